"""[hq] human_review: the reviewer's approval waits for the human's confirmation.

The state AwaitingConfirmation sits between the reviewer's approve and Complete; only
the human leaves it (`ferrus approve` / `ferrus reject NOTES`, /approve and /reject in
HQ, the prompt of an interactive `ferrus run`).  Scripted agents (tests/scripted_agent.py)
play both roles where the whole loop runs.
"""

import io
import json
import os
import shutil
import threading

import pytest

import ferrus
from conftest import SCRIPTED_CONFIG, git, run_cli, scripted_project, set_config, write
from mcp_client import InProcessMcp, tool_text
from test_hq import moves, run

S = ferrus.S
HUMAN_REVIEW = "[hq]\nhuman_review = true\n"
EXECUTOR = ferrus.Caller("executor", "executor:test:1")
REVIEWER = ferrus.Caller("supervisor", "supervisor:test:1")


def to_reviewing(store, task="Build the widget."):
    """A task submitted for review (no check commands: the gate passes)."""
    ferrus.op_create_task(store, ferrus.HUMAN, task)
    ferrus.op_submit(store, EXECUTOR, "Built it; tests added.")
    assert store.read_state().state == S.REVIEWING


def awaiting(store, notes="Checked the tests and the edge cases."):
    to_reviewing(store)
    outcome = ferrus.op_approve(store, REVIEWER, notes)
    assert outcome.data["state"] == "AwaitingConfirmation"
    return outcome


def events(store):
    return [(e["event"], e["actor"].partition("/")[0], e["from"], e["to"])
            for e in store.read_journal() if e["event"] not in ("claim", "heartbeat", "session")]


# -- configuration and the table ----------------------------------------------------------

def test_the_key_is_off_by_default_and_validated():
    assert ferrus.parse_config("").human_review is False
    assert ferrus.parse_config(HUMAN_REVIEW).human_review is True
    assert ferrus.parse_config(HUMAN_REVIEW).unknown_keys == []
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.parse_config('[hq]\nhuman_review = "yes"\n')
    assert "[hq.human_review] must be true or false" in err.value.message
    assert 'got "yes" (a string)' in err.value.message
    problems = []
    ferrus.parse_config("[hq]\nhuman_review = 1\n", problems=problems)
    assert [p.message for p in problems] == [
        "ferrus.toml: [hq.human_review] must be true or false, got 1 (an integer)"]


def test_doctor_names_a_bad_human_review(project):
    set_config(project, '[hq]\nhuman_review = "yes"\n')
    report = run_cli("doctor", cwd=project)
    assert report.returncode == 1
    assert '[hq.human_review] must be true or false, got "yes" (a string)' in report.stdout


def test_the_transition_table_names_the_human_steps():
    rows = {action: (froms, to) for action, froms, to in ferrus.TRANSITIONS}
    assert rows["human_approve"][0] == (S.AWAITING_CONFIRMATION,)
    assert rows["human_reject"][0] == (S.AWAITING_CONFIRMATION,)
    assert "AwaitingConfirmation" in rows["approve"][1]
    assert S.AWAITING_CONFIRMATION in ferrus.ACTIVE_STATES
    assert S.AWAITING_CONFIRMATION not in ferrus.LEASE_STATES
    assert S.AWAITING_CONFIRMATION in ferrus.ALLOWED_FROM["force_reset"]


def test_a_human_rejection_counts_as_a_review_cycle_and_fails_at_the_limit():
    data = ferrus.StateData(state=S.AWAITING_CONFIRMATION, review_cycles=1, check_retries=4)
    back = ferrus.t_human_reject(data, ferrus.utc_now(), 3)
    assert (back.state, back.review_cycles, back.check_retries) == (S.ADDRESSING, 2, 0)
    assert data.state == S.AWAITING_CONFIRMATION, "transitions are pure"
    failed = ferrus.t_human_reject(data, ferrus.utc_now(), 2)
    assert failed.state == S.FAILED and failed.review_cycles == 2
    assert failed.failure_reason == "Task rejected 2 times without resolution."


# -- the operations ---------------------------------------------------------------------------

