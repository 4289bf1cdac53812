"""Races: one task tried by several attempts at once; the first merged one wins.

`ferrus task add TEXT --race 3` (or --race claude,codex) queues one attempt per agent,
each a normal parallel task that names its race; a run starts a race's attempts
together (a race counts as N tasks), and the first attempt that passes its review and
the merge gate is merged: the others are cancelled, their work saved."""

import collections
import contextlib
import os

from .basics import FerrusError, format_duration, format_timestamp, new_id
from .system import atomic_write
from .config import BUILTIN_AGENTS, canonical_agent
from .store import (APPROVED_STATUSES, CANCELLED_STATUS, ENDED_STATUSES, FAILED_STATUS,
                    QUEUED_STATUS, RUNNING_STATUS, TASKS_DIR, require_utf8)
from .operations import ORCHESTRATOR, _nonblank, _outcome, short_task_id, task_title
from .task_queue import (checked_task_records, op_cancel_task, status_word, task_elapsed,
                         task_records, update_task, write_task_record)
from .sessions import format_cost, read_session_records, usage_summary


RACE_ATTEMPTS_MAX = 64          # as many as a run can work at once ([parallel] max_tasks)


def race_id_of(record):
    """The race a task's record says it is an attempt of, or None."""
    race = record.get("race") if isinstance(record, dict) else None
    return race.get("id") if isinstance(race, dict) and isinstance(race.get("id"), str) \
        else None


def parse_race(spec, config, agent=None):
    """The attempts `--race SPEC` asks for: [(agent or None, model)] — ``N`` attempts by
    ``agent`` (None: [hq.executor]'s), or one per ``AGENT[:MODEL]`` of a comma-separated
    list.  Raises FerrusError naming what is wrong (a number out of range, an agent
    ferrus does not know)."""
    spec = (spec or "").strip()
    known = BUILTIN_AGENTS + tuple(config.agents.custom)
    if spec.isdigit():
        count = int(spec)
        if not 2 <= count <= RACE_ATTEMPTS_MAX:
            raise FerrusError("--race %s: a race has from 2 to %d attempts" % (
                spec, RACE_ATTEMPTS_MAX), "ferrus task add TEXT --race 3")
        if agent is not None:
            agent = agent if agent in known else canonical_agent(agent)
            if agent not in known:
                raise FerrusError("--agent %s is not an agent ferrus knows" % agent,
                                  "use %s (`ferrus agents` lists them)" % ", ".join(known))
        return [(agent, "")] * count
    if agent is not None:
        raise FerrusError("--agent goes with --race N; a list of agents names each "
                          "attempt's agent itself", "ferrus task add TEXT --race %s" % spec)
    attempts = []
    for item in spec.split(","):
        name, _, model = item.strip().partition(":")
        name = name if name in known else canonical_agent(name)
        if name not in known:
            raise FerrusError("--race %s: %s is not an agent ferrus knows" % (
                spec, name or "(nothing)"),
                "use %s (`ferrus agents` lists them; [agents.custom.<name>] adds one), "
                "AGENT:MODEL for a model, or a number for that many attempts by "
                "[hq.executor]" % ", ".join(known))
        attempts.append((name, model.strip()))
    if len(attempts) < 2 or len(attempts) > RACE_ATTEMPTS_MAX:
        raise FerrusError("--race %s: a race has from 2 to %d attempts" % (
            spec, RACE_ATTEMPTS_MAX), "name two agents or more: --race claude,codex")
    return attempts


def op_enqueue_race(store, caller, description, attempts):
    """Put a race in the queue: one task per attempt ((agent or None, model), from
    parse_race), all with the same description, each naming the race — in one
    transaction, so a race is queued whole or not at all."""
    _nonblank(description, "Cannot queue the race: the description is empty.")
    require_utf8(description, "the task description")
    store.require()
    race = new_id("r")
    title = task_title(description)
    now = format_timestamp(store.clock())
    tasks = []
    with store.transaction(caller.agent_id) as tx:
        for number, (agent, model) in enumerate(attempts, 1):
            task = new_id("t")
            while task in tasks:
                task = new_id("t")
            record = {"id": task, "title": title, "status": QUEUED_STATUS, "created_at": now,
                      "origin": {"by": caller.agent_id},
                      "race": {"id": race, "attempt": number, "of": len(attempts)}}
            if agent:
                record["agent"] = agent
            if model:
                record["model"] = model
            folder = store.path(TASKS_DIR, task)
            os.makedirs(folder, exist_ok=True)
            atomic_write(os.path.join(folder, "TASK.md"), description)
            write_task_record(store, task, record)
            tasks.append(task)
        tx.set(tx.state, "enqueue_race", race=race, title=title, tasks=tasks,
               agents=[agent or "" for agent, _ in attempts])
        tx.journal_task_id = ""
    named = ", ".join("%s (%s)" % (task, _attempt_agent(agent, model)) for task, (
        agent, model) in zip(tasks, attempts))
    return _outcome("Race %s queued: %d attempts at %s: %s. `ferrus run --parallel %d` (or "
                    "more) runs them side by side; the first merged wins." % (
                        race, len(tasks), title, named, len(tasks)), None, race=race,
                    tasks=tasks, title=title)


