"""Pipeline parts: workflows.json, worker processes, run records.

A file-driven pipeline automaton in three parts (ARCHITECTURE.md, 'Pipeline
automaton'): workflows.json holds static definitions (phases, their workers, agent,
model, timeout, reads, final, pause_after); status.json, one per run in
.ferrus/pipelines/<name>-<stamp>/, is written only by the orchestrator; workers are
agent sessions that write <run folder>/<role>.md and exit — the file existing is the
completion signal.  A dispatch is recorded before its process exists, and workers
outlive a killed orchestrator, which adopts them when it restarts."""

import contextlib
import datetime as _dt
import json
import os
import subprocess
import sys
import time

from .basics import (FerrusError, LazyPattern, deferred_dataclass, format_duration,
                     format_timestamp, random_hex)
from .system import (IS_WINDOWS, atomic_write, kill_process_tree, open_private_log,
                     pid_alive, process_group_kwargs, read_text)
from .config import BUILTIN_AGENTS, _describe_value, load_config
from .session_machine import SS, SessionEvent, backoff_ms
from .agents import tool_denied, tool_display_name, tool_failure_line, tool_line
from .register import adapter_for
from .prompts import prompt_pipeline_worker
from .sessions import (HqMessage, close_session_record, open_session_record,
                       read_session_records, usage_from_log, write_session_record)


