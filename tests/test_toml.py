"""Tests for the TOML section of ferrus: the parsers, the writers and the editors."""

import copy
import datetime
import math

import pytest

import ferrus

try:
    import tomllib
except ImportError:
    tomllib = None

needs_tomllib = pytest.mark.skipif(
    tomllib is None, reason="tomllib needs Python 3.11+; the expected-dict tests cover the built-in parser")

UTC = datetime.timezone.utc


def tz(hours, minutes=0):
    return datetime.timezone(datetime.timedelta(hours=hours, minutes=minutes))


def norm(value):
    """A strict comparable form: keeps types apart (1 vs 1.0 vs True), nan equal
    to nan, and datetimes with different offsets apart even at the same instant."""
    if isinstance(value, dict):
        return {key: norm(item) for key, item in value.items()}
    if isinstance(value, list):
        return [norm(item) for item in value]
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, (datetime.date, datetime.time)):
        return (type(value).__name__, value.isoformat())
    return (type(value).__name__, value)


FERRUS_TOML = """\
# ferrus configuration
[checks]
# Commands the executor's work must pass.
commands = [
  "ruff check .",   # lint
  "pytest -q",
]
parallel = false      # run the commands at the same time
timeout_secs = 600    # per command

[limits]
max_check_retries = 20 # consecutive check failures before Failed
max_review_cycles = 3
max_feedback_lines = 30
wait_timeout_secs = 60

[agents]
path = ".agents"

[agents.claude]
mcp_isolation = "merge-user"

[spec]
directory = "docs/specs"

[lease]
ttl_secs = 90
heartbeat_interval_secs = 30

[hq.supervisor]
agent = "claude-code" # claude-code | codex | qwen-code | gemini-cli
model = ""

[hq.executor]
agent = "codex"
model = ""
"""

FERRUS_DICT = {
    "checks": {"commands": ["ruff check .", "pytest -q"], "parallel": False, "timeout_secs": 600},
    "limits": {"max_check_retries": 20, "max_review_cycles": 3, "max_feedback_lines": 30,
               "wait_timeout_secs": 60},
    "agents": {"path": ".agents", "claude": {"mcp_isolation": "merge-user"}},
    "spec": {"directory": "docs/specs"},
    "lease": {"ttl_secs": 90, "heartbeat_interval_secs": 30},
    "hq": {"supervisor": {"agent": "claude-code", "model": ""},
           "executor": {"agent": "codex", "model": ""}},
}

CODEX_CONFIG = """\
model = "gpt-5-codex"
approval_policy = "on-request"  # untrusted | on-failure | on-request | never

[mcp_servers.ferrus-executor-1]
command = "python3"
args = ["/home/me/proj/ferrus.py", "mcp", "--role", "executor"]
startup_timeout_sec = 30

[mcp_servers.ferrus-executor-1.env]
FERRUS_AGENT_ID = "executor-1"

[mcp_servers.ferrus-executor-1.tools.check]
approval_mode = "approve"

# Someone else's server: must survive every ferrus edit.
[mcp_servers.filesystem]
command = "npx"
args = ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"]

[projects."/abs/path"]
trust_level = "trusted"
"""

CODEX_DICT = {
    "model": "gpt-5-codex",
    "approval_policy": "on-request",
    "mcp_servers": {
        "ferrus-executor-1": {
            "command": "python3",
            "args": ["/home/me/proj/ferrus.py", "mcp", "--role", "executor"],
            "startup_timeout_sec": 30,
            "env": {"FERRUS_AGENT_ID": "executor-1"},
            "tools": {"check": {"approval_mode": "approve"}},
        },
        "filesystem": {"command": "npx",
                       "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"]},
    },
    "projects": {"/abs/path": {"trust_level": "trusted"}},
}

# --- The built-in parser against tomllib -----------------------------------

