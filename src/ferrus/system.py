"""Platform: file locks, atomic writes, contained reads, process groups.

What differs between POSIX and Windows is kept here: flock vs msvcrt locking,
directory fsync, process-group spawn and tree kill, the shell used for checks,
whether a pid is alive and when it started."""

import collections
import contextlib
import errno
import os
import signal
import subprocess
import sys
import tempfile
import time

from .basics import FerrusError, log


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
            pause = min(pause * 2, 0.002)    # a freed lock is taken within 2 ms

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



try:
    import tomllib
except ImportError:  # Python 3.9 and 3.10: the built-in parser below takes over
    tomllib = None


class SqliteMissing(FerrusError):
    """This Python was built without its sqlite3 module (some minimal builds are)."""


def import_sqlite3(feature):
    """The sqlite3 module, imported where ``feature`` (project memory, the repository
    graph) needs it — kept off every command's start-up, and so that a Python built
    without it still runs every other command; SqliteMissing when it has none."""
    try:
        import sqlite3
    except ImportError as err:
        raise SqliteMissing(
            "%s needs Python's sqlite3 module, and this Python (%s) was built without it"
            % (feature, sys.executable or "python"),
            "run ferrus with a Python that has sqlite3 (on Debian/Ubuntu it is part of "
            "python3; a Python built from source needs the SQLite headers, e.g. "
            "libsqlite3-dev); every other ferrus command works without it") from err
    return sqlite3