def test_approve_waits_for_the_human_then_human_approve_completes(store, project):
    set_config(project, HUMAN_REVIEW)
    outcome = awaiting(store)
    assert "a human confirms or rejects it now" in outcome.text
    data = store.read_state()
    assert data.state == S.AWAITING_CONFIRMATION and data.claimed_by is None
    assert store.read_file(ferrus.APPROVAL_FILE) == "Checked the tests and the edge cases."
    summary = ferrus.confirmation_summary(store)
    for part in ("Build the widget.", "Built it; tests added.", "approved by supervisor:test:1",
                 "Checked the tests and the edge cases.", "ferrus approve", "ferrus reject NOTES",
                 "review cycles used 0/3"):
        assert part in summary
    done = ferrus.op_human_approve(store, ferrus.HUMAN, via="hq")
    assert done.data["state"] == "Complete"
    entry = store.read_journal(limit=1)[0]
    assert (entry["event"], entry["actor"], entry["from"], entry["to"]) == (
        "human_approve", "human", "AwaitingConfirmation", "Complete")
    assert entry["detail"]["by"] == ferrus.human_name() and entry["detail"]["via"] == "hq"


def test_human_reject_sends_the_notes_to_the_executor_and_counts(store, project):
    set_config(project, HUMAN_REVIEW)
    awaiting(store)
    outcome = ferrus.op_human_reject(store, ferrus.HUMAN, "Handle the empty widget too.")
    assert outcome.data == {"message": outcome.text, "state": "Addressing", "review_cycles": 1}
    assert store.read_file("REVIEW.md") == "Handle the empty widget too."
    claimed = json.loads(ferrus.op_wait_for_task(store, EXECUTOR).text)
    assert (claimed["state"], claimed["review"]) == ("Addressing", "Handle the empty widget too.")
    assert events(store)[-1] == ("human_reject", "human", "AwaitingConfirmation", "Addressing")
    # The next round waits for the human again, with the counter carried.
    ferrus.op_submit(store, EXECUTOR, "Empty widgets handled.")
    ferrus.op_approve(store, REVIEWER)
    assert store.read_state().state == S.AWAITING_CONFIRMATION
    summary = ferrus.confirmation_summary(store)
    assert "(no notes given)" in summary
    assert "review cycles used 1/3" in summary
    assert "## The last rejection's notes" in summary
    assert "Handle the empty widget too." in summary


def test_a_blocked_wait_for_task_gets_the_task_when_the_human_rejects(store, project):
    set_config(project, HUMAN_REVIEW + "\n[limits]\nwait_timeout_secs = 30\n")
    awaiting(store)
    results = []
    waiting = threading.Thread(target=lambda: results.append(
        json.loads(ferrus.op_wait_for_task(ferrus.Store(str(project)), EXECUTOR).text)))
    waiting.start()
    ferrus.op_human_reject(store, ferrus.HUMAN, "Rename it.")
    waiting.join(30)
    assert results and results[0]["status"] == "claimed"
    assert (results[0]["state"], results[0]["review"]) == ("Addressing", "Rename it.")


def test_a_human_approval_counts_as_a_completed_task_for_the_capacity_gate(store, project):
    set_config(project, HUMAN_REVIEW)
    controller = ferrus.HqController(store, emit=lambda message: None)
    awaiting(store)
    controller.drain_journal()
    assert controller.tasks_completed == 0
    ferrus.op_human_approve(store, ferrus.HUMAN)
    controller.drain_journal()
    assert controller.tasks_completed == 1


def test_the_confirmation_shows_the_diff_stat(store, project):
    set_config(project, HUMAN_REVIEW)
    git(project, "init", "-q")
    write(project, "widget.py", "one\n")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "start")
    ferrus.op_create_task(store, ferrus.HUMAN, "Grow the widget.")
    with open(os.path.join(str(project), "widget.py"), "a") as handle:
        handle.write("two\nthree\n")
    ferrus.op_submit(store, EXECUTOR, "Two lines more.")
    ferrus.op_approve(store, REVIEWER)
    summary = ferrus.confirmation_summary(store)
    assert "## Changes" in summary
    assert "widget.py |" in summary and "1 file changed, 2 insertions(+)" in summary


def test_without_git_the_confirmation_says_why_there_is_no_diff(store, project):
    set_config(project, HUMAN_REVIEW)
    awaiting(store)
    assert "## Changes\nNo diff: " in ferrus.confirmation_summary(store)


