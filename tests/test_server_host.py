"""The server host: while ferrus runs agents, their `ferrus serve` hands the session to one
process that has ferrus loaded, which serves it in a forked copy (server_host.py).

Played with real processes: a host started as ferrus starts it, and `ferrus serve` started
as an agent CLI starts it (the command of its MCP entry, with the environment ferrus gave
the CLI).  Which process served shows in what the server process imported: one the host
served never loads argparse (PYTHONPROFILEIMPORTTIME lists every import on stderr)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import ferrus

pytestmark = pytest.mark.skipif(not ferrus.server_host_possible(),
                                reason="the server host needs Linux (fork and fd passing)")

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
STATUS = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
          "params": {"name": "status", "arguments": {}}}


@pytest.fixture
def host():
    started = ferrus.ServerHost()
    env = started.environment()
    assert set(env) == {ferrus.SERVER_HOST_ENV}
    wait_until(lambda: os.path.exists(env[ferrus.SERVER_HOST_ENV]))
    process = started.process
    yield started
    started.stop()
    process.wait(timeout=60)


def wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "waited %s s" % timeout
        time.sleep(0.01)


def serve(project, env, messages, boot=None, **kwargs):
    """`ferrus serve` as an agent CLI starts it; (replies, stderr, exit status)."""
    argv = (boot or ferrus.ferrus_boot_argv()) + ["-C", str(project), "serve", "--role",
                                                  "executor"]
    done = subprocess.run(argv, input="".join(json.dumps(m) + "\n" for m in messages),
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPROFILEIMPORTTIME="1", **env), **kwargs)
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    return replies, done.stderr, done.returncode


def loaded_argparse(stderr):
    return any(line.rstrip().endswith("| argparse") for line in stderr.splitlines())


def test_a_session_is_served_by_the_host_and_answers_as_any_server(project, host):
    replies, stderr, status = serve(project, host.environment(), [INIT, STATUS])
    assert [reply["id"] for reply in replies] == [1, 2], stderr
    assert replies[0]["result"]["serverInfo"]["name"] == "ferrus"
    assert "Idle" in json.dumps(replies[1]["result"])
    assert status == 0
    assert not loaded_argparse(stderr), "the server process loaded ferrus itself"
    # Without a host (the variable unset), the same command loads ferrus and serves.
    replies, stderr, status = serve(project, {}, [INIT, STATUS])
    assert [reply["id"] for reply in replies] == [1, 2] and status == 0
    assert loaded_argparse(stderr)


def test_the_session_runs_where_and_as_the_agent_started_it(project, host, tmp_path):
    """Its folder, environment and umask are the `ferrus serve`'s, not the host's: a
    server found its project from the folder the CLI started it in."""
    env = dict(host.environment(), FERRUS_SESSION="s-host-test")
    replies, stderr, status = serve(project, env, [INIT, STATUS], cwd=str(project))
    assert status == 0 and len(replies) == 2, stderr
    # A failing start reports as it would without the host, with its exit status.
    replies, stderr, status = serve(tmp_path / "nowhere", host.environment(), [INIT])
    assert replies == [] and status == 2
    assert "no such directory" in stderr


def test_another_ferrus_py_is_not_served_by_this_host(project, host, tmp_path):
    copy = tmp_path / "elsewhere" / "ferrus.py"
    copy.parent.mkdir()
    shutil.copy(ferrus.FERRUS_FILE, str(copy))
    boot = ferrus.ferrus_boot_argv()
    boot[-1] = boot[-1].replace(repr(ferrus.FERRUS_FILE), repr(str(copy)))
    replies, stderr, status = serve(project, host.environment(), [INIT, STATUS], boot=boot)
    assert [reply["id"] for reply in replies] == [1, 2] and status == 0, stderr
    assert loaded_argparse(stderr), "a host must serve only its own ferrus.py"


def host_children(host):
    path = "/proc/%d/task/%d/children" % (host.process.pid, host.process.pid)
    with open(path) as handle:
        return handle.read().split()


def test_a_session_whose_server_is_killed_ends_in_the_host(project, host):
    """An agent ends its server with SIGTERM (or dies): the copy serving it ends too."""
    argv = ferrus.ferrus_boot_argv() + ["-C", str(project), "serve", "--role", "executor"]
    relay = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL,
                             env=dict(os.environ, **host.environment()))
    relay.stdin.write((json.dumps(INIT) + "\n").encode())
    relay.stdin.flush()
    assert json.loads(relay.stdout.readline())["id"] == 1
    assert len(host_children(host)) == 1
    relay.send_signal(signal.SIGTERM)
    relay.wait(timeout=60)
    wait_until(lambda: host_children(host) == [])


def test_a_stopped_host_serves_its_sessions_to_their_end_then_exits(project):
    host = ferrus.ServerHost()
    env = host.environment()
    wait_until(lambda: os.path.exists(env[ferrus.SERVER_HOST_ENV]))
    process = host.process
    argv = ferrus.ferrus_boot_argv() + ["-C", str(project), "serve", "--role", "executor"]
    relay = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=dict(os.environ, **env))
    relay.stdin.write((json.dumps(INIT) + "\n").encode())
    relay.stdin.flush()
    assert json.loads(relay.stdout.readline())["id"] == 1
    host.stop()
    assert host.environment() == {ferrus.SERVER_HOST_ENV: ""}     # no new session there
    wait_until(lambda: not os.path.exists(env[ferrus.SERVER_HOST_ENV]))
    assert process.poll() is None            # the session it serves goes on
    relay.stdin.write((json.dumps(STATUS) + "\n").encode())
    relay.stdin.close()
    assert json.loads(relay.stdout.readline())["id"] == 2
    assert relay.wait(timeout=60) == 0
    assert process.wait(timeout=60) == 0


def test_no_host_where_it_is_switched_off(monkeypatch, project, host):
    """Switched off, no host starts, agents are told of none (not even one this process
    inherited), and a `ferrus serve` that still has a host's socket serves itself."""
    inherited = host.environment()
    monkeypatch.setenv(ferrus.SERVER_HOST_OFF_ENV, "1")
    off = ferrus.ServerHost()
    assert off.environment() == {ferrus.SERVER_HOST_ENV: ""} and off.process is None
    replies, stderr, status = serve(project, dict(inherited, FERRUS_NO_SERVER_HOST="1"),
                                    [INIT, STATUS])
    assert [reply["id"] for reply in replies] == [1, 2] and status == 0
    assert loaded_argparse(stderr)


