"""Checks: the check gate's runner, bounded and killable.

Commands come from ferrus.toml only.  Each streams to its own log with only a tail
kept in memory, runs in its own process group with a timeout, and is recorded so a
crashed orchestrator's checks are found and ended."""

import atexit
import collections
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

from .basics import (FerrusError, deferred_dataclass, format_timestamp, log, pretty_json,
                     random_hex, utc_now)
from .system import (HAS_PROC, IS_WINDOWS, _proc_stat, atomic_write, kill_process_tree,
                     pid_alive, process_environ_has, process_group_kwargs, process_start,
                     process_table, read_text, shell_argv)
from .config import ChecksConfig


# A single output line longer than this is cut in the in-memory tail (the log
# file keeps it whole); together with the line count this bounds memory.
_TAIL_LINE_BYTES = 4000


@deferred_dataclass
class CommandResult:
    """How one [checks] command ended."""

    command: str
    status: str = "skipped"        # passed | failed | timed out | cancelled | skipped
    exit_code: "int | None" = None
    duration: float = 0.0
    line_count: int = 0
    tail: list = dataclasses.field(default_factory=list)
    log_path: "str | None" = None      # relative to the project root, for reports
    log_path_abs: "str | None" = None
    log_cut_bytes: int = 0             # output left out of the middle of the log file
    log_error: "str | None" = None     # why the log file is incomplete (a full disk)
    timeout: "float | None" = None     # the limit it ran into, when it timed out

    @property
    def passed(self):
        return self.status == "passed"


@deferred_dataclass
class CheckRun:
    """One run of the check gate: every command's result and the combined log."""

    results: list
    log_path: str
    cancelled: bool = False

    @property
    def passed(self):
        return not self.cancelled and all(r.passed for r in self.results)

    @property
    def failed(self):
        return [r for r in self.results if not r.passed and r.status != "skipped"]

    def failure_reason(self):
        names = [r.command for r in self.failed] or [r.command for r in self.results if not r.passed]
        return "Commands failed: " + ", ".join(names)

    def report(self, max_lines):
        """The failure report agents read (upstream's layout, plus log paths)."""
        out = ["Checks failed.\n\nFailed commands:\n"]
        for result in self.failed:
            out.append("- `%s`%s\n" % (result.command, _status_note(result)))
        skipped = [r for r in self.results if r.status == "skipped"]
        if skipped:
            out.append("Not run: %s\n" % ", ".join("`%s`" % r.command for r in skipped))
        out.append("\n")
        for result in self.failed:
            out.append("`%s`\n" % result.command)
            tail = result.tail[-max_lines:] if max_lines > 0 else []
            if result.line_count > max_lines:
                out.append("(last %d of %d lines)\n" % (max_lines, result.line_count))
            out.append("```\n" + "\n".join(tail) + "\n```\n")
            if result.log_path:
                out.append("(%s: `%s`)\n" % (_log_description(result), result.log_path))
            out.append("\n")
        out.append("Full log: `%s`" % self.log_path)
        return "".join(out)


# How many of a red command's last lines a one-screen report shows.
CHECK_TAIL_SHOWN = 8


def failed_check_facts(result):
    """A red check command's facts (a CommandResult): what a send-back or a red base
    shows, and --json carries."""
    return {"command": result.command, "status": result.status, "exit": result.exit_code,
            "log": result.log_path, "tail": list(result.tail[-CHECK_TAIL_SHOWN:])}


def describe_failed_check(fact):
    """``check failed: pytest -q (exit 1); log .ferrus/logs/…`` and its last lines."""
    status = fact.get("status") or "failed"
    note = " (exit %s)" % fact["exit"] if status == "failed" and fact.get("exit") is not None \
        else ""
    text = "    check %s: %s%s; log %s" % (status, fact.get("command"), note,
                                           fact.get("log") or "-")
    tail = fact.get("tail") or ["(it printed nothing)"]
    return text + "".join("\n        │ " + line for line in tail)


