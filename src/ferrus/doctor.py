"""Doctor: checking .ferrus/ and ferrus.toml, and safe repairs.

Each finding says what is wrong and how to repair it; `--fix` applies only the safe
repairs (a damaged file is kept aside, never deleted)."""

import contextlib
import json
import os
import tempfile
import time

from .basics import (FerrusError, deferred_dataclass, format_duration, format_timestamp,
                     log, pretty_json, terminal_safe, utc_now)
from .system import TEMP_SUFFIX, atomic_write, fsync_directory, read_text
from .config import (CONFIG_FILE, GitConfig, NO_CHECKS_HINT, NO_CHECKS_WARNING, PLACE_HERE,
                     ParallelConfig, load_config, parse_config)
from .task_machine import S, StateCorrupt, StateData
from .gates import phase_words
from .store import (CANCELLED_STATUS, CONTENT_FILES, DONE_STATUS, FAILED_STATUS,
                    FERRUS_DIR, JOURNAL_FILE, JOURNAL_GAP_EVENT, LOCK_FILE, MERGED_STATUS,
                    PARALLEL_MIRROR_KEY, PUBLISHED_STATUS, QUEUED_STATUS, RUNNING_STATUS,
                    STATE_FILE, Store, TASKS_DIR, TASK_BRANCH_PREFIX, TASK_RECORD_FILE,
                    TASK_RECORD_MAX_BYTES, UNCHANGED_STATUS, _lines_forward, journal_entry,
                    load_task_record, read_task_record, task_record_path,
                    task_record_problem)
from .checks import (CHECK_PROCESS_DIR, end_orphaned_checks, missing_check_programs,
                     orphaned_check_records)
from .git import GitUnavailable, _same_path, display_path, task_checkout
from .worktrees import (_relative_inside, default_worktree_dir, list_task_worktrees,
                        remove_task_worktree, target_head, worktree_changes)
from .sandbox import SandboxUnavailable, sandbox_tool
from .specs import list_spec_paths, parse_spec
from .operations import ROLES, short_task_id, task_diff_exclusions, task_title
from .task_queue import _TASK_ID_RE, queued_task_ids, write_task_record
from .memory import MEMORY_DIR, MEMORY_RECORDS_DIR
from .nano_model import nano_settings_findings
from .register import permission_warnings
from .places import Place, configured_places, place_project_key, running_tasks
from .sessions import SESSIONS_DIR
from .parallel import PARALLEL_RUN_FILE, live_parallel_run, load_parallel_run
from .scaffold import init_project


@deferred_dataclass
class Finding:
    """One problem doctor found, with the repair it suggests (and can apply)."""

    problem: str
    repair: str
    fix: "object | None" = None     # callable applying the safe repair, if there is one
    severity: str = "error"          # error | warning | info (worth knowing, not wrong)


