"""Worktrees: task worktrees, the gate's clean checkout, candidates, fast-forward.

Each function may be called again after a crash at any point: creating finds the
worktree it made, the gate's checkout is reset before each use, and the target only
ever moves by a compare-and-swap or `git merge --ff-only` — to a checked candidate."""

import contextlib
import dataclasses
import json
import os
import re
import shutil

from .basics import FerrusError, LazyPattern, deferred_dataclass
from .config import CONFIG_FILE, git_branch_name_problem
from .git import (GIT_COMMIT_TIMEOUT_SECS, GitError, SNAPSHOT_IDENTITY, _parse_status_v2,
                  _pathspecs, _same_path, _worktree_admin_dirs, commit_tree,
                  common_git_dir, display_path, git_repository, run_git, task_checkout,
                  worktree_admin_dir)


# -- git: task worktrees (parallel tasks) ------------------------------------------------
#
# Each parallel task works in a git worktree of its own, on a branch of its own started
# at the target branch's head.  These functions are plumbing only — no store, no journal:
# the orchestrator records what they did.  Each is safe to call again after a crash at
# any point: creating finds the worktree it made (or finishes one git left half made),
# removing tolerates what is already gone, and listing shows everything left behind.

# The default worktree folder sits beside the repository: <folder name> + this.
WORKTREE_DIR_SUFFIX = ".ferrus-worktrees"


def default_worktree_dir(root, configured=None):
    """The folder task worktrees go in, as an absolute path.

    By default it sits beside the repository, never inside it —
    ``<parent of its top level>/<its folder name>.ferrus-worktrees`` — so test runners,
    linters, editors' searches and `git status` in the user's checkout never see a
    task's files.  ``configured`` ([parallel] worktree_dir; ``~`` expanded, relative to
    the project root) replaces it: outside the repository anywhere, inside it only in a
    git-ignored folder (else every task's files would show up as untracked in the
    user's checkout and be found by test discovery), and never in the .git folder.
    Raises GitUnavailable (no repository here) or FerrusError (a refused folder)."""
    repo = git_repository(root)
    toplevel = os.path.realpath(repo.toplevel)
    if not configured:
        return os.path.join(os.path.dirname(toplevel),
                            os.path.basename(toplevel) + WORKTREE_DIR_SUFFIX)
    path = os.path.realpath(os.path.join(os.path.abspath(root),
                                         os.path.expanduser(configured)))
    rel = _relative_inside(path, toplevel)
    if rel is None:
        return path
    setting = "[parallel] worktree_dir = %s in %s" % (json.dumps(configured), CONFIG_FILE)
    default = os.path.join(os.path.dirname(toplevel),
                           os.path.basename(toplevel) + WORKTREE_DIR_SUFFIX)
    if rel == "":
        raise FerrusError("%s is the repository itself (%s)" % (setting, toplevel),
                          "leave worktree_dir unset (worktrees then go in %s) or name a "
                          "folder outside the repository" % default)
    if (_relative_inside(path, os.path.realpath(repo.git_dir)) is not None
            or rel.split("/")[0] == ".git"):
        raise FerrusError("%s is inside the repository's .git folder" % setting,
                          "leave worktree_dir unset (worktrees then go in %s) or name a "
                          "folder outside the repository" % default)
    # A folder a worktree would be made in: ignored when git would not list it.
    probe = rel + "/ferrus-task/"
    if not run_git(toplevel, ["check-ignore", "--", probe], ok=(0, 1)).strip():
        raise FerrusError("%s is inside the repository (%s) and not git-ignored: every "
                          "task's files would show as untracked in your checkout, in task "
                          "diffs and to test runners" % (setting, toplevel),
                          "leave worktree_dir unset (worktrees then go in %s), name a "
                          "folder outside the repository, or add `/%s/` to .gitignore"
                          % (default, rel))
    return path


def _relative_inside(path, folder):
    """``path`` relative to ``folder`` with / separators ("" for the folder itself), or
    None when it is not inside it (both real, absolute paths)."""
    try:
        rel = os.path.relpath(path, folder)
    except ValueError:                      # another drive (Windows)
        return None
    if rel == os.curdir:
        return ""
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        return None
    return rel.replace(os.sep, "/")


# Whether this git knows `git worktree list -z` (2.36+), once asked: [True] or [False].
_WORKTREE_LIST_NUL = []


