"""One orchestrator per project, agents that cannot start or fail for good, `--timeout`,
the capacity gate on HQ's /task TEXT (issue #10 items 3, 4, 9).

Clocks are injected: nothing here waits for a backoff in real time.
"""

import io
import json
import os
import stat
import subprocess
import sys

import pytest

import ferrus
from conftest import FERRUS_PY, set_config

S, SS = ferrus.S, ferrus.SS


class FakeMonotonic:
    def __init__(self, start=1000.0):
        self.now = start

    def __call__(self):
        return self.now


def custom_agent_config(argv, prompt="stdin"):
    return """
[agents.custom.broken]
interactive = %(argv)s
headless = %(argv)s
prompt = "%(prompt)s"

[hq.supervisor]
agent = "broken"

[hq.executor]
agent = "broken"
""" % {"argv": json.dumps(argv), "prompt": prompt}


def write_program(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# -- an agent that cannot be started -------------------------------------------------------

@pytest.mark.parametrize("content", [
    "this is not a program\n",                              # ENOEXEC: no #! line
    "#!/nonexistent/interpreter\nprint('never')\n",         # missing interpreter
], ids=["enoexec", "missing-interpreter"])
def test_an_agent_that_cannot_start_backs_off_then_stops_and_run_returns(
        project, tmp_path, content):
    program = write_program(tmp_path / "agent", content)
    set_config(project, custom_agent_config([program, "{role}"]))
    store = ferrus.Store(str(project))
    clock = FakeMonotonic()
    lines = []

    def ticking():
        clock.now += 1.0          # every look at the clock moves time on: no real waiting
        return clock.now
    code = ferrus.run_loop(store, "a task", out=lines.append, clock=ticking, poll_interval=0)
    text = "\n".join(lines)
    assert code == ferrus.RUN_FAILED, text
    assert "could not start the executor" in text
    assert "retrying the executor in 2s" in text and "retrying the executor in 16s" in text
    assert "stopped after 5 consecutive errors" in text
    assert "giving up: the executor is stopped" in text


def test_a_failed_start_arms_the_backoff_timer(project, tmp_path):
    program = write_program(tmp_path / "agent", "not a program\n")
    set_config(project, custom_agent_config([program]))
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    clock = FakeMonotonic()
    messages = []
    controller = ferrus.HqController(store, messages.append, clock=clock)
    controller.poll()
    slot = controller.slots["executor"]
    assert slot.state == SS.COOLING_DOWN
    assert slot.timer == clock.now + 2.0
    assert any("not a program this system can run" in m.text for m in messages)
    controller.shutdown()


# -- --timeout -----------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_run_timeout_must_be_positive(project, value):
    done = subprocess.run([sys.executable, FERRUS_PY, "run", "--task", "x", "--timeout", value],
                          cwd=str(project), capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert "--timeout must be a positive number of seconds" in done.stderr
    assert "hint:" in done.stderr
    assert ferrus.Store(str(project)).read_state().state == S.IDLE


# -- the catch-all OSError message ------------------------------------------------------------

def test_the_oserror_hint_never_claims_nothing_changed(project, monkeypatch, capsys):
    def fail(args, root):
        raise OSError(28, "No space left on device", "x")
    monkeypatch.setattr(ferrus, "cmd_status", fail)
    code = ferrus.main(["-C", str(project), "status"])
    err = capsys.readouterr().err
    assert code == 1
    assert "No space left on device" in err
    assert "nothing was changed" not in err and "ferrus doctor" in err


# -- HQ /task TEXT passes the capacity gate ----------------------------------------------------

def test_hq_task_text_passes_the_capacity_gate(project):
    set_config(project, "[capacity]\nmax_tasks = 1\n")
    store = ferrus.Store(str(project))
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    shell.controller.tasks_completed = 1          # the budget of this HQ is spent
    shell.handle("/task Make work.txt")
    assert store.read_state().state == S.IDLE, out.getvalue()
    assert "no new task" in out.getvalue()
    gates = [e["detail"] for e in store.read_journal() if e["event"] == "gate"]
    assert gates and gates[-1]["target"] == "transition:create_task"
    assert gates[-1]["action"] in (ferrus.CHECKPOINT, ferrus.EMERGENCY_STOP)
    shell.controller.shutdown()


def test_hq_task_text_creates_the_task_when_the_gate_allows(project):
    set_config(project, "[capacity]\nmax_tasks = 5\n")
    store = ferrus.Store(str(project))
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=io.StringIO())
    shell.handle("/task Make work.txt")
    assert store.read_state().state == S.EXECUTING
    assert [e["detail"]["target"] for e in store.read_journal() if e["event"] == "gate"] == [
        "transition:create_task"]
    shell.controller.shutdown()


# -- permanent agent errors ----------------------------------------------------------------------

FAILING_AGENT = """#!%(py)s
import sys
sys.stdin.read()
print(%(stdout)r, flush=True)
sys.stderr.write(%(stderr)r)
sys.exit(1)
"""


def failing_agent(tmp_path, stdout="", stderr=""):
    return write_program(tmp_path / "agent", FAILING_AGENT % {
        "py": sys.executable, "stdout": stdout, "stderr": stderr})


@pytest.mark.parametrize("stdout,stderr,words", [
    (json.dumps({"type": "result", "subtype": "success", "is_error": True,
                 "result": "Invalid API key \u00b7 Please run /login"}), "",
     "Invalid API key \u00b7 Please run /login"),
    ("", "error: unknown option '--frobnicate'\n", "error: unknown option '--frobnicate'"),
    (json.dumps({"type": "error", "message": "The model `gpt-nope` does not exist or you do "
                                            "not have access to it."}), "",
     "The model `gpt-nope` does not exist"),
], ids=["claude-login", "unknown-flag", "unknown-model"])
def test_a_permanent_agent_error_stops_at_once_with_the_agents_words(
        project, tmp_path, stdout, stderr, words):
    program = failing_agent(tmp_path, stdout, stderr)
    set_config(project, custom_agent_config([program, "{role}"]))
    store = ferrus.Store(str(project))
    lines = []
    code = ferrus.run_loop(store, "a task", out=lines.append, clock=FakeMonotonic(),
                           poll_interval=0.01, timeout=120)
    text = "\n".join(lines)
    assert code == ferrus.RUN_FAILED, text
    assert words in text
    assert "the executor cannot work" in text and "hint:" in text
    assert "retrying" not in text                     # no second session
    sessions = [e for e in store.read_journal()
                if e["event"] == "session" and e["detail"]["to"] == "Running"]
    assert len(sessions) == 1


def test_a_tool_result_mentioning_an_error_is_not_the_agent_failing():
    tool_output = json.dumps({"type": "user", "message": {"content": [
        {"type": "tool_result", "content": "pytest: error: unrecognized arguments: --x"}]}})
    assert ferrus.permanent_agent_error(tool_output) is None
    ok_result = json.dumps({"type": "result", "is_error": False,
                            "result": "I fixed the unknown option handling"})
    assert ferrus.permanent_agent_error(ok_result) is None
    kind, words, hint = ferrus.permanent_agent_error(
        json.dumps({"type": "turn.failed", "error": {"message": "401 Unauthorized: "
                                                                "Incorrect API key provided"}}))
    assert kind == "login" and "Incorrect API key provided" in words and hint
    assert ferrus.permanent_agent_error("Please set an Auth method in your settings")[0] == "login"


def test_an_agent_failing_for_other_reasons_is_still_retried(project, tmp_path):
    program = failing_agent(tmp_path, "", "Segmentation fault\n")
    set_config(project, custom_agent_config([program, "{role}"]))
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    clock = FakeMonotonic()
    controller = ferrus.HqController(store, lambda m: None, clock=clock)
    slot = controller.slots["executor"]
    import time
    deadline = time.monotonic() + 60
    while slot.state not in (SS.COOLING_DOWN, SS.STOPPED):
        assert time.monotonic() < deadline
        controller.poll()
        time.sleep(0.01)
    assert slot.state == SS.COOLING_DOWN
    controller.shutdown()