def doctor_findings(root):
    """Everything wrong with a project's ferrus files, each with its repair."""
    store = Store(root)
    findings = []
    if not os.path.exists(os.path.join(root, CONFIG_FILE)):
        findings.append(Finding("%s is missing" % CONFIG_FILE, "run `ferrus init`",
                                lambda: init_project(root, report=lambda m: None)))
    else:
        findings.extend(config_findings(root))
        findings.extend(spec_findings(root))
    if not os.path.isdir(store.dir):
        findings.append(Finding("%s/ is missing" % FERRUS_DIR, "run `ferrus init`",
                                lambda: init_project(root, report=lambda m: None)))
        return findings
    for name in (LOCK_FILE, "agents.json", "CONSULT_TEMPLATE.md", "SPEC_TEMPLATE.md") + CONTENT_FILES:
        if not os.path.exists(store.path(name)):
            findings.append(Finding("%s/%s is missing" % (FERRUS_DIR, name),
                                    "recreate it (empty or from the template)",
                                    lambda: init_project(root, report=lambda m: None)))
    data = None
    state_path = store.path(STATE_FILE)
    if not os.path.exists(state_path):
        findings.append(Finding("%s/%s is missing" % (FERRUS_DIR, STATE_FILE),
                                "write a fresh Idle state", lambda: _rebuild_state(store)))
    else:
        try:
            data = store.continue_journal(StateData.from_json(read_text(state_path),
                                                              FERRUS_DIR + "/" + STATE_FILE))
        except StateCorrupt as err:
            findings.append(Finding(
                err.message, "keep the damaged file as STATE.json.corrupt-<time> and write a fresh "
                "Idle state whose rev continues the journal", lambda: _rebuild_state(store)))
    findings.extend(_journal_findings(store, data))
    if data is not None:
        # While STATE.json mirrors a parallel task, the content files are that task's.
        mirrored = data.extra.get(PARALLEL_MIRROR_KEY)
        findings.extend(_content_findings(
            store.for_task(mirrored) if isinstance(mirrored, str) and _TASK_ID_RE.match(
                mirrored) else store, data))
    for path, record in orphaned_check_records(store.dir):
        what = ("check `%s` started %s by ferrus pid %s, which is gone" % (
            record.get("command", "?"), record.get("started_at", "?"), record.get("owner_pid"))
            if record is not None else "unreadable check pid file %s" % os.path.basename(path))
        findings.append(Finding(
            "%s/%s/%s: %s; processes of it may still run" % (
                FERRUS_DIR, CHECK_PROCESS_DIR, os.path.basename(path), what),
            "end the processes carrying its marker (identity verified) and remove the pid file",
            lambda: [log.info("%s", m) for m in end_orphaned_checks(store.dir)],
            severity="warning"))
    findings.extend(_record_findings(store))
    findings.extend(parallel_task_findings(store))
    findings.extend(place_findings(root))
    stray = [name for name in os.listdir(store.dir)
             if name.endswith(TEMP_SUFFIX) or name == "STATE.json.tmp"]
    for folder in ("usage", CHECK_PROCESS_DIR, MEMORY_DIR + "/" + MEMORY_RECORDS_DIR):
        if os.path.isdir(store.path(folder)):
            stray += [folder + "/" + name for name in os.listdir(store.path(folder))
                      if name.endswith(TEMP_SUFFIX)]
    for name in stray:
        path = store.path(name)
        age = time.time() - os.stat(path).st_mtime
        if age > 60:
            findings.append(Finding("stray temporary file %s/%s (%s old)" % (
                FERRUS_DIR, name, format_duration(age)), "delete it",
                lambda path=path: os.unlink(path)))
    return findings


def _record_findings(store):
    """A damaged agents.json or session record breaks nothing (readers skip it), but the
    agents or sessions it held are no longer seen: said here, with a repair."""
    findings = []
    path = store.path("agents.json")
    try:
        registry = json.loads(read_text(path))
        if not isinstance(registry, dict) or not isinstance(registry.get("agents", []), list):
            raise ValueError("not an object with an \"agents\" list")
    except FileNotFoundError:
        pass                                    # reported above as missing
    except (OSError, ValueError) as err:
        findings.append(Finding(
            "%s/agents.json is damaged (%s): agents an earlier orchestrator started are not "
            "tracked" % (FERRUS_DIR, terminal_safe(str(err))[:120]),
            "keep it as agents.json.corrupt-<time> and start an empty list",
            lambda: _set_aside(path, pretty_json({"agents": []})), severity="warning"))
    folder = store.path(SESSIONS_DIR)
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in names:
        record_path = os.path.join(folder, name)
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            record = json.loads(read_text(record_path))
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                raise ValueError("not a session record")
        except (OSError, ValueError) as err:
            findings.append(Finding(
                "%s/%s/%s is damaged (%s): that session is left out of `ferrus sessions` and "
                "usage" % (FERRUS_DIR, SESSIONS_DIR, name, terminal_safe(str(err))[:120]),
                "keep it as %s.corrupt-<time>" % name,
                lambda record_path=record_path: _set_aside(record_path), severity="warning"))
    return findings


# -- doctor: parallel tasks' records, worktrees and branches -----------------------------
#
# -- places: what a killed run left there, a sandbox this machine cannot give --------

