"""A scripted stand-in for the Anthropic Messages API, for driving the real
Claude Code CLI (`claude -p`) offline in end-to-end tests.

Standard library only (http.server + threading), Python 3.9+.

    from fake_anthropic import FakeAnthropic, ScriptedAgent, text, tool_use, claude_env

    agent = ScriptedAgent([
        tool_use("mcp__demo__echo", {"text": "hi"}),
        lambda request, results: text("got " + results[0]["content"]),
    ])
    with FakeAnthropic(agent) as fake:
        subprocess.run([find_claude(), "-p", "...", ...], env=claude_env(fake, home))
        fake.main_requests[1]   # the request that carried the tool result

How it works
------------
`claude -p` honours ANTHROPIC_BASE_URL, so it sends `POST /v1/messages`
(streaming, `"stream": true`) to this server.  Each request is classified:

* a *main* request is a turn of the conversation being scripted; it is
  answered by the next turn of the script (see `FakeAnthropic.__init__`);
* anything else is a *side* request (Claude Code sends some of its own, e.g. a
  tool-less quota probe or a title/topic generation with a different system
  prompt): it gets a short harmless text reply and does not consume the script.

The default `is_main` (`default_is_main`) says "main" when the request offers
an MCP tool (a tool named `mcp__...`) or a non-trivial set of tools; pass your
own `is_main(request) -> bool` to be stricter.

What Claude Code 2.1.197 actually sends (`claude -p ... --output-format
stream-json`): a `HEAD /` connectivity probe (User-Agent Bun), then one
`POST /v1/messages?beta=true` (stream: true, ~25 tools incl. `mcp__*`) per turn.
Without CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 it also sends a session-title
request first: `tools: []`, thinking disabled, `output_config.format` a JSON
schema `{"title": string}` - `default_side_reply` answers it with matching JSON.
Main requests may contain `{"role": "system"}` messages between user turns.

Streaming replies follow Anthropic's server-sent-event protocol: `message_start`,
then per content block `content_block_start` / `content_block_delta`
(`text_delta` or `input_json_delta` with `partial_json`) / `content_block_stop`,
then `message_delta` (with `stop_reason` and `usage`) and `message_stop`.
Non-streaming requests get the equivalent JSON message.  `count_tokens` gets
`{"input_tokens": N}`; other paths are answered with an empty JSON object and
recorded in `unknown`.
"""

import json
import os
import random
import shutil
import string
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = [
    "FakeAnthropic", "ScriptedAgent", "text", "tool_use", "last_tool_results",
    "claude_env", "find_claude", "default_is_main", "default_side_reply", "tool_names",
    "DEFAULT_AGENT_DIRS",
    "find_agent", "turns_by_ferrus_role",
]

# Where .ci/run installs the agent CLIs (checked after PATH and $FERRUS_AGENT_BIN).
DEFAULT_AGENT_DIRS = (os.path.join(os.path.expanduser("~"), ".cache", "ferrus-ci", "agents",
                                   "node_modules", ".bin"),)

_ALNUM = string.ascii_letters + string.digits


def _random_id(prefix, length=24):
    return prefix + "".join(random.choice(_ALNUM) for _ in range(length))


# --------------------------------------------------------------------------- blocks

def text(s):
    """An assistant text block."""
    return {"type": "text", "text": str(s)}


def tool_use(name, input, id=None):
    """An assistant tool_use block; `id` defaults to a fresh "toolu_..." id."""
    return {"type": "tool_use", "id": id or _random_id("toolu_01"), "name": name,
            "input": dict(input or {})}


def _normalise_blocks(reply):
    """Accept a list of blocks, a single block, a string (text) or None (empty text)."""
    if reply is None:
        return [text("")]
    if isinstance(reply, str):
        return [text(reply)]
    if isinstance(reply, dict):
        return [reply]
    blocks = [text(b) if isinstance(b, str) else b for b in reply]
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") not in ("text", "tool_use"):
            raise ValueError("unsupported reply block: %r" % (block,))
    return blocks or [text("")]


