"""[git] branch and commit policy: a branch per task, a commit on approval holding only the
task's files, and a reset that never discards work.

Every test builds a real git repository in a temporary folder (git is required)."""

import io
import json
import os
import re
import shutil

import pytest

from conftest import git, run_cli, set_config, write
import ferrus

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

EXECUTOR = ferrus.Caller("executor", "executor:test:1")
REVIEWER = ferrus.Caller("supervisor", "supervisor:test:1")


def read(root, rel):
    with open(os.path.join(str(root), *rel.split("/")), encoding="utf-8") as handle:
        return handle.read()


def configure(root, git_table):
    """ferrus.toml with its [git] table (the one `ferrus init` wrote) replaced."""
    text = re.sub(r"(?ms)^\[git\]\n.*?(?=^\[|\Z)", "", read(root, "ferrus.toml"))
    set_config(root, text + "\n[git]\n" + git_table + "\n")


def make_repo(root, git_table, commit=True):
    """``root`` (an initialised ferrus project) as a repository with an identity of its
    own, [git] set to ``git_table``, and (unless ``commit`` is false) a first commit."""
    configure(root, git_table)
    git(root, "init", "-q")
    git(root, "config", "user.name", "Test User")
    git(root, "config", "user.email", "test@example.com")
    write(root, ".gitignore", read(root, ".gitignore") + "*.log\n")
    if commit:
        write(root, "app.py", "print('hello')\n")
        write(root, "old.txt", "to be deleted\n")
        git(root, "add", "-A")
        git(root, "commit", "-qm", "initial")
    return root


POLICY = 'branch = "ferrus/{task_id}"\ncommit = "on_approve"'


@pytest.fixture
def repo(project):
    return make_repo(project, POLICY)


def head(root):
    return git(root, "rev-parse", "HEAD").stdout.strip()


