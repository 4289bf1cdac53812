"""Fault injection: failing writes, killed servers, and damaged files.

1. A write that fails (ENOSPC, EACCES, a short write) at every point of a real
   transaction — every os.fsync, os.replace, os.write and tempfile.mkstemp call
   the operation makes, counted on a clean run first.  Before STATE.json's
   os.replace the previous STATE.json and journal stay byte-identical; no
   temporary file is left; the error names the problem; afterwards the next
   operation works and doctor (after its repairs, when the journal lost a line)
   finds no errors.  The CLI reports such failures as `ferrus: ...` + `hint:`.
2. `ferrus serve` killed in the middle of transactions and of a check run.
3. Damaged STATE.json, journal and ferrus.toml met by every CLI command: a clear
   message and a hint (or an isError tool result), never a traceback; then
   `ferrus doctor --fix` repairs what it can and the commands work again.

Part 3 runs every command in process (``ferrus.main(argv)``; ``serve`` through
``InProcessMcp``) for every kind of damage — a crash there is a traceback in real
life — and as real subprocesses (``run_cli``, ``McpProcess``) for one damage of
each file: every command for a truncated STATE.json, the commands that read the
file for a torn journal line and a truncated ferrus.toml.  Each subprocess costs
a Python start-up, which is what keeps that list short.
"""

import collections
import concurrent.futures
import contextlib
import errno
import io
import json
import logging
import os
import random
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback

import pytest

import ferrus
from conftest import run_cli, set_config, write
from mcp_client import InProcessMcp, McpProcess, tool_text

S = ferrus.S
HUMAN = ferrus.HUMAN
SUPERVISOR = ferrus.Caller("supervisor", "supervisor:faults:1")
EXECUTOR = ferrus.Caller("executor", "executor:faults:1")
POSIX_ONLY = pytest.mark.skipif(os.name == "nt", reason="POSIX signals and permissions")


def state_bytes(root):
    with open(os.path.join(str(root), ".ferrus", "STATE.json"), "rb") as handle:
        return handle.read()


def journal_bytes(root):
    with open(os.path.join(str(root), ".ferrus", "events.jsonl"), "rb") as handle:
        return handle.read()


def temp_files(root):
    found = []
    for folder, _, names in os.walk(str(root)):
        found.extend(os.path.join(folder, n) for n in names
                     if n.endswith(ferrus.TEMP_SUFFIX) or n == "STATE.json.tmp")
    return found


def copy_project(source, target):
    """A cheap copy: the skill files under .agents/ play no part in these tests."""
    shutil.copytree(str(source), str(target), ignore=shutil.ignore_patterns(".agents"),
                    copy_function=shutil.copyfile)


def doctor_errors(root):
    return [f.problem for f in ferrus.doctor_findings(str(root)) if f.severity == "error"]


def doctor_fix(root):
    """What `ferrus doctor --fix` does, in process."""
    for finding in ferrus.doctor_findings(str(root)):
        if finding.fix is not None:
            finding.fix()


def journal_seqs(root):
    """The seqs the journal accounts for: a journal_gap entry stands for every lost seq
    from its detail's "from" up to its own (one line however many were lost)."""
    seqs = []
    for entry in ferrus.Store(str(root)).read_journal():
        if entry["event"] == ferrus.JOURNAL_GAP_EVENT:
            seqs.extend(range(entry["detail"]["from"], entry["seq"]))
        seqs.append(entry["seq"])
    return seqs


# ============================================================================
# 1. A write failing at each point of a transaction
# ============================================================================

