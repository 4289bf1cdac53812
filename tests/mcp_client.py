"""A small MCP test client: `ferrus serve` as a subprocess over real pipes.

    with McpProcess(project, "--role", "executor") as server:
        server.initialize()
        result = server.call_tool("status")

A background thread reads the server's stdout line by line.  Responses are
filed by id (``responses``), notifications go to ``notifications``, and every
raw line is kept in ``lines`` so that tests can assert that nothing but
JSON-RPC ever reaches stdout.  stderr goes to a temporary file
(``stderr_text()``).

``InProcessMcp`` drives a ``ferrus.FerrusMcpServer`` inside the test process
over an OS pipe (for tests that need a fake clock or monkeypatched constants).
"""

import itertools
import json
import os
import subprocess
import tempfile
import threading
import time

from conftest import FERRUS_CMD
import mcp_schema

MODERN_VERSION = "2026-07-28"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"


def modern_meta(version=MODERN_VERSION, capabilities=True):
    """The ``_meta`` a 2026-07-28 (stateless) request carries."""
    meta = {META_VERSION: version}
    if capabilities:
        meta[META_CLIENT_CAPABILITIES] = {}
    return meta


class McpError(Exception):
    """A JSON-RPC error response where a result was expected."""

    def __init__(self, response):
        self.response = response
        self.error = response.get("error") or {}
        self.code = self.error.get("code")
        self.data = self.error.get("data")
        super().__init__("%s: %s" % (self.code, self.error.get("message")))


