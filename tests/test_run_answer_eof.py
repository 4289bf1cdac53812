"""Ctrl+D at `ferrus run`'s answer prompt leaves the question waiting and ends the run
with exit 4, as without a terminal — it used to end in an EOFError traceback."""

import os
import select
import subprocess
import time

import pytest

import ferrus
from conftest import FERRUS_CMD, scripted_project

pytestmark = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")


def read_until(fd, text, limit=60.0):
    seen, deadline = b"", time.monotonic() + limit
    while text.encode() not in seen:
        assert time.monotonic() < deadline, "never saw %r in:\n%s" % (text, seen.decode())
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                seen += os.read(fd, 4096)
            except OSError:
                break
    return seen.decode("utf-8", "replace")


def test_ctrl_d_at_the_answer_prompt_exits_4(project, tmp_path):
    store = scripted_project(project, tmp_path / "memory")
    env = dict(os.environ, SCRIPTED_DIR=str(tmp_path / "memory"), SCRIPTED_BEHAVIOR="ask")
    master, slave = os.openpty()
    proc = subprocess.Popen(FERRUS_CMD + ["run", "--task", "Make work.txt"],
                            cwd=str(project), env=env, stdin=slave, stdout=slave,
                            stderr=slave, close_fds=True)
    os.close(slave)
    try:
        read_until(master, "answer> ")
        os.write(master, b"\x04")               # Ctrl+D: end of input on the terminal
        assert proc.wait(timeout=60) == ferrus.RUN_NEEDS_HUMAN
        rest = read_until(master, "no answer is given here")
        assert "no answer is given here" in rest
        assert "Traceback" not in rest and "EOFError" not in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert store.read_state().state == ferrus.S.AWAITING_HUMAN


def test_ctrl_d_at_a_confirmation_answers_no(store, project):
    ferrus.op_create_task(store, ferrus.HUMAN, "Make work.txt")
    master, slave = os.openpty()
    proc = subprocess.Popen(FERRUS_CMD + ["reset"], cwd=str(project),
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    try:
        read_until(master, "[y/N] ")
        os.write(master, b"\x04")
        assert proc.wait(timeout=60) == 1
        rest = read_until(master, "Nothing changed.")
        assert "Nothing changed." in rest and "Traceback" not in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert store.read_state().state == ferrus.S.EXECUTING
