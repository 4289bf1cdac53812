"""Scripted stand-ins for the model APIs of Codex, Qwen Code and Gemini CLI.

Standard library only (http.server + threading), Python 3.9+.  Together with
tests/fake_anthropic.py (Claude Code) this drives every real agent CLI offline:
the CLI, its MCP connection and the ferrus server are real, only the model is
scripted.  One server answers all three wire protocols:

* OpenAI Responses API (Codex): ``POST .../responses``, streamed as server-sent
  events ``response.created``, ``response.output_item.added`` /
  ``response.output_text.delta`` / ``response.output_item.done``,
  ``response.completed``.  Point Codex at it with a ``model_providers`` entry
  (see `codex_args`).
* OpenAI chat completions (Qwen Code): ``POST .../chat/completions``, streamed
  as ``chat.completion.chunk`` events ending with ``data: [DONE]`` (or one JSON
  completion when ``stream`` is false).  See `qwen_env`.
* Gemini API (Gemini CLI): ``POST .../models/M:streamGenerateContent?alt=sse``
  and ``:generateContent`` (plus ``:countTokens``).  See `gemini_env`.

A script is a function ``turn(conversation) -> [action, ...]`` called once per
*main* request (one that offers tools).  `Conversation` is the same whatever
the protocol: the offered tool names, the tool calls made so far with their
outputs, and the user text.  Actions are `call(name, args)` and `say(text)`.
Requests without tools (a CLI's own side requests: routing, next-speaker
checks, titles) get a short reply that fits any JSON schema they ask for.
"""

import json
import os
import random
import string
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fake_anthropic import _schema_instance, find_agent

_ALNUM = string.ascii_letters + string.digits


def _random_id(prefix, length=20):
    return prefix + "".join(random.choice(_ALNUM) for _ in range(length))


# --------------------------------------------------------------------------- script side

def call(name, args=None):
    """The model calls tool ``name`` (an offered name, or a suffix of one) with ``args``."""
    return {"type": "call", "name": name, "args": dict(args or {})}


def raw_call(name, arguments, exact=False):
    """The model calls tool ``name`` with ``arguments`` exactly as given: text that need
    not be JSON (a model's malformed tool call; chat completions only).  ``exact``: the
    name as given, even one the client does not offer."""
    return {"type": "call", "name": name, "args": {}, "raw": str(arguments), "exact": exact}


def say(text):
    """The model answers with text; a turn of only text ends the CLI's run."""
    return {"type": "text", "text": str(text)}


class Conversation:
    """One main request, protocol-independent.

    tools   the tool names the CLI offers the model
    calls   [(name, args, output_text)] of the tool calls already made, in order
    prompt  the user text of the conversation (the prompt the CLI was given)
    """

    def __init__(self, protocol, tools, calls, prompt, body):
        self.protocol = protocol
        self.tools = tools
        self.calls = calls
        self.prompt = prompt
        self.body = body

    def tool(self, suffix):
        """The offered tool whose name is ``suffix`` or ends with it (ferrus's tools
        are offered under CLI-specific prefixes, e.g. ``mcp__ferrus-executor-1__check``)."""
        matches = [name for name in self.tools if name == suffix or name.endswith(suffix)]
        if not matches:
            raise LookupError("no offered tool ends with %r; offered: %s" % (suffix, self.tools))
        return min(matches, key=len)

    def offers(self, suffix):
        return any(name == suffix or name.endswith(suffix) for name in self.tools)


def _resolve(conversation, actions):
    """Normalise a script's reply: a list of actions, names resolved against the offer."""
    if isinstance(actions, (dict, str)):
        actions = [actions]
    out = []
    for action in actions or [say("")]:
        if isinstance(action, str):
            action = say(action)
        if action["type"] == "call":
            name = action["name"] if action.get("exact") else conversation.tool(action["name"])
            action = dict(action, name=name, id=_random_id("call_"))
        out.append(action)
    return out or [say("")]


# --------------------------------------------------------------------------- protocols
#
# Each protocol reads a request body into a Conversation and renders actions
# as its reply (streamed or not).

def _sse(data, event=None):
    head = "event: %s\n" % event if event else ""
    return ("%sdata: %s\n\n" % (head, json.dumps(data))).encode("utf-8")


