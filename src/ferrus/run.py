"""`ferrus run`: one task, the queue, milestones, or the queue in parallel.

Exit codes: 0 complete, 1 failed, 3 timeout or a capacity checkpoint, 4 waiting for a
human nobody here can be."""

import contextlib
import json
import os
import time

from .basics import (FerrusError, UsageError, format_duration, format_timestamp,
                     json_for_terminal, say, utc_now)
from .system import read_text
from .config import NO_CHECKS_HINT, NO_CHECKS_WARNING
from .task_machine import ACTIVE_STATES, S, failure_summary
from .session_machine import CHECKPOINT, EMERGENCY_STOP, SS
from .gates import phase_words
from .store import (DONE_STATUS, FAILED_STATUS, QUEUED_STATUS, RUNNING_STATUS, TASKS_DIR,
                    UNCHANGED_STATUS, damaged_task_note, read_task_record, require_utf8)
from .git import current_branch, display_path, run_git
from .worktrees import worktree_changes
from .specs import milestone_task_text
from .operations import (HUMAN, confirmation_summary, find_milestone, op_create_task,
                         op_diff, op_human_approve, op_human_reject, op_select_milestone,
                         short_task_id, task_diff_exclusions)
from .work import op_answer, op_force_reset
from .task_queue import checked_task_records, task_records, update_task, write_task_record
from .graph import graph_index_before_task
from .memory import memory_after_task_end
from .adapters import CustomAgent
from .nano_model import nano_endpoint, nano_settings
from .register import adapter_for
from .sandbox_agents import confine_controller
from .sessions import HqMessage, format_usage, task_usage
from .web_link import web_board_url
from .controller import HqController
from .race import race_id_of
from .parallel import (ParallelRunner, QUIET_EVENTS, RUN_CHECKPOINT, RUN_COMPLETE,
                       RUN_FAILED, RUN_NEEDS_HUMAN, RUN_TIMEOUT, checkout_base, gate_base)


def run_parallel(store, max_tasks=None, timeout=None, out=None, ask=None, review=None,
                 clock=time.monotonic, poll_interval=0.02, launcher=None, mode="lines",
                 bell=None, allow_red_base=False):
    """`ferrus run --parallel N`: work the queue until it is empty.  Exit codes as
    run_loop's: 0 every task approved (merged, or with no change), 1 one failed, 3 timeout
    or capacity checkpoint, 4 a task waits for a human nobody here can be.  The checks are
    tried on the target's head before any agent starts (ParallelRunner.start)."""
    out = out or (lambda text: say(text, flush=True))
    show = run_printer(out, mode)
    if launcher is None:
        require_headless_agents(store)
    runner = ParallelRunner(store, show, max_tasks, clock=clock, launcher=launcher, bell=bell,
                            ask=ask, review=review, allow_red_base=allow_red_base)
    started = clock()
    try:
        runner.start()
        while not runner.finished and not runner.checkpoint:
            runner.step()
            if runner.stuck_on_human():
                runner.note("every task in flight waits for a human (answer with HQ, "
                            "`ferrus approve`, or `ferrus run --parallel` in a terminal)",
                            exit=RUN_NEEDS_HUMAN)
                return RUN_NEEDS_HUMAN
            if timeout is not None and clock() - started >= timeout:
                runner.note("timed out after %s, while %s" % (
                    format_duration(timeout), phase_words(runner.machine.phase)),
                    exit=RUN_TIMEOUT)
                return RUN_TIMEOUT
            time.sleep(poll_interval)
        code = runner.exit_code()
        runner.note("done: exit %d" % code, exit=code)
        return code
    except KeyboardInterrupt:
        runner.note("interrupted while %s: the agents are stopped, every task stays as it "
                    "is; `ferrus run --parallel %d` goes on with them" % (
                        phase_words(runner.machine.phase), runner.max_tasks), "warning")
        raise
    finally:
        runner.shutdown()


def run_printer(out, mode="lines"):
    """``show(message)`` for `ferrus run`: a line per message, fewer with "quiet", one
    JSON object per message with "json" (for CI logs and other programs)."""
    def show(message):
        if mode == "quiet" and (message.event in QUIET_EVENTS or (
                message.event == "check" and message.data.get("status") == "passed")):
            return
        out(_run_json(message) if mode == "json" else _run_line(message))
    return show


