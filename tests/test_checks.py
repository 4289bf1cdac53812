"""The check runner (`ferrus.run_checks`) and the `ferrus check` command."""

import glob
import io
import json
import os
import resource
import threading
import time

import ferrus
from conftest import run_cli, set_config, wait_until

SUP = ferrus.Caller("supervisor", "supervisor:test:0")


def checks(*commands, parallel=False, timeout=600, fail_fast=False):
    return ferrus.ChecksConfig(commands=list(commands), parallel=parallel,
                               timeout_secs=timeout, fail_fast=fail_fast)


def run(root, config, keep_lines=30, cancel=None, attempt=1):
    return ferrus.run_checks(str(root), config, os.path.join(str(root), ".ferrus", "logs"),
                             attempt=attempt, keep_lines=keep_lines, cancel=cancel)


def read(path):
    with open(path, "rb") as handle:
        return handle.read().decode("utf-8", errors="replace")


def process_gone(pid):
    """True when ``pid`` no longer runs (a zombie nobody reaped counts as gone)."""
    try:
        with open("/proc/%d/stat" % pid) as handle:
            stat = handle.read()
    except FileNotFoundError:
        return True
    except OSError:  # pragma: no cover - no /proc: fall back to kill(0)
        return not ferrus.pid_alive(pid)
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def write_config(root, commands=(), max_check_retries=20, max_feedback_lines=30,
                 parallel=False, timeout=600):
    set_config(root, """\
[checks]
commands = %s
parallel = %s
timeout_secs = %d

[limits]
max_check_retries = %d
max_feedback_lines = %d
wait_timeout_secs = 0
""" % (json.dumps(list(commands)), str(parallel).lower(), timeout, max_check_retries,
       max_feedback_lines))


# ============================================================================
# run_checks: results and the report
# ============================================================================

def test_sequential_pass_and_fail_with_report_format(project):
    failing = "echo first-out; echo to-stderr >&2; exit 3"
    result = run(project, checks("echo hello", failing, "true"))
    assert [r.status for r in result.results] == ["passed", "failed", "passed"]
    assert [r.exit_code for r in result.results] == [0, 3, 0]
    assert not result.passed and not result.cancelled
    assert result.failed == [result.results[1]]
    assert result.failure_reason() == "Commands failed: " + failing
    bad = result.results[1]
    assert bad.tail == ["first-out", "to-stderr"] and bad.line_count == 2

    report = result.report(30)
    assert report.startswith("Checks failed.\n\nFailed commands:\n- `%s` (exit 3)\n" % failing)
    assert "\n`%s`\n```\nfirst-out\nto-stderr\n```\n" % failing in report
    assert "(last " not in report                      # every line fits
    assert "(full output: `%s`)" % bad.log_path in report
    assert report.endswith("Full log: `%s`" % result.log_path)
    assert result.log_path.startswith(".ferrus/logs/check_1_") and result.log_path.endswith(".txt")
    assert "echo hello" not in report                  # passing commands are not reported


def test_report_notes_the_last_n_of_m_lines(project):
    result = run(project, checks("seq 1 100; exit 1"), keep_lines=10)
    (failed,) = result.results
    assert failed.line_count == 100
    assert failed.tail == [str(n) for n in range(91, 101)]
    report = result.report(10)
    assert "(last 10 of 100 lines)\n```\n" + "\n".join(map(str, range(91, 101))) + "\n```" in report
    # A smaller report limit than the kept tail shows fewer lines and says so.
    assert "(last 3 of 100 lines)\n```\n98\n99\n100\n```" in result.report(3)


def test_killed_by_signal_note(project):
    result = run(project, checks("kill -9 $$"))
    assert result.results[0].exit_code == -9
    assert "(killed by signal 9)" in result.report(30)


def test_empty_command_passes(project):
    result = run(project, checks("", "   ", "true"))
    assert [r.status for r in result.results] == ["passed", "passed", "passed"]
    assert result.passed


def test_no_commands_is_a_pass(project):
    result = run(project, checks())
    assert result.results == [] and result.passed


