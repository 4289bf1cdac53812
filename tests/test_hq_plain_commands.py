"""Every command of the plain-line HQ (`ferrus hq --no-tui`), typed over a pipe.

HQ runs as a real process on a project whose agents are the scripted agents of
test_hq.py; a reader thread collects what it prints, and each step waits for the
line it expects instead of sleeping.  What one command answers, and what HQ says when
its input ends, is checked on the plain shell (ferrus.HqShell) in this process.
"""

import io
import os
import subprocess
import threading
import time
import types

import pytest

import ferrus
from conftest import FERRUS_CMD, SCRIPTED_CHECK, wait_until
from test_hq import cli_env
from test_milestones import write_spec

S, SS = ferrus.S, ferrus.SS


class PipedHq:
    """`ferrus hq --no-tui` with stdin and stdout on pipes."""

    def __init__(self, root, env):
        self.proc = subprocess.Popen(FERRUS_CMD + ["hq", "--no-tui"], cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.out = []
        self.changed = threading.Condition()
        self.reader_name = "hq-reader-%d" % self.proc.pid
        threading.Thread(target=self._read, name=self.reader_name, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.changed:
                self.out.append(line.rstrip("\n"))
                self.changed.notify_all()

    def send(self, *lines):
        """Type ``lines``; returns how much output there was before them."""
        with self.changed:
            mark = len(self.out)
        self.proc.stdin.write("".join(line + "\n" for line in lines))
        self.proc.stdin.flush()
        return mark

    def wait_for(self, text, since=0, timeout=60):
        """The output lines from ``since`` up to the first one containing ``text``."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for index in range(since, len(self.out)):
                    if text in self.out[index]:
                        return self.out[since:index + 1]
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.reading()):
                    raise AssertionError("no %r in HQ's output:\n%s" % (
                        text, "\n".join(self.out)))
                self.changed.wait(min(left, 1.0))

    def reading(self):
        return any(thread.name == self.reader_name and thread.is_alive()
                   for thread in threading.enumerate())

    def command(self, line, until, timeout=60):
        """Type one line and return its output up to the line containing ``until``."""
        return self.wait_for(until, self.send(line), timeout)

    def quit(self, *answers):
        self.send("/quit", *answers)
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0, "\n".join(self.out)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def hq(scripted, tmp_path):  # noqa: F811
    started = []

    def start(**env):
        started.append(PipedHq(scripted.root, dict(cli_env(tmp_path), **env)))
        started[-1].wait_for("/help lists the commands")
        return started[-1]
    yield start
    for shell in started:
        shell.close()


def test_commands_that_need_no_running_agent(scripted, hq):  # noqa: F811
    root = scripted.root
    shell = hq(SCRIPTED_BEHAVIOR="")

    out = shell.command("/help", "Anything not starting with / answers")
    for name, _, _ in ferrus.HQ_COMMANDS:
        assert any(line.startswith("  " + name) for line in out), name

    out = shell.command("/agents", "executor: scripted")
    assert "supervisor: scripted — ok, permissions read-only" in out

    # Specs: none yet, then one with three milestones; select one, see it, clear it.
    shell.command("/milestones", "no specs in docs/specs/ yet: /spec drafts one")
    rel = write_spec(root)
    out = shell.command("/milestones", "(m2)")
    assert out[-4:] == [rel, "   [ ] #1.0 Write the first file (m1)",
                        "   [ ] #1.2 Write the third file (m3)",
                        "   [ ] #1.1 Write the second file (m2)"]
    shell.command("/milestones %s m1" % rel, "Selected %s, milestone m1." % rel)
    assert scripted.read_state().selected_milestone == "m1"
    out = shell.command("/status", "  consultant: ")
    assert out[0].startswith("State Idle, for ")
    assert out[1] == "spec %s, milestone m1" % rel
    assert [line.partition(":")[0] for line in out[2:]] == [
        "  executor", "  reviewer", "  consultant"]
    shell.command("/reset-spec", "Spec selection cleared.")
    assert scripted.read_state().selected_spec is None

    # Models and registration edit ferrus.toml as `ferrus register` does.
    shell.command("/model executor big-model", 'Set [hq.executor] agent = "scripted"')
    assert scripted.config().require_hq().executor.model == "big-model"
    shell.command("/model executor --clear", 'Set [hq.executor] agent = "scripted"')
    assert scripted.config().require_hq().executor.model == ""
    shell.command("/model", "error: usage: /model supervisor|executor MODEL (or --clear)")
    shell.command("/model supervisor", "error: usage: /model supervisor|executor")
    shell.command("/register --nonsense", "error: usage: /register [--supervisor A]")
    out = shell.command("/register", 'Set [hq.executor] agent = "scripted"')
    assert "Registered ferrus-supervisor-1 in .ferrus/mcp-supervisor.json " \
           "(passed to scripted as {mcp_config})" in out
    os.remove(os.path.join(root, ".ferrus", "mcp-executor.json"))
    shell.command("/register --executor scripted", "Registered ferrus-executor-1")
    assert os.path.isfile(os.path.join(root, ".ferrus", "mcp-executor.json"))

    # The gate: --force runs the commands in any state; /check is the executor's tool.
    with open(os.path.join(root, "work.txt"), "w") as handle:
        handle.write("not yet\n")                 # the scripted check wants "work" in it
    out = shell.command("/check --force", "Full log: ")
    assert "Checks failed." in out and "- `%s` (exit 1)" % SCRIPTED_CHECK in out
    os.remove(os.path.join(root, "work.txt"))
    shell.command("/check", "error: Cannot run checks from state Idle.")

    # Commands that need a task, a submission, a checkpoint or an agent say so.
    out = shell.command("/resume", "hint: start a task with /task")
    assert out[-2] == "error: nothing to resume: the state is Idle"
    shell.command("/review", "error: there is no submission to review")
    shell.command("/continue", "error: there is no capacity checkpoint to continue from")
    shell.command("/tell executor", "error: usage: /tell ROLE MESSAGE")
    shell.command("/attach executor",
                  "error: no running agent called 'executor' (running: none)")
    shell.command("/pipeline", "error: usage: /pipeline list | init | run NAME TOPIC")
    shell.command("/pipeline frobnicate x", "error: usage: /pipeline list")
    shell.command("/pipeline list", "error: workflows.json not found in ")
    shell.command("/stat", "error: unknown command /stat — did you mean /status?")
    shell.command("/reset", "Nothing to reset: the state is already Idle.")
    shell.command("/init", "ferrus.toml already exists, kept as it is.")
    out = shell.command("/log 2", "clear_selection")
    assert "select_milestone" in out[0] and len(out) == 2
    mark = shell.send("/stop")                  # nothing runs: no question, no output
    shell.quit()
    assert shell.out[mark:] == []
    assert scripted.read_state().state == S.IDLE
    assert not any("Traceback" in line for line in shell.out), "\n".join(shell.out)


def executor_sessions(store):
    """The executor slot's session moves, from the journal: [(to, trigger)]."""
    return [(e["detail"]["to"], e["detail"].get("trigger")) for e in store.read_journal()
            if e["event"] == "session" and e["detail"].get("slot") == "executor"]


def test_commands_on_running_agents(scripted, hq):  # noqa: F811
    shell = hq(SCRIPTED_BEHAVIOR="slow-executor")
    shell.send("/task Make work.txt")
    wait_until(lambda: ("Running", "SessionStarted") in executor_sessions(scripted),
               "the executor to run")
    assert scripted.read_state().state == S.EXECUTING
    shell.command("/task Another", "error: a task is in flight (Executing)")

    # /attach prints the agent's log and follows it until a line is typed.
    out = shell.command("/attach executor", "scripted agent: role executor")
    assert any(line.startswith("--- .ferrus/") and line.endswith("(Enter returns) ---")
               for line in out), out
    shell.wait_for("--- detached ---", shell.send(""))

    # /tell interrupts the session and starts the next one (test_hq.py checks that its
    # prompt carries the message).
    started = executor_sessions(scripted).count(("Running", "SessionStarted"))
    shell.send("/tell executor use tabs, not spaces")
    wait_until(lambda: executor_sessions(scripted).count(("Running", "SessionStarted"))
               > started, "the executor's next session")
    moves = executor_sessions(scripted)
    assert moves.index(("Interrupting", "UrgentMessage")) < len(moves) - 1 - moves[::-1].index(
        ("Running", "SessionStarted"))

    # /quit and /stop ask first while agents run; "n" keeps them running.
    shell.command("/quit", "Agents are running (executor); stop them and quit? [y/N]")
    shell.send("n")
    shell.command("/stop", "Stop every agent session? [y/N]")
    shell.command("y", "Stopped. /resume starts them again.")
    wait_until(lambda: executor_sessions(scripted)[-1][0] == SS.STOPPED,
               "the executor to stop")
    shell.command("/resume", "Resuming the task (Executing).")
    wait_until(lambda: executor_sessions(scripted)[-1] == ("Running", "SessionStarted"),
               "the executor to run again")

    # /reset asks, stops the agents and returns to Idle.
    shell.command("/reset", "The task is Executing. Reset it to Idle and clear its files? [y/N]")
    shell.command("y", "State reset to Idle from Executing.")
    assert scripted.read_state().state == S.IDLE
    shell.quit()
    assert not any("Traceback" in line for line in shell.out), "\n".join(shell.out)


def test_quitting_asks_only_while_agents_have_work_to_lose(project, monkeypatch, tmp_path):
    """/quit and the curses Ctrl+C twice share one rule: agents that only finish after
    the task ended (the grace for their last usage report) are no reason to ask."""
    store = ferrus.Store(str(project))
    curses_hq = ferrus.CursesHq(store, history_path=str(tmp_path / "history"))
    plain = ferrus.HqShell(store, stdin=io.StringIO(), stdout=io.StringIO())
    asked = []
    for shell in (plain, curses_hq):
        busy = types.SimpleNamespace(name="reviewer")
        monkeypatch.setattr(shell.controller, "running", lambda: [busy])
        monkeypatch.setattr(shell, "confirm", lambda question: asked.append(question) or False)
        shell.controller.finishing_since = None
        shell.cmd_quit("")
        assert not shell.done and asked[-1].startswith("Agents are running (reviewer)")
        shell.controller.finishing_since = 1.0
        shell.cmd_quit("") if shell is plain else (shell.ctrl_c(), shell.ctrl_c())
        assert shell.done and len(asked) == (1 if shell is plain else 2)
        shell.controller.shutdown()


def test_hq_register_checks_its_options_as_the_cli_does(project):
    """One helper turns the options into choices for `ferrus register` and /register: a
    model without its agent is refused in both, instead of HQ silently dropping it."""
    store = ferrus.Store(str(project))
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(), stdout=out)
    try:
        shell.handle("/register --supervisor-model opus")
    finally:
        shell.controller.shutdown()
    assert "error: At least one of --supervisor or --executor must be specified" in out.getvalue()
    cli = subprocess.run(
        FERRUS_CMD + ["register", "--supervisor-model", "opus"],
        cwd=str(project), capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and "At least one of --supervisor or --executor" in cli.stderr


def test_a_mistyped_command_gets_a_suggestion(store):
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    shell.handle("/stauts")
    assert "unknown command /stauts — did you mean /status? /help lists them" in out.getvalue()


def test_input_ending_with_a_task_in_flight_says_where_the_task_stays(scripted):
    """Plain HQ fed by a pipe ends with its input; with a task in flight it says so and
    where the task stays, instead of vanishing with its agents stopped and nothing said."""
    out = io.StringIO()
    shell = ferrus.HqShell(scripted, stdin=io.StringIO("/task Make work.txt\n"), stdout=out,
                           resume=False)
    assert shell.run() == 0
    text = out.getvalue()
    assert "Input ended: HQ leaves" in text
    assert "the task stays Executing. `ferrus run --resume` or `ferrus hq` goes on" in text
    data = scripted.read_state()
    assert data.state == ferrus.S.EXECUTING and data.claimed_by is None


def test_input_ending_with_nothing_in_flight_says_nothing_more(scripted):
    out = io.StringIO()
    assert ferrus.HqShell(scripted, stdin=io.StringIO("/status\n"), stdout=out).run() == 0
    assert "Input ended" not in out.getvalue()
