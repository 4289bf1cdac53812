"""The gate tried on the base, before any agent starts.

A command that cannot run or a base that is already red stops a run before it
spends a session; a green verdict is kept per commit and check commands."""

import contextlib
import dataclasses
import json
import os

from .basics import FerrusError, deferred_dataclass, format_timestamp, log, pretty_json
from .system import atomic_write, read_text
from .checks import CHECK_TAIL_SHOWN, describe_failed_check, failed_check_facts, run_checks
from .git import git_repository
from .worktrees import (GATE_FOLDER, default_worktree_dir, gate_checkout,
                        remove_task_worktree, reset_gate)
from .bootstrap import copy_local_files, port_environment, run_teardown, with_port


# -- the gate tried on the base, before any agent starts ----------------------------------
#
# `ferrus run` runs the checks once on the untouched base a task starts from: a command
# that cannot run, or a base that is already red, would otherwise be found only by the
# executor, session after session.  A green verdict is kept in .ferrus/base-checks.json
# for the commit and the commands it was reached with, so the same base is checked once.

BASE_CHECKS_FILE = "base-checks.json"
BASE_CHECKS_KEPT = 20
# Exit statuses of a shell that could not run a command (POSIX sh: not found, not
# executable; cmd.exe: "is not recognized").
CANNOT_RUN_EXITS = (126, 127, 9009)


class RedBaseRefused(FerrusError):
    """The checks fail on a task's base before any agent started, and the run stops."""


@deferred_dataclass
class BaseCheck:
    """The check gate's verdict on a task's base, before any agent worked on it."""

    passed: bool
    commit: "str | None"          # the commit checked (None: a checkout with changes)
    failed: list                  # failed_check_facts of each red command (setup first)
    log: str = ""                 # the run's summary log, relative to the project root
    checked_at: str = ""
    cached: bool = False          # found in base-checks.json, not run now

    def cannot_run(self):
        """The failed commands the shell could not run at all (not found, not executable)."""
        return [fact for fact in self.failed if fact.get("exit") in CANNOT_RUN_EXITS]

    def to_json(self):
        return {"passed": self.passed, "commit": self.commit, "failed": self.failed,
                "log": self.log, "checked_at": self.checked_at}


def _base_check_key(commit, commands, setup):
    return {"commit": commit, "commands": list(commands), "setup": list(setup)}


def cached_base_check(store, commit, commands, setup=()):
    """The BaseCheck kept for ``commit`` checked with exactly these commands, or None."""
    if not commit:
        return None
    key = _base_check_key(commit, commands, setup)
    for entry in reversed(_read_base_checks(store)):
        if all(entry.get(name) == value for name, value in key.items()):
            return BaseCheck(bool(entry.get("passed")), commit, [
                fact for fact in entry.get("failed") or [] if isinstance(fact, dict)],
                str(entry.get("log") or ""), str(entry.get("checked_at") or ""), cached=True)
    return None


def _read_base_checks(store):
    try:
        data = json.loads(read_text(store.path(BASE_CHECKS_FILE), default="") or "{}")
    except (ValueError, OSError):
        return []
    entries = data.get("checks") if isinstance(data, dict) else None
    return [entry for entry in entries or [] if isinstance(entry, dict)]


def _keep_base_check(store, result, commands, setup):
    entry = dict(_base_check_key(result.commit, commands, setup), **result.to_json())
    with store.lock():
        entries = [e for e in _read_base_checks(store)
                   if any(e.get(name) != value for name, value in
                          _base_check_key(result.commit, commands, setup).items())]
        atomic_write(store.path(BASE_CHECKS_FILE), pretty_json(
            {"checks": (entries + [entry])[-BASE_CHECKS_KEPT:]}))