# Words a POSIX shell runs itself: never looked for on PATH.
SHELL_BUILTINS = frozenset((
    "!", ".", ":", "[", "[[", "alias", "bg", "break", "case", "cd", "command", "continue",
    "do", "done", "echo", "elif", "else", "esac", "eval", "exec", "exit", "export", "false",
    "fg", "fi", "for", "function", "getopts", "hash", "if", "jobs", "kill", "local", "printf",
    "pwd", "read", "readonly", "return", "set", "shift", "source", "test", "then", "time",
    "times", "trap", "true", "type", "ulimit", "umask", "unalias", "unset", "until", "wait",
    "while", "{", "}"))
# Tokens after which a shell expects a command.
_SHELL_SEPARATORS = frozenset(("&&", "||", ";", "|", "&", "(", ")", "!", "{", "do", "then",
                               "else", "elif", "if", "while", "until", "time"))


def missing_check_programs(root, command):
    """The programs a [checks] command names that cannot be found: neither on PATH nor,
    for a path, a file under ``root`` — what would make the shell say "not found".  Only
    plain words in command position are judged; anything the shell expands ($VAR,
    `…`, globs) is left alone, so a command that merely looks odd is never reported."""
    import shlex
    if IS_WINDOWS:  # pragma: no cover  (cmd.exe quoting is another language)
        return []
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:
        return []                 # unbalanced quotes: the check itself will say so
    missing, expect = [], True
    for word in words:
        if word in _SHELL_SEPARATORS or set(word) <= set("&|;()"):
            expect = True
            continue
        if not expect:
            continue
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word):
            continue              # VAR=value before the command
        expect = False
        if word in SHELL_BUILTINS or any(c in word for c in "$`*?[~<>") or not word:
            continue
        if "/" in word:
            if "cd" in words[:words.index(word)] and not os.path.isabs(word):
                continue          # relative to a folder the command moved to
            path = os.path.join(root, word)
            found = os.path.isfile(path) and os.access(path, os.X_OK)
        else:
            found = shutil.which(word) is not None
        if not found and word not in missing:
            missing.append(word)
    return missing


def _log_description(result):
    if result.log_error:
        return "incomplete log, %s" % result.log_error
    if result.log_cut_bytes:
        return "log, %d bytes cut from the middle" % result.log_cut_bytes
    return "full output"


def _status_note(result):
    if result.status == "timed out":
        # The configured limit, not the measured time, which includes the kill.
        return " (timed out after %g s)" % (result.timeout or round(result.duration))
    if result.status == "cancelled":
        return " (stopped: %s)" % "another command failed and fail_fast is on"
    if result.exit_code is not None and result.exit_code < 0:
        return " (killed by signal %d)" % -result.exit_code
    if result.exit_code is not None:
        return " (exit %d)" % result.exit_code
    return ""


