"""Pipelines (docs/ARCHITECTURE.md, 'Pipeline automaton'): workflows.json, status.json,
reconcile, restarts, gates, the CLI.

Workers are tests/scripted_worker.py, real processes registered as a custom agent;
the orchestrator's clock is the FakeClock, so backoff and timeouts need no sleeping.
"""

import collections
import copy
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import ferrus
from conftest import FERRUS_CMD, set_config

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripted_worker.py")

CONFIG = """
[agents.custom.worker]
interactive = [%(py)s, %(script)s]
headless = [%(py)s, %(script)s]
prompt = "stdin"

[hq.executor]
agent = "worker"

[sessions]
max_consecutive_errors = 3

[pipelines]
max_parallel = %(parallel)d
"""

RESEARCH = {
    "research": {
        "description": "Pure research + analysis",
        "phases": [
            {"id": "collect", "mode": "parallel", "workers": [
                {"role": "researcher-a", "model": "sonnet", "timeout": 600,
                 "task": "Research perspective A: main sources, facts, current state"},
                {"role": "researcher-b", "model": "sonnet", "timeout": 600,
                 "task": "Research perspective B: alternative views, criticism, edge cases"}]},
            {"id": "synthesis", "mode": "sequential", "workers": [
                {"role": "synthesizer", "model": "opus", "timeout": 420, "final": True,
                 "reads": ["researcher-a.md", "researcher-b.md"],
                 "task": "Synthesize research from both researchers"}]}]}}


def configure(root, parallel=4, workflows=RESEARCH):
    set_config(root, CONFIG % {"py": json.dumps(sys.executable), "script": json.dumps(WORKER),
                               "parallel": parallel})
    with open(os.path.join(str(root), "workflows.json"), "w") as handle:
        json.dump(workflows, handle, indent=2)


@pytest.fixture
def spawn_log(tmp_path, monkeypatch):
    path = tmp_path / "spawns.log"
    monkeypatch.setenv("WORKER_LOG", str(path))
    for name in ("WORKER_FAIL", "WORKER_FAIL_ONCE", "WORKER_SILENT", "WORKER_SLOW",
                 "WORKER_DELAY"):
        monkeypatch.delenv(name, raising=False)
    return path


@pytest.fixture
def research(project, store, spawn_log):
    configure(project)
    return store


def spawns(path):
    if not os.path.exists(str(path)):
        return collections.Counter()
    with open(str(path)) as handle:
        return collections.Counter(line.split()[0] for line in handle if line.strip())


def status_of(store, run):
    return ferrus.read_run(store, run).status


def worker(store, run, role):
    return next(p["workers"][role] for p in status_of(store, run)["phases"]
                if role in p["workers"])


def events(store):
    return [(e["event"], e["detail"].get("role") or e["detail"].get("phase"))
            for e in store.read_journal() if e["actor"] == "pipeline"]


def drive(make, run, until=None, timeout=20):
    """Reconcile (with a fresh orchestrator from ``make()`` each time) until ``until``."""
    until = until or (lambda outcome: outcome.finished)
    deadline = time.monotonic() + timeout
    while True:
        outcome = make().reconcile(run)
        if until(outcome):
            return outcome
        assert time.monotonic() < deadline, "stuck: %r" % (outcome,)
        time.sleep(0.02)


def wait_gone(pid, timeout=5):
    deadline = time.monotonic() + timeout
    while ferrus.worker_pid_running(pid):
        assert time.monotonic() < deadline, "pid %d still running" % pid
        time.sleep(0.02)


# -- the research pipeline, start to end ----------------------------------------------------

