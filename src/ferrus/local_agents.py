"""Local agents: the nano, opencode and goose adapters.

Each is an AgentAdapter like the four of adapters.py (binary, headless and interactive
argv, prompt on stdin, the role's MCP server, permissions, output parser).

- nano is ferrus itself (`ferrus -C ROOT nano ...`, see nano.py): register writes the
  role's server into .ferrus/nano-mcp-<role>.json, which nano starts; it prints Claude
  Code's stream-json, so Claude's parser reads it.
- opencode (npm opencode-ai) reads its project opencode.json, where register writes
  both roles' servers under ``mcp`` (for interactive use).  A headless launch carries
  its whole MCP and permission setup in OPENCODE_CONFIG_CONTENT instead — this role's
  server on, the other's off, edit/bash allowed or denied per profile — so it works in
  a task's worktree, where the git-ignored opencode.json is absent, and keeps each role
  to its own tools.  Its ``run --format json`` events are parsed here.
- goose keeps its configuration in one user-wide config.yaml, so nothing of the
  project's goes there: register writes the role's server into
  .ferrus/goose-mcp-<role>.json and every launch attaches it with --with-extension (a
  command string goose splits itself).  Headless runs use GOOSE_MODE=auto (nobody can
  answer a confirmation) and its documented loop guards; goose cannot be held to
  read-only, so its reviewer can edit.  Its ``--output-format stream-json`` events are
  parsed here.  goose has no npm package: these launch flags follow its documentation
  (CLI Commands, `goose run`), not a run of the real binary.
"""

import json
import os
import sys

from .store import FERRUS_DIR
from .operations import ROLES
from .agents import (AgentEvent, DEFAULT_AGENT_INDEX, Launch, client_tool_timeout_secs,
                     ferrus_boot_argv, ferrus_server_entry, server_key, tool_reason,
                     tool_summary)
from .agent_files import _json_table, edit_json_file, ensure_gitignore_entry, planned_read
from .adapters import AgentAdapter, _load_json_quiet, _parse_claude_style


def _ferrus_argv(root):
    """argv that starts *this* ferrus for the project ``root`` (as MCP entries do)."""
    return ferrus_boot_argv() + ["-C", os.path.abspath(root)]


class _FerrusMcpFileAgent(AgentAdapter):
    """An agent whose role server lives in a JSON file of ferrus's own:
    .ferrus/<name>-mcp-<role>.json with ``mcpServers`` (what nano and goose read)."""

    def mcp_config_path(self, root, role):
        return os.path.join(root, FERRUS_DIR, "%s-mcp-%s.json" % (self.name, role))

    def register(self, root, role, model, report):
        path = self.mcp_config_path(root, role)

        def add_server(data):
            _json_table(data, "mcpServers", path)[server_key(role)] = ferrus_server_entry(
                root, role, self.name)
        edit_json_file(path, add_server)
        report("Registered %s in %s/%s (agent id %s:%s:%d)" % (
            server_key(role), FERRUS_DIR, os.path.basename(path), role, self.name,
            DEFAULT_AGENT_INDEX))

    def unregister(self, root, role, report):
        path = self.mcp_config_path(root, role)
        if os.path.exists(path):
            os.unlink(path)
            report("Removed %s/%s" % (FERRUS_DIR, os.path.basename(path)))

    def registration(self, root, role):
        return _load_json_quiet(self.mcp_config_path(root, role)).get("mcpServers", {}).get(
            server_key(role))


# -- nano ---------------------------------------------------------------------------------

class NanoAdapter(_FerrusMcpFileAgent):
    """nano, the built-in agent (nano.py): needs no binary but the Python running ferrus."""

    name = "nano"
    binary = "ferrus nano"

    def install_hint(self):
        return "nano is part of ferrus; it needs a model server ([agents.nano] base_url)"

    def executable(self):
        return os.path.abspath(sys.executable)

    def version_argv(self):
        return ferrus_boot_argv() + ["--version"]

    def _argv(self, root, role, model):
        argv = _ferrus_argv(root) + ["nano"]
        if role is not None:
            argv += ["--role", role, "--mcp-config", self.mcp_config_path(root, role)]
        model = (model or "").strip()
        return argv + (["--model", model] if model else [])

    def permission_args(self, profile, output=None, reads=()):
        return ["--permissions", profile]

    def headless(self, root, role, prompt, model="", profile=None):
        argv = self._argv(root, role, model) + \
            self.permission_args(self._profile(role, profile)) + \
            self.options.extra_args + self.options.headless_args
        return Launch(argv, prompt, dict(self.options.env))

    def worker(self, root, prompt, model, output, reads=()):
        """A pipeline worker: no ferrus server; it may write ``output`` only."""
        argv = self._argv(root, None, model) + ["--worker-output", output]
        for path in reads:
            argv += ["--read", path]
        return Launch(argv + self.options.extra_args + self.options.headless_args, prompt,
                      dict(self.options.env))

    def interactive(self, root, role, prompt=None, model=""):
        argv = self._argv(root, role, model) + ["--interactive"] + \
            self.options.extra_args + self.options.interactive_args
        if prompt:
            argv += ["--prompt", prompt]
        return Launch(argv, None, dict(self.options.env))

    def parse_line(self, line):
        return _parse_claude_style(line)


