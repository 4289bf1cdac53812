"""Seeded fuzzing of `ferrus serve` over real pipes.

Two long-lived servers (``--role supervisor`` and ``--role executor``) share one
initialised project.  A seeded generator streams JSON-RPC traffic at them:
valid requests for every method and every tool (tools outside the role and
tools that do not exist included), modern-era requests with ``_meta``, and then
mutations of all of it — truncated lines, deep nesting, wrong types for every
field, huge strings, invalid UTF-8, lone surrogate escapes, random bytes, empty
lines, batches, notifications, ``notifications/cancelled`` for in-flight and
unknown ids, and duplicate ids.

What must hold (checked per batch, so a long run keeps only one batch of
bookkeeping in memory and nothing is restarted):

* every request with a valid id (a string or an integer, not a bool) gets
  exactly one response carrying that id — a request cancelled while in flight
  gets zero or one;
* input that cannot be parsed (or is not a request at all) is answered with
  an error without a usable id (``"id": null``, or no id from 2025-11-25 on) — exactly as many such responses as the oracle expects, and
  never one for a notification or for a response-shaped message;
* every stdout line is one UTF-8 JSON-RPC 2.0 message; no response is the
  generic ``Internal error: <exception>`` (that is an uncaught exception);
* the servers never die: each answers a final ``ping`` and exits 0 on EOF, and
  stderr holds no traceback;
* afterwards ``.ferrus/STATE.json`` parses and ``doctor_findings`` reports no
  errors.

Environment:

    FERRUS_FUZZ_N      cases after the fixed prelude (default 300; `make fuzz N=...`)
    FERRUS_FUZZ_SEED   the seed (default fixed); every failure message repeats it
    FERRUS_FUZZ_BATCH  cases per batch (default 64)
    FERRUS_FUZZ_SKIP   comma-separated mutation kinds to leave out, to look past a
                       known bug (kinds: deep, huge, surrogate, utf8, random, batch,
                       truncate, wrongtype, cancel, duplicate)

The oracle that says which responses a line deserves (``classify``) follows
JSON-RPC 2.0 and MCP, using Python's json module as the reference parser.
"""

import collections
import contextlib
import json
import os
import random
import subprocess
import tempfile
import threading
import time

import pytest

import ferrus
from conftest import FERRUS_CMD, set_config

SEED = int(os.environ.get("FERRUS_FUZZ_SEED") or 20261123)
CASES = int(os.environ.get("FERRUS_FUZZ_N") or 300)
BATCH = max(1, int(os.environ.get("FERRUS_FUZZ_BATCH") or 64))
SKIP = frozenset(k.strip() for k in os.environ.get("FERRUS_FUZZ_SKIP", "").split(",") if k.strip())

REPRO = "reproduce with FERRUS_FUZZ_SEED=%d FERRUS_FUZZ_N=%d%s" % (
    SEED, CASES, (" FERRUS_FUZZ_SKIP=" + ",".join(sorted(SKIP))) if SKIP else "")

MODERN = "2026-07-28"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPS = "io.modelcontextprotocol/clientCapabilities"
LEGACY = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
TOOL_PARAMS = {tool.name: [(p.name, p.type, p.required) for p in tool.params]
               for tool in ferrus.TOOLS}
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
CONSULT = ("## Problem\nslow\n\n## What I tried\nthings\n\n## Options (if any)\nnone\n\n"
           "## Question\nnow what?\n")

# What a line deserves.  ("id", key) and ("flex", key) are built per request.
NONE, NULL, MAYBE_NULL = "none", "null", "maybe-null"

FUZZ_CONFIG = """\
[checks]
commands = []

[limits]
wait_timeout_secs = 0
max_review_cycles = 3
max_check_retries = 5

[lease]
ttl_secs = 2
heartbeat_interval_secs = 1
"""


def id_key(value):
    # 1 and "1" are different ids.
    return (type(value).__name__, value)


def valid_id(value):
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def classify(raw):
    """The responses JSON-RPC 2.0 (as MCP uses it) calls for, for one input line."""
    line = raw.rstrip(b"\n")
    if not line.strip():
        return NONE
    try:
        message = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return NULL                      # parse error, id null
    if isinstance(message, list):
        return NULL                      # batches are not supported: one error, id null
    if not isinstance(message, dict):
        return NULL                      # not a request object
    has_id = "id" in message
    method = message.get("method")
    if message.get("jsonrpc") != "2.0":
        if has_id and valid_id(message["id"]):
            return ("id", id_key(message["id"]))
        return NULL if has_id else MAYBE_NULL
    if method is None and ("result" in message or "error" in message):
        return NONE                      # a response: never answered
    if not has_id:
        return NONE if isinstance(method, str) else MAYBE_NULL
    if not valid_id(message["id"]):
        return NULL
    return ("id", id_key(message["id"]))


