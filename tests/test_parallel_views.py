"""Per-task views from the shell, with real git repositories: `ferrus log --task`,
`ferrus sessions --task`, `ferrus diff --task`, `ferrus check --task` and
`ferrus approve/reject [--task]` for parallel tasks (an id or its short end)."""

import json
import os
import shutil

import pytest

import ferrus
from conftest import enqueue, git, run_cli, run_tasks, scripted_setup
from test_parallel_doctor import cli, edit_config, repo, start_task  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

S = ferrus.TaskState


def move_to(store, task, state):
    """Put a task's state where a test needs it (as the agents' tools would have)."""
    task_store = store.for_task(task)
    with task_store.transaction("test") as tx:
        data = tx.state.copy()
        data.state = state
        tx.set(data, "test_move")


def test_log_shows_one_tasks_entries_by_its_short_id(repo):
    store = ferrus.Store(repo)
    first, _, _ = start_task(store, "First.")
    second, _, _ = start_task(store, "Second.")
    out = cli(repo, "log", "--json", "--task", ferrus.short_task_id(first))
    assert out.returncode == 0, out.stderr
    entries = [json.loads(line) for line in out.stdout.splitlines()]
    assert entries and {e["task_id"] for e in entries} == {first}
    assert [e["event"] for e in entries] == ["enqueue_task", "prepare_task", "create_task"]
    last = [json.loads(line) for line in cli(repo, "log", "--json", "-n", "1", "--task",
                                             second).stdout.splitlines()]
    assert [(e["event"], e["task_id"]) for e in last] == [("create_task", second)]
    bad = cli(repo, "log", "--task", "nosuch")
    assert bad.returncode == 1 and "no task nosuch in the queue" in bad.stderr
    # a task of the checkout (not in the queue) is named by its whole id
    quiet = cli(repo, "log", "--task", ferrus.new_id("t"))
    assert quiet.returncode == 0 and "no entry about task" in quiet.stdout


def test_sessions_takes_the_short_id(repo):
    store = ferrus.Store(repo)
    task, _, _ = start_task(store)
    folder = store.path("sessions")
    os.makedirs(folder, exist_ok=True)
    for name, owner in (("s-1", task), ("s-2", "t-20260101T000000-000000")):
        with open(os.path.join(folder, name + ".json"), "w") as handle:
            json.dump({"id": name, "task_id": owner, "role": "executor", "agent": "codex",
                       "started_at": "2026-11-24T06:00:00Z"}, handle)
    out = cli(repo, "sessions", "--json", "--task", ferrus.short_task_id(task))
    assert out.returncode == 0, out.stderr
    assert [r["id"] for r in json.loads(out.stdout)] == ["s-1"]


def test_diff_and_check_of_a_task_are_taken_in_its_worktree(repo):
    edit_config(repo, 'commands = ["true"]', 'commands = ["test -f feature.txt"]')
    store = ferrus.Store(repo)
    task, path, _ = start_task(store)
    with open(os.path.join(path, "feature.txt"), "w") as handle:
        handle.write("new\n")
    out = cli(repo, "diff", "--stat", "--task", ferrus.short_task_id(task))
    assert out.returncode == 0, out.stderr
    assert "feature.txt" in out.stdout and "Task %s diff" % task in out.stdout
    # STATE.json mirrors the task: the plain diff is that task's too, not the checkout's
    plain = cli(repo, "diff", "--stat").stdout
    assert "feature.txt" in plain and "Task %s diff" % task in plain
    checked = cli(repo, "check", "--force", "--task", ferrus.short_task_id(task))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "All checks passed" in checked.stdout
    assert cli(repo, "check", "--force").returncode == 1       # the checkout lacks the file
    # the gate itself, as the executor's check tool runs it: in the worktree, on the task
    gate = cli(repo, "check", "--task", task)
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert [e["task_id"] for e in store.read_journal() if e["event"] == "check_passed"] == \
        [task]
    queued = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Later.").data["task_id"]
    early = cli(repo, "diff", "--task", queued)
    assert early.returncode == 1 and "is queued: it has no work yet" in early.stderr


