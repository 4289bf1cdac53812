"""Parallel tasks at places: `ferrus run --parallel` sends tasks to the places of
[parallel] places, follows them there, merges them here through the merge gate, and
removes them there; a conflict goes back to the executor at its place.

The quick tests use `env` as an exec prefix (this machine, this user); the others a
second local user reached through a real sshd on 127.0.0.1 and through `runuser -u USER
--` (tests/places_harness.py; skipped, saying why, without root or openssh-server).
"""

import contextlib
import json
import os
import subprocess
import sys

import pytest

import ferrus
from conftest import SCRIPTED_AGENT, custom_agent_config, set_config
from places_harness import (PLACE_PYTHON, exec_place, local_place, place_home,  # noqa: F401
                            ssh_place, sshd)  # (exec_place ... sshd: the fixtures)

GIT_IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
                "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def git(where, *args):
    return subprocess.run(["git"] + list(args), cwd=str(where), capture_output=True, text=True,
                          env=dict(os.environ, **GIT_IDENTITY), check=True).stdout.strip()


def toml_list(words):
    return json.dumps(list(words))


def place_table(place):
    """ferrus.toml's [places.NAME] for the PlaceConfig of a fixture."""
    keys = "%s = %s\n" % ("ssh" if place.ssh else "exec", toml_list(place.ssh or place.exec))
    return "[places.%s]\n%sslots = 2\ndir = %s\npython = %s\n" % (
        place.name, keys, json.dumps(place.dir), json.dumps(place.python))


def project_at(tmp_path, monkeypatch, place, agent_argv, places=None, extra="", parallel=""):
    """A repository whose tasks run at ``place`` (a PlaceConfig), the scripted agent
    (``agent_argv``, as the place runs it) in both roles; ``parallel``: more keys of
    [parallel]."""
    for name, value in GIT_IDENTITY.items():
        monkeypatch.setenv(name, value)
    memory = tmp_path / "memory"
    memory.mkdir()
    monkeypatch.setenv("SCRIPTED_DIR", str(memory))
    root = tmp_path / "project"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    ferrus.init_project(str(root), report=lambda message: None)
    set_config(root, "[checks]\ncommands = [\"test -f README.md\"]\n\n[limits]\n"
                     "wait_timeout_secs = 5\n\n[parallel]\nplaces = %s\n%s\n%s\n%s\n" % (
                         toml_list(places or [place.name]), parallel, place_table(place),
                         extra) +
               custom_agent_config("scripted", agent_argv))
    ferrus.register_agents(str(root), {"supervisor": ("scripted", None),
                                       "executor": ("scripted", None)},
                           report=lambda message: None)
    (root / "README.md").write_text("hello\n")
    (root / ".gitignore").write_text(".ferrus/\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    return ferrus.Store(str(root))


def enqueue(store, text):
    return ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]


def run(store, timeout=300):
    lines = []
    code = ferrus.run_parallel(store, None, timeout=timeout, out=lines.append)
    return code, "\n".join(lines)


def place_folder(place):
    return place.dir if place.dir.startswith("/") else os.path.join(place_home(),
                                                                      place.dir[2:])


def tasks_left_there(place):
    """Task worktrees, stores and jobs still at the place."""
    left = []
    for where, folders, _ in os.walk(place_folder(place)):
        left += [os.path.join(where, f) for f in folders if f.startswith("t-")]
    return left


def check_merged_there(store, tasks, place, lines, code, dispatched=True):
    assert code == ferrus.RUN_COMPLETE, lines
    rows = {row["id"]: row for row in ferrus.task_rows(store)}
    assert {task: rows[task]["status"] for task in tasks} == {t: "merged" for t in tasks}
    for task in tasks:
        record = ferrus.read_task_record(store.dir, task)
        assert record["place"] == place.name and record["store"] == "place"
        assert "worktree" not in record
        assert store.for_task(task).read_state().state == ferrus.TaskState.COMPLETE
        assert not dispatched or "dispatched task %s" % ferrus.short_task_id(task) in lines
    assert not dispatched or "at place %s" % place.name in lines
    entries = store.read_journal()
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
    for task in tasks:
        events = [e["event"] for e in entries if e.get("task_id") == task]
        for wanted in ("create_task", "submit", "approve", "integrated"):
            assert wanted in events, (task, events)
        assert any((e.get("detail") or {}).get("place") == place.name for e in entries
                   if e.get("task_id") == task and e["event"] == "submit")
    assert not tasks_left_there(place), tasks_left_there(place)


