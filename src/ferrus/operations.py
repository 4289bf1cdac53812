"""Operations: create, diff, review, approve, confirm, consult, specs.

One function per behaviour; the MCP tools, the CLI, HQ and the web board call these
and nothing else changes .ferrus/.  A refusal raises FerrusError; success returns an
Outcome whose text agents read and whose data is the structured form.  Here: creating
a task, its diff, review, approval and rejection, [git] commit, the human's
confirmation, consultations and specs; and the shape of an MCP tool (Param, Tool)."""

import contextlib
import dataclasses
import fnmatch
import itertools
import os
import threading

from .basics import (FerrusError, LazyPattern, compact_json, deferred_dataclass,
                     json_for_terminal, new_id, say, terminal_safe)
from .system import atomic_write, read_text
from .config import AgentsConfig, GitConfig
from .task_machine import (S, TaskState, t_approve, t_create_task, t_human_approve,
                           t_human_reject, t_reject)
from .store import APPROVAL_FILE, TASK_SCRATCH_FILES, read_task_record
from .git import (GitError, GitUnavailable, commit_task_changes, create_task_branch,
                  describe_base, diff_exclusions, display_path, record_task_base,
                  remove_task_branch, task_checkout, task_diff)
from .bootstrap import copied_paths
from .specs import (dependencies_met, first_ready_milestone, list_spec_paths,
                    mark_milestone_complete, next_ready_milestone, parse_spec, slugify,
                    spec_directory, spec_title, unmet_dependencies)


ROLES = ("supervisor", "executor")


@deferred_dataclass
class Caller:
    """Who is acting: an MCP server's agent identity, the human, or HQ."""

    role: str                      # supervisor | executor | agent | human | hq
    agent_id: str
    cancel: "threading.Event | None" = None
    progress: "object | None" = None   # callable(message) for long waits

    @property
    def is_agent(self):
        return self.role in ("supervisor", "executor", "agent")


HUMAN = Caller("human", "human")


@deferred_dataclass
class Outcome:
    """What an operation returns: text for people, data for programs."""

    text: str
    data: dict

    def print(self, as_json):
        """Print it on the CLI: its data as JSON for programs (`--json`), else its text."""
        if as_json:
            print(json_for_terminal(compact_json(self.data)))
        else:
            say(self.text)


def _outcome(text, state, **data):
    data.setdefault("message", text)
    data["state"] = state.value if isinstance(state, TaskState) else state
    return Outcome(text, data)


def _json_outcome(data):
    return Outcome(compact_json(data), data)


def _nonblank(value, message):
    if not isinstance(value, str) or not value.strip():
        raise FerrusError(message)
    return value


def _guard_lease(store, data, caller, action):
    """An agent may not act on a task whose live lease another agent holds."""
    if not caller.is_agent or data.claimed_by == caller.agent_id or not store.lease_live(data):
        return
    raise FerrusError(
        "Cannot %s: the task is leased to %s until %s." % (action, data.claimed_by, data.lease_until),
        "only the lease holder may %s; the lease frees itself when its holder stops "
        "calling /heartbeat for lease.ttl_secs" % action)


# -- supervisor ---------------------------------------------------------------

def _refuse_create_unless_idle(state):
    if state != S.IDLE:
        raise FerrusError(
            "Cannot create task: current state is %s. The executor must complete or reset "
            "the current task first." % state,
            "a human can run `ferrus reset` to return to Idle")


def _git_config(store):
    """[git], or its defaults when ferrus.toml does not load (the operations that need
    the rest of the file say why)."""
    try:
        return store.config().git
    except FerrusError:
        return GitConfig()


TASK_TITLE_CHARS = 72


def task_title(description):
    """A task's title: the first non-blank line of its description, shortened."""
    title = next((line.strip().lstrip("#").strip() for line in description.splitlines()
                  if line.strip().lstrip("#").strip()), "")
    return title[:TASK_TITLE_CHARS - 3].rstrip() + "..." if len(title) > TASK_TITLE_CHARS \
        else title


# How much of a text (a submission's summary, review notes) its journal entry carries:
# the content files hold only the last of each, and project memory reads them all here.
JOURNAL_TEXT_CHARS = 4000
# The entries whose ``text`` is such a text (`ferrus log` leaves it out of their line).
JOURNAL_TEXT_EVENTS = frozenset(("submit", "reject", "human_reject", "integration_failed",
                                 "approve"))


def journal_text(text):
    """``text`` as a journal entry carries it: at most JOURNAL_TEXT_CHARS characters."""
    text = (text or "").strip()
    return text if len(text) <= JOURNAL_TEXT_CHARS else text[:JOURNAL_TEXT_CHARS - 1] + "…"


