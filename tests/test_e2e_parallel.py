"""Parallel tasks with real agent CLIs: each agent, started in its task's git worktree,
reaches ferrus and works on its own task only.

With each of Claude Code, Codex, Qwen Code and Gemini CLI as executor and reviewer,
`ferrus run --parallel 2` (run as a user runs it) takes two queued tasks, each writing
its own file, to integration.  The models behind the CLIs are scripted
(tests/fake_anthropic.py, tests/fake_models.py) and decide per task from the task text
that wait_for_task / wait_for_review hand them; the CLIs, their MCP connections, ferrus
and git are real.  What reaches each CLI's ferrus server is in ferrus.py, at
WORKTREE_AGENT_FILES.  Each test skips when its CLI is not installed.
"""

import json
import os
import re
import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, git, set_config
from fake_anthropic import FakeAnthropic, claude_env, find_agent, text, tool_use
from fake_models import FakeModels, agent_env, call, say
from test_e2e_offline_agents import AGENTS, offline_setup

pytestmark = pytest.mark.e2e

# Every NAME.txt in the project holds NAME: true alone and after any merge of the tasks.
CHECK = ("python3 -c \"import pathlib, sys; sys.exit(any(p.read_text().strip() != p.stem "
         "for p in pathlib.Path('.').glob('*.txt')))\"")

CONFIG = """
[checks]
commands = [%s]

[limits]
wait_timeout_secs = 20
""" % json.dumps(CHECK)

# The task says what to write; the scripted model reads it from wait_for_task's result.
TASK_TEXT = re.compile(r"Create (\w+\.txt) containing (\w+)")


def ferrus_cli(root, *args, env=None, timeout=60):
    return subprocess.run(FERRUS_CMD + list(args), cwd=str(root),
                          env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def repository(project, agent, env):
    """``project`` as a git repository, ``agent`` registered in both roles (as a user
    does it), everything committed on main."""
    git(project, "init", "-q")
    # The agents run with an isolated HOME: the repository names its committer itself.
    git(project, "config", "user.name", "Test User")
    git(project, "config", "user.email", "test@example.com")
    set_config(project, CONFIG)
    registered = ferrus_cli(project, "register", "--supervisor", agent, "--executor", agent,
                            env=env)
    assert registered.returncode == 0, registered.stderr
    (project / "README.md").write_text("hello\n")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "before the tasks")


def add_task(project, name, env=None):
    added = ferrus_cli(project, "task", "add", "Create %s.txt containing %s." % (name, name),
                       env=env)
    assert added.returncode == 0, added.stderr
    return re.search(r"Task (t-\S+) queued", added.stdout).group(1)


def session_of(actor):
    """The agent session an actor id names (``role:agent:index/session``), or None."""
    return actor.partition("/")[2] or None


def agent_entries_by_task(store, tasks):
    """The journal entries agents made, per task; each must belong to the task its
    agent's session names (a tool call never touches another task)."""
    by_task = {task: [] for task in tasks}
    for entry in store.read_journal():
        session = session_of(entry.get("actor", ""))
        if not session:
            continue
        assert ferrus.session_task(session) == entry["task_id"], entry
        by_task[entry["task_id"]].append(entry)
    return by_task


# -- Claude Code: two tasks to integration ----------------------------------------------------

def system_text(request):
    system = request.get("system")
    if isinstance(system, list):
        return "\n".join(block.get("text", "") for block in system if isinstance(block, dict))
    return str(system or "")


def all_tool_results(request):
    """The text of every tool result in the conversation so far, in order."""
    out = []
    for message in request.get("messages") or []:
        content = message.get("content")
        if message.get("role") != "user" or not isinstance(content, list):
            continue
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                body = block.get("content")
                if isinstance(body, list):
                    body = "\n".join(part.get("text", "") for part in body
                                     if isinstance(part, dict))
                out.append(str(body or ""))
    return out


