"""nano, the built-in agent, as executor and reviewer of a real `ferrus run`.

nano is registered as a user registers it (`ferrus register --supervisor nano
--executor nano`, [agents.nano] pointing at a model server); `ferrus run` starts it
like any agent CLI, nano starts the role's real `ferrus serve` over stdio, and a
scripted chat-completions model (tests/fake_models.py) decides each turn: the executor
claims the task, writes hello.txt with nano's write_file (its first try is a malformed
tool call that nano repairs), checks and submits; the reviewer reads the diff resource
and approves.  Also two tasks at once (`ferrus run --parallel 2`), each nano in its
task's worktree, and a session budget that stops nano with a message naming it.
"""

import json
import os
import re
import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, set_config
from fake_models import FakeModels, call, raw_call, say
from test_e2e_parallel import CHECK as PARALLEL_CHECK
from test_e2e_parallel import TASK_TEXT, assert_both_merged_each_on_its_own, git

pytestmark = pytest.mark.e2e

CHECK = ("python3 -c \"import pathlib, sys; p = pathlib.Path('hello.txt'); "
         "sys.exit(p.exists() and p.read_text().strip() != 'hi')\"")


def nano_config(fake, check=CHECK, extra=""):
    return """
[checks]
commands = [%s]

[limits]
wait_timeout_secs = 20

[agents.nano]
base_url = "%s/v1"
model = "fake-model"
%s""" % (json.dumps(check), fake.url, extra)


