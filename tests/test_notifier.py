"""[notify] notifiers run off the loop's path: notify() never waits for a process to
start, no more than NOTIFY_MAX_RUNNING run at once (one more is not started, and the
warning says so), and in `ferrus run --parallel` one notifier serves the whole run, so a
task's end neither waits for nor stops the notifiers its events started — each is
stopped at its own timeout_secs, or when the run ends.  While a web board serves the
project, a notification carries the task's link on it ({url}, FERRUS_URL, the desktop
notification's second line)."""

import contextlib
import json
import os
import signal
import sys
import threading
import tracemalloc

import ferrus
from conftest import (SCRIPTED_CONFIG, enqueue, run_cli, run_tasks, scripted_setup, set_config,
                      statuses, wait_until)


def hanging_command(pid_file):
    return '["sh", "-c", "echo $$ >> %s; exec sleep 120"]' % pid_file


def pids_in(path):
    return [int(line) for line in open(path).read().split()] if os.path.exists(path) else []


def alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with open("/proc/%d/stat" % pid) as handle:       # a zombie is not running
        return handle.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_notify_returns_before_the_notifier_has_even_started(project, monkeypatch):
    store = ferrus.Store(str(project))
    set_config(str(project), '[notify]\ncommand = ["true"]\nbell = false\n')
    release, spawning, spawned = threading.Event(), threading.Event(), []
    real = ferrus.subprocess.Popen

    def slow_popen(*args, **kwargs):
        spawning.set()
        assert release.wait(30)
        proc = real(*args, **kwargs)
        spawned.append(proc)
        return proc
    monkeypatch.setattr(ferrus.subprocess, "Popen", slow_popen)
    notifier = ferrus.Notifier(store, lambda message: None)
    notifier.notify("complete", "t-1", "done")      # returns while the spawn is stuck
    assert spawning.wait(30) and not spawned
    release.set()
    wait_until(lambda: spawned and spawned[0].poll() is not None, "the notifier to run")
    assert spawned[0].returncode == 0


def test_no_more_than_the_bound_of_notifiers_run_at_once(project, tmp_path):
    pid_file = tmp_path / "pids"
    store = ferrus.Store(str(project))
    set_config(str(project), '[notify]\nbell = false\ntimeout_secs = 600\ncommand = %s\n'
               % hanging_command(pid_file))
    messages = []
    notifier = ferrus.Notifier(store, messages.append)
    for number in range(ferrus.NOTIFY_MAX_RUNNING + 6):
        notifier.notify("complete", "t-%d" % number, "done")
    wait_until(lambda: len(pids_in(pid_file)) == ferrus.NOTIFY_MAX_RUNNING,
               "the notifiers to start")
    started = pids_in(pid_file)
    try:
        assert notifier.skipped == 6 and len(messages) == 1
        assert "%d notifiers are still running (at most %d run at once), so the one for " \
            "complete was not started" % ((ferrus.NOTIFY_MAX_RUNNING,) * 2) in messages[0].text
        assert all(alive(pid) for pid in started)
        notifier.finish(grace=0)
        assert not any(alive(pid) for pid in started)
        assert len(pids_in(pid_file)) == ferrus.NOTIFY_MAX_RUNNING     # none started later
        notifier.notify("complete", "t-late", "after the end")          # nothing more starts
        assert len(pids_in(pid_file)) == ferrus.NOTIFY_MAX_RUNNING
    finally:
        for pid in started:
            if alive(pid):
                os.kill(pid, 9)


def test_a_hung_notifier_does_not_outlive_the_run(scripted):
    """[notify] says a notifier still running after timeout_secs is stopped; the run
    that started it ending first must not leave it running for good."""
    pid_file = os.path.join(scripted.root, "notifier.pid")
    set_config(scripted.root, SCRIPTED_CONFIG + '[notify]\nbell = false\ntimeout_secs = 600\n'
               'command = %s\n' % hanging_command(pid_file))
    done = run_cli("run", "--task", "work", cwd=scripted.root, input="",
                   env={"FERRUS_LOG": "warning"}, timeout=300)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert pids_in(pid_file), "the notifier never ran"
        notifier = pids_in(pid_file)[0]
        wait_until(lambda: not alive(notifier), "the notifier to be stopped", timeout=30)
        assert "[notify] command failed: sh was still running when ferrus ended" in \
            done.stdout, done.stdout
    finally:
        for pid in pids_in(pid_file):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_a_notifier_flooding_stderr_costs_bounded_memory(project):
    """Only the end of a notifier's stderr is kept (it was read whole into memory), and
    its last line still explains the failure."""
    script = ("import sys; sys.stderr.write('x' * (64 << 20) + '\\nthe real reason\\n'); "
              "sys.exit(2)")
    set_config(project, '[notify]\ncommand = [%s, "-c", %s]\n' % (
        json.dumps(sys.executable), json.dumps(script)))
    messages = []
    notifier = ferrus.Notifier(ferrus.Store(str(project)), messages.append)
    tracemalloc.start()
    try:
        notifier.notify("complete", "t-1", "done")
        wait_until(lambda: messages, "the notifier's warning")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "exited with code 2: the real reason" in messages[0].text, messages[0].text
    assert peak < 16 << 20, "reading the notifier's stderr took %d bytes" % peak