# -- opencode -----------------------------------------------------------------------------

# opencode's own tools under the names ferrus shows (TOOL_NAMES knows Claude's).
_OPENCODE_TOOLS = {"bash": "Bash", "read": "Read", "write": "Write", "edit": "Edit",
                   "patch": "Edit", "multiedit": "Edit", "glob": "Glob", "grep": "Grep",
                   "list": "LS", "webfetch": "WebFetch", "websearch": "WebSearch",
                   "todowrite": "TodoWrite", "task": "Task"}
# What each permission profile allows opencode's own tools (MCP tools are always allowed).
_OPENCODE_PERMISSIONS = {"read-only": {"edit": "deny", "bash": "deny"},
                         "edit": {"edit": "allow", "bash": "deny"},
                         "output": {"edit": "allow", "bash": "deny"},
                         "full": {"edit": "allow", "bash": "allow", "webfetch": "allow"}}


class OpencodeAdapter(AgentAdapter):
    """opencode (npm opencode-ai), `opencode run --format json` headless."""

    name = "opencode"
    binary = "opencode"
    package = "opencode-ai"
    instructions_file = "AGENTS.md"

    def config_path(self, root):
        return os.path.join(root, "opencode.json")

    def server_entry(self, root, role, enabled=True):
        entry = ferrus_server_entry(root, role, self.name)
        return {"type": "local", "command": [entry["command"]] + entry["args"],
                "enabled": enabled, "timeout": client_tool_timeout_secs(self.config) * 1000}

    def _config_content(self, root, role, profile):
        """OPENCODE_CONFIG_CONTENT: this role's server only, the profile's permissions."""
        servers = {}
        for each in ROLES:
            servers[server_key(each)] = self.server_entry(root, each, enabled=each == role)
        return json.dumps({"mcp": servers, "permission": _OPENCODE_PERMISSIONS[profile]})

    def _env(self, root, role, profile):
        env = {"OPENCODE_CONFIG_CONTENT": self._config_content(root, role, profile)}
        env.update(self.options.env)
        return env

    def permission_args(self, profile, output=None, reads=()):
        # The permissions travel in OPENCODE_CONFIG_CONTENT; --auto would approve anything
        # not denied, so it is never passed.
        return []

    def can_edit(self, profile):
        return _OPENCODE_PERMISSIONS[profile]["edit"] == "allow"

    def headless(self, root, role, prompt, model="", profile=None):
        model = (model or "").strip()
        argv = [self.binary, "run", "--format", "json"] + (["--model", model] if model else []) + \
            self.options.extra_args + self.options.headless_args
        return Launch(argv, prompt, self._env(root, role, self._profile(role, profile)))

    def worker(self, root, prompt, model, output, reads=()):
        model = (model or "").strip()
        config = {"mcp": {server_key(role): self.server_entry(root, role, enabled=False)
                          for role in ROLES},
                  "permission": _OPENCODE_PERMISSIONS["output"]}
        env = {"OPENCODE_CONFIG_CONTENT": json.dumps(config)}
        env.update(self.options.env)
        argv = [self.binary, "run", "--format", "json"] + (["--model", model] if model else []) + \
            self.options.extra_args + self.options.headless_args
        return Launch(argv, prompt, env)

    def interactive(self, root, role, prompt=None, model=""):
        model = (model or "").strip()
        argv = [self.binary] + (["--model", model] if model else []) + \
            self.options.extra_args + self.options.interactive_args
        if prompt:
            argv += ["--prompt", prompt]
        # An interactive session keeps opencode's own prompts: a person answers them.
        env = {"OPENCODE_CONFIG_CONTENT": json.dumps({"mcp": {
            server_key(each): self.server_entry(root, each, enabled=each == role)
            for each in ROLES}})}
        env.update(self.options.env)
        return Launch(argv, None, env)

    def register(self, root, role, model, report):
        path = self.config_path(root)

        def add_server(data):
            if not data:                    # a new file says what it is; a user's stays
                data["$schema"] = "https://opencode.ai/config.json"
            _json_table(data, "mcp", "opencode.json")[server_key(role)] = \
                self.server_entry(root, role)
        edit_json_file(path, add_server, "opencode.json")
        report("Registered %s in opencode.json (agent id %s:%s:%d)"
               % (server_key(role), role, self.name, DEFAULT_AGENT_INDEX))
        ensure_gitignore_entry(root, "opencode.json", report)

    def unregister(self, root, role, report):
        path = self.config_path(root)
        if planned_read(path) is None:
            return

        def remove(data):
            servers = data.get("mcp")
            if isinstance(servers, dict):
                servers.pop(server_key(role), None)
                if not servers:
                    data.pop("mcp")
            if list(data) == ["$schema"]:
                data.pop("$schema")
        edit_json_file(path, remove, "opencode.json")
        report("Removed %s from opencode.json" % server_key(role))

    def registration(self, root, role):
        servers = _load_json_quiet(self.config_path(root)).get("mcp")
        return _opencode_entry_as_mcp(servers.get(server_key(role))) \
            if isinstance(servers, dict) else None

    def __init__(self, config):
        super().__init__(config)
        self._session_seen = False

    def parse_line(self, line):
        try:
            event = json.loads(line)
        except ValueError:
            return []
        if not isinstance(event, dict):
            return []
        events = []
        if not self._session_seen and event.get("sessionID"):
            self._session_seen = True
            events.append(AgentEvent("session", text=str(event["sessionID"])))
        part = event.get("part") if isinstance(event.get("part"), dict) else {}
        kind = event.get("type")
        if kind == "tool_use":
            events += _opencode_tool(part)
        elif kind == "text" and str(part.get("text") or "").strip():
            events.append(AgentEvent("said", text=str(part["text"])))
        elif kind == "step_finish" and isinstance(part.get("tokens"), dict):
            tokens = part["tokens"]
            cache = tokens.get("cache") if isinstance(tokens.get("cache"), dict) else {}
            read = _whole_number(tokens, "input") + _whole_number(cache, "read") + \
                _whole_number(cache, "write")
            events.append(AgentEvent("usage", input_tokens=read,
                                     output_tokens=_whole_number(tokens, "output") +
                                     _whole_number(tokens, "reasoning"),
                                     text=str(part.get("messageID") or part.get("id") or ""),
                                     context_tokens=read))
        elif kind == "error":
            error = event.get("error")
            message = error.get("data", {}).get("message") if isinstance(error, dict) and \
                isinstance(error.get("data"), dict) else error
            events.append(AgentEvent("said", text=tool_reason(message or event, 1000)))
        return events


