"""CLI views: `status`, `log`, `sessions`, `usage`, `diff`, `tasks` — read-only.

Each command reads the store, the journal and the session records and prints them
(plain lines, or JSON with ``--json``); none of them changes ``.ferrus/``."""

import collections
import contextlib
import dataclasses
import datetime as _dt
import json
import os
import re
import sys
import time

from .basics import (FerrusError, UsageError, compact_json, format_duration,
                     format_timestamp, json_for_terminal, parse_timestamp, say,
                     terminal_safe, utc_now)
from .system import read_text
from .config import NO_CHECKS_WARNING
from .task_machine import S, failure_summary
from .store import (APPROVED_STATUSES, CANCELLED_STATUS, ENDED_STATUSES, MERGED_STATUS,
                    PUBLISHED_STATUS, QUEUED_STATUS, RUNNING_STATUS, Store, TASKS_DIR,
                    TASK_RECORD_FILE, UNCHANGED_STATUS, is_story, journal_story,
                    load_task_record)
from .git import describe_base
from .operations import HUMAN, confirmation_summary, describe_task_commit, short_task_id
from .work import op_rotate_journal, status_data
from .task_queue import (DAMAGED_WORD, count_statuses, foreground_store, foreground_task,
                         last_task_events, op_task_diff, queued_order, require_task_id,
                         resolve_task_ref, status_word, task_elapsed, task_rows,
                         task_state_word)
from .sessions import (STATUS_SESSIONS_SHOWN, compact_count, describe_orchestrator,
                       describe_session, first_lines, format_usage, read_session_records,
                       session_state, usage_summary)
from .orchestrator import running_orchestrator
from .parallel import live_parallel_run
from .race import group_race_rows
from .hq_board import _STATE_COLORS, _color_enabled, _paint, format_event, paint_diff
def cmd_status(args, root):
    store = Store(root).require()
    data = store.read_state()
    # While STATE.json mirrors a parallel task, that task's own files and worktree are
    # what the rows below describe (the checkout's would be another task's, or none).
    view = foreground_store(store)
    record, damaged = load_task_record(store.dir, view.task) if view.task else ({}, None)
    now = store.clock()
    info = status_data(store, data, now)
    info.pop("message")
    config, config_error, notes = _status_config(store)
    orchestrator = running_orchestrator(store)
    sessions = read_session_records(store)
    task_records = [r for r in sessions if data.task_id and r.get("task_id") == data.task_id]
    queue = status_task_rows(store, sessions)
    if args.json:
        info.update(tasks=queue, parallel_task=view.task, orchestrator=orchestrator,
                    usage=usage_summary(task_records),
                    sessions=[session_brief(r) for r in task_records],
                    lease_holder=info["claimed_by"])
        if config:
            info["limits"] = dataclasses.asdict(config.limits)
        info.update(config_error=config_error.full_text() if config_error else None,
                    config_warnings=notes)
        print(json.dumps(info, indent=2))
        return 0
    color = _color_enabled(sys.stdout)
    rows = (_status_task_rows(data, view, record, damaged, info, now, color)
            + _status_counter_rows(data, config)
            + _status_attention_rows(data, view)
            + _status_lease_rows(store, data)
            + _status_spec_rows(data, info, orchestrator)
            + _status_usage_rows(data, task_records)
            + [("rev", str(data.rev))]
            + _status_config_rows(config_error, notes, color))
    width = max(len(label) for label, _ in rows)
    for label, value in rows:     # these rows carry ferrus's own colour codes, made safe above
        print("%s  %s" % (label.rjust(width),
                          value if label in ("state", "config") else terminal_safe(value)))
    if data.state == S.AWAITING_CONFIRMATION:
        print("\n" + terminal_safe(confirmation_summary(view, data)))
    waiting = waiting_for_the_next_run(store, queue)
    for line in describe_queue(queue) + ([waiting] if waiting else []):
        say(line)
    return 0


def _status_config(store):
    """(config or None, the error that made it None, warnings about it)."""
    try:
        config = store.config()
    except FerrusError as err:
        # Defaults would hide the problem: say that the limits are unknown instead.
        return None, err, []
    notes = []
    if not config.checks.commands:
        notes.append(NO_CHECKS_WARNING)
    if config.hq_problem:
        notes.append(config.hq_problem.message)
    return config, None, notes


