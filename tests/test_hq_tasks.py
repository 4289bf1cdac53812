"""HQ and `ferrus status` with the task queue and parallel tasks: /tasks (the task board),
/task add and /task cancel, /run, /attach ID, /log ID, /diff ID and /status ID, typed into
the plain-line HQ over pipes; `ferrus status` summarising every task.  An HQ run of two
parallel tasks is in test_hq_parallel_run.py, the curses board in test_hq_curses_tasks.py."""

import io
import json
import os
import subprocess

import ferrus
from conftest import FERRUS_CMD
from test_hq_plain_commands import hq  # noqa: F401  (hq: the fixture)
from test_milestones import write_spec

S = ferrus.S


def short(task):
    return ferrus.short_task_id(task)


def queue(store, text):
    return ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]


def start(store, task, worktree=None):
    """Give a queued task its own state, Executing, as the parallel runner does (with no
    worktree made unless ``worktree`` is a folder)."""
    ferrus.update_task(store, ferrus.HUMAN, task, "prepare_task", {
        "status": "running", "worktree": worktree or "/nowhere/%s" % task,
        "branch": "ferrus/%s" % task, "started_at": ferrus.format_timestamp(store.clock())})
    task_store = store.for_task(task)
    ferrus.atomic_write(task_store.task_path(ferrus.STATE_FILE), ferrus.StateData().to_json())
    ferrus.op_create_task(task_store, ferrus.HUMAN, task_store.read_file("TASK.md"),
                          task_id=task)
    return task_store


# -- the commands over pipes, without a run ---------------------------------------------------

def test_queue_commands_in_plain_hq(scripted, hq):  # noqa: F811
    root = scripted.root
    shell = hq()
    shell.command("/tasks", "No task is queued or running: /task add TEXT queues one.")

    out = shell.command("/task add Write the docs", "/run works the queue")
    assert out[0].startswith("Task t-") and out[0].endswith(" queued: Write the docs")
    # [parallel] max_tasks is 1 here: /run needs a number, and says so.
    assert out[-1] == "/run works the queue (/run N: N at a time, each task in its own git " \
                      "worktree)."
    [docs] = ferrus.queued_task_ids(scripted)
    rel = write_spec(root)
    shell.command("/task add --milestone %s m1" % rel, "queued: Implement milestone")
    shell.command("/task add --ready %s" % rel, "No milestone of %s is ready to queue" % rel)
    shell.command("/task add --milestone %s" % rel, "error: usage: /task add TEXT | "
                                                     "--milestone SPEC ID | --ready SPEC")
    shell.command("/task add", "error: usage: /task add TEXT")
    shell.command("/task add --frobnicate", "error: usage: /task add TEXT")
    docs_only, milestone = sorted(ferrus.queued_task_ids(scripted), key=lambda task: (
        ferrus.read_task_record(scripted.dir, task)["created_at"]))

    out = shell.command("/tasks", "2 queued; /run works the queue")
    assert out[0] == ferrus.TaskBoard.HEADER
    assert out[1].split()[:3] == [short(docs), "queued", "-"]
    assert out[1].endswith("Write the docs")
    assert out[2].split()[:2] == [short(milestone), "queued"]

    shell.command("/task cancel %s" % short(docs), "Task %s cancelled." % docs)
    shell.command("/task cancel", "error: usage: /task cancel ID")
    shell.command("/task cancel zzzz", "error: no task zzzz in the queue")
    out = shell.command("/tasks", "1 queued, 1 cancelled")
    out = out[out.index(ferrus.TaskBoard.HEADER):]      # a hint may come before it
    assert [line.split()[1] for line in out[1:3]] == ["queued", "cancelled"]

    shell.command("/run", "error: [parallel] max_tasks is 1: a task at a time, in the checkout")
    shell.command("/run 0", "error: usage: /run [N]")
    shell.command("/run 2 3", "error: usage: /run [N]")
    out = shell.command("/status", "tasks: 1 queued, 1 cancelled — /tasks shows the board, "
                                   "/run works the queue")
    assert out[0].startswith("State Idle")

    # /attach ID: the task is the focus of /status, /log and /diff until /attach alone.
    out = shell.command("/attach %s" % short(milestone), "enqueue_task")
    assert out[0].startswith("Following task %s (Implement milestone" % short(milestone))
    out = shell.command("/status", "Task %s: Implement milestone" % short(milestone))
    assert out[-1].endswith("— queued, for 0s") or " — queued, for " in out[-1]
    out = shell.command("/log", "enqueue_task")
    assert len(out) == 1 and "title=Implement milestone" in out[0]
    shell.command("/diff", "error: task %s is queued: it has no work yet" % short(milestone))
    out = shell.command("/log %s 5" % short(docs), "cancel_task")
    out = [line for line in out if not line.startswith("hint:")]    # the error's, before it
    assert [line.split()[4] for line in out] == ["enqueue_task", "cancel_task"]
    shell.command("/attach", "Detached from task %s; every task's lines are shown again."
                  % short(milestone))
    shell.command("/attach", "error: usage: /attach ID (follow a task) or /attach ROLE")
    shell.command("/attach nosuchtask", "error: no task or agent role 'nosuchtask'")
    shell.command("/status nosuchtask", "error: usage: /status [ID]")
    shell.command("/log nosuchtask", "error: usage: /log [ID] [N] [--all]")
    shell.quit()
    assert docs_only == docs
    assert not any("Traceback" in line for line in shell.out), "\n".join(shell.out)


