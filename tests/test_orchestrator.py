"""One orchestrator per project, agents that cannot start or fail for good, `--timeout`,
the capacity gate on HQ's /task TEXT (issue #10 items 3, 4, 9).

Clocks are injected: nothing here waits for a backoff in real time.
"""

import io
import json
import os
import re
import signal
import stat
import subprocess
import sys

import pytest

import conftest
import ferrus
from conftest import FERRUS_CMD, FakeMonotonic, run_cli, set_config, wait_until

S, SS = ferrus.S, ferrus.SS


def custom_agent_config(argv, prompt="stdin"):
    return conftest.custom_agent_config("broken", argv, prompt)


def write_program(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# -- an agent that cannot be started -------------------------------------------------------

@pytest.mark.parametrize("content", [
    "this is not a program\n",                              # ENOEXEC: no #! line
    "#!/nonexistent/interpreter\nprint('never')\n",         # missing interpreter
], ids=["enoexec", "missing-interpreter"])
def test_an_agent_that_cannot_start_backs_off_then_stops_and_run_returns(
        project, tmp_path, content):
    program = write_program(tmp_path / "agent", content)
    set_config(project, custom_agent_config([program, "{role}"]))
    store = ferrus.Store(str(project))
    clock = FakeMonotonic()
    lines = []

    def ticking():
        clock.now += 1.0          # every look at the clock moves time on: no real waiting
        return clock.now
    code = ferrus.run_loop(store, "a task", out=lines.append, clock=ticking, poll_interval=0)
    text = "\n".join(lines)
    assert code == ferrus.RUN_FAILED, text
    assert "could not start the executor" in text
    assert "retrying the executor in 2s" in text and "retrying the executor in 16s" in text
    assert "stopped after 5 consecutive errors" in text
    assert "giving up: the executor is stopped" in text


def test_a_failed_start_arms_the_backoff_timer(project, tmp_path):
    program = write_program(tmp_path / "agent", "not a program\n")
    set_config(project, custom_agent_config([program]))
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    clock = FakeMonotonic()
    messages = []
    controller = ferrus.HqController(store, messages.append, clock=clock)
    controller.poll()
    slot = controller.slots["executor"]
    assert slot.state == SS.COOLING_DOWN
    assert slot.timer == clock.now + 2.0
    assert any("not a program this system can run" in m.text for m in messages)
    controller.shutdown()


# -- --timeout -----------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_run_timeout_must_be_positive(project, value):
    done = subprocess.run(FERRUS_CMD + ["run", "--task", "x", "--timeout", value],
                          cwd=str(project), capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert "--timeout must be a positive number of seconds" in done.stderr
    assert "hint:" in done.stderr
    assert ferrus.Store(str(project)).read_state().state == S.IDLE


# -- the catch-all OSError message ------------------------------------------------------------

def test_the_oserror_hint_never_claims_nothing_changed(project, monkeypatch, capsys):
    def fail(args, root):
        raise OSError(28, "No space left on device", "x")
    monkeypatch.setattr(ferrus, "cmd_status", fail)
    code = ferrus.main(["-C", str(project), "status"])
    err = capsys.readouterr().err
    assert code == 1
    assert "No space left on device" in err
    assert "nothing was changed" not in err and "ferrus doctor" in err


# -- HQ /task TEXT passes the capacity gate ----------------------------------------------------

def test_hq_task_text_passes_the_capacity_gate(project):
    set_config(project, "[capacity]\nmax_tasks = 1\n")
    store = ferrus.Store(str(project))
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    shell.controller.tasks_completed = 1          # the budget of this HQ is spent
    shell.handle("/task Make work.txt")
    assert store.read_state().state == S.IDLE, out.getvalue()
    assert "no new task" in out.getvalue()
    gates = [e["detail"] for e in store.read_journal() if e["event"] == "gate"]
    assert gates and gates[-1]["target"] == "transition:create_task"
    assert gates[-1]["action"] in (ferrus.CHECKPOINT, ferrus.EMERGENCY_STOP)
    shell.controller.shutdown()


def test_hq_task_text_creates_the_task_when_the_gate_allows(project):
    set_config(project, "[capacity]\nmax_tasks = 5\n")
    store = ferrus.Store(str(project))
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=io.StringIO())
    shell.handle("/task Make work.txt")
    assert store.read_state().state == S.EXECUTING
    assert [e["detail"]["target"] for e in store.read_journal() if e["event"] == "gate"] == [
        "transition:create_task"]
    shell.controller.shutdown()


# -- permanent agent errors ----------------------------------------------------------------------

FAILING_AGENT = """#!%(py)s
import sys
sys.stdin.read()
print(%(stdout)r, flush=True)
sys.stderr.write(%(stderr)r)
sys.exit(1)
"""


def failing_agent(tmp_path, stdout="", stderr=""):
    return write_program(tmp_path / "agent", FAILING_AGENT % {
        "py": sys.executable, "stdout": stdout, "stderr": stderr})


@pytest.mark.parametrize("stdout,stderr,words", [
    (json.dumps({"type": "result", "subtype": "success", "is_error": True,
                 "result": "Invalid API key \u00b7 Please run /login"}), "",
     "Invalid API key \u00b7 Please run /login"),
    ("", "error: unknown option '--frobnicate'\n", "error: unknown option '--frobnicate'"),
    (json.dumps({"type": "error", "message": "The model `gpt-nope` does not exist or you do "
                                            "not have access to it."}), "",
     "The model `gpt-nope` does not exist"),
], ids=["claude-login", "unknown-flag", "unknown-model"])
def test_a_permanent_agent_error_stops_at_once_with_the_agents_words(
        project, tmp_path, stdout, stderr, words):
    program = failing_agent(tmp_path, stdout, stderr)
    set_config(project, custom_agent_config([program, "{role}"]))
    store = ferrus.Store(str(project))
    lines = []
    code = ferrus.run_loop(store, "a task", out=lines.append, clock=FakeMonotonic(),
                           poll_interval=0.01, timeout=120)
    text = "\n".join(lines)
    assert code == ferrus.RUN_FAILED, text
    assert words in text
    assert "the executor cannot work" in text and "hint:" in text
    assert "retrying" not in text                     # no second session
    sessions = [e for e in store.read_journal()
                if e["event"] == "session" and e["detail"]["to"] == "Running"]
    assert len(sessions) == 1


def test_a_tool_result_mentioning_an_error_is_not_the_agent_failing():
    tool_output = json.dumps({"type": "user", "message": {"content": [
        {"type": "tool_result", "content": "pytest: error: unrecognized arguments: --x"}]}})
    assert ferrus.permanent_agent_error(tool_output) is None
    ok_result = json.dumps({"type": "result", "is_error": False,
                            "result": "I fixed the unknown option handling"})
    assert ferrus.permanent_agent_error(ok_result) is None
    kind, words, hint = ferrus.permanent_agent_error(
        json.dumps({"type": "turn.failed", "error": {"message": "401 Unauthorized: "
                                                                "Incorrect API key provided"}}))
    assert kind == "login" and "Incorrect API key provided" in words and hint
    assert ferrus.permanent_agent_error("Please set an Auth method in your settings")[0] == "login"


def test_an_agent_failing_for_other_reasons_is_still_retried(project, tmp_path):
    program = failing_agent(tmp_path, "", "Segmentation fault\n")
    set_config(project, custom_agent_config([program, "{role}"]))
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    clock = FakeMonotonic()
    controller = ferrus.HqController(store, lambda m: None, clock=clock)
    slot = controller.slots["executor"]
    import time
    deadline = time.monotonic() + 60
    while slot.state not in (SS.COOLING_DOWN, SS.STOPPED):
        assert time.monotonic() < deadline
        controller.poll()
        time.sleep(0.01)
    assert slot.state == SS.COOLING_DOWN
    controller.shutdown()


def test_giving_up_on_a_stopped_agent_says_the_task_stays_and_how_to_go_on(project, tmp_path):
    """When `ferrus run` gives up on a stopped agent the task is still in flight (a second
    `ferrus run --task` is refused): the last line says where the task stays and that
    `ferrus run --resume` goes on once the cause is fixed."""
    program = failing_agent(tmp_path, "Not logged in \u00b7 Please run /login")
    set_config(project, custom_agent_config([program, "{role}"]))
    result = run_cli("run", "--task", "a task", cwd=project, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last == ("ferrus run: giving up: the executor is stopped (the reason is above); "
                    "the task stays Executing — once that is fixed, `ferrus run --resume` "
                    "goes on with it (`ferrus reset` drops it)")
    assert ferrus.Store(str(project)).read_state().state == S.EXECUTING


# -- one orchestrator per project ----------------------------------------------------------------

SCRIPTED_CONFIG = conftest.SCRIPTED_CONFIG


@pytest.fixture
def scripted(project, tmp_path):
    return conftest.scripted_project(project, tmp_path / "memory")


def cli(root, tmp_path, *args, behavior="", **kw):
    env = dict(os.environ, SCRIPTED_DIR=str(tmp_path / "memory"), SCRIPTED_BEHAVIOR=behavior,
               NO_COLOR="1")
    env.pop(ferrus.SESSION_ENV, None)
    return subprocess.Popen(FERRUS_CMD + list(args), cwd=str(root), env=env,
                            stdin=kw.pop("stdin", subprocess.DEVNULL), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def executor_claimed(store):
    data = store.read_state()
    return data.claimed_by is not None and data.claimed_by.startswith("executor:scripted:1/s-")


def test_a_second_orchestrator_refuses_at_once_naming_the_holder(scripted, tmp_path):
    first = cli(scripted.root, tmp_path, "run", "--task", "Make work.txt", "--timeout", "120",
                behavior="slow-executor")
    try:
        wait_until(lambda: executor_claimed(scripted), "the first run's executor")
        second = cli(scripted.root, tmp_path, "run", "--resume")
        out, err = second.communicate(timeout=30)
        assert second.returncode == 1, out + err
        assert "another orchestrator is running on this project: ferrus run (pid %d" \
            % first.pid in err
        assert "hint:" in err and "--resume" not in err
        hq = cli(scripted.root, tmp_path, "hq", "--no-tui", stdin=subprocess.PIPE)
        out, err = hq.communicate("/task other\n/quit\n", timeout=30)
        assert hq.returncode == 1 and "ferrus run (pid %d" % first.pid in err, out + err
        pipeline = cli(scripted.root, tmp_path, "pipeline", "resume", "nothing")
        out, err = pipeline.communicate(timeout=30)
        assert pipeline.returncode == 1 and "another orchestrator" in err
        # Reading along needs no lock.
        status = cli(scripted.root, tmp_path, "status")
        out, err = status.communicate(timeout=30)
        assert status.returncode == 0, err
        assert "orchestrator  ferrus run (pid %d" % first.pid in out
    finally:
        first.kill()
        first.communicate()
    sessions = [e for e in scripted.read_journal()
                if e["event"] == "session" and e["detail"]["to"] == "Running"]
    assert len(sessions) == 1, "only the first orchestrator started an agent"


def test_after_a_sigkilled_run_resume_stops_the_orphan_and_starts_one_executor(
        scripted, tmp_path):
    first = cli(scripted.root, tmp_path, "run", "--task", "Make work.txt",
                behavior="slow-executor")
    wait_until(lambda: executor_claimed(scripted), "the first run's executor")
    orphan_lease = scripted.read_state().claimed_by
    agents = json.loads(open(scripted.path("agents.json")).read())["agents"]
    orphan = next(a for a in agents if a["name"] == "executor")
    assert orphan["status"] == "running" and orphan["session"] in orphan_lease
    first.kill()                                  # SIGKILL: no cleanup at all
    first.communicate()
    assert ferrus.pid_alive(orphan["pid"]), "the orphaned executor outlives its orchestrator"

    resumed = cli(scripted.root, tmp_path, "run", "--resume", "--timeout", "120")
    out, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, out + err
    assert "took over from ferrus run (pid %d" % first.pid in out
    assert "stopped the executor (pid %d)" % orphan["pid"] in out
    assert "freed the task's lease, held by the stopped %s" % orphan_lease in out
    assert not ferrus.pid_alive(orphan["pid"])
    journal = scripted.read_journal()
    released = [i for i, e in enumerate(journal) if e["event"] == "lease_released"]
    assert len(released) == 1
    later = journal[released[0]:]
    # Exactly one executor session after the takeover, and it did the work.
    executors = [e for e in later if e["event"] == "session" and e["detail"]["slot"] == "executor"
                 and e["detail"]["to"] == "Running"]
    assert len(executors) == 1
    submits = [e for e in journal if e["event"] == "submit"]
    assert len(submits) == 1 and submits[0]["actor"] != orphan_lease
    assert scripted.read_state().state == S.COMPLETE
    assert not os.path.exists(scripted.path(ferrus.ORCHESTRATOR_RECORD))


def test_the_lock_is_released_and_a_clean_exit_leaves_no_record(project):
    store = ferrus.Store(str(project))
    with ferrus.OrchestratorLock(store, "test") as held:
        assert held.notes == []
        record = ferrus.read_orchestrator_record(store)
        assert record["pid"] == os.getpid() and record["kind"] == "test"
        with pytest.raises(ferrus.FerrusError) as refused:
            ferrus.OrchestratorLock(store, "other").acquire()
        assert "test (pid %d" % os.getpid() in refused.value.message
    assert ferrus.read_orchestrator_record(store) is None
    with ferrus.OrchestratorLock(store, "again") as held:
        assert held.notes == []


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_orchestrator_releases_the_project_like_ctrl_c(project, signum):
    """SIGTERM/SIGHUP unwind `ferrus hq` like Ctrl+C: the orchestrator record is removed
    and the exit status is 128 + the signal; by default the signal killed ferrus alone."""
    env = dict(os.environ, FERRUS_LOG="warning")
    proc = subprocess.Popen(FERRUS_CMD + ["-C", str(project), "hq", "--no-tui"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    record = project / ".ferrus" / ferrus.ORCHESTRATOR_RECORD
    try:
        wait_until(record.exists, "HQ to take the orchestrator lock", proc=proc)
        proc.send_signal(signum)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, proc.communicate()
    assert not record.exists(), "the orchestrator record was left behind"


# -- a lease names one agent session --------------------------------------------------------------

def test_two_copies_of_one_agent_id_cannot_share_a_lease(project, clock):
    store = ferrus.Store(str(project), clock=clock)
    first = ferrus.Caller("executor", ferrus.agent_identity("executor", "claude-code", 1, "s-a"))
    copy = ferrus.Caller("executor", ferrus.agent_identity("executor", "claude-code", 1, "s-b"))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    set_config(project, "[limits]\nwait_timeout_secs = 0\n")
    claimed = ferrus.op_wait_for_task(store, first).data
    assert claimed["claimed_by"] == "executor:claude-code:1/s-a"
    assert ferrus.op_wait_for_task(store, copy).data["status"] == "timeout"
    beat = ferrus.op_heartbeat(store, copy).data
    assert beat["code"] == "claimed_by_other"
    with pytest.raises(ferrus.FerrusError):
        ferrus.op_submit(store, copy, "not mine")
    # The holder may still name itself without its session.
    assert ferrus.op_heartbeat(store, first, "executor:claude-code:1").data["status"] == "renewed"
    assert store.read_state().claimed_by == "executor:claude-code:1/s-a"


def test_serve_takes_its_session_from_the_environment_or_the_option():
    assert ferrus.session_from_environment("s-20260101T000000-abcdef") == \
        "s-20260101T000000-abcdef"
    with pytest.raises(ferrus.UsageError):
        ferrus.session_from_environment("../../etc")
    assert ferrus.agent_identity("executor", "codex", 1) == "executor:codex:1"


def test_codex_passes_the_session_variable_to_its_server(project):
    config = ferrus.load_config(str(project))
    argv = ferrus.Codex(config).headless(str(project), "executor", "p").argv
    # (and, inside a task's sandbox, the socket its `ferrus serve` relays to; outside
    # one, the server host's)
    assert 'mcp_servers.ferrus-executor-1.env_vars=["%s", "%s", "%s"]' % (
        ferrus.SESSION_ENV, ferrus.SANDBOX_RELAY_ENV, ferrus.SERVER_HOST_ENV) in argv


# -- lease clocks (issue #11 item 5) ---------------------------------------------------------------

class Monotonic:
    def __init__(self):
        self.now = 5000.0

    def __call__(self):
        return self.now


def lease_project(project, ttl=90):
    set_config(project, "[limits]\nwait_timeout_secs = 0\n\n[lease]\nttl_secs = %d\n" % ttl)


def test_a_lease_stamped_a_day_ahead_is_honoured_only_ttl_from_first_sight(
        project, clock, monkeypatch):
    lease_project(project)
    import datetime as dt
    ahead = type(clock)(clock.now + dt.timedelta(days=1))
    dead = ferrus.Caller("executor", "executor:x:1/s-dead")
    ferrus.op_create_task(ferrus.Store(str(project), clock=clock), ferrus.HUMAN, "t")
    ferrus.op_wait_for_task(ferrus.Store(str(project), clock=ahead), dead)
    assert ferrus.Store(str(project)).read_state().lease_until.startswith("2026-05-14")
    monkeypatch.setattr(ferrus, "LEASE_SIGHTINGS", ferrus.LeaseSightings())   # another process
    mono = Monotonic()
    store = ferrus.Store(str(project), clock=clock, monotonic=mono)
    other = ferrus.Caller("executor", "executor:x:1/s-new")
    assert ferrus.op_wait_for_task(store, other).data["status"] == "timeout"
    assert 89 < store.lease_seconds_left(store.read_state()) <= 90
    mono.now += 60
    clock.advance(60)
    assert ferrus.op_wait_for_task(store, other).data["status"] == "timeout"
    mono.now += 31                      # 91 s since this process first saw the lease
    clock.advance(31)
    taken = ferrus.op_wait_for_task(store, other).data
    assert taken["status"] == "claimed" and taken["claimed_by"] == "executor:x:1/s-new"


def test_a_process_two_hours_ahead_cannot_act_over_a_live_lease(project, clock, monkeypatch):
    lease_project(project)
    import datetime as dt
    holder = ferrus.Caller("executor", "executor:x:1/s-holder")
    store = ferrus.Store(str(project), clock=clock)
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    assert ferrus.op_wait_for_task(store, holder).data["status"] == "claimed"
    monkeypatch.setattr(ferrus, "LEASE_SIGHTINGS", ferrus.LeaseSightings())   # another process
    ahead = ferrus.Store(str(project), clock=type(clock)(clock.now + dt.timedelta(hours=2)),
                         monotonic=Monotonic())
    intruder = ferrus.Caller("executor", "executor:x:1/s-ahead")
    with pytest.raises(ferrus.FerrusError) as refused:
        ferrus.op_submit(ahead, intruder, "my work over theirs")
    assert "leased to executor:x:1/s-holder" in refused.value.message
    with pytest.raises(ferrus.FerrusError):
        ferrus.op_check(ahead, intruder)
    assert ferrus.op_wait_for_task(ahead, intruder).data["status"] == "timeout"
    data = store.read_state()
    assert data.state == S.EXECUTING and data.claimed_by == "executor:x:1/s-holder"


def test_a_lease_abandoned_long_ago_is_free_at_first_sight(project, clock, monkeypatch):
    lease_project(project)
    store = ferrus.Store(str(project), clock=clock)
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    ferrus.op_wait_for_task(store, ferrus.Caller("executor", "executor:x:1/s-gone"))
    state = store.path("STATE.json")
    old = os.stat(state).st_mtime - 600          # written ten minutes ago, never renewed
    os.utime(state, (old, old))
    clock.advance(600)
    monkeypatch.setattr(ferrus, "LEASE_SIGHTINGS", ferrus.LeaseSightings())   # a new process
    fresh = ferrus.Store(str(project), clock=clock, monotonic=Monotonic())
    taken = ferrus.op_wait_for_task(fresh, ferrus.Caller("executor", "executor:x:1/s-next"))
    assert taken.data["status"] == "claimed"


def test_an_interactive_agent_gets_its_own_session(project, tmp_path, monkeypatch):
    seen = tmp_path / "session.txt"
    argv = [sys.executable, "-c", "import os, sys; open(sys.argv[1], 'w').write("
            "os.environ.get('FERRUS_SESSION', ''))", str(seen)]
    set_config(project, custom_agent_config(argv))
    monkeypatch.setenv(ferrus.SESSION_ENV, "s-inherited-from-outside")
    store = ferrus.Store(str(project))
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=io.StringIO())
    shell.interactive("executor", None)
    session = seen.read_text()
    assert session.startswith("s-") and session != "s-inherited-from-outside"
    shell.controller.shutdown()


def test_run_refuses_before_creating_a_task_no_agent_could_work_on(tmp_path):
    """`ferrus run --task` with no agents set, or with a built-in agent CLI that is not
    installed, says so and leaves the project Idle — it used to create the task first and
    then give up on the agent, leaving a task in flight that nobody could work on."""
    root = tmp_path / "proj"
    root.mkdir()
    assert run_cli("init", cwd=str(root)).returncode == 0
    config = root / "ferrus.toml"
    written = config.read_text(encoding="utf-8")      # init names claude-code and codex
    config.write_text(re.sub(r"(?ms)^\[hq\.(supervisor|executor)\]\n.*?(?=^\[|\Z)", "",
                             written), encoding="utf-8")
    refused = run_cli("run", "--task", "Make hello.txt", cwd=str(root))
    assert refused.returncode == 1
    assert "no agent is set for the executor" in refused.stderr
    assert "ferrus register" in refused.stderr
    assert ferrus.Store(str(root)).read_state().state == ferrus.S.IDLE
    config.write_text(written, encoding="utf-8")
    env = dict(os.environ, PATH=str(tmp_path / "empty-bin"))
    missing = run_cli("run", "--task", "Make hello.txt", cwd=str(root), env=env)
    assert missing.returncode == 1, missing.stderr
    assert "agent codex is not installed here (no `codex` on PATH)" in missing.stderr
    assert "npm install" in missing.stderr
    assert ferrus.Store(str(root)).read_state().state == ferrus.S.IDLE
