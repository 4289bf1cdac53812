"""`ferrus task cancel` on parallel tasks, with real git repositories: with no
orchestrator it removes the task's worktree and branch itself (a failed task's kept one
too) and stops the agents a dead orchestrator left at work on it; with a running
`ferrus run --parallel` the runner does it, and a cancel from another shell reaches it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import ferrus
from conftest import branches, git, scripted_setup
from test_parallel_doctor import cli, commit_in, set_status, start_task

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

S = ferrus.TaskState


@pytest.fixture
def repo(git_project, monkeypatch):
    """A git repository with ferrus initialised, the scripted agent in both roles (each
    session of it stays at work a while), everything committed on main."""
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "slow-executor")
    scripted_setup(git_project, ["true"])
    return str(git_project)


def test_cancel_with_no_orchestrator_removes_the_worktree_and_branch(repo):
    store = ferrus.Store(repo)
    task, path, branch = start_task(store)
    head = ferrus.target_head(repo, branch)
    out = cli(repo, "task", "cancel", "--yes", ferrus.short_task_id(task))
    assert out.returncode == 0, out.stderr
    assert "Task %s cancelled. Removed its worktree %s and its branch %s" % (
        task, path, branch) in out.stdout
    assert "`git branch %s %s` brings back what it had committed" % (branch, head[:12]) \
        in out.stdout
    assert not os.path.exists(path) and branch not in branches(repo)
    assert ferrus.read_task_record(store.dir, task)["status"] == "cancelled"
    assert store.for_task(task).read_state().state == S.IDLE


def test_cancel_saves_the_work_and_retry_goes_on_from_it(repo):
    store = ferrus.Store(repo)
    task, path, branch = start_task(store)
    with open(os.path.join(path, "work.py"), "w") as handle:
        handle.write("half done = 1\n")
    os.unlink(os.path.join(path, "README.md"))
    asked = cli(repo, "task", "cancel", ferrus.short_task_id(task))
    assert asked.returncode == 2 and "pass --yes" in asked.stderr     # no terminal to ask
    assert os.path.isdir(path)
    out = cli(repo, "task", "cancel", "--yes", ferrus.short_task_id(task))
    assert out.returncode == 0, out.stderr
    record = ferrus.read_task_record(store.dir, task)
    ref = record["saved"]["ref"]
    assert ref.startswith("refs/ferrus/%s/saved-" % task)
    command = "git branch ferrus-saved-%s %s" % (ferrus.short_task_id(task), ref)
    assert "Its work is saved: `%s`" % command in out.stdout
    assert not os.path.exists(path)
    # The one command it names brings the work back.
    subprocess.run(command.split(), cwd=repo, check=True)
    assert git(repo, "show", "ferrus-saved-%s:work.py" % ferrus.short_task_id(task)
               ).stdout == "half done = 1\n"
    assert "README.md" not in git(repo, "ls-tree", "--name-only", ref).stdout
    # Retried, the task goes on from it.
    assert "goes on from its saved work" in cli(repo, "task", "retry", task).stdout
    runner = ferrus.ParallelRunner(store, lambda m: None, 1)
    runner.start()
    assert runner._prepare_task(task)
    again = ferrus.read_task_record(store.dir, task)["worktree"]
    assert open(os.path.join(again, "work.py")).read() == "half done = 1\n"
    assert not os.path.exists(os.path.join(again, "README.md"))
    assert "work.py" in ferrus.op_diff(store.for_task(task), ferrus.HUMAN).text
    runner.shutdown()


def test_a_lost_race_attempt_s_saved_work_is_not_offered_to_retry(repo):
    store = ferrus.Store(repo)
    task, path, _ = start_task(store)
    with open(os.path.join(path, "work.py"), "w") as handle:
        handle.write("half done = 1\n")
    ferrus.update_task(store, ferrus.ORCHESTRATOR, task, "race_lost", {
        "lost_to": "t-other", "reason": "attempt other of race r-1 was merged first"})
    out = ferrus.op_cancel_task(store, ferrus.ORCHESTRATOR, task, remove_worktree=True).text
    ref = ferrus.read_task_record(store.dir, task)["saved"]["ref"]
    assert "`git branch ferrus-saved-%s %s` makes a branch of it" % (
        ferrus.short_task_id(task), ref) in out
    assert "task retry" not in out and "`ferrus task add` queues a new task" in out
    with pytest.raises(ferrus.FerrusError) as refused:     # what retry would say
        ferrus.op_retry_task(store, ferrus.HUMAN, task)
    assert "lost its race" in refused.value.message


def test_cancel_with_discard_drops_the_work(repo):
    store = ferrus.Store(repo)
    task, path, _ = start_task(store)
    with open(os.path.join(path, "work.py"), "w") as handle:
        handle.write("x = 1\n")
    out = cli(repo, "task", "cancel", "--yes", "--discard", ferrus.short_task_id(task))
    assert out.returncode == 0, out.stderr
    assert "saved" not in out.stdout and not os.path.exists(path)
    assert "Its work was dropped (--discard)" in out.stdout
    assert ferrus.task_refs(repo, task) == {}


def test_cancel_of_a_task_without_work_saves_nothing(repo):
    store = ferrus.Store(repo)
    task, path, _ = start_task(store)
    out = cli(repo, "task", "cancel", "--yes", ferrus.short_task_id(task))
    assert "saved" not in out.stdout and ferrus.task_refs(repo, task) == {}


def test_cancel_removes_a_failed_tasks_kept_worktree_even_while_a_run_goes_on(repo):
    store = ferrus.Store(repo)
    failed, failed_path, failed_branch = start_task(store, "Failed one.")
    set_status(store, failed, "failed")
    running, running_path, running_branch = start_task(store, "Running one.")
    with ferrus.OrchestratorLock(store, "ferrus run"):
        ferrus.atomic_write(store.path("parallel.json"), json.dumps(
            {"phase": 4, "pid": os.getpid(), "ended": False}))
        # the failed task is in nobody's hands: cancel removes its worktree itself
        out = cli(repo, "task", "cancel", failed).stdout
        assert "Removed its worktree %s" % failed_path in out
        assert not os.path.exists(failed_path) and failed_branch not in branches(repo)
        # the running one is the run's to stop: cancel leaves its worktree to it
        out = cli(repo, "task", "cancel", "--yes", running).stdout
        assert "Task %s cancelled." % running in out and "Removed" not in out
        assert "The running ferrus run (pid %d" % os.getpid() in out
        assert "stops its agents and removes its worktree and branch" in out
        assert os.path.isdir(running_path)
    # the run is gone and left it: cancelling again cleans up
    out = cli(repo, "task", "cancel", "--yes", running).stdout
    assert "was already cancelled. Removed its worktree %s" % running_path in out
    assert sorted(branches(repo)) == ["main"]


def test_cancel_stops_the_agents_a_dead_orchestrator_left_on_that_task_only(repo):
    store = ferrus.Store(repo)
    task, path, branch = start_task(store, "Mine.")
    other, _, _ = start_task(store, "Another.")
    agents = []
    for owner in (task, other):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                start_new_session=True)
        agents.append(proc)
        with store.lock():
            ferrus.edit_json_file(store.path("agents.json"), lambda data, proc=proc, owner=owner:
                                  data.setdefault("agents", []).append({
                                      "name": "executor", "pid": proc.pid, "status": "running",
                                      "session": ferrus.session_id_for_task(owner)}))
    try:
        out = cli(repo, "task", "cancel", "--yes", task)
        assert out.returncode == 0, out.stderr
        assert "stopped the executor (pid %d)" % agents[0].pid in out.stdout
        assert agents[0].wait(timeout=30) is not None
        assert agents[1].poll() is None                 # another task's agent is not touched
        entries = json.loads(open(store.path("agents.json")).read())["agents"]
        assert [e["status"] for e in entries] == ["suspended", "running"]
    finally:
        for proc in agents:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def step_until(runner, condition, what, limit=120.0):
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "gave up waiting for " + what
        runner.step()
        time.sleep(0.02)


def test_a_cancel_from_another_shell_reaches_the_running_parallel_run(repo):
    store = ferrus.Store(repo)
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Take your time.").data["task_id"]
    lines = []
    with ferrus.OrchestratorLock(store, "ferrus run"):
        runner = ferrus.ParallelRunner(store, lambda message: lines.append(message.text), 2)
        try:
            runner.start()
            # the executor is at work in the task's worktree (it holds the task's lease)
            step_until(runner, lambda: task in runner.controllers and
                       runner.controllers[task].store.read_state().claimed_by,
                       "the executor to claim the task")
            agent = runner.controllers[task].running()[0].process
            record = ferrus.read_task_record(store.dir, task)
            assert os.path.isdir(record["worktree"])
            out = cli(repo, "task", "cancel", "--yes", ferrus.short_task_id(task))
            assert out.returncode == 0, out.stderr
            assert "stops its agents and removes its worktree" in out.stdout
            step_until(runner, lambda: task not in runner.controllers, "the run to end the task")
            assert runner.ended[task] == "cancelled"
        finally:
            runner.shutdown()
    assert not os.path.exists(record["worktree"])
    assert record["branch"] not in branches(repo)
    assert agent.proc.poll() is not None                # its agent was stopped
    assert any("task %s cancelled" % ferrus.short_task_id(task) in line for line in lines)
    assert ferrus.read_task_record(store.dir, task)["status"] == "cancelled"


def test_a_cancel_that_lands_while_the_run_prepares_the_task_is_not_undone(repo, monkeypatch):
    store = ferrus.Store(repo)
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Never mind.").data["task_id"]
    runner = ferrus.ParallelRunner(store, lambda message: None, 2)
    runner.start()
    real = ferrus.target_head

    def cancel_first(root, branch):
        # another shell cancels between the run's read of the record and its update
        monkeypatch.setattr(ferrus, "target_head", real)
        ferrus.op_cancel_task(store, ferrus.HUMAN, task)
        return real(root, branch)
    monkeypatch.setattr(ferrus, "target_head", cancel_first)
    try:
        assert runner._prepare_task(task) is False
    finally:
        runner.shutdown()
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "cancelled" and "worktree" not in record
    assert branches(repo) == ["main"]


def test_hq_task_cancel_removes_a_failed_tasks_kept_worktree(repo):
    store = ferrus.Store(repo)
    task, path, branch = start_task(store)
    set_status(store, task, "failed")
    proc = subprocess.run([sys.executable, ferrus.__file__, "hq", "--no-tui"], cwd=repo,
                          input="/task cancel %s\n/quit\n" % ferrus.short_task_id(task),
                          text=True, capture_output=True, timeout=120)
    assert "Task %s cancelled. Removed its worktree %s and its branch %s" % (
        task, path, branch) in proc.stdout, proc.stdout + proc.stderr
    assert not os.path.exists(path) and branch not in branches(repo)


# -- a cancel against the merge: one of them wins, atomically ---------------------------------

def run_one_task(repo, monkeypatch, text="Merge me.\n\nWRITE m.txt: m\n"):
    """Queue one task and work it with quick agents; (task, exit code, the run's lines)."""
    monkeypatch.delenv("SCRIPTED_BEHAVIOR")
    store = ferrus.Store(repo)
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]
    lines = []
    code = ferrus.run_parallel(store, 2, timeout=240, out=lines.append)
    return task, code, lines


