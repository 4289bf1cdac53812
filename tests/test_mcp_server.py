"""The MCP server (`ferrus serve`) over real pipes: protocol, roles, tools, waits, leases.

Every server here is `python ferrus.py serve` started through
``mcp_client.McpProcess``, except where a fake clock or a monkeypatched
constant is needed (``InProcessMcp`` runs ``ferrus.FerrusMcpServer`` in this
process).  Starting Python dominates the run time, so most tests use the
``bench`` fixture: four long-lived servers (supervisor, two executors, no role)
on one project that is reset to a fresh Idle before each test.  Tests that need
a fresh or uninitialised server, or that end one, use ``servers`` or their own
McpProcess.  Nothing sleeps to let lease time pass except the test that says so
(ttl_secs = 1 with real servers).

Tests named after a bug (test_upstream_bug_N_*, and the ones whose docstring
describes a defect) are regression tests: each failed before its fix.
"""

import base64
import contextlib
import glob
import json
import os
import shutil
import threading
import time
import types

import pytest

import ferrus
from conftest import FakeClock, run_cli, set_config, wait_until
from mcp_client import (McpError, McpProcess, InProcessMcp, modern_meta, tool_json,
                        tool_text)

LEGACY_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
STRUCTURED_VERSIONS = ("2025-06-18", "2025-11-25")

SUPERVISOR_TOOLS = ["create_task", "enqueue_task", "create_spec", "wait_for_review", "review_pending", "approve",
                    "reject", "respond_consult", "wait_for_answer", "ask_human", "answer",
                    "status", "reset", "heartbeat"]
EXECUTOR_TOOLS = ["wait_for_task", "check", "consult", "submit", "wait_for_consult",
                  "wait_for_answer", "ask_human", "answer", "status", "heartbeat"]
ALL_TOOLS = ["create_task", "enqueue_task", "create_spec", "wait_for_review", "review_pending", "approve",
             "reject", "respond_consult", "wait_for_task", "check", "consult", "submit",
             "wait_for_consult", "wait_for_answer", "ask_human", "answer", "status", "reset",
             "heartbeat"]
# Project memory and the repository graph: read-only, every role, after the task tools.
MEMORY_AND_MAP_TOOLS = ["project_memory_status", "project_context_search", "project_context",
                        "repository_graph_status", "repository_graph_search",
                        "repository_graph_context"]
SUPERVISOR_TOOLS += MEMORY_AND_MAP_TOOLS
EXECUTOR_TOOLS += MEMORY_AND_MAP_TOOLS
ALL_TOOLS += MEMORY_AND_MAP_TOOLS

CONSULT_QUESTION = ("## Problem\nThe parser is slow.\n\n## What I tried\nProfiling.\n\n"
                    "## Options (if any)\nA cache.\n\n## Question\nMay I add a cache?\n")

SUP = ferrus.Caller("supervisor", "supervisor:inproc:0")


def write_config(root, commands=(), wait=1, ttl=60, parallel=False, timeout=600,
                 fail_fast=False, max_check_retries=20, max_review_cycles=3,
                 max_feedback_lines=30):
    """Write ferrus.toml; running servers pick it up (its mtime always moves forward)."""
    path = os.path.join(str(root), "ferrus.toml")
    try:
        previous = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        previous = 0
    set_config(root, """\
[checks]
commands = %s
parallel = %s
timeout_secs = %d
fail_fast = %s

[limits]
max_check_retries = %d
max_review_cycles = %d
max_feedback_lines = %d
wait_timeout_secs = %d

[lease]
ttl_secs = %d
heartbeat_interval_secs = 1
""" % (json.dumps(list(commands)), str(parallel).lower(), timeout, str(fail_fast).lower(),
       max_check_retries, max_review_cycles, max_feedback_lines, wait, ttl))
    if os.stat(path).st_mtime_ns <= previous:
        # Two writes within one timestamp tick: push the mtime past the last one
        # so that ConfigCache's (mtime, size, inode) stamp changes.
        stamp = previous + 1_000_000
        os.utime(path, ns=(stamp, stamp))


@pytest.fixture
def root(project):
    """An initialised project whose waits give up after one second."""
    write_config(project, wait=1)
    return project


@pytest.fixture
def servers(root):
    """Factory: servers(role=None, index=1, init=True) -> an initialised McpProcess.

    ``servers.many(spec, ...)`` starts several at once (their start-up overlaps)
    and returns them initialised; a spec is a role or (role, index).  At teardown
    every server is closed and must exit 0 with clean stdout and no traceback."""
    started = []

    def launch(role=None, index=1, name="test"):
        args = ["--agent-name", name, "--agent-index", str(index)]
        if role:
            args = ["--role", role] + args
        server = McpProcess(root, *args)
        started.append(server)
        return server

    def start(role=None, index=1, name="test", init=True, version="2025-11-25"):
        server = launch(role, index, name)
        if init:
            server.initialize(version)
        return server

    def many(*specs):
        launched = [launch(*(spec if isinstance(spec, tuple) else (spec,))) for spec in specs]
        for server in launched:
            server.initialize()
        return launched

    start.many = many
    yield start
    close_and_check(started)


def close_and_check(started):
    """Close servers; each must exit 0, with clean stdout and no traceback."""
    problems = []
    for server in started:
        server.close_stdin()
    for server in started:
        try:
            code = server.close(timeout=10)
            if code != 0:
                problems.append("%s exited %s" % (server.argv, code))
        except Exception as err:  # pragma: no cover - only on failure
            server.kill()
            problems.append("%s did not exit: %r" % (server.argv, err))
        if server.bad_lines:
            problems.append("non-JSON-RPC stdout lines: %r" % server.bad_lines[:3])
        if server.schema_violations and not server.allow_invalid:
            problems.append("messages that break the MCP schema (%d), first: %s in %s" % (
                len(server.schema_violations), "; ".join(server.schema_violations[0][0][:5]),
                json.dumps(server.schema_violations[0][1])[:800]))
        if "Traceback" in server.stderr_text():
            problems.append("traceback on stderr:\n%s" % server.stderr_text())
        server.stderr_file.close()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One project with four long-lived servers: supervisor:test:1,
    executor:test:1, executor:test:2 and a role-less agent:test:1.  Starting a
    Python process is the slowest thing these tests do, so every test that does
    not need a fresh server uses these through the ``bench`` fixture."""
    root = tmp_path_factory.mktemp("bench") / "proj"
    root.mkdir()
    ferrus.init_project(str(root), report=lambda message: None)
    write_config(root, wait=1)
    common = ("--agent-name", "test")
    started = [McpProcess(root, "--role", "supervisor", *common, "--agent-index", "1"),
               McpProcess(root, "--role", "executor", *common, "--agent-index", "1"),
               McpProcess(root, "--role", "executor", *common, "--agent-index", "2"),
               McpProcess(root, *common, "--agent-index", "1")]
    for server in started:
        server.initialize()
    yield types.SimpleNamespace(root=root, sup=started[0], exe=started[1], exe2=started[2],
                                any=started[3], all=started)
    close_and_check(started)


@pytest.fixture
def bench(shared):
    """The shared servers on a project reset to a fresh Idle: the default test
    config (wait_timeout_secs = 1), empty task files, no check logs, no spec
    selected, nothing left in the clients' queues.  ``bench.journal()`` is the
    journal written since the test began."""
    root = shared.root
    store = ferrus.Store(str(root))
    write_config(root, wait=1)
    ferrus.op_force_reset(store, ferrus.HUMAN)
    if store.read_state().selected_spec:
        ferrus.op_clear_selection(store, ferrus.HUMAN)
    logs = store.path("logs")
    shutil.rmtree(logs)
    os.makedirs(logs)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(str(root), "go.flag"))
    for server in shared.all:
        server.result("ping")
        server.reset_queues()
    first = store.last_journal_seq()
    bench = types.SimpleNamespace(**vars(shared))
    bench.store = store
    bench.journal = lambda: store.read_journal(after_seq=first)
    yield bench
    # Whatever a failed test left running must not act in the next test.
    for server in shared.all:
        server.cancel_pending()
    for server in shared.all:
        server.result("ping")


def state_of(root):
    return ferrus.Store(str(root)).read_state()


def error_of(response):
    assert "error" in response, "expected an error response, got %r" % (response,)
    assert "result" not in response
    return response["error"]


def refused(result, *fragments):
    """Assert a tool result is a refusal (isError) whose text has every fragment."""
    assert result["isError"] is True, result
    text = tool_text(result)
    for fragment in fragments:
        assert fragment in text, "%r not in %r" % (fragment, text)
    return text


def failed(result):
    """Assert a tool result reports a failure (isError) and return it."""
    assert result["isError"] is True, result
    return result


def ok(result):
    assert result["isError"] is False, tool_text(result)
    return result


def executor_with_task(bench, description="Implement the widget."):
    """bench's supervisor, and its executor 1 after claiming a fresh task."""
    sup, exe = bench.sup, bench.exe
    ok(sup.call_tool("create_task", {"description": description}))
    claimed = tool_json(ok(exe.call_tool("wait_for_task")))
    assert claimed["status"] == "claimed"
    return sup, exe


