"""Pipelines: the orchestrator, its reconcile loop and decision table.

reconcile() reads the files, brings status.json up to date and applies the decision
table (ARCHITECTURE.md, 'Reconcile table'); it is idempotent, so it can run on every
tick, after every restart, from any process."""

import contextlib
import json
import os
import time

from .basics import (FerrusError, UsageError, format_duration, format_timestamp,
                     json_for_terminal, log, parse_timestamp, pretty_json)
from .system import FileLock, atomic_write, fsync_directory, kill_process_tree, read_text
from .session_machine import (CHECKPOINT, CONTINUE, EMERGENCY_STOP, Session, SessionEvent,
                              THROTTLE, session_step)
from .gates import Signals, classify, gate_record
from .store import FERRUS_DIR
from .register import adapter_for
from .sessions import (HqMessage, format_usage, read_session_records, sessions_config,
                       usage_summary)
from .notify import Notifier
from .parallel import RUN_COMPLETE, RUN_FAILED, RUN_NEEDS_HUMAN
from .run import _run_line
from .pipeline_defs import (PIPELINES_DIR, PIPELINE_ARCHIVE, PIPELINE_GRACE_SECS,
                            PipelineOutcome, PipelineRun, PipelineWorkers,
                            SPAWN_GRACE_SECS, WORKER_RUNNING, _SESSION_OF, _STATUS_OF,
                            _check, _has_output, _new_worker, find_run, list_runs,
                            parse_workflows, pipelines_config, read_run, read_workflows,
                            run_state, start_worker_process, summarize_output)


# -- the orchestrator ----------------------------------------------------------------------------