def branch_of(root):
    return git(root, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.strip()


def committed_files(root, rev="HEAD"):
    out = git(root, "show", "--name-status", "--format=", rev).stdout.split("\n")
    return sorted(line for line in out if line)


def to_reviewing(store, description="Change the greeting.\n\nMore words.", notes=None):
    created = ferrus.op_create_task(store, ferrus.HUMAN, description)
    ferrus.op_wait_for_task(store, EXECUTOR)
    return created


def submit(store, notes="Changed app.py and added new.py."):
    ferrus.op_submit(store, EXECUTOR, notes)


def do_task_work(root):
    write(root, "app.py", "print('changed by the task')\n")
    write(root, "new.py", "NEW = 1\n")
    os.remove(os.path.join(str(root), "old.txt"))


# -- config ----------------------------------------------------------------------------------

def test_git_table_parses_and_defaults_are_off():
    config = ferrus.parse_config("")
    assert config.git.branch == "" and config.git.commit == "off"
    assert config.git.branch_for("t-1") is None
    config = ferrus.parse_config('[git]\nbranch = "work/{task_id}"\ncommit = "on_approve"\n')
    assert config.git.branch_for("t-1") == "work/t-1" and config.git.commit == "on_approve"


@pytest.mark.parametrize("table, expected", [
    ('branch = "ferrus/work"', "must contain {task_id}"),
    ('branch = "ferrus/{id}-{task_id}"', "no placeholder but {task_id}"),
    ('branch = "bad name/{task_id}"', "no valid branch name"),
    ('branch = "x..y/{task_id}"', "no valid branch name"),
    ('branch = "x/{task_id}.lock"', "no valid branch name"),
    ('branch = true', "must be a branch name template"),
    ('commit = "always"', 'must be one of "off", "on_approve"'),
    ('commit = true', 'must be one of "off", "on_approve"'),
])
def test_bad_git_values_are_clear_errors(table, expected):
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.parse_config("[git]\n%s\n" % table)
    assert expected in err.value.message and "[git." in err.value.message


def test_doctor_reports_bad_git_values_and_unknown_keys(project):
    configure(project, 'branch = "nope"\ncommit = "sometimes"\npush = true')
    result = run_cli("doctor", cwd=project)
    assert result.returncode != 0
    assert "[git.branch] must contain {task_id}" in result.stdout + result.stderr
    assert "[git.commit] must be one of" in result.stdout + result.stderr
    assert "git.push" in result.stdout + result.stderr


# -- the branch --------------------------------------------------------------------------------

def test_create_task_creates_and_checks_out_the_task_branch(repo, store):
    start = head(repo)
    outcome = ferrus.op_create_task(store, ferrus.HUMAN, "Change the greeting.")
    data = store.read_state()
    name = "ferrus/" + data.task_id
    assert branch_of(repo) == name and head(repo) == start
    assert "new git branch %s (from main)" % name in outcome.text
    assert data.task_base["branch"] == name and data.task_base["task_branch"] == name
    assert data.task_base["from_branch"] == "main" and data.task_base["commit"] == start
    entry = list(store.read_journal())[-1]
    assert entry["event"] == "create_task" and entry["detail"]["branch"] == name
    # main is untouched.
    assert git(repo, "rev-parse", "main").stdout.strip() == start


def test_a_dirty_tree_comes_along_to_the_branch_and_nothing_is_lost(repo, store):
    write(repo, "app.py", "print('my own edit')\n")
    write(repo, "mine.txt", "my notes\n")
    git(repo, "add", "mine.txt")
    outcome = ferrus.op_create_task(store, ferrus.HUMAN, "Change the greeting.")
    assert branch_of(repo).startswith("ferrus/t-")
    assert read(repo, "app.py") == "print('my own edit')\n" and read(repo, "mine.txt") == "my notes\n"
    status = git(repo, "status", "--porcelain").stdout
    assert " M app.py" in status and "A  mine.txt" in status      # still staged, still dirty
    assert "uncommitted changes when the task was created" in outcome.text
    assert "stay out of the task's commit" in outcome.text


def test_an_existing_branch_is_refused_and_nothing_changes(repo, store, monkeypatch):
    git(repo, "branch", "ferrus/t-taken")
    monkeypatch.setattr(ferrus, "new_id", lambda prefix: "t-taken")
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.op_create_task(store, ferrus.HUMAN, "Change the greeting.")
    assert "branch ferrus/t-taken already exists" in err.value.message
    assert "never moves an existing branch" in err.value.hint
    assert store.read_state().state == ferrus.S.IDLE and branch_of(repo) == "main"


def test_a_rebase_in_progress_is_refused_with_how_to_finish_it(repo, store):
    git(repo, "checkout", "-q", "-b", "side")
    write(repo, "app.py", "print('side')\n")
    git(repo, "commit", "-qam", "side")
    git(repo, "checkout", "-q", "main")
    write(repo, "app.py", "print('main')\n")
    git(repo, "commit", "-qam", "main")
    assert git(repo, "rebase", "side", check=False).returncode != 0     # a conflict stops it
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.op_create_task(store, ferrus.HUMAN, "Change the greeting.")
    assert "a git rebase is in progress" in err.value.message
    assert "git rebase --continue" in err.value.hint and "git rebase --abort" in err.value.hint
    assert store.read_state().state == ferrus.S.IDLE
    assert "ferrus/" not in git(repo, "branch", "--list").stdout


def test_a_detached_head_gets_a_branch_at_that_commit(repo, store):
    start = head(repo)
    git(repo, "checkout", "-q", "--detach")
    outcome = ferrus.op_create_task(store, ferrus.HUMAN, "Change the greeting.")
    assert branch_of(repo).startswith("ferrus/t-") and head(repo) == start
    assert "from a detached HEAD at %s" % start[:12] in outcome.text
    assert "HEAD is detached" not in outcome.text
    assert store.read_state().task_base["from_branch"] is None


def test_a_refused_create_task_makes_no_branch(repo, store):
    ferrus.op_create_task(store, ferrus.HUMAN, "First.")
    first = branch_of(repo)
    with pytest.raises(ferrus.FerrusError):
        ferrus.op_create_task(store, ferrus.HUMAN, "Second.")
    branches = git(repo, "branch", "--list", "ferrus/*").stdout.split()
    assert branches == ["*", first] and branch_of(repo) == first


def test_not_a_repository_with_a_branch_policy_works_and_warns(project, store):
    configure(project, POLICY)
    outcome = ferrus.op_create_task(store, ferrus.HUMAN, "Change the greeting.")
    assert "[git] branch is set, but the task gets no branch" in outcome.text
    assert store.read_state().state == ferrus.S.EXECUTING
    ferrus.op_submit(store, EXECUTOR, "done")
    approved = ferrus.op_approve(store, REVIEWER)
    assert store.read_state().state == ferrus.S.COMPLETE
    assert "Nothing was committed" in approved.text and "not in a git repository" in approved.text


# -- the commit --------------------------------------------------------------------------------

def test_approve_commits_only_the_tasks_files_with_title_summary_and_trailer(repo, store):
    start = head(repo)
    write(repo, "mine.txt", "the user's own work in progress\n")      # dirty before the task
    write(repo, "staged.txt", "staged by the user\n")
    git(repo, "add", "staged.txt")
    to_reviewing(store, "# Change the greeting\n\nSay something else.")
    task_id = store.read_state().task_id
    do_task_work(repo)
    write(repo, "debug.log", "ignored\n")                               # .gitignore: *.log
    write(repo, ".ferrus/scratch.txt", "ferrus's own\n")
    write(repo, ".mcp.json", "{}\n")
    submit(store, "Changed app.py, added new.py and removed old.txt.")
    outcome = ferrus.op_approve(store, REVIEWER)
    data = store.read_state()
    assert data.state == ferrus.S.COMPLETE
    name = "ferrus/" + task_id
    assert branch_of(repo) == name
    assert git(repo, "rev-parse", "HEAD~1").stdout.strip() == start
    assert git(repo, "rev-parse", "main").stdout.strip() == start        # main untouched
    assert committed_files(repo) == ["A\tnew.py", "D\told.txt", "M\tapp.py"]
    message = git(repo, "log", "-1", "--format=%B").stdout
    assert message.startswith("Change the greeting\n\nChanged app.py, added new.py")
    assert message.rstrip().endswith("Ferrus-Task: %s" % task_id)
    trailers = git(repo, "log", "-1", "--format=%(trailers:key=Ferrus-Task,valueonly)").stdout
    assert trailers.strip() == task_id
    # The user's files: untouched, uncommitted, and the staged one still staged.
    status = git(repo, "status", "--porcelain", "--ignored").stdout
    assert "?? mine.txt" in status and "A  staged.txt" in status
    assert "!! debug.log" in status and read(repo, "debug.log") == "ignored\n"
    assert data.task_commit["commit"] == head(repo) and data.task_commit["files"] == 3
    assert "Committed the task's changes as %s on branch %s (3 files)" % (
        head(repo)[:12], name) in outcome.text
    assert "mine.txt" in outcome.text                    # left out, and said so
    entry = list(store.read_journal())[-1]
    assert entry["event"] == "approve" and entry["detail"]["commit"] == head(repo)[:12]
    assert entry["detail"]["branch"] == name and entry["detail"]["committed_files"] == 3
    status_text = run_cli("status", cwd=repo).stdout
    assert "git commit" in status_text and head(repo)[:12] in status_text
    assert json.loads(run_cli("status", "--json", cwd=repo).stdout)["git_commit"]["commit"] \
        == head(repo)


def test_a_file_changed_before_the_task_stays_out_of_the_commit(repo, store):
    write(repo, "app.py", "print('the user was editing this')\n")
    to_reviewing(store)
    write(repo, "new.py", "NEW = 1\n")
    submit(store)
    outcome = ferrus.op_approve(store, REVIEWER)
    assert committed_files(repo) == ["A\tnew.py"]
    assert read(repo, "app.py") == "print('the user was editing this')\n"
    assert " M app.py" in git(repo, "status", "--porcelain").stdout
    assert "Left uncommitted, as they were changed before the task began: app.py" in outcome.text


def test_commit_off_leaves_the_changes_uncommitted(project, store):
    make_repo(project, 'commit = "off"')
    start = head(project)
    to_reviewing(store)
    do_task_work(project)
    submit(store)
    outcome = ferrus.op_approve(store, REVIEWER)
    assert store.read_state().state == ferrus.S.COMPLETE and head(project) == start
    assert branch_of(project) == "main" and "ommit" not in outcome.text
    assert store.read_state().task_commit is None


def test_commit_without_a_branch_policy_goes_on_the_current_branch(project, store):
    make_repo(project, 'commit = "on_approve"')
    to_reviewing(store)
    do_task_work(project)
    submit(store)
    ferrus.op_approve(store, REVIEWER)
    assert branch_of(project) == "main"
    assert "Ferrus-Task: " in git(project, "log", "-1", "--format=%B").stdout


def test_a_hook_that_refuses_leaves_the_task_approved_and_the_changes_intact(repo, store):
    hook = os.path.join(str(repo), ".git", "hooks", "pre-commit")
    with open(hook, "w") as handle:
        handle.write("#!/bin/sh\necho 'lint says no: app.py line 1' >&2\nexit 1\n")
    os.chmod(hook, 0o755)
    start = head(repo)
    to_reviewing(store)
    do_task_work(repo)
    submit(store)
    outcome = ferrus.op_approve(store, REVIEWER)
    data = store.read_state()
    assert data.state == ferrus.S.COMPLETE and head(repo) == start
    assert "NOT committed" in outcome.text and "lint says no: app.py line 1" in outcome.text
    assert "commit hook refuses it" in outcome.text
    assert "lint says no" in data.task_commit["error"]
    # The changes are all still there, and the new file is untracked again (not left
    # half-added in the user's index).
    assert read(repo, "app.py") == "print('changed by the task')\n"
    assert read(repo, "new.py") == "NEW = 1\n"
    status = git(repo, "status", "--porcelain").stdout
    assert "?? new.py" in status and " M app.py" in status and " D old.txt" in status
    entry = list(store.read_journal())[-1]
    assert entry["event"] == "approve" and "lint says no" in entry["detail"]["commit_failed"]
    assert "NOT committed" in run_cli("status", cwd=repo).stdout
    assert "lint says no" in run_cli("log", cwd=repo).stdout


def test_a_missing_identity_says_how_to_set_one(repo, store, monkeypatch, tmp_path):
    git(repo, "config", "--unset", "user.name")
    git(repo, "config", "--unset", "user.email")
    git(repo, "config", "user.useConfigOnly", "true")
    for name in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME",
                 "GIT_COMMITTER_EMAIL", "EMAIL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    to_reviewing(store)
    do_task_work(repo)
    submit(store)
    outcome = ferrus.op_approve(store, REVIEWER)
    assert store.read_state().state == ferrus.S.COMPLETE
    assert "NOT committed" in outcome.text and "git config user.email" in outcome.text
    assert read(repo, "new.py") == "NEW = 1\n"


def test_head_on_another_branch_is_not_committed_to(repo, store):
    to_reviewing(store)
    task_branch = branch_of(repo)
    do_task_work(repo)
    git(repo, "checkout", "-q", "-b", "elsewhere")
    submit(store)
    outcome = ferrus.op_approve(store, REVIEWER)
    assert store.read_state().state == ferrus.S.COMPLETE
    assert "HEAD is on branch elsewhere, but the task works on branch %s" % task_branch \
        in outcome.text
    assert "git switch %s" % task_branch in outcome.text
    assert git(repo, "rev-parse", "elsewhere").stdout.strip() == \
        git(repo, "rev-parse", "main").stdout.strip()


def test_nothing_to_commit_is_said_plainly(repo, store):
    start = head(repo)
    to_reviewing(store)
    submit(store, "Nothing needed changing.")
    outcome = ferrus.op_approve(store, REVIEWER)
    assert head(repo) == start and "Nothing was committed: the task changed no files" \
        in outcome.text


def test_human_review_commits_when_the_human_approves(project, store):
    set_config(project, "[hq]\nhuman_review = true\n" + read(project, "ferrus.toml"))
    repo = make_repo(project, POLICY)
    start = head(repo)
    to_reviewing(store)
    do_task_work(repo)
    submit(store)
    ferrus.op_approve(store, REVIEWER)
    assert store.read_state().state == ferrus.S.AWAITING_CONFIRMATION and head(repo) == start
    outcome = ferrus.op_human_approve(store, ferrus.HUMAN)
    assert store.read_state().state == ferrus.S.COMPLETE and head(repo) != start
    assert "Committed the task's changes" in outcome.text
    assert list(store.read_journal())[-1]["detail"]["commit"] == head(repo)[:12]


def test_a_repository_without_commits_gets_its_first_commit_on_the_task_branch(project,
                                                                               store):
    make_repo(project, POLICY, commit=False)
    to_reviewing(store)
    write(project, "app.py", "print('first')\n")
    submit(store)
    ferrus.op_approve(store, REVIEWER)
    assert branch_of(project).startswith("ferrus/t-")
    files = committed_files(project)
    assert "A\tapp.py" in files
    # ferrus's own files and agent files are never part of it; the user's are (they
    # were all new when the task began, so they count as changed before it).
    assert not any(".ferrus" in line or ".agents/skills/ferrus" in line for line in files)


def test_a_new_file_with_an_odd_name_is_committed(repo, store):
    to_reviewing(store)
    write(repo, "dir with space/ünï [1].txt", "odd\n")
    write(repo, ":(glob)*.py", "magic-looking\n")
    submit(store)
    ferrus.op_approve(store, REVIEWER)
    files = committed_files(repo)
    assert "A\tdir with space/ünï [1].txt" in git(repo, "-c", "core.quotePath=false", "show",
                                                  "--name-status", "--format=").stdout
    assert len(files) == 2


# -- reset never discards work ---------------------------------------------------------------

def test_reset_keeps_the_tasks_changes_and_says_so(repo, store):
    to_reviewing(store)
    task_branch = branch_of(repo)
    do_task_work(repo)
    result = run_cli("reset", "--yes", cwd=repo)
    assert result.returncode == 0, result.stderr
    assert "Uncommitted changes are kept: 3 files" in result.stdout
    assert "Dropping a task's changes" in result.stdout
    assert "HEAD stays on the task's branch %s; `git switch main` goes back" % task_branch \
        in result.stdout
    assert store.read_state().state == ferrus.S.IDLE
    assert read(repo, "app.py") == "print('changed by the task')\n"
    assert read(repo, "new.py") == "NEW = 1\n"
    assert branch_of(repo) == task_branch


def test_reset_without_git_says_nothing_about_git(project, store):
    ferrus.op_create_task(store, ferrus.HUMAN, "Change the greeting.")
    text = ferrus.op_force_reset(store, ferrus.HUMAN).text
    assert "Uncommitted" not in text and "branch" not in text


def test_reset_counts_the_files_it_leaves_changed_in_good_english(project):
    """One file differs, two files differ."""
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "start")
    store = ferrus.Store(str(project))
    for count, verb in ((1, "differs"), (2, "differ")):
        ferrus.op_create_task(store, ferrus.HUMAN, "Change files")
        for index in range(count):
            (project / ("changed%d.txt" % index)).write_text("round %d\n" % count)
        out = run_cli("reset", "--yes", cwd=project).stdout
        assert "%d file%s in the work tree %s from HEAD" % (
            count, "" if count == 1 else "s", verb) in out
        git(project, "add", "-A")
        git(project, "commit", "-q", "-m", "more")


