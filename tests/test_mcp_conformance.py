"""MCP conformance across protocol eras (issue #12) and hostile-client limits (issue #11).

Every message these tests receive is validated by ``mcp_client`` against the
official JSON Schema of the version in force (``tests/mcp_schemas``), strictly:
a field the version does not define is a failure.  Each test here pins one
rule of one version; test_mcp_server.py covers the ferrus tools themselves.
"""

import base64
import errno
import json
import os
import threading

import pytest

import ferrus
import mcp_schema
from conftest import set_config
from mcp_client import (META_VERSION, McpProcess, InProcessMcp, modern_meta, tool_json,
                        tool_text)

ALL_VERSIONS = list(ferrus.MCP_ALL_VERSIONS)
LEGACY = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")


def config(root, wait=1, commands=(), extra=""):
    set_config(root, """\
[checks]
commands = %s

[limits]
wait_timeout_secs = %d
%s""" % (json.dumps(list(commands)), wait, extra))


@pytest.fixture
def root(project):
    config(project)
    return project


@pytest.fixture
def serve(root):
    """serve(role=None, version="2025-11-25" or None for no initialize) -> McpProcess."""
    started = []

    def start(role=None, version="2025-11-25"):
        args = ["--agent-name", "conf", "--agent-index", "1"]
        if role:
            args = ["--role", role] + args
        server = McpProcess(root, *args)
        started.append(server)
        if version:
            server.initialize(version)
        return server
    yield start
    for server in started:
        assert server.close() == 0, server.stderr_text()
        assert not server.bad_lines, server.bad_lines
        assert "Traceback" not in server.stderr_text(), server.stderr_text()
        server.assert_schema_valid()


def error_of(response):
    assert "error" in response and "result" not in response, response
    return response["error"]


# ============================================================================
# 8. The validator itself, and every era's full flow validated
# ============================================================================

def test_vendored_schemas_are_the_official_ones():
    for version in ALL_VERSIONS:
        schema = mcp_schema.load(version)
        assert "JSONRPCMessage" in mcp_schema.definitions(version), version
        assert "CallToolResult" in mcp_schema.definitions(version), version
    assert "DiscoverResult" in mcp_schema.definitions("2026-07-28")
    assert "title" not in mcp_schema.definitions("2024-11-05")["Tool"]["properties"]
    assert mcp_schema.load("2026-07-28")["$schema"].endswith("draft/2020-12/schema")
    assert schema["$schema"].startswith("http://json-schema.org/draft-07")


def test_the_validator_catches_what_each_version_does_not_define():
    """Not vacuous: the faults issue #12 found are caught by the suite's validator."""
    tool = {"name": "t", "title": "T", "inputSchema": {"type": "object"}}
    listing = {"jsonrpc": "2.0", "id": 1, "result": {"tools": [tool]}}
    assert mcp_schema.message_errors("2025-06-18", listing, "tools/list") == []
    assert any("title" in p for p in mcp_schema.message_errors("2024-11-05", listing,
                                                               "tools/list"))
    progress = {"jsonrpc": "2.0", "method": "notifications/progress",
                "params": {"progressToken": 1, "progress": 1, "message": "m"}}
    assert mcp_schema.message_errors("2025-03-26", progress) == []
    assert mcp_schema.message_errors("2024-11-05", progress)
    null_id = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "x"}}
    assert mcp_schema.message_errors("2025-11-25", null_id)
    no_id = {"jsonrpc": "2.0", "error": {"code": -32700, "message": "x"}}
    assert mcp_schema.message_errors("2025-11-25", no_id) == []
    modern = {"jsonrpc": "2.0", "id": 2, "result": {"tools": []}}
    assert mcp_schema.message_errors("2026-07-28", modern, "tools/list")   # no resultType
    modern["result"].update(resultType="complete", ttlMs=0, cacheScope="private")
    assert mcp_schema.message_errors("2026-07-28", modern, "tools/list") == []
    # structuredContent must fit the declared outputSchema.
    schema = ferrus.TOOLS_BY_NAME["status"].output_schema()
    assert mcp_schema.structured_errors({"state": 3}, schema)
    assert mcp_schema.structured_errors({"state": "Idle", "rev": 1}, schema) == []