class CappedLog:
    """A log file that never grows past ``max_bytes``: the head and the tail survive.

    The first half of the budget goes straight into the file.  After that the
    output goes to two tail segment files beside it (``<log>.tail0`` and
    ``.tail1``) of a quarter budget each; when the current one is full the older
    is emptied and reused, so the disk holds at most the budget at any moment
    and memory holds nothing but one chunk.  ``close`` appends a
    ``[… N bytes cut …]`` line and the kept tail (the last quarter to half of the
    budget) to the log and removes the segments.  A write error (a full disk)
    stops the logging, never the check: output is still drained and counted."""

    def __init__(self, path, max_bytes):
        self.path = path
        self.head_budget = max(1, max_bytes // 2)
        self.segment_budget = max(1, (max_bytes - self.head_budget) // 2)
        self.handle = open(path, "wb")
        self.written = 0           # bytes in the log file itself
        self.total = 0             # every byte offered, kept or not
        self.segments = []         # [path, handle, size], oldest first, at most two
        self.error = None
        self.closed = False
        # A reader thread still draining a pipe that an escaped process holds may
        # write while close() runs.
        self._lock = threading.Lock()

    def write(self, data):
        with self._lock:
            if self.closed:
                return
            self.total += len(data)
            if self.error is None and data:
                self._write(data)

    def _write(self, data):
        try:
            room = self.head_budget - self.written
            if room > 0:
                self.handle.write(data[:room])
                self.written += min(room, len(data))
                data = data[room:]
            while data:
                data = self._write_tail(data)
        except OSError as err:
            self.error = "%s (%s)" % (err.strerror or err, err.__class__.__name__)

    def _write_tail(self, data):
        if not self.segments or self.segments[-1][2] >= self.segment_budget:
            if len(self.segments) == 2:
                # Reuse the older segment: its bytes are no longer among the last ones.
                oldest = self.segments.pop(0)
                oldest[1].seek(0)
                oldest[1].truncate()
                oldest[2] = 0
                self.segments.append(oldest)
            else:
                name = "%s.tail%d" % (self.path, len(self.segments))
                self.segments.append([name, open(name, "w+b"), 0])
        current = self.segments[-1]
        piece = data[:self.segment_budget - current[2]]
        current[1].write(piece)
        current[2] += len(piece)
        return data[len(piece):]

    @property
    def cut_bytes(self):
        """Bytes of output the finished log leaves out (0 while nothing is cut)."""
        kept = self.written + sum(segment[2] for segment in self.segments)
        return max(0, self.total - kept) if self.error is None else 0

    def close(self, trailer=b""):
        """Splice the tail into the log, append ``trailer`` and close everything."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._close(trailer)

    def _close(self, trailer):
        try:
            if self.segments and self.error is None:
                cut = self.cut_bytes
                if cut:
                    self.handle.write(("\n[\u2026 %d bytes cut \u2026]\n" % cut).encode("utf-8"))
                for _name, handle, size in self.segments:
                    handle.seek(0)
                    left = size
                    while left:
                        chunk = handle.read(min(left, 1 << 20))
                        if not chunk:
                            break
                        self.handle.write(chunk)
                        left -= len(chunk)
            if self.error is not None:
                trailer = ("\n[log incomplete: %s]\n" % self.error).encode("utf-8") + trailer
            self.handle.write(trailer)
        except OSError as err:
            self.error = self.error or "%s (%s)" % (err.strerror or err, err.__class__.__name__)
        finally:
            for name, handle, _size in self.segments:
                handle.close()
                with contextlib.suppress(OSError):
                    os.unlink(name)
            with contextlib.suppress(OSError):
                self.handle.close()


class _OutputSink:
    """Streams a command's output to its log file, keeping only a bounded tail."""

    def __init__(self, log_handle, keep_lines):
        self.log = log_handle
        self.tail = collections.deque(maxlen=max(1, keep_lines))
        self.partial = b""
        self.partial_cut = False     # the pending line already lost its beginning
        self.lines = 0

    def feed(self, chunk):
        self.log.write(chunk)
        pieces = (self.partial + chunk).split(b"\n")
        self.partial = pieces.pop()
        if pieces:
            self.lines += len(pieces)
            first_cut, self.partial_cut = self.partial_cut, False
            keep = pieces[-self.tail.maxlen:]
            for index, piece in enumerate(keep):
                cut = first_cut and index == 0 and len(keep) == len(pieces)
                self.tail.append(_tail_text(piece, cut))
        if len(self.partial) > _TAIL_LINE_BYTES:
            # Keep the end of a giant unterminated line, not all of it.
            self.partial = self.partial[-_TAIL_LINE_BYTES:]
            self.partial_cut = True

    def finish(self):
        if self.partial or self.partial_cut:
            self.lines += 1
            self.tail.append(_tail_text(self.partial, self.partial_cut))
            self.partial, self.partial_cut = b"", False


def _tail_text(raw, cut=False):
    if len(raw) > _TAIL_LINE_BYTES:
        raw, cut = raw[-_TAIL_LINE_BYTES:], True
    text = raw.rstrip(b"\r").decode("utf-8", errors="replace")
    return "..." + text if cut else text


def _run_one_command(root, result, timeout, keep_lines, stop, log_dir,
                     max_log_bytes=ChecksConfig.max_log_bytes, process_dir=None, wrap=None,
                     env=None):
    """Run one check command to completion, timeout or ``stop``; fill ``result``.
    ``wrap(argv)`` confines the command (a task's sandbox, see sandbox.py); ``env`` adds
    variables to the command's environment."""
    started = time.monotonic()
    if not result.command.strip():
        result.status = "passed"
        return
    handle = CappedLog(result.log_path_abs, max_log_bytes)
    record = CheckProcessRecord(
        process_dir or os.path.join(os.path.dirname(os.path.abspath(log_dir)), CHECK_PROCESS_DIR),
        os.path.basename(result.log_path_abs)[:-len(".log")], result.command, root)
    try:
        handle.write(("$ %s\n" % result.command).encode("utf-8"))
        sink = _OutputSink(handle, keep_lines)
        try:
            argv = shell_argv(result.command)
            proc = subprocess.Popen(wrap(argv) if wrap else argv, cwd=root,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, env=record.environment(env),
                                    **process_group_kwargs())
        except (OSError, FerrusError) as err:
            # FerrusError: the sandbox the command must run in cannot be made here.
            what = "the shell" if isinstance(err, OSError) else "it in its sandbox"
            err = err.full_text() if isinstance(err, FerrusError) else err
            log.error("check command %r could not start: %s", result.command, err)
            result.status = "failed"
            result.tail = ["could not start %s: %s" % (what, err)]
            result.line_count = 1
            return
        record.started(proc)
        reader = threading.Thread(target=_pump_output, args=(proc.stdout, sink), daemon=True)
        reader.start()
        outcome = None
        while outcome is None:
            try:
                proc.wait(timeout=0.05)
                outcome = "exited"
            except subprocess.TimeoutExpired:
                if record.window is not None:
                    record.window.update()
                if stop.is_set():
                    outcome = "cancelled"
                elif time.monotonic() - started >= timeout:
                    outcome = "timed out"
                    result.timeout = timeout
        if outcome != "exited":
            record.end()
            proc.wait()
        else:
            # What the command left running (a daemon, a grandchild holding the
            # pipe) ends with it: nothing of a check outlives the check.
            record.end(grace=0)
        reader.join(5)
        sink.finish()
        result.duration = time.monotonic() - started
        result.exit_code = proc.returncode
        result.line_count = sink.lines
        result.tail = list(sink.tail)
        if outcome == "exited":
            result.status = "passed" if proc.returncode == 0 else "failed"
        else:
            result.status = outcome
        result.log_cut_bytes = handle.cut_bytes
    except BaseException:
        # Ctrl+C or a crash in ferrus: the command must not run on unwatched.
        record.end(grace=0)
        raise
    finally:
        record.close()
        handle.close(("\n[%s, exit %s, %.2f s]\n" % (result.status, result.exit_code,
                                                    result.duration)).encode("utf-8"))
        result.log_error = handle.error


# -- check processes -------------------------------------------------------------------
#
# A check command starts in its own session and process group, with
# FERRUS_CHECK_ID=<unique marker> in its environment.  A process that leaves the
# group (setsid, a double fork) keeps the marker, so on Linux it is found by
# reading /proc/<pid>/environ; every process in a group or session holding a
# marked process, and every descendant of one, belongs to the check too.  While
# a command runs, its pid file in .ferrus/check-processes/ names the marker, the
# shell's pid and start time and its owner (this ferrus, by pid and start time),
# so the next ferrus to start ends what a SIGKILLed one left behind.

CHECK_MARKER_ENV = "FERRUS_CHECK_ID"
CHECK_PROCESS_DIR = "check-processes"

_ACTIVE_CHECKS = set()            # CheckProcessRecord of this process's running commands
_ACTIVE_CHECKS_LOCK = threading.Lock()
_OWN_START = []                   # this process's start token, read once


def _own_start():
    if not _OWN_START:
        _OWN_START.append(process_start(os.getpid()))
    return _OWN_START[0]


def _check_members(table, marker, leader_pid=None, leader_start=None):
    """The pids in ``table`` that belong to the check marked ``marker``."""
    entry = ("%s=%s" % (CHECK_MARKER_ENV, marker)).encode("utf-8")
    skip = {0, 1, os.getpid()}
    verified = {pid for pid, info in table.items()
                if pid not in skip and not info.zombie and process_environ_has(pid, entry)}
    leader = table.get(leader_pid)
    if leader is not None and leader_start is not None and (
            leader.start if leader.start is not None else process_start(leader_pid)) \
            == leader_start:
        verified.add(leader_pid)
    # Never this ferrus's own group or session, whatever a check process claims.
    own_ids = {os.getpgrp(), os.getsid(0)}
    groups = {table[pid].pgid for pid in verified} - own_ids
    sessions = {table[pid].sid for pid in verified} - own_ids - {None}
    members = set(verified)
    members.update(pid for pid, info in table.items()
                   if info.pgid in groups or info.sid in sessions)
    children = collections.defaultdict(list)
    for pid, info in table.items():
        children[info.ppid].append(pid)
    pending = list(members)
    while pending:
        for child in children.get(pending.pop(), ()):
            if child not in members:
                members.add(child)
                pending.append(child)
    return {pid for pid in members - skip if not table[pid].zombie}


def _read_int(path):
    try:
        with open(path, "rb") as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


class PidWindow:
    """The pids Linux handed out since this object was made: a cheap sweep's candidates.

    Linux allocates pids cyclically, so every process a check started has a pid
    in the cyclic range after ``/proc/sys/kernel/ns_last_pid`` as it was just
    before the check's shell started.  Reading only those /proc entries costs a
    few instead of all (there can be thousands).  The counter is sampled while
    the check runs; once the allocations come near a whole cycle the window
    stops filtering and a sweep reads every process again."""

    LAST_PID = "/proc/sys/kernel/ns_last_pid"

    def __init__(self):
        self.first = _read_int(self.LAST_PID) if HAS_PROC else None
        self.pid_max = _read_int("/proc/sys/kernel/pid_max") if self.first is not None else None
        self.valid = bool(self.first is not None and self.pid_max)
        self.last = self.first
        self.travelled = 0

    def update(self):
        if not self.valid:
            return
        now = _read_int(self.LAST_PID)
        if now is None:
            self.valid = False
            return
        self.travelled += (now - self.last) % self.pid_max
        self.last = now
        if self.travelled >= self.pid_max // 2:
            self.valid = False

    def confirm(self, pid):
        """Stop filtering if ``pid`` (just started) is not in the window: another pid namespace."""
        self.update()
        if self.valid and not self.contains(pid):
            self.valid = False

    def contains(self, pid):
        if not self.valid:
            return True
        return 0 < (pid - self.first) % self.pid_max <= (self.last - self.first) % self.pid_max


class _SharedProcessTable:
    """process_table() for concurrent sweeps: callers share one read of /proc.

    A read costs one /proc file per process (tenths of a second on a loaded
    machine with a thousand processes), and parallel checks tend to end
    together.  A caller gets a table whose read *started* after its call, so
    sharing never hides a process that existed when it asked."""

    def __init__(self):
        self._cond = threading.Condition()
        self._reading = False
        self._generation = 0
        self._table = {}

    def read(self):
        with self._cond:
            # A read already under way may have started before this call: wait for the next.
            wanted = self._generation + (2 if self._reading else 1)
            while self._generation < wanted:
                if self._reading:
                    self._cond.wait()
                    continue
                self._reading = True
                table = {}
                try:
                    self._cond.release()
                    try:
                        table = process_table()
                    finally:
                        self._cond.acquire()
                finally:
                    self._reading = False
                    self._generation += 1
                    self._table = table
                    self._cond.notify_all()
            return self._table


_PROCESS_TABLE = _SharedProcessTable()


def _signal_each(pids, sig):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _gone(pid):
    if HAS_PROC:
        info = _proc_stat(pid)
        return info is None or info.zombie
    return not pid_alive(pid)  # pragma: no cover


def end_check_processes(marker, leader_pid=None, leader_start=None, pgid=None, grace=0.25,
                        leader_done=None, window=None):
    """End every process of one check: TERM, up to ``grace`` seconds, then KILL.

    Before the KILL the processes are stopped (SIGSTOP) and the table is read
    again until no new member shows up, so a process that forks as fast as it
    can cannot outrun the sweep.  ``pgid`` is signalled as a group as well (the
    only handle on the group where there is no /proc).  ``window`` (a PidWindow
    opened before the check started) limits the search to newer processes.
    Returns the pids found."""
    if IS_WINDOWS:  # pragma: no cover - Windows uses kill_process_tree
        return set()

    def find():
        if window is not None:
            window.update()
            if window.valid:
                return _check_members(process_table(window.contains), marker, leader_pid,
                                      leader_start)
        return _check_members(_PROCESS_TABLE.read(), marker, leader_pid, leader_start)

    def signal_group(sig):
        if pgid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
    found = find()
    fresh = set(found)
    if grace > 0 and (found or pgid):
        # Frozen while they are signalled, so none of them sees another die and
        # carries on (a shell running its next command when its child dies) before
        # its own TERM arrives; the TERM is delivered as they continue.
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):
            signal_group(sig)
            _signal_each(found, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if (leader_done is None or leader_done()) and all(_gone(pid) for pid in found):
                break
            time.sleep(0.01)
        fresh = find()
    # Reading the process table is the expensive part (a /proc read per process),
    # so the first look doubles as the first round.
    stopped = set()
    for _ in range(100):
        fresh -= stopped
        if not fresh:
            break
        _signal_each(fresh, signal.SIGSTOP)
        stopped |= fresh
        fresh = find()
    signal_group(signal.SIGKILL)
    _signal_each(stopped, signal.SIGKILL)
    return found | stopped


class CheckProcessRecord:
    """The pid file of one running check command, and how to end its processes."""

    def __init__(self, directory, check_id, command, cwd=None):
        self.path = os.path.join(directory, check_id + ".json")
        self.marker = "%s-%s" % (check_id, random_hex(8))
        self.proc = None
        self.window = None
        self.data = {"check_id": check_id, "marker": self.marker, "command": command,
                     "owner_pid": os.getpid(), "owner_start": _own_start(),
                     "started_at": format_timestamp(utc_now())}
        if cwd is not None:
            # Whose check it is: parallel tasks run theirs in their own worktrees.
            self.data["cwd"] = os.path.abspath(cwd)
        with _ACTIVE_CHECKS_LOCK:
            _ACTIVE_CHECKS.add(self)
        self._save(directory)

    def _save(self, directory=None):
        # Written before the command starts, so no moment exists in which a
        # process of it runs unrecorded; a failure only costs the restart cleanup.
        try:
            if directory:
                os.makedirs(directory, exist_ok=True)
            atomic_write(self.path, pretty_json(self.data) + "\n", durable=False)
        except OSError as err:
            log.warning("cannot record check processes in %s: %s", self.path, err)

    def environment(self, extra=None):
        """The command's environment (with ``extra`` added); also opens the pid window,
        just before the spawn."""
        env = dict(os.environ)
        env.update(extra or {})
        env[CHECK_MARKER_ENV] = self.marker
        self.window = PidWindow()
        return env

    def started(self, proc):
        self.proc = proc
        if self.window is not None:
            self.window.confirm(proc.pid)
        self.data.update(leader_pid=proc.pid, leader_start=process_start(proc.pid))
        self._save()

    def end(self, grace=0.25):
        """End the command's processes (all of them, wherever they went)."""
        proc = self.proc
        if IS_WINDOWS:  # pragma: no cover
            if proc is not None:
                kill_process_tree(proc, grace)
            return
        leader = proc.pid if proc is not None else None
        end_check_processes(self.marker, leader, self.data.get("leader_start"), pgid=leader,
                            grace=grace,
                            leader_done=(lambda: proc.poll() is not None) if proc else None,
                            window=self.window)

    def close(self):
        with _ACTIVE_CHECKS_LOCK:
            _ACTIVE_CHECKS.discard(self)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def end_active_checks():
    """End the check processes this ferrus started (at exit or on SIGTERM)."""
    with _ACTIVE_CHECKS_LOCK:
        records = list(_ACTIVE_CHECKS)
    for record in records:
        with contextlib.suppress(Exception):
            record.end(grace=0)
            record.close()


atexit.register(end_active_checks)


def orphaned_check_records(ferrus_dir):
    """(path, record or None) for pid files whose ferrus is gone.

    None on Windows: without a start time a pid names no process for sure."""
    if IS_WINDOWS:  # pragma: no cover
        return []
    directory = os.path.join(ferrus_dir, CHECK_PROCESS_DIR)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        try:
            data = json.loads(read_text(path))
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("marker"), str):
            found.append((path, None))
            continue
        owner = data.get("owner_pid")
        # A zombie owner is dead: where nothing reaps orphans (some containers' pid 1),
        # a killed MCP server stays one for good.
        if (isinstance(owner, int) and pid_alive(owner) and not _gone(owner)
                and (data.get("owner_start") is None
                     or process_start(owner) == data.get("owner_start"))):
            continue      # its ferrus still runs and will end it
        found.append((path, data))
    return found


def end_orphaned_checks(ferrus_dir):
    """End the processes of checks whose ferrus died (SIGKILL, a crash, a power cut).

    Identity is verified before any signal: the unique marker in a process's
    environment, or the recorded shell pid *and* start time.  Returns one line
    per pid file handled, for logs and `ferrus doctor`."""
    messages = []
    for path, data in orphaned_check_records(ferrus_dir):
        if data is not None:
            leader = data.get("leader_pid") if isinstance(data.get("leader_pid"), int) else None
            pids = end_check_processes(data["marker"], leader, data.get("leader_start"),
                                       grace=0.25)
            messages.append("check `%s` (started %s by ferrus pid %s): %s" % (
                data.get("command", "?"), data.get("started_at", "?"), data.get("owner_pid"),
                "ended pids %s" % ", ".join(str(p) for p in sorted(pids)) if pids
                else "no process was left"))
        else:
            messages.append("unreadable pid file %s removed" % os.path.basename(path))
        with contextlib.suppress(OSError):
            os.unlink(path)
    return messages


def report_orphaned_checks(store):
    """At start-up: end what checks of a dead ferrus left running, and say so on stderr."""
    for message in end_orphaned_checks(store.dir):
        log.warning("left by a ferrus that died: %s", message)


def _pump_output(stream, sink):
    with stream:
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            if not chunk:
                return
            sink.feed(chunk)


class _StopFlag:
    """Set by fail_fast or at the end of a run, and reads as set once ``cancel`` is.

    Checking ``cancel`` where the flag is read, instead of forwarding it from a
    watcher thread, leaves no thread to join: joining one cost every run up to
    its 50 ms poll."""

    def __init__(self, cancel=None):
        self._event = threading.Event()
        self._cancel = cancel

    def set(self):
        self._event.set()

    def is_set(self):
        return self._event.is_set() or (self._cancel is not None and self._cancel.is_set())


def run_checks(root, checks, log_dir, attempt=1, keep_lines=30, cancel=None, project=None,
               wrap=None, env=None):
    """Run the configured check commands (never anything an agent supplies) in ``root``.

    Every command streams into its own log file under ``log_dir``; a summary
    file names them all, by paths relative to ``project`` (default ``root``: a parallel
    task's checks run in its worktree, its logs are the project's).  ``cancel`` (a
    threading.Event) stops the run and kills the process groups.  ``wrap(argv)``
    confines each command (the task's sandbox); ``env`` adds variables to each command's
    environment (a parallel task's FERRUS_TASK_PORT)."""
    os.makedirs(log_dir, exist_ok=True)
    stamp = "%s_%s" % (utc_now().strftime("%Y%m%dT%H%M%S"), random_hex(3))
    base = os.path.join(log_dir, "check_%d_%s" % (attempt, stamp))
    root = os.path.abspath(root)
    results = []
    for index, command in enumerate(checks.commands, 1):
        log_path_abs = "%s.%d.log" % (base, index)
        results.append(CommandResult(
            command=command, log_path_abs=log_path_abs,
            log_path=os.path.relpath(log_path_abs, project or root).replace(os.sep, "/")))
    stop = _StopFlag(cancel)

    def run(result):
        _run_one_command(root, result, checks.timeout_secs, keep_lines, stop, log_dir,
                         checks.max_log_bytes, wrap=wrap, env=env)
        if checks.fail_fast and not result.passed:
            stop.set()

    try:
        if checks.parallel:
            threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in results]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for result in results:
                if stop.is_set():
                    break
                run(result)
    finally:
        cancelled = cancel is not None and cancel.is_set()
        stop.set()
    summary = base + ".txt"
    lines = []
    for result in results:
        label = {"passed": "PASS", "failed": "FAIL"}.get(result.status, result.status.upper())
        lines.append("=== [%s] %s\n" % (label, result.command))
        lines.append("exit: %s, %.2f s, %d lines, log: %s%s\n\n" % (
            result.exit_code, result.duration, result.line_count, result.log_path,
            "" if _log_description(result) == "full output"
            else " (%s)" % _log_description(result)))
    with open(summary, "w", encoding="utf-8") as handle:
        handle.writelines(lines)
    return CheckRun(results=results, cancelled=cancelled,
                    log_path=os.path.relpath(summary, project or root).replace(os.sep, "/"))
