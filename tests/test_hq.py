"""HQ's controller, supervised sessions and `ferrus run`, with scripted agents.

The agents are tests/scripted_agent.py: real processes that read their prompt on
stdin and speak MCP to `ferrus serve`, registered as a custom agent.
"""

import os
import subprocess
import time

import ferrus
from conftest import FERRUS_CMD, SCRIPTED_CONFIG, FakeMonotonic, wait_until

S, SS = ferrus.S, ferrus.SS
CONFIG = SCRIPTED_CONFIG


def run(store, task="Make work.txt", **kw):
    lines = []
    kw.setdefault("timeout", 90)
    code = ferrus.run_loop(store, task, out=lines.append, **kw)
    return code, lines


def moves(store):
    """(event, actor) with the actor's agent session left out (HQ gives every agent one)."""
    return [(e["event"], e["actor"].partition("/")[0]) for e in store.read_journal()
            if e["actor"] != "hq" and e["event"] not in ("claim", "heartbeat")]


def test_approve_path(scripted):
    code, lines = run(scripted)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert scripted.read_state().state == S.COMPLETE
    assert moves(scripted) == [("create_task", "human"),
                               ("check_passed", "executor:scripted:1"),
                               ("submit", "executor:scripted:1"),
                               ("approve", "supervisor:scripted:1")]
    assert any("Idle → Executing" in line for line in lines)
    assert any("Reviewing → Complete" in line for line in lines)
    sessions = [e["detail"] for e in scripted.read_journal() if e["event"] == "session"]
    assert [d["to"] for d in sessions if d["slot"] == "executor"][:4] == [
        "BuildingPrompt", "Spawning", "Running", "SessionComplete"]
    assert "Running" in [d["to"] for d in sessions if d["slot"] == "reviewer"]


def test_reject_then_addressing_then_approve(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "reject-once")
    code, lines = run(scripted)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    events = [m[0] for m in moves(scripted)]
    assert events == ["create_task", "check_passed", "submit", "reject", "check_passed",
                      "submit", "approve"]
    assert scripted.read_state().review_cycles == 1
    assert any("Reviewing → Addressing" in line for line in lines)


def test_consultation(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "consult")
    code, lines = run(scripted)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    events = [m for m in moves(scripted)]
    assert ("consult", "executor:scripted:1") in events
    assert ("respond_consult", "supervisor:scripted:1") in events
    assert ("finish_consult", "executor:scripted:1") in events


def test_question_answered_by_the_human(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "ask")
    asked = []

    def ask(question):
        asked.append(question)
        return "blue"
    code, lines = run(scripted, ask=ask)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert asked == ["Which colour should the button be?"]
    assert (scripted.root and open(os.path.join(scripted.root, "answer.txt")).read()) == "blue"


def test_question_without_a_human_ends_the_run_with_4(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "ask")
    code, lines = run(scripted, ask=lambda question: None)
    assert code == ferrus.RUN_NEEDS_HUMAN
    assert any("Which colour" in line for line in lines)
    assert scripted.read_state().state == S.AWAITING_HUMAN


def drive(controller, until, clock=None, step=0.0, limit=30.0):
    """Poll the controller until ``until()`` holds (real time only passes for processes)."""
    deadline = time.monotonic() + limit
    while not until():
        assert time.monotonic() < deadline, "condition not reached"
        controller.poll()
        if clock is not None:
            clock.now += step
        time.sleep(0.01)


def test_a_crashing_agent_is_restarted_with_backoff_then_stopped(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "crash-executor")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    clock = FakeMonotonic()
    messages = []
    controller = ferrus.HqController(scripted, messages.append, clock=clock)
    slot = controller.slots["executor"]
    waits = []
    for attempt in range(1, 6):
        drive(controller, lambda: slot.state in (SS.COOLING_DOWN, SS.STOPPED))
        if slot.state == SS.STOPPED:
            break
        waits.append(slot.timer - clock.now)
        controller.poll()
        assert slot.state == SS.COOLING_DOWN, "no respawn before the backoff elapsed"
        clock.now = slot.timer                      # time passes without sleeping
        drive(controller, lambda: slot.state in (SS.RUNNING, SS.STOPPED))
    assert waits == [2.0, 4.0, 8.0, 16.0]
    assert slot.state == SS.STOPPED
    assert slot.session.consecutive_errors == 5
    assert any("stopped after 5 consecutive errors" in m.text for m in messages)
    controller.shutdown()