def test_a_session_from_inside_a_sandbox_is_not_served_outside_it(project, host):
    """A process in another mount namespace (a sandbox) that reaches the socket anyway
    is turned away: it serves itself, where it is."""
    if not shutil.which("bwrap") or subprocess.run(
            ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--", "true"],
            capture_output=True).returncode != 0:
        pytest.skip("needs a working bubblewrap")
    inside = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
              "--bind", str(project), str(project), "--unshare-pid", "--"]
    replies, stderr, status = serve(project, host.environment(), [INIT, STATUS],
                                    boot=inside + ferrus.ferrus_boot_argv())
    assert [reply["id"] for reply in replies] == [1, 2] and status == 0, stderr
    assert loaded_argparse(stderr), "the host served a sandboxed process outside it"


def test_a_host_declines_its_ferrus_py_once_it_is_edited(project, tmp_path):
    """A host serves the ferrus.py it loaded: once the file changes (edited, rebuilt),
    each new session serves itself with the file as it is now."""
    copy = tmp_path / "ferrus.py"
    shutil.copy(ferrus.FERRUS_FILE, str(copy))
    socket_path = str(tmp_path / "host.sock")
    started = subprocess.Popen([sys.executable, "-S", str(copy), "serve-host", socket_path],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: os.path.exists(socket_path))
        boot = [sys.executable, "-S", str(copy)]
        env = {ferrus.SERVER_HOST_ENV: socket_path}
        replies, stderr, status = serve(project, env, [INIT], boot=boot)
        assert len(replies) == 1 and not loaded_argparse(stderr), stderr
        with open(str(copy), "a") as handle:
            handle.write("\n# edited\n")
        replies, stderr, status = serve(project, env, [INIT], boot=boot)
        assert len(replies) == 1 and loaded_argparse(stderr), "served by the old code"
    finally:
        started.stdin.close()
        started.wait(timeout=60)


def test_the_folder_of_a_killed_host_is_removed_by_the_next(tmp_path):
    """...but not the folder of a host still starting (its socket not there yet): with
    two ferrus processes starting hosts at once, one removed the other's."""
    import socket
    where = tempfile.mkdtemp(prefix="h-", dir="/tmp")     # short: a socket path is
    try:                                                 # at most about 100 bytes
        folder = tempfile.mkdtemp(prefix=ferrus.SERVER_HOST_PREFIX, dir=where)
        starting = tempfile.mkdtemp(prefix=ferrus.SERVER_HOST_PREFIX, dir=where)
        live = tempfile.mkdtemp(prefix=ferrus.SERVER_HOST_PREFIX, dir=where)
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(os.path.join(folder, "host.sock"))
        dead.close()                           # its socket file stays; nobody listens
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listening.bind(os.path.join(live, "host.sock"))
        listening.listen(1)
        ferrus._remove_dead_hosts(where)
        assert not os.path.exists(folder)
        assert os.path.isdir(starting) and os.path.isdir(live)
        ferrus._remove_dead_hosts(where, clock=lambda: time.time() + 3600)  # never came up
        assert not os.path.exists(starting) and os.path.isdir(live)
        listening.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_a_sandboxed_agent_never_gets_the_hosts_socket(tmp_path):
    """The host serves outside any sandbox: the variable is unset inside one."""
    plan = ferrus.SandboxPlan(cwd=str(tmp_path), writable=[str(tmp_path)], readable=[],
                              hidden=[], empty_file=str(tmp_path / "empty"), network=True)
    argv = ferrus.bwrap_argv(plan, ["agent"])
    assert argv[argv.index(ferrus.SERVER_HOST_ENV) - 1] == "--unsetenv"


