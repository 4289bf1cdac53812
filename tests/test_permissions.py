"""Per-role permission profiles, pipeline workers without ferrus's tools, agent aliases,
and what `ferrus agents` / `ferrus doctor` say about them (issue #10, items 1, 7, 9)."""

import json
import os
import sys

import pytest

import ferrus
from conftest import run_cli, set_config

ROLE_FLAGS = {
    # agent: (flag, value for the executor's default, value for the reviewer's default)
    "claude-code": ("--permission-mode", "acceptEdits", "default"),
    "codex": ("--sandbox", "workspace-write", "read-only"),
    "qwen-code": ("--approval-mode", "auto-edit", "default"),
    "gemini-cli": ("--approval-mode", "auto_edit", "default"),
}


def flag_value(argv, flag):
    assert flag in argv, argv
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("agent", sorted(ROLE_FLAGS))
def test_default_profiles_let_the_executor_edit_and_keep_the_reviewer_read_only(project, agent):
    config = ferrus.load_config(str(project))
    adapter = ferrus.adapter_for(config, agent)
    flag, executor_value, reviewer_value = ROLE_FLAGS[agent]
    executor = adapter.headless(str(project), "executor", "p").argv
    reviewer = adapter.headless(str(project), "supervisor", "p").argv
    assert flag_value(executor, flag) == executor_value
    assert flag_value(reviewer, flag) == reviewer_value
    if agent == "claude-code":
        assert "--disallowedTools=Edit,Write,NotebookEdit" in reviewer
        assert not any(a.startswith("--disallowedTools") for a in executor)


@pytest.mark.parametrize("agent", sorted(ROLE_FLAGS))
def test_hq_permissions_override_the_default(project, agent):
    full = {"claude-code": "bypassPermissions", "codex": "danger-full-access",
            "qwen-code": "yolo", "gemini-cli": "yolo"}
    set_config(project, '[hq.executor]\nagent = "%s"\npermissions = "full"\n\n'
                        '[hq.supervisor]\nagent = "%s"\npermissions = "edit"\n' % (agent, agent))
    config = ferrus.load_config(str(project))
    adapter = ferrus.adapter_for(config, agent)
    flag, executor_value, _ = ROLE_FLAGS[agent]
    assert flag_value(adapter.headless(str(project), "executor", "p").argv, flag) == full[agent]
    assert flag_value(adapter.headless(str(project), "supervisor", "p").argv,
                      flag) == executor_value
    assert ferrus.effective_permissions(config, "executor") == (
        "full", "[hq.executor] permissions in ferrus.toml")


def test_a_bad_permissions_value_is_refused_with_the_choices(project):
    set_config(project, '[hq.executor]\nagent = "codex"\npermissions = "write"\n')
    config = ferrus.load_config(str(project))
    with pytest.raises(ferrus.FerrusError) as err:
        config.require_hq()
    assert "hq.executor.permissions" in err.value.message
    assert '"read-only", "edit", "full"' in err.value.message and '"write"' in err.value.message


def test_user_args_come_after_the_profile_so_they_still_win(project):
    set_config(project, '[agents.claude-code]\nheadless_args = ["--permission-mode", "plan"]\n')
    config = ferrus.load_config(str(project))
    argv = ferrus.ClaudeCode(config).headless(str(project), "executor", "p").argv
    assert argv.index("acceptEdits") < argv.index("plan")


def test_claude_waits_for_its_ferrus_server_before_the_first_turn(project):
    config = ferrus.load_config(str(project))
    launch = ferrus.ClaudeCode(config).headless(str(project), "executor", "p")
    assert launch.env["MCP_CONNECTION_NONBLOCKING"] == "false"


def test_gemini_trusts_the_folder_through_the_environment(project):
    config = ferrus.load_config(str(project))
    gemini = ferrus.GeminiCli(config)
    for launch in (gemini.headless(str(project), "executor", "p"),
                   gemini.interactive(str(project), "supervisor", None),
                   gemini.worker(str(project), "p", "", "/x/out.md")):
        assert launch.env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"


