"""Honest outcomes of a run: an approved task that changed nothing is "approved, no
change", never "merged"; a parallel task's `complete` notification comes after its merge;
`ferrus run --json` prints only JSON, with an event for each step of a task's integration;
a send-back shows the red checks (command, last lines, log) and a conflict its files;
`ferrus tasks` lists the active and recent tasks; a queue's next task starts from the
user's branch, not from the last task's; while a web board serves the project, a question
or an approval waits for it (said once, with the task's link) instead of ending the run
with exit 4.

Real runs (`ferrus run`, `ferrus run --parallel`) with the scripted agents
(tests/scripted_agent.py) in real git repositories.
"""

import json
import os
import re
import subprocess
import threading
import time
import urllib.request

import ferrus
from conftest import (FERRUS_CMD, committed, enqueue, git, run_cli, run_tasks,
                      scripted_config, scripted_setup, set_config, statuses)


def cli(root, *args, timeout=240):
    return run_cli(*args, cwd=root, timeout=timeout)


def json_lines(stdout):
    """Every stdout line as a JSON object (a line that is not one fails the test)."""
    return [json.loads(line) for line in stdout.splitlines()]


# -- approved, no change ------------------------------------------------------------------

def test_an_approved_task_that_changes_nothing_is_not_counted_as_merged(git_project, monkeypatch):
    store = scripted_setup(git_project, ["test -f README.md"])          # README.md holds "hello"
    same = enqueue(store, "Keep the greeting.\n\nWRITE README.md: hello\n")
    new = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    log = []
    monkeypatch.setattr(ferrus.Notifier, "notify", lambda self, event, task, summary:
                        log.append(("notified", event, task, summary)))
    head = git(git_project, "rev-parse", "main").stdout.strip()
    code = ferrus.run_parallel(store, 2, timeout=240, out=log.append, mode="json")
    lines = [item for item in log if isinstance(item, str)]
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {same: "unchanged", new: "merged"}
    assert "alpha.txt" in committed(git_project)
    assert git(git_project, "rev-list", "--count", "%s..main" % head).stdout.strip() == "1"
    events = [json.loads(line) for line in lines]
    unchanged = [e for e in events if e["event"] == "unchanged"]
    assert [e["task_id"] for e in unchanged] == [same]
    merged = [e for e in events if e["event"] == "merged"]
    assert [e["task_id"] for e in merged] == [new]
    assert merged[0]["commit"] == ferrus.read_task_record(store.dir, new)["merged_commit"]
    report = next(e for e in events if e["text"].startswith("ferrus run: report: "))
    assert report["text"] == "ferrus run: report: 1 merged, 1 approved (no change)"
    assert report["counts"] == {"merged": 1, "unchanged": 1}
    # One `complete` per task, sent once its end is known: after the merge (with its
    # commit), or saying it changed nothing — never at the reviewer's approval.
    complete = [item for item in log if isinstance(item, tuple) and item[1] == "complete"]
    assert sorted(item[2] for item in complete) == sorted([same, new])
    said = {item[2]: item[3] for item in complete}
    assert said[new].startswith("merged into main at %s" % merged[0]["commit"][:12])
    assert said[same].startswith("approved, no change (its submission changed no file)")
    def first(event):
        return next(i for i, item in enumerate(log) if isinstance(item, str) and
                    json.loads(item)["event"] == event and json.loads(item)["task_id"] == new)
    told = next(i for i, item in enumerate(log) if isinstance(item, tuple) and
                item[1:3] == ("complete", new))
    assert first("integrating") < told < first("merged")
    # What the views say.
    listed = cli(git_project, "tasks")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(same))
    assert "approved (no change)" in row and "merged" not in row
    # The columns are as wide as their longest entry: every title starts in one column.
    other = next(line for line in listed.stdout.splitlines() if line.startswith(new))
    assert row.index("Keep the greeting.") == other.index("Add alpha.") == \
        listed.stdout.splitlines()[0].index("TITLE")
    assert "1 merged, 1 approved (no change)" in cli(git_project, "status").stdout
    diff = cli(git_project, "diff", "--task", ferrus.short_task_id(same))
    assert diff.returncode == 1 and "approved and changed nothing" in diff.stderr


