"""The far end of a place: what ferrus does there when an orchestrator asks.

The orchestrator (places.py) runs ferrus at a place with one request, a JSON object, and
reads one answer: a JSON line on stdout (or a byte stream, for git objects), an error as
``{"error", "hint"}`` with exit 1.  Requests name projects and tasks, never paths: every
path is made here, under the place's folder (``[places.NAME] dir``)::

    <dir>/ferrus-<hash>/                 ferrus as copied there (by content hash)
    <dir>/projects/<key>/checkout/       one project: a git repository with nothing checked
                                         out, its ferrus.toml and its .ferrus/ store
    <dir>/projects/<key>/tasks/<task>/   each task's worktree (a linked worktree of it)
    <dir>/projects/<key>/jobs/<task>/    each task's job: job.json, lease.json, job.log,
                                         messages.jsonl

A task runs there as a job: a supervisor process, detached from the connection that
started it, runs ``run-task`` (an HqController over the task's store, its agents and their
``ferrus serve`` beside it, confined when the place's [sandbox] says so) and ends it when
its lease runs out — the orchestrator renews the lease while it follows the task, so an
agent nobody watches any more stops within one lease.  ``follow`` streams the task's
journal entries and the controller's messages from where the orchestrator stopped reading,
with a beat line every few seconds (which renews the lease).
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from .basics import (LazyPattern, FerrusError, compact_json, deferred_dataclass, format_timestamp, new_id,
                     utc_now)
from .system import atomic_write, pid_alive, process_group_kwargs, process_start, read_text
from .task_machine import ACTIVE_STATES, StateData, TaskState
from .session_machine import SessionState
from .store import (CANCELLED_STATUS, RUNNING_STATUS, STATE_FILE, Store,
                    TASK_BRANCH_PREFIX, TASK_SCRATCH_FILES, read_task_record)
from .git import (_git_argv, _git_env, delete_task_refs, run_git, set_task_ref,
                  snapshot_worktree, task_ref)
from .worktrees import (_tree_of, create_task_worktree, move_task_worktree,
                        remove_review_checkout, remove_task_worktree, review_checkout_path)
from .operations import (HUMAN, ORCHESTRATOR, op_create_task, op_human_approve,
                         op_human_reject, task_diff_exclusions, task_git_site, task_title)
from .work import op_answer, op_integrated, op_integration_failed
from .task_queue import save_task_work, write_task_record
from .register import copy_agent_configuration, register_agents
from .sandbox_agents import AgentSandbox
from .bootstrap import check_copied_paths, unpack_local_files
from .places import place_probe
from .sessions import task_tokens_and_turns
from .orchestrator import Terminated, _raise_terminated, stop_orphaned_agents
from .controller import HqController
from .parallel import QUIET_EVENTS, run_worktree_setup
from .scaffold import init_project

PLACE_PROJECTS = "projects"
PLACE_CHECKOUT = "checkout"
PLACE_TASKS = "tasks"
PLACE_JOBS = "jobs"
# Names in a request: a project key (places.place_project_key) and a task id.
PLACE_PROJECT_RE = LazyPattern(r"^p-[0-9a-f]{12}$")
PLACE_TASK_RE = LazyPattern(r"^t-[0-9A-Za-z-]{1,60}$")
PLACE_COMMIT_RE = LazyPattern(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
# The branch the place's checkout stands on: unborn, so nothing is ever checked out there.
PLACE_CHECKOUT_BRANCH = "ferrus-place"
# Where the commits sent to a place wait for their task.
PLACE_REF_PREFIX = "refs/ferrus-place/"
# The controller's messages kept for `follow`: beyond this, running commentary is dropped.
PLACE_MESSAGES_MAX_BYTES = 8 * 1024 * 1024
# How a job ends: its agents get this long after SIGTERM.
PLACE_JOB_GRACE_SECS = 10.0


class PlaceRequestError(FerrusError):
    """A request the far end cannot carry out: answered as {"error", "hint"}, exit 1."""


# -- paths, from names only ----------------------------------------------------------------

@deferred_dataclass
class PlaceProject:
    """One project's folders at a place (see the module docstring)."""

    base: str
    key: str

    @property
    def folder(self):
        return os.path.join(self.base, PLACE_PROJECTS, self.key)

    @property
    def checkout(self):
        return os.path.join(self.folder, PLACE_CHECKOUT)

    def worktree(self, task):
        return os.path.join(self.folder, PLACE_TASKS, task)

    def job(self, task):
        return os.path.join(self.folder, PLACE_JOBS, task)

    def store(self):
        return Store(self.checkout)


