"""Adapters: Claude Code, Codex, Qwen Code, Gemini CLI, custom agents.

An adapter knows the binary, how to launch it interactively and headless (the prompt
travels on stdin wherever the CLI allows), how to keep it to its own role's ferrus
server, which files `register` writes, and how to read its machine-readable output.
The traps of the real CLIs are handled here: Claude's variadic --mcp-config, Codex
ignoring an untrusted project's .codex/config.toml, Gemini ignoring untrusted folders."""

import contextlib
import json
import os
import re
import shutil

from .startup import SERVER_HOST_ENV
from .basics import FerrusError, LazyPattern
from .system import atomic_write, read_text
from .tomlfile import (TomlError, format_toml_value, parse_toml, toml_remove_table,
                       toml_replace_table)
from .store import FERRUS_DIR
from .sandbox import SANDBOX_RELAY_ENV
from .operations import ROLES
from .mcp import SESSION_ENV, tools_for_role
from .agents import (AgentEvent, DEFAULT_AGENT_INDEX, Launch, STDIN_PROMPT_POINTER,
                     client_tool_timeout_secs, ferrus_server_entry, server_key,
                     tool_reason, tool_summary)
from .agent_files import (WORKER_PERMISSIONS, _json_table, edit_json_file,
                          effective_permissions, ensure_gitignore_entry, planned_read,
                          planned_write)


# -- adapters -------------------------------------------------------------------------

class AgentAdapter:
    """What every agent CLI adapter provides; subclasses fill in the details."""

    name = ""
    binary = ""
    package = ""              # npm package, for the install hint
    instructions_file = None  # CLAUDE.md, AGENTS.md, ...

    def __init__(self, config):
        self.config = config
        self.options = config.agents.options_for(self.name)

    def install_hint(self):
        return "npm install -g %s" % self.package

    def executable(self):
        return shutil.which(self.binary)

    def version_argv(self):
        return [self.binary, "--version"]

    def register(self, root, role, model, report):
        raise FerrusError("agent %s cannot be registered" % self.name)

    def unregister(self, root, role, report):
        pass

    def registration(self, root, role):
        """The MCP entry this agent's config holds for ``role`` (None when absent)."""
        return None

    def parse_line(self, line):
        return []

    def permission_args(self, profile, output=None, reads=()):
        """The CLI's own flags for a permission profile (see above); [] when it has none."""
        return []

    def can_edit(self, profile):
        """Can a headless launch with this profile change files?  None: ferrus cannot tell."""
        return profile in ("edit", "full")

    def _profile(self, role, profile):
        return profile or effective_permissions(self.config, role)[0]


def _model_args(flag, model):
    """The model flag, or nothing: a blank model means the agent's own default."""
    model = (model or "").strip()
    return [flag, model] if model else []