def require_headless_agents(store):
    """Refuse, before a task is created, a run whose executor or reviewer could not start:
    no [hq.<role>] agent, a built-in agent CLI that is not on PATH, or nano with settings
    it would refuse (a custom agent's command is the user's own and is judged when it
    starts)."""
    config = store.config().require_hq()
    for role, slots in (("executor", "the executor"), ("supervisor", "the reviewer")):
        choice = getattr(config, role)
        if choice is None:
            raise FerrusError("no agent is set for %s: ferrus.toml has no [hq.%s]" % (slots, role),
                              "`ferrus register --supervisor AGENT --executor AGENT` sets both "
                              "(`ferrus agents` lists what is installed)")
        adapter = adapter_for(config, choice.agent)
        if not isinstance(adapter, CustomAgent) and not adapter.executable():
            raise FerrusError("%s's agent %s is not installed here (no `%s` on PATH)" % (
                slots, choice.agent, adapter.binary), adapter.install_hint())
        if adapter.name == "nano":
            nano_endpoint(nano_settings(config))    # nano would refuse to start with them


def run_loop(store, task=None, timeout=None, resume=False, out=None, ask=None,
             clock=time.monotonic, poll_interval=0.02, launcher=None, origin=None, reset=False,
             review=None, mode="lines", bell=None, task_id=None, allow_red_base=False):
    """Create (or take) the task and drive it to Complete or Failed.

    ``ask(question) -> answer or None`` answers human questions (None: nobody can,
    so the run ends with exit 4).  ``review(summary) -> ("approve", None) or
    ("reject", notes) or None`` is the human's word on a reviewer's approval when
    [hq] human_review is on (None: nobody gives it here, exit 4 as well).  ``origin`` is
    the (spec, milestone id) the task implements; a Failed task is replaced only with
    ``reset``.  ``mode`` is one of RUN_OUTPUT_MODES; ``bell()`` rings the terminal's bell
    for [notify].  A new task starts only once the checks were tried on the checkout
    (gate_base): a red one stops the run unless ``allow_red_base``.  Returns the exit
    code."""
    out = out or (lambda text: say(text, flush=True))
    show = run_printer(out, mode)

    def note(text, level="info", **data):
        show(HqMessage(level, "ferrus run: " + text, "run", data))
    data = store.read_state()
    controller = HqController(store, emit=show, clock=clock, launcher=launcher, bell=bell)
    # [sandbox] on: the task's agents start confined, or the run refuses here, before
    # anything is created (SandboxUnavailable says how to install bubblewrap).
    confinement = confine_controller(controller)
    if not controller.recheck_checkpoint():
        note("the capacity checkpoint still holds (%s); raise the limit in [capacity] and run "
             "again" % controller.checkpoint.get("signal"), exit=RUN_CHECKPOINT)
        return RUN_CHECKPOINT
    if task is not None:
        if controller.gate("transition:create_task") in (CHECKPOINT, EMERGENCY_STOP):
            return RUN_CHECKPOINT
        _start_run_task(store, data, task, note, show, launcher=launcher, reset=reset,
                        allow_red_base=allow_red_base, origin=origin, task_id=task_id)
    elif data.state not in ACTIVE_STATES:
        raise UsageError("nothing to run: state is %s and no task was given" % data.state,
                         "pass --task TEXT or --task-file FILE")
    elif not resume:
        raise UsageError("a task is in flight (state %s)" % data.state,
                         "pass --resume to continue it")
    started = clock()
    if not store.config().checks.commands:
        note("warning: %s (%s)" % (NO_CHECKS_WARNING, NO_CHECKS_HINT), "warning",
             warning=NO_CHECKS_WARNING)
    # The task's creation (Idle → Executing) first, then where the run starts from.
    controller.drain_journal()
    # No agent has started yet: their first repository_graph_* call finds it indexed.
    graph_index_before_task(store)
    run_task = store.read_state().task_id
    note(controller.describe_state(), task_id=run_task)
    told_board = set()          # the waits (state, entered at) left to the board
    try:
        while True:
            code = _run_step(store, controller, run_task, note, ask, review, poll_interval,
                             told_board)
            if code is not None:
                return code
            if timeout is not None and clock() - started >= timeout:
                note("timed out after %s (state %s)" % (format_duration(timeout),
                                                       store.read_state().state),
                     exit=RUN_TIMEOUT)
                return RUN_TIMEOUT
            time.sleep(poll_interval)
    finally:
        controller.shutdown()
        # However the run ends (Complete, Failed, a timeout, a human's reset seen), what
        # ended goes into project memory.
        memory_after_task_end(store)
        if confinement is not None:
            confinement.close()
        task_id = store.read_state().task_id
        used = task_usage(store, task_id)
        if used["input_tokens"] or used["output_tokens"]:     # agents that report usage
            note("task %s used %s" % (task_id, format_usage(used)), task_id=task_id,
                 usage=used)


