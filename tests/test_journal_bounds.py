"""Issue #11.2 and #11.8: the journal stays bounded and cheap to read.

A gap between STATE.json's rev and the journal is one journal_gap entry however wide;
events.jsonl rotates; status, `log -n` and HQ's start-up read only the journal's end."""

import json
import os
import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, run_cli, set_config

S = ferrus.S


def set_rev(store, rev):
    path = store.path("STATE.json")
    data = json.load(open(path))
    data["rev"] = rev
    with open(path, "w") as handle:
        json.dump(data, handle)


def journal_lines(store, name=ferrus.JOURNAL_FILE):
    path = store.path(name)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_history(store, count, event="heartbeat", task_id=None):
    """``count`` journal lines written directly (as bench/run.py does), rev to match."""
    with open(store.journal_path(), "a", encoding="utf-8") as handle:
        for seq in range(store.last_journal_seq() + 1, store.last_journal_seq() + count + 1):
            handle.write(ferrus.compact_json({
                "seq": seq, "time": "2026-05-13T10:00:00Z", "actor": "executor:x:1",
                "event": event, "from": "Idle", "to": "Idle", "task_id": task_id,
                "detail": {}}) + "\n")
    set_rev(store, store.last_journal_seq())


def journal_findings(store):
    """What doctor says about the journal (not about ferrus.toml's defaults)."""
    return [f for f in ferrus.doctor_findings(store.root)
            if "journal" in f.problem or ferrus.JOURNAL_FILE in f.problem]


