"""Store: .ferrus/ — transactions, the journal, the lock, task records.

Every mutation is a transaction: the project lock, STATE.json read, a pure
transition applied, content files written first and STATE.json last (the commit
point), one journal line appended.  A parallel task's store keeps its state in
.ferrus/tasks/<id>/ and shares the project's lock and journal."""

import contextlib
import itertools
import json
import os
import time

from .basics import (FerrusError, LazyPattern, compact_json, deferred_dataclass,
                     format_timestamp, log, terminal_safe, utc_now)
from .system import (FileLock, UnsafePath, atomic_write, fsync_directory, open_inside,
                     read_text)
from .config import ConfigCache, LeaseConfig, git_branch_name_problem
from .task_machine import ACTIVE_STATES, LEASE_SIGHTINGS, StateData
from .session_machine import CONTINUE


FERRUS_DIR = ".ferrus"
STATE_FILE = "STATE.json"
LOCK_FILE = "STATE.lock"
JOURNAL_FILE = "events.jsonl"
JOURNAL_ARCHIVE_FILE = "events.jsonl.1"    # what the last rotation moved aside
JOURNAL_GAP_EVENT = "journal_gap"          # one entry for seqs whose lines are lost
# events.jsonl is rotated when a line would take it past this size (FERRUS_JOURNAL_MAX_BYTES).
JOURNAL_MAX_BYTES = 16 * 1024 * 1024


def journal_max_bytes():
    value = os.environ.get("FERRUS_JOURNAL_MAX_BYTES", "")
    try:
        return max(1024, int(value)) if value.strip() else JOURNAL_MAX_BYTES
    except ValueError:
        log.warning("FERRUS_JOURNAL_MAX_BYTES=%r is not a number of bytes; using %d",
                    value, JOURNAL_MAX_BYTES)
        return JOURNAL_MAX_BYTES


# A journal line longer than this is damage (ferrus writes lines of a few hundred bytes):
# readers skip it without ever holding it in memory.
JOURNAL_LINE_LIMIT = 16 * 1024 * 1024


def _lines_backwards(path, chunk=4096, limit=None):
    """The lines of a file (bytes, without their newline) from the last to the first,
    read in chunks from the end that grow up to 1 MiB (most callers want only the
    last few lines).  Lines longer than ``limit`` are skipped.  A missing file has none."""
    limit = JOURNAL_LINE_LIMIT if limit is None else limit
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return
    with handle:
        position = handle.seek(0, os.SEEK_END)
        rest = b""
        skipping = False                 # inside a line already known to be too long
        while position > 0:
            start = max(0, position - chunk)
            handle.seek(start)
            data = handle.read(position - start) + rest
            position = start
            chunk = min(chunk * 4, 1 << 20)
            lines = data.split(b"\n")
            if skipping:
                if len(lines) == 1:
                    continue             # still inside the long line
                lines.pop()              # its first part; what precedes it is whole again
                skipping = False
            rest = lines[0]              # may continue in the chunk before this one
            for line in reversed(lines[1:]):
                yield line
            if len(rest) > limit:
                rest, skipping = b"", True
        if not skipping:
            yield rest


def _lines_forward(path, limit=None):
    """The lines of a file (bytes, without their newline) from the first; a line longer
    than ``limit`` comes as None, read past in bounded pieces."""
    limit = JOURNAL_LINE_LIMIT if limit is None else limit
    with open(path, "rb") as handle:
        while True:
            line = handle.readline(limit + 1)
            if not line:
                return
            if len(line) > limit and not line.endswith(b"\n"):
                while True:
                    more = handle.readline(1 << 20)
                    if not more or more.endswith(b"\n"):
                        break
                yield None
                continue
            yield line[:-1] if line.endswith(b"\n") else line


def _end_of_complete_lines(handle, size, chunk=65536):
    """The offset just past the last newline in an open binary file (0 for none)."""
    position = size
    while position > 0:
        start = max(0, position - chunk)
        handle.seek(start)
        data = handle.read(position - start)
        newline = data.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        position = start
    return 0
CONTENT_FILES = ("TASK.md", "REVIEW.md", "SUBMISSION.md", "QUESTION.md", "ANSWER.md",
                 "CONSULT_REQUEST.md", "CONSULT_RESPONSE.md", "LAST_SPEC_PATH")
# Files that a new task, a reset or HQ's force-reset empty.
TASK_SCRATCH_FILES = ("SUBMISSION.md", "CONSULT_REQUEST.md", "CONSULT_RESPONSE.md",
                      "REVIEW.md", "QUESTION.md", "ANSWER.md")