@pytest.mark.parametrize("version", LEGACY + ("2026-07-28",))
def test_full_task_flow_is_schema_valid_in_every_version(serve, root, version):
    """Supervisor and executor through one whole task, every list, read and
    prompt, with progress notifications: the client validates each message."""
    config(root, wait=5)
    modern = version == "2026-07-28"
    meta = modern_meta() if modern else None

    def params(extra=None):
        value = dict(extra or {})
        if modern:
            value["_meta"] = dict(modern_meta(), **value.get("_meta", {}))
        return value
    sup = serve("supervisor", None if modern else version)
    exe = serve("executor", None if modern else version)
    for server in (sup, exe):
        tools = server.result("tools/list", params())["tools"]
        for tool in tools:
            assert ("title" in tool) == (modern or version >= "2025-06-18")
            assert ("annotations" in tool) == (modern or version >= "2025-03-26")
            assert ("outputSchema" in tool) == (modern or version >= "2025-06-18")
        server.result("resources/list", params())
        server.result("resources/templates/list", params())
        server.result("prompts/list", params())
    waiting = exe.start_tool("wait_for_task", meta=dict(meta or {}, progressToken="p1"))
    created = sup.call_tool("create_task", {"description": "Schema flow."}, meta=meta)
    assert created["isError"] is False
    claimed = exe.wait_response(waiting)["result"]
    assert tool_json(claimed)["status"] == "claimed"
    for uri in ("ferrus://task", "ferrus://state", "ferrus://events", "ferrus://spec_template"):
        assert exe.result("resources/read", params({"uri": uri}))["contents"]
    assert exe.result("prompts/get", params({"name": "executor-context"}))["messages"]
    assert exe.call_tool("heartbeat", meta=meta)["isError"] is False
    assert exe.call_tool("check", meta=meta)["isError"] is False
    assert exe.call_tool("submit", {"content": "Done."}, meta=meta)["isError"] is False
    review = sup.call_tool("wait_for_review", meta=meta)
    assert tool_json(review)["status"] == "claimed"
    assert sup.call_tool("approve", meta=meta)["isError"] is False
    status = sup.call_tool("status", meta=meta)
    if modern or version >= "2025-06-18":
        assert status["structuredContent"]["state"] == "Complete"
    else:
        assert "structuredContent" not in status
    for server in (sup, exe):
        assert server.validated > 5
        server.assert_schema_valid()


# ============================================================================
# 1. Batches: accepted in 2025-03-26 only
# ============================================================================

def test_batches_are_accepted_under_2025_03_26(serve, root):
    server = serve("supervisor", "2025-03-26")
    server.send([{"jsonrpc": "2.0", "id": "b1", "method": "ping"},
                 {"jsonrpc": "2.0", "method": "notifications/initialized"},
                 {"jsonrpc": "2.0", "id": "b2", "method": "tools/call",
                  "params": {"name": "create_task", "arguments": {"description": "batched"}}},
                 {"jsonrpc": "2.0", "id": "b3", "method": "no/such"},
                 7])
    assert server.wait_response("b1")["result"] == {}
    assert server.wait_response("b2")["result"]["isError"] is False
    assert error_of(server.wait_response("b3"))["code"] == -32601
    assert error_of(server.wait_response(None))["code"] == -32600   # the 7
    assert len(server.batches) == 1 and len(server.batches[0]) == 4
    assert ferrus.Store(str(root)).read_state().state == ferrus.S.EXECUTING
    # A batch of notifications gets no reply at all; the next ping is answered first.
    server.send([{"jsonrpc": "2.0", "method": "notifications/initialized"},
                 {"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": "gone"}}])
    assert server.result("ping", id="after") == {}
    assert len(server.batches) == 1
    # An empty array is an invalid request (2025-03-26 errors carry "id": null).
    server.send([])
    response = server.wait_response(None)
    assert error_of(response)["code"] == -32600 and response["id"] is None
    # initialize must not be part of a batch.
    server.send([{"jsonrpc": "2.0", "id": "i", "method": "initialize",
                  "params": {"protocolVersion": "2025-03-26", "capabilities": {},
                             "clientInfo": {"name": "x", "version": "1"}}}])
    assert error_of(server.wait_response("i"))["code"] == -32600