def _opencode_entry_as_mcp(entry):
    """opencode's ``{"type": "local", "command": [...]}`` as command + args (what
    entry_points_here and entry_mismatch read)."""
    if not isinstance(entry, dict):
        return None
    command = entry.get("command") if isinstance(entry.get("command"), list) else []
    return dict(entry, command=command[0] if command else "", args=command[1:])


def _opencode_tool(part):
    """A finished opencode tool call: the call and, when it failed, why."""
    state = part.get("state") if isinstance(part.get("state"), dict) else {}
    raw = str(part.get("tool") or "")
    name = _OPENCODE_TOOLS.get(raw, raw)
    for role in ROLES:
        prefix = server_key(role) + "_"
        if raw.startswith(prefix):
            name = "mcp__%s__%s" % (server_key(role), raw[len(prefix):])
    call_id = str(part.get("callID") or part.get("id") or "")
    ok = state.get("status") == "completed"
    arguments = state.get("input") if isinstance(state.get("input"), dict) else {}
    if "filePath" in arguments:            # opencode's name for the file a tool works on
        arguments = dict(arguments, file_path=arguments["filePath"])
    return [AgentEvent("tool_call", name=name, ok=ok, call_id=call_id,
                       text=tool_summary(arguments)),
            AgentEvent("tool_result", name=name, ok=ok, call_id=call_id,
                       text="" if ok else tool_reason(state.get("error") or state.get("output")
                                                      or "status %s" % state.get("status")))]


def _whole_number(mapping, key):
    value = mapping.get(key) if isinstance(mapping, dict) else None
    return max(0, int(value)) if isinstance(value, (int, float)) and \
        not isinstance(value, bool) else 0


# -- goose --------------------------------------------------------------------------------

GOOSE_MAX_TURNS = 200
GOOSE_MAX_TOOL_REPETITIONS = 25


def _command_string(argv):
    """One command line goose splits back into ``argv`` (its --with-extension value)."""
    import shlex
    if os.name == "nt":  # pragma: no cover - Windows quoting
        return " ".join('"%s"' % arg.replace('"', '\\"') if not arg or any(
            c in arg for c in ' \t"') else arg for arg in argv)
    return " ".join(shlex.quote(arg) for arg in argv)


