"""Check processes are tracked and ended: on timeout, on cancel, after a normal exit,
and at the next start of ferrus after a SIGKILL (issue #11 item 7)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import ferrus
from conftest import (FERRUS_CMD, SCRIPTED_AGENT, custom_agent_config, run_cli, set_config,
                      wait_until)
from mcp_client import McpProcess

pytestmark = pytest.mark.skipif(not ferrus.HAS_PROC, reason="finding processes that left their "
                                "group needs Linux's /proc (see README)")

HUMAN = ferrus.Caller("human", "human:test:0")


def checks(*commands, timeout=600, parallel=False):
    return ferrus.ChecksConfig(commands=list(commands), timeout_secs=timeout, parallel=parallel)


def run(root, config, cancel=None):
    return ferrus.run_checks(str(root), config, os.path.join(str(root), ".ferrus", "logs"),
                             cancel=cancel)


def python_command(code):
    """A shell command running ``code`` with this interpreter."""
    return "%s -c %s" % (sys.executable, ferrus_quote(textwrap.dedent(code)))


def ferrus_quote(text):
    return "'" + text.replace("'", "'\"'\"'") + "'"


# A process that leaves the check's session and group, records its pid, and sleeps.
SETSID_SLEEPER = """
import os, sys, time
os.setsid()
with open(sys.argv[1] if len(sys.argv) > 1 else "escaped.pid", "w") as f:
    f.write(str(os.getpid()))