def encode(message):
    """One line of JSON: UTF-8 as is, lone surrogates as \\udXXX escapes."""
    try:
        return (json.dumps(message, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(message) + "\n").encode("ascii")


def _reject_constant(name):
    raise ValueError("%s is not JSON" % name)


def _short(data, limit=300):
    """A bounded repr (lines sent may be megabytes long)."""
    if isinstance(data, (bytes, str)) and len(data) > limit:
        return repr(data[:limit]) + "...(%d long)" % len(data)
    text = repr(data)
    return text if len(text) <= limit else text[:limit] + "..."


# ============================================================================
# The client side: one server process, streaming, bounded bookkeeping
# ============================================================================

class Peer:
    """`ferrus serve ARGS` with a reader thread that checks every stdout line."""

    LATE_TTL = 30.0

    def __init__(self, root, name, args):
        self.name = name
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ)
        env.pop("FERRUS_DEBUG", None)
        env["NO_COLOR"] = "1"
        self.proc = subprocess.Popen(FERRUS_CMD + ["serve"] + list(args),
                                     cwd=str(root), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env=env)
        self.cond = threading.Condition()
        self.eof = False
        self.lines = 0
        self.nulls = 0
        self.null_mark = 0
        self.sentinel = None
        self.sentinel_nulls = None
        self.outstanding = {}      # key -> [sent, got, cancels, flex]
        self.late = {}             # key -> [allowed, cancels, expires]: cancelled, finalized
        self.violations = []
        self.violation_count = 0
        self.recent = collections.deque(maxlen=12)   # recently sent lines, shortened
        self.batch_null = 0
        self.batch_maybe = 0
        self.batch_keys = set()
        self.last_counter_key = None
        self.sentinels = 0
        self._reader = threading.Thread(target=self._read, daemon=True, name="fuzz-" + name)
        self._reader.start()

    # -- reading ------------------------------------------------------------------------

    def violation(self, text):
        # Called with self.cond held.
        self.violation_count += 1
        if len(self.violations) < 20:
            self.violations.append(text)

    def _read(self):
        stream = self.proc.stdout
        try:
            for raw in iter(stream.readline, b""):
                self._line(raw)
        finally:
            with self.cond:
                self.eof = True
                self.cond.notify_all()

    def _line(self, raw):
        problem = None
        message = None
        if not raw.endswith(b"\n"):
            problem = "stdout line without a newline: %s" % _short(raw)
        else:
            try:
                message = json.loads(raw[:-1].decode("utf-8"), parse_constant=_reject_constant)
            except (UnicodeDecodeError, ValueError) as err:
                problem = "stdout line is not UTF-8 JSON (%s): %s" % (err, _short(raw))
        if message is not None:
            problem = shape_problem(message)
        with self.cond:
            self.lines += 1
            if problem:
                self.violation(problem)
            elif "method" not in message:
                self._account(message)
            self.cond.notify_all()

    def _account(self, message):
        request_id = message.get("id")
        error = message.get("error")
        if error and str(error.get("message", "")).startswith("Internal error"):
            self.violation("uncaught exception reported as %s" % _short(message, 500))
        if request_id is None:
            self.nulls += 1
            return
        key = id_key(request_id)
        if key == self.sentinel:
            self.sentinel_nulls = self.nulls
            self.sentinel = None
            return
        record = self.outstanding.get(key)
        if record is not None:
            record[1] += 1
            if record[1] > record[0]:
                self.violation("id %r answered %d times for %d request(s): %s" % (
                    request_id, record[1], record[0], _short(message)))
            return
        late = self.late.get(key)
        if late is not None:
            late[0] -= 1
            if late[0] < 0:
                self.violation("cancelled id %r answered more than once" % (request_id,))
            return
        self.violation("response for an id that was never sent (or already answered): %s"
                       % _short(message))

    # -- writing ------------------------------------------------------------------------

    def send(self, raw, expect, cancels=None):
        """Record what ``raw`` deserves, then write it (so no answer can overtake us)."""
        with self.cond:
            if expect == NULL:
                self.batch_null += 1
            elif expect == MAYBE_NULL:
                self.batch_maybe += 1
            elif isinstance(expect, tuple):
                kind, key = expect
                record = self.outstanding.setdefault(key, [0, 0, 0, 0])
                record[0] += 1
                if kind == "flex":
                    record[3] += 1
                self.batch_keys.add(key)
            if cancels is not None and cancels in self.outstanding:
                self.outstanding[cancels][2] += 1
        self.recent.append(_short(raw, 200))
        try:
            self.proc.stdin.write(raw)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass   # the server died; finalize() reports it with its stderr

    # -- per-batch checks ---------------------------------------------------------------

    def stderr_text(self, tail=4000):
        self.stderr.seek(0, os.SEEK_END)
        size = self.stderr.tell()
        self.stderr.seek(max(0, size - tail))
        return self.stderr.read().decode("utf-8", "replace")

    def stderr_has_traceback(self):
        """Scan the whole stderr file in chunks (it may be large after a long run)."""
        self.stderr.seek(0)
        carry = b""
        while True:
            chunk = self.stderr.read(1 << 20)
            if not chunk:
                return False
            if b"Traceback (most recent call last)" in carry + chunk:
                return True
            carry = chunk[-64:]

    def describe(self):
        return "%s server (pid %d, exit %s); last lines sent:\n  %s\nstderr tail:\n%s\n%s" % (
            self.name, self.proc.pid, self.proc.poll(), "\n  ".join(self.recent),
            self.stderr_text(), REPRO)

    def _wait(self, predicate, timeout):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.eof:
                    return predicate()
                self.cond.wait(min(remaining, 0.5))
            return True

    def finalize(self, timeout=60.0):
        """End a batch: fence it with a ping, then check every count it promised."""
        self.sentinels += 1
        fence = "fz-fence-%d" % self.sentinels
        with self.cond:
            self.sentinel = id_key(fence)
            self.sentinel_nulls = None
        line = (json.dumps({"jsonrpc": "2.0", "id": fence, "method": "ping"}) + "\n").encode()
        self.recent.append(line.decode().strip())
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        if not self._wait(lambda: self.sentinel_nulls is not None, timeout):
            pytest.fail("%s server stopped answering (no reply to the batch fence ping)\n%s"
                        % (self.name, self.describe()))

        def settled():
            return all(r[1] >= r[0] - r[3] for r in
                       (self.outstanding[k] for k in self.batch_keys) if r[2] == 0)
        if not self._wait(settled, timeout):
            with self.cond:
                missing = [k for k in self.batch_keys if self.outstanding[k][2] == 0
                           and self.outstanding[k][1] < self.outstanding[k][0] - self.outstanding[k][3]]
            pytest.fail("%s server: no response for id(s) %s\n%s"
                        % (self.name, _short(missing[:10]), self.describe()))
        now = time.monotonic()
        with self.cond:
            nulls = self.sentinel_nulls - self.null_mark
            self.null_mark = self.sentinel_nulls
            flex_missing = 0
            for key in self.batch_keys:
                sent, got, cancels, flex = self.outstanding.pop(key)
                if flex:
                    flex_missing += max(0, sent - got)
                elif cancels:
                    if got < sent:
                        self.late[key] = [sent - got, cancels, now + self.LATE_TTL]
                elif got != sent:
                    self.violation("id %r: %d responses for %d requests" % (key[1], got, sent))
            low = self.batch_null + flex_missing
            high = low + self.batch_maybe
            if not low <= nulls <= high:
                self.violation("%d responses with id null, expected %d..%d (parse errors and "
                               "invalid requests get one each, notifications none)"
                               % (nulls, low, high))
            for key in [k for k, v in self.late.items() if v[2] <= now]:
                allowed, cancels, _ = self.late.pop(key)
                if allowed > cancels:
                    self.violation("id %r: %d responses missing but only %d cancellation(s)"
                                   % (key[1], allowed, cancels))
            self.batch_null = self.batch_maybe = 0
            self.batch_keys = set()
            self.last_counter_key = None       # duplicates stay within one batch
            violations = list(self.violations)
        if violations:
            pytest.fail("%s server broke the protocol (%d violation(s)):\n- %s\n%s" % (
                self.name, self.violation_count, "\n- ".join(violations), self.describe()))

    def final_checks(self):
        with self.cond:
            self.sentinel = id_key("fz-final")
            self.sentinel_nulls = None
        self.send((json.dumps({"jsonrpc": "2.0", "id": "fz-final", "method": "ping"}) + "\n")
                  .encode(), NONE)
        if not self._wait(lambda: self.sentinel_nulls is not None, 30):
            pytest.fail("%s server does not answer a final ping\n%s" % (self.name, self.describe()))
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("%s server did not exit within 30 s of EOF\n%s" % (self.name, self.describe()))
        self._reader.join(10)
        assert code == 0, "%s server exited %s on EOF\n%s" % (self.name, code, self.describe())
        assert not self.stderr_has_traceback(), "traceback on stderr:\n%s" % self.describe()
        with self.cond:
            assert not self.violations, "\n".join(self.violations) + "\n" + self.describe()
            print("fuzz: %s server: %d stdout lines, %d answered with id null, %d batches"
                  % (self.name, self.lines, self.nulls, self.sentinels))

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(5)
        for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
            with contextlib.suppress(OSError):
                stream.close()