def test_two_tasks_at_a_place_are_merged_here_and_removed_there(tmp_path, monkeypatch,
                                                                 local_place):
    store = project_at(tmp_path, monkeypatch, local_place,
                       [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    tasks = [enqueue(store, "Add %s.\n\nWRITE %s.txt: %s\n" % (name, name, name))
             for name in ("alpha", "beta")]
    code, lines = run(store)
    check_merged_there(store, tasks, local_place, lines, code)
    files = git(store.root, "ls-tree", "-r", "--name-only", "main").split()
    assert "alpha.txt" in files and "beta.txt" in files
    assert open(os.path.join(store.root, "alpha.txt")).read() == "alpha\n"
    # nothing of the tasks was ever worked in a worktree here
    assert not os.path.exists(store.root + ".ferrus-worktrees") or \
        not os.listdir(store.root + ".ferrus-worktrees")
    shown = subprocess.run([sys.executable, os.path.join(os.path.dirname(ferrus.__file__),
                                                         "ferrus.py"), "tasks", "--all"],
                           cwd=store.root, capture_output=True, text=True)
    assert shown.stdout.count("ran at place %s" % local_place.name) == 2, shown.stdout


def test_copy_to_places_sends_the_local_files_and_keeps_them_out_of_the_work(
        tmp_path, monkeypatch, local_place):
    """[parallel] copy with copy_to_places: the checkout's untracked files (a .env, a
    folder with a link in it) reach the task's worktree at the place, listed in its
    record here, and none of them reaches the target."""
    store = project_at(tmp_path, monkeypatch, local_place,
                       [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"],
                       parallel='copy = [".env", "conf"]\ncopy_to_places = true\n')
    root = store.root
    with open(os.path.join(root, ".env"), "w") as handle:
        handle.write("SECRET=1\n")
    os.makedirs(os.path.join(root, "conf"))
    with open(os.path.join(root, "conf", "local.toml"), "w") as handle:
        handle.write("port = 1\n")
    os.symlink("local.toml", os.path.join(root, "conf", "link"))
    with open(os.path.join(root, ".gitignore"), "a") as handle:
        handle.write(".env\nconf/\n")
    git(root, "commit", "-qam", "ignore local files")
    task = enqueue(store, "Use them.\n\nSHELL cat .env conf/link > seen.txt\n"
                          "SHELL echo changed > .env\n")
    code, lines = run(store)
    check_merged_there(store, [task], local_place, lines, code)
    assert git(root, "show", "main:seen.txt") == "SECRET=1\nport = 1"
    tree = git(root, "ls-tree", "-r", "--name-only", "main").split()
    assert ".env" not in tree and not any(path.startswith("conf/") for path in tree)
    assert ferrus.read_task_record(store.dir, task)["copied"] == [".env", "conf"]
    assert open(os.path.join(root, ".env")).read() == "SECRET=1\n"


def test_a_conflict_at_a_place_goes_back_to_its_executor_there_and_then_merges(
        tmp_path, monkeypatch, local_place):
    store = project_at(tmp_path, monkeypatch, local_place,
                       [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    tasks = [enqueue(store, "Greeting %s.\n\nWRITE greeting.txt: hello from %s\n" % (n, n))
             for n in ("one", "two")]
    code, lines = run(store)
    check_merged_there(store, tasks, local_place, lines, code)
    assert "goes back to its executor" in lines
    entries = store.read_journal()
    assert any(e["event"] == "integration_failed" for e in entries)


def test_a_place_that_cannot_be_reached_leaves_its_tasks_queued_and_says_so(
        tmp_path, monkeypatch, local_place):
    local_place.exec = [str(tmp_path / "no-such-prefix")]
    store = project_at(tmp_path, monkeypatch, local_place,
                       [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    code, lines = run(store, timeout=8)
    assert code == ferrus.RUN_TIMEOUT, lines
    assert "place local failed task %s" % ferrus.short_task_id(task) in lines
    assert "waits in the queue" in lines
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "queued" and not record.get("place")


# -- another user, through sshd and runuser ---------------------------------------------------

def remote_agent(place_config):
    """The scripted agent, copied where the place's user can read it (its CLI, as the
    place's admin installs it)."""
    place = ferrus.Place(place_config)
    folder = os.path.join(place_home(), place_config.dir[2:], "agents")
    with open(SCRIPTED_AGENT, "rb") as handle:
        place.run(["sh", "-c", 'mkdir -p "$1" && cat > "$1/scripted_agent.py"', "sh", folder],
                  input=handle.read())
    return [PLACE_PYTHON, os.path.join(folder, "scripted_agent.py"), "{role}", "{mcp_config}"]


@pytest.fixture(params=["ssh", "exec"])
def remote_place(request):
    return request.getfixturevalue(request.param + "_place")


def test_two_tasks_at_another_users_place_are_merged(tmp_path, monkeypatch, remote_place):
    store = project_at(tmp_path, monkeypatch, remote_place, remote_agent(remote_place))
    tasks = [enqueue(store, "Add %s.\n\nWRITE %s.txt: %s\n" % (name, name, name))
             for name in ("alpha", "beta")]
    code, lines = run(store)
    check_merged_there(store, tasks, remote_place, lines, code)


def test_a_run_stopped_while_its_task_works_at_a_place_is_taken_up_by_the_next(
        tmp_path, monkeypatch, local_place):
    store = project_at(tmp_path, monkeypatch, local_place,
                       [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    seen = []

    def stop_once_dispatched(line):
        seen.append(line)
        if "dispatched task" in line:
            raise KeyboardInterrupt        # Ctrl+C as the task starts there
    with pytest.raises(KeyboardInterrupt):
        ferrus.run_parallel(store, None, timeout=120, out=stop_once_dispatched)
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "running" and record["place"] == local_place.name
    code, lines = run(store)
    assert "resuming 1 task" in lines, lines
    check_merged_there(store, [task], local_place, lines, code, dispatched=False)


def test_a_cancelled_task_at_a_place_keeps_its_work_here(tmp_path, monkeypatch, local_place):
    store = project_at(tmp_path, monkeypatch, local_place,
                       [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    # Its executor writes its file there and ends without submitting, again and again.
    task = enqueue(store, "Slow work.\n\nWRITE slow.txt: slow\nEXIT-WITHOUT-SUBMIT\n")
    lines = []

    def cancel_once_it_worked(line):
        lines.append(line)
        if "executor" in line and "exited" in line and len(lines) < 1000:
            with contextlib.suppress(ferrus.FerrusError):
                ferrus.op_cancel_task(store, ferrus.HUMAN, task)
    code = ferrus.run_parallel(store, None, timeout=120, out=cancel_once_it_worked)
    lines = "\n".join(lines)
    record = ferrus.read_task_record(store.dir, task)
    assert record["status"] == "cancelled", lines
    saved = record["saved"]
    assert git(store.root, "show", saved["commit"] + ":slow.txt") == "slow"
    assert git(store.root, "rev-parse", saved["ref"]) == saved["commit"]
    assert "Its work at place local is saved as %s" % saved["commit"][:12] in lines
    assert not tasks_left_there(local_place)
    assert code == ferrus.RUN_COMPLETE, lines


def test_a_killed_ssh_connection_mid_task_is_made_again_and_the_task_merges(
        tmp_path, monkeypatch, ssh_place):
    store = project_at(tmp_path, monkeypatch, ssh_place, remote_agent(ssh_place))
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    prefix = ferrus.Place(ssh_place)._prefix()
    cut = []

    def cut_when_it_works_there(line):
        if "dispatched task" in line and not cut:
            # Every session over the shared connection ends at once (the follower's too).
            cut.append(subprocess.run(prefix[:-1] + ["-O", "exit", prefix[-1]],
                                      capture_output=True, text=True))
    lines = []

    def out(line):
        lines.append(line)
        cut_when_it_works_there(line)
    code = ferrus.run_parallel(store, None, timeout=300, out=out)
    assert cut and cut[0].returncode == 0, cut
    check_merged_there(store, [task], ssh_place, "\n".join(lines), code)
    seqs = [e["detail"]["place_seq"] for e in store.read_journal()
            if (e.get("detail") or {}).get("place_seq")]
    assert seqs == sorted(set(seqs)), "an entry of the place came twice: %s" % seqs


# -- the real Claude Code CLI at an ssh place --------------------------------------------------

def claude_at_place(place_config, fake):
    """The claude CLI installed at the place as its admin would: the binary (hard-linked
    where the place's user can run it, else copied) behind a wrapper that points it at
    the scripted model ``fake`` with a HOME of its own; the wrapper's folder goes first
    on PATH there ([places.NAME] path)."""
    from fake_anthropic import find_agent
    binary = os.path.realpath(find_agent("claude"))
    place = ferrus.Place(place_config)
    folder = os.path.join(place_home(), place_config.dir[2:], "claude-bin")
    place.run(["mkdir", "-p", folder + "/home"])
    target = os.path.join(folder, "claude-real")
    try:
        os.link(binary, target)
    except OSError:
        import shutil
        shutil.copy(binary, target)
    os.chmod(target, 0o755)
    wrapper = "#!/bin/sh\n" + "".join("export %s=%s\n" % (name, value) for name, value in (
        ("ANTHROPIC_BASE_URL", fake.url), ("ANTHROPIC_API_KEY", "sk-ant-fake-key-for-tests"),
        ("HOME", folder + "/home"), ("XDG_CONFIG_HOME", folder + "/home/.config"),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"), ("DISABLE_TELEMETRY", "1"),
        ("DISABLE_AUTOUPDATER", "1"), ("DISABLE_ERROR_REPORTING", "1"),
        ("NO_PROXY", "127.0.0.1,localhost"))) + 'exec %s "$@"\n' % target
    place.run(["sh", "-c", 'cat > "$1/claude" && chmod 755 "$1/claude"', "sh", folder],
              input=wrapper.encode())
    return folder


@pytest.mark.e2e
def test_two_tasks_at_an_ssh_place_with_the_real_claude_cli_are_merged(
        tmp_path, monkeypatch, ssh_place):
    from fake_anthropic import FakeAnthropic, claude_env, find_agent
    from test_e2e_parallel import TwoTasks
    if not find_agent("claude"):
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    model = TwoTasks()
    with FakeAnthropic(model) as fake:
        ssh_place.path = [claude_at_place(ssh_place, fake)]
        home = tmp_path / "home"
        home.mkdir()
        for name, value in claude_env(fake, str(home)).items():
            monkeypatch.setenv(name, value)
        store = project_at(tmp_path, monkeypatch, ssh_place, ["unused"],
                           extra="path = %s\n" % toml_list(ssh_place.path))
        ferrus.register_agents(store.root, {"supervisor": ("claude-code", None),
                                            "executor": ("claude-code", None)},
                               report=lambda message: None)
        git(store.root, "add", "-A")
        git(store.root, "commit", "-qm", "claude in both roles")
        tasks = [enqueue(store, "Create %s.txt containing %s." % (name, name))
                 for name in ("alpha", "beta")]
        code, lines = run(store, timeout=300)
        check_merged_there(store, tasks, ssh_place, lines + fake.describe(), code)
    for name in ("alpha", "beta"):
        assert git(store.root, "show", "main:%s.txt" % name) == name
    roles = sorted((role, name) for role, _, _, name in model.seen)
    assert roles == [("executor", "alpha.txt"), ("executor", "beta.txt"),
                     ("supervisor", "alpha.txt"), ("supervisor", "beta.txt")], model.seen
    # each agent worked in its task's worktree at the place, as the place's user
    assert all(workdir.startswith(place_home()) for _, _, workdir, _ in model.seen), model.seen


def test_ferrus_run_works_the_queue_at_the_places_without_parallel(tmp_path, monkeypatch,
                                                                    local_place):
    """`ferrus run` as a user types it: with a place in [parallel] places the queue goes
    to the parallel runner even with max_tasks = 1 (here keeps its one slot)."""
    from conftest import FERRUS_CMD
    store = project_at(tmp_path, monkeypatch, local_place,
                       [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"],
                       places=["here", local_place.name])
    tasks = [enqueue(store, "Add %s.\n\nWRITE %s.txt: %s\n" % (name, name, name))
             for name in ("alpha", "beta", "gamma")]
    done = subprocess.run(FERRUS_CMD + ["run", "--timeout", "240"], cwd=store.root,
                          capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "at place %s" % local_place.name in done.stdout
    records = [ferrus.read_task_record(store.dir, task) for task in tasks]
    assert {record["status"] for record in records} == {"merged"}
    assert {record.get("place") or "here" for record in records} == {"here",
                                                                     local_place.name}
    shown = subprocess.run(FERRUS_CMD + ["tasks"], cwd=store.root, capture_output=True,
                           text=True, timeout=60)
    assert "it ran at place %s" % local_place.name in shown.stdout, shown.stdout