def _load_json_quiet(path):
    try:
        data = json.loads(read_text(path, default="") or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class ClaudeCode(AgentAdapter):
    name = "claude-code"
    binary = "claude"
    package = "@anthropic-ai/claude-code"
    instructions_file = "CLAUDE.md"

    def config_path(self, root, role):
        return os.path.join(root, ".claude", "mcp-%s.json" % role)

    def _common(self, root, role, model):
        # --mcp-config takes several values: the = form keeps it from eating the
        # next argument (upstream's trap).
        argv = [self.binary, "--mcp-config=" + self.config_path(root, role)]
        if self.config.agents.claude_mcp_isolation == "ferrus-only":
            argv.append("--strict-mcp-config")
        return argv + _model_args("--model", model)

    def headless(self, root, role, prompt, model="", profile=None):
        argv = self._common(root, role, model) + [
            "--allowedTools=mcp__%s__*" % server_key(role)] + \
            self.permission_args(self._profile(role, profile)) + \
            ["--output-format", "stream-json", "--verbose"] + \
            self.options.extra_args + self.options.headless_args + ["-p"]
        # Claude Code 2.1 connects MCP servers in the background in -p mode, so a
        # first turn can find ferrus's tools "still connecting" on a busy machine;
        # every prompt starts with a ferrus tool, so wait for the server.
        env = {"MCP_TOOL_TIMEOUT": str(client_tool_timeout_secs(self.config) * 1000),
               "MCP_CONNECTION_NONBLOCKING": "false"}
        env.update(self.options.env)
        return Launch(argv, prompt, env)

    def worker(self, root, prompt, model, output, reads=()):
        """A pipeline worker: no ferrus server at all, allowed to write ``output`` only."""
        argv = [self.binary]
        if self.config.agents.claude_mcp_isolation == "ferrus-only":
            argv.append("--strict-mcp-config")
        argv += _model_args("--model", model) + \
            self.permission_args(WORKER_PERMISSIONS, output, reads) + \
            ["--output-format", "stream-json", "--verbose"] + \
            self.options.extra_args + self.options.headless_args + ["-p"]
        return Launch(argv, prompt, dict(self.options.env))

    def permission_args(self, profile, output=None, reads=()):
        if profile == "full":
            return ["--permission-mode", "bypassPermissions"]
        if profile == "edit":
            return ["--permission-mode", "acceptEdits"]
        # "default" mode: anything not allowed up front is refused headless.  The
        # edit tools are denied outright, so a user-level allow rule cannot
        # widen a read-only role.
        args = ["--permission-mode", "default"]
        if profile == "output":
            # Edit(...) rules cover Write too; "//" starts an absolute path (a Windows
            # drive is written /c/...).  Tried with Claude Code 2.1.197: the worker
            # writes that file and is refused any other.
            rule = "Edit(/%s)" % _claude_rule_path(output) if output else "Write"
            return args + ["--allowedTools=" + rule + (",Read" if reads else "")]
        return args + ["--disallowedTools=Edit,Write,NotebookEdit"]

    def interactive(self, root, role, prompt=None, model=""):
        argv = self._common(root, role, model) + self.options.extra_args + \
            self.options.interactive_args
        if prompt:
            argv += ["--", prompt]
        return Launch(argv, None, dict(self.options.env))

    def register(self, root, role, model, report):
        key = server_key(role)
        path = self.config_path(root, role)

        def add_server(data):
            servers = _json_table(data, "mcpServers", path)
            servers[key] = dict({"type": "stdio"}, **ferrus_server_entry(root, role, self.name))
        edit_json_file(path, add_server)
        report("Registered %s in .claude/mcp-%s.json (agent id %s:%s:%d)"
               % (key, role, role, self.name, DEFAULT_AGENT_INDEX))
        settings = os.path.join(root, ".claude", "settings.local.json")
        permission = "mcp__%s__*" % key

        def allow(data):
            permissions = _json_table(data, "permissions", ".claude/settings.local.json")
            allowed = permissions.setdefault("allow", [])
            if not isinstance(allowed, list):
                raise FerrusError(".claude/settings.local.json permissions.allow is not an array")
            if permission not in allowed:
                allowed.append(permission)
                report("Allowed %s in .claude/settings.local.json" % permission)
        edit_json_file(settings, allow)
        for entry in (".claude/mcp-%s.json" % role, ".claude/settings.local.json"):
            ensure_gitignore_entry(root, entry, report)

    def unregister(self, root, role, report):
        key = server_key(role)
        path = self.config_path(root, role)
        if os.path.exists(path):
            edit_json_file(path, lambda data: data.get("mcpServers", {}).pop(key, None))
        settings = os.path.join(root, ".claude", "settings.local.json")
        if os.path.exists(settings):
            def disallow(data):
                allowed = data.get("permissions", {}).get("allow")
                if isinstance(allowed, list) and "mcp__%s__*" % key in allowed:
                    allowed.remove("mcp__%s__*" % key)
            edit_json_file(settings, disallow)
        report("Removed %s from .claude/" % key)

    def registration(self, root, role):
        return _load_json_quiet(self.config_path(root, role)).get("mcpServers", {}).get(
            server_key(role))

    def parse_line(self, line):
        return _parse_claude_style(line)


def _claude_rule_path(path):
    path = os.path.abspath(path).replace(os.sep, "/")
    drive = re.match(r"([A-Za-z]):/", path)
    return "/%s/%s" % (drive.group(1).lower(), path[3:]) if drive else path


def _parse_claude_style(line):
    """Claude Code / Qwen Code stream-json: assistant tool_use blocks, usage, result."""
    try:
        event = json.loads(line)
    except ValueError:
        return _limit_events(line)
    if not isinstance(event, dict):
        return []
    events = []
    kind = event.get("type")
    if kind == "system" and event.get("session_id"):
        events.append(AgentEvent("session", name=str(event.get("model") or ""),
                                 text=str(event["session_id"])))
    elif kind == "assistant":
        message = event.get("message") or {}
        for block in message.get("content") or []:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                events.append(AgentEvent("tool_call", name=str(block.get("name", "")),
                                         text=tool_summary(block.get("input")),
                                         call_id=str(block.get("id") or "")))
            elif isinstance(block, dict) and block.get("type") == "text" and \
                    str(block.get("text") or "").strip():
                events.append(AgentEvent("said", text=str(block["text"])))
        usage = message.get("usage") or {}
        if isinstance(usage, dict) and usage:
            # One request's usage: its input is the whole context the model read.
            event = _claude_usage(usage, text=str(message.get("id") or ""))
            event.context_tokens = event.input_tokens
            events.append(event)
    elif kind == "user":
        # The results of the tool calls, the failed ones with why (a denied call too).
        message = event.get("message") or {}
        for block in message.get("content") or [] if isinstance(message, dict) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                failed = block.get("is_error") is True
                events.append(AgentEvent("tool_result", ok=not failed,
                                         call_id=str(block.get("tool_use_id") or ""),
                                         text=tool_reason(block.get("content")) if failed
                                         else ""))
    elif kind == "result":
        text = str(event.get("result") or "")
        events.extend(_limit_events(text))
        if event.get("is_error") and text.strip():
            events.append(AgentEvent("said", text=text))    # the error it ended with
        usage, cost = event.get("usage"), event.get("total_cost_usd", event.get("cost_usd"))
        cost = float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) \
            else None
        if isinstance(usage, dict):
            events.append(_claude_usage(usage, total=True, cost_usd=cost,
                                        turns=_count(event, "num_turns")))
        elif cost is not None:
            events.append(AgentEvent("usage", cost_usd=cost))
    return events