def test_a_cancel_between_the_merge_checks_and_the_fast_forward_wins(repo, monkeypatch):
    """The cancel was accepted after the checks on the merged result passed and before
    the target moved, and the task was merged anyway."""
    before = ferrus.target_head(repo, "main")
    said = []
    real = ferrus.update_task

    def cancel_once_checked(store, caller, task, event, changes, *args, **kwargs):
        done = real(store, caller, task, event, changes, *args, **kwargs)
        if event == "integration_ready":          # checked: the fast-forward comes next
            said.append(cli(repo, "task", "cancel", "--yes", ferrus.short_task_id(task)))
        return done
    monkeypatch.setattr(ferrus, "update_task", cancel_once_checked)
    task, code, lines = run_one_task(repo, monkeypatch)
    text = "\n".join(lines)
    assert said and said[0].returncode == 0, said
    assert "cancelled before its merge: the target branch is not moved for it" in said[0].stdout
    assert ferrus.target_head(repo, "main") == before            # the target never moved
    assert "m.txt" not in git(repo, "ls-tree", "-r", "--name-only", "main").stdout
    record = ferrus.read_task_record(ferrus.Store(repo).dir, task)
    assert record["status"] == "cancelled" and "merged_commit" not in record
    assert "task %s was cancelled before its merge: main was not moved for it" % (
        ferrus.short_task_id(task)) in text
    events = [e["event"] for e in ferrus.Store(repo).read_journal() if e["task_id"] == task]
    assert "integrated" not in events and "task_merged" not in events
    assert not os.path.exists(record["worktree"])
    assert code == ferrus.RUN_COMPLETE, text