def _project(base, request):
    key = request.get("project")
    if not isinstance(key, str) or not PLACE_PROJECT_RE.match(key):
        raise PlaceRequestError("no valid project key in the request: %r" % (key,),
                                "the orchestrator sends its project's key (p- and 12 hex)")
    return PlaceProject(base, key)


def _task(request):
    task = request.get("task")
    if not isinstance(task, str) or not PLACE_TASK_RE.match(task):
        raise PlaceRequestError("no valid task id in the request: %r" % (task,),
                                "`ferrus tasks` lists the task ids")
    return task


def _commit(value, what):
    if not isinstance(value, str) or not PLACE_COMMIT_RE.match(value):
        raise PlaceRequestError("%s %r is no commit id" % (what, value),
                                "the orchestrator sends full commit ids")
    return value


def _relative(value):
    """The project's folder inside its repository ("." at its top): never out of it."""
    value = value or "."
    parts = value.replace("\\", "/").split("/")
    if os.path.isabs(value) or ".." in parts:
        raise PlaceRequestError("the project folder %r leaves its repository" % value,
                                "the orchestrator sends a path inside the repository")
    return os.path.normpath(value)


# -- the entry point --------------------------------------------------------------------------

def place_side_main(request, base, program):
    """Carry out one request (the boot program calls this with the decoded request, the
    place's folder and the folder ferrus was copied to).  Returns the exit code."""
    out = sys.stdout.buffer
    op = request.get("op")
    handler = PLACE_OPS.get(op)
    try:
        if handler is None:
            raise PlaceRequestError("this ferrus at the place knows no request %r" % (op,),
                                    "the orchestrator and the place run the same ferrus; "
                                    "copy it again (`ferrus places` does)")
        answer = handler(request, base, program, sys.stdin.buffer, out)
    except FerrusError as err:
        out.write((compact_json({"error": err.message, "hint": err.hint or ""}) + "\n")
                  .encode("utf-8"))
        out.flush()
        return 1
    if answer is not None:
        out.write((compact_json(answer) + "\n").encode("utf-8"))
        out.flush()
    return 0


# -- probe: what the place has -------------------------------------------------------------

def _op_probe(request, base, program, stdin, out):
    # A program name, looked up on PATH there, or an absolute path there.
    binaries = [b for b in request.get("binaries") or [] if isinstance(b, str) and b and
                ("/" not in b or os.path.isabs(b))]
    for folder in request.get("path") or []:
        if isinstance(folder, str):
            os.environ["PATH"] = os.path.expanduser(folder) + os.pathsep + os.environ["PATH"]
    answer = place_probe(binaries)
    answer.update(ferrus=os.path.basename(program), jobs=place_jobs(base))
    return answer


# -- git: the place's repository, commits in and out ------------------------------------------

def _repository(project, create=False):
    """The checkout of ``project`` at the place: a git repository standing on an unborn
    branch (nothing checked out), made when ``create``."""
    checkout = project.checkout
    if not os.path.isdir(os.path.join(checkout, ".git")):
        if not create:
            raise PlaceRequestError("project %s has no repository at this place yet"
                                    % project.key, "the orchestrator sends commits first")
        os.makedirs(checkout, exist_ok=True)
        run_git(checkout, ["init", "-q"])
        run_git(checkout, ["symbolic-ref", "HEAD", "refs/heads/" + PLACE_CHECKOUT_BRANCH])
    return checkout


def _op_refs(request, base, program, stdin, out):
    """The commits the place's repository has at its refs' tips (for a thin pack)."""
    project = _project(base, request)
    if not os.path.isdir(os.path.join(project.checkout, ".git")):
        return {"commits": []}
    listed = run_git(project.checkout, ["for-each-ref", "--count=200", "--sort=-committerdate",
                                        "--format=%(objectname)", "refs/"])
    return {"commits": sorted(set(os.fsdecode(listed).split()))}


