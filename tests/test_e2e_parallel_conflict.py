"""Two parallel tasks that rewrite the same lines, with the real Claude Code CLI: the one
integrated second conflicts with the target, ferrus merges the target into its branch
itself (git's conflict markers left in the file), and its executor -- a real `claude -p`
that can only edit files -- resolves the conflict with its Read and Write tools, checks and
submits again; both tasks are merged and no marker ever reaches the target.

The same with Codex, Qwen Code and Gemini CLI, each resolving the conflict with its own
tools.  The models behind the CLIs are scripted (tests/fake_anthropic.py,
tests/fake_models.py); the CLIs, their MCP connections to ferrus, ferrus and git are
real.  Each test skips when its CLI is not installed.
"""

import json
import os
import re

import pytest

import ferrus
from conftest import git, set_config
from fake_anthropic import FakeAnthropic, claude_env, find_agent, text, tool_use
from fake_models import FakeModels, agent_env, call, say
from test_e2e_offline_agents import AGENTS, offline_setup
from test_e2e_parallel import WORKTREE, ferrus_cli, system_text

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


def conflicting_tasks(project, agent, env):
    """``project`` as a git repository with greeting.txt on main, ``agent`` registered in
    both roles, and two queued tasks that each rewrite greeting.txt's line: {id: name}."""
    git(project, "init", "-q")
    # The agents run with an isolated HOME: the repository names its committer itself.
    git(project, "config", "user.name", "Test User")
    git(project, "config", "user.email", "test@example.com")
    set_config(project, CONFIG)
    registered = ferrus_cli(project, "register", "--supervisor", agent, "--executor", agent,
                            env=env)
    assert registered.returncode == 0, registered.stderr
    (project / "greeting.txt").write_text("hello\n")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "before the tasks")
    tasks = {}
    for name in ("alpha", "beta"):
        added = ferrus_cli(project, "task", "add", "Replace the line of greeting.txt with: "
                           "hello from %s" % name, env=env)
        assert added.returncode == 0, added.stderr
        tasks[re.search(r"Task (t-\S+) queued", added.stdout).group(1)] = name
    return tasks


def assert_resolved_and_merged(project, tasks, output):
    """Both tasks merged, the second after one conflict handed over to its executor, the
    target holding both lines and never a marker, nothing left behind.  Returns the id of
    the task that conflicted."""
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

    # The target holds both sides' lines, the checks pass there, and no marker (nor
    # ferrus's own merge commit) is anywhere in its history.
    on_main = git(project, "show", "main:greeting.txt").stdout
    assert sorted(on_main.splitlines()) == sorted(["hello from alpha", "hello from beta"])
    history = git(project, "log", "-p", "main").stdout
    assert "<<<<<<<" not in history and ">>>>>>>" not in history and "=======" not in history
    assert "ferrus: main merged into" not in git(project, "log", "--format=%s", "main").stdout
    assert git(project, "status", "--porcelain", "--untracked-files=no").stdout == ""

    # Worktrees and branches gone.
    assert git(project, "branch", "--list", "ferrus/*").stdout.strip() == ""
    assert git(project, "worktree", "list", "--porcelain").stdout.count("worktree ") == 1
    for task in tasks:
        assert not os.path.exists(ferrus.read_task_record(store.dir, task)["worktree"])
    return second


def test_a_conflict_between_two_parallel_tasks_is_resolved_by_real_claude(project, tmp_path):
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    home = tmp_path / "home"
    home.mkdir()
    model = SameLines()
    with FakeAnthropic(model) as fake:
        env = claude_env(fake, str(home))
        tasks = conflicting_tasks(project, "claude-code", env)
        result = ferrus_cli(project, "run", "--parallel", "2", "--timeout", "300", env=env,
                            timeout=360)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + fake.describe()
    second = assert_resolved_and_merged(project, tasks, output)
    first = next(task for task in tasks if task != second)

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


# -- Codex, Qwen Code, Gemini CLI: the same conflict, resolved with each CLI's own tools -----


def parameters_of(body, tool):
    """The parameter names the CLI declares for its tool ``tool`` (whatever the wire
    protocol nests them in)."""
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            named = node.get("name") == tool or (node.get("function") or {}).get("name") == tool
            schema = node.get("parameters") or node.get("parametersJsonSchema") or \
                (node.get("function") or {}).get("parameters")
            if named and isinstance(schema, dict):
                return list(schema.get("properties") or {})
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return []


def both_sides(shown):
    """The conflicted file as a tool's output showed it (between its first marker line and
    its last), each side's lines kept, the marker lines left out."""
    try:
        shown = json.loads(shown).get("output", shown)      # Gemini CLI wraps it in JSON
    except (ValueError, AttributeError):
        pass
    lines = shown.splitlines()
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("<<<<<<<")]
    ends = [i for i, line in enumerate(lines) if line.lstrip().startswith(">>>>>>>")]
    if not starts or not ends:
        return None
    kept = [line.strip() for line in lines[starts[0]:ends[-1] + 1]
            if not MARKER_LINE.match(line.strip())]
    return "".join(line + "\n" for line in kept)