def shape_problem(message):
    """Why ``message`` is not a JSON-RPC 2.0 message a server may send (None if it is)."""
    if not isinstance(message, dict):
        return "stdout message is not an object: %s" % _short(message)
    if message.get("jsonrpc") != "2.0":
        return "stdout message without \"jsonrpc\": \"2.0\": %s" % _short(message)
    if "method" in message:
        if "id" in message:
            return "the server sent a request although the client offered nothing: %s" % _short(message)
        if not isinstance(message["method"], str):
            return "notification method is not a string: %s" % _short(message)
        if "params" in message and not isinstance(message["params"], dict):
            return "notification params are not an object: %s" % _short(message)
        return None
    if "id" not in message and "error" not in message:
        return "response without an id: %s" % _short(message)
    # An error to a message whose id could not be read: "id": null before
    # 2025-11-25, no id from 2025-11-25 on (its JSONRPCErrorResponse).
    request_id = message.get("id")
    if request_id is not None and not valid_id(request_id):
        return "response id of type %s: %s" % (type(request_id).__name__, _short(message))
    if ("result" in message) == ("error" in message):
        return "response needs exactly one of result and error: %s" % _short(message)
    if "error" in message:
        error = message["error"]
        if not isinstance(error, dict) or not isinstance(error.get("message"), str) or \
                not isinstance(error.get("code"), int) or isinstance(error.get("code"), bool):
            return "malformed error object: %s" % _short(message)
    elif not isinstance(message["result"], dict):
        return "result is not an object: %s" % _short(message)
    return None