def _op_receive(request, base, program, stdin, out):
    """A pack on stdin into the place's repository; ``commit`` then waits at ``ref``."""
    project = _project(base, request)
    commit = _commit(request.get("commit"), "the commit")
    name = request.get("name") or ""
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,60}$", name):
        raise PlaceRequestError("no valid ref name %r" % (name,), "a task id or 'base'")
    checkout = _repository(project, create=True)
    proc = subprocess.Popen(_git_argv(["index-pack", "--stdin", "--fix-thin"]), cwd=checkout,
                            env=_git_env(), stdin=stdin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, said = proc.communicate()
    if proc.returncode != 0:
        raise PlaceRequestError("the commits did not arrive whole: git index-pack said %s" %
                                said.decode("utf-8", "replace").strip()[-300:],
                                "the connection may have dropped; the orchestrator sends "
                                "them again")
    run_git(checkout, ["update-ref", PLACE_REF_PREFIX + name, commit])
    return {"commit": commit}


def _op_send(request, base, program, stdin, out):
    """A pack of ``commit`` without what ``haves`` hold, on stdout."""
    project = _project(base, request)
    commit = _commit(request.get("commit"), "the commit")
    haves = [_commit(h, "a commit the orchestrator has") for h in request.get("haves") or []]
    checkout = _repository(project)
    try:
        run_git(checkout, ["cat-file", "-e", commit + "^{commit}"])
    except FerrusError:
        raise PlaceRequestError("commit %s is not in this place's repository" % commit[:12],
                                "it was never made or sent there; the task's journal at "
                                "the place names its submissions") from None
    known = set(run_git(checkout, ["cat-file", "--batch-check=%(objectname)"],
                        stdin=("\n".join(haves) + "\n").encode()).decode().split())
    revisions = [commit] + ["^" + h for h in haves if h in known]
    out.flush()
    done = subprocess.run(_git_argv(["pack-objects", "--revs", "--thin", "--stdout", "-q"]),
                          cwd=checkout, env=_git_env(),
                          input=("\n".join(revisions) + "\n").encode(), stdout=out,
                          stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise PlaceRequestError("git pack-objects failed at the place: %s" %
                                done.stderr.decode("utf-8", "replace").strip()[-300:],
                                "is the commit there? `ferrus places` checks the place")
    return None


# -- a task there: its worktree, its store ----------------------------------------------------

def _op_prepare(request, base, program, stdin, out):
    """The task's worktree on its branch from ``base``, the project's ferrus.toml and agent
    registration, and the task's store with the task created (Executing).  Idempotent:
    a prepare interrupted half-way is simply done again."""
    project = _project(base, request)
    task = _task(request)
    start = _commit(request.get("base"), "the task's base")
    inside = _relative(request.get("inside"))
    payload = json.loads(stdin.read().decode("utf-8") or "{}")
    checkout = _repository(project)
    store = project.store()
    if not os.path.isfile(store.path(STATE_FILE)):
        init_project(checkout, report=lambda message: None)
    config_text = payload.get("config")
    if isinstance(config_text, str) and read_text(os.path.join(checkout, "ferrus.toml"),
                                                  default=None) != config_text:
        atomic_write(os.path.join(checkout, "ferrus.toml"), config_text)
    choices = {role: tuple(choice) for role, choice in (payload.get("agents") or {}).items()
               if isinstance(choice, list) and len(choice) == 2}
    if choices:
        register_agents(checkout, choices, report=lambda message: None)
    worktree = project.worktree(task)
    workdir = worktree if inside == "." else os.path.join(worktree, inside)
    branch = TASK_BRANCH_PREFIX + task
    # The base stays reachable under the task's own ref, whoever sent it.
    run_git(checkout, ["update-ref", PLACE_REF_PREFIX + task, start])
    create_task_worktree(checkout, worktree, branch, start)
    copy_agent_configuration(checkout, workdir)
    text = payload.get("text") or ""
    record = read_task_record(store.dir, task)
    copied = payload.get("copied") if isinstance(payload.get("copied"), list) else []
    files = [f for f in payload.get("files") or [] if isinstance(f, dict)]
    check_copied_paths(copied, files)
    if not record:
        os.makedirs(store.path("tasks", task), exist_ok=True)
        atomic_write(store.path("tasks", task, "TASK.md"), text)
        record = {"id": task, "title": task_title(text), "status": RUNNING_STATUS,
                  "created_at": format_timestamp(utc_now()), "origin": {"by": "place"},
                  "worktree": worktree, "workdir": workdir, "branch": branch, "base": start,
                  "store": "worktree", "started_at": format_timestamp(utc_now())}
        if isinstance(payload.get("agent"), str):
            record["agent"] = payload["agent"]
        write_task_record(store, task, record)
    if copied or record.get("copied"):
        # [parallel] copy's files (copy_to_places): listed first, as here, so that none
        # can reach a submission unlisted; never part of the task's work.
        if record.get("copied") != copied:
            record = dict(record, copied=copied)
            write_task_record(store, task, record)
        unpack_local_files(workdir, copied, files)
    task_store = store.for_task(task)
    if not task_store.exists():
        atomic_write(task_store.task_path(STATE_FILE), StateData().to_json())
    if task_store.read_state().state == TaskState.IDLE:
        setup = [command for command in payload.get("setup") or [] if isinstance(command, str)]
        run_worktree_setup(store, workdir, setup, "the task's worktree at the place",
                           "fix the command (it runs in the new worktree there)")
        resume = payload.get("resume_from")
        if resume:
            # Retried after a cancel saved its work: the files go back as they were.
            run_git(task_git_site(task_store), ["restore", "--source=" + _commit(
                resume, "the saved work"), "--worktree", "--", ":/"])
        origin = payload.get("origin") or {}
        op_create_task(task_store, ORCHESTRATOR, text,
                       origin=(origin.get("spec"), origin.get("milestone")), task_id=task)
    answer = {"worktree": worktree, "workdir": workdir, "checkout": checkout, "branch": branch}
    if request.get("start"):
        # Its job starts in the same call: one round trip less per task.
        answer.update(_op_start(request, base, program, stdin, out))
    return answer


# -- jobs: a task's supervised process under a lease ------------------------------------------

@deferred_dataclass
class PlaceLease:
    """How long a job may go on unseen, by the supervisor's own monotonic clock: each new
    renewal token seen moves the deadline ``secs`` ahead (the wall clock may jump; the
    deadline does not)."""

    secs: float
    clock: object = time.monotonic
    token: object = None
    deadline: float = 0.0

    def __post_init__(self):
        self.deadline = self.clock() + self.secs

    def seen(self, token, secs=None):
        if token != self.token:
            self.token = token
            if secs:
                self.secs = secs
            self.deadline = self.clock() + self.secs

    def expired(self):
        return self.clock() >= self.deadline


def renew_lease(folder, secs):
    """A new renewal token in ``folder``/lease.json (the supervisor notices it)."""
    atomic_write(os.path.join(folder, "lease.json"), compact_json(
        {"token": os.urandom(8).hex(), "secs": secs}), durable=False)


def _read_json(path):
    try:
        value = json.loads(read_text(path, default="") or "{}")
    except (ValueError, OSError):
        return {}
    return value if isinstance(value, dict) else {}


def job_state(folder):
    """A job's job.json with "state" made true: "running" only while its supervisor is the
    same live process; "lost" when it died without saying how the job ended."""
    job = _read_json(os.path.join(folder, "job.json"))
    if not job:
        return {}
    if job.get("state") == "running":
        pid = job.get("pid")
        alive = isinstance(pid, int) and pid_alive(pid) and (
            job.get("start") is None or process_start(pid) == job.get("start"))
        if not alive:
            job["state"] = "lost"
    return job


def place_jobs(base):
    """Every task under ``base`` (a worktree or a job there): project, task, its job's
    state ("none" before its job started), why its job ended, when it started."""
    rows = []
    projects = os.path.join(base, PLACE_PROJECTS)
    for key in sorted(os.listdir(projects)) if os.path.isdir(projects) else []:
        project = PlaceProject(base, key)
        tasks = set()
        for sub in (PLACE_TASKS, PLACE_JOBS):
            folder = os.path.join(project.folder, sub)
            tasks.update(os.listdir(folder) if os.path.isdir(folder) else [])
        for task in sorted(tasks):
            job = job_state(project.job(task))
            rows.append({"project": key, "task": task, "state": job.get("state", "none"),
                         "reason": job.get("reason"), "started": job.get("started")})
    return rows


def _op_start(request, base, program, stdin, out):
    """Start the task's job (a detached supervisor running run-task), unless it runs."""
    project = _project(base, request)
    task = _task(request)
    lease = float(request.get("lease") or 90)
    folder = project.job(task)
    job = job_state(folder)
    if job.get("state") == "running":
        renew_lease(folder, lease)
        return {"job": job, "started": False}
    if not os.path.isdir(project.worktree(task)):
        raise PlaceRequestError("task %s has no worktree at this place" % task,
                                "the orchestrator prepares it first")
    os.makedirs(folder, exist_ok=True)
    renew_lease(folder, lease)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, "stop"))
    argv = place_self_argv(program, base, {"op": "supervise", "project": project.key,
                                           "task": task, "lease": lease})
    with open(os.path.join(folder, "job.log"), "ab") as log_file:
        proc = subprocess.Popen(argv, cwd=project.checkout, stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=log_file, **process_group_kwargs())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        job = job_state(folder)
        if job.get("pid") == proc.pid:
            return {"job": job, "started": True}
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    raise PlaceRequestError("the task's job did not start at the place (exit %s)" %
                            proc.poll(), "its log is %s there" %
                            os.path.join(folder, "job.log"))


