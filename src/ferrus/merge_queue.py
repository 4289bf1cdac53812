"""The merge queue: approved tasks built, checked and merged one by one.

Approved parallel tasks built, checked and merged one at a time."""

import contextlib
import dataclasses
import functools
import itertools
import os
import re
import threading

from .basics import FerrusError, log, new_id
from .system import atomic_write, read_text
from .config import CONFIG_FILE, PLACE_HERE
from .task_machine import S
from .store import (CANCELLED_STATUS, FAILED_STATUS, MERGED_STATUS, TASK_BRANCH_PREFIX,
                    TaskRecordDamaged, UNCHANGED_STATUS, read_task_record)
from .checks import describe_failed_check, failed_check_facts, run_checks
from .git import (GitError, SNAPSHOT_IDENTITY, TamperedWorktree, TaskCheckout,
                  commit_message, commit_parent, commit_tree, set_task_ref,
                  snapshot_worktree, task_ref, task_refs)
from .worktrees import (_tree_of, build_candidate, changed_paths, fast_forward_target,
                        foreign_commits, gate_checkout, markers_left, move_task_worktree,
                        rechain, reset_gate, target_head)
from .sandbox import TaskSandbox
from .bootstrap import copy_local_files, gate_port, port_environment, run_teardown
from .specs import mark_milestone_complete, parse_spec
from .operations import (ORCHESTRATOR, fold_commit_messages, short_task_id,
                         task_commit_message, task_diff_exclusions, task_git_site)
from .work import op_integrated, op_integration_failed
from .task_queue import TASK_EVENT_SCAN, merge_unless_cancelled, update_task
from .remote import UpstreamDiverged, resolve_commit, published_branch
from .sessions import first_lines


# How long an integration that waits (the target's checkout is dirty) waits between tries.
INTEGRATION_RETRY_SECS = 5.0
# How many of the commits that moved the target outside a run its halt message lists.
FOREIGN_COMMITS_SHOWN = 10


