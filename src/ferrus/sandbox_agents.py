"""Sandbox, the agents' side: their launches confined, ferrus's MCP server reached.

An agent reaches ferrus through its MCP server, which must write ``.ferrus/`` — hidden from
the agent.  So the server runs outside: each role of a sandboxed task gets a
SandboxMcpBridge, a Unix socket in a folder the sandbox may only read, and the ``ferrus
serve`` the agent starts inside finds ``FERRUS_MCP_RELAY`` in its environment and only
relays its stdio to that socket (relay_mcp_stdio), after one line naming its agent session.
For each connection the bridge starts the real ``ferrus serve`` outside with the project and
role the orchestrator chose; of the session it takes only one of its own task, so an agent
can never reach another task or another role's tools.  sandbox_agent_report tells, per
role, whether the agent CLI starts inside (`ferrus agents`).
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from .basics import FerrusError, log
from .system import kill_process_tree, process_group_kwargs
from .config import PLACE_HERE, load_config
from .sandbox import (SANDBOX_RELAY_ENV, SandboxUnavailable, TaskSandbox, plan_sandbox,
                      sandbox_argv, sandbox_tool)
from .operations import ROLES
from .mcp import SESSION_ENV, _SESSION_RE, session_task
from .agents import DEFAULT_AGENT_INDEX, Launch, ferrus_boot_argv
from .server_host import server_host_environment
from .register import adapter_for


# -- the door to ferrus's MCP server ---------------------------------------------------------

# At most this many servers at once behind one bridge (an agent opens one or two).
SANDBOX_BRIDGE_SERVERS = 8
# The relay's first line names its agent session; longer than this is no session.
_RELAY_HELLO_BYTES = 256
_RELAY_CHUNK = 65536


class SandboxMcpBridge:
    """A Unix socket that starts ferrus's MCP server outside the sandbox for each
    connection, with the connection as its stdin and stdout.  The server's role and
    project are the bridge's; of the agent session the relay names in its first line,
    only one of the bridge's own task is taken (an agent may name a session, never
    reach another task or role).  The socket's folder is the sandbox's to read only."""

    def __init__(self, root, role, agent_name, task=None, agent_index=DEFAULT_AGENT_INDEX,
                 folder=None, log_path=None, env=None):
        self.root = os.path.abspath(root)
        self.role = role
        self.agent_name = agent_name
        self.task = task
        self.agent_index = agent_index
        base = dict(os.environ if env is None else env)
        base.pop(SANDBOX_RELAY_ENV, None)        # the server outside serves; it never relays
        # Served by this ferrus's server host, never by one named in what it inherited.
        base.update(server_host_environment())
        self.env = base
        # Unix socket paths are short (about 100 bytes): a folder of its own in the temp dir.
        self.folder = folder or tempfile.mkdtemp(prefix="ferrus-mcp-")
        self.path = os.path.join(self.folder, "mcp.sock")
        self.log_path = log_path
        self.servers = []
        self._closed = threading.Event()
        self._listener = None
        self._thread = None

    def start(self):
        import socket
        os.chmod(self.folder, 0o700)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(SANDBOX_BRIDGE_SERVERS)
        # accept() is not woken by close() from another thread on every system.
        listener.settimeout(0.2)
        self._listener = listener
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="ferrus-mcp-bridge")
        self._thread.start()
        return self

    def _serve(self):
        import socket
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with connection:
                connection.settimeout(5.0)     # a relay says hello at once, or not at all
                session = self._session(_read_hello(connection))
                connection.settimeout(None)
                self.servers = [p for p in self.servers if p.poll() is None]
                if session is None or len(self.servers) >= SANDBOX_BRIDGE_SERVERS:
                    log.warning("MCP bridge %s refused a connection (%s)", self.path,
                                "no session of task %s" % self.task if session is None
                                else "%d servers already run" % len(self.servers))
                    continue
                self.servers.append(self._start_server(connection, session))

    def _session(self, hello):
        session = hello.get("session") if isinstance(hello, dict) else None
        if not isinstance(session, str) or not _SESSION_RE.match(session):
            return None
        if self.task is not None and session_task(session) != self.task:
            return None
        return session

    def server_argv(self, session):
        """The argv of the ferrus MCP server this bridge starts for ``session``."""
        return ferrus_boot_argv() + ["-C", self.root, "serve", "--role", self.role,
                                     "--agent-name", self.agent_name, "--agent-index",
                                     str(self.agent_index), "--session", session]

    def _start_server(self, connection, session):
        errors = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            return subprocess.Popen(self.server_argv(session), stdin=connection.fileno(),
                                    stdout=connection.fileno(), stderr=errors, cwd=self.root,
                                    env=dict(self.env, **{SESSION_ENV: session}),
                                    **process_group_kwargs())
        finally:
            if self.log_path:
                errors.close()

    def close(self, grace=2.0):
        """Stop listening and end the servers still running (their agent is gone)."""
        self._closed.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        if self._thread is not None:
            self._thread.join(1.0)
        for server in self.servers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(grace)
            if server.poll() is None:
                kill_process_tree(server)
                server.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)


def _read_hello(connection):
    """The relay's first line as JSON (one byte at a time, so nothing after it is taken
    from the server's stdin); {} when there is none."""
    line = bytearray()
    with contextlib.suppress(OSError):
        while len(line) < _RELAY_HELLO_BYTES:
            byte = connection.recv(1)
            if not byte or byte == b"\n":
                break
            line += byte
    try:
        return json.loads(line.decode("utf-8"))
    except ValueError:
        return {}


