"""The task queue and per-task stores (parallel tasks): `ferrus task add / tasks / task
cancel`, the supervisor's enqueue_task, .ferrus/tasks/<id>/ with the project's one journal,
and the project's STATE.json that numbers every commit and mirrors the foreground task."""

import json
import os

import pytest

import ferrus
from conftest import enqueue, run_cli, scripted_config, scripted_setup, set_config, statuses

FERRUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ferrus.py")
S = ferrus.TaskState


def cli(root, *args, check=True):
    proc = run_cli(*args, cwd=root, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc


@pytest.fixture
def project(tmp_path):
    ferrus.init_project(str(tmp_path))
    return tmp_path


def start_task(store, text="Do the thing."):
    """Queue a task and create its state as the parallel runner does (no worktree)."""
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]
    task_store = store.for_task(task)
    ferrus.atomic_write(task_store.task_path(ferrus.STATE_FILE), ferrus.StateData().to_json())
    ferrus.op_create_task(task_store, ferrus.HUMAN, text, task_id=task)
    return task, task_store


def test_task_add_lists_and_cancels_from_the_shell(project):
    out = cli(project, "task", "add", "Add a --verbose flag").stdout
    assert "queued" in out
    listed = json.loads(cli(project, "tasks", "--json").stdout)["tasks"]
    assert [row["status"] for row in listed] == ["queued"]
    assert listed[0]["title"] == "Add a --verbose flag"
    task = listed[0]["id"]
    assert open(os.path.join(str(project), ".ferrus", "tasks", task, "TASK.md")).read() == \
        "Add a --verbose flag"
    table = cli(project, "tasks").stdout
    assert task in table and "queued" in table
    # the end of the id is enough, as the run's lines show it
    cli(project, "task", "cancel", ferrus.short_task_id(task))
    assert json.loads(cli(project, "tasks", "--json").stdout)["tasks"][0]["status"] == "cancelled"
    entries = [json.loads(line) for line in
               open(os.path.join(str(project), ".ferrus", "events.jsonl"))]
    assert [(e["event"], e["task_id"]) for e in entries[-2:]] == [
        ("enqueue_task", task), ("cancel_task", task)]


def test_bad_queue_input_is_refused_with_a_hint(project):
    proc = cli(project, "task", "add", check=False)
    assert proc.returncode == 2 and "say what to queue" in proc.stderr
    proc = cli(project, "task", "cancel", "nosuch", check=False)
    assert proc.returncode == 1 and "no task nosuch" in proc.stderr and "ferrus tasks" in proc.stderr
    proc = cli(project, "task", "add", "x", "--agent", "vim", check=False)
    assert proc.returncode == 1 and "not an agent ferrus knows" in proc.stderr


SPEC = """# Feature

## Milestones
- [x] #1.0 Base
  ID: base
- [ ] #1.1 Left
  ID: left
  Depends on: base
- [ ] #1.2 Right
  ID: right
  Depends on: base
- [ ] #1.3 Both
  ID: both
  Depends on: left, right
"""


def test_ready_milestones_are_queued_in_one_step_and_only_once(project):
    os.makedirs(os.path.join(str(project), "docs", "specs"), exist_ok=True)
    with open(os.path.join(str(project), "docs", "specs", "f.md"), "w") as handle:
        handle.write(SPEC)
    out = cli(project, "task", "add", "--ready", "docs/specs/f.md").stdout
    assert "Queued 2 tasks" in out
    rows = json.loads(cli(project, "tasks", "--json").stdout)["tasks"]
    assert sorted(row["origin"]["milestone"] for row in rows) == ["left", "right"]
    assert "No milestone" in cli(project, "task", "add", "--ready", "docs/specs/f.md").stdout
    proc = cli(project, "task", "add", "--milestone", "docs/specs/f.md", "both", check=False)
    assert proc.returncode == 1 and "depends on left, right" in proc.stderr
    proc = cli(project, "task", "add", "--milestone", "docs/specs/f.md", "left", check=False)
    assert proc.returncode == 1 and "already task" in proc.stderr


