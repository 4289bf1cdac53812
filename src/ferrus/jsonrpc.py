"""JSON-RPC: a generic 2.0 server on stdio for every MCP era.

Version negotiation, the stateless 2026 revision's per-request _meta, batches where
the era allows them, worker threads with one writer lock so a blocking call never
blocks ping or cancellation; nothing but protocol bytes on stdout."""

import collections
import json
import threading
import time

from .basics import deferred_dataclass, log


MCP_LEGACY_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
MCP_MODERN_VERSIONS = ("2026-07-28",)
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = (
    -32700, -32600, -32601, -32602, -32603)
RESOURCE_NOT_FOUND = -32002
UNSUPPORTED_PROTOCOL_VERSION = -32022
MCP_ALL_VERSIONS = MCP_MODERN_VERSIONS + MCP_LEGACY_VERSIONS
META_LOG_LEVEL = "io.modelcontextprotocol/logLevel"
# Versions whose base protocol requires servers to accept JSON-RPC batches.
BATCH_VERSIONS = ("2025-03-26",)
# Versions whose error schema requires an id, so an unreadable id is sent as null
# (JSON-RPC 2.0); from 2025-11-25 on the id is optional and left out instead.
NULL_ERROR_ID_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18")
# Legacy methods the 2026-07-28 revision removed: -32601 when a request is modern.
REMOVED_IN_MODERN = ("initialize", "ping", "logging/setLevel")