def _tokens(body):
    return max(1, len(json.dumps(body)) // 4)


# Codex offers each MCP server's tools as a "namespace" tool; the conversation
# names them namespace + this + tool, and calls carry the namespace back.
NAMESPACE_SEPARATOR = "/"


class Responses:
    """OpenAI Responses API, as Codex uses it."""

    name = "responses"

    @staticmethod
    def conversation(body):
        tools = []
        for tool in body.get("tools") or []:
            if tool.get("type") == "namespace":      # MCP tools grouped per server
                tools += ["%s%s%s" % (tool.get("name"), NAMESPACE_SEPARATOR, t.get("name", ""))
                          for t in tool.get("tools") or []]
            else:
                tools.append(tool.get("name") or tool.get("type", ""))
        outputs, calls, prompt = {}, [], []
        items = body.get("input") or []
        for item in items:
            if item.get("type") in ("function_call_output", "custom_tool_call_output"):
                output = item.get("output")
                outputs[item.get("call_id")] = output if isinstance(output, str) \
                    else json.dumps(output)
        for item in items:
            kind = item.get("type")
            if kind in ("function_call", "custom_tool_call"):
                raw = item.get("arguments", item.get("input", ""))
                try:
                    args = json.loads(raw) if kind == "function_call" else {"input": raw}
                except ValueError:
                    args = {"raw": raw}
                name = item.get("name", "")
                if item.get("namespace"):
                    name = item["namespace"] + NAMESPACE_SEPARATOR + name
                calls.append((name, args, outputs.get(item.get("call_id"), "")))
            elif kind == "message" and item.get("role") == "user":
                for part in item.get("content") or []:
                    if isinstance(part, dict) and part.get("type") == "input_text":
                        prompt.append(part.get("text", ""))
        return Conversation("responses", tools, calls, "\n".join(prompt), body)

    @staticmethod
    def _items(actions):
        items = []
        for action in actions:
            if action["type"] == "call":
                item = {"type": "function_call", "id": _random_id("fc_"), "call_id": action["id"],
                        "name": action["name"], "arguments": json.dumps(action["args"]),
                        "status": "completed"}
                if NAMESPACE_SEPARATOR in action["name"]:
                    item["namespace"], item["name"] = action["name"].split(NAMESPACE_SEPARATOR, 1)
                items.append(item)
            else:
                items.append({"type": "message", "id": _random_id("msg_"), "role": "assistant",
                              "status": "completed",
                              "content": [{"type": "output_text", "text": action["text"],
                                           "annotations": []}]})
        return items

    @classmethod
    def reply(cls, body, actions):
        response_id = _random_id("resp_")
        items = cls._items(actions)
        usage = {"input_tokens": _tokens(body), "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": _tokens(items), "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": _tokens(body) + _tokens(items)}
        base = {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": body.get("model") or "fake", "status": "in_progress", "output": []}
        if not body.get("stream"):
            return "application/json", json.dumps(dict(base, status="completed", output=items,
                                                       usage=usage)).encode()
        seq = iter(range(1_000_000))
        events = [_sse({"type": "response.created", "sequence_number": next(seq),
                        "response": base}, "response.created")]
        for index, item in enumerate(items):
            added = dict(item, status="in_progress")
            if item["type"] == "message":
                added["content"] = []
            elif item["type"] == "function_call":
                added["arguments"] = ""
            events.append(_sse({"type": "response.output_item.added", "output_index": index,
                                "sequence_number": next(seq), "item": added},
                               "response.output_item.added"))
            if item["type"] == "message":
                text = item["content"][0]["text"]
                events.append(_sse({"type": "response.output_text.delta", "item_id": item["id"],
                                    "output_index": index, "content_index": 0, "delta": text,
                                    "sequence_number": next(seq)}, "response.output_text.delta"))
            else:
                events.append(_sse({"type": "response.function_call_arguments.delta",
                                    "item_id": item["id"], "output_index": index,
                                    "delta": item["arguments"], "sequence_number": next(seq)},
                                   "response.function_call_arguments.delta"))
            events.append(_sse({"type": "response.output_item.done", "output_index": index,
                                "sequence_number": next(seq), "item": item},
                               "response.output_item.done"))
        events.append(_sse({"type": "response.completed", "sequence_number": next(seq),
                            "response": dict(base, status="completed", output=items,
                                             usage=usage)}, "response.completed"))
        return "text/event-stream", b"".join(events)

    @staticmethod
    def side_reply(body):
        return [say("OK")]


class ChatCompletions:
    """OpenAI chat completions, as Qwen Code uses it."""

    name = "chat"

    @staticmethod
    def conversation(body):
        tools = [(tool.get("function") or {}).get("name", "") for tool in body.get("tools") or []]
        outputs, calls, prompt = {}, [], []
        messages = body.get("messages") or []
        for message in messages:
            if message.get("role") == "tool":
                outputs[message.get("tool_call_id")] = _text_of(message.get("content"))
        for message in messages:
            if message.get("role") == "assistant":
                for tool_call in message.get("tool_calls") or []:
                    function = tool_call.get("function") or {}
                    try:
                        args = json.loads(function.get("arguments") or "{}")
                    except ValueError:
                        args = {"raw": function.get("arguments")}
                    calls.append((function.get("name", ""), args,
                                  outputs.get(tool_call.get("id"), "")))
            elif message.get("role") == "user":
                prompt.append(_text_of(message.get("content")))
        return Conversation("chat", tools, calls, "\n".join(prompt), body)

    @staticmethod
    def reply(body, actions):
        completion_id = _random_id("chatcmpl-")
        model = body.get("model") or "fake"
        tool_calls = [{"index": i, "id": a["id"], "type": "function",
                       "function": {"name": a["name"],
                                    "arguments": a["raw"] if "raw" in a else json.dumps(a["args"])}}
                      for i, a in enumerate(a for a in actions if a["type"] == "call")]
        content = "".join(a["text"] for a in actions if a["type"] == "text")
        finish = "tool_calls" if tool_calls else "stop"
        usage = {"prompt_tokens": _tokens(body), "completion_tokens": _tokens(actions),
                 "total_tokens": _tokens(body) + _tokens(actions)}
        if not body.get("stream"):
            message = {"role": "assistant", "content": content or None}
            if tool_calls:
                message["tool_calls"] = [dict(t) for t in tool_calls]
                for t in message["tool_calls"]:
                    t.pop("index")
            return "application/json", json.dumps({
                "id": completion_id, "object": "chat.completion", "created": int(time.time()),
                "model": model, "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}]}).encode()

        def chunk(delta, finish_reason=None, **extra):
            return _sse(dict({"id": completion_id, "object": "chat.completion.chunk",
                              "created": int(time.time()), "model": model,
                              "choices": [{"index": 0, "delta": delta,
                                           "finish_reason": finish_reason}]}, **extra))
        events = [chunk({"role": "assistant", "content": ""})]
        if content:
            events.append(chunk({"content": content}))
        for tool_call in tool_calls:
            events.append(chunk({"tool_calls": [tool_call]}))
        events.append(chunk({}, finish))
        events.append(_sse({"id": completion_id, "object": "chat.completion.chunk",
                            "created": int(time.time()), "model": model, "choices": [],
                            "usage": usage}))
        events.append(b"data: [DONE]\n\n")
        return "text/event-stream", b"".join(events)

    @staticmethod
    def side_reply(body):
        schema = None
        response_format = body.get("response_format") or {}
        if response_format.get("type") == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
        return [say(json.dumps(_schema_instance(schema)) if schema else "OK")]


class Gemini:
    """The Gemini API (generateContent / streamGenerateContent), as Gemini CLI uses it."""

    name = "gemini"

    @staticmethod
    def conversation(body):
        tools = [declaration.get("name", "") for tool in body.get("tools") or []
                 for declaration in tool.get("functionDeclarations") or []]
        calls, prompt, pending = [], [], []
        for content in body.get("contents") or []:
            for part in content.get("parts") or []:
                if "functionCall" in part:
                    function = part["functionCall"]
                    pending.append(len(calls))
                    calls.append((function.get("name", ""), function.get("args") or {}, ""))
                elif "functionResponse" in part:
                    response = part["functionResponse"]
                    for i, index in enumerate(pending):
                        if calls[index][0] == response.get("name"):
                            name, args, _ = calls[index]
                            calls[index] = (name, args, json.dumps(response.get("response")))
                            pending.pop(i)
                            break
                elif "text" in part and content.get("role") == "user":
                    prompt.append(part["text"])
        return Conversation("gemini", tools, calls, "\n".join(prompt), body)

    @staticmethod
    def _response(body, actions):
        parts = []
        for action in actions:
            if action["type"] == "call":
                parts.append({"functionCall": {"name": action["name"], "args": action["args"]}})
            else:
                parts.append({"text": action["text"]})
        prompt_tokens, output_tokens = _tokens(body), _tokens(actions)
        return {"candidates": [{"content": {"role": "model", "parts": parts},
                                "finishReason": "STOP", "index": 0}],
                "usageMetadata": {"promptTokenCount": prompt_tokens,
                                  "candidatesTokenCount": output_tokens,
                                  "totalTokenCount": prompt_tokens + output_tokens},
                "modelVersion": "gemini-fake", "responseId": _random_id("r")}

    @classmethod
    def reply(cls, body, actions, stream=False):
        response = cls._response(body, actions)
        if stream:
            return "text/event-stream", _sse(response)
        return "application/json", json.dumps(response).encode()

    @staticmethod
    def side_reply(body):
        config = body.get("generationConfig") or {}
        schema = config.get("responseJsonSchema") or config.get("responseSchema")
        if schema:
            return [say(json.dumps(_positive(_schema_instance(_lower_schema(schema)))))]
        return [say("OK")]


def _lower_schema(schema):
    """Gemini schemas spell types in capitals (OBJECT, STRING); JSON Schema does not."""
    if isinstance(schema, dict):
        out = {k: _lower_schema(v) for k, v in schema.items()}
        if isinstance(out.get("type"), str):
            out["type"] = out["type"].lower()
        return out
    if isinstance(schema, list):
        return [_lower_schema(v) for v in schema]
    return schema


def _positive(value):
    """Gemini CLI's routing classifier wants scores from 1 up; 0 is never needed."""
    if isinstance(value, dict):
        return {k: _positive(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_positive(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 1:
        return 1
    return value


def _text_of(content):
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


# --------------------------------------------------------------------------- server

class FakeModels:
    """The server.  ``script(conversation) -> actions`` answers every main request.

    Attributes (filled while serving): url, main (Conversations answered by the
    script, in order), side (bodies of side requests), log ((method, path, kind)),
    errors (tracebacks of script exceptions; the CLI gets an error text reply)."""

    def __init__(self, script):
        self.script = script
        self.url = None
        self.main = []
        self.side = []
        self.log = []
        self.errors = []
        self._lock = threading.Lock()
        self._server = None

    def start(self):
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = _Server(("127.0.0.1", 0), handler)
        self.url = "http://127.0.0.1:%d" % self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="fake-models",
                         daemon=True).start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def answer(self, protocol, body):
        conversation = protocol.conversation(body)
        if not conversation.tools:
            with self._lock:
                self.side.append(body)
            return "side", protocol.side_reply(body)
        with self._lock:
            self.main.append(conversation)
            try:
                return "main", _resolve(conversation, self.script(conversation))
            except Exception:
                self.errors.append(traceback.format_exc())
                return "main", [say("fake_models: script error:\n" + self.errors[-1])]

    def describe(self):
        lines = ["%s %s [%s]" % entry for entry in self.log]
        for conversation in self.main:
            lines.append("main %s: calls %s" % (conversation.protocol,
                                                [c[0] for c in conversation.calls]))
        return "\n".join(lines + self.errors)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A CLI that exits closes its keep-alive connections; that is not an error.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake = None

    def log_message(self, format, *args):
        if os.environ.get("FAKE_MODELS_DEBUG"):
            sys.stderr.write("fake_models: " + (format % args) + "\n")

    def _send(self, status, content_type, data):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _json(self, payload, status=200):
        self._send(status, "application/json", json.dumps(payload).encode())

    def _record(self, kind):
        with self.fake._lock:
            self.fake.log.append((self.command, self.path, kind))

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw.decode("utf-8")) if raw else {}
        except ValueError:
            body = {}
        path = self.path.split("?", 1)[0].rstrip("/")
        if os.environ.get("FAKE_MODELS_DEBUG"):
            sys.stderr.write("fake_models: POST %s %s\n" % (self.path, json.dumps(body)[:3000]))
        if path.endswith("/responses"):
            kind, actions = self.fake.answer(Responses, body)
            content_type, data = Responses.reply(body, actions)
        elif path.endswith("/chat/completions"):
            kind, actions = self.fake.answer(ChatCompletions, body)
            content_type, data = ChatCompletions.reply(body, actions)
        elif path.endswith(":streamGenerateContent") or path.endswith(":generateContent"):
            kind, actions = self.fake.answer(Gemini, body)
            content_type, data = Gemini.reply(body, actions,
                                              stream=path.endswith(":streamGenerateContent"))
        elif path.endswith(":countTokens"):
            kind, content_type = "count", "application/json"
            data = json.dumps({"totalTokens": _tokens(body)}).encode()
        else:
            self._record("unknown")
            return self._json({})
        self._record(kind)
        self._send(200, content_type, data)

    def do_GET(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        self._record("get")
        if path.endswith("/models"):
            return self._json({"object": "list", "data": [{"id": "fake", "object": "model"}],
                               "models": []})
        self._json({})


# --------------------------------------------------------------------------- running CLIs

_SCRUB_PREFIXES = ("OPENAI_", "GEMINI_", "GOOGLE_", "QWEN_", "CODEX_", "ANTHROPIC_",
                   "DASHSCOPE_")
_SCRUB = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")


def agent_env(home, extra=None):
    """os.environ for running an agent CLI offline with HOME=``home``: other
    providers' settings scrubbed, the agent directory on PATH, telemetry off."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB}
    home = str(home)
    env.update({"HOME": home, "XDG_CONFIG_HOME": os.path.join(home, ".config"),
                "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
                "NO_COLOR": "1", "CI": "1", "NO_BROWSER": "1"})
    for binary in ("codex", "qwen", "gemini", "claude"):
        found = find_agent(binary)
        if found:
            directory = os.path.dirname(found)
            if directory not in env.get("PATH", "").split(os.pathsep):
                env["PATH"] = directory + os.pathsep + env.get("PATH", "")
            break
    env.update(extra or {})
    return env