def place_self_argv(program, base, request):
    """The argv that runs ``request`` with the ferrus copied to ``program``, from this
    machine itself (the supervisor and its job)."""
    import base64
    code = ("import sys; sys.path.insert(0, %r); import ferrus, json, base64; "
            "r = json.loads(base64.b64decode(sys.argv[1])); "
            "sys.exit(ferrus.place_side_main(r, %r, %r))" % (program, base, program))
    return [sys.executable, "-c", code,
            base64.b64encode(json.dumps(request).encode()).decode("ascii")]


def _op_supervise(request, base, program, stdin, out):
    """The job's supervisor: run-task in a process group of its own, ended when the lease
    runs out or a stop is asked for; job.json says how it went."""
    project = _project(base, request)
    task = _task(request)
    folder = project.job(task)
    record = {"pid": os.getpid(), "start": process_start(os.getpid()), "state": "running",
              "started": format_timestamp(utc_now()), "ferrus": os.path.basename(program)}
    atomic_write(os.path.join(folder, "job.json"), compact_json(record), durable=False)
    argv = place_self_argv(program, base, {"op": "run-task", "project": project.key,
                                           "task": task})
    with open(os.path.join(folder, "job.log"), "ab") as log_file:
        child = subprocess.Popen(argv, cwd=project.checkout, stdin=subprocess.DEVNULL,
                                 stdout=log_file, stderr=log_file, **process_group_kwargs())
    record["child"] = child.pid
    atomic_write(os.path.join(folder, "job.json"), compact_json(record), durable=False)
    lease = PlaceLease(float(request.get("lease") or 90))
    reason = supervise_job(child, folder, lease)
    if reason != "ended":
        for note in stop_orphaned_agents(project.store(), task):
            _log(folder, note)
    record.update(state="ended", exit=child.returncode, reason=reason,
                  ended=format_timestamp(utc_now()))
    atomic_write(os.path.join(folder, "job.json"), compact_json(record), durable=False)
    return None


