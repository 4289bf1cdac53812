"""A conflict handed to the executor as files to edit: ferrus merges the target into the
task's branch itself (markers left in the files), finds markers left, and squashes the
resolved branch into one commit on the target."""

import os
import subprocess

import ferrus


def git(root, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", "-c", "init.defaultBranch=main"] + list(args), cwd=str(root),
                          env=env, capture_output=True, text=True, check=True).stdout


def write(root, name, text):
    with open(os.path.join(str(root), name), "w") as handle:
        handle.write(text)


def repo_with_a_conflict(tmp_path, monkeypatch):
    for name, value in (("NAME", "t"), ("EMAIL", "t@example.com")):
        monkeypatch.setenv("GIT_AUTHOR_" + name, value)
        monkeypatch.setenv("GIT_COMMITTER_" + name, value)
    root = tmp_path / "r"
    root.mkdir()
    git(root, "init", "-q")
    write(root, "a.txt", "one\n")
    write(root, "b.txt", "b\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    git(root, "branch", "task")
    write(root, "a.txt", "target side\n")
    git(root, "commit", "-qam", "target")
    worktree = tmp_path / "wt"
    git(root, "worktree", "add", "-q", str(worktree), "task")
    write(worktree, "a.txt", "task side\n")
    write(worktree, "c.txt", "new\n")
    git(worktree, "commit", "-qam", "task work")
    git(worktree, "add", "c.txt")
    git(worktree, "commit", "-qm", "more")
    return root, worktree


def test_the_target_is_merged_in_with_markers_and_the_worktree_left_clean(tmp_path, monkeypatch):
    root, worktree = repo_with_a_conflict(tmp_path, monkeypatch)
    target = git(root, "rev-parse", "main").strip()
    base, paths = ferrus.merge_leaving_conflicts(str(worktree), "main", "ferrus: merged")
    assert base == target and paths == ["a.txt"]
    assert git(worktree, "status", "--porcelain") == ""
    assert git(worktree, "rev-parse", "HEAD^").strip() == target       # one commit on it
    assert git(worktree, "rev-parse", "--abbrev-ref", "HEAD").strip() == "task"
    text = open(os.path.join(str(worktree), "a.txt")).read()
    assert "<<<<<<<" in text and "task side" in text and "target side" in text
    assert open(os.path.join(str(worktree), "c.txt")).read() == "new\n"
    assert ferrus.conflict_markers_left(str(worktree), ["a.txt", "c.txt", "gone.txt"]) == \
        ["a.txt"]
    # the executor resolves it by editing the file
    write(worktree, "a.txt", "both sides\n")
    git(worktree, "commit", "-qam", "resolved")
    assert ferrus.conflict_markers_left(str(worktree), ["a.txt"]) == []
    squashed = ferrus.squash_onto(str(worktree), target, "Task title\n\nFerrus-Task: t-1\n")
    assert git(worktree, "rev-parse", "HEAD").strip() == squashed
    assert git(worktree, "rev-parse", "HEAD^").strip() == target
    assert git(worktree, "status", "--porcelain") == ""
    assert git(worktree, "show", "HEAD:a.txt") == "both sides\n"
    assert git(worktree, "log", "--format=%s", "-1") .strip() == "Task title"


def test_a_merge_without_conflicts_still_gives_one_commit_and_no_paths(tmp_path, monkeypatch):
    root, worktree = repo_with_a_conflict(tmp_path, monkeypatch)
    git(worktree, "reset", "-q", "--hard", "HEAD~2")
    write(worktree, "d.txt", "d\n")
    git(worktree, "add", "d.txt")
    git(worktree, "commit", "-qm", "d")
    base, paths = ferrus.merge_leaving_conflicts(str(worktree), "main", "ferrus: merged")
    assert paths == []
    assert git(worktree, "show", "HEAD:a.txt") == "target side\n"
    assert git(worktree, "show", "HEAD:d.txt") == "d\n"