class TwoTasks:
    """The model behind every `claude -p` of the run.  Which role a process plays shows
    in the ferrus tools it is offered; which task, in what wait_for_task / wait_for_review
    returned (the task text), and where its worktree is, in Claude's own system prompt.
    The executor writes the file its task names there, checks and submits; the reviewer
    approves only a diff that holds its task's file and nothing of the other task."""

    def __init__(self):
        self.seen = []           # (role, task id, working directory, the task's file)

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
        found = TASK_TEXT.search(results[0]) if results else None
        if not found:
            return [text("No task reached me: %s" % (results[:1],))]
        name, content = found.groups()
        workdir = re.search(r"Primary working directory: (\S+)", system_text(request)).group(1)
        if done == 1:
            task = re.search(r'"task_id": ?"([^"]+)"', results[0])
            self.seen.append((role, task.group(1) if task else None, workdir, name))
        if role == "executor":
            steps = [tool_use("Write", {"file_path": os.path.join(workdir, name),
                                        "content": content + "\n"}),
                     tool_use(server + "check", {}),
                     tool_use(server + "submit", {"content": "Wrote %s." % name})]
        else:
            diff = json.loads(results[0]).get("diff", "") if results[0].startswith("{") \
                else results[0]
            others = [n for n in ("alpha.txt", "beta.txt") if n != name]
            verdict = ("approve", {}) if "+++ b/%s" % name in diff and not any(
                "b/" + other in diff for other in others) else \
                ("reject", {"notes": "the diff is not this task's: %s" % diff[:400]})
            steps = [tool_use(server + verdict[0], verdict[1])]
        index = done - 1
        return [steps[index]] if index < len(steps) else [text("Done.")]