@pytest.mark.parametrize("version", ["2024-11-05", "2025-06-18", "2025-11-25"])
def test_batches_are_refused_outside_2025_03_26(serve, root, version):
    server = serve("supervisor", version)
    server.send([{"jsonrpc": "2.0", "id": "b1", "method": "ping"},
                 {"jsonrpc": "2.0", "id": "b2", "method": "tools/call",
                  "params": {"name": "create_task", "arguments": {"description": "b"}}}])
    error = error_of(server.wait_response(None))
    assert error["code"] == -32600 and version in error["message"]
    assert not server.has_response("b1") and not server.batches
    assert ferrus.Store(str(root)).read_state().state == ferrus.S.IDLE


# ============================================================================
# 2. 2026-07-28 rules
# ============================================================================

def test_discover_refuses_unknown_versions_with_32022_listing_every_version(serve):
    server = serve(version=None)
    supported = server.result("server/discover", {"_meta": modern_meta()})["supportedVersions"]
    assert supported == ALL_VERSIONS
    for method in ("server/discover", "tools/list"):
        error = error_of(server.request(method, {"_meta": modern_meta("v999.0.0")}))
        assert error["code"] == -32022
        assert error["data"] == {"supported": supported, "requested": "v999.0.0"}


def test_discover_needs_protocol_version_and_client_capabilities(serve):
    server = serve(version=None)
    for params in ({}, {"_meta": {}}, {"_meta": modern_meta(capabilities=False)},
                   {"_meta": {"io.modelcontextprotocol/clientCapabilities": {}}},
                   {"_meta": dict(modern_meta(), **{
                       "io.modelcontextprotocol/clientCapabilities": []})}):
        assert error_of(server.request("server/discover", params))["code"] == -32602, params


