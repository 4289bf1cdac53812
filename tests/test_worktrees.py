"""Parallel tasks' git plumbing: task worktrees (create, remove, list) and where they go.

Every test builds a real git repository in a temporary folder (git is required)."""

import os
import shutil
import signal
import time

import pytest

import ferrus
from conftest import branches, git, write

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def rev(root, what="HEAD"):
    return git(root, "rev-parse", what).stdout.strip()


def registered(root):
    """The paths of the repository's worktrees, the main checkout first."""
    return [line[len("worktree "):] for line in
            git(root, "worktree", "list", "--porcelain").stdout.splitlines()
            if line.startswith("worktree ")]


@pytest.fixture
def repo(tmp_path):
    """A repository with an identity of its own and one commit on main."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    git(root, "config", "user.name", "Test User")
    git(root, "config", "user.email", "test@example.com")
    write(root, "app.py", "print('hello')\n")
    write(root, ".gitignore", ".ferrus/\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "initial")
    return str(root)


@pytest.fixture
def wt_dir(repo):
    return ferrus.default_worktree_dir(repo)


# -- where worktrees go -------------------------------------------------------------------

def test_the_default_worktree_folder_is_beside_the_repository(repo):
    top = os.path.realpath(repo)
    assert ferrus.default_worktree_dir(repo) == top + ".ferrus-worktrees"
    # From a project folder inside the repository: still beside the repository's top.
    os.makedirs(os.path.join(repo, "sub", "project"))
    assert ferrus.default_worktree_dir(os.path.join(repo, "sub", "project")) == (
        top + ".ferrus-worktrees")


def test_a_configured_folder_outside_the_repository_is_used_as_given(repo, tmp_path):
    assert ferrus.default_worktree_dir(repo, str(tmp_path / "elsewhere")) == os.path.realpath(
        str(tmp_path / "elsewhere"))
    # Relative paths are relative to the project root.
    assert ferrus.default_worktree_dir(repo, "../trees") == os.path.join(
        os.path.realpath(str(tmp_path)), "trees")


def test_a_configured_folder_inside_the_repository_must_be_git_ignored(repo):
    with pytest.raises(ferrus.FerrusError) as caught:
        ferrus.default_worktree_dir(repo, "worktrees")
    assert "inside the repository" in caught.value.message
    assert "not git-ignored" in caught.value.message
    assert "/worktrees/" in caught.value.hint and ".gitignore" in caught.value.hint
    # .ferrus/ is ignored (ferrus init says so), so a folder in it is fine.
    assert ferrus.default_worktree_dir(repo, ".ferrus/worktrees") == os.path.join(
        os.path.realpath(repo), ".ferrus", "worktrees")
    write(repo, ".gitignore", ".ferrus/\nworktrees/\n")
    assert ferrus.default_worktree_dir(repo, "worktrees").endswith("worktrees")


def test_the_repository_itself_or_its_git_folder_are_refused(repo):
    for configured in (".", ".git/trees"):
        with pytest.raises(ferrus.FerrusError) as caught:
            ferrus.default_worktree_dir(repo, configured)
        assert "worktree_dir" in caught.value.message and caught.value.hint


def test_no_repository_means_no_worktree_folder(tmp_path):
    with pytest.raises(ferrus.GitUnavailable):
        ferrus.default_worktree_dir(str(tmp_path))


# -- creating ----------------------------------------------------------------------------

def test_create_makes_a_worktree_on_a_new_branch_at_the_start_commit(repo, wt_dir):
    start = rev(repo)
    path = os.path.join(wt_dir, "t-1")
    made = ferrus.create_task_worktree(repo, path, "ferrus/t-1", start)
    assert made == {"path": path, "branch": "ferrus/t-1", "base": start}
    assert rev(path) == start and rev(repo, "ferrus/t-1") == start
    assert git(path, "symbolic-ref", "--short", "HEAD").stdout.strip() == "ferrus/t-1"
    assert open(os.path.join(path, "app.py")).read() == "print('hello')\n"
    # The user's checkout is untouched: still on main, nothing new in it.
    assert git(repo, "symbolic-ref", "--short", "HEAD").stdout.strip() == "main"
    assert git(repo, "status", "--porcelain").stdout == ""


def test_create_accepts_a_branch_name_as_start_and_reports_its_commit(repo, wt_dir):
    made = ferrus.create_task_worktree(repo, os.path.join(wt_dir, "t-1"), "ferrus/t-1", "main")
    assert made["base"] == rev(repo)


def test_create_again_for_the_same_worktree_returns_it(repo, wt_dir):
    start = rev(repo)
    path = os.path.join(wt_dir, "t-1")
    first = ferrus.create_task_worktree(repo, path, "ferrus/t-1", start)
    write(path, "work.txt", "in progress\n")             # an agent's uncommitted work stays
    assert ferrus.create_task_worktree(repo, path, "ferrus/t-1", start) == first
    assert os.path.exists(os.path.join(path, "work.txt"))
    assert len(registered(repo)) == 2


def test_create_again_after_the_target_moved_reports_where_the_branch_forked(repo, wt_dir):
    start = rev(repo)
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", start)
    write(repo, "later.txt", "x\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "later")
    again = ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    assert again["base"] == start


def test_create_refuses_a_path_taken_by_other_files(repo, wt_dir):
    path = os.path.join(wt_dir, "t-1")
    write(path, "mine.txt", "not ferrus's\n")
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    assert "already exists" in caught.value.message and caught.value.hint
    assert "ferrus/t-1" not in branches(repo)
    assert open(os.path.join(path, "mine.txt")).read() == "not ferrus's\n"


def test_create_uses_an_existing_empty_folder(repo, wt_dir):
    path = os.path.join(wt_dir, "t-1")
    os.makedirs(path)
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    assert os.path.exists(os.path.join(path, "app.py"))


def test_create_refuses_another_worktree_at_the_path(repo, wt_dir):
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.create_task_worktree(repo, path, "ferrus/t-2", rev(repo))
    assert "already the worktree of branch ferrus/t-1" in caught.value.message
    assert "ferrus/t-2" not in branches(repo)


def test_create_refuses_a_branch_checked_out_elsewhere(repo, wt_dir):
    ferrus.create_task_worktree(repo, os.path.join(wt_dir, "t-1"), "ferrus/t-1", rev(repo))
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.create_task_worktree(repo, os.path.join(wt_dir, "other"), "ferrus/t-1",
                                    rev(repo))
    assert "already checked out at" in caught.value.message
    assert not os.path.exists(os.path.join(wt_dir, "other"))


def test_create_refuses_an_existing_branch_with_commits_of_its_own(repo, wt_dir):
    git(repo, "branch", "ferrus/t-1")
    git(repo, "checkout", "-q", "ferrus/t-1")
    write(repo, "theirs.txt", "x\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "someone's work")
    git(repo, "checkout", "-q", "main")
    own = rev(repo, "ferrus/t-1")
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.create_task_worktree(repo, os.path.join(wt_dir, "t-1"), "ferrus/t-1", rev(repo))
    assert "already exists, with commits" in caught.value.message
    assert rev(repo, "ferrus/t-1") == own and len(registered(repo)) == 1


def test_a_branch_left_without_its_worktree_is_taken_when_it_holds_nothing_new(repo, wt_dir):
    # What a crash between `git branch` and the checkout of `git worktree add` leaves.
    start = rev(repo)
    git(repo, "branch", "ferrus/t-1", start)
    path = os.path.join(wt_dir, "t-1")
    assert ferrus.create_task_worktree(repo, path, "ferrus/t-1", start)["base"] == start
    assert rev(path) == start


def test_a_half_made_worktree_is_made_again(repo, wt_dir):
    start = rev(repo)
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", start)
    # As if `git worktree add` were killed before its checkout: git's "initializing"
    # lock is still there, the index and the files are not.
    admin = ferrus.worktree_admin_dir(ferrus.common_git_dir(repo), path)
    with open(os.path.join(admin, "locked"), "w") as handle:
        handle.write("initializing")
    os.unlink(os.path.join(admin, "index"))
    os.unlink(os.path.join(path, "app.py"))
    made = ferrus.create_task_worktree(repo, path, "ferrus/t-1", start)
    assert made["base"] == start
    assert open(os.path.join(path, "app.py")).read() == "print('hello')\n"
    assert git(path, "status", "--porcelain").stdout == ""
    assert "locked" not in git(repo, "worktree", "list", "--porcelain").stdout


def test_a_worktree_whose_folder_was_deleted_is_put_back_with_its_commits(repo, wt_dir):
    start = rev(repo)
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", start)
    write(path, "done.txt", "work\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "task work")
    work = rev(path)
    shutil.rmtree(path)
    made = ferrus.create_task_worktree(repo, path, "ferrus/t-1", start)
    assert made["base"] == start and rev(path) == work
    assert os.path.exists(os.path.join(path, "done.txt"))


def test_create_with_a_bad_start_commit_or_branch_name_is_a_clear_error(repo, wt_dir):
    with pytest.raises(ferrus.GitError):
        ferrus.create_task_worktree(repo, os.path.join(wt_dir, "t-1"), "ferrus/t-1", "nope")
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.create_task_worktree(repo, os.path.join(wt_dir, "t-2"), "bad name", rev(repo))
    assert "no valid branch name" in caught.value.message
    assert branches(repo) == ["main"] and len(registered(repo)) == 1


# -- removing ----------------------------------------------------------------------------

def test_remove_deletes_the_worktree_its_changes_and_its_branch(repo, wt_dir):
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    write(path, "scratch.txt", "uncommitted\n")
    done = ferrus.remove_task_worktree(repo, path, "ferrus/t-1")
    assert done == {"path": path, "branch": "ferrus/t-1", "removed": True,
                    "branch_deleted": True}
    assert not os.path.exists(path) and branches(repo) == ["main"]
    assert len(registered(repo)) == 1
    # Again: everything is gone already, which is fine.
    assert ferrus.remove_task_worktree(repo, path, "ferrus/t-1") == dict(
        done, removed=False, branch_deleted=False)


def test_remove_without_a_branch_name_removes_only_the_worktree(repo, wt_dir):
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    done = ferrus.remove_task_worktree(repo, path, None)
    assert done["removed"] and not done["branch_deleted"]
    assert "ferrus/t-1" in branches(repo) and not os.path.exists(path)


def test_remove_can_keep_the_branch(repo, wt_dir):
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    ferrus.remove_task_worktree(repo, path, "ferrus/t-1", delete_branch=False)
    assert "ferrus/t-1" in branches(repo) and not os.path.exists(path)


def test_remove_deletes_a_damaged_or_deleted_worktree(repo, wt_dir):
    damaged, deleted = os.path.join(wt_dir, "t-1"), os.path.join(wt_dir, "t-2")
    ferrus.create_task_worktree(repo, damaged, "ferrus/t-1", rev(repo))
    ferrus.create_task_worktree(repo, deleted, "ferrus/t-2", rev(repo))
    os.unlink(os.path.join(damaged, ".git"))     # git no longer knows the folder as its own
    shutil.rmtree(deleted)
    assert ferrus.remove_task_worktree(repo, deleted, "ferrus/t-2")["removed"]
    assert ferrus.remove_task_worktree(repo, damaged, "ferrus/t-1")["removed"]
    assert not os.path.exists(damaged) and len(registered(repo)) == 1
    assert branches(repo) == ["main"]


def test_remove_leaves_folders_that_are_not_worktrees_and_the_main_checkout(repo, wt_dir):
    stranger = os.path.join(wt_dir, "stranger")
    write(stranger, "keep.txt", "mine\n")
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.remove_task_worktree(repo, stranger, "ferrus/t-9")
    assert "not a worktree of this repository" in caught.value.message
    assert os.path.exists(os.path.join(stranger, "keep.txt"))
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.remove_task_worktree(repo, repo, "main")
    assert "main checkout" in caught.value.message
    assert os.path.exists(os.path.join(repo, "app.py")) and "main" in branches(repo)


def test_remove_leaves_the_worktree_of_another_branch(repo, wt_dir, tmp_path):
    theirs = str(tmp_path / "users-own-worktree")
    git(repo, "worktree", "add", "-q", "-b", "feature", theirs)
    write(theirs, "draft.txt", "uncommitted work\n")
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.remove_task_worktree(repo, theirs, "ferrus/t-1")
    assert "worktree of branch feature, not of ferrus/t-1" in caught.value.message
    assert os.path.exists(os.path.join(theirs, "draft.txt")) and "feature" in branches(repo)


def test_remove_will_not_delete_a_branch_checked_out_in_the_users_checkout(repo, wt_dir):
    git(repo, "checkout", "-q", "-b", "ferrus/t-1")
    with pytest.raises(ferrus.GitError):
        ferrus.remove_task_worktree(repo, os.path.join(wt_dir, "t-1"), "ferrus/t-1")
    assert "ferrus/t-1" in branches(repo)


# -- listing -----------------------------------------------------------------------------

def test_list_shows_every_task_worktree_and_branch_for_doctor(repo, wt_dir):
    start = rev(repo)
    live, gone = os.path.join(wt_dir, "t-1"), os.path.join(wt_dir, "t-2")
    ferrus.create_task_worktree(repo, live, "ferrus/t-1", start)
    ferrus.create_task_worktree(repo, gone, "ferrus/t-2", start)
    shutil.rmtree(gone)
    git(repo, "branch", "ferrus/t-3")                 # a branch whose worktree was removed
    git(repo, "branch", "feature")                    # not ferrus's
    rows = ferrus.list_task_worktrees(repo, "ferrus/")
    assert [(r["branch"], r["path"], r["exists"], bool(r["prunable"])) for r in rows] == [
        ("ferrus/t-1", live, True, False),
        ("ferrus/t-2", gone, False, True),
        ("ferrus/t-3", None, False, False)]
    assert all(r["head"] == start and not r["main"] and not r["rebasing"] for r in rows)


def test_list_marks_the_main_checkout_and_finds_a_worktree_in_a_rebase(repo, wt_dir):
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    write(path, "app.py", "print('task')\n")
    git(path, "commit", "-qam", "task")
    write(repo, "app.py", "print('main')\n")
    git(repo, "commit", "-qam", "main")
    assert git(path, "rebase", "main", check=False).returncode != 0   # stops on the conflict
    git(repo, "checkout", "-q", "-b", "ferrus/seq")   # the one-task [git] branch mode
    rows = {r["branch"]: r for r in ferrus.list_task_worktrees(repo, "ferrus/")}
    assert rows["ferrus/t-1"]["rebasing"] and rows["ferrus/t-1"]["path"] == path
    assert rows["ferrus/seq"]["main"] and not rows["ferrus/t-1"]["main"]


def test_a_worktree_path_with_a_newline_lists_whole(repo, tmp_path):
    path = str(tmp_path / "odd\nname")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    assert [r["path"] for r in ferrus.list_task_worktrees(repo, "ferrus/")] == [path]
    assert ferrus.remove_task_worktree(repo, path, "ferrus/t-1")["removed"]


def test_target_head_names_the_branch_commit_or_none(repo):
    assert ferrus.target_head(repo, "main") == rev(repo)
    assert ferrus.target_head(repo, "missing") is None


# -- a submission recorded as a commit; the merge gate's candidate ------------------------

EXCLUDE = ferrus.diff_exclusions()


def commit_all(root, message):
    git(root, "add", "-A")
    git(root, "commit", "-qm", message)
    return rev(root)


def files_at(root, commit):
    return sorted(git(root, "ls-tree", "-r", "--name-only", commit).stdout.split())


def show(root, commit, path):
    return git(root, "show", "%s:%s" % (commit, path)).stdout


@pytest.fixture
def task(repo, wt_dir):
    """A task's worktree on branch ferrus/t-1, started at main's head."""
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    return path


def base_of(repo):
    return git(repo, "merge-base", "main", "ferrus/t-1").stdout.strip()


def submit(repo, task, summary="Did it."):
    """The task's worktree recorded as its submission (what the reviewer reads)."""
    return ferrus.snapshot_worktree(ferrus.task_checkout(repo, task), base_of(repo), EXCLUDE,
                                    summary)


