#!/usr/bin/env python3
"""nano's own time per model turn, beside the model's (bar: ≤ 5 ms).

    python bench/nano.py                 the table
    python bench/nano.py --turns 400     a longer session
    python bench/nano.py --json          the figures as JSON

nano (the built-in agent) runs one session in this process against an instant
scripted chat-completions server on 127.0.0.1: every answer is prepared before the
session starts, so the server only reads the request and writes bytes back, and the
time it spends doing that is measured inside it and subtracted.  Each turn the model
calls nano's read_file on a small file, until the last turn stops.  What remains per
turn is nano's own work: building the request from the growing conversation, the HTTP
round trip over loopback on a kept-alive connection, folding the streamed answer,
checking and running the tool call, printing its stream-json events (to a null
stream), budgets and the context estimate.  The median of the turns and the mean
(total time less the server's, over the turns) are reported, for the first 50 turns
and for the whole session (the conversation grows with it).

`make bench` (bench/run.py) shows the same figure as its `nano_turn` row, through
measure_turns below.  Standard library only; CPython 3.9+.
"""

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAR_MS = 5.0


def load_ferrus():
    sys.path.insert(0, ROOT)
    import ferrus
    return ferrus


def sse(data):
    return ("data: %s\n\n" % json.dumps(data)).encode()


def answer(call_id, stop=False):
    """A streamed chat completion: a read_file call, or the final words."""
    base = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    if stop:
        delta, finish = {"role": "assistant", "content": "Done."}, "stop"
    else:
        delta, finish = {"role": "assistant", "tool_calls": [{
            "index": 0, "id": call_id, "type": "function", "function": {
                "name": "read_file", "arguments": json.dumps({"path": "small.txt"})}}]}, \
            "tool_calls"
    return b"".join([sse(dict(base, choices=[{"index": 0, "delta": delta,
                                               "finish_reason": None}])),
                     sse(dict(base, choices=[{"index": 0, "delta": {},
                                              "finish_reason": finish}])),
                     sse(dict(base, choices=[], usage={"prompt_tokens": 1000,
                                                       "completion_tokens": 20})),
                     b"data: [DONE]\n\n"])


class InstantServer:
    """Prepared answers, served in order; records when each request arrived and how
    long the server itself took with it."""

    def __init__(self, turns):
        self.answers = [answer("call_%d" % i) for i in range(turns - 1)] + [answer("", True)]
        self.arrivals = []
        self.handling = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                started = time.perf_counter()
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                data = server.answers[len(server.arrivals)]
                server.arrivals.append(started)
                # One write: headers and body apart would wait for the client's delayed ACK.
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                self.wfile.flush()
                server.handling.append(time.perf_counter() - started)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d/v1" % self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def session(ferrus, turns, workdir):
    """One nano session of ``turns`` turns; (per-turn own times in s, total own time)."""
    server = InstantServer(turns)
    try:
        settings = ferrus.NanoSettings(base_url=server.url, model="m", context_tokens=1 << 22,
                                       max_tokens=4096, max_session_tokens=1 << 40,
                                       max_tool_calls=turns + 1)
        client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "m", settings)
        toolbox = ferrus.NanoToolbox(ferrus.NanoFileTools(workdir, "edit"))
        agent = ferrus.NanoAgent(client, toolbox, settings,
                                 ferrus.NanoStreamOutput(io.StringIO(), "s-bench", "m"),
                                 workdir=workdir)
        started = time.perf_counter()
        outcome = agent.run("Read small.txt again and again.")
        ended = time.perf_counter()
        client.close()
    finally:
        server.close()
    if outcome.exit_code != 0 or len(server.arrivals) != turns:
        raise SystemExit("bench/nano.py: the session failed: %s" % outcome.text)
    marks = [started] + server.arrivals
    own = [marks[i + 1] - marks[i] - (server.handling[i - 1] if i else 0)
           for i in range(turns)]
    return own, (ended - started) - sum(server.handling)


def measure_turns(ferrus, turns):
    """A warm-up session, then one of ``turns`` turns (at least 60): the rows
    [(figure, milliseconds)] — the first 50 turns' median, all turns' median and mean."""
    with tempfile.TemporaryDirectory() as workdir:
        with open(os.path.join(workdir, "small.txt"), "w") as handle:
            handle.write("".join("line %d\n" % i for i in range(20)))
        session(ferrus, 20, workdir)                       # warm-up
        own, total = session(ferrus, max(60, turns), workdir)
    return [("first 50 turns, median", statistics.median(own[:50]) * 1000),
            ("all %d turns, median" % len(own), statistics.median(own) * 1000),
            ("all %d turns, mean" % len(own), total / len(own) * 1000)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=200, help="turns in the session")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    rows = measure_turns(load_ferrus(), args.turns)
    turns = max(60, args.turns)
    if args.json:
        print(json.dumps({"bar_ms": BAR_MS, "turns": turns,
                          "rows": [{"figure": name, "ms": round(ms, 3)}
                                   for name, ms in rows]}, indent=2))
        return 0
    print("nano: own time per model turn (instant scripted server, python %s, %d CPUs)"
          % (sys.version.split()[0], os.cpu_count() or 0))
    print("%-28s %10s %8s  %s" % ("figure", "measured", "bar", "verdict"))
    for name, ms in rows:
        print("%-28s %7.2f ms %5.1f ms  %s" % (name, ms, BAR_MS,
                                               "PASS" if ms <= BAR_MS else "MISS"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
