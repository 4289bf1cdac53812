"""The repository graph's reader: what a file defines, imports and calls.

Python is read with ``ast`` (modules, classes, functions, methods, top-level variables,
imports, call names; a file ast refuses falls back to lexical rules).  JavaScript and
TypeScript, Go, Rust, Java and C/C++ are read by documented lexical rules
(docs/MEMORY.md, "How each language is read"): one regular expression blanks comments and
string literals — each match runs from where it starts to where it ends, or to the end
of the file, so the scan stays linear on any input — then one regular expression per
kind of definition is tried at the start of each line, braces are counted for nesting,
and imports are read where only comments are blanked.  Definitions and imports, not
full parsing: what the rules miss is written down with them.  Nothing here touches the
disk or the database (graph.py does); every function takes text and gives facts, bounded
per file whatever the text holds.
"""

import bisect
import dataclasses
import os
import re

from .basics import LazyPattern, deferred_dataclass

# Definitions and calls are looked for in the first GRAPH_LINE_CHARS of a line only (a
# minified bundle is one line of megabytes).
GRAPH_LINE_CHARS = 2000
# What one file may contribute, whatever it holds.
GRAPH_FILE_SYMBOLS = 20_000
GRAPH_FILE_IMPORTS = 5_000
GRAPH_FILE_CALLS = 50_000
GRAPH_SIGNATURE_CHARS = 160

GRAPH_LANGUAGES = {
    ".py": "python", ".pyi": "python", ".pyw": "python",
    ".js": "javascript", ".jsx": "javascript", ".mjs": "javascript", ".cjs": "javascript",
    ".ts": "typescript", ".tsx": "typescript", ".mts": "typescript", ".cts": "typescript",
    ".go": "go", ".rs": "rust", ".java": "java",
    ".c": "c", ".h": "c",
    ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp", ".c++": "cpp", ".hh": "cpp", ".hpp": "cpp",
    ".hxx": "cpp", ".h++": "cpp", ".ipp": "cpp", ".inl": "cpp",
}


@deferred_dataclass
class GraphFacts:
    """What one file defines, imports and calls (lines are 1-based)."""

    symbols: list = dataclasses.field(default_factory=list)   # (name, qual, kind, line, end, sig)
    imports: list = dataclasses.field(default_factory=list)   # (line, spec, keys)
    calls: list = dataclasses.field(default_factory=list)     # (line, name, caller)
    module: str = ""
    note: str = ""


# -- reading a file ---------------------------------------------------------------------------

def graph_language(path):
    """The language a file is read as, by its extension ("" for the others)."""
    return GRAPH_LANGUAGES.get(os.path.splitext(path)[1].lower(), "")


def graph_decode(data):
    """(text with "\\n" line ends, note) of a file's bytes, or (None, why) for a binary
    one: UTF-8 (a BOM dropped), UTF-16 with a BOM, anything else as UTF-8 with the
    bytes that are not replaced (said in the note).  A NUL in the first 8 KiB makes a
    file binary, as git judges it."""
    note = ""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    elif data.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = data.decode("utf-16", errors="replace")
        return _graph_newlines(text), "UTF-16"
    if b"\0" in data[:8192]:
        return None, "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        note = "not UTF-8: undecodable bytes replaced"
    if "\0" in text:
        text = text.replace("\0", " ")
        note = (note + "; " if note else "") + "NUL bytes read as spaces"
    return _graph_newlines(text), note


def _graph_newlines(text):
    return text.replace("\r\n", "\n").replace("\r", "\n")


def graph_line_count(text):
    """The lines of ``text`` as editors count them: a final newline ends the last line,
    it does not start one (an empty file has none)."""
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def _graph_signature(line):
    line = line.strip()
    line = re.sub(r"[\x00-\x1f\x7f-\x9f]", " ", line)
    return line if len(line) <= GRAPH_SIGNATURE_CHARS else \
        line[:GRAPH_SIGNATURE_CHARS - 1] + "…"


def graph_module_name(path, lang):
    """The name other files import ``path`` by: a Python module's dotted path, a Go or
    Java file's folder ("" when there is none to speak of)."""
    if lang == "python":
        stem = path[:-len(os.path.splitext(path)[1])]
        parts = [part for part in stem.split("/") if part]
        if parts and parts[-1] == "__init__":
            parts.pop()
        return ".".join(parts)
    if lang in ("go", "java"):
        return path.rsplit("/", 1)[0] if "/" in path else ""
    return ""