def _start_run_task(store, data, task, note, show, launcher, reset, allow_red_base, origin,
                    task_id):
    """`ferrus run --task`: refuse what is in the way, try the checks on the checkout
    (gate_base), then create the task."""
    if not task.strip():        # refused before anything is reset below
        raise UsageError("the task description is empty",
                         "pass the task as --task TEXT or --task-file FILE")
    require_utf8(task, "the task description")
    if data.state == S.AWAITING_CONFIRMATION:
        raise FerrusError("a task is already in flight (state %s): the reviewer approved "
                          "it and it waits for your word" % data.state,
                          "`ferrus approve` completes it, `ferrus reject NOTES` sends it "
                          "back (then `ferrus run --resume`); `ferrus reset` drops it")
    if data.state in ACTIVE_STATES:
        raise FerrusError("a task is already in flight (state %s)" % data.state,
                          "run `ferrus run --resume` to continue it, or `ferrus reset`")
    if data.state == S.FAILED and not reset:
        raise FerrusError(
            "the last task failed: %s" % failure_summary(data.failure_reason),
            "pass --reset to clear it and start the new task "
            "(`ferrus status` and `ferrus log` show what happened)")
    if launcher is None:            # real agents: they must be able to start at all
        require_headless_agents(store)
    commit, where = checkout_base(store)
    task += gate_base(store, show, where, commit, allow_red_base, checkout=store.workdir)
    if data.state in (S.COMPLETE, S.FAILED):
        # A queued task that ended in the checkout while no run worked the queue (approved
        # by hand) is recorded before the new task takes its place, not lost with it.
        settle_checkout_queue_task(store)
        op_force_reset(store, HUMAN)
    # A task given as text implements no milestone, whatever an interrupted HQ /task
    # may have staged.
    created = op_create_task(store, HUMAN, task, origin=origin or (None, None),
                             task_id=task_id)
    for warning in created.data.get("warnings", ()):
        note("warning: %s" % warning, "warning", warning=warning)
    if created.data.get("branch"):
        note("the task works on the new git branch %s" % created.data["branch"],
             branch=created.data["branch"])