def test_a_hanging_notifier_outlives_its_task_in_a_parallel_run(git_project, tmp_path,
                                                                monkeypatch):
    """Each task's end waited up to 5 s for the notifiers its events had started, then
    stopped them, whatever timeout_secs said; now they run on, stopped at timeout_secs or
    once at the run's end."""
    pid_file = tmp_path / "pids"
    store = scripted_setup(git_project, ["test -f README.md"],
                           '[notify]\nbell = false\ntimeout_secs = 600\n'
                           'events = ["complete"]\ncommand = %s\n\n' % hanging_command(pid_file))
    tasks = [enqueue(store, "T%d.\n\nWRITE n%d.txt: %d\n" % (i, i, i)) for i in range(2)]
    at_task_ends, finished = [], []
    real_end, real_finish = ferrus.ParallelRunner._end_task, ferrus.Notifier.finish

    def end_task(runner, task, status, reason, head=None):
        sent = [e for e in runner.notifier.sent if e[0] == "complete"]
        wait_until(lambda: len(pids_in(pid_file)) >= len(sent), "the notifiers to start")
        real_end(runner, task, status, reason, head)
        at_task_ends.append([alive(pid) for pid in pids_in(pid_file)])

    def finish(notifier, grace=ferrus.NOTIFY_EXIT_GRACE_SECS):
        finished.append(notifier)
        real_finish(notifier, grace=0)
    monkeypatch.setattr(ferrus.ParallelRunner, "_end_task", end_task)
    monkeypatch.setattr(ferrus.Notifier, "finish", finish)
    try:
        code, lines = run_tasks(store, 2)
    finally:
        for pid in pids_in(pid_file):
            if alive(pid):
                os.kill(pid, 9)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "merged" for task in tasks}
    assert len(pids_in(pid_file)) == 2                 # one "complete" per task
    # every notifier started so far was still running when each task ended
    assert len(at_task_ends) == 2 and all(all(states) for states in at_task_ends), at_task_ends
    assert len(finished) == 1                          # once, at the run's end
    assert not any(alive(pid) for pid in pids_in(pid_file))
    assert any("[notify] command failed: sh was still running when ferrus ended" in line
               for line in lines), "\n".join(lines)


def test_a_notification_links_to_the_tasks_page_while_a_board_serves_the_project(
        project, tmp_path, monkeypatch):
    store = ferrus.Store(str(project))
    out = tmp_path / "out"
    # A stand-in notify-send: what the desktop notification would show.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "notify-send").write_text('#!/bin/sh\nprintf %%s "$4" > %s\n'
                                         % (tmp_path / "desktop"))
    (bin_dir / "notify-send").chmod(0o755)
    monkeypatch.setenv("PATH", "%s%s%s" % (bin_dir, os.pathsep, os.environ["PATH"]))
    set_config(str(project), '[notify]\nbell = false\ndesktop = true\ncommand = '
               '["sh", "-c", "printf \'%%s|%%s\' \\"$FERRUS_URL\\" \\"$1\\" > %s", "sh", '
               '"{url}"]\n' % out)

    def notified(task_id):
        for name in ("out", "desktop"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(str(tmp_path / name))
        notifier = ferrus.Notifier(store, lambda message: None)
        notifier.notify("complete", task_id, "said {url} itself")
        wait_until(lambda: out.exists() and (tmp_path / "desktop").exists(),
                   "the notifiers to run")
        notifier.finish()
        return out.read_text(), (tmp_path / "desktop").read_text()

    assert notified("t-1") == ("|", "said {url} itself")       # no board: no link
    ferrus.write_web_record(store, "http://127.0.0.1:8765")      # a board in this process
    try:
        link = "http://127.0.0.1:8765/task/t-1"
        assert notified("t-1") == ("%s|%s" % (link, link), "said {url} itself\n" + link)
    finally:
        ferrus.remove_web_record(store)
    assert notified("t-1")[0] == "|"
