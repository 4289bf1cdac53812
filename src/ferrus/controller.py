"""HQ's controller: agent slots, capacity, reactions to the journal.

HqController starts the agents a task's state asks for (one slot per headless role,
supervised by the session state machine), passes every spawn and transition through
the capacity gate, and keeps session records; front ends feed it input and print
what it emits."""

import contextlib
import dataclasses
import itertools
import os
import signal
import time

from .basics import (FerrusError, UsageError, format_duration, format_timestamp, log,
                     new_id, parse_timestamp, utc_now)
from .system import IS_WINDOWS
from .config import AgentChoice, LeaseConfig
from .task_machine import ACTIVE_STATES, S, WORK_STATES
from .session_machine import (CANCEL_SESSION, CHECKPOINT, CONTINUE, EMERGENCY_STOP,
                              FORCE_STOP_SESSION, LOG_FATAL, SS, Session, SessionEvent,
                              THROTTLE, session_step)
from .gates import Signals, classify, gate_record, usage_added, usage_since
from .store import PARALLEL_MIRROR_KEY, STATE_FILE, TASKS_DIR, read_task_record
from .checks import end_orphaned_checks
from .git import TamperedWorktree, git_repository, run_git
from .worktrees import changed_paths, own_checkout, reset_gate, review_checkout_path
from .bootstrap import store_environment
from .operations import (confirmation_summary, describe_task_commit, guarded_paths,
                         task_git_site)
from .work import op_release_sessions
from .memory import memory_after_task_end, memory_executor_prompt
from .mcp import SESSION_ENV, session_id_for_task, tool_calls_for_task
from .server_host import server_host_environment
from .agent_files import edit_json_file
from .register import adapter_for, copy_agent_configuration
from .prompts import executor_prompt_for, prompt_consultant, prompt_reviewer
from .sessions import (AgentProcess, HqMessage, SESSION_RECORD_EVERY, SLOT_PROGRESS,
                       SLOT_ROLES, _spawn_error_hint, close_session_record,
                       last_words_tail, open_session_record, sessions_config,
                       task_tokens_and_turns, update_session_counts, usage_limit_wait)
from .notify import Notifier, SessionSlot
from .orchestrator import (TASK_SESSIONS_KEY, clear_capacity_checkpoint,
                           task_sessions_started)
from .journal_view import JournalView


def review_folder(store):
    """The folder a parallel task's reviewer and consultant start in: ferrus's own
    checkout of the task's submission (of its base before the first one), beside its
    worktree, reset to that commit, with the files that instruct or configure agents as
    the base has them (the reviewer reads their changes in the diff; they do not act on
    it) and ferrus's agent settings copied in.  The executor's worktree — where it may
    have written agent settings, hooks and instructions, before or after it submitted —
    is never where another agent starts.  Raises FerrusError when it cannot be made."""
    record = read_task_record(store.dir, store.task)
    worktree = record.get("worktree")
    data = store.read_state()
    submitted = data.task_submitted if isinstance(data.task_submitted, dict) else {}
    base = submitted.get("base") or (data.task_base or {}).get("commit")
    commit = submitted.get("commit") or base
    if not isinstance(worktree, str) or not commit:
        raise FerrusError("task %s has no worktree or base commit to review" % store.task,
                          "`ferrus doctor` checks the task's records")
    repo = git_repository(store.root)
    checkout = own_checkout(store.root, review_checkout_path(worktree), commit)
    reset_gate(checkout, commit)
    inside = os.path.relpath(store.root, repo.toplevel).replace(os.sep, "/")
    prefix = "" if inside == "." else inside + "/"
    try:
        extra = store.config().parallel.guarded
    except FerrusError:
        extra = []
    if commit != base:
        changed = [path for path in changed_paths(store.root, base, commit)
                   if path.startswith(prefix)]
        steered = [path for path in changed if guarded_paths([path[len(prefix):]], extra)]
        if steered:
            run_git(checkout, ["restore", "--source=" + base, "--worktree", "--"] +
                    [":(top,literal)" + path for path in steered])
    folder = checkout.work_tree if inside == "." else os.path.join(checkout.work_tree,
                                                                    *inside.split("/"))
    copy_agent_configuration(store.root, folder)
    return folder