# -- pipeline workers ------------------------------------------------------------------

def test_workers_get_no_ferrus_server_and_may_write(project, monkeypatch):
    root = str(project)
    for agent in ferrus.BUILTIN_AGENTS:
        ferrus.register_agents(root, {"supervisor": (agent, None), "executor": (agent, None)},
                               report=lambda m: None)
    monkeypatch.setattr(ferrus.AgentAdapter, "executable", lambda self: "/bin/" + self.binary)
    monkeypatch.setenv("HOME", str(project / "home"))
    config = ferrus.load_config(root)
    output = os.path.join(root, "out.md")

    def worker(agent):
        return ferrus.pipeline_worker_launch(config, agent, root, "PROMPT", "", (), output)

    claude = worker("claude-code").argv
    assert not any("mcp" in arg.lower() and "config" in arg for arg in claude)
    assert not any("ferrus-executor-1" in arg for arg in claude)
    assert flag_value(claude, "--permission-mode") == "default"

    codex = worker("codex").argv
    for key in ("ferrus-executor-1", "ferrus-supervisor-1"):
        assert "mcp_servers.%s.enabled=false" % key in codex
        assert not any(a.startswith("mcp_servers.%s.args" % key) for a in codex)
    assert flag_value(codex, "--sandbox") == "workspace-write"

    for agent in ("qwen-code", "gemini-cli"):
        argv = worker(agent).argv
        allowed = argv[argv.index("--allowed-mcp-server-names") + 1]
        assert not allowed.startswith("ferrus-executor") and "--mcp-config" not in argv
        assert flag_value(argv, "--approval-mode") in ("auto-edit", "auto_edit")


def test_qwen_workers_keep_the_users_other_servers(project, monkeypatch):
    home = project / "home"
    (home / ".qwen").mkdir(parents=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps({"mcpServers": {"docs": {}}}))
    monkeypatch.setenv("HOME", str(home))
    root = str(project)
    ferrus.register_agents(root, {"executor": ("qwen-code", None)}, report=lambda m: None)
    argv = ferrus.QwenCode(ferrus.load_config(root)).worker(root, "p", "", "/x/o.md").argv
    allowed = argv[argv.index("--allowed-mcp-server-names") + 1:argv.index("--approval-mode")]
    assert allowed == ["docs"]


def test_custom_workers_get_an_mcp_config_without_servers(project, monkeypatch):
    set_config(project, '[agents.custom.mine]\ninteractive = ["mine"]\n'
                        'headless = ["mine", "--mcp", "{mcp_config}", "{prompt}"]\n')
    config = ferrus.load_config(str(project))
    monkeypatch.setattr(ferrus.AgentAdapter, "executable", lambda self: "/bin/mine")
    launch = ferrus.pipeline_worker_launch(config, "mine", str(project), "P", "", (), "/x/o.md")
    path = launch.argv[launch.argv.index("--mcp") + 1]
    assert json.loads(open(path).read()) == {"mcpServers": {}}


# -- aliases -------------------------------------------------------------------------------

@pytest.mark.parametrize("alias,agent", sorted(ferrus.AGENT_ALIASES.items()))
def test_register_accepts_the_binary_name(project, alias, agent):
    result = run_cli("register", "--executor", alias, cwd=project)
    assert result.returncode == 0, result.stderr
    config = ferrus.load_config(str(project))
    assert config.executor.agent == agent
    assert 'agent = "%s"' % agent in (project / "ferrus.toml").read_text()


def test_config_accepts_the_binary_name(project):
    set_config(project, '[hq.executor]\nagent = "claude"\n')
    assert ferrus.load_config(str(project)).require_hq().executor.agent == "claude-code"


# -- ferrus agents and doctor --------------------------------------------------------------

