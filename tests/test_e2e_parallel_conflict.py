"""Two parallel tasks that rewrite the same lines, with the real Claude Code CLI: the one
integrated second conflicts with the target, ferrus merges the target into its branch
itself (git's conflict markers left in the file), and its executor -- a real `claude -p`
that can only edit files -- resolves the conflict with its Read and Write tools, checks and
submits again; both tasks are merged and no marker ever reaches the target.

The model behind the CLI is scripted (tests/fake_anthropic.py); the CLI, its MCP
connection to ferrus, ferrus and git are real.  Skips when `claude` is not installed.
"""

import json
import os
import re

import pytest

import ferrus
from conftest import set_config
from fake_anthropic import FakeAnthropic, claude_env, find_agent, text, tool_use
from test_e2e_parallel import ferrus_cli, git, system_text

pytestmark = pytest.mark.e2e

# greeting.txt must hold at least one line and no conflict marker line: true on the
# target, on each task alone, and on the resolved merge -- false while markers are left.
CHECK = ("python3 -c \"import re, sys; text = open('greeting.txt').read(); "
         "sys.exit(not text.strip() or bool(re.search('^(<{7}|={7}|>{7})', text, re.M)))\"")

CONFIG = """
[checks]
commands = [%s]

[limits]
wait_timeout_secs = 20
max_review_cycles = 3
""" % json.dumps(CHECK)

# The task says which line greeting.txt should hold instead of the one it has.
TASK_TEXT = re.compile(r"Replace the line of greeting\.txt with: (hello from \w+)")
# What the conflict notes name (ferrus's review notes after `conflict_handed_over`).
CONFLICTED = re.compile(r"Conflicted files: ([^\n]+)")
# A line of what Claude Code's Read tool returns: its number, an arrow or a tab, the text.
READ_LINE = re.compile(r"^\s*(\d+)(?:\u2192|\t)(.*)$")
MARKER_LINE = re.compile(r"^(?:<{7}|={7}|>{7})(?: |$)")


def conversation(request):
    """The conversation so far as (tool name, its result text) pairs in order, and
    whether the latest user message is a new prompt rather than tool results."""
    names, pairs, prompt = {}, [], True
    for message in request.get("messages") or []:
        content = message.get("content")
        blocks = content if isinstance(content, list) else [{"type": "text",
                                                             "text": str(content)}]
        if message.get("role") == "assistant":
            for block in blocks:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    names[block.get("id")] = block.get("name", "")
        elif message.get("role") == "user":
            results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
            prompt = not results
            for block in results:
                body = block.get("content")
                if isinstance(body, list):
                    body = "\n".join(part.get("text", "") for part in body
                                     if isinstance(part, dict))
                pairs.append((names.get(block.get("tool_use_id"), ""), str(body or "")))
    return pairs, prompt


def handed(result):
    """What wait_for_task / wait_for_review returned, as a dict (empty when not JSON)."""
    try:
        value = json.loads(result)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def resolved(read_result):
    """The file Claude's Read tool showed, with every conflict marker line left out: both
    sides of each conflict kept, one after the other."""
    lines = [found.group(2) for found in map(READ_LINE.match, read_result.splitlines())
             if found]
    if lines and not lines[-1]:
        lines.pop()         # Read numbers the empty "line" after the file's last newline
    return "".join(line + "\n" for line in lines if not MARKER_LINE.match(line))


class SameLines:
    """The model behind every `claude -p` of the run.  The executor reads greeting.txt,
    writes the line its task names, checks and submits; when wait_for_task hands it
    review notes naming conflicted files, it reads each of them and writes it back without
    the marker lines instead.  The reviewer approves a diff that adds its task's line and
    holds no marker."""

    def __init__(self):
        self.resolutions = []     # (task id, file, what Read showed, what was written)
        self.rounds = []          # (role, task id, state wait_for_task/_review returned)
        self.reviewed = []        # (task id, the diff its reviewer was shown)

    def __call__(self, request):
        names = [tool.get("name", "") for tool in request.get("tools") or []]
        role = "executor" if any(n.startswith("mcp__ferrus-executor-1__") for n in names) \
            else "supervisor"
        server = "mcp__ferrus-%s-1__" % role
        first = server + ("wait_for_task" if role == "executor" else "wait_for_review")
        pairs, prompt = conversation(request)
        if prompt:
            return [tool_use(first, {})]
        starts = [i for i, (name, _) in enumerate(pairs) if name == first]
        if not starts:
            return [text("Done.")]
        task = handed(pairs[starts[-1]][1])
        since = pairs[starts[-1] + 1:]
        found = TASK_TEXT.search(task.get("task", ""))
        if not found:
            return [text("No task reached me: %s" % pairs[starts[-1]][1][:300])]
        line = found.group(1)
        if not since:
            self.rounds.append((role, task.get("task_id"), task.get("state")))
        if role == "supervisor":
            if since:
                return [text("Done.")]
            diff = task.get("diff", "")
            self.reviewed.append((task.get("task_id"), diff))
            if "+" + line in diff and "<<<<<<<" not in diff and ">>>>>>>" not in diff:
                return [tool_use(server + "approve", {})]
            return [tool_use(server + "reject", {"notes": "the diff lacks '%s' or holds a "
                                                          "conflict marker: %s" % (line, diff[:400])})]
        workdir = re.search(r"Primary working directory: (\S+)", system_text(request)).group(1)
        conflicted = CONFLICTED.search(task.get("review") or "")
        files = [name.strip() for name in conflicted.group(1).split(",")] if conflicted \
            else ["greeting.txt"]
        steps = []
        for name in files:
            path = os.path.join(workdir, name)
            steps.append(("Read", {"file_path": path}))
            if conflicted:
                steps.append(("Write", lambda shown, path=path, name=name: self.resolve(
                    task.get("task_id"), name, path, shown)))
            else:
                steps.append(("Write", lambda shown, path=path: {"file_path": path,
                                                                 "content": line + "\n"}))
        steps += [(server + "check", {}),
                  (server + "submit", {"content": "greeting.txt says '%s'%s." % (
                      line, ", the conflict with the target resolved keeping both lines"
                      if conflicted else "")})]
        if len(since) >= len(steps):
            return [text("Done.")]
        name, arguments = steps[len(since)]
        if callable(arguments):
            arguments = arguments(since[-1][1])
        return [tool_use(name, arguments)]

    def resolve(self, task, name, path, shown):
        content = resolved(shown)
        self.resolutions.append((task, name, shown, content))
        return {"file_path": path, "content": content}