PIPELINES_DIR, PIPELINE_ARCHIVE = "pipelines", "archive"
PIPELINE_GRACE_SECS = 120          # the grace beyond a phase's timeout
SPAWN_GRACE_SECS = 10              # how long a recorded spawn may take to show its pid
WORKER_RUNNING = ("spawning", "running")
_PIPELINE_NAME_RE = LazyPattern(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_ROLE_RE = LazyPattern(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# A worker entry in status.json *is* its session (see ARCHITECTURE.md, 'Session state
# machine'), persisted.
_SESSION_OF = {"pending": SS.INITIALIZING, "spawning": SS.SPAWNING, "running": SS.RUNNING,
               "cooling": SS.COOLING_DOWN, "completed": SS.SESSION_COMPLETE,
               "failed": SS.STOPPED, "cancelled": SS.STOPPED}
_STATUS_OF = {SS.INITIALIZING: "pending", SS.BUILDING_PROMPT: "pending",
              SS.SPAWNING: "spawning", SS.RUNNING: "running", SS.COOLING_DOWN: "cooling",
              SS.SESSION_COMPLETE: "completed", SS.STOPPED: "failed"}


def pipelines_config(root):
    """[pipelines] from ferrus.toml (validated with the whole file by load_config)."""
    return load_config(root).pipelines


# -- definitions ------------------------------------------------------------------------------

@deferred_dataclass(frozen=True)
class WorkerDef:
    """One worker of a pipeline phase, as workflows.json defines it."""

    role: str
    task: str
    timeout: int
    agent: str = ""                # "" means [hq.executor]'s agent, fixed when a run starts
    model: str = ""
    reads: tuple = ()
    final: bool = False

    @property
    def output(self):
        return self.role + ".md"


@deferred_dataclass(frozen=True)
class PhaseDef:
    """One phase of a pipeline, as workflows.json defines it."""

    id: str
    mode: str                      # parallel | sequential
    workers: tuple
    pause_after: bool = False

    @property
    def timeout(self):
        return max(worker.timeout for worker in self.workers)


@deferred_dataclass(frozen=True)
class PipelineDef:
    """One pipeline of workflows.json."""

    name: str
    description: str
    phases: tuple

    def final_worker(self):
        return next(w for w in self.phases[-1].workers if w.final)


_NOTHING = object()


def _check(ok, path, where, message, got=_NOTHING):
    """Raise the precise error for one JSON path unless ``ok``."""
    if not ok:
        text = "%s: %s %s" % (path, where, message)
        if got is not _NOTHING:
            text += ", got %s" % _describe_value(got)
        raise FerrusError(text, "edit %s (`ferrus pipeline init` writes a commented example)"
                          % path)


def _check_keys(path, where, value, allowed, required):
    _check(isinstance(value, dict), path, where, "must be an object", value)
    for key in value:
        _check(key in allowed, path, "%s.%s" % (where, key),
               "is not a known key (known: %s)" % ", ".join(allowed))
    for key in required:
        _check(key in value, path, where, "needs %s" % json.dumps(key))


def _check_text(path, where, value, pattern=None, what="a non-empty string"):
    _check(isinstance(value, str) and value.strip() and (pattern is None or
                                                         pattern.match(value)),
           path, where, "must be " + what, value)
    return value.strip()


def parse_workflows(text, path, known_agents=None):
    """Validate workflows.json text into {name: PipelineDef}.

    ``known_agents`` None skips the agent check (a run's own snapshot, whose agents
    were checked when the run began)."""
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise FerrusError("%s is not valid JSON: %s" % (path, err),
                          "fix the syntax (`ferrus pipeline init` in a project without a workflows "
                          "file writes a valid example)") from err
    _check(isinstance(raw, dict), path, "the top level", "must be an object of pipelines", raw)
    # JSON has no comments, so one top-level "_comment" key may hold them.
    return {name: _parse_pipeline(path, name, body, known_agents)
            for name, body in raw.items() if name != "_comment"}


def _parse_pipeline(path, name, body, known_agents):
    _check_text(path, name, name, _PIPELINE_NAME_RE,
                "a pipeline name of letters, digits, - and _ (it names the run folder)")
    _check_keys(path, name, body, ("description", "phases"), ("phases",))
    _check(isinstance(body.get("description", ""), str), path, name + ".description",
           "must be a string", body.get("description"))
    raw_phases = body["phases"]
    _check(isinstance(raw_phases, list) and raw_phases, path, name + ".phases",
           "must be a non-empty array", raw_phases)
    phases, produced, finals = [], set(), []
    for p_index, raw in enumerate(raw_phases):
        where = "%s.phases[%d]" % (name, p_index)
        _check_keys(path, where, raw, ("id", "mode", "pause_after", "workers"),
                    ("id", "mode", "workers"))
        phase_id = _check_text(path, where + ".id", raw["id"])
        _check(phase_id not in [p.id for p in phases], path, where + ".id",
               "repeats the phase id %s" % json.dumps(phase_id))
        _check(raw["mode"] in ("parallel", "sequential"), path, where + ".mode",
               "must be \"parallel\" or \"sequential\"", raw["mode"])
        pause_after = raw.get("pause_after", False)
        _check(isinstance(pause_after, bool), path, where + ".pause_after",
               "must be true or false", pause_after)
        _check(not (pause_after and p_index == len(raw_phases) - 1), path, where + ".pause_after",
               "is on the last phase, which delivers instead of waiting")
        _check(isinstance(raw["workers"], list) and raw["workers"], path, where + ".workers",
               "must be a non-empty array", raw["workers"])
        workers = []
        for w_index, raw_worker in enumerate(raw["workers"]):
            at = "%s.workers[%d]" % (where, w_index)
            worker = _parse_worker(path, at, raw_worker, produced, known_agents)
            _check(worker.output not in produced | {w.output for w in workers}, path,
                   at + ".role", "repeats the role %s (roles name the output files, so they "
                   "are unique in a pipeline)" % json.dumps(worker.role))
            if worker.final:
                finals.append((worker.role, p_index, at + ".final"))
            workers.append(worker)
        produced |= {w.output for w in workers}          # readable from the next phase on
        phases.append(PhaseDef(phase_id, raw["mode"], tuple(workers), pause_after))
    _check(len(finals) == 1, path, name, "has %s final workers%s; exactly one worker, in the "
           "last phase, must have \"final\": true (its output is the result)" % (
               len(finals) or "no", " (%s)" % ", ".join(f[0] for f in finals) if finals else ""))
    _check(finals[0][1] == len(phases) - 1, path, finals[0][2],
           "marks a worker outside the last phase; the final worker must be in the last phase")
    return PipelineDef(name, body.get("description", ""), tuple(phases))


def _parse_worker(path, where, raw, produced, known_agents):
    _check_keys(path, where, raw, ("role", "agent", "model", "timeout", "task", "reads", "final"),
                ("role", "timeout", "task"))
    role = _check_text(path, where + ".role", raw["role"], _ROLE_RE,
                       "a role of letters, digits, '.', - and _ (it names <role>.md)")
    timeout = raw["timeout"]
    _check(type(timeout) is int and 0 < timeout <= 604800, path, where + ".timeout",
           "must be a number of seconds from 1 to 604800", timeout)
    for key in ("agent", "model"):
        _check(isinstance(raw.get(key, ""), str), path, "%s.%s" % (where, key),
               "must be a string", raw.get(key))
    agent = raw.get("agent", "").strip()
    _check(not agent or known_agents is None or agent in known_agents, path, where + ".agent",
           "names the unknown agent %s (known: %s)" % (json.dumps(agent),
                                                       ", ".join(known_agents or ())))
    reads = raw.get("reads", [])
    _check(isinstance(reads, list) and all(isinstance(r, str) for r in reads), path,
           where + ".reads", "must be an array of file names", reads)
    for name in reads:
        _check(name in produced, path, where + ".reads", "names %s, which no worker of an "
               "earlier phase writes (earlier outputs: %s)" % (
                   json.dumps(name), ", ".join(sorted(produced)) or "none"))
    final = raw.get("final", False)
    _check(isinstance(final, bool), path, where + ".final", "must be true or false", final)
    return WorkerDef(role, _check_text(path, where + ".task", raw["task"]), timeout, agent,
                     raw.get("model", "").strip(), tuple(reads), final)


def read_workflows(root, config):
    """(file name, its text, {name: PipelineDef}) checked against the project's agents."""
    name = pipelines_config(root).file
    try:
        text = read_text(os.path.join(root, name))
    except FileNotFoundError:
        raise FerrusError("%s not found in %s" % (name, root),
                          "`ferrus pipeline init` writes an example to edit") from None
    return name, text, parse_workflows(text, name, BUILTIN_AGENTS + tuple(config.agents.custom))


def pipeline_worker_launch(config, agent, root, prompt, model, reads=(), output=None):
    """One worker's Launch: headless, without ferrus's tools (a worker must not claim
    or submit the main task), allowed to write its output file (section 14)."""
    adapter = adapter_for(config, agent)
    if not adapter.executable():
        raise FerrusError("%s is not installed" % adapter.binary, adapter.install_hint())
    return adapter.worker(root, prompt, model, output, reads)


# -- worker processes --------------------------------------------------------------------------

# Runs as `python -c` in front of the agent: it records its pid, then becomes the
# agent.  exec keeps the pid on POSIX; Windows has no exec, so there the wrapper waits.
_PID_WRAPPER = (
    "import os, subprocess, sys\n"
    "with open(sys.argv[1] + '.tmp', 'w') as handle:\n"
    "    handle.write(str(os.getpid()))\n"
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "if os.name == 'nt':\n"
    "    sys.exit(subprocess.call(sys.argv[2:]))\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def start_worker_process(launch, root, base):
    """Start a worker that outlives us.  It gets its own process group, reads its
    prompt from ``base``.prompt, writes to ``base``.log, and records its pid in
    ``base``.pid.  None of our pipes is passed to it."""
    env = dict(os.environ)
    env.update(launch.env)
    env["PWD"] = os.path.abspath(root)         # opencode takes its folder from $PWD
    stdin = subprocess.DEVNULL
    if launch.stdin is not None:
        atomic_write(base + ".prompt", launch.stdin)
        stdin = open(base + ".prompt", "rb")
    try:
        with open_private_log(base + ".log") as log_file:
            log_file.write(("$ %s\n" % " ".join(launch.argv)).encode("utf-8", "replace"))
            log_file.flush()
            return subprocess.Popen([sys.executable, "-c", _PID_WRAPPER, base + ".pid"] +
                                    list(launch.argv), cwd=root, env=env, stdin=stdin,
                                    stdout=log_file, stderr=subprocess.STDOUT,
                                    **process_group_kwargs())
    finally:
        if stdin is not subprocess.DEVNULL:
            stdin.close()


def worker_pid_running(pid):
    """pid_alive, except that the zombie an exited worker leaves behind counts as gone."""
    if not IS_WINDOWS:
        with contextlib.suppress(ChildProcessError, OSError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:     # our own child: reaped now
                return False
    if not pid_alive(pid):
        return False
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:   # Linux marks a zombie 'Z'
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class AdoptedWorker:
    """A worker that an earlier orchestrator started; all we know of it is its pid."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and not worker_pid_running(self.pid):
            self.returncode = "unknown"
        return self.returncode


# -- runs ---------------------------------------------------------------------------------------

@deferred_dataclass
class PipelineRun:
    """One run of a pipeline: its folder and its status.json."""

    name: str
    path: str
    archived: bool
    status: dict
    definition: "PipelineDef | None" = None

    def file(self, *parts):
        return os.path.join(self.path, *parts)

    def phase(self):
        return self.status["phases"][self.status["current_phase"]]


_UNPRINTABLE = LazyPattern("[\x00-\x1f\x7f-\x9f]")


def summarize_output(path, label, max_lines=3, width=100, chunk=65536):
    """Lines telling a human what one worker's output holds without opening it: its
    size and its first non-empty lines (summarise, then wait).  Reads at
    most ``chunk`` bytes, so a huge output costs nothing."""
    try:
        size = os.path.getsize(path)
        with open(path, "r", encoding="utf-8", errors="replace") as handle:
            head = handle.read(chunk)
    except OSError as err:
        return ["  - %s (unreadable: %s)" % (label, err.strerror or err)]
    lines = [line.strip() for line in head.splitlines() if line.strip()]
    words = len(head.split())
    if size <= chunk:
        about = "%d non-empty line%s, %d words" % (len(lines), "s"[len(lines) == 1:], words)
    else:
        about = "%d bytes" % size
    summary = ["  - %s (%s)" % (label, about)]
    for line in lines[:max_lines]:
        line = _UNPRINTABLE.sub("?", line)
        summary.append("      " + (line if len(line) <= width else line[:width - 1] + "…"))
    if len(lines) > max_lines or size > chunk:
        summary.append("      …")
    return summary


@deferred_dataclass
class PipelineOutcome:
    """Where a run stands: running, blocked, paused, failed, delivered or cancelled.
    Every state except running needs a human or is final."""

    run: str
    state: str
    message: str = ""
    output: "str | None" = None     # delivered: the final output file, and its text
    text: "str | None" = None

    @property
    def finished(self):
        return self.state != "running"


def _new_worker(attempts=0):
    return {"status": "pending", "session": "", "pid": None, "started_at": None,
            "attempts": attempts, "token": "", "errors": 0, "total_errors": 0,
            "retry_at": None, "message": ""}


def _has_output(path):
    with contextlib.suppress(OSError):
        return os.path.getsize(path) > 0
    return False


def list_runs(store):
    """[(name, path, archived)] for every run: active ones first, newest first."""
    runs = []
    for archived, folder in ((False, store.path(PIPELINES_DIR)),
                             (True, store.path(PIPELINES_DIR, PIPELINE_ARCHIVE))):
        with contextlib.suppress(FileNotFoundError):
            runs += [(n, os.path.join(folder, n), archived)
                     for n in sorted(os.listdir(folder), reverse=True)
                     if os.path.isfile(os.path.join(folder, n, "status.json"))]
    return runs


def find_run(store, ref):
    """A run by its folder name or by a unique prefix of it."""
    runs = list_runs(store)
    matches = [r for r in runs if r[0] == ref] or [r for r in runs if r[0].startswith(ref)]
    if not matches:
        raise FerrusError("no pipeline run matches %s" % json.dumps(ref),
                          "`ferrus pipeline status` lists the runs")
    if len(matches) > 1:
        raise FerrusError("%s matches several runs: %s" % (
            json.dumps(ref), ", ".join(r[0] for r in matches)), "give more of the name")
    return matches[0]


def read_run(store, ref, with_definition=False):
    """A run's status.json (and its workflow.json snapshot), checked for damage."""
    name, path, archived = find_run(store, ref)
    where = store.relpath(os.path.join(path, "status.json"))
    hint = "repair it by hand (`ferrus log` shows what happened), or move %s away and start " \
        "a new run" % store.relpath(path)
    try:
        status = json.loads(read_text(os.path.join(path, "status.json")))
        for phase in status["phases"]:
            phase["workers"] = {role: dict(_new_worker(), **entry)
                                for role, entry in phase["workers"].items()}
        if not 0 <= status["current_phase"] < len(status["phases"]):
            raise IndexError("current_phase %r is not a phase" % status["current_phase"])
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise FerrusError("%s is damaged (%s: %s)" % (where, type(err).__name__, err),
                          hint) from err
    run = PipelineRun(name, path, archived, status)
    if with_definition:
        snapshot = os.path.join(path, "workflow.json")
        run.definition = parse_workflows(read_text(snapshot), store.relpath(snapshot))[
            status["pipeline"]]
        if [(p.id, sorted(w.role for w in p.workers)) for p in run.definition.phases] != \
                [(p.get("id"), sorted(p["workers"])) for p in status["phases"]]:
            raise FerrusError("%s does not match the run's workflow.json" % where, hint)
    return run


def run_state(status):
    """running | paused | failed | delivered | cancelled, as status.json has it."""
    if status.get("cancelled"):
        return "cancelled"
    if status.get("result_delivered"):
        return "delivered"
    if any(p["status"] == "failed" for p in status["phases"]):
        return "failed"
    return "paused" if status.get("paused") else "running"


class PipelineWorkers:
    """The worker processes of a pipeline run: started, watched, adopted after a
    restart, stopped, and their session records kept."""

    def _exited(self, run, worker, entry, why):
        """A session ended without output: the session machine decides between a retry
        and a stop."""
        _, effect = self._step(run, worker.role, SessionEvent("SessionExited", outcome="error"))
        entry.update(pid=None, message=why)
        if entry["status"] == "cooling":
            wait = backoff_ms(entry["errors"]) / 1000.0
            entry["retry_at"] = format_timestamp(self.clock() + _dt.timedelta(seconds=wait))
            self._note(run, "worker_failed", "%s %s; retrying in %s (error %d in a row)" % (
                worker.role, why, format_duration(wait), entry["errors"]), "warning",
                role=worker.role, retry_in=wait, attempt=entry["attempts"])
        else:
            entry["message"] = "%s (%s)" % (why, effect[1])
            self._note(run, "worker_failed", "%s %s; %s" % (worker.role, why, effect[1]),
                       "error", role=worker.role, attempt=entry["attempts"])

    def _process(self, run, role, entry):
        """The worker's process: ours, or one adopted by the pid in status.json or its pid file."""
        token, process = self._processes.get((run.name, role), (None, None))
        if process is not None and token == entry["token"]:
            return process
        pid = entry["pid"]
        with contextlib.suppress(OSError, ValueError):
            pid = pid or int(read_text(self._base(run, role, entry) + ".pid"))
        if not pid:
            return None
        self._processes[(run.name, role)] = (entry["token"], AdoptedWorker(pid))
        return self._processes[(run.name, role)][1]

    @staticmethod
    def _record_id(run, role, entry):
        """A worker attempt's record is named by the run, role and attempt, so whichever
        orchestrator sees the attempt end can close it."""
        return "w-%s-%s-%d" % (run.name, role, entry["attempts"])

    def _settle_records(self, run):
        """Close the record of every worker attempt that is over and whose process has
        exited; its counts are read from its log, which then holds all of its output."""
        records = {r["id"]: r for r in read_session_records(self.store)
                   if r.get("pipeline") == run.name and r.get("status") == "running"}
        if not records:
            return
        workers = {w.role: w for p in run.definition.phases for w in p.workers}
        for phase in run.status["phases"]:
            for role, entry in phase["workers"].items():
                record = records.get(self._record_id(run, role, entry))
                if record is None or entry["status"] in WORKER_RUNNING:
                    continue
                token, process = self._processes.get((run.name, role), (None, None))
                if process is not None and token == entry["token"]:
                    if process.poll() is None:
                        continue        # it wrote its output and is still finishing
                elif isinstance(record.get("pid"), int) and worker_pid_running(record["pid"]):
                    continue
                tally = None
                with contextlib.suppress(FerrusError):
                    worker = workers.get(role)
                    parse_line = adapter_for(self.config, worker.agent if worker else
                                             record.get("agent") or "").parse_line
                    tally = usage_from_log(self._base(run, role, entry) + ".log", parse_line)
                close_session_record(self.store, dict(record),
                                     self._RECORD_OUTCOME.get(entry["status"], entry["status"]),
                                     getattr(process, "returncode", None)
                                     if token == entry["token"] else None, tally,
                                     entry.get("message") or None)

    def _relocate_records(self, run, old_path):
        """The run folder moved (to the archive): its records name the logs' new place."""
        old, new = self.store.relpath(old_path) + "/", self.store.relpath(run.path) + "/"
        for shared in read_session_records(self.store):
            if shared.get("pipeline") == run.name and str(shared.get("log")).startswith(old):
                record = dict(shared, log=new + shared["log"][len(old):])
                with contextlib.suppress(OSError):
                    write_session_record(self.store, record)

    def await_workers(self, ref, grace=10.0, poll_interval=0.1):
        """After a run ends: give its workers that are still finishing (their output is
        written, their last words are not) a moment to exit, so their records get the
        final counts and cost; whatever still runs after ``grace`` is closed later."""
        run = read_run(self.store, ref)
        over = {role for p in run.status["phases"] for role, w in p["workers"].items()
                if w["status"] not in WORKER_RUNNING}
        finishing = [process for (name, role), (_, process) in list(self._processes.items())
                     if name == run.name and role in over]
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in finishing):
            time.sleep(poll_interval)
        with self._lock():
            run = read_run(self.store, ref, with_definition=True)
            self._settle_records(run)
            self._sweep(run)

    def _sweep(self, run):
        """Forget, and so reap, the exited processes whose exit is already recorded."""
        watched = {role for p in run.status["phases"]
                   for role, w in p["workers"].items() if w["status"] in WORKER_RUNNING}
        for key, (_, process) in list(self._processes.items()):
            if key[0] == run.name and key[1] not in watched and process.poll() is not None:
                del self._processes[key]

    def _spawn(self, run, worker, entry, throttled=False):
        """spawning (the dispatch record, saved first), then start, then running with a pid."""
        self._step(run, worker.role, SessionEvent("BackoffElapsed" if entry["status"] == "cooling"
                                                  else "WorktreeReady"))
        reads = [run.file(name) for name in worker.reads]
        prompt = prompt_pipeline_worker(run.status["topic"], worker.task, reads,
                                        run.file(worker.output))
        self._step(run, worker.role, SessionEvent("PromptReady", prompt))
        run.status["retry_count"] += bool(entry["attempts"])
        token = random_hex(4)
        entry.update(status="spawning", token=token, attempts=entry["attempts"] + 1, pid=None,
                     session="pipeline:%s:%s:%s" % (run.name, worker.role, token),
                     started_at=self._now(), retry_at=None)
        self._save(run)
        try:
            launch = pipeline_worker_launch(self.config, worker.agent, self.store.root, prompt,
                                            worker.model, reads, run.file(worker.output))
            process = self.spawner(launch, self.store.root, self._base(run, worker.role, entry))
        except FerrusError as err:
            self._step(run, worker.role, SessionEvent("FatalError", err.full_text()))
            entry["message"] = err.full_text()
            self._note(run, "worker_failed", "%s cannot start: %s" % (worker.role, err.message),
                       "error", role=worker.role)
            return
        except OSError as err:
            self._exited(run, worker, entry, "could not start: %s" % err)
            return
        self._processes[(run.name, worker.role)] = (token, process)
        open_session_record(self.store, self._record_id(run, worker.role, entry), slot="worker",
                            role=worker.role, agent=worker.agent, model=worker.model or "",
                            pipeline=run.name, pid=process.pid,
                            log=self.store.relpath(self._base(run, worker.role, entry) + ".log"),
                            argv=list(launch.argv), prompt=prompt)
        self._step(run, worker.role, SessionEvent("SessionStarted", entry["attempts"]))
        entry.update(pid=process.pid, message="")
        self._note(run, "worker_spawned", "%s spawned (pid %d, attempt %d, agent %s)%s" % (
            worker.role, process.pid, entry["attempts"], worker.agent,
            " after a capacity throttle" if throttled else ""), "agent", role=worker.role,
            pid=process.pid, attempt=entry["attempts"], token=token, throttled=throttled)
        self._save(run)

    def _stop_workers(self, run, status, why):
        """Kill the current phase's running workers and leave each in ``status``."""
        stopped = []
        for role, entry in run.phase()["workers"].items():
            if entry["status"] in WORKER_RUNNING:
                process = self._process(run, role, entry)
                if process is not None and process.poll() is None:
                    kill_process_tree(process)
                self._step(run, role, SessionEvent("OperatorStop"))
                # As in HQ after OperatorStop: the next dispatch is a fresh session.
                entry.update(status=status, pid=None, errors=0, message=why)
                stopped.append(role)
                self._note(run, "worker_stopped", "%s stopped (%s)" % (role, why), "warning",
                           role=role)
        return stopped

    def _read_worker_log(self, run, role, entry, watched):
        try:
            with open(self._base(run, role, entry) + ".log", "rb") as handle:
                handle.seek(watched["offset"])
                data = handle.read(self.WATCH_READ_BYTES)
        except OSError:
            return
        watched["offset"] += len(data)
        lines = (watched["rest"] + data).split(b"\n")
        watched["rest"] = lines.pop()[-self.WATCH_READ_BYTES:]
        for raw in lines:
            line = raw.decode("utf-8", "replace").strip()
            if not line or line.startswith("$ "):      # the command line ferrus wrote
                continue
            if not line.startswith("{"):
                watched["said"] = line[:200]
            events = []
            if watched["parse"] is not None:
                with contextlib.suppress(Exception):   # a parser never stops the loop
                    events = watched["parse"](line)
            calls = watched.setdefault("calls_by_id", {})
            for event in events:
                if event.kind == "tool_call":
                    watched["calls"] += 1
                    watched["shown"] = self.clock()
                    calls[event.call_id] = event.name
                    line = tool_line(role, event.name, event.text, self.store.root)
                    self.emit(HqMessage("agent", line, "tool_call", {
                        "run": run.name, "slot": role, "tool": tool_display_name(event.name),
                        "input": event.text, "ok": event.ok}))
                elif event.kind == "tool_result":
                    name = calls.pop(event.call_id, event.name)
                    if event.ok is False:
                        self.emit(HqMessage("agent", tool_failure_line(
                            role, name, event.text, self.store.root), "tool_failed", {
                                "run": run.name, "slot": role, "tool": tool_display_name(name),
                                "reason": event.text, "denied": tool_denied(event.text)}))
