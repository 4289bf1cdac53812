"""Failed and denied tool calls in plain sight: each agent CLI's output parser finds
the calls that failed, with why, and `ferrus run` / HQ print them as failed; the tool
names look the same whichever CLI made the call; an agent that ends without moving the
task shows its last words.

The fixture lines are real output, recorded by driving each CLI headless with ferrus's
own argv against the scripted model servers (tests/fake_anthropic.py,
tests/fake_models.py): Claude Code 2.1.197 and Qwen Code 0.15.10 stream-json, Codex
0.171 `exec --json`, Gemini CLI 0.61 stream-json.  Only bulky fields that say nothing
about tool calls (uuids, usage, timestamps) were taken out, and the temporary project's
path written as /work/p.
"""

import dataclasses
import json

import pytest

import ferrus

# Claude Code as an executor (acceptEdits, Bash allowed for this recording) and as a
# read-only reviewer: a Read of a missing file, a failing command, Write and Edit not
# enabled (the reviewer's profile), a command outside the project blocked, a ferrus tool
# refusing, then its last message.
CLAUDE = r"""
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"toolu_01gtWK9hB79G5cvAZIpb4xNMBM","name":"Read","input":{"file_path":"/work/p/missing.txt"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","content":"File does not exist. Note: your current working directory is /work/p.","is_error":true,"tool_use_id":"toolu_01gtWK9hB79G5cvAZIpb4xNMBM"}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"toolu_01T4vFKM3q4uT82JX0WQQgjhKI","name":"Bash","input":{"command":"cat nothere.txt","description":"fail"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","content":"Exit code 1\ncat: nothere.txt: No such file or directory","is_error":true,"tool_use_id":"toolu_01T4vFKM3q4uT82JX0WQQgjhKI"}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"toolu_01lCiWaxwb9OALUUSJK9T3a578","name":"Write","input":{"file_path":"/work/p/w.txt","content":"x"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","content":"<tool_use_error>Error: No such tool available: Write. Write exists but is not enabled in this context. Use one of the available tools instead.</tool_use_error>","is_error":true,"tool_use_id":"toolu_01lCiWaxwb9OALUUSJK9T3a578"}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"toolu_011W2Wu1ls5VRV5L0qlK4DwCkX","name":"Edit","input":{"file_path":"/work/p/ferrus.toml","old_string":"NOPE","new_string":"y"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","content":"<tool_use_error>Error: No such tool available: Edit. Edit exists but is not enabled in this context. Use one of the available tools instead.</tool_use_error>","is_error":true,"tool_use_id":"toolu_011W2Wu1ls5VRV5L0qlK4DwCkX"}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"toolu_01Tq36o9n6mTu0e2rMQaRf3cUY","name":"Bash","input":{"command":"ls /nonexistent-dir-xyz","description":"fail"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","content":"ls in '/nonexistent-dir-xyz' was blocked. For security, Claude Code may only list files in the allowed working directories for this session: '/work/p'.","is_error":true,"tool_use_id":"toolu_01Tq36o9n6mTu0e2rMQaRf3cUY"}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"toolu_01V0OYFvIIyPH70GcCbKol9Y9A","name":"mcp__ferrus-executor-1__submit","input":{"content":"x"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","content":"Cannot submit from state Idle. Submit is only valid from Executing or Addressing after the implementation is ready.","is_error":true,"tool_use_id":"toolu_01V0OYFvIIyPH70GcCbKol9Y9A"}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"text","text":"I give up: the build is broken and I cannot fix it."}]}}
"""