# ============================================================================
# Handshake and protocol eras
# ============================================================================

@pytest.mark.parametrize("version", LEGACY_VERSIONS)
def test_initialize_echoes_each_supported_version(servers, version):
    server = servers("executor", init=False)
    result = server.initialize(version)
    assert result["protocolVersion"] == version
    assert result["capabilities"] == {
        "tools": {"listChanged": False},
        "resources": {"listChanged": False, "subscribe": False},
        "prompts": {"listChanged": False}, "logging": {}}
    assert result["serverInfo"]["name"] == "ferrus"
    assert result["serverInfo"]["version"] == ferrus.__version__
    if version >= "2025-06-18":   # Implementation.title is new in 2025-06-18
        assert "executor" in result["serverInfo"]["title"]
    else:
        assert "title" not in result["serverInfo"]
    assert isinstance(result["instructions"], str) and result["instructions"]

    structured = version in STRUCTURED_VERSIONS
    tools = server.result("tools/list")["tools"]
    assert tools
    for tool in tools:
        assert ("outputSchema" in tool) == structured, (version, tool["name"])
        assert tool["inputSchema"]["type"] == "object"
    status = ok(server.call_tool("status"))
    assert ("structuredContent" in status) == structured
    if structured:
        assert status["structuredContent"]["state"] == "Idle"
        assert json.loads(json.dumps(status["structuredContent"])) == status["structuredContent"]


def test_initialize_with_unknown_version_answers_latest(servers):
    server = servers(init=False)
    result = server.initialize("1999-01-01")
    assert result["protocolVersion"] == "2025-11-25"
    # A missing or non-string protocolVersion is malformed params (issue #12.5).
    for params in ({"protocolVersion": 12, "capabilities": {}}, {"capabilities": {}},
                   {"protocolVersion": None}):
        assert error_of(server.request("initialize", params))["code"] == -32602


def test_server_discover_shape(bench):
    server = bench.sup
    result = server.result("server/discover", {"_meta": modern_meta()})
    assert result["resultType"] == "complete"
    assert "2026-07-28" in result["supportedVersions"]
    for version in LEGACY_VERSIONS:
        assert version in result["supportedVersions"]
    assert result["capabilities"]["tools"] == {"listChanged": False}
    assert set(result["capabilities"]) == {"tools", "resources", "prompts", "logging"}
    assert isinstance(result["ttlMs"], int) and result["ttlMs"] >= 0
    assert result["cacheScope"] in ("private", "public", "shared")
    info = result["_meta"]["io.modelcontextprotocol/serverInfo"]
    assert info["name"] == "ferrus" and info["version"] == ferrus.__version__


def test_modern_era_without_initialize(servers, root):
    server = servers("supervisor", init=False)
    listing = server.result("tools/list", {"_meta": modern_meta()})
    assert listing["resultType"] == "complete"
    assert [t["name"] for t in listing["tools"]] == SUPERVISOR_TOOLS
    assert all("outputSchema" in t for t in listing["tools"])
    assert "nextCursor" not in listing
    assert listing["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "ferrus"

    result = server.call_tool("create_task", {"description": "modern task"}, meta=modern_meta())
    assert result["resultType"] == "complete"
    assert result["isError"] is False
    assert result["structuredContent"]["state"] == "Executing"
    assert state_of(root).state == ferrus.S.EXECUTING

    status = server.call_tool("status", meta=modern_meta())
    assert status["resultType"] == "complete"
    assert status["structuredContent"]["state"] == "Executing"
    # A refusal in the modern era is still a result with a resultType.
    again = server.call_tool("create_task", {"description": "x"}, meta=modern_meta())
    assert again["resultType"] == "complete"
    refused(again, "Cannot create task")


def test_modern_era_unsupported_version_is_32022(bench):
    server = bench.any
    for version in ("2099-01-01", "2025-11-25"):
        error = error_of(server.request("tools/list", {"_meta": modern_meta(version)}))
        assert error["code"] == -32022
        assert error["data"]["requested"] == version
        assert error["data"]["supported"] == list(ferrus.MCP_ALL_VERSIONS)
    error = error_of(server.request("tools/call", {"name": "status",
                                                  "_meta": modern_meta("1.0")}))
    assert error["code"] == -32022


def test_modern_era_missing_client_capabilities_is_32602(bench):
    server = bench.any
    error = error_of(server.request("tools/list",
                                    {"_meta": modern_meta(capabilities=False)}))
    assert error["code"] == -32602
    meta = modern_meta()
    meta["io.modelcontextprotocol/clientCapabilities"] = "all of them"
    error = error_of(server.request("tools/call", {"name": "status", "_meta": meta}))
    assert error["code"] == -32602


# ============================================================================
# Lifecycle, notifications, ping, logging, pagination
# ============================================================================

def test_requests_before_initialize_are_refused_except_ping(servers, root):
    server = servers("supervisor", init=False)
    for method, params in (("tools/list", None), ("resources/list", None),
                           ("resources/templates/list", None), ("prompts/list", None),
                           ("resources/read", {"uri": "ferrus://task"}),
                           ("prompts/get", {"name": "executor-context"}),
                           ("logging/setLevel", {"level": "debug"}),
                           ("tools/call", {"name": "create_task",
                                           "arguments": {"description": "too early"}})):
        error = error_of(server.request(method, params))
        assert error["code"] == -32600, (method, error)
        assert "initialize" in error["message"]
    assert state_of(root).state == ferrus.S.IDLE   # the early create_task did nothing
    assert server.result("ping") == {}
    # An unknown method is unknown, not "not initialized"; discover needs no handshake.
    assert error_of(server.request("no/such"))["code"] == -32601
    assert server.result("server/discover",
                         {"_meta": modern_meta()})["resultType"] == "complete"
    server.initialize()
    assert [t["name"] for t in server.result("tools/list")["tools"]] == SUPERVISOR_TOOLS


def test_notifications_never_get_responses(bench):
    server, root = bench.sup, bench.root
    before = list(server.all_responses)
    server.notify("notifications/initialized")
    server.notify("notifications/unknown_thing", {"x": 1})
    server.notify("notifications/cancelled", {"requestId": 12345})
    server.notify("notifications/cancelled", {"requestId": [1, 2]})
    server.notify("notifications/cancelled")
    server.notify("notifications/progress", {"progressToken": "t", "progress": 1})
    server.send({"jsonrpc": "2.0", "method": "notifications/message", "params": [1, 2]})
    # A request method sent as a notification is not executed and not answered.
    server.notify("tools/call", {"name": "create_task", "arguments": {"description": "no"}})
    server.notify("ping")
    server.notify("no/such/method")
    pong = server.request("ping", id="after-notifications")
    assert pong["result"] == {}
    assert server.all_responses == before + [pong]
    assert state_of(root).state == ferrus.S.IDLE


def test_ping_and_logging_set_level(bench):
    server = bench.exe
    assert server.request("ping")["result"] == {}
    assert server.request("ping", {})["result"] == {}
    for level in ferrus.LOG_LEVELS:
        assert server.result("logging/setLevel", {"level": level}) == {}
    server.result("logging/setLevel", {"level": "info"})
    for params in ({"level": "verbose"}, {"level": "DEBUG"}, {"level": 3}, {}):
        assert error_of(server.request("logging/setLevel", params))["code"] == -32602


def test_pagination_cursor(bench):
    server = bench.sup
    for method, key in (("tools/list", "tools"), ("resources/list", "resources"),
                        ("resources/templates/list", "resourceTemplates"),
                        ("prompts/list", "prompts")):
        first = server.result(method)
        assert first[key], method
        assert "nextCursor" not in first, method
        for cursor in ("not a cursor!", "@@@", base64.b64encode(b"999").decode(),
                       base64.b64encode(b"-1").decode(), base64.b64encode(b"abc").decode(), 7):
            error = error_of(server.request(method, {"cursor": cursor}))
            assert error["code"] == -32602, (method, cursor)
        # Offset 0 is a valid cursor: the same first page.
        assert server.result(method, {"cursor": base64.b64encode(b"0").decode()}) == first


def test_tools_list_is_deterministic_across_servers(servers, bench):
    """A fresh server of each role lists exactly what the long-running one lists."""
    fresh = servers.many(("supervisor", 3), ("executor", 3), (None, 3))
    for old, new in zip((bench.sup, bench.exe, bench.any), fresh):
        one, two = old.result("tools/list"), new.result("tools/list")
        assert json.dumps(one) == json.dumps(two)
        assert old.result("resources/list") == new.result("resources/list")
        assert old.result("prompts/list") == new.result("prompts/list")


# ============================================================================
# Roles
# ============================================================================

def test_role_tool_lists(bench):
    expectations = (("supervisor", SUPERVISOR_TOOLS), ("executor", EXECUTOR_TOOLS),
                    (None, ALL_TOOLS))
    started = [bench.sup, bench.exe, bench.any]
    for server, (role, expected) in zip(started, expectations):
        tools = server.result("tools/list")["tools"]
        assert [tool["name"] for tool in tools] == expected, role
        for tool in tools:
            assert tool["title"] and tool["description"]
            assert tool["annotations"]["openWorldHint"] is False
    assert "reset" not in EXECUTOR_TOOLS


def test_tool_outside_role_is_exactly_like_unknown_tool(bench):
    exe, sup, root = bench.exe, bench.sup, bench.root
    unknown = error_of(exe.request("tools/call", {"name": "no_such_tool"}))
    assert unknown["code"] == -32602
    assert unknown["message"] == "Unknown tool: no_such_tool"
    for server, name, arguments in ((exe, "create_task", {"description": "x"}),
                                    (exe, "reset", None), (exe, "approve", None),
                                    (sup, "wait_for_task", None), (sup, "check", None),
                                    (sup, "submit", {"content": "x"})):
        params = {"name": name}
        if arguments:
            params["arguments"] = arguments
        error = error_of(server.request("tools/call", params))
        assert error == {"code": -32602, "message": "Unknown tool: %s" % name}
    for bad_name in (None, 5, ["status"]):
        assert error_of(exe.request("tools/call", {"name": bad_name}))["code"] == -32602
    with pytest.raises(McpError) as info:
        sup.call_tool("wait_for_consult")
    assert info.value.code == -32602
    assert state_of(root).state == ferrus.S.IDLE


def test_serve_refuses_a_session_of_an_unknown_or_unstarted_task(project):
    request = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}) + "\n"
    unknown = "t-20260101T000000-abcdef"
    done = run_cli("serve", "--role", "executor", "--session", unknown + ".s-1", cwd=project,
                   input=request)
    assert done.returncode == 1 and done.stdout == ""
    assert "not a task of this project" in done.stderr and "hint:" in done.stderr
    store = ferrus.Store(str(project))
    queued = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Later.").data["task_id"]
    done = run_cli("serve", "--role", "executor", cwd=project, input=request,
                   env={"FERRUS_SESSION": queued + ".s-2"})
    assert done.returncode == 1 and done.stdout == ""
    assert "has not started" in done.stderr
    # the project's own session is served as before
    done = run_cli("serve", "--role", "executor", "--session", "s-3", cwd=project,
                   input=request)
    assert done.returncode == 0 and '"result"' in done.stdout


