"""Live progress in `ferrus run` and HQ, `--quiet`/`--json`, `log --all`, and [notify].

The agents are tests/scripted_agent.py (real processes speaking MCP to `ferrus serve`).
"""

import io
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import ferrus
from conftest import (FERRUS_CMD, FERRUS_PY, SCRIPTED_CHECK, SCRIPTED_CONFIG, set_config,
                      wait_until)
from test_hq import run

S = ferrus.S




def cli_env(tmp_path, **extra):
    env = dict(os.environ, SCRIPTED_DIR=str(tmp_path / "memory"), SCRIPTED_BEHAVIOR="")
    env.update(extra)
    return env


# -- what `ferrus run` shows -------------------------------------------------------------

def test_run_shows_checks_submission_and_review_notes(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "reject-once")
    code, lines = run(scripted)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    text = "\n".join(lines)
    assert "check passed: %s" % SCRIPTED_CHECK in text
    assert "checks passed — submitting for review" in text
    assert "submission:\n  Did the work." in text
    assert "review notes:\n  Please also add a README line." in text
    # The creation comes first, then the header that describes the task it created.
    first = next(i for i, line in enumerate(lines) if "Idle → Executing" in line)
    header = next(i for i, line in enumerate(lines) if line.startswith("ferrus run: State"))
    assert first < header


def test_a_failing_check_shows_its_command_exit_and_last_lines(scripted, monkeypatch):
    set_config(scripted.root, SCRIPTED_CONFIG.replace(
        'commands = [%s]' % json.dumps(SCRIPTED_CHECK),
        'commands = [%s, "echo the-reason; exit 3"]' % json.dumps(SCRIPTED_CHECK)).replace(
        "wait_timeout_secs = 5", "wait_timeout_secs = 5\nmax_check_retries = 2"))
    # The second check fails before the task too: the run goes on past the red base.
    code, lines = run(scripted, timeout=60, allow_red_base=True)
    text = "\n".join(lines)
    assert code == ferrus.RUN_FAILED, text
    assert "check failed: echo the-reason; exit 3 (exit 3," in text
    assert "    │ the-reason" in text
    assert "checks failed on submit (retry" in text or "checks failed (retry" in text


def test_json_mode_prints_one_object_per_event(scripted, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "reject-once")
    code, lines = run(scripted, mode="json")
    assert code == ferrus.RUN_COMPLETE
    records = [json.loads(line) for line in lines]
    for record in records:
        assert {"time", "event", "level", "text"} <= set(record)
        assert record["event"] in ferrus.PROGRESS_EVENTS + ("run",)
    events = [r["event"] for r in records]
    assert "check" in events and "submission" in events and "review" in events
    moves = [(r["from"], r["to"]) for r in records if r["event"] == "transition"]
    assert moves[0] == ("Idle", "Executing") and moves[-1] == ("Reviewing", "Complete")
    review = next(r for r in records if r["event"] == "review")
    assert review["notes"] == "Please also add a README line."
    check = next(r for r in records if r["event"] == "check")
    assert check["command"] == SCRIPTED_CHECK and check["status"] == "passed"
    assert events[-1] == "complete"


def test_quiet_mode_leaves_out_the_commentary(scripted):
    code, lines = run(scripted, mode="quiet")
    assert code == ferrus.RUN_COMPLETE
    text = "\n".join(lines)
    assert "Reviewing → Complete" in text and "submission:" in text
    assert "started the executor" not in text and "check passed:" not in text


