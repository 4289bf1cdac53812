"""Child process for the check-runner figures: runs ``ferrus.run_checks`` once.

    python checks_child.py FERRUS_PY '{"root": ..., "commands": [...], "parallel": false}'

Prints one JSON object: wall time, per-command results and this process's
memory before and after the run (``ru_maxrss`` and, on Linux, VmRSS/VmHWM
with the high-water mark reset just before the run), so the parent can tell
how much the check runner itself grew while a command streamed its output.

SIGTERM / SIGINT cancel the run through ``run_checks(cancel=...)``, which kills
the command's process group, so an interrupted bench leaves nothing behind.
"""

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcpclient import load_ferrus  # noqa: E402


def maxrss_kib():
    try:
        import resource
    except ImportError:  # Windows
        return None
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value // 1024 if sys.platform == "darwin" else value   # macOS reports bytes


def proc_status_kib(field):
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_hwm():
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def main(argv):
    ferrus = load_ferrus(argv[1])
    spec = json.loads(argv[2])
    cancel = threading.Event()

    def on_signal(signum, frame):
        cancel.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    checks = ferrus.ChecksConfig(commands=list(spec["commands"]),
                                 parallel=bool(spec.get("parallel", False)),
                                 timeout_secs=int(spec.get("timeout", 600)))
    log_dir = os.path.join(spec["root"], ".ferrus", "logs")
    # Warm up what a first run would pay for once (thread start, imports inside
    # subprocess), so the memory figure measures streaming, not first use.
    ferrus.run_checks(spec["root"], ferrus.ChecksConfig(commands=["true"]), log_dir,
                      keep_lines=int(spec.get("keep_lines", 30)))
    rss_before = proc_status_kib("VmRSS")
    maxrss_before = maxrss_kib()
    hwm_reset = reset_hwm()
    started = time.perf_counter()
    run = ferrus.run_checks(spec["root"], checks, log_dir,
                            keep_lines=int(spec.get("keep_lines", 30)), cancel=cancel)
    wall = time.perf_counter() - started
    out = {
        "wall": wall,
        "passed": run.passed,
        "cancelled": run.cancelled,
        "results": [{"command": r.command[:80], "status": r.status, "exit_code": r.exit_code,
                     "duration": r.duration, "line_count": r.line_count,
                     "log": r.log_path_abs} for r in run.results],
        "maxrss_before_kib": maxrss_before,
        "maxrss_after_kib": maxrss_kib(),
        "rss_before_kib": rss_before,
        "hwm_after_kib": proc_status_kib("VmHWM") if hwm_reset else None,
    }
    if spec.get("delete_logs"):
        for result in run.results:
            try:
                os.unlink(result.log_path_abs)
            except OSError:
                pass
    sys.stdout.write(json.dumps(out) + "\n")
    return 0 if not run.cancelled else 130


if __name__ == "__main__":
    sys.exit(main(sys.argv))
