"""The nano, opencode and goose adapters: what register writes, how each is launched
for a role, and how its output is read.  goose has no package to install here: its
launch is checked against its documented `goose run` flags and its output against the
stream-json events its CLI source defines (StreamEvent: message, notification, error,
complete), not against a real goose."""

import json
import os
import shlex
import sys

import pytest

import ferrus
from conftest import set_config



@pytest.fixture
def config(project):
    return ferrus.load_config(str(project))


def register(adapter, project, role):
    messages = []
    with ferrus.FileChanges():
        adapter.register(str(project), role, "", messages.append)
    return messages


# -- nano ----------------------------------------------------------------------------------

def test_nano_starts_this_ferrus_with_the_roles_server_file(config, project):
    adapter = ferrus.NanoAdapter(config)
    assert register(adapter, project, "executor") == [
        "Registered ferrus-executor-1 in .ferrus/nano-mcp-executor.json (agent id "
        "executor:nano:1)"]
    entry = adapter.registration(str(project), "executor")
    assert ferrus.entry_points_here(entry, str(project))
    launch = adapter.headless(str(project), "executor", "PROMPT", "qwen2.5-coder:7b")
    assert launch.stdin == "PROMPT"
    boot = ferrus.ferrus_boot_argv()
    assert launch.argv[:len(boot)] == boot
    assert launch.argv[len(boot):] == ["-C", str(project), "nano", "--role", "executor", "--mcp-config",
                               adapter.mcp_config_path(str(project), "executor"),
                               "--model", "qwen2.5-coder:7b", "--permissions", "edit"]
    reviewer = adapter.headless(str(project), "supervisor", "P")
    assert reviewer.argv[-2:] == ["--permissions", "read-only"]
    assert adapter.executable() == os.path.abspath(sys.executable)
    adapter.unregister(str(project), "executor", lambda message: None)
    assert adapter.registration(str(project), "executor") is None


def test_a_nano_pipeline_worker_has_no_ferrus_server_and_one_output(config, project):
    launch = ferrus.NanoAdapter(config).worker(str(project), "P", "", "/o/out.md",
                                               ["/i/a.md"])
    assert "--mcp-config" not in launch.argv and "--role" not in launch.argv
    assert launch.argv[-4:] == ["--worker-output", "/o/out.md", "--read", "/i/a.md"]


# -- opencode ------------------------------------------------------------------------------

def test_opencode_registers_both_roles_in_opencode_json(config, project):
    adapter = ferrus.OpencodeAdapter(config)
    (project / "opencode.json").write_text(json.dumps({"provider": {"local": {}}}))
    register(adapter, project, "supervisor")
    register(adapter, project, "executor")
    register(adapter, project, "executor")          # idempotent
    data = json.loads((project / "opencode.json").read_text())
    assert data["provider"] == {"local": {}}        # the user's settings stay
    assert sorted(data["mcp"]) == ["ferrus-executor-1", "ferrus-supervisor-1"]
    entry = data["mcp"]["ferrus-executor-1"]
    assert entry["type"] == "local" and entry["enabled"] is True
    assert entry["command"][-6:] == ["--role", "executor", "--agent-name", "opencode",
                                     "--agent-index", "1"]
    assert ferrus.entry_points_here(adapter.registration(str(project), "executor"),
                                    str(project))
    assert "opencode.json" in (project / ".gitignore").read_text().split("\n")
    with ferrus.FileChanges():
        adapter.unregister(str(project), "executor", lambda message: None)
        adapter.unregister(str(project), "supervisor", lambda message: None)
    assert json.loads((project / "opencode.json").read_text()) == {"provider": {"local": {}}}


def test_an_opencode_launch_carries_only_its_roles_server_and_permissions(config, project):
    adapter = ferrus.OpencodeAdapter(config)
    launch = adapter.headless(str(project), "supervisor", "PROMPT", "local/coder")
    assert launch.argv == ["opencode", "run", "--format", "json", "--model", "local/coder"]
    assert launch.stdin == "PROMPT"
    content = json.loads(launch.env["OPENCODE_CONFIG_CONTENT"])
    assert content["mcp"]["ferrus-supervisor-1"]["enabled"] is True
    assert content["mcp"]["ferrus-executor-1"]["enabled"] is False
    assert content["permission"] == {"edit": "deny", "bash": "deny"}
    executor = json.loads(adapter.headless(str(project), "executor", "P").env[
        "OPENCODE_CONFIG_CONTENT"])
    assert executor["permission"] == {"edit": "allow", "bash": "deny"}
    assert adapter.can_edit("edit") and not adapter.can_edit("read-only")


def opencode_events(adapter, *events):
    found = []
    for event in events:
        found += adapter.parse_line(json.dumps(event))
    return found


