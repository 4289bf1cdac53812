"""Damaged per-task records (.ferrus/tasks/<id>/task.json) and a damaged or stale
.ferrus/parallel.json, as fuzzing them against a real `ferrus run --parallel`, `ferrus
tasks`, `ferrus status`, `ferrus doctor` and HQ's task board found them: a field of the
wrong type crashed the run or a view with a traceback, a bad status or worktree left a task
running for good or blocked the merge queue, a target in parallel.json naming a deleted
branch blocked every run.  Now a damaged record is a clear error for that task only (the
run leaves it alone, writes nothing over it, the other tasks go on, exit 1), every view
says "damaged" with the repair, and `ferrus doctor --fix` repairs it."""

import io
import json
import os
import subprocess

import pytest

import ferrus
from conftest import enqueue, git, run_cli, scripted_setup, statuses
from test_parallel import crash_state

S = ferrus.TaskState


def prepared(store, text):
    """A task RUNNING in its own worktree, Executing, as the runner's P2 leaves it (no agent
    at work on it)."""
    task = enqueue(store, text)
    runner = ferrus.ParallelRunner(store, lambda message: None, 2)
    runner.repo = ferrus.git_repository(store.root)
    runner.target = "main"
    runner.worktree_dir = ferrus.default_worktree_dir(store.root)
    assert runner._prepare_task(task)
    return task


def damage(store, task, change):
    """Apply ``change`` (a function of the record, or the file's new text) to task.json."""
    path = ferrus.task_record_path(store.dir, task)
    record = json.loads(open(path).read())
    text = change if isinstance(change, str) else json.dumps(change(record))
    with open(path, "w") as handle:
        handle.write(text)
    return text


def setting(key, value):
    def change(record):
        record[key] = value
        return record
    return change


def cli(root, *args, stdin=None):
    done = run_cli(*args, cwd=root, input=stdin, timeout=240)
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