def _worktree_entries(root):
    """Every worktree of the repository ``root`` is in, the main one first, from
    `git worktree list --porcelain`: dicts with path, head, branch (short name, None
    when detached), bare, locked and prunable (git's reason, "" without one, or None)."""
    out, separator = None, "\0"
    if _WORKTREE_LIST_NUL != [False]:
        try:
            out = run_git(root, ["worktree", "list", "--porcelain", "-z"])
        except GitError as err:
            if _WORKTREE_LIST_NUL or "(exit 129)" not in err.message:
                raise
            _WORKTREE_LIST_NUL.append(False)      # a usage error: git older than 2.36
        else:
            _WORKTREE_LIST_NUL[:] = [True]
    if out is None:                      # older git: a path holding a newline misreads
        out, separator = run_git(root, ["worktree", "list", "--porcelain"]), "\n"
    records = os.fsdecode(out).split(separator * 2)
    entries = []
    for record in records:
        entry = {"path": None, "head": None, "branch": None, "bare": False,
                 "locked": None, "prunable": None}
        for line in record.strip(separator).split(separator):
            key, _, value = line.partition(" ")
            if key == "worktree":
                entry["path"] = os.path.normpath(value)
            elif key == "HEAD":
                entry["head"] = value
            elif key == "branch":
                entry["branch"] = value[len("refs/heads/"):] if value.startswith(
                    "refs/heads/") else value
            elif key == "bare":
                entry["bare"] = True
            elif key in ("locked", "prunable"):
                entry[key] = value
        if entry["path"]:
            entries.append(entry)
    return entries


def _rebasing_branch(git_dir):
    """The branch a rebase in progress in this checkout rewrites, or None."""
    for name in ("rebase-merge", "rebase-apply"):
        with contextlib.suppress(OSError):
            with open(os.path.join(git_dir, name, "head-name"), encoding="utf-8",
                      errors="surrogateescape") as handle:
                ref = handle.read().strip()
            return ref[len("refs/heads/"):] if ref.startswith("refs/heads/") else None
    return None


def _fork_point(root, branch_head, start_commit):
    """Where ``branch_head`` forked from ``start_commit`` (their merge base)."""
    if branch_head == start_commit:
        return start_commit
    out = run_git(root, ["merge-base", branch_head, start_commit], ok=(0, 1)).strip()
    if not out:
        raise GitError("the branch's commit %s shares no history with %s"
                       % (branch_head[:12], start_commit),
                       "`ferrus task cancel ID` removes the task's worktree and branch; "
                       "then queue the task again")
    return os.fsdecode(out)


def _commit_id(root, commit):
    """The full id of ``commit`` (a ref or an abbreviated id) — or GitError."""
    out = run_git(root, ["rev-parse", "-q", "--verify", commit + "^{commit}"], ok=(0, 1))
    if not out.strip():
        raise GitError("%s names no commit in the repository" % commit,
                       "`git log --oneline -5` shows recent commits")
    return os.fsdecode(out).strip()


def _folder_has_files(path):
    try:
        return bool(os.listdir(path))
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        return True


def create_task_worktree(root, path, branch, start_commit):
    """A new worktree at ``path`` on a new branch ``branch`` started at ``start_commit``
    (`git worktree add -b`).  Returns {"path", "branch", "base"}: "base" is the commit
    the branch started from.

    Called again for the same path and branch (say after a crash) it returns the
    worktree already there (its "base" is where its branch forked from
    ``start_commit``), finishes one git was interrupted making (no checkout written yet:
    it is made again), and puts a worktree back whose folder was deleted.  A branch of
    that name left behind without a worktree is used only when it holds no commit that
    ``start_commit`` lacks (nothing on it can be lost).  Anything else — the path taken
    by other files or another worktree, the branch checked out elsewhere or holding
    commits of its own — is refused with a GitError that says what to do; the
    repository is then unchanged."""
    path = os.path.abspath(path)
    problem = git_branch_name_problem(branch)
    if problem:
        raise GitError("%s is no valid branch name: it %s" % (json.dumps(branch), problem),
                       "choose another branch name for the task's worktree")
    if _folder_has_files(path):
        # Before `git worktree add -b`, which would make the branch, then refuse the path.
        return _resume_task_worktree(root, path, branch, start_commit, None)
    try:
        run_git(root, ["worktree", "add", "-q", "--no-track", "-b", branch, path,
                       start_commit + "^{commit}"])
    except GitError as err:
        return _resume_task_worktree(root, path, branch, start_commit, err)
    base = start_commit if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", start_commit) else (
        _commit_id(root, start_commit))
    return {"path": path, "branch": branch, "base": base}