# The reviewer's notes on an approval, for the human who confirms it ([hq] human_review).
# Not one of CONTENT_FILES: a .ferrus/ from before it existed, or upstream's, lacks it and
# is still complete; it is emptied with the task's other files only where it exists.
APPROVAL_FILE = "APPROVAL.md"
# Every file that belongs to a task (in .ferrus/tasks/<id>/ for a parallel one).
TASK_FILES = frozenset(CONTENT_FILES + (APPROVAL_FILE, STATE_FILE))


@deferred_dataclass
class Commit:
    """What one transaction changed, as the journal records it."""

    seq: int
    time: str
    actor: str
    event: str
    from_state: str
    to_state: str
    task_id: "str | None"
    detail: dict

    def to_json(self):
        return {"seq": self.seq, "time": self.time, "actor": self.actor, "event": self.event,
                "from": self.from_state, "to": self.to_state, "task_id": self.task_id,
                "detail": self.detail}


_JOURNAL_TEXT_FIELDS = ("time", "actor", "event", "from", "to", "task_id")


def journal_entry(line):
    """One journal line as a dict with an integer seq, or None when it is not one
    (a write cut short by a crash, or a hand edit)."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict):
        return None
    seq = entry.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int):
        return None
    if not isinstance(entry.get("detail", {}), dict) or not all(
            isinstance(entry.get(key), (str, type(None))) for key in _JOURNAL_TEXT_FIELDS):
        return None
    return entry


# What a content file holds, for messages about the text written to it.
_CONTENT_FILE_WORDS = {"TASK.md": "the task description", "REVIEW.md": "the review notes",
                       "SUBMISSION.md": "the submission", "QUESTION.md": "the question",
                       "ANSWER.md": "the answer", "CONSULT_REQUEST.md": "the consultation",
                       "CONSULT_RESPONSE.md": "the consultation's answer"}
# A lone surrogate: what Python makes of a byte that is not UTF-8 in a command-line
# argument or a line read from a terminal (and of a "\udcff" JSON escape).
_LONE_SURROGATE = LazyPattern("[\ud800-\udfff]")


def require_utf8(text, what):
    """FerrusError unless ``text`` can be written as UTF-8 (no lone surrogate)."""
    bad = _LONE_SURROGATE.search(text) if isinstance(text, str) else None
    if bad:
        code = ord(bad.group())
        raise FerrusError("%s is not valid UTF-8: it holds %s at character %d" % (
            what, "the byte 0x%02x" % (code - 0xdc00) if 0xdc80 <= code <= 0xdcff
            else "an unpaired surrogate U+%04X" % code, bad.start() + 1),
            "write it in UTF-8 (a terminal or a file in another encoding passes other "
            "bytes); nothing was changed")
    return text


class Transaction:
    """The working copy inside ``Store.transaction``: read the state, stage changes.

    Nothing touches the disk until the ``with`` block ends without an exception;
    then content files are written first and STATE.json last (the commit point),
    and one journal line follows."""

    def __init__(self, store, actor, before):
        self.store = store
        self.actor = actor
        self.before = before
        self.state = before.copy()
        self.files = {}
        self.event = None
        self.detail = {}
        self.committed = None   # the Commit, once the block has ended
        self.rotate_journal = False     # start a new events.jsonl with this commit's line
        self.journal_task_id = None     # the task the entry is about, when not the state's
        self.rotated_journal = False    # whether the commit did

    def read(self, name):
        """A content file as this transaction will leave it."""
        if name in self.files:
            return self.files[name]
        return self.store.read_file(name)

    def write(self, name, text):
        # Refused before anything is written: the commit would fail half-way.
        require_utf8(text, _CONTENT_FILE_WORDS.get(name, "the text for %s/%s" % (
            FERRUS_DIR, name)))
        self.files[name] = text

    def set(self, state, event, **detail):
        """Stage the new state and name the event the journal will record."""
        self.state = state
        self.event = event
        self.detail.update(detail)


# Parallel tasks (see ARCHITECTURE.md, 'Parallel tasks') live in .ferrus/tasks/<id>/: the
# queue's record of the task (task.json), its STATE.json and its content files.
TASKS_DIR = "tasks"
TASK_RECORD_FILE = "task.json"
# A parallel task's branch is this + its id (doctor finds leftovers by it).
TASK_BRANCH_PREFIX = "ferrus/"
QUEUED_STATUS, RUNNING_STATUS, MERGED_STATUS, DONE_STATUS, FAILED_STATUS, CANCELLED_STATUS = (
    "queued", "running", "merged", "done", "failed", "cancelled")
# Approved, but its work changed nothing: there was nothing to merge (or commit).
UNCHANGED_STATUS = "unchanged"
# Approved and through the merge gate, its branch pushed for the team's pull request
# ([git] publish = "branch"): the target itself was not moved.
PUBLISHED_STATUS = "published"
TASK_STATUSES = (QUEUED_STATUS, RUNNING_STATUS, MERGED_STATUS, DONE_STATUS, UNCHANGED_STATUS,
                 PUBLISHED_STATUS, FAILED_STATUS, CANCELLED_STATUS)
# Statuses of an approved task.
APPROVED_STATUSES = (MERGED_STATUS, DONE_STATUS, UNCHANGED_STATUS, PUBLISHED_STATUS)
# Statuses of a task that no orchestrator will take up again.
ENDED_STATUSES = APPROVED_STATUSES + (FAILED_STATUS, CANCELLED_STATUS)
# The order statuses are counted and listed in.
TASK_STATUS_ORDER = (RUNNING_STATUS, QUEUED_STATUS) + ENDED_STATUSES
# How a status reads where it is not the status word itself.
TASK_STATUS_WORDS = {UNCHANGED_STATUS: "approved (no change)"}
# The project's STATE.json names the parallel task it mirrors under this additive key.
PARALLEL_MIRROR_KEY = "mirrors_task"
# What the project's STATE.json keeps for itself while it mirrors a task: the
# supervisor's selection and a capacity checkpoint belong to the project, not a task.
_PROJECT_STATE_FIELDS = ("selected_spec", "selected_milestone", "pending_task_spec",
                         "pending_task_milestone")
_PROJECT_EXTRA_KEYS = ("capacity_checkpoint", PARALLEL_MIRROR_KEY)


def _task_part(data):
    """``data`` without what belongs to the project (for comparing a task's state)."""
    part = data.copy()
    for name in _PROJECT_STATE_FIELDS:
        setattr(part, name, None)
    for key in _PROJECT_EXTRA_KEYS:
        part.extra.pop(key, None)
    return part


def _mirror(project, state, task):
    """The project's STATE.json after a commit of parallel task ``task``: a copy of the
    task's state while it is the foreground task (it was, or the project's own state is
    not in flight), else the project's state as it was; with the new rev either way."""
    if project.extra.get(PARALLEL_MIRROR_KEY) == task or project.state not in ACTIVE_STATES:
        out = state.copy()
        for name in _PROJECT_STATE_FIELDS:
            setattr(out, name, getattr(project, name))
        for key in _PROJECT_EXTRA_KEYS:
            out.extra.pop(key, None)
            if key in project.extra:
                out.extra[key] = project.extra[key]
        out.extra[PARALLEL_MIRROR_KEY] = task
    else:
        out = project.copy()
        out.updated_at, out.owner_pid = state.updated_at, state.owner_pid
    out.rev = state.rev
    return out


def task_record_path(ferrus_dir, task):
    return os.path.join(ferrus_dir, TASKS_DIR, task, TASK_RECORD_FILE)


def read_task_record(ferrus_dir, task):
    """A parallel task's queue record (task.json) as a dict; {} when missing or damaged
    (load_task_record says what is wrong; doctor reports and repairs it)."""
    return load_task_record(ferrus_dir, task)[0]


# What task.json may hold; a record that breaks any of it is damaged as a whole, so no
# reader ever meets a field of the wrong type (a list for a status, a number for a path).
TASK_RECORD_MAX_BYTES = 1 << 20
TASK_RECORD_TEXT_CHARS = 64 * 1024
_TASK_RECORD_TEXT = ("id", "title", "created_at", "started_at", "ended_at", "agent",
                     "worktree", "workdir", "branch", "base", "target", "conflict_base",
                     "reason", "merged_commit", "store", "resume_from", "place")
_TASK_RECORD_COMMITS = ("base", "conflict_base", "merged_commit", "resume_from")
_COMMIT_ID_RE = LazyPattern(r"[0-9a-f]{4,64}")


class TaskRecordDamaged(FerrusError):
    """A task.json that is unreadable or holds what ferrus never writes; nothing is
    written over it (doctor sets it aside and writes a new one)."""

    def __init__(self, task, problem):
        self.task, self.problem = task, problem
        super().__init__("task %s: its %s/%s/%s/%s is damaged (%s)" % (
            task, FERRUS_DIR, TASKS_DIR, task, TASK_RECORD_FILE, problem),
            "`ferrus doctor --fix` keeps it as %s.corrupt-<time> and writes a new record "
            "from what is left (a task that had started becomes failed, its worktree kept: "
            "`ferrus task retry` goes on with it)" % TASK_RECORD_FILE)


def damaged_task_note(task, problem):
    """What a run says once about a task whose task.json is damaged."""
    err = TaskRecordDamaged(task, problem)
    return "%s — this run leaves the task alone\nhint: %s" % (err.message, err.hint)


def load_task_record(ferrus_dir, task):
    """(task.json as a dict, None), or ({}, what is wrong with it); ({}, None) when the
    task has no record."""
    try:
        with open_inside(os.path.join(ferrus_dir, TASKS_DIR, task), TASK_RECORD_FILE) as handle:
            raw = handle.read(TASK_RECORD_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}, None
    except (OSError, UnsafePath) as err:
        return {}, "it cannot be read: %s" % (getattr(err, "strerror", None) or err)
    if len(raw) > TASK_RECORD_MAX_BYTES:
        return {}, "it is larger than %d MiB" % (TASK_RECORD_MAX_BYTES >> 20)
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError as err:
        return {}, "not valid JSON: %s" % terminal_safe(str(err))[:120]
    problem = task_record_problem(task, record)
    return ({}, problem) if problem else (record, None)


def task_record_problem(task, record):
    """What is wrong with ``record`` as task ``task``'s task.json, or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("status") not in TASK_STATUSES:
        return "status %s is none of %s" % (_shown(record.get("status")),
                                            ", ".join(TASK_STATUSES))
    for key in _TASK_RECORD_TEXT:
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            return "%s is %s, not text" % (key, _shown(value))
        if value is not None and len(value) > TASK_RECORD_TEXT_CHARS:
            return "%s is %d characters long" % (key, len(value))
    if record.get("id") is not None and record["id"] != task:
        return "id %s is not the task's own" % _shown(record["id"])
    if record.get("store") not in (None, "worktree", "project", "place"):
        return "store %s is none of worktree, project, place" % _shown(record["store"])
    for key in ("worktree", "workdir"):
        if record.get(key) is not None and not os.path.isabs(record[key]):
            return "%s %s is no absolute path" % (key, _shown(record[key]))
    worktree, workdir = record.get("worktree"), record.get("workdir")
    if workdir is not None and not (worktree and _path_within(workdir, worktree)):
        return "workdir %s is not inside its worktree" % _shown(workdir)
    if record.get("branch") is not None and record["branch"] != TASK_BRANCH_PREFIX + task:
        return "branch %s is not the task's branch %s" % (_shown(record["branch"]),
                                                           TASK_BRANCH_PREFIX + task)
    if record.get("target") is not None and git_branch_name_problem(record["target"]):
        return "target %s is no branch name" % _shown(record["target"])
    for key in _TASK_RECORD_COMMITS:
        if record.get(key) is not None and not _COMMIT_ID_RE.fullmatch(record[key]):
            return "%s %s is no commit id" % (key, _shown(record[key]))
    problem = _objects_problem(record, (
        ("origin", {"spec": str, "milestone": str, "by": str, "delegated_by": str}),
        ("integration", {"candidate": str, "target_head": str}),
        ("saved", {"ref": str, "commit": str})))
    if problem:
        return problem
    if record.get("discard") not in (None, True, False):
        return "discard is %s, not true or false" % _shown(record["discard"])
    conflicts = record.get("conflicts")
    if conflicts is not None and not (isinstance(conflicts, list) and
                                      all(isinstance(path, str) for path in conflicts)):
        return "conflicts is %s, not a list of paths" % _shown(conflicts)
    if record["status"] == RUNNING_STATUS and record.get("store") == "place" and \
            not record.get("place"):
        return "it is running at a place but names none"
    if record["status"] == RUNNING_STATUS and record.get("store") == "worktree" and not (
            record.get("worktree") and record.get("branch")):
        return "it is running in a worktree but names no %s" % (
            "worktree" if not record.get("worktree") else "branch")
    return _workflow_record_problem(record)


def _objects_problem(record, shapes):
    """What is wrong with the object fields of a task.json ``shapes`` names ((key,
    {field: str or int}), in order), or None: each an object, each field of its kind."""
    for key, kinds in shapes:
        value = record.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            return "%s is %s, not an object" % (key, _shown(value))
        for name, kind in kinds.items():
            item = value.get(name)
            if item is not None and (not isinstance(item, kind) or isinstance(item, bool)):
                return "%s.%s is %s, not %s" % (key, name, _shown(item),
                                                "text" if kind is str else "a number")
    return None


def _workflow_record_problem(record):
    """What is wrong with the bootstrap, remote and race fields of a task.json (see
    bootstrap.py, remote.py, race.py), or None."""
    copied = record.get("copied")
    if copied is not None and not (isinstance(copied, list) and all(
            isinstance(path, str) and path for path in copied)):
        return "copied is %s, not a list of paths" % _shown(copied)
    port = record.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or
                             not 0 < port < 65536):
        return "port is %s, not a port number" % _shown(port)
    problem = _objects_problem(record, (
        ("race", {"id": str, "attempt": int, "of": int}),
        ("push", {"remote": str, "status": str, "reason": str}),
        ("published", {"remote": str, "branch": str, "commit": str, "pull_request": str})))
    if problem:
        return problem
    for key in ("model", "lost_to"):
        if record.get(key) is not None and not isinstance(record[key], str):
            return "%s is %s, not text" % (key, _shown(record[key]))
    return None


def _path_within(path, folder):
    """Whether ``path`` is ``folder`` or inside it, by their text (no file is looked at)."""
    try:
        rel = os.path.relpath(os.path.normpath(path), os.path.normpath(folder))
    except ValueError:                  # Windows: on another drive
        return False
    return rel == os.curdir or not (rel == os.pardir or rel.startswith(os.pardir + os.sep))


def _shown(value):
    """A value of a damaged record, short enough for a message."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return terminal_safe(text if len(text) <= 40 else text[:37] + "...")


class JournalWriteError(FerrusError, OSError):
    """STATE.json was committed but its journal line could not be written (still an
    OSError for callers that catch those)."""


class Store:
    """The project's ``.ferrus/`` directory: state, content files, journal, lock.

    With ``task`` it is the store of one of the parallel tasks (see ARCHITECTURE.md,
    'Parallel tasks'): STATE.json and the content files live in ``.ferrus/tasks/<id>/``
    and the code it works on in the task's worktree (``workdir``), while the lock, the
    journal, the sessions and the logs stay the project's.  A task's commit also writes
    the project's STATE.json: its rev is the journal's seq for every task (so seq == rev
    still holds project-wide and every waiter wakes), and while that task is in the
    foreground the file mirrors its state, for upstream's readers and the status line."""

    def __init__(self, root, clock=utc_now, lock_timeout=None, monotonic=time.monotonic,
                 task=None):
        self.root = os.path.abspath(root)
        self.dir = os.path.join(self.root, FERRUS_DIR)
        self.clock = clock              # wall clock: timestamps written to files
        self.monotonic = monotonic      # for durations: leases honoured, waits
        self.lock_timeout = lock_timeout if lock_timeout is not None else float(
            os.environ.get("FERRUS_LOCK_TIMEOUT", "10"))
        self.config_cache = ConfigCache(self.root)
        self.task = task
        self.task_dir = self.dir if task is None else os.path.join(self.dir, TASKS_DIR, task)
        self._workdir = None if task is not None else self.root

    def for_task(self, task):
        """The store of one parallel task of this project (same clocks and lock)."""
        store = Store(self.root, self.clock, self.lock_timeout, self.monotonic, task=task)
        store.config_cache = self.config_cache
        return store

    @property
    def workdir(self):
        """Where the task's code is: its worktree for a parallel task, else the project."""
        if self._workdir is None:
            record, problem = load_task_record(self.dir, self.task)
            if problem:
                # Never the project's checkout instead: the task's agents and checks
                # would work there.
                raise TaskRecordDamaged(self.task, problem)
            worktree = record.get("workdir") or record.get("worktree")
            if record.get("store") == "place" and not worktree:
                # Its code is at a place (places.py): here it has no folder, and never
                # the project's checkout instead.
                worktree = os.path.join(self.task_dir, "at-place")
            self._workdir = worktree if isinstance(worktree, str) and worktree else self.root
        return self._workdir

    # -- paths and plain reads ------------------------------------------------

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def task_path(self, name):
        """A file of the task: STATE.json or a content file (TASK.md, ...)."""
        return os.path.join(self.task_dir, name)

    def relpath(self, path):
        rel = os.path.relpath(path, self.root)
        return rel.replace(os.sep, "/")

    def exists(self):
        return os.path.isfile(self.task_path(STATE_FILE))

    def require(self):
        if not os.path.isdir(self.dir):
            raise FerrusError("no %s/ directory in %s" % (FERRUS_DIR, self.root),
                              "run `ferrus init` in the project root first")
        if not os.path.isfile(self.path(STATE_FILE)):
            raise FerrusError("cannot read %s/%s — it is missing" % (FERRUS_DIR, STATE_FILE),
                              "run `ferrus init` (it recreates missing files and keeps the rest)")
        if self.task is not None and not self.exists():
            raise FerrusError("task %s has no state: it is queued, or not a task of this "
                              "project" % self.task, "`ferrus tasks` lists the tasks")
        return self

    def config(self):
        return self.config_cache.get()

    # -- leases, judged by this process's own monotonic clock -------------------

    def lease_seconds_left(self, data):
        """How much longer this process honours ``data``'s lease (0.0: free)."""
        try:
            ttl = self.config().lease.ttl_secs
        except FerrusError:
            ttl = LeaseConfig().ttl_secs
        return LEASE_SIGHTINGS.seconds_left(self.task_dir, data, self.clock(), self.monotonic, ttl,
                                            self._state_written_age)

    def lease_live(self, data):
        return self.lease_seconds_left(data) > 0

    def _state_written_age(self):
        """Real seconds since STATE.json was last written, by the file system's clock."""
        try:
            return max(0.0, time.time() - os.stat(self.task_path(STATE_FILE)).st_mtime)
        except OSError:
            return 0.0

    def read_state(self):
        """The committed state.  Safe without the lock: STATE.json is only ever replaced."""
        self.require()
        return self.continue_journal(StateData.from_json(
            read_text(self.task_path(STATE_FILE)), self.relpath(self.task_path(STATE_FILE))))

    def continue_journal(self, data):
        """A STATE.json without ``rev`` was last written by upstream ferrus (which knows
        no journal) or never written at all: its revision is where the journal ends, so
        the next commit continues the journal instead of looking like a restored file."""
        if data.rev == 0:
            data.rev = self.last_journal_seq()
        return data

    def read_file(self, name):
        """A content file's text ("" when missing); never through a symbolic link."""
        try:
            with open_inside(self.task_dir, name) as handle:
                return handle.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def state_stamp(self):
        """A cheap fingerprint that changes on every commit.

        STATE.json's inode, mtime and size alone could repeat on a filesystem with
        coarse timestamps (inodes are reused, sizes often equal); the journal grows
        one line per commit, and a rotation gives it a new inode, so its inode and
        size make the stamp strictly new."""
        try:
            st = os.stat(self.path(STATE_FILE))
        except FileNotFoundError:
            return None
        try:
            journal = os.stat(self.journal_path())
            journal = (journal.st_ino, journal.st_size)
        except FileNotFoundError:
            journal = -1
        return (st.st_ino, st.st_mtime_ns, st.st_size, journal)

    # -- transactions -----------------------------------------------------------

    def lock(self):
        return FileLock(self.path(LOCK_FILE), self.lock_timeout, FERRUS_DIR + "/" + LOCK_FILE)

    @contextlib.contextmanager
    def transaction(self, actor):
        """Read-modify-write of ``.ferrus/`` under the exclusive STATE.lock."""
        self.require()
        with self.lock():
            before = self.read_state()
            tx = Transaction(self, actor, before)
            yield tx
            if tx.event is not None:
                tx.committed = self._commit(tx)

    def _commit(self, tx):
        now = self.clock()
        for name, text in tx.files.items():
            path = self.task_path(name)
            # Clearing an already empty file is common (create_task, reset); an
            # unchanged file needs no write and no fsync.
            if read_text(path, default="\0") != text:
                atomic_write(path, text)
        state = tx.state.copy()
        if self.task is None and tx.before.extra.get(PARALLEL_MIRROR_KEY) and \
                _task_part(state) != _task_part(tx.before):
            if tx.before.state in ACTIVE_STATES:
                raise FerrusError(
                    "%s/%s mirrors task %s, which runs in its own worktree; its state "
                    "changes only through that task" % (
                        FERRUS_DIR, STATE_FILE, tx.before.extra[PARALLEL_MIRROR_KEY]),
                    "agents of a parallel task are started by `ferrus run --parallel` or HQ; "
                    "`ferrus task cancel ID` drops one")
            # The mirrored task has ended: a task of the project's own takes the file over
            # (a reset's fresh state has no mirror key to drop).
            state.extra.pop(PARALLEL_MIRROR_KEY, None)
        if self.task is None:
            state.rev = tx.before.rev + 1
            project = None
        else:
            # The project's STATE.json numbers every commit of every task: it is written
            # first (a crash after it leaves a gap the next commit records, never a seq
            # used twice), the task's own file second, the journal line last.
            project = self.project_state()
            state.rev = project.rev + 1
        state.updated_at = format_timestamp(now)
        state.owner_pid = os.getpid()
        if state.state != tx.before.state and state.state_entered_at == tx.before.state_entered_at:
            state.state_entered_at = format_timestamp(now)
        if project is not None:
            atomic_write(self.path(STATE_FILE), _mirror(project, state, self.task).to_json())
        atomic_write(self.task_path(STATE_FILE), state.to_json())
        commit = Commit(seq=state.rev, time=state.updated_at, actor=tx.actor, event=tx.event,
                        from_state=tx.before.state.value, to_state=state.state.value,
                        task_id=state.task_id if tx.journal_task_id is None
                        else tx.journal_task_id or None, detail=tx.detail)
        try:
            tx.rotated_journal = self._append_journal(commit, state.rev,
                                                      rotate=tx.rotate_journal)
        except OSError as err:
            raise JournalWriteError(
                "%s was committed to STATE.json (rev %d), but its journal line could not be "
                "written: %s" % (tx.event, state.rev, err.strerror or err),
                "free space or fix permissions, then run `ferrus doctor --fix` to add the "
                "missing journal entry") from err
        return commit

    # -- writing STATE.json outside a transition (the Store is its only writer) ---------

    def create_state(self, data=None):
        """Write this store's first STATE.json (``data``, else a fresh Idle state) when
        there is none; an existing one is left as it is.  True when it was written."""
        path = self.task_path(STATE_FILE)
        if os.path.exists(path):
            return False
        if data is None:
            now = format_timestamp(self.clock())
            data = StateData(updated_at=now, owner_pid=os.getpid(), state_entered_at=now)
        atomic_write(path, data.to_json())
        return True

    def replace_state(self, data, set_aside=None, only_if=None):
        """Repair: write ``data`` as STATE.json under the lock, no transition and no
        journal line (doctor does this for a file that cannot be read, or whose rev
        must follow the journal).  ``set_aside``: keep the file there was under this
        name first (``STATE.json.corrupt-<time>``).  ``only_if()``, asked under the
        lock, may decline (the file was repaired meanwhile): then nothing is written
        and False is returned."""
        path = self.task_path(STATE_FILE)
        with self.lock():
            if only_if is not None and not only_if():
                return False
            if set_aside and os.path.exists(path):
                os.replace(path, set_aside)
            atomic_write(path, data.to_json())
        return True

    def project_state(self):
        """The project's STATE.json (the foreground task's state, its rev the journal's)."""
        return self.continue_journal(StateData.from_json(
            read_text(self.path(STATE_FILE)), FERRUS_DIR + "/" + STATE_FILE))

    # -- the journal ----------------------------------------------------------------

    def journal_path(self):
        return self.path(JOURNAL_FILE)

    def journal_archive_path(self):
        return self.path(JOURNAL_ARCHIVE_FILE)

    def journal_entries_backwards(self):
        """Journal entries from the newest back, reading the files from their ends.

        events.jsonl first, then the archive a rotation left; only strictly falling
        seqs are yielded, so an entry that both files hold is not seen twice.  The
        cost is what the caller consumes, never the length of the journal."""
        below = None
        for path in (self.journal_path(), self.journal_archive_path()):
            for raw in _lines_backwards(path):
                if not raw.strip():
                    continue
                entry = journal_entry(raw.decode("utf-8", "replace"))
                if entry is None or (below is not None and entry["seq"] >= below):
                    continue
                below = entry["seq"]
                yield entry

    def journal_entries(self):
        """Every journal entry, oldest first (the archive, then events.jsonl), streamed
        so that printing a long journal needs no memory for it."""
        above = None
        for path in (self.journal_archive_path(), self.journal_path()):
            if not os.path.exists(path):
                continue
            for line in _lines_forward(path):
                entry = journal_entry(line.decode("utf-8", "replace")) \
                    if line is not None and line.strip() else None
                if entry is None or (above is not None and entry["seq"] <= above):
                    continue
                above = entry["seq"]
                yield entry

    def last_journal_seq(self):
        """The seq of the last complete journal line (0 for none), reading only the tail."""
        entry = next(self.journal_entries_backwards(), None)
        return entry["seq"] if entry is not None else 0

    def _append_journal(self, commit, rev, rotate=False):
        """Append one fsynced line.  A gap a crash left (STATE.json committed, its line
        never written) is first recorded as ONE journal_gap entry, however many seqs
        it spans, so seq stays continuous and the cost stays constant.  Returns whether
        events.jsonl was rotated first."""
        path = self.journal_path()
        last = self.last_journal_seq()
        lines = []
        if last + 1 < rev:
            lines.append(compact_json(Commit(
                seq=rev - 1, time=commit.time, actor="ferrus", event=JOURNAL_GAP_EVENT,
                from_state="?", to_state="?", task_id=None,
                detail={"from": last + 1, "to": rev - 1,
                        "note": "these transitions were committed to STATE.json, but their "
                                "journal lines are lost (a crash before the write, or an "
                                "emptied or damaged events.jsonl)"}).to_json()))
        if last >= rev:
            # The journal is ahead of STATE.json (e.g. a restored backup): keep both
            # readable and let doctor explain it rather than writing duplicate seqs.
            log.warning("journal seq %d is ahead of STATE.json rev %d", last, rev)
        lines.append(compact_json(commit.to_json()))
        payload = ("\n".join(lines) + "\n").encode("utf-8")
        rotated = False
        with contextlib.suppress(FileNotFoundError):
            size = os.stat(path).st_size
            if size and (rotate or size + len(payload) > journal_max_bytes()):
                rotated = self._rotate_journal()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            # A torn last line (killed mid-write) must not glue onto ours.
            if os.fstat(fd).st_size:
                with open(path, "rb") as handle:
                    handle.seek(-1, os.SEEK_END)
                    if handle.read(1) != b"\n":
                        payload = b"\n" + payload
            view = memoryview(payload)
            while view:         # a short write (a full disk) must not pass for a whole line
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return rotated

    def _rotate_journal(self):
        """events.jsonl becomes the archive (replacing the previous one), so the journal
        on disk stays under about twice the limit.  The caller's line then starts the
        new file, which keeps its last seq equal to rev.  Called under the lock."""
        try:
            os.replace(self.journal_path(), self.journal_archive_path())
        except OSError as err:
            # Windows refuses to rename a file another process has open: keep
            # appending and rotate on a later commit.
            log.warning("could not rotate %s: %s", JOURNAL_FILE, err)
            return False
        with contextlib.suppress(OSError):
            fsync_directory(self.dir)
        return True

    def read_journal(self, after_seq=0, limit=None):
        """Journal entries with seq > after_seq (the last ``limit`` when given), oldest
        first, read from the end, so a short tail is cheap however long the journal.

        Lines that do not parse (a torn write) are skipped here; doctor reports them."""
        if limit is not None and limit <= 0:
            return []
        entries = []
        for entry in self.journal_entries_backwards():
            if entry["seq"] <= after_seq or (limit is not None and len(entries) >= limit):
                break
            entries.append(entry)
        entries.reverse()
        return entries

    def journal_position(self):
        """Where the journal ends now, for journal_since: (file identity, byte offset)."""
        try:
            with open(self.journal_path(), "rb") as handle:
                stat = os.fstat(handle.fileno())
                return ((stat.st_dev, stat.st_ino), _end_of_complete_lines(handle, stat.st_size))
        except FileNotFoundError:
            return None

    def journal_since(self, position, after_seq=0):
        """(entries with seq > after_seq appended after ``position``, the new position).

        HQ polls with this, so each poll reads only what is new.  When events.jsonl
        was rotated (or replaced by doctor) since ``position``, what the archive holds
        after ``after_seq`` comes first and the new file is read from its start."""
        try:
            handle = open(self.journal_path(), "rb")
        except FileNotFoundError:
            return [], position            # between a rotation's rename and its write
        with handle:
            stat = os.fstat(handle.fileno())
            identity = (stat.st_dev, stat.st_ino)
            entries = []
            if position is None or position[0] != identity or stat.st_size < position[1]:
                start = 0
                for entry in self.journal_entries_backwards():
                    if entry["seq"] <= after_seq:
                        break
                    entries.append(entry)
                entries.reverse()
                return entries, (identity, _end_of_complete_lines(handle, stat.st_size))
            start = position[1]
            handle.seek(start)
            data = handle.read()
        end = data.rfind(b"\n") + 1        # a line still being written waits for the next poll
        for line in data[:end].split(b"\n"):
            if not line.strip():
                continue
            entry = journal_entry(line.decode("utf-8", "replace"))
            if entry is not None and entry["seq"] > after_seq:
                entries.append(entry)
        return entries, (identity, start + end)

    def append_event(self, actor, event, detail, task_id=None):
        """Journal an event that is not a task transition (sessions, gates, notes), about
        ``task_id`` when it is not the state's task (a queued one, or none: "").

        It still bumps rev, so seq == rev holds and every waiter wakes."""
        with self.transaction(actor) as tx:
            tx.set(tx.state, event)
            tx.detail.update(detail)
            tx.journal_task_id = task_id
        return tx.committed

    # -- waiting ----------------------------------------------------------------------

    def wait_for_change(self, stamp, deadline, cancel=None, poll=0.005):
        """Sleep until STATE.json changes, ``deadline`` (monotonic) passes or ``cancel`` is set.

        A stat every few milliseconds is cheap and notices a commit quickly on every
        platform, without inotify/kqueue."""
        while True:
            if cancel is not None and cancel.is_set():
                return False
            current = self.state_stamp()
            if current != stamp:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if cancel is not None:
                cancel.wait(min(poll, remaining))
            else:
                time.sleep(min(poll, remaining))


# Journal entries that record how ferrus keeps its own books (agent sessions, leases,
# capacity decisions that let work go on) rather than what happened to the task;
# `ferrus log` and HQ's /log leave them out unless asked for everything.
BOOKKEEPING_EVENTS = ("session", "heartbeat", "claim", "lease_released", "consume_answer")


def is_bookkeeping(entry):
    if entry.get("event") == "gate":
        return (entry.get("detail") or {}).get("action") == CONTINUE
    return entry.get("event") in BOOKKEEPING_EVENTS


def is_story(entry):
    """The journal entries a person reading what happened wants (not bookkeeping)."""
    return not is_bookkeeping(entry)


def journal_story(store, count, everything=False, task=None):
    """The last ``count`` journal entries, oldest first, bookkeeping left out unless
    ``everything``, only those about ``task`` when it is given.  At most 20 entries per
    wanted one (and 500; 50 and 5,000 for one task of several) are looked at, so a
    journal of a million heartbeats costs what a short one does; fewer may come back."""
    if everything and task is None:
        return store.read_journal(limit=count)
    scan = 20 * count + 500 if task is None else 50 * count + 5000
    entries = []
    for entry in itertools.islice(store.journal_entries_backwards(), scan):
        if len(entries) >= count:
            break
        if (everything or is_story(entry)) and (task is None or entry.get("task_id") == task):
            entries.append(entry)
    entries.reverse()
    return entries