def place_findings(root, make_place=Place):
    """At each place, the tasks of this project a killed run left (not running here,
    their job not running there), each with its removal as the repair; a place that
    cannot be asked is a warning of its own.  And a sandbox this machine cannot give."""
    try:
        config, places, order = configured_places(root)
    except FerrusError:
        return []                   # config_findings names what is wrong
    findings = []
    if places[PLACE_HERE].sandbox.enabled and PLACE_HERE in order:
        try:
            sandbox_tool()
        except SandboxUnavailable as err:
            findings.append(Finding("%s: no task can start here while [sandbox] is on" %
                                    err.message, err.hint))
    if not any(name != PLACE_HERE for name in places):
        return findings
    project = place_project_key(root)
    running = set(running_tasks(Store(root)))
    for name, place in sorted(places.items()):
        if name == PLACE_HERE:
            continue
        channel = make_place(place)
        try:
            rows = channel.call("jobs").get("jobs") or []
        except FerrusError as err:
            findings.append(Finding("place %s could not be checked for leftovers: %s" % (
                name, err.message), err.hint or "`ferrus places` says what is wrong",
                severity="warning"))
            continue
        for row in rows:
            if row["project"] != project or row["state"] == "running" or \
                    row["task"] in running:
                continue
            findings.append(Finding(
                "place %s still holds task %s (its job %s%s): a run ended without removing "
                "it" % (name, row["task"], row["state"], ", %s" % row["reason"]
                        if row.get("reason") else ""),
                "remove its worktree, branch and store there",
                lambda channel=channel, task=row["task"]: channel.call(
                    "remove", project=project, task=task), severity="warning"))
    return findings


# A parallel task leaves .ferrus/tasks/<id>/ (task.json, its STATE.json), a worktree under
# the worktree folder and a branch ferrus/<id>.  The runner removes a merged or cancelled
# task's worktree and branch and keeps a failed one's; whatever a crash, a deleted record
# or a hand-made change left beyond that is found here.

def parallel_task_findings(store):
    """Damaged task records and task states, RUNNING tasks whose worktree is gone,
    leftover worktrees and branches, and a parallel run that stopped part way."""
    findings = []
    records = {}
    for task in queued_task_ids(store):
        record, problem = _read_task_json(store, task)
        records[task] = record
        if problem:
            findings.append(Finding(
                "%s/%s/%s/%s is damaged (%s): the queue cannot tell what became of task %s"
                % (FERRUS_DIR, TASKS_DIR, task, TASK_RECORD_FILE, problem, task),
                "keep it as %s.corrupt-<time> and write a new record from what is left (its "
                "TASK.md, state and worktree)" % TASK_RECORD_FILE,
                lambda task=task: _rebuild_task_record(store, task), severity="warning"))
            continue
        task_store = store.for_task(task)
        if os.path.isfile(task_store.task_path(STATE_FILE)):
            try:
                task_store.read_state()
            except StateCorrupt as err:
                findings.append(Finding(
                    "task %s: %s" % (task, err.message),
                    "keep it as %s.corrupt-<time>%s" % (STATE_FILE, (
                        " and mark the task failed (its worktree is kept for a look)"
                        if record.get("status") in (QUEUED_STATUS, RUNNING_STATUS) else "")),
                    lambda task=task: _rebuild_task_state(store, task), severity="warning"))
    findings.extend(_task_worktree_findings(store, records))
    findings.extend(_parallel_run_findings(store, records))
    return findings


def _read_task_json(store, task):
    """(record, None) or ({}, what is wrong with it), as every reader judges it."""
    return load_task_record(store.dir, task)


def _task_branch_rows(store):
    """(worktree folder, list_task_worktrees rows, problem): the rows are [] without git."""
    try:
        parallel = store.config().parallel
    except FerrusError:
        parallel = ParallelConfig()
    try:
        try:
            folder = default_worktree_dir(store.root, parallel.worktree_dir)
        except GitUnavailable:
            raise
        except FerrusError:            # a refused worktree_dir: _parallel_config_findings says why
            folder = default_worktree_dir(store.root)
        return folder, list_task_worktrees(store.root, TASK_BRANCH_PREFIX), None
    except GitUnavailable:
        return None, [], None
    except FerrusError as err:
        return None, [], err.message