class Injector:
    """Wraps os.fsync, os.replace, os.write and tempfile.mkstemp; fails call ``nth`` of
    ``target`` (and, for a short write, writes half of it and fails every later one)."""

    def __init__(self, target=None, nth=0, code=errno.ENOSPC, short=False):
        self.target = target
        self.nth = nth
        self.code = code
        self.short = short
        self.counts = collections.Counter()
        self.calls = []           # (function, what, outcome)

    def install(self, patch):
        real = {"fsync": os.fsync, "replace": os.replace, "write": os.write,
                "mkstemp": tempfile.mkstemp}

        def wrap(name):
            def call(*args, **kwargs):
                self.counts[name] += 1
                number = self.counts[name]
                what = self._what(name, args, kwargs)
                if name == self.target and (number == self.nth or (self.short and number > self.nth)):
                    if self.short and number == self.nth:
                        fd, data = args
                        data = bytes(data)
                        written = real["write"](fd, data[:max(1, len(data) // 2)])
                        self.calls.append((name, what, "short"))
                        return written
                    self.calls.append((name, what, "failed"))
                    raise self._error(name, args, kwargs)
                result = real[name](*args, **kwargs)
                self.calls.append((name, what, "ok"))
                return result
            return call

        patch.setattr(os, "fsync", wrap("fsync"))
        patch.setattr(os, "replace", wrap("replace"))
        patch.setattr(os, "write", wrap("write"))
        patch.setattr(tempfile, "mkstemp", wrap("mkstemp"))

    @staticmethod
    def _what(name, args, kwargs):
        if name == "replace":
            return os.path.basename(str(args[1]))
        if name == "mkstemp":
            return str(kwargs.get("prefix", ""))
        fd = args[0]
        try:
            if name == "fsync" and stat.S_ISDIR(os.fstat(fd).st_mode):
                return "<directory>"
            return os.path.basename(os.readlink("/proc/self/fd/%d" % fd))
        except OSError:
            return "fd %d" % fd

    def _error(self, name, args, kwargs):
        message = os.strerror(self.code)
        if name == "replace":
            return OSError(self.code, message, str(args[0]), None, str(args[1]))
        if name == "mkstemp":
            return OSError(self.code, message, kwargs.get("dir"))
        return OSError(self.code, message)

    def failed_call(self):
        return next((c for c in self.calls if c[2] == "failed"), None)

    def state_replaced(self):
        """True when STATE.json's os.replace happened (the commit point was passed)."""
        return any(c == ("replace", "STATE.json", "ok") for c in self.calls)

    def describe(self):
        return "; ".join("%s(%s)%s" % (n, w, "" if o == "ok" else " <- " + o) for n, w, o in self.calls)


def _prepare(root, until):
    """Bring a fresh project to the state an operation starts from (rev >= 2)."""
    store = ferrus.Store(str(root))
    ferrus.op_create_task(store, HUMAN, "warm-up task")
    ferrus.op_force_reset(store, HUMAN)
    if until == S.IDLE:
        return
    ferrus.op_create_task(store, HUMAN, "the task\n\nwith two paragraphs")
    if until == S.EXECUTING:
        return
    if until == S.AWAITING_HUMAN:
        ferrus.op_ask_human(store, EXECUTOR, "which database?")
        return
    ferrus.op_submit(store, EXECUTOR, "done: see the diff")
    assert until == S.REVIEWING


# op name -> (state it starts from, the call, the state it leads to)
OPERATIONS = {
    "create_task": (S.IDLE, lambda st: ferrus.op_create_task(st, HUMAN, "second task"), S.EXECUTING),
    "submit": (S.EXECUTING, lambda st: ferrus.op_submit(st, EXECUTOR, "notes"), S.REVIEWING),
    "reject": (S.REVIEWING, lambda st: ferrus.op_reject(st, SUPERVISOR, "add tests"), S.ADDRESSING),
    "answer": (S.AWAITING_HUMAN, lambda st: ferrus.op_answer(st, HUMAN, "postgres"), S.EXECUTING),
    "force_reset": (S.EXECUTING, lambda st: ferrus.op_force_reset(st, HUMAN), S.IDLE),
}


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """One prepared project per starting state, copied for every injected failure."""
    base = tmp_path_factory.mktemp("fault-templates")
    made = {}
    for state in {start for start, _, _ in OPERATIONS.values()}:
        root = base / state.value
        root.mkdir()
        ferrus.init_project(str(root), report=lambda message: None)
        _prepare(root, state)
        made[state] = root
    return made


def _fresh_copy(template, tmp_path, label):
    root = tmp_path / label
    copy_project(template, root)
    return root


def _points(templates, tmp_path, monkeypatch, name):
    """Count the calls one clean run of the operation makes."""
    start, run, _ = OPERATIONS[name]
    root = _fresh_copy(templates[start], tmp_path, "count")
    injector = Injector()
    with monkeypatch.context() as patch:
        injector.install(patch)
        run(ferrus.Store(str(root)))
    assert injector.counts["replace"] >= 2 and injector.counts["write"] >= 1, injector.describe()
    return injector.counts


def _check_failed_transaction(root, name, injector, error, before_state, before_journal):
    start, run, leads_to = OPERATIONS[name]
    where = "%s: %s" % (name, injector.describe())
    failed = injector.failed_call()
    store = ferrus.Store(str(root))
    assert temp_files(root) == [], "temporary files left behind (%s)" % where
    committed = injector.state_replaced()
    if error is None:
        # Only a best-effort directory fsync may fail without failing the operation.
        assert failed is None or failed[:2] == ("fsync", "<directory>"), (
            "the operation hid a failed %s (%s)" % (failed, where))
        assert committed or injector.short
    else:
        assert isinstance(error, (OSError, ferrus.FerrusError)), where
        text = str(error) + (" " + error.full_text() if isinstance(error, ferrus.FerrusError) else "")
        assert os.strerror(injector.code) in text, "the error does not name the problem: %r (%s)" % (
            text, where)
    if not committed:
        assert state_bytes(root) == before_state, "STATE.json changed before its commit (%s)" % where
        assert journal_bytes(root) == before_journal, "the journal changed (%s)" % where
        assert doctor_errors(root) == [], where
        run(store)                             # the same operation now simply works
        assert store.read_state().state == leads_to, where
    else:
        data = ferrus.StateData.from_json(state_bytes(root).decode("utf-8"))
        assert data.state == leads_to and data.rev == ferrus.StateData.from_json(
            before_state.decode("utf-8")).rev + 1, where
        if injector.short and error is None:
            # The operation reported success: its journal line must then be whole.
            last = journal_bytes(root).rstrip(b"\n").rsplit(b"\n", 1)[-1]
            try:
                seq = json.loads(last.decode("utf-8"))["seq"]
            except ValueError:
                pytest.fail("a short write tore the journal line but the operation reported "
                            "success (%s); last line %r" % (where, last[-80:]))
            assert seq == data.rev, where
        problems = doctor_errors(root)
        for problem in problems:
            assert "journal" in problem or "events.jsonl" in problem, (
                "unexpected doctor error %r (%s)" % (problem, where))
        doctor_fix(root)                        # `ferrus doctor --fix`
        ferrus.op_force_reset(store, HUMAN)
    if store.read_state().state == S.IDLE:
        ferrus.op_create_task(store, HUMAN, "after the failure")
    else:
        ferrus.op_force_reset(store, HUMAN)
    assert doctor_errors(root) == [], where
    rev = store.read_state().rev
    assert journal_seqs(root) == list(range(1, rev + 1)), "journal not gapless (%s)" % where
    assert temp_files(root) == [], where


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_a_write_failing_at_each_point_of_a_transaction(name, templates, tmp_path, monkeypatch):
    counts = _points(templates, tmp_path, monkeypatch, name)
    # ENOSPC at every point; EACCES where permissions bite (creating and renaming files).
    cases = [(fn, n, code, False) for fn in ("fsync", "replace", "write", "mkstemp")
             for n in range(1, counts[fn] + 1)
             for code in ((errno.ENOSPC, errno.EACCES) if fn in ("replace", "mkstemp")
                          else (errno.ENOSPC,))]
    _run_cases(name, cases, templates, tmp_path, monkeypatch)


def test_a_short_journal_write_is_not_reported_as_success(templates, tmp_path, monkeypatch):
    """A full disk can make write(2) store part of the line and return a short count
    (the next write then fails with ENOSPC).  The operation must not report success
    while its journal line is torn."""
    for name in sorted(OPERATIONS):
        counts = _points(templates, tmp_path / name, monkeypatch, name)
        cases = [("write", n, errno.ENOSPC, True) for n in range(1, counts["write"] + 1)]
        _run_cases(name, cases, templates, tmp_path / name, monkeypatch)


def _run_cases(name, cases, templates, tmp_path, monkeypatch):
    start = OPERATIONS[name][0]
    for number, (fn, nth, code, short) in enumerate(cases):
        root = _fresh_copy(templates[start], tmp_path, "case-%s%d-%d" % (fn, nth, number))
        before_state, before_journal = state_bytes(root), journal_bytes(root)
        injector = Injector(fn, nth, code, short)
        error = None
        with monkeypatch.context() as patch:
            injector.install(patch)
            try:
                OPERATIONS[name][1](ferrus.Store(str(root)))
            except (OSError, ferrus.FerrusError) as err:
                error = err
        _check_failed_transaction(root, name, injector, error, before_state, before_journal)


def _in_process_cli(monkeypatch, capsys, argv, stdin=""):
    """``ferrus.main(argv)`` in this process: (exit code, stdout, stderr, traceback or None)."""
    monkeypatch.delenv("FERRUS_DEBUG", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    # main() reconfigures the "ferrus" logger; keep the suite's logging as it was.
    monkeypatch.setattr(ferrus.log, "handlers", list(ferrus.log.handlers))
    monkeypatch.setattr(ferrus.log, "level", ferrus.log.level)
    monkeypatch.setattr(ferrus.log, "propagate", ferrus.log.propagate)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    crash = None
    code = None
    try:
        code = ferrus.main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        crash = traceback.format_exc()
    out, err = capsys.readouterr()
    return code, out, err, crash


def _assert_clean_cli_error(code, out, err, crash, context):
    assert crash is None, "ferrus crashed (%s):\n%s" % (context, crash)
    lines = err.splitlines()
    assert code == 1, "exit %r (%s)\nstdout: %s\nstderr: %s" % (code, context, out, err)
    messages = [l for l in lines if l.startswith("ferrus: ")]
    assert messages, "no `ferrus: ...` line on stderr (%s): %r" % (context, err)
    assert any(l.startswith("hint: ") for l in lines), "no hint (%s): %r" % (context, err)
    assert "Traceback" not in err, context


def test_cli_reset_on_a_read_only_ferrus_dir_in_process(project, monkeypatch, capsys):
    """The root-proof variant: every temporary file in .ferrus/ is refused with EACCES."""
    ferrus.op_create_task(ferrus.Store(str(project)), HUMAN, "something")
    before = state_bytes(project)
    ferrus_dir = os.path.join(str(project), ".ferrus")
    real_mkstemp = tempfile.mkstemp

    def refuse(*args, **kwargs):
        directory = kwargs.get("dir") or (args[2] if len(args) > 2 else None)
        if directory and os.path.abspath(directory).startswith(ferrus_dir):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), directory)
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    code, out, err, crash = _in_process_cli(monkeypatch, capsys, ["-C", str(project), "reset", "--yes"])
    _assert_clean_cli_error(code, out, err, crash, "reset --yes, read-only .ferrus")
    assert os.strerror(errno.EACCES) in err and ".ferrus" in err, err
    assert state_bytes(project) == before
    assert temp_files(project) == []


@POSIX_ONLY
@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root ignores directory permissions")
def test_cli_reset_on_a_read_only_ferrus_dir(project, cli):
    ferrus.op_create_task(ferrus.Store(str(project)), HUMAN, "something")
    before = state_bytes(project)
    ferrus_dir = os.path.join(str(project), ".ferrus")
    os.chmod(ferrus_dir, 0o555)
    try:
        result = cli("reset", "--yes", cwd=project)
    finally:
        os.chmod(ferrus_dir, 0o755)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert any(l.startswith("ferrus: ") for l in lines), result.stderr
    assert any(l.startswith("hint: ") for l in lines), result.stderr
    assert state_bytes(project) == before
    assert temp_files(project) == []


def test_cli_reports_a_failed_write_truthfully_at_every_point(project, monkeypatch, capsys, tmp_path):
    """`ferrus reset --yes` with a write failing at each point: exit 1, `ferrus:` + `hint:`,
    no traceback — and when STATE.json was already committed (only the journal line
    failed) the message must not claim that nothing changed."""
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, HUMAN, "a task to reset")
    template = tmp_path / "template"
    copy_project(project, template)
    counter = Injector()
    with monkeypatch.context() as patch:
        counter.install(patch)
        ferrus.op_force_reset(ferrus.Store(str(project)), HUMAN)
    problems = []
    number = 0
    for fn in ("fsync", "replace", "write", "mkstemp"):
        for nth in range(1, counter.counts[fn] + 1):
            number += 1
            root = tmp_path / ("cli%d" % number)
            copy_project(template, root)
            before = state_bytes(root)
            injector = Injector(fn, nth, errno.ENOSPC)
            with monkeypatch.context() as patch:
                injector.install(patch)
                code, out, err, crash = _in_process_cli(
                    monkeypatch, capsys, ["-C", str(root), "reset", "--yes"])
            failed = injector.failed_call()
            if failed is None or failed[:2] == ("fsync", "<directory>"):
                continue          # a best-effort directory fsync: the reset succeeded
            context = "reset --yes, %s #%d: %s" % (fn, nth, injector.describe())
            _assert_clean_cli_error(code, out, err, crash, context)
            assert os.strerror(errno.ENOSPC) in err, (context, err)
            if state_bytes(root) != before and "nothing was changed" in err:
                problems.append("%s\n  stderr: %s" % (context, err.strip().replace("\n", " | ")))
    assert not problems, ("STATE.json was committed (only the journal line failed) but the CLI "
                          "says nothing was changed:\n" + "\n".join(problems))


# ============================================================================
# 2. `ferrus serve` killed mid-transaction and mid-check
# ============================================================================

CYCLE = (("create_task", {"description": "cycle task"}), ("submit", {"content": "done"}),
         ("reject", {"notes": "again"}), ("reset", {}))


@contextlib.contextmanager
def serving(root, *args):
    """McpProcess that also closes its stdout pipe when done."""
    server = McpProcess(root, *args)
    try:
        with server:
            yield server
    finally:
        for stream in (server.proc.stdin, server.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


def _stop(server):
    """Kill an McpProcess and close its pipes (its own kill() leaves them open)."""
    server.kill()
    for stream in (server.proc.stdin, server.proc.stdout):
        with contextlib.suppress(OSError):
            stream.close()


def _age_temp_files(root):
    old = time.time() - 3600
    for path in temp_files(root):
        os.utime(path, (old, old))


@POSIX_ONLY
def test_sigkill_of_serve_mid_transaction_then_doctor_and_a_new_server(project, cli):
    set_config(project, "[checks]\ncommands = []\n\n[limits]\nwait_timeout_secs = 0\n"
                        "max_review_cycles = 1\n")
    store = ferrus.Store(str(project))
    rng = random.Random(4242)
    for round_ in range(4):
        with serving(project, "--agent-name", "killme") as server:
            server.initialize()
            # Stream the whole cycle many times without waiting: the calls run on the
            # server's worker threads and commit back to back.
            for index in range(160):
                server.start_tool(*CYCLE[index % len(CYCLE)])
            start = store.state_stamp()
            deadline = time.monotonic() + 10
            while store.state_stamp() == start and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.05))
            os.kill(server.pid, signal.SIGKILL)
            _stop(server)
        data = store.read_state()                  # parses after every kill
        assert store.last_journal_seq() <= data.rev, "journal ahead of STATE.json (round %d)" % round_
    assert store.read_state().rev >= 4, "every round committed work before its kill"
    _age_temp_files(project)
    fixed = cli("doctor", "--fix", cwd=project)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "Traceback" not in fixed.stderr
    clean = cli("doctor", cwd=project)
    assert clean.returncode == 0 and "consistent" in clean.stdout, clean.stdout + clean.stderr
    left = [os.path.relpath(p, str(project)) for p in temp_files(project)]
    assert left == [], "temporary files a kill left behind survive `doctor --fix`: %s" % left
    rev = store.read_state().rev
    assert journal_seqs(project) == list(range(1, rev + 1))
    ferrus.op_force_reset(store, HUMAN)
    with serving(project, "--agent-name", "after") as server:
        server.initialize()
        result = server.call_tool("create_task", {"description": "after the crash"})
        assert result["isError"] is False, result
        assert server.call_tool("status")["structuredContent"]["state"] == "Executing"
        assert server.close() == 0
        assert "Traceback" not in server.stderr_text()
    assert doctor_errors(project) == []


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still "exists"; look for any live member.
    try:
        members = [pid for pid in os.listdir("/proc") if pid.isdigit()]
    except OSError:
        return True
    for pid in members:
        try:
            with open("/proc/%s/stat" % pid) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _start_check_and_stop_server(project, how):
    """Start a check whose command records its process group, then stop the server."""
    marker = os.path.join(str(project), "check-started")
    set_config(project, '[checks]\ncommands = ["echo $$ > \'%s\'; sleep 30; echo late"]\n'
                        '\n[limits]\nwait_timeout_secs = 0\n' % marker)
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, HUMAN, "check me")
    before_state, before_journal = state_bytes(project), journal_bytes(project)
    pgid = None
    with serving(project, "--role", "executor") as server:
        server.initialize()
        server.start_tool("check")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                with open(marker) as handle:
                    pgid = int(handle.read().strip())
                break
            time.sleep(0.01)
        assert pgid, "the check command never started"
        os.kill(server.pid, how)
        server.proc.wait(15)
        _stop(server)
    return store, pgid, before_state, before_journal