def test_hq_without_queued_tasks_shows_no_task_line(scripted):  # noqa: F811
    out = io.StringIO()
    shell = ferrus.HqShell(scripted, stdin=io.StringIO(), stdout=out)
    try:
        shell.handle("/status")
    finally:
        shell.shutdown()
    assert "tasks:" not in out.getvalue()
    assert out.getvalue().splitlines()[-1] == "  consultant: idle"


# -- the board and the project's controller -------------------------------------------------------

def test_the_board_has_one_line_per_task_with_its_state_agent_elapsed_and_last_event(store,
                                                                                       clock):
    first, second, third = (queue(store, text) for text in ("First", "Second", "Third"))
    task_store = start(store, first)
    clock.advance(65)
    ferrus.op_cancel_task(store, ferrus.HUMAN, third)
    board = ferrus.TaskBoard(store)
    rows = board.rows()
    assert [row["id"] for row in rows] == [first, second, third]    # running, queued, ended
    assert board.summary(rows) == "1 running, 1 queued, 1 cancelled"
    line = board.line(rows[0], width=80)
    configured = store.config().executor.agent           # until an executor says who it is
    assert line.split()[:4] == [short(first), "Executing", configured, "1m05s"]
    assert line.endswith("create task → Executing (1m05s ago)")
    assert board.line(rows[1], attached=second).startswith("▸" + short(second))
    assert board.line(rows[1]).endswith("Second")         # a queued task shows its title
    assert board.line(rows[2]).endswith("cancel task (0s ago)")
    assert len(board.line(rows[0], width=30)) == 30
    # What happens next is read from the journal's end, not looked up again.
    with task_store.transaction("executor:scripted:1/s-1") as tx:
        data = tx.state.copy()
        data.state = S.REVIEWING
        tx.set(data, "submit")
    rows = board.rows(force=True)
    assert rows[0]["state"] == "Reviewing" and rows[0]["agent"] == "scripted"
    assert board.line(rows[0]).split()[1:3] == ["Reviewing", "scripted"]
    assert ferrus.describe_task_event(rows[0]["last_event"]) == "submit → Reviewing"


def test_tasks_ended_before_hq_started_stay_off_the_board(store, clock):
    old = queue(store, "Old")
    ferrus.op_cancel_task(store, ferrus.HUMAN, old)
    clock.advance(5)
    board = ferrus.TaskBoard(store)
    assert board.rows() == []
    new = queue(store, "New")
    assert [row["id"] for row in board.rows(force=True)] == [new]