def _resume_task_worktree(root, path, branch, start_commit, failure):
    """create_task_worktree when the path is taken or `git worktree add -b` refused
    (``failure``): the worktree is there already, or half made, or something else is in
    the way (GitError)."""
    entries = _worktree_entries(root)
    at_path = next((e for e in entries if _same_path(e["path"], path)), None)
    holder = next((e for e in entries if e["branch"] == branch), None)
    hint_taken = ("ferrus never reuses a folder or branch it did not make: remove it, or "
                  "start the task under another name")
    if at_path and at_path["branch"] != branch:
        raise GitError("%s is already the worktree of %s" % (
            path, "branch " + at_path["branch"] if at_path["branch"] else "a detached HEAD"),
            hint_taken)
    if holder and holder is not at_path:
        if os.path.isdir(holder["path"]):
            raise GitError("branch %s is already checked out at %s" % (branch, holder["path"]),
                           "finish or remove that worktree (`git worktree remove`), then "
                           "start the task again")
        run_git(root, ["worktree", "prune"])              # its folder is gone
    ours = at_path is not None
    if ours:
        git_dir = worktree_admin_dir(common_git_dir(root), path) if os.path.isdir(path) \
            else None
        if git_dir and os.path.exists(os.path.join(git_dir, "index")):
            # Complete: git writes a worktree's index once its checkout is done.
            if at_path["locked"] is not None and os.path.isdir(git_dir):
                with contextlib.suppress(GitError):   # git's own "initializing" lock, left
                    run_git(root, ["worktree", "unlock", path])
            start = _commit_id(root, start_commit)
            return {"path": path, "branch": branch,
                    "base": _fork_point(root, at_path["head"] or start, start)}
        _discard_worktree(root, path)                    # interrupted half way: made again
    if _folder_has_files(path):
        raise GitError("%s already exists and is not the worktree of branch %s"
                       % (path, branch), hint_taken)
    branch_head = target_head(root, branch)
    if branch_head is None:
        if failure is not None:
            raise failure                                 # not a question of leftovers
        run_git(root, ["worktree", "add", "-q", "--no-track", "-b", branch, path,
                       start_commit + "^{commit}"])       # the path is free now
        return {"path": path, "branch": branch, "base": _commit_id(root, start_commit)}
    start = _commit_id(root, start_commit)
    if not ours and not _is_ancestor(root, branch_head, start):
        raise GitError("branch %s already exists, with commits %s does not have"
                       % (branch, start_commit), hint_taken)
    run_git(root, ["worktree", "add", "-q", path, branch])
    return {"path": path, "branch": branch, "base": _fork_point(root, branch_head, start)}


def _is_ancestor(root, ancestor, descendant):
    if ancestor == descendant:
        return True
    try:
        run_git(root, ["merge-base", "--is-ancestor", ancestor, descendant])
        return True
    except GitError as err:
        if "(exit 1)" in err.message:
            return False
        raise


def _discard_worktree(root, path):
    """Delete a linked worktree git cannot remove itself (its folder damaged, deleted or
    half made): its folder, then git's record of it."""
    with contextlib.suppress(GitError):
        run_git(root, ["worktree", "unlock", path])
    if os.path.lexists(path):
        shutil.rmtree(path, onerror=_make_writable_and_retry)
    run_git(root, ["worktree", "prune"])


def _make_writable_and_retry(function, path, exc_info):
    # Windows will not delete a read-only file; anywhere else the error stands.
    if function in (os.unlink, os.remove, os.rmdir) and os.path.lexists(path):
        os.chmod(path, 0o700)
        function(path)
    else:
        raise exc_info[1]


def remove_task_worktree(root, path, branch, delete_branch=True, entries=None):
    """Remove the task worktree at ``path`` — its uncommitted changes with it — and
    (``delete_branch``) its branch, merged or not: the caller decides when a task's
    work is no longer wanted.  ``branch`` None: the worktree only, whatever its branch.  Idempotent: a worktree or branch already gone is fine,
    and a worktree git refuses to remove because its folder is damaged is deleted and
    pruned.  Returns {"path", "branch", "removed", "branch_deleted"} (what this call
    did).  Raises GitError for a path that is not a linked worktree of this repository
    or is the worktree of another branch (its files are left alone), or a branch
    checked out somewhere else.  ``entries``: _worktree_entries(root) if the caller has
    just listed them (removing one worktree leaves the others' entries true)."""
    path = os.path.abspath(path)
    removed = branch_deleted = False
    entries = _worktree_entries(root) if entries is None else entries
    entry = next((e for e in entries if _same_path(e["path"], path)), None)
    if entry is not None:
        if entry is entries[0]:
            raise GitError("%s is the repository's main checkout, not a task worktree"
                           % path, "ferrus removes only the worktrees it made")
        if entry["branch"] is not None and branch is not None and entry["branch"] != branch:
            # Someone else's worktree, or a mix-up of records: its work is not ours to drop.
            raise GitError("%s is the worktree of branch %s, not of %s" % (
                path, entry["branch"], branch), "ferrus removes only the worktrees it made")
        try:
            run_git(root, ["worktree", "remove", "--force", "--force", path])
        except GitError:
            _discard_worktree(root, path)         # damaged: git cannot remove it itself
        removed = True
    elif _folder_has_files(path):
        raise GitError("%s is not a worktree of this repository" % path,
                       "ferrus deletes only worktrees it made; remove that folder by hand "
                       "if it is not wanted")
    elif os.path.isdir(path):
        os.rmdir(path)                     # the empty folder of an interrupted `worktree add`
    if delete_branch and branch:
        try:
            run_git(root, ["branch", "-D", "-q", branch])
            branch_deleted = True
        except GitError:
            if target_head(root, branch) is not None:
                raise
    return {"path": path, "branch": branch, "removed": removed,
            "branch_deleted": branch_deleted}


