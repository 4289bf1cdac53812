"""The real Claude Code CLI, launched through ferrus's own adapter argv, drives the loop.

A scripted model server (tests/fake_anthropic.py) stands in for the model, so
the CLI, its MCP connection and ferrus serve are all real.  Skips when `claude`
is not installed (.ci/run installs it from npm).
"""

import json
import os
import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, git, set_config
from fake_anthropic import (FakeAnthropic, ScriptedAgent, claude_env, find_agent, text, tool_use,
                            turns_by_ferrus_role)

pytestmark = pytest.mark.e2e

# hello.txt, once there, must hold "hi" (the checks pass before the task too: `ferrus run`
# tries them on the base before any agent starts).
CONFIG = """
[checks]
commands = ["python3 -c \\"import pathlib, sys; p = pathlib.Path('hello.txt'); sys.exit(p.exists() and p.read_text().strip() != 'hi')\\""]

[limits]
wait_timeout_secs = 20

[hq.supervisor]
agent = "claude-code"

[hq.executor]
agent = "claude-code"
"""


def run_headless(root, role, prompt, script, home):
    config = ferrus.load_config(str(root))
    launch = ferrus.ClaudeCode(config).headless(str(root), role, prompt)
    with FakeAnthropic(script) as fake:
        env = claude_env(fake, str(home))
        env.update(launch.env)
        result = subprocess.run(launch.argv, input=launch.stdin, cwd=str(root), env=env,
                                capture_output=True, text=True, timeout=180)
        return result, fake


def test_claude_executor_then_reviewer_reach_complete(project, tmp_path):
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    home = tmp_path / "home"
    home.mkdir()
    set_config(project, CONFIG)
    ferrus.register_agents(str(project), {"supervisor": ("claude-code", None),
                                          "executor": ("claude-code", None)},
                           report=lambda message: None)
    # A git repository with everything committed: the task's base is a clean HEAD.
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "before the task"]):
        git(project, *args)
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "Create hello.txt containing hi.")
    assert store.read_state().task_base["dirty_count"] == 0

    prompt = ferrus.prompt_executor()
    assert prompt.startswith("You are the ferrus executor")
    executor = ScriptedAgent([
        tool_use("mcp__ferrus-executor-1__wait_for_task", {}),
        tool_use("Write", {"file_path": str(project / "hello.txt"), "content": "hi\n"}),
        tool_use("mcp__ferrus-executor-1__check", {}),
        tool_use("mcp__ferrus-executor-1__submit", {"content": "Wrote hello.txt."}),
        text("Submitted."),
    ])
    result, fake = run_headless(project, "executor", prompt, executor, home)
    assert result.returncode == 0, result.stderr[-2000:] + fake.describe()
    first = json.dumps(fake.main_requests[0]["messages"])
    assert "You are the ferrus executor" in first, "the prompt travelled on stdin"
    results = [r for request in fake.main_requests[1:]
               for r in __import__("fake_anthropic").last_tool_results(request)]
    assert not any(r["is_error"] for r in results), results
    assert (project / "hello.txt").read_text() == "hi\n"
    assert store.read_state().state == ferrus.S.REVIEWING

    seen = []

    def review_the_diff(request, results):
        # The scripted reviewer approves only when wait_for_review showed it the
        # executor's change as a diff (the new file and its one line).
        seen.append(results[0]["content"] if results else "")
        if "+++ b/hello.txt" in seen[-1] and "@@ -0,0 +1 @@" in seen[-1]:
            return tool_use("mcp__ferrus-supervisor-1__approve", {})
        return tool_use("mcp__ferrus-supervisor-1__reject", {"notes": "no diff to review"})

    assert "ferrus://diff" in ferrus.prompt_reviewer()
    reviewer = ScriptedAgent([
        tool_use("mcp__ferrus-supervisor-1__wait_for_review", {}),
        review_the_diff,
        text("Approved."),
    ])
    result, fake = run_headless(project, "supervisor", ferrus.prompt_reviewer(), reviewer, home)
    assert result.returncode == 0, result.stderr[-2000:] + fake.describe()
    assert seen and "+++ b/hello.txt" in seen[0], seen
    assert store.read_state().state == ferrus.S.COMPLETE

    moves = [(e["event"], e["actor"], e["from"], e["to"]) for e in store.read_journal()]
    assert moves == [
        ("create_task", "human", "Idle", "Executing"),
        ("claim", "executor:claude-code:1", "Executing", "Executing"),
        ("check_passed", "executor:claude-code:1", "Executing", "Executing"),
        ("submit", "executor:claude-code:1", "Executing", "Reviewing"),
        ("claim", "supervisor:claude-code:1", "Reviewing", "Reviewing"),
        ("approve", "supervisor:claude-code:1", "Reviewing", "Complete"),
    ]
    # The adapter parses Claude's stream-json into tool calls.
    adapter = ferrus.ClaudeCode(ferrus.load_config(str(project)))
    calls = [event.name for line in result.stdout.splitlines()
             for event in adapter.parse_line(line) if event.kind == "tool_call"]
    assert calls == ["mcp__ferrus-supervisor-1__wait_for_review",
                     "mcp__ferrus-supervisor-1__approve"]


