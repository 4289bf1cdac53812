"""HQ's task commands: /task, /tasks, /run, /approve, /reject, /reset.

/task, /tasks, /run, /resume, /approve, /reject, /stop, /reset, /check."""

import contextlib

from .basics import FerrusError, UsageError
from .task_machine import ACTIVE_STATES, S, WORK_STATES, failure_summary
from .session_machine import CHECKPOINT, EMERGENCY_STOP
from .store import PARALLEL_MIRROR_KEY, QUEUED_STATUS, RUNNING_STATUS, read_task_record
from .specs import resolve_selected
from .operations import (Caller, HUMAN, op_create_task, op_human_approve, op_human_reject,
                         op_stage_task_origin, short_task_id)
from .work import op_check, op_force_reset, op_run_checks_only
from .task_queue import (op_cancel_task, op_enqueue_milestone, op_enqueue_ready,
                         op_enqueue_task, op_retry_task, require_task_id, task_records)
from .prompts import prompt_task_definition
from .parallel import ParallelRunner
from .run import require_headless_agents
from .hq_board import TaskBoard


class HqTaskCommands:
    """HQ's commands on tasks: /task, /tasks, /run, /resume, /approve, /reject, /review,
    /stop, /continue, /reset, /check."""

    def cmd_check(self, rest):
        if rest == "--force":
            run, config = op_run_checks_only(self.store)
            self.write("no check commands configured" if run is None else
                       "checks passed" if run.passed else run.report(
                           config.limits.max_feedback_lines))
        else:
            try:
                self.write(op_check(self.store, Caller("human", "human:hq:0")).text)
            except FerrusError as err:
                if self.store.read_state().state in WORK_STATES:
                    raise
                # As `ferrus check`: outside a task the human is pointed at --force.
                raise FerrusError(err.message, "/check --force runs the checks in any state "
                                  "and changes nothing") from err

    def driving(self):
        """(store, controller) of the task whose agents /resume, /review and /tell mean:
        the attached task's, run by this HQ, else the checkout's own."""
        if self.attached:
            controller = self.task_controller(self.attached)
            if controller is None:
                raise FerrusError("no agent of task %s runs here" % short_task_id(self.attached),
                                  "/run works the queue, and resumes it")
            return controller.store, controller
        data = self.store.read_state()
        if self.controller.mirrors_parallel_task(data) and data.state in ACTIVE_STATES:
            raise FerrusError("the checkout's state shows parallel task %s, whose agents are "
                              "its own" % short_task_id(data.extra[PARALLEL_MIRROR_KEY]),
                              "/attach ID first (/tasks lists the tasks)")
        return self.store, self.controller

    def cmd_resume(self, rest):
        store, controller = self.driving()
        data = store.read_state()
        if data.state not in ACTIVE_STATES:
            raise FerrusError("nothing to resume: the state is %s" % data.state,
                              "start a task with /task")
        controller.restart_slots()
        self.write("Resuming the task (%s)." % data.state)

    def cmd_approve(self, rest):
        if rest:
            raise UsageError("usage: /approve (it takes no arguments; /reject NOTES sends the "
                             "task back)")
        self.write(op_human_approve(self.human_target((S.AWAITING_CONFIRMATION,)), HUMAN,
                                    via="hq").text)

    def cmd_reject(self, rest):
        if not rest:
            raise UsageError("usage: /reject NOTES — say what must change; the executor gets "
                             "them as review notes")
        self.write(op_human_reject(self.human_target((S.AWAITING_CONFIRMATION,)), HUMAN, rest,
                                   via="hq").text)

    def cmd_review(self, rest):
        store, controller = self.driving()
        state = store.read_state().state
        if state == S.AWAITING_CONFIRMATION:
            raise FerrusError("the reviewer already approved; the task waits for you",
                              "/approve, or /reject NOTES")
        if state != S.REVIEWING:
            raise FerrusError("there is no submission to review")
        controller.restart_slots()

    def cmd_stop(self, rest):
        if self.runner is not None or self.run_width:
            # The parallel run ends; its tasks stay in flight for the next /run.
            if self.runner is not None and self.runner.controllers and not self.confirm(
                    "Stop the parallel run and its agents (%d task%s in flight)?" % (
                        len(self.runner.controllers),
                        "" if len(self.runner.controllers) == 1 else "s")):
                return
            runner, self.runner, self.run_width = self.runner, None, None
            if runner is not None:
                runner.shutdown()
            self.write("The parallel run is stopped; /run resumes its tasks.")
        if self.controller.running() and self.confirm("Stop every agent session?"):
            self.controller.stop_all()
            self.controller.paused = True
            self.write("Stopped. /resume starts them again.")

    def cmd_continue(self, rest):
        runner = self.runner if self.runner is not None and self.runner.checkpoint else None
        if not self.controller.checkpoint and runner is None:
            raise FerrusError("there is no capacity checkpoint to continue from")
        if self.controller.checkpoint:
            self.controller.continue_after_checkpoint()
            self.controller.paused = False
        if runner is not None:
            runner.continue_after_checkpoint()
        self.write("Continuing; the capacity budget counts again from now.")

    def cmd_reset(self, rest):
        data = self.store.read_state()
        if data.state == S.IDLE:
            self.write("Nothing to reset: the state is already Idle.")
            return
        if data.state in ACTIVE_STATES and not self.confirm(
                "The task is %s. Reset it to Idle and clear its files?" % data.state):
            return
        self.controller.stop_all()
        self.write(op_force_reset(self.store, HUMAN).text)

    def cmd_tasks(self, rest):
        rows = self.board.rows(force=True)
        if not rows:
            ended = len(task_records(self.store))
            self.write("No task is queued or running%s: /task add TEXT queues one." % (
                " (%d ended before HQ started: `ferrus tasks` lists them)" % ended
                if ended else ""))
            return
        self.write(TaskBoard.HEADER)
        for row in rows:
            self.write(self.board.line(row, attached=self.attached))
        self.write("%s%s" % (self.board.summary(rows), "; the run works %d at a time" %
                             self.runner.max_tasks if self.runner is not None else
                             "; the run takes queued tasks %d at a time" % self.run_width
                             if self.run_width else
                             "; /run works the queue" if any(row.get("status") in (
                                 QUEUED_STATUS, RUNNING_STATUS) for row in rows) else ""))

    def task_add(self, rest):
        """/task add TEXT | --milestone SPEC ID | --ready SPEC: queue work for /run."""
        words = rest.split()
        usage = UsageError("usage: /task add TEXT | --milestone SPEC ID | --ready SPEC")
        if not words:
            raise usage
        if words[0] == "--milestone":
            if len(words) != 3:
                raise usage
            outcome = op_enqueue_milestone(self.store, HUMAN, words[1], words[2])
        elif words[0] == "--ready":
            if len(words) != 2:
                raise usage
            outcome = op_enqueue_ready(self.store, HUMAN, words[1])
        elif words[0].startswith("--"):
            raise usage
        else:
            outcome = op_enqueue_task(self.store, HUMAN, rest)
        self.write(outcome.text)
        if self.runner is not None or self.run_width:
            self.write("The run takes it up when a slot is free (%d at a time)."
                       % (self.runner.max_tasks if self.runner is not None else
                          self.run_width))
        elif outcome.data.get("task_id") or outcome.data.get("queued"):
            self.write("/run works the queue (%s)." % self.run_width_text())

    def run_width_text(self):
        width = 1
        with contextlib.suppress(FerrusError):
            width = self.store.config().parallel.max_tasks
        return "%d at a time, [parallel] max_tasks" % width if width > 1 else \
            "/run N: N at a time, each task in its own git worktree"

    def cmd_run(self, rest):
        words = rest.split()
        allow_red_base = "--allow-red-base" in words
        words = [word for word in words if word != "--allow-red-base"]
        if len(words) > 1 or (words and not (words[0].isdigit() and 1 <= int(words[0]) <= 64)):
            raise UsageError("usage: /run [N] [--allow-red-base] — work the queue N tasks at a "
                             "time (1 to 64; default [parallel] max_tasks)")
        self.allow_red_base = allow_red_base
        width = int(words[0]) if words else self.store.config().parallel.max_tasks
        if self.runner is not None or self.run_width:
            if self.runner is None:
                self.run_width = width
                self.write("Tasks queued from now on are worked %d at a time." % width)
                return
            if not words or width == self.runner.max_tasks:
                raise FerrusError("the queue is being worked already (%d at a time)"
                                  % self.runner.max_tasks, "/tasks shows the board; /run N "
                                                            "changes how many at a time")
            self.runner.max_tasks = self.run_width = width
            self.write("The run now works %d task%s at a time." % (width, "" if width == 1
                                                                  else "s"))
            return
        if width < 2 and not words:
            raise FerrusError("[parallel] max_tasks is 1: a task at a time, in the checkout",
                              "/run N works the queue N at a time, each task in its own git "
                              "worktree (`ferrus run` works it one by one in the checkout)")
        require_headless_agents(self.store)
        if not any(record.get("status") in (QUEUED_STATUS, RUNNING_STATUS)
                   for _, record in task_records(self.store)):
            self.run_width = width
            self.write("The queue is empty: tasks queued from now on (/task add, the "
                       "supervisor's enqueue_task) are worked %d at a time; /stop ends the "
                       "run." % width)
            return
        self.start_run(width)
        self.write("Working the queue %d at a time, each task in its own worktree: /tasks "
                   "shows the board, /attach ID follows one task; /stop ends the run." % width)

    def start_run(self, width):
        """A ParallelRunner over the queue (P0: it resumes what a previous run left)."""
        runner = ParallelRunner(self.store, self._runner_emit, width, clock=self.clock,
                                bell=self.ring_bell, allow_red_base=self.allow_red_base)
        try:
            runner.start()
        except BaseException:
            runner.shutdown()
            self.run_width = None
            raise
        self.runner, self.run_width = runner, width

    def cmd_task(self, rest):
        verb, _, more = rest.partition(" ")
        if verb == "add":
            self.task_add(more.strip())
            return
        if verb == "cancel":
            if not more.strip() or len(more.split()) != 1:
                raise UsageError("usage: /task cancel ID (/tasks lists the tasks)")
            task = require_task_id(self.store, more.strip())
            if read_task_record(self.store.dir, task).get("status") == RUNNING_STATUS and \
                    not self.confirm("Task %s is running: cancel it (its work is saved "
                                     "first)?" % short_task_id(task)):
                self.write("Nothing changed.")
                return
            # The runner of /run removes the worktree of a task it works; any other (a
            # failed task's kept one, or none of /run's) goes here.
            in_runner = self.runner is not None and task in self.runner.controllers
            self.write(op_cancel_task(self.store, HUMAN, task,
                                      remove_worktree=not in_runner).text)
            return
        if verb == "retry":
            if not more.strip() or len(more.split()) != 1:
                raise UsageError("usage: /task retry ID (/tasks lists the tasks)")
            self.write(op_retry_task(self.store, HUMAN, more.strip()).text)
            return
        data = self.store.read_state()
        if self.controller.mirrors_parallel_task(data) and data.state in ACTIVE_STATES:
            raise FerrusError("parallel tasks are in flight, so the checkout takes no task of "
                              "its own now", "/task add TEXT queues it for the run")
        if data.state in ACTIVE_STATES:
            raise FerrusError("a task is in flight (%s)" % data.state, "/resume or /reset first")
        if data.state == S.FAILED and not self.confirm(
                "The last task failed (%s). Reset it and start a new task?"
                % failure_summary(data.failure_reason)):
            self.write("Nothing changed; the failed task is kept (/reset clears it).")
            return
        # Creating a task is a transition HQ drives: it passes the capacity gate the way
        # `ferrus run --task` does, whether HQ or the supervisor creates it.
        if self.controller.checkpoint and not self.controller.recheck_checkpoint():
            raise FerrusError("no new task: the capacity checkpoint holds (%s)"
                              % self.controller.checkpoint.get("signal"),
                              "/continue counts the budget again from now, or raise the limit "
                              "in [capacity]")
        if self.controller.gate("transition:create_task") in (CHECKPOINT, EMERGENCY_STOP):
            raise FerrusError("no new task: the capacity gate stopped it",
                              "/continue counts the budget again from now, or raise the limit "
                              "in [capacity]")
        if data.state in (S.COMPLETE, S.FAILED):
            op_force_reset(self.store, HUMAN)
        if rest and rest != "--manual":
            created = op_create_task(self.store, HUMAN, rest, origin=(None, None))
            for warning in created.data.get("warnings", ()):
                self.write("warning: %s" % warning)
            if created.data.get("branch"):
                self.write("The task works on the new git branch %s." % created.data["branch"])
            self.controller.paused = False
            return
        milestone = spec = None
        if rest != "--manual" and data.selected_milestone:
            with contextlib.suppress(FerrusError):
                spec, milestone = resolve_selected(self.store.root, data)
        # The supervisor's create_task takes this origin, so approving the task ticks the
        # milestone and advances the selection.
        op_stage_task_origin(self.store, HUMAN, spec, milestone.id if milestone else None)
        try:
            self.interactive("supervisor", prompt_task_definition(milestone, spec))
        finally:
            if self.store.read_state().state == S.IDLE:
                op_stage_task_origin(self.store, HUMAN)
        self.controller.paused = False
