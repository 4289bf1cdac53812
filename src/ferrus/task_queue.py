"""The task queue: add, cancel, retry, task records and rows.

`ferrus task add`, the supervisor's enqueue_task and HQ's /task add put a task in the
queue; cancel saves a task's work before its worktree goes, retry goes on from it;
the rows every view of the queue shows are built here."""

import collections
import contextlib
import itertools
import os

from .basics import (FerrusError, LazyPattern, format_duration, format_timestamp, new_id,
                     parse_timestamp, pretty_json)
from .system import atomic_write, read_text
from .config import BUILTIN_AGENTS
from .task_machine import ACTIVE_STATES, S, t_force_reset, t_integrated
from .store import (APPROVED_STATUSES, CANCELLED_STATUS, DONE_STATUS, FAILED_STATUS,
                    MERGED_STATUS, PARALLEL_MIRROR_KEY, PUBLISHED_STATUS, QUEUED_STATUS,
                    RUNNING_STATUS, STATE_FILE, TASKS_DIR, TASK_RECORD_FILE,
                    TASK_STATUS_ORDER, TASK_STATUS_WORDS, TaskRecordDamaged,
                    UNCHANGED_STATUS, is_story, load_task_record, read_task_record,
                    require_utf8, task_record_path)
from .git import (GitUnavailable, commit_parent, set_task_ref, snapshot_worktree,
                  stream_git, task_checkout, task_ref)
from .worktrees import _tree_of, remove_review_checkout, remove_task_worktree, target_head
from .bootstrap import tear_down_task
from .specs import milestone_task_text, parse_spec, unmet_dependencies
from .operations import (HUMAN, TASK_TITLE_CHARS, _nonblank, _outcome, op_diff,
                         short_task_id, task_diff_exclusions, task_title)
from .work import op_force_reset


def merge_unless_cancelled(store, task, move, caller, **detail):
    """The merge queue's last step, made mutually exclusive with op_cancel_task: under the
    project lock the task is read again; one cancelled meanwhile (its record cancelled,
    its state Idle) is not merged — ``move`` is not called and the target stays where it
    is.  Else ``move()`` moves the target (it returns the commit the target is now at, or
    None when it did not move it) and the task becomes Complete in the same transaction,
    so a cancel waiting for the lock finds it merged.  ``store`` is the project's.

    Returns (CANCELLED_STATUS, None) when the cancel came first, (MERGED_STATUS, commit)
    when the merge did, and (None, None) when ``move`` did not move the target."""
    with store.for_task(task).transaction(caller.agent_id) as tx:
        # A damaged record raises: what it said is unknown, so nothing is merged for it.
        if record_for_update(store, task).get("status") == CANCELLED_STATUS or \
                tx.state.state == S.IDLE:
            return CANCELLED_STATUS, None
        head = move()
        if not head:
            return None, None
        tx.set(t_integrated(tx.state, store.clock()), "integrated", commit=head[:12],
               **detail)
    return MERGED_STATUS, head


# -- the task queue (ARCHITECTURE.md, 'Parallel tasks') ------------------------------------
#
# `ferrus task add`, the supervisor's enqueue_task and HQ's /task add put a task in the
# queue: .ferrus/tasks/<id>/ with its TASK.md and task.json (title, origin, status, and
# once it runs, its worktree and branch).  The orchestrator takes queued tasks in order;
# with [parallel] max_tasks = 1 it runs each as the project's own task, in the checkout,
# exactly as `ferrus run --task` does; with more, each in its own worktree, with its own
# STATE.json beside its task.json.

def status_word(status):
    """A task status as people read it: ``approved (no change)`` for unchanged."""
    return TASK_STATUS_WORDS.get(status, status or "?")


def count_statuses(statuses):
    """``2 running, 1 merged, 1 approved (no change)``: how many tasks have each status."""
    counts = collections.Counter(statuses)
    order = TASK_STATUS_ORDER + tuple(sorted(str(status) for status in counts
                                             if status not in TASK_STATUS_ORDER))
    return ", ".join("%d %s" % (counts[status], status_word(status))
                     for status in order if counts[status])


