"""Worktree bootstrap ([parallel] copy, copy_mode, port_base, ports_per_task, teardown):
the checkout's local files in every task's worktree and in none of its commits, a port
block per task in its agents', checks' and setup's environment (the merge gate's block
in the gate's), and teardown before a worktree goes — with real git and scripted agents."""

import json
import os
import shutil

import pytest

import ferrus
from conftest import committed, enqueue, git, run_tasks as run, scripted_setup as setup
from test_parallel_doctor import start_task

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@pytest.fixture
def repo(git_project):
    """The git repository with ferrus set up (conftest's git_project)."""
    return git_project


def write(path, text):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(str(path), "w") as handle:
        handle.write(text)


def read(path):
    with open(str(path)) as handle:
        return handle.read()


def tree_files(root, commit):
    return sorted(git(root, "ls-tree", "-r", "--name-only", commit).stdout.split())


# -- end to end: two tasks, copied files, ports, setup and teardown ------------------------

TASK = """Task {name}.

WRITE {name}.txt: {name}
SHELL echo edited-in-the-worktree >> config/local.toml
SHELL echo "$FERRUS_TASK_PORT" > "$SCRIPTED_DIR/agent-port-$(basename "$PWD")"
SHELL cp .setup-port "$SCRIPTED_DIR/setup-port-$(basename "$PWD")"
"""


def test_local_files_reach_every_worktree_and_no_commit_and_each_task_has_its_ports(repo):
    memory = os.environ["SCRIPTED_DIR"]
    write(repo / ".gitignore", ".env\n.setup-port\n")
    write(repo / ".env", "SECRET=hunter2\n")                     # ignored by git
    write(repo / "config" / "local.example", "token = ''\n")    # tracked: never copied
    checks = ["test -f .env && test -f config/local.toml",
              'echo "$FERRUS_TASK_PORT $PWD" >> "%s/check-ports"' % memory]
    extra = ('[parallel]\ncopy = [".env", "config/local.*"]\n'
             'setup = ["echo {port} > .setup-port"]\n'
             'teardown = ["echo {port} $FERRUS_TASK_PORT >> \\"%s/teardown\\""]\n'
             'port_base = 30000\nports_per_task = 5\n\n' % memory)
    store = setup(repo, checks, extra)
    write(repo / "config" / "local.toml", "token = 'local-token'\n")   # untracked, NOT ignored
    tasks = [enqueue(store, TASK.format(name=name)) for name in ("alpha", "beta")]
    code, lines = run(store, 2)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    # Both merged; no copied file, nor its content, in any commit or ref.
    files = committed(repo)
    assert "alpha.txt" in files and "beta.txt" in files and "config/local.example" in files
    assert ".env" not in files and "config/local.toml" not in files
    history = git(repo, "log", "--all", "-p").stdout
    for secret in ("hunter2", "local-token", "edited-in-the-worktree"):
        assert secret not in history
    # The checkout's own file is as it was: the agents changed their copies.
    assert read(repo / "config" / "local.toml") == "token = 'local-token'\n"
    for task in tasks:
        record = ferrus.read_task_record(store.dir, task)
        assert record["copied"] == [".env", "config/local.toml"]
    # Each task had its own block, in its agents' and setup's environment and checks.
    ports = {task: int(read(os.path.join(memory, "agent-port-" + task))) for task in tasks}
    assert sorted(ports.values()) == [30005, 30010]
    for task in tasks:
        assert int(read(os.path.join(memory, "setup-port-" + task))) == ports[task]
        assert ferrus.read_task_record(store.dir, task)["port"] == ports[task]
    checked = [line.split(" ", 1) for line in read(os.path.join(memory, "check-ports"))
               .splitlines()]
    for task in tasks:
        mine = [port for port, where in checked if where.endswith(task)]
        assert mine and set(mine) == {str(ports[task])}
    gate = [port for port, where in checked if "ferrus-gate" in where]
    assert gate and set(gate) == {"30000"}       # the base check and the merge gate
    # Teardown ran in each worktree before it went (and in the gate after its checks).
    torn = read(os.path.join(memory, "teardown")).splitlines()
    for task in tasks:
        assert "%d %d" % (ports[task], ports[task]) in torn
    assert "30000 30000" in torn
    assert not any(os.path.exists(ferrus.read_task_record(store.dir, t)["worktree"])
                   for t in tasks)


# -- a submission and a cancel's saved work leave copied files out --------------------------