class RpcError(Exception):
    def __init__(self, code, message, data=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_json(self):
        error = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


@deferred_dataclass
class Request:
    """One JSON-RPC request as a handler sees it."""

    id: object
    method: str
    params: dict
    cancel: threading.Event
    modern: bool = False      # sent in the 2026-07-28 stateless era
    # Set by notifications/cancelled: the client no longer wants any answer.  An
    # EOF shutdown also sets ``cancel`` (to end waits) but still answers.
    abandoned: bool = False
    batched: bool = False     # an element of a JSON-RPC batch (2025-03-26)
    reply: object = None      # callable(response or None): where the answer goes
    lane: object = None       # the _Lane it was admitted to (None: run inline)

    @property
    def meta(self):
        meta = self.params.get("_meta")
        return meta if isinstance(meta, dict) else {}


class _Lane:
    """A bounded group of worker threads for one kind of request.

    At most ``max_workers`` requests of the lane run at once and at most
    ``max_queued`` more wait for a worker; a request beyond that is refused at
    once (never left unanswered).  Workers stay for the next request, so a
    quick call does not pay for starting a thread."""

    def __init__(self, name, max_workers, max_queued, lock):
        self.name = name
        self.max_workers = max_workers
        self.max_queued = max_queued
        self.pending = collections.deque()
        self.active = 0       # admitted and not finished (running or queued)
        self.threads = 0      # worker threads alive
        self.waiting = 0      # workers parked on ``ready`` and not yet handed a request
        self.ready = threading.Condition(lock)


_current_request = threading.local()   # the request a thread is handling (for logging)


class JsonRpcServer:
    """Newline-delimited JSON-RPC 2.0 over a pair of binary streams.

    The reader thread parses messages and answers cheap methods inline.  What
    ``lane_of(request)`` puts in a lane runs on that lane's bounded worker
    threads: long blocking calls ("blocking") have their own lane, so they can
    never starve quick calls ("quick") and neither can delay ``ping`` or a
    cancellation, which the reader answers itself.  A request its lane cannot
    take gets ``busy(request, lane)`` as its answer at once.  One lock
    serialises writes.

    ``protocol_version`` is the legacy version negotiated by initialize (None
    before); it decides whether JSON-RPC batches are accepted (2025-03-26 only)
    and how an error answers a message whose id is unknown."""

    MAX_BLOCKING = 8         # blocking calls running at once (each holds a thread; an agent
                             # needs one or two, and every one polls while it waits)
    MAX_QUICK_WORKERS = 4    # threads for quick calls
    MAX_QUICK_QUEUED = 256   # quick calls waiting for one of those threads

    def __init__(self, reader, writer):
        self.reader = reader
        self.writer = writer
        self.handlers = {}
        self.notification_handlers = {}
        self.lane_of = lambda request: None
        self.busy = self._default_busy
        self.protocol_version = None
        self._write_lock = threading.Lock()
        self._inflight = {}
        self._inflight_lock = threading.Lock()
        self._lanes = {
            "blocking": _Lane("blocking", self.MAX_BLOCKING, 0, self._inflight_lock),
            "quick": _Lane("quick", self.MAX_QUICK_WORKERS, self.MAX_QUICK_QUEUED,
                           self._inflight_lock)}
        self._workers = set()
        self.closed = threading.Event()

    # -- plumbing ------------------------------------------------------------------

    def send(self, message):
        try:
            text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
        except (RecursionError, ValueError):
            # A value echoed from the request is nested too deeply to serialise.
            if isinstance(message, list) or "id" not in message:
                return
            message = {"jsonrpc": "2.0", "id": message["id"], "error": {
                "code": INTERNAL_ERROR, "message": "the response is nested too deeply to send"}}
            text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
        try:
            data = (text + "\n").encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (from a "\ud800" escape in the request) has no UTF-8
            # form; ASCII escapes keep the line valid JSON and valid UTF-8.
            data = (json.dumps(message, separators=(",", ":")) + "\n").encode("ascii")
        with self._write_lock:
            try:
                self.writer.write(data)
                self.writer.flush()
            except (OSError, ValueError):
                self.closed.set()

    def notify(self, method, params):
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    def _send_reply(self, message):
        if message is not None:
            self.send(message)

    def _response(self, request_id, result=None, error=None):
        """A response message.  An error to a message whose id could not be read
        has no id in 2025-11-25 and later (JSONRPCErrorResponse makes it
        optional there) and ``"id": null`` before, as JSON-RPC 2.0 says."""
        message = {"jsonrpc": "2.0"}
        if request_id is not None or self.protocol_version in NULL_ERROR_ID_VERSIONS:
            message["id"] = request_id
        if error is not None:
            message["error"] = error.to_json()
        else:
            message["result"] = result
        return message

    def _respond(self, request_id, result=None, error=None, reply=None):
        (reply or self._send_reply)(self._response(request_id, result, error))

    def _read_line(self):
        """The next line, or None at EOF; an over-long line becomes an error marker."""
        line = self.reader.readline(MAX_MESSAGE_BYTES + 1)
        if not line:
            return None
        if len(line) > MAX_MESSAGE_BYTES and not line.endswith(b"\n"):
            while True:  # discard the rest of the oversized line
                rest = self.reader.readline(1024 * 1024)
                if not rest or rest.endswith(b"\n"):
                    break
            return b""
        return line

    def serve_forever(self):
        """Read until EOF, then cancel whatever is still running and return."""
        try:
            while not self.closed.is_set():
                line = self._read_line()
                if line is None:
                    break
                if line == b"":
                    self._respond(None, error=RpcError(
                        INVALID_REQUEST, "message larger than %d bytes" % MAX_MESSAGE_BYTES))
                    continue
                if line.strip():
                    self._handle_line(line)
        finally:
            self.shutdown()

    def shutdown(self, wait=5.0):
        self.closed.set()
        with self._inflight_lock:
            for request in self._inflight.values():
                request.cancel.set()
            for lane in self._lanes.values():
                lane.waiting = 0
                lane.ready.notify_all()
            workers = list(self._workers)
        deadline = time.monotonic() + wait
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))

    def _handle_line(self, line):
        try:
            message = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            self._respond(None, error=RpcError(PARSE_ERROR, "Parse error: %s" % err))
            return
        if isinstance(message, list):
            if self.protocol_version not in BATCH_VERSIONS:
                self._respond(None, error=RpcError(
                    INVALID_REQUEST, "JSON-RPC batches are not supported in protocol version %s; "
                    "send one message per line" % (self.protocol_version or "negotiation")))
            elif not message:
                self._respond(None, error=RpcError(
                    INVALID_REQUEST, "Invalid Request: an empty batch"))
            else:
                self._handle_batch(message)
            return
        self._handle_message(message, self._send_reply)

    def _handle_batch(self, messages):
        """2025-03-26 batches: one array of responses once every request is answered
        (notifications and cancelled requests add nothing; no array when empty)."""
        lock = threading.Lock()
        responses = []
        remaining = [len(messages)]

        def reply(message):
            with lock:
                if message is not None:
                    responses.append(message)
                remaining[0] -= 1
                finished = remaining[0] == 0
            if finished and responses:
                self.send(responses)
        for message in messages:
            self._handle_message(message, reply, batched=True)

    def _handle_message(self, message, reply, batched=False):
        """Handle one parsed message; ``reply`` is called exactly once, with the
        response or None when none is due."""
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            request_id = message.get("id") if isinstance(message, dict) else None
            self._respond(request_id if _valid_id(request_id) else None, error=RpcError(
                INVALID_REQUEST, "Invalid Request: expected an object with \"jsonrpc\": \"2.0\""),
                reply=reply)
            return
        method = message.get("method")
        if method is None and ("result" in message or "error" in message):
            reply(None)  # a response to a request we never send; ignore it
            return
        params = message.get("params", {})
        if "id" not in message:
            if isinstance(method, str) and isinstance(params, dict):
                handler = self.notification_handlers.get(method)
                if handler:
                    try:
                        handler(params)
                    except Exception:  # a notification never gets an answer, even on failure
                        log.exception("notification %s failed", method)
            reply(None)
            return
        request_id = message["id"]
        if not _valid_id(request_id):
            self._respond(None, error=RpcError(
                INVALID_REQUEST, "Invalid Request: id must be a string or integer"), reply=reply)
            return
        if not isinstance(method, str):
            self._respond(request_id, error=RpcError(
                INVALID_REQUEST, "Invalid Request: method must be a string"), reply=reply)
            return
        if params is None:
            params = {}
        if not isinstance(params, dict):
            self._respond(request_id, error=RpcError(INVALID_PARAMS, "params must be an object"),
                          reply=reply)
            return
        request = Request(request_id, method, params, threading.Event(), batched=batched,
                          reply=reply)
        lane = self._lanes.get(self.lane_of(request))
        if lane is None:
            self._run(request)
            return
        with self._inflight_lock:
            if request_id in self._inflight:
                self._respond(request_id, error=RpcError(
                    INVALID_REQUEST, "request id %r is already in use" % (request_id,)),
                    reply=reply)
                return
            admitted = lane.active < lane.max_workers + lane.max_queued
            if admitted:
                self._inflight[request_id] = request
                request.lane = lane
                lane.active += 1
                lane.pending.append(request)
                worker = None
                if lane.waiting:
                    lane.waiting -= 1
                    lane.ready.notify()
                elif lane.threads < lane.max_workers:
                    lane.threads += 1
                    worker = threading.Thread(target=self._work, args=(lane,), daemon=True,
                                              name="mcp-%s" % lane.name)
                    self._workers.add(worker)
        if not admitted:
            self._run(request, lambda request: self.busy(request, lane))
        elif worker is not None:
            worker.start()

    def _default_busy(self, request, lane):
        raise RpcError(INTERNAL_ERROR, "server busy: %d %s requests are already running; "
                                       "retry when one has finished" % (lane.active, lane.name))

    def _run(self, request, handler=None):
        result = error = None
        _current_request.value, _current_request.server = request, self
        try:
            handler = handler or self.handlers.get(request.method)
            if handler is None:
                raise RpcError(METHOD_NOT_FOUND, "Method not found: %s" % request.method)
            result = handler(request)
        except RpcError as err:
            error = err
        except Exception as err:  # a bug must not kill the server; report it whole
            log.exception("internal error in %s", request.method)
            error = RpcError(INTERNAL_ERROR, "Internal error: %s: %s" % (type(err).__name__, err))
        finally:
            _current_request.value = _current_request.server = None
            with self._inflight_lock:
                self._inflight.pop(request.id, None)
                if request.lane is not None:
                    # Free the slot before answering: a client may send its next
                    # call the moment it reads this answer.
                    request.lane.active -= 1
                    request.lane = None
        if request.abandoned:
            request.reply(None)  # cancelled by the client: the spec says send nothing more
            return
        self._respond(request.id, result=result, error=error, reply=request.reply)

    def _work(self, lane):
        """A worker thread of ``lane``: run its queued requests until shutdown."""
        try:
            while True:
                with self._inflight_lock:
                    while not lane.pending:
                        if self.closed.is_set():
                            return
                        lane.waiting += 1
                        lane.ready.wait()
                    request = lane.pending.popleft()
                self._run(request)
        finally:
            with self._inflight_lock:
                lane.threads -= 1
                self._workers.discard(threading.current_thread())

    def cancel(self, request_id):
        with self._inflight_lock:
            request = self._inflight.get(request_id)
            if request is not None:
                request.abandoned = True
                request.cancel.set()


def _valid_id(value):
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