def test_research_pipeline_runs_to_delivery_and_archive(research, spawn_log):
    orchestrator = ferrus.PipelineOrchestrator(research)
    run = orchestrator.create("research", "FSA architecture")
    active = research.path("pipelines", run)
    first = status_of(research, run)
    assert first["dir"] == run and first["topic"] == "FSA architecture"
    assert [p["status"] for p in first["phases"]] == ["pending", "pending"]

    outcome = drive(lambda: orchestrator, run)
    assert outcome.state == "delivered"
    archived = research.path("pipelines", "archive", run)
    assert not os.path.exists(active) and os.path.isdir(archived)
    assert outcome.output == os.path.join(archived, "synthesizer.md")
    assert "## from researcher-a.md" in outcome.text and "## from researcher-b.md" in outcome.text
    status = json.load(open(os.path.join(archived, "status.json")))
    assert status["result_delivered"] and status["result"] == "synthesizer.md"
    assert [p["status"] for p in status["phases"]] == ["completed", "completed"]
    assert all(w["status"] == "completed" and w["attempts"] == 1 and w["token"]
               for p in status["phases"] for w in p["workers"].values())
    assert spawns(spawn_log) == {"researcher-a": 1, "researcher-b": 1, "synthesizer": 1}
    # The prompt is prompt_pipeline_worker and nothing else.
    prompt = open(os.path.join(archived, "logs", "synthesizer-1.prompt")).read()
    assert prompt == ferrus.prompt_pipeline_worker(
        "FSA architecture", "Synthesize research from both researchers",
        [os.path.join(active, "researcher-a.md"), os.path.join(active, "researcher-b.md")],
        os.path.join(active, "synthesizer.md"))
    names = [name for name, _ in events(research)]
    assert names[0] == "run_created" and names[-2:] == ["delivered", "archived"]
    assert names.count("worker_spawned") == names.count("worker_completed") == 3
    assert names.count("phase_completed") == 2
    # Reconciling a delivered run again changes nothing.
    before = len(research.read_journal())
    assert ferrus.PipelineOrchestrator(research).reconcile(run).state == "delivered"
    assert len(research.read_journal()) == before


def test_a_new_orchestrator_after_every_step_spawns_nothing_twice(research, spawn_log):
    run = ferrus.PipelineOrchestrator(research).create("research", "restarts")
    outcome = drive(lambda: ferrus.PipelineOrchestrator(research), run)
    assert outcome.state == "delivered"
    assert spawns(spawn_log) == {"researcher-a": 1, "researcher-b": 1, "synthesizer": 1}


def test_a_process_started_but_not_recorded_is_adopted_through_its_pid_file(research, spawn_log):
    def dies_after_start(launch, root, base):
        ferrus.start_worker_process(launch, root, base)
        raise KeyboardInterrupt       # the orchestrator dies before writing "running"
    run = ferrus.PipelineOrchestrator(research).create("research", "adoption")
    with pytest.raises(KeyboardInterrupt):
        ferrus.PipelineOrchestrator(research, spawner=dies_after_start).reconcile(run)
    entry = worker(research, run, "researcher-a")
    assert entry["status"] == "spawning" and entry["token"] and entry["pid"] is None
    outcome = drive(lambda: ferrus.PipelineOrchestrator(research), run)
    assert outcome.state == "delivered"
    # A quick worker may already have written its output when the new orchestrator
    # looks (then it is simply completed); either way it was never started twice.
    seen = events(research)
    assert ("worker_adopted", "researcher-a") in seen or \
        ("worker_completed", "researcher-a") in seen
    assert ("worker_spawned", "researcher-a") not in seen
    assert spawns(spawn_log) == {"researcher-a": 1, "researcher-b": 1, "synthesizer": 1}


def test_a_spawn_interrupted_before_the_process_is_counted_not_duplicated(research, clock,
                                                                          spawn_log):
    def dies_before_start(launch, root, base):
        on_disk = worker(research, run, "researcher-a")
        assert on_disk["status"] == "spawning" and on_disk["attempts"] == 1  # recorded first
        raise KeyboardInterrupt
    run = ferrus.PipelineOrchestrator(research).create("research", "interrupted")
    with pytest.raises(KeyboardInterrupt):
        ferrus.PipelineOrchestrator(research, spawner=dies_before_start).reconcile(run)
    # Within the grace period the spawn may still be under way somewhere: wait.
    ferrus.PipelineOrchestrator(research).reconcile(run)
    assert worker(research, run, "researcher-a")["status"] == "spawning"
    clock.advance(ferrus.SPAWN_GRACE_SECS + 1)
    ferrus.PipelineOrchestrator(research).reconcile(run)
    entry = worker(research, run, "researcher-a")
    assert entry["status"] == "cooling" and entry["total_errors"] == 1
    assert "interrupted" in entry["message"]
    clock.advance(3)
    assert drive(lambda: ferrus.PipelineOrchestrator(research), run).state == "delivered"
    assert spawns(spawn_log)["researcher-a"] == 1
    assert status_of(research, run)["retry_count"] == 1


