"""Parallel tasks end to end with scripted agents and real git repositories: the queue
worked N at a time, each task in its own worktree and branch, integrated through the merge
queue only when the checks pass on the merged result (ferrus run --parallel N)."""

import json
import os
import subprocess
import time

import pytest

import ferrus
from conftest import (FERRUS_CMD, committed, enqueue, git, run_tasks, scripted_config,
                      scripted_setup, set_config, statuses, wait_until)

S = ferrus.TaskState


def test_three_tasks_in_parallel_are_all_integrated_with_the_checks_green(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    tasks = [enqueue(store, "Add %s.\n\nWRITE %s.txt: %s\n" % (name, name, name))
             for name in ("alpha", "beta", "gamma")]
    code, lines = run_tasks(store, 3)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "merged" for task in tasks}
    files = committed(git_project)
    for name in ("alpha", "beta", "gamma"):
        assert "%s.txt" % name in files
        assert open(os.path.join(str(git_project), "%s.txt" % name)).read() == name + "\n"
    # the user's checkout followed the target, and is clean
    assert git(git_project, "status", "--porcelain", "--untracked-files=no").stdout == ""
    # every worktree and branch of a merged task is gone
    assert not [b for b in git(git_project, "branch", "--list", "ferrus/*").stdout.split() if b]
    for task in tasks:
        record = ferrus.read_task_record(store.dir, task)
        assert not os.path.exists(record["worktree"])
        assert store.for_task(task).read_state().state == S.COMPLETE
    text = "\n".join(lines)
    # per-task lines carry the task's short id; the three ran at once
    for task in tasks:
        assert "[%s]" % ferrus.short_task_id(task) in text
    entries = store.read_journal()
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
    phases = [e["detail"]["phase"] for e in entries if e["event"] == "phase"]
    assert phases[:4] == [1, 2, 3, 4] and phases[-2:] == [6, 7]
    for entry in entries:
        if entry["event"] == "phase":
            for field in ("tier", "action", "tool_calls", "turns", "tasks_completed",
                          "context_tokens_used", "context_tokens_max"):
                assert field in entry["detail"]
    # three executors ran at the same time: each started before any task was approved
    first_approve = min(e["seq"] for e in entries if e["event"] == "approve")
    creates = [e for e in entries if e["event"] == "create_task"]
    assert len(creates) == 3 and all(e["seq"] < first_approve for e in creates)


