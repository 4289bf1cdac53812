#!/usr/bin/env python3
"""A stand-in agent CLI for pipeline tests: one pipeline worker.

It reads its prompt on stdin, as ferrus sends it to a `prompt = "stdin"` custom
agent, finds the output path and the input files in it, reads the inputs and
writes the output (atomically, as the worker contract asks), then exits.
The environment steers it:

  WORKER_LOG          append "<role> spawned" to this file on every start
  WORKER_FAIL         comma-separated roles that exit 1 without writing
  WORKER_FAIL_ONCE    roles that fail like that on their first start only (needs WORKER_LOG)
  WORKER_SILENT       roles that exit 0 without writing
  WORKER_SLOW         roles that sleep 30 s first
  WORKER_DELAY        seconds every worker sleeps before writing (e.g. 0.5)
  WORKER_USAGE        after writing, wait this many seconds, then print a result event
                      as Claude Code's stream-json does (1000 tokens in, 200 out, $0.05)
"""

import json
import os
import re
import sys
import time


def roles(name):
    return set(filter(None, os.environ.get(name, "").split(",")))


def main():
    prompt = sys.stdin.read()
    match = re.search(r"^Write your complete result to exactly this file: (.+)$", prompt, re.M)
    if not match:
        print("no output path in the prompt:\n" + prompt)
        return 2
    output = match.group(1).strip()
    role = os.path.basename(output)[:-len(".md")]
    topic = re.search(r"^Topic: (.*)$", prompt, re.M).group(1)
    reads = re.findall(r"^- (.+)$", prompt, re.M)
    log = os.environ.get("WORKER_LOG")
    earlier = 0
    if log:
        with open(log, "a+", encoding="utf-8") as handle:
            handle.seek(0)
            earlier = handle.read().splitlines().count("%s spawned" % role)
            handle.write("%s spawned\n" % role)
    print("worker %s started (pid %d)" % (role, os.getpid()), flush=True)
    if role in roles("WORKER_SLOW"):
        time.sleep(30)
    time.sleep(float(os.environ.get("WORKER_DELAY", "0") or 0))
    if role in roles("WORKER_FAIL") or (role in roles("WORKER_FAIL_ONCE") and not earlier):
        print("failing on purpose", flush=True)
        return 1
    if role in roles("WORKER_SILENT"):
        return 0
    parts = ["# %s\n\nTopic: %s\n" % (role, topic)]
    for path in reads:
        with open(path, encoding="utf-8") as handle:
            parts.append("## from %s\n\n%s" % (os.path.basename(path), handle.read()))
    temp = output + ".tmp"
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write("\n".join(parts))
    os.replace(temp, output)
    print("wrote %s" % output, flush=True)
    if os.environ.get("WORKER_USAGE"):
        time.sleep(float(os.environ["WORKER_USAGE"]))
        print(json.dumps({"type": "result", "subtype": "success", "result": "done",
                          "total_cost_usd": 0.05,
                          "usage": {"input_tokens": 1000, "output_tokens": 200}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
