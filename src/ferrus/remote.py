"""The team's remote: the target's upstream fetched, merges pushed, pull requests.

[git] fetch, push, publish and pr in a parallel run: tasks start from and merge onto
what the team has; a merged target is pushed (never forced), or each task's checked
work is pushed as its own branch and a pull request is opened through gh, glab or tea.
A missing CLI, remote or credential stops the run before any agent starts."""

import os
import shutil
import subprocess

from .basics import FerrusError, deferred_dataclass, terminal_safe
from .config import CONFIG_FILE
from .store import CANCELLED_STATUS, PUBLISHED_STATUS, TASK_BRANCH_PREFIX, read_task_record
from .git import GitError, commit_message, run_git
from .worktrees import _is_ancestor, fast_forward_target, target_head
from .operations import ORCHESTRATOR, short_task_id
from .task_queue import merge_unless_cancelled, update_task


# A fetch or a push waits this long for the remote (a slow network, a large push).
REMOTE_TIMEOUT_SECS = 180.0
# How much of what git or a pull request CLI said is kept for a message.
REMOTE_OUTPUT_CHARS = 1500
# What a pull request's body holds of each part of the task (its text, the submission,
# the review notes): the whole body stays well under what gh, glab and tea accept.
PULL_REQUEST_PART_CHARS = 8000


class UpstreamDiverged(FerrusError):
    """The target and its upstream both have commits the other lacks: ferrus never
    rewrites history, so a human brings them together."""


@deferred_dataclass
class Upstream:
    """Where the team's target lives: a remote and its branch."""

    remote: str
    branch: str

    @property
    def name(self):
        return "%s/%s" % (self.remote, self.branch)

    @property
    def ref(self):
        return "refs/remotes/%s/%s" % (self.remote, self.branch)


def _config_value(root, key):
    return os.fsdecode(run_git(root, ["config", "--get", key], ok=(0, 1))).strip()


def remote_names(root):
    return os.fsdecode(run_git(root, ["remote"])).split()


def target_upstream(root, target, git):
    """The Upstream [git] fetch follows for branch ``target``: the branch's own upstream
    (`git branch --set-upstream-to`), else the branch of the same name on [git] push's
    remote.  Raises FerrusError when it has neither."""
    remote = _config_value(root, "branch.%s.remote" % target)
    merge = _config_value(root, "branch.%s.merge" % target)
    if remote and remote != "." and merge.startswith("refs/heads/"):
        return Upstream(remote, merge[len("refs/heads/"):])
    if git.push:
        return Upstream(git.push, target)
    raise FerrusError("[git] fetch = true, but %s has no upstream to fetch" % target,
                      "`git branch --set-upstream-to origin/%s %s` names it, or set [git] "
                      "push = \"origin\" in %s (then origin's %s is fetched)" % (
                          target, target, CONFIG_FILE, target))


def _git_said(err):
    """What git said, bounded and safe to print."""
    return terminal_safe(err.message if isinstance(err, FerrusError) else str(err)
                         )[-REMOTE_OUTPUT_CHARS:]


def fetch_upstream(root, upstream):
    """Fetch ``upstream``'s branch into its remote-tracking ref; the commit it is at, or
    None when the remote has no such branch (yet).  Raises GitError saying what failed
    (no network, no access)."""
    try:
        run_git(root, ["fetch", "--quiet", "--no-tags", "--no-recurse-submodules",
                       upstream.remote, "+refs/heads/%s:%s" % (upstream.branch, upstream.ref)],
                timeout=REMOTE_TIMEOUT_SECS)
    except GitError as err:
        if "couldn't find remote ref" in err.message:
            return None
        raise GitError("fetching %s failed: %s" % (upstream.name, _git_said(err)),
                       "check the network and your access to %s (`git fetch %s` shows what "
                       "git needs), or set [git] fetch = false" % (
                           upstream.remote, upstream.remote)) from None
    return resolve_commit(root, upstream.ref) or None


@deferred_dataclass
class Sync:
    """The target after its upstream was fetched (see sync_with_upstream)."""

    status: str            # same | ahead | moved | blocked
    before: str            # where the local target was
    head: str              # where it is now
    upstream: "str | None"  # where the upstream is (None: the remote has no such branch)
    text: str = ""         # what happened, for people