def test_a_snapshot_leaves_out_copied_files_ignored_or_not(repo):
    write(repo / ".gitignore", ".env\n")
    store = setup(repo, ["true"], '[parallel]\nteardown = ["echo $FERRUS_TASK_PORT {port} '
                                  '> \\"%s/torn\\""]\n\n' % os.environ["SCRIPTED_DIR"])
    task, path, branch = start_task(store)
    base = ferrus.read_task_record(store.dir, task)["base"]
    ferrus.update_task(store, ferrus.HUMAN, task, "task_files_copied", {
        "copied": [".env", "config/local.toml"], "port": 31000})
    write(os.path.join(path, ".env"), "SECRET=hunter2\n")
    write(os.path.join(path, "config", "local.toml"), "token = 'abc'\n")
    write(os.path.join(path, "work.txt"), "work\n")
    task_store = store.for_task(task)
    checkout = ferrus.task_git_site(task_store)
    # Without the record's list, git's own rules would take the file .gitignore misses.
    plain = ferrus.snapshot_worktree(checkout, base, ferrus.diff_exclusions(), "plain")
    assert "config/local.toml" in tree_files(repo, plain) and ".env" not in \
        tree_files(repo, plain)
    snapshot = ferrus.snapshot_worktree(checkout, base, ferrus.task_diff_exclusions(task_store),
                                        "submission")
    assert "work.txt" in tree_files(repo, snapshot)
    assert "config/local.toml" not in tree_files(repo, snapshot)
    assert ".env" not in tree_files(repo, snapshot)
    diff = ferrus.op_task_diff(store, task).text
    assert "work.txt" in diff and "local.toml" not in diff and ".env" not in diff
    # A cancel saves the work without them, then tears the worktree down with its port.
    out = ferrus.op_cancel_task(store, ferrus.HUMAN, task, remove_worktree=True)
    saved = ferrus.read_task_record(store.dir, task)["saved"]["commit"]
    assert tree_files(repo, saved) == sorted(tree_files(repo, base) + ["work.txt"])
    assert read(os.path.join(os.environ["SCRIPTED_DIR"], "torn")) == "31000 31000\n"
    assert not os.path.exists(path), out.text


# -- the copy itself ---------------------------------------------------------------------

def test_copy_sources_takes_untracked_matches_only(tmp_path):
    root = tmp_path / "checkout"
    root.mkdir()
    git(root, "init", "-q")
    write(root / "tracked.env", "x\n")
    write(root / "conf" / "tracked.toml", "x\n")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "c")
    write(root / ".env", "secret\n")
    write(root / "local.env", "y\n")
    write(root / "conf" / "local.toml", "z\n")
    write(root / "node_modules" / "pkg" / "index.js", "js\n")
    write(root / "worktrees" / "t-1" / ".env", "theirs\n")
    patterns = [".env", "*.env", "conf", "node_modules", "**/.env"]
    found = ferrus.copy_sources(str(root), patterns, skip=[str(root / "worktrees")])
    # conf holds a tracked file: only its untracked part; .git is never taken
    assert found == [".env", "conf/local.toml", "local.env", "node_modules"]


def test_copy_and_link_into_a_worktree(tmp_path):
    root, work = tmp_path / "checkout", tmp_path / "work"
    write(root / ".env", "secret\n")
    write(root / "node_modules" / "pkg" / "index.js", "js\n")
    ferrus.copy_into_worktree(str(root), str(work), [".env", "node_modules"], "link")
    assert os.path.islink(str(work / ".env")) and read(work / ".env") == "secret\n"
    assert os.path.islink(str(work / "node_modules"))
    # Copying over the links replaces them: nothing is written through into the checkout.
    ferrus.copy_into_worktree(str(root), str(work), [".env", "node_modules"], "copy")
    assert not os.path.islink(str(work / ".env"))
    write(work / ".env", "changed in the worktree\n")
    assert read(root / ".env") == "secret\n"
    assert read(work / "node_modules" / "pkg" / "index.js") == "js\n"
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.copy_into_worktree(str(root), str(work), ["missing.env"], "copy")
    assert "[parallel] copy could not copy missing.env" in err.value.message


# -- ports -----------------------------------------------------------------------------------

