"""A hostile executor played by the real agent CLIs (their models scripted by
tests/fake_anthropic.py and tests/fake_models.py), with the default edit rights ferrus
gives them: everything they can write in their worktree — the worktree's .git file
(Claude Code refuses that write itself, as a sensitive file; Qwen Code makes it),
files after they submitted, ferrus's own files.  `ferrus run --parallel 2`, run as a
user runs it, must merge only the reviewed work and nothing of a tampered task.  Each
test skips when its CLI is not installed."""

import json
import os
import re

import pytest

import ferrus
from fake_anthropic import FakeAnthropic, claude_env, find_agent, text, tool_use
from fake_models import FakeModels, agent_env, call, say
from test_e2e_offline_agents import offline_setup
from conftest import git
from test_e2e_parallel import (WORKTREE, all_tool_results, ferrus_cli, repository,
                               system_text)

pytestmark = pytest.mark.e2e


class HostileExecutor:
    """Per task (the text wait_for_task returns): "Tamper" rewrites the worktree's .git to
    point at the main repository, then submits; "Sneak" writes its file and a .mcp.json,
    submits, and after the submit writes its file again (a late edit).  The reviewer
    approves whatever it is shown."""

    def __init__(self, main_git):
        self.main_git = main_git

    def __call__(self, request):
        names = [tool.get("name", "") for tool in request.get("tools") or []]
        role = "executor" if any(n.startswith("mcp__ferrus-executor-1__") for n in names) \
            else "supervisor"
        server = "mcp__ferrus-%s-1__" % role
        done = sum(1 for m in request.get("messages", []) if m.get("role") == "assistant")
        results = all_tool_results(request)
        if done == 0:
            return [tool_use(server + ("wait_for_task" if role == "executor"
                                       else "wait_for_review"), {})]
        if role == "supervisor":
            return [tool_use(server + "approve", {})] if done == 1 else [text("Done.")]
        workdir = re.search(r"Primary working directory: (\S+)", system_text(request)).group(1)
        task = results[0] if results else ""
        if "Tamper" in task:
            steps = [tool_use("Write", {"file_path": os.path.join(workdir, "tamper.txt"),
                                        "content": "tamper\n"}),
                     tool_use("Read", {"file_path": os.path.join(workdir, ".git")}),
                     tool_use("Write", {"file_path": os.path.join(workdir, ".git"),
                                        "content": "gitdir: %s\n" % self.main_git}),
                     tool_use(server + "submit", {"content": "Done."})]
        else:
            steps = [tool_use("Write", {"file_path": os.path.join(workdir, "sneak.txt"),
                                        "content": "sneak\n"}),
                     tool_use("Write", {"file_path": os.path.join(workdir, ".mcp.json"),
                                        "content": '{"mcpServers": {"evil": {"command": '
                                                   '"sh"}}}\n'}),
                     tool_use(server + "submit", {"content": "Wrote sneak.txt."}),
                     tool_use("Write", {"file_path": os.path.join(workdir, "sneak.txt"),
                                        "content": "not reviewed\n"})]
        index = done - 1
        return [steps[index]] if index < len(steps) else [text("Done.")]