def sync_with_upstream(root, target, upstream):
    """Bring branch ``target`` up to the commit its Upstream ``upstream`` is at (fetched
    now), as a fast-forward only (fast_forward_target: your checkout follows when it is
    there, never over your uncommitted changes).  "same": nothing to do; "ahead": the
    target has commits the upstream lacks (the next push sends them); "moved": it was
    fast-forwarded; "blocked": it could not be, now (``text`` says why).  Raises
    UpstreamDiverged when each has commits the other lacks, GitError when the fetch
    fails."""
    local = target_head(root, target)
    remote = fetch_upstream(root, upstream)
    if remote is None or remote == local:
        return Sync("ahead" if remote is None else "same", local, local, remote,
                    "%s has no branch %s yet" % (upstream.remote, upstream.branch)
                    if remote is None else "")
    if _is_ancestor(root, remote, local):
        return Sync("ahead", local, local, remote, "%s has %s commit(s) %s lacks" % (
            target, _commits_between(root, remote, local), upstream.name))
    if not _is_ancestor(root, local, remote):
        raise UpstreamDiverged(
            "%s and %s have diverged: %s has %s commit(s) %s lacks, and %s has %s the other "
            "lacks" % (target, upstream.name, target, _commits_between(root, remote, local),
                       upstream.name, upstream.name, _commits_between(root, local, remote)),
            "ferrus never rewrites history: bring them together yourself (`git pull "
            "--rebase` or `git merge %s` on %s, then push), and `ferrus run --parallel` "
            "goes on where it stopped" % (upstream.name, target))
    count = _commits_between(root, local, remote)
    moved = fast_forward_target(root, target, local, remote)
    if moved.status != "done":
        return Sync("blocked", local, local, remote, "%s has %s new commit(s), and %s cannot "
                    "take them now: %s" % (upstream.name, count, target, moved.text))
    return Sync("moved", local, remote, remote, "%s moved on upstream: %s fast-forwarded "
                "from %s to %s (%s commit(s) from %s)" % (
                    target, target, local[:12], remote[:12], count, upstream.name))


def _commits_between(root, old, new):
    return os.fsdecode(run_git(root, ["rev-list", "--count", "%s..%s" % (old, new)])).strip()


@deferred_dataclass
class Push:
    """What a push did: "pushed", "rejected" (the remote refused the update) or
    "failed" (the remote could not be reached, or refused us)."""

    status: str
    text: str


def push_commit(root, remote, commit, branch):
    """Push ``commit`` to ``branch`` of ``remote`` — a fast-forward there or a new
    branch, never with force.  No hook of the checkout runs (the merge gate ran the
    checks)."""
    try:
        # Without --porcelain git says each refused ref ("! [rejected]", "! [remote
        # rejected]" with the hook's reason) on stderr, which GitError carries.
        run_git(root, ["push", "--no-verify", remote,
                       "%s:refs/heads/%s" % (commit, branch)], timeout=REMOTE_TIMEOUT_SECS)
    except GitError as err:
        text = _git_said(err)
        rejected = "[rejected]" in text or "[remote rejected]" in text
        return Push("rejected" if rejected else "failed", "the push of %s to %s's %s was %s: "
                    "%s" % (commit[:12], remote, branch, "rejected" if rejected else
                            "not made", text))
    return Push("pushed", "pushed %s to %s's %s" % (commit[:12], remote, branch))


def push_refused_hint(said, remote, branch):
    """What brings ``remote``'s ``branch`` level with the checkout's after a push git
    refused, saying ``said``: a pull --rebase only when the remote moved (a push that was
    not a fast-forward); a hook's or the host's refusal, or no answer, is fixed there."""
    push = "`git push %s %s`" % (remote, branch)
    if "[remote rejected]" in said:
        return ("%s refused it itself (its hook or branch rules: what it said is above); "
                "allow the push there and run %s, or set [git] publish = \"branch\" to push "
                "each task to a branch of its own instead" % (remote, push))
    if "[rejected]" in said:
        return ("%s's %s moved since (git said the push was not a fast-forward): bring them "
                "together (`git pull --rebase %s %s`, then %s)" % (
                    remote, branch, remote, branch, push))
    return "once %s can be reached again (what git said is above), %s" % (remote, push)


def resolve_commit(root, commit):
    """The commit ``commit`` (an id or a full ref name) is, or "" when the repository
    holds no such commit."""
    return os.fsdecode(run_git(root, ["rev-parse", "-q", "--verify", commit + "^{commit}"],
                               ok=(0, 1))).strip()


