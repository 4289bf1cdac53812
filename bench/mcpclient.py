"""A minimal MCP client over stdio pipes, for timing (standard library only).

One reader thread per connection parses newline-delimited JSON-RPC from the
server's stdout and stamps every response with ``time.perf_counter()`` the
moment its line arrives, so latencies do not include the time the main
thread takes to notice.  stderr goes to a temporary file, shown when a
server dies.

Every connection is registered with a :class:`ProcessRegistry`, which kills
whatever is still alive when the bench ends, however it ends.
"""

import itertools
import json
import os
import signal
import sys
import subprocess
import tempfile
import threading
import time

PROTOCOL_VERSION = "2025-06-18"


class McpFailure(Exception):
    """The server answered with an error, a tool error, or not at all."""


class ProcessRegistry:
    """Every child process the bench starts; ``kill_all`` stops the live ones."""

    def __init__(self):
        self._procs = []
        self._lock = threading.Lock()

    def popen(self, argv, new_session=False, **kwargs):
        if new_session and os.name != "nt":
            kwargs["start_new_session"] = True
        proc = subprocess.Popen(argv, **kwargs)
        proc._bench_group = bool(new_session and os.name != "nt")
        with self._lock:
            self._procs.append(proc)
        return proc

    def forget(self, proc):
        with self._lock:
            if proc in self._procs:
                self._procs.remove(proc)

    @staticmethod
    def stop(proc, grace=2.0):
        """TERM (to the group when it has one), then KILL after ``grace`` seconds."""
        if proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, getattr(signal, "SIGKILL", signal.SIGTERM)):
            try:
                if getattr(proc, "_bench_group", False):
                    os.killpg(proc.pid, sig)
                else:
                    proc.send_signal(sig)
            except (ProcessLookupError, PermissionError, OSError):
                pass
            try:
                proc.wait(grace)
                return
            except subprocess.TimeoutExpired:
                continue
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            pass

    def kill_all(self):
        with self._lock:
            procs = list(self._procs)
            self._procs.clear()
        for proc in procs:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            self.stop(proc, grace=1.0)


class McpConnection:
    """One MCP server process and the client side of its pipes."""

    def __init__(self, argv, registry, cwd=None, env=None, label="server"):
        self.label = label
        self.argv = argv
        self.registry = registry
        self._stderr = tempfile.TemporaryFile()
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._responses = {}          # id -> (message, perf_counter at arrival)
        self.notifications = 0
        self.eof = False
        self.t_spawn = time.perf_counter()
        self.proc = registry.popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=self._stderr)
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                         name="mcp-reader-%s" % label)
        self._reader.start()

    # -- reading -------------------------------------------------------------------

    def _read_loop(self):
        stream = self.proc.stdout
        try:
            while True:
                line = stream.readline()
                arrived = time.perf_counter()
                if not line:
                    break
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(message, dict):
                    continue
                if "id" in message and ("result" in message or "error" in message):
                    with self._cond:
                        self._responses[message["id"]] = (message, arrived)
                        self._cond.notify_all()
                else:
                    self.notifications += 1
        except (OSError, ValueError):
            pass
        finally:
            with self._cond:
                self.eof = True
                self._cond.notify_all()

    def stderr_tail(self, limit=600):
        try:
            self._stderr.seek(0)
            text = self._stderr.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        return text[-limit:].strip()

    # -- writing ---------------------------------------------------------------------

    def send(self, message):
        """Write one message; returns the perf_counter just before the write."""
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8")
        started = time.perf_counter()
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (OSError, ValueError) as err:
            raise McpFailure("%s: cannot write to the server (%s)%s"
                             % (self.label, err, self._died_note()))
        return started

    def start(self, method, params=None):
        """Send a request without waiting: (id, send time)."""
        request_id = next(self._ids)
        message = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        return request_id, self.send(message)

    def wait(self, request_id, timeout=30.0):
        """(response, arrival time) for ``request_id``; McpFailure on error or timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while request_id not in self._responses:
                remaining = deadline - time.monotonic()
                if self.eof:
                    raise McpFailure("%s exited before answering%s"
                                     % (self.label, self._died_note()))
                if remaining <= 0:
                    raise McpFailure("%s did not answer request %s within %.0f s"
                                     % (self.label, request_id, timeout))
                self._cond.wait(remaining)
            message, arrived = self._responses.pop(request_id)
        if "error" in message:
            raise McpFailure("%s: JSON-RPC error %s" % (self.label, json.dumps(message["error"])))
        return message["result"], arrived

    def request(self, method, params=None, timeout=30.0):
        """Send and wait: (result, seconds from write to arrival)."""
        request_id, sent = self.start(method, params)
        result, arrived = self.wait(request_id, timeout)
        return result, arrived - sent

    def notify(self, method, params=None):
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)

    # -- MCP ------------------------------------------------------------------------------

    def initialize(self, timeout=60.0):
        result, _ = self.request("initialize", {
            "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
            "clientInfo": {"name": "ferrus-bench", "version": "1"}}, timeout)
        self.notify("notifications/initialized")
        return result

    def start_tool(self, name, arguments=None):
        return self.start("tools/call", {"name": name, "arguments": arguments or {}})

    def tool_result(self, request_id, timeout=30.0):
        """The result of a tools/call started with :meth:`start_tool`, checked."""
        result, arrived = self.wait(request_id, timeout)
        if result.get("isError"):
            text = " ".join(c.get("text", "") for c in result.get("content", [])
                            if isinstance(c, dict))
            raise McpFailure("%s: tool error: %s" % (self.label, text[:300]))
        return result, arrived

    def call_tool(self, name, arguments=None, timeout=30.0):
        """(result, seconds from write to arrival) of one tools/call."""
        request_id, sent = self.start_tool(name, arguments)
        result, arrived = self.tool_result(request_id, timeout)
        return result, arrived - sent

    # -- ending -----------------------------------------------------------------------------

    def _died_note(self):
        code = self.proc.poll()
        if code is None:
            return ""
        tail = self.stderr_tail()
        return " (exit status %s%s)" % (code, "; stderr: " + tail if tail else "")

    def close(self, timeout=3.0):
        """EOF on stdin, then TERM/KILL if the server does not leave by itself."""
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            ProcessRegistry.stop(self.proc, grace=1.0)
        try:
            self.proc.stdout.close()
        except (OSError, ValueError):
            pass
        self._reader.join(2)
        self.registry.forget(self.proc)
        try:
            self._stderr.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def structured(result):
    """The structured content of a tool result, or the JSON in its first text block."""
    data = result.get("structuredContent")
    if isinstance(data, dict):
        return data
    for block in result.get("content", []):
        if isinstance(block, dict) and block.get("type") == "text":
            try:
                value = json.loads(block["text"])
            except ValueError:
                return {"text": block["text"]}
            return value if isinstance(value, dict) else {"value": value}
    return {}


def load_ferrus(path):
    """Import the ferrus.py at ``path`` as the module ``ferrus``."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ferrus", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ferrus"] = module
    spec.loader.exec_module(module)
    return module
