"""Found by using ferrus as a careless user and an adversary would: what an
interrupted orchestrator leaves behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

import ferrus
from conftest import FERRUS_PY, SCRIPTED_AGENT, custom_agent_config, set_config


def _wait_for(predicate, what, proc=None, limit=60):
    deadline = time.monotonic() + limit
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError("ferrus ended before %s: %r" % (what, proc.communicate()))
        assert time.monotonic() < deadline, "timed out waiting for " + what
        time.sleep(0.02)


def _running(pid):
    """Alive and not a zombie (an orphan's zombie may wait for a reaper)."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the check")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_run_ends_the_check_its_agent_was_running(tmp_path, signum):
    """`ferrus run` stopped while the executor's check runs: the agent and its MCP
    server are stopped, and so is the check command (in a process group of its own),
    instead of running on for minutes with nobody to read its result."""
    root = tmp_path / "proj"
    root.mkdir()
    assert ferrus.main(["-C", str(root), "init"]) == 0
    set_config(root, '[checks]\ncommands = ["echo $$ > check.pid; exec sleep 120"]\n'
               '[limits]\nwait_timeout_secs = 5\n' +
               custom_agent_config("scripted", [sys.executable, SCRIPTED_AGENT, "{role}",
                                                "{mcp_config}"]))
    ferrus.register_agents(str(root), {"supervisor": ("scripted", None),
                                       "executor": ("scripted", None)},
                           report=lambda message: None)
    env = dict(os.environ, FERRUS_LOG="warning", SCRIPTED_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, FERRUS_PY, "-C", str(root), "run", "--task",
                             "work"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    pid_file = root / "check.pid"
    try:
        _wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(),
                  "the check to start", proc)
        check_pid = int(pid_file.read_text())
        proc.send_signal(signum)
        proc.communicate(timeout=60)
        _wait_for(lambda: not _running(check_pid), "the check to end", limit=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if pid_file.exists() and pid_file.read_text().strip():
            with __import__("contextlib").suppress(OSError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert not os.listdir(root / ".ferrus" / ferrus.CHECK_PROCESS_DIR), \
        "the check's pid file was left behind"
