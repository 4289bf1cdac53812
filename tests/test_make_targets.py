"""The Makefile's targets as a developer meets them: `make test` without pytest says how
to install it instead of failing with Python's bare "No module named pytest", and runs the
suite split across processes (tools/run_tests.py)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_without_pytest_says_how_to_install_it():
    # -S hides site-packages, so this interpreter has no pytest.
    result = subprocess.run(["make", "-s", "-C", REPO, "test", "PYTHON=%s -S" % sys.executable],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "pytest is not installed" in result.stderr
    assert "-m pip install pytest" in result.stderr


# -- tools/run_tests.py: the suite split across processes (what `make test` runs) ---------

sys.path.insert(0, os.path.join(REPO, "tools"))
import run_tests  # noqa: E402


def test_the_split_balances_the_groups_by_time_and_keeps_machine_wide_files_together(
        monkeypatch):
    files = ["test_a.py", "test_b.py", "test_c.py", "test_d.py", "test_places_1.py",
             "test_places_2.py", "test_new.py"]
    monkeypatch.setattr(run_tests, "shares_machine", lambda name: "places" in name)
    durations = {"test_a.py": 100, "test_b.py": 60, "test_c.py": 40, "test_d.py": 10,
                 "test_places_1.py": 30, "test_places_2.py": 20}
    groups = run_tests.split(files, 2, durations)
    assert sorted(sum(groups, [])) == sorted(files)          # every file once
    together = [group for group in groups if "test_places_1.py" in group]
    assert "test_places_2.py" in together[0]
    weight = lambda group: sum(durations.get(name, 260 / 6) for name in group)  # noqa: E731
    assert abs(weight(groups[0]) - weight(groups[1])) <= 60
    assert run_tests.split(files, 1, durations) == [sorted(files)]
    assert len(run_tests.split(["test_a.py"], 4, durations)) == 1


def test_the_groups_status_is_one_pytest_would_give():
    def groups(*statuses):
        return [type("G", (), {"status": status})() for status in statuses]

    assert run_tests.combined_status(groups(0, 0), {"passed": 3}) == 0
    assert run_tests.combined_status(groups(0, 1), {"passed": 3, "failed": 1}) == 1
    # -k selecting nothing in one group is not a failure while another ran tests ...
    assert run_tests.combined_status(groups(0, 5), {"passed": 1, "deselected": 9}) == 0
    # ... but no test run anywhere is pytest's 5, a failure.
    assert run_tests.combined_status(groups(5, 5), {"deselected": 9}) == 5
    assert run_tests.combined_status(groups(0, 2), {"passed": 3}) == 2     # interrupted
    assert run_tests.counts(["....", "2 failed, 10 passed, 1 skipped in 4.20s"]) == {
        "failed": 2, "passed": 10, "skipped": 1}


def run_split(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "run_tests.py"),
                           "--jobs", "2"] + list(args),
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def test_the_split_suite_runs_each_group_and_sums_them_up():
    done = run_split("-k", "test_boot_code_loads_this_file or test_a_class_made_a_deferred")
    assert done.returncode == 0, done.stdout[-2000:]
    assert "in 2 groups" in done.stdout
    assert re.search(r"^tests: 2 passed, \d+ deselected in [0-9.]+s \(2 groups; exit 0\)$",
                     done.stdout, re.M), done.stdout[-1000:]
    assert re.search(r"^\[1\] ", done.stdout, re.M) and re.search(r"^\[2\] ", done.stdout, re.M)


def test_the_split_suite_with_nothing_selected_fails_as_pytest_does():
    done = run_split("-k", "no_test_is_called_this_anywhere")
    assert done.returncode == 5, done.stdout[-2000:]
    assert "no tests ran" in done.stdout or "deselected" in done.stdout


def test_a_bad_number_of_groups_is_a_usage_error_that_names_it():
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "run_tests.py")],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=dict(os.environ, FERRUS_TEST_JOBS="two"))
    assert done.returncode == 4
    assert "FERRUS_TEST_JOBS must be a whole number of at least 1, not 'two'" in done.stderr
    assert run_split("--jobs", "0").returncode == 4