def _status_task_rows(data, view, record, damaged, info, now, color):
    """The state (coloured), the task, its age and where it stands in git."""
    state = _paint(data.state.value, _STATE_COLORS.get(data.state.value), color)
    if info["seconds_in_state"] is not None:
        state += "  (for %s)" % format_duration(info["seconds_in_state"])
    rows = [("state", state)]
    if data.paused_state:
        rows.append(("paused from", data.paused_state.value))
    rows.append(("task", (data.task_id or "-") + (
        "  (parallel task, %s; `ferrus tasks` lists every task)" % (
            "its %s is damaged: `ferrus doctor --fix` repairs it" % TASK_RECORD_FILE
            if damaged else
            status_word(record["status"]) if record.get("status") in APPROVED_STATUSES else
            "in its worktree %s" % record["worktree"] if record.get("worktree") and
            os.path.isdir(record["worktree"]) else record.get("status") or "queued")
        if view.task else "")))
    if data.task_started_at:
        with contextlib.suppress(ValueError):
            rows.append(("task age", format_duration(
                (now - parse_timestamp(data.task_started_at)).total_seconds())))
    if view.task and record.get("status") in (MERGED_STATUS, UNCHANGED_STATUS,
                                              PUBLISHED_STATUS, CANCELLED_STATUS):
        # Its branch and worktree are gone: the base would name a branch that is no more.
        merged = record.get("merged_commit") or ""
        rows.append(("git", "merged into %s%s; its worktree and branch were removed%s" % (
            record.get("target") or "the target", " at %s" % merged[:12] if merged else "",
            " (`git show %s` shows what it changed)" % merged[:12] if merged else "")
            if record["status"] == MERGED_STATUS else
            "approved, and it changed nothing: nothing was merged; its worktree and branch "
            "were removed" if record["status"] == UNCHANGED_STATUS else
            "published as %s's branch %s%s; its worktree was removed" % (
                (record.get("published") or {}).get("remote"),
                (record.get("published") or {}).get("branch"),
                " (pull request %s)" % record["published"]["pull_request"]
                if (record.get("published") or {}).get("pull_request") else "")
            if record["status"] == PUBLISHED_STATUS else
            "cancelled; its worktree and branch were removed"))
    elif data.task_base:
        rows.append(("git base", describe_base(data.task_base) + " (`ferrus diff` shows the "
                                                                "changes since)"))
    return rows


def _status_counter_rows(data, config):
    if config:
        return [("check retries", "%d/%d" % (data.check_retries,
                                             config.limits.max_check_retries)),
                ("review cycles", "%d/%d" % (data.review_cycles,
                                             config.limits.max_review_cycles))]
    return [("check retries", "%d (limit unknown: ferrus.toml is invalid)" % data.check_retries),
            ("review cycles", "%d (limit unknown: ferrus.toml is invalid)" % data.review_cycles)]


def _status_attention_rows(data, view):
    """What needs a human or tells how the task ended: the failure, a question, the
    reviewer's approval waiting for a word, the commit [git] made."""
    rows = []
    if data.failure_reason:
        rows.append(("failure", failure_summary(data.failure_reason)))
    if data.state == S.AWAITING_HUMAN:
        # Whoever comes back later must see what was asked, not only that something was.
        asked = first_lines(view.read_file("QUESTION.md"), 4)
        rows += [("question" if index == 0 else "", terminal_safe(line))
                 for index, line in enumerate(asked or ["(QUESTION.md is empty)"])]
        rows.append(("answer", "in HQ (`ferrus`), or `ferrus run --parallel N` in a terminal"
                     if view.task else
                     "in HQ (`ferrus`), or `ferrus run --resume` in a terminal"))
    elif data.state == S.AWAITING_CONFIRMATION:
        named = " --task %s" % short_task_id(view.task) if view.task else ""
        rows.append(("your word", "the reviewer approved: `ferrus approve%s`, or `ferrus "
                                  "reject%s NOTES` (`ferrus approve%s` shows the summary first)"
                     % (named, named, named)))
    if data.task_commit:
        said = describe_task_commit(data.task_commit).splitlines()
        rows += [("git commit" if index == 0 else "", line) for index, line in enumerate(said)]
    return rows


