"""The store: transactions under the lock, atomic durable writes, the journal, crash safety."""

import errno
import multiprocessing
import os
import random
import signal
import time

import pytest

import ferrus
from ferrus import S

POSIX_ONLY = pytest.mark.skipif(os.name == "nt", reason="uses fork and SIGKILL")


def journal_seqs(store):
    return [entry["seq"] for entry in store.read_journal()]


def test_transaction_writes_content_then_state_then_one_journal_line(store):
    with store.transaction("tester") as tx:
        tx.write("TASK.md", "hello")
        tx.set(ferrus.t_create_task(tx.state, store.clock(), "t-1"), "create_task")
    data = store.read_state()
    assert data.state == S.EXECUTING and data.rev == 1
    assert store.read_file("TASK.md") == "hello"
    [entry] = store.read_journal()
    assert entry["seq"] == 1 and entry["actor"] == "tester" and entry["event"] == "create_task"
    assert (entry["from"], entry["to"], entry["task_id"]) == ("Idle", "Executing", "t-1")


def test_a_failing_transaction_writes_nothing(store):
    before = open(store.path("STATE.json")).read()
    with pytest.raises(RuntimeError):
        with store.transaction("tester") as tx:
            tx.write("TASK.md", "partial")
            tx.set(ferrus.t_create_task(tx.state, store.clock(), "t-1"), "create_task")
            raise RuntimeError("boom")
    assert open(store.path("STATE.json")).read() == before
    assert store.read_file("TASK.md") == ""
    assert store.read_journal() == []


def test_a_transaction_without_an_event_commits_nothing(store):
    with store.transaction("reader") as tx:
        assert tx.state.state == S.IDLE
    assert store.read_state().rev == 0 and store.read_journal() == []


def test_missing_ferrus_dir_says_run_init(tmp_path):
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.Store(str(tmp_path)).read_state()
    assert "ferrus init" in err.value.hint


def test_lock_wait_is_bounded_and_explained(store):
    store.lock_timeout = 0.2
    with store.lock():
        started = time.monotonic()
        with pytest.raises(ferrus.LockTimeout) as err:
            with store.transaction("second"):
                pass
    assert time.monotonic() - started < 5
    assert "STATE.lock" in err.value.message


def test_atomic_write_leaves_no_temp_files_and_keeps_mode(tmp_path):
    path = tmp_path / "f.txt"
    ferrus.atomic_write(str(path), "one")
    os.chmod(str(path), 0o640)
    ferrus.atomic_write(str(path), "two")
    assert path.read_text() == "two"
    if os.name != "nt":
        assert os.stat(str(path)).st_mode & 0o777 == 0o640
    assert os.listdir(str(tmp_path)) == ["f.txt"]


@pytest.mark.parametrize("failing_call", [1, 2, 3])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_write_failing_mid_transaction_keeps_the_previous_state(store, monkeypatch,
                                                                  failing_call, code):
    """fsync #1 is TASK.md, #2 is STATE.json (the commit point), #3 the journal."""
    ferrus.op_create_task(store, ferrus.HUMAN, "first task")
    state_before = open(store.path("STATE.json")).read()
    real_fsync = os.fsync
    calls = {"n": 0}

    def flaky_fsync(fd):
        calls["n"] += 1
        if calls["n"] == failing_call:
            raise OSError(code, os.strerror(code))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", flaky_fsync)
    monkeypatch.setattr(ferrus, "fsync_directory", lambda path: None)
    with pytest.raises(OSError):
        with store.transaction("tester") as tx:
            tx.write("REVIEW.md", "new notes")
            tx.set(ferrus.t_check_passed(tx.state, store.clock()), "check_passed")
    monkeypatch.setattr(os, "fsync", real_fsync)
    data = store.read_state()   # always parses
    leftovers = [n for n in os.listdir(store.dir) if n.endswith(ferrus.TEMP_SUFFIX)]
    assert leftovers == []
    if failing_call < 3:
        assert open(store.path("STATE.json")).read() == state_before
        assert data.rev == 1
    else:
        # STATE.json was committed; its journal line may or may not have reached
        # the disk.  Either way the next commit leaves seq equal to rev, gapless.
        assert data.rev == 2
        store.append_event("tester", "note", {})
        assert journal_seqs(store) == [1, 2, 3]
        assert store.read_journal()[1]["event"] in ("check_passed", "journal_gap")


# -- concurrency ----------------------------------------------------------------