def published_branch(task):
    """The branch a task's checked work is pushed to with [git] publish = "branch"."""
    return TASK_BRANCH_PREFIX + task


# -- pull requests through the forge's own CLI -----------------------------------------------

# cli -> (what it is, how to install it, argv that fails when it is not logged in)
PULL_REQUEST_TOOLS = {
    "gh": ("the GitHub CLI", "https://cli.github.com, then `gh auth login`",
           ["gh", "auth", "status"]),
    "glab": ("the GitLab CLI", "https://gitlab.com/gitlab-org/cli, then `glab auth login`",
             ["glab", "auth", "status"]),
    "tea": ("the Gitea CLI", "https://gitea.com/gitea/tea, then `tea login add`",
            ["tea", "whoami"]),
}
# Nothing a pull request CLI asks may wait for a terminal nobody watches.
_NO_PROMPTS = {"GH_PROMPT_DISABLED": "1", "NO_PROMPT": "1", "GIT_TERMINAL_PROMPT": "0",
               "NO_COLOR": "1"}


def pull_request_argv(cli, base, head, title, body):
    """The argv that opens a pull (merge) request from ``head`` into ``base``."""
    if cli == "gh":
        return ["gh", "pr", "create", "--base", base, "--head", head, "--title", title,
                "--body", body]
    if cli == "glab":
        return ["glab", "mr", "create", "--source-branch", head, "--target-branch", base,
                "--title", title, "--description", body, "--yes"]
    return ["tea", "pulls", "create", "--head", head, "--base", base, "--title", title,
            "--description", body]


def _run_cli(root, argv):
    """(exit code, what it printed) of a pull request CLI run in the checkout."""
    env = dict(os.environ, **_NO_PROMPTS)
    try:
        proc = subprocess.run(argv, cwd=root, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=REMOTE_TIMEOUT_SECS)
    except subprocess.TimeoutExpired:
        return None, "it did not finish within %.0f s" % REMOTE_TIMEOUT_SECS
    except OSError as err:
        return None, str(err.strerror or err)
    return proc.returncode, terminal_safe(proc.stdout.decode("utf-8", "replace").strip()
                                          )[-REMOTE_OUTPUT_CHARS:]


def require_pull_request_cli(root, cli):
    """Raise FerrusError unless ``cli`` is on PATH and logged in."""
    what, install, status = PULL_REQUEST_TOOLS[cli]
    if shutil.which(cli) is None:
        raise FerrusError("[git] pr = \"%s\" opens pull requests through %s, and `%s` is not "
                          "on PATH" % (cli, what, cli),
                          "install it (%s), or set [git] pr = \"\" in %s (the task's branch "
                          "is still pushed)" % (install, CONFIG_FILE))
    code, said = _run_cli(root, status)
    if code != 0:
        raise FerrusError("`%s` says %s cannot open pull requests here%s" % (
            " ".join(status), cli, ": " + said if said else ""),
            "log in (%s), or set [git] pr = \"\" in %s" % (install.split(", then ")[-1],
                                                            CONFIG_FILE))


def open_pull_request(root, cli, base, head, title, body):
    """Open a pull request through ``cli``; its address (or the CLI's last line).
    Raises FerrusError with what the CLI said when it fails."""
    argv = pull_request_argv(cli, base, head, title, body)
    code, said = _run_cli(root, argv)
    if code != 0:
        raise FerrusError("`%s %s` failed%s: %s" % (
            cli, " ".join(argv[1:3]), " (exit %s)" % code if code is not None else "",
            said or "it printed nothing"),
            "the branch %s is pushed: open the pull request by hand" % head)
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    return next((line for line in reversed(lines) if line.startswith(("https://",
                                                                       "http://"))),
                lines[-1] if lines else "")


def pull_request_text(store, task, record, candidate, onto, target, commands):
    """(title, body) of a task's pull request: its title; its text, its submission and
    the reviewer's notes; and what the merge gate checked."""
    task_store = store.for_task(task)

    def part(name):
        text = task_store.read_file(name).strip() if task_store.exists() else ""
        return text if len(text) <= PULL_REQUEST_PART_CHARS else \
            text[:PULL_REQUEST_PART_CHARS] + "\n[… cut …]"
    approval = part("APPROVAL.md") or "Approved by the reviewer (no notes)."
    gate = "The checks passed on this branch's commit %s (its work on %s at %s) in a clean " \
           "checkout:\n%s" % (candidate[:12], target, onto[:12], "\n".join(
               "- `%s`" % command for command in commands) or "- (no [checks] commands)")
    summary = ""
    try:
        summary = commit_message(store.root, candidate).strip()
    except FerrusError:
        pass
    body = "\n\n".join(section for section in (
        "## Task\n\n" + (part("TASK.md") or record.get("title") or task),
        "## Submission\n\n" + (part("SUBMISSION.md") or summary),
        "## Review\n\n" + approval,
        "## Merge gate\n\n" + gate,
        "Ferrus-Task: %s" % task) if section)
    return record.get("title") or task, body