# ============================================================================
# Tools: the loop, happy paths and refusals
# ============================================================================

def test_full_loop_and_journal(bench):
    write_config(bench.root, commands=["echo check-ok"], wait=1)
    sup, exe = bench.sup, bench.exe

    created = ok(sup.call_tool("create_task", {"description": "Build the widget."}))
    task_id = created["structuredContent"]["task_id"]
    assert created["structuredContent"]["state"] == "Executing"

    claimed = tool_json(ok(exe.call_tool("wait_for_task")))
    assert claimed["status"] == "claimed"
    assert claimed["claimed_by"] == "executor:test:1"
    assert claimed["task"] == "Build the widget."
    assert claimed["state"] == "Executing" and claimed["task_id"] == task_id

    checked = ok(exe.call_tool("check"))
    assert checked["structuredContent"]["passed"] is True
    assert "All checks passed" in tool_text(checked)

    submitted = ok(exe.call_tool("submit", {"content": "Added the widget."}))
    assert submitted["structuredContent"]["state"] == "Reviewing"

    review = tool_json(ok(sup.call_tool("wait_for_review")))
    assert review["status"] == "claimed" and review["claimed_by"] == "supervisor:test:1"
    assert review["submission"] == "Added the widget."
    assert review["review_cycles_used"] == 0

    rejected = ok(sup.call_tool("reject", {"notes": "Handle the empty widget."}))
    assert rejected["structuredContent"]["state"] == "Addressing"
    assert rejected["structuredContent"]["review_cycles"] == 1

    again = tool_json(ok(exe.call_tool("wait_for_task")))
    assert again["status"] == "claimed"
    assert again["state"] == "Addressing"
    assert again["review"] == "Handle the empty widget."
    assert again["task"] == "Build the widget."

    ok(exe.call_tool("submit", {"content": "Empty widgets handled."}))
    pending = ok(sup.call_tool("review_pending"))
    assert "Empty widgets handled." in tool_text(pending)
    assert "Handle the empty widget." in tool_text(pending)
    approved = ok(sup.call_tool("approve"))
    assert approved["structuredContent"]["state"] == "Complete"
    assert state_of(bench.root).state == ferrus.S.COMPLETE

    journal = bench.journal()
    assert [(e["event"], e["actor"]) for e in journal] == [
        ("create_task", "supervisor:test:1"),
        ("claim", "executor:test:1"),
        ("check_passed", "executor:test:1"),
        ("submit", "executor:test:1"),
        ("claim", "supervisor:test:1"),
        ("reject", "supervisor:test:1"),
        ("claim", "executor:test:1"),
        ("submit", "executor:test:1"),
        ("approve", "supervisor:test:1"),
    ]
    first = journal[0]["seq"]
    assert [e["seq"] for e in journal] == list(range(first, first + 9))
    assert [(e["from"], e["to"]) for e in journal if e["from"] != e["to"]] == [
        ("Idle", "Executing"), ("Executing", "Reviewing"), ("Reviewing", "Addressing"),
        ("Addressing", "Reviewing"), ("Reviewing", "Complete")]
    assert all(e["task_id"] == task_id for e in journal)
    assert journal[2]["detail"]["log"].startswith(".ferrus/logs/")


def test_refusals_in_wrong_state(bench):
    sup, exe = bench.sup, bench.exe
    idle_refusals = [
        (sup, "review_pending", None, "No submission pending review. Current state: Idle"),
        (sup, "approve", None, "Cannot approve from state Idle"),
        (sup, "reject", {"notes": "no"}, "Cannot reject from state Idle"),
        (sup, "respond_consult", {"response": "r"}, "Cannot respond to consultation from state Idle"),
        (sup, "reset", None, "Cannot reset from state Idle"),
        (sup, "answer", {"response": "r"}, "Cannot answer from state Idle"),
        (sup, "ask_human", {"question": "q?"}, "cannot ask_human from state Idle"),
        (sup, "wait_for_answer", None, "No question is pending (state Idle)"),
        (exe, "check", None, "Cannot run checks from state Idle"),
        (exe, "submit", {"content": "done"}, "Cannot submit from state Idle"),
        (exe, "consult", {"question": CONSULT_QUESTION}, "Cannot consult from state Idle"),
        (exe, "wait_for_consult", None, "Cannot wait for consultation from state Idle"),
        (exe, "wait_for_answer", None, "No question is pending (state Idle)"),
        (sup, "create_task", {"description": "   "}, "the description is empty"),
        (sup, "create_spec", {"markdown": ""}, "markdown content is empty"),
    ]
    for server, name, arguments, fragment in idle_refusals:
        refused(server.call_tool(name, arguments), fragment)
    assert state_of(bench.root).state == ferrus.S.IDLE
    assert bench.journal() == []
    # heartbeat's refusals keep upstream's structured shape and are tool errors (isError).
    beat = tool_json(failed(exe.call_tool("heartbeat")))
    assert beat["status"] == "error" and beat["code"] == "not_claimed"

    ok(sup.call_tool("create_task", {"description": "one"}))
    refused(sup.call_tool("create_task", {"description": "two"}),
            "Cannot create task: current state is Executing")
    tool_json(ok(exe.call_tool("wait_for_task")))
    refused(exe.call_tool("consult", {"question": "help?"}), "must follow the template",
            "## Problem")
    refused(sup.call_tool("reject", {"notes": ""}), "review notes are empty")
    refused(sup.call_tool("approve"), "Cannot approve from state Executing")
    assert state_of(bench.root).state == ferrus.S.EXECUTING