def _status_lease_rows(store, data):
    left = store.lease_seconds_left(data)
    if left > 0:
        return [("lease", "%s, expires in %s (%s)" % (data.claimed_by, format_duration(left),
                                                    data.lease_until))]
    if data.claimed_by:
        return [("lease", "expired (last holder %s)" % data.claimed_by)]
    return [("lease", "none")]


def _status_spec_rows(data, info, orchestrator):
    """The milestone the task implements, the spec selection, capacity, orchestrator."""
    rows = []
    if data.task_milestone:
        # The note says what approval does to the box, or did: an approved task's
        # milestone is already ticked, a failed one's never will be by this task.
        effect = {S.COMPLETE: "ticked when it was approved",
                  S.FAILED: "not ticked: the task failed"}.get(data.state, "approving ticks it")
        rows.append(("task from", "milestone %s of %s (%s)"
                     % (data.task_milestone, data.task_spec, effect)))
    if data.selected_spec:
        rows.append(("spec", data.selected_spec))
        rows.append(("milestone", data.selected_milestone or "(none left)"))
    else:
        rows.append(("spec", "none selected"))
    capacity = info.get("capacity")
    if capacity:
        rows.append(("capacity", "%s (%s%s)%s" % (
            capacity["tier"], capacity["action"],
            ", %s" % capacity["signal"] if capacity["signal"] else "",
            " — checkpoint: raise [capacity] limits or /continue in HQ"
            if capacity["checkpoint"] else "")))
    rows.append(("orchestrator", describe_orchestrator(orchestrator) if orchestrator else
                 "none running"))
    return rows


def _status_usage_rows(data, task_records):
    if not task_records:
        return []
    rows = [("usage", format_usage(usage_summary(task_records)))]
    shown = task_records[-STATUS_SESSIONS_SHOWN:]
    if len(shown) < len(task_records):
        rows.append(("sessions", "%d earlier: `ferrus sessions --task %s`" % (
            len(task_records) - len(shown), data.task_id)))
    rows.extend(("session", describe_session(record)) for record in shown)
    return rows


def _status_config_rows(config_error, notes, color):
    rows = []
    if config_error:
        rows.append(("config", _paint("error: " + terminal_safe(config_error.message), "1;31",
                                      color)))
        hint = config_error.hint or ""
        if "ferrus doctor" not in hint:
            hint += " (`ferrus doctor` lists every problem)"
        rows.append(("", "fix: %s" % hint))
    for note in notes:
        rows.append(("config", _paint("warning: " + terminal_safe(note), "33", color)))
    return rows


# `ferrus status` sums the queue up: counts by status, every task at work, the next few
# queued and the last few ended (a queue of a thousand tasks is a dozen lines); the rest
# are `ferrus tasks`'.
STATUS_ENDED_TASKS_SHOWN = 5
STATUS_QUEUED_TASKS_SHOWN = 5
STATUS_ACTIVE_TASKS_SHOWN = 20


def status_task_rows(store, sessions):
    """The queue for `ferrus status`: task_rows with each task's short id, its executor's
    agent (from its session ``sessions`` when the task did not name one) and last event
    (its newest journal entry that tells what happened, as an object)."""
    rows = sorted(task_rows(store), key=queued_order)
    if not rows:
        return rows
    last = last_task_events(store, [row["id"] for row in rows])
    executors = {record.get("task_id"): record.get("agent") for record in sessions
                 if record.get("role") == "executor"}
    now = store.clock()
    for row in rows:
        row["agent"] = row.get("agent") or executors.get(row["id"])
        entry = last.get(row["id"])
        row["short_id"] = short_task_id(row["id"])
        row["elapsed_secs"] = task_elapsed(row, now)
        row["last_event"] = None if entry is None else {
            key: entry.get(key) for key in ("seq", "time", "event", "from", "to", "actor")}
    return rows