def supervise_job(child, folder, lease, poll=0.25, sleep=time.sleep):
    """Wait for ``child``; end it when ``lease`` expires or a stop file appears.  Returns
    "ended" (it exited by itself), "lease expired" or "stopped"."""
    while child.poll() is None:
        kept = _read_json(os.path.join(folder, "lease.json"))
        lease.seen(kept.get("token"), kept.get("secs") if isinstance(kept.get("secs"),
                                                                      (int, float)) else None)
        reason = "stopped" if os.path.exists(os.path.join(folder, "stop")) else \
            "lease expired" if lease.expired() else None
        if reason:
            _end_group(child)
            return reason
        sleep(poll)
    return "ended"


def _end_group(child, grace=PLACE_JOB_GRACE_SECS):
    """SIGTERM to the job's process group (run-task stops its agents), SIGKILL after."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(grace)
        if child.poll() is not None:
            return


def _log(folder, text):
    with contextlib.suppress(OSError):
        with open(os.path.join(folder, "job.log"), "a", encoding="utf-8") as handle:
            handle.write("%s ferrus place: %s\n" % (format_timestamp(utc_now()), text))


class PlaceMessageLog:
    """The controller's messages, one JSON line each, for `follow` to stream: bounded, the
    running commentary (tool calls, heartbeats) dropped once the file is large."""

    def __init__(self, path, max_bytes=PLACE_MESSAGES_MAX_BYTES):
        self.path = path
        self.max_bytes = max_bytes

    def write(self, message):
        try:
            size = os.path.getsize(self.path)
        except OSError:
            size = 0
        if size > self.max_bytes and message.event in QUIET_EVENTS:
            return
        line = compact_json(dataclasses.asdict(message)) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)


def run_place_task(project, task, poll=0.05, clock=time.monotonic, stop=None):
    """The task's HqController at the place, until the task is Complete, Failed or
    cancelled (Integrating waits: the merge gate's verdict comes from the orchestrator).
    Returns 0, or 1 when its agents are stopped for good."""
    store = project.store()
    task_store = store.for_task(task)
    messages = PlaceMessageLog(os.path.join(project.job(task), "messages.jsonl"))
    controller = HqController(task_store, emit=messages.write, clock=clock,
                              executor_agent=read_task_record(store.dir, task).get("agent"))
    # The place's own [sandbox] (the orchestrator wrote it into the config it sent).
    confinement = AgentSandbox.for_task(task_store, store.config().sandbox, _agents(store))
    if confinement is not None:
        confinement.require()            # never unconfined: the job ends here instead
        controller.launcher = confinement.launcher_for(controller)
    try:
        while stop is None or not stop():
            controller.poll()
            data = task_store.read_state()
            if data.state in (TaskState.COMPLETE, TaskState.FAILED):
                controller.wind_down(poll)
                return 0
            if read_task_record(store.dir, task).get("status") == CANCELLED_STATUS:
                return 0
            if any(slot.state == SessionState.STOPPED for slot in controller.slots.values()) \
                    and not controller.running() and data.state in ACTIVE_STATES:
                return 1
            time.sleep(poll)
        return 0
    finally:
        controller.shutdown()
        if confinement is not None:
            confinement.close()


def _agents(store):
    config = store.config()
    return [choice.agent for choice in (config.supervisor, config.executor) if choice]


def _op_run_task(request, base, program, stdin, out):
    project = _project(base, request)
    task = _task(request)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        code = run_place_task(project, task)
    except Terminated:
        code = 143
    sys.exit(code)


def _op_stop(request, base, program, stdin, out):
    """Ask the task's job to stop (its agents end, their work stays in the worktree) and
    wait a little for it."""
    project = _project(base, request)
    task = _task(request)
    folder = project.job(task)
    if not os.path.isdir(folder):
        return {"job": {}}
    atomic_write(os.path.join(folder, "stop"), "stop\n", durable=False)
    deadline = time.monotonic() + float(request.get("wait") or 20)
    while time.monotonic() < deadline and job_state(folder).get("state") == "running":
        time.sleep(0.05)
    return {"job": job_state(folder)}


# -- acting on the task: answers, the human's word, the merge gate's verdict ------------------

def _op_act(request, base, program, stdin, out):
    project = _project(base, request)
    task = _task(request)
    action = request.get("action")
    text = stdin.read().decode("utf-8") if action in PLACE_TEXT_ACTIONS else ""
    store = project.store().for_task(task)
    if action == "renew":
        renew_lease(project.job(task), float(request.get("lease") or 90))
        return {"renewed": True}
    if action == "save":
        # A cancel keeps the work: the worktree there recorded as a commit on the task's
        # base (None when it holds nothing new), for the orchestrator to fetch.
        _, saved = save_task_work(project.store(), task,
                                  read_task_record(project.store().dir, task))
        return {"saved": saved}
    if action == "answer":
        outcome = op_answer(store, HUMAN, text)
    elif action == "approve":
        outcome = op_human_approve(store, HUMAN, via="place")
    elif action == "reject":
        outcome = op_human_reject(store, HUMAN, text, via="place")
    elif action == "integrated":
        outcome = op_integrated(store, ORCHESTRATOR)
    elif action == "integration_failed":
        onto = request.get("onto")
        move_to = request.get("move_to")
        if move_to:
            saved = move_worktree_there(project, task, _commit(move_to, "the merge gate's "
                                                               "candidate"))
        outcome = op_integration_failed(store, ORCHESTRATOR, text,
                                        onto=_commit(onto, "onto") if onto else None,
                                        **_act_detail(request))
    else:
        raise PlaceRequestError("no action %r" % (action,), "one of: %s" % ", ".join(
            PLACE_ACTIONS))
    # The commit's seq: the orchestrator knows that entry as its own act's echo.
    data = store.read_state()
    answer = {"message": outcome.text, "state": str(data.state), "rev": data.rev}
    if action == "integration_failed" and move_to:
        answer["saved"] = saved
    return answer


def _act_detail(request):
    """What the orchestrator's journal entry said of an act (its cause, files, failed
    checks), for the place's own entry: plain JSON values only."""
    detail = request.get("detail")
    return {key: value for key, value in detail.items() if isinstance(key, str) and
            key not in ("onto", "notes")} if isinstance(detail, dict) else {}