def _count(mapping, key):
    """A non-negative whole number from a CLI's JSON (0 for anything else)."""
    value = mapping.get(key)
    return max(0, int(value)) if isinstance(value, (int, float)) and \
        not isinstance(value, bool) else 0


def _claude_usage(usage, **fields):
    """A usage event from an Anthropic usage object.  Input counts every token the
    model read, cached or not (as Codex's input_tokens does)."""
    return AgentEvent("usage", input_tokens=_count(usage, "input_tokens") +
                      _count(usage, "cache_creation_input_tokens") +
                      _count(usage, "cache_read_input_tokens"),
                      output_tokens=_count(usage, "output_tokens"), **fields)


_LIMIT_RE = LazyPattern(r"(?:hit your (?:session |usage )?limit|usage limit|rate limit)"
                       r".{0,40}?resets? (?:at )?([^\n.]+)", re.IGNORECASE)


def _limit_events(text):
    match = _LIMIT_RE.search(text or "")
    return [AgentEvent("limit", text=match.group(1).strip())] if match else []


# Errors no retry can cure, as the agent CLIs word them, with what the user must do.
PERMANENT_AGENT_ERRORS = (
    ("login", LazyPattern(
        r"invalid api key|invalid x-api-key|incorrect api key|api key not valid|"
        r"authentication_error|authentication failed|please run /login|not logged in|"
        r"oauth token has expired|please set an auth method|401 unauthorized|"
        r"no api key (?:found|provided)|missing api key|api key is missing", re.IGNORECASE),
     "log the agent in (run it once interactively, e.g. `claude` then /login) or set its "
     "API key, then run again"),
    ("model", LazyPattern(
        r"unknown model|invalid model|model_not_found|"
        r"model\b[^\n]{0,80}?\b(?:not found|does not exist|is not supported|is not available|"
        r"not available|may not exist)|issue with the selected model", re.IGNORECASE),
     "check the model name: `ferrus register --<role>-model M`, /model in HQ, or [hq.<role>] "
     "in ferrus.toml"),
    ("flag", LazyPattern(
        r"unknown option|unrecognized option|unexpected argument|unrecognized arguments?|"
        r"unknown (?:flag|argument)s?:?|invalid option", re.IGNORECASE),
     "the agent refused its command line: check extra_args / headless_args under "
     "[agents.<name>] in ferrus.toml and the agent's version (`ferrus agents`)"),
)