def test_the_last_allowed_rejection_is_announced_and_fails_the_task(store, project):
    set_config(project, HUMAN_REVIEW + "\n[limits]\nmax_review_cycles = 1\n")
    awaiting(store)
    assert "a rejection now fails the task" in ferrus.confirmation_summary(store)
    outcome = ferrus.op_human_reject(store, ferrus.HUMAN, "Not what I asked for.")
    assert outcome.data["state"] == "Failed" and "ferrus reset" in outcome.text


def test_human_approve_ticks_the_milestone_not_the_reviewers_approve(store, project):
    set_config(project, HUMAN_REVIEW)
    os.makedirs(os.path.join(str(project), "docs", "specs"), exist_ok=True)
    rel = "docs/specs/a.md"
    with open(os.path.join(str(project), rel), "w") as handle:
        handle.write("# A\n\n## Milestones\n\n- [ ] #1 First\n  - ID: m1\n  - Depends on: none\n")
    ferrus.op_select_milestone(store, ferrus.HUMAN, rel, "m1")
    ferrus.op_create_task(store, ferrus.HUMAN, "Do m1.", origin=(rel, "m1"))
    ferrus.op_submit(store, EXECUTOR, "Done.")
    ferrus.op_approve(store, REVIEWER)
    assert "- [ ] #1" in open(os.path.join(str(project), rel)).read()
    outcome = ferrus.op_human_approve(store, ferrus.HUMAN)
    assert "- [x] #1" in open(os.path.join(str(project), rel)).read()
    assert outcome.data["milestone_completed"] == "m1"
    assert store.read_state().selected_milestone is None


def test_the_human_steps_refuse_outside_awaiting_confirmation(store, project):
    to_reviewing(store)
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.op_human_approve(store, ferrus.HUMAN)
    assert "no approval waits for your confirmation (state Reviewing)" in err.value.message
    assert "human_review = true" in err.value.hint
    with pytest.raises(ferrus.FerrusError):
        ferrus.op_human_reject(store, ferrus.HUMAN, "x")
    assert store.read_state().state == S.REVIEWING


def test_a_new_task_and_a_reset_clear_the_approval_notes(store, project):
    set_config(project, HUMAN_REVIEW)
    awaiting(store)
    ferrus.op_force_reset(store, ferrus.HUMAN)
    assert store.read_file(ferrus.APPROVAL_FILE) == ""
    awaiting(store)
    ferrus.op_human_approve(store, ferrus.HUMAN)
    ferrus.op_force_reset(store, ferrus.HUMAN)
    to_reviewing(store)
    assert store.read_file(ferrus.APPROVAL_FILE) == ""


# -- agents cannot confirm ----------------------------------------------------------------------

def test_no_agent_can_confirm_through_the_operations_or_mcp(store, project):
    set_config(project, HUMAN_REVIEW + "\n[limits]\nwait_timeout_secs = 0\n")
    awaiting(store)
    for caller in (REVIEWER, EXECUTOR, ferrus.Caller("agent", "agent:unknown:0")):
        with pytest.raises(ferrus.FerrusError) as err:
            ferrus.op_human_approve(store, caller)
        assert "only the human confirms" in err.value.message
        with pytest.raises(ferrus.FerrusError):
            ferrus.op_human_reject(store, caller, "do it again")
    with InProcessMcp(store, None) as server:
        server.initialize()
        names = {tool["name"] for tool in server.result("tools/list")["tools"]}
        assert not {"human_approve", "human_reject", "confirm"} & names
        for name, arguments in (("approve", {}), ("reject", {"notes": "redo"})):
            result = server.call_tool(name, arguments)
            assert result["isError"] is True
            assert "waits for a human's confirmation" in tool_text(result)
        status = tool_text(server.call_tool("status"))
        assert "AwaitingConfirmation" in status and "no agent can" in status
        waited = json.loads(tool_text(server.call_tool("wait_for_review")))
        assert waited == {"status": "timeout", "state": "AwaitingConfirmation"}
    assert store.read_state().state == S.AWAITING_CONFIRMATION
    assert [e[0] for e in events(store)][-1] == "approve"


def test_ferrus_approve_refuses_inside_an_agent_session(project):
    store = ferrus.Store(str(project))
    set_config(project, HUMAN_REVIEW)
    awaiting(store)
    result = run_cli("approve", "--yes", cwd=project, env={ferrus.SESSION_ENV: "s-agent"})
    assert result.returncode == 1
    assert "Cannot approve on a human's behalf" in result.stderr
    result = run_cli("reject", "redo", cwd=project, env={ferrus.SESSION_ENV: "s-agent"})
    assert result.returncode == 1
    assert store.read_state().state == S.AWAITING_CONFIRMATION