def cli(root, *args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("FERRUS_SESSION", "FERRUS_DEBUG")}
    return subprocess.run(FERRUS_CMD + list(args), cwd=str(root), env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def register_nano(project):
    registered = cli(project, "register", "--supervisor", "nano", "--executor", "nano")
    assert registered.returncode == 0, registered.stdout + registered.stderr


def workdir_of(conversation):
    """The working folder nano's system prompt names."""
    system = conversation.body["messages"][0]["content"]
    return re.search(r"working folder (\S+)\.", system).group(1)


class NanoModel:
    """The model behind every nano session.  Which role shows in the prompt; which task
    in what wait_for_task / wait_for_review returned.  The executor's first write is a
    malformed tool call (nano answers it with a JSON error, the model tries again)."""

    def __init__(self, malformed_first=True):
        self.malformed_first = malformed_first
        self.seen = []               # (role, task id, working folder, the task's file)
        self.reviewer_tools = []
        self.repair_answers = []

    def __call__(self, conversation):
        role = "executor" if "You are the ferrus executor" in conversation.prompt \
            else "supervisor"
        calls = conversation.calls
        if not calls:
            return call("wait_for_task" if role == "executor" else "wait_for_review")
        found = TASK_TEXT.search(calls[0][2])
        if not found:
            return say("No task reached me: %s" % calls[0][2][:300])
        name, content = found.groups()
        if len(calls) == 1:
            task = re.search(r'"task_id": ?"([^"]+)"', calls[0][2])
            self.seen.append((role, task.group(1) if task else None, workdir_of(conversation),
                              name))
        if role == "supervisor":
            self.reviewer_tools.append(sorted(conversation.tools))
            steps = [call("read_resource", {"uri": "ferrus://diff"}),
                     call("approve", {"notes": "The diff adds %s as asked." % name})]
        else:
            write = call("write_file", {"path": name, "content": content + "\n"})
            steps = [write, call("check"),
                     call("submit", {"content": "Wrote %s; the check passes." % name})]
            if self.malformed_first:
                steps.insert(0, raw_call("write_file", '{"path": "%s", "content": ' % name))
        done = len(calls) - 1
        if done and "malformed tool call" in calls[-1][2]:
            self.repair_answers.append(json.loads(calls[-1][2]))
        return steps[done] if done < len(steps) else say("Done.")


def test_nano_takes_a_task_to_complete_as_executor_and_reviewer(project):
    subprocess.run(["git", "init", "-q"], cwd=str(project), check=True)
    model = NanoModel()
    with FakeModels(model) as fake:
        set_config(project, nano_config(fake).replace("Create", "Create"))
        register_nano(project)
        result = cli(project, "run", "--task", "Create hello.txt containing hi.",
                     "--timeout", "120", timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + fake.describe()
    assert "Reviewing → Complete" in result.stdout
    assert (project / "hello.txt").read_text() == "hi\n"
    # The malformed call was answered with what is wrong and the tool's parameters, once.
    assert len(model.repair_answers) == 1
    assert "not valid JSON" in model.repair_answers[0]["problem"]
    assert model.repair_answers[0]["parameters"]["required"] == ["path", "content"]
    # The reviewer, read-only, is offered no tool that writes.
    assert model.reviewer_tools and not any({"write_file", "replace", "run_shell_command"} &
                                            set(tools) for tools in model.reviewer_tools)
    store = ferrus.Store(str(project))
    moves = {(e["event"], e["actor"].split("/")[0]) for e in store.read_journal()}
    assert {("claim", "executor:nano:1"), ("check_passed", "executor:nano:1"),
            ("submit", "executor:nano:1"), ("approve", "supervisor:nano:1")} <= moves
    # The session records hold the tokens the server reported and the tool calls nano made.
    records = {r["slot"]: r for r in ferrus.read_session_records(store)}
    assert records["executor"]["outcome"] == "success"
    assert records["executor"]["tool_calls"] == 5 and records["reviewer"]["tool_calls"] == 3
    for record in records.values():
        assert record["input_tokens"] > 0 and record["output_tokens"] > 0, record
        assert record["turns"] >= 3, record
    log = (project / records["executor"]["log"]).read_text()
    assert "repairing a malformed tool call" in log


def test_two_tasks_in_parallel_with_nano_are_both_integrated(project):
    git(project, "init", "-q")
    git(project, "config", "user.name", "Test User")
    git(project, "config", "user.email", "test@example.com")
    model = NanoModel(malformed_first=False)
    with FakeModels(model) as fake:
        set_config(project, nano_config(fake, PARALLEL_CHECK))
        register_nano(project)
        (project / "README.md").write_text("hello\n")
        git(project, "add", "-A")
        git(project, "commit", "-qm", "before the tasks")
        tasks = []
        for name in ("alpha", "beta"):
            added = cli(project, "task", "add", "Create %s.txt containing %s." % (
                name, name))
            assert added.returncode == 0, added.stderr
            tasks.append(re.search(r"Task (t-\S+) queued", added.stdout).group(1))
        result = cli(project, "run", "--parallel", "2", "--timeout", "150",
                     timeout=200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:] + fake.describe()
    # nano wrote each task's file with a relative path: inside its task's worktree.
    assert_both_merged_each_on_its_own(project, tasks, model.seen, "nano", output)


def test_a_session_budget_stops_nano_with_a_message_naming_it(project):
    """A model that keeps reading never submits: max_tool_calls ends each session, and
    the run reports why in nano's own words."""
    def reader(conversation):
        if not conversation.calls:
            return call("wait_for_task")
        return call("list_directory", {"path": "."})
    with FakeModels(reader) as fake:
        set_config(project, nano_config(fake, extra="max_tool_calls = 3\n") +
                   "\n[sessions]\nmax_consecutive_errors = 1\n")
        register_nano(project)
        result = cli(project, "run", "--task", "Create hello.txt containing hi.",
                     "--timeout", "60", timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "nano stopped: this session made 3 tool calls, its budget is 3 " \
           "([agents.nano] max_tool_calls)" in output, output[-3000:]
    store = ferrus.Store(str(project))
    executor = [r for r in ferrus.read_session_records(store) if r["slot"] == "executor"]
    assert executor and executor[0]["outcome"] == "error" and executor[0]["tool_calls"] == 3


def test_an_interactive_nano_session_reads_more_instructions_until_eof(project):
    """HQ's interactive sessions: nano answers, then reads the person's next line."""
    answers = iter(["Which file?", "Done: I would edit a.txt."])

    def chat(conversation):
        return say(next(answers))
    with FakeModels(chat) as fake:
        set_config(project, nano_config(fake))
        register_nano(project)
        env = {k: v for k, v in os.environ.items() if k != "FERRUS_SESSION"}
        done = subprocess.run(
            FERRUS_CMD + ["nano", "--role", "supervisor", "--mcp-config",
                          str(project / ".ferrus" / "nano-mcp-supervisor.json"),
                          "--interactive", "--prompt", "Plan a change with me."], cwd=str(project), env=env,
            input="a.txt, please\n", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Which file?" in done.stdout and "Done: I would edit a.txt." in done.stdout
    second = fake.main[1].body["messages"]
    assert [m["role"] for m in second[1:]] == ["user", "assistant", "user"]
    assert second[-1]["content"] == "a.txt, please"
