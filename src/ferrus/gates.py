"""Capacity gates: tiers and actions, the phase machine, dispatch gates (pure).

Before every agent spawn and every transition HQ drives, the usage signals are
classified Green / Orange / Red and mapped to Continue, Throttle, Checkpoint or
EmergencyStop (ARCHITECTURE.md, 'Capacity gates'); the parallel runner's phases
P0–P7 move only through the same gate, and dispatch gates check a batch before it
runs.  Callers journal every decision."""

import dataclasses

from .basics import FerrusError, deferred_dataclass
from .session_machine import (CHECKPOINT, CONTINUE, EMERGENCY_STOP, GREEN, ORANGE, RED,
                              THROTTLE)


@deferred_dataclass(frozen=True)
class Signals:
    """The usage a capacity gate judges: counts since the budget last started."""

    tool_calls: int = 0
    sessions: int = 0
    tasks_completed: int = 0
    tokens_used: int = 0
    parallel_agents: int = 0
    turns: int = 0                 # model turns the agents reported
    context_tokens_used: int = 0   # the largest context a running agent holds now
    context_tokens_max: int = 0    # the model's context window (0: unknown, not judged)


# The signals that count usage (the others are levels: agents running, context held).
USAGE_COUNTS = ("tool_calls", "sessions", "tasks_completed", "tokens_used", "turns")


def usage_since(current, base):
    """``current`` with its counts from ``base`` on (never below 0), its levels as
    they are: what a budget that started at ``base`` has used."""
    return dataclasses.replace(current, **{
        name: max(0, getattr(current, name) - getattr(base, name)) for name in USAGE_COUNTS})


def usage_added(base, more):
    """The counts of ``base`` and ``more`` together (a budget's new start)."""
    return Signals(**{name: getattr(base, name) + getattr(more, name)
                      for name in USAGE_COUNTS})


# signal field -> the limit it is measured against
SIGNAL_LIMITS = (("tool_calls", "max_tool_calls"), ("sessions", "max_sessions"),
                 ("tasks_completed", "max_tasks"), ("tokens_used", "max_tokens"),
                 ("parallel_agents", "max_parallel_agents"), ("turns", "max_turns"))


def classify(signals, limits):
    """(tier, action, the signal closest to its limit or None).

    The context in use is judged as a share of the window the signals carry (a full
    window is 100 %, like any limit reached); an unknown window judges nothing."""
    worst, ratio = None, 0.0
    for name, limit_name in SIGNAL_LIMITS:
        limit = getattr(limits, limit_name, 0)
        if limit > 0:
            share = getattr(signals, name) / float(limit)
            if share > ratio:
                worst, ratio = name, share
    if signals.context_tokens_max > 0:
        share = signals.context_tokens_used / float(signals.context_tokens_max)
        if share > ratio:
            worst, ratio = "context_tokens_used", share
    if ratio * 100 >= limits.emergency_percent:
        return RED, EMERGENCY_STOP, worst
    if ratio >= 1.0:
        return RED, CHECKPOINT, worst
    if ratio * 100 >= limits.orange_percent:
        return ORANGE, THROTTLE, worst
    return GREEN, CONTINUE, worst


def gate_record(target, tier, action, signals, limits, worst=None):
    """The journal detail of one gate decision (a GateRecord, plus the limits)."""
    record = {"target": target, "tier": tier, "action": action, "signal": worst}
    record.update(dataclasses.asdict(signals))
    record["limits"] = {name: getattr(limits, name, 0) for _, name in SIGNAL_LIMITS
                        if getattr(limits, name, 0)}
    return record


# -- the phase machine (ARCHITECTURE.md, 'Phase machine') ------------------------------
#
# A parallel run's cycle goes through eight phases.  Every move between them is
# checked against the allowed transitions, passes the capacity gate and leaves a
# GateRecord, so the audit trail shows each phase entered and the usage at that moment.

PHASE_NAMES = ("preflight", "plan", "prepare", "dispatch", "collect", "integrate", "report",
               "cleanup")
(PHASE_PREFLIGHT, PHASE_PLAN, PHASE_PREPARE, PHASE_DISPATCH, PHASE_COLLECT, PHASE_INTEGRATE,
 PHASE_REPORT, PHASE_CLEANUP) = range(len(PHASE_NAMES))

# phase -> the phases it may go to.  P0's targets depend on the recovery target (see
# PhaseMachine.allowed_targets): P1 on a fresh start, only the interrupted phase after a crash.
PHASE_TRANSITIONS = {
    PHASE_PREFLIGHT: (PHASE_PLAN,),
    PHASE_PLAN: (PHASE_PREPARE,),
    PHASE_PREPARE: (PHASE_DISPATCH,),
    PHASE_DISPATCH: (PHASE_COLLECT,),
    PHASE_COLLECT: (PHASE_DISPATCH, PHASE_INTEGRATE),       # back to P3 while work and slots remain
    PHASE_INTEGRATE: (PHASE_PLAN, PHASE_PREPARE, PHASE_REPORT),
    PHASE_REPORT: (PHASE_CLEANUP,),
    PHASE_CLEANUP: (PHASE_PLAN,),
}


