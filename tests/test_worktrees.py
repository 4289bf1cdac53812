"""Parallel tasks' git plumbing: task worktrees (create, remove, list) and where they go.

Every test builds a real git repository in a temporary folder (git is required)."""

import os
import shutil
import subprocess

import pytest

import ferrus
from test_git_diff import write

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(root, *args, check=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", "-c", "init.defaultBranch=main"] + list(args), cwd=str(root),
                          env=env, capture_output=True, text=True, check=check)


def rev(root, what="HEAD"):
    return git(root, "rev-parse", what).stdout.strip()


def branches(root):
    return git(root, "for-each-ref", "--format=%(refname:short)", "refs/heads/").stdout.split()


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
    admin = ferrus._worktree_git_dir(path)
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
