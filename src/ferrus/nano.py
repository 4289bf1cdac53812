"""nano, the built-in agent: a local chat-completions model plays a ferrus role.

nano needs nothing but Python and a model server that speaks the OpenAI chat
completions API (Ollama, vLLM, llama.cpp's llama-server, LM Studio).  ferrus starts it
as it starts any agent CLI — ``ferrus -C ROOT nano --role executor --mcp-config FILE``
with the prompt on stdin — and nano starts the ferrus server FILE names over stdio,
exactly as the other CLIs' MCP clients do, so the model gets that role's tools and no
other.  Beside them it gets nano's own file tools, confined to the folder nano runs in
(the task's worktree): list, read a line range and search for every role; write and
exact-string edit with the "edit" permission profile (the executor's default); a shell
command with a timeout and bounded output only with "full".

A model turn: the conversation goes to ``POST {base_url}/chat/completions`` (streamed,
the tools offered), the stream is folded into text and tool calls, each call runs and
its result is appended.  A call whose arguments are not one JSON object, or that names
no offered tool, is answered once with a JSON error saying how to fix it; a second one
in a row ends the session.  Budgets ([agents.nano] max_session_tokens,
max_session_secs, max_tool_calls) stop a session with a message that names the budget;
the oldest tool exchanges are dropped when the conversation nears context_tokens.
Nothing is kept between sessions: a new one starts from the task's state on disk,
which its prompt tells it to read (wait_for_task), never from a hidden conversation.

What nano does goes to stdout as Claude Code's stream-json events (system init,
assistant messages with tool_use blocks and usage, user messages with tool_result
blocks, a result with the totals), so ferrus counts its tool calls and tokens and
keeps its last words with the parser it already has.  HTTP goes to loopback only,
unless [agents.nano] allow_remote = true.
"""

import contextlib
import fnmatch
import json
import os
import re
import subprocess
import sys
import threading
import time

from .basics import (LazyPattern, FerrusError, UsageError, __version__, deferred_dataclass,
                     did_you_mean, new_id, terminal_safe)
from .system import (atomic_write, kill_process_tree, process_group_kwargs, read_text,
                     shell_argv)
from .config import load_config
from .store import FERRUS_DIR
from .operations import ROLES
from .mcp import SESSION_ENV
from .agents import tool_summary
from .agent_files import DEFAULT_PERMISSIONS, WORKER_PERMISSIONS
from .nano_model import (ChatCompletionsClient, NanoModelError, NanoToolCall, nano_api_key,
                         nano_endpoint, nano_settings, resolve_nano_model)


# -- the MCP client --------------------------------------------------------------------

NANO_MCP_PROTOCOL = "2025-06-18"


class NanoMcpClient:
    """One stdio MCP server (ferrus serve) as nano's MCP client sees it.

    Newline-delimited JSON-RPC 2.0 both ways.  A reader thread hands each response
    to the request waiting for its id, so a blocking wait_for_task and a heartbeat
    can be in flight together; the server's own requests (ping) are answered."""

    def __init__(self, name, entry, cwd, env=None):
        self.name = name
        command = entry.get("command")
        args = entry.get("args") or []
        if not isinstance(command, str) or not command or not isinstance(args, list):
            raise FerrusError("MCP server %s has no command to start" % name,
                              "register the agent again (ferrus register)")
        environment = dict(os.environ if env is None else env)
        environment.update({str(k): str(v) for k, v in (entry.get("env") or {}).items()})
        # In nano's own process group: when ferrus stops nano's tree, its server goes too.
        self._proc = subprocess.Popen([command] + [str(arg) for arg in args], cwd=cwd,
                                      env=environment, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        self._write_lock = threading.Lock()
        self._pending = {}
        self._pending_lock = threading.Lock()
        self._ids = iter(range(1, 1 << 62))
        self._closed = None          # why the connection ended
        self.capabilities = {}
        threading.Thread(target=self._read, name="nano-mcp-%s" % name, daemon=True).start()

    def _send(self, message):
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8")
        with self._write_lock:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()

    def _read(self):
        with contextlib.suppress(OSError, ValueError):
            for raw in iter(self._proc.stdout.readline, b""):
                try:
                    message = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(message, dict):
                    self._dispatch(message)
        code = self._proc.wait()
        self._closed = "the MCP server %s exited (code %s)" % (self.name, code)
        with self._pending_lock:
            waiting, self._pending = list(self._pending.values()), {}
        for slot in waiting:
            slot["error"] = self._closed
            slot["done"].set()

    def _dispatch(self, message):
        if "method" in message:
            if "id" in message:        # the server asks us: only ping is ever needed
                reply = {"jsonrpc": "2.0", "id": message["id"]}
                if message["method"] == "ping":
                    reply["result"] = {}
                else:
                    reply["error"] = {"code": -32601, "message": "nano does not offer %s"
                                      % message["method"]}
                with contextlib.suppress(OSError, ValueError):
                    self._send(reply)
            return                     # notifications (progress, logging) are not needed
        with self._pending_lock:
            slot = self._pending.pop(message.get("id"), None)
        if slot is not None:
            if "error" in message:
                error = message["error"] if isinstance(message["error"], dict) else {}
                slot["error"] = str(error.get("message") or message["error"])
            else:
                slot["result"] = message.get("result")
            slot["done"].set()

    def request(self, method, params=None, timeout=60.0):
        if self._closed:
            raise FerrusError(self._closed)
        request_id = next(self._ids)
        slot = {"done": threading.Event(), "result": None, "error": None}
        with self._pending_lock:
            self._pending[request_id] = slot
        try:
            self._send({"jsonrpc": "2.0", "id": request_id, "method": method,
                        "params": params or {}})
        except (OSError, ValueError):
            with self._pending_lock:
                self._pending.pop(request_id, None)
            raise FerrusError(self._closed or "the MCP server %s is gone" % self.name) from None
        if not slot["done"].wait(timeout):
            with self._pending_lock:
                self._pending.pop(request_id, None)
            with contextlib.suppress(OSError, ValueError):
                self._send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                            "params": {"requestId": request_id, "reason": "timeout"}})
            raise FerrusError("the MCP server %s did not answer %s within %d s"
                              % (self.name, method, timeout))
        if slot["error"] is not None:
            raise FerrusError("%s: %s" % (method, slot["error"]))
        return slot["result"] if isinstance(slot["result"], dict) else {}

    def initialize(self, timeout=60.0):
        result = self.request("initialize", {
            "protocolVersion": NANO_MCP_PROTOCOL, "capabilities": {},
            "clientInfo": {"name": "ferrus-nano", "version": __version__}}, timeout)
        self.capabilities = result.get("capabilities") or {}
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return result

    def _paged(self, method, key, timeout):
        items, cursor = [], None
        for _page in range(100):
            result = self.request(method, {"cursor": cursor} if cursor else {}, timeout)
            items += [item for item in result.get(key) or [] if isinstance(item, dict)]
            cursor = result.get("nextCursor")
            if not cursor:
                break
        return items

    def list_tools(self, timeout=60.0):
        return self._paged("tools/list", "tools", timeout)

    def list_resources(self, timeout=60.0):
        if "resources" not in self.capabilities:
            return [], []
        return (self._paged("resources/list", "resources", timeout),
                self._paged("resources/templates/list", "resourceTemplates", timeout))

    def call_tool(self, name, arguments, timeout):
        """(is_error, text) of one tool call."""
        result = self.request("tools/call", {"name": name, "arguments": arguments}, timeout)
        return bool(result.get("isError")), _content_text(result.get("content"),
                                                          result.get("structuredContent"))

    def read_resource(self, uri, timeout=60.0):
        result = self.request("resources/read", {"uri": uri}, timeout)
        return "\n".join(str(item.get("text", "")) if "text" in item else
                         "(%s: binary content, %s)" % (item.get("uri"), item.get("mimeType"))
                         for item in result.get("contents") or [] if isinstance(item, dict))

    def close(self):
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.close()
        try:
            self._proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(2.0)