def _hammer(root, worker, count, start):
    # Generous bounds: on a loaded 2-core machine one lock wait can take many seconds.
    store = ferrus.Store(root, lock_timeout=600)
    start.wait(600)         # every worker writes at once: their updates contend
    for i in range(count):
        if i % 2 == 0:
            store.append_event("worker-%d" % worker, "tick", {"i": i})
        else:
            with store.transaction("worker-%d" % worker) as tx:
                data = tx.state.copy()
                data.check_retries += 1
                tx.set(data, "bump", i=i)


def test_eight_processes_lose_no_update(project):
    root = str(project)
    workers, each = 8, 50
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(workers)
    procs = [ctx.Process(target=_hammer, args=(root, w, each, start)) for w in range(workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(900)
        assert proc.exitcode == 0
    store = ferrus.Store(root)
    data = store.read_state()
    assert data.rev == workers * each
    assert data.check_retries == workers * each // 2, "every read-modify-write survived"
    entries = store.read_journal()
    assert [e["seq"] for e in entries] == list(range(1, workers * each + 1))
    per_actor = {}
    for entry in entries:
        per_actor[entry["actor"]] = per_actor.get(entry["actor"], 0) + 1
    assert per_actor == {"worker-%d" % w: each for w in range(workers)}


# -- crash safety ----------------------------------------------------------------

def _commit_forever(root):
    store = ferrus.Store(root, lock_timeout=60)
    while True:
        data = store.read_state()
        if data.state == S.IDLE:
            ferrus.op_create_task(store, ferrus.HUMAN, "task %d" % data.rev)
        else:
            ferrus.op_force_reset(store, ferrus.HUMAN)


@POSIX_ONLY
def test_sigkill_at_random_moments_never_corrupts_state(project):
    root = str(project)
    store = ferrus.Store(root)
    rng = random.Random(1234)
    kills = 0
    # 200 kills at random moments, and more while the children have committed too little
    # to prove anything (on a loaded machine a child may not run before its kill).
    while kills < 200 or store.read_state().rev <= 20:
        assert kills < 5000, "the children never got to commit"
        kills += 1
        pid = os.fork()
        if pid == 0:  # child: commit until killed
            try:
                _commit_forever(root)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.002, 0.04))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        data = store.read_state()          # parses every single time
        assert store.last_journal_seq() <= data.rev
    assert store.read_state().rev > 20, "the children did commit work"
    # Age any temp file a kill left behind so doctor considers it stray.
    for name in os.listdir(store.dir):
        if name.endswith(ferrus.TEMP_SUFFIX):
            old = time.time() - 3600
            os.utime(store.path(name), (old, old))
    ferrus.cmd_doctor(type("Args", (), {"fix": True, "probe": False})(), root)
    problems = [f for f in ferrus.doctor_findings(root) if f.severity == "error"]
    assert problems == []
    data = store.read_state()
    covered = []          # a journal_gap entry stands for the lost seqs from..seq, in one line
    for entry in store.read_journal():
        if entry["event"] == "journal_gap":
            covered.extend(range(entry["detail"]["from"], entry["seq"] + 1))
        else:
            covered.append(entry["seq"])
    assert covered == list(range(1, data.rev + 1)), "journal gapless and equal to rev after doctor"
    assert not [n for n in os.listdir(store.dir) if n.endswith(ferrus.TEMP_SUFFIX)]


def test_a_torn_journal_line_is_skipped_and_repaired(store):
    store.append_event("a", "one", {})
    with open(store.journal_path(), "a") as handle:
        handle.write('{"seq": 2, "ti')          # a write cut short
    assert journal_seqs(store) == [1]
    store.append_event("a", "two", {})           # starts on a fresh line
    assert journal_seqs(store) == [1, 2]
    findings = ferrus.doctor_findings(store.root)
    assert any("unreadable" in f.problem for f in findings)
    for finding in findings:
        if finding.fix:
            finding.fix()
    assert not [f for f in ferrus.doctor_findings(store.root) if f.severity == "error"]


def test_wait_for_change_notices_a_commit_quickly(store):
    import threading
    stamp = store.state_stamp()
    timer = threading.Timer(0.05, lambda: store.append_event("x", "poke", {}))
    timer.start()
    started = time.monotonic()
    assert store.wait_for_change(stamp, time.monotonic() + 5)
    assert time.monotonic() - started < 2
    timer.join()


def test_wait_for_change_stops_on_cancel(store):
    import threading
    cancel = threading.Event()
    cancel.set()
    assert not store.wait_for_change(store.state_stamp(), time.monotonic() + 5, cancel)