def _after_a_killed_check(project, store, before_state, before_journal, cli):
    assert state_bytes(project) == before_state, "a killed check changed STATE.json"
    assert journal_bytes(project) == before_journal
    set_config(project, "[checks]\ncommands = [\"true\"]\n\n[limits]\nwait_timeout_secs = 0\n")
    with serving(project, "--role", "executor") as server:
        server.initialize()
        result = server.call_tool("check")
        assert result["isError"] is False and result["structuredContent"]["passed"], result
        assert server.close() == 0
        assert "Traceback" not in server.stderr_text()
    _age_temp_files(project)
    fixed = cli("doctor", "--fix", cwd=project)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert temp_files(project) == []
    assert doctor_errors(project) == []


@POSIX_ONLY
def test_sigkill_of_serve_mid_check_leaves_the_state_unchanged(project, cli):
    """SIGKILL cannot be caught, so the server cannot stop its check; what must hold is
    that nothing was committed and that a new server and doctor work normally.
    (The check's process group outlives the server: see the SIGTERM test.)"""
    store, pgid, before_state, before_journal = _start_check_and_stop_server(project, signal.SIGKILL)
    try:
        _after_a_killed_check(project, store, before_state, before_journal, cli)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


@POSIX_ONLY
def test_sigterm_of_serve_mid_check_stops_the_check_process_group(project, cli):
    """Agent CLIs stop their MCP servers with SIGTERM.  The server must then end its
    check run like it does on EOF or a cancellation: kill the check's process group
    (a `sleep 30` here; a real test suite could run for many minutes)."""
    store, pgid, before_state, before_journal = _start_check_and_stop_server(project, signal.SIGTERM)
    try:
        deadline = time.monotonic() + 3
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = _group_alive(pgid)
        _after_a_killed_check(project, store, before_state, before_journal, cli)
        assert not alive, "the check's process group (%d) outlived the SIGTERMed server" % pgid
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def test_doctor_fix_removes_stray_temp_files_in_every_directory_ferrus_writes(project, monkeypatch):
    """A crash mid-write can leave a temporary file wherever ferrus writes atomically
    (found here by watching atomic_write through a session of tool calls); once such a
    file is stale, `doctor --fix` must delete it, in subdirectories of .ferrus/ too."""
    written = set()
    real_atomic_write = ferrus.atomic_write

    def watching(path, *args, **kwargs):
        written.add(os.path.dirname(os.path.abspath(path)))
        return real_atomic_write(path, *args, **kwargs)

    monkeypatch.setattr(ferrus, "atomic_write", watching)
    store = ferrus.Store(str(project))
    with InProcessMcp(store, None) as server:
        server.initialize()
        for name, arguments in (("create_task", {"description": "watch the writes"}),
                                ("heartbeat", {}), ("ask_human", {"question": "ok?"}),
                                ("answer", {"response": "yes"}), ("status", {})):
            server.call_tool(name, arguments)
    monkeypatch.setattr(ferrus, "atomic_write", real_atomic_write)
    ferrus_dir = os.path.realpath(os.path.join(str(project), ".ferrus"))
    folders = sorted(d for d in written if os.path.realpath(d).startswith(ferrus_dir))
    assert folders, written
    old = time.time() - 3600
    planted = []
    for folder in folders:
        path = os.path.join(folder, ".leftover.json.abc123" + ferrus.TEMP_SUFFIX)
        with open(path, "w") as handle:
            handle.write("{")
        os.utime(path, (old, old))
        planted.append(path)
    doctor_fix(project)
    left = [os.path.relpath(p, str(project)) for p in planted if os.path.exists(p)]
    assert left == [], "doctor --fix left stale temporary files behind: %s" % left


