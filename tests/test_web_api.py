"""The web board's JSON API: what it shows (the queue as `ferrus tasks --json` has it,
board columns, a task's page, its diff, log windows, tool calls from session logs) and
what its actions do (queue, cancel, retry, answer, approve, reject) — each through the
operation the CLI calls, journaled with the human on the web as the actor.  Agent text
comes back exact and inert, never as markup."""

import json
import os
import shutil

import pytest

import ferrus
from conftest import run_cli, set_config
from web_client import BoardClient, running_board


S = ferrus.S
EXECUTOR = ferrus.Caller("executor", "executor:test:1")
REVIEWER = ferrus.Caller("supervisor", "supervisor:test:1")
HOSTILE = "<img src=x onerror=alert(1)> & </script><script>alert(2)</script>"


@pytest.fixture
def board(store):
    with running_board(store) as running:
        yield running


@pytest.fixture
def client(board):
    return BoardClient(board)


def journal(store, event):
    return [e for e in store.read_journal() if e["event"] == event]


def awaiting_confirmation(store, text="Build the widget."):
    """The checkout's own task, approved by the reviewer, waiting for the human."""
    set_config(store.root, "[hq]\nhuman_review = true\n")
    ferrus.op_create_task(store, ferrus.HUMAN, text)
    ferrus.op_submit(store, EXECUTOR, "Built it.")
    ferrus.op_approve(store, REVIEWER, "Looks right.")
    assert store.read_state().state == S.AWAITING_CONFIRMATION
    return store.read_state().task_id


def asking(store, text="Paint the button.", question="Which colour?"):
    ferrus.op_create_task(store, ferrus.HUMAN, text)
    ferrus.op_ask_human(store, EXECUTOR, question)
    return store.read_state().task_id


# -- the board ---------------------------------------------------------------------------------

def test_the_board_lists_what_ferrus_tasks_json_lists(project):
    store = ferrus.Store(str(project))        # the wall clock, as the CLI's
    for text in ("First task\n\nwith a body", "Second task"):
        ferrus.op_enqueue_task(store, ferrus.HUMAN, text)
    cancelled = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Dropped").data["task_id"]
    ferrus.op_cancel_task(store, ferrus.HUMAN, cancelled)
    listed = run_cli("tasks", "--json", cwd=project)
    assert listed.returncode == 0, listed.stderr
    cli_rows = json.loads(listed.stdout)["tasks"]
    with running_board(store) as running:
        board = BoardClient(running).get("/api/tasks").json
    assert [row["id"] for row in board["tasks"]] == [row["id"] for row in cli_rows]
    for mine, theirs in zip(board["tasks"], cli_rows):
        for key, value in theirs.items():
            if key != "age_secs":
                assert mine[key] == value, key
    assert board["older"] == 0 and board["seq"] == store.last_journal_seq()
    assert [column for column, _ in board["columns"]] == [
        "queued", "executing", "reviewing", "awaiting", "integrating", "merged", "ended"]
    assert [row["column"] for row in board["tasks"]] == ["queued", "queued", "ended"]
    assert board["tasks"][0]["last_event"] == "enqueue task"
    assert board["tasks"][2]["last_event"] == "cancel task"
    assert board["tasks"][0]["short_id"] == ferrus.short_task_id(board["tasks"][0]["id"])


@pytest.mark.parametrize("row, column", [
    ({"status": "queued"}, "queued"),
    ({"status": "running", "state": None}, "executing"),
    ({"status": "running", "state": "Executing"}, "executing"),
    ({"status": "running", "state": "Addressing"}, "executing"),
    ({"status": "running", "state": "Consultation"}, "executing"),
    ({"status": "running", "state": "Reviewing"}, "reviewing"),
    ({"status": "running", "state": "AwaitingHuman"}, "awaiting"),
    ({"status": "running", "state": "AwaitingConfirmation"}, "awaiting"),
    ({"status": "running", "state": "Integrating"}, "integrating"),
    ({"status": "running", "state": "Complete"}, "integrating"),
    ({"status": "running", "state": "Failed"}, "ended"),
    ({"status": "merged"}, "merged"), ({"status": "done"}, "merged"),
    ({"status": "unchanged"}, "merged"), ({"status": "failed"}, "ended"),
    ({"status": "cancelled"}, "ended"), ({"status": "running", "problem": "x"}, "ended"),
])
def test_each_task_goes_in_the_column_of_where_it_stands(row, column):
    assert ferrus.web_board_column(row) == column