def op_create_task(store, caller, description, origin=None, task_id=None):
    """Idle → Executing.  ``origin`` (spec path, milestone id) names the milestone the task
    implements; without it the origin HQ staged for the supervisor (pending_task_*) applies.
    With [git] branch set, the task's branch is created and checked out first (a parallel
    task has its worktree's branch instead).  ``task_id``: the queue's id for the task."""
    _nonblank(description, "Cannot create task: the description is empty.")
    # git runs before the lock is taken (it can take a moment in a big repository).
    base, warnings = record_task_base(task_git_site(store), task_diff_exclusions(store))
    git_config = _git_config(store)
    if store.task is not None:
        git_config = dataclasses.replace(git_config, branch="")
    branch = None
    if git_config.branch and not base.get("git"):
        warnings.append("[git] branch is set, but the task gets no branch: %s" % base["reason"])
    elif git_config.branch:
        # Refused here, before a branch exists, in the usual case; the transaction
        # below checks again and takes the branch back if it must refuse after all.
        _refuse_create_unless_idle(store.read_state().state)
        task_id = task_id or new_id("t")
        branch = git_config.branch_for(task_id)
        try:
            from_branch = create_task_branch(store.root, branch, base)
        except GitError as err:
            raise FerrusError("Cannot create task: [git] branch: %s." % err.message.rstrip("."),
                              err.hint) from err
        base = dict(base, branch=branch, task_branch=branch, from_branch=from_branch)
        # The task's branch is where HEAD is now, detached or not before.
        warnings = [w for w in warnings if not w.startswith("HEAD is detached")]
    if git_config.commit == "on_approve" and base.get("dirty_count"):
        warnings.append("with [git] commit = \"on_approve\", the files already changed stay "
                        "out of the task's commit (they are yours to commit)")
    try:
        with store.transaction(caller.agent_id) as tx:
            _refuse_create_unless_idle(tx.state.state)
            task_id = task_id or new_id("t")
            data = tx.state
            if origin is not None:
                data = data.copy()
                data.pending_task_spec, data.pending_task_milestone = origin
            new = t_create_task(data, store.clock(), task_id, base)
            detail = {"task_id": task_id, "title": task_title(description)}
            if base.get("git"):
                detail["base"] = (base["commit"] or "")[:12]
            if branch:
                detail["branch"] = branch
            if new.task_milestone:
                detail.update(spec=new.task_spec, milestone=new.task_milestone)
            tx.set(new, "create_task", **detail)
            tx.write("TASK.md", description)
            # Stale review, question and answer text must not leak into the new task
            # (see ARCHITECTURE.md, 'Differences from upstream ferrus', item 17).
            for name in TASK_SCRATCH_FILES + _approval_file_if_any(store):
                tx.write(name, "")
    except BaseException:
        if branch:
            remove_task_branch(store.root, branch, base.get("from_branch"), base.get("commit"))
        raise
    text = "Task created. State: Executing. The Executor can now call /wait_for_task."
    if branch:
        text += "\nThe task works on the new git branch %s (from %s)." % (
            branch, base["from_branch"] or "a detached HEAD at %s" % (base["commit"] or "")[:12])
    if warnings:
        text += "".join("\nwarning: %s" % warning for warning in warnings)
    return _outcome(text, S.EXECUTING, task_id=task_id, base=base, warnings=warnings,
                    branch=branch)


# -- the task's diff ------------------------------------------------------------------

# How much of the patch the review tools carry inline (ferrus://diff serves more).
REVIEW_DIFF_BYTES = 16 * 1024


def task_diff_exclusions(store):
    try:
        agents_path = store.config().agents.path
    except FerrusError:
        agents_path = AgentsConfig.path
    exclude = diff_exclusions(agents_path)
    if store.task is not None:
        # What [parallel] copy brought from the checkout is never the task's work.
        exclude += [path for path in copied_paths(read_task_record(store.dir, store.task))
                    if path not in exclude]
    return exclude


def task_git_site(store):
    """Where git works on the code of ``store``'s task: the user's checkout (a path) for
    the project's own task; for a parallel task, its worktree as ferrus made it (a
    TaskCheckout — TamperedWorktree when its .git was rewritten)."""
    if store.task is None:
        return store.workdir
    worktree = read_task_record(store.dir, store.task).get("worktree")
    if not isinstance(worktree, str) or not worktree:
        return store.workdir
    try:
        return task_checkout(store.root, worktree, cwd=store.workdir)
    except GitUnavailable:
        return store.workdir           # no repository at all: no diff, as without git


# The states in which a parallel task's diff is its recorded submission, not its worktree.
SUBMITTED_STATES = (S.REVIEWING, S.AWAITING_CONFIRMATION, S.INTEGRATING, S.COMPLETE)


def submission_under_review(store, data):
    """The recorded submission (see snapshot_worktree) ``data``'s diff is, or None: a
    parallel task's from its submit until it is sent back."""
    submitted = data.task_submitted
    if store.task is None or data.state not in SUBMITTED_STATES or not isinstance(
            submitted, dict) or not isinstance(submitted.get("commit"), str):
        return None
    return submitted