def relay_mcp_stdio(path, session=None, stdin_fd=None, stdout_fd=None):
    """The ``ferrus serve`` an agent starts inside a sandbox: it names its agent session
    (``$FERRUS_SESSION``), then relays its stdio byte for byte to the bridge at ``path``.
    Returns the exit code."""
    import socket
    stdin_fd = sys.stdin.fileno() if stdin_fd is None else stdin_fd
    stdout_fd = sys.stdout.fileno() if stdout_fd is None else stdout_fd
    session = os.environ.get(SESSION_ENV, "") if session is None else session
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
        connection.sendall((json.dumps({"session": session}) + "\n").encode("utf-8"))
    except OSError as err:
        sys.stderr.write("ferrus: cannot reach ferrus's MCP server through %s: %s\n"
                         "hint: the agent runs in a sandbox whose orchestrator has ended; "
                         "start the task again with `ferrus run`\n" % (path, err.strerror or err))
        return 1

    def forward():
        try:
            while True:
                data = os.read(stdin_fd, _RELAY_CHUNK)
                if not data:
                    break
                connection.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            connection.shutdown(socket.SHUT_WR)     # the server sees its stdin end
    threading.Thread(target=forward, daemon=True).start()
    try:
        while True:
            data = connection.recv(_RELAY_CHUNK)
            if not data:
                break
            view = memoryview(data)
            while view:
                view = view[os.write(stdout_fd, view):]
    except OSError:
        return 1
    finally:
        connection.close()
    return 0


# -- one task's sandbox, agents included ---------------------------------------------------