def test_methods_removed_in_2026_are_unknown_with_a_modern_meta(serve, root):
    server = serve(version=None)
    for method, params in (("ping", {}), ("logging/setLevel", {"level": "debug"}),
                           ("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                           "clientInfo": {"name": "x", "version": "1"}})):
        params = dict(params, _meta=modern_meta())
        assert error_of(server.request(method, params))["code"] == -32601, method
    # The modern initialize did not initialize anything for later legacy calls.
    error = error_of(server.request("tools/list"))
    assert error["code"] == -32600 and "initialize" in error["message"]
    # Legacy ping still works without _meta.
    assert server.result("ping") == {}


# ============================================================================
# 3. Tool errors are tool results from 2025-11-25 on
# ============================================================================

@pytest.mark.parametrize("version", LEGACY)
def test_invalid_tool_arguments_by_era(serve, version):
    server = serve("supervisor", version)
    for arguments, fragment in (({}, "missing required argument 'description'"),
                                ({"description": 5}, "must be a string"),
                                ({"description": "x", "extra": 1}, "unknown argument 'extra'")):
        response = server.request("tools/call", {"name": "create_task", "arguments": arguments})
        if version >= "2025-11-25":
            assert response["result"]["isError"] is True
            assert fragment in tool_text(response["result"])
        else:   # "Invalid arguments" are protocol errors before 2025-11-25
            assert error_of(response)["code"] == -32602
            assert fragment in error_of(response)["message"]
    # An unknown tool is a protocol error in every version.
    assert error_of(server.request("tools/call", {"name": "nope"}))["code"] == -32602


def test_invalid_tool_arguments_in_2026_are_tool_results(serve):
    server = serve("supervisor", None)
    result = server.call_tool("create_task", {"description": 1}, meta=modern_meta())
    assert result["isError"] is True and result["resultType"] == "complete"


def test_every_tool_failure_sets_is_error(serve):
    exe = serve("executor")
    for arguments, code in (({}, "not_claimed"), ({"agent_id": "executor:other:1"},
                                                  "foreign_id")):
        result = exe.call_tool("heartbeat", arguments)
        assert result["isError"] is True
        assert result["structuredContent"]["code"] == code


# ============================================================================
# 4. structuredContent is mirrored in a text block
# ============================================================================

def test_structured_content_is_mirrored_as_json_text(serve):
    sup = serve("supervisor", "2025-06-18")
    result = sup.call_tool("create_task", {"description": "Mirror me."})
    texts = [block["text"] for block in result["content"]]
    assert "Executing" in texts[0] and not texts[0].startswith("{")   # prose first
    assert json.loads(texts[-1]) == result["structuredContent"]
    status = sup.call_tool("status")
    assert any(json.loads(t) == status["structuredContent"]
               for t in (b["text"] for b in status["content"]) if t.startswith("{"))
    # Before 2025-06-18 there is no structuredContent and the prose stands alone.
    old = serve("supervisor", "2025-03-26")
    result = old.call_tool("status")
    assert "structuredContent" not in result and len(result["content"]) == 1


# ============================================================================
# 5. Ids and versions
# ============================================================================

@pytest.mark.parametrize("version,null_id", [("2024-11-05", True), ("2025-06-18", True),
                                             ("2025-11-25", False)])
def test_error_ids_follow_each_era(serve, version, null_id):
    server = serve(version=version)
    server.send(b"{not json\n")
    response = server.wait_response(None)
    assert error_of(response)["code"] == -32700
    assert ("id" in response) == null_id
    if null_id:
        assert response["id"] is None


def test_a_listed_resource_whose_file_is_missing_is_resource_not_found(serve, root):
    os.unlink(os.path.join(str(root), ".ferrus", "REVIEW.md"))
    server = serve()
    error = error_of(server.request("resources/read", {"uri": "ferrus://review"}))
    assert error["code"] == -32002 and "REVIEW.md" in error["message"]
    modern = error_of(server.request("resources/read", {"uri": "ferrus://review",
                                                        "_meta": modern_meta()}))
    assert modern["code"] == -32602


# ============================================================================
# 6. Logging that happens
# ============================================================================

def test_server_warnings_reach_the_client_at_or_above_its_level(serve, root):
    server = serve("executor")

    def warnings():
        return [n for n in server.notifications if n["method"] == "notifications/message"]
    server.result("logging/setLevel", {"level": "error"})
    config(root, extra="[mystery]\nkey = 1\n")
    server.call_tool("heartbeat")                        # reloads the config
    assert warnings() == []                              # a warning is below "error"
    server.result("logging/setLevel", {"level": "warning"})
    config(root, extra="[mystery]\nkey = 2\n")
    server.call_tool("heartbeat")
    message = server.wait_notification(lambda n: n["method"] == "notifications/message")
    assert message["params"]["level"] == "warning"
    assert "unknown key" in message["params"]["data"]
    assert message["params"]["logger"] == "ferrus"


def test_modern_requests_get_log_messages_only_at_their_own_level(serve, root):
    server = serve("executor", None)
    config(root, extra="[mystery]\nkey = 1\n")
    server.call_tool("heartbeat", meta=modern_meta())    # no logLevel: nothing
    assert not [n for n in server.notifications if n["method"] == "notifications/message"]
    config(root, extra="[mystery]\nkey = 2\n")
    server.call_tool("heartbeat", meta=dict(modern_meta(), **{
        "io.modelcontextprotocol/logLevel": "info"}))
    message = server.wait_notification(lambda n: n["method"] == "notifications/message")
    assert message["params"]["level"] == "warning"
    bad = dict(modern_meta(), **{"io.modelcontextprotocol/logLevel": "loud"})
    assert error_of(server.request("tools/list", {"_meta": bad}))["code"] == -32602


def test_a_slow_lock_wait_is_logged_to_the_client(project, monkeypatch):
    config(project)
    monkeypatch.setattr(ferrus.FileLock, "SLOW_WAIT", 0.05)
    store = ferrus.Store(str(project))
    with InProcessMcp(store, "supervisor") as server:
        server.initialize()
        server.result("logging/setLevel", {"level": "warning"})
        with store.lock():    # another holder: the tool's transaction must wait
            request_id = server.start_tool("create_task", {"description": "patient"})
            message = server.wait_notification(
                lambda n: n["method"] == "notifications/message")
        assert message["params"]["level"] == "warning"
        assert "for the lock on .ferrus/STATE.lock" in message["params"]["data"]
        assert server.wait_response(request_id)["result"]["isError"] is False


# ============================================================================
# 7. Fields a version does not define
# ============================================================================

def test_progress_message_is_left_out_in_2024_11_05(project, monkeypatch):
    config(project, wait=1)
    monkeypatch.setattr(ferrus._Waiter, "PROGRESS_EVERY", 0.05)
    store = ferrus.Store(str(project))
    for version, with_message in (("2024-11-05", False), ("2025-03-26", True)):
        with InProcessMcp(store, "executor") as server:
            server.initialize(version)
            server.call_tool("wait_for_task", meta={"progressToken": "t"})
            progress = [n["params"] for n in server.notifications
                        if n["method"] == "notifications/progress"]
            assert progress
            assert all(("message" in p) == with_message for p in progress)
            info = server.result("initialize", {"protocolVersion": version,
                                                "capabilities": {}})["serverInfo"]
            assert ("title" in info) == (version >= "2025-06-18")


# ============================================================================
# #11.3: bounded windows of check logs, binary as blobs
# ============================================================================

def _write_log(root, name, data):
    path = os.path.join(str(root), ".ferrus", "logs", name)
    with open(path, "wb") as handle:
        handle.write(data)
    return path


def test_a_huge_log_is_served_as_head_and_tail_with_what_was_left_out(serve, root):
    size = 3 * 1024 * 1024
    body = b"HEAD-MARK\n" + b"m" * (size - 20) + b"\nTAIL-MARK\n"
    _write_log(root, "big.log", body)
    server = serve()
    contents = server.result("resources/read", {"uri": "ferrus://logs/big.log"})["contents"]
    assert len(contents) == 1
    text = contents[0]["text"]
    assert text.startswith("HEAD-MARK") and text.endswith("TAIL-MARK\n")
    assert len(text) < ferrus.LOG_WINDOW_HEAD + ferrus.LOG_WINDOW_TAIL + 1000
    gap = len(body) - ferrus.LOG_WINDOW_HEAD - ferrus.LOG_WINDOW_TAIL
    assert "this log has %d bytes" % len(body) in text and "(%d bytes) are left out" % gap in text
    # The range template reads any part, at most LOG_READ_MAX bytes at a time.
    piece = server.result("resources/read", {
        "uri": "ferrus://logs/big.log?offset=0&length=9"})["contents"][0]["text"]
    assert piece.endswith("HEAD-MARK") and "bytes 0 to 9 of %d" % len(body) in piece
    whole = server.result("resources/read", {
        "uri": "ferrus://logs/big.log?offset=5&length=999999999"})["contents"][0]["text"]
    assert "bytes 5 to %d" % (5 + ferrus.LOG_READ_MAX) in whole
    error = error_of(server.request("resources/read", {
        "uri": "ferrus://logs/big.log?offset=x"}))
    assert error["code"] == -32002


def test_a_binary_log_is_sent_as_blobs(serve, root):
    data = b"\x00\x01binary\xff\xfe" * 100
    _write_log(root, "bin.log", data)
    big = b"\x00" * (ferrus.LOG_WINDOW_HEAD + ferrus.LOG_WINDOW_TAIL + 5000)
    _write_log(root, "nul.log", big)
    server = serve()
    contents = server.result("resources/read", {"uri": "ferrus://logs/bin.log"})["contents"]
    assert [c["mimeType"] for c in contents] == ["application/octet-stream"]
    assert base64.b64decode(contents[0]["blob"]) == data
    contents = server.result("resources/read", {"uri": "ferrus://logs/nul.log"})["contents"]
    assert "5000 bytes) are left out" in contents[0]["text"]
    blobs = [base64.b64decode(c["blob"]) for c in contents[1:]]
    assert [len(b) for b in blobs] == [ferrus.LOG_WINDOW_HEAD, ferrus.LOG_WINDOW_TAIL]


# ============================================================================
# #11.6: no symlink out of .ferrus/, disk errors as tool errors
# ============================================================================

@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("TOP-SECRET-CONTENT\n")
    return str(path)


@pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="POSIX symlinks")
def test_symlinks_out_of_ferrus_are_not_followed(serve, root, secret, tmp_path):
    ferrus_dir = os.path.join(str(root), ".ferrus")
    os.unlink(os.path.join(ferrus_dir, "TASK.md"))
    os.symlink(secret, os.path.join(ferrus_dir, "TASK.md"))
    os.symlink(secret, os.path.join(ferrus_dir, "logs", "leak.log"))
    os.mkfifo(os.path.join(ferrus_dir, "logs", "fifo.log"))
    server = serve()
    seen = []
    for uri in ("ferrus://task", "ferrus://logs/leak.log", "ferrus://logs/fifo.log"):
        response = server.request("resources/read", {"uri": uri})
        seen.append(json.dumps(response))
        assert error_of(response)["code"] == -32002, uri
    assert "symbolic link" in seen[0]
    prompt = server.result("prompts/get", {"name": "executor-context"})
    seen.append(json.dumps(prompt))
    assert not any("TOP-SECRET" in text for text in seen)
    # A logs directory that is itself a link out of .ferrus/ is refused too.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.log").write_text("TOP-SECRET-CONTENT")
    logs = os.path.join(ferrus_dir, "logs")
    os.rename(logs, logs + ".real")
    os.symlink(str(outside), logs)
    response = server.request("resources/read", {"uri": "ferrus://logs/x.log"})
    assert error_of(response)["code"] == -32002 and "TOP-SECRET" not in json.dumps(response)


@pytest.mark.parametrize("code,cause,hint", [
    (errno.ENOSPC, "No space left on device", "free some space"),
    (errno.EROFS, "Read-only file system", "read-only file system"),
    (errno.ENAMETOOLONG, "File name too long", "shorter name")])
def test_disk_full_read_only_and_name_too_long_are_tool_errors(project, monkeypatch, code,
                                                                cause, hint):
    config(project)
    store = ferrus.Store(str(project))
    before = store.read_state()

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code), os.path.join(store.path(), "TASK.md"))
    monkeypatch.setattr(ferrus, "atomic_write", refuse)
    with InProcessMcp(store, "supervisor") as server:
        server.initialize()
        result = server.call_tool("create_task", {"description": "no room"})
        assert result["isError"] is True
        text = tool_text(result)
        assert cause in text and "TASK.md" in text and "hint: " in text and hint in text
        assert server.result("ping") == {}
    after = store.read_state()
    assert (after.state, after.rev) == (before.state, before.rev)