# What each phase is doing, for people: the phase codes are for the record and the code.
PHASE_WORDS = ("checking the repository (and recovering a run that stopped)",
               "choosing the next queued tasks", "preparing the tasks' worktrees",
               "starting the tasks' agents", "waiting for the agents' work",
               "merging approved tasks into the target branch", "reporting how tasks ended",
               "cleaning up")


def _is_phase(phase):
    return isinstance(phase, int) and not isinstance(phase, bool) and \
        0 <= phase < len(PHASE_NAMES)


def phase_label(phase):
    """``P3 dispatch``, or the bare value when it names no phase (for the record; people
    read phase_words)."""
    if _is_phase(phase):
        return "P%d %s" % (phase, PHASE_NAMES[phase])
    return repr(phase)


def phase_words(phase):
    """What a parallel run does in ``phase``, in words: ``merging approved tasks into the
    target branch``."""
    return PHASE_WORDS[phase] if _is_phase(phase) else "an unknown step (%r)" % (phase,)


class InvalidPhaseTransition(FerrusError):
    """A phase move the machine does not allow; nothing changed."""

    def __init__(self, from_phase, to_phase, allowed):
        self.from_phase = from_phase
        self.to_phase = to_phase
        self.allowed = tuple(allowed)
        super().__init__(
            "phase transition %s → %s is not allowed (from %s: %s)" % (
                phase_label(self.from_phase), phase_label(self.to_phase),
                phase_label(self.from_phase),
                ", ".join(phase_label(p) for p in self.allowed) or "nothing"),
            "the cycle is P0 → P1 → P2 → P3 → P4 (→ P3 while work and slots remain) → P5 → "
            "P1, P2 or P6 → P7 → P1; after a crash P0 goes only to the phase it interrupted")


class ShutdownRequired(FerrusError):
    """The capacity gate answered Checkpoint or EmergencyStop before a phase move: the
    phase did not change; the caller persists its state and halts."""

    def __init__(self, action, record):
        signal = record.get("signal")
        super().__init__(
            "capacity %s before %s: %s" % (
                action, phase_label(record.get("phase")),
                "%s reached %s" % (signal, record.get(signal)) if signal else "a limit is reached"),
            "raise the limit in [capacity] of ferrus.toml, then resume")
        self.action = action
        self.record = record


def phase_gate_record(phase, tier, action, signals, limits, worst=None, from_phase=None):
    """One phase move's GateRecord: the target phase, tier, action and the signals the
    audit trail keeps — tool calls, turns, tasks completed, context tokens used and max,
    with every other signal — plus where it came from, the deciding signal and the limits."""
    record = {"phase": phase, "phase_name": PHASE_NAMES[phase], "from_phase": from_phase,
              "tier": tier, "action": action, "signal": worst}
    record.update(dataclasses.asdict(signals))
    record["limits"] = {name: getattr(limits, name, 0) for _, name in SIGNAL_LIMITS
                        if getattr(limits, name, 0)}
    return record


def _phase_number(value, low, what):
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < len(PHASE_NAMES):
        raise FerrusError("%s must be a phase number from %d to %d, got %r" % (
            what, low, len(PHASE_NAMES) - 1, value),
            "phases are %s" % ", ".join(phase_label(p) for p in range(len(PHASE_NAMES))))
    return value