# Output events that report the agent's own failure.  Tool results (a check's output
# that mentions "unknown option", say) are never read as the agent failing.
_ERROR_EVENT_TYPES = ("result", "error", "turn.failed")


def _error_texts(line):
    """The parts of one output line that may state why the agent itself failed."""
    try:
        event = json.loads(line)
    except ValueError:
        return [line]          # plain text, usually stderr (it is merged into stdout)
    if not isinstance(event, dict) or event.get("type") not in _ERROR_EVENT_TYPES:
        return []
    if event.get("type") == "result" and not (event.get("is_error") or
                                              event.get("status") == "error"):
        return []
    texts = []

    def collect(value, depth=0):
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict) and depth < 4:
            for item in value.values():
                collect(item, depth + 1)
        elif isinstance(value, list) and depth < 4:
            for item in value[:20]:
                collect(item, depth + 1)
    collect(event)
    return texts


def permanent_agent_error(line):
    """(kind, the agent's own words, hint) when ``line`` says no retry can help, else None."""
    for text in _error_texts(line):
        for kind, pattern, hint in PERMANENT_AGENT_ERRORS:
            if pattern.search(text):
                words = " ".join(text.split())
                return kind, words[:400] + ("…" if len(words) > 400 else ""), hint
    return None


class Codex(AgentAdapter):
    name = "codex"
    binary = "codex"
    package = "@openai/codex"
    instructions_file = "AGENTS.md"

    def overrides(self, root, role):
        """-c settings that define this role's server and disable the other role's.

        Codex ignores .codex/config.toml in projects the user has not trusted, so
        launches inject the server on the command line and work everywhere."""
        key = server_key(role)
        entry = ferrus_server_entry(root, role, self.name)
        settings = [("command", entry["command"]), ("args", entry["args"]),
                    ("startup_timeout_sec", 30),
                    ("tool_timeout_sec", client_tool_timeout_secs(self.config)),
                    ("default_tools_approval_mode", "approve"), ("enabled", True),
                    # Codex passes only listed variables to servers: the session id (and, in a
                    # sandbox, its relay's socket; outside one, the server host's) must
                    # reach it.
                    ("env_vars", [SESSION_ENV, SANDBOX_RELAY_ENV, SERVER_HOST_ENV])]
        argv = []
        for name, value in settings:
            argv += ["-c", "mcp_servers.%s.%s=%s" % (key, name, format_toml_value(value))]
        other_role = "executor" if role == "supervisor" else "supervisor"
        return argv + self._disable(root, other_role)

    def _disable(self, root, role):
        """-c settings that switch off the project's server for ``role``, if it has one."""
        key = server_key(role)
        if not self._project_defines(root, key):
            return []
        # In an untrusted project Codex never loaded that server, and a table with
        # only `enabled` is invalid config: give it a command too.
        command = ferrus_server_entry(root, role, self.name)["command"]
        return ["-c", "mcp_servers.%s.command=%s" % (key, format_toml_value(command)),
                "-c", "mcp_servers.%s.enabled=false" % key]

    def _project_defines(self, root, key):
        try:
            data = parse_toml(read_text(os.path.join(root, ".codex", "config.toml"), default=""))
        except TomlError:
            return False
        return key in (data.get("mcp_servers") or {})

    def headless(self, root, role, prompt, model="", profile=None):
        argv = [self.binary, "exec", "--json", "--skip-git-repo-check"] + \
            _model_args("--model", model) + self.overrides(root, role) + \
            self.permission_args(self._profile(role, profile)) + \
            self.options.extra_args + self.options.headless_args + ["-"]
        return Launch(argv, prompt, dict(self.options.env))

    def worker(self, root, prompt, model, output, reads=()):
        """A pipeline worker: ferrus's servers disabled, the sandbox lets it write."""
        argv = [self.binary, "exec", "--json", "--skip-git-repo-check"] + \
            _model_args("--model", model)
        for role in ROLES:
            argv += self._disable(root, role)
        argv += self.permission_args(WORKER_PERMISSIONS, output, reads) + \
            self.options.extra_args + self.options.headless_args + ["-"]
        return Launch(argv, prompt, dict(self.options.env))

    # `codex exec` never asks for approval; the sandbox alone bounds what the
    # model's commands and patches may touch (read-only is its default).
    _SANDBOX = {"read-only": "read-only", "edit": "workspace-write",
                "output": "workspace-write", "full": "danger-full-access"}

    def permission_args(self, profile, output=None, reads=()):
        return ["--sandbox", self._SANDBOX[profile]]

    def interactive(self, root, role, prompt=None, model=""):
        argv = [self.binary] + _model_args("--model", model) + self.overrides(root, role) + \
            self.options.extra_args + self.options.interactive_args
        if prompt:
            argv += ["--", prompt]
        return Launch(argv, None, dict(self.options.env))

    def config_path(self, root):
        return os.path.join(root, ".codex", "config.toml")

    def register(self, root, role, model, report):
        key = server_key(role)
        entry = ferrus_server_entry(root, role, self.name)
        table = {"command": entry["command"], "args": entry["args"], "startup_timeout_sec": 30,
                 "tool_timeout_sec": client_tool_timeout_secs(self.config),
                 "default_tools_approval_mode": "approve",
                 "tools": {tool.name: {"approval_mode": "approve"}
                           for tool in tools_for_role(role)}}
        path = self.config_path(root)
        text = planned_read(path) or ""
        try:
            parse_toml(text)
            new = toml_replace_table(text, ("mcp_servers", key), table)
        except TomlError as err:
            raise FerrusError(".codex/config.toml: %s" % err,
                              "fix the file by hand first; nothing was written") from err
        if new != text:
            planned_write(path, new)
        report("Registered %s in .codex/config.toml (agent id %s:%s:%d)"
               % (key, role, self.name, DEFAULT_AGENT_INDEX))
        ensure_gitignore_entry(root, ".codex/config.toml", report)

    def unregister(self, root, role, report):
        path = self.config_path(root)
        text = planned_read(path) or ""
        if text:
            try:
                new = toml_remove_table(text, ("mcp_servers", server_key(role)))
            except TomlError as err:
                raise FerrusError(".codex/config.toml: %s" % err,
                                  "fix the file by hand first; nothing was written") from err
            if new != text:
                planned_write(path, new)
                report("Removed %s from .codex/config.toml" % server_key(role))

    def registration(self, root, role):
        try:
            data = parse_toml(read_text(self.config_path(root), default=""))
        except TomlError:
            return None
        return (data.get("mcp_servers") or {}).get(server_key(role))

    def parse_line(self, line):
        try:
            event = json.loads(line)
        except ValueError:
            return _limit_events(line)
        if not isinstance(event, dict):
            return []
        kind = event.get("type")
        if kind == "thread.started":
            return [AgentEvent("session", text=str(event.get("thread_id", "")))]
        if kind == "item.completed":
            return self._completed_item(event.get("item") or {})
        if kind == "turn.completed":
            usage = event.get("usage") or {}
            return [AgentEvent("usage", input_tokens=int(usage.get("input_tokens") or 0),
                               output_tokens=int(usage.get("output_tokens") or 0))]
        if kind in ("turn.failed", "error"):
            said = (event.get("error") or {}).get("message") if isinstance(
                event.get("error"), dict) else event.get("message")
            return _limit_events(json.dumps(event)) + (
                [AgentEvent("said", text=str(said))] if said else [])
        return []

    @staticmethod
    def _completed_item(item):
        """Codex reports a tool call once, when it ended: the call and, when it failed,
        its result with why."""
        kind, item_id = item.get("type"), str(item.get("id") or "")
        if kind == "agent_message" and str(item.get("text") or "").strip():
            return [AgentEvent("said", text=str(item["text"]))]
        if kind == "mcp_tool_call":
            name, ok = "%s/%s" % (item.get("server"), item.get("tool")), \
                item.get("status") == "completed"
            result = item.get("result") if isinstance(item.get("result"), dict) else {}
            reason = tool_reason(item.get("error") or result.get("content"))
            call = AgentEvent("tool_call", name=name, ok=ok, call_id=item_id,
                              text=tool_summary(item.get("arguments")))
        # Codex's own tools: a shell command, or file edits (its apply_patch).
        elif kind == "command_execution":
            name, ok = "shell", item.get("exit_code") == 0
            output = [line for line in str(item.get("aggregated_output") or "").splitlines()
                      if line.strip()]
            reason = tool_reason("exit %s%s" % (item.get("exit_code"), ": " + " ".join(
                output[-3:]) if output else ""))
            call = AgentEvent("tool_call", name=name, ok=ok, call_id=item_id,
                              text=tool_summary({"command": _unwrap_shell(item.get("command"))}))
        elif kind == "file_change":
            paths = [c.get("path") for c in item.get("changes") or []
                     if isinstance(c, dict) and isinstance(c.get("path"), str)]
            name, ok = "apply_patch", item.get("status") == "completed"
            reason = "the patch was not applied (status %s)" % item.get("status")
            call = AgentEvent("tool_call", name=name, ok=ok, call_id=item_id,
                              text=tool_summary({"path": paths}))
        else:
            return []
        return [call, AgentEvent("tool_result", name=name, ok=ok, call_id=item_id,
                                 text="" if ok else reason)]


