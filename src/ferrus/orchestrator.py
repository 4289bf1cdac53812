"""One orchestrator per project: the lock, and what a dead one left.

HQ, `ferrus run` and the pipeline orchestrator hold the lock; a second one refuses at
once and says who holds it; the agents and checks a dead holder left running are
stopped before anything new starts."""

import contextlib
import json
import os
import signal
import subprocess
import threading
import time

from .basics import FerrusError, format_timestamp, pretty_json, utc_now
from .system import FileLock, IS_WINDOWS, LockTimeout, atomic_write, pid_alive, read_text
from .store import FERRUS_DIR
from .work import op_release_sessions
from .mcp import session_task
from .agent_files import edit_json_file
from .sessions import (ORCHESTRATOR_RECORD, _host_name, close_orphaned_records,
                       describe_orchestrator, read_orchestrator_record)


# -- one orchestrator per project ------------------------------------------------------------
#
# HQ, `ferrus run` and the pipeline orchestrator each hold .ferrus/orchestrator.lock
# (the platform FileLock) for their whole life; .ferrus/orchestrator.json says who
# holds it.  The OS drops the lock when its holder dies however it dies, so a free
# lock with a record left behind means a dead holder: the agents it started are
# stopped (and their leases freed) before the new holder starts anything.

ORCHESTRATOR_LOCK = "orchestrator.lock"


def running_orchestrator(store):
    """Who holds the orchestrator lock, read without touching the lock (None: nobody).

    A record whose process is gone on this host was left by a holder that died."""
    record = read_orchestrator_record(store)
    if record is None:
        return None
    pid = record.get("pid")
    if record.get("host") == _host_name() and not (isinstance(pid, int) and pid_alive(pid)):
        return None
    return record