def _content_text(content, structured=None):
    parts = []
    for block in content or []:
        if isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict):
            parts.append("(%s content)" % block.get("type"))
    if not parts and structured is not None:
        parts.append(json.dumps(structured))
    return "\n".join(parts)


def read_mcp_config(path):
    """{server name: entry} from a JSON file with ``mcpServers`` (what register wrote)."""
    try:
        data = json.loads(read_text(path))
    except FileNotFoundError:
        raise FerrusError("nano's MCP configuration %s does not exist" % path,
                          "ferrus register --executor nano (or --supervisor nano) writes it"
                          ) from None
    except ValueError as err:
        raise FerrusError("nano's MCP configuration %s is not JSON: %s" % (path, err),
                          "register the agent again (ferrus register)") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise FerrusError("%s has no mcpServers object" % path,
                          "register the agent again (ferrus register)")
    return {str(name): entry for name, entry in servers.items() if isinstance(entry, dict)}


# -- nano's own file tools --------------------------------------------------------------

class NanoToolError(Exception):
    """A tool call that cannot be done as asked; the text goes back to the model."""


# Folders the file tools never enter: ferrus's state and git's own.
_NANO_HIDDEN = (FERRUS_DIR, ".git")
NANO_READ_LINES = 2000
NANO_SEARCH_MATCHES = 200
NANO_LIST_ENTRIES = 1000
NANO_SEARCH_FILE_BYTES = 2 * 1024 * 1024


def _fn(name, description, properties, required=()):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(required)}}}


_STRING = {"type": "string"}
_NANO_FILE_TOOL_SPECS = {
    "list_directory": _fn(
        "list_directory", "List a folder of the working folder (folders end with /).",
        {"path": dict(_STRING, description="folder, relative to the working folder; "
                                           "default ."),
         "recursive": {"type": "boolean", "description": "also list every subfolder"}}),
    "read_file": _fn(
        "read_file", "Read a text file, or some of its lines.",
        {"path": dict(_STRING, description="file, relative to the working folder"),
         "start_line": {"type": "integer", "description": "first line (1 = the first)"},
         "end_line": {"type": "integer", "description": "last line (inclusive)"}}, ["path"]),
    "grep_search": _fn(
        "grep_search", "Search files for a regular expression; gives path:line: text.",
        {"pattern": dict(_STRING, description="Python regular expression"),
         "path": dict(_STRING, description="folder or file to search; default ."),
         "include": dict(_STRING, description="only file names matching this glob, "
                                              "e.g. *.py")}, ["pattern"]),
    "write_file": _fn(
        "write_file", "Create or replace a file with the given content.",
        {"path": dict(_STRING, description="file, relative to the working folder"),
         "content": dict(_STRING, description="the whole new content")},
        ["path", "content"]),
    "replace": _fn(
        "replace", "Edit a file: replace an exact piece of its text (whitespace included) "
                   "with new text. old_string must occur exactly once unless replace_all.",
        {"path": dict(_STRING, description="file, relative to the working folder"),
         "old_string": dict(_STRING, description="the exact text to replace"),
         "new_string": dict(_STRING, description="the text to put there"),
         "replace_all": {"type": "boolean", "description": "replace every occurrence"}},
        ["path", "old_string", "new_string"]),
    "run_shell_command": _fn(
        "run_shell_command", "Run a shell command in the working folder; gives its exit "
                             "code and output (long output is cut in the middle).",
        {"command": dict(_STRING, description="the command line"),
         "timeout_secs": {"type": "integer", "description": "stop it after this many "
                                                            "seconds"}}, ["command"]),
}
_NANO_READ_TOOLS = ("list_directory", "read_file", "grep_search")
_NANO_EDIT_TOOLS = ("write_file", "replace")


def nano_file_tool_names(profile):
    """The file tools a permission profile gives (PERMISSION_PROFILES, or "output": a
    pipeline worker's)."""
    names = list(_NANO_READ_TOOLS)
    if profile in ("edit", "output", "full"):
        names += _NANO_EDIT_TOOLS
    if profile == "full":
        names.append("run_shell_command")
    return names


