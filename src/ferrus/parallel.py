"""Parallel tasks: the queue worked in worktrees through the phase machine.

ParallelRunner prepares worktrees, dispatches each task's controller, collects what
they ask of a human and hands approved tasks to the merge queue; .ferrus/parallel.json
keeps the phase, so a run killed anywhere is resumed by the next one."""

import collections
import contextlib
import dataclasses
import functools
import json
import os
import threading
import time

from .basics import FerrusError, fields_of, format_timestamp, pretty_json, terminal_safe
from .system import atomic_write, read_text
from .config import CONFIG_FILE, PLACE_HERE, git_branch_name_problem
from .task_machine import ACTIVE_STATES, S, StateData, failure_summary
from .session_machine import EMERGENCY_STOP, SS
from .gates import (DispatchGateError, DispatchRecord, PhaseMachine, ShutdownRequired,
                    Signals, phase_words, run_dispatch_gates)
from .store import (CANCELLED_STATUS, ENDED_STATUSES, FAILED_STATUS, FERRUS_DIR,
                    MERGED_STATUS, PARALLEL_MIRROR_KEY, PUBLISHED_STATUS, QUEUED_STATUS,
                    RUNNING_STATUS, TASK_BRANCH_PREFIX, TASK_RECORD_FILE,
                    TaskRecordDamaged, UNCHANGED_STATUS, _shown, damaged_task_note,
                    load_task_record, read_task_record)
from .checks import _status_note, run_checks
from .git import (GitUnavailable, TamperedWorktree, current_branch, delete_task_refs,
                  git_repository, record_task_base, run_git)
from .worktrees import (_worktree_entries, create_task_worktree, default_worktree_dir,
                        list_task_worktrees, own_checkout, remove_review_checkout,
                        remove_task_worktree, review_checkout_path, target_head)
from .sandbox import SandboxUnavailable, sandbox_tool
from .bootstrap import (choose_task_port, copy_into_worktree, copy_sources, gate_port,
                        port_environment, tear_down_task, with_port)
from .operations import (HUMAN, ORCHESTRATOR, confirmation_summary, op_create_task,
                         op_human_approve, op_human_reject, short_task_id,
                         task_diff_exclusions, task_git_site)
from .work import op_answer
from .base_checks import (RedBaseRefused, cached_base_check, check_base,
                          describe_base_check, red_base_note, remove_gate_checkout,
                          without_red_base_note)
from .task_queue import (_TASK_ID_RE, _remove_task_leftovers, checked_task_records,
                         count_statuses, task_records, update_task)
from .memory import memory_after_task_end
from .remote import TeamRemote
from .register import copy_agent_configuration
from .sandbox_agents import confine_controller
from .server_host import server_host_environment
from .sessions import HqMessage
from .web_link import web_board_url
from .notify import Notifier
from .orchestrator import running_orchestrator
from .controller import HqController
from .place_tasks import PlaceRunning, PlaceTask
from .merge_queue import MergeQueue
from .race import RaceRunner


# -- `ferrus run`'s exit codes and output modes (the runner ends with the same codes) ------

RUN_COMPLETE, RUN_FAILED, RUN_TIMEOUT, RUN_NEEDS_HUMAN = 0, 1, 3, 4
RUN_CHECKPOINT = 3      # a capacity Checkpoint or EmergencyStop also ends the run with 3


RUN_OUTPUT_MODES = ("lines", "quiet", "json")
# What `ferrus run --quiet` leaves out: the running commentary, not what happened.
QUIET_EVENTS = ("tool_call", "heartbeat", "check_started", "session")


# -- parallel tasks: the queue worked through the phase machine ------------------------------
#
# ParallelRunner drives up to [parallel] max_tasks tasks of the queue at once, each in its
# own git worktree, with one HqController per task over that task's store, so each task's
# sessions, leases, gates and messages are exactly those of a single task.  The phase machine
# (Capacity gates) says what the runner does next; the controllers are polled in every phase,
# so agents already at work never wait for it.  .ferrus/parallel.json keeps the phase, the
# batch and its dispatch records across a crash: the next run goes from P0 straight back to
# the phase that was interrupted (ARCHITECTURE.md, 'Parallel tasks', has the mapping).

PARALLEL_RUN_FILE = "parallel.json"


def read_parallel_run(store):
    """.ferrus/parallel.json as a dict ({} when there is none or it is damaged)."""
    return load_parallel_run(store)[0]


def load_parallel_run(store):
    """(.ferrus/parallel.json as a dict, None), or ({}, what is wrong with it); ({}, None)
    when there is none."""
    try:
        text = read_text(store.path(PARALLEL_RUN_FILE), default="")
    except OSError as err:
        return {}, "it cannot be read: %s" % (err.strerror or err)
    if not text.strip():
        return {}, None
    try:
        run = json.loads(text)
    except ValueError as err:
        return {}, "not valid JSON: %s" % terminal_safe(str(err))[:120]
    problem = parallel_run_problem(run)
    return ({}, problem) if problem else (run, None)


def parallel_run_problem(run):
    """What is wrong with ``run`` as parallel.json's content (what ParallelRunner._save
    writes), or None."""
    if not isinstance(run, dict):
        return "not a JSON object"
    phase = run.get("phase")
    if phase is not None and (isinstance(phase, bool) or not isinstance(phase, int) or
                              not 0 <= phase <= 7):
        return "phase %s is none of 0 to 7" % _shown(phase)
    batch = run.get("batch")
    if batch is not None and not (isinstance(batch, list) and all(
            isinstance(task, str) and _TASK_ID_RE.match(task) for task in batch)):
        return "batch is %s, not a list of task ids" % _shown(batch)
    dispatch = run.get("dispatch")
    fields = [field.name for field in fields_of(DispatchRecord)]
    if dispatch is not None and not (isinstance(dispatch, list) and all(
            isinstance(saved, dict) and set(saved) <= set(fields) and
            all(isinstance(saved.get(name, ""), str) for name in fields) and
            "task_id" in saved for saved in dispatch)):
        return "dispatch is %s, not a list of dispatch records" % _shown(dispatch)
    target = run.get("target")
    if target is not None and (not isinstance(target, str) or
                               git_branch_name_problem(target)):
        return "target %s is no branch name" % _shown(target)
    if not isinstance(run.get("ended", False), bool):
        return "ended is %s, not true or false" % _shown(run["ended"])
    pid = run.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int)):
        return "pid is %s, not a process id" % _shown(pid)
    return None


