"""Real MCP clients against `ferrus serve`: the official MCP Python SDK and Claude Code.

These run when the tools are available (.ci/run installs them into a cache) and
skip, saying why, when they are not:
- FERRUS_MCP_SDK_PYTHON: a Python with the `mcp` package installed;
- the `claude` CLI on PATH or in $FERRUS_AGENT_BIN.
"""

import json
import os
import subprocess
import sys

import pytest

import ferrus
from conftest import FERRUS_PY
from fake_anthropic import find_agent

pytestmark = pytest.mark.e2e

SDK_SCRIPT = r'''
import asyncio, json, sys
from mcp import Client, StdioServerParameters

ferrus_py, root, mode = sys.argv[1], sys.argv[2], sys.argv[3]

async def session(role):
    params = StdioServerParameters(command=sys.argv[4], cwd=root, args=[
        ferrus_py, "serve", "--role", role, "--agent-name", "sdk", "--agent-index", "1"])
    return Client(params, mode=mode, raise_exceptions=True)

async def main():
    report = {}
    async with await session("supervisor") as sup:
        report["version"] = sup.protocol_version
        report["supervisor_tools"] = [t.name for t in (await sup.list_tools()).tools]
        created = await sup.call_tool("create_task", {"description": "from the SDK"})
        report["create_task"] = [created.is_error, created.content[0].text]
        state = await sup.read_resource("ferrus://state")
        report["state"] = json.loads(state.contents[0].text)["state"]
        report["prompts"] = [p.name for p in (await sup.list_prompts()).prompts]
    async with await session("executor") as exe:
        report["executor_tools"] = [t.name for t in (await exe.list_tools()).tools]
        claimed = await exe.call_tool("wait_for_task", {})
        report["claimed"] = claimed.structured_content
        submitted = await exe.call_tool("submit", {"content": "done"})
        report["submit"] = [submitted.is_error, submitted.structured_content["state"]]
        wrong = await exe.call_tool("check", {})
        report["check_in_reviewing"] = [wrong.is_error, wrong.content[0].text]
    print(json.dumps(report))

asyncio.run(main())
'''


def sdk_python():
    python = os.environ.get("FERRUS_MCP_SDK_PYTHON")
    if not python:
        pytest.skip("FERRUS_MCP_SDK_PYTHON is not set (.ci/run installs the MCP SDK and sets it)")
    if subprocess.run([python, "-c", "import mcp"], capture_output=True).returncode != 0:
        pytest.skip("%s cannot import mcp" % python)
    return python


@pytest.mark.parametrize("mode,version", [("legacy", "2025-11-25"), ("auto", "2026-07-28"),
                                          ("2026-07-28", "2026-07-28")])
def test_official_sdk_client_lists_and_calls_tools(project, tmp_path, mode, version):
    python = sdk_python()
    script = tmp_path / "sdk_client.py"
    script.write_text(SDK_SCRIPT)
    result = subprocess.run([python, str(script), FERRUS_PY, str(project), mode, sys.executable],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["version"] == version
    assert report["supervisor_tools"] == [t.name for t in ferrus.tools_for_role("supervisor")]
    assert report["executor_tools"] == [t.name for t in ferrus.tools_for_role("executor")]
    assert report["create_task"] == [False, "Task created. State: Executing. The Executor can "
                                            "now call /wait_for_task."]
    assert report["state"] == "Executing"
    assert report["prompts"] == ["executor-context", "supervisor-review"]
    assert report["claimed"]["status"] == "claimed"
    assert report["claimed"]["claimed_by"] == "executor:sdk:1"
    assert report["submit"] == [False, "Reviewing"]
    assert report["check_in_reviewing"][0] is True
    assert "Cannot run checks from state Reviewing" in report["check_in_reviewing"][1]


def test_claude_mcp_list_shows_ferrus_connected(project, tmp_path):
    claude = find_agent("claude")
    if not claude:
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code; "
                    ".ci/run does it and sets FERRUS_AGENT_BIN)")
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1",
               DISABLE_AUTOUPDATER="1")
    entry = {"type": "stdio", "command": sys.executable,
             "args": [FERRUS_PY, "serve", "--role", "executor", "--agent-name", "claude-code",
                      "--agent-index", "1"]}
    added = subprocess.run([claude, "mcp", "add-json", "-s", "local", "ferrus-executor-1",
                            json.dumps(entry)], cwd=str(project), env=env, capture_output=True,
                           text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    listed = subprocess.run([claude, "mcp", "list"], cwd=str(project), env=env,
                            capture_output=True, text=True, timeout=120)
    line = [l for l in listed.stdout.splitlines() if l.startswith("ferrus-executor-1:")]
    assert line, listed.stdout + listed.stderr
    assert "Connected" in line[0] and "Failed" not in line[0], line[0]
