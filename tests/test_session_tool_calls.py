"""Each session record counts its own ferrus tool calls, not those of an agent that ran
beside it: during a consultation the executor (waiting in wait_for_consult) and the
consultant run at the same time, and neither may be credited with the other's calls.
"""

import io
import json
import os
import time

import ferrus
from conftest import SCRIPTED_CONFIG, run_cli, scripted_project, set_config


def calls_per_session(store):
    """What each session's own MCP server counted (its usage file names the session)."""
    counted = {}
    folder = store.path("usage")
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as handle:
            data = json.load(handle)
        session = data["agent_id"].rsplit("/", 1)[-1]
        counted[session] = counted.get(session, 0) + sum(data["tool_calls"].values())
    return counted


def test_a_consultation_does_not_add_one_sessions_calls_to_the_other(project, tmp_path,
                                                                     monkeypatch):
    store = scripted_project(project, tmp_path / "memory")
    monkeypatch.setenv("SCRIPTED_DIR", str(tmp_path / "memory"))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "consult")
    result = run_cli("run", "--task", "Make work.txt", cwd=project, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    records = ferrus.read_session_records(store)
    assert sorted(r["slot"] for r in records) == ["consultant", "executor", "reviewer"]
    counted = calls_per_session(store)
    consultant = next(r for r in records if r["slot"] == "consultant")
    assert consultant["tool_calls"] == counted[consultant["id"]] == 1    # respond_consult
    for record in records:
        assert record["tool_calls"] == counted[record["id"]], record
    # The task's total is the sum of what the servers counted, as `ferrus status` shows.
    assert ferrus.task_usage(store, store.read_state().task_id)["tool_calls"] == \
        ferrus.tool_calls_for_task(store, store.read_state().task_id)


def test_tool_calls_for_session_reads_only_that_sessions_servers(store):
    os.makedirs(store.path("usage"))
    for agent_id, calls in (("executor:x:1/s-a", {"t-1": 4, "t-0": 9}),
                            ("supervisor:x:1/s-b", {"t-1": 1}),
                            ("executor:x:1", {"t-1": 7})):       # no session: never counted
        with open(store.path("usage", agent_id.replace(":", "_").replace("/", "_") + ".json"),
                  "w") as handle:
            json.dump({"agent_id": agent_id, "pid": 1, "tool_calls": calls}, handle)
    assert ferrus.tool_calls_for_session(store, "s-a", "t-1") == 4
    assert ferrus.tool_calls_for_session(store, "s-b", "t-1") == 1
    assert ferrus.tool_calls_for_session(store, "s-c", "t-1") == 0
    assert ferrus.tool_calls_for_task(store, "t-1") == 12


def test_hq_shows_a_running_agents_ferrus_tool_calls_when_its_output_has_none(
        project, tmp_path, monkeypatch):
    # The scripted agent prints no stream-json: only its MCP server counts its calls.
    # It asks a question and waits for the answer, so it is still running when looked at.
    store = scripted_project(project, tmp_path / "memory")
    # The count on disk reaches two when the first wait for the answer returns, after
    # wait_timeout_secs: one second here, not SCRIPTED_CONFIG's five.
    set_config(project, SCRIPTED_CONFIG.replace("wait_timeout_secs = 5", "wait_timeout_secs = 1"))
    monkeypatch.setenv("SCRIPTED_DIR", str(tmp_path / "memory"))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "ask")
    ferrus.op_create_task(store, ferrus.HUMAN, "Make work.txt")
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    controller = shell.controller
    try:
        deadline = time.monotonic() + 60
        while not (store.read_state().state == ferrus.S.AWAITING_HUMAN
                   and ferrus.tool_calls_for_task(store, store.read_state().task_id) >= 2):
            assert time.monotonic() < deadline, "the executor never asked"
            controller.poll()
            time.sleep(0.05)
        slot = controller.slots["executor"]
        assert slot.tool_calls == 0 and slot.process is not None
        calls = controller.tool_calls_of(slot)
        assert calls >= 2                       # wait_for_task, ask_human (and waits)
        shell.cmd_status("")
        assert "executor: Running (pid %d, " % slot.process.pid in out.getvalue()
        assert ", 0 tool calls)" not in out.getvalue()
        _, _, agents = ferrus.CursesHq.status_lines(shell)
        assert "executor Running (" in agents and "executor Running (0 tool calls)" not in agents
    finally:
        controller.shutdown()


def test_one_tool_call_is_singular_in_session_lines_and_usage():
    record = {"id": "s-1", "status": "ended", "outcome": "stopped", "exit_code": -15,
              "started_at": "2026-01-01T00:00:00Z", "slot": "executor", "agent": "x",
              "tool_calls": 1, "input_tokens": 0, "output_tokens": 0, "cost_usd": None}
    assert "— 1 tool call, 0/0 tokens" in ferrus.describe_session(record)
    summary = ferrus.usage_summary([record, dict(record, id="s-2", tool_calls=0)])
    assert ferrus.format_usage(summary).startswith("2 sessions, 1 tool call, ")
    assert "2 tool calls" in ferrus.describe_session(dict(record, tool_calls=2))
