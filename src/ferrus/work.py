"""Operations on the work: waits, check and submit, questions, status, reset.

The blocking waits (wait_for_task, wait_for_review, ...) claim work as soon as it is
there; check and submit run the gate unlocked and apply its result in a transaction
only if the task did not move meanwhile; a parallel task's submit records its
worktree as a commit first."""

import contextlib
import itertools
import json
import os
import time

from .basics import FerrusError, TransitionError, parse_timestamp, pretty_json
from .system import read_text
from .task_machine import (ALLOWED_FROM, S, WORK_STATES, claim, clear_lease, t_answer,
                           t_ask_human, t_check_failed, t_check_passed, t_consult,
                           t_finish_consult, t_force_reset, t_integrated,
                           t_integration_failed, t_reset, t_submit)
from .session_machine import CONTINUE, GREEN
from .store import (FERRUS_DIR, JOURNAL_ARCHIVE_FILE, JOURNAL_FILE, TASK_SCRATCH_FILES,
                    read_task_record)
from .checks import run_checks
from .git import TaskCheckout, set_task_ref, snapshot_worktree, task_diff, task_ref
from .worktrees import changed_paths
from .sandbox import check_wrapper
from .bootstrap import store_environment
from .operations import (GUARDED_SHOWN, Outcome, _approval_file_if_any, _guard_lease,
                         _json_outcome, _nonblank, _outcome, guarded_paths, journal_text,
                         review_diff, task_diff_exclusions, task_git_site)


# -- waiting ------------------------------------------------------------------

class _Waiter:
    """The budget and the progress cadence shared by every wait_* operation."""

    PROGRESS_EVERY = 5.0

    def __init__(self, store, caller, timeout=None):
        self.store = store
        self.caller = caller
        budget = store.config().limits.wait_timeout_secs if timeout is None else timeout
        self.started = time.monotonic()
        self.deadline = self.started + budget
        self.next_progress = self.started + self.PROGRESS_EVERY

    def cancelled(self):
        return self.caller.cancel is not None and self.caller.cancel.is_set()

    def pause(self, stamp, what, wake_after=None):
        """Wait for the next commit (or ``wake_after`` seconds, e.g. until a foreign
        lease expires, which commits nothing); False once the budget is spent or the
        call is cancelled."""
        wake_at = None if wake_after is None else time.monotonic() + max(0.0, wake_after)
        while True:
            now = time.monotonic()
            if self.cancelled() or now >= self.deadline:
                return False
            if wake_at is not None and now >= wake_at:
                return True
            slice_end = min(self.deadline, self.next_progress, wake_at or self.deadline)
            if self.store.wait_for_change(stamp, slice_end, self.caller.cancel):
                return True
            if time.monotonic() >= self.next_progress:
                self.next_progress += self.PROGRESS_EVERY
                if self.caller.progress:
                    self.caller.progress("waiting for %s (%.0f s)" % (
                        what, time.monotonic() - self.started))

    def timeout(self, state):
        return _json_outcome({"status": "timeout", "state": state.value})


def _wait_and_claim(store, caller, claimable, build, what):
    waiter = _Waiter(store, caller)
    ttl = store.config().lease.ttl_secs
    while True:
        stamp = store.state_stamp()
        with store.transaction(caller.agent_id) as tx:
            data = tx.state
            now = store.clock()
            live = store.lease_seconds_left(data) > 0
            # A cancelled call never claims: its caller will never hear that it holds
            # the task (checked under the lock, as the cancel may land mid-pause).
            if waiter.cancelled():
                return waiter.timeout(data.state)
            if data.state in claimable and (not live or data.claimed_by == caller.agent_id):
                renewing = data.claimed_by == caller.agent_id and live
                # Re-entry renews the lease too (upstream did not: see
                # ARCHITECTURE.md, 'Differences from upstream ferrus', item 7).
                tx.set(claim(data, caller.agent_id, now, ttl), "claim",
                       agent=caller.agent_id, renewed=renewing)
        if tx.committed:
            store.lease_seconds_left(tx.state)      # the new lease is seen from now on
            return _json_outcome(build(tx.state))
        lease_left = None
        if data.state in claimable and live:
            # Wake when the foreign lease runs out by our monotonic count.
            lease_left = store.lease_seconds_left(data) + 0.001
        if not waiter.pause(stamp, what, lease_left):
            return waiter.timeout(data.state)


