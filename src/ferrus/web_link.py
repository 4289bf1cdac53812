"""Where the running web boards are: .ferrus/web.json, for [notify] and runs.

Every board (`ferrus web`, or --web beside `ferrus run` and HQ) adds its address —
scheme, host and port, never its token — with its pid and that process's start time to
.ferrus/web.json when it starts, and takes out only its own entry when it stops (the file
goes with the last one).  web_board_url() reads it: the link to a task's page on the
first board whose process still runs, else None.  The pid and start time together name
one process, so the entry of a board that was killed links nothing even after its pid is
reused.  The Notifier puts that link in its messages, and a run leaves a question or an
approval to the board instead of ending with exit 4 when nobody at its terminal can
answer.  This module sits before the Notifier (in the sessions layer), unlike the rest of
the board, which comes after HQ.
"""

import contextlib
import json
import os

from .basics import LazyPattern, FerrusError, compact_json, format_timestamp
from .system import FileLock, UnsafePath, atomic_write, open_inside, pid_alive, process_start


# .ferrus/web.json: {"boards": [{url, pid, start, started}, ...]} — every running board.
WEB_RECORD_FILE = "web.json"
_WEB_RECORD_LOCK = "web.lock"           # serialises the read-modify-write of web.json
_WEB_URL_RE = LazyPattern(r"^https?://[^\s/?#@]+$")


def _read_boards(store):
    """The entries of web.json that are well formed (a damaged file holds none)."""
    try:
        with open_inside(store.dir, WEB_RECORD_FILE) as handle:
            record = json.loads(handle.read(1 << 20).decode("utf-8"))
    except (OSError, ValueError, UnsafePath):
        return []
    boards = record.get("boards") if isinstance(record, dict) else None
    if not isinstance(boards, list):
        return []
    return [board for board in boards if isinstance(board, dict)
            and isinstance(board.get("url"), str) and _WEB_URL_RE.match(board["url"])
            and isinstance(board.get("pid"), int) and not isinstance(board["pid"], bool)]


def _board_alive(board):
    """Does the process that wrote this entry still run?  A pid alone could be another
    process's by now; with its start time it names the board's own."""
    pid = board["pid"]
    if not pid_alive(pid):
        return False
    start = process_start(pid)
    return start is None or board.get("start") == start


def _rewrite_boards(store, change):
    """web.json := change(its live entries), under web.lock; removed when none are left."""
    with FileLock(store.path(_WEB_RECORD_LOCK), timeout=10, what=".ferrus/web.lock"):
        boards = change([board for board in _read_boards(store) if _board_alive(board)])
        if boards:
            atomic_write(store.path(WEB_RECORD_FILE), compact_json({"boards": boards}),
                         durable=False)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(store.path(WEB_RECORD_FILE))


def write_web_record(store, base_url):
    """Add the board this process serves (its address, pid and start) to .ferrus/web.json."""
    entry = {"url": base_url, "pid": os.getpid(), "start": process_start(os.getpid()),
             "started": format_timestamp(store.clock())}
    _rewrite_boards(store, lambda boards: boards + [entry])


def remove_web_record(store, base_url=None):
    """Take this process's board at ``base_url`` (each of its boards without it) out of
    web.json; other processes' boards stay."""
    with contextlib.suppress(OSError, FerrusError):
        _rewrite_boards(store, lambda boards: [
            board for board in boards if not (board["pid"] == os.getpid() and
                                              base_url in (None, board["url"]))])


def web_board_url(store, task_id=None):
    """The URL of ``task_id``'s page (of the board without it) while `ferrus web` (or a
    run's --web) serves this project, else None; [notify] puts it in its messages.  It
    never holds the token: the browser that opened the board has its cookie."""
    import urllib.parse
    for board in _read_boards(store):
        if _board_alive(board):
            return board["url"] + (
                "/task/%s" % urllib.parse.quote(task_id, safe="") if task_id else "/")
    return None