def test_an_agent_that_exits_without_progress_is_noticed(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "silent-executor")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    messages = []
    controller = ferrus.HqController(scripted, messages.append, clock=FakeMonotonic())
    drive(controller, lambda: controller.slots["executor"].state == SS.COOLING_DOWN)
    assert any("exited (exit 0) without calling submit or consult" in m.text and
               "it said nothing (no final message) before it ended" in m.text for m in messages)
    controller.shutdown()


def test_hq_restarted_mid_task_resumes_it(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "reject-once")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    first = ferrus.HqController(scripted, lambda m: None)
    drive(first, lambda: scripted.read_state().state == S.ADDRESSING, limit=60)
    first.shutdown()                                   # HQ dies mid-task
    code, lines = run(scripted, task=None, resume=True)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert lines[0].startswith("ferrus run: State Addressing")


def test_tell_interrupts_and_the_next_prompt_carries_the_message(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "slow-executor")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    clock = FakeMonotonic()
    controller = ferrus.HqController(scripted, lambda m: None, clock=clock)
    slot = controller.slots["executor"]
    drive(controller, lambda: slot.state == SS.RUNNING)
    first_pid = slot.process.pid
    controller.tell("executor", "stop and use tabs")
    assert slot.state == SS.INTERRUPTING
    drive(controller, lambda: slot.state == SS.RUNNING and slot.process.pid != first_pid)
    assert "URGENT message from the operator" in slot.session.prompt
    assert "stop and use tabs" in slot.session.prompt
    assert slot.session.consecutive_errors == 0, "an interrupt is not an error"
    controller.stop_all()
    assert slot.state == SS.INITIALIZING and slot.process is None


# -- the session state machine itself -------------------------------------

def ev(kind, value=None, outcome=""):
    return ferrus.SessionEvent(kind, value, outcome)


def test_session_machine_table():
    s = ferrus.Session()
    s, effect = ferrus.session_step(s, ev("WorktreeReady"))
    assert s.state == SS.BUILDING_PROMPT and effect is None
    s, effect = ferrus.session_step(s, ev("PromptReady", "go"))
    assert s.state == SS.SPAWNING and effect == (ferrus.STORE_PROMPT, "go")
    s, _ = ferrus.session_step(s, ev("SessionStarted", 0))
    assert s.state == SS.RUNNING
    s, _ = ferrus.session_step(s, ev("SessionExited", outcome="success"))
    assert s.state == SS.SESSION_COMPLETE
    s, effect = ferrus.session_step(s, ev("WorktreeReady"))
    assert s.state == SS.BUILDING_PROMPT and s.session_seq == 1
    assert effect == ferrus.INCREMENT_SESSION
    s, _ = ferrus.session_step(s, ev("PromptReady", "again"))
    s, _ = ferrus.session_step(s, ev("SessionStarted", 1))
    s, effect = ferrus.session_step(s, ev("UrgentMessage", "hey"))
    assert s.state == SS.INTERRUPTING and effect == ferrus.CANCEL_SESSION and s.urgent == "hey"
    s2, effect = ferrus.session_step(s, ev("GraceExceeded"))
    assert s2.state == SS.BUILDING_PROMPT and effect == ferrus.FORCE_STOP_SESSION
    s, _ = ferrus.session_step(s, ev("SessionExited", outcome="error"))
    assert s.state == SS.BUILDING_PROMPT and s.consecutive_errors == 0 and s.total_errors == 0
    for state_name in list(SS):
        stopped, effect = ferrus.session_step(ferrus.Session(state=state_name), ev("OperatorStop"))
        assert stopped.state == SS.STOPPED
        assert effect == (ferrus.CANCEL_SESSION if state_name in (SS.RUNNING, SS.INTERRUPTING)
                          else None)
        fatal, effect = ferrus.session_step(ferrus.Session(state=state_name),
                                            ev("FatalError", "x"))
        assert fatal.state == SS.STOPPED and effect == (ferrus.LOG_FATAL, "x")


