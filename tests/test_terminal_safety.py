"""Issue #11.1: text from agents, checks and files never reaches a terminal as control
sequences.  The scripted agent asks a question full of escape sequences; every front
end that shows it (`ferrus run`, plain and curses HQ, `pipeline run`, status, log,
doctor) must write them as visible text.  The bytes written are what is checked."""

import json
import os
import subprocess
import time

import pytest

import ferrus
from conftest import FERRUS_CMD, enqueue, git, run_tasks, scripted_setup

# OSC 52 (set the clipboard), OSC 0 (window title), CSI 2J (clear the screen), a carriage
# return that overprints the line with a lie, and a UTF-8-encoded C1 CSI.
EVIL = ("Pick one\x1b]52;c;ZXZpbA==\x07\x1b]0;pwned\x07\x1b[2J\rTask complete. "
        "\u009b31mred\x7f")
SHOWN = "Pick one^[]52;c;ZXZpbA==^G^[]0;pwned^G^[[2J^MTask complete. \\x9b31mred^?"


def assert_inert(raw):
    """No byte a terminal would act on: only printable text, newline and tab."""
    assert isinstance(raw, bytes)
    text = raw.decode("utf-8")
    bad = [ch for ch in text if (ord(ch) < 0x20 and ch not in "\n\t") or 0x7f <= ord(ch) <= 0x9f]
    assert not bad, "control characters reached the terminal: %r" % sorted(set(bad))


def env_for(tmp_path, **extra):
    env = dict(os.environ, SCRIPTED_DIR=str(tmp_path), NO_COLOR="1")
    env.pop("FERRUS_DEBUG", None)
    env.update(extra)
    return env


def cli_bytes(*args, cwd):
    """Run the CLI and return (exit code, stdout text) decoded from the exact bytes (a
    text-mode pipe would turn a carriage return into a newline and hide it)."""
    env = dict(os.environ, NO_COLOR="1")
    env.pop("FERRUS_DEBUG", None)
    done = subprocess.run(FERRUS_CMD + list(args), cwd=str(cwd),
                          capture_output=True, env=env, timeout=60)
    assert_inert(done.stdout)
    assert_inert(done.stderr)
    return done.returncode, done.stdout.decode("utf-8")


# -- the sanitiser ---------------------------------------------------------------------

def test_terminal_safe_makes_every_control_visible_and_keeps_unicode():
    assert ferrus.terminal_safe(EVIL) == SHOWN
    ordinary = "naïve café — 漢字 かな 한글 🙂👍🏽 שלום\tcol\nnext line"
    assert ferrus.terminal_safe(ordinary) == ordinary
    assert ferrus.terminal_safe("\x00\x08\x0b\x0c\x1f") == "^@^H^K^L^_"
    assert ferrus.terminal_safe("\x80\x9f") == "\\x80\\x9f"
    assert ferrus.terminal_safe(SHOWN) == SHOWN                 # idempotent
    assert ferrus.terminal_safe(42) == "42"


def test_json_for_terminal_is_exact_json_without_controls():
    value = {"q": EVIL}
    text = ferrus.json_for_terminal(ferrus.compact_json(value))
    assert json.loads(text) == value
    assert_inert(text.encode("utf-8"))


def test_commit_messages_carry_no_raw_control_characters(git_project):
    message = ferrus.task_commit_message("t-1", "Red \x1b[31mtitle\x07 \x9b2J\r\nmore",
                                         "notes\x1b]52;c;eA==\x07\r\nline two\ttab\x7f")
    assert not any(ch in message for ch in "\x1b\x07\x9b\x7f\r")
    assert message.startswith("Red ^[[31mtitle^G \\x9b2J\n\nnotes^[]52;c;eA==^G\nline two\ttab^?")
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "Bell \x07 and \x1b[2J escape\n\nWRITE bell.txt: bell\n")
    code, lines = run_tasks(store, 1)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    log = git(git_project, "log", "-1", "--format=%B", "main").stdout
    assert "Ferrus-Task: %s" % task in log
    assert "\x1b" not in log and "\x07" not in log and "Bell ^G and ^[[2J escape" in log


# -- the front ends ----------------------------------------------------------------------

