"""Agent adapters: argv for every mode, register/unregister (the names and models it takes,
the files it writes and takes back), `ferrus agents`, prompts."""

import dataclasses
import json
import os
import sys

import pytest

import ferrus
from conftest import run_cli, set_config

BIG = "x" * (1024 * 1024)
DASHED = "--help me: this prompt starts like a flag"


@pytest.fixture
def config(project):
    return ferrus.load_config(str(project))


def adapters(config):
    return [ferrus.ClaudeCode(config), ferrus.Codex(config), ferrus.QwenCode(config),
            ferrus.GeminiCli(config)]


# -- argv ------------------------------------------------------------------------------

@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("prompt", ["do the task", DASHED, BIG])
def test_headless_prompt_travels_on_stdin_never_in_argv(project, config, index, prompt):
    adapter = adapters(config)[index]
    launch = adapter.headless(str(project), "executor", prompt)
    assert launch.stdin == prompt, "no argv limit, no flag confusion"
    assert all(prompt not in arg for arg in launch.argv)
    assert launch.argv[0] == adapter.binary
    assert sum(len(a) for a in launch.argv) < 20000


@pytest.mark.parametrize("index", range(4))
def test_model_flag_only_when_a_model_is_set(project, config, index):
    adapter = adapters(config)[index]
    without = adapter.headless(str(project), "executor", "p").argv
    with_model = adapter.headless(str(project), "executor", "p", "  ").argv
    assert "--model" not in without and with_model == without, "a blank model is no model"
    chosen = adapter.headless(str(project), "executor", "p", "big-model").argv
    assert chosen[chosen.index("--model") + 1] == "big-model"
    inter = adapter.interactive(str(project), "supervisor", None, "big-model").argv
    assert inter[inter.index("--model") + 1] == "big-model"


def test_claude_argv(project, config):
    root = str(project)
    launch = ferrus.ClaudeCode(config).headless(root, "executor", "p", "opus")
    assert launch.argv == [
        "claude", "--mcp-config=" + os.path.join(root, ".claude", "mcp-executor.json"),
        "--model", "opus", "--allowedTools=mcp__ferrus-executor-1__*",
        "--permission-mode", "acceptEdits", "--output-format", "stream-json", "--verbose", "-p"]
    assert int(launch.env["MCP_TOOL_TIMEOUT"]) > config.limits.wait_timeout_secs * 1000
    # -p must not start its first turn before ferrus's server is connected
    assert launch.env["MCP_CONNECTION_NONBLOCKING"] == "false"
    interactive = ferrus.ClaudeCode(config).interactive(root, "supervisor", DASHED)
    assert interactive.argv[-2:] == ["--", DASHED], "a dash prompt is never read as a flag"
    assert interactive.argv[1].startswith("--mcp-config="), \
        "the = form stops the variadic --mcp-config from eating the prompt"
    assert ferrus.ClaudeCode(config).interactive(root, "supervisor").argv[-1] != "--"


def test_claude_ferrus_only_isolation_adds_strict(project):
    set_config(project, '[agents.claude]\nmcp_isolation = "ferrus-only"\n')
    config = ferrus.load_config(str(project))
    assert "--strict-mcp-config" in ferrus.ClaudeCode(config).headless(str(project), "executor",
                                                                       "p").argv


def test_codex_argv_injects_its_server_so_untrusted_projects_work(project, config):
    root = str(project)
    argv = ferrus.Codex(config).headless(root, "executor", "p").argv
    assert argv[:4] == ["codex", "exec", "--json", "--skip-git-repo-check"] and argv[-1] == "-"
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "-c"]
    assert 'mcp_servers.ferrus-executor-1.command="%s"' % sys.executable in overrides
    assert 'mcp_servers.ferrus-executor-1.default_tools_approval_mode="approve"' in overrides
    timeout = [o for o in overrides if ".tool_timeout_sec=" in o][0]
    assert int(timeout.split("=")[1]) > config.limits.wait_timeout_secs
    args = [o for o in overrides if ".args=" in o][0]
    assert ferrus.parse_toml("a = " + args.split("=", 1)[1])["a"][-6:] == [
        "--role", "executor", "--agent-name", "codex", "--agent-index", "1"]
    assert not any("ferrus-supervisor-1" in o for o in overrides)
    ferrus.register_agents(root, {"supervisor": ("codex", None)}, report=lambda m: None)
    argv = ferrus.Codex(ferrus.load_config(root)).headless(root, "executor", "p").argv
    assert "mcp_servers.ferrus-supervisor-1.enabled=false" in argv, "the other role is hidden"
    assert 'mcp_servers.ferrus-supervisor-1.command="%s"' % sys.executable in argv, \
        "an enabled-only table is invalid config in an untrusted project"