VALID_CORPUS = {
    "ferrus-toml": FERRUS_TOML,
    "codex-config": CODEX_CONFIG,
    "empty": "",
    "only-comments": "# a\n  # b\n\n",
    "keys": "a = 1\n\"quoted key\" = 2\n'literal key' = 3\nb.c.d = 4\n\"\" = 5\n1234 = 6\n-_- = 7\n",
    "dotted-key-spaces": 'a . b . "c d" = 1\na.e = 2\n',
    "keys-like-values": "true = 1\nfalse = 2\ninf = 3\nnan = 4\n3.14159 = \"pi\"\n",
    "unicode-keys": '"ʎǝʞ" = "value"\n"\\u0041" = 1\nemoji = "😀"\n',
    "headers": '[a.b."c d"]\nx = 1\n[ a . e ]\ny = 2\n[a.""]\nz = 3\n',
    "implicit-then-explicit": "[x.y.z]\nw = 1\n[x]\nv = 2\n",
    "out-of-order": "[fruit.apple]\n[animal]\n[fruit.orange]\n",
    "dotted-tables": '[fruit]\napple.color = "red"\napple.taste.sweet = true\n'
                     "[fruit.apple.texture]\nsmooth = true\n",
    "root-dotted": 'name = "Orange"\nphysical.color = "orange"\nphysical.shape = "round"\n'
                   'site."google.com" = true\n',
    "array-of-tables": '[[products]]\nname = "Hammer"\n[[products]]\n\n[[products]]\n'
                       'name = "Nail"\ncolor = "gray"\n',
    "nested-array-of-tables": '[[fruits]]\nname = "apple"\n[fruits.physical]\ncolor = "red"\n'
                              '[[fruits.varieties]]\nname = "red delicious"\n'
                              '[[fruits.varieties]]\nname = "granny smith"\n'
                              '[[fruits]]\nname = "banana"\n[[fruits.varieties]]\nname = "plantain"\n',
    "aot-subtables": "[[a]]\n[a.b]\nc = 1\n[[a.d]]\ne = 1\n[[a.d]]\ne = 2\n[[a]]\n[a.b]\nc = 2\n",
    "basic-escapes": 's = "tab\\t nl\\n quote\\" backslash\\\\ \\u00e9 \\U0001F600 \\b\\f\\r end"\n',
    "literal-strings": "path = 'C:\\Users\\x'\nre = '<\\i\\c*\\s*>'\nq = 'Tom \"Dubs\" Preston'\n",
    "multiline-basic": 's1 = """\nRoses are red\nViolets are blue"""\n'
                       's2 = """\\\n    The quick brown \\\n    fox jumps over \\\n      the lazy dog.\\\n    """\n',
    "multiline-backslash-spaces": 's = """\\  \n   a \\  \n\n   b"""\n',
    "multiline-quotes": 's = """Here are two quotation marks: "". Simple."""\n'
                        't = """Here are fifteen: ""\\"""\\"""\\"""\\"""\\"."""\n'
                        'u = """"This," she said, "is just a pointless statement.""""\n',
    "multiline-literal": "re = '''I [dw]on't need \\d{2} apples'''\n"
                         "lines = '''\nThe first newline is\ntrimmed in raw strings.\n   All other whitespace\n"
                         "   is preserved.\n'''\nq = ''''That,' she said, 'is still pointless.''''\n",
    "hash-in-strings": "a = \"# not a comment\" # comment\nb = '#'\nc = \"\"\"#\n#\"\"\"\n",
    "tabs": "a = \"x\ty\" #\tc\nb = 'p\tq'\n",
    "integers": "a = +99\nb = 42\nc = 0\nd = -17\ne = 1_000\nf = 5_349_221\ng = 1_2_3_4_5\n"
                "h = 0xDEADBEEF\ni = 0xdead_beef\nj = 0o01234567\nk = 0o755\nl = 0b11010110\nm = -0\nn = +0\n",
    "big-integers": "big = 9223372036854775807\nsmall = -9223372036854775808\n",
    "floats": "a = +1.0\nb = 3.1415\nc = -0.01\nd = 5e+22\ne = 1e06\nf = -2E-2\ng = 6.626e-34\n"
              "h = 224_617.445_991_228\ni = -0.0\nj = +0.0\nk = 1e1_0\n",
    "special-floats": "a = inf\nb = +inf\nc = -inf\nd = nan\ne = +nan\nf = -nan\n",
    "booleans": "a = true\nb = false\nc = [true, false]\n",
    "offset-datetimes": "a = 1979-05-27T07:32:00Z\nb = 1979-05-27T00:32:00-07:00\n"
                        "c = 1979-05-27T00:32:00.999999-07:00\nd = 1979-05-27 07:32:00Z\n"
                        "e = 1979-05-27t07:32:00z\nf = 1979-05-27T07:32:00.1234567+05:30\n"
                        "g = 1979-05-27T07:32:00-00:00\n",
    "local-datetimes": "a = 1979-05-27T07:32:00\nb = 1979-05-27T00:32:00.5\n",
    "dates": "a = 1979-05-27\nb = 2024-02-29\nc = 1979-05-27 # just a date\n",
    "times": "a = 07:32:00\nb = 00:32:00.999999\nc = 23:59:59.1\n",
    "arrays": 'integers = [ 1, 2, 3 ]\ncolors = [ "red", "yellow", "green" ]\n'
              "nested = [ [ 1, 2 ], [3, 4, 5] ]\nmixed = [ [ 1, 2 ], [\"a\", \"b\"] ]\n"
              "strings = [ \"all\", 'strings', \"\"\"are the same\"\"\", '''type''' ]\n"
              "numbers = [ 0.1, 0.2, 0.5, 1, 2, 5 ]\nempty = []\nempty2 = [   ]\n",
    "mixed-arrays": 'a = [1, "two", 3.0, [4], { five = 5 }, 1979-05-27]\nb = [[{c = 1}], []]\n',
    "multiline-arrays": "a = [\n  1, # one\n  # a comment line\n  2,\n\n]\nb = [ # after bracket\n]\n"
                        "c = [\n  [ 1,\n 2 ],\n]\nd = [\n  { x = 1 },\n  { y = [\n 2 ] },\n]\n",
    "inline-tables": 'name = { first = "Tom", last = "Preston-Werner" }\npoint = { x = 1, y = 2 }\n'
                     'animal = { type.name = "pug" }\nempty = {}\n'
                     "nested = { a = { b = { c = 1 } }, d = [ { e = 1 } ], f.g = 1, f.h = 2 }\n",
    "inline-tables-in-arrays": "points = [ { x = 1, y = 2, z = 3 },\n           { x = 7, y = 8, z = 9 } ]\n",
    "whitespace": '\t  key\t=\t"v"\t# c\n  [  t  ]  # header comment\n\tx=1\nb= 2\nc =3\n',
    "crlf": 'a = 1\r\n[t]\r\nb = "x"\r\ns = """\r\nline\r\n"""\r\nl = [\r\n  1,\r\n]\r\n',
    "no-final-newline": "[t]\na = 1",
    "comment-no-final-newline": "a = 1 # end",
    "odd-comments": "# ¡unicode! \"quotes\" 'x' [brackets] = #\na = 1 ### more\n#[not.a.table]\n",
    "pyproject": '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
                 '[project]\nname = "ferrus"\nversion = "0.1.0"\nrequires-python = ">=3.9"\n'
                 'authors = [{ name = "A. Person", email = "a@example.com" }]\n'
                 'classifiers = [\n    "Programming Language :: Python :: 3",\n'
                 '    "License :: OSI Approved :: MIT License",\n]\n\n'
                 '[project.scripts]\nferrus = "ferrus:main"\n\n[tool.pytest.ini_options]\n'
                 'addopts = "-q"\n',
}


