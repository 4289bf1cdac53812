"""nano's model side: [agents.nano] settings and the chat-completions client.

nano (nano.py) and the tool-calling probe (probe.py) talk to a model server through
this: the settings of ``[agents.nano]`` validated key by key, the endpoint they name
(loopback only unless allow_remote), and a client of the OpenAI chat completions API
(Ollama, vLLM, llama.cpp's llama-server, LM Studio).  The client keeps one HTTP
connection open for a session, sends the conversation and the offered tools, and folds
the streamed answer (server-sent events) into text, tool calls and the usage the
server reports; transient failures are retried, every other one becomes a message
that says what to check.
"""

import contextlib
import dataclasses
import json
import os
import threading
import time

from .basics import FerrusError, __version__, deferred_dataclass, did_you_mean, fields_of
from .config import CONFIG_FILE
from .operations import ROLES


# -- settings ([agents.nano] in ferrus.toml) -------------------------------------------

NANO_DEFAULT_BASE_URL = "http://127.0.0.1:11434/v1"


@deferred_dataclass
class NanoSettings:
    """``[agents.nano]``: the model server, the model, and one session's budgets."""

    base_url: str = NANO_DEFAULT_BASE_URL   # Ollama's; vLLM :8000/v1, llama-server :8080/v1
    model: str = ""                # "" = [hq.<role>] model, else the server's only model
    api_key_env: str = ""          # the variable holding a bearer key ("": none is sent)
    max_tokens: int = 4096         # per model answer
    temperature: float = 0.2
    context_tokens: int = 32768    # the model's context window as the server runs it
    max_session_tokens: int = 200000
    max_session_secs: int = 1800
    max_tool_calls: int = 200
    request_timeout_secs: int = 600
    command_timeout_secs: int = 120
    allow_remote: bool = False     # a base_url that is not this machine (loopback)


# key -> (lowest, highest) for the whole-number settings.
_NANO_INT_RANGES = {"max_tokens": (1, 1 << 20), "context_tokens": (256, 1 << 24),
                    "max_session_tokens": (1, 1 << 40), "max_session_secs": (1, 7 * 86400),
                    "max_tool_calls": (1, 1 << 20), "request_timeout_secs": (1, 86400),
                    "command_timeout_secs": (1, 86400)}