def test_per_command_logs_hold_the_full_output(project):
    commands = ("seq 1 500", "echo only-stderr >&2; exit 2", "printf 'no newline at end'")
    result = run(project, checks(*commands), keep_lines=5)
    logs = sorted(glob.glob(os.path.join(str(project), ".ferrus", "logs", "check_1_*.log")))
    assert len(logs) == 3
    for number, (command, outcome) in enumerate(zip(commands, result.results), 1):
        assert outcome.log_path_abs.endswith(".%d.log" % number)
        assert os.path.isfile(outcome.log_path_abs)
        assert outcome.log_path == os.path.relpath(outcome.log_path_abs, str(project))
        text = read(outcome.log_path_abs)
        assert text.startswith("$ %s\n" % command)
    first = read(result.results[0].log_path_abs)
    assert "\n".join(str(n) for n in range(1, 501)) in first
    assert result.results[0].tail == [str(n) for n in range(496, 501)]
    assert result.results[0].line_count == 500
    assert "only-stderr" in read(result.results[1].log_path_abs)
    assert "no newline at end" in read(result.results[2].log_path_abs)
    assert result.results[2].line_count == 1
    assert result.results[2].tail == ["no newline at end"]
    summary = read(os.path.join(str(project), result.log_path))
    assert "=== [PASS] seq 1 500" in summary and "=== [FAIL] echo only-stderr" in summary
    for outcome in result.results:
        assert outcome.log_path in summary


def test_attempt_number_is_in_the_log_names(project):
    result = run(project, checks("true"), attempt=7)
    assert os.path.basename(result.log_path).startswith("check_7_")
    assert os.path.basename(result.results[0].log_path).startswith("check_7_")


def test_commands_run_in_the_project_root(project):
    result = run(project, checks("test -f ferrus.toml && pwd"))
    assert result.passed
    assert os.path.realpath(result.results[0].tail[0]) == os.path.realpath(str(project))


# ============================================================================
# Concurrency, timeouts, fail_fast, cancellation
# ============================================================================

def test_parallel_runs_commands_at_the_same_time(project):
    """Each command marks that it started and passes only once all four have started:
    run one after another, the first would wait for the others until it gives up."""
    barrier = ("touch started.{i}; n=0; while [ $n -lt 1200 ]; do "
               "[ -e started.0 ] && [ -e started.1 ] && [ -e started.2 ] && [ -e started.3 ] "
               "&& exit 0; sleep 0.05; n=$((n+1)); done; exit 1")
    result = run(project, checks(*[barrier.format(i=i) for i in range(4)], parallel=True,
                                 timeout=120))
    assert result.passed and len(result.results) == 4, result.report(30)


def test_timeout_kills_the_whole_process_group(project):
    pid_file = os.path.join(str(project), "grandchild.pid")
    command = "sh -c 'sleep 600 & echo $! > grandchild.pid; sleep 600'"
    started = time.monotonic()
    result = run(project, checks(command, "echo after", timeout=1))
    # far below the 600 s the command would take, with room for a loaded machine
    assert time.monotonic() - started < 120
    timed_out, after = result.results
    assert timed_out.status == "timed out"
    assert after.status == "passed"         # a timeout is a failure, not a stop
    assert not result.passed and result.failed == [timed_out]
    assert "(timed out after 1 s)" in result.report(30)
    with open(pid_file) as handle:
        grandchild = int(handle.read())
    wait_until(lambda: process_gone(grandchild), "the background grandchild to die", 3)


def test_grandchild_left_running_after_exit_does_not_hang_the_gate(project):
    pid_file = os.path.join(str(project), "daemon.pid")
    started = time.monotonic()
    result = run(project, checks("sleep 600 & echo $! > daemon.pid; echo done"))
    assert time.monotonic() - started < 120     # the gate did not wait for the daemon
    assert result.passed and result.results[0].tail == ["done"]
    with open(pid_file) as handle:
        daemon = int(handle.read())
    wait_until(lambda: process_gone(daemon), "the leftover background process to die", 3)


def test_fail_fast_sequential_skips_the_rest(project):
    result = run(project, checks("exit 4", "touch second-ran", "touch third-ran", fail_fast=True))
    assert [r.status for r in result.results] == ["failed", "skipped", "skipped"]
    assert not os.path.exists(os.path.join(str(project), "second-ran"))
    assert result.failed == [result.results[0]]
    assert "Not run: `touch second-ran`, `touch third-ran`" in result.report(30)
    # Without fail_fast every command runs.
    result = run(project, checks("exit 4", "touch second-ran"))
    assert [r.status for r in result.results] == ["failed", "passed"]
    assert os.path.exists(os.path.join(str(project), "second-ran"))


def test_fail_fast_parallel_stops_the_others(project):
    started = time.monotonic()
    result = run(project, checks("sleep 0.2; exit 1", "sleep 600; touch slow-finished",
                                 "sleep 600", parallel=True, fail_fast=True))
    elapsed = time.monotonic() - started
    assert elapsed < 120, "fail_fast did not stop the parallel commands (%.1f s)" % elapsed
    assert [r.status for r in result.results] == ["failed", "cancelled", "cancelled"]
    assert not os.path.exists(os.path.join(str(project), "slow-finished"))
    assert not result.passed and not result.cancelled
    assert "(stopped: another command failed and fail_fast is on)" in result.report(30)


