#!/usr/bin/env python3
"""Run ferrus's test suite split across processes: what `make test` runs.

Most of the suite's time is ferrus processes the tests start and wait for, so one
pytest leaves cores idle.  This splits the test files into as many groups as there are
jobs (`--jobs N`, FERRUS_TEST_JOBS, default: the CPUs, at most 4), balanced by the
times in tests/durations.json (a file not in it counts as the average), runs one
`python -m pytest -q` per group at once, relays each one's lines as they come
(prefixed with its number), and ends with one summary.  Files that share a machine-wide
resource (the places harness's local user and sshd) stay in one group.

The exit status is pytest's: 0 when every group passed, 1 when a test failed, 5 when no
group collected a test at all (a group that selects nothing with -k is not a failure
while another ran tests), the worst other status otherwise.  Extra arguments go to
every pytest; when they name test paths, one pytest runs them as given, unsplit.

    python tools/run_tests.py [--jobs N] [--record] [pytest arguments...]

--record rewrites tests/durations.json from this run's per-file times (run it after
adding slow tests; the split stays balanced without it, only less evenly).
Standard library only, like ferrus.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
DURATIONS = os.path.join(TESTS, "durations.json")
# Files that must not run at the same time as each other: they set up one machine-wide
# thing (a local user, its home, sshd's host keys) the others also use.
SHARED_MARKERS = ("places_harness",)
MAX_DEFAULT_JOBS = 4
COUNT_WORDS = ("failed", "passed", "skipped", "xfailed", "xpassed", "error", "errors",
               "deselected", "warning", "warnings")


def test_files():
    return sorted(name for name in os.listdir(TESTS)
                  if name.startswith("test_") and name.endswith(".py"))


def read_durations():
    try:
        with open(DURATIONS, encoding="utf-8") as handle:
            data = json.load(handle)
        return {name: float(value) for name, value in data.items()
                if isinstance(value, (int, float))}
    except (OSError, ValueError, AttributeError):
        return {}


def shares_machine(name):
    with open(os.path.join(TESTS, name), encoding="utf-8") as handle:
        text = handle.read()
    return any(marker in text for marker in SHARED_MARKERS)


def split(files, jobs, durations):
    """Groups of files with about equal total time (longest first onto the lightest
    group); the files that share the machine travel as one unit."""
    known = [durations[name] for name in files if name in durations]
    default = sum(known) / len(known) if known else 1.0
    weight = {name: durations.get(name, default) for name in files}
    shared = [name for name in files if shares_machine(name)]
    units = [[name] for name in files if name not in shared]
    if shared:
        units.append(shared)
    units.sort(key=lambda unit: -sum(weight[name] for name in unit))
    groups = [[] for _ in range(max(1, min(jobs, len(units))))]
    loads = [0.0] * len(groups)
    for unit in units:
        lightest = loads.index(min(loads))
        groups[lightest].extend(unit)
        loads[lightest] += sum(weight[name] for name in unit)
    return [sorted(group) for group in groups if group]


# pytest options whose value is the next argument (that value is not a test path).
VALUE_OPTIONS = {"-k", "-m", "-p", "-W", "-o", "-c", "--tb", "--durations", "--maxfail",
                 "--basetemp", "--rootdir", "--deselect", "--ignore", "--ignore-glob",
                 "--junitxml", "--log-level", "--timeout", "--confcutdir"}


def names_paths(args):
    """Do the pytest arguments name tests to run (a path or a node id)?"""
    value_next = False
    for arg in args:
        if value_next or arg.startswith("-"):
            value_next = arg in VALUE_OPTIONS
            continue
        if "::" in arg or os.path.exists(arg) or os.path.exists(os.path.join(ROOT, arg)):
            return True
    return False


def default_jobs():
    wanted = os.environ.get("FERRUS_TEST_JOBS", "").strip()
    if wanted:
        return jobs_number(wanted, "FERRUS_TEST_JOBS")
    return max(1, min(os.cpu_count() or 1, MAX_DEFAULT_JOBS))


def jobs_number(text, where):
    if not text.isdigit() or int(text) < 1:
        sys.stderr.write("run_tests.py: %s must be a whole number of at least 1, not %r "
                         "(1 runs one plain pytest)\n" % (where, text))
        raise SystemExit(4)            # pytest's status for a usage error
    return int(text)


class Group:
    def __init__(self, number, files, args, record):
        self.number = number
        self.files = files
        argv = [sys.executable, "-m", "pytest", "-q"] + \
            [os.path.join("tests", name) for name in files] + list(args)
        if record:
            argv += ["--durations=0", "--durations-min=0"]
        self.lines = []
        self.status = None
        kwargs = {"start_new_session": True} if os.name == "posix" else {}
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, **kwargs)

    def relay(self, out, lock, prefix):
        for raw in iter(self.process.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            with lock:
                out.write("%s%s\n" % (prefix, line))
                out.flush()
        self.status = self.process.wait()

    def stop(self):
        if self.process.poll() is None:
            try:
                if os.name == "posix":
                    os.killpg(self.process.pid, signal.SIGINT)
                else:
                    self.process.terminate()
            except OSError:
                pass


def counts(lines):
    """{word: n} from a pytest -q run's last summary line ("3 failed, 10 passed in 4s")."""
    for line in reversed(lines):
        if re.search(r"\bin [0-9.]+s\b", line) and re.search(r"\d+ \w+", line):
            found = {}
            for number, word in re.findall(r"(\d+) (\w+)", line):
                if word in COUNT_WORDS:
                    word = {"errors": "error", "warnings": "warning"}.get(word, word)
                    found[word] = found.get(word, 0) + int(number)
            return found
    return {}


