"""Fixes found by trying ferrus as a new user: a terminated orchestrator stops its
agents; an empty --task is refused before the finished task is cleared."""

import os
import signal
import subprocess
import time

import pytest

import ferrus
from conftest import FERRUS_CMD

S = ferrus.S


def _project(tmp_path):
    root = tmp_path / "proj"
    root.mkdir()
    assert ferrus.main(["-C", str(root), "init"]) == 0
    return root


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_terminated_orchestrator_releases_the_project_like_ctrl_c(tmp_path, signum):
    """SIGTERM/SIGHUP unwind `ferrus hq` like Ctrl+C: the orchestrator record is removed
    and the exit status is 128 + the signal; by default the signal killed ferrus alone."""
    root = _project(tmp_path)
    env = dict(os.environ, FERRUS_LOG="warning")
    proc = subprocess.Popen(FERRUS_CMD + ["-C", str(root), "hq", "--no-tui"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    record = root / ".ferrus" / ferrus.ORCHESTRATOR_RECORD
    deadline = time.monotonic() + 60
    while not record.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "HQ never took the orchestrator lock"
        time.sleep(0.02)
    proc.send_signal(signum)
    try:
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, proc.communicate()
    assert not record.exists(), "the orchestrator record was left behind"