def _run_step(store, controller, run_task, note, ask, review, poll_interval, told_board):
    """One turn of run_loop: the controller polled, then the run's exit code when the task
    ended, went away, hit a checkpoint, waits for a human nobody here can be, or has an
    agent that gave up; else None (the questions and confirmations a human here can give
    are passed on).  While a board serves the project (`ferrus web`, --web) the human
    gives them there: the run says so once each time the task enters such a state
    (``told_board``: those waits; a journal entry such as a session's end changes the rev
    but not the wait) and waits for the board's answer."""
    controller.poll()
    data = store.read_state()
    controller.catch_up(data.rev)
    wait = (data.state, data.state_entered_at)
    if data.state not in (S.AWAITING_HUMAN, S.AWAITING_CONFIRMATION):
        told_board.clear()          # a later question is a new wait, whatever its time
    if data.state in (S.COMPLETE, S.FAILED) and data.task_id == run_task:
        controller.wind_down(poll_interval)
        return RUN_COMPLETE if data.state == S.COMPLETE else RUN_FAILED
    if data.state == S.IDLE or data.task_id != run_task:
        # Someone else reset (or replaced) the task: no agent will move it now.
        note("task %s is gone: the state is %s%s, changed outside this run "
             "(`ferrus log` shows by whom); stopping" % (
                 run_task, data.state, " with task %s" % data.task_id
                 if data.task_id and data.task_id != run_task else ""),
             exit=RUN_FAILED)
        return RUN_FAILED
    if controller.checkpoint and not controller.running():
        note("stopped at a capacity checkpoint; raise the limit in [capacity] and run "
             "`ferrus run --resume`", exit=RUN_CHECKPOINT)
        return RUN_CHECKPOINT
    if data.state == S.AWAITING_HUMAN and controller.shown_question:
        board = web_board_url(store, run_task)
        answer = ask(controller.shown_question) if ask and board is None else None
        if answer is None and board is not None:
            if wait not in told_board:
                told_board.add(wait)
                note("the question waits for your answer on the board: %s" % board)
            answer = ""                 # nothing to pass on: the board answers
        if answer is None:
            note("an agent asked a human and no answer is given here (stdin is not "
                 "a terminal, or it ended); answer with HQ or `ferrus run --resume` "
                 "in a terminal", exit=RUN_NEEDS_HUMAN)
            return RUN_NEEDS_HUMAN
        if answer.strip():
            op_answer(store, HUMAN, answer)
    if data.state == S.AWAITING_CONFIRMATION and controller.shown_confirmation:
        board = web_board_url(store, run_task)
        decision = review(confirmation_summary(store, data)) \
            if review and board is None else None
        if decision is None and board is not None:
            if wait not in told_board:
                told_board.add(wait)
                note("the reviewer's approval waits for your confirmation on the board: %s"
                     % board)
        elif decision is None:
            note("the task waits for a human's confirmation of the reviewer's "
                 "approval; run `ferrus approve`, or `ferrus reject NOTES` and then "
                 "`ferrus run --resume`", exit=RUN_NEEDS_HUMAN)
            return RUN_NEEDS_HUMAN
        else:
            verdict, notes = decision
            try:
                if verdict == "approve":
                    op_human_approve(store, HUMAN, via="run")
                else:
                    op_human_reject(store, HUMAN, notes, via="run")
            except FerrusError as err:      # e.g. someone else decided meanwhile
                note(err.message)
    stuck = [slot.name for slot in controller.slots.values() if slot.state == SS.STOPPED]
    if stuck and not controller.running():
        # The task itself is still in flight: say how to go on once the cause is
        # fixed, as a second `ferrus run --task` would be refused.
        note("giving up: the %s is stopped (the reason is above); the task stays %s "
             "— once that is fixed, `ferrus run --resume` goes on with it "
             "(`ferrus reset` drops it)"
             % (" and the ".join(stuck), store.read_state().state), exit=RUN_FAILED)
        return RUN_FAILED
    return None


def _record_checkout_end(store, task, code, reason, note=None):
    """A queued task run in the checkout ended with exit ``code``: done — or unchanged,
    approved while its diff is empty — or failed with ``reason``.  A cancel from another
    shell meanwhile stays a cancel."""
    status = FAILED_STATUS
    if code == RUN_COMPLETE:
        status = UNCHANGED_STATUS if _changed_nothing(store) else DONE_STATUS
    changes = {"status": status, "ended_at": format_timestamp(store.clock())}
    if status == FAILED_STATUS and reason:
        changes["reason"] = reason
    if update_task(store, HUMAN, task, "task_" + status, changes,
                   only_from=(RUNNING_STATUS,)) is not None and status == UNCHANGED_STATUS \
            and note is not None:
        note("task %s was approved, and it changed nothing (its diff is empty): approved, "
             "no change" % short_task_id(task), "warning", task_id=task, status=status)
    memory_after_task_end(store)


