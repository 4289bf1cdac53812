"""The supervisor's answer to a consultation reaches HQ and `ferrus run` even when the
waiting executor has already taken it: wait_for_consult empties CONSULT_RESPONSE.md in
the same moment, so the answer shown comes from the journal entry, not the file."""

import ferrus

EXE = ferrus.Caller("executor", "executor:test:1")
SUP = ferrus.Caller("supervisor", "supervisor:test:1")
QUESTION = "## Problem\nx\n## What I tried\ny\n## Options (if any)\nA or B\n## Question\nWhich?"


def test_the_answer_is_shown_after_the_executor_took_it(store):
    shown = []
    controller = ferrus.HqController(store, emit=shown.append)      # HQ watching
    ferrus.op_create_task(store, ferrus.HUMAN, "Make work.txt")
    ferrus.op_wait_for_task(store, EXE)
    ferrus.op_consult(store, EXE, QUESTION)
    ferrus.op_respond_consult(store, SUP, "Use option A.\n\nBecause B is slower.")
    ferrus.op_wait_for_consult(store, EXE)            # takes the answer and empties the file
    assert store.read_file("CONSULT_RESPONSE.md") == ""
    controller.drain_journal()                        # HQ reads the entries only now
    answers = [m for m in shown if m.event == "consult_answer"]
    assert [m.text for m in answers] == [
        "the supervisor answers:\n  Use option A.\n  Because B is slower."]
    assert answers[0].data["answer"] == "Use option A.\nBecause B is slower."
    # `ferrus log` keeps its one line per entry: the answer's text is not in it.
    entry = next(e for e in store.read_journal() if e["event"] == "respond_consult")
    assert "said" in entry["detail"] and "said=" not in ferrus.format_event(entry)