@needs_tomllib
@pytest.mark.parametrize("name", sorted(VALID_CORPUS))
def test_builtin_parser_agrees_with_tomllib(name):
    document = VALID_CORPUS[name]
    assert norm(ferrus.parse_toml_builtin(document)) == norm(tomllib.loads(document))


def test_corpus_is_large_enough():
    assert len(VALID_CORPUS) >= 40


# --- The built-in parser on its own (runs everywhere) -----------------------

EXPECTED = [
    (FERRUS_TOML, FERRUS_DICT),
    (CODEX_CONFIG, CODEX_DICT),
    ("", {}),
    ('a . b . "c d" = 1\n"" = 2\n', {"a": {"b": {"c d": 1}}, "": 2}),
    ("[x.y.z]\nw = 1\n[x]\nv = 2\n", {"x": {"y": {"z": {"w": 1}}, "v": 2}}),
    ('[[p]]\nn = "a"\n[p.q]\nr = 1\n[[p]]\n', {"p": [{"n": "a", "q": {"r": 1}}, {}]}),
    ('s = "t\\t\\"q\\" \\\\ \\u00e9 \\U0001F600"\n', {"s": 't\t"q" \\ é 😀'}),
    ("l = 'C:\\x'\nm = '''\nraw\\n'''\n", {"l": "C:\\x", "m": "raw\\n"}),
    ('s = """\nab\\\n    cd\n"e"\n"""\n', {"s": 'abcd\n"e"\n'}),
    ('q = """a""""\n', {"q": 'a"'}),
    ("i = [1_000, 0xff, 0o17, 0b101, -0, +5]\n", {"i": [1000, 255, 15, 5, 0, 5]}),
    ("f = [1.5, -2e3, 1_0.2_5, inf, -inf, -0.0]\n",
     {"f": [1.5, -2000.0, 10.25, math.inf, -math.inf, -0.0]}),
    ("d = 1979-05-27T07:32:00.1234567-07:30\n",
     {"d": datetime.datetime(1979, 5, 27, 7, 32, 0, 123456, tzinfo=tz(-7, -30))}),
    ("d = 1979-05-27 07:32:00Z\nl = 1979-05-27T07:32:00\nday = 1979-05-27\nt = 07:32:00.5\n",
     {"d": datetime.datetime(1979, 5, 27, 7, 32, tzinfo=UTC),
      "l": datetime.datetime(1979, 5, 27, 7, 32), "day": datetime.date(1979, 5, 27),
      "t": datetime.time(7, 32, 0, 500000)}),
    ("a = [\n  1, # one\n  # note\n  [2,\n 3],\n]\n", {"a": [1, [2, 3]]}),
    ("t = { a = 1, b.c = { d = true }, e = [] }\n", {"t": {"a": 1, "b": {"c": {"d": True}}, "e": []}}),
    ("a = 1\r\n[t]\r\ns = \"\"\"\r\nx\r\n\"\"\"", {"a": 1, "t": {"s": "x\n"}}),
]


@pytest.mark.parametrize("document, expected", EXPECTED, ids=[str(i) for i in range(len(EXPECTED))])
def test_builtin_parser_gives_expected_dicts(document, expected):
    assert norm(ferrus.parse_toml_builtin(document)) == norm(expected)
    assert norm(ferrus.parse_toml(document)) == norm(expected)


def test_builtin_parser_nan():
    value = ferrus.parse_toml_builtin("n = nan\nm = -nan\n")
    assert math.isnan(value["n"]) and math.isnan(value["m"])