def test_qwen_and_gemini_argv_allow_only_their_role_server(project, config):
    root = str(project)
    qwen = ferrus.QwenCode(config).headless(root, "supervisor", "p").argv
    assert qwen[qwen.index("--allowed-mcp-server-names") + 1] == "ferrus-supervisor-1"
    servers = json.loads(qwen[qwen.index("--mcp-config") + 1])["mcpServers"]
    assert list(servers) == ["ferrus-supervisor-1"] and servers["ferrus-supervisor-1"]["trust"]
    assert qwen[-1] == ferrus.STDIN_PROMPT_POINTER
    gemini = ferrus.GeminiCli(config).headless(root, "executor", "p").argv
    assert "--skip-trust" in gemini
    assert gemini[gemini.index("--allowed-mcp-server-names") + 1] == "ferrus-executor-1"
    inter = ferrus.GeminiCli(config).interactive(root, "executor", DASHED).argv
    assert inter[-1] == "--prompt-interactive=" + DASHED


def test_user_options_are_added(project):
    set_config(project, """
[agents.codex]
extra_args = ["--sandbox", "workspace-write"]
headless_args = ["--ephemeral"]
interactive_args = ["--search"]
env = { CODEX_X = "1" }
""")
    config = ferrus.load_config(str(project))
    headless = ferrus.Codex(config).headless(str(project), "executor", "p")
    assert headless.argv[-4:] == ["--sandbox", "workspace-write", "--ephemeral", "-"]
    assert headless.env == {"CODEX_X": "1"}
    interactive = ferrus.Codex(config).interactive(str(project), "executor", None)
    assert interactive.argv[-3:] == ["--sandbox", "workspace-write", "--search"]


def test_custom_agent_templates(project):
    set_config(project, """
[agents.custom.mycli]
interactive = ["mycli", "--model", "{model}", "--mcp", "{mcp_config}", "{prompt}"]
headless = ["mycli", "run", "--role", "{role}", "--model", "{model}"]
prompt = "stdin"

[hq.executor]
agent = "mycli"
""")
    config = ferrus.load_config(str(project))
    assert config.executor.agent == "mycli"
    adapter = ferrus.adapter_for(config, "mycli")
    launch = adapter.headless(str(project), "executor", DASHED)
    assert launch.argv == ["mycli", "run", "--role", "executor"] and launch.stdin == DASHED
    launch = adapter.interactive(str(project), "supervisor", "hi", "m1")
    assert launch.argv == ["mycli", "--model", "m1", "--mcp",
                           os.path.join(str(project), ".ferrus", "mcp-supervisor.json"), "hi"]
    ferrus.register_agents(str(project), {"executor": ("mycli", None)}, report=lambda m: None)
    entry = adapter.registration(str(project), "executor")
    assert ferrus.entry_points_here(entry, str(project))


@pytest.mark.parametrize("text,fragment", [
    ('[agents.custom.x]\nheadless = ["x"]\n', "needs interactive"),
    ('[agents.custom.x]\ninteractive = ["x"]\nheadless = ["x"]\nprompt = "file"\n', "prompt"),
    ('[agents.codex]\nextra_args = "--yolo"\n', "must be an array of strings"),
])
def test_bad_agent_options_are_explained(project, text, fragment):
    set_config(project, text)
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.load_config(str(project))
    assert fragment in err.value.message


# -- parsing agent output --------------------------------------------------------------

