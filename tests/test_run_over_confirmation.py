"""`ferrus run --task` over a task that waits for the human's confirmation says what the
human can do (approve, reject, reset), not only `ferrus run --resume`."""

import ferrus
from conftest import run_cli

S = ferrus.S


def test_the_refusal_names_approve_and_reject(store, project):
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.task_id = S.AWAITING_CONFIRMATION, "t-1"
        tx.set(data, "test_state")
    result = run_cli("run", "--task", "another", cwd=project)
    assert result.returncode == 1
    assert "a task is already in flight (state AwaitingConfirmation): the reviewer approved " \
        "it and it waits for your word" in result.stderr
    assert "hint: `ferrus approve` completes it, `ferrus reject NOTES` sends it back" \
        in result.stderr
    assert store.read_state().state == S.AWAITING_CONFIRMATION
