#!/usr/bin/env python3
"""ferrus benchmark suite: the performance bar listed in bench/README.md, measured in one run.

    python bench/run.py [--quick] [--json] [--only NAME[,NAME]] [--ferrus PATH]
                        [--sdk-python PY | --sdk-venv DIR | --no-sdk] [--strict]

Prints one table: each figure, what was measured, the bar beside it and
PASS / MISS / n.a.  Every comparison (python -c pass, the MCP SDK server) is
measured in the same run, interleaved with ferrus where that is possible.
Standard library only; the MCP SDK is installed into a scratch virtualenv of
its own (default ~/.cache/ferrus-bench/mcp-venv) and its columns say "not
available" when that fails.  See bench/README.md.
"""

import argparse
import collections
import contextlib
import io
import itertools
import json
import math
import os
import platform
import py_compile
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

try:
    import resource                    # POSIX: the CPU time of the parallel run
except ImportError:  # pragma: no cover - Windows
    resource = None

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from mcpclient import McpConnection, McpFailure, ProcessRegistry, load_ferrus, structured  # noqa: E402
from web import fig_web_first_paint  # noqa: E402

DEFAULT_FERRUS = os.path.join(os.path.dirname(__file__), "..", "ferrus.py")
DEFAULT_SDK_VENV = os.path.join(os.path.expanduser("~"), ".cache", "ferrus-bench", "mcp-venv")
SDK_INSTALL_TIMEOUT = 180.0
ROLE = "executor"


# ============================================================================
# Results
# ============================================================================

class Figure:
    """One figure's outcome: rows of (measured, bar, result), raw values for --json."""

    def __init__(self, name):
        self.name = name
        self.rows = []
        self.values = {}
        self.error = None
        self.seconds = 0.0

    def info(self, measured):
        self.rows.append({"measured": measured, "bar": "", "result": ""})

    def check(self, measured, bar, ok):
        """A bar: ok True -> PASS, False -> MISS, None -> n.a."""
        result = "n.a." if ok is None else ("PASS" if ok else "MISS")
        self.rows.append({"measured": measured, "bar": bar, "result": result})

    def na(self, note, bar=""):
        self.rows.append({"measured": note, "bar": bar, "result": "n.a."})

    def fail(self, message):
        self.error = message
        self.rows.append({"measured": "error: %s" % message, "bar": "", "result": "error"})

    @property
    def result(self):
        if self.error:
            return "error"
        results = [row["result"] for row in self.rows if row["result"]]
        if "MISS" in results:
            return "MISS"
        if "PASS" in results:
            return "PASS"
        return "n.a." if results else "info"

    def to_json(self):
        return {"name": self.name, "result": self.result, "rows": self.rows,
                "values": self.values, "error": self.error, "seconds": round(self.seconds, 3)}


def median(values):
    return statistics.median(values) if values else float("nan")