# -- each CLI's own `mcp list` after ferrus init + register --------------------------------

def isolated_env(home):
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1",
               DISABLE_AUTOUPDATER="1", NO_COLOR="1")
    env.pop("CODEX_HOME", None)
    directory = os.environ.get("FERRUS_AGENT_BIN")
    if directory:
        env["PATH"] = directory + os.pathsep + env.get("PATH", "")
    return env


def registered_repo(tmp_path, agent, trust):
    """A fresh git repository after `ferrus init` and `ferrus register` (as a user runs them)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    env = isolated_env(home)
    git(repo, "init", "-q")
    for args in (["init"], ["register", "--supervisor", agent, "--executor", agent]
                 + (["--trust"] if trust else [])):
        result = subprocess.run(FERRUS_CMD + args,
                                cwd=str(repo), env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    return repo, env


def mcp_list(binary, repo, env):
    found = find_agent(binary)
    if not found:
        pytest.skip("%s is not installed (.ci/run installs it from npm)" % binary)
    result = subprocess.run([found, "mcp", "list"], cwd=str(repo), env=env, capture_output=True,
                            text=True, timeout=180)
    return result.stdout + result.stderr


def server_lines(output):
    return {key: [l for l in output.splitlines() if key + ":" in l or l.startswith(key + " ")]
            for key in ("ferrus-supervisor-1", "ferrus-executor-1")}


@pytest.mark.parametrize("agent,binary", [("qwen-code", "qwen"), ("gemini-cli", "gemini")])
def test_settings_json_agents_list_both_roles_connected(tmp_path, agent, binary):
    if not find_agent(binary):
        pytest.skip("%s is not installed (.ci/run installs it from npm)" % binary)
    repo, env = registered_repo(tmp_path, agent, trust=True)
    output = mcp_list(binary, repo, env)
    for key, lines in server_lines(output).items():
        assert lines and "Connected" in lines[0] and "Disconnected" not in lines[0], output


def test_codex_mcp_list_shows_both_roles_in_a_trusted_project(tmp_path):
    if not find_agent("codex"):
        pytest.skip("codex is not installed (.ci/run installs it from npm)")
    repo, env = registered_repo(tmp_path, "codex", trust=True)
    output = mcp_list("codex", repo, env)
    for key, lines in server_lines(output).items():
        assert lines and "enabled" in lines[0], output
        assert os.path.dirname(ferrus.FERRUS_FILE) in lines[0]


def test_codex_headless_argv_reaches_the_server_without_trust(tmp_path):
    """Codex ignores .codex/config.toml in untrusted projects; the launch injects it."""
    if not find_agent("codex"):
        pytest.skip("codex is not installed (.ci/run installs it from npm)")
    repo, env = registered_repo(tmp_path, "codex", trust=False)
    launch = ferrus.Codex(ferrus.load_config(str(repo))).headless(str(repo), "executor", "p")
    overrides = [a for i, a in enumerate(launch.argv) if i and launch.argv[i - 1] == "-c"]
    argv = [find_agent("codex"), "mcp", "list"]
    for override in overrides:
        argv += ["-c", override]
    result = subprocess.run(argv, cwd=str(repo), env=env, capture_output=True, text=True,
                            timeout=120)
    lines = server_lines(result.stdout)
    assert lines["ferrus-executor-1"] and "enabled" in lines["ferrus-executor-1"][0], result.stdout
    assert not lines["ferrus-supervisor-1"] or "disabled" in lines["ferrus-supervisor-1"][0]


def test_claude_accepts_the_entry_register_wrote(tmp_path):
    """`claude mcp list` only shows user/project/local servers, so the entry from
    .claude/mcp-executor.json is added at local scope and health-checked."""
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed")
    repo, env = registered_repo(tmp_path, "claude-code", trust=False)
    for role in ferrus.ROLES:
        key = ferrus.server_key(role)
        entry = json.loads((repo / ".claude" / ("mcp-%s.json" % role)).read_text())["mcpServers"][key]
        added = subprocess.run([find_agent("claude"), "mcp", "add-json", "-s", "local", key,
                                json.dumps(entry)], cwd=str(repo), env=env, capture_output=True,
                               text=True, timeout=60)
        assert added.returncode == 0, added.stderr
    output = mcp_list("claude", repo, env)
    for key, lines in server_lines(output).items():
        assert lines and "Connected" in lines[0], output


def claude_loop(project, tmp_path):
    """A project whose supervisor and executor are Claude Code, and a model script that
    plays both: the executor writes hello.txt, checks and submits; the reviewer approves.
    Returns (the scripted turn function, the isolated HOME)."""
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    home = tmp_path / "home"
    home.mkdir()
    set_config(project, CONFIG)
    ferrus.register_agents(str(project), {"supervisor": ("claude-code", None),
                                          "executor": ("claude-code", None)},
                           report=lambda message: None)
    steps = {
        "executor": [tool_use("mcp__ferrus-executor-1__wait_for_task", {}),
                     tool_use("Write", {"file_path": str(project / "hello.txt"),
                                        "content": "hi\n"}),
                     tool_use("mcp__ferrus-executor-1__check", {}),
                     tool_use("mcp__ferrus-executor-1__submit", {"content": "Wrote hello.txt."})],
        "supervisor": [tool_use("mcp__ferrus-supervisor-1__wait_for_review", {}),
                       tool_use("mcp__ferrus-supervisor-1__approve", {})],
    }
    return turns_by_ferrus_role(steps), home


def test_ferrus_run_with_real_claude_reaches_complete(project, tmp_path):
    """`ferrus run --task ...` supervises real `claude -p` sessions (executor, reviewer)."""
    turn, home = claude_loop(project, tmp_path)
    with FakeAnthropic(turn) as fake:
        env = claude_env(fake, str(home))
        result = subprocess.run(FERRUS_CMD + ["run", "--task", "Create hello.txt containing hi.",
                                              "--timeout", "240"],
                                cwd=str(project), env=env, capture_output=True, text=True,
                                timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Reviewing → Complete" in result.stdout
    store = ferrus.Store(str(project))
    assert store.read_state().state == ferrus.S.COMPLETE
    assert (project / "hello.txt").read_text() == "hi\n"
    actors = {(e["event"], e["actor"].partition("/")[0]) for e in store.read_journal()}
    assert ("submit", "executor:claude-code:1") in actors
    assert ("approve", "supervisor:claude-code:1") in actors
    # Claude passed HQ's FERRUS_SESSION to its ferrus server: the lease named the session.
    assert all(e["actor"].startswith("executor:claude-code:1/s-")
               for e in store.read_journal() if e["event"] == "submit")
    assert_usage_from_claude_result_events(store)


def claude_results(store, record):
    """The result events in a session's raw log: what Claude itself reported."""
    events = []
    with open(os.path.join(store.root, record["log"]), encoding="utf-8") as handle:
        for line in handle:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue          # the log's own lines ($ argv, [exit 0]) and stderr
    return [event for event in events if isinstance(event, dict) and event.get("type") == "result"]