class _Client:
    """Message bookkeeping shared by the subprocess and the in-process client."""

    def __init__(self):
        self.lines = []            # every raw stdout line (bytes, newline stripped)
        self.bad_lines = []        # lines that are not one JSON-RPC 2.0 object in UTF-8
        self.notifications = []    # notification messages, in arrival order
        self.responses = {}        # id -> [response, ...] not yet taken by a waiter
        self.all_responses = []    # every response ever received, in arrival order
        self.pending = set()       # keys of requests sent and not yet answered
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self.eof = False
        # Schema validation of everything the server sends (issue #12 item 8).
        self.version = None          # negotiated by initialize (legacy era)
        self.sent = {}               # request key -> (method, version, tool name)
        self.output_schemas = {}     # tool name -> outputSchema seen in tools/list
        self.schema_violations = []  # (problem list, message) for every invalid message
        self.validated = 0           # messages checked
        self.batches = []            # batch responses, as received
        self.allow_invalid = False   # a test that checks a violation itself sets this

    # -- the reading side -------------------------------------------------------------

    def _feed_line(self, raw):
        raw = raw.rstrip(b"\n")
        with self._cond:
            self.lines.append(raw)
            try:
                message = json.loads(raw.decode("utf-8"))  # strict UTF-8, like any client
            except (UnicodeDecodeError, ValueError):
                self.bad_lines.append(raw)
                self._cond.notify_all()
                return
            self._validate(message)
            if isinstance(message, list) and message and all(
                    isinstance(item, dict) and "id" in item for item in message):
                # A 2025-03-26 batch response: file each response by its id.
                self.batches.append(message)
                for item in message:
                    self.all_responses.append(item)
                    self.pending.discard(_key(item["id"]))
                    self.responses.setdefault(_key(item["id"]), []).append(item)
            elif not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
                self.bad_lines.append(raw)
            elif "method" in message and "id" not in message:
                self.notifications.append(message)
            elif "id" in message and ("result" in message or "error" in message) or (
                    "error" in message and "method" not in message):
                # From 2025-11-25 on an error to a message whose id could not be read
                # has no id at all; it is filed under None, like "id": null.
                request_id = message.get("id")
                self.all_responses.append(message)
                self.pending.discard(_key(request_id))
                self.responses.setdefault(_key(request_id), []).append(message)
            else:
                self.bad_lines.append(raw)
            self._cond.notify_all()

    def _version_for(self, meta):
        """The schema version a request is answered under."""
        if isinstance(meta, dict) and mcp_schema_meta_version(meta) is not None:
            version = mcp_schema_meta_version(meta)
            return version if version in mcp_schema.VERSIONS else mcp_schema.MODERN
        return self.version or "2025-11-25"

    def _validate(self, message):
        """Check one received message against the schema of the version in force."""
        record = None
        if isinstance(message, dict) and message.get("id") is not None and "method" not in message:
            record = self.sent.get(_key(message["id"])) if _valid_key(message["id"]) else None
        elif isinstance(message, list):
            records = [self.sent.get(_key(item["id"])) if isinstance(item, dict) and
                       _valid_key(item.get("id")) else None for item in message]
            record = next((r for r in records if r), None)
        method, version, tool = record if record else (None, self._version_for(None), None)
        if isinstance(message, list):
            problems = mcp_schema.message_errors(version, message, {
                i: (r[0] if r else None) for i, r in enumerate(records)})
        else:
            problems = mcp_schema.message_errors(version, message, method)
        result = message.get("result") if isinstance(message, dict) else None
        if method == "initialize" and isinstance(result, dict):
            self.version = result.get("protocolVersion")
        if method == "tools/list" and isinstance(result, dict):
            for entry in result.get("tools", ()):
                if "outputSchema" in entry:
                    self.output_schemas[entry["name"]] = entry["outputSchema"]
        if method == "tools/call" and isinstance(result, dict):
            problems += tool_result_errors(tool, result, self.output_schemas.get(tool))
        self.validated += 1
        if problems:
            self.schema_violations.append((problems, message))
            if isinstance(message, dict):
                message["__schema_problems__"] = problems

    def assert_schema_valid(self):
        """Fail when any message received so far broke its version's schema."""
        if self.schema_violations:
            problems, message = self.schema_violations[0]
            raise AssertionError("%d message(s) broke the MCP schema; first: %s\nmessage: %s"
                                 % (len(self.schema_violations), "; ".join(problems[:6]),
                                    json.dumps(message)[:1500]))

    def _mark_eof(self):
        with self._cond:
            self.eof = True
            self._cond.notify_all()

    # -- the writing side ---------------------------------------------------------------

    def _write(self, data):
        raise NotImplementedError

    def send(self, message):
        """Send a message: a dict/list (serialised + newline) or raw bytes as they are."""
        if isinstance(message, (bytes, bytearray)):
            data = bytes(message)
        else:
            data = (json.dumps(message) + "\n").encode("utf-8")
        self._write(data)

    def next_id(self):
        return next(self._ids)

    def start_request(self, method, params=None, id=None):
        """Send a request without waiting; returns its id."""
        request_id = self.next_id() if id is None else id
        message = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        with self._cond:
            self.pending.add(_key(request_id))
            meta = params.get("_meta") if isinstance(params, dict) else None
            tool = params.get("name") if method == "tools/call" and isinstance(
                params, dict) else None
            if _valid_key(request_id):
                self.sent[_key(request_id)] = (method, self._version_for(meta), tool)
        self.send(message)
        return request_id

    def cancel_pending(self):
        """Cancel every request still unanswered (notifications/cancelled) and forget them."""
        with self._cond:
            keys = list(self.pending)
            self.pending.clear()
        for _, request_id in keys:
            self.notify("notifications/cancelled", {"requestId": request_id})
        return [request_id for _, request_id in keys]

    def reset_queues(self):
        """Drop responses nobody took (used between tests that share a server)."""
        with self._cond:
            self.responses.clear()

    def wait_response(self, request_id, timeout=10):
        """The next response carrying ``request_id`` (None for id-less errors)."""
        key = _key(request_id)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                queue = self.responses.get(key)
                if queue:
                    response = queue.pop(0)
                    problems = response.pop("__schema_problems__", None)
                    if problems and not self.allow_invalid:
                        raise AssertionError("response breaks the MCP schema: %s\n%s" % (
                            "; ".join(problems[:6]), json.dumps(response)[:1500]))
                    return response
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.eof and not queue):
                    raise TimeoutError("no response for id %r within %.1f s%s (stderr: %s)" % (
                        request_id, timeout, " (server closed stdout)" if self.eof else "",
                        self.stderr_text()[-2000:]))
                self._cond.wait(remaining)

    def has_response(self, request_id):
        with self._cond:
            return any(_key(r.get("id")) == _key(request_id) for r in self.all_responses)

    def request(self, method, params=None, id=None, timeout=10):
        """Send a request and return the whole response message (result or error)."""
        return self.wait_response(self.start_request(method, params, id), timeout)

    def result(self, method, params=None, id=None, timeout=10):
        """Like request(), but return the result and raise McpError on an error response."""
        response = self.request(method, params, id, timeout)
        if "error" in response:
            raise McpError(response)
        return response["result"]

    def notify(self, method, params=None):
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)

    def initialize(self, version="2025-11-25"):
        """initialize + notifications/initialized; returns the initialize result."""
        result = self.result("initialize", {
            "protocolVersion": version, "capabilities": {},
            "clientInfo": {"name": "ferrus-tests", "version": "1"}})
        self.notify("notifications/initialized")
        return result

    def tool_params(self, name, arguments=None, meta=None):
        params = {"name": name}
        if arguments is not None:
            params["arguments"] = arguments
        if meta is not None:
            params["_meta"] = meta
        return params

    def call_tool(self, name, arguments=None, meta=None, id=None, timeout=10):
        """tools/call; returns the result dict (raises McpError on a JSON-RPC error)."""
        return self.result("tools/call", self.tool_params(name, arguments, meta), id, timeout)

    def start_tool(self, name, arguments=None, meta=None, id=None):
        """Start a tools/call without waiting for it; returns its id."""
        return self.start_request("tools/call", self.tool_params(name, arguments, meta), id)

    def wait_notification(self, predicate, timeout=10):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for message in self.notifications:
                    if predicate(message):
                        return message
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("no matching notification within %.1f s" % timeout)
                self._cond.wait(remaining)

    def stderr_text(self):
        return ""