def settle_checkout_queue_task(store, note=None):
    """The queued task the checkout holds, once it is Complete or Failed (a human approved
    it after its run stopped to wait for them): its queue record says so now, before
    another task takes the checkout.  Returns its id, or None when there is none."""
    data = store.project_state()
    if not data.task_id or data.state not in (S.COMPLETE, S.FAILED):
        return None
    record = dict(task_records(store)).get(data.task_id)
    if not record or record.get("status") != RUNNING_STATUS or record.get("store") != "project":
        return None
    _record_checkout_end(store, data.task_id,
                         RUN_COMPLETE if data.state == S.COMPLETE else RUN_FAILED,
                         data.failure_reason, note)
    return data.task_id


def _ended_in_the_checkout(store, task):
    """How queue task ``task`` ended in the checkout when another task has taken its place
    since: RUN_COMPLETE or RUN_FAILED as its last move in the journal says, or None (it
    was replaced while still in flight)."""
    for entry in store.journal_entries_backwards():
        if entry.get("task_id") != task:
            continue
        if entry.get("event") == "create_task":
            return None
        if entry.get("to") in (S.COMPLETE.value, S.FAILED.value) and \
                entry.get("from") != entry.get("to"):
            return RUN_COMPLETE if entry["to"] == S.COMPLETE.value else RUN_FAILED
    return None


def _changed_nothing(store):
    """Whether the checkout's task changed nothing since its base (git says so; without
    git nothing is known, and the task counts as done)."""
    try:
        return op_diff(store, stat_only=True).data.get("files") == []
    except FerrusError:
        return False


def _branch_tasks_start_from(store):
    """With [git] branch set: the branch the checkout is on as a queue's run begins, the
    one each of its tasks starts from (None when there is none to keep to)."""
    try:
        if not store.config().git.branch:
            return None
        return current_branch(store.root)
    except FerrusError:
        return None


def _back_to_home_branch(store, home, note):
    """Before the next queued task: a checkout left on the previous task's branch ([git]
    branch) goes back to ``home``, so the task starts from the user's branch, not from
    the previous task's work.  A checkout with uncommitted changes stays where it is."""
    if not home:
        return
    with contextlib.suppress(FerrusError):
        branch = current_branch(store.root)
        previous = (store.project_state().task_base or {}).get("task_branch")
        if branch == home or branch != previous:
            return
        changed = worktree_changes(store.root, task_diff_exclusions(store))
        if changed:
            note("the next task starts on %s, the last task's branch, not on %s: the checkout "
                 "has uncommitted changes (%s)" % (branch, home, ", ".join(
                     map(display_path, changed[:3]))),
                 "warning", branch=branch, home=home)
            return
        run_git(store.root, ["checkout", "-q", home])
        note("back on %s, so the next task starts from it (the last task's work stays on "
             "its branch %s)" % (home, branch), branch=home, left=branch)