# -- before any agent starts ---------------------------------------------------------------

def preflight_remote(root, git, target):
    """What [git] fetch, push and pr need, tried before any agent starts: the remotes
    exist and answer with our credentials, and the pull request CLI is there and
    logged in.  Raises FerrusError saying what is missing."""
    if not (git.fetch or git.push):
        return
    known = remote_names(root)
    wanted = []
    if git.fetch:
        wanted.append(target_upstream(root, target, git).remote)
    if git.push:
        wanted.append(git.push)
    for remote in wanted:
        if remote not in known:
            raise FerrusError("there is no git remote %s (the remotes are: %s)" % (
                remote, ", ".join(known) or "none"),
                "`git remote add %s URL`, or change [git] in %s" % (remote, CONFIG_FILE))
    if git.push:
        head = target_head(root, target)
        try:
            run_git(root, ["push", "--dry-run", "--no-verify", git.push,
                           "%s:refs/heads/%s" % (head, target)], timeout=REMOTE_TIMEOUT_SECS)
        except GitError as err:
            text = _git_said(err)
            # A refused update (behind, protected) still means we reached it and may push.
            if "[rejected]" not in text and "[remote rejected]" not in text:
                raise FerrusError("ferrus could not reach %s to push: %s" % (git.push, text),
                                  "check the network and your credentials (`git push "
                                  "--dry-run %s %s` shows what git needs), or set [git] "
                                  "push = \"\"" % (git.push, target)) from None
    if git.pr:
        require_pull_request_cli(root, git.pr)


# -- the parallel runner's part ------------------------------------------------------------

