"""opencode (npm opencode-ai) as executor and reviewer of a real `ferrus run`, offline.

opencode is registered as a user registers it; `ferrus run` starts `opencode run
--format json` with the role's server and permissions in OPENCODE_CONFIG_CONTENT, and
opencode talks to a scripted chat-completions model (tests/fake_models.py) through an
OpenAI-compatible provider set in the user's opencode config — the recipe of
docs/LOCAL_MODELS.md for Ollama, vLLM and llama.cpp, with the scripted server in their
place.  The executor writes hello.txt with opencode's own write tool, checks and
submits; the reviewer, whose profile denies edits, is offered no write tool and
approves.  Skips when opencode is not installed.
"""

import json
import os
import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, set_config
from fake_models import FakeModels, agent_env, call, find_agent, say
from test_e2e_nano import CHECK

pytestmark = pytest.mark.e2e


def opencode_provider(fake):
    """The user-level opencode config of the recipe: an OpenAI-compatible provider."""
    return {"$schema": "https://opencode.ai/config.json",
            "provider": {"local": {"npm": "@ai-sdk/openai-compatible", "name": "Local server",
                                   "options": {"baseURL": fake.url + "/v1"},
                                   "models": {"coder": {"name": "coder", "tool_call": True}}}},
            "model": "local/coder", "autoupdate": False, "share": "disabled"}


class OpencodeModel:
    def __init__(self, project):
        self.project = project
        self.reviewer_tools = []

    def __call__(self, conversation):
        if "You are the ferrus" not in conversation.prompt:
            return say("OK")               # opencode's own side requests (titles)
        calls = [name for name, _, _ in conversation.calls]
        if "You are the ferrus executor" in conversation.prompt:
            steps = [call("wait_for_task"),
                     call("write", {"filePath": os.path.join(str(self.project), "hello.txt"),
                                    "content": "hi\n"}),
                     call("check"), call("submit", {"content": "Wrote hello.txt."})]
        else:
            self.reviewer_tools.append(sorted(conversation.tools))
            steps = [call("wait_for_review"), call("approve", {"notes": "hello.txt is right"})]
        return steps[len(calls)] if len(calls) < len(steps) else say("Done.")


def test_opencode_takes_a_task_to_complete_offline(project, tmp_path):
    if not find_agent("opencode"):
        pytest.skip("opencode is not installed (npm install opencode-ai)")
    home = tmp_path / "home"
    (home / ".config" / "opencode").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=str(project), check=True)
    set_config(project, "\n[checks]\ncommands = [%s]\n\n[limits]\nwait_timeout_secs = 20\n"
               % json.dumps(CHECK))
    env = agent_env(home, {"OPENCODE_DISABLE_MODELS_FETCH": "1",
                           "OPENCODE_DISABLE_AUTOUPDATE": "1"})
    env["PATH"] = os.path.dirname(find_agent("opencode")) + os.pathsep + env["PATH"]
    env.pop("FERRUS_SESSION", None)
    registered = subprocess.run(FERRUS_CMD + ["register", "--supervisor", "opencode",
                                              "--executor", "opencode"], cwd=str(project),
                                env=env, capture_output=True, text=True)
    assert registered.returncode == 0, registered.stderr
    model = OpencodeModel(project)
    with FakeModels(model) as fake:
        (home / ".config" / "opencode" / "opencode.json").write_text(
            json.dumps(opencode_provider(fake)))
        result = subprocess.run(FERRUS_CMD + ["run", "--task",
                                              "Create hello.txt containing hi.",
                                              "--timeout", "200"],
                                cwd=str(project), env=env, capture_output=True, text=True,
                                timeout=260, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + fake.describe()
    assert "Reviewing → Complete" in result.stdout
    assert (project / "hello.txt").read_text() == "hi\n"
    assert "executor ▸ ferrus check" in result.stdout and "executor ▸ Write" in result.stdout
    assert model.reviewer_tools and not any({"write", "edit", "bash"} & set(tools)
                                            for tools in model.reviewer_tools)
    # Only the reviewer's own server reached the reviewer.
    assert not any(name.startswith("ferrus-executor-1_") for tools in model.reviewer_tools
                   for name in tools)
    store = ferrus.Store(str(project))
    moves = {(e["event"], e["actor"].split("/")[0]) for e in store.read_journal()}
    assert {("submit", "executor:opencode:1"), ("approve", "supervisor:opencode:1")} <= moves
    for record in ferrus.read_session_records(store):
        assert record["input_tokens"] > 0 and record["tool_calls"] > 0, record