def test_hq_says_the_commit_failed_when_the_task_completes(repo, store):
    hook = os.path.join(str(repo), ".git", "hooks", "commit-msg")
    with open(hook, "w") as handle:
        handle.write("#!/bin/sh\necho 'commit-msg: needs a ticket number' >&2\nexit 1\n")
    os.chmod(hook, 0o755)
    to_reviewing(store)
    do_task_work(repo)
    submit(store)
    messages = []
    controller = ferrus.HqController(store, messages.append)
    controller.reconcile()
    ferrus.op_approve(store, REVIEWER)
    controller.reconcile()
    done = [m for m in messages if m.text.startswith("Task complete.")]
    assert len(done) == 1 and done[0].kind == "error"
    assert "NOT committed" in done[0].text and "needs a ticket number" in done[0].text


def test_hq_task_names_the_new_branch(repo, store):
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    try:
        shell.handle("/task Do the thing.")
    finally:
        shell.controller.shutdown()
    assert "The task works on the new git branch ferrus/%s." % store.read_state().task_id \
        in out.getvalue()


def test_a_project_in_a_subfolder_commits_its_own_files_only(tmp_path):
    top = tmp_path / "top"
    project = top / "service"
    project.mkdir(parents=True)
    ferrus.init_project(str(project), report=lambda message: None)
    configure(project, POLICY)
    git(top, "init", "-q")
    git(top, "config", "user.name", "Test User")
    git(top, "config", "user.email", "test@example.com")
    write(top, "other/lib.py", "LIB = 1\n")
    write(project, "app.py", "print('hello')\n")
    git(top, "add", "-A")
    git(top, "commit", "-qm", "initial")
    write(project, "draft.md", "the user's draft\n")          # dirty before the task
    store = ferrus.Store(str(project))
    to_reviewing(store)
    write(project, "app.py", "print('task')\n")
    write(top, "other/lib.py", "LIB = 2\n")                   # outside the project
    submit(store)
    outcome = ferrus.op_approve(store, REVIEWER)
    assert committed_files(top) == ["M\tservice/app.py"], outcome.text
    assert "draft.md" in outcome.text
    status = git(top, "status", "--porcelain").stdout
    assert " M other/lib.py" in status and "?? service/draft.md" in status