def gate(repo, wt_dir):
    return ferrus.gate_checkout(repo, wt_dir, rev(repo, "main"))


def candidate(repo, task, wt_dir, message="Task t-1", history="squash"):
    submitted = submit(repo, task)
    return ferrus.build_candidate(gate(repo, wt_dir), "main", rev(repo, "main"),
                                  [(submitted, message)], history)


def test_a_submission_holds_the_worktrees_files_but_never_ferrus_files(repo, task):
    start = rev(repo)
    write(task, "feature.py", "def feature():\n    return 1\n")
    write(task, "app.py", "print('hello, task')\n")
    for rel in (".mcp.json", ".codex/config.toml", ".claude/settings.local.json",
                ".agents/skills/ferrus/SKILL.md"):
        write(task, rel, "registration\n")
    git(task, "add", ".mcp.json")                     # an agent staged one by hand
    git(task, "add", "-f", ".agents/skills/ferrus/SKILL.md")
    git(task, "commit", "-qm", "the agent's own commit of ferrus's files")
    write(task, ".ferrus/tasks/t-evil/task.json", '{"status": "queued"}\n')
    git(task, "add", "-f", ".ferrus")
    git(task, "commit", "-qm", "a task record planted in the branch")
    commit = submit(repo, task, "Added feature().")
    assert files_at(task, commit) == [".gitignore", "app.py", "feature.py"]
    assert git(repo, "rev-parse", commit + "^").stdout.strip() == start
    assert git(repo, "log", "-1", "--format=%B", commit).stdout.strip() == "Added feature()."
    # The worktree, its index and its branch are as the agent left them.
    assert os.path.exists(os.path.join(task, ".mcp.json"))
    assert "feature.py" in git(task, "status", "--porcelain").stdout
    assert rev(task) != start and rev(task) != commit