def test_the_checkouts_own_task_is_a_card_too(client, store):
    task = asking(store)
    board = client.get("/api/tasks").json
    card = board["tasks"][0]
    assert (card["id"], card["column"], card["place"], card["title"]) == (
        task, "awaiting", "checkout", "Paint the button.")
    assert card["checkout"] is True


@pytest.mark.parametrize("header, title", [
    ("a/x.txt b/x.txt", "x.txt"),
    ("a/with space.txt b/with space.txt", "with space.txt"),
    (r'"a/esc\033[2Jname.txt" "b/esc\033[2Jname.txt"', "esc\u241b[2Jname.txt"),
    (r'"a/caf\303\251 \"q\"\ttab" "b/caf\303\251 \"q\"\ttab"', 'café "q"\u2409tab'),
    ("a/old.txt b/new.txt", "old.txt → new.txt"),
    (r'a/plain.txt "b/new\nline"', "plain.txt → new\u240aline"),
])
def test_a_diffs_file_is_titled_by_its_path_unquoted_and_inert(header, title):
    assert ferrus.diff_file_title(header) == title


def test_the_checkouts_own_task_is_named_by_its_short_id_as_its_card_shows(client, store):
    task = awaiting_confirmation(store)
    short = ferrus.short_task_id(task)
    assert client.get("/api/tasks/%s" % short).json["task"]["id"] == task
    answer = client.post("/api/tasks/%s/approve" % short)
    assert answer.status == 200 and answer.json["task_id"] == task
    assert store.read_state().state != S.AWAITING_CONFIRMATION
    assert client.get("/api/tasks/%s" % short[-3:]).status == 404     # 4 characters at least


def test_hostile_titles_come_back_exact_and_never_as_markup(client, store):
    ferrus.op_enqueue_task(store, ferrus.HUMAN, HOSTILE)
    answer = client.get("/api/tasks")
    assert b"<" not in answer.raw and b"\\u003c" in answer.raw       # inert as text
    assert answer.json["tasks"][0]["title"] == HOSTILE                 # and exact as JSON
    task = answer.json["tasks"][0]["id"]
    detail = client.get("/api/tasks/%s" % task)
    assert b"<" not in detail.raw and detail.json["text"] == HOSTILE


# -- a task's page ------------------------------------------------------------------------------

def test_a_tasks_page_has_its_text_events_usage_and_the_actions_that_apply(client, store):
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Write docs\n\nAll of them.").data[
        "task_id"]
    detail = client.get("/api/tasks/%s" % ferrus.short_task_id(task)).json
    assert detail["task"]["id"] == task and detail["task"]["title"] == "Write docs"
    assert detail["text"] == "Write docs\n\nAll of them."
    assert [e["event"] for e in detail["events"]] == ["enqueue_task"]
    assert detail["usage"]["sessions"] == 0 and detail["sessions"] == []
    assert detail["actions"] == {"cancel": True, "retry": False, "answer": False,
                                 "approve": False, "reject": False}
    assert detail["state"] is None                        # queued: no state of its own yet


def test_an_unknown_task_is_not_found(client):
    answer = client.get("/api/tasks/t-20260101T000000-abcdef")
    assert answer.status == 404 and "no task" in answer.json["error"]
    assert client.get("/api/tasks/nope/diff").status == 404


def test_a_question_shows_on_its_tasks_page(client, store):
    task = asking(store, question="Blue or <b>green</b>?")
    detail = client.get("/api/tasks/%s" % task).json
    assert detail["question"] == "Blue or <b>green</b>?"
    assert detail["actions"]["answer"] is True
    assert detail["state"]["state"] == "AwaitingHuman"
    assert detail["state"]["question_from"] == EXECUTOR.agent_id


def test_red_checks_on_a_tasks_page_carry_their_last_lines(client, store):
    set_config(store.root, '[checks]\ncommands = ["echo out-1; echo \\"<b>boom</b>\\"; exit 3"]\n')
    ferrus.op_create_task(store, ferrus.HUMAN, "Make it pass.")
    ferrus.op_check(store, EXECUTOR)
    task = store.read_state().task_id
    events = client.get("/api/tasks/%s" % task).json["events"]
    failed = [e for e in events if e["event"] == "check_failed"][0]
    check = failed["detail"]["checks"][0]
    assert check["status"] == "failed" and check["tail"][-2:] == ["out-1", "<b>boom</b>"]
    assert check["log_name"] and check["log_name"].endswith(".log")
    log = client.get("/api/logs/%s" % check["log_name"]).json
    assert "<b>boom</b>" in log["text"]


