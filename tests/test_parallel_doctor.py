"""`ferrus doctor` on parallel tasks, with real git repositories: leftover worktrees and
branches (of merged, cancelled or unknown tasks) removed by --fix, a failed task's kept
worktree shown as kept, a RUNNING task whose worktree is gone, damaged task records and
task states set aside, and a parallel run that stopped part way."""

import json
import os
import shutil

import pytest

import ferrus
from conftest import branches, git, run_cli, scripted_config, scripted_setup, set_config

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

FERRUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ferrus.py")
S = ferrus.TaskState


def cli(root, *args):
    return run_cli(*args, cwd=root, timeout=120)


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda m: None)
    edit_config(str(root), "commands = []", 'commands = ["true"]')
    with open(os.path.join(str(root), "README.md"), "w") as handle:
        handle.write("hello\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    return str(root)


def edit_config(root, old, new):
    path = os.path.join(root, "ferrus.toml")
    with open(path) as handle:
        text = handle.read()
    assert old in text
    with open(path, "w") as handle:
        handle.write(text.replace(old, new, 1))


def start_task(store, text="Do it."):
    """A task as the parallel runner starts one: queued, then RUNNING in its own worktree
    and branch from main's head, with its state in Executing."""
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]
    path = os.path.join(ferrus.default_worktree_dir(store.root), task)
    branch = ferrus.TASK_BRANCH_PREFIX + task
    base = ferrus.target_head(store.root, "main")
    ferrus.update_task(store, ferrus.HUMAN, task, "prepare_task", {
        "status": "running", "worktree": path, "branch": branch, "base": base,
        "target": "main", "store": "worktree"})
    ferrus.create_task_worktree(store.root, path, branch, base)
    task_store = store.for_task(task)
    ferrus.atomic_write(task_store.task_path(ferrus.STATE_FILE), ferrus.StateData().to_json())
    ferrus.op_create_task(task_store, ferrus.HUMAN, text, task_id=task)
    return task, path, branch


def set_status(store, task, status):
    ferrus.update_task(store, ferrus.HUMAN, task, "task_" + status, {"status": status})


def commit_in(path, name, text):
    with open(os.path.join(path, name), "w") as handle:
        handle.write(text)
    git(path, "add", name)
    git(path, "commit", "-qm", "work on " + name)


def test_leftovers_of_merged_cancelled_and_unknown_tasks_are_listed_and_removed(repo):
    store = ferrus.Store(repo)
    merged, merged_path, merged_branch = start_task(store, "Merged one.")
    set_status(store, merged, "merged")
    cancelled, cancelled_path, cancelled_branch = start_task(store, "Cancelled one.")
    commit_in(cancelled_path, "c.txt", "c\n")
    head = git(cancelled_path, "rev-parse", "HEAD").stdout.strip()
    git(repo, "worktree", "remove", "--force", cancelled_path)     # only its branch is left
    set_status(store, cancelled, "cancelled")
    unknown, unknown_path, unknown_branch = start_task(store, "Forgotten one.")
    shutil.rmtree(os.path.join(store.dir, "tasks", unknown))         # its record is gone
    running, running_path, running_branch = start_task(store, "Still running.")

    found = cli(repo, "doctor")
    assert found.returncode == 0, found.stdout + found.stderr       # warnings only
    out = found.stdout
    assert "warning: leftover worktree %s (branch %s): task %s is merged" % (
        merged_path, merged_branch, merged) in out
    assert "warning: leftover branch %s: task %s was cancelled" % (
        cancelled_branch, cancelled) in out
    # the commits of a deleted branch can be brought back
    assert "`git branch %s %s` brings it back" % (cancelled_branch, head[:12]) in out
    assert "leftover worktree %s (branch %s): no task of the queue is %s" % (
        unknown_path, unknown_branch, unknown) in out
    assert running not in out                                      # in the queue's hands
    # STATE.json mirrors the running task: its content files are the task's own
    assert "TASK.md is empty" not in out

    fixed = cli(repo, "doctor", "--fix")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert fixed.stdout.count("fixed: remove the worktree and its branch") == 2
    assert "fixed: remove the branch (it was at %s" % head[:12] in fixed.stdout
    assert sorted(branches(repo)) == sorted(["main", running_branch])
    assert not os.path.exists(merged_path) and not os.path.exists(unknown_path)
    assert os.path.isdir(running_path)
    assert "leftover" not in cli(repo, "doctor").stdout


