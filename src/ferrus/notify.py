"""Notifications: the bell, desktop notices, [notify] commands.

The terminal bell, desktop notifications and [notify] commands, off the loop's path."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from .basics import FerrusError, log
from .system import IS_WINDOWS, kill_process_tree, process_group_kwargs
from .config import NotifyConfig
from .session_machine import SS, Session
from .sessions import HqMessage, SLOT_ROLES, count_tool_calls
from .web_link import web_board_url


# -- notifications ---------------------------------------------------------------------------
#
# [notify] tells a human who is not watching that the loop needs them or ended: the
# terminal bell (through the front end's ``bell``), a command of the user's (ntfy,
# curl to a webhook, ...) and the desktop's own notifier.  Commands run detached with
# a timeout on a thread of their own, so a failing or hanging one never blocks the
# loop; the first failure is shown, later ones only logged.

NOTIFY_TITLES = {"awaiting_human": "an agent needs your answer", "complete": "task complete",
                 "failed": "task failed", "checkpoint": "capacity checkpoint",
                 "emergency_stop": "capacity emergency stop",
                 "pipeline_delivered": "pipeline delivered", "task_created": "task created",
                 "submitted": "work submitted for review", "rejected": "submission rejected"}


def desktop_notification_argv(title, body):
    """The argv that shows a desktop notification with what this system has (no
    dependency), or None."""
    if sys.platform == "darwin":
        quote = lambda text: json.dumps(text, ensure_ascii=False)   # noqa: E731  "…" and \"
        return ["osascript", "-e", "display notification %s with title %s"
                % (quote(body), quote(title))]
    if IS_WINDOWS:  # pragma: no cover
        script = (
            "[Windows.UI.Notifications.ToastNotificationManager, Windows.UI.Notifications, "
            "ContentType=WindowsRuntime] | Out-Null;"
            "$t = [Windows.UI.Notifications.ToastNotificationManager]::GetTemplateContent("
            "[Windows.UI.Notifications.ToastTemplateType]::ToastText02);"
            "$n = $t.GetElementsByTagName('text');"
            "$n.Item(0).AppendChild($t.CreateTextNode($env:FERRUS_NOTIFY_TITLE)) | Out-Null;"
            "$n.Item(1).AppendChild($t.CreateTextNode($env:FERRUS_NOTIFY_BODY)) | Out-Null;"
            "[Windows.UI.Notifications.ToastNotificationManager]::CreateToastNotifier("
            "'ferrus').Show([Windows.UI.Notifications.ToastNotification]::new($t))")
        return ["powershell", "-NoProfile", "-NonInteractive", "-Command", script]
    if shutil.which("notify-send"):
        # "--" ends the options: the body is an agent's words and may start with "-".
        return ["notify-send", "--app-name=ferrus", "--", title, body]
    return None


def terminal_bell(stream):
    """A function that rings ``stream``'s terminal bell, or None when it is no terminal.
    The bell character is written straight to the stream: say() would show it as text."""
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return None

    def ring():
        stream.write("\a")
        stream.flush()
    return ring


# How long a front end that is ending waits for its notifiers before stopping them.
NOTIFY_EXIT_GRACE_SECS = 5
NOTIFY_STDERR_TAIL_BYTES = 4096     # what is kept of a notifier's stderr, for its warning
# At most this many notifiers (commands and desktop notifications) run at once; one more
# is not started (it would only pile up behind those that hang) and the failure warning
# says so.
NOTIFY_MAX_RUNNING = 4


class Notifier:
    """Announces NOTIFY_EVENTS as [notify] says.  ``emit`` receives the one warning
    about a failing notifier; ``bell()`` rings the front end's bell (None: no terminal).

    Nothing of a notifier runs on the caller's path: notify() starts a thread that
    starts the process and watches it, stopping it at [notify] timeout_secs, so a
    notifier that hangs costs the loop nothing — and no more than NOTIFY_MAX_RUNNING of
    them run at once.  One Notifier serves a whole `ferrus run --parallel` (every task's
    controller), so that bound holds for the run."""

    def __init__(self, store, emit, bell=None):
        self.store = store
        self.emit = emit
        self.bell = bell
        self.failed_once = False
        self.sent = []             # (event, task_id, summary), for tests and `status`
        self.running = []          # (process, what, program, deadline) still unfinished
        self.stopped_at_exit = set()  # pids finish() stopped
        self.skipped = 0           # notifiers not started: NOTIFY_MAX_RUNNING were running
        self._lock = threading.Lock()
        self._alive = 0            # notifiers started and not yet ended (or not yet spawned)
        self._closed = False       # finish() ran: nothing more is started

    def config(self):
        try:
            return self.store.config().notify
        except FerrusError:
            return NotifyConfig()   # a broken ferrus.toml still rings the bell

    def notify(self, event, task_id, summary):
        config = self.config()
        if event not in config.events:
            return
        summary = " ".join((summary or "").split())[:300]
        url = web_board_url(self.store, task_id) or ""     # while a board serves the project
        self.sent.append((event, task_id, summary))
        if config.bell and self.bell is not None:
            with contextlib.suppress(Exception):   # a closed terminal is no reason to stop
                self.bell()
        # {url} before {summary}: an agent's words saying "{url}" stay as they are.
        values = {"{event}": event, "{task_id}": task_id or "", "{url}": url,
                  "{summary}": summary}
        env = {"FERRUS_EVENT": event, "FERRUS_TASK_ID": task_id or "",
               "FERRUS_SUMMARY": summary, "FERRUS_URL": url}
        if config.command:
            argv = [self._fill(part, values) for part in config.command]
            self._start("[notify] command", argv, env, config.timeout_secs, event)
        if config.desktop:
            title = "ferrus: %s" % NOTIFY_TITLES.get(event, event)
            body = "\n".join(part for part in (summary or title, url) if part)
            argv = desktop_notification_argv(title, body)
            if argv is None:
                self._failed("[notify] desktop", "no desktop notifier was found (notify-send "
                             "on Linux, osascript on macOS, PowerShell on Windows)")
            else:
                self._start("[notify] desktop", argv, dict(env, FERRUS_NOTIFY_TITLE=title,
                                                           FERRUS_NOTIFY_BODY=body),
                            config.timeout_secs, event)

    @staticmethod
    def _fill(part, values):
        for key, value in values.items():
            part = part.replace(key, value)
        return part

    def _start(self, what, argv, env, timeout, event):
        with self._lock:
            if self._closed:
                return
            full = self._alive >= NOTIFY_MAX_RUNNING
            if full:
                self.skipped += 1
            else:
                self._alive += 1
        if full:
            self._failed(what, "%d notifiers are still running (at most %d run at once), so "
                         "the one for %s was not started" % (NOTIFY_MAX_RUNNING,
                                                            NOTIFY_MAX_RUNNING, event))
            return
        threading.Thread(target=self._run, args=(what, argv, env, timeout), daemon=True,
                         name="ferrus-notify").start()

    def _run(self, what, argv, env, timeout):
        try:
            with self._lock:
                if self._closed:
                    return
            try:
                proc = subprocess.Popen(argv, cwd=self.store.root, env=dict(os.environ, **env),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, **process_group_kwargs())
            except OSError as err:
                self._failed(what, "%s could not start: %s" % (argv[0], err.strerror or err))
                return
            with self._lock:
                self.running = [entry for entry in self.running if entry[0].returncode is None]
                self.running.append((proc, what, argv[0], time.monotonic() + timeout))
                closed = self._closed
            if closed:                      # finish() came while it was starting
                self.stopped_at_exit.add(proc.pid)
                kill_process_tree(proc)
            self._watch(what, argv[0], proc, timeout)
        finally:
            with self._lock:
                self._alive -= 1

    def finish(self, grace=NOTIFY_EXIT_GRACE_SECS):
        """At the front end's end: notifiers still running get up to ``grace`` seconds
        (never past their timeout), then are stopped.  Their watch threads die with
        this process, so without this a hung notifier would run on for good."""
        with self._lock:
            self._closed = True
            pending = [entry for entry in self.running if entry[0].poll() is None]
            self.running = []
        if not pending:
            return
        until = min(time.monotonic() + grace, max(entry[3] for entry in pending))
        while time.monotonic() < until and any(e[0].poll() is None for e in pending):
            time.sleep(0.02)
        for proc, what, program, _ in pending:
            if proc.poll() is None:
                self.stopped_at_exit.add(proc.pid)    # reported here, not by its watcher
                kill_process_tree(proc)
                self._failed(what, "%s was still running when ferrus ended and was stopped"
                             % program)

    def _watch(self, what, program, proc, timeout):
        # Only the end of its stderr is kept: a notifier flooding it (until its
        # timeout) must not fill ferrus's memory.
        tail = bytearray()

        def drain():
            with proc.stderr:
                for chunk in iter(lambda: proc.stderr.read(65536), b""):
                    tail.extend(chunk)
                    del tail[:-NOTIFY_STDERR_TAIL_BYTES]
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_tree(proc)
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
            self._failed(what, "%s was still running after %ds and was stopped"
                         % (program, timeout))
            return
        reader.join(5)
        err = bytes(tail)
        if proc.returncode != 0 and proc.pid not in self.stopped_at_exit:
            said = (err or b"").decode("utf-8", "replace").strip().splitlines()
            self._failed(what, "%s exited with code %s%s" % (
                program, proc.returncode, ": " + said[-1][:200] if said else ""))

    def _failed(self, what, why):
        with self._lock:
            first, self.failed_once = not self.failed_once, True
        if not first:
            log.info("%s failed again: %s", what, why)
            return
        self.emit(HqMessage("warning", "%s failed: %s (the loop goes on; later failures are "
                                       "only logged)" % (what, why), "notifier",
                            {"notifier": what, "error": why}))


class SessionSlot:
    """A headless role slot: its session (see ARCHITECTURE.md, 'Session state machine')
    and the process it supervises."""

    def __init__(self, name, limits):
        self.name = name
        self.role = SLOT_ROLES[name]
        self.limits = limits
        self.session = Session(max_consecutive_errors=limits.max_consecutive_errors,
                               max_total_errors=limits.max_total_errors)
        self.process = None
        self.session_id = None     # names the running agent session (its leases carry it)
        self.timer = None          # clock value when the current wait ends
        self.start_seq = 0
        self.tool_calls = 0
        self.started_at = None     # clock value when the running session started
        self.events_shown = 0      # how many of the process's events were reported
        self.calls_by_id = {}      # call id -> (tool, input) of calls still without a result
        self.record = None         # the running session's record (.ferrus/sessions/)
        self.record_due = 0.0      # clock value after which changed counts are written

    @property
    def state(self):
        return self.session.state

    def label(self):
        """The session state in words: a slot that has nothing to do is idle (its
        machine says Initializing or SessionComplete, which reads like activity)."""
        if self.process is None and self.session.state in (SS.INITIALIZING,
                                                           SS.SESSION_COMPLETE):
            return "idle"
        return self.session.state.value

    def describe(self, tool_calls=None):
        """``tool_calls``: the session's count as the controller knows it (its streamed
        output or its MCP servers' count); without it, only what the output showed."""
        text = "%s: %s" % (self.name, self.label())
        if self.process is not None and self.session.state in (SS.RUNNING, SS.INTERRUPTING):
            text += " (pid %d, %s)" % (self.process.pid, count_tool_calls(
                self.tool_calls if tool_calls is None else tool_calls))
        return text
