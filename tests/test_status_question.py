"""`ferrus status` in AwaitingHuman shows the question and where to answer it; in
AwaitingConfirmation, what gives the human's word."""

import ferrus
from conftest import run_cli

EXE = ferrus.Caller("executor", "executor:test:1")


def test_status_shows_the_pending_question(store, project):
    ferrus.op_create_task(store, ferrus.HUMAN, "Make work.txt")
    ferrus.op_wait_for_task(store, EXE)
    ferrus.op_ask_human(store, EXE, "Which colour should the button be?\n\nBlue or red.")
    out = run_cli("status", cwd=project).stdout
    rows = [line.strip() for line in out.splitlines()]
    assert "question  Which colour should the button be?" in rows
    assert "Blue or red." in rows
    assert "answer  in HQ (`ferrus`), or `ferrus run --resume` in a terminal" in rows


def test_status_says_how_to_confirm(store, project):
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.task_id = ferrus.S.AWAITING_CONFIRMATION, "t-1"
        tx.set(data, "test_state")
    out = run_cli("status", cwd=project).stdout
    assert "your word  the reviewer approved: `ferrus approve`, or `ferrus reject NOTES`" in out