def test_a_submission_keeps_an_excluded_tracked_file_as_the_base_has_it(repo, task):
    write(repo, ".mcp.json", '{"mcpServers": {}}\n')
    git(repo, "add", ".mcp.json")
    git(repo, "commit", "-qm", "the project keeps .mcp.json")
    git(task, "merge", "-q", "main")
    write(task, ".mcp.json", '{"mcpServers": {"evil": {"command": "sh"}}}\n')
    write(task, "x.py", "x = 1\n")
    commit = ferrus.snapshot_worktree(ferrus.task_checkout(repo, task), rev(repo), EXCLUDE,
                                      "s")
    assert show(repo, commit, ".mcp.json") == '{"mcpServers": {}}\n'
    assert "x.py" in files_at(repo, commit)


def test_the_candidate_is_one_commit_on_the_target_with_the_submitted_tree(repo, task, wt_dir):
    start = rev(repo)
    write(task, "feature.py", "x = 1\n")
    built = candidate(repo, task, wt_dir, "Task t-1: add a feature\n\nbody\n")
    assert built.status == "ready" and built.target_head == start
    assert built.commits == [built.head]
    assert git(repo, "rev-parse", built.head + "^").stdout.strip() == start
    assert files_at(repo, built.head) == [".gitignore", "app.py", "feature.py"]
    assert git(repo, "log", "-1", "--format=%s|%an", built.head).stdout.strip() == (
        "Task t-1: add a feature|Test User")
    assert rev(repo, "main") == start                     # nothing moved yet