def test_log_of_one_task_leaves_the_others_out(store):
    first, second = queue(store, "First"), queue(store, "Second")
    start(store, first)
    start(store, second)
    story = ferrus.journal_story(store, 10, task=first)
    assert [entry["event"] for entry in story] == ["enqueue_task", "prepare_task",
                                                   "create_task"]
    assert {entry["task_id"] for entry in story} == {first}


def test_the_projects_controller_leaves_a_mirrored_parallel_task_to_its_own(store):
    """The project's STATE.json mirrors a parallel task: HQ's own controller must neither
    offer to resume it in the checkout nor start agents for it there (nor show its lines
    twice), or the task would have two executors, one in the wrong folder."""
    task = queue(store, "In a worktree")
    start(store, task)
    assert store.read_state().extra.get(ferrus.PARALLEL_MIRROR_KEY) == task
    assert store.read_state().state == S.EXECUTING
    spawned, shown = [], []

    def launcher(slot):
        spawned.append(slot.name)
        raise AssertionError("no agent may start for a mirrored task")
    controller = ferrus.HqController(store, shown.append, launcher=launcher)
    assert controller.task_in_flight() is None
    with store.for_task(task).transaction("executor:x:1/s") as tx:
        data = tx.state.copy()
        data.state = S.REVIEWING
        tx.set(data, "submit")
    for _ in range(3):
        controller.poll()
    assert spawned == [] and shown == []
    controller.shutdown()


def test_answers_and_verdicts_go_to_the_task_that_waits(store):
    first, second = queue(store, "First"), queue(store, "Second")
    stores = {task: start(store, task) for task in (first, second)}

    def wait_for_human(task):
        with stores[task].transaction("executor:x:1/s") as tx:
            tx.set(ferrus.t_ask_human(tx.state, store.clock(), "executor:x:1"), "ask_human")
            tx.write("QUESTION.md", "Which colour?")
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(), stdout=out)
    try:
        wait_for_human(second)
        shell.handle("blue")
        assert stores[second].read_state().state == S.EXECUTING
        assert stores[second].read_file("ANSWER.md") == "blue"
        wait_for_human(first)
        wait_for_human(second)
        shell.handle("red")
        assert "error: tasks %s, %s all wait for you" % tuple(sorted(
            (short(first), short(second)), key=lambda end: (first + second).index(end))) \
            in out.getvalue() or "all wait for you" in out.getvalue()
        shell.handle("/attach %s" % short(first))
        shell.handle("red")
        assert stores[first].read_file("ANSWER.md") == "red"
        assert stores[second].read_state().state == S.AWAITING_HUMAN
        # attached elsewhere, the one task that waits still gets the answer
        shell.handle("green")
        assert stores[second].read_file("ANSWER.md") == "green"
    finally:
        shell.shutdown()


# -- `ferrus status` ------------------------------------------------------------------------------