class SameLinesOffline:
    """SameLines for Codex, Qwen Code and Gemini CLI: the executor writes its line into
    greeting.txt with the CLI's own tools (Codex's shell, the others' write_file); handed
    review notes naming conflicted files, it reads greeting.txt (Codex: cat, the others:
    read_file) and writes it back with both sides' lines and no marker."""

    def __init__(self):
        self.resolutions = []     # (task id, what the read showed, what was written)
        self.reviewed = []        # (task id, what wait_for_review returned)

    def __call__(self, conversation):
        prompt = conversation.prompt
        if "You are the ferrus" not in prompt:
            return say("OK")            # the CLI's own helpers (Qwen's memory agent, ...)
        role = "executor" if "You are the ferrus executor" in prompt else "supervisor"
        calls = [(name, output) for name, _, output in conversation.calls
                 if name != "tool_search"]
        first = "wait_for_task" if role == "executor" else "wait_for_review"
        if not calls:
            if not conversation.offers(first) and conversation.offers("tool_search"):
                # Qwen Code offers MCP tools only after the model asks for them by name.
                names = ",".join("mcp__%s__%s" % (ferrus.server_key(role), tool) for tool in
                                 ("wait_for_task", "check", "submit", "wait_for_review",
                                  "approve", "reject"))
                return call("tool_search", {"query": "select:" + names, "max_results": 20})
            return call(first)
        handed_text = calls[0][1]
        found = TASK_TEXT.search(handed_text)
        if not found:
            return say("No task reached me: %s" % handed_text[:300])
        line = found.group(1)
        task = re.search(r'task_id\\?": ?\\?"(t-[^"\\]+)', handed_text)
        if role == "supervisor":
            if len(calls) > 1:
                return say("Done.")
            self.reviewed.append((task.group(1) if task else None, handed_text))
            clean = not re.search(r"(?:^|\n|\\n)\+(?:<{7}|>{7})", handed_text)
            return call("approve") if "+" + line in handed_text and clean else \
                call("reject", {"notes": "the diff lacks '%s' or holds a marker" % line})
        conflicted = "Conflicted files: greeting.txt" in handed_text
        # Qwen Code, like Claude Code, writes over a file only after reading it.
        steps = ["read", "write", "check", "submit"]
        if len(calls) > len(steps):
            return say("Done.")
        step = steps[len(calls) - 1]
        if step in ("check", "submit"):
            return call("check") if step == "check" else call("submit", {
                "content": "greeting.txt says '%s'%s." % (
                    line, ", both sides of the conflict kept" if conflicted else "")})
        folder = WORKTREE.search(json.dumps(conversation.body)).group() \
            if conversation.offers("write_file") else None
        if step == "read":
            if folder is None:                                              # Codex
                return call("exec_command", {"cmd": "cat greeting.txt"})
            tool = conversation.tool("read_file")
            key = "absolute_path" if "absolute_path" in parameters_of(
                conversation.body, tool) else "file_path"
            return call("read_file", {key: os.path.join(folder, "greeting.txt")})
        content = line + "\n"
        if conflicted:
            content = both_sides(calls[-1][1])
            if content is None:
                return say("The read showed no conflict: %s" % calls[-1][1][:300])
            self.resolutions.append((task.group(1) if task else None, calls[-1][1], content))
        if folder is None:                                                  # Codex
            return call("exec_command", {"cmd": "printf '%s' > greeting.txt"
                                         % content.replace("\n", "\\n")})
        return call("write_file", {"file_path": os.path.join(folder, "greeting.txt"),
                                   "content": content})


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_a_conflict_between_two_parallel_tasks_is_resolved_by_each_real_cli(agent, project,
                                                                              tmp_path):
    binary = find_agent(AGENTS[agent])
    if not binary:
        pytest.skip("%s is not installed (npm install %s)" % (
            AGENTS[agent], ferrus.ADAPTERS[agent].package))
    home = tmp_path / "home"
    home.mkdir()
    env = agent_env(home)
    tasks = conflicting_tasks(project, agent, env)
    model = SameLinesOffline()
    with FakeModels(model) as fake:
        env.update(offline_setup(agent, fake, home))
        result = ferrus_cli(project, "run", "--parallel", "2", "--timeout", "300", env=env,
                            timeout=360)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + fake.describe()
    second = assert_resolved_and_merged(project, tasks, output)
    assert [(task, "<<<<<<<" in shown, sorted(written.splitlines()))
            for task, shown, written in model.resolutions] == \
        [(second, True, ["hello from alpha", "hello from beta"])]
    first = next(task for task in tasks if task != second)
    last_review = [shown for task, shown in model.reviewed if task == second][-1]
    assert "+hello from %s" % tasks[second] in last_review
    assert "+hello from %s" % tasks[first] not in last_review, last_review