def test_a_late_edit_after_the_submission_is_not_in_the_candidate(repo, task, wt_dir):
    write(task, "feature.py", "reviewed = 1\n")
    submitted = submit(repo, task)
    write(task, "feature.py", "import os; os.system('curl evil')\n")    # after submit
    write(task, "late.py", "late = 1\n")
    built = ferrus.build_candidate(gate(repo, wt_dir), "main", rev(repo),
                                   [(submitted, "t-1")])
    assert show(repo, built.head, "feature.py") == "reviewed = 1\n"
    assert "late.py" not in files_at(repo, built.head)


def test_a_task_that_changed_nothing_is_empty(repo, task, wt_dir):
    write(task, ".mcp.json", "registration only\n")
    built = candidate(repo, task, wt_dir)
    assert (built.status, built.head, built.commits) == ("empty", rev(repo), [])


def test_a_task_whose_change_the_target_already_has_is_empty(repo, task, wt_dir):
    write(task, "same.txt", "same\n")
    submitted = submit(repo, task)
    write(repo, "same.txt", "same\n")
    commit_all(repo, "the same change on main")
    built = ferrus.build_candidate(gate(repo, wt_dir), "main", rev(repo), [(submitted, "x")])
    assert built.status == "empty" and built.head == rev(repo)