def waiting_for_the_next_run(store, rows):
    """The line saying which running worktree (or place) tasks no `ferrus run --parallel`
    works now (one that stopped left them where they were: they go on in the next run),
    or "" while a run works the queue or none is left so."""
    left = [row for row in rows if row.get("status") == RUNNING_STATUS and not
            row.get("problem") and (row.get("worktree") or row.get("place"))]
    if not left or live_parallel_run(store) is not None:
        return ""
    return ("no run works the queue now: %s wait%s for the next `ferrus run --parallel`, "
            "which goes on with %s where %s stopped" % (
                ", ".join("%s (%s)" % (row.get("short_id") or short_task_id(row["id"]),
                                       task_state_word(row)) for row in left[:5])
                + (" and %d more" % (len(left) - 5) if len(left) > 5 else ""),
                "s" if len(left) == 1 else "", "it" if len(left) == 1 else "them",
                "it" if len(left) == 1 else "they"))


def describe_queue(rows):
    """The lines `ferrus status` ends with: the counts by status, then one line per task
    (short id, state, agent, age, title; the worktree of a running one) for those at work,
    the damaged, the next few queued and the last few ended, the others counted."""
    if not rows:
        return []

    def kind(row):
        if row.get("problem"):
            return DAMAGED_WORD
        return "ended" if row.get("status") in ENDED_STATUSES else row.get("status")
    lines = ["", "tasks  %s (`ferrus tasks` lists them)" % count_statuses(
        DAMAGED_WORD if row.get("problem") else row.get("status") for row in rows)]
    groups = collections.defaultdict(list)
    for row in rows:
        groups[kind(row)].append(row)
    shown, more = set(), []
    # (group, how many lines, the newest rather than the oldest, how the rest are counted)
    for group, limit, newest, rest in (
            ("ended", STATUS_ENDED_TASKS_SHOWN, True, "  … %d ended earlier"),
            (RUNNING_STATUS, STATUS_ACTIVE_TASKS_SHOWN, False, "  … %d more running"),
            (DAMAGED_WORD, STATUS_ENDED_TASKS_SHOWN, False, "  … %d more damaged"),
            (QUEUED_STATUS, STATUS_QUEUED_TASKS_SHOWN, False, "  … %d more queued")):
        members = groups.pop(group, [])
        chosen = members[-limit:] if newest else members[:limit]
        shown.update(id(row) for row in chosen)
        if len(members) > len(chosen):
            more.append(rest % (len(members) - len(chosen)))
    for leftover in groups.values():       # a status no group above names: each is shown
        shown.update(id(row) for row in leftover)
    if more and more[0].endswith("ended earlier"):
        lines.append(more.pop(0))           # before the lines, as they come after them
    for row in rows:
        if id(row) not in shown:
            continue
        age = format_duration(row["age_secs"]) if row.get("age_secs") is not None else "?"
        lines.append("  %-6s %-13s %-10s %7s  %s" % (
            row["short_id"], task_state_word(row), (row.get("agent") or "-")[:10], age,
            row.get("title", "")))
        if row.get("status") == RUNNING_STATUS and row.get("worktree"):
            lines.append("  %-6s worktree %s%s" % ("", row["worktree"], " (branch %s)" % (
                row["branch"]) if row.get("branch") else ""))
        elif row.get("status") == RUNNING_STATUS and row.get("place"):
            lines.append("  %-6s at place %s" % ("", row["place"]))
    return lines + more


def cmd_log(args, root):
    store = Store(root).require()
    everything = getattr(args, "all", False)
    task = resolve_task_ref(store, args.task) if getattr(args, "task", None) else None

    def wanted(entry):
        return (everything or is_story(entry)) and (task is None or
                                                    entry.get("task_id") == task)
    if args.n is None:
        entries = (e for e in store.journal_entries() if wanted(e))
    else:
        entries = journal_story(store, args.n, everything=everything, task=task)
    color = _color_enabled(sys.stdout)

    def line(entry):
        return json_for_terminal(compact_json(entry)) if args.json else format_event(entry, color)
    last = 0
    for entry in entries:
        print(line(entry))
        last = entry["seq"]
    if not last and not args.follow and not args.json:
        print("(the journal is empty: nothing has happened yet)" if not store.last_journal_seq()
              else "(no entry about task %s%s)" % (task, "" if everything else
                                                    "; `--all` adds the bookkeeping ones")
              if task else
              "(nothing but bookkeeping entries lately; `ferrus log --all` shows them)")
    if not args.follow:
        return 0
    last = max(last, store.last_journal_seq())
    sys.stdout.flush()
    try:
        while True:
            stamp = store.state_stamp()
            store.wait_for_change(stamp, time.monotonic() + 1.0, poll=0.05)
            for entry in store.read_journal(after_seq=last):
                if wanted(entry):
                    print(line(entry))
                last = entry["seq"]
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 0