# ============================================================================
# #11.4: bounded workers; blocking waits never starve quick requests
# ============================================================================

def _threads(pid):
    with open("/proc/%d/status" % pid) as handle:
        for line in handle:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return None


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="counts threads through /proc")
def test_a_thousand_pending_waits_leave_ping_and_quick_calls_answered(serve, root):
    config(root, wait=120)
    exe = serve("executor")
    total = 1000
    ids = [exe.start_tool("wait_for_task") for _ in range(total)]
    assert exe.result("ping", timeout=30) == {}
    assert exe.call_tool("status", timeout=30)["isError"] is False   # a quick call
    limit = ferrus.JsonRpcServer.MAX_BLOCKING
    refused = [exe.wait_response(i, timeout=60) for i in ids[limit:]]
    for response in refused:
        assert response["result"]["isError"] is True
        assert "too many calls in flight" in tool_text(response["result"])
    running = ids[:limit]
    early = [r for r in exe.all_responses if r.get("id") in running]
    assert not early, "an admitted wait ended early: %s" % json.dumps(early)[:2000]
    threads = _threads(exe.pid)
    assert threads is not None and threads <= limit + ferrus.JsonRpcServer.MAX_QUICK_WORKERS + 4
    # The admitted waits are real: a task wakes them and exactly one claims it.
    sup = serve("supervisor")
    sup.call_tool("create_task", {"description": "one for a thousand"})
    claimed = [exe.wait_response(running[0], timeout=30)]
    for request_id in running[1:]:
        exe.notify("notifications/cancelled", {"requestId": request_id})
    assert tool_json(claimed[0]["result"])["status"] == "claimed"
    assert exe.result("ping") == {}