class HqController(JournalView):
    """The UI-independent HQ: journal in, sessions supervised, messages out.

    ``clock`` is a monotonic clock (injectable so tests never sleep); ``emit``
    receives HqMessage objects; ``launcher`` builds the Launch for a slot (the
    configured adapters by default)."""

    # With an agent running and nothing to report for this long, a heartbeat line says
    # what it is doing (how long, how many tool calls, its last words).
    HEARTBEAT_SECS = 60.0
    CHECK_SCAN_EVERY = 0.25

    def __init__(self, store, emit, clock=time.monotonic, launcher=None, bell=None,
                 executor_agent=None, notifier=None, executor_model=None):
        self.store = store
        self.executor_agent = executor_agent    # a parallel task's own executor agent
        self.executor_model = executor_model    # and model (a race's attempt may name one)
        self._out = emit
        self.clock = clock
        self.last_activity = clock()
        # A parallel run's controllers share its notifier (``notifier``): a task's end
        # must not wait for, or stop, the notifiers its events started.
        self.notifier = notifier or Notifier(store, self.emit, bell)
        self._owns_notifier = notifier is None
        self.checks_seen = {}         # check id -> (command, clock value when first seen)
        self._next_check_scan = 0.0
        self.launcher = launcher or self._launch_with_adapter
        self.limits = sessions_config(store.root)
        self.slots = {name: SessionSlot(name, self.limits) for name in SLOT_ROLES}
        self._deferred_moves = None   # session moves journaled once _advance is done
        # Asked before an agent starts (a parallel run paces its steps with it); None: any
        # agent a slot needs starts at once.
        self.may_start_agent = None
        # Entries from before this HQ started are not shown again, and none is read:
        # start-up costs the same whatever the journal's length.
        self.journal_offset = store.journal_position()
        self.cursor = store.last_journal_seq()
        self.start_seq = self.cursor
        self._missing_rev = None
        # Capacity signals HQ counts itself (tool calls come from the MCP servers).
        # Sessions per task live in STATE.json, so limits hold across restarts.
        self.sessions_seed = self._sessions_before_counter()
        self.tasks_completed = 0
        self.baseline = Signals()
        self.throttle_until = None
        self.checkpoint = self.store.read_state().extra.get("capacity_checkpoint")
        self.paused = False           # True until the user agrees to resume a task in flight
        self.finishing_since = None   # when the task ended while agents still ran
        self.shown_question = None
        self.shown_confirmation = None    # (task, entered) whose summary was emitted
        # The state found at start-up is shown by describe_state(), with its own time; only
        # states reached while this controller runs are announced ("Task complete.").
        self.last_state = self.store.read_state().state
        self._parallel_tasks = set()  # ids of tasks known to run in parallel
        self.mirrored = False         # the project's state mirrors a parallel task

    def emit(self, message):
        if not message.event:
            message.event = "session" if message.kind == "agent" else "info"
        self.last_activity = self.clock()
        self._out(message)

    # -- start-up ------------------------------------------------------------------

    def task_in_flight(self):
        """The task HQ would resume agents for, if any.  A task waiting for the human's
        confirmation needs no agent, so there is nothing to ask: HQ shows it at once."""
        data = self.store.read_state()
        return data if data.state in ACTIVE_STATES and not self.mirrors_parallel_task(data) \
            and data.state != S.AWAITING_CONFIRMATION else None

    def mirrors_parallel_task(self, data):
        """The project's STATE.json shows a parallel task (see Store): that task's own
        controller drives it in its worktree, so the project's has nothing to do."""
        return self.store.task is None and bool(data.extra.get(PARALLEL_MIRROR_KEY))

    def _of_parallel_task(self, task):
        """Whether journal entries about ``task`` belong to a parallel task (one with a
        store of its own), which its own controller shows, not the project's."""
        if not task or self.store.task is not None:
            return False
        if task in self._parallel_tasks:
            return True
        # Only a yes is kept: a queued task gets its store when it starts.
        if os.path.isfile(self.store.path(TASKS_DIR, task, STATE_FILE)):
            self._parallel_tasks.add(task)
            return True
        return False

    def describe_state(self):
        data = self.store.read_state()
        now = self.store.clock()
        text = "State %s" % data.state
        if data.task_id:
            text += ", task %s" % data.task_id
        if data.state_entered_at:
            with contextlib.suppress(ValueError):
                entered = parse_timestamp(data.state_entered_at)
                if data.state in (S.COMPLETE, S.FAILED):
                    # A task that ended before now is shown as such, with its own time.
                    text += ", %s at %s (%s ago)" % (
                        "completed" if data.state == S.COMPLETE else "failed",
                        entered.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
                        format_duration((now - entered).total_seconds()))
                else:
                    text += ", for %s" % format_duration((now - entered).total_seconds())
        text += ", check retries %d, review cycles %d" % (data.check_retries, data.review_cycles)
        return text

    # -- the loop --------------------------------------------------------------------

    CAPACITY_CHECK_EVERY = 1.0
    FINISH_GRACE_SECS = 10.0      # how long agents may finish after the task ended

    def poll(self):
        """One step: journal entries in order, agent exits, timers, then reconcile."""
        # What agents and checks started comes before the journal entries it led to: an
        # agent reports a tool call before its result is committed, and a check's pid file
        # is gone before the entry with its result is written.
        for slot in self.slots.values():
            self._show_tool_calls(slot)
        self._watch_checks()
        self.drain_journal()
        for slot in self.slots.values():
            self._check_slot(slot)
        self._watch_capacity()
        if not self.paused:
            self.reconcile()
        self._heartbeat()

    def needed_slots(self, data):
        answer_pending = bool(self.store.read_file("ANSWER.md").strip())
        needed = {}
        heartbeat = LeaseConfig.heartbeat_interval_secs
        with contextlib.suppress(FerrusError):      # a broken file stops the spawn itself
            heartbeat = self.store.config().lease.heartbeat_interval_secs
        prompt = executor_prompt_for(data, answer_pending, heartbeat)
        if prompt and data.state != S.AWAITING_HUMAN:
            needed["executor"] = prompt
        if data.state == S.REVIEWING:
            needed["reviewer"] = prompt_reviewer()
        if data.state == S.CONSULTATION:
            needed["consultant"] = prompt_consultant(
                resuming=self.slots["consultant"].session.session_seq > 0)
        return needed

    def reconcile(self):
        data = self.store.read_state()
        self.catch_up(data.rev)
        self.mirrored = self.mirrors_parallel_task(data)
        if self.mirrored:
            self.last_state = data.state
            return
        if data.state == S.AWAITING_HUMAN:
            question = self.store.read_file("QUESTION.md").strip()
            if question and question != self.shown_question:
                self.shown_question = question
                self.emit(HqMessage("question", question, "question",
                                    {"question": question, "task_id": data.task_id}))
        else:
            self.shown_question = None
        if data.state == S.AWAITING_CONFIRMATION:
            waiting = (data.task_id, data.state_entered_at)
            if waiting != self.shown_confirmation:
                self.shown_confirmation = waiting
                self.emit(HqMessage("confirm", confirmation_summary(self.store, data),
                                    "confirmation", {"task_id": data.task_id}))
        else:
            self.shown_confirmation = None
        if data.state != self.last_state:
            if data.state == S.COMPLETE:
                commit = data.task_commit or {}
                self.emit(HqMessage("error" if commit.get("error") else "info", "Task complete."
                                    + (" " + describe_task_commit(commit) if commit else ""),
                                    "complete", {"task_id": data.task_id}))
            elif data.state == S.FAILED:
                self.emit(HqMessage("error", "Task failed: %s" % (data.failure_reason or ""),
                                    "failed", {"task_id": data.task_id,
                                               "reason": data.failure_reason}))
            if data.state in (S.COMPLETE, S.FAILED):
                memory_after_task_end(self.store)
            if data.state == S.IDLE:
                self.stop_all(quiet=True)
            # An agent that ended the task (the reviewer's approve) is still saying its
            # last words; they carry its usage and cost, so it gets a moment to exit.
            # While the human decides, too, no agent has anything more to do.
            self.finishing_since = time.monotonic() if data.state in (
                S.COMPLETE, S.FAILED, S.AWAITING_CONFIRMATION, S.INTEGRATING) else None
            self.last_state = data.state
        if self.finishing_since is not None and (
                not self.running() or
                time.monotonic() - self.finishing_since >= self.FINISH_GRACE_SECS):
            self.finishing_since = None
            self.stop_all(quiet=True)
        needed = self.needed_slots(data)
        for name, prompt in needed.items():
            self._advance(self.slots[name], prompt, data)

    def _advance(self, slot, prompt, data):
        """Move a needed slot forward through its session machine towards Running.

        The agent is started first and the session's moves are journaled after it (in
        their order): each is an fsynced commit, and an agent that waits for three of
        them reacts that much later (ARCHITECTURE.md, 'Session state machine')."""
        held = self._deferred_moves is not None      # held for a whole step already
        if not held:
            self._deferred_moves = []
        try:
            session = slot.session
            if session.state in (SS.INITIALIZING, SS.SESSION_COMPLETE):
                self._step(slot, SessionEvent("WorktreeReady"))
            if slot.session.state == SS.BUILDING_PROMPT:
                text = prompt
                if slot.name == "executor" and data.state in WORK_STATES:
                    # Once per executor session: what earlier tasks on the same ground
                    # decided, and why their work was sent back.
                    text += memory_executor_prompt(self.store, data)
                if slot.session.urgent:
                    text += "\n\nURGENT message from the operator (act on it first):\n" + \
                        slot.session.urgent
                self._step(slot, SessionEvent("PromptReady", text))
            if slot.session.state == SS.SPAWNING and (
                    self.may_start_agent is None or self.may_start_agent()) and \
                    self._capacity_allows("spawn:" + slot.name):
                self._spawn(slot)
        finally:
            if not held:
                self.release_session_moves()

    def hold_session_moves(self):
        """Journal session moves only at release_session_moves(): a runner polling several
        controllers starts every agent a step needs before it commits their moves."""
        if self._deferred_moves is None:
            self._deferred_moves = []

    def release_session_moves(self):
        moves, self._deferred_moves = self._deferred_moves or [], None
        for move in moves:
            with contextlib.suppress(FerrusError, OSError):
                self._commit_session_move(move)

    # -- capacity gates (ARCHITECTURE.md, 'Capacity gates') --------------------------

    def signals(self, extra_parallel=0):
        data = self.store.read_state()
        task = data.task_id
        for slot in self.running():        # the gate reads what the records say
            self._save_counts(slot, force=True)
        tokens, turns = task_tokens_and_turns(self.store, task)
        # The context is a level, not a count: the fullest running agent's, never rebased.
        context = max([slot.process.tally.context_tokens for slot in self.running()] + [0])
        return usage_since(Signals(
            tool_calls=tool_calls_for_task(self.store, task),
            sessions=self.sessions_of(data) + sum(
                1 for move in self._deferred_moves or ()
                if move["to"] == SS.RUNNING.value),   # started, not yet journaled
            tasks_completed=self.tasks_completed, tokens_used=tokens, turns=turns,
            parallel_agents=len(self.running()) + extra_parallel,
            context_tokens_used=context,
            context_tokens_max=self.store.config().capacity.context_window), self.baseline)

    def gate(self, target, extra_parallel=0):
        """Classify the signals, journal the decision and carry out its action."""
        limits = self.store.config().capacity
        if not limits.enabled():
            return CONTINUE
        signals = self.signals(extra_parallel)
        tier, action, worst = classify(signals, limits)
        record = gate_record(target, tier, action, signals, limits, worst)
        with contextlib.suppress(FerrusError, OSError):
            self.store.append_event("hq", "gate", record)
        if action in (CHECKPOINT, EMERGENCY_STOP):
            if action == EMERGENCY_STOP:
                self.stop_all()
            self._set_checkpoint(record)
            self.emit(HqMessage("error", "capacity %s: %s at %s of its limit — %s. Raise the "
                                         "limit in [capacity] or /continue." % (
                action, worst, getattr(signals, worst),
                "every agent was stopped" if action == EMERGENCY_STOP else "no new agents start")))
        elif action == THROTTLE:
            self.emit(HqMessage("warning", "capacity Orange (%s near its limit): waiting %s "
                                           "before starting the next agent" % (
                worst, format_duration(limits.throttle_secs))))
        return action

    def _watch_capacity(self):
        """While agents run, a limit can be crossed between spawns: look once a second
        and stop everything at the emergency level (journaling only then)."""
        now = self.clock()
        if not self.running() or now < getattr(self, "_next_capacity_check", 0):
            return
        self._next_capacity_check = now + self.CAPACITY_CHECK_EVERY
        limits = self.store.config().capacity
        if not limits.enabled() or self.checkpoint:
            return
        _, action, _ = classify(self.signals(), limits)
        if action == EMERGENCY_STOP:     # a Checkpoint only stops the next spawn
            self.gate("running")

    def _capacity_allows(self, target):
        if self.checkpoint:
            return False
        now = self.clock()
        if self.throttle_until is not None:
            if now < self.throttle_until:
                return False
            self.throttle_until = None       # the wait is over: start the agent
            return True
        action = self.gate(target, extra_parallel=1)
        if action == THROTTLE:
            self.throttle_until = now + self.store.config().capacity.throttle_secs
            return self.throttle_until <= now
        return action == CONTINUE

    def _set_checkpoint(self, record):
        self.checkpoint = record
        with contextlib.suppress(FerrusError, OSError):
            with self.store.transaction("hq") as tx:
                data = tx.state.copy()
                data.extra["capacity_checkpoint"] = dict(record, at=format_timestamp(utc_now()))
                tx.set(data, "capacity_checkpoint", target=record["target"],
                       action=record["action"])

    def continue_after_checkpoint(self):
        """/continue: clear the checkpoint; the budget counts again from here."""
        self.checkpoint = None
        self.throttle_until = None
        self.baseline = usage_added(self.baseline, self.signals())
        clear_capacity_checkpoint(self.store)

    def recheck_checkpoint(self):
        """After limits were raised: clear the checkpoint if the gate now lets work go on."""
        if not self.checkpoint:
            return True
        limits = self.store.config().capacity
        tier, action, _ = classify(self.signals(), limits)
        if action in (CONTINUE, THROTTLE):
            self.checkpoint = None
            clear_capacity_checkpoint(self.store)
            self.emit(HqMessage("info", "capacity is %s again; continuing" % tier))
            return True
        return False

    def _spawn(self, slot):
        try:
            launch, parse_line = self.launcher(slot)
        except FerrusError as err:
            self._step(slot, SessionEvent("FatalError", err.full_text()))
            return
        stamp = utc_now().strftime("%Y%m%dT%H%M%S")
        log_path = self.store.path("logs", "%s%s_%s_%d.log" % (
            self.store.task + "_" if self.store.task else "", slot.name, stamp,
            slot.session.session_seq))
        # The agent's `ferrus serve` inherits this id and puts it in its lease holder id,
        # so a lease names this one session, not just <role>:<agent>:<index>; an agent of
        # a parallel task finds its task in it.
        slot.session_id = session_id_for_task(self.store.task) if self.store.task \
            else new_id("s")
        # A parallel task's agents (and the checks their `ferrus serve` runs) get its
        # port block (bootstrap.py).
        # Its `ferrus serve` is served by the server host (server_host.py) when there is
        # one; a sandbox unsets the variable.
        env = dict(server_host_environment())
        env.update(launch.env)
        env.update(store_environment(self.store))
        env[SESSION_ENV] = slot.session_id
        launch = dataclasses.replace(launch, env=env)
        try:
            folder = self.agent_folder(slot)
            slot.process = AgentProcess(launch, folder, log_path, parse_line)
        except FerrusError as err:
            self.emit(HqMessage("error", "could not prepare where the %s works: %s" % (
                slot.name, err.full_text())))
            self._step(slot, SessionEvent("FatalError", err.full_text()))
            return
        except OSError as err:
            self.emit(HqMessage("error", "could not start the %s (%s): %s%s" % (
                slot.name, launch.argv[0], err.strerror or err, _spawn_error_hint(err))))
            self._open_record(slot, launch, log_path, None)
            self._close_record(slot, None, "not started", note="%s: %s" % (
                launch.argv[0], err.strerror or err))
            # A start that fails counts as a failed session: back off, retry, and stop
            # at the thresholds instead of waiting for a timer never armed.
            self._step(slot, SessionEvent("SessionExited", outcome="error"))
            self._arm_backoff(slot)
            return
        slot.start_seq = self.store.last_journal_seq()
        slot.timer = self.clock() + self.limits.timeout_secs
        slot.tool_calls = slot.events_shown = 0
        slot.calls_by_id = {}
        slot.started_at = self.clock()
        # Said as soon as the process exists; its records follow.
        self.emit(HqMessage("agent", "started the %s (pid %d), log %s" % (
            slot.name, slot.process.pid, self.store.relpath(log_path))))
        self._open_record(slot, launch, log_path, slot.process.pid)
        self._step(slot, SessionEvent("SessionStarted", slot.session.session_seq))
        self._record_agent(slot, "running")

    def agent_folder(self, slot):
        """Where a slot's agent starts: the task's code for its executor; for a parallel
        task's reviewer and consultant, ferrus's own checkout of what was submitted
        (review_folder) — never the executor's worktree."""
        if self.store.task is None or slot.name == "executor":
            return self.store.workdir
        return review_folder(self.store)

    def agent_choice(self, role, config=None):
        """The agent (and model) that plays ``role`` here: [hq.<role>], or for a parallel
        task's executor the agent its queue record names."""
        config = config or self.store.config()
        choice = getattr(config, role)
        wanted = self.executor_agent if role == "executor" else None
        model = self.executor_model if role == "executor" else None
        if wanted and choice is not None and choice.agent == wanted:
            return dataclasses.replace(choice, model=model) if model else choice
        if wanted:
            return AgentChoice(agent=wanted, model=model or "")
        return choice

    def _launch_with_adapter(self, slot):
        config = self.store.config().require_hq()
        choice = self.agent_choice(slot.role, config)
        if choice is None:
            raise FerrusError("no [hq.%s] agent in ferrus.toml" % slot.role,
                              "ferrus register --%s <agent>" % slot.role)
        adapter = adapter_for(config, choice.agent)
        if not adapter.executable():
            raise FerrusError("%s is not installed" % adapter.binary, adapter.install_hint())
        return adapter.headless(self.store.root, slot.role, slot.session.prompt,
                                choice.model), adapter.parse_line

    def _check_slot(self, slot):
        process = slot.process
        now = self.clock()
        if process is not None:
            slot.tool_calls = process.tally.tool_calls
            self._save_counts(slot)
            self._show_tool_calls(slot)
        if slot.state == SS.RUNNING and process is not None:
            if process.exited():
                self._on_exit(slot)
            elif slot.timer is not None and now >= slot.timer:
                self.emit(HqMessage("warning", "the %s ran past [sessions] timeout_secs; "
                                               "stopping it" % slot.name))
                process.terminate()
                process.finish()
                slot.process = None
                self._record_agent(slot, "suspended")
                self._close_record(slot, process, "timeout")
                self._step(slot, SessionEvent("SessionExited", outcome="timeout"))
                self._arm_backoff(slot)
        elif slot.state == SS.INTERRUPTING and process is not None:
            if process.exited():
                process.finish()
                slot.process = None
                self._record_agent(slot, "suspended")
                self._close_record(slot, process, "interrupted")
                self._step(slot, SessionEvent("SessionExited", outcome="interrupted"))
            elif slot.timer is not None and now >= slot.timer:
                self._step(slot, SessionEvent("GraceExceeded"))
        elif slot.state == SS.COOLING_DOWN and slot.timer is not None and now >= slot.timer:
            slot.timer = None
            self._step(slot, SessionEvent("BackoffElapsed"))

    def _on_exit(self, slot):
        process = slot.process
        code = process.finish()
        self._show_tool_calls(slot)        # what it reported just before it ended
        slot.process = None
        self._record_agent(slot, "suspended")
        progressed = any(entry.get("event") in SLOT_PROGRESS[slot.name]
                         or (entry.get("from") != entry.get("to") and entry.get("actor") != "hq")
                         for entry in self.store.read_journal(after_seq=slot.start_seq))
        limit = process.limit()
        last_words = last_words_tail(process.last_words)
        self._close_record(slot, process, "usage limit" if limit and not progressed else
                           "success" if code == 0 and progressed else
                           "agent error" if process.fatal is not None and not progressed else
                           "no progress" if code == 0 else "error",
                           note=("resets %s" % limit if limit and not progressed else
                                 process.fatal[1] if process.fatal is not None and not progressed
                                 else None if progressed else
                                 "its last words: %s" % last_words if last_words else None))
        if limit and not progressed:
            wait = usage_limit_wait(limit)
            self.emit(HqMessage("warning", "the %s hit its usage limit (resets %s); waiting "
                                           "%s instead of retrying" % (slot.name, limit,
                                                                        format_duration(wait))))
            slot.session = dataclasses.replace(slot.session, state=SS.COOLING_DOWN)
            slot.timer = self.clock() + wait
            return
        if code == 0 and progressed:
            self._step(slot, SessionEvent("SessionExited", outcome="success"))
            return
        if process.fatal is not None and not progressed:
            # Not logged in, a bad key, an unknown model or flag: retrying only repeats it.
            kind, words, hint = process.fatal
            self.emit(HqMessage("error", "the %s cannot work: %s said: %s" % (
                slot.name, os.path.basename(process.argv0), words)))
            self._step(slot, SessionEvent("FatalError", "%s\nhint: %s (log: %s)" % (
                {"login": "the agent is not logged in or its key is refused",
                 "model": "the agent does not know its model",
                 "flag": "the agent refused an option"}[kind],
                hint, self.store.relpath(process.log_path))))
            return
        if self._worktree_tampered():
            # Not restarted: the parallel run fails the task at once, saying why.
            self._step(slot, SessionEvent("SessionExited", outcome="error"))
            return
        said = "\n  its last words: %s" % last_words if last_words else \
            "\n  it said nothing (no final message) before it ended"
        facts = {"slot": slot.name, "exit": code, "last_words": last_words,
                 "log": self.store.relpath(process.log_path)}
        if code == 0:
            self.emit(HqMessage("warning", "the %s exited (exit 0) without calling %s; "
                                           "restarting it%s" % (
                                               slot.name,
                                               " or ".join(SLOT_PROGRESS[slot.name][:2]), said),
                                "session", facts))
        else:
            self.emit(HqMessage("warning", "the %s exited with code %s; see %s%s" % (
                slot.name, code, self.store.relpath(process.log_path), said), "session",
                facts))
        self._step(slot, SessionEvent("SessionExited", outcome="error"))
        self._arm_backoff(slot)

    def _worktree_tampered(self):
        """Whether this is a parallel task whose worktree's .git was rewritten."""
        if self.store.task is None:
            return False
        try:
            task_git_site(self.store)
        except TamperedWorktree:
            return True
        except FerrusError:
            pass
        return False

    def _arm_backoff(self, slot):
        if slot.state == SS.COOLING_DOWN:
            slot.timer = self.clock() + slot.session.backoff_ms / 1000.0
            self.emit(HqMessage("info", "retrying the %s in %s (error %d in a row)" % (
                slot.name, format_duration(slot.session.backoff_ms / 1000.0),
                slot.session.consecutive_errors)))

    def _step(self, slot, event):
        before = slot.session.state
        slot.session, effect = session_step(slot.session, event)
        if effect == CANCEL_SESSION and slot.process is not None:
            if slot.session.state == SS.STOPPED:
                process = slot.process
                process.terminate()
                process.finish()
                slot.process = None
                self._record_agent(slot, "suspended")
                self._close_record(slot, process, "stopped")
            else:
                self._interrupt(slot)
        elif effect == FORCE_STOP_SESSION and slot.process is not None:
            process = slot.process
            process.terminate(grace=0)
            process.finish()
            slot.process = None
            self._record_agent(slot, "suspended")
            self._close_record(slot, process, "killed", note="it outlived interrupt_grace_secs")
        elif isinstance(effect, tuple) and effect[0] == LOG_FATAL:
            self.emit(HqMessage("error", "the %s is stopped: %s" % (slot.name, effect[1])))
        if slot.session.state != before:
            if self._deferred_moves is not None:      # journaled once the agent started
                self._deferred_moves.append(self._session_move(slot, before, event))
                return
            with contextlib.suppress(FerrusError, OSError):
                self._journal_session(slot, before, event)

    def _journal_session(self, slot, before, event):
        self._commit_session_move(self._session_move(slot, before, event))

    @staticmethod
    def _session_move(slot, before, event):
        """A session's move as its journal entry's detail, taken when it happens."""
        return {"slot": slot.name, "from": before.value, "to": slot.session.state.value,
                "seq": slot.session.session_seq, "trigger": event.kind,
                "pid": slot.process.pid if slot.process else None}

    def _commit_session_move(self, move):
        """Journal a session's move; a start also counts in STATE.json, so the sessions
        a task had are known after a restart without reading the journal."""
        with self.store.transaction("hq") as tx:
            tx.set(tx.state, "session")
            tx.detail.update(move)
            if move["to"] == SS.RUNNING.value:
                tx.state.extra[TASK_SESSIONS_KEY] = {"task_id": tx.state.task_id,
                                                     "sessions": self.sessions_of(tx.state) + 1}

    # How far back a project from before STATE.json counted sessions is searched.
    SESSION_SCAN_LIMIT = 10000

    def _sessions_before_counter(self):
        """The current task's session starts, for a STATE.json written before it counted
        them: the task's own entries at the journal's end, read backwards (bounded)."""
        data = self.store.read_state()
        counter = data.extra.get(TASK_SESSIONS_KEY)
        if data.task_id is None or (isinstance(counter, dict) and
                                    counter.get("task_id") == data.task_id):
            return {}
        count = 0
        entries = self.store.journal_entries_backwards()
        for entry in itertools.islice(entries, self.SESSION_SCAN_LIMIT):
            if entry.get("task_id") != data.task_id or entry.get("event") == "create_task":
                break
            if entry.get("event") == "session" and (entry.get("detail") or {}).get(
                    "to") == SS.RUNNING.value:
                count += 1
        return {data.task_id: count}

    def sessions_of(self, data):
        """Sessions started for ``data``'s task so far (all HQs, across restarts)."""
        return task_sessions_started(data, self.sessions_seed.get(data.task_id, 0))

    def _interrupt(self, slot):
        """TERM the process group now; KILL after the grace period (GraceExceeded)."""
        if IS_WINDOWS:  # pragma: no cover
            slot.process.terminate(grace=0)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(slot.process.pid, signal.SIGTERM)
        slot.timer = self.clock() + self.limits.interrupt_grace_secs

    # -- session records ---------------------------------------------------------------

    def _open_record(self, slot, launch, log_path, pid):
        agent, model = "unknown", ""
        with contextlib.suppress(FerrusError):
            choice = self.agent_choice(slot.role)
            if choice is not None:
                agent, model = choice.agent, choice.model or ""
        slot.record = open_session_record(
            self.store, slot.session_id, slot=slot.name, role=slot.role, agent=agent,
            model=model, task_id=self.store.read_state().task_id, pid=pid,
            log=self.store.relpath(log_path), argv=list(launch.argv), prompt=slot.session.prompt)
        slot.record_due = self.clock() + SESSION_RECORD_EVERY

    def _save_counts(self, slot, force=False):
        """Persist a running session's counts, at most once a second unless forced."""
        now = self.clock()
        if slot.record is None or slot.process is None or (not force and now < slot.record_due):
            return
        slot.record_due = now + SESSION_RECORD_EVERY
        update_session_counts(self.store, slot.record, slot.process.tally,
                              self.tool_calls_of(slot))

    def _close_record(self, slot, process, outcome, note=None):
        record, slot.record = slot.record, None
        if record is not None:
            close_session_record(self.store, record, outcome,
                                 process.proc.returncode if process is not None else None,
                                 process.tally if process is not None else None, note,
                                 self.tool_calls_of(slot))

    def _record_agent(self, slot, status):
        """Keep .ferrus/agents.json current (entries keyed by slot and pid)."""
        path = self.store.path("agents.json")
        process = slot.process
        name = "%s %s" % (self.store.task, slot.name) if self.store.task else slot.name

        def update(data):
            agents = data.setdefault("agents", [])
            entry = next((a for a in agents if a.get("name") == name), None)
            if entry is None:
                entry = {"name": name}
                if self.store.task:
                    entry["task"] = self.store.task
                agents.append(entry)
            choice = None
            with contextlib.suppress(FerrusError):
                choice = self.agent_choice(slot.role)
            # agent_type is required by upstream's reader of this file.
            entry.update(role=slot.role, status=status,
                         agent_type=choice.agent if choice else entry.get("agent_type", "unknown"),
                         pid=process.pid if process is not None and status == "running" else None,
                         started_at=format_timestamp(utc_now()) if status == "running"
                         else entry.get("started_at"),
                         session=slot.session_id if status == "running" else
                         entry.get("session"))
        with contextlib.suppress(FerrusError, OSError):
            with self.store.lock():
                edit_json_file(path, update)
        if status != "running" and slot.session_id:
            # The session is over: a lease it still holds protects nothing, and the next
            # session (a new id) should not wait ttl_secs for it.
            with contextlib.suppress(FerrusError, OSError):
                op_release_sessions(self.store, [slot.session_id])

    # -- operator actions ------------------------------------------------------------

    def tell(self, slot_name, message):
        slot = self.slots.get(slot_name)
        if slot is None:
            raise UsageError("unknown role %r: use %s" % (slot_name, ", ".join(self.slots)))
        if slot.state != SS.RUNNING:
            slot.session = dataclasses.replace(slot.session, urgent=message)
            self.emit(HqMessage("info", "the %s is not running; its next prompt carries the "
                                        "message" % slot_name))
            return
        self._step(slot, SessionEvent("UrgentMessage", message))
        self.emit(HqMessage("info", "interrupting the %s; it restarts with your message" %
                                    slot_name))

    def stop_all(self, quiet=False):
        for slot in self.slots.values():
            running = slot.process is not None
            # An idle slot (nothing running, nothing pending) has nothing to stop: it only
            # starts afresh below, without a journal entry (an fsynced commit) saying so.
            if running or slot.state not in (SS.INITIALIZING, SS.SESSION_COMPLETE):
                self._step(slot, SessionEvent("OperatorStop"))
            if running and not quiet:
                self.emit(HqMessage("info", "stopped the %s" % slot.name))
            # A stopped slot starts afresh the next time its role is needed.
            slot.session = Session(max_consecutive_errors=self.limits.max_consecutive_errors,
                                   max_total_errors=self.limits.max_total_errors)
            slot.timer = None

    def restart_slots(self):
        """/resume: give stopped slots a fresh session so reconcile starts them again."""
        for slot in self.slots.values():
            if slot.state == SS.STOPPED:
                slot.session = Session(max_consecutive_errors=self.limits.max_consecutive_errors,
                                       max_total_errors=self.limits.max_total_errors)
        self.paused = False

    def running(self):
        return [slot for slot in self.slots.values() if slot.process is not None]

    def wind_down(self, poll_interval=0.02):
        """Let the agents still running after the task ended exit on their own (at most
        FINISH_GRACE_SECS), so their records get their final usage."""
        deadline = time.monotonic() + self.FINISH_GRACE_SECS + 1.0
        # The caller may have read the ending state before this controller did: one
        # poll lets it see the ending (and start the grace) first.
        self.poll()
        while self.finishing_since is not None and time.monotonic() < deadline:
            time.sleep(poll_interval)
            self.poll()

    def shutdown(self):
        stopped = False
        for slot in self.slots.values():
            if slot.process is not None:
                process = slot.process
                process.terminate()
                process.finish()
                slot.process = None
                self._record_agent(slot, "suspended")
                self._close_record(slot, process, "stopped", note="its orchestrator ended")
                stopped = True
        if stopped:
            # A check runs in a process group of its own, so stopping the agent's group
            # left it running (its MCP server was killed before it could end it).
            for message in end_orphaned_checks(self.store.dir):
                log.info("stopped with its agent: %s", message)
        if self._owns_notifier:
            self.notifier.finish()