def test_a_cancel_that_waits_for_the_merge_in_progress_is_refused_and_says_so(repo,
                                                                              monkeypatch):
    """The cancel arrives while the fast-forward runs (the merge holds the lock): the
    merge wins, and the cancel is refused saying the merge came first."""
    import threading
    store = ferrus.Store(repo)
    outcome, waiting = {}, threading.Event()
    real_move, real_acquire = ferrus.fast_forward_target, ferrus.FileLock.acquire

    def acquire(lock):
        if threading.current_thread().name == "cancel":
            waiting.set()                 # the cancel now waits for the lock
        return real_acquire(lock)

    def cancel(task):
        try:
            outcome["said"] = ferrus.op_cancel_task(store, ferrus.HUMAN, task).text
        except ferrus.FerrusError as err:
            outcome["refused"] = err

    def move_while_a_cancel_waits(root, target, expected, commit):
        task = next(t for t in ferrus.queued_task_ids(store)
                    if ferrus.read_task_record(store.dir, t).get("status") == "running")
        thread = threading.Thread(target=cancel, args=(task,), name="cancel")
        thread.start()
        outcome["thread"] = thread
        assert waiting.wait(30), "the cancel never reached the lock"
        return real_move(root, target, expected, commit)
    monkeypatch.setattr(ferrus.FileLock, "acquire", acquire)
    monkeypatch.setattr(ferrus, "fast_forward_target", move_while_a_cancel_waits)
    task, code, lines = run_one_task(repo, monkeypatch)
    outcome["thread"].join(60)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert "said" not in outcome, outcome
    refused = outcome["refused"]
    assert "is already merged into main at " in refused.message and \
        "the merge came before this cancel, nothing was cancelled" in refused.message
    assert ferrus.read_task_record(store.dir, task)["status"] == "merged"
    assert "m.txt" in git(repo, "ls-tree", "-r", "--name-only", "main").stdout


def test_a_cancel_after_a_run_died_between_the_fast_forward_and_its_record_is_refused(
        repo, monkeypatch):
    """The target already holds the checked candidate but the run was killed before it
    recorded the merge: a cancel then must not call the merged task cancelled."""
    store = ferrus.Store(repo)
    task, path, branch = start_task(store)
    task_store = store.for_task(task)
    data = task_store.read_state()
    data.state = S.INTEGRATING                     # approved, in the merge queue
    ferrus.atomic_write(task_store.task_path(ferrus.STATE_FILE), data.to_json())
    commit_in(path, "c.txt", "c\n")
    candidate = ferrus.target_head(repo, branch)
    git(repo, "merge", "-q", "--ff-only", branch)                # the fast-forward happened
    ferrus.update_task(store, ferrus.HUMAN, task, "integration_ready", {
        "integration": {"candidate": candidate, "target_head": "x"}})
    out = cli(repo, "task", "cancel", "--yes", ferrus.short_task_id(task))
    assert out.returncode == 1
    assert "is already merged into main at %s: the merge came before this cancel" % (
        candidate[:12]) in out.stderr
    assert ferrus.read_task_record(store.dir, task)["status"] == "running"
    assert task_store.read_state().state == S.INTEGRATING