def test_tool_calls_are_read_from_the_session_logs_through_the_agents_parser(client, store):
    ferrus.op_create_task(store, ferrus.HUMAN, "Use tools.")
    task = store.read_state().task_id
    log_name = "executor_20260101T000000_1.log"
    lines = [
        {"type": "assistant", "message": {"content": [
            {"type": "tool_use", "id": "t1", "name": "Bash",
             "input": {"command": "rm -rf / # " + HOSTILE}}]}},
        {"type": "user", "message": {"content": [
            {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
             "content": "permission denied"}]}},
        {"type": "assistant", "message": {"content": [
            {"type": "tool_use", "id": "t2", "name": "Write",
             "input": {"file_path": "notes.md"}}]}},
    ]
    os.makedirs(store.path("logs"), exist_ok=True)
    with open(store.path("logs", log_name), "w") as handle:
        handle.write("not json at all\n" + "\n".join(json.dumps(line) for line in lines) + "\n")
    ferrus.open_session_record(store, "s-1", slot="executor", role="executor",
                               agent="claude-code", task_id=task,
                               log="%s/logs/%s" % (ferrus.FERRUS_DIR, log_name))
    detail = client.get("/api/tasks/%s" % task).json
    calls = detail["tool_calls"]
    assert [(c["tool"], c["ok"]) for c in calls] == [("Shell", False), ("Write", None)]
    assert calls[0]["summary"].startswith("rm -rf / # <img src=x")
    assert calls[0]["reason"] == "permission denied"
    assert detail["sessions"][0]["log_name"] == log_name
    assert "prompt" not in detail["sessions"][0] and "argv" not in detail["sessions"][0]


# -- log windows ---------------------------------------------------------------------------------

def write_log(store, name, data):
    os.makedirs(store.path("logs"), exist_ok=True)
    with open(store.path("logs", name), "wb") as handle:
        handle.write(data)


def test_a_log_is_served_in_bounded_windows(client, store):
    data = b"".join(b"line %06d\n" % n for n in range(20000))        # 240,000 bytes
    write_log(store, "big.log", data)
    end = client.get("/api/logs/big.log").json
    assert end["size"] == len(data) and end["length"] == ferrus.WEB_LOG_WINDOW_BYTES
    assert end["offset"] == len(data) - ferrus.WEB_LOG_WINDOW_BYTES
    assert end["text"].endswith("line 019999\n")
    start = client.get("/api/logs/big.log?offset=0&length=22").json
    assert start["text"] == "line 000000\nline 00000" and start["offset"] == 0
    huge = client.get("/api/logs/big.log?offset=0&length=99999999").json
    assert huge["length"] == len(data)                               # under the 1 MiB cap
    assert client.get("/api/logs/big.log?offset=-1").status == 400
    assert client.get("/api/logs/big.log?length=1e9").status == 400


