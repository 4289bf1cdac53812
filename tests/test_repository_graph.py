"""The repository graph: a generated project of a few hundred files in seven languages,
with hostile ones among them (malformed code, deep nesting, a megabyte line, UTF-16 and
Latin-1, NUL bytes, an unterminated comment, symbolic links out of the tree, a git-ignored
folder), indexed and asked search, show and context questions whose answers are known;
incremental re-indexing, paging and bounds, a damaged database, a parallel task's overlay,
the walk without git, the command line and the MCP tools."""

import contextlib
import io
import json
import os
import shutil
import sqlite3

import pytest

import ferrus
import mcp_schema
from conftest import scripted_project
from mcp_client import InProcessMcp
from test_parallel_doctor import git, start_task

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

PER_LANGUAGE = 40


def source_files(count=PER_LANGUAGE):
    """{path: text} of the generated project, and {name: (path, line, kind)} of the
    definitions it is known to hold (the line found in the text itself)."""
    files, known = {}, {}

    def add(path, text, definitions):
        files[path] = text
        lines = text.split("\n")
        for name, marker, kind in definitions:
            line = next(n for n, content in enumerate(lines, 1) if marker in content)
            known[name] = (path, line, kind)

    for i in range(count):
        j = (i * 7 + 3) % count
        add("src/pyapp/mod_%d.py" % i, (
            '"""Module %(i)d."""\nimport os\nfrom pyapp.mod_%(j)d import py_func_%(j)d\n\n'
            'CONSTANT_%(i)d = %(i)d\n\n\nclass PyClass%(i)d:\n'
            '    def method_%(i)d(self, value):\n        return py_func_%(j)d(value)\n\n\n'
            'def py_func_%(i)d(value):\n    return os.path.join(str(value), "x")\n')
            % {"i": i, "j": j},
            [("CONSTANT_%d" % i, "CONSTANT_%d =" % i, "variable"),
             ("PyClass%d" % i, "class PyClass%d" % i, "class"),
             ("PyClass%d.method_%d" % (i, i), "def method_%d" % i, "method"),
             ("py_func_%d" % i, "def py_func_%d" % i, "function")])
        add("web/ts/mod_%d.ts" % i, (
            'import { tsFunc%(j)d } from "./mod_%(j)d";\n\n'
            'export interface TsShape%(i)d {\n  size: number;\n}\n\n'
            'export class TsClass%(i)d {\n  tsMethod%(i)d(value: number): number {\n'
            '    return tsFunc%(j)d(value);\n  }\n}\n\n'
            'export function tsFunc%(i)d(value: number): number {\n  return value + %(i)d;\n}\n\n'
            'export const tsArrow%(i)d = (value: number) => value * 2;\n') % {"i": i, "j": j},
            [("TsShape%d" % i, "interface TsShape%d" % i, "interface"),
             ("TsClass%d" % i, "class TsClass%d" % i, "class"),
             ("TsClass%d.tsMethod%d" % (i, i), "tsMethod%d(value" % i, "method"),
             ("tsFunc%d" % i, "function tsFunc%d" % i, "function"),
             ("tsArrow%d" % i, "tsArrow%d =" % i, "function")])
        add("web/js/mod_%d.js" % i, (
            'const { jsFunc%(j)d } = require("./mod_%(j)d");\n\n'
            'function jsFunc%(i)d(a) {\n  return a + 1;\n}\n\n'
            'class JsClass%(i)d {\n  jsMethod%(i)d() {\n    return jsFunc%(j)d(2);\n  }\n}\n\n'
            'module.exports = { jsFunc%(i)d, JsClass%(i)d };\n') % {"i": i, "j": j},
            [("jsFunc%d" % i, "function jsFunc%d" % i, "function"),
             ("JsClass%d" % i, "class JsClass%d" % i, "class"),
             ("JsClass%d.jsMethod%d" % (i, i), "jsMethod%d()" % i, "method")])
        add("go/pkg%d/mod_%d.go" % (i % 5, i), (
            'package pkg%(p)d\n\nimport (\n\t"fmt"\n\tother "example.com/proj/go/pkg%(q)d"\n)\n\n'
            'type GoStruct%(i)d struct {\n\tname string\n}\n\n'
            'func (g *GoStruct%(i)d) GoMethod%(i)d() int {\n\tfmt.Println(g.name)\n'
            '\treturn 1\n}\n\n'
            'func GoFunc%(i)d(x int) int {\n\treturn other.GoFunc%(j)d(x)\n}\n')
            % {"i": i, "j": j, "p": i % 5, "q": j % 5},
            [("GoStruct%d" % i, "type GoStruct%d" % i, "struct"),
             ("GoStruct%d.GoMethod%d" % (i, i), ") GoMethod%d()" % i, "method"),
             ("GoFunc%d" % i, "func GoFunc%d" % i, "function")])
        add("rust/src/mod_%d.rs" % i, (
            "use crate::mod_%(j)d::rs_func_%(j)d;\n\n"
            "pub struct RsStruct%(i)d {\n    size: i64,\n}\n\n"
            "impl RsStruct%(i)d {\n    pub fn rs_method_%(i)d(&self) -> i64 {\n"
            "        rs_func_%(j)d(self.size)\n    }\n}\n\n"
            "pub fn rs_func_%(i)d(x: i64) -> i64 {\n    let c = 'c';\n    x + 1\n}\n\n"
            "pub trait RsTrait%(i)d<'a> {\n    fn required(&'a self);\n}\n") % {"i": i, "j": j},
            [("RsStruct%d" % i, "pub struct RsStruct%d" % i, "struct"),
             ("RsStruct%d.rs_method_%d" % (i, i), "fn rs_method_%d" % i, "method"),
             ("rs_func_%d" % i, "pub fn rs_func_%d" % i, "function"),
             ("RsTrait%d" % i, "trait RsTrait%d" % i, "trait")])
        add("java/src/com/example/Mod%d.java" % i, (
            "package com.example;\n\nimport com.example.Mod%(j)d;\n\n"
            "public class Mod%(i)d {\n    private final int size = %(i)d;\n\n"
            "    public Mod%(i)d() {\n    }\n\n"
            "    public static int javaMethod%(i)d(int value) {\n"
            "        return Mod%(j)d.javaMethod%(j)d(value);\n    }\n}\n") % {"i": i, "j": j},
            [("Mod%d" % i, "public class Mod%d" % i, "class"),
             ("Mod%d.javaMethod%d" % (i, i), "int javaMethod%d(" % i, "method")])
        add("c/mod_%d.c" % i, (
            '#include "mod_%(j)d.h"\n#include <stdio.h>\n\n#define C_MACRO_%(i)d %(i)d\n\n'
            "struct CStruct%(i)d {\n    int size;\n};\n\n"
            "static int c_helper_%(i)d(int v)\n{\n    return v;\n}\n\n"
            "int c_func_%(i)d(int v) {\n    return c_func_%(j)d(c_helper_%(i)d(v));\n}\n")
            % {"i": i, "j": j},
            [("C_MACRO_%d" % i, "#define C_MACRO_%d" % i, "macro"),
             ("CStruct%d" % i, "struct CStruct%d" % i, "struct"),
             ("c_helper_%d" % i, "int c_helper_%d(" % i, "function"),
             ("c_func_%d" % i, "int c_func_%d(" % i, "function")])
        files["c/mod_%d.h" % i] = "int c_func_%d(int v);\n" % i
        add("cpp/mod_%d.cpp" % i, (
            '#include "../c/mod_%(i)d.h"\n\nnamespace proj {\n\n'
            "class CppClass%(i)d : public Base {\n public:\n"
            "  int cppMethod%(i)d() const { return 1; }\n  void later%(i)d(int v);\n};\n\n"
            "void CppClass%(i)d::later%(i)d(int v) {\n  c_func_%(i)d(v);\n}\n\n}  // namespace\n")
            % {"i": i},
            [("proj.CppClass%d" % i, "class CppClass%d" % i, "class"),
             ("proj.CppClass%d.cppMethod%d" % (i, i), "int cppMethod%d()" % i, "method"),
             ("proj.CppClass%d.later%d" % (i, i), "::later%d(int v) {" % i, "method")])
    return files, known