def move_worktree_there(project, task, commit):
    """The task's worktree there put at ``commit`` (the merge gate's candidate, sent there
    first) as the merge queue does here: what it held saved under a ref first when that is
    more than its last submission.  Returns that {"ref", "commit"}, or None."""
    store = project.store()
    task_store = store.for_task(task)
    data = task_store.read_state()
    submitted = data.task_submitted if isinstance(data.task_submitted, dict) else {}
    checkout = task_git_site(task_store)
    saved = None
    if isinstance(submitted.get("base"), str) and isinstance(submitted.get("commit"), str):
        held = snapshot_worktree(checkout, submitted["base"], task_diff_exclusions(task_store),
                                 "ferrus: the worktree of task %s before the merge queue "
                                 "moved it" % task)
        if _tree_of(project.checkout, held) != _tree_of(project.checkout,
                                                        submitted["commit"]):
            saved = {"ref": task_ref(task, new_id("saved")), "commit": held}
            set_task_ref(project.checkout, saved["ref"], held)
    branch = read_task_record(store.dir, task).get("branch") or TASK_BRANCH_PREFIX + task
    move_task_worktree(checkout, branch, commit)
    return saved


PLACE_ACTIONS = ("renew", "save", "answer", "approve", "reject", "integrated",
                 "integration_failed")
