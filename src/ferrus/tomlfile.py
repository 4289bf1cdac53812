"""TOML: reading, and edits that keep every comment.

Reading errors carry line and column.  Writing never re-serialises a file: one key
of one table is set, removed or a table replaced, every comment and blank line of
the user's ferrus.toml kept."""

import collections
import datetime as _dt
import re

from .basics import LazyPattern
from .system import tomllib


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


_TOML_TOMLLIB_WHERE = LazyPattern(r"\s*\(at (?:line (\d+), column \d+|end of document)\)$")


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
_TOML_WS = LazyPattern(r"[ \t]*")
_TOML_COMMENT = LazyPattern("#[^%s]*" % _TOML_CTRL)
_TOML_BARE_KEY = LazyPattern(r"[A-Za-z0-9_-]+")
_TOML_BASIC_CHUNK = LazyPattern('[^"\\\\%s]*' % _TOML_CTRL)
_TOML_ML_BASIC_CHUNK = LazyPattern('[^"\\\\%s]*' % _TOML_ML_CTRL)
_TOML_BAD_CHAR = LazyPattern("[%s]" % _TOML_CTRL)
_TOML_ML_BAD_CHAR = LazyPattern("[%s]" % _TOML_ML_CTRL)
_TOML_LINE_END_BACKSLASH = LazyPattern(r"[ \t]*\n[ \t\n]*")
_TOML_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}
_TOML_TIME = r"([01][0-9]|2[0-3]):([0-5][0-9]):([0-5][0-9])(?:\.([0-9]+))?"
_TOML_LOCAL_TIME = LazyPattern(_TOML_TIME)
_TOML_DATETIME = LazyPattern(
    r"([0-9]{4})-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r"(?:[Tt ]" + _TOML_TIME + r"(?:([Zz])|([+-])([01][0-9]|2[0-3]):([0-5][0-9]))?)?")
_TOML_NUMBER = LazyPattern(
    r"0x[0-9A-Fa-f](?:_?[0-9A-Fa-f])*|0o[0-7](?:_?[0-7])*|0b[01](?:_?[01])*"
    r"|[+-]?(?:0|[1-9](?:_?[0-9])*)"
    r"(?P<float>(?:\.[0-9](?:_?[0-9])*)?(?:[eE][+-]?[0-9](?:_?[0-9])*)?)")
_TOML_SPECIAL_FLOAT = LazyPattern(r"[+-]?(?:inf|nan)")
_TOML_WORD = LazyPattern(r"[^ \t\n,\]}#]*")


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

_TOML_QUOTE_NEEDED = LazyPattern('["\\\\\x00-\x1f\x7f]')
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