def hostile_files(outside):
    """{path: bytes} of the files meant to hurt the indexer."""
    deep = "x = " + "(" * 1000 + "1" + ")" * 1000 + "\n\ndef after_nesting():\n    pass\n"
    minified = "function visibleAtStart(){return 1}" + ";var a=1" * 40000 + \
        ";function hiddenFarAway(){return 2}\n"
    return {
        "src/pyapp/broken.py": b"def broken(:\n    pass\n\n\nclass StillFound:\n"
                               b"    def survives(self):\n        pass\n",
        "src/pyapp/nested.py": deep.encode(),
        "src/pyapp/utf16.py": "def utf16_function():\n    return 'ü'\n".encode("utf-16"),
        "src/pyapp/late_nul.py": b"def before_nul():\n    pass\n" + b"#" * 9000 +
                                 b"\0\n\ndef after_nul():\n    pass\n",
        "java/src/com/example/Latin.java": b"// caf\xe9 cr\xe8me\npublic class LatinClass {\n}\n",
        "go/bom.go": b"\xef\xbb\xbfpackage bom\n\nfunc BomFunc() int {\n\treturn 1\n}\n",
        "c/binary.c": b"int x;\0\0\0\xff\xfe",
        "web/js/minified.js": minified.encode(),
        "web/js/huge.js": b"// " + b"x" * (ferrus.GRAPH_MAX_FILE_BYTES + 10) + b"\n",
        "c/unterminated.c": b"/* never closed\n" +
                            b"int hidden_in_comment(void) { return 0; }\n" * 2000,
        "c/backtrack.c": b"a " * 200000 + b"\nint after_backtrack(void) { return 1; }\n",
        "ignored_dir/hidden.py": b"def ignored_function():\n    pass\n",
        ".gitignore": b".ferrus/\nignored_dir/\n",
    }


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """The generated project, committed to git and indexed once: (store, known, report)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    base = tmp_path_factory.mktemp("graph")
    root = base / "project"
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret.py").write_text("def secret_outside():\n    pass\n")
    (outside / "deeper").mkdir()
    (outside / "deeper" / "also.py").write_text("def also_outside():\n    pass\n")
    root.mkdir()
    files, known = source_files()
    for path, content in list(files.items()) + list(hostile_files(outside).items()):
        full = root / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(content if isinstance(content, bytes) else content.encode())
    os.symlink(str(outside / "secret.py"), str(root / "evil.py"))
    os.symlink(str(outside / "deeper"), str(root / "linked_dir"))
    os.symlink("mod_0.py", str(root / "src" / "pyapp" / "inside_link.py"))
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda message: None)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "generated")
    (root / "src" / "pyapp" / "untracked.py").write_text("def untracked_function():\n    pass\n")
    store = ferrus.Store(str(root))
    report = ferrus.graph_index(store)
    return store, known, report


def search(store, query, **options):
    with ferrus.graph_open(store, refresh=False) as view:
        return ferrus.graph_search(view, query, **options)[0]


# -- what is found ------------------------------------------------------------------------------

def test_every_known_definition_is_found_at_its_line(indexed):
    store, known, _ = indexed
    missing = []
    with ferrus.graph_open(store, refresh=False) as view:
        for qualname, (path, line, kind) in known.items():
            hits, _ = ferrus.graph_search(view, qualname, limit=5)
            if not any((hit["path"], hit["line"], hit["kind"], hit["qualname"]) ==
                       (path, line, kind, qualname) for hit in hits):
                missing.append((qualname, path, line, kind, hits[:2]))
    assert not missing, missing[:5]
    assert len(known) >= 7 * PER_LANGUAGE * 3


def test_a_name_ranks_its_exact_definition_first(indexed):
    store, known, _ = indexed
    for name in ("py_func_7", "tsFunc7", "GoFunc7", "rs_func_7", "c_func_7", "jsFunc7"):
        first = search(store, name)[0]
        assert (first["path"], first["line"]) == known[name][:2]
        assert first["match"] == "exact" and first["location"] == "%s:%d" % known[name][:2]
    # c_func_7 is declared in mod_7.h too, but only the definition with a body counts
    assert [hit["path"] for hit in search(store, "c_func_7") if hit["name"] == "c_func_7"] \
        == ["c/mod_7.c"]


def test_qualified_names_words_prefixes_and_paths(indexed):
    store, known, _ = indexed
    # Rust's and C++'s own spelling of a qualified name
    assert search(store, "RsStruct3::rs_method_3")[0]["location"] == \
        "%s:%d" % known["RsStruct3.rs_method_3"][:2]
    assert search(store, "CppClass4::later4")[0]["qualname"] == "proj.CppClass4.later4"
    worded = search(store, "go method 12")
    assert worded and worded[0]["qualname"] == "GoStruct12.GoMethod12"
    prefixed = search(store, "PyClass1", kind="class", limit=50)
    assert {hit["name"] for hit in prefixed} >= {"PyClass1", "PyClass10", "PyClass19"}
    assert all(hit["kind"] == "class" for hit in prefixed)
    in_folder = search(store, "GoFunc", path="go/pkg2", limit=100)
    assert len(in_folder) == PER_LANGUAGE // 5 and all(
        hit["path"].startswith("go/pkg2/") for hit in in_folder)
    by_path = search(store, "rust/src/mod_5.rs")
    assert by_path[0]["kind"] == "file" and by_path[0]["path"] == "rust/src/mod_5.rs"


def test_context_names_what_a_file_imports_who_imports_it_and_who_calls_its_names(indexed):
    store, known, _ = indexed
    # mod_i imports mod_j with j = (7i + 3) % 40: mod_5 is imported by mod_6 and mod_26
    importers = {i for i in range(PER_LANGUAGE) if (i * 7 + 3) % PER_LANGUAGE == 5}
    outcome = ferrus.op_graph_context(store, ferrus.HUMAN, "src/pyapp/mod_5.py", limit=100)
    items = outcome.data["items"]
    by = {relation: [item for item in items if item.get("relation", "defines") == relation]
          for relation in ("defines", "imports", "imported_by", "called_from")}
    assert {item["qualname"] for item in by["defines"]} == {
        "CONSTANT_5", "PyClass5", "PyClass5.method_5", "py_func_5"}
    assert {item["target"] for item in by["imports"]} == {"src/pyapp/mod_38.py", None}
    assert {item["path"] for item in by["imported_by"]} == {
        "src/pyapp/mod_%d.py" % i for i in importers}
    callers = {(item["path"], item["caller"]) for item in by["called_from"]}
    assert {("src/pyapp/mod_%d.py" % i, "PyClass%d.method_%d" % (i, i))
            for i in importers} <= callers
    assert "Imported by:" in outcome.text and "src/pyapp/mod_6.py:3" in outcome.text
    # the other languages' imports resolve to files (Go: to the package's folder)
    for path, target in (("web/ts/mod_5.ts", "web/ts/mod_38.ts"),
                         ("web/js/mod_5.js", "web/js/mod_38.js"),
                         ("rust/src/mod_5.rs", "rust/src/mod_38.rs"),
                         ("java/src/com/example/Mod5.java", "java/src/com/example/Mod38.java"),
                         ("c/mod_5.c", "c/mod_38.h"), ("go/pkg0/mod_5.go", "go/pkg3/")):
        with ferrus.graph_open(store, refresh=False) as view:
            assert target in {item["target"] for item in ferrus.graph_imports_of(view, path)}, \
                path
    go_users = ferrus.op_graph_context(store, ferrus.HUMAN, "go/pkg3/mod_8.go", limit=100)
    assert any(item.get("relation") == "imported_by" for item in go_users.data["items"])
    symbol = ferrus.op_graph_context(store, ferrus.HUMAN, "rs_func_38").data["items"]
    assert {(item["path"], item.get("caller")) for item in symbol
            if item.get("relation") == "called_from"} >= {
        ("rust/src/mod_5.rs", "RsStruct5.rs_method_5")}


def test_show_gives_a_files_outline_and_a_definitions_source(indexed):
    store, known, _ = indexed
    outline = ferrus.op_graph_show(store, ferrus.HUMAN, "web/ts/mod_3.ts")
    assert [item["qualname"] for item in outline.data["items"] if "relation" not in item] == [
        "TsShape3", "TsClass3", "TsClass3.tsMethod3", "tsFunc3", "tsArrow3"]
    assert outline.data["file"]["lang"] == "typescript"
    definition = ferrus.op_graph_show(store, ferrus.HUMAN, "src/pyapp/mod_3.py:PyClass3.method_3")
    path, line, _ = known["PyClass3.method_3"]
    assert definition.data["excerpt"].splitlines()[0].split()[0] == str(line)
    assert "return py_func_24(value)" in definition.data["excerpt"]
    assert [item["name"] for item in definition.data["items"]
            if item.get("relation") == "calls"] == ["py_func_24"]
    with pytest.raises(ferrus.FerrusError, match="defines no nothing_here"):
        ferrus.op_graph_show(store, ferrus.HUMAN, "src/pyapp/mod_3.py:nothing_here")
    with pytest.raises(ferrus.FerrusError, match="no file or definition is named"):
        ferrus.op_graph_context(store, ferrus.HUMAN, "NoSuchThingAnywhere")


# -- hostile contents -----------------------------------------------------------------------

def test_hostile_files_are_listed_with_why_and_never_break_the_index(indexed):
    store, _, report = indexed
    with ferrus.graph_open(store, refresh=False) as view:
        status = {path: row for path, *row in view.rows(
            "SELECT path, status, note FROM g_files")}
    assert status["c/binary.c"][0] == "binary"
    assert status["web/js/huge.js"][0] == "huge"
    assert status["evil.py"][0] == "outside" and status["linked_dir"][0] == "outside"
    assert status["src/pyapp/inside_link.py"][0] == "link"
    assert "UTF-16" in status["src/pyapp/utf16.py"][1]
    assert "not UTF-8" in status["java/src/com/example/Latin.java"][1]
    assert "not valid Python" in status["src/pyapp/broken.py"][1]
    assert not any(path.startswith("ignored_dir/") or path.startswith(".ferrus/")
                   for path in status)
    assert report.skipped["binary"] == 1 and report.skipped["huge"] == 1
    for name in ("StillFound", "StillFound.survives", "after_nesting", "utf16_function",
                 "before_nul", "after_nul", "LatinClass", "BomFunc", "visibleAtStart",
                 "after_backtrack", "untracked_function"):
        assert search(store, name) and search(store, name)[0]["qualname"] == name, name
    for name in ("secret_outside", "also_outside", "ignored_function", "hiddenFarAway",
                 "hidden_in_comment"):
        assert not [hit for hit in search(store, name) if hit["name"] == name], name


def test_every_answer_is_bounded_and_paged(indexed, monkeypatch):
    store, _, _ = indexed
    first = ferrus.op_graph_search(store, ferrus.HUMAN, "mod", limit=7)
    assert len(first.data["hits"]) == 7 and first.data["next_offset"] == 7
    assert "call again with offset=7" in first.text
    second = ferrus.op_graph_search(store, ferrus.HUMAN, "mod", limit=7, offset=7)
    assert not {h["location"] for h in first.data["hits"]} & {
        h["location"] for h in second.data["hits"]}
    monkeypatch.setattr(ferrus, "GRAPH_ANSWER_CHARS", 600)
    cut = ferrus.op_graph_context(store, ferrus.HUMAN, "src/pyapp/mod_5.py", limit=100)
    assert len(cut.text) < 1200 and cut.data["next_offset"] == len(cut.data["items"])
    rest = ferrus.op_graph_context(store, ferrus.HUMAN, "src/pyapp/mod_5.py", limit=100,
                                  offset=cut.data["next_offset"])
    assert rest.data["items"] and rest.data["items"][0] not in cut.data["items"]
    for bad in ({"limit": 0}, {"offset": -1}, {"limit": True}):
        with pytest.raises(ferrus.FerrusError, match="whole number"):
            ferrus.op_graph_search(store, ferrus.HUMAN, "mod", **bad)
    with pytest.raises(ferrus.FerrusError, match="at most 1000"):
        ferrus.op_graph_search(store, ferrus.HUMAN, "x" * 1001)
    assert ferrus.op_graph_search(store, ferrus.HUMAN, "%_'\"\\;--")  # no SQL injection


def test_lexical_rules_stay_linear_on_hostile_text():
    """One megabyte of what makes regular expressions backtrack: each extractor reads it
    (a catastrophic pattern would hang here), and finds the definition after it."""
    junk = {"c": "int " + "a " * 300000 + "(\nint after_junk(void) { return 1; }\n",
            "javascript": "const x = " + "(" * 100000 + "\nfunction afterJunk() {}\n",
            "rust": "impl<" + "T, " * 100000 + "\npub fn after_junk() {}\n",
            "java": "public " * 100000 + "\nclass AfterJunk {}\n",
            "go": "func (" * 100000 + "\nfunc AfterJunk() {}\n"}
    for lang, text in junk.items():
        facts = ferrus.graph_extract("x", text, lang)
        assert any(symbol[0].lower().replace("_", "") == "afterjunk" for symbol in
                   facts.symbols), lang


# -- keeping up to date -------------------------------------------------------------------------

@needs_git
def test_index_reads_only_what_changed(tmp_path):
    root = tmp_path / "small"
    root.mkdir()
    (root / "a.py").write_text("def alpha():\n    return beta()\n")
    (root / "b.py").write_text("def beta():\n    return 1\n")
    (root / "notes.txt").write_text("not code\n")
    for name in ("a.py", "b.py"):
        os.utime(str(root / name), (1_000_000, 1_000_000))   # written long before
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda message: None)
    store = ferrus.Store(str(root))
    first = ferrus.graph_index(store)
    assert first.extracted == 2 and first.read == 2        # notes.txt is listed, not read
    again = ferrus.graph_index(store)
    assert again.extracted == 0
    (root / "b.py").write_text("def beta():\n    return 1\n\n\ndef gamma():\n    return 2\n")
    changed = ferrus.graph_index(store)
    assert (changed.read, changed.extracted) == (1, 1)
    assert search(store, "gamma")[0]["location"] == "b.py:5"
    # the same bytes written again: read and hashed, not extracted
    (root / "b.py").write_text("def beta():\n    return 1\n\n\ndef gamma():\n    return 2\n")
    os.utime(str(root / "b.py"), ns=(1, 1))
    touched = ferrus.graph_index(store)
    assert (touched.read, touched.extracted) == (1, 0)
    os.unlink(str(root / "a.py"))
    removed = ferrus.graph_index(store)
    assert removed.removed == 1 and not search(store, "alpha")
    with ferrus.graph_open(store, refresh=False) as view:
        assert ferrus.graph_callers_of(view, ["beta"]) == []
    full = ferrus.graph_index(store, full=True)
    assert full.extracted == 1 and full.full


def test_a_task_start_indexes_the_graph_as_a_query_would(tmp_path, monkeypatch):
    root = tmp_path / "start"
    root.mkdir()
    (root / "a.py").write_text("def alpha():\n    pass\n")
    (root / "b.py").write_text("def beta():\n    pass\n")
    ferrus.init_project(str(root), report=lambda message: None)
    store = ferrus.Store(str(root))
    # A project larger than a query would build by itself: left for `ferrus graph index`.
    monkeypatch.setattr(ferrus, "GRAPH_AUTO_BUILD_FILES", 1)
    assert ferrus.graph_index_before_task(store) is None
    assert not os.path.exists(ferrus.graph_db_path(store))
    monkeypatch.setattr(ferrus, "GRAPH_AUTO_BUILD_FILES", 5000)
    assert ferrus.graph_index_before_task(store).extracted == 2
    # Once built, it is kept up to date whatever the project's size.
    monkeypatch.setattr(ferrus, "GRAPH_AUTO_BUILD_FILES", 1)
    (root / "c.py").write_text("def gamma():\n    pass\n")
    assert ferrus.graph_index_before_task(store).extracted == 1
    assert search(store, "gamma")[0]["location"] == "c.py:1"
    # A graph that cannot be written now is no reason to stop a task.
    monkeypatch.setattr(ferrus, "graph_connect", lambda *a, **k: (_ for _ in ()).throw(
        ferrus.GraphUnavailable("locked", "try again")))
    assert ferrus.graph_index_before_task(store) is None


def test_ferrus_run_indexes_the_graph_before_its_agents_start(project, tmp_path, monkeypatch):
    store = scripted_project(project, tmp_path / "memory")
    monkeypatch.setenv("SCRIPTED_DIR", str(tmp_path / "memory"))
    (project / "tool.py").write_text("def helper():\n    pass\n")
    lines = []
    code = ferrus.run_loop(store, "Make work.txt", out=lines.append, timeout=90)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    executor_started = min(e["time"] for e in store.read_journal() if e["event"] == "session")
    with ferrus.graph_open(store, refresh=False) as view:
        assert view.rows("SELECT path FROM g_symbols WHERE name = 'helper'") == [("tool.py",)]
        indexed_at = view.rows("SELECT value FROM meta WHERE key = 'indexed_at'")[0][0]
    assert indexed_at <= executor_started


@needs_git
def test_a_damaged_database_is_rebuilt_from_the_tree(tmp_path):
    root = tmp_path / "damaged"
    root.mkdir()
    (root / "a.py").write_text("def alpha():\n    pass\n")
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda message: None)
    store = ferrus.Store(str(root))
    ferrus.graph_index(store)
    with open(ferrus.graph_db_path(store), "wb") as handle:
        handle.write(b"this is not a database" * 100)
    ferrus._GRAPH_REFRESHED.clear()
    hits = ferrus.op_graph_search(store, ferrus.HUMAN, "alpha").data["hits"]
    assert [hit["location"] for hit in hits] == ["a.py:1"]


@needs_git
def test_a_graph_another_process_writes_answers_from_what_is_there(tmp_path, monkeypatch):
    root = tmp_path / "busy"
    root.mkdir()
    (root / "a.py").write_text("def alpha():\n    pass\n")
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda message: None)
    store = ferrus.Store(str(root))
    ferrus.graph_index(store)
    (root / "b.py").write_text("def beta():\n    pass\n")
    monkeypatch.setattr(ferrus, "GRAPH_BUSY_SECS", 0.05)
    ferrus._GRAPH_REFRESHED.clear()
    writer = sqlite3.connect(ferrus.graph_db_path(store), isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")            # another process indexing right now
    try:
        busy = ferrus.op_graph_search(store, ferrus.HUMAN, "alpha")
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert [hit["location"] for hit in busy.data["hits"]] == ["a.py:1"]
    assert "the graph was not refreshed" in busy.data["notes"][0]
    assert "note: the graph was not refreshed" in busy.text
    ferrus._GRAPH_REFRESHED.clear()
    assert ferrus.op_graph_search(store, ferrus.HUMAN, "beta").data["hits"]


def test_two_indexers_at_once_store_each_file_once(tmp_path, monkeypatch):
    # The supervisor's and the executor's servers both build a graph never built: the
    # second waits for the first's write lock, then finds its rows instead of inserting
    # them again (a UNIQUE constraint failure before).
    root = tmp_path / "twice"
    root.mkdir()
    (root / "a.py").write_text("def alpha():\n    pass\n")
    (root / "b.py").write_text("def beta():\n    pass\n")
    ferrus.init_project(str(root), report=lambda message: None)
    store = ferrus.Store(str(root))
    begin = ferrus._graph_begin
    others = []

    def another_indexer_first(connection):
        if not others:                  # the other one takes the lock, fills, commits
            others.append(None)
            others[0] = ferrus.graph_index(store)
        begin(connection)
    monkeypatch.setattr(ferrus, "_graph_begin", another_indexer_first)
    second = ferrus.graph_index(store)
    assert others[0].extracted == 2 and second.extracted == 0
    with ferrus.graph_open(store, refresh=False) as view:
        assert sorted(view.rows("SELECT name, path FROM g_symbols")) == [
            ("alpha", "a.py"), ("beta", "b.py")]


def test_lines_are_counted_as_editors_count_them_and_counts_are_worded(tmp_path):
    root = tmp_path / "lines"
    root.mkdir()
    (root / "two.py").write_text("def two():\n    pass\n")
    (root / "open_end.py").write_text("def open_end():\n    pass")
    (root / "one.py").write_text("X = 1\n")
    (root / "empty.py").write_text("")
    (root / "crlf.py").write_bytes(b"def crlf():\r\n    pass\r\n")
    outside = tmp_path / "elsewhere.py"
    outside.write_text("SECRET = 1\n")
    os.symlink(str(outside), str(root / "out.py"))
    ferrus.init_project(str(root), report=lambda message: None)
    store = ferrus.Store(str(root))
    ferrus.graph_index(store)
    lines = {name: ferrus.op_graph_show(store, ferrus.HUMAN, name).data["file"]["lines"]
             for name in ("two.py", "open_end.py", "one.py", "empty.py", "crlf.py")}
    assert lines == {"two.py": 2, "open_end.py": 2, "one.py": 1, "empty.py": 0, "crlf.py": 2}
    assert ferrus.op_graph_show(store, ferrus.HUMAN, "two.py").text.startswith(
        "two.py — python, 2 lines")
    assert ferrus.op_graph_show(store, ferrus.HUMAN, "one.py").text.startswith(
        "one.py — python, 1 line\n")
    context = ferrus.op_graph_context(store, ferrus.HUMAN, "two.py").data
    assert '"lines": 2' in json.dumps(context)
    said = ferrus.op_graph_index(store, ferrus.HUMAN, full=True).text
    assert "Skipped: 1 link out of the tree." in said
    assert "1 link out of the tree" in ferrus.op_graph_status(store, ferrus.HUMAN).text


def test_without_git_the_tree_is_walked_and_special_files_are_skipped(tmp_path):
    root = tmp_path / "plain"
    root.mkdir()
    (root / "app.py").write_text("def walked():\n    pass\n")
    for folder in ("node_modules", ".hidden", "__pycache__"):
        (root / folder).mkdir()
        (root / folder / "dep.py").write_text("def never_walked():\n    pass\n")
    ferrus.init_project(str(root), report=lambda message: None)
    if hasattr(os, "mkfifo"):
        os.mkfifo(str(root / "pipe.py"))        # reading it would block for ever
    store = ferrus.Store(str(root))
    report = ferrus.graph_index(store)
    assert report.listing == "a walk of the tree (no git)"
    assert search(store, "walked")[0]["location"] == "app.py:1"
    assert not search(store, "never_walked")
    if hasattr(os, "mkfifo"):
        assert report.skipped.get("special") == 1


@needs_git
def test_a_task_worktree_is_laid_over_the_shared_graph_without_touching_it(tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda message: None)
    (root / "lib.py").write_text("def shared():\n    return 1\n")
    (root / "old.py").write_text("def going_away():\n    return shared()\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    store = ferrus.Store(str(root))
    ferrus.graph_index(store)
    task, worktree, _ = start_task(store, "Change lib.")
    with open(os.path.join(worktree, "lib.py"), "w") as handle:
        handle.write("def shared():\n    return 1\n\n\ndef added_by_task():\n    return shared()\n")
    with open(os.path.join(worktree, "fresh.py"), "w") as handle:
        handle.write("from lib import added_by_task\n\n\ndef brand_new():\n"
                     "    return added_by_task()\n")
    os.unlink(os.path.join(worktree, "old.py"))
    shared_before = sqlite3.connect(ferrus.graph_db_path(store)).execute(
        "SELECT path, hash FROM files ORDER BY path").fetchall()
    task_store = store.for_task(task)
    seen = ferrus.op_graph_search(task_store, ferrus.HUMAN, "added_by_task").data["hits"]
    assert [hit["location"] for hit in seen] == ["lib.py:5"]
    assert ferrus.op_graph_search(task_store, ferrus.HUMAN, "brand_new").data["hits"]
    assert not ferrus.op_graph_search(task_store, ferrus.HUMAN, "going_away").data["hits"]
    context = ferrus.op_graph_context(task_store, ferrus.HUMAN, "lib.py").data["items"]
    assert {item["path"] for item in context if item.get("relation") == "imported_by"} == \
        {"fresh.py"}
    status = ferrus.op_graph_status(task_store, ferrus.HUMAN).data["overlay"]
    assert status["task"] == task and status["files"] == 2 and status["gone"] == 1
    # the project's own view, and the shared database, know nothing of the task's work
    assert not ferrus.op_graph_search(store, ferrus.HUMAN, "added_by_task").data["hits"]
    assert ferrus.op_graph_search(store, ferrus.HUMAN, "going_away").data["hits"]
    assert sqlite3.connect(ferrus.graph_db_path(store)).execute(
        "SELECT path, hash FROM files ORDER BY path").fetchall() == shared_before
    # once the task ended, its overlay goes with the next index
    ferrus.update_task(store, ferrus.HUMAN, task, "task_cancelled", {"status": "cancelled"})
    ferrus.graph_index(store)
    assert not os.path.exists(ferrus.graph_overlay_path(store, task))


# -- the command line and the MCP tools ----------------------------------------------------------

def run_graph_cli(root, *argv):
    args = ferrus.build_parser("graph").parse_args(list(argv))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.run(args, str(root))
    return code, out.getvalue()


def test_the_graph_commands(indexed, monkeypatch):
    store, known, _ = indexed
    monkeypatch.chdir(store.root)
    code, out = run_graph_cli(store.root, "graph", "search", "GoStruct9", "--json")
    assert code == 0
    assert json.loads(out)["hits"][0]["location"] == "%s:%d" % known["GoStruct9"][:2]
    code, out = run_graph_cli(store.root, "graph", "show", "c/mod_2.c:c_func_2")
    assert code == 0 and "int c_func_2(int v) {" in out
    monkeypatch.chdir(os.path.join(store.root, "web"))
    code, out = run_graph_cli(store.root, "graph", "context", "ts/mod_1.ts", "-n", "3")
    assert code == 0 and out.startswith("Context of web/ts/mod_1.ts") and "offset=3" in out
    code, out = run_graph_cli(store.root, "graph", "status")
    assert code == 0 and "Languages:" in out and "typescript" in out
    code, out = run_graph_cli(store.root, "graph", "index", "--json")
    assert code == 0 and json.loads(out)["report"]["extracted"] == 0
    with pytest.raises(ferrus.FerrusError, match="^-n must be a whole number of at least 1"):
        run_graph_cli(store.root, "graph", "search", "GoStruct9", "-n", "0")
    with pytest.raises(ferrus.FerrusError, match="^--offset must be a whole number"):
        run_graph_cli(store.root, "graph", "context", "ts/mod_1.ts", "--offset", "-1")


def test_the_mcp_tools_are_flat_read_only_and_answer_valid_structured_content(indexed):
    store, known, _ = indexed
    for role in ("executor", "supervisor"):
        client = InProcessMcp(store, role)
        try:
            client.initialize()
            listed = {}
            cursor = None
            while True:
                page = client.result("tools/list", {"cursor": cursor} if cursor else {})
                listed.update((tool["name"], tool) for tool in page["tools"])
                cursor = page.get("nextCursor")
                if not cursor:
                    break
            for tool in ferrus.GRAPH_TOOLS:
                entry = listed[tool.name]
                assert entry["annotations"]["readOnlyHint"] is True
                assert all(set(schema) <= {"type", "description"} for schema in
                           entry["inputSchema"]["properties"].values())
            result = client.call_tool("repository_graph_search", {"query": "TsClass8"})
            assert not result.get("isError"), result
            assert not mcp_schema.structured_errors(
                result["structuredContent"], listed["repository_graph_search"]["outputSchema"])
            assert result["structuredContent"]["hits"][0]["location"] == \
                "%s:%d" % known["TsClass8"][:2]
            assert "%s:%d" % known["TsClass8"][:2] in result["content"][0]["text"]
            for name, arguments in (("repository_graph_status", {}),
                                    ("repository_graph_context",
                                     {"target": "java/src/com/example/Mod8.java",
                                      "limit": 5})):
                answer = client.call_tool(name, arguments)
                assert not answer.get("isError"), answer
                assert not mcp_schema.structured_errors(answer["structuredContent"],
                                                        listed[name]["outputSchema"])
            refused = client.call_tool("repository_graph_search", {"query": "x", "limit": 0})
            assert refused["isError"] and "whole number" in refused["content"][0]["text"]
        finally:
            client.close()