def test_a_queued_task_that_changes_nothing_in_the_checkout_is_unchanged(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    set_config(git_project, scripted_config(["test -f README.md"], "[parallel]\nmax_tasks = 1\n\n"))
    git(git_project, "commit", "-qam", "one at a time")
    same = enqueue(store, "Keep the greeting.\n\nWRITE README.md: hello\n")
    done = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    lines = []
    code = ferrus.run_queue(store, out=lines.append, timeout=240)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {same: "unchanged", done: "done"}
    assert any("approved, no change" in line for line in lines)


# -- ferrus run --json: only JSON, an event per step of an integration -----------------------

def test_json_run_prints_only_json_and_each_step_of_the_merge_queue(git_project):
    # The check fails when both files exist: each task alone passes, the second merged
    # onto the first does not, and goes back to its executor with the red check.
    check = "test ! -f left.txt || test ! -f right.txt || { echo left and right clash; exit 1; }"
    store = scripted_setup(git_project, [check])
    set_config(git_project, scripted_config([check]).replace("max_review_cycles = 3",
                                                      "max_review_cycles = 1"))
    git(git_project, "commit", "-qam", "one review cycle")
    left = enqueue(store, "Left.\n\nWRITE left.txt: left\n")
    right = enqueue(store, "Right.\n\nWRITE right.txt: right\n")
    done = cli(git_project, "run", "--parallel", "2", "--json")
    events = json_lines(done.stdout)            # nothing but JSON on stdout
    assert done.returncode == ferrus.RUN_FAILED, done.stdout[-3000:] + done.stderr
    kinds = [e["event"] for e in events]
    assert kinds.count("integrating") >= 2 and kinds.count("merged") == 1
    assert all(e["event"] in ferrus.PROGRESS_EVENTS + ("run",) for e in events)
    merged = next(e for e in events if e["event"] == "merged")
    assert merged["commit"] == ferrus.read_task_record(store.dir, merged["task_id"])[
        "merged_commit"]
    back = next(e for e in events if e["event"] == "sent_back")
    assert back["task_id"] == ({left, right} - {merged["task_id"]}).pop()
    assert back["cause"] == "checks" and back["target"] == "main"
    assert back["reason"] == "the checks fail on its work merged with main"
    [red] = back["failed"]
    assert red["command"] == check and red["exit"] == 1
    assert red["tail"] == ["left and right clash"]
    assert red["log"].startswith(".ferrus/logs/") and os.path.isfile(
        os.path.join(str(git_project), red["log"]))
    # The line a person reads says the same.
    lines = back["text"].splitlines()
    assert lines[0] == "ferrus run: task %s goes back to its executor: the checks fail on " \
                       "its work merged with main" % ferrus.short_task_id(back["task_id"])
    assert lines[1] == "    check failed: %s (exit 1); log %s" % (check, red["log"])
    assert lines[2] == "        │ left and right clash"
    assert not any("P5" in e["text"] or "P4" in e["text"] for e in events)


def test_a_conflict_lists_its_files(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    enqueue(store, "Greeting one.\n\nWRITE greeting.txt: hello from one\n")
    enqueue(store, "Greeting two.\n\nWRITE greeting.txt: hello from two\n")
    code, lines = run_tasks(store, 2, mode="json")
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    events = [json.loads(line) for line in lines]
    [conflict] = [e for e in events if e["event"] == "conflict"]
    assert conflict["files"] == ["greeting.txt"] and conflict["cause"] == "conflict"
    assert conflict["text"] == "ferrus run: task %s goes back to its executor: it conflicts " \
                               "with main in greeting.txt" % ferrus.short_task_id(
                                   conflict["task_id"])
    # `ferrus log` tells the run's steps in words, never by their phase codes.
    shown = cli(git_project, "log", "-n", "400").stdout
    assert "phase            the run is now merging approved tasks into the target branch  " \
           "capacity Green, Continue" in shown
    assert "the run is now waiting for the agents' work" in shown
    assert not re.search(r"\bP[0-7]\b|phase_name=", shown), shown


def test_json_warnings_are_objects_too(project, tmp_path):
    from conftest import SCRIPTED_CONFIG, scripted_project
    scripted_project(project, tmp_path / "memory")
    # [git] branch without a repository: the task is created with a warning.
    set_config(project, SCRIPTED_CONFIG + '\n[git]\nbranch = "ferrus/{task_id}"\n')
    env = dict(os.environ, SCRIPTED_DIR=str(tmp_path / "memory"), SCRIPTED_BEHAVIOR="")
    done = subprocess.run(FERRUS_CMD + ["run", "--json", "--task", "Make work."],
                          cwd=str(project), env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    events = json_lines(done.stdout)
    warning = next(e for e in events if e.get("warning"))
    assert warning["level"] == "warning" and "[git] branch is set" in warning["warning"]
    assert events[-1]["event"] == "complete"


# -- ferrus tasks: active and recent, --all for the history ---------------------------------

def test_tasks_lists_active_and_recent_ones_and_all_with_all(project):
    store = ferrus.Store(str(project))
    long_title = "Refactor the storage layer so that every write goes through one " \
                 "transaction and the journal"
    tasks = [enqueue(store, text) for text in (long_title, "Old one", "Recent one", "Waiting")]
    now = store.clock()
    ended = {tasks[1]: now - ferrus._dt.timedelta(days=3),
             tasks[2]: now - ferrus._dt.timedelta(hours=2)}
    for task, when in ended.items():
        record = ferrus.read_task_record(store.dir, task)
        record.update(status="merged", ended_at=ferrus.format_timestamp(when))
        ferrus.write_task_record(store, task, record)
    shown = cli(project, "tasks")
    assert shown.returncode == 0, shown.stderr
    listed = [line.split()[0] for line in shown.stdout.splitlines()[1:] if line.startswith("t-")]
    assert listed == [tasks[0], tasks[2], tasks[3]]
    assert "… and 1 older ended task (`ferrus tasks --all` lists them)" in shown.stdout
    everything = cli(project, "tasks", "--all")
    assert [line.split()[0] for line in everything.stdout.splitlines()
            if line.startswith("t-")] == tasks
    data = json.loads(cli(project, "tasks", "--json").stdout)
    assert [row["id"] for row in data["tasks"]] == [tasks[0], tasks[2], tasks[3]]
    assert data["older"] == 1
    assert data["tasks"][0]["title"] == long_title          # uncut
    assert ferrus.read_task_record(store.dir, tasks[0])["title"].endswith("...")
    assert len(json.loads(cli(project, "tasks", "--json", "--all").stdout)["tasks"]) == 4


# -- a queue's tasks each start from the user's branch ---------------------------------------

def test_with_a_branch_per_task_the_next_queued_task_starts_from_the_users_branch(git_project):
    store = scripted_setup(git_project, ["test -f README.md"])
    set_config(git_project, scripted_config(["test -f README.md"], '[git]\nbranch = '
                                     '"ferrus/{task_id}"\ncommit = "on_approve"\n\n'))
    git(git_project, "commit", "-qam", "a branch per task")
    first = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    second = enqueue(store, "Add beta.\n\nWRITE beta.txt: beta\n")
    lines = []
    code = ferrus.run_queue(store, out=lines.append, timeout=240)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert statuses(store) == {first: "done", second: "done"}
    creates = {e["task_id"]: e for e in store.read_journal() if e["event"] == "create_task"}
    assert creates[second]["detail"]["branch"] == "ferrus/" + second
    # The second task's branch forked from main, so it holds beta, not alpha.
    assert "alpha.txt" not in committed(git_project, "ferrus/" + second)
    assert "beta.txt" in committed(git_project, "ferrus/" + second)
    assert "alpha.txt" in committed(git_project, "ferrus/" + first)
    assert any(line == "ferrus run: back on main, so the next task starts from it (the last "
               "task's work stays on its branch ferrus/%s)" % first for line in lines), lines


# -- a board serving the project answers for the human ----------------------------------------

def board_post(base_url, token, path, body):
    """A POST to a board's API as a script sends it (the bearer token, no Origin)."""
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                     method="POST", headers={
                                         "Authorization": "Bearer " + token,
                                         "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def wait_for(condition, what, limit=120):
    deadline = time.monotonic() + limit
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "gave up waiting for " + what
        time.sleep(0.05)


def test_a_run_with_a_board_leaves_the_question_and_the_approval_to_it(project, tmp_path):
    # `ferrus run --task ... --web`, stdin not a terminal, [hq] human_review on: without
    # the board the question alone would end the run with exit 4.
    from conftest import SCRIPTED_CONFIG, scripted_project
    store = scripted_project(project, tmp_path / "memory")
    set_config(project, SCRIPTED_CONFIG.replace("[limits]", "[hq]\nhuman_review = true\n\n"
                                                "[limits]", 1))
    env = dict(os.environ, NO_COLOR="1", SCRIPTED_DIR=str(tmp_path / "memory"),
               SCRIPTED_BEHAVIOR="ask")
    env.pop("FERRUS_DEBUG", None)
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    with open(str(out), "w") as stdout, open(str(err), "w") as stderr:
        proc = subprocess.Popen(FERRUS_CMD + ["run", "--task", "Make work.txt", "--web",
                                              "--web-port", "0"],
                                cwd=str(project), env=env, stdin=subprocess.DEVNULL,
                                stdout=stdout, stderr=stderr)
    try:
        url = wait_for(lambda: re.search(r"the board is at (http://\S+)", err.read_text()),
                       "the board's URL").group(1)
        base_url, token = url.split("/?token=")
        # The human acts once the run said where (as one reading its output would).
        wait_for(lambda: "the question waits for your answer on the board" in out.read_text(),
                 "the run to leave the question to the board")
        task = store.read_state().task_id
        board_post(base_url, token, "/api/answer", {"text": "Blue"})
        wait_for(lambda: "the reviewer's approval waits for your confirmation on the board"
                 in out.read_text(), "the run to leave the approval to the board")
        board_post(base_url, token, "/api/tasks/%s/approve" % task, {})
        assert proc.wait(timeout=120) == ferrus.RUN_COMPLETE, out.read_text() + err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shown = out.read_text()
    link = "%s/task/%s" % (base_url, task)
    assert shown.count("ferrus run: the question waits for your answer on the board: %s\n"
                       % link) == 1, shown
    assert shown.count("ferrus run: the reviewer's approval waits for your confirmation on "
                       "the board: %s\n" % link) == 1, shown
    assert "answer>" not in shown and "approve?" not in shown
    assert store.read_state().state == ferrus.S.COMPLETE
    human = [(e["event"], e["actor"]) for e in store.read_journal()
             if e["actor"].startswith("human")]
    assert human == [("create_task", "human"), ("answer", "human/web"),
                     ("human_approve", "human/web")]
    assert not (project / ".ferrus" / "web.json").exists()


def test_a_parallel_run_with_a_board_waits_for_its_answer_instead_of_exit_4(
        git_project, monkeypatch):
    store = scripted_setup(git_project, ["test -f README.md"])
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "ask")
    board = ferrus.WebBoard(store, "127.0.0.1", 0).start()
    answered = []
    lines = []

    def answer_from_the_board():
        # As its user would: once the run has said where the question waits (an answer
        # given before the run saw the question leaves it nothing to say).
        wait_for(lambda: any("waits for your answer on the board" in line for line in lines),
                 "the run's word on the question", limit=200)
        answered.append(board_post(board.base_url, board.token, "/api/answer",
                                   {"text": "Blue", "task": task}))
    helper = threading.Thread(target=answer_from_the_board, daemon=True)
    helper.start()
    try:
        # No ask: nobody at this run's terminal.
        code = ferrus.run_parallel(store, 2, timeout=240, out=lines.append)
    finally:
        board.close()
    helper.join(10)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    assert answered and answered[0]["task_id"] == task
    assert statuses(store) == {task: "merged"}
    told = [line for line in lines if "waits for your answer on the board" in line]
    assert told == ["ferrus run: task %s: the question waits for your answer on the board: "
                    "%s/task/%s" % (ferrus.short_task_id(task), board.base_url, task)], lines
    assert [e["actor"] for e in store.read_journal() if e["event"] == "answer"] == ["human/web"]