def test_a_conflict_between_two_parallel_tasks_is_resolved_by_real_claude(project, tmp_path):
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    home = tmp_path / "home"
    home.mkdir()
    model = SameLines()
    with FakeAnthropic(model) as fake:
        env = claude_env(fake, str(home))
        git(project, "init", "-q")
        git(project, "config", "user.name", "Test User")
        git(project, "config", "user.email", "test@example.com")
        set_config(project, CONFIG)
        registered = ferrus_cli(project, "register", "--supervisor", "claude-code",
                                "--executor", "claude-code", env=env)
        assert registered.returncode == 0, registered.stderr
        (project / "greeting.txt").write_text("hello\n")
        git(project, "add", "-A")
        git(project, "commit", "-qm", "before the tasks")
        tasks = {}
        for name in ("alpha", "beta"):
            added = ferrus_cli(project, "task", "add", "Replace the line of greeting.txt "
                               "with: hello from %s" % name, env=env)
            assert added.returncode == 0, added.stderr
            tasks[re.search(r"Task (t-\S+) queued", added.stdout).group(1)] = name
        result = ferrus_cli(project, "run", "--parallel", "2", "--timeout", "300", env=env,
                            timeout=360)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + fake.describe()
    assert "report: 2 merged" in output, output[-4000:]

    rows = {row["id"]: row for row in json.loads(ferrus_cli(project, "tasks", "--json").stdout)
            ["tasks"]}
    assert {task: rows[task]["status"] for task in tasks} == {task: "merged" for task in tasks}

    # The task integrated second is the one that conflicted, and only it.
    store = ferrus.Store(str(project))
    entries = store.read_journal()
    failed = [e for e in entries if e["event"] == "integration_failed"]
    assert [(e["detail"].get("cause"), e["to"]) for e in failed] == [("conflict", "Addressing")]
    second = failed[0]["task_id"]
    first = next(task for task in tasks if task != second)
    handovers = [e for e in entries if e["event"] == "conflict_handed_over"]
    assert [(e["task_id"], e["detail"]["files"]) for e in handovers] == \
        [(second, ["greeting.txt"])]
    integrated = [e["task_id"] for e in entries if e["event"] == "integrated"]
    assert integrated == [first, second]
    assert store.for_task(second).read_state().review_cycles == 1
    assert store.for_task(first).read_state().review_cycles == 0

    # Its executor was handed the conflict as review notes, saw the markers with its Read
    # tool, and wrote the file back with both sides' lines.
    assert ("executor", second, "Addressing") in model.rounds
    assert len(model.resolutions) == 1
    task, name, shown, written = model.resolutions[0]
    assert (task, name) == (second, "greeting.txt")
    assert "<<<<<<<" in shown and ">>>>>>>" in shown, repr(shown)
    assert sorted(written.splitlines()) == sorted(["hello from alpha", "hello from beta"])

    # Its reviewer was shown its own work on top of the target (the line it adds), not the
    # first task's line the target already had.
    diffs = [diff for task, diff in model.reviewed if task == second]
    assert len(diffs) == 2
    assert "+hello from %s" % tasks[second] in diffs[1], diffs[1]
    assert "+hello from %s" % tasks[first] not in diffs[1], diffs[1]
    assert "HEAD has moved since the task was created" not in diffs[1], diffs[1]

    # The target holds both sides' lines, the checks pass there, and no marker (nor
    # ferrus's own merge commit) is anywhere in its history.
    on_main = git(project, "show", "main:greeting.txt")
    assert sorted(on_main.splitlines()) == sorted(["hello from alpha", "hello from beta"])
    history = git(project, "log", "-p", "main")
    assert "<<<<<<<" not in history and ">>>>>>>" not in history and "=======" not in history
    assert "ferrus: main merged into" not in git(project, "log", "--format=%s", "main")
    assert git(project, "status", "--porcelain", "--untracked-files=no") == ""

    # Worktrees and branches gone.
    assert git(project, "branch", "--list", "ferrus/*").strip() == ""
    assert git(project, "worktree", "list", "--porcelain").count("worktree ") == 1
    for task in tasks:
        assert not os.path.exists(ferrus.read_task_record(store.dir, task)["worktree"])