# Each invalid document with the line the built-in parser names.  An
# unterminated string is reported where it starts (tomllib says where the
# document ran out); otherwise the two agree.
INVALID = [
    ("a = 1\nb = 2\na = 3\n", 3),                 # duplicate key
    ("[t]\nx = 1\n[t]\n", 3),                     # table declared twice
    ("[t]\nx.y = 1\n[t.x]\n", 3),                 # header for a dotted-key table
    ("[a.b]\n[a]\nb.c = 1\n", 3),                 # dotted key into a declared table
    ("a = {x = 1}\n[a]\n", 2),                    # header for an inline table
    ("a = {x = 1}\na.y = 2\n", 2),                # extending an inline table
    ("a = [1]\n[[a]]\n", 2),                      # appending to a static array
    ("[[a]]\n[a]\n", 2),                          # array of tables as a table
    ("a = 1\n[a.b]\n", 2),                        # a value as a table
    ("[[x]]\nfoo = 1\n[x.foo]\n", 3),
    ('a = "abc\nb = 1\n', 1),                     # unterminated strings
    ('a = 1\nb = """abc\n\nc = 1\n', 2),
    ("a = '''\nx\n", 1),
    ("a = 'x\n", 1),
    ("a = 1\nb = nope\n", 2),                     # bad values
    ("key = # no value\n", 1),
    ("x = 1\ny = 1979-02-30\n", 2),
    ("x = 01\n", 1),
    ("x = 1__0\n", 1),
    ("x = 1.\n", 1),
    ("x = +0x1\n", 1),
    ("x = true1\n", 1),
    ('a = "\\q"\n', 1),
    ('a = "\\uD800"\n', 1),
    ("a = [1, 2\nb = 3\n", 2),
    ("a = [1,,2]\n", 1),
    ("a = 1 b = 2\n", 1),                         # bad structure
    ("[t\nx = 1\n", 1),
    ("[[t]\n", 1),
    ("\n\n  = 1\n", 3),
    ("a = 1\n\x01\n", 2),
    ("a = 1 # bell \x07\n", 1),
]

# Invalid in TOML 1.0 but allowed by TOML 1.1, which a future tomllib may follow.
INVALID_BUILTIN_ONLY = [
    ("a = { b = 1,\n c = 2 }\n", 1),
    ("a = { b = 1, }\n", 1),
    ("t = 07:32\n", 1),
    ('s = "\\e"\n', 1),
]


def line_of(error):
    """The line number a TomlError's message starts with ("line 3: ...")."""
    head, _, detail = str(error).partition(": ")
    assert head.startswith("line ") and detail, str(error)
    return int(head[len("line "):])


@pytest.mark.parametrize("document, line", INVALID + INVALID_BUILTIN_ONLY,
                         ids=[str(i) for i in range(len(INVALID + INVALID_BUILTIN_ONLY))])
def test_builtin_parser_rejects_invalid_documents(document, line):
    with pytest.raises(ferrus.TomlError) as caught:
        ferrus.parse_toml_builtin(document)
    assert line_of(caught.value) == line


@pytest.mark.parametrize("document, line", INVALID, ids=[str(i) for i in range(len(INVALID))])
def test_parse_toml_rejects_invalid_documents(document, line):
    with pytest.raises(ferrus.TomlError) as caught:
        ferrus.parse_toml(document)
    assert isinstance(line_of(caught.value), int)
    assert isinstance(caught.value, ValueError)


def test_error_message_names_the_key():
    with pytest.raises(ferrus.TomlError) as caught:
        ferrus.parse_toml_builtin('[t]\na = 1\n\n\n\n\nfoo "bar"\n')
    assert str(caught.value) == 'line 7: expected \'=\' after key "foo"'


@needs_tomllib
def test_parse_toml_converts_tomllib_errors():
    with pytest.raises(ferrus.TomlError) as caught:
        ferrus.parse_toml("a = 1\n[t]\nb = \n")
    assert line_of(caught.value) == 3
    assert "(at line" not in str(caught.value)
    with pytest.raises(ferrus.TomlError) as caught:
        ferrus.parse_toml('a = 1\ns = """open\n')
    assert line_of(caught.value) == 3  # tomllib says "end of document"


def test_builtin_parser_wants_text():
    with pytest.raises(TypeError):
        ferrus.parse_toml_builtin(b"a = 1")


# --- Writing values -----------------------------------------------------------

@pytest.mark.parametrize("value, text", [
    ("plain", '"plain"'),
    ('say "hi" \\ bye', '"say \\"hi\\" \\\\ bye"'),
    ("tab\tnl\ncr\r\x01\x7f", '"tab\\tnl\\ncr\\r\\u0001\\u007f"'),
    ("héllo 😀", '"héllo 😀"'),
    (True, "true"),
    (False, "false"),
    (0, "0"),
    (-42, "-42"),
    (1.5, "1.5"),
    (1e300, "1e+300"),
    (float("inf"), "inf"),
    (float("-inf"), "-inf"),
    (float("nan"), "nan"),
    ([], "[]"),
    (["a", "b"], '["a", "b"]'),
    ([1, [2.5, True]], "[1, [2.5, true]]"),
    ({}, "{}"),
    ({"k": "v", "two words": 1}, '{ k = "v", "two words" = 1 }'),
    ({"t": {"n": [1]}}, "{ t = { n = [1] } }"),
])
def test_format_toml_value(value, text):
    assert ferrus.format_toml_value(value) == text


