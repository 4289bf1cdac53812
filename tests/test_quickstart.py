"""README's quick start, run as written: its five commands, with the real Claude Code CLI
as executor and reviewer, reach Complete in a fresh git repository.

The commands are read from the README itself (the first ```sh block under "Quick
start"), so changing the quick start without keeping it working fails here.  Only the
model is scripted (tests/fake_anthropic.py); ferrus, its MCP servers and `claude -p` are
real.  Skips when `claude` is not installed (.ci/run installs it from npm).
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

import ferrus
from conftest import FERRUS_CMD
from fake_anthropic import FakeAnthropic, claude_env, find_agent, tool_use, turns_by_ferrus_role

pytestmark = pytest.mark.e2e

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")

TEXT_PY = '''import re


def slugify(text):
    """Lower-case words of `text` joined by hyphens."""
    return "-".join(re.findall(r"[a-z0-9]+", text.lower()))
'''

TEST_PY = '''from text import slugify


def test_slugify():
    assert slugify("Hello, World!") == "hello-world"
'''


def quick_start():
    """(the ferrus commands as argv lists, the [checks] commands line of step 2)."""
    with open(README, encoding="utf-8") as handle:
        readme = handle.read()
    section = readme[readme.index("## Quick start"):]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL).group(1)
    commands = [shlex.split(line, comments=True) for line in block.splitlines()
                if line.startswith("ferrus ")]
    checks = re.search(r"^#\s+(commands = \[.*\])\s*$", block, re.MULTILINE).group(1)
    return commands, checks


def test_the_quick_start_has_five_steps():
    commands, checks = quick_start()
    assert [argv[1] for argv in commands] == ["init", "register", "run", "status"]
    assert checks.startswith("commands = [")


def scripted_model(project):
    """The executor writes text.py and its test, checks and submits; the reviewer approves."""
    steps = {
        "executor": [tool_use("mcp__ferrus-executor-1__wait_for_task", {}),
                     tool_use("Write", {"file_path": str(project / "text.py"),
                                        "content": TEXT_PY}),
                     tool_use("Write", {"file_path": str(project / "test_text.py"),
                                        "content": TEST_PY}),
                     tool_use("mcp__ferrus-executor-1__check", {}),
                     tool_use("mcp__ferrus-executor-1__submit",
                              {"content": "Added slugify(text) to text.py with a test."})],
        "supervisor": [tool_use("mcp__ferrus-supervisor-1__wait_for_review", {}),
                       tool_use("mcp__ferrus-supervisor-1__approve", {})],
    }
    return turns_by_ferrus_role(steps)


def test_the_readme_quick_start_reaches_complete(tmp_path):
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    commands, checks = quick_start()
    project = tmp_path / "your-project"
    project.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    git = ["git", "-c", "user.name=quick start", "-c", "user.email=qs@example.invalid"]
    (project / "README.md").write_text("# demo\n")
    # "A project whose tests run with python3 -m pytest -q": its tests pass before the
    # task (`ferrus run` tries them before any agent starts).
    (project / "test_start.py").write_text("def test_start():\n    assert True\n")
    for argv in (["init", "-q"], ["add", "README.md", "test_start.py"],
                 ["commit", "-q", "-m", "start"]):
        subprocess.run(git + argv, cwd=str(project), check=True, capture_output=True)
    # The check command must find pytest: run it with this interpreter.
    checks = checks.replace('"python3 ', '"%s ' % sys.executable.replace("\\", "/"))
    with FakeAnthropic(scripted_model(project)) as fake:
        env = claude_env(fake, str(home))
        outputs = []
        for argv in commands:
            result = subprocess.run(FERRUS_CMD + argv[1:],
                                    cwd=str(project), env=env, capture_output=True, text=True,
                                    timeout=300, stdin=subprocess.DEVNULL)
            assert result.returncode == 0, (argv, result.stdout[-3000:], result.stderr[-2000:])
            outputs.append(result.stdout)
            if argv[1] == "init":          # step 2: what the README tells the user to edit
                toml = project / "ferrus.toml"
                edited = toml.read_text().replace("commands = []", checks, 1)
                assert edited != toml.read_text()
                toml.write_text(edited)
    assert "Task complete." in outputs[2]
    assert re.search(r"state\s+Complete", outputs[3])
    assert ferrus.Store(str(project)).read_state().state == ferrus.S.COMPLETE
    assert (project / "text.py").read_text() == TEXT_PY
