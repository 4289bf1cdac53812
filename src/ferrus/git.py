"""Git: a task's base and diff, its pinned worktree, submissions, [git] commit.

The only code that runs git on a task's files.  A task remembers where it started
and its diff is measured from there; a parallel task's worktree is hostile ground,
so git is always told its git folder and work tree (TaskCheckout) and runs no hook,
filter or merge driver; at submit the worktree is recorded as a commit, which is
what the reviewer reads and the merge gate merges."""

import contextlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading

from .basics import FerrusError, LazyPattern, deferred_dataclass
from .config import CONFIG_FILE, git_branch_name_problem
from .store import FERRUS_DIR


# -- git: a task's base and its diff --------------------------------------------------
#
# A task remembers where it started (record_task_base) and its diff is measured from
# there to the working tree, untracked files included (task_diff).  ferrus only reads
# the repository: git runs from argv lists (no shell) with a timeout, the user's index
# is never written (the full diff works on a private copy of it, and
# GIT_OPTIONAL_LOCKS=0 keeps the read-only commands from refreshing it), and where git
# is missing or the project is not in a repository there is simply no diff.
# Operations, the MCP server and HQ reach git only through the functions below
# (docs/ARCHITECTURE.md, "Git: a task's base and diff").

GIT_TIMEOUT_SECS = 60.0
# Files ferrus (or `ferrus register`) writes into a project: never part of a task's
# diff, whatever the agent did.  Paths relative to the project root.
DIFF_EXCLUDED_PATHS = (FERRUS_DIR, ".mcp.json", ".claude/mcp-supervisor.json",
                       ".claude/mcp-executor.json", ".claude/settings.local.json",
                       ".codex", ".qwen", ".gemini")
# The skill folders `ferrus init` writes under [agents] path.
DIFF_EXCLUDED_SKILLS = ("skills/ferrus", "skills/ferrus-supervisor", "skills/ferrus-executor")
# What create_task names of a dirty tree (the count is always exact).
BASE_DIRTY_NAMES = 50
# Variables that would point git at another repository or index than the project's.
_GIT_LOCATION_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_PREFIX",
                      "GIT_COMMON_DIR", "GIT_NAMESPACE", "GIT_OBJECT_DIRECTORY",
                      "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CEILING_DIRECTORIES")


class GitUnavailable(FerrusError):
    """There can be no diff here (git is missing, or the project is in no repository);
    everything else in ferrus works as without git."""


class GitError(FerrusError):
    """A git command failed or gave an answer ferrus cannot use."""


