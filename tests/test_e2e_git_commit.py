"""[git] branch and commit with the real Claude Code CLI: `ferrus run` takes a task from a
clean repository to Complete, and the task's branch then holds its commit.

A scripted model server (tests/fake_anthropic.py) stands in for the model; the CLI, its
MCP connection, ferrus and git are all real.  Skips when `claude` is not installed."""

import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, git, set_config
from fake_anthropic import FakeAnthropic, claude_env
from test_e2e_agents import CONFIG, claude_loop

pytestmark = pytest.mark.e2e


def test_ferrus_run_with_real_claude_commits_the_task_on_its_branch(project, tmp_path):
    turn, home = claude_loop(project, tmp_path)
    set_config(project, CONFIG + '\n[git]\nbranch = "ferrus/{task_id}"\n'
                                 'commit = "on_approve"\n')
    git(project, "init", "-q")
    git(project, "config", "user.name", "Test User")
    git(project, "config", "user.email", "test@example.com")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "before the task")
    start = git(project, "rev-parse", "HEAD").stdout.strip()
    with FakeAnthropic(turn) as fake:
        env = claude_env(fake, str(home))
        result = subprocess.run(FERRUS_CMD + ["run",
                                 "--task", "Create hello.txt containing hi.", "--timeout", "240"],
                                cwd=str(project), env=env, capture_output=True, text=True,
                                timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    store = ferrus.Store(str(project))
    data = store.read_state()
    assert data.state == ferrus.S.COMPLETE
    branch = "ferrus/" + data.task_id
    assert "ferrus run: the task works on the new git branch %s" % branch in result.stdout
    # After Complete: HEAD is on the task's branch, one commit past the base, and that
    # commit holds hello.txt and nothing of ferrus's or Claude's own files.
    assert git(project, "symbolic-ref", "--short", "HEAD").stdout.strip() == branch
    head = git(project, "rev-parse", "HEAD").stdout.strip()
    assert git(project, "rev-parse", "HEAD~1").stdout.strip() == start
    assert git(project, "rev-parse", "main").stdout.strip() == start
    assert git(project, "show", "--name-status", "--format=", "HEAD").stdout.split() == \
        ["A", "hello.txt"]
    message = git(project, "log", "-1", "--format=%B").stdout
    assert message.startswith("Create hello.txt containing hi.\n\nWrote hello.txt.\n")
    assert git(project, "log", "-1",
               "--format=%(trailers:key=Ferrus-Task,valueonly)").stdout.strip() \
        == data.task_id
    assert data.task_commit["commit"] == head and data.task_commit["branch"] == branch
    approve = [e for e in store.read_journal() if e["event"] == "approve"]
    assert approve[-1]["detail"]["commit"] == head[:12]
    assert "Committed the task's changes as %s on branch %s" % (head[:12], branch) \
        in result.stdout
    assert git(project, "status", "--porcelain").stdout.strip() == ""