class NanoFileTools:
    """nano's file tools, confined to ``workdir``.

    Every path is resolved (symbolic links included) and must stay inside the working
    folder; .ferrus/ and .git are refused.  A pipeline worker (``output``) may write
    only its output file, and may read the files it was given (``reads``) wherever
    they are."""

    def __init__(self, workdir, profile, command_timeout_secs=120, result_chars=24000,
                 output=None, reads=()):
        self.workdir = os.path.abspath(workdir)
        self.real_root = os.path.realpath(self.workdir)
        self.names = nano_file_tool_names(profile)
        self.command_timeout_secs = command_timeout_secs
        self.result_chars = result_chars
        self.output = os.path.realpath(output) if output else None
        self.reads = {os.path.realpath(path) for path in reads}

    def specs(self):
        return [_NANO_FILE_TOOL_SPECS[name] for name in self.names]

    def call(self, name, args):
        """(ok, text) of one call; ``args`` is a dict."""
        handler = getattr(self, "_tool_" + name, None)
        if name not in self.names or handler is None:
            return False, "no tool %s here" % name
        try:
            return handler(**_known_args(args, _NANO_FILE_TOOL_SPECS[name]))
        except NanoToolError as err:
            return False, str(err)
        except TypeError as err:        # a required argument missing
            return False, "bad arguments for %s: %s" % (name, err)
        except OSError as err:
            return False, "%s: %s" % (err.filename or name, err.strerror or err)
        except (ValueError, UnicodeError) as err:  # e.g. a name the file system refuses
            return False, "%s cannot do that: %s" % (name, err)

    def _path(self, path, write=False):
        """(real path, path relative to the working folder) of an allowed path."""
        if not isinstance(path, str) or not path.strip():
            raise NanoToolError("path must be a non-empty string")
        if "\0" in path:
            raise NanoToolError("path %s has a null byte; a file name cannot"
                                % json.dumps(path))
        full = path if os.path.isabs(path) else os.path.join(self.workdir, path)
        try:
            real = os.path.realpath(full)
        except (OSError, ValueError) as err:
            raise NanoToolError("path %s cannot be used: %s" % (json.dumps(path), err)) \
                from None
        if write and self.output is not None:
            if real != self.output:
                raise NanoToolError("this worker may write only its output file %s"
                                    % self.output)
            return real, real
        if not write and real in self.reads:
            return real, path
        if real != self.real_root and not real.startswith(self.real_root.rstrip(os.sep) + os.sep):
            raise NanoToolError("%s is outside the working folder %s" % (path, self.workdir))
        relative = os.path.relpath(real, self.real_root)
        if relative.split(os.sep)[0] in _NANO_HIDDEN:
            raise NanoToolError("%s is ferrus's or git's own; use the ferrus tools instead"
                                % relative)
        return real, relative.replace(os.sep, "/")

    def _tool_list_directory(self, path=".", recursive=False):
        real, relative = self._path(path or ".")
        if not os.path.isdir(real):
            raise NanoToolError("%s is not a folder" % relative)
        entries = []
        for folder, dirs, files in os.walk(real):
            dirs[:] = sorted(d for d in dirs if not self._hidden(folder, d))
            files = [f for f in files if not self._hidden(folder, f)]
            base = os.path.relpath(folder, real)
            prefix = "" if base == "." else base.replace(os.sep, "/") + "/"
            entries += [prefix + d + "/" for d in dirs] + [prefix + f for f in sorted(files)]
            if not recursive or len(entries) > NANO_LIST_ENTRIES:
                break
        if not recursive:
            entries.sort()
        more = len(entries) - NANO_LIST_ENTRIES
        shown = entries[:NANO_LIST_ENTRIES]
        return True, "\n".join(shown) + ("\n… %d more" % more if more > 0 else "") \
            if shown else "(empty folder)"

    def _tool_read_file(self, path, start_line=None, end_line=None):
        real, relative = self._path(path)
        if not os.path.isfile(real):
            raise NanoToolError("%s is not a file" % relative)
        first = _whole(start_line, "start_line") or 1
        last = _whole(end_line, "end_line")
        if last is not None and last < first:
            raise NanoToolError("end_line %d is before start_line %d" % (last, first))
        last = min(last or first + NANO_READ_LINES - 1, first + NANO_READ_LINES - 1)
        lines, total, size = [], 0, 0
        with open(real, "rb") as handle:
            if b"\0" in handle.read(8192):
                raise NanoToolError("%s is a binary file (%d bytes)"
                                    % (relative, os.path.getsize(real)))
            handle.seek(0)
            for total, raw in enumerate(handle, 1):
                if first <= total <= last and size < self.result_chars:
                    line = raw.decode("utf-8", "replace")
                    lines.append(line)
                    size += len(line)
        text = "".join(lines)
        cut = len(text) > self.result_chars
        text = text[:self.result_chars]
        shown_last = first + len(lines) - 1
        head = "%s: lines %d-%d of %d%s" % (relative, first, max(first, shown_last), total,
                                             " (cut: read a smaller range)" if cut or
                                             shown_last < min(last, total) else "")
        if not lines:
            head = "%s: %s" % (relative, "empty file" if total == 0 else
                               "it has %d lines, none from line %d" % (total, first))
        return True, head + "\n" + text

    def _tool_grep_search(self, pattern, path=".", include=None):
        if not isinstance(pattern, str) or not pattern:
            raise NanoToolError("pattern must be a non-empty string")
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise NanoToolError("pattern is not a valid regular expression: %s" % err) \
                from None
        real, relative = self._path(path or ".")
        files = [real] if os.path.isfile(real) else self._walk_files(real, include)
        matches, searched, too_large = [], 0, []
        for file_path in files:
            if len(matches) > NANO_SEARCH_MATCHES:
                break
            with contextlib.suppress(OSError):
                if os.path.getsize(file_path) > NANO_SEARCH_FILE_BYTES:
                    too_large.append(self._shown_path(file_path))
                    continue
            searched += 1
            matches += self._grep_one(file_path, regex)
        more = len(matches) - NANO_SEARCH_MATCHES
        text = "\n".join(matches[:NANO_SEARCH_MATCHES]) or "no match in %d file(s)" % searched
        if too_large:
            text += "\nnot searched (over %s; read_file reads them by line range): %s" % (
                "%d MB" % (NANO_SEARCH_FILE_BYTES >> 20) if NANO_SEARCH_FILE_BYTES >= 1 << 20
                else "%d bytes" % NANO_SEARCH_FILE_BYTES, ", ".join(too_large[:20]) +
                (" and %d more" % (len(too_large) - 20) if len(too_large) > 20 else ""))
        return True, text + ("\n… more matches; narrow the pattern or the path" if more > 0
                             else "")

    def _shown_path(self, file_path):
        return os.path.relpath(file_path, self.real_root).replace(os.sep, "/")

    def _hidden(self, folder, name):
        """ferrus's and git's own, at the top of the working folder (a worktree's .git
        is a file)."""
        return name in _NANO_HIDDEN and os.path.realpath(folder) == self.real_root

    def _walk_files(self, real, include):
        for folder, dirs, files in os.walk(real):
            dirs[:] = sorted(d for d in dirs if not self._hidden(folder, d))
            for name in sorted(files):
                if self._hidden(folder, name):
                    continue
                if not include or fnmatch.fnmatch(name, include):
                    yield os.path.join(folder, name)

    def _grep_one(self, file_path, regex):
        found = []
        try:
            if os.path.getsize(file_path) > NANO_SEARCH_FILE_BYTES:
                return found
            with open(file_path, "rb") as handle:
                data = handle.read()
        except OSError:
            return found
        if b"\0" in data[:8192]:
            return found
        shown = self._shown_path(file_path)
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if regex.search(line):
                found.append("%s:%d: %s" % (shown, number, line.strip()[:300]))
                if len(found) > NANO_SEARCH_MATCHES:
                    break
        return found

    def _tool_write_file(self, path, content):
        if not isinstance(content, str):
            raise NanoToolError("content must be a string (the whole file)")
        real, relative = self._path(path, write=True)
        if os.path.isdir(real):
            raise NanoToolError("%s is a folder" % relative)
        existed = os.path.exists(real)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        atomic_write(real, content)
        return True, "%s %s (%d lines)" % ("replaced" if existed else "created", relative,
                                           content.count("\n") + (not content.endswith("\n")
                                                                  and bool(content)))

    def _tool_replace(self, path, old_string, new_string, replace_all=False):
        if not isinstance(old_string, str) or not old_string:
            raise NanoToolError("old_string must be the exact, non-empty text to replace "
                                "(use write_file to create a file)")
        if not isinstance(new_string, str):
            raise NanoToolError("new_string must be a string")
        real, relative = self._path(path, write=True)
        if not os.path.isfile(real):
            raise NanoToolError("%s does not exist (write_file creates a file)" % relative)
        with open(real, "r", encoding="utf-8", errors="surrogateescape", newline="") as handle:
            text = handle.read()
        count = text.count(old_string)
        if count == 0 and "\r\n" in text and "\r\n" not in old_string:
            old_string, new_string = (old_string.replace("\n", "\r\n"),
                                      new_string.replace("\n", "\r\n"))
            count = text.count(old_string)
        if count == 0:
            raise NanoToolError("old_string was not found in %s; read the file again and copy "
                                "the exact text, whitespace and indentation included" % relative)
        if count > 1 and replace_all is not True:
            raise NanoToolError("old_string occurs %d times in %s; include more of the "
                                "surrounding lines so it occurs once, or set replace_all"
                                % (count, relative))
        text = text.replace(old_string, new_string) if replace_all is True \
            else text.replace(old_string, new_string, 1)
        atomic_write(real, text.encode("utf-8", "surrogateescape"))
        return True, "replaced %d occurrence(s) in %s" % (count if replace_all is True else 1,
                                                           relative)

    def _tool_run_shell_command(self, command, timeout_secs=None):
        if not isinstance(command, str) or not command.strip():
            raise NanoToolError("command must be a non-empty string")
        limit = _whole(timeout_secs, "timeout_secs") or self.command_timeout_secs
        limit = min(limit, self.command_timeout_secs)
        proc = subprocess.Popen(shell_argv(command), cwd=self.workdir, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                **process_group_kwargs())
        output = _BoundedOutput(self.result_chars)
        reader = threading.Thread(target=output.drain, args=(proc.stdout,), daemon=True)
        reader.start()
        try:
            code = proc.wait(limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_process_tree(proc)
            code, timed_out = proc.wait(), True
        reader.join(5)
        head = "timed out after %d s (stopped)" % limit if timed_out else "exit %d" % code
        return code == 0 and not timed_out, head + "\n" + output.text()


class _BoundedOutput:
    """A command's output with only its beginning and end kept (memory stays bounded)."""

    def __init__(self, chars):
        self.head_limit = chars // 4
        self.tail_limit = chars - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def drain(self, stream):
        with contextlib.suppress(OSError, ValueError):
            for chunk in iter(lambda: stream.read(65536), b""):
                room = self.head_limit - len(self.head)
                if room > 0:
                    self.head += chunk[:room]
                    chunk = chunk[room:]
                self.tail += chunk
                if len(self.tail) > self.tail_limit:
                    self.dropped += len(self.tail) - self.tail_limit
                    del self.tail[:len(self.tail) - self.tail_limit]

    def text(self):
        middle = "\n… %d bytes cut …\n" % self.dropped if self.dropped else ""
        return (bytes(self.head).decode("utf-8", "replace") + middle +
                bytes(self.tail).decode("utf-8", "replace"))


def _whole(value, name):
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NanoToolError("%s must be a whole number from 1" % name)
    return value


def _known_args(args, spec):
    """The arguments a tool's schema names (a model's extra keys are ignored)."""
    known = spec["function"]["parameters"]["properties"]
    return {key: value for key, value in args.items() if key in known}


# -- the toolbox: ferrus's MCP tools and the file tools under one list ------------------

@deferred_dataclass
class NanoTool:
    """A tool as the model sees it, and where a call goes."""

    name: str             # the name offered to the model
    shown: str            # the name in nano's output (mcp__<server>__<tool> for MCP tools)
    spec: dict            # the OpenAI function tool
    server: "NanoMcpClient | None" = None
    remote_name: str = ""


class NanoToolbox:
    """Every tool of a session: the MCP servers' (under their own names when those
    are free) and nano's file tools; plus read_resource when a server has resources
    (the prompts point at ferrus://diff and ferrus://task)."""

    def __init__(self, files, servers=(), tool_timeout=180.0):
        self.files = files
        self.servers = list(servers)
        self.tool_timeout = tool_timeout
        self.tools = {}
        for spec in files.specs():
            name = spec["function"]["name"]
            self.tools[name] = NanoTool(name, name, spec)
        resources = []
        for server in self.servers:
            for tool in server.list_tools():
                self._add_mcp_tool(server, tool)
            listed, templates = server.list_resources()
            resources += [(server, item.get("uri") or item.get("uriTemplate"))
                          for item in listed + templates]
        if resources:
            uris = ", ".join(sorted({str(uri) for _server, uri in resources if uri}))[:600]
            self.resource_servers = {server for server, _uri in resources}
            self.tools["read_resource"] = NanoTool("read_resource", "read_resource", _fn(
                "read_resource", "Read an MCP resource by its URI (%s)." % uris,
                {"uri": dict(_STRING, description="e.g. ferrus://diff")}, ["uri"]))
        self._specs = [tool.spec for tool in self.tools.values()]

    def _add_mcp_tool(self, server, tool):
        remote = str(tool.get("name") or "")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", remote):
            return
        name = remote if remote not in self.tools else \
            re.sub(r"[^A-Za-z0-9_-]", "_", "%s__%s" % (server.name, remote))[:64]
        schema = tool.get("inputSchema") if isinstance(tool.get("inputSchema"), dict) \
            else {"type": "object", "properties": {}}
        self.tools[name] = NanoTool(name, "mcp__%s__%s" % (server.name, remote), {
            "type": "function", "function": {"name": name,
                                             "description": str(tool.get("description") or
                                                                "")[:1024],
                                             "parameters": schema}},
            server, remote)

    def specs(self):
        return self._specs

    def call(self, name, args):
        """(ok, text) of one call of an offered tool."""
        tool = self.tools[name]
        try:
            if tool.server is not None:
                is_error, text = tool.server.call_tool(tool.remote_name, args,
                                                       self.tool_timeout)
                return not is_error, text
            if name == "read_resource":
                return self._read_resource(args.get("uri"))
        except FerrusError as err:
            return False, err.full_text()
        return self.files.call(name, args)

    def _read_resource(self, uri):
        if not isinstance(uri, str) or not uri:
            return False, "uri must be a resource URI such as ferrus://diff"
        errors = []
        for server in self.resource_servers:
            try:
                return True, server.read_resource(uri, self.tool_timeout)
            except FerrusError as err:
                errors.append(str(err))
        return False, "; ".join(errors)

    def close(self):
        for server in self.servers:
            server.close()


# -- what nano prints ----------------------------------------------------------------------

class NanoStreamOutput:
    """Claude Code's stream-json events, one JSON object a line on ``stream`` (what
    the NanoAdapter parses with ferrus's Claude-style parser)."""

    def __init__(self, stream, session_id, model):
        self.stream = stream
        self.session_id = session_id
        self.model = model

    def _emit(self, event):
        self.stream.write(json.dumps(event, ensure_ascii=False) + "\n")
        self.stream.flush()

    def started(self, tools):
        self._emit({"type": "system", "subtype": "init", "session_id": self.session_id,
                    "model": self.model, "tools": tools, "agent": "ferrus-nano/%s"
                                                                   % __version__})

    def assistant(self, message_id, text, calls, turn):
        content = ([{"type": "text", "text": text}] if text.strip() else []) + [
            {"type": "tool_use", "id": call_id, "name": shown, "input": args}
            for call_id, shown, args in calls]
        message = {"id": message_id, "role": "assistant", "model": turn.model or self.model,
                   "content": content}
        if turn.prompt_tokens is not None or turn.completion_tokens is not None:
            message["usage"] = {"input_tokens": turn.prompt_tokens or 0,
                                "output_tokens": turn.completion_tokens or 0}
        self._emit({"type": "assistant", "session_id": self.session_id, "message": message})

    def results(self, results):
        self._emit({"type": "user", "session_id": self.session_id, "message": {
            "role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                         "is_error": not ok, "content": text}
                                        for call_id, ok, text in results]}})

    def note(self, text):
        """Something nano itself says (a repair, a trimmed context): plain text."""
        self.stream.write("nano: %s\n" % text)
        self.stream.flush()

    def finished(self, error, text, usage, turns, seconds):
        event = {"type": "result", "subtype": "error" if error else "success",
                 "is_error": bool(error), "result": text, "session_id": self.session_id,
                 "num_turns": turns, "duration_ms": int(seconds * 1000)}
        if usage is not None:
            event["usage"] = {"input_tokens": usage[0], "output_tokens": usage[1]}
        self._emit(event)