def run_queue(store, out=None, **run_options):
    """`ferrus run` with tasks queued and [parallel] max_tasks = 1: each queued task in
    turn, as the project's own task in the checkout (exactly `ferrus run --task`).  A
    failed task does not stop the queue; the exit code is the worst of the runs."""
    out = out or (lambda text: say(text, flush=True))
    show = run_printer(out, run_options.get("mode", "lines"))

    def note(text, level="info", **data):
        show(HqMessage(level, "ferrus run: " + text, "run", data))
    worst = RUN_COMPLETE
    for task, _, problem in checked_task_records(store):
        if problem:
            out("ferrus run: " + damaged_task_note(task, problem))
            worst = RUN_FAILED
    home = _branch_tasks_start_from(store)
    for task, record in task_records(store):
        # A queued task an earlier run took up in the checkout: resumed, or recorded.
        if record.get("status") != RUNNING_STATUS or record.get("store") != "project":
            continue
        data = store.project_state()
        code = None
        if data.task_id == task and data.state in ACTIVE_STATES:
            note("resuming task %s from the queue" % short_task_id(task), task_id=task)
            code = run_loop(store, None, resume=True, out=out, **run_options)
        elif data.task_id == task and data.state in (S.COMPLETE, S.FAILED):
            code = RUN_COMPLETE if data.state == S.COMPLETE else RUN_FAILED
        elif not _created_since_taken(store, task):
            # The run that took it stopped before the task began: it was never worked on.
            _put_back_in_queue(store, task, "the run that took it stopped before it began")
            note("task %s was taken by a run that stopped before it began; it is back in the "
                 "queue" % short_task_id(task), task_id=task)
            continue
        if code is None and _ended_in_the_checkout(store, task) == RUN_COMPLETE:
            # Approved by hand, then replaced by another task before any run recorded it.
            update_task(store, HUMAN, task, "task_" + DONE_STATUS, {
                "status": DONE_STATUS, "ended_at": format_timestamp(store.clock())},
                only_from=(RUNNING_STATUS,))
            note("task %s was approved after its run stopped: done" % short_task_id(task),
                 task_id=task)
            continue
        if code is None:
            _record_checkout_end(store, task, RUN_FAILED, (
                "it ran in the checkout, which now holds %s (state %s); `ferrus log` shows "
                "what happened to it" % ("task %s" % data.task_id if data.task_id
                                         else "no task", data.state)))
        elif code in (RUN_COMPLETE, RUN_FAILED):
            _record_checkout_end(store, task, code, data.failure_reason, note)
        if code not in (None, RUN_COMPLETE, RUN_FAILED):
            return code
        worst = max(worst, code or RUN_FAILED)
    # What would stop a run before its task starts (a ferrus.toml that does not load, an
    # agent that cannot start) is found before a task is taken: it must not use one up.
    store.config()
    if run_options.get("launcher") is None:
        require_headless_agents(store)
    races_said = False
    while True:
        queued = [(task, record) for task, record in task_records(store)
                  if record.get("status") == QUEUED_STATUS]
        races = sorted({race_id_of(record) for _, record in queued if race_id_of(record)})
        if races and not races_said:
            races_said = True
            # A race's attempts run side by side, each in its own worktree.
            note("%s stay%s queued: a race's attempts run side by side in worktrees, with "
                 "`ferrus run --parallel N` (N at least its attempts)" % (
                     ", ".join("race %s" % race for race in races),
                     "s" if len(races) == 1 else ""), "error", races=races)
            worst = RUN_FAILED
        queued = [(task, record) for task, record in queued if not race_id_of(record)]
        if not queued:
            return worst
        task, record = queued[0]
        origin = record.get("origin") or {}
        note("task %s from the queue (%d left after it): %s" % (
            short_task_id(task), len(queued) - 1, record.get("title", "")), task_id=task,
            queued=len(queued) - 1)
        _back_to_home_branch(store, home, note)
        if update_task(store, HUMAN, task, "dispatch_task", {
                "status": RUNNING_STATUS, "store": "project",
                "started_at": format_timestamp(store.clock())},
                only_from=(QUEUED_STATUS,)) is None:
            continue                # cancelled from another shell since it was read
        try:
            code = run_loop(store, read_text(os.path.join(store.path(TASKS_DIR, task),
                                                          "TASK.md")),
                            out=out, origin=(origin.get("spec"), origin.get("milestone")),
                            reset=True, task_id=task, **run_options)
        except BaseException as err:
            # Refused (or interrupted) before the task began in the checkout: it goes back
            # to the queue, not used up.  One that began stays running: the next run
            # resumes it.
            with contextlib.suppress(Exception):
                if store.project_state().task_id != task:
                    _put_back_in_queue(store, task, "the run stopped before it began: %s" % (
                        err.message if isinstance(err, FerrusError)
                        else type(err).__name__))
            raise
        if code in (RUN_COMPLETE, RUN_FAILED):
            _record_checkout_end(store, task, code, store.project_state().failure_reason, note)
        if code not in (RUN_COMPLETE, RUN_FAILED):
            return code            # a question, a timeout or a checkpoint: stop here
        worst = max(worst, code)


def _created_since_taken(store, task):
    """Whether queue task ``task`` began in the checkout (a create_task entry for it)
    after the run that took it (its dispatch_task entry): the journal is read back to
    that entry only."""
    for entry in store.journal_entries_backwards():
        if entry.get("task_id") == task and entry.get("event") == "create_task":
            return True
        if entry.get("task_id") == task and entry.get("event") == "dispatch_task":
            return False
    return False