# Codex `exec --json` in workspace-write: two failing commands, one that worked, a patch
# applied, ferrus's submit refusing, its last message.
CODEX = r"""
{"type":"item.completed","item":{"id":"item_1","type":"command_execution","command":"/bin/bash -lc 'cat missing.txt'","aggregated_output":"cat: missing.txt: No such file or directory\n","exit_code":1,"status":"failed"}}
{"type":"item.completed","item":{"id":"item_2","type":"command_execution","command":"/bin/bash -lc 'ls /nonexistent-dir-xyz'","aggregated_output":"ls: cannot access '/nonexistent-dir-xyz': No such file or directory\n","exit_code":2,"status":"failed"}}
{"type":"item.completed","item":{"id":"item_3","type":"command_execution","command":"/bin/bash -lc 'printf x > w.txt'","aggregated_output":"","exit_code":0,"status":"completed"}}
{"type":"item.completed","item":{"id":"item_4","type":"file_change","changes":[{"path":"/work/p/new.txt","kind":"add"}],"status":"completed"}}
{"type":"item.completed","item":{"id":"item_5","type":"mcp_tool_call","server":"ferrus-executor-1","tool":"submit","arguments":{"content":"x"},"result":{"content":[{"type":"text","text":"Cannot submit from state Idle. Submit is only valid from Executing or Addressing after the implementation is ready."}],"structured_content":null},"error":null,"status":"failed"}}
{"type":"item.completed","item":{"id":"item_6","type":"agent_message","text":"I give up: the build is broken and I cannot fix it."}}
"""

# Qwen Code as a read-only reviewer (approval mode default): a missing file, the shell and
# the edit tools declined, then (as an executor) ferrus's submit refusing through the MCP
# error Qwen wraps in the call's JSON.
QWEN = r"""
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"call_U1Qx2dCYpW43HoO9XC3I","name":"read_file","input":{"file_path":"/work/p/missing.txt","absolute_path":"/work/p/missing.txt"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","tool_use_id":"call_U1Qx2dCYpW43HoO9XC3I","is_error":true,"content":"File not found: /work/p/missing.txt"}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"call_JlxztUlnJD5QvPovbN7Y","name":"run_shell_command","input":{"cmd":"ls /nonexistent-dir-xyz"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","tool_use_id":"call_JlxztUlnJD5QvPovbN7Y","is_error":true,"content":"Qwen Code requires permission to use \"run_shell_command\", but that permission was declined. Matching deny rule: \"run_shell_command\"."}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"call_e2qli9Exk1YcZTKY7jQZ","name":"write_file","input":{"cmd":"printf x > w.txt"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","tool_use_id":"call_e2qli9Exk1YcZTKY7jQZ","is_error":true,"content":"Qwen Code requires permission to use \"write_file\", but that permission was declined. Matching deny rule: \"edit\"."}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"call_4k0MNfOZQB8Ohzd1vJ79","name":"mcp__ferrus-executor-1__submit","input":{"content":"x"}}]}}
{"type":"user","message":{"role":"user","content":[{"type":"tool_result","tool_use_id":"call_4k0MNfOZQB8Ohzd1vJ79","is_error":true,"content":"MCP tool 'submit' reported tool error for function call: {\"name\":\"submit\",\"args\":{\"content\":\"x\"}} with response: [{\"functionResponse\":{\"name\":\"submit\",\"response\":{\"error\":{\"content\":[{\"type\":\"text\",\"text\":\"Cannot submit from state Idle. Submit is only valid from Executing or Addressing after the implementation is ready.\"}],\"isError\":true},\"content\":\"[Circular]\"}}}]"}]}}
{"type":"assistant","message":{"role":"assistant","content":[{"type":"text","text":"I give up: the build is broken and I cannot fix it."}]}}
"""