# ============================================================================
# The generator
# ============================================================================

class Generator:
    """Seeded JSON-RPC traffic: valid messages first, then mutations of them."""

    def __init__(self, rng):
        self.rng = rng
        self.counter = 0
        self.unknown = 0

    # -- building blocks ----------------------------------------------------------------

    def next_id(self):
        self.counter += 1
        r = self.rng.random()
        if r < 0.55:
            return self.counter
        if r < 0.9:
            return "r%d" % self.counter
        return "\u00fc-%d-\U0001f980" % self.counter

    def weird_id(self):
        return self.rng.choice([0, -1, 2 ** 53 + 1, 2 ** 64 + 7, -(2 ** 70), "", " ", "0", "1",
                                "\u00e9", "null", "id with\nnewline", "x" * 5000,
                                "\ud800-lone", "\U0010ffff"])

    def text(self, allow_huge=True):
        rng = self.rng
        r = rng.random()
        if r < 0.35:
            return " ".join(rng.choice(["fix", "the", "parser", "add", "tests", "README", "bug",
                                        "#", "##", "`code`", "-", "[ ]"])
                            for _ in range(rng.randint(1, 12)))
        if r < 0.5:
            return CONSULT
        if r < 0.6:
            return rng.choice(["", " ", "\n", "\t\t", "\u200b"])
        if r < 0.75:
            return "".join(chr(rng.choice([rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x2fff),
                                           rng.randint(0x1f300, 0x1f9ff), rng.randint(0, 0x1f),
                                           0x7f, 0xfeff, 0x202e, 0xfffd]))
                           for _ in range(rng.randint(1, 60)))
        if r < 0.9:
            return "# Title %d\n\n- [ ] #1.0 thing\n  - ID: m1\n  - Depends on: none\n" % rng.randint(0, 99)
        if allow_huge and "huge" not in SKIP and r > 0.985:
            return self.huge()
        return "line\n" * rng.randint(1, 200)

    def huge(self):
        size = int(2 ** self.rng.uniform(12, 21.6))      # 4 KB .. ~3 M characters
        return self.rng.choice("aab\u00e9") * size

    def value(self, depth=0):
        """A random JSON value (for wrong-type mutations)."""
        rng = self.rng
        choices = [None, True, False, 0, -1, 1.5, 1e308, -0.0, 2 ** 63, "", "x", "1",
                   "\u00e9", [], {}, [1, "a"], {"k": "v"}, {"name": "status"}]
        if depth < 3 and rng.random() < 0.2:
            if rng.random() < 0.5:
                return [self.value(depth + 1) for _ in range(rng.randint(0, 4))]
            return {rng.choice(["a", "id", "name", "_meta", "\u00e9"]): self.value(depth + 1)
                    for _ in range(rng.randint(0, 4))}
        return rng.choice(choices)

    def meta(self):
        rng = self.rng
        r = rng.random()
        if r < 0.6:
            return {META_VERSION: MODERN, META_CAPS: {}}
        if r < 0.7:
            return {META_VERSION: MODERN}
        if r < 0.8:
            return {META_VERSION: rng.choice(["1999-01-01", LEGACY[0], "", 7, None]), META_CAPS: {}}
        if r < 0.9:
            return {"progressToken": rng.choice([1, "tok", None, 1.5, True])}
        return self.value()

    def tool_arguments(self, name):
        rng = self.rng
        params = TOOL_PARAMS.get(name, [])
        arguments = {}
        for pname, ptype, required in params:
            if required or rng.random() < 0.5:
                if ptype == "string":
                    arguments[pname] = self.text()
                else:
                    arguments[pname] = self.value()
        if name == "heartbeat" and "agent_id" in arguments and rng.random() < 0.5:
            arguments["agent_id"] = rng.choice(["executor:unknown:0", "supervisor:unknown:0",
                                                "other:x:1"])
        r = rng.random()
        if r < 0.05:
            arguments["unexpected"] = self.value()
        elif r < 0.1 and arguments:
            del arguments[rng.choice(list(arguments))]
        return arguments

    def request(self):
        """A valid request: (method, params or None)."""
        rng = self.rng
        r = rng.random()
        if r < 0.5:
            name = rng.choice(list(TOOL_PARAMS) + ["nope", "", "STATUS", "status ", "../status",
                                                   "wait_for_task\u0000", "\u00fcber"])
            params = {"name": name}
            if rng.random() < 0.9:
                params["arguments"] = self.tool_arguments(name)
            return "tools/call", params
        method = rng.choice(["initialize", "ping", "tools/list", "resources/list",
                             "resources/templates/list", "resources/read", "resources/read",
                             "prompts/list", "prompts/get", "logging/setLevel",
                             "server/discover", "no/such/method", "", "rpc.discover",
                             "notifications/initialized", "completion/complete"])
        if method == "initialize":
            # Not 2025-03-26: it makes the server accept batches, which this
            # oracle expects refused (test_mcp_conformance.py covers batches).
            versions = tuple(v for v in LEGACY if v != "2025-03-26")
            return method, {"protocolVersion": rng.choice(versions + (MODERN, "1999-01-01", "")),
                            "capabilities": rng.choice([{}, {"roots": {}}]),
                            "clientInfo": {"name": "fuzz", "version": "1"}}
        if method == "resources/read":
            return method, {"uri": rng.choice([
                "ferrus://task", "ferrus://review", "ferrus://submission", "ferrus://question",
                "ferrus://answer", "ferrus://consult_template", "ferrus://spec_template",
                "ferrus://consult_request", "ferrus://consult_response", "ferrus://state",
                "ferrus://events", "ferrus://logs/nope.log", "ferrus://logs/../STATE.json",
                "ferrus://../ferrus.toml", "ferrus://logs/..", "ferrus://logs/.hidden",
                "ferrus://logs/%2e%2e%2fSTATE.json", "ferrus:///etc/passwd", "file:///etc/passwd",
                "ferrus://logs//etc/passwd", "ferrus://logs/a\u0000b", "ferrus://TASK",
                "ferrus://logs/C:\\Windows", "ferrus://\ud800", "", "ferrus://"])}
        if method == "prompts/get":
            return method, {"name": rng.choice(["executor-context", "supervisor-review", "nope", ""])}
        if method == "logging/setLevel":
            return method, {"level": rng.choice(LOG_LEVELS + ("trace", "", "INFO"))}
        if method in ("tools/list", "resources/list", "prompts/list") and rng.random() < 0.3:
            return method, {"cursor": rng.choice(["MA==", "MTAw", "LTE=", "!!", "", "OTk5OTk5",
                                                  "\u00e9"])}
        return method, (None if rng.random() < 0.3 else {})

    def notification(self):
        rng = self.rng
        method = rng.choice(["notifications/initialized", "notifications/progress",
                             "notifications/roots/list_changed", "notifications/unknown",
                             "notifications/cancelled", "", "ping", "tools/call"])
        params = {}
        if method == "notifications/cancelled":
            params = {"requestId": self.unknown_id(), "reason": "fuzz"}
        elif method == "tools/call":
            params = {"name": "status"}
        elif rng.random() < 0.2:
            params = self.value()
        message = {"jsonrpc": "2.0", "method": method}
        if rng.random() < 0.8:
            message["params"] = params
        return message

    def unknown_id(self):
        self.unknown += 1
        return self.rng.choice(["never-%d" % self.unknown, -(10 ** 12) - self.unknown])

    # -- one case -----------------------------------------------------------------------

    def case(self, peer):
        """Send one case to ``peer``: a message, a mutation or a small burst."""
        rng = self.rng
        r = rng.random()
        if r < 0.42:
            return self.send_request(peer, mutate=False)
        if r < 0.52:
            return self.send_obj(peer, self.notification())
        if r < 0.58 and "cancel" not in SKIP:
            # A request and its cancellation, or a cancellation for an id never used.
            key = self.send_request(peer, mutate=False, threaded=True)
            target = key[1] if key and rng.random() < 0.8 else self.unknown_id()
            self.send_obj(peer, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                                 "params": {"requestId": target}},
                          cancels=id_key(target))
            return None
        if r < 0.62 and "duplicate" not in SKIP and peer.last_counter_key is not None:
            method, params = self.request()
            return self.send_obj(peer, self.envelope(peer.last_counter_key[1], method, params))
        if r < 0.64:
            raw = rng.choice([b"\n", b"  \n", b"\t\n", b"\r\n", b" \x0c \n"])
            peer.send(raw, classify(raw))
            return None
        return self.send_mutation(peer)

    def envelope(self, request_id, method, params):
        message = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        return message

    def send_request(self, peer, mutate, threaded=False):
        method, params = self.request()
        if threaded:
            method, params = "tools/call", {"name": self.rng.choice(list(TOOL_PARAMS))}
            params["arguments"] = self.tool_arguments(params["name"])
        if self.rng.random() < 0.15 and method != "initialize":
            params = dict(params or {})
            params["_meta"] = self.meta()
        fresh = self.rng.random() < 0.95
        request_id = self.next_id() if fresh else self.weird_id()
        self.send_obj(peer, self.envelope(request_id, method, params))
        key = id_key(request_id)
        if fresh:
            peer.last_counter_key = key
        return key

    def send_obj(self, peer, message, cancels=None):
        raw = encode(message)
        peer.send(raw, classify(raw), cancels=cancels)

    # -- mutations -----------------------------------------------------------------------

    def send_mutation(self, peer):
        rng = self.rng
        kinds = [k for k in ("wrongtype", "truncate", "deep", "huge", "utf8", "surrogate",
                             "random", "batch", "shape") if k not in SKIP]
        kind = rng.choice(kinds) if kinds else "shape"
        method, params = self.request()
        request_id = self.next_id()
        message = self.envelope(request_id, method, params)
        if kind == "wrongtype":
            self.wrong_type(message)
            return self.send_obj(peer, message)
        if kind == "truncate":
            raw = json.dumps(message).encode("utf-8")
            cut = rng.randint(1, len(raw) - 1)
            return peer.send(raw[:cut] + b"\n", classify(raw[:cut]))
        if kind == "deep":
            return self.send_deep(peer, rng.choice([10, 200, 900, 975, 985, 995, 1000, 1500,
                                                    5000, 10000, 100000]))
        if kind == "huge":
            target = rng.choice(["method", "id", "arg", "uri"])
            big = self.huge()
            if target == "method":
                message["method"] = big
            elif target == "id":
                message["id"] = big
            elif target == "uri":
                message = self.envelope(request_id, "resources/read", {"uri": "ferrus://" + big})
            else:
                name = rng.choice([n for n, p in TOOL_PARAMS.items() if p])
                arguments = self.tool_arguments(name)
                arguments[TOOL_PARAMS[name][0][0]] = big
                message = self.envelope(request_id, "tools/call",
                                        {"name": name, "arguments": arguments})
            return self.send_obj(peer, message)
        if kind == "utf8":
            raw = encode(message)[:-1]
            bad = rng.choice([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                              b"\xe2\x82", b"\x80", b"\xfe\xfe"])
            # Inside a string value (the usual case) or anywhere.
            spot = raw.find(b'"method": "') + 11 if rng.random() < 0.6 else rng.randint(0, len(raw))
            raw = raw[:spot] + bad + raw[spot:]
            return peer.send(raw + b"\n", classify(raw))
        if kind == "surrogate":
            lone = rng.choice(["\ud800", "\udfff", "\udc80", "a\ud83d", "\ud83d\ude00"])
            where = rng.random()
            if where < 0.5:
                name = rng.choice([n for n, p in TOOL_PARAMS.items() if p])
                arguments = self.tool_arguments(name)
                arguments[TOOL_PARAMS[name][0][0]] = "text " + lone + " more"
                message = self.envelope(request_id, "tools/call", {"name": name, "arguments": arguments})
            elif where < 0.65:
                message["method"] = "x" + lone
            elif where < 0.8:
                message["id"] = "id" + lone + str(self.counter)
            else:
                message = self.envelope(request_id, "resources/read", {"uri": "ferrus://" + lone})
            return self.send_obj(peer, message)   # json.dumps escapes them as \udXXX
        if kind == "random":
            raw = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))).replace(b"\n", b" ")
            if rng.random() < 0.3:
                raw = b"{" + raw + b"}"
            return peer.send(raw + b"\n", classify(raw))
        if kind == "batch":
            items = []
            for _ in range(rng.randint(0, 4)):
                if rng.random() < 0.7:
                    m, p = self.request()
                    items.append(self.envelope(self.next_id(), m, p))
                else:
                    items.append(self.notification())
            return self.send_obj(peer, items)
        # "shape": a field dropped, renamed or the envelope otherwise bent.
        r = rng.random()
        if r < 0.2:
            del message["jsonrpc"]
        elif r < 0.35:
            message["jsonrpc"] = rng.choice(["1.0", "2", 2.0, None, "2.0 "])
        elif r < 0.5:
            del message["method"]
        elif r < 0.6:
            message["result"] = {}
        elif r < 0.7:
            message.pop("method")
            message["error"] = {"code": -1, "message": "x"}
        elif r < 0.8:
            message["id"] = rng.choice([True, False, None, 1.0, 1.5, [1], {"a": 1}])
        elif r < 0.9:
            # Duplicate keys: Python (like most parsers) keeps the last one.
            raw = ('{"jsonrpc":"2.0","id":%s,"id":%s,"method":"ping"}' % (
                json.dumps(self.next_id()), json.dumps(request_id))).encode()
            return peer.send(raw + b"\n", classify(raw))
        else:
            raw = json.dumps(message).encode() + b"\r"
            return peer.send(raw + b"\n", classify(raw))
        return self.send_obj(peer, message)

    def wrong_type(self, message):
        rng = self.rng
        field = rng.choice(["id", "method", "params", "jsonrpc", "params.name", "params.arguments",
                            "params.arguments.*", "params.uri", "params._meta", "params.cursor",
                            "params.level", "params.protocolVersion"])
        value = self.value()
        if "." not in field:
            message[field] = value
            return
        params = message.get("params")
        if not isinstance(params, dict):
            params = message["params"] = {}
        parts = field.split(".")[1:]
        if parts[0] == "arguments" and len(parts) == 2:
            name = rng.choice([n for n, p in TOOL_PARAMS.items() if p])
            message["method"] = "tools/call"
            params.clear()
            params["name"] = name
            params["arguments"] = self.tool_arguments(name)
            params["arguments"][rng.choice(TOOL_PARAMS[name])[0]] = value
            return
        if parts[0] in ("name", "arguments"):
            message["method"] = "tools/call"
        params[parts[0]] = value

    def send_deep(self, peer, depth):
        """Nesting built as text (json.dumps itself would hit the recursion limit)."""
        rng = self.rng
        if rng.random() < 0.5:
            nested = "[" * depth + "]" * depth
        else:
            nested = '{"a":' * depth + "1" + "}" * depth
        r = rng.random()
        if r < 0.25:
            raw = nested.encode()                                     # a bare nested line
            expect = NULL
        elif r < 0.4:
            raw = ('{"jsonrpc":"2.0","method":"notifications/progress","params":{"x":%s}}'
                   % nested).encode()
            expect = MAYBE_NULL                                       # a notification, or unparseable
        else:
            # Only methods answered inline, so the batch fence settles them.
            request_id = self.next_id()
            method, field = rng.choice([("ping", "_meta"), ("ping", "x"),
                                        ("tools/list", "cursor"), ("resources/read", "uri"),
                                        ("prompts/get", "name"), ("logging/setLevel", "level"),
                                        ("initialize", "protocolVersion"), ("ping", "meta"),
                                        ("ping", "_meta.version")])
            if field == "_meta.version":
                body = '{"_meta":{"%s":%s,"%s":{}}}' % (META_VERSION, nested, META_CAPS)
            else:
                body = '{"%s":%s}' % (field, nested)
            raw = ('{"jsonrpc":"2.0","id":%s,"method":"%s","params":%s}'
                   % (json.dumps(request_id), method, body)).encode()
            expect = ("flex", id_key(request_id))
        peer.send(raw + b"\n", expect)