class PipelineOrchestrator(PipelineWorkers):
    """Creates runs and reconciles them; the only writer of status.json.

    ``clock`` returns aware datetimes (the store's clock by default).  Deadlines are
    kept in status.json as timestamps so that they survive restarts.
    ``spawner(launch, root, base)`` starts a worker and returns something with
    ``pid`` and ``poll()``.  ``gate(target)`` is the capacity hook: it is asked
    before every spawn and answers Continue, Throttle, Checkpoint or EmergencyStop.
    ``emit`` receives an HqMessage for every event."""

    # A running worker that showed nothing for this long gets a heartbeat line.
    HEARTBEAT_SECS = 60.0
    WATCH_READ_BYTES = 65536       # at most this much of a worker's log is read per look

    def __init__(self, store, clock=None, spawner=None, gate=None, emit=None, bell=None):
        self.store = store.require()
        self.clock = clock or store.clock
        self.spawner = spawner or start_worker_process
        self.gate = gate or self._capacity_gate
        self.emit = emit or (lambda message: log.info("%s", message.text))
        # emit may be replaced later (HQ follows a run with its own), so look it up late.
        self.notifier = Notifier(store, lambda message: self.emit(message), bell)
        self._watched = {}         # (run, role, attempt) -> what watch() read of its log
        self.config = store.config()
        self.settings = pipelines_config(store.root)
        self.limits = sessions_config(store.root)
        self._processes = {}       # (run, role) -> (spawn token, the process, ours or adopted)
        self._pending = []         # journal entries that wait for the next status.json write
        self._run = None           # the run being reconciled, for the default gate

    def _lock(self):
        os.makedirs(self.store.path(PIPELINES_DIR), exist_ok=True)
        return FileLock(self.store.path(PIPELINES_DIR, ".lock"), self.store.lock_timeout,
                        "%s/%s/.lock" % (FERRUS_DIR, PIPELINES_DIR))

    def _now(self):
        return format_timestamp(self.clock())

    def _age(self, stamp):
        return (self.clock() - parse_timestamp(stamp)).total_seconds()

    def _note(self, run, event, text, kind="info", **detail):
        self._pending.append((event, dict(run=run.name, **detail), HqMessage(kind, text)))

    def _save(self, run):
        """Write status.json first (it is the truth), then journal what it records."""
        atomic_write(run.file("status.json"), pretty_json(run.status) + "\n")
        pending, self._pending = self._pending, []
        for event, detail, message in pending:
            with contextlib.suppress(FerrusError, OSError):
                self.store.append_event("pipeline", event, detail)
            self.emit(message)

    def create(self, pipeline, topic):
        """Make the run folder with a workflow.json snapshot and status.json; return its name."""
        if not topic.strip():
            raise UsageError("the topic is empty", "ferrus pipeline run NAME TOPIC")
        file_name, text, definitions = read_workflows(self.store.root, self.config)
        if pipeline not in definitions:
            raise FerrusError("no pipeline %s in %s" % (json.dumps(pipeline), file_name),
                              "defined: %s" % (", ".join(definitions) or "none"))
        # The snapshot fixes the definition and the default agent for the whole run.
        snapshot = json.loads(text)[pipeline]
        for p_index, phase in enumerate(snapshot["phases"]):
            for w_index, worker in enumerate(phase["workers"]):
                if not worker.get("agent", "").strip():
                    choice = self.config.require_hq().executor
                    _check(choice is not None, file_name, "%s.phases[%d].workers[%d]" % (
                        pipeline, p_index, w_index), "names no agent and ferrus.toml has no "
                        "[hq.executor] to default to")
                    worker.update(agent=choice.agent, model=worker.get("model") or choice.model)
        definition = parse_workflows(json.dumps({pipeline: snapshot}), file_name)[pipeline]
        stamp = self.clock().astimezone().strftime("%Y%m%d-%H%M%S")
        taken = {name for name, _, _ in list_runs(self.store)}
        with self._lock():
            for name in ["%s-%s%s" % (pipeline, stamp, suffix)
                         for suffix in [""] + ["-%d" % n for n in range(2, 100)]]:
                path = self.store.path(PIPELINES_DIR, name)
                if name not in taken and not os.path.exists(path):
                    break
            else:
                raise FerrusError("too many %s runs started within one second" % pipeline)
            os.makedirs(os.path.join(path, "logs"))
            atomic_write(os.path.join(path, "workflow.json"),
                         pretty_json({pipeline: snapshot}) + "\n")
            status = {"pipeline": pipeline, "dir": name, "topic": topic.strip(),
                      "current_phase": 0, "retry_count": 0,
                      "phases": [{"id": p.id, "status": "pending", "started_at": None,
                                  "message": "", "workers": {w.role: _new_worker()
                                                             for w in p.workers}}
                                 for p in definition.phases],
                      "result_delivered": False, "paused": False, "paused_reason": "",
                      "cancelled": False, "created_at": self._now()}
            run = PipelineRun(name, path, False, status, definition)
            self._note(run, "run_created", "run %s created in %s" % (
                name, self.store.relpath(path)), pipeline=pipeline, topic=status["topic"])
            self._save(run)
        return name

    # -- reconcile: files in; status.json and the decision table out ----------------------

    def reconcile(self, ref):
        """One idempotent step; returns a PipelineOutcome."""
        with self._lock():
            run = read_run(self.store, ref, with_definition=True)
            before = json.dumps(run.status, sort_keys=True)
            self._run = run
            try:
                return self._decide(run)
            finally:
                self._run = None
                if self._pending or json.dumps(run.status, sort_keys=True) != before:
                    self._save(run)
                self._settle_records(run)
                self._sweep(run)

    def _decide(self, run):
        status = run.status
        if status.get("cancelled") or status["result_delivered"]:
            return self._archive(run)            # result_delivered → archive
        while True:
            index, phase = status["current_phase"], run.phase()
            definition = run.definition.phases[index]
            if phase["status"] == "pending":
                phase.update(status="running", started_at=self._now())
                self._note(run, "phase_started", "phase %s started (%d worker%s, %s)" % (
                    phase["id"], len(definition.workers), "s"[len(definition.workers) == 1:],
                    definition.mode), phase=phase["id"])
            self._observe(run, definition)
            # A phase is failed while a worker of it is (retry, or a late output, lifts
            # that); its other workers run on and their outputs are kept.
            failed = [role for role, w in phase["workers"].items() if w["status"] == "failed"]
            if failed:
                message = "; ".join("%s failed: %s" % (role, phase["workers"][role]["message"])
                                    for role in failed)
                if (phase["status"], phase["message"]) != ("failed", message):
                    phase.update(status="failed", message=message)
                    self._note(run, "phase_failed", "phase %s failed — %s" % (
                        phase["id"], message), "error", phase=phase["id"], workers=failed)
                return PipelineOutcome(run.name, "failed", message)
            if phase["status"] == "failed":
                phase.update(status="running", message="")
            problems = self._dispatch_gates(run, definition)
            if not problems and all(w["status"] == "completed" for w in phase["workers"].values()):
                phase.update(status="completed", finished_at=self._now())
                self._note(run, "phase_completed", "phase %s completed" % phase["id"],
                           phase=phase["id"])
                if index == len(status["phases"]) - 1:
                    return self._deliver(run)
                status["current_phase"] += 1
                if definition.pause_after:
                    summary = [line for w in definition.workers
                               for line in summarize_output(run.file(w.output),
                                                            self.store.relpath(run.file(w.output)))]
                    self._pause(run, "pause_after %s" % phase["id"], "phase %s is done; its "
                                "outputs:\n%s\nRead them, then `ferrus pipeline continue %s` "
                                "starts phase %s" % (phase["id"], "\n".join(summary), run.name,
                                                     run.phase()["id"]))
                else:
                    continue           # the next phase starts at once
            if not problems and not status["paused"]:
                self._dispatch(run, definition)
            if status["paused"]:
                return PipelineOutcome(run.name, "paused", status["paused_reason"])
            if problems and not any(w["status"] in WORKER_RUNNING for w in phase["workers"].values()):
                return PipelineOutcome(run.name, "blocked", phase["message"])
            return PipelineOutcome(run.name, "running", phase["message"])

    def _observe(self, run, definition):
        """Bring the current phase's workers up to date with their files and processes."""
        for worker in definition.workers:
            entry = run.phase()["workers"][worker.role]
            if entry["status"] in ("completed", "cancelled"):
                continue
            if entry["attempts"] and _has_output(run.file(worker.output)):
                # The file is the signal, whatever the session thought.
                if entry["status"] == "running":
                    self._step(run, worker.role, SessionEvent("SessionExited", outcome="success"))
                entry.update(status="completed", retry_at=None, message="")
                self._note(run, "worker_completed", "%s completed: %s" % (
                    worker.role, run.file(worker.output)), role=worker.role)
                continue
            if entry["status"] not in WORKER_RUNNING:
                continue
            process = self._process(run, worker.role, entry)
            if entry["status"] == "spawning":
                if process is None and self._age(entry["started_at"]) < SPAWN_GRACE_SECS:
                    continue           # someone may be recording its start right now
                if process is not None:
                    self._step(run, worker.role, SessionEvent("SessionStarted", entry["attempts"]))
                    entry["pid"] = process.pid
                    self._note(run, "worker_adopted", "%s was started before a restart; adopted "
                               "pid %d" % (worker.role, process.pid), "agent", role=worker.role,
                               pid=process.pid, attempt=entry["attempts"])
            if process is not None and process.poll() is None:
                if self._age(entry["started_at"]) > definition.timeout + PIPELINE_GRACE_SECS:
                    self._step(run, worker.role, SessionEvent("OperatorStop"))
                    kill_process_tree(process)
                    entry["message"] = "timed out: still running after %s (phase timeout %ds " \
                        "+ %ds)" % (format_duration(self._age(entry["started_at"])),
                                    definition.timeout, PIPELINE_GRACE_SECS)
                    self._note(run, "worker_failed", "%s %s" % (worker.role, entry["message"]),
                               "error", role=worker.role, reason="timeout")
                continue
            code = getattr(process, "returncode", None)
            self._exited(run, worker, entry, "its start was interrupted before the process "
                         "existed" if process is None else "exited %swithout writing %s" % (
                             "with code %s " % code if isinstance(code, int) else "",
                             worker.output))

    def _step(self, run, role, event):
        """One transition of the session that a worker entry persists."""
        entry = next(p["workers"][role] for p in run.status["phases"] if role in p["workers"])
        session = Session(state=_SESSION_OF[entry["status"]], session_seq=entry["attempts"],
                          consecutive_errors=entry["errors"], total_errors=entry["total_errors"],
                          max_consecutive_errors=self.limits.max_consecutive_errors,
                          max_total_errors=self.limits.max_total_errors)
        session, effect = session_step(session, event)
        entry.update(status=_STATUS_OF[session.state], errors=session.consecutive_errors,
                     total_errors=session.total_errors)
        return session, effect

    def _base(self, run, role, entry):
        return run.file("logs", "%s-%d" % (role, entry["attempts"]))

    # -- session records ------------------------------------------------------------------

    # How an ended worker attempt's record reads, by the worker's status after it.
    _RECORD_OUTCOME = {"completed": "success", "failed": "failed", "cooling": "error",
                       "cancelled": "cancelled", "pending": "stopped"}

    # -- dispatch gates (ARCHITECTURE.md, 'Dispatch gates') ------------------------------------

    def _dispatch_gates(self, run, definition):
        """Coverage, batch size and input coverage for the current phase.  While one of
        them fails, the phase is "blocked" and nothing more in it is dispatched."""
        phase, problems = run.phase(), []
        for worker in definition.workers:
            entry = phase["workers"][worker.role]
            recorded = bool(entry["token"] and entry["attempts"])
            if entry["status"] == "completed" and not recorded:
                problems.append("coverage: %s is marked completed without a dispatch record"
                                % worker.role)
            elif not recorded and _has_output(run.file(worker.output)):
                problems.append("coverage: %s exists but %s was never dispatched (`ferrus "
                                "pipeline retry %s %s` discards it and runs the worker)" % (
                                    worker.output, worker.role, run.name, worker.role))
            missing = [name for name in worker.reads if not _has_output(run.file(name))]
            if missing and entry["status"] in ("pending", "cooling"):
                problems.append("input: %s waits for %s (missing)" % (
                    worker.role, ", ".join(missing)))
        running = [role for role, w in phase["workers"].items() if w["status"] in WORKER_RUNNING]
        if len(running) > self._batch_limit(definition):
            problems.append("batch size: %d workers running (%s), more than the %d allowed" % (
                len(running), ", ".join(running), self._batch_limit(definition)))
        message = "; ".join(problems)
        if problems and message != phase["message"]:
            self._note(run, "phase_blocked", "phase %s blocked — %s" % (phase["id"], message),
                       "warning", phase=phase["id"], problems=problems)
        if problems or phase["status"] == "blocked":
            phase.update(status="blocked" if problems else "running", message=message)
        return problems

    def _batch_limit(self, definition):
        return 1 if definition.mode == "sequential" else self.settings.max_parallel

    def _dispatch(self, run, definition):
        """Start what the phase allows: in definition order, at most the batch limit at once."""
        phase, now = run.phase(), self.clock()
        running = sum(w["status"] in WORKER_RUNNING for w in phase["workers"].values())
        for worker in definition.workers:
            entry = phase["workers"][worker.role]
            if entry["status"] == "completed":
                continue
            due = entry["status"] == "pending" or (
                entry["status"] == "cooling" and parse_timestamp(entry["retry_at"]) <= now)
            if due and running < self._batch_limit(definition):
                action = self.gate("pipeline:%s:%s" % (run.name, worker.role))
                if action == CHECKPOINT:
                    self._pause(run, "capacity checkpoint", "capacity checkpoint before %s; "
                                "`ferrus pipeline continue %s` goes on" % (worker.role, run.name))
                    return
                if action == EMERGENCY_STOP:
                    stopped = self._stop_workers(run, "pending", "stopped by the capacity gate")
                    self._pause(run, "capacity emergency stop", "capacity emergency stop; "
                                "stopped %s" % (", ".join(stopped) or "no worker"))
                    return
                self._spawn(run, worker, entry, throttled=action == THROTTLE)
                running += entry["status"] in WORKER_RUNNING
            if definition.mode == "sequential":
                return                 # the next worker waits for this one to finish

    def _capacity_gate(self, target):
        """The default hook: the capacity gate on this run's own signals, each decision
        journaled.
        A Throttle is only recorded here; waiting is the business of the gate's owner."""
        limits = self.config.capacity
        if not limits.enabled() or self._run is None:
            return CONTINUE
        workers = [w for p in self._run.status["phases"] for w in p["workers"].values()]
        used = usage_summary([r for r in read_session_records(self.store)
                              if r.get("pipeline") == self._run.name])
        signals = Signals(sessions=sum(w["attempts"] for w in workers) + 1,
                          tokens_used=used["input_tokens"] + used["output_tokens"],
                          parallel_agents=sum(w["status"] in WORKER_RUNNING for w in workers) + 1)
        tier, action, worst = classify(signals, limits)
        with contextlib.suppress(FerrusError, OSError):
            self.store.append_event("pipeline", "gate", gate_record(target, tier, action, signals,
                                                                    limits, worst))
        return action

    # -- pausing, delivering, stopping -------------------------------------------------------------

    def _pause(self, run, reason, text):
        run.status.update(paused=True, paused_reason=reason)
        self._note(run, "paused", text, "warning", reason=reason)

    def _deliver(self, run):
        final = run.definition.final_worker()
        run.status.update(result_delivered=True, result=final.output, delivered_at=self._now())
        # The folder moves to the archive right after this, so name the output where it
        # will be (the run's current path would no longer exist).
        archived = self.store.path(PIPELINES_DIR, PIPELINE_ARCHIVE, run.name, final.output)
        where = self.store.relpath(run.file(final.output) if run.archived else archived)
        self._note(run, "delivered", "delivered %s" % where, output=final.output)
        self._save(run)            # delivered on disk before the folder moves
        self.notifier.notify("pipeline_delivered", run.name, "%s: %s" % (
            run.status.get("topic", ""), where))
        return self._archive(run)

    def _archive(self, run):
        """Move a finished run into .ferrus/pipelines/archive/ (again: nothing to do)."""
        if not run.archived:
            archive = self.store.path(PIPELINES_DIR, PIPELINE_ARCHIVE)
            os.makedirs(archive, exist_ok=True)
            old_path = run.path
            os.replace(run.path, os.path.join(archive, run.name))
            fsync_directory(archive)
            run.path, run.archived = os.path.join(archive, run.name), True
            self._relocate_records(run, old_path)
            self._note(run, "archived", "run %s archived in %s" % (
                run.name, self.store.relpath(run.path)), to=self.store.relpath(run.path))
        if run.status.get("cancelled"):
            return PipelineOutcome(run.name, "cancelled", "the run was cancelled")
        output = run.file(run.status.get("result") or run.definition.final_worker().output)
        return PipelineOutcome(run.name, "delivered", output, output,
                               read_text(output, default=""))

    # -- operator commands ----------------------------------------------------------------------

    def _change(self, ref, change):
        """Apply ``change(run)`` to an active run under the lock, then save it."""
        with self._lock():
            run = read_run(self.store, ref, with_definition=True)
            if run.archived:
                raise FerrusError("run %s is %s and archived" % (run.name, run_state(run.status)),
                                  "start a new one with `ferrus pipeline run`")
            change(run)
            self._save(run)
            return run.name

    def continue_run(self, ref):
        """Un-pause after pause_after or a capacity checkpoint."""
        def change(run):
            if not run.status["paused"]:
                raise FerrusError("run %s is not paused (it is %s)" % (
                    run.name, run_state(run.status)),
                    "`ferrus pipeline resume %s` follows it" % run.name)
            self._note(run, "continued", "continuing after %s" % run.status["paused_reason"],
                       reason=run.status["paused_reason"])
            run.status.update(paused=False, paused_reason="")
        return self._change(ref, change)

    def retry(self, ref, role):
        """Forget a worker's failure (or a stray output) so that it runs again."""
        def change(run):
            phase = run.phase()
            if role not in phase["workers"]:
                raise UsageError("%s is not a worker of the current phase %s (workers: %s)" % (
                    json.dumps(role), phase["id"], ", ".join(phase["workers"])))
            entry = phase["workers"][role]
            if entry["status"] in WORKER_RUNNING:
                raise FerrusError("%s is running (pid %s)" % (role, entry["pid"]),
                                  "wait for it, or `ferrus pipeline cancel %s`" % run.name)
            if entry["status"] == "completed" and entry["token"]:
                raise FerrusError("%s already completed" % role,
                                  "its output is %s" % run.file(role + ".md"))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(run.file(role + ".md"))   # a stray or partial output is no signal
            phase["workers"][role] = dict(_new_worker(entry["attempts"]), token=entry["token"])
            if phase["status"] in ("failed", "blocked"):
                phase.update(status="running", message="")    # reconcile derives both again
            self._note(run, "worker_retry", "%s will run again" % role, role=role)
        return self._change(ref, change)

    def cancel(self, ref):
        """Stop the run's workers, mark it cancelled and archive it."""
        def change(run):
            stopped = self._stop_workers(run, "cancelled", "the run was cancelled")
            for phase in run.status["phases"]:
                if phase["status"] not in ("completed", "failed"):
                    phase["status"] = "cancelled"
            run.status.update(cancelled=True, paused=False)
            self._note(run, "cancelled", "run %s cancelled%s" % (run.name, (
                "; stopped " + ", ".join(stopped)) if stopped else ""), "warning", stopped=stopped)
            self._save(run)        # cancelled on disk before the folder moves
            self._archive(run)
        return self._change(ref, change)

    def drive(self, ref, poll_interval=0.1, should_stop=None):
        """Reconcile until the run is done or needs a human: the foreground loop."""
        while True:
            outcome = self.reconcile(ref)
            if outcome.finished:
                self.await_workers(outcome.run, poll_interval=poll_interval)
            if outcome.finished or (should_stop is not None and should_stop()):
                return outcome
            self.watch(ref)
            time.sleep(poll_interval)

    # -- live progress ------------------------------------------------------------------------

    def watch(self, ref):
        """What the current phase's running workers are doing, as HQ shows its agents:
        one line per tool call their output reports, and a heartbeat (time, tool calls,
        last words) when one showed nothing for HEARTBEAT_SECS.  Only reads: progress is
        no part of status.json."""
        try:
            run = read_run(self.store, ref, with_definition=True)
        except (FerrusError, OSError, ValueError):
            return
        if run.archived:
            return
        now, current = self.clock(), set()
        definition = run.definition.phases[run.status["current_phase"]]
        for worker in definition.workers:
            entry = run.phase()["workers"][worker.role]
            if entry["status"] not in WORKER_RUNNING or not entry["attempts"]:
                continue
            key = (run.name, worker.role, entry["attempts"])
            current.add(key)
            watched = self._watched.get(key)
            if watched is None:
                parse = None
                with contextlib.suppress(FerrusError):
                    parse = adapter_for(self.config, worker.agent).parse_line
                watched = self._watched[key] = {"offset": 0, "rest": b"", "calls": 0,
                                                "said": "", "shown": now, "parse": parse}
            self._read_worker_log(run, worker.role, entry, watched)
            if (now - watched["shown"]).total_seconds() >= self.HEARTBEAT_SECS:
                watched["shown"] = now
                secs = self._age(entry["started_at"]) if entry.get("started_at") else 0.0
                text = "%s working, %s, %d tool call%s" % (
                    worker.role, format_duration(secs), watched["calls"],
                    "" if watched["calls"] == 1 else "s")
                if watched["said"]:
                    said = watched["said"]
                    text += "; last output: " + (said if len(said) <= 100 else said[:99] + "…")
                self.emit(HqMessage("agent", text, "heartbeat", {
                    "run": run.name, "slot": worker.role, "secs": round(secs, 1),
                    "tool_calls": watched["calls"], "last_output": watched["said"]}))
        for key in [k for k in self._watched if k[0] == run.name and k not in current]:
            del self._watched[key]



