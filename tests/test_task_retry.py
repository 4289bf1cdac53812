"""`ferrus task retry ID` and HQ's /task retry: a failed or cancelled task is queued again
-- in its kept worktree and branch, with the work done so far, when it ran in one;
afresh when it ran in the checkout -- and a task that is queued or merged is refused."""

import io
import json
import os

import pytest

import ferrus
from conftest import (committed, enqueue, git, run_cli, run_tasks, scripted_config,
                      scripted_setup, set_config, statuses)

S = ferrus.TaskState


def test_a_failed_task_is_retried_in_its_kept_worktree_and_merged(git_project, tmp_path):
    # [parallel] setup fails until the flag file exists: the task fails after its
    # worktree was made, which is kept.
    scripted_setup(git_project, ["test -f README.md"])
    flag = tmp_path / "ready"
    set_config(git_project, scripted_config(["test -f README.md"],
                                            "[parallel]\nsetup = [%s]\n\n" % json.dumps(
                                                "test -f '%s'" % flag)))
    git(git_project, "commit", "-qam", "setup")
    store = ferrus.Store(str(git_project))
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    # The setup fails on the target's clean checkout before the run too: going on anyway.
    code, lines = run_tasks(store, 2, allow_red_base=True)
    assert code == ferrus.RUN_FAILED, "\n".join(lines)
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "failed" and "setup failed" in record["reason"]
    worktree = record["worktree"]
    assert os.path.isdir(worktree)
    # work done so far in the kept worktree
    with open(os.path.join(worktree, "early.txt"), "w") as handle:
        handle.write("early\n")
    flag.write_text("")
    done = run_cli("task", "retry", ferrus.short_task_id(task), cwd=git_project)
    assert done.returncode == 0, done.stderr
    assert "queued again" in done.stdout and worktree in done.stdout
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "queued" and "reason" not in record
    assert record["worktree"] == worktree and record["branch"] == "ferrus/" + task
    assert store.for_task(task).read_state().state == S.IDLE
    retried = [e for e in store.read_journal() if e["event"] == "retry_task"]
    assert retried[-1]["task_id"] == task and retried[-1]["detail"]["was"] == "failed"
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "merged"}
    files = committed(git_project)
    assert "alpha.txt" in files and "early.txt" in files


def test_retry_refuses_tasks_that_did_not_fail_and_works_from_hq(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "Queued.\n\nWRITE q.txt: q\n")
    with pytest.raises(ferrus.FerrusError) as refused:
        ferrus.op_retry_task(store, ferrus.HUMAN, task)
    assert "is queued, not failed or cancelled" in refused.value.message
    ferrus.op_cancel_task(store, ferrus.HUMAN, task, remove_worktree=True)
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(), stdout=out)
    try:
        shell.handle("/task retry %s" % ferrus.short_task_id(task))
        shell.handle("/task retry")
    finally:
        shell.shutdown()
    assert "queued again" in out.getvalue()
    assert "usage: /task retry ID" in out.getvalue()
    assert statuses(store) == {task: "queued"}
    ferrus.update_task(store, ferrus.HUMAN, task, "task_merged", {"status": "merged"})
    done = run_cli("task", "retry", task, cwd=git_project)
    assert done.returncode == 1 and "already merged" in done.stderr


def test_retrying_a_task_that_ran_in_the_checkout_queues_it_afresh(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "One.\n\nWRITE one.txt: one\n")
    ferrus.update_task(store, ferrus.HUMAN, task, "task_failed", {
        "status": "failed", "store": "project", "started_at": "2026-01-01T00:00:00Z",
        "ended_at": "2026-01-01T00:01:00Z", "reason": "too many check failures"})
    ferrus.op_retry_task(store, ferrus.HUMAN, task)
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "queued"
    assert not {"store", "started_at", "ended_at", "reason"} & set(record)
    lines = []
    assert ferrus.run_queue(store, out=lines.append) == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "done"}
