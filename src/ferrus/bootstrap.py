"""Worktree bootstrap: the checkout's local files, a port block per task, teardown.

A new worktree holds only what git tracks: [parallel] copy brings the checkout's
untracked local files (a .env) into it and keeps them out of the task's commits; each
task gets a block of ports (FERRUS_TASK_PORT) for its agents, checks, setup and
teardown; [parallel] teardown runs before its worktree is removed."""

import dataclasses
import os
import shutil

from .basics import FerrusError
from .config import PORT_PLACEHOLDER
from .store import FERRUS_DIR, RUNNING_STATUS, read_task_record
from .checks import _status_note, run_checks
from .git import run_git


# -- the checkout's local files, copied into a new worktree --------------------------------
#
# `.env`, `config/local.toml`, a `node_modules` folder: what a project needs to run but git
# does not hold.  The files and folders of the checkout that match a [parallel] copy
# pattern and that git does not track are copied (or, with copy_mode = "link", linked)
# into each new worktree, and the task's record lists them ("copied"): every diff,
# submission and saved work of the task leaves those paths as its base has them
# (task_diff_exclusions), so a copied secret never reaches a commit — ignored by
# .gitignore or not.

TASK_PORT_ENV = "FERRUS_TASK_PORT"
NEVER_COPIED = (".git", FERRUS_DIR)


def copy_sources(root, patterns, skip=()):
    """The project-relative paths ("/"-separated, sorted) of what [parallel] copy brings
    from the checkout at ``root``: each file or folder matching one of ``patterns``
    (glob patterns; ``**`` spans folders; ``*`` does not match a leading dot) that git
    does not track — a matched folder holding tracked files is gone through child by
    child.  Never .git or .ferrus, nor anything inside one of the folders ``skip`` (the
    worktrees' own folder)."""
    import glob
    matched = set()
    for pattern in patterns:
        for path in glob.glob(os.path.join(glob.escape(root), pattern), recursive=True):
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if rel in (".", "") or rel.startswith("../") or \
                    set(rel.split("/")) & set(NEVER_COPIED) or \
                    any(_resolves_inside(path, folder) for folder in skip):
                continue
            matched.add(rel)
    # What lies inside another match comes with it.
    matched = {rel for rel in matched if not any(
        rel.startswith(other + "/") for other in matched if other != rel)}
    if not matched:
        return []
    out = run_git(root, ["ls-files", "-z", "--cached", "--"] +
                  [":(literal)" + rel for rel in sorted(matched)], ok=(0, 1))
    tracked = {os.fsdecode(name) for name in out.split(b"\0") if name}
    found = []
    for rel in sorted(matched):
        found.extend(_untracked_parts(root, rel, tracked))
    return sorted(found)


def _resolves_inside(path, folder):
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(folder))
    return rel == os.curdir or not rel.startswith(os.pardir)


def _untracked_parts(root, rel, tracked):
    """``rel`` when git tracks nothing at or below it, else its untracked parts."""
    if rel in tracked:
        return []
    prefix = rel + "/"
    if not any(path.startswith(prefix) for path in tracked):
        return [rel]
    full = os.path.join(root, *rel.split("/"))
    if os.path.islink(full) or not os.path.isdir(full):
        return []
    parts = []
    for name in sorted(os.listdir(full)):
        if name not in NEVER_COPIED:
            parts.extend(_untracked_parts(root, prefix + name, tracked))
    return parts


def copy_into_worktree(root, workdir, paths, mode="copy"):
    """Copy (``mode`` "copy") or symbolically link ("link") each of ``paths`` (from
    copy_sources) from the checkout at ``root`` into the task's project folder
    ``workdir``, replacing what an earlier try left there.  Raises FerrusError naming
    the path and the reason when one cannot be."""
    for rel in paths:
        source = os.path.join(root, *rel.split("/"))
        target = os.path.join(workdir, *rel.split("/"))
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if mode == "link":
                if os.path.islink(target) and os.readlink(target) == source:
                    continue
                _remove(target)
                os.symlink(source, target, target_is_directory=os.path.isdir(source))
            else:
                # Removed first: a link an earlier try left would be written through.
                _remove(target)
                if os.path.isdir(source) and not os.path.islink(source):
                    shutil.copytree(source, target, symlinks=True)
                else:
                    shutil.copy2(source, target)
        except OSError as err:
            raise FerrusError(
                "[parallel] copy could not %s %s into the worktree: %s" % (
                    "link" if mode == "link" else "copy", rel, err.strerror or err),
                "set copy_mode = \"copy\" where links cannot be made (Windows without "
                "developer mode), or take the pattern out of [parallel] copy" if
                mode == "link" else "check the file's permissions, or take the pattern "
                "out of [parallel] copy") from err


