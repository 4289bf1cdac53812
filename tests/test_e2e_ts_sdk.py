"""The official TypeScript SDK client (npm @modelcontextprotocol/sdk) against `ferrus serve`.

The SDK parses every message with its own schemas and checks each tool's
structuredContent against the outputSchema from tools/list, so this is a
conformance check written by someone else.  It drives the whole task flow over
stdio: create, claim (with progress while it waits), check, submit, reject,
address, submit, approve.

Runs when node and the SDK are available, skips saying why otherwise:
- FERRUS_TS_SDK_DIR: a folder with node_modules/@modelcontextprotocol/sdk, or
- $FERRUS_CI_CACHE/ts-sdk (default ~/.cache/ferrus-ci/ts-sdk), where .ci/run
  installs it (`npm install @modelcontextprotocol/sdk`).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import FERRUS_PY, set_config

pytestmark = pytest.mark.e2e

CLIENT_SCRIPT = r'''
import { isDeepStrictEqual } from "node:util";
const [sdkDir, python, ferrusPy, root] = process.argv.slice(2);
const { Client } = await import(sdkDir + "/dist/esm/client/index.js");
const { StdioClientTransport } = await import(sdkDir + "/dist/esm/client/stdio.js");

async function connect(role) {
  const transport = new StdioClientTransport({
    command: python, cwd: root, stderr: "inherit",
    args: [ferrusPy, "serve", "--role", role, "--agent-name", "ts", "--agent-index", "1"],
  });
  const client = new Client({ name: "ferrus-ts-e2e", version: "1.0.0" });
  await client.connect(transport);
  return client;
}

const text = (result) => result.content.filter((c) => c.type === "text").map((c) => c.text);
const report = {};
const sup = await connect("supervisor");
const exe = await connect("executor");
report.server = sup.getServerVersion();
report.instructions = sup.getInstructions();
report.supervisorTools = (await sup.listTools()).tools.map((t) => t.name);
report.executorTools = (await exe.listTools()).tools.map((t) => t.name);
report.ping = await exe.ping();
await exe.setLoggingLevel("warning");
report.templates = (await sup.listResourceTemplates()).resourceTemplates.map((t) => t.uriTemplate);
report.prompts = (await sup.listPrompts()).prompts.map((p) => p.name);

// The executor waits first; the progress notifications reach onprogress.
// The task is created only once the first progress notification has arrived
// (ferrus sends one every few seconds while a wait blocks).
const progress = [];
let firstProgress;
const progressed = new Promise((resolve) => { firstProgress = resolve; });
const waiting = exe.callTool({ name: "wait_for_task", arguments: {} }, undefined,
  { onprogress: (p) => { progress.push(p); firstProgress(); }, timeout: 60000 });
await progressed;
const created = await sup.callTool({ name: "create_task",
  arguments: { description: "Add a TypeScript greeting." } });
report.created = [created.isError, created.structuredContent.state];
const claimed = await waiting;
report.claimed = claimed.structuredContent;
report.progressSeen = progress.length;

report.badArguments = await exe.callTool({ name: "submit", arguments: { content: 5 } });
report.heartbeat = (await exe.callTool({ name: "heartbeat", arguments: {} })).structuredContent;
report.check = (await exe.callTool({ name: "check", arguments: {} })).structuredContent;
report.submit1 = (await exe.callTool({ name: "submit",
  arguments: { content: "First try." } })).structuredContent;
const review = await sup.callTool({ name: "wait_for_review", arguments: {} });
report.review = review.structuredContent;
report.reject = (await sup.callTool({ name: "reject",
  arguments: { notes: "Say hello politely." } })).structuredContent;
report.readdress = (await exe.callTool({ name: "wait_for_task", arguments: {} })).structuredContent;
report.submit2 = (await exe.callTool({ name: "submit",
  arguments: { content: "Polite now." } })).structuredContent;
await sup.callTool({ name: "wait_for_review", arguments: {} });
report.approve = (await sup.callTool({ name: "approve", arguments: {} })).structuredContent;
report.status = (await sup.callTool({ name: "status", arguments: {} })).structuredContent;
const state = await sup.readResource({ uri: "ferrus://state" });
report.stateResource = JSON.parse(state.contents[0].text).state;
const prompt = await exe.getPrompt({ name: "executor-context" });
report.prompt = prompt.messages[0].content.text;
try {
  await sup.readResource({ uri: "ferrus://nothing-here" });
  report.missingResource = "no error";
} catch (err) {
  report.missingResource = err.code;
}
report.mirrored = text(created).some((t) => {
  try { return isDeepStrictEqual(JSON.parse(t), created.structuredContent); }
  catch { return false; }
});
await sup.close();
await exe.close();
console.log(JSON.stringify(report));
'''


def ts_sdk_dir():
    if not shutil.which("node"):
        pytest.skip("node is not on PATH (the TypeScript SDK client needs it)")
    candidates = []
    if os.environ.get("FERRUS_TS_SDK_DIR"):
        candidates.append(os.environ["FERRUS_TS_SDK_DIR"])
    cache = os.environ.get("FERRUS_CI_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "ferrus-ci")
    candidates.append(os.path.join(cache, "ts-sdk"))
    for folder in candidates:
        sdk = os.path.join(folder, "node_modules", "@modelcontextprotocol", "sdk")
        if os.path.isfile(os.path.join(sdk, "dist", "esm", "client", "index.js")):
            return sdk
    pytest.skip("the TypeScript MCP SDK is not installed in %s (.ci/run installs it: npm "
                "install @modelcontextprotocol/sdk there, or set FERRUS_TS_SDK_DIR)"
                % " or ".join(candidates))


def test_official_typescript_sdk_client_runs_the_full_task_flow(project, tmp_path):
    sdk = ts_sdk_dir()
    set_config(project, '[checks]\ncommands = ["%s -c pass"]\n\n[limits]\n'
               'wait_timeout_secs = 30\n' % sys.executable.replace("\\", "/"))
    script = tmp_path / "client.mjs"
    script.write_text(CLIENT_SCRIPT)
    completed = subprocess.run(["node", str(script), sdk, sys.executable, FERRUS_PY,
                                str(project)], capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["server"]["name"] == "ferrus"
    assert "wait_for_task" in report["executorTools"] and "approve" in report["supervisorTools"]
    assert "reset" not in report["executorTools"]
    assert report["ping"] == {}
    assert "ferrus://logs/{name}{?offset,length}" in report["templates"]
    assert report["prompts"] == ["executor-context", "supervisor-review"]
    assert report["created"] == [False, "Executing"]
    assert report["claimed"]["status"] == "claimed"
    assert report["claimed"]["claimed_by"] == "executor:ts:1"
    assert report["progressSeen"] >= 1
    bad = report["badArguments"]
    assert bad["isError"] is True and "must be a string" in bad["content"][0]["text"]
    assert report["heartbeat"]["status"] == "renewed"
    assert report["check"]["passed"] is True
    assert report["submit1"]["state"] == "Reviewing"
    assert report["review"]["status"] == "claimed"
    assert report["reject"]["state"] == "Addressing"
    assert report["readdress"]["status"] == "claimed"
    assert "Say hello politely." in report["readdress"]["review"]
    assert report["submit2"]["state"] == "Reviewing"
    assert report["approve"]["state"] == "Complete"
    assert report["status"]["state"] == "Complete"
    assert report["stateResource"] == "Complete"
    assert "TypeScript greeting" in report["prompt"]
    assert report["missingResource"] == -32002
    assert report["mirrored"] is True
    assert "Traceback" not in completed.stderr
