"""The real Claude Code CLI, as ferrus's executor, asks the repository graph where a name
is defined (repository_graph_search) and about a file's neighbours
(repository_graph_context), and gets file:line answers, and asks project memory
(project_context_search) why an earlier task was sent back.

A scripted model server (tests/fake_anthropic.py) stands in for the model, so the CLI,
its MCP connection to `ferrus serve` and the tools are all real.  Skips when `claude`
is not installed."""

import json
import os
import subprocess

import pytest

import ferrus
from conftest import set_config
from fake_anthropic import (FakeAnthropic, ScriptedAgent, claude_env, find_agent,
                            last_tool_results, text, tool_use)

pytestmark = pytest.mark.e2e

CONFIG = """
[limits]
max_review_cycles = 1
wait_timeout_secs = 20

[hq.supervisor]
agent = "claude-code"

[hq.executor]
agent = "claude-code"
"""

SETTINGS = '''"""Settings of the app."""
import json


class Settings:
    def __init__(self, path):
        self.path = path


def load_settings(path):
    with open(path) as handle:
        return Settings(json.load(handle))
'''

MAIN = '''from app.settings import load_settings


def main():
    return load_settings("app.json")
'''


def test_claude_asks_the_graph_and_memory_and_gets_file_line_answers(project, tmp_path):
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    home = tmp_path / "home"
    home.mkdir()
    set_config(project, CONFIG)
    os.makedirs(str(project / "app"))
    (project / "app" / "__init__.py").write_text("")
    (project / "app" / "settings.py").write_text(SETTINGS)
    (project / "app" / "main.py").write_text(MAIN)
    ferrus.register_agents(str(project), {"supervisor": ("claude-code", None),
                                          "executor": ("claude-code", None)},
                           report=lambda message: None)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(["git"] + args, cwd=str(project), env=env, check=True)
    store = ferrus.Store(str(project))
    # An earlier task, rejected for a reason the next executor should hear.
    ferrus.op_create_task(store, ferrus.HUMAN, "Cache the settings loader.")
    executor = ferrus.Caller("executor", "executor:test:1")
    reviewer = ferrus.Caller("supervisor", "supervisor:test:1")
    ferrus.op_wait_for_task(store, executor)
    ferrus.op_submit(store, executor, "Cached settings in a global dict.")
    ferrus.op_wait_for_review(store, reviewer)
    ferrus.op_reject(store, reviewer, "No global dict for the settings cache: keep it on "
                                      "the Settings object.")
    ferrus.memory_after_task_end(store)
    ferrus.op_reset(store, reviewer)
    ferrus.graph_index(store)
    ferrus.op_create_task(store, ferrus.HUMAN, "Make load_settings cache what it read.")

    answers = {}

    def remember(name):
        def step(request, results):
            answers[name] = results[0] if results else None
            return {"search": tool_use("mcp__ferrus-executor-1__repository_graph_context",
                                       {"target": "app/settings.py"}),
                    "context": tool_use("mcp__ferrus-executor-1__project_context_search",
                                        {"query": "settings cache"}),
                    "memory": text("I know where to look.")}[name]
        return step
    script = ScriptedAgent([
        tool_use("mcp__ferrus-executor-1__repository_graph_search", {"query": "load_settings"}),
        remember("search"), remember("context"), remember("memory")])
    config = ferrus.load_config(str(project))
    launch = ferrus.ClaudeCode(config).headless(str(project), "executor",
                                                ferrus.prompt_executor())
    with FakeAnthropic(script) as fake:
        run_env = claude_env(fake, str(home))
        run_env.update(launch.env)
        result = subprocess.run(launch.argv, input=launch.stdin, cwd=str(project),
                                env=run_env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:] + fake.describe()
    assert set(answers) == {"search", "context", "memory"}, fake.describe()
    for name, answer in answers.items():
        assert answer is not None and not answer["is_error"], (name, answer)
    # Claude Code hands the model the structured content (the JSON), not the prose: the
    # locations are in both.
    assert "app/settings.py:10" in answers["search"]["content"]        # def load_settings
    context = answers["context"]["content"]
    assert "app/main.py:1" in context                                  # who imports it
    assert "imported_by" in context or "imports it" in context
    assert "app/main.py:5" in context and "load_settings" in context   # who calls it
    assert "No global dict for the settings cache" in answers["memory"]["content"]
    calls = [json.loads(line).get("type") for line in result.stdout.splitlines()
             if line.startswith("{")]
    assert calls, "claude printed its stream"
    assert last_tool_results(fake.main_requests[-1])