def test_cli_run_json_and_quiet(scripted, tmp_path):
    done = subprocess.run(FERRUS_CMD + ["run", "--json", "--task", "Make work.txt"],
                          cwd=scripted.root, capture_output=True, text=True, timeout=120,
                          env=cli_env(tmp_path), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert records[-1]["event"] == "complete"
    both = subprocess.run(FERRUS_CMD + ["run", "--json", "--quiet", "--resume"],
                          cwd=scripted.root, capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "not allowed with" in both.stderr


# -- tool calls and heartbeats, from a stub agent and an injected clock ------------------------

class FakeProcess:
    def __init__(self, events=(), last_text=""):
        self.events = list(events)
        self.tally = ferrus.UsageTally()
        for event in self.events:
            self.tally.add(event)
        self.last_text = last_text
        self.pid = 4242
        self.log_path = "x.log"

    def exited(self):
        return False


def test_tool_calls_are_one_line_each_and_a_heartbeat_follows_silence(project, clock):
    store = ferrus.Store(str(project))
    now = [100.0]
    messages = []
    controller = ferrus.HqController(store, messages.append, clock=lambda: now[0])
    slot = controller.slots["executor"]
    slot.session = ferrus.dataclasses.replace(slot.session, state=ferrus.SS.RUNNING)
    slot.process = FakeProcess([ferrus.AgentEvent("tool_call", name="Bash", text="pytest -q"),
                                ferrus.AgentEvent("usage", input_tokens=5),
                                ferrus.AgentEvent("tool_call", name="Edit", text="src/a.py")],
                               last_text="Retrying request in 30s")
    slot.started_at = now[0]
    slot.timer = None
    controller._check_slot(slot)
    calls = [m for m in messages if m.event == "tool_call"]
    assert [m.text for m in calls] == ["executor ▸ Shell  pytest -q",
                                       "executor ▸ Edit  src/a.py"]
    controller._check_slot(slot)
    assert len([m for m in messages if m.event == "tool_call"]) == 2      # shown once
    controller._heartbeat()
    assert not [m for m in messages if m.event == "heartbeat"]
    now[0] += controller.HEARTBEAT_SECS + 70
    controller._heartbeat()
    beat = [m for m in messages if m.event == "heartbeat"]
    assert len(beat) == 1
    assert beat[0].text.startswith("executor working, 2m1")
    assert "2 tool calls" in beat[0].text and "last output: Retrying request in 30s" in beat[0].text
    controller._heartbeat()
    assert len([m for m in messages if m.event == "heartbeat"]) == 1     # not again at once
    slot.process = None


def test_claude_codex_and_gemini_tool_calls_carry_their_argument():
    line = json.dumps({"type": "assistant", "message": {"content": [
        {"type": "tool_use", "name": "Bash", "input": {"command": "make   test"}}]}})
    assert [(e.name, e.text) for e in ferrus._parse_claude_style(line)
            if e.kind == "tool_call"] == [("Bash", "make test")]
    codex = ferrus.Codex(ferrus.Config())
    events = codex.parse_line(json.dumps({"type": "item.completed", "item": {
        "type": "command_execution", "command": "bash -lc ls", "exit_code": 0}}))
    # The shell wrapper Codex runs a command in is left out: the model's own command.
    assert [(e.name, e.text, e.ok) for e in events if e.kind == "tool_call"] == \
        [("shell", "ls", True)]
    gemini = ferrus.GeminiCli(ferrus.Config())
    events = gemini.parse_line(json.dumps({"type": "tool_use", "tool_name": "read_file",
                                           "parameters": {"absolute_path": "/a/b.py"}}))
    assert [(e.name, e.text) for e in events if e.kind == "tool_call"] == [("read_file",
                                                                            "/a/b.py")]
    assert ferrus.tool_summary({"x": "y" * 300}).endswith("…")
    # A resource read (nano's read_resource, Claude's ReadMcpResourceTool) shows its URI.
    assert ferrus.tool_summary({"server": "ferrus-supervisor-1", "uri": "ferrus://diff"}) == \
        "ferrus://diff"


# -- start-up, status and the log ------------------------------------------------------------

def test_a_task_completed_before_hq_started_is_not_announced_again(scripted):
    assert run(scripted)[0] == ferrus.RUN_COMPLETE
    messages = []
    controller = ferrus.HqController(scripted, messages.append)
    controller.poll()
    controller.poll()
    assert not [m for m in messages if "Task complete" in m.text]
    assert "completed at " in controller.describe_state()
    assert all(slot.label() == "idle" for slot in controller.slots.values())


CONSULT_QUESTION = ("## Problem\nx\n## What I tried\ny\n## Options (if any)\nA or B\n"
                    "## Question\nWhich?")


def test_the_supervisors_answer_is_shown_after_the_executor_took_it(store):
    """The supervisor's answer to a consultation reaches HQ and `ferrus run` even when the
    waiting executor has already taken it: wait_for_consult empties CONSULT_RESPONSE.md in
    the same moment, so the answer shown comes from the journal entry, not the file."""
    executor = ferrus.Caller("executor", "executor:test:1")
    supervisor = ferrus.Caller("supervisor", "supervisor:test:1")
    shown = []
    controller = ferrus.HqController(store, emit=shown.append)      # HQ watching
    ferrus.op_create_task(store, ferrus.HUMAN, "Make work.txt")
    ferrus.op_wait_for_task(store, executor)
    ferrus.op_consult(store, executor, CONSULT_QUESTION)
    ferrus.op_respond_consult(store, supervisor, "Use option A.\n\nBecause B is slower.")
    ferrus.op_wait_for_consult(store, executor)       # takes the answer and empties the file
    assert store.read_file("CONSULT_RESPONSE.md") == ""
    controller.drain_journal()                        # HQ reads the entries only now
    answers = [m for m in shown if m.event == "consult_answer"]
    assert [m.text for m in answers] == [
        "the supervisor answers:\n  Use option A.\n  Because B is slower."]
    assert answers[0].data["answer"] == "Use option A.\nBecause B is slower."
    # `ferrus log` keeps its one line per entry: the answer's text is not in it.
    entry = next(e for e in store.read_journal() if e["event"] == "respond_consult")
    assert "said" in entry["detail"] and "said=" not in ferrus.format_event(entry)


def test_log_hides_bookkeeping_unless_all(scripted, tmp_path):
    assert run(scripted)[0] == ferrus.RUN_COMPLETE
    short = subprocess.run(FERRUS_CMD + ["log", "-n", "3"], cwd=scripted.root,
                           capture_output=True, text=True, timeout=60)
    assert short.returncode == 0
    assert " approve " in short.stdout.splitlines()[-1]
    assert " session " not in short.stdout
    everything = subprocess.run(FERRUS_CMD + ["log", "--all"], cwd=scripted.root,
                                capture_output=True, text=True, timeout=60)
    assert " session " in everything.stdout
    story = subprocess.run(FERRUS_CMD + ["log"], cwd=scripted.root,
                           capture_output=True, text=True, timeout=60)
    assert len(story.stdout.splitlines()) < len(everything.stdout.splitlines())


def test_hq_log_and_help(scripted):
    assert run(scripted)[0] == ferrus.RUN_COMPLETE
    out = []

    class Shell(ferrus.HqShell):
        def write(self, text):
            out.append(text)
    shell = Shell(scripted)
    shell.handle("/log 3")
    assert "approve" in out[-1] and not any(" session " in line for line in out)
    out.clear()
    shell.handle("/log 3 --all")
    assert len(out) == 3
    out.clear()
    shell.handle("/help")
    lines = "\n".join(out).splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert any(line.startswith("  /pipeline") for line in lines)


def test_reset_in_idle_journals_nothing(project):
    store = ferrus.Store(str(project))
    before = store.last_journal_seq()
    done = subprocess.run(FERRUS_CMD + ["reset", "--yes"], cwd=str(project),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Nothing to reset" in done.stdout
    assert store.last_journal_seq() == before


def test_format_event_shows_check_results_briefly():
    entry = {"seq": 4, "time": "2026-01-01T00:00:00Z", "actor": "executor:x:1",
             "event": "check_failed", "from": "Executing", "to": "Executing",
             "detail": {"checks": [{"command": "pytest -q", "status": "failed", "exit": 1,
                                    "secs": 2.5, "log": ".ferrus/logs/a.log"}]}}
    line = ferrus.format_event(entry)
    assert "checks=pytest -q:failed" in line and ".ferrus/logs/a.log" not in line


# -- notifications ---------------------------------------------------------------------------

RECORDER = textwrap.dedent("""\
    import sys
    with open(sys.argv[1], "a") as handle:
        handle.write(" | ".join(sys.argv[2:]) + "\\n")
""")


def notify_config(record, events=None, extra=""):
    lines = ["", "[notify]", "bell = true",
             "command = %s" % json.dumps([sys.executable, record + ".py", record, "{event}",
                                          "{task_id}", "{summary}"])]
    if events is not None:
        lines.append("events = %s" % json.dumps(events))
    return "\n".join(lines) + "\n" + extra


def wait_for_lines(path, count, timeout=20):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as handle:
                lines = handle.read().splitlines()
            if len(lines) >= count:
                return lines
        time.sleep(0.05)
    raise AssertionError("the notifier recorded %s" % (
        open(path).read() if os.path.exists(path) else "nothing"))


def test_a_notifier_command_records_a_full_run_in_order(scripted, monkeypatch, tmp_path):
    record = str(tmp_path / "notified")
    with open(record + ".py", "w") as handle:
        handle.write(RECORDER)
    set_config(scripted.root, SCRIPTED_CONFIG + notify_config(record, list(ferrus.NOTIFY_EVENTS)))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "reject-once")
    rings = []
    code, lines = run(scripted, bell=lambda: rings.append(1))
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    task = scripted.read_state().task_id
    got = wait_for_lines(record, 5)
    # Detached commands may finish in any order; the order they were started is kept.
    events = [line.split(" | ")[0] for line in got]
    assert sorted(events) == sorted(["task_created", "submitted", "rejected", "submitted",
                                     "complete"])
    assert all(line.split(" | ")[1] == task for line in got)
    assert any(line.startswith("rejected | %s | Please also add a README line." % task)
               for line in got)
    assert len(rings) == 5


def test_notifications_are_started_in_the_order_of_the_run(scripted, monkeypatch, tmp_path):
    sent = []
    monkeypatch.setattr(ferrus.Notifier, "notify",
                        lambda self, event, task, summary: sent.append(event)
                        if event in self.config().events else None)
    set_config(scripted.root, SCRIPTED_CONFIG + '\n[notify]\nevents = %s\n'
               % json.dumps(list(ferrus.NOTIFY_EVENTS)))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "reject-once")
    assert run(scripted)[0] == ferrus.RUN_COMPLETE
    assert sent == ["task_created", "submitted", "rejected", "submitted", "complete"]


def test_default_events_and_awaiting_human(scripted, monkeypatch, tmp_path):
    record = str(tmp_path / "notified")
    with open(record + ".py", "w") as handle:
        handle.write(RECORDER)
    set_config(scripted.root, SCRIPTED_CONFIG + notify_config(record))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "ask")
    code, lines = run(scripted, ask=lambda question: "blue")
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    got = wait_for_lines(record, 2)
    assert [line.split(" | ")[0] for line in got] == ["awaiting_human", "complete"] or \
        sorted(line.split(" | ")[0] for line in got) == ["awaiting_human", "complete"]
    assert any("Which colour" in line for line in got)