def list_task_worktrees(root, branch_prefix):
    """Every worktree and branch ferrus made for tasks — every branch whose name starts
    with ``branch_prefix`` — so that leftovers can be found: dicts with path (None for a
    branch checked out nowhere), branch, head, exists (its folder is there), prunable
    (git's reason when git would prune it, else None), locked, main (it is the main
    checkout, never a task worktree) and rebasing (a rebase of it is in progress, which
    git shows as a detached HEAD).  Sorted by branch."""
    entries = _worktree_entries(root)
    out = os.fsdecode(run_git(root, ["for-each-ref", "--format=%(objectname) %(refname)",
                                     "refs/heads/"]))
    heads = {}
    for line in out.splitlines():
        commit, _, ref = line.partition(" ")
        name = ref[len("refs/heads/"):]
        if name.startswith(branch_prefix):
            heads[name] = commit
    found = []
    git_dirs = _entry_git_dirs(root, entries)
    for index, entry in enumerate(entries):
        branch, rebasing = entry["branch"], False
        if branch is None and not entry["bare"]:
            git_dir = git_dirs[index]
            branch = _rebasing_branch(git_dir) if git_dir else None
            rebasing = branch is not None
        if branch is None or not branch.startswith(branch_prefix):
            continue
        found.append({"path": entry["path"], "branch": branch,
                      "head": heads.get(branch, entry["head"]),
                      "exists": os.path.isdir(entry["path"]), "prunable": entry["prunable"],
                      "locked": entry["locked"], "main": index == 0, "rebasing": rebasing})
        heads.pop(branch, None)
    found += [{"path": None, "branch": name, "head": commit, "exists": False,
               "prunable": None, "locked": None, "main": False, "rebasing": False}
              for name, commit in heads.items()]
    return sorted(found, key=lambda row: (row["branch"], row["path"] or ""))


def worktree_changes(where, exclude):
    """The paths with uncommitted changes (untracked files included) in the checkout at
    ``where`` (a task's TaskCheckout), leaving out ``exclude`` (ferrus's own files) — or
    GitError."""
    out = run_git(where, ["status", "--porcelain=v2", "-z", "--ignore-submodules=dirty"]
                  + _pathspecs(exclude))
    return _parse_status_v2(out)[2]


def target_head(root, branch):
    """The commit branch ``branch`` is at, or None when there is no such branch."""
    out = run_git(root, ["rev-parse", "-q", "--verify", "refs/heads/%s^{commit}" % branch],
                  ok=(0, 1))
    return os.fsdecode(out).strip() or None


def foreign_commits(root, known, head, limit=50):
    """One line per commit ``head`` has and ``known`` lacks ("<short> <author>: <subject>",
    newest first, at most ``limit``+1 so a caller can say "more"); [] when either is None
    or git cannot tell."""
    if not known or not head:
        return []
    try:
        out = run_git(root, ["log", "--max-count=%d" % (limit + 1), "--format=%h %an: %s",
                             "%s..%s" % (known, head), "--"])
    except GitError:
        return []
    return os.fsdecode(out).splitlines()


# -- git: the merge gate's own clean checkout ---------------------------------------------
#
# The merge gate never works in a task's worktree: the executor owns it (and whatever it
# left running there may still write to it), and its git-ignored files — a build, a
# cache, a file a test reads — would make the checks pass where a clean checkout of the
# target fails.  It builds each candidate in a checkout of its own, a detached worktree
# beside the tasks' (gate_checkout), cleaned of every untracked and ignored file before
# each use: the candidate is the target's head with the task's submitted commit applied
# (a three-way merge from the task's base, as a rebase would make it), committed as one
# commit on the target — the commit the checks then run on and the target moves to.
# Nothing there needs undoing after a crash: the next use resets it.  A conflict is
# handed to the executor as files to edit (a real agent cannot be trusted to run git,
# and a sandboxed one cannot write the repository's .git folder, but every executor can
# edit files): ferrus commits the merge with git's markers left in the conflicted files
# on top of the target's head, and the task's worktree is moved there.

# The gate's folder in the worktree folder (task worktrees are named by their ids, t-...).
GATE_FOLDER = "ferrus-gate"
# A task's review checkout is its worktree's path and this.
REVIEW_SUFFIX = ".review"
CONFLICT_MARKER = LazyPattern(rb"^(?:<{7}|>{7})(?: |\r?$)", re.M)
# How much build_candidate says about a conflict (the executor reads it in REVIEW.md).
CONFLICT_TEXT_CHARS = 4096
# Lines of one side of a conflicting hunk shown before the rest is left out, and the
# characters of one line (a minified file's line can be the whole file).
CONFLICT_SIDE_LINES = 12
CONFLICT_LINE_CHARS = 200


def gate_checkout(root, worktree_dir, start):
    """ferrus's clean checkout for the merge gate: ``<worktree_dir>/ferrus-gate`` (see
    own_checkout; the checks run the tasks' code there).  Returns its TaskCheckout."""
    return own_checkout(root, os.path.join(worktree_dir, GATE_FOLDER), start)


def review_checkout_path(worktree):
    """Where the checkout a task's reviewer and consultant work in lives: beside the
    task's worktree ``worktree``."""
    return worktree.rstrip("/\\") + REVIEW_SUFFIX


def remove_review_checkout(root, worktree, entries=None):
    """The review checkout of the task whose worktree is ``worktree`` goes (the task
    ended); nothing of anyone's is in it.  True when there was one.  ``entries`` as for
    remove_task_worktree."""
    path = review_checkout_path(worktree)
    if not os.path.lexists(path) and worktree_admin_dir(common_git_dir(root), path) is None:
        return False
    remove_task_worktree(root, path, None, entries=entries)
    return True