# Gemini CLI as an executor (auto_edit): a missing file, the shell not offered, a write
# that worked, a replace with bad arguments, ferrus's submit refusing (wrapped as Qwen's),
# its last message streamed as a delta.
GEMINI = r"""
{"type":"tool_use","tool_name":"read_file","tool_id":"read_file__read_file_1795763544415_0","parameters":{"file_path":"/work/p/missing.txt","absolute_path":"/work/p/missing.txt"}}
{"type":"tool_result","tool_id":"read_file__read_file_1795763544415_0","status":"error","output":"File not found.","error":{"type":"file_not_found","message":"File not found: /work/p/missing.txt"}}
{"type":"tool_use","tool_name":"run_shell_command","tool_id":"run_shell_command__run_shell_command_1795763544488_0","parameters":{"cmd":"ls /nonexistent-dir-xyz"}}
{"type":"tool_result","tool_id":"run_shell_command__run_shell_command_1795763544488_0","status":"error","output":"Tool \"run_shell_command\" not found. Did you mean one of: \"update_topic\", \"grep_search\", \"replace\"?","error":{"type":"tool_not_registered","message":"Tool \"run_shell_command\" not found. Did you mean one of: \"update_topic\", \"grep_search\", \"replace\"?"}}
{"type":"tool_use","tool_name":"write_file","tool_id":"write_file__write_file_1795763544510_0","parameters":{"file_path":"/work/p/w.txt","content":"x"}}
{"type":"tool_result","tool_id":"write_file__write_file_1795763544510_0","status":"success"}
{"type":"tool_use","tool_name":"replace","tool_id":"replace__replace_1795763544531_0","parameters":{"file_path":"/work/p/ferrus.toml","old_string":"NOPE","new_string":"y"}}
{"type":"tool_result","tool_id":"replace__replace_1795763544531_0","status":"error","output":"params must have required property 'instruction'","error":{"type":"invalid_tool_params","message":"params must have required property 'instruction'"}}
{"type":"tool_use","tool_name":"mcp_ferrus-executor-1_submit","tool_id":"mcp_ferrus-executor-1_submit__mcp_ferrus-executor-1_submit_1795763544553_0","parameters":{"content":"x"}}
{"type":"tool_result","tool_id":"mcp_ferrus-executor-1_submit__mcp_ferrus-executor-1_submit_1795763544553_0","status":"error","output":"Error: MCP tool 'submit' reported an error.","error":{"type":"mcp_tool_error","message":"MCP tool 'submit' reported tool error for function call: {\"name\":\"submit\",\"args\":{\"content\":\"x\"}} with response: [{\"functionResponse\":{\"name\":\"submit\",\"response\":{\"content\":[{\"type\":\"text\",\"text\":\"Cannot submit from state Idle. Submit is only valid from Executing or Addressing after the implementation is ready.\"}],\"isError\":true}}}]"}}
{"type":"message","role":"assistant","content":"I give up: the build is broken and I cannot fix it.","delta":true}
"""

ADAPTERS = {"claude": (ferrus.ClaudeCode, CLAUDE), "codex": (ferrus.Codex, CODEX),
            "qwen": (ferrus.QwenCode, QWEN), "gemini": (ferrus.GeminiCli, GEMINI)}


class RecordedAgent:
    """An agent process that already printed ``lines`` (parsed by ``adapter``)."""

    def __init__(self, adapter, lines):
        self.events, self.tally, self.pid, self.log_path = [], ferrus.UsageTally(), 1, "x.log"
        self.said, self.last_text = ferrus.LastWords(), ""
        for line in lines.strip().splitlines():
            for event in adapter.parse_line(line):
                self.events.append(event)
                self.tally.add(event)
                self.said.add(event)

    def exited(self):
        return False


def shown(project, cli):
    """What HQ and `ferrus run` print for the recorded output of ``cli``."""
    return shown_for(project, *ADAPTERS[cli])


def shown_for(project, adapter, lines):
    """What HQ and `ferrus run` print for ``lines`` of an ``adapter`` class's agent."""
    messages = []
    controller = ferrus.HqController(ferrus.Store(str(project)), messages.append,
                                     clock=lambda: 0.0)
    slot = controller.slots["executor"]
    slot.session = dataclasses.replace(slot.session, state=ferrus.SS.RUNNING)
    slot.process = RecordedAgent(adapter(ferrus.Config()), lines)
    controller._show_tool_calls(slot)
    slot.process = None
    return messages