def test_create_spec_selects_first_ready_milestone(bench):
    sup = bench.sup
    markdown = ("# Widget Spec\n\n## Milestones\n"
                "- [x] #1.0 Done already\n  - ID: m0\n  - Depends on: none\n"
                "- [ ] #1.1 First\n  - ID: m1\n  - Depends on: #1.0\n"
                "- [ ] #1.2 Second\n  - ID: m2\n  - Depends on: #1.1\n")
    result = ok(sup.call_tool("create_spec", {"markdown": markdown}))
    data = result["structuredContent"]
    assert data["path"].startswith("docs/specs/") and data["path"].endswith("widget-spec.md")
    assert data["selected_milestone"] == "m1"
    with open(os.path.join(str(bench.root), data["path"]), encoding="utf-8") as handle:
        assert handle.read() == markdown
    status = ok(sup.call_tool("status"))["structuredContent"]
    assert status["selected_spec"] == data["path"] and status["selected_milestone"] == "m1"
    # A second spec with the same title gets a new file, never overwrites.
    second = ok(sup.call_tool("create_spec", {"markdown": markdown}))["structuredContent"]
    assert second["path"] != data["path"]


def test_consult_round_trip(bench):
    sup, exe = executor_with_task(bench)
    consulted = ok(exe.call_tool("consult", {"question": CONSULT_QUESTION}))
    assert consulted["structuredContent"]["state"] == "Consultation"
    assert consulted["structuredContent"]["paused_state"] == "Executing"
    request = sup.result("resources/read", {"uri": "ferrus://consult_request"})
    assert request["contents"][0]["text"] == CONSULT_QUESTION
    refused(exe.call_tool("check"), "Cannot run checks from state Consultation")
    ok(sup.call_tool("respond_consult", {"response": "Yes, add an LRU cache."}))
    answer = ok(exe.call_tool("wait_for_consult"))
    assert answer["structuredContent"]["status"] == "responded"
    assert answer["structuredContent"]["response"] == "Yes, add an LRU cache."
    assert answer["structuredContent"]["state"] == "Executing"
    assert tool_text(answer) == "Yes, add an LRU cache."
    data = state_of(bench.root)
    assert data.state == ferrus.S.EXECUTING and data.claimed_by == "executor:test:1"
    refused(exe.call_tool("wait_for_consult"), "Cannot wait for consultation from state Executing")


def test_ask_human_round_trip(bench):
    sup, exe = executor_with_task(bench)
    asked = ok(exe.call_tool("ask_human", {"question": "Which database?"}))
    assert asked["structuredContent"] == {
        "message": tool_text(asked), "state": "AwaitingHuman", "paused_state": "Executing"}
    assert state_of(bench.root).question_from == "executor:test:1"
    question = exe.result("resources/read", {"uri": "ferrus://question"})
    assert question["contents"][0]["text"] == "Which database?"
    ok(sup.call_tool("answer", {"response": "PostgreSQL."}))
    got = tool_json(ok(exe.call_tool("wait_for_answer")))
    assert got == {"status": "answered", "answer": "PostgreSQL.", "resumed_state": "Executing"}
    assert state_of(bench.root).state == ferrus.S.EXECUTING


def test_reject_until_failed_then_reset(bench):
    write_config(bench.root, wait=1, max_review_cycles=1)
    sup, exe = executor_with_task(bench)
    ok(exe.call_tool("submit", {"content": "v1"}))
    failed = ok(sup.call_tool("reject", {"notes": "Wrong approach."}))
    assert failed["structuredContent"]["state"] == "Failed"
    assert "Review cycle limit reached (1/1)" in tool_text(failed)
    status = ok(exe.call_tool("status"))["structuredContent"]
    assert status["state"] == "Failed" and "rejected 1 times" in status["failure_reason"]
    reset = ok(sup.call_tool("reset"))
    assert reset["structuredContent"]["state"] == "Idle"
    store = bench.store
    assert store.read_file("REVIEW.md") == "" and store.read_file("SUBMISSION.md") == ""
    refused(sup.call_tool("reset"), "Cannot reset from state Idle")


def test_status_and_heartbeat_happy_path(bench):
    sup, exe = executor_with_task(bench)
    status = ok(exe.call_tool("status"))
    assert "**State:** Executing" in tool_text(status)
    assert status["structuredContent"]["claimed_by"] == "executor:test:1"
    before = state_of(bench.root).lease_until
    beat = tool_json(ok(exe.call_tool("heartbeat")))
    assert beat["status"] == "renewed" and beat["claimed_by"] == "executor:test:1"
    assert ferrus.parse_timestamp(beat["lease_until"]) >= ferrus.parse_timestamp(before)
    same = tool_json(ok(exe.call_tool("heartbeat", {"agent_id": "executor:test:1"})))
    assert same["status"] == "renewed"
    other = tool_json(failed(sup.call_tool("heartbeat")))
    assert other["code"] == "claimed_by_other"


# ============================================================================
# Bad input
# ============================================================================

def test_malformed_json_is_parse_error_with_null_id(bench):
    server = bench.any
    for line in (b'{"jsonrpc": "2.0", "id": "m1", "method": "ping"\n', b"not json at all\n",
                 b'{"jsonrpc":"2.0","id":"m2","method":"ping",}\n'):
        server.send(line)
        response = server.wait_response(None)
        # 2025-11-25's JSONRPCErrorResponse: no id when it could not be read.
        assert "id" not in response
        assert error_of(response)["code"] == -32700
    assert not server.has_response("m1") and not server.has_response("m2")
    assert server.result("ping") == {}


def test_batch_is_invalid_request(bench):
    server, root = bench.sup, bench.root
    for batch in ([{"jsonrpc": "2.0", "id": "b1", "method": "ping"},
                   {"jsonrpc": "2.0", "id": "b2", "method": "tools/call",
                    "params": {"name": "create_task", "arguments": {"description": "b"}}}], []):
        server.send(batch)
        assert error_of(server.wait_response(None))["code"] == -32600
    assert not server.has_response("b1") and not server.has_response("b2")
    assert state_of(root).state == ferrus.S.IDLE


def test_wrong_jsonrpc_version_and_non_objects(bench):
    server = bench.any
    server.send({"jsonrpc": "1.0", "id": 707, "method": "ping"})
    assert error_of(server.wait_response(707))["code"] == -32600
    server.send({"id": 708, "method": "ping"})
    assert error_of(server.wait_response(708))["code"] == -32600
    for value in ("just a string", 42, None):
        server.send(value)
        assert error_of(server.wait_response(None))["code"] == -32600
    server.send({"jsonrpc": "2.0", "id": 709, "method": 5})
    assert error_of(server.wait_response(709))["code"] == -32600
    server.send({"jsonrpc": "2.0", "id": 710, "method": "ping", "params": [1, 2]})
    assert error_of(server.wait_response(710))["code"] == -32602


def test_invalid_id_type(bench):
    server = bench.any
    for bad_id in (1.5, True, False, [1], {"a": 1}, None):
        server.send({"jsonrpc": "2.0", "id": bad_id, "method": "ping"})
        response = server.wait_response(None)
        assert "id" not in response, bad_id
        assert error_of(response)["code"] == -32600, bad_id
        assert server.result("ping") == {}


def test_unknown_method(bench):
    for server in bench.all:
        error = error_of(server.request("tools/frobnicate"))
        assert error["code"] == -32601
        assert "tools/frobnicate" in error["message"]
        assert error_of(server.request("initialized"))["code"] == -32601


def test_tool_argument_validation(bench):
    server, root = bench.sup, bench.root
    # 2025-11-25 (SEP-1303): arguments that break the inputSchema are tool
    # errors the model can read; see test_mcp_conformance.py for older versions.
    cases = [
        ({"name": "create_task"}, "missing required argument 'description'"),
        ({"name": "create_task", "arguments": {}}, "missing required argument"),
        ({"name": "create_task", "arguments": {"description": 5}}, "must be a string"),
        ({"name": "create_task", "arguments": {"description": None}}, "must be a string"),
        ({"name": "create_task", "arguments": {"description": ["a"]}}, "must be a string"),
        ({"name": "create_task", "arguments": {"description": "x", "priority": 1}},
         "unknown argument 'priority'"),
        ({"name": "status", "arguments": {"verbose": True}}, "unknown argument 'verbose'"),
        ({"name": "heartbeat", "arguments": {"agent_id": 3}}, "must be a string"),
    ]
    for params, fragment in cases:
        refused(server.result("tools/call", params), fragment, "hint:")
    # A call that breaks CallToolRequest itself is still malformed params.
    for params in ({"name": "create_task", "arguments": "description"},
                   {"name": "create_task", "arguments": [1]}):
        error = error_of(server.request("tools/call", params))
        assert error["code"] == -32602, params
        assert "must be an object" in error["message"], error
    assert state_of(root).state == ferrus.S.IDLE
    # `arguments: null` is the same as no arguments.
    assert ok(server.call_tool("status", None))["structuredContent"]["state"] == "Idle"
    assert ok(server.result("tools/call", {"name": "status", "arguments": None}))