# ============================================================================
# 3. Damaged STATE.json, journal and ferrus.toml against every command
# ============================================================================

def _read(root, rel):
    with open(os.path.join(str(root), rel), "rb") as handle:
        return handle.read()


def _edit_state(**changes):
    def mutate(root):
        data = json.loads(_read(root, ".ferrus/STATE.json"))
        data.update(changes)
        write(root, ".ferrus/STATE.json", json.dumps(data, indent=2))   # ASCII escapes
    return mutate


def _append_journal(line):
    def mutate(root):
        with open(os.path.join(str(root), ".ferrus", "events.jsonl"), "ab") as handle:
            handle.write(line)
    return mutate


def _journal_garbage_in_the_middle(root):
    lines = _read(root, ".ferrus/events.jsonl").splitlines(True)
    lines.insert(1, b"\x00\xff\xfe not json at all\n")
    write(root, ".ferrus/events.jsonl", b"".join(lines))


def _config_replace(old, new):
    def mutate(root):
        text = _read(root, "ferrus.toml").decode("utf-8")
        assert old in text
        write(root, "ferrus.toml", text.replace(old, new, 1))
    return mutate


def _config_cut_in_a_header(root):
    text = _read(root, "ferrus.toml")
    write(root, "ferrus.toml", text[:text.index(b"[limits]") + 4])


