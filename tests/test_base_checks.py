"""The gate is tried before any agent starts: `ferrus run` (one task, the queue, or
`--parallel N`) and HQ's /run run the checks once on the untouched base — the checkout
as it is, or a clean checkout of the target's head after [parallel] setup — and stop on
a command that cannot run or a base already red, with the command, its last lines and a
hint; `--allow-red-base` goes on and tells the executor what failed before it began.  A
green verdict is kept per commit and commands.  `ferrus doctor` reports a [checks]
program that is not found.

Real runs with the scripted agents (tests/scripted_agent.py).
"""

import glob
import io
import json
import os

import ferrus
from conftest import (SCRIPTED_CONFIG, SCRIPTED_CHECK, enqueue, git, run_cli, scripted_project,
                      scripted_setup, set_config)

MISSING = "nosuchtool-for-ferrus --version"


def cli(root, *args, tmp_path=None, timeout=240):
    env = {"SCRIPTED_BEHAVIOR": ""}
    if tmp_path is not None:
        env["SCRIPTED_DIR"] = str(tmp_path / "memory")
    return run_cli(*args, cwd=root, env=env, timeout=timeout)


def with_checks(commands):
    return SCRIPTED_CONFIG.replace("commands = [%s]" % json.dumps(SCRIPTED_CHECK),
                                   "commands = %s" % json.dumps(commands))


def base_runs(root):
    """How many times the checks ran on a base (their summary logs are attempt 0)."""
    return len(glob.glob(os.path.join(str(root), ".ferrus", "logs", "check_0_*.txt")))