def op_wait_for_task(store, caller):
    def build(data):
        return {"status": "claimed", "claimed_by": data.claimed_by, "lease_until": data.lease_until,
                "state": data.state.value, "task": store.read_file("TASK.md"),
                "review": store.read_file("REVIEW.md"), "task_id": data.task_id,
                "heartbeat_interval_secs": store.config().lease.heartbeat_interval_secs}
    return _wait_and_claim(store, caller, WORK_STATES, build, "a task")


# The changed files wait_for_review lists, bounded as its diff is: the stat shows as many
# (TaskDiff.stat_text), ferrus://diff has them all.
REVIEW_FILES_MAX = 500
REVIEW_FILES_BYTES = 64 * 1024


def review_file_list(files, max_files=REVIEW_FILES_MAX, max_bytes=REVIEW_FILES_BYTES):
    """The first of ``files`` (ChangedFile.to_json dicts) that fit ``max_files`` entries
    and ``max_bytes`` of JSON: 30,000 changed files made a 5.7 MB answer."""
    listed, size = [], 2
    for entry in files[:max_files]:
        size += len(json.dumps(entry, ensure_ascii=False)) + 2
        if size > max_bytes:
            break
        listed.append(entry)
    return listed


def op_wait_for_review(store, caller):
    def build(data):
        # After the claim, outside the lock: git may take a moment.
        diff_text, changed_files = review_diff(store, store.read_file("SUBMISSION.md"))
        listed = review_file_list(changed_files)
        return {"status": "claimed", "claimed_by": data.claimed_by, "lease_until": data.lease_until,
                "state": data.state.value, "task": store.read_file("TASK.md"),
                "submission": store.read_file("SUBMISSION.md"),
                "review": store.read_file("REVIEW.md"),
                "diff": diff_text, "changed_files": listed,
                "changed_files_total": len(changed_files),
                "review_cycles_used": data.review_cycles,
                "check_retries_used": data.check_retries, "task_id": data.task_id,
                "heartbeat_interval_secs": store.config().lease.heartbeat_interval_secs}
    return _wait_and_claim(store, caller, (S.REVIEWING,), build, "a submission")


def op_wait_for_consult(store, caller):
    data = store.read_state()
    if data.state != S.CONSULTATION and not (
            data.state == S.AWAITING_HUMAN and data.paused_state == S.CONSULTATION):
        raise FerrusError("Cannot wait for consultation from state %s. Call /consult first."
                          % data.state)
    waiter = _Waiter(store, caller)
    ttl = store.config().lease.ttl_secs
    while True:
        stamp = store.state_stamp()
        response = None
        with store.transaction(caller.agent_id) as tx:
            data = tx.state
            if data.state == S.CONSULTATION:
                response = tx.read("CONSULT_RESPONSE.md")
                if response.strip():
                    now = store.clock()
                    new = t_finish_consult(data, now)
                    if new.claimed_by:
                        new = claim(new, new.claimed_by, now, ttl)
                    tx.write("CONSULT_RESPONSE.md", "")
                    tx.write("CONSULT_REQUEST.md", "")
                    tx.set(new, "finish_consult")
            elif not (data.state == S.AWAITING_HUMAN and data.paused_state == S.CONSULTATION):
                raise FerrusError("The consultation ended without a response: the state is now %s."
                                  % data.state, "call /status to see where the task stands")
        if tx.committed:
            text = response.strip()
            return Outcome(text, {"status": "responded", "response": text,
                                  "state": tx.state.state.value, "message": text})
        if not waiter.pause(stamp, "the consultation response"):
            return waiter.timeout(data.state)