time.sleep(300)
"""

# The classic daemon: fork, setsid, fork again, the middle process exits, so the
# sleeper's parent is init and it shares neither group nor session with the check.
DOUBLE_FORK = """
import os, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
with open("daemon.pid.tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename("daemon.pid.tmp", "daemon.pid")
time.sleep(300)
"""


def wait_for_pid(root, name, timeout=15):
    path = os.path.join(str(root), name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with open(path) as handle:
                return int(handle.read())
        time.sleep(0.01)
    raise AssertionError("%s never appeared" % name)


def gone(pid):
    info = ferrus._proc_stat(pid)
    return info is None or info.zombie


def wait_gone(pid, timeout=5):
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return gone(pid)


@contextlib.contextmanager
def reaping(*names, root):
    """Kill what a failed test left (never a stranger: only pids the test's commands wrote)."""
    try:
        yield
    finally:
        for name in names:
            path = os.path.join(str(root), name)
            with contextlib.suppress(OSError, ValueError):
                with open(path) as handle:
                    pid = int(handle.read())
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)


def record_files(root):
    folder = os.path.join(str(root), ".ferrus", ferrus.CHECK_PROCESS_DIR)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_setsid_sleeper_is_killed_on_timeout(project):
    command = python_command(SETSID_SLEEPER) + " & sleep 300"
    with reaping("escaped.pid", root=project):
        (result,) = run(project, checks(command, timeout=1)).results
        assert result.status == "timed out"
        pid = wait_for_pid(project, "escaped.pid")
        assert wait_gone(pid), "the setsid'd process %d outlived the check's timeout" % pid
    assert record_files(project) == []


def test_double_forked_daemon_is_killed_on_timeout(project):
    command = python_command(DOUBLE_FORK) + "; sleep 300"
    with reaping("daemon.pid", root=project):
        (result,) = run(project, checks(command, timeout=1)).results
        assert result.status == "timed out"
        pid = wait_for_pid(project, "daemon.pid")
        assert wait_gone(pid), "the double-forked daemon %d outlived the check's timeout" % pid


def test_double_forked_daemon_ends_with_a_check_that_exits(project):
    command = python_command(DOUBLE_FORK) + \
        "; while [ ! -s daemon.pid ]; do sleep 0.01; done; echo started"
    with reaping("daemon.pid", root=project):
        (result,) = run(project, checks(command)).results
        assert result.passed and result.tail == ["started"]
        pid = wait_for_pid(project, "daemon.pid")
        assert wait_gone(pid), "a daemon a passing check started is still running"


def test_cancel_ends_a_process_that_left_the_group(project):
    cancel = threading.Event()
    box = {}
    command = python_command(SETSID_SLEEPER) + " & wait"
    with reaping("escaped.pid", root=project):
        thread = threading.Thread(target=lambda: box.setdefault(
            "run", run(project, checks(command), cancel=cancel)))
        thread.start()
        pid = wait_for_pid(project, "escaped.pid")
        assert record_files(project), "no pid file while the check runs"
        cancel.set()
        thread.join(15)
        assert not thread.is_alive()
        assert box["run"].cancelled
        assert wait_gone(pid), "the cancelled check's setsid'd process %d still runs" % pid
    assert record_files(project) == []


def test_pid_file_names_the_check_while_it_runs(project):
    cancel = threading.Event()
    command = "echo $$ > shell.pid; sleep 300"
    with reaping("shell.pid", root=project):
        thread = threading.Thread(target=run, args=(project, checks(command)),
                                  kwargs={"cancel": cancel})
        thread.start()
        shell = wait_for_pid(project, "shell.pid")
        # (The rewrite with the shell's pid may be under way: its temporary file is not
        # a second record.)
        (name,) = [name for name in record_files(project)
                   if not name.endswith(ferrus.TEMP_SUFFIX)]
        record = {}
        deadline = time.monotonic() + 15
        # The file is written before the shell starts and again with its pid just after.
        while "leader_pid" not in record and time.monotonic() < deadline:
            with open(os.path.join(str(project), ".ferrus", ferrus.CHECK_PROCESS_DIR, name)) as h:
                record = json.load(h)
            time.sleep(0.01)
        assert record["command"] == command
        assert record["owner_pid"] == os.getpid()
        assert record["owner_start"] == ferrus.process_start(os.getpid())
        assert record["leader_pid"] == shell
        assert record["leader_start"] == ferrus.process_start(shell)
        with open("/proc/%d/environ" % shell, "rb") as handle:
            assert ("FERRUS_CHECK_ID=%s" % record["marker"]).encode() in handle.read().split(b"\0")
        # A live owner's check is never touched by another ferrus's start-up cleanup.
        assert ferrus.end_orphaned_checks(str(project / ".ferrus")) == []
        assert not gone(shell)
        cancel.set()
        thread.join(15)
    assert record_files(project) == []


def test_a_forking_storm_cannot_outrun_the_sweep(project):
    # Every process forks a child and exits at once: a chain that never stands still.
    # It ends itself after a minute, so a sweep that misses it cannot leave a storm
    # eating the machine (and every later test) for good.
    storm = python_command("""
        import os, time
        with open("storm.pid", "w") as f:
            f.write(str(os.getpid()))
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            if os.fork():
                os._exit(0)
            os.setsid()
            time.sleep(0.001)
    """)
    (result,) = run(project, checks(storm + " & sleep 300", timeout=1)).results
    assert result.status == "timed out"
    survivors = check_processes_in(project)
    for pid in survivors:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not survivors, "processes of the check survived: %s" % survivors


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_run_ends_the_check_its_agent_was_running(project, tmp_path, signum):
    """`ferrus run` stopped while the executor's check runs: the agent and its MCP
    server are stopped, and so is the check command (in a process group of its own),
    instead of running on for minutes with nobody to read its result."""
    set_config(project, '[checks]\ncommands = ["echo $$ > check.pid; exec sleep 120"]\n'
               '[limits]\nwait_timeout_secs = 5\n' +
               custom_agent_config("scripted", [sys.executable, SCRIPTED_AGENT, "{role}",
                                                "{mcp_config}"]))
    ferrus.register_agents(str(project), {"supervisor": ("scripted", None),
                                          "executor": ("scripted", None)},
                           report=lambda message: None)
    env = dict(os.environ, FERRUS_LOG="warning", SCRIPTED_DIR=str(tmp_path))
    proc = subprocess.Popen(FERRUS_CMD + ["-C", str(project), "run", "--task", "work"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    pid_file = project / "check.pid"
    with reaping("check.pid", root=project):
        try:
            wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(),
                       "the check to start", proc=proc)
            check_pid = int(pid_file.read_text())
            proc.send_signal(signum)
            proc.communicate(timeout=60)
            wait_until(lambda: gone(check_pid), "the check to end", timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert not os.listdir(project / ".ferrus" / ferrus.CHECK_PROCESS_DIR), \
        "the check's pid file was left behind"


def check_processes_in(root):
    """Live processes started by a check (they carry the marker) working in ``root``."""
    found = []
    for pid, info in ferrus.process_table().items():
        try:
            with open("/proc/%d/environ" % pid, "rb") as handle:
                env = handle.read().split(b"\0")
            cwd = os.readlink("/proc/%d/cwd" % pid)
        except OSError:
            continue
        if not info.zombie and cwd == os.path.realpath(str(root)) and any(
                entry.startswith(b"FERRUS_CHECK_ID=") for entry in env):
            found.append(pid)
    return found


# ----------------------------------------------------------------------------
# SIGKILL of the ferrus that ran the check, then the next start
# ----------------------------------------------------------------------------

def _kill_serve_mid_check(project):
    """Start a check through `ferrus serve`, SIGKILL the server, return the escaped pids."""
    escaped = python_command(SETSID_SLEEPER)
    set_config(project, '[checks]\ncommands = [%s]\n\n[limits]\nwait_timeout_secs = 0\n'
                        % json.dumps("echo $$ > shell.pid; %s & %s & sleep 300"
                                     % (python_command(DOUBLE_FORK), escaped)))
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, HUMAN, "check me")
    server = McpProcess(project, "--role", "executor")
    try:
        with server:
            server.initialize()
            server.start_tool("check")
            pids = [wait_for_pid(project, name) for name in ("shell.pid", "escaped.pid",
                                                              "daemon.pid")]
            os.kill(server.pid, signal.SIGKILL)
            server.proc.wait(15)
    finally:
        for stream in (server.proc.stdin, server.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
    # SIGKILL cannot be caught: everything still runs, and the pid file says so.
    assert [pid for pid in pids if gone(pid)] == []
    assert len(record_files(project)) == 1
    return pids


@pytest.mark.parametrize("next_start", ["serve", "check", "doctor --fix"])
def test_the_next_start_after_a_sigkill_ends_the_checks_processes(project, next_start):
    with reaping("shell.pid", "escaped.pid", "daemon.pid", root=project):
        pids = _kill_serve_mid_check(project)
        if next_start == "serve":
            with McpProcess(project, "--role", "executor") as server:
                server.initialize()
                assert server.close() == 0
                stderr = server.stderr_text()
            assert "left by a ferrus that died" in stderr
        elif next_start == "check":
            set_config(project, "[checks]\ncommands = [\"true\"]\n")
            result = run_cli("check", "--force", cwd=project)
            assert result.returncode == 0, result.stdout + result.stderr
            assert "left by a ferrus that died" in result.stderr
        else:
            report = run_cli("doctor", cwd=project)
            assert "check-processes" in report.stdout and "processes of it may still run" \
                in report.stdout, report.stdout
            assert [pid for pid in pids if gone(pid)] == [], "plain doctor must not kill"
            result = run_cli("doctor", "--fix", cwd=project)
            assert "fixed: end the processes" in result.stdout, result.stdout
        alive = [pid for pid in pids if not wait_gone(pid)]
        assert alive == [], "processes of the killed server's check still run: %s" % alive
    assert record_files(project) == []


def test_a_stale_pid_file_never_signals_a_stranger(project):
    """A recorded pid that now belongs to another process (pid reuse) is left alone:
    its start time differs and it does not carry the check's marker."""
    folder = os.path.join(str(project), ".ferrus", ferrus.CHECK_PROCESS_DIR)
    os.makedirs(folder)
    import subprocess
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        record = {"check_id": "check_1_x.1", "marker": "check_1_x.1-deadbeef", "command": "x",
                  "owner_pid": 999999999, "owner_start": "1", "leader_pid": stranger.pid,
                  "leader_start": "1", "started_at": "2026-01-01T00:00:00Z"}
        with open(os.path.join(folder, "check_1_x.1.json"), "w") as handle:
            json.dump(record, handle)
        with open(os.path.join(folder, "junk.json"), "w") as handle:
            handle.write("{not json")
        messages = ferrus.end_orphaned_checks(str(project / ".ferrus"))
        assert len(messages) == 2 and "no process was left" in " ".join(messages)
        assert stranger.poll() is None, "a stranger with a reused pid was signalled"
        assert record_files(project) == []
    finally:
        stranger.kill()
        stranger.wait()


def test_pid_window_follows_allocation_round_the_cycle(monkeypatch):
    counter = {"value": 32000}
    monkeypatch.setattr(ferrus, "_read_int", lambda path: 32768 if path.endswith("pid_max")
                        else counter["value"])
    window = ferrus.PidWindow()
    assert window.valid and not window.contains(32000) and not window.contains(32001)
    counter["value"] = 32100
    window.update()
    assert window.contains(32001) and window.contains(32100) and not window.contains(32101)
    counter["value"] = 400                       # wrapped past pid_max back to the low pids
    window.update()
    assert window.contains(32767) and window.contains(300) and window.contains(400)
    assert not window.contains(401) and not window.contains(31999)
    window.confirm(401)                          # a pid outside: another namespace
    assert not window.valid and window.contains(12345)
    other = ferrus.PidWindow()
    for step in range(1, 5):                     # half a cycle of allocations: stop filtering
        counter["value"] = (400 + step * 5000) % 32768
        other.update()
    assert not other.valid