def test_a_check_command_that_cannot_run_stops_the_run_before_any_agent(project, tmp_path):
    store = scripted_project(project, tmp_path / "memory")
    set_config(project, with_checks([SCRIPTED_CHECK, MISSING]))
    done = cli(project, "run", "--task", "Make work.txt", tmp_path=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ferrus: no agent was started: the checks already fail on the project folder" \
        in done.stderr
    assert "hint: `%s` could not run: fix it in [checks] of ferrus.toml" % MISSING in done.stderr
    assert "--allow-red-base" not in done.stderr     # it would not help: see below
    out = done.stdout
    assert "ferrus run: the checks fail on the project folder, before any agent started:" in out
    assert "    check failed: %s (exit 127: the command could not run — not found or not " \
           "executable); log .ferrus/logs/check_0_" % MISSING in out
    assert "        │ " in out and "not found" in out.split(MISSING, 2)[-1]
    # Nothing started: no task, no agent session.
    assert store.read_state().state == ferrus.S.IDLE
    assert not [e for e in store.read_journal() if e["event"] == "create_task"]
    assert ferrus.read_session_records(store) == []
    # --allow-red-base starts on failing checks, never on one that cannot run.
    done = cli(project, "run", "--allow-red-base", "--task", "Make work.txt",
               tmp_path=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ferrus: no agent was started: `%s` cannot run on the project folder (exit 127)" \
        % MISSING in done.stderr
    assert "not on a check that cannot run at all" in done.stderr
    assert "going on anyway" not in done.stdout
    assert ferrus.read_session_records(store) == []


def test_allow_red_base_goes_on_and_the_executor_is_told_what_failed_before(project,
                                                                           tmp_path):
    store = scripted_project(project, tmp_path / "memory")
    # Red before the task (no work.txt yet), green once the executor wrote it.
    set_config(project, with_checks(["test -f work.txt"]))
    refused = cli(project, "run", "--task", "Make work.txt", tmp_path=tmp_path)
    assert refused.returncode == 1 and "hint: fix what fails" in refused.stderr
    done = cli(project, "run", "--allow-red-base", "--task", "Make work.txt",
               tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ferrus run: going on anyway (--allow-red-base): the executor is told which " \
           "checks failed before it began" in done.stdout
    assert "Reviewing → Complete" in done.stdout
    task = store.read_file("TASK.md")
    assert task.startswith("Make work.txt\n\n---\nNote from ferrus: before this task started, "
                           "these checks already failed on its base (the project folder)")
    assert "- `test -f work.txt` (exit 1)" in task


def test_a_green_base_is_checked_once_per_commit_and_a_changed_checkout_every_time(
        git_project, tmp_path, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "")
    root = git_project
    scripted_project(root, tmp_path / "memory")
    with open(os.path.join(str(root), ".gitignore"), "a") as handle:
        handle.write("work.txt\n")                   # the executor's work keeps it clean
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    head = git(root, "rev-parse", "HEAD").stdout.strip()
    first = cli(root, "run", "--task", "Make work.txt", tmp_path=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "ferrus run: running the checks on the checkout (main at %s) before any agent " \
           "starts (1 command; a pass is kept for this commit)" % head[:12] in first.stdout
    assert "ferrus run: the checks pass on the checkout (main at %s)\n" % head[:12] \
        in first.stdout
    assert base_runs(root) == 1
    again = cli(root, "run", "--task", "Make work.txt again", tmp_path=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "ferrus run: the checks pass on the checkout (main at %s) (as when checked " \
           % head[:12] in again.stdout
    assert "running the checks" not in again.stdout and base_runs(root) == 1
    kept = json.loads(open(os.path.join(str(root), ".ferrus", "base-checks.json")).read())
    assert [(e["commit"], e["commands"], e["passed"]) for e in kept["checks"]] == [
        (head, [SCRIPTED_CHECK], True)]
    # An uncommitted change: the checkout is checked as it is, every time.
    with open(os.path.join(str(root), "notes.txt"), "w") as handle:
        handle.write("mine\n")
    for _ in range(2):
        done = cli(root, "run", "--task", "Make work.txt once more", tmp_path=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "running the checks on the checkout (main at %s, with 1 changed file)" \
            % head[:12] in done.stdout
    assert base_runs(root) == 3


def test_json_mode_reports_the_red_base_as_an_event(project, tmp_path):
    scripted_project(project, tmp_path / "memory")
    set_config(project, with_checks([MISSING]))
    done = cli(project, "run", "--json", "--task", "Make work.txt", tmp_path=tmp_path)
    assert done.returncode == 1
    events = [json.loads(line) for line in done.stdout.splitlines()]   # only JSON
    red = next(e for e in events if e["event"] == "base_checks" and "passed" in e)
    assert red["passed"] is False and red["level"] == "error" and red["commit"] is None
    assert red["failed"][0]["command"] == MISSING and red["failed"][0]["exit"] == 127


def test_the_queue_in_the_checkout_keeps_its_task_when_the_base_is_red(project, tmp_path):
    store = scripted_project(project, tmp_path / "memory")
    set_config(project, with_checks([MISSING]))
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Make work.txt").data["task_id"]
    done = cli(project, "run", tmp_path=tmp_path)
    assert done.returncode == 1 and "no agent was started" in done.stderr
    assert ferrus.read_task_record(store.dir, task)["status"] == "queued"
    assert ferrus.read_session_records(store) == []


def test_a_parallel_run_tries_the_checks_on_a_clean_checkout_of_the_target(git_project):
    store = scripted_setup(git_project, ["test -f README.md", "test -f alpha.txt"])
    head = git(git_project, "rev-parse", "main").stdout.strip()
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    # An untracked file in the user's checkout is not in the clean checkout.
    with open(os.path.join(str(git_project), "alpha.txt"), "w") as handle:
        handle.write("only here\n")
    done = cli(git_project, "run", "--parallel", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ferrus: no agent was started: the checks already fail on main at %s" % head[:12] \
        in done.stderr
    assert "    check failed: test -f alpha.txt (exit 1); log .ferrus/logs/check_0_" \
        in done.stdout
    assert ferrus.read_task_record(store.dir, task)["status"] == "queued"
    # Nothing of the run is left: no task worktree or branch, no temporary checkout.
    assert git(git_project, "worktree", "list", "--porcelain").stdout.count("worktree ") == 1
    assert git(git_project, "branch", "--list", "ferrus/*").stdout.strip() == ""
    folder = ferrus.default_worktree_dir(str(git_project))
    assert not os.path.isdir(folder) or not os.listdir(folder)
    os.remove(os.path.join(str(git_project), "alpha.txt"))
    # Going on anyway: the task's executor reads which checks failed before it began.
    done = cli(git_project, "run", "--parallel", "2", "--allow-red-base")
    assert done.returncode == 0, done.stdout + done.stderr
    assert ferrus.read_task_record(store.dir, task)["status"] == "merged"
    told = store.for_task(task).read_file("TASK.md")
    assert "these checks already failed on its base (main at %s)" % head[:12] in told
    assert "- `test -f alpha.txt` (exit 1)" in told


def test_hq_run_refuses_a_red_target_and_starts_no_agent(git_project):
    store = scripted_setup(git_project, ["test -f alpha.txt"])
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    try:
        shell.handle("/run 2")
        text = out.getvalue()
        assert "the checks fail on main at" in text and "test -f alpha.txt (exit 1)" in text
        assert "error: no agent was started: the checks already fail on main at" in text
        assert shell.runner is None and not shell.run_width
        assert ferrus.read_task_record(store.dir, task)["status"] == "queued"
    finally:
        shell.shutdown()


def test_doctor_reports_a_check_program_that_is_not_found(project):
    set_config(project, '[checks]\ncommands = ["test -d .", %s, "./scripts/lint.sh"]\n'
               % json.dumps(MISSING))
    done = cli(project, "doctor")
    assert done.returncode == 1
    assert "error: ferrus.toml: [checks] command `%s` runs nosuchtool-for-ferrus, which is " \
           "not found (not on PATH)" % MISSING in done.stdout
    assert "error: ferrus.toml: [checks] command `./scripts/lint.sh` runs ./scripts/lint.sh, " \
           "which is not found (no such file in the project)" in done.stdout
    assert "`test -d .`" not in done.stdout
    os.makedirs(os.path.join(str(project), "scripts"))
    with open(os.path.join(str(project), "scripts", "lint.sh"), "w") as handle:
        handle.write("#!/bin/sh\n")
    os.chmod(os.path.join(str(project), "scripts", "lint.sh"), 0o755)
    assert "lint.sh" not in cli(project, "doctor").stdout