def queued_task_ids(store):
    """Every task of the queue, oldest first (ids start with their creation time)."""
    try:
        names = os.listdir(store.path(TASKS_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(name for name in names if _TASK_ID_RE.match(name)
                  and os.path.isfile(task_record_path(store.dir, name)))


_TASK_ID_RE = LazyPattern(r"^t-[0-9]{8}T[0-9]{6}-[0-9a-f]{6}$")


def queued_order(record):
    """Sort key of a task's record or task_rows row by when it was queued (timestamps
    compared as times, not as text: "10:00:00Z" is before "10:00:00.001Z")."""
    with contextlib.suppress(ValueError, TypeError):
        return parse_timestamp(record.get("created_at")).timestamp()
    return 0.0


def task_records(store):
    """[(task id, its task.json)] of the queue, oldest first: an id orders tasks only by
    the second they were queued in (then by its random end), so tasks queued within one
    second are ordered by their records' created_at.  A damaged record is {}."""
    return [(task, record) for task, record, _ in checked_task_records(store)]


def checked_task_records(store, tasks=None):
    """[(task id, its task.json or {}, what is wrong with it or None)] of the queue (or of
    the ``tasks`` given, in their order), oldest first as task_records."""
    if tasks is not None:
        return [(task,) + load_task_record(store.dir, task) for task in tasks]
    loaded = [(task,) + load_task_record(store.dir, task) for task in queued_task_ids(store)]
    return sorted(loaded, key=lambda item: (item[0][:17], queued_order(item[1])))


def require_task_id(store, task):
    """The id of the queue's task that ``task`` names — its whole id, or the end of it
    (at least 4 characters, as the task's lines show it: ``3fa2c1``) when only one task's
    id ends so — else a FerrusError that says what does."""
    known = queued_task_ids(store)
    if isinstance(task, str) and task in known:
        return task
    matches = [name for name in known if isinstance(task, str) and len(task) >= 4
               and name.endswith(task)]
    if len(matches) == 1:
        return matches[0]
    raise FerrusError("%s task %s in the queue" % ("more than one" if matches else "no",
                                                   str(task)[:80]),
                      "`ferrus tasks` lists them%s" % (
                          " (the newest is %s)" % known[-1] if known else ""))


def resolve_task_ref(store, ref):
    """The task id a command's ``--task`` names: ``current`` (the task in STATE.json), a
    task of the queue (its id or unique end), or any id a task of the checkout had."""
    if ref == "current":
        return store.read_state().task_id
    try:
        return require_task_id(store, ref)
    except FerrusError:
        if isinstance(ref, str) and _TASK_ID_RE.match(ref):
            return ref
        raise


def task_store_of(store, task):
    """The store holding the state of queue task ``task`` (its id or unique end): its
    own, or the project's for a task run in the checkout while it is the current one —
    else a FerrusError saying why there is none."""
    task = require_task_id(store, task)
    record = read_task_record(store.dir, task)
    if record.get("store") == "project":
        if store.project_state().task_id == task:
            return store
        raise FerrusError("task %s ran in the checkout and is no longer its current task"
                          % task, "`ferrus log --task %s` shows what happened to it"
                          % short_task_id(task))
    task_store = store.for_task(task)
    if not task_store.exists():
        raise FerrusError("task %s has not started yet (it is %s)" % (
            task, record.get("status") or QUEUED_STATUS),
            "`ferrus run --parallel N` starts the queue's tasks")
    return task_store


def foreground_task(store):
    """The parallel task the project's STATE.json mirrors (see ARCHITECTURE.md,
    'Parallel tasks'), or None while the file holds the checkout's own task."""
    task = store.project_state().extra.get(PARALLEL_MIRROR_KEY)
    if isinstance(task, str) and _TASK_ID_RE.match(task) and \
            os.path.isfile(task_record_path(store.dir, task)):
        return task
    return None


def foreground_store(store):
    """The store the plain views (`ferrus status`, `ferrus diff`, HQ's /status and /diff)
    read for the foreground task: the mirrored parallel task's own — its question, review
    and submission files, its worktree — else the project's.  The mirror copies only the
    state; reading the checkout's files for a parallel task would show another task's."""
    task = foreground_task(store)
    if task is None:
        return store
    task_store = store.for_task(task)
    return task_store if task_store.exists() else store


def diff_store_of(store, task):
    """The store whose diff shows queue task ``task``'s work, or a FerrusError saying why
    there is none to show: merged (its work is on the target, at its merged commit),
    not started, or its worktree gone."""
    record = read_task_record(store.dir, task)
    status = record.get("status")
    if status == UNCHANGED_STATUS:
        raise FerrusError("task %s was approved and changed nothing: it has no diff, and "
                          "nothing was merged" % short_task_id(task),
                          "`ferrus log --task %s` shows what happened to it"
                          % short_task_id(task))
    if status == MERGED_STATUS:
        merged = record.get("merged_commit") or ""
        raise FerrusError("task %s is merged%s%s; its worktree and branch were removed" % (
            short_task_id(task), " at %s" % merged[:12] if merged else "",
            " into %s" % record["target"] if record.get("target") else ""),
            "`git show %s` shows what it changed" % (merged[:12] or record.get("target")
                                                     or "HEAD"))
    if record.get("store") != "project" and not store.for_task(task).exists():
        raise FerrusError("task %s is %s: it has no work yet" % (
            short_task_id(task), status or "not started"),
            "`ferrus tasks` lists the tasks (/tasks in HQ)")
    task_store = task_store_of(store, task)
    if task_store is not store and not os.path.isdir(task_store.workdir):
        raise FerrusError("task %s's worktree %s is gone%s" % (
            short_task_id(task), task_store.workdir,
            " (it was cancelled)" if status == CANCELLED_STATUS else ""),
            "`ferrus log --task %s` shows what happened to it; `ferrus doctor` lists "
            "orphaned tasks and worktrees" % short_task_id(task))
    return task_store


def op_merged_task_diff(store, task, stat_only=False, paths=None, head_bytes=192 * 1024,
                        tail_bytes=32 * 1024):
    """What merged task ``task`` changed: its merged commit against the target's head it
    was merged onto (the commit's parent when that is not recorded) — `git show` of the
    task's one commit.  Its worktree and branch are gone; the commit stays."""
    record = read_task_record(store.dir, task)
    published = record.get("published") or {}
    commit = record.get("merged_commit") or published.get("commit") or ""
    base = (record.get("integration") or {}).get("target_head") or commit + "^"
    args = ["diff", "--find-renames", "--stat" if stat_only else "--patch-with-stat", base,
            commit, "--"] + list(paths or [])
    head, tail, total = stream_git(store.root, args, head_bytes, tail_bytes)
    text = os.fsdecode(bytes(head))
    if tail:
        text += "\n[… %d bytes not shown …]\n%s" % (total - len(head) - len(tail),
                                                    os.fsdecode(bytes(tail)))
    title = "Task %s %s at %s (%s..%s)" % (
        short_task_id(task), "merged into %s" % (record.get("target") or "its target")
        if not published else "published as %s's branch %s" % (
            published.get("remote"), published.get("branch")), commit[:12], base[:12],
        commit[:12])
    return _outcome("%s\n\n%s" % (title, text.rstrip("\n")), None, available=True,
                    task_id=task, merged_commit=commit, base=base, target=record.get("target"),
                    diff=text, cut=bool(tail))


def op_task_diff(store, task=None, stat_only=False, paths=None):
    """`ferrus diff` and HQ's /diff: the checkout's task (``task`` None), a queue task's
    work in its worktree, or a merged task's merged commit (op_merged_task_diff)."""
    record = read_task_record(store.dir, task) if task is not None else {}
    if (record.get("status") == MERGED_STATUS and record.get("merged_commit")) or (
            record.get("status") == PUBLISHED_STATUS and (record.get("published") or {})
            .get("commit")):
        return op_merged_task_diff(store, task, stat_only, paths)
    if task is not None:
        store = diff_store_of(store, task)
    return op_diff(store, HUMAN, stat_only=stat_only, paths=paths)


def stores_awaiting_confirmation(store):
    """[(task id, store)] of every task waiting in AwaitingConfirmation for the human:
    the checkout's own task and each parallel task."""
    waiting = []
    project = store.project_state()
    if project.state == S.AWAITING_CONFIRMATION and not project.extra.get(PARALLEL_MIRROR_KEY):
        waiting.append((project.task_id, store))
    for task, record in task_records(store):
        if record.get("status") != RUNNING_STATUS or record.get("store") == "project":
            continue
        task_store = store.for_task(task)
        with contextlib.suppress(FerrusError):
            if task_store.exists() and task_store.read_state().state == \
                    S.AWAITING_CONFIRMATION:
                waiting.append((task, task_store))
    return waiting


def record_for_update(store, task):
    """Task ``task``'s record, to change and write back (holding the project lock); a
    damaged one raises TaskRecordDamaged: writing over it would lose what it still
    holds (doctor sets it aside and rebuilds it)."""
    record, problem = load_task_record(store.dir, task)
    if problem:
        raise TaskRecordDamaged(task, problem)
    return record


def write_task_record(store, task, record):
    """Replace a task's task.json; call it holding the project lock."""
    atomic_write(task_record_path(store.dir, task), pretty_json(record))


def update_task(store, caller, task, event, changes, only_from=None, **detail):
    """Change a task's task.json and journal ``event`` about it, in one transaction.
    With ``only_from`` (statuses) a task whose status is none of them is left as it is
    (None is returned): a cancel from another shell may have come first."""
    with store.transaction(caller.agent_id) as tx:
        record = record_for_update(store, task)
        if only_from is not None and record.get("status") not in only_from:
            return None
        record.update(changes)
        write_task_record(store, task, record)
        tx.set(tx.state, event, **detail)
        tx.journal_task_id = task
    return record


def _milestone_taken(store, spec, milestone):
    """The queued or running task that implements ``milestone`` of ``spec``, if any."""
    for task, record in task_records(store):
        origin = record.get("origin") or {}
        if record.get("status") in (QUEUED_STATUS, RUNNING_STATUS) and \
                origin.get("spec") == spec and \
                origin.get("milestone") == milestone:
            return task
    data = store.project_state()
    if data.state in ACTIVE_STATES and data.task_spec == spec and \
            data.task_milestone == milestone:
        return data.task_id
    return None


def op_enqueue_task(store, caller, description, spec=None, milestone=None, agent=None):
    """Put a task in the queue.  ``spec`` and ``milestone`` name the milestone it
    implements; ``agent`` the executor agent that should take it (a supervisor that
    splits a milestone as team lead names one; [parallel] delegates says which may)."""
    _nonblank(description, "Cannot queue the task: the description is empty.")
    require_utf8(description, "the task description")
    known = BUILTIN_AGENTS + tuple(store.config().agents.custom) if agent is not None else ()
    if agent is not None and agent not in known:
        raise FerrusError("Cannot queue the task: %r is not an agent ferrus knows" % agent,
                          "use one of %s" % ", ".join(known))
    if milestone is not None and spec is None:
        raise FerrusError("Cannot queue the task: a milestone needs its spec")
    store.require()
    task = new_id("t")
    origin = {"by": caller.agent_id}
    if spec is not None:
        origin["spec"] = spec
    if milestone is not None:
        origin["milestone"] = milestone
    if caller.is_agent and caller.role == "supervisor":
        # A supervisor that splits work into tasks acts as team lead: the delegation gate
        # checks where each of its tasks went.
        origin["delegated_by"] = caller.agent_id
    record = {"id": task, "title": task_title(description), "status": QUEUED_STATUS,
              "created_at": format_timestamp(store.clock()), "origin": origin}
    if agent is not None:
        record["agent"] = agent
    folder = store.path(TASKS_DIR, task)
    with store.transaction(caller.agent_id) as tx:
        # Checked again under the lock: two shells queuing one milestone get one task.
        taken = _milestone_taken(store, spec, milestone) if milestone is not None else None
        if taken:
            raise FerrusError("Cannot queue the task: milestone %s of %s is already task %s"
                              % (milestone, spec, taken), "`ferrus tasks` lists the queue")
        os.makedirs(folder, exist_ok=True)
        atomic_write(os.path.join(folder, "TASK.md"), description)
        write_task_record(store, task, record)
        tx.set(tx.state, "enqueue_task", title=record["title"],
               **{key: value for key, value in origin.items() if key != "by"})
        tx.journal_task_id = task
    return _outcome("Task %s queued: %s" % (task, record["title"]), None, task_id=task,
                    title=record["title"])


def op_enqueue_milestone(store, caller, spec, milestone_id):
    """Queue the task that implements one milestone (it must be ready: unchecked and
    every milestone it depends on done)."""
    path = os.path.join(store.root, spec)
    if not os.path.isfile(path):
        raise FerrusError("Cannot queue milestone %s: there is no spec %s" % (milestone_id, spec),
                          "`ferrus status` names the specs; paths are relative to the project")
    text = read_text(path)
    milestones = parse_spec(text)
    chosen = next((m for m in milestones if milestone_id in (m.id, m.marker)), None)
    if chosen is None:
        raise FerrusError("Cannot queue milestone %s: %s has no such milestone" % (
            milestone_id, spec), "its milestones are %s" % (
            ", ".join(m.id for m in milestones) or "none"))
    if chosen.completed:
        raise FerrusError("Cannot queue milestone %s: it is already complete" % chosen.id,
                          "untick its box in %s to do it again" % spec)
    waits = unmet_dependencies(chosen, milestones)
    if waits:
        raise FerrusError("Cannot queue milestone %s: it depends on %s, not complete yet" % (
            chosen.id, ", ".join(waits)), "queue what it depends on first")
    rel = os.path.relpath(path, store.root).replace(os.sep, "/")
    return op_enqueue_task(store, caller, milestone_task_text(rel, text, chosen), rel, chosen.id)


def op_enqueue_ready(store, caller, spec):
    """Queue every ready milestone of ``spec`` that no task implements yet."""
    path = os.path.join(store.root, spec)
    if not os.path.isfile(path):
        raise FerrusError("there is no spec %s" % spec, "paths are relative to the project")
    rel = os.path.relpath(path, store.root).replace(os.sep, "/")
    queued = []
    for milestone in parse_spec(read_text(path)):
        if not milestone.completed and not unmet_dependencies(
                milestone, parse_spec(read_text(path))) and \
                not _milestone_taken(store, rel, milestone.id):
            queued.append(op_enqueue_milestone(store, caller, rel, milestone.id).data["task_id"])
    if not queued:
        return _outcome("No milestone of %s is ready to queue (each is done, waits for "
                        "another, or is a task already)." % rel, None, queued=[])
    return _outcome("Queued %d task%s: %s" % (len(queued), "" if len(queued) == 1 else "s",
                                              ", ".join(queued)), None, queued=queued)


def _refuse_ended(task, record):
    if record.get("status") == MERGED_STATUS:
        _refuse_merged_first(task, record.get("target"), record.get("merged_commit"))
    if record.get("status") in APPROVED_STATUSES:
        raise FerrusError("task %s is already %s" % (task, status_word(record["status"])),
                          "its work is in the checkout; nothing to cancel"
                          if record["status"] == DONE_STATUS else
                          "its branch was pushed for a pull request; close that to drop it"
                          if record["status"] == PUBLISHED_STATUS else
                          "it was approved and changed nothing; nothing to cancel")


def _refuse_merged(store, task, record, data):
    """A cancel that comes after the merge (see merge_unless_cancelled) is refused and
    says so: the task is Complete, or the target is already at the commit the merge
    queue checked for it (its run stopped before it could record the merge)."""
    merged = data.state == S.COMPLETE
    candidate = (record.get("integration") or {}).get("candidate")
    target = record.get("target")
    if not merged and candidate and target and data.state == S.INTEGRATING:
        with contextlib.suppress(FerrusError):
            merged = target_head(store.root, target) == candidate
    if merged:
        _refuse_merged_first(task, target, candidate)


def _refuse_merged_first(task, target, commit):
    raise FerrusError(
        "task %s is already merged into %s%s: the merge came before this cancel, nothing "
        "was cancelled" % (task, target or "its target", " at %s" % commit[:12] if commit
                           else ""),
        "its work is on %s (`ferrus log --task %s` shows the merge); revert it there if it "
        "is not wanted" % (target or "the target branch", short_task_id(task)))


def op_cancel_task(store, caller, task, remove_worktree=False, discard=False):
    """Take a task out of the queue, or stop a running one: it is never taken up again.
    The orchestrator running it stops its agents and removes its worktree and branch;
    with ``remove_worktree`` (no orchestrator will: none runs, or the task is not in its
    hands, as a failed task's kept worktree is not) they are removed here.  Either way
    its work is saved first (save_task_work), unless ``discard``."""
    task = require_task_id(store, task)
    record = read_task_record(store.dir, task)      # read again under the lock below
    _refuse_ended(task, record)
    task_store = store.for_task(task)
    if record.get("status") == CANCELLED_STATUS:
        text = "Task %s was already cancelled." % task
    elif task_store.exists():
        with task_store.transaction(caller.agent_id) as tx:
            # Under the lock the merge queue's last step holds (merge_unless_cancelled):
            # either the merge came first and this cancel is refused, or the cancel comes
            # first and the target is never moved for this task.
            record = record_for_update(store, task)
            _refuse_ended(task, record)         # merged meanwhile, under our feet
            _refuse_merged(store, task, record, tx.state)
            integrating = tx.state.state == S.INTEGRATING
            new = t_force_reset(tx.state, store.clock())
            new.task_id = tx.state.task_id
            tx.set(new, "cancel_task", **({"discard": True} if discard else {}))
            record.update(status=CANCELLED_STATUS, ended_at=format_timestamp(store.clock()))
            if discard:
                record["discard"] = True
            write_task_record(store, task, record)
        text = "Task %s cancelled%s." % (task, " before its merge: the target branch is not "
                                         "moved for it" if integrating else "")
    else:
        if record.get("store") == "project":
            data = store.project_state()
            if data.task_id == task and data.state in ACTIVE_STATES:
                op_force_reset(store, caller)
        changes = {"status": CANCELLED_STATUS, "ended_at": format_timestamp(store.clock())}
        if discard:
            changes["discard"] = True
        if update_task(store, caller, task, "cancel_task", changes,
                       only_from=(QUEUED_STATUS, RUNNING_STATUS, FAILED_STATUS)) is None:
            _refuse_ended(task, read_task_record(store.dir, task))
        text = "Task %s cancelled." % task
    removed = {}
    if remove_worktree:
        said, removed = _remove_task_leftovers(store, read_task_record(store.dir, task))
        text += said
    return _outcome(text, None, task_id=task, removed=removed)


# What a task's record says about one attempt at it: dropped when it is queued again.
_ATTEMPT_KEYS = ("reason", "ended_at", "integration", "merged_commit", "place_tidied")


def op_retry_task(store, caller, task):
    """Put a failed (or cancelled) task back in the queue: the next `ferrus run` takes it
    up again.  A parallel task goes on in its kept worktree and branch, with the work done
    so far (its state is reset to Idle, so the run creates it afresh, Executing); one whose
    worktree is gone starts again from the target's head."""
    task = require_task_id(store, task)
    record = record_for_update(store, task)
    status = record.get("status") or QUEUED_STATUS
    if status in APPROVED_STATUSES:
        raise FerrusError("task %s is already %s" % (task, status_word(status)),
                          "it was approved; `ferrus task add` queues more work")
    if status not in (FAILED_STATUS, CANCELLED_STATUS):
        raise FerrusError("task %s is %s, not failed or cancelled: there is nothing to retry"
                          % (task, status), "`ferrus tasks` lists the tasks and their states")
    if record.get("lost_to"):
        # Its race was won: a second attempt merged would be the same task twice.
        saved = (record.get("saved") or {}).get("ref")
        raise FerrusError("task %s lost its race: attempt %s was merged first" % (
            task, short_task_id(record["lost_to"])),
            "%s`ferrus task add` queues a new task to build on what was merged" % (
                "its work is saved (`git branch NAME %s` makes a branch of it); " % saved
                if saved else ""))
    worktree = record.get("worktree")
    kept = bool(worktree) and os.path.isdir(worktree)

    def requeued():
        now = record_for_update(store, task)
        if now.get("status") != status:
            # Retried (or changed) by someone else since it was read: leave it be.
            raise FerrusError("task %s is %s now, not %s: someone else changed it" % (
                task, now.get("status"), status), "`ferrus tasks` shows where it stands")
        fresh = dict(now, status=QUEUED_STATUS)
        for key in _ATTEMPT_KEYS + ("discard",):
            fresh.pop(key, None)
        saved = fresh.pop("saved", None)
        if fresh.get("store") == "project" or not kept:
            # Run in the checkout, or its worktree is gone: it starts as a new task —
            # from the work a cancel saved, when there is some.
            for key in ("store", "started_at", "worktree", "workdir", "branch", "base",
                        "target", "resume_from"):
                fresh.pop(key, None)
            if isinstance(saved, dict) and isinstance(saved.get("commit"), str) and \
                    fresh.get("store") != "project":
                with contextlib.suppress(FerrusError):
                    fresh["base"] = commit_parent(store.root, saved["commit"])
                    fresh["resume_from"] = saved["commit"]
        return fresh
    task_store = store.for_task(task)
    detail = {"was": status, "worktree": worktree if kept else None}
    if task_store.exists():
        with task_store.transaction(caller.agent_id) as tx:
            new = t_force_reset(tx.state, store.clock())
            new.task_id = tx.state.task_id
            tx.set(new, "retry_task", **detail)
            tx.journal_task_id = task
            write_task_record(store, task, requeued())
    else:
        with store.transaction(caller.agent_id) as tx:
            write_task_record(store, task, requeued())
            tx.set(tx.state, "retry_task", **detail)
            tx.journal_task_id = task
    saved = record.get("saved") if isinstance(record.get("saved"), dict) else {}
    text = "Task %s is queued again%s." % (task, (
        "; it goes on in its kept worktree %s with the work done so far" % worktree)
        if kept and record.get("store") != "project" else
        "; it goes on from its saved work (%s)" % saved["ref"]
        if not kept and saved.get("ref") else "")
    return _outcome(text + " `ferrus run` (or HQ /run) takes it up.", None, task_id=task,
                    worktree=worktree if kept else None)


def save_task_work(store, task, record):
    """Before a task's worktree goes: its files recorded as a commit on the task's base
    under refs/ferrus/<task>/saved-<id> (see snapshot_worktree), unless they hold
    nothing the base lacks.  Returns (text for people, {"ref", "commit"} or None).
    Raises FerrusError when the work exists and cannot be saved (then the worktree must
    stay)."""
    worktree = record.get("worktree")
    if record.get("store") == "project" or not isinstance(worktree, str) or not \
            os.path.isdir(worktree):
        return "", None
    task_store = store.for_task(task)
    base = record.get("base")
    with contextlib.suppress(FerrusError):
        base = (task_store.read_state().task_base or {}).get("commit") or base
    if not isinstance(base, str) or not base:
        return "", None
    checkout = task_checkout(store.root, worktree, cwd=task_store.workdir, verify=False)
    commit = snapshot_worktree(checkout, base, task_diff_exclusions(task_store),
                               "ferrus: the work of task %s, saved before its worktree was "
                               "removed" % task)
    if _tree_of(store.root, commit) == _tree_of(store.root, base):
        return "", None
    ref = task_ref(task, new_id("saved"))
    set_task_ref(store.root, ref, commit)
    update_task(store, HUMAN, task, "task_work_saved", {"saved": {"ref": ref,
                                                                  "commit": commit}},
                ref=ref)
    short = short_task_id(task)
    # A lost race attempt is never retried (see op_retry_task): its work is only a branch.
    lost = record.get("lost_to") or (read_task_record(store.dir, task) or {}).get("lost_to")
    then = ("`ferrus task add` queues a new task to build on what was merged" if lost
            else "`ferrus task retry %s` goes on from it" % short)
    return (" Its work is saved: `git branch ferrus-saved-%s %s` makes a branch of it; "
            "%s." % (short, ref, then), {"ref": ref, "commit": commit})


def _remove_task_leftovers(store, record):
    """(text, what was removed) for a cancelled task's worktree and branch, its work
    saved first (see save_task_work) unless it was cancelled with --discard."""
    worktree, branch = record.get("worktree"), record.get("branch")
    if record.get("store") == "project" or not worktree or not branch:
        return "", {}
    saved_text = ""
    if not record.get("discard"):
        try:
            saved_text, _ = save_task_work(store, record.get("id") or os.path.basename(
                worktree), record)
        except GitUnavailable:
            return "", {}
        except FerrusError as err:
            return (" Its worktree %s stays: its work could not be saved (%s); look at it "
                    "there, or `ferrus task cancel --discard` drops it." % (
                        worktree, err.message)), {}
    with contextlib.suppress(FerrusError, OSError):
        remove_review_checkout(store.root, worktree)
    torn = tear_down_task(store, record)
    torn = " Warning: %s." % torn if torn else ""
    try:
        head = target_head(store.root, branch)
        done = remove_task_worktree(store.root, worktree, branch)
    except GitUnavailable:
        return "", {}
    except FerrusError as err:
        return (" Its worktree %s and branch %s stay: %s (`ferrus doctor --fix` removes them "
                "once that is fixed)." % (worktree, branch, err.message)), {}
    parts, removed = [], {}
    if done["removed"]:
        parts.append("its worktree %s" % worktree)
        removed["worktree"] = worktree
    if done["branch_deleted"]:
        parts.append("its branch %s (it was at %s: `git branch %s %s` brings back what it "
                     "had committed)" % (branch, head[:12], branch, head[:12]) if head
                     else "its branch %s" % branch)
        removed["branch"] = branch
    if record.get("discard"):
        saved_text = " Its work was dropped (--discard): nothing of it was kept."
    return (saved_text + (" Removed %s." % " and ".join(parts) if parts else "") + torn,
            removed)


def task_rows(store, tasks=None):
    """One dict per task of the queue for `ferrus tasks`, HQ's board and `ferrus status`:
    id, title, status, state, agent, worktree, branch, age, tokens, last event.  Only the
    ``tasks`` given (ids), when they are."""
    rows = []
    now = store.clock()
    project = store.project_state() if store.exists() else None
    for task, record, problem in checked_task_records(store, tasks):
        row = {"id": task, "title": (record.get("title") or "")[:TASK_TITLE_CHARS],
               "status": record.get("status"),
               "state": None, "agent": record.get("agent"),
               "worktree": record.get("worktree"), "branch": record.get("branch"),
               # The place it runs (or ran) at, when not here (places.py).
               "place": record.get("place") if record.get("store") == "place" else None,
               "origin": record.get("origin") or {}, "created_at": record.get("created_at"),
               "started_at": record.get("started_at"), "ended_at": record.get("ended_at")}
        task_store = store.for_task(task)
        data = None
        if record.get("store") == "project":
            data = project if project is not None and project.task_id == task else None
        elif os.path.isfile(task_store.task_path(STATE_FILE)):
            with contextlib.suppress(FerrusError):
                data = task_store.read_state()
        if data is not None:
            row["state"] = data.state.value
            row["review_cycles"] = data.review_cycles
            row["failure_reason"] = data.failure_reason
        with contextlib.suppress(ValueError, TypeError):
            row["age_secs"] = max(0.0, (now - parse_timestamp(record.get("created_at")))
                                  .total_seconds())
        if record.get("integration"):
            row["integration"] = record["integration"]
        if record.get("merged_commit"):
            row["merged_commit"] = record["merged_commit"]
        for key in ("race", "published", "lost_to"):     # a race's attempt, a pushed branch
            if record.get(key):
                row[key] = record[key]
        if problem:
            # Said in every view of the queue (`ferrus tasks`, status, HQ's board), with
            # the repair.
            row["problem"] = problem
            row["title"] = "(its %s is damaged: %s; `ferrus doctor --fix` repairs it)" % (
                TASK_RECORD_FILE, problem)
        rows.append(row)
    return rows


# How far back the last event of each task is looked for: a bounded read of the journal's
# end, so a long journal costs what a short one does (an older task shows no last event).
TASK_EVENT_SCAN = 3000


def last_task_events(store, tasks, scan=TASK_EVENT_SCAN):
    """{task: its newest journal entry that tells what happened} for the ``tasks`` that
    have one among the journal's last ``scan`` entries (bookkeeping left out)."""
    wanted, found = set(tasks), {}
    for entry in itertools.islice(store.journal_entries_backwards(), scan):
        if len(found) == len(wanted):
            break
        task = entry.get("task_id")
        if task in wanted and task not in found and is_story(entry):
            found[task] = entry
    return found


def describe_task_event(entry, now=None):
    """A journal entry in a few words for a task's line: ``submit → Reviewing``,
    ``check passed``, ``task merged`` (and how long ago, given ``now``)."""
    if not entry:
        return "-"
    what = str(entry.get("event") or "?").replace("_", " ")
    if entry.get("from") != entry.get("to") and entry.get("to"):
        what += " → %s" % entry["to"]
    if now is not None:
        with contextlib.suppress(ValueError, TypeError):
            what += " (%s ago)" % format_duration(
                (now - parse_timestamp(entry.get("time"))).total_seconds())
    return what


def task_elapsed(row, now):
    """How long a task of task_rows has been at it: since it started (or was queued) until
    now or its end; None when its record has no usable time."""
    record_start = row.get("started_at") or row.get("created_at")
    try:
        start = parse_timestamp(record_start)
        end = parse_timestamp(row["ended_at"]) if row.get("ended_at") else now
    except (ValueError, TypeError):
        return None
    return max(0.0, (end - start).total_seconds())


DAMAGED_WORD = "damaged"     # a task whose task.json is damaged, in the views


def task_state_word(row):
    """A task's place in one word: its state while it runs, else its queue status."""
    if row.get("problem"):
        return DAMAGED_WORD
    return row["state"] if row.get("status") == RUNNING_STATUS and row.get("state") \
        else status_word(row.get("status"))