def op_diff(store, caller=None, stat_only=False, paths=None, head_bytes=192 * 1024,
            tail_bytes=32 * 1024, more_hint="Read one file's diff with ferrus://diff/<path> "
                                             "(or `ferrus diff PATH`)."):
    """The task's changes (base → working tree) as text and data.  Without git, or
    outside a repository, the outcome says why there is no diff (it is not an error)."""
    data = store.read_state()
    base = data.task_base
    submitted = submission_under_review(store, data)
    try:
        if submitted:
            base = dict(base or {}, git=True, commit=submitted.get("base"))
            diff = task_diff(store.root, base, task_diff_exclusions(store),
                             patch=not stat_only, paths=paths, head_bytes=head_bytes,
                             tail_bytes=tail_bytes, to=submitted["commit"])
        else:
            diff = task_diff(task_git_site(store), base, task_diff_exclusions(store),
                             patch=not stat_only, paths=paths, head_bytes=head_bytes,
                             tail_bytes=tail_bytes)
    except GitUnavailable as err:
        return _outcome("No diff: %s." % err.message.rstrip("."), data.state, available=False,
                        reason=err.message, hint=err.hint)
    title = "Task %s diff: %s → %s" % (data.task_id or "(none)", describe_base(
        diff.base) if diff.base else "HEAD", "submission %s (%s)" % (
            submitted.get("n", "?"), submitted["commit"][:12]) if submitted else "working tree")
    parts = [title]
    if submitted and submitted.get("guarded"):
        parts.append("warning: %s" % guarded_warning(submitted["guarded"]))
    parts += ["note: %s" % note for note in diff.notes]
    parts += ["", diff.stat_text()]
    if not stat_only and diff.files:
        parts += ["", diff.patch_text(more_hint).rstrip("\n")]
    added, deleted = diff.totals()
    return _outcome("\n".join(parts), data.state, available=True, task_id=data.task_id,
                    base=diff.base, notes=diff.notes,
                    submission=submitted["commit"] if submitted else None,
                    guarded=list(submitted.get("guarded") or []) if submitted else [],
                    files=[changed.to_json() for changed in diff.files],
                    insertions=added, deletions=deleted,
                    patch_bytes=diff.patch_bytes, patch_cut=list(diff.patch_cut or ()) or None)


# A word of the submission notes that names a file: dir/name.ext or name.ext.
_MENTIONED_FILE_RE = LazyPattern(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-][\w.-]*\.[A-Za-z0-9]{1,10})"
                                r"(?![\w/-])")


def unchanged_mentions(root, notes, changed_paths):
    """The project files the notes mention that the diff does not touch (only names of
    files that exist, so a URL or a version number is never taken for one)."""
    changed = set(changed_paths)
    found = []
    for name in _MENTIONED_FILE_RE.findall(notes or ""):
        name = name.rstrip(".")
        if name in changed or name in found or any(p.endswith("/" + name) for p in changed):
            continue
        if os.path.isfile(os.path.join(root, name)) and not os.path.isabs(name):
            found.append(name)
    return found


def review_diff(store, submission=""):
    """(text, changed files) for a review: the stat, the patch's first
    REVIEW_DIFF_BYTES and where to read the rest, plus a warning for files the
    submission names that the diff does not change.  Never fails: a git problem is
    reported in the text."""
    try:
        outcome = op_diff(store, head_bytes=REVIEW_DIFF_BYTES, tail_bytes=0,
                          more_hint="Read the rest with ferrus://diff, or one file's diff "
                                    "with ferrus://diff/<path>.")
    except FerrusError as err:
        return "No diff: %s" % err.full_text(), []
    text = outcome.text
    files = outcome.data.get("files") or []
    if outcome.data.get("available"):
        unchanged = unchanged_mentions(store.workdir, submission,
                                       [f["path"] for f in files] +
                                       [f["old_path"] for f in files if f.get("old_path")])
        if unchanged:
            text = ("warning: the submission notes name %s, which the diff does not change\n\n"
                    % ", ".join(unchanged)) + text
    return text, files


def op_review_pending(store, caller):
    data = store.read_state()
    if data.state != S.REVIEWING:
        raise FerrusError("No submission pending review. Current state: %s. Wait for the "
                          "Executor to call /submit." % data.state)
    return _outcome(_review_text(store, data), data.state)


def _review_text(store, data):
    limits = store.config().limits
    text = "## Task\n\n%s\n" % store.read_file("TASK.md")
    submission = store.read_file("SUBMISSION.md")
    if submission.strip():
        text += "\n## Submission Notes\n\n%s" % submission
    text += "\n## Changes\n\n%s\n" % review_diff(store, submission)[0]
    review = store.read_file("REVIEW.md")
    if review.strip():
        text += "\n## Previous Review Notes\n\n%s" % review
    text += "\n---\nReview cycles used: %d/%d  \nCheck retries used: %d/%d" % (
        data.review_cycles, limits.max_review_cycles, data.check_retries, limits.max_check_retries)
    return text


def _approval_file_if_any(store):
    return (APPROVAL_FILE,) if os.path.exists(store.task_path(APPROVAL_FILE)) else ()


def _refuse_agent_on_confirmation(data, action):
    """The reviewer's approve or reject once its approval waits for the human."""
    if data.state == S.AWAITING_CONFIRMATION:
        raise FerrusError(
            "Cannot %s: the submission is already approved and waits for a human's "
            "confirmation (state AwaitingConfirmation). Only the human can approve or reject "
            "it now; stop here." % action,
            "the human runs `ferrus approve` or `ferrus reject NOTES` (or /approve, /reject in "
            "HQ)")