def test_a_failing_or_hanging_notifier_never_blocks_and_is_reported_once(project, tmp_path):
    store = ferrus.Store(str(project))
    messages = []
    set_config(str(project), '[notify]\ncommand = ["%s", "-c", "import time; time.sleep(60)"]\n'
               'timeout_secs = 1\n' % sys.executable.replace("\\", "/"))
    notifier = ferrus.Notifier(store, messages.append)
    import time
    earlier = set(threading.enumerate())
    started = time.monotonic()
    notifier.notify("complete", "t-1", "done")
    notifier.notify("failed", "t-1", "boom")
    assert time.monotonic() - started < 5      # detached: notify returns at once
    # Both hang until their timeout: once each watch has ended, one failure was reported.
    wait_until(lambda: messages and not [thread for thread in threading.enumerate()
                                         if thread.name == "ferrus-notify" and
                                         thread not in earlier],
               "both notifiers to be stopped", timeout=20)
    assert len(messages) == 1 and "was still running after 1s" in messages[0].text
    set_config(str(project), '[notify]\ncommand = ["/nonexistent/notifier"]\n')
    other = ferrus.Notifier(store, messages.append)
    other.notify("complete", "t-1", "done")
    other.notify("complete", "t-1", "done")
    deadline = time.monotonic() + 20            # the spawn is off the caller's path too
    while len(messages) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(messages) == 2 and "could not start" in messages[1].text
    other.finish()
    assert len(messages) == 2                   # the second failure is only logged