# -- the CLI and HQ -------------------------------------------------------------------------------

def test_cli_status_approve_and_reject(project):
    store = ferrus.Store(str(project))
    set_config(project, HUMAN_REVIEW)
    awaiting(store)
    status = run_cli("status", cwd=project)
    assert "AwaitingConfirmation" in status.stdout
    assert "Checked the tests and the edge cases." in status.stdout
    # Without a terminal and without --yes nobody can be asked: nothing changes.
    refused = run_cli("approve", cwd=project)
    assert refused.returncode == 2 and "pass --yes" in refused.stderr
    assert "Built it; tests added." in refused.stdout
    assert run_cli("reject", cwd=project).returncode == 2
    notes = os.path.join(str(project), "notes.md")
    with open(notes, "w") as handle:
        handle.write("Rename the widget.\n")
    rejected = run_cli("reject", "--file", notes, cwd=project)
    assert rejected.returncode == 0, rejected.stderr
    assert "State: Addressing" in rejected.stdout
    assert store.read_file("REVIEW.md") == "Rename the widget.\n"
    ferrus.op_submit(store, EXECUTOR, "Renamed.")
    ferrus.op_approve(store, REVIEWER)
    approved = run_cli("approve", "--yes", cwd=project)
    assert approved.returncode == 0, approved.stderr
    assert store.read_state().state == S.COMPLETE
    last = store.read_journal(limit=1)[0]
    assert (last["event"], last["actor"], last["detail"]["via"]) == (
        "human_approve", "human", "cli")
    again = run_cli("approve", "--yes", cwd=project)
    assert again.returncode == 1 and "the task is already Complete" in again.stderr


def test_status_says_what_gives_the_humans_word(store, project):
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.task_id = S.AWAITING_CONFIRMATION, "t-1"
        tx.set(data, "test_state")
    out = run_cli("status", cwd=project).stdout
    assert "your word  the reviewer approved: `ferrus approve`, or `ferrus reject NOTES`" in out


def test_run_task_over_a_task_awaiting_confirmation_names_approve_and_reject(store, project):
    """The refusal says what the human can do (approve, reject), not only `ferrus run
    --resume`."""
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


def test_hq_shows_the_summary_and_takes_approve_and_reject(project):
    store = ferrus.Store(str(project))
    set_config(project, HUMAN_REVIEW)
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    awaiting(store)
    shell.controller.poll()
    shell.controller.poll()          # shown once per wait, not on every poll
    text = out.getvalue()
    assert text.count("[AWAITING YOUR CONFIRMATION]") == 1
    assert "Checked the tests and the edge cases." in text
    shell.handle("looks fine")
    assert "/approve, or /reject NOTES" in out.getvalue()
    shell.handle("/reject")
    assert "usage: /reject NOTES" in out.getvalue()
    shell.handle("/review")
    assert "the reviewer already approved" in out.getvalue()
    shell.handle("/reject Add a changelog entry.")
    assert store.read_state().state == S.ADDRESSING
    assert store.read_file("REVIEW.md") == "Add a changelog entry."
    shell.controller.shutdown()
    ferrus.op_submit(store, EXECUTOR, "Changelog added.")
    ferrus.op_approve(store, REVIEWER)
    # A restarted HQ shows the waiting approval at once (there is no agent to resume, so
    # it does not ask) and takes /approve.
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    assert shell.controller.task_in_flight() is None
    shell.controller.poll()
    assert "[AWAITING YOUR CONFIRMATION]" in out.getvalue()
    shell.handle("/status")
    assert out.getvalue().count("Changelog added.") == 2
    shell.handle("/approve")
    shell.controller.shutdown()
    assert store.read_state().state == S.COMPLETE
    assert [e["detail"].get("via") for e in store.read_journal()
            if e["event"].startswith("human_")] == ["hq", "hq"]


# -- the whole loop with scripted agents ---------------------------------------------------------

@pytest.fixture
def scripted(project, tmp_path, monkeypatch):
    memory = tmp_path / "memory"
    store = scripted_project(project, memory)
    set_config(project, SCRIPTED_CONFIG.replace("[limits]", HUMAN_REVIEW + "\n[limits]", 1))
    monkeypatch.setenv("SCRIPTED_DIR", str(memory))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "")
    store.memory = str(memory)
    return store