def _task_worktree_findings(store, records):
    folder, rows, problem = _task_branch_rows(store)
    if problem:
        return [Finding("cannot list the task worktrees: %s" % problem,
                        "check the repository with `git worktree list`", severity="warning")]
    findings = []
    try:
        single_task_branch = store.config().git.branch_for
    except FerrusError:
        single_task_branch = GitConfig().branch_for
    for row in rows:
        task = row["branch"][len(TASK_BRANCH_PREFIX):]
        if row["main"] or not _TASK_ID_RE.match(task):
            continue                       # the user's own checkout, or not a task's branch
        record = records.get(task)
        if task in records and not record:
            continue                       # a damaged record: reported above
        path = row["path"]
        if path is not None and not (
                _relative_inside(os.path.realpath(path), folder) not in (None, "")
                or (record and record.get("worktree")
                    and _same_path(path, record["worktree"]))):
            continue                       # checked out by hand somewhere else
        status = record.get("status") if record else None
        if status in (QUEUED_STATUS, RUNNING_STATUS):
            continue                       # in the queue's hands (a gone worktree: below)
        if status == FAILED_STATUS and path is not None and row["exists"]:
            findings.append(Finding(
                "task %s failed; its worktree %s (branch %s) is kept for a look"
                % (task, path, row["branch"]),
                "`ferrus task cancel %s` removes them (`ferrus task retry %s` goes on in "
                "them instead)" % (short_task_id(task), short_task_id(task)), severity="info"))
            continue
        if record is None and path is None and single_task_branch(task) == row["branch"]:
            continue                       # [git] branch made it for a task in the checkout
        findings.append(_orphan_finding(store, task, row, status, folder))
    for task, record in records.items():
        worktree = record.get("worktree")
        if record.get("status") == RUNNING_STATUS and record.get("store") != "project" and \
                worktree and not os.path.isdir(worktree):
            branch = record.get("branch") or TASK_BRANCH_PREFIX + task
            kept = any(row["branch"] == branch for row in rows)
            findings.append(Finding(
                "task %s is running, but its worktree %s is gone: its agents cannot work "
                "and it cannot be merged" % (task, worktree),
                "`ferrus task cancel %s` ends it (and deletes its branch)%s" % (
                    short_task_id(task),
                    "; to keep its commits, first `git branch keep-%s %s`" % (
                        short_task_id(task), branch) if kept else "")))
    return findings


def _orphan_finding(store, task, row, status, folder):
    """A worktree or branch of a task that is merged, cancelled or unknown."""
    why = {None: "no task of the queue is %s" % task, MERGED_STATUS: "task %s is merged" % task,
           UNCHANGED_STATUS: "task %s was approved with no change" % task,
           PUBLISHED_STATUS: "task %s was published as a branch of its remote" % task,
           CANCELLED_STATUS: "task %s was cancelled" % task}.get(
        status, "task %s is %s" % (task, status))
    what = ("worktree %s (branch %s)" % (row["path"], row["branch"]) if row["path"]
            else "branch %s" % row["branch"])
    if row["path"] and not row["exists"]:
        what += ", whose folder is gone,"
    back = " (it was at %s: `git branch %s %s` brings it back)" % (
        row["head"][:12], row["branch"], row["head"][:12]) if row["head"] else ""
    path = row["path"] or os.path.join(folder or store.root, task)
    if status is None and row["path"] and row["exists"]:
        try:
            changed = worktree_changes(task_checkout(store.root, row["path"]),
                                       task_diff_exclusions(store))
        except FerrusError:
            changed = []
        if changed:
            return Finding(
                "leftover %s: %s, and it has uncommitted changes (%s)" % (
                    what, why, ", ".join(map(display_path, changed[:5]))),
                "look at them there; when they are not wanted, `git worktree remove --force "
                "%s` and `git branch -D %s`" % (row["path"], row["branch"]), severity="warning")
    return Finding("leftover %s: %s" % (what, why),
                   "remove %s%s" % ("the worktree and its branch" if row["path"]
                                    else "the branch", back),
                   lambda: remove_task_worktree(store.root, path, row["branch"]),
                   severity="warning")