# name -> (which file, how it is damaged)
DAMAGE = {
    "state-truncated": ("state", lambda r: write(r, ".ferrus/STATE.json",
                                                  _read(r, ".ferrus/STATE.json")[:60])),
    "state-empty": ("state", lambda r: write(r, ".ferrus/STATE.json", b"")),
    "state-binary": ("state", lambda r: write(r, ".ferrus/STATE.json", b"\x00\xff\xfe\x80 {")),
    "state-unknown-state": ("state", _edit_state(state="Finished")),
    "state-wrong-type": ("state", _edit_state(check_retries="two")),
    "state-not-an-object": ("state", lambda r: write(r, ".ferrus/STATE.json", b"[1, 2]\n")),
    "state-nested-deep": ("state", lambda r: write(r, ".ferrus/STATE.json", b"[" * 100000)),
    "state-date-out-of-range": ("state", _edit_state(updated_at="9999-12-31T23:59:59-01:00")),
    "state-lone-surrogate": ("state", _edit_state(task_id="t-\ud800")),
    "journal-torn": ("journal", _append_journal(b'{"seq": 3, "time": "2026-')),
    "journal-garbage-line": ("journal", _journal_garbage_in_the_middle),
    "journal-infinite-seq": ("journal", _append_journal(b'{"seq": 1e999, "event": "x"}\n')),
    "journal-nested-deep": ("journal", _append_journal(b"[" * 100000 + b"\n")),
    "journal-odd-fields": ("journal", _append_journal(
        b'{"seq": 3, "time": 5, "actor": "me", "event": "note", "from": "Idle", '
        b'"to": ["Idle"], "task_id": null, "detail": "typed by hand"}\n')),
    "config-truncated": ("config", _config_cut_in_a_header),
    "config-bad-value": ("config", _config_replace("wait_timeout_secs = 60",
                                                   'wait_timeout_secs = "soon"')),
    "config-nested-deep": ("config", lambda r: write(
        r, "ferrus.toml", b"x = " + b"[" * 100000 + b"\n" + _read(r, "ferrus.toml"))),
}
# The subprocess runs: every command for a truncated STATE.json, the commands that read
# the file for the other two (each subprocess costs a Python start-up).
AS_SUBPROCESS = {
    "state-truncated": None,
    "journal-torn": (("status",), ("log",), ("reset", "--yes"), ("doctor",), ("check",),
                     ("hq", "--no-tui"), ("serve",)),
    "config-truncated": (("status",), ("doctor",), ("check", "--force"), ("agents",),
                         ("register", "--executor", "codex"), ("hq", "--no-tui"), ("serve",)),
}