def test_run_approve_path(scripted):
    summaries = []

    def review(summary):
        summaries.append(summary)
        return "approve", None
    code, lines = run(scripted, review=review)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert moves(scripted) == [("create_task", "human"), ("check_passed", "executor:scripted:1"),
                               ("submit", "executor:scripted:1"),
                               ("approve", "supervisor:scripted:1"), ("human_approve", "human")]
    assert len(summaries) == 1 and "Did the work." in summaries[0]
    assert "approved by supervisor:scripted:1" in summaries[0]
    assert any("Reviewing → AwaitingConfirmation" in line for line in lines)
    assert any("your confirmation is needed" in line for line in lines)
    assert any("AwaitingConfirmation → Complete  (human_approve by human)" in line
               for line in lines)
    confirmed = [e for e in scripted.read_journal() if e["event"] == "human_approve"]
    assert confirmed[0]["detail"]["via"] == "run"


def test_run_reject_path_delivers_the_notes_and_counts_the_cycle(scripted):
    decisions = [("reject", "Also write the date into work.txt."), ("approve", None)]
    code, lines = run(scripted, review=lambda summary: decisions.pop(0))
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert [m[0] for m in moves(scripted)] == [
        "create_task", "check_passed", "submit", "approve", "human_reject", "check_passed",
        "submit", "approve", "human_approve"]
    assert scripted.read_state().review_cycles == 1
    with open(os.path.join(scripted.memory, "reviews-seen")) as handle:
        assert handle.read() == "Also write the date into work.txt.\n"


def test_with_the_feature_off_the_run_is_exactly_as_before(scripted, project):
    set_config(project, SCRIPTED_CONFIG)
    called = []
    code, lines = run(scripted, review=lambda summary: called.append(summary))
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert called == []
    assert moves(scripted) == [("create_task", "human"), ("check_passed", "executor:scripted:1"),
                               ("submit", "executor:scripted:1"),
                               ("approve", "supervisor:scripted:1")]
    assert not any("AwaitingConfirmation" in json.dumps(e) for e in scripted.read_journal())
    assert not os.path.exists(scripted.path(ferrus.APPROVAL_FILE))
    with open(scripted.path(ferrus.STATE_FILE)) as handle:
        assert json.load(handle)["state"] == "Complete"


def test_a_run_without_a_human_exits_4_and_resumes_after_a_restart(scripted):
    code, lines = run(scripted)
    assert code == ferrus.RUN_NEEDS_HUMAN, "\n".join(lines)
    assert "ferrus approve" in lines[-1] and "ferrus run --resume" in lines[-1]
    assert scripted.read_state().state == S.AWAITING_CONFIRMATION
    # A later run (a restart) finds the task waiting and asks again; nothing is re-reviewed.
    decisions = [("reject", "One more line, please."), None]
    code, lines = run(scripted, task=None, resume=True,
                      review=lambda summary: decisions.pop(0))
    assert code == ferrus.RUN_NEEDS_HUMAN, "\n".join(lines)
    assert [m[0] for m in moves(scripted)][-4:] == ["human_reject", "check_passed", "submit",
                                                    "approve"]
    code, lines = run(scripted, task=None, resume=True,
                      review=lambda summary: ("approve", None))
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert scripted.read_state().review_cycles == 1


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_curses_hq_shows_the_confirmation_and_takes_reject_then_approve(scripted, tmp_path):
    from test_hq_curses import Pane
    pane = Pane(scripted.root, tmp_path)
    try:
        pane.wait(lambda lines: lines[0].startswith("ferrus HQ │ Idle"), what="status line")
        pane.type("/task Make work.txt", "Enter")
        screen = pane.wait_for("[AWAITING YOUR CONFIRMATION]", timeout=60)
        assert screen[0].startswith("ferrus HQ │ AwaitingConfirmation")
        pane.type("/reject Add a second line.", "Enter")
        pane.wait_for("State: Addressing")
        pane.wait_for("## The last rejection's notes", timeout=60)     # the second approval
        pane.type("/approve", "Enter")
        pane.wait_for("Task complete.", timeout=30)
        assert scripted.read_state().state == S.COMPLETE
        assert [m[0] for m in moves(scripted)][-5:] == [
            "human_reject", "check_passed", "submit", "approve", "human_approve"]
        with open(os.path.join(str(tmp_path), "reviews-seen")) as handle:
            assert handle.read() == "Add a second line.\n"
        pane.type("/quit", "Enter")
        assert pane.exited() == 0
    finally:
        pane.close()