def _put_back_in_queue(store, task, why):
    """A queue task taken for the checkout that never began there: queued again."""
    with store.transaction(HUMAN.agent_id) as tx:
        record = read_task_record(store.dir, task)
        if record.get("status") != RUNNING_STATUS:
            return
        for key in ("store", "started_at", "ended_at", "reason"):
            record.pop(key, None)
        record["status"] = QUEUED_STATUS
        write_task_record(store, task, record)
        tx.set(tx.state, "requeue_task", reason=why[:500])
        tx.journal_task_id = task


def run_milestones(store, wanted="next", until_done=False, timeout=None, resume=False,
                   reset=False, out=None, clock=time.monotonic, **run_options):
    """``ferrus run --milestone ID|next`` and ``--until-done``: one task per spec milestone.

    Each milestone becomes a task whose origin is that milestone, so approving it ticks
    the box and advances the selection.  With ``until_done`` the next ready milestone
    follows until none is left; any other ending (Failed, a question nobody can answer,
    a capacity checkpoint, the timeout) stops the run with that ending's exit code."""
    out = out or (lambda text: say(text, flush=True))
    show = run_printer(out, run_options.get("mode", "lines"))
    started = clock()

    def note(text, level="info", **data):
        show(HqMessage(level, "ferrus run: " + text, "run", data))

    def time_left():
        return None if timeout is None else max(0.0, timeout - (clock() - started))
    home = _branch_tasks_start_from(store)
    if resume and store.read_state().state in ACTIVE_STATES:
        code = run_loop(store, None, time_left(), True, out=out, clock=clock, **run_options)
        if code != RUN_COMPLETE or not until_done:
            return code
        wanted = "next"
    previous = None
    finished = 0
    while True:
        found = find_milestone(store, wanted)
        if found is None:
            note("every milestone is complete (%d done in this run)" % finished
                 if finished else "every milestone of the spec is complete")
            return RUN_COMPLETE
        path, text, milestone = found
        state = store.read_state().state
        if state in ACTIVE_STATES:
            # Checked before the selection moves: retargeting a running task was an
            # upstream bug (see ARCHITECTURE.md, 'Differences from upstream ferrus', item 16).
            raise FerrusError("a task is already in flight (state %s)" % state,
                              "run `ferrus run --resume` to continue it, or `ferrus reset`")
        if (path, milestone.id) == previous:
            raise FerrusError("milestone %s of %s was approved but its box is still open"
                              % (milestone.id, path),
                              "tick `- [x]` on its line in the spec, then run again")
        previous = (path, milestone.id)
        _back_to_home_branch(store, home, note)
        op_select_milestone(store, HUMAN, path, milestone.id)
        note("milestone %s (%s) of %s" % (milestone.display(), milestone.id, path),
             milestone=milestone.id, spec=path)
        code = run_loop(store, milestone_task_text(path, text, milestone), time_left(),
                        out=out, clock=clock, origin=(path, milestone.id), reset=reset,
                        **run_options)
        if code != RUN_COMPLETE or not until_done:
            return code
        finished += 1
        reset = False       # --reset clears the Failed task the run started from, only that one
        wanted = "next"


def _run_line(message):
    if message.text.startswith("ferrus run: "):
        return message.text            # ferrus run's own words, as they always were
    stamp = time.strftime("%H:%M:%S")
    if message.kind == "question":
        return "%s  question for a human:\n%s" % (stamp, message.text)
    if message.kind == "confirm":
        return "%s  your confirmation is needed:\n%s" % (stamp, message.text)
    return "%s  %s%s" % (stamp, "" if message.kind in ("transition", "info", "agent")
                         else message.kind + ": ", message.text)


def _run_json(message):
    """One message as one JSON line: time, event, level, text, then the event's facts."""
    record = {"time": format_timestamp(utc_now()), "event": message.event or "info",
              "level": message.kind, "text": message.text}
    for key, value in message.data.items():
        record.setdefault(key, value)
    # Insertion order (time, event, level, text first) reads better than sorted keys.
    return json_for_terminal(json.dumps(record, ensure_ascii=False, separators=(",", ":"),
                                        default=str))