def test_output_parsers(config):
    claude = ferrus.ClaudeCode(config)
    line = json.dumps({"type": "assistant", "message": {"content": [
        {"type": "tool_use", "name": "mcp__ferrus-executor-1__check", "input": {}}],
        "usage": {"input_tokens": 10, "output_tokens": 5}}})
    events = claude.parse_line(line)
    assert [(e.kind, e.name) for e in events] == [("tool_call", "mcp__ferrus-executor-1__check"),
                                                  ("usage", "")]
    assert events[1].input_tokens == 10 and events[1].output_tokens == 5
    limit = claude.parse_line(json.dumps({"type": "result", "result":
                                          "You've hit your limit · resets 3pm (UTC)"}))
    assert limit[0].kind == "limit" and limit[0].text.startswith("3pm")
    codex = ferrus.Codex(config)
    assert codex.parse_line(json.dumps({"type": "item.completed", "item": {
        "type": "mcp_tool_call", "server": "ferrus-executor-1", "tool": "submit",
        "status": "failed"}}))[0].ok is False
    usage = codex.parse_line(json.dumps({"type": "turn.completed", "usage": {
        "input_tokens": 7, "output_tokens": 3}}))[0]
    assert (usage.input_tokens, usage.output_tokens) == (7, 3)
    assert codex.parse_line("not json") == []
    gemini = ferrus.GeminiCli(config)
    assert gemini.parse_line(json.dumps({"type": "tool_use", "tool_name": "x"}))[0].name == "x"


# -- register ----------------------------------------------------------------------------

USER_CLAUDE_SETTINGS = {"permissions": {"allow": ["Bash(ls:*)"], "deny": ["WebFetch"]},
                        "theme": "dark"}
USER_CODEX = """# my codex settings
model = "o3"   # keep this comment

[mcp_servers.docs]
command = "docs-server"  # and this one
"""


def snapshot(root):
    out = {}
    for base, _, files in os.walk(str(root)):
        if "/.ferrus" in base:
            continue
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as handle:
                out[os.path.relpath(path, str(root))] = handle.read()
    return out


def test_register_twice_on_top_of_user_content_is_idempotent(project):
    root = str(project)
    (project / ".claude").mkdir()
    (project / ".claude/settings.local.json").write_text(json.dumps(USER_CLAUDE_SETTINGS))
    (project / ".codex").mkdir()
    (project / ".codex/config.toml").write_text(USER_CODEX)
    (project / "CLAUDE.md").write_text("# House rules\n")
    (project / ".qwen").mkdir()
    (project / ".qwen/settings.json").write_text('{"theme": "x", "mcpServers": {"mine": {}}}')
    run = lambda: ferrus.register_agents(root, {"supervisor": ("claude-code", "opus"),
                                                "executor": ("codex", None)},
                                         report=lambda m: None)
    run()
    first = snapshot(project)
    run()
    assert snapshot(project) == first, "a second register changes nothing"
    settings = json.loads((project / ".claude/settings.local.json").read_text())
    assert settings["theme"] == "dark" and settings["permissions"]["deny"] == ["WebFetch"]
    assert settings["permissions"]["allow"] == ["Bash(ls:*)", "mcp__ferrus-supervisor-1__*"]
    servers = json.loads((project / ".claude/mcp-supervisor.json").read_text())["mcpServers"]
    assert list(servers) == ["ferrus-supervisor-1"]
    assert ferrus.entry_points_here(servers["ferrus-supervisor-1"], root)
    codex = (project / ".codex/config.toml").read_text()
    assert codex.startswith(USER_CODEX), "comments and user settings kept"
    data = ferrus.parse_toml(codex)
    assert set(data["mcp_servers"]) == {"docs", "ferrus-executor-1"}
    server = data["mcp_servers"]["ferrus-executor-1"]
    assert set(server["tools"]) == {t.name for t in ferrus.tools_for_role("executor")}
    assert server["tool_timeout_sec"] > ferrus.load_config(root).limits.wait_timeout_secs
    claude_md = (project / "CLAUDE.md").read_text()
    assert claude_md.startswith("# House rules\n")
    assert claude_md.count("<!-- ferrus-supervisor-instructions -->") == 1
    assert "must not override" in claude_md
    assert (project / "AGENTS.md").read_text().count("ferrus-executor-instructions -->") == 2
    config = ferrus.load_config(root)
    assert (config.supervisor.agent, config.supervisor.model) == ("claude-code", "opus")
    assert (config.executor.agent, config.executor.model) == ("codex", "")
    gitignore = (project / ".gitignore").read_text().splitlines()
    for entry in (".claude/mcp-supervisor.json", ".claude/settings.local.json",
                  ".codex/config.toml"):
        assert gitignore.count(entry) == 1