@pytest.mark.parametrize("value", [
    "", "quote\" back\\slash", "\x00\x1f\x7f\b\f", "ünï", 123, -0.0, 1e-7, 2.5e16, True,
    ["x", 1, [], {}], {"a b": {"c.d": ["e"]}, "": 1},
])
def test_format_toml_value_round_trips(value):
    assert norm(ferrus.parse_toml_builtin("v = %s\n" % ferrus.format_toml_value(value))["v"]) == norm(value)


@pytest.mark.parametrize("value", [None, object(), datetime.date(2024, 1, 1), {"a": None}, [b"x"], {1: 2}])
def test_format_toml_value_rejects_other_types(value):
    with pytest.raises(TypeError):
        ferrus.format_toml_value(value)


@pytest.mark.parametrize("key, text", [
    ("bare_key-1", "bare_key-1"),
    ("1234", "1234"),
    ("", '""'),
    ("with space", '"with space"'),
    ("/abs/path", '"/abs/path"'),
    ("a.b", '"a.b"'),
    ('q"uote', '"q\\"uote"'),
    ("ключ", '"ключ"'),
])
def test_format_toml_key(key, text):
    assert ferrus.format_toml_key(key) == text


# --- The line-preserving editors ----------------------------------------------


def assert_parses_to(text, expected):
    assert norm(ferrus.parse_toml_builtin(text)) == norm(expected)
    assert norm(ferrus.parse_toml(text)) == norm(expected)


def changed(base, path, value):
    """A deep copy of `base` with `value` at `path` (None removes it)."""
    result = copy.deepcopy(base)
    target = result
    for part in path[:-1]:
        target = target.setdefault(part, {})
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return result


def test_set_key_replaces_only_the_value():
    out = ferrus.toml_set_key(FERRUS_TOML, ("checks",), "parallel", True)
    assert out == FERRUS_TOML.replace(
        "parallel = false      # run", "parallel = true      # run")
    assert_parses_to(out, changed(FERRUS_DICT, ("checks", "parallel"), True))


def test_set_key_replaces_a_multiline_value_whole():
    out = ferrus.toml_set_key(FERRUS_TOML, ("checks",), "commands", ["make lint", "make test"])
    assert out == FERRUS_TOML.replace(
        'commands = [\n  "ruff check .",   # lint\n  "pytest -q",\n]\n',
        'commands = ["make lint", "make test"]\n')
    assert_parses_to(out, changed(FERRUS_DICT, ("checks", "commands"), ["make lint", "make test"]))


def test_set_key_keeps_indentation_and_spacing_before_the_value():
    text = "[t]\n  a   =   1   # one\n\tb=2\n"
    assert ferrus.toml_set_key(text, ("t",), "a", "x") == '[t]\n  a   =   "x"   # one\n\tb=2\n'
    assert ferrus.toml_set_key(text, ("t",), "b", [1]) == "[t]\n  a   =   1   # one\n\tb=[1]\n"


def test_set_key_matches_headers_by_parsed_parts():
    text = '[ hq . "supervisor" ]\n  agent = "x" # who\n'
    assert ferrus.toml_set_key(text, ("hq", "supervisor"), "agent", "codex") == \
        '[ hq . "supervisor" ]\n  agent = "codex" # who\n'
    assert ferrus.toml_set_key(text, ("hq", "supervisor"), "model", "m") == \
        '[ hq . "supervisor" ]\n  agent = "x" # who\n  model = "m"\n'


def test_set_key_inserts_after_the_last_key_of_its_table():
    out = ferrus.toml_set_key(FERRUS_TOML, ("limits",), "max_consults", 5)
    assert out == FERRUS_TOML.replace(
        "wait_timeout_secs = 60\n\n", "wait_timeout_secs = 60\nmax_consults = 5\n\n")
    assert_parses_to(out, changed(FERRUS_DICT, ("limits", "max_consults"), 5))


def test_set_key_inserts_before_comments_that_lead_into_the_next_table():
    text = "[a]\nx = 1\n# about b\n\n# more about b\n[b]\ny = 2\n"
    assert ferrus.toml_set_key(text, ("a",), "z", 3) == \
        "[a]\nx = 1\nz = 3\n# about b\n\n# more about b\n[b]\ny = 2\n"


def test_set_key_in_a_table_without_keys_goes_under_its_header():
    text = "[a]\n# nothing yet\n\n[b]\n"
    assert ferrus.toml_set_key(text, ("a",), "k", "v") == '[a]\nk = "v"\n# nothing yet\n\n[b]\n'


