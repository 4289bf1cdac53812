"""Cancelling a queue task from a front end: the question first, then the cancel.

`ferrus task cancel` and the web board cancel a queue task the same way: a running
task (or one whose worktree's work would be dropped) needs the human's yes first, then
agents a dead orchestrator left on the task are stopped, op_cancel_task ends it, and
the live `ferrus run --parallel` working it (if one does) removes its worktree, else the
cancel does.  HQ's /task cancel knows its own runner and calls op_cancel_task itself."""

import contextlib

from .basics import FerrusError
from .store import RUNNING_STATUS, read_task_record
from .operations import short_task_id
from .task_queue import op_cancel_task, require_task_id
from .sessions import describe_orchestrator
from .orchestrator import running_orchestrator, stop_orphaned_agents
from .parallel import live_parallel_run


def cancel_needs_confirmation(store, task, discard=False):
    """The question to ask before cancelling ``task`` (as `ferrus task cancel` asks it),
    or None when a cancel needs no yes: only a running task, or dropping a worktree's
    work, does."""
    task = require_task_id(store, task)
    record = read_task_record(store.dir, task)
    if not (record.get("status") == RUNNING_STATUS or (discard and record.get("worktree"))):
        return None
    state = ""
    with contextlib.suppress(FerrusError):
        state = " (%s)" % store.for_task(task).read_state().state
    return "Task %s is %s%s: cancel it%s?" % (
        short_task_id(task), record.get("status"), state,
        " and DROP the work in its worktree" if discard else " (its work is saved first)")


def cancel_queue_task(store, caller, task, discard=False, out=None):
    """Cancel a queue task once the human said yes: agents a dead orchestrator left on
    it are stopped first; the run working it (if one does) removes its worktree, else
    this does.  Each line to show goes to ``out`` as it happens; returns them all."""
    lines = []

    def tell(line):
        lines.append(line)
        if out is not None:
            out(line)
    task = require_task_id(store, task)
    running = read_task_record(store.dir, task).get("status") == RUNNING_STATUS
    runner = live_parallel_run(store) if running else None
    if running and running_orchestrator(store) is None:
        # A dead orchestrator may have left the task's agents at work in its worktree.
        for note in stop_orphaned_agents(store, task):
            tell(note)
    tell(op_cancel_task(store, caller, task, remove_worktree=runner is None,
                        discard=discard).text)
    if runner is not None:
        tell("The running %s stops its agents and removes its worktree and branch."
             % describe_orchestrator(runner))
    return lines