class NanoHumanOutput:
    """The same events as readable lines, for an interactive session."""

    def __init__(self, stream):
        self.stream = stream

    def _say(self, text):
        self.stream.write(terminal_safe(text) + "\n")
        self.stream.flush()

    def started(self, tools):
        self._say("nano: %d tools; type your answer after each reply, an empty line or "
                  "Ctrl+D ends" % len(tools))

    def assistant(self, message_id, text, calls, turn):
        if text.strip():
            self._say(text.strip())
        for _call_id, shown, args in calls:
            summary = tool_summary(args) if isinstance(args, dict) else str(args)[:100]
            self._say("  ▸ %s%s" % (shown, "  " + summary if summary else ""))

    def results(self, results):
        for _call_id, ok, text in results:
            if not ok:
                self._say("  ✗ %s" % " ".join(text.split())[:200])

    def note(self, text):
        self._say("nano: %s" % text)

    def finished(self, error, text, usage, turns, seconds):
        if error:
            self._say(text)


# -- the agent loop ----------------------------------------------------------------------

NANO_SYSTEM_PROMPT = """You are nano, a coding agent that ferrus runs without a terminal.
You act only by calling the tools offered, one JSON object of arguments per call, exactly
as each tool's schema says. File paths are relative to the working folder {workdir}.
Your file tools: {file_tools}. The other tools are ferrus's: they move the task forward.
When the instructions say to stop, answer with one short sentence and call no tool."""

