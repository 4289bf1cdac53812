"""Probe: a short tool-calling exercise that tells if a model can drive ferrus.

Local models fail ferrus in one way above all: they do not call tools reliably.  The
probe finds that out in seconds, before a task is spent on it.  Each nano role's model
(its endpoint and model, deduplicated) gets one fixed exercise over the same client nano
uses: call lookup_word with an argument, read the word it returns (new each run, so it
cannot be guessed), call submit_word with exactly that word, then stop.  The verdict
names the first thing that went wrong — no tool calls (a model that only chats),
malformed JSON, the wrong tool, wrong arguments, no stop, a timeout, an unreachable or
failing server — with the latency and the tokens the server reported.

Agents other than nano are driven by their own CLIs, which the probe does not start;
their rows say so.  `ferrus doctor --probe` runs the same probe after its checks.
"""

import dataclasses
import json
import time

from .basics import FerrusError, deferred_dataclass, random_hex, say
from .config import load_config
from .operations import ROLES
from .nano_model import (ChatCompletionsClient, NanoModelError, nano_api_key,
                         nano_endpoint, nano_settings, resolve_nano_model)


PROBE_TIMEOUT_SECS = 120
PROBE_KEY = "ferrus"
PROBE_TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_word", "description": "Look up the secret word stored under a key.",
        "parameters": {"type": "object", "properties": {
            "key": {"type": "string", "description": "the key to look up"}},
            "required": ["key"]}}},
    {"type": "function", "function": {
        "name": "submit_word", "description": "Submit the secret word you looked up.",
        "parameters": {"type": "object", "properties": {
            "word": {"type": "string", "description": "the word, exactly as looked up"}},
            "required": ["word"]}}},
]
PROBE_PROMPT = ("This is a test of your tool calls. First call the tool lookup_word with "
                "key \"%s\". It returns a secret word. Then call submit_word with exactly "
                "that word. When submit_word has answered, reply with the single word DONE "
                "and call no more tools." % PROBE_KEY)


@deferred_dataclass
class ProbeVerdict:
    """What the probe found for one model."""

    passed: bool
    reason: str            # "" when passed; else no tool calls, malformed JSON, ...
    detail: str = ""
    hint: str = ""         # what to do about a server's failure (a fix: line)
    seconds: float = 0.0
    input_tokens: "int | None" = None
    output_tokens: "int | None" = None
    turns: int = 0


class _ProbeFailed(Exception):
    def __init__(self, reason, detail):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _one_call(turn, expected):
    """(name, arguments) of the single tool call ``expected`` in a model turn."""
    if not turn.tool_calls:
        said = " ".join((turn.text or "").split())
        raise _ProbeFailed("no tool calls", "the model answered in text instead of calling "
                           "%s%s" % (expected, ": %s" % json.dumps(said[:160]) if said
                                     else " (it said nothing)"))
    call = turn.tool_calls[0]
    if call.name != expected:
        raise _ProbeFailed("wrong tool", "the model called %s instead of %s"
                           % (json.dumps(call.name), expected))
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        raise _ProbeFailed("malformed JSON", "the arguments of %s are not JSON: %s"
                           % (expected, (call.arguments or "")[:160])) from None
    if not isinstance(arguments, dict):
        raise _ProbeFailed("malformed JSON", "the arguments of %s are not a JSON object: %s"
                           % (expected, (call.arguments or "")[:160]))
    return call, arguments


def probe_model(client, clock=time.monotonic, word=None):
    """Run the exercise against ``client`` (a ChatCompletionsClient); a ProbeVerdict."""
    word = word or "amber-" + random_hex(3)
    messages = [{"role": "user", "content": PROBE_PROMPT}]
    verdict = ProbeVerdict(False, "")
    started = clock()

    # The whole exercise, not each answer, has PROBE_TIMEOUT_SECS (by the client's clock).
    until = client.clock() + PROBE_TIMEOUT_SECS

    def ask():
        turn = client.complete(messages, PROBE_TOOLS, within_secs=until - client.clock())
        verdict.turns += 1
        for field, value in (("input_tokens", turn.prompt_tokens),
                             ("output_tokens", turn.completion_tokens)):
            if value is not None:
                setattr(verdict, field, (getattr(verdict, field) or 0) + value)
        return turn

    def answer(call, text):
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.call_id, "content": text})

    try:
        call, arguments = _one_call(ask(), "lookup_word")
        if arguments.get("key") != PROBE_KEY:
            raise _ProbeFailed("wrong arguments", "lookup_word got %s, not key %s"
                               % (json.dumps(arguments)[:160], json.dumps(PROBE_KEY)))
        answer(call, "The secret word is %s" % word)
        call, arguments = _one_call(ask(), "submit_word")
        if str(arguments.get("word", "")).strip().strip("\"'") != word:
            raise _ProbeFailed("wrong arguments", "submit_word got %s, not the word %s that "
                               "lookup_word returned" % (json.dumps(arguments)[:160], word))
        answer(call, "Accepted.")
        last = ask()
        if last.tool_calls:
            raise _ProbeFailed("did not stop", "after the exercise the model called %s "
                               "again instead of answering" % last.tool_calls[0].name)
        verdict.passed = True
    except _ProbeFailed as failed:
        verdict.reason, verdict.detail = failed.reason, failed.detail
    except NanoModelError as err:
        timed_out = "did not answer within" in err.message
        verdict.reason = "timeout" if timed_out else "server error"
        if timed_out and client.clock() >= until:
            err = NanoModelError("the model did not finish the exercise within %d s (%s)"
                                 % (PROBE_TIMEOUT_SECS, err.message), err.hint)
        verdict.detail, verdict.hint = err.message, err.hint or ""
    verdict.seconds = clock() - started
    return verdict


