"""Session records (.ferrus/sessions/) and usage: tokens and cost per session, task and
pipeline run, as `ferrus status`, `ferrus sessions`, `ferrus usage`, HQ and the capacity
gates see them.

The agents are tests/scripted_agent.py with the `usage` behaviour (it prints tool calls,
tokens and cost as Claude Code's stream-json does) and tests/scripted_worker.py with
WORKER_USAGE for pipeline workers.
"""

import datetime as dt
import io
import json
import os
import signal
import subprocess
import sys

import pytest

import ferrus
from conftest import (FERRUS_CMD, run_cli, scripted_project, set_config, SCRIPTED_CONFIG,
                      wait_until)

S = ferrus.S


@pytest.fixture
def scripted(project, tmp_path, monkeypatch):
    store = scripted_project(project, tmp_path / "memory")
    monkeypatch.setenv("SCRIPTED_DIR", str(tmp_path / "memory"))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "usage")
    return store


def records(store):
    return ferrus.read_session_records(store)


# -- folding what the CLIs report ------------------------------------------------------------

def claude_lines():
    assistant = {"type": "assistant", "message": {
        "id": "msg_1", "content": [{"type": "tool_use", "name": "mcp__x__check"}],
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 1}}}
    repeated = json.loads(json.dumps(assistant))
    repeated["message"]["content"] = [{"type": "text", "text": "checking"}]
    second = {"type": "assistant", "message": {
        "id": "msg_2", "content": [], "usage": {"input_tokens": 200, "output_tokens": 3}}}
    result = {"type": "result", "subtype": "success", "result": "ok",
              "total_cost_usd": 0.0123,
              "usage": {"input_tokens": 210, "cache_creation_input_tokens": 40,
                        "cache_read_input_tokens": 90, "output_tokens": 30}}
    init = {"type": "system", "subtype": "init", "session_id": "abc", "model": "claude-x"}
    return [json.dumps(e) for e in (init, assistant, repeated, second, result)]


def test_claude_usage_counts_each_message_once_and_the_result_replaces_the_estimate(project):
    adapter = ferrus.ClaudeCode(ferrus.load_config(str(project)))
    tally = ferrus.UsageTally()
    lines = claude_lines()
    for line in lines[:4]:
        for event in adapter.parse_line(line):
            tally.add(event)
    # msg_1 came twice (once per block): counted once; cached input counts as input.
    assert (tally.input_tokens, tally.output_tokens, tally.cost_usd) == (300, 4, None)
    assert tally.tool_calls == 1 and tally.model == "claude-x" and tally.agent_session == "abc"
    for event in adapter.parse_line(lines[4]):
        tally.add(event)
    assert (tally.input_tokens, tally.output_tokens, tally.cost_usd) == (340, 30, 0.0123)


def test_codex_turns_add_up_and_gemini_reports_totals(project):
    config = ferrus.load_config(str(project))
    tally = ferrus.UsageTally()
    for _ in range(2):
        for event in ferrus.Codex(config).parse_line(json.dumps(
                {"type": "turn.completed", "usage": {"input_tokens": 7, "output_tokens": 3}})):
            tally.add(event)
    assert (tally.input_tokens, tally.output_tokens, tally.cost_usd) == (14, 6, None)
    gemini = ferrus.UsageTally()
    for line in ({"type": "init", "session_id": "g", "model": "gemini-x"},
                 {"type": "result", "stats": {"input_tokens": 50, "output_tokens": 5}}):
        for event in ferrus.GeminiCli(config).parse_line(json.dumps(line)):
            gemini.add(event)
    assert (gemini.input_tokens, gemini.output_tokens, gemini.model) == (50, 5, "gemini-x")


def test_a_custom_agent_printing_claude_events_gets_its_usage_counted(project):
    set_config(project, SCRIPTED_CONFIG)
    config = ferrus.load_config(str(project))
    adapter = ferrus.adapter_for(config, "scripted")
    events = [e for line in claude_lines() for e in adapter.parse_line(line)]
    assert [e.kind for e in events].count("usage") == 4
    assert adapter.parse_line("plain text from a custom CLI") == []


# -- a run leaves a record of every session ----------------------------------------------------