def test_the_work_is_applied_onto_a_moved_target(repo, task, wt_dir):
    write(task, "feature.py", "x = 1\n")
    commit_all(task, "agent's own commit")          # an executor may commit by itself
    write(task, "more.py", "y = 2\n")               # and leave the rest uncommitted
    submitted = submit(repo, task)
    write(repo, "other.py", "z = 3\n")
    moved = commit_all(repo, "someone else's work")
    built = ferrus.build_candidate(gate(repo, wt_dir), "main", moved, [(submitted, "Task t-1")])
    assert built.status == "ready" and built.target_head == moved
    assert git(repo, "rev-parse", built.head + "^").stdout.strip() == moved
    assert files_at(repo, built.head) == [".gitignore", "app.py", "feature.py", "more.py",
                                          "other.py"]
    done = ferrus.fast_forward_target(repo, "main", moved, built.head)
    assert (done.status, done.head, done.checkout) == ("done", built.head,
                                                       os.path.realpath(repo))
    assert rev(repo) == built.head and git(repo, "status", "--porcelain").stdout == ""
    # Asked again (a retry after a crash): already done.
    assert ferrus.fast_forward_target(repo, "main", moved, built.head).status == "done"


def test_merge_history_adds_the_tasks_commit_and_a_merge(repo, task, wt_dir):
    write(task, "feature.py", "x = 1\n")
    submitted = submit(repo, task)
    start = base_of(repo)
    write(repo, "other.py", "z = 3\n")
    moved = commit_all(repo, "someone else's work")
    built = ferrus.build_candidate(gate(repo, wt_dir), "main", moved,
                                   [(submitted, "Task t-1")], "merge")
    own, merged = built.commits
    assert built.head == merged
    assert git(repo, "rev-parse", own + "^").stdout.strip() == start
    assert git(repo, "rev-list", "--parents", "-n", "1", merged).stdout.split()[1:] == [
        moved, own]
    assert set(files_at(repo, merged)) >= {"feature.py", "other.py"}
    # Without target changes: just the task's commit.
    git(repo, "reset", "-q", "--hard", start)
    again = ferrus.build_candidate(gate(repo, wt_dir), "main", start,
                                   [(submitted, "Task t-1")], "merge")
    assert len(again.commits) == 1 and again.head == again.commits[0]


def test_linear_history_makes_a_commit_per_step(repo, task, wt_dir):
    start = rev(repo)
    write(task, "a.txt", "1\n")
    first = submit(repo, task, "first")
    write(task, "a.txt", "2\n")
    second_tree = git(repo, "rev-parse", submit(repo, task, "second") + "^{tree}").stdout.strip()
    chained = ferrus.commit_tree(repo, second_tree, [first], "second")
    built = ferrus.build_candidate(gate(repo, wt_dir), "main", start,
                                   [(first, "one"), (chained, "two")], "linear")
    assert len(built.commits) == 2
    assert git(repo, "log", "--format=%s", start + ".." + built.head).stdout.split() == [
        "two", "one"]
    assert show(repo, built.commits[0], "a.txt") == "1\n"
    assert show(repo, built.head, "a.txt") == "2\n"
    folded = ferrus.rechain(repo, start, [(second_tree, "one\ntwo")])
    assert git(repo, "rev-parse", folded + "^").stdout.strip() == start


def edit_the_same_line(repo, task):
    write(task, "app.py", "print('hello from the task')\n")
    write(repo, "app.py", "print('hello from main')\n")
    return commit_all(repo, "main changes the greeting")


@pytest.mark.parametrize("history", ["squash", "linear"])
def test_a_single_commit_candidate_leaves_the_gate_exactly_at_it(repo, task, wt_dir, history):
    """The merge gate checks a one-commit candidate without resetting its checkout
    first: the build leaves HEAD, the index and the files at that commit, nothing
    untracked or ignored (a spec milestone ticked in it included)."""
    write(task, "feature.py", "def feature():\n    return 1\n")
    submitted = submit(repo, task)
    the_gate = gate(repo, wt_dir)
    write(the_gate.work_tree, "leftover.txt", "from the last check\n")
    ticked = os.path.join(the_gate.work_tree, "app.py")

    def tick():
        with open(ticked, "a") as handle:
            handle.write("# ticked\n")
        return [ticked]
    built = ferrus.build_candidate(the_gate, "main", rev(repo, "main"),
                                   [(submitted, "Task t-1")], history, edit=tick)
    assert built.status == "ready" and built.commits == [built.head]
    assert git(the_gate.work_tree, "rev-parse", "HEAD").stdout.strip() == built.head
    assert git(the_gate.work_tree, "status", "--porcelain", "--ignored",
               "--untracked-files=all").stdout == ""
    assert show(repo, built.head, "app.py").endswith("# ticked\n")


