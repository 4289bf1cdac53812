#!/usr/bin/env python3
"""A stand-in agent CLI for HQ and `ferrus run` tests.

It behaves like a real agent would: it reads its prompt on stdin, starts the
ferrus MCP server named in its MCP config file ({mcp_config}), and calls the
tools its prompt asks for.  What it decides is steered by the environment:

  SCRIPTED_BEHAVIOR  comma-separated: reject-once, consult, ask, crash-executor,
                     crash-reviewer, silent-executor, slow-executor, give-up-once (the
                     first executor session prints, as Claude Code's stream-json does, a
                     shell call that fails and a last message, and exits 0 without
                     submitting), usage (report
                     tool calls, tokens and cost as Claude Code's stream-json does:
                     each tool call an assistant event worth 100 tokens in and 10 out,
                     printed twice as Claude repeats a message per block, and a final
                     result event with the totals and $0.001 per call)
  SCRIPTED_DIR       a directory for its memory between sessions (flag files)
  SCRIPTED_QUESTION  the question `ask` sends (default: a question about a colour)

The executor writes work.txt, or, when the task has lines `WRITE <file>: <text>`, those
files; review notes that say `git rebase BRANCH` (or `git merge BRANCH`) make it do that
first, its own side winning each conflict.  A hostile executor is played by task lines
`SHELL <command>` (run in its worktree before it checks and submits: anything its edit
rights allow), `EXIT-WITHOUT-SUBMIT` (the session ends after the SHELL lines, exit 0)
and `AFTER-SUBMIT <command>` (left running after it submitted, as a process an agent
forgot: it runs half a second later).

Usage: scripted_agent.py ROLE MCP_CONFIG
"""

import json
import os
import re
import subprocess
import sys
import time


class Mcp:
    def __init__(self, command, args, report_usage=False):
        self.proc = subprocess.Popen([command] + args, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self.next_id = 0
        self.report_usage = report_usage
        self.calls = 0
        self.request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                    "clientInfo": {"name": "scripted-agent", "version": "1"}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def send(self, message):
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def request(self, method, params):
        self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        while True:
            message = json.loads(self.proc.stdout.readline())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise SystemExit("protocol error: %s" % message["error"])
                return message["result"]

    def call(self, name, **arguments):
        self.calls += 1
        if self.report_usage:
            event = {"type": "assistant", "message": {
                "id": "msg_%d" % self.calls, "content": [{"type": "tool_use", "name": name}],
                "usage": {"input_tokens": 100, "output_tokens": 10}}}
            print(json.dumps(event), flush=True)
            event["message"]["content"] = [{"type": "text", "text": "calling %s" % name}]
            print(json.dumps(event), flush=True)
        result = self.request("tools/call", {"name": name, "arguments": arguments})
        text = result["content"][0]["text"]
        print("tool %s -> %s" % (name, text[:200].replace("\n", " ")), flush=True)
        return result.get("structuredContent") or {}, text, result["isError"]

    def wait(self, name, done):
        while True:
            data, text, error = self.call(name)
            if error:
                raise SystemExit("%s failed: %s" % (name, text))
            if done(data):
                return data

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(10)
        if self.report_usage:
            print(json.dumps({"type": "result", "subtype": "success", "result": "done",
                              "total_cost_usd": 0.001 * self.calls,
                              "usage": {"input_tokens": 100 * self.calls - 50,
                                        "cache_read_input_tokens": 50,
                                        "output_tokens": 10 * self.calls}}), flush=True)


# What the executor prints when it gives up (Claude Code's stream-json event shapes).
GIVE_UP = (
    {"type": "assistant", "message": {"content": [
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "make test"}}]}},
    {"type": "user", "message": {"content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
         "content": "Exit code 2\nmake: *** No rule to make target 'test'.  Stop."}]}},
    {"type": "assistant", "message": {"content": [
        {"type": "text", "text": "I cannot finish this: the project has no test target, so "
                                 "I stop here."}]}},
)


def flag(name):
    return os.path.join(os.environ.get("SCRIPTED_DIR", "."), name)


def once(name):
    """True the first time a flag is asked for, False afterwards."""
    path = flag(name)
    if os.path.exists(path):
        return False
    open(path, "w").close()
    return True