def test_ferrus_run_records_every_session_with_its_prompt_usage_and_log(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "usage,reject-once")
    lines = []
    code = ferrus.run_loop(scripted, "Make work.txt", out=lines.append, timeout=90)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    task = scripted.read_state().task_id
    found = records(scripted)
    shown = "\n".join(lines) + "\n" + json.dumps([ferrus.session_brief(r) for r in found],
                                                  indent=1)
    assert [r["slot"] for r in found] == ["executor", "reviewer", "executor", "reviewer"], shown
    for record in found:
        assert record["status"] == "ended" and record["outcome"] == "success", shown
        assert record["exit_code"] == 0 and record["task_id"] == task
        assert record["agent"] == "scripted" and record["model"] == "scripted-model"
        assert record["argv"][0] == sys.executable and record["argv"][1].endswith(
            "scripted_agent.py")
        assert ferrus.parse_timestamp(record["started_at"]) <= \
            ferrus.parse_timestamp(record["ended_at"])
        assert os.path.isfile(os.path.join(str(scripted.root), record["log"]))
        # The lease holder names the same session as the record.
        assert record["id"].startswith("s-")
    assert "You are the ferrus executor" in found[0]["prompt"]
    assert "REVIEW mode" in found[1]["prompt"]
    # The executor called wait_for_task, check and submit; the reviewer two tools.
    assert [r["tool_calls"] for r in found] == [3, 2, 3, 2], shown
    assert [r["input_tokens"] for r in found] == [300, 200, 300, 200], shown
    assert [r["cost_usd"] for r in found] == [0.003, 0.002, 0.003, 0.002], shown
    # The last reviewer ended the task, and still got to report its cost.
    summary = ferrus.task_usage(scripted, task)
    assert summary == {"sessions": 4, "tool_calls": 10, "input_tokens": 1000,
                       "output_tokens": 100, "cost_usd": 0.01, "cost_unknown": 0}
    # `ferrus run` ends with what the task used.
    assert lines[-1].endswith("ferrus run: task %s used 4 sessions, 10 tool calls, 1k tokens "
                              "in / 100 out, $0.0100" % task), shown


def test_status_sessions_and_usage_commands_read_the_records(scripted, tmp_path):
    code = ferrus.run_loop(scripted, "Make work.txt", out=lambda line: None, timeout=90)
    assert code == ferrus.RUN_COMPLETE
    root = scripted.root
    status = run_cli("status", cwd=root)
    assert status.returncode == 0, status.stderr
    assert "usage  2 sessions, 5 tool calls, 500 tokens in / 50 out, $0.0050" in status.stdout
    session_rows = [l for l in status.stdout.splitlines() if l.strip().startswith("session ")]
    assert len(session_rows) == 2 and all(".ferrus/logs/" in row for row in session_rows)
    info = json.loads(run_cli("status", "--json", cwd=root).stdout)
    assert info["usage"]["cost_usd"] == 0.005 and len(info["sessions"]) == 2
    assert "prompt" not in info["sessions"][0] and info["sessions"][0]["state"] == "ended"

    listed = run_cli("sessions", cwd=root)
    assert listed.returncode == 0 and listed.stdout.count("success, exit 0") == 2
    full = json.loads(run_cli("sessions", "--json", cwd=root).stdout)
    assert [r["slot"] for r in full] == ["executor", "reviewer"] and full[0]["prompt"]
    one = run_cli("sessions", full[0]["id"], cwd=root)
    assert "prompt:" in one.stdout and "You are the ferrus executor" in one.stdout
    assert "argv" in one.stdout
    missing = run_cli("sessions", "s-nothing", cwd=root)
    assert missing.returncode == 1 and "no session record matches" in missing.stderr

    usage = json.loads(run_cli("usage", "--json", cwd=root).stdout)
    assert usage["total"]["input_tokens"] == 500 and usage["total"]["cost_usd"] == 0.005
    assert [t["name"] for t in usage["tasks"]] == [scripted.read_state().task_id]
    assert usage["agents"][0]["name"] == "scripted (scripted-model)"
    text = run_cli("usage", cwd=root).stdout
    assert "by task" in text and "$0.0050" in text
    later = json.loads(run_cli("usage", "--json", "--since", "2099-01-01", cwd=root).stdout)
    assert later["total"]["sessions"] == 0
    recent = json.loads(run_cli("usage", "--json", "--since", "1h", cwd=root).stdout)
    assert recent["total"]["sessions"] == 2
    bad = run_cli("usage", "--since", "last tuesday", cwd=root)
    assert bad.returncode == 2 and "--since" in bad.stderr and "hint:" in bad.stderr