def test_a_conflict_is_handed_over_as_a_commit_with_markers(repo, task, wt_dir):
    write(task, "unrelated.py", "fine = True\n")
    write(task, "app.py", "print('hello from the task')\n")
    submitted = submit(repo, task)
    write(repo, "app.py", "print('hello from main')\n")
    target = commit_all(repo, "main changes the greeting")
    the_gate = gate(repo, wt_dir)
    built = ferrus.build_candidate(the_gate, "main", target, [(submitted, "Task t-1")])
    assert built.status == "conflict" and built.conflicts == ["app.py"]
    assert built.target_head == target and built.commits == []
    text = built.text
    assert "conflicts in 1 file: app.py" in text and "app.py, line 1" in text
    task_side = text.index("the task's side:")
    main_side = text.index("main's side (at %s)" % target[:12])
    assert task_side < text.index("hello from the task") < main_side
    assert text.index("hello from main") > main_side
    # The hand-over commit: on the target, the task's work in it, markers left.
    assert git(repo, "rev-parse", built.head + "^").stdout.strip() == target
    handed = show(repo, built.head, "app.py")
    assert "<<<<<<<" in handed and "hello from the task" in handed and "hello from main" in handed
    assert show(repo, built.head, "unrelated.py") == "fine = True\n"
    assert ferrus.markers_left(repo, built.head, ["app.py", "unrelated.py", "gone.txt"]) == [
        "app.py"]
    # The gate is clean again; the target is untouched.
    assert git(the_gate.work_tree, "status", "--porcelain").stdout == ""
    assert rev(repo) == target
    # The executor's worktree goes to the hand-over commit, back on its own branch even
    # when the executor had switched it elsewhere.
    git(task, "checkout", "-q", "--detach")
    ferrus.move_task_worktree(ferrus.task_checkout(repo, task), "ferrus/t-1", built.head)
    assert rev(task) == built.head == rev(repo, "ferrus/t-1")
    assert git(task, "rev-parse", "--abbrev-ref", "HEAD").stdout.strip() == "ferrus/t-1"
    assert rev(repo, "main") == target


def test_two_tasks_on_the_same_lines_the_second_conflicts_then_merges(repo, wt_dir):
    start = rev(repo)
    first, second = os.path.join(wt_dir, "t-1"), os.path.join(wt_dir, "t-2")
    ferrus.create_task_worktree(repo, first, "ferrus/t-1", start)
    ferrus.create_task_worktree(repo, second, "ferrus/t-2", start)
    write(first, "app.py", "print('one')\n")
    write(second, "app.py", "print('two')\n")
    one = ferrus.build_candidate(gate(repo, wt_dir), "main", start, [(
        ferrus.snapshot_worktree(ferrus.task_checkout(repo, first), start, EXCLUDE, "1"), "t-1")])
    assert ferrus.fast_forward_target(repo, "main", start, one.head).status == "done"
    two_checkout = ferrus.task_checkout(repo, second)
    two = ferrus.build_candidate(gate(repo, wt_dir), "main", one.head, [(
        ferrus.snapshot_worktree(two_checkout, start, EXCLUDE, "2"), "t-2")])
    assert two.status == "conflict" and two.conflicts == ["app.py"]
    ferrus.move_task_worktree(two_checkout, "ferrus/t-2", two.head)
    write(second, "app.py", "print('one')\nprint('two')\n")          # resolved by editing
    resolved = ferrus.snapshot_worktree(two_checkout, one.head, EXCLUDE, "resolved")
    assert ferrus.markers_left(repo, resolved, ["app.py"]) == []
    again = ferrus.build_candidate(gate(repo, wt_dir), "main", one.head, [(resolved, "t-2")])
    assert again.status == "ready"
    assert ferrus.fast_forward_target(repo, "main", one.head, again.head).status == "done"
    assert open(os.path.join(repo, "app.py")).read() == "print('one')\nprint('two')\n"
    assert git(repo, "rev-list", "--count", start + "..main").stdout.strip() == "2"


def test_a_file_deleted_on_one_side_is_named(repo, task, wt_dir):
    os.unlink(os.path.join(task, "app.py"))
    submitted = submit(repo, task)
    write(repo, "app.py", "print('changed on main')\n")
    moved = commit_all(repo, "main edits app.py")
    built = ferrus.build_candidate(gate(repo, wt_dir), "main", moved, [(submitted, "t-1")])
    assert built.status == "conflict" and built.conflicts == ["app.py"]
    assert "app.py: the task deleted it, main (at " in built.text


def test_a_long_conflict_is_cut_to_a_few_kib(repo, task, wt_dir):
    for index in range(40):
        write(task, "f%02d.txt" % index, "task\n" * 30)
    submitted = submit(repo, task)
    for index in range(40):
        write(repo, "f%02d.txt" % index, "main\n" * 30)
    moved = commit_all(repo, "main writes the same files")
    built = ferrus.build_candidate(gate(repo, wt_dir), "main", moved, [(submitted, "t-1")])
    assert built.status == "conflict" and len(built.conflicts) == 40
    assert len(built.text) <= ferrus.CONFLICT_TEXT_CHARS + 200
    assert "more lines]" in built.text and "left out" in built.text


def test_a_conflict_in_a_minified_file_shows_its_lines_cut(repo, task, wt_dir):
    write(task, "bundle.min.js", "var task=1;" * 2000 + "\n")
    submitted = submit(repo, task)
    write(repo, "bundle.min.js", "var main=2;" * 2000 + "\n")
    moved = commit_all(repo, "main builds the bundle")
    built = ferrus.build_candidate(gate(repo, wt_dir), "main", moved, [(submitted, "t-1")])
    assert built.conflicts == ["bundle.min.js"] and len(built.text) < 1000
    assert "var task=1;" in built.text and "var main=2;" in built.text


