"""Every table of ferrus.toml is validated in one place (the Config section): `ferrus
doctor` names the file, the table.key and the expected type for a bad value in any
table, lists every bad value at once, and warns about unknown keys in every table."""

import dataclasses

import pytest

import ferrus
from conftest import set_config

# A value of the wrong type for a key whose default is of this type, and what doctor
# then says is expected.
WRONG_VALUE = {
    bool: ('"yes"', "must be true or false"),
    int: ('"many"', "must be an integer"),
    str: ("5", "must be a string"),
    list: ('"one"', "must be an array of strings"),
}


def plain_table_cases():
    """(table, toml text, expected message) for every key of every plain table."""
    cases = []
    for table in ferrus.PLAIN_TABLES:
        defaults = getattr(ferrus.Config(), table)
        for field in dataclasses.fields(defaults):
            value, expected = WRONG_VALUE[type(getattr(defaults, field.name))]
            cases.append((table, "[%s]\n%s = %s\n" % (table, field.name, value),
                          "ferrus.toml: [%s.%s] %s" % (table, field.name, expected)))
    return cases


# Tables that are not read straight into one dataclass, each with a bad value.
NESTED_TABLE_CASES = [
    ("agents", '[agents]\npath = 3\n', "ferrus.toml: [agents.path] must be a string, got 3"),
    ("agents.claude", '[agents.claude]\nmcp_isolation = "none"\n',
     'ferrus.toml: [agents.claude.mcp_isolation] must be "merge-user" or "ferrus-only", '
     'got "none"'),
    ("agents.<name>", '[agents.codex]\nextra_args = "--yolo"\n',
     'ferrus.toml: [agents.codex.extra_args] must be an array of strings, got "--yolo"'),
    ("agents.<name>", '[agents.gemini-cli]\nenv = { A = 1 }\n',
     "ferrus.toml: [agents.gemini-cli.env] must be a table of strings"),
    ("agents.custom.<name>",
     '[agents.custom.mycli]\ninteractive = ["m"]\nheadless = ["m"]\nprompt = 1\n',
     'ferrus.toml: [agents.custom.mycli.prompt] must be "argv" or "stdin", got 1'),
    ("agents.custom.<name>", '[agents.custom.mycli]\ninteractive = "m"\nheadless = ["m"]\n',
     "ferrus.toml: [agents.custom.mycli.interactive] must be an array of strings"),
    ("hq", "[hq]\nsupervisor = 5\n",
     "ferrus.toml: [hq.supervisor] must be a table with `agent` (or a string), got 5"),
    ("hq", "[hq]\nhuman_review = 1\n",
     "ferrus.toml: [hq.human_review] must be true or false, got 1"),
    ("hq.supervisor", '[hq.supervisor]\nagent = "codex"\nmodel = 5\n',
     "ferrus.toml: [hq.supervisor.model] must be a string, got 5"),
    ("hq.executor", '[hq.executor]\nagent = "codex"\npermissions = "root"\n',
     'ferrus.toml: [hq.executor.permissions] must be one of "read-only", "edit", "full", '
     'got "root"'),
    ("hq.executor", '[hq.executor]\nagent = 7\n',
     "ferrus.toml: [hq.executor.agent] must be an agent name string, got 7"),
    ("parallel", '[parallel]\nintegrate = "squash"\n',
     'ferrus.toml: [parallel.integrate] must be "rebase" or "merge", got "squash"'),
    ("parallel", '[parallel]\nmax_tasks = 0\n',
     'ferrus.toml: [parallel.max_tasks] must be'),
    ("parallel", '[parallel]\nplaces = ["here", "nowhere"]\n',
     'ferrus.toml: [parallel.places] names "nowhere" (a string), which is neither "here" '
     'nor a [places.nowhere] table'),
    ("sandbox", '[sandbox]\nenabled = "yes"\n',
     'ferrus.toml: [sandbox.enabled] must be true or false, got "yes"'),
    ("sandbox", '[sandbox]\nwritable = ["cache"]\n',
     'ferrus.toml: [sandbox.writable] must list absolute paths or paths under ~/'),
    ("places", '[places.box]\nslots = 2\n',
     "ferrus.toml: [places.box] needs exactly one of ssh = [...]"),
    ("places", '[places.box]\nssh = ["ssh", "h"]\nslots = 0\n',
     "ferrus.toml: [places.box.slots] must be an integer between 1 and 64, got 0"),
    ("places", '[places.here]\nssh = ["ssh", "h"]\n',
     "ferrus.toml: [places.here.ssh] cannot be set: here is this machine"),
    ("places", '[places.box]\nexec = ["env"]\n[places.box.sandbox]\nnetwork = 0\n',
     "ferrus.toml: [places.box.sandbox.network] must be true or false, got 0"),
    ("git", '[git]\ncommit = "yes"\n',
     'ferrus.toml: [git.commit] must be one of "off", "on_approve", got "yes"'),
    ("git", '[git]\nbranch = "ferrus"\n',
     'ferrus.toml: [git.branch] must contain {task_id}'),
]


def test_every_table_the_file_knows_has_a_case():
    covered = {table.split(".")[0] for table, _, _ in NESTED_TABLE_CASES}
    covered.update(table for table, _, _ in plain_table_cases())
    assert covered == set(ferrus.KNOWN_TABLES)
    assert {table for table, _, _ in plain_table_cases()} == set(ferrus.PLAIN_TABLES)