def op_wait_for_answer(store, caller):
    waiter = _Waiter(store, caller)
    ttl = store.config().lease.ttl_secs
    first = True
    while True:
        stamp = store.state_stamp()
        answer = None
        with store.transaction(caller.agent_id) as tx:
            data = tx.state
            now = store.clock()
            pending = tx.read("ANSWER.md")
            if data.state == S.AWAITING_HUMAN and pending.strip():
                # Someone wrote ANSWER.md by hand (or upstream HQ did): apply it here.
                data = t_answer(data, now)
            if data.state != S.AWAITING_HUMAN and pending.strip():
                # The single consumer of an answer: it is cleared in this transaction,
                # so no second caller can read it (see
                # ARCHITECTURE.md, 'Differences from upstream ferrus', item 5).
                answer = pending.strip()
                if data.claimed_by == caller.agent_id:
                    data = claim(data, caller.agent_id, now, ttl)
                tx.write("ANSWER.md", "")
                tx.write("QUESTION.md", "")
                tx.set(data, "consume_answer")
            elif data.state != S.AWAITING_HUMAN and first:
                raise FerrusError("No question is pending (state %s), so there is no answer to "
                                  "wait for." % data.state, "call /ask_human first")
        first = False
        if answer is not None:
            return _json_outcome({"status": "answered", "answer": answer,
                                  "resumed_state": tx.state.state.value})
        if not waiter.pause(stamp, "the human's answer"):
            return waiter.timeout(data.state)


# -- executor -------------------------------------------------------------------

def _run_gate(store, caller, action):
    """Run the check gate for ``action`` (check or submit) without holding the lock.

    Returns (snapshot, run, config); run is None when no commands are configured."""
    data = store.read_state()
    if data.state not in WORK_STATES:
        if action == "check":
            raise FerrusError("Cannot run checks from state %s. Checks are only valid in Executing "
                              "or Addressing state." % data.state)
        raise FerrusError("Cannot submit from state %s. Submit is only valid from Executing or "
                          "Addressing after the implementation is ready." % data.state)
    _guard_lease(store, data, caller, action)
    config = store.config()
    if not config.checks.commands:
        return data, None, config
    # A sandboxed task's checks run confined as its agents do (they run its code).
    run = run_checks(store.workdir, config.checks, store.path("logs"), data.check_retries + 1,
                     config.limits.max_feedback_lines, caller.cancel, store.root,
                     wrap=check_wrapper(store), env=store_environment(store))
    if run.cancelled:
        raise FerrusError("The check run was cancelled; the state is unchanged.")
    return data, run, config


def _same_task(store, tx, snapshot, caller, action):
    """Apply a gate result only to the task, state and lease it was run for (see
    ARCHITECTURE.md, 'Differences from upstream ferrus', item 2)."""
    current = tx.state
    if current.task_id != snapshot.task_id or current.state != snapshot.state:
        raise FerrusError(
            "The state moved from %s to %s while the checks ran, so their result was discarded "
            "and nothing was written." % (snapshot.state, current.state),
            "call /status, then /wait_for_task if there is still work to do")
    _guard_lease(store, current, caller, action)


# The agents' messages for the check gate (upstream's wording), by action and result.
GATE_TEXTS = {
    "check": {
        "none": "All checks passed. Warning: no check commands are configured in ferrus.toml. "
                "State remains unchanged.",
        "pass": "All checks passed. State remains %(state)s. Continue working or call /submit "
                "when the task is ready for review.",
        "fail": "Checks failed (retry %(retries)d/%(max)d).\n\n%(report)s\n\nState remains "
                "%(state)s. Fix the issues and call /check again.",
        "limit": "Check retry limit reached (%(retries)d/%(max)d).\n\n%(report)s\n\nState is "
                 "now Failed. A human must call /reset to recover.",
    },
    "submit": {
        "none": "Submitted for review. Warning: no check commands are configured in ferrus.toml, "
                "so the final check gate was treated as a pass. State: Reviewing.",
        "pass": "Submitted for review. State: Reviewing. The Supervisor can now call "
                "/review_pending.",
        "fail": "Final review gate failed during /submit (retry %(retries)d/%(max)d).\n\n"
                "%(report)s\n\nState remains %(state)s. Fix the issues and run /check or /submit "
                "again.",
        "limit": "Final review gate failed during /submit and hit the retry limit "
                 "(%(retries)d/%(max)d).\n\n%(report)s\n\nState is now Failed. A human must "
                 "call /reset to recover.",
    },
}