def session_brief(record):
    """A record without its prompt and argv, for listings."""
    brief = {key: value for key, value in record.items() if key not in ("prompt", "argv")}
    brief["state"] = session_state(record)
    return brief


def parse_since(text, now):
    """--since: a duration back from now (90m, 12h, 7d, 2w) or a date or timestamp."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if match:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match.group(2)]
        return now - _dt.timedelta(seconds=float(match.group(1)) * unit)
    with contextlib.suppress(ValueError):
        return parse_timestamp(text.strip())
    with contextlib.suppress(ValueError):
        day = _dt.datetime.strptime(text.strip(), "%Y-%m-%d")
        return day.replace(tzinfo=_dt.datetime.now().astimezone().tzinfo)   # local midnight
    raise UsageError("--since %s is neither a duration nor a date" % json.dumps(text),
                     "use e.g. --since 24h, --since 7d, --since 2026-05-01 or an RFC 3339 time")


def _find_session(records, ref):
    matches = [r for r in records if r["id"] == ref] or \
        [r for r in records if r["id"].startswith(ref)]
    if not matches:
        raise FerrusError("no session record matches %s" % json.dumps(ref),
                          "`ferrus sessions` lists them")
    if len(matches) > 1:
        raise FerrusError("%s matches %d session records" % (json.dumps(ref), len(matches)),
                          "give more of the id")
    return matches[0]


def cmd_sessions(args, root):
    store = Store(root).require()
    records = read_session_records(store)
    if args.id:
        record = _find_session(records, args.id)
        if args.json:
            print(json.dumps(dict(record, state=session_state(record)), indent=2))
            return 0
        for key in ("id", "slot", "role", "agent", "model", "task_id", "pipeline", "started_at",
                    "ended_at", "outcome", "exit_code", "note", "pid", "tool_calls",
                    "input_tokens", "output_tokens", "cost_usd", "agent_session", "log"):
            if record.get(key) not in (None, ""):
                print(terminal_safe("%14s  %s" % (key, record[key])))
        print(terminal_safe("%14s  %s" % ("state", session_state(record))))
        print(terminal_safe("%14s  %s" % ("argv", " ".join(record.get("argv") or []))))
        print("        prompt:")
        for line in str(record.get("prompt") or "(none: the agent started without one)"
                        ).splitlines():
            print(terminal_safe("    " + line))
        return 0
    if args.task:
        task = resolve_task_ref(store, args.task)
        records = [r for r in records if r.get("task_id") == task]
    if args.pipeline:
        records = [r for r in records if str(r.get("pipeline") or "").startswith(args.pipeline)]
    if args.n is not None:
        records = records[-args.n:] if args.n > 0 else []
    if args.json:
        print(json.dumps([dict(r, state=session_state(r)) for r in records], indent=2))
        return 0
    if not records:
        print("(no agent session is recorded%s)" % (" for that filter" if args.task or
                                                    args.pipeline else " yet"))
        return 0
    for record in records:
        where = "task %s" % record["task_id"] if record.get("task_id") else \
            "pipeline %s" % record["pipeline"] if record.get("pipeline") else "no task"
        print(terminal_safe("%s  [%s]  %s" % (record["id"], where, describe_session(record))))
    print("(`ferrus sessions ID` shows one session with its argv and prompt)")
    return 0


def _usage_groups(records, key):
    groups = collections.OrderedDict()
    for record in records:
        name = key(record)
        if name:
            groups.setdefault(name, []).append(record)
    return [dict(usage_summary(group), name=name, first_started=group[0].get("started_at"),
                 last_started=group[-1].get("started_at"))
            for name, group in groups.items()]


def _started_since(record, since):
    try:
        return parse_timestamp(record.get("started_at")) >= since
    except ValueError:
        return False


def cmd_usage(args, root):
    store = Store(root).require()
    records = read_session_records(store)
    since = None
    if args.since:
        since = parse_since(args.since, utc_now())
        records = [r for r in records if _started_since(r, since)]
    report = {
        "since": format_timestamp(since) if since else None,
        "total": usage_summary(records),
        "tasks": _usage_groups(records, lambda r: r.get("task_id")),
        "pipelines": _usage_groups(records, lambda r: r.get("pipeline")),
        "agents": _usage_groups(records, lambda r: "%s%s" % (
            r.get("agent") or "?", " (%s)" % r["model"] if r.get("model") else "")),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("usage %s" % ("since %s" % report["since"] if since else "of every recorded session"))
    print(terminal_safe("  total  %s" % format_usage(report["total"])))
    for title, key in (("by task", "tasks"), ("by pipeline run", "pipelines"),
                       ("by agent", "agents")):
        if report[key]:
            print(title)
            width = max(len(group["name"]) for group in report[key])
            for group in report[key]:
                print(terminal_safe("  %s  %s" % (group["name"].ljust(width),
                                                  format_usage(group))))
    if report["total"]["cost_unknown"] and report["total"]["sessions"]:
        print("(cost is known only where the agent CLI reports it, as Claude Code does; the "
              "tokens of the others are counted, their cost is not)")
    return 0


def cmd_diff(args, root):
    store = Store(root).require()
    # Without --task: the parallel task the checkout's STATE.json mirrors, if it does.
    task = require_task_id(store, args.task) if args.task else foreground_task(store)
    paths = []
    for path in args.paths:
        # Typed in a shell, a path is relative to where the user stands.
        relative = os.path.relpath(os.path.abspath(path), store.root)
        if relative == ".." or relative.startswith(".." + os.sep) or os.path.isabs(relative):
            raise UsageError("%s is outside the project (%s)" % (path, store.root),
                             "name files or folders inside the project")
        paths.append(relative.replace(os.sep, "/"))
    outcome = op_task_diff(store, task, args.stat, paths or None)
    if args.json:
        print(json_for_terminal(compact_json(outcome.data)))
        return 0 if outcome.data.get("available") else 1
    if not outcome.data.get("available"):
        raise FerrusError("no diff: %s" % outcome.data["reason"], outcome.data.get("hint"))
    print(paint_diff(outcome.text, _color_enabled(sys.stdout)))
    return 0


def task_table(rows):
    """The lines of `ferrus tasks`: a heading, then id, state, agent, age and title of
    each row, the columns as wide as their longest entry (a state such as "approved (no
    change)" or "AwaitingConfirmation" never pushes the rest of its line aside)."""
    cells = [(row["id"], task_state_word(row), row.get("agent") or "-",
              format_duration(row["age_secs"]) if row.get("age_secs") is not None else "?",
              row["title"]) for row in rows]
    heading = ("TASK", "STATE", "AGENT", "AGE", "TITLE")
    widths = [max(len(cell[column]) for cell in cells + [heading]) for column in range(4)]
    pattern = "%%-%ds %%-%ds %%-%ds %%%ds  %%s" % tuple(widths)
    return [pattern % heading] + [pattern % cell for cell in cells], widths[0]


