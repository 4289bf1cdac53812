"""The server host: agents' MCP servers forked from one loaded ferrus, per session.

Every agent session starts its own `ferrus serve` (the agent CLI runs the command its
MCP entry names), and starting one is loading ferrus and half the standard library:
most of the CPU a parallel task costs ferrus.  While ferrus runs agents (`ferrus run`,
HQ), it keeps one process that has loaded ferrus and listens on a private Unix
socket; the agents it starts get that socket's path in SERVER_HOST_ENV.  Their
`ferrus serve` then does almost nothing (startup.py: serve_through_host): it passes
its stdin, stdout and stderr with its command line, environment, folder and umask to
the host, which forks a copy of itself that runs the command there, and waits for
its exit status.  Anything that keeps the host from serving — no host, another
ferrus.py, a platform without fork and descriptor passing — leaves the server to
start as before.  Linux only (fork without exec elsewhere is not as safe); never for
a sandboxed agent (the socket is outside its sandbox, and the variable is unset)."""

import atexit
import contextlib
import marshal
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from .startup import (SERVER_HOST_ENV, SERVER_HOST_FOLDER, SERVER_HOST_OFF_ENV,
                      SERVER_HOST_PREFIX, ferrus_identity, peer_in_same_world,
                      private_folder)
from .basics import FERRUS_FILE, FerrusError, log, realize_dataclasses
from .agents import ferrus_boot_argv

SERVER_HOST_COMMAND = "serve-host"
# The largest description of a session a host reads (command line and environment), and
# how long a forked copy waits for it.
_MAX_SESSION_MESSAGE = 4 << 20
_SESSION_READ_SECS = 30.0


def server_host_possible():
    return (sys.platform.startswith("linux") and hasattr(socket, "send_fds")
            and hasattr(os, "fork") and os.environ.get(SERVER_HOST_OFF_ENV) != "1")


class ServerHost:
    """This process's server host, started when an agent is first launched and told
    to stop (by closing its stdin) when this process ends; it then serves the
    sessions it has until they end, and exits."""

    def __init__(self):
        self.process = None
        self.path = None
        self.unavailable = False
        self._lock = threading.Lock()

    def environment(self):
        """{SERVER_HOST_ENV: its socket} for an agent's launch — empty with no host, so
        that a socket this process inherited is not used either."""
        with self._lock:
            if self.process is None and not self.unavailable:
                self._start()
            if self.process is None or self.process.poll() is not None:
                return {SERVER_HOST_ENV: ""}
            return {SERVER_HOST_ENV: self.path}

    def _start(self):
        if not server_host_possible():
            self.unavailable = True
            return
        _remove_dead_hosts()
        try:
            folder = tempfile.mkdtemp(prefix=SERVER_HOST_PREFIX, dir=SERVER_HOST_FOLDER)
        except OSError as err:
            log.debug("no server host: %s", err)
            self.unavailable = True
            return
        path = os.path.join(folder, "host.sock")
        try:
            # Its own session: a Ctrl+C meant for ferrus's terminal does not end the
            # sessions it serves; ferrus ends it by closing its stdin.
            self.process = subprocess.Popen(
                ferrus_boot_argv() + [SERVER_HOST_COMMAND, path], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                start_new_session=True)
        except OSError as err:
            log.debug("no server host: %s", err)
            self.unavailable = True
            with contextlib.suppress(OSError):
                os.rmdir(folder)
            return
        self.path = path
        atexit.register(self.stop)

    def stop(self):
        """No new session is served; those being served go on to their end."""
        with self._lock:
            process, self.process = self.process, None
            self.unavailable = True
        if process is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()


SERVER_HOST = ServerHost()


# A host's folder without its socket for this long is one whose host died starting.
_HOST_START_SECS = 120.0


def _remove_dead_hosts(where=SERVER_HOST_FOLDER, clock=time.time):
    """The folders (in ``where``) of this user's hosts that were killed: their socket
    refuses every connection (or never came, long ago).  A folder whose host is
    starting (its socket not there yet) is left alone."""
    import glob
    for folder in glob.glob(os.path.join(glob.escape(where), SERVER_HOST_PREFIX + "*")):
        with contextlib.suppress(OSError):
            # Only a real folder of this user's, as a host makes it: never through a
            # link someone else put in /tmp under that name.
            if not private_folder(folder):
                continue
            status = os.lstat(folder)
            path = os.path.join(folder, "host.sock")
            if os.path.lexists(path):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(path)
                    continue                      # alive
                except ConnectionRefusedError:
                    pass
                finally:
                    probe.close()
            elif clock() - status.st_mtime < _HOST_START_SECS:
                continue
            for name in os.listdir(folder):
                os.unlink(os.path.join(folder, name))
            os.rmdir(folder)


