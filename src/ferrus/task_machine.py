"""Task state machine: states, the transition table, leases (pure).

STATE.json's fields and spellings are upstream's (new fields are additive); every
transition is a pure function of the state and the clock, and the table TRANSITIONS
is what the code, the docs and the tests follow."""

import collections
import contextlib
import dataclasses
import datetime as _dt
import enum
import json
import threading

from .basics import (FerrusError, TransitionError, deferred_dataclass, fields_of,
                     format_timestamp, parse_timestamp, pretty_json)


class TaskState(str, enum.Enum):
    """The task's lifecycle.  Values are upstream's PascalCase spellings."""

    IDLE = "Idle"
    EXECUTING = "Executing"
    CONSULTATION = "Consultation"
    REVIEWING = "Reviewing"
    ADDRESSING = "Addressing"
    COMPLETE = "Complete"
    FAILED = "Failed"
    AWAITING_HUMAN = "AwaitingHuman"
    # With [hq] human_review on, the reviewer's approval leads here instead of to Complete,
    # and only a human moves the task on.  It is a state of its own, not a flag on
    # Reviewing: every tool and every HQ reaction keyed on Reviewing (the reviewer's
    # wait_for_review claim, HQ starting a reviewer, approve and reject) must then not
    # apply, and a state makes the transition table refuse them all in one place.  With
    # the feature off no STATE.json ever holds it, so upstream reads the files as before.
    AWAITING_CONFIRMATION = "AwaitingConfirmation"
    # A parallel task's approved work waits here for the merge queue: it is Complete only
    # once it is integrated into the target branch with the checks green on the result,
    # and a conflict or a red check sends it back to Addressing (ARCHITECTURE.md,
    # 'Parallel tasks').  Only parallel tasks, never the project's own STATE.json, hold it.
    INTEGRATING = "Integrating"

    def __str__(self):
        return self.value


S = TaskState
WORK_STATES = (S.EXECUTING, S.ADDRESSING)
LEASE_STATES = (S.EXECUTING, S.ADDRESSING, S.CONSULTATION, S.REVIEWING, S.AWAITING_HUMAN)
ACTIVE_STATES = (S.EXECUTING, S.ADDRESSING, S.CONSULTATION, S.REVIEWING, S.AWAITING_HUMAN,
                 S.AWAITING_CONFIRMATION, S.INTEGRATING)

# The one table the code and the docs follow: action, states it is allowed
# from, and where it leads.  "same" keeps the state; "paused" restores the
# state saved when the task was paused.
TRANSITIONS = (
    ("create_task", (S.IDLE,), "Executing"),
    ("claim", (S.EXECUTING, S.ADDRESSING, S.REVIEWING), "same (takes the lease)"),
    ("check_passed", WORK_STATES, "same"),
    ("check_failed", WORK_STATES, "same, or Failed at max_check_retries"),
    ("submit", WORK_STATES, "Reviewing"),
    ("consult", WORK_STATES, "Consultation"),
    ("respond_consult", (S.CONSULTATION,), "same"),
    ("finish_consult", (S.CONSULTATION,), "paused (Executing or Addressing)"),
    ("approve", (S.REVIEWING,), "Complete, or AwaitingConfirmation with [hq] human_review, "
     "or Integrating for a parallel task"),
    ("reject", (S.REVIEWING,), "Addressing, or Failed at max_review_cycles"),
    # The human's word on the reviewer's approval; no agent may take these.
    ("human_approve", (S.AWAITING_CONFIRMATION,), "Complete, or Integrating for a parallel task"),
    ("human_reject", (S.AWAITING_CONFIRMATION,), "Addressing, or Failed at max_review_cycles"),
    # The merge queue's verdict on a parallel task; only the orchestrator takes these.
    ("integrated", (S.INTEGRATING,), "Complete"),
    ("integration_failed", (S.INTEGRATING,), "Addressing, or Failed at max_review_cycles"),
    ("ask_human", (S.EXECUTING, S.ADDRESSING, S.CONSULTATION, S.REVIEWING), "AwaitingHuman"),
    ("answer", (S.AWAITING_HUMAN,), "paused"),
    ("heartbeat", LEASE_STATES, "same (renews the lease)"),
    ("reset", (S.FAILED,), "Idle"),
    ("force_reset", tuple(S), "Idle"),
)
ALLOWED_FROM = {action: frozenset(froms) for action, froms, _ in TRANSITIONS}

