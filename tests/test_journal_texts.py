"""The journal carries the texts of a task's story, bounded: the title at create_task, the
summary at submit, the notes at reject, human_reject, integration_failed and approve.

SUBMISSION.md and REVIEW.md hold only the last of each; the journal keeps them all, so
project memory can be rebuilt from it.  `ferrus log` leaves the texts out of its lines
(they can be long); `ferrus log --json` has them."""

import json

import ferrus
from conftest import run_cli, set_config

S = ferrus.S
EXECUTOR = ferrus.Caller("executor", "executor:test:1")
REVIEWER = ferrus.Caller("supervisor", "supervisor:test:1")


def entry(store, event):
    """The last journal entry of ``event``."""
    return [e for e in store.read_journal() if e["event"] == event][-1]


def reviewing(store, summary="Parsed the flags; tests added."):
    ferrus.op_submit(store, EXECUTOR, summary)
    assert store.read_state().state == S.REVIEWING


def test_each_step_of_a_task_journals_its_text(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "# Parse --verbose\n\nAnd --quiet too.")
    assert entry(store, "create_task")["detail"]["title"] == "Parse --verbose"
    reviewing(store, "First try: --verbose only.")
    assert entry(store, "submit")["detail"]["text"] == "First try: --verbose only."
    ferrus.op_reject(store, REVIEWER, "  --quiet is missing.\n")
    assert entry(store, "reject")["detail"]["text"] == "--quiet is missing."
    reviewing(store, "Both flags now.")
    ferrus.op_approve(store, REVIEWER, "Both flags work; the tests cover them.")
    submits = [e["detail"]["text"] for e in store.read_journal() if e["event"] == "submit"]
    # Both summaries are kept, though SUBMISSION.md holds only the last.
    assert submits == ["First try: --verbose only.", "Both flags now."]
    assert entry(store, "approve")["detail"]["text"] == "Both flags work; the tests cover them."
    assert store.read_state().state == S.COMPLETE


def test_an_approval_without_notes_journals_no_text(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "Tidy the README.")
    reviewing(store)
    ferrus.op_approve(store, REVIEWER)
    assert "text" not in entry(store, "approve")["detail"]


def test_a_humans_rejection_journals_its_notes(store, project):
    set_config(project, "[hq]\nhuman_review = true\n")
    ferrus.op_create_task(store, ferrus.HUMAN, "Rename the widget.")
    reviewing(store)
    ferrus.op_approve(store, REVIEWER, "Looks right.")
    assert entry(store, "approve")["detail"]["text"] == "Looks right."
    ferrus.op_human_reject(store, ferrus.HUMAN, "The old name is still in the docs.")
    assert entry(store, "human_reject")["detail"]["text"] == "The old name is still in the docs."


def test_a_long_text_is_cut_to_the_journal_limit(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "Write the report.")
    long_summary = "x" * (ferrus.JOURNAL_TEXT_CHARS * 3)
    reviewing(store, long_summary)
    text = entry(store, "submit")["detail"]["text"]
    assert len(text) == ferrus.JOURNAL_TEXT_CHARS and text.endswith("…")
    # The file still has the whole summary for the reviewer.
    assert store.read_file("SUBMISSION.md") == long_summary


def test_ferrus_log_leaves_the_texts_out_and_log_json_has_them(store, project):
    ferrus.op_create_task(store, ferrus.HUMAN, "Add the flag.")
    reviewing(store, "SUMMARY-MARK added the flag.")
    ferrus.op_reject(store, REVIEWER, "NOTES-MARK the flag has no test.")
    plain = run_cli("log", cwd=project)
    assert plain.returncode == 0, plain.stderr
    reject_line = next(line for line in plain.stdout.splitlines() if " reject " in line)
    assert "review_cycles=1" in reject_line
    assert "NOTES-MARK" not in plain.stdout and "SUMMARY-MARK" not in plain.stdout
    as_json = run_cli("log", "--json", cwd=project)
    assert as_json.returncode == 0, as_json.stderr
    entries = [json.loads(line) for line in as_json.stdout.splitlines() if line.strip()]
    by_event = {e["event"]: e for e in entries}
    assert by_event["reject"]["detail"]["text"] == "NOTES-MARK the flag has no test."
    assert by_event["submit"]["detail"]["text"] == "SUMMARY-MARK added the flag."