def _git_env(index_file=None, extra=None):
    # A hook or a wrapper may have exported GIT_DIR & co. for another repository:
    # the project's repository is the one its root is in, nothing else.
    env = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATION_VARS}
    env.update(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", GIT_PAGER="cat")
    env.update(extra or {})
    if index_file:
        env["GIT_INDEX_FILE"] = index_file
    return env


def _git_argv(args, pinned=None, hooks=False):
    argv = ["git", "-c", "core.quotePath=false", "-c", "core.fsmonitor=false"]
    if not hooks:
        # ferrus's own plumbing runs no hook: a hook is the user's word on their own
        # commits and checkouts (see run_git's ``hooks``), and a relative core.hooksPath
        # can name files a task wrote.
        argv += ["-c", "core.hooksPath=" + os.devnull]
    if pinned is not None:
        argv += pinned.git_options()
    return argv + list(args)


def _git_site(where):
    """(working directory, TaskCheckout or None) of a git call made at ``where``: a path
    (the user's own checkout, where git finds its repository as usual) or a
    TaskCheckout (a task's worktree: its git folder and work tree named explicitly)."""
    if isinstance(where, TaskCheckout):
        return where.cwd, where
    return where, None


def _git_failure(args, code, stderr):
    said = stderr.decode("utf-8", "replace").strip()
    command = next((arg for arg in args if not arg.startswith("-")), args[0])
    return GitError("git %s failed (exit %s)%s" % (command, code, ": " + said if said else ""),
                    "run the same git command in the project to see what git needs")


def run_git(root, args, timeout=GIT_TIMEOUT_SECS, index_file=None, stdin=None, ok=(0,),
            env=None, hooks=False):
    """stdout (bytes) of ``git <args>`` run in ``root`` (a path, or a task's
    TaskCheckout); ``env`` adds variables; ``hooks``: the repository's hooks run (only
    for what ferrus does in the user's own checkout on the user's behalf: [git] branch
    and commit).  Raises GitUnavailable when git is not installed, GitError when it
    fails, times out or exits outside ``ok``."""
    cwd, pinned = _git_site(root)
    try:
        proc = subprocess.run(_git_argv(args, pinned, hooks and pinned is None), cwd=cwd,
                              env=_git_env(index_file, env),
                              input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=None if stdin is not None else subprocess.DEVNULL,
                              timeout=timeout)
    except FileNotFoundError:
        raise GitUnavailable("git is not installed (no `git` command on PATH)",
                             "install git to see task diffs; everything else works without it"
                             ) from None
    except subprocess.TimeoutExpired:
        raise GitError("git %s did not finish within %.0f s" % (args[0], timeout),
                       "the repository may be very large or on a slow disk; try again") from None
    if proc.returncode not in ok:
        raise _git_failure(args, proc.returncode, proc.stderr)
    return proc.stdout


def stream_git(root, args, head_bytes, tail_bytes, timeout=GIT_TIMEOUT_SECS, index_file=None):
    """(head, tail, total) of the stdout of ``git <args>``: at most the first
    ``head_bytes`` and the last ``tail_bytes`` are kept, however much git prints
    (``tail`` is empty when the whole output fits in ``head``)."""
    errors = tempfile.TemporaryFile()
    cwd, pinned = _git_site(root)
    try:
        proc = subprocess.Popen(_git_argv(args, pinned), cwd=cwd, env=_git_env(index_file),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
    except FileNotFoundError:
        errors.close()
        raise GitUnavailable("git is not installed (no `git` command on PATH)",
                             "install git to see task diffs; everything else works without it"
                             ) from None
    timed_out = threading.Event()

    def stop():
        timed_out.set()
        proc.kill()
    timer = threading.Timer(timeout, stop)
    timer.daemon = True
    timer.start()
    head, tail, total = bytearray(), bytearray(), 0
    try:
        while True:
            chunk = proc.stdout.read(65536)
            if not chunk:
                break
            total += len(chunk)
            room = head_bytes - len(head)
            if room > 0:
                head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                tail += chunk
                if len(tail) > 2 * tail_bytes + 65536:
                    del tail[:len(tail) - tail_bytes]
        code = proc.wait()
    finally:
        timer.cancel()
        proc.stdout.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = b""
    with errors, contextlib.suppress(OSError):
        errors.seek(0)
        stderr = errors.read(64 * 1024)
    if timed_out.is_set():
        raise GitError("git %s did not finish within %.0f s" % (args[0], timeout),
                       "the repository may be very large or on a slow disk; try again")
    if code != 0:
        raise _git_failure(args, code, stderr)
    return bytes(head), bytes(tail[-tail_bytes:] if tail_bytes else b""), total


@deferred_dataclass
class GitRepository:
    """The repository a project root is in, as git reports it."""

    root: str          # the project root (git runs there; paths are relative to it)
    toplevel: str
    git_dir: str

    def operation_in_progress(self):
        """The git operation left unfinished in this checkout (rebase, merge, ...), or None."""
        for name, what in (("rebase-merge", "rebase"), ("rebase-apply", "rebase"),
                           ("MERGE_HEAD", "merge"), ("CHERRY_PICK_HEAD", "cherry-pick"),
                           ("REVERT_HEAD", "revert"), ("BISECT_LOG", "bisect")):
            if os.path.exists(os.path.join(self.git_dir, name)):
                return what
        return None

    def submodules(self):
        """The submodule paths .gitmodules declares (empty without submodules)."""
        if not os.path.isfile(os.path.join(self.toplevel, ".gitmodules")):
            return []
        with contextlib.suppress(GitError):
            out = run_git(self.toplevel, ["config", "--file", ".gitmodules", "-z",
                                          "--get-regexp", r"^submodule\..*\.path$"], ok=(0, 1))
            return [entry.split("\n", 1)[1] for entry in
                    os.fsdecode(out).split("\0") if "\n" in entry]
        return []

    def head(self):
        """The commit HEAD names, or None in a repository without commits."""
        out = run_git(self.root, ["rev-parse", "-q", "--verify", "HEAD^{commit}"], ok=(0, 1))
        return out.decode("ascii").strip() or None

    def has_commit(self, commit):
        return bool(run_git(self.root, ["rev-parse", "-q", "--verify", commit + "^{commit}"],
                            ok=(0, 1)).strip())

    def empty_tree(self):
        """The id of the empty tree (sha1 or sha256, as the repository uses)."""
        return run_git(self.root, ["hash-object", "-t", "tree", "--stdin"],
                       stdin=b"").decode("ascii").strip()


def _dot_git_above(root):
    """The .git (folder or file, as in a worktree or submodule) in ``root`` or the nearest
    folder above it, or None: only with one can git find a repository, so a project
    outside any repository never pays for starting git (create_task is on a fast path)."""
    path = os.path.abspath(root)
    while True:
        candidate = os.path.join(path, ".git")
        if os.path.exists(candidate):
            return candidate
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


# git_repository's answers in this process: {root: (what its .git was, GitRepository)}.
# A long run asks about the same root on every task step; git is asked again only when
# the .git it found is another (another folder, or a .git file rewritten).
_REPOSITORIES = {}


def _dot_git_identity(dot_git):
    """What makes git's answer for a .git the same: the folder itself (its mtime moves
    with every index.lock; in the same place, it names the same paths), or a .git file's
    words (a worktree's or submodule's "gitdir: ...", read whole: a few bytes)."""
    try:
        st = os.stat(dot_git)
        if stat.S_ISDIR(st.st_mode):
            return (dot_git, st.st_dev, st.st_ino)
        with open(dot_git, "rb") as handle:
            return (dot_git, handle.read(4097))
    except OSError:
        return None


def git_repository(root):
    """The GitRepository ``root`` is in (a path, or a task's TaskCheckout, whose
    repository is named, not looked for).  Raises GitUnavailable when there is none."""
    if isinstance(root, TaskCheckout):
        return GitRepository(root=root, toplevel=root.work_tree, git_dir=root.git_dir)
    dot_git = _dot_git_above(root)
    if dot_git is None:
        raise GitUnavailable("%s is not in a git repository" % root,
                             "run `git init` and commit your files to get task diffs; "
                             "everything else works without git")
    identity = _dot_git_identity(dot_git)
    known = _REPOSITORIES.get(root)
    if known is not None and known[0] == identity and os.path.isdir(known[1].git_dir):
        return known[1]
    try:
        out = run_git(root, ["rev-parse", "--show-toplevel", "--absolute-git-dir"])
    except GitError as err:
        raise GitUnavailable("%s is not in a git repository (%s)" % (root, err.message),
                             "run `git init` and commit your files to get task diffs; "
                             "everything else works without git") from err
    lines = os.fsdecode(out).splitlines()
    if len(lines) < 2 or not lines[0]:
        raise GitUnavailable("%s is not in a git work tree (a bare repository?)" % root,
                             "run ferrus in a checkout with a work tree")
    repository = GitRepository(root=root, toplevel=os.path.normpath(lines[0]),
                               git_dir=os.path.normpath(lines[1]))
    if identity is not None and isinstance(root, str):
        _REPOSITORIES[root] = (identity, repository)
    return repository


# -- git: a task's worktree is hostile ground ----------------------------------------------
#
# The executor owns every file of its worktree, the .git file that tells git where the
# worktree's repository is included: rewritten, it would make git commit into the user's
# checkout, or read a configuration the agent wrote (whose filter and hook commands git
# runs).  So ferrus never lets git discover a task's repository: every call on a task's
# worktree names its git folder and work tree (TaskCheckout), taken from the repository's
# own records of its worktrees (.git/worktrees/*/gitdir, which the agent's edit rights do
# not reach), and refuses a worktree whose .git no longer points there.  Those calls also
# run with no hooks, no filters, no merge drivers and no fsmonitor, whatever the task's
# files say: git runs nothing the task wrote.


class TamperedWorktree(GitError):
    """A task's worktree no longer points to the git folder ferrus made it with."""


@deferred_dataclass(frozen=True)
class TaskCheckout:
    """A task's worktree as ferrus made it: its work tree (top folder), its git folder
    inside the repository's .git, and the folder git runs in (the project's subfolder of
    the worktree, or its top)."""

    work_tree: str
    git_dir: str
    common_dir: str
    cwd: str
    overrides: tuple = ()      # -c settings that switch off what would run commands

    def git_options(self):
        return ["--git-dir=" + self.git_dir, "--work-tree=" + self.work_tree] + list(
            self.overrides)


def _read_first_line(path, limit=4096):
    with open(path, "rb") as handle:
        return handle.read(limit).split(b"\n", 1)[0].strip().decode("utf-8", "surrogateescape")


def _worktree_admin_dirs(common_dir):
    """{worktree's .git path (real, normalised): its git folder} from the repository's
    own records (<common dir>/worktrees/<name>/gitdir), for every linked worktree."""
    found = {}
    folder = os.path.join(common_dir, "worktrees")
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    for name in names:
        admin = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            pointer = _read_first_line(os.path.join(admin, "gitdir"))
            if pointer:
                pointer = os.path.join(admin, pointer) if not os.path.isabs(pointer) else pointer
                found[os.path.normcase(os.path.realpath(pointer))] = admin
    return found


def worktree_admin_dir(common_dir, work_tree):
    """The git folder the repository keeps for its linked worktree at ``work_tree``, or
    None when it keeps none."""
    dot_git = os.path.normcase(os.path.realpath(os.path.join(work_tree, ".git")))
    # First the folder the worktree's .git names, taken only when the repository's own
    # record there points back at this worktree — the record decides, as in the scan
    # below, which reads every worktree's record (dozens in a parallel run).
    named = _admin_named_by(os.path.join(work_tree, ".git"), common_dir)
    if named is not None:
        with contextlib.suppress(OSError):
            pointer = _read_first_line(os.path.join(named, "gitdir"))
            if pointer and os.path.normcase(os.path.realpath(os.path.join(
                    named, pointer))) == dot_git:
                return named
    return _worktree_admin_dirs(common_dir).get(dot_git)


def _admin_named_by(dot_git, common_dir):
    """<common dir>/worktrees/<name> when the .git file ``dot_git`` names such a folder
    (a first guess only), else None."""
    try:
        if os.path.islink(dot_git) or not os.path.isfile(dot_git):
            return None
        line = _read_first_line(dot_git)
    except OSError:
        return None
    if not line.startswith("gitdir:"):
        return None
    name = os.path.basename(os.path.normpath(line[len("gitdir:"):].strip()))
    if not name or name in (".", ".."):
        return None
    return os.path.join(common_dir, "worktrees", name)


# {checkout path: its common dir}, asked of git once per process and path.
_COMMON_GIT_DIRS = {}


def common_git_dir(root):
    """The repository's own .git folder (its common dir) for the checkout at ``root``."""
    key = os.path.abspath(root)
    found = _COMMON_GIT_DIRS.get(key)
    if found is None or not os.path.isdir(found):
        git_repository(root)               # GitUnavailable outside any repository
        out = os.fsdecode(run_git(root, ["rev-parse", "--git-common-dir"])).strip()
        # Relative to where git ran (before git 2.31's --path-format there is no other way).
        found = _COMMON_GIT_DIRS[key] = os.path.normpath(os.path.join(key, out))
    return found


# -c settings for every git call on a task's worktree, by common dir: hooks, filters and
# merge drivers the repository's configuration defines are switched off (they would run
# commands on the task's files, or commands the task's files are: a relative
# core.hooksPath or filter command names a file of the worktree).
_PINNED_OVERRIDES = {}


def _pinned_overrides(common_dir):
    cached = _PINNED_OVERRIDES.get(common_dir)
    if cached is not None:
        return cached
    overrides = ["-c", "gc.auto=0",
                 "-c", "maintenance.auto=false", "-c", "submodule.recurse=false"]
    out = b""
    with contextlib.suppress(GitError):
        out = run_git(common_dir, ["--git-dir=" + common_dir, "config", "-z",
                                   "--get-regexp", r"^(filter|merge)\..+\."], ok=(0, 1))
    seen = set()
    for entry in os.fsdecode(out).split("\0"):
        key = entry.split("\n", 1)[0]
        section, _, rest = key.partition(".")
        name, _, variable = rest.rpartition(".")
        if not name or "=" in name or (section, name) in seen:
            continue
        seen.add((section, name))
        if section == "filter":
            for variable in ("clean", "smudge", "process"):
                overrides += ["-c", "filter.%s.%s=" % (name, variable)]
            overrides += ["-c", "filter.%s.required=false" % name]
        elif section == "merge":
            # A custom merge driver that always reports a conflict: ferrus then hands the
            # file to the executor instead of running the driver.
            overrides += ["-c", "merge.%s.driver=false" % name]
    result = tuple(overrides)
    _PINNED_OVERRIDES[common_dir] = result
    return result


def task_checkout(root, work_tree, cwd=None, verify=True):
    """The TaskCheckout of the linked worktree at ``work_tree`` of the repository the
    user's checkout ``root`` is in; ``cwd`` is where git runs (default: the work tree).

    Raises TamperedWorktree when the worktree's .git is not the one-line file git wrote,
    pointing to the git folder the repository keeps for that worktree (an agent rewrote
    it, replaced it with a folder, or deleted it) — unless ``verify`` is False (only to
    save the files of a worktree about to go) — and GitError when the repository keeps
    no such worktree at all."""
    work_tree = os.path.abspath(work_tree)
    common = common_git_dir(root)
    admin = worktree_admin_dir(common, work_tree)
    if admin is None:
        raise GitError("%s is not a worktree of the repository at %s" % (work_tree, root),
                       "`git worktree list` there shows its worktrees; `ferrus doctor` "
                       "finds tasks whose worktree is missing")
    dot_git = os.path.join(work_tree, ".git")
    problem = None
    try:
        if not verify:
            pass            # saving a tampered worktree's files: git reads no .git anyway
        elif os.path.islink(dot_git) or not os.path.isfile(dot_git):
            problem = "it is no longer a file" if os.path.lexists(dot_git) else "it is gone"
        else:
            line = _read_first_line(dot_git)
            pointer = line[len("gitdir:"):].strip() if line.startswith("gitdir:") else None
            if pointer is None:
                problem = "it no longer names a git folder"
            else:
                pointed = os.path.join(work_tree, pointer) if not os.path.isabs(pointer) \
                    else pointer
                if not _same_path(pointed, admin):
                    problem = "it points to %s" % display_path(pointer)
    except OSError as err:
        problem = "it cannot be read (%s)" % err.strerror
    if problem:
        raise TamperedWorktree(
            "the task's worktree %s has a .git that ferrus did not write: %s, where "
            "ferrus made it point to %s" % (work_tree, problem, admin),
            "nothing of the task was committed; its files are kept for a look, and "
            "`ferrus task cancel ID` removes them")
    return TaskCheckout(work_tree=work_tree, git_dir=admin, common_dir=common,
                        cwd=os.path.abspath(cwd) if cwd else work_tree,
                        overrides=_pinned_overrides(common))


_PATH_NEEDS_QUOTES = LazyPattern(r'[\x00-\x1f\x7f"\\]')
_PATH_ESCAPES = {"\a": r"\a", "\b": r"\b", "\t": r"\t", "\n": r"\n", "\v": r"\v",
                 "\f": r"\f", "\r": r"\r", '"': r'\"', "\\": r"\\"}


def display_path(path):
    """A changed file's name for a list or a --stat line, quoted as git quotes it when
    it holds a control character, a quote or a backslash: a newline in a file name must
    not start a line of its own (a fake stat line in what a reviewer reads).  Other
    characters, Unicode included, are shown as they are."""
    if not _PATH_NEEDS_QUOTES.search(path):
        return path
    return '"%s"' % _PATH_NEEDS_QUOTES.sub(
        lambda match: _PATH_ESCAPES.get(match.group()) or "\\%03o" % ord(match.group()), path)


def diff_exclusions(agents_path=".agents"):
    """Project-relative paths never part of a task's diff (see DIFF_EXCLUDED_PATHS)."""
    paths = list(DIFF_EXCLUDED_PATHS)
    skills = os.path.normpath(agents_path or ".")
    if not os.path.isabs(skills) and not skills.startswith(".."):
        paths += [os.path.join(skills, rel).replace(os.sep, "/") if skills != "." else rel
                  for rel in DIFF_EXCLUDED_SKILLS]
    return paths


def _pathspecs(exclude, paths=None):
    specs = [":(literal)" + p for p in paths] if paths else ["."]
    return ["--"] + specs + [":(exclude,literal)" + p for p in exclude]


def _parse_status_v2(out):
    """(oid, branch, dirty paths) from ``git status --porcelain=v2 --branch -z``."""
    fields = os.fsdecode(out).split("\0")
    oid = branch = None
    dirty = []
    index = 0
    while index < len(fields):
        entry = fields[index]
        index += 1
        if entry.startswith("# branch.oid "):
            value = entry[len("# branch.oid "):]
            oid = None if value == "(initial)" else value
        elif entry.startswith("# branch.head "):
            value = entry[len("# branch.head "):]
            branch = None if value == "(detached)" else value
        elif entry.startswith(("1 ", "u ")):
            dirty.append(entry.split(" ", 8 if entry[0] == "1" else 10)[-1])
        elif entry.startswith("2 "):
            dirty.append(entry.split(" ", 9)[-1])
            index += 1                      # the original path of a rename
        elif entry.startswith("? "):
            dirty.append(entry[2:])
    return oid, branch, dirty


def record_task_base(root, exclude):
    """(base, warnings): where a new task starts in git — the HEAD commit (None in a
    repository without commits), the branch (None on a detached HEAD) and the files
    already changed — and what the human should know about it.  Without git the base
    says why there is none; this never fails."""
    try:
        repo = git_repository(root)
        out = run_git(root, ["status", "--porcelain=v2", "--branch", "-z",
                             "--ignore-submodules=dirty"] + _pathspecs(exclude))
    except FerrusError as err:
        return {"git": False, "reason": err.message}, []
    commit, branch, dirty = _parse_status_v2(out)
    base = {"git": True, "commit": commit, "branch": branch,
            "dirty": dirty[:BASE_DIRTY_NAMES], "dirty_count": len(dirty)}
    warnings = []
    if dirty:
        more = len(dirty) - BASE_DIRTY_NAMES
        warnings.append("the working tree had uncommitted changes when the task was created "
                        "(%s%s); they will show in the task's diff"
                        % (", ".join(map(display_path, dirty[:BASE_DIRTY_NAMES])),
                           " and %d more" % more if more > 0 else ""))
    if commit is None:
        warnings.append("the repository has no commits yet: the task's diff shows every "
                        "file as new")
    elif branch is None:
        warnings.append("HEAD is detached (at %s): the task's base is that commit, on no "
                        "branch" % commit[:12])
    operation = repo.operation_in_progress()
    if operation:
        base["operation"] = operation
        warnings.append("a git %s is in progress: the task's diff will include what it "
                        "changes; finish it (or abort it) before the task, if you can"
                        % operation)
    submodules = repo.submodules()
    if submodules:
        base["submodules"] = submodules
        warnings.append("the repository has submodules (%s): the task's diff shows a changed "
                        "submodule as its new commit, not the changes inside it"
                        % ", ".join(submodules))
    return base, warnings


def describe_base(base):
    """One line naming a task base."""
    if not base:
        return "no base recorded"
    if not base.get("git"):
        return "no git base (%s)" % base.get("reason", "unknown")
    if base.get("commit") is None:
        where = "no commit yet"
    else:
        where = base["commit"][:12]
    return "%s%s" % (where, " on branch %s" % base["branch"] if base.get("branch")
                     else " (detached HEAD)" if base.get("commit") else "")


@deferred_dataclass
class ChangedFile:
    """One file of a task's diff, with its added and deleted line counts."""

    path: str
    added: "int | None"          # None for a binary file
    deleted: "int | None"
    old_path: "str | None" = None  # where a renamed file came from

    def to_json(self):
        out = {"path": self.path, "added": self.added, "deleted": self.deleted,
               "binary": self.added is None}
        if self.old_path:
            out["old_path"] = self.old_path
        return out


@deferred_dataclass
class TaskDiff:
    """A task's changes: base → working tree, with a bounded part of the patch."""

    base: dict
    files: list
    notes: list
    patch_head: str = ""     # the patch's first bytes (the whole patch when it fits)
    patch_tail: str = ""     # its last bytes when the middle was left out
    patch_bytes: int = 0     # the patch's whole size
    patch_cut: "tuple | None" = None     # (first byte, end byte) left out, or None

    def totals(self):
        return (sum(f.added or 0 for f in self.files), sum(f.deleted or 0 for f in self.files))

    def stat_text(self, max_files=500, width=40):
        """git's --stat, roughly: a line per file, then the totals."""
        if not self.files:
            return " no changes"
        lines = []
        name_width = min(60, max(len(self._label(f)) for f in self.files[:max_files]))
        biggest = max((f.added or 0) + (f.deleted or 0) for f in self.files) or 1
        for changed in self.files[:max_files]:
            label = self._label(changed)
            if changed.added is None:
                lines.append(" %s | Bin" % label.ljust(name_width))
                continue
            count = changed.added + changed.deleted
            scale = min(1.0, width / biggest)
            plus = int(round(changed.added * scale)) or (1 if changed.added else 0)
            minus = int(round(changed.deleted * scale)) or (1 if changed.deleted else 0)
            lines.append(" %s | %5d %s%s" % (label.ljust(name_width), count, "+" * plus,
                                             "-" * minus))
        if len(self.files) > max_files:
            lines.append(" ... and %d more files" % (len(self.files) - max_files))
        added, deleted = self.totals()
        lines.append(" %d file%s changed, %d insertion%s(+), %d deletion%s(-)" % (
            len(self.files), "" if len(self.files) == 1 else "s", added,
            "" if added == 1 else "s", deleted, "" if deleted == 1 else "s"))
        return "\n".join(lines)

    @staticmethod
    def _label(changed):
        return ("%s => %s" % (display_path(changed.old_path), display_path(changed.path))
                if changed.old_path else display_path(changed.path))

    def patch_text(self, more_hint=""):
        """The patch as far as it was kept, with a note where its middle was left out."""
        if self.patch_cut is None:
            return self.patch_head
        first, end = self.patch_cut
        return "%s\n[ferrus: the diff has %d bytes; bytes %d to %d (%d bytes) are left out.%s]\n\n%s" % (
            self.patch_head, self.patch_bytes, first, end, end - first,
            " " + more_hint if more_hint else "", self.patch_tail)


def _parse_numstat(out):
    """[ChangedFile] from ``git diff --numstat -z``."""
    fields = os.fsdecode(out).split("\0")
    files, index = [], 0
    while index < len(fields):
        entry = fields[index]
        index += 1
        if not entry:
            continue
        added, deleted, path = entry.split("\t", 2)
        old = None
        if not path:                          # a rename: the two paths follow
            old, path = fields[index], fields[index + 1]
            index += 2
        binary = added == "-"
        files.append(ChangedFile(path=path, added=None if binary else int(added),
                                 deleted=None if binary else int(deleted), old_path=old))
    return files


def _cut_lines(head, tail, total):
    """(head text, tail text, cut) with the head ending and the tail starting at a line
    boundary; cut is the (first, end) byte range left out, or None."""
    if total <= len(head):
        return head.decode("utf-8", "replace"), "", None
    newline = head.rfind(b"\n")
    if newline >= 0:
        head = head[:newline + 1]
    newline = tail.find(b"\n")
    if 0 <= newline < len(tail) - 1:
        tail = tail[newline + 1:]
    return (head.decode("utf-8", "replace"), tail.decode("utf-8", "replace"),
            (len(head), total - len(tail)))


def _without_nested(untracked, notes):
    """``untracked`` without the nested repositories git lists as "dir/" (noted)."""
    nested = [p for p in untracked if p.endswith("/")]
    if nested:
        notes.append("untracked nested repositories are not diffed: %s" % ", ".join(nested))
    return [p for p in untracked if not p.endswith("/")]


def _new_file_numstat(root, rel):
    """ChangedFile for an untracked file, counted as git counts a new file: binary when
    its first 8,000 bytes hold a NUL, else its lines (a last line without a newline too)."""
    path = os.path.join(root, *rel.split("/"))
    if os.path.islink(path):
        return ChangedFile(rel, 1, 0)                 # git diffs a link as its target's name
    lines, last, first = 0, b"\n", True
    try:
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(1 << 20)
                if not chunk:
                    break
                if first and b"\0" in chunk[:8000]:
                    return ChangedFile(rel, None, None)
                first = False
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except OSError:
        return ChangedFile(rel, 0, 0)                 # gone or unreadable since it was listed
    return ChangedFile(rel, lines + (last != b"\n"), 0)


# How ferrus asks git for a task's diff: no external diff tools or colours of the
# user's, paths relative to the project, a submodule's inner edits not followed.
DIFF_OPTIONS = ["--no-ext-diff", "--no-color", "--relative", "--ignore-submodules=dirty"]


def _list_changes(root, compare, specs, options, notes):
    """(ChangedFile of each tracked file, path of each untracked file) against
    ``compare``: the tracked files' numstat from the user's index (read, never written)
    and the untracked listing, the two git commands run side by side."""
    listed = {}

    def list_untracked():
        try:
            listed["out"] = run_git(root, ["ls-files", "-z", "--others", "--exclude-standard"]
                                    + specs)
        except FerrusError as err:
            listed["error"] = err
    lister = threading.Thread(target=list_untracked, daemon=True)
    lister.start()
    try:
        files = _parse_numstat(run_git(root, ["diff", "-z", "--numstat"] + options + [compare]
                                       + specs))
    finally:
        lister.join()
    if "error" in listed:
        raise listed["error"]
    return files, _without_nested([p for p in os.fsdecode(listed["out"]).split("\0") if p],
                                  notes)


def _stat_files(root, compare, specs, options, notes):
    """[ChangedFile] of the diff without its patch, the untracked files counted here as
    git would count them.  A stat asks for nothing else, and this is its fast path."""
    files, untracked = _list_changes(root, compare, specs, options, notes)
    folder = _git_site(root)[0]
    files += [_new_file_numstat(folder, rel) for rel in untracked]
    files.sort(key=lambda changed: changed.path.encode("utf-8", "surrogateescape"))
    return files


def task_diff(root, base, exclude, patch=True, paths=None, head_bytes=192 * 1024,
              tail_bytes=32 * 1024, to=None):
    """The TaskDiff of the working tree against ``base`` (from record_task_base; None
    compares with HEAD), untracked files included and ``exclude`` left out; ``paths``
    narrows it to those project-relative paths.  ``to``: the commit of a recorded
    submission, diffed instead of the working tree.  Raises GitUnavailable (no diff can
    be made here) or GitError."""
    repo = git_repository(root)
    notes = []
    if to is not None:
        return _commit_diff(root, base, exclude, patch, paths, head_bytes, tail_bytes, to)
    head = repo.head()
    if base and not base.get("git", True):
        # No base could be taken then (no repository yet, git missing or failing).
        notes.append("no base was recorded when the task was created (%s): the diff is "
                      "against HEAD" % base.get("reason"))
        base = None
        start = head
    elif base:
        start = base.get("commit")
        if start and start != head and not repo.has_commit(start):
            raise GitError("the task's base commit %s is no longer in the repository"
                           % start[:12], "its history was rewritten; `git diff` against "
                           "another commit shows the changes by hand")
        if start and head and head != start and base.get("onto_target"):
            notes.append("the merge queue put the task's branch on the target's head %s "
                         "(HEAD %s): the diff is the task's work on top of it"
                         % (start[:12], head[:12]))
        elif start and head and head != start:
            notes.append("HEAD has moved since the task was created (base %s, HEAD %s): "
                         "commits made since are part of the diff" % (start[:12], head[:12]))
        if base.get("dirty_count"):
            names = base.get("dirty") or []
            more = base["dirty_count"] - len(names)
            notes.append("already changed before the task began (the diff includes those "
                         "changes): %s%s" % (", ".join(map(display_path, names)),
                                             " and %d more" % more if more > 0 else ""))
    else:
        start = head
        notes.append("no task base is recorded: the diff is against HEAD")
    operation = repo.operation_in_progress()
    if operation:
        notes.append("a git %s is in progress in this checkout" % operation)
    submodules = repo.submodules()
    if submodules:
        notes.append("submodules (%s) show as their commit, not the changes inside them"
                     % ", ".join(submodules))
    compare = start or repo.empty_tree()
    specs = _pathspecs(exclude, paths)
    options = DIFF_OPTIONS
    if not patch:
        return TaskDiff(base=base or {}, notes=notes,
                        files=_stat_files(root, compare, specs, options, notes))
    # A private copy of the index: untracked files are added to it as intent-to-add,
    # so that one `git diff` shows them as new files; the user's index is untouched.
    with private_index(repo.git_dir) as index_file:
        untracked = [p for p in os.fsdecode(run_git(
            root, ["ls-files", "-z", "--others", "--exclude-standard"] + specs,
            index_file=index_file)).split("\0") if p]
        untracked = _without_nested(untracked, notes)
        for start_at in range(0, len(untracked), 500):
            run_git(root, ["--literal-pathspecs", "add", "--intent-to-add", "--"]
                    + untracked[start_at:start_at + 500], index_file=index_file)
        files = _parse_numstat(run_git(root, ["diff", "-z", "--numstat"] + options + [compare]
                                       + specs, index_file=index_file))
        diff = TaskDiff(base=base or {}, files=files, notes=notes)
        if files:
            raw_head, raw_tail, total = stream_git(
                root, ["diff", "--no-textconv", "--src-prefix=a/", "--dst-prefix=b/"]
                + options + [compare] + specs, head_bytes, tail_bytes, index_file=index_file)
            diff.patch_head, diff.patch_tail, diff.patch_cut = _cut_lines(raw_head, raw_tail,
                                                                         total)
            diff.patch_bytes = total
        return diff


def _commit_diff(root, base, exclude, patch, paths, head_bytes, tail_bytes, to):
    """task_diff of a recorded submission: base → the commit ``to``."""
    start = (base or {}).get("commit")
    if not start:
        raise GitError("the submission has no base commit to compare with",
                       "`ferrus doctor` checks the task's records")
    notes = []
    if base.get("onto_target"):
        notes.append("the merge queue put the task on the target's head %s: the diff is "
                     "the task's work on top of it" % start[:12])
    specs = _pathspecs(exclude, paths)
    compare = [start, to]
    files = _parse_numstat(run_git(root, ["diff", "-z", "--numstat"] + DIFF_OPTIONS + compare
                                   + specs))
    diff = TaskDiff(base=base, files=files, notes=notes)
    if patch and files:
        raw_head, raw_tail, total = stream_git(
            root, ["diff", "--no-textconv", "--src-prefix=a/", "--dst-prefix=b/"]
            + DIFF_OPTIONS + compare + specs, head_bytes, tail_bytes)
        diff.patch_head, diff.patch_tail, diff.patch_cut = _cut_lines(raw_head, raw_tail, total)
        diff.patch_bytes = total
    return diff


@contextlib.contextmanager
def private_index(git_dir):
    """The path of a private copy of the index of the checkout whose git folder is
    ``git_dir``, deleted afterwards: git commands given it (index_file=) stage, diff
    and write trees without touching the real index."""
    fd, index_file = tempfile.mkstemp(prefix="ferrus-", suffix=".index", dir=git_dir)
    try:
        with os.fdopen(fd, "wb") as copy:
            with contextlib.suppress(FileNotFoundError):
                with open(os.path.join(git_dir, "index"), "rb") as original:
                    shutil.copyfileobj(original, copy, 1 << 20)
                    written = os.fstat(original.fileno())
                    copy.flush()
                    # The copy keeps the index's own time: git trusts an entry's cached
                    # stat only when the file is older than the index, so a newer copy
                    # would hide a same-size edit made in the second of the last commit.
                    os.utime(index_file, ns=(written.st_atime_ns, written.st_mtime_ns))
        if os.path.getsize(index_file) == 0:
            os.unlink(index_file)            # git reads a missing index as empty, not a 0-byte one
        yield index_file
    finally:
        with contextlib.suppress(OSError):
            os.unlink(index_file)


# -- git: a submission recorded as a commit ---------------------------------------------
#
# What the reviewer of a parallel task reads and what the merge gate merges are one and
# the same commit: at submit, ferrus records the worktree's files as a commit on the
# task's base (snapshot_worktree) and keeps it under refs/ferrus/<task>/; later edits in
# the worktree (a process the executor left behind) change nothing of it.  The commit is
# built from the files alone, with a private index, so neither the executor's own
# commits nor its index decide what it holds, and ferrus's own files (the exclusions of
# every diff) are always as the base has them: whatever reaches the target is in the
# reviewer's diff.

# A task's refs: each submission, and the work a cancel or a hand-over saved.
TASK_REF_PREFIX = "refs/ferrus/"
# Snapshot commits are ferrus's own bookkeeping, never the target's history (the merge
# gate makes the commits the target gains, in the user's name): a fixed identity, so a
# repository without one configured can still record a submission.
SNAPSHOT_IDENTITY = {"GIT_AUTHOR_NAME": "ferrus", "GIT_AUTHOR_EMAIL": "ferrus@localhost",
                     "GIT_COMMITTER_NAME": "ferrus", "GIT_COMMITTER_EMAIL": "ferrus@localhost"}


def task_ref(task, name):
    """The ref ``name`` (submit-3, saved-20261127T101500) of task ``task``."""
    return "%s%s/%s" % (TASK_REF_PREFIX, task, name)


def snapshot_worktree(checkout, base, exclude, message, left_out=None):
    """The commit (not yet on any ref) of the files of the task's worktree: the tree of
    ``base`` with every path of the project folder (``checkout.cwd``) as the worktree
    has it — tracked or untracked, .gitignore honoured — except ``exclude`` (ferrus's own
    files), which stay as ``base`` has them, as does everything outside the project
    folder.  Its parent is ``base``.  The worktree, its index and its branch are left as
    they are.  An untracked folder holding a git repository of its own is left out (git
    would record it as a bare link to a commit of that repository, or fail on one
    without a commit): its path (relative to the project folder, with a "/") is added
    to the list ``left_out`` when one is given."""
    nested = nested_repositories(checkout)
    if left_out is not None:
        left_out.extend(nested)
    with private_index(checkout.git_dir) as index_file:
        # Everything as the base has it first (the executor may have committed or staged
        # anything), keeping the cached stat data of the files that did not change.
        run_git(checkout, ["reset", "-q", base, "--", ":/"], index_file=index_file)
        run_git(checkout, ["add", "-A"] + _pathspecs(list(exclude) + nested),
                index_file=index_file, ok=(0, 1))
        if exclude:
            run_git(checkout, ["reset", "-q", base, "--"] +
                    [":(literal)" + path for path in exclude], index_file=index_file)
        tree = os.fsdecode(run_git(checkout, ["write-tree"], index_file=index_file)).strip()
    return commit_tree(checkout, tree, [base], message, SNAPSHOT_IDENTITY)


def nested_repositories(checkout):
    """The untracked folders of the project folder that hold a git repository of their
    own (git lists each as one entry ending in "/"), relative to the project folder."""
    out = run_git(checkout, ["ls-files", "-z", "--others", "--exclude-standard"], ok=(0, 1))
    return sorted(os.fsdecode(name) for name in out.split(b"\0") if name.endswith(b"/"))


def commit_tree(where, tree, parents, message, identity=None):
    """A new commit of ``tree`` with ``parents`` and ``message`` (git commit-tree; no
    hook runs, no ref moves).  ``identity``: author and committer variables, else the
    repository's user.name and user.email."""
    args = ["commit-tree", tree]
    for parent in parents:
        args += ["-p", parent]
    try:
        out = run_git(where, args, stdin=message.encode("utf-8", "surrogateescape"),
                      env=identity)
    except GitError as err:
        if identity is None and _no_identity(where):
            raise GitError(err.message, "git does not know who commits here: set `git "
                           "config user.name \"Your Name\"` and `git config user.email "
                           "you@example.com` in the repository, then try again") from None
        raise
    return os.fsdecode(out).strip()


def _no_identity(where):
    try:
        run_git(where, ["var", "GIT_COMMITTER_IDENT"])
        return False
    except GitError:
        return True


def commit_parent(where, commit):
    """The first parent of ``commit`` (None for a root commit)."""
    out = run_git(where, ["rev-parse", "-q", "--verify", commit + "^1"], ok=(0, 1))
    return os.fsdecode(out).strip() or None


def commit_message(where, commit):
    """The whole message of ``commit``."""
    return os.fsdecode(run_git(where, ["show", "-s", "--format=%B", commit])).rstrip("\n")


def set_task_ref(root, ref, commit):
    """Point ``ref`` at ``commit`` (in the repository of the user's checkout ``root``)."""
    run_git(root, ["update-ref", "-m", "ferrus", ref, commit])


def task_refs(root, task):
    """{name: commit} of the refs under refs/ferrus/<task>/ (submit-N, saved-...)."""
    prefix = task_ref(task, "")
    out = os.fsdecode(run_git(root, ["for-each-ref", "--format=%(objectname) %(refname)",
                                     prefix]))
    refs = {}
    for line in out.splitlines():
        commit, _, ref = line.partition(" ")
        if ref.startswith(prefix):
            refs[ref[len(prefix):]] = commit
    return refs


def delete_task_refs(root, task, keep=("saved-",)):
    """Remove the task's refs but those whose name starts with one of ``keep`` (the work
    a cancel saved stays until the user drops it)."""
    lines = ["delete %s\n" % task_ref(task, name)
             for name in task_refs(root, task) if not name.startswith(tuple(keep))]
    if lines:
        run_git(root, ["update-ref", "--stdin"], stdin="".join(lines).encode("utf-8"))


# -- git: the task's branch and its commit ([git] branch, [git] commit) -------------------
#
# The only two places ferrus writes to a repository, and both only add: a new branch at
# HEAD (the work tree, the index and any uncommitted change stay exactly as they were)
# and a new commit on the task's branch holding the task's own files.  ferrus never
# resets, stashes, pushes or rewrites anything; whatever refuses leaves the repository
# as it found it, and the error says why and what to do by hand.

# Commit hooks may run a test suite: they get longer than a read.
GIT_COMMIT_TIMEOUT_SECS = 600.0
# How much of git's own words (a hook's output, say) a commit failure keeps.
GIT_FAILURE_CHARS = 2000


def _finish_or_abort(operation):
    return ("`git bisect reset`" if operation == "bisect" else
            "`git %s --continue` or `git %s --abort`" % (operation, operation))


def current_branch(root):
    """The branch HEAD is on (also an unborn one), or None on a detached HEAD."""
    out = run_git(root, ["symbolic-ref", "-q", "--short", "HEAD"], ok=(0, 1))
    return os.fsdecode(out).strip() or None


def create_task_branch(root, name, base):
    """Create branch ``name`` at HEAD and check it out; the work tree, the index and any
    uncommitted change stay as they are (they come along).  ``base`` is what
    record_task_base just found (the branch HEAD is on, a git operation in progress).
    Returns the branch HEAD was on before (None from a detached HEAD).  Raises GitError
    saying why not — the repository is then unchanged."""
    hint_off = "; or set branch = \"\" in [git] of %s to work without a branch" % CONFIG_FILE
    operation = base.get("operation")
    if operation:
        raise GitError("a git %s is in progress in this checkout, and a new branch now would "
                       "tangle with it" % operation, "finish it or abort it (%s), then create "
                       "the task again%s" % (_finish_or_abort(operation), hint_off))
    problem = git_branch_name_problem(name)
    if problem:
        raise GitError("%s is no valid branch name: it %s" % (json.dumps(name), problem),
                       "change [git] branch in %s" % CONFIG_FILE)
    if run_git(root, ["rev-parse", "-q", "--verify", "refs/heads/" + name], ok=(0, 1)).strip():
        raise GitError("branch %s already exists" % name,
                       "ferrus never moves an existing branch: rename it (`git branch -m %s "
                       "NEW`) or delete it, then create the task again%s" % (name, hint_off))
    run_git(root, ["checkout", "-q", "-b", name], hooks=True)
    return base.get("branch")


def remove_task_branch(root, name, previous, commit):
    """Undo create_task_branch when the task could not be created after all: back to
    ``previous`` (or the detached ``commit``) and the new branch, still at that same
    commit, deleted.  Best effort; nothing in the work tree changes either way."""
    with contextlib.suppress(FerrusError):
        if previous:
            # Both branches name the same commit: moving HEAD is all a checkout would do.
            run_git(root, ["symbolic-ref", "HEAD", "refs/heads/" + previous])
        elif commit:
            run_git(root, ["checkout", "-q", "--detach", commit])
        if commit:
            run_git(root, ["branch", "-q", "-d", name])


def _project_prefix(repo):
    """The project root relative to the repository's top level ("" when they are one)."""
    rel = os.path.relpath(os.path.realpath(repo.root), os.path.realpath(repo.toplevel))
    return "" if rel == "." else rel.replace(os.sep, "/") + "/"


def _changed_before(base, prefix):
    """A test for "this project path was already changed when the task began", from the
    base's dirty list (top-level-relative; an untracked folder is listed as "dir/")."""
    entries = [entry[len(prefix):] for entry in base.get("dirty") or ()
               if entry.startswith(prefix)]
    files = {entry for entry in entries if not entry.endswith("/")}
    folders = tuple(entry for entry in entries if entry.endswith("/"))
    return lambda path: path in files or path.startswith(folders)


def commit_task_changes(root, base, exclude, message, timeout=GIT_COMMIT_TIMEOUT_SECS):
    """Commit the task's own changes onto the branch it works on, running the user's hooks.

    The task's files are what changed since HEAD (untracked ones included, .gitignore
    honoured, ``exclude`` — .ferrus/ and the agent files — never), less the files that
    were already changed when the task began (``base["dirty"]``: the user's, left
    uncommitted).  Other staged changes in the user's index stay staged and out of the
    commit.  Returns {"commit", "branch", "files", "left_out"}; "commit" is None (with
    a "reason") when there was nothing to commit.  Raises GitUnavailable (no repository)
    or GitError saying why nothing was committed; the work tree is never touched."""
    repo = git_repository(root)
    if not base or not base.get("git"):
        raise GitError("no git base was recorded when the task was created (%s)"
                       % ((base or {}).get("reason") or "it was created without git"),
                       "commit the changes by hand (`git status` shows them)")
    operation = repo.operation_in_progress()
    if operation:
        raise GitError("a git %s is in progress in this checkout" % operation,
                       "finish it or abort it (%s), then commit the task's changes by hand "
                       "(`ferrus diff --stat` lists them)" % _finish_or_abort(operation))
    branch = current_branch(root)
    expected = base.get("branch")
    if branch is None or branch != expected:
        raise GitError("HEAD is %s, but the task %s: ferrus commits only onto the task's "
                       "branch" % ("detached" if branch is None else "on branch " + branch,
                                   "works on branch " + expected if expected
                                   else "began on a detached HEAD"),
                       "%scommit the task's changes by hand (`ferrus diff --stat` lists them)"
                       % ("`git switch %s`, then " % expected if expected else ""))
    if (base.get("dirty_count") or 0) > len(base.get("dirty") or ()):
        raise GitError("%d files were already changed when the task began, more than ferrus "
                       "keeps by name, so it cannot tell the task's changes from yours"
                       % base["dirty_count"],
                       "commit the task's files by hand (`ferrus diff --stat` lists them)")
    changed_before = _changed_before(base, _project_prefix(repo))
    tracked, untracked = _list_changes(root, repo.head() or repo.empty_tree(),
                                       _pathspecs(exclude), DIFF_OPTIONS, [])
    paths, left_out = [], []
    for path in sorted(set(untracked).union(
            *(filter(None, (changed.path, changed.old_path)) for changed in tracked)),
            key=lambda path: path.encode("utf-8", "surrogateescape")):
        (left_out if changed_before(path) else paths).append(path)
    if not paths:
        return {"commit": None, "branch": branch, "files": 0, "left_out": left_out,
                "reason": "the task changed no files" if not left_out else
                "the task changed only files that were already changed before it began "
                "(%s); they are yours to commit" % ", ".join(left_out)}
    # A new file must be known to the index for `git commit -- PATH`: intent-to-add
    # records only its name, and is taken back if the commit fails.
    added = [p for p in paths if p in set(untracked)]
    fd, message_file = tempfile.mkstemp(prefix="ferrus-commit-", suffix=".txt",
                                        dir=repo.git_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(message)
        if added:
            run_git(root, ["--literal-pathspecs", "add", "--intent-to-add",
                           "--pathspec-from-file=-", "--pathspec-file-nul"],
                    stdin=nul_list(added))
        try:
            run_git(root, ["--literal-pathspecs", "commit", "-q", "--cleanup=whitespace",
                           "-F", message_file, "--pathspec-from-file=-",
                           "--pathspec-file-nul"], stdin=nul_list(paths), timeout=timeout,
                    hooks=True)
        except GitError as err:
            if added:
                with contextlib.suppress(FerrusError):
                    run_git(root, ["--literal-pathspecs", "rm", "-q", "--cached",
                                   "--ignore-unmatch", "--pathspec-from-file=-",
                                   "--pathspec-file-nul"], stdin=nul_list(added))
            raise _commit_failure(err) from err
    finally:
        with contextlib.suppress(OSError):
            os.unlink(message_file)
    commit = os.fsdecode(run_git(root, ["rev-parse", "HEAD"])).strip()
    return {"commit": commit, "branch": branch, "files": len(paths), "left_out": left_out}


def nul_list(names):
    """Paths as git's --pathspec-file-nul reads them."""
    return b"".join(os.fsencode(name) + b"\0" for name in names)


def _commit_failure(err):
    """The GitError of a refused `git commit`, with git's (or the hook's) words kept
    and a hint for the usual cause."""
    said = err.message
    if len(said) > GIT_FAILURE_CHARS:
        said = said[:GIT_FAILURE_CHARS] + " [...]"
    if "tell me who you are" in said or "empty ident" in said or "ident name" in said:
        hint = ("git does not know who commits here: set `git config user.name \"Your "
                "Name\"` and `git config user.email you@example.com`, then commit the "
                "task's files by hand (`ferrus diff --stat` lists them)")
    elif "hook" in said.lower() or "exit 1)" in said:
        hint = ("a commit hook refuses it, most likely (its output, if any, is above): fix "
                "what it says and commit the task's files by hand (`ferrus diff --stat` "
                "lists them)")
    else:
        hint = "commit the task's files by hand (`ferrus diff --stat` lists them)"
    return GitError(said, hint)


def _same_path(one, other):
    return os.path.normcase(os.path.realpath(one)) == os.path.normcase(os.path.realpath(other))