def _complete_task(store, tx, data, new):
    """What reaching Complete does besides the state: tick the task's spec milestone and
    move the selection on.  Returns the journal detail."""
    detail = {}
    # The milestone tick is a content file written before STATE.json, and it
    # is idempotent, so a failed commit can simply be approved again.  A parallel task's
    # tick is made by the merge gate, in the commit that merges its work
    # (ParallelRunner._milestone_tick): its worktree is the executor's, not ferrus's.
    if data.task_spec and data.task_milestone and store.task is None:
        path = os.path.join(store.root, data.task_spec)
        if os.path.isfile(path):
            text = read_text(path)
            milestones = parse_spec(text)
            match = next((m for m in milestones if m.id == data.task_milestone), None)
            if match is not None:
                if not match.completed:
                    tx.write(path, mark_milestone_complete(text, match))
                    match.completed = True
                    detail["milestone_completed"] = match.id
                if (data.selected_spec == data.task_spec
                        and data.selected_milestone == data.task_milestone):
                    following = next_ready_milestone(milestones, match.id)
                    new.selected_milestone = following.id if following else None
                    detail["selected_milestone"] = new.selected_milestone
    return detail


# -- [git] commit = "on_approve" ------------------------------------------------------------

# How much of the submission notes a commit message carries.
COMMIT_BODY_CHARS = 4000


# The longest commit subject line; a longer title is wrapped into the body.
COMMIT_SUBJECT_CHARS = 72


def fold_commit_messages(messages):
    """One message for a commit that also holds the commits of ``messages[:-1]`` (each
    red in the gate on its own): the last message, with the others' bodies before its
    trailer."""
    last = messages[-1]
    if len(messages) == 1:
        return last
    text, trailer = last, ""
    at = last.rfind("\n\nFerrus-Task:")
    if at >= 0:
        text, trailer = last[:at], last[at:]
    earlier = []
    for message in messages[:-1]:
        body = message.partition("\n\n")[2]
        body = body[:body.rfind("Ferrus-Task:")] if "Ferrus-Task:" in body else body
        earlier.append("%s\n%s" % (message.partition("\n")[0], body.strip()))
    return "%s\n\nAlso holds the earlier submission%s, whose commit alone failed the "\
        "checks:\n\n%s%s" % (text.rstrip(), "" if len(earlier) == 1 else "s",
                              "\n\n".join(earlier), trailer or "\n")