def assert_usage_from_claude_result_events(store, pipeline=None):
    """Every session's record holds the tokens and cost of Claude's result event (the
    fake model server reports usage in every response; Claude prices it), and `ferrus
    usage` adds them up."""
    records = [r for r in ferrus.read_session_records(store) if r.get("pipeline") == pipeline]
    assert records
    for record in records:
        results = claude_results(store, record)
        assert results, "no result event in %s" % record["log"]
        usage = results[-1]["usage"]
        assert record["cost_usd"] == results[-1]["total_cost_usd"] and record["cost_usd"] > 0
        assert record["input_tokens"] == usage["input_tokens"] + usage.get(
            "cache_creation_input_tokens", 0) + usage.get("cache_read_input_tokens", 0) > 0
        assert record["output_tokens"] == usage["output_tokens"] > 0
        assert record["outcome"] == "success" and record["model"], record
    report = json.loads(subprocess.run(
        FERRUS_CMD + ["usage", "--json"], cwd=store.root,
        capture_output=True, text=True, check=True).stdout)
    group = report["pipelines"][0] if pipeline else report["tasks"][0]
    assert group["sessions"] == len(records) and group["cost_unknown"] == 0
    assert group["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in records))
    assert group["input_tokens"] == sum(r["input_tokens"] for r in records)


def test_pipeline_run_with_real_claude_workers_delivers_and_archives(project, tmp_path):
    """`ferrus pipeline init` + `ferrus pipeline run research "FSA architecture"`, every
    worker a real `claude -p` whose scripted model writes the worker's output file."""
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    import re
    home = tmp_path / "home"
    home.mkdir()
    set_config(project, CONFIG)
    ferrus.register_agents(str(project), {"executor": ("claude-code", None)},
                           report=lambda message: None)

    def turn(request):
        if any(m.get("role") == "assistant" for m in request.get("messages", [])):
            return [text("Written.")]
        prompt = json.dumps(request.get("messages", []))
        output = re.search(r"exactly this file: ([^\s\"\\]+)", prompt).group(1)
        role = os.path.splitext(os.path.basename(output))[0]
        return [tool_use("Write", {"file_path": output,
                                   "content": "# %s\n\nFindings about FSA architecture.\n" % role})]

    subprocess.run(FERRUS_CMD + ["pipeline", "init"], cwd=str(project),
                   check=True, capture_output=True)
    with FakeAnthropic(turn, is_main=lambda request: bool(request.get("tools"))) as fake:
        env = claude_env(fake, str(home))
        result = subprocess.run(FERRUS_CMD + ["pipeline", "run", "research",
                                 "FSA architecture"], cwd=str(project), env=env,
                                capture_output=True, text=True, timeout=300,
                                stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    archive = project / ".ferrus" / "pipelines" / "archive"
    runs = list(archive.iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("research-")
    final = (runs[0] / "synthesizer.md").read_text()
    assert final.startswith("# synthesizer")
    for role in ("researcher-a", "researcher-b"):
        assert (runs[0] / ("%s.md" % role)).exists()
    status = json.loads((runs[0] / "status.json").read_text())
    assert status["result_delivered"] is True
    assert_usage_from_claude_result_events(ferrus.Store(str(project)), pipeline=runs[0].name)


def test_hq_task_flow_with_real_claude_reaches_complete(project, tmp_path):
    """HQ (plain lines) with `/task TEXT`: real `claude -p` executor and reviewer."""
    import time
    turn, home = claude_loop(project, tmp_path)
    store = ferrus.Store(str(project))
    with FakeAnthropic(turn) as fake:
        proc = subprocess.Popen(FERRUS_CMD + ["hq", "--no-tui"],
                                cwd=str(project), env=claude_env(fake, str(home)),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            proc.stdin.write("/task Create hello.txt containing hi.\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 180
            while store.read_state().state != ferrus.S.COMPLETE:
                assert time.monotonic() < deadline, "HQ did not reach Complete"
                time.sleep(0.2)
            proc.stdin.write("/quit\n")
            proc.stdin.flush()
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0
    assert "Reviewing → Complete" in out and "Task complete." in out
    assert (project / "hello.txt").read_text() == "hi\n"