def graph_extract(path, text, lang):
    """The GraphFacts of one file's text."""
    module = graph_module_name(path, lang)
    if lang == "python":
        facts = _graph_python(text, module, path.endswith("__init__.py"))
    elif lang in _GRAPH_LEXERS:
        facts = _GRAPH_LEXERS[lang](text)
    else:
        facts = GraphFacts()
    facts.module = module
    del facts.symbols[GRAPH_FILE_SYMBOLS:]
    del facts.imports[GRAPH_FILE_IMPORTS:]
    del facts.calls[GRAPH_FILE_CALLS:]
    return facts


# -- Python, through ast ----------------------------------------------------------------------

def _graph_python(text, module, is_package):
    import ast                 # kept off every command's start-up
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as err:
        facts = _graph_python_lexical(text, module, is_package)
        reason = err.msg if isinstance(err, SyntaxError) and err.msg else type(err).__name__
        facts.note = "not valid Python (%s%s): read by the lexical rules" % (
            reason[:80], " at line %s" % err.lineno
            if isinstance(err, SyntaxError) and err.lineno else "")
        return facts
    lines = text.split("\n")
    facts = GraphFacts()
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef)
    # An explicit stack, not recursion: a hostile file nests a hundred thousand deep.
    stack = [(node, (), None) for node in reversed(tree.body)]
    while stack:
        node, scope, caller = stack.pop()
        kind = type(node)
        if kind in definitions or kind is ast.ClassDef:
            in_class = bool(scope) and scope[-1][1] == "class"
            what = "class" if kind is ast.ClassDef else "method" if in_class else "function"
            qual = ".".join([name for name, _ in scope] + [node.name])
            facts.symbols.append((node.name, qual, what, node.lineno,
                                  getattr(node, "end_lineno", None),
                                  _graph_signature(lines[node.lineno - 1]
                                                   if node.lineno <= len(lines) else "")))
            inner = scope + ((node.name, "class" if kind is ast.ClassDef else "function"),)
            for child in ast.iter_child_nodes(node):
                in_body = child in node.body
                stack.append((child, inner if in_body else scope,
                               qual if in_body and kind is not ast.ClassDef else caller))
            continue
        if kind is ast.Import:
            for alias in node.names:
                facts.imports.append((node.lineno, alias.name, alias.name))
        elif kind is ast.ImportFrom:
            base = _graph_python_base(module, is_package, node.level, node.module)
            shown = "." * (node.level or 0) + (node.module or "")
            for alias in node.names:
                facts.imports.append((node.lineno, "%s:%s" % (shown, alias.name),
                                      _graph_python_keys(base, alias.name)))
        elif kind is ast.Call:
            func = node.func
            name = func.id if type(func) is ast.Name else \
                func.attr if type(func) is ast.Attribute else None
            if name:
                facts.calls.append((node.lineno, name, caller))
        elif not scope and kind in (ast.Assign, ast.AnnAssign):
            targets = node.targets if kind is ast.Assign else [node.target]
            for target in targets:
                if type(target) is ast.Name:
                    facts.symbols.append((target.id, target.id, "variable", node.lineno,
                                          getattr(node, "end_lineno", None),
                                          _graph_signature(lines[node.lineno - 1])))
        stack.extend((child, scope, caller) for child in ast.iter_child_nodes(node))
    return facts


def _graph_python_base(module, is_package, level, name):
    """The absolute module a ``from … import`` names, from the importing module's own
    dotted name: "" for the top of the tree, None when a relative import climbs above
    it."""
    if not level:
        return name or ""
    package = module.split(".") if module else []
    if not is_package:
        package = package[:-1]
    climb = level - 1
    if climb > len(package):
        return None
    package = package[:len(package) - climb]
    return ".".join(package + ([name] if name else []))


def _graph_python_keys(base, name):
    """The modules ``from base import name`` may mean, best first ("|"-separated): the
    submodule base.name, else base itself."""
    if base is None:
        return ""
    if name == "*":
        return base
    return "%s.%s|%s" % (base, name, base) if base else name