def live_parallel_run(store):
    """The orchestrator record of the `ferrus run --parallel` working this project now
    (it holds the orchestrator lock and wrote parallel.json), else None."""
    holder = running_orchestrator(store)
    run = read_parallel_run(store)
    if holder is None or run.get("ended") or holder.get("pid") != run.get("pid"):
        return None
    return holder


class ParallelRunner(PlaceRunning, MergeQueue, TeamRemote, RaceRunner):
    """The task queue, worked ``max_tasks`` at a time in git worktrees (see above).

    ``emit`` receives HqMessage objects (a task's carry its id in ``data``);
    ``ask``/``review`` answer questions and confirmations as in run_loop (None: nobody
    here can)."""

    def __init__(self, store, emit, max_tasks=None, clock=time.monotonic, launcher=None,
                 bell=None, ask=None, review=None, allow_red_base=False):
        self.store = store
        self._out = emit
        self.allow_red_base = allow_red_base
        self.base_note = ""            # what tasks are told of checks red on their base
        config = store.config()
        self.parallel = config.parallel
        self.max_tasks = max_tasks or self.parallel.max_tasks
        self.clock = clock
        self.launcher = launcher
        self.bell = bell
        self.ask, self.review = ask, review
        self.controllers = {}          # task -> HqController of a task in flight
        self.machine = PhaseMachine()
        self.batch = []                # the tasks P1 chose for this cycle
        self.dispatched = []           # DispatchRecords of this cycle
        self.target = None             # the branch tasks merge into
        self.repo = None
        self.worktree_dir = None
        self.integration = None        # {"task", "thread", "result"} while one runs
        # While a finished integration is wound up: what _end_task leaves until the next
        # integration has started (removing the merged task's worktrees).
        self.held_cleanups = None
        self.held_candidate = None     # (task, Integration) checked, waiting to fast-forward
        self.retry_at = None           # when a waiting integration is tried again
        self.waiting_said = None
        self.ended = collections.OrderedDict()   # task -> status, for the report
        self.damaged = {}              # task -> what is wrong with its task.json (said once)
        self.notifier = Notifier(store, self.emit, bell)    # every task's controller's
        self.waiting_human = set()
        self.setup_files_told = False   # once a run: setup leaves files git does not ignore
        self.checkpoint = None
        self.finished = False
        self.halted = None             # why the run stopped itself (the target moved outside)
        self.known_target = None       # the target's head as this run last left it
        self.tasks_completed = 0
        self._seen = None              # what step() last judged the tasks by
        self._starts_left = None       # agents a step may still start (None: not in a step)
        self._queued = None            # (state stamp, queued task ids)
        self._integrating = None       # (state stamp, controllers, tasks to integrate)
        self._init_places(config, max_tasks is not None)     # [parallel] places
        # Tasks prepared side by side: each takes a distinct port block, and `git worktree
        # add` runs one at a time (two at once can read each other's half-written entry).
        self._prepare_lock = threading.Lock()
        self._race_plan = None         # ((state stamp, free slots), the next batch)
        self.oversized = {}            # race -> attempts, of races too big for this run

    # -- messages --------------------------------------------------------------------------

    def emit(self, message):
        if not message.event:
            message.event = "run"
        self._out(message)

    def note(self, text, level="info", event="run", **data):
        """One line of the run's own; ``event`` names it for `--json` (see PROGRESS_EVENTS:
        integrating, merged, unchanged, sent_back, conflict), "run" for the rest."""
        self.emit(HqMessage(level, "ferrus run: " + text, event, data))

    def _task_emitter(self, task):
        prefix = "[%s] " % short_task_id(task)

        def emit(message):
            message.text = prefix + message.text
            message.data = dict(message.data or {}, task_id=task)
            self._out(message)
        return emit

    # -- persistence -----------------------------------------------------------------------

    def _save(self, working=True):
        """``working`` False: this process no longer works the queue (HQ's /stop), so a
        cancel from another shell cleans up after itself (see live_parallel_run)."""
        record = {"phase": self.machine.phase, "target": self.target, "batch": self.batch,
                  "dispatch": [dataclasses.asdict(r) for r in self.dispatched],
                  "ended": self.finished, "pid": os.getpid() if working else None,
                  "updated_at": format_timestamp(self.store.clock())}
        with self.store.lock():
            atomic_write(self.store.path(PARALLEL_RUN_FILE), pretty_json(record))

    def signals(self):
        """The run's usage: every task's sessions, calls, turns and tokens, summed; the
        largest context any running agent holds."""
        totals = collections.Counter()
        context = 0
        for controller in self.controllers.values():
            signals = controller.signals()
            for name in ("tool_calls", "sessions", "tokens_used", "turns"):
                totals[name] += getattr(signals, name)
            totals["parallel_agents"] += len(controller.running())
            context = max(context, signals.context_tokens_used)
        return Signals(tasks_completed=self.tasks_completed, context_tokens_used=context,
                       context_tokens_max=self.store.config().capacity.context_window,
                       **totals)

    def advance(self, target):
        """One phase transition: the gate decides, the journal records it (GateRecord)."""
        try:
            _, record = self.machine.transition(target, self.signals(),
                                                self.store.config().capacity)
        except ShutdownRequired as stop:
            self._journal_phase(stop.record)
            self.checkpoint = stop.record
            if stop.action == EMERGENCY_STOP:
                for controller in self.controllers.values():
                    controller.stop_all()
            self.note("capacity %s before %s: %s reached its limit; %s" % (
                stop.action, phase_words(target), stop.record.get("signal") or "a signal",
                "every agent was stopped" if stop.action == EMERGENCY_STOP
                else "nothing new starts"), "error", checkpoint=stop.record)
            self._save()
            return False
        # parallel.json first, the journal line last (as a commit writes STATE.json before
        # its line): whoever reads the new phase in the journal finds it saved for recovery.
        self._save()
        self._journal_phase(record)
        return True

    def _journal_phase(self, record):
        with contextlib.suppress(FerrusError, OSError):
            self.store.append_event("ferrus", "phase", record, task_id="")

    def continue_after_checkpoint(self):
        """HQ's /continue after a capacity checkpoint: the budget counts again from here
        (every task's, and the run's completed tasks), and the refused phase is tried
        again at the next step."""
        self.checkpoint = None
        self.tasks_completed = 0
        for controller in self.controllers.values():
            controller.continue_after_checkpoint()

    # -- the loop ------------------------------------------------------------------------

    def start(self):
        """P0: preflight, and the recovery of whatever a crashed run left."""
        try:
            self.repo = git_repository(self.store.root)
        except GitUnavailable as err:
            raise FerrusError("parallel tasks need a git repository: %s" % err.message,
                              "run `git init` and commit once, or run one task at a time "
                              "([parallel] max_tasks = 1)") from err
        if self.repo.operation_in_progress():
            raise FerrusError("a %s is in progress in the checkout"
                              % self.repo.operation_in_progress(),
                              "finish or abort it first: tasks merge into the target branch")
        previous, problem = load_parallel_run(self.store)
        if problem:
            self.note("%s/%s is damaged (%s): this run starts afresh (`ferrus doctor "
                      "--fix` sets the file aside)" % (FERRUS_DIR, PARALLEL_RUN_FILE, problem),
                      "warning")
        saved_target = previous.get("target") if not previous.get("ended") else None
        self.target = self.parallel.target or saved_target or current_branch(self.store.root)
        if self.target == saved_target and self.target != current_branch(self.store.root) \
                and target_head(self.store.root, self.target) is None:
            # The branch the interrupted run merged into was deleted or renamed since: the
            # tasks go to the branch checked out, as on a fresh start, rather than no run
            # ever starting again.
            self.target = current_branch(self.store.root)
            self.note("the interrupted run merged into %s, which is no branch any more: the "
                      "tasks now merge into %s (set [parallel] target to choose)" % (
                          saved_target, self.target or "the branch checked out"), "warning")
        if not self.target:
            raise FerrusError("parallel tasks need a target branch, and HEAD is detached",
                              "check out the branch the tasks should merge into, or set "
                              "[parallel] target")
        if target_head(self.store.root, self.target) is None:
            if current_branch(self.store.root) == self.target:
                raise FerrusError("the target branch %s has no commit yet" % self.target,
                                  "commit once (parallel tasks start from the target's head)")
            raise FerrusError("there is no branch %s to merge tasks into" % self.target,
                              "create it, or set [parallel] target to an existing branch "
                              "(\"\" = the branch checked out)")
        self.worktree_dir = default_worktree_dir(self.store.root, self.parallel.worktree_dir)
        if PLACE_HERE in self.place_order and self.place_slots.get(PLACE_HERE) and \
                self.place_configs[PLACE_HERE].sandbox.enabled:
            sandbox_tool()       # SandboxUnavailable: no task here may start unconfined
        project = self.store.project_state()
        if project.state in ACTIVE_STATES and not project.extra.get(PARALLEL_MIRROR_KEY):
            raise FerrusError("a task is in flight in the checkout itself (state %s)"
                              % project.state, "finish it with `ferrus run --resume` (or "
                              "`ferrus reset` it) before running tasks in parallel")
        self._remove_leftovers()
        self._tidy_places(task_records(self.store))
        resumed = []
        for task, record, problem in checked_task_records(self.store):
            if problem:
                self._leave_damaged(task, problem)
            if record.get("status") != RUNNING_STATUS or not (
                    record.get("worktree") or record.get("store") == "place"):
                continue
            if self._prepared_half_way(task):
                self._prepare_again(task)
                continue
            resumed.append(task)
            self._adopt(task)
        if resumed:
            self.note("resuming %d task%s a previous run left: %s" % (
                len(resumed), "" if len(resumed) == 1 else "s",
                ", ".join(short_task_id(t) for t in resumed)))
        self._settle_races()
        self._check_remote()
        # The server host starts now, so it is ready when the first agents start (the
        # check on the base takes a while).
        server_host_environment()
        self._check_base()
        self.known_target = target_head(self.store.root, self.target)
        interrupted = previous.get("phase") if not previous.get("ended") else None
        if isinstance(interrupted, int) and 1 <= interrupted <= 7:
            self.batch = [t for t in previous.get("batch") or [] if isinstance(t, str)]
            self.dispatched = []
            for saved in previous.get("dispatch") or []:
                with contextlib.suppress(TypeError):     # a damaged record: dispatch again
                    self.dispatched.append(DispatchRecord(**saved))
            self.machine.set_recovery_target(interrupted)
            if previous.get("pid"):        # it died working (a kill, a crash)
                self.note("the previous run stopped while %s; going on from there"
                          % phase_words(interrupted))
            else:                          # it ended on purpose, tasks still in flight
                self.note("going on where the previous run left off (%s)"
                          % phase_words(interrupted))
            return self.advance(interrupted)
        return self.advance(1)

    def _check_base(self):
        """Before any queued task starts: the checks on a clean checkout of the target's
        head, after [parallel] setup (gate_base; a red one refuses the run unless
        allow_red_base).  Tasks taken up again started before, from their own base."""
        if not self.queued():
            return
        head = target_head(self.store.root, self.target)
        try:
            self.base_note = gate_base(self.store, self.emit, "%s at %s" % (
                self.target, head[:12]), head, self.allow_red_base, setup=self.parallel.setup,
                port=gate_port(self.parallel))
        except RedBaseRefused:
            self.finished = True    # nothing ran: parallel.json stays as the last run left it
            remove_gate_checkout(self.store)
            raise

    def _remove_leftovers(self):
        """The worktree and branch of a task that was merged or cancelled just before a
        run died (recorded, not yet removed): removed now, so nothing leaks."""
        records = dict(task_records(self.store))
        with contextlib.suppress(FerrusError):
            for row in list_task_worktrees(self.store.root, TASK_BRANCH_PREFIX):
                task = (row.get("branch") or "")[len(TASK_BRANCH_PREFIX):]
                record = records.get(task) or {}
                if row.get("main") or record.get("status") not in (
                        MERGED_STATUS, UNCHANGED_STATUS, PUBLISHED_STATUS, CANCELLED_STATUS):
                    continue
                torn = tear_down_task(self.store, record)
                if torn:
                    self.note("finished task %s: %s" % (short_task_id(task), torn), "warning",
                              task_id=task)
                # Its review checkout too (detached, so not among the task worktrees).
                with contextlib.suppress(FerrusError, OSError):
                    remove_review_checkout(self.store.root, row.get("path") or
                                           record.get("worktree"))
                try:
                    remove_task_worktree(self.store.root, row.get("path") or
                                         record.get("worktree"), row["branch"])
                except FerrusError as err:
                    self.note("could not remove the worktree of finished task %s: %s"
                              % (short_task_id(task), err.message), "warning", task_id=task)

    # Agents one step starts at most (one per CPU, at least two).  Starting one is tens of
    # milliseconds of the runner's time and an agent CLI's start-up on the cores; a step
    # that started eight at once left every other task's hand-off (a submission to review,
    # an approval to the merge queue) waiting for it.  The rest start in the next steps.
    AGENT_STARTS_PER_STEP = max(2, os.cpu_count() or 1)

    def _may_start_agent(self):
        if self._starts_left is None:
            return True
        if self._starts_left <= 0:
            return False
        self._starts_left -= 1
        return True

    def step(self):
        """Poll every task's controller, then do what the current phase needs."""
        polled = list(self.controllers.values())
        self._starts_left = self.AGENT_STARTS_PER_STEP
        try:
            for controller in polled:
                controller.hold_session_moves()
            for controller in polled:
                controller.poll()
        finally:
            self._starts_left = None
            for controller in polled:
                controller.release_session_moves()
        # What the tasks' states ask of the runner changes only with a commit (or with a
        # question a controller has just shown): the task files are read only then, so a
        # long queue costs nothing while the agents work.
        seen = (self.store.state_stamp(), tuple(
            (task, c.shown_question, c.shown_confirmation,
             tuple(slot.state for slot in c.slots.values()))
            for task, c in self.controllers.items()))
        if seen != self._seen:
            self._seen = seen
            self._queued = None
            for task, controller in list(self.controllers.items()):
                try:
                    self._watch_task(task, controller)
                except TaskRecordDamaged as damaged:
                    self._leave_damaged(damaged.task, damaged.problem)
        if self.checkpoint or self.finished:
            return
        try:
            self._do_phase(self.machine.phase)
        except TaskRecordDamaged as damaged:
            # Found damaged as the phase worked on it: that task is left alone, and the
            # phase goes on with the others at the next step.
            self._leave_damaged(damaged.task, damaged.problem)

    def _do_phase(self, phase):
        if phase == 1:
            self._plan()
        elif phase == 2:
            self._prepare()
        elif phase == 3:
            self._dispatch()
        elif phase == 4:
            self._collect()
        elif phase == 5:
            self._integrate()
        elif phase == 6:
            self._report()
        elif phase == 7:
            self._cleanup()

    def _leave_damaged(self, task, problem):
        """A task whose task.json is damaged: its agents (if any) are stopped and this run
        leaves it alone — nothing is written over the record — saying so once, with the
        repair; the other tasks go on.  The run then ends with exit 1."""
        if self.integration is not None and self.integration["task"] == task:
            self._stop_integration()
        self._stop_controller(task)
        self.waiting_human.discard(task)
        if task in self.batch:
            self.batch.remove(task)
        self.dispatched = [r for r in self.dispatched if r.task_id != task]
        if self.held_candidate is not None and self.held_candidate[0] == task:
            self.held_candidate = None
        if task not in self.damaged:
            self.damaged[task] = problem
            self.note(damaged_task_note(task, problem), "error", task_id=task,
                      problem=problem)

    # -- P1 plan, P2 prepare, P3 dispatch ---------------------------------------------------

    def queued(self):
        """The queued tasks, oldest first (read again after each commit only)."""
        if self._queued is None or self._queued[0] != self.store.state_stamp():
            stamp, queued = self.store.state_stamp(), []
            for task, record, problem in checked_task_records(self.store):
                if problem:
                    self._leave_damaged(task, problem)
                elif record.get("status") == QUEUED_STATUS:
                    queued.append(task)
            self._queued = (stamp, self._without_oversized_races(queued))
        return list(self._queued[1])

    def free_slots(self):
        return min(max(0, self.max_tasks - len(self.controllers)), self.place_free_slots())

    def _plan(self):
        self.batch = self._next_batch()
        self.dispatched = []
        self.advance(2)

    def _prepare(self):
        todo = [task for task in self.batch if task not in self.controllers]
        if todo:
            self._sync_before_prepare()
        for task, ready in zip(todo, self._prepare_side_by_side(todo)):
            if not ready:
                self.batch.remove(task)
                self._unplace(task)
        self.advance(3)

    def _prepare_side_by_side(self, tasks):
        """_prepare_task for each of ``tasks``, all at once: each has its own worktree,
        [parallel] setup and store, so the batch waits for the slowest, not for the sum
        (the git processes, setup commands and fsyncs overlap).  A task that cannot be
        prepared is failed here, in the runner's thread."""
        if len(tasks) < 2:
            return [self._prepare_task(task) for task in tasks]
        results = [None] * len(tasks)

        def prepare(index, task):
            try:
                results[index] = self._prepare_task(task, fail=False)
            except BaseException as err:       # handed to the runner's thread below
                results[index] = err
        threads = [threading.Thread(target=prepare, args=(index, task), daemon=True,
                                    name="ferrus-prepare-%s" % short_task_id(task))
                   for index, task in enumerate(tasks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ready = []
        for task, result in zip(tasks, results):
            if isinstance(result, TaskRecordDamaged):
                self._leave_damaged(result.task, result.problem)
                result = False
            elif isinstance(result, FerrusError):
                self._end_task(task, FAILED_STATUS, "could not prepare its worktree: %s" %
                               result.full_text())
                result = False
            elif isinstance(result, BaseException):
                raise result
            ready.append(bool(result))
        return ready

    def _prepare_task(self, task, fail=True):
        """The task's worktree and branch from the target's head, ferrus's agent
        configuration copied into it, and its state created (Executing).  Idempotent, so
        a run that crashed half-way through it simply does it again.  A FerrusError fails
        the task (or, with ``fail`` False, is raised for the caller to do that)."""
        record = read_task_record(self.store.dir, task)
        if record.get("status") not in (QUEUED_STATUS, RUNNING_STATUS):
            return False
        place = record.get("place") if record.get("store") == "place" else None
        place = place or self._choose_place(task)
        if place is None:
            return False                       # no free slot at any place just now
        if place != PLACE_HERE:
            return self._prepare_at_place(task, record, place, fail)
        path = record.get("worktree") or os.path.join(self.worktree_dir, task)
        branch = record.get("branch") or TASK_BRANCH_PREFIX + task
        # A project in a subfolder of its repository works in that subfolder of the worktree.
        inside = os.path.relpath(self.store.root, self.repo.toplevel)
        workdir = path if inside == "." else os.path.join(path, inside)
        try:
            start = record.get("base") or target_head(self.store.root, self.target)
            changes = {"status": RUNNING_STATUS, "worktree": path, "workdir": workdir,
                       "branch": branch,
                       "base": start, "target": self.target, "store": "worktree",
                       "started_at": record.get("started_at") or format_timestamp(
                           self.store.clock())}
            with self._prepare_lock:
                port = choose_task_port(task_records(self.store), task, self.parallel)
                if port:
                    changes["port"] = port
                if update_task(self.store, ORCHESTRATOR, task, "prepare_task", changes,
                               only_from=(QUEUED_STATUS, RUNNING_STATUS),
                               worktree=path, branch=branch, base=start[:12],
                               **({"port": port} if port else {})) is None:
                    return False              # cancelled since it was read
                create_task_worktree(self.store.root, path, branch, start)
                # Its reviewer's checkout too, now, beside the other tasks being prepared:
                # at the reviewer's start (in the runner's step) only a reset to the
                # submission is left (see review_folder).
                own_checkout(self.store.root, review_checkout_path(path), start)
            copy_agent_configuration(self.store.root, workdir)
            self._copy_local_files(task, workdir)
            task_store = self.store.for_task(task)
            task_store.create_state(StateData())
            if task_store.read_state().state == S.IDLE:
                self._set_up_worktree(task, workdir, port)
                origin = record.get("origin") or {}
                op_create_task(task_store, ORCHESTRATOR,
                               without_red_base_note(task_store.read_file("TASK.md")) +
                               self.base_note,
                               origin=(origin.get("spec"), origin.get("milestone")),
                               task_id=task)
            resume = read_task_record(self.store.dir, task).get("resume_from")
            if isinstance(resume, str) and resume:
                # Retried after a cancel saved its work: the files go back as they were
                # (idempotent: `restore` makes them the saved commit's, however often).
                run_git(task_git_site(task_store), ["restore", "--source=" + resume,
                                                    "--worktree", "--", ":/"])
                update_task(self.store, ORCHESTRATOR, task, "task_work_restored",
                            {"resume_from": None}, commit=resume[:12])
        except TaskRecordDamaged:
            raise                              # not the task's failure: it is left alone
        except FerrusError as err:
            if not fail:
                raise
            self._end_task(task, FAILED_STATUS, "could not prepare its worktree: %s" %
                           err.full_text())
            return False
        return True

    def _set_up_worktree(self, task, path, port=None):
        """[parallel] setup in the new worktree (``port``: its block); raises FerrusError
        naming the failed command.  Files it makes that git does not ignore would become
        part of the task's work, merged with it, and conflict with every later task's own:
        the run says so, naming them."""
        before = _files_git_would_add(path) if self.parallel.setup else set()
        self._run_setup(path, "its worktree", "fix the command (it runs in the new worktree, "
                        "which holds only what git tracks and what [parallel] copy brings), "
                        "then `ferrus task cancel %s` and queue the task again"
                        % short_task_id(task), port=port)
        if not self.parallel.setup or self.setup_files_told:
            return
        made = sorted(_files_git_would_add(path) - before)
        if made:
            self.setup_files_told = True
            self.note("[parallel] setup made files git does not ignore in task %s's worktree "
                      "(%s%s): they become part of the task's work and are merged with it, "
                      "and each later task's own copy then conflicts with them; add them to "
                      ".gitignore" % (short_task_id(task), ", ".join(made[:5]),
                                      " and %d more" % (len(made) - 5) if len(made) > 5
                                      else ""), "warning", task_id=task, files=made[:20])

    def _copy_local_files(self, task, workdir):
        """[parallel] copy: the checkout's untracked local files into the new worktree,
        listed in the task's record so that none of them is ever part of its work."""
        if not self.parallel.copy:
            return
        paths = copy_sources(self.store.root, self.parallel.copy, skip=[self.worktree_dir])
        # Listed first: a file copied and not yet listed could reach a submission.
        update_task(self.store, ORCHESTRATOR, task, "task_files_copied", {"copied": paths},
                    count=len(paths), mode=self.parallel.copy_mode)
        copy_into_worktree(self.store.root, workdir, paths, self.parallel.copy_mode)

    def _run_setup(self, path, where, hint, wrap=None, port=None):
        run_worktree_setup(self.store, path, self.parallel.setup, where, hint, wrap, port)

    def _prepared_half_way(self, task):
        """A RUNNING task whose state was never created: _prepare_task marks the record
        running first, then makes the worktree, the task's STATE.json (Idle) and the task
        (Executing); a run killed in between leaves the state missing or Idle."""
        task_store = self.store.for_task(task)
        if not task_store.exists():
            return True
        if read_task_record(self.store.dir, task).get("store") == "place":
            return False    # prepared there; its mirror here stays Idle until it follows
        try:
            return task_store.read_state().state == S.IDLE
        except FerrusError:
            return False            # a damaged state: doctor's to repair, not ours to redo

    def _prepare_again(self, task):
        """Put a task prepared only half-way back in the queue, its worktree and branch
        kept in its record: preparing it again finishes what was begun (each step of
        _prepare_task is idempotent).  Never counted as a cancel: only op_cancel_task
        cancels."""
        self._stop_controller(task)
        self.waiting_human.discard(task)
        if update_task(self.store, ORCHESTRATOR, task, "requeue_task", {
                "status": QUEUED_STATUS}, only_from=(RUNNING_STATUS,),
                reason="prepared half-way") is not None:
            self.note("task %s was prepared only half-way when a run stopped: it is queued "
                      "again, and preparing it finishes its worktree" % short_task_id(task),
                      "warning", task_id=task)

    def _adopt(self, task):
        record = read_task_record(self.store.dir, task)
        task_store = self.store.for_task(task)
        if not task_store.exists() or record.get("status") != RUNNING_STATUS:
            return None             # cancelled (or ended) since it was chosen
        if record.get("store") == "place":
            return self._adopt_at_place(task, record)
        if record.get("worktree") and not os.path.isdir(task_store.workdir):
            # Its folder was deleted: put the worktree back on the task's branch (the work
            # committed there is kept; what was only in the folder is gone).
            try:
                create_task_worktree(self.store.root, record["worktree"], record["branch"],
                                     record.get("base"))
                copy_agent_configuration(self.store.root, task_store.workdir)
                self._copy_local_files(task, task_store.workdir)
            except (FerrusError, KeyError) as err:
                self._end_task(task, FAILED_STATUS, "its worktree %s is gone and could not "
                               "be made again: %s" % (record.get("worktree"), err))
                return None
            self.note("task %s's worktree was gone; made it again from its branch %s" % (
                short_task_id(task), record["branch"]), "warning", task_id=task)
        controller = HqController(task_store, emit=self._task_emitter(task), clock=self.clock,
                                  launcher=self.launcher, bell=self.bell,
                                  executor_agent=record.get("agent"), notifier=self.notifier,
                                  executor_model=record.get("model"))
        controller.may_start_agent = self._may_start_agent
        try:
            # [sandbox] on: its agents start confined, or the task fails saying how to
            # install bubblewrap (it never starts unconfined).
            self.sandboxes[task] = confine_controller(controller)
        except SandboxUnavailable as err:
            self._end_task(task, FAILED_STATUS, "its sandbox cannot start: %s" %
                           err.full_text())
            return None
        self.task_place[task] = PLACE_HERE
        self.controllers[task] = controller
        return controller

    def _dispatch(self):
        # P4 → P3 comes back here while queued tasks and free slots remain: those are
        # chosen and prepared now (P1 and P2 for them, inside this phase).
        if self.machine.phase == 3 and not self.batch:
            batch = self._next_batch()
            if batch:
                self._sync_before_prepare()
            for task in batch:
                if self._prepare_task(task):
                    self.batch.append(task)
                else:
                    self._unplace(task)
        for task in self.batch:
            if any(record.task_id == task for record in self.dispatched):
                continue
            # A task a crashed run dispatched was taken up again at start-up.
            controller = self.controllers.get(task) or self._adopt(task)
            if controller is None:
                continue
            choice = controller.agent_choice("executor")
            self.dispatched.append(DispatchRecord(task_id=task, role="executor",
                                                  agent=choice.agent if choice else "",
                                                  session_id=""))
            record = read_task_record(self.store.dir, task)
            self.note("dispatched task %s (%s) to %s %s" % (
                short_task_id(task), record.get("title", ""),
                choice.agent if choice else "no agent",
                "at place %s" % record["place"] if record.get("store") == "place" else
                "in %s" % controller.store.workdir), task_id=task,
                place=record.get("place") or PLACE_HERE)
        self._run_dispatch_gates()
        self.batch = []
        self.advance(4)

    def _run_dispatch_gates(self):
        """Coverage, batch size and delegation before P4 (see 'Dispatch gates'): a task a
        gate refuses is failed (delegation) or goes back to the queue (coverage, batch)."""
        records = {task: record for task, record in task_records(self.store)}
        allowed = list(self.parallel.delegates)
        if not allowed:
            with contextlib.suppress(FerrusError):
                executor = self.store.config().executor
                allowed = [executor.agent] if executor else []
        while True:
            try:
                run_dispatch_gates(list(self.batch), self.dispatched,
                                   [(t, records.get(t, {}).get("origin") or {})
                                    for t in self.batch], self.max_tasks, allowed)
                return
            except DispatchGateError as refused:
                with contextlib.suppress(FerrusError, OSError):
                    self.store.append_event("ferrus", "dispatch_gate", {
                        "gate": refused.gate, "tasks": list(refused.tasks),
                        "reason": refused.message}, task_id="")
                self.note("dispatch gate %s: %s" % (refused.gate, refused.message), "error")
                for task in refused.tasks:
                    if task in self.batch:
                        self.batch.remove(task)
                    self.dispatched = [r for r in self.dispatched if r.task_id != task]
                    if refused.gate in ("batch", "coverage"):
                        # Not dispatched (or one too many): back to the queue, to be
                        # chosen again when a slot is free.
                        self._stop_controller(task)
                        update_task(self.store, ORCHESTRATOR, task, "requeue_task",
                                    {"status": QUEUED_STATUS}, reason=refused.gate)
                    else:
                        self._end_task(task, FAILED_STATUS, "dispatch gate %s: %s" % (
                            refused.gate, refused.message))
                if not refused.tasks:
                    return

    # -- P4 collect --------------------------------------------------------------------------

    def _watch_task(self, task, controller):
        """What a task's state asks of the runner: a question or confirmation for the
        human, an end (failed or cancelled) to record."""
        try:
            data = controller.store.read_state()
        except FerrusError:
            return
        record, problem = load_task_record(self.store.dir, task)
        if problem:
            raise TaskRecordDamaged(task, problem)
        if record.get("status") == CANCELLED_STATUS:
            self._end_task(task, CANCELLED_STATUS, None)
            return
        if isinstance(controller, PlaceTask):
            self._watch_place_task(task, controller, data, record)
            return
        if data.state == S.IDLE:
            # Idle and not cancelled (a cancel writes both in one commit): its state was
            # never created, so it is prepared again, not taken for a cancel.
            self._prepare_again(task)
            return
        try:
            task_git_site(controller.store)
        except TamperedWorktree as err:
            self._end_task(task, FAILED_STATUS, "tampered: %s" % err.full_text())
            return
        except FerrusError:
            pass                 # a worktree gone or git failing: said where it matters
        if data.state == S.FAILED:
            self._end_task(task, FAILED_STATUS, data.failure_reason)
            return
        stopped = [slot.name for slot in controller.slots.values() if slot.state == SS.STOPPED]
        if stopped and not controller.running():
            # As `ferrus run` gives up on its task: no agent will move this one any more.
            self._end_task(task, FAILED_STATUS, "its %s is stopped (the reason is above); "
                           "once that is fixed, `ferrus task retry %s` queues it again" % (
                               " and ".join(stopped), short_task_id(task)))
            return
        if data.state == S.AWAITING_HUMAN and controller.shown_question:
            # While a board serves the project, the human answers there.
            answer = self.ask(controller.shown_question) if self.ask and \
                web_board_url(self.store) is None else None
            if answer is None:
                self._left_to_board(task, "question waits for your answer")
                self.waiting_human.add(task)
            elif answer.strip():
                op_answer(controller.store, HUMAN, answer)
            else:
                self._seen = None        # no answer yet: ask again at the next step
        elif data.state == S.AWAITING_CONFIRMATION and controller.shown_confirmation:
            decision = self.review(confirmation_summary(controller.store, data)) \
                if self.review and web_board_url(self.store) is None else None
            if decision is None:
                self._left_to_board(task, "approval waits for your confirmation")
                self.waiting_human.add(task)
            else:
                verdict, notes = decision
                with contextlib.suppress(FerrusError):
                    if verdict == "approve":
                        op_human_approve(controller.store, HUMAN, via="run")
                    else:
                        op_human_reject(controller.store, HUMAN, notes, via="run")
        else:
            self.waiting_human.discard(task)

    def _left_to_board(self, task, what):
        """Said once as ``task`` starts waiting for the human while a board serves the
        project (`ferrus web`, --web): where to answer, as nobody is asked here."""
        board = web_board_url(self.store, task)
        if board is not None and task not in self.waiting_human:
            self.note("task %s: the %s on the board: %s" % (short_task_id(task), what, board),
                      task_id=task)

    def _collect(self):
        if self.integrating():
            if self.advance(5):
                self._integrate()      # an approved task enters the merge queue at once
        elif self._next_batch():
            self.advance(3)
        elif not self.controllers:
            self.advance(5)        # nothing left: P5 has nothing to merge and reports

    def stuck_on_human(self):
        """Every task still in flight waits for a human nobody here can be (nor on a
        board serving the project: `ferrus web`, --web)."""
        return bool(self.controllers) and set(self.controllers) <= self.waiting_human and \
            not self._next_batch() and web_board_url(self.store) is None

    # -- P5 integrate: the merge queue -----------------------------------------------------

    # -- a task's end ---------------------------------------------------------------------

    def _stop_controller(self, task):
        controller = self.controllers.pop(task, None)
        if controller is not None:
            controller.shutdown()
        self.task_place.pop(task, None)
        confinement = self.sandboxes.pop(task, None)
        if confinement is not None:
            confinement.close()

    def _remove_finished_worktrees(self, task, record):
        """A merged (or unchanged, or published) task's review checkout, [parallel]
        teardown, worktree and branch: gone, each failure said with its repair."""
        torn = tear_down_task(self.store, record)
        if torn:
            self.note("task %s: %s" % (short_task_id(task), torn), "warning", task_id=task)
        entries = None          # git's list of worktrees, read once for both removals
        with contextlib.suppress(FerrusError, OSError):
            entries = _worktree_entries(self.store.root)
            remove_review_checkout(self.store.root, record["worktree"], entries)
        try:
            remove_task_worktree(self.store.root, record["worktree"], record.get("branch"),
                                 entries=entries)
        except FerrusError as err:
            self.note("could not remove task %s's worktree %s: %s (`ferrus doctor --fix` "
                      "removes what a finished task leaves)" % (
                          short_task_id(task), record["worktree"], err.message),
                      "warning", task_id=task)

    def _end_task(self, task, status, reason, head=None, empty=False):
        """Record how a task ended; a merged, unchanged or cancelled task's worktree and
        branch go, a failed one's stay for a look (until `ferrus task cancel`; `doctor`
        notes them).  An approved task's `complete` notification goes out now, once it is
        merged (or known to change nothing), not at its approval."""
        if self.integration is not None and self.integration["task"] == task:
            self._stop_integration()        # its checks run in the worktree about to go
        record = read_task_record(self.store.dir, task)
        title = record.get("title", "")
        published = record.get("published") or {}
        said = {MERGED_STATUS: "merged into %s%s: %s" % (
                    self.target, " at %s" % head[:12] if head else "", title),
                UNCHANGED_STATUS: "approved, no change (%s): %s" % (
                    "its submission changed no file" if empty else
                    "%s already has its work" % self.target, title),
                PUBLISHED_STATUS: "published as %s's branch %s%s: %s" % (
                    published.get("remote"), published.get("branch"),
                    " (pull request %s)" % published["pull_request"]
                    if published.get("pull_request") else "", title)}.get(status)
        controller = self.controllers.get(task)
        if said and controller is not None:
            controller.notifier.notify("complete", task, said)
        confinement = self.sandboxes.get(task)
        if isinstance(controller, PlaceTask) and status != FAILED_STATUS:
            controller.stop_job = False     # its removal there stops it (see _end_at_place)
        self._stop_controller(task)
        if confinement is not None and status != FAILED_STATUS:
            confinement.remove()       # its temp folder and private objects
        self.waiting_human.discard(task)
        if record.get("status") not in ENDED_STATUSES or record.get("status") != status:
            changes = {"status": status, "ended_at": format_timestamp(self.store.clock())}
            if reason:
                changes["reason"] = reason
            if head:
                changes["merged_commit"] = head
            detail = {"status": status}
            if reason:
                detail["reason"] = reason[:500]
            update_task(self.store, ORCHESTRATOR, task, "task_" + status, changes, **detail)
            memory_after_task_end(self.store)
        if status in (MERGED_STATUS, UNCHANGED_STATUS, PUBLISHED_STATUS):
            with contextlib.suppress(FerrusError):
                delete_task_refs(self.store.root, task)   # the target (or remote) has it
        saved_note = ""
        if record.get("store") == "place":
            saved_note = self._end_at_place(task, record, status, controller)
        if status in (MERGED_STATUS, UNCHANGED_STATUS, PUBLISHED_STATUS) and \
                record.get("worktree"):
            removal = functools.partial(self._remove_finished_worktrees, task, record)
            if self.held_cleanups is not None:
                self.held_cleanups.append(removal)     # once the next integration started
            else:
                removal()
        else:
            if record.get("worktree"):
                with contextlib.suppress(FerrusError, OSError):
                    remove_review_checkout(self.store.root, record["worktree"])
            if status == CANCELLED_STATUS and record.get("store") != "place":
                # Its work is saved first (unless cancelled with --discard).
                saved_note = _remove_task_leftovers(
                    self.store, read_task_record(self.store.dir, task))[0]
        self.ended[task] = status
        if status == MERGED_STATUS:
            self.base_note = ""        # the target moved to a head the merge gate passed
            self.note("task %s %s" % (short_task_id(task), said), event="merged",
                      task_id=task, status=status, target=self.target, commit=head,
                      title=title)
        elif status == UNCHANGED_STATUS:
            self.note("task %s %s — nothing to merge" % (short_task_id(task), said),
                      event="unchanged", task_id=task, status=status, target=self.target,
                      title=title)
        elif status == PUBLISHED_STATUS:
            self.note("task %s %s" % (short_task_id(task), said), event="published",
                      task_id=task, status=status, target=self.target, title=title,
                      **published)
        elif status == FAILED_STATUS:
            self.note("task %s failed: %s (its worktree %s is kept: `ferrus task retry %s` "
                      "queues it again to go on there, `ferrus task cancel %s` removes it)"
                      % (short_task_id(task), failure_summary(reason or ""),
                         record.get("worktree") or ("at place %s" % record["place"]
                                                    if record.get("place") else "-"), short_task_id(task),
                         short_task_id(task)), "error", task_id=task, status=status)
        else:
            self.note("task %s cancelled.%s" % (short_task_id(task), saved_note), "warning",
                      task_id=task, status=status)
        if status in (MERGED_STATUS, UNCHANGED_STATUS, PUBLISHED_STATUS):
            self._decide_race(task, record)      # a race's first merged attempt wins it

    # -- P6 report, P7 cleanup -------------------------------------------------------------

    def _report(self):
        counts = collections.Counter(self.ended.values())
        parts = [count_statuses(self.ended.values())] if self.ended else []
        if self.damaged:
            parts.append("%d with a damaged %s (`ferrus doctor --fix`)" % (
                len(self.damaged), TASK_RECORD_FILE))
        if self.oversized:
            parts.append("%d race%s left queued, too big for %d at a time" % (
                len(self.oversized), "" if len(self.oversized) == 1 else "s", self.max_tasks))
        self.note("report: %s" % (", ".join(parts) or "no task ran"), counts=dict(counts))
        self.advance(7)

    def _cleanup(self):
        with contextlib.suppress(FerrusError):
            run_git(self.store.root, ["worktree", "prune"])
        if self.queued():
            self.advance(1)
            return
        remove_gate_checkout(self.store)        # the queue is done
        self.finished = True
        self._save()

    # -- the end -------------------------------------------------------------------------------

    def exit_code(self):
        if self.checkpoint:
            return RUN_CHECKPOINT
        if self.halted or self.damaged or self.oversized or any(
                status == FAILED_STATUS for status in self.ended.values()):
            return RUN_FAILED
        if self.waiting_human:
            return RUN_NEEDS_HUMAN
        return RUN_COMPLETE

    def shutdown(self):
        """Stop every agent (the tasks stay as they are, for the next run to resume)."""
        self._stop_integration()
        for task in list(self.controllers):
            self.controllers.pop(task).shutdown()
        for task in list(self.sandboxes):
            # Their MCP bridges: the servers outside and the socket's folder go too.
            self.sandboxes.pop(task).close()
        self.finish_place_removals()
        self.notifier.finish()
        if self.target is not None and (not self.finished or self.halted):
            with contextlib.suppress(FerrusError, OSError):
                self._save(working=False)



def _files_git_would_add(path):
    """The untracked files under ``path`` that git does not ignore (relative to it)."""
    try:
        out = run_git(path, ["ls-files", "-z", "--others", "--exclude-standard"], ok=(0, 1))
    except FerrusError:
        return set()
    return {os.fsdecode(name) for name in out.split(b"\0") if name}


def run_worktree_setup(store, path, commands, where, hint, wrap=None, port=None):
    """[parallel] setup (``commands``) in ``path``, with the check runner (logs, timeouts,
    process groups; ``wrap``, a sandbox's) and ``port``'s block ({port},
    FERRUS_TASK_PORT); raises FerrusError naming the failed command and ``where`` it ran."""
    if not commands:
        return
    config = store.config()
    setup = dataclasses.replace(config.checks, commands=with_port(list(commands), port),
                                parallel=False, fail_fast=True)
    run = run_checks(path, setup, store.path("logs"), 0, config.limits.max_feedback_lines,
                     None, store.root, wrap=wrap, env=port_environment(port))
    if not run.passed:
        failed = run.failed[0] if run.failed else None
        raise FerrusError("[parallel] setup failed in %s: `%s`%s, log %s" % (
            where, failed.command if failed else "?", _status_note(failed) if failed
            else "", failed.log_path if failed else run.log_path), hint)


def gate_base(store, emit, where, commit, allow_red=False, checkout=None, setup=(),
              cancel=None, port=None):
    """The check gate tried on a task's base before any agent starts (see check_base),
    told to ``emit`` as "base_checks" events.  A red base, or a command that cannot run,
    stops here with a FerrusError unless ``allow_red``; then the text for the executor
    that says which checks failed before it began is returned ("" on a green base)."""
    def tell(level, text, **facts):
        emit(HqMessage(level, "ferrus run: " + text, "base_checks", facts))
    commands = store.config().checks.commands
    if not commands:
        return ""
    if cached_base_check(store, commit, commands, setup) is None:
        tell("info", "running the checks on %s before any agent starts (%d command%s%s)" % (
            where, len(commands), "" if len(commands) == 1 else "s",
            "; a pass is kept for this commit" if commit else ""), running=True)
    result = check_base(store, commit, checkout, setup, cancel, port)
    if result.passed:
        tell("info", "the checks pass on %s%s" % (where, " (as when checked %s)" % (
            result.checked_at) if result.cached else ""), cached=result.cached,
            **result.to_json())
        return ""
    broken = result.cannot_run()
    allowed = allow_red and not broken
    tell("warning" if allowed else "error", "\n".join(describe_base_check(result, where)),
         cached=result.cached, **result.to_json())
    if broken and allow_red:
        # A red base is work for the executor; a check that cannot run is not: every
        # submission would fail it the same way, whatever the work.
        raise RedBaseRefused(
            "no agent was started: `%s` cannot run on %s (exit %s)" % (
                broken[0].get("command"), where, broken[0].get("exit")),
            "--allow-red-base starts a run on failing checks, not on a check that cannot "
            "run at all: fix it in [checks] of %s (`ferrus doctor` checks the commands)"
            % CONFIG_FILE)
    if not allow_red:
        raise RedBaseRefused(
            "no agent was started: the checks already fail on %s" % where,
            ("`%s` could not run: fix it in [checks] of %s (`ferrus doctor` checks the "
             "commands)" % (broken[0].get("command"), CONFIG_FILE)) if broken else
            "fix what fails (the lines and logs above), or pass --allow-red-base to start "
            "anyway: the executor is then told which checks failed before it began")
    tell("warning", "going on anyway (--allow-red-base): the executor is told which checks "
                    "failed before it began", allowed=True)
    return red_base_note(result, where)


def checkout_base(store):
    """(commit, where) of the checkout a single task starts in: its HEAD commit, or None
    when it has uncommitted changes (checked as it is, every time)."""
    base, _ = record_task_base(store.workdir, task_diff_exclusions(store))
    if not base.get("git"):
        return None, "the project folder"
    head = (base.get("commit") or "")[:12]
    on = "%s at %s" % (base.get("branch") or "a detached HEAD", head or "no commit")
    if base.get("dirty_count"):
        return None, "the checkout (%s, with %d changed file%s)" % (
            on, base["dirty_count"], "" if base["dirty_count"] == 1 else "s")
    return base.get("commit"), "the checkout (%s)" % on