def percentile(values, p):
    """Nearest-rank percentile."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, int(math.ceil(p / 100.0 * len(ordered))))
    return ordered[rank - 1]


def ms(seconds):
    value = seconds * 1000.0
    if value != value:  # nan
        return "n/a"
    if value < 10:
        return "%.2f ms" % value
    if value < 1000:
        return "%.1f ms" % value
    return "%.2f s" % seconds


def ratio(a, b):
    return a / b if b else float("inf")


# ============================================================================
# The bench context: ferrus, temp projects, child processes, the SDK
# ============================================================================

class BenchError(Exception):
    pass


def progress(message):
    sys.stderr.write("bench: %s\n" % message)
    sys.stderr.flush()


class Bench:
    def __init__(self, args):
        self.args = args
        self.quick = args.quick
        self.python = sys.executable
        self.ferrus_path = os.path.abspath(args.ferrus)
        self.ferrus = load_ferrus(self.ferrus_path)
        self.registry = ProcessRegistry()
        self.tmp = tempfile.mkdtemp(prefix="ferrus-bench-")
        self._sdk = None
        self._sdk_lock = threading.Lock()

    def reps(self, full, quick):
        return quick if self.quick else full

    # -- projects and servers ----------------------------------------------------------

    def run_cli(self, root, *argv, timeout=60):
        proc = self.registry.popen([self.python, self.ferrus_path] + list(argv), cwd=root,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
        try:
            out, _ = proc.communicate(timeout=timeout)
        finally:
            ProcessRegistry.stop(proc)
            self.registry.forget(proc)
        if proc.returncode != 0:
            raise BenchError("`ferrus %s` failed (%s): %s" % (
                " ".join(argv), proc.returncode, out.decode("utf-8", "replace").strip()[-400:]))
        return out.decode("utf-8", "replace")

    def project(self, name, commands=None):
        """A fresh project made by `ferrus init`; ``commands`` become [checks] commands."""
        root = os.path.join(self.tmp, name)
        os.makedirs(root)
        self.run_cli(root, "init")
        if commands is not None:
            path = os.path.join(root, "ferrus.toml")
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
            line = "commands = %s" % json.dumps(list(commands))
            text, count = re.subn(r"(?m)^commands\s*=.*$", lambda m: line, text, count=1)
            if not count:
                raise BenchError("no `commands =` line in the ferrus.toml that init wrote")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        return root

    def serve_argv(self, role=ROLE, agent_name="bench"):
        """`ferrus serve` started the way `ferrus register` configures agents to start it."""
        if hasattr(self.ferrus, "ferrus_boot_code"):
            return [self.python, "-c", self.ferrus.ferrus_boot_code(), "serve", "--role", role,
                    "--agent-name", agent_name]
        return [self.python, self.ferrus_path, "serve", "--role", role,
                "--agent-name", agent_name]

    def serve(self, root, role=ROLE, label=None):
        return McpConnection(self.serve_argv(role), self.registry, cwd=root,
                             label=label or "ferrus serve --role %s" % role)

    def store(self, root):
        return self.ferrus.Store(root)

    def reset(self, root):
        self.ferrus.op_force_reset(self.store(root), self.ferrus.HUMAN)

    def run_child(self, argv, timeout):
        """Run a helper script in its own session; its last stdout line as JSON."""
        errors = tempfile.TemporaryFile()
        proc = self.registry.popen(argv, new_session=True, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=errors)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            ProcessRegistry.stop(proc)
            raise BenchError("%s did not finish within %.0f s" % (os.path.basename(argv[1]), timeout))
        finally:
            ProcessRegistry.stop(proc)
            self.registry.forget(proc)
        lines = out.decode("utf-8", "replace").strip().splitlines()
        if proc.returncode != 0 or not lines:
            errors.seek(0)
            tail = errors.read().decode("utf-8", "replace").strip()[-500:]
            raise BenchError("%s exited %s: %s" % (os.path.basename(argv[1]), proc.returncode,
                                                   tail or "(no output)"))
        return json.loads(lines[-1])

    # -- the MCP SDK comparison server ----------------------------------------------------

    def tool_specs(self, role=ROLE):
        return [{"name": t.name, "description": t.description,
                 "params": [[p.name, bool(p.required)] for p in t.params]}
                for t in self.ferrus.tools_for_role(role)]

    def sdk(self):
        """(python, version, None) of an interpreter with the MCP SDK, or (None, None, why)."""
        with self._sdk_lock:
            if self._sdk is None:
                self._sdk = self._find_sdk()
            return self._sdk

    def _probe_sdk(self, python, timeout=60):
        code = ("import mcp.server, importlib.metadata as m, sys; "
                "sys.stdout.write(m.version('mcp'))")
        try:
            proc = self.registry.popen([python, "-c", code], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as err:
            return None, str(err)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, "probing %s timed out" % python
        finally:
            ProcessRegistry.stop(proc)
            self.registry.forget(proc)
        if proc.returncode != 0:
            lines = err.decode("utf-8", "replace").strip().splitlines()
            return None, lines[-1] if lines else "exit %s" % proc.returncode
        return out.decode().strip() or "?", None

    def _find_sdk(self):
        args = self.args
        if args.no_sdk:
            return None, None, "disabled by --no-sdk"
        if args.sdk_python:
            version, why = self._probe_sdk(args.sdk_python)
            return (args.sdk_python, version, None) if version else (None, None, why)
        venv = os.path.abspath(os.path.expanduser(args.sdk_venv))
        python = os.path.join(venv, "Scripts", "python.exe") if os.name == "nt" else \
            os.path.join(venv, "bin", "python")
        if os.path.exists(python):
            version, why = self._probe_sdk(python)
            if version:
                return python, version, None
        progress("installing the MCP Python SDK into %s (python -m venv + pip install mcp, "
                 "at most %.0f s)" % (venv, SDK_INSTALL_TIMEOUT))
        deadline = time.monotonic() + SDK_INSTALL_TIMEOUT
        steps = []
        if not os.path.exists(python):
            steps.append([self.python, "-m", "venv", venv])
        steps.append([python, "-m", "pip", "install", "--disable-pip-version-check",
                      "--quiet", "mcp"])
        for argv in steps:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None, None, "SDK install timed out after %.0f s" % SDK_INSTALL_TIMEOUT
            log = tempfile.TemporaryFile()
            try:
                proc = self.registry.popen(argv, new_session=True, stdin=subprocess.DEVNULL,
                                           stdout=log, stderr=subprocess.STDOUT)
            except OSError as err:
                return None, None, "cannot run %s: %s" % (argv[0], err)
            try:
                proc.wait(remaining)
            except subprocess.TimeoutExpired:
                return None, None, "SDK install timed out after %.0f s" % SDK_INSTALL_TIMEOUT
            finally:
                ProcessRegistry.stop(proc)
                self.registry.forget(proc)
            if proc.returncode != 0:
                log.seek(0)
                lines = [l for l in log.read().decode("utf-8", "replace").splitlines()
                         if l.strip() and not l.startswith("WARNING")]
                return None, None, "`%s` failed: %s" % (
                    " ".join(os.path.basename(a) for a in argv[:4]),
                    lines[-1] if lines else "exit %s" % proc.returncode)
        version, why = self._probe_sdk(python)
        return (python, version, None) if version else (None, None, why)

    def sdk_argv(self, root, python):
        return [python, os.path.join(HERE, "sdk_server.py"),
                "--state", os.path.join(root, ".ferrus", "STATE.json"),
                "--tools", json.dumps(self.tool_specs())]

    # -- cleanup ---------------------------------------------------------------------------

    def cleanup(self):
        self.registry.kill_all()
        if not self.args.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)


# ============================================================================
# Figures (one function each; each fills in a Figure)
# ============================================================================

def _handshake(bench, argv, cwd, label):
    """Seconds from spawn to the answer of tools/list (after initialize), and the tool names."""
    started = time.perf_counter()
    conn = McpConnection(argv, bench.registry, cwd=cwd, label=label)
    try:
        conn.initialize(timeout=60)
        request_id, _ = conn.start("tools/list")
        result, arrived = conn.wait(request_id, timeout=60)
    finally:
        conn.close()
    return arrived - started, sorted(t.get("name") for t in result.get("tools", []))


def _bare_python(bench, *flags):
    started = time.perf_counter()
    proc = bench.registry.popen([bench.python] + list(flags) + ["-c", "pass"],
                                stdin=subprocess.DEVNULL)
    proc.wait()
    elapsed = time.perf_counter() - started
    bench.registry.forget(proc)
    if proc.returncode != 0:
        raise BenchError("python -c pass exited %s" % proc.returncode)
    return elapsed


def fig_serve_cold_start(bench, fig):
    """`ferrus serve` spawn -> answered initialize + tools/list, vs python -c pass and the SDK."""
    root = bench.project("cold")
    runs = bench.reps(11, 3)
    expected = sorted(t.name for t in bench.ferrus.tools_for_role(ROLE))
    sdk_python, sdk_version, sdk_why = bench.sdk()

    # For information: the same server started as `python -m ferrus` from cached
    # bytecode (how the launcher / an installed ferrus start), compiled ahead here.
    pyc_dir = os.path.join(bench.tmp, "pyc")
    os.makedirs(pyc_dir)
    shutil.copyfile(bench.ferrus_path, os.path.join(pyc_dir, "ferrus.py"))
    py_compile.compile(os.path.join(pyc_dir, "ferrus.py"), doraise=True)
    pyc_env = dict(os.environ, PYTHONPATH=pyc_dir)
    pyc_env.pop("PYTHONPYCACHEPREFIX", None)

    variants = [("ferrus", lambda: _handshake(bench, bench.serve_argv(), root, "ferrus serve")),
                ("python", lambda: (_bare_python(bench), None))]
    if sdk_python:
        variants.append(("sdk", lambda: _handshake(bench, bench.sdk_argv(root, sdk_python), root,
                                                   "MCP SDK server")))

    def pyc_variant():
        started = time.perf_counter()
        conn = McpConnection([bench.python, "-m", "ferrus", "serve", "--role", ROLE], bench.registry,
                             cwd=root, env=pyc_env, label="python -m ferrus serve")
        try:
            conn.initialize(timeout=60)
            result, arrived = conn.wait(conn.start("tools/list")[0], timeout=60)
        finally:
            conn.close()
        return arrived - started, None
    variants.append(("pyc", pyc_variant))
    # For information: both without site hooks (-S).  A .pth file in site-packages
    # that imports something slows `python -c pass` far more than ferrus, which
    # imports much of the same anyway, so the ratio depends on the installation.
    no_site = [bench.python, "-S"] + bench.serve_argv()[1:]
    variants.append(("ferrus_S", lambda: _handshake(bench, no_site, root, "ferrus serve (-S)")))
    variants.append(("python_S", lambda: (_bare_python(bench, "-S"), None)))

    samples = {name: [] for name, _ in variants}
    for round_no in range(runs + 1):          # round 0 warms the page cache, not counted
        for name, measure in variants:
            elapsed, names = measure()
            if names is not None and names != expected:
                raise BenchError("%s listed %s, expected %s" % (name, names, expected))
            if round_no:
                samples[name].append(elapsed)

    f, py = median(samples["ferrus"]), median(samples["python"])
    fig.values.update({"runs": runs, "ferrus_s": samples["ferrus"], "python_s": samples["python"],
                       "pyc_s": samples["pyc"], "ferrus_median_s": f, "python_median_s": py})
    fig.info("ferrus serve %s (median of %d; min %s)" % (ms(f), runs, ms(min(samples["ferrus"]))))
    fig.check("python -c pass %s → %.2f×" % (ms(py), ratio(f, py)), "≤ 3× python -c pass",
              ratio(f, py) <= 3.0)
    if sdk_python:
        s = median(samples["sdk"])
        fig.values.update({"sdk_s": samples["sdk"], "sdk_median_s": s, "sdk_version": sdk_version})
        fig.check("MCP SDK %s server %s → %.2f×" % (sdk_version, ms(s), ratio(f, s)),
                  "≤ 0.2× MCP SDK server", ratio(f, s) <= 0.2)
    else:
        fig.na("MCP SDK server: not available (%s)" % sdk_why, "≤ 0.2× MCP SDK server")
    pyc = median(samples["pyc"])
    fig.values["pyc_median_s"] = pyc
    fig.info("(info) python -m ferrus, cached .pyc: %s → %.2f× python" % (ms(pyc), ratio(pyc, py)))
    f_s, py_s = median(samples["ferrus_S"]), median(samples["python_S"])
    fig.values.update({"ferrus_S_median_s": f_s, "python_S_median_s": py_s})
    fig.info("(info) both with -S (no site hooks): %s vs %s → %.2f×" % (ms(f_s), ms(py_s),
                                                                       ratio(f_s, py_s)))


def fig_status_from_shell(bench, fig):
    """`ferrus status` typed in a shell: the launcher, bytecode cached, vs python -c pass."""
    root = bench.project("shell")
    runs = bench.reps(11, 3)
    # A copy of the launcher and ferrus.py, so the bytecode cache is written here and
    # is warm after round 0, as it is for a user after their first command.
    home = os.path.join(bench.tmp, "launcher")
    os.makedirs(home)
    launcher = os.path.join(home, "ferrus")
    shutil.copyfile(os.path.join(os.path.dirname(bench.ferrus_path), "ferrus"), launcher)
    shutil.copyfile(bench.ferrus_path, os.path.join(home, "ferrus.py"))
    env = dict(os.environ)
    env.pop("PYTHONPYCACHEPREFIX", None)

    def status():
        started = time.perf_counter()
        proc = bench.registry.popen([bench.python, launcher, "-C", root, "status"], cwd=root,
                                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
        out, _ = proc.communicate(timeout=60)
        elapsed = time.perf_counter() - started
        bench.registry.forget(proc)
        if proc.returncode != 0 or b"Idle" not in out:
            raise BenchError("`ferrus status` exited %s: %s" % (
                proc.returncode, out.decode("utf-8", "replace")[-300:]))
        return elapsed

    samples = {"status": [], "python": []}
    for round_no in range(runs + 1):          # round 0 writes the bytecode cache
        for name, measure in (("status", status), ("python", lambda: _bare_python(bench))):
            elapsed = measure()
            if round_no:
                samples[name].append(elapsed)
    s, py = median(samples["status"]), median(samples["python"])
    fig.values.update({"runs": runs, "status_s": samples["status"], "python_s": samples["python"],
                       "status_median_s": s, "python_median_s": py})
    fig.info("ferrus status (launcher, cached bytecode) %s (median of %d)" % (ms(s), runs))
    fig.check("python -c pass %s → %.2f×" % (ms(py), ratio(s, py)), "≤ 2.5× python -c pass",
              ratio(s, py) <= 2.5)


def fig_status_round_trip(bench, fig):
    """tools/call status on a warm server, ferrus and SDK calls interleaved."""
    root = bench.project("status")
    calls = bench.reps(300, 50)
    warmup = 20
    sdk_python, sdk_version, sdk_why = bench.sdk()
    conns = [("ferrus", bench.serve(root))]
    if sdk_python:
        conns.append(("sdk", McpConnection(bench.sdk_argv(root, sdk_python), bench.registry,
                                           cwd=root, label="MCP SDK server")))
    samples = {name: [] for name, _ in conns}
    try:
        for _, conn in conns:
            conn.initialize(timeout=60)
        result, _ = conns[0][1].call_tool("status")
        if structured(result).get("state") != "Idle":
            raise BenchError("ferrus status did not report state Idle: %s" % json.dumps(result)[:200])
        for i in range(warmup + calls):
            for name, conn in conns:
                _, elapsed = conn.call_tool("status")
                if i >= warmup:
                    samples[name].append(elapsed)
    finally:
        for _, conn in conns:
            conn.close()
    f, f99 = median(samples["ferrus"]), percentile(samples["ferrus"], 99)
    fig.values.update({"calls": calls, "ferrus_median_s": f, "ferrus_p99_s": f99})
    fig.check("median %s, p99 %s (%d calls)" % (ms(f), ms(f99), calls), "≤ 2 ms median",
              f <= 0.002)
    if sdk_python:
        s, s99 = median(samples["sdk"]), percentile(samples["sdk"], 99)
        fig.values.update({"sdk_median_s": s, "sdk_p99_s": s99, "sdk_version": sdk_version})
        fig.check("MCP SDK median %s, p99 %s → %.2f×" % (ms(s), ms(s99), ratio(f, s)),
                  "≤ 0.5× MCP SDK", ratio(f, s) <= 0.5)
    else:
        fig.na("MCP SDK server: not available (%s)" % sdk_why, "≤ 0.5× MCP SDK")


def fig_create_to_wait(bench, fig):
    """A blocked wait_for_task (executor server) returns after create_task (supervisor server)."""
    root = bench.project("wait")
    rounds = bench.reps(40, 8)
    warmup = 2
    executor = bench.serve(root, "executor")
    supervisor = bench.serve(root, "supervisor")
    latencies, creates = [], []
    try:
        executor.initialize(timeout=60)
        supervisor.initialize(timeout=60)
        for round_no in range(warmup + rounds):
            bench.reset(root)
            wait_id, _ = executor.start_tool("wait_for_task")
            # Let the wait reach its blocking poll; the jitter samples every poll phase.
            time.sleep(0.03 + random.random() * 0.01)
            create_id, sent = supervisor.start_tool("create_task",
                                                    {"description": "bench round %d" % round_no})
            result, arrived = executor.tool_result(wait_id, timeout=30)
            _, created = supervisor.tool_result(create_id, timeout=30)
            data = structured(result)
            if data.get("status") != "claimed":
                raise BenchError("wait_for_task returned %s, not a claim" % json.dumps(data)[:200])
            if round_no >= warmup:
                latencies.append(arrived - sent)
                creates.append(created - sent)
    finally:
        executor.close()
        supervisor.close()
    med, p99 = median(latencies), percentile(latencies, 99)
    fig.values.update({"rounds": rounds, "median_s": med, "p99_s": p99, "max_s": max(latencies),
                       "create_task_median_s": median(creates)})
    fig.check("median %s (%d rounds)" % (ms(med), rounds), "≤ 25 ms median", med <= 0.025)
    fig.check("p99 %s, max %s" % (ms(p99), ms(max(latencies))), "≤ 100 ms p99", p99 <= 0.100)
    fig.info("(info) create_task's own round trip: median %s" % ms(median(creates)))


HQ_POLL_INTERVAL = 0.02   # the cadence of HQ's front ends (PlainHq.run, run_loop)


def _prefill_journal(root, count):
    """Give a project a long history: ``count`` journal lines, STATE.json rev to match.

    Written directly (one fsynced transaction each would take minutes), in the
    journal's documented format: seq == rev, one JSON object per line."""
    ferrus_dir = os.path.join(root, ".ferrus")
    state_path = os.path.join(ferrus_dir, "STATE.json")
    with open(state_path, encoding="utf-8") as handle:
        state = json.load(handle)
    first = int(state.get("rev", 0)) + 1
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(os.path.join(ferrus_dir, "events.jsonl"), "a", encoding="utf-8") as handle:
        for seq in range(first, first + count):
            handle.write(json.dumps({
                "seq": seq, "time": stamp, "actor": "executor:bench:0", "event": "heartbeat",
                "from": state["state"], "to": state["state"], "task_id": None,
                "detail": {}}, separators=(",", ":"), sort_keys=True) + "\n")
    state["rev"] = first + count - 1
    with open(state_path, "w", encoding="utf-8") as handle:
        json.dump(state, handle, indent=2)