_GRAPH_PY_DEF = LazyPattern(r"^([ \t]*)(?:async[ \t]+)?(def|class)[ \t]+([A-Za-z_]\w*)")
_GRAPH_PY_IMPORT = LazyPattern(r"^[ \t]*import[ \t]+([\w.]+)")
_GRAPH_PY_FROM = LazyPattern(r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+\(?([\w*, \t]+)")
_GRAPH_PY_CALL = LazyPattern(r"([A-Za-z_]\w*)[ \t]*\(")


def _graph_python_lexical(text, module, is_package):
    """A Python file ast cannot read: ``def``/``class`` lines by indentation, imports
    and call names line by line."""
    facts = GraphFacts()
    scope = []                              # (indent, name, kind)
    for number, line in enumerate(text.split("\n"), 1):
        line = line[:GRAPH_LINE_CHARS]
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(stripped)
        while scope and scope[-1][0] >= indent:
            scope.pop()
        match = _GRAPH_PY_DEF.match(line)
        if match:
            in_class = bool(scope) and scope[-1][2] == "class"
            kind = "class" if match.group(2) == "class" else "method" if in_class else \
                "function"
            qual = ".".join([entry[1] for entry in scope] + [match.group(3)])
            facts.symbols.append((match.group(3), qual, kind, number, None,
                                  _graph_signature(line)))
            scope.append((indent, match.group(3), match.group(2)))
            continue
        match = _GRAPH_PY_IMPORT.match(line)
        if match:
            facts.imports.append((number, match.group(1), match.group(1)))
            continue
        match = _GRAPH_PY_FROM.match(line)
        if match:
            base = _graph_python_base(module, is_package, len(match.group(1)),
                                      match.group(2) or None)
            for name in re.findall(r"[\w*]+", match.group(3)):
                if name == "as":
                    break
                facts.imports.append((number, "%s%s:%s" % (match.group(1), match.group(2),
                                                           name),
                                      _graph_python_keys(base, name)))
            continue
        caller = next((".".join(e[1] for e in scope[:i + 1]) for i in
                       range(len(scope) - 1, -1, -1) if scope[i][2] == "def"), None)
        for call in _GRAPH_PY_CALL.finditer(line):
            if call.group(1) not in _GRAPH_PY_KEYWORDS:
                facts.calls.append((number, call.group(1), caller))
    return facts


_GRAPH_PY_KEYWORDS = frozenset(("if", "elif", "while", "for", "return", "and", "or", "not",
                                "in", "is", "with", "assert", "yield", "await", "lambda",
                                "print", "del", "except", "raise"))


# -- the lexical languages --------------------------------------------------------------------
#
# Each file is blanked twice by one regular expression per language that matches a
# comment or a string literal from where it starts to where it ends (or to the end of
# the file when it never ends, so the scan stays linear on any input): once with the
# comments made spaces (imports are read there, their paths being strings), once with
# the strings emptied too (definitions and calls are read there).  Newlines survive, so
# line numbers do.

_GRAPH_BLOCK_COMMENT = r"/\*(?:[^*]|\*(?!/))*(?:\*/|\Z)"
_GRAPH_LINE_COMMENT = r"//[^\n]*"
_GRAPH_DQ = r'"(?:\\.|[^"\\\n])*"?'
_GRAPH_SQ = r"'(?:\\.|[^'\\\n])*'?"
_GRAPH_BACKTICK = r"`(?:\\.|[^`\\])*`?"
_GRAPH_BLANKERS = {
    "javascript": LazyPattern("(?P<c>%s|%s)|(?P<s>%s|%s|%s)" % (
        _GRAPH_LINE_COMMENT, _GRAPH_BLOCK_COMMENT, _GRAPH_DQ, _GRAPH_SQ, _GRAPH_BACKTICK),
        re.S),
    "go": LazyPattern("(?P<c>%s|%s)|(?P<s>%s|%s|%s)" % (
        _GRAPH_LINE_COMMENT, _GRAPH_BLOCK_COMMENT, _GRAPH_DQ, _GRAPH_SQ, _GRAPH_BACKTICK),
        re.S),
    # Rust: raw strings, strings spanning lines, and char literals of one character or
    # escape — a lifetime ('a) starts none.
    "rust": LazyPattern(r"(?P<c>%s|%s)|(?P<s>b?r(#*)\".*?(?:\"\3|\Z)|b?\"(?:\\.|[^\"\\])*\"?"
                        r"|b?'(?:\\(?:u\{[0-9a-fA-F]{1,6}\}|x[0-9a-fA-F]{2}|.)|[^'\\\n])')" % (
                           _GRAPH_LINE_COMMENT, _GRAPH_BLOCK_COMMENT), re.S),
    "java": LazyPattern("(?P<c>%s|%s)|(?P<s>\"\"\"(?:[^\"\\\\]|\\\\.|\"(?!\"\"))*(?:\"\"\"|\\Z)"
                        "|%s|%s)" % (_GRAPH_LINE_COMMENT, _GRAPH_BLOCK_COMMENT, _GRAPH_DQ,
                                    _GRAPH_SQ), re.S),
    "c": LazyPattern("(?P<c>%s|%s)|(?P<s>%s|%s)" % (
        _GRAPH_LINE_COMMENT, _GRAPH_BLOCK_COMMENT, _GRAPH_DQ, _GRAPH_SQ), re.S),
}
_GRAPH_BLANKERS["typescript"] = _GRAPH_BLANKERS["javascript"]
_GRAPH_BLANKERS["cpp"] = _GRAPH_BLANKERS["c"]


def graph_blank(text, lang):
    """(text with comments blanked, text with comments and strings blanked)."""
    blanker = _GRAPH_BLANKERS[lang]

    def comments(match):
        found = match.group()
        if match.group("c") is None:
            return found
        return " " + "\n" * found.count("\n")

    def everything(match):
        found = match.group()
        return ('""' if match.group("s") is not None else " ") + "\n" * found.count("\n")
    return blanker.sub(comments, text), blanker.sub(everything, text)


class _GraphLines:
    """Line numbers of offsets into one text."""

    def __init__(self, text):
        self.starts = [0]
        find = text.find
        at = find("\n")
        while at >= 0:
            self.starts.append(at + 1)
            at = find("\n", at + 1)

    def number(self, offset):
        return bisect.bisect_right(self.starts, offset)


_GRAPH_CALL = LazyPattern(r"([A-Za-z_$][\w$]*)\s*\(")
_GRAPH_CONTAINERS = ("class", "struct", "interface", "trait", "enum", "impl", "module",
                     "union")
_GRAPH_CLASSLIKE = ("class", "struct", "interface", "trait", "impl", "enum", "union")


def _graph_scan(text, rules, keywords, statement_end=True, nested_functions=False):
    """Definitions and calls of a blanked C-family text.  ``rules``: (needle, regex, kind
    or callable(match, enclosing entry) -> (name, kind) | None[, False]) tried in order
    at the start of each line that holds the needle; a last element False marks a rule
    whose functions need no body.  Nesting follows the braces.  A function counts only
    when a ``{`` comes before a ``;`` after its name (``statement_end``), so declarations
    and calls written at the start of a line are not taken for definitions.  Definitions
    inside a function's body are left out, but for ``nested_functions`` (JavaScript's
    named inner functions)."""
    facts = GraphFacts()
    symbols = facts.symbols
    depth = 0
    open_ = []                  # [qual, kind, depth before its line, opened, line]
    starts, callers, own_names = [], [], {}
    caller = None               # the innermost function whose body is open
    offset = 0
    for number, full in enumerate(text.split("\n"), 1):
        starts.append(offset)
        callers.append(caller)
        changed = False
        line = full[:GRAPH_LINE_CHARS] if len(full) > GRAPH_LINE_CHARS else full
        if line and not line.isspace():
            defined = match = None
            inside = False           # not looked up yet
            for rule in rules:
                if rule[0] not in line:
                    continue
                match = rule[1].match(line)
                if not match:
                    continue
                if inside is False:
                    inside = next((entry for entry in reversed(open_) if entry[3]), None)
                kind = rule[2]
                found = kind(match, inside) if callable(kind) else (match.group(1), kind)
                if found is None:
                    continue
                if found[1] in ("function", "method") and statement_end and \
                        rule[3:] != (False,):
                    rest = text[offset + match.end():offset + match.end() + 4000]
                    brace, semicolon = rest.find("{"), rest.find(";")
                    if (brace < 0 or 0 <= semicolon < brace) and not (
                            inside is not None and inside[1] == "interface"):
                        continue
                defined = found
                break
            in_function = bool(inside) and inside[1] == "function"
            if defined and not (in_function and not (nested_functions and
                                                     defined[1] == "function")):
                name, what = defined
                if what == "function" and inside and inside[1] in _GRAPH_CLASSLIKE:
                    what = "method"
                if "." in name and what == "function":
                    what = "method"           # Foo::bar defined outside its class
                qual = "%s.%s" % (inside[0], name) if inside and (
                    inside[1] != "function" or what == "function") else name
                short = name.rsplit(".", 1)[-1]
                own_names[number] = short
                if what != "impl":
                    symbols.append((short, qual, what, number, None, _graph_signature(line)))
                after = full[match.end():]
                one_line = "{" in after and after.count("{") <= after.count("}")
                if (what in _GRAPH_CONTAINERS or what in ("function", "method")) and \
                        not one_line:
                    open_.append([qual, "function" if what in ("function", "method")
                                  else what, depth, False, number])
                    changed = True
        if "{" in full or "}" in full:
            depth += full.count("{") - full.count("}")
            if depth < 0:
                depth = 0
        while open_:
            entry = open_[-1]
            if entry[3]:
                if depth <= entry[2]:
                    open_.pop()           # its body ended on this line
                    changed = True
                    continue
                break
            if depth > entry[2]:
                entry[3] = True           # its body opened
                changed = True
                break
            if number > entry[4] and (number - entry[4] > 4 or ";" in line or "}" in line):
                open_.pop()               # a declaration, not a definition with a body
                changed = True
                continue
            break
        if changed:
            caller = next((entry[0] for entry in reversed(open_)
                           if entry[1] == "function" and entry[3]), None)
        offset += len(full) + 1
    calls = facts.calls
    for call in _GRAPH_CALL.finditer(text):
        at = call.start()
        number = bisect.bisect_right(starts, at)
        name = call.group(1)
        if name in keywords or at - starts[number - 1] >= GRAPH_LINE_CHARS or \
                own_names.get(number) == name:
            continue
        calls.append((number, name, callers[number - 1]))
    return facts


def _graph_imports(text, patterns, group=1):
    """(line, spec) of every match of ``patterns`` over the comment-blanked text."""
    lines = _GraphLines(text)
    found = []
    for regex in patterns:
        for match in regex.finditer(text):
            found.append((lines.number(match.start()), match.group(group).strip()))
    found.sort()
    return found


_GRAPH_JS_KEYWORDS = frozenset((
    "if", "for", "while", "switch", "catch", "return", "function", "typeof", "new", "await",
    "yield", "super", "import", "require", "delete", "void", "in", "of", "instanceof",
    "constructor", "do", "else", "case", "throw", "with", "async"))
_GRAPH_JS_ID = r"[A-Za-z_$][\w$]*"
_GRAPH_JS_RULES = [
    ("class", LazyPattern(r"^\s*(?:export\s+)?(?:default\s+)?(?:declare\s+)?(?:abstract\s+)?"
                          r"class\s+(%s)" % _GRAPH_JS_ID), "class"),
    ("function", LazyPattern(r"^\s*(?:export\s+)?(?:default\s+)?(?:declare\s+)?(?:async\s+)?"
                             r"function\b\s*\*?\s*(%s)" % _GRAPH_JS_ID), "function"),
    ("interface", LazyPattern(r"^\s*(?:export\s+)?(?:declare\s+)?interface\s+(%s)" % _GRAPH_JS_ID),
     "interface"),
    ("type", LazyPattern(r"^\s*(?:export\s+)?(?:declare\s+)?type\s+(%s)\s*(?:<[^>\n]{0,200}>)?\s*="
                % _GRAPH_JS_ID), "type"),
    ("enum", LazyPattern(r"^\s*(?:export\s+)?(?:declare\s+)?(?:const\s+)?enum\s+(%s)"
                         % _GRAPH_JS_ID), "enum"),
    ("{", LazyPattern(r"^\s*(?:export\s+)?(?:declare\s+)?(?:namespace|module)\s+(%s)\s*\{"
                % _GRAPH_JS_ID), "module"),
    ("=", LazyPattern(r"^\s*(?:export\s+)?(?:declare\s+)?(?:const|let|var)\s+(%s)\s*"
                r"(?::[^=\n]{0,200})?=\s*(?:async\s+)?"
                r"(?:function\b|\([^()\n]{0,300}\)\s*(?::[^=\n]{0,100})?=>|%s\s*=>)"
                % (_GRAPH_JS_ID, _GRAPH_JS_ID)),
     lambda match, inside: (match.group(1), "function") if inside is None or
     inside[1] != "function" else None, False),
    ("", LazyPattern(r"^(?:export\s+)?(?:const|let|var)\s+(%s)\b" % _GRAPH_JS_ID),
     lambda match, inside: (match.group(1), "variable") if inside is None else None),
    ("(", LazyPattern(r"^\s*(?:(?:public|private|protected|static|async|readonly|abstract|override|"
                r"get|set|declare)\s+)*\*?\s*(#?%s)\s*(?:<[^>\n]{0,200}>)?\s*\(" % _GRAPH_JS_ID),
     lambda match, inside: (match.group(1), "function")
     if inside is not None and inside[1] == "class"
     and match.group(1) not in _GRAPH_JS_KEYWORDS else None),
]
_GRAPH_JS_IMPORTS = [
    LazyPattern(r"\bimport\s+(?:type\s+)?(?:[\w*$\s{},]{0,2000}?\bfrom\s*)?([\"'])([^\"'\n]{1,500})"
                r"\1"),
    LazyPattern(r"\bexport\s+(?:type\s+)?(?:\*(?:\s+as\s+[\w$]+)?|\{[^}]{0,2000}\})\s*from\s*"
                r"([\"'])([^\"'\n]{1,500})\1"),
    LazyPattern(r"\brequire\s*\(\s*([\"'])([^\"'\n]{1,500})\1\s*\)"),
    LazyPattern(r"\bimport\s*\(\s*([\"'])([^\"'\n]{1,500})\1\s*\)"),
]


def _graph_javascript(text):
    commented, code = graph_blank(text, "javascript")
    facts = _graph_scan(code, _GRAPH_JS_RULES, _GRAPH_JS_KEYWORDS, nested_functions=True)
    facts.imports = [(line, spec, spec) for line, spec in
                     _graph_imports(commented, _GRAPH_JS_IMPORTS, group=2)]
    return facts


_GRAPH_GO_KEYWORDS = frozenset(("if", "for", "switch", "return", "func", "go", "defer",
                                "import", "const", "var",
                                "select", "case", "range", "make", "new", "len", "cap",
                                "append", "panic", "copy", "delete", "close", "type"))


def _graph_go_func(match, inside):
    receiver, name = match.group(1), match.group(2)
    if receiver:
        return "%s.%s" % (receiver.lstrip("*").split("[")[0], name), "method"
    return name, "function"


_GRAPH_GO_RULES = [
    ("func", LazyPattern(r"^func\s+(?:\(\s*(?:[A-Za-z_]\w*\s+)?\*?\s*([A-Za-z_][\w.]*)"
                         r"(?:\[[^\]\n]*\])?\s*\)\s*)?([A-Za-z_]\w*)"), _graph_go_func),
    ("type", LazyPattern(r"^type\s+([A-Za-z_]\w*)\s+(?:\[[^\]\n]*\]\s*)?struct\b"), "struct"),
    ("type", LazyPattern(r"^type\s+([A-Za-z_]\w*)\s+(?:\[[^\]\n]*\]\s*)?interface\b"), "interface"),
    ("type", LazyPattern(r"^type\s+([A-Za-z_]\w*)\b"), "type"),
    ("const", LazyPattern(r"^const\s+([A-Za-z_]\w*)"), "constant"),
    ("var", LazyPattern(r"^var\s+([A-Za-z_]\w*)"), "variable"),
]
_GRAPH_GO_GROUP = LazyPattern(r"^(const|var|type)\s*\(\s*$")
_GRAPH_GO_GROUP_ITEM = LazyPattern(r"^\s+([A-Za-z_]\w*)\b")
_GRAPH_GO_IMPORTS = [
    LazyPattern(r"^import\s+(?:[\w.]+\s+)?\"([^\"\n]{1,500})\"", re.M),
]
_GRAPH_GO_IMPORT_BLOCK = LazyPattern(r"^import\s*\(([^)]{0,20000})\)", re.M)
_GRAPH_GO_IMPORT_ITEM = LazyPattern(r"(?:^|\n)[ \t]*(?:[\w.]+[ \t]+)?\"([^\"\n]{1,500})\"")


def _graph_go(text):
    commented, code = graph_blank(text, "go")
    facts = _graph_scan(code, _GRAPH_GO_RULES, _GRAPH_GO_KEYWORDS, statement_end=False)
    # Grouped declarations: `const (`, `var (` and `type (` blocks, one name a line.
    group = None
    for number, line in enumerate(code.split("\n"), 1):
        line = line[:GRAPH_LINE_CHARS]
        if group is None:
            match = _GRAPH_GO_GROUP.match(line)
            group = match.group(1) if match else None
            continue
        if line.startswith(")"):
            group = None
            continue
        match = _GRAPH_GO_GROUP_ITEM.match(line)
        if match and line[:1] == "\t" and not line[1:2].isspace():
            facts.symbols.append((match.group(1), match.group(1),
                                  {"const": "constant", "var": "variable"}.get(group, "type"),
                                  number, None, _graph_signature(line)))
    imports = _graph_imports(commented, _GRAPH_GO_IMPORTS)
    lines = _GraphLines(commented)
    for block in _GRAPH_GO_IMPORT_BLOCK.finditer(commented):
        for item in _GRAPH_GO_IMPORT_ITEM.finditer(block.group(1)):
            imports.append((lines.number(block.start(1) + item.start(1)), item.group(1)))
    facts.imports = [(line, spec, spec) for line, spec in sorted(imports)]
    return facts


_GRAPH_RUST_KEYWORDS = frozenset(("if", "for", "while", "match", "return", "fn", "loop",
                                  "Some", "Ok", "Err", "Box", "Vec", "as", "in", "move",
                                  "unsafe", "where", "impl", "dyn", "pub"))
_GRAPH_RUST_VIS = r"(?:pub(?:\s*\([^)\n]{0,60}\))?\s+)?"
_GRAPH_RUST_RULES = [
    ("fn", LazyPattern(r"^\s*%s(?:default\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
                r"(?:extern\s+\"[^\"\n]*\"\s+)?fn\s+([A-Za-z_]\w*)" % _GRAPH_RUST_VIS), "function"),
    ("struct", LazyPattern(r"^\s*%sstruct\s+([A-Za-z_]\w*)" % _GRAPH_RUST_VIS), "struct"),
    ("enum", LazyPattern(r"^\s*%senum\s+([A-Za-z_]\w*)" % _GRAPH_RUST_VIS), "enum"),
    ("union", LazyPattern(r"^\s*%sunion\s+([A-Za-z_]\w*)" % _GRAPH_RUST_VIS), "union"),
    ("trait", LazyPattern(r"^\s*%s(?:unsafe\s+)?trait\s+([A-Za-z_]\w*)" % _GRAPH_RUST_VIS), "trait"),
    ("type", LazyPattern(r"^\s*%stype\s+([A-Za-z_]\w*)" % _GRAPH_RUST_VIS), "type"),
    ("mod", LazyPattern(r"^\s*%smod\s+([A-Za-z_]\w*)\s*\{" % _GRAPH_RUST_VIS), "module"),
    (":", LazyPattern(r"^\s*%s(?:const|static(?:\s+mut)?)\s+([A-Za-z_]\w*)\s*:" % _GRAPH_RUST_VIS),
     "constant"),
    ("macro_rules", LazyPattern(r"^\s*macro_rules!\s*([A-Za-z_]\w*)"), "macro"),
    ("impl", LazyPattern(r"^\s*(?:unsafe\s+)?impl\b(?:\s*<[^{\n]{0,300}?>)?\s+"
                         r"(?:[^{\n]{0,300}?\s+for\s+)?(?:[\w]+::)*([A-Za-z_]\w*)"), "impl"),
]
_GRAPH_RUST_USE = LazyPattern(r"^\s*%suse\s+([^;]{1,2000});" % _GRAPH_RUST_VIS, re.M)
_GRAPH_RUST_MOD = LazyPattern(r"^\s*%smod\s+([A-Za-z_]\w*)\s*;" % _GRAPH_RUST_VIS, re.M)
_GRAPH_RUST_CRATE = LazyPattern(r"^\s*extern\s+crate\s+([A-Za-z_]\w*)", re.M)


def graph_rust_use_paths(tree, limit=200):
    """The paths one ``use`` names: ``a::{b, c::{d, e}}`` gives a::b, a::c::d, a::c::e
    (at most ``limit``; a brace left open ends the list)."""
    tree = re.sub(r"\s+", "", tree)
    out = []

    def expand(prefix, rest, depth):
        if depth > 8:
            return
        items, level, start = [], 0, 0
        for index, char in enumerate(rest):
            if char == "{":
                level += 1
            elif char == "}":
                level -= 1
            elif char == "," and level == 0:
                items.append(rest[start:index])
                start = index + 1
        items.append(rest[start:])
        for item in items:
            if len(out) >= limit or not item:
                continue
            brace = item.find("{")
            if brace >= 0:
                expand(prefix + item[:brace], item[brace + 1:item.rfind("}")]
                       if item.rfind("}") > brace else item[brace + 1:], depth + 1)
            else:
                out.append(prefix + item)
    expand("", tree, 0)
    return [path.rstrip(":") for path in out if path.strip(":")]


def _graph_rust(text):
    commented, code = graph_blank(text, "rust")
    facts = _graph_scan(code, _GRAPH_RUST_RULES, _GRAPH_RUST_KEYWORDS)
    lines = _GraphLines(commented)
    imports = []
    for match in _GRAPH_RUST_USE.finditer(commented):
        number = lines.number(match.start(1))
        for path in graph_rust_use_paths(re.sub(r"\bas\s+\w+", "", match.group(1))):
            imports.append((number, path, "use:" + path))
    for match in _GRAPH_RUST_MOD.finditer(commented):
        imports.append((lines.number(match.start(1)), "mod " + match.group(1),
                        "mod:" + match.group(1)))
    for match in _GRAPH_RUST_CRATE.finditer(commented):
        imports.append((lines.number(match.start(1)), "extern crate " + match.group(1),
                        "crate:" + match.group(1)))
    facts.imports = sorted(imports)
    return facts


_GRAPH_JAVA_KEYWORDS = frozenset(("if", "for", "while", "switch", "catch", "return", "new",
                                  "throw", "synchronized", "super", "this", "else", "do",
                                  "try", "assert", "case"))
_GRAPH_JAVA_MODIFIERS = r"(?:(?:public|protected|private|abstract|static|final|sealed|" \
                        r"non-sealed|strictfp|synchronized|native|default|transient|" \
                        r"volatile)\s+|@[\w.]+(?:\([^)\n]{0,200}\))?\s+)*"


def _graph_java_method(match, inside):
    if inside is None or inside[1] not in ("class", "interface", "enum") or \
            match.group(1) in _GRAPH_JAVA_KEYWORDS:
        return None
    return match.group(1), "function"


_GRAPH_JAVA_RULES = [
    ("", LazyPattern(r"^\s*%s(?:class|record)\s+([A-Za-z_]\w*)" % _GRAPH_JAVA_MODIFIERS), "class"),
    ("interface", LazyPattern(r"^\s*%s@?interface\s+([A-Za-z_]\w*)" % _GRAPH_JAVA_MODIFIERS),
     "interface"),
    ("enum", LazyPattern(r"^\s*%senum\s+([A-Za-z_]\w*)" % _GRAPH_JAVA_MODIFIERS), "enum"),
    ("(", LazyPattern(r"^\s*%s(?:<[^>\n]{0,200}>\s+)?[\w.$]+(?:<[^;{}()\n]{0,200}>)?(?:\[\s*\])*\s+"
                r"([A-Za-z_$][\w$]*)\s*\(" % _GRAPH_JAVA_MODIFIERS), _graph_java_method),
    ("(", LazyPattern(r"^\s*%s([A-Z][\w$]*)\s*\(" % _GRAPH_JAVA_MODIFIERS),
     lambda match, inside: (match.group(1), "function")
     if inside is not None and inside[0].rsplit(".", 1)[-1] == match.group(1) else None),
]
_GRAPH_JAVA_IMPORTS = [LazyPattern(r"^\s*import\s+(?:static\s+)?([\w.]+(?:\.\*)?)\s*;", re.M)]


def _graph_java(text):
    commented, code = graph_blank(text, "java")
    facts = _graph_scan(code, _GRAPH_JAVA_RULES, _GRAPH_JAVA_KEYWORDS)
    facts.imports = [(line, spec, spec) for line, spec in
                     _graph_imports(commented, _GRAPH_JAVA_IMPORTS)]
    return facts


_GRAPH_C_KEYWORDS = frozenset((
    "if", "for", "while", "switch", "return", "sizeof", "alignof", "decltype", "catch",
    "static_assert", "defined", "typeof", "__attribute__", "__declspec", "else", "do",
    "case", "new", "delete", "throw", "operator", "template", "typename", "using"))


def _graph_c_function(match, inside):
    name = match.group(1)
    if name.rsplit("::", 1)[-1].lstrip("~") in _GRAPH_C_KEYWORDS:
        return None
    return name.replace("::", "."), "function"


_GRAPH_C_RULES = [
    ("#", LazyPattern(r"^\s*#\s*define\s+([A-Za-z_]\w*)"), "macro"),
    ("namespace", LazyPattern(r"^\s*namespace\s+([A-Za-z_][\w:]*)\s*\{"),
     lambda match, inside: (match.group(1).replace("::", "."), "module")),
    ("", LazyPattern(r"^\s*(?:typedef\s+)?(?:template\s*<[^>\n]{0,300}>\s*)?"
                r"(class|struct|union|enum)(?:\s+class)?\s+(?:\[\[[^\]\n]*\]\]\s*)?"
                r"(?:[A-Z_][A-Z0-9_]*\s+)?([A-Za-z_]\w*)\s*(?:final\s*)?(?::[^{;\n]{0,300})?"
                r"(?:\{|$)"),
     lambda match, inside: (match.group(2), match.group(1))),
    ("typedef", LazyPattern(r"^\s*typedef\b[^;\n]{0,300}?\b([A-Za-z_]\w*)\s*;"), "type"),
    ("(", LazyPattern(r"^(?!\s*#)\s*(?:[\w:*&<>,~\[\]]+\s+|[\w:<>,]+[*&]+\s*){0,8}"
                r"((?:[A-Za-z_]\w*::)*~?[A-Za-z_]\w*)\s*\("), _graph_c_function),
]
_GRAPH_C_INCLUDES = LazyPattern(r"^\s*#\s*include\s*([<\"])([^>\"\n]{1,300})[>\"]", re.M)


def _graph_c(text, lang="c"):
    commented, code = graph_blank(text, lang)
    facts = _graph_scan(code, _GRAPH_C_RULES, _GRAPH_C_KEYWORDS)
    # #include paths are strings: they are read where only comments are blanked.
    lines = _GraphLines(commented)
    facts.imports = [(lines.number(match.start(2)),
                      "%s%s%s" % (match.group(1), match.group(2),
                                  ">" if match.group(1) == "<" else '"'),
                      ("local:" if match.group(1) == '"' else "system:") + match.group(2))
                     for match in _GRAPH_C_INCLUDES.finditer(commented)]
    return facts


_GRAPH_LEXERS = {"javascript": _graph_javascript, "typescript": _graph_javascript,
                 "go": _graph_go, "rust": _graph_rust, "java": _graph_java,
                 "c": _graph_c, "cpp": lambda text: _graph_c(text, "cpp")}