class GooseAdapter(_FerrusMcpFileAgent):
    """goose (Block's agent, a Rust binary): `goose run` headless, its documented flags."""

    name = "goose"
    binary = "goose"
    package = ""
    instructions_file = "AGENTS.md"

    def install_hint(self):
        return ("install goose from its releases (https://block.github.io/goose/docs/"
                "getting-started/installation) and put `goose` on PATH")

    def extension(self, root, role):
        """--with-extension's value: ``NAME:COMMAND ARGS`` naming the server as ferrus
        does, so its tools reach the model as <server>__<tool>."""
        entry = self.registration(root, role) or ferrus_server_entry(root, role, self.name)
        return "%s:%s" % (server_key(role),
                          _command_string([entry["command"]] + list(entry.get("args") or [])))

    def _env(self, headless):
        env = {"GOOSE_MODE": "auto"} if headless else {}
        env.update(self.options.env)
        return env

    def can_edit(self, profile):
        return True           # its developer extension edits files in every mode

    def _run_argv(self, model):
        model = (model or "").strip()
        return [self.binary, "run", "--no-session", "--output-format", "stream-json",
                "--max-turns", str(GOOSE_MAX_TURNS),
                "--max-tool-repetitions", str(GOOSE_MAX_TOOL_REPETITIONS)] + \
            (["--model", model] if model else [])

    def headless(self, root, role, prompt, model="", profile=None):
        argv = self._run_argv(model) + ["--with-extension", self.extension(root, role)] + \
            self.options.extra_args + self.options.headless_args + ["--instructions", "-"]
        return Launch(argv, prompt, self._env(True))

    def worker(self, root, prompt, model, output, reads=()):
        argv = self._run_argv(model) + self.options.extra_args + self.options.headless_args + \
            ["--instructions", "-"]
        return Launch(argv, prompt, self._env(True))

    def interactive(self, root, role, prompt=None, model=""):
        extension = ["--with-extension", self.extension(root, role)]
        model = (model or "").strip()
        models = ["--model", model] if model else []
        if prompt:
            argv = [self.binary, "run", "--interactive"] + extension + models + \
                self.options.extra_args + self.options.interactive_args + ["--text", prompt]
        else:
            argv = [self.binary, "session"] + extension + self.options.extra_args + \
                self.options.interactive_args
        return Launch(argv, None, self._env(False))

    def parse_line(self, line):
        try:
            event = json.loads(line)
        except ValueError:
            return []
        if not isinstance(event, dict):
            return []
        kind = event.get("type")
        if kind == "message" and isinstance(event.get("message"), dict):
            return _goose_message(event["message"])
        if kind == "complete":
            return [AgentEvent("usage", input_tokens=_whole_number(event, "input_tokens") +
                               _whole_number(event, "cache_read_input_tokens") +
                               _whole_number(event, "cache_write_input_tokens"),
                               output_tokens=_whole_number(event, "output_tokens"), total=True,
                               cost_usd=event["cost_usd"] if isinstance(
                                   event.get("cost_usd"), (int, float)) else None)]
        if kind == "error":
            return [AgentEvent("said", text=tool_reason(event.get("error"), 1000))]
        return []


def _goose_tool_name(name):
    """goose names an extension's tool <extension>__<tool>; ferrus's servers as the other
    agents' MCP tools, its own developer tools under ferrus's names."""
    extension, _, tool = name.partition("__")
    if tool and extension.replace("_", "-").startswith("ferrus-"):
        return "mcp__%s__%s" % (extension.replace("_", "-"), tool)
    return {"developer__shell": "Bash", "developer__text_editor": "Edit"}.get(name, name)


def _goose_message(message):
    events = []
    for block in message.get("content") or []:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and message.get("role") == "assistant" and \
                str(block.get("text") or "").strip():
            events.append(AgentEvent("said", text=str(block["text"])))
        elif kind == "toolRequest":
            call = block.get("toolCall") if isinstance(block.get("toolCall"), dict) else {}
            value = call.get("value") if isinstance(call.get("value"), dict) else {}
            events.append(AgentEvent("tool_call", name=_goose_tool_name(str(value.get("name")
                                                                            or "")),
                                     call_id=str(block.get("id") or ""),
                                     text=tool_summary(value.get("arguments"))))
        elif kind == "toolResponse":
            result = block.get("toolResult") if isinstance(block.get("toolResult"), dict) \
                else {}
            value = result.get("value") if isinstance(result.get("value"), dict) else {}
            failed = result.get("status") == "error" or value.get("isError") is True
            events.append(AgentEvent("tool_result", ok=not failed,
                                     call_id=str(block.get("id") or ""),
                                     text=tool_reason(result.get("error") or
                                                      value.get("content")) if failed else ""))
    return events


LOCAL_AGENT_ADAPTERS = (NanoAdapter, OpencodeAdapter, GooseAdapter)
# The files their register writes, relative to the project root (for unregister's
# clean-up of emptied files, with register's REGISTRATION_FILES).
LOCAL_AGENT_REGISTRATION_FILES = ("opencode.json",)