EXPECTED = {
    "claude": [
        "executor ▸ Read  /work/p/missing.txt",
        "executor ✗ Read failed: File does not exist. Note: your current working directory "
        "is /work/p.",
        "executor ▸ Shell  cat nothere.txt",
        "executor ✗ Shell failed: Exit code 1 cat: nothere.txt: No such file or directory",
        "executor ▸ Write  /work/p/w.txt",
        "executor ✗ Write denied: Error: No such tool available: Write. Write exists but is "
        "not enabled in this context. Use one of the available tools instead.",
        "executor ▸ Edit  /work/p/ferrus.toml",
        "executor ✗ Edit denied: Error: No such tool available: Edit. Edit exists but is not "
        "enabled in this context. Use one of the available tools instead.",
        "executor ▸ Shell  ls /nonexistent-dir-xyz",
        "executor ✗ Shell denied: ls in '/nonexistent-dir-xyz' was blocked. For security, "
        "Claude Code may only list files in the allowed working directories for this "
        "session: '/work/p'.",
        "executor ▸ ferrus submit  x",
        "executor ✗ ferrus submit failed: Cannot submit from state Idle. Submit is only valid "
        "from Executing or Addressing after the implementation is ready."],
    "codex": [
        "executor ▸ Shell  cat missing.txt",
        "executor ✗ Shell failed: exit 1: cat: missing.txt: No such file or directory",
        "executor ▸ Shell  ls /nonexistent-dir-xyz",
        "executor ✗ Shell failed: exit 2: ls: cannot access '/nonexistent-dir-xyz': No such "
        "file or directory",
        "executor ▸ Shell  printf x > w.txt",
        "executor ▸ Edit  /work/p/new.txt",
        "executor ▸ ferrus submit  x",
        "executor ✗ ferrus submit failed: Cannot submit from state Idle. Submit is only valid "
        "from Executing or Addressing after the implementation is ready."],
    "qwen": [
        "executor ▸ Read  /work/p/missing.txt",
        "executor ✗ Read failed: File not found: /work/p/missing.txt",
        "executor ▸ Shell  ls /nonexistent-dir-xyz",
        "executor ✗ Shell denied: Qwen Code requires permission to use \"run_shell_command\", "
        "but that permission was declined. Matching deny rule: \"run_shell_command\".",
        "executor ▸ Write  printf x > w.txt",
        "executor ✗ Write denied: Qwen Code requires permission to use \"write_file\", but "
        "that permission was declined. Matching deny rule: \"edit\".",
        "executor ▸ ferrus submit  x",
        "executor ✗ ferrus submit failed: Cannot submit from state Idle. Submit is only valid "
        "from Executing or Addressing after the implementation is ready."],
    "gemini": [
        "executor ▸ Read  /work/p/missing.txt",
        "executor ✗ Read failed: File not found: /work/p/missing.txt",
        "executor ▸ Shell  ls /nonexistent-dir-xyz",
        "executor ✗ Shell failed: Tool \"run_shell_command\" not found. Did you mean one of: "
        "\"update_topic\", \"grep_search\", \"replace\"?",
        "executor ▸ Write  /work/p/w.txt",
        "executor ▸ Edit  /work/p/ferrus.toml",
        "executor ✗ Edit failed: params must have required property 'instruction'",
        "executor ▸ ferrus submit  x",
        "executor ✗ ferrus submit failed: Cannot submit from state Idle. Submit is only valid "
        "from Executing or Addressing after the implementation is ready."],
}


@pytest.mark.parametrize("cli", sorted(ADAPTERS))
def test_each_failed_or_denied_tool_call_prints_as_such_with_its_reason(project, cli):
    messages = shown(project, cli)
    assert [m.text for m in messages if m.event in ("tool_call", "tool_failed")] == \
        EXPECTED[cli]
    failed = [m for m in messages if m.event == "tool_failed"]
    assert all(m.kind == "agent" and m.data["reason"] for m in failed)
    # --json carries the failure as facts: the tool, what it was called with, why, and
    # whether the agent was not allowed it.
    submit = [m.data for m in failed if m.data["tool"] == "ferrus submit"]
    assert submit == [{"slot": "executor", "tool": "ferrus submit", "input": "x",
                       "reason": "Cannot submit from state Idle. Submit is only valid from "
                                 "Executing or Addressing after the implementation is ready.",
                       "denied": False}]
    assert any(m.data["denied"] for m in failed) == (cli in ("claude", "qwen"))


def test_opencode_refusing_a_call_its_permissions_deny_is_shown_as_denied(project):
    # opencode's `run --format json` event for an edit outside its project folder (what
    # it did to every edit while $PWD named another folder than its working directory).
    refused = json.dumps({"type": "tool_use", "sessionID": "ses_1", "part": {
        "tool": "write", "callID": "c1", "state": {
            "status": "error", "input": {"filePath": "/work/p/a.txt", "content": "x"},
            "error": "The user rejected permission to use this specific tool call."}}})
    messages = shown_for(project, ferrus.OpencodeAdapter, refused)
    assert [m.text for m in messages] == [
        "executor ▸ Write  /work/p/a.txt",
        "executor ✗ Write denied: The user rejected permission to use this specific tool "
        "call."]
    assert messages[1].data["denied"] is True


