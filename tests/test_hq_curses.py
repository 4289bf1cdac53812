"""The curses HQ front end, driven through a real terminal: tmux.

ferrus runs in a detached tmux session (its own server socket); keys go in with
`send-keys` and the screen comes back with `capture-pane`.  The agents are the
scripted agents of test_hq.py.
"""

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time

import pytest

import ferrus
from conftest import FERRUS_CMD

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Pane:
    """`ferrus hq` in a 120x40 tmux pane; afterwards its exit code and `stty -a`."""

    def __init__(self, root, tmp_path, **env):
        pytest.importorskip("curses")
        # A private server; its socket path must stay short (sun_path has ~100 bytes).
        self.socket_dir = tempfile.mkdtemp(prefix="ferrus-tmux-")
        self.tmux = ["tmux", "-S", os.path.join(self.socket_dir, "s"), "-f", os.devnull]
        self.exit_file, self.stty_file = tmp_path / "hq.exit", tmp_path / "hq.stty"
        self.history = tmp_path / "home" / ".ferrus_history"
        self.history.parent.mkdir(exist_ok=True)
        full_env = dict(os.environ, SCRIPTED_DIR=str(tmp_path), HOME=str(self.history.parent),
                        **env)
        for name in ("NO_COLOR", "TMUX", "FERRUS_DEBUG"):
            full_env.pop(name, None)
        # tmux gives panes its own TERM, so the command sets the one under test.
        command = "cd %s && TERM=xterm-256color %s %s hq; echo $? > %s; stty -a > %s" % tuple(
            shlex.quote(str(part)) for part in (root, *FERRUS_CMD,
                                                self.exit_file, self.stty_file))
        subprocess.run(self.tmux + ["new-session", "-d", "-s", "hq", "-x", "120", "-y", "40",
                                    command], env=full_env, check=True, timeout=30)

    def keys(self, *keys, literal=False):
        subprocess.run(self.tmux + ["send-keys", "-t", "hq"] + (["-l"] if literal else []) +
                       list(keys), check=True, timeout=30)

    def type(self, text, *keys):
        """Type ``text`` literally, then press ``keys`` (tmux key names)."""
        self.keys(text, literal=True)
        if keys:
            self.keys(*keys)

    def lines(self, escapes=False):
        done = subprocess.run(self.tmux + ["capture-pane", "-p", "-t", "hq"] +
                              (["-e"] if escapes else []),
                              capture_output=True, text=True, timeout=30)
        return done.stdout.rstrip("\n").split("\n") if done.returncode == 0 else []

    def alive(self):
        return subprocess.run(self.tmux + ["has-session", "-t", "hq"], capture_output=True,
                              timeout=30).returncode == 0

    def wait(self, condition, timeout=15.0, what=""):
        """Wait until ``condition(lines)`` holds; fail with the screen if it never does."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.lines()
            if condition(lines):
                return lines
            assert time.monotonic() < deadline, "timed out waiting for %s; screen:\n%s" % (
                what, "\n".join(lines))
            time.sleep(0.1)

    def wait_for(self, text, timeout=15.0):
        return self.wait(lambda lines: any(text in line for line in lines), timeout, repr(text))

    def input_line(self):
        return self.lines()[-1].rstrip()

    def exited(self, timeout=15.0):
        """The exit code of ferrus once the pane has closed (the terminal is restored)."""
        deadline = time.monotonic() + timeout
        while self.alive() or not self.stty_file.exists():
            assert time.monotonic() < deadline, "HQ did not exit:\n" + "\n".join(self.lines())
            time.sleep(0.1)
        return int(self.exit_file.read_text().strip())

    def close(self):
        subprocess.run(self.tmux + ["kill-server"], capture_output=True, timeout=30)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


@pytest.fixture
def pane_for(scripted, tmp_path):  # noqa: F811
    panes = []

    def start(**env):
        panes.append(Pane(scripted.root, tmp_path, **env))
        return panes[-1]
    yield start
    for pane in panes:
        pane.close()


def wait_agents_done(pane):
    """After the task ends the reviewer still says its last words for a moment (HQ
    waits for them); quitting before that asks first, so wait until every slot is idle."""
    pane.wait(lambda lines: len(lines) > 1 and "executor idle" in lines[1] and
              "reviewer idle" in lines[1], what="the agents to finish")


def assert_terminal_restored(pane):
    flags = pane.stty_file.read_text().split()
    assert "icanon" in flags and "echo" in flags and "icrnl" in flags, flags


def test_curses_hq_status_task_completion_and_quit(scripted, pane_for):  # noqa: F811
    limits = scripted.config().limits
    pane = pane_for(SCRIPTED_BEHAVIOR="")
    screen = pane.wait(lambda lines: lines[0].startswith("ferrus HQ │ Idle"), what="status line")
    assert "retries 0/%d" % limits.max_check_retries in screen[0]
    assert "reviews 0/%d" % limits.max_review_cycles in screen[0]
    assert "executor idle" in screen[1] and "reviewer idle" in screen[1]

    pane.type("/status", "Enter")
    screen = pane.wait_for("  executor: idle")
    assert any(line.startswith("State Idle") for line in screen)
    assert screen[0].startswith("ferrus HQ │ Idle")

    # Tab completes a unique command at once; Enter then submits it.
    pane.type("/sta", "Tab")
    pane.wait(lambda lines: lines[-1].rstrip() == "> /status", what="the completion")
    pane.keys("Enter")
    pane.wait(lambda lines: sum(line.rstrip() == "> /status" for line in lines) == 2 and
              sum(line.startswith("State Idle") for line in lines) == 3, what="a second /status")

    pane.type("/task Make work.txt", "Enter")
    screen = pane.wait(lambda lines: any("Task complete." in line for line in lines) and
                       lines[0].startswith("ferrus HQ │ Complete"), timeout=60,
                       what="the task to complete")
    assert scripted.read_state().state == ferrus.S.COMPLETE
    assert any("Idle → Executing" in line for line in screen)
    assert any("Reviewing → Complete" in line for line in screen)
    # Transitions are coloured (NO_COLOR is unset).
    assert re.search(r"\x1b\[(\d+;)*3[1-7]m[^\n]*Reviewing → Complete",
                     "\n".join(pane.lines(escapes=True)))

    # The history keeps each command once, in order; Up and Down browse it.
    assert pane.history.read_text().splitlines() == ["/status", "/task Make work.txt"]
    pane.keys("Up")
    pane.wait(lambda lines: lines[-1].rstrip() == "> /task Make work.txt", what="history Up")
    pane.keys("Up", "Down", "Down")
    pane.wait(lambda lines: lines[-1].rstrip() == ">", what="history Down")

    # Ctrl+C once only warns; twice within 2 s quits (no agent runs, so no question).
    wait_agents_done(pane)
    pane.keys("C-c")
    pane.wait_for("Press Ctrl+C again to quit.")
    assert pane.alive()
    pane.keys("C-c")
    assert pane.exited() == 0
    assert_terminal_restored(pane)


def test_curses_hq_question_confirm_attach_and_multiline_answer(scripted, pane_for):  # noqa: F811
    pane = pane_for(SCRIPTED_BEHAVIOR="ask")
    pane.wait(lambda lines: lines[0].startswith("ferrus HQ │ Idle"), what="status line")
    pane.type("/task Make work.txt", "Enter")
    pane.wait_for("Which colour should the button be?", timeout=60)
    screen = pane.wait_for("[AWAITING YOUR ANSWER]")
    assert screen[0].startswith("ferrus HQ │ AwaitingHuman")

    # The executor still runs (it waits for the answer): quitting asks first.
    pane.keys("C-c")
    pane.wait_for("Press Ctrl+C again to quit.")
    pane.keys("C-c")
    screen = pane.wait(lambda lines: "stop them and quit?" in lines[1], what="the confirmation")
    assert "[y/N]" in screen[1] and "executor" in screen[1]
    pane.keys("n")
    pane.wait_for("stop them and quit? no")
    assert pane.alive()

    # /attach shows the agent's log until a key is pressed.
    pane.type("/attach executor", "Enter")
    screen = pane.wait_for("tool ask_human")
    assert "attached to the executor" in screen[1]
    pane.keys("x")
    screen = pane.wait_for("--- detached from the executor ---")
    assert pane.input_line() == ">"

    # A three-line answer: Ctrl+J and Alt+Enter insert newlines, Enter sends.
    pane.type("blue", "C-j")
    pane.type("green", "M-Enter")
    pane.type("red")
    pane.wait(lambda lines: [line.rstrip() for line in lines[-3:]] == [
        "> blue", "  green", "  red"], what="three input lines")
    pane.keys("Enter")
    pane.wait(lambda lines: any("Task complete." in line for line in lines), timeout=60,
              what="the task to complete")
    assert scripted.read_state().state == ferrus.S.COMPLETE
    with open(os.path.join(scripted.root, "answer.txt")) as handle:
        assert handle.read() == "blue\ngreen\nred"
    # Answers are not commands: the history has only the command lines.
    assert pane.history.read_text().splitlines() == ["/task Make work.txt", "/attach executor"]

    wait_agents_done(pane)
    pane.type("/quit", "Enter")
    assert pane.exited() == 0
    assert_terminal_restored(pane)