def test_no_hook_runs_when_the_candidate_is_built_or_merged(repo, task, wt_dir, tmp_path):
    ran = str(tmp_path / "hook-ran")
    for name in ("pre-commit", "commit-msg", "post-commit", "post-checkout", "post-merge",
                 "post-rewrite", "reference-transaction"):
        write(os.path.join(repo, ".git", "hooks"), name, "#!/bin/sh\necho %s >> %s\n"
              % (name, ran))
        os.chmod(os.path.join(repo, ".git", "hooks", name), 0o755)
    write(task, "feature.py", "x = 1\n")
    built = candidate(repo, task, wt_dir)
    assert ferrus.fast_forward_target(repo, "main", built.target_head, built.head).status == (
        "done")
    assert not os.path.exists(ran)


def test_no_identity_is_an_error_for_the_user_not_the_executor(repo, task, wt_dir, monkeypatch,
                                                               tmp_path):
    for name in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME",
                 "GIT_COMMITTER_EMAIL", "EMAIL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    git(repo, "config", "--unset", "user.name")
    git(repo, "config", "--unset", "user.email")
    git(repo, "config", "user.useConfigOnly", "true")
    write(task, "feature.py", "x = 1\n")
    submitted = submit(repo, task)                # ferrus's own record needs no identity
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.build_candidate(gate(repo, wt_dir), "main", rev(repo), [(submitted, "t-1")])
    assert "user.email" in caught.value.hint


# -- the gate's own checkout --------------------------------------------------------------

def test_the_gate_is_cleaned_of_ignored_files_before_each_use(repo, task, wt_dir):
    the_gate = gate(repo, wt_dir)
    ferrus.reset_gate(the_gate, rev(repo))
    write(the_gate.work_tree, "build/cache.txt", "left by an earlier check\n")
    write(the_gate.work_tree, "app.py", "changed by an earlier check\n")
    ferrus.reset_gate(the_gate, rev(repo))
    assert not os.path.exists(os.path.join(the_gate.work_tree, "build"))
    assert open(os.path.join(the_gate.work_tree, "app.py")).read() == "print('hello')\n"


def test_a_tampered_gate_is_made_again(repo, wt_dir):
    the_gate = gate(repo, wt_dir)
    write(the_gate.work_tree, ".git", "gitdir: %s\n" % os.path.join(repo, ".git"))
    again = gate(repo, wt_dir)
    assert again.git_dir == the_gate.git_dir or os.path.isdir(again.git_dir)
    assert ferrus.task_checkout(repo, again.work_tree).work_tree == again.work_tree
    assert git(repo, "status", "--porcelain").stdout == ""


def test_a_folder_in_the_way_of_the_gate_is_refused(repo, wt_dir):
    write(os.path.join(wt_dir, ferrus.GATE_FOLDER), "mine.txt", "not ferrus's\n")
    with pytest.raises(ferrus.GitError) as caught:
        gate(repo, wt_dir)
    assert "in the way" in caught.value.message
    assert os.path.exists(os.path.join(wt_dir, ferrus.GATE_FOLDER, "mine.txt"))


# -- moving the target ------------------------------------------------------------------

def test_a_target_checked_out_nowhere_moves_by_compare_and_swap(repo, task, wt_dir):
    git(repo, "checkout", "-q", "--detach")               # main is checked out nowhere
    write(task, "feature.py", "x = 1\n")
    result = candidate(repo, task, wt_dir)
    done = ferrus.fast_forward_target(repo, "main", result.target_head, result.head)
    assert (done.status, done.checkout) == ("done", None)
    assert rev(repo, "main") == result.head
    assert "ferrus: integrate" in git(repo, "reflog", "-1", "main").stdout
    # The user's detached checkout did not move.
    assert rev(repo) == result.target_head


def test_a_target_that_moved_meanwhile_is_not_touched(repo, task, wt_dir):
    write(task, "feature.py", "x = 1\n")
    result = candidate(repo, task, wt_dir)
    write(repo, "late.py", "late = 1\n")
    late = commit_all(repo, "committed during the checks")
    moved = ferrus.fast_forward_target(repo, "main", result.target_head, result.head)
    assert (moved.status, moved.head) == ("moved", late) and rev(repo) == late
    git(repo, "checkout", "-q", "--detach")               # and where it is checked out nowhere
    moved = ferrus.fast_forward_target(repo, "main", result.target_head, result.head)
    assert (moved.status, moved.head) == ("moved", late) and rev(repo, "main") == late


def test_a_dirty_checkout_of_the_target_waits_and_keeps_the_users_change(repo, task, wt_dir):
    write(task, "app.py", "print('task')\n")
    write(task, "new.py", "new = 1\n")
    result = candidate(repo, task, wt_dir)
    old = result.target_head
    write(repo, "app.py", "print('my own edit')\n")      # tracked, changed by the task too
    write(repo, "new.py", "mine\n")                      # untracked where the task adds one
    dirty = ferrus.fast_forward_target(repo, "main", old, result.head)
    assert (dirty.status, dirty.files, dirty.head) == ("dirty", ["app.py", "new.py"], old)
    assert "app.py, new.py" in dirty.text
    assert rev(repo) == old
    assert open(os.path.join(repo, "app.py")).read() == "print('my own edit')\n"
    assert open(os.path.join(repo, "new.py")).read() == "mine\n"
    # Once the user moves their changes away, it goes through.
    os.unlink(os.path.join(repo, "new.py"))
    git(repo, "checkout", "--", "app.py")
    assert ferrus.fast_forward_target(repo, "main", old, result.head).status == "done"