def test_a_log_window_never_leaves_ferrus_logs(client, store, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("private key\n")
    write_log(store, "ok.log", b"fine\n")
    os.symlink(str(secret), store.path("logs", "linked.log"))
    answer = client.get("/api/logs/linked.log")
    assert answer.status == 403 and "symbolic link" in answer.json["error"]
    for name in ("..%2FSTATE.json", "%2E%2E%2Fevents.jsonl", ".hidden", "missing.log"):
        answer = client.get("/api/logs/%s" % name)
        assert answer.status == 404, name
        assert "private key" not in answer.text
    assert client.get("/api/logs/../STATE.json").status == 404


def test_terminal_escapes_and_binary_in_logs_are_shown_as_text(client, store):
    write_log(store, "esc.log", b"\x1b[31mred\x1b[0m \x1b]0;title\x07done\x00\xff\n")
    window = client.get("/api/logs/esc.log").json
    assert window["text"] == "red done\u2400\ufffd\n" and window["binary"] is True


# -- acting ---------------------------------------------------------------------------------------

def test_queueing_a_task_from_the_board_is_the_humans_on_the_web(client, store):
    answer = client.post("/api/tasks", {"text": "Add a --verbose flag\n\nDetails."})
    assert answer.status == 201
    task = answer.json["task_id"]
    assert answer.json["message"] == "Task %s queued: Add a --verbose flag" % task
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "queued" and record["origin"] == {"by": "human/web"}
    assert journal(store, "enqueue_task")[-1]["actor"] == "human/web"


@pytest.mark.parametrize("body, status, words", [
    ({}, 400, "the task's text is missing"), ({"text": "   "}, 400, "the task's text is missing"),
    ({"text": 42}, 400, "the task's text must be a string, not 42"),
    ({"text": "x", "agent": ["a"]}, 400, "the agent must be a string"),
    ({"text": "x", "agent": "no-such-agent"}, 409, "is not an agent ferrus knows"),
])
def test_a_bad_task_is_refused_with_what_to_fix(client, store, body, status, words):
    answer = client.post("/api/tasks", body)
    assert answer.status == status and words in answer.json["error"]
    assert ferrus.task_rows(store) == []


def test_a_body_that_is_not_a_json_object_is_refused(client):
    for raw in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe"):
        answer = client.request("POST", "/api/tasks", raw_body=raw,
                                headers={"Content-Type": "application/json"})
        assert answer.status == 400, raw


def test_cancel_and_retry_a_queued_task(client, store):
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Maybe later").data["task_id"]
    cancelled = client.post("/api/tasks/%s/cancel" % ferrus.short_task_id(task))
    assert cancelled.status == 200 and cancelled.json["message"] == "Task %s cancelled." % task
    assert ferrus.read_task_record(store.dir, task)["status"] == "cancelled"
    assert journal(store, "cancel_task")[-1]["actor"] == "human/web"
    again = client.post("/api/tasks/%s/cancel" % task)
    assert again.json["message"] == "Task %s was already cancelled." % task
    retried = client.post("/api/tasks/%s/retry" % task)
    assert retried.status == 200 and "is queued again" in retried.json["message"]
    assert ferrus.read_task_record(store.dir, task)["status"] == "queued"
    refused = client.post("/api/tasks/%s/retry" % task)
    assert refused.status == 409 and "not failed or cancelled" in refused.json["error"]
    assert client.post("/api/tasks/%s/cancel" % task, {"discard": "yes"}).status == 400


def test_the_checkouts_own_task_is_not_cancelled_from_the_queue(client, store):
    task = asking(store)
    answer = client.post("/api/tasks/%s/cancel" % task)
    assert answer.status == 409 and "`ferrus reset`" in answer.json["hint"]
    assert store.read_state().state == S.AWAITING_HUMAN


def test_answering_a_question_goes_through_op_answer(client, store):
    task = asking(store)
    answer = client.post("/api/answer", {"text": "Blue, like the sky <3"})
    assert answer.status == 200 and "State restored to Executing" in answer.json["message"]
    assert "recorded in `.ferrus/ANSWER.md`" in answer.json["message"]
    assert answer.json["task_id"] == task
    assert store.read_state().state == S.EXECUTING
    assert store.read_file("ANSWER.md") == "Blue, like the sky <3"
    entry = journal(store, "answer")[-1]
    assert entry["actor"] == "human/web" and entry["detail"]["asked_by"] == EXECUTOR.agent_id
    again = client.post("/api/answer", {"text": "Red"})
    assert again.status == 409 and "only valid in AwaitingHuman" in again.json["error"]
    assert client.post("/api/answer", {"text": ""}).status == 400


def test_approving_from_the_board_is_the_humans_confirmation(client, store):
    task = awaiting_confirmation(store)
    detail = client.get("/api/tasks/%s" % task).json
    assert detail["actions"]["approve"] and detail["confirmation"]["approval_notes"] == \
        "Looks right."
    answer = client.post("/api/tasks/%s/approve" % task)
    assert answer.status == 200 and answer.json["message"].startswith("Approved. State: Complete")
    assert store.read_state().state == S.COMPLETE
    entry = journal(store, "human_approve")[-1]
    assert entry["actor"] == "human/web" and entry["detail"]["via"] == "web"
    again = client.post("/api/tasks/%s/approve" % task)
    assert again.status == 409 and "the task is already Complete" in again.json["hint"]


def test_rejecting_from_the_board_needs_notes_and_sends_them_to_the_executor(client, store):
    task = awaiting_confirmation(store)
    assert client.post("/api/tasks/%s/reject" % task, {}).status == 400
    answer = client.post("/api/tasks/%s/reject" % task, {"notes": "Handle <empty> input."})
    assert answer.status == 200 and "State: Addressing" in answer.json["message"]
    assert store.read_file("REVIEW.md") == "Handle <empty> input."
    entry = journal(store, "human_reject")[-1]
    assert entry["actor"] == "human/web" and entry["detail"]["via"] == "web"


def test_a_board_started_inside_an_agent_session_cannot_confirm_for_the_human(
        client, store, monkeypatch):
    task = awaiting_confirmation(store)
    monkeypatch.setenv(ferrus.SESSION_ENV, "s-agent-7")
    answer = client.post("/api/tasks/%s/approve" % task)
    assert answer.status == 409 and "on a human's behalf" in answer.json["error"]
    assert store.read_state().state == S.AWAITING_CONFIRMATION


# -- parallel tasks (git worktrees) ----------------------------------------------------------------

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@pytest.fixture
def repo(tmp_path):
    from test_parallel_doctor import git
    root = tmp_path / "project"
    root.mkdir()
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda m: None)
    set_config(root, '[checks]\ncommands = ["true"]\n\n[hq]\nhuman_review = true\n')
    (root / "README.md").write_text("hello\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    return ferrus.Store(str(root))


@needs_git
def test_cancelling_a_running_task_needs_a_yes_as_the_cli_asks_for(repo):
    from test_parallel_doctor import start_task
    task, path, branch = start_task(repo, "Long work.")
    with running_board(repo) as board:
        client = BoardClient(board)
        asked = client.post("/api/tasks/%s/cancel" % task)
        assert asked.status == 409
        assert asked.json["confirm"] == "Task %s is running (Executing): cancel it (its work " \
            "is saved first)?" % ferrus.short_task_id(task)
        assert ferrus.read_task_record(repo.dir, task)["status"] == "running"
        done = client.post("/api/tasks/%s/cancel" % task, {"confirm": True})
        assert done.status == 200, done.json
        assert "Task %s cancelled." % task in done.json["message"]
        assert "Removed its worktree %s" % path in done.json["message"]
    assert ferrus.read_task_record(repo.dir, task)["status"] == "cancelled"
    assert not os.path.exists(path)


@needs_git
def test_a_parallel_tasks_question_approval_and_diff_on_the_board(repo):
    from test_parallel_doctor import start_task
    first, path, _ = start_task(repo, "First.")
    second, _, _ = start_task(repo, "Second.")
    ferrus.op_ask_human(repo.for_task(first), EXECUTOR, "Tabs or spaces?")
    ferrus.op_ask_human(repo.for_task(second), EXECUTOR, "Which file?")
    with running_board(repo) as board:
        client = BoardClient(board)
        both = client.post("/api/answer", {"text": "Spaces"})
        assert both.status == 409 and "2 tasks wait for an answer" in both.json["error"]
        done = client.post("/api/answer", {"task": ferrus.short_task_id(first),
                                           "text": "Spaces"})
        assert done.status == 200 and done.json["task_id"] == first
        assert repo.for_task(first).read_file("ANSWER.md") == "Spaces"
        assert "recorded in `.ferrus/tasks/%s/ANSWER.md`" % first in done.json["message"]
        assert repo.for_task(second).read_state().state == S.AWAITING_HUMAN
        # Its work, submitted and approved by the reviewer, waits for the human.
        with open(os.path.join(path, "feature.py"), "w") as handle:
            handle.write("".join("line = %d\n" % n for n in range(50)))
        with open(os.path.join(path, "esc\x1b[2Jname.txt"), "w") as handle:
            handle.write("a name git quotes\n")
        ferrus.op_submit(repo.for_task(first), EXECUTOR, "Added feature.py")
        ferrus.op_approve(repo.for_task(first), REVIEWER, "Fine.")
        card = [t for t in client.get("/api/tasks").json["tasks"] if t["id"] == first][0]
        assert card["column"] == "awaiting" and card["state"] == "AwaitingConfirmation"
        diff = client.get("/api/tasks/%s/diff" % first).json
        assert diff["available"] and diff["submission"]
        assert sorted(f["path"] for f in diff["files"]) == ["esc\x1b[2Jname.txt", "feature.py"]
        # Git quotes the odd name; the page's title is the path, its escape made visible.
        assert '"a/esc\\033[2Jname.txt"' in diff["text"]
        assert diff["file_titles"] == ["esc\u241b[2Jname.txt", "feature.py"]
        assert diff["text"].count("\n+line = ") == 50
        assert "diff --git a/feature.py" in diff["text"]
        approved = client.post("/api/tasks/%s/approve" % first)
        assert approved.status == 200 and "Integrating" in approved.json["message"]
        assert repo.for_task(first).read_state().state == S.INTEGRATING