def test_register_every_agent_for_both_roles(project):
    root = str(project)
    for agent in ferrus.BUILTIN_AGENTS:
        ferrus.register_agents(root, {"supervisor": (agent, None), "executor": (agent, None)},
                               report=lambda m: None)
        config = ferrus.load_config(root)
        for role in ferrus.ROLES:
            entry = ferrus.adapter_for(config, agent).registration(root, role)
            assert ferrus.entry_points_here(entry, root), (agent, role)
    qwen = json.loads((project / ".qwen/settings.json").read_text())["mcpServers"]
    assert set(qwen) == {"ferrus-supervisor-1", "ferrus-executor-1"}
    assert (project / "GEMINI.md").exists() and (project / "QWEN.md").exists()


def test_unregister_removes_what_register_added(project):
    root = str(project)
    (project / ".codex").mkdir()
    (project / ".codex/config.toml").write_text(USER_CODEX)
    (project / "AGENTS.md").write_text("# Agents\n")
    before = {name: (project / name).read_text() for name in (".codex/config.toml", "AGENTS.md")}
    ferrus.register_agents(root, {"executor": ("codex", None)}, report=lambda m: None)
    ferrus.unregister_agents(root, ["executor"], report=lambda m: None)
    assert {name: (project / name).read_text() for name in before} == before


def test_unregister_removes_the_files_it_emptied(project, cli):
    (project / "CLAUDE.md").write_text("# my notes\n")
    gitignore_before = (project / ".gitignore").read_text()
    before = sorted(os.listdir(str(project)))
    for agent in ("claude-code", "codex", "qwen-code", "gemini-cli"):
        assert cli("register", "--supervisor", agent, "--executor", agent,
                   cwd=project).returncode == 0
        result = cli("unregister", cwd=project)
        assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(str(project))) == before
    assert (project / ".gitignore").read_text() == gitignore_before
    assert (project / "CLAUDE.md").read_text().startswith("# my notes")


def test_unregister_keeps_a_file_with_other_content(project, cli):
    (project / ".qwen").mkdir()
    (project / ".qwen" / "settings.json").write_text('{"theme": "dark"}')
    cli("register", "--executor", "qwen-code", cwd=project)
    cli("unregister", cwd=project)
    assert '"theme": "dark"' in (project / ".qwen" / "settings.json").read_text()


def test_register_model_rules_and_flat_hq_migration(project):
    """Upstream bug 10: a stale model survived an agent switch; flat [hq] broke loading."""
    root = str(project)
    set_config(project, '# keep me\n[hq]\nsupervisor = "codex"  # old style\nexecutor = "codex"\n')
    ferrus.register_agents(root, {"executor": ("claude-code", "  sonnet  ")},
                           report=lambda m: None)
    config = ferrus.load_config(root)
    assert (config.executor.agent, config.executor.model) == ("claude-code", "sonnet")
    assert config.supervisor.agent == "codex"
    assert (project / "ferrus.toml").read_text().startswith("# keep me\n")
    ferrus.register_agents(root, {"executor": ("qwen-code", None)}, report=lambda m: None)
    config = ferrus.load_config(root)
    assert (config.executor.agent, config.executor.model) == ("qwen-code", "")


def test_setting_a_model_says_which_model_was_written(project):
    """Setting a role's model (`/model`, `ferrus register --executor-model`) names the
    model written, or cleared, not only the agent."""
    said = []
    ferrus.update_hq_config(str(project), "executor", "codex", "gpt-big ", said.append)
    ferrus.update_hq_config(str(project), "executor", "codex", "", said.append)
    ferrus.update_hq_config(str(project), "supervisor", "codex", None, said.append)
    assert said == [
        'Set [hq.executor] agent = "codex", model = "gpt-big" in ferrus.toml',
        'Set [hq.executor] agent = "codex", model = "" (the agent\'s own default) in ferrus.toml',
        'Set [hq.supervisor] agent = "codex" in ferrus.toml']
    assert ferrus.load_config(str(project)).require_hq().executor.model == ""


