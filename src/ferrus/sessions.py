"""Sessions: session records, usage, agent processes, HQ's messages.

Every agent session leaves a record (role, agent, outcome, tool calls, tokens, cost,
log); an AgentProcess runs one agent in its own process group and reads its output
into events; HqMessage is what every front end prints."""

import contextlib
import dataclasses
import datetime as _dt
import errno
import json
import os
import re
import subprocess
import threading

from .basics import (FerrusError, LazyPattern, deferred_dataclass, format_timestamp, log,
                     parse_timestamp, pretty_json, utc_now)
from .system import (atomic_write, kill_process_tree, open_private_log, pid_alive,
                     process_group_kwargs, read_text)
from .config import SessionsConfig, load_config
from .store import FERRUS_DIR
from .checks import CHECK_PROCESS_DIR
from .mcp import open_in_ferrus_dir
from .agents import UsageTally
from .adapters import permanent_agent_error
from .register import adapter_for


def sessions_config(root):
    """[sessions] from ferrus.toml (validated with the whole file by load_config).

    HQ starts even when ferrus.toml is broken, so a human can see the task and fix
    the file; every agent launch loads the config and reports the error, so these
    defaults never drive a session."""
    try:
        return load_config(root).sessions
    except FerrusError:
        return SessionsConfig()


# -- session records ------------------------------------------------------------------
#
# Every agent session ferrus starts (HQ's and `ferrus run`'s headless slots, HQ's
# interactive sessions, pipeline workers) has a record in .ferrus/sessions/<id>.json:
# who ran (role, agent, model, argv), what it was told (the prompt), when, how it
# ended, what it used (tool calls, tokens, cost when the CLI reports it) and where its
# raw log is.  A record is written atomically when the session starts, again while its
# counts change and when it ends, so it survives restarts and a killed orchestrator;
# the next orchestrator closes what a dead one left open.  Every usage figure ferrus
# shows, and the capacity gates' token signal, is a sum over these records.

SESSIONS_DIR = "sessions"
SESSION_RECORD_EVERY = 1.0     # seconds between rewrites of a running session's counts
STATUS_SESSIONS_SHOWN = 8      # the current task's newest sessions that status lists
_RECORD_CACHE = {}             # sessions folder -> {file name: (file identity, record)}


def _orchestrator_identity(store):
    """Who starts a session now: this process, named as its orchestrator lock names it."""
    holder = read_orchestrator_record(store) or {}
    kind = holder.get("kind") if holder.get("pid") == os.getpid() else None
    return {"kind": kind or "ferrus", "pid": os.getpid(), "host": _host_name()}


def write_session_record(store, record, durable=True):
    """Write one record (the folder is private: records hold whole prompts)."""
    folder = store.path(SESSIONS_DIR)
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=0o700, exist_ok=True)
    atomic_write(os.path.join(folder, record["id"] + ".json"), pretty_json(record) + "\n",
                 durable=durable)


def open_session_record(store, session_id, **fields):
    """Record a session that starts now; returns the record (a dict the caller keeps)."""
    record = {"id": session_id, "status": "running", "started_at": format_timestamp(utc_now()),
              "ended_at": None, "outcome": None, "exit_code": None, "note": None,
              "slot": None, "role": None, "agent": None, "model": "", "task_id": None,
              "pipeline": None, "pid": None, "log": None, "argv": [], "prompt": None,
              "tool_calls": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": None,
              "turns": 0, "context_tokens": 0,
              "orchestrator": _orchestrator_identity(store)}
    record.update(fields)
    try:
        write_session_record(store, record)
    except OSError as err:       # a record must never stop the agent it describes
        log.warning("could not write the session record %s: %s", session_id, err)
    return record


def _counts(tally, tool_calls):
    """The tally's figures; ``tool_calls`` (the session's ferrus tool calls, counted by
    the MCP servers) stands in when the agent's output shows fewer, or none at all."""
    counts = tally.counts()
    counts["tool_calls"] = max(counts["tool_calls"], tool_calls or 0)
    return counts


def update_session_counts(store, record, tally, tool_calls=None):
    """Persist a running session's counts when they changed; True when written."""
    counts = _counts(tally, tool_calls)
    if tally.model and not record.get("model"):
        counts["model"] = tally.model
    if all(record.get(key) == value for key, value in counts.items()):
        return False
    record.update(counts)
    with contextlib.suppress(OSError):
        write_session_record(store, record, durable=False)
    return True