def test_big_lines_and_oversized_line(bench):
    sup = bench.sup
    description = "x" * (10 * 1024 * 1024)
    result = ok(sup.call_tool("create_task", {"description": description}, timeout=60))
    assert result["structuredContent"]["state"] == "Executing"
    assert os.path.getsize(os.path.join(str(bench.root), ".ferrus", "TASK.md")) == len(description)

    huge = (b'{"jsonrpc":"2.0","id":4040,"method":"ping","params":{"pad":"'
            + b"y" * (40 * 1024 * 1024) + b'"}}\n')
    sup.send(huge)
    error = error_of(sup.wait_response(None, timeout=60))
    assert error["code"] in (-32600, -32700)
    assert "larger" in error["message"]
    assert not sup.has_response(4040)
    # Still serving, and the state is intact.
    assert sup.result("ping") == {}
    assert ok(sup.call_tool("status"))["structuredContent"]["state"] == "Executing"
    assert state_of(bench.root).state == ferrus.S.EXECUTING


def test_invalid_utf8_is_parse_error(bench):
    server = bench.any
    server.send(b'{"jsonrpc":"2.0","id":"u1","method":"ping","params":{"x":"\xff\xfe"}}\n')
    error = error_of(server.wait_response(None))
    assert error["code"] == -32700
    server.send(b"\xc3\x28\n")
    assert error_of(server.wait_response(None))["code"] == -32700
    assert not server.has_response("u1")
    assert server.result("ping") == {}


def test_state_survives_a_barrage_of_garbage(bench):
    sup = bench.sup
    ok(sup.call_tool("create_task", {"description": "keep me"}))
    garbage = [b"\n", b"   \n", b"{\n", b"[1,2\n", b"\x00\x01\x02\n", b"\xff" * 100 + b"\n",
               b'{"jsonrpc":"2.0"}\n', b'{"jsonrpc":"2.0","id":{},"method":"x"}\n',
               b'{"jsonrpc":"2.0","id":1e400,"method":"ping"}\n',
               b'{"jsonrpc":"2.0","id":"g","method":"tools/call","params":{"name":1}}\n',
               b'{"jsonrpc":"2.0","id":"h","method":"tools/call","params":"x"}\n',
               b'{"jsonrpc":"2.0","id":"i","method":"resources/read","params":{"uri":5}}\n']
    for line in garbage:
        sup.send(line)
    assert sup.request("ping", id="alive")["result"] == {}
    assert sup.result("ping") == {}
    data = state_of(bench.root)        # STATE.json still parses
    assert data.state == ferrus.S.EXECUTING
    assert bench.store.read_file("TASK.md") == "keep me"
    with open(os.path.join(str(bench.root), ".ferrus", "STATE.json"), encoding="utf-8") as handle:
        assert json.load(handle)["state"] == "Executing"


def test_duplicate_in_flight_id_is_refused(bench):
    write_config(bench.root, wait=30)
    exe = bench.exe
    exe.start_tool("wait_for_task", id="dup")
    exe.result("ping")
    exe.start_tool("wait_for_task", id="dup")
    error = error_of(exe.wait_response("dup"))
    assert error["code"] == -32600 and "already in use" in error["message"]
    # The first call is still alive and ends normally: it claims the next task.
    ferrus.op_create_task(bench.store, SUP, "for the first call")
    first = exe.wait_response("dup", timeout=10)
    assert tool_json(first["result"])["status"] == "claimed"


# ============================================================================
# Waits
# ============================================================================

def test_wait_for_task_wakes_promptly_on_create_task(bench):
    write_config(bench.root, wait=30)
    exe, sup = bench.exe, bench.sup
    request_id = exe.start_tool("wait_for_task")
    exe.result("ping")           # the wait was read first and is under way
    assert not exe.has_response(request_id)
    started = time.monotonic()
    ok(sup.call_tool("create_task", {"description": "wake up"}))
    response = exe.wait_response(request_id, timeout=10)
    elapsed = time.monotonic() - started
    assert tool_json(response["result"])["status"] == "claimed"
    # Woken by the task, not by its 30 s budget; how fast is a bench figure
    # (bench/run.py create_to_wait), not a test on a possibly loaded machine.
    assert elapsed < 15, "wait_for_task took %.2f s to notice the task" % elapsed


def test_wait_timeouts_are_normal_results(bench):
    exe, sup = bench.exe, bench.sup
    # Both block for wait_timeout_secs = 1 in Idle, at the same time.
    task_wait = exe.start_tool("wait_for_task")
    review_wait = sup.start_tool("wait_for_review")
    for request_id, server in ((task_wait, exe), (review_wait, sup)):
        result = server.wait_response(request_id)["result"]
        assert result["isError"] is False
        assert tool_json(result) == {"status": "timeout", "state": "Idle"}
        assert result["structuredContent"] == {"status": "timeout", "state": "Idle"}

    write_config(bench.root, wait=0)
    ok(sup.call_tool("create_task", {"description": "t"}))
    tool_json(ok(exe.call_tool("wait_for_task")))
    ok(exe.call_tool("consult", {"question": CONSULT_QUESTION}))
    result = ok(exe.call_tool("wait_for_consult"))
    assert tool_json(result) == {"status": "timeout", "state": "Consultation"}
    ok(exe.call_tool("ask_human", {"question": "?"}))
    for server in (exe, sup):
        result = ok(server.call_tool("wait_for_answer"))
        assert tool_json(result) == {"status": "timeout", "state": "AwaitingHuman"}


def test_progress_notifications_during_wait(project, monkeypatch):
    write_config(project, wait=1)
    monkeypatch.setattr(ferrus._Waiter, "PROGRESS_EVERY", 0.05)
    store = ferrus.Store(str(project))
    with InProcessMcp(store, "executor") as server:
        server.initialize()
        with_token = server.start_tool("wait_for_task", meta={"progressToken": "tok-1"})
        with_int_token = server.start_tool("wait_for_task", meta={"progressToken": 77})
        without = server.start_tool("wait_for_task")
        for request_id in (with_token, with_int_token, without):
            assert tool_json(server.wait_response(request_id)["result"])["status"] == "timeout"
        progress = [n["params"] for n in server.notifications
                    if n["method"] == "notifications/progress"]
        assert {p["progressToken"] for p in progress} == {"tok-1", 77}
        for token in ("tok-1", 77):
            mine = [p for p in progress if p["progressToken"] == token]
            assert len(mine) >= 3, mine
            values = [p["progress"] for p in mine]
            assert values == sorted(values) and len(set(values)) == len(values)
            assert all("waiting for a task" in p["message"] for p in mine)
        # No progress arrives after the final response.
        count = len(server.notifications)
        assert server.result("ping") == {}
        assert len(server.notifications) == count


def test_ping_is_answered_while_a_wait_blocks(bench):
    write_config(bench.root, wait=30)
    exe = bench.exe
    request_id = exe.start_tool("wait_for_task")
    for _ in range(3):
        started = time.monotonic()
        assert exe.result("ping") == {}
        assert time.monotonic() - started < 0.5
    assert ok(exe.call_tool("status"))["structuredContent"]["state"] == "Idle"
    assert not exe.has_response(request_id)
    exe.notify("notifications/cancelled", {"requestId": request_id})


