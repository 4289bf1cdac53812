"""Startup: what runs before any other import.

`python ferrus.py` puts the script's folder first on sys.path, and `python -m ferrus`
the current folder; a project root with its own queue.py or logging.py would shadow
the standard library, so that entry goes first.  Ctrl+C during the imports is noted
and acted on once main() runs; started as a program, the garbage collector waits
until every module is loaded.  In the generated ferrus.py this part comes before the
standard library's imports."""

import gc
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

_interrupted_while_starting.ferrus_startup = True
_interrupted_while_starting.interrupted = False

if __name__ == "__main__":
    import signal as _signal  # noqa: E402
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:   # not ignored
        _signal.signal(_signal.SIGINT, _interrupted_while_starting)