def test_blocking_lane_full_keeps_quick_lane_free(project, monkeypatch):
    """In process, with a small lane: quick tool calls run while every
    blocking worker is taken, and a freed worker takes new blocking calls."""
    config(project, wait=60)
    monkeypatch.setattr(ferrus.JsonRpcServer, "MAX_BLOCKING", 2)
    store = ferrus.Store(str(project))
    with InProcessMcp(store, "executor") as server:
        server.initialize()
        first, second = server.start_tool("wait_for_task"), server.start_tool("wait_for_task")
        third = server.wait_response(server.start_tool("wait_for_consult"))
        assert third["result"]["isError"] is True
        for _ in range(20):
            assert server.call_tool("status")["isError"] is False
        server.notify("notifications/cancelled", {"requestId": first})
        lane = server.server.rpc._lanes["blocking"]
        freed = threading.Event()
        for _ in range(2000):     # the cancelled wait ends within a poll interval
            if lane.active == 1:
                break
            freed.wait(0.005)
        assert lane.active == 1
        later = server.start_tool("wait_for_task")
        # A busy refusal would be written before the reader even reads the ping.
        assert server.result("ping") == {}
        assert not server.has_response(later), "the freed worker refused a new wait"
        assert not server.has_response(second)
        server.cancel_pending()
        assert server.result("ping") == {}


