"""Agents: launching ferrus elsewhere, agent events, tool names, usage.

What every adapter shares: the boot code an MCP entry runs (this very ferrus.py, from
its cached bytecode), the events read from an agent's output (tool calls, failures,
usage) and the one name each tool is shown by, whichever CLI called it."""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys

from .basics import FERRUS_FILE, LazyPattern, compact_json, deferred_dataclass


DEFAULT_AGENT_INDEX = 1
STDIN_PROMPT_POINTER = "Follow the instructions given on standard input."


def server_key(role):
    """The MCP server name of a role; one per role, so register stays idempotent."""
    return "ferrus-%s-%d" % (role, DEFAULT_AGENT_INDEX)


def ferrus_boot_code(marked=True):
    """`python -c` code that imports *this* ferrus.py from its absolute path.

    Running `python ferrus.py` compiles the whole file on every start (about
    100 ms); importing it lets Python reuse the cached bytecode, so an agent's
    server starts about twice as fast.  The current folder ('' on sys.path) is
    dropped and ferrus.py is loaded by path rather than by putting its folder on
    sys.path, so a project's own queue.py or logging.py never hides the
    standard library.  FERRUS_LAUNCHER marks ferrus as started as a program, as the
    launcher does: a server makes only the dataclasses it uses (an agent's server
    starts once per session).  ``marked=False`` is the code an older ferrus
    registered (without the mark), still recognised as this ferrus."""
    return ("import sys; %ssys.path[:] = [p for p in sys.path if p]; "
            "import importlib.util as u; "
            "s = u.spec_from_file_location('ferrus', %r); f = u.module_from_spec(s); "
            "sys.modules['ferrus'] = f; s.loader.exec_module(f); sys.exit(f.main())"
            % ("FERRUS_LAUNCHER = True; " if marked else "", FERRUS_FILE))


# Variables coverage.py sets to measure the Python processes a test starts; it starts
# in them through a .pth file, which only `site` reads.
_COVERAGE_VARIABLES = ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG")


def ferrus_boot_argv():
    """[python, flags, "-c", boot code]: how ferrus starts itself (an agent's MCP server,
    nano, the sandbox's bridge).  ``-S`` skips `site`: ferrus needs nothing from
    site-packages (it is stdlib-only and loaded by path), and the .pth files there cost
    every start (8-25 ms, an agent's server starts once per session) — except while
    coverage.py measures subprocesses, which starts through one of them."""
    flags = [] if any(os.environ.get(name) for name in _COVERAGE_VARIABLES) else ["-S"]
    return [os.path.abspath(sys.executable)] + flags + ["-c", ferrus_boot_code()]


def _boot_args(args):
    """(boot code, the args after it) of an MCP entry's args, which start with
    ["-c", code] or ["-S", "-c", code]; (None, args) when they do not."""
    args = [str(arg) for arg in args]
    start = 1 if args[:1] == ["-S"] else 0
    if args[start:start + 1] != ["-c"] or len(args) < start + 2:
        return None, args
    return args[start + 1], args[start + 2:]


def ferrus_server_entry(root, role, agent):
    """command + args that start *this* ferrus (absolute interpreter and file)."""
    argv = ferrus_boot_argv()
    return {"command": argv[0],
            "args": argv[1:] + ["-C", os.path.abspath(root), "serve", "--role", role,
                                "--agent-name", agent, "--agent-index",
                                str(DEFAULT_AGENT_INDEX)]}


def entry_points_here(entry, root):
    """Does an MCP entry start this ferrus for this project?"""
    if not isinstance(entry, dict):
        return False
    code, rest = _boot_args(entry.get("args") or [])
    return (entry.get("command") == os.path.abspath(sys.executable)
            and code in (ferrus_boot_code(), ferrus_boot_code(marked=False))
            and os.path.abspath(root) in rest)


def entry_mismatch(entry, root):
    """Why an MCP entry does not start this ferrus for this project: (severity, text),
    or None when it does.  Another Python still works while it exists, so it is only
    a warning."""
    if not isinstance(entry, dict):
        return "error", "its MCP entry is not a JSON object / TOML table"
    args = [str(arg) for arg in entry.get("args") or []]
    project = args[args.index("-C") + 1] if "-C" in args[:-1] else None
    if project is None or os.path.abspath(project) != os.path.abspath(root):
        return "error", "its MCP entry serves another project (%s)" % (project or "none named")
    code, _ = _boot_args(args)
    older = code == ferrus_boot_code(marked=False)
    if code != ferrus_boot_code() and not older:
        code = code or " ".join(args[:2])
        named = re.search(r"'([^']+)'", code)
        return "error", "its MCP entry starts another ferrus or another version of it (%s)" % (
            named.group(1) if named else code[:80])
    command = str(entry.get("command") or "")
    if command != os.path.abspath(sys.executable):
        if not shutil.which(command):
            return "error", "its MCP entry starts ferrus with a Python that is gone (%s)" % command
        return "warning", ("registered with another Python (%s); this ferrus runs on %s"
                           % (command, os.path.abspath(sys.executable)))
    if older:
        return "warning", ("registered by an older ferrus: its server starts slower than "
                           "this ferrus's would")
    return None