def test_two_tasks_in_parallel_with_real_claude_are_both_integrated(project, tmp_path):
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    home = tmp_path / "home"
    home.mkdir()
    model = TwoTasks()
    with FakeAnthropic(model) as fake:
        env = claude_env(fake, str(home))
        repository(project, "claude-code", env)
        tasks = [add_task(project, name, env) for name in ("alpha", "beta")]
        result = ferrus_cli(project, "run", "--parallel", "2", "--timeout", "240", env=env,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + fake.describe()
    assert_both_merged_each_on_its_own(project, tasks, model.seen, "claude-code", output)


# -- Codex, Qwen Code, Gemini CLI: each in its task's worktree -------------------------------


# A task's worktree, or the review checkout beside it (its reviewer's folder).
WORKTREE = re.compile(r"/[^\s\"'\\\\<>]*\.ferrus-worktrees/t-[0-9]{8}T[0-9]{6}-[0-9a-f]{6}"
                      r"(?:\.review)?")


class TwoTasksOffline:
    """The model behind every Codex, Qwen Code or Gemini CLI process of the run, as
    TwoTasks is for Claude: the role shows in the prompt, the task in what wait_for_task
    or wait_for_review returned, the working folder in what the CLI tells its model about
    its environment.  The executor writes its task's file with the CLI's own tool."""

    def __init__(self):
        self.seen = []           # (role, task id, working folder the CLI named, file)

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
        handed = calls[0][1]
        found = TASK_TEXT.search(handed)
        if not found:
            return say("No task reached me: %s" % handed[:300])
        name, content = found.groups()
        if len(calls) == 1:
            task = re.search(r'task_id\\?": ?\\?"(t-[^"\\]+)', handed)
            folder = WORKTREE.search(json.dumps(conversation.body))
            self.seen.append((role, task.group(1) if task else None,
                              folder.group() if folder else None, name))
        if role == "supervisor":
            if len(calls) > 1:
                return say("Done.")
            mine = "b/" + name in handed and not any(
                "b/" + other in handed for other in ("alpha.txt", "beta.txt") if other != name)
            return call("approve") if mine else call("reject", {"notes": "not this task's diff"})
        steps = ["write", "check", "submit"]
        if len(calls) > len(steps):
            return say("Done.")
        step = steps[len(calls) - 1]
        if step == "check":
            return call("check")
        if step == "submit":
            return call("submit", {"content": "Wrote %s." % name})
        if conversation.offers("write_file"):           # Qwen Code, Gemini CLI
            folder = WORKTREE.search(json.dumps(conversation.body))
            return call("write_file", {"file_path": os.path.join(folder.group(), name),
                                       "content": content + "\n"})
        return call("exec_command", {"cmd": "printf '%s\\n' > %s" % (content, name)})  # Codex


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_two_tasks_in_parallel_with_each_real_cli_reach_their_own_tasks(agent, project,
                                                                         tmp_path):
    binary = find_agent(AGENTS[agent])
    if not binary:
        pytest.skip("%s is not installed (npm install %s)" % (
            AGENTS[agent], ferrus.ADAPTERS[agent].package))
    home = tmp_path / "home"
    home.mkdir()
    env = agent_env(home)
    repository(project, agent, env)
    tasks = [add_task(project, name, env) for name in ("alpha", "beta")]
    model = TwoTasksOffline()
    with FakeModels(model) as fake:
        env.update(offline_setup(agent, fake, home))
        result = ferrus_cli(project, "run", "--parallel", "2", "--timeout", "240", env=env,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + fake.describe()
    assert_both_merged_each_on_its_own(project, tasks, model.seen, agent, output)


def assert_both_merged_each_on_its_own(project, tasks, seen, agent, output):
    assert "report: 2 merged" in output
    # Both merged, both files on main with their content, the checks green there, the
    # user's checkout clean.
    rows = {row["id"]: row for row in json.loads(ferrus_cli(project, "tasks", "--json").stdout)
            ["tasks"]}
    assert {task: rows[task]["status"] for task in tasks} == {task: "merged" for task in tasks}
    for name in ("alpha", "beta"):
        assert git(project, "show", "main:%s.txt" % name).stdout == name + "\n"
    assert subprocess.run(CHECK, shell=True, cwd=str(project)).returncode == 0
    assert git(project, "status", "--porcelain", "--untracked-files=no").stdout == ""
    # Worktrees and branches gone.
    assert git(project, "branch", "--list", "ferrus/*").stdout.strip() == ""
    assert git(project, "worktree", "list", "--porcelain").stdout.count("worktree ") == 1
    store = ferrus.Store(str(project))
    worktrees = {task: ferrus.read_task_record(store.dir, task)["worktree"] for task in tasks}
    assert not any(os.path.exists(path) for path in worktrees.values())
    # Each CLI was handed its own task: the executor worked in that task's worktree (it
    # told its model so), the reviewer in ferrus's own checkout of the submission beside
    # it — the executor of alpha.txt's task and its reviewer, and beta.txt's.
    names = {task: re.search(r"\w+\.txt", rows[task]["title"]).group() for task in tasks}
    folders = {"executor": lambda path: path,
               "supervisor": ferrus.review_checkout_path}
    assert sorted(seen) == sorted((role, task, folders[role](worktrees[task]), names[task])
                                  for task in tasks for role in ("executor", "supervisor"))
    # Every tool call landed on the task of the session that made it, and on no other:
    # FERRUS_SESSION reached each CLI's ferrus server.
    by_task = agent_entries_by_task(store, tasks)
    for task in tasks:
        moves = [(e["event"], e["actor"].split("/")[0]) for e in by_task[task]]
        assert moves == [("claim", "executor:%s:1" % agent),
                         ("check_passed", "executor:%s:1" % agent),
                         ("submit", "executor:%s:1" % agent),
                         ("claim", "supervisor:%s:1" % agent),
                         ("approve", "supervisor:%s:1" % agent)], moves
        assert store.for_task(task).read_state().state == ferrus.S.COMPLETE
    # The merge queue moved main to each task's checked commit, one after the other.
    merged = [e["detail"]["commit"] for e in store.read_journal() if e["event"] == "integrated"]
    history = git(project, "log", "--format=%H", "main").stdout
    assert len(merged) == 2 and all(commit in history for commit in merged)