def _gate_operation(store, caller, action, content=None):
    """check and submit: run the gate unlocked, then apply its result in a transaction."""
    submitted = _record_submission(store, caller, content) if action == "submit" else None
    changed = _checkout_submitted_files(store) if action == "submit" else {}
    snapshot, run, config = _run_gate(store, caller, action)
    limits = config.limits
    passed = run is None or run.passed
    with store.transaction(caller.agent_id) as tx:
        now = store.clock()
        _same_task(store, tx, snapshot, caller, action)
        log_path = run.log_path if run else None
        if passed and action == "submit":
            tx.write("SUBMISSION.md", content)
            detail = {"log": log_path, "text": journal_text(content), **changed}
            if submitted is not None:
                left_out = submitted.pop("left_out", [])
                if left_out:
                    detail["left_out"] = left_out[:GUARDED_SHOWN]
                submitted["n"] = ((tx.state.task_submitted or {}).get("n") or 0) + 1
                set_task_ref(store.root, task_ref(store.task, "submit-%d" % submitted["n"]),
                             submitted["commit"])
                detail.update(submission=submitted["commit"][:12], n=submitted["n"])
                if submitted.get("guarded"):
                    detail["guarded"] = submitted["guarded"][:GUARDED_SHOWN]
            tx.set(t_submit(t_check_passed(tx.state, now), now, submitted), "submit", **detail)
        elif passed:
            tx.set(t_check_passed(tx.state, now), "check_passed", log=log_path)
        else:
            tx.set(t_check_failed(tx.state, now, run.failure_reason(), limits.max_check_retries),
                   "check_failed", log=log_path, failed=[r.command for r in run.failed])
            tx.detail["retries"] = tx.state.check_retries
            if action == "submit":
                tx.detail["during"] = "submit"
        if run is not None:
            # Each command's result, so whoever reads the journal can show the run.
            tx.detail["checks"] = [check_summary(result) for result in run.results]
    new = tx.state
    kind = ("none" if run is None else "pass" if passed else
            "limit" if new.state == S.FAILED else "fail")
    text = GATE_TEXTS[action][kind] % {
        "state": new.state, "retries": new.check_retries, "max": limits.max_check_retries,
        "report": "" if passed else run.report(limits.max_feedback_lines)}
    if passed:
        if submitted is not None:
            text += left_out_note(tx.detail.get("left_out"))
        return _outcome(text, new.state, passed=True, log=run.log_path if run else None)
    return _outcome(text, new.state, passed=False, log=run.log_path,
                    check_retries=new.check_retries)


def _record_submission(store, caller, summary):
    """A parallel task's worktree recorded as a commit on its base before the submit's
    checks run (see snapshot_worktree): {"commit", "base", "guarded"}.  None for the
    project's own task, or when the state or lease refuses the submit anyway (the gate
    then says why).  Raises TamperedWorktree: nothing is recorded from a worktree whose
    .git was rewritten."""
    if store.task is None:
        return None
    data = store.read_state()
    base = (data.task_base or {}).get("commit")
    if data.state not in WORK_STATES or not base:
        return None
    _guard_lease(store, data, caller, "submit")
    checkout = task_git_site(store)
    if not isinstance(checkout, TaskCheckout):
        return None
    left_out = []
    commit = snapshot_worktree(checkout, base, task_diff_exclusions(store),
                               (summary or "").strip() or "(no summary)", left_out)
    changed = changed_paths(store.root, base, commit)
    try:
        extra = store.config().parallel.guarded
    except FerrusError:
        extra = []
    return {"commit": commit, "base": base, "left_out": left_out, "guarded": guarded_paths(
        [_project_relative(store, path) for path in changed], extra)}


# The submit entry of the project's own task names at most this many changed paths, in
# at most this many characters (a journal entry stays small whatever the tree holds).
SUBMIT_FILES_JOURNALED = 500
SUBMIT_FILES_CHARS = 16 * 1024


