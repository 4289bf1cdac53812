"""Session state machine: supervising one agent slot (pure).

Every headless agent slot (executor, reviewer, consultant, pipeline worker) is
supervised by this machine (see ARCHITECTURE.md, 'Session state machine'):
step(session, event) returns the next session and one side effect for the
supervisor to carry out — start, back off, stop, report."""

import dataclasses
import enum

from .basics import deferred_dataclass


class SessionState(str, enum.Enum):
    INITIALIZING = "Initializing"
    BUILDING_PROMPT = "BuildingPrompt"
    SPAWNING = "Spawning"
    RUNNING = "Running"
    SESSION_COMPLETE = "SessionComplete"
    COOLING_DOWN = "CoolingDown"
    INTERRUPTING = "Interrupting"
    STOPPED = "Stopped"

    def __str__(self):
        return self.value


SS = SessionState

# Effects the supervisor performs after a step.
STORE_PROMPT, CANCEL_SESSION, FORCE_STOP_SESSION, INCREMENT_SESSION, LOG_FATAL = (
    "StorePrompt", "CancelSession", "ForceStopSession", "IncrementSession", "LogFatal")


@deferred_dataclass(frozen=True)
class SessionEvent:
    """WorktreeReady, PromptReady(prompt), SessionStarted(seq), SessionExited(outcome),
    UrgentMessage(text), GraceExceeded, BackoffElapsed, OperatorStop, FatalError(text)."""

    kind: str
    value: object = None      # the prompt, seq, message text or fatal message
    outcome: str = ""         # SessionExited: success | error | timeout


@deferred_dataclass(frozen=True)
class Session:
    """One agent slot's session state (see ARCHITECTURE.md, 'Session state machine')."""

    state: SessionState = SS.INITIALIZING
    session_seq: int = 0
    consecutive_errors: int = 0
    total_errors: int = 0
    max_consecutive_errors: int = 5
    max_total_errors: int = 20
    prompt: "str | None" = None
    urgent: "str | None" = None     # the operator message the next prompt must carry
    backoff_ms: int = 0


def backoff_ms(consecutive_errors):
    """min(2000 * 2^(n-1), 60000) ms for the n-th consecutive error."""
    n = max(1, consecutive_errors)
    return min(2000 * 2 ** (n - 1), 60000)


def session_step(session, event):
    """One transition of the session table (ARCHITECTURE.md, 'Session state machine'):
    (new session, effect or None).

    An event the current state does not accept leaves the session unchanged
    (effect None); OperatorStop and FatalError are accepted from every state."""
    replace = dataclasses.replace
    state, kind = session.state, event.kind
    if kind == "OperatorStop":
        effect = CANCEL_SESSION if state in (SS.RUNNING, SS.INTERRUPTING) else None
        return replace(session, state=SS.STOPPED), effect
    if kind == "FatalError":
        return replace(session, state=SS.STOPPED), (LOG_FATAL, event.value)
    if state == SS.INITIALIZING and kind == "WorktreeReady":
        return replace(session, state=SS.BUILDING_PROMPT), None
    if state == SS.BUILDING_PROMPT and kind == "PromptReady":
        return replace(session, state=SS.SPAWNING, prompt=event.value, urgent=None), \
            (STORE_PROMPT, event.value)
    if state == SS.SPAWNING and kind == "SessionStarted":
        # The original design also reset consecutive_errors here.  We reset it only on a
        # successful exit: an agent that starts and then crashes every time would
        # otherwise never back off beyond 2 s nor reach max_consecutive_errors.
        return replace(session, state=SS.RUNNING, session_seq=event.value), None
    if state in (SS.SPAWNING, SS.RUNNING) and kind == "SessionExited":
        if event.outcome == "success" and state == SS.RUNNING:
            return replace(session, state=SS.SESSION_COMPLETE, consecutive_errors=0), None
        consecutive = session.consecutive_errors + 1
        total = session.total_errors + 1
        counted = replace(session, consecutive_errors=consecutive, total_errors=total)
        if consecutive >= session.max_consecutive_errors or total >= session.max_total_errors:
            reason = ("%d consecutive errors" % consecutive
                      if consecutive >= session.max_consecutive_errors else
                      "%d errors in total" % total)
            return replace(counted, state=SS.STOPPED), (LOG_FATAL, "stopped after " + reason)
        return replace(counted, state=SS.COOLING_DOWN, backoff_ms=backoff_ms(consecutive)), None
    if state == SS.RUNNING and kind == "UrgentMessage":
        return replace(session, state=SS.INTERRUPTING, urgent=event.value), CANCEL_SESSION
    if state == SS.INTERRUPTING and kind == "SessionExited":
        # An interrupt is intentional: no error is counted.
        return replace(session, state=SS.BUILDING_PROMPT), None
    if state == SS.INTERRUPTING and kind == "GraceExceeded":
        return replace(session, state=SS.BUILDING_PROMPT), FORCE_STOP_SESSION
    if state == SS.SESSION_COMPLETE and kind == "WorktreeReady":
        return replace(session, state=SS.BUILDING_PROMPT,
                       session_seq=session.session_seq + 1), INCREMENT_SESSION
    if state == SS.COOLING_DOWN and kind == "BackoffElapsed":
        return replace(session, state=SS.BUILDING_PROMPT), None
    return session, None



GREEN, ORANGE, RED = "Green", "Orange", "Red"
CONTINUE, THROTTLE, CHECKPOINT, EMERGENCY_STOP = "Continue", "Throttle", "Checkpoint", "EmergencyStop"