def _attempt_agent(agent, model):
    return "%s%s" % (agent or "[hq.executor]", ":" + model if model else "")


# -- planning: a race's attempts start together ------------------------------------------

def plan_batch(queued, records, free):
    """The tasks to start now, in queue order, given ``free`` slots: a task alone takes
    one, a race's queued attempts start together or wait (it counts as that many tasks),
    and the queue's order holds (nothing behind a waiting race passes it)."""
    groups = collections.OrderedDict()
    for task in queued:
        groups.setdefault(race_id_of(records.get(task)) or task, []).append(task)
    chosen = []
    for members in groups.values():
        if len(chosen) + len(members) > free:
            break
        chosen.extend(members)
    return chosen


def oversized_races(queued, records, max_tasks):
    """{race: its queued attempts} of the races with more attempts queued than a run of
    ``max_tasks`` tasks at a time can start together."""
    races = collections.defaultdict(list)
    for task in queued:
        race = race_id_of(records.get(task))
        if race:
            races[race].append(task)
    return {race: tasks for race, tasks in races.items() if len(tasks) > max_tasks}


class RaceRunner:
    """The parallel runner's part of races (mixed into ParallelRunner, as MergeQueue
    is): a race's attempts are planned together, and the first one merged ends the
    others."""

    def _next_batch(self):
        """plan_batch over the queue and the free slots (worked out again only after a
        commit or a slot freed)."""
        key = (self.store.state_stamp(), self.free_slots())
        if self._race_plan is None or self._race_plan[0] != key:
            queued = self.queued()
            records = {task: record for task, record, _ in
                       checked_task_records(self.store, queued)}
            self._race_plan = (key, plan_batch(queued, records, self.free_slots()))
        return list(self._race_plan[1])

    def _without_oversized_races(self, queued):
        """``queued`` less the attempts of races this run cannot start together (said
        once each; the run then ends with exit 1, and they stay queued)."""
        records = {task: record for task, record, _ in
                   checked_task_records(self.store, queued)}
        oversized = oversized_races(queued, records, self.max_tasks)
        for race, tasks in oversized.items():
            if race not in self.oversized:
                self.oversized[race] = len(tasks)
                self.note("race %s has %d attempts queued, and this run works %d tasks at "
                          "a time: a race's attempts start together, so they stay queued "
                          "(`ferrus run --parallel %d` runs them)" % (
                              race, len(tasks), self.max_tasks, len(tasks)), "error",
                          race=race)
        left_out = {task for tasks in oversized.values() for task in tasks}
        return [task for task in queued if task not in left_out]

    def _settle_races(self):
        """At start-up: a race whose winner a crashed run merged, with attempts still in
        the queue's hands, is decided now."""
        records = task_records(self.store)
        for task, record in records:
            if race_id_of(record) and record.get("status") in APPROVED_STATUSES and any(
                    race_id_of(other) == race_id_of(record) and other.get("status") in (
                        QUEUED_STATUS, RUNNING_STATUS) for _, other in records):
                self._decide_race(task, record)

    def _decide_race(self, winner, record):
        """Attempt ``winner`` of a race is merged (or approved with no change, or
        published): every other attempt loses — a queued, running or failed one is
        cancelled, its work saved and its worktree removed, and is never retried — and
        the journal records every attempt's outcome, time and cost."""
        race = race_id_of(record)
        if not race:
            return
        for task, other in task_records(self.store):
            if task == winner or race_id_of(other) != race or other.get("lost_to"):
                continue
            if other.get("status") in APPROVED_STATUSES:
                continue
            update_task(self.store, ORCHESTRATOR, task, "race_lost", {
                "lost_to": winner, "reason": "attempt %s of race %s was merged first" % (
                    short_task_id(winner), race)}, race=race, winner=winner)
            if other.get("status") not in (QUEUED_STATUS, RUNNING_STATUS, FAILED_STATUS):
                continue
            running = task in self.controllers
            # A running attempt's agents are stopped and its worktree removed by
            # _end_task; the others' kept worktrees go here, their work saved first.
            with contextlib.suppress(FerrusError):
                op_cancel_task(self.store, ORCHESTRATOR, task, remove_worktree=not running)
            if running:
                self._end_task(task, CANCELLED_STATUS, None)
            elif task in self.ended:
                self.ended[task] = CANCELLED_STATUS    # a lost attempt fails no run
        attempts = race_summary(self.store, race)
        update_task(self.store, ORCHESTRATOR, winner, "race_decided", {}, race=race,
                    winner=winner, attempts=attempts)
        self.note("race %s: attempt %s (task %s, %s) was merged first; %s" % (
            race, (record.get("race") or {}).get("attempt"), short_task_id(winner),
            _attempt_agent(record.get("agent"), record.get("model")), "; ".join(
                "%s %s" % (short_task_id(a["task"]), describe_attempt(a))
                for a in attempts if a["task"] != winner) or "it ran alone"),
            event="race_decided", race=race, winner=winner, attempts=attempts)