class AgentSandbox(TaskSandbox):
    """A task's confinement with its agents: besides its checks, each agent's launch is
    confined, and its ``ferrus serve`` reaches the real server outside through one MCP
    bridge per role (made at the role's first launch, kept until close)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bridges = {}

    def plan(self, argv=(), readable=(), relay=None):
        plan = super().plan(argv, readable)
        if relay is not None:
            plan.readable.append((relay.folder, relay.folder))
            plan.env[SANDBOX_RELAY_ENV] = relay.path
        return plan

    def wrap_launch(self, launch, role, agent_name, log_path=None):
        """The agent's Launch confined to the task; its ``ferrus serve`` reaches the role's
        bridge."""
        tool = self.require()
        bridge = self.bridges.get(role)
        if bridge is None:
            bridge = SandboxMcpBridge(self.root, role, agent_name, self.task,
                                      log_path=log_path).start()
            self.bridges[role] = bridge
        plan = self.plan(launch.argv, relay=bridge)
        return Launch(argv=sandbox_argv(plan, launch.argv, tool), stdin=launch.stdin,
                      env=dict(launch.env))

    def launcher(self, inner, agent_of_role):
        """A launcher for an HqController of this task: ``inner(slot)``'s launch, confined
        (``agent_of_role(role)`` names the agent for its MCP server's id)."""
        def launch(slot):
            plain, parse_line = inner(slot)
            return self.wrap_launch(plain, slot.role, agent_of_role(slot.role)), parse_line
        return launch

    def launcher_for(self, controller):
        """The launcher of ``controller`` (an HqController of this task), confined."""
        def agent_of_role(role):
            choice = controller.agent_choice(role)
            return choice.agent if choice else "agent"
        return self.launcher(controller.launcher, agent_of_role)

    def close(self):
        """End the bridges (the task's agents have stopped)."""
        for bridge in self.bridges.values():
            bridge.close()
        self.bridges = {}


class ControllerSandbox:
    """The confinement of one HqController's agents (of a parallel task here, or of the
    project's own task), decided at each launch by this machine's [sandbox] as ferrus.toml
    says it then: on, the launch is confined (one AgentSandbox, its bridges kept); off,
    it goes as it is.  A ferrus.toml that does not load fails the launch, saying why, as
    it always did — never an agent started unconfined because the file could not be read."""

    def __init__(self, controller):
        self.controller = controller
        self.inner = controller.launcher
        self.confinement = None

    def sandbox(self):
        """The AgentSandbox to launch in, or None ([sandbox] off).  Raises FerrusError
        (ferrus.toml does not load) and SandboxUnavailable."""
        store = self.controller.store
        config = store.config()
        wanted = config.places[PLACE_HERE].sandbox
        if not wanted.enabled:
            return None
        if self.confinement is None or self.confinement.config != wanted:
            agents = [choice.agent for choice in (config.supervisor, config.executor)
                      if choice]
            executor = getattr(self.controller, "executor_agent", None)
            if executor and executor not in agents:
                agents.append(executor)
            if self.confinement is not None:
                self.confinement.close()
            self.confinement = AgentSandbox.for_task(store, wanted, agents)
        return self.confinement

    def launch(self, slot):
        confinement = self.sandbox()
        if confinement is None:
            return self.inner(slot)

        def agent_of_role(role):
            choice = self.controller.agent_choice(role)
            return choice.agent if choice else "agent"
        return confinement.launcher(self.inner, agent_of_role)(slot)

    def close(self):
        """End the bridges (its agents have stopped)."""
        if self.confinement is not None:
            self.confinement.close()

    def remove(self):
        """The task's temp folder and private objects (the task has ended)."""
        if self.confinement is not None:
            self.confinement.remove()


def confine_controller(controller, require=True):
    """Confine the agents of ``controller`` (an HqController) by this machine's [sandbox]
    (see ControllerSandbox); returns the ControllerSandbox (close() it when the controller
    stops, remove() it when its task has ended).  ``require``: when the sandbox is on,
    raise SandboxUnavailable now (saying how to install bubblewrap) rather than at the
    first launch — a task never starts unconfined.  A ferrus.toml that does not load is
    left to the caller's own checks (and fails each launch)."""
    confined = ControllerSandbox(controller)
    if require:
        try:
            confinement = confined.sandbox()
        except SandboxUnavailable:
            raise
        except FerrusError:
            confinement = None
        if confinement is not None:
            confinement.require()
    controller.launcher = confined.launch
    return confined


# -- does each agent CLI start inside? --------------------------------------------------------

def sandbox_agent_report(root, config=None, run=subprocess.run, tool=None, home=None):
    """Per role with an agent: whether its CLI starts inside the sandbox (its version
    command, in a scratch worktree with the same rules), as `ferrus agents` shows it.
    Rows: {"role", "agent", "works": bool, "note"}; one row with "problem" when there is
    no sandbox here at all."""
    config = config or load_config(root)
    sandbox = config.places[PLACE_HERE].sandbox
    try:
        tool = tool or sandbox_tool()
    except SandboxUnavailable as err:
        return [{"role": None, "agent": None, "works": False, "problem": err.message,
                 "hint": err.hint}]
    rows = []
    for role in ROLES:
        choice = getattr(config, role, None)
        if choice is None:
            continue
        adapter = adapter_for(config, choice.agent)
        if not adapter.executable():
            rows.append({"role": role, "agent": choice.agent, "works": False,
                         "note": "%s is not installed" % adapter.binary})
            continue
        rows.append(dict({"role": role, "agent": choice.agent},
                         **_try_inside(adapter, sandbox, tool, run, home)))
    return rows


def _try_inside(adapter, sandbox, tool, run, home):
    scratch = tempfile.mkdtemp(prefix="ferrus-sandbox-check-")
    try:
        work = os.path.join(scratch, "work")
        os.makedirs(work)
        plan = plan_sandbox(sandbox, work, os.path.join(scratch, "state"),
                            agents=(adapter.name,), home=home,
                            argv=adapter.version_argv())
        argv = adapter.version_argv()
        argv[0] = adapter.executable() or argv[0]
        try:
            done = run(sandbox_argv(plan, argv, tool), cwd=work, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        except (OSError, subprocess.SubprocessError) as err:
            return {"works": False, "note": "could not start inside: %s" % err}
        said = done.stdout.decode("utf-8", "replace").strip().splitlines()
        if done.returncode == 0:
            return {"works": True, "note": "starts inside the sandbox (%s)%s" % (
                tool[0], ": " + said[-1][:80] if said else "")}
        return {"works": False, "note": "fails inside the sandbox (exit %d)%s" % (
            done.returncode, ": " + said[-1][:160] if said else "")}
    except (FerrusError, OSError) as err:
        return {"works": False, "note": "could not be tried inside: %s" % (
            getattr(err, "message", None) or err)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