def test_a_leftover_worktree_with_uncommitted_changes_of_an_unknown_task_is_kept(repo):
    store = ferrus.Store(repo)
    task, path, branch = start_task(store)
    with open(os.path.join(path, "draft.txt"), "w") as handle:
        handle.write("unsaved work\n")
    shutil.rmtree(os.path.join(store.dir, "tasks", task))
    fixed = cli(repo, "doctor", "--fix")
    assert "it has uncommitted changes (draft.txt)" in fixed.stdout
    assert "git worktree remove --force %s" % path in fixed.stdout
    assert os.path.isfile(os.path.join(path, "draft.txt")) and branch in branches(repo)


def test_a_failed_tasks_kept_worktree_is_a_note_and_stays(repo):
    store = ferrus.Store(repo)
    task, path, branch = start_task(store)
    set_status(store, task, "failed")
    found = cli(repo, "doctor")
    assert found.returncode == 0
    assert "info: task %s failed; its worktree %s (branch %s) is kept for a look" % (
        task, path, branch) in found.stdout
    assert "`ferrus task cancel %s` removes them" % ferrus.short_task_id(task) in found.stdout
    assert "everything is consistent (see the notes above)" in found.stdout
    cli(repo, "doctor", "--fix")
    assert os.path.isdir(path) and branch in branches(repo)


def test_a_running_task_whose_worktree_is_gone_is_an_error_that_says_how_to_recover(repo):
    store = ferrus.Store(repo)
    task, path, branch = start_task(store)
    shutil.rmtree(path)
    found = cli(repo, "doctor")
    assert found.returncode == 1
    assert "error: task %s is running, but its worktree %s is gone" % (task, path) \
        in found.stdout
    assert "`ferrus task cancel %s` ends it" % ferrus.short_task_id(task) in found.stdout
    assert "git branch keep-%s %s" % (ferrus.short_task_id(task), branch) in found.stdout
    # --fix does not cancel a task behind the user's back
    assert cli(repo, "doctor", "--fix").returncode == 1
    assert ferrus.read_task_record(store.dir, task)["status"] == "running"


def test_a_branch_the_git_branch_policy_made_for_a_task_in_the_checkout_is_not_ours(repo):
    edit_config(repo, 'branch = ""', 'branch = "ferrus/{task_id}"')
    git(repo, "branch", "ferrus/" + ferrus.new_id("t"))
    out = cli(repo, "doctor").stdout
    assert "leftover" not in out


def test_a_damaged_task_record_is_set_aside_and_rebuilt_without_losing_the_work(repo):
    store = ferrus.Store(repo)
    task, path, branch = start_task(store, "Important work.")
    queued = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Not started yet.").data["task_id"]
    for name in (task, queued):
        with open(ferrus.task_record_path(store.dir, name), "w") as handle:
            handle.write("{torn")
    found = cli(repo, "doctor")
    assert found.returncode == 0
    assert ".ferrus/tasks/%s/task.json is damaged" % task in found.stdout
    assert ".ferrus/tasks/%s/task.json is damaged" % queued in found.stdout
    assert "leftover" not in found.stdout          # its worktree is not taken for an orphan
    fixed = cli(repo, "doctor", "--fix")
    assert fixed.returncode == 0, fixed.stdout
    folder = os.path.join(store.dir, "tasks", task)
    assert any(name.startswith("task.json.corrupt-") for name in os.listdir(folder))
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "failed" and record["title"] == "Important work."
    assert record["worktree"] == path and record["branch"] == branch
    assert "was damaged" in record["reason"]
    # a task that never ran goes back in the queue
    assert ferrus.read_task_record(store.dir, queued)["status"] == "queued"
    again = cli(repo, "doctor").stdout
    assert ".json is damaged" not in again and "is kept for a look" in again