# A model that writes its call as text instead of a tool call: Hermes/Qwen's
# <tool_call>{...}</tool_call>, or a bare {"name": ..., "arguments": {...}} object.
_TEXT_TOOL_CALL = LazyPattern(r"<tool_call>\s*(\{.*?\})\s*</tool_call>|"
                              r"^\s*(?:```(?:json)?\s*)?(\{\s*\"name\".*\})\s*(?:```)?\s*$",
                              re.DOTALL)


class NanoBudgetExceeded(FerrusError):
    """A session budget ran out."""


@deferred_dataclass
class NanoOutcome:
    """How a session ended: exit code 0 (the model stopped) or 1, and its last text."""

    exit_code: int
    text: str


class NanoAgent:
    """One session: the conversation, its budgets and its repairs.

    ``clock`` is a monotonic clock (injectable).  The conversation lives in memory
    only; a crash loses it and the next session starts from the task's state."""

    def __init__(self, client, toolbox, settings, output, clock=time.monotonic,
                 workdir=".", heartbeat=None):
        self.client = client
        self.toolbox = toolbox
        self.settings = settings
        self.output = output
        self.clock = clock
        self.heartbeat = heartbeat
        self.started = clock()
        self.turns = 0
        self.tool_calls = 0
        self.reported = [0, 0]        # tokens the server reported (input, output)
        self.any_reported = False
        self.estimated_tokens = 0     # reported, plus an estimate where it reported none
        self.repairs_in_a_row = 0
        self.tokens_per_char = 0.3    # calibrated from the server's prompt_tokens
        file_tools = ", ".join(toolbox.files.names)
        self.messages = [{"role": "system", "content": NANO_SYSTEM_PROMPT.format(
            workdir=os.path.abspath(workdir), file_tools=file_tools)}]
        self._prompt_text = ""
        self._spec_chars = len(json.dumps(toolbox.specs()))

    # - budgets -

    def _check_budgets(self):
        settings, elapsed = self.settings, self.clock() - self.started
        if elapsed >= settings.max_session_secs:
            raise NanoBudgetExceeded(
                "nano stopped: this session ran %s, its budget is %d s ([agents.nano] "
                "max_session_secs)" % (_seconds(elapsed), settings.max_session_secs),
                "the task's state is kept: the next session goes on from it; raise "
                "max_session_secs under [agents.nano] for longer sessions")
        if self.estimated_tokens >= settings.max_session_tokens:
            raise NanoBudgetExceeded(
                "nano stopped: this session used %d tokens, its budget is %d "
                "([agents.nano] max_session_tokens)" % (self.estimated_tokens,
                                                         settings.max_session_tokens),
                "the task's state is kept: the next session goes on from it; raise "
                "max_session_tokens under [agents.nano] for longer sessions")
        if self.tool_calls >= settings.max_tool_calls:
            raise NanoBudgetExceeded(
                "nano stopped: this session made %d tool calls, its budget is %d "
                "([agents.nano] max_tool_calls)" % (self.tool_calls, settings.max_tool_calls),
                "the task's state is kept: the next session goes on from it; raise "
                "max_tool_calls under [agents.nano] if the work needs more")

    # - context -

    def _chars(self):
        return self._spec_chars + sum(_message_chars(message) for message in self.messages)

    def _context_limit(self):
        return self.settings.context_tokens - self.settings.max_tokens

    def _fit_context(self):
        """Drop the oldest tool exchanges (whole: an answer with its results) until the
        conversation fits 85% of what the context leaves beside the answer."""
        limit = self._context_limit() * 0.85
        if self._chars() * self.tokens_per_char <= limit:
            return
        dropped = 0
        while self._chars() * self.tokens_per_char > limit * 0.8:
            end = self._first_group_end()
            if end is None:
                break
            dropped += end - 2
            del self.messages[2:end]
        if dropped:
            self.messages[1]["content"] = self._prompt_text + (
                "\n\n[nano: %d earlier messages of this session were removed to stay within "
                "the model's context; ferrus keeps the task's state, so read it again with "
                "the ferrus tools when you need it]" % dropped)
            self.output.note("removed %d earlier messages to stay within context_tokens = %d"
                             % (dropped, self.settings.context_tokens))
        if self._chars() * self.tokens_per_char > limit:
            for message in self.messages[2:]:
                if message["role"] == "tool" and len(message["content"]) > 2000:
                    message["content"] = message["content"][:2000] + "\n… (cut to fit)"
        if self._chars() * self.tokens_per_char > self._context_limit():
            raise FerrusError(
                "nano stopped: the conversation no longer fits context_tokens = %d with "
                "max_tokens = %d for the answer" % (self.settings.context_tokens,
                                                     self.settings.max_tokens),
                "run the model with a larger context and raise context_tokens under "
                "[agents.nano] to match")

    def _first_group_end(self):
        """The end of the oldest exchange after the prompt (None: only the newest is left)."""
        index = 3
        while index < len(self.messages) and self.messages[index]["role"] == "tool":
            index += 1
        return index if index < len(self.messages) else None

    # - turns -

    def run(self, prompt, next_input=None):
        """Work until the model stops (then ask ``next_input`` for more, interactive)."""
        self._prompt_text = prompt
        self.messages.append({"role": "user", "content": prompt})
        self.output.started(sorted(self.toolbox.tools))
        last_text = ""
        try:
            while True:
                turn = self._turn()
                if turn is not None:
                    continue
                last_text = self._last_text()
                answer = next_input() if next_input is not None else None
                if not answer:
                    break
                self.messages.append({"role": "user", "content": answer})
        except FerrusError as err:
            text = err.full_text()
            self.output.finished(True, text, self._usage(), self.turns,
                                 self.clock() - self.started)
            return NanoOutcome(1, text)
        self.output.finished(False, last_text, self._usage(), self.turns,
                             self.clock() - self.started)
        return NanoOutcome(0, last_text)

    def _usage(self):
        return tuple(self.reported) if self.any_reported else None

    def _last_text(self):
        for message in reversed(self.messages):
            if message["role"] == "assistant" and message.get("content"):
                return message["content"]
        return ""

    def _turn(self):
        """One model turn and its tool calls; None when the model stopped."""
        self._check_budgets()
        self._fit_context()
        request_chars = self._chars()
        try:
            turn = self.client.complete(self.messages, self.toolbox.specs(), within_secs=(
                self.settings.max_session_secs - (self.clock() - self.started)))
        except NanoModelError:
            self._check_budgets()          # the session's budget cut the answer short
            raise
        self.turns += 1
        self._count_usage(turn, request_chars)
        calls = turn.tool_calls or self._calls_in_text(turn)
        message = {"role": "assistant", "content": turn.text if not calls or
                   turn.tool_calls else ""}
        if calls:
            message["tool_calls"] = [{"id": call.call_id, "type": "function",
                                      "function": {"name": call.name,
                                                   "arguments": call.arguments}}
                                     for call in calls]
        self.messages.append(message)
        parsed = [(call, self._arguments(call)) for call in calls]
        self.output.assistant(new_id("msg"), message["content"] or "", [
            (call.call_id, self._shown(call.name), args if problem is None else call.arguments)
            for call, (args, problem) in parsed], turn)
        if not calls:
            return None
        self._run_calls(parsed, turn)
        return turn

    def _count_usage(self, turn, request_chars):
        if turn.prompt_tokens is not None:
            self.any_reported = True
            self.reported[0] += turn.prompt_tokens
            if request_chars:
                self.tokens_per_char = max(0.05, min(2.0, turn.prompt_tokens / request_chars))
        if turn.completion_tokens is not None:
            self.any_reported = True
            self.reported[1] += turn.completion_tokens
        answer_chars = len(turn.text) + sum(len(c.arguments) + len(c.name)
                                            for c in turn.tool_calls)
        self.estimated_tokens += (turn.prompt_tokens if turn.prompt_tokens is not None
                                  else int(request_chars * self.tokens_per_char)) + \
            (turn.completion_tokens if turn.completion_tokens is not None
             else int(answer_chars * self.tokens_per_char))

    def _shown(self, name):
        tool = self.toolbox.tools.get(name)
        return tool.shown if tool is not None else name

    def _calls_in_text(self, turn):
        """A tool call the model wrote as text, when it names an offered tool."""
        match = _TEXT_TOOL_CALL.search(turn.text or "")
        if not match:
            return []
        try:
            data = json.loads(match.group(1) or match.group(2))
        except ValueError:
            return []
        if not isinstance(data, dict) or data.get("name") not in self.toolbox.tools:
            return []
        arguments = data.get("arguments", data.get("parameters", {}))
        self.output.note("the model wrote its call of %s as text; nano made it a tool call"
                         % data["name"])
        return [NanoToolCall(new_id("call"), data["name"], arguments if isinstance(
            arguments, str) else json.dumps(arguments))]

    def _arguments(self, call):
        """(arguments dict, None) or (None, what is wrong with the call)."""
        if call.name not in self.toolbox.tools:
            close = did_you_mean(call.name, list(self.toolbox.tools))
            return None, "there is no tool named %s%s" % (
                json.dumps(call.name), "; did you mean %s?" % close if close else
                "; the tools are: %s" % ", ".join(sorted(self.toolbox.tools)))
        raw = (call.arguments or "").strip() or "{}"
        try:
            value = json.loads(raw)
            if isinstance(value, str):         # arguments encoded twice
                value = json.loads(value)
        except ValueError as err:
            return None, "the arguments are not valid JSON (%s): %s" % (err, raw[:300])
        if not isinstance(value, dict):
            return None, "the arguments must be one JSON object, got %s" % raw[:300]
        required = self.toolbox.tools[call.name].spec["function"]["parameters"].get(
            "required") or []
        missing = [key for key in required if key not in value]
        if missing:
            return None, "%s needs the argument(s) %s" % (call.name, ", ".join(missing))
        return value, None

    def _run_calls(self, parsed, turn):
        results, malformed = [], []
        for call, (args, problem) in parsed:
            if problem is not None:
                malformed.append(problem)
                text = json.dumps({"error": "malformed tool call", "problem": problem,
                                   "fix": "call the tool again with arguments that are one "
                                          "JSON object matching its parameters",
                                   "parameters": self._parameters_of(call.name)})
                ok = False
            else:
                self.tool_calls += 1
                ok, text = self.toolbox.call(call.name, args)
                if self.heartbeat is not None:
                    self.heartbeat.saw(call.name, ok, text)
            text = _bounded(text, self.toolbox.files.result_chars)
            results.append((call.call_id, ok, text))
            self.messages.append({"role": "tool", "tool_call_id": call.call_id,
                                  "content": text})
        self.output.results(results)
        if not malformed:
            self.repairs_in_a_row = 0
            return
        if turn.finish_reason == "length":
            malformed.append("the answer was cut at max_tokens = %d"
                             % self.settings.max_tokens)
        if self.repairs_in_a_row:
            raise FerrusError("nano stopped: the model's tool call was malformed again after "
                              "one repair: %s" % malformed[0],
                              "this model does not call tools reliably: `ferrus agents "
                              "--probe` tests it; try another model or a server with its "
                              "tool-call parser on (vLLM --enable-auto-tool-choice, "
                              "llama-server --jinja)")
        self.repairs_in_a_row = 1
        self.output.note("repairing a malformed tool call: %s" % malformed[0])

    def _parameters_of(self, name):
        tool = self.toolbox.tools.get(name)
        return tool.spec["function"]["parameters"] if tool is not None else {
            "tools": sorted(self.toolbox.tools)}