def test_cancel_event_kills_the_run(project):
    cancel = threading.Event()
    box = {}
    command = "sleep 600 & echo $! > cancel.pid; wait"
    thread = threading.Thread(target=lambda: box.setdefault(
        "run", run(project, checks(command, "touch never-ran"), cancel=cancel)))
    thread.start()
    pid_file = os.path.join(str(project), "cancel.pid")
    wait_until(lambda: os.path.exists(pid_file) and os.path.getsize(pid_file),
               "the check to start", 10)
    started = time.monotonic()
    cancel.set()
    thread.join(120)
    assert not thread.is_alive()
    assert time.monotonic() - started < 120     # far below the command's 600 s
    result = box["run"]
    assert result.cancelled and not result.passed
    assert [r.status for r in result.results] == ["cancelled", "skipped"]
    assert not os.path.exists(os.path.join(str(project), "never-ran"))
    with open(pid_file) as handle:
        pid = int(handle.read())
    wait_until(lambda: process_gone(pid), "the cancelled command's child to die", 3)


# ============================================================================
# Bounded memory
# ============================================================================

def test_huge_output_keeps_memory_bounded(project):
    line = "ferrus check output line padded to sixty-odd bytes 0123456789"
    lines = 3_300_000                  # about 200 MB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run(project, checks("yes '%s' | head -n %d" % (line, lines)), keep_lines=25)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (outcome,) = result.results
    try:
        assert outcome.status == "passed"
        assert outcome.line_count == lines
        assert len(outcome.tail) <= 25
        assert outcome.tail == [line] * 25
        # The log keeps the head and the tail within [checks] max_log_bytes (8 MiB).
        assert os.path.getsize(outcome.log_path_abs) <= 8 * 1024 * 1024 + 200
        assert outcome.log_cut_bytes > lines * (len(line) + 1) - 8 * 1024 * 1024
        # ru_maxrss is in KiB on Linux; a buffered 200 MB would show.
        assert after - before < 64 * 1024, "max RSS grew by %d KiB" % (after - before)
    finally:
        os.unlink(outcome.log_path_abs)


def test_giant_line_is_cut_in_the_tail(project):
    size = 5 * 1024 * 1024
    result = run(project, checks("head -c %d /dev/zero | tr '\\0' x; echo; "
                                 "head -c %d /dev/zero | tr '\\0' y; exit 1" % (size, size)))
    (outcome,) = result.results
    assert outcome.line_count == 2
    terminated, unterminated = outcome.tail
    assert len(terminated) <= ferrus._TAIL_LINE_BYTES + 3
    assert terminated.endswith("x" * 100) and set(terminated) <= {".", "x"}
    assert len(unterminated) <= ferrus._TAIL_LINE_BYTES + 3
    assert unterminated.endswith("y" * 100) and set(unterminated) <= {".", "y"}
    assert len(result.report(30)) < 3 * ferrus._TAIL_LINE_BYTES + 1000
    # The log keeps the head (x...) and the tail (...y) within max_log_bytes (8 MiB).
    assert os.path.getsize(outcome.log_path_abs) <= 8 * 1024 * 1024 + 200
    with open(outcome.log_path_abs, "rb") as handle:
        data = handle.read()
    assert b"x" * 1000 in data[:8192] and b"y" * 1000 in data[-8192:]
    assert b"bytes cut" in data


def test_a_cut_giant_line_is_always_marked_as_cut(project):
    """A line longer than _TAIL_LINE_BYTES shows in the tail as "..." + its last
    bytes.  When the line arrives over several pipe reads (any line of megabytes
    does), _OutputSink trims the pending partial line to exactly
    _TAIL_LINE_BYTES, so _tail_text no longer sees that it was longer and the
    "..." marker is lost: the agent cannot tell the line was cut."""
    size = 5 * 1024 * 1024
    short = run(project, checks("printf '%%s\\n' %s" % ("z" * 5000)))
    assert short.results[0].tail[0] == "..." + "z" * ferrus._TAIL_LINE_BYTES   # one read: marked
    for command in ("head -c %d /dev/zero | tr '\\0' x; echo" % size,   # newline in a later read
                    "head -c %d /dev/zero | tr '\\0' x" % size):        # no newline at all
        tail = run(project, checks(command)).results[0].tail
        assert len(tail) == 1
        assert tail[0][:3] == "...", (
            "%r: the cut line starts %r, without the \"...\" marker" % (command, tail[0][:5]))
        assert tail[0][3:] == "x" * ferrus._TAIL_LINE_BYTES


# ============================================================================
# `ferrus check` and `ferrus check --force`
# ============================================================================