def test_register_validates_before_writing_anything(project, cli):
    """Upstream bug 11: files were half written before an error."""
    result = cli("register", "--supervisor", "claude-code", "--executor", "nope", cwd=project)
    assert result.returncode == 1 and "Unknown agent 'nope'" in result.stderr
    assert not (project / ".claude").exists()
    result = cli("register", "--supervisor-model", "x", cwd=project)
    assert result.returncode == 2
    assert "At least one of --supervisor or --executor must be specified" in result.stderr
    result = cli("register", "--executor", "codex", "--supervisor-model", "x", cwd=project)
    assert "--supervisor-model requires --supervisor" in result.stderr
    empty = project.parent / "empty"
    empty.mkdir()
    result = cli("register", "--executor", "codex", cwd=empty)
    assert "ferrus.toml not found" in result.stderr and not (empty / ".codex").exists()


def test_a_mistyped_agent_name_gets_the_closest_known_one(project):
    """The short names are listed, and the name meant is suggested."""
    result = run_cli("register", "--supervisor", "claud", "--executor", "codex", cwd=project)
    assert result.returncode == 1
    assert "Unknown agent 'claud'. Supported values: \"claude-code\", \"codex\", " \
        "\"qwen-code\", \"gemini-cli\", \"nano\", \"opencode\", \"goose\" (or \"claude\", " \
        "\"qwen\", \"gemini\" for short)" in result.stderr
    assert 'hint: did you mean "claude"? Otherwise describe it under [agents.custom.<name>]' \
        in result.stderr
    far = run_cli("register", "--supervisor", "zzz", "--executor", "codex", cwd=project)
    assert "hint: or describe it under [agents.custom.<name>]" in far.stderr


def test_bare_register_registers_the_agents_ferrus_toml_names(project, capsys):
    root = str(project)
    config = ferrus.load_config(root)
    expected = {"supervisor": config.supervisor.agent, "executor": config.executor.agent}
    capsys.readouterr()
    assert ferrus.main(["-C", root, "register"]) == 0
    out = capsys.readouterr().out
    assert "Registering the agents ferrus.toml names" in out
    for role, agent in expected.items():
        assert "%s %s" % (role, agent) in out
    rows = {row["role"]: row for row in ferrus.agents_report(root, probe=lambda argv: None)}
    assert rows["executor"]["agent"] == expected["executor"]


def test_bare_register_without_configured_agents_says_how(project, capsys):
    (project / "ferrus.toml").write_text('[checks]\ncommands = ["true"]\n')
    assert ferrus.main(["-C", str(project), "register"]) == 2
    err = capsys.readouterr().err
    assert "At least one of --supervisor or --executor" in err and "[hq.supervisor]" in err


def test_register_refuses_a_broken_user_file(project):
    (project / ".claude").mkdir()
    (project / ".claude/settings.local.json").write_text("{not json")
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.register_agents(str(project), {"supervisor": ("claude-code", None)},
                               report=lambda m: None)
    assert "settings.local.json" in err.value.message
    assert (project / ".claude/settings.local.json").read_text() == "{not json"