def test_the_default_config_has_a_parallel_block_at_the_defaults(tmp_path):
    """`ferrus init` writes a [parallel] block holding every key at its default."""
    text = ferrus.default_config_text()
    assert "\n[parallel]\n" in text
    parsed = ferrus.parse_toml(text)["parallel"]
    defaults = ferrus.ParallelConfig()
    assert set(parsed) == {field.name for field in dataclasses.fields(defaults)}
    for key, value in parsed.items():
        assert value == getattr(defaults, key), key
    root = tmp_path / "fresh"
    root.mkdir()
    ferrus.init_project(str(root), report=lambda m: None)
    config = ferrus.load_config(str(root))
    assert config.parallel == defaults and not config.unknown_keys


@pytest.mark.parametrize("table,text,expected", plain_table_cases() + NESTED_TABLE_CASES)
def test_a_bad_value_in_any_table_is_named_with_its_type(project, table, text, expected):
    set_config(project, '[checks]\ncommands = ["true"]\n' + text if table != "checks"
               else text)
    messages = [finding.problem for finding in ferrus.config_findings(str(project))
                if finding.severity == "error"]
    assert [m for m in messages if m.startswith(expected)], (expected, messages)


@pytest.mark.parametrize("table,text,expected", [
    next(case for case in plain_table_cases() if case[0] == table)
    for table in ferrus.PLAIN_TABLES] + NESTED_TABLE_CASES)
def test_doctor_reports_a_bad_value_in_each_table_in_turn(project, capsys, table, text, expected):
    # `ferrus doctor` in this process: its report is the point, not starting a program.
    set_config(project, text)
    code = ferrus.main(["-C", str(project), "doctor"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert expected in out, out


def test_every_bad_value_is_listed_even_two_in_one_table(project, cli):
    set_config(project, '[checks]\ncommands = ["true"]\nparallel = "yes"\ntimeout_secs = 0\n'
                        '[agents.codex]\nextra_args = 1\nenv = 2\n'
                        '[hq.executor]\nagent = 7\nmodel = 8\n')
    out = cli("doctor", cwd=project).stdout
    for key in ("checks.parallel", "checks.timeout_secs", "agents.codex.extra_args",
                "agents.codex.env", "hq.executor.agent", "hq.executor.model"):
        assert "[%s]" % key in out, key
    # Commands that need the file report the first error and how many there are.
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.load_config(str(project))
    assert "[checks.parallel]" in err.value.message
    assert "lists all 6 problems" in err.value.hint


def test_a_check_command_that_is_no_string_is_named(project):
    """Not "must be an array of strings, got an array", which left the user looking for
    what is wrong: the item and its type are named."""
    set_config(project, '[checks]\ncommands = ["pytest", 1]\n')
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.load_config(str(project))
    assert "[checks.commands] must be an array of strings, got an array whose item 2 is " \
        "1 (an integer)" in err.value.message


UNKNOWN_KEYS = """
[checks]
commands = ["true"]
colour = "blue"

[agents]
pth = ".x"

[agents.codex]
flags = []

[agents.cladue]
extra_args = []

[agents.custom.mycli]
interactive = ["m"]
headless = ["m"]
descrption = "mine"

[hq]
reviewer = "codex"

[hq.executor]
agent = "codex"
modle = "o3"

[hqq]
x = 1
"""


def test_unknown_keys_in_every_table_warn_and_are_ignored(project, cli):
    set_config(project, UNKNOWN_KEYS)
    config = ferrus.load_config(str(project))        # warnings, not errors
    assert config.executor.agent == "codex" and config.executor.model == ""
    assert config.hq_problem is None
    assert "mycli" in config.agents.custom and "cladue" not in config.agents.options
    expected = ["checks.colour", "agents.pth", "agents.custom.mycli.descrption",
                "agents.codex.flags", "agents.cladue", "hq.reviewer", "hq.executor.modle",
                "hqq"]
    assert sorted(config.unknown_keys) == sorted(expected)
    result = cli("doctor", cwd=project)
    assert result.returncode == 0, result.stdout
    for key in expected:
        assert result.stdout.count("unknown key %s (ignored)" % key) == 1, key


def test_a_bad_hq_only_stops_commands_that_launch_agents(project):
    set_config(project, '[checks]\ncommands = ["true"]\n[hq.supervisor]\nagent = "nope"\n'
                        '[hq.executor]\nagent = "codex"\npermissions = "root"\n')
    config = ferrus.Store(str(project)).config()     # check, submit and the waits go on
    assert config.checks.commands == ["true"]
    assert len(config.hq_problems) == 2
    with pytest.raises(ferrus.FerrusError) as err:
        config.require_hq()
    assert 'agent "nope" is unknown' in err.value.message
    messages = [f.problem for f in ferrus.config_findings(str(project))]
    assert any("[hq.executor.permissions]" in m for m in messages)
    assert any('[hq.supervisor] agent "nope"' in m for m in messages)


def test_agent_options_may_use_any_name_of_the_agent(project):
    set_config(project, '[agents.claude-code]\nmcp_isolation = "ferrus-only"\n'
                        '[agents.qwen]\nextra_args = ["--q"]\n')
    config = ferrus.load_config(str(project))
    assert config.agents.claude_mcp_isolation == "ferrus-only"
    assert config.agents.options_for("qwen-code").extra_args == ["--q"]
    assert config.unknown_keys == []


def test_options_for_a_custom_agent_are_known(project):
    set_config(project, '[agents.custom.mycli]\ninteractive = ["m"]\nheadless = ["m"]\n'
                        '[agents.mycli]\nenv = { A = "1" }\n')
    config = ferrus.load_config(str(project))
    assert config.agents.options_for("mycli").env == {"A": "1"}
    assert config.unknown_keys == []