def test_opencode_events_give_tool_calls_usage_and_words(config):
    adapter = ferrus.OpencodeAdapter(config)
    events = opencode_events(
        adapter,
        {"type": "step_start", "sessionID": "ses_1", "part": {"type": "step-start"}},
        {"type": "tool_use", "sessionID": "ses_1", "part": {
            "tool": "ferrus-executor-1_check", "callID": "c1",
            "state": {"status": "completed", "input": {}}}},
        {"type": "tool_use", "sessionID": "ses_1", "part": {
            "tool": "write", "callID": "c2", "state": {
                "status": "error", "input": {"filePath": "/p/a.txt", "content": "x"},
                "error": "The user rejected permission to use this specific tool call."}}},
        {"type": "step_finish", "sessionID": "ses_1", "part": {
            "messageID": "m1", "tokens": {"input": 100, "output": 20, "reasoning": 5,
                                          "cache": {"read": 50, "write": 0}}}},
        {"type": "text", "sessionID": "ses_1", "part": {"text": "Done."}})
    kinds = [(e.kind, e.name, e.ok, e.text) for e in events]
    assert kinds[0] == ("session", "", None, "ses_1")
    assert kinds[1] == ("tool_call", "mcp__ferrus-executor-1__check", True, "")
    assert kinds[3] == ("tool_call", "Write", False, "/p/a.txt")
    assert kinds[4] == ("tool_result", "Write", False,
                        "The user rejected permission to use this specific tool call.")
    usage = events[5]
    assert (usage.kind, usage.input_tokens, usage.output_tokens) == ("usage", 150, 25)
    assert kinds[-1] == ("said", "", None, "Done.")
    assert ferrus.tool_display_name(events[1].name) == "ferrus check"
    assert adapter.parse_line("not json") == []


# -- goose ---------------------------------------------------------------------------------

def test_goose_is_launched_with_its_documented_run_flags(config, project):
    adapter = ferrus.GooseAdapter(config)
    register(adapter, project, "executor")
    launch = adapter.headless(str(project), "executor", "PROMPT", "qwen3-coder")
    argv = launch.argv
    assert argv[:2] == ["goose", "run"] and launch.stdin == "PROMPT"
    # `goose run`'s documented options: -i/--instructions - reads stdin, --no-session,
    # --output-format stream-json, --max-turns, --max-tool-repetitions, --model,
    # --with-extension "COMMAND".
    assert argv[-2:] == ["--instructions", "-"]
    for flag, value in (("--output-format", "stream-json"), ("--model", "qwen3-coder"),
                        ("--max-turns", "200"), ("--max-tool-repetitions", "25")):
        assert argv[argv.index(flag) + 1] == value
    assert "--no-session" in argv and launch.env["GOOSE_MODE"] == "auto"
    extension = argv[argv.index("--with-extension") + 1]
    name, _, command = extension.partition(":")
    entry = adapter.registration(str(project), "executor")
    assert name == "ferrus-executor-1"
    assert shlex.split(command) == [entry["command"]] + entry["args"]   # goose splits it so
    interactive = adapter.interactive(str(project), "supervisor", "plan with me")
    assert interactive.argv[:3] == ["goose", "run", "--interactive"]
    assert interactive.argv[-2:] == ["--text", "plan with me"]
    assert "GOOSE_MODE" not in interactive.env
    assert adapter.interactive(str(project), "supervisor").argv[:2] == ["goose", "session"]


def test_goose_stream_events_give_tool_calls_usage_and_errors(config):
    adapter = ferrus.GooseAdapter(config)
    lines = [
        {"type": "message", "message": {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "toolRequest", "id": "t1", "toolCall": {"status": "success", "value": {
                "name": "ferrus-executor-1__check", "arguments": {}}}},
            {"type": "toolRequest", "id": "t2", "toolCall": {"status": "success", "value": {
                "name": "developer__shell", "arguments": {"command": "ls"}}}}]}},
        {"type": "message", "message": {"role": "user", "content": [
            {"type": "toolResponse", "id": "t1", "toolResult": {"status": "success",
                                                                "value": {"content": []}}},
            {"type": "toolResponse", "id": "t2", "toolResult": {"status": "error",
                                                                "error": "denied by policy"}}]}},
        {"type": "notification", "extension_id": "x", "log": {"message": "hi"}},
        {"type": "complete", "total_tokens": 130, "input_tokens": 100, "output_tokens": 30},
        {"type": "error", "error": "provider unreachable"},
    ]
    events = []
    for line in lines:
        events += adapter.parse_line(json.dumps(line))
    kinds = [(e.kind, e.name, e.ok, e.text) for e in events]
    assert kinds[:3] == [("said", "", None, "Checking."),
                         ("tool_call", "mcp__ferrus-executor-1__check", None, ""),
                         ("tool_call", "Bash", None, "ls")]
    assert kinds[3] == ("tool_result", "", True, "")
    assert kinds[4] == ("tool_result", "", False, "denied by policy")
    assert (events[5].kind, events[5].input_tokens, events[5].output_tokens,
            events[5].total) == ("usage", 100, 30, True)
    assert kinds[6] == ("said", "", None, "provider unreachable")


def test_goose_cannot_be_held_to_read_only_and_a_goose_reviewer_is_warned_of(project):
    assert ferrus.GooseAdapter(ferrus.load_config(str(project))).can_edit("read-only") is True
    set_config(project, '[hq.supervisor]\nagent = "goose"\n\n[hq.executor]\nagent = "goose"\n')
    config = ferrus.load_config(str(project))
    [(warning, hint)] = ferrus.permission_warnings(config, "supervisor")
    assert warning == ('the supervisor (goose) can edit files although its permissions are '
                       '"read-only": goose cannot be held to reading')
    assert "ferrus register --supervisor AGENT" in hint
    assert ferrus.permission_warnings(config, "executor") == []
