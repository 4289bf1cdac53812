"""The book's promise: ferrus is developed as the modules of src/ferrus/, in dependency
order, and ferrus.py is exactly what they build.

tools/amalgamate.py builds ferrus.py from the modules in the order src/ferrus/__init__.py
names; it refuses an import of a later module, an import cycle, a top-level name defined
in two modules and any import outside the standard library.  These tests hold the
committed ferrus.py to the build, plant each defect the build must refuse, and keep the
modules readable: a docstring that says what each one owns, none over ~1,500 lines, and
every name a module uses either its own, a builtin or imported by name.
"""

import ast
import builtins
import os
import re
import shutil
import subprocess
import sys
import symtable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "src", "ferrus")
FERRUS_PY = os.path.join(ROOT, "ferrus.py")
AMALGAMATE = os.path.join(ROOT, "tools", "amalgamate.py")
MODULE_LINES_MAX = 1500

sys.path.insert(0, os.path.join(ROOT, "tools"))
import amalgamate  # noqa: E402


@pytest.fixture(scope="module")
def modules():
    return amalgamate.load()[1]


def test_the_committed_ferrus_py_is_what_the_modules_build():
    with open(FERRUS_PY, encoding="utf-8") as handle:
        committed = handle.read()
    assert committed == amalgamate.build(), \
        "ferrus.py is stale: run `make ferrus.py` and commit it"


def test_the_build_is_the_same_bytes_every_time():
    assert amalgamate.build() == amalgamate.build()


def test_the_generated_file_says_it_is_generated_and_names_every_module(modules):
    with open(FERRUS_PY, encoding="utf-8") as handle:
        head = handle.read(8000)
    assert head.startswith("#!/usr/bin/env python3\n# Generated from src/ferrus/")
    assert "make ferrus.py" in head.split('"""')[0]
    for module in modules:
        assert "    %s.py ." % module.name in head, module.name


def planted(tmp_path, module, text, mode="append"):
    """A copy of src/ferrus with ``text`` added to ``module`` (or a new module)."""
    copy = tmp_path / "src" / "ferrus"
    shutil.copytree(SOURCE, str(copy))
    path = copy / (module + ".py")
    if mode == "append":
        with open(str(path), "a", encoding="utf-8") as handle:
            handle.write(text)
    else:
        old = path.read_text(encoding="utf-8")
        docstring_end = old.index('"""', 3) + 3
        path.write_text(old[:docstring_end] + "\n" + text + old[docstring_end:],
                        encoding="utf-8")
    return str(copy)


def refusal(source):
    with pytest.raises(amalgamate.BuildError) as caught:
        amalgamate.build(source)
    return str(caught.value)


def test_the_build_refuses_an_import_of_a_later_module(tmp_path):
    source = planted(tmp_path, "store", "from .cli import main\n", mode="imports")
    message = refusal(source)
    assert "src/ferrus/store.py:" in message and "the later module cli" in message


def test_the_build_refuses_an_import_cycle(tmp_path):
    source = planted(tmp_path, "basics", "from .basics import log\n", mode="imports")
    message = refusal(source)
    assert "src/ferrus/basics.py:" in message and "imports itself" in message


def test_the_build_refuses_a_name_defined_in_two_modules(tmp_path):
    source = planted(tmp_path, "cli", "\n\ndef utc_now():\n    return None\n")
    message = refusal(source)
    assert "src/ferrus/cli.py:" in message and "utc_now is already defined at " \
        "src/ferrus/basics.py:" in message


def test_the_build_refuses_an_import_outside_the_standard_library(tmp_path):
    source = planted(tmp_path, "cli", "\n\ndef later():\n    import requests\n"
                     "    return requests\n")
    message = refusal(source)
    assert "src/ferrus/cli.py:" in message and "requests, which is not in the standard " \
        "library" in message