def own_checkout(root, path, start):
    """A detached worktree of ferrus's own at ``path`` (the repository of the user's
    checkout ``root``): made (at ``start``) when missing, and made again when damaged
    or tampered with — nothing of anyone's lives there.  Returns its TaskCheckout."""
    try:
        checkout = task_checkout(root, path)
    except GitError:
        common = common_git_dir(root)
        registered = worktree_admin_dir(common, path) is not None
        if not registered and _folder_has_files(path):
            raise GitError("%s is in the way of a checkout of ferrus's" % path,
                           "ferrus keeps its own clean checkouts there: move that folder "
                           "away") from None
        if registered or os.path.lexists(path):      # else nothing is there to discard
            _discard_worktree(root, path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        run_git(root, ["worktree", "add", "-q", "--detach", "--no-checkout", path,
                       start + "^{commit}"])
        checkout = task_checkout(root, path)
    return checkout


def reset_gate(gate, commit):
    """The gate's checkout at ``commit`` exactly: every file as the commit has it, no
    untracked or ignored file left, no operation in progress."""
    run_git(gate, ["reset", "-q", "--hard", commit + "^{commit}"])
    run_git(gate, ["clean", "-ffdxq", "--", ":/"])


@deferred_dataclass
class Integration:
    """A task's submitted work made into a candidate for the target branch."""

    status: str            # "ready", "conflict", or "empty" (nothing the target lacks)
    head: str              # ready: the candidate; conflict: the hand-over commit; empty:
                           # the target's head
    target_head: str       # the target's head it was built on
    conflicts: list = dataclasses.field(default_factory=list)   # conflicting paths
    text: str = ""         # what happened, for people (a conflict's files and hunks)
    # ready: the commits to check, in order (the last is the candidate); with merge
    # history the task's own commit comes before the merge.
    commits: list = dataclasses.field(default_factory=list)


def build_candidate(gate, target_branch, target, steps, history="squash", edit=None):
    """Build, in the gate's checkout, the commit(s) that would put a task's work on
    ``target`` (the head of ``target_branch``).

    ``steps``: [(commit, message)] in order — each a commit whose parent is where its
    changes start (a submission's snapshot on the task's base); "squash" and "merge"
    histories take one step.  Each is applied by a three-way merge onto what the steps
    before made.  "squash"/"linear": a commit per step on top of ``target``, in the
    user's name; "merge": the task's commit on its own base, then a merge commit on
    ``target`` with it as second parent.  ``edit()``, called before the last commit,
    may change files in the gate (ferrus ticking a spec milestone) and returns their
    absolute paths.

    Returns an Integration: "ready" with the commits to check, "empty" when the target
    has every change already, "conflict" with the conflicting paths, a text for the
    executor and the hand-over commit (the target's head with the task's work merged
    in, git's markers left in the conflicted files).  Raises GitError (no identity to
    commit with, a damaged repository)."""
    reset_gate(gate, target)
    target_tree = _tree_of(gate, target)
    made, parent = [], target
    for index, (commit, message) in enumerate(steps):
        try:
            run_git(gate, ["cherry-pick", "--no-commit", commit], timeout=GIT_COMMIT_TIMEOUT_SECS)
        except GitError as err:
            conflicts = _conflicting_stages(gate)
            if not conflicts:
                raise GitError("applying the task's work onto %s failed: %s" % (
                    target_branch, err.message), "run `git cherry-pick --no-commit %s` in a "
                    "checkout of %s to see what git needs" % (commit[:12], target_branch)
                    ) from None
            return _hand_over(gate, target_branch, target, steps, conflicts)
        if edit is not None and index == len(steps) - 1:
            changed = edit()
            if changed:
                run_git(gate, ["add", "--"] + [":(literal)" + os.path.relpath(
                    p, gate.work_tree).replace(os.sep, "/") for p in changed])
        tree = os.fsdecode(run_git(gate, ["write-tree"])).strip()
        if history == "merge":
            base = _first_parent(gate, commit)
            own = commit_tree(gate, tree if base == target else _tree_of(gate, commit),
                              [base], message)
            if tree == target_tree:
                break
            merged = commit_tree(gate, tree, [target, own], "Merge task work into %s\n\n%s"
                                 % (target_branch, message))
            made = [own, merged] if base != target else [own]
            parent = made[-1]
            break
        if tree == _tree_of(gate, parent):
            continue                      # this step changes nothing the target lacks
        parent = commit_tree(gate, tree, [parent], message)
        made.append(parent)
        run_git(gate, ["update-ref", "--no-deref", "HEAD", parent])
    if not made or _tree_of(gate, made[-1]) == target_tree:
        reset_gate(gate, target)
        return Integration("empty", target, target, [], "the task changes nothing that %s "
                           "(at %s) does not already have" % (target_branch, target[:12]))
    return Integration("ready", made[-1], target, [], "the task's work applied to %s at %s"
                       % (target_branch, target[:12]), commits=made)


def rechain(gate, target, trees_and_messages):
    """Commits of the given trees, each on the one before, the first on ``target``: a
    linear history with some of build_candidate's commits folded into the next."""
    parent = target
    for tree, message in trees_and_messages:
        parent = commit_tree(gate, tree, [parent], message)
    return parent


# A commit's tree never changes (its id is a hash of it): {commit id: tree id}, so the
# merge queue's several comparisons of the same commits start git once per commit.
_TREES = {}
_FULL_COMMIT_ID = LazyPattern(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _tree_of(where, commit):
    tree = _TREES.get(commit)
    if tree is None:
        tree = os.fsdecode(run_git(where, ["rev-parse", commit + "^{tree}"])).strip()
        if _FULL_COMMIT_ID.fullmatch(commit):
            if len(_TREES) >= 4096:
                _TREES.clear()
            _TREES[commit] = tree
    return tree


def _first_parent(where, commit):
    return os.fsdecode(run_git(where, ["rev-parse", commit + "^1"])).strip()


def _hand_over(gate, target_branch, target, steps, conflicts):
    """The "conflict" Integration: the task's whole work (its last step) merged into
    ``target`` with the markers left, committed on ``target`` for the executor."""
    if len(steps) > 1:                   # linear: one merge of the task's last snapshot
        reset_gate(gate, target)
        with contextlib.suppress(GitError):
            run_git(gate, ["cherry-pick", "--no-commit", steps[-1][0]],
                    timeout=GIT_COMMIT_TIMEOUT_SECS)
        conflicts = _conflicting_stages(gate) or conflicts
    text = _conflict_text(gate, conflicts, target_branch, target)
    run_git(gate, ["add", "-A", "--", ":/"])
    tree = os.fsdecode(run_git(gate, ["write-tree"])).strip()
    handover = commit_tree(gate, tree, [target], "ferrus: %s merged into the task's work, "
                           "its conflicts left for the executor" % target_branch,
                           SNAPSHOT_IDENTITY)
    reset_gate(gate, target)
    return Integration("conflict", handover, target,
                       sorted(conflicts, key=lambda p: p.encode("utf-8", "surrogateescape")),
                       text)


def markers_left(root, commit, paths):
    """Which of ``paths`` (relative to the repository's top) still hold a conflict
    marker line in ``commit``."""
    if not paths:
        return []
    out = run_git(root, ["grep", "-I", "-l", "-z", "-E", "^(<{7}|>{7})( |$)", commit, "--"]
                  + [":(top,literal)" + p for p in paths], ok=(0, 1))
    prefix = commit + ":"
    return sorted(entry[len(prefix):] if entry.startswith(prefix) else entry
                  for entry in os.fsdecode(out).split("\0") if entry)


def changed_paths(root, old, new, paths=None):
    """The paths (relative to the repository's top) that differ between two commits,
    optionally only among ``paths`` (git pathspecs from the top)."""
    out = run_git(root, ["diff", "--name-only", "-z", "--no-renames", old, new, "--"]
                  + ([":(top)" + p for p in paths] if paths else [":/"]))
    return [p for p in os.fsdecode(out).split("\0") if p]


def move_task_worktree(checkout, branch, commit):
    """Put the task's branch, index and files at ``commit`` (untracked files stay).  The
    caller saved what the worktree held first (save it with snapshot_worktree)."""
    # The executor may have switched its worktree to another branch — even the target:
    # HEAD is put back on the task's own branch before anything moves.
    run_git(checkout, ["symbolic-ref", "HEAD", "refs/heads/" + branch])
    run_git(checkout, ["reset", "-q", "--hard", commit + "^{commit}"])
def _conflicting_stages(worktree):
    """{path: set of stages present} for each conflicted path (`git ls-files -u`)."""
    stages = {}
    for entry in os.fsdecode(run_git(worktree, ["ls-files", "-u", "-z", "--full-name"])
                             ).split("\0"):
        if "\t" in entry:
            info, path = entry.split("\t", 1)
            stages.setdefault(path, set()).add(info.split()[2])
    return stages


def _conflict_text(gate, conflicts, target_branch, target):
    """The conflicting files and, for text files, each side of every conflicting hunk:
    what the executor needs to make the task fit the target, at most
    CONFLICT_TEXT_CHARS."""
    # The task's work is applied onto the target: "ours" is the target, "theirs" the task.
    task_stage, target_stage = "3", "2"
    target_label = "%s (at %s)" % (target_branch, target[:12])
    names = sorted(conflicts, key=lambda p: p.encode("utf-8", "surrogateescape"))
    parts = ["Applying the task's work onto %s (at %s) conflicts in %d file%s: %s" % (
        target_branch, target[:12], len(names), "" if len(names) == 1 else "s",
        ", ".join(map(display_path, names)))]
    top = gate.work_tree
    for path in names:
        stages = conflicts[path]
        if task_stage not in stages:
            parts.append("%s: the task deleted it, %s changed it" % (display_path(path),
                                                                    target_label))
            continue
        if target_stage not in stages:
            parts.append("%s: %s deleted it, the task changed it" % (display_path(path),
                                                                    target_label))
            continue
        hunks = _conflict_hunks(os.path.join(top, *path.split("/")))
        if not hunks:
            parts.append("%s: both sides changed it (no text conflict markers: a binary "
                         "file, or a file type or mode change)" % display_path(path))
            continue
        for line_number, ours, theirs in hunks:
            task, other = theirs, ours
            parts.append("%s, line %d:\n  the task's side:\n%s\n  %s's side (at %s):\n%s"
                         % (display_path(path), line_number, _side_lines(task),
                            target_branch, target[:12], _side_lines(other)))
    if len(parts[0]) > CONFLICT_TEXT_CHARS // 2:               # thousands of files
        parts[0] = parts[0][:CONFLICT_TEXT_CHARS // 2] + " [...]"
    text = ""
    for index, part in enumerate(parts):
        candidate = text + ("\n\n" if text else "") + part
        if len(candidate) > CONFLICT_TEXT_CHARS:
            left = len(parts) - index
            return text + "\n\n[... %d more conflicting part%s left out; the files in your " \
                "worktree hold them all between git's markers]" % (
                    left, "" if left == 1 else "s")
        text = candidate
    return text


def _conflict_hunks(path):
    """[(line number, ours lines, theirs lines)] of the conflict markers in a file."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read(1 << 20).splitlines()
    except OSError:
        return []
    hunks, index = [], 0
    while index < len(lines):
        if not lines[index].startswith("<<<<<<<"):
            index += 1
            continue
        start, ours, theirs, side = index + 1, [], [], "ours"
        index += 1
        while index < len(lines) and not lines[index].startswith(">>>>>>>"):
            line = lines[index]
            if line.startswith("|||||||") and side == "ours":
                side = "base"                              # diff3 / zdiff3 style
            elif line.startswith("=======") and side != "theirs":
                side = "theirs"
            elif side == "ours":
                ours.append(line)
            elif side == "theirs":
                theirs.append(line)
            index += 1
        hunks.append((start, ours, theirs))
        index += 1
    return hunks


def _side_lines(lines):
    shown = ["    | " + (line if len(line) <= CONFLICT_LINE_CHARS else
                         line[:CONFLICT_LINE_CHARS] + " [...]")
             for line in lines[:CONFLICT_SIDE_LINES]]
    if len(lines) > CONFLICT_SIDE_LINES:
        shown.append("    [... %d more lines]" % (len(lines) - CONFLICT_SIDE_LINES))
    return "\n".join(shown) if shown else "    (nothing: the lines are removed)"


@deferred_dataclass
class FastForward:
    """What fast_forward_target did to the target branch."""

    status: str            # "done", "moved" (not at old_head any more) or "dirty"
    head: "str | None"     # where the target is now
    files: list = dataclasses.field(default_factory=list)   # dirty: the user's files in the way
    text: str = ""         # why, for people
    checkout: "str | None" = None   # where the target is checked out (None: nowhere)


def fast_forward_target(root, target_branch, old_head, new_head):
    """Move ``target_branch`` from ``old_head`` to ``new_head``, only as a fast-forward.

    Checked out nowhere, its ref moves by one atomic compare-and-swap (`git update-ref
    <new> <old>`).  Checked out (the user's checkout, usually), the checkout is updated
    with `git merge --ff-only` — never a reset or a forced checkout — unless a file the
    update changes has uncommitted changes there, or an untracked (or ignored) file sits
    where it writes one, or a merge or rebase is in progress there: then nothing is
    touched and the status is "dirty", with those files named (other uncommitted changes
    are carried along, as `git pull` would).  "moved": the target is no longer at
    ``old_head`` (someone committed); integrate again.  "done" also when the target is
    at ``new_head`` already (a retry after a crash).  A kill at any moment leaves the
    target's ref at ``old_head`` or ``new_head``.  Raises GitError when ``new_head`` does
    not descend from ``old_head`` or git fails otherwise."""
    entries = _worktree_entries(root)
    git_dirs = _entry_git_dirs(root, entries)
    holder = None
    for index, entry in enumerate(entries):
        if entry["branch"] == target_branch:
            holder = entry
        elif entry["branch"] is None and not entry["bare"]:
            git_dir = git_dirs[index]
            if git_dir and _rebasing_branch(git_dir) == target_branch:
                return FastForward("dirty", old_head, [], "a rebase of %s is in progress in "
                                   "%s: waiting until it is finished or aborted"
                                   % (target_branch, entry["path"]), entry["path"])
    if holder is not None and not os.path.isdir(holder["path"]):
        holder = None                                # its folder is gone: nothing to overwrite
    if holder is not None:
        current = holder["head"]
    else:
        current = target_head(root, target_branch)
    where = holder["path"] if holder else None
    if current == new_head:
        return FastForward("done", new_head, [], "%s is at %s" % (target_branch, new_head[:12]),
                           where)
    if current != old_head:
        return _moved(target_branch, current, old_head, where)
    if holder is None:
        # update-ref moves a ref anywhere: only a descendant may go there (`merge
        # --ff-only` below refuses anything else itself).
        _require_fast_forward(root, target_branch, old_head, new_head)
        try:
            run_git(root, ["update-ref", "-m", "ferrus: integrate %s" % new_head[:12],
                           "refs/heads/" + target_branch, new_head, old_head])
        except GitError:
            current = target_head(root, target_branch)
            if current == new_head:
                return FastForward("done", new_head, [], "%s is at %s" % (
                    target_branch, new_head[:12]))
            if current != old_head:
                return _moved(target_branch, current, old_head, None)
            raise
        return FastForward("done", new_head, [], "%s moved from %s to %s" % (
            target_branch, old_head[:12], new_head[:12]))
    checkout = holder["path"]
    # The target checked out in a linked worktree (a task's, if its executor switched it
    # there): git is told which repository, as for every task worktree.
    where = checkout if holder is entries[0] else task_checkout(root, checkout)
    blocked = _checkout_blockers(where, old_head, new_head)
    if blocked:
        return blocked
    try:
        run_git(where, ["merge", "--ff-only", "-q", new_head])
    except GitError as err:
        current = target_head(root, target_branch)
        if current == new_head:
            return FastForward("done", new_head, [], "%s is at %s" % (
                target_branch, new_head[:12]), checkout)
        if current != old_head:
            return _moved(target_branch, current, old_head, checkout)
        _require_fast_forward(root, target_branch, old_head, new_head)
        blocked = _checkout_blockers(where, old_head, new_head)
        if blocked:
            return blocked
        raise GitError("updating %s in your checkout %s failed: %s" % (
            target_branch, checkout, err.message), "run `git merge --ff-only %s` there to "
            "see what git needs" % new_head[:12]) from None
    return FastForward("done", new_head, [], "%s moved from %s to %s (checked out in %s)" % (
        target_branch, old_head[:12], new_head[:12], checkout), checkout)


def _require_fast_forward(root, target_branch, old_head, new_head):
    if not _is_ancestor(root, old_head, new_head):
        raise GitError("%s is not a fast-forward of %s (at %s)" % (
            new_head[:12], target_branch, old_head[:12]),
            "integrate the task onto the target's head again")


def _entry_git_dirs(root, entries):
    """The git folder of each of ``entries`` (from _worktree_entries, the main checkout
    first), from the repository's own records — never from a worktree's .git file,
    which the agent working there may have rewritten."""
    common = common_git_dir(root)
    admins = _worktree_admin_dirs(common)
    dirs = []
    for index, entry in enumerate(entries):
        if index == 0:
            dirs.append(None if entry["bare"] else common)
        else:
            dot_git = os.path.normcase(os.path.realpath(os.path.join(entry["path"], ".git")))
            dirs.append(admins.get(dot_git))
    return dirs


def _moved(target_branch, current, old_head, where):
    return FastForward("moved", current, [], "%s moved to %s since %s: the task is "
                       "integrated onto its new head again" % (
                           target_branch, current[:12] if current else "(deleted)",
                           old_head[:12]), where)


def _checkout_blockers(checkout, old_head, new_head):
    """A "dirty" FastForward when the checkout cannot take the update untouched: a git
    operation in progress, or local changes (also untracked or ignored files) at paths
    the update writes; else None."""
    where = checkout                    # a path, or a linked worktree's TaskCheckout
    repo = git_repository(where)
    operation = repo.operation_in_progress()
    checkout = repo.toplevel
    if operation:
        return FastForward("dirty", old_head, [], "a git %s is in progress in your checkout "
                           "%s: waiting until it is finished" % (operation, checkout), checkout)
    touched = [p for p in os.fsdecode(run_git(where, [
        "diff", "--name-only", "-z", "--no-renames", old_head, new_head])).split("\0") if p]
    if not touched:
        return None
    # Past a few thousand paths the command line could be too long: ask about them all.
    specs = (["--"] + [":(literal)" + p for p in touched]) if len(touched) <= 2000 else []
    out = run_git(where, ["status", "--porcelain=v2", "-z", "--untracked-files=all",
                             "--ignored=matching", "--no-renames"] + specs)
    local = []
    for entry in os.fsdecode(out).split("\0"):
        if entry.startswith(("1 ", "u ")):
            local.append(entry.split(" ", 8 if entry[0] == "1" else 10)[-1])
        elif entry.startswith(("? ", "! ")):
            local.append(entry[2:])
    touched_set = set(touched)
    blocking = {p for p in local if p in touched_set or any(
        p.startswith(t + "/") for t in touched) or any(t.startswith(p + "/") for t in touched)}
    # A file (untracked or ignored) where the update needs a folder, which the status
    # above, asked only about the paths themselves, does not list.
    for path in touched:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in touched_set:
                break
            full = os.path.join(checkout, *parts[:depth])
            if os.path.islink(full) or os.path.isfile(full):
                blocking.add(folder)
                break
    blocking = sorted(blocking)
    if not blocking:
        return None
    return FastForward("dirty", old_head, blocking, "your checkout %s has uncommitted changes "
                       "(or untracked files) where the task's changes go: %s; commit, stash or "
                       "move them, and the task is integrated" % (
                           checkout, ", ".join(map(display_path, blocking[:20]))
                           + (" and %d more" % (len(blocking) - 20) if len(blocking) > 20
                              else "")), checkout)
