"""HQ's views: colours, event lines, the task board, the command table.

Colours, events as lines, the task board, and the table of HQ commands."""

import argparse
import contextlib
import os
import threading
import time

from .basics import (FerrusError, UsageError, compact_json, format_duration,
                     parse_timestamp, terminal_safe)
from .session_machine import CONTINUE
from .gates import _is_phase, phase_words
from .store import ENDED_STATUSES, QUEUED_STATUS, RUNNING_STATUS, is_story
from .operations import JOURNAL_TEXT_EVENTS, short_task_id
from .task_queue import (DAMAGED_WORD, count_statuses, describe_task_event,
                         last_task_events, queued_order, queued_task_ids, task_elapsed,
                         task_rows, task_state_word)
from .sessions import HqMessage
from .pipelines import _pipeline_result, pipeline_command


def _color_enabled(stream):
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


_STATE_COLORS = {"Idle": "2", "Executing": "36", "Addressing": "33", "Consultation": "35",
                 "AwaitingHuman": "1;33", "AwaitingConfirmation": "1;33", "Reviewing": "34",
                 "Complete": "32", "Failed": "1;31"}


def _paint(text, code, enabled):
    return "\033[%sm%s\033[0m" % (code, text) if enabled and code else text


def _diff_line_kind(line):
    """How a line of ``ferrus diff`` output is coloured: diff+, diff-, diff@, diffmeta or None."""
    if line.startswith(("+++ ", "--- ", "diff --git ")):
        return "diffmeta"
    if line.startswith("+"):
        return "diff+"
    if line.startswith("-"):
        return "diff-"
    if line.startswith("@@"):
        return "diff@"
    if line.startswith(("warning:", "note:", "[ferrus:")):
        return "warning"
    return None


_DIFF_COLORS = {"diff+": "32", "diff-": "31", "diff@": "36", "diffmeta": "1", "warning": "33"}


def paint_diff(text, color):
    """``ferrus diff`` output made safe for a terminal, coloured when ``color``."""
    return "\n".join(_paint(line, _DIFF_COLORS.get(_diff_line_kind(line)), color)
                     for line in terminal_safe(text).split("\n"))


def format_event(entry, color=False):
    """One journal entry as a readable line."""
    when = entry.get("time", "")
    with contextlib.suppress(ValueError, TypeError):
        when = parse_timestamp(when).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    # Every field came from a file an agent may have shaped: shown, never obeyed.
    moved = entry.get("from") != entry.get("to")
    change = ("%s → %s" % (terminal_safe(entry.get("from")), _paint(
        terminal_safe(entry.get("to")), _STATE_COLORS.get(entry.get("to")), color))) \
        if moved else terminal_safe(entry.get("to"))
    detail = dict(entry.get("detail") or {})
    detail.pop("said", None)        # the text itself is shown by HQ and `ferrus run`
    if entry.get("event") in JOURNAL_TEXT_EVENTS:
        detail.pop("text", None)    # notes and summaries: in `ferrus log --json`
    if entry.get("event") == "phase" and _is_phase(detail.get("phase")):
        # A parallel run's step, in words; its GateRecord is in `ferrus log --json`.
        change = "the run is now %s" % phase_words(detail["phase"])
        gate = "capacity %s, %s" % (detail.get("tier"), detail.get("action")) \
            if detail.get("tier") else ""
        if detail.get("signal") and detail.get("action") != CONTINUE:
            gate += " (%s)" % detail["signal"]
        detail = {"": gate} if gate else {}
    if isinstance(detail.get("checks"), list):
        # Each command's result in brief; its log path is in `ferrus log --json`.
        detail["checks"] = ",".join("%s:%s" % (c.get("command"), c.get("status"))
                                    for c in detail["checks"] if isinstance(c, dict))
    extra = " ".join(("%s=%s" % (k, v) if k else v) if isinstance(v, (str, int, float))
                     else "%s=%s" % (k, compact_json(v)) for k, v in detail.items()
                     if v is not None)
    return "%s  #%-5s %-22s %-16s %s%s" % (
        terminal_safe(when), entry.get("seq"), terminal_safe(entry.get("actor")),
        terminal_safe(entry.get("event")), change, "  " + terminal_safe(extra) if extra else "")


# HQ follows runs in background threads; one per run, however often it is asked.
_HQ_FOLLOWED = {}