# How Codex runs a model's command: the shell wrapper around it says nothing.
_SHELL_WRAPPER = LazyPattern(r"^(?:/usr)?(?:/bin/)?(?:ba|z)?sh -l?c ")


def _unwrap_shell(command):
    """``/bin/bash -lc 'cat a.txt'`` as ``cat a.txt`` (the command the model gave)."""
    import shlex
    if not isinstance(command, str) or not _SHELL_WRAPPER.match(command):
        return command
    rest = _SHELL_WRAPPER.sub("", command, count=1)
    with contextlib.suppress(ValueError):
        parts = shlex.split(rest)
        if len(parts) == 1:
            return parts[0]
    return rest


class _SettingsJsonAgent(AgentAdapter):
    """Qwen Code and Gemini CLI: `mcpServers` in <dir>/settings.json."""

    settings_dir = ""

    def settings_path(self, root):
        return os.path.join(root, self.settings_dir, "settings.json")

    def server_entry(self, root, role):
        entry = ferrus_server_entry(root, role, self.name)
        # trust: the server's own tools run without a confirmation prompt, which a
        # headless run could never answer.
        entry.update(timeout=client_tool_timeout_secs(self.config) * 1000, trust=True)
        return entry

    def register(self, root, role, model, report):
        key = server_key(role)
        path = self.settings_path(root)
        label = "%s/settings.json" % self.settings_dir

        def add_server(data):
            _json_table(data, "mcpServers", label)[key] = self.server_entry(root, role)
        edit_json_file(path, add_server, label)
        report("Registered %s in %s (agent id %s:%s:%d)"
               % (key, label, role, self.name, DEFAULT_AGENT_INDEX))
        ensure_gitignore_entry(root, label, report)

    def unregister(self, root, role, report):
        path = self.settings_path(root)
        if os.path.exists(path):
            edit_json_file(path, lambda data: data.get("mcpServers", {}).pop(server_key(role), None))
            report("Removed %s from %s/settings.json" % (server_key(role), self.settings_dir))

    def registration(self, root, role):
        return _load_json_quiet(self.settings_path(root)).get("mcpServers", {}).get(
            server_key(role))

    # --approval-mode values; headless, a tool that would need approval is refused.
    _APPROVAL = {}

    def permission_args(self, profile, output=None, reads=()):
        return ["--approval-mode", self._APPROVAL[profile]]

    def _servers_except_ferrus(self, root):
        """The other MCP servers a worker keeps (project and user settings), or a name
        no server has: an allow-list that is never empty excludes ferrus's servers."""
        names = []
        for path in (self.settings_path(root),
                     os.path.join(os.path.expanduser("~"), self.settings_dir, "settings.json")):
            servers = _load_json_quiet(path).get("mcpServers")
            for name in (servers if isinstance(servers, dict) else {}):
                if not name.startswith("ferrus-") and name not in names:
                    names.append(name)
        return names or ["ferrus-no-server"]

    def _worker_argv(self, root, model, output, reads):
        return [self.binary, "--allowed-mcp-server-names"] + \
            self._servers_except_ferrus(root) + _model_args("--model", model) + \
            self.permission_args(WORKER_PERMISSIONS, output, reads) + \
            ["--output-format", "stream-json"] + self.options.extra_args + \
            self.options.headless_args


