"""`ferrus status` on a task made from a spec milestone says what approval does to the
milestone's box — or did: after Complete it is ticked already, after Failed it is not."""

import pytest

import ferrus
from conftest import run_cli

S = ferrus.S


def put(store, state):
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.task_id = state, "t-1"
        data.task_milestone, data.task_spec = "m1.0", "docs/specs/demo.md"
        if state == S.FAILED:
            data.failure_reason = "Task rejected 3 times without resolution."
        tx.set(data, "test_state")


@pytest.mark.parametrize("state, note", [
    (S.EXECUTING, "approving ticks it"),
    (S.COMPLETE, "ticked when it was approved"),
    (S.FAILED, "not ticked: the task failed"),
])
def test_the_task_from_row_matches_the_state(store, project, state, note):
    put(store, state)
    out = run_cli("status", cwd=project).stdout
    row = next(line for line in out.splitlines() if "task from" in line)
    assert row.strip() == "task from  milestone m1.0 of docs/specs/demo.md (%s)" % note