def main():
    role, config_path = sys.argv[1], sys.argv[2]
    prompt = sys.stdin.read()
    behavior = set(filter(None, os.environ.get("SCRIPTED_BEHAVIOR", "").split(",")))
    mode = ("reviewer" if "REVIEW mode" in prompt else
            "consultant" if "CONSULTATION mode" in prompt else role)
    print("scripted agent: role %s, mode %s, behavior %s" % (role, mode, sorted(behavior)),
          flush=True)
    if os.path.isdir(os.environ.get("SCRIPTED_DIR", "")):
        with open(flag("cwd-" + mode), "a") as handle:     # where each session started
            handle.write(os.getcwd() + "\n")
    if "crash-" + mode in behavior:
        print("crashing on purpose", flush=True)
        return 3
    if "silent-" + mode in behavior:
        return 0
    if mode == "executor" and "give-up-once" in behavior and once("gave-up"):
        for event in GIVE_UP:
            print(json.dumps(event), flush=True)
        return 0
    with open(config_path) as handle:
        server = list(json.load(handle)["mcpServers"].values())[0]
    if "usage" in behavior:
        print(json.dumps({"type": "system", "subtype": "init", "session_id": "scripted-1",
                          "model": "scripted-model"}), flush=True)
    mcp = Mcp(server["command"], server["args"], report_usage="usage" in behavior)
    try:
        if mode == "reviewer":
            mcp.wait("wait_for_review", lambda d: d.get("status") == "claimed")
            if "reject-once" in behavior and once("rejected"):
                mcp.call("reject", notes="Please also add a README line.")
            else:
                mcp.call("approve")
        elif mode == "consultant":
            mcp.call("respond_consult", response="Use option A.")
        else:
            if "consultation is still open" in prompt:
                mcp.wait("wait_for_consult", lambda d: d.get("status") == "responded")
            elif "/wait_for_answer" in prompt.split("\n\n")[1] if "\n\n" in prompt else False:
                mcp.wait("wait_for_answer", lambda d: d.get("status") == "answered")
            claimed = mcp.wait("wait_for_task", lambda d: d.get("status") == "claimed")
            if claimed.get("review"):       # the review notes this session was given
                with open(flag("reviews-seen"), "a") as handle:
                    handle.write(claimed["review"] + "\n")
            if "consult" in behavior and once("consulted"):
                mcp.call("consult", question="## Problem\nx\n## What I tried\ny\n"
                                             "## Options (if any)\nA or B\n## Question\nWhich?")
                mcp.wait("wait_for_consult", lambda d: d.get("status") == "responded")
            if "ask" in behavior and once("asked"):
                mcp.call("ask_human", question=os.environ.get(
                    "SCRIPTED_QUESTION", "Which colour should the button be?"))
                answer = mcp.wait("wait_for_answer", lambda d: d.get("status") == "answered")
                with open("answer.txt", "w") as handle:
                    handle.write(answer["answer"])
            if "slow-executor" in behavior:
                time.sleep(30)
            update = re.search(r"`git (rebase|merge) ([^`\s]+)`", claimed.get("review") or "")
            if update:
                # Told to bring its branch up to date with the target: do it, this side
                # winning every conflict (a parallel task's scripted resolution).
                command = ["git", "rebase", "-X", "theirs", update.group(2)] \
                    if update.group(1) == "rebase" else \
                    ["git", "merge", "-X", "ours", "--no-edit", update.group(2)]
                subprocess.run(command, check=True, stdout=sys.stderr)
            writes = re.findall(r"^WRITE ([^:\n]+): (.*)$", claimed.get("task") or "", re.M)
            for name, text in writes:
                # A task that says what to write, file by file (parallel tasks each
                # change their own files).
                with open(name, "w") as handle:
                    handle.write(text + "\n")
            if not writes:
                with open("work.txt", "a") as handle:
                    handle.write("work\n")
            for command in re.findall(r"^SHELL (.+)$", claimed.get("task") or "", re.M):
                subprocess.run(["sh", "-c", command], stdout=sys.stderr, stderr=sys.stderr)
            if re.search(r"^EXIT-WITHOUT-SUBMIT$", claimed.get("task") or "", re.M):
                return 0
            mcp.call("check")
            mcp.call("submit", content="Did the work.")
            for command in re.findall(r"^AFTER-SUBMIT (.+)$", claimed.get("task") or "", re.M):
                subprocess.Popen(["sh", "-c", "sleep 0.5; " + command], start_new_session=True,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        mcp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
