"""Startup: what runs before any other import.

`python ferrus.py` puts the script's folder first on sys.path, and `python -m ferrus`
the current folder; a project root with its own queue.py or logging.py would shadow
the standard library, so that entry goes first.  Ctrl+C during the imports is noted
and acted on once main() runs; started as a program, the garbage collector waits
until every module is loaded, and an agent's MCP server that a server host can serve
(server_host.py) hands its stdin, stdout and stderr there and only waits.  In the
generated ferrus.py this part comes before the
standard library's imports."""

import gc
import marshal
import os
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


# Started as a program (`python ferrus.py`, `python -m ferrus`, the `ferrus` launcher,
# which marks its own __main__): ferrus may leave for later what the command never needs
# (see deferred_dataclass).  Imported by another program, everything is made up front.
STARTED_AS_PROGRAM = __name__ == "__main__" or bool(
    getattr(sys.modules.get("__main__"), "FERRUS_LAUNCHER", False))

# Loading ferrus makes some hundred thousand objects, none of them garbage, and the
# collector would walk them again and again as they pile up (4 ms of every start, and
# an agent's server starts once per session): it waits until api.py, the last module.
if STARTED_AS_PROGRAM:
    gc.disable()

# The variable that names a server host's socket to an agent's `ferrus serve`, and the
# one that turns server hosts off (FERRUS_NO_SERVER_HOST=1: every server serves itself).
SERVER_HOST_ENV = "FERRUS_SERVER_HOST"
SERVER_HOST_OFF_ENV = "FERRUS_NO_SERVER_HOST"
# How long a `ferrus serve` waits for a host to take its session before serving itself.
SERVER_HOST_HANDSHAKE_SECS = 10.0
# Where hosts keep their sockets, each in a folder of its own: /tmp whatever TMPDIR says,
# as a sandbox hides all of /tmp (a read-only mount does not stop a connect()).
SERVER_HOST_FOLDER = "/tmp"
SERVER_HOST_PREFIX = "ferrus-host-"


def command_word(argv):
    """The command ``argv`` names: its first word that is no option (``-C DIR`` skipped),
    or None (then the whole parser is built: help, an unknown word, HQ)."""
    words = list(argv)
    while words:
        word = words.pop(0)
        if word == "--":
            return words[0] if words else None
        if word == "-C":
            if words:
                words.pop(0)
            continue
        if word.startswith("-"):
            if word in ("-h", "--help", "--version"):
                return None
            continue
        return word
    return None


def ferrus_identity(path):
    """What tells one ferrus.py from another (or from itself before an edit)."""
    status = os.stat(path)
    return (os.path.realpath(path), status.st_size, status.st_mtime_ns)


def private_folder(path):
    """Whether ``path`` is a real folder (no link) of this user's that nobody else may
    enter: where a host's socket must be for a session to go there."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (info.st_mode & 0o170000) == 0o040000 and info.st_uid == os.getuid() and \
        not info.st_mode & 0o077


def peer_in_same_world(link):
    """Whether the process at the other end of the Unix socket ``link`` is this user's
    and sees the files this process sees (the same mount namespace): never a process in
    a sandbox, in either direction — the host would run a sandboxed agent's command
    outside its sandbox, and a listener a sandboxed agent put in the host's place would
    get a session's stdio and environment."""
    import socket
    import struct
    try:
        pid, uid, _ = struct.unpack("3i", link.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return uid == os.getuid() and pid > 0 and \
            os.readlink("/proc/%d/ns/mnt" % pid) == os.readlink("/proc/self/ns/mnt")
    except (OSError, AttributeError, struct.error):
        return False


def serve_through_host():
    """`ferrus serve` started with SERVER_HOST_ENV set: this process hands its stdin,
    stdout and stderr, command line, environment, folder and umask to the server host,
    whose copy of an already loaded ferrus serves the session, and exits with its exit
    status when it is done.  Returns (and the process goes on to serve itself) when
    there is no host to reach or the host runs another ferrus.py."""
    path = os.environ.get(SERVER_HOST_ENV)
    if not path or os.environ.get(SERVER_HOST_OFF_ENV) == "1" or \
            not sys.platform.startswith("linux") or command_word(sys.argv[1:]) != "serve" \
            or not private_folder(os.path.dirname(path)):
        return
    import socket
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link.settimeout(SERVER_HOST_HANDSHAKE_SECS)   # a host that never answers is none
    try:
        link.connect(path)
        if not peer_in_same_world(link):
            link.close()
            return
        mask = os.umask(0o022)
        os.umask(mask)
        payload = marshal.dumps((list(sys.argv[1:]), dict(os.environ), os.getcwd(), mask,
                                 ferrus_identity(__file__)))
        message = len(payload).to_bytes(4, "big") + payload
        sent = socket.send_fds(link, [message], [0, 1, 2])
        link.sendall(message[sent:])
        if link.recv(1) != b"Y":
            link.close()
            return
    except (OSError, ValueError, NameError):
        link.close()
        return
    link.settimeout(None)          # the session lasts as long as the agent wants it
    try:
        status = link.recv(1)
    except KeyboardInterrupt:
        os._exit(130)
    except OSError:
        status = b""
    os._exit(status[0] if status else 1)


if STARTED_AS_PROGRAM:
    serve_through_host()

_interrupted_while_starting.ferrus_startup = True
_interrupted_while_starting.interrupted = False

if __name__ == "__main__":
    import signal as _signal  # noqa: E402
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:   # not ignored
        _signal.signal(_signal.SIGINT, _interrupted_while_starting)