def test_a_damaged_task_state_is_set_aside_and_the_task_failed(repo):
    store = ferrus.Store(repo)
    task, path, branch = start_task(store)
    task_store = store.for_task(task)
    with open(task_store.task_path("STATE.json"), "w") as handle:
        handle.write("not json")
    found = cli(repo, "doctor")
    assert "warning: task %s: " % task in found.stdout
    assert "mark the task failed" in found.stdout
    fixed = cli(repo, "doctor", "--fix")
    assert fixed.returncode == 0, fixed.stdout
    data = task_store.read_state()
    assert data.state == S.FAILED and "was damaged" in data.failure_reason
    assert data.task_id == task
    assert ferrus.read_task_record(store.dir, task)["status"] == "failed"
    assert any(n.startswith("STATE.json.corrupt-") for n in os.listdir(task_store.task_dir))
    entries = store.read_journal()
    assert entries[-1]["event"] == "doctor" and entries[-1]["task_id"] == task
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
    assert os.path.isdir(path)                       # the work stays


def write_run(store, **record):
    ferrus.atomic_write(store.path("parallel.json"), json.dumps(record))


def test_a_parallel_run_that_stopped_part_way_is_a_note(repo):
    store = ferrus.Store(repo)
    write_run(store, phase=4, pid=999999, ended=False, updated_at="2026-11-24T06:00:00Z")
    ferrus.op_enqueue_task(store, ferrus.HUMAN, "Left for the next run.")
    found = cli(repo, "doctor")
    assert found.returncode == 0
    assert "info: .ferrus/parallel.json: a parallel run (pid 999999, last seen " \
           "2026-11-24T06:00:00Z) stopped while waiting for the agents' work, unfinished" in \
        found.stdout
    assert "P4" not in found.stdout                     # phase codes are not for people
    assert "goes on from there with the 1 task(s) left" in found.stdout
    cli(repo, "doctor", "--fix")
    assert os.path.exists(store.path("parallel.json"))


def test_a_stale_parallel_run_with_nothing_left_is_deleted_and_a_damaged_one_set_aside(repo):
    store = ferrus.Store(repo)
    write_run(store, phase=5, pid=999999, ended=False)
    fixed = cli(repo, "doctor", "--fix")
    assert "no task is left for it" in fixed.stdout and "fixed: delete it" in fixed.stdout
    assert not os.path.exists(store.path("parallel.json"))
    ferrus.atomic_write(store.path("parallel.json"), "[1, 2")
    assert ".ferrus/parallel.json is damaged" in cli(repo, "doctor").stdout
    cli(repo, "doctor", "--fix")
    assert any(n.startswith("parallel.json.corrupt-") for n in os.listdir(store.dir))
    # a finished run is not stale
    write_run(store, phase=7, pid=999999, ended=True)
    assert "parallel.json" not in cli(repo, "doctor").stdout


def test_a_live_parallel_run_is_not_stale(repo):
    store = ferrus.Store(repo)
    with ferrus.OrchestratorLock(store, "ferrus run"):
        write_run(store, phase=4, pid=os.getpid(), ended=False)
        assert ferrus.live_parallel_run(store)["pid"] == os.getpid()
        assert "parallel.json" not in cli(repo, "doctor").stdout
    assert ferrus.live_parallel_run(store) is None


def test_doctor_reports_a_worktree_dir_inside_the_repository_and_a_missing_target(git_project):
    """The [parallel] settings `ferrus run --parallel` refuses: warnings, errors once
    max_tasks > 1 makes every `ferrus run` parallel."""
    scripted_setup(git_project, ["test -f README.md"])
    base = scripted_config(["test -f README.md"])
    set_config(git_project, base + '\n[parallel]\nworktree_dir = "trees"\ntarget = "nope"\n')
    findings = {f.problem: f for f in ferrus.doctor_findings(str(git_project))}
    inside = [f for p, f in findings.items() if "worktree_dir" in p]
    target = [f for p, f in findings.items() if "target" in p and "nope" in p]
    assert len(inside) == 1 and "not git-ignored" in inside[0].problem
    assert "/trees/" in inside[0].repair and inside[0].severity == "warning"
    assert len(target) == 1 and target[0].severity == "warning"
    # with max_tasks > 1 every `ferrus run` is parallel: both are errors
    set_config(git_project, base + '\n[parallel]\nmax_tasks = 2\nworktree_dir = "trees"\n'
               'target = "nope"\n')
    done = run_cli("doctor", cwd=git_project)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "worktree_dir" in done.stdout + done.stderr and '"nope"' in done.stdout + done.stderr
    # ignored, and an existing branch: nothing to report
    (git_project / ".gitignore").write_text("/trees/\n")
    git(git_project, "branch", "nope")
    assert not [f for f in ferrus.doctor_findings(str(git_project))
                if "[parallel]" in f.problem]