def test_a_task_store_keeps_its_own_state_and_the_project_numbers_every_commit(project):
    store = ferrus.Store(str(project))
    first, first_store = start_task(store, "First.")
    second, second_store = start_task(store, "Second.")
    assert first_store.read_state().state == S.EXECUTING
    assert first_store.read_file("TASK.md") == "First."
    assert second_store.read_file("TASK.md") == "Second."
    # the project's TASK.md is not touched by a parallel task
    assert store.read_file("TASK.md") == ""
    project_state = store.read_state()
    assert project_state.rev == store.last_journal_seq()
    # the foreground task (the first one in flight) is mirrored, the second is not
    assert project_state.extra[ferrus.PARALLEL_MIRROR_KEY] == first
    assert project_state.task_id == first and project_state.state == S.EXECUTING
    entries = store.read_journal()
    creates = [(e["event"], e["task_id"]) for e in entries if e["event"] == "create_task"]
    assert creates == [("create_task", first), ("create_task", second)]
    seqs = [e["seq"] for e in entries]
    assert seqs == list(range(1, len(seqs) + 1))
    assert first_store.read_state().rev < second_store.read_state().rev == project_state.rev


def test_the_mirror_refuses_a_change_that_is_not_the_tasks_own(project):
    store = ferrus.Store(str(project))
    first, first_store = start_task(store)
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.op_submit(store, ferrus.Caller("executor", "executor:x:0"), "done")
    assert "mirrors task %s" % first in err.value.message
    assert first_store.read_state().state == S.EXECUTING
    # bookkeeping on the project still works
    ferrus.Store(str(project)).append_event("hq", "note", {"x": 1})


def test_when_the_foreground_task_ends_the_next_commit_takes_the_mirror(project):
    store = ferrus.Store(str(project))
    first, first_store = start_task(store)
    second, second_store = start_task(store)
    ferrus.op_cancel_task(store, ferrus.HUMAN, first)
    ferrus.op_heartbeat  # (the next commit of the other task takes over)
    second_store.append_event("hq", "note", {})
    data = store.read_state()
    assert data.extra[ferrus.PARALLEL_MIRROR_KEY] == second and data.task_id == second


@pytest.mark.parametrize("ended", [S.COMPLETE, S.FAILED])
def test_the_checkout_takes_its_state_back_once_the_mirrored_task_ended(project, ended):
    """A merged (or failed) parallel task leaves its last state mirrored in the project's
    STATE.json: a reset or the checkout's next task replaces it like any ended task."""
    store = ferrus.Store(str(project))
    first, _ = start_task(store)
    data = store.read_state()
    data.state = ended
    ferrus.atomic_write(store.path(ferrus.STATE_FILE), data.to_json())
    ferrus.op_force_reset(store, ferrus.HUMAN)
    after = store.read_state()
    assert after.state == S.IDLE and ferrus.PARALLEL_MIRROR_KEY not in after.extra
    ferrus.op_create_task(store, ferrus.HUMAN, "The checkout's own task.")
    assert store.read_state().state == S.EXECUTING


def test_a_crash_between_the_project_file_and_the_tasks_leaves_a_recorded_gap(project,
                                                                              monkeypatch):
    store = ferrus.Store(str(project))
    task, task_store = start_task(store)
    real = ferrus.atomic_write
    calls = []

    def failing(path, text, *args, **kwargs):
        calls.append(path)
        if path == task_store.task_path(ferrus.STATE_FILE):
            raise OSError(28, "No space left on device")
        return real(path, text, *args, **kwargs)
    monkeypatch.setattr(ferrus, "atomic_write", failing)
    with pytest.raises(OSError):
        task_store.append_event("hq", "note", {})
    monkeypatch.setattr(ferrus, "atomic_write", real)
    task_store.append_event("hq", "note", {})
    entries = store.read_journal()
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
    assert entries[-2]["event"] == "journal_gap"
    assert task_store.read_state().rev == store.read_state().rev == entries[-1]["seq"]