def test_set_key_in_the_root_table():
    assert ferrus.toml_set_key(FERRUS_TOML, (), "version", 1) == \
        "# ferrus configuration\nversion = 1\n" + FERRUS_TOML[len("# ferrus configuration\n"):]
    out = ferrus.toml_set_key(CODEX_CONFIG, (), "model", "o3")
    assert out == CODEX_CONFIG.replace('model = "gpt-5-codex"', 'model = "o3"')
    out = ferrus.toml_set_key(CODEX_CONFIG, (), "model_reasoning_effort", "high")
    assert out == CODEX_CONFIG.replace(
        "never\n", 'never\nmodel_reasoning_effort = "high"\n', 1)
    assert_parses_to(out, changed(CODEX_DICT, ("model_reasoning_effort",), "high"))


def test_set_key_appends_a_missing_table():
    out = ferrus.toml_set_key(FERRUS_TOML, ("projects", "/abs/path"), "trust_level", "trusted")
    assert out == FERRUS_TOML + '\n[projects."/abs/path"]\ntrust_level = "trusted"\n'
    assert_parses_to(out, changed(FERRUS_DICT, ("projects",), {"/abs/path": {"trust_level": "trusted"}}))


def test_set_key_appends_after_exactly_one_blank_line():
    assert ferrus.toml_set_key("a = 1", ("t",), "k", 1) == "a = 1\n\n[t]\nk = 1\n"
    assert ferrus.toml_set_key("a = 1\n\n", ("t",), "k", 1) == "a = 1\n\n[t]\nk = 1\n"
    assert ferrus.toml_set_key("", ("t",), "k", 1) == "[t]\nk = 1\n"
    assert ferrus.toml_set_key("", (), "k", 1) == "k = 1\n"


def test_set_key_defines_an_implicit_table():
    text = '[hq.supervisor]\nagent = "x"\n'
    out = ferrus.toml_set_key(text, ("hq",), "mode", "auto")
    assert out == text + '\n[hq]\nmode = "auto"\n'
    assert_parses_to(out, {"hq": {"supervisor": {"agent": "x"}, "mode": "auto"}})


def test_set_key_without_a_final_newline():
    assert ferrus.toml_set_key("[t]\na = 1", ("t",), "b", 2) == "[t]\na = 1\nb = 2\n"
    assert ferrus.toml_set_key("[t]", ("t",), "b", 2) == "[t]\nb = 2\n"
    assert ferrus.toml_set_key("[t]\na = 1", ("t",), "a", 2) == "[t]\na = 2"


def test_set_key_keeps_crlf_line_endings():
    text = "a = 1\r\n[t]\r\nx = 1 # c\r\n"
    assert ferrus.toml_set_key(text, ("t",), "x", 2) == "a = 1\r\n[t]\r\nx = 2 # c\r\n"
    assert ferrus.toml_set_key(text, ("t",), "y", 2) == "a = 1\r\n[t]\r\nx = 1 # c\r\ny = 2\r\n"
    assert ferrus.toml_set_key(text, ("u",), "y", 2) == text + "\r\n[u]\r\ny = 2\r\n"
    assert ferrus.toml_set_key("a = 1\r\nb = 2", (), "c", 3) == "a = 1\r\nb = 2\r\nc = 3\r\n"


def test_set_key_in_codex_config_sub_tables():
    out = ferrus.toml_set_key(CODEX_CONFIG, ("mcp_servers", "ferrus-executor-1", "tools", "check"),
                              "approval_mode", "prompt")
    assert out == CODEX_CONFIG.replace('approval_mode = "approve"', 'approval_mode = "prompt"')
    out = ferrus.toml_set_key(CODEX_CONFIG, ("projects", "/abs/path"), "trust_level", "untrusted")
    assert out == CODEX_CONFIG.replace('trust_level = "trusted"', 'trust_level = "untrusted"')
    out = ferrus.toml_set_key(CODEX_CONFIG, ("mcp_servers", "ferrus-executor-1"), "enabled", True)
    assert out == CODEX_CONFIG.replace("startup_timeout_sec = 30\n",
                                       "startup_timeout_sec = 30\nenabled = true\n")


@pytest.mark.parametrize("text, table, key, value", [
    (FERRUS_TOML, ("checks",), "parallel", True),
    (FERRUS_TOML, ("checks",), "commands", ["a", "b"]),
    (FERRUS_TOML, ("limits",), "new", 1),
    (FERRUS_TOML, ("hq", "reviewer"), "agent", "codex"),
    (FERRUS_TOML, (), "title", "x"),
    (CODEX_CONFIG, ("mcp_servers", "ferrus-executor-1", "env"), "FERRUS_ROOT", "/p"),
    ("a = 1", ("t",), "k", {"x": [1, 2]}),
    ("", (), "k", "v"),
])
def test_set_key_is_idempotent(text, table, key, value):
    once = ferrus.toml_set_key(text, table, key, value)
    assert ferrus.toml_set_key(once, table, key, value) == once
    assert ferrus.parse_toml_builtin(once) == changed(ferrus.parse_toml_builtin(text), table + (key,), value)