class PhaseMachine:
    """Which phase the cycle is in, and the only way to move it: ``transition``.

    Pure: it keeps the phase, the recovery target and the GateRecords of this process
    in ``history``; persisting ``to_json()`` and journaling the records is the caller's."""

    def __init__(self, phase=PHASE_PREFLIGHT, recovery_target=0, history=None):
        self.phase = _phase_number(phase, 0, "phase")
        self.recovery_target = _phase_number(recovery_target, 0, "recovery target")
        if self.recovery_target and self.phase != PHASE_PREFLIGHT:
            raise FerrusError("a recovery target (%s) is kept only in P0 preflight, not in %s"
                              % (phase_label(self.recovery_target), phase_label(self.phase)),
                              "the machine resumes from P0: use PhaseMachine.resumed(saved)")
        self.history = list(history) if history is not None else []

    def set_recovery_target(self, phase):
        """After a crash: P0 may then go only to ``phase``, the one that was interrupted."""
        if self.phase != PHASE_PREFLIGHT:
            raise FerrusError("a recovery target is set in P0 preflight; the machine is in %s"
                              % phase_label(self.phase),
                              "start a resumed run from P0 (PhaseMachine.resumed(saved))")
        self.recovery_target = _phase_number(phase, 1, "the recovery target")

    def allowed_targets(self):
        if self.phase == PHASE_PREFLIGHT and self.recovery_target:
            return (self.recovery_target,)
        return PHASE_TRANSITIONS[self.phase]

    def transition(self, target, signals, limits):
        """Move to ``target`` when allowed and the capacity gate lets work go on.

        Returns (action, record) on Continue or Throttle (a Throttle moves too: waiting
        is the caller's business).  Raises InvalidPhaseTransition (nothing recorded) or,
        on Checkpoint / EmergencyStop, ShutdownRequired after recording the decision."""
        allowed = self.allowed_targets()
        if type(target) is not int or target not in allowed:     # 2.0, True, "2" are not phases
            raise InvalidPhaseTransition(self.phase, target, allowed)
        tier, action, worst = classify(signals, limits)
        record = phase_gate_record(target, tier, action, signals, limits, worst, self.phase)
        self.history.append(record)
        if action in (CHECKPOINT, EMERGENCY_STOP):
            raise ShutdownRequired(action, record)
        if self.phase == PHASE_PREFLIGHT:
            self.recovery_target = 0
        self.phase = target
        return action, record

    def to_json(self):
        return {"phase": self.phase, "recovery_target": self.recovery_target}

    @classmethod
    def from_json(cls, data):
        """The machine exactly as ``to_json`` saved it (history starts empty)."""
        if not isinstance(data, dict):
            raise FerrusError("a saved phase machine must be an object with phase and "
                              "recovery_target, got %s" % type(data).__name__,
                              "the saved phase is damaged: without it the run starts "
                              "afresh from P0")
        return cls(data.get("phase", PHASE_PREFLIGHT), data.get("recovery_target", 0))

    @classmethod
    def resumed(cls, data):
        """After a crash: back in P0, whose only way out is the phase that was interrupted
        (a fresh start when the run had not left P0)."""
        saved = cls.from_json(data)
        machine = cls()
        target = saved.phase or saved.recovery_target
        if target:
            machine.set_recovery_target(target)
        return machine


# -- dispatch gates ------------------------------------------------------------------
#
# Before a parallel run collects (P3 → P4) it checks what it dispatched: every task it
# chose has a dispatch record, the batch fits `max_tasks`, and a task a supervisor split
# off as team lead went to an agent the topology allows.

@deferred_dataclass(frozen=True)
class DispatchRecord:
    """One agent session started for a task."""

    task_id: str
    role: str           # executor | reviewer | consultant
    agent: str
    session_id: str = ""


class DispatchGateError(FerrusError):
    """A dispatch gate failed: ``gate`` names it, ``tasks`` the task ids concerned."""

    def __init__(self, gate, tasks, message, hint):
        super().__init__(message, hint)
        self.gate = gate
        self.tasks = list(tasks)


def _unique(ids):
    return list(dict.fromkeys(ids))


def check_dispatch_coverage(selected_task_ids, records):
    """Every task chosen for the batch has at least one dispatch record."""
    covered = {record.task_id for record in records}
    missing = [task for task in _unique(selected_task_ids) if task not in covered]
    if missing:
        raise DispatchGateError(
            "coverage", missing, "dispatch coverage: no agent was dispatched for %s %s"
            % ("task" if len(missing) == 1 else "tasks", ", ".join(missing)),
            "dispatch each chosen task (P3) before collecting, or take it out of the batch")


def check_batch_size(selected_task_ids, max_tasks):
    """The batch holds at most ``max_tasks`` tasks (0: no limit)."""
    batch = _unique(selected_task_ids)
    if max_tasks > 0 and len(batch) > max_tasks:
        raise DispatchGateError(
            "batch", batch[max_tasks:], "batch size: %d tasks chosen, at most %d run at once "
            "(over: %s)" % (len(batch), max_tasks, ", ".join(batch[max_tasks:])),
            "choose at most max_tasks tasks per batch, or raise [parallel] max_tasks")


def check_delegation(tasks, records, allowed_agents):
    """A task a supervisor session split off as team lead (its origin has
    ``delegated_by``) went to an executor agent the topology allows.

    ``tasks`` is [(task id, origin dict)]; ``allowed_agents`` None means no topology
    restricts the agents."""
    if allowed_agents is None:
        return
    allowed = set(allowed_agents)
    wrong = []
    for task_id, origin in tasks:
        if not isinstance(origin, dict) or not origin.get("delegated_by"):
            continue
        agents = [r.agent for r in records if r.task_id == task_id and r.role == "executor"]
        if not agents or any(agent not in allowed for agent in agents):
            wrong.append((task_id, origin["delegated_by"], agents))
    if wrong:
        raise DispatchGateError(
            "delegation", [task for task, _, _ in wrong],
            "team-lead delegation: %s" % "; ".join(
                "task %s (split off by session %s) went to %s" % (
                    task, lead, ", ".join(agents) if agents else "no executor")
                for task, lead, agents in wrong),
            "the topology allows %s as the executor of a delegated task" % (
                ", ".join(sorted(allowed)) if allowed else "no agent"))


def run_dispatch_gates(selected, records, tasks, max_tasks, allowed_agents):
    """Coverage, batch size and delegation, in that order; raises the first failure."""
    check_dispatch_coverage(selected, records)
    check_batch_size(selected, max_tasks)
    check_delegation(tasks, records, allowed_agents)
