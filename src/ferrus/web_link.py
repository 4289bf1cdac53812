"""Where the running web board is: .ferrus/web.json, for [notify] and runs.

A board (`ferrus web`, or --web beside `ferrus run` and HQ) writes its address — scheme,
host and port, never its token — and its pid to .ferrus/web.json when it starts and
removes the file when it stops.  web_board_url() reads it: the link to a task's page
while a live process serves the board, else None (a file left by a board that died is
ignored).  The Notifier puts that link in its messages, and a run leaves a question or
an approval to the board instead of ending with exit 4 when nobody at its terminal can
answer.  This module sits before the Notifier (in the sessions layer), unlike the rest of
the board, which comes after HQ.
"""

import contextlib
import json
import os
import re
import urllib.parse

from .basics import compact_json, format_timestamp
from .system import UnsafePath, atomic_write, open_inside, pid_alive


# .ferrus/web.json: the running board's address (never its token) and pid.
WEB_RECORD_FILE = "web.json"
_WEB_URL_RE = re.compile(r"^https?://[^\s/?#@]+$")


def write_web_record(store, base_url):
    """Name the board this process serves (its address, its pid) in .ferrus/web.json."""
    atomic_write(store.path(WEB_RECORD_FILE), compact_json(
        {"url": base_url, "pid": os.getpid(), "started": format_timestamp(store.clock())}),
        durable=False)


def remove_web_record(store):
    """web.json goes with its board (another board's, started since, stays)."""
    with contextlib.suppress(OSError, ValueError, AttributeError, UnsafePath):
        with open_inside(store.dir, WEB_RECORD_FILE) as handle:
            record = json.loads(handle.read(4096).decode("utf-8"))
        if record.get("pid") == os.getpid():
            os.unlink(store.path(WEB_RECORD_FILE))


def web_board_url(store, task_id=None):
    """The URL of ``task_id``'s page (of the board without it) while `ferrus web` (or a
    run's --web) serves this project, else None; [notify] puts it in its messages.  It
    never holds the token: the browser that opened the board has its cookie."""
    try:
        with open_inside(store.dir, WEB_RECORD_FILE) as handle:
            record = json.loads(handle.read(4096).decode("utf-8"))
    except (OSError, ValueError, UnsafePath):
        return None
    url, pid = record.get("url") if isinstance(record, dict) else None, \
        record.get("pid") if isinstance(record, dict) else None
    if not isinstance(url, str) or not _WEB_URL_RE.match(url) or \
            not isinstance(pid, int) or isinstance(pid, bool) or not pid_alive(pid):
        return None
    return url + ("/task/%s" % urllib.parse.quote(task_id, safe="") if task_id else "/")