# `ferrus tasks` without --all: the tasks in the queue's hands, and the ended ones that
# ended in the last RECENT_TASK_SECS — at most RECENT_TASKS_SHOWN of them, the newest.
RECENT_TASK_SECS = 24 * 3600
RECENT_TASKS_SHOWN = 20


def recent_task_rows(rows, now):
    """(rows shown, ended rows left out): every queued and running task, and the newest
    RECENT_TASKS_SHOWN of those that ended in the last RECENT_TASK_SECS."""
    ended = []
    for row in rows:
        if row.get("status") not in ENDED_STATUSES:
            continue
        try:
            age = (now - parse_timestamp(row.get("ended_at"))).total_seconds()
        except (ValueError, TypeError):
            age = None              # a record that never said when it ended: not recent
        if age is not None and age <= RECENT_TASK_SECS:
            ended.append(row)
    recent = {row["id"] for row in sorted(ended, key=lambda r: r.get("ended_at") or "")
              [-RECENT_TASKS_SHOWN:]}
    shown = [row for row in rows if row.get("status") not in ENDED_STATUSES
             or row["id"] in recent]
    return shown, len(rows) - len(shown)


def full_task_title(store, task, title):
    """A task's title uncut: the first line of its TASK.md (``title`` when unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        text = read_text(os.path.join(store.path(TASKS_DIR, task), "TASK.md"))
        return next((line.strip().lstrip("#").strip() for line in text.splitlines()
                     if line.strip().lstrip("#").strip()), title)
    return title


def tasks_with_usage(store, rows, full_titles=True):
    """`ferrus tasks`'s rows: ``rows`` of task_rows with each task's tokens, cost (None
    while a session's cost is unknown) and executor agent (from its sessions when its
    record names none); with ``full_titles`` (`--json`, the board) its title uncut."""
    by_task = collections.defaultdict(list)
    for record in read_session_records(store):
        by_task[record.get("task_id")].append(record)
    for row in rows:
        records = by_task.get(row["id"], [])
        used = usage_summary(records)
        row["tokens"] = used["input_tokens"] + used["output_tokens"]
        row["cost_usd"] = None if used["cost_unknown"] else used["cost_usd"]
        row["agent"] = row.get("agent") or next(
            (r.get("agent") for r in reversed(records) if r.get("role") == "executor"), None)
        if full_titles:
            row["title"] = full_task_title(store, row["id"], row["title"])
    return rows


def cmd_tasks(args, root):
    store = Store(root).require()
    rows = task_rows(store)
    older = 0
    if not args.all:
        rows, older = recent_task_rows(rows, store.clock())
    tasks_with_usage(store, rows, full_titles=args.json)
    if args.json:
        for row in rows:
            row["title"] = full_task_title(store, row["id"], row["title"])
        races = group_race_rows(store, rows)[1]
        print(json_for_terminal(compact_json(dict({"tasks": rows, "older": older},
                                                  **({"races": races} if races else {})))))
        return 0
    if not rows:
        say("No task in the queue%s: `ferrus task add TEXT` queues one." % (
            " and none ended in the last day (%d older: `ferrus tasks --all`)" % older
            if older else ""))
        return 0
    rows, _ = group_race_rows(store, rows)
    lines, indent = task_table(rows)
    say(lines[0])
    for row, line in zip(rows, lines[1:]):
        if row.get("race_heading"):
            say(row["race_heading"])
        if row.get("tokens"):
            line += "  (%s tok)" % compact_count(row["tokens"])
        say(line)
        if row.get("race_attempt"):
            say("%*s %s" % (indent, "", row["race_attempt"]))
        if row.get("worktree") and row["status"] == RUNNING_STATUS:
            say("%*s worktree %s" % (indent, "", row["worktree"]))
        elif row.get("place") and row["status"] == RUNNING_STATUS:
            say("%*s at place %s" % (indent, "", row["place"]))
        elif row.get("status") == MERGED_STATUS and row.get("merged_commit"):
            say("%*s merged at %s (`ferrus diff --task %s`)%s" % (
                indent, "", row["merged_commit"][:12], short_task_id(row["id"]),
                "; it ran at place %s" % row["place"] if row.get("place") else ""))
        elif row.get("status") == PUBLISHED_STATUS and row.get("published"):
            published = row["published"]
            say("%*s published as %s's branch %s%s" % (
                indent, "", published.get("remote"), published.get("branch"),
                ", pull request %s" % published["pull_request"]
                if published.get("pull_request") else ""))
        elif row.get("place"):
            say("%*s ran at place %s" % (indent, "", row["place"]))
    if older:
        say("… and %d older ended task%s (`ferrus tasks --all` lists them)" % (
            older, "" if older == 1 else "s"))
    waiting = waiting_for_the_next_run(store, rows)
    if waiting:
        say(waiting[0].upper() + waiting[1:] + ".")
    return 0


def cmd_journal(args, root):
    store = Store(root).require()
    say(op_rotate_journal(store, HUMAN).text)
    return 0