WORKFLOWS_EXAMPLE = {
    "_comment": [
        "ferrus pipelines (see docs/PIPELINES.md). Each top-level key but this one defines "
        "a pipeline:",
        "  description  what it is for",
        "  phases       run in order; a phase starts when every output of the previous exists",
        "    id         the phase's name;  mode: \"parallel\" or \"sequential\"",
        "    pause_after  true: stop after this phase until `ferrus pipeline continue RUN`",
        "    workers    each writes <role>.md in the run folder and exits",
        "      role, timeout (seconds), task     required",
        "      agent    an agent name; default: [hq.executor] in ferrus.toml",
        "      model    that agent's model name (e.g. sonnet); default: the agent's own",
        "      reads    outputs of earlier phases, e.g. [\"researcher-a.md\"]",
        "      final    exactly one worker, in the last phase: its output is the result",
        "Run: ferrus pipeline run research \"your topic\"",
    ],
    "research": {
        "description": "Pure research + analysis",
        "phases": [
            {"id": "collect", "mode": "parallel", "workers": [
                {"role": "researcher-a", "timeout": 600,
                 "task": "Research perspective A: main sources, facts, current state"},
                {"role": "researcher-b", "timeout": 600,
                 "task": "Research perspective B: alternative views, criticism, edge cases"}]},
            {"id": "synthesis", "mode": "sequential", "workers": [
                {"role": "synthesizer", "timeout": 420, "final": True,
                 "reads": ["researcher-a.md", "researcher-b.md"],
                 "task": "Synthesize research from both researchers"}]}]},
}