def _checkout_submitted_files(store):
    """What the project's own task had changed when it submitted — the paths of the diff
    its reviewer is shown (the working tree against the task's base), less those already
    changed before the task began — as the submit entry's ``files`` (project memory
    records them); {} for a parallel task (its commit says) or without git."""
    if store.task is not None:
        return {}
    data = store.read_state()
    base = data.task_base or {}
    if not data.task_id or not base.get("git"):
        return {}
    try:
        paths = [changed.path for changed in task_diff(
            task_git_site(store), base, task_diff_exclusions(store), patch=False).files]
    except FerrusError:
        return {}
    before = set(base.get("dirty") or [])
    folders = tuple(path for path in before if path.endswith("/"))   # an untracked folder
    files = [path for path in paths if path not in before and not path.startswith(folders)]
    kept, size = [], 0
    for path in files[:SUBMIT_FILES_JOURNALED]:
        size += len(path) + 4
        if size > SUBMIT_FILES_CHARS:
            break
        kept.append(path)
    return {"files": kept, "files_count": len(files),
            "files_before_task": len(paths) - len(files)}


def left_out_note(paths):
    """What the submit says about folders its commit could not hold ("" for none)."""
    if not paths:
        return ""
    shown = ", ".join(paths[:GUARDED_SHOWN]) + (
        " and %d more" % (len(paths) - GUARDED_SHOWN) if len(paths) > GUARDED_SHOWN else "")
    return ("\n\nLeft out of the submission: %s — a folder with a git repository of its "
            "own, which a task's commit cannot hold. To include its files, remove its .git "
            "folder and submit again." % shown)


def _project_relative(store, path):
    """A path relative to the repository's top, made relative to the project folder."""
    top = read_task_record(store.dir, store.task).get("worktree") if store.task else None
    if top and store.workdir != top:
        inside = os.path.relpath(store.workdir, top).replace(os.sep, "/")
        if path.startswith(inside + "/"):
            return path[len(inside) + 1:]
    return path


def check_summary(result):
    """One command's result as the journal keeps it (its output is in its log)."""
    return {"command": result.command, "status": result.status, "exit": result.exit_code,
            "secs": round(result.duration, 2), "log": result.log_path}


def op_check(store, caller):
    return _gate_operation(store, caller, "check")


def op_submit(store, caller, content):
    return _gate_operation(store, caller, "submit", content)


CONSULT_HEADINGS = ("## Problem", "## What I tried", "## Options (if any)", "## Question")


def op_consult(store, caller, question):
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state not in WORK_STATES:
            raise FerrusError("Cannot consult from state %s. Consultation is only available while "
                              "executing work." % data.state)
        _guard_lease(store, data, caller, "consult")
        missing = [h for h in CONSULT_HEADINGS if h not in (question or "")]
        if missing:
            raise FerrusError("The consultation request must follow the template; it lacks %s."
                              % ", ".join(missing),
                              "read ferrus://consult_template and fill in every heading")
        tx.write("CONSULT_REQUEST.md", question)
        tx.write("CONSULT_RESPONSE.md", "")
        paused = data.state
        tx.set(t_consult(data, store.clock()), "consult")
    text = ("Consultation request written to `.ferrus/CONSULT_REQUEST.md`.\n"
            "State is now Consultation (paused from %s).\n"
            "HQ will start the Supervisor in consultation mode to answer it.\n"
            "Call /wait_for_consult now to receive the response." % paused)
    return _outcome(text, S.CONSULTATION, paused_state=paused.value)


# -- shared -----------------------------------------------------------------------

def op_ask_human(store, caller, question):
    _nonblank(question, "Cannot ask a human: the question is empty.")
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state not in ALLOWED_FROM["ask_human"]:
            raise TransitionError("ask_human", data.state)
        tx.write("QUESTION.md", question)
        tx.write("ANSWER.md", "")
        paused = data.state
        tx.set(t_ask_human(data, store.clock(), caller.agent_id), "ask_human",
               asked_by=caller.agent_id)
    text = ("Question written to `.ferrus/QUESTION.md`.\n"
            "State is now AwaitingHuman (paused from %s).\n"
            "Call /wait_for_answer immediately and keep calling it until it returns the answer.\n"
            "Do NOT call other tools while the question is open." % paused)
    return _outcome(text, S.AWAITING_HUMAN, paused_state=paused.value)