def test_status_summarises_every_task(store, clock, tmp_path):
    root = store.root
    merged, running, waiting = [], [], []
    for kept, text in ((merged, "Merged one"), (running, "Running one"),
                       (waiting, "Queued one")):
        kept.append(queue(store, text))
        clock.advance(1)
    [merged], [running], [waiting] = merged, running, waiting
    start(store, merged)
    ferrus.update_task(store, ferrus.HUMAN, merged, "task_merged", {
        "status": "merged", "merged_commit": "abc123", "ended_at":
        ferrus.format_timestamp(store.clock())})
    start(store, running, worktree=str(tmp_path / "wt"))
    done = subprocess.run(FERRUS_CMD + ["status"], cwd=root, text=True,
                          capture_output=True, timeout=60, env=dict(os.environ, NO_COLOR="1"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = lines.index("tasks  1 running, 1 queued, 1 merged (`ferrus tasks` lists them)")
    body = lines[at + 1:]
    # No run works the queue: the running task is said to wait for the next one.
    assert body[-1].startswith("no run works the queue now: %s" % short(running)), body
    body = body[:-1]
    assert [line.split()[:2] for line in body if not line.split()[0] == "worktree"] == [
        [short(merged), "merged"], [short(running), "Executing"], [short(waiting), "queued"]]
    assert body[1].endswith("Running one") and body[0].endswith("Merged one")
    assert body[2].split() == ["worktree", str(tmp_path / "wt"), "(branch",
                               "ferrus/%s)" % running]
    done = subprocess.run(FERRUS_CMD + ["status", "--json"], cwd=root, text=True,
                          capture_output=True, timeout=60)
    tasks = json.loads(done.stdout)["tasks"]
    assert [(t["short_id"], t["status"], t["state"]) for t in tasks] == [
        (short(merged), "merged", "Executing"), (short(running), "running", "Executing"),
        (short(waiting), "queued", None)]
    assert tasks[0]["last_event"]["event"] == "task_merged"
    assert tasks[2]["last_event"]["event"] == "enqueue_task"


def test_status_counts_old_ended_tasks_instead_of_listing_them(store, clock):
    tasks = []
    for number in range(8):
        tasks.append(queue(store, "Task %d" % number))
        clock.advance(0.001)
    for task in tasks[:7]:
        ferrus.op_cancel_task(store, ferrus.HUMAN, task)
    lines = ferrus.describe_queue(ferrus.status_task_rows(store, []))
    assert lines[1] == "tasks  1 queued, 7 cancelled (`ferrus tasks` lists them)"
    assert lines[2] == "  … 2 ended earlier"
    assert [line.split()[0] for line in lines[3:]] == [short(t) for t in tasks[2:]]


def test_status_sums_up_a_long_queue_in_a_few_lines(store, clock):
    """A queue of a thousand tasks made `ferrus status` a thousand lines: it now gives the
    counts, every task at work, the next few queued and the last few ended."""
    tasks = []
    for number in range(70):
        tasks.append(queue(store, "Task %d" % number))
        clock.advance(0.001)
    cancelled, running, queued = tasks[:8], tasks[8:11], tasks[11:]
    for task in cancelled:
        ferrus.op_cancel_task(store, ferrus.HUMAN, task)
    for task in running:
        start(store, task)
    ferrus.atomic_write(ferrus.task_record_path(store.dir, queued[-1]), '{"status": 7}')
    lines = ferrus.describe_queue(ferrus.status_task_rows(store, []))
    assert lines[1] == ("tasks  3 running, 58 queued, 8 cancelled, 1 damaged "
                        "(`ferrus tasks` lists them)")
    assert lines[2] == "  … 3 ended earlier"
    listed = [line.split()[0] for line in lines[3:] if not line.startswith("  …")
              and line.split()[0] != "worktree"]
    # in the order they were queued (a damaged record has no time: first)
    assert listed == [short(t) for t in queued[-1:] + cancelled[3:] + running + queued[:5]]
    assert lines[-1] == "  … 53 more queued" and len(lines) < 25
    damaged = next(line for line in lines if line.startswith("  " + short(queued[-1])))
    assert damaged.split()[1] == "damaged" and "`ferrus doctor --fix` repairs it" in damaged
    assert "status 7 is none of queued" in damaged


def test_status_without_tasks_is_unchanged(store):
    assert ferrus.describe_queue(ferrus.status_task_rows(store, [])) == []


def test_agent_commands_mean_the_attached_task_and_never_a_mirrored_one(store):
    task = queue(store, "In a worktree")
    start(store, task)
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(), stdout=out)
    try:
        # The checkout's STATE.json mirrors the task: /resume must not restart the
        # checkout's own agents for it (it said "Resuming the task (Executing).").
        for command in ("/resume", "/review", "/tell executor hurry"):
            shell.handle(command)
            assert out.getvalue().splitlines()[-2:] == [
                "error: the checkout's state shows parallel task %s, whose agents are its own"
                % short(task), "hint: /attach ID first (/tasks lists the tasks)"], command
        shell.handle("/attach %s" % short(task))
        shell.handle("/resume")
        assert out.getvalue().splitlines()[-2:] == [
            "error: no agent of task %s runs here" % short(task),
            "hint: /run works the queue, and resumes it"]
    finally:
        shell.shutdown()