def init_workflows(root, report=print):
    """Write the example workflows.json; never over an existing file."""
    name = pipelines_config(root).file
    path = os.path.join(root, name)
    if os.path.exists(path):
        raise FerrusError("%s already exists" % name, "edit it, or move it away first")
    atomic_write(path, pretty_json(WORKFLOWS_EXAMPLE) + "\n")
    report("Wrote %s with an example pipeline (research). `ferrus pipeline list` shows it."
           % name)


def describe_workflows(definitions, config):
    """Lines listing every pipeline with its phases and workers."""
    default = config.executor.agent if config.executor else "[hq.executor] (not set)"
    lines = []
    for name, definition in definitions.items():
        lines.append("%s%s" % (name, " — " + definition.description
                               if definition.description else ""))
        for number, phase in enumerate(definition.phases, 1):
            lines.append("  %d. %s (%s%s, timeout %ds)" % (
                number, phase.id, phase.mode, ", pause after" if phase.pause_after else "",
                phase.timeout))
            for w in phase.workers:
                notes = [w.agent or default, "%ds" % w.timeout] + (["model " + w.model]
                                                                  if w.model else [])
                notes += ["reads " + ", ".join(w.reads)] if w.reads else []
                lines.append("     - %s%s (%s): %s" % (w.role, " [final]" if w.final else "",
                                                      ", ".join(notes), w.task))
    return lines or ["no pipelines defined"]