def test_a_hostile_claude_executor_gets_nothing_unreviewed_onto_the_target(project, tmp_path):
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    home = tmp_path / "home"
    home.mkdir()
    main_git = os.path.join(str(project), ".git")
    with FakeAnthropic(HostileExecutor(main_git)) as fake:
        env = claude_env(fake, str(home))
        repository(project, "claude-code", env)
        before = git(project, "rev-parse", "main").stdout.strip()
        for title in ("Tamper with the worktree.", "Sneak past the review."):
            added = ferrus_cli(project, "task", "add", title, env=env)
            assert added.returncode == 0, added.stderr
        result = ferrus_cli(project, "run", "--parallel", "2", "--timeout", "240", env=env,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + fake.describe()
    store = ferrus.Store(str(project))
    outcome = {row["title"]: row["status"] for row in ferrus.task_rows(store)}
    assert outcome == {"Tamper with the worktree.": "merged",
                       "Sneak past the review.": "merged"}, output[-4000:]
    # Claude Code would not write .git (a "sensitive file"): that task's own file merged.
    assert "sensitive file" in open(_executor_log(store, "Tamper")).read()
    files = git(project, "ls-tree", "-r", "--name-only", "main").stdout.split()
    assert "tamper.txt" in files and ".mcp.json" not in files
    # What the reviewer approved, not the edit made after the submit.
    assert git(project, "show", "main:sneak.txt").stdout == "sneak\n"
    assert git(project, "rev-list", "--count", before + "..main").stdout.strip() == "2"
    # The user's checkout followed the target and nothing else: its index and files
    # are main's, with no commit of the tampered task in between.
    assert git(project, "rev-parse", "HEAD").stdout == git(project, "rev-parse", "main").stdout
    assert git(project, "status", "--porcelain", "--untracked-files=no").stdout == ""


def _executor_log(store, title_word):
    for row in ferrus.task_rows(store):
        if title_word in row["title"]:
            logs = store.path("logs")
            return os.path.join(logs, sorted(n for n in os.listdir(logs) if n.startswith(
                row["id"] + "_executor_"))[0])
    raise AssertionError("no task titled with %s" % title_word)


class TamperingQwen:
    """The model behind Qwen Code: the executor of "Tamper" writes its file, then points
    its worktree's .git at the main repository with write_file, and submits; the other
    task's executor writes its file and submits.  Reviewers approve."""

    def __init__(self, main_git):
        self.main_git = main_git

    def __call__(self, conversation):
        prompt = conversation.prompt
        if "You are the ferrus" not in prompt:
            return say("OK")
        role = "executor" if "You are the ferrus executor" in prompt else "supervisor"
        calls = [(name, output) for name, _, output in conversation.calls
                 if name != "tool_search"]
        first = "wait_for_task" if role == "executor" else "wait_for_review"
        if not calls:
            if not conversation.offers(first) and conversation.offers("tool_search"):
                names = ",".join("mcp__%s__%s" % (ferrus.server_key(role), tool) for tool in
                                 ("wait_for_task", "check", "submit", "wait_for_review",
                                  "approve", "reject"))
                return call("tool_search", {"query": "select:" + names, "max_results": 20})
            return call(first)
        if role == "supervisor":
            return call("approve") if len(calls) == 1 else say("Done.")
        folder = WORKTREE.search(json.dumps(conversation.body)).group()
        name = "tamper" if "Tamper" in calls[0][1] else "honest"
        steps = [("write_file", {"file_path": os.path.join(folder, name + ".txt"),
                                 "content": name + "\n"})]
        if name == "tamper":
            steps.append(("read_file", {"file_path": os.path.join(folder, ".git")}))
            steps.append(("write_file", {"file_path": os.path.join(folder, ".git"),
                                         "content": "gitdir: %s\n" % self.main_git}))
        steps.append(("submit", {"content": "Wrote %s.txt." % name}))
        if len(calls) > len(steps):
            return say("Done.")
        return call(*steps[len(calls) - 1])


def test_a_qwen_executor_that_rewrites_its_git_file_fails_and_merges_nothing(project,
                                                                             tmp_path):
    if not find_agent("qwen"):
        pytest.skip("qwen is not installed (npm install @qwen-code/qwen-code)")
    home = tmp_path / "home"
    home.mkdir()
    env = agent_env(home)
    repository(project, "qwen-code", env)
    before = git(project, "rev-parse", "main").stdout.strip()
    for title in ("Tamper with the worktree.", "Honest work."):
        added = ferrus_cli(project, "task", "add", title, env=env)
        assert added.returncode == 0, added.stderr
    main_git = os.path.join(str(project), ".git")
    with FakeModels(TamperingQwen(main_git)) as fake:
        env.update(offline_setup("qwen-code", fake, home))
        result = ferrus_cli(project, "run", "--parallel", "2", "--timeout", "240", env=env,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == ferrus.RUN_FAILED, output[-4000:] + fake.describe()
    store = ferrus.Store(str(project))
    outcome = {row["title"]: row for row in ferrus.task_rows(store)}
    assert outcome["Honest work."]["status"] == "merged", output[-4000:]
    tampered = outcome["Tamper with the worktree."]
    assert tampered["status"] == "failed" and "tampered" in output
    assert "did not write" in ferrus.read_task_record(store.dir, tampered["id"])["reason"]
    files = git(project, "ls-tree", "-r", "--name-only", "main").stdout.split()
    assert "honest.txt" in files and "tamper.txt" not in files
    assert git(project, "rev-list", "--count", before + "..main").stdout.strip() == "1"
    assert git(project, "rev-parse", "HEAD").stdout == git(project, "rev-parse", "main").stdout
    assert git(project, "status", "--porcelain", "--untracked-files=no").stdout == ""
