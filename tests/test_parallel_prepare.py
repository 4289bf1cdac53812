"""P2 prepares the batch's tasks side by side: their worktrees, [parallel] setup commands
and states are made at once, so a batch waits for its slowest task, not for the sum."""

import json
import os

import ferrus
from conftest import enqueue, run_tasks, scripted_setup, statuses


def test_the_batch_is_prepared_side_by_side(git_project, tmp_path):
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    # Each task's setup says it is here, then waits (at most 20 s) until the other's has
    # come too: prepared one after the other, the first would give up and fail its task.
    # The merge gate's clean checkout runs it too (the checks tried on the target's head
    # before the run, and each integration's), alone: it does not wait.
    barrier = ('touch "%s/$(basename "$PWD")"; case "$(basename "$PWD")" in t-*) i=0; '
               'while [ "$(ls "%s" | grep -c "^t-")" -lt 2 ] && [ $i -lt 200 ]; do sleep 0.1; '
               'i=$((i+1)); done; [ "$(ls "%s" | grep -c "^t-")" -ge 2 ];; esac'
               % ((str(arrived),) * 3))
    store = scripted_setup(git_project, ["test -f README.md"], "[parallel]\nsetup = %s\n\n"
                  % json.dumps([barrier]))
    tasks = [enqueue(store, "T%d.\n\nWRITE s%d.txt: %d\n" % (i, i, i)) for i in range(2)]
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "merged" for task in tasks}
    # Each task's worktree got it, and so did the merge gate's clean checkout.
    assert sorted(os.listdir(str(arrived))) == sorted(tasks + [ferrus.GATE_FOLDER])


def test_a_task_that_cannot_be_prepared_fails_alone_when_prepared_side_by_side(git_project):
    store = scripted_setup(git_project, ["test -f README.md"],
                  '[parallel]\nsetup = ["case $(basename $PWD) in *%s) exit 7;; esac"]\n\n'
                  % "PLACEHOLDER")
    tasks = [enqueue(store, "T%d.\n\nWRITE f%d.txt: %d\n" % (i, i, i)) for i in range(2)]
    broken = tasks[1]
    text = open(os.path.join(str(git_project), "ferrus.toml")).read().replace(
        "PLACEHOLDER", broken[-6:])
    with open(os.path.join(str(git_project), "ferrus.toml"), "w") as handle:
        handle.write(text)
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_FAILED, "\n".join(lines)
    assert statuses(store) == {tasks[0]: "merged", broken: "failed"}
    reason = ferrus.read_task_record(store.dir, broken)["reason"]
    assert "could not prepare its worktree" in reason and "exit 7" in reason