def check_base(store, commit, checkout=None, setup=(), cancel=None, port=None):
    """Run the check gate on a task's base before any agent starts; a BaseCheck.

    ``checkout`` is where the base is checked out as it is (the project's own checkout
    for a single task); None makes a clean one: a temporary detached worktree of
    ``commit`` beside the repository (default_worktree_dir), holding what [parallel]
    copy brings, where ``setup`` (the [parallel] setup commands) runs first and
    [parallel] teardown last, with the merge gate's ports (``port``: {port} and
    FERRUS_TASK_PORT), removed afterwards.  With a ``commit`` a green verdict is kept
    for it and these commands and reused; ``commit`` None (a checkout with uncommitted
    changes) is checked every time."""
    config = store.config()
    commands = list(config.checks.commands)
    found = cached_base_check(store, commit, commands, setup)
    if found is not None:
        return found
    if checkout is None:
        folder = _clean_checkout(store, commit)
        copy_local_files(store, folder, default_worktree_dir(
            store.root, store.config().parallel.worktree_dir))
        result = _run_base_checks(store, folder, commit, setup, cancel, port)
    else:
        result = _run_base_checks(store, checkout, commit, (), cancel)
    # Only a green verdict is kept: a red one is tried again, as what fixes it (a tool
    # installed, a file made) need not change the commit.
    if commit and result.passed and not (cancel is not None and cancel.is_set()):
        with contextlib.suppress(OSError):       # a verdict not kept is checked again
            _keep_base_check(store, result, commands, setup)
    return result


def _run_base_checks(store, checkout, commit, setup, cancel, port=None):
    config = store.config()
    keep = config.limits.max_feedback_lines
    failed, log_path = [], ""
    env = port_environment(port)
    if setup:
        steps = dataclasses.replace(config.checks, commands=with_port(setup, port),
                                    parallel=False, fail_fast=True)
        run = run_checks(checkout, steps, store.path("logs"), 0, keep, cancel, store.root,
                         env=env)
        failed = [dict(failed_check_facts(r), setup=True) for r in run.failed]
        log_path = run.log_path
    if not failed:
        run = run_checks(checkout, config.checks, store.path("logs"), 0, keep, cancel,
                         store.root, env=env)
        failed = [failed_check_facts(r) for r in run.failed]
        log_path = run.log_path
    if setup:
        torn = run_teardown(store, checkout, port, "the merge gate's checkout")
        if torn:
            log.warning("%s", torn)
    return BaseCheck(not failed, commit, failed, log_path,
                     format_timestamp(store.clock()))


def _clean_checkout(store, commit):
    """The project folder (a subfolder when the project is one of its repository) of the
    merge gate's clean checkout (see gate_checkout), at ``commit``."""
    repo = git_repository(store.root)
    gate = gate_checkout(store.root, default_worktree_dir(
        store.root, store.config().parallel.worktree_dir), commit)
    reset_gate(gate, commit)
    inside = os.path.relpath(store.root, repo.toplevel)
    return gate.work_tree if inside == "." else os.path.join(gate.work_tree, inside)


def remove_gate_checkout(store):
    """The merge gate's checkout goes (a run is over; the next one makes it again)."""
    with contextlib.suppress(FerrusError, OSError):
        folder = default_worktree_dir(store.root, store.config().parallel.worktree_dir)
        remove_task_worktree(store.root, os.path.join(folder, GATE_FOLDER), None)


def describe_base_check(result, where):
    """The lines that say what failed on the base ``where`` (``main at 3fa2c1``)."""
    lines = ["the checks fail on %s, before any agent started:" % where]
    for fact in result.failed:
        text = describe_failed_check(fact)
        if fact.get("exit") in CANNOT_RUN_EXITS:
            text = text.replace("(exit %s)" % fact["exit"], "(exit %s: the command could not "
                                "run — not found or not executable)" % fact["exit"], 1)
        if fact.get("setup"):
            text = text.replace("    check ", "    [parallel] setup ", 1)
        lines.append(text)
    return lines


RED_BASE_MARK = "\n\n---\nNote from ferrus: before this task started, "


def without_red_base_note(text):
    """A task's text without the red_base_note an earlier start added to it."""
    return text.split(RED_BASE_MARK, 1)[0]


def red_base_note(result, where):
    """What the executor is told with its task when it starts on a red base."""
    parts = [RED_BASE_MARK + "these checks already "
             "failed on its base (%s), with no change of yours; the check gate still needs "
             "every check to pass:" % where]
    for fact in result.failed:
        parts.append("- `%s`%s%s" % (fact.get("command"), " (exit %s)" % fact["exit"]
                                      if fact.get("exit") is not None else "",
                                      " ([parallel] setup)" if fact.get("setup") else ""))
        parts += ["    " + line for line in (fact.get("tail") or [])[-CHECK_TAIL_SHOWN:]]
    return "\n".join(parts) + "\n"