PLACE_TEXT_ACTIONS = ("answer", "reject", "integration_failed")


# -- follow: the task's journal and messages, as they come ------------------------------------

def _op_follow(request, base, program, stdin, out):
    project = _project(base, request)
    task = _task(request)
    follow_place_task(project, task, int(request.get("after") or 0),
                      int(request.get("messages_from") or 0), out,
                      beat=float(request.get("beat") or 2.0),
                      lease=float(request.get("lease") or 90))
    return None


# How long follow_place_task holds back a task's state whose journal line it has not read.
PLACE_VIEW_WAIT_SECS = 2.0


def follow_place_task(project, task, after, messages_from, out, beat=2.0, lease=90.0,
                      poll=0.02, clock=time.monotonic, sleep=time.sleep):
    """Stream to ``out`` the task's journal entries after seq ``after`` and the messages
    from byte ``messages_from`` on, one JSON line each; a beat line every ``beat`` seconds
    (renewing the job's lease); an end line once the job has ended and all is sent.
    Returns when that is written or ``out`` is gone (the connection dropped)."""
    store = project.store()
    folder = project.job(task)
    messages = os.path.join(folder, "messages.jsonl")
    position = None
    next_beat = clock()
    last_seq = after
    shown = None
    ahead_since = None
    try:
        while True:
            job = job_state(folder)
            lines = []
            entries, position = store.journal_since(position, last_seq)
            for entry in entries:
                last_seq = max(last_seq, entry["seq"])
                if entry.get("task_id") == task:
                    lines.append({"entry": entry})
            files = place_task_files(store, task, shown)
            rev = files["state"].get("rev") if files is not None else None
            if isinstance(rev, int) and rev > last_seq and (
                    ahead_since is None or clock() - ahead_since < PLACE_VIEW_WAIT_SECS):
                # Committed after the journal was read: the state goes with the entry that
                # led to it, in the next round (the orchestrator commits entries with the
                # state they led to; an entry after its state waited for a beat, and a
                # task merged before that beat lost it).  A line that never comes (its
                # write failed) holds the state back PLACE_VIEW_WAIT_SECS at most.
                ahead_since = clock() if ahead_since is None else ahead_since
                files = None
            if files is not None:
                ahead_since = None
                shown = rev
                lines.append({"task": files})
            batch, messages_from = _messages_after(messages, messages_from)
            lines += [{"message": message, "at": messages_from} for message in batch]
            now = clock()
            ended = job.get("state") in ("ended", "lost") and not entries and not batch
            if now >= next_beat or ended:
                if job.get("state") == "running":
                    renew_lease(folder, lease)
                tokens, turns = task_tokens_and_turns(store.for_task(task), task)
                lines.append({"beat": {"seq": last_seq, "at": messages_from,
                                       "job": job.get("state", "none"),
                                       "task": place_task_view(store, task),
                                       "usage": {"tokens": tokens, "turns": turns}}})
                next_beat = now + beat
            if ended:
                lines.append({"end": {"job": job, "task": place_task_view(store, task)}})
            if lines:
                out.write("".join(compact_json(line) + "\n" for line in lines).encode("utf-8"))
                out.flush()
            if ended:
                return
            sleep(poll)
    except (BrokenPipeError, ConnectionResetError):
        return