def test_run_resume_without_a_terminal_exits_4_and_starts_no_agent(project):
    store = ferrus.Store(str(project))
    set_config(project, HUMAN_REVIEW)
    awaiting(store)
    result = run_cli("run", "--resume", cwd=project)
    assert result.returncode == ferrus.RUN_NEEDS_HUMAN, result.stdout + result.stderr
    assert "your confirmation is needed" in result.stdout
    assert "Checked the tests and the edge cases." in result.stdout
    assert "`ferrus approve`, or `ferrus reject NOTES`" in result.stdout.splitlines()[-1]
    assert "started the" not in result.stdout
    assert store.read_state().state == S.AWAITING_CONFIRMATION
    refused = run_cli("run", "--task", "Another one", cwd=project)
    assert refused.returncode == 1 and "already in flight (state AwaitingConfirmation)" in \
        refused.stderr


def test_doctor_accepts_a_waiting_task_and_warns_when_its_submission_is_gone(project):
    store = ferrus.Store(str(project))
    set_config(project, HUMAN_REVIEW + '\n[checks]\ncommands = ["true"]\n')
    awaiting(store)
    assert run_cli("doctor", cwd=project).returncode == 0
    with open(store.path("SUBMISSION.md"), "w"):
        pass
    report = run_cli("doctor", cwd=project)
    assert "state is AwaitingConfirmation but .ferrus/SUBMISSION.md is empty" in report.stdout


# -- a queued task waiting in the checkout -----------------------------------------------------

def queued_task_waiting_for_the_human(git_project):
    """A queued task run in the checkout (`ferrus run --parallel 1`) with [hq] human_review
    on, stopped (exit 4) at AwaitingConfirmation; returns (store, task id)."""
    from conftest import enqueue, scripted_setup
    store = scripted_setup(git_project, ["test -f README.md"], extra=HUMAN_REVIEW + "\n")
    task = enqueue(store, "One.\n\nWRITE one.txt: one\n")
    lines = []
    assert ferrus.run_queue(store, out=lines.append, timeout=90) == ferrus.RUN_NEEDS_HUMAN, \
        "\n".join(lines)
    assert store.project_state().state == S.AWAITING_CONFIRMATION
    return store, task


def test_a_queued_task_approved_after_its_run_stopped_is_done_not_failed(git_project):
    from conftest import statuses
    store, task = queued_task_waiting_for_the_human(git_project)
    approved = run_cli("approve", "--yes", "--task", task, cwd=git_project)
    assert "State: Complete" in approved.stdout, approved.stdout + approved.stderr
    assert statuses(store) == {task: "done"}
    # A task run in the checkout afterwards, then the queue: nothing fails the approved task.
    set_config(git_project, open(str(git_project / "ferrus.toml")).read().replace(
        HUMAN_REVIEW, ""))
    assert run(store, task="Other.\n\nWRITE two.txt: two\n")[0] == ferrus.RUN_COMPLETE
    lines = []
    assert ferrus.run_queue(store, out=lines.append) == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "done"}


def test_a_queued_task_approved_elsewhere_is_recorded_before_a_new_task_replaces_it(
        git_project):
    from conftest import statuses
    store, task = queued_task_waiting_for_the_human(git_project)
    ferrus.op_human_approve(store, ferrus.HUMAN, via="web")
    set_config(git_project, open(str(git_project / "ferrus.toml")).read().replace(
        HUMAN_REVIEW, ""))
    assert run(store, task="Other.\n\nWRITE two.txt: two\n")[0] == ferrus.RUN_COMPLETE
    assert statuses(store) == {task: "done"}


def test_a_queued_task_approved_then_reset_away_is_done_on_the_next_run(git_project):
    from conftest import statuses
    store, task = queued_task_waiting_for_the_human(git_project)
    ferrus.op_human_approve(store, ferrus.HUMAN, via="web")
    ferrus.op_force_reset(store, ferrus.HUMAN)
    ferrus.op_create_task(store, ferrus.HUMAN, "Something else.")
    ferrus.op_force_reset(store, ferrus.HUMAN)
    lines = []
    assert ferrus.run_queue(store, out=lines.append) == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {task: "done"}, "\n".join(lines)
    assert "approved after its run stopped" in "\n".join(lines)