def describe_run(store, status, path, now=None):
    """Lines showing one run's phases and workers."""
    now = now or store.clock()
    lines = ["run       %s (%s%s)" % (status["dir"], run_state(status),
                                      ": " + status["paused_reason"] if status.get("paused")
                                      else ""),
             "pipeline  %s, topic %s" % (status["pipeline"], json.dumps(status["topic"])),
             "folder    %s" % store.relpath(path),
             "retries   %d" % status.get("retry_count", 0)]
    workers = [r for r in read_session_records(store) if r.get("pipeline") == status["dir"]]
    if workers:
        lines.append("usage     %s" % format_usage(usage_summary(workers)))
    for number, phase in enumerate(status["phases"], 1):
        current = "  <- current" if number - 1 == status["current_phase"] and \
            run_state(status) not in ("delivered", "cancelled") else ""
        lines.append("phase %d  %s: %s%s" % (number, phase["id"], phase["status"], current))
        if phase.get("message"):
            lines.append("          %s" % phase["message"])
        for role, w in phase["workers"].items():
            detail = "attempt %d" % w.get("attempts", 0) if w.get("attempts") else ""
            if w.get("status") in WORKER_RUNNING and w.get("pid"):
                detail += ", pid %s" % w["pid"]
                with contextlib.suppress(ValueError, TypeError):
                    detail += ", for %s" % format_duration(
                        (now - parse_timestamp(w["started_at"])).total_seconds())
            if w.get("message") and w.get("status") != "completed":
                detail += (", " if detail else "") + w["message"]
            lines.append("    %-16s %-10s %s" % (role, w.get("status"), detail))
    if status.get("result"):
        lines.append("result    %s" % store.relpath(os.path.join(path, status["result"])))
    return lines