def call_when_id_is_free(client, name, request_id, arguments=None, timeout=60):
    """Call a tool under the id of a cancelled call.  The server frees an id only when
    its call has ended, so this returns once that happened: the event itself, where a
    fixed sleep would only guess how long a loaded machine needs."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.call_tool(name, arguments, id=request_id)
        except McpError as err:
            if "already in use" not in str(err) or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


def answers_to(client, request_id):
    """The results (not "id already in use" errors) that carried ``request_id``."""
    return [r for r in client.all_responses if r.get("id") == request_id and "result" in r]


def test_cancelled_wait_ends_without_a_response(bench):
    write_config(bench.root, wait=30)
    exe, sup = bench.exe, bench.sup
    request_id = exe.start_tool("wait_for_task")
    exe.result("ping")
    exe.notify("notifications/cancelled", {"requestId": request_id, "reason": "user"})
    exe.result("ping")           # the cancellation has been read and applied
    ok(sup.call_tool("create_task", {"description": "nobody may claim this"}))
    assert ok(exe.call_tool("status"))["structuredContent"]["state"] == "Executing"
    ok(call_when_id_is_free(exe, "status", request_id))     # the cancelled call has ended
    data = state_of(bench.root)
    assert data.claimed_by is None, "the cancelled wait went on and claimed the task"
    assert len(answers_to(exe, request_id)) == 1, "the cancelled wait answered"
    assert tool_json(exe.call_tool("wait_for_task", id=request_id))["status"] == "claimed"


def test_cancelled_check_kills_its_commands_and_changes_nothing(bench):
    write_config(bench.root, wait=1, commands=["sleep 600 & echo $! > check.pid; wait"])
    sup, exe = executor_with_task(bench)
    before = bench.store.read_state()
    pid_file = os.path.join(str(bench.root), "check.pid")
    request_id = exe.start_tool("check")
    wait_until(lambda: os.path.exists(pid_file) and os.path.getsize(pid_file), "the check")
    with open(pid_file) as handle:
        pid = int(handle.read())
    started = time.monotonic()
    exe.notify("notifications/cancelled", {"requestId": request_id})
    wait_until(lambda: not ferrus.pid_alive(pid) or _zombie(pid),
               "the cancelled check's process to die", timeout=60)
    assert time.monotonic() - started < 60      # killed, far below its own 600 s
    assert exe.result("ping") == {}
    after = bench.store.read_state()
    assert (after.rev, after.check_retries, after.state) == (before.rev, 0, ferrus.S.EXECUTING)
    # The executor can run the gate again afterwards, even under the same id, which the
    # server frees only once the cancelled call has ended.
    write_config(bench.root, wait=1, commands=["true"])
    again = call_when_id_is_free(exe, "check", request_id)
    assert ok(again)["structuredContent"]["passed"] is True
    assert len(answers_to(exe, request_id)) == 1, "the cancelled check answered"
    os.unlink(pid_file)


def _zombie(pid):
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_closing_stdin_during_a_wait_exits_zero_promptly(root):
    write_config(root, wait=60)
    with McpProcess(root, "--role", "executor") as exe:
        exe.initialize()
        exe.start_tool("wait_for_task")
        exe.result("ping")
        started = time.monotonic()
        assert exe.close(timeout=10) == 0
        assert time.monotonic() - started < 2.0
        assert exe.bad_lines == []


def test_two_executors_race_for_one_task(bench):
    """Six rounds, exactly one winner each.  Even rounds: the task exists and both
    executors call wait_for_task at once (wait_timeout_secs = 0, so the loser
    returns at once).  Odd rounds: both are blocked in wait_for_task (1 s budget)
    when the task is created, so both wake for the same commit."""
    one, two = bench.exe, bench.exe2
    store = bench.store
    winners = []
    for round_number in range(6):
        task_first = round_number % 2 == 0
        write_config(bench.root, wait=0 if task_first else 1, ttl=60)
        if task_first:
            ferrus.op_create_task(store, SUP, "race %d" % round_number)
        ids = [(one, one.start_tool("wait_for_task")), (two, two.start_tool("wait_for_task"))]
        if not task_first:
            one.result("ping")
            two.result("ping")
            ferrus.op_create_task(store, SUP, "race %d" % round_number)
        outcomes = [tool_json(server.wait_response(rid)["result"]) for server, rid in ids]
        statuses = sorted(o["status"] for o in outcomes)
        assert statuses == ["claimed", "timeout"], (round_number, outcomes)
        winner = next(o for o in outcomes if o["status"] == "claimed")
        assert store.read_state().claimed_by == winner["claimed_by"]
        winners.append(winner["claimed_by"])
        ferrus.op_force_reset(store, ferrus.HUMAN)
    claims = [e for e in bench.journal() if e["event"] == "claim"]
    assert [e["actor"] for e in claims] == winners


# ============================================================================
# Leases
# ============================================================================

def test_lease_expiry_and_takeover(project):
    write_config(project, wait=0, ttl=90)
    clock = FakeClock()
    store_a = ferrus.Store(str(project), clock=clock)
    store_b = ferrus.Store(str(project), clock=clock)
    ferrus.op_create_task(store_a, SUP, "lease me")
    with InProcessMcp(store_a, "executor", "test", 1) as a, \
            InProcessMcp(store_b, "executor", "test", 2) as b:
        a.initialize()
        b.initialize()
        assert tool_json(ok(a.call_tool("wait_for_task")))["claimed_by"] == "executor:test:1"
        # While A's lease is live, B can neither claim nor act.
        assert tool_json(ok(b.call_tool("wait_for_task")))["status"] == "timeout"
        refused(b.call_tool("check"), "leased to executor:test:1")
        refused(b.call_tool("submit", {"content": "mine"}), "leased to executor:test:1")
        refused(b.call_tool("consult", {"question": CONSULT_QUESTION}), "leased to")
        assert tool_json(failed(b.call_tool("heartbeat")))["code"] == "claimed_by_other"

        clock.advance(60)
        assert tool_json(ok(a.call_tool("heartbeat")))["status"] == "renewed"
        clock.advance(89)
        assert tool_json(ok(b.call_tool("wait_for_task")))["status"] == "timeout"
        clock.advance(2)         # 91 s after A's last renewal: the lease has expired
        assert tool_json(failed(a.call_tool("heartbeat")))["code"] == "expired"
        taken = tool_json(ok(b.call_tool("wait_for_task")))
        assert taken["status"] == "claimed" and taken["claimed_by"] == "executor:test:2"

        assert tool_json(failed(a.call_tool("heartbeat")))["code"] == "claimed_by_other"
        refused(a.call_tool("check"), "leased to executor:test:2")
        refused(a.call_tool("submit", {"content": "late"}), "leased to executor:test:2")
        assert ok(b.call_tool("check"))["structuredContent"]["passed"] is True
        assert tool_json(ok(b.call_tool("heartbeat")))["status"] == "renewed"
    events = [(e["event"], e["actor"]) for e in store_a.read_journal()]
    assert ("claim", "executor:test:2") in events
    assert store_a.read_state().claimed_by == "executor:test:2"


def test_heartbeat_foreign_id(bench):
    sup, exe = executor_with_task(bench)
    before = state_of(bench.root)
    result = failed(exe.call_tool("heartbeat", {"agent_id": "executor:someone-else:9"}))
    beat = tool_json(result)
    assert beat["status"] == "error" and beat["code"] == "foreign_id"
    assert "executor:test:1" in beat["message"]
    after = state_of(bench.root)
    assert (after.rev, after.lease_until) == (before.rev, before.lease_until)


def test_heartbeat_in_awaiting_human(bench):
    sup, exe = executor_with_task(bench)
    ok(exe.call_tool("ask_human", {"question": "Blue or green?"}))
    assert state_of(bench.root).state == ferrus.S.AWAITING_HUMAN
    beat = tool_json(ok(exe.call_tool("heartbeat")))
    assert beat["status"] == "renewed" and beat["claimed_by"] == "executor:test:1"
    assert state_of(bench.root).state == ferrus.S.AWAITING_HUMAN


def test_blocked_wait_for_task_claims_when_the_foreign_lease_expires(bench):
    """A waiter blocked behind a live lease must notice when that lease runs out.

    Lease expiry commits nothing, so a waiter that only wakes on STATE.json
    changes sleeps through it and returns "timeout" although the task became
    claimable a second into its wait (real time: ttl_secs = 1)."""
    write_config(bench.root, wait=2, ttl=1)
    ferrus.op_create_task(bench.store, SUP, "abandoned task")
    a, b = bench.exe, bench.exe2
    assert tool_json(a.call_tool("wait_for_task"))["status"] == "claimed"
    started = time.monotonic()
    result = tool_json(b.call_tool("wait_for_task", timeout=20))
    elapsed = time.monotonic() - started
    assert result["status"] == "claimed", (
        "wait_for_task slept through the expiry of a 1 s lease and returned %r after "
        "%.1f s" % (result, elapsed))
    assert result["claimed_by"] == "executor:test:2"
    assert elapsed < 1.9


# ============================================================================
# Regression tests for upstream bugs
# ============================================================================

def test_upstream_bug_1_ask_human_during_consultation_keeps_the_consultation(bench):
    sup, exe = executor_with_task(bench)
    ok(exe.call_tool("consult", {"question": CONSULT_QUESTION}))
    asked = ok(exe.call_tool("ask_human", {"question": "Is a cache allowed?"}))
    assert asked["structuredContent"]["paused_state"] == "Consultation"
    # wait_for_consult keeps waiting (a timeout, not an error) while the human decides.
    write_config(bench.root, wait=0)
    assert tool_json(ok(exe.call_tool("wait_for_consult")))["state"] == "AwaitingHuman"
    answered = ok(sup.call_tool("answer", {"response": "Yes."}))
    assert answered["structuredContent"]["state"] == "Consultation"
    assert tool_json(ok(exe.call_tool("wait_for_answer")))["resumed_state"] == "Consultation"
    ok(sup.call_tool("respond_consult", {"response": "Use functools.lru_cache."}))
    done = ok(exe.call_tool("wait_for_consult"))["structuredContent"]
    assert done["status"] == "responded"
    assert done["state"] == "Executing"
    data = state_of(bench.root)
    assert data.state == ferrus.S.EXECUTING
    assert data.paused_state is None and data.consult_paused_state is None


def test_upstream_bug_1b_consultation_from_addressing_returns_to_addressing(bench):
    sup, exe = executor_with_task(bench)
    ok(exe.call_tool("submit", {"content": "v1"}))
    ok(sup.call_tool("reject", {"notes": "Redo it."}))
    assert tool_json(ok(exe.call_tool("wait_for_task")))["state"] == "Addressing"
    ok(exe.call_tool("consult", {"question": CONSULT_QUESTION}))
    ok(exe.call_tool("ask_human", {"question": "?"}))
    ok(sup.call_tool("answer", {"response": "!"}))
    ok(sup.call_tool("respond_consult", {"response": "Go ahead."}))
    assert ok(exe.call_tool("wait_for_consult"))["structuredContent"]["state"] == "Addressing"


def test_upstream_bug_2_one_answer_is_consumed_exactly_once(bench):
    write_config(bench.root, wait=0)
    sup, exe = executor_with_task(bench)
    ok(exe.call_tool("ask_human", {"question": "Tabs or spaces?"}))
    ok(sup.call_tool("answer", {"response": "Spaces."}))
    first = tool_json(ok(exe.call_tool("wait_for_answer")))
    assert first["status"] == "answered" and first["answer"] == "Spaces."
    refused(exe.call_tool("wait_for_answer"), "No question is pending")
    refused(sup.call_tool("wait_for_answer"), "No question is pending")
    store = bench.store
    assert store.read_file("ANSWER.md") == ""
    consumed = [e for e in bench.journal() if e["event"] == "consume_answer"]
    assert len(consumed) == 1 and consumed[0]["actor"] == "executor:test:1"


def test_upstream_bug_3_supervisor_has_wait_for_answer(bench):
    sup, exe = executor_with_task(bench)
    ok(exe.call_tool("submit", {"content": "done"}))
    assert tool_json(ok(sup.call_tool("wait_for_review")))["status"] == "claimed"
    names = [t["name"] for t in sup.result("tools/list")["tools"]]
    assert "wait_for_answer" in names and "ask_human" in names
    asked = ok(sup.call_tool("ask_human", {"question": "Is this license OK?"}))
    assert asked["structuredContent"]["paused_state"] == "Reviewing"
    ferrus.op_answer(bench.store, ferrus.HUMAN, "Yes, Apache-2.0 is fine.")
    got = tool_json(ok(sup.call_tool("wait_for_answer")))
    assert got == {"status": "answered", "answer": "Yes, Apache-2.0 is fine.",
                   "resumed_state": "Reviewing"}
    assert ok(sup.call_tool("approve"))["structuredContent"]["state"] == "Complete"


def test_upstream_bug_4_wait_for_consult_timeout_is_a_normal_result(bench):
    sup, exe = executor_with_task(bench)
    ok(exe.call_tool("consult", {"question": CONSULT_QUESTION}))
    write_config(bench.root, wait=0)
    result = exe.call_tool("wait_for_consult")
    assert result["isError"] is False
    assert tool_json(result) == {"status": "timeout", "state": "Consultation"}
    assert result["structuredContent"]["status"] == "timeout"
    assert state_of(bench.root).state == ferrus.S.CONSULTATION
    # Calling again after a timeout is the documented way to keep waiting.
    ok(sup.call_tool("respond_consult", {"response": "Proceed."}))
    again = ok(exe.call_tool("wait_for_consult"))
    assert again["structuredContent"]["status"] == "responded"


def test_upstream_bug_5_create_task_clears_stale_files(bench):
    store = bench.store
    for name in ferrus.TASK_SCRATCH_FILES:
        ferrus.atomic_write(store.path(name), "stale %s from an older task" % name)
    sup, exe = bench.sup, bench.exe
    ok(sup.call_tool("create_task", {"description": "fresh task"}))
    assert store.read_file("TASK.md") == "fresh task"
    for name in ("REVIEW.md", "QUESTION.md", "ANSWER.md", "SUBMISSION.md",
                 "CONSULT_REQUEST.md", "CONSULT_RESPONSE.md"):
        assert store.read_file(name) == "", name
    claimed = tool_json(ok(exe.call_tool("wait_for_task")))
    assert claimed["review"] == ""
    for uri in ("ferrus://review", "ferrus://question", "ferrus://answer"):
        assert exe.result("resources/read", {"uri": uri})["contents"][0]["text"] == ""


def test_upstream_bug_6_executor_has_no_reset(bench):
    write_config(bench.root, wait=1, max_check_retries=1, commands=["false"])
    sup, exe = executor_with_task(bench)
    assert "reset" not in [t["name"] for t in exe.result("tools/list")["tools"]]
    result = failed(exe.call_tool("check"))
    assert result["structuredContent"]["state"] == "Failed"
    error = error_of(exe.request("tools/call", {"name": "reset"}))
    assert error == {"code": -32602, "message": "Unknown tool: reset"}
    assert state_of(bench.root).state == ferrus.S.FAILED
    assert ok(sup.call_tool("reset"))["structuredContent"]["state"] == "Idle"


def test_upstream_bug_7_check_does_not_write_back_a_stale_state(bench):
    # The check command blocks until the test has moved the state on (a flag file
    # instead of `sleep 1`, so the ordering is certain).
    write_config(bench.root, wait=1, commands=["while [ ! -f go.flag ]; do sleep 0.01; done"])
    sup, exe = executor_with_task(bench, "the old task")
    store = bench.store
    logs = os.path.join(str(bench.root), ".ferrus", "logs")
    request_id = exe.start_tool("check")
    wait_until(lambda: glob.glob(os.path.join(logs, "check_1_*.1.log")), "the check to start")
    ferrus.op_force_reset(store, ferrus.HUMAN)
    created = ferrus.op_create_task(store, SUP, "the new task")
    rev = store.read_state().rev
    open(os.path.join(str(bench.root), "go.flag"), "w").close()
    result = exe.wait_response(request_id, timeout=20)["result"]
    refused(result, "The state moved", "discarded")
    data = store.read_state()
    assert data.rev == rev, "the stale check committed something"
    assert data.task_id == created.data["task_id"]
    assert data.state == ferrus.S.EXECUTING
    assert data.check_retries == 0 and data.claimed_by is None and data.failure_reason is None
    assert store.read_file("TASK.md") == "the new task"
    assert store.read_journal()[-1]["event"] == "create_task"


def test_upstream_bug_8_heartbeat_refuses_a_foreign_id(bench):
    sup, exe = executor_with_task(bench)
    two = bench.exe2
    # Executor 2 cannot keep executor 1's lease alive by naming it.
    beat = tool_json(failed(two.call_tool("heartbeat", {"agent_id": "executor:test:1"})))
    assert beat["code"] == "foreign_id"
    # Nor act on the task while that lease is live.
    refused(two.call_tool("check"), "leased to executor:test:1")
    refused(two.call_tool("submit", {"content": "not mine"}), "leased to executor:test:1")
    refused(two.call_tool("consult", {"question": CONSULT_QUESTION}), "leased to executor:test:1")
    assert state_of(bench.root).claimed_by == "executor:test:1"
    journal = bench.journal()
    assert not [e for e in journal if e["event"] == "heartbeat"]


def test_upstream_bug_9_wrong_argument_type_is_invalid_params_not_parse_error(bench):
    # Not a parse error: from 2025-11-25 on a tool error the model can correct
    # (SEP-1303); before, -32602 (test_mcp_conformance.py).
    sup, root = bench.sup, bench.root
    refused(sup.call_tool("create_task", {"description": 12345}), "must be a string")
    refused(sup.call_tool("reject", {"notes": {"text": "x"}}), "must be a string")
    assert state_of(root).state == ferrus.S.IDLE


def test_submit_is_refused_when_the_lease_was_taken_over_during_the_check(project):
    """A's submit started while A held the lease; its lease expired during the
    check run and B claimed the task.  A's result must not be committed over B's
    claim (the lease is checked before the run but not again at commit)."""
    flag = os.path.join(str(project), "go.flag")
    write_config(project, wait=0, ttl=60,
                 commands=["while [ ! -f go.flag ]; do sleep 0.01; done"])
    clock = FakeClock()
    store = ferrus.Store(str(project), clock=clock)
    a = ferrus.Caller("executor", "executor:test:1")
    b = ferrus.Caller("executor", "executor:test:2")
    ferrus.op_create_task(store, SUP, "contested task")
    assert ferrus.op_wait_for_task(store, a).data["status"] == "claimed"
    outcome = {}

    def submit():
        try:
            outcome["result"] = ferrus.op_submit(store, a, "A's work")
        except ferrus.FerrusError as err:
            outcome["error"] = err

    thread = threading.Thread(target=submit)
    thread.start()
    try:
        logs = os.path.join(str(project), ".ferrus", "logs")
        wait_until(lambda: glob.glob(os.path.join(logs, "check_1_*.1.log")), "the check")
        clock.advance(61)
        assert ferrus.op_wait_for_task(store, b).data["status"] == "claimed"
    finally:
        open(flag, "w").close()
        thread.join(20)
    data = store.read_state()
    assert "error" in outcome, (
        "A's submit was committed although B held the lease: state %s, claimed_by %s"
        % (data.state, data.claimed_by))
    assert data.state == ferrus.S.EXECUTING and data.claimed_by == "executor:test:2"


# ============================================================================
# Resources and prompts
# ============================================================================

def test_resources_list_and_read_each(bench):
    sup = bench.sup
    resources = sup.result("resources/list")["resources"]
    uris = [r["uri"] for r in resources]
    assert uris == ["ferrus://task", "ferrus://review", "ferrus://submission",
                    "ferrus://question", "ferrus://answer", "ferrus://consult_template",
                    "ferrus://spec_template", "ferrus://consult_request",
                    "ferrus://consult_response", "ferrus://state", "ferrus://events",
                    "ferrus://diff"]
    ok(sup.call_tool("create_task", {"description": "Resource task."}))
    for resource in resources:
        read = sup.result("resources/read", {"uri": resource["uri"]})
        (content,) = read["contents"]
        assert content["uri"] == resource["uri"]
        assert content["mimeType"] == resource["mimeType"]
        assert isinstance(content["text"], str)
    read = lambda uri: sup.result("resources/read", {"uri": uri})["contents"][0]["text"]
    assert read("ferrus://task") == "Resource task."
    assert json.loads(read("ferrus://state"))["state"] == "Executing"
    assert "## Problem" in read("ferrus://consult_template")
    assert "## Milestones" in read("ferrus://spec_template")
    error = error_of(sup.request("resources/read", {"uri": "ferrus://nope"}))
    assert error["code"] == -32002
    assert error_of(sup.request("resources/read", {}))["code"] == -32602
    # The modern era uses -32602 for an unknown resource and adds cache hints.
    modern = sup.request("resources/read", {"uri": "ferrus://nope", "_meta": modern_meta()})
    assert error_of(modern)["code"] == -32602
    modern = sup.result("resources/read", {"uri": "ferrus://task", "_meta": modern_meta()})
    assert modern["resultType"] == "complete" and "ttlMs" in modern


def test_events_resource_returns_recent_journal(bench):
    sup, exe = executor_with_task(bench)
    events = json.loads(sup.result("resources/read",
                                   {"uri": "ferrus://events"})["contents"][0]["text"])
    assert [e["event"] for e in events[-2:]] == ["create_task", "claim"]
    assert events[-2]["actor"] == "supervisor:test:1" and events[-1]["actor"] == "executor:test:1"
    assert events == bench.store.read_journal(limit=ferrus.EVENTS_RESOURCE_LIMIT)
    assert 0 < len(events) <= ferrus.EVENTS_RESOURCE_LIMIT


def test_log_resource_reads_a_check_log(bench):
    write_config(bench.root, wait=1, commands=["echo resource-log-marker; false"])
    sup, exe = executor_with_task(bench)
    result = failed(exe.call_tool("check"))
    assert result["structuredContent"]["passed"] is False
    logs = sorted(glob.glob(os.path.join(str(bench.root), ".ferrus", "logs", "check_1_*.1.log")))
    assert len(logs) == 1
    name = os.path.basename(logs[0])
    read = exe.result("resources/read", {"uri": "ferrus://logs/" + name})
    assert read["contents"][0]["mimeType"] == "text/plain"
    assert "resource-log-marker" in read["contents"][0]["text"]
    summary = os.path.basename(result["structuredContent"]["log"])
    text = exe.result("resources/read", {"uri": "ferrus://logs/" + summary})["contents"][0]["text"]
    assert name in text
    error = error_of(exe.request("resources/read", {"uri": "ferrus://logs/missing.log"}))
    assert error["code"] == -32002


ESCAPING_URIS = [
    "ferrus://../ferrus.toml", "ferrus://logs/../STATE.json", "ferrus://logs/..%2fSTATE.json",
    "ferrus://logs/..%2FSTATE.json", "ferrus://logs/../../ferrus.toml", "ferrus://logs/.",
    "ferrus://logs/..", "ferrus://logs/", "ferrus://logs//etc/passwd", "ferrus:///etc/passwd",
    "ferrus://task/../../ferrus.toml", "ferrus://STATE.json", "ferrus://TASK.md",
    "file:///etc/passwd", "ferrus://logs/\\..\\STATE.json", "FERRUS://task", "",
]


def test_escaping_resource_uris_are_refused(bench):
    server = bench.exe
    for uri in ESCAPING_URIS:
        response = server.request("resources/read", {"uri": uri})
        error = error_of(response)
        assert error["code"] in (-32002, -32602), uri
        text = json.dumps(response)
        assert "contents" not in text and "[checks]" not in text and "root:" not in text, uri


def test_resource_templates_list(bench):
    server = bench.any
    templates = server.result("resources/templates/list")["resourceTemplates"]
    assert {t["uriTemplate"] for t in templates} == {
        "ferrus://{file}", "ferrus://logs/{name}", "ferrus://logs/{name}{?offset,length}",
        "ferrus://diff/{+path}"}
    assert all(t["name"] for t in templates)


def test_prompts_list_get_and_unknown(bench):
    sup, exe = executor_with_task(bench, "Prompted task.")
    prompts = exe.result("prompts/list")["prompts"]
    assert [p["name"] for p in prompts] == ["executor-context", "supervisor-review"]
    got = exe.result("prompts/get", {"name": "executor-context"})
    (message,) = got["messages"]
    assert message["role"] == "user"
    assert "Prompted task." in message["content"]["text"]
    assert "Executing" in message["content"]["text"]
    review = sup.result("prompts/get", {"name": "supervisor-review"})
    assert "Prompted task." in review["messages"][0]["content"]["text"]
    for params in ({"name": "nope"}, {}, {"name": 3}):
        assert error_of(exe.request("prompts/get", params))["code"] == -32602


# ============================================================================
# Shutdown and stdout hygiene
# ============================================================================

def test_eof_exits_zero_and_stdout_is_only_json_rpc(root):
    with McpProcess(root, "--role", "supervisor") as server:
        server.initialize()
        server.result("tools/list")
        server.call_tool("create_task", {"description": "print('hello')"})
        server.call_tool("status")
        server.result("resources/read", {"uri": "ferrus://events"})
        server.request("nope")
        server.send(b"garbage\n")
        server.wait_response(None)
        assert server.close() == 0
        assert server.bad_lines == []
        assert server.lines, "nothing on stdout"
        for raw in server.lines:
            message = json.loads(raw.decode("utf-8"))
            assert message["jsonrpc"] == "2.0"
            # An error to an unreadable message has no id from 2025-11-25 on.
            is_response = ("id" in message or "error" in message) and (
                "result" in message or "error" in message)
            is_notification = "id" not in message and isinstance(message.get("method"), str)
            assert is_response or is_notification, message
        assert len(server.all_responses) == 7


def test_request_in_flight_when_stdin_closes_still_gets_its_response(root):
    """A client that sends a request and then closes stdin (a half-close, e.g.
    `printf ... | ferrus serve`) must still get the answer to what the server
    executed.  Today the EOF shutdown marks every in-flight call cancelled, so the
    response is dropped although the task was created."""
    store = ferrus.Store(str(root))
    with McpProcess(root, "--role", "supervisor") as server:
        server.initialize()
        with store.lock():       # hold the state lock so the call is still running at EOF
            request_id = server.start_tool("create_task", {"description": "piped"})
            server.result("ping")
            server.close_stdin()
            time.sleep(0.3)
        assert server.proc.wait(10) == 0
        server._reader.join(5)
        assert store.read_state().state == ferrus.S.EXECUTING   # the call did run
        assert server.has_response(request_id), "create_task ran but its response was dropped"


def test_lone_surrogate_in_a_request_is_answered_in_valid_utf8(root):
    """JSON allows the escape \\ud800; the server must not echo it back as
    invalid UTF-8 bytes (surrogatepass), or strict clients lose the message."""
    with McpProcess(root) as server:
        server.initialize()
        server.send(b'{"jsonrpc":"2.0","id":5,"method":"no/such\\ud800method"}\n')
        server.send(b'{"jsonrpc":"2.0","id":6,"method":"resources/read",'
                    b'"params":{"uri":"ferrus://\\udfff"}}\n')
        assert server.result("ping") == {}
        assert server.bad_lines == [], "undecodable stdout lines: %r" % server.bad_lines
        assert error_of(server.wait_response(5))["code"] == -32601
        assert error_of(server.wait_response(6))["code"] == -32002