@pytest.mark.parametrize("text, table, key, line", [
    ('hq = { supervisor = { agent = "x" } }\n', ("hq", "supervisor"), "agent", 1),
    ('a = 1\nhq.supervisor.agent = "x"\n', ("hq", "supervisor"), "agent", 2),
    ('hq.supervisor.agent = "x"\n', ("hq",), "other", 1),          # [hq] made by dotted keys
    ('[hq]\nsupervisor.agent = "x"\n', ("hq",), "supervisor", 2),  # the key is a dotted table
    ('[hq]\nsupervisor = { agent = "x" }\n', ("hq", "supervisor"), "agent", 2),
    ('[hq.supervisor]\nagent = "x"\n', ("hq",), "supervisor", 1),  # the key is a table
    ('[[hq]]\nagent = "x"\n', ("hq",), "agent", 1),                 # arrays of tables
    ('[[hq]]\n[hq.sub]\n', ("hq", "sub"), "k", 1),
    ("x = 1\nt = 2\n", ("t",), "k", 2),                               # the table is a value
])
def test_set_key_refuses_what_it_cannot_edit(text, table, key, line):
    with pytest.raises(ferrus.TomlError) as caught:
        ferrus.toml_set_key(text, table, key, "v")
    assert line_of(caught.value) == line
    assert "cannot edit" in str(caught.value)
    with pytest.raises(ferrus.TomlError):
        ferrus.toml_remove_key(text, table, key)


def test_set_key_rejects_invalid_documents_and_values():
    with pytest.raises(ferrus.TomlError) as caught:
        ferrus.toml_set_key("a = 1\nb = \n", (), "c", 1)
    assert line_of(caught.value) == 2
    with pytest.raises(TypeError):
        ferrus.toml_set_key("a = 1\n", (), "b", None)


def test_remove_key():
    out = ferrus.toml_remove_key(FERRUS_TOML, ("checks",), "parallel")
    assert out == FERRUS_TOML.replace("parallel = false      # run the commands at the same time\n", "")
    assert_parses_to(out, changed(FERRUS_DICT, ("checks", "parallel"), None))
    out = ferrus.toml_remove_key(FERRUS_TOML, ("checks",), "commands")
    assert out == FERRUS_TOML.replace('commands = [\n  "ruff check .",   # lint\n  "pytest -q",\n]\n', "")
    assert_parses_to(out, changed(FERRUS_DICT, ("checks", "commands"), None))
    out = ferrus.toml_remove_key(FERRUS_TOML, ("hq", "executor"), "model")
    assert out == FERRUS_TOML[:-len('model = ""\n')]
    assert ferrus.toml_remove_key("a = 1\r\nb = 2", (), "b") == "a = 1\r\n"
    assert ferrus.toml_remove_key("a = 1\r\nb = 2\r\n", (), "a") == "b = 2\r\n"


def test_remove_key_when_absent_returns_the_text_unchanged():
    assert ferrus.toml_remove_key(FERRUS_TOML, ("checks",), "nope") == FERRUS_TOML
    assert ferrus.toml_remove_key(FERRUS_TOML, ("nope",), "parallel") == FERRUS_TOML
    assert ferrus.toml_remove_key("", (), "x") == ""


def test_replace_table_rewrites_the_table_and_its_sub_tables_in_place():
    out = ferrus.toml_replace_table(FERRUS_TOML, ("agents",), {"path": ".a", "codex": {"x": 1}})
    assert out == FERRUS_TOML.replace(
        '[agents]\npath = ".agents"\n\n[agents.claude]\nmcp_isolation = "merge-user"\n',
        '[agents]\npath = ".a"\n\n[agents.codex]\nx = 1\n')
    assert_parses_to(out, changed(FERRUS_DICT, ("agents",), {"path": ".a", "codex": {"x": 1}}))


def test_replace_table_without_plain_values_skips_the_parent_header():
    mapping = {"supervisor": {"agent": "codex", "model": "o3"}, "reviewer": {"agent": "claude-code"}}
    out = ferrus.toml_replace_table(FERRUS_TOML, ("hq",), mapping)
    head = FERRUS_TOML[:FERRUS_TOML.index("[hq.supervisor]")]
    assert out == head + ('[hq.supervisor]\nagent = "codex"\nmodel = "o3"\n\n'
                          '[hq.reviewer]\nagent = "claude-code"\n')
    assert_parses_to(out, changed(FERRUS_DICT, ("hq",), mapping))


def test_replace_table_gathers_scattered_sub_tables():
    text = "[a]\nx = 1\n\n# about b\n[b]\ny = 2\n\n[a.c]\nz = 3\n\n[d]\nw = 4\n"
    out = ferrus.toml_replace_table(text, ("a",), {"x": 9, "c": {"z": 8}})
    assert out == "[a]\nx = 9\n\n[a.c]\nz = 8\n\n# about b\n[b]\ny = 2\n\n[d]\nw = 4\n"
    assert_parses_to(out, {"a": {"x": 9, "c": {"z": 8}}, "b": {"y": 2}, "d": {"w": 4}})