def server_host_environment():
    """What an agent's launch adds so that its `ferrus serve` is served by the host."""
    return SERVER_HOST.environment()


def host_sessions(path, run_command, control=0):
    """`ferrus serve-host PATH`: listen on the Unix socket ``path`` and serve each
    session passed there (serve_through_host) in a forked copy of this process, which
    runs ``run_command(argv)``; stop listening once ``control`` (a descriptor, stdin)
    reaches its end, then wait for the sessions being served.  This process stays
    single-threaded, so every fork is a whole copy."""
    # The ferrus.py loaded here: a session of the file as it is later (edited, rebuilt)
    # is declined, and serves itself.
    identity = ferrus_identity(FERRUS_FILE)
    realize_dataclasses()          # once here, rather than in each session
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o177)
    try:
        # Listening before it has its name: another ferrus that finds the socket there
        # and is refused takes the host for dead (_remove_dead_hosts).
        listener.bind(path + ".new")
        listener.listen(64)
        os.rename(path + ".new", path)
    except OSError as err:
        raise FerrusError("serve-host cannot listen on %s: %s" % (path, err.strerror or err),
                          "ferrus starts its server host itself, with a socket in a new "
                          "private folder") from None
    finally:
        os.umask(mask)

    children = set()
    try:
        while True:
            ready, _, _ = select.select([listener, control], [], [], 1.0)
            _reap(children)
            if control in ready and not os.read(control, 512):
                break
            if listener in ready:
                with contextlib.suppress(OSError):
                    connection, _ = listener.accept()
                    if not peer_in_same_world(connection):
                        connection.close()     # (it then serves itself, where it is)
                        continue
                    pid = os.fork()
                    if pid == 0:
                        _serve_session(connection, listener, run_command, identity)
                    connection.close()
                    children.add(pid)
    finally:
        listener.close()
        for name in (path, path + ".new"):
            with contextlib.suppress(OSError):
                os.unlink(name)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))
    for pid in children:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    return 0


def _reap(children):
    for pid in list(children):
        try:
            done = os.waitpid(pid, os.WNOHANG)[0]
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


def _serve_session(connection, listener, run_command, identity):
    """In the forked copy: take over the session the connection describes, run its
    command, tell the waiting `ferrus serve` the exit status; never returns."""
    status = 1
    finished = threading.Event()
    try:
        listener.close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        connection.settimeout(_SESSION_READ_SECS)
        argv, env, cwd, mask, theirs = _read_session(connection)
        connection.settimeout(None)
        if theirs != identity:
            connection.sendall(b"N")       # another ferrus.py: it serves itself
            os._exit(0)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        os.umask(mask)
        sys.argv = ["-c"] + list(argv)
        connection.sendall(b"Y")
        # Its `ferrus serve` gone (the agent ended it, or was killed): end as a server
        # whose client sends SIGTERM does.
        threading.Thread(target=_end_with, args=(connection, finished), daemon=True,
                         name="session-link").start()
        status = run_command(list(argv))
        status = status if isinstance(status, int) else 1
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else 1
    except BaseException:       # noqa: B902 - the copy must end here, whatever happened
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        finished.set()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(OSError):
            connection.sendall(bytes([status & 0xFF]))
        os._exit(status & 0xFF)


def _read_session(connection):
    """(argv, environment, folder, umask, ferrus identity) of a session; its stdin,
    stdout and stderr become this process's."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    if len(fds) != 3 or len(data) < 4:
        raise OSError("a session came without its stdin, stdout and stderr")
    size = int.from_bytes(data[:4], "big")
    if size > _MAX_SESSION_MESSAGE:
        raise OSError("a session description of %d bytes" % size)
    data = data[4:]
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            raise OSError("the session's description ended early")
        data += more
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    return marshal.loads(data)


def _end_with(connection, finished):
    with contextlib.suppress(OSError):
        while connection.recv(64):
            pass
    if not finished.is_set():        # (done, the copy is on its way out anyway)
        os.kill(os.getpid(), signal.SIGTERM)