def hq_cmd_pipeline(shell, rest):
    """/pipeline list|init|run NAME TOPIC|status [RUN]|resume|continue|cancel RUN|retry RUN W"""
    usage = UsageError("usage: /pipeline list | init | run NAME TOPIC | status [RUN] | "
                       "resume RUN | continue RUN | retry RUN WORKER | cancel RUN")
    words = rest.split()
    if not words:
        raise usage
    args = argparse.Namespace(pipeline_command=words[0], json=False, ref=None)
    arities = {"list": (0,), "init": (0,), "status": (0, 1), "resume": (1,), "continue": (1,),
               "cancel": (1,), "retry": (2,)}
    if words[0] == "run" and len(words) >= 3:
        args.name, args.topic = words[1], rest.split(None, 2)[2:]
    elif len(words) - 1 in arities.get(words[0], ()):
        args.ref = words[1] if len(words) > 1 else None
        args.worker = words[2] if len(words) > 2 else None
    else:
        raise usage

    def follow(orchestrator, name):
        thread = _HQ_FOLLOWED.get(name)
        if thread is not None and thread.is_alive():
            shell.write("run %s is already being followed" % name)
            return 0

        def loop():
            orchestrator.emit = shell.show
            try:
                outcome = orchestrator.drive(name, poll_interval=0.25,
                                             should_stop=lambda: shell.done)
            except FerrusError as err:
                shell.show(HqMessage("error", "pipeline %s: %s" % (name, err.full_text())))
                return
            _pipeline_result(outcome, lambda text: shell.show(HqMessage("info", text)))
        _HQ_FOLLOWED[name] = threading.Thread(target=loop, daemon=True)
        _HQ_FOLLOWED[name].start()
        shell.write("following run %s; /pipeline status %s shows it" % (name, name))
        return 0
    pipeline_command(shell.store, args, shell.write, follow, bell=shell.ring_bell)


class TaskBoard:
    """The tasks of the queue at a glance, for HQ: one row per task that is queued or
    running, or ended since HQ started (older ones are `ferrus tasks`' to list), with its
    state, agent, elapsed time and last event.

    The last events come from the journal: the tasks' newest entries are looked up once,
    then HQ's reading of the journal keeps them current (only what was appended since is
    read), so the board costs the same however long the journal is."""

    REFRESH_SECS = 0.25       # rows are rebuilt at most this often (8 tasks: 16 small reads)

    def __init__(self, store):
        self.store = store
        self.opened_at = store.clock()
        self.position = store.journal_position()
        self.cursor = store.last_journal_seq()
        self.last = None          # task -> its newest story entry (None until first asked)
        self.agents = {}          # task -> the agent its executor's entries name
        # Tasks that ended before HQ started never come back on the board: after one
        # look their records are not read again (a long history costs nothing).
        self.settled = set()
        self.cached, self.due = [], 0.0

    def _follow(self):
        entries, self.position = self.store.journal_since(self.position, after_seq=self.cursor)
        for entry in entries:
            self.cursor = max(self.cursor, entry["seq"])
            task = entry.get("task_id")
            if task and is_story(entry):
                self.last[task] = entry
                # An agent's actor id is role:agent:index (then its session).
                actor = str(entry.get("actor") or "").split(":")
                if actor[0] == "executor" and len(actor) > 2:
                    self.agents[task] = actor[1]

    def _shown(self, row):
        if row.get("problem") or row.get("status") in (QUEUED_STATUS, RUNNING_STATUS):
            return True                 # a damaged record is there until it is repaired
        with contextlib.suppress(ValueError, TypeError):
            return parse_timestamp(row.get("ended_at")) >= self.opened_at
        return False

    def rows(self, force=False):
        """task_rows of the tasks on the board, running first, then queued, then ended,
        each with its ``last_event`` entry and ``elapsed`` seconds."""
        now = time.monotonic()
        if not force and now < self.due:
            return self.cached
        self.due = now + self.REFRESH_SECS
        try:
            rows = task_rows(self.store, [task for task in queued_task_ids(self.store)
                                          if task not in self.settled])
        except (FerrusError, OSError):
            return self.cached
        self.settled.update(row["id"] for row in rows if row.get("status") in ENDED_STATUSES
                            and not self._shown(row))
        rows = [row for row in rows if self._shown(row)]
        if self.last is None:
            self.last = last_task_events(self.store, [row["id"] for row in rows])
        self._follow()
        executor = None
        with contextlib.suppress(FerrusError):
            executor = self.store.config().executor
        wall = self.store.clock()
        order = {RUNNING_STATUS: 0, QUEUED_STATUS: 1}
        for row in rows:
            row["last_event"] = self.last.get(row["id"])
            row["elapsed"] = task_elapsed(row, wall)
            row["agent"] = row.get("agent") or self.agents.get(row["id"]) or (
                executor.agent if executor and row.get("status") == RUNNING_STATUS else None)
        self.cached = sorted(rows, key=lambda row: (order.get(row.get("status"), 2),
                                                    queued_order(row)))
        return self.cached

    def summary(self, rows=None):
        """``2 running, 1 queued, 1 merged`` (the board's rows by status)."""
        return count_statuses(DAMAGED_WORD if row.get("problem") else row.get("status")
                              for row in (self.rows() if rows is None else rows))

    def line(self, row, width=None, attached=None):
        """One task's row: short id, state, agent, elapsed, last event (cut to ``width``)."""
        elapsed = row.get("elapsed")
        text = "%s%-6s %-13s %-10s %7s  %s" % (
            "▸" if row["id"] == attached else " ", short_task_id(row["id"]),
            task_state_word(row), (row.get("agent") or "-")[:10],
            format_duration(elapsed) if elapsed is not None else "?",
            row.get("title", "") if row.get("status") == QUEUED_STATUS else
            ("@%s " % row["place"] if row.get("place") else "") +
            describe_task_event(row.get("last_event"), self.store.clock()))
        text = terminal_safe(text)
        if width is not None and len(text) > width:
            text = text[:max(1, width - 1)] + "…"
        return text

    HEADER = " TASK   STATE         AGENT      ELAPSED  LAST EVENT"