def in_process(capsys, root, *args):
    """`ferrus ARGS` as ferrus.main in this process, returned as cli() returns a program's
    end: what a view or doctor says of a damaged record is the point, not starting a
    program (each run that meets the damage is a real `ferrus run`)."""
    capsys.readouterr()
    code = ferrus.main(["-C", str(root)] + list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return subprocess.CompletedProcess(list(args), code, out, err)


# -- what the validation calls damaged ------------------------------------------------------

TASK = "t-20260101T000000-abcdef"
WORKTREE = "/work/repo.ferrus-worktrees/" + TASK
GOOD = {"id": TASK, "title": "T", "status": "running", "created_at": "2026-01-01T00:00:00Z",
        "origin": {"by": "human", "spec": "specs/a.md", "milestone": "m1"}, "agent": "codex",
        "worktree": WORKTREE, "workdir": WORKTREE + "/svc", "branch": "ferrus/" + TASK,
        "base": "0" * 40, "target": "main", "store": "worktree",
        "integration": {"candidate": "1" * 40, "target_head": "2" * 40},
        "conflicts": ["a.txt"], "conflict_base": "3" * 40, "reason": "r",
        "merged_commit": "4" * 40}


@pytest.mark.parametrize("key, value, said", [
    ("status", 5, "status 5 is none of"), ("status", ["running"], "status [\"running\"]"),
    ("status", {"a": 1}, "status {"), ("status", None, "status null"),
    ("status", "bogus", "status \"bogus\""),
    ("worktree", 5, "worktree is 5, not text"), ("worktree", "", "worktree \"\" is no abs"),
    ("worktree", "relative/" + TASK, "is no absolute path"),
    ("worktree", "/etc", "is not inside its worktree"),
    ("workdir", "/elsewhere/" + TASK, "is not inside its worktree"),
    ("branch", 5, "branch is 5"), ("branch", "main", "is not the task's branch"),
    ("base", ["x"], "base is [\"x\"]"), ("base", "not a commit", "is no commit id"),
    ("target", 5, "target is 5"), ("target", "..bad", "is no branch name"),
    ("origin", "str", "origin is \"str\", not an object"),
    ("origin", {"spec": 5}, "origin.spec is 5"),
    ("agent", 5, "agent is 5"), ("agent", ["x"], "agent is [\"x\"]"),
    ("integration", "str", "integration is \"str\""),
    ("integration", {"candidate": 5}, "integration.candidate is 5"),
    ("conflicts", "a.txt", "conflicts is \"a.txt\", not a list"),
    ("conflicts", [5], "conflicts is [5]"), ("conflict_base", 5, "conflict_base is 5"),
    ("title", ["x"], "title is [\"x\"]"), ("title", "x" * 70000, "title is 70000 char"),
    ("created_at", 5, "created_at is 5"), ("store", "somewhere", "store \"somewhere\""),
    ("id", "t-20260101T000000-ffffff", "is not the task's own"),
    ("reason", 5, "reason is 5"), ("merged_commit", 5, "merged_commit is 5"),
    ("copied", ".env", "copied is \".env\", not a list"), ("copied", [""], "copied is"),
    ("port", 70000, "port is 70000"), ("port", True, "port is true"),
    ("race", "r-1", "race is \"r-1\", not an object"),
    ("race", {"attempt": "1"}, "race.attempt is \"1\", not a number"),
    ("push", {"status": 5}, "push.status is 5"),
    ("published", {"branch": ["x"]}, "published.branch is"),
    ("model", 5, "model is 5"), ("lost_to", 5, "lost_to is 5"),
])
def test_a_field_ferrus_never_writes_makes_the_record_damaged(key, value, said):
    assert ferrus.task_record_problem(TASK, GOOD) is None
    problem = ferrus.task_record_problem(TASK, dict(GOOD, **{key: value}))
    assert problem and said in problem, problem


def test_what_ferrus_writes_is_never_called_damaged(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    queued = enqueue(store, "Queued.")
    running = prepared(store, "Running.")
    ferrus.op_cancel_task(store, ferrus.HUMAN, running)
    ferrus.op_retry_task(store, ferrus.HUMAN, running)
    for task in (queued, running):
        record, problem = ferrus.load_task_record(store.dir, task)
        assert problem is None and record["status"] == "queued"
    assert ferrus.task_record_problem(TASK, {"status": "queued"}) is None   # only a status
    assert ferrus.task_record_problem(TASK, dict(GOOD, worktree=None, workdir=None)) == \
        "it is running in a worktree but names no worktree"
    assert ferrus.task_record_problem(TASK, [1, 2]) == "not a JSON object"


# -- a real run with one damaged task among good ones ----------------------------------------

# (what is damaged, the task's stage, the damage, how `ferrus run --parallel` went before)
CASES = [
    ("status a list", "queued", setting("status", ["running"]), "`ferrus status` traceback"),
    ("origin text", "queued", setting("origin", "by hand"), "every run: traceback"),
    ("worktree a number", "queued", setting("worktree", 5), "every run: traceback"),
    ("agent a number", "queued", setting("agent", 5), "run, status and HQ: traceback"),
    ("status unknown", "running", setting("status", "bogus"), "left running for good"),
    ("worktree elsewhere", "running", setting("worktree", "/etc"),
     "the merge queue stuck on it, the run timed out"),
    ("integration text", "running", setting("integration", "x"), "every run: traceback"),
    ("not an object", "running", "[1, 2]", "left running for good"),
    ("over 1 MiB", "running", lambda r: dict(r, reason="x" * (1 << 20)),
     "left running for good"),
]


@pytest.mark.parametrize("what, stage, change, before", CASES, ids=[c[0] for c in CASES])
def test_a_damaged_task_is_left_alone_and_the_other_tasks_go_on(git_project, capsys, what,
                                                                 stage, change, before):
    store = scripted_setup(git_project, ["test -f README.md"])
    bad = prepared(store, "Bad.\n\nWRITE bad.txt: bad\n") if stage == "running" else \
        enqueue(store, "Bad.\n\nWRITE bad.txt: bad\n")
    good = enqueue(store, "Good.\n\nWRITE good.txt: good\n")
    text = damage(store, bad, change)
    done = cli(git_project, "run", "--parallel", "2", "--timeout", "200")
    out = done.stdout + done.stderr
    assert done.returncode == ferrus.RUN_FAILED, out
    assert ferrus.read_task_record(store.dir, good)["status"] == "merged", out
    assert "good.txt" in git(git_project, "ls-tree", "-r", "--name-only", "main").stdout
    assert "bad.txt" not in git(git_project, "ls-tree", "-r", "--name-only", "main").stdout
    problem = ferrus.load_task_record(store.dir, bad)[1]
    assert "task %s: its .ferrus/tasks/%s/task.json is damaged (%s)" % (bad, bad, problem) \
        in out and "`ferrus doctor --fix`" in out and "this run leaves the task alone" in out
    assert "report: 1 merged, 1 with a damaged task.json" in out
    assert open(ferrus.task_record_path(store.dir, bad)).read() == text   # nothing written
    # every view says so, with the repair, and none breaks
    for view in (["tasks"], ["status"]):
        shown = in_process(capsys, git_project, *view)
        assert shown.returncode == 0 and "damaged" in shown.stdout, shown.stdout
        assert "`ferrus doctor --fix` repairs it" in shown.stdout
    if stage == "running":      # the checkout's state mirrors it
        assert "(parallel task, its task.json is damaged: `ferrus doctor --fix` repairs " \
            "it;" in in_process(capsys, git_project, "status").stdout
    listed = json.loads(in_process(capsys, git_project, "tasks", "--json").stdout)
    assert any(row["id"] == bad and row["problem"] == problem for row in (
        listed["tasks"] if isinstance(listed, dict) else listed))
    board = io.StringIO()
    shell = ferrus.HqShell(ferrus.Store(git_project), stdin=io.StringIO(), stdout=board)
    try:
        shell.handle("/tasks")
    finally:
        shell.shutdown()
    assert "damaged" in board.getvalue(), board.getvalue()
    doctor = in_process(capsys, git_project, "doctor")
    assert "%s/%s/%s is damaged (%s)" % (".ferrus/tasks", bad, "task.json", problem) in \
        doctor.stdout, doctor.stdout
    # doctor --fix repairs it: a task that had started is failed with its worktree kept
    # (retry goes on there), one that had not is queued again
    fixed = in_process(capsys, git_project, "doctor", "--fix")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    record, problem = ferrus.load_task_record(store.dir, bad)
    assert problem is None and record["title"] == "Bad."
    assert record["status"] == ("failed" if stage == "running" else "queued")
    assert [name for name in os.listdir(os.path.dirname(ferrus.task_record_path(
        store.dir, bad))) if name.startswith("task.json.corrupt-")]


def test_a_task_repaired_by_doctor_is_retried_and_merged(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    bad = prepared(store, "Bad.\n\nWRITE bad.txt: bad\n")
    damage(store, bad, setting("integration", "x"))
    assert cli(git_project, "doctor", "--fix").returncode == 0
    assert cli(git_project, "task", "retry", ferrus.short_task_id(bad)).returncode == 0
    done = cli(git_project, "run", "--parallel", "2", "--timeout", "200")
    assert done.returncode == 0, done.stdout + done.stderr
    assert statuses(store) == {bad: "merged"}
    assert "bad.txt" in git(git_project, "ls-tree", "-r", "--name-only", "main").stdout


def test_doctor_keeps_the_end_of_a_task_that_had_ended(git_project):
    """A merged task whose record was damaged came back as failed, and retry would have
    run it again."""
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "Done.\n\nWRITE d.txt: d\n")
    assert cli(git_project, "run", "--parallel", "2", "--timeout", "200").returncode == 0
    merged = ferrus.read_task_record(store.dir, task)
    damage(store, task, setting("agent", 5))
    assert cli(git_project, "doctor", "--fix").returncode == 0
    record, problem = ferrus.load_task_record(store.dir, task)
    assert problem is None and record["status"] == "merged"
    for key in ("merged_commit", "ended_at", "target", "created_at", "origin"):
        assert record[key] == merged[key]
    assert "agent" not in record


def test_doctor_keeps_the_race_an_attempt_belongs_to(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    tasks = ferrus.op_enqueue_race(store, ferrus.HUMAN, "Race.", [
        ("scripted", "m1"), ("scripted", "")]).data["tasks"]
    before = ferrus.read_task_record(store.dir, tasks[0])
    damage(store, tasks[0], setting("title", ["x"]))
    assert cli(git_project, "doctor", "--fix").returncode == 0
    record, problem = ferrus.load_task_record(store.dir, tasks[0])
    assert problem is None and record["status"] == "queued"
    assert record["race"] == before["race"] and record["model"] == "m1"


def test_cancel_and_retry_write_nothing_over_a_damaged_record(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    queued, running = enqueue(store, "Queued."), prepared(store, "Running.")
    for task in (queued, running):
        text = damage(store, task, setting("origin", 5))
        for verb in ("cancel", "retry"):
            done = cli(git_project, "task", verb, ferrus.short_task_id(task))
            assert done.returncode == 1
            assert "ferrus: task %s: its .ferrus/tasks/%s/task.json is damaged (origin is 5, " \
                "not an object)" % (task, task) in done.stderr, done.stderr
            assert "`ferrus doctor --fix` keeps it as task.json.corrupt-<time>" in done.stderr
            assert open(ferrus.task_record_path(store.dir, task)).read() == text
    assert store.for_task(running).read_state().state == S.EXECUTING


def test_one_at_a_time_in_the_checkout_a_damaged_task_is_said_and_skipped(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    bad, good = enqueue(store, "Bad."), enqueue(store, "Good.\n\nWRITE good.txt: good\n")
    text = damage(store, bad, "[1, 2]")
    done = cli(git_project, "run", "--timeout", "200")          # [parallel] max_tasks = 1
    assert done.returncode == ferrus.RUN_FAILED, done.stdout + done.stderr
    assert "ferrus run: task %s: its .ferrus/tasks/%s/task.json is damaged (not a JSON " \
        "object) — this run leaves the task alone" % (bad, bad) in done.stdout
    assert ferrus.read_task_record(store.dir, good)["status"] == "done"
    assert open(ferrus.task_record_path(store.dir, bad)).read() == text


def test_a_record_damaged_while_its_task_runs_stops_only_that_task(git_project):
    import time
    store = scripted_setup(git_project, ["test -f README.md"])
    bad = enqueue(store, "Bad.\n\nWRITE bad.txt: bad\n")
    good = enqueue(store, "Good.\n\nWRITE good.txt: good\n")
    lines = []
    runner = ferrus.ParallelRunner(store, lambda message: lines.append(message.text), 2)
    try:
        runner.start()
        deadline = time.monotonic() + 120
        while bad not in runner.controllers:
            assert time.monotonic() < deadline, "\n".join(lines)
            runner.step()
        damage(store, bad, setting("status", 7))
        while not runner.finished:
            assert time.monotonic() < deadline, "\n".join(lines)
            runner.step()
            time.sleep(0.01)
    finally:
        runner.shutdown()
    assert bad not in runner.controllers and runner.damaged == {
        bad: "status 7 is none of queued, running, merged, done, unchanged, published, failed, cancelled"}
    assert ferrus.read_task_record(store.dir, good)["status"] == "merged"
    assert runner.exit_code() == ferrus.RUN_FAILED
    assert sum("is damaged" in line for line in lines) == 1        # said once
    assert json.loads(open(ferrus.task_record_path(store.dir, bad)).read())["status"] == 7


# -- .ferrus/parallel.json ------------------------------------------------------------------

@pytest.mark.parametrize("saved, said", [
    ({"phase": 3, "target": "main", "batch": 5, "dispatch": [], "ended": False, "pid": 1},
     "batch is 5, not a list of task ids"),
    ({"phase": 4, "target": "main", "batch": [], "dispatch": 5, "ended": False, "pid": 1},
     "dispatch is 5, not a list of dispatch records"),
    ({"phase": 3, "target": "main", "batch": "abc", "dispatch": [], "ended": False, "pid": 1},
     "batch is \"abc\""),
    ({"phase": 4, "target": 5, "batch": [], "dispatch": [], "ended": False, "pid": 1},
     "target 5 is no branch name"),
    ({"phase": "4", "target": "main", "batch": [], "dispatch": [], "ended": False, "pid": 1},
     "phase \"4\" is none of 0 to 7"),
], ids=["batch a number", "dispatch a number", "batch text", "target a number", "phase text"])
def test_a_damaged_parallel_json_is_set_aside_by_the_run_and_by_doctor(git_project, saved,
                                                                       said):
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    ferrus.atomic_write(store.path(ferrus.PARALLEL_RUN_FILE), json.dumps(saved))
    doctor = cli(git_project, "doctor")
    assert ".ferrus/parallel.json is damaged (%s" % said in doctor.stdout, doctor.stdout
    done = cli(git_project, "run", "--parallel", "2", "--timeout", "200")
    assert done.returncode == 0, done.stdout + done.stderr
    assert ".ferrus/parallel.json is damaged (%s" % said in done.stdout
    assert "this run starts afresh (" in done.stdout
    assert statuses(store) == {task: "merged"}


def test_a_parallel_run_whose_target_branch_was_deleted_no_longer_blocks_every_run(
        git_project):
    """The interrupted run merged into a branch deleted since: every later run refused
    ("there is no branch ... to merge tasks into") until parallel.json was removed by hand."""
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    git(git_project, "branch", "release")
    crash_state(store, 4, [])
    saved = json.loads(open(store.path(ferrus.PARALLEL_RUN_FILE)).read())
    ferrus.atomic_write(store.path(ferrus.PARALLEL_RUN_FILE),
                        json.dumps(dict(saved, target="release")))
    git(git_project, "branch", "-D", "release")
    doctor = cli(git_project, "doctor")
    assert "merged into release, which is no branch any more" in doctor.stdout, doctor.stdout
    done = cli(git_project, "run", "--parallel", "2", "--timeout", "200")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the interrupted run merged into release, which is no branch any more: the " \
        "tasks now merge into main" in done.stdout
    assert statuses(store) == {task: "merged"}
    assert "t.txt" in git(git_project, "ls-tree", "-r", "--name-only", "main").stdout
    # and doctor --fix sets such a file aside
    crash_state(store, 4, [])
    ferrus.atomic_write(store.path(ferrus.PARALLEL_RUN_FILE),
                        json.dumps(dict(saved, target="gone")))
    assert cli(git_project, "doctor", "--fix").returncode == 0
    assert not os.path.exists(store.path(ferrus.PARALLEL_RUN_FILE))