def test_make_ferrus_py_exits_non_zero_and_names_the_file_and_line(tmp_path):
    copy = tmp_path / "repo"
    (copy / "tools").mkdir(parents=True)
    shutil.copy(AMALGAMATE, str(copy / "tools"))
    shutil.copytree(SOURCE, str(copy / "src" / "ferrus"))
    with open(str(copy / "src" / "ferrus" / "git.py"), "a", encoding="utf-8") as handle:
        handle.write("\n\nimport yaml  # noqa\n")
    result = subprocess.run([sys.executable, str(copy / "tools" / "amalgamate.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "src/ferrus/git.py:" in result.stderr
    assert not (copy / "ferrus.py").exists()


def test_where_maps_a_line_of_ferrus_py_back_to_its_module(modules):
    with open(FERRUS_PY, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    module = next(m for m in modules if m.name == "store")
    wanted = next(i for i, line in enumerate(module.lines) if line.startswith("class Store:"))
    generated = lines.index("class Store:") + 1
    result = subprocess.run([sys.executable, AMALGAMATE, "--where", str(generated)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "src/ferrus/store.py:%d" % (wanted + 1)


def test_every_module_says_what_it_owns_and_stays_a_readable_size(modules):
    for module in modules:
        first = module.docstring.split("\n", 1)[0]
        assert first.endswith(".") and len(first) <= 80, (module.rel, first)
        assert len(module.lines) <= MODULE_LINES_MAX, "%s has %d lines: split it along a " \
            "real seam" % (module.rel, len(module.lines))


def test_every_dataclass_is_made_when_first_used(modules):
    """A module does no work at import that a command may not need: `@dataclass` compiles
    three methods per class, so ferrus's classes use `@deferred_dataclass` (basics)."""
    eager = []
    for module in modules:
        for node in ast.walk(ast.parse("\n".join(module.lines))):
            if isinstance(node, ast.ClassDef):
                for decorator in node.decorator_list:
                    target = decorator.func if isinstance(decorator, ast.Call) else decorator
                    if ast.unparse(target) in ("dataclass", "dataclasses.dataclass"):
                        eager.append("%s: class %s" % (module.rel, node.name))
    assert eager == [], "use @deferred_dataclass: %s" % ", ".join(eager)


def _run_at_import(statements):
    """The nodes of ``statements`` Python runs when the module is imported (module and
    class bodies; not function bodies or lambdas)."""
    for statement in statements:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(statement, ast.ClassDef):
            yield from _run_at_import(statement.body)
            continue
        todo = [statement]
        while todo:
            node = todo.pop()
            if not isinstance(node, ast.Lambda):
                yield node
                todo.extend(ast.iter_child_nodes(node))


def test_every_pattern_is_compiled_when_first_used(modules):
    """`re.compile` at import is paid by every start of every command (an agent's server
    starts once per session): module-level patterns are `LazyPattern`s (basics)."""
    eager = ["%s:%d" % (module.rel, node.lineno) for module in modules
             for node in _run_at_import(ast.parse("\n".join(module.lines)).body)
             if isinstance(node, ast.Call) and ast.unparse(node.func) == "re.compile"]
    assert eager == [], "use LazyPattern: %s" % ", ".join(eager)


def test_every_name_a_module_uses_is_its_own_imported_or_builtin(modules):
    """So an editor or a linter opening one module sees real names: nothing reaches
    another module's name through the one namespace of the built file, and nothing is
    imported that is not used."""
    builtin = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__"}
    problems = []
    for module in modules:
        bound = set(module.defined())
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        used = set()

        def walk(table):
            for symbol in table.get_symbols():
                name = symbol.get_name()
                if table.get_type() == "module" and symbol.is_referenced():
                    used.add(name)
                    if symbol.is_assigned():
                        # Bound here: since 3.12 a comprehension's variables at module
                        # level are the module's own (PEP 709 inlines comprehensions).
                        bound.add(name)
                elif table.get_type() != "module" and symbol.is_global():
                    used.add(name)
            for child in table.get_children():
                walk(child)
        walk(symtable.symtable(module.text, module.rel, "exec"))
        missing = sorted(used - bound - builtin)
        if missing:
            problems.append("%s uses %s" % (module.rel, ", ".join(missing)))
        imported = set()
        for node in module.imports + module.package_imports:
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        public = set()
        for node in module.tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                public = set(ast.literal_eval(node.value))
        unused = sorted(imported - used - public - _annotation_words(module.tree))
        if unused:
            problems.append("%s imports %s and never uses it" % (module.rel, ", ".join(unused)))
    assert not problems, "\n".join(problems)


def _annotation_words(tree):
    """Names a module uses only in string annotations ("threading.Event | None")."""
    words = set()
    for node in ast.walk(tree):
        annotation = getattr(node, "annotation", None) if isinstance(
            node, (ast.AnnAssign, ast.arg)) else None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            words |= set(re.findall(r"(?<![.\w])([A-Za-z_]\w*)", annotation.value))
    return words