def nano_setting_problems(table, where="%s [agents.nano]" % CONFIG_FILE):
    """(NanoSettings, [FerrusError]) from an ``[agents.nano]`` table: every bad or
    unknown key is one problem, and keeps its default."""
    settings, problems = NanoSettings(), []
    known = [field.name for field in fields_of(NanoSettings)]

    def problem(key, expected, value):
        problems.append(FerrusError("%s %s %s, got %s" % (where, key, expected,
                                                          json.dumps(value, default=str)),
                                    "fix %s under [agents.nano] in %s (docs/LOCAL_MODELS.md "
                                    "lists the settings)" % (key, CONFIG_FILE)))
    for key, value in (table or {}).items():
        if key not in known:
            close = did_you_mean(key, known)
            problems.append(FerrusError("%s has no setting %s" % (where, key),
                                        "did you mean %s?" % close if close else
                                        "the settings are: %s" % ", ".join(known)))
        elif key in _NANO_INT_RANGES:
            low, high = _NANO_INT_RANGES[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                problem(key, "must be a whole number from %d to %d" % (low, high), value)
            else:
                setattr(settings, key, value)
        elif key == "temperature":
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value <= 2:
                problem(key, "must be a number from 0 to 2", value)
            else:
                settings.temperature = float(value)
        elif key == "allow_remote":
            if not isinstance(value, bool):
                problem(key, "must be true or false", value)
            else:
                settings.allow_remote = value
        elif not isinstance(value, str):
            problem(key, "must be a string", value)
        else:
            setattr(settings, key, value.strip())
    if settings.max_tokens >= settings.context_tokens:
        problem("max_tokens", "must be below context_tokens (%d): the answer shares the "
                              "context with the conversation" % settings.context_tokens,
                settings.max_tokens)
        settings.max_tokens = max(1, settings.context_tokens // 4)
    return settings, problems


def nano_settings_findings(config):
    """[(problem, hint)] of [agents.nano] for `ferrus doctor`: every bad key, when a role
    uses nano or the table exists."""
    table = config.agents.options_for("nano").settings
    uses = any(getattr(getattr(config, role, None), "agent", None) == "nano" for role in ROLES)
    if not table and not uses:
        return []
    settings, problems = nano_setting_problems(table)
    found = [(err.message, err.hint or "") for err in problems]
    if not problems:
        try:
            nano_endpoint(settings)
        except FerrusError as err:
            found.append((err.message, err.hint or ""))
    return found


def nano_settings(config):
    """The validated [agents.nano] settings of a loaded config (the first problem raised)."""
    table = config.agents.options_for("nano").settings
    settings, problems = nano_setting_problems(table)
    if problems:
        raise problems[0]
    return settings


@deferred_dataclass
class NanoEndpoint:
    """Where the chat completions API is: parsed from base_url and checked."""

    scheme: str
    host: str
    port: int
    path: str          # the base path, e.g. /v1 (no trailing /)
    loopback: bool

    @property
    def url(self):
        host = "[%s]" % self.host if ":" in self.host else self.host
        return "%s://%s:%d%s" % (self.scheme, host, self.port, self.path)


def _is_loopback(host):
    import ipaddress
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def nano_endpoint(settings):
    """The endpoint of ``settings.base_url``; a remote one only with allow_remote."""
    import urllib.parse
    where = "[agents.nano] base_url %s" % json.dumps(settings.base_url)
    hint = 'e.g. base_url = "%s" (Ollama), "http://127.0.0.1:8080/v1" (llama-server) or ' \
           '"http://127.0.0.1:8000/v1" (vLLM)' % NANO_DEFAULT_BASE_URL
    try:
        parts = urllib.parse.urlsplit(settings.base_url)
        port = parts.port
    except ValueError as err:
        raise FerrusError("%s is not a URL: %s" % (where, err), hint) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FerrusError("%s is not an http:// or https:// URL" % where, hint)
    if parts.username or parts.password or parts.query or parts.fragment:
        raise FerrusError("%s must not carry a user, password, query or fragment" % where,
                          "put a key in an environment variable and name it with "
                          "api_key_env under [agents.nano]")
    endpoint = NanoEndpoint(parts.scheme, parts.hostname,
                            port or (443 if parts.scheme == "https" else 80),
                            parts.path.rstrip("/"), _is_loopback(parts.hostname))
    if not endpoint.loopback and not settings.allow_remote:
        raise FerrusError("%s is not on this machine: nano talks to loopback model servers "
                          "unless told otherwise" % where,
                          "nano sends the project's code to that server; if you mean it, set "
                          "allow_remote = true under [agents.nano] in %s" % CONFIG_FILE)
    return endpoint


def nano_api_key(settings, environ=None):
    """The bearer key named by api_key_env (None when no key is configured)."""
    if not settings.api_key_env:
        return None
    key = (environ if environ is not None else os.environ).get(settings.api_key_env, "")
    if not key.strip():
        raise FerrusError("[agents.nano] api_key_env names %s, which is not set"
                          % settings.api_key_env,
                          "export %s=<key> before ferrus starts nano, or remove api_key_env "
                          "(local servers need no key)" % settings.api_key_env)
    return key.strip()


# -- the chat completions client ------------------------------------------------------

class NanoModelError(FerrusError):
    """The model server failed a request; ``retryable`` when trying again may help."""

    def __init__(self, message, hint=None, retryable=False):
        super().__init__(message, hint)
        self.retryable = retryable


@deferred_dataclass
class NanoToolCall:
    """One tool call as the model streamed it (arguments still raw JSON text)."""

    call_id: str
    name: str
    arguments: str


@deferred_dataclass
class NanoTurn:
    """One model answer: its text, its tool calls, and the usage the server reported."""

    text: str = ""
    tool_calls: list = dataclasses.field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: "int | None" = None
    completion_tokens: "int | None" = None
    model: str = ""


NANO_MAX_RESPONSE_BYTES = 16 * 1024 * 1024
NANO_MAX_LINE_BYTES = 1 << 20
_RETRYABLE_STATUS = (408, 429, 500, 502, 503, 504)


def _usage_numbers(turn, usage):
    if isinstance(usage, dict):
        for field, key in (("prompt_tokens", "prompt_tokens"),
                           ("completion_tokens", "completion_tokens")):
            value = usage.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                setattr(turn, field, value)


def fold_chat_stream(lines):
    """A NanoTurn from the server-sent events of a streamed chat completion.

    ``lines`` are the raw lines (bytes or str).  Tool calls come in pieces keyed by
    their index: the first piece has the id and name, the arguments arrive as text
    fragments (llama-server) or whole (Ollama).

    A stream that ends with neither [DONE] nor a finish_reason was cut off (the
    server or the connection failed): its half an answer is an error, never taken as
    what the model meant."""
    turn, text, calls, done = NanoTurn(), [], {}, False
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue                      # comments (": keep-alive"), event: lines, blanks
        payload = line[5:].strip()
        if done or payload == "[DONE]":
            # Read on to the end of the response, so the kept connection is clean.
            done = True
            continue
        try:
            chunk = json.loads(payload)
        except ValueError:
            raise NanoModelError("the model server streamed a line that is not JSON: %s"
                                 % payload[:200]) from None
        if not isinstance(chunk, dict):
            continue
        if chunk.get("error"):
            raise NanoModelError("the model server reported an error mid-answer: %s"
                                 % _error_text(chunk), retryable=True)
        turn.model = str(chunk.get("model") or turn.model)
        _usage_numbers(turn, chunk.get("usage"))
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            if isinstance(delta.get("content"), str):
                text.append(delta["content"])
            for position, piece in enumerate(delta.get("tool_calls") or []):
                if not isinstance(piece, dict):
                    continue
                index = piece.get("index", position)
                call = calls.setdefault(index, {"id": "", "name": "", "arguments": []})
                call["id"] = piece.get("id") or call["id"]
                function = piece.get("function") or {}
                if not call["name"] and function.get("name"):
                    call["name"] = str(function["name"])
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    call["arguments"].append(arguments)
                elif arguments is not None:            # a server that sends an object
                    call["arguments"].append(json.dumps(arguments))
            if choice.get("finish_reason"):
                turn.finish_reason = str(choice["finish_reason"])
    if not done and not turn.finish_reason:
        raise NanoModelError("the model server's answer broke off before its end (no "
                             "finish_reason, no [DONE]): the server or the connection "
                             "failed, not the model", "see the model server's own log",
                             retryable=True)
    turn.text = "".join(text)
    turn.tool_calls = [NanoToolCall(call["id"] or "call_%d" % index, call["name"],
                                    "".join(call["arguments"]))
                       for index, call in calls.items()]
    return turn


def turn_from_completion(body):
    """A NanoTurn from a non-streamed chat completion (a server that ignored stream)."""
    choice = ((body.get("choices") or [{}])[0]) if isinstance(body, dict) else {}
    message = choice.get("message") or {}
    turn = NanoTurn(text=message.get("content") if isinstance(message.get("content"), str)
                    else "", finish_reason=str(choice.get("finish_reason") or ""),
                    model=str(body.get("model") or ""))
    for index, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        arguments = function.get("arguments")
        turn.tool_calls.append(NanoToolCall(
            call.get("id") or "call_%d" % index, str(function.get("name") or ""),
            arguments if isinstance(arguments, str) else json.dumps(arguments or {})))
    _usage_numbers(turn, body.get("usage"))
    return turn


def _error_text(body):
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or json.dumps(error))
    if error:
        return str(error)
    return json.dumps(body)[:500] if body else ""


class ChatCompletionsClient:
    """The OpenAI chat completions API over one kept-alive HTTP connection.

    http.client (what urllib.request uses underneath) keeps the connection open
    between turns, which a local server answers in well under a millisecond; proxies
    are not used, so HTTP_PROXY never sends a loopback request elsewhere.  Transient
    failures (connection refused or reset, 408/429/5xx, an answer cut off) are
    retried ``retries`` times with a growing pause.  ``timeout`` bounds a whole
    answer, not only the silence between its bytes; ``clock`` is monotonic
    (injectable)."""

    def __init__(self, endpoint, model, settings, api_key=None, sleep=time.sleep,
                 retries=2, timeout=None, clock=time.monotonic):
        self.endpoint = endpoint
        self.model = model
        self.settings = settings
        self.api_key = api_key
        self.sleep = sleep
        self.retries = retries
        self.timeout = timeout or settings.request_timeout_secs
        self.clock = clock
        self._connection = None
        self._deadline = None        # clock() by which the answer in flight must be in
        self._limit = self.timeout   # the seconds that deadline allowed

    def _connect(self):
        import socket
        import http.client      # here, not at the top: every other command starts without it
        if self._connection is None:
            kind = http.client.HTTPSConnection if self.endpoint.scheme == "https" \
                else http.client.HTTPConnection
            self._connection = kind(self.endpoint.host, self.endpoint.port, timeout=self.timeout)
        if self._connection.sock is None:
            self._connection.connect()
            # A request goes out as headers then body: without this, Nagle's algorithm
            # holds the body until the server's delayed ACK, 40 ms a turn on Linux.
            with contextlib.suppress(OSError, AttributeError):
                self._connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._connection

    def close(self):
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _headers(self, stream):
        headers = {"Content-Type": "application/json",
                   "Accept": "text/event-stream" if stream else "application/json",
                   "User-Agent": "ferrus-nano/%s" % __version__}
        if self.api_key:
            headers["Authorization"] = "Bearer " + self.api_key
        return headers

    def _send(self, method, path, body=None, stream=False):
        """One request on the kept connection: (status, content type, response).  A
        kept connection the server closed in the meantime is reopened once."""
        import http.client
        data = json.dumps(body).encode("utf-8") if body is not None else None
        for attempt in (1, 2):
            fresh = self._connection is None or self._connection.sock is None
            try:
                connection = self._connect()
                self._bound_socket()
                connection.request(method, self.endpoint.path + path, body=data,
                                   headers=self._headers(stream))
                response = connection.getresponse()
                return response.status, response.getheader("Content-Type") or "", response
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if fresh or attempt == 2:
                    raise
            except BaseException:
                self.close()
                raise
        raise AssertionError("unreachable")

    def _request(self, method, path, body=None, stream=False):
        """_send with the retries; returns (content type, response) of a 200 answer."""
        pause = 1.0
        for attempt in range(self.retries + 1):
            try:
                return self._request_once(method, path, body, stream)
            except NanoModelError as err:
                if not err.retryable or attempt == self.retries:
                    raise
            self.sleep(pause)
            pause *= 3
        raise AssertionError("unreachable")

    def _request_once(self, method, path, body, stream):
        import socket
        import http.client
        url = self.endpoint.url + path
        try:
            status, content_type, response = self._send(method, path, body, stream)
        except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError,
                http.client.RemoteDisconnected) as err:
            raise NanoModelError("cannot reach the model server at %s: %s" % (url, err),
                                 "start the server (ollama serve, llama-server, vllm serve, LM "
                                 "Studio's server) or fix [agents.nano] base_url in %s"
                                 % CONFIG_FILE, retryable=True) from None
        except socket.timeout:
            raise self._timed_out() from None
        except OSError as err:
            raise NanoModelError("cannot reach the model server at %s: %s" % (
                url, err.strerror or err), "check [agents.nano] base_url in %s" % CONFIG_FILE,
                retryable=True) from None
        if status != 200:
            raw = response.read(65536)
            self.close()
            try:
                detail = _error_text(json.loads(raw.decode("utf-8", "replace")))
            except ValueError:
                detail = " ".join(raw.decode("utf-8", "replace").split())[:500]
            raise NanoModelError("the model server answered HTTP %d to POST %s: %s" % (
                status, url, detail or "(no message)"), _status_hint(status, self.model),
                retryable=status in _RETRYABLE_STATUS)
        return content_type, response

    def _timed_out(self):
        self.close()
        return NanoModelError("the model server at %s did not answer within %d s"
                              % (self.endpoint.url, self._limit),
                              "a slow model needs more time: raise [agents.nano] "
                              "request_timeout_secs")

    def _time_left(self):
        """Seconds left before the answer's deadline; the timeout error when none."""
        if self._deadline is None:
            return self.timeout
        left = self._deadline - self.clock()
        if left <= 0:
            raise self._timed_out()
        return left

    def _bound_socket(self):
        """The socket waits no longer than the answer's deadline allows."""
        connection = self._connection
        if connection is not None and connection.sock is not None:
            with contextlib.suppress(OSError):
                connection.sock.settimeout(max(0.001, min(self.timeout, self._time_left())))

    def complete(self, messages, tools, within_secs=None):
        """One model turn: the conversation and the offered tools in, a NanoTurn out.

        The whole answer, retries included, takes at most request_timeout_secs, or
        ``within_secs`` when that is less (what is left of a session's budget)."""
        self._limit = self.timeout if within_secs is None else \
            max(0, min(self.timeout, int(round(within_secs))))
        self._deadline = self.clock() + (self.timeout if within_secs is None else
                                         min(self.timeout, within_secs))
        # A server that trickles bytes never lets the socket's timeout fire: at the
        # deadline the watchdog shuts the socket, and the read in progress ends.
        watchdog = threading.Timer(max(0.0, self._deadline - self.clock()) + 0.05,
                                   self._expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            pause = 1.0
            for attempt in range(self.retries + 1):
                try:
                    return self._complete_once(messages, tools)
                except NanoModelError as err:
                    if not err.retryable or attempt == self.retries or \
                            self._deadline - self.clock() <= pause:
                        raise
                self.sleep(pause)
                pause *= 3
            raise AssertionError("unreachable")
        finally:
            watchdog.cancel()
            self._deadline = None

    def _expire(self):
        import socket
        sock = getattr(self._connection, "sock", None)
        if self._deadline is not None:
            self._deadline = self.clock()        # every later check says: timed out
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _complete_once(self, messages, tools):
        import socket
        import http.client
        self._time_left()
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": self.settings.max_tokens,
                "temperature": self.settings.temperature}
        if tools:
            body["tools"] = tools
            body["tool_choice"] = "auto"
        content_type, response = self._request_once("POST", "/chat/completions", body,
                                                    stream=True)
        try:
            if "json" in content_type:
                raw = response.read(NANO_MAX_RESPONSE_BYTES + 1)
                if len(raw) > NANO_MAX_RESPONSE_BYTES:
                    raise NanoModelError("the model's answer is over %d MB"
                                         % (NANO_MAX_RESPONSE_BYTES >> 20))
                return turn_from_completion(json.loads(raw.decode("utf-8", "replace")))
            turn = fold_chat_stream(self._bounded_lines(response))
            # readline() never marks the response done; read() does, so the kept
            # connection takes the next request.
            response.read()
            return turn
        except socket.timeout:
            raise self._timed_out() from None
        except (OSError, http.client.HTTPException, ValueError, NanoModelError) as err:
            self.close()
            self._time_left()               # the deadline cut it: a timeout
            if isinstance(err, NanoModelError):
                raise
            raise NanoModelError("the model's answer broke off: %s" % err,
                                 retryable=True) from None

    def _bounded_lines(self, response):
        total = 0
        while True:
            self._bound_socket()
            line = response.readline(NANO_MAX_LINE_BYTES + 1)
            if not line:
                return
            if len(line) > NANO_MAX_LINE_BYTES:
                raise NanoModelError("the model server streamed a line longer than the "
                                     "limit of %d MB (NANO_MAX_LINE_BYTES): %s…" % (
                                         NANO_MAX_LINE_BYTES >> 20,
                                         line[:80].decode("utf-8", "replace")),
                                     "one server-sent event is one line; a longer one is "
                                     "a broken server or a model's runaway answer: see "
                                     "the model server's own log")
            self._time_left()
            total += len(line)
            if total > NANO_MAX_RESPONSE_BYTES:
                raise NanoModelError("the model's answer is over %d MB"
                                     % (NANO_MAX_RESPONSE_BYTES >> 20))
            yield line

    def list_models(self):
        """The model ids the server offers (GET /models)."""
        _content_type, response = self._request("GET", "/models")
        try:
            body = json.loads(response.read().decode("utf-8", "replace"))
        except ValueError:
            return []
        return [str(entry.get("id")) for entry in (body.get("data") or [])
                if isinstance(entry, dict) and entry.get("id")]


def _status_hint(status, model):
    if status in (401, 403):
        return ("the server wants a key: export it in a variable and name that variable with "
                "api_key_env under [agents.nano]")
    if status == 404:
        return ("check the model name (%s; `ollama list` shows what Ollama has) and that "
                "base_url ends with /v1" % json.dumps(model))
    if status == 400:
        return ("the server refused the request: a model without tool support, or "
                "context_tokens larger than the server's context (e.g. Ollama's num_ctx, "
                "llama-server's --ctx-size)")
    return "see the model server's own log"


def resolve_nano_model(client, configured):
    """The model to ask: the configured one, else the server's only model."""
    if configured:
        return configured
    models = client.list_models()
    if len(models) == 1:
        return models[0]
    raise FerrusError("nano has no model to use: %s" % (
        "the server offers %s" % ", ".join(models[:10]) if models else
        "the server lists none"),
        "set model under [agents.nano] in %s, or register with a model: ferrus register "
        "--executor nano --executor-model <model>" % CONFIG_FILE)