def probe_rows(root, clock=time.monotonic):
    """One row per role: its agent, and for nano the probe's verdict of its model (each
    distinct endpoint and model is probed once)."""
    config = load_config(root).require_hq()
    rows, verdicts = [], {}
    for role in ROLES:
        choice = getattr(config, role)
        row = {"role": role, "agent": choice.agent if choice else None}
        rows.append(row)
        if choice is None or choice.agent != "nano":
            row["probed"] = False
            row["note"] = ("no [hq.%s] agent" % role if choice is None else
                           "not probed: %s runs its own model client; the probe exercises "
                           "nano's models" % choice.agent)
            continue
        row["probed"] = True
        try:
            settings = nano_settings(config)
            endpoint = nano_endpoint(settings)
            row["endpoint"] = endpoint.url
            client = ChatCompletionsClient(endpoint, "", settings, nano_api_key(settings),
                                           retries=0, timeout=min(PROBE_TIMEOUT_SECS,
                                                                  settings.request_timeout_secs))
            client.model = resolve_nano_model(client, choice.model or settings.model)
        except FerrusError as err:
            row.update(model=choice.model or None, passed=False,
                       reason="not configured" if not isinstance(err, NanoModelError)
                       else "server error", detail=err.message, hint=err.hint or "")
            continue
        row["model"] = client.model
        key = (endpoint.url, client.model)
        if key not in verdicts:
            try:
                verdicts[key] = probe_model(client, clock)
            finally:
                client.close()
        row.update(dataclasses.asdict(verdicts[key]))
    return rows


PROBE_FAILURE_HINTS = {
    "no tool calls": "this model (or its server's chat template) does not make tool calls: "
                     "pick a model trained for tools, and turn the server's tool parser on "
                     "(llama-server --jinja, vllm serve --enable-auto-tool-choice "
                     "--tool-call-parser ...)",
    "malformed JSON": "the model writes broken tool arguments: nano repairs one in a row, "
                      "no more; try a larger or tool-tuned model, or a lower temperature",
    "wrong tool": "the model does not follow tool instructions; try a larger or tool-tuned "
                  "model",
    "wrong arguments": "the model does not carry a tool's result into its next call; try a "
                       "larger or tool-tuned model",
    "did not stop": "the model keeps calling tools; nano's budgets would stop it, but a "
                    "session would be wasted",
    "timeout": "the model is too slow for this machine; raise [agents.nano] "
               "request_timeout_secs or use a smaller model",
}


def add_probe_option(parser):
    """`--probe` on `ferrus agents` and `ferrus doctor`."""
    parser.add_argument("--probe", action="store_true",
                        help="run the tool-calling probe on each nano role's model: can it "
                             "drive ferrus? (pass or fail, why, time, tokens)")
    return parser


def report_probes(root, as_json=False, emit=say, clock=time.monotonic):
    """Print the probe rows (`ferrus agents --probe`); returns 1 when a probe failed."""
    rows = probe_rows(root, clock)
    if as_json:
        emit(json.dumps(rows, indent=2))
    else:
        for row in rows:
            emit(_probe_lines(row))
    return 1 if any(row.get("probed") and not row.get("passed") for row in rows) else 0


def _probe_lines(row):
    head = "%-10s %s" % (row["role"], row["agent"] or "(none)")
    if not row.get("probed"):
        return "%s\n           %s" % (head, row["note"])
    if row.get("model"):
        head += " (model %s%s)" % (row["model"], " at %s" % row["endpoint"]
                                   if row.get("endpoint") else "")
    tokens = "" if row.get("input_tokens") is None else ", %d tokens" % (
        (row.get("input_tokens") or 0) + (row.get("output_tokens") or 0))
    if row.get("passed"):
        return "%s\n           probe: pass — %d turns in %.1f s%s" % (
            head, row["turns"], row["seconds"], tokens)
    lines = [head, "           probe: FAIL — %s%s" % (row["reason"], ": " + row["detail"]
                                                        if row.get("detail") else "")]
    if row.get("seconds"):
        turns = row.get("turns", 0)
        lines.append("           after %d turn%s in %.1f s%s" % (
            turns, "" if turns == 1 else "s", row["seconds"], tokens))
    hint = PROBE_FAILURE_HINTS.get(row["reason"]) or row.get("hint")
    if hint:
        lines.append("           fix: %s" % hint)
    return "\n".join(lines)