COMMANDS = (("status",), ("status", "--json"), ("log",), ("log", "--json"), ("reset", "--yes"),
            ("doctor",), ("check",), ("check", "--force"), ("run", "--resume"), ("agents",),
            ("register", "--executor", "codex"), ("hq", "--no-tui"), ("serve",))

FILE_NAMES = {"state": ("STATE.json",), "journal": ("events.jsonl", "journal"),
              "config": ("ferrus.toml",)}

# What each command must do with each damaged file:
#   fail     exit != 0, `ferrus: <names the file>` and `hint:` on stderr
#   ok       exit 0 (the command does not need the file, or skips a bad journal line)
#   diagnose doctor: exit 1 and the finding names the file
#   refuse   `run --resume` with nothing in flight: exit 2 with `ferrus:` and `hint:`
#   any      exit 0 or 1 (`agents` reports agents that are not installed)
EXPECT = {
    "state": {"status": "fail", "status --json": "fail", "log": "ok", "log --json": "ok",
              "reset --yes": "fail", "doctor": "diagnose", "check": "fail", "check --force": "ok",
              "run --resume": "fail", "agents": "any", "register --executor codex": "ok",
              "hq --no-tui": "fail", "serve": "fail"},
    "journal": {"status": "ok", "status --json": "ok", "log": "ok", "log --json": "ok",
                "reset --yes": "ok", "doctor": "diagnose", "check": "ok", "check --force": "ok",
                "run --resume": "refuse", "agents": "any", "register --executor codex": "ok",
                "hq --no-tui": "ok", "serve": "ok"},
    "config": {"status": "ok", "status --json": "ok", "log": "ok", "log --json": "ok",
               "reset --yes": "ok", "doctor": "diagnose", "check": "fail", "check --force": "fail",
               "run --resume": "refuse", "agents": "fail", "register --executor codex": "fail",
               # HQ starts; its commands that need the config report the error themselves.
               "hq --no-tui": "ok", "serve": "ok"},
}
HEALTHY = {"status": "ok", "status --json": "ok", "log": "ok", "log --json": "ok",
           "reset --yes": "ok", "doctor": "ok", "check": "ok", "check --force": "ok",
           "run --resume": "refuse", "agents": "any", "register --executor codex": "ok",
           "hq --no-tui": "ok", "serve": "ok"}