def test_agents_show_the_profile_and_warn_when_the_executor_cannot_edit(project, monkeypatch):
    root = str(project)
    ferrus.register_agents(root, {"supervisor": ("codex", None), "executor": ("claude-code", None)},
                           report=lambda m: None)
    monkeypatch.setattr(ferrus.AgentAdapter, "executable", lambda self: "/bin/" + self.binary)
    supervisor, executor = ferrus.agents_report(root, probe=lambda argv: "1.0")
    assert supervisor["permissions"] == "read-only"
    assert supervisor["permission_args"] == ["--sandbox", "read-only"]
    assert executor["permissions"] == "edit" and "warnings" not in executor
    text = (project / "ferrus.toml").read_text().replace(
        'agent = "claude-code"', 'agent = "claude-code"\npermissions = "read-only"')
    set_config(project, text)
    executor = ferrus.agents_report(root, probe=lambda argv: "1.0")[1]
    assert "cannot edit files" in executor["warnings"][0]["warning"]
    doctor = run_cli("doctor", cwd=project)
    assert "warning: the executor (claude-code) cannot edit files" in doctor.stdout
    assert 'permissions = "edit"' in doctor.stdout


def test_agents_name_another_python_for_what_it_is(project, monkeypatch, tmp_path):
    root = str(project)
    ferrus.register_agents(root, {"supervisor": ("claude-code", None),
                                  "executor": ("claude-code", None)}, report=lambda m: None)
    path = project / ".claude" / "mcp-executor.json"
    data = json.loads(path.read_text())
    other_python = tmp_path / "bin" / "python3"
    other_python.parent.mkdir()
    other_python.symlink_to(sys.executable)
    data["mcpServers"]["ferrus-executor-1"]["command"] = str(other_python)
    path.write_text(json.dumps(data))
    monkeypatch.setattr(ferrus.AgentAdapter, "executable", lambda self: "/bin/" + self.binary)
    executor = ferrus.agents_report(root, probe=lambda argv: "1.0")[1]
    assert "problem" not in executor, "another Python still works"
    warning = executor["warnings"][0]["warning"]
    assert warning.startswith("registered with another Python (%s)" % other_python)
    assert "another ferrus or project" not in json.dumps(executor)

    data["mcpServers"]["ferrus-executor-1"]["command"] = str(tmp_path / "gone" / "python3")
    path.write_text(json.dumps(data))
    executor = ferrus.agents_report(root, probe=lambda argv: "1.0")[1]
    assert "a Python that is gone" in executor["problem"]

    data["mcpServers"]["ferrus-executor-1"]["command"] = sys.executable
    args = data["mcpServers"]["ferrus-executor-1"]["args"]
    args[args.index("-C") + 1] = str(tmp_path / "elsewhere")
    path.write_text(json.dumps(data))
    executor = ferrus.agents_report(root, probe=lambda argv: "1.0")[1]
    assert executor["problem"] == "its MCP entry serves another project (%s)" % (
        tmp_path / "elsewhere")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_claude_full_as_root_is_a_warning_until_the_sandbox_says_so(project):
    set_config(project, '[hq.executor]\nagent = "claude-code"\npermissions = "full"\n')
    warnings = ferrus.permission_warnings(ferrus.load_config(str(project)), "executor")
    assert "refuses" in warnings[0][0] and "IS_SANDBOX" in warnings[0][1]
    set_config(project, '[hq.executor]\nagent = "claude-code"\npermissions = "full"\n\n'
                        '[agents.claude-code]\nenv = { IS_SANDBOX = "1" }\n')
    assert ferrus.permission_warnings(ferrus.load_config(str(project)), "executor") == []


def test_hq_agents_command_shows_profile_and_warnings(project, monkeypatch):
    import io
    set_config(project, '[hq.supervisor]\nagent = "codex"\n\n'
                        '[hq.executor]\nagent = "codex"\npermissions = "read-only"\n')
    monkeypatch.setattr(ferrus.AgentAdapter, "executable", lambda self: None)
    out = io.StringIO()
    shell = ferrus.HqShell(ferrus.Store(str(project)), stdin=io.StringIO(""), stdout=out)
    shell.handle("/agents")
    text = out.getvalue()
    assert "executor: codex — codex is not installed, permissions read-only" in text
    assert "warning: the executor (codex) cannot edit files" in text
