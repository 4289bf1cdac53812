"""Turns and the context in use, from what each agent CLI reports (docs/HQ.md, 'Capacity
gates'): folded by UsageTally, kept in the session records, and measured by HQ's capacity
gate against `[capacity] max_turns` and `context_window`."""

import json
import os
import subprocess

import ferrus
from conftest import FERRUS_CMD, set_config
from conftest import FakeMonotonic
from test_hq import CONFIG, drive


def fold(adapter, events):
    tally = ferrus.UsageTally()
    for event in events:
        for parsed in adapter.parse_line(json.dumps(event)):
            tally.add(parsed)
    return tally


def claude_turn(message_id, text_or_tool, usage):
    block = {"type": "tool_use", "name": text_or_tool, "input": {}} \
        if text_or_tool.startswith("mcp__") else {"type": "text", "text": text_or_tool}
    return {"type": "assistant", "message": {"id": message_id, "model": "claude-x",
                                             "content": [block], "usage": usage}}


def claude_session(result_extra):
    first = {"input_tokens": 3, "cache_creation_input_tokens": 2000,
             "cache_read_input_tokens": 10000, "output_tokens": 50}
    second = {"input_tokens": 5, "cache_creation_input_tokens": 300,
              "cache_read_input_tokens": 12000, "output_tokens": 20}
    result = {"type": "result", "subtype": "success", "is_error": False, "result": "done",
              "total_cost_usd": 0.02, "usage": {"input_tokens": 8,
                                                "cache_creation_input_tokens": 2300,
                                                "cache_read_input_tokens": 22000,
                                                "output_tokens": 70}}
    result.update(result_extra)
    return [{"type": "system", "subtype": "init", "session_id": "c1", "model": "claude-x"},
            claude_turn("msg_1", "mcp__ferrus-executor__check", first),
            claude_turn("msg_1", "checking", first),           # the same message, next block
            {"type": "user", "message": {"content": [{"type": "tool_result", "content": "ok"}]}},
            claude_turn("msg_2", "Done.", second), result]


def test_claude_counts_a_turn_per_message_and_the_context_of_the_last_one(project):
    adapter = ferrus.ClaudeCode(ferrus.load_config(str(project)))
    events = claude_session({})
    partial = fold(adapter, events[:3])
    assert (partial.turns, partial.context_tokens) == (1, 12003)
    tally = fold(adapter, events)
    # Two messages, the first repeated per block; the result (without num_turns) keeps
    # that count; the context is the last request's input with its cached tokens.
    assert (tally.turns, tally.context_tokens) == (2, 12305)
    assert tally.counts()["turns"] == 2 and tally.counts()["context_tokens"] == 12305


def test_num_turns_of_the_result_is_the_total(project):
    adapter = ferrus.ClaudeCode(ferrus.load_config(str(project)))
    tally = fold(adapter, claude_session({"num_turns": 3}))
    assert (tally.turns, tally.context_tokens) == (3, 12305)
    # Nonsense counts are ignored rather than trusted.
    for bad in (-4, "7", True, None):
        assert fold(adapter, claude_session({"num_turns": bad})).turns == 2


def test_qwen_reports_like_claude(project):
    adapter = ferrus.QwenCode(ferrus.load_config(str(project)))
    usage = {"input_tokens": 9000, "output_tokens": 40, "total_tokens": 9040}
    events = [{"type": "system", "subtype": "init", "session_id": "q1", "model": "qwen3"},
              claude_turn("m1", "mcp__ferrus-executor__submit", usage),
              {"type": "result", "subtype": "success", "result": "ok", "num_turns": 1,
               "usage": usage}]
    tally = fold(adapter, events)
    assert (tally.turns, tally.context_tokens) == (1, 9000)


def test_codex_counts_completed_turns_and_reports_no_context(project):
    adapter = ferrus.Codex(ferrus.load_config(str(project)))
    events = [{"type": "thread.started", "thread_id": "t-1"}, {"type": "turn.started"},
              {"type": "item.completed", "item": {"id": "item_1", "type": "command_execution",
                                                  "command": "ls", "exit_code": 0}},
              {"type": "turn.completed", "usage": {"input_tokens": 24763,
                                                   "cached_input_tokens": 24448,
                                                   "output_tokens": 122}}]
    tally = fold(adapter, events)
    # Codex's usage is the sum over every request of the turn: not one context.
    assert (tally.turns, tally.context_tokens, tally.tool_calls) == (1, 0, 1)