def test_an_agent_server_of_a_task_works_on_that_task_only(project):
    from mcp_client import McpProcess
    store = ferrus.Store(str(project))
    first, first_store = start_task(store, "First.")
    second, second_store = start_task(store, "Second.")
    env = dict(os.environ, FERRUS_SESSION=ferrus.session_id_for_task(second))
    with McpProcess(str(project), "--role", "executor", env=env) as server:
        server.initialize()
        result = server.call_tool("wait_for_task", {})
        assert "Second." in json.dumps(result)
    assert second_store.read_state().claimed_by and not first_store.read_state().claimed_by
    assert ferrus.session_task(ferrus.session_id_for_task(second)) == second
    assert ferrus.session_task("s-20261124T000000-abcdef") is None


def test_the_supervisor_queues_tasks_as_team_lead(project):
    store = ferrus.Store(str(project))
    supervisor = ferrus.Caller("supervisor", "supervisor:claude-code:0/s-1")
    task = ferrus.op_enqueue_task(store, supervisor, "Split part", agent="codex").data["task_id"]
    record = ferrus.read_task_record(store.dir, task)
    assert record["origin"]["delegated_by"] == "supervisor:claude-code:0/s-1"
    assert record["agent"] == "codex"


def test_two_shells_queuing_one_milestone_get_one_task(project):
    import concurrent.futures
    os.makedirs(os.path.join(str(project), "docs", "specs"), exist_ok=True)
    with open(os.path.join(str(project), "docs", "specs", "f.md"), "w") as handle:
        handle.write(SPEC)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: cli(project, "task", "add", "--milestone",
                                              "docs/specs/f.md", "left", check=False),
                                range(4)))
    assert sorted(r.returncode for r in results) == [0, 1, 1, 1]
    assert [row["origin"]["milestone"] for row in
            json.loads(cli(project, "tasks", "--json").stdout)["tasks"]] == ["left"]


def test_a_cancel_never_turns_a_merged_task_into_a_cancelled_one(project, monkeypatch):
    store = ferrus.Store(str(project))
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "T.").data["task_id"]
    real = ferrus.read_task_record
    seen = []

    def merged_meanwhile(ferrus_dir, name):
        record = real(ferrus_dir, name)
        if not seen:       # the first look says queued; then it is merged elsewhere
            seen.append(1)
            ferrus.write_task_record(store, name, dict(record, status="merged"))
        return record
    monkeypatch.setattr(ferrus, "read_task_record", merged_meanwhile)
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.op_cancel_task(store, ferrus.HUMAN, task)
    assert "already merged" in err.value.message
    assert real(store.dir, task)["status"] == "merged"


# -- `ferrus run` working the queue in the checkout ------------------------------------------

def test_a_config_that_does_not_load_takes_no_task_from_the_queue(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    first = enqueue(store, "One.\n\nWRITE one.txt: one\n")
    second = enqueue(store, "Two.\n\nWRITE two.txt: two\n")
    set_config(git_project, scripted_config(["test -f README.md"],
                                            checks_extra='timeout_secs = "soon"\n'))
    lines = []
    with pytest.raises(ferrus.FerrusError) as refused:
        ferrus.run_queue(store, out=lines.append)
    assert "timeout_secs" in refused.value.message
    assert statuses(store) == {first: "queued", second: "queued"}
    assert "dispatch_task" not in [e["event"] for e in store.read_journal()]
    set_config(git_project, scripted_config(["test -f README.md"]))
    assert ferrus.run_queue(store, out=lines.append) == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {first: "done", second: "done"}


def test_a_run_that_raises_before_its_task_began_puts_the_task_back(git_project, monkeypatch):
    store = scripted_setup(git_project, ["test -f README.md"])
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


def test_a_task_left_running_without_a_state_is_recovered_not_failed(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "One.\n\nWRITE one.txt: one\n")
    # What a run killed between taking the task and creating it leaves behind.
    ferrus.update_task(store, ferrus.HUMAN, task, "dispatch_task",
                       {"status": "running", "store": "project"})
    lines = []
    assert ferrus.run_queue(store, out=lines.append) == ferrus.RUN_COMPLETE, "\n".join(lines)
    text = "\n".join(lines)
    assert "back in the queue" in text
    assert statuses(store) == {task: "done"}
    assert (git_project / "one.txt").read_text() == "one\n"


def test_a_task_replaced_in_the_checkout_is_failed_with_a_reason(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
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