def test_approve_and_reject_find_the_waiting_parallel_task(repo):
    store = ferrus.Store(repo)
    first, _, _ = start_task(store, "First.")
    second, _, _ = start_task(store, "Second.")
    move_to(store, first, S.AWAITING_CONFIRMATION)
    move_to(store, second, S.AWAITING_CONFIRMATION)
    both = cli(repo, "approve", "--yes")
    assert both.returncode == 2
    assert "2 tasks wait for your confirmation: %s (First.), %s (Second.)" % (
        ferrus.short_task_id(first), ferrus.short_task_id(second)) in both.stderr
    assert "ferrus approve --task" in both.stderr
    sent_back = cli(repo, "reject", "--task", ferrus.short_task_id(second), "Use", "tabs")
    assert sent_back.returncode == 0, sent_back.stderr
    assert "State: Addressing" in sent_back.stdout
    assert store.for_task(second).read_file("REVIEW.md") == "Use tabs"
    # one task left waiting: no --task needed
    approved = cli(repo, "approve", "--yes")
    assert approved.returncode == 0, approved.stderr
    assert "State: Integrating" in approved.stdout
    assert "No run is working the queue now: the next `ferrus run --parallel`" in \
        approved.stdout
    assert store.for_task(first).read_state().state == S.INTEGRATING
    none = cli(repo, "approve", "--yes")
    assert none.returncode == 1 and "no approval waits for your confirmation" in none.stderr


def test_plain_status_and_diff_show_the_mirrored_parallel_task(git_project, monkeypatch):
    """The views of the task STATE.json mirrors, in its worktree and once merged."""
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "ask")
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    (git_project / "mine.txt").write_text("the user's own change\n")
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_NEEDS_HUMAN, "\n".join(lines)
    assert store.project_state().extra["mirrors_task"] == task
    assert ferrus.foreground_store(store).task == task
    done = run_cli("status", cwd=git_project)
    assert done.returncode == 0, done.stderr
    assert "question  Which colour should the button be?" in done.stdout
    assert "QUESTION.md is empty" not in done.stdout
    assert "run --resume" not in done.stdout and "`ferrus run --parallel N`" in done.stdout
    assert "(parallel task, in its worktree" in done.stdout
    status = json.loads(run_cli("status", "--json", cwd=git_project).stdout)
    assert status["parallel_task"] == task
    # the task's diff, in its worktree: never the user's own change in the checkout
    worktree = ferrus.read_task_record(store.dir, task)["worktree"]
    with open(os.path.join(worktree, "wip.txt"), "w") as handle:
        handle.write("work in progress\n")
    done = run_cli("diff", "--stat", cwd=git_project)
    assert done.returncode == 0, done.stderr
    assert "wip.txt" in done.stdout and "mine.txt" not in done.stdout
    # answered, the run goes on and merges it: the views say so, not its deleted branch
    ferrus.op_answer(store.for_task(task), ferrus.HUMAN, "blue")
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "")
    code, more = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines + more)
    merged = ferrus.read_task_record(store.dir, task)["merged_commit"]
    done = run_cli("status", cwd=git_project)
    assert "merged into main at %s" % merged[:12] in done.stdout
    assert "on branch ferrus/" not in done.stdout
    # Its diff, as the README says: what its merged commit changed (`git show` of it).
    shown = git(git_project, "show", "--format=", "--stat", merged).stdout
    for args in (("diff", "--stat"), ("diff", "--stat", "--task",
                                      ferrus.short_task_id(task))):
        done = run_cli(*args, cwd=git_project)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("Task %s merged into main at %s" % (
            ferrus.short_task_id(task), merged[:12]))
        assert shown.strip() in done.stdout
        assert "wip.txt" in done.stdout