def test_cli_check_force_exit_codes_and_no_state_change(project):
    store = ferrus.Store(str(project))
    rev = store.read_state().rev

    write_config(project, [])
    done = run_cli("check", "--force", cwd=project)
    assert done.returncode == 0, done.stderr
    assert "No check commands are configured" in done.stdout

    write_config(project, ["echo fine"])
    done = run_cli("check", "--force", cwd=project)
    assert done.returncode == 0, done.stderr
    assert "passed    echo fine" in done.stdout and "All checks passed" in done.stdout

    write_config(project, ["echo fine", "echo boom-output; exit 5"])
    done = run_cli("check", "--force", cwd=project)
    assert done.returncode == 1
    assert "failed    echo boom-output; exit 5 (exit 5)" in done.stdout
    assert "Checks failed.\n\nFailed commands:\n- `echo boom-output; exit 5` (exit 5)" in done.stdout
    assert "boom-output" in done.stdout and "Full log: `.ferrus/logs/check_0_" in done.stdout

    # In Executing too: --force changes nothing, not even the retry counter.
    ferrus.op_create_task(store, SUP, "a task")
    rev = store.read_state().rev
    done = run_cli("check", "--force", cwd=project)
    assert done.returncode == 1
    data = store.read_state()
    assert data.rev == rev and data.check_retries == 0 and data.state == ferrus.S.EXECUTING
    assert [e["event"] for e in store.read_journal()] == ["create_task"]


def test_cli_check_refused_outside_a_work_state(project):
    write_config(project, ["true"])
    done = run_cli("check", cwd=project)
    assert done.returncode == 1
    assert "Cannot run checks from state Idle" in done.stderr
    assert ferrus.Store(str(project)).read_journal() == []


def test_check_outside_a_task_points_at_force(project):
    result = run_cli("check", cwd=project)
    assert result.returncode == 1
    assert "Cannot run checks from state Idle" in result.stderr
    assert "hint: `ferrus check --force`" in result.stderr


def test_hq_check_outside_a_task_points_at_force_as_the_cli_does(store):
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    try:
        shell.handle("/check")
    finally:
        shell.controller.shutdown()
    text = out.getvalue()
    assert "error: Cannot run checks from state Idle." in text
    assert "hint: /check --force runs the checks in any state and changes nothing" in text


def test_cli_check_counts_retries_and_fails_at_max(project):
    store = ferrus.Store(str(project))
    write_config(project, ["echo nope; false"], max_check_retries=3)
    ferrus.op_create_task(store, SUP, "a task")

    done = run_cli("check", cwd=project)
    assert done.returncode == 1
    assert "Checks failed (retry 1/3)" in done.stdout and "nope" in done.stdout
    assert store.read_state().check_retries == 1
    done = run_cli("check", cwd=project)
    assert done.returncode == 1 and "retry 2/3" in done.stdout
    assert store.read_state().check_retries == 2

    # A pass resets the counter.
    write_config(project, ["true"], max_check_retries=3)
    done = run_cli("check", cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "All checks passed. State remains Executing" in done.stdout
    assert store.read_state().check_retries == 0

    write_config(project, ["echo nope; false"], max_check_retries=3)
    for attempt in (1, 2):
        assert run_cli("check", cwd=project).returncode == 1
        assert store.read_state().check_retries == attempt
    done = run_cli("check", cwd=project)
    assert done.returncode == 1
    assert "Check retry limit reached (3/3)" in done.stdout
    data = store.read_state()
    assert data.state == ferrus.S.FAILED
    assert data.failure_reason.startswith("Check failed 3 consecutive times.")

    done = run_cli("check", cwd=project)
    assert done.returncode == 1 and "Cannot run checks from state Failed" in done.stderr

    journal = store.read_journal()
    assert [e["event"] for e in journal] == ["create_task", "check_failed", "check_failed",
                                             "check_passed", "check_failed", "check_failed",
                                             "check_failed"]
    assert {e["actor"] for e in journal[1:]} == {"human:cli:0"}
    assert journal[-1]["to"] == "Failed"
    # Each attempt's logs are numbered by the retry it was.
    names = {os.path.basename(p).split("_")[1]
             for p in glob.glob(os.path.join(str(project), ".ferrus", "logs", "check_*.txt"))}
    assert names == {"1", "2", "3"}


def test_cli_check_without_commands_passes_with_a_warning(project):
    store = ferrus.Store(str(project))
    write_config(project, [])
    ferrus.op_create_task(store, SUP, "a task")
    done = run_cli("check", cwd=project)
    assert done.returncode == 0
    assert "no check commands are configured" in done.stdout
    assert store.read_state().state == ferrus.S.EXECUTING