HQ_COMMANDS = (
    ("/task", "[TEXT | --manual]", "define a task with the supervisor (or create TEXT directly) "
                                   "and run the loop"),
    ("/task add", "TEXT | --milestone SPEC ID | --ready SPEC",
     "queue a task (or a spec's milestone, or every ready one) for /run"),
    ("/task cancel", "ID", "drop a queued task, or stop a running one"),
    ("/task retry", "ID", "queue a failed or cancelled task again (in its kept worktree)"),
    ("/tasks", "", "the task board: each queued, running and recently ended task with its "
                   "state, agent, elapsed time and last event"),
    ("/run", "[N] [--allow-red-base]", "work the task queue N tasks at a time, each in its "
                                       "own git worktree, merged through the check gate "
                                       "(default [parallel] max_tasks), until /stop; the "
                                       "checks are tried on the target first, and a red "
                                       "one stops it unless --allow-red-base"),
    ("/plan", "", "a free planning session with the supervisor"),
    ("/spec", "", "draft and save a specification with the supervisor"),
    ("/milestones", "[SPEC [ID]]", "list specs and milestones, or select one"),
    ("/reset-spec", "", "clear the spec selection"),
    ("/status", "[ID]", "state, counters, lease, and each agent session (of task ID, or "
                        "the attached task)"),
    ("/log", "[ID] [N] [--all]", "the last N journal entries (default 20), of task ID or the "
                                 "attached one only; --all also shows bookkeeping (sessions, "
                                 "leases, heartbeats)"),
    ("/agents", "", "installed agents and their registration"),
    ("/attach", "ID | ROLE", "follow task ID (only its lines; /status, /log, /diff show it; "
                             "/attach alone detaches), or show the live log of a running "
                             "agent (a key returns)"),
    ("/tell", "ROLE MESSAGE", "interrupt an agent; its next session starts with MESSAGE"),
    ("/check", "[--force]", "run the check gate"),
    ("/resume", "", "resume the task in flight (restarts stopped agents)"),
    ("/review", "", "start the reviewer again"),
    ("/approve", "", "confirm the reviewer's approval ([hq] human_review)"),
    ("/reject", "NOTES", "send the approved task back to the executor with NOTES"),
    ("/stop", "", "stop every agent session (and the parallel run of /run)"),
    ("/continue", "", "go on after a capacity checkpoint (the budget counts again from now)"),
    ("/pipeline", "list|init|run NAME TOPIC|status [RUN]|resume|continue|retry|cancel RUN",
     "file-driven pipelines (workflows.json), followed in the background"),
    ("/diff", "[ID] [--stat] [PATH]", "the task's changes since its base (git); of task ID "
                                      "or the attached one"),
    ("/reset", "", "return to Idle (asks first)"),
    ("/supervisor", "", "an interactive supervisor session"),
    ("/executor", "", "an interactive executor session"),
    ("/model", "ROLE MODEL|--clear", "set or clear a role's model"),
    ("/register", "--supervisor A --executor A", "register agents (as `ferrus register`)"),
    ("/init", "[--agents-path P]", "initialise ferrus here"),
    ("/help", "", "this list"),
    ("/quit", "", "leave HQ (agents are stopped)"),
)
