"""Capacity gates (docs/ARCHITECTURE.md, 'Capacity gates'): tiers and actions, GateRecords
in the journal, and the wiring into HQ and `ferrus run` (Throttle waits, Checkpoint halts,
EmergencyStop kills)."""

import os
import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, set_config
from conftest import FakeMonotonic
from test_hq import CONFIG, drive

SS = ferrus.SS


@pytest.mark.parametrize("signal,limit", [("tool_calls", "max_tool_calls"),
                                          ("sessions", "max_sessions"),
                                          ("tasks_completed", "max_tasks"),
                                          ("tokens_used", "max_tokens"),
                                          ("parallel_agents", "max_parallel_agents")])
def test_each_signal_reaches_each_tier(signal, limit):
    limits = ferrus.CapacityConfig(**{limit: 10}, orange_percent=80, emergency_percent=150)
    seen = []
    for value in (0, 7, 8, 9, 10, 14, 15, 40):
        tier, action, worst = ferrus.classify(ferrus.Signals(**{signal: value}), limits)
        seen.append((value, tier, action))
        if value:
            assert worst == signal
    assert seen == [(0, "Green", "Continue"), (7, "Green", "Continue"),
                    (8, "Orange", "Throttle"), (9, "Orange", "Throttle"),
                    (10, "Red", "Checkpoint"), (14, "Red", "Checkpoint"),
                    (15, "Red", "EmergencyStop"), (40, "Red", "EmergencyStop")]


def test_limits_are_off_by_default_and_the_worst_signal_decides():
    assert not ferrus.CapacityConfig().enabled()
    assert ferrus.classify(ferrus.Signals(tool_calls=10 ** 6), ferrus.CapacityConfig()) == (
        "Green", "Continue", None)
    limits = ferrus.CapacityConfig(max_tool_calls=100, max_sessions=2)
    assert ferrus.classify(ferrus.Signals(tool_calls=10, sessions=2), limits)[1:] == (
        "Checkpoint", "sessions")
    record = ferrus.gate_record("spawn:executor", "Red", "Checkpoint",
                                ferrus.Signals(tool_calls=10, sessions=2), limits, "sessions")
    for field in ("target", "tier", "action", "tool_calls", "sessions", "tasks_completed",
                  "tokens_used", "parallel_agents"):
        assert field in record
    assert record["limits"] == {"max_tool_calls": 100, "max_sessions": 2}


def test_capacity_config_is_validated(project):
    set_config(project, "[capacity]\norange_percent = 120\n")
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.load_config(str(project))
    assert "capacity.orange_percent" in err.value.message


def test_mcp_servers_count_tool_calls_per_task(project):
    from mcp_client import McpProcess
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    task = store.read_state().task_id
    with McpProcess(project, "--role", "executor") as server:
        server.initialize()
        for _ in range(3):
            server.call_tool("status")
    assert ferrus.tool_calls_for_task(store, task) == 3
    assert ferrus.tool_calls_for_task(store, "other") == 0


def gates(store):
    return [e["detail"] for e in store.read_journal() if e["event"] == "gate"]


def with_capacity(project, text):
    set_config(project, CONFIG + "\n[capacity]\n" + text)


def test_throttle_waits_and_says_so(scripted, project):
    with_capacity(project, "max_sessions = 4\norange_percent = 25\nthrottle_secs = 30\n")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    clock = FakeMonotonic()
    messages = []
    controller = ferrus.HqController(scripted, messages.append, clock=clock)
    drive(controller, lambda: scripted.read_state().state == ferrus.S.REVIEWING)
    reviewer = controller.slots["reviewer"]
    drive(controller, lambda: controller.throttle_until is not None)
    assert reviewer.state == SS.SPAWNING and reviewer.process is None
    assert any("waiting 30s before starting the next agent" in m.text for m in messages)
    controller.poll()
    assert reviewer.process is None, "no spawn before the throttle delay"
    clock.now = controller.throttle_until
    drive(controller, lambda: scripted.read_state().state == ferrus.S.COMPLETE)
    records = gates(scripted)
    assert records[0]["tier"] == "Green" and records[0]["target"] == "spawn:executor"
    assert any(r["tier"] == "Orange" and r["action"] == "Throttle" for r in records)
    controller.shutdown()


def test_checkpoint_halts_ferrus_run_with_3_and_resumes_after_raising_limits(scripted, project,
                                                                             tmp_path):
    with_capacity(project, "max_sessions = 1\n")
    env = dict(os.environ, SCRIPTED_DIR=str(tmp_path))
    first = subprocess.run(FERRUS_CMD + ["run", "--task", "Make work.txt"],
                           cwd=str(project), capture_output=True, text=True, timeout=120,
                           env=env, stdin=subprocess.DEVNULL)
    assert first.returncode == 3, first.stdout + first.stderr
    assert "capacity checkpoint" in first.stdout
    data = scripted.read_state()
    assert data.state == ferrus.S.REVIEWING
    assert data.extra["capacity_checkpoint"]["action"] == "Checkpoint"
    status = subprocess.run(FERRUS_CMD + ["status"], cwd=str(project),
                            capture_output=True, text=True, env=env)
    assert "Red (Checkpoint, sessions)" in status.stdout and "checkpoint" in status.stdout
    again = subprocess.run(FERRUS_CMD + ["run", "--resume"], cwd=str(project),
                           capture_output=True, text=True, timeout=60, env=env,
                           stdin=subprocess.DEVNULL)
    assert again.returncode == 3 and "still holds" in again.stdout
    with_capacity(project, "max_sessions = 10\n")
    resumed = subprocess.run(FERRUS_CMD + ["run", "--resume"], cwd=str(project),
                             capture_output=True, text=True, timeout=120, env=env,
                             stdin=subprocess.DEVNULL)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert scripted.read_state().state == ferrus.S.COMPLETE
    assert "capacity_checkpoint" not in scripted.read_state().extra
    actions = [r["action"] for r in gates(scripted)]
    assert "Checkpoint" in actions and actions[-1] == "Continue"


def test_emergency_stop_kills_running_agents(scripted, project, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "slow-executor")
    with_capacity(project, "max_tool_calls = 1\nemergency_percent = 100\n")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    clock = FakeMonotonic()
    messages = []
    controller = ferrus.HqController(scripted, messages.append, clock=clock)
    executor = controller.slots["executor"]
    drive(controller, lambda: executor.state == SS.RUNNING)
    process = executor.process
    task = scripted.read_state().task_id
    drive(controller, lambda: ferrus.tool_calls_for_task(scripted, task) >= 1)
    clock.now += 2
    drive(controller, lambda: controller.checkpoint is not None, clock=clock, step=1.0)
    assert process.proc.poll() is not None, "the running agent was killed at once"
    assert controller.running() == []
    record = gates(scripted)[-1]
    assert (record["target"], record["tier"], record["action"]) == ("running", "Red",
                                                                    "EmergencyStop")
    assert record["tool_calls"] >= 1
    assert any("EmergencyStop" in m.text for m in messages)
    controller.poll()
    assert executor.process is None, "nothing is spawned after an emergency stop"
    controller.continue_after_checkpoint()
    assert controller.checkpoint is None
    controller.shutdown()