def copy_local_files(store, folder, worktree_dir):
    """[parallel] copy into ``folder`` (a task's project folder, or the merge gate's
    clean checkout: the checks need what the tasks had); the paths copied."""
    parallel = store.config().parallel
    if not parallel.copy:
        return []
    paths = copy_sources(store.root, parallel.copy, skip=[worktree_dir])
    copy_into_worktree(store.root, folder, paths, parallel.copy_mode)
    return paths


# The most [parallel] copy sends to a task at another place (copy_to_places = true):
# the files travel in the request that prepares the task there.
PLACE_COPY_LIMIT = 16 << 20


def pack_local_files(root, paths):
    """[parallel] copy's ``paths`` (from copy_sources, in the checkout at ``root``) as
    they travel to a place: a list of {"path", "mode", "data" (base64)} for each file
    at or under them, {"path", "link"} for a symbolic link (kept as a link, as a copy
    here keeps it).  Raises FerrusError past PLACE_COPY_LIMIT bytes."""
    import base64
    entries, total = [], 0

    def add(full, rel):
        nonlocal total
        if os.path.islink(full):
            entries.append({"path": rel, "link": os.readlink(full)})
        elif os.path.isfile(full):
            with open(full, "rb") as handle:
                data = handle.read(PLACE_COPY_LIMIT + 1 - total)
            total += len(data)
            if total > PLACE_COPY_LIMIT:
                raise FerrusError(
                    "[parallel] copy matches more than %d MiB of files (at %s): more than "
                    "ferrus sends to a place with copy_to_places" % (
                        PLACE_COPY_LIMIT >> 20, rel),
                    "narrow [parallel] copy, or make those files there with [parallel] "
                    "setup and set copy_to_places = false")
            entries.append({"path": rel, "mode": os.stat(full).st_mode & 0o777,
                            "data": base64.b64encode(data).decode("ascii")})
    for rel in paths:
        full = os.path.join(root, *rel.split("/"))
        if os.path.isdir(full) and not os.path.islink(full):
            for folder, dirs, files in os.walk(full):
                dirs.sort()
                inside = os.path.relpath(folder, root).replace(os.sep, "/")
                for name in sorted(files) + sorted(d for d in dirs if os.path.islink(
                        os.path.join(folder, d))):
                    add(os.path.join(folder, name), inside + "/" + name)
        else:
            add(full, rel)
    return entries


def check_copied_paths(paths, entries):
    """Refuse (FerrusError) a path of ``paths`` or ``entries`` that would leave the
    project folder or name .git or .ferrus."""
    for rel in list(paths) + [entry.get("path") for entry in entries]:
        if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or \
                set(rel.split("/")) & ({"..", ".", ""} | set(NEVER_COPIED)):
            raise FerrusError("[parallel] copy sent a path that leaves the worktree or "
                              "names %s: %r" % (" or ".join(NEVER_COPIED), rel),
                              "the orchestrator sends paths inside the project")