def file_times(lines):
    """{file: seconds} from --durations=0 output (setup, call and teardown summed)."""
    times = {}
    for line in lines:
        match = re.match(r"\s*([0-9.]+)s (?:setup|call|teardown)\s+tests/([^:]+\.py)::", line)
        if match:
            times[match.group(2)] = times.get(match.group(2), 0.0) + float(match.group(1))
    return times


def combined_status(groups, totals):
    statuses = [group.status for group in groups]
    if any(status == 1 for status in statuses):
        return 1
    worse = [status for status in statuses if status not in (0, 1, 5)]
    if worse:
        return max(worse)
    ran = sum(totals.get(word, 0) for word in ("passed", "failed", "skipped", "xfailed",
                                               "xpassed", "error"))
    return 5 if ran == 0 else 0


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    jobs, record = None, False
    while args and args[0] in ("--jobs", "-j", "--record") or \
            (args and args[0].startswith("--jobs=")):
        option = args.pop(0)
        if option == "--record":
            record = True
        elif option.startswith("--jobs="):
            jobs = jobs_number(option.split("=", 1)[1], "--jobs")
        else:
            jobs = jobs_number(args.pop(0) if args else "", option)
    jobs = default_jobs() if jobs is None else jobs
    if names_paths(args) or jobs <= 1:
        command = [sys.executable, "-m", "pytest", "-q"] + \
            ([] if names_paths(args) else ["tests"]) + args
        return subprocess.call(command, cwd=ROOT)
    groups_files = split(test_files(), jobs, read_durations())
    started = time.monotonic()
    sys.stdout.write("tests: %d files in %d groups run at once (tools/run_tests.py)\n"
                     % (sum(map(len, groups_files)), len(groups_files)))
    sys.stdout.flush()
    lock = threading.Lock()
    groups = [Group(number, files, args, record)
              for number, files in enumerate(groups_files, 1)]
    threads = [threading.Thread(target=group.relay,
                                args=(sys.stdout, lock, "[%d] " % group.number))
               for group in groups]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except KeyboardInterrupt:
        for group in groups:
            group.stop()
        for thread in threads:
            thread.join(30)
        sys.stdout.write("tests: interrupted\n")
        return 2
    totals = {}
    for group in groups:
        for word, number in counts(group.lines).items():
            totals[word] = totals.get(word, 0) + number
    status = combined_status(groups, totals)
    order = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "error",
             "warning")
    words = ", ".join("%d %s" % (totals[word], word) for word in order if totals.get(word))
    sys.stdout.write("tests: %s in %.1fs (%d groups; exit %d)\n" % (
        words or "no tests ran", time.monotonic() - started, len(groups), status))
    if record and status == 0:
        times = {}
        for group in groups:
            times.update(file_times(group.lines))
        with open(DURATIONS, "w", encoding="utf-8") as handle:
            json.dump({name: round(times.get(name, 0.0), 1) for name in test_files()},
                      handle, indent=1, sort_keys=True)
            handle.write("\n")
        sys.stdout.write("tests: wrote %s\n" % os.path.relpath(DURATIONS, ROOT))
    return status


if __name__ == "__main__":
    sys.exit(main())