def op_answer(store, caller, response):
    _nonblank(response, "Cannot answer: the response is empty.")
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state != S.AWAITING_HUMAN:
            raise FerrusError("Cannot answer from state %s. /answer is only valid in AwaitingHuman "
                              "state." % data.state)
        new = t_answer(data, store.clock())
        tx.write("ANSWER.md", response)
        tx.set(new, "answer", asked_by=data.question_from)
    return _outcome("Response recorded in `%s`. State restored to %s. The agent can read the "
                    "answer and continue." % (store.relpath(store.task_path("ANSWER.md")),
                                              new.state), new.state)


def op_status(store, caller=None):
    data = store.read_state()
    now = store.clock()
    lines = ["**State:** %s" % data.state, "**Check retries:** %d" % data.check_retries,
             "**Review cycles:** %d" % data.review_cycles]
    if data.failure_reason:
        lines.append("**Failure reason:** %s" % data.failure_reason)
    if data.task_id:
        lines.append("**Task:** %s" % data.task_id)
    if store.lease_live(data):
        lines.append("**Lease:** %s until %s" % (data.claimed_by, data.lease_until))
    if data.state == S.AWAITING_CONFIRMATION:
        lines.append("**Waiting for:** a human to confirm or reject the reviewer's approval "
                     "(no agent can); nothing for agents to do until then.")
    return Outcome("\n".join(lines), status_data(store, data, now))


def status_data(store, data, now):
    """Everything `ferrus status --json` and the status tool report."""
    entered = data.state_entered_at
    seconds_in_state = None
    if entered:
        with contextlib.suppress(ValueError):
            seconds_in_state = max(0.0, (now - parse_timestamp(entered)).total_seconds())
    return {"state": data.state.value, "task_id": data.task_id,
            "check_retries": data.check_retries, "review_cycles": data.review_cycles,
            "failure_reason": data.failure_reason, "paused_state":
                data.paused_state.value if data.paused_state else None,
            "claimed_by": data.claimed_by if store.lease_live(data) else None,
            "lease_until": data.lease_until if store.lease_live(data) else None,
            "state_entered_at": entered, "seconds_in_state": seconds_in_state,
            "task_started_at": data.task_started_at,
            "selected_spec": data.selected_spec, "selected_milestone": data.selected_milestone,
            "rev": data.rev, "capacity": capacity_status(store, data),
            "git_commit": data.task_commit, "message": None}


def capacity_status(store, data):
    """The capacity tier as the last gate decision left it (None when no limit is set)."""
    with contextlib.suppress(FerrusError):
        if not store.config().capacity.enabled():
            return None
    checkpoint = data.extra.get("capacity_checkpoint")
    if checkpoint:
        return {"tier": checkpoint.get("tier"), "action": checkpoint.get("action"),
                "signal": checkpoint.get("signal"), "checkpoint": True}
    # The newest gate decision among the last 500 entries, read from the journal's end.
    for entry in itertools.islice(store.journal_entries_backwards(), 500):
        if entry.get("event") == "gate":
            detail = entry.get("detail") or {}
            return {"tier": detail.get("tier"), "action": detail.get("action"),
                    "signal": detail.get("signal"), "checkpoint": False}
    return {"tier": GREEN, "action": CONTINUE, "signal": None, "checkpoint": False}


def op_reset(store, caller):
    """The agents' escape hatch: Failed → Idle (supervisor only)."""
    with store.transaction(caller.agent_id) as tx:
        if tx.state.state != S.FAILED:
            raise FerrusError("Cannot reset from state %s. Reset is only available in the Failed "
                              "state." % tx.state.state)
        tx.set(t_reset(tx.state, store.clock()), "reset")
        for name in ("REVIEW.md", "SUBMISSION.md", "CONSULT_REQUEST.md",
                     "CONSULT_RESPONSE.md") + _approval_file_if_any(store):
            tx.write(name, "")
    return _outcome("State reset to Idle. REVIEW.md, SUBMISSION.md, and consultation files "
                    "cleared. Ready for a new task.", S.IDLE)


