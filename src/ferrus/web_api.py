"""The web board's API: what it shows of the store, and what its actions call.

These functions answer the board's JSON requests (web.py routes them): the queue as
`ferrus tasks --json` lists it with what a card needs (its column, last event, tokens
and cost), one task's page (its text, state, the question or approval it waits on, its
journal entries with the red checks' last lines, its sessions, the tool calls read from
their logs through each agent's own parser, its usage), its diff, and windows of the
logs in .ferrus/logs/.  Every read is bounded, and every file is opened without
following a symbolic link out of .ferrus/.  The actions are the operations the CLI
calls, with the human on the web as the caller (``human/web`` in the journal); a
refusal is a WebRefusal (an HTTP status, the message and its hint) or the operation's
own FerrusError.
"""

import contextlib
import os
import re

from .basics import LazyPattern, FerrusError, compact_json, format_timestamp, parse_timestamp
from .system import UnsafePath, open_inside
from .task_machine import S
from .store import (APPROVED_STATUSES, CANCELLED_STATUS, DONE_STATUS, FAILED_STATUS,
                    FERRUS_DIR, MERGED_STATUS, PARALLEL_MIRROR_KEY, QUEUED_STATUS,
                    RUNNING_STATUS, journal_story, read_task_record, task_record_path)
from .operations import (Caller, op_diff, op_human_approve, op_human_reject, short_task_id,
                         task_title)
from .work import op_answer
from .task_queue import (describe_task_event, diff_store_of, last_task_events,
                         op_enqueue_task, op_merged_task_diff, op_retry_task,
                         queued_task_ids, require_task_id, task_elapsed, task_rows,
                         task_state_word, task_store_of)
from .mcp import SESSION_ENV
from .agents import tool_display_name, tool_reason
from .register import adapter_for
from .sessions import check_log_tail, read_session_records, usage_summary
from .task_cancel import cancel_needs_confirmation, cancel_queue_task
from .cli_views import recent_task_rows, tasks_with_usage


WEB_TASK_EVENTS_SHOWN = 300            # a task page's journal entries
WEB_TEXT_MAX_CHARS = 64 * 1024         # TASK.md, QUESTION.md, ... on a task's page
WEB_LOG_WINDOW_BYTES = 64 * 1024       # a log's window when none is asked for: its end
WEB_LOG_READ_MAX = 1024 * 1024         # the largest window one request may ask for
WEB_DIFF_HEAD_BYTES = 4 * 1024 * 1024  # a diff's first bytes on the page ...
WEB_DIFF_TAIL_BYTES = 256 * 1024       # ... and its last, when it is longer
WEB_TOOL_CALLS_SHOWN = 200             # a task page's newest tool calls
WEB_SESSION_LOG_SCAN = 256 * 1024      # how much of each session log's end is read for them
WEB_CHECK_TAILS_SHOWN = 20             # check entries whose red commands get output tails

# The board's columns, in order: (key, heading).
WEB_COLUMNS = (("queued", "Queued"), ("executing", "Executing"), ("reviewing", "Reviewing"),
               ("awaiting", "Awaiting you"), ("integrating", "Integrating"),
               ("merged", "Merged"), ("ended", "Failed / cancelled"))