class QwenCode(_SettingsJsonAgent):
    name = "qwen-code"
    binary = "qwen"
    package = "@qwen-code/qwen-code"
    instructions_file = "QWEN.md"
    settings_dir = ".qwen"

    def _common(self, root, role, model):
        # The server travels on the command line too, so a folder Qwen does not
        # trust (which ignores .qwen/settings.json) still has it; only this
        # role's server is allowed.
        config = {"mcpServers": {server_key(role): self.server_entry(root, role)}}
        return [self.binary, "--mcp-config", json.dumps(config),
                "--allowed-mcp-server-names", server_key(role)] + _model_args("--model", model)

    _APPROVAL = {"read-only": "default", "edit": "auto-edit", "output": "auto-edit",
                 "full": "yolo"}

    def headless(self, root, role, prompt, model="", profile=None):
        argv = self._common(root, role, model) + \
            self.permission_args(self._profile(role, profile)) + \
            ["--output-format", "stream-json"] + \
            self.options.extra_args + self.options.headless_args + [STDIN_PROMPT_POINTER]
        return Launch(argv, prompt, dict(self.options.env))

    def worker(self, root, prompt, model, output, reads=()):
        return Launch(self._worker_argv(root, model, output, reads) + [STDIN_PROMPT_POINTER],
                      prompt, dict(self.options.env))

    def interactive(self, root, role, prompt=None, model=""):
        argv = self._common(root, role, model) + self.options.extra_args + \
            self.options.interactive_args
        if prompt:
            argv.append("--prompt-interactive=" + prompt)
        return Launch(argv, None, dict(self.options.env))

    def parse_line(self, line):
        return _parse_claude_style(line)