class MergeQueue:
    """P5 of the parallel runner: approved tasks merged one at a time, each built and
    checked in the gate's clean checkout, the target fast-forwarded only when green."""

    def integrating(self):
        """Tasks approved and waiting for the merge queue, the longest-waiting first
        (read again after each commit only: it is asked on every step)."""
        stamp = self.store.state_stamp()
        if self._integrating is None or self._integrating[0] != stamp or \
                self._integrating[1] != set(self.controllers):
            self._integrating = (stamp, set(self.controllers), self._read_integrating())
        return list(self._integrating[2])

    def _read_integrating(self):
        waiting = []
        for task, controller in self.controllers.items():
            with contextlib.suppress(FerrusError):
                data = controller.store.read_state()
                if data.state in (S.INTEGRATING, S.COMPLETE):
                    waiting.append((data.state_entered_at or "", task))
        return [task for _, task in sorted(waiting)]

    def _integrate(self):
        if self.integration is not None:
            if self.integration["thread"].is_alive():
                return
            # The next task in the queue starts now, not a step (eight polls) later, and
            # before the finished task's worktrees are removed: that removal then runs
            # beside the next integration's thread instead of ahead of it.
            held = self.held_cleanups = []
            try:
                self._finish_integration(self.integration)
                self.integration = None
                self._start_next_integration()
            finally:
                self.held_cleanups = None
                for cleanup in held:
                    cleanup()
            return
        self._start_next_integration()

    def _start_next_integration(self):
        if self.halted:
            return          # stopped (a moved target, a refused push): nothing more starts
        if self.retry_at is not None and self.clock() < self.retry_at:
            return
        self.retry_at = None
        waiting = self.integrating()
        if waiting:
            self._start_integration(waiting[0])
            return
        self.advance(1 if self.queued() or self.controllers else 6)

    def _start_integration(self, task):
        controller = self.controllers[task]
        task_store = controller.store
        data = task_store.read_state()
        if data.state == S.COMPLETE:          # integrated before a crash: only clean up
            self._merged(task, None)
            return
        record = read_task_record(self.store.dir, task)
        pending = record.get("integration") or {}
        head = target_head(self.store.root, self.target)
        if pending.get("candidate") and head == pending["candidate"]:
            # The target was fast-forwarded, and the run stopped before it said so.
            op_integrated(task_store, ORCHESTRATOR, commit=head[:12], target=self.target)
            self._merged(task, head)
            return
        if pending.get("candidate") and self._publishing() and resolve_commit(
                self.store.root, pending["candidate"]):
            # Checked, and its push may have been made before the run stopped: the same
            # commit is pushed again (nothing to send when it is there already).
            self._publish(task, pending["candidate"], pending.get("target_head") or head)
            return
        if self._moved_outside(head):
            return
        held = self.held_candidate
        if held is not None and held[0] == task and head == held[1].target_head:
            # Only the fast-forward waited (your checkout was in the way): the candidate
            # and its checks still hold, so try just that again.
            self._fast_forward(task, held[1])
            return
        self.held_candidate = None
        submitted = data.task_submitted if isinstance(data.task_submitted, dict) else {}
        if not isinstance(submitted.get("commit"), str) or not isinstance(
                submitted.get("base"), str):
            # Approved without a recorded submission (a task an older ferrus took to
            # review): what would merge was never fixed, so it is submitted again.
            self._send_back(task, "ferrus has no record of the submission your reviewer "
                            "approved, so it cannot tell what to merge. Check and submit "
                            "your work again.", cause="unrecorded")
            return
        job = {"task": task, "thread": None, "result": None, "error": None,
               "cancel": threading.Event()}
        work = functools.partial(self._integration_work, job, task, task_store, data,
                                 record, submitted, head)
        self.note("integrating task %s into %s (its submitted work onto %s's head, then the "
                  "checks in a clean checkout)" % (short_task_id(task), self.target,
                                                   self.target), event="integrating",
                  task_id=task, target=self.target)
        job["thread"] = threading.Thread(target=work, daemon=True,
                                         name="ferrus-integrate-%s" % short_task_id(task))
        job["thread"].start()
        self.integration = job

    def _integration_work(self, job, task, task_store, data, record, submitted, target):
        """The merge queue's git work and checks for one task, on a thread of its own:
        the task's submitted commit built onto the target in the gate's clean checkout
        (see build_candidate), checked there; a conflict or a red result moves the
        task's worktree to what the executor must fix.  Leaves job["result"] (what
        happened, the Integration, the check run) or job["error"]."""
        try:
            root = self.store.root
            if target is None:
                raise GitError("there is no branch %s to integrate into" % self.target,
                               "create it, or set [parallel] target to an existing branch")
            # [git] fetch: onto what the team has (remote.py).
            target = self._sync_for_integration(job, target)
            # The task's worktree as ferrus made it, or the task fails as tampered (its
            # submission, not its worktree, is what merges: a deleted folder stops nothing).
            checkout = task_git_site(task_store) if os.path.isdir(task_store.workdir) \
                else None
            conflicts = [p for p in record.get("conflicts") or [] if isinstance(p, str)]
            left = markers_left(root, submitted["commit"], conflicts)
            if left:
                job["result"] = ("markers", left, None)
                return
            gate = gate_checkout(root, self.worktree_dir, target)
            steps = self._integration_steps(task, task_store, data, submitted)
            built = build_candidate(gate, self.target, target, steps, self._history(),
                                    edit=self._milestone_tick(data, self._gate_project(gate)))
            if built.status == "conflict":
                self._move_worktree(task, checkout, submitted, built.head)
                job["result"] = ("conflict", built, None)
                return
            if built.status == "ready" and changed_paths(root, target, built.head,
                                                         [self._config_path()]):
                job["result"] = ("config", built, None)
                return
            checks = None
            if built.status == "ready":
                built, checks = self._check_candidate(gate, built, steps, job["cancel"])
            if checks is not None and not checks.passed:
                self._move_worktree(task, checkout, submitted, built.head)
            job["result"] = ("built", built, checks)
        except FerrusError as err:
            job["error"] = err
        except Exception as err:    # never lose the task: say what broke, and wait
            log.debug("integration of %s failed", task, exc_info=True)
            job["error"] = FerrusError("the integration of task %s failed: %s: %s" % (
                task, type(err).__name__, err), "run with FERRUS_DEBUG=1 for the traceback")

    def _history(self):
        return "merge" if self.parallel.integrate == "merge" else self.parallel.history

    def _config_path(self):
        """ferrus.toml relative to the repository's top (ferrus's own configuration: a
        task may not change the checks that judge it)."""
        return os.path.relpath(os.path.join(self.store.root, CONFIG_FILE),
                               self.repo.toplevel).replace(os.sep, "/")

    def _integration_steps(self, task, task_store, data, submitted):
        """[(commit, message)] for build_candidate: the approved submission (its message
        names every submission), or with linear history every submission on the same
        base, each a commit on the one before (their messages say what each was)."""
        root = self.store.root
        description = task_store.read_file("TASK.md")
        refs = task_refs(root, task)
        numbered = sorted((int(name[len("submit-"):]), commit) for name, commit in refs.items()
                          if re.fullmatch(r"submit-[0-9]+", name))
        upto = submitted.get("n") if isinstance(submitted.get("n"), int) else None
        same_base = [(n, commit) for n, commit in numbered
                     if (upto is None or n <= upto) and commit_parent(root, commit)
                     == submitted["base"]]
        if not same_base or same_base[-1][1] != submitted["commit"]:
            same_base = [(upto or 0, submitted["commit"])]
        messages = {}           # a commit's message never changes: asked of git once

        def message(commit):
            if commit not in messages:
                messages[commit] = commit_message(root, commit)
            return messages[commit]
        summaries = [message(commit) for _, commit in same_base]
        if self._history() != "linear" or len(same_base) == 1:
            # One commit holds the work of every submission, those made before the task
            # was brought up to date with the target too: its message names them all.
            every = [message(commit) for n, commit in numbered
                     if upto is None or n <= upto] or summaries
            return [(submitted["commit"], task_commit_message(task, description, every))]
        steps, parent = [], submitted["base"]
        for index, (n, commit) in enumerate(same_base):
            parent = commit_tree(root, _tree_of(root, commit), [parent], summaries[index],
                                 SNAPSHOT_IDENTITY)
            steps.append((parent, task_commit_message(
                task, description, [summaries[index]], part=(index + 1, len(same_base)))))
        return steps

    def _gate_project(self, gate):
        """The project's folder in the gate's checkout (a subfolder of the repository
        in a monorepo), where the checks and [parallel] setup run."""
        inside = os.path.relpath(self.store.root, self.repo.toplevel)
        return os.path.normpath(os.path.join(gate.work_tree, inside))

    def _milestone_tick(self, data, folder):
        """build_candidate's ``edit``: the task's spec milestone ticked in the candidate
        (the tick merges with the work it marks), or None."""
        if not (data.task_spec and data.task_milestone):
            return None

        def tick():
            path = os.path.join(folder, data.task_spec)
            if not os.path.isfile(path):
                return []
            text = read_text(path)
            match = next((m for m in parse_spec(text) if m.id == data.task_milestone), None)
            if match is None or match.completed:
                return []
            atomic_write(path, mark_milestone_complete(text, match), durable=False)
            return [path]
        return tick

    def _check_candidate(self, gate, built, steps, cancel):
        """(Integration, CheckRun) of the candidate's checks in the gate's clean checkout:
        each commit it adds is checked; with linear history a red one before the last is
        folded into the next (every commit the target gains is green).  The run is the
        last commit's (None without check commands)."""
        config = self.store.config()
        if not config.checks.commands:
            return built, None
        verdicts = []
        wrap = self._gate_sandbox(gate)
        port = gate_port(self.parallel)
        for index, commit in enumerate(built.commits):
            # build_candidate leaves the gate's checkout at a single squash or linear
            # commit exactly (HEAD, index and files; nothing untracked): no reset then.
            if index or len(built.commits) > 1 or self._history() == "merge":
                reset_gate(gate, commit)
            self._set_up_gate(gate, wrap)
            run = run_checks(self._gate_project(gate), config.checks, self.store.path("logs"),
                             0, config.limits.max_feedback_lines, cancel, self.store.root,
                             wrap=wrap, env=port_environment(port))
            torn = run_teardown(self.store, self._gate_project(gate), port,
                                "the merge gate's checkout")
            if torn:
                log.warning("%s", torn)
            verdicts.append(run)
            if run.cancelled or (not run.passed and self._history() != "linear"):
                return built, run
        last = verdicts[-1]
        red = [index for index, run in enumerate(verdicts[:-1]) if not run.passed]
        if last.passed and red and self._history() == "linear":
            kept, folded = [], []
            for index, commit in enumerate(built.commits):
                folded.append(steps[index][1])
                if index in red:
                    continue
                kept.append((_tree_of(gate, commit), fold_commit_messages(folded)))
                folded = []
            head = rechain(gate, built.target_head, kept)
            built = dataclasses.replace(built, head=head, commits=[head])
        return built, last

    def _set_up_gate(self, gate, wrap=None):
        """[parallel] copy and setup in the gate's checkout (it holds only the candidate's
        files, and the checkout's local files the tasks had)."""
        copy_local_files(self.store, self._gate_project(gate), self.worktree_dir)
        self._run_setup(self._gate_project(gate), "the merge gate's checkout %s"
                        % gate.work_tree, "fix the command (it runs in a clean checkout of "
                        "the candidate, which holds only what git tracks); the task waits and "
                        "is integrated again", wrap, gate_port(self.parallel))

    def _gate_sandbox(self, gate):
        """The wrap of the gate's commands when this machine's [sandbox] is on: they run
        the candidate's code, which is a task's (None when it is off)."""
        config = self.store.config().places[PLACE_HERE].sandbox
        if not config.enabled:
            return None
        return TaskSandbox(config, gate.work_tree, self.store.path("gate-sandbox"),
                           cwd=self._gate_project(gate), repository=self.store.root,
                           root=self.store.root).wrap

    def _move_worktree(self, task, checkout, submitted, commit):
        """Put the task's worktree at ``commit`` (what its executor must fix), after
        saving what it held if that is more than its last submission.  A worktree that
        is gone is made again from its branch when the task is taken up (see _adopt)."""
        if not isinstance(checkout, TaskCheckout):
            return
        record = read_task_record(self.store.dir, task)
        exclude = task_diff_exclusions(self.store.for_task(task))
        held = snapshot_worktree(checkout, submitted["base"], exclude,
                                 "ferrus: the worktree of task %s before the merge queue "
                                 "moved it" % task)
        if _tree_of(self.store.root, held) != _tree_of(self.store.root, submitted["commit"]):
            set_task_ref(self.store.root, task_ref(task, new_id("saved")), held)
        move_task_worktree(checkout, record.get("branch") or TASK_BRANCH_PREFIX + task, commit)

    def _finish_integration(self, job):
        task = job["task"]
        self._take_sync(job.pop("synced", None))
        controller = self.controllers.get(task)
        if controller is None:
            return
        error = job["error"]
        if isinstance(error, TaskRecordDamaged):
            raise error
        if isinstance(error, UpstreamDiverged):
            self._stop_integrations(error.full_text(), "diverged", task_id=task)
            return
        if isinstance(error, TamperedWorktree):
            self._end_task(task, FAILED_STATUS, "tampered: %s" % error.full_text())
            return
        if error is not None:
            # Not the executor's to fix (no git identity, a damaged repository): the task
            # waits, Integrating, and the run says what to do.
            self._wait(task, error.full_text())
            return
        what, built, checks = job["result"]
        if what == "markers":
            self._send_back(task, "git's conflict markers are still in %s. Edit each of "
                            "those files: keep both sides' intent and remove every marker "
                            "line (the lines of seven <, = or > signs), then check and "
                            "submit again." % ", ".join(built), cause="markers",
                            files=list(built))
            return
        if what == "config":
            self._send_back(task, "Your work changes %s, ferrus's own configuration (the "
                            "checks that judge your work, the agents): a task may not change "
                            "it. Undo that change (only the user edits it), then check and "
                            "submit again." % CONFIG_FILE, cause="config")
            return
        if what == "conflict":
            update_task(self.store, ORCHESTRATOR, task, "conflict_handed_over",
                        {"conflicts": built.conflicts, "conflict_base": built.target_head},
                        files=built.conflicts)
            self._send_back(task, "Your work conflicts with the target branch %s, which "
                            "moved on since your task started (other tasks were merged into "
                            "it). ferrus has brought your worktree up to date with it: the "
                            "files below now hold both sides of each conflict between git's "
                            "markers (a line of seven < signs, the target's side, a line of "
                            "seven = signs, your side, a line of seven > signs). "
                            "Edit them to keep both sides' intent and remove every marker "
                            "line; do not run git yourself. Then check and submit again.\n\n"
                            "Conflicted files: %s\n\n%s" % (
                                self.target, ", ".join(built.conflicts) or "(none left)",
                                built.text),
                            cause="conflict", files=list(built.conflicts),
                            onto=built.target_head)
            return
        if checks is not None and not checks.passed:
            self._send_back(task, "Your work applies to the target branch %s cleanly, but "
                            "the checks fail on the result in a clean checkout (your worktree "
                            "now holds that result: the target's latest work with yours on "
                            "top).\n\n%s" % (
                                self.target, checks.report(
                                    self.store.config().limits.max_feedback_lines)),
                            cause="checks", failed=[r.command for r in checks.failed],
                            onto=built.target_head, checks=checks)
            return
        if built.status == "empty":     # approved, but nothing the target lacks: no merge
            self._unchanged(task, built.target_head)
            return
        update_task(self.store, ORCHESTRATOR, task, "integration_ready", {
            "integration": {"candidate": built.head, "target_head": built.target_head}},
            candidate=(built.head or "")[:12])
        if self._publishing():
            self._publish(task, built.head, built.target_head)
        else:
            self._fast_forward(task, built)

    def _fast_forward(self, task, built):
        """Move the target to the checked candidate — unless the task was cancelled
        meanwhile (merge_unless_cancelled decides which came first) — or hold it while
        something of the user's is in the way."""
        outcome = {}

        def move():
            outcome["moved"] = fast_forward_target(self.store.root, self.target,
                                                   built.target_head, built.head)
            return built.head if outcome["moved"].status == "done" else None
        self.held_candidate = None
        won, head = merge_unless_cancelled(self.store, task, move, ORCHESTRATOR,
                                           target=self.target)
        if won == CANCELLED_STATUS:
            self.note("task %s was cancelled before its merge: %s was not moved for it" % (
                short_task_id(task), self.target), "warning", task_id=task)
            self._end_task(task, CANCELLED_STATUS, None)
            return
        moved = outcome["moved"]
        if won == MERGED_STATUS:
            self._merged(task, head)
        elif moved.status == "moved":
            self._moved_outside(moved.head)
        else:
            self.held_candidate = (task, built)
            self._wait(task, moved.text + (" (commit or stash them; ferrus never overwrites "
                                           "your work)" if moved.files else ""))

    def _wait(self, task, why):
        """The integration of ``task`` cannot go on now: say why (once) and try again in
        INTEGRATION_RETRY_SECS."""
        if why != self.waiting_said:
            self.waiting_said = why
            self.note("task %s is ready to merge, and waits: %s" % (short_task_id(task), why),
                      "warning", task_id=task)
        self.retry_at = self.clock() + INTEGRATION_RETRY_SECS

    def _send_back(self, task, notes, onto=None, checks=None, **detail):
        """``onto``: the target head the task's branch now sits on (None when the branch
        did not move); ``checks``: the merge gate's CheckRun when it was red, whose failing
        commands are shown with their last lines and logs."""
        task_store = self.controllers[task].store
        outcome = op_integration_failed(task_store, ORCHESTRATOR, notes, onto, **detail)
        cause, files = detail.get("cause"), [str(f) for f in detail.get("files") or []]
        failed = [failed_check_facts(result) for result in checks.failed] \
            if checks is not None else []
        why = {"conflict": "it conflicts with %s in %s" % (
                   self.target, ", ".join(files) or "files git named no more"),
               "checks": "the checks fail on its work merged with %s" % self.target,
               "markers": "git's conflict markers are still in %s" % ", ".join(files),
               "config": "its work changes %s" % CONFIG_FILE,
               "refused": first_lines(notes, 1, 300)[0] if notes.strip() else
               "its integration was refused"}.get(cause, "its integration failed")
        lines = ["task %s goes back to its executor: %s" % (short_task_id(task), why)]
        lines += [describe_failed_check(fact) for fact in failed]
        facts = {"task_id": task, "state": outcome.data["state"], "cause": cause,
                 "reason": why, "target": self.target}
        if cause == "conflict":
            self.note("\n".join(lines), "warning", event="conflict", files=files, **facts)
        else:
            self.note("\n".join(lines), "warning", event="sent_back", failed=failed,
                      files=files, **facts)

    def _moved_outside(self, head):
        """Whether the target has commits this run did not put there (since its base
        check, or its last merge): then the run stops, naming them.  What lands on the
        target must have passed the gate, and a task's checks or hooks (unconfined unless
        a sandbox place is set) could have moved the branch as well as its user."""
        known = self.known_target
        if known is None or head == known:
            return False
        commits = foreign_commits(self.store.root, known, head)
        listed = "\n".join("  " + line for line in commits[:FOREIGN_COMMITS_SHOWN])
        if len(commits) > FOREIGN_COMMITS_SHOWN:
            listed += "\n  ... and %d more" % (len(commits) - FOREIGN_COMMITS_SHOWN)
        if head is None:
            what = "%s was deleted" % self.target
        else:
            what = "%s moved from %s to %s outside this run%s" % (
                self.target, known[:12], head[:12],
                ":\n" + listed if listed else " (it is no descendant of where it was)")
        self.halted = what
        self.note("stopped: %s\nferrus merges only work its gate has checked, and it did not "
                  "check these. Look at them (a task's checks or hooks run unconfined unless "
                  "a sandbox place is set, and can move branches); when they are right, "
                  "`ferrus run --parallel` tries the checks on the new head and goes on with "
                  "every task where it stopped." % what, "error", event="target_moved",
                  target=self.target, head=head, known=known)
        self.finished = True
        return True

    def _merged(self, task, head):
        if head is not None:
            self.known_target = head
        if head is None and self._integrated_unchanged(task):
            self._unchanged(task, None)    # a run that stopped before it recorded the end
            return
        if head is None and self._publishing():
            candidate = (read_task_record(self.store.dir, task).get("integration") or {}
                         ).get("candidate")
            if candidate:                  # published, and the run stopped before its end
                self._end_published(task, published_branch(task), candidate)
                return
        self.tasks_completed += 1
        self.waiting_said = None
        self._end_task(task, MERGED_STATUS, None, head=head)
        self._push_merged(task, head)

    def _unchanged(self, task, target_head):
        """An approved task whose work the target already has: it ends Complete, nothing
        is merged, and it is counted as approved with no change, never as merged."""
        task_store = self.controllers[task].store
        data = task_store.read_state()
        if data.state == S.INTEGRATING:
            op_integrated(task_store, ORCHESTRATOR, target=self.target, unchanged=True,
                          target_head=(target_head or "")[:12] or None)
        submitted = data.task_submitted if isinstance(data.task_submitted, dict) else {}
        empty = False
        with contextlib.suppress(FerrusError, TypeError, KeyError):
            empty = _tree_of(self.store.root, submitted["commit"]) == _tree_of(
                self.store.root, submitted["base"])
        self.tasks_completed += 1
        self.waiting_said = None
        self._end_task(task, UNCHANGED_STATUS, None, empty=empty)

    def _integrated_unchanged(self, task):
        """Whether ``task``'s newest integrated entry (read back a bounded stretch of the
        journal) says it changed nothing."""
        for entry in itertools.islice(self.store.journal_entries_backwards(), TASK_EVENT_SCAN):
            if entry.get("task_id") == task and entry.get("event") == "integrated":
                return bool((entry.get("detail") or {}).get("unchanged"))
        return False

    def _stop_integration(self):
        """End the integration under way: its checks are stopped, its thread waited for
        (an integration cut short is undone by the next one)."""
        job, self.integration = self.integration, None
        if job is not None and job["thread"] is not None:
            job["cancel"].set()
            job["thread"].join(timeout=30)
            self._take_sync(job.pop("synced", None))