def limited_memory():
    """A child that would need more than 1 GiB fails fast instead of swapping."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


# -- a gap is one entry -----------------------------------------------------------------

def test_a_wide_gap_is_recorded_as_one_journal_gap_entry(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "first")
    open(store.journal_path(), "w").close()         # an emptied events.jsonl
    set_rev(store, 300000)
    ferrus.op_force_reset(store, ferrus.HUMAN)
    gap, reset = journal_lines(store)
    assert gap["event"] == "journal_gap" and gap["seq"] == 300000
    assert gap["detail"]["from"] == 1 and gap["detail"]["to"] == 300000
    assert reset["seq"] == 300001 == store.read_state().rev
    assert [e["seq"] for e in store.read_journal()] == [300000, 300001]
    # Readers understand it: doctor sees a continuous journal, log shows the range.
    assert journal_findings(store) == []
    shown = ferrus.format_event(gap)
    assert "journal_gap" in shown and "from=1" in shown and "to=300000" in shown


def test_a_single_lost_line_is_a_journal_gap_too(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    set_rev(store, 2)                                # committed, never journaled
    store.append_event("tester", "note", {})
    assert [(e["seq"], e["event"]) for e in store.read_journal()] == [
        (1, "create_task"), (2, "journal_gap"), (3, "note")]


@pytest.mark.skipif(os.name == "nt", reason="uses RLIMIT_AS")
@pytest.mark.parametrize("command", [["doctor", "--fix"], ["reset", "--yes"]])
def test_a_rev_of_ten_to_the_twelve_is_repaired_in_bounded_memory(project, command):
    store = ferrus.Store(str(project))
    if command[0] == "reset":          # reset in Idle has nothing to do and writes nothing
        ferrus.op_create_task(store, ferrus.HUMAN, "t")
        open(store.journal_path(), "w").close()
    set_rev(store, 10 ** 12)
    env = dict(os.environ, NO_COLOR="1")
    done = subprocess.run(FERRUS_CMD + command, cwd=str(project),
                          capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=limited_memory)
    assert done.returncode == 0, done.stdout + done.stderr
    entries = journal_lines(store)
    assert len(entries) == 2 and entries[0]["event"] == "journal_gap"
    assert entries[0]["detail"] == dict(entries[0]["detail"], **{"from": 1, "to": 10 ** 12})
    assert entries[-1]["seq"] == store.read_state().rev == 10 ** 12 + 1
    assert run_cli("doctor", cwd=project).returncode == 0


def test_doctor_still_reports_a_real_hole_in_the_sequence(store):
    write_history(store, 3)
    lines = open(store.journal_path()).read().splitlines()
    with open(store.journal_path(), "w") as handle:
        handle.write("\n".join([lines[0], lines[2]]) + "\n")
    problems = [f.problem for f in ferrus.doctor_findings(store.root)]
    assert any("not gapless" in p and ": 3" in p for p in problems)


# -- rotation -----------------------------------------------------------------------------

def test_the_journal_rotates_at_its_size_limit_and_rev_stays_last_seq(store, monkeypatch):
    monkeypatch.setenv("FERRUS_JOURNAL_MAX_BYTES", "4096")
    for i in range(120):
        store.append_event("tester", "note", {"i": i})
    current = journal_lines(store)
    archive = journal_lines(store, ferrus.JOURNAL_ARCHIVE_FILE)
    assert os.path.getsize(store.journal_path()) <= 4096
    assert os.path.getsize(store.journal_archive_path()) <= 4096
    assert current[-1]["seq"] == store.read_state().rev == 120
    assert archive and archive[-1]["seq"] + 1 == current[0]["seq"]
    # Readers see across the rotation: the last entries, gapless, oldest first.
    tail = store.read_journal(limit=len(current) + 3)
    assert [e["seq"] for e in tail] == list(range(120 - len(current) - 2, 121))
    assert [e["seq"] for e in store.read_journal(after_seq=current[0]["seq"] - 2)] == \
        list(range(current[0]["seq"] - 1, 121))
    assert journal_findings(store) == []


def test_journal_rotate_command(project):
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    done = run_cli("journal", "rotate", cwd=project)
    assert done.returncode == 0, done.stderr
    assert "events.jsonl.1" in done.stdout
    assert [e["event"] for e in journal_lines(store, ferrus.JOURNAL_ARCHIVE_FILE)] == \
        ["create_task"]
    [entry] = journal_lines(store)
    assert entry["event"] == "journal_rotated" and entry["seq"] == store.read_state().rev == 2
    log = run_cli("log", cwd=project)
    assert "create_task" in log.stdout and "journal_rotated" in log.stdout
    assert run_cli("doctor", cwd=project).returncode == 0
    assert run_cli("journal", cwd=project).returncode == 2       # names the subcommand


def test_a_crash_between_rotation_and_write_loses_no_seq(store):
    write_history(store, 5)
    os.replace(store.journal_path(), store.journal_archive_path())   # renamed, then killed
    assert store.last_journal_seq() == 5
    store.append_event("tester", "note", {})
    assert [e["seq"] for e in store.read_journal()] == [1, 2, 3, 4, 5, 6]
    assert journal_lines(store)[0]["seq"] == 6


def test_hq_follows_the_journal_across_a_rotation(store, monkeypatch):
    shown = []
    controller = ferrus.HqController(store, emit=shown.append, launcher=lambda slot: None)
    try:
        monkeypatch.setenv("FERRUS_JOURNAL_MAX_BYTES", "2048")
        seen = []
        original = controller._show_entry
        monkeypatch.setattr(controller, "_show_entry",
                            lambda entry: (seen.append(entry["seq"]), original(entry)))
        for i in range(60):
            ferrus.op_create_task(store, ferrus.HUMAN, "task %d" % i)
            ferrus.op_force_reset(store, ferrus.HUMAN)
            if i % 3 == 0:                 # HQ polls more often than the file fills
                controller.drain_journal()
        controller.drain_journal()
        assert os.path.exists(store.journal_archive_path())
        assert seen == list(range(1, 121))
    finally:
        controller.shutdown()


# -- status, log -n and HQ start read only the end --------------------------------------

@pytest.fixture
def counted_parses(monkeypatch):
    """How many journal lines are parsed: the measure of reading "the whole journal"."""
    count = [0]
    real = ferrus.journal_entry

    def counting(line):
        count[0] += 1
        return real(line)
    monkeypatch.setattr(ferrus, "journal_entry", counting)
    return count


def test_status_log_and_hq_start_do_not_scan_a_long_journal(store, project, counted_parses,
                                                            capsys):
    set_config(project, open(os.path.join(str(project), "ferrus.toml")).read() +
               "\n[capacity]\nmax_sessions = 100\n")
    write_history(store, 50000)
    store.append_event("hq", "gate", {"tier": "Green", "action": "Continue", "signal": None})
    write_history(store, 30)

    counted_parses[0] = 0
    outcome = ferrus.op_status(store)
    assert outcome.data["capacity"]["tier"] == "Green"
    assert counted_parses[0] < 200

    counted_parses[0] = 0
    args = type("Args", (), {"n": 5, "json": False, "follow": False, "all": True})()
    ferrus.cmd_log(args, store.root)
    assert len(capsys.readouterr().out.splitlines()) == 5
    assert counted_parses[0] < 200
    # Without --all the heartbeats are left out, and looking for other entries is bounded.
    counted_parses[0] = 0
    args.all = False
    ferrus.cmd_log(args, store.root)
    assert "--all" in capsys.readouterr().out
    assert counted_parses[0] < 1000

    counted_parses[0] = 0
    controller = ferrus.HqController(store, emit=lambda m: None, launcher=lambda slot: None)
    try:
        assert controller.cursor == store.read_state().rev
        assert counted_parses[0] < 200
        store.append_event("tester", "note", {})
        counted_parses[0] = 0
        controller.drain_journal()
        assert controller.cursor == store.read_state().rev and counted_parses[0] < 10
    finally:
        controller.shutdown()


def test_sessions_per_task_survive_an_hq_restart_without_the_journal(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    first = ferrus.HqController(store, emit=lambda m: None, launcher=lambda slot: None)
    try:
        slot = first.slots["executor"]
        for _ in range(3):
            before = slot.session.state
            slot.session = ferrus.dataclasses.replace(slot.session, state=ferrus.SS.RUNNING)
            first._journal_session(slot, before, ferrus.SessionEvent("SessionStarted"))
            slot.session = ferrus.dataclasses.replace(slot.session, state=ferrus.SS.STOPPED)
        assert first.signals().sessions == 3
    finally:
        first.shutdown()
    counter = store.read_state().extra[ferrus.TASK_SESSIONS_KEY]
    assert counter == {"task_id": store.read_state().task_id, "sessions": 3}
    open(store.journal_path(), "w").close()          # the count does not come from here
    again = ferrus.HqController(store, emit=lambda m: None, launcher=lambda slot: None)
    try:
        assert again.signals().sessions == 3
    finally:
        again.shutdown()
    ferrus.op_force_reset(store, ferrus.HUMAN)
    ferrus.op_create_task(store, ferrus.HUMAN, "next")
    fresh = ferrus.HqController(store, emit=lambda m: None, launcher=lambda slot: None)
    try:
        assert fresh.signals().sessions == 0                  # a new task counts anew
    finally:
        fresh.shutdown()


def test_sessions_of_a_project_from_before_the_counter_come_from_the_task_tail(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    task = store.read_state().task_id
    for _ in range(2):
        store.append_event("hq", "session", {"slot": "executor", "from": "Spawning",
                                             "to": "Running"})
    controller = ferrus.HqController(store, emit=lambda m: None, launcher=lambda slot: None)
    try:
        assert ferrus.TASK_SESSIONS_KEY not in store.read_state().extra
        assert controller.sessions_of(store.read_state()) == 2
        assert store.read_state().task_id == task
    finally:
        controller.shutdown()


# -- a damaged journal never has to fit in memory ----------------------------------------

@pytest.mark.parametrize("where", ["middle", "end", "start"])
def test_an_overlong_line_is_skipped_not_held(store, monkeypatch, where):
    monkeypatch.setattr(ferrus, "JOURNAL_LINE_LIMIT", 1000)
    write_history(store, 3)
    lines = open(store.journal_path()).read().splitlines(True)
    junk = "x" * 50000 + ("\n" if where != "end" else "")
    at = {"start": 0, "middle": 2, "end": 3}[where]
    with open(store.journal_path(), "w") as handle:
        handle.write("".join(lines[:at]) + junk + "".join(lines[at:]))
    assert [e["seq"] for e in store.read_journal()] == [1, 2, 3]
    assert [e["seq"] for e in store.journal_entries()] == [1, 2, 3]
    assert store.last_journal_seq() == 3
    [finding] = journal_findings(store)
    assert "1 unreadable line(s)" in finding.problem
    finding.fix()
    assert journal_findings(store) == []
    assert [e["seq"] for e in journal_lines(store)] == [1, 2, 3]
    store.append_event("tester", "note", {})
    assert [e["seq"] for e in store.read_journal()] == [1, 2, 3, 4]