def mcp_schema_meta_version(meta):
    version = meta.get(META_VERSION)
    return version if isinstance(version, str) else (None if version is None else str(version))


def _valid_key(request_id):
    return isinstance(request_id, (str, int)) and not isinstance(request_id, bool)


def tool_result_errors(tool, result, output_schema=None):
    """Rules the schema cannot express for a tools/call result.

    structuredContent must conform to the tool's outputSchema, and a text block
    must carry the same JSON (2025-06-18 tools page)."""
    if "structuredContent" not in result:
        return []
    structured = result["structuredContent"]
    problems = []
    if output_schema is None and tool is not None:
        import ferrus
        if tool in ferrus.TOOLS_BY_NAME:
            output_schema = ferrus.TOOLS_BY_NAME[tool].output_schema()
    if output_schema is not None and not result.get("isError"):
        problems += mcp_schema.structured_errors(structured, output_schema)
    mirrored = False
    for block in result.get("content", ()):
        if isinstance(block, dict) and block.get("type") == "text":
            try:
                mirrored = mirrored or json.loads(block["text"]) == structured
            except (ValueError, TypeError):
                pass
    if not mirrored:
        problems.append("$.result.content: no text block carries the structuredContent JSON")
    return problems


def _key(request_id):
    # 1 and "1" are different ids; True is not an id at all.
    return (type(request_id).__name__, request_id)


def tool_text(result):
    """The text of a tools/call result's first content item."""
    return result["content"][0]["text"]


def tool_json(result):
    """A tools/call result's text parsed as JSON (the wait_* and heartbeat tools)."""
    return json.loads(tool_text(result))


class McpProcess(_Client):
    """`python ferrus.py serve ARGS` in ``root`` with binary pipes."""

    def __init__(self, root, *serve_args, env=None):
        super().__init__()
        full_env = dict(os.environ)
        full_env.pop("FERRUS_DEBUG", None)
        full_env["NO_COLOR"] = "1"
        if env:
            full_env.update(env)
        self.stderr_file = tempfile.TemporaryFile()
        self.argv = FERRUS_CMD + ["serve"] + [str(a) for a in serve_args]
        self.proc = subprocess.Popen(self.argv, cwd=str(root), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr_file,
                                     env=full_env)
        self._write_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name="mcp-client-reader")
        self._reader.start()

    @property
    def pid(self):
        return self.proc.pid

    def _read_loop(self):
        stream = self.proc.stdout
        try:
            for raw in iter(stream.readline, b""):
                self._feed_line(raw)
        finally:
            self._mark_eof()

    def _write(self, data):
        with self._write_lock:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def close_stdin(self):
        with self._write_lock:
            if not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()
                except BrokenPipeError:
                    pass

    def close(self, timeout=10):
        """Close stdin, wait for the server to exit and return its exit code."""
        self.close_stdin()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        self._reader.join(timeout)
        return code

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(5)

    def stderr_text(self):
        try:
            self.stderr_file.seek(0)
            return self.stderr_file.read().decode("utf-8", errors="replace")
        except (OSError, ValueError):
            return ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            if self.proc.poll() is None:
                self.close(timeout=10)
        except Exception:
            self.kill()
        finally:
            self.stderr_file.close()
        if exc[0] is None:
            self.assert_schema_valid()


class InProcessMcp(_Client):
    """A ``ferrus.FerrusMcpServer`` on a thread of this process, fed through an OS pipe."""

    def __init__(self, store, role=None, agent_name="test", agent_index=1):
        super().__init__()
        import ferrus
        read_fd, self._write_fd = os.pipe()
        self._reader_stream = os.fdopen(read_fd, "rb")
        self._buffer = b""
        self._buffer_lock = threading.Lock()
        self.server = ferrus.FerrusMcpServer(store, role, agent_name, agent_index,
                                             self._reader_stream, self)
        self._thread = threading.Thread(target=self.server.serve, daemon=True,
                                        name="in-process-mcp")
        self._thread.start()

    # The server writes its output here (it calls write + flush).
    def write(self, data):
        with self._buffer_lock:
            self._buffer += data
            *complete, self._buffer = self._buffer.split(b"\n")
        for line in complete:
            self._feed_line(line)
        return len(data)

    def flush(self):
        pass

    def _write(self, data):
        view = memoryview(data)
        while view:
            view = view[os.write(self._write_fd, view):]

    def close(self, timeout=10):
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        self._thread.join(timeout)
        self._mark_eof()
        self._reader_stream.close()
        return 0 if not self._thread.is_alive() else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        if exc[0] is None:
            self.assert_schema_valid()