def test_replace_table_in_codex_config():
    mapping = {"command": "python3", "args": ["ferrus.py", "mcp"],
               "env": {"FERRUS_AGENT_ID": "executor-1"},
               "tools": {"check": {"approval_mode": "approve"}, "submit": {"approval_mode": "approve"}}}
    out = ferrus.toml_replace_table(CODEX_CONFIG, ("mcp_servers", "ferrus-executor-1"), mapping)
    start = CODEX_CONFIG.index("[mcp_servers.ferrus-executor-1]")
    end = CODEX_CONFIG.index("# Someone else's")
    assert out == CODEX_CONFIG[:start] + (
        '[mcp_servers.ferrus-executor-1]\ncommand = "python3"\nargs = ["ferrus.py", "mcp"]\n\n'
        '[mcp_servers.ferrus-executor-1.env]\nFERRUS_AGENT_ID = "executor-1"\n\n'
        '[mcp_servers.ferrus-executor-1.tools.check]\napproval_mode = "approve"\n\n'
        '[mcp_servers.ferrus-executor-1.tools.submit]\napproval_mode = "approve"\n\n'
    ) + CODEX_CONFIG[end:]
    assert_parses_to(out, changed(CODEX_DICT, ("mcp_servers", "ferrus-executor-1"), mapping))
    # The same again changes nothing.
    assert ferrus.toml_replace_table(out, ("mcp_servers", "ferrus-executor-1"), mapping) == out


def test_replace_table_appends_a_missing_table():
    out = ferrus.toml_replace_table(CODEX_CONFIG, ("mcp_servers", "ferrus-executor-2"),
                                    {"command": "python3", "tools": {"check": {"approval_mode": "approve"}}})
    assert out == CODEX_CONFIG + (
        '\n[mcp_servers.ferrus-executor-2]\ncommand = "python3"\n\n'
        '[mcp_servers.ferrus-executor-2.tools.check]\napproval_mode = "approve"\n')
    assert ferrus.toml_replace_table("", ("t",), {}) == "[t]\n"


def test_replace_table_without_a_final_newline_and_with_crlf():
    assert ferrus.toml_replace_table("a = 1\r\n[t]\r\nx = 1", ("t",), {"y": 2}) == "a = 1\r\n[t]\r\ny = 2\r\n"


def test_replace_table_refuses_dotted_and_inline_definitions():
    with pytest.raises(ferrus.TomlError) as caught:
        ferrus.toml_replace_table("x = 1\nhq.supervisor.agent = 'x'\n", ("hq",), {})
    assert line_of(caught.value) == 2
    with pytest.raises(ferrus.TomlError):
        ferrus.toml_replace_table("[hq]\nsupervisor = {}\n", ("hq", "supervisor"), {})
    with pytest.raises(ferrus.TomlError):
        ferrus.toml_remove_table("[[hq]]\n[hq.supervisor]\n", ("hq", "supervisor"))
    with pytest.raises(TypeError):
        ferrus.toml_replace_table("", ("t",), {"k": None})
    with pytest.raises(ValueError):
        ferrus.toml_replace_table("", (), {})


def test_remove_table_in_the_middle():
    out = ferrus.toml_remove_table(FERRUS_TOML, ("agents",))
    assert out == FERRUS_TOML.replace(
        '\n[agents]\npath = ".agents"\n\n[agents.claude]\nmcp_isolation = "merge-user"\n', "")
    assert_parses_to(out, changed(FERRUS_DICT, ("agents",), None))


def test_remove_table_first_and_last():
    out = ferrus.toml_remove_table(FERRUS_TOML, ("checks",))
    assert out == "# ferrus configuration\n" + FERRUS_TOML[FERRUS_TOML.index("[limits]"):]
    out = ferrus.toml_remove_table(FERRUS_TOML, ("hq",))
    assert out == FERRUS_TOML[:FERRUS_TOML.index("\n[hq.supervisor]")]
    assert_parses_to(out, changed(FERRUS_DICT, ("hq",), None))
    assert ferrus.toml_remove_table("[t]\nx = 1", ("t",)) == ""


def test_remove_table_sub_table_only():
    out = ferrus.toml_remove_table(CODEX_CONFIG, ("mcp_servers", "ferrus-executor-1", "tools"))
    assert out == CODEX_CONFIG.replace(
        '\n[mcp_servers.ferrus-executor-1.tools.check]\napproval_mode = "approve"\n', "")
    expected = changed(CODEX_DICT, ("mcp_servers", "ferrus-executor-1", "tools"), None)
    assert_parses_to(out, expected)


def test_remove_table_when_absent_returns_the_text_unchanged():
    assert ferrus.toml_remove_table(FERRUS_TOML, ("nope",)) == FERRUS_TOML
    assert ferrus.toml_remove_table(FERRUS_TOML, ("hq", "reviewer")) == FERRUS_TOML
