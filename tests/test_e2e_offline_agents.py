"""Codex, Qwen Code and Gemini CLI as headless executor and reviewer, offline.

`ferrus run --task` supervises the real CLIs with the argv `ferrus register`
gives them by default; tests/fake_models.py scripts the model behind each one
(OpenAI Responses for Codex, OpenAI chat completions for Qwen Code, the Gemini
API for Gemini CLI).  The executor's model writes hello.txt with the CLI's own
file tool, ferrus's check verifies the content, the reviewer approves.  Each
test skips when its CLI is not installed.
"""

import json
import os
import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, git, set_config
from fake_models import FakeModels, agent_env, call, find_agent, say

pytestmark = pytest.mark.e2e

# hello.txt, once there, must hold "hi": true before the task too (`ferrus run` tries the
# checks on the base before any agent starts).
CHECK = ("python3 -c \"import pathlib, sys; p = pathlib.Path('hello.txt'); "
         "sys.exit(p.exists() and p.read_text().strip() != 'hi')\"")

CONFIG = """
[checks]
commands = [%s]

[limits]
wait_timeout_secs = 20
""" % json.dumps(CHECK)

# agent -> (binary, the tool its model writes files with)
AGENTS = {"codex": "codex", "qwen-code": "qwen", "gemini-cli": "gemini"}


def offline_setup(agent, fake, home):
    """Point ``agent`` at ``fake``: the CLI's own provider settings in the isolated HOME
    and environment, nothing in the project (ferrus's files stay as register wrote them)."""
    if agent == "codex":
        (home / ".codex").mkdir()
        (home / ".codex" / "config.toml").write_text(
            'model_provider = "fake"\nmodel = "fake-model"\n\n[model_providers.fake]\n'
            'name = "fake"\nbase_url = "%s/v1"\nwire_api = "responses"\n'
            'env_key = "FAKE_MODEL_KEY"\n' % fake.url)
        # With bubblewrap installed Codex sandboxes commands through a helper it links
        # into CODEX_HOME, and refuses to when CODEX_HOME is under the temporary folder
        # (as the tests' HOME is): a TMPDIR of its own keeps HOME out of it.
        (home / "tmp").mkdir()
        return {"FAKE_MODEL_KEY": "fake-key", "TMPDIR": str(home / "tmp")}
    if agent == "qwen-code":
        return {"OPENAI_BASE_URL": fake.url + "/v1", "OPENAI_API_KEY": "fake-key",
                "OPENAI_MODEL": "fake-model"}
    (home / ".gemini").mkdir()
    (home / ".gemini" / "settings.json").write_text(json.dumps(
        {"security": {"auth": {"selectedType": "gemini-api-key"}}}))
    return {"GOOGLE_GEMINI_BASE_URL": fake.url, "GEMINI_API_KEY": "fake-key"}


class Loop:
    """The model for both roles: the executor claims, writes hello.txt, checks and
    submits; the reviewer first tries to write a file (its read-only profile must
    stop that), then claims the review and approves."""

    def __init__(self, project):
        self.project = project
        self.reviewer_offered_writes = []

    def write(self, conversation, name, content):
        if conversation.offers("write_file"):           # Qwen Code, Gemini CLI
            return call("write_file", {"file_path": os.path.join(str(self.project), name),
                                       "content": content})
        return call("exec_command", {"cmd": "printf '%s' > %s" % (content.replace("\n", "\\n"),
                                                                   name)})      # Codex

    def __call__(self, conversation):
        prompt = conversation.prompt
        if "You are the ferrus" not in prompt:
            return say("OK")            # the CLI's own helpers (Qwen's memory agent, ...)
        if "You are the ferrus executor" in prompt:
            role = "executor"
            steps = ["wait_for_task", ("hello.txt", "hi\n"), "check", "submit"]
        else:
            role = "supervisor"
            if conversation.offers("write_file"):
                self.reviewer_offered_writes.append(conversation.protocol)
            steps = ["wait_for_review", "approve"]
            if conversation.offers("exec_command"):
                steps.insert(0, ("reviewer-was-here.txt", "x"))     # Codex's sandbox refuses
        done = [name for name, _, _ in conversation.calls if name != "tool_search"]
        if len(done) >= len(steps):
            return say("Done.")
        step = steps[len(done)]
        if isinstance(step, tuple):
            return self.write(conversation, *step)
        args = {"content": "Wrote hello.txt; the check passes."} if step == "submit" else {}
        if not conversation.offers(step) and conversation.offers("tool_search"):
            # Qwen Code offers MCP tools only after the model asks for them by name.
            names = ",".join("mcp__%s__%s" % (ferrus.server_key(role), tool)
                             for tool in ("wait_for_task", "check", "submit", "wait_for_review",
                                          "approve"))
            return call("tool_search", {"query": "select:" + names, "max_results": 20})
        return call(step, args)


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_ferrus_run_with_real_agent_as_executor_and_reviewer(agent, project, tmp_path):
    binary = find_agent(AGENTS[agent])
    if not binary:
        pytest.skip("%s is not installed (npm install %s)" % (
            AGENTS[agent], ferrus.ADAPTERS[agent].package))
    home = tmp_path / "home"
    home.mkdir()
    git(project, "init", "-q")
    set_config(project, CONFIG)
    env = agent_env(home)
    registered = subprocess.run(FERRUS_CMD + ["register", "--supervisor",
                                 agent, "--executor", agent], cwd=str(project), env=env,
                                capture_output=True, text=True)
    assert registered.returncode == 0, registered.stderr
    loop = Loop(project)
    with FakeModels(loop) as fake:
        env.update(offline_setup(agent, fake, home))
        result = subprocess.run(FERRUS_CMD + ["run", "--task",
                                 "Create hello.txt containing hi.", "--timeout", "240"],
                                cwd=str(project), env=env, capture_output=True, text=True,
                                timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout[-3000:] + result.stderr[-2000:] +
                                    fake.describe())
    assert "Reviewing → Complete" in result.stdout
    assert (project / "hello.txt").read_text() == "hi\n"
    assert not (project / "reviewer-was-here.txt").exists(), "the reviewer is read-only"
    assert not loop.reviewer_offered_writes, "a read-only reviewer is offered no write tool"
    store = ferrus.Store(str(project))
    assert store.read_state().state == ferrus.S.COMPLETE
    # Actors carry the agent session HQ gave each agent (FERRUS_SESSION reached the server).
    assert all("/s-" in e["actor"] for e in store.read_journal() if e["event"] == "submit")
    moves = {(e["event"], e["actor"].split("/")[0]) for e in store.read_journal()}
    assert ("check_passed", "executor:%s:1" % agent) in moves
    assert ("submit", "executor:%s:1" % agent) in moves
    assert ("approve", "supervisor:%s:1" % agent) in moves
    # Each session's record has the tokens the CLI reported from the fake model's usage;
    # none of these CLIs reports a cost, and `ferrus usage` says so.
    records = ferrus.read_session_records(store)
    assert {r["slot"] for r in records} >= {"executor", "reviewer"}
    for record in records:
        assert record["input_tokens"] > 0 and record["output_tokens"] > 0, record
        assert record["cost_usd"] is None and record["tool_calls"] > 0, record
    usage = subprocess.run(FERRUS_CMD + ["usage"], cwd=str(project),
                           capture_output=True, text=True, check=True).stdout
    assert "cost unknown" in usage and "cost is known only where" in usage