def _parallel_run_findings(store, records):
    path = store.path(PARALLEL_RUN_FILE)
    if not os.path.exists(path):
        return []
    run, problem = load_parallel_run(store)
    if problem:
        return [Finding("%s/%s is damaged (%s): the next parallel run starts afresh instead "
                        "of going on where the last one stopped" % (
                            FERRUS_DIR, PARALLEL_RUN_FILE, problem),
                        "keep it as %s.corrupt-<time>" % PARALLEL_RUN_FILE,
                        lambda: _set_aside(path), severity="warning")]
    if run.get("ended") or live_parallel_run(store) is not None:
        return []
    target = run.get("target")
    if target:
        try:
            gone = target_head(store.root, target) is None
        except FerrusError:
            gone = False            # no repository, or git could not say
        if gone:
            return [Finding("%s/%s: the parallel run that stopped part way merged into %s, "
                            "which is no branch any more: the next run merges into [parallel] "
                            "target or the branch checked out instead" % (
                                FERRUS_DIR, PARALLEL_RUN_FILE, target),
                            "keep it as %s.corrupt-<time> (the next run then starts afresh)"
                            % PARALLEL_RUN_FILE, lambda: _set_aside(path), severity="warning")]
    where = phase_words(run.get("phase"))
    pending = [task for task, record in records.items()
               if record.get("status") in (QUEUED_STATUS, RUNNING_STATUS)]
    text = "%s/%s: a parallel run (pid %s, last seen %s) stopped while %s, unfinished" % (
        FERRUS_DIR, PARALLEL_RUN_FILE, run.get("pid", "?"), run.get("updated_at", "?"), where)
    if pending:
        return [Finding(text, "nothing to repair: the next `ferrus run --parallel` goes on "
                              "from there with the %d task(s) left" % len(pending),
                        severity="info")]
    return [Finding(text + "; no task is left for it", "delete it",
                    lambda: os.unlink(path), severity="info")]


def _rebuild_task_record(store, task):
    """A task.json set aside, and a new one from what is left: the title from TASK.md,
    the worktree and branch git knows, and a status that loses nothing — queued when
    nothing ever ran, else failed (its worktree is kept for a look)."""
    task_store = store.for_task(task)
    branch = TASK_BRANCH_PREFIX + task
    _, rows, _ = _task_branch_rows(store)
    row = next((r for r in rows if r["branch"] == branch and r["path"]), None)
    started = os.path.isfile(task_store.task_path(STATE_FILE)) or any(
        r["branch"] == branch for r in rows)
    with store.lock():
        path = task_record_path(store.dir, task)
        record, problem = _read_task_json(store, task)
        if not problem:
            return                          # repaired meanwhile
        description = task_store.read_file("TASK.md")
        record = {"id": task, "title": task_title(description) or "(unknown: %s was damaged)"
                  % TASK_RECORD_FILE, "status": QUEUED_STATUS if description and not started
                  else FAILED_STATUS, "origin": {"by": "doctor"}}
        salvaged = _salvaged_task_fields(store, task)
        record.update(salvaged)
        if salvaged.get("status") in SALVAGED_ENDS:
            pass                        # it had ended: nothing of it runs again
        elif record["status"] == FAILED_STATUS:
            record["reason"] = "its %s was damaged; doctor set it aside" % TASK_RECORD_FILE
            record["ended_at"] = format_timestamp(store.clock())
        if started and record.get("store") != "project":
            record.update(branch=branch, store="worktree")
        if row is not None:
            record["worktree"] = row["path"]
        _set_aside(path, pretty_json(record))


# The ends a rebuilt task.json keeps from the damaged one.
SALVAGED_ENDS = (MERGED_STATUS, DONE_STATUS, PUBLISHED_STATUS, CANCELLED_STATUS)