_WEB_LOG_NAME_RE = LazyPattern(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
# Terminal escape sequences in logs: shown as the text around them, never as control bytes.
_WEB_ANSI_RE = LazyPattern(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-_]")


class WebRefusal(Exception):
    """A request the board answers with an error: HTTP status, message, hint (and any
    further fields of the JSON answer)."""

    def __init__(self, status, message, hint=None, **fields):
        super().__init__(message)
        self.status, self.message, self.hint, self.fields = status, message, hint, fields


# ============================================================================
# What the board shows
# ============================================================================

def is_queue_task(store, task):
    """Whether ``task`` is one of the queue's (it has a task.json), not the checkout's own."""
    return os.path.isfile(task_record_path(store.dir, task))


def web_board_column(row):
    """The board column a task of task_rows goes in (see WEB_COLUMNS)."""
    status, state = row.get("status"), row.get("state")
    if row.get("problem") or status in (FAILED_STATUS, CANCELLED_STATUS):
        return "ended"
    if status == QUEUED_STATUS:
        return "queued"
    if status in APPROVED_STATUSES:
        return "merged"
    if state in (S.AWAITING_HUMAN.value, S.AWAITING_CONFIRMATION.value):
        return "awaiting"
    if state == S.REVIEWING.value:
        return "reviewing"
    if state in (S.INTEGRATING.value, S.COMPLETE.value):
        return "integrating"
    if state == S.FAILED.value:
        return "ended"
    return "executing"          # Executing, Addressing, Consultation, or being prepared


def _board_fields(store, rows, now):
    """What a card shows beyond the row: column, short id, state word, elapsed
    time and the task's last event in a few words."""
    last = last_task_events(store, [row["id"] for row in rows])
    for row in rows:
        entry = last.get(row["id"])
        if row.get("status") == FAILED_STATUS and not row.get("failure_reason"):
            # Failed before or outside its state machine (a red gate, a tampered worktree):
            # the queue's record says why.
            row["failure_reason"] = read_task_record(store.dir, row["id"]).get("reason")
        # "place" stays as `ferrus tasks --json` has it: None is this machine ("here").
        row.update(column=web_board_column(row), short_id=short_task_id(row["id"]),
                   state_word=task_state_word(row),
                   elapsed_secs=task_elapsed(row, now),
                   last_event=describe_task_event(entry) if entry else None,
                   last_event_at=entry.get("time") if entry else None)
    return rows


def checkout_task_row(store, queue_ids):
    """The card of the task STATE.json holds when it is the checkout's own (`ferrus run
    --task`, HQ), not one of the queue: None when there is none or it is Idle."""
    try:
        data = store.project_state()
    except FerrusError:
        return None
    if not data.task_id or data.task_id in queue_ids or data.state == S.IDLE or \
            data.extra.get(PARALLEL_MIRROR_KEY):
        return None
    status = DONE_STATUS if data.state == S.COMPLETE else FAILED_STATUS \
        if data.state == S.FAILED else RUNNING_STATUS
    row = {"id": data.task_id, "title": task_title(store.read_file("TASK.md")) or data.task_id,
           "status": status, "state": data.state.value, "agent": None, "worktree": None,
           "branch": (data.task_base or {}).get("branch"), "origin": {},
           "created_at": data.task_started_at, "started_at": data.task_started_at,
           "ended_at": data.updated_at if status != RUNNING_STATUS else None,
           "review_cycles": data.review_cycles, "failure_reason": data.failure_reason,
           "place": "checkout", "checkout": True}
    with contextlib.suppress(ValueError, TypeError):
        row["age_secs"] = max(0.0, (store.clock() - parse_timestamp(data.task_started_at))
                              .total_seconds())
    return row


def web_task_listing(store, everything=False):
    """The board's data: `ferrus tasks --json`'s rows — every task with ``everything``,
    else those in the queue's hands and the recently ended — each with its card fields,
    the checkout's own task first when it has one, and the journal seq they were read at
    (a stream opened from it misses nothing)."""
    seq = store.last_journal_seq()
    now = store.clock()
    rows = task_rows(store)
    older = 0
    if not everything:
        rows, older = recent_task_rows(rows, now)
    checkout = checkout_task_row(store, set(queued_task_ids(store)))
    if checkout is not None:
        rows.insert(0, checkout)
    tasks_with_usage(store, rows)
    if checkout is not None:
        checkout["title"] = task_title(store.read_file("TASK.md")) or checkout["id"]
    human_review = False
    with contextlib.suppress(FerrusError):
        human_review = bool(store.config().human_review)
    return {"tasks": _board_fields(store, rows, now), "older": older, "seq": seq,
            "now": format_timestamp(now), "columns": [list(c) for c in WEB_COLUMNS],
            "project": os.path.basename(store.root), "human_review": human_review}


def web_task_store(store, ref):
    """(task id, the store holding its state or None while it has none) for ``ref``: a
    queue task (its id or unique end) or the checkout's own task (its id)."""
    try:
        task = require_task_id(store, ref)
    except FerrusError:
        data = store.project_state()
        # The checkout's own task by its id or its end (as its card shows it), when no
        # task of the queue ends so too.
        if isinstance(ref, str) and data.task_id and not data.extra.get(PARALLEL_MIRROR_KEY) \
                and (data.task_id == ref or (len(ref) >= 4 and data.task_id.endswith(ref) and
                                             not any(name.endswith(ref)
                                                     for name in queued_task_ids(store)))):
            return data.task_id, store
        raise WebRefusal(404, "no task %s in this project" % str(ref)[:80],
                         "the board lists the tasks; a task's id or the end of it names it"
                         ) from None
    try:
        return task, task_store_of(store, task)
    except FerrusError:
        return task, None           # queued, or its run in the checkout is over


def _bounded_text(text):
    if len(text) <= WEB_TEXT_MAX_CHARS:
        return text
    return text[:WEB_TEXT_MAX_CHARS] + "\n\n[ferrus: %d more characters are left out]" % (
        len(text) - WEB_TEXT_MAX_CHARS)


def web_log_name(path):
    """The file name in .ferrus/logs/ that a recorded log path (``.ferrus/logs/x.log``)
    names, or None for anything else."""
    prefix = FERRUS_DIR + "/logs/"
    if not isinstance(path, str) or not path.startswith(prefix):
        return None
    name = path[len(prefix):]
    return name if _WEB_LOG_NAME_RE.match(name) else None


def _with_check_tails(store, entries):
    """``entries`` with the last lines of each red check command (as HQ shows them) in
    the newest WEB_CHECK_TAILS_SHOWN check entries; the entries are copied, not changed."""
    out, shown = list(entries), 0
    for index in range(len(out) - 1, -1, -1):
        checks = (out[index].get("detail") or {}).get("checks")
        if not isinstance(checks, list) or shown >= WEB_CHECK_TAILS_SHOWN:
            continue
        shown += 1
        entry = dict(out[index], detail=dict(out[index]["detail"]))
        entry["detail"]["checks"] = [
            dict(check, tail=check_log_tail(store, check.get("log")), log_name=web_log_name(
                check.get("log"))) if isinstance(check, dict) and check.get("status") not in
            (None, "passed") else check for check in checks]
        out[index] = entry
    return out


def _session_brief(record):
    brief = {key: record.get(key) for key in (
        "id", "slot", "role", "agent", "model", "status", "outcome", "exit_code", "note",
        "started_at", "ended_at", "tool_calls", "input_tokens", "output_tokens", "cost_usd",
        "turns")}
    brief["log_name"] = web_log_name(record.get("log"))
    return brief


def _read_end(store, name, size_limit):
    """The last ``size_limit`` bytes of .ferrus/logs/<name> (symlink-safe) as lines, the
    first one dropped when the read began inside it; [] when it cannot be read."""
    try:
        with open_inside(store.path("logs"), name) as handle:
            size = os.fstat(handle.fileno()).st_size
            handle.seek(max(0, size - size_limit))
            data = handle.read(size_limit)
    except (OSError, UnsafePath):
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[1:] if size > size_limit else lines


def task_tool_calls(store, records, limit=WEB_TOOL_CALLS_SHOWN):
    """The newest ``limit`` tool calls of these session records, oldest first, read from
    the end of each session's log through its agent's own parser: slot, tool (as HQ
    names it), summary (its main argument, cut short), whether it failed and why."""
    try:
        config = store.config()
    except FerrusError:
        return []
    calls = []
    for record in records:
        name = web_log_name(record.get("log"))
        if not name or not record.get("agent"):
            continue
        try:
            parse_line = adapter_for(config, record["agent"]).parse_line
        except FerrusError:
            continue
        by_id = {}
        for line in _read_end(store, name, WEB_SESSION_LOG_SCAN):
            try:
                events = list(parse_line(line.strip())) if line.strip() else []
            except Exception:         # parsers never take the board down (as usage_from_log)
                continue
            for event in events:
                if event.kind == "tool_call":
                    call = {"session": record.get("id"), "slot": record.get("slot"),
                            "tool": tool_display_name(event.name), "summary": event.text,
                            "ok": event.ok, "reason": None}
                    calls.append(call)
                    if event.call_id:
                        by_id[event.call_id] = call
                elif event.kind == "tool_result" and event.ok is False:
                    call = by_id.get(event.call_id)
                    if call is not None:
                        call.update(ok=False, reason=tool_reason(event.text))
        del calls[:-limit]
    return calls


def web_task_detail(store, ref):
    """Everything a task's page shows: its card, text, state, the question it waits on,
    the reviewer's approval it waits to have confirmed, its journal entries (red checks
    with their output's last lines), sessions, tool calls and usage, and which actions
    apply now."""
    task, task_store = web_task_store(store, ref)
    seq = store.last_journal_seq()
    listing_row = task_rows(store, [task])[0] if is_queue_task(store, task) else \
        checkout_task_row(store, set())
    row = _board_fields(store, tasks_with_usage(store, [listing_row]), store.clock())[0]
    if row.get("checkout"):
        row["title"] = task_title(store.read_file("TASK.md")) or task
    text_store = task_store if task_store is not None else store.for_task(task)
    detail = {"task": row, "seq": seq, "project": os.path.basename(store.root),
              "text": _bounded_text(text_store.read_file("TASK.md")),
              "state": None, "question": None, "confirmation": None, "review_notes": None,
              "submission": None}
    data = None
    if task_store is not None:
        with contextlib.suppress(FerrusError):
            data = task_store.read_state()
    if data is not None:
        detail["state"] = {"state": data.state.value, "paused_state": data.paused_state.value
                           if data.paused_state else None, "check_retries": data.check_retries,
                           "review_cycles": data.review_cycles,
                           "failure_reason": data.failure_reason, "claimed_by": data.claimed_by,
                           "lease_until": data.lease_until,
                           "state_entered_at": data.state_entered_at,
                           "question_from": data.question_from, "base": data.task_base}
        detail["review_notes"] = _bounded_text(task_store.read_file("REVIEW.md")) or None
        detail["submission"] = _bounded_text(task_store.read_file("SUBMISSION.md")) or None
        if data.state == S.AWAITING_HUMAN:
            detail["question"] = _bounded_text(task_store.read_file("QUESTION.md"))
        if data.state == S.AWAITING_CONFIRMATION:
            detail["confirmation"] = {
                "approval_notes": _bounded_text(task_store.read_file("APPROVAL.md")) or None,
                "review_cycles": data.review_cycles}
    detail["events"] = _with_check_tails(store, journal_story(store, WEB_TASK_EVENTS_SHOWN,
                                                              task=task))
    records = [r for r in read_session_records(store) if r.get("task_id") == task]
    detail["sessions"] = [_session_brief(r) for r in records]
    detail["usage"] = usage_summary(records)
    detail["tool_calls"] = task_tool_calls(store, records)
    state = data.state if data is not None else None
    status = row.get("status")
    queue_task = not row.get("checkout")
    detail["actions"] = {
        "cancel": queue_task and status in (QUEUED_STATUS, RUNNING_STATUS, FAILED_STATUS),
        "retry": queue_task and status in (FAILED_STATUS, CANCELLED_STATUS),
        "answer": state == S.AWAITING_HUMAN,
        "approve": state == S.AWAITING_CONFIRMATION,
        "reject": state == S.AWAITING_CONFIRMATION}
    return detail


def web_task_diff(store, ref):
    """A task's diff for its page, as `ferrus diff --task` has it but with a larger
    window (WEB_DIFF_HEAD_BYTES + WEB_DIFF_TAIL_BYTES): a merged task's merged commit,
    a running one's work (its recorded submission while it is reviewed), or why there
    is none."""
    task, _ = web_task_store(store, ref)
    record = read_task_record(store.dir, task) if is_queue_task(store, task) else {}
    try:
        if record.get("status") == MERGED_STATUS and record.get("merged_commit"):
            outcome = op_merged_task_diff(store, task, head_bytes=WEB_DIFF_HEAD_BYTES,
                                          tail_bytes=WEB_DIFF_TAIL_BYTES)
            return _with_file_titles(dict(outcome.data, text=outcome.data.get("diff") or "",
                                          title=outcome.text.split("\n", 1)[0]))
        diff_store = diff_store_of(store, task) if is_queue_task(store, task) else store
        outcome = op_diff(diff_store, web_caller(), head_bytes=WEB_DIFF_HEAD_BYTES,
                          tail_bytes=WEB_DIFF_TAIL_BYTES, more_hint="`ferrus diff --task %s "
                          "PATH` shows one file's whole diff." % short_task_id(task))
    except FerrusError as err:
        return {"available": False, "reason": err.message, "hint": err.hint}
    data = dict(outcome.data)
    if data.get("available"):
        data["title"], _, data["text"] = outcome.text.partition("\n")
    return _with_file_titles(data)


def _with_file_titles(data):
    """``file_titles``: the title of each file of the diff (each `diff --git` line, in order)."""
    data["file_titles"] = [diff_file_title(line[len("diff --git "):])
                     for line in (data.get("text") or "").split("\n")
                     if line.startswith("diff --git ")]
    return data


_GIT_QUOTED_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
_CONTROL_CHARACTERS = LazyPattern("[\x00-\x1f\x7f]")


def _git_path_at(header, start):
    """(the path at ``header[start:]`` as git wrote it — C-quoted in "…" when it holds odd
    bytes, with octal escapes for them — and where the quoted one ends), or (None, start)
    when it is not quoted."""
    if not header.startswith('"', start):
        return None, start
    path, at = bytearray(), start + 1
    while at < len(header) and header[at] != '"':
        if header[at] == "\\" and at + 1 < len(header):
            octal = re.match(r"[0-7]{3}", header[at + 1:at + 4])
            if octal:
                path.append(int(octal.group(), 8) & 0xFF)
                at += 4
                continue
            escaped = header[at + 1]
            path += bytes([_GIT_QUOTED_ESCAPES[escaped]]) if escaped in _GIT_QUOTED_ESCAPES \
                else escaped.encode("utf-8")
            at += 2
            continue
        path += header[at].encode("utf-8")
        at += 1
    return path.decode("utf-8", "replace"), at + 1


def diff_file_title(header):
    """What a file of a diff is called on the page, from its `diff --git a/X b/Y` header:
    the path (``old → new`` when renamed), unquoted, with control characters shown as
    their Unicode pictures (an escape sequence in a name is never one)."""
    old, after = _git_path_at(header, 0)
    if old is not None:
        new, _ = _git_path_at(header, after + 1)
        if new is None:
            new = header[after + 1:]
    else:
        middle = len(header) // 2           # a/P b/P: both halves name the same path
        if header[middle:middle + 3] == " b/" and header[2:middle] == header[middle + 3:]:
            old, new = header[:middle], header[middle + 1:]
        else:
            split = header.rfind(' "b/') if header.endswith('"') else header.rfind(" b/")
            old = header[:split] if split > 0 else header
            new = header[split + 1:] if split > 0 else header
            if new.startswith('"'):
                new = _git_path_at(new, 0)[0] or new
    old, new = (name[2:] if name[:2] in ("a/", "b/") else name for name in (old, new))
    title = new if old == new else "%s → %s" % (old, new)
    return _CONTROL_CHARACTERS.sub(lambda c: chr(0x2400 + ord(c.group()))
                                   if c.group() != "\x7f" else "\u2421", title)


def web_log_window(store, name, offset=None, length=None):
    """A window of .ferrus/logs/<name>: ``length`` bytes (at most WEB_LOG_READ_MAX) from
    ``offset``, by default its last WEB_LOG_WINDOW_BYTES; never through a symbolic link
    or out of .ferrus/logs.  Text with terminal escape sequences taken out."""
    if not isinstance(name, str) or not _WEB_LOG_NAME_RE.match(name):
        raise WebRefusal(404, "no log %s" % str(name)[:80], "logs are files in %s/logs/"
                         % FERRUS_DIR)
    length = WEB_LOG_WINDOW_BYTES if length is None else max(0, min(length, WEB_LOG_READ_MAX))
    try:
        handle = open_inside(store.path("logs"), name)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise WebRefusal(404, "no log %s in %s/logs/" % (name, FERRUS_DIR),
                         "it may have been removed; a check run or a session writes new "
                         "ones") from None
    except UnsafePath as err:
        raise WebRefusal(403, err.message, err.hint) from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        start = max(0, size - length) if offset is None else max(0, min(offset, size))
        handle.seek(start)
        data = handle.read(length)
    text = data.decode("utf-8", "replace")
    binary = "\0" in text
    text = _WEB_ANSI_RE.sub("", text.replace("\0", "\N{SYMBOL FOR NULL}"))
    return {"name": name, "size": size, "offset": start, "length": len(data), "text": text,
            "binary": binary}


# ============================================================================
# What the page does: the operations, with the human on the web as the caller
# ============================================================================

def web_caller():
    """The human on the web page, as the journal names them — unless the board was
    started from inside an agent session (its environment names one): then it acts as
    that agent, whom the operations refuse a human's verdicts."""
    session = os.environ.get(SESSION_ENV)
    return Caller("agent", "agent/%s" % session) if session else Caller("human", "human/web")


def stores_awaiting_answer(store):
    """[(task id, store)] of every task whose agent waits for a human's answer
    (AwaitingHuman): the checkout's own and each parallel task's."""
    waiting = []
    project = store.project_state()
    if project.state == S.AWAITING_HUMAN and not project.extra.get(PARALLEL_MIRROR_KEY):
        waiting.append((project.task_id, store))
    for row in task_rows(store):
        if row.get("status") == RUNNING_STATUS and row.get("state") == S.AWAITING_HUMAN.value:
            with contextlib.suppress(FerrusError):
                waiting.append((row["id"], task_store_of(store, row["id"])))
    return waiting


def _body_text(body, key, what, required=True):
    value = body.get(key)
    if value is None and not required:
        return None
    if value is not None and not isinstance(value, str):
        raise WebRefusal(400, "%s must be a string, not %s: send {\"%s\": \"…\"} as JSON" % (
            what, compact_json(value)[:40], key), "put the text in double quotes")
    if not isinstance(value, str) or not value.strip():
        raise WebRefusal(400, "%s is missing: send {\"%s\": \"…\"} as JSON" % (what, key),
                         "the text must not be empty")
    return value


def web_enqueue(store, caller, body):
    outcome = op_enqueue_task(store, caller, _body_text(body, "text", "the task's text"),
                              agent=_body_text(body, "agent", "the agent", required=False))
    return 201, {"message": outcome.text, "task_id": outcome.data["task_id"],
                 "title": outcome.data["title"]}


def web_cancel(store, caller, ref, body):
    discard = body.get("discard", False)
    if not isinstance(discard, bool):
        raise WebRefusal(400, "discard must be true or false, not %s" % compact_json(discard)[:40])
    task, _ = web_task_store(store, ref)
    if not is_queue_task(store, task):
        raise WebRefusal(409, "task %s is the checkout's own, not a task of the queue" % task,
                         "`ferrus reset` in a shell returns the checkout's task to Idle")
    question = cancel_needs_confirmation(store, task, discard)
    if question and body.get("confirm") is not True:
        raise WebRefusal(409, question, "the page asks first; an API call sends "
                         "{\"confirm\": true} to mean yes", confirm=question)
    return 200, {"message": "\n".join(cancel_queue_task(store, caller, task, discard)),
                 "task_id": task}


def web_retry(store, caller, ref, body):
    task, _ = web_task_store(store, ref)
    if not is_queue_task(store, task):
        raise WebRefusal(409, "task %s is the checkout's own, not a task of the queue" % task,
                         "`ferrus task add` queues its work again as a new task")
    return 200, {"message": op_retry_task(store, caller, task).text, "task_id": task}


def _started_task_store(store, ref):
    """(task id, its store) for a task that has a state: one whose question or approval
    can wait for the human."""
    task, task_store = web_task_store(store, ref)
    if task_store is None:
        raise WebRefusal(409, "task %s is not under way: nothing of it waits for you" % task,
                         "the board shows where it stands")
    return task, task_store


def web_approve(store, caller, ref, body):
    task, task_store = _started_task_store(store, ref)
    return 200, {"message": op_human_approve(task_store, caller, via="web").text,
                 "task_id": task}


def web_reject(store, caller, ref, body):
    task, task_store = _started_task_store(store, ref)
    notes = _body_text(body, "notes", "the rejection's notes (what must change)")
    return 200, {"message": op_human_reject(task_store, caller, notes, via="web").text,
                 "task_id": task}


def web_answer(store, caller, body):
    text = _body_text(body, "text", "the answer")
    ref = body.get("task")
    if ref is not None:
        task, target = _started_task_store(store, ref)
    else:
        waiting = stores_awaiting_answer(store)
        if len(waiting) > 1:
            raise WebRefusal(409, "%d tasks wait for an answer: %s" % (len(waiting), ", ".join(
                short_task_id(task) for task, _ in waiting)),
                "name one: {\"task\": \"%s\", \"text\": …}" % short_task_id(waiting[0][0]))
        task, target = waiting[0] if waiting else (None, store)
    return 200, {"message": op_answer(target, caller, text).text, "task_id": task}


# POST /api/tasks/ID/<verb>
WEB_TASK_ACTIONS = {"cancel": web_cancel, "retry": web_retry, "approve": web_approve,
                    "reject": web_reject}