def pipeline_command(store, args, out, follow, bell=None):
    """Run one `pipeline` subcommand; ``follow(orchestrator, run)`` drives a run."""
    command = args.pipeline_command
    if command == "init":
        init_workflows(store.root, out)
        return 0
    if command == "list":
        config = store.config()
        for line in describe_workflows(read_workflows(store.root, config)[2], config):
            out(line)
        return 0
    if command == "status":
        return _pipeline_status(store, args, out)
    orchestrator = PipelineOrchestrator(store, emit=lambda message: out(_run_line(message)),
                                        bell=bell)
    if command == "run":
        return follow(orchestrator, orchestrator.create(args.name, " ".join(args.topic)))
    if command == "resume":
        return follow(orchestrator, find_run(store, args.ref)[0])
    if command == "continue":
        return follow(orchestrator, orchestrator.continue_run(args.ref))
    if command == "retry":
        return follow(orchestrator, orchestrator.retry(args.ref, args.worker))
    orchestrator.cancel(args.ref)          # the parser allows nothing else
    return 0


def _pipeline_status(store, args, out):
    if args.ref:
        name, path, _ = find_run(store, args.ref)
        run = read_run(store, name)
        if args.json:
            out(json_for_terminal(pretty_json(run.status)))
        else:
            for line in describe_run(store, run.status, path):
                out(line)
        return 0
    rows = []
    for name, path, archived in list_runs(store):
        row = {"run": name, "state": "damaged", "archived": archived, "pipeline": "?",
               "topic": "", "phase": "?"}
        with contextlib.suppress(FerrusError):     # `status RUN` explains the damage
            status = read_run(store, name).status
            row.update(state=run_state(status), pipeline=status["pipeline"],
                       topic=status["topic"], phase="%d/%d %s" % (
                           status["current_phase"] + 1, len(status["phases"]),
                           status["phases"][status["current_phase"]]["id"]))
        rows.append(row)
    if args.json:
        out(json_for_terminal(pretty_json(rows)))
        return 0
    if not rows:
        out("no pipeline runs yet (`ferrus pipeline run NAME TOPIC` starts one)")
    for row in rows:
        out("%-32s %-10s phase %-16s %s%s" % (row["run"], row["state"], row["phase"],
                                             json.dumps(row["topic"]),
                                             "  (archived)" if row["archived"] else ""))
    return 0


def _pipeline_result(outcome, out):
    """Report how a followed run ended; the exit code says whether a human is needed."""
    if outcome.state == "delivered":
        out("result: %s" % outcome.output)
        out(outcome.text.rstrip())
        return 0
    if outcome.state == "failed":
        out("run %s failed: %s" % (outcome.run, outcome.message))
        out("hint: `ferrus pipeline retry %s WORKER` runs a worker again" % outcome.run)
        return RUN_FAILED
    if outcome.state in ("paused", "blocked"):
        out("run %s is %s: %s" % (outcome.run, outcome.state, outcome.message))
        return RUN_NEEDS_HUMAN
    out("run %s is %s" % (outcome.run, outcome.state))
    return RUN_FAILED if outcome.state == "cancelled" else RUN_COMPLETE