class OrchestratorLock:
    """The project's orchestrator lock, held from acquire() to release().

    ``notes`` lists what taking over from a dead holder did, for the caller to show."""

    def __init__(self, store, kind):
        self.store = store
        self.kind = kind
        self.notes = []
        self._lock = FileLock(store.path(ORCHESTRATOR_LOCK), 0,
                              "%s/%s" % (FERRUS_DIR, ORCHESTRATOR_LOCK))
        self._signals = {}

    def acquire(self):
        try:
            self._lock.acquire()
        except LockTimeout:
            holder = read_orchestrator_record(self.store)
            raise FerrusError(
                "another orchestrator is running on this project: %s"
                % describe_orchestrator(holder),
                "only one of HQ, `ferrus run` and `ferrus pipeline` drives a project at a time; "
                "use that one, or wait for it to end (`ferrus status` and `ferrus log` read "
                "along safely)") from None
        self._stop_on_termination()
        try:
            previous = read_orchestrator_record(self.store)
            if previous is not None and previous.get("pid") != os.getpid():
                self.notes.append("took over from %s, which ended without releasing the "
                                  "project" % describe_orchestrator(previous))
            atomic_write(self.store.path(ORCHESTRATOR_RECORD), pretty_json({
                "pid": os.getpid(), "kind": self.kind, "host": _host_name(),
                "started": format_timestamp(utc_now())}) + "\n")
            self.notes.extend(stop_orphaned_agents(self.store))
            self.notes.extend(close_orphaned_records(self.store))
        except BaseException:
            self.release()
            raise
        return self

    def _stop_on_termination(self):
        """SIGTERM and SIGHUP (a closed terminal, `kill`) end the orchestrator the way
        Ctrl+C does, so its agents are stopped and their leases freed; by default they
        would kill ferrus alone and leave its agents working unsupervised."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in ("SIGTERM", "SIGHUP"):
            number = getattr(signal, name, None)
            if number is not None:
                self._signals[number] = signal.signal(number, _raise_terminated)

    def release(self):
        for number, previous in self._signals.items():
            signal.signal(number, previous)
        self._signals.clear()
        with contextlib.suppress(OSError):
            record = read_orchestrator_record(self.store)
            if record is not None and record.get("pid") == os.getpid():
                os.unlink(self.store.path(ORCHESTRATOR_RECORD))
        self._lock.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP while orchestrating: unwinds like Ctrl+C; exit 128 + signal."""

    def __init__(self, signum):
        super().__init__(signum)
        self.exit_code = 128 + signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def _is_agent_group(pid):
    """Is ``pid`` alive and the leader of its own process group, as every agent HQ starts
    is?  A pid reused by an unrelated process is almost never a group leader."""
    if not pid_alive(pid):
        return False
    if IS_WINDOWS:  # pragma: no cover
        return True
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _stop_process_group(pid, grace=2.0):
    if IS_WINDOWS:  # pragma: no cover
        subprocess.run(["taskkill", "/T", "/F", "/PID", str(pid)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline and pid_alive(pid):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.02)
        if not pid_alive(pid):
            return


def stop_orphaned_agents(store, task=None):
    """Stop the agents a dead orchestrator left running (only parallel task ``task``'s,
    when given) and free the leases of their sessions; returns what was done, one line
    each.

    HQ's agents cannot be adopted — their output pipes died with their orchestrator, so
    nobody could read what they report — so they are stopped; the task state in
    STATE.json is kept and the next session starts from it.  Pipeline workers write
    files, not pipes, and are adopted by the pipeline orchestrator instead."""
    path = store.path("agents.json")
    if not os.path.isfile(path):
        return []
    try:
        registry = json.loads(read_text(path) or "{}")
        entries = [e for e in registry.get("agents") or []
                   if isinstance(e, dict) and e.get("status") == "running"
                   and (task is None or session_task(e.get("session")) == task)]
    except (ValueError, OSError, AttributeError) as err:
        return ["could not read %s/agents.json (%s): agents a previous orchestrator started "
                "may still be running" % (FERRUS_DIR, err)]
    notes, sessions = [], []
    for entry in entries:
        pid = entry.get("pid")
        if isinstance(pid, int) and not isinstance(pid, bool) and _is_agent_group(pid):
            _stop_process_group(pid)
            notes.append("stopped the %s (pid %d) that the previous orchestrator left running"
                         % (entry.get("name", "agent"), pid))
        if entry.get("session"):
            sessions.append(entry["session"])
    if entries:
        def mark(data):
            for entry in data.get("agents") or []:
                if isinstance(entry, dict) and entry.get("status") == "running" and (
                        task is None or session_task(entry.get("session")) == task):
                    entry.update(status="suspended", pid=None)
        with contextlib.suppress(FerrusError):
            with store.lock():
                edit_json_file(path, mark)
    by_task = {}
    for session in sessions:
        by_task.setdefault(session_task(session), []).append(session)
    for owner, stopped in sorted(by_task.items(), key=lambda item: item[0] or ""):
        task_store = store if owner is None else store.for_task(owner)
        if owner is not None and not task_store.exists():
            continue
        with contextlib.suppress(FerrusError):
            released = op_release_sessions(task_store, stopped)
            if released:
                notes.append("freed the %s lease, held by the stopped %s" % (
                    "task's" if owner is None else "task %s's" % owner, released))
    return notes


def clear_capacity_checkpoint(store):
    with store.transaction("hq") as tx:
        if "capacity_checkpoint" in tx.state.extra:
            data = tx.state.copy()
            del data.extra["capacity_checkpoint"]
            tx.set(data, "capacity_continue")


# STATE.json's count of the sessions HQ started for the current task.
TASK_SESSIONS_KEY = "task_sessions"


def task_sessions_started(data, otherwise=0):
    """Sessions started for ``data``'s task so far (all HQs, across restarts), as its
    STATE.json counts them; ``otherwise`` when it does not."""
    counter = data.extra.get(TASK_SESSIONS_KEY)
    if isinstance(counter, dict) and counter.get("task_id") == data.task_id and \
            isinstance(counter.get("sessions"), int):
        return counter["sessions"]
    return otherwise