def test_trust_writes_user_level_trust(project, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("CODEX_HOME", raising=False)
    ferrus.register_agents(str(project), {"supervisor": ("gemini-cli", None),
                                          "executor": ("codex", None)},
                           trust=True, report=lambda m: None)
    codex = ferrus.parse_toml((home / ".codex/config.toml").read_text())
    assert codex["projects"][str(project)]["trust_level"] == "trusted"
    folders = json.loads((home / ".gemini/trustedFolders.json").read_text())
    assert folders[str(project)] == "TRUST_FOLDER"


# -- ferrus agents -------------------------------------------------------------------------

def test_agents_report(project, monkeypatch):
    root = str(project)
    ferrus.register_agents(root, {"supervisor": ("claude-code", None)}, report=lambda m: None)
    monkeypatch.setattr(ferrus.AgentAdapter, "executable",
                        lambda self: "/bin/" + self.binary if self.binary == "claude" else None)
    rows = ferrus.agents_report(root, probe=lambda argv: "2.1.197 (Claude Code)")
    supervisor, executor = rows
    assert supervisor["points_here"] and supervisor["version"] == "2.1.197 (Claude Code)"
    assert "problem" not in supervisor
    assert executor["agent"] == "codex" and executor["problem"] == "codex is not installed"
    assert executor["hint"] == "npm install -g @openai/codex"


def test_agents_cli_says_what_is_missing(project):
    result = run_cli("agents", cwd=project, env={"PATH": "/nonexistent"})
    assert result.returncode == 1
    assert "not installed" in result.stdout and "npm install -g @openai/codex" in result.stdout


def test_probe_version_is_bounded():
    assert ferrus.probe_version([sys.executable, "-c", "import time; time.sleep(30)"],
                                timeout=0.5) == ""
    assert ferrus.probe_version([sys.executable, "-c", "print('v 1.2')"]) == "v 1.2"
    assert ferrus.probe_version(["/nonexistent/binary"]) == ""


# -- prompts ----------------------------------------------------------------------------------

def test_prompts_name_their_tools_in_order():
    def order(text, *tools):
        positions = [text.index("/" + tool) for tool in tools]
        assert positions == sorted(positions), tools
    order(ferrus.prompt_executor(), "wait_for_task", "check", "submit")
    order(ferrus.prompt_reviewer(), "wait_for_review", "review_pending", "approve")
    order(ferrus.prompt_consultant(), "respond_consult")
    order(ferrus.prompt_executor_after_answer(), "wait_for_answer", "wait_for_task", "submit")
    order(ferrus.prompt_executor_in_consultation(), "wait_for_consult", "check", "submit")
    assert "/create_task" in ferrus.prompt_task_definition()
    assert "/create_spec" in ferrus.prompt_spec() and "ferrus://spec_template" in ferrus.prompt_spec()
    for prompt in (ferrus.prompt_executor(), ferrus.prompt_reviewer(), ferrus.prompt_spec(),
                   ferrus.prompt_consultant(True), ferrus.prompt_task_definition()):
        assert "supporting context only" in prompt
    worker = ferrus.prompt_pipeline_worker("FSA", "research X", ["a.md"], "out/b.md")
    assert "out/b.md" in worker and "a.md" in worker and "FSA" in worker


def test_task_prompt_with_a_milestone():
    milestone = ferrus.Milestone("#1.1", "m1.1", "Login", ["#1.0"], False, 4)
    text = ferrus.prompt_task_definition(milestone, "docs/specs/a.md")
    assert "Spec: docs/specs/a.md\nMilestone: #1.1 Login\nMilestone ID: m1.1\nCompleted: no\n" \
           "Depends on: #1.0" in text


def state(s, paused=None, asked=None):
    return ferrus.StateData(state=s, paused_state=paused, question_from=asked)


def test_prompt_selection_fixes_upstream_hq_bugs_6_to_9():
    S = ferrus.S
    # 9: no executor for states that need none.
    for s in (S.IDLE, S.FAILED, S.COMPLETE, S.REVIEWING):
        assert ferrus.executor_prompt_for(state(s), False) is None
    # 8: an answer already recorded (state restored) still gets the resume prompt.
    assert ferrus.executor_prompt_for(state(S.EXECUTING), True) == \
        ferrus.prompt_executor_after_answer()
    assert ferrus.executor_prompt_for(state(S.EXECUTING), False) == ferrus.prompt_executor()
    assert ferrus.executor_prompt_for(state(S.AWAITING_HUMAN, S.ADDRESSING), False) == \
        ferrus.prompt_executor_awaiting_answer()
    # 6/7: a consultation (even one whose consultant asked a human) keeps the executor
    # waiting on the consultation, and the consultant gets its own prompt.
    assert ferrus.executor_prompt_for(state(S.AWAITING_HUMAN, S.CONSULTATION,
                                            "supervisor:x:1"), False) == \
        ferrus.prompt_executor_in_consultation()
    assert ferrus.executor_prompt_for(state(S.CONSULTATION), False) == \
        ferrus.prompt_executor_in_consultation()


def test_the_controller_gives_reviewer_and_consultant_their_prompts(store):
    S = ferrus.S
    controller = ferrus.HqController(store, emit=lambda message: None)
    needed = controller.needed_slots(state(S.REVIEWING))
    assert needed == {"reviewer": ferrus.prompt_reviewer()}
    needed = controller.needed_slots(state(S.CONSULTATION))
    assert needed["consultant"] == ferrus.prompt_consultant(False)
    # A consultant that already ran once resumes the consultation.
    slot = controller.slots["consultant"]
    slot.session = dataclasses.replace(slot.session, session_seq=1)
    needed = controller.needed_slots(state(S.CONSULTATION))
    assert needed["consultant"] == ferrus.prompt_consultant(True)
    assert "consultant" not in controller.needed_slots(state(S.EXECUTING))