def _content_text(content):
    """The text of a tool_result's `content` (a string or a list of blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif isinstance(block, str):
            parts.append(block)
    return "\n".join(parts)


def last_tool_results(request):
    """The tool_result blocks of the last user message of a request body, each as
    {"tool_use_id": ..., "content": <text>, "is_error": bool}."""
    for message in reversed(request.get("messages") or []):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if not isinstance(content, list):
            return []
        return [{"tool_use_id": block.get("tool_use_id"),
                 "content": _content_text(block.get("content")),
                 "is_error": bool(block.get("is_error", False))}
                for block in content
                if isinstance(block, dict) and block.get("type") == "tool_result"]
    return []


def tool_names(request):
    return [tool.get("name", "") for tool in (request.get("tools") or []) if isinstance(tool, dict)]


def _schema_instance(schema):
    """A small value satisfying a (simple) JSON schema, for structured-output side requests."""
    if not isinstance(schema, dict):
        return "fake"
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return _schema_instance(schema[key][0])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {name: _schema_instance(props.get(name, {})) for name in schema.get("required") or []}
    if kind == "array":
        return []
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return "Fake session"


def default_side_reply(request):
    """Reply to a side request: if it asks for structured output (Claude Code's
    session-title request sends `output_config.format` = a JSON schema) a minimal
    JSON document matching the schema, else "OK"."""
    output_format = (request.get("output_config") or {}).get("format") or {}
    if output_format.get("type") == "json_schema":
        return [text(json.dumps(_schema_instance(output_format.get("schema"))))]
    return [text("OK")]


def default_is_main(request):
    """Main conversation = the request offers an MCP tool (`mcp__*`) or at least a
    few tools.  Side requests of Claude Code (quota probe, title/topic generation)
    carry no tools."""
    names = tool_names(request)
    return any(name.startswith("mcp__") for name in names) or len(names) >= 3


# --------------------------------------------------------------------------- scripts

class ScriptedAgent:
    """A turn function that plays `steps` in order, one per main request.

    A step is a block (`text(...)`, `tool_use(...)`), a list of blocks, a string
    (text), or a callable `step(request, tool_results)` returning any of those,
    where `tool_results` is `last_tool_results(request)` - so a step can branch on
    what the previous tool call returned.  When the steps are used up every further
    turn is the final text turn `final` (default "done").
    """

    def __init__(self, steps, final="done"):
        self.steps = list(steps)
        self.final = final
        self.index = 0
        self.transcript = []  # (request, blocks) per turn played
        self._lock = threading.Lock()

    @property
    def finished(self):
        return self.index >= len(self.steps)

    def __call__(self, request):
        with self._lock:
            if self.index < len(self.steps):
                step = self.steps[self.index]
                self.index += 1
            else:
                step = text(self.final)
        if callable(step):
            step = step(request, last_tool_results(request))
        blocks = _normalise_blocks(step)
        self.transcript.append((request, blocks))
        return blocks


class _TurnList:
    """A list of turns (blocks or callables taking the request), played in order."""

    def __init__(self, turns, final="done"):
        self.turns = list(turns)
        self.final = final
        self.index = 0

    def __call__(self, request):
        if self.index < len(self.turns):
            turn = self.turns[self.index]
            self.index += 1
        else:
            turn = text(self.final)
        if callable(turn):
            turn = turn(request)
        return turn


# --------------------------------------------------------------------------- server

def _estimate_tokens(body):
    return max(1, len(json.dumps(body)) // 4)


def _chunks(s, size):
    return [s[i:i + size] for i in range(0, len(s), size)] or [""]


def _sse(event, data):
    return ("event: %s\ndata: %s\n\n" % (event, json.dumps(data))).encode("utf-8")


class FakeAnthropic:
    """The fake API server.

    script: a turn function `script(request) -> blocks` called once per main
        request, or a list of turns (each a list of blocks / a block / a string,
        or a callable taking the request) played in order, then "done".
    is_main: `is_main(request) -> bool`, see `default_is_main`.
    side_reply: the reply to side requests: a string, or `side_reply(request)`
        returning blocks; default `default_side_reply`.

    Attributes (filled while serving):
        url            "http://127.0.0.1:PORT" once started
        requests       every /v1/messages body received (parsed JSON), in order
        main_requests  the ones answered by the script
        side_requests  the ones answered with `side_reply`
        log            one dict per HTTP request: method, path, kind, headers
        unknown        (method, path) of requests to paths this fake does not know
        errors         tracebacks of exceptions raised by the script (the CLI then
                       gets a text reply naming the error and stops)
    """

    def __init__(self, script, is_main=None, side_reply=None, model=None):
        self.script = _TurnList(script) if isinstance(script, (list, tuple)) else script
        self.is_main = is_main or default_is_main
        self.side_reply = default_side_reply if side_reply is None else side_reply
        self.model = model
        self.url = None
        self.requests = []
        self.main_requests = []
        self.side_requests = []
        self.log = []
        self.unknown = []
        self.errors = []
        self._lock = threading.Lock()
        self._script_lock = threading.Lock()
        self._server = None
        self._thread = None

    # -- lifecycle

    def start(self):
        fake = self

        class Handler(_Handler):
            pass

        Handler.fake = fake
        self._server = _Server(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="fake-anthropic", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self):
        return self.start() if self._server is None else self

    def __exit__(self, *exc):
        self.stop()
        return False

    # -- answering

    def _answer_messages(self, body):
        """The reply blocks and kind ("main"/"side") for a /v1/messages body."""
        try:
            main = bool(self.is_main(body))
        except Exception:
            self._error(traceback.format_exc())
            main = False
        if main:
            # One main turn at a time, in arrival order: the script is sequential.
            with self._script_lock:
                with self._lock:
                    self.requests.append(body)
                    self.main_requests.append(body)
                try:
                    return _normalise_blocks(self.script(body)), "main"
                except Exception:
                    error = traceback.format_exc()
                    self._error(error)
                    return [text("fake_anthropic: script error:\n" + error)], "main"
        with self._lock:
            self.requests.append(body)
            self.side_requests.append(body)
        reply = self.side_reply
        try:
            blocks = _normalise_blocks(reply(body) if callable(reply) else reply)
        except Exception:
            self._error(traceback.format_exc())
            blocks = [text("OK")]
        return blocks, "side"

    def _error(self, error):
        with self._lock:
            self.errors.append(error)

    def describe(self):
        """A readable summary of the traffic, for assertion messages."""
        lines = []
        for entry in self.log:
            lines.append("%(method)s %(path)s [%(kind)s]" % entry)
        if self.errors:
            lines.append("script errors:")
            lines.extend(self.errors)
        return "\n".join(lines)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # keep-alive connections must not block stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake = None  # set on a per-server subclass

    def log_message(self, format, *args):  # keep test output quiet
        if os.environ.get("FAKE_ANTHROPIC_DEBUG"):
            sys.stderr.write("fake_anthropic: " + (format % args) + "\n")

    # -- plumbing

    def _read_body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return {}
        try:
            return json.loads(raw.decode("utf-8"))
        except ValueError:
            return {"_raw": raw.decode("utf-8", "replace")}

    def _send(self, status, payload, content_type="application/json", head=False):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("request-id", _random_id("req_"))
        self.send_header("anthropic-organization-id", "00000000-0000-0000-0000-000000000000")
        self.end_headers()
        if not head:
            self.wfile.write(data)
            self.wfile.flush()

    def _record(self, kind):
        entry = {"method": self.command, "path": self.path, "kind": kind,
                 "headers": dict(self.headers.items())}
        with self.fake._lock:
            self.fake.log.append(entry)
            if kind == "unknown":
                self.fake.unknown.append((self.command, self.path))

    def _route(self):
        return self.path.split("?", 1)[0].rstrip("/")

    # -- verbs

    def do_POST(self):
        body = self._read_body()
        route = self._route()
        if route == "/v1/messages":
            blocks, kind = self.fake._answer_messages(body)
            self._record(kind)
            if body.get("stream"):
                self._send(200, self._stream(body, blocks), content_type="text/event-stream")
            else:
                self._send(200, self._message(body, blocks))
        elif route == "/v1/messages/count_tokens":
            self._record("count_tokens")
            self._send(200, {"input_tokens": _estimate_tokens(body)})
        else:
            self._record("unknown")
            self._send(200, {})

    def do_GET(self):
        self._record("probe" if self._route() in ("", "/v1", "/v1/models") else "unknown")
        if self._route() == "/v1/models":
            self._send(200, {"data": [], "has_more": False, "first_id": None, "last_id": None})
        else:
            self._send(200, {})

    def do_HEAD(self):
        self._record("probe")
        self._send(200, {}, head=True)

    def do_OPTIONS(self):
        self._record("probe")
        self._send(200, {})

    do_PUT = do_PATCH = do_DELETE = do_POST

    # -- message shapes

    def _model(self, body):
        return self.fake.model or body.get("model") or "claude-fake"

    def _usage(self, body, blocks):
        return {"input_tokens": _estimate_tokens(body.get("messages") or []),
                "output_tokens": max(1, len(json.dumps(blocks)) // 4),
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    @staticmethod
    def _stop_reason(blocks):
        return "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"

    def _message(self, body, blocks):
        return {"id": _random_id("msg_01"), "type": "message", "role": "assistant",
                "model": self._model(body), "content": blocks,
                "stop_reason": self._stop_reason(blocks), "stop_sequence": None,
                "usage": self._usage(body, blocks)}

    def _stream(self, body, blocks):
        usage = self._usage(body, blocks)
        start_usage = dict(usage, output_tokens=1)
        out = [_sse("message_start", {"type": "message_start", "message": {
            "id": _random_id("msg_01"), "type": "message", "role": "assistant",
            "model": self._model(body), "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": start_usage}}),
            _sse("ping", {"type": "ping"})]
        for index, block in enumerate(blocks):
            if block["type"] == "text":
                start = {"type": "text", "text": ""}
                deltas = [{"type": "text_delta", "text": piece}
                          for piece in _chunks(block["text"], 40)]
            else:
                start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                deltas = [{"type": "input_json_delta", "partial_json": piece}
                          for piece in [""] + _chunks(json.dumps(block["input"]), 20)]
            out.append(_sse("content_block_start", {"type": "content_block_start",
                                                    "index": index, "content_block": start}))
            for delta in deltas:
                out.append(_sse("content_block_delta", {"type": "content_block_delta",
                                                        "index": index, "delta": delta}))
            out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        out.append(_sse("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": self._stop_reason(blocks),
                                                    "stop_sequence": None},
                                          "usage": {"output_tokens": usage["output_tokens"]}}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        return b"".join(out)


# --------------------------------------------------------------------------- running claude

def find_agent(binary):
    """Path of an agent CLI executable: on PATH first, then in $FERRUS_AGENT_BIN (a
    directory), then in DEFAULT_AGENT_DIRS; else None."""
    found = shutil.which(binary)
    if found:
        return found
    dirs = []
    agent_bin = os.environ.get("FERRUS_AGENT_BIN")
    if agent_bin:
        dirs.append(os.path.dirname(agent_bin) if os.path.isfile(agent_bin) else agent_bin)
    dirs.extend(DEFAULT_AGENT_DIRS)
    for directory in dirs:
        candidate = os.path.join(directory, binary)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    return None


def find_claude():
    """Path of the `claude` executable, or None."""
    return find_agent("claude")


# Environment variables that would send the CLI somewhere else or change auth.
_SCRUB = ("ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL",
          "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
          "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_CUSTOM_HEADERS",
          "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_OAUTH_TOKEN",
          "CLAUDE_CONFIG_DIR", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy",
          "ALL_PROXY", "all_proxy")


def turns_by_ferrus_role(steps):
    """A turn function for FakeAnthropic when one model server plays every ferrus role:
    each claude process is one role, and the ferrus tools it is offered say which
    (``steps`` maps "executor" / "supervisor" to that role's scripted turns, answered in
    order, then "Done.")."""
    def turn(request):
        names = [tool.get("name", "") for tool in request.get("tools") or []]
        role = "executor" if any(n.startswith("mcp__ferrus-executor-1__") for n in names) \
            else "supervisor"
        done = sum(1 for m in request.get("messages", []) if m.get("role") == "assistant")
        return [steps[role][done]] if done < len(steps[role]) else [text("Done.")]
    return turn


def claude_env(fake, home):
    """A copy of os.environ for running `claude` against `fake` with HOME=`home`
    (an isolated temp dir); the directory of `find_claude()` is put on PATH."""
    env = dict(os.environ)
    for name in _SCRUB:
        env.pop(name, None)
    home = str(home)
    env.update({
        "ANTHROPIC_BASE_URL": fake.url,
        "ANTHROPIC_API_KEY": "sk-ant-fake-key-for-tests",
        "HOME": home,
        "XDG_CONFIG_HOME": os.path.join(home, ".config"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    })
    claude = find_claude()
    if claude:
        directory = os.path.dirname(claude)
        path = env.get("PATH", "")
        if directory not in path.split(os.pathsep):
            env["PATH"] = directory + (os.pathsep + path if path else "")
    return env
