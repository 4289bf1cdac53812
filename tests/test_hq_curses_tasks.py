"""The task board of the curses HQ, in an 80x24 terminal (tmux): queued tasks on the board
before /run, two of three running after it, /attach ID marking one and narrowing the
status line and the transcript to it, and quitting with parallel agents at work."""

import shutil
import subprocess

import pytest

import ferrus
from test_hq_curses import Pane, assert_terminal_restored
from test_hq_parallel_run import make_git_project

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def test_the_board_in_80_columns(scripted, tmp_path):  # noqa: F811
    root = scripted.root
    make_git_project(root)
    tasks = [ferrus.op_enqueue_task(scripted, ferrus.HUMAN, "WRITE %s.txt: %s" % (name, name))
             .data["task_id"] for name in ("a", "b", "c")]
    short = [ferrus.short_task_id(task) for task in tasks]
    # The executors take their time, so the board can be read while they work.
    pane = Pane(root, tmp_path, SCRIPTED_BEHAVIOR="slow-executor")
    try:
        subprocess.run(pane.tmux + ["resize-window", "-t", "hq", "-x", "80", "-y", "24"],
                       check=True, timeout=30)
        lines = pane.wait_for("tasks: 3 queued — /tasks lists them, /attach ID follows one")
        assert len(lines) == 24 and max(len(line) for line in lines) <= 80
        assert lines[2].startswith("tasks: 3 queued")
        assert [line.split()[:2] for line in lines[3:6]] == [[s, "queued"] for s in short]
        assert lines[3].endswith("WRITE a.txt: a")
        assert lines[6].startswith("ferrus HQ %s" % ferrus.__version__)   # the transcript

        pane.type("/run", "Enter")
        lines = pane.wait_for("tasks: 2 running, 1 queued")
        lines = pane.wait(lambda lines: sum("Executing" in line for line in lines[3:6]) == 2
                          and lines[0].startswith("ferrus HQ │ tasks: 2 running, 1 queued │ "
                                                  "/attach ID"),
                          what="two tasks executing on the board, counted on the status line")
        assert lines[1] == "run: waiting for the agents' work, 2 at a time"
        assert lines[5].split()[:2] == [short[2], "queued"]
        assert all(line.split()[2] == "scripted" for line in lines[3:5])

        pane.type("/attach %s" % short[1], "Enter")
        lines = pane.wait_for("Following task %s" % short[1])
        assert lines[0].startswith("ferrus HQ │ Executing ") and "▸%s" % short[1] in lines[0]
        assert lines[1].startswith("executor Running")
        assert lines[4].startswith("▸%s Executing" % short[1])
        # Only that task's lines (and HQ's own) are left in the transcript.
        transcript = lines[7:-2]
        assert not any("[%s]" % short[0] in line for line in transcript), transcript
        pane.type("/attach", "Enter")
        lines = pane.wait_for("Detached from task %s" % short[1])
        assert lines[0].startswith("ferrus HQ │ tasks: 2 running")

        pane.keys("C-c")
        pane.keys("C-c")
        pane.wait_for("stop them and quit?")
        pane.keys("y")
        assert pane.exited(timeout=30) == 0
        assert_terminal_restored(pane)
    finally:
        pane.close()
    # The tasks stay in flight for the next run; no agent was left behind.
    assert [ferrus.read_task_record(scripted.dir, task)["status"] for task in tasks] == [
        "running", "running", "queued"]
    records = ferrus.read_session_records(scripted)
    assert records and all(ferrus.session_state(record) == "ended" for record in records)