def test_notify_config_is_validated(project):
    set_config(str(project), '[notify]\nevents = ["complete", "lunch"]\n')
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.load_config(str(project))
    assert "notify.events" in err.value.message and "lunch" in err.value.message
    set_config(str(project), '[notify]\nbell = "yes"\n')
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.load_config(str(project))
    assert "notify.bell" in err.value.message
    set_config(str(project), '[notify]\ndesktop = true\ncommand = ["ntfy", "{event}"]\n')
    config = ferrus.load_config(str(project)).notify
    assert config.desktop and config.bell and config.command == ["ntfy", "{event}"]
    assert config.events == list(ferrus.NOTIFY_DEFAULT_EVENTS)


def test_desktop_notifier_argv_needs_no_dependency(monkeypatch):
    monkeypatch.setattr(ferrus.sys, "platform", "darwin")
    argv = ferrus.desktop_notification_argv("ferrus: done", 'say "hi"')
    assert argv[0] == "osascript" and '\\"hi\\"' in argv[2]
    monkeypatch.setattr(ferrus.sys, "platform", "linux")
    monkeypatch.setattr(ferrus.shutil, "which", lambda name: "/usr/bin/" + name)
    argv = ferrus.desktop_notification_argv("ferrus: done", "--icon=/etc/passwd")
    assert argv.index("--") < argv.index("--icon=/etc/passwd")   # an agent's words, no option
    monkeypatch.setattr(ferrus.shutil, "which", lambda name: None)
    assert ferrus.desktop_notification_argv("t", "b") is None