@pytest.fixture(scope="module")
def damage_template(tmp_path_factory):
    """An Idle project with history (two journal lines) and no check commands."""
    root = tmp_path_factory.mktemp("damage") / "proj"
    root.mkdir()
    ferrus.init_project(str(root), report=lambda message: None)
    store = ferrus.Store(str(root))
    ferrus.op_create_task(store, HUMAN, "first task")
    ferrus.op_force_reset(store, HUMAN)
    return root


def _damaged_copy(template, base, damage, command):
    """A copy for one command; `check` gets a task in flight so it has work to do."""
    root = base / ("%s-%s" % (damage or "healthy", "-".join(command).replace("--", "")))
    copy_project(template, root)
    if command == ("check",):
        ferrus.op_create_task(ferrus.Store(str(root)), HUMAN, "work to check")
    if damage:
        DAMAGE[damage][1](root)
    return root


def _verdict(expectation, kind, command, code, out, err):
    """Why this outcome breaks the expectation (None when it does not)."""
    lines = err.splitlines()
    if "Traceback" in err:
        return "a traceback on stderr"
    if code is None:
        return "did not finish"
    names = FILE_NAMES.get(kind, ())
    if expectation == "ok":
        return None if code == 0 else "exit %s, expected 0" % code
    if expectation == "any":
        return None if code in (0, 1) else "exit %s, expected 0 or 1" % code
    if expectation == "diagnose":
        if code != 1:
            return "doctor exit %s, expected 1" % code
        if not any(name in out for name in names):
            return "doctor does not name %s" % " or ".join(names)
        return None
    messages = [l for l in lines if l.startswith("ferrus: ") and not l.startswith("ferrus: WARNING")]
    if not messages:
        return "no `ferrus: ...` message on stderr"
    if not any(l.startswith("hint: ") for l in lines):
        return "no `hint: ...` line on stderr"
    if expectation == "refuse":
        return None if code == 2 else "exit %s, expected 2" % code
    if code == 0:
        return "exit 0, expected a failure"
    if not any(name in m for m in messages for name in names):
        return "the message does not name %s" % " or ".join(names)
    return None