def test_an_agent_that_reports_no_cost_shows_tokens_and_says_cost_is_unknown(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    task = store.read_state().task_id
    record = ferrus.open_session_record(store, "s-1", slot="executor", agent="codex", task_id=task)
    tally = ferrus.UsageTally()
    tally.add(ferrus.AgentEvent("usage", input_tokens=1500, output_tokens=20))
    ferrus.close_session_record(store, record, "success", 0, tally)
    summary = ferrus.task_usage(store, task)
    assert summary["cost_usd"] is None and summary["cost_unknown"] == 1
    assert ferrus.format_usage(summary) == \
        "1 session, 0 tool calls, 1.5k tokens in / 20 out, cost unknown"
    text = run_cli("usage", cwd=store.root).stdout
    assert "cost unknown" in text and "cost is known only where the agent CLI reports it" in text


def test_parse_since_reads_durations_dates_and_timestamps():
    now = dt.datetime(2026, 5, 13, 12, 0, tzinfo=dt.timezone.utc)
    assert ferrus.parse_since("90m", now) == now - dt.timedelta(minutes=90)
    assert ferrus.parse_since("7d", now) == now - dt.timedelta(days=7)
    assert ferrus.parse_since("2026-05-01T00:00:00Z", now) == dt.datetime(
        2026, 5, 1, tzinfo=dt.timezone.utc)
    assert ferrus.parse_since("2026-05-01", now).date() == dt.date(2026, 5, 1)
    with pytest.raises(ferrus.UsageError):
        ferrus.parse_since("yesterday-ish", now)


# -- restarts and a killed orchestrator --------------------------------------------------------

def test_a_killed_orchestrator_leaves_a_record_that_says_so_and_the_next_one_closes_it(
        scripted, tmp_path):
    env = dict(os.environ, SCRIPTED_BEHAVIOR="usage,slow-executor", NO_COLOR="1")
    proc = subprocess.Popen(FERRUS_CMD + ["run", "--task", "Make work.txt"],
                            cwd=str(scripted.root), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        # The executor claimed the task (one tool call) and sleeps: its count is on disk.
        record = wait_until(lambda: next((r for r in records(scripted)
                                          if r["tool_calls"] >= 1), None),
                            "the running executor's record shows its first tool call")
        assert record["status"] == "running" and ferrus.session_state(record) == "running"
        assert record["orchestrator"]["kind"] == "ferrus run"
        assert record["orchestrator"]["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    # Nothing closed it, and anyone reading it can tell its orchestrator died.
    listed = json.loads(run_cli("sessions", "--json", cwd=scripted.root).stdout)
    assert [r["state"] for r in listed] == ["orphaned"]
    assert "orphaned (its orchestrator, pid %d, died)" % proc.pid in \
        run_cli("sessions", cwd=scripted.root).stdout
    # The next orchestrator stops the agent left behind and closes the record, with the
    # counts read again from the session's log.
    with ferrus.OrchestratorLock(scripted, "test") as held:
        assert any("closed the record of the executor session" in n for n in held.notes)
    closed = records(scripted)[0]
    assert closed["status"] == "ended" and closed["outcome"] == "orphaned"
    assert "pid %d" % proc.pid in closed["note"] and closed["tool_calls"] == 1
    assert closed["input_tokens"] == 100 and closed["ended_at"]


def test_usage_survives_a_restart_and_the_capacity_gate_counts_it(scripted):
    set_config(scripted.root, SCRIPTED_CONFIG + "\n[capacity]\nmax_tokens = 1000\n")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    task = scripted.read_state().task_id
    # Sessions of this task recorded by an earlier orchestrator (HQ or `ferrus run`).
    for index in range(2):
        tally = ferrus.UsageTally()
        tally.add(ferrus.AgentEvent("usage", input_tokens=500, output_tokens=60, total=True))
        record = ferrus.open_session_record(scripted, "s-old-%d" % index, slot="executor",
                                            task_id=task)
        ferrus.close_session_record(scripted, record, "error", 1, tally)
    controller = ferrus.HqController(scripted, lambda message: None)
    assert controller.signals().tokens_used == 1120
    assert controller.gate("spawn:executor") in (ferrus.CHECKPOINT, ferrus.EMERGENCY_STOP)
    gate = [e["detail"] for e in scripted.read_journal() if e["event"] == "gate"][0]
    assert gate["tokens_used"] == 1120 and gate["signal"] == "tokens_used"


def test_a_running_sessions_counts_reach_the_gate_before_it_ends(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "usage,slow-executor")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    controller = ferrus.HqController(scripted, lambda message: None)
    try:
        wait_until(lambda: controller.poll() or controller.slots["executor"].tool_calls >= 1,
                   "the executor's first tool call")
        # The gate reads the record, which is written before the signals are taken.
        assert controller.signals().tokens_used == 110
        assert records(scripted)[0]["input_tokens"] == 100
    finally:
        controller.shutdown()
    record = records(scripted)[0]
    assert record["outcome"] == "stopped" and record["note"] == "its orchestrator ended"


# -- HQ ------------------------------------------------------------------------------------------

def test_hq_status_and_status_line_show_the_tasks_sessions_and_usage(scripted):
    code = ferrus.run_loop(scripted, "Make work.txt", out=lambda line: None, timeout=90)
    assert code == ferrus.RUN_COMPLETE
    out = io.StringIO()
    shell = ferrus.HqShell(scripted, stdin=io.StringIO(""), stdout=out)
    shell.cmd_status("")
    text = out.getvalue()
    assert "2 sessions, 5 tool calls, 500 tokens in / 50 out, $0.0050" in text
    assert text.count(".ferrus/logs/") == 2
    # The curses screen's top line (read without a terminal).
    _, line, _ = ferrus.CursesHq.status_lines(shell)
    assert "550 tok $0.01" in line


# -- pipelines -----------------------------------------------------------------------------------

PIPELINE_CONFIG = """
[agents.custom.worker]
interactive = [%(py)s, %(script)s]
headless = [%(py)s, %(script)s]
prompt = "stdin"

[hq.executor]
agent = "worker"
"""

WORKFLOWS = {"duo": {"description": "two workers", "phases": [
    {"id": "one", "mode": "parallel", "workers": [
        {"role": "first", "timeout": 60, "task": "one"},
        {"role": "second", "timeout": 60, "task": "two", "final": True}]}]}}


def test_pipeline_workers_have_records_with_their_usage_per_run(project, monkeypatch):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripted_worker.py")
    set_config(project, PIPELINE_CONFIG % {"py": json.dumps(sys.executable),
                                           "script": json.dumps(worker)})
    with open(os.path.join(str(project), "workflows.json"), "w") as handle:
        json.dump(WORKFLOWS, handle)
    for name in ("WORKER_LOG", "WORKER_FAIL", "WORKER_FAIL_ONCE", "WORKER_SILENT",
                 "WORKER_SLOW", "WORKER_DELAY"):
        monkeypatch.delenv(name, raising=False)
    # Each worker writes its output, then reports its usage a moment later.
    monkeypatch.setenv("WORKER_USAGE", "0.3")
    store = ferrus.Store(str(project))
    orchestrator = ferrus.PipelineOrchestrator(store)
    run = orchestrator.create("duo", "a topic")
    outcome = orchestrator.drive(run, poll_interval=0.02)
    assert outcome.state == "delivered", outcome
    found = [r for r in records(store) if r.get("pipeline") == run]
    assert sorted(r["role"] for r in found) == ["first", "second"]
    for record in found:
        assert record["status"] == "ended" and record["outcome"] == "success", record
        assert record["exit_code"] == 0 and record["slot"] == "worker"
        assert (record["input_tokens"], record["output_tokens"], record["cost_usd"]) == \
            (1000, 200, 0.05)
        assert "Write your complete result to exactly this file" in record["prompt"]
        # The run was archived: the record names the log where it is now.
        assert "/archive/" in record["log"]
        assert os.path.isfile(os.path.join(str(project), record["log"]))
    status = run_cli("pipeline", "status", run, cwd=project).stdout
    assert "usage     2 sessions, 0 tool calls, 2k tokens in / 400 out, $0.1000" in status
    usage = json.loads(run_cli("usage", "--json", cwd=project).stdout)
    assert usage["pipelines"] == [dict(usage["pipelines"][0], name=run, sessions=2,
                                       input_tokens=2000, output_tokens=400, cost_usd=0.1)]
    assert usage["tasks"] == []


def test_an_agent_that_cannot_start_leaves_a_record_saying_why(project, tmp_path):
    from conftest import custom_agent_config
    program = tmp_path / "agent"
    program.write_text("this is not a program\n")
    program.chmod(0o755)
    set_config(project, custom_agent_config("broken", [str(program), "{role}"]))
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    controller = ferrus.HqController(store, lambda message: None, clock=lambda: 1000.0)
    controller.poll()
    record = records(store)[0]
    assert record["outcome"] == "not started" and record["status"] == "ended"
    assert str(program) in record["note"] and record["agent"] == "broken"
    assert "You are the ferrus executor" in record["prompt"]


def test_an_agent_whose_output_reports_nothing_still_has_its_ferrus_tool_calls(scripted,
                                                                                monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "")       # plain text output, no usage events
    code = ferrus.run_loop(scripted, "Make work.txt", out=lambda line: None, timeout=90)
    assert code == ferrus.RUN_COMPLETE
    found = records(scripted)
    assert [(r["slot"], r["tool_calls"]) for r in found] == [("executor", 3), ("reviewer", 2)]
    assert all(r["input_tokens"] == 0 and r["cost_usd"] is None for r in found)
    assert "cost unknown" in ferrus.format_usage(ferrus.task_usage(
        scripted, scripted.read_state().task_id))


def test_an_interactive_hq_session_is_recorded_with_its_exit_and_unknown_usage(project):
    quick = [sys.executable, "-c", "import sys; sys.exit(3)"]
    set_config(project, """
[agents.custom.quick]
interactive = %s
headless = %s

[hq.supervisor]
agent = "quick"
model = "m1"
""" % (json.dumps(quick), json.dumps(quick)))
    store = ferrus.Store(str(project))
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=io.StringIO())
    shell.interactive("supervisor", "Plan the work.")
    record = records(store)[0]
    assert record["slot"] == "interactive supervisor" and record["model"] == "m1"
    assert record["prompt"] == "Plan the work." and record["exit_code"] == 3
    assert record["outcome"] == "ended" and record["usage_reported"] is False
    assert "usage not reported" in ferrus.describe_session(record)


REVIEWER_LAST_WORDS = """
import json, os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
time.sleep(0.3)                      # its last model turn, after the approve
print(json.dumps({"type": "result", "result": "Approved.", "total_cost_usd": 0.25,
                  "usage": {"input_tokens": 40, "output_tokens": 4}}), flush=True)
"""


def test_a_reviewer_that_ended_the_task_gets_to_report_its_cost(store, tmp_path):
    """The run can see Complete before its controller does; the reviewer that approved is
    still given its grace, so its record has the cost of its last words."""
    go = tmp_path / "go"
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    ferrus.op_submit(store, ferrus.Caller("executor", "executor:test:1"), "Done.")

    def launcher(slot):
        return (ferrus.Launch([sys.executable, "-c", REVIEWER_LAST_WORDS, str(go)]),
                ferrus._parse_claude_style)
    controller = ferrus.HqController(store, lambda message: None, launcher=launcher)
    wait_until(lambda: controller.poll() or controller.slots["reviewer"].process is not None,
               "the reviewer started")
    ferrus.op_approve(store, ferrus.Caller("supervisor", "supervisor:test:1"))
    go.write_text("")
    controller.wind_down()               # without a poll since the approve
    controller.shutdown()
    record = [r for r in records(store) if r["slot"] == "reviewer"][0]
    assert (record["outcome"], record["exit_code"], record["cost_usd"]) == ("success", 0, 0.25)
