#!/usr/bin/env python3
"""ferrus — deterministic, restart-safe orchestration of coding agents.

ferrus drives coding agents through a Supervisor → Executor → Reviewer loop.  The
loop is an explicit state machine kept on disk in ``.ferrus/``; agents are
stateless workers that move it forward only through ferrus's MCP tools, and a
check gate (the project's own lint and test commands) plus a reviewer stand
between "done" and "accepted".

This file is the whole tool.  It uses only the Python standard library and runs
on CPython 3.9+ on Linux, macOS and Windows.  Run it as ``python ferrus.py``,
``python -m ferrus``, through the ``ferrus`` launcher, or as an installed
``ferrus`` command — all four behave the same.

Other programs may import ferrus.  What they may rely on is listed in ``__all__``:
the store and its state types, the operations (``op_*``, the one implementation of
every behaviour), the config loader and its dataclasses, the MCP server entry
``serve_stdio``, ``main`` and ``FerrusError``.  Everything else may change between
versions without notice.

Contents (each section uses only the sections above it):

     1. Basics .................. version, errors, time, JSON helpers
     2. Platform ................ file locks, atomic writes, process groups
     3. TOML .................... reading (tomllib or built-in) and line-preserving edits
     4. Config .................. ferrus.toml as validated dataclasses
     5. Task state machine ...... states, the transition table, pure transitions, leases
     6. Session state machine ... supervising one agent slot, pure
     7. Capacity gates .......... usage signals to tier and action, pure
     8. Store ................... paths, transactions, the journal, waiting
     9. Checks .................. the check runner
    10. Git ..................... a task's base, diff, branch and commit; task worktrees
    11. Specs ................... spec and milestone parsing, selection, completion
    12. Operations .............. one function per behaviour, shared by MCP, HQ and the CLI
    13. MCP ..................... JSON-RPC 2.0 stdio server, tools, resources, prompts
    14. Agents .................. one adapter per agent CLI, register, prompts for every mode
    15. Sessions ................ supervised agent processes, the HQ controller, `ferrus run`
    16. Pipelines ............... workflows.json, status.json, the reconcile loop
    17. Init and doctor ......... scaffolding a project, checking and repairing .ferrus/
    18. Packaging ............... ferrus as its own PEP 517 build backend (``pip install .``)
    19. HQ front ends ........... the plain-line shell and the curses screen over the controller
    20. CLI ..................... argparse front end, ``main(argv) -> int``
"""

import sys

# `python ferrus.py` puts the script's folder first on sys.path, and `python -m ferrus`
# the current folder.  When ferrus.py sits in a project root that has its own queue.py,
# logging.py or enum.py, those would be imported instead of the standard library, so
# that entry goes before any other import (ferrus needs nothing but the standard
# library).  -I and -P (3.11+) add no such entry.
if (__name__ == "__main__" and sys.path and not sys.flags.isolated
        and not getattr(sys.flags, "safe_path", False)):
    del sys.path[0]


def _interrupted_while_starting(signum, frame):
    """Ctrl+C before main() runs is only noted (raising in the middle of an import can
    be lost or leave a half-imported module); main() then exits 130 at once, having
    done nothing, instead of Python printing a traceback of its import machinery."""
    _interrupted_while_starting.interrupted = True


_interrupted_while_starting.ferrus_startup = True
_interrupted_while_starting.interrupted = False

if __name__ == "__main__":
    import signal as _signal  # noqa: E402
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:   # not ignored
        _signal.signal(_signal.SIGINT, _interrupted_while_starting)

import argparse  # noqa: E402  (the imports below must follow the sys.path fix above)
import atexit
import base64
import collections
import contextlib
import dataclasses
import datetime as _dt
import difflib
import enum
import errno
import getpass
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.parse

__version__ = "0.1.0"

# The public interface (see the module docstring); everything else may change.
__all__ = [
    "__version__", "main", "FerrusError", "TransitionError",
    # the config loader and its dataclasses (section 4)
    "load_config", "Config", "ChecksConfig", "LimitsConfig", "LeaseConfig", "SpecConfig",
    "AgentChoice", "AgentOptions", "CustomAgentSpec", "AgentsConfig", "CapacityConfig",
    "SessionsConfig", "PipelinesConfig", "NotifyConfig", "GitConfig", "ParallelConfig",
    # the store and its state types (sections 5 and 8)
    "Store", "TaskState", "StateData",
    # the operations and what they take and give (section 12)
    "Caller", "HUMAN", "Outcome",
    "op_create_task", "op_review_pending", "op_approve", "op_reject", "op_human_approve",
    "op_human_reject", "op_respond_consult", "op_create_spec", "op_select_milestone",
    "op_stage_task_origin", "op_clear_selection", "op_wait_for_task", "op_wait_for_review",
    "op_wait_for_consult", "op_wait_for_answer", "op_check", "op_submit", "op_consult",
    "op_ask_human", "op_answer", "op_status", "op_reset", "op_force_reset",
    "op_rotate_journal", "op_heartbeat", "op_release_sessions", "op_run_checks_only",
    "op_diff", "op_enqueue_task", "op_enqueue_milestone", "op_enqueue_ready", "op_cancel_task",
    "op_retry_task",
    "op_integrated", "op_integration_failed",
    # the MCP server over stdio (section 13)
    "serve_stdio",
]

log = logging.getLogger("ferrus")


# ============================================================================
# 1. Basics
# ============================================================================

class FerrusError(Exception):
    """An expected failure: a message for the user and, usually, how to fix it."""

    exit_code = 1

    def __init__(self, message, hint=None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self):
        return self.message

    def full_text(self):
        """The message with its hint, as MCP tool errors carry the whole cause."""
        if self.hint:
            return "%s\nhint: %s" % (self.message, self.hint)
        return self.message


class UsageError(FerrusError):
    """Bad command-line usage; exits 2 like argparse does."""

    exit_code = 2


class TransitionError(FerrusError):
    """An action that the task state machine does not allow from the current state."""

    def __init__(self, action, state, hint=None):
        super().__init__(
            "cannot %s from state %s — current state is invalid for this operation"
            % (action, state), hint)
        self.action = action
        self.state = state


def utc_now():
    """The current time as an aware UTC datetime (the default clock everywhere)."""
    return _dt.datetime.now(_dt.timezone.utc)


def format_timestamp(moment):
    """RFC 3339 in UTC with a ``Z``; the fraction uses the fewest of 0/3/6 exact digits.

    This matches what upstream ferrus writes (it may also write 9 digits, which
    :func:`parse_timestamp` reads)."""
    moment = moment.astimezone(_dt.timezone.utc)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    micros = moment.microsecond
    if micros:
        text += ".%03d" % (micros // 1000) if micros % 1000 == 0 else ".%06d" % micros
    return text + "Z"


_TIMESTAMP_RE = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))$")


def parse_timestamp(text):
    """Parse an RFC 3339 timestamp (any offset, up to 9 fraction digits) to aware UTC."""
    match = _TIMESTAMP_RE.match(text.strip()) if isinstance(text, str) else None
    if not match:
        raise ValueError("not an RFC 3339 timestamp: %r" % (text,))
    year, month, day, hour, minute, second = (int(g) for g in match.group(1, 2, 3, 4, 5, 6))
    fraction = match.group(7) or ""
    micros = int((fraction + "000000")[:6])
    offset = _dt.timedelta(0)
    if match.group(9):
        offset = _dt.timedelta(hours=int(match.group(10)), minutes=int(match.group(11)))
        if match.group(9) == "-":
            offset = -offset
    try:
        moment = _dt.datetime(year, month, day, hour, minute, second, micros,
                              tzinfo=_dt.timezone(offset))
        return moment.astimezone(_dt.timezone.utc)
    except OverflowError:
        raise ValueError("timestamp out of range: %r" % (text,)) from None


def format_duration(seconds):
    """A short human duration: ``45s``, ``3m12s``, ``2h05m``, ``3d4h``."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return "%ds" % seconds
    if seconds < 3600:
        return "%dm%02ds" % divmod(seconds, 60)
    if seconds < 86400:
        return "%dh%02dm" % (seconds // 3600, seconds % 3600 // 60)
    return "%dd%dh" % (seconds // 86400, seconds % 86400 // 3600)


def compact_json(value):
    """Compact JSON with sorted keys — the shape upstream's tool bodies have."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def pretty_json(value):
    """Indented JSON with keys in insertion order and no trailing newline."""
    return json.dumps(value, indent=2, ensure_ascii=False)


# Every C0 control except tab and newline, DEL, and every C1 control (U+0080–U+009F;
# some terminals act on UTF-8-encoded C1 such as U+009B CSI).  ESC is among them, so
# no escape sequence (OSC 52 clipboard, window title, clear screen) survives.
_TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _visible_control(match):
    code = ord(match.group())
    if code < 0x20 or code == 0x7f:
        return "^" + chr(code ^ 0x40)       # caret notation: ESC → ^[, CR → ^M, DEL → ^?
    return "\\x%02x" % code


def terminal_safe(text):
    """``text`` with every terminal control made visible, for printing to a terminal.

    Agents, checks and files are untrusted: what they wrote is shown, never obeyed.
    Newline and tab are kept; every other character (CJK, emoji, accents) is
    untouched.  Applied where text is printed, never to what is stored."""
    text = text if isinstance(text, str) else str(text)
    return _TERMINAL_CONTROLS.sub(_visible_control, text)


def say(text="", file=None, flush=False):
    """print() for every line that may carry agent, check or file text."""
    print(terminal_safe(text), file=file if file is not None else sys.stdout, flush=flush)


def json_for_terminal(text):
    """JSON text with DEL and C1 controls written as \\u escapes: the same value when
    parsed (json already escapes C0), and nothing a terminal would act on."""
    return _TERMINAL_CONTROLS.sub(lambda match: "\\u%04x" % ord(match.group()), text)


def random_hex(nbytes):
    """``nbytes`` random bytes from the OS as hex: what ``secrets.token_hex`` does,
    without importing secrets (hmac, hashlib) into every start-up."""
    return os.urandom(nbytes).hex()


def new_id(prefix):
    """A short unique id such as ``t-20261123T085200-3fa2c1``."""
    stamp = utc_now().strftime("%Y%m%dT%H%M%S")
    return "%s-%s-%s" % (prefix, stamp, random_hex(3))


def did_you_mean(word, candidates):
    """The known name closest to a mistyped one, or None (difflib; argparse suggests
    only from Python 3.14 on)."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


# ============================================================================
# 2. Platform
# ============================================================================

IS_WINDOWS = os.name == "nt"

if IS_WINDOWS:  # pragma: no cover - exercised on Windows only
    import msvcrt
else:
    import fcntl


class LockTimeout(FerrusError):
    pass


class FileLock:
    """An exclusive advisory lock on a file, with a bounded wait.

    POSIX uses ``flock`` (not ``lockf``) so that upstream ferrus, which locks
    STATE.lock the same way, excludes us and we exclude it.  Windows locks the
    first byte with ``msvcrt.locking``.  The lock is re-entrant per instance
    only in the sense that nesting is refused: one holder at a time."""

    def __init__(self, path, timeout=10.0, what=None):
        self.path = path
        self.timeout = timeout
        self.what = what or path
        self._fd = None

    SLOW_WAIT = 2.0   # a wait this long is logged once (and reaches MCP clients)

    def acquire(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        started = time.monotonic()
        deadline = started + self.timeout
        pause = 0.0005
        slow_logged = False
        while True:
            try:
                if IS_WINDOWS:  # pragma: no cover
                    os.lseek(fd, 0, os.SEEK_SET)
                    msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
                else:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return self
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK,
                                     getattr(errno, "EDEADLK", -1)):
                    os.close(fd)
                    raise
            if time.monotonic() >= deadline:
                os.close(fd)
                raise LockTimeout(
                    "timed out after %.0f s waiting for the lock on %s" % (self.timeout, self.what),
                    "another ferrus process (or upstream ferrus) is holding it; if none is "
                    "running, the lock is stale only in theory — flock locks die with their "
                    "process — so check for a hung `ferrus` process")
            if not slow_logged and time.monotonic() - started >= self.SLOW_WAIT:
                slow_logged = True
                log.warning("waited %.1f s so far for the lock on %s; another ferrus process "
                            "holds it", time.monotonic() - started, self.what)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def release(self):
        if self._fd is None:
            return
        try:
            if IS_WINDOWS:  # pragma: no cover
                os.lseek(self._fd, 0, os.SEEK_SET)
                msvcrt.locking(self._fd, msvcrt.LK_UNLCK, 1)
            else:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def fsync_directory(path):
    """Make a rename inside ``path`` durable (a no-op where directories can't be opened)."""
    if IS_WINDOWS:  # pragma: no cover
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


TEMP_SUFFIX = ".ferrus-tmp"


def _current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once at import: os.umask can only be read by setting it, which is not
# thread-safe later on.
_UMASK = _current_umask()


def atomic_write(path, data, durable=True):
    """Replace ``path`` with ``data`` (str or bytes) so readers see old or new, never half.

    A uniquely named temporary file in the same directory is written, flushed and
    fsynced, then renamed over the target, and the directory is fsynced.  On any
    failure (a full disk, a read-only file) the temporary file is removed and the
    previous content stays intact.  ``durable=False`` skips the fsyncs, for
    counters that may lose their last increments in a power cut."""
    temp = write_temp_beside(path, data, durable)
    try:
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    if durable:
        fsync_directory(os.path.dirname(os.path.abspath(path)))


def write_temp_beside(path, data, durable=True):
    """Write ``data`` to a new temporary file in ``path``'s folder; return its name.

    The first half of atomic_write: renaming the result over ``path`` is the
    second.  The temporary file gets ``path``'s mode (or the usual one for a new
    file) and is removed again if writing it fails."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory = os.path.dirname(os.path.abspath(path))
    # The temporary name is longer than the target's; a shortened prefix keeps a
    # target near the 255-byte name limit writable.
    fd, temp = tempfile.mkstemp(prefix="." + os.path.basename(path)[:96] + ".",
                                suffix=TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        # mkstemp makes 0600 files; keep the old mode, or the usual one for new files.
        with contextlib.suppress(OSError):
            mode = os.stat(path).st_mode & 0o7777 if os.path.exists(path) else 0o666 & ~_UMASK
            os.chmod(temp, mode)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return temp


def open_private_log(path):
    """Open ``path`` for appending, readable by its owner only (0600).

    Agent session logs hold whole transcripts (code, prompts, sometimes secrets an
    agent printed), so they are created 0600 whatever the umask, and an existing
    one written by an older ferrus is narrowed to 0600 too."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags, 0o600)
    if not IS_WINDOWS:
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def read_text(path, default=None):
    """Read a UTF-8 text file; ``default`` when it does not exist (if given)."""
    try:
        with open(path, "r", encoding="utf-8", errors="replace", newline="") as handle:
            return handle.read()
    except FileNotFoundError:
        if default is None:
            raise
        return default


class UnsafePath(FerrusError):
    """A file ferrus will not read: a symbolic link, a folder on the way that leads
    outside the base folder, or something other than a regular file."""


def open_inside(base, *parts):
    """``base/parts`` opened for binary reading without leaving ``base``.

    A symbolic link as the file itself is never followed (an agent could point
    TASK.md or a check log at any file of the machine), a folder on the way must
    resolve inside ``base``, and only regular files are opened (a FIFO would block
    the reader).  Raises UnsafePath, or OSError (FileNotFoundError, ...)."""
    shown = "/".join((os.path.basename(base),) + parts)
    real_base = os.path.realpath(base)
    path = os.path.join(base, *parts)
    parent = os.path.realpath(os.path.dirname(path))
    if parent != real_base and not parent.startswith(real_base + os.sep):
        raise UnsafePath("%s is outside %s/ (a symbolic link on the way)"
                         % (shown, os.path.basename(base)),
                         "ferrus reads only files inside %s/; remove the link"
                         % os.path.basename(base))
    link_refused = UnsafePath("%s is a symbolic link; ferrus does not follow links there"
                              % shown, "replace the link with the file itself")
    if not hasattr(os, "O_NOFOLLOW") and os.path.islink(path):  # pragma: no cover - Windows
        raise link_refused
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise link_refused from err
        raise
    try:
        if (os.fstat(fd).st_mode & 0o170000) != 0o100000:   # stat.S_ISREG
            raise UnsafePath("%s is not a regular file" % shown)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def shell_argv(command):
    """The argv that runs one check command through the platform shell."""
    if IS_WINDOWS:  # pragma: no cover
        return ["cmd", "/C", command]
    return ["/bin/sh", "-c", command]


def process_group_kwargs():
    """Popen keyword arguments that put the child in its own process group."""
    if IS_WINDOWS:  # pragma: no cover
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


def kill_process_tree(proc, grace=0.25):
    """Stop ``proc`` and everything it started: TERM to the group, then KILL."""
    if proc.poll() is not None and IS_WINDOWS:  # pragma: no cover
        return
    if IS_WINDOWS:  # pragma: no cover
        subprocess.run(["taskkill", "/T", "/F", "/PID", str(proc.pid)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        if sig == signal.SIGKILL:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.01)
        # The leader may be gone while grandchildren linger in the group, so the
        # group still gets the KILL.


def pid_alive(pid):
    """True when a process with this pid exists."""
    if not pid or pid <= 0:
        return False
    if IS_WINDOWS:  # pragma: no cover
        import ctypes
        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)
        if not handle:
            return False
        ctypes.windll.kernel32.CloseHandle(handle)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


ProcessInfo = collections.namedtuple("ProcessInfo", "pid ppid pgid sid start zombie")


def _proc_stat(pid):
    """ProcessInfo from Linux's /proc/<pid>/stat, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return ProcessInfo(pid, int(fields[1]), int(fields[2]), int(fields[3]),
                           fields[19].decode("ascii"), fields[0] == b"Z")
    except (IndexError, ValueError):
        return None


HAS_PROC = not IS_WINDOWS and os.path.isdir("/proc/self") and _proc_stat(os.getpid()) is not None


def process_table(candidate=None):
    """Every visible process as {pid: ProcessInfo} (only pids ``candidate`` accepts).

    Linux reads /proc (start = boot-relative start time, sid known); other POSIX
    systems ask ``ps`` (no session, start time only through process_start);
    Windows returns {}."""
    if IS_WINDOWS:  # pragma: no cover
        return {}
    table = {}
    if HAS_PROC:
        for name in os.listdir("/proc"):
            if name.isdigit() and (candidate is None or candidate(int(name))):
                info = _proc_stat(int(name))
                if info is not None:
                    table[info.pid] = info
        return table
    try:  # pragma: no cover - macOS and the BSDs
        output = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid=", "-o", "pgid=",
                                 "-o", "stat="], capture_output=True, text=True,
                                timeout=10).stdout
    except (OSError, subprocess.SubprocessError):  # pragma: no cover
        return table
    for line in output.splitlines():  # pragma: no cover
        parts = line.split()
        if len(parts) >= 3 and all(p.isdigit() for p in parts[:3]):
            pid, ppid, pgid = (int(p) for p in parts[:3])
            zombie = len(parts) > 3 and parts[3].startswith("Z")
            table[pid] = ProcessInfo(pid, ppid, pgid, None, None, zombie)
    return table


def process_start(pid):
    """An opaque start-time token of ``pid`` (None when unknown or gone).

    With the pid it names one process for good: a pid reused later gets another
    start time, so a stale pid file never makes ferrus signal a stranger."""
    if IS_WINDOWS:  # pragma: no cover
        return None
    if HAS_PROC:
        info = _proc_stat(pid)
        return info.start if info is not None else None
    try:  # pragma: no cover - macOS and the BSDs
        output = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # pragma: no cover
        return None
    return output or None  # pragma: no cover


def process_environ_has(pid, entry):
    """Does ``pid``'s environment hold ``entry`` (bytes, ``NAME=value``)?  Linux only."""
    if not HAS_PROC:
        return False
    try:
        with open("/proc/%d/environ" % pid, "rb") as handle:
            return entry in handle.read().split(b"\0")
    except OSError:
        return False


# ============================================================================
# 3. TOML
# ============================================================================

try:
    import tomllib
except ImportError:  # Python 3.9 and 3.10: the built-in parser below takes over
    tomllib = None

# Reading: parse_toml() uses tomllib when Python has it and parse_toml_builtin()
# otherwise.  The built-in parser reads all of TOML 1.0 and gives exactly what
# tomllib gives, errors included; the tests hold it to that.
#
# Writing: ferrus edits files that people also edit by hand, so it never
# re-serialises a whole document.  The editors below change only the lines they
# must and keep every other byte, comment and blank line where it was.


class TomlError(ValueError):
    """A TOML document that cannot be read, or an edit this section cannot make.

    The message is ``line <n>: <what is wrong>`` (n 1-based), or only what is
    wrong when the line is unknown."""

    def __init__(self, detail, line=None):
        super().__init__("line %s: %s" % (line, detail) if line else detail)


_TOML_TOMLLIB_WHERE = re.compile(r"\s*\(at (?:line (\d+), column \d+|end of document)\)$")


def parse_toml(text):
    """Parse a TOML document into a dict, with tomllib when Python has it."""
    if tomllib is None:
        return parse_toml_builtin(text)
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise TomlError("values are nested too deeply") from None
    except tomllib.TOMLDecodeError as exc:
        detail, line = str(exc), None
        where = _TOML_TOMLLIB_WHERE.search(detail)
        if where:
            # "end of document" is the last line, as the built-in parser says.
            line = int(where.group(1) or text.count("\n") + 1)
            detail = detail[:where.start()]
        raise TomlError(detail[:1].lower() + detail[1:], line) from None


def parse_toml_builtin(text):
    """Parse a TOML 1.0 document into a dict without tomllib."""
    if not isinstance(text, str):
        raise TypeError("TOML text must be str, not %s" % type(text).__name__)
    try:
        return _TomlParser(text).parse()
    except RecursionError:
        raise TomlError("values are nested too deeply") from None


# --- The built-in parser ----------------------------------------------------

_TOML_CTRL = "\x00-\x08\x0a-\x1f\x7f"      # control characters except tab
_TOML_ML_CTRL = "\x00-\x08\x0b-\x1f\x7f"   # ... and except newline
_TOML_WS = re.compile(r"[ \t]*")
_TOML_COMMENT = re.compile("#[^%s]*" % _TOML_CTRL)
_TOML_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_TOML_BASIC_CHUNK = re.compile('[^"\\\\%s]*' % _TOML_CTRL)
_TOML_ML_BASIC_CHUNK = re.compile('[^"\\\\%s]*' % _TOML_ML_CTRL)
_TOML_BAD_CHAR = re.compile("[%s]" % _TOML_CTRL)
_TOML_ML_BAD_CHAR = re.compile("[%s]" % _TOML_ML_CTRL)
_TOML_LINE_END_BACKSLASH = re.compile(r"[ \t]*\n[ \t\n]*")
_TOML_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}
_TOML_TIME = r"([01][0-9]|2[0-3]):([0-5][0-9]):([0-5][0-9])(?:\.([0-9]+))?"
_TOML_LOCAL_TIME = re.compile(_TOML_TIME)
_TOML_DATETIME = re.compile(
    r"([0-9]{4})-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r"(?:[Tt ]" + _TOML_TIME + r"(?:([Zz])|([+-])([01][0-9]|2[0-3]):([0-5][0-9]))?)?")
_TOML_NUMBER = re.compile(
    r"0x[0-9A-Fa-f](?:_?[0-9A-Fa-f])*|0o[0-7](?:_?[0-7])*|0b[01](?:_?[01])*"
    r"|[+-]?(?:0|[1-9](?:_?[0-9])*)"
    r"(?P<float>(?:\.[0-9](?:_?[0-9])*)?(?:[eE][+-]?[0-9](?:_?[0-9])*)?)")
_TOML_SPECIAL_FLOAT = re.compile(r"[+-]?(?:inf|nan)")
_TOML_WORD = re.compile(r"[^ \t\n,\]}#]*")


class _TomlStatement(collections.namedtuple("_TomlStatement", "header key array first last start end")):
    """Where one header or key/value sits in a document, for the editors.

    ``header`` holds the section's key parts and ``key`` the key/value's (None
    on a header line); ``first``/``last`` are the 0-based lines it spans and
    ``start``/``end`` the columns where its value begins and ends on them.
    """

    __slots__ = ()


class _TomlParser:
    """A recursive-descent TOML parser that reads one document once.

    How each table came to exist decides what may still be added to it:
    "implicit" tables (the ``a`` of ``[a.b]``) may still get a header of their
    own, "defined" ones (declared by a header) may not be declared again,
    "dotted" ones (made by ``a.b = 1``) grow only while their section lasts,
    "frozen" values (inline tables, arrays) never change and "aot" arrays of
    tables grow only through ``[[...]]`` headers.
    """

    def __init__(self, text, record=False):
        self.src = text.replace("\r\n", "\n")  # line numbers and columns survive this
        self.pos = 0
        self.root = {}
        # id() of each container -> its kind; ids stay unique because every
        # container lives on inside the result.
        self.kinds = {}
        # The current section: its key parts, its table, and the ids of the
        # tables its dotted keys made (which only it may extend).
        self.header, self.section, self.dotted = (), self.root, set()
        self.statements = [] if record else None

    def error(self, detail, pos=None):
        pos = self.pos if pos is None else pos
        return TomlError(detail, self.src.count("\n", 0, pos) + 1)

    def where(self, pos):
        """0-based (line, column) of a position."""
        return self.src.count("\n", 0, pos), pos - self.src.rfind("\n", 0, pos) - 1

    def parse(self):
        src = self.src
        while True:
            self.skip()
            if self.pos >= len(src):
                return self.root
            char, start = src[self.pos], self.pos
            if char == "\n":
                self.pos += 1
                continue
            if char == "[":
                key, array = self.table_header()
                self.record(key, None, array, start, start, start)
            elif char != "#":
                key, value_start = self.key_value(self.section, self.dotted, self.header)
                self.record(self.header, key, False, start, value_start, self.pos)
            self.skip()
            self.comment()
            if self.pos < len(src):
                if src[self.pos] != "\n":
                    raise self.error("expected the end of the line, found %r" % src[self.pos])
                self.pos += 1

    def record(self, header, key, array, first, start, end):
        if self.statements is not None:
            (first, start), (last, end) = self.where(start), self.where(end)
            self.statements.append(_TomlStatement(header, key, array, first, last, start, end))

    def skip(self, newlines=False):
        """Skip spaces and tabs; with `newlines` also line breaks and comments."""
        while True:
            self.pos = _TOML_WS.match(self.src, self.pos).end()
            char = self.src[self.pos:self.pos + 1]
            if not newlines or char not in ("\n", "#"):
                return
            if char == "\n":
                self.pos += 1
            self.comment()

    def comment(self):
        match = _TOML_COMMENT.match(self.src, self.pos)
        if match:
            self.pos = match.end()
            if self.src[self.pos:self.pos + 1] not in ("", "\n"):
                raise self.error("control characters are not allowed in comments")

    def table_header(self):
        start = self.pos
        array = self.src.startswith("[[", start)
        self.pos += 2 if array else 1
        self.skip()
        key = self.key()
        close = "]]" if array else "]"
        if not self.src.startswith(close, self.pos):
            raise self.error("expected %r to close the table header" % close)
        self.pos += len(close)
        self.open_table(key, array, start)
        return key, array

    def open_table(self, key, array, pos):
        """Make `key` the current section, creating the tables on its path."""
        name = _toml_header(key, array)
        table = self.root
        for i, part in enumerate(key[:-1]):
            child = table.get(part)
            if child is None:
                child = table[part] = {}
                self.kinds[id(child)] = "implicit"
            if isinstance(child, list) and self.kinds.get(id(child)) == "aot":
                child = child[-1]  # [a.b] after [[a]] extends the latest element
            elif not isinstance(child, dict) or self.kinds.get(id(child)) == "frozen":
                raise self.error("cannot define %s: %s is not a table" % (name, _toml_name(key[:i + 1])), pos)
            table = child
        existing = table.get(key[-1])
        if array and existing is None:
            existing = table[key[-1]] = []
            self.kinds[id(existing)] = "aot"
        if array and isinstance(existing, list) and self.kinds.get(id(existing)) == "aot":
            section = {}
            existing.append(section)
        elif not array and existing is None:
            section = table[key[-1]] = {}
        elif not array and isinstance(existing, dict) and self.kinds.get(id(existing)) == "implicit":
            section = existing
        else:
            raise self.error("cannot define %s: %s is already defined" % (name, _toml_name(key)), pos)
        self.kinds[id(section)] = "defined"
        self.header, self.section, self.dotted = key, section, set()

    def key(self):
        parts = [self.key_part()]
        self.skip()
        while self.src.startswith(".", self.pos):
            self.pos += 1
            self.skip()
            parts.append(self.key_part())
            self.skip()
        return tuple(parts)

    def key_part(self):
        bare = _TOML_BARE_KEY.match(self.src, self.pos)
        if bare:
            self.pos = bare.end()
            return bare.group()
        char = self.src[self.pos:self.pos + 1]
        if char == '"':
            return self.basic_string(multiline=False)
        if char == "'":
            return self.literal_string(multiline=False)
        raise self.error("expected a key, found %r" % char if char.strip() else "expected a key")

    def key_value(self, table, dotted, prefix):
        """Parse `key = value` into `table`; return the key and where its value starts."""
        start = self.pos
        key = self.key()
        if not self.src.startswith("=", self.pos):
            raise self.error("expected '=' after key %s" % _toml_name(key))
        self.pos += 1
        self.skip()
        value_start = self.pos
        value = self.value()
        for i, part in enumerate(key[:-1]):
            child = table.get(part)
            if child is None:
                child = table[part] = {}
            elif not isinstance(child, dict) or (
                    id(child) not in dotted and self.kinds.get(id(child)) != "implicit"):
                raise self.error("cannot add keys to %s: it is already defined"
                                 % _toml_name(prefix + key[:i + 1]), start)
            self.kinds[id(child)] = "dotted"
            dotted.add(id(child))
            table = child
        if key[-1] in table:
            raise self.error("duplicate key %s" % _toml_name(prefix + key), start)
        table[key[-1]] = value
        if isinstance(value, (dict, list)):
            self.kinds[id(value)] = "frozen"
        return key, value_start

    def value(self):
        src, pos = self.src, self.pos
        char = src[pos:pos + 1]
        if char == '"':
            return self.basic_string(src.startswith('"""', pos))
        if char == "'":
            return self.literal_string(src.startswith("'''", pos))
        if char == "[":
            return self.array()
        if char == "{":
            return self.inline_table()
        for word, value in (("true", True), ("false", False)):
            if src.startswith(word, pos):
                self.pos += len(word)
                return value
        match = _TOML_DATETIME.match(src, pos)
        if match:
            self.pos = match.end()
            try:
                return _toml_datetime(match)
            except ValueError:
                raise self.error("invalid date %s" % match.group(), pos) from None
        match = _TOML_LOCAL_TIME.match(src, pos)
        if match:
            self.pos = match.end()
            hour, minute, second, fraction = match.groups()
            return _dt.time(int(hour), int(minute), int(second), _toml_micros(fraction))
        match = _TOML_NUMBER.match(src, pos)
        if match:
            self.pos = match.end()
            number = match.group().replace("_", "")
            return float(number) if match.group("float") else int(number, 0)
        match = _TOML_SPECIAL_FLOAT.match(src, pos)
        if match:
            self.pos = match.end()
            return float(match.group())
        word = _TOML_WORD.match(src, pos).group()
        raise self.error("invalid value %s" % word if word else "expected a value")

    def basic_string(self, multiline):
        src, start = self.src, self.pos
        pos = start + (3 if multiline else 1)
        if multiline and src.startswith("\n", pos):
            pos += 1  # a newline right after the opening quotes is not content
        chunk = _TOML_ML_BASIC_CHUNK if multiline else _TOML_BASIC_CHUNK
        parts = []
        while True:
            match = chunk.match(src, pos)
            parts.append(match.group())
            pos = match.end()
            char = src[pos:pos + 1]
            if char == '"' and (not multiline or src.startswith('"""', pos)):
                self.pos = pos + (3 if multiline else 1)
                return "".join(parts) + (self.extra_quotes('"') if multiline else "")
            if char == '"':
                parts.append(char)
                pos += 1
            elif char == "\\":
                pos = self.escape(pos, multiline, parts)
            elif char in ("", "\n"):
                raise self.error("unterminated string", start)
            else:
                raise self.error("control character U+%04X must be escaped" % ord(char), pos)

    def escape(self, pos, multiline, parts):
        """Decode the escape at `pos` into `parts`; return the position after it."""
        src = self.src
        char = src[pos + 1:pos + 2]
        if multiline and char in (" ", "\t", "\n"):
            # A line-ending backslash swallows the line break and the blank space after it.
            match = _TOML_LINE_END_BACKSLASH.match(src, pos + 1)
            if not match:
                raise self.error("only spaces may follow a line-ending backslash", pos)
            return match.end()
        if char in _TOML_ESCAPES:
            parts.append(_TOML_ESCAPES[char])
            return pos + 2
        if char in ("u", "U"):
            size = 4 if char == "u" else 8
            digits = src[pos + 2:pos + 2 + size]
            if re.fullmatch("[0-9A-Fa-f]{%d}" % size, digits):
                code = int(digits, 16)
                if code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF:
                    parts.append(chr(code))
                    return pos + 2 + size
            raise self.error("\\%s needs %d hex digits naming a Unicode character" % (char, size), pos)
        raise self.error("invalid escape sequence \\%s" % char if char.strip()
                         else "a lone backslash must be written as \\\\", pos)

    def literal_string(self, multiline):
        src, start = self.src, self.pos
        if multiline:
            first = start + 3 + src.startswith("\n", start + 3)
            end = src.find("'''", first)
        else:
            first = start + 1
            end = src.find("'", first)
            if 0 <= src.find("\n", first) < end:
                end = -1
        if end < 0:
            raise self.error("unterminated string", start)
        body = src[first:end]
        bad = (_TOML_ML_BAD_CHAR if multiline else _TOML_BAD_CHAR).search(body)
        if bad:
            raise self.error("control characters are not allowed in strings", first + bad.start())
        self.pos = end + (3 if multiline else 1)
        return body + self.extra_quotes("'") if multiline else body

    def extra_quotes(self, quote):
        """Up to two quotes just before a closing triple quote belong to the string."""
        count = 0
        while count < 2 and self.src.startswith(quote, self.pos):
            count += 1
            self.pos += 1
        return quote * count

    def array(self):
        start = self.pos
        self.pos += 1
        items = []
        while True:
            self.skip(newlines=True)
            if self.src.startswith("]", self.pos):
                self.pos += 1
                return items
            items.append(self.value())
            self.skip(newlines=True)
            char = self.src[self.pos:self.pos + 1]
            if char not in (",", "]"):
                raise self.error("expected ',' or ']' in the array that starts on line %d"
                                 % (self.where(start)[0] + 1))
            self.pos += 1
            if char == "]":
                return items

    def inline_table(self):
        self.pos += 1
        table, dotted = {}, set()
        self.skip()
        if self.src.startswith("}", self.pos):
            self.pos += 1
            return table
        while True:
            self.key_value(table, dotted, ())
            self.skip()
            char = self.src[self.pos:self.pos + 1]
            if char not in (",", "}"):
                raise self.error("expected ',' or '}' in an inline table (which must fit on one line)")
            self.pos += 1
            if char == "}":
                return table
            self.skip()


def _toml_datetime(match):
    """A date or datetime from a _TOML_DATETIME match, as tomllib builds it."""
    year, month, day, hour, minute, second, fraction, zulu, sign, off_hour, off_minute = match.groups()
    if hour is None:
        return _dt.date(int(year), int(month), int(day))
    tzinfo = None
    if zulu:
        tzinfo = _dt.timezone.utc
    elif sign:
        offset = _dt.timedelta(hours=int(off_hour), minutes=int(off_minute))
        tzinfo = _dt.timezone(-offset if sign == "-" else offset)
    return _dt.datetime(int(year), int(month), int(day), int(hour), int(minute), int(second),
                        _toml_micros(fraction), tzinfo=tzinfo)


def _toml_micros(fraction):
    """Microseconds from the digits after the decimal point; extra precision is dropped."""
    return int((fraction or "0")[:6].ljust(6, "0"))


# --- Writing values ---------------------------------------------------------

_TOML_QUOTE_NEEDED = re.compile('["\\\\\x00-\x1f\x7f]')
_TOML_QUOTE_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t",
                       "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_quote(text):
    """`text` as a TOML basic string."""
    escape = lambda m: _TOML_QUOTE_ESCAPES.get(m.group(), "\\u%04x" % ord(m.group()))  # noqa: E731
    return '"%s"' % _TOML_QUOTE_NEEDED.sub(escape, text)


def format_toml_key(key):
    """A key as TOML writes it: bare when it can be, quoted otherwise."""
    if not isinstance(key, str):
        raise TypeError("TOML keys must be str, not %s" % type(key).__name__)
    return key if _TOML_BARE_KEY.fullmatch(key) else _toml_quote(key)


def format_toml_value(value):
    """A value as TOML text on one line (lists as arrays, dicts as inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        return repr(value) if abs(value) != float("inf") else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return _toml_quote(value)
    if isinstance(value, (list, tuple)):
        return "[%s]" % ", ".join(format_toml_value(item) for item in value)
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ %s }" % ", ".join("%s = %s" % (format_toml_key(k), format_toml_value(v))
                                    for k, v in value.items())
    raise TypeError("cannot write a %s as a TOML value" % type(value).__name__)


def _toml_header(parts, array=False):
    """The header line of a table, e.g. ``[projects."/abs/path"]``."""
    text = ".".join(format_toml_key(part) for part in parts)
    return "[[%s]]" % text if array else "[%s]" % text


def _toml_name(parts):
    """Key parts as a readable dotted name for messages, e.g. ``"hq.supervisor"``."""
    return '"%s"' % ".".join(parts)


# --- Line-preserving edits --------------------------------------------------
#
# The editors parse the document once with the built-in parser, which notes
# where each header and key/value sits.  A section is a header (or the start of
# the document, for the root table) with the key/values that follow it.  The
# editors refuse, with a TomlError, to touch anything defined in a way a line
# edit could not change safely: keys inside inline tables, tables made by
# dotted keys in a parent section, and anything inside an array of tables.


def _toml_sections(text):
    """[(header statement or None for the root, [key/value statements])] in order."""
    parser = _TomlParser(text, record=True)
    parser.parse()
    sections = [(None, [])]
    for statement in parser.statements:
        if statement.key is None:
            sections.append((statement, []))
        else:
            sections[-1][1].append(statement)
    return sections


def _toml_starts(parts, prefix):
    """Whether key parts `parts` begin with `prefix` (or equal it)."""
    return parts[:len(prefix)] == prefix


def _toml_cannot(statement, what, why):
    return TomlError("cannot edit %s: %s; change it by hand" % (what, why), statement.first + 1)


def _toml_clash(pair, full, target, what):
    """The error for a key/value at `full` that overlaps `target` beyond a line edit's reach."""
    if len(full) > len(target) or (full == target and len(pair.key) > 1):
        return _toml_cannot(pair, what, "it is made by dotted keys on this line")
    return _toml_cannot(pair, what, "the value set on this line is in the way")


def _toml_locate(text, table, key):
    """Find `key` directly under `[table]`: (section or None, statement or None)."""
    want = table + (key,)
    what = _toml_name(want)
    section = found = None
    for head, pairs in _toml_sections(text):
        path = head.header if head else ()
        if head and head.array and _toml_starts(want, path):
            raise _toml_cannot(head, what, "it is inside the array of tables declared on this line")
        if head and not head.array and _toml_starts(path, want):
            raise _toml_cannot(head, what, "it is a table (see the header on this line), not a key")
        if path == table:
            section = (head, pairs)
        for pair in pairs:
            full = path + pair.key
            if path == table and pair.key == (key,):
                found = pair
            elif (_toml_starts(full, want) or _toml_starts(want, full)
                  or (len(path) < len(table) and _toml_starts(full, table))):
                raise _toml_clash(pair, full, want, what)
    return section, found


def _toml_cr(text):
    """What ends each line of text.split("\\n") before its "\\n": "\\r" in CRLF files."""
    return "\r" if "\r\n" in text else ""


def _toml_delete(lines, first, last):
    """Delete lines first..last of a text.split("\\n") list."""
    # Deleting the unterminated last line keeps the line break before it.
    lines[first:last + 1] = [""] if last == len(lines) - 1 else []


def _toml_append(text, block):
    """Add lines at the end, after one blank line, ending with a line break."""
    newline = _toml_cr(text) + "\n"
    if text and not text.endswith("\n"):
        text += newline
    if text and text.split("\n")[-2].strip():
        text += newline
    return text + newline.join(block) + newline


def toml_set_key(text, table, key, value):
    """Set `key` under `[table]` (``()`` is the root) to `value`, changing as little as possible.

    An existing value is replaced in place, keeping the indentation, the text
    before the value and any comment after it.  A new key goes after the last
    key/value of its table, and a missing table is appended to the document.
    """
    rendered = format_toml_value(value)
    table = tuple(table)
    section, found = _toml_locate(text, table, key)
    line = "%s = %s" % (format_toml_key(key), rendered)
    if section is None:
        return _toml_append(text, [_toml_header(table), line])
    lines = text.split("\n")
    if found:
        before, after = lines[found.first][:found.start], lines[found.last][found.end:]
        lines[found.first:found.last + 1] = [before + rendered + after]
        return "\n".join(lines)
    head, pairs = section
    indent = ""
    if pairs:
        at = pairs[-1].last + 1
        indent = re.match(r"[ \t]*", lines[pairs[-1].first]).group()
    elif head:
        at = head.first + 1
    else:  # a root key with no other root keys goes after the file's opening comments
        at = 0
        while at < len(lines) - 1 and lines[at].lstrip().startswith("#"):
            at += 1
    if at == len(lines):  # the document has no final line break: give it one
        lines[-1] += _toml_cr(text)
        lines.append("")
    lines.insert(at, indent + line + _toml_cr(text))
    return "\n".join(lines)


def toml_remove_key(text, table, key):
    """Remove `key` (all of its lines) from `[table]`; unchanged text when it is absent."""
    found = _toml_locate(text, tuple(table), key)[1]
    if not found:
        return text
    lines = text.split("\n")
    _toml_delete(lines, found.first, found.last)
    return "\n".join(lines)


def _toml_table_spans(text, table):
    """The (first, last) lines of each section of `table` and its sub-tables.

    A span ends at the section's last key/value, so blank lines and comments
    that lead into the next section stay with that section.
    """
    if not table:
        raise ValueError("a table edit needs a table name; () is the whole document")
    what, spans = _toml_header(table), []
    for head, pairs in _toml_sections(text):
        path = head.header if head else ()
        if head and _toml_starts(path, table):
            spans.append((head.first, pairs[-1].last if pairs else head.first))
            continue
        if head and head.array and _toml_starts(table, path):
            raise _toml_cannot(head, what, "it is inside the array of tables declared on this line")
        for pair in pairs:
            full = path + pair.key
            if _toml_starts(full, table) or _toml_starts(table, full):
                raise _toml_clash(pair, full, table, what)
    return spans


def _toml_delete_section(lines, first, last):
    """Delete a section span with the blank lines that separated it from its neighbours."""
    header = first
    while first > 0 and not lines[first - 1].strip():
        first -= 1
    if first == header:  # no blank lines above: take the ones below instead
        while last < len(lines) - 2 and not lines[last + 1].strip():
            last += 1
    _toml_delete(lines, first, last)


def _toml_render_table(table, mapping):
    """Lines for `[table]`: its plain values, then each nested dict as a sub-table."""
    if not isinstance(mapping, dict):
        raise TypeError("a TOML table must be a dict, not %s" % type(mapping).__name__)
    plain = ["%s = %s" % (format_toml_key(k), format_toml_value(v))
             for k, v in mapping.items() if not isinstance(v, dict)]
    nested = [(k, v) for k, v in mapping.items() if isinstance(v, dict)]
    # A table holding only sub-tables needs no header of its own.
    lines = [_toml_header(table)] + plain if plain or not nested else []
    for name, sub in nested:
        lines += ([""] if lines else []) + _toml_render_table(table + (name,), sub)
    return lines


def toml_replace_table(text, table, mapping):
    """Replace `[table]` and all its sub-tables with a fresh rendering of `mapping`.

    The new text goes where the first of those sections was (or at the end).
    Comments inside the replaced sections are lost with them; every other
    byte, including comments just above the next section, stays as it was.
    """
    table = tuple(table)
    rendered = _toml_render_table(table, mapping)
    spans = _toml_table_spans(text, table)
    if not spans:
        return _toml_append(text, rendered)
    lines = text.split("\n")
    for first, last in reversed(spans[1:]):
        _toml_delete_section(lines, first, last)
    first, last = spans[0]
    if last == len(lines) - 1:  # the document has no final line break: give it one
        lines.append("")
    lines[first:last + 1] = [line + _toml_cr(text) for line in rendered]
    return "\n".join(lines)


def toml_remove_table(text, table):
    """Remove `[table]` and all its sub-tables; unchanged text when there are none."""
    spans = _toml_table_spans(text, tuple(table))
    if not spans:
        return text
    lines = text.split("\n")
    for first, last in reversed(spans):
        _toml_delete_section(lines, first, last)
    return "\n".join(lines)


# ============================================================================
# 4. Config
# ============================================================================

CONFIG_FILE = "ferrus.toml"
BUILTIN_AGENTS = ("claude-code", "codex", "qwen-code", "gemini-cli")
# The binary names people type for the built-in agents.
AGENT_ALIASES = {"claude": "claude-code", "qwen": "qwen-code", "gemini": "gemini-cli"}
# What a headless agent may do besides calling ferrus's tools (see section 14).
PERMISSION_PROFILES = ("read-only", "edit", "full")
CLAUDE_MCP_ISOLATION = ("merge-user", "ferrus-only")


@dataclasses.dataclass
class ChecksConfig:
    """[checks]: the project's own lint and test commands, the check gate."""

    commands: list = dataclasses.field(default_factory=list)
    parallel: bool = False
    timeout_secs: int = 600
    fail_fast: bool = False
    max_log_bytes: int = 8 * 1024 * 1024


@dataclasses.dataclass
class LimitsConfig:
    """[limits]: how often a task may fail its checks or its review, and waits."""

    max_check_retries: int = 20
    max_review_cycles: int = 3
    max_feedback_lines: int = 30
    wait_timeout_secs: int = 60


@dataclasses.dataclass
class LeaseConfig:
    """[lease]: how long a claim on the task lasts without a heartbeat."""

    ttl_secs: int = 90
    heartbeat_interval_secs: int = 30


@dataclasses.dataclass
class SpecConfig:
    """[spec]: where specs with milestones live."""

    directory: str = "docs/specs"


@dataclasses.dataclass
class AgentChoice:
    """One role's agent in [hq.<role>]: which CLI, which model, which permissions."""

    agent: str
    model: str = ""
    permissions: str = ""     # "" = the role's default profile


def canonical_agent(name):
    """A built-in agent's name for what the user typed (`claude` means claude-code)."""
    name = (name or "").strip()
    return AGENT_ALIASES.get(name, name)


@dataclasses.dataclass
class AgentOptions:
    """``[agents.<name>]``: flags and environment the user adds to an agent's launches."""

    extra_args: list = dataclasses.field(default_factory=list)
    headless_args: list = dataclasses.field(default_factory=list)
    interactive_args: list = dataclasses.field(default_factory=list)
    env: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CustomAgentSpec:
    """``[agents.custom.<name>]``: an agent CLI described by argv templates."""

    name: str
    interactive: list
    headless: list
    prompt: str = "argv"            # argv | stdin
    version_args: list = dataclasses.field(default_factory=lambda: ["--version"])


@dataclasses.dataclass
class AgentsConfig:
    """[agents] and [agents.<name>]: skill files, per-agent options, custom CLIs."""

    path: str = ".agents"
    claude_mcp_isolation: str = "merge-user"
    options: dict = dataclasses.field(default_factory=dict)    # agent name -> AgentOptions
    custom: dict = dataclasses.field(default_factory=dict)     # name -> CustomAgentSpec

    def options_for(self, agent):
        return self.options.get(agent) or AgentOptions()


@dataclasses.dataclass
class CapacityConfig:
    """[capacity]: every limit is off (0) by default."""

    max_tool_calls: int = 0        # ferrus tool calls per task (counted by the MCP servers)
    max_sessions: int = 0          # agent sessions per task
    max_tasks: int = 0             # tasks completed per HQ / `ferrus run`
    max_tokens: int = 0            # tokens per task, from agents that report usage
    max_parallel_agents: int = 0   # agent processes at once
    max_turns: int = 0             # model turns per task, from agents that report them
    context_window: int = 0        # the model's context window in tokens (0: unknown)
    orange_percent: int = 80       # at this share of a limit: Orange, Throttle
    emergency_percent: int = 150   # at this share: EmergencyStop (from 100%: Checkpoint)
    throttle_secs: int = 10        # how long a Throttle waits before spawning

    def enabled(self):
        return any((self.max_tool_calls, self.max_sessions, self.max_tasks, self.max_tokens,
                    self.max_parallel_agents, self.max_turns, self.context_window))


@dataclasses.dataclass
class SessionsConfig:
    """[sessions]: how HQ supervises each agent slot (ARCHITECTURE.md, 'Session state machine')."""

    max_consecutive_errors: int = 5
    max_total_errors: int = 20
    timeout_secs: int = 3600
    interrupt_grace_secs: int = 10


@dataclasses.dataclass
class PipelinesConfig:
    """[pipelines] in ferrus.toml; runs always live in .ferrus/pipelines/."""

    file: str = "workflows.json"
    max_parallel: int = 4          # the batch-size gate: workers running at once in a run


# [git] commit: when ferrus commits a task's changes.
GIT_COMMIT_POLICIES = ("off", "on_approve")
# The one placeholder a [git] branch template may hold (each task gets its own branch).
GIT_BRANCH_PLACEHOLDER = "{task_id}"


@dataclasses.dataclass
class GitConfig:
    """[git]: what ferrus does in git besides reading the task's diff (off by default)."""

    branch: str = ""               # e.g. "ferrus/{task_id}"; "" = no branch per task
    commit: str = "off"            # off | on_approve

    def branch_for(self, task_id):
        """The branch a task gets, or None when [git] branch is off."""
        return self.branch.replace(GIT_BRANCH_PLACEHOLDER, task_id) if self.branch else None


# What [notify] can announce.  The first group needs a human or ends something and is
# on by default; the second reports ordinary progress and is there for those who ask.
NOTIFY_DEFAULT_EVENTS = ("awaiting_human", "complete", "failed", "checkpoint", "emergency_stop",
                         "pipeline_delivered")
NOTIFY_EVENTS = NOTIFY_DEFAULT_EVENTS + ("task_created", "submitted", "rejected")


@dataclasses.dataclass
class NotifyConfig:
    """[notify]: how a human who is not watching hears that the loop needs them."""

    bell: bool = True              # the terminal bell in HQ and `ferrus run`
    desktop: bool = False          # notify-send, osascript or a PowerShell toast
    command: list = dataclasses.field(default_factory=list)   # argv; {event} {task_id} {summary}
    timeout_secs: int = 30         # a notifier still running then is stopped
    events: list = dataclasses.field(default_factory=lambda: list(NOTIFY_DEFAULT_EVENTS))


def _check_notify(path, notify):
    unknown = [name for name in notify.events if name not in NOTIFY_EVENTS]
    if unknown:
        raise _config_error(path, "notify.events", "must name only these events: %s"
                            % ", ".join(NOTIFY_EVENTS), unknown[0])
    if notify.command and not notify.command[0].strip():
        raise _config_error(path, "notify.command", "must start with a program name",
                            notify.command[0])


INTEGRATION_MODES = ("rebase", "merge")


@dataclasses.dataclass
class ParallelConfig:
    """[parallel]: several tasks at once, each in its own git worktree, integrated through
    a merge queue that keeps the target branch green (ARCHITECTURE.md, 'Parallel tasks')."""

    max_tasks: int = 1             # 1: one task at a time in the checkout, as ever
    integrate: str = "rebase"      # rebase | merge onto the target's head before the checks
    target: str = ""               # the branch tasks merge into; "" = the one checked out
    worktree_dir: str = ""         # "" = <repository>.ferrus-worktrees beside the repository
    delegates: list = dataclasses.field(default_factory=list)  # agents a team lead may use
    # Shell commands run in each new worktree before its agents start (it holds only what
    # git tracks: install dependencies, link a virtualenv...); a failure fails the task.
    setup: list = dataclasses.field(default_factory=list)


def _check_parallel(path, parallel):
    if parallel.integrate not in INTEGRATION_MODES:
        raise _config_error(path, "parallel.integrate", 'must be "rebase" or "merge"',
                            parallel.integrate)


# The tables _fill_section reads straight into their dataclass, in file order.
PLAIN_TABLES = ("checks", "limits", "lease", "spec", "capacity", "sessions", "pipelines",
                "notify", "parallel")
KNOWN_TABLES = PLAIN_TABLES + ("agents", "hq", "git")
# [hq.<role>] tables: which agent (and model, permissions) plays each role.
HQ_ROLES = ("supervisor", "executor")
AGENT_CHOICE_KEYS = ("agent", "model", "permissions")
# [agents.<name>] keys, and the argv templates of [agents.custom.<name>].
AGENT_OPTION_LISTS = ("extra_args", "headless_args", "interactive_args")
CUSTOM_AGENT_KEYS = ("interactive", "headless", "prompt", "version_args")


@dataclasses.dataclass
class Config:
    """The whole of ferrus.toml, one dataclass per table, validated by load_config."""

    checks: ChecksConfig = dataclasses.field(default_factory=ChecksConfig)
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)
    lease: LeaseConfig = dataclasses.field(default_factory=LeaseConfig)
    spec: SpecConfig = dataclasses.field(default_factory=SpecConfig)
    agents: AgentsConfig = dataclasses.field(default_factory=AgentsConfig)
    capacity: CapacityConfig = dataclasses.field(default_factory=CapacityConfig)
    sessions: SessionsConfig = dataclasses.field(default_factory=SessionsConfig)
    pipelines: PipelinesConfig = dataclasses.field(default_factory=PipelinesConfig)
    notify: NotifyConfig = dataclasses.field(default_factory=NotifyConfig)
    git: GitConfig = dataclasses.field(default_factory=GitConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    supervisor: "AgentChoice | None" = None
    executor: "AgentChoice | None" = None
    # [hq] human_review: the reviewer's approval waits for a human's confirmation.
    human_review: bool = False
    # Problems in [hq] only matter to commands that launch agents, so they are kept
    # here instead of breaking check, submit and the waits (see
    # ARCHITECTURE.md, 'Differences from upstream ferrus', item 14).
    hq_problems: list = dataclasses.field(default_factory=list)
    unknown_keys: list = dataclasses.field(default_factory=list)
    path: str = CONFIG_FILE

    @property
    def hq_problem(self):
        """The first problem in [hq], or None."""
        return self.hq_problems[0] if self.hq_problems else None

    def require_hq(self):
        if self.hq_problems:
            raise self.hq_problem
        return self


# Upper bounds keep arithmetic sane: upstream overflowed on a huge ttl (see
# ARCHITECTURE.md, 'Differences from upstream ferrus', item 19).
_INT_LIMITS = {
    ("limits", "max_check_retries"): (1, 1_000_000),
    ("limits", "max_review_cycles"): (1, 1_000_000),
    ("limits", "max_feedback_lines"): (0, 100_000),
    ("limits", "wait_timeout_secs"): (0, 86_400),
    ("lease", "ttl_secs"): (1, 31_536_000),
    ("lease", "heartbeat_interval_secs"): (1, 31_536_000),
    ("checks", "timeout_secs"): (1, 604_800),
    ("checks", "max_log_bytes"): (4096, 2 ** 40),
    ("capacity", "orange_percent"): (1, 100),
    ("parallel", "max_tasks"): (1, 64),
    ("capacity", "emergency_percent"): (100, 100_000),
    ("capacity", "throttle_secs"): (0, 86_400),
    ("sessions", "max_consecutive_errors"): (1, 1_000_000),
    ("sessions", "max_total_errors"): (1, 1_000_000),
    ("sessions", "timeout_secs"): (1, 31_536_000),
    ("sessions", "interrupt_grace_secs"): (0, 86_400),
    ("pipelines", "max_parallel"): (1, 1000),
    ("notify", "timeout_secs"): (1, 3600),
}


def _config_error(path, key, expected, got=None, line=None):
    where = "%s: [%s]" % (path, key) if line is None else "%s line %s" % (path, line)
    message = "%s %s" % (where, expected)
    if got is not None:
        message += ", got %s" % _describe_value(got)
    return FerrusError(message, "edit %s and fix that value (docs/REFERENCE.md, section "
                                "ferrus.toml, lists every key)" % path)


def _describe_value(value):
    if isinstance(value, bool):
        return "%s (a boolean)" % ("true" if value else "false")
    if isinstance(value, int):
        return "%d (an integer)" % value
    if isinstance(value, str):
        return "%s (a string)" % json.dumps(value)
    if isinstance(value, list):
        # Arrays hold strings wherever ferrus.toml has them: name the item that is not one.
        odd = next(((i, v) for i, v in enumerate(value) if not isinstance(v, str)), None)
        return "an array" if odd is None else "an array whose item %d is %s" % (
            odd[0] + 1, _describe_value(odd[1]))
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, float):
        return "%r (a number)" % value
    if isinstance(value, (_dt.date, _dt.time)):
        return "%s (a date or time)" % value.isoformat()
    return type(value).__name__


def _value_problem(current, value, limits):
    """What ``value`` should have been, given the default it replaces; None if it fits."""
    if isinstance(current, bool):
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(current, int):
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer"
        low, high = limits
        return None if low <= value <= high else "must be between %d and %d" % (low, high)
    if isinstance(current, str):
        return None if isinstance(value, str) else "must be a string"
    if isinstance(current, list):
        return None if _is_string_list(value) else "must be an array of strings"
    return None


def _is_string_list(value):
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _fill_section(path, raw, name, target, unknown, found):
    """Copy ``raw[name]`` into the dataclass instance ``target``, type-checked.

    Each bad value is appended to ``found`` (the default stays), each unknown key
    to ``unknown``."""
    table = raw.get(name, {})
    if not isinstance(table, dict):
        found.append(_config_error(path, name, "must be a table", table))
        return
    fields = {f.name for f in dataclasses.fields(target)}
    for key, value in table.items():
        dotted = "%s.%s" % (name, key)
        if key not in fields:
            unknown.append(dotted)
            continue
        problem = _value_problem(getattr(target, key), value,
                                 _INT_LIMITS.get((name, key), (0, 2 ** 31)))
        if problem:
            found.append(_config_error(path, dotted, problem, value))
        else:
            setattr(target, key, value)


def _parse_hq_table(path, hq, config, unknown):
    """[hq]: the agent of each role.  Its problems go to ``config.hq_problems``."""
    if not isinstance(hq, dict):
        config.hq_problems.append(_config_error(path, "hq", "must be a table", hq))
        return
    known_agents = BUILTIN_AGENTS + tuple(config.agents.custom)
    for key, value in hq.items():
        if key == "human_review":         # a setting, not a role: _parse_human_review
            continue
        if key not in HQ_ROLES:
            unknown.append("hq.%s" % key)
            continue
        choice, problems = _parse_agent_choice(path, key, value, known_agents, unknown)
        setattr(config, key, choice)
        config.hq_problems.extend(problems)


def _parse_agent_choice(path, role, value, known_agents, unknown):
    """``[hq.<role>]`` (or the legacy ``[hq] <role> = "agent"``): (choice, problems)."""
    where = "hq.%s" % role
    if isinstance(value, str):
        agent, model, permissions = value, "", ""
    elif isinstance(value, dict):
        unknown.extend("%s.%s" % (where, key) for key in value if key not in AGENT_CHOICE_KEYS)
        agent = value.get("agent")
        model = value.get("model", "")
        permissions = value.get("permissions", "")
        problems = []
        if agent is None:
            problems.append(_config_error(path, where, "needs `agent = \"<agent name>\"`"))
        elif not isinstance(agent, str):
            problems.append(_config_error(path, where + ".agent", "must be an agent name string",
                                          agent))
        if not isinstance(model, str):
            problems.append(_config_error(path, where + ".model", "must be a string", model))
        if permissions not in PERMISSION_PROFILES + ("",):
            problems.append(_config_error(
                path, where + ".permissions", "must be one of %s" % ", ".join(
                    json.dumps(p) for p in PERMISSION_PROFILES), permissions))
        if problems:
            return None, problems
    else:
        return None, [_config_error(path, where, "must be a table with `agent` (or a string)",
                                    value)]
    agent = canonical_agent(agent) if agent.strip() not in known_agents else agent.strip()
    if agent not in known_agents:
        return None, [FerrusError(
            "%s: [%s] agent %s is unknown" % (path, where, json.dumps(agent)),
            "use one of: %s (or describe it under [agents.custom.<name>])"
            % ", ".join(known_agents))]
    return AgentChoice(agent=agent, model=model.strip(), permissions=permissions), []


def _parse_agents_table(path, agents, target, unknown, found):
    """``[agents]``: ``path``, ``[agents.<name>]`` options, ``[agents.custom.<name>]``."""
    if not isinstance(agents, dict):
        found.append(_config_error(path, "agents", "must be a table", agents))
        return
    if "path" in agents:
        if isinstance(agents["path"], str):
            target.path = agents["path"]
        else:
            found.append(_config_error(path, "agents.path", "must be a string", agents["path"]))
    custom = agents.get("custom", {})
    if isinstance(custom, dict):
        _parse_custom_agents(path, custom, target, unknown, found)
    else:
        found.append(_config_error(path, "agents.custom", "must be a table of agent tables",
                                   custom))
        custom = {}
    # Options may name a custom agent whose own table is broken: that error is enough.
    known_agents = BUILTIN_AGENTS + tuple(custom)
    for name, table in agents.items():
        if name in ("path", "custom"):
            continue
        agent = name if name in custom else canonical_agent(name)
        if agent not in known_agents:
            unknown.append("agents.%s" % name)
        elif not isinstance(table, dict):
            found.append(_config_error(path, "agents.%s" % name, "must be a table", table))
        else:
            target.options[agent] = _parse_agent_options(path, name, agent, table, target,
                                                         unknown, found)


def _parse_agent_options(path, name, agent, table, target, unknown, found):
    """``[agents.<name>]``: flags and environment added to an agent's launches."""
    options = AgentOptions()
    for key, value in table.items():
        dotted = "agents.%s.%s" % (name, key)
        if key in AGENT_OPTION_LISTS:
            if _is_string_list(value):
                setattr(options, key, list(value))
            else:
                found.append(_config_error(path, dotted, "must be an array of strings", value))
        elif key == "env":
            if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
                options.env = dict(value)
            else:
                found.append(_config_error(path, dotted, "must be a table of strings", value))
        elif key == "mcp_isolation" and agent == "claude-code":
            if value in CLAUDE_MCP_ISOLATION:
                target.claude_mcp_isolation = value
            else:
                # Upstream silently treated typos as merge-user (see
                # ARCHITECTURE.md, 'Differences from upstream ferrus', item 14).
                found.append(_config_error(path, dotted, "must be \"merge-user\" or "
                                           "\"ferrus-only\"", value))
        else:
            unknown.append(dotted)
    return options


def _parse_custom_agents(path, custom, target, unknown, found):
    """``[agents.custom.<name>]``: agent CLIs described by argv templates."""
    for name, table in custom.items():
        where = "agents.custom.%s" % name
        if not isinstance(table, dict):
            found.append(_config_error(path, where, "must be a table", table))
            continue
        problems = []
        if name in BUILTIN_AGENTS:
            problems.append(_config_error(path, where, "must not reuse a built-in agent name"))
        missing = [k for k in ("interactive", "headless") if k not in table]
        if missing:
            problems.append(_config_error(path, where, "needs %s (argv templates)"
                                          % " and ".join(missing)))
        for key in ("interactive", "headless", "version_args"):
            value = table.get(key, ["-"])
            if not _is_string_list(value):
                problems.append(_config_error(path, "%s.%s" % (where, key),
                                              "must be an array of strings", value))
            elif not value and key != "version_args":
                problems.append(_config_error(path, "%s.%s" % (where, key),
                                              "must not be empty (an argv template)"))
        if table.get("prompt", "argv") not in ("argv", "stdin"):
            problems.append(_config_error(path, where + ".prompt", "must be \"argv\" or \"stdin\"",
                                          table["prompt"]))
        unknown.extend("%s.%s" % (where, key) for key in table if key not in CUSTOM_AGENT_KEYS)
        found.extend(problems)
        if not problems:
            spec = CustomAgentSpec(name=name, interactive=list(table["interactive"]),
                                   headless=list(table["headless"]),
                                   prompt=table.get("prompt", "argv"))
            if "version_args" in table:
                spec.version_args = list(table["version_args"])
            target.custom[name] = spec


def parse_config(text, path=CONFIG_FILE, problems=None):
    """Build a validated :class:`Config` from ferrus.toml text.

    Every table is checked and every bad value found.  The first error is raised,
    unless ``problems`` is a list: then each error is appended to it and the bad
    values keep their defaults, so `ferrus doctor` can list them all at once.
    Problems in [hq] are kept in ``config.hq_problems`` either way (only commands
    that launch agents need [hq]); unknown keys in ``config.unknown_keys``."""
    try:
        raw = parse_toml(text)
    except TomlError as err:
        raise FerrusError("%s is not valid TOML: %s" % (path, err),
                          "fix the syntax at that line (`ferrus init` in an empty folder writes a "
                          "commented example; docs/REFERENCE.md, section ferrus.toml, lists every "
                          "key)") from None
    config = Config(path=path)
    unknown = config.unknown_keys
    found = [] if problems is None else problems
    for name in PLAIN_TABLES:
        _fill_section(path, raw, name, getattr(config, name), unknown, found)
    for check, table in ((_check_notify, config.notify), (_check_parallel, config.parallel)):
        try:
            check(path, table)
        except FerrusError as err:
            found.append(err)
    _parse_agents_table(path, raw.get("agents", {}), config.agents, unknown, found)
    _parse_hq_table(path, raw.get("hq", {}), config, unknown)
    # Not one of hq_problems, which only agent launches notice: a mistyped value must
    # not let the reviewer's approval complete a task the human meant to confirm.
    _parse_human_review(path, raw.get("hq", {}), config, found)
    _parse_git_table(path, raw.get("git", {}), config.git, unknown, found)
    unknown.extend(name for name in raw if name not in KNOWN_TABLES)
    if found and problems is None:
        first, count = found[0], len(found) + len(config.hq_problems)
        if count > 1:
            raise FerrusError(first.message, "%s; `ferrus doctor` lists all %d problems in %s"
                              % (first.hint, count, path))
        raise first
    return config


def _parse_human_review(path, hq, config, found):
    value = hq.get("human_review", False) if isinstance(hq, dict) else False
    if not isinstance(value, bool):
        found.append(_config_error(path, "hq.human_review", "must be true or false", value))
        return
    config.human_review = value


def git_branch_name_problem(name):
    """Why ``name`` cannot be a git branch name (git's check-ref-format rules), or None."""
    if not name or name == "@" or name.startswith(("-", "/")) or name.endswith(("/", ".")):
        return "must not be empty, \"@\", start with - or /, or end with / or ."
    if any(ord(ch) < 32 or ch == "\x7f" or ch in " ~^:?*[\\" for ch in name):
        return "must not hold spaces, control characters or any of ~ ^ : ? * [ \\"
    if ".." in name or "//" in name or "@{" in name:
        return "must not hold .., // or @{"
    for part in name.split("/"):
        if part.startswith(".") or part.endswith(".lock"):
            return "must not have a part that starts with . or ends with .lock"
    return None


def _parse_git_table(path, git, target, unknown, found):
    """``[git]``: the branch template and the commit policy."""
    if not isinstance(git, dict):
        found.append(_config_error(path, "git", "must be a table", git))
        return
    for key, value in git.items():
        if key not in ("branch", "commit"):
            unknown.append("git.%s" % key)
    branch = git.get("branch", "")
    if not isinstance(branch, str):
        found.append(_config_error(path, "git.branch", "must be a branch name template such "
                                   "as \"ferrus/{task_id}\" (or \"\" for no branch)", branch))
    elif branch:
        leftover = branch.replace(GIT_BRANCH_PLACEHOLDER, "")
        problem = None
        if GIT_BRANCH_PLACEHOLDER not in branch:
            problem = "must contain {task_id}, so that each task gets a branch of its own"
        elif "{" in leftover or "}" in leftover:
            problem = "may hold no placeholder but {task_id}"
        else:
            problem = git_branch_name_problem(branch.replace(GIT_BRANCH_PLACEHOLDER,
                                                             "t-0123456789ab"))
            if problem:
                problem = "is no valid branch name: it " + problem
        if problem:
            found.append(_config_error(path, "git.branch", problem, branch))
        else:
            target.branch = branch
    commit = git.get("commit", "off")
    if commit not in GIT_COMMIT_POLICIES:
        found.append(_config_error(path, "git.commit", "must be one of %s" % ", ".join(
            json.dumps(p) for p in GIT_COMMIT_POLICIES), commit))
    else:
        target.commit = commit


def load_config(root):
    """Read and validate ``<root>/ferrus.toml``."""
    path = os.path.join(root, CONFIG_FILE)
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise FerrusError("%s not found in %s" % (CONFIG_FILE, root),
                          "run `ferrus init` in the project root first") from None
    return parse_config(text, CONFIG_FILE)


class ConfigCache:
    """Re-reads ferrus.toml only when it changed on disk (mtime, size or inode)."""

    def __init__(self, root):
        self.root = root
        self._stamp = None
        self._config = None
        self._lock = threading.Lock()

    def get(self):
        path = os.path.join(self.root, CONFIG_FILE)
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            if stamp is None or stamp != self._stamp:
                self._config = load_config(self.root)
                self._stamp = stamp
                # Once per change of the file, not on every read (`ferrus doctor`
                # lists them too).
                for key in self._config.unknown_keys:
                    log.warning("%s: unknown key %s is ignored", CONFIG_FILE, key)
            return self._config


NO_CHECKS_WARNING = ("%s has no [checks] commands, so the check gate passes every "
                     "submission" % CONFIG_FILE)
NO_CHECKS_HINT = ("add your lint and test commands, e.g. commands = [\"make lint\", "
                  "\"make test\"] under [checks]")


# ============================================================================
# 5. Task state machine
# ============================================================================

class TaskState(str, enum.Enum):
    """The task's lifecycle.  Values are upstream's PascalCase spellings."""

    IDLE = "Idle"
    EXECUTING = "Executing"
    CONSULTATION = "Consultation"
    REVIEWING = "Reviewing"
    ADDRESSING = "Addressing"
    COMPLETE = "Complete"
    FAILED = "Failed"
    AWAITING_HUMAN = "AwaitingHuman"
    # With [hq] human_review on, the reviewer's approval leads here instead of to Complete,
    # and only a human moves the task on.  It is a state of its own, not a flag on
    # Reviewing: every tool and every HQ reaction keyed on Reviewing (the reviewer's
    # wait_for_review claim, HQ starting a reviewer, approve and reject) must then not
    # apply, and a state makes the transition table refuse them all in one place.  With
    # the feature off no STATE.json ever holds it, so upstream reads the files as before.
    AWAITING_CONFIRMATION = "AwaitingConfirmation"
    # A parallel task's approved work waits here for the merge queue: it is Complete only
    # once it is integrated into the target branch with the checks green on the result,
    # and a conflict or a red check sends it back to Addressing (ARCHITECTURE.md,
    # 'Parallel tasks').  Only parallel tasks, never the project's own STATE.json, hold it.
    INTEGRATING = "Integrating"

    def __str__(self):
        return self.value


S = TaskState
WORK_STATES = (S.EXECUTING, S.ADDRESSING)
LEASE_STATES = (S.EXECUTING, S.ADDRESSING, S.CONSULTATION, S.REVIEWING, S.AWAITING_HUMAN)
ACTIVE_STATES = (S.EXECUTING, S.ADDRESSING, S.CONSULTATION, S.REVIEWING, S.AWAITING_HUMAN,
                 S.AWAITING_CONFIRMATION, S.INTEGRATING)

# The one table the code and the docs follow: action, states it is allowed
# from, and where it leads.  "same" keeps the state; "paused" restores the
# state saved when the task was paused.
TRANSITIONS = (
    ("create_task", (S.IDLE,), "Executing"),
    ("claim", (S.EXECUTING, S.ADDRESSING, S.REVIEWING), "same (takes the lease)"),
    ("check_passed", WORK_STATES, "same"),
    ("check_failed", WORK_STATES, "same, or Failed at max_check_retries"),
    ("submit", WORK_STATES, "Reviewing"),
    ("consult", WORK_STATES, "Consultation"),
    ("respond_consult", (S.CONSULTATION,), "same"),
    ("finish_consult", (S.CONSULTATION,), "paused (Executing or Addressing)"),
    ("approve", (S.REVIEWING,), "Complete, or AwaitingConfirmation with [hq] human_review, "
     "or Integrating for a parallel task"),
    ("reject", (S.REVIEWING,), "Addressing, or Failed at max_review_cycles"),
    # The human's word on the reviewer's approval; no agent may take these.
    ("human_approve", (S.AWAITING_CONFIRMATION,), "Complete, or Integrating for a parallel task"),
    ("human_reject", (S.AWAITING_CONFIRMATION,), "Addressing, or Failed at max_review_cycles"),
    # The merge queue's verdict on a parallel task; only the orchestrator takes these.
    ("integrated", (S.INTEGRATING,), "Complete"),
    ("integration_failed", (S.INTEGRATING,), "Addressing, or Failed at max_review_cycles"),
    ("ask_human", (S.EXECUTING, S.ADDRESSING, S.CONSULTATION, S.REVIEWING), "AwaitingHuman"),
    ("answer", (S.AWAITING_HUMAN,), "paused"),
    ("heartbeat", LEASE_STATES, "same (renews the lease)"),
    ("reset", (S.FAILED,), "Idle"),
    ("force_reset", tuple(S), "Idle"),
)
ALLOWED_FROM = {action: frozenset(froms) for action, froms, _ in TRANSITIONS}

# STATE.json field order as upstream writes it; additive fields follow.
_UPSTREAM_FIELDS = (
    "schema_version", "state", "check_retries", "review_cycles", "failure_reason",
    "updated_at", "owner_pid", "paused_state", "claimed_by", "lease_until",
    "last_heartbeat", "selected_spec", "selected_milestone", "pending_task_spec",
    "pending_task_milestone", "task_spec", "task_milestone")
_ALWAYS_WRITTEN = ("schema_version", "state", "check_retries", "review_cycles",
                   "failure_reason", "updated_at", "owner_pid")


@dataclasses.dataclass
class StateData:
    """STATE.json.  Timestamps stay strings so untouched ones round-trip byte for byte."""

    state: TaskState = S.IDLE
    check_retries: int = 0
    review_cycles: int = 0
    failure_reason: "str | None" = None
    schema_version: int = 1
    updated_at: str = "1970-01-01T00:00:00Z"
    owner_pid: int = 0
    paused_state: "TaskState | None" = None
    claimed_by: "str | None" = None
    lease_until: "str | None" = None
    last_heartbeat: "str | None" = None
    selected_spec: "str | None" = None
    selected_milestone: "str | None" = None
    pending_task_spec: "str | None" = None
    pending_task_milestone: "str | None" = None
    task_spec: "str | None" = None
    task_milestone: "str | None" = None
    # Additive fields (upstream ignores unknown fields on read).
    rev: int = 0
    task_id: "str | None" = None
    state_entered_at: "str | None" = None
    task_started_at: "str | None" = None
    # The state a consultation paused, kept apart from paused_state so that
    # ask_human during Consultation cannot lose it (see
    # ARCHITECTURE.md, 'Differences from upstream ferrus', item 4).
    consult_paused_state: "TaskState | None" = None
    # Which agent asked the pending question, so HQ can tell who waits.
    question_from: "str | None" = None
    # Where the task started in git (see task_base): its diff is measured from there.
    task_base: "dict | None" = None
    # What [git] commit = "on_approve" did when the task was approved: the commit, or
    # why there is none (see commit_task_changes).
    task_commit: "dict | None" = None
    extra: dict = dataclasses.field(default_factory=dict)

    def copy(self):
        return dataclasses.replace(self, extra=dict(self.extra))

    # -- serialisation -----------------------------------------------------

    def to_json(self):
        out = {}
        for name in _UPSTREAM_FIELDS:
            value = getattr(self, name)
            if value is None and name not in _ALWAYS_WRITTEN:
                continue
            out[name] = value.value if isinstance(value, TaskState) else value
        for name in ("rev", "task_id", "state_entered_at", "task_started_at",
                     "consult_paused_state", "question_from", "task_base", "task_commit"):
            value = getattr(self, name)
            # rev 0 means "never written by this ferrus": an upstream file stays as it was.
            if value is not None and not (name == "rev" and value == 0):
                out[name] = value.value if isinstance(value, TaskState) else value
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return pretty_json(out)

    @classmethod
    def from_json(cls, text, where="STATE.json"):
        try:
            raw = json.loads(text)
            json.dumps(raw, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise StateCorrupt("%s holds a \\u escape that is no character (a lone surrogate)"
                               % where) from None
        except (ValueError, RecursionError) as err:
            raise StateCorrupt("%s is not valid JSON (%s)" % (where, err)) from err
        if not isinstance(raw, dict):
            raise StateCorrupt("%s must hold a JSON object" % where)
        data = cls()
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        for key in ("state", "check_retries", "review_cycles"):
            if key not in raw:
                raise StateCorrupt("%s has no %r field" % (where, key))
        for key, value in raw.items():
            if key not in known:
                data.extra[key] = value
                continue
            try:
                setattr(data, key, _coerce_state_field(key, value))
            except (TypeError, ValueError) as err:
                raise StateCorrupt("%s field %r: %s" % (where, key, err)) from err
        return data


class StateCorrupt(FerrusError):
    def __init__(self, message):
        super().__init__(message, "run `ferrus doctor` to see what is wrong and "
                                  "`ferrus doctor --fix` to repair it")


_STATE_ENUM_FIELDS = ("state", "paused_state", "consult_paused_state")
_STATE_INT_FIELDS = ("check_retries", "review_cycles", "schema_version", "owner_pid", "rev")
_STATE_TIME_FIELDS = ("updated_at", "lease_until", "last_heartbeat", "state_entered_at",
                      "task_started_at")


def _coerce_state_field(key, value):
    if value is None:
        if key in ("state",) or key in _STATE_INT_FIELDS:
            raise ValueError("must not be null")
        return None
    if key in ("task_base", "task_commit"):
        if not isinstance(value, dict):
            raise ValueError("must be an object, got %r" % (value,))
        return value
    if key in _STATE_ENUM_FIELDS:
        try:
            return TaskState(value)
        except ValueError:
            raise ValueError("unknown state %r (expected one of %s)"
                             % (value, ", ".join(s.value for s in TaskState))) from None
    if key in _STATE_INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError("must be a non-negative integer, got %r" % (value,))
        return value
    if not isinstance(value, str):
        raise ValueError("must be a string, got %r" % (value,))
    if key in _STATE_TIME_FIELDS:
        parse_timestamp(value)
    return value


# -- leases (see ARCHITECTURE.md, 'Leases') -----------------------------------

def lease_deadline(data):
    return parse_timestamp(data.lease_until) if data.lease_until else None


def claim(data, agent_id, now, ttl_secs):
    data = data.copy()
    data.claimed_by = agent_id
    data.lease_until = format_timestamp(now + _dt.timedelta(seconds=ttl_secs))
    data.last_heartbeat = format_timestamp(now)
    return data


class LeaseSightings:
    """How long this process honours a lease — never on a wall clock alone.

    Wall clocks jump, and another process's clock may run hours ahead or behind.  So a
    lease, known by (project, holder, lease_until), is honoured for at most its holder's
    own length (lease_until − last_heartbeat, capped at ttl_secs) from the moment this
    process first saw it, counted on this process's monotonic clock; and while our wall
    clock agreed at first sight that it was live, also no longer than our wall clock says.
    A lease our wall clock calls expired at first sight (abandoned long ago, or our clock
    runs ahead) is honoured for what is left of its length since STATE.json was last
    written, as the file system's clock saw it: a dead holder's lease frees at once, a
    live holder's lease is not taken from it by a process whose clock is ahead."""

    KEEP = 256

    def __init__(self):
        self._seen = collections.OrderedDict()
        self._lock = threading.Lock()

    def seconds_left(self, where, data, now, monotonic, ttl, written_age):
        deadline = lease_deadline(data)
        if deadline is None:
            return 0.0
        length = float(ttl)
        if data.last_heartbeat:
            with contextlib.suppress(ValueError):
                length = min(length, (deadline - parse_timestamp(data.last_heartbeat))
                             .total_seconds())
        wall_left = (deadline - now).total_seconds()
        key = (where, data.claimed_by, data.lease_until)
        mono = monotonic()
        with self._lock:
            seen = self._seen.get(key)
            if seen is None:
                looked_live = wall_left > 0
                budget = min(length, wall_left) if looked_live else length - written_age()
                seen = self._seen[key] = (mono, looked_live, max(0.0, budget))
                while len(self._seen) > self.KEEP:
                    self._seen.popitem(last=False)
        first_seen, looked_live, budget = seen
        left = budget - (mono - first_seen)
        if looked_live:
            left = min(left, wall_left)
        return max(0.0, left)


# One table per process: every Store of a project shares what this process has seen.
LEASE_SIGHTINGS = LeaseSightings()


def clear_lease(data):
    data = data.copy()
    data.claimed_by = data.lease_until = data.last_heartbeat = None
    return data


# -- pure transitions ---------------------------------------------------------

def _require(action, data):
    if data.state not in ALLOWED_FROM[action]:
        raise TransitionError(action, data.state)


def _enter(data, state, now):
    """Move to ``state``, stamping when it was entered if it changed."""
    if data.state != state:
        data.state_entered_at = format_timestamp(now)
    data.state = state
    return data


def t_create_task(data, now, task_id, base=None):
    _require("create_task", data)
    data = clear_lease(data)
    data.task_spec, data.pending_task_spec = data.pending_task_spec, None
    data.task_milestone, data.pending_task_milestone = data.pending_task_milestone, None
    data.check_retries = data.review_cycles = 0
    data.failure_reason = None
    data.paused_state = data.consult_paused_state = data.question_from = None
    data.task_id = task_id
    data.task_base = base
    data.task_commit = None
    data.task_started_at = format_timestamp(now)
    return _enter(data, S.EXECUTING, now)


def t_check_passed(data, now):
    _require("check_passed", data)
    data = data.copy()
    data.check_retries = 0
    data.failure_reason = None
    return data


def t_check_failed(data, now, reason, max_retries):
    _require("check_failed", data)
    data = data.copy()
    data.check_retries += 1
    if data.check_retries >= max_retries:
        data.failure_reason = "Check failed %d consecutive times. Last failure:\n%s" % (
            max_retries, reason)
        data = clear_lease(data)
        return _enter(data, S.FAILED, now)
    data.failure_reason = reason
    return data


def failure_summary(reason):
    """One line saying why a task failed.  The recorded reason may span lines, and its
    first can end in a colon that introduces the next ("… Last failure:" then the
    commands): those are joined, so a one-line view never ends on a bare colon."""
    lines = [line.strip() for line in (reason or "").splitlines() if line.strip()]
    if not lines:
        return "no reason recorded"
    summary = lines[0]
    if summary.endswith(":") and len(lines) > 1:
        summary += " " + lines[1]
    return summary


def t_submit(data, now):
    _require("submit", data)
    data = clear_lease(data)
    return _enter(data, S.REVIEWING, now)


def t_consult(data, now):
    _require("consult", data)
    data = data.copy()
    data.paused_state = data.consult_paused_state = data.state
    return _enter(data, S.CONSULTATION, now)


def t_finish_consult(data, now):
    _require("finish_consult", data)
    data = data.copy()
    # Consult is only reachable from Executing/Addressing, so when an older file
    # lost the paused state, Executing is the truthful fallback, not Idle.
    resume = data.consult_paused_state or data.paused_state
    if resume not in WORK_STATES:
        resume = S.EXECUTING
    data.paused_state = data.consult_paused_state = None
    return _enter(data, resume, now)


def t_approve(data, now, human_review=False, integrate=False):
    _require("approve", data)
    data = clear_lease(data)
    return _enter(data, S.AWAITING_CONFIRMATION if human_review
                  else S.INTEGRATING if integrate else S.COMPLETE, now)


def t_human_approve(data, now, integrate=False):
    _require("human_approve", data)
    data = clear_lease(data)
    return _enter(data, S.INTEGRATING if integrate else S.COMPLETE, now)


def t_integrated(data, now):
    _require("integrated", data)
    return _enter(data.copy(), S.COMPLETE, now)


def t_integration_failed(data, now, max_cycles, onto=None):
    """A conflict or a red check on the merged result is a review cycle: the executor
    gets the cause as review notes.  ``onto`` is the target's head the merge queue left
    the task's branch on (rebased onto it, or merged with it for the executor to resolve
    a conflict): the task's diff is measured from there on, so its reviewer sees the
    task's own work, not what other tasks brought to the target meanwhile."""
    _require("integration_failed", data)
    data = _send_back(data, now, max_cycles)
    if onto and data.task_base and data.task_base.get("git"):
        data.task_base = dict(data.task_base, commit=onto, dirty=[], dirty_count=0,
                              onto_target=True)
    return data


def t_reject(data, now, max_cycles):
    _require("reject", data)
    return _send_back(data, now, max_cycles)


def t_human_reject(data, now, max_cycles):
    """The human's rejection counts as a review cycle, exactly like the reviewer's."""
    _require("human_reject", data)
    return _send_back(data, now, max_cycles)


def _send_back(data, now, max_cycles):
    data = clear_lease(data)
    data.review_cycles += 1
    if data.review_cycles >= max_cycles:
        data.failure_reason = "Task rejected %d times without resolution." % max_cycles
        return _enter(data, S.FAILED, now)
    data.check_retries = 0
    return _enter(data, S.ADDRESSING, now)


def t_ask_human(data, now, asked_by=None):
    _require("ask_human", data)
    data = data.copy()
    data.paused_state = data.state
    data.question_from = asked_by
    return _enter(data, S.AWAITING_HUMAN, now)


def t_answer(data, now):
    _require("answer", data)
    data = data.copy()
    resume = data.paused_state or S.IDLE
    # Returning to a consultation puts the consultation's own paused state back
    # where upstream expects it.
    data.paused_state = data.consult_paused_state if resume == S.CONSULTATION else None
    data.question_from = None
    return _enter(data, resume, now)


def t_force_reset(data, now):
    """Back to a fresh Idle state that keeps only the spec selection and the rev."""
    fresh = StateData(selected_spec=data.selected_spec,
                      selected_milestone=data.selected_milestone,
                      rev=data.rev, extra={})
    fresh.state_entered_at = format_timestamp(now) if data.state != S.IDLE else data.state_entered_at
    return fresh


def t_reset(data, now):
    _require("reset", data)
    return t_force_reset(data, now)


# ============================================================================
# 6. Session state machine
# ============================================================================
#
# Every headless agent slot (executor, reviewer, consultant, pipeline worker)
# is supervised by this machine (see ARCHITECTURE.md, 'Session state machine').
# It is pure: step(session, event) returns the next session and one side effect
# for the supervisor to carry out.

class SessionState(str, enum.Enum):
    INITIALIZING = "Initializing"
    BUILDING_PROMPT = "BuildingPrompt"
    SPAWNING = "Spawning"
    RUNNING = "Running"
    SESSION_COMPLETE = "SessionComplete"
    COOLING_DOWN = "CoolingDown"
    INTERRUPTING = "Interrupting"
    STOPPED = "Stopped"

    def __str__(self):
        return self.value


SS = SessionState

# Effects the supervisor performs after a step.
STORE_PROMPT, CANCEL_SESSION, FORCE_STOP_SESSION, INCREMENT_SESSION, LOG_FATAL = (
    "StorePrompt", "CancelSession", "ForceStopSession", "IncrementSession", "LogFatal")


@dataclasses.dataclass(frozen=True)
class SessionEvent:
    """WorktreeReady, PromptReady(prompt), SessionStarted(seq), SessionExited(outcome),
    UrgentMessage(text), GraceExceeded, BackoffElapsed, OperatorStop, FatalError(text)."""

    kind: str
    value: object = None      # the prompt, seq, message text or fatal message
    outcome: str = ""         # SessionExited: success | error | timeout


@dataclasses.dataclass(frozen=True)
class Session:
    """One agent slot's session state (see ARCHITECTURE.md, 'Session state machine')."""

    state: SessionState = SS.INITIALIZING
    session_seq: int = 0
    consecutive_errors: int = 0
    total_errors: int = 0
    max_consecutive_errors: int = 5
    max_total_errors: int = 20
    prompt: "str | None" = None
    urgent: "str | None" = None     # the operator message the next prompt must carry
    backoff_ms: int = 0


def backoff_ms(consecutive_errors):
    """min(2000 * 2^(n-1), 60000) ms for the n-th consecutive error."""
    n = max(1, consecutive_errors)
    return min(2000 * 2 ** (n - 1), 60000)


def session_step(session, event):
    """One transition of the session table (ARCHITECTURE.md, 'Session state machine'):
    (new session, effect or None).

    An event the current state does not accept leaves the session unchanged
    (effect None); OperatorStop and FatalError are accepted from every state."""
    replace = dataclasses.replace
    state, kind = session.state, event.kind
    if kind == "OperatorStop":
        effect = CANCEL_SESSION if state in (SS.RUNNING, SS.INTERRUPTING) else None
        return replace(session, state=SS.STOPPED), effect
    if kind == "FatalError":
        return replace(session, state=SS.STOPPED), (LOG_FATAL, event.value)
    if state == SS.INITIALIZING and kind == "WorktreeReady":
        return replace(session, state=SS.BUILDING_PROMPT), None
    if state == SS.BUILDING_PROMPT and kind == "PromptReady":
        return replace(session, state=SS.SPAWNING, prompt=event.value, urgent=None), \
            (STORE_PROMPT, event.value)
    if state == SS.SPAWNING and kind == "SessionStarted":
        # The original design also reset consecutive_errors here.  We reset it only on a
        # successful exit: an agent that starts and then crashes every time would
        # otherwise never back off beyond 2 s nor reach max_consecutive_errors.
        return replace(session, state=SS.RUNNING, session_seq=event.value), None
    if state in (SS.SPAWNING, SS.RUNNING) and kind == "SessionExited":
        if event.outcome == "success" and state == SS.RUNNING:
            return replace(session, state=SS.SESSION_COMPLETE, consecutive_errors=0), None
        consecutive = session.consecutive_errors + 1
        total = session.total_errors + 1
        counted = replace(session, consecutive_errors=consecutive, total_errors=total)
        if consecutive >= session.max_consecutive_errors or total >= session.max_total_errors:
            reason = ("%d consecutive errors" % consecutive
                      if consecutive >= session.max_consecutive_errors else
                      "%d errors in total" % total)
            return replace(counted, state=SS.STOPPED), (LOG_FATAL, "stopped after " + reason)
        return replace(counted, state=SS.COOLING_DOWN, backoff_ms=backoff_ms(consecutive)), None
    if state == SS.RUNNING and kind == "UrgentMessage":
        return replace(session, state=SS.INTERRUPTING, urgent=event.value), CANCEL_SESSION
    if state == SS.INTERRUPTING and kind == "SessionExited":
        # An interrupt is intentional: no error is counted.
        return replace(session, state=SS.BUILDING_PROMPT), None
    if state == SS.INTERRUPTING and kind == "GraceExceeded":
        return replace(session, state=SS.BUILDING_PROMPT), FORCE_STOP_SESSION
    if state == SS.SESSION_COMPLETE and kind == "WorktreeReady":
        return replace(session, state=SS.BUILDING_PROMPT,
                       session_seq=session.session_seq + 1), INCREMENT_SESSION
    if state == SS.COOLING_DOWN and kind == "BackoffElapsed":
        return replace(session, state=SS.BUILDING_PROMPT), None
    return session, None


# ============================================================================
# 7. Capacity gates
# ============================================================================
#
# Before every agent spawn and every transition HQ drives, the usage signals are
# classified Green / Orange / Red and mapped to an action (see ARCHITECTURE.md,
# 'Capacity gates').  This section is pure; HQ and `ferrus run` call it and journal
# every decision.

GREEN, ORANGE, RED = "Green", "Orange", "Red"
CONTINUE, THROTTLE, CHECKPOINT, EMERGENCY_STOP = "Continue", "Throttle", "Checkpoint", "EmergencyStop"


@dataclasses.dataclass(frozen=True)
class Signals:
    """The usage a capacity gate judges: counts since the budget last started."""

    tool_calls: int = 0
    sessions: int = 0
    tasks_completed: int = 0
    tokens_used: int = 0
    parallel_agents: int = 0
    turns: int = 0                 # model turns the agents reported
    context_tokens_used: int = 0   # the largest context a running agent holds now
    context_tokens_max: int = 0    # the model's context window (0: unknown, not judged)


# signal field -> the limit it is measured against
SIGNAL_LIMITS = (("tool_calls", "max_tool_calls"), ("sessions", "max_sessions"),
                 ("tasks_completed", "max_tasks"), ("tokens_used", "max_tokens"),
                 ("parallel_agents", "max_parallel_agents"), ("turns", "max_turns"))


def classify(signals, limits):
    """(tier, action, the signal closest to its limit or None).

    The context in use is judged as a share of the window the signals carry (a full
    window is 100 %, like any limit reached); an unknown window judges nothing."""
    worst, ratio = None, 0.0
    for name, limit_name in SIGNAL_LIMITS:
        limit = getattr(limits, limit_name, 0)
        if limit > 0:
            share = getattr(signals, name) / float(limit)
            if share > ratio:
                worst, ratio = name, share
    if signals.context_tokens_max > 0:
        share = signals.context_tokens_used / float(signals.context_tokens_max)
        if share > ratio:
            worst, ratio = "context_tokens_used", share
    if ratio * 100 >= limits.emergency_percent:
        return RED, EMERGENCY_STOP, worst
    if ratio >= 1.0:
        return RED, CHECKPOINT, worst
    if ratio * 100 >= limits.orange_percent:
        return ORANGE, THROTTLE, worst
    return GREEN, CONTINUE, worst


def gate_record(target, tier, action, signals, limits, worst=None):
    """The journal detail of one gate decision (a GateRecord, plus the limits)."""
    record = {"target": target, "tier": tier, "action": action, "signal": worst}
    record.update(dataclasses.asdict(signals))
    record["limits"] = {name: getattr(limits, name, 0) for _, name in SIGNAL_LIMITS
                        if getattr(limits, name, 0)}
    return record


# -- the phase machine (ARCHITECTURE.md, 'Phase machine') ------------------------------
#
# A parallel run's cycle goes through eight phases.  Every move between them is
# checked against the allowed transitions, passes the capacity gate and leaves a
# GateRecord, so the audit trail shows each phase entered and the usage at that moment.

PHASE_NAMES = ("preflight", "plan", "prepare", "dispatch", "collect", "integrate", "report",
               "cleanup")
(PHASE_PREFLIGHT, PHASE_PLAN, PHASE_PREPARE, PHASE_DISPATCH, PHASE_COLLECT, PHASE_INTEGRATE,
 PHASE_REPORT, PHASE_CLEANUP) = range(len(PHASE_NAMES))

# phase -> the phases it may go to.  P0's targets depend on the recovery target (see
# PhaseMachine.allowed_targets): P1 on a fresh start, only the interrupted phase after a crash.
PHASE_TRANSITIONS = {
    PHASE_PREFLIGHT: (PHASE_PLAN,),
    PHASE_PLAN: (PHASE_PREPARE,),
    PHASE_PREPARE: (PHASE_DISPATCH,),
    PHASE_DISPATCH: (PHASE_COLLECT,),
    PHASE_COLLECT: (PHASE_DISPATCH, PHASE_INTEGRATE),       # back to P3 while work and slots remain
    PHASE_INTEGRATE: (PHASE_PLAN, PHASE_PREPARE, PHASE_REPORT),
    PHASE_REPORT: (PHASE_CLEANUP,),
    PHASE_CLEANUP: (PHASE_PLAN,),
}


def phase_label(phase):
    """``P3 dispatch``, or the bare value when it names no phase."""
    if isinstance(phase, int) and not isinstance(phase, bool) and 0 <= phase < len(PHASE_NAMES):
        return "P%d %s" % (phase, PHASE_NAMES[phase])
    return repr(phase)


class InvalidPhaseTransition(FerrusError):
    """A phase move the machine does not allow; nothing changed."""

    def __init__(self, from_phase, to_phase, allowed):
        self.from_phase = from_phase
        self.to_phase = to_phase
        self.allowed = tuple(allowed)
        super().__init__(
            "phase transition %s → %s is not allowed (from %s: %s)" % (
                phase_label(self.from_phase), phase_label(self.to_phase),
                phase_label(self.from_phase),
                ", ".join(phase_label(p) for p in self.allowed) or "nothing"),
            "the cycle is P0 → P1 → P2 → P3 → P4 (→ P3 while work and slots remain) → P5 → "
            "P1, P2 or P6 → P7 → P1; after a crash P0 goes only to the phase it interrupted")


class ShutdownRequired(FerrusError):
    """The capacity gate answered Checkpoint or EmergencyStop before a phase move: the
    phase did not change; the caller persists its state and halts."""

    def __init__(self, action, record):
        signal = record.get("signal")
        super().__init__(
            "capacity %s before %s: %s" % (
                action, phase_label(record.get("phase")),
                "%s reached %s" % (signal, record.get(signal)) if signal else "a limit is reached"),
            "raise the limit in [capacity] of ferrus.toml, then resume")
        self.action = action
        self.record = record


def phase_gate_record(phase, tier, action, signals, limits, worst=None, from_phase=None):
    """One phase move's GateRecord: the target phase, tier, action and the signals the
    audit trail keeps — tool calls, turns, tasks completed, context tokens used and max,
    with every other signal — plus where it came from, the deciding signal and the limits."""
    record = {"phase": phase, "phase_name": PHASE_NAMES[phase], "from_phase": from_phase,
              "tier": tier, "action": action, "signal": worst}
    record.update(dataclasses.asdict(signals))
    record["limits"] = {name: getattr(limits, name, 0) for _, name in SIGNAL_LIMITS
                        if getattr(limits, name, 0)}
    return record


def _phase_number(value, low, what):
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < len(PHASE_NAMES):
        raise FerrusError("%s must be a phase number from %d to %d, got %r" % (
            what, low, len(PHASE_NAMES) - 1, value),
            "phases are %s" % ", ".join(phase_label(p) for p in range(len(PHASE_NAMES))))
    return value


class PhaseMachine:
    """Which phase the cycle is in, and the only way to move it: ``transition``.

    Pure: it keeps the phase, the recovery target and the GateRecords of this process
    in ``history``; persisting ``to_json()`` and journaling the records is the caller's."""

    def __init__(self, phase=PHASE_PREFLIGHT, recovery_target=0, history=None):
        self.phase = _phase_number(phase, 0, "phase")
        self.recovery_target = _phase_number(recovery_target, 0, "recovery target")
        if self.recovery_target and self.phase != PHASE_PREFLIGHT:
            raise FerrusError("a recovery target (%s) is kept only in P0 preflight, not in %s"
                              % (phase_label(self.recovery_target), phase_label(self.phase)),
                              "the machine resumes from P0: use PhaseMachine.resumed(saved)")
        self.history = list(history) if history is not None else []

    def set_recovery_target(self, phase):
        """After a crash: P0 may then go only to ``phase``, the one that was interrupted."""
        if self.phase != PHASE_PREFLIGHT:
            raise FerrusError("a recovery target is set in P0 preflight; the machine is in %s"
                              % phase_label(self.phase),
                              "start a resumed run from P0 (PhaseMachine.resumed(saved))")
        self.recovery_target = _phase_number(phase, 1, "the recovery target")

    def allowed_targets(self):
        if self.phase == PHASE_PREFLIGHT and self.recovery_target:
            return (self.recovery_target,)
        return PHASE_TRANSITIONS[self.phase]

    def transition(self, target, signals, limits):
        """Move to ``target`` when allowed and the capacity gate lets work go on.

        Returns (action, record) on Continue or Throttle (a Throttle moves too: waiting
        is the caller's business).  Raises InvalidPhaseTransition (nothing recorded) or,
        on Checkpoint / EmergencyStop, ShutdownRequired after recording the decision."""
        allowed = self.allowed_targets()
        if type(target) is not int or target not in allowed:     # 2.0, True, "2" are not phases
            raise InvalidPhaseTransition(self.phase, target, allowed)
        tier, action, worst = classify(signals, limits)
        record = phase_gate_record(target, tier, action, signals, limits, worst, self.phase)
        self.history.append(record)
        if action in (CHECKPOINT, EMERGENCY_STOP):
            raise ShutdownRequired(action, record)
        if self.phase == PHASE_PREFLIGHT:
            self.recovery_target = 0
        self.phase = target
        return action, record

    def to_json(self):
        return {"phase": self.phase, "recovery_target": self.recovery_target}

    @classmethod
    def from_json(cls, data):
        """The machine exactly as ``to_json`` saved it (history starts empty)."""
        if not isinstance(data, dict):
            raise FerrusError("a saved phase machine must be an object with phase and "
                              "recovery_target, got %s" % type(data).__name__,
                              "the saved phase is damaged: without it the run starts "
                              "afresh from P0")
        return cls(data.get("phase", PHASE_PREFLIGHT), data.get("recovery_target", 0))

    @classmethod
    def resumed(cls, data):
        """After a crash: back in P0, whose only way out is the phase that was interrupted
        (a fresh start when the run had not left P0)."""
        saved = cls.from_json(data)
        machine = cls()
        target = saved.phase or saved.recovery_target
        if target:
            machine.set_recovery_target(target)
        return machine


# -- dispatch gates ------------------------------------------------------------------
#
# Before a parallel run collects (P3 → P4) it checks what it dispatched: every task it
# chose has a dispatch record, the batch fits `max_tasks`, and a task a supervisor split
# off as team lead went to an agent the topology allows.

@dataclasses.dataclass(frozen=True)
class DispatchRecord:
    """One agent session started for a task."""

    task_id: str
    role: str           # executor | reviewer | consultant
    agent: str
    session_id: str = ""


class DispatchGateError(FerrusError):
    """A dispatch gate failed: ``gate`` names it, ``tasks`` the task ids concerned."""

    def __init__(self, gate, tasks, message, hint):
        super().__init__(message, hint)
        self.gate = gate
        self.tasks = list(tasks)


def _unique(ids):
    return list(dict.fromkeys(ids))


def check_dispatch_coverage(selected_task_ids, records):
    """Every task chosen for the batch has at least one dispatch record."""
    covered = {record.task_id for record in records}
    missing = [task for task in _unique(selected_task_ids) if task not in covered]
    if missing:
        raise DispatchGateError(
            "coverage", missing, "dispatch coverage: no agent was dispatched for %s %s"
            % ("task" if len(missing) == 1 else "tasks", ", ".join(missing)),
            "dispatch each chosen task (P3) before collecting, or take it out of the batch")


def check_batch_size(selected_task_ids, max_tasks):
    """The batch holds at most ``max_tasks`` tasks (0: no limit)."""
    batch = _unique(selected_task_ids)
    if max_tasks > 0 and len(batch) > max_tasks:
        raise DispatchGateError(
            "batch", batch[max_tasks:], "batch size: %d tasks chosen, at most %d run at once "
            "(over: %s)" % (len(batch), max_tasks, ", ".join(batch[max_tasks:])),
            "choose at most max_tasks tasks per batch, or raise [parallel] max_tasks")


def check_delegation(tasks, records, allowed_agents):
    """A task a supervisor session split off as team lead (its origin has
    ``delegated_by``) went to an executor agent the topology allows.

    ``tasks`` is [(task id, origin dict)]; ``allowed_agents`` None means no topology
    restricts the agents."""
    if allowed_agents is None:
        return
    allowed = set(allowed_agents)
    wrong = []
    for task_id, origin in tasks:
        if not isinstance(origin, dict) or not origin.get("delegated_by"):
            continue
        agents = [r.agent for r in records if r.task_id == task_id and r.role == "executor"]
        if not agents or any(agent not in allowed for agent in agents):
            wrong.append((task_id, origin["delegated_by"], agents))
    if wrong:
        raise DispatchGateError(
            "delegation", [task for task, _, _ in wrong],
            "team-lead delegation: %s" % "; ".join(
                "task %s (split off by session %s) went to %s" % (
                    task, lead, ", ".join(agents) if agents else "no executor")
                for task, lead, agents in wrong),
            "the topology allows %s as the executor of a delegated task" % (
                ", ".join(sorted(allowed)) if allowed else "no agent"))


def run_dispatch_gates(selected, records, tasks, max_tasks, allowed_agents):
    """Coverage, batch size and delegation, in that order; raises the first failure."""
    check_dispatch_coverage(selected, records)
    check_batch_size(selected, max_tasks)
    check_delegation(tasks, records, allowed_agents)


# ============================================================================
# 8. Store
# ============================================================================

FERRUS_DIR = ".ferrus"
STATE_FILE = "STATE.json"
LOCK_FILE = "STATE.lock"
JOURNAL_FILE = "events.jsonl"
JOURNAL_ARCHIVE_FILE = "events.jsonl.1"    # what the last rotation moved aside
JOURNAL_GAP_EVENT = "journal_gap"          # one entry for seqs whose lines are lost
# events.jsonl is rotated when a line would take it past this size (FERRUS_JOURNAL_MAX_BYTES).
JOURNAL_MAX_BYTES = 16 * 1024 * 1024


def journal_max_bytes():
    value = os.environ.get("FERRUS_JOURNAL_MAX_BYTES", "")
    try:
        return max(1024, int(value)) if value.strip() else JOURNAL_MAX_BYTES
    except ValueError:
        log.warning("FERRUS_JOURNAL_MAX_BYTES=%r is not a number of bytes; using %d",
                    value, JOURNAL_MAX_BYTES)
        return JOURNAL_MAX_BYTES


# A journal line longer than this is damage (ferrus writes lines of a few hundred bytes):
# readers skip it without ever holding it in memory.
JOURNAL_LINE_LIMIT = 16 * 1024 * 1024


def _lines_backwards(path, chunk=4096, limit=None):
    """The lines of a file (bytes, without their newline) from the last to the first,
    read in chunks from the end that grow up to 1 MiB (most callers want only the
    last few lines).  Lines longer than ``limit`` are skipped.  A missing file has none."""
    limit = JOURNAL_LINE_LIMIT if limit is None else limit
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return
    with handle:
        position = handle.seek(0, os.SEEK_END)
        rest = b""
        skipping = False                 # inside a line already known to be too long
        while position > 0:
            start = max(0, position - chunk)
            handle.seek(start)
            data = handle.read(position - start) + rest
            position = start
            chunk = min(chunk * 4, 1 << 20)
            lines = data.split(b"\n")
            if skipping:
                if len(lines) == 1:
                    continue             # still inside the long line
                lines.pop()              # its first part; what precedes it is whole again
                skipping = False
            rest = lines[0]              # may continue in the chunk before this one
            for line in reversed(lines[1:]):
                yield line
            if len(rest) > limit:
                rest, skipping = b"", True
        if not skipping:
            yield rest


def _lines_forward(path, limit=None):
    """The lines of a file (bytes, without their newline) from the first; a line longer
    than ``limit`` comes as None, read past in bounded pieces."""
    limit = JOURNAL_LINE_LIMIT if limit is None else limit
    with open(path, "rb") as handle:
        while True:
            line = handle.readline(limit + 1)
            if not line:
                return
            if len(line) > limit and not line.endswith(b"\n"):
                while True:
                    more = handle.readline(1 << 20)
                    if not more or more.endswith(b"\n"):
                        break
                yield None
                continue
            yield line[:-1] if line.endswith(b"\n") else line


def _end_of_complete_lines(handle, size, chunk=65536):
    """The offset just past the last newline in an open binary file (0 for none)."""
    position = size
    while position > 0:
        start = max(0, position - chunk)
        handle.seek(start)
        data = handle.read(position - start)
        newline = data.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        position = start
    return 0
CONTENT_FILES = ("TASK.md", "REVIEW.md", "SUBMISSION.md", "QUESTION.md", "ANSWER.md",
                 "CONSULT_REQUEST.md", "CONSULT_RESPONSE.md", "LAST_SPEC_PATH")
# Files that a new task, a reset or HQ's force-reset empty.
TASK_SCRATCH_FILES = ("SUBMISSION.md", "CONSULT_REQUEST.md", "CONSULT_RESPONSE.md",
                      "REVIEW.md", "QUESTION.md", "ANSWER.md")
# The reviewer's notes on an approval, for the human who confirms it ([hq] human_review).
# Not one of CONTENT_FILES: a .ferrus/ from before it existed, or upstream's, lacks it and
# is still complete; it is emptied with the task's other files only where it exists.
APPROVAL_FILE = "APPROVAL.md"
# Every file that belongs to a task (in .ferrus/tasks/<id>/ for a parallel one).
TASK_FILES = frozenset(CONTENT_FILES + (APPROVAL_FILE, STATE_FILE))


@dataclasses.dataclass
class Commit:
    """What one transaction changed, as the journal records it."""

    seq: int
    time: str
    actor: str
    event: str
    from_state: str
    to_state: str
    task_id: "str | None"
    detail: dict

    def to_json(self):
        return {"seq": self.seq, "time": self.time, "actor": self.actor, "event": self.event,
                "from": self.from_state, "to": self.to_state, "task_id": self.task_id,
                "detail": self.detail}


_JOURNAL_TEXT_FIELDS = ("time", "actor", "event", "from", "to", "task_id")


def journal_entry(line):
    """One journal line as a dict with an integer seq, or None when it is not one
    (a write cut short by a crash, or a hand edit)."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict):
        return None
    seq = entry.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int):
        return None
    if not isinstance(entry.get("detail", {}), dict) or not all(
            isinstance(entry.get(key), (str, type(None))) for key in _JOURNAL_TEXT_FIELDS):
        return None
    return entry


# What a content file holds, for messages about the text written to it.
_CONTENT_FILE_WORDS = {"TASK.md": "the task description", "REVIEW.md": "the review notes",
                       "SUBMISSION.md": "the submission", "QUESTION.md": "the question",
                       "ANSWER.md": "the answer", "CONSULT_REQUEST.md": "the consultation",
                       "CONSULT_RESPONSE.md": "the consultation's answer"}
# A lone surrogate: what Python makes of a byte that is not UTF-8 in a command-line
# argument or a line read from a terminal (and of a "\udcff" JSON escape).
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def require_utf8(text, what):
    """FerrusError unless ``text`` can be written as UTF-8 (no lone surrogate)."""
    bad = _LONE_SURROGATE.search(text) if isinstance(text, str) else None
    if bad:
        code = ord(bad.group())
        raise FerrusError("%s is not valid UTF-8: it holds %s at character %d" % (
            what, "the byte 0x%02x" % (code - 0xdc00) if 0xdc80 <= code <= 0xdcff
            else "an unpaired surrogate U+%04X" % code, bad.start() + 1),
            "write it in UTF-8 (a terminal or a file in another encoding passes other "
            "bytes); nothing was changed")
    return text


class Transaction:
    """The working copy inside ``Store.transaction``: read the state, stage changes.

    Nothing touches the disk until the ``with`` block ends without an exception;
    then content files are written first and STATE.json last (the commit point),
    and one journal line follows."""

    def __init__(self, store, actor, before):
        self.store = store
        self.actor = actor
        self.before = before
        self.state = before.copy()
        self.files = {}
        self.event = None
        self.detail = {}
        self.committed = None   # the Commit, once the block has ended
        self.rotate_journal = False     # start a new events.jsonl with this commit's line
        self.journal_task_id = None     # the task the entry is about, when not the state's
        self.rotated_journal = False    # whether the commit did

    def read(self, name):
        """A content file as this transaction will leave it."""
        if name in self.files:
            return self.files[name]
        return self.store.read_file(name)

    def write(self, name, text):
        # Refused before anything is written: the commit would fail half-way.
        require_utf8(text, _CONTENT_FILE_WORDS.get(name, "the text for %s/%s" % (
            FERRUS_DIR, name)))
        self.files[name] = text

    def set(self, state, event, **detail):
        """Stage the new state and name the event the journal will record."""
        self.state = state
        self.event = event
        self.detail.update(detail)


# Parallel tasks (see ARCHITECTURE.md, 'Parallel tasks') live in .ferrus/tasks/<id>/: the
# queue's record of the task (task.json), its STATE.json and its content files.
TASKS_DIR = "tasks"
TASK_RECORD_FILE = "task.json"
# A parallel task's branch is this + its id (doctor finds leftovers by it).
TASK_BRANCH_PREFIX = "ferrus/"
QUEUED_STATUS, RUNNING_STATUS, MERGED_STATUS, DONE_STATUS, FAILED_STATUS, CANCELLED_STATUS = (
    "queued", "running", "merged", "done", "failed", "cancelled")
TASK_STATUSES = (QUEUED_STATUS, RUNNING_STATUS, MERGED_STATUS, DONE_STATUS, FAILED_STATUS,
                 CANCELLED_STATUS)
# Statuses of a task that no orchestrator will take up again.
ENDED_STATUSES = (MERGED_STATUS, DONE_STATUS, FAILED_STATUS, CANCELLED_STATUS)
# The project's STATE.json names the parallel task it mirrors under this additive key.
PARALLEL_MIRROR_KEY = "mirrors_task"
# What the project's STATE.json keeps for itself while it mirrors a task: the
# supervisor's selection and a capacity checkpoint belong to the project, not a task.
_PROJECT_STATE_FIELDS = ("selected_spec", "selected_milestone", "pending_task_spec",
                         "pending_task_milestone")
_PROJECT_EXTRA_KEYS = ("capacity_checkpoint", PARALLEL_MIRROR_KEY)


def _task_part(data):
    """``data`` without what belongs to the project (for comparing a task's state)."""
    part = data.copy()
    for name in _PROJECT_STATE_FIELDS:
        setattr(part, name, None)
    for key in _PROJECT_EXTRA_KEYS:
        part.extra.pop(key, None)
    return part


def _mirror(project, state, task):
    """The project's STATE.json after a commit of parallel task ``task``: a copy of the
    task's state while it is the foreground task (it was, or the project's own state is
    not in flight), else the project's state as it was; with the new rev either way."""
    if project.extra.get(PARALLEL_MIRROR_KEY) == task or project.state not in ACTIVE_STATES:
        out = state.copy()
        for name in _PROJECT_STATE_FIELDS:
            setattr(out, name, getattr(project, name))
        for key in _PROJECT_EXTRA_KEYS:
            out.extra.pop(key, None)
            if key in project.extra:
                out.extra[key] = project.extra[key]
        out.extra[PARALLEL_MIRROR_KEY] = task
    else:
        out = project.copy()
        out.updated_at, out.owner_pid = state.updated_at, state.owner_pid
    out.rev = state.rev
    return out


def task_record_path(ferrus_dir, task):
    return os.path.join(ferrus_dir, TASKS_DIR, task, TASK_RECORD_FILE)


def read_task_record(ferrus_dir, task):
    """A parallel task's queue record (task.json) as a dict; {} when missing or damaged
    (load_task_record says what is wrong; doctor reports and repairs it)."""
    return load_task_record(ferrus_dir, task)[0]


# What task.json may hold; a record that breaks any of it is damaged as a whole, so no
# reader ever meets a field of the wrong type (a list for a status, a number for a path).
TASK_RECORD_MAX_BYTES = 1 << 20
TASK_RECORD_TEXT_CHARS = 64 * 1024
_TASK_RECORD_TEXT = ("id", "title", "created_at", "started_at", "ended_at", "agent",
                     "worktree", "workdir", "branch", "base", "target", "conflict_base",
                     "reason", "merged_commit", "store")
_TASK_RECORD_COMMITS = ("base", "conflict_base", "merged_commit")
_COMMIT_ID_RE = re.compile(r"[0-9a-f]{4,64}")


class TaskRecordDamaged(FerrusError):
    """A task.json that is unreadable or holds what ferrus never writes; nothing is
    written over it (doctor sets it aside and writes a new one)."""

    def __init__(self, task, problem):
        self.task, self.problem = task, problem
        super().__init__("task %s: its %s/%s/%s/%s is damaged (%s)" % (
            task, FERRUS_DIR, TASKS_DIR, task, TASK_RECORD_FILE, problem),
            "`ferrus doctor --fix` keeps it as %s.corrupt-<time> and writes a new record "
            "from what is left (a task that had started becomes failed, its worktree kept: "
            "`ferrus task retry` goes on with it)" % TASK_RECORD_FILE)


def damaged_task_note(task, problem):
    """What a run says once about a task whose task.json is damaged."""
    err = TaskRecordDamaged(task, problem)
    return "%s — this run leaves the task alone\nhint: %s" % (err.message, err.hint)


def load_task_record(ferrus_dir, task):
    """(task.json as a dict, None), or ({}, what is wrong with it); ({}, None) when the
    task has no record."""
    try:
        with open_inside(os.path.join(ferrus_dir, TASKS_DIR, task), TASK_RECORD_FILE) as handle:
            raw = handle.read(TASK_RECORD_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}, None
    except (OSError, UnsafePath) as err:
        return {}, "it cannot be read: %s" % (getattr(err, "strerror", None) or err)
    if len(raw) > TASK_RECORD_MAX_BYTES:
        return {}, "it is larger than %d MiB" % (TASK_RECORD_MAX_BYTES >> 20)
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError as err:
        return {}, "not valid JSON: %s" % terminal_safe(str(err))[:120]
    problem = task_record_problem(task, record)
    return ({}, problem) if problem else (record, None)


def task_record_problem(task, record):
    """What is wrong with ``record`` as task ``task``'s task.json, or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("status") not in TASK_STATUSES:
        return "status %s is none of %s" % (_shown(record.get("status")),
                                            ", ".join(TASK_STATUSES))
    for key in _TASK_RECORD_TEXT:
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            return "%s is %s, not text" % (key, _shown(value))
        if value is not None and len(value) > TASK_RECORD_TEXT_CHARS:
            return "%s is %d characters long" % (key, len(value))
    if record.get("id") is not None and record["id"] != task:
        return "id %s is not the task's own" % _shown(record["id"])
    if record.get("store") not in (None, "worktree", "project"):
        return "store %s is neither worktree nor project" % _shown(record["store"])
    for key in ("worktree", "workdir"):
        if record.get(key) is not None and not os.path.isabs(record[key]):
            return "%s %s is no absolute path" % (key, _shown(record[key]))
    worktree, workdir = record.get("worktree"), record.get("workdir")
    if workdir is not None and not (worktree and _path_within(workdir, worktree)):
        return "workdir %s is not inside its worktree" % _shown(workdir)
    if record.get("branch") is not None and record["branch"] != TASK_BRANCH_PREFIX + task:
        return "branch %s is not the task's branch %s" % (_shown(record["branch"]),
                                                           TASK_BRANCH_PREFIX + task)
    if record.get("target") is not None and git_branch_name_problem(record["target"]):
        return "target %s is no branch name" % _shown(record["target"])
    for key in _TASK_RECORD_COMMITS:
        if record.get(key) is not None and not _COMMIT_ID_RE.fullmatch(record[key]):
            return "%s %s is no commit id" % (key, _shown(record[key]))
    for key, kinds in (("origin", {"spec": str, "milestone": str, "by": str,
                                   "delegated_by": str}),
                       ("integration", {"candidate": str, "target_head": str})):
        value = record.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            return "%s is %s, not an object" % (key, _shown(value))
        for name, kind in kinds.items():
            if value.get(name) is not None and not isinstance(value[name], kind):
                return "%s.%s is %s, not text" % (key, name, _shown(value[name]))
    conflicts = record.get("conflicts")
    if conflicts is not None and not (isinstance(conflicts, list) and
                                      all(isinstance(path, str) for path in conflicts)):
        return "conflicts is %s, not a list of paths" % _shown(conflicts)
    if record["status"] == RUNNING_STATUS and record.get("store") == "worktree" and not (
            record.get("worktree") and record.get("branch")):
        return "it is running in a worktree but names no %s" % (
            "worktree" if not record.get("worktree") else "branch")
    return None


def _path_within(path, folder):
    """Whether ``path`` is ``folder`` or inside it, by their text (no file is looked at)."""
    try:
        rel = os.path.relpath(os.path.normpath(path), os.path.normpath(folder))
    except ValueError:                  # Windows: on another drive
        return False
    return rel == os.curdir or not (rel == os.pardir or rel.startswith(os.pardir + os.sep))


def _shown(value):
    """A value of a damaged record, short enough for a message."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return terminal_safe(text if len(text) <= 40 else text[:37] + "...")


class JournalWriteError(FerrusError, OSError):
    """STATE.json was committed but its journal line could not be written (still an
    OSError for callers that catch those)."""


class Store:
    """The project's ``.ferrus/`` directory: state, content files, journal, lock.

    With ``task`` it is the store of one of the parallel tasks (see ARCHITECTURE.md,
    'Parallel tasks'): STATE.json and the content files live in ``.ferrus/tasks/<id>/``
    and the code it works on in the task's worktree (``workdir``), while the lock, the
    journal, the sessions and the logs stay the project's.  A task's commit also writes
    the project's STATE.json: its rev is the journal's seq for every task (so seq == rev
    still holds project-wide and every waiter wakes), and while that task is in the
    foreground the file mirrors its state, for upstream's readers and the status line."""

    def __init__(self, root, clock=utc_now, lock_timeout=None, monotonic=time.monotonic,
                 task=None):
        self.root = os.path.abspath(root)
        self.dir = os.path.join(self.root, FERRUS_DIR)
        self.clock = clock              # wall clock: timestamps written to files
        self.monotonic = monotonic      # for durations: leases honoured, waits
        self.lock_timeout = lock_timeout if lock_timeout is not None else float(
            os.environ.get("FERRUS_LOCK_TIMEOUT", "10"))
        self.config_cache = ConfigCache(self.root)
        self.task = task
        self.task_dir = self.dir if task is None else os.path.join(self.dir, TASKS_DIR, task)
        self._workdir = None if task is not None else self.root

    def for_task(self, task):
        """The store of one parallel task of this project (same clocks and lock)."""
        store = Store(self.root, self.clock, self.lock_timeout, self.monotonic, task=task)
        store.config_cache = self.config_cache
        return store

    @property
    def workdir(self):
        """Where the task's code is: its worktree for a parallel task, else the project."""
        if self._workdir is None:
            record, problem = load_task_record(self.dir, self.task)
            if problem:
                # Never the project's checkout instead: the task's agents and checks
                # would work there.
                raise TaskRecordDamaged(self.task, problem)
            worktree = record.get("workdir") or record.get("worktree")
            self._workdir = worktree if isinstance(worktree, str) and worktree else self.root
        return self._workdir

    # -- paths and plain reads ------------------------------------------------

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def task_path(self, name):
        """A file of the task: STATE.json or a content file (TASK.md, ...)."""
        return os.path.join(self.task_dir, name)

    def relpath(self, path):
        rel = os.path.relpath(path, self.root)
        return rel.replace(os.sep, "/")

    def exists(self):
        return os.path.isfile(self.task_path(STATE_FILE))

    def require(self):
        if not os.path.isdir(self.dir):
            raise FerrusError("no %s/ directory in %s" % (FERRUS_DIR, self.root),
                              "run `ferrus init` in the project root first")
        if not os.path.isfile(self.path(STATE_FILE)):
            raise FerrusError("cannot read %s/%s — it is missing" % (FERRUS_DIR, STATE_FILE),
                              "run `ferrus init` (it recreates missing files and keeps the rest)")
        if self.task is not None and not self.exists():
            raise FerrusError("task %s has no state: it is queued, or not a task of this "
                              "project" % self.task, "`ferrus tasks` lists the tasks")
        return self

    def config(self):
        return self.config_cache.get()

    # -- leases, judged by this process's own monotonic clock -------------------

    def lease_seconds_left(self, data):
        """How much longer this process honours ``data``'s lease (0.0: free)."""
        try:
            ttl = self.config().lease.ttl_secs
        except FerrusError:
            ttl = LeaseConfig().ttl_secs
        return LEASE_SIGHTINGS.seconds_left(self.task_dir, data, self.clock(), self.monotonic, ttl,
                                            self._state_written_age)

    def lease_live(self, data):
        return self.lease_seconds_left(data) > 0

    def _state_written_age(self):
        """Real seconds since STATE.json was last written, by the file system's clock."""
        try:
            return max(0.0, time.time() - os.stat(self.task_path(STATE_FILE)).st_mtime)
        except OSError:
            return 0.0

    def read_state(self):
        """The committed state.  Safe without the lock: STATE.json is only ever replaced."""
        self.require()
        return self.continue_journal(StateData.from_json(
            read_text(self.task_path(STATE_FILE)), self.relpath(self.task_path(STATE_FILE))))

    def continue_journal(self, data):
        """A STATE.json without ``rev`` was last written by upstream ferrus (which knows
        no journal) or never written at all: its revision is where the journal ends, so
        the next commit continues the journal instead of looking like a restored file."""
        if data.rev == 0:
            data.rev = self.last_journal_seq()
        return data

    def read_file(self, name):
        """A content file's text ("" when missing); never through a symbolic link."""
        try:
            with open_inside(self.task_dir, name) as handle:
                return handle.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def state_stamp(self):
        """A cheap fingerprint that changes on every commit.

        STATE.json's inode, mtime and size alone could repeat on a filesystem with
        coarse timestamps (inodes are reused, sizes often equal); the journal grows
        one line per commit, and a rotation gives it a new inode, so its inode and
        size make the stamp strictly new."""
        try:
            st = os.stat(self.path(STATE_FILE))
        except FileNotFoundError:
            return None
        try:
            journal = os.stat(self.journal_path())
            journal = (journal.st_ino, journal.st_size)
        except FileNotFoundError:
            journal = -1
        return (st.st_ino, st.st_mtime_ns, st.st_size, journal)

    # -- transactions -----------------------------------------------------------

    def lock(self):
        return FileLock(self.path(LOCK_FILE), self.lock_timeout, FERRUS_DIR + "/" + LOCK_FILE)

    @contextlib.contextmanager
    def transaction(self, actor):
        """Read-modify-write of ``.ferrus/`` under the exclusive STATE.lock."""
        self.require()
        with self.lock():
            before = self.read_state()
            tx = Transaction(self, actor, before)
            yield tx
            if tx.event is not None:
                tx.committed = self._commit(tx)

    def _commit(self, tx):
        now = self.clock()
        for name, text in tx.files.items():
            path = self.task_path(name)
            # Clearing an already empty file is common (create_task, reset); an
            # unchanged file needs no write and no fsync.
            if read_text(path, default="\0") != text:
                atomic_write(path, text)
        state = tx.state.copy()
        if self.task is None and tx.before.extra.get(PARALLEL_MIRROR_KEY) and \
                _task_part(state) != _task_part(tx.before):
            if tx.before.state in ACTIVE_STATES:
                raise FerrusError(
                    "%s/%s mirrors task %s, which runs in its own worktree; its state "
                    "changes only through that task" % (
                        FERRUS_DIR, STATE_FILE, tx.before.extra[PARALLEL_MIRROR_KEY]),
                    "agents of a parallel task are started by `ferrus run --parallel` or HQ; "
                    "`ferrus task cancel ID` drops one")
            # The mirrored task has ended: a task of the project's own takes the file over.
            del state.extra[PARALLEL_MIRROR_KEY]
        if self.task is None:
            state.rev = tx.before.rev + 1
            project = None
        else:
            # The project's STATE.json numbers every commit of every task: it is written
            # first (a crash after it leaves a gap the next commit records, never a seq
            # used twice), the task's own file second, the journal line last.
            project = self.project_state()
            state.rev = project.rev + 1
        state.updated_at = format_timestamp(now)
        state.owner_pid = os.getpid()
        if state.state != tx.before.state and state.state_entered_at == tx.before.state_entered_at:
            state.state_entered_at = format_timestamp(now)
        if project is not None:
            atomic_write(self.path(STATE_FILE), _mirror(project, state, self.task).to_json())
        atomic_write(self.task_path(STATE_FILE), state.to_json())
        commit = Commit(seq=state.rev, time=state.updated_at, actor=tx.actor, event=tx.event,
                        from_state=tx.before.state.value, to_state=state.state.value,
                        task_id=state.task_id if tx.journal_task_id is None
                        else tx.journal_task_id or None, detail=tx.detail)
        try:
            tx.rotated_journal = self._append_journal(commit, state.rev,
                                                      rotate=tx.rotate_journal)
        except OSError as err:
            raise JournalWriteError(
                "%s was committed to STATE.json (rev %d), but its journal line could not be "
                "written: %s" % (tx.event, state.rev, err.strerror or err),
                "free space or fix permissions, then run `ferrus doctor --fix` to add the "
                "missing journal entry") from err
        return commit

    def project_state(self):
        """The project's STATE.json (the foreground task's state, its rev the journal's)."""
        return self.continue_journal(StateData.from_json(
            read_text(self.path(STATE_FILE)), FERRUS_DIR + "/" + STATE_FILE))

    # -- the journal ----------------------------------------------------------------

    def journal_path(self):
        return self.path(JOURNAL_FILE)

    def journal_archive_path(self):
        return self.path(JOURNAL_ARCHIVE_FILE)

    def journal_entries_backwards(self):
        """Journal entries from the newest back, reading the files from their ends.

        events.jsonl first, then the archive a rotation left; only strictly falling
        seqs are yielded, so an entry that both files hold is not seen twice.  The
        cost is what the caller consumes, never the length of the journal."""
        below = None
        for path in (self.journal_path(), self.journal_archive_path()):
            for raw in _lines_backwards(path):
                if not raw.strip():
                    continue
                entry = journal_entry(raw.decode("utf-8", "replace"))
                if entry is None or (below is not None and entry["seq"] >= below):
                    continue
                below = entry["seq"]
                yield entry

    def journal_entries(self):
        """Every journal entry, oldest first (the archive, then events.jsonl), streamed
        so that printing a long journal needs no memory for it."""
        above = None
        for path in (self.journal_archive_path(), self.journal_path()):
            if not os.path.exists(path):
                continue
            for line in _lines_forward(path):
                entry = journal_entry(line.decode("utf-8", "replace")) \
                    if line is not None and line.strip() else None
                if entry is None or (above is not None and entry["seq"] <= above):
                    continue
                above = entry["seq"]
                yield entry

    def last_journal_seq(self):
        """The seq of the last complete journal line (0 for none), reading only the tail."""
        entry = next(self.journal_entries_backwards(), None)
        return entry["seq"] if entry is not None else 0

    def _append_journal(self, commit, rev, rotate=False):
        """Append one fsynced line.  A gap a crash left (STATE.json committed, its line
        never written) is first recorded as ONE journal_gap entry, however many seqs
        it spans, so seq stays continuous and the cost stays constant.  Returns whether
        events.jsonl was rotated first."""
        path = self.journal_path()
        last = self.last_journal_seq()
        lines = []
        if last + 1 < rev:
            lines.append(compact_json(Commit(
                seq=rev - 1, time=commit.time, actor="ferrus", event=JOURNAL_GAP_EVENT,
                from_state="?", to_state="?", task_id=None,
                detail={"from": last + 1, "to": rev - 1,
                        "note": "these transitions were committed to STATE.json, but their "
                                "journal lines are lost (a crash before the write, or an "
                                "emptied or damaged events.jsonl)"}).to_json()))
        if last >= rev:
            # The journal is ahead of STATE.json (e.g. a restored backup): keep both
            # readable and let doctor explain it rather than writing duplicate seqs.
            log.warning("journal seq %d is ahead of STATE.json rev %d", last, rev)
        lines.append(compact_json(commit.to_json()))
        payload = ("\n".join(lines) + "\n").encode("utf-8")
        rotated = False
        with contextlib.suppress(FileNotFoundError):
            size = os.stat(path).st_size
            if size and (rotate or size + len(payload) > journal_max_bytes()):
                rotated = self._rotate_journal()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            # A torn last line (killed mid-write) must not glue onto ours.
            if os.fstat(fd).st_size:
                with open(path, "rb") as handle:
                    handle.seek(-1, os.SEEK_END)
                    if handle.read(1) != b"\n":
                        payload = b"\n" + payload
            view = memoryview(payload)
            while view:         # a short write (a full disk) must not pass for a whole line
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return rotated

    def _rotate_journal(self):
        """events.jsonl becomes the archive (replacing the previous one), so the journal
        on disk stays under about twice the limit.  The caller's line then starts the
        new file, which keeps its last seq equal to rev.  Called under the lock."""
        try:
            os.replace(self.journal_path(), self.journal_archive_path())
        except OSError as err:
            # Windows refuses to rename a file another process has open: keep
            # appending and rotate on a later commit.
            log.warning("could not rotate %s: %s", JOURNAL_FILE, err)
            return False
        with contextlib.suppress(OSError):
            fsync_directory(self.dir)
        return True

    def read_journal(self, after_seq=0, limit=None):
        """Journal entries with seq > after_seq (the last ``limit`` when given), oldest
        first, read from the end, so a short tail is cheap however long the journal.

        Lines that do not parse (a torn write) are skipped here; doctor reports them."""
        if limit is not None and limit <= 0:
            return []
        entries = []
        for entry in self.journal_entries_backwards():
            if entry["seq"] <= after_seq or (limit is not None and len(entries) >= limit):
                break
            entries.append(entry)
        entries.reverse()
        return entries

    def journal_position(self):
        """Where the journal ends now, for journal_since: (file identity, byte offset)."""
        try:
            with open(self.journal_path(), "rb") as handle:
                stat = os.fstat(handle.fileno())
                return ((stat.st_dev, stat.st_ino), _end_of_complete_lines(handle, stat.st_size))
        except FileNotFoundError:
            return None

    def journal_since(self, position, after_seq=0):
        """(entries with seq > after_seq appended after ``position``, the new position).

        HQ polls with this, so each poll reads only what is new.  When events.jsonl
        was rotated (or replaced by doctor) since ``position``, what the archive holds
        after ``after_seq`` comes first and the new file is read from its start."""
        try:
            handle = open(self.journal_path(), "rb")
        except FileNotFoundError:
            return [], position            # between a rotation's rename and its write
        with handle:
            stat = os.fstat(handle.fileno())
            identity = (stat.st_dev, stat.st_ino)
            entries = []
            if position is None or position[0] != identity or stat.st_size < position[1]:
                start = 0
                for entry in self.journal_entries_backwards():
                    if entry["seq"] <= after_seq:
                        break
                    entries.append(entry)
                entries.reverse()
                return entries, (identity, _end_of_complete_lines(handle, stat.st_size))
            start = position[1]
            handle.seek(start)
            data = handle.read()
        end = data.rfind(b"\n") + 1        # a line still being written waits for the next poll
        for line in data[:end].split(b"\n"):
            if not line.strip():
                continue
            entry = journal_entry(line.decode("utf-8", "replace"))
            if entry is not None and entry["seq"] > after_seq:
                entries.append(entry)
        return entries, (identity, start + end)

    def append_event(self, actor, event, detail, task_id=None):
        """Journal an event that is not a task transition (sessions, gates, notes), about
        ``task_id`` when it is not the state's task (a queued one, or none: "").

        It still bumps rev, so seq == rev holds and every waiter wakes."""
        with self.transaction(actor) as tx:
            tx.set(tx.state, event)
            tx.detail.update(detail)
            tx.journal_task_id = task_id
        return tx.committed

    # -- waiting ----------------------------------------------------------------------

    def wait_for_change(self, stamp, deadline, cancel=None, poll=0.005):
        """Sleep until STATE.json changes, ``deadline`` (monotonic) passes or ``cancel`` is set.

        A stat every few milliseconds is cheap and notices a commit quickly on every
        platform, without inotify/kqueue."""
        while True:
            if cancel is not None and cancel.is_set():
                return False
            current = self.state_stamp()
            if current != stamp:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if cancel is not None:
                cancel.wait(min(poll, remaining))
            else:
                time.sleep(min(poll, remaining))


# Journal entries that record how ferrus keeps its own books (agent sessions, leases,
# capacity decisions that let work go on) rather than what happened to the task;
# `ferrus log` and HQ's /log leave them out unless asked for everything.
BOOKKEEPING_EVENTS = ("session", "heartbeat", "claim", "lease_released", "consume_answer")


def is_bookkeeping(entry):
    if entry.get("event") == "gate":
        return (entry.get("detail") or {}).get("action") == CONTINUE
    return entry.get("event") in BOOKKEEPING_EVENTS


def is_story(entry):
    """The journal entries a person reading what happened wants (not bookkeeping)."""
    return not is_bookkeeping(entry)


def journal_story(store, count, everything=False, task=None):
    """The last ``count`` journal entries, oldest first, bookkeeping left out unless
    ``everything``, only those about ``task`` when it is given.  At most 20 entries per
    wanted one (and 500; 50 and 5,000 for one task of several) are looked at, so a
    journal of a million heartbeats costs what a short one does; fewer may come back."""
    if everything and task is None:
        return store.read_journal(limit=count)
    scan = 20 * count + 500 if task is None else 50 * count + 5000
    entries = []
    for entry in itertools.islice(store.journal_entries_backwards(), scan):
        if len(entries) >= count:
            break
        if (everything or is_story(entry)) and (task is None or entry.get("task_id") == task):
            entries.append(entry)
    entries.reverse()
    return entries


# ============================================================================
# 9. Checks
# ============================================================================

# A single output line longer than this is cut in the in-memory tail (the log
# file keeps it whole); together with the line count this bounds memory.
_TAIL_LINE_BYTES = 4000


@dataclasses.dataclass
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


@dataclasses.dataclass
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
                     max_log_bytes=ChecksConfig.max_log_bytes, process_dir=None):
    """Run one check command to completion, timeout or ``stop``; fill ``result``."""
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
            proc = subprocess.Popen(shell_argv(result.command), cwd=root,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, env=record.environment(),
                                    **process_group_kwargs())
        except OSError as err:
            log.error("check command %r could not start: %s", result.command, err)
            result.status = "failed"
            result.tail = ["could not start the shell: %s" % err]
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

    def environment(self):
        """The command's environment; also opens the pid window, just before the spawn."""
        env = dict(os.environ)
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


def run_checks(root, checks, log_dir, attempt=1, keep_lines=30, cancel=None, project=None):
    """Run the configured check commands (never anything an agent supplies) in ``root``.

    Every command streams into its own log file under ``log_dir``; a summary
    file names them all, by paths relative to ``project`` (default ``root``: a parallel
    task's checks run in its worktree, its logs are the project's).  ``cancel`` (a
    threading.Event) stops the run and kills the process groups."""
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
                         checks.max_log_bytes)
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


# ============================================================================
# 10. Git
# ============================================================================
#
# The only code that runs git: reading a task's base and diff, and, when [git] asks,
# writing its branch and its commit; for parallel tasks, their worktrees and their
# integration into the target branch.  Operations, the MCP server and the front ends
# reach the repository through this section alone.

# -- git: a task's base and its diff --------------------------------------------------
#
# A task remembers where it started (record_task_base) and its diff is measured from
# there to the working tree, untracked files included (task_diff).  ferrus only reads
# the repository: git runs from argv lists (no shell) with a timeout, the user's index
# is never written (the full diff works on a private copy of it, and
# GIT_OPTIONAL_LOCKS=0 keeps the read-only commands from refreshing it), and where git
# is missing or the project is not in a repository there is simply no diff.
# Operations, the MCP server and HQ reach git only through the functions below
# (docs/ARCHITECTURE.md, "Git: a task's base and diff").

GIT_TIMEOUT_SECS = 60.0
# Files ferrus (or `ferrus register`) writes into a project: never part of a task's
# diff, whatever the agent did.  Paths relative to the project root.
DIFF_EXCLUDED_PATHS = (FERRUS_DIR, ".mcp.json", ".claude/mcp-supervisor.json",
                       ".claude/mcp-executor.json", ".claude/settings.local.json",
                       ".codex", ".qwen", ".gemini")
# The skill folders `ferrus init` writes under [agents] path.
DIFF_EXCLUDED_SKILLS = ("skills/ferrus", "skills/ferrus-supervisor", "skills/ferrus-executor")
# What create_task names of a dirty tree (the count is always exact).
BASE_DIRTY_NAMES = 50
# Variables that would point git at another repository or index than the project's.
_GIT_LOCATION_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_PREFIX",
                      "GIT_COMMON_DIR", "GIT_NAMESPACE", "GIT_OBJECT_DIRECTORY",
                      "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CEILING_DIRECTORIES")


class GitUnavailable(FerrusError):
    """There can be no diff here (git is missing, or the project is in no repository);
    everything else in ferrus works as without git."""


class GitError(FerrusError):
    """A git command failed or gave an answer ferrus cannot use."""


def _git_env(index_file=None):
    # A hook or a wrapper may have exported GIT_DIR & co. for another repository:
    # the project's repository is the one its root is in, nothing else.
    env = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATION_VARS}
    env.update(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", GIT_PAGER="cat")
    if index_file:
        env["GIT_INDEX_FILE"] = index_file
    return env


def _git_argv(args):
    return ["git", "-c", "core.quotePath=false", "-c", "core.fsmonitor=false"] + list(args)


def _git_failure(args, code, stderr):
    said = stderr.decode("utf-8", "replace").strip()
    command = next((arg for arg in args if not arg.startswith("-")), args[0])
    return GitError("git %s failed (exit %s)%s" % (command, code, ": " + said if said else ""),
                    "run the same git command in the project to see what git needs")


def run_git(root, args, timeout=GIT_TIMEOUT_SECS, index_file=None, stdin=None, ok=(0,)):
    """stdout (bytes) of ``git <args>`` run in ``root``.  Raises GitUnavailable when git
    is not installed, GitError when it fails, times out or exits outside ``ok``."""
    try:
        proc = subprocess.run(_git_argv(args), cwd=root, env=_git_env(index_file),
                              input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=None if stdin is not None else subprocess.DEVNULL,
                              timeout=timeout)
    except FileNotFoundError:
        raise GitUnavailable("git is not installed (no `git` command on PATH)",
                             "install git to see task diffs; everything else works without it"
                             ) from None
    except subprocess.TimeoutExpired:
        raise GitError("git %s did not finish within %.0f s" % (args[0], timeout),
                       "the repository may be very large or on a slow disk; try again") from None
    if proc.returncode not in ok:
        raise _git_failure(args, proc.returncode, proc.stderr)
    return proc.stdout


def stream_git(root, args, head_bytes, tail_bytes, timeout=GIT_TIMEOUT_SECS, index_file=None):
    """(head, tail, total) of the stdout of ``git <args>``: at most the first
    ``head_bytes`` and the last ``tail_bytes`` are kept, however much git prints
    (``tail`` is empty when the whole output fits in ``head``)."""
    errors = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(_git_argv(args), cwd=root, env=_git_env(index_file),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
    except FileNotFoundError:
        errors.close()
        raise GitUnavailable("git is not installed (no `git` command on PATH)",
                             "install git to see task diffs; everything else works without it"
                             ) from None
    timed_out = threading.Event()

    def stop():
        timed_out.set()
        proc.kill()
    timer = threading.Timer(timeout, stop)
    timer.daemon = True
    timer.start()
    head, tail, total = bytearray(), bytearray(), 0
    try:
        while True:
            chunk = proc.stdout.read(65536)
            if not chunk:
                break
            total += len(chunk)
            room = head_bytes - len(head)
            if room > 0:
                head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                tail += chunk
                if len(tail) > 2 * tail_bytes + 65536:
                    del tail[:len(tail) - tail_bytes]
        code = proc.wait()
    finally:
        timer.cancel()
        proc.stdout.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = b""
    with errors, contextlib.suppress(OSError):
        errors.seek(0)
        stderr = errors.read(64 * 1024)
    if timed_out.is_set():
        raise GitError("git %s did not finish within %.0f s" % (args[0], timeout),
                       "the repository may be very large or on a slow disk; try again")
    if code != 0:
        raise _git_failure(args, code, stderr)
    return bytes(head), bytes(tail[-tail_bytes:] if tail_bytes else b""), total


@dataclasses.dataclass
class GitRepository:
    """The repository a project root is in, as git reports it."""

    root: str          # the project root (git runs there; paths are relative to it)
    toplevel: str
    git_dir: str

    def operation_in_progress(self):
        """The git operation left unfinished in this checkout (rebase, merge, ...), or None."""
        for name, what in (("rebase-merge", "rebase"), ("rebase-apply", "rebase"),
                           ("MERGE_HEAD", "merge"), ("CHERRY_PICK_HEAD", "cherry-pick"),
                           ("REVERT_HEAD", "revert"), ("BISECT_LOG", "bisect")):
            if os.path.exists(os.path.join(self.git_dir, name)):
                return what
        return None

    def submodules(self):
        """The submodule paths .gitmodules declares (empty without submodules)."""
        if not os.path.isfile(os.path.join(self.toplevel, ".gitmodules")):
            return []
        with contextlib.suppress(GitError):
            out = run_git(self.toplevel, ["config", "--file", ".gitmodules", "-z",
                                          "--get-regexp", r"^submodule\..*\.path$"], ok=(0, 1))
            return [entry.split("\n", 1)[1] for entry in
                    os.fsdecode(out).split("\0") if "\n" in entry]
        return []

    def head(self):
        """The commit HEAD names, or None in a repository without commits."""
        out = run_git(self.root, ["rev-parse", "-q", "--verify", "HEAD^{commit}"], ok=(0, 1))
        return out.decode("ascii").strip() or None

    def has_commit(self, commit):
        return bool(run_git(self.root, ["rev-parse", "-q", "--verify", commit + "^{commit}"],
                            ok=(0, 1)).strip())

    def empty_tree(self):
        """The id of the empty tree (sha1 or sha256, as the repository uses)."""
        return run_git(self.root, ["hash-object", "-t", "tree", "--stdin"],
                       stdin=b"").decode("ascii").strip()


def _inside_dot_git_tree(root):
    """True when ``root`` or a folder above it holds a .git (folder or file, as in a
    worktree or submodule): only then can git find a repository, so a project outside
    any repository never pays for starting git (create_task is on a fast path)."""
    path = os.path.abspath(root)
    while True:
        if os.path.exists(os.path.join(path, ".git")):
            return True
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def git_repository(root):
    """The GitRepository ``root`` is in.  Raises GitUnavailable when there is none."""
    if not _inside_dot_git_tree(root):
        raise GitUnavailable("%s is not in a git repository" % root,
                             "run `git init` and commit your files to get task diffs; "
                             "everything else works without git")
    try:
        out = run_git(root, ["rev-parse", "--show-toplevel", "--absolute-git-dir"])
    except GitError as err:
        raise GitUnavailable("%s is not in a git repository (%s)" % (root, err.message),
                             "run `git init` and commit your files to get task diffs; "
                             "everything else works without git") from err
    lines = os.fsdecode(out).splitlines()
    if len(lines) < 2 or not lines[0]:
        raise GitUnavailable("%s is not in a git work tree (a bare repository?)" % root,
                             "run ferrus in a checkout with a work tree")
    return GitRepository(root=root, toplevel=os.path.normpath(lines[0]),
                         git_dir=os.path.normpath(lines[1]))


_PATH_NEEDS_QUOTES = re.compile(r'[\x00-\x1f\x7f"\\]')
_PATH_ESCAPES = {"\a": r"\a", "\b": r"\b", "\t": r"\t", "\n": r"\n", "\v": r"\v",
                 "\f": r"\f", "\r": r"\r", '"': r'\"', "\\": r"\\"}


def display_path(path):
    """A changed file's name for a list or a --stat line, quoted as git quotes it when
    it holds a control character, a quote or a backslash: a newline in a file name must
    not start a line of its own (a fake stat line in what a reviewer reads).  Other
    characters, Unicode included, are shown as they are."""
    if not _PATH_NEEDS_QUOTES.search(path):
        return path
    return '"%s"' % _PATH_NEEDS_QUOTES.sub(
        lambda match: _PATH_ESCAPES.get(match.group()) or "\\%03o" % ord(match.group()), path)


def diff_exclusions(agents_path=".agents"):
    """Project-relative paths never part of a task's diff (see DIFF_EXCLUDED_PATHS)."""
    paths = list(DIFF_EXCLUDED_PATHS)
    skills = os.path.normpath(agents_path or ".")
    if not os.path.isabs(skills) and not skills.startswith(".."):
        paths += [os.path.join(skills, rel).replace(os.sep, "/") if skills != "." else rel
                  for rel in DIFF_EXCLUDED_SKILLS]
    return paths


def _pathspecs(exclude, paths=None):
    specs = [":(literal)" + p for p in paths] if paths else ["."]
    return ["--"] + specs + [":(exclude,literal)" + p for p in exclude]


def _parse_status_v2(out):
    """(oid, branch, dirty paths) from ``git status --porcelain=v2 --branch -z``."""
    fields = os.fsdecode(out).split("\0")
    oid = branch = None
    dirty = []
    index = 0
    while index < len(fields):
        entry = fields[index]
        index += 1
        if entry.startswith("# branch.oid "):
            value = entry[len("# branch.oid "):]
            oid = None if value == "(initial)" else value
        elif entry.startswith("# branch.head "):
            value = entry[len("# branch.head "):]
            branch = None if value == "(detached)" else value
        elif entry.startswith(("1 ", "u ")):
            dirty.append(entry.split(" ", 8 if entry[0] == "1" else 10)[-1])
        elif entry.startswith("2 "):
            dirty.append(entry.split(" ", 9)[-1])
            index += 1                      # the original path of a rename
        elif entry.startswith("? "):
            dirty.append(entry[2:])
    return oid, branch, dirty


def record_task_base(root, exclude):
    """(base, warnings): where a new task starts in git — the HEAD commit (None in a
    repository without commits), the branch (None on a detached HEAD) and the files
    already changed — and what the human should know about it.  Without git the base
    says why there is none; this never fails."""
    try:
        repo = git_repository(root)
        out = run_git(root, ["status", "--porcelain=v2", "--branch", "-z",
                             "--ignore-submodules=dirty"] + _pathspecs(exclude))
    except FerrusError as err:
        return {"git": False, "reason": err.message}, []
    commit, branch, dirty = _parse_status_v2(out)
    base = {"git": True, "commit": commit, "branch": branch,
            "dirty": dirty[:BASE_DIRTY_NAMES], "dirty_count": len(dirty)}
    warnings = []
    if dirty:
        more = len(dirty) - BASE_DIRTY_NAMES
        warnings.append("the working tree had uncommitted changes when the task was created "
                        "(%s%s); they will show in the task's diff"
                        % (", ".join(map(display_path, dirty[:BASE_DIRTY_NAMES])),
                           " and %d more" % more if more > 0 else ""))
    if commit is None:
        warnings.append("the repository has no commits yet: the task's diff shows every "
                        "file as new")
    elif branch is None:
        warnings.append("HEAD is detached (at %s): the task's base is that commit, on no "
                        "branch" % commit[:12])
    operation = repo.operation_in_progress()
    if operation:
        base["operation"] = operation
        warnings.append("a git %s is in progress: the task's diff will include what it "
                        "changes; finish it (or abort it) before the task, if you can"
                        % operation)
    submodules = repo.submodules()
    if submodules:
        base["submodules"] = submodules
        warnings.append("the repository has submodules (%s): the task's diff shows a changed "
                        "submodule as its new commit, not the changes inside it"
                        % ", ".join(submodules))
    return base, warnings


def describe_base(base):
    """One line naming a task base."""
    if not base:
        return "no base recorded"
    if not base.get("git"):
        return "no git base (%s)" % base.get("reason", "unknown")
    if base.get("commit") is None:
        where = "no commit yet"
    else:
        where = base["commit"][:12]
    return "%s%s" % (where, " on branch %s" % base["branch"] if base.get("branch")
                     else " (detached HEAD)" if base.get("commit") else "")


@dataclasses.dataclass
class ChangedFile:
    """One file of a task's diff, with its added and deleted line counts."""

    path: str
    added: "int | None"          # None for a binary file
    deleted: "int | None"
    old_path: "str | None" = None  # where a renamed file came from

    def to_json(self):
        out = {"path": self.path, "added": self.added, "deleted": self.deleted,
               "binary": self.added is None}
        if self.old_path:
            out["old_path"] = self.old_path
        return out


@dataclasses.dataclass
class TaskDiff:
    """A task's changes: base → working tree, with a bounded part of the patch."""

    base: dict
    files: list
    notes: list
    patch_head: str = ""     # the patch's first bytes (the whole patch when it fits)
    patch_tail: str = ""     # its last bytes when the middle was left out
    patch_bytes: int = 0     # the patch's whole size
    patch_cut: "tuple | None" = None     # (first byte, end byte) left out, or None

    def totals(self):
        return (sum(f.added or 0 for f in self.files), sum(f.deleted or 0 for f in self.files))

    def stat_text(self, max_files=500, width=40):
        """git's --stat, roughly: a line per file, then the totals."""
        if not self.files:
            return " no changes"
        lines = []
        name_width = min(60, max(len(self._label(f)) for f in self.files[:max_files]))
        biggest = max((f.added or 0) + (f.deleted or 0) for f in self.files) or 1
        for changed in self.files[:max_files]:
            label = self._label(changed)
            if changed.added is None:
                lines.append(" %s | Bin" % label.ljust(name_width))
                continue
            count = changed.added + changed.deleted
            scale = min(1.0, width / biggest)
            plus = int(round(changed.added * scale)) or (1 if changed.added else 0)
            minus = int(round(changed.deleted * scale)) or (1 if changed.deleted else 0)
            lines.append(" %s | %5d %s%s" % (label.ljust(name_width), count, "+" * plus,
                                             "-" * minus))
        if len(self.files) > max_files:
            lines.append(" ... and %d more files" % (len(self.files) - max_files))
        added, deleted = self.totals()
        lines.append(" %d file%s changed, %d insertion%s(+), %d deletion%s(-)" % (
            len(self.files), "" if len(self.files) == 1 else "s", added,
            "" if added == 1 else "s", deleted, "" if deleted == 1 else "s"))
        return "\n".join(lines)

    @staticmethod
    def _label(changed):
        return ("%s => %s" % (display_path(changed.old_path), display_path(changed.path))
                if changed.old_path else display_path(changed.path))

    def patch_text(self, more_hint=""):
        """The patch as far as it was kept, with a note where its middle was left out."""
        if self.patch_cut is None:
            return self.patch_head
        first, end = self.patch_cut
        return "%s\n[ferrus: the diff has %d bytes; bytes %d to %d (%d bytes) are left out.%s]\n\n%s" % (
            self.patch_head, self.patch_bytes, first, end, end - first,
            " " + more_hint if more_hint else "", self.patch_tail)


def _parse_numstat(out):
    """[ChangedFile] from ``git diff --numstat -z``."""
    fields = os.fsdecode(out).split("\0")
    files, index = [], 0
    while index < len(fields):
        entry = fields[index]
        index += 1
        if not entry:
            continue
        added, deleted, path = entry.split("\t", 2)
        old = None
        if not path:                          # a rename: the two paths follow
            old, path = fields[index], fields[index + 1]
            index += 2
        binary = added == "-"
        files.append(ChangedFile(path=path, added=None if binary else int(added),
                                 deleted=None if binary else int(deleted), old_path=old))
    return files


def _cut_lines(head, tail, total):
    """(head text, tail text, cut) with the head ending and the tail starting at a line
    boundary; cut is the (first, end) byte range left out, or None."""
    if total <= len(head):
        return head.decode("utf-8", "replace"), "", None
    newline = head.rfind(b"\n")
    if newline >= 0:
        head = head[:newline + 1]
    newline = tail.find(b"\n")
    if 0 <= newline < len(tail) - 1:
        tail = tail[newline + 1:]
    return (head.decode("utf-8", "replace"), tail.decode("utf-8", "replace"),
            (len(head), total - len(tail)))


def _without_nested(untracked, notes):
    """``untracked`` without the nested repositories git lists as "dir/" (noted)."""
    nested = [p for p in untracked if p.endswith("/")]
    if nested:
        notes.append("untracked nested repositories are not diffed: %s" % ", ".join(nested))
    return [p for p in untracked if not p.endswith("/")]


def _new_file_numstat(root, rel):
    """ChangedFile for an untracked file, counted as git counts a new file: binary when
    its first 8,000 bytes hold a NUL, else its lines (a last line without a newline too)."""
    path = os.path.join(root, *rel.split("/"))
    if os.path.islink(path):
        return ChangedFile(rel, 1, 0)                 # git diffs a link as its target's name
    lines, last, first = 0, b"\n", True
    try:
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(1 << 20)
                if not chunk:
                    break
                if first and b"\0" in chunk[:8000]:
                    return ChangedFile(rel, None, None)
                first = False
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except OSError:
        return ChangedFile(rel, 0, 0)                 # gone or unreadable since it was listed
    return ChangedFile(rel, lines + (last != b"\n"), 0)


# How ferrus asks git for a task's diff: no external diff tools or colours of the
# user's, paths relative to the project, a submodule's inner edits not followed.
DIFF_OPTIONS = ["--no-ext-diff", "--no-color", "--relative", "--ignore-submodules=dirty"]


def _list_changes(root, compare, specs, options, notes):
    """(ChangedFile of each tracked file, path of each untracked file) against
    ``compare``: the tracked files' numstat from the user's index (read, never written)
    and the untracked listing, the two git commands run side by side."""
    listed = {}

    def list_untracked():
        try:
            listed["out"] = run_git(root, ["ls-files", "-z", "--others", "--exclude-standard"]
                                    + specs)
        except FerrusError as err:
            listed["error"] = err
    lister = threading.Thread(target=list_untracked, daemon=True)
    lister.start()
    try:
        files = _parse_numstat(run_git(root, ["diff", "-z", "--numstat"] + options + [compare]
                                       + specs))
    finally:
        lister.join()
    if "error" in listed:
        raise listed["error"]
    return files, _without_nested([p for p in os.fsdecode(listed["out"]).split("\0") if p],
                                  notes)


def _stat_files(root, compare, specs, options, notes):
    """[ChangedFile] of the diff without its patch, the untracked files counted here as
    git would count them.  A stat asks for nothing else, and this is its fast path."""
    files, untracked = _list_changes(root, compare, specs, options, notes)
    files += [_new_file_numstat(root, rel) for rel in untracked]
    files.sort(key=lambda changed: changed.path.encode("utf-8", "surrogateescape"))
    return files


def task_diff(root, base, exclude, patch=True, paths=None, head_bytes=192 * 1024,
              tail_bytes=32 * 1024):
    """The TaskDiff of the working tree against ``base`` (from record_task_base; None
    compares with HEAD), untracked files included and ``exclude`` left out; ``paths``
    narrows it to those project-relative paths.  Raises GitUnavailable (no diff can be
    made here) or GitError."""
    repo = git_repository(root)
    notes = []
    head = repo.head()
    if base and not base.get("git", True):
        # No base could be taken then (no repository yet, git missing or failing).
        notes.append("no base was recorded when the task was created (%s): the diff is "
                      "against HEAD" % base.get("reason"))
        base = None
        start = head
    elif base:
        start = base.get("commit")
        if start and start != head and not repo.has_commit(start):
            raise GitError("the task's base commit %s is no longer in the repository"
                           % start[:12], "its history was rewritten; `git diff` against "
                           "another commit shows the changes by hand")
        if start and head and head != start and base.get("onto_target"):
            notes.append("the merge queue put the task's branch on the target's head %s "
                         "(HEAD %s): the diff is the task's work on top of it"
                         % (start[:12], head[:12]))
        elif start and head and head != start:
            notes.append("HEAD has moved since the task was created (base %s, HEAD %s): "
                         "commits made since are part of the diff" % (start[:12], head[:12]))
        if base.get("dirty_count"):
            names = base.get("dirty") or []
            more = base["dirty_count"] - len(names)
            notes.append("already changed before the task began (the diff includes those "
                         "changes): %s%s" % (", ".join(map(display_path, names)),
                                             " and %d more" % more if more > 0 else ""))
    else:
        start = head
        notes.append("no task base is recorded: the diff is against HEAD")
    operation = repo.operation_in_progress()
    if operation:
        notes.append("a git %s is in progress in this checkout" % operation)
    submodules = repo.submodules()
    if submodules:
        notes.append("submodules (%s) show as their commit, not the changes inside them"
                     % ", ".join(submodules))
    compare = start or repo.empty_tree()
    specs = _pathspecs(exclude, paths)
    options = DIFF_OPTIONS
    if not patch:
        return TaskDiff(base=base or {}, notes=notes,
                        files=_stat_files(root, compare, specs, options, notes))
    # A private copy of the index: untracked files are added to it as intent-to-add,
    # so that one `git diff` shows them as new files; the user's index is untouched.
    fd, index_file = tempfile.mkstemp(prefix="ferrus-diff-", suffix=".index", dir=repo.git_dir)
    try:
        with os.fdopen(fd, "wb") as copy:
            with contextlib.suppress(FileNotFoundError):
                with open(os.path.join(repo.git_dir, "index"), "rb") as original:
                    shutil.copyfileobj(original, copy, 1 << 20)
                    written = os.fstat(original.fileno())
                    copy.flush()
                    # The copy keeps the index's own time: git trusts an entry's cached
                    # stat only when the file is older than the index, so a newer copy
                    # would hide a same-size edit made in the second of the last commit.
                    os.utime(index_file, ns=(written.st_atime_ns, written.st_mtime_ns))
        if os.path.getsize(index_file) == 0:
            os.unlink(index_file)            # git reads a missing index as empty, not a 0-byte one
        untracked = [p for p in os.fsdecode(run_git(
            root, ["ls-files", "-z", "--others", "--exclude-standard"] + specs,
            index_file=index_file)).split("\0") if p]
        untracked = _without_nested(untracked, notes)
        for start_at in range(0, len(untracked), 500):
            run_git(root, ["--literal-pathspecs", "add", "--intent-to-add", "--"]
                    + untracked[start_at:start_at + 500], index_file=index_file)
        files = _parse_numstat(run_git(root, ["diff", "-z", "--numstat"] + options + [compare]
                                       + specs, index_file=index_file))
        diff = TaskDiff(base=base or {}, files=files, notes=notes)
        if files:
            raw_head, raw_tail, total = stream_git(
                root, ["diff", "--no-textconv", "--src-prefix=a/", "--dst-prefix=b/"]
                + options + [compare] + specs, head_bytes, tail_bytes, index_file=index_file)
            diff.patch_head, diff.patch_tail, diff.patch_cut = _cut_lines(raw_head, raw_tail,
                                                                         total)
            diff.patch_bytes = total
        return diff
    finally:
        with contextlib.suppress(OSError):
            os.unlink(index_file)


# -- git: the task's branch and its commit ([git] branch, [git] commit) -------------------
#
# The only two places ferrus writes to a repository, and both only add: a new branch at
# HEAD (the work tree, the index and any uncommitted change stay exactly as they were)
# and a new commit on the task's branch holding the task's own files.  ferrus never
# resets, stashes, pushes or rewrites anything; whatever refuses leaves the repository
# as it found it, and the error says why and what to do by hand.

# Commit hooks may run a test suite: they get longer than a read.
GIT_COMMIT_TIMEOUT_SECS = 600.0
# How much of git's own words (a hook's output, say) a commit failure keeps.
GIT_FAILURE_CHARS = 2000


def _finish_or_abort(operation):
    return ("`git bisect reset`" if operation == "bisect" else
            "`git %s --continue` or `git %s --abort`" % (operation, operation))


def current_branch(root):
    """The branch HEAD is on (also an unborn one), or None on a detached HEAD."""
    out = run_git(root, ["symbolic-ref", "-q", "--short", "HEAD"], ok=(0, 1))
    return os.fsdecode(out).strip() or None


def create_task_branch(root, name, base):
    """Create branch ``name`` at HEAD and check it out; the work tree, the index and any
    uncommitted change stay as they are (they come along).  ``base`` is what
    record_task_base just found (the branch HEAD is on, a git operation in progress).
    Returns the branch HEAD was on before (None from a detached HEAD).  Raises GitError
    saying why not — the repository is then unchanged."""
    hint_off = "; or set branch = \"\" in [git] of %s to work without a branch" % CONFIG_FILE
    operation = base.get("operation")
    if operation:
        raise GitError("a git %s is in progress in this checkout, and a new branch now would "
                       "tangle with it" % operation, "finish it or abort it (%s), then create "
                       "the task again%s" % (_finish_or_abort(operation), hint_off))
    problem = git_branch_name_problem(name)
    if problem:
        raise GitError("%s is no valid branch name: it %s" % (json.dumps(name), problem),
                       "change [git] branch in %s" % CONFIG_FILE)
    if run_git(root, ["rev-parse", "-q", "--verify", "refs/heads/" + name], ok=(0, 1)).strip():
        raise GitError("branch %s already exists" % name,
                       "ferrus never moves an existing branch: rename it (`git branch -m %s "
                       "NEW`) or delete it, then create the task again%s" % (name, hint_off))
    run_git(root, ["checkout", "-q", "-b", name])
    return base.get("branch")


def remove_task_branch(root, name, previous, commit):
    """Undo create_task_branch when the task could not be created after all: back to
    ``previous`` (or the detached ``commit``) and the new branch, still at that same
    commit, deleted.  Best effort; nothing in the work tree changes either way."""
    with contextlib.suppress(FerrusError):
        if previous:
            # Both branches name the same commit: moving HEAD is all a checkout would do.
            run_git(root, ["symbolic-ref", "HEAD", "refs/heads/" + previous])
        elif commit:
            run_git(root, ["checkout", "-q", "--detach", commit])
        if commit:
            run_git(root, ["branch", "-q", "-d", name])


def _project_prefix(repo):
    """The project root relative to the repository's top level ("" when they are one)."""
    rel = os.path.relpath(os.path.realpath(repo.root), os.path.realpath(repo.toplevel))
    return "" if rel == "." else rel.replace(os.sep, "/") + "/"


def _changed_before(base, prefix):
    """A test for "this project path was already changed when the task began", from the
    base's dirty list (top-level-relative; an untracked folder is listed as "dir/")."""
    entries = [entry[len(prefix):] for entry in base.get("dirty") or ()
               if entry.startswith(prefix)]
    files = {entry for entry in entries if not entry.endswith("/")}
    folders = tuple(entry for entry in entries if entry.endswith("/"))
    return lambda path: path in files or path.startswith(folders)


def commit_task_changes(root, base, exclude, message, timeout=GIT_COMMIT_TIMEOUT_SECS):
    """Commit the task's own changes onto the branch it works on, running the user's hooks.

    The task's files are what changed since HEAD (untracked ones included, .gitignore
    honoured, ``exclude`` — .ferrus/ and the agent files — never), less the files that
    were already changed when the task began (``base["dirty"]``: the user's, left
    uncommitted).  Other staged changes in the user's index stay staged and out of the
    commit.  Returns {"commit", "branch", "files", "left_out"}; "commit" is None (with
    a "reason") when there was nothing to commit.  Raises GitUnavailable (no repository)
    or GitError saying why nothing was committed; the work tree is never touched."""
    repo = git_repository(root)
    if not base or not base.get("git"):
        raise GitError("no git base was recorded when the task was created (%s)"
                       % ((base or {}).get("reason") or "it was created without git"),
                       "commit the changes by hand (`git status` shows them)")
    operation = repo.operation_in_progress()
    if operation:
        raise GitError("a git %s is in progress in this checkout" % operation,
                       "finish it or abort it (%s), then commit the task's changes by hand "
                       "(`ferrus diff --stat` lists them)" % _finish_or_abort(operation))
    branch = current_branch(root)
    expected = base.get("branch")
    if branch is None or branch != expected:
        raise GitError("HEAD is %s, but the task %s: ferrus commits only onto the task's "
                       "branch" % ("detached" if branch is None else "on branch " + branch,
                                   "works on branch " + expected if expected
                                   else "began on a detached HEAD"),
                       "%scommit the task's changes by hand (`ferrus diff --stat` lists them)"
                       % ("`git switch %s`, then " % expected if expected else ""))
    if (base.get("dirty_count") or 0) > len(base.get("dirty") or ()):
        raise GitError("%d files were already changed when the task began, more than ferrus "
                       "keeps by name, so it cannot tell the task's changes from yours"
                       % base["dirty_count"],
                       "commit the task's files by hand (`ferrus diff --stat` lists them)")
    changed_before = _changed_before(base, _project_prefix(repo))
    tracked, untracked = _list_changes(root, repo.head() or repo.empty_tree(),
                                       _pathspecs(exclude), DIFF_OPTIONS, [])
    paths, left_out = [], []
    for path in sorted(set(untracked).union(
            *(filter(None, (changed.path, changed.old_path)) for changed in tracked)),
            key=lambda path: path.encode("utf-8", "surrogateescape")):
        (left_out if changed_before(path) else paths).append(path)
    if not paths:
        return {"commit": None, "branch": branch, "files": 0, "left_out": left_out,
                "reason": "the task changed no files" if not left_out else
                "the task changed only files that were already changed before it began "
                "(%s); they are yours to commit" % ", ".join(left_out)}
    # A new file must be known to the index for `git commit -- PATH`: intent-to-add
    # records only its name, and is taken back if the commit fails.
    added = [p for p in paths if p in set(untracked)]
    fd, message_file = tempfile.mkstemp(prefix="ferrus-commit-", suffix=".txt",
                                        dir=repo.git_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(message)
        if added:
            run_git(root, ["--literal-pathspecs", "add", "--intent-to-add",
                           "--pathspec-from-file=-", "--pathspec-file-nul"],
                    stdin=nul_list(added))
        try:
            run_git(root, ["--literal-pathspecs", "commit", "-q", "--cleanup=whitespace",
                           "-F", message_file, "--pathspec-from-file=-",
                           "--pathspec-file-nul"], stdin=nul_list(paths), timeout=timeout)
        except GitError as err:
            if added:
                with contextlib.suppress(FerrusError):
                    run_git(root, ["--literal-pathspecs", "rm", "-q", "--cached",
                                   "--ignore-unmatch", "--pathspec-from-file=-",
                                   "--pathspec-file-nul"], stdin=nul_list(added))
            raise _commit_failure(err) from err
    finally:
        with contextlib.suppress(OSError):
            os.unlink(message_file)
    commit = os.fsdecode(run_git(root, ["rev-parse", "HEAD"])).strip()
    return {"commit": commit, "branch": branch, "files": len(paths), "left_out": left_out}


def nul_list(names):
    """Paths as git's --pathspec-file-nul reads them."""
    return b"".join(os.fsencode(name) + b"\0" for name in names)


def _commit_failure(err):
    """The GitError of a refused `git commit`, with git's (or the hook's) words kept
    and a hint for the usual cause."""
    said = err.message
    if len(said) > GIT_FAILURE_CHARS:
        said = said[:GIT_FAILURE_CHARS] + " [...]"
    if "tell me who you are" in said or "empty ident" in said or "ident name" in said:
        hint = ("git does not know who commits here: set `git config user.name \"Your "
                "Name\"` and `git config user.email you@example.com`, then commit the "
                "task's files by hand (`ferrus diff --stat` lists them)")
    elif "hook" in said.lower() or "exit 1)" in said:
        hint = ("a commit hook refuses it, most likely (its output, if any, is above): fix "
                "what it says and commit the task's files by hand (`ferrus diff --stat` "
                "lists them)")
    else:
        hint = "commit the task's files by hand (`ferrus diff --stat` lists them)"
    return GitError(said, hint)


# -- git: task worktrees (parallel tasks) ------------------------------------------------
#
# Each parallel task works in a git worktree of its own, on a branch of its own started
# at the target branch's head.  These functions are plumbing only — no store, no journal:
# the orchestrator records what they did.  Each is safe to call again after a crash at
# any point: creating finds the worktree it made (or finishes one git left half made),
# removing tolerates what is already gone, and listing shows everything left behind.

# The default worktree folder sits beside the repository: <folder name> + this.
WORKTREE_DIR_SUFFIX = ".ferrus-worktrees"


def default_worktree_dir(root, configured=None):
    """The folder task worktrees go in, as an absolute path.

    By default it sits beside the repository, never inside it —
    ``<parent of its top level>/<its folder name>.ferrus-worktrees`` — so test runners,
    linters, editors' searches and `git status` in the user's checkout never see a
    task's files.  ``configured`` ([parallel] worktree_dir; ``~`` expanded, relative to
    the project root) replaces it: outside the repository anywhere, inside it only in a
    git-ignored folder (else every task's files would show up as untracked in the
    user's checkout and be found by test discovery), and never in the .git folder.
    Raises GitUnavailable (no repository here) or FerrusError (a refused folder)."""
    repo = git_repository(root)
    toplevel = os.path.realpath(repo.toplevel)
    if not configured:
        return os.path.join(os.path.dirname(toplevel),
                            os.path.basename(toplevel) + WORKTREE_DIR_SUFFIX)
    path = os.path.realpath(os.path.join(os.path.abspath(root),
                                         os.path.expanduser(configured)))
    rel = _relative_inside(path, toplevel)
    if rel is None:
        return path
    setting = "[parallel] worktree_dir = %s in %s" % (json.dumps(configured), CONFIG_FILE)
    default = os.path.join(os.path.dirname(toplevel),
                           os.path.basename(toplevel) + WORKTREE_DIR_SUFFIX)
    if rel == "":
        raise FerrusError("%s is the repository itself (%s)" % (setting, toplevel),
                          "leave worktree_dir unset (worktrees then go in %s) or name a "
                          "folder outside the repository" % default)
    if (_relative_inside(path, os.path.realpath(repo.git_dir)) is not None
            or rel.split("/")[0] == ".git"):
        raise FerrusError("%s is inside the repository's .git folder" % setting,
                          "leave worktree_dir unset (worktrees then go in %s) or name a "
                          "folder outside the repository" % default)
    # A folder a worktree would be made in: ignored when git would not list it.
    probe = rel + "/ferrus-task/"
    if not run_git(toplevel, ["check-ignore", "--", probe], ok=(0, 1)).strip():
        raise FerrusError("%s is inside the repository (%s) and not git-ignored: every "
                          "task's files would show as untracked in your checkout, in task "
                          "diffs and to test runners" % (setting, toplevel),
                          "leave worktree_dir unset (worktrees then go in %s), name a "
                          "folder outside the repository, or add `/%s/` to .gitignore"
                          % (default, rel))
    return path


def _relative_inside(path, folder):
    """``path`` relative to ``folder`` with / separators ("" for the folder itself), or
    None when it is not inside it (both real, absolute paths)."""
    try:
        rel = os.path.relpath(path, folder)
    except ValueError:                      # another drive (Windows)
        return None
    if rel == os.curdir:
        return ""
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        return None
    return rel.replace(os.sep, "/")


# Whether this git knows `git worktree list -z` (2.36+), once asked: [True] or [False].
_WORKTREE_LIST_NUL = []


def _worktree_entries(root):
    """Every worktree of the repository ``root`` is in, the main one first, from
    `git worktree list --porcelain`: dicts with path, head, branch (short name, None
    when detached), bare, locked and prunable (git's reason, "" without one, or None)."""
    out, separator = None, "\0"
    if _WORKTREE_LIST_NUL != [False]:
        try:
            out = run_git(root, ["worktree", "list", "--porcelain", "-z"])
        except GitError as err:
            if _WORKTREE_LIST_NUL or "(exit 129)" not in err.message:
                raise
            _WORKTREE_LIST_NUL.append(False)      # a usage error: git older than 2.36
        else:
            _WORKTREE_LIST_NUL[:] = [True]
    if out is None:                      # older git: a path holding a newline misreads
        out, separator = run_git(root, ["worktree", "list", "--porcelain"]), "\n"
    records = os.fsdecode(out).split(separator * 2)
    entries = []
    for record in records:
        entry = {"path": None, "head": None, "branch": None, "bare": False,
                 "locked": None, "prunable": None}
        for line in record.strip(separator).split(separator):
            key, _, value = line.partition(" ")
            if key == "worktree":
                entry["path"] = os.path.normpath(value)
            elif key == "HEAD":
                entry["head"] = value
            elif key == "branch":
                entry["branch"] = value[len("refs/heads/"):] if value.startswith(
                    "refs/heads/") else value
            elif key == "bare":
                entry["bare"] = True
            elif key in ("locked", "prunable"):
                entry[key] = value
        if entry["path"]:
            entries.append(entry)
    return entries


def _same_path(one, other):
    return os.path.normcase(os.path.realpath(one)) == os.path.normcase(os.path.realpath(other))


def _worktree_git_dir(path):
    """The git folder of the checkout at ``path`` (its .git folder, or the folder its
    .git file points to, as in a linked worktree), or None when it has neither."""
    dot_git = os.path.join(path, ".git")
    if os.path.isdir(dot_git):
        return dot_git
    try:
        with open(dot_git, encoding="utf-8", errors="surrogateescape") as handle:
            line = handle.readline().strip()
    except OSError:
        return None
    if not line.startswith("gitdir:"):
        return None
    return os.path.normpath(os.path.join(path, line[len("gitdir:"):].strip()))


def _rebasing_branch(git_dir):
    """The branch a rebase in progress in this checkout rewrites, or None."""
    for name in ("rebase-merge", "rebase-apply"):
        with contextlib.suppress(OSError):
            with open(os.path.join(git_dir, name, "head-name"), encoding="utf-8",
                      errors="surrogateescape") as handle:
                ref = handle.read().strip()
            return ref[len("refs/heads/"):] if ref.startswith("refs/heads/") else None
    return None


def _fork_point(root, branch_head, start_commit):
    """Where ``branch_head`` forked from ``start_commit`` (their merge base)."""
    if branch_head == start_commit:
        return start_commit
    out = run_git(root, ["merge-base", branch_head, start_commit], ok=(0, 1)).strip()
    if not out:
        raise GitError("the branch's commit %s shares no history with %s"
                       % (branch_head[:12], start_commit),
                       "`ferrus task cancel ID` removes the task's worktree and branch; "
                       "then queue the task again")
    return os.fsdecode(out)


def _commit_id(root, commit):
    """The full id of ``commit`` (a ref or an abbreviated id) — or GitError."""
    out = run_git(root, ["rev-parse", "-q", "--verify", commit + "^{commit}"], ok=(0, 1))
    if not out.strip():
        raise GitError("%s names no commit in the repository" % commit,
                       "`git log --oneline -5` shows recent commits")
    return os.fsdecode(out).strip()


def _folder_has_files(path):
    try:
        return bool(os.listdir(path))
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        return True


def create_task_worktree(root, path, branch, start_commit):
    """A new worktree at ``path`` on a new branch ``branch`` started at ``start_commit``
    (`git worktree add -b`).  Returns {"path", "branch", "base"}: "base" is the commit
    the branch started from.

    Called again for the same path and branch (say after a crash) it returns the
    worktree already there (its "base" is where its branch forked from
    ``start_commit``), finishes one git was interrupted making (no checkout written yet:
    it is made again), and puts a worktree back whose folder was deleted.  A branch of
    that name left behind without a worktree is used only when it holds no commit that
    ``start_commit`` lacks (nothing on it can be lost).  Anything else — the path taken
    by other files or another worktree, the branch checked out elsewhere or holding
    commits of its own — is refused with a GitError that says what to do; the
    repository is then unchanged."""
    path = os.path.abspath(path)
    problem = git_branch_name_problem(branch)
    if problem:
        raise GitError("%s is no valid branch name: it %s" % (json.dumps(branch), problem),
                       "choose another branch name for the task's worktree")
    if _folder_has_files(path):
        # Before `git worktree add -b`, which would make the branch, then refuse the path.
        return _resume_task_worktree(root, path, branch, start_commit, None)
    try:
        run_git(root, ["worktree", "add", "-q", "--no-track", "-b", branch, path,
                       start_commit + "^{commit}"])
    except GitError as err:
        return _resume_task_worktree(root, path, branch, start_commit, err)
    base = start_commit if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", start_commit) else (
        _commit_id(root, start_commit))
    return {"path": path, "branch": branch, "base": base}


def _resume_task_worktree(root, path, branch, start_commit, failure):
    """create_task_worktree when the path is taken or `git worktree add -b` refused
    (``failure``): the worktree is there already, or half made, or something else is in
    the way (GitError)."""
    entries = _worktree_entries(root)
    at_path = next((e for e in entries if _same_path(e["path"], path)), None)
    holder = next((e for e in entries if e["branch"] == branch), None)
    hint_taken = ("ferrus never reuses a folder or branch it did not make: remove it, or "
                  "start the task under another name")
    if at_path and at_path["branch"] != branch:
        raise GitError("%s is already the worktree of %s" % (
            path, "branch " + at_path["branch"] if at_path["branch"] else "a detached HEAD"),
            hint_taken)
    if holder and holder is not at_path:
        if os.path.isdir(holder["path"]):
            raise GitError("branch %s is already checked out at %s" % (branch, holder["path"]),
                           "finish or remove that worktree (`git worktree remove`), then "
                           "start the task again")
        run_git(root, ["worktree", "prune"])              # its folder is gone
    ours = at_path is not None
    if ours:
        git_dir = _worktree_git_dir(path) if os.path.isdir(path) else None
        if git_dir and os.path.exists(os.path.join(git_dir, "index")):
            # Complete: git writes a worktree's index once its checkout is done.
            if at_path["locked"] is not None and os.path.isdir(git_dir):
                with contextlib.suppress(GitError):   # git's own "initializing" lock, left
                    run_git(root, ["worktree", "unlock", path])
            start = _commit_id(root, start_commit)
            return {"path": path, "branch": branch,
                    "base": _fork_point(root, at_path["head"] or start, start)}
        _discard_worktree(root, path)                    # interrupted half way: made again
    if _folder_has_files(path):
        raise GitError("%s already exists and is not the worktree of branch %s"
                       % (path, branch), hint_taken)
    branch_head = target_head(root, branch)
    if branch_head is None:
        if failure is not None:
            raise failure                                 # not a question of leftovers
        run_git(root, ["worktree", "add", "-q", "--no-track", "-b", branch, path,
                       start_commit + "^{commit}"])       # the path is free now
        return {"path": path, "branch": branch, "base": _commit_id(root, start_commit)}
    start = _commit_id(root, start_commit)
    if not ours and not _is_ancestor(root, branch_head, start):
        raise GitError("branch %s already exists, with commits %s does not have"
                       % (branch, start_commit), hint_taken)
    run_git(root, ["worktree", "add", "-q", path, branch])
    return {"path": path, "branch": branch, "base": _fork_point(root, branch_head, start)}


def _is_ancestor(root, ancestor, descendant):
    if ancestor == descendant:
        return True
    try:
        run_git(root, ["merge-base", "--is-ancestor", ancestor, descendant])
        return True
    except GitError as err:
        if "(exit 1)" in err.message:
            return False
        raise


def _discard_worktree(root, path):
    """Delete a linked worktree git cannot remove itself (its folder damaged, deleted or
    half made): its folder, then git's record of it."""
    with contextlib.suppress(GitError):
        run_git(root, ["worktree", "unlock", path])
    if os.path.lexists(path):
        shutil.rmtree(path, onerror=_make_writable_and_retry)
    run_git(root, ["worktree", "prune"])


def _make_writable_and_retry(function, path, exc_info):
    # Windows will not delete a read-only file; anywhere else the error stands.
    if function in (os.unlink, os.remove, os.rmdir) and os.path.lexists(path):
        os.chmod(path, 0o700)
        function(path)
    else:
        raise exc_info[1]


def remove_task_worktree(root, path, branch, delete_branch=True):
    """Remove the task worktree at ``path`` — its uncommitted changes with it — and
    (``delete_branch``) its branch, merged or not: the caller decides when a task's
    work is no longer wanted.  ``branch`` None: the worktree only, whatever its branch.  Idempotent: a worktree or branch already gone is fine,
    and a worktree git refuses to remove because its folder is damaged is deleted and
    pruned.  Returns {"path", "branch", "removed", "branch_deleted"} (what this call
    did).  Raises GitError for a path that is not a linked worktree of this repository
    or is the worktree of another branch (its files are left alone), or a branch
    checked out somewhere else."""
    path = os.path.abspath(path)
    removed = branch_deleted = False
    entries = _worktree_entries(root)
    entry = next((e for e in entries if _same_path(e["path"], path)), None)
    if entry is not None:
        if entry is entries[0]:
            raise GitError("%s is the repository's main checkout, not a task worktree"
                           % path, "ferrus removes only the worktrees it made")
        if entry["branch"] is not None and branch is not None and entry["branch"] != branch:
            # Someone else's worktree, or a mix-up of records: its work is not ours to drop.
            raise GitError("%s is the worktree of branch %s, not of %s" % (
                path, entry["branch"], branch), "ferrus removes only the worktrees it made")
        try:
            run_git(root, ["worktree", "remove", "--force", "--force", path])
        except GitError:
            _discard_worktree(root, path)         # damaged: git cannot remove it itself
        removed = True
    elif _folder_has_files(path):
        raise GitError("%s is not a worktree of this repository" % path,
                       "ferrus deletes only worktrees it made; remove that folder by hand "
                       "if it is not wanted")
    elif os.path.isdir(path):
        os.rmdir(path)                     # the empty folder of an interrupted `worktree add`
    if delete_branch and branch:
        try:
            run_git(root, ["branch", "-D", "-q", branch])
            branch_deleted = True
        except GitError:
            if target_head(root, branch) is not None:
                raise
    return {"path": path, "branch": branch, "removed": removed,
            "branch_deleted": branch_deleted}


def list_task_worktrees(root, branch_prefix):
    """Every worktree and branch ferrus made for tasks — every branch whose name starts
    with ``branch_prefix`` — so that leftovers can be found: dicts with path (None for a
    branch checked out nowhere), branch, head, exists (its folder is there), prunable
    (git's reason when git would prune it, else None), locked, main (it is the main
    checkout, never a task worktree) and rebasing (a rebase of it is in progress, which
    git shows as a detached HEAD).  Sorted by branch."""
    entries = _worktree_entries(root)
    out = os.fsdecode(run_git(root, ["for-each-ref", "--format=%(objectname) %(refname)",
                                     "refs/heads/"]))
    heads = {}
    for line in out.splitlines():
        commit, _, ref = line.partition(" ")
        name = ref[len("refs/heads/"):]
        if name.startswith(branch_prefix):
            heads[name] = commit
    found = []
    for index, entry in enumerate(entries):
        branch, rebasing = entry["branch"], False
        if branch is None and not entry["bare"]:
            git_dir = _worktree_git_dir(entry["path"])
            branch = _rebasing_branch(git_dir) if git_dir else None
            rebasing = branch is not None
        if branch is None or not branch.startswith(branch_prefix):
            continue
        found.append({"path": entry["path"], "branch": branch,
                      "head": heads.get(branch, entry["head"]),
                      "exists": os.path.isdir(entry["path"]), "prunable": entry["prunable"],
                      "locked": entry["locked"], "main": index == 0, "rebasing": rebasing})
        heads.pop(branch, None)
    found += [{"path": None, "branch": name, "head": commit, "exists": False,
               "prunable": None, "locked": None, "main": False, "rebasing": False}
              for name, commit in heads.items()]
    return sorted(found, key=lambda row: (row["branch"], row["path"] or ""))


def worktree_changes(path, exclude):
    """The paths with uncommitted changes (untracked files included) in the checkout at
    ``path``, leaving out ``exclude`` (ferrus's own files) — or GitError."""
    out = run_git(path, ["status", "--porcelain=v2", "-z", "--ignore-submodules=dirty"]
                  + _pathspecs(exclude))
    return _parse_status_v2(out)[2]


def target_head(root, branch):
    """The commit branch ``branch`` is at, or None when there is no such branch."""
    out = run_git(root, ["rev-parse", "-q", "--verify", "refs/heads/%s^{commit}" % branch],
                  ok=(0, 1))
    return os.fsdecode(out).strip() or None


# -- git: a conflict handed to the executor as files to edit -----------------------------
#
# A real agent cannot be trusted to run git (its CLI's permissions often forbid it, and a
# sandboxed one cannot write the repository's .git folder), but every executor can edit
# files.  So when a task conflicts with the target, ferrus itself brings the task's branch
# up to date: one commit on top of the target's head holding the task's work merged with
# it, git's conflict markers left in the conflicted files for the executor to resolve.
# That commit never reaches the target as it is: once the executor resolved the markers,
# the integration squashes the branch into one commit on the target (squash_onto).

CONFLICT_MARKER = re.compile(rb"^(?:<{7}|>{7})(?: |\r?$)", re.M)
CONFLICT_SCAN_BYTES = 8 * 1024 * 1024


def merge_leaving_conflicts(worktree, target_branch, message):
    """Merge ``target_branch``'s head into the task's branch in ``worktree`` (its top
    level) and commit the result as one commit on top of that head, conflict markers
    included; the worktree is then clean on the task's branch.  Returns (the target head
    it was built on, the conflicted paths relative to the worktree).  No hooks run (the
    commit only carries the conflict to the executor).  Raises GitError."""
    target = target_head(worktree, target_branch)
    if target is None:
        raise GitError("there is no branch %s to bring the task up to date with"
                       % target_branch, "name an existing target branch")
    run_git(worktree, ["merge", "--no-commit", "--no-ff", target], ok=(0, 1),
            timeout=GIT_COMMIT_TIMEOUT_SECS)
    try:
        unmerged = os.fsdecode(run_git(worktree, ["diff", "--name-only", "-z",
                                                  "--diff-filter=U"]))
        paths = [path for path in unmerged.split("\0") if path]
        if paths:
            run_git(worktree, ["add", "-A", "--pathspec-from-file=-", "--pathspec-file-nul"],
                    stdin=nul_list(paths))
        tree = os.fsdecode(run_git(worktree, ["write-tree"])).strip()
        commit = os.fsdecode(run_git(worktree, ["commit-tree", tree, "-p", target, "-m",
                                                message])).strip()
    except GitError:
        run_git(worktree, ["merge", "--abort"], ok=(0, 128))
        raise
    # Forget the merge (index and files stay as they are), then put the branch on the
    # new commit, whose tree they already are.
    run_git(worktree, ["merge", "--quit"])
    run_git(worktree, ["update-ref", "-m", "ferrus: the target merged in, conflicts left "
                       "for the executor", "HEAD", commit])
    return target, paths


def conflict_markers_left(worktree, paths):
    """Which of ``paths`` (relative to the worktree) still hold a conflict marker line."""
    left = []
    for path in paths:
        try:
            with open(os.path.join(worktree, *path.split("/")), "rb") as handle:
                if CONFLICT_MARKER.search(handle.read(CONFLICT_SCAN_BYTES)):
                    left.append(path)
        except OSError:
            continue            # removed or unreadable: no marker to worry about
    return left


def squash_onto(worktree, onto, message):
    """The task's branch as ONE commit on top of ``onto`` with the tree it has now (the
    work after a conflict the executor resolved); returns that commit.  The worktree
    stays clean: only the branch moves."""
    tree = os.fsdecode(run_git(worktree, ["rev-parse", "HEAD^{tree}"])).strip()
    commit = os.fsdecode(run_git(worktree, ["commit-tree", tree, "-p", onto, "-m",
                                            message])).strip()
    run_git(worktree, ["update-ref", "-m", "ferrus: the task squashed onto its target",
                       "HEAD", commit])
    return commit


# -- git: integrating a task into the target branch (the merge queue's git half) --------
#
# An approved task's worktree is committed, then rebased onto (or merged with) the target
# branch's current head; the orchestrator runs the checks on that candidate and, when
# they pass, fast_forward_target moves the target to it.  A conflict is undone at once
# (the worktree goes back to the task's own commit) and described for the executor.  A
# crash part way is undone by the next prepare_integration: it leaves a note in the
# worktree's git folder while it works, so a rebase or merge found in progress there is
# known to be its own.  The target only ever moves by an atomic compare-and-swap of its
# ref (or `git merge --ff-only` where it is checked out), so it is at its old head or at
# the checked candidate, never in between.

# The note prepare_integration keeps in the worktree's git folder while it works.
INTEGRATION_NOTE = "ferrus-integration"
# How much prepare_integration says about a conflict (the executor reads it in REVIEW.md).
CONFLICT_TEXT_CHARS = 4096
# Lines of one side of a conflicting hunk shown before the rest is left out, and the
# characters of one line (a minified file's line can be the whole file).
CONFLICT_SIDE_LINES = 12
CONFLICT_LINE_CHARS = 200
INTEGRATION_MODES = ("rebase", "merge")


@dataclasses.dataclass
class Integration:
    """A task's worktree made into a candidate for the target branch."""

    status: str            # "ready", "conflict", or "empty" (nothing the target lacks)
    head: str              # ready: the candidate; conflict: the task's own commit, as before
    target_head: str       # the target's head it was built on
    conflicts: list = dataclasses.field(default_factory=list)   # conflicting paths
    text: str = ""         # what happened, for people (a conflict's files and hunks)
    committed: bool = False   # the task's uncommitted changes were committed first


class IntegrationRefused(GitError):
    """A hook refused the task's commit, rebase or merge (its words are in the message):
    something whoever works on the task can fix, unlike a broken repository."""


def prepare_integration(worktree, target_branch, mode, message, exclude,
                        timeout=GIT_COMMIT_TIMEOUT_SECS):
    """Make the task's worktree a candidate for ``target_branch``.

    (1) Everything the task changed under ``worktree`` (tracked and untracked, .gitignore
    honoured, ``exclude`` — ferrus's registration files — never, even when staged) is
    committed with ``message``, the user's hooks run; nothing to commit is fine.
    (2) ``mode`` "rebase" rebases the task's branch onto the target's current head,
    "merge" merges that head into it.  (3) A conflict is aborted at once — the worktree
    is back on the task's commit — and returned with the conflicting paths and a short
    text (the files and the hunks of each side, at most CONFLICT_TEXT_CHARS).

    Returns an Integration.  Raises IntegrationRefused when a hook refuses, GitError when
    git has no identity to commit with (ferrus does not invent one: the commits land on
    the user's branch in the user's name), when the worktree is in a git operation ferrus
    did not start, or when git fails otherwise; the worktree is then on the task's
    branch with its work intact.  Safe to call again after a crash at any point: an
    integration cut short is undone first.  Conflicting paths are relative to the
    repository's top level."""
    if mode not in INTEGRATION_MODES:
        raise FerrusError("integrate = %s is no integration mode" % json.dumps(mode),
                          'use "rebase" or "merge"')
    if not message.strip():
        raise FerrusError("the task's commit needs a message", "pass the task's title")
    git_dir = _worktree_git_dir(worktree) or os.fsdecode(run_git(
        worktree, ["rev-parse", "--absolute-git-dir"])).strip()
    _undo_interrupted_integration(worktree, git_dir)
    branch = _head_branch(git_dir)
    if branch is None:
        raise GitError("the task's worktree %s is on a detached HEAD, not its branch"
                       % worktree, "`git switch <the task's branch>` there, then try again")
    target = target_head(worktree, target_branch)
    if target is None:
        raise GitError("there is no branch %s to integrate into" % target_branch,
                       "create it, or name another target branch")
    note = os.path.join(git_dir, INTEGRATION_NOTE)
    atomic_write(note, json.dumps({"pid": os.getpid(), "start": _own_start(),
                                   "branch": branch, "target": target}).encode("utf-8"),
                 durable=False)
    try:
        committed = _commit_worktree(worktree, git_dir, exclude, message, timeout)
        conflict = _rebase_or_merge(worktree, git_dir, branch, target_branch, target, mode,
                                    timeout)
        out = os.fsdecode(run_git(worktree, ["rev-parse", "HEAD", "HEAD^{tree}",
                                             target + "^{tree}"])).split()
        head, tree, target_tree = out[0], out[1], out[2]
        if conflict:
            paths, text = conflict
            return Integration("conflict", head, target, paths, text, committed)
        if head == target or tree == target_tree:
            return Integration("empty", head, target, [], "the task changes nothing that %s "
                               "(at %s) does not already have" % (target_branch, target[:12]),
                               committed)
        done = ("rebased onto" if mode == "rebase" else "merged with")
        return Integration("ready", head, target, [], "the task's branch %s is %s %s at %s"
                           % (branch, done, target_branch, target[:12]), committed)
    finally:
        if _operation_in(git_dir) is None:
            with contextlib.suppress(OSError):
                os.unlink(note)


def _head_branch(git_dir):
    """The branch a checkout's HEAD is on (read from its git folder), or None."""
    try:
        with open(os.path.join(git_dir, "HEAD"), encoding="utf-8",
                  errors="surrogateescape") as handle:
            ref = handle.read().strip()
    except OSError:
        return None
    return ref[len("ref: refs/heads/"):] if ref.startswith("ref: refs/heads/") else None


def _operation_in(git_dir):
    """The git operation left unfinished in the checkout of ``git_dir``, or None."""
    return GitRepository(root=git_dir, toplevel=git_dir, git_dir=git_dir
                         ).operation_in_progress()


def _undo_interrupted_integration(worktree, git_dir):
    """Abort the rebase or merge a killed prepare_integration left in the worktree, with
    the lock files of the git it ran; refuse an operation somebody else started, and an
    integration another live process is running."""
    note = os.path.join(git_dir, INTEGRATION_NOTE)
    operation = _operation_in(git_dir)
    if not os.path.exists(note):
        if operation:
            raise GitError("a git %s is in progress in the task's worktree %s, and ferrus "
                           "did not start it" % (operation, worktree),
                           "finish it or abort it there (%s), then integrate again"
                           % _finish_or_abort(operation))
        return
    left = {}
    with contextlib.suppress(OSError, ValueError):
        with open(note, encoding="utf-8") as handle:
            left = json.loads(handle.read())
    pid = left.get("pid") if isinstance(left, dict) else None
    if (isinstance(pid, int) and pid != os.getpid() and pid_alive(pid)
            and process_start(pid) == left.get("start")):
        raise GitError("another ferrus process (pid %d) is integrating %s" % (pid, worktree),
                       "let it finish; only one orchestrator runs per project")
    # The git that ferrus ran there was killed with it: its locks are stale.
    for lock in ("index.lock", "HEAD.lock"):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(git_dir, lock))
    if operation in INTEGRATION_MODES:
        run_git(worktree, [operation, "--abort"])
    elif operation:
        raise GitError("a git %s is in progress in the task's worktree %s" % (operation,
                       worktree), "finish it or abort it there (%s), then integrate again"
                       % _finish_or_abort(operation))
    with contextlib.suppress(OSError):
        os.unlink(note)


def _commit_worktree(worktree, git_dir, exclude, message, timeout):
    """Commit the task's changes under ``worktree`` (not ``exclude``); False when there
    was nothing to commit.  Raises IntegrationRefused when git commit refuses."""
    specs = _pathspecs(exclude)
    # Exit 1: everything was added, but an excluded path is also git-ignored (.ferrus/),
    # which `git add` reports even for an exclusion.
    run_git(worktree, ["add", "-A"] + specs, ok=(0, 1))
    fd, message_file = tempfile.mkstemp(prefix="ferrus-commit-", suffix=".txt", dir=git_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(message)
        # Only the paths under `specs` are committed, so an excluded file an agent
        # staged by hand stays out of it.
        run_git(worktree, ["commit", "-q", "--cleanup=whitespace", "-F", message_file]
                + specs, timeout=timeout)
        return True
    except GitError as err:
        if not run_git(worktree, ["diff", "--cached", "--name-only", "-z", "HEAD"] + specs):
            return False                                  # nothing to commit
        raise _integration_failure(worktree, err, "commit") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(message_file)


def _rebase_or_merge(worktree, git_dir, branch, target_branch, target, mode, timeout):
    """Rebase the task's branch onto ``target`` or merge it in.  None when that worked;
    (paths, text) of a conflict, after aborting it; GitError when git failed."""
    if _is_ancestor(worktree, target, "HEAD"):
        # The branch has the target already: nothing to rebase (the usual case when the
        # target did not move), or an executor resolved a conflict by merging the target
        # in — which a rebase would undo, replaying the task's commits into the same
        # conflict again.
        return None
    if mode == "rebase":
        # The user's rebase settings that would move other branches or reorder commits
        # do not apply here; local changes left (excluded tracked files) are carried.
        args = ["-c", "rebase.updateRefs=false", "-c", "rebase.autoSquash=false",
                "-c", "rebase.backend=merge", "rebase", "-q", "--autostash", target]
    else:
        args = ["merge", "-q", "--no-edit", "--ff", "-m",
                "Merge branch '%s' (at %s) into %s" % (target_branch, target[:12], branch),
                target]
    try:
        run_git(worktree, args, timeout=timeout)
        return None
    except GitError as err:
        failure = err
    conflicts = _conflicting_stages(worktree) if _operation_in(git_dir) else {}
    text = _conflict_text(worktree, conflicts, target_branch, target, mode) if conflicts else ""
    if _operation_in(git_dir):
        run_git(worktree, [mode, "--abort"])
    if conflicts:
        return sorted(conflicts, key=lambda p: p.encode("utf-8", "surrogateescape")), text
    raise _integration_failure(worktree, failure, mode) from None


def _integration_failure(worktree, err, command):
    """The error for a refused git commit, rebase or merge in a task's worktree (after
    it was undone): no identity (GitError), a hook (IntegrationRefused), or else."""
    said = err.message
    if len(said) > GIT_FAILURE_CHARS:
        said = said[:GIT_FAILURE_CHARS] + " [...]"
    try:
        run_git(worktree, ["var", "GIT_COMMITTER_IDENT"])
    except GitError:
        return GitError(said, "git does not know who commits here: set `git config "
                        "user.name \"Your Name\"` and `git config user.email "
                        "you@example.com` in the repository, then integrate the task again")
    if "hook" in said.lower() or command == "commit":
        return IntegrationRefused(said, "a hook refuses it, most likely (its words are "
                                  "above): fix what it says in the task's worktree %s, "
                                  "then integrate the task again" % worktree)
    return GitError(said, "the task's worktree %s is back on its own commit; run `git %s` "
                    "there to see what git needs" % (worktree, command))


def _conflicting_stages(worktree):
    """{path: set of stages present} for each conflicted path (`git ls-files -u`)."""
    stages = {}
    for entry in os.fsdecode(run_git(worktree, ["ls-files", "-u", "-z", "--full-name"])
                             ).split("\0"):
        if "\t" in entry:
            info, path = entry.split("\t", 1)
            stages.setdefault(path, set()).add(info.split()[2])
    return stages


def _conflict_text(worktree, conflicts, target_branch, target, mode):
    """The conflicting files and, for text files, each side of every conflicting hunk:
    what the executor needs to make the task fit the target, at most
    CONFLICT_TEXT_CHARS."""
    # A rebase replays the task's commits onto the target ("theirs" is the task); a
    # merge brings the target into the task's branch ("ours" is the task).
    task_stage, target_stage = ("3", "2") if mode == "rebase" else ("2", "3")
    target_label = "%s (at %s)" % (target_branch, target[:12])
    names = sorted(conflicts, key=lambda p: p.encode("utf-8", "surrogateescape"))
    parts = ["%s the task onto %s (at %s) conflicts in %d file%s: %s" % (
        "Rebasing" if mode == "rebase" else "Merging", target_branch, target[:12],
        len(names), "" if len(names) == 1 else "s", ", ".join(map(display_path, names)))]
    top = os.fsdecode(run_git(worktree, ["rev-parse", "--show-toplevel"])).strip()
    for path in names:
        stages = conflicts[path]
        if task_stage not in stages:
            parts.append("%s: the task deleted it, %s changed it" % (display_path(path),
                                                                    target_label))
            continue
        if target_stage not in stages:
            parts.append("%s: %s deleted it, the task changed it" % (display_path(path),
                                                                    target_label))
            continue
        hunks = _conflict_hunks(os.path.join(top, *path.split("/")))
        if not hunks:
            parts.append("%s: both sides changed it (no text conflict markers: a binary "
                         "file, or a file type or mode change)" % display_path(path))
            continue
        for line_number, ours, theirs in hunks:
            task, other = (theirs, ours) if task_stage == "3" else (ours, theirs)
            parts.append("%s, line %d:\n  the task's side:\n%s\n  %s's side (at %s):\n%s"
                         % (display_path(path), line_number, _side_lines(task),
                            target_branch, target[:12], _side_lines(other)))
    if len(parts[0]) > CONFLICT_TEXT_CHARS // 2:               # thousands of files
        parts[0] = parts[0][:CONFLICT_TEXT_CHARS // 2] + " [...]"
    text = ""
    for index, part in enumerate(parts):
        candidate = text + ("\n\n" if text else "") + part
        if len(candidate) > CONFLICT_TEXT_CHARS:
            left = len(parts) - index
            return text + "\n\n[... %d more conflicting part%s left out; `git diff` in the " \
                "worktree during the rebase or merge shows them all]" % (
                    left, "" if left == 1 else "s")
        text = candidate
    return text


def _conflict_hunks(path):
    """[(line number, ours lines, theirs lines)] of the conflict markers in a file."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read(1 << 20).splitlines()
    except OSError:
        return []
    hunks, index = [], 0
    while index < len(lines):
        if not lines[index].startswith("<<<<<<<"):
            index += 1
            continue
        start, ours, theirs, side = index + 1, [], [], "ours"
        index += 1
        while index < len(lines) and not lines[index].startswith(">>>>>>>"):
            line = lines[index]
            if line.startswith("|||||||") and side == "ours":
                side = "base"                              # diff3 / zdiff3 style
            elif line.startswith("=======") and side != "theirs":
                side = "theirs"
            elif side == "ours":
                ours.append(line)
            elif side == "theirs":
                theirs.append(line)
            index += 1
        hunks.append((start, ours, theirs))
        index += 1
    return hunks


def _side_lines(lines):
    shown = ["    | " + (line if len(line) <= CONFLICT_LINE_CHARS else
                         line[:CONFLICT_LINE_CHARS] + " [...]")
             for line in lines[:CONFLICT_SIDE_LINES]]
    if len(lines) > CONFLICT_SIDE_LINES:
        shown.append("    [... %d more lines]" % (len(lines) - CONFLICT_SIDE_LINES))
    return "\n".join(shown) if shown else "    (nothing: the lines are removed)"


@dataclasses.dataclass
class FastForward:
    """What fast_forward_target did to the target branch."""

    status: str            # "done", "moved" (not at old_head any more) or "dirty"
    head: "str | None"     # where the target is now
    files: list = dataclasses.field(default_factory=list)   # dirty: the user's files in the way
    text: str = ""         # why, for people
    checkout: "str | None" = None   # where the target is checked out (None: nowhere)


def fast_forward_target(root, target_branch, old_head, new_head):
    """Move ``target_branch`` from ``old_head`` to ``new_head``, only as a fast-forward.

    Checked out nowhere, its ref moves by one atomic compare-and-swap (`git update-ref
    <new> <old>`).  Checked out (the user's checkout, usually), the checkout is updated
    with `git merge --ff-only` — never a reset or a forced checkout — unless a file the
    update changes has uncommitted changes there, or an untracked (or ignored) file sits
    where it writes one, or a merge or rebase is in progress there: then nothing is
    touched and the status is "dirty", with those files named (other uncommitted changes
    are carried along, as `git pull` would).  "moved": the target is no longer at
    ``old_head`` (someone committed); integrate again.  "done" also when the target is
    at ``new_head`` already (a retry after a crash).  A kill at any moment leaves the
    target's ref at ``old_head`` or ``new_head``.  Raises GitError when ``new_head`` does
    not descend from ``old_head`` or git fails otherwise."""
    entries = _worktree_entries(root)
    holder = None
    for entry in entries:
        if entry["branch"] == target_branch:
            holder = entry
        elif entry["branch"] is None and not entry["bare"]:
            git_dir = _worktree_git_dir(entry["path"])
            if git_dir and _rebasing_branch(git_dir) == target_branch:
                return FastForward("dirty", old_head, [], "a rebase of %s is in progress in "
                                   "%s: waiting until it is finished or aborted"
                                   % (target_branch, entry["path"]), entry["path"])
    if holder is not None and not os.path.isdir(holder["path"]):
        holder = None                                # its folder is gone: nothing to overwrite
    if holder is not None:
        current = holder["head"]
    else:
        current = target_head(root, target_branch)
    where = holder["path"] if holder else None
    if current == new_head:
        return FastForward("done", new_head, [], "%s is at %s" % (target_branch, new_head[:12]),
                           where)
    if current != old_head:
        return _moved(target_branch, current, old_head, where)
    if not _is_ancestor(root, old_head, new_head):
        raise GitError("%s is not a fast-forward of %s (at %s)" % (new_head[:12], target_branch,
                                                                  old_head[:12]),
                       "integrate the task onto the target's head again")
    if holder is None:
        try:
            run_git(root, ["update-ref", "-m", "ferrus: integrate %s" % new_head[:12],
                           "refs/heads/" + target_branch, new_head, old_head])
        except GitError:
            current = target_head(root, target_branch)
            if current == new_head:
                return FastForward("done", new_head, [], "%s is at %s" % (
                    target_branch, new_head[:12]))
            if current != old_head:
                return _moved(target_branch, current, old_head, None)
            raise
        return FastForward("done", new_head, [], "%s moved from %s to %s" % (
            target_branch, old_head[:12], new_head[:12]))
    checkout = holder["path"]
    blocked = _checkout_blockers(checkout, old_head, new_head)
    if blocked:
        return blocked
    try:
        run_git(checkout, ["merge", "--ff-only", "-q", new_head])
    except GitError as err:
        current = target_head(root, target_branch)
        if current == new_head:
            return FastForward("done", new_head, [], "%s is at %s" % (
                target_branch, new_head[:12]), checkout)
        if current != old_head:
            return _moved(target_branch, current, old_head, checkout)
        blocked = _checkout_blockers(checkout, old_head, new_head)
        if blocked:
            return blocked
        raise GitError("updating %s in your checkout %s failed: %s" % (
            target_branch, checkout, err.message), "run `git merge --ff-only %s` there to "
            "see what git needs" % new_head[:12]) from None
    return FastForward("done", new_head, [], "%s moved from %s to %s (checked out in %s)" % (
        target_branch, old_head[:12], new_head[:12], checkout), checkout)


def _moved(target_branch, current, old_head, where):
    return FastForward("moved", current, [], "%s moved to %s since %s: the task is "
                       "integrated onto its new head again" % (
                           target_branch, current[:12] if current else "(deleted)",
                           old_head[:12]), where)


def _checkout_blockers(checkout, old_head, new_head):
    """A "dirty" FastForward when the checkout cannot take the update untouched: a git
    operation in progress, or local changes (also untracked or ignored files) at paths
    the update writes; else None."""
    git_dir = _worktree_git_dir(checkout)
    operation = _operation_in(git_dir) if git_dir else None
    if operation:
        return FastForward("dirty", old_head, [], "a git %s is in progress in your checkout "
                           "%s: waiting until it is finished" % (operation, checkout), checkout)
    touched = [p for p in os.fsdecode(run_git(checkout, [
        "diff", "--name-only", "-z", "--no-renames", old_head, new_head])).split("\0") if p]
    if not touched:
        return None
    # Past a few thousand paths the command line could be too long: ask about them all.
    specs = (["--"] + [":(literal)" + p for p in touched]) if len(touched) <= 2000 else []
    out = run_git(checkout, ["status", "--porcelain=v2", "-z", "--untracked-files=all",
                             "--ignored=matching", "--no-renames"] + specs)
    local = []
    for entry in os.fsdecode(out).split("\0"):
        if entry.startswith(("1 ", "u ")):
            local.append(entry.split(" ", 8 if entry[0] == "1" else 10)[-1])
        elif entry.startswith(("? ", "! ")):
            local.append(entry[2:])
    touched_set = set(touched)
    blocking = {p for p in local if p in touched_set or any(
        p.startswith(t + "/") for t in touched) or any(t.startswith(p + "/") for t in touched)}
    # A file (untracked or ignored) where the update needs a folder, which the status
    # above, asked only about the paths themselves, does not list.
    for path in touched:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in touched_set:
                break
            full = os.path.join(checkout, *parts[:depth])
            if os.path.islink(full) or os.path.isfile(full):
                blocking.add(folder)
                break
    blocking = sorted(blocking)
    if not blocking:
        return None
    return FastForward("dirty", old_head, blocking, "your checkout %s has uncommitted changes "
                       "(or untracked files) where the task's changes go: %s; commit, stash or "
                       "move them, and the task is integrated" % (
                           checkout, ", ".join(map(display_path, blocking[:20]))
                           + (" and %d more" % (len(blocking) - 20) if len(blocking) > 20
                              else "")), checkout)


# ============================================================================
# 11. Specs
# ============================================================================

@dataclasses.dataclass
class Milestone:
    """One `- [ ]` milestone of a spec, with what it depends on."""

    marker: str
    id: str
    title: str
    depends_on: list
    completed: bool
    line_index: int

    def display(self):
        return "%s %s" % (self.marker, self.title)


_MILESTONE_RE = re.compile(r"^\s*- \[([ xX])\] (.*)$")
_FENCE_RE = re.compile(r"^\s*(```|~~~)")
_HEADING_RE = re.compile(r"^#{1,6}\s")


def _milestone_header(line):
    match = _MILESTONE_RE.match(line.rstrip("\r\n"))
    if not match:
        return None
    rest = match.group(2).strip()
    if not rest.startswith("#"):
        return None
    parts = rest.split(None, 1)
    if len(parts) < 2 or len(parts[0]) < 2 or not parts[1].strip():
        return None
    return match.group(1) in "xX", parts[0], parts[1].strip()


def parse_spec(text):
    """The milestones of a spec: upstream's rules, with their edge cases fixed (see
    ARCHITECTURE.md, 'Differences from upstream ferrus', item 15).

    A milestone's own lines end at the next milestone, at a Markdown heading or
    at the end of its list; fenced code blocks are never read; the first ``ID:``
    wins; ``Depends on:`` is parsed into markers and ids."""
    milestones = []
    current = None
    in_fence = False
    for index, line in enumerate(text.split("\n")):
        if _FENCE_RE.match(line):
            in_fence = not in_fence
            current = None
            continue
        if in_fence:
            continue
        header = _milestone_header(line)
        if header:
            completed, marker, title = header
            current = Milestone(marker, "", title, [], completed, index)
            milestones.append(current)
            continue
        if current is None:
            continue
        stripped = line.strip()
        if _HEADING_RE.match(line):
            current = None
            continue
        if stripped.startswith("- "):
            stripped = stripped[2:].strip()
        if stripped.startswith("ID:") and not current.id:
            current.id = stripped[3:].strip()
        elif stripped.startswith("Depends on:"):
            value = stripped[len("Depends on:"):].strip()
            current.depends_on = [] if value.lower() in ("", "none") else [
                part.strip() for part in value.split(",") if part.strip()]
    return [m for m in milestones if m.id]


def dependencies_met(milestone, milestones):
    done = {m.marker for m in milestones if m.completed} | {m.id for m in milestones if m.completed}
    known = {m.marker for m in milestones} | {m.id for m in milestones}
    return all(dep in done for dep in milestone.depends_on if dep in known)


def first_ready_milestone(milestones, after=None):
    """The first incomplete milestone whose dependencies are complete (after ``after``)."""
    started = after is None
    for milestone in milestones:
        if not started:
            started = milestone.id == after
            continue
        if not milestone.completed and dependencies_met(milestone, milestones):
            return milestone
    return None


def next_ready_milestone(milestones, after):
    """The milestone to select once ``after`` is done: the next ready one in document
    order, else an earlier one that was waiting on it (``Depends on:`` may point forward)."""
    return first_ready_milestone(milestones, after=after) or first_ready_milestone(milestones)


def unmet_dependencies(milestone, milestones):
    """The markers or ids ``milestone`` waits for that are not complete yet."""
    done = {m.marker for m in milestones if m.completed} | {m.id for m in milestones if m.completed}
    known = {m.marker for m in milestones} | {m.id for m in milestones}
    return [dep for dep in milestone.depends_on if dep in known and dep not in done]


def milestone_block(text, milestone):
    """The milestone's header line and its own child lines, as written in the spec."""
    lines = text.split("\n")
    block = [lines[milestone.line_index].strip()]
    for line in lines[milestone.line_index + 1:]:
        if _milestone_header(line) or _HEADING_RE.match(line) or _FENCE_RE.match(line):
            break
        block.append(line.rstrip())
    while block and not block[-1].strip():
        block.pop()
    return "\n".join(block)


def milestone_task_text(spec_path, text, milestone):
    """A task description for ``ferrus run --milestone``: the milestone and its spec."""
    return ("Implement milestone %s (ID %s) of the spec %s.\n\n%s\n\n"
            "Read the whole spec for context. Do this milestone only; the reviewer checks "
            "it against the spec's requirements and acceptance criteria.\n"
            % (milestone.marker, milestone.id, spec_path, milestone_block(text, milestone)))


def spec_directory(root, config):
    directory = config.spec.directory.strip()
    if not directory:
        raise FerrusError("ferrus.toml [spec].directory is empty.",
                          "set it to a folder such as \"docs/specs\"")
    return os.path.join(root, directory)


def list_spec_paths(root, config):
    directory = spec_directory(root, config)
    if not os.path.isdir(directory):
        return []
    rel = os.path.relpath(directory, root).replace(os.sep, "/")
    return sorted("%s/%s" % (rel, name) for name in os.listdir(directory)
                  if name.endswith(".md") and os.path.isfile(os.path.join(directory, name)))


def spec_display_name(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    if len(stem) > 11 and re.match(r"^\d{4}-\d{2}-\d{2}-", stem):
        stem = stem[11:]
    return stem


def resolve_selected(root, data):
    """(spec_path, milestone) for the selection, or raise FerrusError saying what is missing."""
    if not data.selected_spec or not data.selected_milestone:
        raise FerrusError("no spec milestone is selected",
                          "select one in HQ with /milestones, or create a spec first")
    path = os.path.join(root, data.selected_spec)
    if not os.path.isfile(path):
        raise FerrusError("the selected spec %s does not exist" % data.selected_spec,
                          "select another spec with /milestones")
    for milestone in parse_spec(read_text(path)):
        if milestone.id == data.selected_milestone:
            return data.selected_spec, milestone
    raise FerrusError("milestone %s is not in %s" % (data.selected_milestone, data.selected_spec),
                      "select another milestone with /milestones")


# Longest slug in a spec's file name: with the date, a "-NNNN" counter, ".md" and
# atomic_write's temporary-name decoration it stays far below the 255-byte limit
# of common file systems (a 239-character title used to fail "File name too long").
SLUG_MAX_CHARS = 80


def slugify(title, max_chars=SLUG_MAX_CHARS):
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower().encode("ascii", "replace").decode("ascii")
                  .replace("?", "-")).strip("-")
    if len(slug) > max_chars:
        # Cut at a word boundary when one is near, so the name stays readable.
        cut = slug[:max_chars + 1].rfind("-")
        slug = (slug[:cut] if cut >= max_chars // 2 else slug[:max_chars]).strip("-")
    return slug or "spec"


def spec_title(markdown):
    for line in markdown.split("\n"):
        stripped = line.strip()
        if stripped.startswith("# ") and stripped[2:].strip():
            return stripped[2:].strip()
    return "spec"


def mark_milestone_complete(text, milestone):
    """The spec text with that milestone's box ticked; every other byte unchanged."""
    lines = text.split("\n")
    line = lines[milestone.line_index]
    lines[milestone.line_index] = line.replace("- [ ]", "- [x]", 1)
    return "\n".join(lines)


SPEC_TEMPLATE = """# <Feature Name> Specification

## Summary
One paragraph: what this feature is and who it is for.

## Goals
- What must be true when this is done.

## Non-Goals
- What is deliberately left out.

## Context
Where this fits in the codebase, and anything a newcomer must know first.

## Requirements
- Behaviour, interfaces, error handling, performance.

## Milestones
Order milestones so that each one can be built, checked and reviewed on its own.
Each milestone is a checkbox line with a marker such as `#1.0`, followed by an
`ID:` line and a `Depends on:` line (`none`, or markers like `#1.0, #1.1`).
ferrus picks the first unchecked milestone whose dependencies are checked.

- [ ] #1.0 ...
  - ID: m1.0
  - Depends on: none
- [ ] #1.1 ...
  - ID: m1.1
  - Depends on: #1.0
- [ ] #1.2 ...
  - ID: m1.2
  - Depends on: #1.0

## Acceptance Criteria
- How a reviewer decides that the feature is done.

## Risks and Open Questions
- What could go wrong, and what is still undecided.
"""


# ============================================================================
# 12. Operations
# ============================================================================
#
# One function per behaviour.  The MCP tools, the CLI (and HQ) call these and
# nothing else changes .ferrus/.  A refusal raises FerrusError; success returns
# an Outcome whose text agents read and whose data is the structured form.

ROLES = ("supervisor", "executor")


@dataclasses.dataclass
class Caller:
    """Who is acting: an MCP server's agent identity, the human, or HQ."""

    role: str                      # supervisor | executor | agent | human | hq
    agent_id: str
    cancel: "threading.Event | None" = None
    progress: "object | None" = None   # callable(message) for long waits

    @property
    def is_agent(self):
        return self.role in ("supervisor", "executor", "agent")


HUMAN = Caller("human", "human")


@dataclasses.dataclass
class Outcome:
    """What an operation returns: text for people, data for programs."""

    text: str
    data: dict


def _outcome(text, state, **data):
    data.setdefault("message", text)
    data["state"] = state.value if isinstance(state, TaskState) else state
    return Outcome(text, data)


def _json_outcome(data):
    return Outcome(compact_json(data), data)


def _nonblank(value, message):
    if not isinstance(value, str) or not value.strip():
        raise FerrusError(message)
    return value


def _guard_lease(store, data, caller, action):
    """An agent may not act on a task whose live lease another agent holds."""
    if not caller.is_agent or data.claimed_by == caller.agent_id or not store.lease_live(data):
        return
    raise FerrusError(
        "Cannot %s: the task is leased to %s until %s." % (action, data.claimed_by, data.lease_until),
        "only the lease holder may %s; the lease frees itself when its holder stops "
        "calling /heartbeat for lease.ttl_secs" % action)


# -- supervisor ---------------------------------------------------------------

def _refuse_create_unless_idle(state):
    if state != S.IDLE:
        raise FerrusError(
            "Cannot create task: current state is %s. The executor must complete or reset "
            "the current task first." % state,
            "a human can run `ferrus reset` to return to Idle")


def _git_config(store):
    """[git], or its defaults when ferrus.toml does not load (the operations that need
    the rest of the file say why)."""
    try:
        return store.config().git
    except FerrusError:
        return GitConfig()


def op_create_task(store, caller, description, origin=None, task_id=None):
    """Idle → Executing.  ``origin`` (spec path, milestone id) names the milestone the task
    implements; without it the origin HQ staged for the supervisor (pending_task_*) applies.
    With [git] branch set, the task's branch is created and checked out first (a parallel
    task has its worktree's branch instead).  ``task_id``: the queue's id for the task."""
    _nonblank(description, "Cannot create task: the description is empty.")
    # git runs before the lock is taken (it can take a moment in a big repository).
    base, warnings = record_task_base(store.workdir, task_diff_exclusions(store))
    git_config = _git_config(store)
    if store.task is not None:
        git_config = dataclasses.replace(git_config, branch="")
    branch = None
    if git_config.branch and not base.get("git"):
        warnings.append("[git] branch is set, but the task gets no branch: %s" % base["reason"])
    elif git_config.branch:
        # Refused here, before a branch exists, in the usual case; the transaction
        # below checks again and takes the branch back if it must refuse after all.
        _refuse_create_unless_idle(store.read_state().state)
        task_id = task_id or new_id("t")
        branch = git_config.branch_for(task_id)
        try:
            from_branch = create_task_branch(store.root, branch, base)
        except GitError as err:
            raise FerrusError("Cannot create task: [git] branch: %s." % err.message.rstrip("."),
                              err.hint) from err
        base = dict(base, branch=branch, task_branch=branch, from_branch=from_branch)
        # The task's branch is where HEAD is now, detached or not before.
        warnings = [w for w in warnings if not w.startswith("HEAD is detached")]
    if git_config.commit == "on_approve" and base.get("dirty_count"):
        warnings.append("with [git] commit = \"on_approve\", the files already changed stay "
                        "out of the task's commit (they are yours to commit)")
    try:
        with store.transaction(caller.agent_id) as tx:
            _refuse_create_unless_idle(tx.state.state)
            task_id = task_id or new_id("t")
            data = tx.state
            if origin is not None:
                data = data.copy()
                data.pending_task_spec, data.pending_task_milestone = origin
            new = t_create_task(data, store.clock(), task_id, base)
            detail = {"task_id": task_id}
            if base.get("git"):
                detail["base"] = (base["commit"] or "")[:12]
            if branch:
                detail["branch"] = branch
            if new.task_milestone:
                detail.update(spec=new.task_spec, milestone=new.task_milestone)
            tx.set(new, "create_task", **detail)
            tx.write("TASK.md", description)
            # Stale review, question and answer text must not leak into the new task
            # (see ARCHITECTURE.md, 'Differences from upstream ferrus', item 17).
            for name in TASK_SCRATCH_FILES + _approval_file_if_any(store):
                tx.write(name, "")
    except BaseException:
        if branch:
            remove_task_branch(store.root, branch, base.get("from_branch"), base.get("commit"))
        raise
    text = "Task created. State: Executing. The Executor can now call /wait_for_task."
    if branch:
        text += "\nThe task works on the new git branch %s (from %s)." % (
            branch, base["from_branch"] or "a detached HEAD at %s" % (base["commit"] or "")[:12])
    if warnings:
        text += "".join("\nwarning: %s" % warning for warning in warnings)
    return _outcome(text, S.EXECUTING, task_id=task_id, base=base, warnings=warnings,
                    branch=branch)


# -- the task's diff ------------------------------------------------------------------

# How much of the patch the review tools carry inline (ferrus://diff serves more).
REVIEW_DIFF_BYTES = 16 * 1024


def task_diff_exclusions(store):
    try:
        agents_path = store.config().agents.path
    except FerrusError:
        agents_path = AgentsConfig.path
    return diff_exclusions(agents_path)


def op_diff(store, caller=None, stat_only=False, paths=None, head_bytes=192 * 1024,
            tail_bytes=32 * 1024, more_hint="Read one file's diff with ferrus://diff/<path> "
                                             "(or `ferrus diff PATH`)."):
    """The task's changes (base → working tree) as text and data.  Without git, or
    outside a repository, the outcome says why there is no diff (it is not an error)."""
    data = store.read_state()
    base = data.task_base
    try:
        diff = task_diff(store.workdir, base, task_diff_exclusions(store), patch=not stat_only,
                         paths=paths, head_bytes=head_bytes, tail_bytes=tail_bytes)
    except GitUnavailable as err:
        return _outcome("No diff: %s." % err.message.rstrip("."), data.state, available=False,
                        reason=err.message, hint=err.hint)
    title = "Task %s diff: %s → working tree" % (data.task_id or "(none)", describe_base(
        diff.base) if diff.base else "HEAD")
    parts = [title]
    parts += ["note: %s" % note for note in diff.notes]
    parts += ["", diff.stat_text()]
    if not stat_only and diff.files:
        parts += ["", diff.patch_text(more_hint).rstrip("\n")]
    added, deleted = diff.totals()
    return _outcome("\n".join(parts), data.state, available=True, task_id=data.task_id,
                    base=diff.base, notes=diff.notes,
                    files=[changed.to_json() for changed in diff.files],
                    insertions=added, deletions=deleted,
                    patch_bytes=diff.patch_bytes, patch_cut=list(diff.patch_cut or ()) or None)


# A word of the submission notes that names a file: dir/name.ext or name.ext.
_MENTIONED_FILE_RE = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-][\w.-]*\.[A-Za-z0-9]{1,10})"
                                r"(?![\w/-])")


def unchanged_mentions(root, notes, changed_paths):
    """The project files the notes mention that the diff does not touch (only names of
    files that exist, so a URL or a version number is never taken for one)."""
    changed = set(changed_paths)
    found = []
    for name in _MENTIONED_FILE_RE.findall(notes or ""):
        name = name.rstrip(".")
        if name in changed or name in found or any(p.endswith("/" + name) for p in changed):
            continue
        if os.path.isfile(os.path.join(root, name)) and not os.path.isabs(name):
            found.append(name)
    return found


def review_diff(store, submission=""):
    """(text, changed files) for a review: the stat, the patch's first
    REVIEW_DIFF_BYTES and where to read the rest, plus a warning for files the
    submission names that the diff does not change.  Never fails: a git problem is
    reported in the text."""
    try:
        outcome = op_diff(store, head_bytes=REVIEW_DIFF_BYTES, tail_bytes=0,
                          more_hint="Read the rest with ferrus://diff, or one file's diff "
                                    "with ferrus://diff/<path>.")
    except FerrusError as err:
        return "No diff: %s" % err.full_text(), []
    text = outcome.text
    files = outcome.data.get("files") or []
    if outcome.data.get("available"):
        unchanged = unchanged_mentions(store.workdir, submission,
                                       [f["path"] for f in files] +
                                       [f["old_path"] for f in files if f.get("old_path")])
        if unchanged:
            text = ("warning: the submission notes name %s, which the diff does not change\n\n"
                    % ", ".join(unchanged)) + text
    return text, files


def op_review_pending(store, caller):
    data = store.read_state()
    if data.state != S.REVIEWING:
        raise FerrusError("No submission pending review. Current state: %s. Wait for the "
                          "Executor to call /submit." % data.state)
    return _outcome(_review_text(store, data), data.state)


def _review_text(store, data):
    limits = store.config().limits
    text = "## Task\n\n%s\n" % store.read_file("TASK.md")
    submission = store.read_file("SUBMISSION.md")
    if submission.strip():
        text += "\n## Submission Notes\n\n%s" % submission
    text += "\n## Changes\n\n%s\n" % review_diff(store, submission)[0]
    review = store.read_file("REVIEW.md")
    if review.strip():
        text += "\n## Previous Review Notes\n\n%s" % review
    text += "\n---\nReview cycles used: %d/%d  \nCheck retries used: %d/%d" % (
        data.review_cycles, limits.max_review_cycles, data.check_retries, limits.max_check_retries)
    return text


def _approval_file_if_any(store):
    return (APPROVAL_FILE,) if os.path.exists(store.task_path(APPROVAL_FILE)) else ()


def _refuse_agent_on_confirmation(data, action):
    """The reviewer's approve or reject once its approval waits for the human."""
    if data.state == S.AWAITING_CONFIRMATION:
        raise FerrusError(
            "Cannot %s: the submission is already approved and waits for a human's "
            "confirmation (state AwaitingConfirmation). Only the human can approve or reject "
            "it now; stop here." % action,
            "the human runs `ferrus approve` or `ferrus reject NOTES` (or /approve, /reject in "
            "HQ)")


def _complete_task(store, tx, data, new):
    """What reaching Complete does besides the state: tick the task's spec milestone and
    move the selection on.  Returns the journal detail."""
    detail = {}
    # The milestone tick is a content file written before STATE.json, and it
    # is idempotent, so a failed commit can simply be approved again.
    if data.task_spec and data.task_milestone:
        # A parallel task ticks the spec in its worktree: the tick is merged with its work.
        path = os.path.join(store.workdir, data.task_spec)
        if not os.path.isfile(path):
            path = os.path.join(store.root, data.task_spec)
        if os.path.isfile(path):
            text = read_text(path)
            milestones = parse_spec(text)
            match = next((m for m in milestones if m.id == data.task_milestone), None)
            if match is not None:
                if not match.completed:
                    tx.write(path, mark_milestone_complete(text, match))
                    match.completed = True
                    detail["milestone_completed"] = match.id
                if (data.selected_spec == data.task_spec
                        and data.selected_milestone == data.task_milestone):
                    following = next_ready_milestone(milestones, match.id)
                    new.selected_milestone = following.id if following else None
                    detail["selected_milestone"] = new.selected_milestone
    return detail


# -- [git] commit = "on_approve" ------------------------------------------------------------

# How much of the submission notes a commit message carries.
COMMIT_BODY_CHARS = 4000


def task_commit_message(task_id, description, submission):
    """The commit message of a task: its title (the description's first line), the
    submission notes, and a ``Ferrus-Task`` trailer.  Controls (an ESC or a BEL in a
    title an agent or a queue wrote) are shown in caret notation, never stored raw in the
    history where `git log` would print them to a terminal."""
    description, submission = (
        terminal_safe(text.replace("\r\n", "\n").replace("\r", "\n"))
        for text in (description, submission))
    title = next((line.strip().lstrip("#").strip() for line in description.splitlines()
                  if line.strip().lstrip("#").strip()), "") or "ferrus task %s" % task_id
    if len(title) > 72:
        title = title[:69].rstrip() + "..."
    body = submission.strip()
    if len(body) > COMMIT_BODY_CHARS:
        body = body[:COMMIT_BODY_CHARS].rstrip() + "\n[...]"
    return "%s\n\n%s%sFerrus-Task: %s\n" % (title, body, "\n\n" if body else "", task_id)


def commit_on_approve(store, data):
    """The task_commit record of [git] commit = "on_approve" for the task ``data`` is
    about to complete: the commit made, or why there is none.  Never raises: a failed
    commit must not stop the approval (the changes stay in the work tree)."""
    message = task_commit_message(data.task_id or "", store.read_file("TASK.md"),
                                  store.read_file("SUBMISSION.md"))
    try:
        return commit_task_changes(store.workdir, data.task_base, task_diff_exclusions(store),
                                   message)
    except GitUnavailable as err:
        return {"commit": None, "reason": err.message}
    except FerrusError as err:
        return {"commit": None, "error": err.message, "hint": err.hint}


def _commit_before_complete(store, caller, data, action, git_config):
    """Commit the task's changes while it is still one step from Complete (outside the
    lock: hooks may take minutes).  None when [git] commit is off."""
    if git_config.commit != "on_approve":
        return None
    _guard_lease(store, data, caller, action)
    return commit_on_approve(store, data)


def _record_commit(new, data, commit, detail):
    """Put the commit record on the Complete state and in the journal detail."""
    if commit is None or new.task_id != data.task_id:
        return
    new.task_commit = commit
    if commit.get("commit"):
        detail.update(commit=commit["commit"][:12], branch=commit["branch"],
                      committed_files=commit["files"])
    elif commit.get("error"):
        detail["commit_failed"] = commit["error"]
    else:
        detail["not_committed"] = commit.get("reason")


def describe_task_commit(commit):
    """One line (with its hint) on what [git] commit did for a task, or None."""
    if not commit:
        return None
    if commit.get("commit"):
        line = "Committed the task's changes as %s on branch %s (%d file%s)." % (
            commit["commit"][:12], commit.get("branch"), commit.get("files", 0),
            "" if commit.get("files") == 1 else "s")
        if commit.get("left_out"):
            line += " Left uncommitted, as they were changed before the task began: %s." % (
                ", ".join(commit["left_out"]))
        return line
    if commit.get("error"):
        return "The task's changes were NOT committed (they are still in the work tree): " \
            "%s.%s" % (commit["error"].rstrip("."), "\nhint: %s" % commit["hint"]
                       if commit.get("hint") else "")
    return "Nothing was committed: %s." % (commit.get("reason") or "").rstrip(".")


def op_approve(store, caller, notes=None):
    """Reviewing → Complete, or → AwaitingConfirmation when [hq] human_review is on (then
    ``notes``, the reviewer's verdict in words, wait in APPROVAL.md for the human).  With
    [git] commit = "on_approve" the task's changes are committed on the way to Complete."""
    if notes is not None and not isinstance(notes, str):
        raise FerrusError("Cannot approve: notes must be text.")
    config = store.config()
    human_review = config.human_review
    commit = None
    if not human_review and store.task is None:
        before = store.read_state()
        if before.state == S.REVIEWING:
            commit = _commit_before_complete(store, caller, before, "approve", config.git)
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        _refuse_agent_on_confirmation(data, "approve")
        if data.state != S.REVIEWING:
            raise FerrusError("Cannot approve from state %s. Call /review_pending first." % data.state)
        _guard_lease(store, data, caller, "approve")
        new = t_approve(data, store.clock(), human_review, integrate=store.task is not None)
        if notes and notes.strip():
            tx.write(APPROVAL_FILE, notes)
        elif human_review:
            # No notes this time: the human must not read an earlier cycle's.
            for name in _approval_file_if_any(store):
                tx.write(name, "")
        if new.state == S.COMPLETE:
            detail = _complete_task(store, tx, data, new)
            _record_commit(new, data, commit, detail)
            tx.set(new, "approve", **detail)
        elif new.state == S.INTEGRATING:
            tx.set(new, "approve", awaiting="integration",
                   **_complete_task(store, tx, data, new))
        else:
            tx.set(new, "approve", awaiting="human")
    if new.state == S.INTEGRATING:
        return _outcome("Task approved. State: Integrating — ferrus merges it into the target "
                        "branch once the checks pass on the merged result. Your review is "
                        "done; stop here.", new.state)
    if new.state == S.AWAITING_CONFIRMATION:
        return _outcome("Approval recorded. State: AwaitingConfirmation — a human confirms or "
                        "rejects it now ([hq] human_review is on). Your review is done; stop "
                        "here.", new.state)
    text = "Task approved. State: Complete. Well done!"
    if new.task_commit:
        text += "\n" + describe_task_commit(new.task_commit)
    return _outcome(text, S.COMPLETE, git_commit=new.task_commit)


def op_reject(store, caller, notes):
    _nonblank(notes, "Cannot reject: the review notes are empty. Say what must change.")
    limits = store.config().limits
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        _refuse_agent_on_confirmation(data, "reject")
        if data.state != S.REVIEWING:
            raise FerrusError("Cannot reject from state %s. Call /review_pending first." % data.state)
        _guard_lease(store, data, caller, "reject")
        new = t_reject(data, store.clock(), limits.max_review_cycles)
        tx.write("REVIEW.md", notes)
        tx.set(new, "reject", review_cycles=new.review_cycles)
    if new.state == S.FAILED:
        text = ("Review cycle limit reached (%d/%d).\n\nState is now Failed. A human must call "
                "/reset to recover." % (new.review_cycles, limits.max_review_cycles))
    else:
        text = ("Submission rejected (cycle %d/%d).\n\n**Review notes written.** State: "
                "Addressing. The Executor should call /wait_for_task to see the notes and /check "
                "after addressing them." % (new.review_cycles, limits.max_review_cycles))
    return _outcome(text, new.state, review_cycles=new.review_cycles)


# -- the human's confirmation ([hq] human_review) -----------------------------------------

def human_name():
    """Who the human at this terminal is, as the journal records a confirmation."""
    try:
        return getpass.getuser()
    except (OSError, KeyError, ImportError):     # no login name anywhere (containers)
        return "unknown"


def _require_human(caller, action):
    if caller.is_agent:
        raise FerrusError(
            "Cannot %s on a human's behalf: only the human confirms or rejects a task the "
            "reviewer approved (this caller is %s)." % (action, caller.agent_id),
            "a human runs `ferrus %s` in a shell of their own, or /%s in HQ"
            % (action, action))


def _nothing_to_confirm(data, action):
    hint = {S.REVIEWING: "the reviewer has not decided yet ([hq] human_review = true makes "
                         "its approval wait for you)",
            S.COMPLETE: "the task is already Complete",
            S.IDLE: "there is no task"}.get(data.state, "`ferrus status` shows where it stands")
    return FerrusError("Cannot %s: no approval waits for your confirmation (state %s)."
                       % (action, data.state), hint)


def op_human_approve(store, caller, via="cli"):
    """AwaitingConfirmation → Complete, by the human only."""
    _require_human(caller, "approve")
    before = store.read_state()
    commit = None
    if before.state == S.AWAITING_CONFIRMATION and store.task is None:
        commit = _commit_before_complete(store, caller, before, "approve", _git_config(store))
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state != S.AWAITING_CONFIRMATION:
            raise _nothing_to_confirm(data, "approve")
        new = t_human_approve(data, store.clock(), integrate=store.task is not None)
        detail = _complete_task(store, tx, data, new)
        _record_commit(new, data, commit, detail)
        tx.set(new, "human_approve", by=human_name(), via=via, **detail)
    if new.state == S.INTEGRATING:
        return _outcome("Approved. State: Integrating — it is merged once the checks pass on "
                        "the merged result.", new.state, **detail)
    text = "Approved. State: Complete."
    if detail.get("milestone_completed"):
        text += " Milestone %s of %s is ticked." % (detail["milestone_completed"], data.task_spec)
    if new.task_commit:
        text += "\n" + describe_task_commit(new.task_commit)
    return _outcome(text, S.COMPLETE, git_commit=new.task_commit, **detail)


def op_human_reject(store, caller, notes, via="cli"):
    """AwaitingConfirmation → Addressing (or Failed at max_review_cycles), by the human
    only: the notes become the review notes the executor reads, and the cycle counts."""
    _require_human(caller, "reject")
    _nonblank(notes, "Cannot reject: the notes are empty. Say what must change.")
    limits = store.config().limits
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state != S.AWAITING_CONFIRMATION:
            raise _nothing_to_confirm(data, "reject")
        new = t_human_reject(data, store.clock(), limits.max_review_cycles)
        tx.write("REVIEW.md", notes)
        tx.set(new, "human_reject", by=human_name(), via=via, review_cycles=new.review_cycles)
    if new.state == S.FAILED:
        text = ("Rejected; the review cycle limit is reached (%d/%d), so the task is now "
                "Failed. `ferrus reset` clears it." % (new.review_cycles,
                                                      limits.max_review_cycles))
    else:
        text = ("Rejected (cycle %d/%d). State: Addressing; the executor gets your notes as "
                "review notes." % (new.review_cycles, limits.max_review_cycles))
    return _outcome(text, new.state, review_cycles=new.review_cycles)


def _excerpt(text, max_lines):
    lines = text.strip().splitlines()
    if len(lines) <= max_lines:
        return "\n".join(lines)
    return "\n".join(lines[:max_lines] + ["… (%d more lines)" % (len(lines) - max_lines)])


# How far back the reviewer's approve entry is looked for (a waiting task writes little).
_APPROVER_SCAN = 2000


def confirmation_summary(store, data=None):
    """What the human sees before confirming: the task, the submission, the reviewer's
    verdict and notes, the diff stat, and how to answer.  Every part but the stat is
    data an agent wrote."""
    data = data or store.read_state()
    approver = None
    for entry in itertools.islice(store.journal_entries_backwards(), _APPROVER_SCAN):
        if entry.get("event") == "approve" and entry.get("task_id") == data.task_id:
            approver = entry.get("actor")
            break
    limits = None
    with contextlib.suppress(FerrusError):
        limits = store.config().limits
    notes = store.read_file(APPROVAL_FILE).strip()
    parts = [
        "The reviewer approved task %s; it waits for your confirmation." % (data.task_id or "-"),
        "## Task\n" + (_excerpt(store.read_file("TASK.md"), 12) or "(TASK.md is empty)"),
        "## Submission\n" + (_excerpt(store.read_file("SUBMISSION.md"), 30)
                             or "(no submission notes)"),
        "## Reviewer's verdict\napproved by %s\n%s" % (
            approver.partition("/")[0] if approver else "the reviewer",
            _excerpt(notes, 30) if notes else "(no notes given)"),
    ]
    try:
        changes = op_diff(store, stat_only=True).text
    except FerrusError as err:          # a git failure must not hide the rest
        changes = "No diff: %s" % err.message
    parts.append("## Changes\n" + _excerpt(changes, 40))
    earlier = store.read_file("REVIEW.md").strip()
    if earlier and data.review_cycles:
        parts.append("## The last rejection's notes (what this round had to address)\n"
                     + _excerpt(earlier, 20))
    cycles = "review cycles used %d" % data.review_cycles
    if limits:
        cycles += "/%d" % limits.max_review_cycles
        if data.review_cycles + 1 >= limits.max_review_cycles:
            cycles += " — a rejection now fails the task"
    # A parallel task is named: with several waiting, a plain `ferrus approve` refuses.
    named = " --task %s" % short_task_id(store.task) if store.task else ""
    parts.append("Approve: `ferrus approve%s` or /approve in HQ.  Reject: `ferrus reject%s "
                 "NOTES` or /reject NOTES in HQ: the executor gets your notes (%s)."
                 % (named, named, cycles))
    return "\n\n".join(parts)


def op_respond_consult(store, caller, response):
    _nonblank(response, "Consultation response cannot be empty.")
    with store.transaction(caller.agent_id) as tx:
        if tx.state.state != S.CONSULTATION:
            raise FerrusError("Cannot respond to consultation from state %s. /respond_consult is "
                              "only valid in Consultation state." % tx.state.state)
        tx.write("CONSULT_RESPONSE.md", response)
        # The entry carries the answer's first lines: the waiting executor empties the
        # file at once (finish_consult), often before HQ or `ferrus run` reads it.
        lines = [line.rstrip()[:160] for line in response.splitlines() if line.strip()]
        tx.set(tx.state, "respond_consult", said=lines[:8] + (
            ["… (%d more lines)" % (len(lines) - 8)] if len(lines) > 8 else []))
    return _outcome("Consultation response recorded in `.ferrus/CONSULT_RESPONSE.md`.",
                    S.CONSULTATION)


def op_create_spec(store, caller, markdown):
    _nonblank(markdown, "Cannot create spec: markdown content is empty.")
    config = store.config()
    try:
        directory = spec_directory(store.root, config)
    except FerrusError as err:
        raise FerrusError("Cannot create spec: " + err.message, err.hint) from err
    os.makedirs(directory, exist_ok=True)
    stem = "%s-%s" % (store.clock().strftime("%Y-%m-%d"), slugify(spec_title(markdown)))
    text = markdown if markdown.endswith("\n") else markdown + "\n"
    # Claim a unique name with exclusive create, then fill it atomically.
    for number in range(1, 10000):
        name = "%s.md" % stem if number == 1 else "%s-%d.md" % (stem, number)
        path = os.path.join(directory, name)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            break
        except FileExistsError:
            continue
    else:
        raise FerrusError("Cannot create spec: %s already holds 9999 specs named %s-*.md"
                          % (directory, stem), "rename or archive some of them")
    try:
        atomic_write(path, text)
    except BaseException:
        # Never leave the empty placeholder behind a failed write.
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    rel = os.path.relpath(path, store.root).replace(os.sep, "/")
    milestone = first_ready_milestone(parse_spec(text))
    with store.transaction(caller.agent_id) as tx:
        data = tx.state.copy()
        tx.write("LAST_SPEC_PATH", rel)
        # Changing the selection under a running task would retarget it (see
        # ARCHITECTURE.md, 'Differences from upstream ferrus', item 16), so mid-task
        # the spec is saved but not selected.
        selectable = data.state in (S.IDLE, S.COMPLETE, S.FAILED)
        if selectable:
            data.selected_spec = rel
            data.selected_milestone = milestone.id if milestone else None
        tx.set(data, "create_spec", path=rel, selected=selectable)
    if not selectable:
        text = ("Spec created at %s. It was not selected because a task is in progress (state %s); "
                "select it with /milestones when the task ends." % (rel, data.state))
    elif milestone:
        text = "Spec created at %s. Selected milestone: %s." % (rel, milestone.id)
    else:
        text = "Spec created at %s. No incomplete milestone selected." % rel
    return _outcome(text, data.state, path=rel,
                    selected_milestone=milestone.id if milestone and selectable else None)


def op_select_milestone(store, caller, spec_path, milestone_id=None):
    """Select a spec and one of its milestones (the first ready one by default)."""
    full = os.path.join(store.root, spec_path)
    if not os.path.isfile(full):
        raise FerrusError("spec %s does not exist" % spec_path)
    milestones = parse_spec(read_text(full))
    if milestone_id is None:
        chosen = first_ready_milestone(milestones)
    else:
        chosen = next((m for m in milestones if m.id == milestone_id), None)
        if chosen is None:
            raise FerrusError("milestone %s is not in %s" % (milestone_id, spec_path),
                              "ids: " + ", ".join(m.id for m in milestones))
    rel = os.path.relpath(full, store.root).replace(os.sep, "/")
    with store.transaction(caller.agent_id) as tx:
        data = tx.state.copy()
        data.selected_spec = rel
        data.selected_milestone = chosen.id if chosen else None
        tx.set(data, "select_milestone", spec=rel, milestone=data.selected_milestone)
    return _outcome("Selected %s, milestone %s." % (rel, data.selected_milestone or "(none left)"),
                    data.state)


def op_stage_task_origin(store, caller, spec_path=None, milestone_id=None):
    """Record which milestone the next create_task implements (HQ's /task, before the
    supervisor defines it), or forget it (both None)."""
    with store.transaction(caller.agent_id) as tx:
        data = tx.state.copy()
        if (data.pending_task_spec, data.pending_task_milestone) == (spec_path, milestone_id):
            return
        data.pending_task_spec, data.pending_task_milestone = spec_path, milestone_id
        tx.set(data, "stage_task_origin", spec=spec_path, milestone=milestone_id)


def find_milestone(store, wanted):
    """(spec path, spec text, milestone) for ``ferrus run --milestone``.

    ``wanted`` is a milestone id or marker, or "next": the selected milestone when it is
    still open, else the first ready one of the selected spec (or of the only spec).
    Returns None for "next" when every milestone is done; raises when nothing fits."""
    data = store.read_state()
    config = store.config()
    specs = list_spec_paths(store.root, config)
    if data.selected_spec:
        if not os.path.isfile(os.path.join(store.root, data.selected_spec)):
            raise FerrusError("the selected spec %s does not exist" % data.selected_spec,
                              "select another with /milestones in HQ")
        candidates = [data.selected_spec] + ([p for p in specs if p != data.selected_spec]
                                             if wanted != "next" else [])
    elif wanted != "next" or len(specs) == 1:
        candidates = specs
    elif not specs:
        raise FerrusError("there is no spec in %s" % config.spec.directory,
                          "write one with /spec in HQ, or by hand from the template in "
                          ".ferrus/SPEC_TEMPLATE.md (its milestones are `- [ ] #1.0 …` lines "
                          "with `ID:` and `Depends on:`), then run again")
    else:
        raise FerrusError("no spec is selected and %s holds %d specs" % (
            config.spec.directory, len(specs)), "select one with /milestones in HQ")
    for path in candidates:
        text = read_text(os.path.join(store.root, path))
        milestones = parse_spec(text)
        if wanted == "next":
            chosen = None
            if path == data.selected_spec and data.selected_milestone:
                chosen = next((m for m in milestones if m.id == data.selected_milestone
                               and not m.completed and dependencies_met(m, milestones)), None)
            chosen = chosen or first_ready_milestone(milestones)
            if chosen is None:
                blocked = [m for m in milestones if not m.completed]
                if blocked:
                    raise FerrusError(
                        "no milestone of %s is ready: %s" % (path, "; ".join(
                            "%s waits for %s" % (m.marker, ", ".join(
                                unmet_dependencies(m, milestones))) for m in blocked)),
                        "fix the `Depends on:` lines of %s" % path)
                return None
        else:
            chosen = next((m for m in milestones if wanted in (m.id, m.marker)), None)
            if chosen is None:
                continue
            if chosen.completed:
                raise FerrusError("milestone %s of %s is already complete" % (wanted, path),
                                  "untick its box in the spec to do it again")
            waits = unmet_dependencies(chosen, milestones)
            if waits:
                raise FerrusError("milestone %s of %s depends on %s, not complete yet" % (
                    wanted, path, ", ".join(waits)), "run `ferrus run --milestone next`")
        return path, text, chosen
    raise FerrusError("no milestone %s in %s" % (wanted, ", ".join(candidates) or "any spec"),
                      "`ferrus run --milestone next` takes the next ready one")


def op_clear_selection(store, caller):
    with store.transaction(caller.agent_id) as tx:
        data = tx.state.copy()
        data.selected_spec = data.selected_milestone = None
        tx.set(data, "clear_selection")
    return _outcome("Spec selection cleared.", data.state)


# -- waiting ------------------------------------------------------------------

class _Waiter:
    """The budget and the progress cadence shared by every wait_* operation."""

    PROGRESS_EVERY = 5.0

    def __init__(self, store, caller, timeout=None):
        self.store = store
        self.caller = caller
        budget = store.config().limits.wait_timeout_secs if timeout is None else timeout
        self.started = time.monotonic()
        self.deadline = self.started + budget
        self.next_progress = self.started + self.PROGRESS_EVERY

    def cancelled(self):
        return self.caller.cancel is not None and self.caller.cancel.is_set()

    def pause(self, stamp, what, wake_after=None):
        """Wait for the next commit (or ``wake_after`` seconds, e.g. until a foreign
        lease expires, which commits nothing); False once the budget is spent or the
        call is cancelled."""
        wake_at = None if wake_after is None else time.monotonic() + max(0.0, wake_after)
        while True:
            now = time.monotonic()
            if self.cancelled() or now >= self.deadline:
                return False
            if wake_at is not None and now >= wake_at:
                return True
            slice_end = min(self.deadline, self.next_progress, wake_at or self.deadline)
            if self.store.wait_for_change(stamp, slice_end, self.caller.cancel):
                return True
            if time.monotonic() >= self.next_progress:
                self.next_progress += self.PROGRESS_EVERY
                if self.caller.progress:
                    self.caller.progress("waiting for %s (%.0f s)" % (
                        what, time.monotonic() - self.started))

    def timeout(self, state):
        return _json_outcome({"status": "timeout", "state": state.value})


def _wait_and_claim(store, caller, claimable, build, what):
    waiter = _Waiter(store, caller)
    ttl = store.config().lease.ttl_secs
    while True:
        stamp = store.state_stamp()
        with store.transaction(caller.agent_id) as tx:
            data = tx.state
            now = store.clock()
            live = store.lease_seconds_left(data) > 0
            # A cancelled call never claims: its caller will never hear that it holds
            # the task (checked under the lock, as the cancel may land mid-pause).
            if waiter.cancelled():
                return waiter.timeout(data.state)
            if data.state in claimable and (not live or data.claimed_by == caller.agent_id):
                renewing = data.claimed_by == caller.agent_id and live
                # Re-entry renews the lease too (upstream did not: see
                # ARCHITECTURE.md, 'Differences from upstream ferrus', item 7).
                tx.set(claim(data, caller.agent_id, now, ttl), "claim",
                       agent=caller.agent_id, renewed=renewing)
        if tx.committed:
            store.lease_seconds_left(tx.state)      # the new lease is seen from now on
            return _json_outcome(build(tx.state))
        lease_left = None
        if data.state in claimable and live:
            # Wake when the foreign lease runs out by our monotonic count.
            lease_left = store.lease_seconds_left(data) + 0.001
        if not waiter.pause(stamp, what, lease_left):
            return waiter.timeout(data.state)


def op_wait_for_task(store, caller):
    def build(data):
        return {"status": "claimed", "claimed_by": data.claimed_by, "lease_until": data.lease_until,
                "state": data.state.value, "task": store.read_file("TASK.md"),
                "review": store.read_file("REVIEW.md"), "task_id": data.task_id,
                "heartbeat_interval_secs": store.config().lease.heartbeat_interval_secs}
    return _wait_and_claim(store, caller, WORK_STATES, build, "a task")


# The changed files wait_for_review lists, bounded as its diff is: the stat shows as many
# (TaskDiff.stat_text), ferrus://diff has them all.
REVIEW_FILES_MAX = 500
REVIEW_FILES_BYTES = 64 * 1024


def review_file_list(files, max_files=REVIEW_FILES_MAX, max_bytes=REVIEW_FILES_BYTES):
    """The first of ``files`` (ChangedFile.to_json dicts) that fit ``max_files`` entries
    and ``max_bytes`` of JSON: 30,000 changed files made a 5.7 MB answer."""
    listed, size = [], 2
    for entry in files[:max_files]:
        size += len(json.dumps(entry, ensure_ascii=False)) + 2
        if size > max_bytes:
            break
        listed.append(entry)
    return listed


def op_wait_for_review(store, caller):
    def build(data):
        # After the claim, outside the lock: git may take a moment.
        diff_text, changed_files = review_diff(store, store.read_file("SUBMISSION.md"))
        listed = review_file_list(changed_files)
        return {"status": "claimed", "claimed_by": data.claimed_by, "lease_until": data.lease_until,
                "state": data.state.value, "task": store.read_file("TASK.md"),
                "submission": store.read_file("SUBMISSION.md"),
                "review": store.read_file("REVIEW.md"),
                "diff": diff_text, "changed_files": listed,
                "changed_files_total": len(changed_files),
                "review_cycles_used": data.review_cycles,
                "check_retries_used": data.check_retries, "task_id": data.task_id,
                "heartbeat_interval_secs": store.config().lease.heartbeat_interval_secs}
    return _wait_and_claim(store, caller, (S.REVIEWING,), build, "a submission")


def op_wait_for_consult(store, caller):
    data = store.read_state()
    if data.state != S.CONSULTATION and not (
            data.state == S.AWAITING_HUMAN and data.paused_state == S.CONSULTATION):
        raise FerrusError("Cannot wait for consultation from state %s. Call /consult first."
                          % data.state)
    waiter = _Waiter(store, caller)
    ttl = store.config().lease.ttl_secs
    while True:
        stamp = store.state_stamp()
        response = None
        with store.transaction(caller.agent_id) as tx:
            data = tx.state
            if data.state == S.CONSULTATION:
                response = tx.read("CONSULT_RESPONSE.md")
                if response.strip():
                    now = store.clock()
                    new = t_finish_consult(data, now)
                    if new.claimed_by:
                        new = claim(new, new.claimed_by, now, ttl)
                    tx.write("CONSULT_RESPONSE.md", "")
                    tx.write("CONSULT_REQUEST.md", "")
                    tx.set(new, "finish_consult")
            elif not (data.state == S.AWAITING_HUMAN and data.paused_state == S.CONSULTATION):
                raise FerrusError("The consultation ended without a response: the state is now %s."
                                  % data.state, "call /status to see where the task stands")
        if tx.committed:
            text = response.strip()
            return Outcome(text, {"status": "responded", "response": text,
                                  "state": tx.state.state.value, "message": text})
        if not waiter.pause(stamp, "the consultation response"):
            return waiter.timeout(data.state)


def op_wait_for_answer(store, caller):
    waiter = _Waiter(store, caller)
    ttl = store.config().lease.ttl_secs
    first = True
    while True:
        stamp = store.state_stamp()
        answer = None
        with store.transaction(caller.agent_id) as tx:
            data = tx.state
            now = store.clock()
            pending = tx.read("ANSWER.md")
            if data.state == S.AWAITING_HUMAN and pending.strip():
                # Someone wrote ANSWER.md by hand (or upstream HQ did): apply it here.
                data = t_answer(data, now)
            if data.state != S.AWAITING_HUMAN and pending.strip():
                # The single consumer of an answer: it is cleared in this transaction,
                # so no second caller can read it (see
                # ARCHITECTURE.md, 'Differences from upstream ferrus', item 5).
                answer = pending.strip()
                if data.claimed_by == caller.agent_id:
                    data = claim(data, caller.agent_id, now, ttl)
                tx.write("ANSWER.md", "")
                tx.write("QUESTION.md", "")
                tx.set(data, "consume_answer")
            elif data.state != S.AWAITING_HUMAN and first:
                raise FerrusError("No question is pending (state %s), so there is no answer to "
                                  "wait for." % data.state, "call /ask_human first")
        first = False
        if answer is not None:
            return _json_outcome({"status": "answered", "answer": answer,
                                  "resumed_state": tx.state.state.value})
        if not waiter.pause(stamp, "the human's answer"):
            return waiter.timeout(data.state)


# -- executor -------------------------------------------------------------------

def _run_gate(store, caller, action):
    """Run the check gate for ``action`` (check or submit) without holding the lock.

    Returns (snapshot, run, config); run is None when no commands are configured."""
    data = store.read_state()
    if data.state not in WORK_STATES:
        if action == "check":
            raise FerrusError("Cannot run checks from state %s. Checks are only valid in Executing "
                              "or Addressing state." % data.state)
        raise FerrusError("Cannot submit from state %s. Submit is only valid from Executing or "
                          "Addressing after the implementation is ready." % data.state)
    _guard_lease(store, data, caller, action)
    config = store.config()
    if not config.checks.commands:
        return data, None, config
    run = run_checks(store.workdir, config.checks, store.path("logs"), data.check_retries + 1,
                     config.limits.max_feedback_lines, caller.cancel, store.root)
    if run.cancelled:
        raise FerrusError("The check run was cancelled; the state is unchanged.")
    return data, run, config


def _same_task(store, tx, snapshot, caller, action):
    """Apply a gate result only to the task, state and lease it was run for (see
    ARCHITECTURE.md, 'Differences from upstream ferrus', item 2)."""
    current = tx.state
    if current.task_id != snapshot.task_id or current.state != snapshot.state:
        raise FerrusError(
            "The state moved from %s to %s while the checks ran, so their result was discarded "
            "and nothing was written." % (snapshot.state, current.state),
            "call /status, then /wait_for_task if there is still work to do")
    _guard_lease(store, current, caller, action)


# The agents' messages for the check gate (upstream's wording), by action and result.
GATE_TEXTS = {
    "check": {
        "none": "All checks passed. Warning: no check commands are configured in ferrus.toml. "
                "State remains unchanged.",
        "pass": "All checks passed. State remains %(state)s. Continue working or call /submit "
                "when the task is ready for review.",
        "fail": "Checks failed (retry %(retries)d/%(max)d).\n\n%(report)s\n\nState remains "
                "%(state)s. Fix the issues and call /check again.",
        "limit": "Check retry limit reached (%(retries)d/%(max)d).\n\n%(report)s\n\nState is "
                 "now Failed. A human must call /reset to recover.",
    },
    "submit": {
        "none": "Submitted for review. Warning: no check commands are configured in ferrus.toml, "
                "so the final check gate was treated as a pass. State: Reviewing.",
        "pass": "Submitted for review. State: Reviewing. The Supervisor can now call "
                "/review_pending.",
        "fail": "Final review gate failed during /submit (retry %(retries)d/%(max)d).\n\n"
                "%(report)s\n\nState remains %(state)s. Fix the issues and run /check or /submit "
                "again.",
        "limit": "Final review gate failed during /submit and hit the retry limit "
                 "(%(retries)d/%(max)d).\n\n%(report)s\n\nState is now Failed. A human must "
                 "call /reset to recover.",
    },
}


def _gate_operation(store, caller, action, content=None):
    """check and submit: run the gate unlocked, then apply its result in a transaction."""
    snapshot, run, config = _run_gate(store, caller, action)
    limits = config.limits
    passed = run is None or run.passed
    with store.transaction(caller.agent_id) as tx:
        now = store.clock()
        _same_task(store, tx, snapshot, caller, action)
        log_path = run.log_path if run else None
        if passed and action == "submit":
            tx.write("SUBMISSION.md", content)
            tx.set(t_submit(t_check_passed(tx.state, now), now), "submit", log=log_path)
        elif passed:
            tx.set(t_check_passed(tx.state, now), "check_passed", log=log_path)
        else:
            tx.set(t_check_failed(tx.state, now, run.failure_reason(), limits.max_check_retries),
                   "check_failed", log=log_path, failed=[r.command for r in run.failed])
            tx.detail["retries"] = tx.state.check_retries
            if action == "submit":
                tx.detail["during"] = "submit"
        if run is not None:
            # Each command's result, so whoever reads the journal can show the run.
            tx.detail["checks"] = [check_summary(result) for result in run.results]
    new = tx.state
    kind = ("none" if run is None else "pass" if passed else
            "limit" if new.state == S.FAILED else "fail")
    text = GATE_TEXTS[action][kind] % {
        "state": new.state, "retries": new.check_retries, "max": limits.max_check_retries,
        "report": "" if passed else run.report(limits.max_feedback_lines)}
    if passed:
        return _outcome(text, new.state, passed=True, log=run.log_path if run else None)
    return _outcome(text, new.state, passed=False, log=run.log_path,
                    check_retries=new.check_retries)


def check_summary(result):
    """One command's result as the journal keeps it (its output is in its log)."""
    return {"command": result.command, "status": result.status, "exit": result.exit_code,
            "secs": round(result.duration, 2), "log": result.log_path}


def op_check(store, caller):
    return _gate_operation(store, caller, "check")


def op_submit(store, caller, content):
    return _gate_operation(store, caller, "submit", content)


CONSULT_HEADINGS = ("## Problem", "## What I tried", "## Options (if any)", "## Question")


def op_consult(store, caller, question):
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state not in WORK_STATES:
            raise FerrusError("Cannot consult from state %s. Consultation is only available while "
                              "executing work." % data.state)
        _guard_lease(store, data, caller, "consult")
        missing = [h for h in CONSULT_HEADINGS if h not in (question or "")]
        if missing:
            raise FerrusError("The consultation request must follow the template; it lacks %s."
                              % ", ".join(missing),
                              "read ferrus://consult_template and fill in every heading")
        tx.write("CONSULT_REQUEST.md", question)
        tx.write("CONSULT_RESPONSE.md", "")
        paused = data.state
        tx.set(t_consult(data, store.clock()), "consult")
    text = ("Consultation request written to `.ferrus/CONSULT_REQUEST.md`.\n"
            "State is now Consultation (paused from %s).\n"
            "HQ will start the Supervisor in consultation mode to answer it.\n"
            "Call /wait_for_consult now to receive the response." % paused)
    return _outcome(text, S.CONSULTATION, paused_state=paused.value)


# -- shared -----------------------------------------------------------------------

def op_ask_human(store, caller, question):
    _nonblank(question, "Cannot ask a human: the question is empty.")
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state not in ALLOWED_FROM["ask_human"]:
            raise TransitionError("ask_human", data.state)
        tx.write("QUESTION.md", question)
        tx.write("ANSWER.md", "")
        paused = data.state
        tx.set(t_ask_human(data, store.clock(), caller.agent_id), "ask_human",
               asked_by=caller.agent_id)
    text = ("Question written to `.ferrus/QUESTION.md`.\n"
            "State is now AwaitingHuman (paused from %s).\n"
            "Call /wait_for_answer immediately and keep calling it until it returns the answer.\n"
            "Do NOT call other tools while the question is open." % paused)
    return _outcome(text, S.AWAITING_HUMAN, paused_state=paused.value)


def op_answer(store, caller, response):
    _nonblank(response, "Cannot answer: the response is empty.")
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state != S.AWAITING_HUMAN:
            raise FerrusError("Cannot answer from state %s. /answer is only valid in AwaitingHuman "
                              "state." % data.state)
        new = t_answer(data, store.clock())
        tx.write("ANSWER.md", response)
        tx.set(new, "answer", asked_by=data.question_from)
    return _outcome("Response recorded in `.ferrus/ANSWER.md`. State restored to %s. The agent can "
                    "read the answer and continue." % new.state, new.state)


def op_status(store, caller=None):
    data = store.read_state()
    now = store.clock()
    lines = ["**State:** %s" % data.state, "**Check retries:** %d" % data.check_retries,
             "**Review cycles:** %d" % data.review_cycles]
    if data.failure_reason:
        lines.append("**Failure reason:** %s" % data.failure_reason)
    if data.task_id:
        lines.append("**Task:** %s" % data.task_id)
    if store.lease_live(data):
        lines.append("**Lease:** %s until %s" % (data.claimed_by, data.lease_until))
    if data.state == S.AWAITING_CONFIRMATION:
        lines.append("**Waiting for:** a human to confirm or reject the reviewer's approval "
                     "(no agent can); nothing for agents to do until then.")
    return Outcome("\n".join(lines), status_data(store, data, now))


def status_data(store, data, now):
    """Everything `ferrus status --json` and the status tool report."""
    entered = data.state_entered_at
    seconds_in_state = None
    if entered:
        with contextlib.suppress(ValueError):
            seconds_in_state = max(0.0, (now - parse_timestamp(entered)).total_seconds())
    return {"state": data.state.value, "task_id": data.task_id,
            "check_retries": data.check_retries, "review_cycles": data.review_cycles,
            "failure_reason": data.failure_reason, "paused_state":
                data.paused_state.value if data.paused_state else None,
            "claimed_by": data.claimed_by if store.lease_live(data) else None,
            "lease_until": data.lease_until if store.lease_live(data) else None,
            "state_entered_at": entered, "seconds_in_state": seconds_in_state,
            "task_started_at": data.task_started_at,
            "selected_spec": data.selected_spec, "selected_milestone": data.selected_milestone,
            "rev": data.rev, "capacity": capacity_status(store, data),
            "git_commit": data.task_commit, "message": None}


def capacity_status(store, data):
    """The capacity tier as the last gate decision left it (None when no limit is set)."""
    with contextlib.suppress(FerrusError):
        if not store.config().capacity.enabled():
            return None
    checkpoint = data.extra.get("capacity_checkpoint")
    if checkpoint:
        return {"tier": checkpoint.get("tier"), "action": checkpoint.get("action"),
                "signal": checkpoint.get("signal"), "checkpoint": True}
    # The newest gate decision among the last 500 entries, read from the journal's end.
    for entry in itertools.islice(store.journal_entries_backwards(), 500):
        if entry.get("event") == "gate":
            detail = entry.get("detail") or {}
            return {"tier": detail.get("tier"), "action": detail.get("action"),
                    "signal": detail.get("signal"), "checkpoint": False}
    return {"tier": GREEN, "action": CONTINUE, "signal": None, "checkpoint": False}


def op_reset(store, caller):
    """The agents' escape hatch: Failed → Idle (supervisor only)."""
    with store.transaction(caller.agent_id) as tx:
        if tx.state.state != S.FAILED:
            raise FerrusError("Cannot reset from state %s. Reset is only available in the Failed "
                              "state." % tx.state.state)
        tx.set(t_reset(tx.state, store.clock()), "reset")
        for name in ("REVIEW.md", "SUBMISSION.md", "CONSULT_REQUEST.md",
                     "CONSULT_RESPONSE.md") + _approval_file_if_any(store):
            tx.write(name, "")
    return _outcome("State reset to Idle. REVIEW.md, SUBMISSION.md, and consultation files "
                    "cleared. Ready for a new task.", S.IDLE)


def kept_changes_note(store, data):
    """What a reset leaves in git — it never discards work: the task's uncommitted
    changes (they stay in the work tree) and the task's branch (HEAD stays on it).
    "" when there is nothing to say (no task, no git, no changes)."""
    base = data.task_base or {}
    if not data.task_id or not base.get("git"):
        return ""
    notes = []
    with contextlib.suppress(FerrusError):
        files = task_diff(store.workdir, None, task_diff_exclusions(store), patch=False).files
        if files:
            notes.append("Uncommitted changes are kept: %d file%s in the work tree %s "
                         "from HEAD (`git status` shows them). To drop them, see \"Dropping "
                         "a task's changes\" in docs/REFERENCE.md."
                         % (len(files), "" if len(files) == 1 else "s",
                            "differs" if len(files) == 1 else "differ"))
    if base.get("task_branch"):
        notes.append("HEAD stays on the task's branch %s; `%s` goes back (uncommitted "
                     "changes come along)." % (
                         base["task_branch"], "git switch " + base["from_branch"]
                         if base.get("from_branch") else "git checkout --detach %s"
                         % (base.get("commit") or "")[:12]))
    return "\n".join(notes)


def op_force_reset(store, caller):
    """The human's reset: any state → Idle, task files cleared, selection kept.  Nothing
    in the work tree or in git changes (see kept_changes_note)."""
    kept = kept_changes_note(store, store.read_state())
    with store.transaction(caller.agent_id) as tx:
        previous = tx.state.state
        tx.set(t_force_reset(tx.state, store.clock()), "force_reset", previous=previous.value)
        for name in ("TASK.md",) + TASK_SCRATCH_FILES + _approval_file_if_any(store):
            tx.write(name, "")
        agents_path = store.path("agents.json")
        if os.path.isfile(agents_path):
            with contextlib.suppress(ValueError, OSError):
                registry = json.loads(read_text(agents_path))
                for entry in registry.get("agents", []):
                    if entry.get("status") == "running":
                        entry["status"], entry["pid"] = "suspended", None
                tx.write("agents.json", pretty_json(registry))
    return _outcome("State reset to Idle from %s. Task files cleared; the spec selection is kept."
                    % previous + ("\n" + kept if kept else ""), S.IDLE,
                    previous_state=previous.value)


def op_rotate_journal(store, caller):
    """Move events.jsonl aside now (it also happens by itself at the size limit)."""
    with store.transaction(caller.agent_id) as tx:
        tx.set(tx.state, "journal_rotated", archive=JOURNAL_ARCHIVE_FILE)
        tx.rotate_journal = True
    seq = tx.committed.seq
    if not tx.rotated_journal:
        return _outcome("%s/%s was empty, or could not be renamed (Windows: another process has "
                        "it open); entry #%d "
                        "records the attempt." % (FERRUS_DIR, JOURNAL_FILE, seq),
                        tx.state.state, seq=seq, rotated=False)
    return _outcome("%s/%s moved to %s/%s (replacing the older archive); the new %s starts "
                    "with entry #%d." % (FERRUS_DIR, JOURNAL_FILE, FERRUS_DIR,
                                         JOURNAL_ARCHIVE_FILE, JOURNAL_FILE, seq),
                    tx.state.state, seq=seq, rotated=True)


def op_heartbeat(store, caller, agent_id=None):
    """Renew the caller's own lease.  The identity is the server's, not an argument."""
    def error(code, message):
        return _json_outcome({"status": "error", "code": code, "message": message})
    # The agent may name itself without its session; the lease is still renewed only
    # for this server's own identity, session included.
    if agent_id and agent_id not in (caller.agent_id, caller.agent_id.partition("/")[0]):
        # Upstream trusted the argument, so any client could renew any lease (see
        # ARCHITECTURE.md, 'Differences from upstream ferrus', item 7).
        return error("foreign_id", "This server acts as %s and cannot renew a lease for %s"
                     % (caller.agent_id, agent_id))
    ttl = store.config().lease.ttl_secs
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        now = store.clock()
        if data.claimed_by != caller.agent_id:
            if data.claimed_by is None:
                return error("not_claimed", "No active lease exists")
            return error("claimed_by_other", "Lease is held by %s" % data.claimed_by)
        if not store.lease_live(data):
            return error("expired", "Your lease expired before renewal")
        if data.state not in ALLOWED_FROM["heartbeat"]:
            return error("invalid_state", "State %s cannot hold a lease" % data.state)
        tx.set(claim(data, caller.agent_id, now, ttl), "heartbeat")
    store.lease_seconds_left(tx.state)              # the renewed lease is seen from now on
    return _json_outcome({"status": "renewed", "claimed_by": tx.state.claimed_by,
                          "lease_until": tx.state.lease_until})


def lease_session(agent_id):
    """The agent session a lease holder id names (``<role>:<agent>:<index>/<session>``)."""
    return agent_id.rpartition("/")[2] if agent_id and "/" in agent_id else None


def op_release_sessions(store, sessions):
    """Free the lease when one of ``sessions`` (stopped agent sessions) holds it.

    Returns the holder whose lease was freed, or None."""
    with store.transaction("hq") as tx:
        data = tx.state
        if data.claimed_by and lease_session(data.claimed_by) in sessions:
            tx.set(clear_lease(data), "lease_released", holder=data.claimed_by,
                   reason="its agent session was stopped")
            return data.claimed_by
    return None


def op_run_checks_only(store, cancel=None):
    """`ferrus check --force`: run the gate and report, changing no state."""
    config = store.config()
    if not config.checks.commands:
        return None, config
    return run_checks(store.workdir, config.checks, store.path("logs"), 0,
                      config.limits.max_feedback_lines, cancel, store.root), config


def op_integrated(store, caller, **detail):
    """Integrating → Complete: the merge queue fast-forwarded the target branch to the
    task's work, with the checks green on that very commit."""
    with store.transaction(caller.agent_id) as tx:
        tx.set(t_integrated(tx.state, store.clock()), "integrated", **detail)
    return _outcome("Task integrated. State: Complete.", S.COMPLETE, **detail)


def merge_unless_cancelled(store, task, move, caller, **detail):
    """The merge queue's last step, made mutually exclusive with op_cancel_task: under the
    project lock the task is read again; one cancelled meanwhile (its record cancelled,
    its state Idle) is not merged — ``move`` is not called and the target stays where it
    is.  Else ``move()`` moves the target (it returns the commit the target is now at, or
    None when it did not move it) and the task becomes Complete in the same transaction,
    so a cancel waiting for the lock finds it merged.  ``store`` is the project's.

    Returns (CANCELLED_STATUS, None) when the cancel came first, (MERGED_STATUS, commit)
    when the merge did, and (None, None) when ``move`` did not move the target."""
    with store.for_task(task).transaction(caller.agent_id) as tx:
        # A damaged record raises: what it said is unknown, so nothing is merged for it.
        if record_for_update(store, task).get("status") == CANCELLED_STATUS or \
                tx.state.state == S.IDLE:
            return CANCELLED_STATUS, None
        head = move()
        if not head:
            return None, None
        tx.set(t_integrated(tx.state, store.clock()), "integrated", commit=head[:12],
               **detail)
    return MERGED_STATUS, head


def op_integration_failed(store, caller, notes, onto=None, **detail):
    """Integrating → Addressing (or Failed at max_review_cycles): a conflict with the
    target branch or a red check on the merged result, told to the executor as review
    notes.  It counts as a review cycle.  ``onto``: the target head the task's branch
    was left on, its diff's base from now on (see t_integration_failed)."""
    limits = store.config().limits
    if onto:
        detail["onto"] = onto[:12]
    with store.transaction(caller.agent_id) as tx:
        new = t_integration_failed(tx.state, store.clock(), limits.max_review_cycles,
                                   onto)
        tx.write("REVIEW.md", notes)
        tx.set(new, "integration_failed", **detail)
    return _outcome("Integration failed. State: %s." % new.state, new.state, **detail)


# -- the task queue (ARCHITECTURE.md, 'Parallel tasks') ------------------------------------
#
# `ferrus task add`, the supervisor's enqueue_task and HQ's /task add put a task in the
# queue: .ferrus/tasks/<id>/ with its TASK.md and task.json (title, origin, status, and
# once it runs, its worktree and branch).  The orchestrator takes queued tasks in order;
# with [parallel] max_tasks = 1 it runs each as the project's own task, in the checkout,
# exactly as `ferrus run --task` does; with more, each in its own worktree, with its own
# STATE.json beside its task.json.

TASK_TITLE_CHARS = 72


def task_title(description):
    """A task's title: the first non-blank line of its description, shortened."""
    title = next((line.strip().lstrip("#").strip() for line in description.splitlines()
                  if line.strip().lstrip("#").strip()), "")
    return title[:TASK_TITLE_CHARS - 3].rstrip() + "..." if len(title) > TASK_TITLE_CHARS \
        else title


def queued_task_ids(store):
    """Every task of the queue, oldest first (ids start with their creation time)."""
    try:
        names = os.listdir(store.path(TASKS_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(name for name in names if _TASK_ID_RE.match(name)
                  and os.path.isfile(task_record_path(store.dir, name)))


_TASK_ID_RE = re.compile(r"^t-[0-9]{8}T[0-9]{6}-[0-9a-f]{6}$")


def queued_order(record):
    """Sort key of a task's record or task_rows row by when it was queued (timestamps
    compared as times, not as text: "10:00:00Z" is before "10:00:00.001Z")."""
    with contextlib.suppress(ValueError, TypeError):
        return parse_timestamp(record.get("created_at")).timestamp()
    return 0.0


def task_records(store):
    """[(task id, its task.json)] of the queue, oldest first: an id orders tasks only by
    the second they were queued in (then by its random end), so tasks queued within one
    second are ordered by their records' created_at.  A damaged record is {}."""
    return [(task, record) for task, record, _ in checked_task_records(store)]


def checked_task_records(store, tasks=None):
    """[(task id, its task.json or {}, what is wrong with it or None)] of the queue (or of
    the ``tasks`` given, in their order), oldest first as task_records."""
    if tasks is not None:
        return [(task,) + load_task_record(store.dir, task) for task in tasks]
    loaded = [(task,) + load_task_record(store.dir, task) for task in queued_task_ids(store)]
    return sorted(loaded, key=lambda item: (item[0][:17], queued_order(item[1])))


def require_task_id(store, task):
    """The id of the queue's task that ``task`` names — its whole id, or the end of it
    (at least 4 characters, as the task's lines show it: ``3fa2c1``) when only one task's
    id ends so — else a FerrusError that says what does."""
    known = queued_task_ids(store)
    if isinstance(task, str) and task in known:
        return task
    matches = [name for name in known if isinstance(task, str) and len(task) >= 4
               and name.endswith(task)]
    if len(matches) == 1:
        return matches[0]
    raise FerrusError("%s task %s in the queue" % ("more than one" if matches else "no",
                                                   str(task)[:80]),
                      "`ferrus tasks` lists them%s" % (
                          " (the newest is %s)" % known[-1] if known else ""))


def short_task_id(task):
    """What the lines of a parallel run show for a task: the random end of its id."""
    return task.rsplit("-", 1)[-1] if task else ""


def resolve_task_ref(store, ref):
    """The task id a command's ``--task`` names: ``current`` (the task in STATE.json), a
    task of the queue (its id or unique end), or any id a task of the checkout had."""
    if ref == "current":
        return store.read_state().task_id
    try:
        return require_task_id(store, ref)
    except FerrusError:
        if isinstance(ref, str) and _TASK_ID_RE.match(ref):
            return ref
        raise


def task_store_of(store, task):
    """The store holding the state of queue task ``task`` (its id or unique end): its
    own, or the project's for a task run in the checkout while it is the current one —
    else a FerrusError saying why there is none."""
    task = require_task_id(store, task)
    record = read_task_record(store.dir, task)
    if record.get("store") == "project":
        if store.project_state().task_id == task:
            return store
        raise FerrusError("task %s ran in the checkout and is no longer its current task"
                          % task, "`ferrus log --task %s` shows what happened to it"
                          % short_task_id(task))
    task_store = store.for_task(task)
    if not task_store.exists():
        raise FerrusError("task %s has not started yet (it is %s)" % (
            task, record.get("status") or QUEUED_STATUS),
            "`ferrus run --parallel N` starts the queue's tasks")
    return task_store


def foreground_task(store):
    """The parallel task the project's STATE.json mirrors (see ARCHITECTURE.md,
    'Parallel tasks'), or None while the file holds the checkout's own task."""
    task = store.project_state().extra.get(PARALLEL_MIRROR_KEY)
    if isinstance(task, str) and _TASK_ID_RE.match(task) and \
            os.path.isfile(task_record_path(store.dir, task)):
        return task
    return None


def foreground_store(store):
    """The store the plain views (`ferrus status`, `ferrus diff`, HQ's /status and /diff)
    read for the foreground task: the mirrored parallel task's own — its question, review
    and submission files, its worktree — else the project's.  The mirror copies only the
    state; reading the checkout's files for a parallel task would show another task's."""
    task = foreground_task(store)
    if task is None:
        return store
    task_store = store.for_task(task)
    return task_store if task_store.exists() else store


def diff_store_of(store, task):
    """The store whose diff shows queue task ``task``'s work, or a FerrusError saying why
    there is none to show: merged (its work is on the target, at its merged commit),
    not started, or its worktree gone."""
    record = read_task_record(store.dir, task)
    status = record.get("status")
    if status == MERGED_STATUS:
        merged = record.get("merged_commit") or ""
        raise FerrusError("task %s is merged%s%s; its worktree and branch were removed" % (
            short_task_id(task), " at %s" % merged[:12] if merged else "",
            " into %s" % record["target"] if record.get("target") else ""),
            "`git show %s` shows what it changed" % (merged[:12] or record.get("target")
                                                     or "HEAD"))
    if record.get("store") != "project" and not store.for_task(task).exists():
        raise FerrusError("task %s is %s: it has no work yet" % (
            short_task_id(task), status or "not started"),
            "`ferrus tasks` lists the tasks (/tasks in HQ)")
    task_store = task_store_of(store, task)
    if task_store is not store and not os.path.isdir(task_store.workdir):
        raise FerrusError("task %s's worktree %s is gone%s" % (
            short_task_id(task), task_store.workdir,
            " (it was cancelled)" if status == CANCELLED_STATUS else ""),
            "`ferrus log --task %s` shows what happened to it; `ferrus doctor` lists "
            "orphaned tasks and worktrees" % short_task_id(task))
    return task_store


def stores_awaiting_confirmation(store):
    """[(task id, store)] of every task waiting in AwaitingConfirmation for the human:
    the checkout's own task and each parallel task."""
    waiting = []
    project = store.project_state()
    if project.state == S.AWAITING_CONFIRMATION and not project.extra.get(PARALLEL_MIRROR_KEY):
        waiting.append((project.task_id, store))
    for task, record in task_records(store):
        if record.get("status") != RUNNING_STATUS or record.get("store") == "project":
            continue
        task_store = store.for_task(task)
        with contextlib.suppress(FerrusError):
            if task_store.exists() and task_store.read_state().state == \
                    S.AWAITING_CONFIRMATION:
                waiting.append((task, task_store))
    return waiting


def record_for_update(store, task):
    """Task ``task``'s record, to change and write back (holding the project lock); a
    damaged one raises TaskRecordDamaged: writing over it would lose what it still
    holds (doctor sets it aside and rebuilds it)."""
    record, problem = load_task_record(store.dir, task)
    if problem:
        raise TaskRecordDamaged(task, problem)
    return record


def write_task_record(store, task, record):
    """Replace a task's task.json; call it holding the project lock."""
    atomic_write(task_record_path(store.dir, task), pretty_json(record))


def update_task(store, caller, task, event, changes, only_from=None, **detail):
    """Change a task's task.json and journal ``event`` about it, in one transaction.
    With ``only_from`` (statuses) a task whose status is none of them is left as it is
    (None is returned): a cancel from another shell may have come first."""
    with store.transaction(caller.agent_id) as tx:
        record = record_for_update(store, task)
        if only_from is not None and record.get("status") not in only_from:
            return None
        record.update(changes)
        write_task_record(store, task, record)
        tx.set(tx.state, event, **detail)
        tx.journal_task_id = task
    return record


def _milestone_taken(store, spec, milestone):
    """The queued or running task that implements ``milestone`` of ``spec``, if any."""
    for task, record in task_records(store):
        origin = record.get("origin") or {}
        if record.get("status") in (QUEUED_STATUS, RUNNING_STATUS) and \
                origin.get("spec") == spec and \
                origin.get("milestone") == milestone:
            return task
    data = store.project_state()
    if data.state in ACTIVE_STATES and data.task_spec == spec and \
            data.task_milestone == milestone:
        return data.task_id
    return None


def op_enqueue_task(store, caller, description, spec=None, milestone=None, agent=None):
    """Put a task in the queue.  ``spec`` and ``milestone`` name the milestone it
    implements; ``agent`` the executor agent that should take it (a supervisor that
    splits a milestone as team lead names one; [parallel] delegates says which may)."""
    _nonblank(description, "Cannot queue the task: the description is empty.")
    require_utf8(description, "the task description")
    known = BUILTIN_AGENTS + tuple(store.config().agents.custom) if agent is not None else ()
    if agent is not None and agent not in known:
        raise FerrusError("Cannot queue the task: %r is not an agent ferrus knows" % agent,
                          "use one of %s" % ", ".join(known))
    if milestone is not None and spec is None:
        raise FerrusError("Cannot queue the task: a milestone needs its spec")
    store.require()
    task = new_id("t")
    origin = {"by": caller.agent_id}
    if spec is not None:
        origin["spec"] = spec
    if milestone is not None:
        origin["milestone"] = milestone
    if caller.is_agent and caller.role == "supervisor":
        # A supervisor that splits work into tasks acts as team lead: the delegation gate
        # checks where each of its tasks went.
        origin["delegated_by"] = caller.agent_id
    record = {"id": task, "title": task_title(description), "status": QUEUED_STATUS,
              "created_at": format_timestamp(store.clock()), "origin": origin}
    if agent is not None:
        record["agent"] = agent
    folder = store.path(TASKS_DIR, task)
    with store.transaction(caller.agent_id) as tx:
        # Checked again under the lock: two shells queuing one milestone get one task.
        taken = _milestone_taken(store, spec, milestone) if milestone is not None else None
        if taken:
            raise FerrusError("Cannot queue the task: milestone %s of %s is already task %s"
                              % (milestone, spec, taken), "`ferrus tasks` lists the queue")
        os.makedirs(folder, exist_ok=True)
        atomic_write(os.path.join(folder, "TASK.md"), description)
        write_task_record(store, task, record)
        tx.set(tx.state, "enqueue_task", title=record["title"],
               **{key: value for key, value in origin.items() if key != "by"})
        tx.journal_task_id = task
    return _outcome("Task %s queued: %s" % (task, record["title"]), None, task_id=task,
                    title=record["title"])


def op_enqueue_milestone(store, caller, spec, milestone_id):
    """Queue the task that implements one milestone (it must be ready: unchecked and
    every milestone it depends on done)."""
    path = os.path.join(store.root, spec)
    if not os.path.isfile(path):
        raise FerrusError("Cannot queue milestone %s: there is no spec %s" % (milestone_id, spec),
                          "`ferrus status` names the specs; paths are relative to the project")
    text = read_text(path)
    milestones = parse_spec(text)
    chosen = next((m for m in milestones if milestone_id in (m.id, m.marker)), None)
    if chosen is None:
        raise FerrusError("Cannot queue milestone %s: %s has no such milestone" % (
            milestone_id, spec), "its milestones are %s" % (
            ", ".join(m.id for m in milestones) or "none"))
    if chosen.completed:
        raise FerrusError("Cannot queue milestone %s: it is already complete" % chosen.id,
                          "untick its box in %s to do it again" % spec)
    waits = unmet_dependencies(chosen, milestones)
    if waits:
        raise FerrusError("Cannot queue milestone %s: it depends on %s, not complete yet" % (
            chosen.id, ", ".join(waits)), "queue what it depends on first")
    rel = os.path.relpath(path, store.root).replace(os.sep, "/")
    return op_enqueue_task(store, caller, milestone_task_text(rel, text, chosen), rel, chosen.id)


def op_enqueue_ready(store, caller, spec):
    """Queue every ready milestone of ``spec`` that no task implements yet."""
    path = os.path.join(store.root, spec)
    if not os.path.isfile(path):
        raise FerrusError("there is no spec %s" % spec, "paths are relative to the project")
    rel = os.path.relpath(path, store.root).replace(os.sep, "/")
    queued = []
    for milestone in parse_spec(read_text(path)):
        if not milestone.completed and not unmet_dependencies(
                milestone, parse_spec(read_text(path))) and \
                not _milestone_taken(store, rel, milestone.id):
            queued.append(op_enqueue_milestone(store, caller, rel, milestone.id).data["task_id"])
    if not queued:
        return _outcome("No milestone of %s is ready to queue (each is done, waits for "
                        "another, or is a task already)." % rel, None, queued=[])
    return _outcome("Queued %d task%s: %s" % (len(queued), "" if len(queued) == 1 else "s",
                                              ", ".join(queued)), None, queued=queued)


def _refuse_ended(task, record):
    if record.get("status") == MERGED_STATUS:
        _refuse_merged_first(task, record.get("target"), record.get("merged_commit"))
    if record.get("status") == DONE_STATUS:
        raise FerrusError("task %s is already done" % task,
                          "its work is in the checkout; nothing to cancel")


def _refuse_merged(store, task, record, data):
    """A cancel that comes after the merge (see merge_unless_cancelled) is refused and
    says so: the task is Complete, or the target is already at the commit the merge
    queue checked for it (its run stopped before it could record the merge)."""
    merged = data.state == S.COMPLETE
    candidate = (record.get("integration") or {}).get("candidate")
    target = record.get("target")
    if not merged and candidate and target and data.state == S.INTEGRATING:
        with contextlib.suppress(FerrusError):
            merged = target_head(store.root, target) == candidate
    if merged:
        _refuse_merged_first(task, target, candidate)


def _refuse_merged_first(task, target, commit):
    raise FerrusError(
        "task %s is already merged into %s%s: the merge came before this cancel, nothing "
        "was cancelled" % (task, target or "its target", " at %s" % commit[:12] if commit
                           else ""),
        "its work is on %s (`ferrus log --task %s` shows the merge); revert it there if it "
        "is not wanted" % (target or "the target branch", short_task_id(task)))


def op_cancel_task(store, caller, task, remove_worktree=False):
    """Take a task out of the queue, or stop a running one: it is never taken up again.
    The orchestrator running it stops its agents and removes its worktree and branch;
    with ``remove_worktree`` (no orchestrator will: none runs, or the task is not in its
    hands, as a failed task's kept worktree is not) they are removed here."""
    task = require_task_id(store, task)
    record = read_task_record(store.dir, task)      # read again under the lock below
    _refuse_ended(task, record)
    task_store = store.for_task(task)
    if record.get("status") == CANCELLED_STATUS:
        text = "Task %s was already cancelled." % task
    elif task_store.exists():
        with task_store.transaction(caller.agent_id) as tx:
            # Under the lock the merge queue's last step holds (merge_unless_cancelled):
            # either the merge came first and this cancel is refused, or the cancel comes
            # first and the target is never moved for this task.
            record = record_for_update(store, task)
            _refuse_ended(task, record)         # merged meanwhile, under our feet
            _refuse_merged(store, task, record, tx.state)
            integrating = tx.state.state == S.INTEGRATING
            new = t_force_reset(tx.state, store.clock())
            new.task_id = tx.state.task_id
            tx.set(new, "cancel_task")
            record.update(status=CANCELLED_STATUS, ended_at=format_timestamp(store.clock()))
            write_task_record(store, task, record)
        text = "Task %s cancelled%s." % (task, " before its merge: the target branch is not "
                                         "moved for it" if integrating else "")
    else:
        if record.get("store") == "project":
            data = store.project_state()
            if data.task_id == task and data.state in ACTIVE_STATES:
                op_force_reset(store, caller)
        if update_task(store, caller, task, "cancel_task",
                       {"status": CANCELLED_STATUS, "ended_at": format_timestamp(store.clock())},
                       only_from=(QUEUED_STATUS, RUNNING_STATUS, FAILED_STATUS)) is None:
            _refuse_ended(task, read_task_record(store.dir, task))
        text = "Task %s cancelled." % task
    removed = {}
    if remove_worktree:
        said, removed = _remove_task_leftovers(store, read_task_record(store.dir, task))
        text += said
    return _outcome(text, None, task_id=task, removed=removed)


# What a task's record says about one attempt at it: dropped when it is queued again.
_ATTEMPT_KEYS = ("reason", "ended_at", "integration", "merged_commit")


def op_retry_task(store, caller, task):
    """Put a failed (or cancelled) task back in the queue: the next `ferrus run` takes it
    up again.  A parallel task goes on in its kept worktree and branch, with the work done
    so far (its state is reset to Idle, so the run creates it afresh, Executing); one whose
    worktree is gone starts again from the target's head."""
    task = require_task_id(store, task)
    record = record_for_update(store, task)
    status = record.get("status") or QUEUED_STATUS
    if status in (MERGED_STATUS, DONE_STATUS):
        raise FerrusError("task %s is already %s" % (task, status),
                          "its work is on the target branch; `ferrus task add` queues "
                          "more work")
    if status not in (FAILED_STATUS, CANCELLED_STATUS):
        raise FerrusError("task %s is %s, not failed or cancelled: there is nothing to retry"
                          % (task, status), "`ferrus tasks` lists the tasks and their states")
    worktree = record.get("worktree")
    kept = bool(worktree) and os.path.isdir(worktree)

    def requeued():
        now = record_for_update(store, task)
        if now.get("status") != status:
            # Retried (or changed) by someone else since it was read: leave it be.
            raise FerrusError("task %s is %s now, not %s: someone else changed it" % (
                task, now.get("status"), status), "`ferrus tasks` shows where it stands")
        fresh = dict(now, status=QUEUED_STATUS)
        for key in _ATTEMPT_KEYS:
            fresh.pop(key, None)
        if fresh.get("store") == "project" or not kept:
            # Run in the checkout, or its worktree is gone: it starts as a new task.
            for key in ("store", "started_at", "worktree", "workdir", "branch", "base",
                        "target"):
                fresh.pop(key, None)
        return fresh
    task_store = store.for_task(task)
    detail = {"was": status, "worktree": worktree if kept else None}
    if task_store.exists():
        with task_store.transaction(caller.agent_id) as tx:
            new = t_force_reset(tx.state, store.clock())
            new.task_id = tx.state.task_id
            tx.set(new, "retry_task", **detail)
            tx.journal_task_id = task
            write_task_record(store, task, requeued())
    else:
        with store.transaction(caller.agent_id) as tx:
            write_task_record(store, task, requeued())
            tx.set(tx.state, "retry_task", **detail)
            tx.journal_task_id = task
    text = "Task %s is queued again%s." % (task, (
        "; it goes on in its kept worktree %s with the work done so far" % worktree)
        if kept and record.get("store") != "project" else "")
    return _outcome(text + " `ferrus run` (or HQ /run) takes it up.", None, task_id=task,
                    worktree=worktree if kept else None)


def _remove_task_leftovers(store, record):
    """(text, what was removed) for a cancelled task's worktree and branch."""
    worktree, branch = record.get("worktree"), record.get("branch")
    if record.get("store") == "project" or not worktree or not branch:
        return "", {}
    try:
        head = target_head(store.root, branch)
        done = remove_task_worktree(store.root, worktree, branch)
    except GitUnavailable:
        return "", {}
    except FerrusError as err:
        return (" Its worktree %s and branch %s stay: %s (`ferrus doctor --fix` removes them "
                "once that is fixed)." % (worktree, branch, err.message)), {}
    parts, removed = [], {}
    if done["removed"]:
        parts.append("its worktree %s" % worktree)
        removed["worktree"] = worktree
    if done["branch_deleted"]:
        parts.append("its branch %s (it was at %s: `git branch %s %s` brings it back)" % (
            branch, head[:12], branch, head[:12]) if head else "its branch %s" % branch)
        removed["branch"] = branch
    return (" Removed %s." % " and ".join(parts) if parts else ""), removed


def task_rows(store, tasks=None):
    """One dict per task of the queue for `ferrus tasks`, HQ's board and `ferrus status`:
    id, title, status, state, agent, worktree, branch, age, tokens, last event.  Only the
    ``tasks`` given (ids), when they are."""
    rows = []
    now = store.clock()
    project = store.project_state() if store.exists() else None
    for task, record, problem in checked_task_records(store, tasks):
        row = {"id": task, "title": (record.get("title") or "")[:TASK_TITLE_CHARS],
               "status": record.get("status"),
               "state": None, "agent": record.get("agent"),
               "worktree": record.get("worktree"), "branch": record.get("branch"),
               "origin": record.get("origin") or {}, "created_at": record.get("created_at"),
               "started_at": record.get("started_at"), "ended_at": record.get("ended_at")}
        task_store = store.for_task(task)
        data = None
        if record.get("store") == "project":
            data = project if project is not None and project.task_id == task else None
        elif os.path.isfile(task_store.task_path(STATE_FILE)):
            with contextlib.suppress(FerrusError):
                data = task_store.read_state()
        if data is not None:
            row["state"] = data.state.value
            row["review_cycles"] = data.review_cycles
            row["failure_reason"] = data.failure_reason
        with contextlib.suppress(ValueError, TypeError):
            row["age_secs"] = max(0.0, (now - parse_timestamp(record.get("created_at")))
                                  .total_seconds())
        if record.get("integration"):
            row["integration"] = record["integration"]
        if problem:
            # Said in every view of the queue (`ferrus tasks`, status, HQ's board), with
            # the repair.
            row["problem"] = problem
            row["title"] = "(its %s is damaged: %s; `ferrus doctor --fix` repairs it)" % (
                TASK_RECORD_FILE, problem)
        rows.append(row)
    return rows


# How far back the last event of each task is looked for: a bounded read of the journal's
# end, so a long journal costs what a short one does (an older task shows no last event).
TASK_EVENT_SCAN = 3000


def last_task_events(store, tasks, scan=TASK_EVENT_SCAN):
    """{task: its newest journal entry that tells what happened} for the ``tasks`` that
    have one among the journal's last ``scan`` entries (bookkeeping left out)."""
    wanted, found = set(tasks), {}
    for entry in itertools.islice(store.journal_entries_backwards(), scan):
        if len(found) == len(wanted):
            break
        task = entry.get("task_id")
        if task in wanted and task not in found and is_story(entry):
            found[task] = entry
    return found


def describe_task_event(entry, now=None):
    """A journal entry in a few words for a task's line: ``submit → Reviewing``,
    ``check passed``, ``task merged`` (and how long ago, given ``now``)."""
    if not entry:
        return "-"
    what = str(entry.get("event") or "?").replace("_", " ")
    if entry.get("from") != entry.get("to") and entry.get("to"):
        what += " → %s" % entry["to"]
    if now is not None:
        with contextlib.suppress(ValueError, TypeError):
            what += " (%s ago)" % format_duration(
                (now - parse_timestamp(entry.get("time"))).total_seconds())
    return what


def task_elapsed(row, now):
    """How long a task of task_rows has been at it: since it started (or was queued) until
    now or its end; None when its record has no usable time."""
    record_start = row.get("started_at") or row.get("created_at")
    try:
        start = parse_timestamp(record_start)
        end = parse_timestamp(row["ended_at"]) if row.get("ended_at") else now
    except (ValueError, TypeError):
        return None
    return max(0.0, (end - start).total_seconds())


DAMAGED_WORD = "damaged"     # a task whose task.json is damaged, in the views


def task_state_word(row):
    """A task's place in one word: its state while it runs, else its queue status."""
    if row.get("problem"):
        return DAMAGED_WORD
    return row["state"] if row.get("status") == RUNNING_STATUS and row.get("state") \
        else row.get("status") or "?"


# ============================================================================
# 13. MCP
# ============================================================================
#
# First a generic JSON-RPC 2.0 server on newline-delimited stdio, then the
# ferrus tools, resources and prompts, registered per role.

MCP_LEGACY_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
MCP_MODERN_VERSIONS = ("2026-07-28",)
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = (
    -32700, -32600, -32601, -32602, -32603)
RESOURCE_NOT_FOUND = -32002
UNSUPPORTED_PROTOCOL_VERSION = -32022
MCP_ALL_VERSIONS = MCP_MODERN_VERSIONS + MCP_LEGACY_VERSIONS
META_LOG_LEVEL = "io.modelcontextprotocol/logLevel"
# Versions whose base protocol requires servers to accept JSON-RPC batches.
BATCH_VERSIONS = ("2025-03-26",)
# Versions whose error schema requires an id, so an unreadable id is sent as null
# (JSON-RPC 2.0); from 2025-11-25 on the id is optional and left out instead.
NULL_ERROR_ID_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18")
# Legacy methods the 2026-07-28 revision removed: -32601 when a request is modern.
REMOVED_IN_MODERN = ("initialize", "ping", "logging/setLevel")


class RpcError(Exception):
    def __init__(self, code, message, data=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_json(self):
        error = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


@dataclasses.dataclass
class Request:
    """One JSON-RPC request as a handler sees it."""

    id: object
    method: str
    params: dict
    cancel: threading.Event
    modern: bool = False      # sent in the 2026-07-28 stateless era
    # Set by notifications/cancelled: the client no longer wants any answer.  An
    # EOF shutdown also sets ``cancel`` (to end waits) but still answers.
    abandoned: bool = False
    batched: bool = False     # an element of a JSON-RPC batch (2025-03-26)
    reply: object = None      # callable(response or None): where the answer goes
    lane: object = None       # the _Lane it was admitted to (None: run inline)

    @property
    def meta(self):
        meta = self.params.get("_meta")
        return meta if isinstance(meta, dict) else {}


class _Lane:
    """A bounded group of worker threads for one kind of request.

    At most ``max_workers`` requests of the lane run at once and at most
    ``max_queued`` more wait for a worker; a request beyond that is refused at
    once (never left unanswered).  Workers stay for the next request, so a
    quick call does not pay for starting a thread."""

    def __init__(self, name, max_workers, max_queued, lock):
        self.name = name
        self.max_workers = max_workers
        self.max_queued = max_queued
        self.pending = collections.deque()
        self.active = 0       # admitted and not finished (running or queued)
        self.threads = 0      # worker threads alive
        self.waiting = 0      # workers parked on ``ready`` and not yet handed a request
        self.ready = threading.Condition(lock)


_current_request = threading.local()   # the request a thread is handling (for logging)


class JsonRpcServer:
    """Newline-delimited JSON-RPC 2.0 over a pair of binary streams.

    The reader thread parses messages and answers cheap methods inline.  What
    ``lane_of(request)`` puts in a lane runs on that lane's bounded worker
    threads: long blocking calls ("blocking") have their own lane, so they can
    never starve quick calls ("quick") and neither can delay ``ping`` or a
    cancellation, which the reader answers itself.  A request its lane cannot
    take gets ``busy(request, lane)`` as its answer at once.  One lock
    serialises writes.

    ``protocol_version`` is the legacy version negotiated by initialize (None
    before); it decides whether JSON-RPC batches are accepted (2025-03-26 only)
    and how an error answers a message whose id is unknown."""

    MAX_BLOCKING = 8         # blocking calls running at once (each holds a thread; an agent
                             # needs one or two, and every one polls while it waits)
    MAX_QUICK_WORKERS = 4    # threads for quick calls
    MAX_QUICK_QUEUED = 256   # quick calls waiting for one of those threads

    def __init__(self, reader, writer):
        self.reader = reader
        self.writer = writer
        self.handlers = {}
        self.notification_handlers = {}
        self.lane_of = lambda request: None
        self.busy = self._default_busy
        self.protocol_version = None
        self._write_lock = threading.Lock()
        self._inflight = {}
        self._inflight_lock = threading.Lock()
        self._lanes = {
            "blocking": _Lane("blocking", self.MAX_BLOCKING, 0, self._inflight_lock),
            "quick": _Lane("quick", self.MAX_QUICK_WORKERS, self.MAX_QUICK_QUEUED,
                           self._inflight_lock)}
        self._workers = set()
        self.closed = threading.Event()

    # -- plumbing ------------------------------------------------------------------

    def send(self, message):
        try:
            text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
        except (RecursionError, ValueError):
            # A value echoed from the request is nested too deeply to serialise.
            if isinstance(message, list) or "id" not in message:
                return
            message = {"jsonrpc": "2.0", "id": message["id"], "error": {
                "code": INTERNAL_ERROR, "message": "the response is nested too deeply to send"}}
            text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
        try:
            data = (text + "\n").encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (from a "\ud800" escape in the request) has no UTF-8
            # form; ASCII escapes keep the line valid JSON and valid UTF-8.
            data = (json.dumps(message, separators=(",", ":")) + "\n").encode("ascii")
        with self._write_lock:
            try:
                self.writer.write(data)
                self.writer.flush()
            except (OSError, ValueError):
                self.closed.set()

    def notify(self, method, params):
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    def _send_reply(self, message):
        if message is not None:
            self.send(message)

    def _response(self, request_id, result=None, error=None):
        """A response message.  An error to a message whose id could not be read
        has no id in 2025-11-25 and later (JSONRPCErrorResponse makes it
        optional there) and ``"id": null`` before, as JSON-RPC 2.0 says."""
        message = {"jsonrpc": "2.0"}
        if request_id is not None or self.protocol_version in NULL_ERROR_ID_VERSIONS:
            message["id"] = request_id
        if error is not None:
            message["error"] = error.to_json()
        else:
            message["result"] = result
        return message

    def _respond(self, request_id, result=None, error=None, reply=None):
        (reply or self._send_reply)(self._response(request_id, result, error))

    def _read_line(self):
        """The next line, or None at EOF; an over-long line becomes an error marker."""
        line = self.reader.readline(MAX_MESSAGE_BYTES + 1)
        if not line:
            return None
        if len(line) > MAX_MESSAGE_BYTES and not line.endswith(b"\n"):
            while True:  # discard the rest of the oversized line
                rest = self.reader.readline(1024 * 1024)
                if not rest or rest.endswith(b"\n"):
                    break
            return b""
        return line

    def serve_forever(self):
        """Read until EOF, then cancel whatever is still running and return."""
        try:
            while not self.closed.is_set():
                line = self._read_line()
                if line is None:
                    break
                if line == b"":
                    self._respond(None, error=RpcError(
                        INVALID_REQUEST, "message larger than %d bytes" % MAX_MESSAGE_BYTES))
                    continue
                if line.strip():
                    self._handle_line(line)
        finally:
            self.shutdown()

    def shutdown(self, wait=5.0):
        self.closed.set()
        with self._inflight_lock:
            for request in self._inflight.values():
                request.cancel.set()
            for lane in self._lanes.values():
                lane.waiting = 0
                lane.ready.notify_all()
            workers = list(self._workers)
        deadline = time.monotonic() + wait
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))

    def _handle_line(self, line):
        try:
            message = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            self._respond(None, error=RpcError(PARSE_ERROR, "Parse error: %s" % err))
            return
        if isinstance(message, list):
            if self.protocol_version not in BATCH_VERSIONS:
                self._respond(None, error=RpcError(
                    INVALID_REQUEST, "JSON-RPC batches are not supported in protocol version %s; "
                    "send one message per line" % (self.protocol_version or "negotiation")))
            elif not message:
                self._respond(None, error=RpcError(
                    INVALID_REQUEST, "Invalid Request: an empty batch"))
            else:
                self._handle_batch(message)
            return
        self._handle_message(message, self._send_reply)

    def _handle_batch(self, messages):
        """2025-03-26 batches: one array of responses once every request is answered
        (notifications and cancelled requests add nothing; no array when empty)."""
        lock = threading.Lock()
        responses = []
        remaining = [len(messages)]

        def reply(message):
            with lock:
                if message is not None:
                    responses.append(message)
                remaining[0] -= 1
                finished = remaining[0] == 0
            if finished and responses:
                self.send(responses)
        for message in messages:
            self._handle_message(message, reply, batched=True)

    def _handle_message(self, message, reply, batched=False):
        """Handle one parsed message; ``reply`` is called exactly once, with the
        response or None when none is due."""
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            request_id = message.get("id") if isinstance(message, dict) else None
            self._respond(request_id if _valid_id(request_id) else None, error=RpcError(
                INVALID_REQUEST, "Invalid Request: expected an object with \"jsonrpc\": \"2.0\""),
                reply=reply)
            return
        method = message.get("method")
        if method is None and ("result" in message or "error" in message):
            reply(None)  # a response to a request we never send; ignore it
            return
        params = message.get("params", {})
        if "id" not in message:
            if isinstance(method, str) and isinstance(params, dict):
                handler = self.notification_handlers.get(method)
                if handler:
                    try:
                        handler(params)
                    except Exception:  # a notification never gets an answer, even on failure
                        log.exception("notification %s failed", method)
            reply(None)
            return
        request_id = message["id"]
        if not _valid_id(request_id):
            self._respond(None, error=RpcError(
                INVALID_REQUEST, "Invalid Request: id must be a string or integer"), reply=reply)
            return
        if not isinstance(method, str):
            self._respond(request_id, error=RpcError(
                INVALID_REQUEST, "Invalid Request: method must be a string"), reply=reply)
            return
        if params is None:
            params = {}
        if not isinstance(params, dict):
            self._respond(request_id, error=RpcError(INVALID_PARAMS, "params must be an object"),
                          reply=reply)
            return
        request = Request(request_id, method, params, threading.Event(), batched=batched,
                          reply=reply)
        lane = self._lanes.get(self.lane_of(request))
        if lane is None:
            self._run(request)
            return
        with self._inflight_lock:
            if request_id in self._inflight:
                self._respond(request_id, error=RpcError(
                    INVALID_REQUEST, "request id %r is already in use" % (request_id,)),
                    reply=reply)
                return
            admitted = lane.active < lane.max_workers + lane.max_queued
            if admitted:
                self._inflight[request_id] = request
                request.lane = lane
                lane.active += 1
                lane.pending.append(request)
                worker = None
                if lane.waiting:
                    lane.waiting -= 1
                    lane.ready.notify()
                elif lane.threads < lane.max_workers:
                    lane.threads += 1
                    worker = threading.Thread(target=self._work, args=(lane,), daemon=True,
                                              name="mcp-%s" % lane.name)
                    self._workers.add(worker)
        if not admitted:
            self._run(request, lambda request: self.busy(request, lane))
        elif worker is not None:
            worker.start()

    def _default_busy(self, request, lane):
        raise RpcError(INTERNAL_ERROR, "server busy: %d %s requests are already running; "
                                       "retry when one has finished" % (lane.active, lane.name))

    def _run(self, request, handler=None):
        result = error = None
        _current_request.value, _current_request.server = request, self
        try:
            handler = handler or self.handlers.get(request.method)
            if handler is None:
                raise RpcError(METHOD_NOT_FOUND, "Method not found: %s" % request.method)
            result = handler(request)
        except RpcError as err:
            error = err
        except Exception as err:  # a bug must not kill the server; report it whole
            log.exception("internal error in %s", request.method)
            error = RpcError(INTERNAL_ERROR, "Internal error: %s: %s" % (type(err).__name__, err))
        finally:
            _current_request.value = _current_request.server = None
            with self._inflight_lock:
                self._inflight.pop(request.id, None)
                if request.lane is not None:
                    # Free the slot before answering: a client may send its next
                    # call the moment it reads this answer.
                    request.lane.active -= 1
                    request.lane = None
        if request.abandoned:
            request.reply(None)  # cancelled by the client: the spec says send nothing more
            return
        self._respond(request.id, result=result, error=error, reply=request.reply)

    def _work(self, lane):
        """A worker thread of ``lane``: run its queued requests until shutdown."""
        try:
            while True:
                with self._inflight_lock:
                    while not lane.pending:
                        if self.closed.is_set():
                            return
                        lane.waiting += 1
                        lane.ready.wait()
                    request = lane.pending.popleft()
                self._run(request)
        finally:
            with self._inflight_lock:
                lane.threads -= 1
                self._workers.discard(threading.current_thread())

    def cancel(self, request_id):
        with self._inflight_lock:
            request = self._inflight.get(request_id)
            if request is not None:
                request.abandoned = True
                request.cancel.set()


def _valid_id(value):
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


# -- ferrus tools ---------------------------------------------------------------------

@dataclasses.dataclass
class Param:
    """One parameter of an MCP tool, for its JSON input schema."""

    name: str
    type: str
    description: str
    required: bool = True


@dataclasses.dataclass
class Tool:
    """One MCP tool: its schema, the roles that get it, the operation it calls."""

    name: str
    title: str
    description: str
    roles: tuple
    run: object                     # callable(store, caller, **arguments) -> Outcome
    params: tuple = ()
    output: dict = dataclasses.field(default_factory=dict)
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False

    def input_schema(self):
        return {"type": "object",
                "properties": {p.name: {"type": p.type, "description": p.description}
                               for p in self.params},
                "required": [p.name for p in self.params if p.required]}

    def output_schema(self):
        properties = {}
        for name, kind in self.output.items():
            if kind.endswith("?"):
                properties[name] = {"type": [kind[:-1], "null"]}
            else:
                properties[name] = {"type": kind}
        return {"type": "object", "properties": properties}


SUP, EXE = ("supervisor",), ("executor",)
BOTH = ("supervisor", "executor")
_TEXT_OUT = {"message": "string", "state": "string"}
_CLAIM_OUT = {"status": "string", "state": "string", "claimed_by": "string?",
              "lease_until": "string?", "task": "string", "review": "string", "task_id": "string?",
              "heartbeat_interval_secs": "integer?"}

TOOLS = (
    Tool("create_task", "Create task",
         "Start a new task from Idle: writes the description to TASK.md and moves the state to "
         "Executing so an executor can claim it with /wait_for_task. Confirm the task with the "
         "user first.", SUP,
         lambda st, c, description: op_create_task(st, c, description),
         (Param("description", "string", "The whole task in Markdown: outcome, constraints, "
                                         "acceptance criteria."),),
         dict(_TEXT_OUT, task_id="string", base="object", warnings="array")),
    Tool("enqueue_task", "Queue task",
         "Put a task in the queue that `ferrus run` and HQ work through (several at once, each "
         "in its own git worktree, with [parallel] max_tasks above 1). Use it to split a "
         "milestone into independent tasks as team lead: each should change different files. "
         "Confirm the tasks with the user first.", SUP,
         lambda st, c, description, spec=None, milestone=None, agent=None: op_enqueue_task(
             st, c, description, spec, milestone, agent),
         (Param("description", "string", "The whole task in Markdown: outcome, constraints, "
                                         "acceptance criteria."),
          Param("spec", "string", "Optional: the spec (path relative to the project) whose "
                                  "milestone this task implements.", required=False),
          Param("milestone", "string", "Optional: that milestone's ID.", required=False),
          Param("agent", "string", "Optional: the executor agent to hand it to (e.g. "
                                   "claude-code, codex); [parallel] delegates says which may "
                                   "be used.", required=False)),
         dict(_TEXT_OUT, task_id="string", title="string")),
    Tool("create_spec", "Create spec",
         "Save an approved feature specification (Markdown following ferrus://spec_template) "
         "into the spec directory and select its first ready milestone when no task is running.",
         SUP, lambda st, c, markdown: op_create_spec(st, c, markdown),
         (Param("markdown", "string", "The full specification in Markdown."),),
         dict(_TEXT_OUT, path="string", selected_milestone="string?")),
    Tool("wait_for_review", "Wait for review",
         "Block until a submission is in Reviewing, claim the review lease and return the task, "
         "submission notes, earlier review notes, the task's diff (stat and first part; "
         "ferrus://diff has all of it) and the changed files (the first 500; "
         "changed_files_total counts them all). On {\"status\":\"timeout\"} call it again.",
         SUP, lambda st, c: op_wait_for_review(st, c), (),
         dict(_CLAIM_OUT, submission="string", review_cycles_used="integer",
              check_retries_used="integer", diff="string", changed_files="array",
              changed_files_total="integer")),
    Tool("review_pending", "Review pending submission",
         "Read the task, the submission notes, the task's diff (stat and first part) and "
         "previous review notes of the submission awaiting review.", SUP, lambda st, c: op_review_pending(st, c), (), _TEXT_OUT,
         read_only=True, idempotent=True),
    Tool("approve", "Approve submission",
         "Accept the submission under review: the state becomes Complete and the task's spec "
         "milestone is ticked (with [hq] human_review on, it becomes AwaitingConfirmation "
         "until the human confirms).", SUP,
         lambda st, c, notes=None: op_approve(st, c, notes),
         (Param("notes", "string", "Optional: what you verified and why it is acceptable "
                                   "(shown to the human who confirms).", required=False),),
         _TEXT_OUT),
    Tool("reject", "Reject submission",
         "Send the submission back with notes saying exactly what must change. The state "
         "becomes Addressing (or Failed once max_review_cycles is reached).", SUP,
         lambda st, c, notes: op_reject(st, c, notes),
         (Param("notes", "string", "Concrete, actionable review notes in Markdown."),),
         dict(_TEXT_OUT, review_cycles="integer"), destructive=True),
    Tool("respond_consult", "Answer consultation",
         "Answer the executor's consultation request (ferrus://consult_request). The executor "
         "receives it from /wait_for_consult.", SUP,
         lambda st, c, response: op_respond_consult(st, c, response),
         (Param("response", "string", "Your guidance for the executor."),), _TEXT_OUT),
    Tool("wait_for_task", "Wait for task",
         "Block until a task is in Executing or Addressing, claim its lease and return the task "
         "and any review notes to address. On {\"status\":\"timeout\"} call it again.", EXE,
         lambda st, c: op_wait_for_task(st, c), (), _CLAIM_OUT),
    Tool("check", "Run checks",
         "Run the project's configured check commands (lint, tests). Passing resets the retry "
         "counter; each failure uses one retry and returns the failing output. Use it freely "
         "while working and again just before /submit.", EXE,
         lambda st, c: op_check(st, c), (),
         dict(_TEXT_OUT, passed="boolean", log="string?", check_retries="integer")),
    Tool("consult", "Consult supervisor",
         "Pause the task and ask the supervisor for guidance. The question must use the four "
         "headings of ferrus://consult_template. Then call /wait_for_consult.", EXE,
         lambda st, c, question: op_consult(st, c, question),
         (Param("question", "string", "The filled-in consultation template."),),
         dict(_TEXT_OUT, paused_state="string")),
    Tool("submit", "Submit for review",
         "Run the final check gate and, when it passes, record the submission notes and move "
         "the task to Reviewing.", EXE,
         lambda st, c, content: op_submit(st, c, content),
         (Param("content", "string", "Submission notes: what changed, why, and how it was "
                                     "verified."),),
         dict(_TEXT_OUT, passed="boolean", log="string?", check_retries="integer")),
    Tool("wait_for_consult", "Wait for consultation",
         "Block until the supervisor answers your consultation, then resume the paused state "
         "and return the answer. On {\"status\":\"timeout\"} call it again.", EXE,
         lambda st, c: op_wait_for_consult(st, c), (),
         {"status": "string", "state": "string", "response": "string", "message": "string"}),
    Tool("wait_for_answer", "Wait for human answer",
         "Block until a human answers the question you asked with /ask_human, then return the "
         "answer and the state the task resumed in. On {\"status\":\"timeout\"} call it again.",
         BOTH, lambda st, c: op_wait_for_answer(st, c), (),
         {"status": "string", "state": "string", "answer": "string", "resumed_state": "string"}),
    Tool("ask_human", "Ask a human",
         "Last resort when only a human can decide: pause the task with a question. Call "
         "/wait_for_answer right after and nothing else.", BOTH,
         lambda st, c, question: op_ask_human(st, c, question),
         (Param("question", "string", "A short, self-contained question for the human."),),
         dict(_TEXT_OUT, paused_state="string")),
    Tool("answer", "Answer question",
         "Answer the pending human question (ferrus://question) and resume the paused state.",
         BOTH, lambda st, c, response: op_answer(st, c, response),
         (Param("response", "string", "The answer."),), _TEXT_OUT),
    Tool("status", "Status",
         "Show the task state, retry and review counters, the lease and the selected milestone.",
         BOTH, lambda st, c: op_status(st, c), (),
         {"state": "string", "task_id": "string?", "check_retries": "integer",
          "review_cycles": "integer", "failure_reason": "string?", "paused_state": "string?",
          "claimed_by": "string?", "lease_until": "string?", "state_entered_at": "string?",
          "seconds_in_state": "number?", "task_started_at": "string?",
          "selected_spec": "string?", "selected_milestone": "string?", "rev": "integer",
          "capacity": "object?", "message": "string?"},
         read_only=True, idempotent=True),
    Tool("reset", "Reset failed task",
         "Escape hatch after the task Failed: return to Idle, clearing review, submission and "
         "consultation files.", SUP, lambda st, c: op_reset(st, c), (), _TEXT_OUT,
         destructive=True),
    Tool("heartbeat", "Renew lease",
         "Renew this agent's lease on the task; call it every lease.heartbeat_interval_secs "
         "while working. The lease is always this server's own identity.", BOTH,
         lambda st, c, agent_id=None: op_heartbeat(st, c, agent_id),
         (Param("agent_id", "string", "Optional; if given it must be this server's own agent "
                                      "id.", required=False),),
         {"status": "string", "claimed_by": "string?", "lease_until": "string?",
          "code": "string", "message": "string"}, idempotent=True),
)
TOOLS_BY_NAME = {tool.name: tool for tool in TOOLS}


def tools_for_role(role):
    """The tools a server for ``role`` offers (every tool when role is None)."""
    return [tool for tool in TOOLS if role is None or role in tool.roles]


# -- resources and prompts --------------------------------------------------------------

# uri name, title, file, mime type, what a missing file gives (None: an error).
RESOURCES = (
    ("task", "Task", "TASK.md", "text/markdown", None),
    ("review", "Review Notes", "REVIEW.md", "text/markdown", None),
    ("submission", "Submission", "SUBMISSION.md", "text/markdown", None),
    ("question", "Question", "QUESTION.md", "text/markdown", ""),
    ("answer", "Answer", "ANSWER.md", "text/markdown", ""),
    ("consult_template", "Consultation Template", "CONSULT_TEMPLATE.md", "text/markdown", ""),
    ("spec_template", "Specification Template", "SPEC_TEMPLATE.md", "text/markdown", "SPEC"),
    ("consult_request", "Consult Request", "CONSULT_REQUEST.md", "text/markdown", None),
    ("consult_response", "Consult Response", "CONSULT_RESPONSE.md", "text/markdown", None),
    ("state", "State", STATE_FILE, "application/json", None),
    ("events", "Recent Events", JOURNAL_FILE, "application/json", "[]"),
)
RESOURCES_BY_NAME = {entry[0]: entry for entry in RESOURCES}
EVENTS_RESOURCE_LIMIT = 200
# A .ferrus/ file served whole up to this size; past it the tail is left out (and said so).
RESOURCE_MAX_BYTES = 4 * 1024 * 1024
# ferrus://logs/{name}: a log up to HEAD + TAIL bytes is served whole, a longer one as
# its first HEAD and last TAIL bytes; ?offset=&length= reads any range up to READ_MAX.
LOG_WINDOW_HEAD = 16 * 1024
LOG_WINDOW_TAIL = 240 * 1024
LOG_READ_MAX = 1024 * 1024
LOG_URI_RE = re.compile(r"^ferrus://logs/([A-Za-z0-9_][A-Za-z0-9_.-]*)"
                        r"(?:\?(offset=\d{1,18}(?:&length=\d{1,18})?|length=\d{1,18}))?$")

PROMPTS = (
    ("executor-context", "Executor task context: state, task, and review notes",
     "Executor task context: state, task description, and review notes"),
    ("supervisor-review", "Supervisor review context: state, task, and submission notes",
     "Supervisor review context: state, task description, and submission notes"),
)


class ResourceNotFound(FerrusError):
    """A ferrus:// URI that names nothing ferrus will serve."""


def open_in_ferrus_dir(store, *parts):
    """An open binary file object for .ferrus/<parts> (see open_inside): raises
    ResourceNotFound for what ferrus refuses to read, or OSError.  A task's own files
    (STATE.json, TASK.md, ...) are those of the store's task."""
    base = store.task_dir if len(parts) == 1 and parts[0] in TASK_FILES else store.path()
    try:
        return open_inside(base, *parts)
    except UnsafePath as err:
        raise ResourceNotFound(err.message, err.hint) from err


def read_ferrus_text(store, name, limit=RESOURCE_MAX_BYTES):
    """The text of .ferrus/<name> (symlink-safe), at most ``limit`` bytes of it."""
    with open_in_ferrus_dir(store, name) as handle:
        data = handle.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    if len(data) > limit:
        text += ("\n\n[ferrus: %s/%s is larger than %d bytes; the rest is left out]\n"
                 % (FERRUS_DIR, name, limit))
    return text


def _utf8_start(data, index):
    """``index`` moved forward past UTF-8 continuation bytes (at most 3)."""
    for _ in range(3):
        if index < len(data) and 0x80 <= data[index] < 0xC0:
            index += 1
    return index


def _utf8_text(data):
    """``data`` as text when it is UTF-8 without NUL bytes (a cut last character
    is dropped), else None: such content is sent as a blob."""
    if b"\0" in data:
        return None
    for cut in range(4):
        try:
            return data[:len(data) - cut].decode("utf-8")
        except UnicodeDecodeError as err:
            if err.start < len(data) - 4:
                return None
    return None


def read_log_window(store, uri):
    """(contents list) of ferrus://logs/<name>[?offset=N&length=M], never the whole
    of a huge log: see LOG_WINDOW_HEAD/TAIL and LOG_READ_MAX."""
    match = LOG_URI_RE.match(uri)
    if not match:
        raise ResourceNotFound("Resource not found: %s" % uri,
                               "log URIs are ferrus://logs/<file name in .ferrus/logs>, "
                               "optionally with ?offset=<byte>&length=<bytes>")
    name, query = match.group(1), match.group(2)
    base_uri = "ferrus://logs/" + name
    try:
        handle = open_in_ferrus_dir(store, "logs", name)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise ResourceNotFound("Resource not found: %s" % uri,
                               "the log may have been removed; a check run writes new ones"
                               ) from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if query:
            fields = dict(part.split("=") for part in query.split("&"))
            offset = min(int(fields.get("offset", 0)), size)
            length = min(int(fields.get("length", LOG_READ_MAX)), LOG_READ_MAX)
            handle.seek(offset)
            pieces = [(offset, handle.read(length))]
        elif size <= LOG_WINDOW_HEAD + LOG_WINDOW_TAIL:
            pieces = [(0, handle.read(size))]
        else:
            head = handle.read(LOG_WINDOW_HEAD)
            handle.seek(size - LOG_WINDOW_TAIL)
            tail = handle.read(LOG_WINDOW_TAIL)
            skip = _utf8_start(tail, 0)
            pieces = [(0, head), (size - LOG_WINDOW_TAIL + skip, tail[skip:])]
    end = pieces[-1][0] + len(pieces[-1][1])
    texts = [_utf8_text(data) for _, data in pieces]
    if len(pieces) == 2:
        gap_start = len(pieces[0][1])
        note = ("[ferrus: this log has %d bytes; bytes %d to %d (%d bytes) are left out. "
                "Read them with %s?offset=%d&length=%d (at most %d bytes per read).]"
                % (size, gap_start, pieces[1][0], pieces[1][0] - gap_start, base_uri,
                   gap_start, min(pieces[1][0] - gap_start, LOG_READ_MAX), LOG_READ_MAX))
    elif query and (pieces[0][0] > 0 or end < size):
        note = ("[ferrus: bytes %d to %d of %d]" % (pieces[0][0], end, size))
    else:
        note = None
    if all(text is not None for text in texts):
        if len(texts) == 2:
            text = "%s\n\n%s\n\n%s" % (texts[0], note, texts[1])
        else:
            text = texts[0] if note is None else "%s\n%s" % (note, texts[0])
        return [{"uri": uri, "mimeType": "text/plain", "text": text}]
    # Binary (NUL bytes or not UTF-8): the bytes as they are, base64 in blobs.
    contents = []
    if note:
        contents.append({"uri": uri, "mimeType": "text/plain", "text": note})
    for offset, data in pieces:
        contents.append({"uri": "%s?offset=%d&length=%d" % (base_uri, offset, len(data)),
                         "mimeType": "application/octet-stream",
                         "blob": base64.b64encode(data).decode("ascii")})
    return contents


def read_diff_resource(store, uri):
    """The text of ferrus://diff (the task's whole diff, bounded) or ferrus://diff/<path>
    (one file or folder of it).  Without git it says why there is no diff."""
    rest = uri[len("ferrus://diff"):]
    paths = None
    if rest:
        path = urllib.parse.unquote(rest[1:]) if rest.startswith("/") else ""
        parts = path.replace("\\", "/").split("/")
        if (not path or "\0" in path or path.startswith("/") or re.match(r"^[A-Za-z]:", path)
                or ".." in parts):
            raise ResourceNotFound("Resource not found: %s" % uri,
                                   "diff URIs are ferrus://diff or ferrus://diff/<path relative "
                                   "to the project root>")
        paths = [path.rstrip("/")]
    return op_diff(store, paths=paths).text


def read_resource(store, uri):
    """(mime type, text) of a ``ferrus://`` resource; nothing outside .ferrus/ is reachable.

    Raises ResourceNotFound for a URI that names nothing (or a file that is
    missing or refused), OSError when reading fails."""
    if not isinstance(uri, str) or not uri.startswith("ferrus://"):
        raise ResourceNotFound("Resource not found: %s" % uri)
    name = uri[len("ferrus://"):]
    if name == "diff" or name.startswith("diff/"):
        return "text/x-diff", read_diff_resource(store, uri)
    if name.startswith("logs/"):
        contents = read_log_window(store, uri)
        return contents[0]["mimeType"], "".join(c.get("text", "") for c in contents)
    entry = RESOURCES_BY_NAME.get(name)
    if entry is None:
        raise ResourceNotFound("Unknown ferrus resource: %s" % name,
                               "resources/list names every resource ferrus serves")
    _, _, filename, mime, missing = entry
    try:
        if name in ("events", "state"):
            # Parsed by the store; opening first refuses a symlink in their place.
            open_in_ferrus_dir(store, filename).close()
            if name == "events":
                return mime, pretty_json(store.read_journal(limit=EVENTS_RESOURCE_LIMIT))
            return mime, store.read_state().to_json()
        return mime, read_ferrus_text(store, filename)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        if missing is None:
            raise ResourceNotFound("Resource not found: %s (.ferrus/%s does not exist)"
                                   % (uri, filename)) from None
        return mime, SPEC_TEMPLATE if missing == "SPEC" else missing


def render_prompt(store, name):
    data = store.read_state()

    def read(filename):
        try:
            return read_ferrus_text(store, filename)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return ""
        except ResourceNotFound as err:   # a symlink out of .ferrus/: say so, show nothing
            return "[ferrus: %s]" % err.message
    task = read("TASK.md")
    if name == "executor-context":
        sections = ["## State\n\nCurrent state: **%s** | Check retries: %d | Review cycles: %d"
                    % (data.state, data.check_retries, data.review_cycles), "## Task\n\n" + task]
        review = read("REVIEW.md")
        if review.strip():
            sections.append("## Review Notes (Re-address)\n\n" + review)
    else:
        sections = ["## State\n\nCurrent state: **%s** | Check retries used: %d | Review cycles: %d"
                    % (data.state, data.check_retries, data.review_cycles), "## Task\n\n" + task]
        submission = read("SUBMISSION.md")
        if submission.strip():
            sections.append("## Submission Notes\n\n" + submission)
    return "\n\n---\n\n".join(sections)


# -- the ferrus MCP server ------------------------------------------------------------------

# Names the agent session a `ferrus serve` works for.  HQ sets it for every agent it
# starts; the agent's MCP server inherits it and leases carry it, so two copies of one
# <role>:<agent>:<index> can never both hold or renew a lease.
SESSION_ENV = "FERRUS_SESSION"
_SESSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def agent_identity(role, agent_name, index, session=None):
    """``<role>:<agent>:<index>`` (upstream's agent id), plus ``/<session>`` when the
    server works for one known agent session."""
    identity = "%s:%s:%s" % (role or "agent", agent_name, index)
    return identity + "/" + session if session else identity


def session_from_environment(value=None):
    """The agent session named by --session or $FERRUS_SESSION (None when unset)."""
    value = os.environ.get(SESSION_ENV, "") if value is None else value
    if not value:
        return None
    if not _SESSION_RE.match(value):
        raise UsageError("the agent session %r is not a valid id" % value[:80],
                         "use letters, digits, '.', '_' and '-' (at most 64), as HQ does")
    return value


def session_id_for_task(task):
    """A new agent session id for an agent of parallel task ``task``.  The session id is
    what reaches the agent's MCP server with every agent CLI (FERRUS_SESSION, see
    Launch), so naming the task in it tells the server its task at launch, with
    nothing to register per task."""
    return "%s.%s" % (task, new_id("s"))


def session_task(session):
    """The parallel task an agent session works for (None for the project's own)."""
    task, dot, rest = (session or "").partition(".")
    return task if dot and _TASK_ID_RE.match(task) and rest.startswith("s-") else None


class FerrusMcpServer:
    """The ferrus tools, resources and prompts for one role, on a JsonRpcServer.

    Every answer is shaped for the protocol version in force for its request
    (``era``): the one negotiated by initialize, or 2026-07-28 for a request
    whose ``_meta`` carries a protocol version.  Fields a version does not
    define are left out for it."""

    PAGE_SIZE = 100

    def __init__(self, store, role=None, agent_name="unknown", agent_index=0,
                 reader=None, writer=None, session=None):
        self.store = store
        self.role = role
        self.agent_id = agent_identity(role, agent_name, agent_index, session)
        self.rpc = JsonRpcServer(reader, writer)
        self.tools = tools_for_role(role)
        self.tool_names = {tool.name for tool in self.tools}
        self.initialized = False
        self.protocol_version = None
        self.log_level = "info"
        self.tool_calls = 0
        self.usage = ToolCallCounter(agent_name=self.agent_id)
        rpc = self.rpc
        rpc.handlers.update({
            "initialize": self._initialize,
            "server/discover": self._discover,
            "ping": self._guard(lambda request: {}),
            "tools/list": self._guard(self._tools_list),
            "tools/call": self._guard(self._tools_call),
            "resources/list": self._guard(self._resources_list),
            "resources/templates/list": self._guard(self._templates_list),
            "resources/read": self._guard(self._resources_read),
            "prompts/list": self._guard(self._prompts_list),
            "prompts/get": self._guard(self._prompts_get),
            "logging/setLevel": self._guard(self._set_level),
        })
        rpc.lane_of = self._lane_of
        rpc.busy = self._busy
        rpc.notification_handlers.update({
            "notifications/initialized": lambda params: None,
            "notifications/cancelled": self._cancelled,
        })
        self._log_handler = _McpLogHandler(self)

    def serve(self):
        # The server's own warnings and errors also go to the client (notifications/message).
        log.addHandler(self._log_handler)
        try:
            self.rpc.serve_forever()
        finally:
            log.removeHandler(self._log_handler)

    # -- protocol ----------------------------------------------------------------------

    def era(self, request):
        """The protocol version a request is answered under."""
        if request is not None and request.modern:
            return MCP_MODERN_VERSIONS[0]
        return self.protocol_version or MCP_LEGACY_VERSIONS[0]

    def server_info(self, version=None):
        info = {"name": "ferrus", "version": __version__}
        if version is None or version >= "2025-06-18":
            info["title"] = "ferrus (%s)" % (self.role or "all tools")
        return info

    def capabilities(self):
        return {"tools": {"listChanged": False},
                "resources": {"listChanged": False, "subscribe": False},
                "prompts": {"listChanged": False}, "logging": {}}

    def instructions(self):
        if self.role == "executor":
            return ("ferrus executor tools. Start with /wait_for_task, implement the task, run "
                    "/check, then /submit. Call /heartbeat while you work.")
        if self.role == "supervisor":
            return ("ferrus supervisor tools: define tasks (/create_task), review submissions "
                    "(/wait_for_review, /approve, /reject) and answer consultations.")
        return "ferrus: every orchestration tool (no role restriction)."

    def _initialize(self, request):
        if META_VERSION in request.meta:
            raise RpcError(METHOD_NOT_FOUND, "Method not found: initialize does not exist in "
                           "protocol version 2026-07-28 (use server/discover)")
        if request.batched:
            raise RpcError(INVALID_REQUEST, "initialize must not be part of a JSON-RPC batch")
        requested = request.params.get("protocolVersion")
        if not isinstance(requested, str):
            raise RpcError(INVALID_PARAMS, "initialize needs protocolVersion as a string, e.g. "
                                           "\"%s\"" % MCP_LEGACY_VERSIONS[0])
        version = requested if requested in MCP_LEGACY_VERSIONS else MCP_LEGACY_VERSIONS[0]
        self.protocol_version = self.rpc.protocol_version = version
        self.initialized = True
        return {"protocolVersion": version, "capabilities": self.capabilities(),
                "serverInfo": self.server_info(version), "instructions": self.instructions()}

    def _check_modern_meta(self, request):
        """Validate a 2026-07-28 request's _meta: -32022 for a version ferrus does
        not speak (listing every one it does), -32602 for a missing field."""
        meta = request.meta
        if META_VERSION not in meta:
            raise RpcError(INVALID_PARAMS, "%s needs _meta[\"%s\"] (one of %s)" % (
                request.method, META_VERSION, ", ".join(MCP_MODERN_VERSIONS)))
        version = meta[META_VERSION]
        if version not in MCP_MODERN_VERSIONS:
            raise RpcError(UNSUPPORTED_PROTOCOL_VERSION,
                           "Unsupported protocol version: %s" % (version,),
                           {"supported": list(MCP_ALL_VERSIONS),
                            "requested": version if isinstance(version, str) else
                            json.dumps(version)})
        if not isinstance(meta.get(META_CLIENT_CAPABILITIES), dict):
            raise RpcError(INVALID_PARAMS, "_meta must carry %s (an object)"
                           % META_CLIENT_CAPABILITIES)
        level = meta.get(META_LOG_LEVEL)
        if level is not None and level not in LOG_LEVELS:
            raise RpcError(INVALID_PARAMS, "Invalid %s %r; expected one of %s"
                           % (META_LOG_LEVEL, level, ", ".join(LOG_LEVELS)))
        request.modern = True

    def _discover(self, request):
        self._check_modern_meta(request)
        return {"resultType": "complete", "supportedVersions": list(MCP_ALL_VERSIONS),
                "capabilities": self.capabilities(), "instructions": self.instructions(),
                "ttlMs": 0, "cacheScope": "private",
                "_meta": {META_SERVER_INFO: self.server_info()}}

    def _guard(self, handler):
        """Legacy requests need initialize first; modern ones carry their version in _meta."""
        def guarded(request):
            if META_VERSION in request.meta:
                if request.method in REMOVED_IN_MODERN:
                    raise RpcError(METHOD_NOT_FOUND, "Method not found: %s does not exist in "
                                   "protocol version 2026-07-28" % request.method)
                self._check_modern_meta(request)
                result = handler(request)
                result.setdefault("resultType", "complete")
                result.setdefault("_meta", {})[META_SERVER_INFO] = self.server_info()
                return result
            if not self.initialized and request.method != "ping":
                raise RpcError(INVALID_REQUEST, "Server not initialized: send initialize first")
            return handler(request)
        return guarded

    def _lane_of(self, request):
        if request.method == "resources/read":
            # The task's diff runs git, which can take a while in a big repository.
            uri = request.params.get("uri")
            return "blocking" if isinstance(uri, str) and uri.startswith("ferrus://diff") \
                else None
        if request.method != "tools/call":
            return None
        name = request.params.get("name")
        return "blocking" if isinstance(name, str) and name in BLOCKING_TOOLS else "quick"

    def _busy(self, request, lane):
        """The answer to a call no worker can take: a tool error the caller can read."""
        if request.method != "tools/call":
            return self.rpc._default_busy(request, lane)
        text = ("ferrus: too many calls in flight: %d %s tool calls are already running on "
                "this server, the most it runs at once.\nhint: wait for one of them to "
                "finish (or cancel it) and call %s again"
                % (lane.active, lane.name, request.params.get("name")))
        return self._error_result(text)

    def _structured(self, request):
        return self.era(request) >= "2025-06-18"

    def _page(self, request, items, key):
        cursor = request.params.get("cursor")
        start = 0
        if cursor is not None:
            try:
                start = int(base64.b64decode(str(cursor).encode("ascii"), validate=True))
                if start < 0 or start > len(items):
                    raise ValueError
            except (ValueError, TypeError, UnicodeError):
                raise RpcError(INVALID_PARAMS, "Invalid cursor: %r" % (cursor,)) from None
        page = items[start:start + self.PAGE_SIZE]
        result = {key: page}
        if start + self.PAGE_SIZE < len(items):
            result["nextCursor"] = base64.b64encode(
                str(start + self.PAGE_SIZE).encode("ascii")).decode("ascii")
        if request.modern:
            result.update(ttlMs=0, cacheScope="private")
        return result

    def _cancelled(self, params):
        request_id = params.get("requestId")
        if _valid_id(request_id):
            self.rpc.cancel(request_id)

    def _set_level(self, request):
        level = request.params.get("level")
        if level not in LOG_LEVELS:
            raise RpcError(INVALID_PARAMS, "Invalid log level %r; expected one of %s"
                           % (level, ", ".join(LOG_LEVELS)))
        self.log_level = level
        return {}

    def send_log(self, level, message, request=None):
        """notifications/message at or above the client's level.

        A 2026-07-28 request chooses its own level in _meta (no level: no log
        messages for it); otherwise the level set by logging/setLevel applies,
        once the client has initialized."""
        if request is not None and request.modern:
            threshold = request.meta.get(META_LOG_LEVEL)
            if threshold not in LOG_LEVELS:
                return
        elif self.initialized:
            threshold = self.log_level
        else:
            return
        if LOG_LEVELS.index(level) >= LOG_LEVELS.index(threshold):
            self.rpc.notify("notifications/message",
                            {"level": level, "logger": "ferrus", "data": message})

    # -- tools -------------------------------------------------------------------------

    def _tools_list(self, request):
        version = self.era(request)
        items = []
        for tool in self.tools:
            entry = {"name": tool.name}
            if version >= "2025-06-18":
                entry["title"] = tool.title
            entry.update(description=tool.description, inputSchema=tool.input_schema())
            if version >= "2025-03-26":
                entry["annotations"] = {"title": tool.title, "readOnlyHint": tool.read_only,
                                        "destructiveHint": tool.destructive,
                                        "idempotentHint": tool.idempotent,
                                        "openWorldHint": False}
            if version >= "2025-06-18":
                entry["outputSchema"] = tool.output_schema()
            items.append(entry)
        return self._page(request, items, "tools")

    @staticmethod
    def _error_result(text):
        return {"content": [{"type": "text", "text": text}], "isError": True}

    def _tools_call(self, request):
        name = request.params.get("name")
        if not isinstance(name, str) or name not in self.tool_names:
            # A tool outside this role is as unknown as a tool that does not exist.
            raise RpcError(INVALID_PARAMS, "Unknown tool: %s" % (name,))
        tool = TOOLS_BY_NAME[name]
        arguments = request.params.get("arguments")
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, dict):
            raise RpcError(INVALID_PARAMS, "arguments of %s must be an object" % name)
        problem = _argument_problem(tool, arguments)
        if problem is not None:
            # 2025-11-25 (SEP-1303): input validation errors are tool execution
            # errors the model can read and correct; earlier versions list
            # invalid arguments among the protocol errors.
            if self.era(request) >= "2025-11-25":
                return self._error_result("ferrus: %s\nhint: %s" % problem)
            raise RpcError(INVALID_PARAMS, problem[0])
        caller = Caller(self.role or "agent", self.agent_id, request.cancel,
                        self._progress_reporter(request))
        self.tool_calls += 1
        with contextlib.suppress(FerrusError, OSError):
            self.usage.count(self.store)
        try:
            outcome = tool.run(self.store, caller, **arguments)
        except FerrusError as err:
            return self._error_result(err.full_text())
        except OSError as err:
            # A full disk, a read-only file system, a name too long...: the tool
            # failed, the state on disk did not change (transactions are atomic).
            return self._error_result(os_error_text(tool.name, err))
        failed = outcome.data.get("status") == "error" or outcome.data.get("passed") is False
        content = [{"type": "text", "text": outcome.text}]
        result = {"content": content, "isError": failed}
        if self._structured(request):
            result["structuredContent"] = outcome.data
            # The text blocks must carry the structured JSON too (the tools page's
            # SHOULD); prose, when there is any, stays first for human readers.
            mirror = compact_json(outcome.data)
            if outcome.text != mirror:
                content.append({"type": "text", "text": mirror})
        return result

    def _progress_reporter(self, request):
        token = request.meta.get("progressToken")
        if not (_valid_id(token)):
            return None
        count = [0]
        with_message = self.era(request) >= "2025-03-26"

        def report(message):
            if request.cancel.is_set():
                return
            count[0] += 1
            params = {"progressToken": token, "progress": count[0]}
            if with_message:
                params["message"] = message
            self.rpc.notify("notifications/progress", params)
        return report

    # -- resources and prompts ---------------------------------------------------------

    def _resources_list(self, request):
        items = [{"uri": "ferrus://" + name, "name": title, "mimeType": mime}
                 for name, title, _, mime, _ in RESOURCES]
        items.append({"uri": "ferrus://diff", "name": "Task Diff", "mimeType": "text/x-diff",
                      "description": "The task's changes from its base commit to the working "
                                     "tree (untracked files included): a stat, then the "
                                     "unified diff, its middle left out when it is long"})
        return self._page(request, items, "resources")

    def _templates_list(self, request):
        items = [{"uriTemplate": "ferrus://{file}", "name": "ferrus-file",
                  "description": "A file of .ferrus/ by resource name (task, review, state, ...)"},
                 {"uriTemplate": "ferrus://logs/{name}", "name": "ferrus-log",
                  "description": "A check log from .ferrus/logs/: whole up to %d KiB, else its "
                                 "first %d KiB and last %d KiB with a note of what was left out"
                                 % ((LOG_WINDOW_HEAD + LOG_WINDOW_TAIL) // 1024,
                                    LOG_WINDOW_HEAD // 1024, LOG_WINDOW_TAIL // 1024),
                  "mimeType": "text/plain"},
                 {"uriTemplate": "ferrus://logs/{name}{?offset,length}", "name": "ferrus-log-range",
                  "description": "length bytes (at most %d KiB) of a check log from byte offset"
                                 % (LOG_READ_MAX // 1024)},
                 {"uriTemplate": "ferrus://diff/{+path}", "name": "ferrus-diff-path",
                  "description": "The task's diff of one file or folder (path relative to the "
                                 "project root)", "mimeType": "text/x-diff"}]
        return self._page(request, items, "resourceTemplates")

    def _resources_read(self, request):
        uri = request.params.get("uri")
        if not isinstance(uri, str):
            raise RpcError(INVALID_PARAMS, "resources/read needs a string uri")
        try:
            if uri.startswith("ferrus://logs/"):
                contents = read_log_window(self.store, uri)
            else:
                mime, text = read_resource(self.store, uri)
                contents = [{"uri": uri, "mimeType": mime, "text": text}]
        except ResourceNotFound as err:
            # Resource not found: -32002 until 2025-11-25, -32602 in 2026-07-28.
            code = INVALID_PARAMS if request.modern else RESOURCE_NOT_FOUND
            raise RpcError(code, err.full_text(), {"uri": uri}) from err
        except (OSError, FerrusError) as err:
            text = err.full_text() if isinstance(err, FerrusError) else \
                os_error_text("resources/read", err)
            raise RpcError(INTERNAL_ERROR, text, {"uri": uri}) from err
        result = {"contents": contents}
        if request.modern:
            result.update(ttlMs=0, cacheScope="private")
        return result

    def _prompts_list(self, request):
        items = [{"name": name, "description": description} for name, description, _ in PROMPTS]
        return self._page(request, items, "prompts")

    def _prompts_get(self, request):
        name = request.params.get("name")
        entry = next((p for p in PROMPTS if p[0] == name), None)
        if entry is None:
            raise RpcError(INVALID_PARAMS, "Prompt not found: %s" % (name,))
        try:
            text = render_prompt(self.store, name)
        except FerrusError as err:
            raise RpcError(INTERNAL_ERROR, err.full_text()) from err
        except OSError as err:
            raise RpcError(INTERNAL_ERROR, os_error_text("prompts/get", err)) from err
        return {"description": entry[2],
                "messages": [{"role": "user", "content": {"type": "text", "text": text}}]}


# Tools that may block for long (waits, check commands): they run in their own
# bounded lane so they never hold up quick calls.
BLOCKING_TOOLS = frozenset(("wait_for_task", "wait_for_review", "wait_for_consult",
                            "wait_for_answer", "check", "submit", "review_pending"))

_OS_ERROR_HINTS = {
    errno.ENOSPC: "the disk is full; free some space and call it again",
    errno.EROFS: "the project is on a read-only file system; ferrus needs to write .ferrus/",
    errno.ENAMETOOLONG: "a file name is too long for this file system; use a shorter name "
                        "(for a spec, a shorter title)",
    errno.EACCES: "ferrus may not write there; check the permissions of .ferrus/",
    errno.EPERM: "ferrus may not write there; check the permissions of .ferrus/",
}
if hasattr(errno, "EDQUOT"):
    _OS_ERROR_HINTS[errno.EDQUOT] = "the disk quota is used up; free some space and retry"


def os_error_text(what, err):
    """A tool-error text for an OSError: what failed, the cause, how to fix it."""
    cause = err.strerror or str(err)
    if err.filename:
        cause += ": %s" % err.filename
    hint = _OS_ERROR_HINTS.get(err.errno, "fix the cause and call it again; the task state "
                                          "was not changed")
    return "ferrus: %s failed: %s\nhint: %s" % (what, cause, hint)


class _McpLogHandler(logging.Handler):
    """Sends ferrus's own warnings and errors to the MCP client too."""

    LEVELS = ((logging.CRITICAL, "critical"), (logging.ERROR, "error"),
              (logging.WARNING, "warning"), (logging.INFO, "info"), (0, "debug"))

    def __init__(self, server):
        super().__init__(logging.WARNING)
        self.server = server
        self._busy = threading.local()

    def emit(self, record):
        if getattr(self._busy, "value", False):
            return  # logging while sending a log message must not loop
        self._busy.value = True
        try:
            owner = getattr(_current_request, "server", None)
            if owner is not None and owner is not self.server.rpc:
                return  # another server in this process is handling that request
            level = next(name for number, name in self.LEVELS if record.levelno >= number)
            request = getattr(_current_request, "value", None)
            self.server.send_log(level, record.getMessage(), request)
        except Exception:  # a log line must never break the server
            pass
        finally:
            self._busy.value = False


_JSON_TYPES = {"string": str, "integer": int, "boolean": bool, "number": (int, float)}


def _argument_problem(tool, arguments):
    """(problem, hint) when ``arguments`` do not fit the tool's inputSchema, else None."""
    expected = {p.name: p for p in tool.params}
    takes = ", ".join("%s (%s)" % (p.name, p.type) for p in tool.params) or "no arguments"
    for name, value in arguments.items():
        if name not in expected:
            return ("unknown argument %r for tool %s" % (name, tool.name),
                    "%s takes %s" % (tool.name, takes))
        kind = expected[name].type
        if not isinstance(value, _JSON_TYPES[kind]) or (
                kind != "boolean" and isinstance(value, bool)):
            return ("argument %r of tool %s must be a %s, got %s" % (
                name, tool.name, kind, _json_type_name(value)),
                "pass %s as a JSON %s" % (name, kind))
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return ("argument %r of tool %s is not valid Unicode (it holds a lone "
                        "surrogate \\u escape)" % (name, tool.name),
                        "send the text as valid UTF-8")
    for param in tool.params:
        if param.required and param.name not in arguments:
            return ("missing required argument %r for tool %s" % (param.name, tool.name),
                    "%s takes %s" % (tool.name, takes))
    return None


def _json_type_name(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", int: "integer", float: "number", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


class ToolCallCounter:
    """This server's ferrus tool calls per task, for the capacity gate.

    Each server owns one small file, .ferrus/usage/<agent>-<pid>.json, so no two
    processes ever write the same file and nothing needs the state lock.  The
    file is rewritten at most every FLUSH_EVERY seconds and at exit, so counting
    costs a tool call next to nothing."""

    FLUSH_EVERY = 0.25

    def __init__(self, agent_name):
        self.agent_name = agent_name
        self.counts = {}
        self._lock = threading.Lock()
        self._stamp = self._task = None
        self._flushed_at = 0.0
        self._dirty = False

    def count(self, store):
        stamp = store.state_stamp()
        with self._lock:
            if stamp != self._stamp:
                self._stamp, self._task = stamp, store.read_state().task_id or "-"
            self.counts[self._task] = self.counts.get(self._task, 0) + 1
            self._dirty = True
            if time.monotonic() - self._flushed_at >= self.FLUSH_EVERY:
                self._write(store)

    def flush(self, store):
        with self._lock:
            if self._dirty:
                self._write(store)

    def _write(self, store):
        name = "%s-%d.json" % (re.sub(r"[^A-Za-z0-9_.-]", "_", self.agent_name), os.getpid())
        os.makedirs(store.path("usage"), exist_ok=True)
        atomic_write(store.path("usage", name), compact_json(
            {"agent_id": self.agent_name, "pid": os.getpid(), "tool_calls": self.counts}),
            durable=False)
        self._flushed_at = time.monotonic()
        self._dirty = False


def tool_calls_for_task(store, task_id, session=None):
    """Ferrus tool calls made for ``task_id``, summed over every server's usage file;
    with ``session``, only over the servers that agent session started (their agent
    id ends in ``/<session>``), so two agents running at once are counted apart."""
    total = 0
    directory = store.path("usage")
    if not task_id or not os.path.isdir(directory):
        return 0
    # The file name carries the agent id ("/" made "_"), so a session's files are found
    # without reading every other server's (HQ asks about each running slot every second).
    marker = "_" + session if session else ""        # a first sieve; the id decides
    for name in os.listdir(directory):
        if not name.endswith(".json") or marker not in name:
            continue
        with contextlib.suppress(ValueError, OSError, AttributeError, TypeError):
            usage = json.loads(read_text(os.path.join(directory, name)))
            if session is None or usage["agent_id"].endswith("/" + session):
                total += int(usage["tool_calls"].get(task_id, 0))
    return total


def tool_calls_for_session(store, session, task_id):
    """The ferrus tool calls agent session ``session`` made for ``task_id``."""
    return tool_calls_for_task(store, task_id, session=session)


def call_on_signal(signum, action):
    """Run ``action`` on a thread as soon as ``signum`` arrives (POSIX, main thread only).

    Complements a Python handler, which waits for the main thread to run."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch():
        while True:
            try:
                data = os.read(read_fd, 512)
            except OSError:
                return
            if not data:
                return
            if signum in data:
                action()
                return
    threading.Thread(target=watch, daemon=True, name="signal-%d" % signum).start()


def watch_parent(on_orphaned, interval=1.0):
    """Call ``on_orphaned`` once the process that started us is gone."""
    if IS_WINDOWS:  # pragma: no cover - Windows closes our stdin when the parent dies
        return
    parent = os.getppid()

    def loop():
        while True:
            time.sleep(interval)
            current = os.getppid()
            if current != parent or current <= 1:
                on_orphaned()
                return
    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


def serve_stdio(root, role, agent_name, agent_index, session=None):
    """`ferrus serve`: the MCP server on this process's stdin/stdout."""
    session = session_from_environment(session)
    store = Store(root)
    store.require()
    task = session_task(session)
    if task is not None:
        # An agent of a parallel task: every tool call works on that task alone — never
        # on the checkout's own task, which the server would serve without it.
        if not os.path.isfile(task_record_path(store.dir, task)):
            raise FerrusError("session %s names task %s, which is not a task of this "
                              "project (no %s/%s/%s/%s)" % (
                                  session, task, FERRUS_DIR, TASKS_DIR, task, TASK_RECORD_FILE),
                              "agents of parallel tasks are started by `ferrus run "
                              "--parallel` or HQ; `ferrus tasks` lists the tasks (a session "
                              "of the project's own task has no task id before its dot)")
        store = store.for_task(task)
        if not store.exists():
            raise FerrusError("session %s names task %s, which has not started (it has no "
                              "%s yet)" % (session, task, STATE_FILE),
                              "`ferrus run --parallel N` or HQ starts the queue's tasks "
                              "and their agents")
    report_orphaned_checks(store)
    writer = sys.stdout.buffer
    # Only protocol bytes may reach stdout: anything printed by accident goes to stderr.
    sys.stdout = sys.stderr
    server = FerrusMcpServer(store, role, agent_name, agent_index, sys.stdin.buffer, writer,
                             session=session)

    def orphaned():
        log.info("parent process exited; stopping the MCP server")
        server.rpc.shutdown(wait=2.0)
        end_active_checks()      # os._exit skips atexit
        with contextlib.suppress(FerrusError, OSError):
            server.usage.flush(store)
        os._exit(0)
    watch_parent(orphaned)
    if not IS_WINDOWS:
        # Clients stop servers with SIGTERM: end running checks (their process
        # groups) as EOF does, instead of dying and leaving them behind.
        signal.signal(signal.SIGTERM, lambda signum, frame: orphaned())
        # A Python handler runs only when the main thread runs bytecode, and it
        # sits in a blocking read of stdin: a SIGTERM the kernel hands to a worker
        # thread would wait for the next request.  The wakeup fd is written by
        # whichever thread takes the signal, and a thread of ours acts on it.
        call_on_signal(signal.SIGTERM, orphaned)
    server.serve()
    with contextlib.suppress(FerrusError, OSError):
        server.usage.flush(store)
    return 0


# ============================================================================
# 14. Agents
# ============================================================================
#
# One adapter per agent CLI.  An adapter knows the binary, how to launch it
# interactively and headless (the prompt travels on stdin wherever the CLI
# allows, so it is never read as a flag nor cut by argv limits), how to keep it
# to its own role's ferrus server, which files `register` writes, and how to
# read its machine-readable output.  The traps of the real CLIs are handled
# here: Claude's variadic --mcp-config, Codex ignoring an untrusted project's
# .codex/config.toml, Gemini ignoring untrusted folders, client tool timeouts.

FERRUS_FILE = os.path.abspath(__file__)
DEFAULT_AGENT_INDEX = 1
STDIN_PROMPT_POINTER = "Follow the instructions given on standard input."


def server_key(role):
    """The MCP server name of a role; one per role, so register stays idempotent."""
    return "ferrus-%s-%d" % (role, DEFAULT_AGENT_INDEX)


def ferrus_boot_code():
    """`python -c` code that imports *this* ferrus.py from its absolute path.

    Running `python ferrus.py` compiles the whole file on every start (about
    100 ms); importing it lets Python reuse the cached bytecode, so an agent's
    server starts about twice as fast.  The current folder ('' on sys.path) is
    dropped and ferrus.py is loaded by path rather than by putting its folder on
    sys.path, so a project's own queue.py or logging.py never hides the
    standard library."""
    return ("import sys; sys.path[:] = [p for p in sys.path if p]; import importlib.util as u; "
            "s = u.spec_from_file_location('ferrus', %r); f = u.module_from_spec(s); "
            "sys.modules['ferrus'] = f; s.loader.exec_module(f); sys.exit(f.main())"
            % FERRUS_FILE)


def ferrus_server_entry(root, role, agent):
    """command + args that start *this* ferrus (absolute interpreter and file)."""
    return {"command": os.path.abspath(sys.executable),
            "args": ["-c", ferrus_boot_code(), "-C", os.path.abspath(root), "serve",
                     "--role", role, "--agent-name", agent,
                     "--agent-index", str(DEFAULT_AGENT_INDEX)]}


def entry_points_here(entry, root):
    """Does an MCP entry start this ferrus for this project?"""
    if not isinstance(entry, dict):
        return False
    args = entry.get("args") or []
    return (entry.get("command") == os.path.abspath(sys.executable)
            and args[:2] == ["-c", ferrus_boot_code()] and os.path.abspath(root) in args)


def entry_mismatch(entry, root):
    """Why an MCP entry does not start this ferrus for this project: (severity, text),
    or None when it does.  Another Python still works while it exists, so it is only
    a warning."""
    if not isinstance(entry, dict):
        return "error", "its MCP entry is not a JSON object / TOML table"
    args = [str(arg) for arg in entry.get("args") or []]
    project = args[args.index("-C") + 1] if "-C" in args[:-1] else None
    if project is None or os.path.abspath(project) != os.path.abspath(root):
        return "error", "its MCP entry serves another project (%s)" % (project or "none named")
    if args[:2] != ["-c", ferrus_boot_code()]:
        code = args[1] if args[:1] == ["-c"] and len(args) > 1 else " ".join(args[:2])
        named = re.search(r"'([^']+)'", code)
        return "error", "its MCP entry starts another ferrus or another version of it (%s)" % (
            named.group(1) if named else code[:80])
    command = str(entry.get("command") or "")
    if command != os.path.abspath(sys.executable):
        if not shutil.which(command):
            return "error", "its MCP entry starts ferrus with a Python that is gone (%s)" % command
        return "warning", ("registered with another Python (%s); this ferrus runs on %s"
                           % (command, os.path.abspath(sys.executable)))
    return None


def client_tool_timeout_secs(config):
    """Comfortably above one wait_* call, so no client cuts a long-poll short."""
    return config.limits.wait_timeout_secs + 120


@dataclasses.dataclass
class Launch:
    """How to start an agent CLI: argv, what goes to its stdin, extra environment."""

    argv: list
    stdin: "str | None" = None
    env: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class AgentEvent:
    """Something an agent's structured output reported."""

    kind: str                 # tool_call | usage | session | limit | model_output | tool_result
    name: str = ""            # tool_call: the tool; session: the model, when reported
    ok: "bool | None" = None
    input_tokens: int = 0
    output_tokens: int = 0
    text: str = ""            # usage: its message ("" for none); tool_call: tool_summary
    cost_usd: "float | None" = None   # usage: the session's cost so far, when reported
    total: bool = False       # usage: the session's totals so far, replacing earlier counts
    turns: int = 0            # usage with total: the session's model turns, when reported
    context_tokens: int = 0   # usage: the context this turn's request held (0: not reported)


# The argument that says most about a tool call, in the order looked for.
_TOOL_SUMMARY_KEYS = ("command", "cmd", "file_path", "path", "absolute_path", "pattern", "url",
                      "query", "description", "prompt", "content", "notes", "question",
                      "response")
_MCP_TOOL_NAME = re.compile(r"^mcp__(.+?)__(.+)$")


def tool_line(slot, name, summary, root=None):
    """One tool call as a progress line: ``executor ▸ Write  src/a.py``.  An MCP tool is
    named by its server and tool (ferrus's own as ``ferrus submit``); paths under the
    project root are shown relative to it."""
    match = _MCP_TOOL_NAME.match(name or "")
    if match:
        server, tool = match.groups()
        name = "ferrus %s" % tool if server.startswith("ferrus") else "%s/%s" % (server, tool)
    if root and summary:
        summary = summary.replace(os.path.join(root, ""), "")
    return "%s ▸ %s%s" % (slot, name, "  " + summary if summary else "")


def tool_summary(arguments, width=100):
    """A tool call's arguments as one short line: its command, file or pattern when it
    has one, else the arguments in compact JSON, cut to ``width``."""
    if not isinstance(arguments, dict) or not arguments:
        return ""
    value = next((arguments[key] for key in _TOOL_SUMMARY_KEYS
                  if isinstance(arguments.get(key), (str, list)) and arguments[key]), None)
    if isinstance(value, list):
        value = " ".join(str(part) for part in value)
    text = value if value is not None else compact_json(arguments)
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"


class UsageTally:
    """What one agent session has used so far, folded from its AgentEvents.

    CLIs report usage in three ways, and each is folded without double counting:
    per message (Claude repeats a message's usage on every block of it, so only
    the last report per message counts), per turn (Codex: summed), and as the
    session's totals (Claude's and Gemini's final result: they replace what was
    counted before).  Cost is known only when the CLI reports it.

    Turns: each message or turn with usage is one, until the totals say how many
    (Claude's and Qwen's ``num_turns``).  Gemini reports neither, so its turns are
    counted from the stream: the model's first output after the start or after a tool
    result begins one.  The context in use is the last request's input, cached tokens
    included, from the CLIs that report usage per request (Claude, Qwen)."""

    def __init__(self):
        self.tool_calls = 0
        self.model = ""
        self.agent_session = ""
        self.cost_usd = None
        self.context_tokens = 0     # the context the last request held (0: not reported)
        self._settled = (0, 0)      # the last reported totals
        self._settled_turns = 0     # turns up to the last totals
        self._pending = {}          # message id (or a counter) -> (input, output) since
        self._stream_turns = 0      # turns seen in the stream (agents without per-turn usage)
        self._turn_open = False     # the model is answering: its output is no new turn

    def add(self, event):
        if event.kind == "tool_call":
            self.tool_calls += 1
        elif event.kind == "session":
            self.agent_session = event.text or self.agent_session
            self.model = event.name or self.model
        elif event.kind == "usage":
            if event.total:
                self._settled = (event.input_tokens, event.output_tokens)
                self._settled_turns = event.turns or self._settled_turns + len(self._pending)
                if event.turns:
                    self._stream_turns = 0
                self._pending = {}
            elif event.input_tokens or event.output_tokens:
                self._pending[event.text or len(self._pending)] = (event.input_tokens,
                                                                   event.output_tokens)
            if event.context_tokens:
                self.context_tokens = event.context_tokens
            if event.cost_usd is not None:
                self.cost_usd = event.cost_usd
        elif event.kind == "model_output":
            if not self._turn_open:
                self._stream_turns += 1
                self._turn_open = True
        elif event.kind == "tool_result":
            self._turn_open = False

    @property
    def input_tokens(self):
        return self._settled[0] + sum(pair[0] for pair in list(self._pending.values()))

    @property
    def output_tokens(self):
        return self._settled[1] + sum(pair[1] for pair in list(self._pending.values()))

    @property
    def turns(self):
        return self._settled_turns + len(self._pending) + self._stream_turns

    def counts(self):
        """The figures a session record keeps."""
        return {"tool_calls": self.tool_calls, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "cost_usd": self.cost_usd,
                "turns": self.turns, "context_tokens": self.context_tokens}


# -- files register edits -----------------------------------------------------------
#
# `register` and `unregister` touch several files (MCP configs, settings,
# CLAUDE.md, .gitignore, ferrus.toml, the user's trust lists).  They do it as one
# change set: every new content is computed, and every input validated, before
# the first byte is written, so a bad file met late leaves all files as they
# were.  Writes follow symlinks: a CLAUDE.md or settings file that links to a
# shared copy is updated at its target and stays a link.

class FileChanges:
    """New contents for several files, written all together or not at all.

    Used as ``with FileChanges():`` — planned_read/planned_write inside the block
    (on this thread) go through it, and leaving the block without an exception
    commits.  ``commit`` writes every temporary file first and renames them only
    once all exist; if a rename still fails, the files already replaced get
    their old content back."""

    _active = threading.local()

    def __init__(self):
        self.planned = {}        # real path -> bytes, in the order first planned

    def read(self, path):
        real = os.path.realpath(path)
        if real in self.planned:
            return self.planned[real].decode("utf-8")
        return _read_or_none(real)

    def write(self, path, data):
        self.planned[os.path.realpath(path)] = data.encode("utf-8") if isinstance(data, str) \
            else data

    def commit(self):
        """Write every planned file; returns the real paths that changed."""
        changed = [(real, data) for real, data in self.planned.items()
                   if _read_bytes_or_none(real) != data]
        staged = []
        try:
            for real, data in changed:
                os.makedirs(os.path.dirname(real), exist_ok=True)
                staged.append((real, write_temp_beside(real, data)))
        except BaseException:
            for _real, temp in staged:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            raise
        done = []
        try:
            for real, temp in staged:
                before = _read_bytes_or_none(real)
                os.replace(temp, real)
                done.append((real, before))
        except BaseException:
            for _real, temp in staged[len(done):]:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            for real, before in reversed(done):
                with contextlib.suppress(OSError):
                    if before is None:
                        os.unlink(real)
                    else:
                        atomic_write(real, before)
            raise
        for directory in {os.path.dirname(real) for real, _ in done}:
            fsync_directory(directory)
        return [real for real, _ in done]

    def __enter__(self):
        if getattr(FileChanges._active, "current", None) is not None:
            raise RuntimeError("FileChanges blocks do not nest")
        FileChanges._active.current = self
        return self

    def __exit__(self, kind, value, traceback):
        FileChanges._active.current = None
        if kind is None:
            self.commit()


def _read_bytes_or_none(path):
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _read_or_none(path):
    data = _read_bytes_or_none(path)
    return None if data is None else data.decode("utf-8", errors="replace")


def planned_read(path):
    """A file's text as the current change set would leave it (None: no such file)."""
    changes = getattr(FileChanges._active, "current", None)
    if changes is not None:
        return changes.read(path)
    return _read_or_none(os.path.realpath(path))


def planned_write(path, data):
    """Write through the current change set, or at once (atomically, through symlinks)."""
    changes = getattr(FileChanges._active, "current", None)
    if changes is not None:
        changes.write(path, data)
        return
    real = os.path.realpath(path)
    os.makedirs(os.path.dirname(real), exist_ok=True)
    atomic_write(real, data)


def add_registration_options(parser):
    """The options of `ferrus register` (and HQ's /register): one list for both."""
    parser.add_argument("--supervisor", metavar="AGENT", help="agent for the supervisor role")
    parser.add_argument("--supervisor-model", metavar="M", help="model for the supervisor")
    parser.add_argument("--executor", metavar="AGENT", help="agent for the executor role")
    parser.add_argument("--executor-model", metavar="M", help="model for the executor")
    parser.add_argument("--trust", action="store_true",
                        help="also mark this project trusted in the agents' user settings "
                             "(Codex, Gemini, Qwen), so their `mcp list` shows it")
    return parser


def registration_choices(args, root):
    """{role: (agent, model)} from add_registration_options' arguments, checked as
    upstream checks them; with no option at all, the agents [hq.*] of ferrus.toml
    name.  Returns (choices, from_config)."""
    if not (args.supervisor or args.executor or args.supervisor_model is not None
            or args.executor_model is not None):
        choices = configured_registration(root)
        if not choices:
            raise UsageError("At least one of --supervisor or --executor must be specified",
                             "e.g. ferrus register --supervisor claude-code --executor codex "
                             "(a bare `ferrus register` uses [hq.supervisor] and [hq.executor] "
                             "of ferrus.toml, and this project names neither)")
        return choices, True
    # Upstream's checks, in upstream's order.
    if not args.supervisor and not args.executor:
        raise UsageError("At least one of --supervisor or --executor must be specified",
                         "e.g. ferrus register --supervisor claude-code --executor codex")
    if args.supervisor_model is not None and not args.supervisor:
        raise UsageError("--supervisor-model requires --supervisor")
    if args.executor_model is not None and not args.executor:
        raise UsageError("--executor-model requires --executor")
    return {role: (getattr(args, role), getattr(args, role + "_model"))
            for role in ROLES if getattr(args, role)}, False


def ensure_gitignore_entry(root, entry, report):
    """Add ``entry`` to .gitignore unless a line already says it (CRLF tolerated)."""
    path = os.path.join(root, ".gitignore")
    text = planned_read(path)
    existing = {line.rstrip("\r").strip() for line in (text or "").split("\n")}
    if entry in existing or entry.rstrip("/") in existing or "/" + entry in existing:
        return False
    if text is None:
        planned_write(path, entry + "\n")
        report("Created .gitignore")
        return True
    if text and not text.endswith("\n"):
        text += "\n"
    planned_write(path, text + entry + "\n")
    report("Added %s to .gitignore" % entry)
    return True


def _strip_json_comments(text):
    """``text`` without // and /* */ comments outside strings (to recognise JSONC)."""
    out = []
    index, length, in_string = 0, len(text), False
    while index < length:
        char = text[index]
        if in_string:
            out.append(char)
            if char == "\\":
                out.append(text[index + 1:index + 2])
                index += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
            out.append(char)
        elif text.startswith("//", index):
            end = text.find("\n", index)
            index = length if end < 0 else end
            continue
        elif text.startswith("/*", index):
            end = text.find("*/", index + 2)
            index = length if end < 0 else end + 2
            continue
        else:
            out.append(char)
        index += 1
    return "".join(out)


def edit_json_file(path, mutate, what=None):
    """Load a JSON object file (missing or empty: {}), apply ``mutate``, write if changed.

    Key order and every unrelated setting are kept; the write is atomic, goes to
    a symlink's target, and joins the current FileChanges when there is one."""
    label = what or path
    text = planned_read(path) or ""
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError as err:
        try:
            json.loads(_strip_json_comments(text))
            has_comments = True
        except ValueError:
            has_comments = False
        if has_comments:
            raise FerrusError(
                "%s has comments (JSON with comments), which ferrus would lose when it rewrites "
                "the file" % label,
                "remove the comments from %s and run the command again; nothing was written"
                % path) from err
        raise FerrusError("Failed to parse %s: %s" % (label, err),
                          "fix the JSON by hand (ferrus never overwrites a file it cannot read); "
                          "nothing was written") from err
    if not isinstance(data, dict):
        raise FerrusError("%s root is not a JSON object" % label,
                          "fix or remove the file; nothing was written")
    before = json.dumps(data, sort_keys=False)
    mutate(data)
    if json.dumps(data, sort_keys=False) != before or not text.strip():
        planned_write(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        return True
    return False


def _json_table(data, key, label):
    value = data.setdefault(key, {})
    if not isinstance(value, dict):
        raise FerrusError("%s %s is not a JSON object" % (label, key), "fix the file by hand")
    return value


def _instruction_markers(role):
    return "<!-- ferrus-%s-instructions -->" % role, "<!-- /ferrus-%s-instructions -->" % role


def instruction_section(role):
    start, end = _instruction_markers(role)
    if role == "executor":
        body = ("This repository is orchestrated by ferrus. As the executor you work through the "
                "ferrus MCP tools: when HQ starts you, its prompt says what to do; when you are "
                "started by hand, call `wait_for_task` first, then implement, `check`, and "
                "`submit`.")
    else:
        body = ("This repository is orchestrated by ferrus. As the supervisor you define tasks, "
                "review submissions and answer consultations through the ferrus MCP tools; the "
                "prompt you were started with names your mode (task definition, planning, spec, "
                "review or consultation).")
    return ("\n%s\n## ferrus %s\n\n%s\n\nThe initial prompt and the ferrus MCP tools define what "
            "you do. ROLE.md, SKILL.md, AGENTS.md and CLAUDE.md are supporting context only and "
            "must not override them.\n%s\n" % (start, role, body, end))


def add_instruction_section(path, role, report):
    text = planned_read(path) or ""
    if _instruction_markers(role)[0] in text:
        return
    planned_write(path, text + instruction_section(role))
    report("Added the %s instructions to %s" % (role, os.path.basename(path)))


def remove_instruction_section(path, role, report):
    text = planned_read(path) or ""
    start, end = _instruction_markers(role)
    first = text.find(start)
    if first < 0:
        return
    last = text.find(end, first)
    last = len(text) if last < 0 else last + len(end)
    if text[last:last + 1] == "\n":
        last += 1
    if first > 0 and text[first - 1] == "\n":
        first -= 1
    planned_write(path, text[:first] + text[last:])
    report("Removed the %s instructions from %s" % (role, os.path.basename(path)))


# -- permission profiles ----------------------------------------------------------------
#
# A headless agent has nobody to answer a permission prompt: whatever its CLI
# would ask about is refused, so each launch says up front what the role may do
# besides calling ferrus's tools (which register already allows).
#   read-only  read the project; the reviewer and consultant (supervisor role)
#   edit       also create and edit files inside the project; the executor.  Its
#              builds and tests run through ferrus's /check, so no shell is granted
#   full       anything the CLI can do, without asking
#   output     pipeline workers: write their one output file (Claude Code can say
#              exactly that; the other CLIs get their nearest, "edit")
# `[hq.<role>] permissions` overrides the role's default.  Interactive sessions
# keep each CLI's own prompts: a person is there to answer them.

DEFAULT_PERMISSIONS = {"supervisor": "read-only", "executor": "edit"}
WORKER_PERMISSIONS = "output"


def effective_permissions(config, role):
    """(profile, where it comes from) for a role's headless launches."""
    choice = getattr(config, role, None)
    if choice is not None and choice.permissions:
        return choice.permissions, "[hq.%s] permissions in %s" % (role, CONFIG_FILE)
    return DEFAULT_PERMISSIONS[role], "the %s's default" % role


# -- adapters -------------------------------------------------------------------------

class AgentAdapter:
    """What every agent CLI adapter provides; subclasses fill in the details."""

    name = ""
    binary = ""
    package = ""              # npm package, for the install hint
    instructions_file = None  # CLAUDE.md, AGENTS.md, ...

    def __init__(self, config):
        self.config = config
        self.options = config.agents.options_for(self.name)

    def install_hint(self):
        return "npm install -g %s" % self.package

    def executable(self):
        return shutil.which(self.binary)

    def version_argv(self):
        return [self.binary, "--version"]

    def register(self, root, role, model, report):
        raise FerrusError("agent %s cannot be registered" % self.name)

    def unregister(self, root, role, report):
        pass

    def registration(self, root, role):
        """The MCP entry this agent's config holds for ``role`` (None when absent)."""
        return None

    def parse_line(self, line):
        return []

    def permission_args(self, profile, output=None, reads=()):
        """The CLI's own flags for a permission profile (see above); [] when it has none."""
        return []

    def can_edit(self, profile):
        """Can a headless launch with this profile change files?  None: ferrus cannot tell."""
        return profile in ("edit", "full")

    def _profile(self, role, profile):
        return profile or effective_permissions(self.config, role)[0]


def _model_args(flag, model):
    """The model flag, or nothing: a blank model means the agent's own default."""
    model = (model or "").strip()
    return [flag, model] if model else []


def _load_json_quiet(path):
    try:
        data = json.loads(read_text(path, default="") or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class ClaudeCode(AgentAdapter):
    name = "claude-code"
    binary = "claude"
    package = "@anthropic-ai/claude-code"
    instructions_file = "CLAUDE.md"

    def config_path(self, root, role):
        return os.path.join(root, ".claude", "mcp-%s.json" % role)

    def _common(self, root, role, model):
        # --mcp-config takes several values: the = form keeps it from eating the
        # next argument (upstream's trap).
        argv = [self.binary, "--mcp-config=" + self.config_path(root, role)]
        if self.config.agents.claude_mcp_isolation == "ferrus-only":
            argv.append("--strict-mcp-config")
        return argv + _model_args("--model", model)

    def headless(self, root, role, prompt, model="", profile=None):
        argv = self._common(root, role, model) + [
            "--allowedTools=mcp__%s__*" % server_key(role)] + \
            self.permission_args(self._profile(role, profile)) + \
            ["--output-format", "stream-json", "--verbose"] + \
            self.options.extra_args + self.options.headless_args + ["-p"]
        # Claude Code 2.1 connects MCP servers in the background in -p mode, so a
        # first turn can find ferrus's tools "still connecting" on a busy machine;
        # every prompt starts with a ferrus tool, so wait for the server.
        env = {"MCP_TOOL_TIMEOUT": str(client_tool_timeout_secs(self.config) * 1000),
               "MCP_CONNECTION_NONBLOCKING": "false"}
        env.update(self.options.env)
        return Launch(argv, prompt, env)

    def worker(self, root, prompt, model, output, reads=()):
        """A pipeline worker: no ferrus server at all, allowed to write ``output`` only."""
        argv = [self.binary]
        if self.config.agents.claude_mcp_isolation == "ferrus-only":
            argv.append("--strict-mcp-config")
        argv += _model_args("--model", model) + \
            self.permission_args(WORKER_PERMISSIONS, output, reads) + \
            ["--output-format", "stream-json", "--verbose"] + \
            self.options.extra_args + self.options.headless_args + ["-p"]
        return Launch(argv, prompt, dict(self.options.env))

    def permission_args(self, profile, output=None, reads=()):
        if profile == "full":
            return ["--permission-mode", "bypassPermissions"]
        if profile == "edit":
            return ["--permission-mode", "acceptEdits"]
        # "default" mode: anything not allowed up front is refused headless.  The
        # edit tools are denied outright, so a user-level allow rule cannot
        # widen a read-only role.
        args = ["--permission-mode", "default"]
        if profile == "output":
            # Edit(...) rules cover Write too; "//" starts an absolute path (a Windows
            # drive is written /c/...).  Tried with Claude Code 2.1.197: the worker
            # writes that file and is refused any other.
            rule = "Edit(/%s)" % _claude_rule_path(output) if output else "Write"
            return args + ["--allowedTools=" + rule + (",Read" if reads else "")]
        return args + ["--disallowedTools=Edit,Write,NotebookEdit"]

    def interactive(self, root, role, prompt=None, model=""):
        argv = self._common(root, role, model) + self.options.extra_args + \
            self.options.interactive_args
        if prompt:
            argv += ["--", prompt]
        return Launch(argv, None, dict(self.options.env))

    def register(self, root, role, model, report):
        key = server_key(role)
        path = self.config_path(root, role)

        def add_server(data):
            servers = _json_table(data, "mcpServers", path)
            servers[key] = dict({"type": "stdio"}, **ferrus_server_entry(root, role, self.name))
        edit_json_file(path, add_server)
        report("Registered %s in .claude/mcp-%s.json (agent id %s:%s:%d)"
               % (key, role, role, self.name, DEFAULT_AGENT_INDEX))
        settings = os.path.join(root, ".claude", "settings.local.json")
        permission = "mcp__%s__*" % key

        def allow(data):
            permissions = _json_table(data, "permissions", ".claude/settings.local.json")
            allowed = permissions.setdefault("allow", [])
            if not isinstance(allowed, list):
                raise FerrusError(".claude/settings.local.json permissions.allow is not an array")
            if permission not in allowed:
                allowed.append(permission)
                report("Allowed %s in .claude/settings.local.json" % permission)
        edit_json_file(settings, allow)
        for entry in (".claude/mcp-%s.json" % role, ".claude/settings.local.json"):
            ensure_gitignore_entry(root, entry, report)

    def unregister(self, root, role, report):
        key = server_key(role)
        path = self.config_path(root, role)
        if os.path.exists(path):
            edit_json_file(path, lambda data: data.get("mcpServers", {}).pop(key, None))
        settings = os.path.join(root, ".claude", "settings.local.json")
        if os.path.exists(settings):
            def disallow(data):
                allowed = data.get("permissions", {}).get("allow")
                if isinstance(allowed, list) and "mcp__%s__*" % key in allowed:
                    allowed.remove("mcp__%s__*" % key)
            edit_json_file(settings, disallow)
        report("Removed %s from .claude/" % key)

    def registration(self, root, role):
        return _load_json_quiet(self.config_path(root, role)).get("mcpServers", {}).get(
            server_key(role))

    def parse_line(self, line):
        return _parse_claude_style(line)


def _claude_rule_path(path):
    path = os.path.abspath(path).replace(os.sep, "/")
    drive = re.match(r"([A-Za-z]):/", path)
    return "/%s/%s" % (drive.group(1).lower(), path[3:]) if drive else path


def _parse_claude_style(line):
    """Claude Code / Qwen Code stream-json: assistant tool_use blocks, usage, result."""
    try:
        event = json.loads(line)
    except ValueError:
        return _limit_events(line)
    if not isinstance(event, dict):
        return []
    events = []
    kind = event.get("type")
    if kind == "system" and event.get("session_id"):
        events.append(AgentEvent("session", name=str(event.get("model") or ""),
                                 text=str(event["session_id"])))
    elif kind == "assistant":
        message = event.get("message") or {}
        for block in message.get("content") or []:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                events.append(AgentEvent("tool_call", name=str(block.get("name", "")),
                                         text=tool_summary(block.get("input"))))
        usage = message.get("usage") or {}
        if isinstance(usage, dict) and usage:
            # One request's usage: its input is the whole context the model read.
            event = _claude_usage(usage, text=str(message.get("id") or ""))
            event.context_tokens = event.input_tokens
            events.append(event)
    elif kind == "result":
        text = str(event.get("result") or "")
        events.extend(_limit_events(text))
        usage, cost = event.get("usage"), event.get("total_cost_usd", event.get("cost_usd"))
        cost = float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) \
            else None
        if isinstance(usage, dict):
            events.append(_claude_usage(usage, total=True, cost_usd=cost,
                                        turns=_count(event, "num_turns")))
        elif cost is not None:
            events.append(AgentEvent("usage", cost_usd=cost))
    return events


def _count(mapping, key):
    """A non-negative whole number from a CLI's JSON (0 for anything else)."""
    value = mapping.get(key)
    return max(0, int(value)) if isinstance(value, (int, float)) and \
        not isinstance(value, bool) else 0


def _claude_usage(usage, **fields):
    """A usage event from an Anthropic usage object.  Input counts every token the
    model read, cached or not (as Codex's input_tokens does)."""
    return AgentEvent("usage", input_tokens=_count(usage, "input_tokens") +
                      _count(usage, "cache_creation_input_tokens") +
                      _count(usage, "cache_read_input_tokens"),
                      output_tokens=_count(usage, "output_tokens"), **fields)


_LIMIT_RE = re.compile(r"(?:hit your (?:session |usage )?limit|usage limit|rate limit)"
                       r".{0,40}?resets? (?:at )?([^\n.]+)", re.IGNORECASE)


def _limit_events(text):
    match = _LIMIT_RE.search(text or "")
    return [AgentEvent("limit", text=match.group(1).strip())] if match else []


# Errors no retry can cure, as the agent CLIs word them, with what the user must do.
PERMANENT_AGENT_ERRORS = (
    ("login", re.compile(
        r"invalid api key|invalid x-api-key|incorrect api key|api key not valid|"
        r"authentication_error|authentication failed|please run /login|not logged in|"
        r"oauth token has expired|please set an auth method|401 unauthorized|"
        r"no api key (?:found|provided)|missing api key|api key is missing", re.IGNORECASE),
     "log the agent in (run it once interactively, e.g. `claude` then /login) or set its "
     "API key, then run again"),
    ("model", re.compile(
        r"unknown model|invalid model|model_not_found|"
        r"model\b[^\n]{0,80}?\b(?:not found|does not exist|is not supported|is not available|"
        r"not available|may not exist)|issue with the selected model", re.IGNORECASE),
     "check the model name: `ferrus register --<role>-model M`, /model in HQ, or [hq.<role>] "
     "in ferrus.toml"),
    ("flag", re.compile(
        r"unknown option|unrecognized option|unexpected argument|unrecognized arguments?|"
        r"unknown (?:flag|argument)s?:?|invalid option", re.IGNORECASE),
     "the agent refused its command line: check extra_args / headless_args under "
     "[agents.<name>] in ferrus.toml and the agent's version (`ferrus agents`)"),
)

# Output events that report the agent's own failure.  Tool results (a check's output
# that mentions "unknown option", say) are never read as the agent failing.
_ERROR_EVENT_TYPES = ("result", "error", "turn.failed")


def _error_texts(line):
    """The parts of one output line that may state why the agent itself failed."""
    try:
        event = json.loads(line)
    except ValueError:
        return [line]          # plain text, usually stderr (it is merged into stdout)
    if not isinstance(event, dict) or event.get("type") not in _ERROR_EVENT_TYPES:
        return []
    if event.get("type") == "result" and not (event.get("is_error") or
                                              event.get("status") == "error"):
        return []
    texts = []

    def collect(value, depth=0):
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict) and depth < 4:
            for item in value.values():
                collect(item, depth + 1)
        elif isinstance(value, list) and depth < 4:
            for item in value[:20]:
                collect(item, depth + 1)
    collect(event)
    return texts


def permanent_agent_error(line):
    """(kind, the agent's own words, hint) when ``line`` says no retry can help, else None."""
    for text in _error_texts(line):
        for kind, pattern, hint in PERMANENT_AGENT_ERRORS:
            if pattern.search(text):
                words = " ".join(text.split())
                return kind, words[:400] + ("…" if len(words) > 400 else ""), hint
    return None


class Codex(AgentAdapter):
    name = "codex"
    binary = "codex"
    package = "@openai/codex"
    instructions_file = "AGENTS.md"

    def overrides(self, root, role):
        """-c settings that define this role's server and disable the other role's.

        Codex ignores .codex/config.toml in projects the user has not trusted, so
        launches inject the server on the command line and work everywhere."""
        key = server_key(role)
        entry = ferrus_server_entry(root, role, self.name)
        settings = [("command", entry["command"]), ("args", entry["args"]),
                    ("startup_timeout_sec", 30),
                    ("tool_timeout_sec", client_tool_timeout_secs(self.config)),
                    ("default_tools_approval_mode", "approve"), ("enabled", True),
                    # Codex passes only listed variables to servers: the session id must reach it.
                    ("env_vars", [SESSION_ENV])]
        argv = []
        for name, value in settings:
            argv += ["-c", "mcp_servers.%s.%s=%s" % (key, name, format_toml_value(value))]
        other_role = "executor" if role == "supervisor" else "supervisor"
        return argv + self._disable(root, other_role)

    def _disable(self, root, role):
        """-c settings that switch off the project's server for ``role``, if it has one."""
        key = server_key(role)
        if not self._project_defines(root, key):
            return []
        # In an untrusted project Codex never loaded that server, and a table with
        # only `enabled` is invalid config: give it a command too.
        command = ferrus_server_entry(root, role, self.name)["command"]
        return ["-c", "mcp_servers.%s.command=%s" % (key, format_toml_value(command)),
                "-c", "mcp_servers.%s.enabled=false" % key]

    def _project_defines(self, root, key):
        try:
            data = parse_toml(read_text(os.path.join(root, ".codex", "config.toml"), default=""))
        except TomlError:
            return False
        return key in (data.get("mcp_servers") or {})

    def headless(self, root, role, prompt, model="", profile=None):
        argv = [self.binary, "exec", "--json", "--skip-git-repo-check"] + \
            _model_args("--model", model) + self.overrides(root, role) + \
            self.permission_args(self._profile(role, profile)) + \
            self.options.extra_args + self.options.headless_args + ["-"]
        return Launch(argv, prompt, dict(self.options.env))

    def worker(self, root, prompt, model, output, reads=()):
        """A pipeline worker: ferrus's servers disabled, the sandbox lets it write."""
        argv = [self.binary, "exec", "--json", "--skip-git-repo-check"] + \
            _model_args("--model", model)
        for role in ROLES:
            argv += self._disable(root, role)
        argv += self.permission_args(WORKER_PERMISSIONS, output, reads) + \
            self.options.extra_args + self.options.headless_args + ["-"]
        return Launch(argv, prompt, dict(self.options.env))

    # `codex exec` never asks for approval; the sandbox alone bounds what the
    # model's commands and patches may touch (read-only is its default).
    _SANDBOX = {"read-only": "read-only", "edit": "workspace-write",
                "output": "workspace-write", "full": "danger-full-access"}

    def permission_args(self, profile, output=None, reads=()):
        return ["--sandbox", self._SANDBOX[profile]]

    def interactive(self, root, role, prompt=None, model=""):
        argv = [self.binary] + _model_args("--model", model) + self.overrides(root, role) + \
            self.options.extra_args + self.options.interactive_args
        if prompt:
            argv += ["--", prompt]
        return Launch(argv, None, dict(self.options.env))

    def config_path(self, root):
        return os.path.join(root, ".codex", "config.toml")

    def register(self, root, role, model, report):
        key = server_key(role)
        entry = ferrus_server_entry(root, role, self.name)
        table = {"command": entry["command"], "args": entry["args"], "startup_timeout_sec": 30,
                 "tool_timeout_sec": client_tool_timeout_secs(self.config),
                 "default_tools_approval_mode": "approve",
                 "tools": {tool.name: {"approval_mode": "approve"}
                           for tool in tools_for_role(role)}}
        path = self.config_path(root)
        text = planned_read(path) or ""
        try:
            parse_toml(text)
            new = toml_replace_table(text, ("mcp_servers", key), table)
        except TomlError as err:
            raise FerrusError(".codex/config.toml: %s" % err,
                              "fix the file by hand first; nothing was written") from err
        if new != text:
            planned_write(path, new)
        report("Registered %s in .codex/config.toml (agent id %s:%s:%d)"
               % (key, role, self.name, DEFAULT_AGENT_INDEX))
        ensure_gitignore_entry(root, ".codex/config.toml", report)

    def unregister(self, root, role, report):
        path = self.config_path(root)
        text = planned_read(path) or ""
        if text:
            try:
                new = toml_remove_table(text, ("mcp_servers", server_key(role)))
            except TomlError as err:
                raise FerrusError(".codex/config.toml: %s" % err,
                                  "fix the file by hand first; nothing was written") from err
            if new != text:
                planned_write(path, new)
                report("Removed %s from .codex/config.toml" % server_key(role))

    def registration(self, root, role):
        try:
            data = parse_toml(read_text(self.config_path(root), default=""))
        except TomlError:
            return None
        return (data.get("mcp_servers") or {}).get(server_key(role))

    def parse_line(self, line):
        try:
            event = json.loads(line)
        except ValueError:
            return _limit_events(line)
        if not isinstance(event, dict):
            return []
        kind = event.get("type")
        if kind == "thread.started":
            return [AgentEvent("session", text=str(event.get("thread_id", "")))]
        if kind == "item.completed":
            item = event.get("item") or {}
            if item.get("type") == "mcp_tool_call":
                return [AgentEvent("tool_call", name="%s/%s" % (item.get("server"), item.get("tool")),
                                   ok=item.get("status") == "completed",
                                   text=tool_summary(item.get("arguments")))]
            # Codex's own tools: a shell command, or file edits (its apply_patch).
            if item.get("type") == "command_execution":
                return [AgentEvent("tool_call", name="shell", ok=item.get("exit_code") == 0,
                                   text=tool_summary({"command": item.get("command")}))]
            if item.get("type") == "file_change":
                paths = [c.get("path") for c in item.get("changes") or []
                         if isinstance(c, dict) and isinstance(c.get("path"), str)]
                return [AgentEvent("tool_call", name="edit", ok=item.get("status") == "completed",
                                   text=tool_summary({"path": paths}))]
        if kind == "turn.completed":
            usage = event.get("usage") or {}
            return [AgentEvent("usage", input_tokens=int(usage.get("input_tokens") or 0),
                               output_tokens=int(usage.get("output_tokens") or 0))]
        if kind in ("turn.failed", "error"):
            return _limit_events(json.dumps(event))
        return []


class _SettingsJsonAgent(AgentAdapter):
    """Qwen Code and Gemini CLI: `mcpServers` in <dir>/settings.json."""

    settings_dir = ""

    def settings_path(self, root):
        return os.path.join(root, self.settings_dir, "settings.json")

    def server_entry(self, root, role):
        entry = ferrus_server_entry(root, role, self.name)
        # trust: the server's own tools run without a confirmation prompt, which a
        # headless run could never answer.
        entry.update(timeout=client_tool_timeout_secs(self.config) * 1000, trust=True)
        return entry

    def register(self, root, role, model, report):
        key = server_key(role)
        path = self.settings_path(root)
        label = "%s/settings.json" % self.settings_dir

        def add_server(data):
            _json_table(data, "mcpServers", label)[key] = self.server_entry(root, role)
        edit_json_file(path, add_server, label)
        report("Registered %s in %s (agent id %s:%s:%d)"
               % (key, label, role, self.name, DEFAULT_AGENT_INDEX))
        ensure_gitignore_entry(root, label, report)

    def unregister(self, root, role, report):
        path = self.settings_path(root)
        if os.path.exists(path):
            edit_json_file(path, lambda data: data.get("mcpServers", {}).pop(server_key(role), None))
            report("Removed %s from %s/settings.json" % (server_key(role), self.settings_dir))

    def registration(self, root, role):
        return _load_json_quiet(self.settings_path(root)).get("mcpServers", {}).get(
            server_key(role))

    # --approval-mode values; headless, a tool that would need approval is refused.
    _APPROVAL = {}

    def permission_args(self, profile, output=None, reads=()):
        return ["--approval-mode", self._APPROVAL[profile]]

    def _servers_except_ferrus(self, root):
        """The other MCP servers a worker keeps (project and user settings), or a name
        no server has: an allow-list that is never empty excludes ferrus's servers."""
        names = []
        for path in (self.settings_path(root),
                     os.path.join(os.path.expanduser("~"), self.settings_dir, "settings.json")):
            servers = _load_json_quiet(path).get("mcpServers")
            for name in (servers if isinstance(servers, dict) else {}):
                if not name.startswith("ferrus-") and name not in names:
                    names.append(name)
        return names or ["ferrus-no-server"]

    def _worker_argv(self, root, model, output, reads):
        return [self.binary, "--allowed-mcp-server-names"] + \
            self._servers_except_ferrus(root) + _model_args("--model", model) + \
            self.permission_args(WORKER_PERMISSIONS, output, reads) + \
            ["--output-format", "stream-json"] + self.options.extra_args + \
            self.options.headless_args


class QwenCode(_SettingsJsonAgent):
    name = "qwen-code"
    binary = "qwen"
    package = "@qwen-code/qwen-code"
    instructions_file = "QWEN.md"
    settings_dir = ".qwen"

    def _common(self, root, role, model):
        # The server travels on the command line too, so a folder Qwen does not
        # trust (which ignores .qwen/settings.json) still has it; only this
        # role's server is allowed.
        config = {"mcpServers": {server_key(role): self.server_entry(root, role)}}
        return [self.binary, "--mcp-config", json.dumps(config),
                "--allowed-mcp-server-names", server_key(role)] + _model_args("--model", model)

    _APPROVAL = {"read-only": "default", "edit": "auto-edit", "output": "auto-edit",
                 "full": "yolo"}

    def headless(self, root, role, prompt, model="", profile=None):
        argv = self._common(root, role, model) + \
            self.permission_args(self._profile(role, profile)) + \
            ["--output-format", "stream-json"] + \
            self.options.extra_args + self.options.headless_args + [STDIN_PROMPT_POINTER]
        return Launch(argv, prompt, dict(self.options.env))

    def worker(self, root, prompt, model, output, reads=()):
        return Launch(self._worker_argv(root, model, output, reads) + [STDIN_PROMPT_POINTER],
                      prompt, dict(self.options.env))

    def interactive(self, root, role, prompt=None, model=""):
        argv = self._common(root, role, model) + self.options.extra_args + \
            self.options.interactive_args
        if prompt:
            argv.append("--prompt-interactive=" + prompt)
        return Launch(argv, None, dict(self.options.env))

    def parse_line(self, line):
        return _parse_claude_style(line)


class GeminiCli(_SettingsJsonAgent):
    name = "gemini-cli"
    binary = "gemini"
    package = "@google/gemini-cli"
    instructions_file = "GEMINI.md"
    settings_dir = ".gemini"

    _APPROVAL = {"read-only": "default", "edit": "auto_edit", "output": "auto_edit",
                 "full": "yolo"}

    def _common(self, model, role):
        return [self.binary, "--skip-trust", "--allowed-mcp-server-names", server_key(role)] + \
            _model_args("--model", model)

    def _env(self):
        # Gemini ignores project settings (our server included) in a folder the user
        # never trusted.  --skip-trust alone comes too late for that in Gemini CLI
        # 0.61 (the settings are read before the flag), the variable it sets works.
        env = {"GEMINI_CLI_TRUST_WORKSPACE": "true"}
        env.update(self.options.env)
        return env

    def headless(self, root, role, prompt, model="", profile=None):
        argv = self._common(model, role) + self.permission_args(self._profile(role, profile)) + \
            ["--output-format", "stream-json"] + \
            self.options.extra_args + self.options.headless_args + \
            ["--prompt=" + STDIN_PROMPT_POINTER]
        return Launch(argv, prompt, self._env())

    def worker(self, root, prompt, model, output, reads=()):
        argv = self._worker_argv(root, model, output, reads)
        argv.insert(1, "--skip-trust")
        return Launch(argv + ["--prompt=" + STDIN_PROMPT_POINTER], prompt, self._env())

    def interactive(self, root, role, prompt=None, model=""):
        argv = self._common(model, role) + self.options.extra_args + self.options.interactive_args
        if prompt:
            argv.append("--prompt-interactive=" + prompt)
        return Launch(argv, None, self._env())

    def parse_line(self, line):
        try:
            event = json.loads(line)
        except ValueError:
            return _limit_events(line)
        if not isinstance(event, dict):
            return []
        kind = event.get("type")
        if kind == "init" and event.get("session_id"):
            return [AgentEvent("session", name=str(event.get("model") or ""),
                               text=str(event["session_id"]))]
        # Gemini reports no usage per turn: a turn is the model's output between the
        # prompt or tool results (see UsageTally).
        if kind == "tool_use":
            return [AgentEvent("tool_call", name=str(event.get("tool_name") or event.get("name")),
                               text=tool_summary(event.get("parameters"))),
                    AgentEvent("model_output")]
        if kind == "message" and event.get("role") == "assistant":
            return [AgentEvent("model_output")]
        if kind == "tool_result":
            return [AgentEvent("tool_result")]
        if kind == "result":
            stats = event.get("stats") or {}
            return [AgentEvent("usage", input_tokens=int(stats.get("input_tokens") or 0),
                               output_tokens=int(stats.get("output_tokens") or 0), total=True)]
        return []


WORKER_MCP_CONFIG = '{"mcpServers": {}}\n'


class CustomAgent(AgentAdapter):
    """An agent described in ferrus.toml by argv templates.

    Placeholders: {prompt}, {model}, {role}, {mcp_config} (a JSON file with this
    role's ferrus server under mcpServers).  An argument that is exactly
    "{model}" is dropped, with the flag before it, when no model is set."""

    def __init__(self, config, spec):
        self.spec = spec
        self.name = spec.name
        self.binary = spec.interactive[0]
        super().__init__(config)

    def install_hint(self):
        return "install `%s` and put it on PATH" % self.binary

    def version_argv(self):
        return [self.binary] + list(self.spec.version_args)

    def mcp_config_path(self, root, role):
        return os.path.join(root, FERRUS_DIR, "mcp-%s.json" % role)

    def _render(self, template, root, role, prompt, model):
        values = {"{model}": model or "", "{role}": role,
                  "{mcp_config}": self.mcp_config_path(root, role), "{prompt}": prompt or ""}
        argv = []
        for arg in template:
            if arg == "{model}" and not model:
                if argv and argv[-1].startswith("-"):
                    argv.pop()
                continue
            if arg == "{prompt}" and prompt is None:
                continue
            for placeholder, value in values.items():
                arg = arg.replace(placeholder, value)
            argv.append(arg)
        return argv

    def headless(self, root, role, prompt, model="", profile=None):
        stdin = prompt if self.spec.prompt == "stdin" else None
        argv = self._render(self.spec.headless, root, role,
                            None if stdin is not None else prompt, model)
        argv[1:1] = self.options.extra_args + self.options.headless_args
        return Launch(argv, stdin, dict(self.options.env))

    def worker(self, root, prompt, model, output, reads=()):
        """A pipeline worker: {mcp_config} names a file without any ferrus server."""
        path = self.mcp_config_path(root, "worker")
        if read_text(path, default="") != WORKER_MCP_CONFIG:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, WORKER_MCP_CONFIG)
        return self.headless(root, "worker", prompt, model)

    def can_edit(self, profile):
        return None           # its argv templates decide; ferrus adds no flags

    def parse_line(self, line):
        # A custom CLI that prints Claude Code's stream-json events (a wrapper around
        # it, say) gets its tool calls, tokens and cost counted; other output is read
        # for usage-limit messages only.
        return _parse_claude_style(line)

    def interactive(self, root, role, prompt=None, model=""):
        argv = self._render(self.spec.interactive, root, role, prompt, model)
        argv[1:1] = self.options.extra_args + self.options.interactive_args
        return Launch(argv, None, dict(self.options.env))

    def register(self, root, role, model, report):
        path = self.mcp_config_path(root, role)

        def add_server(data):
            _json_table(data, "mcpServers", path)[server_key(role)] = ferrus_server_entry(
                root, role, self.name)
        edit_json_file(path, add_server)
        report("Registered %s in %s/mcp-%s.json (passed to %s as {mcp_config})"
               % (server_key(role), FERRUS_DIR, role, self.name))

    def unregister(self, root, role, report):
        path = self.mcp_config_path(root, role)
        if os.path.exists(path):
            os.unlink(path)
            report("Removed %s/mcp-%s.json" % (FERRUS_DIR, role))

    def registration(self, root, role):
        return _load_json_quiet(self.mcp_config_path(root, role)).get("mcpServers", {}).get(
            server_key(role))


ADAPTERS = {cls.name: cls for cls in (ClaudeCode, Codex, QwenCode, GeminiCli)}


def adapter_for(config, agent):
    if agent not in config.agents.custom:
        agent = canonical_agent(agent)
    if agent in ADAPTERS:
        return ADAPTERS[agent](config)
    if agent in config.agents.custom:
        return CustomAgent(config, config.agents.custom[agent])
    known = BUILTIN_AGENTS + tuple(AGENT_ALIASES) + tuple(config.agents.custom)
    close = did_you_mean(agent, known)
    raise FerrusError("Unknown agent %r. Supported values: %s (or %s for short)" % (
        agent, ", ".join(json.dumps(a) for a in BUILTIN_AGENTS + tuple(config.agents.custom)),
        ", ".join(json.dumps(a) for a in AGENT_ALIASES)),
        ("did you mean %s? Otherwise describe " % json.dumps(close) if close else
         "or describe ") + "it under [agents.custom.<name>] in ferrus.toml")


def probe_version(argv, timeout=10.0):
    """First line of `<agent> --version`, or '' (bounded: upstream had no timeout)."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = result.stdout.strip().splitlines()
    return lines[0].strip() if result.returncode == 0 and lines else ""


# -- register -------------------------------------------------------------------------

def configured_registration(root):
    """What a bare `register` registers: the agents [hq.supervisor] and [hq.executor]
    of ferrus.toml name, with their models."""
    config = Store(root).config().require_hq()
    return {role: (choice.agent, choice.model or None)
            for role, choice in ((role, getattr(config, role, None)) for role in ROLES)
            if choice is not None and choice.agent}


def register_agents(root, choices, trust=False, report=print):
    """`ferrus register`: write each role's agent configuration and update [hq].

    ``choices`` maps role -> (agent, model-or-None).  Everything is validated
    before the first file is written (see
    ARCHITECTURE.md, 'Differences from upstream ferrus', item 11)."""
    if not os.path.exists(os.path.join(root, CONFIG_FILE)):
        raise FerrusError("%s not found — run `ferrus init` first" % CONFIG_FILE)
    config = load_config(root)
    choices = {role: (agent if agent in config.agents.custom else canonical_agent(agent), model)
               for role, (agent, model) in choices.items()}
    adapters = {role: adapter_for(config, agent) for role, (agent, _) in choices.items()}
    # One change set: every file's new content is computed (and every input read
    # and validated) before any is written; the messages follow the commit.
    messages = []
    with FileChanges():
        for role in ROLES:
            if role not in choices:
                continue
            agent, model = choices[role]
            model = (model or "").strip()
            adapter = adapters[role]
            adapter.register(root, role, model, messages.append)
            if adapter.instructions_file:
                add_instruction_section(os.path.join(root, adapter.instructions_file), role,
                                        messages.append)
            if trust:
                trust_project(adapter, root, messages.append)
            update_hq_config(root, role, agent, model if choices[role][1] is not None else None,
                             messages.append)
    for message in messages:
        report(message)


def update_hq_config(root, role, agent, model, report):
    """Set [hq.<role>] agent (and model) in ferrus.toml, keeping every comment.

    Switching to another agent without naming a model clears the old vendor's
    model instead of keeping it (see
    ARCHITECTURE.md, 'Differences from upstream ferrus', item 10); models are trimmed."""
    path = os.path.join(root, CONFIG_FILE)
    text = planned_read(path)
    if text is None:
        raise FerrusError("%s not found — run `ferrus init` first" % CONFIG_FILE)
    try:
        raw = parse_toml(text)
        hq = raw.get("hq", {})
        for other in ROLES:
            flat = hq.get(other) if isinstance(hq, dict) else None
            if isinstance(flat, str):      # legacy flat form: migrate to [hq.<role>]
                text = toml_remove_key(text, ("hq",), other)
                text = toml_set_key(text, ("hq", other), "agent", flat)
        current = ((hq.get(role) if isinstance(hq, dict) else None) or {})
        previous_agent = current.get("agent") if isinstance(current, dict) else current
        text = toml_set_key(text, ("hq", role), "agent", agent)
        if model is not None:
            text = toml_set_key(text, ("hq", role), "model", model.strip())
        elif previous_agent != agent:
            text = toml_set_key(text, ("hq", role), "model", "")
    except TomlError as err:
        raise FerrusError("%s: %s" % (CONFIG_FILE, err),
                          "fix [hq] in %s by hand; nothing was written" % CONFIG_FILE) from err
    planned_write(path, text)
    said = "agent = %s" % json.dumps(agent)
    if model is not None:
        said += ", model = %s" % json.dumps(model.strip()) + (
            " (the agent's own default)" if not model.strip() else "")
    report("Set [hq.%s] %s in %s" % (role, said, CONFIG_FILE))


def trust_project(adapter, root, report):
    """Mark the project trusted in the agent's user config (only with --trust)."""
    home = os.path.expanduser("~")
    root = os.path.abspath(root)
    if adapter.name == "codex":
        path = os.path.join(os.environ.get("CODEX_HOME") or os.path.join(home, ".codex"),
                            "config.toml")
        text = planned_read(path) or ""
        try:
            parse_toml(text)
            new = toml_set_key(text, ("projects", root), "trust_level", "trusted")
        except TomlError as err:
            raise FerrusError("%s: %s" % (path, err),
                              "fix the file by hand first, or register without --trust; "
                              "nothing was written") from err
        if new != text:
            planned_write(path, new)
            report("Trusted %s in %s" % (root, path))
    elif adapter.name in ("gemini-cli", "qwen-code"):
        path = os.path.join(home, "." + adapter.binary, "trustedFolders.json")

        def trust(data):
            data[root] = "TRUST_FOLDER"
        if edit_json_file(path, trust):
            report("Trusted %s in %s" % (root, path))


def unregister_agents(root, roles, report=print):
    config = load_config(root)
    messages = []
    with FileChanges():
        _unregister_roles(root, config, roles, messages.append)
    for message in messages:
        report(message)
    # After the changes are on disk: only then can a file be seen to be empty.
    remove_emptied_registration_files(root, report)


def _unregister_roles(root, config, roles, report):
    for role in roles:
        choice = getattr(config, role)
        agents = [choice.agent] if choice else []
        # Remove what any adapter wrote for this role, whatever [hq] says now.
        for name in BUILTIN_AGENTS + tuple(config.agents.custom):
            adapter = adapter_for(config, name)
            if adapter.registration(root, role) is not None or name in agents:
                adapter.unregister(root, role, report)
                if adapter.instructions_file:
                    remove_instruction_section(os.path.join(root, adapter.instructions_file),
                                               role, report)


# Every file `register` may create or extend, relative to the project root.
REGISTRATION_FILES = (".claude/mcp-supervisor.json", ".claude/mcp-executor.json",
                      ".claude/settings.local.json", ".codex/config.toml", ".qwen/settings.json",
                      ".gemini/settings.json", "CLAUDE.md", "AGENTS.md", "QWEN.md", "GEMINI.md")


def _hollow(value):
    """True for JSON holding nothing but empty objects and arrays."""
    if isinstance(value, dict):
        return all(_hollow(v) for v in value.values())
    if isinstance(value, list):
        return all(_hollow(v) for v in value)
    return False


# What an agent CLI started in a parallel task's worktree reads from its working folder.
# Its task reaches ferrus as FERRUS_SESSION (the session id starts with the task id),
# which the ferrus server inherits from the CLI (Codex passes only the variables its
# env_vars lists).  The server itself comes by absolute path or on the command line for
# Claude Code (--mcp-config), Codex (-c) and Qwen Code (--mcp-config JSON); Gemini CLI
# has no such flag and reads .gemini/settings.json from the folder it starts in, so
# without its copy an agent in a worktree has no ferrus tools.  The other copies keep
# the project's settings for interactive sessions there (Claude's allows ferrus's
# tools).  diff_exclusions keeps them out of every diff and commit.
WORKTREE_AGENT_FILES = (".qwen/settings.json", ".gemini/settings.json",
                        ".claude/settings.local.json")


def copy_agent_configuration(root, worktree):
    """Copy the project's agent registration files into a task's worktree, so an agent
    started there reaches the same ferrus (its servers' -C names the project)."""
    for relative in WORKTREE_AGENT_FILES:
        source = os.path.join(root, *relative.split("/"))
        if not os.path.isfile(source):
            continue
        target = os.path.join(worktree, *relative.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        atomic_write(target, read_text(source))


def remove_emptied_registration_files(root, report):
    """After unregister: delete the registration files left with nothing in them (and
    their .gitignore lines and emptied folders); a file with anything else stays."""
    for rel in REGISTRATION_FILES:
        path = os.path.join(root, *rel.split("/"))
        if not os.path.isfile(path):
            continue
        text = read_text(path)
        if rel.endswith(".json"):
            try:
                empty = _hollow(json.loads(text))
            except ValueError:
                empty = False
        else:
            empty = not text.strip()
        if not empty:
            continue
        os.unlink(path)
        report("Removed %s (nothing else was in it)" % rel)
        remove_gitignore_entry(root, rel, report)
        folder = os.path.dirname(path)
        if folder != root and not os.listdir(folder):
            os.rmdir(folder)


def remove_gitignore_entry(root, entry, report):
    """Drop the exact line ``ensure_gitignore_entry`` added for ``entry``."""
    path = os.path.join(root, ".gitignore")
    text = planned_read(path) or ""
    lines = text.split("\n")
    kept = [line for line in lines if line.rstrip("\r").strip() != entry]
    if len(kept) != len(lines):
        planned_write(path, "\n".join(kept))
        report("Removed %s from .gitignore" % entry)


def agents_report(root, probe=probe_version):
    """`ferrus agents`: per role, the agent, its binary, version and registration."""
    config = load_config(root).require_hq()
    rows = []
    for role in ROLES:
        choice = getattr(config, role)
        if choice is None:
            rows.append({"role": role, "agent": None, "problem": "no [hq.%s] in ferrus.toml" % role,
                         "hint": "ferrus register --%s <agent>" % role})
            continue
        adapter = adapter_for(config, choice.agent)
        path = adapter.executable()
        entry = adapter.registration(root, role)
        profile, source = effective_permissions(config, role)
        row = {"role": role, "agent": choice.agent, "model": choice.model or None,
               "binary": adapter.binary, "path": path,
               "version": probe(adapter.version_argv()) if path else "",
               "registered": entry is not None,
               "points_here": entry_points_here(entry, root),
               "permissions": profile, "permissions_from": source,
               "permission_args": adapter.permission_args(profile)}
        mismatch = entry_mismatch(entry, root) if entry is not None else None
        warnings = permission_warnings(config, role)
        if not path:
            row["problem"] = "%s is not installed" % adapter.binary
            row["hint"] = adapter.install_hint()
        elif entry is None:
            row["problem"] = "no %s entry in its MCP configuration" % server_key(role)
            row["hint"] = "ferrus register --%s %s" % (role, choice.agent)
        elif mismatch and mismatch[0] == "error":
            row["problem"] = mismatch[1]
            row["hint"] = "ferrus register --%s %s" % (role, choice.agent)
        elif mismatch:
            warnings.insert(0, (mismatch[1], "ferrus register --%s %s re-registers it with "
                                "this Python" % (role, choice.agent)))
        if warnings:
            row["warnings"] = [{"warning": text, "hint": hint} for text, hint in warnings]
        rows.append(row)
    return rows


def permission_warnings(config, role):
    """[(warning, hint)] about what a role's headless agent may do: an executor that
    cannot edit fails every task at the check gate."""
    choice = getattr(config, role, None)
    if choice is None:
        return []
    adapter = adapter_for(config, choice.agent)
    profile, source = effective_permissions(config, role)
    warnings = []
    fix = 'set `permissions = "edit"` under [hq.executor] in %s' % CONFIG_FILE
    if role == "executor":
        can_edit = adapter.can_edit(profile)
        if can_edit is False:
            warnings.append(("the executor (%s) cannot edit files: permissions are %s (%s)"
                             % (choice.agent, json.dumps(profile), source), fix))
        elif can_edit is None:
            warnings.append(("ferrus cannot tell whether the executor (%s) may edit files: its "
                             "[agents.custom.%s] argv templates decide" % (choice.agent,
                                                                           choice.agent),
                             "make its headless template grant file edits"))
    if (profile == "full" and isinstance(adapter, ClaudeCode) and hasattr(os, "geteuid")
            and os.geteuid() == 0 and "IS_SANDBOX" not in adapter.options.env):
        # Measured with 2.1.197: "--dangerously-skip-permissions cannot be used with
        # root/sudo privileges for security reasons", and the session ends at once.
        warnings.append(("Claude Code refuses permissions = \"full\" (bypassPermissions) "
                         "when run as root, so the %s would exit at once" % role,
                         "in a sandbox, add `env = { IS_SANDBOX = \"1\" }` under "
                         "[agents.claude-code]; otherwise use \"edit\""))
    flags = {arg.split("=", 1)[0] for arg in adapter.permission_args(profile)
             if arg.startswith("-")}
    options = adapter.options.extra_args + adapter.options.headless_args
    overridden = sorted({arg.split("=", 1)[0] for arg in options} & flags)
    if overridden:
        warnings.append(("[agents.%s] sets %s itself; it follows ferrus's %s flags and may "
                         "change what the %s may do" % (choice.agent, ", ".join(overridden),
                                                        json.dumps(profile), role),
                         "use [hq.%s] permissions instead" % role))
    return warnings


# -- prompts ----------------------------------------------------------------------------
#
# Every headless prompt names the tool calls in the order the agent makes them.

PROMPT_PRECEDENCE = (
    "ROLE.md, SKILL.md, AGENTS.md and CLAUDE.md are supporting context only. If they "
    "conflict with this prompt or with the ferrus MCP tools, this prompt and the tools win.")

_EXECUTOR_RULES = """Rules:
- Run builds, linters and tests only through /check; it runs the project's own gate.
- A green /check is feedback, not a handover: /submit is always required.
- Never edit files under .ferrus/ and never imitate a ferrus tool by hand.
- If a ferrus tool call fails or is cancelled, call the same tool again.
- Consult the supervisor (/consult, following ferrus://consult_template, then
  /wait_for_consult) only about the code or the task, never about the tools.
- Only when neither a retry nor a consultation helps, /ask_human, then
  /wait_for_answer until it answers.
- You run without a terminal: never ask questions in your reply text."""


def _executor_rules(heartbeat_secs):
    """The executor's rules, with ferrus.toml's [lease] heartbeat_interval_secs."""
    return _EXECUTOR_RULES + (
        "\n- Call /heartbeat about every %d seconds while you work (lease.heartbeat_interval_secs) "
        "so your lease stays alive." % heartbeat_secs)


def prompt_task_definition(milestone=None, spec_path=None):
    text = """You are the ferrus supervisor in TASK DEFINITION mode. Your goal is one clear,
executable task for the executor agent.

1. Understand what the user wants; ask clarifying questions until nothing important is open.
2. Draft the exact task text: the outcome, the constraints, and acceptance criteria a
   reviewer can verify.
3. Show the draft and revise it until the user explicitly approves it.
4. Only then call /create_task with the approved text (closely matching the draft), and stop.

Do not implement anything or edit files. /create_task is the only tool that creates work;
never call /create_spec in this mode."""
    if milestone is not None:
        text += """

Selected spec milestone:

Spec: %s
Milestone: %s
Milestone ID: %s
Completed: %s
Depends on: %s

Base the draft on this milestone; still show the exact text and wait for approval.""" % (
            spec_path, milestone.display(), milestone.id, "yes" if milestone.completed else "no",
            ", ".join(milestone.depends_on) or "none")
    return text + "\n\n" + PROMPT_PRECEDENCE


def prompt_plan():
    return ("You are the ferrus supervisor in PLANNING mode: explore ideas with the user, clarify "
            "problems and sketch designs. Stay at the planning level unless the user explicitly "
            "asks for more; no ferrus tool is required. The user's explicit instructions and the "
            "ferrus tools take precedence over ROLE.md, SKILL.md, AGENTS.md and CLAUDE.md.")


def prompt_spec():
    return """You are the ferrus supervisor in SPECIFICATION mode. A spec says WHAT and WHY,
never HOW.

1. Read the resource ferrus://spec_template first and follow its structure exactly.
2. Clarify the goal with the user.
3. Draft the whole spec in Markdown, including a Milestones section: every milestone is a
   `- [ ] #N.M Title` line with a `- ID: mN.M` line and a `- Depends on: none` or
   `- Depends on: #1.0, #1.1` line. Milestones are logical stages, ordered
   prerequisites first, each small enough to become one or more tasks.
4. Show the draft and revise it until the user explicitly approves the full text.
5. Only then call /create_spec with exactly that text, and stop.

No code, no pseudocode, no file edits; never call /create_task in this mode.

""" + PROMPT_PRECEDENCE


def prompt_executor(heartbeat_secs=LeaseConfig.heartbeat_interval_secs):
    return ("You are the ferrus executor, running headless.\n\n"
            "1. Call /wait_for_task first; it returns the task (and review notes to address "
            "after a rejection). On {\"status\":\"timeout\"} call it again.\n"
            "2. Implement the task with the smallest complete change.\n"
            "3. Call /check whenever you want feedback, and again right before submitting.\n"
            "4. Call /submit with notes: what changed, why, and how you verified it. Then stop.\n\n"
            + _executor_rules(heartbeat_secs) + "\n\n" + PROMPT_PRECEDENCE)


def prompt_executor_after_answer(heartbeat_secs=LeaseConfig.heartbeat_interval_secs):
    return ("You are the ferrus executor, resuming after a human answered your question.\n\n"
            "1. Call /wait_for_answer: it returns the human's answer (exactly once).\n"
            "2. Call /wait_for_task to re-read the task and renew your lease.\n"
            "3. Continue the work with the answer in mind; /check, then /submit. Then stop.\n\n"
            + _executor_rules(heartbeat_secs) + "\n\n" + PROMPT_PRECEDENCE)


def prompt_executor_awaiting_answer(heartbeat_secs=LeaseConfig.heartbeat_interval_secs):
    return ("You are the ferrus executor. You asked a human a question and it is still open.\n\n"
            "1. Call /wait_for_answer and keep calling it until it returns the answer.\n"
            "2. Call /wait_for_task to re-read the task, then continue: /check, then /submit. "
            "Then stop.\n\n" + _executor_rules(heartbeat_secs) + "\n\n" + PROMPT_PRECEDENCE)


def prompt_executor_in_consultation(heartbeat_secs=LeaseConfig.heartbeat_interval_secs):
    return ("You are the ferrus executor. You asked the supervisor for guidance "
            "(.ferrus/CONSULT_REQUEST.md exists) and the consultation is still open.\n\n"
            "1. Call /wait_for_consult and keep calling it until it returns the response. Do not "
            "implement anything before that, and never resolve the consultation by hand.\n"
            "2. Then continue as usual: implement, /check, /submit. Then stop.\n\n"
            + _executor_rules(heartbeat_secs) + "\n\n" + PROMPT_PRECEDENCE)


def prompt_reviewer():
    return ("You are the ferrus supervisor in REVIEW mode, running headless.\n\n"
            "1. Call /wait_for_review; on {\"status\":\"timeout\"} call it again.\n"
            "2. Call /review_pending and read the task, the submission notes and the task's "
            "diff: it shows the stat and the first part of the diff against the commit the task "
            "started from; read the resource ferrus://diff for all of it, or "
            "ferrus://diff/<path> for one file.\n"
            "3. Judge correctness, fit to the task and the verification evidence.\n"
            "4. Call /approve (with notes on what you verified), or /reject with concrete, "
            "actionable notes. Then stop.\n\n"
            "Do not fix the code yourself and do not ask the executor to re-run checks by hand "
            "(the gate already ran). Never edit .ferrus/.\n\n" + PROMPT_PRECEDENCE)


def prompt_consultant(resuming=False):
    opening = ("You are the ferrus supervisor in CONSULTATION mode, resuming an open "
               "consultation (.ferrus/CONSULT_REQUEST.md already exists)."
               if resuming else
               "You are the ferrus supervisor in CONSULTATION mode: the executor is blocked and "
               "asked for guidance.")
    return (opening + "\n\n"
            "1. Read ferrus://task and ferrus://consult_request.\n"
            "2. Inspect the code read-only if you need to.\n"
            "3. Answer the question directly with /respond_consult, recommending one option. "
            "Then stop.\n\n"
            "Write no code and change no files (in the repository or in .ferrus/). Only if the "
            "answer cannot be found in the repository and the task, /ask_human, then "
            "/wait_for_answer, then /respond_consult.\n\n" + PROMPT_PRECEDENCE)


def prompt_pipeline_worker(topic, task, reads, output):
    lines = ["You are one worker of a ferrus pipeline.", "", "Topic: %s" % topic, "",
             "Your task: %s" % task, ""]
    if reads:
        lines += ["Read these files first:"] + ["- %s" % path for path in reads] + [""]
    lines += ["Write your complete result to exactly this file: %s" % output,
              "Writing that file is how ferrus knows you are done: write it once, completely, "
              "as your last step. Do not write any other file."]
    return "\n".join(lines)


def executor_prompt_for(data, answer_pending, heartbeat_secs=LeaseConfig.heartbeat_interval_secs):
    """The executor's prompt for the state it resumes in (see
    ARCHITECTURE.md, 'Differences from upstream ferrus', item 29).

    None when no executor is needed (Idle, Complete, Failed, Reviewing,
    AwaitingConfirmation)."""
    if data.state == S.AWAITING_HUMAN:
        if data.paused_state == S.CONSULTATION:
            return prompt_executor_in_consultation(heartbeat_secs)
        if data.paused_state in WORK_STATES:
            return prompt_executor_awaiting_answer(heartbeat_secs)
        return None        # the reviewer asked; the executor has nothing to do
    if data.state == S.CONSULTATION:
        return prompt_executor_in_consultation(heartbeat_secs)
    if data.state in WORK_STATES:
        return (prompt_executor_after_answer(heartbeat_secs) if answer_pending
                else prompt_executor(heartbeat_secs))
    return None


# ============================================================================
# 15. Sessions
# ============================================================================
#
# The engine that runs the loop: agent processes supervised one slot per
# headless role (the session state machine of section 6 decides), the
# one-orchestrator lock, and HqController, which reads the journal in order (so
# no transition is ever missed) and reacts.  The controller knows nothing about
# terminals: `ferrus run` (at the end of this section) and the HQ front ends
# (section 19) feed it input and print what it emits.

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


class AgentProcess:
    """One running agent CLI: its process, its raw log, and what its output said."""

    def __init__(self, launch, root, log_path, parse_line):
        self.log_path = log_path
        self.events = []
        self.tally = UsageTally()  # tool calls, tokens and cost, as the output reports them
        self.lines = 0
        self.last_text = ""        # the last line that was not a JSON event, for heartbeats
        self.fatal = None          # (kind, words, hint): an error no retry can cure
        env = dict(os.environ)
        env.update(launch.env)
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
                        if self.fatal is None:
                            self.fatal = permanent_agent_error(line)
                    except Exception:   # a parser must never take the supervisor down
                        log.debug("unparsable agent output line", exc_info=True)

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


@dataclasses.dataclass
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
    "heartbeat",       # nothing else for a while: slot, secs, tool_calls, last_output
    "session",         # an agent started, exited, backs off or is stopped: slot
    "complete", "failed", "capacity", "pipeline", "notifier", "info")


def first_lines(text, count=4, width=160):
    """The first ``count`` non-blank lines of ``text``, each cut to ``width``."""
    lines = [line.rstrip() for line in (text or "").splitlines() if line.strip()]
    kept = [line if len(line) <= width else line[:width - 1] + "…" for line in lines[:count]]
    if len(lines) > count:
        kept.append("… (%d more lines)" % (len(lines) - count))
    return kept


_CHECK_LOG_TRAILER = re.compile(r"^\[(passed|failed|timed out|cancelled|skipped), exit ")


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


# -- notifications ---------------------------------------------------------------------------
#
# [notify] tells a human who is not watching that the loop needs them or ended: the
# terminal bell (through the front end's ``bell``), a command of the user's (ntfy,
# curl to a webhook, ...) and the desktop's own notifier.  Commands run detached with
# a timeout on a thread of their own, so a failing or hanging one never blocks the
# loop; the first failure is shown, later ones only logged.

NOTIFY_TITLES = {"awaiting_human": "an agent needs your answer", "complete": "task complete",
                 "failed": "task failed", "checkpoint": "capacity checkpoint",
                 "emergency_stop": "capacity emergency stop",
                 "pipeline_delivered": "pipeline delivered", "task_created": "task created",
                 "submitted": "work submitted for review", "rejected": "submission rejected"}


def desktop_notification_argv(title, body):
    """The argv that shows a desktop notification with what this system has (no
    dependency), or None."""
    if sys.platform == "darwin":
        quote = lambda text: json.dumps(text, ensure_ascii=False)   # noqa: E731  "…" and \"
        return ["osascript", "-e", "display notification %s with title %s"
                % (quote(body), quote(title))]
    if IS_WINDOWS:  # pragma: no cover
        script = (
            "[Windows.UI.Notifications.ToastNotificationManager, Windows.UI.Notifications, "
            "ContentType=WindowsRuntime] | Out-Null;"
            "$t = [Windows.UI.Notifications.ToastNotificationManager]::GetTemplateContent("
            "[Windows.UI.Notifications.ToastTemplateType]::ToastText02);"
            "$n = $t.GetElementsByTagName('text');"
            "$n.Item(0).AppendChild($t.CreateTextNode($env:FERRUS_NOTIFY_TITLE)) | Out-Null;"
            "$n.Item(1).AppendChild($t.CreateTextNode($env:FERRUS_NOTIFY_BODY)) | Out-Null;"
            "[Windows.UI.Notifications.ToastNotificationManager]::CreateToastNotifier("
            "'ferrus').Show([Windows.UI.Notifications.ToastNotification]::new($t))")
        return ["powershell", "-NoProfile", "-NonInteractive", "-Command", script]
    if shutil.which("notify-send"):
        # "--" ends the options: the body is an agent's words and may start with "-".
        return ["notify-send", "--app-name=ferrus", "--", title, body]
    return None


def terminal_bell(stream):
    """A function that rings ``stream``'s terminal bell, or None when it is no terminal.
    The bell character is written straight to the stream: say() would show it as text."""
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return None

    def ring():
        stream.write("\a")
        stream.flush()
    return ring


# How long a front end that is ending waits for its notifiers before stopping them.
NOTIFY_EXIT_GRACE_SECS = 5
NOTIFY_STDERR_TAIL_BYTES = 4096     # what is kept of a notifier's stderr, for its warning
# At most this many notifiers (commands and desktop notifications) run at once; one more
# is not started (it would only pile up behind those that hang) and the failure warning
# says so.
NOTIFY_MAX_RUNNING = 4


class Notifier:
    """Announces NOTIFY_EVENTS as [notify] says.  ``emit`` receives the one warning
    about a failing notifier; ``bell()`` rings the front end's bell (None: no terminal).

    Nothing of a notifier runs on the caller's path: notify() starts a thread that
    starts the process and watches it, stopping it at [notify] timeout_secs, so a
    notifier that hangs costs the loop nothing — and no more than NOTIFY_MAX_RUNNING of
    them run at once.  One Notifier serves a whole `ferrus run --parallel` (every task's
    controller), so that bound holds for the run."""

    def __init__(self, store, emit, bell=None):
        self.store = store
        self.emit = emit
        self.bell = bell
        self.failed_once = False
        self.sent = []             # (event, task_id, summary), for tests and `status`
        self.running = []          # (process, what, program, deadline) still unfinished
        self.stopped_at_exit = set()  # pids finish() stopped
        self.skipped = 0           # notifiers not started: NOTIFY_MAX_RUNNING were running
        self._lock = threading.Lock()
        self._alive = 0            # notifiers started and not yet ended (or not yet spawned)
        self._closed = False       # finish() ran: nothing more is started

    def config(self):
        try:
            return self.store.config().notify
        except FerrusError:
            return NotifyConfig()   # a broken ferrus.toml still rings the bell

    def notify(self, event, task_id, summary):
        config = self.config()
        if event not in config.events:
            return
        summary = " ".join((summary or "").split())[:300]
        self.sent.append((event, task_id, summary))
        if config.bell and self.bell is not None:
            with contextlib.suppress(Exception):   # a closed terminal is no reason to stop
                self.bell()
        values = {"{event}": event, "{task_id}": task_id or "", "{summary}": summary}
        env = {"FERRUS_EVENT": event, "FERRUS_TASK_ID": task_id or "",
               "FERRUS_SUMMARY": summary}
        if config.command:
            argv = [self._fill(part, values) for part in config.command]
            self._start("[notify] command", argv, env, config.timeout_secs, event)
        if config.desktop:
            title = "ferrus: %s" % NOTIFY_TITLES.get(event, event)
            argv = desktop_notification_argv(title, summary or title)
            if argv is None:
                self._failed("[notify] desktop", "no desktop notifier was found (notify-send "
                             "on Linux, osascript on macOS, PowerShell on Windows)")
            else:
                self._start("[notify] desktop", argv, dict(env, FERRUS_NOTIFY_TITLE=title,
                                                           FERRUS_NOTIFY_BODY=summary or title),
                            config.timeout_secs, event)

    @staticmethod
    def _fill(part, values):
        for key, value in values.items():
            part = part.replace(key, value)
        return part

    def _start(self, what, argv, env, timeout, event):
        with self._lock:
            if self._closed:
                return
            full = self._alive >= NOTIFY_MAX_RUNNING
            if full:
                self.skipped += 1
            else:
                self._alive += 1
        if full:
            self._failed(what, "%d notifiers are still running (at most %d run at once), so "
                         "the one for %s was not started" % (NOTIFY_MAX_RUNNING,
                                                            NOTIFY_MAX_RUNNING, event))
            return
        threading.Thread(target=self._run, args=(what, argv, env, timeout), daemon=True,
                         name="ferrus-notify").start()

    def _run(self, what, argv, env, timeout):
        try:
            with self._lock:
                if self._closed:
                    return
            try:
                proc = subprocess.Popen(argv, cwd=self.store.root, env=dict(os.environ, **env),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, **process_group_kwargs())
            except OSError as err:
                self._failed(what, "%s could not start: %s" % (argv[0], err.strerror or err))
                return
            with self._lock:
                self.running = [entry for entry in self.running if entry[0].returncode is None]
                self.running.append((proc, what, argv[0], time.monotonic() + timeout))
                closed = self._closed
            if closed:                      # finish() came while it was starting
                self.stopped_at_exit.add(proc.pid)
                kill_process_tree(proc)
            self._watch(what, argv[0], proc, timeout)
        finally:
            with self._lock:
                self._alive -= 1

    def finish(self, grace=NOTIFY_EXIT_GRACE_SECS):
        """At the front end's end: notifiers still running get up to ``grace`` seconds
        (never past their timeout), then are stopped.  Their watch threads die with
        this process, so without this a hung notifier would run on for good."""
        with self._lock:
            self._closed = True
            pending = [entry for entry in self.running if entry[0].poll() is None]
            self.running = []
        if not pending:
            return
        until = min(time.monotonic() + grace, max(entry[3] for entry in pending))
        while time.monotonic() < until and any(e[0].poll() is None for e in pending):
            time.sleep(0.02)
        for proc, what, program, _ in pending:
            if proc.poll() is None:
                self.stopped_at_exit.add(proc.pid)    # reported here, not by its watcher
                kill_process_tree(proc)
                self._failed(what, "%s was still running when ferrus ended and was stopped"
                             % program)

    def _watch(self, what, program, proc, timeout):
        # Only the end of its stderr is kept: a notifier flooding it (until its
        # timeout) must not fill ferrus's memory.
        tail = bytearray()

        def drain():
            with proc.stderr:
                for chunk in iter(lambda: proc.stderr.read(65536), b""):
                    tail.extend(chunk)
                    del tail[:-NOTIFY_STDERR_TAIL_BYTES]
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_tree(proc)
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
            self._failed(what, "%s was still running after %ds and was stopped"
                         % (program, timeout))
            return
        reader.join(5)
        err = bytes(tail)
        if proc.returncode != 0 and proc.pid not in self.stopped_at_exit:
            said = (err or b"").decode("utf-8", "replace").strip().splitlines()
            self._failed(what, "%s exited with code %s%s" % (
                program, proc.returncode, ": " + said[-1][:200] if said else ""))

    def _failed(self, what, why):
        with self._lock:
            first, self.failed_once = not self.failed_once, True
        if not first:
            log.info("%s failed again: %s", what, why)
            return
        self.emit(HqMessage("warning", "%s failed: %s (the loop goes on; later failures are "
                                       "only logged)" % (what, why), "notifier",
                            {"notifier": what, "error": why}))


class SessionSlot:
    """A headless role slot: its session (see ARCHITECTURE.md, 'Session state machine')
    and the process it supervises."""

    def __init__(self, name, limits):
        self.name = name
        self.role = SLOT_ROLES[name]
        self.limits = limits
        self.session = Session(max_consecutive_errors=limits.max_consecutive_errors,
                               max_total_errors=limits.max_total_errors)
        self.process = None
        self.session_id = None     # names the running agent session (its leases carry it)
        self.timer = None          # clock value when the current wait ends
        self.start_seq = 0
        self.tool_calls = 0
        self.started_at = None     # clock value when the running session started
        self.events_shown = 0      # how many of the process's events were reported
        self.record = None         # the running session's record (.ferrus/sessions/)
        self.record_due = 0.0      # clock value after which changed counts are written

    @property
    def state(self):
        return self.session.state

    def label(self):
        """The session state in words: a slot that has nothing to do is idle (its
        machine says Initializing or SessionComplete, which reads like activity)."""
        if self.process is None and self.session.state in (SS.INITIALIZING,
                                                           SS.SESSION_COMPLETE):
            return "idle"
        return self.session.state.value

    def describe(self, tool_calls=None):
        """``tool_calls``: the session's count as the controller knows it (its streamed
        output or its MCP servers' count); without it, only what the output showed."""
        text = "%s: %s" % (self.name, self.label())
        if self.process is not None and self.session.state in (SS.RUNNING, SS.INTERRUPTING):
            text += " (pid %d, %s)" % (self.process.pid, count_tool_calls(
                self.tool_calls if tool_calls is None else tool_calls))
        return text


# -- one orchestrator per project ------------------------------------------------------------
#
# HQ, `ferrus run` and the pipeline orchestrator each hold .ferrus/orchestrator.lock
# (the platform FileLock) for their whole life; .ferrus/orchestrator.json says who
# holds it.  The OS drops the lock when its holder dies however it dies, so a free
# lock with a record left behind means a dead holder: the agents it started are
# stopped (and their leases freed) before the new holder starts anything.

ORCHESTRATOR_LOCK = "orchestrator.lock"
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


def running_orchestrator(store):
    """Who holds the orchestrator lock, read without touching the lock (None: nobody).

    A record whose process is gone on this host was left by a holder that died."""
    record = read_orchestrator_record(store)
    if record is None:
        return None
    pid = record.get("pid")
    if record.get("host") == _host_name() and not (isinstance(pid, int) and pid_alive(pid)):
        return None
    return record


class OrchestratorLock:
    """The project's orchestrator lock, held from acquire() to release().

    ``notes`` lists what taking over from a dead holder did, for the caller to show."""

    def __init__(self, store, kind):
        self.store = store
        self.kind = kind
        self.notes = []
        self._lock = FileLock(store.path(ORCHESTRATOR_LOCK), 0,
                              "%s/%s" % (FERRUS_DIR, ORCHESTRATOR_LOCK))
        self._signals = {}

    def acquire(self):
        try:
            self._lock.acquire()
        except LockTimeout:
            holder = read_orchestrator_record(self.store)
            raise FerrusError(
                "another orchestrator is running on this project: %s"
                % describe_orchestrator(holder),
                "only one of HQ, `ferrus run` and `ferrus pipeline` drives a project at a time; "
                "use that one, or wait for it to end (`ferrus status` and `ferrus log` read "
                "along safely)") from None
        self._stop_on_termination()
        try:
            previous = read_orchestrator_record(self.store)
            if previous is not None and previous.get("pid") != os.getpid():
                self.notes.append("took over from %s, which ended without releasing the "
                                  "project" % describe_orchestrator(previous))
            atomic_write(self.store.path(ORCHESTRATOR_RECORD), pretty_json({
                "pid": os.getpid(), "kind": self.kind, "host": _host_name(),
                "started": format_timestamp(utc_now())}) + "\n")
            self.notes.extend(stop_orphaned_agents(self.store))
            self.notes.extend(close_orphaned_records(self.store))
        except BaseException:
            self.release()
            raise
        return self

    def _stop_on_termination(self):
        """SIGTERM and SIGHUP (a closed terminal, `kill`) end the orchestrator the way
        Ctrl+C does, so its agents are stopped and their leases freed; by default they
        would kill ferrus alone and leave its agents working unsupervised."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in ("SIGTERM", "SIGHUP"):
            number = getattr(signal, name, None)
            if number is not None:
                self._signals[number] = signal.signal(number, _raise_terminated)

    def release(self):
        for number, previous in self._signals.items():
            signal.signal(number, previous)
        self._signals.clear()
        with contextlib.suppress(OSError):
            record = read_orchestrator_record(self.store)
            if record is not None and record.get("pid") == os.getpid():
                os.unlink(self.store.path(ORCHESTRATOR_RECORD))
        self._lock.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP while orchestrating: unwinds like Ctrl+C; exit 128 + signal."""

    def __init__(self, signum):
        super().__init__(signum)
        self.exit_code = 128 + signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def _host_name():
    import platform
    return platform.node() or "this machine"


def _is_agent_group(pid):
    """Is ``pid`` alive and the leader of its own process group, as every agent HQ starts
    is?  A pid reused by an unrelated process is almost never a group leader."""
    if not pid_alive(pid):
        return False
    if IS_WINDOWS:  # pragma: no cover
        return True
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _stop_process_group(pid, grace=2.0):
    if IS_WINDOWS:  # pragma: no cover
        subprocess.run(["taskkill", "/T", "/F", "/PID", str(pid)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline and pid_alive(pid):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.02)
        if not pid_alive(pid):
            return


def stop_orphaned_agents(store, task=None):
    """Stop the agents a dead orchestrator left running (only parallel task ``task``'s,
    when given) and free the leases of their sessions; returns what was done, one line
    each.

    HQ's agents cannot be adopted — their output pipes died with their orchestrator, so
    nobody could read what they report — so they are stopped; the task state in
    STATE.json is kept and the next session starts from it.  Pipeline workers write
    files, not pipes, and are adopted by the pipeline orchestrator instead."""
    path = store.path("agents.json")
    if not os.path.isfile(path):
        return []
    try:
        registry = json.loads(read_text(path) or "{}")
        entries = [e for e in registry.get("agents") or []
                   if isinstance(e, dict) and e.get("status") == "running"
                   and (task is None or session_task(e.get("session")) == task)]
    except (ValueError, OSError, AttributeError) as err:
        return ["could not read %s/agents.json (%s): agents a previous orchestrator started "
                "may still be running" % (FERRUS_DIR, err)]
    notes, sessions = [], []
    for entry in entries:
        pid = entry.get("pid")
        if isinstance(pid, int) and not isinstance(pid, bool) and _is_agent_group(pid):
            _stop_process_group(pid)
            notes.append("stopped the %s (pid %d) that the previous orchestrator left running"
                         % (entry.get("name", "agent"), pid))
        if entry.get("session"):
            sessions.append(entry["session"])
    if entries:
        def mark(data):
            for entry in data.get("agents") or []:
                if isinstance(entry, dict) and entry.get("status") == "running" and (
                        task is None or session_task(entry.get("session")) == task):
                    entry.update(status="suspended", pid=None)
        with contextlib.suppress(FerrusError):
            with store.lock():
                edit_json_file(path, mark)
    by_task = {}
    for session in sessions:
        by_task.setdefault(session_task(session), []).append(session)
    for owner, stopped in sorted(by_task.items(), key=lambda item: item[0] or ""):
        task_store = store if owner is None else store.for_task(owner)
        if owner is not None and not task_store.exists():
            continue
        with contextlib.suppress(FerrusError):
            released = op_release_sessions(task_store, stopped)
            if released:
                notes.append("freed the %s lease, held by the stopped %s" % (
                    "task's" if owner is None else "task %s's" % owner, released))
    return notes


def clear_capacity_checkpoint(store):
    with store.transaction("hq") as tx:
        if "capacity_checkpoint" in tx.state.extra:
            data = tx.state.copy()
            del data.extra["capacity_checkpoint"]
            tx.set(data, "capacity_continue")


# STATE.json's count of the sessions HQ started for the current task.
TASK_SESSIONS_KEY = "task_sessions"


class HqController:
    """The UI-independent HQ: journal in, sessions supervised, messages out.

    ``clock`` is a monotonic clock (injectable so tests never sleep); ``emit``
    receives HqMessage objects; ``launcher`` builds the Launch for a slot (the
    configured adapters by default)."""

    # With an agent running and nothing to report for this long, a heartbeat line says
    # what it is doing (how long, how many tool calls, its last words).
    HEARTBEAT_SECS = 60.0
    CHECK_SCAN_EVERY = 0.25

    def __init__(self, store, emit, clock=time.monotonic, launcher=None, bell=None,
                 executor_agent=None, notifier=None):
        self.store = store
        self.executor_agent = executor_agent    # a parallel task's own executor agent
        self._out = emit
        self.clock = clock
        self.last_activity = clock()
        # A parallel run's controllers share its notifier (``notifier``): a task's end
        # must not wait for, or stop, the notifiers its events started.
        self.notifier = notifier or Notifier(store, self.emit, bell)
        self._owns_notifier = notifier is None
        self.checks_seen = {}         # check id -> (command, clock value when first seen)
        self._next_check_scan = 0.0
        self.launcher = launcher or self._launch_with_adapter
        self.limits = sessions_config(store.root)
        self.slots = {name: SessionSlot(name, self.limits) for name in SLOT_ROLES}
        self._deferred_moves = None   # session moves journaled once _advance is done
        # Entries from before this HQ started are not shown again, and none is read:
        # start-up costs the same whatever the journal's length.
        self.journal_offset = store.journal_position()
        self.cursor = store.last_journal_seq()
        self.start_seq = self.cursor
        self._missing_rev = None
        # Capacity signals HQ counts itself (tool calls come from the MCP servers).
        # Sessions per task live in STATE.json, so limits hold across restarts.
        self.sessions_seed = self._sessions_before_counter()
        self.tasks_completed = 0
        self.baseline = Signals()
        self.throttle_until = None
        self.checkpoint = self.store.read_state().extra.get("capacity_checkpoint")
        self.paused = False           # True until the user agrees to resume a task in flight
        self.finishing_since = None   # when the task ended while agents still ran
        self.shown_question = None
        self.shown_confirmation = None    # (task, entered) whose summary was emitted
        # The state found at start-up is shown by describe_state(), with its own time; only
        # states reached while this controller runs are announced ("Task complete.").
        self.last_state = self.store.read_state().state
        self._parallel_tasks = set()  # ids of tasks known to run in parallel
        self.mirrored = False         # the project's state mirrors a parallel task

    def emit(self, message):
        if not message.event:
            message.event = "session" if message.kind == "agent" else "info"
        self.last_activity = self.clock()
        self._out(message)

    # -- start-up ------------------------------------------------------------------

    def task_in_flight(self):
        """The task HQ would resume agents for, if any.  A task waiting for the human's
        confirmation needs no agent, so there is nothing to ask: HQ shows it at once."""
        data = self.store.read_state()
        return data if data.state in ACTIVE_STATES and not self.mirrors_parallel_task(data) \
            and data.state != S.AWAITING_CONFIRMATION else None

    def mirrors_parallel_task(self, data):
        """The project's STATE.json shows a parallel task (see Store): that task's own
        controller drives it in its worktree, so the project's has nothing to do."""
        return self.store.task is None and bool(data.extra.get(PARALLEL_MIRROR_KEY))

    def _of_parallel_task(self, task):
        """Whether journal entries about ``task`` belong to a parallel task (one with a
        store of its own), which its own controller shows, not the project's."""
        if not task or self.store.task is not None:
            return False
        if task in self._parallel_tasks:
            return True
        # Only a yes is kept: a queued task gets its store when it starts.
        if os.path.isfile(self.store.path(TASKS_DIR, task, STATE_FILE)):
            self._parallel_tasks.add(task)
            return True
        return False

    def describe_state(self):
        data = self.store.read_state()
        now = self.store.clock()
        text = "State %s" % data.state
        if data.task_id:
            text += ", task %s" % data.task_id
        if data.state_entered_at:
            with contextlib.suppress(ValueError):
                entered = parse_timestamp(data.state_entered_at)
                if data.state in (S.COMPLETE, S.FAILED):
                    # A task that ended before now is shown as such, with its own time.
                    text += ", %s at %s (%s ago)" % (
                        "completed" if data.state == S.COMPLETE else "failed",
                        entered.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
                        format_duration((now - entered).total_seconds()))
                else:
                    text += ", for %s" % format_duration((now - entered).total_seconds())
        text += ", check retries %d, review cycles %d" % (data.check_retries, data.review_cycles)
        return text

    # -- the loop --------------------------------------------------------------------

    CAPACITY_CHECK_EVERY = 1.0
    FINISH_GRACE_SECS = 10.0      # how long agents may finish after the task ended

    def poll(self):
        """One step: journal entries in order, agent exits, timers, then reconcile."""
        # What agents and checks started comes before the journal entries it led to: an
        # agent reports a tool call before its result is committed, and a check's pid file
        # is gone before the entry with its result is written.
        for slot in self.slots.values():
            self._show_tool_calls(slot)
        self._watch_checks()
        self.drain_journal()
        for slot in self.slots.values():
            self._check_slot(slot)
        self._watch_capacity()
        if not self.paused:
            self.reconcile()
        self._heartbeat()

    def drain_journal(self):
        entries, self.journal_offset = self.store.journal_since(self.journal_offset,
                                                                after_seq=self.cursor)
        for entry in entries:
            if entry["seq"] > self.cursor:
                self.cursor = entry["seq"]
                if self.store.task is not None and entry.get("task_id") != self.store.task \
                        or self._of_parallel_task(entry.get("task_id")):
                    continue            # another parallel task's: its own controller shows it
                # Complete is reached by the reviewer's approve, or by the human's
                # confirmation when [hq] human_review is on.
                if entry.get("to") == S.COMPLETE.value and entry.get("from") != S.COMPLETE.value \
                        and entry["seq"] > self.start_seq:
                    self.tasks_completed += 1
                self._show_entry(entry)

    def catch_up(self, rev, patience=1.0):
        """Show journal entries up to ``rev``.  STATE.json is written just before its
        journal line, so a state read can be a moment ahead of the journal."""
        self.drain_journal()
        if self.cursor >= rev or rev == self._missing_rev:
            return
        deadline = time.monotonic() + patience
        while self.cursor < rev and time.monotonic() < deadline:
            time.sleep(0.005)
            self.drain_journal()
        if self.cursor < rev:
            # A crash left STATE.json ahead of the journal; doctor (or the next
            # commit) fills the gap.  Do not wait for it on every poll.
            self._missing_rev = rev

    def _show_entry(self, entry):
        event = entry.get("event")
        self._notify_for(entry)
        if event in ("heartbeat", "claim") or entry.get("actor") in ("hq", "pipeline"):
            return
        if event in ("check_passed", "check_failed", "submit"):
            self._show_checks(entry)
        if entry.get("from") != entry.get("to"):
            self.emit(HqMessage("transition", "%s → %s  (%s by %s)" % (
                entry.get("from"), entry.get("to"), event, entry.get("actor")), "transition",
                {"from": entry.get("from"), "to": entry.get("to"), "by": event,
                 "actor": entry.get("actor"), "task_id": entry.get("task_id"),
                 "seq": entry.get("seq")}))
        # What the agents said, from the content files the entry wrote (still current:
        # HQ reads each entry within moments of its commit).
        shown = {"submit": ("SUBMISSION.md", "submission", "submission", 4),
                 "reject": ("REVIEW.md", "review", "review notes", 8),
                 "human_reject": ("REVIEW.md", "review", "the human's review notes", 8),
                 "consult": ("CONSULT_REQUEST.md", "consult", "consultation", 8),
                 "respond_consult": ("CONSULT_RESPONSE.md", "consult_answer",
                                     "the supervisor answers", 8),
                 "answer": ("ANSWER.md", "answer", "answered", 4)}.get(event)
        if shown is not None:
            name, kind, title, count = shown
            said = (entry.get("detail") or {}).get("said")
            lines = [str(line) for line in said] if isinstance(said, list) and said else \
                first_lines(self.store.read_file(name), count)
            if lines:
                key = {"submission": "summary", "review": "notes", "consult": "question"}.get(
                    kind, "answer")
                self.emit(HqMessage("info", "%s:\n  %s" % (title, "\n  ".join(lines)), kind,
                                    {key: "\n".join(lines), "task_id": entry.get("task_id")}))

    def _show_checks(self, entry):
        """One line per check command (the failing ones with their last lines), then the
        gate's verdict, from the entry's detail."""
        detail = entry.get("detail") or {}
        checks = [c for c in detail.get("checks") or [] if isinstance(c, dict)]
        if not checks:
            return
        for check in checks:
            passed = check.get("status") == "passed"
            tail = [] if passed else check_log_tail(self.store, check.get("log"))
            secs = check.get("secs") if isinstance(check.get("secs"), (int, float)) else 0
            took = format_duration(secs) if secs >= 1 else "%.1fs" % secs
            if check.get("status") == "failed" and check.get("exit") is not None:
                took = "exit %s, %s" % (check.get("exit"), took)
            text = "check %s: %s (%s)" % (check.get("status"), check.get("command"), took)
            if tail:
                text += "\n" + "\n".join("    │ " + line for line in tail)
            self.emit(HqMessage("info" if passed else "warning", text, "check",
                                dict(check, tail=tail)))
        passed = entry.get("event") != "check_failed"
        during = "submit" if entry.get("event") == "submit" or \
            detail.get("during") == "submit" else "check"
        if passed:
            text = "checks passed" + (" — submitting for review" if during == "submit" else "")
        else:
            text = "checks failed%s (retry %s); full log %s" % (
                " on submit" if during == "submit" else "", detail.get("retries", "?"),
                detail.get("log"))
        self.emit(HqMessage("info" if passed else "warning", text, "checks", {
            "passed": passed, "during": during, "retries": detail.get("retries"),
            "log": detail.get("log"), "task_id": entry.get("task_id")}))

    def _notify_for(self, entry):
        """The journal entries worth a notification ([notify] picks which)."""
        event, detail, task = entry.get("event"), entry.get("detail") or {}, entry.get("task_id")
        if entry.get("actor") == "pipeline":
            return                      # the pipeline orchestrator announces its own
        if entry.get("to") == S.FAILED.value and entry.get("from") != S.FAILED.value:
            reason = self.store.read_state().failure_reason or event
            self.notifier.notify("failed", task, reason.splitlines()[0] if reason else "")
            return
        if event == "capacity_checkpoint":
            action = detail.get("action")
            self.notifier.notify("emergency_stop" if action == EMERGENCY_STOP else "checkpoint",
                                 task, "capacity %s before %s" % (action, detail.get("target")))
            return
        sources = {"create_task": ("task_created", "TASK.md"),
                   "submit": ("submitted", "SUBMISSION.md"), "reject": ("rejected", "REVIEW.md"),
                   "ask_human": ("awaiting_human", "QUESTION.md"),
                   "approve": ("complete", "TASK.md"), "human_approve": ("complete", "TASK.md"),
                   "human_reject": ("rejected", "REVIEW.md")}
        if event == "approve" and entry.get("to") == S.AWAITING_CONFIRMATION.value:
            # [hq] human_review: the reviewer approved and the human must confirm.
            self.notifier.notify("awaiting_human", task, "the reviewer approved; confirm with "
                                 "`ferrus approve` or send it back with `ferrus reject NOTES`")
            return
        if event in sources:
            name, source = sources[event]
            lines = first_lines(self.store.read_file(source), 1, 200)
            self.notifier.notify(name, task, lines[0] if lines else "")

    def _watch_checks(self):
        """A check command that starts is shown at once (its result comes with the
        journal entry); its pid file in .ferrus/check-processes/ says it runs."""
        now = self.clock()
        if now < self._next_check_scan or self.mirrored:
            return                    # a parallel task's checks are its controller's
        self._next_check_scan = now + self.CHECK_SCAN_EVERY
        running = running_check_commands(self.store)
        for check_id, command in running.items():
            if check_id not in self.checks_seen:
                self.checks_seen[check_id] = (command, now)
                self.emit(HqMessage("info", "check running: %s" % command, "check_started",
                                    {"command": command}))
        for check_id in [c for c in self.checks_seen if c not in running]:
            del self.checks_seen[check_id]

    def _heartbeat(self):
        now = self.clock()
        if now - self.last_activity < self.HEARTBEAT_SECS:
            return
        running = [slot for slot in self.slots.values()
                   if slot.process is not None and slot.started_at is not None]
        if not running:
            self.last_activity = now
            return
        for slot in running:
            calls = self.tool_calls_of(slot)
            secs = now - slot.started_at
            text = "%s working, %s, %d tool call%s" % (slot.name, format_duration(secs), calls,
                                                      "" if calls == 1 else "s")
            checks = ["%s (%s)" % (command, format_duration(now - since))
                      for command, since in self.checks_seen.values()]
            if checks:
                text += "; check running: " + ", ".join(checks)
            said = slot.process.last_text
            if said:
                text += "; last output: " + (said if len(said) <= 100 else said[:99] + "…")
            self.emit(HqMessage("agent", text, "heartbeat", {
                "slot": slot.name, "secs": round(secs, 1), "tool_calls": calls,
                "checks_running": [c for c, _ in self.checks_seen.values()],
                "last_output": said}))

    def tool_calls_of(self, slot):
        """The running session's tool calls: from its own streamed output, or, for an
        agent that streams nothing ferrus reads, its ferrus tool calls (counted by the
        MCP servers it started, which carry its session id — not the task's calls since
        it started, which would include an agent running beside it)."""
        mcp = 0
        with contextlib.suppress(FerrusError, OSError):
            mcp = tool_calls_for_session(self.store, slot.session_id,
                                         self.store.read_state().task_id)
        return max(slot.tool_calls, mcp, 0)

    def needed_slots(self, data):
        answer_pending = bool(self.store.read_file("ANSWER.md").strip())
        needed = {}
        heartbeat = LeaseConfig.heartbeat_interval_secs
        with contextlib.suppress(FerrusError):      # a broken file stops the spawn itself
            heartbeat = self.store.config().lease.heartbeat_interval_secs
        prompt = executor_prompt_for(data, answer_pending, heartbeat)
        if prompt and data.state != S.AWAITING_HUMAN:
            needed["executor"] = prompt
        if data.state == S.REVIEWING:
            needed["reviewer"] = prompt_reviewer()
        if data.state == S.CONSULTATION:
            needed["consultant"] = prompt_consultant(
                resuming=self.slots["consultant"].session.session_seq > 0)
        return needed

    def reconcile(self):
        data = self.store.read_state()
        self.catch_up(data.rev)
        self.mirrored = self.mirrors_parallel_task(data)
        if self.mirrored:
            self.last_state = data.state
            return
        if data.state == S.AWAITING_HUMAN:
            question = self.store.read_file("QUESTION.md").strip()
            if question and question != self.shown_question:
                self.shown_question = question
                self.emit(HqMessage("question", question, "question",
                                    {"question": question, "task_id": data.task_id}))
        else:
            self.shown_question = None
        if data.state == S.AWAITING_CONFIRMATION:
            waiting = (data.task_id, data.state_entered_at)
            if waiting != self.shown_confirmation:
                self.shown_confirmation = waiting
                self.emit(HqMessage("confirm", confirmation_summary(self.store, data),
                                    "confirmation", {"task_id": data.task_id}))
        else:
            self.shown_confirmation = None
        if data.state != self.last_state:
            if data.state == S.COMPLETE:
                commit = data.task_commit or {}
                self.emit(HqMessage("error" if commit.get("error") else "info", "Task complete."
                                    + (" " + describe_task_commit(commit) if commit else ""),
                                    "complete", {"task_id": data.task_id}))
            elif data.state == S.FAILED:
                self.emit(HqMessage("error", "Task failed: %s" % (data.failure_reason or ""),
                                    "failed", {"task_id": data.task_id,
                                               "reason": data.failure_reason}))
            if data.state == S.IDLE:
                self.stop_all(quiet=True)
            # An agent that ended the task (the reviewer's approve) is still saying its
            # last words; they carry its usage and cost, so it gets a moment to exit.
            # While the human decides, too, no agent has anything more to do.
            self.finishing_since = time.monotonic() if data.state in (
                S.COMPLETE, S.FAILED, S.AWAITING_CONFIRMATION, S.INTEGRATING) else None
            self.last_state = data.state
        if self.finishing_since is not None and (
                not self.running() or
                time.monotonic() - self.finishing_since >= self.FINISH_GRACE_SECS):
            self.finishing_since = None
            self.stop_all(quiet=True)
        needed = self.needed_slots(data)
        for name, prompt in needed.items():
            self._advance(self.slots[name], prompt, data)

    def _advance(self, slot, prompt, data):
        """Move a needed slot forward through its session machine towards Running.

        The agent is started first and the session's moves are journaled after it (in
        their order): each is an fsynced commit, and an agent that waits for three of
        them reacts that much later (ARCHITECTURE.md, 'Session state machine')."""
        held = self._deferred_moves is not None      # held for a whole step already
        if not held:
            self._deferred_moves = []
        try:
            session = slot.session
            if session.state in (SS.INITIALIZING, SS.SESSION_COMPLETE):
                self._step(slot, SessionEvent("WorktreeReady"))
            if slot.session.state == SS.BUILDING_PROMPT:
                text = prompt
                if slot.session.urgent:
                    text += "\n\nURGENT message from the operator (act on it first):\n" + \
                        slot.session.urgent
                self._step(slot, SessionEvent("PromptReady", text))
            if slot.session.state == SS.SPAWNING and self._capacity_allows("spawn:" + slot.name):
                self._spawn(slot)
        finally:
            if not held:
                self.release_session_moves()

    def hold_session_moves(self):
        """Journal session moves only at release_session_moves(): a runner polling several
        controllers starts every agent a step needs before it commits their moves."""
        if self._deferred_moves is None:
            self._deferred_moves = []

    def release_session_moves(self):
        moves, self._deferred_moves = self._deferred_moves or [], None
        for move in moves:
            with contextlib.suppress(FerrusError, OSError):
                self._commit_session_move(move)

    # -- capacity gates (ARCHITECTURE.md, 'Capacity gates') --------------------------

    def signals(self, extra_parallel=0):
        data = self.store.read_state()
        task = data.task_id
        for slot in self.running():        # the gate reads what the records say
            self._save_counts(slot, force=True)
        tokens, turns = self._task_tokens_and_turns(task)
        current = Signals(tool_calls=tool_calls_for_task(self.store, task),
                          sessions=self.sessions_of(data) + sum(
                              1 for move in self._deferred_moves or ()
                              if move["to"] == SS.RUNNING.value),   # started, not yet journaled
                          tasks_completed=self.tasks_completed,
                          tokens_used=tokens, turns=turns,
                          parallel_agents=len(self.running()) + extra_parallel)
        base = self.baseline
        # The context is a level, not a count: the fullest running agent's, never rebased.
        context = max([slot.process.tally.context_tokens for slot in self.running()] + [0])
        return Signals(tool_calls=max(0, current.tool_calls - base.tool_calls),
                       sessions=max(0, current.sessions - base.sessions),
                       tasks_completed=max(0, current.tasks_completed - base.tasks_completed),
                       tokens_used=max(0, current.tokens_used - base.tokens_used),
                       parallel_agents=current.parallel_agents,
                       turns=max(0, current.turns - base.turns),
                       context_tokens_used=context,
                       context_tokens_max=self.store.config().capacity.context_window)

    def gate(self, target, extra_parallel=0):
        """Classify the signals, journal the decision and carry out its action."""
        limits = self.store.config().capacity
        if not limits.enabled():
            return CONTINUE
        signals = self.signals(extra_parallel)
        tier, action, worst = classify(signals, limits)
        record = gate_record(target, tier, action, signals, limits, worst)
        with contextlib.suppress(FerrusError, OSError):
            self.store.append_event("hq", "gate", record)
        if action in (CHECKPOINT, EMERGENCY_STOP):
            if action == EMERGENCY_STOP:
                self.stop_all()
            self._set_checkpoint(record)
            self.emit(HqMessage("error", "capacity %s: %s at %s of its limit — %s. Raise the "
                                         "limit in [capacity] or /continue." % (
                action, worst, getattr(signals, worst),
                "every agent was stopped" if action == EMERGENCY_STOP else "no new agents start")))
        elif action == THROTTLE:
            self.emit(HqMessage("warning", "capacity Orange (%s near its limit): waiting %s "
                                           "before starting the next agent" % (
                worst, format_duration(limits.throttle_secs))))
        return action

    def _watch_capacity(self):
        """While agents run, a limit can be crossed between spawns: look once a second
        and stop everything at the emergency level (journaling only then)."""
        now = self.clock()
        if not self.running() or now < getattr(self, "_next_capacity_check", 0):
            return
        self._next_capacity_check = now + self.CAPACITY_CHECK_EVERY
        limits = self.store.config().capacity
        if not limits.enabled() or self.checkpoint:
            return
        _, action, _ = classify(self.signals(), limits)
        if action == EMERGENCY_STOP:     # a Checkpoint only stops the next spawn
            self.gate("running")

    def _capacity_allows(self, target):
        if self.checkpoint:
            return False
        now = self.clock()
        if self.throttle_until is not None:
            if now < self.throttle_until:
                return False
            self.throttle_until = None       # the wait is over: start the agent
            return True
        action = self.gate(target, extra_parallel=1)
        if action == THROTTLE:
            self.throttle_until = now + self.store.config().capacity.throttle_secs
            return self.throttle_until <= now
        return action == CONTINUE

    def _set_checkpoint(self, record):
        self.checkpoint = record
        with contextlib.suppress(FerrusError, OSError):
            with self.store.transaction("hq") as tx:
                data = tx.state.copy()
                data.extra["capacity_checkpoint"] = dict(record, at=format_timestamp(utc_now()))
                tx.set(data, "capacity_checkpoint", target=record["target"],
                       action=record["action"])

    def continue_after_checkpoint(self):
        """/continue: clear the checkpoint; the budget counts again from here."""
        self.checkpoint = None
        self.throttle_until = None
        current = self.signals()
        self.baseline = Signals(tool_calls=self.baseline.tool_calls + current.tool_calls,
                                sessions=self.baseline.sessions + current.sessions,
                                tasks_completed=self.baseline.tasks_completed +
                                current.tasks_completed,
                                tokens_used=self.baseline.tokens_used + current.tokens_used,
                                turns=self.baseline.turns + current.turns)
        clear_capacity_checkpoint(self.store)

    def recheck_checkpoint(self):
        """After limits were raised: clear the checkpoint if the gate now lets work go on."""
        if not self.checkpoint:
            return True
        limits = self.store.config().capacity
        tier, action, _ = classify(self.signals(), limits)
        if action in (CONTINUE, THROTTLE):
            self.checkpoint = None
            clear_capacity_checkpoint(self.store)
            self.emit(HqMessage("info", "capacity is %s again; continuing" % tier))
            return True
        return False

    def _spawn(self, slot):
        try:
            launch, parse_line = self.launcher(slot)
        except FerrusError as err:
            self._step(slot, SessionEvent("FatalError", err.full_text()))
            return
        stamp = utc_now().strftime("%Y%m%dT%H%M%S")
        log_path = self.store.path("logs", "%s%s_%s_%d.log" % (
            self.store.task + "_" if self.store.task else "", slot.name, stamp,
            slot.session.session_seq))
        # The agent's `ferrus serve` inherits this id and puts it in its lease holder id,
        # so a lease names this one session, not just <role>:<agent>:<index>; an agent of
        # a parallel task finds its task in it.
        slot.session_id = session_id_for_task(self.store.task) if self.store.task \
            else new_id("s")
        launch = dataclasses.replace(launch, env=dict(launch.env,
                                                      **{SESSION_ENV: slot.session_id}))
        try:
            slot.process = AgentProcess(launch, self.store.workdir, log_path, parse_line)
        except OSError as err:
            self.emit(HqMessage("error", "could not start the %s (%s): %s%s" % (
                slot.name, launch.argv[0], err.strerror or err, _spawn_error_hint(err))))
            self._open_record(slot, launch, log_path, None)
            self._close_record(slot, None, "not started", note="%s: %s" % (
                launch.argv[0], err.strerror or err))
            # A start that fails counts as a failed session: back off, retry, and stop
            # at the thresholds instead of waiting for a timer never armed.
            self._step(slot, SessionEvent("SessionExited", outcome="error"))
            self._arm_backoff(slot)
            return
        slot.start_seq = self.store.last_journal_seq()
        slot.timer = self.clock() + self.limits.timeout_secs
        slot.tool_calls = slot.events_shown = 0
        slot.started_at = self.clock()
        # Said as soon as the process exists; its records follow.
        self.emit(HqMessage("agent", "started the %s (pid %d), log %s" % (
            slot.name, slot.process.pid, self.store.relpath(log_path))))
        self._open_record(slot, launch, log_path, slot.process.pid)
        self._step(slot, SessionEvent("SessionStarted", slot.session.session_seq))
        self._record_agent(slot, "running")

    def agent_choice(self, role, config=None):
        """The agent (and model) that plays ``role`` here: [hq.<role>], or for a parallel
        task's executor the agent its queue record names."""
        config = config or self.store.config()
        choice = getattr(config, role)
        wanted = self.executor_agent if role == "executor" else None
        if wanted and (choice is None or choice.agent != wanted):
            return AgentChoice(agent=wanted)
        return choice

    def _launch_with_adapter(self, slot):
        config = self.store.config().require_hq()
        choice = self.agent_choice(slot.role, config)
        if choice is None:
            raise FerrusError("no [hq.%s] agent in ferrus.toml" % slot.role,
                              "ferrus register --%s <agent>" % slot.role)
        adapter = adapter_for(config, choice.agent)
        if not adapter.executable():
            raise FerrusError("%s is not installed" % adapter.binary, adapter.install_hint())
        return adapter.headless(self.store.root, slot.role, slot.session.prompt,
                                choice.model), adapter.parse_line

    def _check_slot(self, slot):
        process = slot.process
        now = self.clock()
        if process is not None:
            slot.tool_calls = process.tally.tool_calls
            self._save_counts(slot)
            self._show_tool_calls(slot)
        if slot.state == SS.RUNNING and process is not None:
            if process.exited():
                self._on_exit(slot)
            elif slot.timer is not None and now >= slot.timer:
                self.emit(HqMessage("warning", "the %s ran past [sessions] timeout_secs; "
                                               "stopping it" % slot.name))
                process.terminate()
                process.finish()
                slot.process = None
                self._record_agent(slot, "suspended")
                self._close_record(slot, process, "timeout")
                self._step(slot, SessionEvent("SessionExited", outcome="timeout"))
                self._arm_backoff(slot)
        elif slot.state == SS.INTERRUPTING and process is not None:
            if process.exited():
                process.finish()
                slot.process = None
                self._record_agent(slot, "suspended")
                self._close_record(slot, process, "interrupted")
                self._step(slot, SessionEvent("SessionExited", outcome="interrupted"))
            elif slot.timer is not None and now >= slot.timer:
                self._step(slot, SessionEvent("GraceExceeded"))
        elif slot.state == SS.COOLING_DOWN and slot.timer is not None and now >= slot.timer:
            slot.timer = None
            self._step(slot, SessionEvent("BackoffElapsed"))

    def _show_tool_calls(self, slot):
        """One compact line per tool call the agent's streamed output reported."""
        if slot.process is None:
            return
        events = slot.process.events[slot.events_shown:]
        slot.events_shown += len(events)
        for event in events:
            if event.kind == "tool_call":
                line = tool_line(slot.name, event.name, event.text, self.store.root)
                self.emit(HqMessage("agent", line, "tool_call", {
                    "slot": slot.name, "tool": event.name, "input": event.text,
                    "ok": event.ok}))

    def _on_exit(self, slot):
        process = slot.process
        code = process.finish()
        slot.process = None
        self._record_agent(slot, "suspended")
        progressed = any(entry.get("event") in SLOT_PROGRESS[slot.name]
                         or (entry.get("from") != entry.get("to") and entry.get("actor") != "hq")
                         for entry in self.store.read_journal(after_seq=slot.start_seq))
        limit = process.limit()
        self._close_record(slot, process, "usage limit" if limit and not progressed else
                           "success" if code == 0 and progressed else
                           "agent error" if process.fatal is not None and not progressed else
                           "no progress" if code == 0 else "error",
                           note=("resets %s" % limit if limit and not progressed else
                                 process.fatal[1] if process.fatal is not None and not progressed
                                 else None))
        if limit and not progressed:
            wait = usage_limit_wait(limit)
            self.emit(HqMessage("warning", "the %s hit its usage limit (resets %s); waiting "
                                           "%s instead of retrying" % (slot.name, limit,
                                                                        format_duration(wait))))
            slot.session = dataclasses.replace(slot.session, state=SS.COOLING_DOWN)
            slot.timer = self.clock() + wait
            return
        if code == 0 and progressed:
            self._step(slot, SessionEvent("SessionExited", outcome="success"))
            return
        if process.fatal is not None and not progressed:
            # Not logged in, a bad key, an unknown model or flag: retrying only repeats it.
            kind, words, hint = process.fatal
            self.emit(HqMessage("error", "the %s cannot work: %s said: %s" % (
                slot.name, os.path.basename(process.argv0), words)))
            self._step(slot, SessionEvent("FatalError", "%s\nhint: %s (log: %s)" % (
                {"login": "the agent is not logged in or its key is refused",
                 "model": "the agent does not know its model",
                 "flag": "the agent refused an option"}[kind],
                hint, self.store.relpath(process.log_path))))
            return
        if code == 0:
            self.emit(HqMessage("warning", "the %s exited without calling %s; restarting it" % (
                slot.name, " or ".join(SLOT_PROGRESS[slot.name][:2]))))
        else:
            self.emit(HqMessage("warning", "the %s exited with code %s; see %s" % (
                slot.name, code, self.store.relpath(process.log_path))))
        self._step(slot, SessionEvent("SessionExited", outcome="error"))
        self._arm_backoff(slot)

    def _arm_backoff(self, slot):
        if slot.state == SS.COOLING_DOWN:
            slot.timer = self.clock() + slot.session.backoff_ms / 1000.0
            self.emit(HqMessage("info", "retrying the %s in %s (error %d in a row)" % (
                slot.name, format_duration(slot.session.backoff_ms / 1000.0),
                slot.session.consecutive_errors)))

    def _step(self, slot, event):
        before = slot.session.state
        slot.session, effect = session_step(slot.session, event)
        if effect == CANCEL_SESSION and slot.process is not None:
            if slot.session.state == SS.STOPPED:
                process = slot.process
                process.terminate()
                process.finish()
                slot.process = None
                self._record_agent(slot, "suspended")
                self._close_record(slot, process, "stopped")
            else:
                self._interrupt(slot)
        elif effect == FORCE_STOP_SESSION and slot.process is not None:
            process = slot.process
            process.terminate(grace=0)
            process.finish()
            slot.process = None
            self._record_agent(slot, "suspended")
            self._close_record(slot, process, "killed", note="it outlived interrupt_grace_secs")
        elif isinstance(effect, tuple) and effect[0] == LOG_FATAL:
            self.emit(HqMessage("error", "the %s is stopped: %s" % (slot.name, effect[1])))
        if slot.session.state != before:
            if self._deferred_moves is not None:      # journaled once the agent started
                self._deferred_moves.append(self._session_move(slot, before, event))
                return
            with contextlib.suppress(FerrusError, OSError):
                self._journal_session(slot, before, event)

    def _journal_session(self, slot, before, event):
        self._commit_session_move(self._session_move(slot, before, event))

    @staticmethod
    def _session_move(slot, before, event):
        """A session's move as its journal entry's detail, taken when it happens."""
        return {"slot": slot.name, "from": before.value, "to": slot.session.state.value,
                "seq": slot.session.session_seq, "trigger": event.kind,
                "pid": slot.process.pid if slot.process else None}

    def _commit_session_move(self, move):
        """Journal a session's move; a start also counts in STATE.json, so the sessions
        a task had are known after a restart without reading the journal."""
        with self.store.transaction("hq") as tx:
            tx.set(tx.state, "session")
            tx.detail.update(move)
            if move["to"] == SS.RUNNING.value:
                tx.state.extra[TASK_SESSIONS_KEY] = {"task_id": tx.state.task_id,
                                                     "sessions": self.sessions_of(tx.state) + 1}

    # How far back a project from before STATE.json counted sessions is searched.
    SESSION_SCAN_LIMIT = 10000

    def _sessions_before_counter(self):
        """The current task's session starts, for a STATE.json written before it counted
        them: the task's own entries at the journal's end, read backwards (bounded)."""
        data = self.store.read_state()
        counter = data.extra.get(TASK_SESSIONS_KEY)
        if data.task_id is None or (isinstance(counter, dict) and
                                    counter.get("task_id") == data.task_id):
            return {}
        count = 0
        entries = self.store.journal_entries_backwards()
        for entry in itertools.islice(entries, self.SESSION_SCAN_LIMIT):
            if entry.get("task_id") != data.task_id or entry.get("event") == "create_task":
                break
            if entry.get("event") == "session" and (entry.get("detail") or {}).get(
                    "to") == SS.RUNNING.value:
                count += 1
        return {data.task_id: count}

    def sessions_of(self, data):
        """Sessions started for ``data``'s task so far (all HQs, across restarts)."""
        counter = data.extra.get(TASK_SESSIONS_KEY)
        if isinstance(counter, dict) and counter.get("task_id") == data.task_id and \
                isinstance(counter.get("sessions"), int):
            return counter["sessions"]
        return self.sessions_seed.get(data.task_id, 0)

    def _interrupt(self, slot):
        """TERM the process group now; KILL after the grace period (GraceExceeded)."""
        if IS_WINDOWS:  # pragma: no cover
            slot.process.terminate(grace=0)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(slot.process.pid, signal.SIGTERM)
        slot.timer = self.clock() + self.limits.interrupt_grace_secs

    # -- session records ---------------------------------------------------------------

    def _open_record(self, slot, launch, log_path, pid):
        agent, model = "unknown", ""
        with contextlib.suppress(FerrusError):
            choice = self.agent_choice(slot.role)
            if choice is not None:
                agent, model = choice.agent, choice.model or ""
        slot.record = open_session_record(
            self.store, slot.session_id, slot=slot.name, role=slot.role, agent=agent,
            model=model, task_id=self.store.read_state().task_id, pid=pid,
            log=self.store.relpath(log_path), argv=list(launch.argv), prompt=slot.session.prompt)
        slot.record_due = self.clock() + SESSION_RECORD_EVERY

    def _save_counts(self, slot, force=False):
        """Persist a running session's counts, at most once a second unless forced."""
        now = self.clock()
        if slot.record is None or slot.process is None or (not force and now < slot.record_due):
            return
        slot.record_due = now + SESSION_RECORD_EVERY
        update_session_counts(self.store, slot.record, slot.process.tally,
                              self.tool_calls_of(slot))

    def _close_record(self, slot, process, outcome, note=None):
        record, slot.record = slot.record, None
        if record is not None:
            close_session_record(self.store, record, outcome,
                                 process.proc.returncode if process is not None else None,
                                 process.tally if process is not None else None, note,
                                 self.tool_calls_of(slot))

    def _task_tokens_and_turns(self, task):
        records = [r for r in read_session_records(self.store)
                   if task and r.get("task_id") == task]
        summary = usage_summary(records)
        return (summary["input_tokens"] + summary["output_tokens"],
                sum(int(_number(r.get("turns"))) for r in records))

    def _record_agent(self, slot, status):
        """Keep .ferrus/agents.json current (entries keyed by slot and pid)."""
        path = self.store.path("agents.json")
        process = slot.process
        name = "%s %s" % (self.store.task, slot.name) if self.store.task else slot.name

        def update(data):
            agents = data.setdefault("agents", [])
            entry = next((a for a in agents if a.get("name") == name), None)
            if entry is None:
                entry = {"name": name}
                if self.store.task:
                    entry["task"] = self.store.task
                agents.append(entry)
            choice = None
            with contextlib.suppress(FerrusError):
                choice = self.agent_choice(slot.role)
            # agent_type is required by upstream's reader of this file.
            entry.update(role=slot.role, status=status,
                         agent_type=choice.agent if choice else entry.get("agent_type", "unknown"),
                         pid=process.pid if process is not None and status == "running" else None,
                         started_at=format_timestamp(utc_now()) if status == "running"
                         else entry.get("started_at"),
                         session=slot.session_id if status == "running" else
                         entry.get("session"))
        with contextlib.suppress(FerrusError, OSError):
            with self.store.lock():
                edit_json_file(path, update)
        if status != "running" and slot.session_id:
            # The session is over: a lease it still holds protects nothing, and the next
            # session (a new id) should not wait ttl_secs for it.
            with contextlib.suppress(FerrusError, OSError):
                op_release_sessions(self.store, [slot.session_id])

    # -- operator actions ------------------------------------------------------------

    def tell(self, slot_name, message):
        slot = self.slots.get(slot_name)
        if slot is None:
            raise UsageError("unknown role %r: use %s" % (slot_name, ", ".join(self.slots)))
        if slot.state != SS.RUNNING:
            slot.session = dataclasses.replace(slot.session, urgent=message)
            self.emit(HqMessage("info", "the %s is not running; its next prompt carries the "
                                        "message" % slot_name))
            return
        self._step(slot, SessionEvent("UrgentMessage", message))
        self.emit(HqMessage("info", "interrupting the %s; it restarts with your message" %
                                    slot_name))

    def stop_all(self, quiet=False):
        for slot in self.slots.values():
            running = slot.process is not None
            # An idle slot (nothing running, nothing pending) has nothing to stop: it only
            # starts afresh below, without a journal entry (an fsynced commit) saying so.
            if running or slot.state not in (SS.INITIALIZING, SS.SESSION_COMPLETE):
                self._step(slot, SessionEvent("OperatorStop"))
            if running and not quiet:
                self.emit(HqMessage("info", "stopped the %s" % slot.name))
            # A stopped slot starts afresh the next time its role is needed.
            slot.session = Session(max_consecutive_errors=self.limits.max_consecutive_errors,
                                   max_total_errors=self.limits.max_total_errors)
            slot.timer = None

    def restart_slots(self):
        """/resume: give stopped slots a fresh session so reconcile starts them again."""
        for slot in self.slots.values():
            if slot.state == SS.STOPPED:
                slot.session = Session(max_consecutive_errors=self.limits.max_consecutive_errors,
                                       max_total_errors=self.limits.max_total_errors)
        self.paused = False

    def running(self):
        return [slot for slot in self.slots.values() if slot.process is not None]

    def wind_down(self, poll_interval=0.02):
        """Let the agents still running after the task ended exit on their own (at most
        FINISH_GRACE_SECS), so their records get their final usage."""
        deadline = time.monotonic() + self.FINISH_GRACE_SECS + 1.0
        # The caller may have read the ending state before this controller did: one
        # poll lets it see the ending (and start the grace) first.
        self.poll()
        while self.finishing_since is not None and time.monotonic() < deadline:
            time.sleep(poll_interval)
            self.poll()

    def shutdown(self):
        stopped = False
        for slot in self.slots.values():
            if slot.process is not None:
                process = slot.process
                process.terminate()
                process.finish()
                slot.process = None
                self._record_agent(slot, "suspended")
                self._close_record(slot, process, "stopped", note="its orchestrator ended")
                stopped = True
        if stopped:
            # A check runs in a process group of its own, so stopping the agent's group
            # left it running (its MCP server was killed before it could end it).
            for message in end_orphaned_checks(self.store.dir):
                log.info("stopped with its agent: %s", message)
        if self._owns_notifier:
            self.notifier.finish()


# -- `ferrus run`: the loop without any UI ---------------------------------------------

RUN_COMPLETE, RUN_FAILED, RUN_TIMEOUT, RUN_NEEDS_HUMAN = 0, 1, 3, 4
RUN_CHECKPOINT = 3      # a capacity Checkpoint or EmergencyStop also ends the run with 3


RUN_OUTPUT_MODES = ("lines", "quiet", "json")
# What `ferrus run --quiet` leaves out: the running commentary, not what happened.
QUIET_EVENTS = ("tool_call", "heartbeat", "check_started", "session")


# -- parallel tasks: the queue worked through the phase machine ------------------------------
#
# ParallelRunner drives up to [parallel] max_tasks tasks of the queue at once, each in its
# own git worktree, with one HqController per task over that task's store, so each task's
# sessions, leases, gates and messages are exactly those of a single task.  The phase machine
# (Capacity gates) says what the runner does next; the controllers are polled in every phase,
# so agents already at work never wait for it.  .ferrus/parallel.json keeps the phase, the
# batch and its dispatch records across a crash: the next run goes from P0 straight back to
# the phase that was interrupted (ARCHITECTURE.md, 'Parallel tasks', has the mapping).

PARALLEL_RUN_FILE = "parallel.json"
ORCHESTRATOR = Caller("hq", "ferrus")
# How long an integration that waits (the target's checkout is dirty) waits between tries.
INTEGRATION_RETRY_SECS = 5.0


def read_parallel_run(store):
    """.ferrus/parallel.json as a dict ({} when there is none or it is damaged)."""
    return load_parallel_run(store)[0]


def load_parallel_run(store):
    """(.ferrus/parallel.json as a dict, None), or ({}, what is wrong with it); ({}, None)
    when there is none."""
    try:
        text = read_text(store.path(PARALLEL_RUN_FILE), default="")
    except OSError as err:
        return {}, "it cannot be read: %s" % (err.strerror or err)
    if not text.strip():
        return {}, None
    try:
        run = json.loads(text)
    except ValueError as err:
        return {}, "not valid JSON: %s" % terminal_safe(str(err))[:120]
    problem = parallel_run_problem(run)
    return ({}, problem) if problem else (run, None)


def parallel_run_problem(run):
    """What is wrong with ``run`` as parallel.json's content (what ParallelRunner._save
    writes), or None."""
    if not isinstance(run, dict):
        return "not a JSON object"
    phase = run.get("phase")
    if phase is not None and (isinstance(phase, bool) or not isinstance(phase, int) or
                              not 0 <= phase <= 7):
        return "phase %s is none of 0 to 7" % _shown(phase)
    batch = run.get("batch")
    if batch is not None and not (isinstance(batch, list) and all(
            isinstance(task, str) and _TASK_ID_RE.match(task) for task in batch)):
        return "batch is %s, not a list of task ids" % _shown(batch)
    dispatch = run.get("dispatch")
    fields = [field.name for field in dataclasses.fields(DispatchRecord)]
    if dispatch is not None and not (isinstance(dispatch, list) and all(
            isinstance(saved, dict) and set(saved) <= set(fields) and
            all(isinstance(saved.get(name, ""), str) for name in fields) and
            "task_id" in saved for saved in dispatch)):
        return "dispatch is %s, not a list of dispatch records" % _shown(dispatch)
    target = run.get("target")
    if target is not None and (not isinstance(target, str) or
                               git_branch_name_problem(target)):
        return "target %s is no branch name" % _shown(target)
    if not isinstance(run.get("ended", False), bool):
        return "ended is %s, not true or false" % _shown(run["ended"])
    pid = run.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int)):
        return "pid is %s, not a process id" % _shown(pid)
    return None


def live_parallel_run(store):
    """The orchestrator record of the `ferrus run --parallel` working this project now
    (it holds the orchestrator lock and wrote parallel.json), else None."""
    holder = running_orchestrator(store)
    run = read_parallel_run(store)
    if holder is None or run.get("ended") or holder.get("pid") != run.get("pid"):
        return None
    return holder


class ParallelRunner:
    """The task queue, worked ``max_tasks`` at a time in git worktrees (see above).

    ``emit`` receives HqMessage objects (a task's carry its id in ``data``);
    ``ask``/``review`` answer questions and confirmations as in run_loop (None: nobody
    here can)."""

    def __init__(self, store, emit, max_tasks=None, clock=time.monotonic, launcher=None,
                 bell=None, ask=None, review=None):
        self.store = store
        self._out = emit
        config = store.config()
        self.parallel = config.parallel
        self.max_tasks = max_tasks or self.parallel.max_tasks
        self.clock = clock
        self.launcher = launcher
        self.bell = bell
        self.ask, self.review = ask, review
        self.controllers = {}          # task -> HqController of a task in flight
        self.machine = PhaseMachine()
        self.batch = []                # the tasks P1 chose for this cycle
        self.dispatched = []           # DispatchRecords of this cycle
        self.target = None             # the branch tasks merge into
        self.repo = None
        self.worktree_dir = None
        self.integration = None        # {"task", "thread", "result"} while one runs
        self.held_candidate = None     # (task, Integration) checked, waiting to fast-forward
        self.retry_at = None           # when a waiting integration is tried again
        self.waiting_said = None
        self.ended = collections.OrderedDict()   # task -> status, for the report
        self.damaged = {}              # task -> what is wrong with its task.json (said once)
        self.notifier = Notifier(store, self.emit, bell)    # every task's controller's
        self.waiting_human = set()
        self.checkpoint = None
        self.finished = False
        self.tasks_completed = 0
        self._seen = None              # what step() last judged the tasks by
        self._queued = None            # (state stamp, queued task ids)
        self._integrating = None       # (state stamp, controllers, tasks to integrate)

    # -- messages --------------------------------------------------------------------------

    def emit(self, message):
        if not message.event:
            message.event = "run"
        self._out(message)

    def note(self, text, level="info", **data):
        self.emit(HqMessage(level, "ferrus run: " + text, "run", data))

    def _task_emitter(self, task):
        prefix = "[%s] " % short_task_id(task)

        def emit(message):
            message.text = prefix + message.text
            message.data = dict(message.data or {}, task_id=task)
            self._out(message)
        return emit

    # -- persistence -----------------------------------------------------------------------

    def _save(self, working=True):
        """``working`` False: this process no longer works the queue (HQ's /stop), so a
        cancel from another shell cleans up after itself (see live_parallel_run)."""
        record = {"phase": self.machine.phase, "target": self.target, "batch": self.batch,
                  "dispatch": [dataclasses.asdict(r) for r in self.dispatched],
                  "ended": self.finished, "pid": os.getpid() if working else None,
                  "updated_at": format_timestamp(self.store.clock())}
        with self.store.lock():
            atomic_write(self.store.path(PARALLEL_RUN_FILE), pretty_json(record))

    def signals(self):
        """The run's usage: every task's sessions, calls, turns and tokens, summed; the
        largest context any running agent holds."""
        totals = collections.Counter()
        context = 0
        for controller in self.controllers.values():
            signals = controller.signals()
            for name in ("tool_calls", "sessions", "tokens_used", "turns"):
                totals[name] += getattr(signals, name)
            totals["parallel_agents"] += len(controller.running())
            context = max(context, signals.context_tokens_used)
        return Signals(tasks_completed=self.tasks_completed, context_tokens_used=context,
                       context_tokens_max=self.store.config().capacity.context_window,
                       **totals)

    def advance(self, target):
        """One phase transition: the gate decides, the journal records it (GateRecord)."""
        try:
            _, record = self.machine.transition(target, self.signals(),
                                                self.store.config().capacity)
        except ShutdownRequired as stop:
            self._journal_phase(stop.record)
            self.checkpoint = stop.record
            if stop.action == EMERGENCY_STOP:
                for controller in self.controllers.values():
                    controller.stop_all()
            self.note("capacity %s before %s: %s reached its limit; %s" % (
                stop.action, phase_label(target), stop.record.get("signal") or "a signal",
                "every agent was stopped" if stop.action == EMERGENCY_STOP
                else "nothing new starts"), "error", checkpoint=stop.record)
            self._save()
            return False
        # parallel.json first, the journal line last (as a commit writes STATE.json before
        # its line): whoever reads the new phase in the journal finds it saved for recovery.
        self._save()
        self._journal_phase(record)
        return True

    def _journal_phase(self, record):
        with contextlib.suppress(FerrusError, OSError):
            self.store.append_event("ferrus", "phase", record, task_id="")

    def continue_after_checkpoint(self):
        """HQ's /continue after a capacity checkpoint: the budget counts again from here
        (every task's, and the run's completed tasks), and the refused phase is tried
        again at the next step."""
        self.checkpoint = None
        self.tasks_completed = 0
        for controller in self.controllers.values():
            controller.continue_after_checkpoint()

    # -- the loop ------------------------------------------------------------------------

    def start(self):
        """P0: preflight, and the recovery of whatever a crashed run left."""
        try:
            self.repo = git_repository(self.store.root)
        except GitUnavailable as err:
            raise FerrusError("parallel tasks need a git repository: %s" % err.message,
                              "run `git init` and commit once, or run one task at a time "
                              "([parallel] max_tasks = 1)") from err
        if self.repo.operation_in_progress():
            raise FerrusError("a %s is in progress in the checkout"
                              % self.repo.operation_in_progress(),
                              "finish or abort it first: tasks merge into the target branch")
        previous, problem = load_parallel_run(self.store)
        if problem:
            self.note("%s/%s is damaged (%s): this run starts afresh from P1 (`ferrus doctor "
                      "--fix` sets the file aside)" % (FERRUS_DIR, PARALLEL_RUN_FILE, problem),
                      "warning")
        saved_target = previous.get("target") if not previous.get("ended") else None
        self.target = self.parallel.target or saved_target or current_branch(self.store.root)
        if self.target == saved_target and self.target != current_branch(self.store.root) \
                and target_head(self.store.root, self.target) is None:
            # The branch the interrupted run merged into was deleted or renamed since: the
            # tasks go to the branch checked out, as on a fresh start, rather than no run
            # ever starting again.
            self.target = current_branch(self.store.root)
            self.note("the interrupted run merged into %s, which is no branch any more: the "
                      "tasks now merge into %s (set [parallel] target to choose)" % (
                          saved_target, self.target or "the branch checked out"), "warning")
        if not self.target:
            raise FerrusError("parallel tasks need a target branch, and HEAD is detached",
                              "check out the branch the tasks should merge into, or set "
                              "[parallel] target")
        if target_head(self.store.root, self.target) is None:
            if current_branch(self.store.root) == self.target:
                raise FerrusError("the target branch %s has no commit yet" % self.target,
                                  "commit once (parallel tasks start from the target's head)")
            raise FerrusError("there is no branch %s to merge tasks into" % self.target,
                              "create it, or set [parallel] target to an existing branch "
                              "(\"\" = the branch checked out)")
        self.worktree_dir = default_worktree_dir(self.store.root, self.parallel.worktree_dir)
        project = self.store.project_state()
        if project.state in ACTIVE_STATES and not project.extra.get(PARALLEL_MIRROR_KEY):
            raise FerrusError("a task is in flight in the checkout itself (state %s)"
                              % project.state, "finish it with `ferrus run --resume` (or "
                              "`ferrus reset` it) before running tasks in parallel")
        self._remove_leftovers()
        resumed = []
        for task, record, problem in checked_task_records(self.store):
            if problem:
                self._leave_damaged(task, problem)
            if record.get("status") != RUNNING_STATUS or not record.get("worktree"):
                continue
            if self._prepared_half_way(task):
                self._prepare_again(task)
                continue
            resumed.append(task)
            self._adopt(task)
        if resumed:
            self.note("resuming %d task%s a previous run left: %s" % (
                len(resumed), "" if len(resumed) == 1 else "s",
                ", ".join(short_task_id(t) for t in resumed)))
        interrupted = previous.get("phase") if not previous.get("ended") else None
        if isinstance(interrupted, int) and 1 <= interrupted <= 7:
            self.batch = [t for t in previous.get("batch") or [] if isinstance(t, str)]
            self.dispatched = []
            for saved in previous.get("dispatch") or []:
                with contextlib.suppress(TypeError):     # a damaged record: dispatch again
                    self.dispatched.append(DispatchRecord(**saved))
            self.machine.set_recovery_target(interrupted)
            self.note("the previous run stopped in %s; going on from there"
                      % phase_label(interrupted))
            return self.advance(interrupted)
        return self.advance(1)

    def _remove_leftovers(self):
        """The worktree and branch of a task that was merged or cancelled just before a
        run died (recorded, not yet removed): removed now, so nothing leaks."""
        records = dict(task_records(self.store))
        with contextlib.suppress(FerrusError):
            for row in list_task_worktrees(self.store.root, TASK_BRANCH_PREFIX):
                task = (row.get("branch") or "")[len(TASK_BRANCH_PREFIX):]
                record = records.get(task) or {}
                if row.get("main") or record.get("status") not in (MERGED_STATUS,
                                                                   CANCELLED_STATUS):
                    continue
                try:
                    remove_task_worktree(self.store.root, row.get("path") or
                                         record.get("worktree"), row["branch"])
                except FerrusError as err:
                    self.note("could not remove the worktree of finished task %s: %s"
                              % (short_task_id(task), err.message), "warning", task_id=task)

    def step(self):
        """Poll every task's controller, then do what the current phase needs."""
        polled = list(self.controllers.values())
        try:
            for controller in polled:
                controller.hold_session_moves()
            for controller in polled:
                controller.poll()
        finally:
            for controller in polled:
                controller.release_session_moves()
        # What the tasks' states ask of the runner changes only with a commit (or with a
        # question a controller has just shown): the task files are read only then, so a
        # long queue costs nothing while the agents work.
        seen = (self.store.state_stamp(), tuple(
            (task, c.shown_question, c.shown_confirmation,
             tuple(slot.state for slot in c.slots.values()))
            for task, c in self.controllers.items()))
        if seen != self._seen:
            self._seen = seen
            self._queued = None
            for task, controller in list(self.controllers.items()):
                try:
                    self._watch_task(task, controller)
                except TaskRecordDamaged as damaged:
                    self._leave_damaged(damaged.task, damaged.problem)
        if self.checkpoint or self.finished:
            return
        try:
            self._do_phase(self.machine.phase)
        except TaskRecordDamaged as damaged:
            # Found damaged as the phase worked on it: that task is left alone, and the
            # phase goes on with the others at the next step.
            self._leave_damaged(damaged.task, damaged.problem)

    def _do_phase(self, phase):
        if phase == 1:
            self._plan()
        elif phase == 2:
            self._prepare()
        elif phase == 3:
            self._dispatch()
        elif phase == 4:
            self._collect()
        elif phase == 5:
            self._integrate()
        elif phase == 6:
            self._report()
        elif phase == 7:
            self._cleanup()

    def _leave_damaged(self, task, problem):
        """A task whose task.json is damaged: its agents (if any) are stopped and this run
        leaves it alone — nothing is written over the record — saying so once, with the
        repair; the other tasks go on.  The run then ends with exit 1."""
        if self.integration is not None and self.integration["task"] == task:
            self._stop_integration()
        self._stop_controller(task)
        self.waiting_human.discard(task)
        if task in self.batch:
            self.batch.remove(task)
        self.dispatched = [r for r in self.dispatched if r.task_id != task]
        if self.held_candidate is not None and self.held_candidate[0] == task:
            self.held_candidate = None
        if task not in self.damaged:
            self.damaged[task] = problem
            self.note(damaged_task_note(task, problem), "error", task_id=task,
                      problem=problem)

    # -- P1 plan, P2 prepare, P3 dispatch ---------------------------------------------------

    def queued(self):
        """The queued tasks, oldest first (read again after each commit only)."""
        if self._queued is None or self._queued[0] != self.store.state_stamp():
            stamp, queued = self.store.state_stamp(), []
            for task, record, problem in checked_task_records(self.store):
                if problem:
                    self._leave_damaged(task, problem)
                elif record.get("status") == QUEUED_STATUS:
                    queued.append(task)
            self._queued = (stamp, queued)
        return list(self._queued[1])

    def free_slots(self):
        return max(0, self.max_tasks - len(self.controllers))

    def _plan(self):
        self.batch = self.queued()[:self.free_slots()]
        self.dispatched = []
        self.advance(2)

    def _prepare(self):
        todo = [task for task in self.batch if task not in self.controllers]
        for task, ready in zip(todo, self._prepare_side_by_side(todo)):
            if not ready:
                self.batch.remove(task)
        self.advance(3)

    def _prepare_side_by_side(self, tasks):
        """_prepare_task for each of ``tasks``, all at once: each has its own worktree,
        [parallel] setup and store, so the batch waits for the slowest, not for the sum
        (the git processes, setup commands and fsyncs overlap).  A task that cannot be
        prepared is failed here, in the runner's thread."""
        if len(tasks) < 2:
            return [self._prepare_task(task) for task in tasks]
        results = [None] * len(tasks)

        def prepare(index, task):
            try:
                results[index] = self._prepare_task(task, fail=False)
            except BaseException as err:       # handed to the runner's thread below
                results[index] = err
        threads = [threading.Thread(target=prepare, args=(index, task), daemon=True,
                                    name="ferrus-prepare-%s" % short_task_id(task))
                   for index, task in enumerate(tasks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ready = []
        for task, result in zip(tasks, results):
            if isinstance(result, TaskRecordDamaged):
                self._leave_damaged(result.task, result.problem)
                result = False
            elif isinstance(result, FerrusError):
                self._end_task(task, FAILED_STATUS, "could not prepare its worktree: %s" %
                               result.full_text())
                result = False
            elif isinstance(result, BaseException):
                raise result
            ready.append(bool(result))
        return ready

    def _prepare_task(self, task, fail=True):
        """The task's worktree and branch from the target's head, ferrus's agent
        configuration copied into it, and its state created (Executing).  Idempotent, so
        a run that crashed half-way through it simply does it again.  A FerrusError fails
        the task (or, with ``fail`` False, is raised for the caller to do that)."""
        record = read_task_record(self.store.dir, task)
        if record.get("status") not in (QUEUED_STATUS, RUNNING_STATUS):
            return False
        path = record.get("worktree") or os.path.join(self.worktree_dir, task)
        branch = record.get("branch") or TASK_BRANCH_PREFIX + task
        # A project in a subfolder of its repository works in that subfolder of the worktree.
        inside = os.path.relpath(self.store.root, self.repo.toplevel)
        workdir = path if inside == "." else os.path.join(path, inside)
        try:
            start = record.get("base") or target_head(self.store.root, self.target)
            if update_task(self.store, ORCHESTRATOR, task, "prepare_task", {
                    "status": RUNNING_STATUS, "worktree": path, "workdir": workdir,
                    "branch": branch,
                    "base": start, "target": self.target, "store": "worktree",
                    "started_at": record.get("started_at") or format_timestamp(
                        self.store.clock())},
                    only_from=(QUEUED_STATUS, RUNNING_STATUS),
                    worktree=path, branch=branch, base=start[:12]) is None:
                return False                  # cancelled since it was read
            create_task_worktree(self.store.root, path, branch, start)
            copy_agent_configuration(self.store.root, workdir)
            task_store = self.store.for_task(task)
            if not task_store.exists():
                atomic_write(task_store.task_path(STATE_FILE), StateData().to_json())
            if task_store.read_state().state == S.IDLE:
                self._set_up_worktree(task, workdir)
                origin = record.get("origin") or {}
                op_create_task(task_store, ORCHESTRATOR, task_store.read_file("TASK.md"),
                               origin=(origin.get("spec"), origin.get("milestone")),
                               task_id=task)
        except TaskRecordDamaged:
            raise                              # not the task's failure: it is left alone
        except FerrusError as err:
            if not fail:
                raise
            self._end_task(task, FAILED_STATUS, "could not prepare its worktree: %s" %
                           err.full_text())
            return False
        return True

    def _set_up_worktree(self, task, path):
        """[parallel] setup in the new worktree, with the check runner (logs, timeouts,
        process groups); raises FerrusError naming the failed command."""
        if not self.parallel.setup:
            return
        config = self.store.config()
        setup = dataclasses.replace(config.checks, commands=list(self.parallel.setup),
                                    parallel=False, fail_fast=True)
        run = run_checks(path, setup, self.store.path("logs"), 0,
                         config.limits.max_feedback_lines, None, self.store.root)
        if not run.passed:
            failed = run.failed[0] if run.failed else None
            raise FerrusError("[parallel] setup failed in its worktree: `%s`%s, log %s" % (
                failed.command if failed else "?", _status_note(failed) if failed else "",
                failed.log_path if failed else run.log_path),
                "fix the command (it runs in the new worktree, which holds only what git "
                "tracks), then `ferrus task cancel %s` and queue the task again"
                % short_task_id(task))

    def _prepared_half_way(self, task):
        """A RUNNING task whose state was never created: _prepare_task marks the record
        running first, then makes the worktree, the task's STATE.json (Idle) and the task
        (Executing); a run killed in between leaves the state missing or Idle."""
        task_store = self.store.for_task(task)
        if not task_store.exists():
            return True
        try:
            return task_store.read_state().state == S.IDLE
        except FerrusError:
            return False            # a damaged state: doctor's to repair, not ours to redo

    def _prepare_again(self, task):
        """Put a task prepared only half-way back in the queue, its worktree and branch
        kept in its record: preparing it again finishes what was begun (each step of
        _prepare_task is idempotent).  Never counted as a cancel: only op_cancel_task
        cancels."""
        self._stop_controller(task)
        self.waiting_human.discard(task)
        if update_task(self.store, ORCHESTRATOR, task, "requeue_task", {
                "status": QUEUED_STATUS}, only_from=(RUNNING_STATUS,),
                reason="prepared half-way") is not None:
            self.note("task %s was prepared only half-way when a run stopped: it is queued "
                      "again, and preparing it finishes its worktree" % short_task_id(task),
                      "warning", task_id=task)

    def _adopt(self, task):
        record = read_task_record(self.store.dir, task)
        task_store = self.store.for_task(task)
        if not task_store.exists() or record.get("status") != RUNNING_STATUS:
            return None             # cancelled (or ended) since it was chosen
        if record.get("worktree") and not os.path.isdir(task_store.workdir):
            # Its folder was deleted: put the worktree back on the task's branch (the work
            # committed there is kept; what was only in the folder is gone).
            try:
                create_task_worktree(self.store.root, record["worktree"], record["branch"],
                                     record.get("base"))
                copy_agent_configuration(self.store.root, task_store.workdir)
            except (FerrusError, KeyError) as err:
                self._end_task(task, FAILED_STATUS, "its worktree %s is gone and could not "
                               "be made again: %s" % (record.get("worktree"), err))
                return None
            self.note("task %s's worktree was gone; made it again from its branch %s" % (
                short_task_id(task), record["branch"]), "warning", task_id=task)
        controller = HqController(task_store, emit=self._task_emitter(task), clock=self.clock,
                                  launcher=self.launcher, bell=self.bell,
                                  executor_agent=record.get("agent"), notifier=self.notifier)
        self.controllers[task] = controller
        return controller

    def _dispatch(self):
        # P4 → P3 comes back here while queued tasks and free slots remain: those are
        # chosen and prepared now (P1 and P2 for them, inside this phase).
        if self.machine.phase == 3 and not self.batch:
            for task in self.queued()[:self.free_slots()]:
                if self._prepare_task(task):
                    self.batch.append(task)
        for task in self.batch:
            if any(record.task_id == task for record in self.dispatched):
                continue
            # A task a crashed run dispatched was taken up again at start-up.
            controller = self.controllers.get(task) or self._adopt(task)
            if controller is None:
                continue
            choice = controller.agent_choice("executor")
            self.dispatched.append(DispatchRecord(task_id=task, role="executor",
                                                  agent=choice.agent if choice else "",
                                                  session_id=""))
            self.note("dispatched task %s (%s) to %s in %s" % (
                short_task_id(task), read_task_record(self.store.dir, task).get("title", ""),
                choice.agent if choice else "no agent", controller.store.workdir),
                task_id=task)
        self._run_dispatch_gates()
        self.batch = []
        self.advance(4)

    def _run_dispatch_gates(self):
        """Coverage, batch size and delegation before P4 (see 'Dispatch gates'): a task a
        gate refuses is failed (delegation) or goes back to the queue (coverage, batch)."""
        records = {task: record for task, record in task_records(self.store)}
        allowed = list(self.parallel.delegates)
        if not allowed:
            with contextlib.suppress(FerrusError):
                executor = self.store.config().executor
                allowed = [executor.agent] if executor else []
        while True:
            try:
                run_dispatch_gates(list(self.batch), self.dispatched,
                                   [(t, records.get(t, {}).get("origin") or {})
                                    for t in self.batch], self.max_tasks, allowed)
                return
            except DispatchGateError as refused:
                with contextlib.suppress(FerrusError, OSError):
                    self.store.append_event("ferrus", "dispatch_gate", {
                        "gate": refused.gate, "tasks": list(refused.tasks),
                        "reason": refused.message}, task_id="")
                self.note("dispatch gate %s: %s" % (refused.gate, refused.message), "error")
                for task in refused.tasks:
                    if task in self.batch:
                        self.batch.remove(task)
                    self.dispatched = [r for r in self.dispatched if r.task_id != task]
                    if refused.gate in ("batch", "coverage"):
                        # Not dispatched (or one too many): back to the queue, to be
                        # chosen again when a slot is free.
                        self._stop_controller(task)
                        update_task(self.store, ORCHESTRATOR, task, "requeue_task",
                                    {"status": QUEUED_STATUS}, reason=refused.gate)
                    else:
                        self._end_task(task, FAILED_STATUS, "dispatch gate %s: %s" % (
                            refused.gate, refused.message))
                if not refused.tasks:
                    return

    # -- P4 collect --------------------------------------------------------------------------

    def _watch_task(self, task, controller):
        """What a task's state asks of the runner: a question or confirmation for the
        human, an end (failed or cancelled) to record."""
        try:
            data = controller.store.read_state()
        except FerrusError:
            return
        record, problem = load_task_record(self.store.dir, task)
        if problem:
            raise TaskRecordDamaged(task, problem)
        if record.get("status") == CANCELLED_STATUS:
            self._end_task(task, CANCELLED_STATUS, None)
            return
        if data.state == S.IDLE:
            # Idle and not cancelled (a cancel writes both in one commit): its state was
            # never created, so it is prepared again, not taken for a cancel.
            self._prepare_again(task)
            return
        if data.state == S.FAILED:
            self._end_task(task, FAILED_STATUS, data.failure_reason)
            return
        stopped = [slot.name for slot in controller.slots.values() if slot.state == SS.STOPPED]
        if stopped and not controller.running():
            # As `ferrus run` gives up on its task: no agent will move this one any more.
            self._end_task(task, FAILED_STATUS, "its %s is stopped (the reason is above); "
                           "once that is fixed, `ferrus task retry %s` queues it again" % (
                               " and ".join(stopped), short_task_id(task)))
            return
        if data.state == S.AWAITING_HUMAN and controller.shown_question:
            answer = self.ask(controller.shown_question) if self.ask else None
            if answer is None:
                self.waiting_human.add(task)
            elif answer.strip():
                op_answer(controller.store, HUMAN, answer)
            else:
                self._seen = None        # no answer yet: ask again at the next step
        elif data.state == S.AWAITING_CONFIRMATION and controller.shown_confirmation:
            decision = self.review(confirmation_summary(controller.store, data)) \
                if self.review else None
            if decision is None:
                self.waiting_human.add(task)
            else:
                verdict, notes = decision
                with contextlib.suppress(FerrusError):
                    if verdict == "approve":
                        op_human_approve(controller.store, HUMAN, via="run")
                    else:
                        op_human_reject(controller.store, HUMAN, notes, via="run")
        else:
            self.waiting_human.discard(task)

    def integrating(self):
        """Tasks approved and waiting for the merge queue, the longest-waiting first
        (read again after each commit only: it is asked on every step)."""
        stamp = self.store.state_stamp()
        if self._integrating is None or self._integrating[0] != stamp or \
                self._integrating[1] != set(self.controllers):
            self._integrating = (stamp, set(self.controllers), self._read_integrating())
        return list(self._integrating[2])

    def _read_integrating(self):
        waiting = []
        for task, controller in self.controllers.items():
            with contextlib.suppress(FerrusError):
                data = controller.store.read_state()
                if data.state in (S.INTEGRATING, S.COMPLETE):
                    waiting.append((data.state_entered_at or "", task))
        return [task for _, task in sorted(waiting)]

    def _collect(self):
        if self.integrating():
            if self.advance(5):
                self._integrate()      # an approved task enters the merge queue at once
        elif self.queued() and self.free_slots():
            self.advance(3)
        elif not self.controllers:
            self.advance(5)        # nothing left: P5 has nothing to merge and reports

    def stuck_on_human(self):
        """Every task still in flight waits for a human nobody here can be."""
        return bool(self.controllers) and set(self.controllers) <= self.waiting_human and \
            not (self.queued() and self.free_slots())

    # -- P5 integrate: the merge queue -----------------------------------------------------

    def _integrate(self):
        if self.integration is not None:
            if self.integration["thread"].is_alive():
                return
            self._finish_integration(self.integration)
            self.integration = None
            # The next task in the queue starts now, not a step (eight polls) later.
        if self.retry_at is not None and self.clock() < self.retry_at:
            return
        self.retry_at = None
        waiting = self.integrating()
        if waiting:
            self._start_integration(waiting[0])
            return
        self.advance(1 if self.queued() or self.controllers else 6)

    def _start_integration(self, task):
        controller = self.controllers[task]
        task_store = controller.store
        data = task_store.read_state()
        if data.state == S.COMPLETE:          # integrated before a crash: only clean up
            self._merged(task, None)
            return
        record = read_task_record(self.store.dir, task)
        pending = record.get("integration") or {}
        head = target_head(self.store.root, self.target)
        if pending.get("candidate") and head == pending["candidate"]:
            # The target was fast-forwarded, and the run stopped before it said so.
            op_integrated(task_store, ORCHESTRATOR, commit=head[:12], target=self.target)
            self._merged(task, head)
            return
        held = self.held_candidate
        if held is not None and held[0] == task and head == held[1].target_head:
            # Only the fast-forward waited (your checkout was in the way): the candidate
            # and its checks still hold, so try just that again.
            self._fast_forward(task, held[1])
            return
        self.held_candidate = None
        job = {"task": task, "thread": None, "result": None, "error": None,
               "cancel": threading.Event()}
        config = self.store.config()
        message = task_commit_message(task, task_store.read_file("TASK.md"),
                                      task_store.read_file("SUBMISSION.md"))
        top = record.get("worktree") or task_store.workdir
        conflicts = [p for p in record.get("conflicts") or [] if isinstance(p, str)]
        config_file = os.path.relpath(os.path.join(self.store.root, CONFIG_FILE),
                                      self.repo.toplevel).replace(os.sep, "/")

        def work():
            try:
                left = conflict_markers_left(top, conflicts)
                if left:
                    job["result"] = ("markers", left)
                    return
                built = prepare_integration(task_store.workdir, self.target,
                                            self.parallel.integrate, message,
                                            task_diff_exclusions(task_store))
                if built.status == "ready" and record.get("conflict_base"):
                    # After a conflict the branch holds ferrus's merge: one clean commit
                    # on the target instead.
                    built = dataclasses.replace(built, head=squash_onto(
                        top, built.target_head, message))
                if built.status == "ready" and run_git(top, [
                        "diff", "--name-only", built.target_head, built.head, "--",
                        ":(top)" + config_file]).strip():
                    job["result"] = ("config", built)
                    return
                checks = None
                if built.status == "ready" and config.checks.commands:
                    checks = run_checks(task_store.workdir, config.checks,
                                        self.store.path("logs"), 0,
                                        config.limits.max_feedback_lines, job["cancel"],
                                        self.store.root)
                job["result"] = (built, checks)
                if built.status == "conflict":
                    job["merged"] = merge_leaving_conflicts(top, self.target, (
                        "ferrus: %s merged into task %s, its conflicts left for the "
                        "executor" % (self.target, short_task_id(task))))
            except FerrusError as err:
                job["error"] = err
            except Exception as err:    # never lose the task: say what broke, and wait
                log.debug("integration of %s failed", task, exc_info=True)
                job["error"] = FerrusError("the integration of task %s failed: %s: %s" % (
                    task, type(err).__name__, err), "run with FERRUS_DEBUG=1 for the traceback")
        self.note("integrating task %s into %s (%s, then the checks on the result)" % (
            short_task_id(task), self.target, self.parallel.integrate), task_id=task)
        job["thread"] = threading.Thread(target=work, daemon=True,
                                         name="ferrus-integrate-%s" % short_task_id(task))
        job["thread"].start()
        self.integration = job

    def _finish_integration(self, job):
        task = job["task"]
        controller = self.controllers.get(task)
        if controller is None:
            return
        if isinstance(job["error"], TaskRecordDamaged):
            raise job["error"]
        if isinstance(job["error"], IntegrationRefused):
            self._send_back(task, "ferrus could not integrate your work: %s" %
                            job["error"].full_text(), cause="refused")
            return
        if job["error"] is not None:
            # Not the executor's to fix (no git identity, a damaged repository): the task
            # waits, Integrating, and the run says what to do.
            self._wait(task, job["error"].full_text())
            return
        built, checks = job["result"]
        if built == "markers":
            self._send_back(task, "git's conflict markers are still in %s. Edit each of "
                            "those files: keep both sides' intent and remove every marker "
                            "line (the lines of seven <, = or > signs), then check and "
                            "submit again." % ", ".join(checks), cause="markers",
                            files=list(checks))
            return
        if built == "config":
            self._send_back(task, "Your work changes %s, ferrus's own configuration (the "
                            "checks that judge your work, the agents): a task may not change "
                            "it. Undo that change (only the user edits it), then check and "
                            "submit again." % CONFIG_FILE, cause="config",
                            onto=checks.target_head)
            return
        if built.status == "conflict":
            merged = job.get("merged")
            if merged is None:
                self._wait(task, "it conflicts with %s, and ferrus could not merge %s into "
                           "its branch for the executor" % (self.target, self.target))
                return
            base, paths = merged
            update_task(self.store, ORCHESTRATOR, task, "conflict_handed_over",
                        {"conflicts": paths, "conflict_base": base}, files=paths)
            self._send_back(task, "Your work conflicts with the target branch %s, which "
                            "moved on since your task started (other tasks were merged into "
                            "it). ferrus has brought your branch up to date with it: the "
                            "files below now hold both sides of each conflict between git's "
                            "markers (a line of seven < signs, your side, a line of seven = "
                            "signs, the target's side, a line of seven > signs). "
                            "Edit them to keep both sides' intent and remove every marker "
                            "line; do not run git yourself. Then check and submit again.\n\n"
                            "Conflicted files: %s\n\n%s" % (
                                self.target, ", ".join(paths) or "(none left)", built.text),
                            cause="conflict", files=list(built.conflicts), onto=base)
            return
        if checks is not None and not checks.passed:
            self._send_back(task, "Your work merged with the target branch %s cleanly, but "
                            "the checks fail on the merged result (they passed on your work "
                            "alone, so it is the combination).\n\n%s" % (
                                self.target, checks.report(
                                    self.store.config().limits.max_feedback_lines)),
                            cause="checks", failed=[r.command for r in checks.failed],
                            onto=built.target_head)
            return
        update_task(self.store, ORCHESTRATOR, task, "integration_ready", {
            "integration": {"candidate": built.head, "target_head": built.target_head}},
            candidate=(built.head or "")[:12])
        self._fast_forward(task, built)

    def _fast_forward(self, task, built):
        """Move the target to the checked candidate — unless the task was cancelled
        meanwhile (merge_unless_cancelled decides which came first) — or hold it while
        something of the user's is in the way."""
        outcome = {}

        def move():
            outcome["moved"] = fast_forward_target(self.store.root, self.target,
                                                   built.target_head, built.head)
            return built.head if outcome["moved"].status == "done" else None
        self.held_candidate = None
        won, head = merge_unless_cancelled(self.store, task, move, ORCHESTRATOR,
                                           target=self.target)
        if won == CANCELLED_STATUS:
            self.note("task %s was cancelled before its merge: %s was not moved for it" % (
                short_task_id(task), self.target), "warning", task_id=task)
            self._end_task(task, CANCELLED_STATUS, None)
            return
        moved = outcome["moved"]
        if won == MERGED_STATUS:
            self._merged(task, head)
        elif moved.status == "moved":
            self.note("the target %s moved during the integration of %s; integrating again"
                      % (self.target, short_task_id(task)), task_id=task)
        else:
            self.held_candidate = (task, built)
            self._wait(task, moved.text + (" (commit or stash them; ferrus never overwrites "
                                           "your work)" if moved.files else ""))

    def _wait(self, task, why):
        """The integration of ``task`` cannot go on now: say why (once) and try again in
        INTEGRATION_RETRY_SECS."""
        if why != self.waiting_said:
            self.waiting_said = why
            self.note("task %s is ready to merge, and waits: %s" % (short_task_id(task), why),
                      "warning", task_id=task)
        self.retry_at = self.clock() + INTEGRATION_RETRY_SECS

    def _send_back(self, task, notes, onto=None, **detail):
        """``onto``: the target head the task's branch now sits on (None when the branch
        did not move)."""
        task_store = self.controllers[task].store
        outcome = op_integration_failed(task_store, ORCHESTRATOR, notes, onto, **detail)
        self.note("task %s goes back to its executor: %s" % (
            short_task_id(task), {"conflict": "it conflicts with %s" % self.target,
                                  "checks": "the checks fail on the merged result"}.get(
                detail.get("cause"), "its integration failed")),
            "warning", task_id=task, state=outcome.data["state"])

    def _merged(self, task, head):
        self.tasks_completed += 1
        self.waiting_said = None
        self._end_task(task, MERGED_STATUS, None, head=head)

    # -- a task's end ---------------------------------------------------------------------

    def _stop_controller(self, task):
        controller = self.controllers.pop(task, None)
        if controller is not None:
            controller.shutdown()

    def _end_task(self, task, status, reason, head=None):
        """Record how a task ended; a merged or cancelled task's worktree and branch go,
        a failed one's stay for a look (until `ferrus task cancel`; `doctor` notes them)."""
        if self.integration is not None and self.integration["task"] == task:
            self._stop_integration()        # its checks run in the worktree about to go
        self._stop_controller(task)
        self.waiting_human.discard(task)
        record = read_task_record(self.store.dir, task)
        if record.get("status") not in ENDED_STATUSES or record.get("status") != status:
            changes = {"status": status, "ended_at": format_timestamp(self.store.clock())}
            if reason:
                changes["reason"] = reason
            if head:
                changes["merged_commit"] = head
            detail = {"status": status}
            if reason:
                detail["reason"] = reason[:500]
            update_task(self.store, ORCHESTRATOR, task, "task_" + status, changes, **detail)
        if status in (MERGED_STATUS, CANCELLED_STATUS) and record.get("worktree"):
            try:
                remove_task_worktree(self.store.root, record["worktree"], record.get("branch"))
            except FerrusError as err:
                self.note("could not remove task %s's worktree %s: %s (`ferrus doctor --fix` "
                          "removes what a finished task leaves)" % (
                              short_task_id(task), record["worktree"], err.message),
                          "warning", task_id=task)
        self.ended[task] = status
        title = record.get("title", "")
        if status == MERGED_STATUS:
            self.note("task %s merged into %s%s: %s" % (
                short_task_id(task), self.target, " at %s" % head[:12] if head else "", title),
                task_id=task, status=status)
        elif status == FAILED_STATUS:
            self.note("task %s failed: %s (its worktree %s is kept: `ferrus task retry %s` "
                      "queues it again to go on there, `ferrus task cancel %s` removes it)"
                      % (short_task_id(task), failure_summary(reason or ""),
                         record.get("worktree") or "-", short_task_id(task),
                         short_task_id(task)), "error", task_id=task, status=status)
        else:
            self.note("task %s cancelled" % short_task_id(task), "warning", task_id=task,
                      status=status)

    # -- P6 report, P7 cleanup -------------------------------------------------------------

    def _report(self):
        counts = collections.Counter(self.ended.values())
        parts = ["%d %s" % (counts[s], s) for s in (MERGED_STATUS, FAILED_STATUS,
                                                    CANCELLED_STATUS) if counts[s]]
        if self.damaged:
            parts.append("%d with a damaged %s (`ferrus doctor --fix`)" % (
                len(self.damaged), TASK_RECORD_FILE))
        self.note("report: %s" % (", ".join(parts) or "no task ran"), counts=dict(counts))
        self.advance(7)

    def _cleanup(self):
        with contextlib.suppress(FerrusError):
            run_git(self.store.root, ["worktree", "prune"])
        if self.queued():
            self.advance(1)
            return
        self.finished = True
        self._save()

    # -- the end -------------------------------------------------------------------------------

    def exit_code(self):
        if self.checkpoint:
            return RUN_CHECKPOINT
        if self.damaged or any(status == FAILED_STATUS for status in self.ended.values()):
            return RUN_FAILED
        if self.waiting_human:
            return RUN_NEEDS_HUMAN
        return RUN_COMPLETE

    def shutdown(self):
        """Stop every agent (the tasks stay as they are, for the next run to resume)."""
        self._stop_integration()
        for task in list(self.controllers):
            self.controllers.pop(task).shutdown()
        self.notifier.finish()
        if self.target is not None and not self.finished:
            with contextlib.suppress(FerrusError, OSError):
                self._save(working=False)

    def _stop_integration(self):
        """End the integration under way: its checks are stopped, its thread waited for
        (an integration cut short is undone by the next one)."""
        job, self.integration = self.integration, None
        if job is not None and job["thread"] is not None:
            job["cancel"].set()
            job["thread"].join(timeout=30)


def run_parallel(store, max_tasks=None, timeout=None, out=None, ask=None, review=None,
                 clock=time.monotonic, poll_interval=0.02, launcher=None, mode="lines",
                 bell=None):
    """`ferrus run --parallel N`: work the queue until it is empty.  Exit codes as
    run_loop's: 0 every task merged, 1 one failed, 3 timeout or capacity checkpoint, 4 a
    task waits for a human nobody here can be."""
    out = out or (lambda text: say(text, flush=True))
    show = run_printer(out, mode)
    if launcher is None:
        require_headless_agents(store)
    runner = ParallelRunner(store, show, max_tasks, clock=clock, launcher=launcher, bell=bell,
                            ask=ask, review=review)
    started = clock()
    try:
        runner.start()
        while not runner.finished and not runner.checkpoint:
            runner.step()
            if runner.stuck_on_human():
                runner.note("every task in flight waits for a human (answer with HQ, "
                            "`ferrus approve`, or `ferrus run --parallel` in a terminal)",
                            exit=RUN_NEEDS_HUMAN)
                return RUN_NEEDS_HUMAN
            if timeout is not None and clock() - started >= timeout:
                runner.note("timed out after %s in %s" % (
                    format_duration(timeout), phase_label(runner.machine.phase)),
                    exit=RUN_TIMEOUT)
                return RUN_TIMEOUT
            time.sleep(poll_interval)
        code = runner.exit_code()
        runner.note("done: exit %d" % code, exit=code)
        return code
    except KeyboardInterrupt:
        runner.note("interrupted in %s: the agents are stopped, every task stays as it is; "
                    "`ferrus run --parallel %d` goes on with them" % (
                        phase_label(runner.machine.phase), runner.max_tasks), "warning")
        raise
    finally:
        runner.shutdown()


def run_printer(out, mode="lines"):
    """``show(message)`` for `ferrus run`: a line per message, fewer with "quiet", one
    JSON object per message with "json" (for CI logs and other programs)."""
    def show(message):
        if mode == "quiet" and (message.event in QUIET_EVENTS or (
                message.event == "check" and message.data.get("status") == "passed")):
            return
        out(_run_json(message) if mode == "json" else _run_line(message))
    return show


def require_headless_agents(store):
    """Refuse, before a task is created, a run whose executor or reviewer could not start:
    no [hq.<role>] agent, or a built-in agent CLI that is not on PATH (a custom agent's
    command is the user's own and is judged when it starts)."""
    config = store.config().require_hq()
    for role, slots in (("executor", "the executor"), ("supervisor", "the reviewer")):
        choice = getattr(config, role)
        if choice is None:
            raise FerrusError("no agent is set for %s: ferrus.toml has no [hq.%s]" % (slots, role),
                              "`ferrus register --supervisor AGENT --executor AGENT` sets both "
                              "(`ferrus agents` lists what is installed)")
        adapter = adapter_for(config, choice.agent)
        if not isinstance(adapter, CustomAgent) and not adapter.executable():
            raise FerrusError("%s's agent %s is not installed here (no `%s` on PATH)" % (
                slots, choice.agent, adapter.binary), adapter.install_hint())


def run_loop(store, task=None, timeout=None, resume=False, out=None, ask=None,
             clock=time.monotonic, poll_interval=0.02, launcher=None, origin=None, reset=False,
             review=None, mode="lines", bell=None, task_id=None):
    """Create (or take) the task and drive it to Complete or Failed.

    ``ask(question) -> answer or None`` answers human questions (None: nobody can,
    so the run ends with exit 4).  ``review(summary) -> ("approve", None) or
    ("reject", notes) or None`` is the human's word on a reviewer's approval when
    [hq] human_review is on (None: nobody gives it here, exit 4 as well).  ``origin`` is
    the (spec, milestone id) the task implements; a Failed task is replaced only with
    ``reset``.  ``mode`` is one of RUN_OUTPUT_MODES; ``bell()`` rings the terminal's bell
    for [notify].  Returns the exit code."""
    out = out or (lambda text: say(text, flush=True))
    show = run_printer(out, mode)

    def note(text, **data):
        show(HqMessage("info", "ferrus run: " + text, "run", data))
    data = store.read_state()
    controller = HqController(store, emit=show, clock=clock, launcher=launcher, bell=bell)
    if not controller.recheck_checkpoint():
        note("the capacity checkpoint still holds (%s); raise the limit in [capacity] and run "
             "again" % controller.checkpoint.get("signal"), exit=RUN_CHECKPOINT)
        return RUN_CHECKPOINT
    if task is not None and controller.gate("transition:create_task") in (
            CHECKPOINT, EMERGENCY_STOP):
        return RUN_CHECKPOINT
    if task is not None:
        if not task.strip():        # refused before anything is reset below
            raise UsageError("the task description is empty",
                             "pass the task as --task TEXT or --task-file FILE")
        require_utf8(task, "the task description")
        if data.state == S.AWAITING_CONFIRMATION:
            raise FerrusError("a task is already in flight (state %s): the reviewer approved "
                              "it and it waits for your word" % data.state,
                              "`ferrus approve` completes it, `ferrus reject NOTES` sends it "
                              "back (then `ferrus run --resume`); `ferrus reset` drops it")
        if data.state in ACTIVE_STATES:
            raise FerrusError("a task is already in flight (state %s)" % data.state,
                              "run `ferrus run --resume` to continue it, or `ferrus reset`")
        if data.state == S.FAILED and not reset:
            raise FerrusError(
                "the last task failed: %s" % failure_summary(data.failure_reason),
                "pass --reset to clear it and start the new task "
                "(`ferrus status` and `ferrus log` show what happened)")
        if launcher is None:            # real agents: they must be able to start at all
            require_headless_agents(store)
        if data.state in (S.COMPLETE, S.FAILED):
            op_force_reset(store, HUMAN)
        # A task given as text implements no milestone, whatever an interrupted HQ /task
        # may have staged.
        created = op_create_task(store, HUMAN, task, origin=origin or (None, None),
                                 task_id=task_id)
        for warning in created.data.get("warnings", ()):
            out("ferrus run: warning: %s" % warning)
        if created.data.get("branch"):
            out("ferrus run: the task works on the new git branch %s" % created.data["branch"])
    elif data.state not in ACTIVE_STATES:
        raise UsageError("nothing to run: state is %s and no task was given" % data.state,
                         "pass --task TEXT or --task-file FILE")
    elif not resume:
        raise UsageError("a task is in flight (state %s)" % data.state,
                         "pass --resume to continue it")
    started = clock()
    if not store.config().checks.commands:
        note("warning: %s (%s)" % (NO_CHECKS_WARNING, NO_CHECKS_HINT))
    # The task's creation (Idle → Executing) first, then where the run starts from.
    controller.drain_journal()
    run_task = store.read_state().task_id
    note(controller.describe_state(), task_id=run_task)
    try:
        while True:
            controller.poll()
            data = store.read_state()
            controller.catch_up(data.rev)
            if data.state in (S.COMPLETE, S.FAILED) and data.task_id == run_task:
                controller.wind_down(poll_interval)
                return RUN_COMPLETE if data.state == S.COMPLETE else RUN_FAILED
            if data.state == S.IDLE or data.task_id != run_task:
                # Someone else reset (or replaced) the task: no agent will move it now.
                note("task %s is gone: the state is %s%s, changed outside this run "
                     "(`ferrus log` shows by whom); stopping" % (
                         run_task, data.state, " with task %s" % data.task_id
                         if data.task_id and data.task_id != run_task else ""),
                     exit=RUN_FAILED)
                return RUN_FAILED
            if controller.checkpoint and not controller.running():
                note("stopped at a capacity checkpoint; raise the limit in [capacity] and run "
                     "`ferrus run --resume`", exit=RUN_CHECKPOINT)
                return RUN_CHECKPOINT
            if data.state == S.AWAITING_HUMAN and controller.shown_question:
                answer = ask(controller.shown_question) if ask else None
                if answer is None:
                    note("an agent asked a human and no answer is given here (stdin is not "
                         "a terminal, or it ended); answer with HQ or `ferrus run --resume` "
                         "in a terminal", exit=RUN_NEEDS_HUMAN)
                    return RUN_NEEDS_HUMAN
                if answer.strip():
                    op_answer(store, HUMAN, answer)
            if data.state == S.AWAITING_CONFIRMATION and controller.shown_confirmation:
                decision = review(confirmation_summary(store, data)) if review else None
                if decision is None:
                    note("the task waits for a human's confirmation of the reviewer's "
                         "approval; run `ferrus approve`, or `ferrus reject NOTES` and then "
                         "`ferrus run --resume`", exit=RUN_NEEDS_HUMAN)
                    return RUN_NEEDS_HUMAN
                verdict, notes = decision
                try:
                    if verdict == "approve":
                        op_human_approve(store, HUMAN, via="run")
                    else:
                        op_human_reject(store, HUMAN, notes, via="run")
                except FerrusError as err:      # e.g. someone else decided meanwhile
                    note(err.message)
            if any(slot.state == SS.STOPPED for slot in controller.slots.values()) and \
                    not controller.running():
                stuck = [s.name for s in controller.slots.values() if s.state == SS.STOPPED]
                # The task itself is still in flight: say how to go on once the cause is
                # fixed, as a second `ferrus run --task` would be refused.
                note("giving up: the %s is stopped (the reason is above); the task stays %s "
                     "— once that is fixed, `ferrus run --resume` goes on with it "
                     "(`ferrus reset` drops it)"
                     % (" and the ".join(stuck), store.read_state().state), exit=RUN_FAILED)
                return RUN_FAILED
            if timeout is not None and clock() - started >= timeout:
                note("timed out after %s (state %s)" % (format_duration(timeout), data.state),
                     exit=RUN_TIMEOUT)
                return RUN_TIMEOUT
            time.sleep(poll_interval)
    finally:
        controller.shutdown()
        task_id = store.read_state().task_id
        used = task_usage(store, task_id)
        if used["input_tokens"] or used["output_tokens"]:     # agents that report usage
            note("task %s used %s" % (task_id, format_usage(used)), task_id=task_id,
                 usage=used)


def _record_checkout_end(store, task, code, reason):
    """A queued task run in the checkout ended with exit ``code``: done, or failed with
    ``reason``.  A cancel from another shell meanwhile stays a cancel."""
    status = DONE_STATUS if code == RUN_COMPLETE else FAILED_STATUS
    changes = {"status": status, "ended_at": format_timestamp(store.clock())}
    if status == FAILED_STATUS and reason:
        changes["reason"] = reason
    update_task(store, HUMAN, task, "task_" + status, changes, only_from=(RUNNING_STATUS,))


def run_queue(store, out=None, **run_options):
    """`ferrus run` with tasks queued and [parallel] max_tasks = 1: each queued task in
    turn, as the project's own task in the checkout (exactly `ferrus run --task`).  A
    failed task does not stop the queue; the exit code is the worst of the runs."""
    out = out or (lambda text: say(text, flush=True))
    worst = RUN_COMPLETE
    for task, _, problem in checked_task_records(store):
        if problem:
            out("ferrus run: " + damaged_task_note(task, problem))
            worst = RUN_FAILED
    for task, record in task_records(store):
        # A queued task an earlier run took up in the checkout: resumed, or recorded.
        if record.get("status") != RUNNING_STATUS or record.get("store") != "project":
            continue
        data = store.project_state()
        code = None
        if data.task_id == task and data.state in ACTIVE_STATES:
            out("ferrus run: resuming task %s from the queue" % short_task_id(task))
            code = run_loop(store, None, resume=True, out=out, **run_options)
        elif data.task_id == task and data.state in (S.COMPLETE, S.FAILED):
            code = RUN_COMPLETE if data.state == S.COMPLETE else RUN_FAILED
        elif not _created_since_taken(store, task):
            # The run that took it stopped before the task began: it was never worked on.
            _put_back_in_queue(store, task, "the run that took it stopped before it began")
            out("ferrus run: task %s was taken by a run that stopped before it began; it is "
                "back in the queue" % short_task_id(task))
            continue
        if code is None:
            _record_checkout_end(store, task, RUN_FAILED, (
                "it ran in the checkout, which now holds %s (state %s); `ferrus log` shows "
                "what happened to it" % ("task %s" % data.task_id if data.task_id
                                         else "no task", data.state)))
        elif code in (RUN_COMPLETE, RUN_FAILED):
            _record_checkout_end(store, task, code, data.failure_reason)
        if code not in (None, RUN_COMPLETE, RUN_FAILED):
            return code
        worst = max(worst, code or RUN_FAILED)
    # What would stop a run before its task starts (a ferrus.toml that does not load, an
    # agent that cannot start) is found before a task is taken: it must not use one up.
    store.config()
    if run_options.get("launcher") is None:
        require_headless_agents(store)
    while True:
        queued = [(task, record) for task, record in task_records(store)
                  if record.get("status") == QUEUED_STATUS]
        if not queued:
            return worst
        task, record = queued[0]
        origin = record.get("origin") or {}
        out("ferrus run: task %s from the queue (%d left after it): %s" % (
            short_task_id(task), len(queued) - 1, record.get("title", "")))
        if update_task(store, HUMAN, task, "dispatch_task", {
                "status": RUNNING_STATUS, "store": "project",
                "started_at": format_timestamp(store.clock())},
                only_from=(QUEUED_STATUS,)) is None:
            continue                # cancelled from another shell since it was read
        try:
            code = run_loop(store, read_text(os.path.join(store.path(TASKS_DIR, task),
                                                          "TASK.md")),
                            out=out, origin=(origin.get("spec"), origin.get("milestone")),
                            reset=True, task_id=task, **run_options)
        except BaseException as err:
            # Refused (or interrupted) before the task began in the checkout: it goes back
            # to the queue, not used up.  One that began stays running: the next run
            # resumes it.
            with contextlib.suppress(Exception):
                if store.project_state().task_id != task:
                    _put_back_in_queue(store, task, "the run stopped before it began: %s" % (
                        err.message if isinstance(err, FerrusError)
                        else type(err).__name__))
            raise
        if code in (RUN_COMPLETE, RUN_FAILED):
            _record_checkout_end(store, task, code, store.project_state().failure_reason)
        if code not in (RUN_COMPLETE, RUN_FAILED):
            return code            # a question, a timeout or a checkpoint: stop here
        worst = max(worst, code)


def _created_since_taken(store, task):
    """Whether queue task ``task`` began in the checkout (a create_task entry for it)
    after the run that took it (its dispatch_task entry): the journal is read back to
    that entry only."""
    for entry in store.journal_entries_backwards():
        if entry.get("task_id") == task and entry.get("event") == "create_task":
            return True
        if entry.get("task_id") == task and entry.get("event") == "dispatch_task":
            return False
    return False


def _put_back_in_queue(store, task, why):
    """A queue task taken for the checkout that never began there: queued again."""
    with store.transaction(HUMAN.agent_id) as tx:
        record = read_task_record(store.dir, task)
        if record.get("status") != RUNNING_STATUS:
            return
        for key in ("store", "started_at", "ended_at", "reason"):
            record.pop(key, None)
        record["status"] = QUEUED_STATUS
        write_task_record(store, task, record)
        tx.set(tx.state, "requeue_task", reason=why[:500])
        tx.journal_task_id = task


def run_milestones(store, wanted="next", until_done=False, timeout=None, resume=False,
                   reset=False, out=None, clock=time.monotonic, **run_options):
    """``ferrus run --milestone ID|next`` and ``--until-done``: one task per spec milestone.

    Each milestone becomes a task whose origin is that milestone, so approving it ticks
    the box and advances the selection.  With ``until_done`` the next ready milestone
    follows until none is left; any other ending (Failed, a question nobody can answer,
    a capacity checkpoint, the timeout) stops the run with that ending's exit code."""
    out = out or (lambda text: say(text, flush=True))
    show = run_printer(out, run_options.get("mode", "lines"))
    started = clock()

    def note(text, **data):
        show(HqMessage("info", "ferrus run: " + text, "run", data))

    def time_left():
        return None if timeout is None else max(0.0, timeout - (clock() - started))
    if resume and store.read_state().state in ACTIVE_STATES:
        code = run_loop(store, None, time_left(), True, out=out, clock=clock, **run_options)
        if code != RUN_COMPLETE or not until_done:
            return code
        wanted = "next"
    previous = None
    finished = 0
    while True:
        found = find_milestone(store, wanted)
        if found is None:
            note("every milestone is complete (%d done in this run)" % finished
                 if finished else "every milestone of the spec is complete")
            return RUN_COMPLETE
        path, text, milestone = found
        state = store.read_state().state
        if state in ACTIVE_STATES:
            # Checked before the selection moves: retargeting a running task was an
            # upstream bug (see ARCHITECTURE.md, 'Differences from upstream ferrus', item 16).
            raise FerrusError("a task is already in flight (state %s)" % state,
                              "run `ferrus run --resume` to continue it, or `ferrus reset`")
        if (path, milestone.id) == previous:
            raise FerrusError("milestone %s of %s was approved but its box is still open"
                              % (milestone.id, path),
                              "tick `- [x]` on its line in the spec, then run again")
        previous = (path, milestone.id)
        op_select_milestone(store, HUMAN, path, milestone.id)
        note("milestone %s (%s) of %s" % (milestone.display(), milestone.id, path),
             milestone=milestone.id, spec=path)
        code = run_loop(store, milestone_task_text(path, text, milestone), time_left(),
                        out=out, clock=clock, origin=(path, milestone.id), reset=reset,
                        **run_options)
        if code != RUN_COMPLETE or not until_done:
            return code
        finished += 1
        reset = False       # --reset clears the Failed task the run started from, only that one
        wanted = "next"


def _run_line(message):
    if message.event == "run":
        return message.text            # ferrus run's own words, as they always were
    stamp = time.strftime("%H:%M:%S")
    if message.kind == "question":
        return "%s  question for a human:\n%s" % (stamp, message.text)
    if message.kind == "confirm":
        return "%s  your confirmation is needed:\n%s" % (stamp, message.text)
    return "%s  %s%s" % (stamp, "" if message.kind in ("transition", "info", "agent")
                         else message.kind + ": ", message.text)


def _run_json(message):
    """One message as one JSON line: time, event, level, text, then the event's facts."""
    record = {"time": format_timestamp(utc_now()), "event": message.event or "info",
              "level": message.kind, "text": message.text}
    for key, value in message.data.items():
        record.setdefault(key, value)
    # Insertion order (time, event, level, text first) reads better than sorted keys.
    return json_for_terminal(json.dumps(record, ensure_ascii=False, separators=(",", ":"),
                                        default=str))


# -- HQ front end: plain lines ------------------------------------------------------------

# -- HQ front end: curses ---------------------------------------------------------------
#
# HqShell's commands in a full-screen terminal: two status lines on top, the transcript
# in the middle, a hint line and the input at the bottom.  curses is imported inside
# functions because Windows Python has no curses module.

# ============================================================================
# 16. Pipelines
# ============================================================================
#
# A file-driven pipeline automaton in three parts (see ARCHITECTURE.md, 'Pipeline
# automaton').
#
#   workflows.json  static definitions: phases (parallel or sequential), their
#                   workers (agent, model, timeout, task, reads, final), pause_after.
#   status.json     one per run, in .ferrus/pipelines/<name>-<stamp>/, written only
#                   by the orchestrator, atomically, under .ferrus/pipelines/.lock.
#   workers         agent sessions that write <run folder>/<role>.md and exit.  The
#                   file existing is the completion signal; workers never touch
#                   status.json and never decide what comes next.
#
# reconcile() reads the files, brings status.json up to date and applies the
# decision table (ARCHITECTURE.md, 'Reconcile table').  It is idempotent, so it
# can run on every tick, after every restart, from any process.
#
# Restart protocol.  A dispatch is recorded before its process exists: the worker
# entry becomes "spawning" with a new spawn token and attempt number (the dispatch
# record), the process starts, the entry becomes "running" with its pid.  Workers
# have their own process group and write to a log file, not to our pipes, so they
# outlive a killed orchestrator.  A small wrapper writes the worker's pid to
# logs/<role>-<attempt>.pid and then execs the agent, which closes the gap between
# "spawning" and "running".  A restarted orchestrator adopts what it finds: it
# leaves a live pid alone and notices its exit by polling the pid (it cannot
# Popen.wait it).  A dead pid without output counts as one failed session, which
# session state machine retries or stops.  A "spawning" entry that still has no pid
# file after SPAWN_GRACE_SECS never started, and counts the same way.  Nothing
# starts twice without being counted.  (If the system reuses a pid after a long
# outage, the worker looks alive; the phase timeout catches that.)

PIPELINES_DIR, PIPELINE_ARCHIVE = "pipelines", "archive"
PIPELINE_GRACE_SECS = 120          # the grace beyond a phase's timeout
SPAWN_GRACE_SECS = 10              # how long a recorded spawn may take to show its pid
WORKER_RUNNING = ("spawning", "running")
_PIPELINE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_ROLE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# A worker entry in status.json *is* its session (see ARCHITECTURE.md, 'Session state
# machine'), persisted.
_SESSION_OF = {"pending": SS.INITIALIZING, "spawning": SS.SPAWNING, "running": SS.RUNNING,
               "cooling": SS.COOLING_DOWN, "completed": SS.SESSION_COMPLETE,
               "failed": SS.STOPPED, "cancelled": SS.STOPPED}
_STATUS_OF = {SS.INITIALIZING: "pending", SS.BUILDING_PROMPT: "pending",
              SS.SPAWNING: "spawning", SS.RUNNING: "running", SS.COOLING_DOWN: "cooling",
              SS.SESSION_COMPLETE: "completed", SS.STOPPED: "failed"}


def pipelines_config(root):
    """[pipelines] from ferrus.toml (validated with the whole file by load_config)."""
    return load_config(root).pipelines


# -- definitions ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WorkerDef:
    """One worker of a pipeline phase, as workflows.json defines it."""

    role: str
    task: str
    timeout: int
    agent: str = ""                # "" means [hq.executor]'s agent, fixed when a run starts
    model: str = ""
    reads: tuple = ()
    final: bool = False

    @property
    def output(self):
        return self.role + ".md"


@dataclasses.dataclass(frozen=True)
class PhaseDef:
    """One phase of a pipeline, as workflows.json defines it."""

    id: str
    mode: str                      # parallel | sequential
    workers: tuple
    pause_after: bool = False

    @property
    def timeout(self):
        return max(worker.timeout for worker in self.workers)


@dataclasses.dataclass(frozen=True)
class PipelineDef:
    """One pipeline of workflows.json."""

    name: str
    description: str
    phases: tuple

    def final_worker(self):
        return next(w for w in self.phases[-1].workers if w.final)


_NOTHING = object()


def _check(ok, path, where, message, got=_NOTHING):
    """Raise the precise error for one JSON path unless ``ok``."""
    if not ok:
        text = "%s: %s %s" % (path, where, message)
        if got is not _NOTHING:
            text += ", got %s" % _describe_value(got)
        raise FerrusError(text, "edit %s (`ferrus pipeline init` writes a commented example)"
                          % path)


def _check_keys(path, where, value, allowed, required):
    _check(isinstance(value, dict), path, where, "must be an object", value)
    for key in value:
        _check(key in allowed, path, "%s.%s" % (where, key),
               "is not a known key (known: %s)" % ", ".join(allowed))
    for key in required:
        _check(key in value, path, where, "needs %s" % json.dumps(key))


def _check_text(path, where, value, pattern=None, what="a non-empty string"):
    _check(isinstance(value, str) and value.strip() and (pattern is None or
                                                         pattern.match(value)),
           path, where, "must be " + what, value)
    return value.strip()


def parse_workflows(text, path, known_agents=None):
    """Validate workflows.json text into {name: PipelineDef}.

    ``known_agents`` None skips the agent check (a run's own snapshot, whose agents
    were checked when the run began)."""
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise FerrusError("%s is not valid JSON: %s" % (path, err),
                          "fix the syntax (`ferrus pipeline init` in a project without a workflows "
                          "file writes a valid example)") from err
    _check(isinstance(raw, dict), path, "the top level", "must be an object of pipelines", raw)
    # JSON has no comments, so one top-level "_comment" key may hold them.
    return {name: _parse_pipeline(path, name, body, known_agents)
            for name, body in raw.items() if name != "_comment"}


def _parse_pipeline(path, name, body, known_agents):
    _check_text(path, name, name, _PIPELINE_NAME_RE,
                "a pipeline name of letters, digits, - and _ (it names the run folder)")
    _check_keys(path, name, body, ("description", "phases"), ("phases",))
    _check(isinstance(body.get("description", ""), str), path, name + ".description",
           "must be a string", body.get("description"))
    raw_phases = body["phases"]
    _check(isinstance(raw_phases, list) and raw_phases, path, name + ".phases",
           "must be a non-empty array", raw_phases)
    phases, produced, finals = [], set(), []
    for p_index, raw in enumerate(raw_phases):
        where = "%s.phases[%d]" % (name, p_index)
        _check_keys(path, where, raw, ("id", "mode", "pause_after", "workers"),
                    ("id", "mode", "workers"))
        phase_id = _check_text(path, where + ".id", raw["id"])
        _check(phase_id not in [p.id for p in phases], path, where + ".id",
               "repeats the phase id %s" % json.dumps(phase_id))
        _check(raw["mode"] in ("parallel", "sequential"), path, where + ".mode",
               "must be \"parallel\" or \"sequential\"", raw["mode"])
        pause_after = raw.get("pause_after", False)
        _check(isinstance(pause_after, bool), path, where + ".pause_after",
               "must be true or false", pause_after)
        _check(not (pause_after and p_index == len(raw_phases) - 1), path, where + ".pause_after",
               "is on the last phase, which delivers instead of waiting")
        _check(isinstance(raw["workers"], list) and raw["workers"], path, where + ".workers",
               "must be a non-empty array", raw["workers"])
        workers = []
        for w_index, raw_worker in enumerate(raw["workers"]):
            at = "%s.workers[%d]" % (where, w_index)
            worker = _parse_worker(path, at, raw_worker, produced, known_agents)
            _check(worker.output not in produced | {w.output for w in workers}, path,
                   at + ".role", "repeats the role %s (roles name the output files, so they "
                   "are unique in a pipeline)" % json.dumps(worker.role))
            if worker.final:
                finals.append((worker.role, p_index, at + ".final"))
            workers.append(worker)
        produced |= {w.output for w in workers}          # readable from the next phase on
        phases.append(PhaseDef(phase_id, raw["mode"], tuple(workers), pause_after))
    _check(len(finals) == 1, path, name, "has %s final workers%s; exactly one worker, in the "
           "last phase, must have \"final\": true (its output is the result)" % (
               len(finals) or "no", " (%s)" % ", ".join(f[0] for f in finals) if finals else ""))
    _check(finals[0][1] == len(phases) - 1, path, finals[0][2],
           "marks a worker outside the last phase; the final worker must be in the last phase")
    return PipelineDef(name, body.get("description", ""), tuple(phases))


def _parse_worker(path, where, raw, produced, known_agents):
    _check_keys(path, where, raw, ("role", "agent", "model", "timeout", "task", "reads", "final"),
                ("role", "timeout", "task"))
    role = _check_text(path, where + ".role", raw["role"], _ROLE_RE,
                       "a role of letters, digits, '.', - and _ (it names <role>.md)")
    timeout = raw["timeout"]
    _check(type(timeout) is int and 0 < timeout <= 604800, path, where + ".timeout",
           "must be a number of seconds from 1 to 604800", timeout)
    for key in ("agent", "model"):
        _check(isinstance(raw.get(key, ""), str), path, "%s.%s" % (where, key),
               "must be a string", raw.get(key))
    agent = raw.get("agent", "").strip()
    _check(not agent or known_agents is None or agent in known_agents, path, where + ".agent",
           "names the unknown agent %s (known: %s)" % (json.dumps(agent),
                                                       ", ".join(known_agents or ())))
    reads = raw.get("reads", [])
    _check(isinstance(reads, list) and all(isinstance(r, str) for r in reads), path,
           where + ".reads", "must be an array of file names", reads)
    for name in reads:
        _check(name in produced, path, where + ".reads", "names %s, which no worker of an "
               "earlier phase writes (earlier outputs: %s)" % (
                   json.dumps(name), ", ".join(sorted(produced)) or "none"))
    final = raw.get("final", False)
    _check(isinstance(final, bool), path, where + ".final", "must be true or false", final)
    return WorkerDef(role, _check_text(path, where + ".task", raw["task"]), timeout, agent,
                     raw.get("model", "").strip(), tuple(reads), final)


def read_workflows(root, config):
    """(file name, its text, {name: PipelineDef}) checked against the project's agents."""
    name = pipelines_config(root).file
    try:
        text = read_text(os.path.join(root, name))
    except FileNotFoundError:
        raise FerrusError("%s not found in %s" % (name, root),
                          "`ferrus pipeline init` writes an example to edit") from None
    return name, text, parse_workflows(text, name, BUILTIN_AGENTS + tuple(config.agents.custom))


def pipeline_worker_launch(config, agent, root, prompt, model, reads=(), output=None):
    """One worker's Launch: headless, without ferrus's tools (a worker must not claim
    or submit the main task), allowed to write its output file (section 14)."""
    adapter = adapter_for(config, agent)
    if not adapter.executable():
        raise FerrusError("%s is not installed" % adapter.binary, adapter.install_hint())
    return adapter.worker(root, prompt, model, output, reads)


# -- worker processes --------------------------------------------------------------------------

# Runs as `python -c` in front of the agent: it records its pid, then becomes the
# agent.  exec keeps the pid on POSIX; Windows has no exec, so there the wrapper waits.
_PID_WRAPPER = (
    "import os, subprocess, sys\n"
    "with open(sys.argv[1] + '.tmp', 'w') as handle:\n"
    "    handle.write(str(os.getpid()))\n"
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "if os.name == 'nt':\n"
    "    sys.exit(subprocess.call(sys.argv[2:]))\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def start_worker_process(launch, root, base):
    """Start a worker that outlives us.  It gets its own process group, reads its
    prompt from ``base``.prompt, writes to ``base``.log, and records its pid in
    ``base``.pid.  None of our pipes is passed to it."""
    env = dict(os.environ)
    env.update(launch.env)
    stdin = subprocess.DEVNULL
    if launch.stdin is not None:
        atomic_write(base + ".prompt", launch.stdin)
        stdin = open(base + ".prompt", "rb")
    try:
        with open_private_log(base + ".log") as log_file:
            log_file.write(("$ %s\n" % " ".join(launch.argv)).encode("utf-8", "replace"))
            log_file.flush()
            return subprocess.Popen([sys.executable, "-c", _PID_WRAPPER, base + ".pid"] +
                                    list(launch.argv), cwd=root, env=env, stdin=stdin,
                                    stdout=log_file, stderr=subprocess.STDOUT,
                                    **process_group_kwargs())
    finally:
        if stdin is not subprocess.DEVNULL:
            stdin.close()


def worker_pid_running(pid):
    """pid_alive, except that the zombie an exited worker leaves behind counts as gone."""
    if not IS_WINDOWS:
        with contextlib.suppress(ChildProcessError, OSError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:     # our own child: reaped now
                return False
    if not pid_alive(pid):
        return False
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:   # Linux marks a zombie 'Z'
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class AdoptedWorker:
    """A worker that an earlier orchestrator started; all we know of it is its pid."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and not worker_pid_running(self.pid):
            self.returncode = "unknown"
        return self.returncode


# -- runs ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class PipelineRun:
    """One run of a pipeline: its folder and its status.json."""

    name: str
    path: str
    archived: bool
    status: dict
    definition: "PipelineDef | None" = None

    def file(self, *parts):
        return os.path.join(self.path, *parts)

    def phase(self):
        return self.status["phases"][self.status["current_phase"]]


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f]")


def summarize_output(path, label, max_lines=3, width=100, chunk=65536):
    """Lines telling a human what one worker's output holds without opening it: its
    size and its first non-empty lines (summarise, then wait).  Reads at
    most ``chunk`` bytes, so a huge output costs nothing."""
    try:
        size = os.path.getsize(path)
        with open(path, "r", encoding="utf-8", errors="replace") as handle:
            head = handle.read(chunk)
    except OSError as err:
        return ["  - %s (unreadable: %s)" % (label, err.strerror or err)]
    lines = [line.strip() for line in head.splitlines() if line.strip()]
    words = len(head.split())
    if size <= chunk:
        about = "%d non-empty line%s, %d words" % (len(lines), "s"[len(lines) == 1:], words)
    else:
        about = "%d bytes" % size
    summary = ["  - %s (%s)" % (label, about)]
    for line in lines[:max_lines]:
        line = _UNPRINTABLE.sub("?", line)
        summary.append("      " + (line if len(line) <= width else line[:width - 1] + "…"))
    if len(lines) > max_lines or size > chunk:
        summary.append("      …")
    return summary


@dataclasses.dataclass
class PipelineOutcome:
    """Where a run stands: running, blocked, paused, failed, delivered or cancelled.
    Every state except running needs a human or is final."""

    run: str
    state: str
    message: str = ""
    output: "str | None" = None     # delivered: the final output file, and its text
    text: "str | None" = None

    @property
    def finished(self):
        return self.state != "running"


def _new_worker(attempts=0):
    return {"status": "pending", "session": "", "pid": None, "started_at": None,
            "attempts": attempts, "token": "", "errors": 0, "total_errors": 0,
            "retry_at": None, "message": ""}


def _has_output(path):
    with contextlib.suppress(OSError):
        return os.path.getsize(path) > 0
    return False


def list_runs(store):
    """[(name, path, archived)] for every run: active ones first, newest first."""
    runs = []
    for archived, folder in ((False, store.path(PIPELINES_DIR)),
                             (True, store.path(PIPELINES_DIR, PIPELINE_ARCHIVE))):
        with contextlib.suppress(FileNotFoundError):
            runs += [(n, os.path.join(folder, n), archived)
                     for n in sorted(os.listdir(folder), reverse=True)
                     if os.path.isfile(os.path.join(folder, n, "status.json"))]
    return runs


def find_run(store, ref):
    """A run by its folder name or by a unique prefix of it."""
    runs = list_runs(store)
    matches = [r for r in runs if r[0] == ref] or [r for r in runs if r[0].startswith(ref)]
    if not matches:
        raise FerrusError("no pipeline run matches %s" % json.dumps(ref),
                          "`ferrus pipeline status` lists the runs")
    if len(matches) > 1:
        raise FerrusError("%s matches several runs: %s" % (
            json.dumps(ref), ", ".join(r[0] for r in matches)), "give more of the name")
    return matches[0]


def read_run(store, ref, with_definition=False):
    """A run's status.json (and its workflow.json snapshot), checked for damage."""
    name, path, archived = find_run(store, ref)
    where = store.relpath(os.path.join(path, "status.json"))
    hint = "repair it by hand (`ferrus log` shows what happened), or move %s away and start " \
        "a new run" % store.relpath(path)
    try:
        status = json.loads(read_text(os.path.join(path, "status.json")))
        for phase in status["phases"]:
            phase["workers"] = {role: dict(_new_worker(), **entry)
                                for role, entry in phase["workers"].items()}
        if not 0 <= status["current_phase"] < len(status["phases"]):
            raise IndexError("current_phase %r is not a phase" % status["current_phase"])
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise FerrusError("%s is damaged (%s: %s)" % (where, type(err).__name__, err),
                          hint) from err
    run = PipelineRun(name, path, archived, status)
    if with_definition:
        snapshot = os.path.join(path, "workflow.json")
        run.definition = parse_workflows(read_text(snapshot), store.relpath(snapshot))[
            status["pipeline"]]
        if [(p.id, sorted(w.role for w in p.workers)) for p in run.definition.phases] != \
                [(p.get("id"), sorted(p["workers"])) for p in status["phases"]]:
            raise FerrusError("%s does not match the run's workflow.json" % where, hint)
    return run


def run_state(status):
    """running | paused | failed | delivered | cancelled, as status.json has it."""
    if status.get("cancelled"):
        return "cancelled"
    if status.get("result_delivered"):
        return "delivered"
    if any(p["status"] == "failed" for p in status["phases"]):
        return "failed"
    return "paused" if status.get("paused") else "running"


# -- the orchestrator ----------------------------------------------------------------------------

class PipelineOrchestrator:
    """Creates runs and reconciles them; the only writer of status.json.

    ``clock`` returns aware datetimes (the store's clock by default).  Deadlines are
    kept in status.json as timestamps so that they survive restarts.
    ``spawner(launch, root, base)`` starts a worker and returns something with
    ``pid`` and ``poll()``.  ``gate(target)`` is the capacity hook: it is asked
    before every spawn and answers Continue, Throttle, Checkpoint or EmergencyStop.
    ``emit`` receives an HqMessage for every event."""

    # A running worker that showed nothing for this long gets a heartbeat line.
    HEARTBEAT_SECS = 60.0
    WATCH_READ_BYTES = 65536       # at most this much of a worker's log is read per look

    def __init__(self, store, clock=None, spawner=None, gate=None, emit=None, bell=None):
        self.store = store.require()
        self.clock = clock or store.clock
        self.spawner = spawner or start_worker_process
        self.gate = gate or self._capacity_gate
        self.emit = emit or (lambda message: log.info("%s", message.text))
        # emit may be replaced later (HQ follows a run with its own), so look it up late.
        self.notifier = Notifier(store, lambda message: self.emit(message), bell)
        self._watched = {}         # (run, role, attempt) -> what watch() read of its log
        self.config = store.config()
        self.settings = pipelines_config(store.root)
        self.limits = sessions_config(store.root)
        self._processes = {}       # (run, role) -> (spawn token, the process, ours or adopted)
        self._pending = []         # journal entries that wait for the next status.json write
        self._run = None           # the run being reconciled, for the default gate

    def _lock(self):
        os.makedirs(self.store.path(PIPELINES_DIR), exist_ok=True)
        return FileLock(self.store.path(PIPELINES_DIR, ".lock"), self.store.lock_timeout,
                        "%s/%s/.lock" % (FERRUS_DIR, PIPELINES_DIR))

    def _now(self):
        return format_timestamp(self.clock())

    def _age(self, stamp):
        return (self.clock() - parse_timestamp(stamp)).total_seconds()

    def _note(self, run, event, text, kind="info", **detail):
        self._pending.append((event, dict(run=run.name, **detail), HqMessage(kind, text)))

    def _save(self, run):
        """Write status.json first (it is the truth), then journal what it records."""
        atomic_write(run.file("status.json"), pretty_json(run.status) + "\n")
        pending, self._pending = self._pending, []
        for event, detail, message in pending:
            with contextlib.suppress(FerrusError, OSError):
                self.store.append_event("pipeline", event, detail)
            self.emit(message)

    def create(self, pipeline, topic):
        """Make the run folder with a workflow.json snapshot and status.json; return its name."""
        if not topic.strip():
            raise UsageError("the topic is empty", "ferrus pipeline run NAME TOPIC")
        file_name, text, definitions = read_workflows(self.store.root, self.config)
        if pipeline not in definitions:
            raise FerrusError("no pipeline %s in %s" % (json.dumps(pipeline), file_name),
                              "defined: %s" % (", ".join(definitions) or "none"))
        # The snapshot fixes the definition and the default agent for the whole run.
        snapshot = json.loads(text)[pipeline]
        for p_index, phase in enumerate(snapshot["phases"]):
            for w_index, worker in enumerate(phase["workers"]):
                if not worker.get("agent", "").strip():
                    choice = self.config.require_hq().executor
                    _check(choice is not None, file_name, "%s.phases[%d].workers[%d]" % (
                        pipeline, p_index, w_index), "names no agent and ferrus.toml has no "
                        "[hq.executor] to default to")
                    worker.update(agent=choice.agent, model=worker.get("model") or choice.model)
        definition = parse_workflows(json.dumps({pipeline: snapshot}), file_name)[pipeline]
        stamp = self.clock().astimezone().strftime("%Y%m%d-%H%M%S")
        taken = {name for name, _, _ in list_runs(self.store)}
        with self._lock():
            for name in ["%s-%s%s" % (pipeline, stamp, suffix)
                         for suffix in [""] + ["-%d" % n for n in range(2, 100)]]:
                path = self.store.path(PIPELINES_DIR, name)
                if name not in taken and not os.path.exists(path):
                    break
            else:
                raise FerrusError("too many %s runs started within one second" % pipeline)
            os.makedirs(os.path.join(path, "logs"))
            atomic_write(os.path.join(path, "workflow.json"),
                         pretty_json({pipeline: snapshot}) + "\n")
            status = {"pipeline": pipeline, "dir": name, "topic": topic.strip(),
                      "current_phase": 0, "retry_count": 0,
                      "phases": [{"id": p.id, "status": "pending", "started_at": None,
                                  "message": "", "workers": {w.role: _new_worker()
                                                             for w in p.workers}}
                                 for p in definition.phases],
                      "result_delivered": False, "paused": False, "paused_reason": "",
                      "cancelled": False, "created_at": self._now()}
            run = PipelineRun(name, path, False, status, definition)
            self._note(run, "run_created", "run %s created in %s" % (
                name, self.store.relpath(path)), pipeline=pipeline, topic=status["topic"])
            self._save(run)
        return name

    # -- reconcile: files in; status.json and the decision table out ----------------------

    def reconcile(self, ref):
        """One idempotent step; returns a PipelineOutcome."""
        with self._lock():
            run = read_run(self.store, ref, with_definition=True)
            before = json.dumps(run.status, sort_keys=True)
            self._run = run
            try:
                return self._decide(run)
            finally:
                self._run = None
                if self._pending or json.dumps(run.status, sort_keys=True) != before:
                    self._save(run)
                self._settle_records(run)
                self._sweep(run)

    def _decide(self, run):
        status = run.status
        if status.get("cancelled") or status["result_delivered"]:
            return self._archive(run)            # result_delivered → archive
        while True:
            index, phase = status["current_phase"], run.phase()
            definition = run.definition.phases[index]
            if phase["status"] == "pending":
                phase.update(status="running", started_at=self._now())
                self._note(run, "phase_started", "phase %s started (%d worker%s, %s)" % (
                    phase["id"], len(definition.workers), "s"[len(definition.workers) == 1:],
                    definition.mode), phase=phase["id"])
            self._observe(run, definition)
            # A phase is failed while a worker of it is (retry, or a late output, lifts
            # that); its other workers run on and their outputs are kept.
            failed = [role for role, w in phase["workers"].items() if w["status"] == "failed"]
            if failed:
                message = "; ".join("%s failed: %s" % (role, phase["workers"][role]["message"])
                                    for role in failed)
                if (phase["status"], phase["message"]) != ("failed", message):
                    phase.update(status="failed", message=message)
                    self._note(run, "phase_failed", "phase %s failed — %s" % (
                        phase["id"], message), "error", phase=phase["id"], workers=failed)
                return PipelineOutcome(run.name, "failed", message)
            if phase["status"] == "failed":
                phase.update(status="running", message="")
            problems = self._dispatch_gates(run, definition)
            if not problems and all(w["status"] == "completed" for w in phase["workers"].values()):
                phase.update(status="completed", finished_at=self._now())
                self._note(run, "phase_completed", "phase %s completed" % phase["id"],
                           phase=phase["id"])
                if index == len(status["phases"]) - 1:
                    return self._deliver(run)
                status["current_phase"] += 1
                if definition.pause_after:
                    summary = [line for w in definition.workers
                               for line in summarize_output(run.file(w.output),
                                                            self.store.relpath(run.file(w.output)))]
                    self._pause(run, "pause_after %s" % phase["id"], "phase %s is done; its "
                                "outputs:\n%s\nRead them, then `ferrus pipeline continue %s` "
                                "starts phase %s" % (phase["id"], "\n".join(summary), run.name,
                                                     run.phase()["id"]))
                else:
                    continue           # the next phase starts at once
            if not problems and not status["paused"]:
                self._dispatch(run, definition)
            if status["paused"]:
                return PipelineOutcome(run.name, "paused", status["paused_reason"])
            if problems and not any(w["status"] in WORKER_RUNNING for w in phase["workers"].values()):
                return PipelineOutcome(run.name, "blocked", phase["message"])
            return PipelineOutcome(run.name, "running", phase["message"])

    def _observe(self, run, definition):
        """Bring the current phase's workers up to date with their files and processes."""
        for worker in definition.workers:
            entry = run.phase()["workers"][worker.role]
            if entry["status"] in ("completed", "cancelled"):
                continue
            if entry["attempts"] and _has_output(run.file(worker.output)):
                # The file is the signal, whatever the session thought.
                if entry["status"] == "running":
                    self._step(run, worker.role, SessionEvent("SessionExited", outcome="success"))
                entry.update(status="completed", retry_at=None, message="")
                self._note(run, "worker_completed", "%s completed: %s" % (
                    worker.role, run.file(worker.output)), role=worker.role)
                continue
            if entry["status"] not in WORKER_RUNNING:
                continue
            process = self._process(run, worker.role, entry)
            if entry["status"] == "spawning":
                if process is None and self._age(entry["started_at"]) < SPAWN_GRACE_SECS:
                    continue           # someone may be recording its start right now
                if process is not None:
                    self._step(run, worker.role, SessionEvent("SessionStarted", entry["attempts"]))
                    entry["pid"] = process.pid
                    self._note(run, "worker_adopted", "%s was started before a restart; adopted "
                               "pid %d" % (worker.role, process.pid), "agent", role=worker.role,
                               pid=process.pid, attempt=entry["attempts"])
            if process is not None and process.poll() is None:
                if self._age(entry["started_at"]) > definition.timeout + PIPELINE_GRACE_SECS:
                    self._step(run, worker.role, SessionEvent("OperatorStop"))
                    kill_process_tree(process)
                    entry["message"] = "timed out: still running after %s (phase timeout %ds " \
                        "+ %ds)" % (format_duration(self._age(entry["started_at"])),
                                    definition.timeout, PIPELINE_GRACE_SECS)
                    self._note(run, "worker_failed", "%s %s" % (worker.role, entry["message"]),
                               "error", role=worker.role, reason="timeout")
                continue
            code = getattr(process, "returncode", None)
            self._exited(run, worker, entry, "its start was interrupted before the process "
                         "existed" if process is None else "exited %swithout writing %s" % (
                             "with code %s " % code if isinstance(code, int) else "",
                             worker.output))

    def _exited(self, run, worker, entry, why):
        """A session ended without output: the session machine decides between a retry
        and a stop."""
        _, effect = self._step(run, worker.role, SessionEvent("SessionExited", outcome="error"))
        entry.update(pid=None, message=why)
        if entry["status"] == "cooling":
            wait = backoff_ms(entry["errors"]) / 1000.0
            entry["retry_at"] = format_timestamp(self.clock() + _dt.timedelta(seconds=wait))
            self._note(run, "worker_failed", "%s %s; retrying in %s (error %d in a row)" % (
                worker.role, why, format_duration(wait), entry["errors"]), "warning",
                role=worker.role, retry_in=wait, attempt=entry["attempts"])
        else:
            entry["message"] = "%s (%s)" % (why, effect[1])
            self._note(run, "worker_failed", "%s %s; %s" % (worker.role, why, effect[1]),
                       "error", role=worker.role, attempt=entry["attempts"])

    def _step(self, run, role, event):
        """One transition of the session that a worker entry persists."""
        entry = next(p["workers"][role] for p in run.status["phases"] if role in p["workers"])
        session = Session(state=_SESSION_OF[entry["status"]], session_seq=entry["attempts"],
                          consecutive_errors=entry["errors"], total_errors=entry["total_errors"],
                          max_consecutive_errors=self.limits.max_consecutive_errors,
                          max_total_errors=self.limits.max_total_errors)
        session, effect = session_step(session, event)
        entry.update(status=_STATUS_OF[session.state], errors=session.consecutive_errors,
                     total_errors=session.total_errors)
        return session, effect

    def _process(self, run, role, entry):
        """The worker's process: ours, or one adopted by the pid in status.json or its pid file."""
        token, process = self._processes.get((run.name, role), (None, None))
        if process is not None and token == entry["token"]:
            return process
        pid = entry["pid"]
        with contextlib.suppress(OSError, ValueError):
            pid = pid or int(read_text(self._base(run, role, entry) + ".pid"))
        if not pid:
            return None
        self._processes[(run.name, role)] = (entry["token"], AdoptedWorker(pid))
        return self._processes[(run.name, role)][1]

    def _base(self, run, role, entry):
        return run.file("logs", "%s-%d" % (role, entry["attempts"]))

    # -- session records ------------------------------------------------------------------

    @staticmethod
    def _record_id(run, role, entry):
        """A worker attempt's record is named by the run, role and attempt, so whichever
        orchestrator sees the attempt end can close it."""
        return "w-%s-%s-%d" % (run.name, role, entry["attempts"])

    # How an ended worker attempt's record reads, by the worker's status after it.
    _RECORD_OUTCOME = {"completed": "success", "failed": "failed", "cooling": "error",
                       "cancelled": "cancelled", "pending": "stopped"}

    def _settle_records(self, run):
        """Close the record of every worker attempt that is over and whose process has
        exited; its counts are read from its log, which then holds all of its output."""
        records = {r["id"]: r for r in read_session_records(self.store)
                   if r.get("pipeline") == run.name and r.get("status") == "running"}
        if not records:
            return
        workers = {w.role: w for p in run.definition.phases for w in p.workers}
        for phase in run.status["phases"]:
            for role, entry in phase["workers"].items():
                record = records.get(self._record_id(run, role, entry))
                if record is None or entry["status"] in WORKER_RUNNING:
                    continue
                token, process = self._processes.get((run.name, role), (None, None))
                if process is not None and token == entry["token"]:
                    if process.poll() is None:
                        continue        # it wrote its output and is still finishing
                elif isinstance(record.get("pid"), int) and worker_pid_running(record["pid"]):
                    continue
                tally = None
                with contextlib.suppress(FerrusError):
                    worker = workers.get(role)
                    parse_line = adapter_for(self.config, worker.agent if worker else
                                             record.get("agent") or "").parse_line
                    tally = usage_from_log(self._base(run, role, entry) + ".log", parse_line)
                close_session_record(self.store, dict(record),
                                     self._RECORD_OUTCOME.get(entry["status"], entry["status"]),
                                     getattr(process, "returncode", None)
                                     if token == entry["token"] else None, tally,
                                     entry.get("message") or None)

    def _relocate_records(self, run, old_path):
        """The run folder moved (to the archive): its records name the logs' new place."""
        old, new = self.store.relpath(old_path) + "/", self.store.relpath(run.path) + "/"
        for shared in read_session_records(self.store):
            if shared.get("pipeline") == run.name and str(shared.get("log")).startswith(old):
                record = dict(shared, log=new + shared["log"][len(old):])
                with contextlib.suppress(OSError):
                    write_session_record(self.store, record)

    def await_workers(self, ref, grace=10.0, poll_interval=0.1):
        """After a run ends: give its workers that are still finishing (their output is
        written, their last words are not) a moment to exit, so their records get the
        final counts and cost; whatever still runs after ``grace`` is closed later."""
        run = read_run(self.store, ref)
        over = {role for p in run.status["phases"] for role, w in p["workers"].items()
                if w["status"] not in WORKER_RUNNING}
        finishing = [process for (name, role), (_, process) in list(self._processes.items())
                     if name == run.name and role in over]
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in finishing):
            time.sleep(poll_interval)
        with self._lock():
            run = read_run(self.store, ref, with_definition=True)
            self._settle_records(run)
            self._sweep(run)

    def _sweep(self, run):
        """Forget, and so reap, the exited processes whose exit is already recorded."""
        watched = {role for p in run.status["phases"]
                   for role, w in p["workers"].items() if w["status"] in WORKER_RUNNING}
        for key, (_, process) in list(self._processes.items()):
            if key[0] == run.name and key[1] not in watched and process.poll() is not None:
                del self._processes[key]

    # -- dispatch gates (ARCHITECTURE.md, 'Dispatch gates') ------------------------------------

    def _dispatch_gates(self, run, definition):
        """Coverage, batch size and input coverage for the current phase.  While one of
        them fails, the phase is "blocked" and nothing more in it is dispatched."""
        phase, problems = run.phase(), []
        for worker in definition.workers:
            entry = phase["workers"][worker.role]
            recorded = bool(entry["token"] and entry["attempts"])
            if entry["status"] == "completed" and not recorded:
                problems.append("coverage: %s is marked completed without a dispatch record"
                                % worker.role)
            elif not recorded and _has_output(run.file(worker.output)):
                problems.append("coverage: %s exists but %s was never dispatched (`ferrus "
                                "pipeline retry %s %s` discards it and runs the worker)" % (
                                    worker.output, worker.role, run.name, worker.role))
            missing = [name for name in worker.reads if not _has_output(run.file(name))]
            if missing and entry["status"] in ("pending", "cooling"):
                problems.append("input: %s waits for %s (missing)" % (
                    worker.role, ", ".join(missing)))
        running = [role for role, w in phase["workers"].items() if w["status"] in WORKER_RUNNING]
        if len(running) > self._batch_limit(definition):
            problems.append("batch size: %d workers running (%s), more than the %d allowed" % (
                len(running), ", ".join(running), self._batch_limit(definition)))
        message = "; ".join(problems)
        if problems and message != phase["message"]:
            self._note(run, "phase_blocked", "phase %s blocked — %s" % (phase["id"], message),
                       "warning", phase=phase["id"], problems=problems)
        if problems or phase["status"] == "blocked":
            phase.update(status="blocked" if problems else "running", message=message)
        return problems

    def _batch_limit(self, definition):
        return 1 if definition.mode == "sequential" else self.settings.max_parallel

    def _dispatch(self, run, definition):
        """Start what the phase allows: in definition order, at most the batch limit at once."""
        phase, now = run.phase(), self.clock()
        running = sum(w["status"] in WORKER_RUNNING for w in phase["workers"].values())
        for worker in definition.workers:
            entry = phase["workers"][worker.role]
            if entry["status"] == "completed":
                continue
            due = entry["status"] == "pending" or (
                entry["status"] == "cooling" and parse_timestamp(entry["retry_at"]) <= now)
            if due and running < self._batch_limit(definition):
                action = self.gate("pipeline:%s:%s" % (run.name, worker.role))
                if action == CHECKPOINT:
                    self._pause(run, "capacity checkpoint", "capacity checkpoint before %s; "
                                "`ferrus pipeline continue %s` goes on" % (worker.role, run.name))
                    return
                if action == EMERGENCY_STOP:
                    stopped = self._stop_workers(run, "pending", "stopped by the capacity gate")
                    self._pause(run, "capacity emergency stop", "capacity emergency stop; "
                                "stopped %s" % (", ".join(stopped) or "no worker"))
                    return
                self._spawn(run, worker, entry, throttled=action == THROTTLE)
                running += entry["status"] in WORKER_RUNNING
            if definition.mode == "sequential":
                return                 # the next worker waits for this one to finish

    def _spawn(self, run, worker, entry, throttled=False):
        """spawning (the dispatch record, saved first), then start, then running with a pid."""
        self._step(run, worker.role, SessionEvent("BackoffElapsed" if entry["status"] == "cooling"
                                                  else "WorktreeReady"))
        reads = [run.file(name) for name in worker.reads]
        prompt = prompt_pipeline_worker(run.status["topic"], worker.task, reads,
                                        run.file(worker.output))
        self._step(run, worker.role, SessionEvent("PromptReady", prompt))
        run.status["retry_count"] += bool(entry["attempts"])
        token = random_hex(4)
        entry.update(status="spawning", token=token, attempts=entry["attempts"] + 1, pid=None,
                     session="pipeline:%s:%s:%s" % (run.name, worker.role, token),
                     started_at=self._now(), retry_at=None)
        self._save(run)
        try:
            launch = pipeline_worker_launch(self.config, worker.agent, self.store.root, prompt,
                                            worker.model, reads, run.file(worker.output))
            process = self.spawner(launch, self.store.root, self._base(run, worker.role, entry))
        except FerrusError as err:
            self._step(run, worker.role, SessionEvent("FatalError", err.full_text()))
            entry["message"] = err.full_text()
            self._note(run, "worker_failed", "%s cannot start: %s" % (worker.role, err.message),
                       "error", role=worker.role)
            return
        except OSError as err:
            self._exited(run, worker, entry, "could not start: %s" % err)
            return
        self._processes[(run.name, worker.role)] = (token, process)
        open_session_record(self.store, self._record_id(run, worker.role, entry), slot="worker",
                            role=worker.role, agent=worker.agent, model=worker.model or "",
                            pipeline=run.name, pid=process.pid,
                            log=self.store.relpath(self._base(run, worker.role, entry) + ".log"),
                            argv=list(launch.argv), prompt=prompt)
        self._step(run, worker.role, SessionEvent("SessionStarted", entry["attempts"]))
        entry.update(pid=process.pid, message="")
        self._note(run, "worker_spawned", "%s spawned (pid %d, attempt %d, agent %s)%s" % (
            worker.role, process.pid, entry["attempts"], worker.agent,
            " after a capacity throttle" if throttled else ""), "agent", role=worker.role,
            pid=process.pid, attempt=entry["attempts"], token=token, throttled=throttled)
        self._save(run)

    def _capacity_gate(self, target):
        """The default hook: the capacity gate on this run's own signals, each decision
        journaled.
        A Throttle is only recorded here; waiting is the business of the gate's owner."""
        limits = self.config.capacity
        if not limits.enabled() or self._run is None:
            return CONTINUE
        workers = [w for p in self._run.status["phases"] for w in p["workers"].values()]
        used = usage_summary([r for r in read_session_records(self.store)
                              if r.get("pipeline") == self._run.name])
        signals = Signals(sessions=sum(w["attempts"] for w in workers) + 1,
                          tokens_used=used["input_tokens"] + used["output_tokens"],
                          parallel_agents=sum(w["status"] in WORKER_RUNNING for w in workers) + 1)
        tier, action, worst = classify(signals, limits)
        with contextlib.suppress(FerrusError, OSError):
            self.store.append_event("pipeline", "gate", gate_record(target, tier, action, signals,
                                                                    limits, worst))
        return action

    # -- pausing, delivering, stopping -------------------------------------------------------------

    def _pause(self, run, reason, text):
        run.status.update(paused=True, paused_reason=reason)
        self._note(run, "paused", text, "warning", reason=reason)

    def _deliver(self, run):
        final = run.definition.final_worker()
        run.status.update(result_delivered=True, result=final.output, delivered_at=self._now())
        # The folder moves to the archive right after this, so name the output where it
        # will be (the run's current path would no longer exist).
        archived = self.store.path(PIPELINES_DIR, PIPELINE_ARCHIVE, run.name, final.output)
        where = self.store.relpath(run.file(final.output) if run.archived else archived)
        self._note(run, "delivered", "delivered %s" % where, output=final.output)
        self._save(run)            # delivered on disk before the folder moves
        self.notifier.notify("pipeline_delivered", run.name, "%s: %s" % (
            run.status.get("topic", ""), where))
        return self._archive(run)

    def _archive(self, run):
        """Move a finished run into .ferrus/pipelines/archive/ (again: nothing to do)."""
        if not run.archived:
            archive = self.store.path(PIPELINES_DIR, PIPELINE_ARCHIVE)
            os.makedirs(archive, exist_ok=True)
            old_path = run.path
            os.replace(run.path, os.path.join(archive, run.name))
            fsync_directory(archive)
            run.path, run.archived = os.path.join(archive, run.name), True
            self._relocate_records(run, old_path)
            self._note(run, "archived", "run %s archived in %s" % (
                run.name, self.store.relpath(run.path)), to=self.store.relpath(run.path))
        if run.status.get("cancelled"):
            return PipelineOutcome(run.name, "cancelled", "the run was cancelled")
        output = run.file(run.status.get("result") or run.definition.final_worker().output)
        return PipelineOutcome(run.name, "delivered", output, output,
                               read_text(output, default=""))

    def _stop_workers(self, run, status, why):
        """Kill the current phase's running workers and leave each in ``status``."""
        stopped = []
        for role, entry in run.phase()["workers"].items():
            if entry["status"] in WORKER_RUNNING:
                process = self._process(run, role, entry)
                if process is not None and process.poll() is None:
                    kill_process_tree(process)
                self._step(run, role, SessionEvent("OperatorStop"))
                # As in HQ after OperatorStop: the next dispatch is a fresh session.
                entry.update(status=status, pid=None, errors=0, message=why)
                stopped.append(role)
                self._note(run, "worker_stopped", "%s stopped (%s)" % (role, why), "warning",
                           role=role)
        return stopped

    # -- operator commands ----------------------------------------------------------------------

    def _change(self, ref, change):
        """Apply ``change(run)`` to an active run under the lock, then save it."""
        with self._lock():
            run = read_run(self.store, ref, with_definition=True)
            if run.archived:
                raise FerrusError("run %s is %s and archived" % (run.name, run_state(run.status)),
                                  "start a new one with `ferrus pipeline run`")
            change(run)
            self._save(run)
            return run.name

    def continue_run(self, ref):
        """Un-pause after pause_after or a capacity checkpoint."""
        def change(run):
            if not run.status["paused"]:
                raise FerrusError("run %s is not paused (it is %s)" % (
                    run.name, run_state(run.status)),
                    "`ferrus pipeline resume %s` follows it" % run.name)
            self._note(run, "continued", "continuing after %s" % run.status["paused_reason"],
                       reason=run.status["paused_reason"])
            run.status.update(paused=False, paused_reason="")
        return self._change(ref, change)

    def retry(self, ref, role):
        """Forget a worker's failure (or a stray output) so that it runs again."""
        def change(run):
            phase = run.phase()
            if role not in phase["workers"]:
                raise UsageError("%s is not a worker of the current phase %s (workers: %s)" % (
                    json.dumps(role), phase["id"], ", ".join(phase["workers"])))
            entry = phase["workers"][role]
            if entry["status"] in WORKER_RUNNING:
                raise FerrusError("%s is running (pid %s)" % (role, entry["pid"]),
                                  "wait for it, or `ferrus pipeline cancel %s`" % run.name)
            if entry["status"] == "completed" and entry["token"]:
                raise FerrusError("%s already completed" % role,
                                  "its output is %s" % run.file(role + ".md"))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(run.file(role + ".md"))   # a stray or partial output is no signal
            phase["workers"][role] = dict(_new_worker(entry["attempts"]), token=entry["token"])
            if phase["status"] in ("failed", "blocked"):
                phase.update(status="running", message="")    # reconcile derives both again
            self._note(run, "worker_retry", "%s will run again" % role, role=role)
        return self._change(ref, change)

    def cancel(self, ref):
        """Stop the run's workers, mark it cancelled and archive it."""
        def change(run):
            stopped = self._stop_workers(run, "cancelled", "the run was cancelled")
            for phase in run.status["phases"]:
                if phase["status"] not in ("completed", "failed"):
                    phase["status"] = "cancelled"
            run.status.update(cancelled=True, paused=False)
            self._note(run, "cancelled", "run %s cancelled%s" % (run.name, (
                "; stopped " + ", ".join(stopped)) if stopped else ""), "warning", stopped=stopped)
            self._save(run)        # cancelled on disk before the folder moves
            self._archive(run)
        return self._change(ref, change)

    def drive(self, ref, poll_interval=0.1, should_stop=None):
        """Reconcile until the run is done or needs a human: the foreground loop."""
        while True:
            outcome = self.reconcile(ref)
            if outcome.finished:
                self.await_workers(outcome.run, poll_interval=poll_interval)
            if outcome.finished or (should_stop is not None and should_stop()):
                return outcome
            self.watch(ref)
            time.sleep(poll_interval)

    # -- live progress ------------------------------------------------------------------------

    def watch(self, ref):
        """What the current phase's running workers are doing, as HQ shows its agents:
        one line per tool call their output reports, and a heartbeat (time, tool calls,
        last words) when one showed nothing for HEARTBEAT_SECS.  Only reads: progress is
        no part of status.json."""
        try:
            run = read_run(self.store, ref, with_definition=True)
        except (FerrusError, OSError, ValueError):
            return
        if run.archived:
            return
        now, current = self.clock(), set()
        definition = run.definition.phases[run.status["current_phase"]]
        for worker in definition.workers:
            entry = run.phase()["workers"][worker.role]
            if entry["status"] not in WORKER_RUNNING or not entry["attempts"]:
                continue
            key = (run.name, worker.role, entry["attempts"])
            current.add(key)
            watched = self._watched.get(key)
            if watched is None:
                parse = None
                with contextlib.suppress(FerrusError):
                    parse = adapter_for(self.config, worker.agent).parse_line
                watched = self._watched[key] = {"offset": 0, "rest": b"", "calls": 0,
                                                "said": "", "shown": now, "parse": parse}
            self._read_worker_log(run, worker.role, entry, watched)
            if (now - watched["shown"]).total_seconds() >= self.HEARTBEAT_SECS:
                watched["shown"] = now
                secs = self._age(entry["started_at"]) if entry.get("started_at") else 0.0
                text = "%s working, %s, %d tool call%s" % (
                    worker.role, format_duration(secs), watched["calls"],
                    "" if watched["calls"] == 1 else "s")
                if watched["said"]:
                    said = watched["said"]
                    text += "; last output: " + (said if len(said) <= 100 else said[:99] + "…")
                self.emit(HqMessage("agent", text, "heartbeat", {
                    "run": run.name, "slot": worker.role, "secs": round(secs, 1),
                    "tool_calls": watched["calls"], "last_output": watched["said"]}))
        for key in [k for k in self._watched if k[0] == run.name and k not in current]:
            del self._watched[key]

    def _read_worker_log(self, run, role, entry, watched):
        try:
            with open(self._base(run, role, entry) + ".log", "rb") as handle:
                handle.seek(watched["offset"])
                data = handle.read(self.WATCH_READ_BYTES)
        except OSError:
            return
        watched["offset"] += len(data)
        lines = (watched["rest"] + data).split(b"\n")
        watched["rest"] = lines.pop()[-self.WATCH_READ_BYTES:]
        for raw in lines:
            line = raw.decode("utf-8", "replace").strip()
            if not line or line.startswith("$ "):      # the command line ferrus wrote
                continue
            if not line.startswith("{"):
                watched["said"] = line[:200]
            events = []
            if watched["parse"] is not None:
                with contextlib.suppress(Exception):   # a parser never stops the loop
                    events = watched["parse"](line)
            for event in events:
                if event.kind == "tool_call":
                    watched["calls"] += 1
                    watched["shown"] = self.clock()
                    line = tool_line(role, event.name, event.text, self.store.root)
                    self.emit(HqMessage("agent", line, "tool_call", {
                        "run": run.name, "slot": role, "tool": event.name, "input": event.text,
                        "ok": event.ok}))


WORKFLOWS_EXAMPLE = {
    "_comment": [
        "ferrus pipelines (see docs/PIPELINES.md). Each top-level key but this one defines "
        "a pipeline:",
        "  description  what it is for",
        "  phases       run in order; a phase starts when every output of the previous exists",
        "    id         the phase's name;  mode: \"parallel\" or \"sequential\"",
        "    pause_after  true: stop after this phase until `ferrus pipeline continue RUN`",
        "    workers    each writes <role>.md in the run folder and exits",
        "      role, timeout (seconds), task     required",
        "      agent    an agent name; default: [hq.executor] in ferrus.toml",
        "      model    that agent's model name (e.g. sonnet); default: the agent's own",
        "      reads    outputs of earlier phases, e.g. [\"researcher-a.md\"]",
        "      final    exactly one worker, in the last phase: its output is the result",
        "Run: ferrus pipeline run research \"your topic\"",
    ],
    "research": {
        "description": "Pure research + analysis",
        "phases": [
            {"id": "collect", "mode": "parallel", "workers": [
                {"role": "researcher-a", "timeout": 600,
                 "task": "Research perspective A: main sources, facts, current state"},
                {"role": "researcher-b", "timeout": 600,
                 "task": "Research perspective B: alternative views, criticism, edge cases"}]},
            {"id": "synthesis", "mode": "sequential", "workers": [
                {"role": "synthesizer", "timeout": 420, "final": True,
                 "reads": ["researcher-a.md", "researcher-b.md"],
                 "task": "Synthesize research from both researchers"}]}]},
}


def init_workflows(root, report=print):
    """Write the example workflows.json; never over an existing file."""
    name = pipelines_config(root).file
    path = os.path.join(root, name)
    if os.path.exists(path):
        raise FerrusError("%s already exists" % name, "edit it, or move it away first")
    atomic_write(path, pretty_json(WORKFLOWS_EXAMPLE) + "\n")
    report("Wrote %s with an example pipeline (research). `ferrus pipeline list` shows it."
           % name)


def describe_workflows(definitions, config):
    """Lines listing every pipeline with its phases and workers."""
    default = config.executor.agent if config.executor else "[hq.executor] (not set)"
    lines = []
    for name, definition in definitions.items():
        lines.append("%s%s" % (name, " — " + definition.description
                               if definition.description else ""))
        for number, phase in enumerate(definition.phases, 1):
            lines.append("  %d. %s (%s%s, timeout %ds)" % (
                number, phase.id, phase.mode, ", pause after" if phase.pause_after else "",
                phase.timeout))
            for w in phase.workers:
                notes = [w.agent or default, "%ds" % w.timeout] + (["model " + w.model]
                                                                  if w.model else [])
                notes += ["reads " + ", ".join(w.reads)] if w.reads else []
                lines.append("     - %s%s (%s): %s" % (w.role, " [final]" if w.final else "",
                                                      ", ".join(notes), w.task))
    return lines or ["no pipelines defined"]


def describe_run(store, status, path, now=None):
    """Lines showing one run's phases and workers."""
    now = now or store.clock()
    lines = ["run       %s (%s%s)" % (status["dir"], run_state(status),
                                      ": " + status["paused_reason"] if status.get("paused")
                                      else ""),
             "pipeline  %s, topic %s" % (status["pipeline"], json.dumps(status["topic"])),
             "folder    %s" % store.relpath(path),
             "retries   %d" % status.get("retry_count", 0)]
    workers = [r for r in read_session_records(store) if r.get("pipeline") == status["dir"]]
    if workers:
        lines.append("usage     %s" % format_usage(usage_summary(workers)))
    for number, phase in enumerate(status["phases"], 1):
        current = "  <- current" if number - 1 == status["current_phase"] and \
            run_state(status) not in ("delivered", "cancelled") else ""
        lines.append("phase %d  %s: %s%s" % (number, phase["id"], phase["status"], current))
        if phase.get("message"):
            lines.append("          %s" % phase["message"])
        for role, w in phase["workers"].items():
            detail = "attempt %d" % w.get("attempts", 0) if w.get("attempts") else ""
            if w.get("status") in WORKER_RUNNING and w.get("pid"):
                detail += ", pid %s" % w["pid"]
                with contextlib.suppress(ValueError, TypeError):
                    detail += ", for %s" % format_duration(
                        (now - parse_timestamp(w["started_at"])).total_seconds())
            if w.get("message") and w.get("status") != "completed":
                detail += (", " if detail else "") + w["message"]
            lines.append("    %-16s %-10s %s" % (role, w.get("status"), detail))
    if status.get("result"):
        lines.append("result    %s" % store.relpath(os.path.join(path, status["result"])))
    return lines


def pipeline_command(store, args, out, follow, bell=None):
    """Run one `pipeline` subcommand; ``follow(orchestrator, run)`` drives a run."""
    command = args.pipeline_command
    if command == "init":
        init_workflows(store.root, out)
        return 0
    if command == "list":
        config = store.config()
        for line in describe_workflows(read_workflows(store.root, config)[2], config):
            out(line)
        return 0
    if command == "status":
        return _pipeline_status(store, args, out)
    orchestrator = PipelineOrchestrator(store, emit=lambda message: out(_run_line(message)),
                                        bell=bell)
    if command == "run":
        return follow(orchestrator, orchestrator.create(args.name, " ".join(args.topic)))
    if command == "resume":
        return follow(orchestrator, find_run(store, args.ref)[0])
    if command == "continue":
        return follow(orchestrator, orchestrator.continue_run(args.ref))
    if command == "retry":
        return follow(orchestrator, orchestrator.retry(args.ref, args.worker))
    orchestrator.cancel(args.ref)          # the parser allows nothing else
    return 0


def _pipeline_status(store, args, out):
    if args.ref:
        name, path, _ = find_run(store, args.ref)
        run = read_run(store, name)
        if args.json:
            out(json_for_terminal(pretty_json(run.status)))
        else:
            for line in describe_run(store, run.status, path):
                out(line)
        return 0
    rows = []
    for name, path, archived in list_runs(store):
        row = {"run": name, "state": "damaged", "archived": archived, "pipeline": "?",
               "topic": "", "phase": "?"}
        with contextlib.suppress(FerrusError):     # `status RUN` explains the damage
            status = read_run(store, name).status
            row.update(state=run_state(status), pipeline=status["pipeline"],
                       topic=status["topic"], phase="%d/%d %s" % (
                           status["current_phase"] + 1, len(status["phases"]),
                           status["phases"][status["current_phase"]]["id"]))
        rows.append(row)
    if args.json:
        out(json_for_terminal(pretty_json(rows)))
        return 0
    if not rows:
        out("no pipeline runs yet (`ferrus pipeline run NAME TOPIC` starts one)")
    for row in rows:
        out("%-32s %-10s phase %-16s %s%s" % (row["run"], row["state"], row["phase"],
                                             json.dumps(row["topic"]),
                                             "  (archived)" if row["archived"] else ""))
    return 0


def _pipeline_result(outcome, out):
    """Report how a followed run ended; the exit code says whether a human is needed."""
    if outcome.state == "delivered":
        out("result: %s" % outcome.output)
        out(outcome.text.rstrip())
        return 0
    if outcome.state == "failed":
        out("run %s failed: %s" % (outcome.run, outcome.message))
        out("hint: `ferrus pipeline retry %s WORKER` runs a worker again" % outcome.run)
        return RUN_FAILED
    if outcome.state in ("paused", "blocked"):
        out("run %s is %s: %s" % (outcome.run, outcome.state, outcome.message))
        return RUN_NEEDS_HUMAN
    out("run %s is %s" % (outcome.run, outcome.state))
    return RUN_FAILED if outcome.state == "cancelled" else RUN_COMPLETE


# ============================================================================
# 17. Init and doctor
# ============================================================================

CONSULT_TEMPLATE = """## Problem
...

## What I tried
...

## Options (if any)
...

## Question
...
"""

def default_config_text(agents_path=".agents"):
    return """\
# ferrus configuration.  Every key is optional unless noted; the values shown
# are the defaults.  Reference: docs/REFERENCE.md, section "ferrus.toml".

[checks]
# The check gate: commands that must all exit 0 before work can be submitted,
# run from the project root through the shell.  Agents cannot add commands.
commands = []
parallel = false        # run the commands at the same time
timeout_secs = 600      # per command; a command past it is killed (its whole process group)
fail_fast = false       # stop the remaining commands after the first failure

[limits]
max_check_retries = 20  # consecutive check failures before the task becomes Failed
max_review_cycles = 3   # reject -> fix round trips before the task becomes Failed
max_feedback_lines = 30 # output lines per failing command shown to the agent
wait_timeout_secs = 60  # how long one wait_* tool call blocks before returning a timeout

[lease]
ttl_secs = 90                # a claim expires this long after its last renewal
heartbeat_interval_secs = 30 # how often agents are asked to call /heartbeat

[spec]
directory = "docs/specs"     # where /create_spec saves specifications

[agents]
path = %s              # where `ferrus init` writes the skill files

[git]
branch = ""            # e.g. "ferrus/{task_id}": each task starts on a new branch of its own
commit = "off"         # "on_approve": commit the task's own files when it is approved

[notify]
# When an agent waits for you or the task ends (docs/REFERENCE.md, "Notifications").
bell = true            # the terminal bell in HQ and `ferrus run`
desktop = false        # also a desktop notification (notify-send, osascript, PowerShell)
command = []           # e.g. ["curl", "-s", "-d", "{event}: {summary}", "https://ntfy.sh/TOPIC"]

[parallel]
# Several queued tasks at once, each in its own git worktree and branch, merged into the
# target only when the checks pass on the result (`ferrus task add`, `ferrus run --parallel N`).
max_tasks = 1          # 1: queued tasks run one at a time in the checkout
integrate = "rebase"   # "merge": merge the target into the task's branch instead
target = ""            # the branch tasks merge into; "" = the branch checked out
worktree_dir = ""      # "" = <repository>.ferrus-worktrees beside the repository
delegates = []         # agents a supervisor's split-off tasks may go to ([] = [hq.executor]'s)
setup = []             # e.g. ["npm ci"]: run in each new worktree before its agents start

[hq.supervisor]
agent = "claude-code"  # claude-code | codex | qwen-code | gemini-cli
model = ""             # empty: the agent's own default

[hq.executor]
agent = "codex"        # claude-code | codex | qwen-code | gemini-cli
model = ""
""" % format_toml_value(agents_path)


SKILL_OVERVIEW = """---
name: ferrus
description: How the ferrus orchestration loop works — roles, states, tools and files. Advisory background; the prompt you were started with and the ferrus MCP tools always take precedence.
---

# ferrus

ferrus runs one task at a time through a fixed loop:

1. The **supervisor** agrees the task with the human and calls `create_task`.
2. The **executor** claims it with `wait_for_task`, implements it, runs `check`
   until the project's own lint and test commands pass, then calls `submit`.
3. A **reviewer** (the supervisor role) claims the submission with
   `wait_for_review` and calls `approve` or `reject` with notes.
4. A rejection sends the task back to the executor (state Addressing).

The state lives in `.ferrus/STATE.json`; agents keep nothing between runs.
Move the task only through the MCP tools — never edit `.ferrus/` by hand.

## States

Idle → Executing → Reviewing → Complete, with these detours:
- Executing/Addressing → Consultation (`consult`) → back (`wait_for_consult`)
- Executing/Addressing/Consultation/Reviewing → AwaitingHuman (`ask_human`) →
  back (`answer` by a human, read with `wait_for_answer`)
- Reviewing → Addressing (`reject`); check failures stay in place
- when the project sets `[hq] human_review`, `approve` leads to AwaitingConfirmation:
  only the human then approves (Complete) or rejects (Addressing); agents wait
- too many check failures or rejections → Failed (a human resets it)

## Tools by role

Supervisor: create_task, create_spec, wait_for_review, review_pending, approve,
reject, respond_consult, ask_human, wait_for_answer, answer, status, reset,
heartbeat.

Executor: wait_for_task, check, consult, wait_for_consult, submit, ask_human,
wait_for_answer, answer, status, heartbeat.

Every `wait_*` tool returns `{"status":"timeout"}` when nothing happened within
`wait_timeout_secs`; simply call it again.  Call `heartbeat` about every
`lease.heartbeat_interval_secs` while you hold a task.

## Resources

`ferrus://task`, `ferrus://review`, `ferrus://submission`, `ferrus://question`,
`ferrus://answer`, `ferrus://consult_template`, `ferrus://spec_template`,
`ferrus://consult_request`, `ferrus://consult_response`, `ferrus://state`,
`ferrus://events` (the recent journal) and `ferrus://logs/<file>` (check logs).
"""

SKILL_SUPERVISOR = """---
name: ferrus-supervisor
description: Playbook for the ferrus supervisor — defining tasks, reviewing submissions and answering consultations. Advisory; the initial prompt and the ferrus tools take precedence.
---

# Supervisor playbook

## Defining a task
- Write the outcome first, then constraints, then acceptance criteria a
  reviewer can check without guessing.
- Keep a task small enough to review in one sitting; split larger work into
  spec milestones (`create_spec`).
- Show the draft to the human and wait for a clear yes before `create_task`.

## Reviewing
- Start with `wait_for_review`; read the task, the submission notes and the
  diff itself, not only the notes: `review_pending` shows its stat and first
  part, `ferrus://diff` all of it, `ferrus://diff/<path>` one file.
- Approve when every acceptance criterion holds.  Otherwise `reject` with
  notes that name the file, the problem and the expected result.
- Do not fix the code yourself.

## Consultations
- Read `ferrus://consult_request`, answer the question that was asked, and
  give one recommended option.  Reply with `respond_consult`.

## Humans
- `ask_human` is for decisions only a human can make.  After it, call
  `wait_for_answer` and nothing else.

Tools: create_task, create_spec, wait_for_review, review_pending, approve,
reject, respond_consult, ask_human, wait_for_answer, answer, status, reset,
heartbeat.
"""

ROLE_SUPERVISOR = """---
name: ferrus-supervisor-role
description: What the ferrus supervisor is responsible for and what it must not do.
---

# Supervisor role

Responsible for: turning a human's intent into a precise task, reviewing the
executor's submission against it, and guiding the executor when it consults.

Never: implement the task, approve work that has not passed review, change
the task's state except through the ferrus tools, or edit files in `.ferrus/`.
"""

SKILL_EXECUTOR = """---
name: ferrus-executor
description: Playbook for the ferrus executor — implementing a task, using the check gate and submitting well. Advisory; the initial prompt and the ferrus tools take precedence.
---

# Executor playbook

## Working
- Call `wait_for_task` first; it returns the task and, after a rejection,
  the review notes you must address.
- Read the code around the change before editing.  Prefer the smallest diff
  that fully solves the task; follow the project's existing style.
- Run `check` whenever you want feedback and always right before `submit`.
  Each failure uses one retry from a limited budget, so read the output.
- Call `heartbeat` regularly so your lease does not expire.

## When stuck
- `consult` the supervisor with the four headings of
  `ferrus://consult_template` (Problem, What I tried, Options, Question), then
  call `wait_for_consult`.
- `ask_human` only when no agent can decide; then call `wait_for_answer`.

## Submitting
- `submit` runs the check gate again.  The notes say what changed, why, and
  how you verified it, and list anything left undone.

Tools: wait_for_task, check, consult, wait_for_consult, submit, ask_human,
wait_for_answer, answer, status, heartbeat.
"""

ROLE_EXECUTOR = """---
name: ferrus-executor-role
description: What the ferrus executor is responsible for and what it must not do.
---

# Executor role

Responsible for: implementing the claimed task, keeping the check gate green
with `check`, and handing the work over with `submit`.

Never: approve or review its own work, change the task's scope, or touch
`.ferrus/` except through the ferrus tools.
"""

SKILL_FILES = (
    ("skills/ferrus/SKILL.md", SKILL_OVERVIEW),
    ("skills/ferrus-supervisor/SKILL.md", SKILL_SUPERVISOR),
    ("skills/ferrus-supervisor/ROLE.md", ROLE_SUPERVISOR),
    ("skills/ferrus-executor/SKILL.md", SKILL_EXECUTOR),
    ("skills/ferrus-executor/ROLE.md", ROLE_EXECUTOR),
)


def init_project(root, agents_path=None, report=print):
    """`ferrus init`: create whatever is missing; never overwrite what exists."""
    root = os.path.abspath(root)
    config_path = os.path.join(root, CONFIG_FILE)
    if os.path.exists(config_path):
        report("%s already exists, kept as it is." % CONFIG_FILE)
        if agents_path is not None:
            report("(--agents-path only applies when ferrus.toml is created)")
    else:
        atomic_write(config_path, default_config_text(agents_path or ".agents"))
        report("Created %s" % CONFIG_FILE)
    try:
        config = load_config(root)
    except FerrusError as err:
        report("warning: %s — using defaults for the spec directory and agents path" % err)
        config = Config()
    store = Store(root)
    os.makedirs(store.path("logs"), exist_ok=True)

    def create(name, content):
        path = store.path(name)
        if os.path.exists(path):
            return
        atomic_write(path, content)
        report("Created %s/%s" % (FERRUS_DIR, name))

    create("CONSULT_TEMPLATE.md", CONSULT_TEMPLATE)
    create("SPEC_TEMPLATE.md", SPEC_TEMPLATE)
    now = utc_now()
    create(STATE_FILE, StateData(updated_at=format_timestamp(now), owner_pid=os.getpid(),
                                 state_entered_at=format_timestamp(now)).to_json())
    for name in CONTENT_FILES:
        create(name, "")
    create(LOCK_FILE, "")
    create("agents.json", pretty_json({"agents": []}))
    create(JOURNAL_FILE, "")
    spec_dir = os.path.join(root, config.spec.directory.strip() or "docs/specs")
    if not os.path.isdir(spec_dir):
        os.makedirs(spec_dir)
        report("Created %s/" % os.path.relpath(spec_dir, root).replace(os.sep, "/"))
    # An explicit --agents-path wins; otherwise the (possibly edited) ferrus.toml decides.
    skills_root = os.path.join(root, agents_path or config.agents.path)
    for rel, text in SKILL_FILES:
        path = os.path.join(skills_root, rel)
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, text)
        report("Created %s" % os.path.relpath(path, root).replace(os.sep, "/"))
    ensure_gitignore_entry(root, FERRUS_DIR + "/", report)
    return config


@dataclasses.dataclass
class Finding:
    """One problem doctor found, with the repair it suggests (and can apply)."""

    problem: str
    repair: str
    fix: "object | None" = None     # callable applying the safe repair, if there is one
    severity: str = "error"          # error | warning | info (worth knowing, not wrong)


def doctor_findings(root):
    """Everything wrong with a project's ferrus files, each with its repair."""
    store = Store(root)
    findings = []
    if not os.path.exists(os.path.join(root, CONFIG_FILE)):
        findings.append(Finding("%s is missing" % CONFIG_FILE, "run `ferrus init`",
                                lambda: init_project(root, report=lambda m: None)))
    else:
        findings.extend(config_findings(root))
        findings.extend(spec_findings(root))
    if not os.path.isdir(store.dir):
        findings.append(Finding("%s/ is missing" % FERRUS_DIR, "run `ferrus init`",
                                lambda: init_project(root, report=lambda m: None)))
        return findings
    for name in (LOCK_FILE, "agents.json", "CONSULT_TEMPLATE.md", "SPEC_TEMPLATE.md") + CONTENT_FILES:
        if not os.path.exists(store.path(name)):
            findings.append(Finding("%s/%s is missing" % (FERRUS_DIR, name),
                                    "recreate it (empty or from the template)",
                                    lambda: init_project(root, report=lambda m: None)))
    data = None
    state_path = store.path(STATE_FILE)
    if not os.path.exists(state_path):
        findings.append(Finding("%s/%s is missing" % (FERRUS_DIR, STATE_FILE),
                                "write a fresh Idle state", lambda: _rebuild_state(store)))
    else:
        try:
            data = store.continue_journal(StateData.from_json(read_text(state_path),
                                                              FERRUS_DIR + "/" + STATE_FILE))
        except StateCorrupt as err:
            findings.append(Finding(
                err.message, "keep the damaged file as STATE.json.corrupt-<time> and write a fresh "
                "Idle state whose rev continues the journal", lambda: _rebuild_state(store)))
    findings.extend(_journal_findings(store, data))
    if data is not None:
        # While STATE.json mirrors a parallel task, the content files are that task's.
        mirrored = data.extra.get(PARALLEL_MIRROR_KEY)
        findings.extend(_content_findings(
            store.for_task(mirrored) if isinstance(mirrored, str) and _TASK_ID_RE.match(
                mirrored) else store, data))
    for path, record in orphaned_check_records(store.dir):
        what = ("check `%s` started %s by ferrus pid %s, which is gone" % (
            record.get("command", "?"), record.get("started_at", "?"), record.get("owner_pid"))
            if record is not None else "unreadable check pid file %s" % os.path.basename(path))
        findings.append(Finding(
            "%s/%s/%s: %s; processes of it may still run" % (
                FERRUS_DIR, CHECK_PROCESS_DIR, os.path.basename(path), what),
            "end the processes carrying its marker (identity verified) and remove the pid file",
            lambda: [log.info("%s", m) for m in end_orphaned_checks(store.dir)],
            severity="warning"))
    findings.extend(_record_findings(store))
    findings.extend(parallel_task_findings(store))
    stray = [name for name in os.listdir(store.dir)
             if name.endswith(TEMP_SUFFIX) or name == "STATE.json.tmp"]
    for folder in ("usage", CHECK_PROCESS_DIR):
        if os.path.isdir(store.path(folder)):
            stray += [folder + "/" + name for name in os.listdir(store.path(folder))
                      if name.endswith(TEMP_SUFFIX)]
    for name in stray:
        path = store.path(name)
        age = time.time() - os.stat(path).st_mtime
        if age > 60:
            findings.append(Finding("stray temporary file %s/%s (%s old)" % (
                FERRUS_DIR, name, format_duration(age)), "delete it",
                lambda path=path: os.unlink(path)))
    return findings


def _record_findings(store):
    """A damaged agents.json or session record breaks nothing (readers skip it), but the
    agents or sessions it held are no longer seen: said here, with a repair."""
    findings = []
    path = store.path("agents.json")
    try:
        registry = json.loads(read_text(path))
        if not isinstance(registry, dict) or not isinstance(registry.get("agents", []), list):
            raise ValueError("not an object with an \"agents\" list")
    except FileNotFoundError:
        pass                                    # reported above as missing
    except (OSError, ValueError) as err:
        findings.append(Finding(
            "%s/agents.json is damaged (%s): agents an earlier orchestrator started are not "
            "tracked" % (FERRUS_DIR, terminal_safe(str(err))[:120]),
            "keep it as agents.json.corrupt-<time> and start an empty list",
            lambda: _set_aside(path, pretty_json({"agents": []})), severity="warning"))
    folder = store.path(SESSIONS_DIR)
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in names:
        record_path = os.path.join(folder, name)
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            record = json.loads(read_text(record_path))
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                raise ValueError("not a session record")
        except (OSError, ValueError) as err:
            findings.append(Finding(
                "%s/%s/%s is damaged (%s): that session is left out of `ferrus sessions` and "
                "usage" % (FERRUS_DIR, SESSIONS_DIR, name, terminal_safe(str(err))[:120]),
                "keep it as %s.corrupt-<time>" % name,
                lambda record_path=record_path: _set_aside(record_path), severity="warning"))
    return findings


# -- doctor: parallel tasks' records, worktrees and branches -----------------------------
#
# A parallel task leaves .ferrus/tasks/<id>/ (task.json, its STATE.json), a worktree under
# the worktree folder and a branch ferrus/<id>.  The runner removes a merged or cancelled
# task's worktree and branch and keeps a failed one's; whatever a crash, a deleted record
# or a hand-made change left beyond that is found here.

def parallel_task_findings(store):
    """Damaged task records and task states, RUNNING tasks whose worktree is gone,
    leftover worktrees and branches, and a parallel run that stopped part way."""
    findings = []
    records = {}
    for task in queued_task_ids(store):
        record, problem = _read_task_json(store, task)
        records[task] = record
        if problem:
            findings.append(Finding(
                "%s/%s/%s/%s is damaged (%s): the queue cannot tell what became of task %s"
                % (FERRUS_DIR, TASKS_DIR, task, TASK_RECORD_FILE, problem, task),
                "keep it as %s.corrupt-<time> and write a new record from what is left (its "
                "TASK.md, state and worktree)" % TASK_RECORD_FILE,
                lambda task=task: _rebuild_task_record(store, task), severity="warning"))
            continue
        task_store = store.for_task(task)
        if os.path.isfile(task_store.task_path(STATE_FILE)):
            try:
                task_store.read_state()
            except StateCorrupt as err:
                findings.append(Finding(
                    "task %s: %s" % (task, err.message),
                    "keep it as %s.corrupt-<time>%s" % (STATE_FILE, (
                        " and mark the task failed (its worktree is kept for a look)"
                        if record.get("status") in (QUEUED_STATUS, RUNNING_STATUS) else "")),
                    lambda task=task: _rebuild_task_state(store, task), severity="warning"))
    findings.extend(_task_worktree_findings(store, records))
    findings.extend(_parallel_run_findings(store, records))
    return findings


def _read_task_json(store, task):
    """(record, None) or ({}, what is wrong with it), as every reader judges it."""
    return load_task_record(store.dir, task)


def _task_branch_rows(store):
    """(worktree folder, list_task_worktrees rows, problem): the rows are [] without git."""
    try:
        parallel = store.config().parallel
    except FerrusError:
        parallel = ParallelConfig()
    try:
        try:
            folder = default_worktree_dir(store.root, parallel.worktree_dir)
        except GitUnavailable:
            raise
        except FerrusError:            # a refused worktree_dir: _parallel_config_findings says why
            folder = default_worktree_dir(store.root)
        return folder, list_task_worktrees(store.root, TASK_BRANCH_PREFIX), None
    except GitUnavailable:
        return None, [], None
    except FerrusError as err:
        return None, [], err.message


def _task_worktree_findings(store, records):
    folder, rows, problem = _task_branch_rows(store)
    if problem:
        return [Finding("cannot list the task worktrees: %s" % problem,
                        "check the repository with `git worktree list`", severity="warning")]
    findings = []
    try:
        single_task_branch = store.config().git.branch_for
    except FerrusError:
        single_task_branch = GitConfig().branch_for
    for row in rows:
        task = row["branch"][len(TASK_BRANCH_PREFIX):]
        if row["main"] or not _TASK_ID_RE.match(task):
            continue                       # the user's own checkout, or not a task's branch
        record = records.get(task)
        if task in records and not record:
            continue                       # a damaged record: reported above
        path = row["path"]
        if path is not None and not (
                _relative_inside(os.path.realpath(path), folder) not in (None, "")
                or (record and record.get("worktree")
                    and _same_path(path, record["worktree"]))):
            continue                       # checked out by hand somewhere else
        status = record.get("status") if record else None
        if status in (QUEUED_STATUS, RUNNING_STATUS):
            continue                       # in the queue's hands (a gone worktree: below)
        if status == FAILED_STATUS and path is not None and row["exists"]:
            findings.append(Finding(
                "task %s failed; its worktree %s (branch %s) is kept for a look"
                % (task, path, row["branch"]),
                "`ferrus task cancel %s` removes them (`ferrus task retry %s` goes on in "
                "them instead)" % (short_task_id(task), short_task_id(task)), severity="info"))
            continue
        if record is None and path is None and single_task_branch(task) == row["branch"]:
            continue                       # [git] branch made it for a task in the checkout
        findings.append(_orphan_finding(store, task, row, status, folder))
    for task, record in records.items():
        worktree = record.get("worktree")
        if record.get("status") == RUNNING_STATUS and record.get("store") != "project" and \
                worktree and not os.path.isdir(worktree):
            branch = record.get("branch") or TASK_BRANCH_PREFIX + task
            kept = any(row["branch"] == branch for row in rows)
            findings.append(Finding(
                "task %s is running, but its worktree %s is gone: its agents cannot work "
                "and it cannot be merged" % (task, worktree),
                "`ferrus task cancel %s` ends it (and deletes its branch)%s" % (
                    short_task_id(task),
                    "; to keep its commits, first `git branch keep-%s %s`" % (
                        short_task_id(task), branch) if kept else "")))
    return findings


def _orphan_finding(store, task, row, status, folder):
    """A worktree or branch of a task that is merged, cancelled or unknown."""
    why = {None: "no task of the queue is %s" % task, MERGED_STATUS: "task %s is merged" % task,
           CANCELLED_STATUS: "task %s was cancelled" % task}.get(
        status, "task %s is %s" % (task, status))
    what = ("worktree %s (branch %s)" % (row["path"], row["branch"]) if row["path"]
            else "branch %s" % row["branch"])
    if row["path"] and not row["exists"]:
        what += ", whose folder is gone,"
    back = " (it was at %s: `git branch %s %s` brings it back)" % (
        row["head"][:12], row["branch"], row["head"][:12]) if row["head"] else ""
    path = row["path"] or os.path.join(folder or store.root, task)
    if status is None and row["path"] and row["exists"]:
        try:
            changed = worktree_changes(row["path"], task_diff_exclusions(store))
        except FerrusError:
            changed = []
        if changed:
            return Finding(
                "leftover %s: %s, and it has uncommitted changes (%s)" % (
                    what, why, ", ".join(map(display_path, changed[:5]))),
                "look at them there; when they are not wanted, `git worktree remove --force "
                "%s` and `git branch -D %s`" % (row["path"], row["branch"]), severity="warning")
    return Finding("leftover %s: %s" % (what, why),
                   "remove %s%s" % ("the worktree and its branch" if row["path"]
                                    else "the branch", back),
                   lambda: remove_task_worktree(store.root, path, row["branch"]),
                   severity="warning")


def _parallel_run_findings(store, records):
    path = store.path(PARALLEL_RUN_FILE)
    if not os.path.exists(path):
        return []
    run, problem = load_parallel_run(store)
    if problem:
        return [Finding("%s/%s is damaged (%s): the next parallel run starts from P1 instead "
                        "of the phase the last one stopped in" % (
                            FERRUS_DIR, PARALLEL_RUN_FILE, problem),
                        "keep it as %s.corrupt-<time>" % PARALLEL_RUN_FILE,
                        lambda: _set_aside(path), severity="warning")]
    if run.get("ended") or live_parallel_run(store) is not None:
        return []
    target = run.get("target")
    if target:
        try:
            gone = target_head(store.root, target) is None
        except FerrusError:
            gone = False            # no repository, or git could not say
        if gone:
            return [Finding("%s/%s: the parallel run that stopped part way merged into %s, "
                            "which is no branch any more: the next run merges into [parallel] "
                            "target or the branch checked out instead" % (
                                FERRUS_DIR, PARALLEL_RUN_FILE, target),
                            "keep it as %s.corrupt-<time> (the next run then starts from P1)"
                            % PARALLEL_RUN_FILE, lambda: _set_aside(path), severity="warning")]
    where = phase_label(run.get("phase"))
    pending = [task for task, record in records.items()
               if record.get("status") in (QUEUED_STATUS, RUNNING_STATUS)]
    text = "%s/%s: a parallel run (pid %s, last seen %s) stopped in %s without finishing" % (
        FERRUS_DIR, PARALLEL_RUN_FILE, run.get("pid", "?"), run.get("updated_at", "?"), where)
    if pending:
        return [Finding(text, "nothing to repair: the next `ferrus run --parallel` goes on "
                              "from there with the %d task(s) left" % len(pending),
                        severity="info")]
    return [Finding(text + "; no task is left for it", "delete it",
                    lambda: os.unlink(path), severity="info")]


def _rebuild_task_record(store, task):
    """A task.json set aside, and a new one from what is left: the title from TASK.md,
    the worktree and branch git knows, and a status that loses nothing — queued when
    nothing ever ran, else failed (its worktree is kept for a look)."""
    task_store = store.for_task(task)
    branch = TASK_BRANCH_PREFIX + task
    _, rows, _ = _task_branch_rows(store)
    row = next((r for r in rows if r["branch"] == branch and r["path"]), None)
    started = os.path.isfile(task_store.task_path(STATE_FILE)) or any(
        r["branch"] == branch for r in rows)
    with store.lock():
        path = task_record_path(store.dir, task)
        record, problem = _read_task_json(store, task)
        if not problem:
            return                          # repaired meanwhile
        description = task_store.read_file("TASK.md")
        record = {"id": task, "title": task_title(description) or "(unknown: %s was damaged)"
                  % TASK_RECORD_FILE, "status": QUEUED_STATUS if description and not started
                  else FAILED_STATUS, "origin": {"by": "doctor"}}
        salvaged = _salvaged_task_fields(store, task)
        record.update(salvaged)
        if salvaged.get("status") in (MERGED_STATUS, DONE_STATUS, CANCELLED_STATUS):
            pass                        # it had ended: nothing of it runs again
        elif record["status"] == FAILED_STATUS:
            record["reason"] = "its %s was damaged; doctor set it aside" % TASK_RECORD_FILE
            record["ended_at"] = format_timestamp(store.clock())
        if started and record.get("store") != "project":
            record.update(branch=branch, store="worktree")
        if row is not None:
            record["worktree"] = row["path"]
        _set_aside(path, pretty_json(record))


def _salvaged_task_fields(store, task):
    """What a damaged task.json still says that a new record can keep, each field only
    when it is what ferrus writes: when it was queued, its origin (the milestone it
    implements) and the agent it was given — and, when it had ended (merged, done or
    cancelled), that end: so a merged or done task is never run again."""
    try:
        with open(task_record_path(store.dir, task), "rb") as handle:
            damaged = json.loads(handle.read(TASK_RECORD_MAX_BYTES).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(damaged, dict):
        return {}
    keys = ["created_at", "origin", "agent"]
    if damaged.get("status") in (MERGED_STATUS, DONE_STATUS, CANCELLED_STATUS):
        keys += ["status", "ended_at", "merged_commit", "target", "store", "started_at"]
    kept = {}
    for key in keys:
        if key in damaged and not task_record_problem(
                task, {"status": damaged[key] if key == "status" else QUEUED_STATUS,
                       key: damaged[key]}):
            kept[key] = damaged[key]
    return kept


def _rebuild_task_state(store, task):
    """A task's STATE.json set aside; a task still in the queue's hands is failed (the
    runner keeps its worktree), with a fresh state saying why."""
    task_store = store.for_task(task)
    state_path = task_store.task_path(STATE_FILE)
    reason = "its %s was damaged; doctor kept it as %s.corrupt-<time>" % (STATE_FILE,
                                                                         STATE_FILE)
    with store.lock():
        try:
            task_store.read_state()
            return                          # repaired meanwhile
        except StateCorrupt:
            pass
        now = format_timestamp(store.clock())
        fresh = StateData(state=S.FAILED, failure_reason=reason, task_id=task,
                          rev=store.last_journal_seq(), updated_at=now, owner_pid=os.getpid(),
                          state_entered_at=now)
        _set_aside(state_path, fresh.to_json())
    with task_store.transaction("doctor") as tx:
        tx.set(tx.state, "doctor", note=reason)
        record = read_task_record(store.dir, task)
        if record.get("status") in (QUEUED_STATUS, RUNNING_STATUS):
            record.update(status=FAILED_STATUS, reason=reason, ended_at=now)
            write_task_record(store, task, record)


def _set_aside(path, replacement=None):
    """Rename a damaged file to <name>.corrupt-<time> (nothing is deleted), and write
    ``replacement`` in its place when there is one."""
    os.replace(path, "%s.corrupt-%s" % (path, utc_now().strftime("%Y%m%dT%H%M%S")))
    if replacement is not None:
        atomic_write(path, replacement)


def config_findings(root):
    """Every problem in ferrus.toml, each once: errors in any table, a bad [hq], unknown
    keys, and an empty [checks] (then the check gate passes every submission)."""
    problems = []
    try:
        config = parse_config(read_text(os.path.join(root, CONFIG_FILE)), CONFIG_FILE, problems)
    except FerrusError as err:          # not valid TOML: nothing else can be checked
        return [Finding(err.message, err.hint or "fix ferrus.toml")]
    findings = [Finding(err.message, err.hint or "fix ferrus.toml") for err in problems]
    findings.extend(Finding(err.message, err.hint or "fix [hq] in ferrus.toml")
                    for err in config.hq_problems)
    if not config.hq_problems:
        for role in ROLES:
            for text, hint in permission_warnings(config, role):
                findings.append(Finding(text, hint, severity="warning"))
    for key in dict.fromkeys(config.unknown_keys):
        findings.append(Finding("%s: unknown key %s (ignored)" % (CONFIG_FILE, key),
                                "check its spelling against docs/REFERENCE.md, section "
                                "ferrus.toml", severity="warning"))
    if not any(problem.message.startswith("%s: [checks" % CONFIG_FILE) for problem in problems) \
            and not config.checks.commands:
        findings.append(Finding(NO_CHECKS_WARNING, NO_CHECKS_HINT, severity="warning"))
    if not any(problem.message.startswith("%s: [parallel" % CONFIG_FILE)
               for problem in problems):
        findings.extend(_parallel_config_findings(root, config.parallel))
    return findings


def _parallel_config_findings(root, parallel):
    """What `ferrus run --parallel` would refuse in [parallel], found by the same checks:
    a worktree_dir inside the repository (not git-ignored, the repository itself, its
    .git folder) and a target branch that does not exist.  An error when max_tasks makes
    every `ferrus run` parallel, else a warning (only --parallel N would refuse)."""
    severity = "error" if parallel.max_tasks > 1 else "warning"
    findings = []
    try:
        default_worktree_dir(root, parallel.worktree_dir)
    except GitUnavailable:
        return findings             # no repository: nothing to check against
    except FerrusError as err:
        findings.append(Finding("%s (`ferrus run --parallel` refuses it)" % err.message,
                                err.hint or "fix [parallel] worktree_dir in ferrus.toml",
                                severity=severity))
    if parallel.target:
        try:
            head = target_head(root, parallel.target)
        except FerrusError:
            head = ""               # git could not say: not reported as missing
        if head is None:
            findings.append(Finding(
                "%s: [parallel] target = %s names no branch of the repository "
                "(`ferrus run --parallel` refuses it)" % (CONFIG_FILE,
                                                          json.dumps(parallel.target)),
                "create the branch, or set target to an existing one (\"\" = the branch "
                "checked out)", severity=severity))
    return findings


def spec_findings(root):
    """Milestones whose ``Depends on:`` names no milestone of their spec: the picker
    ignores such a dependency (a typo would otherwise block the milestone for ever), so
    the milestone may be taken before the work it was meant to wait for."""
    findings = []
    try:
        paths = list_spec_paths(root, load_config(root))
    except (FerrusError, OSError):      # config_findings reports a bad [spec]
        return findings
    for rel in paths:
        try:
            milestones = parse_spec(read_text(os.path.join(root, rel)))
        except (OSError, UnicodeDecodeError):
            continue
        known = {m.marker for m in milestones} | {m.id for m in milestones}
        for milestone in milestones:
            unknown = [dep for dep in milestone.depends_on if dep not in known]
            if unknown:
                findings.append(Finding(
                    "%s: milestone %s depends on %s, which no milestone of this spec is "
                    "(ignored: it does not wait for %s)" % (
                        rel, milestone.marker, ", ".join(unknown),
                        "it" if len(unknown) == 1 else "them"),
                    "name existing markers or ids in its `Depends on:` line (e.g. #1.0, "
                    "m1.0), or `none`", severity="warning"))
    return findings


def _journal_findings(store, data):
    findings = []
    path = store.journal_path()
    if not os.path.exists(path):
        return [Finding("%s/%s is missing" % (FERRUS_DIR, JOURNAL_FILE),
                        "create it (history before now is gone)",
                        lambda: atomic_write(path, ""))]
    # One pass in constant memory: a rotated journal is bounded, a hand-made one may not be.
    bad_count, bad_lines, gaps, previous = 0, [], [], None
    for number, line in enumerate(_lines_forward(path), 1):
        if line is not None and not line.strip():
            continue
        entry = journal_entry(line.decode("utf-8", "replace")) if line is not None else None
        if entry is None:           # torn, hand-edited, or longer than any real line
            bad_count += 1
            if len(bad_lines) < 5:
                bad_lines.append(number)
            continue
        seq = entry["seq"]
        # A journal_gap entry stands for the seqs from detail.from up to its own.
        first = seq
        if entry.get("event") == JOURNAL_GAP_EVENT:
            gap_from = (entry.get("detail") or {}).get("from")
            if isinstance(gap_from, int) and not isinstance(gap_from, bool):
                first = gap_from
        if previous is not None and first != previous + 1 and len(gaps) < 5:
            gaps.append(seq)
        previous = seq
    if bad_count:
        findings.append(Finding(
            "%s/%s has %d unreadable line(s) (line %s) — usually a write cut short by a crash"
            % (FERRUS_DIR, JOURNAL_FILE, bad_count, ", ".join(map(str, bad_lines))),
            "drop those lines", lambda: _rewrite_journal(store)))
    if gaps:
        findings.append(Finding("journal sequence is not gapless (next after a gap: %s)"
                                % ", ".join(map(str, gaps[:5])),
                                "renumbering would break history; nothing to fix automatically",
                                severity="warning"))
    if data is not None:
        last = store.last_journal_seq()      # the archive's, right after a rotation
        if last < data.rev:
            findings.append(Finding(
                "STATE.json is at rev %d but the journal ends at seq %d: %d transition(s) were "
                "committed without a journal line (a crash between the two writes, or an "
                "emptied events.jsonl)" % (data.rev, last, data.rev - last),
                "record them as one journal_gap entry so seq matches rev again",
                lambda: _fill_journal(store)))
        elif last > data.rev:
            findings.append(Finding(
                "the journal (seq %d) is ahead of STATE.json (rev %d) — STATE.json was restored "
                "or hand-edited" % (last, data.rev),
                "raise STATE.json's rev to %d" % last, lambda: _bump_rev(store, last)))
    return findings


def _content_findings(store, data):
    findings = []
    expect = {S.REVIEWING: "SUBMISSION.md", S.AWAITING_CONFIRMATION: "SUBMISSION.md",
              S.AWAITING_HUMAN: "QUESTION.md",
              S.CONSULTATION: "CONSULT_REQUEST.md", S.EXECUTING: "TASK.md",
              S.ADDRESSING: "REVIEW.md"}
    name = expect.get(data.state)
    if name and not store.read_file(name).strip():
        findings.append(Finding("state is %s but %s/%s is empty" % (data.state, FERRUS_DIR, name),
                                "the agents will lack context; `ferrus reset` starts over",
                                severity="warning"))
    if data.state == S.AWAITING_HUMAN and data.paused_state is None:
        findings.append(Finding("state is AwaitingHuman but paused_state is missing, so an answer "
                                "would return to Idle", "`ferrus reset` starts over",
                                severity="warning"))
    return findings


def _rebuild_state(store):
    with store.lock():
        path = store.path(STATE_FILE)
        if os.path.exists(path):
            stamp = utc_now().strftime("%Y%m%dT%H%M%S")
            os.replace(path, path + ".corrupt-" + stamp)
        now = utc_now()
        fresh = StateData(rev=store.last_journal_seq(), updated_at=format_timestamp(now),
                          owner_pid=os.getpid(), state_entered_at=format_timestamp(now))
        atomic_write(path, fresh.to_json())


def _rewrite_journal(store):
    """Keep the readable lines, streamed through a temporary file (never all in memory)."""
    path = store.journal_path()
    with store.lock():
        fd, temp = tempfile.mkstemp(prefix="." + JOURNAL_FILE + ".", suffix=TEMP_SUFFIX,
                                    dir=store.dir)
        try:
            with os.fdopen(fd, "wb") as out:
                for line in _lines_forward(path):
                    if line is not None and journal_entry(
                            line.decode("utf-8", "replace")) is not None:
                        out.write(line.rstrip(b"\r") + b"\n")
                out.flush()
                os.fsync(out.fileno())
            with contextlib.suppress(OSError):
                os.chmod(temp, os.stat(path).st_mode & 0o7777)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        fsync_directory(store.dir)


def _fill_journal(store):
    with store.transaction("doctor") as tx:
        tx.set(tx.state, "doctor", note="journal reconciled with STATE.json")


def _bump_rev(store, last):
    with store.lock():
        data = store.read_state()
        data.rev = last
        atomic_write(store.path(STATE_FILE), data.to_json())


# ============================================================================
# 18. Packaging
# ============================================================================
#
# pyproject.toml names ``ferrus:BuildBackend`` as its PEP 517 / PEP 660 backend
# (``backend-path = ["."]``), so ``pip install .`` needs nothing but the standard
# library: no setuptools download (a Python 3.12+ venv has none, and the one a 3.9
# venv ships predates ``[project]`` tables), which is what an air-gapped machine has.

class BuildBackend:
    """The PEP 517 / 660 hooks: a wheel holding ferrus.py, an sdist, an editable wheel.

    Metadata comes from pyproject.toml's [project] table, the version from
    ``__version__``.  Archive members get one fixed time, so two builds are identical."""

    EPOCH = 315532800                                   # 1980-01-01, the zip format's floor
    SDIST_FILES = ("pyproject.toml", "ferrus.py", "ferrus", "README.md", "LICENSE")

    @staticmethod
    def _source():
        return os.path.dirname(os.path.abspath(__file__))

    @classmethod
    def _read(cls, name):
        with open(os.path.join(cls._source(), name), "r", encoding="utf-8") as handle:
            return handle.read()

    @classmethod
    def project(cls):
        project = dict(parse_toml(cls._read("pyproject.toml"))["project"])
        project["version"] = __version__
        return project

    @staticmethod
    def _dist_name(project):
        return "%s-%s" % (re.sub(r"[-_.]+", "_", project["name"]).lower(), project["version"])

    @classmethod
    def metadata_text(cls, project):
        """Core metadata (METADATA in a wheel, PKG-INFO in an sdist)."""
        lines = ["Metadata-Version: 2.1", "Name: %s" % project["name"],
                 "Version: %s" % project["version"]]
        for key, field in (("description", "Summary"), ("license", "License"),
                           ("requires-python", "Requires-Python")):
            if project.get(key):
                lines.append("%s: %s" % (field, project[key]))
        lines += ["Classifier: %s" % c for c in project.get("classifiers", ())]
        lines += ["Requires-Dist: %s" % d for d in project.get("dependencies", ())]
        for extra, requirements in sorted(project.get("optional-dependencies", {}).items()):
            lines.append("Provides-Extra: %s" % extra)
            lines += ['Requires-Dist: %s; extra == "%s"' % (r, extra) for r in requirements]
        if not project.get("readme"):
            return "\n".join(lines) + "\n"
        lines.append("Description-Content-Type: text/markdown")
        return "\n".join(lines) + "\n\n" + cls._read(project["readme"])

    @staticmethod
    def _record_line(path, data):
        import hashlib          # build-time only: kept off every command's start-up
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return "%s,sha256=%s,%d\n" % (path, digest, len(data))

    @classmethod
    def _write_wheel(cls, directory, files):
        import zipfile
        project = cls.project()
        dist = cls._dist_name(project)
        info = dist + ".dist-info"
        scripts = sorted(project.get("scripts", {}).items())
        files = list(files) + [
            (info + "/METADATA", cls.metadata_text(project).encode("utf-8")),
            (info + "/WHEEL", b"Wheel-Version: 1.0\nGenerator: ferrus\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
            (info + "/entry_points.txt",
             ("[console_scripts]\n" + "".join("%s = %s\n" % s for s in scripts)).encode()),
        ] + [(info + "/licenses/" + name, cls._read(name).encode("utf-8"))
             for name in project.get("license-files", ())]
        record = "".join(cls._record_line(path, data) for path, data in files)
        files.append((info + "/RECORD", (record + info + "/RECORD,,\n").encode("utf-8")))
        name = dist + "-py3-none-any.whl"
        with zipfile.ZipFile(os.path.join(directory, name), "w", zipfile.ZIP_DEFLATED) as wheel:
            for path, data in files:
                entry = zipfile.ZipInfo(path, time.gmtime(cls._epoch())[:6])
                entry.external_attr = 0o644 << 16
                entry.compress_type = zipfile.ZIP_DEFLATED
                wheel.writestr(entry, data)
        return name

    @classmethod
    def _epoch(cls):
        return max(cls.EPOCH, int(os.environ.get("SOURCE_DATE_EPOCH", cls.EPOCH)))

    # -- the hooks pip calls ---------------------------------------------------------

    @staticmethod
    def get_requires_for_build_wheel(config_settings=None):
        return []

    get_requires_for_build_sdist = get_requires_for_build_editable = get_requires_for_build_wheel

    @classmethod
    def build_wheel(cls, wheel_directory, config_settings=None, metadata_directory=None):
        return cls._write_wheel(wheel_directory,
                                [("ferrus.py", cls._read("ferrus.py").encode("utf-8"))])

    @classmethod
    def build_editable(cls, wheel_directory, config_settings=None, metadata_directory=None):
        # A .pth line puts the source folder on sys.path, so edits take effect at once.
        return cls._write_wheel(wheel_directory, [("ferrus_editable.pth",
                                                   (cls._source() + "\n").encode("utf-8"))])

    @classmethod
    def _sdist_paths(cls):
        """The fixed files, then docs/*.md when the folder is there (README links to them;
        a copy of the five files alone still builds)."""
        docs = os.path.join(cls._source(), "docs")
        found = sorted(name for name in os.listdir(docs) if name.endswith(".md")) \
            if os.path.isdir(docs) else []
        return list(cls.SDIST_FILES) + ["docs/" + name for name in found]

    @classmethod
    def build_sdist(cls, sdist_directory, config_settings=None):
        import io
        import tarfile
        project = cls.project()
        base = cls._dist_name(project)
        members = [(path, cls._read(path).encode("utf-8")) for path in cls._sdist_paths()]
        members.append(("PKG-INFO", cls.metadata_text(project).encode("utf-8")))
        name = base + ".tar.gz"
        with tarfile.open(os.path.join(sdist_directory, name), "w:gz",
                          format=tarfile.PAX_FORMAT) as archive:
            for path, data in members:
                member = tarfile.TarInfo("%s/%s" % (base, path))
                member.size, member.mtime = len(data), cls._epoch()
                member.mode = 0o755 if path == "ferrus" else 0o644
                archive.addfile(member, io.BytesIO(data))
        return name


# ============================================================================
# 19. HQ front ends
# ============================================================================
#
# What a human looks at.  Both front ends drive the UI-independent HqController
# (section 15): HqShell reads plain lines from any stream, CursesHq draws the
# same transcript in a terminal with a status bar and line editing.  A new front
# end (a web page, a task board) plugs in here, beside them, and calls nothing
# the controller and the operations do not already offer.

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
    if isinstance(detail.get("checks"), list):
        # Each command's result in brief; its log path is in `ferrus log --json`.
        detail["checks"] = ",".join("%s:%s" % (c.get("command"), c.get("status"))
                                    for c in detail["checks"] if isinstance(c, dict))
    extra = " ".join("%s=%s" % (k, v if isinstance(v, (str, int, float)) else compact_json(v))
                     for k, v in detail.items() if v is not None)
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
        counts = collections.Counter(DAMAGED_WORD if row.get("problem") else row.get("status")
                                     for row in (self.rows() if rows is None else rows))
        return ", ".join("%d %s" % (counts[status], status) for status in (
            RUNNING_STATUS, QUEUED_STATUS, MERGED_STATUS, DONE_STATUS, FAILED_STATUS,
            CANCELLED_STATUS, DAMAGED_WORD) if counts[status])

    def line(self, row, width=None, attached=None):
        """One task's row: short id, state, agent, elapsed, last event (cut to ``width``)."""
        elapsed = row.get("elapsed")
        text = "%s%-6s %-13s %-10s %7s  %s" % (
            "▸" if row["id"] == attached else " ", short_task_id(row["id"]),
            task_state_word(row), (row.get("agent") or "-")[:10],
            format_duration(elapsed) if elapsed is not None else "?",
            row.get("title", "") if row.get("status") == QUEUED_STATUS else
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
    ("/run", "[N]", "work the task queue N tasks at a time, each in its own git worktree, "
                    "merged through the check gate (default [parallel] max_tasks), until "
                    "/stop"),
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


class HqShell:
    """HQ's commands on top of the controller, with a plain-line front end.

    This class is the plain front end (it works without curses, on Windows and
    with piped stdin).  Another front end subclasses it and overrides only the
    terminal parts: ``show``/``write`` (output), ``run`` (the input loop that
    calls ``handle`` per line and ``poll`` between keys), ``confirm``,
    ``interactive`` (handing the terminal to an agent) and ``attach_agent``.

    Parallel tasks (`/run`) are worked by a ParallelRunner, the one `ferrus run
    --parallel` uses, polled beside the project's own controller; `/attach ID` makes one
    task the focus of the output and of /status, /log and /diff."""

    def __init__(self, store, stdin=None, stdout=None, resume=None, clock=time.monotonic):
        self.store = store
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        self.resume = resume
        self.lines = collections.deque()
        self.held = None            # messages queued while an interactive agent has the terminal
        self.done = False
        self.clock = clock
        self.controller = HqController(store, self.show, clock=clock, bell=self.ring_bell)
        self.runner = None          # the ParallelRunner of /run while it works the queue
        self.run_width = None       # how many at a time /run asked for, until /stop
        self.next_queue_look = 0.0
        self.attached = None        # the task /attach ID follows
        self.hidden = 0             # other tasks' lines left out while attached
        self.board = TaskBoard(store)

    QUEUE_LOOK_SECS = 1.0       # after /run, how often an empty queue is looked at again

    def poll(self):
        """One step of everything HQ drives: the project's task, then the parallel run —
        which, after /run and until /stop, starts again when tasks are queued."""
        self.controller.poll()
        runner = self.runner
        if runner is None:
            if self.run_width and self.clock() >= self.next_queue_look:
                self.next_queue_look = self.clock() + self.QUEUE_LOOK_SECS
                if any(row.get("status") == QUEUED_STATUS for row in self.board.rows()):
                    try:
                        self.start_run(self.run_width)
                    except FerrusError as err:
                        self.show(HqMessage("error", "the parallel run cannot start: %s "
                                            "(/run tries again)" % err.full_text(), "run"))
            return
        try:
            runner.step()
        except FerrusError as err:
            self.runner = self.run_width = None
            runner.shutdown()
            self.show(HqMessage("error", "the parallel run stopped: %s (/run starts it again)"
                                % err.full_text(), "run"))
            return
        if runner.finished:
            self.runner = None
            runner.shutdown()
            self.show(HqMessage("info", "The queue is done; what is queued next is worked "
                                        "%d at a time too (/stop ends the run)."
                                % self.run_width, "run"))

    def shutdown(self):
        """HQ leaves: every agent it started stops (the tasks stay as they are)."""
        try:
            if self.runner is not None:
                self.runner.shutdown()
        finally:
            self.controller.shutdown()

    def _runner_emit(self, message):
        """The parallel run's lines: in HQ its own notes say "queue:", not "ferrus run:"."""
        if message.text.startswith("ferrus run: "):
            message.text = "queue: " + message.text[len("ferrus run: "):]
        self.show(message)

    def hides(self, message):
        """While attached to a task, the lines of other tasks are left out (a question or
        a confirmation is still shown: someone must answer it)."""
        task = (message.data or {}).get("task_id") if isinstance(message.data, dict) else None
        return bool(self.attached and task and task != self.attached and
                    message.kind not in ("question", "confirm"))

    def ring_bell(self):
        """[notify] bell: only on a terminal (a pipe would get a stray BEL byte)."""
        if hasattr(self.stdout, "isatty") and self.stdout.isatty():
            self.stdout.write("\a")
            self.stdout.flush()

    def show(self, message):
        if self.held is not None:
            self.held.append(message)
            return
        if self.hides(message):
            self.hidden += 1
            return
        prefix = {"warning": "warning: ", "error": "error: ", "agent": "• "}.get(message.kind, "")
        if message.kind == "question":
            self.write("\n[AWAITING YOUR ANSWER]\n%s\n\nType your answer and press Enter." %
                       message.text)
        elif message.kind == "confirm":
            self.write("\n[AWAITING YOUR CONFIRMATION]\n%s" % message.text)
        else:
            self.write(prefix + message.text)

    def write(self, text):
        say(text, file=self.stdout, flush=True)

    def _reader(self):
        for line in self.stdin:
            self.lines.append(line.rstrip("\n"))
        self.lines.append(None)   # EOF

    def run(self):
        self.write("ferrus HQ %s — /help lists the commands, /quit leaves." % __version__)
        self.write(self.controller.describe_state())
        data = self.controller.task_in_flight()
        if data is not None:
            if self.resume is None:
                self.write("A task is in flight. Resume it? [y/N]")
                self.controller.paused = True
                self.awaiting_resume = True
            else:
                self.controller.paused = not self.resume
                self.write("Resuming it." if self.resume else "Not resuming (use /resume).")
        try:
            self.parallel_tasks_in_flight()
        except FerrusError as err:
            self.write("error: %s" % err.full_text())
        threading.Thread(target=self._reader, daemon=True).start()
        try:
            while not self.done:
                self.poll()
                while self.lines and not self.done:
                    line = self.lines.popleft()
                    if line is None:
                        self.done = True
                        self._say_input_ended()
                        break
                    self.handle(line)
                time.sleep(0.02)
        finally:
            self.shutdown()
        return 0

    def _say_input_ended(self):
        """Plain HQ ends with its input (a pipe, a file); say what that leaves behind, as
        the agents it stops would otherwise vanish without a word."""
        if self.runner is not None and self.runner.controllers:
            self.write("Input ended: HQ leaves and stops the agents of %d parallel task%s; "
                       "they stay in flight: `ferrus run` or /run in `ferrus hq` goes on with "
                       "them." % (len(self.runner.controllers),
                                  "" if len(self.runner.controllers) == 1 else "s"))
        data = self.controller.task_in_flight()
        if data is None:
            return
        running = [slot.name for slot in self.controller.slots.values()
                   if slot.process is not None]
        self.write("Input ended: HQ leaves%s; the task stays %s. `ferrus run --resume` or "
                   "`ferrus hq` goes on with it." % (
                       " and stops the %s" % ", ".join(running) if running else "",
                       data.state))

    # -- input -------------------------------------------------------------------------

    def handle(self, line):
        text = line.strip()
        if getattr(self, "awaiting_resume", False):
            self.awaiting_resume = False
            if text.lower() in ("y", "yes"):
                self.controller.paused = False
                self.write("Resuming.")
                return
            self.write("Not resuming; /resume continues the task later.")
            if not text or text.lower() in ("n", "no"):
                return
        if not text:
            return
        try:
            require_utf8(text, "that line")     # a /tell or an answer would lose it later
        except FerrusError as err:
            self.write("error: %s\nhint: %s" % (err.message, err.hint))
            return
        if not text.startswith("/"):
            self.answer(text)
            return
        name, _, rest = text.partition(" ")
        handler = getattr(self, "cmd_" + name[1:].replace("-", "_"), None)
        if handler is None or name not in [c[0] for c in HQ_COMMANDS]:
            known = did_you_mean(name, [c[0] for c in HQ_COMMANDS])
            self.write("error: unknown command %s — %s/help lists them" % (
                name, "did you mean %s? " % known if known else ""))
            return
        try:
            handler(rest.strip())
        except FerrusError as err:
            self.write("error: %s" % err.message + ("\nhint: %s" % err.hint if err.hint else ""))

    # -- parallel tasks ----------------------------------------------------------------

    def parallel_tasks_in_flight(self):
        """At start-up: parallel tasks a previous run left in flight are resumed with
        --resume, else HQ says how to resume them."""
        running = [task for task, record in task_records(self.store)
                   if record.get("status") == RUNNING_STATUS and record.get("worktree")]
        if not running:
            return
        what = "%d parallel task%s in flight (%s)" % (
            len(running), " is" if len(running) == 1 else "s are",
            ", ".join(short_task_id(task) for task in running))
        if self.resume:
            self.write(what + "; resuming.")
            self.cmd_run("")
        else:
            self.write(what + "; /run resumes them, /tasks shows the board.")

    def running_task_ids(self):
        """The parallel tasks with a store of their own that have not ended."""
        return [task for task, record in task_records(self.store)
                if record.get("status") == RUNNING_STATUS and
                self.store.for_task(task).exists()]

    def task_controller(self, task):
        """The controller driving ``task`` in this HQ's run, if one does."""
        return self.runner.controllers.get(task) if self.runner is not None else None

    def human_target(self, states):
        """The store a human's answer or verdict is for: the attached task's, else the only
        parallel task in one of ``states``, else the project's."""
        if self.attached and self.store.for_task(self.attached).exists():
            with contextlib.suppress(FerrusError):
                if self.store.for_task(self.attached).read_state().state in states:
                    return self.store.for_task(self.attached)
        waiting = []
        for task in self.running_task_ids():
            with contextlib.suppress(FerrusError):
                if self.store.for_task(task).read_state().state in states:
                    waiting.append(task)
        if len(waiting) > 1:
            raise FerrusError("tasks %s all wait for you" % ", ".join(
                short_task_id(task) for task in waiting), "/attach ID picks the task, then "
                                                          "answer (or /approve, /reject NOTES)")
        return self.store.for_task(waiting[0]) if waiting else self.store

    def task_word(self, word):
        """The task ``word`` names (its id or the end of it, as lines show it), or None
        when it names none."""
        if not word or len(word) < 4 or word.startswith("-"):
            return None
        with contextlib.suppress(FerrusError):
            return require_task_id(self.store, word)
        return None

    def answer(self, text):
        try:
            store = self.human_target((S.AWAITING_HUMAN, S.AWAITING_CONFIRMATION))
        except FerrusError as err:
            self.write("error: %s\nhint: %s" % (err.message, err.hint))
            return
        data = store.read_state()
        if data.state == S.AWAITING_CONFIRMATION:
            self.write("error: the reviewer's approval waits for you: /approve, or /reject "
                       "NOTES (a plain line answers only an agent's question)")
            return
        if data.state != S.AWAITING_HUMAN:
            self.write("error: commands start with '/' (try /help); nobody is waiting for an "
                       "answer (state %s)" % data.state)
            return
        op_answer(store, HUMAN, text)
        self.write("Answer recorded; the agent continues.")

    def confirm(self, question):
        self.write(question + " [y/N]")
        while not self.lines:
            self.poll()
            time.sleep(0.02)
        reply = self.lines.popleft()
        if reply is None:
            self.done = True
            return False
        return reply.strip().lower() in ("y", "yes")

    # -- commands ----------------------------------------------------------------------

    HELP_WIDTH = 80        # /help fits an 80-column terminal
    HELP_COLUMN = 24       # where the descriptions start

    def cmd_help(self, rest):
        import textwrap
        width, column = self.HELP_WIDTH, self.HELP_COLUMN
        for name, args, what in HQ_COMMANDS:
            usage = ("%s %s" % (name, args)).strip()
            body = textwrap.wrap(what, width - column)
            if len(usage) <= column - 4:        # two spaces before the description
                lines = ["  " + usage.ljust(column - 2) + body[0]]
                body = body[1:]
            else:              # a long usage gets its own lines, the description below it
                lines = textwrap.wrap(usage, width - 2, initial_indent="  ",
                                      subsequent_indent="    ")
            lines += [" " * column + line for line in body]
            self.write("\n".join(lines))
        self.write("  Anything not starting with / answers the pending question.")

    def busy_agents(self):
        """The slots whose agents would lose work if HQ quit now, as "executor, reviewer";
        agents that only finish after the task ended have no work left to lose."""
        busy = [slot.name for slot in self.controller.running()] \
            if self.controller.finishing_since is None else []
        if self.runner is not None:
            busy += ["%s of %s" % (slot.name, short_task_id(task))
                     for task, controller in self.runner.controllers.items()
                     if controller.finishing_since is None for slot in controller.running()]
        return ", ".join(busy)

    def quit_unless_declined(self):
        busy = self.busy_agents()
        if not busy or self.confirm("Agents are running (%s); stop them and quit?" % busy):
            self.done = True

    def cmd_quit(self, rest):
        self.quit_unless_declined()

    def cmd_status(self, rest):
        task = self.task_word(rest) or (None if rest else self.attached)
        if rest and task is None:
            raise UsageError("usage: /status [ID] — no task %s in the queue (/tasks lists them)"
                             % rest)
        if task is not None:
            self.task_status(task)
            return
        self.write(self.controller.describe_state())
        capacity = capacity_status(self.store, self.store.read_state())
        if capacity:
            self.write("capacity %s (%s)%s" % (capacity["tier"], capacity["action"],
                                               " — checkpoint" if capacity["checkpoint"] else ""))
        data = self.store.read_state()
        if data.selected_spec:
            self.write("spec %s, milestone %s" % (data.selected_spec,
                                                  data.selected_milestone or "(none left)"))
        for slot in self.controller.slots.values():
            self.write("  " + slot.describe(self.controller.tool_calls_of(slot)))
        records = [r for r in read_session_records(self.store)
                   if data.task_id and r.get("task_id") == data.task_id]
        if records:
            self.write("task %s: %s" % (data.task_id, format_usage(usage_summary(records))))
            for record in records[-STATUS_SESSIONS_SHOWN:]:
                self.write("  " + terminal_safe(describe_session(record)))
        if data.state == S.AWAITING_CONFIRMATION:
            # The mirrored parallel task's own files, when STATE.json mirrors one.
            self.write(confirmation_summary(foreground_store(self.store), data))
        rows = self.board.rows(force=True)
        if rows:
            self.write("tasks: %s — /tasks shows the board%s" % (
                self.board.summary(rows), "" if self.runner is not None or self.run_width else
                ", /run works the queue" if any(row.get("status") in (
                    QUEUED_STATUS, RUNNING_STATUS) for row in rows) else ""))

    def task_status(self, task):
        """/status of one task of the queue: where it stands, its agents and sessions."""
        record = read_task_record(self.store.dir, task)
        task_store = self.store.for_task(task)
        rows = [row for row in task_rows(self.store) if row["id"] == task]
        row = rows[0] if rows else {"id": task, "status": record.get("status")}
        elapsed = task_elapsed(row, self.store.clock())
        self.write("Task %s: %s — %s%s" % (
            short_task_id(task), record.get("title", ""), task_state_word(row),
            ", for %s" % format_duration(elapsed) if elapsed is not None else ""))
        if task_store.exists():
            data = task_store.read_state()
            self.write("check retries %d, review cycles %d" % (data.check_retries,
                                                              data.review_cycles))
            if data.failure_reason:
                self.write("failure: %s" % failure_summary(data.failure_reason))
        if record.get("worktree"):
            self.write("worktree %s, branch %s" % (record["worktree"], record.get("branch")))
        if record.get("merged_commit"):
            self.write("merged into %s at %s" % (record.get("target") or "the target",
                                                 record["merged_commit"][:12]))
        if record.get("reason") and not task_store.exists():
            self.write("reason: %s" % failure_summary(record["reason"]))
        controller = self.task_controller(task)
        if controller is not None:
            for slot in controller.slots.values():
                self.write("  " + slot.describe(controller.tool_calls_of(slot)))
        elif record.get("status") == RUNNING_STATUS:
            self.write("  no agent of it runs here (/run resumes it)")
        sessions = [r for r in read_session_records(self.store) if r.get("task_id") == task]
        if sessions:
            self.write("usage: %s" % format_usage(usage_summary(sessions)))
            for session in sessions[-STATUS_SESSIONS_SHOWN:]:
                self.write("  " + terminal_safe(describe_session(session)))
        if task_store.exists() and task_store.read_state().state == S.AWAITING_CONFIRMATION:
            self.write(confirmation_summary(task_store, task_store.read_state()))

    def cmd_log(self, rest):
        words = rest.split()
        everything = "--all" in words
        named = [w for w in words if w != "--all" and self.task_word(w)]
        numbers = [w for w in words if w != "--all" and w not in named]
        if len(named) > 1 or len(numbers) > 1 or (numbers and not numbers[0].isdigit()):
            raise UsageError("usage: /log [ID] [N] [--all] — ID is a task of the queue "
                             "(/tasks lists them)")
        count = int(numbers[0]) if numbers else 20
        task = self.task_word(named[0]) if named else self.attached
        entries = journal_story(self.store, count, everything, task=task)
        for entry in entries:
            self.write(format_event(entry))
        if not entries:
            self.write("(nothing yet%s)" % ("" if everything else "; /log --all also shows the "
                                                                "bookkeeping entries"))

    def diff_store(self, task):
        """The store whose diff /diff shows for ``task``, or a FerrusError saying why a
        task of the queue has none to show."""
        if task is None:
            task = foreground_task(self.store)      # the parallel task the state mirrors
        return self.store if task is None else diff_store_of(self.store, task)

    def cmd_diff(self, rest):
        words = rest.split()
        stat_only = "--stat" in words
        named = [w for w in words if w != "--stat" and self.task_word(w)][:1]
        paths = [w for w in words if w != "--stat" and w not in named] or None
        store = self.diff_store(self.task_word(named[0]) if named else self.attached)
        outcome = op_diff(store, HUMAN, stat_only=stat_only, paths=paths)
        if not outcome.data.get("available"):
            self.write(outcome.text + ("\nhint: %s" % outcome.data["hint"]
                                       if outcome.data.get("hint") else ""))
            return
        self.page("diff", outcome.text)

    def page(self, title, text):
        """Long output (a diff): all of it here, coloured where the terminal allows."""
        if _color_enabled(self.stdout):
            print(paint_diff(text, True), file=self.stdout, flush=True)
        else:
            self.write(text)

    def cmd_agents(self, rest):
        for row in agents_report(self.store.root):
            self.write("%s: %s%s%s" % (row["role"], row["agent"], " — " + row["problem"]
                                       if "problem" in row else " — ok",
                                       ", permissions %s" % row["permissions"]
                                       if "permissions" in row else ""))
            for warning in row.get("warnings", ()):
                self.write("  warning: %s (%s)" % (warning["warning"], warning["hint"]))

    def cmd_attach(self, rest):
        if rest in SLOT_ROLES:
            self.attach_agent(rest)
            return
        if not rest:
            if self.attached is None:
                raise UsageError("usage: /attach ID (follow a task) or /attach ROLE (an "
                                 "agent's live log); /tasks lists the tasks")
            self.write("Detached from task %s%s; every task's lines are shown again." % (
                short_task_id(self.attached), " (%d of other tasks' lines were left out; "
                "/log shows what happened)" % self.hidden if self.hidden else ""))
            self.attached, self.hidden = None, 0
            return
        task = self.task_word(rest)
        if task is None:
            raise UsageError("no task or agent role %r (tasks: /tasks lists them; roles: %s)"
                             % (rest, ", ".join(SLOT_ROLES)))
        record = read_task_record(self.store.dir, task)
        self.attached, self.hidden = task, 0
        self.write("Following task %s (%s): only its lines are shown; /status, /log and /diff "
                   "show it; /attach alone shows every task again." % (
                       short_task_id(task), record.get("title", "")))
        for entry in journal_story(self.store, 5, task=task):
            self.write(format_event(entry))

    def focus_controller(self):
        """The controller of the attached task when this HQ runs it, else the project's."""
        return (self.task_controller(self.attached) if self.attached else None) or \
            self.controller

    def attach_agent(self, rest):
        controller = self.focus_controller()
        slot = controller.slots.get(rest)
        if slot is None or slot.process is None:
            raise UsageError("no running agent called %r (running: %s)" % (rest, ", ".join(
                s.name for s in controller.running()) or "none"))
        self.write("--- %s (Enter returns) ---" % self.store.relpath(slot.process.log_path))
        with open(slot.process.log_path, "r", encoding="utf-8", errors="replace") as handle:
            self.write(handle.read()[-4000:].rstrip())
            while not self.lines and slot.process is not None:
                chunk = handle.read()
                if chunk:
                    self.write(chunk.rstrip())
                self.poll()
                time.sleep(0.1)
        if self.lines and self.lines[0] is not None:
            self.lines.popleft()
        self.write("--- detached ---")

    def cmd_tell(self, rest):
        role, _, message = rest.partition(" ")
        if not message.strip():
            raise UsageError("usage: /tell ROLE MESSAGE (roles: executor, reviewer, consultant)")
        self.driving()[1].tell(role, message.strip())

    def cmd_check(self, rest):
        if rest == "--force":
            run, config = op_run_checks_only(self.store)
            self.write("no check commands configured" if run is None else
                       "checks passed" if run.passed else run.report(
                           config.limits.max_feedback_lines))
        else:
            try:
                self.write(op_check(self.store, Caller("human", "human:hq:0")).text)
            except FerrusError as err:
                if self.store.read_state().state in WORK_STATES:
                    raise
                # As `ferrus check`: outside a task the human is pointed at --force.
                raise FerrusError(err.message, "/check --force runs the checks in any state "
                                  "and changes nothing") from err

    def driving(self):
        """(store, controller) of the task whose agents /resume, /review and /tell mean:
        the attached task's, run by this HQ, else the checkout's own."""
        if self.attached:
            controller = self.task_controller(self.attached)
            if controller is None:
                raise FerrusError("no agent of task %s runs here" % short_task_id(self.attached),
                                  "/run works the queue, and resumes it")
            return controller.store, controller
        data = self.store.read_state()
        if self.controller.mirrors_parallel_task(data) and data.state in ACTIVE_STATES:
            raise FerrusError("the checkout's state shows parallel task %s, whose agents are "
                              "its own" % short_task_id(data.extra[PARALLEL_MIRROR_KEY]),
                              "/attach ID first (/tasks lists the tasks)")
        return self.store, self.controller

    def cmd_resume(self, rest):
        store, controller = self.driving()
        data = store.read_state()
        if data.state not in ACTIVE_STATES:
            raise FerrusError("nothing to resume: the state is %s" % data.state,
                              "start a task with /task")
        controller.restart_slots()
        self.write("Resuming the task (%s)." % data.state)

    def cmd_approve(self, rest):
        if rest:
            raise UsageError("usage: /approve (it takes no arguments; /reject NOTES sends the "
                             "task back)")
        self.write(op_human_approve(self.human_target((S.AWAITING_CONFIRMATION,)), HUMAN,
                                    via="hq").text)

    def cmd_reject(self, rest):
        if not rest:
            raise UsageError("usage: /reject NOTES — say what must change; the executor gets "
                             "them as review notes")
        self.write(op_human_reject(self.human_target((S.AWAITING_CONFIRMATION,)), HUMAN, rest,
                                   via="hq").text)

    def cmd_review(self, rest):
        store, controller = self.driving()
        state = store.read_state().state
        if state == S.AWAITING_CONFIRMATION:
            raise FerrusError("the reviewer already approved; the task waits for you",
                              "/approve, or /reject NOTES")
        if state != S.REVIEWING:
            raise FerrusError("there is no submission to review")
        controller.restart_slots()

    def cmd_stop(self, rest):
        if self.runner is not None or self.run_width:
            # The parallel run ends; its tasks stay in flight for the next /run.
            if self.runner is not None and self.runner.controllers and not self.confirm(
                    "Stop the parallel run and its agents (%d task%s in flight)?" % (
                        len(self.runner.controllers),
                        "" if len(self.runner.controllers) == 1 else "s")):
                return
            runner, self.runner, self.run_width = self.runner, None, None
            if runner is not None:
                runner.shutdown()
            self.write("The parallel run is stopped; /run resumes its tasks.")
        if self.controller.running() and self.confirm("Stop every agent session?"):
            self.controller.stop_all()
            self.controller.paused = True
            self.write("Stopped. /resume starts them again.")

    def cmd_pipeline(self, rest):
        hq_cmd_pipeline(self, rest)

    def cmd_continue(self, rest):
        runner = self.runner if self.runner is not None and self.runner.checkpoint else None
        if not self.controller.checkpoint and runner is None:
            raise FerrusError("there is no capacity checkpoint to continue from")
        if self.controller.checkpoint:
            self.controller.continue_after_checkpoint()
            self.controller.paused = False
        if runner is not None:
            runner.continue_after_checkpoint()
        self.write("Continuing; the capacity budget counts again from now.")

    def cmd_reset(self, rest):
        data = self.store.read_state()
        if data.state == S.IDLE:
            self.write("Nothing to reset: the state is already Idle.")
            return
        if data.state in ACTIVE_STATES and not self.confirm(
                "The task is %s. Reset it to Idle and clear its files?" % data.state):
            return
        self.controller.stop_all()
        self.write(op_force_reset(self.store, HUMAN).text)

    def cmd_tasks(self, rest):
        rows = self.board.rows(force=True)
        if not rows:
            ended = len(task_records(self.store))
            self.write("No task is queued or running%s: /task add TEXT queues one." % (
                " (%d ended before HQ started: `ferrus tasks` lists them)" % ended
                if ended else ""))
            return
        self.write(TaskBoard.HEADER)
        for row in rows:
            self.write(self.board.line(row, attached=self.attached))
        self.write("%s%s" % (self.board.summary(rows), "; the run works %d at a time" %
                             self.runner.max_tasks if self.runner is not None else
                             "; the run takes queued tasks %d at a time" % self.run_width
                             if self.run_width else
                             "; /run works the queue" if any(row.get("status") in (
                                 QUEUED_STATUS, RUNNING_STATUS) for row in rows) else ""))

    def task_add(self, rest):
        """/task add TEXT | --milestone SPEC ID | --ready SPEC: queue work for /run."""
        words = rest.split()
        usage = UsageError("usage: /task add TEXT | --milestone SPEC ID | --ready SPEC")
        if not words:
            raise usage
        if words[0] == "--milestone":
            if len(words) != 3:
                raise usage
            outcome = op_enqueue_milestone(self.store, HUMAN, words[1], words[2])
        elif words[0] == "--ready":
            if len(words) != 2:
                raise usage
            outcome = op_enqueue_ready(self.store, HUMAN, words[1])
        elif words[0].startswith("--"):
            raise usage
        else:
            outcome = op_enqueue_task(self.store, HUMAN, rest)
        self.write(outcome.text)
        if self.runner is not None or self.run_width:
            self.write("The run takes it up when a slot is free (%d at a time)."
                       % (self.runner.max_tasks if self.runner is not None else
                          self.run_width))
        elif outcome.data.get("task_id") or outcome.data.get("queued"):
            self.write("/run works the queue (%s)." % self.run_width_text())

    def run_width_text(self):
        width = 1
        with contextlib.suppress(FerrusError):
            width = self.store.config().parallel.max_tasks
        return "%d at a time, [parallel] max_tasks" % width if width > 1 else \
            "/run N: N at a time, each task in its own git worktree"

    def cmd_run(self, rest):
        words = rest.split()
        if len(words) > 1 or (words and not (words[0].isdigit() and 1 <= int(words[0]) <= 64)):
            raise UsageError("usage: /run [N] — work the queue N tasks at a time (1 to 64; "
                             "default [parallel] max_tasks)")
        width = int(words[0]) if words else self.store.config().parallel.max_tasks
        if self.runner is not None or self.run_width:
            if self.runner is None:
                self.run_width = width
                self.write("Tasks queued from now on are worked %d at a time." % width)
                return
            if not words or width == self.runner.max_tasks:
                raise FerrusError("the queue is being worked already (%d at a time)"
                                  % self.runner.max_tasks, "/tasks shows the board; /run N "
                                                            "changes how many at a time")
            self.runner.max_tasks = self.run_width = width
            self.write("The run now works %d task%s at a time." % (width, "" if width == 1
                                                                  else "s"))
            return
        if width < 2 and not words:
            raise FerrusError("[parallel] max_tasks is 1: a task at a time, in the checkout",
                              "/run N works the queue N at a time, each task in its own git "
                              "worktree (`ferrus run` works it one by one in the checkout)")
        require_headless_agents(self.store)
        if not any(record.get("status") in (QUEUED_STATUS, RUNNING_STATUS)
                   for _, record in task_records(self.store)):
            self.run_width = width
            self.write("The queue is empty: tasks queued from now on (/task add, the "
                       "supervisor's enqueue_task) are worked %d at a time; /stop ends the "
                       "run." % width)
            return
        self.start_run(width)
        self.write("Working the queue %d at a time, each task in its own worktree: /tasks "
                   "shows the board, /attach ID follows one task; /stop ends the run." % width)

    def start_run(self, width):
        """A ParallelRunner over the queue (P0: it resumes what a previous run left)."""
        runner = ParallelRunner(self.store, self._runner_emit, width, clock=self.clock,
                                bell=self.ring_bell)
        try:
            runner.start()
        except BaseException:
            runner.shutdown()
            self.run_width = None
            raise
        self.runner, self.run_width = runner, width

    def cmd_task(self, rest):
        verb, _, more = rest.partition(" ")
        if verb == "add":
            self.task_add(more.strip())
            return
        if verb == "cancel":
            if not more.strip() or len(more.split()) != 1:
                raise UsageError("usage: /task cancel ID (/tasks lists the tasks)")
            task = require_task_id(self.store, more.strip())
            # The runner of /run removes the worktree of a task it works; any other (a
            # failed task's kept one, or none of /run's) goes here.
            in_runner = self.runner is not None and task in self.runner.controllers
            self.write(op_cancel_task(self.store, HUMAN, task,
                                      remove_worktree=not in_runner).text)
            return
        if verb == "retry":
            if not more.strip() or len(more.split()) != 1:
                raise UsageError("usage: /task retry ID (/tasks lists the tasks)")
            self.write(op_retry_task(self.store, HUMAN, more.strip()).text)
            return
        data = self.store.read_state()
        if self.controller.mirrors_parallel_task(data) and data.state in ACTIVE_STATES:
            raise FerrusError("parallel tasks are in flight, so the checkout takes no task of "
                              "its own now", "/task add TEXT queues it for the run")
        if data.state in ACTIVE_STATES:
            raise FerrusError("a task is in flight (%s)" % data.state, "/resume or /reset first")
        if data.state == S.FAILED and not self.confirm(
                "The last task failed (%s). Reset it and start a new task?"
                % failure_summary(data.failure_reason)):
            self.write("Nothing changed; the failed task is kept (/reset clears it).")
            return
        # Creating a task is a transition HQ drives: it passes the capacity gate the way
        # `ferrus run --task` does, whether HQ or the supervisor creates it.
        if self.controller.checkpoint and not self.controller.recheck_checkpoint():
            raise FerrusError("no new task: the capacity checkpoint holds (%s)"
                              % self.controller.checkpoint.get("signal"),
                              "/continue counts the budget again from now, or raise the limit "
                              "in [capacity]")
        if self.controller.gate("transition:create_task") in (CHECKPOINT, EMERGENCY_STOP):
            raise FerrusError("no new task: the capacity gate stopped it",
                              "/continue counts the budget again from now, or raise the limit "
                              "in [capacity]")
        if data.state in (S.COMPLETE, S.FAILED):
            op_force_reset(self.store, HUMAN)
        if rest and rest != "--manual":
            created = op_create_task(self.store, HUMAN, rest, origin=(None, None))
            for warning in created.data.get("warnings", ()):
                self.write("warning: %s" % warning)
            if created.data.get("branch"):
                self.write("The task works on the new git branch %s." % created.data["branch"])
            self.controller.paused = False
            return
        milestone = spec = None
        if rest != "--manual" and data.selected_milestone:
            with contextlib.suppress(FerrusError):
                spec, milestone = resolve_selected(self.store.root, data)
        # The supervisor's create_task takes this origin, so approving the task ticks the
        # milestone and advances the selection.
        op_stage_task_origin(self.store, HUMAN, spec, milestone.id if milestone else None)
        try:
            self.interactive("supervisor", prompt_task_definition(milestone, spec))
        finally:
            if self.store.read_state().state == S.IDLE:
                op_stage_task_origin(self.store, HUMAN)
        self.controller.paused = False

    def cmd_plan(self, rest):
        self.interactive("supervisor", prompt_plan())

    def cmd_spec(self, rest):
        self.interactive("supervisor", prompt_spec())

    def cmd_supervisor(self, rest):
        self.interactive("supervisor", None)

    def cmd_executor(self, rest):
        self.interactive("executor", None)

    def cmd_milestones(self, rest):
        parts = rest.split()
        if parts:
            self.write(op_select_milestone(self.store, HUMAN, parts[0],
                                           parts[1] if len(parts) > 1 else None).text)
            return
        config = self.store.config()
        paths = list_spec_paths(self.store.root, config)
        if not paths:
            self.write("no specs in %s/ yet: /spec drafts one with the supervisor"
                       % config.spec.directory.strip().rstrip("/"))
        for path in paths:
            self.write(path)
            for milestone in parse_spec(read_text(os.path.join(self.store.root, path))):
                self.write("   [%s] %s (%s)" % ("x" if milestone.completed else " ",
                                                milestone.display(), milestone.id))

    def cmd_reset_spec(self, rest):
        self.write(op_clear_selection(self.store, HUMAN).text)

    def cmd_model(self, rest):
        parts = rest.split(None, 1)
        if len(parts) != 2 or parts[0] not in ROLES:
            raise UsageError("usage: /model supervisor|executor MODEL (or --clear)")
        config = self.store.config().require_hq()
        choice = getattr(config, parts[0])
        if choice is None:
            raise FerrusError("no [hq.%s] agent yet" % parts[0], "/register first")
        model = "" if parts[1] == "--clear" else parts[1]
        update_hq_config(self.store.root, parts[0], choice.agent, model, self.write)

    def cmd_register(self, rest):
        usage = UsageError("usage: /register [--supervisor A] [--executor A] "
                           "[--supervisor-model M] [--executor-model M] [--trust]")

        class Parser(argparse.ArgumentParser):
            def error(self, message):       # never print over the screen, never exit
                raise usage
        args = add_registration_options(Parser(add_help=False)).parse_args(rest.split())
        choices, _ = registration_choices(args, self.store.root)
        # Through write(), so the output lands in HQ's transcript, not over the screen.
        register_agents(self.store.root, choices, trust=args.trust, report=self.write)

    def cmd_init(self, rest):
        args = rest.split()
        init_project(self.store.root, args[1] if len(args) == 2 else None, self.write)

    def interactive(self, role, prompt):
        """Hand the terminal to an agent; reactions keep running meanwhile."""
        config = self.store.config().require_hq()
        choice = getattr(config, role)
        if choice is None:
            raise FerrusError("no [hq.%s] agent in ferrus.toml" % role,
                              "/register --%s <agent>" % role)
        adapter = adapter_for(config, choice.agent)
        launch = adapter.interactive(self.store.root, role, prompt, choice.model)
        env = dict(os.environ)
        env.update(launch.env)
        env[SESSION_ENV] = new_id("s")       # its leases name this session, as headless ones do
        self.held = []
        try:
            proc = subprocess.Popen(launch.argv, cwd=self.store.root, env=env)
        except OSError as err:
            self.held = None
            raise FerrusError("could not start %s: %s" % (launch.argv[0], err),
                              adapter.install_hint()) from err
        # The terminal is the agent's, so ferrus reads none of its output: the record
        # has the when and the exit, and says that its usage is unknown.
        record = open_session_record(
            self.store, env[SESSION_ENV], slot="interactive %s" % role, role=role,
            agent=choice.agent, model=choice.model or "", pid=proc.pid, argv=list(launch.argv),
            prompt=prompt, task_id=self.store.read_state().task_id, usage_reported=False)
        # Ctrl+C belongs to the agent now: HQ ignores it with a Python handler (not
        # SIG_IGN, which the agent would inherit) instead of dying and orphaning agents.
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
        try:
            while proc.poll() is None:
                self.poll()
                time.sleep(0.05)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            close_session_record(self.store, record, "ended" if proc.poll() is not None
                                 else "left running", proc.returncode,
                                 note="interactive: its output went to the terminal, so its "
                                      "tool calls, tokens and cost are not known")
            held, self.held = self.held, None
            for message in held:
                self.show(message)


HISTORY_FILE = "~/.ferrus_history"
HISTORY_KEEP = 1000
_CURSES_COLORS = {"transition": "CYAN", "warning": "YELLOW", "error": "RED",
                  "question": "MAGENTA", "agent": "GREEN",
                  "diff+": "GREEN", "diff-": "RED", "diff@": "CYAN",
                  "Executing": "CYAN", "Addressing": "YELLOW", "Consultation": "MAGENTA",
                  "AwaitingHuman": "YELLOW", "AwaitingConfirmation": "YELLOW",
                  "Reviewing": "BLUE", "Complete": "GREEN",
                  "Failed": "RED", "Integrating": "BLUE", "merged": "GREEN", "failed": "RED"}
_CURSES_KEYS_HELP = ("Enter send · Alt+Enter/Ctrl+J newline · Tab complete · ↑↓ history · "
                     "PgUp/PgDn scroll · Ctrl+C twice quits")


def _line_edits(curses):
    """Keys that only edit the input: key -> (buffer, cursor) -> (buffer, cursor)."""
    back = lambda b, c: (b[:max(0, c - 1)] + b[c:], c - 1)           # noqa: E731
    delete = lambda b, c: (b[:c] + b[c + 1:], c)                        # noqa: E731
    home, end = (lambda b, c: (b, 0)), (lambda b, c: (b, len(b)))
    return {curses.KEY_BACKSPACE: back, "\x7f": back, "\x08": back,
            curses.KEY_DC: delete, "\x04": delete, curses.KEY_HOME: home, "\x01": home,
            curses.KEY_END: end, "\x05": end,
            curses.KEY_LEFT: lambda b, c: (b, c - 1), curses.KEY_RIGHT: lambda b, c: (b, c + 1),
            "\x15": lambda b, c: (b[c:], 0),                      # Ctrl+U: cut before
            "\x0b": lambda b, c: (b[:c], c),                      # Ctrl+K: cut after
            "\n": lambda b, c: (b[:c] + "\n" + b[c:], c + 1)}     # Ctrl+J: a newline


def fit_banner(text, width):
    """``text`` in ``width`` columns for the one-row dialog banner: too long, its middle
    gives way to "…", as its end holds the question and the keys that answer it."""
    if len(text) <= width:
        return text
    if width < 2:
        return text[-width:] if width > 0 else ""
    head = width // 3
    return text[:head] + "…" + text[len(text) - (width - head - 1):]


class CursesHq(HqShell):
    """HQ in curses.  Only HqShell's terminal parts are replaced; ``handle`` and the
    ``cmd_*`` methods are shared, so both front ends behave the same."""

    def __init__(self, store, resume=None, clock=time.monotonic, history_path=None):
        super().__init__(store, resume=resume, clock=clock)
        self.scr = self.curses = None
        self.transcript = collections.deque(maxlen=10000)   # (kind, one line)
        self.scroll = 0              # screen rows scrolled back from the newest
        self.buffer, self.cursor = "", 0
        self.history_path = os.path.expanduser(history_path or HISTORY_FILE)
        self.history = self._load_history()
        self.history_pos, self.draft = len(self.history), ""
        self.completion = None       # (candidates, index, text before the word, text after)
        self.banner = None           # a y/n question, dialog title or attach notice
        self.view = self.selected = None     # lines shown instead of the transcript
        self.notice, self.notice_until, self.last_ctrl_c = None, 0.0, 0.0
        self.status, self.status_due = ("", "", ""), 0.0
        self.attrs = collections.defaultdict(int)
        self.bell_due = False        # rung at the next draw, from the thread that draws

    def ring_bell(self):
        self.bell_due = True

    # -- output --------------------------------------------------------------------------

    def show(self, message):
        if self.held is not None:            # an interactive agent has the terminal
            self.held.append(message)
            return
        stamp = time.strftime("%H:%M:%S ")
        # Every line is kept with its task: /attach ID shows one task's, and detaching
        # brings the others back.
        task = message.data.get("task_id") if isinstance(message.data, dict) else None
        if message.kind == "question":
            self.add("question", "%s[AWAITING YOUR ANSWER]\n%s\nType your answer and press "
                                 "Enter." % (stamp, message.text))
        elif message.kind == "confirm":
            self.add("question", "%s[AWAITING YOUR CONFIRMATION]\n%s" % (stamp, message.text))
        else:
            prefix = {"warning": "warning: ", "error": "error: ", "agent": "• "}
            self.add(message.kind, stamp + prefix.get(message.kind, "") + message.text, task)
        self.status_due = 0                  # a message usually means the state moved

    def write(self, text):
        self.add("error" if text.startswith("error:") else "output", text)

    def add(self, kind, text, task=None):
        for line in terminal_safe(text).expandtabs().split("\n"):
            self.transcript.append((kind, line, task))
            if self.scroll and (self.attached is None or task in (None, self.attached)):
                self.scroll += 1             # a scrolled-back view stays where it is

    # -- the loop ------------------------------------------------------------------------

    def run(self):
        import curses
        self.curses = curses
        os.environ.setdefault("ESCDELAY", "25")          # a lone Esc should not lag
        # SIGTERM/SIGHUP only set a flag: the loop ends and the terminal is restored.
        previous = {sig: signal.signal(sig, lambda *_: setattr(self, "done", True))
                    for sig in (getattr(signal, n, None) for n in ("SIGTERM", "SIGHUP")) if sig}
        try:
            return curses.wrapper(self._main)    # endwin() whatever happens, then re-raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.shutdown()

    def _main(self, scr):
        curses = self.curses
        self.scr, self.edits = scr, _line_edits(curses)
        curses.raw()        # Ctrl+C arrives as a key, never as KeyboardInterrupt mid-poll
        curses.nonl()       # so that Enter (\r) and Ctrl+J (\n) differ
        with contextlib.suppress(curses.error):
            curses.curs_set(1)
        self._setup_colors()
        self.write("ferrus HQ %s — /help lists the commands, Ctrl+C twice quits." % __version__)
        self.write(self.controller.describe_state())
        data = self.controller.task_in_flight()
        if data is not None:
            self.controller.paused = True    # no agent starts while the question is open
            self.controller.paused = not (self.resume if self.resume is not None else
                                          self.confirm("A task is in flight (%s). Resume it?"
                                                       % data.state))
            self.write("Not resuming; /resume continues the task later."
                       if self.controller.paused else "Resuming it.")
        try:
            self.parallel_tasks_in_flight()
        except FerrusError as err:
            self.write("error: %s" % err.full_text())
        while not self.done:
            self.poll()                      # reactions go on while the user types
            self.draw()
            key = self.getkey(50)
            while key is not None and not self.done:     # pasted text: take it all at once
                self.on_key(key)
                key = self.getkey(0)
        return 0

    def getkey(self, timeout_ms):
        """One key (str or curses key code), or None if none came within the timeout."""
        self.scr.timeout(timeout_ms)
        try:
            return self.scr.get_wch()
        except self.curses.error:
            return None

    def on_key(self, key):
        curses = self.curses
        if self.completion and key not in ("\t", curses.KEY_BTAB, "\r", curses.KEY_ENTER,
                                           "\x1b"):
            self.completion = None           # typing goes on from the completed text
        if key == "\x1b":
            after = self.getkey(30)
            if after in ("\r", "\n"):        # Alt+Enter
                self.on_key("\n")
            elif after is None and self.completion:      # Esc: back to what was typed
                head, tail = self.completion[2:]
                self.buffer, self.cursor, self.completion = head + tail, len(head), None
            elif after is not None:
                self.on_key(after)           # Alt+key: as the key alone
        elif key in ("\r", curses.KEY_ENTER):
            if self.completion:
                self.completion = None       # Enter accepts the completion
            else:
                self.submit()
        elif key in self.edits:
            self.buffer, cursor = self.edits[key](self.buffer, self.cursor)
            self.cursor = max(0, min(len(self.buffer), cursor))
        elif key in ("\t", curses.KEY_BTAB):
            self.complete(-1 if key == curses.KEY_BTAB else 1)
        elif key == "\x03":
            self.ctrl_c()
        elif key in (curses.KEY_UP, curses.KEY_DOWN):
            self.browse(-1 if key == curses.KEY_UP else 1)
        elif key in (curses.KEY_PPAGE, curses.KEY_NPAGE):
            page = max(1, self.scr.getmaxyx()[0] // 2)
            self.scroll = max(0, self.scroll + (page if key == curses.KEY_PPAGE else -page))
        elif key == "\x0c":                  # Ctrl+L: repaint a garbled screen
            self.scr.clearok(True)
        elif isinstance(key, str) and key.isprintable():
            self.buffer = self.buffer[:self.cursor] + key + self.buffer[self.cursor:]
            self.cursor += 1

    def submit(self):
        text, self.buffer, self.cursor = self.buffer.strip(), "", 0
        self.history_pos, self.draft, self.scroll = len(self.history), "", 0
        if not text:
            return
        self.add("input", "> " + text.replace("\n", "\n  "))
        if text.startswith("/"):             # answers to agents stay out of the history
            self.remember(text)
        self.handle(text)
        self.status_due = 0

    def ctrl_c(self):
        now = time.monotonic()
        if now - self.last_ctrl_c > 2.0:
            self.buffer, self.cursor, self.last_ctrl_c = "", 0, now
            self.notice, self.notice_until = "Press Ctrl+C again to quit.", now + 2.0
            return
        self.last_ctrl_c = 0.0
        self.quit_unless_declined()

    # -- completion and history ----------------------------------------------------------

    def candidates(self, head, word):
        """Command names for the first word; slot or role names after some commands."""
        if not head:
            return [name for name, _, _ in HQ_COMMANDS if name.startswith(word)]
        tasks = tuple(short_task_id(row["id"]) for row in self.board.rows())
        words = {"/attach": tuple(self.controller.slots) + tasks,
                 "/tell": tuple(self.controller.slots), "/model": ROLES,
                 "/log": tasks, "/diff": tasks, "/status": tasks,
                 "/task": ("add", "cancel", "retry")}.get(head.split()[0], ()) \
            if head.count(" ") == 1 else ()
        return [w for w in words if w.startswith(word)]

    def complete(self, step):
        if self.completion:
            options, index, head, tail = self.completion
            index = (index + step) % len(options)
        else:
            before, tail = self.buffer[:self.cursor], self.buffer[self.cursor:]
            if not before.startswith("/") or "\n" in before:
                return
            head, _, word = before.rpartition(" ")
            head = head + " " if head else ""
            options = self.candidates(head, word)
            if not options:
                return
            index = 0 if step > 0 else len(options) - 1
        self.buffer, self.cursor = head + options[index] + tail, len(head + options[index])
        # One candidate completes at once; several cycle until Enter accepts one.
        self.completion = (options, index, head, tail) if len(options) > 1 else None

    def _load_history(self):
        try:
            with open(self.history_path, encoding="utf-8", errors="replace") as handle:
                lines = handle.read().splitlines()[-HISTORY_KEEP:]
        except OSError:
            return []
        # One entry a line; a multi-line command has its newlines escaped.
        return [re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), line)
                for line in lines if line.strip()]

    def remember(self, text):
        """Append a command to ~/.ferrus_history at once, so a crash loses nothing."""
        if self.history and self.history[-1] == text:
            return
        self.history.append(text)
        self.history_pos = len(self.history)
        with contextlib.suppress(OSError):
            fd = os.open(self.history_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with open(fd, "a", encoding="utf-8") as handle:
                handle.write(text.replace("\\", "\\\\").replace("\n", "\\n") + "\n")

    def browse(self, step):
        if self.history_pos == len(self.history):
            self.draft = self.buffer         # what was being typed comes back at the end
        self.history_pos = min(len(self.history), max(0, self.history_pos + step))
        self.buffer = (self.history[self.history_pos] if self.history_pos < len(self.history)
                       else self.draft)
        self.cursor = len(self.buffer)

    # -- drawing -------------------------------------------------------------------------

    def _setup_colors(self):
        curses = self.curses
        for kind in ("question", "error", "input"):
            self.attrs[kind] = curses.A_BOLD
        if not curses.has_colors():
            return
        background, pairs = -1, {}
        try:
            curses.use_default_colors()      # keep the terminal's own colours
        except curses.error:
            background = curses.COLOR_BLACK
        if os.environ.get("NO_COLOR"):
            return
        for key, name in _CURSES_COLORS.items():
            if name not in pairs:
                pairs[name] = len(pairs) + 1
                curses.init_pair(pairs[name], getattr(curses, "COLOR_" + name), background)
            self.attrs[key] |= curses.color_pair(pairs[name])

    def status_lines(self):
        """(state, the state line, the agents line): times, counters against their limits,
        spec and milestone; then each slot's session state.  Of the attached task when
        there is one; while parallel tasks run unattached, how many do what."""
        store, controller = self.store, self.controller
        if self.attached:
            store, controller = self.store.for_task(self.attached), \
                self.task_controller(self.attached)
            if not store.exists():
                record = read_task_record(self.store.dir, self.attached)
                return "", "ferrus HQ │ task %s %s │ /attach alone returns to every task" % (
                    short_task_id(self.attached), record.get("status", "gone")), ""
        try:
            data, now = store.read_state(), self.store.clock()
        except FerrusError as err:
            return "", "ferrus HQ │ state unreadable: %s" % err, ""
        if not self.attached and self.controller.mirrors_parallel_task(data):
            runner = self.runner
            return "", "ferrus HQ │ tasks: %s │ /attach ID follows one" % (
                self.board.summary() or "none"), \
                "run: %s, %d at a time" % (phase_label(runner.machine.phase),
                                           runner.max_tasks) if runner is not None else \
                "run: waiting for queued tasks, %d at a time" % self.run_width \
                if self.run_width else "no run: /run works the queue"
        retries = cycles = "?"
        with contextlib.suppress(FerrusError):
            limits = self.store.config().limits
            retries, cycles = limits.max_check_retries, limits.max_review_cycles

        def since(stamp):
            with contextlib.suppress(ValueError, TypeError):
                return format_duration((now - parse_timestamp(stamp)).total_seconds())
            return "-"
        parts = ["ferrus HQ", "%s %s" % (data.state, since(data.state_entered_at))]
        if data.state in ACTIVE_STATES and data.task_started_at:
            parts.append("task %s" % since(data.task_started_at))
        parts += ["retries %d/%s" % (data.check_retries, retries),
                  "reviews %d/%s" % (data.review_cycles, cycles)]
        if data.selected_spec:
            parts.append("spec %s · %s" % (spec_display_name(data.selected_spec),
                                           data.selected_milestone or "none left"))
        if controller is not None and controller.paused and data.state in ACTIVE_STATES:
            parts.append("PAUSED (/resume)")
        if controller is not None and controller.checkpoint:
            parts.append("CAPACITY CHECKPOINT (/continue)")
        if data.task_id:
            used = task_usage(self.store, data.task_id)
            if used["sessions"]:
                parts.append("%s tok%s" % (
                    compact_count(used["input_tokens"] + used["output_tokens"]),
                    " $%.2f%s" % (used["cost_usd"], "+?" if used["cost_unknown"] else "")
                    if used["cost_usd"] is not None else ""))
        if self.attached:            # right after its state, where a narrow screen keeps it
            parts.insert(2, "▸%s" % short_task_id(self.attached))
        slots = ["%s %s%s" % (slot.name, slot.label(),
                              " (%s)" % count_tool_calls(controller.tool_calls_of(slot))
                              if slot.session.state in (SS.RUNNING, SS.INTERRUPTING) else "")
                 for slot in (controller.slots.values() if controller is not None else ())]
        return data.state.value, " │ ".join(parts), " · ".join(slots) if controller is not None \
            else "no agent of this task runs here (/run resumes it)"

    def board_rows(self, height, width):
        """The task board's screen rows, (text, attr): a header, then one row per task,
        as many as fit in about half of what is left of the screen."""
        rows = self.board.rows()
        if not rows:
            return []
        room = max(2, min(12, (height - 8) // 2))
        shown = rows if len(rows) <= room else rows[:room - 1]
        out = [("tasks: %s — /tasks lists them, /attach ID follows one" % self.board.summary(rows),
                self.curses.A_BOLD)]
        for row in shown:
            out.append((self.board.line(row, width, self.attached),
                        self.attrs[task_state_word(row)] |
                        (self.curses.A_BOLD if row["id"] == self.attached else 0)))
        if len(shown) < len(rows):
            out.append(("  … %d more (/tasks)" % (len(rows) - len(shown)), self.curses.A_DIM))
        return out

    def _tail(self, entries, height, width):
        """The screen rows of the newest entries, ``self.scroll`` rows back from the end."""
        import textwrap
        rows = []
        for kind, line, *_ in reversed(entries):
            wrapped = (textwrap.wrap(line, width, subsequent_indent="  ", drop_whitespace=False)
                       if width > 8 else [line[:max(1, width)]]) or [""]
            rows.extend((kind, row) for row in reversed(wrapped))
            if len(rows) >= height + self.scroll:
                break
        self.scroll = max(0, min(self.scroll, len(rows) - height))
        return list(reversed(rows[self.scroll:self.scroll + height]))

    def _input_rows(self, width):
        """The input as screen rows ("> " first, then indented) and the cursor's row/col."""
        rows, where, offset, span = [], (0, 2), 0, max(1, width - 2)
        for number, line in enumerate(self.buffer.split("\n")):
            for start in range(0, max(len(line), 1), span):
                chunk = line[start:start + span]
                if offset + start <= self.cursor <= offset + start + len(chunk):
                    where = (len(rows), 2 + self.cursor - offset - start)
                rows.append(("> " if number == 0 and start == 0 else "  ") + chunk)
            offset += len(line) + 1
        return rows, where

    def hint(self):
        if self.notice and time.monotonic() < self.notice_until:
            return self.notice
        if self.completion:
            options, index = self.completion[:2]
            return "  ".join("[%s]" % o if i == index else o for i, o in enumerate(options))
        if self.scroll:
            return "scrolled back %d lines — PgDn returns" % self.scroll
        typed = self.buffer.split()
        # The longest command the input starts with: "/task add …" is not "/task …".
        return next(("%s — %s" % (("%s %s" % (command, args)).strip(), what)
                     for command, args, what in sorted(HQ_COMMANDS, key=lambda c: -len(c[0]))
                     if typed[:len(command.split())] == command.split()),
                    _CURSES_KEYS_HELP)

    def put(self, row, col, text, attr=0):
        with contextlib.suppress(self.curses.error):    # writing the last cell "fails"
            self.scr.addnstr(row, col, terminal_safe(text), max(0, self.scr.getmaxyx()[1] - col),
                             attr)

    def draw(self):
        curses = self.curses
        height, width = self.scr.getmaxyx()
        if time.monotonic() >= self.status_due:      # about once a second
            self.status, self.status_due = self.status_lines(), time.monotonic() + 1.0
        state, line, agents = self.status
        rows, (cursor_row, cursor_col) = self._input_rows(width)
        keep = max(1, min(len(rows), height // 3))
        first = max(0, min(cursor_row - keep + 1, len(rows) - keep))
        # The task board goes above the transcript: at 80 columns a side pane would leave
        # neither the board's rows nor the transcript's lines room enough to read.
        board = self.board_rows(height, width) if height >= 12 else []
        top, bottom = 2 + len(board), height - keep - 1   # the transcript's rows; the hint
        self.scr.erase()
        self.put(0, 0, line.ljust(width), curses.A_REVERSE)
        self.put(0, len("ferrus HQ │ "), state, curses.A_REVERSE | self.attrs[state])
        if self.banner:                              # dialogs ask in the status area
            self.put(1, 0, fit_banner(self.banner, width).ljust(width),
                     curses.A_BOLD | self.attrs["question"])
        else:
            self.put(1, 0, agents)
        for i, (text, attr) in enumerate(board):
            self.put(2 + i, 0, text, attr)
        if self.selected is not None:                # a selection dialog
            size = max(1, bottom - top)
            first_option = max(0, min(self.selected - size // 2, len(self.view) - size))
            for i, option in enumerate(self.view[first_option:first_option + size]):
                self.put(top + i, 0, option.ljust(width),
                         curses.A_REVERSE if first_option + i == self.selected else 0)
        else:
            entries = self.transcript if self.view is None else [
                line if isinstance(line, tuple) else ("agent", line) for line in self.view]
            if self.view is None and self.attached:  # one task's lines, and HQ's own
                entries = [entry for entry in entries if entry[2] in (None, self.attached)
                           or entry[0] == "question"]
            for i, (kind, text) in enumerate(self._tail(entries, bottom - top, width)):
                self.put(top + i, 0, text, self.attrs[kind])
        self.put(bottom, 0, self.hint(), curses.A_DIM)
        for i, row in enumerate(rows[first:first + keep]):
            self.put(bottom + 1 + i, 0, row)
        with contextlib.suppress(curses.error):
            self.scr.move(bottom + 1 + cursor_row - first, min(cursor_col, width - 1))
        self.scr.refresh()
        if self.bell_due:
            self.bell_due = False
            with contextlib.suppress(curses.error):
                curses.beep()

    # -- dialogs -------------------------------------------------------------------------

    def _modal(self, banner, react):
        """Poll and draw until ``react(key)`` returns something other than ``...``; None
        if HQ is told to quit meanwhile."""
        self.banner = banner
        try:
            while not self.done:
                self.poll()
                self.draw()
                key = self.getkey(50)
                result = ... if key is None else react(key)
                if result is not ...:
                    return result
            return None
        finally:
            self.banner = None

    def confirm(self, question):
        answer = self._modal(question + "  [y/N]", lambda key: True if key in ("y", "Y") else
                             False if key in ("n", "N", "\r", "\n", "\x1b", "\x03") else ...)
        self.write("%s %s" % (question, "yes" if answer else "no"))
        return bool(answer)

    def select(self, title, options):
        """A list dialog: ↑/↓ move, Enter picks (the index), Esc cancels (None)."""
        curses = self.curses
        moves = {curses.KEY_UP: -1, curses.KEY_DOWN: 1, curses.KEY_PPAGE: -10,
                 curses.KEY_NPAGE: 10, curses.KEY_HOME: -len(options), curses.KEY_END: len(options)}

        def react(key):
            if key in moves:
                self.selected = max(0, min(len(options) - 1, self.selected + moves[key]))
                return ...
            return (self.selected if key in ("\r", "\n", curses.KEY_ENTER) else
                    None if key in ("\x1b", "\x03", "q") else ...)
        self.view, self.selected = list(options), 0
        try:
            return self._modal(title + "  (↑↓ move, Enter selects, Esc cancels)", react)
        finally:
            self.view = self.selected = None

    # -- commands that need the screen ---------------------------------------------------

    def cmd_milestones(self, rest):
        if rest:
            return super().cmd_milestones(rest)
        choices = []
        paths = list_spec_paths(self.store.root, self.store.config())
        if not paths:
            return super().cmd_milestones(rest)     # says there is none, and how to write one
        for path in paths:
            choices.append(((path, None), "%s  (the first ready milestone)" % path))
            for milestone in parse_spec(read_text(os.path.join(self.store.root, path))):
                choices.append(((path, milestone.id), "   [%s] %s (%s)" % (
                    "x" if milestone.completed else " ", milestone.display(), milestone.id)))
        if not choices:
            self.write("No specs yet; /spec drafts one.")
            return
        index = self.select("Select a spec or milestone", [label for _, label in choices])
        if index is not None:
            self.write(op_select_milestone(self.store, HUMAN, *choices[index][0]).text)

    def page(self, title, text):
        """A pager over the transcript area: ↑↓ PgUp PgDn Home End move, q or Esc closes."""
        curses = self.curses
        lines = [(_diff_line_kind(line) or "output", line)
                 for line in terminal_safe(text).expandtabs().split("\n")]
        saved_scroll, self.scroll = self.scroll, len(lines) * 8     # _tail clamps: the top

        def react(key):
            page = max(1, self.scr.getmaxyx()[0] - 4)
            moves = {curses.KEY_UP: 1, "k": 1, curses.KEY_DOWN: -1, "j": -1,
                     curses.KEY_PPAGE: page, "b": page, curses.KEY_NPAGE: -page, " ": -page,
                     curses.KEY_HOME: len(lines) * 8, "g": len(lines) * 8,
                     curses.KEY_END: -len(lines) * 8, "G": -len(lines) * 8}
            if key in moves:
                self.scroll = max(0, self.scroll + moves[key])
                return ...
            if key == "\x1b":
                if self.getkey(30) is None:
                    return None                  # a lone Esc closes
                while self.getkey(0) is not None:
                    pass                         # a key curses did not decode: ignored
                return ...
            return None if key in ("q", "Q", "\x03", "\r", "\n", curses.KEY_ENTER) else ...
        self.view = lines
        try:
            self._modal("%s — ↑↓ PgUp/PgDn Home/End (g/G) move · q closes" % title, react)
        finally:
            self.view, self.scroll = None, saved_scroll
        self.write("(%s: %d lines shown in the pager)" % (title, len(lines)))

    def attach_agent(self, rest):
        """The agent's live log in the transcript area until a key is pressed."""
        controller = self.focus_controller()
        slot = controller.slots.get(rest)
        if slot is None or slot.process is None:
            raise UsageError("no running agent called %r (running: %s)" % (rest, ", ".join(
                s.name for s in controller.running()) or "none"))
        process, lines, pending = slot.process, collections.deque(maxlen=5000), ""
        self.view, self.banner = lines, "attached to the %s — %s — any key returns" % (
            rest, self.store.relpath(process.log_path))
        try:
            with open(process.log_path, encoding="utf-8", errors="replace") as handle:
                while process is not None and self.getkey(100) is None and not self.done:
                    exited = slot.process is not process     # then read its last words
                    pending += handle.read()
                    *complete, pending = pending.split("\n")
                    lines.extend(complete)
                    if exited:
                        lines.extend(([pending] if pending else []) + ["[the agent exited]"])
                        process = None
                    self.poll()
                    self.draw()
            if process is None:
                self._modal(self.banner, lambda key: True)   # still until a key
        finally:
            self.view = self.banner = None
        self.write("--- detached from the %s ---" % rest)

    def interactive(self, role, prompt):
        """Leave curses while the agent CLI owns the terminal; HqShell keeps polling and
        holds the messages; curses comes back afterwards."""
        curses = self.curses
        curses.def_prog_mode()
        curses.endwin()
        print("--- the %s agent has the terminal; HQ continues when it exits ---" % role,
              flush=True)
        try:
            super().interactive(role, prompt)      # which leaves Ctrl+C to the agent
        finally:
            curses.reset_prog_mode()
            self.scr.clearok(True)
            self.status_due = 0


def hq_front_end(store, resume, no_tui):
    """CursesHq in a capable terminal, else the plain-line HqShell."""
    term = os.environ.get("TERM", "dumb")
    if not no_tui and term != "dumb" and sys.stdin.isatty() and sys.stdout.isatty():
        try:
            import curses
        except ImportError:              # Windows Python has no curses
            curses = None
        if curses is not None:
            with contextlib.suppress(curses.error):     # no terminfo entry for TERM
                curses.setupterm(term, sys.stdout.fileno())
                return CursesHq(store, resume=resume)
    return HqShell(store, resume=resume)


# ============================================================================
# 20. CLI
# ============================================================================

def invoked_as():
    """How the user started ferrus, for hints they can paste: ``ferrus`` from the
    launcher or an installed command, else the interpreter and this file."""
    program = os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "")
    if program in ("ferrus", "ferrus.exe"):
        return "ferrus"
    if program == "__main__.py" or program == "-m":
        return "python3 -m ferrus"
    return "python3 %s" % os.path.abspath(__file__)


def cmd_init(args, root):
    init_project(root, args.agents_path)
    print()
    me = invoked_as()
    # Name only the steps still to do: `init` run again in a set-up project would
    # otherwise send its user back to steps done long ago.
    steps = []
    checks_set = registered = False
    with contextlib.suppress(FerrusError, OSError):
        config = load_config(root)
        checks_set = bool(config.checks.commands)
        hq = config.require_hq()
        registered = all(
            getattr(hq, role) is not None and adapter_for(config, getattr(hq, role).agent)
            .registration(root, role) is not None for role in ROLES)
    if not checks_set:
        steps.append("put your lint and test commands in [checks] of ferrus.toml")
    if not registered:
        steps.append("`%s register` (the agents [hq.*] names; or --supervisor A "
                     "--executor A)" % me)
    steps.append("`%s run --task \"...\"`" % me)
    print("ferrus is initialized. Next: %s." % ", then ".join(steps))
    return 0


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
    config = config_error = None
    try:
        config = store.config()
    except FerrusError as err:
        # Defaults would hide the problem: say that the limits are unknown instead.
        config_error = err
    notes = []
    if config_error is None:
        if not config.checks.commands:
            notes.append(NO_CHECKS_WARNING)
        if config.hq_problem:
            notes.append(config.hq_problem.message)
    orchestrator = running_orchestrator(store)
    sessions = read_session_records(store)
    task_records = [r for r in sessions if data.task_id and r.get("task_id") == data.task_id]
    queue = status_task_rows(store, sessions)
    if args.json:
        info["tasks"] = queue
        info["parallel_task"] = view.task       # the parallel task STATE.json mirrors
        info["orchestrator"] = orchestrator
        info["usage"] = usage_summary(task_records)
        info["sessions"] = [session_brief(r) for r in task_records]
        info["lease_holder"] = info["claimed_by"]
        if config:
            info["limits"] = dataclasses.asdict(config.limits)
        info["config_error"] = config_error.full_text() if config_error else None
        info["config_warnings"] = notes
        print(json.dumps(info, indent=2))
        return 0
    color = _color_enabled(sys.stdout)
    rows = [("state", _paint(data.state.value, _STATE_COLORS.get(data.state.value), color))]
    if info["seconds_in_state"] is not None:
        rows[0] = ("state", rows[0][1] + "  (for %s)" % format_duration(info["seconds_in_state"]))
    if data.paused_state:
        rows.append(("paused from", data.paused_state.value))
    rows.append(("task", (data.task_id or "-") + (
        "  (parallel task, %s; `ferrus tasks` lists every task)" % (
            "its %s is damaged: `ferrus doctor --fix` repairs it" % TASK_RECORD_FILE
            if damaged else
            "merged" if record.get("status") == MERGED_STATUS else
            "in its worktree %s" % record["worktree"] if record.get("worktree") and
            os.path.isdir(record["worktree"]) else record.get("status") or "queued")
        if view.task else "")))
    if data.task_started_at:
        with contextlib.suppress(ValueError):
            rows.append(("task age", format_duration(
                (now - parse_timestamp(data.task_started_at)).total_seconds())))
    if view.task and record.get("status") in (MERGED_STATUS, CANCELLED_STATUS):
        # Its branch and worktree are gone: the base would name a branch that is no more.
        merged = record.get("merged_commit") or ""
        rows.append(("git", "merged into %s%s; its worktree and branch were removed%s" % (
            record.get("target") or "the target", " at %s" % merged[:12] if merged else "",
            " (`git show %s` shows what it changed)" % merged[:12] if merged else "")
            if record["status"] == MERGED_STATUS else
            "cancelled; its worktree and branch were removed"))
    elif data.task_base:
        rows.append(("git base", describe_base(data.task_base) + " (`ferrus diff` shows the "
                                                                "changes since)"))
    if config:
        rows.append(("check retries", "%d/%d" % (data.check_retries,
                                                 config.limits.max_check_retries)))
        rows.append(("review cycles", "%d/%d" % (data.review_cycles,
                                                 config.limits.max_review_cycles)))
    else:
        rows.append(("check retries", "%d (limit unknown: ferrus.toml is invalid)"
                     % data.check_retries))
        rows.append(("review cycles", "%d (limit unknown: ferrus.toml is invalid)"
                     % data.review_cycles))
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
    left = store.lease_seconds_left(data)
    if left > 0:
        rows.append(("lease", "%s, expires in %s (%s)" % (data.claimed_by, format_duration(left),
                                                        data.lease_until)))
    elif data.claimed_by:
        rows.append(("lease", "expired (last holder %s)" % data.claimed_by))
    else:
        rows.append(("lease", "none"))
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
    if task_records:
        rows.append(("usage", format_usage(usage_summary(task_records))))
        shown = task_records[-STATUS_SESSIONS_SHOWN:]
        if len(shown) < len(task_records):
            rows.append(("sessions", "%d earlier: `ferrus sessions --task %s`" % (
                len(task_records) - len(shown), data.task_id)))
        rows.extend(("session", describe_session(record)) for record in shown)
    rows.append(("rev", str(data.rev)))
    if config_error:
        rows.append(("config", _paint("error: " + terminal_safe(config_error.message), "1;31",
                                      color)))
        hint = config_error.hint or ""
        if "ferrus doctor" not in hint:
            hint += " (`ferrus doctor` lists every problem)"
        rows.append(("", "fix: %s" % hint))
    for note in notes:
        rows.append(("config", _paint("warning: " + terminal_safe(note), "33", color)))
    width = max(len(label) for label, _ in rows)
    for label, value in rows:     # these rows carry ferrus's own colour codes, made safe above
        print("%s  %s" % (label.rjust(width),
                          value if label in ("state", "config") else terminal_safe(value)))
    if data.state == S.AWAITING_CONFIRMATION:
        print("\n" + terminal_safe(confirmation_summary(view, data)))
    for line in describe_queue(queue):
        say(line)
    return 0


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
    counts = collections.Counter(DAMAGED_WORD if row.get("problem") else row.get("status")
                                 for row in rows)
    lines = ["", "tasks  %s (`ferrus tasks` lists them)" % ", ".join(
        "%d %s" % (counts[status], status) for status in (
            RUNNING_STATUS, QUEUED_STATUS, MERGED_STATUS, DONE_STATUS, FAILED_STATUS,
            CANCELLED_STATUS, DAMAGED_WORD) if counts[status])]
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
    if task is not None:
        store = diff_store_of(store, task)
    paths = []
    for path in args.paths:
        # Typed in a shell, a path is relative to where the user stands.
        relative = os.path.relpath(os.path.abspath(path), store.root)
        if relative == ".." or relative.startswith(".." + os.sep) or os.path.isabs(relative):
            raise UsageError("%s is outside the project (%s)" % (path, store.root),
                             "name files or folders inside the project")
        paths.append(relative.replace(os.sep, "/"))
    outcome = op_diff(store, HUMAN, stat_only=args.stat, paths=paths or None)
    if args.json:
        print(json_for_terminal(compact_json(outcome.data)))
        return 0 if outcome.data.get("available") else 1
    if not outcome.data.get("available"):
        raise FerrusError("no diff: %s" % outcome.data["reason"], outcome.data.get("hint"))
    print(paint_diff(outcome.text, _color_enabled(sys.stdout)))
    return 0


def cmd_task(args, root):
    store = Store(root).require()
    caller = human_caller()
    if args.task_command == "cancel":
        task = require_task_id(store, args.id)
        running = read_task_record(store.dir, task).get("status") == RUNNING_STATUS
        runner = live_parallel_run(store) if running else None
        if running and running_orchestrator(store) is None:
            # A dead orchestrator may have left the task's agents at work in its worktree.
            for note in stop_orphaned_agents(store, task):
                say(note)
        say(op_cancel_task(store, caller, task, remove_worktree=runner is None).text)
        if runner is not None:
            say("The running %s stops its agents and removes its worktree and branch."
                % describe_orchestrator(runner))
        return 0
    if args.task_command == "retry":
        say(op_retry_task(store, caller, args.id).text)
        return 0
    sources = [name for name in ("text", "file", "milestone", "ready")
               if getattr(args, name)]
    if len(sources) != 1:
        raise UsageError("say what to queue: TEXT, --file F, --milestone SPEC ID or --ready SPEC "
                         "(one of them)", 'ferrus task add "Add a --verbose flag"')
    if args.milestone or args.ready:
        if args.agent:
            raise UsageError("--agent goes with a task given as TEXT or --file")
        outcome = op_enqueue_milestone(store, caller, *args.milestone) if args.milestone \
            else op_enqueue_ready(store, caller, args.ready)
    else:
        text = " ".join(args.text)
        if args.file:
            try:
                text = sys.stdin.read() if args.file == "-" else read_text(args.file)
            except OSError as err:
                raise FerrusError("cannot read --file %s: %s" % (args.file, err.strerror),
                                  "give the path of a text file holding the task, or - for "
                                  "stdin") from err
        outcome = op_enqueue_task(store, caller, text, agent=args.agent)
    say(outcome.text)
    return 0


def format_task_row(row, now_width=None):
    """One line of `ferrus tasks`: id, state, agent, age, title."""
    age = format_duration(row["age_secs"]) if row.get("age_secs") is not None else "?"
    return "%-25s %-12s %-12s %7s  %s" % (row["id"], task_state_word(row),
                                         row.get("agent") or "-", age,
                                         row["title"])


def cmd_tasks(args, root):
    store = Store(root).require()
    rows = task_rows(store)
    records = read_session_records(store)
    for row in rows:
        used = usage_summary([r for r in records if r.get("task_id") == row["id"]])
        row["tokens"] = used["input_tokens"] + used["output_tokens"]
        row["cost_usd"] = None if used["cost_unknown"] else used["cost_usd"]
        row["agent"] = row.get("agent") or next(
            (r.get("agent") for r in reversed(records) if r.get("task_id") == row["id"]
             and r.get("role") == "executor"), None)
    if args.json:
        print(json_for_terminal(compact_json({"tasks": rows})))
        return 0
    if not rows:
        say("The queue is empty: `ferrus task add TEXT` queues a task.")
        return 0
    say("%-25s %-12s %-12s %7s  %s" % ("TASK", "STATE", "AGENT", "AGE", "TITLE"))
    for row in rows:
        line = format_task_row(row)
        if row.get("tokens"):
            line += "  (%s tok)" % compact_count(row["tokens"])
        say(line)
        if row.get("worktree") and row["status"] == RUNNING_STATUS:
            say("%25s worktree %s" % ("", row["worktree"]))
    return 0


def cmd_journal(args, root):
    store = Store(root).require()
    say(op_rotate_journal(store, HUMAN).text)
    return 0


def confirm(question):
    """Ask a yes/no question on the terminal; refuse to guess without one."""
    if not sys.stdin.isatty():
        raise UsageError("%s — stdin is not a terminal, so nobody can answer" % question,
                         "pass --yes to confirm")
    try:
        answer = input("%s [y/N] " % question)
    except EOFError:            # Ctrl+D answers no, as Enter does
        say()
        return False
    return answer.strip().lower() in ("y", "yes")


def cmd_reset(args, root):
    store = Store(root).require()
    data = store.read_state()
    if data.state == S.IDLE:
        say("Nothing to reset: the state is already Idle.")
        return 0
    if not args.yes:
        if not confirm("Reset the task (state %s) to Idle and clear its files?" % data.state):
            say("Nothing changed.")
            return 1
    say(op_force_reset(store, HUMAN).text)
    return 0


def human_caller():
    """The human, unless this shell belongs to an agent session HQ started (its
    environment names the session): then an agent, whom the operations refuse."""
    session = os.environ.get(SESSION_ENV)
    return Caller("agent", "agent/%s" % session) if session else HUMAN


def confirmation_store(store, task, verb):
    """The store of the task ``ferrus approve/reject`` acts on: ``--task`` names it; else
    the one task waiting for a confirmation; with none, the checkout's (the operation then
    says why there is nothing to confirm)."""
    if task:
        return task_store_of(store, task)
    waiting = stores_awaiting_confirmation(store)
    if len(waiting) > 1:
        raise UsageError("%d tasks wait for your confirmation: %s" % (len(waiting), ", ".join(
            "%s (%s)" % (short_task_id(t), read_task_record(store.dir, t).get("title") or t)
            for t, _ in waiting)), "name one: `ferrus %s --task %s`" % (
                verb, short_task_id(waiting[0][0])))
    return waiting[0][1] if waiting else store


def cmd_approve(args, root):
    store = confirmation_store(Store(root).require(), args.task, "approve")
    caller = human_caller()
    data = store.read_state()
    if data.state != S.AWAITING_CONFIRMATION or caller.is_agent:
        say(op_human_approve(store, caller).text)     # refuses, saying why
        return 0
    if not args.yes:
        say(terminal_safe(confirmation_summary(store, data)))
        say()
        if not confirm("Approve task %s?" % (data.task_id or "")):
            say("Nothing changed.")
            return 1
    say(op_human_approve(store, caller).text)
    return 0


def cmd_reject(args, root):
    store = confirmation_store(Store(root).require(), args.task, "reject")
    notes = " ".join(args.notes)
    if args.file:
        if notes:
            raise UsageError("give the notes as words or with --file, not both")
        try:
            notes = sys.stdin.read() if args.file == "-" else read_text(args.file)
        except OSError as err:
            raise FerrusError("cannot read --file %s: %s" % (args.file, err.strerror),
                              "give the path of a text file holding your notes, or - for stdin") from err
    if not notes.strip():
        raise UsageError("the rejection needs notes: what must change",
                         "ferrus reject \"Handle the empty input too\" (or --file NOTES.md)")
    say(op_human_reject(store, human_caller(), notes).text)
    return 0


def cmd_doctor(args, root):
    findings = doctor_findings(root)
    if not findings:
        say("ferrus doctor: everything is consistent.")
        return 0
    remaining = repaired = 0
    for finding in findings:
        say("%s: %s" % (finding.severity, finding.problem))
        if args.fix and finding.fix is not None:
            try:
                finding.fix()
                say("  fixed: %s" % finding.repair)
                repaired += 1
                continue
            except (OSError, FerrusError) as err:
                say("  could not fix: %s" % err)
        elif finding.fix is not None:
            say("  repair: %s (run `ferrus doctor --fix`)" % finding.repair)
        else:
            say("  what to do: %s" % finding.repair)
        if finding.severity == "error":
            remaining += 1
    warnings = sum(1 for finding in findings if finding.severity == "warning")
    if args.fix:
        # Fixes can reveal or resolve others; report what is still wrong.
        left = [f for f in doctor_findings(root) if f.severity == "error"]
        done = "repaired %d problem(s)" % repaired if repaired else "repaired nothing"
        if left:
            say("ferrus doctor: %s; %d error(s) remain (see above for what to do)."
                % (done, len(left)))
        elif repaired:
            say("ferrus doctor: %s; no errors remain." % done)
        else:
            say("ferrus doctor: there was no error to repair (%d warning(s) above)." % warnings)
        return 1 if left else 0
    if not remaining:
        say("ferrus doctor: everything is consistent, with %d warning(s) above." % warnings
            if warnings else "ferrus doctor: everything is consistent (see the notes above).")
    return 1 if remaining else 0


def cmd_check(args, root):
    store = Store(root).require()
    report_orphaned_checks(store)
    if args.task:
        store = task_store_of(store, args.task)
    if args.force:
        run, config = op_run_checks_only(store)
        if run is None:
            say("No check commands are configured in ferrus.toml ([checks] commands).")
            return 0
        for result in run.results:
            say("%-9s %s%s" % (result.status, result.command, _status_note(result)
                                 if not result.passed else ""))
        if not run.passed:
            say()
            say(run.report(config.limits.max_feedback_lines))
        else:
            say("All checks passed. Full log: %s" % run.log_path)
        return 0 if run.passed else 1
    try:
        outcome = op_check(store, Caller("human", "human:cli:0"))
    except FerrusError as err:
        if store.read_state().state in WORK_STATES:
            raise
        # The agents' message cannot mention a CLI flag; the human at the shell can use it.
        raise FerrusError(err.message, "`ferrus check --force` runs the checks in any state "
                                       "and changes nothing") from err
    say(outcome.text)
    return 0 if outcome.data.get("passed") else 1


def cmd_register(args, root):
    choices, from_config = registration_choices(args, root)
    if from_config:
        say("Registering the agents ferrus.toml names: %s" % ", ".join(
            "%s %s" % (role, agent) for role, (agent, _model) in choices.items()))
    register_agents(root, choices, trust=args.trust)
    print()
    print("Done. `ferrus agents` shows whether each agent is installed and connected.")
    return 0


def cmd_unregister(args, root):
    roles = [role for role in ROLES if getattr(args, role)] or list(ROLES)
    unregister_agents(root, roles)
    return 0


def cmd_agents(args, root):
    rows = agents_report(root)
    if args.json:
        say(json.dumps(rows, indent=2))
        return 0 if not any("problem" in row for row in rows) else 1
    for row in rows:
        if row["agent"] is None:
            say("%-10s (none)  %s" % (row["role"], row["problem"]))
        else:
            say("%-10s %s%s" % (row["role"], row["agent"],
                                  " (model %s)" % row["model"] if row["model"] else ""))
            say("           binary: %s" % (row["path"] or "not installed"))
            if row["path"]:
                say("           version: %s" % (row["version"] or "unknown (--version failed)"))
            say("           MCP: %s" % ("points at this ferrus" if row["points_here"] else
                                          "registered elsewhere" if row["registered"] else
                                          "not registered"))
            say("           permissions: %s (%s)%s" % (
                row["permissions"], row["permissions_from"],
                ": " + " ".join(row["permission_args"]) if row["permission_args"] else ""))
        for warning in row.get("warnings", ()):
            say("           warning: %s" % warning["warning"])
            say("           fix: %s" % warning["hint"])
        if "problem" in row:
            say("           problem: %s" % row["problem"])
            say("           fix: %s" % row["hint"])
    return 0 if not any("problem" in row for row in rows) else 1


def cmd_run(args, root):
    if args.timeout is not None and not args.timeout > 0:     # also refuses NaN
        raise UsageError("--timeout must be a positive number of seconds, got %g"
                         % args.timeout, "leave --timeout out to run until the task ends")
    store = Store(root).require()
    report_orphaned_checks(store)
    task = args.task
    if args.task_file:
        try:
            task = sys.stdin.read() if args.task_file == "-" else read_text(args.task_file)
        except OSError as err:
            raise FerrusError("cannot read --task-file %s: %s" % (args.task_file, err.strerror),
                              "give the path of a text file holding the task, relative to "
                              "the current folder, - for stdin, or pass the task as --task "
                              "TEXT") from err
    mode = "json" if args.json else "quiet" if args.quiet else "lines"
    # JSON goes to programs, which answer no questions and want no bell characters.
    interactive = sys.stdin.isatty() and mode != "json"
    bell = terminal_bell(sys.stdout) if mode != "json" else None

    def ask(question):
        if not interactive:
            return None
        # The question itself is already on the screen (the run's own event line).
        say("Your answer to the question above:", flush=True)
        try:
            return input("answer> ")
        except EOFError:        # Ctrl+D: no answer now; the question keeps waiting
            say()
            return None

    def review(summary):
        """The human's word on the reviewer's approval shown above ([hq] human_review)."""
        if not interactive:
            return None
        try:
            while True:
                reply = input("approve? y approves, r rejects with notes, Enter decides "
                              "later> ").strip().lower()
                if reply in ("y", "yes"):
                    return "approve", None
                if reply in ("r", "reject", "n", "no"):
                    notes = input("notes for the executor> ")
                    if notes.strip():
                        return "reject", notes
                    say("a rejection needs notes saying what must change", flush=True)
                elif not reply:
                    return None
        except EOFError:
            return None
    if args.until_done and task is not None:
        raise UsageError("--until-done works through spec milestones; it cannot follow --task",
                         "use `ferrus run --until-done` (or `--milestone ID --until-done`)")
    if args.parallel is not None and not 1 <= args.parallel <= 64:
        raise UsageError("--parallel takes a number of tasks from 1 to 64, got %d"
                         % args.parallel, "ferrus run --parallel 3")
    parallel = args.parallel
    if parallel is None:
        # A ferrus.toml that does not load is reported by the run itself, as ever.
        with contextlib.suppress(FerrusError):
            parallel = store.config().parallel.max_tasks
    parallel = parallel or 1
    if parallel > 1 and (args.milestone or args.until_done or args.resume or args.reset):
        raise UsageError("tasks run in parallel come from the queue",
                         "queue them with `ferrus task add` (--milestone SPEC ID, --ready "
                         "SPEC), then `ferrus run --parallel N`; an interrupted task is "
                         "resumed by the next run, a failed one once `ferrus task retry ID` "
                         "queues it again")
    with OrchestratorLock(store, "ferrus run") as held:
        show = run_printer(lambda text: say(text, flush=True), mode)
        for note in held.notes:
            show(HqMessage("info", "ferrus run: %s" % note, "run"))
        if parallel > 1:
            if task is not None:
                require_utf8(task, "the task description")
                show(HqMessage("info", "ferrus run: " + op_enqueue_task(
                    store, human_caller(), task).text, "run"))
            return run_parallel(store, parallel, args.timeout, ask=ask, review=review,
                                mode=mode, bell=bell)
        if args.milestone or args.until_done:
            return run_milestones(store, args.milestone or "next", args.until_done,
                                  args.timeout, args.resume, args.reset, ask=ask, review=review,
                                  mode=mode, bell=bell)
        if task is None and not args.resume and any(
                record.get("status") in (QUEUED_STATUS, RUNNING_STATUS)
                for _, record in task_records(store)):
            return run_queue(store, timeout=args.timeout, ask=ask, review=review, mode=mode,
                             bell=bell)
        return run_loop(store, task, args.timeout, args.resume, ask=ask, reset=args.reset,
                        review=review, mode=mode, bell=bell)


def cmd_hq(args, root):
    store = Store(root).require()
    report_orphaned_checks(store)
    resume = True if getattr(args, "resume", False) else None
    with OrchestratorLock(store, "ferrus hq") as held:
        front = hq_front_end(store, resume, getattr(args, "no_tui", False))
        for note in held.notes:
            front.write(note)
        return front.run()


# -- `ferrus pipeline …` and HQ's `/pipeline …` ------------------------------------------------
#
# One implementation for both front ends: pipeline_command() does the work and
# reports through ``out``; only following a run differs (the CLI drives it in
# the foreground, HQ in a background thread so HQ keeps reacting).

def _follow_in_foreground(orchestrator, name):
    say("following run %s — Ctrl+C leaves its workers running" % name, flush=True)
    try:
        outcome = orchestrator.drive(name)
    except KeyboardInterrupt:
        say("\ninterrupted: the workers keep running and status.json is intact; "
              "`ferrus pipeline resume %s` continues" % name, flush=True)
        return 130
    return _pipeline_result(outcome, lambda text: say(text, flush=True))


# The pipeline subcommands that drive runs, and so need the orchestrator lock.
PIPELINE_DRIVING = ("run", "resume", "continue", "retry")


def cmd_pipeline(args, root):
    store = Store(root).require()
    out = lambda text: say(text, flush=True)     # noqa: E731
    if args.pipeline_command not in PIPELINE_DRIVING:
        return pipeline_command(store, args, out, _follow_in_foreground,
                                bell=terminal_bell(sys.stdout))
    with OrchestratorLock(store, "ferrus pipeline %s" % args.pipeline_command) as held:
        for note in held.notes:
            out(note)
        return pipeline_command(store, args, out, _follow_in_foreground,
                                bell=terminal_bell(sys.stdout))


def add_pipeline_parser(sub):
    """`ferrus pipeline …` on the top-level subparsers."""
    p = sub.add_parser("pipeline", help="file-driven multi-agent pipelines (workflows.json)")
    commands = p.add_subparsers(dest="pipeline_command", metavar="COMMAND")
    commands.required = True
    commands.add_parser("list", help="the pipelines workflows.json defines")
    commands.add_parser("init", help="write an example workflows.json (never overwrites)")
    c = commands.add_parser("run", help="start a run and drive it to delivery")
    c.add_argument("name", metavar="NAME", help="the pipeline")
    c.add_argument("topic", metavar="TOPIC", nargs="+", help="what the workers work on")
    c = commands.add_parser("status", help="one run's phases and workers, or every run")
    c.add_argument("ref", metavar="RUN", nargs="?", help="a run folder name (or unique prefix)")
    c.add_argument("--json", action="store_true", help="status.json / machine-readable rows")
    for name, what in (("resume", "drive a run again (after Ctrl+C, a crash or a reboot)"),
                       ("continue", "go on after pause_after or a capacity checkpoint"),
                       ("cancel", "stop a run's workers, mark it cancelled and archive it")):
        c = commands.add_parser(name, help=what)
        c.add_argument("ref", metavar="RUN", help="a run folder name (or unique prefix)")
    c = commands.add_parser("retry", help="run a failed worker again")
    c.add_argument("ref", metavar="RUN", help="a run folder name (or unique prefix)")
    c.add_argument("worker", metavar="WORKER", help="the worker's role")
    p.set_defaults(run=cmd_pipeline)


def cmd_serve(args, root):
    return serve_stdio(root, args.role, args.agent_name, args.agent_index, args.session)


class CliParser(argparse.ArgumentParser):
    """argparse with a "did you mean" hint for a mistyped command, choice or option."""

    argv = ()       # the command line being parsed, to find the subcommand's options

    def error(self, message):
        self.print_usage(sys.stderr)
        text = "%s: error: %s\n" % (self.prog, message)
        suggestion = self._suggestion(message)
        if suggestion:
            text += "hint: did you mean %s?\n" % suggestion
        self.exit(2, text)

    def _suggestion(self, message):
        choice = re.search(r"invalid choice: '?([^'\s]*)'? \(choose from (.*)\)", message)
        if choice:
            return did_you_mean(choice.group(1), re.findall(r"[^',\s]+", choice.group(2)))
        if not message.startswith("unrecognized arguments:"):
            return None
        options = self._option_names()
        for word in message.split(":", 1)[1].split():
            if word.startswith("-"):
                found = did_you_mean(word.split("=", 1)[0], options)
                if found:
                    return found
        return None

    def _option_names(self):
        """This parser's options and those of the subcommand named on the command line."""
        names = [o for action in self._actions for o in action.option_strings]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                command = next((word for word in CliParser.argv if word in action.choices), None)
                if command:
                    names += action.choices[command]._option_names()
        return names


def build_parser():
    parser = CliParser(
        prog="ferrus", description="Deterministic Supervisor → Executor → Reviewer orchestration "
                                   "of coding agents.")
    parser.add_argument("--version", action="version", version="ferrus %s" % __version__)
    parser.add_argument("-C", dest="directory", metavar="DIR",
                        help="run as if started in DIR (the project root)")
    parser.add_argument("--debug", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("init", help="create ferrus.toml, .ferrus/ and the skill files")
    p.add_argument("--agents-path", metavar="P", help="where skill files go (default .agents)")
    p.set_defaults(run=cmd_init)

    p = sub.add_parser("status", help="where the task stands")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=cmd_status)

    p = sub.add_parser("log", help="the journal of every transition")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new entries")
    p.add_argument("-n", type=int, default=None, metavar="N", help="only the last N entries")
    p.add_argument("--all", "-a", action="store_true",
                   help="also the bookkeeping entries (agent sessions, leases, heartbeats, "
                        "capacity checks that let work go on)")
    p.add_argument("--task", metavar="ID", help="only the entries about this task (a queue "
                                                 "task's id or its end; `current`)")
    p.set_defaults(run=cmd_log)

    p = sub.add_parser("sessions", help="every agent session: role, agent, outcome, usage, log")
    p.add_argument("id", nargs="?", help="show this one session (an id or its prefix) in full")
    p.add_argument("--json", action="store_true", help="the records as JSON")
    p.add_argument("--task", metavar="ID", help="only this task's sessions (`current`: the "
                                                 "current task's)")
    p.add_argument("--pipeline", metavar="RUN", help="only this pipeline run's workers")
    p.add_argument("-n", type=int, default=None, metavar="N", help="only the last N sessions")
    p.set_defaults(run=cmd_sessions)

    p = sub.add_parser("usage", help="tokens and cost per task, pipeline run and agent")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--since", metavar="WHEN", help="only sessions started since WHEN: a "
                                                   "duration (24h, 7d) or a date (2026-05-01)")
    p.set_defaults(run=cmd_usage)

    p = sub.add_parser("diff", help="the task's changes since its base commit (git)")
    p.add_argument("--stat", action="store_true", help="only the files changed and their counts")
    p.add_argument("--json", action="store_true", help="the diff's data as one JSON object")
    p.add_argument("paths", nargs="*", metavar="PATH", help="only these files or folders")
    p.add_argument("--task", metavar="ID", help="a parallel task's diff, in its worktree")
    p.set_defaults(run=cmd_diff)

    p = sub.add_parser("task", help="queue a task, cancel or retry one (parallel tasks)")
    commands = p.add_subparsers(dest="task_command", metavar="COMMAND")
    commands.required = True
    add = commands.add_parser("add", help="put a task in the queue `ferrus run` works through")
    add.add_argument("text", nargs="*", metavar="TEXT", help="the task, in words")
    add.add_argument("--file", metavar="F", help="the task from this file (- for stdin)")
    add.add_argument("--milestone", nargs=2, metavar=("SPEC", "ID"),
                     help="the task that implements this milestone of this spec")
    add.add_argument("--ready", metavar="SPEC",
                     help="one task for every ready milestone of this spec")
    add.add_argument("--agent", metavar="AGENT",
                     help="the executor agent for this task (default: [hq.executor])")
    cancel = commands.add_parser("cancel", help="take a task out of the queue or stop it; its "
                                                "worktree and branch are removed")
    cancel.add_argument("id", metavar="ID", help="the task's id (`ferrus tasks`)")
    retry = commands.add_parser("retry", help="queue a failed or cancelled task again; it "
                                              "goes on in its kept worktree")
    retry.add_argument("id", metavar="ID", help="the task's id (`ferrus tasks`)")
    p.set_defaults(run=cmd_task)

    p = sub.add_parser("tasks", help="the task queue: id, state, agent, age, title")
    p.add_argument("--json", action="store_true", help="one JSON object with every task")
    p.set_defaults(run=cmd_tasks)

    p = sub.add_parser("journal", help="maintain the journal (events.jsonl)")
    commands = p.add_subparsers(dest="journal_command", metavar="COMMAND")
    commands.required = True
    commands.add_parser("rotate", help="move events.jsonl to events.jsonl.1 and start anew")
    p.set_defaults(run=cmd_journal)

    p = sub.add_parser("reset", help="return to Idle from any state (keeps the spec selection)")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(run=cmd_reset)

    p = sub.add_parser("approve", help="confirm the reviewer's approval ([hq] human_review)")
    p.add_argument("--yes", "-y", action="store_true",
                   help="approve without showing the summary and asking first")
    p.add_argument("--task", metavar="ID", help="the parallel task to approve (needed when "
                                                 "more than one waits)")
    p.set_defaults(run=cmd_approve)

    p = sub.add_parser("reject", help="send a task the reviewer approved back to the executor "
                                      "([hq] human_review)")
    p.add_argument("notes", nargs="*", metavar="NOTES", help="what must change (review notes)")
    p.add_argument("--file", "-F", metavar="F", help="read the notes from file F (- for stdin)")
    p.add_argument("--task", metavar="ID", help="the parallel task to send back (needed when "
                                                 "more than one waits)")
    p.set_defaults(run=cmd_reject)

    p = sub.add_parser("doctor", help="check .ferrus/ for consistency and explain repairs")
    p.add_argument("--fix", action="store_true", help="apply the safe repairs")
    p.set_defaults(run=cmd_doctor)

    p = sub.add_parser("check", help="run the check gate ([checks] commands)")
    p.add_argument("--force", action="store_true",
                   help="run the checks in any state and change nothing")
    p.add_argument("--task", metavar="ID", help="a parallel task's checks, in its worktree")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("register", help="configure agent CLIs to reach this ferrus")
    add_registration_options(p)
    p.set_defaults(run=cmd_register)

    p = sub.add_parser("unregister", help="remove what register wrote")
    p.add_argument("--supervisor", action="store_true", help="only the supervisor role")
    p.add_argument("--executor", action="store_true", help="only the executor role")
    p.set_defaults(run=cmd_unregister)

    p = sub.add_parser("agents", help="each role's agent: installed, version, registered")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=cmd_agents)

    p = sub.add_parser("run", help="run the whole loop without a UI until Complete or Failed")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--task", metavar="TEXT", help="create this task (as the human)")
    group.add_argument("--task-file", metavar="F",
                       help="create the task from this file (- for stdin)")
    group.add_argument("--milestone", metavar="ID|next",
                       help="create the task from this spec milestone (id or marker), or the "
                            "next ready one; approving it ticks its box")
    p.add_argument("--until-done", action="store_true",
                   help="after each milestone, take the next ready one until none is left")
    p.add_argument("--parallel", type=int, metavar="N",
                   help="work the task queue (`ferrus task add`) N tasks at a time, each in "
                        "its own git worktree, merged when the checks pass on the result "
                        "(default: [parallel] max_tasks)")
    p.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (exit 3)")
    p.add_argument("--resume", action="store_true", help="continue the task in flight")
    p.add_argument("--reset", action="store_true",
                   help="replace a Failed task (without it, a Failed task is kept and the run "
                        "refuses)")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--quiet", "-q", action="store_true",
                        help="only transitions, verdicts, questions, problems and the end "
                             "(no tool calls, heartbeats or agent starts)")
    output.add_argument("--json", action="store_true",
                        help="one JSON object per event on stdout, for CI logs and programs "
                             "(never asks: a question ends the run with exit 4)")
    p.set_defaults(run=cmd_run)

    p = sub.add_parser("hq", help="the interactive orchestration shell (also: plain `ferrus`)")
    p.add_argument("--resume", action="store_true", help="resume a task in flight without asking")
    p.add_argument("--no-tui", action="store_true", help="plain lines instead of curses")
    p.set_defaults(run=cmd_hq)

    add_pipeline_parser(sub)

    p = sub.add_parser("serve", help="the MCP server on stdio (started by agents)")
    p.add_argument("--role", choices=ROLES, help="expose only this role's tools")
    p.add_argument("--agent-name", default="unknown", help="agent name in the agent id")
    p.add_argument("--agent-index", type=int, default=0, help="index in the agent id")
    p.add_argument("--session", metavar="ID",
                   help="the agent session this server works for (default: $%s, set by HQ); "
                        "leases name it" % SESSION_ENV)
    p.set_defaults(run=cmd_serve)
    return parser


def setup_logging(debug=False):
    level_name = "debug" if debug else os.environ.get("FERRUS_LOG", "warning").lower()
    level = getattr(logging, level_name.upper(), logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ferrus: %(levelname)s: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


def find_project_root(start):
    """The nearest folder from ``start`` upwards that holds .ferrus/ or ferrus.toml (as git
    finds .git), so every command works from a subdirectory; ``start`` when none does."""
    folder = start
    while True:
        if (os.path.isdir(os.path.join(folder, FERRUS_DIR))
                or os.path.isfile(os.path.join(folder, CONFIG_FILE))):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return start
        folder = parent


def main(argv=None):
    """The command line: returns the exit code.  Ctrl+C at any point of it exits 130
    without a traceback (what it interrupted cleans up on the way out)."""
    if threading.current_thread() is threading.main_thread():
        starting = signal.getsignal(signal.SIGINT)
        if getattr(starting, "ferrus_startup", False):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if getattr(starting, "interrupted", False):
                return 130
    try:
        return _main(argv)
    except KeyboardInterrupt as interrupt:
        return getattr(interrupt, "exit_code", 130)


def _main(argv):
    parser = build_parser()
    CliParser.argv = tuple(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("FERRUS_DEBUG") == "1"
    setup_logging(debug)
    start = os.path.abspath(args.directory or os.getcwd())
    if args.directory is not None and not os.path.isdir(start):
        say("ferrus: -C %s: %s" % (args.directory, "not a directory" if os.path.exists(start)
                                   else "no such directory"), file=sys.stderr)
        say("hint: pass the project's folder, e.g. `ferrus -C path/to/project status`",
            file=sys.stderr)
        return 2
    # `init` creates a project right here; every other command finds the enclosing one.
    root = start if args.command == "init" else find_project_root(start)
    if not getattr(args, "run", None):
        if not os.path.isdir(os.path.join(root, FERRUS_DIR)):
            parser.print_help()
            return 0
        args.run, args.resume = cmd_hq, False

    try:
        return args.run(args, root)
    except FerrusError as err:
        if debug:
            raise
        say("ferrus: %s" % err.message, file=sys.stderr)
        if err.hint:
            say("hint: %s" % err.hint, file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as interrupt:
        return getattr(interrupt, "exit_code", 130)
    except BrokenPipeError:
        return 1
    except OSError as err:
        if debug:
            raise
        # A full disk or a read-only file: the atomic writes left the old state intact.
        where = " (%s)" % err.filename if err.filename else ""
        say("ferrus: %s%s" % (err.strerror or err, where), file=sys.stderr)
        # Never "nothing was changed": a command may fail after an earlier write landed.
        say("hint: each file in .ferrus/ is replaced whole, so it holds its old or its new "
            "content; free space or fix permissions, check with `ferrus status` and "
            "`ferrus doctor`, and try again", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