def test_each_running_task_gets_a_block_of_its_own():
    parallel = ferrus.ParallelConfig(port_base=40000, ports_per_task=10)
    records = [("t-a", {"status": "running", "port": 40010}),
               ("t-b", {"status": "merged", "port": 40020}),       # ended: free again
               ("t-c", {"status": "running", "port": 40030})]
    assert ferrus.choose_task_port(records, "t-new", parallel) == 40020
    assert ferrus.choose_task_port(records + [("t-new", {"port": 40050})], "t-new",
                                   parallel) == 40050          # a retried task keeps its own
    assert ferrus.choose_task_port(records + [("t-new", {"port": 40010})], "t-new",
                                   parallel) == 40020          # unless another holds it
    assert ferrus.choose_task_port(records, "t-new", ferrus.ParallelConfig(port_base=0)) \
        is None
    full = [("t-%d" % i, {"status": "running", "port": 40000 + 10 * i}) for i in range(1, 65)]
    with pytest.raises(ferrus.FerrusError):
        ferrus.choose_task_port(full, "t-new", parallel)
    assert ferrus.with_port(["serve --port {port}", "true"], 40010) == [
        "serve --port 40010", "true"]
    assert ferrus.port_environment(40010) == {"FERRUS_TASK_PORT": "40010"}


# -- ferrus.toml -------------------------------------------------------------------------------

@pytest.mark.parametrize("table,expected", [
    ('copy = ["../secrets"]', "leaves the project folder"),
    ('copy = ["/etc/passwd"]', "absolute path"),
    ('copy = [".git/config"]', "never copied"),
    ('copy_mode = "hardlink"', 'must be "copy" or "link"'),
    ("port_base = 80", "ports below need root"),
    ("port_base = 65000", "leaves no room"),
    ('port_base = 0\nsetup = ["serve --port {port}"]', "uses {port}"),
    ("copy_to_places = 1", "must be true or false"),
])
def test_bad_bootstrap_settings_are_refused(table, expected):
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.parse_config("[parallel]\n%s\n" % table)
    assert expected in err.value.message, err.value.message


def test_the_init_template_holds_the_defaults():
    config = ferrus.parse_config(ferrus.default_config_text())
    assert config.parallel == ferrus.ParallelConfig() and config.git == ferrus.GitConfig()
    for key in ("copy", "copy_mode", "copy_to_places", "port_base", "ports_per_task",
                "teardown", "fetch", "push", "publish", "pr"):
        assert "\n%s = " % key in ferrus.default_config_text()


# -- copy_to_places: the files packed for a place, and written there ----------------------

def test_local_files_packed_for_a_place_come_out_the_same_there(tmp_path):
    source = tmp_path / "checkout"
    (source / "conf" / "deep").mkdir(parents=True)
    (source / ".env").write_text("SECRET=1\n")
    (source / "conf" / "deep" / "run.sh").write_text("echo hi\n")
    os.chmod(str(source / "conf" / "deep" / "run.sh"), 0o750)
    os.symlink("deep/run.sh", str(source / "conf" / "link"))
    entries = ferrus.pack_local_files(str(source), [".env", "conf"])
    assert json.loads(json.dumps(entries)) == entries          # travels as JSON
    there = tmp_path / "there"
    there.mkdir()
    (there / "conf").mkdir()
    (there / "conf" / "stale.txt").write_text("from an earlier try\n")
    ferrus.unpack_local_files(str(there), [".env", "conf"], entries)
    assert (there / ".env").read_text() == "SECRET=1\n"
    assert (there / "conf" / "deep" / "run.sh").read_text() == "echo hi\n"
    assert os.stat(str(there / "conf" / "deep" / "run.sh")).st_mode & 0o777 == 0o750
    assert os.readlink(str(there / "conf" / "link")) == "deep/run.sh"
    assert not (there / "conf" / "stale.txt").exists()


def test_more_local_files_than_a_place_takes_are_refused_saying_what_to_do(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(ferrus, "PLACE_COPY_LIMIT", 10)
    (tmp_path / "big").write_text("x" * 11)
    with pytest.raises(ferrus.FerrusError) as refused:
        ferrus.pack_local_files(str(tmp_path), ["big"])
    assert "more than" in refused.value.message and "copy_to_places" in refused.value.hint


@pytest.mark.parametrize("paths, entries", [
    (["../escape"], []), ([".git"], []), (["a/.ferrus/x"], []), (["/etc"], []), ([7], []),
    ([], [{"path": "ok/../../x", "data": ""}])])
def test_a_copied_path_that_leaves_the_worktree_is_refused_there(tmp_path, paths, entries):
    with pytest.raises(ferrus.FerrusError):
        ferrus.unpack_local_files(str(tmp_path), paths, entries)
    assert os.listdir(str(tmp_path)) == []


def test_a_file_is_never_written_through_a_copied_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    there = tmp_path / "there"
    there.mkdir()
    entries = [{"path": "cfg", "link": str(outside)},
               {"path": "cfg/evil", "data": "eA==", "mode": 0o644}]
    with pytest.raises(ferrus.FerrusError):
        ferrus.unpack_local_files(str(there), ["cfg"], entries)
    assert os.listdir(str(outside)) == []
