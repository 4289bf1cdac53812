"""An HQ run of two parallel tasks with scripted agents in a real git repository, through
to integration: /task add, /run, /attach ID (the other task's lines left out, its question
still shown and answered), /tasks, /status ID and /diff ID afterwards."""

import json
import os
import subprocess
import threading
import time

import ferrus
from conftest import FERRUS_CMD, SCRIPTED_CHECK, git, set_config
from test_hq import CONFIG, cli_env
from test_hq_plain_commands import PipedHq, hq  # noqa: F401  (hq: the fixture)

S = ferrus.S


def short(task):
    return ferrus.short_task_id(task)


def exact_line(shell, since, line, timeout=30):
    """HQ's output from ``since`` up to a line that is exactly ``line``."""
    deadline = time.monotonic() + timeout
    while line not in shell.out[since:]:
        assert time.monotonic() < deadline, "no line %r in:\n%s" % (line, "\n".join(shell.out))
        time.sleep(0.05)
    out = shell.out[since:]
    return out[:out.index(line) + 1]


class ResumingHq(PipedHq):
    """`ferrus hq --no-tui --resume` on pipes."""

    def __init__(self, root, env):
        self.proc = subprocess.Popen(FERRUS_CMD + ["hq", "--no-tui", "--resume"],
                                     cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.out = []
        self.changed = threading.Condition()
        self.reader_name = "hq-reader-%d" % self.proc.pid
        threading.Thread(target=self._read, name=self.reader_name, daemon=True).start()


def make_git_project(root, max_tasks=2):
    """The scripted project as a git repository whose tasks run ``max_tasks`` at a time
    (ferrus.toml and the agents' files committed: the checkout is clean)."""
    set_config(root, CONFIG.replace(json.dumps(SCRIPTED_CHECK), '"true"')
               + "\n[parallel]\nmax_tasks = %d\n" % max_tasks)
    with open(os.path.join(str(root), ".gitignore"), "a") as handle:
        handle.write(".ferrus/\n")
    git(root, "init", "-q")
    git(root, "config", "user.email", "test@example.com")
    git(root, "config", "user.name", "test")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "start")


# -- a parallel run in HQ ---------------------------------------------------------------------------

def test_hq_runs_two_parallel_tasks_to_integration(scripted, hq, tmp_path):  # noqa: F811
    root = scripted.root
    make_git_project(root)
    base = git(root, "rev-parse", "HEAD").stdout.strip()
    shell = hq(SCRIPTED_BEHAVIOR="ask")
    shell.command("/task add WRITE alpha.txt: alpha", "/run works the queue (2 at a time")
    shell.command("/task add WRITE beta.txt: beta", "/run works the queue")
    first, second = [task for task, _ in ferrus.task_records(scripted)]
    # Attached to the first task, the second's lines are left out — except its question.
    shell.command("/attach %s" % short(first), "Following task %s" % short(first))
    mark = shell.send("/run")
    question = shell.wait_for("[AWAITING YOUR ANSWER]", mark)
    asking = next(task for task in (first, second)
                  if scripted.for_task(task).read_state().state == S.AWAITING_HUMAN)
    shell.send("blue")
    shell.wait_for("task %s merged into main" % short(first), mark, timeout=90)
    out = shell.command("/attach", "Detached from task %s" % short(first))
    assert "of other tasks' lines were left out" in out[-1]
    shown = shell.out[mark:len(shell.out) - len(out)]
    # (the question is shown whichever task asks it)
    assert not any(line.startswith("[%s]" % short(second)) and "Which colour" not in line
                   for line in shown), shown
    assert any(line.startswith("[%s]" % short(first)) for line in shown), shown
    assert question
    shell.wait_for("The queue is done; what is queued next is worked 2 at a time too", mark,
                   timeout=90)
    # The run goes on with what is queued after it (until /stop).
    mark = shell.send("/task add WRITE gamma.txt: gamma")
    shell.wait_for("The run takes it up when a slot is free (2 at a time).", mark)
    shell.wait_for("merged into main", mark, timeout=90)
    shell.wait_for("The queue is done", mark, timeout=90)
    shell.command("/stop", "The parallel run is stopped; /run resumes its tasks.")

    out = exact_line(shell, shell.send("/tasks"), "3 merged")   # (a short id may end in 3)
    out = out[out.index(ferrus.TaskBoard.HEADER):]
    assert [line.split()[1] for line in out[1:4]] == ["merged"] * 3
    assert all(line.split()[2] == "scripted" for line in out[1:4])
    out = shell.command("/status %s" % short(second), "merged into main at")
    # A merged task's /diff is its merged commit's (its worktree and branch are gone).
    out = shell.command("/diff %s" % short(second), "+beta")
    assert any(line.startswith("Task %s merged into main at " % short(second)) for line in out)
    shell.quit()
    # Both tasks' files (and the answer the asking one wrote) are on main, checked.
    files = git(root, "ls-tree", "--name-only", "main").stdout.split()
    assert {"alpha.txt", "beta.txt", "gamma.txt", "answer.txt"} <= set(files)
    assert git(root, "show", "main:answer.txt").stdout == "blue"
    assert git(root, "rev-list", "--count", "%s..main" % base).stdout.strip() == "3"
    assert [ferrus.read_task_record(scripted.dir, t)["status"] for t in (first, second)] == [
        "merged", "merged"]
    assert asking in (first, second)
    assert not any("Traceback" in line for line in shell.out), "\n".join(shell.out)


def test_hq_resumes_parallel_tasks_a_previous_hq_left(scripted, hq, tmp_path):  # noqa: F811
    root = scripted.root
    make_git_project(root)
    shell = hq(SCRIPTED_BEHAVIOR="slow-executor")
    shell.command("/task add WRITE alpha.txt: alpha", "/run works the queue")
    shell.command("/task add WRITE beta.txt: beta", "/run works the queue")
    tasks = [task for task, _ in ferrus.task_records(scripted)]      # in the queue's order
    mark = shell.send("/run")
    for task in tasks:
        shell.wait_for("[%s] started the executor" % short(task), mark)
    shell.send("/quit", "y")
    shell.proc.stdin.close()
    assert shell.proc.wait(timeout=60) == 0
    assert [ferrus.read_task_record(scripted.dir, t)["status"] for t in tasks] == [
        "running", "running"]

    again = hq()
    out = again.wait_for("/run resumes them")
    assert out[-1] == "2 parallel tasks are in flight (%s); /run resumes them, /tasks shows " \
                      "the board." % ", ".join(short(t) for t in tasks)
    again.quit()
    # `ferrus hq --resume` takes them up at once.
    resuming = ResumingHq(root, cli_env(tmp_path))
    try:
        resuming.wait_for("2 parallel tasks are in flight (%s); resuming." % ", ".join(
            short(t) for t in tasks))
        resuming.wait_for("queue: resuming 2 tasks a previous run left")
        resuming.wait_for("The queue is done", timeout=120)
        resuming.quit()
    finally:
        resuming.close()
    assert {"alpha.txt", "beta.txt"} <= set(git(root, "ls-tree", "--name-only", "main").stdout.split())
    assert [ferrus.read_task_record(scripted.dir, t)["status"] for t in tasks] == [
        "merged", "merged"]