# ============================================================================
# The prelude: every method and every mutation kind once, whatever N is
# ============================================================================

def prelude(gen, peer):
    """Deterministic coverage: each method valid, then one of each hostile shape."""
    def obj(message, cancels=None):
        gen.send_obj(peer, message, cancels)

    def req(method, params=None, request_id=None):
        request_id = gen.next_id() if request_id is None else request_id
        obj(gen.envelope(request_id, method, params))
        return request_id

    req("ping")
    req("initialize", {"protocolVersion": LEGACY[0], "capabilities": {},
                       "clientInfo": {"name": "fuzz", "version": "1"}})
    obj({"jsonrpc": "2.0", "method": "notifications/initialized"})
    for method in ("tools/list", "resources/list", "resources/templates/list", "prompts/list",
                   "server/discover"):
        req(method, {})
    for name in list(TOOL_PARAMS) + ["nope"]:
        req("tools/call", {"name": name, "arguments": gen.tool_arguments(name)})
    for uri in ("ferrus://state", "ferrus://events", "ferrus://logs/../STATE.json",
                "ferrus://../ferrus.toml", "file:///etc/passwd"):
        req("resources/read", {"uri": uri})
    for name in ("executor-context", "supervisor-review", "nope"):
        req("prompts/get", {"name": name})
    req("logging/setLevel", {"level": "debug"})
    req("logging/setLevel", {"level": "loud"})
    modern = {"_meta": {META_VERSION: MODERN, META_CAPS: {}}}
    req("tools/list", dict(modern))
    req("tools/call", dict(modern, name="status"))
    req("resources/read", dict(modern, uri="ferrus://task"))
    req("ping", {"_meta": {META_VERSION: "1999-01-01", META_CAPS: {}}})
    req("ping", {"_meta": {META_VERSION: MODERN}})
    # Hostile shapes.
    if "deep" not in SKIP:
        peer.send(b"[" * 10000 + b"]" * 10000 + b"\n", NULL)
        for depth in (100, 10000):
            request_id = gen.next_id()
            peer.send(('{"jsonrpc":"2.0","id":%s,"method":"ping","params":{"x":%s}}\n' % (
                json.dumps(request_id), "[" * depth + "]" * depth)).encode(),
                ("flex", id_key(request_id)))
    if "huge" not in SKIP:
        req("tools/call", {"name": "ask_human", "arguments": {"question": "h" * (3 << 20)}})
        req("tools/call", {"name": "heartbeat", "arguments": {"agent_id": "\u00e9" * (1 << 20)}})
        req("h" * (2 << 20))
    if "utf8" not in SKIP:
        peer.send(b'{"jsonrpc":"2.0","id":1,"method":"pi\xffng"}\n', NULL)
        peer.send(b"\xed\xa0\x80\n", NULL)
    if "surrogate" not in SKIP:
        req("no/such\ud800method")
        req("tools/call", {"name": "ask_human", "arguments": {"question": "why \udfff?"}})
        req("tools/call", {"name": "create_task", "arguments": {"description": "task \ud800"}})
    if "random" not in SKIP:
        peer.send(bytes(range(256)).replace(b"\n", b"") + b"\n", NULL)
    peer.send(b"\n", NONE)
    peer.send(b"   \n", NONE)
    peer.send(b'{"jsonrpc":"2.0","id":5,"meth\n', NULL)
    if "batch" not in SKIP:
        obj([])
        obj([{"jsonrpc": "2.0", "id": gen.next_id(), "method": "ping"},
             {"jsonrpc": "2.0", "method": "notifications/initialized"}])
    for bad in (True, None, 1.5, [1], {"a": 1}):
        obj({"jsonrpc": "2.0", "id": bad, "method": "ping"})
    obj({"jsonrpc": "2.0", "id": 7, "result": {}})
    obj({"jsonrpc": "1.0", "id": gen.next_id(), "method": "ping"})
    obj({"jsonrpc": "2.0", "method": 5})
    obj({"jsonrpc": "2.0", "id": gen.next_id(), "method": 5})
    obj({"jsonrpc": "2.0", "id": gen.next_id(), "method": "ping", "params": [1]})
    obj({"jsonrpc": "2.0", "id": gen.next_id(), "method": "tools/call",
         "params": {"name": "status", "arguments": [1]}})
    if "cancel" not in SKIP:
        in_flight = req("tools/call", {"name": "wait_for_task", "arguments": {}})
        obj({"jsonrpc": "2.0", "method": "notifications/cancelled",
             "params": {"requestId": in_flight}}, cancels=id_key(in_flight))
        obj({"jsonrpc": "2.0", "method": "notifications/cancelled",
             "params": {"requestId": gen.unknown_id()}})
        obj({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": True}})
        obj({"jsonrpc": "2.0", "method": "notifications/cancelled"})
    if "duplicate" not in SKIP:
        twice = gen.next_id()
        req("tools/call", {"name": "status"}, twice)
        req("tools/call", {"name": "status"}, twice)
        req("ping", None, twice)
        req("ping", None, 1)
        req("ping", None, "1")


# ============================================================================
# The tests
# ============================================================================

def _state_bytes(root):
    with open(os.path.join(str(root), ".ferrus", "STATE.json"), "rb") as handle:
        return handle.read()


def _human_nudge(store, rng):
    """Between batches the human resets a finished task, so the walk keeps moving."""
    try:
        data = store.read_state()
        big = os.path.getsize(store.path("TASK.md")) > 65536
        if data.state in (ferrus.S.COMPLETE, ferrus.S.FAILED) or big or rng.random() < 0.1:
            ferrus.op_force_reset(store, ferrus.HUMAN)
    except ferrus.FerrusError:
        pass     # e.g. a lock timeout: the servers are busy, which is fine


def test_fuzz_serve(project):
    set_config(project, FUZZ_CONFIG)
    rng = random.Random(SEED)
    gen = Generator(rng)
    store = ferrus.Store(str(project))
    print("fuzz: seed %d, %d cases after the prelude, batches of %d%s" % (
        SEED, CASES, BATCH, (", skipping " + ",".join(sorted(SKIP))) if SKIP else ""))
    peers = [Peer(project, "supervisor", ["--role", "supervisor", "--agent-name", "fuzz"]),
             Peer(project, "executor", ["--role", "executor", "--agent-name", "fuzz"])]
    try:
        for peer in peers:
            prelude(gen, peer)
            peer.finalize()
        done = 0
        while done < CASES:
            for _ in range(min(BATCH, CASES - done)):
                gen.case(peers[rng.random() < 0.5])
                done += 1
            for peer in peers:
                peer.finalize()
            _human_nudge(store, rng)
        for peer in peers:
            peer.final_checks()
    finally:
        for peer in peers:
            peer.kill()
    ferrus.StateData.from_json(_state_bytes(project).decode("utf-8"))
    errors = [f.problem for f in ferrus.doctor_findings(str(project)) if f.severity == "error"]
    assert errors == [], "doctor after the fuzz run: %s\n%s" % (errors, REPRO)


# -- the shapes the fuzzer found, each on its own ------------------------------------------

def _one_server(project, lines):
    """Send raw lines with what each deserves; the server must answer and stay up."""
    peer = Peer(project, "plain", [])
    try:
        for raw, expect in lines:
            peer.send(raw, expect)
        peer.finalize(timeout=20)
        peer.final_checks()
    finally:
        peer.kill()


def test_a_deeply_nested_line_is_a_parse_error_not_a_crash(project):
    """10000 nested arrays exceed the parser's recursion limit: that is unparseable
    input (-32700, id null), and the server must keep serving."""
    _one_server(project, [(b"[" * 10000 + b"]" * 10000 + b"\n", NULL),
                          (b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":'
                           + b"{\"a\":" * 10000 + b"1" + b"}" * 10000 + b"}}\n", ("flex", id_key(1))),
                          (b'{"jsonrpc":"2.0","id":2,"method":"ping"}\n', ("id", id_key(2)))])


def test_values_nested_near_the_recursion_limit_are_answered(project):
    """A value the parser just manages to read must not crash the server when an
    error echoes it back (-32022 carries the requested version in its data)."""
    lines = []
    for depth in range(900, 1101, 3):
        nested = "[" * depth + "]" * depth
        lines.append((('{"jsonrpc":"2.0","id":%d,"method":"ping","params":{"_meta":'
                       '{"%s":%s,"%s":{}}}}\n' % (depth, META_VERSION, nested, META_CAPS)).encode(),
                      ("flex", id_key(depth))))
    lines.append((b'{"jsonrpc":"2.0","id":"last","method":"ping"}\n', ("id", id_key("last"))))
    _one_server(project, lines)


def test_a_lone_surrogate_in_tool_arguments_is_a_clean_refusal(project):
    """JSON may carry "\\ud800"; a tool argument holding one cannot be written to a
    UTF-8 file.  That must be an ordinary refusal (-32602 or an isError result),
    not an uncaught UnicodeEncodeError (-32603 plus a traceback on stderr)."""
    before = _state_bytes(project)
    lines = [(b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":'
              b'"2025-11-25","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}\n',
              ("id", id_key(0)))]
    for number, (tool, arg) in enumerate((("create_task", "description"),
                                          ("create_spec", "markdown"),
                                          ("ask_human", "question")), 1):
        lines.append((('{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"%s",'
                       '"arguments":{"%s":"# T\\n\\ud800 text"}}}\n' % (number, tool, arg)).encode(),
                      ("id", id_key(number))))
    _one_server(project, lines)
    assert _state_bytes(project) == before
    specs = os.path.join(str(project), "docs", "specs")
    leftovers = [n for n in os.listdir(specs)] if os.path.isdir(specs) else []
    assert leftovers == [], "a refused create_spec left files behind: %s" % leftovers