class GeminiCli(_SettingsJsonAgent):
    name = "gemini-cli"
    binary = "gemini"
    package = "@google/gemini-cli"
    instructions_file = "GEMINI.md"
    settings_dir = ".gemini"

    _APPROVAL = {"read-only": "default", "edit": "auto_edit", "output": "auto_edit",
                 "full": "yolo"}

    def _common(self, model, role):
        return [self.binary, "--skip-trust", "--allowed-mcp-server-names", server_key(role)] + \
            _model_args("--model", model)

    def _env(self):
        # Gemini ignores project settings (our server included) in a folder the user
        # never trusted.  --skip-trust alone comes too late for that in Gemini CLI
        # 0.61 (the settings are read before the flag), the variable it sets works.
        env = {"GEMINI_CLI_TRUST_WORKSPACE": "true"}
        env.update(self.options.env)
        return env

    def headless(self, root, role, prompt, model="", profile=None):
        argv = self._common(model, role) + self.permission_args(self._profile(role, profile)) + \
            ["--output-format", "stream-json"] + \
            self.options.extra_args + self.options.headless_args + \
            ["--prompt=" + STDIN_PROMPT_POINTER]
        return Launch(argv, prompt, self._env())

    def worker(self, root, prompt, model, output, reads=()):
        argv = self._worker_argv(root, model, output, reads)
        argv.insert(1, "--skip-trust")
        return Launch(argv + ["--prompt=" + STDIN_PROMPT_POINTER], prompt, self._env())

    def interactive(self, root, role, prompt=None, model=""):
        argv = self._common(model, role) + self.options.extra_args + self.options.interactive_args
        if prompt:
            argv.append("--prompt-interactive=" + prompt)
        return Launch(argv, None, self._env())

    def parse_line(self, line):
        try:
            event = json.loads(line)
        except ValueError:
            return _limit_events(line)
        if not isinstance(event, dict):
            return []
        kind = event.get("type")
        if kind == "init" and event.get("session_id"):
            return [AgentEvent("session", name=str(event.get("model") or ""),
                               text=str(event["session_id"]))]
        # Gemini reports no usage per turn: a turn is the model's output between the
        # prompt or tool results (see UsageTally).
        if kind == "tool_use":
            return [AgentEvent("tool_call", name=str(event.get("tool_name") or event.get("name")),
                               text=tool_summary(event.get("parameters")),
                               call_id=str(event.get("tool_id") or "")),
                    AgentEvent("model_output")]
        if kind == "message" and event.get("role") == "assistant":
            said = str(event.get("content") or "")
            return [AgentEvent("model_output")] + ([AgentEvent(
                "said", name="delta" if event.get("delta") else "", text=said)]
                if said.strip() else [])
        if kind == "tool_result":
            failed = event.get("status") == "error"
            return [AgentEvent("tool_result", ok=not failed,
                               call_id=str(event.get("tool_id") or ""),
                               text=tool_reason(event.get("error") or event.get("output"))
                               if failed else "")]
        if kind == "result":
            stats = event.get("stats") or {}
            error = event.get("error")
            return [AgentEvent("usage", input_tokens=int(stats.get("input_tokens") or 0),
                               output_tokens=int(stats.get("output_tokens") or 0), total=True)
                    ] + ([AgentEvent("said", text=tool_reason(error, 1000))]
                         if event.get("status") == "error" and error else [])
        return []


