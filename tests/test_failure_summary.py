"""A task that failed on its check retries says why in one line — `ferrus status`, a
refused `ferrus run --task` — with the failing commands, not a line ending "Last failure:"."""

import ferrus
from conftest import run_cli

S = ferrus.S


def fail_on_checks(store):
    reason = ferrus.t_check_failed(ferrus.StateData(state=S.EXECUTING), ferrus.utc_now(),
                                   "Commands failed: python3 -m pytest -q", 1).failure_reason
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.failure_reason = S.FAILED, reason
        tx.set(data, "test_fail")
    return reason


def test_the_summary_joins_a_line_that_ends_in_a_colon_with_the_next():
    assert ferrus.failure_summary("Check failed 2 consecutive times. Last failure:\n"
                                  "Commands failed: a, b\n") == \
        "Check failed 2 consecutive times. Last failure: Commands failed: a, b"
    assert ferrus.failure_summary("Task rejected 3 times without resolution.") == \
        "Task rejected 3 times without resolution."
    assert ferrus.failure_summary(None) == ferrus.failure_summary("  \n") == "no reason recorded"


def test_status_and_a_refused_run_name_the_failing_commands(store, project):
    reason = fail_on_checks(store)
    assert reason.splitlines()[0].endswith("Last failure:")      # what is recorded
    status = run_cli("status", cwd=project)
    assert "Last failure: Commands failed: python3 -m pytest -q" in status.stdout
    refused = run_cli("run", "--task", "again", cwd=project)
    assert refused.returncode == 1
    assert "the last task failed: Check failed 1 consecutive times. Last failure: " \
        "Commands failed: python3 -m pytest -q" in refused.stderr
    assert store.read_state().state == S.FAILED