def measure_hq_reaction(bench, rounds, history=0):
    """Seconds from a committed journal entry to HQ spawning the agent that reacts to it.

    A ``ferrus.HqController`` runs in a thread with the loop HQ's front ends use
    (poll, then sleep HQ_POLL_INTERVAL); its launcher starts a stub agent (``sleep``)
    instead of a real CLI.  Each round resets to Idle (HQ stops the stub), waits a
    random part of a poll interval, commits create_task from a separate Store, and
    times from the commit to HQ's "started the executor" message, emitted right
    after the agent's process is spawned (the launcher call, just before the spawn,
    is the fallback stamp if that message is ever reworded)."""
    ferrus = bench.ferrus
    root = bench.project("hq-%d" % history)
    if history:
        _prefill_journal(root, history)
    stub = ["sleep", "30"] if os.name != "nt" else [bench.python, "-c",
                                                       "import time; time.sleep(30)"]
    launched, spawned = [], []
    lock = threading.Lock()

    def launcher(slot):
        with lock:
            launched.append((slot.name, time.perf_counter()))
        return ferrus.Launch(argv=list(stub)), (lambda line: [])

    def emit(message):
        if message.kind == "agent" and "executor" in message.text and "start" in message.text:
            with lock:
                spawned.append(time.perf_counter())

    controller = ferrus.HqController(bench.store(root), emit=emit, launcher=launcher)
    stop = threading.Event()
    failure = []
    poll_times = []

    def loop():
        try:
            while not stop.is_set():
                started = time.perf_counter()
                controller.poll()
                poll_times.append(time.perf_counter() - started)
                stop.wait(HQ_POLL_INTERVAL)
        except Exception as err:  # reported by the main thread
            failure.append("HQ poll failed: %s: %s" % (type(err).__name__, err))

    thread = threading.Thread(target=loop, daemon=True, name="bench-hq")
    thread.start()
    committer = bench.store(root)
    supervisor = ferrus.Caller("supervisor", "supervisor:bench:0")
    latencies = []
    try:
        for round_no in range(rounds + 1):          # round 0 is a warm-up
            ferrus.op_force_reset(committer, ferrus.HUMAN)
            deadline = time.monotonic() + 10       # until HQ has stopped the last stub
            while controller.running() and not failure and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05 + random.random() * HQ_POLL_INTERVAL)
            with lock:
                seen_launch, seen_spawn = len(launched), len(spawned)
            ferrus.op_create_task(committer, supervisor, "bench hq round %d" % round_no)
            committed = time.perf_counter()
            deadline = time.monotonic() + 10
            while True:
                with lock:
                    done = len(spawned) > seen_spawn
                    stamp = spawned[seen_spawn] if done else None
                    fallback = [t for n, t in launched[seen_launch:] if n == "executor"]
                if done or failure:
                    break
                if time.monotonic() > deadline:
                    if fallback:
                        stamp = fallback[0]
                        break
                    raise BenchError("HQ did not start the executor within 10 s of create_task")
                time.sleep(0.001)
            if failure:
                raise BenchError(failure[0])
            if round_no:
                latencies.append(stamp - committed)
        # What an idle HQ costs per poll (nothing new in the journal).
        time.sleep(0.3)
        del poll_times[:]
        time.sleep(10 * HQ_POLL_INTERVAL)
        idle = median(list(poll_times))
    finally:
        stop.set()
        thread.join(5)
        controller.shutdown()
        with contextlib.suppress(Exception):
            ferrus.op_force_reset(committer, ferrus.HUMAN)
    return latencies, idle


def fig_hq_reaction(bench, fig):
    """Journal entry -> HQ spawns the reacting agent."""
    if not hasattr(bench.ferrus, "HqController"):
        fig.na("HQ not implemented yet", "≤ 50 ms median")
        return
    latencies, idle = measure_hq_reaction(bench, bench.reps(30, 5))
    med = median(latencies)
    fig.values.update({"median_s": med, "p99_s": percentile(latencies, 99), "idle_poll_s": idle})
    fig.check("median %s, p99 %s (%d rounds)" % (ms(med), ms(percentile(latencies, 99)),
                                                  len(latencies)), "≤ 50 ms median", med <= 0.050)
    fig.info("(HQ polls every %.0f ms, as its front ends do; the agent is a stub; "
             "an idle poll takes %s)" % (HQ_POLL_INTERVAL * 1000, ms(idle)))
    # For information: the same after a long history, as in a project used for weeks
    # (every heartbeat and HQ session step is a journal line).
    history = 5000
    long_lat, long_idle = measure_hq_reaction(bench, bench.reps(15, 5), history)
    fig.values.update({"history": history, "history_median_s": median(long_lat),
                       "history_idle_poll_s": long_idle})
    fig.info("(info) with %d journal entries: median %s, idle poll %s" % (
        history, ms(median(long_lat)), ms(long_idle)))