# -- what a race did: every attempt's outcome, time and cost --------------------------------

def race_summary(store, race, now=None):
    """One dict per attempt of ``race`` (in attempt order): task, attempt, agent, model,
    status, lost_to, secs (from its start to its end, or now), tokens, cost_usd (summed
    over the sessions that reported one; None when none did), cost_unknown (how many
    did not) and sessions."""
    now = now or store.clock()
    sessions = read_session_records(store)
    attempts = []
    for task, record in task_records(store):
        if race_id_of(record) != race:
            continue
        mine = [r for r in sessions if r.get("task_id") == task]
        used = usage_summary(mine)
        agent = record.get("agent") or next((r.get("agent") for r in reversed(mine)
                                             if r.get("role") == "executor"), None)
        secs = task_elapsed(record, now) if record.get("started_at") else None
        attempts.append({
            "task": task, "attempt": (record.get("race") or {}).get("attempt"),
            "agent": agent, "model": record.get("model") or "",
            "status": record.get("status"), "lost_to": record.get("lost_to"),
            "secs": round(secs, 1) if secs is not None else None,
            "tokens": used["input_tokens"] + used["output_tokens"],
            "cost_usd": used["cost_usd"], "cost_unknown": used["cost_unknown"],
            "sessions": used["sessions"]})
    return sorted(attempts, key=lambda a: a["attempt"] or 0)


def describe_attempt(attempt):
    """``cancelled (lost), 41s, $0.0030``: an attempt's outcome, time and cost."""
    outcome = status_word(attempt.get("status"))
    if attempt.get("lost_to") and attempt.get("status") != CANCELLED_STATUS:
        outcome += ", lost"
    elif attempt.get("lost_to"):
        outcome += " (lost)"
    parts = [outcome]
    if attempt.get("secs") is not None:
        parts.append(format_duration(attempt["secs"]))
    if attempt.get("sessions"):
        parts.append(format_cost(attempt))
    return ", ".join(parts)


def race_outcome(attempts):
    """A race's state in words, from its attempts (race_summary)."""
    won = next((a for a in attempts if a.get("status") in APPROVED_STATUSES), None)
    if won is not None:
        return "won by attempt %s (%s): %s" % (won.get("attempt"), short_task_id(won["task"]),
                                               status_word(won["status"]))
    if any(a.get("status") not in ENDED_STATUSES for a in attempts):
        return "running" if any(a.get("status") == RUNNING_STATUS for a in attempts) \
            else "queued"
    failed = sum(1 for a in attempts if a.get("status") == FAILED_STATUS)
    return "no winner (%d failed, %d cancelled)" % (failed, len(attempts) - failed)


def group_race_rows(store, rows, now=None):
    """``rows`` (of `ferrus tasks`) with a race's attempts together, where its first
    attempt was: that one carries "race_heading" (the race, its title and outcome), each
    attempt "race_attempt" (its number, outcome, time and cost).  Also returns the race
    summaries, for --json."""
    by_race = collections.OrderedDict()
    for row in rows:
        race = race_id_of(row)
        if race:
            by_race.setdefault(race, []).append(row)
    if not by_race:
        return rows, []
    races, summaries = {}, {}
    for race, members in by_race.items():
        summaries[race] = {a["task"]: a for a in race_summary(store, race, now)}
        races[race] = members
    grouped, placed = [], set()
    for row in rows:
        race = race_id_of(row)
        if not race:
            grouped.append(row)
            continue
        if race in placed:
            continue
        placed.add(race)
        attempts = list(summaries[race].values())
        for index, member in enumerate(races[race]):
            member = dict(member)
            attempt = summaries[race].get(member["id"], {})
            member["race_attempt"] = "attempt %s of %s: %s" % (
                attempt.get("attempt", "?"), (member.get("race") or {}).get("of", "?"),
                describe_attempt(attempt) if attempt else status_word(member.get("status")))
            if index == 0:
                member["race_heading"] = "race %s: %s — %s" % (
                    race, member.get("title") or "", race_outcome(attempts))
            grouped.append(member)
    return grouped, [{"race": race, "title": races[race][0].get("title"),
                      "outcome": race_outcome(list(summaries[race].values())),
                      "attempts": list(summaries[race].values())} for race in races]