def test_a_tool_looks_the_same_whichever_cli_called_it(project):
    names = {cli: {m.data["tool"] for m in shown(project, cli) if m.event == "tool_call"}
             for cli in ADAPTERS}
    assert names["claude"] >= {"Read", "Shell", "Write", "Edit", "ferrus submit"}
    assert names["gemini"] >= {"Read", "Shell", "Write", "Edit", "ferrus submit"}
    assert names["qwen"] >= {"Read", "Shell", "Write", "ferrus submit"}
    assert names["codex"] == {"Shell", "Edit", "ferrus submit"}
    # Another MCP server's tool is server/tool, from every CLI's spelling of it.
    assert {ferrus.tool_display_name(name) for name in (
        "mcp__github__search", "mcp_github_search", "github/search")} == {"github/search"}


@pytest.mark.parametrize("cli", sorted(ADAPTERS))
def test_the_last_message_of_each_cli_is_its_last_words(cli):
    adapter, lines = ADAPTERS[cli]
    agent = RecordedAgent(adapter(ferrus.Config()), lines)
    assert agent.said.text.strip() == "I give up: the build is broken and I cannot fix it."


def test_gemini_streams_a_message_in_pieces_and_they_make_one():
    pieces = ['{"type":"message","role":"assistant","content":"I stop: ","delta":true}',
              '{"type":"message","role":"assistant","content":"no database.","delta":true}']
    agent = RecordedAgent(ferrus.GeminiCli(ferrus.Config()), "\n".join(
        GEMINI.strip().splitlines()[:2] + pieces))
    assert agent.said.text == "I stop: no database."


def test_an_executor_that_gives_up_shows_its_failed_call_last_words_and_exit(
        project, tmp_path, monkeypatch):
    from conftest import scripted_project
    store = scripted_project(project, tmp_path / "memory")
    monkeypatch.setenv("SCRIPTED_DIR", str(tmp_path / "memory"))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "give-up-once")
    lines = []
    code = ferrus.run_loop(store, "Make work.txt", out=lines.append, timeout=90)
    text = "\n".join(lines)
    assert code == ferrus.RUN_COMPLETE, text
    assert "executor ▸ Shell  make test" in text
    assert "  executor ✗ Shell failed: Exit code 2 make: *** No rule to make target 'test'. " \
           "Stop." in text
    assert "the executor exited (exit 0) without calling submit or consult; restarting it\n" \
           "  its last words: I cannot finish this: the project has no test target, so I " \
           "stop here." in text
    record = next(r for r in ferrus.read_session_records(store) if r["outcome"] == "no progress")
    assert record["note"].startswith("its last words: I cannot finish this")


def test_paths_are_shown_relative_to_the_folder_the_agent_works_in(project, tmp_path):
    """A parallel task's agent works in its worktree: a path there is shown short, and
    one into the project's own checkout is shown as the agent gave it."""
    worktree = tmp_path / "wt"
    main_file, own_file = str(project / "calc.py"), str(worktree / "own.py")
    lines = "\n".join(json.dumps(event) for event in (
        {"type": "assistant", "message": {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "Write",
             "input": {"file_path": main_file, "content": "x"}},
            {"type": "tool_use", "id": "t2", "name": "Write",
             "input": {"file_path": own_file, "content": "x"}}]}},
        {"type": "user", "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
             "content": "%s is outside the working folder %s" % (main_file, worktree)}]}}))
    messages = []
    controller = ferrus.HqController(ferrus.Store(str(project)), messages.append,
                                     clock=lambda: 0.0)
    controller.store._workdir = str(worktree)       # as a parallel task's store has it
    slot = controller.slots["executor"]
    slot.process = RecordedAgent(ferrus.ClaudeCode(ferrus.Config()), lines)
    controller._show_tool_calls(slot)
    assert [m.text for m in messages] == [
        "executor ▸ Write  %s" % main_file, "executor ▸ Write  own.py",
        "executor ✗ Write failed: %s is outside the working folder %s" % (main_file,
                                                                          worktree)]