def client_tool_timeout_secs(config):
    """Comfortably above one wait_* call, so no client cuts a long-poll short."""
    return config.limits.wait_timeout_secs + 120


@deferred_dataclass
class Launch:
    """How to start an agent CLI: argv, what goes to its stdin, extra environment."""

    argv: list
    stdin: "str | None" = None
    env: dict = dataclasses.field(default_factory=dict)


@deferred_dataclass
class AgentEvent:
    """Something an agent's structured output reported."""

    # tool_call | tool_result | said | usage | session | limit | model_output
    kind: str
    # tool_call, tool_result: the tool (as the CLI names it); session: the model, when
    # reported; said: "delta" when the text goes on the message before it (Gemini streams
    # a message in pieces)
    name: str = ""
    ok: "bool | None" = None  # tool_call, tool_result: whether the call worked, when known
    input_tokens: int = 0
    output_tokens: int = 0
    # usage: its message ("" for none); tool_call: tool_summary; tool_result: why it
    # failed (one line); said: what the model wrote
    text: str = ""
    cost_usd: "float | None" = None   # usage: the session's cost so far, when reported
    total: bool = False       # usage: the session's totals so far, replacing earlier counts
    turns: int = 0            # usage with total: the session's model turns, when reported
    context_tokens: int = 0   # usage: the context this turn's request held (0: not reported)
    call_id: str = ""         # tool_call, tool_result: the id that pairs a result with its call


# The argument that says most about a tool call, in the order looked for.
_TOOL_SUMMARY_KEYS = ("command", "cmd", "file_path", "path", "absolute_path", "pattern", "url",
                      "uri", "query", "description", "prompt", "content", "notes", "question",
                      "response")
# An MCP tool as each CLI names it: Claude Code and Qwen Code mcp__SERVER__TOOL, Gemini
# CLI mcp_SERVER_TOOL (its server names carry no "_"), Codex's parser SERVER/TOOL.
_MCP_TOOL_NAMES = (LazyPattern(r"^mcp__(.+?)__(.+)$"), LazyPattern(r"^mcp_([^_]+)_(.+)$"),
                   LazyPattern(r"^([^/\s]+)/([^/\s]+)$"))

# Each CLI's own tools under the one name ferrus shows, whichever CLI made the call
# (Claude Code's names, a shell is a Shell).  A tool not listed keeps its own name.
TOOL_NAMES = {
    "Bash": "Shell", "run_shell_command": "Shell", "shell": "Shell",
    "exec_command": "Shell", "local_shell": "Shell",
    "Read": "Read", "read_file": "Read", "read_many_files": "Read",
    "Write": "Write", "write_file": "Write",
    "Edit": "Edit", "MultiEdit": "Edit", "NotebookEdit": "Edit", "edit": "Edit",
    "replace": "Edit", "apply_patch": "Edit",
    "Glob": "Glob", "glob": "Glob",
    "Grep": "Grep", "grep_search": "Grep", "search_file_content": "Grep",
    "LS": "List", "list_directory": "List",
    "WebFetch": "WebFetch", "web_fetch": "WebFetch",
    "WebSearch": "WebSearch", "google_web_search": "WebSearch", "web_search": "WebSearch",
    "TodoWrite": "Todo", "todo_write": "Todo", "write_todos": "Todo",
    "Task": "Agent", "Agent": "Agent", "agent": "Agent", "invoke_agent": "Agent",
}


def tool_display_name(name):
    """The name a tool call is shown under: ferrus's own MCP tools as ``ferrus submit``,
    another MCP server's as ``server/tool``, each CLI's own tools by TOOL_NAMES."""
    name = str(name or "")
    if name in TOOL_NAMES:
        return TOOL_NAMES[name]
    for pattern in _MCP_TOOL_NAMES:
        match = pattern.match(name)
        if match:
            server, tool = match.groups()
            return "ferrus %s" % tool if server.startswith("ferrus") else "%s/%s" % (server,
                                                                                     tool)
    return name


def tool_line(slot, name, summary, root=None):
    """One tool call as a progress line: ``executor ▸ Write  src/a.py`` (the tool named by
    tool_display_name); paths under the project root are shown relative to it."""
    if root and summary:
        summary = summary.replace(os.path.join(root, ""), "")
    return "%s ▸ %s%s" % (slot, tool_display_name(name), "  " + summary if summary else "")


# A tool result that says the agent was not allowed the call, as the CLIs word it
# (opencode: "The user rejected permission to use this specific tool call.").
_TOOL_DENIED = LazyPattern(
    r"requires? (?:approval|permission)|permission (?:was )?(?:declined|denied)|"
    r"not enabled in this context|was blocked|not allowed|rejected by user approval|"
    r"read-only sandbox|blocked by (?:the )?(?:sandbox|policy)|"
    r"rejected permission", re.IGNORECASE)