def test_a_link_in_tmp_named_like_a_hosts_folder_is_never_followed(tmp_path):
    """Another user could put /tmp/ferrus-host-x -> one of your folders: the clean-up of
    dead hosts' folders must not empty it."""
    where = tempfile.mkdtemp(prefix="h-", dir="/tmp")
    try:
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "precious.txt").write_text("keep\n")
        os.symlink(str(victim), os.path.join(where, ferrus.SERVER_HOST_PREFIX + "zz"))
        ferrus._remove_dead_hosts(where, clock=lambda: time.time() + 3600)
        assert (victim / "precious.txt").read_text() == "keep\n"
    finally:
        shutil.rmtree(where, ignore_errors=True)


def listener_that_records(folder):
    """A stand-in host listening at folder/host.sock that records whether anyone
    connected and what came: (socket path, thread, record)."""
    import socket
    import threading
    path = os.path.join(folder, "host.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    server.settimeout(0.1)
    record, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            connection.settimeout(5)
            with contextlib.suppress(OSError):
                record.append(connection.recv(64))
            connection.close()
        server.close()
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return path, stop, thread, record


def test_a_socket_in_a_folder_others_may_enter_gets_no_session(project):
    """The socket's folder must be a private one of this user's: another user who made
    a folder of that name (after a host's went) would otherwise get the session."""
    folder = tempfile.mkdtemp(prefix="h-", dir="/tmp")
    try:
        os.chmod(folder, 0o755)
        path, stop, thread, record = listener_that_records(folder)
        replies, stderr, status = serve(project, {ferrus.SERVER_HOST_ENV: path}, [INIT])
        assert len(replies) == 1 and status == 0 and loaded_argparse(stderr)
        stop.set()
        thread.join(30)
        assert record == [], "a session went to a socket in a folder others may enter"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_listener_put_there_from_inside_a_sandbox_gets_no_session(project):
    """A sandboxed agent that can write where the host's socket is could put its own
    listener in its place: a `ferrus serve` outside hands nothing to a process in
    another mount namespace."""
    if not shutil.which("bwrap") or subprocess.run(
            ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--", "true"],
            capture_output=True).returncode != 0:
        pytest.skip("needs a working bubblewrap")
    folder = tempfile.mkdtemp(prefix="h-", dir="/tmp")
    path = os.path.join(folder, "host.sock")
    got = os.path.join(folder, "got")
    code = ("import socket; s = socket.socket(socket.AF_UNIX); s.bind(%r); s.listen(1); "
            "open(%r + '.ready', 'w').close(); c, _ = s.accept(); c.settimeout(5)\n"
            "try: data = c.recv(64)\nexcept OSError: data = b''\n"
            "open(%r, 'wb').write(data)" % (path, got, got))
    inside = subprocess.Popen(["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc",
                               "/proc", "--bind", folder, folder, "--unshare-pid", "--",
                               sys.executable, "-S", "-c", code])
    try:
        wait_until(lambda: os.path.exists(got + ".ready"))
        replies, stderr, status = serve(project, {ferrus.SERVER_HOST_ENV: path}, [INIT])
        assert len(replies) == 1 and status == 0 and loaded_argparse(stderr)
        inside.wait(timeout=30)
        assert open(got, "rb").read() == b"", "the sandboxed listener got a session"
    finally:
        inside.kill()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_sandbox_hides_the_hosts_folder_even_where_tmp_is_writable(tmp_path, host):
    folder = os.path.dirname(host.environment()[ferrus.SERVER_HOST_ENV])
    work = tmp_path / "work"
    work.mkdir()
    plan = ferrus.plan_sandbox(ferrus.SandboxConfig(enabled=True, writable=["/tmp"]),
                               str(work), str(tmp_path / "state"))
    assert "/tmp" in plan.writable and folder in plan.hidden
    argv = ferrus.bwrap_argv(plan, ["agent"])
    assert argv.index(folder) > argv.index("/tmp")      # mounted over the writable /tmp


def test_the_sandbox_bridge_s_servers_use_this_ferrus_s_host_only(monkeypatch, tmp_path,
                                                                 host):
    monkeypatch.setenv(ferrus.SERVER_HOST_ENV, "/tmp/another-ferrus/host.sock")
    monkeypatch.setattr(ferrus, "SERVER_HOST", host)
    bridge = ferrus.SandboxMcpBridge(str(tmp_path), "executor", "scripted",
                                     folder=str(tmp_path))
    assert bridge.env[ferrus.SERVER_HOST_ENV] == host.environment()[ferrus.SERVER_HOST_ENV]