def close_session_record(store, record, outcome, exit_code=None, tally=None, note=None,
                         tool_calls=None):
    """The session is over: how it ended and its final counts."""
    if tally is not None:
        record.update(_counts(tally, tool_calls))
        if tally.model and not record.get("model"):
            record["model"] = tally.model
        if tally.agent_session:
            record["agent_session"] = tally.agent_session
    record.update(status="ended", ended_at=format_timestamp(utc_now()), outcome=outcome,
                  exit_code=exit_code if isinstance(exit_code, int) else None,
                  note=note or record.get("note"))
    try:
        write_session_record(store, record)
    except OSError as err:
        log.warning("could not write the session record %s: %s", record.get("id"), err)


def read_session_records(store):
    """Every session record, oldest first.  Files not changed since the last call are
    not read again, so HQ can sum them every second.  The records are shared: read
    them, never change them."""
    folder = store.path(SESSIONS_DIR)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    cache, fresh = _RECORD_CACHE.get(folder, {}), {}
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = os.path.join(folder, name)
        try:
            info = os.stat(path)
        except OSError:
            continue
        identity = (info.st_ino, info.st_mtime_ns, info.st_size)
        hit = cache.get(name)
        if hit is not None and hit[0] == identity:
            fresh[name] = hit
            continue
        try:
            record = json.loads(read_text(path))
        except (OSError, ValueError):
            continue             # half a file from another tool: skipped, never fatal
        if isinstance(record, dict) and isinstance(record.get("id"), str):
            try:
                started = parse_timestamp(record.get("started_at"))
            except ValueError:
                started = _dt.datetime.min.replace(tzinfo=_dt.timezone.utc)
            fresh[name] = (identity, record, (started, record["id"]))
    _RECORD_CACHE[folder] = fresh
    return [entry[1] for entry in sorted(fresh.values(), key=lambda entry: entry[2])]


def session_state(record):
    """running | ended | orphaned (its orchestrator died while it ran)."""
    if record.get("status") != "running":
        return "ended"
    orchestrator = record.get("orchestrator") or {}
    pid = orchestrator.get("pid")
    if orchestrator.get("host") != _host_name() or (isinstance(pid, int) and pid_alive(pid)):
        return "running"
    worker = record.get("pid")
    if record.get("pipeline") and isinstance(worker, int) and pid_alive(worker):
        return "running"         # a pipeline worker outlives its orchestrator
    return "orphaned"


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value):
    return value if _is_number(value) else 0


def usage_summary(records):
    """Sessions, tokens and cost of some records.  Cost is summed over the sessions
    that reported one; ``cost_unknown`` counts those that did not."""
    costs = [r.get("cost_usd") for r in records]
    known = [c for c in costs if _is_number(c)]
    return {"sessions": len(records),
            "tool_calls": sum(int(_number(r.get("tool_calls"))) for r in records),
            "input_tokens": sum(int(_number(r.get("input_tokens"))) for r in records),
            "output_tokens": sum(int(_number(r.get("output_tokens"))) for r in records),
            "cost_usd": round(sum(known), 6) if known else None,
            "cost_unknown": len(records) - len(known)}


def task_tokens_and_turns(store, task_id):
    """(tokens, model turns) the sessions of one task reported: what the capacity gates
    count (at a place, its side sends them here with each beat)."""
    records = [r for r in read_session_records(store) if task_id and r.get("task_id") == task_id]
    summary = usage_summary(records)
    return (summary["input_tokens"] + summary["output_tokens"],
            sum(int(_number(r.get("turns"))) for r in records))


def task_usage(store, task_id):
    """The usage of one task's sessions (HQ, `ferrus run`, interactive)."""
    return usage_summary([r for r in read_session_records(store)
                          if task_id and r.get("task_id") == task_id])