def test_killing_pipeline_run_and_resuming_loses_nothing(research, project, spawn_log, cli):
    env = dict(os.environ, WORKER_DELAY="0.6", NO_COLOR="1")
    proc = subprocess.Popen(FERRUS_CMD + ["pipeline", "run", "research", "kill"],
                            cwd=str(project), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while sum(spawns(spawn_log).values()) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.kill()                              # mid-phase, both researchers in flight
    proc.wait()
    run = ferrus.list_runs(research)[0][0]
    assert run.startswith("research-")
    result = cli("pipeline", "resume", "research", cwd=project, env={"WORKER_DELAY": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "result: " in result.stdout and "## from researcher-b.md" in result.stdout
    assert spawns(spawn_log) == {"researcher-a": 1, "researcher-b": 1, "synthesizer": 1}
    assert status_of(research, run)["result_delivered"]


# -- session rules, timeouts, pause_after ---------------------------------------------------

@pytest.mark.parametrize("variable,why", [("WORKER_FAIL", "exited with code 1 without writing"),
                                          ("WORKER_SILENT", "exited with code 0 without writing")])
def test_a_failing_worker_backs_off_then_stops_and_retry_runs_it_again(
        research, clock, spawn_log, monkeypatch, variable, why):
    monkeypatch.setenv(variable, "researcher-b")
    orchestrator = ferrus.PipelineOrchestrator(research)
    run = orchestrator.create("research", "failures")
    drive(lambda: orchestrator, run,
          lambda o: worker(research, run, "researcher-b")["status"] == "cooling")
    entry = worker(research, run, "researcher-b")
    assert why in entry["message"] and entry["errors"] == 1
    assert ferrus.parse_timestamp(entry["retry_at"]) == clock() + ferrus._dt.timedelta(seconds=2)
    orchestrator.reconcile(run)                 # the backoff has not elapsed: no respawn
    assert spawns(spawn_log)["researcher-b"] == 1
    for errors, wait in ((2, 2), (3, 4)):       # [sessions] max_consecutive_errors = 3
        clock.advance(wait)
        drive(lambda: orchestrator, run,
              lambda o: worker(research, run, "researcher-b")["errors"] == errors)
    outcome = orchestrator.reconcile(run)
    assert outcome.state == "failed" and "researcher-b failed" in outcome.message
    assert "stopped after 3 consecutive errors" in outcome.message
    assert status_of(research, run)["phases"][0]["status"] == "failed"
    assert spawns(spawn_log)["researcher-b"] == 3
    assert ("phase_failed", "collect") in events(research)

    monkeypatch.delenv(variable)
    orchestrator.retry(run, "researcher-b")
    assert drive(lambda: orchestrator, run).state == "delivered"
    assert spawns(spawn_log) == {"researcher-a": 1, "researcher-b": 4, "synthesizer": 1}
    assert status_of(research, run)["retry_count"] == 3


def test_a_worker_failing_once_is_retried_after_its_backoff(research, clock, spawn_log,
                                                            monkeypatch):
    monkeypatch.setenv("WORKER_FAIL_ONCE", "synthesizer")
    orchestrator = ferrus.PipelineOrchestrator(research)
    run = orchestrator.create("research", "flaky")
    drive(lambda: orchestrator, run,
          lambda o: worker(research, run, "synthesizer")["status"] == "cooling")
    clock.advance(2)
    assert drive(lambda: orchestrator, run).state == "delivered"
    assert spawns(spawn_log)["synthesizer"] == 2


def test_a_phase_running_past_its_timeout_plus_grace_fails(research, clock, spawn_log,
                                                           monkeypatch):
    monkeypatch.setenv("WORKER_SLOW", "researcher-b")
    orchestrator = ferrus.PipelineOrchestrator(research)
    run = orchestrator.create("research", "slow")
    drive(lambda: orchestrator, run,
          lambda o: worker(research, run, "researcher-a")["status"] == "completed")
    pid = worker(research, run, "researcher-b")["pid"]
    clock.advance(600 + ferrus.PIPELINE_GRACE_SECS - 1)
    assert orchestrator.reconcile(run).state == "running"       # within the limit: wait
    clock.advance(2)
    outcome = orchestrator.reconcile(run)
    assert outcome.state == "failed" and "researcher-b failed: timed out" in outcome.message
    wait_gone(pid)                                               # the slow worker was stopped
    assert status_of(research, run)["phases"][0]["status"] == "failed"
    assert spawns(spawn_log)["synthesizer"] == 0


def test_pause_after_waits_for_continue(project, store, spawn_log):
    workflows = copy.deepcopy(RESEARCH)
    workflows["research"]["phases"][0]["pause_after"] = True
    configure(project, workflows=workflows)
    orchestrator = ferrus.PipelineOrchestrator(store)
    run = orchestrator.create("research", "pausing")
    with pytest.raises(ferrus.FerrusError, match="not paused"):
        orchestrator.continue_run(run)
    outcome = drive(lambda: orchestrator, run)
    assert outcome.state == "paused" and outcome.message == "pause_after collect"
    summary = [e["detail"] for e in store.read_journal() if e["event"] == "paused"]
    assert summary == [{"run": run, "reason": "pause_after collect"}]
    status = status_of(store, run)
    assert status["paused"] and status["current_phase"] == 1
    for _ in range(3):
        assert orchestrator.reconcile(run).state == "paused"
    assert spawns(spawn_log)["synthesizer"] == 0
    orchestrator.continue_run(run)
    assert drive(lambda: orchestrator, run).state == "delivered"
    assert spawns(spawn_log)["synthesizer"] == 1


# -- definitions -------------------------------------------------------------------------

AGENTS = ferrus.BUILTIN_AGENTS + ("worker",)


def mutated(change):
    workflows = copy.deepcopy(RESEARCH)
    change(workflows["research"])
    return json.dumps(workflows)


def _phase(p, i):
    return p["phases"][i]


def _w(p, i, j):
    return p["phases"][i]["workers"][j]


INVALID = [
    (lambda p: p.update(owner="me"), "research.owner is not a known key"),
    (lambda p: _phase(p, 0).update(_comment="x"), "research.phases[0]._comment is not a known"),
    (lambda p: _w(p, 0, 0).update(colour="red"), "research.phases[0].workers[0].colour is not"),
    (lambda p: _w(p, 0, 1).update(timeout="600"),
     'research.phases[0].workers[1].timeout must be a number of seconds from 1 to 604800, '
     'got "600" (a string)'),
    (lambda p: _w(p, 0, 0).pop("task"), "research.phases[0].workers[0] needs \"task\""),
    (lambda p: _w(p, 0, 0).update(role="a/b"), "research.phases[0].workers[0].role must be"),
    (lambda p: _w(p, 1, 0).update(reads="researcher-a.md"),
     "research.phases[1].workers[0].reads must be an array of file names"),
    (lambda p: _phase(p, 0).update(mode="random"), "research.phases[0].mode must be"),
    (lambda p: _phase(p, 0).update(pause_after="yes"), "research.phases[0].pause_after must be"),
    (lambda p: _phase(p, 1).update(pause_after=True), "research.phases[1].pause_after is on the "
                                                      "last phase"),
    (lambda p: p.update(phases=[]), "research.phases must be a non-empty array"),
    (lambda p: _phase(p, 0).update(workers=[]), "research.phases[0].workers must be a non-empty"),
    (lambda p: _phase(p, 1).update(id="collect"),
     'research.phases[1].id repeats the phase id "collect"'),
    (lambda p: _w(p, 1, 0).update(role="researcher-a"),
     'research.phases[1].workers[0].role repeats the role "researcher-a"'),
    (lambda p: _w(p, 0, 1).update(role="researcher-a"),
     'research.phases[0].workers[1].role repeats the role'),
    (lambda p: _w(p, 1, 0).update(reads=["researcher-c.md"]),
     'research.phases[1].workers[0].reads names "researcher-c.md", which no worker of an '
     'earlier phase writes (earlier outputs: researcher-a.md, researcher-b.md)'),
    (lambda p: _w(p, 0, 1).update(reads=["researcher-a.md"]),     # same phase: not earlier
     'research.phases[0].workers[1].reads names "researcher-a.md"'),
    (lambda p: _w(p, 1, 0).pop("final"), "research has no final workers"),
    (lambda p: _phase(p, 1)["workers"].append(dict(_w(p, 1, 0), role="editor")),
     "research has 2 final workers (synthesizer, editor)"),
    (lambda p: (_w(p, 0, 0).update(final=True), _w(p, 1, 0).pop("final")),
     "research.phases[0].workers[0].final marks a worker outside the last phase"),
    (lambda p: _w(p, 0, 0).update(agent="nobody"),
     'research.phases[0].workers[0].agent names the unknown agent "nobody" (known: '
     'claude-code, codex, qwen-code, gemini-cli, nano, opencode, goose, worker)'),
    (lambda p: _w(p, 0, 0).update(model=3), "research.phases[0].workers[0].model must be"),
]


@pytest.mark.parametrize("change,message", INVALID)
def test_invalid_definitions_are_named_precisely(change, message):
    with pytest.raises(ferrus.FerrusError) as caught:
        ferrus.parse_workflows(mutated(change), "workflows.json", AGENTS)
    assert str(caught.value).startswith("workflows.json: ")
    assert message in str(caught.value)
    assert "ferrus pipeline init" in caught.value.hint


def test_definition_file_level_errors_and_the_comment_key():
    for text, message in (("{", "workflows.json is not valid JSON"),
                          ("[]", "the top level must be an object"),
                          ('{"bad name": {}}', "workflows.json: bad name must be a pipeline name")):
        with pytest.raises(ferrus.FerrusError, match=message):
            ferrus.parse_workflows(text, "workflows.json", AGENTS)
    parsed = ferrus.parse_workflows(json.dumps(dict(RESEARCH, _comment=["notes"])),
                                    "workflows.json", AGENTS)
    assert list(parsed) == ["research"]
    definition = parsed["research"]
    assert definition.final_worker().role == "synthesizer"
    assert [p.timeout for p in definition.phases] == [600, 420]


def test_a_run_keeps_its_own_definition_with_the_default_agent_fixed(research):
    run = ferrus.PipelineOrchestrator(research).create("research", "snapshot")
    with open(os.path.join(str(research.root), "workflows.json"), "w") as handle:
        handle.write("{}")                     # later edits do not touch a started run
    definition = ferrus.read_run(research, run, with_definition=True).definition
    assert [w.agent for p in definition.phases for w in p.workers] == ["worker"] * 3
    assert definition.final_worker().reads == ("researcher-a.md", "researcher-b.md")


def test_pipelines_config_is_validated(project):
    set_config(project, "[pipelines]\nmax_parallel = 0\n")
    with pytest.raises(ferrus.FerrusError, match=r"\[pipelines.max_parallel\] must be between"):
        ferrus.pipelines_config(str(project))
    set_config(project, '[pipelines]\nfile = "flows.json"\nmax_parallel = 2\n')
    assert ferrus.pipelines_config(str(project)) == ferrus.PipelinesConfig("flows.json", 2)


def test_a_worker_without_an_agent_needs_an_executor(project, store, spawn_log):
    configure(project)
    set_config(project, "")
    with pytest.raises(ferrus.FerrusError, match=r"workers\[0\] names no agent and ferrus.toml "
                                                 r"has no \[hq.executor\]"):
        ferrus.PipelineOrchestrator(store).create("research", "x")


def test_claude_workers_may_write_their_output_only(project, monkeypatch):
    monkeypatch.setattr(ferrus.ClaudeCode, "executable", lambda self: "/usr/bin/claude")
    config = ferrus.parse_config("")
    output = os.path.join(str(project), "out", "researcher-a.md")
    launch = ferrus.pipeline_worker_launch(config, "claude-code", str(project), "PROMPT", "opus",
                                           ["/x/in.md"], output)
    assert launch.stdin == "PROMPT" and "opus" in launch.argv
    assert "--allowedTools=Edit(/%s),Read" % output in launch.argv
    assert launch.argv[launch.argv.index("--permission-mode") + 1] == "default"
    launch = ferrus.pipeline_worker_launch(config, "claude-code", str(project), "P", "",
                                           output=output)
    assert "--allowedTools=Edit(/%s)" % output in launch.argv
    monkeypatch.setattr(ferrus.ClaudeCode, "executable", lambda self: None)
    with pytest.raises(ferrus.FerrusError, match="claude is not installed"):
        ferrus.pipeline_worker_launch(config, "claude-code", str(project), "P", "")


# -- dispatch gates ----------------------------------------------------------------------

def edit_status(store, run, change):
    path = os.path.join(ferrus.find_run(store, run)[1], "status.json")
    status = json.load(open(path))
    change(status)
    ferrus.atomic_write(path, json.dumps(status))


def test_coverage_gate_an_output_without_a_dispatch_record_is_not_completion(research,
                                                                             spawn_log):
    orchestrator = ferrus.PipelineOrchestrator(research)
    run = orchestrator.create("research", "coverage")
    stray = os.path.join(research.path("pipelines", run), "researcher-b.md")
    open(stray, "w").write("written by someone who is not a worker")
    outcome = orchestrator.reconcile(run)
    assert outcome.state == "blocked"
    assert "coverage: researcher-b.md exists but researcher-b was never dispatched" in \
        outcome.message
    phase = status_of(research, run)["phases"][0]
    assert phase["status"] == "blocked" and phase["workers"]["researcher-b"]["status"] == "pending"
    assert not spawns(spawn_log)                       # the whole phase is stopped
    assert ("phase_blocked", "collect") in events(research)
    orchestrator.retry(run, "researcher-b")            # discards the stray output
    assert not os.path.exists(stray)
    assert drive(lambda: orchestrator, run).state == "delivered"
    assert spawns(spawn_log) == {"researcher-a": 1, "researcher-b": 1, "synthesizer": 1}


def test_coverage_gate_a_completed_mark_without_dispatch_record_blocks_the_phase(research,
                                                                                 spawn_log):
    orchestrator = ferrus.PipelineOrchestrator(research)
    run = orchestrator.create("research", "coverage")
    edit_status(research, run, lambda s: s["phases"][0]["workers"]["researcher-b"].update(
        status="completed"))
    outcome = drive(lambda: orchestrator, run)
    assert outcome.state == "blocked"
    assert "researcher-b is marked completed without a dispatch record" in outcome.message
    assert status_of(research, run)["phases"][0]["status"] == "blocked"
    assert spawns(spawn_log) == {}


def test_batch_size_gate_runs_a_large_parallel_phase_in_batches(project, store, spawn_log):
    configure(project, parallel=1)
    orchestrator = ferrus.PipelineOrchestrator(store)
    run = orchestrator.create("research", "batches")
    most = [0]

    def watch(outcome):
        phase = status_of(store, run)["phases"][0]
        most[0] = max(most[0], sum(w["status"] in ferrus.WORKER_RUNNING
                                   for w in phase["workers"].values()))
        return outcome.finished
    assert drive(lambda: orchestrator, run, watch).state == "delivered"
    assert most[0] == 1
    order = events(store)
    assert order.index(("worker_spawned", "researcher-b")) > \
        order.index(("worker_completed", "researcher-a"))


def test_batch_size_gate_reports_more_running_than_allowed(project, store, spawn_log):
    configure(project, parallel=1)
    orchestrator = ferrus.PipelineOrchestrator(store)
    run = orchestrator.create("research", "too many")
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
                for _ in range(2)]
    try:
        def two_running(status):
            status["phases"][0]["status"] = "running"
            for role, proc in zip(("researcher-a", "researcher-b"), sleepers):
                status["phases"][0]["workers"][role].update(
                    status="running", pid=proc.pid, attempts=1, token="hand",
                    started_at=ferrus.format_timestamp(store.clock()))
        edit_status(store, run, two_running)
        outcome = orchestrator.reconcile(run)
        assert outcome.state == "running"
        assert "batch size: 2 workers running (researcher-a, researcher-b), more than the 1 " \
               "allowed" in outcome.message
        assert status_of(store, run)["phases"][0]["status"] == "blocked"
        assert [e for e in store.read_journal() if e["event"] == "phase_blocked"]
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
    assert drive(lambda: orchestrator, run,
                 lambda o: "batch size" not in o.message).state == "running"


def test_input_coverage_gate_holds_a_worker_whose_input_is_missing(project, store, spawn_log):
    workflows = copy.deepcopy(RESEARCH)
    workflows["research"]["phases"][0]["pause_after"] = True
    configure(project, workflows=workflows)
    orchestrator = ferrus.PipelineOrchestrator(store)
    run = orchestrator.create("research", "inputs")
    assert drive(lambda: orchestrator, run).state == "paused"
    folder = store.path("pipelines", run)
    text = open(os.path.join(folder, "researcher-b.md")).read()
    os.unlink(os.path.join(folder, "researcher-b.md"))
    orchestrator.continue_run(run)
    outcome = orchestrator.reconcile(run)
    assert outcome.state == "blocked"
    assert outcome.message == "input: synthesizer waits for researcher-b.md (missing)"
    assert spawns(spawn_log)["synthesizer"] == 0
    open(os.path.join(folder, "researcher-b.md"), "w").write(text)
    assert drive(lambda: orchestrator, run).state == "delivered"
    assert spawns(spawn_log)["synthesizer"] == 1


# -- the capacity hook -------------------------------------------------------------------

def test_capacity_checkpoint_pauses_without_spawning(research, spawn_log):
    asked = []
    checkpoint = ferrus.PipelineOrchestrator(
        research, gate=lambda target: asked.append(target) or ferrus.CHECKPOINT)
    run = checkpoint.create("research", "budget")
    outcome = checkpoint.reconcile(run)
    assert outcome.state == "paused" and outcome.message == "capacity checkpoint"
    assert asked == ["pipeline:%s:researcher-a" % run]
    assert checkpoint.reconcile(run).state == "paused" and len(asked) == 1
    assert not spawns(spawn_log)
    assert status_of(research, run)["paused_reason"] == "capacity checkpoint"
    checkpoint.continue_run(run)
    assert drive(lambda: ferrus.PipelineOrchestrator(research), run).state == "delivered"


def test_capacity_emergency_stop_kills_the_running_workers(research, spawn_log, monkeypatch):
    monkeypatch.setenv("WORKER_SLOW", "researcher-a")
    orchestrator = ferrus.PipelineOrchestrator(
        research, gate=lambda target: ferrus.EMERGENCY_STOP if target.endswith("researcher-b")
        else ferrus.CONTINUE)
    run = orchestrator.create("research", "emergency")
    outcome = orchestrator.reconcile(run)
    assert outcome.state == "paused" and outcome.message == "capacity emergency stop"
    entry = worker(research, run, "researcher-a")
    assert entry["status"] == "pending" and entry["message"] == "stopped by the capacity gate"
    pid = [e["detail"]["pid"] for e in research.read_journal() if e["event"] == "worker_spawned"]
    wait_gone(pid[0])
    assert ("worker_stopped", "researcher-a") in events(research)
    assert worker(research, run, "researcher-b")["attempts"] == 0


def test_capacity_throttle_is_recorded_and_spawns(research, spawn_log):
    orchestrator = ferrus.PipelineOrchestrator(research, gate=lambda target: ferrus.THROTTLE)
    run = orchestrator.create("research", "throttle")
    assert drive(lambda: orchestrator, run).state == "delivered"
    spawned = [e["detail"] for e in research.read_journal() if e["event"] == "worker_spawned"]
    assert len(spawned) == 3 and all(d["throttled"] for d in spawned)


def test_the_default_gate_applies_capacity_limits_and_journals_records(project, store,
                                                                        spawn_log):
    configure(project)
    with open(os.path.join(str(project), "ferrus.toml"), "a") as handle:
        handle.write("\n[capacity]\nmax_sessions = 2\n")
    set_config(project, open(os.path.join(str(project), "ferrus.toml")).read())
    orchestrator = ferrus.PipelineOrchestrator(store)
    run = orchestrator.create("research", "limits")
    outcome = orchestrator.reconcile(run)
    assert outcome.state == "paused" and outcome.message == "capacity checkpoint"
    records = [e["detail"] for e in store.read_journal() if e["event"] == "gate"]
    assert [(r["target"].split(":")[-1], r["action"], r["sessions"]) for r in records] == [
        ("researcher-a", "Continue", 1), ("researcher-b", "Checkpoint", 2)]


# -- the CLI -------------------------------------------------------------------------------

def test_cli_init_list_run_status_cancel(project, store, spawn_log, cli):
    configure(project)
    os.unlink(os.path.join(str(project), "workflows.json"))
    result = cli("pipeline", "init", cwd=project)
    assert result.returncode == 0 and "workflows.json" in result.stdout
    example = json.load(open(os.path.join(str(project), "workflows.json")))
    assert "_comment" in example and "research" in example
    again = cli("pipeline", "init", cwd=project)
    assert again.returncode == 1 and "workflows.json already exists" in again.stderr

    listed = cli("pipeline", "list", cwd=project)
    assert listed.returncode == 0
    assert "research — Pure research + analysis" in listed.stdout
    assert "synthesizer [final] (worker, 420s, reads researcher-a.md, researcher-b.md)" in \
        listed.stdout

    ran = cli("pipeline", "run", "research", "FSA architecture", cwd=project)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    for text in ("run research-", "researcher-a spawned", "phase collect completed",
                 "delivered", "archived", "Topic: FSA architecture"):
        assert text in ran.stdout
    run = ferrus.list_runs(store)[0][0]

    listing = cli("pipeline", "status", cwd=project)
    assert run in listing.stdout and "delivered" in listing.stdout and "(archived)" in \
        listing.stdout
    shown = cli("pipeline", "status", run[:12], cwd=project)
    assert shown.returncode == 0 and "phase 2  synthesis: completed" in shown.stdout
    assert json.loads(cli("pipeline", "status", run, "--json", cwd=project).stdout)["dir"] == run

    # A run with workers in flight (started here, so another process adopts them).
    os.environ["WORKER_SLOW"] = "researcher-a,researcher-b"
    try:
        orchestrator = ferrus.PipelineOrchestrator(store)
        second = orchestrator.create("research", "to cancel")
        orchestrator.reconcile(second)
    finally:
        del os.environ["WORKER_SLOW"]
    pids = [worker(store, second, role)["pid"] for role in ("researcher-a", "researcher-b")]
    assert all(ferrus.worker_pid_running(pid) for pid in pids)
    cancelled = cli("pipeline", "cancel", second, cwd=project)
    assert cancelled.returncode == 0, cancelled.stderr
    assert "cancelled" in cancelled.stdout
    for pid in pids:
        wait_gone(pid)
    status = status_of(store, second)
    assert status["cancelled"] and ferrus.find_run(store, second)[2]      # archived
    assert status["phases"][0]["workers"]["researcher-a"]["status"] == "cancelled"
    assert cli("pipeline", "cancel", second, cwd=project).returncode == 1
    assert ("cancelled", None) in events(store)


def test_cli_errors(project, store, spawn_log, cli):
    configure(project)
    assert cli("pipeline", cwd=project).returncode == 2
    missing = cli("pipeline", "run", "nosuch", "topic", cwd=project)
    assert missing.returncode == 1 and 'no pipeline "nosuch" in workflows.json' in missing.stderr
    unknown = cli("pipeline", "resume", "nothing", cwd=project)
    assert unknown.returncode == 1 and "no pipeline run matches" in unknown.stderr
    with open(os.path.join(str(project), "workflows.json"), "w") as handle:
        handle.write('{"research": {"phases": []}}')
    bad = cli("pipeline", "list", cwd=project)
    assert bad.returncode == 1
    assert "workflows.json: research.phases must be a non-empty array" in bad.stderr
    assert "hint:" in bad.stderr


@pytest.mark.skipif(os.name == "nt", reason="SIGINT to a console process group")
def test_ctrl_c_leaves_workers_and_status_for_resume(research, project, spawn_log, cli):
    env = dict(os.environ, WORKER_DELAY="0.5")
    proc = subprocess.Popen(FERRUS_CMD + ["pipeline", "run", "research", "ctrl-c"],
                            cwd=str(project), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 15
    while sum(spawns(spawn_log).values()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=15)[0]
    assert proc.returncode == 130 and "ferrus pipeline resume" in output
    run = ferrus.list_runs(research)[0][0]
    result = cli("pipeline", "resume", run, cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    assert spawns(spawn_log) == {"researcher-a": 1, "researcher-b": 1, "synthesizer": 1}


def test_hq_pipeline_command_follows_a_run_in_the_background(research, spawn_log):
    output = io.StringIO()
    shell = ferrus.HqShell(research, stdin=io.StringIO(""), stdout=output)
    ferrus.hq_cmd_pipeline(shell, "list")
    assert "research — Pure research + analysis" in output.getvalue()
    with pytest.raises(ferrus.UsageError, match="usage: /pipeline"):
        ferrus.hq_cmd_pipeline(shell, "run research")
    ferrus.hq_cmd_pipeline(shell, "run research FSA in HQ")
    deadline = time.monotonic() + 15
    while "result: " not in output.getvalue():        # HQ stays free meanwhile
        assert time.monotonic() < deadline, output.getvalue()
        time.sleep(0.02)
    run = ferrus.list_runs(research)[0][0]
    assert status_of(research, run)["topic"] == "FSA in HQ"
    assert "following run %s" % run in output.getvalue()
    ferrus.hq_cmd_pipeline(shell, "status")
    assert "delivered" in output.getvalue().splitlines()[-1]


def test_a_damaged_status_json_is_explained(research, cli):
    run = ferrus.PipelineOrchestrator(research).create("research", "damage")
    ferrus.atomic_write(os.path.join(research.path("pipelines", run), "status.json"), "{oops")
    with pytest.raises(ferrus.FerrusError, match="status.json is damaged") as caught:
        ferrus.PipelineOrchestrator(research).reconcile(run)
    assert "move .ferrus/pipelines/%s away" % run in caught.value.hint
    listing = cli("pipeline", "status", cwd=research.root)
    assert listing.returncode == 0 and "damaged" in listing.stdout