def test_two_tasks_editing_the_same_lines_the_second_goes_back_and_then_integrates(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    first = enqueue(store, "Greeting one.\n\nWRITE greeting.txt: hello from one\n")
    second = enqueue(store, "Greeting two.\n\nWRITE greeting.txt: hello from two\n")
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {first: "merged", second: "merged"}
    entries = store.read_journal()
    failed = [e for e in entries if e["event"] == "integration_failed"]
    assert len(failed) == 1 and failed[0]["detail"]["cause"] == "conflict"
    assert failed[0]["to"] == "Addressing" and "greeting.txt" in failed[0]["detail"]["files"]
    loser = failed[0]["task_id"]
    assert "conflicts with" in "\n".join(lines)
    # the loser's executor was told the cause; its side won the scripted resolution
    assert store.for_task(loser).read_state().review_cycles == 1
    assert open(os.path.join(str(git_project), "greeting.txt")).read() == \
        "hello from %s\n" % ("one" if loser == first else "two")
    # ferrus merged the target into the loser's branch itself, markers for the executor
    # to edit (no agent has to run git), and none of that reached the target
    handed = [e for e in entries if e["event"] == "conflict_handed_over"]
    assert handed and handed[0]["task_id"] == loser and handed[0]["detail"]["files"] == \
        ["greeting.txt"]
    history = git(git_project, "log", "-p", "main").stdout
    assert "<<<<<<<" not in history and ">>>>>>>" not in history
    assert "ferrus: main merged into" not in git(git_project, "log", "--format=%s", "main").stdout


def test_a_check_that_passes_alone_but_fails_after_the_merge_sends_the_task_back(git_project):
    # The check fails when both files exist: each task alone passes it.  The task sent
    # back fails it on every try: two tries end it (not the default 20).
    store = scripted_setup(git_project, ["test ! -f left.txt || test ! -f right.txt"],
                           extra="max_check_retries = 2\n")
    left = enqueue(store, "Left.\n\nWRITE left.txt: left\n")
    right = enqueue(store, "Right.\n\nWRITE right.txt: right\n")
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_FAILED, "\n".join(lines)
    result = statuses(store)
    merged = [t for t, s in result.items() if s == "merged"]
    failed = [t for t, s in result.items() if s == "failed"]
    assert len(merged) == 1 and len(failed) == 1
    entries = store.read_journal()
    causes = [e["detail"]["cause"] for e in entries if e["event"] == "integration_failed"]
    assert causes and set(causes) == {"checks"}
    # the target never went red: exactly one of the files is on it
    files = committed(git_project)
    assert ("left.txt" in files) != ("right.txt" in files)
    # the failed task's worktree is kept for a look
    record = ferrus.read_task_record(store.dir, failed[0])
    assert os.path.isdir(record["worktree"])


def test_max_tasks_one_queue_in_parallel_mode_takes_one_at_a_time(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    tasks = [enqueue(store, "Task %d.\n\nWRITE f%d.txt: %d\n" % (i, i, i)) for i in range(2)]
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE
    assert all(status == "merged" for status in statuses(store).values())


# -- dispatch gates in a run ---------------------------------------------------------------

def test_a_task_split_off_by_a_team_lead_to_an_agent_the_topology_refuses_fails(git_project):
    store = scripted_setup(git_project, ["test -f README.md"],
                           '[parallel]\ndelegates = ["scripted"]\n\n')
    lead = ferrus.Caller("supervisor", "supervisor:scripted:0/s-lead")
    ok = ferrus.op_enqueue_task(store, lead, "Fine.\n\nWRITE ok.txt: ok\n").data["task_id"]
    refused = ferrus.op_enqueue_task(store, lead, "Elsewhere.\n\nWRITE no.txt: no\n",
                                     agent="codex").data["task_id"]
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_FAILED
    assert statuses(store) == {ok: "merged", refused: "failed"}
    record = ferrus.read_task_record(store.dir, refused)
    assert "dispatch gate delegation" in record["reason"] and "codex" in record["reason"]
    gates = [e for e in store.read_journal() if e["event"] == "dispatch_gate"]
    assert gates[0]["detail"]["gate"] == "delegation" and gates[0]["detail"]["tasks"] == [refused]
    assert "no.txt" not in committed(git_project)


def crash_state(store, phase, batch, dispatched=()):
    """.ferrus/parallel.json as a run killed in ``phase`` leaves it."""
    ferrus.atomic_write(store.path(ferrus.PARALLEL_RUN_FILE), json.dumps({
        "phase": phase, "target": "main", "batch": list(batch),
        "dispatch": [dict(task_id=t, role="executor", agent="scripted", session_id="")
                     for t in dispatched], "ended": False, "pid": 1}))


def test_a_batch_larger_than_the_run_allows_sends_the_rest_back_to_the_queue(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    tasks = [enqueue(store, "T%d.\n\nWRITE t%d.txt: %d\n" % (i, i, i)) for i in range(3)]
    # A run with 3 slots was killed after it prepared its batch; this one has 2 slots.
    runner = ferrus.ParallelRunner(store, lambda m: None, 3)
    runner.start()
    runner.step()          # P1: the batch of 3
    runner.step()          # P2: prepared
    crash_state(store, 3, tasks)
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert all(status == "merged" for status in statuses(store).values())
    gates = [e["detail"] for e in store.read_journal() if e["event"] == "dispatch_gate"]
    assert gates and gates[0]["gate"] == "batch" and gates[0]["tasks"] == tasks[2:]
    requeued = [e["task_id"] for e in store.read_journal() if e["event"] == "requeue_task"]
    assert requeued == tasks[2:]


def test_a_task_chosen_but_never_prepared_is_not_dispatched_and_goes_back_to_the_queue(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    crash_state(store, 3, [task])          # chosen, but its worktree was never made
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    gates = [e["detail"] for e in store.read_journal() if e["event"] == "dispatch_gate"]
    assert gates[0]["gate"] == "coverage" and gates[0]["tasks"] == [task]
    assert statuses(store) == {task: "merged"}


# -- restart safety ------------------------------------------------------------------------

def phases_of(store):
    return [(e["detail"]["from_phase"], e["detail"]["phase"]) for e in store.read_journal()
            if e["event"] == "phase"]


def test_after_a_crash_P0_goes_only_to_the_interrupted_phase(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    runner = ferrus.ParallelRunner(store, lambda m: None, 2)
    runner.start()
    runner.step()          # P1 → P2
    runner.step()          # P2 → P3: prepared, not dispatched
    assert runner.machine.phase == 3
    del runner             # killed here: nothing shut down
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    moves = phases_of(store)
    resumed = moves.index((0, 3))
    assert (0, 1) not in moves[resumed:]
    assert statuses(store) == {task: "merged"}
    # the machine itself refuses any other way out of P0 after a crash
    machine = ferrus.PhaseMachine.resumed({"phase": 5})
    with pytest.raises(ferrus.InvalidPhaseTransition):
        machine.transition(1, ferrus.Signals(), ferrus.CapacityConfig())


def test_a_crash_after_the_fast_forward_is_finished_without_merging_twice(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    runner = ferrus.ParallelRunner(store, lambda m: None, 1)
    runner.start()
    # run until the target moved, then "crash" before the task is recorded Complete (the
    # transition is made right after the fast-forward, in the same transaction)
    real = ferrus.t_integrated
    import threading
    crashed = threading.Event()

    def crash(*args, **kwargs):
        crashed.set()
        raise KeyboardInterrupt("killed")
    ferrus.t_integrated = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in range(3000):
                runner.step()
                time.sleep(0.01)
    finally:
        ferrus.t_integrated = real
        for controller in runner.controllers.values():
            controller.shutdown()
    assert crashed.is_set()
    head = git(git_project, "rev-parse", "main").stdout.strip()
    assert store.for_task(task).read_state().state == S.INTEGRATING
    code, lines = run_tasks(store, 1)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert git(git_project, "rev-parse", "main").stdout.strip() == head     # not merged again
    assert statuses(store) == {task: "merged"}
    assert git(git_project, "log", "--oneline", "main").stdout.count("T.") == 1


def run_cli_until(git_project, event_test, env_extra=None, timeout=120):
    """Start `ferrus run --parallel 2` and SIGKILL it (and only it) once the journal
    holds an entry ``event_test`` accepts."""
    import signal
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.Popen(FERRUS_CMD + ["run", "--parallel", "2"],
                            cwd=str(git_project), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    store = ferrus.Store(str(git_project))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if any(event_test(e) for e in store.read_journal(limit=400)):
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                return
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.02)
        raise AssertionError("the run never reached the point to kill it")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def assert_all_merged_and_tidy(git_project, store, tasks, lines=()):
    assert statuses(store) == {task: "merged" for task in tasks}, "\n".join(lines)
    files = committed(git_project)
    for task in tasks:
        assert store.for_task(task).read_state().state == S.COMPLETE
    assert not [b for b in git(git_project, "branch", "--list", "ferrus/*").stdout.split() if b], \
        "\n".join(lines)
    listed = git(git_project, "worktree", "list", "--porcelain").stdout
    assert listed.count("worktree ") == 1, listed
    return files


@pytest.mark.parametrize("point", ["collect", "integrate"])
def test_sigkill_during_a_run_then_resume_loses_nothing(git_project, point):
    # Killed at an integration, the run must still be at work: the merge gate's check of a
    # task's commit (its title "T0." or "T1." is HEAD only there) takes a second.
    slow_gate = 'case "$(git log -1 --format=%s)" in T?.) sleep 1;; esac'
    checks = [slow_gate, "test -f README.md"] if point == "integrate" else ["test -f README.md"]
    store = scripted_setup(git_project, checks)
    tasks = [enqueue(store, "T%d.\n\nWRITE k%d.txt: %d\n" % (i, i, i)) for i in range(2)]
    if point == "collect":
        def reached(entry):
            return entry["event"] == "phase" and entry["detail"]["phase"] == 4
    else:
        def reached(entry):      # the candidate is checked, the target not yet moved
            return entry["event"] == "integration_ready"
    run_cli_until(git_project, reached)
    interrupted = json.loads(open(store.path(ferrus.PARALLEL_RUN_FILE)).read())["phase"]
    before = git(git_project, "rev-parse", "main").stdout.strip()
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    files = assert_all_merged_and_tidy(git_project, store, tasks, lines)
    assert "k0.txt" in files and "k1.txt" in files
    # the dead run's agents were stopped before anything started again
    assert any("previous" in line or "resuming" in line for line in lines), "\n".join(lines)
    moves = phases_of(store)
    # P0 went straight back to the phase the killed run had reached (its last saved one:
    # collect, or dispatch when the kill came between journaling a move and saving it)
    assert (0, interrupted) in moves and interrupted in ((3, 4) if point == "collect" else (5,))
    # the target only moved forward, to checked merges
    assert git(git_project, "merge-base", "--is-ancestor", before, "main",
               check=False).returncode == 0


def half_prepare(store, task, stage):
    """The task as _prepare_task leaves it when a run is killed part way: its record
    RUNNING with its worktree and branch named, then (``stage``) nothing more, the
    worktree made, or the worktree and the task's STATE.json (Idle) made too."""
    path = os.path.join(ferrus.default_worktree_dir(store.root), task)
    branch = ferrus.TASK_BRANCH_PREFIX + task
    base = ferrus.target_head(store.root, "main")
    ferrus.update_task(store, ferrus.ORCHESTRATOR, task, "prepare_task", {
        "status": "running", "worktree": path, "workdir": path, "branch": branch,
        "base": base, "target": "main", "store": "worktree"})
    if stage in ("worktree", "idle state"):
        ferrus.create_task_worktree(store.root, path, branch, base)
    if stage == "idle state":
        ferrus.atomic_write(store.for_task(task).task_path(ferrus.STATE_FILE),
                            ferrus.StateData().to_json())
    return path


@pytest.mark.parametrize("stage", ["record", "worktree", "idle state"])
@pytest.mark.parametrize("phase", [3, 4])
def test_a_task_a_killed_run_prepared_half_way_is_prepared_again_not_cancelled(git_project, stage,
                                                                               phase):
    """A run killed inside _prepare_task left a RUNNING record whose state is missing or
    Idle; the next run took Idle for a cancel (or left it running for good)."""
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    other = enqueue(store, "U.\n\nWRITE u.txt: u\n")
    path = half_prepare(store, task, stage)
    # killed in P2 (its batch saved) or while P4 → P3 prepared more (the batch not saved)
    crash_state(store, phase, [task] if phase == 3 else [])
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "merged", other: "merged"}, "\n".join(lines)
    assert "t.txt" in committed(git_project) and "u.txt" in committed(git_project)
    entries = [e for e in store.read_journal() if e["task_id"] == task]
    assert not [e for e in entries if e["event"] in ("cancel_task", "task_cancelled")]
    requeued = [e for e in entries if e["event"] == "requeue_task"]
    assert requeued and requeued[0]["detail"]["reason"] == "prepared half-way"
    assert "task %s was prepared only half-way" % ferrus.short_task_id(task) in "\n".join(
        lines)
    # the worktree it was given is the one it was finished in
    assert ferrus.read_task_record(store.dir, task)["worktree"] == path


def test_sigkill_while_a_task_is_prepared_then_the_next_run_prepares_it_again(git_project,
                                                                              tmp_path):
    """The real kill: `ferrus run --parallel` killed while [parallel] setup runs in the new
    worktree (the record RUNNING, the task's state Idle, no task created yet)."""
    import signal
    started, release = tmp_path / "setup.started", tmp_path / "setup.release"
    # (The merge gate's clean checkout runs the setup too, before the run starts the
    # task: only the task's worktree, named by its id, waits.)
    store = scripted_setup(git_project, ["test -f README.md"],
                           '[parallel]\nsetup = [%s]\n\n' % json.dumps(
        'case "$(basename "$PWD")" in t-*) touch %s; while [ ! -f %s ]; do sleep 0.05; '
        'done;; esac' % (started, release)))
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    proc = subprocess.Popen(FERRUS_CMD + ["run", "--parallel", "2"],
                            cwd=str(git_project), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "setup never ran"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        release.touch()                 # the setup command it left behind ends too
    assert ferrus.read_task_record(store.dir, task)["status"] == "running"
    assert store.for_task(task).read_state().state == S.IDLE
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "merged"}
    assert "t.txt" in committed(git_project)


def test_setup_commands_prepare_each_worktree_and_a_failing_one_fails_its_task(git_project):
    with open(os.path.join(str(git_project), ".gitignore"), "a") as handle:
        handle.write("built.flag\n")
    store = scripted_setup(git_project, ["test -f built.flag"],
                           '[parallel]\nsetup = ["touch built.flag"]\n\n')
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert "built.flag" not in committed(git_project) and "t.txt" in committed(git_project)
    set_config(git_project, scripted_config(["true"], '[parallel]\nsetup = ["exit 7"]\n\n'))
    broken = enqueue(store, "U.\n\nWRITE u.txt: u\n")
    # Tried on a clean checkout of the target before any agent starts, the setup fails:
    # the run stops there, naming it.
    with pytest.raises(ferrus.RedBaseRefused):
        run_tasks(store, 2)
    assert ferrus.read_task_record(store.dir, broken)["status"] == "queued"
    code, lines = run_tasks(store, 2, allow_red_base=True)
    assert any("[parallel] setup failed: exit 7" in line for line in lines), lines
    assert code == ferrus.RUN_FAILED
    reason = ferrus.read_task_record(store.dir, broken)["reason"]
    assert "[parallel] setup failed" in reason and "exit 7" in reason
    assert not any("setup made files" in line for line in lines), lines


def test_files_setup_makes_that_git_does_not_ignore_are_named_once_with_the_fix(git_project):
    store = scripted_setup(git_project, ["true"],
                           '[parallel]\nsetup = ["echo {port} > setup_port.out"]\n'
                           'port_base = 31000\n\n')
    for name in ("one", "two"):
        enqueue(store, "T.\n\nWRITE %s.txt: %s\n" % (name, name))
    _, lines = run_tasks(store, 2)
    told = [line for line in lines if "setup made files git does not ignore" in line]
    assert len(told) == 1, lines
    assert "setup_port.out" in told[0] and "add them to .gitignore" in told[0]


def integrating(task_store):
    """The task's state put back in Integrating, as an approval leaves it."""
    data = task_store.read_state()
    data.state = S.INTEGRATING
    ferrus.atomic_write(task_store.task_path(ferrus.STATE_FILE), data.to_json())


def test_a_task_failed_by_its_integrations_says_so_not_that_it_was_rejected(git_project):
    from test_parallel_doctor import start_task
    store = scripted_setup(git_project, ["true"])
    task, _, _ = start_task(store)
    task_store = store.for_task(task)
    for _ in range(3):
        integrating(task_store)
        outcome = ferrus.op_integration_failed(task_store, ferrus.ORCHESTRATOR,
                                               "Merging it conflicts in a.txt.")
    assert outcome.data["state"] == S.FAILED.value
    reason = task_store.read_state().failure_reason
    assert reason.startswith("Task integration failed 3 times"), reason
    assert "rejected" not in reason
    # Rejections and failed integrations together: each is counted for what it was.
    other, _, _ = start_task(store, "Again.")
    other_store = store.for_task(other)
    integrating(other_store)
    ferrus.op_integration_failed(other_store, ferrus.ORCHESTRATOR, "Conflicts.")
    data = other_store.read_state()
    data.review_cycles = 2          # a reviewer's rejection since
    ferrus.atomic_write(other_store.task_path(ferrus.STATE_FILE), data.to_json())
    integrating(other_store)
    ferrus.op_integration_failed(other_store, ferrus.ORCHESTRATOR, "Conflicts again.")
    reason = other_store.read_state().failure_reason
    assert "integration failed 2 times" in reason and "rejected once" in reason, reason


def test_a_project_in_a_subfolder_of_its_repository_works_in_that_subfolder(tmp_path,
                                                                            monkeypatch):
    top = tmp_path / "repo"
    project = top / "svc"
    project.mkdir(parents=True)
    for name, value in (("NAME", "t"), ("EMAIL", "t@example.com")):
        monkeypatch.setenv("GIT_AUTHOR_" + name, value)
        monkeypatch.setenv("GIT_COMMITTER_" + name, value)
    monkeypatch.setenv("SCRIPTED_DIR", str(tmp_path))
    git(top, "init", "-q")
    ferrus.init_project(str(project), report=lambda m: None)
    store = scripted_setup(project, ["test -f README.md"])
    task = enqueue(store, "T.\n\nWRITE sub.txt: sub\n")
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert "svc/sub.txt" in committed(top)
    assert ferrus.read_task_record(store.dir, task)["workdir"].endswith(os.sep + "svc")


def test_without_a_git_identity_the_integration_waits_and_says_why(git_project, monkeypatch):
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    for name in ("NAME", "EMAIL"):
        monkeypatch.delenv("GIT_AUTHOR_" + name)
        monkeypatch.delenv("GIT_COMMITTER_" + name)
    empty = git_project.parent / "empty.gitconfig"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))
    monkeypatch.setenv("HOME", str(git_project.parent))
    git(git_project, "config", "user.useConfigOnly", "true")
    # The integration is tried again every INTEGRATION_RETRY_SECS.  Made short, the tries
    # come quickly; after the third the run's clock jumps past its timeout, so it ends
    # as a run that waited that long does, without the test waiting for it.
    monkeypatch.setattr(ferrus, "INTEGRATION_RETRY_SECS", 0.05)
    tries = []
    real_wait = ferrus.MergeQueue._wait

    def counted_wait(queue, task_id, why):
        tries.append(why)
        return real_wait(queue, task_id, why)
    monkeypatch.setattr(ferrus.MergeQueue, "_wait", counted_wait)
    code, lines = run_tasks(store, 2, timeout=600, clock=lambda: time.monotonic() + (
        600 if len(tries) >= 3 else 0))
    assert code == ferrus.RUN_TIMEOUT, "\n".join(lines)
    assert len(tries) >= 3 and len(set(tries)) == 1, tries
    text = "\n".join(lines)
    assert "waits" in text and text.count("ready to merge, and waits") == 1
    data = store.for_task(task).read_state()
    assert data.state == S.INTEGRATING and data.review_cycles == 0
    git(git_project, "config", "user.name", "Someone")
    git(git_project, "config", "user.email", "someone@example.com")
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert "t.txt" in committed(git_project)


def test_a_task_that_changes_ferrus_toml_is_never_merged(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    before = open(os.path.join(str(git_project), "ferrus.toml")).read()
    task = enqueue(store, "Loosen the checks.\n\nWRITE ferrus.toml: [checks]\n")
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_FAILED, "\n".join(lines)
    causes = [e["detail"]["cause"] for e in store.read_journal()
              if e["event"] == "integration_failed"]
    assert causes and set(causes) == {"config"}
    assert open(os.path.join(str(git_project), "ferrus.toml")).read() == before
    assert git(git_project, "show", "main:ferrus.toml").stdout == before


def test_a_task_whose_executor_is_stopped_fails_and_the_run_ends(git_project, monkeypatch):
    store = scripted_setup(git_project, ["test -f README.md"],
                  "[sessions]\nmax_consecutive_errors = 1\n\n")
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "crash-executor")
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    code, lines = run_tasks(store, 2, timeout=120)
    assert code == ferrus.RUN_FAILED, "\n".join(lines)
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "failed" and "executor is stopped" in record["reason"]


def test_a_running_tasks_deleted_worktree_is_made_again_from_its_branch(git_project):
    import shutil
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    runner = ferrus.ParallelRunner(store, lambda m: None, 2)
    runner.start()
    runner.step()
    runner.step()          # prepared, not dispatched: then the run died
    record = ferrus.read_task_record(store.dir, task)
    shutil.rmtree(record["worktree"])
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert "made it again" in "\n".join(lines)
    assert statuses(store) == {task: "merged"}


def test_without_a_human_here_a_full_run_waiting_for_confirmations_exits_4(git_project):
    store = scripted_setup(git_project, ["test -f README.md"], "[hq]\nhuman_review = true\n\n")
    tasks = [enqueue(store, "T%d.\n\nWRITE w%d.txt: %d\n" % (i, i, i)) for i in range(3)]
    code, lines = run_tasks(store, 2, timeout=120)
    assert code == ferrus.RUN_NEEDS_HUMAN, "\n".join(lines)
    assert sorted(statuses(store).values()) == ["queued", "running", "running"]


def test_an_empty_answer_asks_again(git_project, monkeypatch):
    store = scripted_setup(git_project, ["test -f README.md"])
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "ask")
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    answers = iter(["", "blue"])
    asked = []

    def ask(question):
        asked.append(question)
        return next(answers)
    code, lines = run_tasks(store, 2, timeout=120, ask=ask)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert len(asked) == 2 and statuses(store) == {task: "merged"}


def test_a_cancel_during_the_integration_stops_its_checks_before_the_worktree_goes(git_project):
    # Slow only in the integration, where the task's commit ("T.") is HEAD; it says when
    # it starts there.
    started_file = os.path.join(os.path.dirname(str(git_project)), "gate-check.started")
    store = scripted_setup(git_project, [
        "if [ \"$(git log -1 --format=%%s)\" = T. ]; then touch '%s'; sleep 60; fi"
        % started_file])
    task = enqueue(store, "T.\n\nWRITE t.txt: t\n")
    runner = ferrus.ParallelRunner(store, lambda m: None, 2)
    runner.start()
    deadline = time.monotonic() + 90
    while runner.integration is None and time.monotonic() < deadline:
        runner.step()
        time.sleep(0.01)
    assert runner.integration is not None
    wait_until(lambda: os.path.exists(started_file), "the merge gate's check to start")
    assert runner.integration["thread"].is_alive()
    started = time.monotonic()
    ferrus.op_cancel_task(store, ferrus.HUMAN, task)
    runner.step()
    assert runner.integration is None and time.monotonic() - started < 30
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "cancelled" and not os.path.exists(record["worktree"])
    runner.shutdown()


def test_a_stopped_runner_no_longer_claims_the_queue(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    enqueue(store, "T.\n\nWRITE t.txt: t\n")
    runner = ferrus.ParallelRunner(store, lambda m: None, 2)
    runner.start()
    runner.step()
    assert ferrus.read_parallel_run(store)["pid"] == os.getpid()
    runner.shutdown()                   # HQ's /stop: a cancel elsewhere must clean up itself
    saved = ferrus.read_parallel_run(store)
    assert saved["pid"] is None and not saved["ended"] and saved["phase"] == 2
