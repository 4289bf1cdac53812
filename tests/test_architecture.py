"""The book's promise: ferrus.py's sections come in dependency order.

The module docstring says each section uses only the sections above it.  These
tests parse ferrus.py, give every top-level name the section it is defined in,
and fail on any reference from a section to a later one — so a reader can stop
at any banner knowing everything above it stands on its own.
"""

import ast
import os
import re

import pytest

FERRUS_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "ferrus.py")
BANNER = re.compile(r"^# (\d+)\. (\S.*)$")


def sections_of(lines):
    """[(first line, number, title)] of every ``# N. Title`` under a ``# ====`` rule."""
    found = []
    for index, line in enumerate(lines):
        match = BANNER.match(line)
        if match and index and lines[index - 1].startswith("# ====="):
            found.append((index + 1, int(match.group(1)), match.group(2).strip()))
    return found


def section_at(sections, line):
    number = None
    for first, this, _ in sections:
        if first <= line:
            number = this
    return number


def _is_main_guard(node):
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _defined_names(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    return [name.id for target in targets for name in ast.walk(target)
            if isinstance(name, ast.Name)]


def forward_references(source):
    """[(line, from section, name, its section)] for every reference to a later section."""
    lines = source.splitlines()
    sections = sections_of(lines)
    tree = ast.parse(source)
    home = {}
    for node in tree.body:
        for name in _defined_names(node):
            home.setdefault(name, section_at(sections, node.lineno))
    found = set()
    for node in tree.body:
        here = section_at(sections, node.lineno)
        if here is None or _is_main_guard(node):
            continue
        for child in ast.walk(node):
            if isinstance(child, ast.Name) and (home.get(child.id) or 0) > here:
                found.add((child.lineno, here, child.id, home[child.id]))
    return sorted(found)


@pytest.fixture(scope="module")
def source():
    with open(FERRUS_PY, encoding="utf-8") as handle:
        return handle.read()


def test_no_section_uses_a_later_one(source):
    problems = ["line %d (section %d) uses %s from section %d" % found
                for found in forward_references(source)]
    assert not problems, "\n".join(problems)


def test_the_table_of_contents_names_every_section_in_order(source):
    lines = source.splitlines()
    sections = sections_of(lines)
    assert [number for _, number, _ in sections] == list(range(1, len(sections) + 1))
    docstring = ast.get_docstring(ast.parse(source))
    listed = re.findall(r"^\s*(\d+)\. (\S+(?: \S+)*?) ?\.{2,}", docstring, re.M)
    assert [(int(number), title) for number, title in listed] == \
        [(number, title) for _, number, title in sections]


def test_every_section_stays_a_readable_size(source):
    """No room holds more than a sixth of the book (the old "Sessions and HQ" held 18%)."""
    lines = source.splitlines()
    sections = sections_of(lines)
    bounds = [first for first, _, _ in sections] + [len(lines) + 1]
    for (first, number, title), end in zip(sections, bounds[1:]):
        assert end - first < len(lines) / 6, "section %d %s has %d lines" % (
            number, title, end - first)


def test_the_checker_finds_a_forward_reference():
    """The test above could fail: a section that calls into a later one is caught."""
    book = "\n".join([
        "# " + "=" * 20, "# 1. Basics", "# " + "=" * 20,
        "def early():", "    return late()",
        "# " + "=" * 20, "# 2. Later", "# " + "=" * 20,
        "def late():", "    return early()",
        "if __name__ == '__main__':", "    late()", ""])
    assert forward_references(book) == [(5, 1, "late", 2)]