# STATE.json field order as upstream writes it; additive fields follow.
_UPSTREAM_FIELDS = (
    "schema_version", "state", "check_retries", "review_cycles", "failure_reason",
    "updated_at", "owner_pid", "paused_state", "claimed_by", "lease_until",
    "last_heartbeat", "selected_spec", "selected_milestone", "pending_task_spec",
    "pending_task_milestone", "task_spec", "task_milestone")
_ALWAYS_WRITTEN = ("schema_version", "state", "check_retries", "review_cycles",
                   "failure_reason", "updated_at", "owner_pid")


@deferred_dataclass
class StateData:
    """STATE.json.  Timestamps stay strings so untouched ones round-trip byte for byte."""

    state: TaskState = S.IDLE
    check_retries: int = 0
    review_cycles: int = 0
    failure_reason: "str | None" = None
    schema_version: int = 1
    updated_at: str = "1970-01-01T00:00:00Z"
    owner_pid: int = 0
    paused_state: "TaskState | None" = None
    claimed_by: "str | None" = None
    lease_until: "str | None" = None
    last_heartbeat: "str | None" = None
    selected_spec: "str | None" = None
    selected_milestone: "str | None" = None
    pending_task_spec: "str | None" = None
    pending_task_milestone: "str | None" = None
    task_spec: "str | None" = None
    task_milestone: "str | None" = None
    # Additive fields (upstream ignores unknown fields on read).
    rev: int = 0
    task_id: "str | None" = None
    state_entered_at: "str | None" = None
    task_started_at: "str | None" = None
    # The state a consultation paused, kept apart from paused_state so that
    # ask_human during Consultation cannot lose it (see
    # ARCHITECTURE.md, 'Differences from upstream ferrus', item 4).
    consult_paused_state: "TaskState | None" = None
    # Which agent asked the pending question, so HQ can tell who waits.
    question_from: "str | None" = None
    # Where the task started in git (see task_base): its diff is measured from there.
    task_base: "dict | None" = None
    # What [git] commit = "on_approve" did when the task was approved: the commit, or
    # why there is none (see commit_task_changes).
    task_commit: "dict | None" = None
    # A parallel task's last submission as ferrus recorded it (see snapshot_worktree):
    # {"commit", "base", "n"} — what its reviewer reads and the merge gate merges.
    task_submitted: "dict | None" = None
    extra: dict = dataclasses.field(default_factory=dict)

    def copy(self):
        return dataclasses.replace(self, extra=dict(self.extra))

    # -- serialisation -----------------------------------------------------

    def to_json(self):
        out = {}
        for name in _UPSTREAM_FIELDS:
            value = getattr(self, name)
            if value is None and name not in _ALWAYS_WRITTEN:
                continue
            out[name] = value.value if isinstance(value, TaskState) else value
        for name in ("rev", "task_id", "state_entered_at", "task_started_at",
                     "consult_paused_state", "question_from", "task_base", "task_commit",
                     "task_submitted"):
            value = getattr(self, name)
            # rev 0 means "never written by this ferrus": an upstream file stays as it was.
            if value is not None and not (name == "rev" and value == 0):
                out[name] = value.value if isinstance(value, TaskState) else value
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return pretty_json(out)

    @classmethod
    def from_json(cls, text, where="STATE.json"):
        try:
            raw = json.loads(text)
            json.dumps(raw, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise StateCorrupt("%s holds a \\u escape that is no character (a lone surrogate)"
                               % where) from None
        except (ValueError, RecursionError) as err:
            raise StateCorrupt("%s is not valid JSON (%s)" % (where, err)) from err
        if not isinstance(raw, dict):
            raise StateCorrupt("%s must hold a JSON object" % where)
        data = cls()
        known = {f.name for f in fields_of(cls)} - {"extra"}
        for key in ("state", "check_retries", "review_cycles"):
            if key not in raw:
                raise StateCorrupt("%s has no %r field" % (where, key))
        for key, value in raw.items():
            if key not in known:
                data.extra[key] = value
                continue
            try:
                setattr(data, key, _coerce_state_field(key, value))
            except (TypeError, ValueError) as err:
                raise StateCorrupt("%s field %r: %s" % (where, key, err)) from err
        return data


class StateCorrupt(FerrusError):
    def __init__(self, message):
        super().__init__(message, "run `ferrus doctor` to see what is wrong and "
                                  "`ferrus doctor --fix` to repair it")


_STATE_ENUM_FIELDS = ("state", "paused_state", "consult_paused_state")
_STATE_INT_FIELDS = ("check_retries", "review_cycles", "schema_version", "owner_pid", "rev")
_STATE_TIME_FIELDS = ("updated_at", "lease_until", "last_heartbeat", "state_entered_at",
                      "task_started_at")


def _coerce_state_field(key, value):
    if value is None:
        if key in ("state",) or key in _STATE_INT_FIELDS:
            raise ValueError("must not be null")
        return None
    if key in ("task_base", "task_commit", "task_submitted"):
        if not isinstance(value, dict):
            raise ValueError("must be an object, got %r" % (value,))
        return value
    if key in _STATE_ENUM_FIELDS:
        try:
            return TaskState(value)
        except ValueError:
            raise ValueError("unknown state %r (expected one of %s)"
                             % (value, ", ".join(s.value for s in TaskState))) from None
    if key in _STATE_INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError("must be a non-negative integer, got %r" % (value,))
        return value
    if not isinstance(value, str):
        raise ValueError("must be a string, got %r" % (value,))
    if key in _STATE_TIME_FIELDS:
        parse_timestamp(value)
    return value


# -- leases (see ARCHITECTURE.md, 'Leases') -----------------------------------

def lease_deadline(data):
    return parse_timestamp(data.lease_until) if data.lease_until else None


def claim(data, agent_id, now, ttl_secs):
    data = data.copy()
    data.claimed_by = agent_id
    data.lease_until = format_timestamp(now + _dt.timedelta(seconds=ttl_secs))
    data.last_heartbeat = format_timestamp(now)
    return data


class LeaseSightings:
    """How long this process honours a lease — never on a wall clock alone.

    Wall clocks jump, and another process's clock may run hours ahead or behind.  So a
    lease, known by (project, holder, lease_until), is honoured for at most its holder's
    own length (lease_until − last_heartbeat, capped at ttl_secs) from the moment this
    process first saw it, counted on this process's monotonic clock; and while our wall
    clock agreed at first sight that it was live, also no longer than our wall clock says.
    A lease our wall clock calls expired at first sight (abandoned long ago, or our clock
    runs ahead) is honoured for what is left of its length since STATE.json was last
    written, as the file system's clock saw it: a dead holder's lease frees at once, a
    live holder's lease is not taken from it by a process whose clock is ahead."""

    KEEP = 256

    def __init__(self):
        self._seen = collections.OrderedDict()
        self._lock = threading.Lock()

    def seconds_left(self, where, data, now, monotonic, ttl, written_age):
        deadline = lease_deadline(data)
        if deadline is None:
            return 0.0
        length = float(ttl)
        if data.last_heartbeat:
            with contextlib.suppress(ValueError):
                length = min(length, (deadline - parse_timestamp(data.last_heartbeat))
                             .total_seconds())
        wall_left = (deadline - now).total_seconds()
        key = (where, data.claimed_by, data.lease_until)
        mono = monotonic()
        with self._lock:
            seen = self._seen.get(key)
            if seen is None:
                looked_live = wall_left > 0
                budget = min(length, wall_left) if looked_live else length - written_age()
                seen = self._seen[key] = (mono, looked_live, max(0.0, budget))
                while len(self._seen) > self.KEEP:
                    self._seen.popitem(last=False)
        first_seen, looked_live, budget = seen
        left = budget - (mono - first_seen)
        if looked_live:
            left = min(left, wall_left)
        return max(0.0, left)


# One table per process: every Store of a project shares what this process has seen.
LEASE_SIGHTINGS = LeaseSightings()


def clear_lease(data):
    data = data.copy()
    data.claimed_by = data.lease_until = data.last_heartbeat = None
    return data


# -- pure transitions ---------------------------------------------------------

def _require(action, data):
    if data.state not in ALLOWED_FROM[action]:
        raise TransitionError(action, data.state)


def _enter(data, state, now):
    """Move to ``state``, stamping when it was entered if it changed."""
    if data.state != state:
        data.state_entered_at = format_timestamp(now)
    data.state = state
    return data


def t_create_task(data, now, task_id, base=None):
    _require("create_task", data)
    data = clear_lease(data)
    data.task_spec, data.pending_task_spec = data.pending_task_spec, None
    data.task_milestone, data.pending_task_milestone = data.pending_task_milestone, None
    data.check_retries = data.review_cycles = 0
    data.failure_reason = None
    data.paused_state = data.consult_paused_state = data.question_from = None
    data.task_id = task_id
    data.task_base = base
    data.task_commit = data.task_submitted = None
    data.task_started_at = format_timestamp(now)
    return _enter(data, S.EXECUTING, now)


def t_check_passed(data, now):
    _require("check_passed", data)
    data = data.copy()
    data.check_retries = 0
    data.failure_reason = None
    return data


def t_check_failed(data, now, reason, max_retries):
    _require("check_failed", data)
    data = data.copy()
    data.check_retries += 1
    if data.check_retries >= max_retries:
        data.failure_reason = "Check failed %d consecutive times. Last failure:\n%s" % (
            max_retries, reason)
        data = clear_lease(data)
        return _enter(data, S.FAILED, now)
    data.failure_reason = reason
    return data


def failure_summary(reason):
    """One line saying why a task failed.  The recorded reason may span lines, and its
    first can end in a colon that introduces the next ("… Last failure:" then the
    commands): those are joined, so a one-line view never ends on a bare colon."""
    lines = [line.strip() for line in (reason or "").splitlines() if line.strip()]
    if not lines:
        return "no reason recorded"
    summary = lines[0]
    if summary.endswith(":") and len(lines) > 1:
        summary += " " + lines[1]
    return summary


def t_submit(data, now, submitted=None):
    """``submitted``: the submission ferrus recorded as a commit (parallel tasks)."""
    _require("submit", data)
    data = clear_lease(data)
    if submitted is not None:
        data.task_submitted = submitted
    return _enter(data, S.REVIEWING, now)


def t_consult(data, now):
    _require("consult", data)
    data = data.copy()
    data.paused_state = data.consult_paused_state = data.state
    return _enter(data, S.CONSULTATION, now)


def t_finish_consult(data, now):
    _require("finish_consult", data)
    data = data.copy()
    # Consult is only reachable from Executing/Addressing, so when an older file
    # lost the paused state, Executing is the truthful fallback, not Idle.
    resume = data.consult_paused_state or data.paused_state
    if resume not in WORK_STATES:
        resume = S.EXECUTING
    data.paused_state = data.consult_paused_state = None
    return _enter(data, resume, now)


def t_approve(data, now, human_review=False, integrate=False):
    _require("approve", data)
    data = clear_lease(data)
    return _enter(data, S.AWAITING_CONFIRMATION if human_review
                  else S.INTEGRATING if integrate else S.COMPLETE, now)


def t_human_approve(data, now, integrate=False):
    _require("human_approve", data)
    data = clear_lease(data)
    return _enter(data, S.INTEGRATING if integrate else S.COMPLETE, now)


def t_integrated(data, now):
    _require("integrated", data)
    return _enter(data.copy(), S.COMPLETE, now)


def t_integration_failed(data, now, max_cycles, onto=None):
    """A conflict or a red check on the merged result is a review cycle: the executor
    gets the cause as review notes.  ``onto`` is the target's head the merge queue left
    the task's branch on (rebased onto it, or merged with it for the executor to resolve
    a conflict): the task's diff is measured from there on, so its reviewer sees the
    task's own work, not what other tasks brought to the target meanwhile."""
    _require("integration_failed", data)
    data = _send_back(data, now, max_cycles)
    if onto and data.task_base and data.task_base.get("git"):
        data.task_base = dict(data.task_base, commit=onto, dirty=[], dirty_count=0,
                              onto_target=True)
    return data


def t_reject(data, now, max_cycles):
    _require("reject", data)
    return _send_back(data, now, max_cycles)


def t_human_reject(data, now, max_cycles):
    """The human's rejection counts as a review cycle, exactly like the reviewer's."""
    _require("human_reject", data)
    return _send_back(data, now, max_cycles)


def _send_back(data, now, max_cycles):
    data = clear_lease(data)
    data.review_cycles += 1
    if data.review_cycles >= max_cycles:
        data.failure_reason = "Task rejected %d times without resolution." % max_cycles
        return _enter(data, S.FAILED, now)
    data.check_retries = 0
    return _enter(data, S.ADDRESSING, now)


def t_ask_human(data, now, asked_by=None):
    _require("ask_human", data)
    data = data.copy()
    data.paused_state = data.state
    data.question_from = asked_by
    return _enter(data, S.AWAITING_HUMAN, now)


def t_answer(data, now):
    _require("answer", data)
    data = data.copy()
    resume = data.paused_state or S.IDLE
    # Returning to a consultation puts the consultation's own paused state back
    # where upstream expects it.
    data.paused_state = data.consult_paused_state if resume == S.CONSULTATION else None
    data.question_from = None
    return _enter(data, resume, now)


def t_force_reset(data, now):
    """Back to a fresh Idle state that keeps only the spec selection and the rev."""
    fresh = StateData(selected_spec=data.selected_spec,
                      selected_milestone=data.selected_milestone,
                      rev=data.rev, extra={})
    fresh.state_entered_at = format_timestamp(now) if data.state != S.IDLE else data.state_entered_at
    return fresh


def t_reset(data, now):
    _require("reset", data)
    return t_force_reset(data, now)