def compact_count(number):
    """12345 -> '12.3k': token counts for status lines."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if number >= size:
            return ("%.1f%s" % (number / size, unit)).replace(".0" + unit, unit)
    return str(int(number))


def format_cost(summary):
    """'$0.0123', 'cost unknown', or '$0.01 + 2 sessions of unknown cost'."""
    cost, unknown = summary.get("cost_usd"), summary.get("cost_unknown", 0)
    if cost is None:
        return "cost unknown" if summary.get("sessions") else "$0"
    text = "$%.4f" % cost if cost < 1 else "$%.2f" % cost
    if unknown:
        text += " + %d session%s of unknown cost" % (unknown, "" if unknown == 1 else "s")
    return text


def count_tool_calls(count):
    """'1 tool call', '5 tool calls'."""
    return "%d tool call%s" % (count, "" if count == 1 else "s")


def format_usage(summary):
    """'3 sessions, 41 tool calls, 12.3k tokens in / 1.2k out, $0.0123'."""
    return "%d session%s, %s, %s tokens in / %s out, %s" % (
        summary["sessions"], "" if summary["sessions"] == 1 else "s",
        count_tool_calls(summary["tool_calls"]),
        compact_count(summary["input_tokens"]), compact_count(summary["output_tokens"]),
        format_cost(summary))


def describe_session(record, root=None):
    """One line: slot, agent, state and outcome, exit, counts, cost and the log."""
    state = session_state(record)
    if state == "ended":
        state = record.get("outcome") or "ended"
        if isinstance(record.get("exit_code"), int):
            state += ", exit %d" % record["exit_code"]
    elif state == "orphaned":
        state = "orphaned (its orchestrator, pid %s, died)" % (
            (record.get("orchestrator") or {}).get("pid"))
    agent = record.get("agent") or "?"
    if record.get("model"):
        agent += " (%s)" % record["model"]
    cost = record.get("cost_usd")
    usage = "%s, %s/%s tokens, %s" % (
        count_tool_calls(int(_number(record.get("tool_calls")))),
        compact_count(_number(record.get("input_tokens"))),
        compact_count(_number(record.get("output_tokens"))),
        "$%.4f" % cost if _is_number(cost) else "cost unknown")
    if record.get("usage_reported") is False:
        usage = "usage not reported"
    text = "%s %s %s: %s — %s" % (record.get("started_at") or "?",
                                 record.get("slot") or record.get("role") or "?", agent, state,
                                 usage)
    if record.get("log"):
        text += " — log %s" % record["log"]
    return text


def usage_from_log(path, parse_line):
    """Fold a session's raw log through its adapter's parser (a log is read a line at
    a time, so its size does not matter)."""
    tally = UsageTally()
    with contextlib.suppress(OSError):
        with open(path, "rb") as handle:
            for raw in handle:
                line = raw.decode("utf-8", "replace").strip()
                if line:
                    with contextlib.suppress(Exception):     # parsers never take us down
                        for event in parse_line(line):
                            tally.add(event)
    return tally


def close_orphaned_records(store):
    """Close the records of HQ and `ferrus run` sessions whose orchestrator died: the
    counts are read again from their logs, the end is now (the latest it can have
    been).  Pipeline workers outlive their orchestrator; the pipeline's reconcile
    closes theirs.  Returns one note per record closed."""
    notes, config = [], None
    with contextlib.suppress(FerrusError):
        config = store.config()
    for shared in read_session_records(store):
        if shared.get("pipeline") or session_state(shared) != "orphaned":
            continue
        record = dict(shared)
        tally = None
        if config is not None and record.get("log") and record.get("agent"):
            with contextlib.suppress(FerrusError):
                parse_line = adapter_for(config, record["agent"]).parse_line
                tally = usage_from_log(os.path.join(store.root, record["log"]), parse_line)
        dead = record.get("orchestrator") or {}
        close_session_record(store, record, "orphaned", tally=tally,
                             note="its orchestrator (%s, pid %s) ended while it ran; ended by "
                                  "then at the latest" % (dead.get("kind"), dead.get("pid")))
        notes.append("closed the record of the %s session %s, which the previous orchestrator "
                     "left open" % (record.get("slot") or "agent", record["id"]))
    return notes


# What each slot must achieve before its session counts as done: HQ checks the
# journal itself instead of trusting an exit code.
SLOT_ROLES = {"executor": "executor", "reviewer": "supervisor", "consultant": "supervisor"}
SLOT_PROGRESS = {"executor": ("submit", "consult", "ask_human", "check_failed"),
                 "reviewer": ("approve", "reject", "ask_human"),
                 "consultant": ("respond_consult", "ask_human")}


def usage_limit_wait(text, now=None):
    """Seconds until a "resets 3pm" / "resets at 15:30" time, or 15 minutes if unreadable."""
    now = now or _dt.datetime.now()
    match = re.search(r"(\d{1,2})(?::(\d{2}))?\s*([ap]m)?", text or "", re.IGNORECASE)
    if not match:
        return 900.0
    hour, minute = int(match.group(1)), int(match.group(2) or 0)
    if match.group(3):
        hour = hour % 12 + (12 if match.group(3).lower() == "pm" else 0)
    if hour > 23 or minute > 59:
        return 900.0
    target = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if target <= now:
        target += _dt.timedelta(days=1)
    return (target - now).total_seconds() + 60


def _spawn_error_hint(err):
    """Why an agent program could not be started, in terms a user can act on."""
    if err.errno == errno.ENOEXEC:
        return " — it is not a program this system can run; a script needs a first line " \
               "such as #!/usr/bin/env python3"
    if err.errno == errno.ENOENT:
        return " — the program, or the interpreter named on its #! line, does not exist"
    if err.errno == errno.EACCES:
        return " — it is not executable (chmod +x) or a folder on the way is not readable"
    return ""


class LastWords:
    """The model's last message, folded from "said" AgentEvents: a new message replaces
    it, a streamed piece of the same message (Gemini) goes on it; only its end is kept."""

    CHARS = 2000

    def __init__(self):
        self.text = ""
        self._open = False        # the event before was a piece of what the model wrote

    def add(self, event):
        if event.kind == "said":
            words = self.text + event.text if event.name == "delta" and self._open \
                else event.text
            self.text = words[-self.CHARS:]
            self._open = True
        elif event.kind in ("tool_call", "tool_result"):
            self._open = False


class AgentProcess:
    """One running agent CLI: its process, its raw log, and what its output said."""

    def __init__(self, launch, root, log_path, parse_line):
        self.log_path = log_path
        self.events = []
        self.tally = UsageTally()  # tool calls, tokens and cost, as the output reports them
        self.lines = 0
        self.last_text = ""        # the last line that was not a JSON event, for heartbeats
        self.said = LastWords()    # the model's last message, as the output said
        self.fatal = None          # (kind, words, hint): an error no retry can cure
        env = dict(os.environ)
        env.update(launch.env)
        env["PWD"] = os.path.abspath(root)     # opencode takes its folder from $PWD
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        self.log = open_private_log(log_path)
        self.log.write(("$ %s\n" % " ".join(launch.argv)).encode("utf-8", "replace"))
        self.argv0 = launch.argv[0]
        self.proc = subprocess.Popen(
            launch.argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if launch.stdin is not None else subprocess.DEVNULL,
            **process_group_kwargs())
        self.pid = self.proc.pid
        self._parse_line = parse_line
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if launch.stdin is not None:
            threading.Thread(target=self._feed, args=(launch.stdin,), daemon=True).start()

    def _feed(self, text):
        try:
            with self.proc.stdin:
                self.proc.stdin.write(text.encode("utf-8"))
        except (OSError, ValueError):
            pass   # the agent exited before reading its prompt; its exit says why

    def _read(self):
        with self.proc.stdout:
            for raw in iter(self.proc.stdout.readline, b""):
                self.log.write(raw)
                self.log.flush()
                self.lines += 1
                line = raw.decode("utf-8", "replace").strip()
                if line and not line.startswith("{"):
                    self.last_text = line[:200]
                if line:
                    try:
                        events = self._parse_line(line)
                        self.events.extend(events)
                        for event in events:
                            self.tally.add(event)
                            self.said.add(event)
                        if self.fatal is None:
                            self.fatal = permanent_agent_error(line)
                    except Exception:   # a parser must never take the supervisor down
                        log.debug("unparsable agent output line", exc_info=True)

    @property
    def last_words(self):
        return self.said.text

    def exited(self):
        return self.proc.poll() is not None and not self.reader.is_alive()

    def finish(self):
        self.reader.join(2)
        with contextlib.suppress(OSError):
            self.log.write(("\n[exit %s]\n" % self.proc.returncode).encode())
            self.log.close()
        return self.proc.returncode

    def terminate(self, grace=0.25):
        kill_process_tree(self.proc, grace)

    def limit(self):
        hits = [e for e in self.events if e.kind == "limit"]
        return hits[-1].text if hits else None


@deferred_dataclass
class HqMessage:
    """One line the engine emits for a front end to show."""

    kind: str      # transition | info | warning | error | question | agent
    text: str
    # What happened, for `ferrus run --json` and other programs: a short name (see
    # PROGRESS_EVENTS) and its facts.  The text says the same for people.
    event: str = ""
    data: dict = dataclasses.field(default_factory=dict)


# The progress events HQ and `ferrus run` report (the "event" of each --json object).
PROGRESS_EVENTS = (
    "transition",      # the task moved: from, to, by (the journal event), actor, task_id
    "check_started",   # a check command began: command
    "check",           # a check command ended: command, status, exit, secs, log, tail
    "checks",          # the gate's verdict: passed, during (check | submit), retries, log
    "submission",      # the executor submitted: summary (first lines of SUBMISSION.md)
    "review",          # the reviewer rejected: notes (first lines of REVIEW.md)
    "consult",         # the executor asked the supervisor: question
    "consult_answer",  # the supervisor answered: answer
    "question",        # an agent asks a human: question
    "confirmation",    # the reviewer approved and [hq] human_review waits for the human
    "answer",          # a human answered: answer
    "tool_call",       # an agent called a tool: slot, tool, input
    "tool_failed",     # an agent's tool call failed or was denied: slot, tool, input,
                       # reason, denied
    "heartbeat",       # nothing else for a while: slot, secs, tool_calls, last_output
    "session",         # an agent started, exited, backs off or is stopped: slot
    "base_checks",     # the checks tried on a task's base before any agent started: passed,
                       # commit, failed (command, status, exit, log, tail), log, cached
    # A parallel task's integration (`ferrus run --parallel`), each with task_id, target:
    "integrating",     # the merge queue took it up
    "merged",          # the target moved to its work: commit, title
    "unchanged",       # approved, and the target already had its work: nothing merged
    "sent_back",       # back to its executor: cause, reason, failed (the red checks with
                       # command, status, exit, log, tail), files
    "conflict",        # back to its executor to resolve a conflict: files
    "target_moved",    # the run stopped: the target gained commits it did not check
                       # (target, head, known: where the run had left it)
    # The team's remote ([git] fetch, push, publish; remote.py):
    "upstream",        # the target was brought up to its upstream (head), or could not be
    "pushed",          # the merged target was pushed: remote, commit
    "push_rejected", "push_failed",   # the push was refused or not made: the run stopped
    "diverged",        # the target and its upstream diverged: the run stopped
    "published",       # approved and checked, its branch pushed: remote, branch, commit,
                       # pull_request
    "race_decided",    # an attempt of a race merged: race, winner, attempts (race.py)
    "complete", "failed", "capacity", "pipeline", "notifier", "info")


LAST_WORDS_SHOWN = 300


def last_words_tail(text, width=LAST_WORDS_SHOWN):
    """The end of an agent's last message on one line ("" when it wrote none): where it
    says why it stopped."""
    words = " ".join((text or "").split())
    return words if len(words) <= width else "…" + words[-(width - 1):]


def first_lines(text, count=4, width=160):
    """The first ``count`` non-blank lines of ``text``, each cut to ``width``."""
    lines = [line.rstrip() for line in (text or "").splitlines() if line.strip()]
    kept = [line if len(line) <= width else line[:width - 1] + "…" for line in lines[:count]]
    if len(lines) > count:
        kept.append("… (%d more lines)" % (len(lines) - count))
    return kept


_CHECK_LOG_TRAILER = LazyPattern(r"^\[(passed|failed|timed out|cancelled|skipped), exit ")


def check_log_tail(store, log_path, count=8, chunk=16384):
    """The last ``count`` lines a check command printed, read from the end of its log
    (``log_path`` relative to the project root) without reading the whole file."""
    if not isinstance(log_path, str) or not log_path.startswith(FERRUS_DIR + "/"):
        return []
    try:
        with open_in_ferrus_dir(store, *log_path.split("/")[1:]) as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - chunk))
            data = handle.read()
    except (OSError, FerrusError, ValueError):
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if size > chunk:
        lines = lines[1:]                  # the first line may start mid-way
    lines = [line for line in lines if not _CHECK_LOG_TRAILER.match(line)]
    while lines and not lines[-1].strip():
        lines.pop()
    return [line[:200] for line in lines[-count:]]


def running_check_commands(store):
    """{check id: command} of the check commands running right now for ``store``'s task,
    from their pid files in .ferrus/check-processes/ (whoever started them): those run
    in its working folder, so a parallel task never shows another task's checks (a pid
    file that names no folder counts for every task)."""
    directory = store.path(CHECK_PROCESS_DIR)
    workdir = os.path.normcase(os.path.abspath(store.workdir))
    running = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not name.endswith(".json"):
                continue
            with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
                record = json.loads(read_text(os.path.join(directory, name)))
                cwd = record.get("cwd")
                if isinstance(cwd, str) and os.path.normcase(cwd) != workdir:
                    continue
                running[name[:-5]] = str(record["command"])
    return running
ORCHESTRATOR_RECORD = "orchestrator.json"


def describe_orchestrator(record):
    """'ferrus run (pid 123 on host, since 2026-…Z)' from an orchestrator.json record."""
    if not isinstance(record, dict):
        return "another ferrus process (it has not said which yet)"
    return "%s (pid %s on %s, since %s)" % (record.get("kind", "?"), record.get("pid", "?"),
                                            record.get("host", "?"), record.get("started", "?"))


def read_orchestrator_record(store):
    try:
        record = json.loads(read_text(store.path(ORCHESTRATOR_RECORD), default="") or "null")
    except (ValueError, OSError):
        return None
    return record if isinstance(record, dict) else None


def _host_name():
    import platform
    return platform.node() or "this machine"