# -- pipeline workers: the same progress ----------------------------------------------------

CHATTY_WORKER = textwrap.dedent("""\
    import json, sys, time
    sys.stdin.read()
    print(json.dumps({"type": "assistant", "message": {"content": [
        {"type": "tool_use", "name": "WebFetch", "input": {"url": "https://example.org"}}]}}),
        flush=True)
    print("Retrying request (attempt 2 of 10)", flush=True)
    time.sleep(60)
""")


def test_a_pipeline_worker_shows_tool_calls_and_heartbeats(project, tmp_path, monkeypatch,
                                                           clock):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY_WORKER)
    set_config(str(project), textwrap.dedent("""\
        [agents.custom.chatty]
        interactive = [%(py)s, %(script)s]
        headless = [%(py)s, %(script)s]
        prompt = "stdin"

        [hq.executor]
        agent = "chatty"
        """) % {"py": json.dumps(sys.executable), "script": json.dumps(str(script))})
    with open(os.path.join(str(project), "workflows.json"), "w") as handle:
        json.dump({"one": {"description": "d", "phases": [{"id": "p", "mode": "parallel",
                   "workers": [{"role": "scout", "timeout": 600, "final": True,
                                "task": "look around"}]}]}}, handle)
    # A custom agent streams nothing ferrus reads; this one speaks Claude's stream-json.
    monkeypatch.setattr(ferrus.CustomAgent, "parse_line",
                        lambda self, line: ferrus._parse_claude_style(line))
    store = ferrus.Store(str(project), clock=clock)
    messages = []
    orchestrator = ferrus.PipelineOrchestrator(store, emit=messages.append)
    run = orchestrator.create("one", "a topic")
    try:
        orchestrator.reconcile(run)
        import time
        deadline = time.monotonic() + 30
        while not [m for m in messages if m.event == "tool_call"] or \
                not orchestrator._watched or \
                not list(orchestrator._watched.values())[0]["said"]:
            assert time.monotonic() < deadline, [m.text for m in messages]
            orchestrator.watch(run)
            time.sleep(0.05)
        call = next(m for m in messages if m.event == "tool_call")
        assert call.text == "scout ▸ WebFetch  https://example.org"
        assert not [m for m in messages if m.event == "heartbeat"]
        clock.advance(orchestrator.HEARTBEAT_SECS + 5)
        orchestrator.watch(run)
        beat = [m for m in messages if m.event == "heartbeat"]
        assert len(beat) == 1 and beat[0].text.startswith("scout working, 1m")
        assert "1 tool call;" in beat[0].text
        assert "last output: Retrying request (attempt 2 of 10)" in beat[0].text
    finally:
        orchestrator.cancel(run)


def test_a_delivered_pipeline_run_notifies(project, store, tmp_path, monkeypatch):
    from test_pipelines import configure
    configure(project)
    monkeypatch.delenv("WORKER_LOG", raising=False)
    sent = []
    monkeypatch.setattr(ferrus.Notifier, "notify",
                        lambda self, event, ref, summary: sent.append((event, ref, summary)))
    orchestrator = ferrus.PipelineOrchestrator(store)
    run = orchestrator.create("research", "notify me")
    import time
    deadline = time.monotonic() + 60
    while not orchestrator.reconcile(run).finished:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [(e, r) for e, r, _ in sent] == [("pipeline_delivered", run)]
    assert sent[0][2].startswith("notify me: .ferrus/pipelines/archive/")