def test_a_file_where_the_task_makes_a_folder_waits_too(repo, task, wt_dir):
    write(task, "docs/guide.md", "# Guide\n")
    result = candidate(repo, task, wt_dir)
    write(repo, "docs", "my notes, in a file called docs\n")
    dirty = ferrus.fast_forward_target(repo, "main", result.target_head, result.head)
    assert (dirty.status, dirty.files) == ("dirty", ["docs"])
    assert open(os.path.join(repo, "docs")).read() == "my notes, in a file called docs\n"


def test_other_uncommitted_changes_in_the_checkout_are_carried_along(repo, task, wt_dir):
    write(task, "feature.py", "x = 1\n")
    result = candidate(repo, task, wt_dir)
    write(repo, "app.py", "print('my own edit')\n")
    write(repo, "notes.txt", "mine\n")
    git(repo, "add", "notes.txt")
    done = ferrus.fast_forward_target(repo, "main", result.target_head, result.head)
    assert done.status == "done" and rev(repo) == result.head
    assert open(os.path.join(repo, "app.py")).read() == "print('my own edit')\n"
    assert sorted(git(repo, "status", "--porcelain").stdout.splitlines()) == [
        " M app.py", "A  notes.txt"]


def test_an_ignored_file_where_the_task_writes_one_is_not_overwritten(repo, task, wt_dir):
    write(task, ".gitignore", ".ferrus/\n")
    write(task, "settings.env", "from the task\n")
    result = candidate(repo, task, wt_dir)
    write(repo, ".gitignore", ".ferrus/\n*.env\n")       # the user ignores it locally
    write(repo, "settings.env", "SECRET=mine\n")
    git(repo, "update-index", "--assume-unchanged", ".gitignore")
    dirty = ferrus.fast_forward_target(repo, "main", result.target_head, result.head)
    assert dirty.status == "dirty" and dirty.files == ["settings.env"]
    assert open(os.path.join(repo, "settings.env")).read() == "SECRET=mine\n"


def test_a_merge_or_rebase_in_progress_on_the_target_waits(repo, task, wt_dir):
    other = os.path.join(wt_dir, "t-2")
    ferrus.create_task_worktree(repo, other, "ferrus/t-2", rev(repo))
    write(other, "app.py", "print('other')\n")
    commit_all(other, "other")
    write(repo, "app.py", "print('main')\n")
    git(repo, "commit", "-qam", "main")
    write(task, "feature.py", "x = 1\n")
    result = candidate(repo, task, wt_dir)
    assert git(repo, "merge", "ferrus/t-2", check=False).returncode != 0
    head = rev(repo)
    dirty = ferrus.fast_forward_target(repo, "main", head, result.head)
    assert dirty.status == "dirty" and "merge is in progress" in dirty.text
    git(repo, "merge", "--abort")
    assert git(repo, "rebase", "ferrus/t-2", check=False).returncode != 0   # HEAD detached
    dirty = ferrus.fast_forward_target(repo, "main", head, result.head)
    assert dirty.status == "dirty" and "rebase of main is in progress" in dirty.text
    git(repo, "rebase", "--abort")
    assert rev(repo, "main") == head


def test_only_a_fast_forward_is_allowed(repo, task):
    write(task, "feature.py", "x = 1\n")
    side = commit_all(task, "task")
    write(repo, "other.py", "z = 3\n")
    old = commit_all(repo, "main")
    with pytest.raises(ferrus.GitError) as caught:
        ferrus.fast_forward_target(repo, "main", old, side)
    assert "not a fast-forward" in caught.value.message and rev(repo) == old


@pytest.mark.skipif(os.name == "nt", reason="a shell-script git wrapper")
def test_a_git_older_than_2_36_lists_worktrees_without_nul(repo, wt_dir, tmp_path,
                                                            monkeypatch):
    real = shutil.which("git")
    bin_dir = tmp_path / "old-git"
    write(str(bin_dir), "git", '#!/bin/sh\nfor arg in "$@"; do\n  if [ "$arg" = "-z" ] && '
          'echo "$*" | grep -q "worktree list"; then\n    echo "error: unknown switch '
          '\\`z\'" >&2; exit 129\n  fi\ndone\nexec "%s" "$@"\n' % real)
    os.chmod(str(bin_dir / "git"), 0o755)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ["PATH"])
    monkeypatch.setattr(ferrus, "_WORKTREE_LIST_NUL", [])
    path = os.path.join(wt_dir, "t-1")
    ferrus.create_task_worktree(repo, path, "ferrus/t-1", rev(repo))
    assert [r["path"] for r in ferrus.list_task_worktrees(repo, "ferrus/")] == [path]
    assert ferrus._WORKTREE_LIST_NUL == [False]
    assert ferrus.remove_task_worktree(repo, path, "ferrus/t-1")["removed"]