def kept_changes_note(store, data):
    """What a reset leaves in git — it never discards work: the task's uncommitted
    changes (they stay in the work tree) and the task's branch (HEAD stays on it).
    "" when there is nothing to say (no task, no git, no changes)."""
    base = data.task_base or {}
    if not data.task_id or not base.get("git"):
        return ""
    notes = []
    with contextlib.suppress(FerrusError):
        files = task_diff(task_git_site(store), None, task_diff_exclusions(store),
                          patch=False).files
        if files:
            notes.append("Uncommitted changes are kept: %d file%s in the work tree %s "
                         "from HEAD (`git status` shows them). To drop them, see \"Dropping "
                         "a task's changes\" in docs/REFERENCE.md."
                         % (len(files), "" if len(files) == 1 else "s",
                            "differs" if len(files) == 1 else "differ"))
    if base.get("task_branch"):
        notes.append("HEAD stays on the task's branch %s; `%s` goes back (uncommitted "
                     "changes come along)." % (
                         base["task_branch"], "git switch " + base["from_branch"]
                         if base.get("from_branch") else "git checkout --detach %s"
                         % (base.get("commit") or "")[:12]))
    return "\n".join(notes)


def op_force_reset(store, caller):
    """The human's reset: any state → Idle, task files cleared, selection kept.  Nothing
    in the work tree or in git changes (see kept_changes_note)."""
    kept = kept_changes_note(store, store.read_state())
    with store.transaction(caller.agent_id) as tx:
        previous = tx.state.state
        tx.set(t_force_reset(tx.state, store.clock()), "force_reset", previous=previous.value)
        for name in ("TASK.md",) + TASK_SCRATCH_FILES + _approval_file_if_any(store):
            tx.write(name, "")
        agents_path = store.path("agents.json")
        if os.path.isfile(agents_path):
            with contextlib.suppress(ValueError, OSError):
                registry = json.loads(read_text(agents_path))
                for entry in registry.get("agents", []):
                    if entry.get("status") == "running":
                        entry["status"], entry["pid"] = "suspended", None
                tx.write("agents.json", pretty_json(registry))
    return _outcome("State reset to Idle from %s. Task files cleared; the spec selection is kept."
                    % previous + ("\n" + kept if kept else ""), S.IDLE,
                    previous_state=previous.value)


def op_rotate_journal(store, caller):
    """Move events.jsonl aside now (it also happens by itself at the size limit)."""
    with store.transaction(caller.agent_id) as tx:
        tx.set(tx.state, "journal_rotated", archive=JOURNAL_ARCHIVE_FILE)
        tx.rotate_journal = True
    seq = tx.committed.seq
    if not tx.rotated_journal:
        return _outcome("%s/%s was empty, or could not be renamed (Windows: another process has "
                        "it open); entry #%d "
                        "records the attempt." % (FERRUS_DIR, JOURNAL_FILE, seq),
                        tx.state.state, seq=seq, rotated=False)
    return _outcome("%s/%s moved to %s/%s (replacing the older archive); the new %s starts "
                    "with entry #%d." % (FERRUS_DIR, JOURNAL_FILE, FERRUS_DIR,
                                         JOURNAL_ARCHIVE_FILE, JOURNAL_FILE, seq),
                    tx.state.state, seq=seq, rotated=True)