def test_gemini_turns_are_counted_from_its_stream(project):
    adapter = ferrus.GeminiCli(ferrus.load_config(str(project)))
    now = "2026-01-01T00:00:00.000Z"
    events = [
        {"type": "init", "timestamp": now, "session_id": "g1", "model": "gemini-2.5-pro"},
        {"type": "message", "timestamp": now, "role": "user", "content": "Do the task"},
        # turn 1: text in chunks, then two tool calls
        {"type": "message", "timestamp": now, "role": "assistant", "content": "I will",
         "delta": True},
        {"type": "message", "timestamp": now, "role": "assistant", "content": " look.",
         "delta": True},
        {"type": "tool_use", "timestamp": now, "tool_name": "read_file", "tool_id": "a",
         "parameters": {"absolute_path": "/p/a.py"}},
        {"type": "tool_use", "timestamp": now, "tool_name": "read_file", "tool_id": "b",
         "parameters": {"absolute_path": "/p/b.py"}},
        {"type": "tool_result", "timestamp": now, "tool_id": "a", "status": "success"},
        {"type": "tool_result", "timestamp": now, "tool_id": "b", "status": "success"},
        # turn 2: only a tool call
        {"type": "tool_use", "timestamp": now, "tool_name": "mcp_ferrus-executor_submit",
         "tool_id": "c", "parameters": {"content": "done"}},
        {"type": "tool_result", "timestamp": now, "tool_id": "c", "status": "success"},
        # turn 3: the answer
        {"type": "message", "timestamp": now, "role": "assistant", "content": "Submitted.",
         "delta": True},
        {"type": "result", "timestamp": now, "status": "success",
         "stats": {"total_tokens": 5000, "input_tokens": 4800, "output_tokens": 200,
                   "cached": 0, "input": 4800, "duration_ms": 900, "tool_calls": 3}}]
    tally = fold(adapter, events)
    assert (tally.turns, tally.tool_calls, tally.context_tokens) == (3, 3, 0)
    assert (tally.input_tokens, tally.output_tokens) == (4800, 200)


def test_session_records_keep_turns_and_context(project):
    store = ferrus.Store(str(project))
    record = ferrus.open_session_record(store, "s-1", slot="executor", agent="claude-code")
    assert (record["turns"], record["context_tokens"]) == (0, 0)
    adapter = ferrus.ClaudeCode(ferrus.load_config(str(project)))
    tally = fold(adapter, claude_session({})[:3])
    assert ferrus.update_session_counts(store, record, tally)
    saved = ferrus.read_session_records(store)[0]
    assert (saved["turns"], saved["context_tokens"]) == (1, 12003)


# -- HQ's gate measures them ----------------------------------------------------------

def test_hq_signals_sum_turns_and_take_the_running_context(scripted, project, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "usage,slow-executor")
    set_config(project, CONFIG + "\n[capacity]\nmax_turns = 1000\ncontext_window = 400\n")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    controller = ferrus.HqController(scripted, lambda message: None, clock=FakeMonotonic())
    executor = controller.slots["executor"]
    try:
        drive(controller, lambda: executor.process is not None
              and executor.process.tally.turns >= 1)
        signals = controller.signals()
        # Each scripted call is a Claude message of 100 input tokens.
        assert signals.turns >= 1 and signals.context_tokens_used == 100
        assert signals.context_tokens_max == 400
        assert ferrus.classify(signals, scripted.config().capacity)[:2] == ("Green", "Continue")
        record = next(r for r in ferrus.read_session_records(scripted) if r["slot"] == "executor")
        assert record["turns"] == signals.turns and record["context_tokens"] == 100
    finally:
        controller.shutdown()
    # Once no agent runs, no context is in use.
    assert controller.signals().context_tokens_used == 0


def test_ferrus_run_stops_at_max_turns(scripted, project, tmp_path):
    set_config(project, CONFIG + "\n[capacity]\nmax_turns = 1\n")
    env = dict(os.environ, SCRIPTED_DIR=str(tmp_path), SCRIPTED_BEHAVIOR="usage")
    done = subprocess.run(FERRUS_CMD + ["run", "--task", "Make work.txt"],
                          cwd=str(project), capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "capacity checkpoint" in done.stdout
    checkpoint = scripted.read_state().extra["capacity_checkpoint"]
    assert checkpoint["signal"] == "turns" and checkpoint["turns"] >= 1
    executor = [r for r in ferrus.read_session_records(scripted) if r["slot"] == "executor"]
    assert executor and executor[0]["turns"] >= 1