def _serve_in_process(root):
    """initialize + status + the events resource on an in-process server:
    (exit-like code, text, problems)."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.exc_info:
                records.append(self.format(record))
    handler = Collect()
    ferrus.log.addHandler(handler)
    try:
        store = ferrus.Store(str(root))
        with InProcessMcp(store, None) as server:
            server.initialize()
            responses = [server.request("tools/call", {"name": "status"}),
                         server.request("resources/read", {"uri": "ferrus://events"})]
            server.result("ping")
            bad = list(server.bad_lines)
    finally:
        ferrus.log.removeHandler(handler)
    return _serve_verdict(responses, bad, "\n".join(records))


def _serve_verdict(responses, bad_lines, stderr):
    status, events = responses
    problems = []
    if bad_lines:
        problems.append("non-JSON-RPC stdout: %r" % bad_lines[:2])
    if "Traceback" in stderr:
        problems.append("traceback: %s" % _last_line(stderr))
    for response in responses:
        error = response.get("error") or {}
        if str(error.get("message", "")).startswith("Internal error"):
            problems.append("uncaught exception: %s" % error["message"])
    if "error" in status:
        problems.append("status is a JSON-RPC error: %s" % status["error"])
        return 1, "", problems
    result = status["result"]
    return (1 if result.get("isError") else 0), tool_text(result), problems


def _check_serve(expectation, kind, code, text, problems):
    if problems:
        return "; ".join(problems)
    if expectation == "ok":
        return None if code == 0 else "the status tool failed: %s" % text
    if code == 0:
        return "the status tool succeeded on a damaged file"
    if not any(name in text for name in FILE_NAMES[kind]) or "hint:" not in text:
        return "the error result does not name the file with a hint: %r" % text
    return None


def _run_in_process(monkeypatch, capsys, root, command):
    if command == ("serve",):
        code, text, problems = _serve_in_process(root)
        return code, text, "", problems
    stdin = "/quit\n" if command[0] == "hq" else ""
    code, out, err, crash = _in_process_cli(monkeypatch, capsys, ("-C", str(root)) + command, stdin)
    if crash:
        err += "\nTraceback (in process): " + _last_line(crash)
    return code, out, err, None


def _last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1] if lines else ""


# Commands that change nothing the others read share one copy in process.
READ_ONLY = (("status",), ("status", "--json"), ("log",), ("log", "--json"), ("doctor",),
             ("check", "--force"), ("run", "--resume"), ("agents",), ("serve",))


def _matrix_in_process(monkeypatch, capsys, base, template, damage, expectations, kind):
    failures = []
    shared = _damaged_copy(template, base, damage, ("shared",))
    for command in COMMANDS:
        root = shared if command in READ_ONLY else _damaged_copy(template, base, damage, command)
        label = " ".join(command)
        code, out, err, problems = _run_in_process(monkeypatch, capsys, root, command)
        if command == ("serve",):
            why = _check_serve(expectations[label], kind, code, out, problems)
        else:
            why = _verdict(expectations[label], kind, command, code, out, err)
        if why:
            failures.append("`ferrus %s`: %s\n      stdout: %s\n      stderr: %s" % (
                label, why, out.strip()[-200:].replace("\n", " | "),
                err.strip()[-300:].replace("\n", " | ")))
    return failures


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_file_meets_every_command_then_doctor_fix(damage, damage_template, tmp_path,
                                                          monkeypatch, capsys):
    kind = DAMAGE[damage][0]
    failures = _matrix_in_process(monkeypatch, capsys, tmp_path, damage_template, damage,
                                  EXPECT[kind], kind)
    # Then `ferrus doctor --fix` on one damaged copy, and every command again.
    root = _damaged_copy(damage_template, tmp_path, damage, ("after",))
    code, out, err, crash = _in_process_cli(monkeypatch, capsys,
                                            ["-C", str(root), "doctor", "--fix"])
    if crash or "Traceback" in err:
        failures.append("`ferrus doctor --fix` crashed: %s" % _last_line(crash or err))
    elif kind == "config":
        if code != 1 or "ferrus.toml" not in out:
            failures.append("doctor --fix cannot repair ferrus.toml and must say so (exit 1): "
                            "exit %s, %r" % (code, out))
        shutil.copy(os.path.join(str(damage_template), "ferrus.toml"),
                    os.path.join(str(root), "ferrus.toml"))      # the human fixes it
    elif code != 0:
        failures.append("doctor --fix exit %s: %s" % (code, out.strip().replace("\n", " | ")))
    if kind == "state" and not failures:
        kept = [n for n in os.listdir(os.path.join(str(root), ".ferrus"))
                if n.startswith("STATE.json.corrupt-")]
        if not kept:
            failures.append("doctor --fix did not keep the damaged STATE.json aside")
    if not failures:
        fixed_template = root
        after = tmp_path / "after-fix"
        after.mkdir()
        for problem in _matrix_in_process(monkeypatch, capsys, after, fixed_template, None,
                                          HEALTHY, kind):
            failures.append("after doctor --fix: " + problem)
        remaining = doctor_errors(fixed_template)
        if remaining:
            failures.append("doctor still finds errors after --fix: %s" % remaining)
    assert not failures, "damage %r:\n  - %s" % (damage, "\n  - ".join(failures))


# -- the same, with real subprocesses, for one damage of each file --------------------------

def _serve_subprocess(root):
    with serving(root) as server:
        server.initialize()
        responses = [server.request("tools/call", {"name": "status"}),
                     server.request("resources/read", {"uri": "ferrus://events"})]
        server.result("ping")
        code = server.close()
        stderr = server.stderr_text()
        bad = list(server.bad_lines)
    status_code, text, problems = _serve_verdict(responses, bad, stderr)
    if code != 0:
        problems.append("serve exited %s on EOF" % code)
    return status_code, text, problems


def _run_subprocess(root, command):
    if command == ("serve",):
        code, text, problems = _serve_subprocess(root)
        return code, text, "", problems
    stdin = "/quit\n" if command[0] == "hq" else ""
    result = run_cli(*command, cwd=root, input=stdin, timeout=60)
    return result.returncode, result.stdout, result.stderr, None


@pytest.mark.parametrize("damage", sorted(AS_SUBPROCESS))
def test_damaged_file_meets_the_commands_as_a_subprocess(damage, damage_template, tmp_path):
    kind = DAMAGE[damage][0]
    jobs = []
    for command in AS_SUBPROCESS[damage] or COMMANDS:
        jobs.append((command, _damaged_copy(damage_template, tmp_path, damage, command)))
    repaired = _damaged_copy(damage_template, tmp_path, damage, ("repaired",))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda job: (job[0],) + _run_subprocess(job[1], job[0]), jobs))
    failures = []
    for command, code, out, err, problems in outcomes:
        label = " ".join(command)
        if command == ("serve",):
            why = _check_serve(EXPECT[kind][label], kind, code, out, problems)
        else:
            why = _verdict(EXPECT[kind][label], kind, command, code, out, err)
        if why:
            failures.append("`ferrus %s`: %s (stderr: %s)" % (label, why, err.strip()[-400:]))
    fix = run_cli("doctor", "--fix", cwd=repaired)
    assert "Traceback" not in fix.stderr, fix.stderr
    if kind == "config":
        assert fix.returncode == 1 and "ferrus.toml" in fix.stdout, fix.stdout
        shutil.copy(os.path.join(str(damage_template), "ferrus.toml"),
                    os.path.join(str(repaired), "ferrus.toml"))
    else:
        assert fix.returncode == 0, fix.stdout + fix.stderr
    # (doctor --fix exit 0 already means doctor found nothing left; the config needed a human.)
    checks = [("status", "--json")] + ([("doctor",)] if kind == "config" else [])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        again = list(pool.map(lambda c: (c, run_cli(*c, cwd=repaired)), checks))
    for command, result in again:
        if result.returncode != 0 or "Traceback" in result.stderr:
            failures.append("after doctor --fix, `ferrus %s` exit %s: %s" % (
                " ".join(command), result.returncode, result.stderr.strip()[-300:]))
    assert not failures, "damage %r:\n  - %s" % (damage, "\n  - ".join(failures))