def test_ferrus_run_shows_an_agents_question_inert(scripted, tmp_path):  # noqa: F811
    env = env_for(tmp_path, SCRIPTED_BEHAVIOR="ask", SCRIPTED_QUESTION=EVIL)
    done = subprocess.run(FERRUS_CMD + ["run", "--task", "ask"],
                          cwd=scripted.root, capture_output=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 4, done.stdout + done.stderr
    assert SHOWN.encode("utf-8") in done.stdout
    assert_inert(done.stdout)
    assert_inert(done.stderr)
    # Stored data keeps the exact text; only what is shown is made visible.
    assert scripted.read_file("QUESTION.md").strip() == EVIL.strip()


def test_plain_hq_shows_an_agents_question_inert(scripted, tmp_path):  # noqa: F811
    env = env_for(tmp_path, SCRIPTED_BEHAVIOR="ask", SCRIPTED_QUESTION=EVIL)
    proc = subprocess.Popen(FERRUS_CMD + ["hq", "--no-tui"], cwd=scripted.root,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        proc.stdin.write(b"/task ask\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 90
        while scripted.read_state().state != ferrus.S.AWAITING_HUMAN:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)              # HQ polls; give it time to show the question
        proc.stdin.write(b"/log 5\n/quit\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"[AWAITING YOUR ANSWER]" in out
    assert SHOWN.encode("utf-8") in out
    assert_inert(out)


def test_curses_hq_shows_an_agents_question_inert(scripted, tmp_path):  # noqa: F811
    pytest.importorskip("curses")
    test_hq_curses = pytest.importorskip("test_hq_curses")
    if test_hq_curses.shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    pane = test_hq_curses.Pane(scripted.root, tmp_path, SCRIPTED_BEHAVIOR="ask",
                               SCRIPTED_QUESTION=EVIL)
    try:
        title = subprocess.run(pane.tmux + ["display", "-p", "-t", "hq", "#{pane_title}"],
                               capture_output=True, text=True, timeout=30).stdout
        pane.wait(lambda lines: lines[0].startswith("ferrus HQ"), what="the status line")
        pane.type("/task ask", "Enter")
        screen = pane.wait_for("^[]52;c;ZXZpbA==^G^[]0;pwned^G^[[2J^MTask complete.",
                               timeout=90)
        assert screen[0].startswith("ferrus HQ")         # the screen was not cleared
        after = subprocess.run(pane.tmux + ["display", "-p", "-t", "hq", "#{pane_title}"],
                               capture_output=True, text=True, timeout=30).stdout
        assert "pwned" not in after and after == title
        buffers = subprocess.run(pane.tmux + ["list-buffers"], capture_output=True, text=True,
                                 timeout=30).stdout
        assert "evil" not in buffers                      # OSC 52 set no clipboard buffer
        pane.keys("C-c")
        pane.keys("C-c")
    finally:
        pane.close()


def test_pipeline_run_shows_a_workers_output_inert(project, tmp_path, monkeypatch):
    test_pipelines = pytest.importorskip("test_pipelines")
    test_pipelines.configure(project)
    monkeypatch.setenv("WORKER_LOG", str(tmp_path / "spawns.log"))
    for name in ("WORKER_FAIL", "WORKER_FAIL_ONCE", "WORKER_SILENT", "WORKER_SLOW",
                 "WORKER_DELAY"):
        monkeypatch.delenv(name, raising=False)
    topic = EVIL.replace("\r", "")          # the topic travels on one prompt line
    env = env_for(tmp_path)
    ran = subprocess.run(FERRUS_CMD + ["pipeline", "run", "research", topic],
                         cwd=str(project), capture_output=True, timeout=120, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert b"Topic: Pick one^[]52;c;ZXZpbA==^G^[]0;pwned^G^[[2J" in ran.stdout
    assert_inert(ran.stdout)
    assert_inert(ran.stderr)
    run = ferrus.list_runs(ferrus.Store(str(project)))[0][0]
    listed = subprocess.run(FERRUS_CMD + ["pipeline", "status", run, "--json"],
                            cwd=str(project), capture_output=True, timeout=60, env=env)
    assert json.loads(listed.stdout)["topic"] == topic          # --json stays exact
    assert_inert(listed.stdout)


def test_status_log_and_doctor_show_file_text_inert(store, project):
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    store.append_event("agent\x1b[2J", "note", {"text": EVIL})
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.failure_reason = EVIL
        data.selected_spec = "specs/\x1b]0;title\x07.md"
        tx.set(data, "fail")
    stray = os.path.join(str(project), ".ferrus", "x\x1b[2J\r" + ferrus.TEMP_SUFFIX)
    open(stray, "w").close()
    os.utime(stray, (time.time() - 600, time.time() - 600))

    _, status = cli_bytes("status", cwd=project)
    assert "Pick one^[]52;c;ZXZpbA==^G" in status
    assert "specs/^[]0;title^G.md" in status

    _, log = cli_bytes("log", "-n", "5", cwd=project)
    assert "agent^[[2J" in log and SHOWN in log
    _, as_json = cli_bytes("log", "-n", "5", "--json", cwd=project)
    entries = [json.loads(line) for line in as_json.splitlines()]
    assert any(entry["detail"].get("text") == EVIL for entry in entries)   # exact

    _, doctor = cli_bytes("doctor", cwd=project)
    assert "x^[[2J^M" + ferrus.TEMP_SUFFIX in doctor