def _write_history(root, count, per_task=10000):
    """A project's journal of ``count`` entries, written directly in the journal's format
    (seq == rev): tasks of ``per_task`` entries each, every task's steps a mix of
    heartbeats, HQ session moves and capacity gate decisions, as a busy HQ leaves them.
    STATE.json's rev, task and session count match the last entry, as ferrus leaves them."""
    ferrus_dir = os.path.join(root, ".ferrus")
    state_path = os.path.join(ferrus_dir, "STATE.json")
    with open(state_path, encoding="utf-8") as handle:
        state = json.load(handle)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    head = '{"actor":"%s","detail":%s,"event":"%s","from":"Executing","seq":%d,'
    tail = '"task_id":"t-bench-%d","time":"' + stamp + '","to":"Executing"}\n'
    kinds = (("executor:bench:0", "{}", "heartbeat"),
             ("hq", '{"from":"Spawning","slot":"executor","to":"Running"}', "session"),
             ("hq", '{"action":"Continue","signal":null,"target":"spawn:executor",'
                    '"tier":"Green"}', "gate"))
    sessions = 0
    with open(os.path.join(ferrus_dir, "events.jsonl"), "w", encoding="utf-8") as handle:
        batch = []
        for seq in range(1, count + 1):
            task = (seq - 1) // per_task
            back = count - seq               # both sizes end with the same entries
            kind = kinds[0] if back % 20 != 10 else kinds[1 + (back // 20) % 2]
            if seq == task * per_task + 1:
                sessions = 0
            if kind[2] == "session":
                sessions += 1
            batch.append(head % (kind[0], kind[1], kind[2], seq) + tail % task)
            if len(batch) >= 10000:
                handle.write("".join(batch))
                batch = []
        handle.write("".join(batch))
    state.update(rev=count, state="Executing", task_id="t-bench-%d" % ((count - 1) // per_task),
                 task_sessions={"task_id": "t-bench-%d" % ((count - 1) // per_task),
                                "sessions": sessions})
    with open(state_path, "w", encoding="utf-8") as handle:
        json.dump(state, handle, indent=2)


def _journal_ops(bench, root):
    """The three operations under test, in-process: the `status` tool (its capacity
    part on), `ferrus log -n 20`, and HQ's start-up (its controller made and shut)."""
    ferrus = bench.ferrus
    store = bench.store(root)
    log_args = argparse.Namespace(n=20, json=False, follow=False, all=True)
    story_args = argparse.Namespace(n=20, json=False, follow=False, all=False)

    def status():
        data = ferrus.op_status(store).data
        if not data.get("capacity"):
            raise BenchError("the status tool reported no capacity tier")

    def log_tail():
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink):
            ferrus.cmd_log(log_args, root)
        if sink.getvalue().count("\n") != 20:
            raise BenchError("`ferrus log -n 20 --all` printed %d lines"
                             % sink.getvalue().count("\n"))

    def story_tail():
        # Without --all, bookkeeping (heartbeats, sessions, gates) is skipped: a bounded
        # look back from the end, however little of it is story.
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink):
            ferrus.cmd_log(story_args, root)
        if not 0 < sink.getvalue().count("\n") <= 20:
            raise BenchError("`ferrus log -n 20` printed %d lines" % sink.getvalue().count("\n"))

    def hq_start():
        controller = ferrus.HqController(ferrus.Store(root), emit=lambda message: None,
                                         launcher=lambda slot: None)
        controller.shutdown()
    return (("status", status), ("log -n 20 --all", log_tail), ("log -n 20", story_tail),
            ("HQ start", hq_start))


def fig_journal_scale(bench, fig):
    """status, `log -n 20` and HQ start with 10^6 journal entries vs 100."""
    small_n, large_n = 100, 1000000
    roots = {}
    for count in (small_n, large_n):
        root = bench.project("journal-%d" % count)
        with open(os.path.join(root, "ferrus.toml"), "a", encoding="utf-8") as handle:
            handle.write("\n[capacity]\nmax_sessions = 1000000\n")
        started = time.perf_counter()
        _write_history(root, count)
        if count == large_n:
            size = os.path.getsize(os.path.join(root, ".ferrus", "events.jsonl"))
            fig.info("(%d entries, %.0f MB, written in %.1f s)" % (
                count, size / 1e6, time.perf_counter() - started))
        roots[count] = root
    reps = bench.reps(200, 40)
    ops = {count: _journal_ops(bench, roots[count]) for count in roots}
    for index, (name, _) in enumerate(ops[small_n]):
        samples = {small_n: [], large_n: []}
        for rep in range(reps + 5):                  # interleaved; the first 5 warm up
            for count in (small_n, large_n):
                started = time.perf_counter()
                ops[count][index][1]()
                if rep >= 5:
                    samples[count].append(time.perf_counter() - started)
        small, large = median(samples[small_n]), median(samples[large_n])
        fig.values[name] = {"small_s": small, "large_s": large, "reps": reps}
        measured = "%s: %s with %d entries, %s with 100 → %.2f×" % (
            name, ms(large), large_n, ms(small), ratio(large, small))
        if name == "log -n 20":
            # Its look-back is bounded (20 × n + 500 entries), not the journal: a
            # 100-entry journal simply ends the look-back sooner.
            fig.info("(info) %s (default view; reads at most 900 entries)" % measured)
        else:
            fig.check(measured, "≤ 2× the 100-entry figure", ratio(large, small) <= 2.0)


def _checks_child(bench, root, commands, parallel, timeout, **extra):
    spec = dict(root=root, commands=commands, parallel=parallel, **extra)
    return bench.run_child([bench.python, os.path.join(HERE, "checks_child.py"),
                            bench.ferrus_path, json.dumps(spec)], timeout)


def _plain_root(bench, name):
    root = os.path.join(bench.tmp, name)
    os.makedirs(os.path.join(root, ".ferrus", "logs"))
    return root


def fig_checks_parallel(bench, fig):
    """Four `sleep 1` checks through ferrus.run_checks, sequential and parallel."""
    root = _plain_root(bench, "checks")
    commands = ["sleep 1"] * 4
    if os.name == "nt":  # pragma: no cover
        commands = ['"%s" -c "import time; time.sleep(1)"' % bench.python] * 4
    sequential = _checks_child(bench, root, commands, False, 60)
    parallel = [_checks_child(bench, root, commands, True, 60) for _ in range(bench.reps(3, 1))]
    for run in [sequential] + parallel:
        if not run["passed"]:
            raise BenchError("a check did not pass: %s" % run["results"])
    par = median([run["wall"] for run in parallel])
    fig.values.update({"sequential_s": sequential["wall"], "parallel_s": par,
                       "parallel_runs_s": [run["wall"] for run in parallel]})
    fig.check("parallel %s (median of %d)" % (ms(par), len(parallel)), "≤ 1.2 s wall", par <= 1.2)
    fig.info("sequential %s → %.1f× speed-up" % (ms(sequential["wall"]),
                                                  ratio(sequential["wall"], par)))


def fig_check_memory_1gb(bench, fig):
    """A check printing 1 GiB of lines: the runner's peak RSS growth and throughput."""
    try:
        import resource  # noqa: F401
    except ImportError:  # pragma: no cover
        fig.na("needs the resource module (POSIX)", "≤ 20 MB growth")
        return
    root = _plain_root(bench, "memory")
    chunks = 16384                        # 16384 × 64 KiB = 1 GiB
    total = chunks * 65536
    code = ("import sys\nw = sys.stdout.buffer.write\nchunk = (b'x' * 63 + b'\\n') * 1024\n"
            "for _ in range(%d):\n    w(chunk)\n" % chunks)
    command = "%s -c \"%s\"" % (bench.python, code.replace('"', '\\"'))
    if os.name != "nt":
        import shlex
        command = "%s -c %s" % (shlex.quote(bench.python), shlex.quote(code))
    run = _checks_child(bench, root, [command], False, 600, delete_logs=True)
    result = run["results"][0]
    if result["status"] != "passed":
        raise BenchError("the 1 GiB check ended %s (exit %s)" % (result["status"],
                                                                result["exit_code"]))
    expected_lines = total // 64
    kib = []
    if run.get("maxrss_before_kib") is not None:
        kib.append(run["maxrss_after_kib"] - run["maxrss_before_kib"])
    if run.get("hwm_after_kib") is not None and run.get("rss_before_kib") is not None:
        kib.append(run["hwm_after_kib"] - run["rss_before_kib"])
    growth_mb = max(kib) * 1024 / 1e6 if kib else float("nan")
    throughput = total / run["wall"] / 1e6
    fig.values.update({"bytes": total, "lines": result["line_count"], "wall_s": run["wall"],
                       "growth_mb": growth_mb, "maxrss_before_kib": run["maxrss_before_kib"],
                       "maxrss_after_kib": run["maxrss_after_kib"],
                       "rss_before_kib": run["rss_before_kib"],
                       "hwm_after_kib": run["hwm_after_kib"], "throughput_mb_s": throughput})
    fig.check("peak RSS growth %.1f MB (ru_maxrss %s → %s KiB)" % (
        growth_mb, run["maxrss_before_kib"], run["maxrss_after_kib"]), "≤ 20 MB growth",
        growth_mb <= 20)
    fig.info("1 GiB in %.2f s → %.0f MB/s, %d lines counted%s" % (
        run["wall"], throughput, result["line_count"],
        "" if result["line_count"] == expected_lines else " (expected %d!)" % expected_lines))


def _race(bench, root, workers, per):
    """Run ``workers`` race_worker.py processes on ``root``; their reports and the wall time."""
    procs = []
    outputs = {}
    timer = None
    killed = []
    try:
        for index in range(workers):
            procs.append(bench.registry.popen(
                [bench.python, os.path.join(HERE, "race_worker.py"), bench.ferrus_path, root,
                 str(index), str(per)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL))
        for proc in procs:
            if proc.stdout.readline().strip() != b"ready":
                raise BenchError("a race worker failed to start (exit %s)" % proc.wait())

        def watchdog():
            killed.append(True)
            for proc in procs:
                ProcessRegistry.stop(proc, grace=0.5)
        timer = threading.Timer(300, watchdog)
        timer.daemon = True
        timer.start()
        started = time.perf_counter()
        for proc in procs:         # release every worker at once
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        for proc in procs:
            line = proc.stdout.readline()
            if line.strip():
                data = json.loads(line)
                outputs[data["worker"]] = data
        elapsed = time.perf_counter() - started
        for proc in procs:
            proc.wait(30)
    finally:
        if timer:
            timer.cancel()
        for proc in procs:
            ProcessRegistry.stop(proc)
            bench.registry.forget(proc)
    if killed:
        raise BenchError("the race did not finish within 300 s")
    if len(outputs) != workers:
        raise BenchError("only %d of %d workers reported" % (len(outputs), workers))
    total = {key: sum(o[key] for o in outputs.values())
             for key in ("done", "toggles", "fsyncs", "fsync_s", "lock_wait_s", "lock_held_s")}
    total["errors"] = [e for o in outputs.values() for e in o["errors"]]
    total["elapsed"] = elapsed
    return total


def _io_floor(directory, count):
    """Seconds per transition for the disk work alone: the renames and fsyncs one
    race transition makes (STATE.json + journal; every other one also TASK.md),
    done by one process with no Python logic around them."""
    journal = os.open(os.path.join(directory, "floor.jsonl"),
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    payload = b"{" + b'"k": "v", ' * 60 + b"}\n"

    def replace(name):
        fd, temp = tempfile.mkstemp(dir=directory, prefix="." + name)
        os.write(fd, payload)
        os.fsync(fd)
        os.close(fd)
        os.replace(temp, os.path.join(directory, name))
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    try:
        started = time.perf_counter()
        for k in range(count):
            if k % 2:
                replace("floor-task.md")
            replace("floor-state.json")
            os.write(journal, payload)
            os.fsync(journal)
        return (time.perf_counter() - started) / count
    finally:
        os.close(journal)


def _tmpfs_dir():
    """A RAM-backed directory (fsync is free there), or None."""
    for path in ("/dev/shm",):
        if os.path.isdir(path) and os.access(path, os.W_OK):
            return path
    return None


def fig_transition_race(bench, fig):
    """8 processes × 500 store transactions on one .ferrus/: throughput and lost updates."""
    root = bench.project("race")
    workers, per = 8, bench.reps(500, 100)
    store = bench.store(root)
    rev_before = store.read_state().rev
    seq_before = store.last_journal_seq()
    race = _race(bench, root, workers, per)
    done, toggles, elapsed, errors = race["done"], race["toggles"], race["elapsed"], race["errors"]
    final = store.read_state()
    committed = final.rev - rev_before
    counter = int(final.extra.get("bench_counter", 0))
    # A lost update shows as a commit that did not advance rev, or an increment of
    # bench_counter (read-modify-write of STATE.json) that another commit overwrote.
    lost = max(done - committed, toggles - counter, 0)
    entries = [e for e in store.read_journal() if int(e["seq"]) > seq_before]
    seqs = [int(e["seq"]) for e in entries]
    gapless = seqs == list(range(seq_before + 1, final.rev + 1))
    ticks = {(e["detail"].get("worker"), e["detail"].get("k")) for e in entries
             if e.get("event") == "bench_tick"}
    ticks_expected = done - toggles
    throughput = done / elapsed
    fig.values.update({"workers": workers, "per_worker": per, "done": done,
                       "refused": workers * per - done, "errors": errors[:10],
                       "elapsed_s": elapsed, "transitions_per_s": throughput,
                       "rev_delta": committed, "bench_counter": counter, "toggles": toggles,
                       "lost_updates": lost, "journal_gapless": gapless,
                       "journal_entries": len(seqs), "ticks_journaled": len(ticks),
                       "fsyncs": race["fsyncs"], "fsync_s": race["fsync_s"],
                       "lock_held_s": race["lock_held_s"], "lock_wait_s": race["lock_wait_s"]})
    fig.check("%.0f transitions/s (%d × %d in %.2f s)" % (throughput, workers, per, elapsed),
              "≥ 500 transitions/s", throughput >= 500)
    fig.check("%d lost: rev +%d for %d commits, counter %d/%d, journal %d..%d %s" % (
        lost, committed, done, counter, toggles, seq_before + 1, final.rev,
        "gapless" if gapless else "NOT gapless"), "0 lost updates",
        lost == 0 and gapless and committed == done and len(ticks) == ticks_expected)
    if len(ticks) != ticks_expected:
        fig.info("%d of %d append_event entries journaled" % (len(ticks), ticks_expected))
    if errors:
        fig.info("%d transitions refused: %s" % (workers * per - done, errors[0]))
    if done:
        fig.info("lock held %.0f%% of wall, %.2f ms per transition; %.1f fsyncs per "
                 "transition, %.2f ms each = %.0f%% of wall" % (
                     100 * race["lock_held_s"] / elapsed, 1000 * race["lock_held_s"] / done,
                     race["fsyncs"] / done, 1000 * race["fsync_s"] / max(1, race["fsyncs"]),
                     100 * race["fsync_s"] / elapsed))
    if os.name != "nt":
        floor = _io_floor(os.path.join(root, ".ferrus"), bench.reps(400, 100))
        fig.values["io_floor_s"] = floor
        fig.info("(info) that disk work alone, one process, no ferrus: %s per transition "
                 "→ ceiling %.0f/s" % (ms(floor), 1 / floor))
    # For information: the same race where fsync costs nothing, which separates
    # ferrus's own per-transition cost (and lock hand-over) from the disk's.
    shm = _tmpfs_dir()
    if shm:
        ram_root = tempfile.mkdtemp(prefix="ferrus-bench-race-", dir=shm)
        try:
            bench.run_cli(ram_root, "init")
            ram = _race(bench, ram_root, workers, per)
        finally:
            shutil.rmtree(ram_root, ignore_errors=True)
        ram_rate = ram["done"] / ram["elapsed"]
        fig.values.update({"tmpfs_transitions_per_s": ram_rate,
                           "tmpfs_lock_held_s": ram["lock_held_s"], "tmpfs_elapsed_s": ram["elapsed"]})
        fig.info("(info) same race on tmpfs %s: %.0f transitions/s, lock held %.0f%% of wall" % (
            shm, ram_rate, 100 * ram["lock_held_s"] / ram["elapsed"]))


LOOP_STEPS = (
    ("create_task", "supervisor", {"description": "bench loop"}),
    ("wait_for_task", "executor", {}),
    ("check", "executor", {}),
    ("submit", "executor", {"content": "done"}),
    ("wait_for_review", "supervisor", {}),
    ("approve", "supervisor", {}),
)


def fig_full_loop(bench, fig):
    """create → claim → check → submit → claim review → approve, two scripted MCP clients."""
    root = bench.project("loop", commands=["true"])
    loops = bench.reps(25, 5)
    warmup = 1
    conns = {"supervisor": bench.serve(root, "supervisor"), "executor": bench.serve(root, "executor")}
    totals, steps = [], {name: [] for name, _, _ in LOOP_STEPS}
    try:
        for conn in conns.values():
            conn.initialize(timeout=60)
        for loop in range(warmup + loops):
            bench.reset(root)
            timings = {}
            started = None
            for name, role, arguments in LOOP_STEPS:
                request_id, sent = conns[role].start_tool(name, arguments)
                started = sent if started is None else started
                result, arrived = conns[role].tool_result(request_id, timeout=60)
                timings[name] = arrived - sent
                data = structured(result)
                if name in ("check", "submit") and data.get("passed") is False:
                    raise BenchError("%s did not pass: %s" % (name, json.dumps(data)[:200]))
            if data.get("state") != "Complete":
                raise BenchError("the loop ended in state %s" % data.get("state"))
            if loop >= warmup:
                totals.append(arrived - started)
                for name, value in timings.items():
                    steps[name].append(value)
    finally:
        for conn in conns.values():
            conn.close()
    med = median(totals)
    fig.values.update({"loops": loops, "median_s": med, "p99_s": percentile(totals, 99),
                       "steps_median_s": {k: median(v) for k, v in steps.items()}})
    fig.info("median %s per loop, p99 %s (%d loops, check = `true`)" % (
        ms(med), ms(percentile(totals, 99)), loops))
    parts = ["%s %s" % (name, ms(median(steps[name]))) for name, _, _ in LOOP_STEPS]
    fig.info("steps: " + ", ".join(parts[:3]))
    fig.info("       " + ", ".join(parts[3:]))


def fig_ping_under_waits(bench, fig):
    """One executor server with 1,000 wait_for_task calls pending: how fast ping answers."""
    root = bench.project("pending")
    path = os.path.join(root, "ferrus.toml")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    text, count = re.subn(r"(?m)^wait_timeout_secs\s*=.*$", "wait_timeout_secs = 600", text,
                          count=1)
    if not count:
        raise BenchError("no `wait_timeout_secs =` line in the ferrus.toml that init wrote")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    pending = 1000
    pings = bench.reps(50, 10)
    conn = bench.serve(root, "executor")
    latencies = []
    try:
        conn.initialize(timeout=60)
        waits = [conn.start_tool("wait_for_task")[0] for _ in range(pending)]
        refused = 0
        # Each wait is either running (no answer yet) or refused at once as
        # excess; the refusals all arrive before the answer to this ping.
        _, first = conn.request("ping", timeout=60)
        with conn._cond:
            answered = [i for i in waits if i in conn._responses]
        for request_id in answered:
            result, _ = conn.wait(request_id)
            refused += bool(result.get("isError"))
        for _ in range(pings):
            _, elapsed = conn.request("ping", timeout=60)
            latencies.append(elapsed)
        for request_id in waits:
            if request_id not in answered:
                conn.notify("notifications/cancelled", {"requestId": request_id})
        _, _ = conn.request("ping", timeout=60)
    finally:
        conn.close()
    worst = max(latencies)
    fig.values.update({"pending": pending, "refused": refused, "first_ping_s": first,
                       "ping_median_s": median(latencies), "ping_max_s": worst})
    fig.check("%d pings while %d waits run: median %s, max %s" % (
        pings, pending - refused, ms(median(latencies)), ms(worst)), "answered ≤ 100 ms",
        worst <= 0.1)
    fig.info("%d wait_for_task sent at once: %d running, %d refused at once as excess; the "
             "first ping, queued behind all of them, %s" % (pending, pending - refused, refused,
                                                             ms(first)))


def _git(root, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@example.com",
               GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="bench@example.com")
    subprocess.run(["git", "-c", "init.defaultBranch=main"] + list(args), cwd=root, env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def fig_diff_stat(bench, fig):
    """The task's diff stat in a 20,000-file repository with 200 files changed."""
    import shutil
    if shutil.which("git") is None:
        fig.na("git is not installed", "≤ 300 ms")
        return
    if not hasattr(bench.ferrus, "op_diff"):
        fig.na("this ferrus has no task diff", "≤ 300 ms")
        return
    files, changed = 20000, 200
    root = bench.project("git-diff")
    started = time.perf_counter()
    for i in range(files):
        folder = os.path.join(root, "src", "d%03d" % (i // 100))
        if i % 100 == 0:
            os.makedirs(folder)
        with open(os.path.join(folder, "f%05d.py" % i), "w", encoding="utf-8") as handle:
            handle.write("".join("value_%d = %d\n" % (n, i) for n in range(8)))
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "20,000 files")
    fig.info("(repository of %d files made in %.1f s)" % (files, time.perf_counter() - started))
    store = bench.store(root)
    bench.ferrus.op_create_task(store, bench.ferrus.HUMAN, "Change 200 files.")
    # Half the change edits tracked files, half adds untracked ones.
    for i in range(0, files, files // (changed // 2)):
        with open(os.path.join(root, "src", "d%03d" % (i // 100), "f%05d.py" % i), "a",
                  encoding="utf-8") as handle:
            handle.write("added = True\n")
    for i in range(changed // 2):
        with open(os.path.join(root, "src", "new_%03d.py" % i), "w", encoding="utf-8") as handle:
            handle.write("new = %d\n" % i)
    samples = []
    for rep in range(bench.reps(11, 3) + 1):          # the first warms the file cache
        started = time.perf_counter()
        outcome = bench.ferrus.op_diff(store, stat_only=True)
        if rep:
            samples.append(time.perf_counter() - started)
    found = len(outcome.data.get("files") or ())
    if found != changed:
        fig.fail("the stat lists %d files, not %d" % (found, changed))
        return
    fig.values.update({"files": files, "changed": changed, "median_s": median(samples),
                       "samples": samples})
    fig.check("diff stat of %d changed files among %d: median %s of %d" % (
        changed, files, ms(median(samples)), len(samples)), "≤ 300 ms",
        median(samples) <= 0.3)
    # The same diff read over MCP, with pings sent while it runs: they do not wait for it.
    conn = bench.serve(root, "supervisor")
    try:
        conn.initialize(timeout=60)
        pings = []
        for _ in range(bench.reps(5, 2)):
            read_id, _ = conn.start("resources/read", {"uri": "ferrus://diff"})
            _, elapsed = conn.request("ping", timeout=60)
            pings.append(elapsed)
            conn.wait(read_id, timeout=120)
    finally:
        conn.close()
    fig.values["ping_during_diff_s"] = pings
    fig.check("ping sent while ferrus://diff (the whole diff) is being read: max %s"
              % ms(max(pings)), "never blocked (≤ 100 ms)", max(pings) <= 0.1)


# -- parallel tasks ----------------------------------------------------------------------------

PARALLEL_TASKS = 8
PARALLEL_CHECK = "test -f README.md"      # the checks the tests of parallel runs use


def _parallel_project(bench, name, checks):
    """A git repository with ferrus initialised, every change committed on main, and the
    custom agent ``instant`` as executor and reviewer (its argv is never run: the
    bench's launcher starts the agents, see _InstantAgents)."""
    if shutil.which("git") is None:
        raise BenchError("git is not installed")
    root = bench.project(name)
    with open(os.path.join(root, "ferrus.toml"), "w", encoding="utf-8") as handle:
        handle.write("[checks]\ncommands = %s\n\n[limits]\nwait_timeout_secs = 5\n"
                     "max_review_cycles = 1000\n\n"
                     '[agents.custom.instant]\ninteractive = ["instant-agent", "{role}", '
                     '"{mcp_config}"]\nheadless = ["instant-agent", "{role}", "{mcp_config}"]\n'
                     'prompt = "stdin"\n\n[hq.supervisor]\nagent = "instant"\n\n'
                     '[hq.executor]\nagent = "instant"\n' % json.dumps(list(checks)))
    bench.ferrus.register_agents(root, {"supervisor": ("instant", None),
                                        "executor": ("instant", None)},
                                 report=lambda message: None)
    with open(os.path.join(root, "README.md"), "w", encoding="utf-8") as handle:
        handle.write("hello\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "start")
    return root


_FIFO_NUMBERS = itertools.count(1)


def _fifo_stub(bench, name):
    """(argv, path): a stand-in agent process, `cat FIFO`, that ends when the writer
    the bench opens on the FIFO is closed."""
    path = os.path.join(bench.tmp, "fifo-%s-%d" % (name, next(_FIFO_NUMBERS)))
    os.mkfifo(path)
    return ["cat", path], path


class _InstantAgents:
    """Agents whose own time is next to nothing: a thread of the bench plays each agent
    session ferrus starts.  The launcher ferrus calls gives it a stub process (`cat` on a
    FIFO, which ferrus supervises as it would an agent CLI); the thread starts the
    `ferrus serve` that the MCP configuration ferrus wrote for the role names, in the
    task's worktree with the session id ferrus gave the stub (as an agent CLI would), makes
    the scripted agent's tool calls (executor: wait_for_task, write the task's
    `WRITE name: text` files, check, submit; reviewer: wait_for_review, approve), then
    closes the FIFO so the stub exits.  Only the file writes are the agent's own work;
    their time is kept per task so it can be subtracted, and so is each session's whole
    life (the stub's start to its end) for the figure without the agents' sessions."""

    def __init__(self, bench, root):
        self.bench = bench
        self.root = root
        self.ferrus = bench.ferrus
        self.store = bench.store(root)
        self.lock = threading.Lock()
        self.own = collections.defaultdict(float)    # task -> seconds of the agents' own work
        self.sessions = collections.defaultdict(float)   # task -> seconds agents were up
        self.failures = []
        self.threads = []

    def launcher(self, slot):
        argv, fifo = _fifo_stub(self.bench, "agent")
        thread = threading.Thread(target=self._play, args=(slot, fifo), daemon=True,
                                  name="bench-agent-%s" % slot.name)
        thread.start()
        self.threads.append(thread)
        return self.ferrus.Launch(argv=argv), (lambda line: [])

    def _play(self, slot, fifo):
        try:
            # Opening blocks until the stub has the FIFO open: by then ferrus has started
            # it and named its session (which carries the task's id).
            with open(fifo, "w"):
                began = time.perf_counter()
                task = self._session(slot)
                with self.lock:
                    self.sessions[task] += time.perf_counter() - began
        except Exception as err:     # reported by the figure
            with self.lock:
                self.failures.append("%s agent: %s: %s" % (slot.name, type(err).__name__, err))

    def _session(self, slot):
        ferrus = self.ferrus
        session = slot.session_id
        task = ferrus.session_task(session)
        record = ferrus.read_task_record(self.store.dir, task)
        with open(os.path.join(self.root, ".ferrus", "mcp-%s.json" % slot.role),
                  encoding="utf-8") as handle:
            server = list(json.load(handle)["mcpServers"].values())[0]
        # As Claude Code, Qwen Code and Gemini CLI do (Codex for the variables ferrus
        # names): the server gets the environment ferrus gave the CLI.
        deadline = time.monotonic() + 10
        while slot.process is None and time.monotonic() < deadline:
            time.sleep(0.001)         # the stub is up; ferrus is just recording it
        env = dict(_process_environment(slot.process.proc.pid) if slot.process else None
                   or os.environ, **{ferrus.SESSION_ENV: session})
        conn = McpConnection([server["command"]] + list(server["args"]), self.bench.registry,
                             cwd=record["worktree"], env=env,
                             label="ferrus serve for %s" % slot.name)
        try:
            conn.initialize(timeout=60)
            if slot.name == "reviewer":
                self._until(conn, "wait_for_review", "claimed")
                conn.call_tool("approve", timeout=60)
            elif slot.name == "executor":
                claimed = self._until(conn, "wait_for_task", "claimed")
                started = time.perf_counter()
                writes = re.findall(r"^WRITE ([^:\n]+): (.*)$", claimed.get("task") or "",
                                    re.M)
                for name, text in writes:
                    with open(os.path.join(record["worktree"], name), "w",
                              encoding="utf-8") as handle:
                        handle.write(text + "\n")
                with self.lock:
                    self.own[task] += time.perf_counter() - started
                conn.call_tool("check", timeout=60)
                conn.call_tool("submit", {"content": "Did the work."}, timeout=60)
        finally:
            conn.close()
        return task

    @staticmethod
    def _until(conn, tool, status):
        for _ in range(100):
            result, _ = conn.call_tool(tool, timeout=60)
            data = structured(result)
            if data.get("status") == status:
                return data
        raise BenchError("%s never answered %s" % (tool, status))

    def join(self):
        for thread in self.threads:
            thread.join(30)


def _server_host_cpu(ferrus):
    """CPU seconds of this process's server host and its reaped children (Linux's /proc;
    0 without one)."""
    host = getattr(ferrus, "SERVER_HOST", None)
    process = getattr(host, "process", None)
    if process is None:
        return 0.0
    try:
        with open("/proc/%d/stat" % process.pid, encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _process_environment(pid):
    """The environment process ``pid`` started with (Linux's /proc), or None."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as handle:
            entries = handle.read().split(b"\0")
    except OSError:
        return None
    return dict(os.fsdecode(entry).partition("=")[::2] for entry in entries if b"=" in entry)


def _overlap(start, end, intervals):
    """Seconds of [start, end] covered by the union of ``intervals``."""
    covered, cursor = 0.0, start
    for low, high in sorted(intervals):
        low, high = max(low, cursor), min(high, end)
        if high > low:
            covered += high - low
            cursor = high
    return covered


def _journal_intact(entries, tasks):
    """(ok, words): seq runs 1..N with none twice, and each task's milestones
    (prepared, created, submitted, approved, integrated, merged) appear exactly once."""
    seqs = [entry.get("seq") for entry in entries]
    gapless = seqs == list(range(1, len(seqs) + 1))
    counts = collections.Counter((entry.get("task_id"), entry.get("event")) for entry in entries)
    wanted = ("prepare_task", "create_task", "submit", "approve", "integrated", "task_merged")
    odd = ["%s %s ×%d" % (task[-6:], event, counts[(task, event)]) for task in tasks
           for event in wanted if counts[(task, event)] != 1]
    words = "journal seq 1..%d %s" % (len(seqs), "gapless, none twice" if gapless else
                                      "NOT contiguous")
    words += "; each task's %d milestones once" % len(wanted) if not odd else \
        "; milestones lost or doubled: %s" % ", ".join(odd[:4])
    return gapless and not odd, words


def parallel_run_once(bench, label):
    """One `ferrus run --parallel 8` (run_parallel in this process) of 8 queued tasks, each
    writing its own file, worked by _InstantAgents: per task, ferrus's own time and the
    steps it went through; for the run, the wall and CPU time, git processes, whether
    every task merged and whether the journal is intact."""
    ferrus = bench.ferrus
    n = PARALLEL_TASKS
    root = _parallel_project(bench, "parallel-%s" % label, [PARALLEL_CHECK])
    store = bench.store(root)
    tasks = [ferrus.op_enqueue_task(store, ferrus.HUMAN, "Add file %d.\n\nWRITE file%d.txt: %d\n"
                                    % (i, i, i)).data["task_id"] for i in range(n)]
    agents = _InstantAgents(bench, root)
    # Stamps taken around ferrus's own functions (in this process: the runner's thread and
    # its integration thread), keyed by the task's worktree folder (named after the task).
    stamps = collections.defaultdict(dict)
    git_runs = [0]
    originals = {name: getattr(ferrus, name) for name in
                 ("remove_task_worktree", "_git_argv")}
    work = ferrus.MergeQueue._integration_work

    def integration_work(runner, job, task, *args, **kwargs):
        stamps[task]["integrate"] = time.time()
        return work(runner, job, task, *args, **kwargs)

    def remove_task_worktree(root_, worktree, *args, **kwargs):
        try:
            return originals["remove_task_worktree"](root_, worktree, *args, **kwargs)
        finally:
            stamps[os.path.basename(worktree)]["end"] = time.time()

    def git_argv(*args, **kwargs):
        git_runs[0] += 1
        return originals["_git_argv"](*args, **kwargs)

    lines = []
    ferrus.MergeQueue._integration_work = integration_work
    ferrus.remove_task_worktree = remove_task_worktree
    ferrus._git_argv = git_argv
    def cpu_times():
        if resource is None:
            return (0.0, 0.0)
        own, children = (usage.ru_utime + usage.ru_stime for usage in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN)))
        # The server host (a child that lives on) and the sessions it has served.
        return own, children + _server_host_cpu(ferrus)

    cpu_before = cpu_times()
    started = time.time()
    try:
        code = ferrus.run_parallel(store, n, timeout=300, out=lines.append,
                                   launcher=agents.launcher)
    finally:
        for name, value in originals.items():
            setattr(ferrus, name, value)
        ferrus.MergeQueue._integration_work = work
    wall = time.time() - started
    agents.join()
    cpu_self, cpu_children = [after - before for before, after in
                              zip(cpu_before, cpu_times())]
    if agents.failures:
        raise BenchError(agents.failures[0])
    status = {row["id"]: row["status"] for row in ferrus.task_rows(store)}
    merged = [task for task in tasks if status.get(task) == "merged"]
    if code != 0 or len(merged) != n:
        tail = " | ".join(line for line in lines[-6:])
        raise BenchError("the run exited %s with %d of %d merged: %s" % (code, len(merged),
                                                                        n, tail[-400:]))
    entries = store.read_journal()

    def entry_time(task, event, slot=None):
        for entry in entries:
            if entry.get("task_id") == task and entry.get("event") == event and (
                    slot is None or (entry.get("detail") or {}).get("slot") == slot and
                    entry["detail"].get("to") == "Running"):
                return ferrus.parse_timestamp(entry["time"]).timestamp()
        raise BenchError("no %s entry for task %s in the journal" % (event, task))

    spans = {}
    for task in tasks:
        mark = stamps[task]
        if "integrate" not in mark or "end" not in mark:
            raise BenchError("task %s was merged without the integration being seen" % task)
        spans[task] = {"start": entry_time(task, "prepare_task"),
                       "created": entry_time(task, "create_task"),
                       "executor": entry_time(task, "session", "executor"),
                       "claimed": entry_time(task, "claim"),
                       "submitted": entry_time(task, "submit"),
                       "reviewer": entry_time(task, "session", "reviewer"),
                       "approved": entry_time(task, "approve"),
                       "integrate": mark["integrate"], "end": mark["end"]}
    latency, overhead, waits, outside = [], [], [], []
    for task, span in spans.items():
        # Waiting in the merge queue while other tasks are integrated is their time
        # (integrations are one at a time), not this task's.
        others = [(s["integrate"], s["end"]) for t, s in spans.items() if t != task]
        wait = _overlap(span["approved"], span["integrate"], others)
        total = span["end"] - span["start"]
        latency.append(total)
        waits.append(wait)
        overhead.append(total - wait - agents.own[task])
        outside.append(total - wait - agents.sessions[task])
    files_ok = all(os.path.exists(os.path.join(root, "file%d.txt" % i)) for i in range(n))
    intact, journal_words = _journal_intact(entries, tasks)
    return {"overhead": overhead, "latency": latency, "waits": waits, "spans": spans,
            "outside": outside,
            "agents_own": sum(agents.own.values()), "wall": wall, "cpu_self": cpu_self,
            "cpu_children": cpu_children, "git_processes": git_runs[0],
            "merged": len(merged), "ok": len(merged) == n and files_ok and intact,
            "journal": journal_words, "entries": len(entries)}


def fig_parallel_overhead(bench, fig):
    """8 tasks run with --parallel 8 by instant agents: ferrus's own time per task."""
    if not hasattr(bench.ferrus, "run_parallel"):
        fig.na("this ferrus has no parallel tasks", "≤ 1 s median per task")
        return
    if shutil.which("git") is None or not hasattr(os, "mkfifo"):
        fig.na("needs git and FIFOs (not on this platform)", "≤ 1 s median per task")
        return
    n = PARALLEL_TASKS
    runs = [parallel_run_once(bench, str(number)) for number in range(bench.reps(3, 1))]
    overhead = [value for run in runs for value in run["overhead"]]
    latency = [value for run in runs for value in run["latency"]]
    waits = [value for run in runs for value in run["waits"]]
    outside = [value for run in runs for value in run["outside"]]
    spans = [span for run in runs for span in run["spans"].values()]
    med, p90 = median(overhead), percentile(overhead, 90)
    fig.values.update({"tasks": n, "runs": len(runs), "overhead_median_s": med,
                       "overhead_p90_s": p90, "overhead_s": overhead, "latency_s": latency,
                       "queue_wait_s": waits,
                       "wall_s": [run["wall"] for run in runs],
                       "git_processes": [run["git_processes"] for run in runs],
                       "journal_entries": [run["entries"] for run in runs]})
    fig.check("ferrus's own time per task: median %s, p90 %s (%d runs of %d tasks, "
              "--parallel %d)" % (ms(med), ms(p90), len(runs), n, n),
              "≤ 1 s median per task", med <= 1.0)
    worst = next((run for run in runs if not run["ok"]), runs[-1])
    fig.check("%d of %d merged in every run, every file on main; %s" % (
        min(run["merged"] for run in runs), n, worst["journal"]),
        "all merged, 0 lost", all(run["ok"] for run in runs))
    fig.info("(info) dispatch → merged per task: median %s, p90 %s, of which waiting for the "
             "merge queue: median %s; agents' own work: %s per run" % (
                 ms(median(latency)), ms(percentile(latency, 90)), ms(median(waits)),
                 ms(median([run["agents_own"] for run in runs]))))
    fig.values["outside_sessions_s"] = outside
    fig.info("(info) the same without the agents' sessions (from each stub's start to its end, "
             "their `ferrus serve` and tool calls included): median %s, p90 %s" % (
                 ms(median(outside)), ms(percentile(outside, 90))))
    # Where a task's time goes, step by step (the medians over the tasks).
    steps = (("prepared", "start", "created"), ("dispatched", "created", "executor"),
             ("executor's server up, claimed", "executor", "claimed"),
             ("check + submit", "claimed", "submitted"),
             ("reviewer started", "submitted", "reviewer"),
             ("reviewer's server up, approved", "reviewer", "approved"),
             ("to the merge queue", "approved", "integrate"),
             ("integrated + cleaned up", "integrate", "end"))
    breakdown = [(label, median([s[b] - s[a] for s in spans])) for label, a, b in steps]
    fig.values["steps_median_s"] = dict(breakdown)
    fig.info("(info) steps (medians): " + ", ".join(
        "%s %s" % (label, ms(value)) for label, value in breakdown[:4]))
    fig.info("                        " + ", ".join(
        "%s %s" % (label, ms(value)) for label, value in breakdown[4:]))
    wall = median([run["wall"] for run in runs])
    cpu_self = median([run["cpu_self"] for run in runs])
    cpu_children = median([run["cpu_children"] for run in runs])
    git_runs = median([run["git_processes"] for run in runs])
    fig.values.update({"cpu_runner_s": cpu_self, "cpu_children_s": cpu_children})
    fig.info("(info) a run (medians): %s wall (%s per task); CPU %s in the runner's process "
             "(runner, agents' threads), %s in child processes (%d `ferrus serve`, git, "
             "checks); %d git processes in the runner (%.1f per task)" % (
                 ms(wall), ms(wall / n), ms(cpu_self), ms(cpu_children), 2 * n,
                 git_runs, git_runs / n))


PLACE_TASKS = 2


def place_run_once(bench, label, place):
    """Wall seconds of `ferrus run --parallel 2` (run_parallel) of two queued tasks, each
    writing its own file, worked by the scripted agent (tests/scripted_agent.py, real
    processes) — here (``place`` None) or at ``place`` (a PlaceConfig), where the agent
    is a copy the place's user can run."""
    ferrus = bench.ferrus
    root = bench.project("place-%s" % label)
    agent = [bench.python, os.path.join(REPO, "tests", "scripted_agent.py")]
    places = ""
    if place is not None:
        channel = ferrus.Place(place)
        folder = place.dir[2:].rstrip("/") + "/agents"      # under the place user's home
        with open(agent[1], "rb") as handle:
            done = channel.run(["sh", "-c", 'cd && mkdir -p "$1" && cat > "$1/scripted_agent.py" '
                                '&& echo "$HOME/$1"', "sh", folder], input=handle.read())
        if done.returncode != 0:
            raise BenchError("could not copy the scripted agent to the place: %s" %
                             done.stderr.decode("utf-8", "replace")[-300:])
        agent = [place.python, done.stdout.decode().strip() + "/scripted_agent.py"]
        places = ("places = [%s]\n\n[places.%s]\nssh = %s\nslots = %d\ndir = %s\n"
                  "python = %s\n" % (json.dumps(place.name), place.name, json.dumps(place.ssh),
                                     PLACE_TASKS, json.dumps(place.dir),
                                     json.dumps(place.python)))
    argv = agent + ["{role}", "{mcp_config}"]
    with open(os.path.join(root, "ferrus.toml"), "w", encoding="utf-8") as handle:
        handle.write("[checks]\ncommands = [\"test -f README.md\"]\n\n[limits]\n"
                     "wait_timeout_secs = 5\n\n[parallel]\n%s\n"
                     "[agents.custom.scripted]\ninteractive = %s\nheadless = %s\n"
                     "prompt = \"stdin\"\n\n[hq.supervisor]\nagent = \"scripted\"\n\n"
                     "[hq.executor]\nagent = \"scripted\"\n" % (
                         places, json.dumps(argv), json.dumps(argv)))
    ferrus.register_agents(root, {"supervisor": ("scripted", None),
                                  "executor": ("scripted", None)}, report=lambda message: None)
    with open(os.path.join(root, "README.md"), "w", encoding="utf-8") as handle:
        handle.write("hello\n")
    with open(os.path.join(root, ".gitignore"), "w", encoding="utf-8") as handle:
        handle.write(".ferrus/\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "start")
    store = bench.store(root)
    tasks = [ferrus.op_enqueue_task(store, ferrus.HUMAN, "Add file %d.\n\nWRITE file%d.txt: %d\n"
                                    % (i, i, i)).data["task_id"] for i in range(PLACE_TASKS)]
    lines = []
    started = time.time()
    code = ferrus.run_parallel(store, PLACE_TASKS, timeout=300, out=lines.append)
    wall = time.time() - started
    status = {row["id"]: row["status"] for row in ferrus.task_rows(store)}
    if code != 0 or any(status.get(task) != "merged" for task in tasks):
        raise BenchError("the run %s exited %s: %s" % (
            "at the place" if place else "here", code, " | ".join(lines[-5:])[-400:]))
    return wall


def fig_place_overhead(bench, fig):
    """Two tasks at an ssh place on 127.0.0.1 vs here: what the channel adds per task."""
    bar = "≤ 3 s per task more than here"
    if not hasattr(bench.ferrus, "Place"):
        fig.na("this ferrus has no places", bar)
        return
    tests = os.path.join(REPO, "tests")
    for folder in (REPO, tests):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        import places_harness
        places_harness.require_place_user()
        server = places_harness.SshServer()
    except BaseException as err:            # pytest's skip: the harness says why
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        fig.na("needs root, openssh-server and a second local user: %s" % (
            getattr(err, "msg", None) or err), bar)
        return
    place = bench.ferrus.PlaceConfig("box", ssh=server.prefix(),
                                     dir="~/.ferrus-places/bench-%d" % os.getpid(),
                                     python=places_harness.PLACE_PYTHON)
    try:
        runs = bench.reps(2, 1)
        here = [place_run_once(bench, "here-%d" % n, None) for n in range(runs)]
        there = [place_run_once(bench, "box-%d" % n, place) for n in range(runs)]
    finally:
        with contextlib.suppress(Exception):
            bench.ferrus.Place(place).run(["sh", "-c", 'cd && rm -rf "$1"', "sh",
                                           place.dir[2:]])
        server.stop()
    added = (median(there) - median(here)) / PLACE_TASKS
    fig.values.update({"here_wall_s": here, "place_wall_s": there, "added_per_task_s": added,
                       "tasks": PLACE_TASKS})
    fig.check("%d tasks (scripted agents, real processes) at an ssh place on 127.0.0.1, a "
              "second user: %s wall vs %s here: %s more per task (%d run%s each)" % (
                  PLACE_TASKS, ms(median(there)), ms(median(here)), ms(added), runs,
                  "" if runs == 1 else "s"), bar, added <= 3.0)


def measure_hq_reaction_parallel(bench, active, rounds):
    """Seconds from a committed `submit` of one of ``active`` parallel tasks to the
    ParallelRunner's controller for that task spawning its reviewer, and the runner's
    step times while nothing happens.

    The runner (ferrus.ParallelRunner, polled as run_parallel polls it: step, then sleep
    20 ms) runs in a thread with ``active`` tasks in flight, one HqController each.  Every
    executor is a stub that keeps running (`sleep`), so all tasks stay active; each
    reviewer is a stub on a FIFO that the bench ends once the round is over.  A round,
    taking the tasks in turn from a separate Store: claim as the executor, submit (the
    check is `true`), time from the commit to the "started the reviewer" message of
    that task, then claim as the reviewer, reject (back to Addressing) and end the
    reviewer stub."""
    ferrus = bench.ferrus
    root = _parallel_project(bench, "hq-parallel-%d" % active, ["true"])
    store = bench.store(root)
    tasks = [ferrus.op_enqueue_task(store, ferrus.HUMAN, "Task %d." % i).data["task_id"]
             for i in range(active)]
    lock = threading.Lock()
    started = collections.defaultdict(list)        # (task, slot) -> spawn stamps
    release = {}                                    # task -> Event ending its reviewer stub
    sleeper = ["sleep", "600"]

    def launcher(slot):
        if slot.name != "reviewer":
            return ferrus.Launch(argv=list(sleeper)), (lambda line: [])
        argv, fifo = _fifo_stub(bench, "reviewer")
        done = threading.Event()

        def hold():
            with open(fifo, "w"):
                task = ferrus.session_task(slot.session_id)
                with lock:
                    release[task] = done
                done.wait(60)
        threading.Thread(target=hold, daemon=True, name="bench-reviewer-stub").start()
        return ferrus.Launch(argv=argv), (lambda line: [])

    def emit(message):
        text = message.text or ""
        task = (message.data or {}).get("task_id")
        if message.kind == "agent" and task and "started the " in text:
            slot = "reviewer" if "started the reviewer" in text else \
                "executor" if "started the executor" in text else None
            if slot:
                with lock:
                    started[(task, slot)].append(time.perf_counter())

    runner = ferrus.ParallelRunner(store, emit, active, launcher=launcher)
    stop = threading.Event()
    failure, step_times = [], []
    quiet = threading.Event()          # set while the bench wants idle step times

    def loop():
        try:
            runner.start()
            while not stop.is_set():
                began = time.perf_counter()
                runner.step()
                if quiet.is_set():
                    step_times.append(time.perf_counter() - began)
                stop.wait(HQ_POLL_INTERVAL)
        except Exception as err:  # reported by the main thread
            failure.append("the runner failed: %s: %s" % (type(err).__name__, err))

    def wait_for(what, condition, limit=30):
        deadline = time.monotonic() + limit
        while not condition():
            if failure:
                raise BenchError(failure[0])
            if time.monotonic() > deadline:
                raise BenchError("%s did not happen within %d s" % (what, limit))
            time.sleep(0.001)

    thread = threading.Thread(target=loop, daemon=True, name="bench-parallel-runner")
    thread.start()
    latencies = []
    executor = ferrus.Caller("executor", "executor:bench:0")
    reviewer = ferrus.Caller("supervisor", "supervisor:bench:0")
    try:
        wait_for("%d executors starting" % active,
                 lambda: all(started.get((t, "executor")) for t in tasks), 60)
        wait_for("phase P4 (collect)", lambda: runner.machine.phase == 4)
        # Idle: every task in flight, nothing new in the journal.
        time.sleep(0.5)
        quiet.set()
        time.sleep(50 * HQ_POLL_INTERVAL)
        quiet.clear()
        idle = median(list(step_times))
        task_stores = {task: bench.store(root).for_task(task) for task in tasks}
        for round_no in range(rounds + 1):           # round 0 is a warm-up
            task = tasks[round_no % active]
            task_store = task_stores[task]
            ferrus.op_wait_for_task(task_store, executor)
            time.sleep(random.random() * HQ_POLL_INTERVAL)
            with lock:
                seen = len(started[(task, "reviewer")])
            ferrus.op_submit(task_store, executor, "Done.")
            committed = time.perf_counter()
            wait_for("the reviewer of task %s starting" % task,
                     lambda: len(started[(task, "reviewer")]) > seen, 10)
            if round_no:
                latencies.append(started[(task, "reviewer")][seen] - committed)
            ferrus.op_wait_for_review(task_store, reviewer)
            ferrus.op_reject(task_store, reviewer, "Once more.")
            wait_for("the reviewer stub of task %s" % task, lambda: task in release, 10)
            with lock:
                release.pop(task).set()
            controller = runner.controllers[task]
            wait_for("the reviewer of task %s ending" % task,
                     lambda: controller.slots["reviewer"].process is None, 10)
    finally:
        stop.set()
        thread.join(10)
        runner.shutdown()
        with lock:
            for done in release.values():
                done.set()
    if failure:
        raise BenchError(failure[0])
    return latencies, idle


def fig_hq_reaction_8_active(bench, fig):
    """submit -> the reviewer spawned, with 8 parallel tasks in flight (8 controllers)."""
    if not hasattr(bench.ferrus, "ParallelRunner"):
        fig.na("this ferrus has no parallel tasks", "≤ 50 ms median")
        return
    if shutil.which("git") is None or not hasattr(os, "mkfifo"):
        fig.na("needs git and FIFOs (not on this platform)", "≤ 50 ms median")
        return
    rounds = bench.reps(32, 8)
    latencies, idle = measure_hq_reaction_parallel(bench, PARALLEL_TASKS, rounds)
    med = median(latencies)
    fig.values.update({"active": PARALLEL_TASKS, "median_s": med,
                       "p99_s": percentile(latencies, 99), "idle_step_s": idle,
                       "samples": latencies})
    fig.check("median %s, p99 %s (%d rounds, %d tasks active)" % (
        ms(med), ms(percentile(latencies, 99)), len(latencies), PARALLEL_TASKS),
        "≤ 50 ms median", med <= 0.050)
    fig.info("(one ParallelRunner polls the %d tasks' controllers every %.0f ms, as `ferrus run "
             "--parallel` does; agents are stubs; an idle step over all %d takes %s)" % (
                 PARALLEL_TASKS, HQ_POLL_INTERVAL * 1000, PARALLEL_TASKS, ms(idle)))
    one, one_idle = measure_hq_reaction_parallel(bench, 1, bench.reps(12, 4))
    fig.values.update({"one_active_median_s": median(one), "one_active_idle_step_s": one_idle})
    fig.info("(info) the same with 1 task active: median %s, idle step %s" % (
        ms(median(one)), ms(one_idle)))


def fig_nano_turn(bench, fig):
    """nano's own time per model turn against an instant scripted server (bench/nano.py)."""
    bar = "≤ 5 ms"
    if not hasattr(bench.ferrus, "NanoAgent"):
        fig.na("this ferrus has no nano", bar)
        return
    import nano as nano_bench
    turns = bench.reps(200, 60)
    rows = nano_bench.measure_turns(bench.ferrus, turns)
    fig.values.update({name: round(value, 3) for name, value in rows})
    first_median, all_median, all_mean = [value for _name, value in rows]
    fig.check("mean %.2f ms, median %.2f ms over %d turns (first 50: median %.2f ms)" % (
        all_mean, all_median, max(60, turns), first_median), bar + " per turn",
        all_mean <= nano_bench.BAR_MS)


def fig_repository_graph(bench, fig):
    """`ferrus graph index` of 2,000 generated files, full and after one change, and
    search with ~100,000 definitions (bench/graph.py)."""
    import shutil
    import graph as graph_bench          # bench/graph.py
    if shutil.which("git") is None:
        fig.na("git is not installed", "≤ 2 s / ≤ 200 ms; ≤ 50 ms")
        return
    module = graph_bench.graph_module(bench.ferrus, bench.ferrus_path)
    if module is None:
        fig.na("this ferrus has no repository graph", "≤ 2 s / ≤ 200 ms; ≤ 50 ms")
        return
    options = argparse.Namespace(quick=bench.quick, files=2000, keep=bench.args.keep,
                                 ferrus=bench.ferrus_path)
    rows, values = graph_bench.measure(options, bench.ferrus, module)
    fig.values.update(values)
    for name, measured, bar, ok in rows:
        if ok is None:
            fig.info("(info) %s: %s" % (name, measured))
        else:
            fig.check("%s: %s" % (name, measured), bar, ok)


MEMORY_RECORDS = 1000
MEMORY_WORDS = ("lease heartbeat journal rotation review notes submission merge queue "
                "worktree branch config toml check gate timeout retry backoff capacity "
                "session prompt cache index graph search parser token usage session "
                "notify bell desktop spec milestone outcome archive reset doctor").split()


def _memory_record(index, rng):
    """One generated record of an ended task: one word in four from MEMORY_WORDS (every
    task's vocabulary), the rest from a tail of 5,000 rarer ones (each task's own
    names), a few files, a rejection with notes on every third task."""
    words = lambda count: " ".join(  # noqa: E731
        rng.choice(MEMORY_WORDS) if rng.random() < 0.25 else "name%d" % rng.randrange(5000)
        for _ in range(count))
    files = ["src/pkg%d/mod%d.py" % (rng.randrange(20), rng.randrange(200))
             for _ in range(rng.randrange(1, 6))]
    reviews = [{"verdict": "rejected", "time": "2026-01-01T00:00:00Z", "by": "reviewer",
                "notes": "The %s is wrong: %s." % (words(2), words(20))}] if index % 3 == 0 else []
    return {"id": "t-20260101T%06d-%06x" % (index, index), "kind": "task",
            "title": words(6).capitalize(), "outcome": "merged" if index % 7 else "failed",
            "ended_at": "2026-01-%02dT00:00:00Z" % (1 + index % 28),
            "description": words(60), "files": files, "reviews": reviews,
            "submissions": [{"n": 1, "time": "2026-01-01T00:00:00Z", "summary": words(30)}]}


def fig_project_memory(bench, fig):
    """Project memory with 1,000 ended tasks' records: `ferrus memory rebuild`, a search,
    and the memory section of an executor's prompt (made between create_task and the
    executor's spawn, so on hq_reaction's path)."""
    ferrus = bench.ferrus
    if not hasattr(ferrus, "memory_executor_prompt"):
        fig.na("this ferrus has no project memory", "≤ 50 ms; ≤ 20 ms")
        return
    try:
        ferrus.import_sqlite3("project memory")
    except ferrus.FerrusError as err:
        fig.na(err.message, "≤ 50 ms; ≤ 20 ms")
        return
    root = bench.project("memory")
    store = ferrus.Store(root)
    folder = ferrus.memory_records_dir(store)
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(26)
    for index in range(MEMORY_RECORDS):
        record = _memory_record(index, rng)
        with open(os.path.join(folder, record["id"] + ".json"), "w", encoding="utf-8") as handle:
            json.dump(record, handle)
    started = time.perf_counter()
    ferrus.memory_sync(store, rebuild=True)
    rebuild = time.perf_counter() - started
    status = ferrus.op_memory_status(store, ferrus.HUMAN).data
    if status["records"] != MEMORY_RECORDS:
        raise BenchError("memory holds fewer records than were written: %s" % status)
    queries = ("lease heartbeat", "review notes merge", "src/pkg3/mod17.py", "nothing_like_this")
    searches, cpus = [], []
    for _ in range(bench.reps(11, 3)):
        for query in queries:
            cpu, started = time.process_time(), time.perf_counter()
            ferrus.op_memory_search(store, ferrus.HUMAN, query)
            searches.append(time.perf_counter() - started)
            cpus.append(time.process_time() - cpu)
    supervisor = ferrus.Caller("supervisor", "supervisor:bench:0")
    ferrus.op_create_task(store, supervisor, "Make the lease heartbeat survive a journal "
                          "rotation; see src/pkg3/mod17.py and the review notes.")
    data = store.read_state()
    prompts = []
    for _ in range(bench.reps(21, 5)):
        started = time.perf_counter()
        section = ferrus.memory_executor_prompt(store, data)
        prompts.append(time.perf_counter() - started)
    if "lease" not in section.lower():
        raise BenchError("the executor's memory section names no earlier task: %r" % section)
    search, prompt = median(searches), median(prompts)
    fig.values.update({"records": MEMORY_RECORDS, "backend": status.get("backend"),
                       "rebuild_s": rebuild, "search_s": searches, "search_cpu_s": cpus,
                       "prompt_s": prompts, "prompt_chars": len(section)})
    fig.info("%d records (%s): `memory rebuild` %s" % (MEMORY_RECORDS, status.get("backend"),
                                                       ms(rebuild)))
    fig.check("project_context_search %s (median of %d; CPU %s)" % (
        ms(search), len(searches), ms(median(cpus))), "≤ 50 ms", search <= 0.05)
    fig.check("executor prompt's memory section %s (median of %d, %d characters)" % (
        ms(prompt), len(prompts), len(section)), "≤ 20 ms", prompt <= 0.02)


FIGURES = (
    ("serve_cold_start", fig_serve_cold_start),
    ("status_from_shell", fig_status_from_shell),
    ("status_round_trip", fig_status_round_trip),
    ("create_to_wait", fig_create_to_wait),
    ("hq_reaction", fig_hq_reaction),
    ("checks_parallel", fig_checks_parallel),
    ("check_memory_1gb", fig_check_memory_1gb),
    ("transition_race", fig_transition_race),
    ("full_loop", fig_full_loop),
    ("ping_under_waits", fig_ping_under_waits),
    ("journal_scale", fig_journal_scale),
    ("diff_stat", fig_diff_stat),
    ("parallel_overhead", fig_parallel_overhead),
    ("place_overhead", fig_place_overhead),
    ("hq_reaction_8_active", fig_hq_reaction_8_active),
    ("web_first_paint", fig_web_first_paint),
    ("nano_turn", fig_nano_turn),
    ("repository_graph", fig_repository_graph),
    ("project_memory", fig_project_memory),
)


# ============================================================================
# Output
# ============================================================================

def header(bench):
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    cpus = os.cpu_count() or 0
    return {
        "cpus": cpus,
        "cpus_usable": usable,
        "python": "%s %s" % (platform.python_implementation(), platform.python_version()),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "ferrus": bench.ferrus_path,
        "ferrus_version": getattr(bench.ferrus, "__version__", "?"),
        "mode": "quick" if bench.quick else "full",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def render_table(head, figures):
    cpu = "%d CPUs" % head["cpus"]
    if head["cpus_usable"] and head["cpus_usable"] != head["cpus"]:
        cpu += " (%d usable)" % head["cpus_usable"]
    lines = ["ferrus bench (%s run) — %s, %s, %s" % (head["mode"], cpu, head["python"],
                                                    head["platform"]),
             "ferrus %s at %s" % (head["ferrus_version"], head["ferrus"]), ""]
    rows = [("figure", "measured", "bar", "result")]
    for fig in figures:
        for i, row in enumerate(fig.rows or [{"measured": "", "bar": "", "result": ""}]):
            rows.append((fig.name if i == 0 else "", row["measured"], row["bar"], row["result"]))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    for n, row in enumerate(rows):
        if n == 1 or (n > 1 and row[0]):
            lines.append("  ".join("-" * w for w in widths) + "  ------")
        lines.append("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row[:3]))
                     + "  " + row[3])
    counts = {}
    for fig in figures:
        counts[fig.result] = counts.get(fig.result, 0) + 1
    lines.append("")
    lines.append("figures: " + ", ".join("%d %s" % (counts[k], k) for k in
                                         ("PASS", "MISS", "n.a.", "error", "info") if k in counts))
    return "\n".join(lines)


# ============================================================================
# Main
# ============================================================================

def parse_args(argv):
    names = [name for name, _ in FIGURES]
    parser = argparse.ArgumentParser(
        prog="bench/run.py", description="ferrus benchmark suite (the bars: bench/README.md).",
        epilog="figures: " + ", ".join(names))
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions (a smoke run; bars are still applied)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--only", metavar="NAME[,NAME]",
                        help="run only these figures (comma-separated)")
    parser.add_argument("--ferrus", metavar="PATH", default=DEFAULT_FERRUS,
                        help="the ferrus.py to measure (default: the repo's)")
    parser.add_argument("--sdk-python", metavar="PY",
                        help="an interpreter that has the MCP SDK (skips the scratch venv)")
    parser.add_argument("--sdk-venv", metavar="DIR", default=DEFAULT_SDK_VENV,
                        help="scratch virtualenv for the MCP SDK, created on first use "
                             "(default %(default)s)")
    parser.add_argument("--no-sdk", action="store_true",
                        help="skip the MCP SDK comparisons (reported as n.a.)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary projects (their path is printed)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a figure misses its bar or fails")
    args = parser.parse_args(argv)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            parser.error("unknown figure(s) %s; choose from %s"
                         % (", ".join(unknown), ", ".join(names)))
        args.selected = [n for n in names if n in wanted]
    else:
        args.selected = names
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    args = parse_args(argv)
    # Users' ferrus starts from cached bytecode (the launcher, `python -m`, the boot
    # code `register` writes); a shell that forbids writing it would measure a cold
    # compile of ferrus.py on every start instead.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    path = os.path.abspath(args.ferrus)
    try:
        with open(path, encoding="utf-8") as handle:
            if any(line.strip() == "#@@TOML@@" for line in handle):
                progress("%s still holds the #@@TOML@@ placeholder and cannot be imported; "
                         "point --ferrus at a copy with the TOML section filled in" % path)
                return 2
    except OSError as err:
        progress("cannot read %s: %s" % (path, err))
        return 2
    for sig in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, _raise_interrupt)
    bench = None
    try:
        try:
            bench = Bench(args)
        except Exception as err:
            progress("cannot load %s: %s: %s" % (path, type(err).__name__, err))
            return 2
        figures = []
        functions = dict(FIGURES)
        for number, name in enumerate(args.selected, 1):
            progress("[%d/%d] %s" % (number, len(args.selected), name))
            fig = Figure(name)
            started = time.perf_counter()
            try:
                functions[name](bench, fig)
            except (McpFailure, BenchError) as err:
                fig.fail(str(err))
            except Exception as err:
                fig.fail("%s: %s" % (type(err).__name__, err))
            fig.seconds = time.perf_counter() - started
            # A figure must not leave processes behind for the next one.
            bench.registry.kill_all()
            figures.append(fig)
        head = header(bench)
        if args.json:
            print(json.dumps({"header": head, "figures": [f.to_json() for f in figures]},
                             indent=2))
        else:
            print(render_table(head, figures))
        if args.keep:
            progress("temporary projects kept in %s" % bench.tmp)
        if args.strict and any(f.result in ("MISS", "error") for f in figures):
            return 1
        return 0
    except KeyboardInterrupt:
        progress("interrupted; stopping child processes")
        return 130
    finally:
        if bench is not None:
            bench.cleanup()


if __name__ == "__main__":
    sys.exit(main())
