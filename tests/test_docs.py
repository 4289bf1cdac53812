"""The documentation keeps up with the code: every command, option and ferrus.toml key
is documented in README.md or docs/*.md, every relative link there resolves, and
ferrus.py's comments point only at documents inside the repository."""

import argparse
import dataclasses
import os
import re

import pytest

import ferrus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_DIR = os.path.join(ROOT, "docs")


def doc_paths():
    paths = [os.path.join(ROOT, "README.md")]
    if os.path.isdir(DOCS_DIR):
        paths += sorted(os.path.join(DOCS_DIR, name) for name in os.listdir(DOCS_DIR)
                        if name.endswith(".md"))
    return paths


def read(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read()


ALL_DOCS = "\n".join(read(path) for path in doc_paths())


# -- commands and options ---------------------------------------------------------------

def subcommands(parser, path=()):
    """(path of names, parser) for every subcommand of the CLI, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield path + (name,), subparser
                yield from subcommands(subparser, path + (name,))


def long_options(parser):
    return [option for action in parser._actions if action.help != argparse.SUPPRESS
            for option in action.option_strings
            if option.startswith("--") and option != "--help"]


COMMANDS = list(subcommands(ferrus.build_parser()))


def test_the_parser_has_subcommands():
    # Guards the walk itself: a parser rewritten without argparse subparsers would
    # otherwise make every test below pass vacuously.
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("names", [names for names, _ in COMMANDS], ids=" ".join)
def test_every_subcommand_is_documented(names):
    """`ferrus run`, and for nested ones a line naming the parent command and the child
    (`ferrus pipeline list | init | …` or `ferrus journal rotate`)."""
    if len(names) == 1:
        assert re.search(r"ferrus %s\b" % re.escape(names[0]), ALL_DOCS), \
            "`ferrus %s` is documented nowhere in README.md or docs/" % names[0]
    else:
        parent, child = " ".join(names[:-1]), names[-1]
        pattern = r"ferrus %s\b[^\n]*\b%s\b" % (re.escape(parent), re.escape(child))
        assert re.search(pattern, ALL_DOCS), \
            "`ferrus %s %s` is documented nowhere in README.md or docs/" % (parent, child)


@pytest.mark.parametrize("names,option", [
    (names, option) for names, parser in COMMANDS for option in long_options(parser)],
    ids=lambda value: " ".join(value) if isinstance(value, tuple) else value)
def test_every_option_is_documented(names, option):
    """Each long option appears on a line that also names its command (and, for a
    nested command, its parent)."""
    lines = [line for line in ALL_DOCS.splitlines()
             if re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(option), line)]
    assert any(all(re.search(r"\b%s\b" % re.escape(name), line) for name in names)
               for line in lines), \
        "`ferrus %s %s` is documented nowhere in README.md or docs/" % (" ".join(names), option)


def test_global_options_are_documented():
    parser = ferrus.build_parser()
    options = [option for action in parser._actions if action.help != argparse.SUPPRESS
               for option in action.option_strings if option not in ("-h", "--help")]
    assert options
    for option in options:
        assert re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(option), ALL_DOCS), \
            "the global option %s is documented nowhere" % option


# -- ferrus.toml keys ---------------------------------------------------------------------

# Fields of the Config dataclasses whose ferrus.toml spelling differs from the field name,
# and fields that hold sub-tables rather than keys ([agents.<name>], [agents.custom.<name>]).
TOML_SPELLING = {("agents", "claude_mcp_isolation"): "mcp_isolation"}
SUB_TABLE_FIELDS = {("agents", "options"), ("agents", "custom")}
# Sub-tables and [hq.<role>] read into dataclasses that are not fields of Config
# ([agents.nano]'s own keys are kept in AgentOptions.settings and read by NanoSettings).
NESTED_TABLES = {"agents.<name>": ferrus.AgentOptions,
                 "agents.custom.<name>": ferrus.CustomAgentSpec,
                 "agents.nano": ferrus.NanoSettings,
                 "hq.<role>": ferrus.AgentChoice}
NOT_KEYS = {("agents.<name>", "settings")}


def config_keys():
    """(table, key) for every key the Config section reads into its dataclasses."""
    keys = []
    for table_field in dataclasses.fields(ferrus.Config):
        default = ferrus.Config()
        value = getattr(default, table_field.name)
        if not dataclasses.is_dataclass(value):
            continue
        for field in dataclasses.fields(value):
            if (table_field.name, field.name) in SUB_TABLE_FIELDS:
                continue
            keys.append((table_field.name,
                         TOML_SPELLING.get((table_field.name, field.name), field.name)))
    for table, cls in NESTED_TABLES.items():
        keys.extend((table, field.name) for field in dataclasses.fields(cls)
                    if (table, field.name) not in NOT_KEYS)
    return keys


def test_config_keys_are_found():
    keys = config_keys()
    assert ("checks", "commands") in keys and ("hq.<role>", "agent") in keys


@pytest.mark.parametrize("table,key", config_keys(), ids=lambda value: value)
def test_every_config_key_is_documented(table, key):
    """A key is documented when the docs show it as `key` or in a TOML example (`key =`)."""
    pattern = r"`%s`|^\s*#?\s*%s\s*=" % (re.escape(key), re.escape(key))
    assert re.search(pattern, ALL_DOCS, re.MULTILINE), \
        "ferrus.toml key %s in [%s] is documented nowhere in README.md or docs/" % (key, table)


def test_every_config_table_is_documented():
    for table in ferrus.KNOWN_TABLES:
        assert "[%s" % table in ALL_DOCS, "[%s] is documented nowhere" % table


# -- links ----------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def heading_anchor(heading):
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    text = FENCE.sub("", read(path))
    return {heading_anchor(match.group(1))
            for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE)}


def relative_links():
    for path in doc_paths():
        for target in LINK.findall(FENCE.sub("", read(path))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
                continue
            yield path, target


@pytest.mark.parametrize("path,target", list(relative_links()),
                         ids=lambda value: os.path.relpath(value, ROOT)
                         if os.path.isabs(value) else value)
def test_relative_links_resolve(path, target):
    file_part, _, anchor = target.partition("#")
    resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
        if file_part else path
    assert os.path.exists(resolved), "%s links to %s, which does not exist" % (
        os.path.relpath(path, ROOT), target)
    if anchor and resolved.endswith(".md"):
        assert anchor in anchors(resolved), "%s links to %s: no such heading in %s" % (
            os.path.relpath(path, ROOT), target, os.path.relpath(resolved, ROOT))


def test_the_heading_anchor_follows_github():
    assert heading_anchor("ferrus.toml") == "ferrustoml"
    assert heading_anchor("Quick start: a task to Complete in five commands") == \
        "quick-start-a-task-to-complete-in-five-commands"
    assert heading_anchor("Claude Code (`claude-code`, binary `claude`)") == \
        "claude-code-claude-code-binary-claude"


def test_the_readme_names_make_test():
    assert "make test" in read(os.path.join(ROOT, "README.md"))


# -- docs/ARCHITECTURE.md and the comments that point to it ------------------------------------

ARCHITECTURE = os.path.join(DOCS_DIR, "ARCHITECTURE.md")
FERRUS_PY = os.path.join(ROOT, "ferrus.py")
# Documents a future maintainer will not have: the design notes and reference material
# ferrus was first written from.  Comments point to ARCHITECTURE.md's headings instead.
OUTSIDE_DOCUMENTS = re.compile(r"seed 0\d|seed-00\d|\bseed(?:'s\b|:| step)|upstream §|DESIGN §|"
                               r"§\s*\d|reference/\w", re.IGNORECASE)


def architecture_headings():
    return {match.group(1).strip() for match in
            re.finditer(r"^#{2,6}\s+(.+?)\s*$", FENCE.sub("", read(ARCHITECTURE)), re.MULTILINE)}


def test_ferrus_py_cites_no_document_outside_the_repository():
    found = ["ferrus.py:%d: %s" % (number, line.strip())
             for number, line in enumerate(read(FERRUS_PY).splitlines(), 1)
             if OUTSIDE_DOCUMENTS.search(line)]
    assert not found, "cite a heading of docs/ARCHITECTURE.md instead:\n" + "\n".join(found)


def other_sources():
    """Docs, the tests (this file excepted: it holds the patterns) and the bench."""
    paths = doc_paths()
    for folder in ("tests", "bench"):
        for base, _, names in os.walk(os.path.join(ROOT, folder)):
            paths += [os.path.join(base, name) for name in names
                      if name.endswith((".py", ".md")) and name != "test_docs.py"]
    return paths


def test_docs_tests_and_bench_cite_no_document_outside_the_repository():
    found = ["%s: %s" % (os.path.relpath(path, ROOT), line.strip())
             for path in other_sources() for line in read(path).splitlines()
             if OUTSIDE_DOCUMENTS.search(line)]
    assert not found, "\n".join(found)


def test_the_outside_document_pattern_catches_what_it_should():
    for text in ("(seed 001)", "Seed 004:", "upstream §11.4", "DESIGN §3", "bug §11.17",
                 "see reference/upstream-core.md", "the seed's grace", "# seed step 6"):
        assert OUTSIDE_DOCUMENTS.search(text), text
    assert not OUTSIDE_DOCUMENTS.search("see ARCHITECTURE.md, 'Session state machine'")


ARCHITECTURE_REFERENCE = re.compile(r"ARCHITECTURE\.md,\s+(?:#\s*)?'([^']+)'(?:,\s+item (\d+))?")


def architecture_references():
    """(line, heading, item or None) for every "ARCHITECTURE.md, '<heading>'" in ferrus.py;
    a comment may wrap between the file name and the heading."""
    text = read(FERRUS_PY)
    joined = re.sub(r"\n\s*#\s*", " ", text)
    return [(match.group(1), match.group(2)) for match in ARCHITECTURE_REFERENCE.finditer(joined)]


def test_ferrus_py_points_to_architecture_headings_that_exist():
    references = architecture_references()
    assert references, "ferrus.py has no reference to docs/ARCHITECTURE.md"
    headings = architecture_headings()
    missing = sorted({heading for heading, _ in references if heading not in headings})
    assert not missing, "ferrus.py cites headings docs/ARCHITECTURE.md does not have: %s" % (
        ", ".join(repr(heading) for heading in missing))


def numbered_differences():
    text = read(ARCHITECTURE)
    section = text[text.index("## Differences from upstream ferrus"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    return [int(number) for number in re.findall(r"^(\d+)\. ", section, re.MULTILINE)]


def test_the_differences_from_upstream_are_numbered_one_by_one():
    numbers = numbered_differences()
    assert numbers == list(range(1, len(numbers) + 1))


def test_cited_differences_exist():
    count = len(numbered_differences())
    for heading, item in architecture_references():
        if item is not None:
            assert heading == "Differences from upstream ferrus", heading
            assert 1 <= int(item) <= count, "item %s of %d" % (item, count)


def module_uses():
    """{module: the modules it imports} from src/ferrus/, in build order."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import amalgamate
    return {module.name: [node.module for node in module.package_imports]
            for module in amalgamate.load()[1]}


def test_the_module_table_tells_the_truth():
    """The table in 'The modules of src/ferrus/' lists every module, in build order,
    with exactly the modules it uses (basics and system left out, as nearly every
    module uses them; system's own use of basics is listed)."""
    uses = module_uses()
    text = read(ARCHITECTURE).split("## The modules of src/ferrus/", 1)[1].split("\n## ")[0]
    rows = [(match.group(1), match.group(2).strip()) for match in re.finditer(
        r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|$", text, re.MULTILINE)]
    assert [name for name, _ in rows] == list(uses), "the modules, in build order"
    problems = []
    for name, listed in rows:
        actual = [m for m in uses[name] if m not in ("basics", "system") or name == "system"]
        if listed.split() != actual and not (listed == "—" and not actual):
            problems.append("%s uses %s" % (name, " ".join(actual) or "—"))
    assert not problems, "update the table in docs/ARCHITECTURE.md, 'The modules of " \
                         "src/ferrus/':\n" + "\n".join(problems)


def test_the_transition_table_names_every_action():
    section = read(ARCHITECTURE).split("## Task state machine", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)
    assert listed == [action for action, _, _ in ferrus.TRANSITIONS]


# -- HQ commands and the MCP surface ------------------------------------------------------------

@pytest.mark.parametrize("command", [name for name, _, _ in ferrus.HQ_COMMANDS])
def test_every_hq_command_is_documented(command):
    assert re.search(r"`%s\b" % re.escape(command), ALL_DOCS), \
        "HQ's %s is documented nowhere in README.md or docs/" % command


@pytest.mark.parametrize("tool", [tool.name for tool in ferrus.TOOLS])
def test_every_mcp_tool_is_documented(tool):
    assert re.search(r"`%s\(" % re.escape(tool), ALL_DOCS), \
        "the MCP tool %s is documented nowhere (as `%s(…)`)" % (tool, tool)


@pytest.mark.parametrize("resource", [entry[0] for entry in ferrus.RESOURCES])
def test_every_mcp_resource_is_documented(resource):
    assert re.search(r"`(ferrus://)?%s`" % re.escape(resource), ALL_DOCS), \
        "the MCP resource ferrus://%s is documented nowhere" % resource


@pytest.mark.parametrize("prompt", [entry[0] for entry in ferrus.PROMPTS])
def test_every_mcp_prompt_is_documented(prompt):
    assert "`%s`" % prompt in ALL_DOCS, "the MCP prompt %s is documented nowhere" % prompt
