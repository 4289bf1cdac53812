"""`ferrus status` in AwaitingHuman shows the question and where to answer it; in
AwaitingConfirmation, what gives the human's word."""

import ferrus
from conftest import run_cli

EXE = ferrus.Caller("executor", "executor:test:1")


def test_status_says_how_to_confirm(store, project):
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.task_id = ferrus.S.AWAITING_CONFIRMATION, "t-1"
        tx.set(data, "test_state")
    out = run_cli("status", cwd=project).stdout
    assert "your word  the reviewer approved: `ferrus approve`, or `ferrus reject NOTES`" in out