def task_commit_message(task_id, description, submissions, part=None):
    """The commit message of a task: its title (the description's first line), the
    summary of each submission (``submissions``: one text, or a list in order), and a
    ``Ferrus-Task`` trailer; ``part`` (k, n) numbers one of a linear history's commits.
    A title longer than a subject line is cut at a word and given whole in the body —
    never shortened with "...".  Controls (an ESC or a BEL in a title an agent or a
    queue wrote) are shown in caret notation, never stored raw in the history where
    `git log` would print them to a terminal."""
    if isinstance(submissions, str):
        submissions = [submissions]
    clean = [terminal_safe(text.replace("\r\n", "\n").replace("\r", "\n")).strip()
             for text in [description] + list(submissions)]
    description, summaries = clean[0], [text for text in clean[1:] if text]
    title = next((line.strip().lstrip("#").strip() for line in description.splitlines()
                  if line.strip().lstrip("#").strip()), "") or "ferrus task %s" % task_id
    suffix = " (%d/%d)" % part if part else ""
    room = COMMIT_SUBJECT_CHARS - len(suffix)
    body = []
    if len(title) > room:
        cut = title.rfind(" ", 0, room + 1)
        subject = title[:cut if cut > room // 2 else room].rstrip()
        body.append(title)
    else:
        subject = title
    for index, summary in enumerate(summaries):
        if len(summary) > COMMIT_BODY_CHARS:
            summary = summary[:COMMIT_BODY_CHARS].rstrip() + "\n[...]"
        body.append("Submission %d:\n%s" % (index + 1, summary) if len(summaries) > 1
                    else summary)
    return "%s%s\n\n%s%sFerrus-Task: %s\n" % (subject, suffix, "\n\n".join(body),
                                              "\n\n" if body else "", task_id)


def commit_on_approve(store, data):
    """The task_commit record of [git] commit = "on_approve" for the task ``data`` is
    about to complete: the commit made, or why there is none.  Never raises: a failed
    commit must not stop the approval (the changes stay in the work tree)."""
    message = task_commit_message(data.task_id or "", store.read_file("TASK.md"),
                                  store.read_file("SUBMISSION.md"))
    try:
        return commit_task_changes(store.workdir, data.task_base, task_diff_exclusions(store),
                                   message)
    except GitUnavailable as err:
        return {"commit": None, "reason": err.message}
    except FerrusError as err:
        return {"commit": None, "error": err.message, "hint": err.hint}


def _commit_before_complete(store, caller, data, action, git_config):
    """Commit the task's changes while it is still one step from Complete (outside the
    lock: hooks may take minutes).  None when [git] commit is off."""
    if git_config.commit != "on_approve":
        return None
    _guard_lease(store, data, caller, action)
    return commit_on_approve(store, data)


def _record_commit(new, data, commit, detail):
    """Put the commit record on the Complete state and in the journal detail."""
    if commit is None or new.task_id != data.task_id:
        return
    new.task_commit = commit
    if commit.get("commit"):
        detail.update(commit=commit["commit"][:12], branch=commit["branch"],
                      committed_files=commit["files"])
    elif commit.get("error"):
        detail["commit_failed"] = commit["error"]
    else:
        detail["not_committed"] = commit.get("reason")


def describe_task_commit(commit):
    """One line (with its hint) on what [git] commit did for a task, or None."""
    if not commit:
        return None
    if commit.get("commit"):
        line = "Committed the task's changes as %s on branch %s (%d file%s)." % (
            commit["commit"][:12], commit.get("branch"), commit.get("files", 0),
            "" if commit.get("files") == 1 else "s")
        if commit.get("left_out"):
            line += " Left uncommitted, as they were changed before the task began: %s." % (
                ", ".join(commit["left_out"]))
        return line
    if commit.get("error"):
        return "The task's changes were NOT committed (they are still in the work tree): " \
            "%s.%s" % (commit["error"].rstrip("."), "\nhint: %s" % commit["hint"]
                       if commit.get("hint") else "")
    return "Nothing was committed: %s." % (commit.get("reason") or "").rstrip(".")


def op_approve(store, caller, notes=None):
    """Reviewing → Complete, or → AwaitingConfirmation when [hq] human_review is on (then
    ``notes``, the reviewer's verdict in words, wait in APPROVAL.md for the human).  With
    [git] commit = "on_approve" the task's changes are committed on the way to Complete."""
    if notes is not None and not isinstance(notes, str):
        raise FerrusError("Cannot approve: notes must be text.")
    config = store.config()
    guarded = (store.read_state().task_submitted or {}).get("guarded") if store.task else None
    human_review = config.human_review or bool(guarded)
    commit = None
    if not human_review and store.task is None:
        before = store.read_state()
        if before.state == S.REVIEWING:
            commit = _commit_before_complete(store, caller, before, "approve", config.git)
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        _refuse_agent_on_confirmation(data, "approve")
        if data.state != S.REVIEWING:
            raise FerrusError("Cannot approve from state %s. Call /review_pending first." % data.state)
        _guard_lease(store, data, caller, "approve")
        new = t_approve(data, store.clock(), human_review, integrate=store.task is not None)
        if notes and notes.strip():
            tx.write(APPROVAL_FILE, notes)
        elif human_review:
            # No notes this time: the human must not read an earlier cycle's.
            for name in _approval_file_if_any(store):
                tx.write(name, "")
        if new.state == S.COMPLETE:
            detail = _complete_task(store, tx, data, new)
            _record_commit(new, data, commit, detail)
            tx.set(new, "approve", **detail)
        elif new.state == S.INTEGRATING:
            tx.set(new, "approve", awaiting="integration",
                   **_complete_task(store, tx, data, new))
        else:
            tx.set(new, "approve", awaiting="human")
        if notes and notes.strip():
            tx.detail["text"] = journal_text(notes)
    if new.state == S.INTEGRATING:
        return _outcome("Task approved. State: Integrating — ferrus merges it into the target "
                        "branch once the checks pass on the merged result. Your review is "
                        "done; stop here.", new.state)
    if new.state == S.AWAITING_CONFIRMATION:
        return _outcome("Approval recorded. State: AwaitingConfirmation — a human confirms or "
                        "rejects it now (%s). Your review is done; stop here." % (
                            "[hq] human_review is on" if config.human_review else
                            guarded_warning(guarded)), new.state)
    text = "Task approved. State: Complete. Well done!"
    if new.task_commit:
        text += "\n" + describe_task_commit(new.task_commit)
    return _outcome(text, S.COMPLETE, git_commit=new.task_commit)


def op_reject(store, caller, notes):
    _nonblank(notes, "Cannot reject: the review notes are empty. Say what must change.")
    limits = store.config().limits
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        _refuse_agent_on_confirmation(data, "reject")
        if data.state != S.REVIEWING:
            raise FerrusError("Cannot reject from state %s. Call /review_pending first." % data.state)
        _guard_lease(store, data, caller, "reject")
        new = t_reject(data, store.clock(), limits.max_review_cycles)
        tx.write("REVIEW.md", notes)
        tx.set(new, "reject", review_cycles=new.review_cycles, text=journal_text(notes))
    if new.state == S.FAILED:
        text = ("Review cycle limit reached (%d/%d).\n\nState is now Failed. A human must call "
                "/reset to recover." % (new.review_cycles, limits.max_review_cycles))
    else:
        text = ("Submission rejected (cycle %d/%d).\n\n**Review notes written.** State: "
                "Addressing. The Executor should call /wait_for_task to see the notes and /check "
                "after addressing them." % (new.review_cycles, limits.max_review_cycles))
    return _outcome(text, new.state, review_cycles=new.review_cycles)


# -- the human's confirmation ([hq] human_review) -----------------------------------------

def human_name():
    """Who the human at this terminal is, as the journal records a confirmation."""
    import getpass
    try:
        return getpass.getuser()
    except (OSError, KeyError, ImportError):     # no login name anywhere (containers)
        return "unknown"


def _require_human(caller, action):
    if caller.is_agent:
        raise FerrusError(
            "Cannot %s on a human's behalf: only the human confirms or rejects a task the "
            "reviewer approved (this caller is %s)." % (action, caller.agent_id),
            "a human runs `ferrus %s` in a shell of their own, or /%s in HQ"
            % (action, action))


def _nothing_to_confirm(data, action):
    hint = {S.REVIEWING: "the reviewer has not decided yet ([hq] human_review = true makes "
                         "its approval wait for you)",
            S.COMPLETE: "the task is already Complete",
            S.IDLE: "there is no task"}.get(data.state, "`ferrus status` shows where it stands")
    return FerrusError("Cannot %s: no approval waits for your confirmation (state %s)."
                       % (action, data.state), hint)


def op_human_approve(store, caller, via="cli"):
    """AwaitingConfirmation → Complete, by the human only."""
    _require_human(caller, "approve")
    before = store.read_state()
    commit = None
    if before.state == S.AWAITING_CONFIRMATION and store.task is None:
        commit = _commit_before_complete(store, caller, before, "approve", _git_config(store))
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state != S.AWAITING_CONFIRMATION:
            raise _nothing_to_confirm(data, "approve")
        new = t_human_approve(data, store.clock(), integrate=store.task is not None)
        detail = _complete_task(store, tx, data, new)
        _record_commit(new, data, commit, detail)
        tx.set(new, "human_approve", by=human_name(), via=via, **detail)
    if new.state == S.INTEGRATING:
        return _outcome("Approved. State: Integrating — it is merged once the checks pass on "
                        "the merged result.", new.state, **detail)
    text = "Approved. State: Complete."
    if detail.get("milestone_completed"):
        text += " Milestone %s of %s is ticked." % (detail["milestone_completed"], data.task_spec)
    if new.task_commit:
        text += "\n" + describe_task_commit(new.task_commit)
    return _outcome(text, S.COMPLETE, git_commit=new.task_commit, **detail)


def op_human_reject(store, caller, notes, via="cli"):
    """AwaitingConfirmation → Addressing (or Failed at max_review_cycles), by the human
    only: the notes become the review notes the executor reads, and the cycle counts."""
    _require_human(caller, "reject")
    _nonblank(notes, "Cannot reject: the notes are empty. Say what must change.")
    limits = store.config().limits
    with store.transaction(caller.agent_id) as tx:
        data = tx.state
        if data.state != S.AWAITING_CONFIRMATION:
            raise _nothing_to_confirm(data, "reject")
        new = t_human_reject(data, store.clock(), limits.max_review_cycles)
        tx.write("REVIEW.md", notes)
        tx.set(new, "human_reject", by=human_name(), via=via, review_cycles=new.review_cycles,
               text=journal_text(notes))
    if new.state == S.FAILED:
        text = ("Rejected; the review cycle limit is reached (%d/%d), so the task is now "
                "Failed. `ferrus reset` clears it." % (new.review_cycles,
                                                      limits.max_review_cycles))
    else:
        text = ("Rejected (cycle %d/%d). State: Addressing; the executor gets your notes as "
                "review notes." % (new.review_cycles, limits.max_review_cycles))
    return _outcome(text, new.state, review_cycles=new.review_cycles)


def _excerpt(text, max_lines):
    lines = text.strip().splitlines()
    if len(lines) <= max_lines:
        return "\n".join(lines)
    return "\n".join(lines[:max_lines] + ["… (%d more lines)" % (len(lines) - max_lines)])


# How far back the reviewer's approve entry is looked for (a waiting task writes little).
_APPROVER_SCAN = 2000


def confirmation_summary(store, data=None):
    """What the human sees before confirming: the task, the submission, the reviewer's
    verdict and notes, the diff stat, and how to answer.  Every part but the stat is
    data an agent wrote."""
    data = data or store.read_state()
    approver = None
    for entry in itertools.islice(store.journal_entries_backwards(), _APPROVER_SCAN):
        if entry.get("event") == "approve" and entry.get("task_id") == data.task_id:
            approver = entry.get("actor")
            break
    limits = None
    with contextlib.suppress(FerrusError):
        limits = store.config().limits
    notes = store.read_file(APPROVAL_FILE).strip()
    parts = [
        "The reviewer approved task %s; it waits for your confirmation." % (data.task_id or "-"),
        "## Task\n" + (_excerpt(store.read_file("TASK.md"), 12) or "(TASK.md is empty)"),
        "## Submission\n" + (_excerpt(store.read_file("SUBMISSION.md"), 30)
                             or "(no submission notes)"),
        "## Reviewer's verdict\napproved by %s\n%s" % (
            approver.partition("/")[0] if approver else "the reviewer",
            _excerpt(notes, 30) if notes else "(no notes given)"),
    ]
    try:
        changes = op_diff(store, stat_only=True).text
    except FerrusError as err:          # a git failure must not hide the rest
        changes = "No diff: %s" % err.message
    parts.append("## Changes\n" + _excerpt(changes, 40))
    earlier = store.read_file("REVIEW.md").strip()
    if earlier and data.review_cycles:
        parts.append("## The last rejection's notes (what this round had to address)\n"
                     + _excerpt(earlier, 20))
    cycles = "review cycles used %d" % data.review_cycles
    if limits:
        cycles += "/%d" % limits.max_review_cycles
        if data.review_cycles + 1 >= limits.max_review_cycles:
            cycles += " — a rejection now fails the task"
    # A parallel task is named: with several waiting, a plain `ferrus approve` refuses.
    named = " --task %s" % short_task_id(store.task) if store.task else ""
    parts.append("Approve: `ferrus approve%s` or /approve in HQ.  Reject: `ferrus reject%s "
                 "NOTES` or /reject NOTES in HQ: the executor gets your notes (%s)."
                 % (named, named, cycles))
    return "\n\n".join(parts)


def op_respond_consult(store, caller, response):
    _nonblank(response, "Consultation response cannot be empty.")
    with store.transaction(caller.agent_id) as tx:
        if tx.state.state != S.CONSULTATION:
            raise FerrusError("Cannot respond to consultation from state %s. /respond_consult is "
                              "only valid in Consultation state." % tx.state.state)
        tx.write("CONSULT_RESPONSE.md", response)
        # The entry carries the answer's first lines: the waiting executor empties the
        # file at once (finish_consult), often before HQ or `ferrus run` reads it.
        lines = [line.rstrip()[:160] for line in response.splitlines() if line.strip()]
        tx.set(tx.state, "respond_consult", said=lines[:8] + (
            ["… (%d more lines)" % (len(lines) - 8)] if len(lines) > 8 else []))
    return _outcome("Consultation response recorded in `.ferrus/CONSULT_RESPONSE.md`.",
                    S.CONSULTATION)


def op_create_spec(store, caller, markdown):
    _nonblank(markdown, "Cannot create spec: markdown content is empty.")
    config = store.config()
    try:
        directory = spec_directory(store.root, config)
    except FerrusError as err:
        raise FerrusError("Cannot create spec: " + err.message, err.hint) from err
    os.makedirs(directory, exist_ok=True)
    stem = "%s-%s" % (store.clock().strftime("%Y-%m-%d"), slugify(spec_title(markdown)))
    text = markdown if markdown.endswith("\n") else markdown + "\n"
    # Claim a unique name with exclusive create, then fill it atomically.
    for number in range(1, 10000):
        name = "%s.md" % stem if number == 1 else "%s-%d.md" % (stem, number)
        path = os.path.join(directory, name)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            break
        except FileExistsError:
            continue
    else:
        raise FerrusError("Cannot create spec: %s already holds 9999 specs named %s-*.md"
                          % (directory, stem), "rename or archive some of them")
    try:
        atomic_write(path, text)
    except BaseException:
        # Never leave the empty placeholder behind a failed write.
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    rel = os.path.relpath(path, store.root).replace(os.sep, "/")
    milestone = first_ready_milestone(parse_spec(text))
    with store.transaction(caller.agent_id) as tx:
        data = tx.state.copy()
        tx.write("LAST_SPEC_PATH", rel)
        # Changing the selection under a running task would retarget it (see
        # ARCHITECTURE.md, 'Differences from upstream ferrus', item 16), so mid-task
        # the spec is saved but not selected.
        selectable = data.state in (S.IDLE, S.COMPLETE, S.FAILED)
        if selectable:
            data.selected_spec = rel
            data.selected_milestone = milestone.id if milestone else None
        tx.set(data, "create_spec", path=rel, selected=selectable)
    if not selectable:
        text = ("Spec created at %s. It was not selected because a task is in progress (state %s); "
                "select it with /milestones when the task ends." % (rel, data.state))
    elif milestone:
        text = "Spec created at %s. Selected milestone: %s." % (rel, milestone.id)
    else:
        text = "Spec created at %s. No incomplete milestone selected." % rel
    return _outcome(text, data.state, path=rel,
                    selected_milestone=milestone.id if milestone and selectable else None)


def op_select_milestone(store, caller, spec_path, milestone_id=None):
    """Select a spec and one of its milestones (the first ready one by default)."""
    full = os.path.join(store.root, spec_path)
    if not os.path.isfile(full):
        raise FerrusError("spec %s does not exist" % spec_path)
    milestones = parse_spec(read_text(full))
    if milestone_id is None:
        chosen = first_ready_milestone(milestones)
    else:
        chosen = next((m for m in milestones if m.id == milestone_id), None)
        if chosen is None:
            raise FerrusError("milestone %s is not in %s" % (milestone_id, spec_path),
                              "ids: " + ", ".join(m.id for m in milestones))
    rel = os.path.relpath(full, store.root).replace(os.sep, "/")
    with store.transaction(caller.agent_id) as tx:
        data = tx.state.copy()
        data.selected_spec = rel
        data.selected_milestone = chosen.id if chosen else None
        tx.set(data, "select_milestone", spec=rel, milestone=data.selected_milestone)
    return _outcome("Selected %s, milestone %s." % (rel, data.selected_milestone or "(none left)"),
                    data.state)


def op_stage_task_origin(store, caller, spec_path=None, milestone_id=None):
    """Record which milestone the next create_task implements (HQ's /task, before the
    supervisor defines it), or forget it (both None)."""
    with store.transaction(caller.agent_id) as tx:
        data = tx.state.copy()
        if (data.pending_task_spec, data.pending_task_milestone) == (spec_path, milestone_id):
            return
        data.pending_task_spec, data.pending_task_milestone = spec_path, milestone_id
        tx.set(data, "stage_task_origin", spec=spec_path, milestone=milestone_id)


def find_milestone(store, wanted):
    """(spec path, spec text, milestone) for ``ferrus run --milestone``.

    ``wanted`` is a milestone id or marker, or "next": the selected milestone when it is
    still open, else the first ready one of the selected spec (or of the only spec).
    Returns None for "next" when every milestone is done; raises when nothing fits."""
    data = store.read_state()
    config = store.config()
    specs = list_spec_paths(store.root, config)
    if data.selected_spec:
        if not os.path.isfile(os.path.join(store.root, data.selected_spec)):
            raise FerrusError("the selected spec %s does not exist" % data.selected_spec,
                              "select another with /milestones in HQ")
        candidates = [data.selected_spec] + ([p for p in specs if p != data.selected_spec]
                                             if wanted != "next" else [])
    elif wanted != "next" or len(specs) == 1:
        candidates = specs
    elif not specs:
        raise FerrusError("there is no spec in %s" % config.spec.directory,
                          "write one with /spec in HQ, or by hand from the template in "
                          ".ferrus/SPEC_TEMPLATE.md (its milestones are `- [ ] #1.0 …` lines "
                          "with `ID:` and `Depends on:`), then run again")
    else:
        raise FerrusError("no spec is selected and %s holds %d specs" % (
            config.spec.directory, len(specs)), "select one with /milestones in HQ")
    for path in candidates:
        text = read_text(os.path.join(store.root, path))
        milestones = parse_spec(text)
        if wanted == "next":
            chosen = None
            if path == data.selected_spec and data.selected_milestone:
                chosen = next((m for m in milestones if m.id == data.selected_milestone
                               and not m.completed and dependencies_met(m, milestones)), None)
            chosen = chosen or first_ready_milestone(milestones)
            if chosen is None:
                blocked = [m for m in milestones if not m.completed]
                if blocked:
                    raise FerrusError(
                        "no milestone of %s is ready: %s" % (path, "; ".join(
                            "%s waits for %s" % (m.marker, ", ".join(
                                unmet_dependencies(m, milestones))) for m in blocked)),
                        "fix the `Depends on:` lines of %s" % path)
                return None
        else:
            chosen = next((m for m in milestones if wanted in (m.id, m.marker)), None)
            if chosen is None:
                continue
            if chosen.completed:
                raise FerrusError("milestone %s of %s is already complete" % (wanted, path),
                                  "untick its box in the spec to do it again")
            waits = unmet_dependencies(chosen, milestones)
            if waits:
                raise FerrusError("milestone %s of %s depends on %s, not complete yet" % (
                    wanted, path, ", ".join(waits)), "run `ferrus run --milestone next`")
        return path, text, chosen
    raise FerrusError("no milestone %s in %s" % (wanted, ", ".join(candidates) or "any spec"),
                      "`ferrus run --milestone next` takes the next ready one")


def op_clear_selection(store, caller):
    with store.transaction(caller.agent_id) as tx:
        data = tx.state.copy()
        data.selected_spec = data.selected_milestone = None
        tx.set(data, "clear_selection")
    return _outcome("Spec selection cleared.", data.state)


# Files that instruct or configure agents, or that tools run by themselves (hooks, CI,
# direnv, an editor's tasks): a task changing one merges only once a human confirmed it,
# whatever [hq] human_review says — an agent must not be able to rewrite the next
# agents' instructions, or plant code that runs outside the check gate, unseen.
GUARDED_NAMES = ("CLAUDE.md", "CLAUDE.local.md", "AGENTS.md", "GEMINI.md", "QWEN.md",
                 ".cursorrules", ".windsurfrules", ".clinerules", "copilot-instructions.md",
                 ".mcp.json", ".envrc", ".gitattributes", ".gitmodules",
                 ".pre-commit-config.yaml")
GUARDED_FOLDERS = (".claude", ".codex", ".gemini", ".qwen", ".cursor", ".githooks", ".husky",
                   ".vscode", ".github/workflows")
GUARDED_SHOWN = 20


def guarded_paths(paths, extra_patterns=()):
    """Those of ``paths`` (project-relative, /-separated) that instruct or configure
    agents, or run by themselves (GUARDED_NAMES, GUARDED_FOLDERS, and the fnmatch
    patterns of [parallel] guarded)."""
    found = []
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        if (name in GUARDED_NAMES
                or any(path == folder or path.startswith(folder + "/")
                       for folder in GUARDED_FOLDERS)
                or any(fnmatch.fnmatchcase(path, pattern) for pattern in extra_patterns)):
            found.append(path)
    return found


def guarded_warning(paths):
    shown = ", ".join(map(display_path, paths[:GUARDED_SHOWN]))
    more = len(paths) - GUARDED_SHOWN
    return ("this submission changes files that instruct or configure agents, or that run "
            "by themselves (%s%s): a human must confirm it before it is merged"
            % (shown, " and %d more" % more if more > 0 else ""))


def short_task_id(task):
    """What the lines of a parallel run show for a task: the random end of its id."""
    return task.rsplit("-", 1)[-1] if task else ""
ORCHESTRATOR = Caller("hq", "ferrus")


# -- the shape of an MCP tool (mcp lists them; memory and graph define their own) ------------

@deferred_dataclass
class Param:
    """One parameter of an MCP tool, for its JSON input schema."""

    name: str
    type: str
    description: str
    required: bool = True


@deferred_dataclass
class Tool:
    """One MCP tool: its schema, the roles that get it, the operation it calls."""

    name: str
    title: str
    description: str
    roles: tuple
    run: object                     # callable(store, caller, **arguments) -> Outcome
    params: tuple = ()
    output: dict = dataclasses.field(default_factory=dict)
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False

    def input_schema(self):
        return {"type": "object",
                "properties": {p.name: {"type": p.type, "description": p.description}
                               for p in self.params},
                "required": [p.name for p in self.params if p.required]}

    def output_schema(self):
        properties = {}
        for name, kind in self.output.items():
            if kind.endswith("?"):
                properties[name] = {"type": [kind[:-1], "null"]}
            else:
                properties[name] = {"type": kind}
        return {"type": "object", "properties": properties}