def test_a_call_sent_right_after_an_answer_finds_its_slot_free(project, monkeypatch):
    """The lane slot is freed before the answer is written, so a client at the
    limit that sends its next call the moment it reads an answer is never refused."""
    config(project, wait=0)
    monkeypatch.setattr(ferrus.JsonRpcServer, "MAX_BLOCKING", 1)
    store = ferrus.Store(str(project))
    with InProcessMcp(store, "executor") as server:
        server.initialize()
        for _ in range(100):
            result = server.call_tool("wait_for_task")
            assert tool_json(result)["status"] == "timeout", tool_text(result)


@pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="POSIX symlinks")
def test_tool_results_never_carry_a_symlinked_files_target(serve, root, secret):
    sup, exe = serve("supervisor"), serve("executor")
    assert sup.call_tool("create_task", {"description": "real task"})["isError"] is False
    task = os.path.join(str(root), ".ferrus", "TASK.md")
    os.unlink(task)
    os.symlink(secret, task)
    results = [exe.call_tool("wait_for_task"), sup.call_tool("status"),
               exe.call_tool("status")]
    assert "TOP-SECRET" not in json.dumps(results)
    assert results[0]["isError"] is True
    assert "symbolic link" in tool_text(results[0]) and "hint:" in tool_text(results[0])