def _salvaged_task_fields(store, task):
    """What a damaged task.json still says that a new record can keep, each field only
    when it is what ferrus writes: when it was queued, its origin (the milestone it
    implements), the agent and model it was given and the race it is an attempt of — and,
    when it had ended (merged, done, published or cancelled), that end: so a merged or
    done task is never run again."""
    try:
        with open(task_record_path(store.dir, task), "rb") as handle:
            damaged = json.loads(handle.read(TASK_RECORD_MAX_BYTES).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(damaged, dict):
        return {}
    keys = ["created_at", "origin", "agent", "model", "race"]
    if damaged.get("status") in SALVAGED_ENDS:
        keys += ["status", "ended_at", "merged_commit", "published", "target", "store",
                 "started_at"]
    kept = {}
    for key in keys:
        if key in damaged and not task_record_problem(
                task, {"status": damaged[key] if key == "status" else QUEUED_STATUS,
                       key: damaged[key]}):
            kept[key] = damaged[key]
    return kept


def _rebuild_task_state(store, task):
    """A task's STATE.json set aside; a task still in the queue's hands is failed (the
    runner keeps its worktree), with a fresh state saying why."""
    task_store = store.for_task(task)
    state_path = task_store.task_path(STATE_FILE)
    reason = "its %s was damaged; doctor kept it as %s.corrupt-<time>" % (STATE_FILE,
                                                                         STATE_FILE)
    def still_damaged():
        try:
            task_store.read_state()
            return False                    # repaired meanwhile
        except StateCorrupt:
            return True
    now = format_timestamp(store.clock())
    fresh = StateData(state=S.FAILED, failure_reason=reason, task_id=task,
                      rev=store.last_journal_seq(), updated_at=now, owner_pid=os.getpid(),
                      state_entered_at=now)
    if not task_store.replace_state(fresh, set_aside="%s.corrupt-%s" % (
            state_path, utc_now().strftime("%Y%m%dT%H%M%S")), only_if=still_damaged):
        return
    with task_store.transaction("doctor") as tx:
        tx.set(tx.state, "doctor", note=reason)
        record = read_task_record(store.dir, task)
        if record.get("status") in (QUEUED_STATUS, RUNNING_STATUS):
            record.update(status=FAILED_STATUS, reason=reason, ended_at=now)
            write_task_record(store, task, record)


def _set_aside(path, replacement=None):
    """Rename a damaged file to <name>.corrupt-<time> (nothing is deleted), and write
    ``replacement`` in its place when there is one."""
    os.replace(path, "%s.corrupt-%s" % (path, utc_now().strftime("%Y%m%dT%H%M%S")))
    if replacement is not None:
        atomic_write(path, replacement)


def config_findings(root):
    """Every problem in ferrus.toml, each once: errors in any table, a bad [hq], unknown
    keys, and an empty [checks] (then the check gate passes every submission)."""
    problems = []
    try:
        config = parse_config(read_text(os.path.join(root, CONFIG_FILE)), CONFIG_FILE, problems)
    except FerrusError as err:          # not valid TOML: nothing else can be checked
        return [Finding(err.message, err.hint or "fix ferrus.toml")]
    findings = [Finding(err.message, err.hint or "fix ferrus.toml") for err in problems]
    findings.extend(Finding(err.message, err.hint or "fix [hq] in ferrus.toml")
                    for err in config.hq_problems)
    if not config.hq_problems:
        for role in ROLES:
            for text, hint in permission_warnings(config, role):
                findings.append(Finding(text, hint, severity="warning"))
    findings.extend(Finding(problem, hint) for problem, hint in nano_settings_findings(config))
    for key in dict.fromkeys(config.unknown_keys):
        findings.append(Finding("%s: unknown key %s (ignored)" % (CONFIG_FILE, key),
                                "check its spelling against docs/REFERENCE.md, section "
                                "ferrus.toml", severity="warning"))
    if not any(problem.message.startswith("%s: [checks" % CONFIG_FILE) for problem in problems) \
            and not config.checks.commands:
        findings.append(Finding(NO_CHECKS_WARNING, NO_CHECKS_HINT, severity="warning"))
    for command in config.checks.commands:
        for program in missing_check_programs(root, command):
            findings.append(Finding(
                "%s: [checks] command `%s` runs %s, which is not found (%s): the check gate "
                "would fail every time, and `ferrus run` stops before any agent starts" % (
                    CONFIG_FILE, command, program, "no such file in the project"
                    if "/" in program else "not on PATH"),
                "install %s, or fix the command in [checks] of %s" % (program, CONFIG_FILE)))
    if not any(problem.message.startswith("%s: [parallel" % CONFIG_FILE)
               for problem in problems):
        findings.extend(_parallel_config_findings(root, config.parallel))
    return findings


def _parallel_config_findings(root, parallel):
    """What `ferrus run --parallel` would refuse in [parallel], found by the same checks:
    a worktree_dir inside the repository (not git-ignored, the repository itself, its
    .git folder) and a target branch that does not exist.  An error when max_tasks makes
    every `ferrus run` parallel, else a warning (only --parallel N would refuse)."""
    severity = "error" if parallel.max_tasks > 1 else "warning"
    findings = []
    try:
        default_worktree_dir(root, parallel.worktree_dir)
    except GitUnavailable:
        return findings             # no repository: nothing to check against
    except FerrusError as err:
        findings.append(Finding("%s (`ferrus run --parallel` refuses it)" % err.message,
                                err.hint or "fix [parallel] worktree_dir in ferrus.toml",
                                severity=severity))
    if parallel.target:
        try:
            head = target_head(root, parallel.target)
        except FerrusError:
            head = ""               # git could not say: not reported as missing
        if head is None:
            findings.append(Finding(
                "%s: [parallel] target = %s names no branch of the repository "
                "(`ferrus run --parallel` refuses it)" % (CONFIG_FILE,
                                                          json.dumps(parallel.target)),
                "create the branch, or set target to an existing one (\"\" = the branch "
                "checked out)", severity=severity))
    return findings


def spec_findings(root):
    """Milestones whose ``Depends on:`` names no milestone of their spec: the picker
    ignores such a dependency (a typo would otherwise block the milestone for ever), so
    the milestone may be taken before the work it was meant to wait for."""
    findings = []
    try:
        paths = list_spec_paths(root, load_config(root))
    except (FerrusError, OSError):      # config_findings reports a bad [spec]
        return findings
    for rel in paths:
        try:
            milestones = parse_spec(read_text(os.path.join(root, rel)))
        except (OSError, UnicodeDecodeError):
            continue
        known = {m.marker for m in milestones} | {m.id for m in milestones}
        for milestone in milestones:
            unknown = [dep for dep in milestone.depends_on if dep not in known]
            if unknown:
                findings.append(Finding(
                    "%s: milestone %s depends on %s, which no milestone of this spec is "
                    "(ignored: it does not wait for %s)" % (
                        rel, milestone.marker, ", ".join(unknown),
                        "it" if len(unknown) == 1 else "them"),
                    "name existing markers or ids in its `Depends on:` line (e.g. #1.0, "
                    "m1.0), or `none`", severity="warning"))
    return findings


def _journal_findings(store, data):
    findings = []
    path = store.journal_path()
    if not os.path.exists(path):
        return [Finding("%s/%s is missing" % (FERRUS_DIR, JOURNAL_FILE),
                        "create it (history before now is gone)",
                        lambda: atomic_write(path, ""))]
    # One pass in constant memory: a rotated journal is bounded, a hand-made one may not be.
    bad_count, bad_lines, gaps, previous = 0, [], [], None
    for number, line in enumerate(_lines_forward(path), 1):
        if line is not None and not line.strip():
            continue
        entry = journal_entry(line.decode("utf-8", "replace")) if line is not None else None
        if entry is None:           # torn, hand-edited, or longer than any real line
            bad_count += 1
            if len(bad_lines) < 5:
                bad_lines.append(number)
            continue
        seq = entry["seq"]
        # A journal_gap entry stands for the seqs from detail.from up to its own.
        first = seq
        if entry.get("event") == JOURNAL_GAP_EVENT:
            gap_from = (entry.get("detail") or {}).get("from")
            if isinstance(gap_from, int) and not isinstance(gap_from, bool):
                first = gap_from
        if previous is not None and first != previous + 1 and len(gaps) < 5:
            gaps.append(seq)
        previous = seq
    if bad_count:
        findings.append(Finding(
            "%s/%s has %d unreadable line(s) (line %s) — usually a write cut short by a crash"
            % (FERRUS_DIR, JOURNAL_FILE, bad_count, ", ".join(map(str, bad_lines))),
            "drop those lines", lambda: _rewrite_journal(store)))
    if gaps:
        findings.append(Finding("journal sequence is not gapless (next after a gap: %s)"
                                % ", ".join(map(str, gaps[:5])),
                                "renumbering would break history; nothing to fix automatically",
                                severity="warning"))
    if data is not None:
        last = store.last_journal_seq()      # the archive's, right after a rotation
        if last < data.rev:
            findings.append(Finding(
                "STATE.json is at rev %d but the journal ends at seq %d: %d transition(s) were "
                "committed without a journal line (a crash between the two writes, or an "
                "emptied events.jsonl)" % (data.rev, last, data.rev - last),
                "record them as one journal_gap entry so seq matches rev again",
                lambda: _fill_journal(store)))
        elif last > data.rev:
            findings.append(Finding(
                "the journal (seq %d) is ahead of STATE.json (rev %d) — STATE.json was restored "
                "or hand-edited" % (last, data.rev),
                "raise STATE.json's rev to %d" % last, lambda: _bump_rev(store, last)))
    return findings


def _content_findings(store, data):
    findings = []
    expect = {S.REVIEWING: "SUBMISSION.md", S.AWAITING_CONFIRMATION: "SUBMISSION.md",
              S.AWAITING_HUMAN: "QUESTION.md",
              S.CONSULTATION: "CONSULT_REQUEST.md", S.EXECUTING: "TASK.md",
              S.ADDRESSING: "REVIEW.md"}
    name = expect.get(data.state)
    if name and not store.read_file(name).strip():
        findings.append(Finding("state is %s but %s/%s is empty" % (data.state, FERRUS_DIR, name),
                                "the agents will lack context; `ferrus reset` starts over",
                                severity="warning"))
    if data.state == S.AWAITING_HUMAN and data.paused_state is None:
        findings.append(Finding("state is AwaitingHuman but paused_state is missing, so an answer "
                                "would return to Idle", "`ferrus reset` starts over",
                                severity="warning"))
    return findings


def _rebuild_state(store):
    now = utc_now()
    fresh = StateData(rev=store.last_journal_seq(), updated_at=format_timestamp(now),
                      owner_pid=os.getpid(), state_entered_at=format_timestamp(now))
    store.replace_state(fresh, set_aside=store.path(STATE_FILE) + ".corrupt-" +
                        now.strftime("%Y%m%dT%H%M%S"))


def _rewrite_journal(store):
    """Keep the readable lines, streamed through a temporary file (never all in memory)."""
    path = store.journal_path()
    with store.lock():
        fd, temp = tempfile.mkstemp(prefix="." + JOURNAL_FILE + ".", suffix=TEMP_SUFFIX,
                                    dir=store.dir)
        try:
            with os.fdopen(fd, "wb") as out:
                for line in _lines_forward(path):
                    if line is not None and journal_entry(
                            line.decode("utf-8", "replace")) is not None:
                        out.write(line.rstrip(b"\r") + b"\n")
                out.flush()
                os.fsync(out.fileno())
            with contextlib.suppress(OSError):
                os.chmod(temp, os.stat(path).st_mode & 0o7777)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        fsync_directory(store.dir)


def _fill_journal(store):
    with store.transaction("doctor") as tx:
        tx.set(tx.state, "doctor", note="journal reconciled with STATE.json")


def _bump_rev(store, last):
    data = store.read_state()
    data.rev = last
    store.replace_state(data)
