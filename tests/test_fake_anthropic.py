"""Self-test of tests/fake_anthropic.py: the wire format on its own, then the real
Claude Code CLI (`claude -p`) driven offline through a stdio MCP tool."""

import json
import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_anthropic import (  # noqa: E402
    FakeAnthropic, ScriptedAgent, claude_env, find_claude, last_tool_results, text, tool_use,
)


def _post(fake, path, body):
    request = urllib.request.Request(fake.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers.get("Content-Type"), response.read().decode()


def _sse_events(payload):
    events = []
    for chunk in payload.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append(data)
    return events


MCP_TOOLS = [{"name": "mcp__demo__echo", "input_schema": {"type": "object"}}]


def test_streaming_shapes_side_requests_and_endpoints():
    agent = ScriptedAgent([
        [text("calling"), tool_use("mcp__demo__echo", {"text": "hi"}, id="toolu_1")],
        lambda request, results: text("saw " + results[0]["content"]),
    ])
    with FakeAnthropic(agent) as fake:
        # A side request (no tools, structured output): answered, script untouched.
        schema = {"type": "object", "properties": {"title": {"type": "string"}},
                  "required": ["title"]}
        _, body = _post(fake, "/v1/messages", {
            "messages": [{"role": "user", "content": "title?"}], "max_tokens": 50,
            "output_config": {"format": {"type": "json_schema", "schema": schema}}})
        side = json.loads(body)
        assert side["stop_reason"] == "end_turn"
        assert set(json.loads(side["content"][0]["text"])) == {"title"}
        assert agent.index == 0

        # Main turn 1, streamed: text + tool_use.
        first = {"stream": True, "tools": MCP_TOOLS, "model": "m",
                 "messages": [{"role": "user", "content": "go"}]}
        content_type, payload = _post(fake, "/v1/messages?beta=true", first)
        assert content_type.startswith("text/event-stream")
        events = _sse_events(payload)
        kinds = [e["type"] for e in events if e["type"] != "ping"]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        assert events[0]["message"]["content"] == [] and events[0]["message"]["model"] == "m"
        starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
        assert starts[0] == {"type": "text", "text": ""}
        assert starts[1] == {"type": "tool_use", "id": "toolu_1", "name": "mcp__demo__echo",
                             "input": {}}
        partial = "".join(e["delta"]["partial_json"] for e in events
                          if e["type"] == "content_block_delta" and e["index"] == 1)
        assert all(e["delta"]["type"] == "input_json_delta" for e in events
                   if e["type"] == "content_block_delta" and e["index"] == 1)
        assert json.loads(partial) == {"text": "hi"}
        delta = [e for e in events if e["type"] == "message_delta"][0]
        assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] > 0

        # Main turn 2, not streamed: the step sees the tool result.
        second = {"tools": MCP_TOOLS, "messages": first["messages"] + [
            {"role": "assistant", "content": [tool_use("mcp__demo__echo", {}, id="toolu_1")]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "echo: hi"}]}]}]}
        message = json.loads(_post(fake, "/v1/messages", second)[1])
        assert message["content"] == [text("saw echo: hi")] and message["stop_reason"] == "end_turn"
        assert last_tool_results(second) == [
            {"tool_use_id": "toolu_1", "content": "echo: hi", "is_error": False}]

        # Past the script: the final text turn.
        assert json.loads(_post(fake, "/v1/messages", second)[1])["content"] == [text("done")]

        assert json.loads(_post(fake, "/v1/messages/count_tokens", first)[1])["input_tokens"] > 0
        _post(fake, "/v1/something/else", {})
        assert fake.unknown == [("POST", "/v1/something/else")]
        assert len(fake.requests) == 4 and len(fake.main_requests) == 3
        assert len(fake.side_requests) == 1 and not fake.errors


MCP_SERVER = textwrap.dedent('''
    import json, sys

    def reply(msg_id, result):
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id, "result": result}) + "\\n")
        sys.stdout.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        method, msg_id = msg.get("method"), msg.get("id")
        if msg_id is None:  # a notification
            continue
        if method == "initialize":
            reply(msg_id, {"protocolVersion": msg["params"]["protocolVersion"],
                           "capabilities": {"tools": {}},
                           "serverInfo": {"name": "demo", "version": "0.1"}})
        elif method == "tools/list":
            reply(msg_id, {"tools": [{
                "name": "echo", "description": "Echo the text back.",
                "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}},
                                "required": ["text"]}}]})
        elif method == "tools/call":
            said = msg["params"].get("arguments", {}).get("text", "")
            reply(msg_id, {"content": [{"type": "text", "text": "echo: " + said}]})
        elif method == "ping":
            reply(msg_id, {})
        else:
            sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id, "error": {
                "code": -32601, "message": "method not found: %s" % method}}) + "\\n")
            sys.stdout.flush()
''')


@pytest.mark.e2e
def test_real_claude_cli_calls_mcp_tool_through_fake(tmp_path):
    claude = find_claude()
    if claude is None:
        pytest.skip("Claude Code CLI `claude` not found on PATH, in $FERRUS_AGENT_BIN or in "
                    "~/.cache/ferrus-ci/agents (npm install @anthropic-ai/claude-code)")
    server = tmp_path / "demo_mcp.py"
    server.write_text(MCP_SERVER)
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"demo": {
        "type": "stdio", "command": sys.executable, "args": [str(server)]}}}))
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()

    agent = ScriptedAgent([tool_use("mcp__demo__echo", {"text": "hi"}), text("done")])
    with FakeAnthropic(agent) as fake:
        try:
            result = subprocess.run(
                [claude, "-p", "use the echo tool", "--mcp-config=%s" % config,
                 "--strict-mcp-config", "--allowedTools", "mcp__demo__*",
                 "--output-format", "stream-json", "--verbose"],
                cwd=str(work), env=claude_env(fake, home), stdin=subprocess.DEVNULL,
                capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired as exc:
            pytest.fail("claude did not finish in 90 s\n%s\nstdout:\n%s\nstderr:\n%s"
                        % (fake.describe(), exc.stdout, exc.stderr))
        traffic = "%s\nstdout:\n%s\nstderr:\n%s" % (fake.describe(), result.stdout, result.stderr)

        assert result.returncode == 0, traffic
        assert not fake.errors, traffic
        assert agent.finished, traffic
        assert len(fake.main_requests) == 2, traffic
        first, second = fake.main_requests
        assert "mcp__demo__echo" in [t["name"] for t in first["tools"]]
        assert last_tool_results(first) == []
        results = last_tool_results(second)
        assert len(results) == 1 and "echo: hi" in results[0]["content"], traffic
        assert results[0]["is_error"] is False
        # The side requests the CLI made (if any) did not count as turns.
        assert all(not fake.is_main(r) for r in fake.side_requests)

    events = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    calls = [block for event in events if event.get("type") == "assistant"
             for block in event["message"]["content"] if block.get("type") == "tool_use"]
    assert [(c["name"], c["input"]) for c in calls] == [("mcp__demo__echo", {"text": "hi"})]
    tool_results = [block for event in events if event.get("type") == "user"
                    for block in event["message"]["content"]
                    if isinstance(block, dict) and block.get("type") == "tool_result"]
    assert tool_results and tool_results[0]["tool_use_id"] == calls[0]["id"]
    assert "echo: hi" in json.dumps(tool_results[0]["content"])
    final = events[-1]
    assert final["type"] == "result" and final["is_error"] is False and final["result"] == "done"