TOOL_REASON_CHARS = 240


def tool_failure_line(slot, name, reason, root=None):
    """A failed tool call as a progress line: ``executor ✗ Shell failed: exit 2: …``
    (``denied`` when the agent was not allowed the call)."""
    if root and reason:
        reason = reason.replace(os.path.join(root, ""), "")
    return "%s ✗ %s %s%s" % (slot, tool_display_name(name) or "a tool",
                             "denied" if tool_denied(reason) else "failed",
                             ": " + reason if reason else "")


def tool_denied(reason):
    """Whether a failed tool call's reason says the agent was not allowed it."""
    return bool(_TOOL_DENIED.search(reason or ""))


def tool_reason(value, width=TOOL_REASON_CHARS):
    """Why a tool call failed, as one line: the text of a CLI's tool result (a string, or
    content blocks), its markup and a wrapped MCP error's JSON taken off, cut to ``width``."""
    if isinstance(value, list):
        value = " ".join(block.get("text", "") if isinstance(block, dict) else str(block)
                         for block in value)
    elif isinstance(value, dict):
        value = value.get("message") or value.get("text") or compact_json(value)
    text = re.sub(r"</?tool_use_error>", "", str(value or ""))
    wrapped = text.find(" with response: ")
    if wrapped >= 0:
        # Gemini CLI and Qwen Code wrap an MCP tool's error in the JSON of the call.
        with contextlib.suppress(ValueError):
            texts = re.findall(r'"text"\s*:\s*("(?:[^"\\]|\\.)*")', text[wrapped:])
            if texts:
                text = " ".join(json.loads(piece) for piece in texts)
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def tool_summary(arguments, width=100):
    """A tool call's arguments as one short line: its command, file or pattern when it
    has one, else the arguments in compact JSON, cut to ``width``."""
    if not isinstance(arguments, dict) or not arguments:
        return ""
    value = next((arguments[key] for key in _TOOL_SUMMARY_KEYS
                  if isinstance(arguments.get(key), (str, list)) and arguments[key]), None)
    if isinstance(value, list):
        value = " ".join(str(part) for part in value)
    text = value if value is not None else compact_json(arguments)
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"


class UsageTally:
    """What one agent session has used so far, folded from its AgentEvents.

    CLIs report usage in three ways, and each is folded without double counting:
    per message (Claude repeats a message's usage on every block of it, so only
    the last report per message counts), per turn (Codex: summed), and as the
    session's totals (Claude's and Gemini's final result: they replace what was
    counted before).  Cost is known only when the CLI reports it.

    Turns: each message or turn with usage is one, until the totals say how many
    (Claude's and Qwen's ``num_turns``).  Gemini reports neither, so its turns are
    counted from the stream: the model's first output after the start or after a tool
    result begins one.  The context in use is the last request's input, cached tokens
    included, from the CLIs that report usage per request (Claude, Qwen)."""

    def __init__(self):
        self.tool_calls = 0
        self.model = ""
        self.agent_session = ""
        self.cost_usd = None
        self.context_tokens = 0     # the context the last request held (0: not reported)
        self._settled = (0, 0)      # the last reported totals
        self._settled_turns = 0     # turns up to the last totals
        self._pending = {}          # message id (or a counter) -> (input, output) since
        self._stream_turns = 0      # turns seen in the stream (agents without per-turn usage)
        self._turn_open = False     # the model is answering: its output is no new turn

    def add(self, event):
        if event.kind == "tool_call":
            self.tool_calls += 1
        elif event.kind == "session":
            self.agent_session = event.text or self.agent_session
            self.model = event.name or self.model
        elif event.kind == "usage":
            if event.total:
                self._settled = (event.input_tokens, event.output_tokens)
                self._settled_turns = event.turns or self._settled_turns + len(self._pending)
                if event.turns:
                    self._stream_turns = 0
                self._pending = {}
            elif event.input_tokens or event.output_tokens:
                self._pending[event.text or len(self._pending)] = (event.input_tokens,
                                                                   event.output_tokens)
            if event.context_tokens:
                self.context_tokens = event.context_tokens
            if event.cost_usd is not None:
                self.cost_usd = event.cost_usd
        elif event.kind == "model_output":
            if not self._turn_open:
                self._stream_turns += 1
                self._turn_open = True
        elif event.kind == "tool_result":
            self._turn_open = False

    @property
    def input_tokens(self):
        return self._settled[0] + sum(pair[0] for pair in list(self._pending.values()))

    @property
    def output_tokens(self):
        return self._settled[1] + sum(pair[1] for pair in list(self._pending.values()))

    @property
    def turns(self):
        return self._settled_turns + len(self._pending) + self._stream_turns

    def counts(self):
        """The figures a session record keeps."""
        return {"tool_calls": self.tool_calls, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "cost_usd": self.cost_usd,
                "turns": self.turns, "context_tokens": self.context_tokens}
