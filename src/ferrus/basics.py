"""Basics: the version, errors, UTC time, JSON, terminal-safe text.

FerrusError carries a message and a hint (a CLI failure prints both); every text an
agent, a check or a file wrote passes terminal_safe before it reaches a terminal."""

import dataclasses
import datetime as _dt
import json
import logging
import os
import re
import sys
import threading


__version__ = "0.1.0"
# This very file (ferrus.py, once built): what MCP entries start and places get a copy of.
FERRUS_FILE = os.path.abspath(__file__)


log = logging.getLogger("ferrus")


# -- dataclasses made when first used ----------------------------------------------------
#
# Making a dataclass compiles its __init__, __repr__ and __eq__ from generated source:
# for the 45 of ferrus that was a third of the time `ferrus status` took, and a command
# uses only a few of them.  Started as a program, ferrus makes each one when it is first
# instantiated (or fields_of asks for its fields); imported as a module, api.py makes
# them all at once, so other programs see ordinary dataclasses.

_PENDING_DATACLASSES = {}          # class -> its @dataclass options, not yet applied
_DATACLASS_LOCK = threading.RLock()   # a class's pending bases are made inside


def deferred_dataclass(cls=None, **options):
    """``@dataclasses.dataclass`` (with the same options), applied to the class when it
    is first instantiated (or its fields are asked for with fields_of)."""
    def defer(cls):
        if cls in _PENDING_DATACLASSES:     # its first_init would call itself forever
            raise TypeError("%s is made a deferred dataclass twice" % cls.__name__)
        _PENDING_DATACLASSES[cls] = (options, cls.__dict__.get("__init__"))

        def first_init(self, *args, **kwargs):
            realize_dataclass(cls)
            cls.__init__(self, *args, **kwargs)
        cls.__init__ = first_init
        return cls
    return defer if cls is None else defer(cls)


def realize_dataclass(cls):
    """Apply the pending @dataclass of ``cls`` now (a no-op once done)."""
    with _DATACLASS_LOCK:
        pending = _PENDING_DATACLASSES.pop(cls, None)
        if pending is None:
            return cls
        for base in cls.__mro__[1:]:        # a dataclass takes its bases' fields
            if base in _PENDING_DATACLASSES:
                realize_dataclass(base)
        options, own_init = pending
        if own_init is None:
            del cls.__init__
        else:
            cls.__init__ = own_init
        return dataclasses.dataclass(cls, **options)


def realize_dataclasses():
    """Every pending dataclass made now (ferrus imported as a module)."""
    for cls in list(_PENDING_DATACLASSES):
        realize_dataclass(cls)


def fields_of(cls):
    """``dataclasses.fields`` of a class that may not have been made yet."""
    return dataclasses.fields(realize_dataclass(cls))


class LazyPattern:
    """A regular expression compiled the first time it is used: starting ferrus for one
    command must not pay for the patterns of every other command (an agent's MCP server
    starts once per session, so every compile at import is paid on each).

    Anything asked of it (``match``, ``sub``, ``pattern`` …) is the compiled pattern's,
    kept on the instance after the first time, so a pattern used in a loop costs what the
    compiled one does."""

    def __init__(self, pattern, flags=0):
        self._source = (pattern, flags)
        self._compiled = None

    def __getattr__(self, name):
        # Called only for what the instance does not have yet.
        if name.startswith("__"):
            raise AttributeError(name)
        compiled = self._compiled
        if compiled is None:
            compiled = self._compiled = re.compile(*self._source)
        value = getattr(compiled, name)
        self.__dict__[name] = value
        return value

    def __repr__(self):
        return "LazyPattern(%r)" % (self._source[0],)


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


_TIMESTAMP_RE = LazyPattern(
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
_TERMINAL_CONTROLS = LazyPattern("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


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
    import difflib
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None
