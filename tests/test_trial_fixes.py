"""What the adversary trial of parallel tasks found outside the parallel runner: a queue
task used up by a config error, `ferrus serve` for an unknown task, `ferrus task retry`,
the plain views of a mirrored task, control characters in commit messages, the default
[parallel] block and doctor's [parallel] checks."""

import json
import os
import subprocess
import sys

import pytest

import ferrus
from conftest import SCRIPTED_AGENT, custom_agent_config, run_cli, set_config

S = ferrus.TaskState


def git(root, *args, check=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", "-c", "init.defaultBranch=main"] + list(args), cwd=str(root),
                          env=env, capture_output=True, text=True, check=check)


def config_text(checks, extra=""):
    return ("[checks]\ncommands = %s\n%s\n[limits]\nwait_timeout_secs = 5\n"
            "max_review_cycles = 3\n\n" % (json.dumps(checks), extra) +
            custom_agent_config("scripted", [sys.executable, SCRIPTED_AGENT, "{role}",
                                             "{mcp_config}"]))


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with ferrus initialised, the scripted agent in both roles, and
    everything committed on main."""
    root = tmp_path / "project"
    root.mkdir()
    for name in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv("GIT_%s_NAME" % name, "t")
        monkeypatch.setenv("GIT_%s_EMAIL" % name, "t@example.com")
    memory = tmp_path / "memory"
    memory.mkdir()
    monkeypatch.setenv("SCRIPTED_DIR", str(memory))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "")
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda m: None)
    set_config(root, config_text(["test -f README.md"]))
    ferrus.register_agents(str(root), {"supervisor": ("scripted", None),
                                       "executor": ("scripted", None)}, report=lambda m: None)
    (root / "README.md").write_text("hello\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    return root


def enqueue(store, text):
    return ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]


def statuses(store):
    return {row["id"]: row["status"] for row in ferrus.task_rows(store)}


def events(store, task=None):
    return [e["event"] for e in store.read_journal() if task is None or e["task_id"] == task]


# -- 1. a config error at `ferrus run` does not use up a queued task ----------------------

def test_a_config_that_does_not_load_takes_no_task_from_the_queue(repo):
    store = ferrus.Store(str(repo))
    first = enqueue(store, "One.\n\nWRITE one.txt: one\n")
    second = enqueue(store, "Two.\n\nWRITE two.txt: two\n")
    set_config(repo, config_text(["test -f README.md"], 'timeout_secs = "soon"\n'))
    lines = []
    with pytest.raises(ferrus.FerrusError) as refused:
        ferrus.run_queue(store, out=lines.append)
    assert "timeout_secs" in refused.value.message
    assert statuses(store) == {first: "queued", second: "queued"}
    assert "dispatch_task" not in events(store)
    set_config(repo, config_text(["test -f README.md"]))
    assert ferrus.run_queue(store, out=lines.append) == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {first: "done", second: "done"}


def test_a_run_that_raises_before_its_task_began_puts_the_task_back(repo, monkeypatch):
    store = ferrus.Store(str(repo))
    task = enqueue(store, "One.\n\nWRITE one.txt: one\n")

    def refused(*args, **kwargs):
        raise ferrus.FerrusError("the agents would not start")
    monkeypatch.setattr(ferrus, "run_loop", refused)
    with pytest.raises(ferrus.FerrusError):
        ferrus.run_queue(store, out=lambda line: None)
    assert statuses(store) == {task: "queued"}
    entry = [e for e in store.read_journal() if e["event"] == "requeue_task"][-1]
    assert entry["task_id"] == task and "would not start" in entry["detail"]["reason"]
    record = ferrus.read_task_record(store.dir, task)
    assert "store" not in record and "started_at" not in record


def test_a_task_left_running_without_a_state_is_recovered_not_failed(repo):
    store = ferrus.Store(str(repo))
    task = enqueue(store, "One.\n\nWRITE one.txt: one\n")
    # What a run killed between taking the task and creating it leaves behind.
    ferrus.update_task(store, ferrus.HUMAN, task, "dispatch_task",
                       {"status": "running", "store": "project"})
    lines = []
    assert ferrus.run_queue(store, out=lines.append) == ferrus.RUN_COMPLETE, "\n".join(lines)
    text = "\n".join(lines)
    assert "back in the queue" in text
    assert statuses(store) == {task: "done"}
    assert (repo / "one.txt").read_text() == "one\n"


def test_a_task_replaced_in_the_checkout_is_failed_with_a_reason(repo):
    store = ferrus.Store(str(repo))
    task = enqueue(store, "One.\n\nWRITE one.txt: one\n")
    ferrus.update_task(store, ferrus.HUMAN, task, "dispatch_task",
                       {"status": "running", "store": "project"})
    ferrus.op_create_task(store, ferrus.HUMAN, "One.", task_id=task)
    ferrus.op_force_reset(store, ferrus.HUMAN)
    ferrus.op_create_task(store, ferrus.HUMAN, "Something else.")
    ferrus.op_force_reset(store, ferrus.HUMAN)
    ferrus.run_queue(store, out=lambda line: None)
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "failed" and "`ferrus log`" in record["reason"]


# -- 2. `ferrus serve` for a session of a task that is not there ------------------------

def test_serve_refuses_a_session_of_an_unknown_or_unstarted_task(project):
    request = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}) + "\n"
    unknown = "t-20260101T000000-abcdef"
    done = run_cli("serve", "--role", "executor", "--session", unknown + ".s-1", cwd=project,
                   input=request)
    assert done.returncode == 1 and done.stdout == ""
    assert "not a task of this project" in done.stderr and "hint:" in done.stderr
    store = ferrus.Store(str(project))
    queued = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Later.").data["task_id"]
    done = run_cli("serve", "--role", "executor", cwd=project, input=request,
                   env={"FERRUS_SESSION": queued + ".s-2"})
    assert done.returncode == 1 and done.stdout == ""
    assert "has not started" in done.stderr
    # the project's own session is served as before
    done = run_cli("serve", "--role", "executor", "--session", "s-3", cwd=project,
                   input=request)
    assert done.returncode == 0 and '"result"' in done.stdout


# -- 3. `ferrus task retry ID` ----------------------------------------------------------

def committed(root, rev="main"):
    return sorted(git(root, "ls-tree", "-r", "--name-only", rev).stdout.split())


def test_a_failed_task_is_retried_in_its_kept_worktree_and_merged(repo, tmp_path):
    # [parallel] setup fails until the flag file exists: the task fails after its
    # worktree was made, which is kept.
    flag = tmp_path / "ready"
    set_config(repo, config_text(["test -f README.md"],
                                 "\n[parallel]\nsetup = [%s]\n" % json.dumps(
                                     "test -f '%s'" % flag)))
    git(repo, "commit", "-qam", "setup")
    store = ferrus.Store(str(repo))
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    lines = []
    # The setup fails on the target's clean checkout before the run too: going on anyway.
    assert ferrus.run_parallel(store, 2, timeout=240, out=lines.append,
                               allow_red_base=True) == ferrus.RUN_FAILED
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "failed" and "setup failed" in record["reason"]
    worktree = record["worktree"]
    assert os.path.isdir(worktree)
    # work done so far in the kept worktree
    with open(os.path.join(worktree, "early.txt"), "w") as handle:
        handle.write("early\n")
    flag.write_text("")
    done = run_cli("task", "retry", ferrus.short_task_id(task), cwd=repo)
    assert done.returncode == 0, done.stderr
    assert "queued again" in done.stdout and worktree in done.stdout
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "queued" and "reason" not in record
    assert record["worktree"] == worktree and record["branch"] == "ferrus/" + task
    assert store.for_task(task).read_state().state == S.IDLE
    retried = [e for e in store.read_journal() if e["event"] == "retry_task"]
    assert retried[-1]["task_id"] == task and retried[-1]["detail"]["was"] == "failed"
    lines = []
    code = ferrus.run_parallel(store, 2, timeout=240, out=lines.append)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "merged"}
    files = committed(repo)
    assert "alpha.txt" in files and "early.txt" in files


def test_retry_refuses_tasks_that_did_not_fail_and_works_from_hq(repo):
    store = ferrus.Store(str(repo))
    task = enqueue(store, "Queued.\n\nWRITE q.txt: q\n")
    with pytest.raises(ferrus.FerrusError) as refused:
        ferrus.op_retry_task(store, ferrus.HUMAN, task)
    assert "is queued, not failed or cancelled" in refused.value.message
    ferrus.op_cancel_task(store, ferrus.HUMAN, task, remove_worktree=True)
    import io
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
    done = run_cli("task", "retry", task, cwd=repo)
    assert done.returncode == 1 and "already merged" in done.stderr


# -- 5. controls in commit messages -----------------------------------------------------

def test_commit_messages_carry_no_raw_control_characters(repo):
    message = ferrus.task_commit_message("t-1", "Red \x1b[31mtitle\x07 \x9b2J\r\nmore",
                                         "notes\x1b]52;c;eA==\x07\r\nline two\ttab\x7f")
    assert not any(ch in message for ch in "\x1b\x07\x9b\x7f\r")
    assert message.startswith("Red ^[[31mtitle^G \\x9b2J\n\nnotes^[]52;c;eA==^G\nline two\ttab^?")
    store = ferrus.Store(str(repo))
    task = enqueue(store, "Bell \x07 and \x1b[2J escape\n\nWRITE bell.txt: bell\n")
    lines = []
    assert ferrus.run_parallel(store, 1, timeout=240, out=lines.append) == \
        ferrus.RUN_COMPLETE, "\n".join(lines)
    log = git(repo, "log", "-1", "--format=%B", "main").stdout
    assert "Ferrus-Task: %s" % task in log
    assert "\x1b" not in log and "\x07" not in log and "Bell ^G and ^[[2J escape" in log


# -- 6. `ferrus init` writes a [parallel] block -------------------------------------------

def test_the_default_config_has_a_parallel_block_at_the_defaults(tmp_path):
    text = ferrus.default_config_text()
    assert "\n[parallel]\n" in text
    parsed = ferrus.parse_toml(text)["parallel"]
    defaults = ferrus.ParallelConfig()
    assert set(parsed) == {field.name for field in ferrus.dataclasses.fields(defaults)}
    for key, value in parsed.items():
        assert value == getattr(defaults, key), key
    root = tmp_path / "fresh"
    root.mkdir()
    ferrus.init_project(str(root), report=lambda m: None)
    config = ferrus.load_config(str(root))
    assert config.parallel == defaults and not config.unknown_keys


# -- 7. doctor reports the [parallel] settings `ferrus run --parallel` refuses ----------------

def test_doctor_reports_a_worktree_dir_inside_the_repository_and_a_missing_target(repo):
    base = config_text(["test -f README.md"])
    set_config(repo, base + '\n[parallel]\nworktree_dir = "trees"\ntarget = "nope"\n')
    findings = {f.problem: f for f in ferrus.doctor_findings(str(repo))}
    inside = [f for p, f in findings.items() if "worktree_dir" in p]
    target = [f for p, f in findings.items() if "target" in p and "nope" in p]
    assert len(inside) == 1 and "not git-ignored" in inside[0].problem
    assert "/trees/" in inside[0].repair and inside[0].severity == "warning"
    assert len(target) == 1 and target[0].severity == "warning"
    # with max_tasks > 1 every `ferrus run` is parallel: both are errors
    set_config(repo, base + '\n[parallel]\nmax_tasks = 2\nworktree_dir = "trees"\n'
               'target = "nope"\n')
    done = run_cli("doctor", cwd=repo)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "worktree_dir" in done.stdout + done.stderr and '"nope"' in done.stdout + done.stderr
    # ignored, and an existing branch: nothing to report
    (repo / ".gitignore").write_text("/trees/\n")
    git(repo, "branch", "nope")
    assert not [f for f in ferrus.doctor_findings(str(repo))
                if "[parallel]" in f.problem]


# -- 4. the plain views of a task STATE.json mirrors --------------------------------------

def test_plain_status_and_diff_show_the_mirrored_parallel_task(repo, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "ask")
    store = ferrus.Store(str(repo))
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    (repo / "mine.txt").write_text("the user's own change\n")
    lines = []
    code = ferrus.run_parallel(store, 2, timeout=240, out=lines.append)
    assert code == ferrus.RUN_NEEDS_HUMAN, "\n".join(lines)
    assert store.project_state().extra["mirrors_task"] == task
    assert ferrus.foreground_store(store).task == task
    done = run_cli("status", cwd=repo)
    assert done.returncode == 0, done.stderr
    assert "question  Which colour should the button be?" in done.stdout
    assert "QUESTION.md is empty" not in done.stdout
    assert "run --resume" not in done.stdout and "`ferrus run --parallel N`" in done.stdout
    assert "(parallel task, in its worktree" in done.stdout
    status = json.loads(run_cli("status", "--json", cwd=repo).stdout)
    assert status["parallel_task"] == task
    # the task's diff, in its worktree: never the user's own change in the checkout
    worktree = ferrus.read_task_record(store.dir, task)["worktree"]
    with open(os.path.join(worktree, "wip.txt"), "w") as handle:
        handle.write("work in progress\n")
    done = run_cli("diff", "--stat", cwd=repo)
    assert done.returncode == 0, done.stderr
    assert "wip.txt" in done.stdout and "mine.txt" not in done.stdout
    # answered, the run goes on and merges it: the views say so, not its deleted branch
    ferrus.op_answer(store.for_task(task), ferrus.HUMAN, "blue")
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "")
    code = ferrus.run_parallel(store, 2, timeout=240, out=lines.append)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    merged = ferrus.read_task_record(store.dir, task)["merged_commit"]
    done = run_cli("status", cwd=repo)
    assert "merged into main at %s" % merged[:12] in done.stdout
    assert "on branch ferrus/" not in done.stdout
    # Its diff, as the README says: what its merged commit changed (`git show` of it).
    shown = subprocess.run(["git", "show", "--format=", "--stat", merged], cwd=str(repo),
                           capture_output=True, text=True, check=True).stdout
    for args in (("diff", "--stat"), ("diff", "--stat", "--task",
                                      ferrus.short_task_id(task))):
        done = run_cli(*args, cwd=repo)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("Task %s merged into main at %s" % (
            ferrus.short_task_id(task), merged[:12]))
        assert shown.strip() in done.stdout
        assert "wip.txt" in done.stdout


def test_retrying_a_task_that_ran_in_the_checkout_queues_it_afresh(repo):
    store = ferrus.Store(str(repo))
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