def _messages_after(path, offset, limit=256 * 1024):
    """(messages written after byte ``offset``, the offset after them): whole lines only."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(limit)
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    found = []
    for line in data[:end].splitlines():
        with contextlib.suppress(ValueError):
            found.append(json.loads(line.decode("utf-8", "replace")))
    return found, offset + end


# The task's files the orchestrator mirrors, each cut at this many bytes.
PLACE_FILE_BYTES = 64 * 1024


def place_task_files(store, task, shown_rev):
    """{"state": the task's STATE.json, "files": its scratch files} when its STATE.json is
    at another rev than ``shown_rev`` (None: never shown), else None: what an orchestrator
    needs to mirror the task (its status, its question, its review notes)."""
    task_store = store.for_task(task)
    try:
        state = json.loads(read_text(task_store.task_path(STATE_FILE), default="") or "{}")
    except (ValueError, OSError):
        return None
    if not isinstance(state, dict) or not state or (shown_rev is not None and
                                                    state.get("rev") == shown_rev):
        return None
    files = {}
    for name in TASK_SCRATCH_FILES:
        text = task_store.read_file(name)
        files[name] = text[:PLACE_FILE_BYTES]
    return {"state": state, "files": files}


def place_task_view(store, task):
    """Where the task stands there: {"state", "submitted": the full commit of its last
    submission (what the merge gate fetches), "n": its number}."""
    try:
        data = store.for_task(task).read_state()
    except FerrusError as err:
        return {"state": None, "problem": err.message}
    submitted = data.task_submitted or {}
    return {"state": str(data.state), "submitted": submitted.get("commit"),
            "n": submitted.get("n")}


# -- cleaning up: a task removed, what a killed run left --------------------------------------

def _op_remove(request, base, program, stdin, out):
    """Stop the task's job and remove its worktree, branch, store folder and job folder."""
    project = _project(base, request)
    task = _task(request)
    _op_stop(dict(request, wait=30), base, program, stdin, out)
    return {"removed": remove_place_task(project, task)}


def remove_place_task(project, task):
    removed = []
    worktree = project.worktree(task)
    if os.path.isdir(os.path.join(project.checkout, ".git")):
        with contextlib.suppress(FerrusError):
            remove_task_worktree(project.checkout, worktree, TASK_BRANCH_PREFIX + task)
            removed.append(worktree)
        with contextlib.suppress(FerrusError, OSError):
            # The reviewer's checkout of its submission, and its submission refs there
            # (what a cancel saved there was fetched first).
            if remove_review_checkout(project.checkout, worktree):
                removed.append(review_checkout_path(worktree))
        with contextlib.suppress(FerrusError):
            delete_task_refs(project.checkout, task, keep=())
        for name in (task, task + "-resume", task + "-onto"):
            with contextlib.suppress(FerrusError):
                run_git(project.checkout, ["update-ref", "-d", PLACE_REF_PREFIX + name])
    for folder in (worktree, project.store().path("tasks", task), project.job(task)):
        if os.path.isdir(folder):
            shutil.rmtree(folder, ignore_errors=True)
            if folder not in removed:
                removed.append(folder)
    return removed


def _op_clean(request, base, program, stdin, out):
    """What killed runs left: every task whose job is not running and that the
    orchestrator does not keep (``keep``: [project, task] pairs; only ``project``'s when
    given), and the copies of ferrus no running job uses."""
    keep = {tuple(pair) for pair in request.get("keep") or [] if isinstance(pair, list)}
    only = request.get("project")
    removed = []
    in_use = {os.path.basename(program)}
    for row in place_jobs(base):
        if row["state"] == "running":
            in_use.add(job_state(PlaceProject(base, row["project"]).job(row["task"]))
                       .get("ferrus"))
            continue
        if (row["project"], row["task"]) in keep or (only and row["project"] != only) or \
                not PLACE_PROJECT_RE.match(row["project"]) or not PLACE_TASK_RE.match(
                    row["task"]):
            continue
        removed += remove_place_task(PlaceProject(base, row["project"]), row["task"])
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if name.startswith("ferrus-") and name not in in_use and \
                os.path.isdir(os.path.join(base, name)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(os.path.join(base, name))
    return {"removed": removed}


def _op_jobs(request, base, program, stdin, out):
    return {"jobs": place_jobs(base)}


PLACE_OPS = {
    "probe": _op_probe, "refs": _op_refs, "receive": _op_receive, "send": _op_send,
    "prepare": _op_prepare, "start": _op_start, "supervise": _op_supervise,
    "run-task": _op_run_task, "stop": _op_stop, "act": _op_act, "follow": _op_follow,
    "remove": _op_remove, "clean": _op_clean, "jobs": _op_jobs,
}