class TeamRemote:
    """[git] fetch, push and publish in the parallel runner (a part of ParallelRunner,
    as MergeQueue is): the target synced with its upstream before tasks are prepared
    and before each integration, a merge pushed, or a task's branch published with a
    pull request.  A push that fails stops the queue's integrations, saying why."""

    def _remote_config(self):
        return self.store.config().git

    def _check_remote(self):
        """P0, before any agent starts: what the remote needs is there (preflight_remote),
        and the target is brought up to its upstream.  Raises FerrusError."""
        git = self._remote_config()
        root = self.store.root
        preflight_remote(root, git, self.target)
        if not git.fetch:
            return
        sync = sync_with_upstream(root, self.target, target_upstream(root, self.target, git))
        if sync.status == "moved":
            self.note(sync.text, event="upstream", target=self.target, head=sync.head)
        elif sync.status == "blocked":
            self.note(sync.text + "; tasks start from %s as it is" % self.target, "warning",
                      event="upstream", target=self.target)
        elif sync.status == "ahead" and git.push and git.publish == "target":
            self.note("%s: the next merge pushes them to %s" % (sync.text, git.push))

    def _sync_before_prepare(self):
        """[git] fetch before tasks are prepared: they start from what the team has.  A
        fetch that fails is said, and they start from the target as it is."""
        git = self._remote_config()
        if not git.fetch or self.integration is not None:
            return                 # an integration running syncs the target itself
        root = self.store.root
        try:
            sync = sync_with_upstream(root, self.target, target_upstream(root, self.target,
                                                                         git))
        except UpstreamDiverged as err:
            self._stop_integrations(err.full_text(), "diverged")
            return
        except FerrusError as err:
            self.note("%s; the tasks start from %s as it is" % (err.message, self.target),
                      "warning", event="upstream", target=self.target)
            return
        self._take_sync(sync)
        if sync.status == "blocked":
            self.note(sync.text, "warning", event="upstream", target=self.target)

    def _take_sync(self, sync):
        """What a sync moved becomes what this run knows of the target."""
        if sync is None or sync.status != "moved":
            return
        if self.known_target in (None, sync.before):
            self.known_target = sync.head
        self.note(sync.text, event="upstream", target=self.target, head=sync.head)

    def _sync_for_integration(self, job, target):
        """[git] fetch before an integration (on its thread): the commit to build the
        task's work onto; a sync that moved the target is left in job["synced"] for the
        runner.  Raises UpstreamDiverged, or FerrusError when the integration must wait."""
        git = self._remote_config()
        if not git.fetch:
            return target
        root = self.store.root
        sync = sync_with_upstream(root, self.target, target_upstream(root, self.target, git))
        if sync.status == "blocked":
            raise FerrusError(sync.text, "the integration is tried again in a few seconds")
        job["synced"] = sync
        return sync.head

    def _stop_integrations(self, what, event, **facts):
        """The queue merges nothing more in this run: it stops, saying why; every task
        stays where it is for the next run (as when the target moved outside it)."""
        if self.halted:
            return
        self.halted = what
        self.note("stopped: %s\nNothing more is merged in this run; every task stays where "
                  "it is, and `ferrus run --parallel` goes on with them once this is "
                  "fixed." % what, "error", event=event, target=self.target, **facts)
        self.finished = True

    def _push_merged(self, task, head):
        """[git] push after task ``task`` merged at ``head`` (publish = "target")."""
        git = self._remote_config()
        if not git.push or git.publish != "target" or head is None:
            return
        pushed = push_commit(self.store.root, git.push, head, self.target)
        update_task(self.store, ORCHESTRATOR, task, "task_pushed" if pushed.status ==
                    "pushed" else "push_" + pushed.status, {"push": {
                        "remote": git.push, "status": pushed.status,
                        "reason": "" if pushed.status == "pushed" else pushed.text[:2000]}},
                    remote=git.push, commit=head[:12])
        if pushed.status == "pushed":
            self.note("task %s: %s" % (short_task_id(task), pushed.text), event="pushed",
                      task_id=task, remote=git.push, commit=head)
            return
        self._stop_integrations(
            "%s\n%s holds the merge of task %s at %s here, and %s does not: %s" % (
                pushed.text, self.target, short_task_id(task), head[:12], git.push,
                push_refused_hint(pushed.text, git.push, self.target)),
            "push_" + pushed.status, task_id=task, remote=git.push)

    def _publishing(self):
        return self._remote_config().publish == "branch"

    def _publish(self, task, candidate, onto):
        """[git] publish = "branch": the checked candidate pushed as the task's own branch
        (the target does not move), the task Complete and published, and with [git] pr a
        pull request opened — unless the task was cancelled first."""
        git = self._remote_config()
        branch = published_branch(task)
        outcome = {}

        def push():
            outcome["push"] = push_commit(self.store.root, git.push, candidate, branch)
            return candidate if outcome["push"].status == "pushed" else None
        won, _ = merge_unless_cancelled(self.store, task, push, ORCHESTRATOR,
                                        target=self.target, published=branch)
        if won == CANCELLED_STATUS:
            self.note("task %s was cancelled before it was published: nothing was pushed" %
                      short_task_id(task), "warning", task_id=task)
            self._end_task(task, CANCELLED_STATUS, None)
            return
        if won is None:
            self._stop_integrations(outcome["push"].text, "push_" + outcome["push"].status,
                                    task_id=task, remote=git.push)
            return
        self._end_published(task, branch, candidate, onto)

    def _end_published(self, task, branch, candidate, onto=None):
        """A published task's pull request (once) and its end."""
        git = self._remote_config()
        record = read_task_record(self.store.dir, task)
        published = dict(record.get("published") or {}, remote=git.push, branch=branch,
                         commit=candidate)
        if git.pr and "pull_request" not in published:
            title, body = pull_request_text(
                self.store, task, record, candidate, onto or (
                    record.get("integration") or {}).get("target_head") or candidate,
                self.target, self.store.config().checks.commands)
            try:
                published["pull_request"] = open_pull_request(
                    self.store.root, git.pr, self.target, branch, title, body)
            except FerrusError as err:
                published["pull_request"] = ""
                self.note("task %s: %s" % (short_task_id(task), err.full_text()), "warning",
                          task_id=task)
        update_task(self.store, ORCHESTRATOR, task, "task_published",
                    {"published": published}, remote=git.push, branch=branch,
                    commit=candidate[:12], pull_request=published.get("pull_request") or None)
        self.tasks_completed += 1
        self.waiting_said = None
        self._end_task(task, PUBLISHED_STATUS, None)