def _message_chars(message):
    chars = len(message.get("content") or "") + 16
    for call in message.get("tool_calls") or ():
        chars += len(call["function"]["arguments"]) + len(call["function"]["name"]) + 40
    return chars


def _bounded(text, chars):
    text = text or ""
    if len(text) <= chars:
        return text
    return text[:chars] + "\n… (%d more characters cut)" % (len(text) - chars)


def _seconds(seconds):
    return "%d s" % seconds if seconds < 120 else "%d min" % (seconds // 60)


class NanoHeartbeat:
    """Keeps the executor's lease alive while a slow model thinks.

    After a wait_for_task that claimed the task, the heartbeat tool is called every
    [lease] heartbeat_interval_secs from a thread; the model may call it too.  It
    stops at the end of the session's budget (``budget_secs`` from its start, by the
    monotonic ``clock``): a session stuck past its budget lets its lease run out."""

    def __init__(self, toolbox, interval_secs, budget_secs=None, clock=time.monotonic):
        self.toolbox = toolbox
        self.interval = max(1.0, float(interval_secs))
        self.clock = clock
        self.deadline = None if budget_secs is None else clock() + budget_secs
        self._stop = threading.Event()
        self._thread = None

    def saw(self, name, ok, text):
        if self._thread is None and name == "wait_for_task" and ok and \
                '"timeout"' not in text and "heartbeat" in self.toolbox.tools:
            self._thread = threading.Thread(target=self._beat, name="nano-heartbeat",
                                            daemon=True)
            self._thread.start()

    def _beat(self):
        while not self._stop.wait(self.interval) and self.beat():
            pass

    def beat(self):
        """One heartbeat; False (and none sent) once the session's budget is spent."""
        if self.deadline is not None and self.clock() >= self.deadline:
            return False
        tool = self.toolbox.tools["heartbeat"]
        with contextlib.suppress(FerrusError):
            tool.server.call_tool(tool.remote_name, {}, 30.0)
        return True

    def stop(self):
        self._stop.set()


# -- the command: `ferrus nano` (hidden; agents' launches use it) ------------------------

def add_nano_parser(sub):
    """`ferrus nano`: added without help text, so it stays out of `ferrus --help`
    (ferrus starts it; people use `ferrus register --executor nano`)."""
    p = sub.add_parser("nano", description="nano, the built-in agent (ferrus starts it as "
                                           "the agent of a role; the prompt comes on stdin)")
    p.add_argument("--role", choices=ROLES, help="the role it plays (its MCP server's)")
    p.add_argument("--mcp-config", metavar="FILE",
                   help="JSON file whose mcpServers nano starts and uses")
    p.add_argument("--model", metavar="M", help="the model (default: [agents.nano] model)")
    p.add_argument("--permissions", choices=("read-only", "edit", "output", "full"),
                   help="which file tools it gets (default: the role's profile)")
    p.add_argument("--prompt", metavar="TEXT", help="the prompt (default: standard input)")
    p.add_argument("--interactive", action="store_true",
                   help="read more instructions from the terminal after each answer")
    p.add_argument("--worker-output", metavar="FILE",
                   help="a pipeline worker: no ferrus server, may write only FILE")
    p.add_argument("--read", action="append", default=[], metavar="FILE",
                   help="a pipeline worker may read FILE (repeatable)")
    p.set_defaults(run=cmd_nano)
    return p


def cmd_nano(args, root):
    try:
        return _run_nano(args, root)
    except FerrusError as err:
        if not args.interactive:
            # Said as nano's last event too, so `ferrus run` shows why the session ended
            # (a start-up problem: its settings, its model server, its MCP server).
            NanoStreamOutput(sys.stdout, os.environ.get(SESSION_ENV) or new_id("nano"),
                             args.model or "").finished(True, err.full_text(), None, 0, 0.0)
        raise


def _run_nano(args, root):
    config = load_config(root)
    settings = nano_settings(config)
    if args.worker_output is None and (args.role is None or args.mcp_config is None):
        raise UsageError("nano needs --role and --mcp-config (or --worker-output)",
                         "ferrus starts nano itself: ferrus register --executor nano")
    profile = args.permissions or (WORKER_PERMISSIONS if args.worker_output else
                                   DEFAULT_PERMISSIONS[args.role])
    prompt = args.prompt if args.prompt is not None else \
        (_read_human_line() if args.interactive else sys.stdin.read())
    if not (prompt or "").strip():
        if args.interactive:
            return 0                       # nothing asked: the person left at once
        raise UsageError("nano got no prompt", "give it on standard input or with --prompt")
    endpoint = nano_endpoint(settings)
    client = ChatCompletionsClient(endpoint, "", settings, nano_api_key(settings))
    client.model = resolve_nano_model(client, (args.model or "").strip() or settings.model)
    workdir = os.getcwd()
    files = NanoFileTools(workdir, profile, settings.command_timeout_secs,
                          result_chars=max(2000, min(24000, settings.context_tokens)),
                          output=args.worker_output, reads=args.read)
    servers = []
    try:
        for name, entry in (read_mcp_config(args.mcp_config).items()
                            if args.mcp_config else ()):
            server = NanoMcpClient(name, entry, workdir)
            servers.append(server)
            server.initialize()
        toolbox = NanoToolbox(files, servers, tool_timeout=config.limits.wait_timeout_secs + 120)
        servers = []                       # the toolbox closes them from here on
    finally:
        for server in servers:
            server.close()
    session = os.environ.get(SESSION_ENV) or new_id("nano")
    output = NanoHumanOutput(sys.stdout) if args.interactive else \
        NanoStreamOutput(sys.stdout, session, client.model)
    heartbeat = NanoHeartbeat(toolbox, config.lease.heartbeat_interval_secs,
                              settings.max_session_secs) if args.role == "executor" else None
    agent = NanoAgent(client, toolbox, settings, output, workdir=workdir, heartbeat=heartbeat)
    try:
        outcome = agent.run(prompt, _read_human_line if args.interactive else None)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        toolbox.close()
        client.close()
    return outcome.exit_code


def _read_human_line():
    """One instruction from the person at the terminal (None at EOF or an empty line)."""
    try:
        line = input("you> ")
    except EOFError:
        return None
    return line.strip() or None