def unpack_local_files(workdir, paths, entries):
    """At the place: [parallel] copy's files (pack_local_files) written into the task's
    project folder ``workdir``, each of ``paths`` (the copied top-level paths) cleared
    first.  A path that would leave the folder, or name .git or .ferrus, is refused."""
    import base64
    check_copied_paths(paths, entries)
    for rel in paths:
        target = os.path.join(workdir, *rel.split("/"))
        if os.path.lexists(target):
            _remove(target)
    for entry in entries:
        target = os.path.join(workdir, *entry["path"].split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not _resolves_inside(os.path.dirname(target), workdir):
            raise FerrusError("[parallel] copy sent %s, under a link that leaves the "
                              "worktree" % entry["path"], "a copied link is never written "
                              "through")
        if os.path.lexists(target):
            _remove(target)
        if isinstance(entry.get("link"), str):
            os.symlink(entry["link"], target)
        else:
            with open(target, "wb") as handle:
                handle.write(base64.b64decode(entry.get("data") or ""))
            os.chmod(target, int(entry.get("mode") or 0o600) & 0o777)


def _remove(path):
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def copied_paths(record):
    """The paths [parallel] copy put in a task's worktree, from its task.json."""
    copied = record.get("copied")
    return [path for path in copied if isinstance(path, str) and path] \
        if isinstance(copied, list) else []


# -- ports: a block per task, one for the merge gate ----------------------------------------
#
# Block 0 (from [parallel] port_base) is the merge gate's: its setup, checks and teardown,
# and the checks tried on the base.  Each running task holds one of the blocks after it
# (its record's "port"), so two tasks' dev servers or test databases never collide.  A
# task keeps its block while it runs; an ended task's block is free again.

TASK_PORT_BLOCKS = 64


def choose_task_port(records, task, parallel):
    """The first port of the block task ``task`` gets, given ``records`` ([(task id,
    task.json)] of the queue): the block its record names when no other running task
    holds it, else the lowest free one; None when ports are off (port_base = 0).  Raises
    FerrusError when every block is held."""
    if not parallel.port_base:
        return None
    held = {record.get("port") for other, record in records
            if other != task and record.get("status") == RUNNING_STATUS}
    blocks = [parallel.port_base + index * parallel.ports_per_task
              for index in range(1, TASK_PORT_BLOCKS + 1)]
    own = dict(records).get(task, {}).get("port")
    if own in blocks and own not in held:
        return own
    for port in blocks:
        if port not in held:
            return port
    raise FerrusError("every one of the %d port blocks is held by a running task"
                      % TASK_PORT_BLOCKS, "let a task end first, or lower --parallel")


def gate_port(parallel):
    """The merge gate's first port (block 0), or None when ports are off."""
    return parallel.port_base or None


def port_environment(port):
    """The variables a task's (or the gate's) agents and commands get for ``port``."""
    return {TASK_PORT_ENV: str(port)} if port else {}


def task_environment(record):
    """port_environment of the block task.json ``record`` holds ({} when none)."""
    port = record.get("port")
    return port_environment(port if isinstance(port, int) and not isinstance(port, bool)
                            else None)


def store_environment(store):
    """task_environment of ``store``'s parallel task ({} for the checkout's own task)."""
    return task_environment(read_task_record(store.dir, store.task)) if store.task else {}


def with_port(commands, port):
    """``commands`` with {port} replaced by ``port`` (left as they are without one)."""
    return [command.replace(PORT_PLACEHOLDER, str(port)) if port else command
            for command in commands]


# -- teardown: what setup started, stopped before a worktree goes ---------------------------

def run_teardown(store, folder, port, where):
    """[parallel] teardown in ``folder`` (a task's project folder, or the merge gate's),
    with ``port``'s block in its environment and {port} replaced: every command runs,
    whatever the one before did.  Returns "" when all passed (or there are none), else
    what failed, for a warning (a failed teardown never keeps a worktree)."""
    config = store.config()
    commands = with_port(config.parallel.teardown, port)
    if not commands or not os.path.isdir(folder):
        return ""
    steps = dataclasses.replace(config.checks, commands=commands, parallel=False,
                                fail_fast=False)
    run = run_checks(folder, steps, store.path("logs"), 0, config.limits.max_feedback_lines,
                     None, store.root, env=port_environment(port))
    return "; ".join("[parallel] teardown `%s` failed in %s%s, log %s" % (
        failed.command, where, _status_note(failed), failed.log_path)
        for failed in run.failed)


def tear_down_task(store, record):
    """run_teardown in the project folder of the task whose task.json is ``record``,
    before its worktree is removed: "" or a warning's text (also when ferrus.toml does
    not load: the worktree goes either way)."""
    folder = record.get("workdir") or record.get("worktree")
    if record.get("store") == "project" or not isinstance(folder, str):
        return ""
    port = record.get("port") if isinstance(record.get("port"), int) else None
    try:
        return run_teardown(store, folder, port, "its worktree %s" % folder)
    except FerrusError as err:
        return "[parallel] teardown did not run in %s: %s" % (folder, err.message)