# -- Ctrl+C while ferrus starts ----------------------------------------------------------------

def test_ctrl_c_while_ferrus_loads_exits_130_before_doing_anything(project, monkeypatch):
    import signal
    previous = signal.getsignal(signal.SIGINT)
    handler = ferrus._interrupted_while_starting
    try:
        signal.signal(signal.SIGINT, handler)
        handler(signal.SIGINT, None)                 # Ctrl+C arrives during the imports
        monkeypatch.chdir(str(project))
        before = ferrus.Store(str(project)).last_journal_seq()
        assert ferrus.main(["run", "--task", "anything"]) == 130
        assert ferrus.Store(str(project)).last_journal_seq() == before   # nothing done
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        handler.interrupted = False
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_anywhere_in_main_exits_130_without_a_traceback(monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(ferrus, "build_parser", interrupted)
    assert ferrus.main(["status"]) == 130
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_ctrl_c_during_a_run_stops_it_with_130(project, tmp_path):
    import signal
    import time
    set_config(str(project), """
[agents.custom.slow]
interactive = ["sleep", "30"]
headless = ["sleep", "30"]

[hq.supervisor]
agent = "slow"

[hq.executor]
agent = "slow"
""")
    launcher = os.path.join(os.path.dirname(FERRUS_PY), "ferrus")
    proc = subprocess.Popen([sys.executable, launcher, "run", "--task", "x"], cwd=str(project),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if "started the executor" in line:
                break
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in out
    assert ferrus.running_orchestrator(ferrus.Store(str(project))) is None


def test_the_bell_rings_only_when_asked_for_and_only_on_a_terminal(project):
    store = ferrus.Store(str(project))
    rings = []
    notifier = ferrus.Notifier(store, lambda message: None, bell=lambda: rings.append(1))
    notifier.notify("complete", "t-1", "done")
    notifier.notify("submitted", "t-1", "not in the default events")
    assert rings == [1]
    set_config(str(project), "[notify]\nbell = false\n")
    notifier.notify("complete", "t-1", "done")
    assert rings == [1]
    assert ferrus.terminal_bell(open(os.devnull, "w")) is None

    class Terminal:
        def __init__(self):
            self.written = ""

        def isatty(self):
            return True

        def write(self, text):
            self.written += text

        def flush(self):
            pass
    screen = Terminal()
    ferrus.terminal_bell(screen)()
    assert screen.written == "\a"
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=screen)
    shell.ring_bell()
    assert screen.written == "\a\a"
    piped = io.StringIO()
    ferrus.HqShell(store, stdin=io.StringIO(""), stdout=piped).ring_bell()
    assert piped.getvalue() == ""


def test_failed_checkpoint_and_human_review_entries_notify(project, monkeypatch):
    store = ferrus.Store(str(project))
    sent = []
    monkeypatch.setattr(ferrus.Notifier, "notify",
                        lambda self, event, task, summary: sent.append((event, summary)))
    controller = ferrus.HqController(store, lambda message: None)
    entries = [
        {"event": "check_failed", "from": "Executing", "to": "Failed", "task_id": "t-1"},
        {"event": "capacity_checkpoint", "from": "Executing", "to": "Executing", "actor": "hq",
         "detail": {"action": "Checkpoint", "target": "spawn:executor"}, "task_id": "t-1"},
        {"event": "capacity_checkpoint", "from": "Executing", "to": "Executing", "actor": "hq",
         "detail": {"action": "EmergencyStop", "target": "running"}, "task_id": "t-1"},
        {"event": "approve", "from": "Reviewing", "to": "AwaitingConfirmation", "task_id": "t-1"},
        {"event": "human_approve", "from": "AwaitingConfirmation", "to": "Complete",
         "task_id": "t-1"},
        {"event": "delivered", "actor": "pipeline", "from": "Idle", "to": "Idle"},
        {"event": "session", "actor": "hq", "from": "Executing", "to": "Executing"}]
    for entry in entries:
        controller._notify_for(entry)
    assert [event for event, _ in sent] == ["failed", "checkpoint", "emergency_stop",
                                            "awaiting_human", "complete"]
    assert "spawn:executor" in sent[1][1] and "ferrus approve" in sent[3][1]