def test_backoff_formula_and_thresholds():
    assert [ferrus.backoff_ms(n) for n in range(1, 8)] == [2000, 4000, 8000, 16000, 32000,
                                                          60000, 60000]
    s = ferrus.Session(state=SS.SPAWNING, max_consecutive_errors=5, max_total_errors=7)
    for expected in (2000, 4000, 8000, 16000):
        s, _ = ferrus.session_step(s, ev("SessionExited", outcome="timeout"))
        assert s.state == SS.COOLING_DOWN and s.backoff_ms == expected
        s, _ = ferrus.session_step(s, ev("BackoffElapsed"))
        s, _ = ferrus.session_step(s, ev("PromptReady", "p"))
    s, effect = ferrus.session_step(s, ev("SessionExited", outcome="error"))
    assert s.state == SS.STOPPED and effect[0] == ferrus.LOG_FATAL
    # Total errors stop a session even when it keeps recovering in between.
    s = ferrus.Session(state=SS.RUNNING, total_errors=19)
    s, effect = ferrus.session_step(s, ev("SessionExited", outcome="error"))
    assert s.state == SS.STOPPED and "20 errors in total" in effect[1]
    # Events a state does not accept change nothing.
    same, effect = ferrus.session_step(ferrus.Session(), ev("BackoffElapsed"))
    assert same == ferrus.Session() and effect is None


def test_usage_limit_wait():
    now = __import__("datetime").datetime(2026, 5, 13, 14, 0)
    assert ferrus.usage_limit_wait("3pm (UTC)", now) == 3600 + 60
    assert ferrus.usage_limit_wait("at 13:30", now) == 23.5 * 3600 + 60
    assert ferrus.usage_limit_wait("soon", now) == 900.0


# -- the CLI ----------------------------------------------------------------------------

def cli_env(tmp):
    return dict(os.environ, SCRIPTED_DIR=str(tmp), NO_COLOR="1")


def test_ferrus_run_cli_exit_codes(scripted, tmp_path, monkeypatch):
    root = scripted.root
    done = subprocess.run(FERRUS_CMD + ["run", "--task", "Make work.txt"],
                          cwd=root, capture_output=True, text=True, timeout=120,
                          env=cli_env(tmp_path), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Reviewing → Complete" in done.stdout
    again = subprocess.run(FERRUS_CMD + ["run", "--resume"], cwd=root,
                           capture_output=True, text=True, timeout=60, env=cli_env(tmp_path))
    assert again.returncode == 2 and "nothing to run" in again.stderr
    env = dict(cli_env(tmp_path), SCRIPTED_BEHAVIOR="slow-executor")
    slow = subprocess.run(FERRUS_CMD + ["run", "--task", "slow", "--timeout", "1"],
                          cwd=root, capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)
    assert slow.returncode == 3 and "timed out" in slow.stdout
    ferrus.op_force_reset(scripted, ferrus.HUMAN)
    env = dict(cli_env(tmp_path), SCRIPTED_BEHAVIOR="ask")
    asked = subprocess.run(FERRUS_CMD + ["run", "--task", "ask"], cwd=root,
                           capture_output=True, text=True, timeout=120, env=env,
                           stdin=subprocess.DEVNULL)
    assert asked.returncode == 4 and "Which colour" in asked.stdout


def test_a_task_reset_from_outside_ends_the_run(scripted):
    """`ferrus reset` in another shell while `ferrus run` drives the task: the run says
    the task is gone and ends, instead of waiting for ever in Idle (no agent moves a reset
    task)."""
    env = dict(os.environ, FERRUS_LOG="warning", SCRIPTED_BEHAVIOR="slow-executor")
    proc = subprocess.Popen(FERRUS_CMD + ["-C", scripted.root, "run", "--task", "work"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_until(lambda: scripted.read_state().claimed_by, "the executor to claim the task",
                   proc=proc)
        task_id = scripted.read_state().task_id
        ferrus.op_force_reset(scripted, ferrus.HUMAN)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == ferrus.RUN_FAILED, out
    assert "task %s is gone: the state is Idle, changed outside this run" % task_id in out, out


def test_plain_hq_runs_a_task_to_complete(scripted, tmp_path):
    proc = subprocess.Popen(FERRUS_CMD + ["hq", "--no-tui"], cwd=scripted.root,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=cli_env(tmp_path))
    try:
        proc.stdin.write("/status\n/task Make work.txt\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 90
        while scripted.read_state().state != S.COMPLETE:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.stdin.write("/log 3\n/nonsense\nhello\n/quit\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "State Idle" in out and "executor: idle" in out and "Initializing" not in out
    assert "Reviewing → Complete" in out and "Task complete." in out
    assert "unknown command /nonsense" in out
    assert "nobody is waiting for an answer" in out