WORKER_MCP_CONFIG = '{"mcpServers": {}}\n'


class CustomAgent(AgentAdapter):
    """An agent described in ferrus.toml by argv templates.

    Placeholders: {prompt}, {model}, {role}, {mcp_config} (a JSON file with this
    role's ferrus server under mcpServers).  An argument that is exactly
    "{model}" is dropped, with the flag before it, when no model is set."""

    def __init__(self, config, spec):
        self.spec = spec
        self.name = spec.name
        self.binary = spec.interactive[0]
        super().__init__(config)

    def install_hint(self):
        return "install `%s` and put it on PATH" % self.binary

    def version_argv(self):
        return [self.binary] + list(self.spec.version_args)

    def mcp_config_path(self, root, role):
        return os.path.join(root, FERRUS_DIR, "mcp-%s.json" % role)

    def _render(self, template, root, role, prompt, model):
        values = {"{model}": model or "", "{role}": role,
                  "{mcp_config}": self.mcp_config_path(root, role), "{prompt}": prompt or ""}
        argv = []
        for arg in template:
            if arg == "{model}" and not model:
                if argv and argv[-1].startswith("-"):
                    argv.pop()
                continue
            if arg == "{prompt}" and prompt is None:
                continue
            for placeholder, value in values.items():
                arg = arg.replace(placeholder, value)
            argv.append(arg)
        return argv

    def headless(self, root, role, prompt, model="", profile=None):
        stdin = prompt if self.spec.prompt == "stdin" else None
        argv = self._render(self.spec.headless, root, role,
                            None if stdin is not None else prompt, model)
        argv[1:1] = self.options.extra_args + self.options.headless_args
        return Launch(argv, stdin, dict(self.options.env))

    def worker(self, root, prompt, model, output, reads=()):
        """A pipeline worker: {mcp_config} names a file without any ferrus server."""
        path = self.mcp_config_path(root, "worker")
        if read_text(path, default="") != WORKER_MCP_CONFIG:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, WORKER_MCP_CONFIG)
        return self.headless(root, "worker", prompt, model)

    def can_edit(self, profile):
        return None           # its argv templates decide; ferrus adds no flags

    def parse_line(self, line):
        # A custom CLI that prints Claude Code's stream-json events (a wrapper around
        # it, say) gets its tool calls, tokens and cost counted; other output is read
        # for usage-limit messages only.
        return _parse_claude_style(line)

    def interactive(self, root, role, prompt=None, model=""):
        argv = self._render(self.spec.interactive, root, role, prompt, model)
        argv[1:1] = self.options.extra_args + self.options.interactive_args
        return Launch(argv, None, dict(self.options.env))

    def register(self, root, role, model, report):
        path = self.mcp_config_path(root, role)

        def add_server(data):
            _json_table(data, "mcpServers", path)[server_key(role)] = ferrus_server_entry(
                root, role, self.name)
        edit_json_file(path, add_server)
        report("Registered %s in %s/mcp-%s.json (passed to %s as {mcp_config})"
               % (server_key(role), FERRUS_DIR, role, self.name))

    def unregister(self, root, role, report):
        path = self.mcp_config_path(root, role)
        if os.path.exists(path):
            os.unlink(path)
            report("Removed %s/mcp-%s.json" % (FERRUS_DIR, role))

    def registration(self, root, role):
        return _load_json_quiet(self.mcp_config_path(root, role)).get("mcpServers", {}).get(
            server_key(role))