def op_heartbeat(store, caller, agent_id=None):
    """Renew the caller's own lease.  The identity is the server's, not an argument."""
    def error(code, message):
        return _json_outcome({"status": "error", "code": code, "message": message})
    # The agent may name itself without its session; the lease is still renewed only
    # for this server's own identity, session included.
    if agent_id and agent_id not in (caller.agent_id, caller.agent_id.partition("/")[0]):
        # Upstream trusted the argument, so any client could renew any lease (see
        # ARCHITECTURE.md, 'Differences from upstream ferrus', item 7).
        return error("foreign_id", "This server acts as %s and cannot renew a lease for %s"
                     % (caller.agent_id, agent_id))
    ttl = store.config().lease.ttl_secs
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        now = store.clock()
        if data.claimed_by != caller.agent_id:
            if data.claimed_by is None:
                return error("not_claimed", "No active lease exists")
            return error("claimed_by_other", "Lease is held by %s" % data.claimed_by)
        if not store.lease_live(data):
            return error("expired", "Your lease expired before renewal")
        if data.state not in ALLOWED_FROM["heartbeat"]:
            return error("invalid_state", "State %s cannot hold a lease" % data.state)
        tx.set(claim(data, caller.agent_id, now, ttl), "heartbeat")
    store.lease_seconds_left(tx.state)              # the renewed lease is seen from now on
    return _json_outcome({"status": "renewed", "claimed_by": tx.state.claimed_by,
                          "lease_until": tx.state.lease_until})


def lease_session(agent_id):
    """The agent session a lease holder id names (``<role>:<agent>:<index>/<session>``)."""
    return agent_id.rpartition("/")[2] if agent_id and "/" in agent_id else None


def op_release_sessions(store, sessions):
    """Free the lease when one of ``sessions`` (stopped agent sessions) holds it.

    Returns the holder whose lease was freed, or None."""
    with store.transaction("hq") as tx:
        data = tx.state
        if data.claimed_by and lease_session(data.claimed_by) in sessions:
            tx.set(clear_lease(data), "lease_released", holder=data.claimed_by,
                   reason="its agent session was stopped")
            return data.claimed_by
    return None


def op_run_checks_only(store, cancel=None):
    """`ferrus check --force`: run the gate and report, changing no state."""
    config = store.config()
    if not config.checks.commands:
        return None, config
    return run_checks(store.workdir, config.checks, store.path("logs"), 0,
                      config.limits.max_feedback_lines, cancel, store.root), config


def op_integrated(store, caller, **detail):
    """Integrating → Complete: the merge queue fast-forwarded the target branch to the
    task's work, with the checks green on that very commit."""
    with store.transaction(caller.agent_id) as tx:
        tx.set(t_integrated(tx.state, store.clock()), "integrated", **detail)
    return _outcome("Task integrated. State: Complete.", S.COMPLETE, **detail)


def _integration_failure_reason(store, data, max_cycles):
    """Why a task failed at its last failed integration: how many of its review cycles
    were failed integrations (its journal since it was created, this one included) and
    how many a reviewer's or human's rejections — not "rejected" for what no one did."""
    failed = 1
    for entry in store.journal_entries_backwards():
        if entry.get("task_id") not in (None, data.task_id):
            continue
        if entry.get("event") == "create_task":
            break
        if entry.get("event") == "integration_failed":
            failed += 1
    failed = min(failed, data.review_cycles)
    rejected = data.review_cycles - failed
    def times(count):
        return "once" if count == 1 else "%d times" % count
    return "Task integration failed %s (a conflict with the target branch or red checks " \
        "on the merged result)%s: the review cycle limit (%d) is reached without " \
        "resolution." % (times(failed), ", and it was rejected %s" % times(rejected)
                         if rejected else "", max_cycles)


def op_integration_failed(store, caller, notes, onto=None, **detail):
    """Integrating → Addressing (or Failed at max_review_cycles): a conflict with the
    target branch or a red check on the merged result, told to the executor as review
    notes.  It counts as a review cycle.  ``onto``: the target head the task's branch
    was left on, its diff's base from now on (see t_integration_failed)."""
    limits = store.config().limits
    if onto:
        detail["onto"] = onto[:12]
    with store.transaction(caller.agent_id) as tx:
        new = t_integration_failed(tx.state, store.clock(), limits.max_review_cycles,
                                   onto)
        if new.state == S.FAILED:
            new.failure_reason = _integration_failure_reason(store, new,
                                                             limits.max_review_cycles)
        tx.write("REVIEW.md", notes)
        tx.set(new, "integration_failed", text=journal_text(notes), **detail)
    return _outcome("Integration failed. State: %s." % new.state, new.state, **detail)
