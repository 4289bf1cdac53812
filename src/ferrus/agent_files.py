"""Agent files: the files register edits, planned and written safely.

JSON configs, instruction sections in CLAUDE.md and the like, .gitignore entries.
Every change is planned first and written only when all of them can be (a dry run
prints the plan); JSON files keep their comments out and their other keys as they
were."""

import contextlib
import json
import os
import threading

from .basics import FerrusError
from .system import atomic_write, fsync_directory, write_temp_beside
from .config import CONFIG_FILE


# -- files register edits -----------------------------------------------------------
#
# `register` and `unregister` touch several files (MCP configs, settings,
# CLAUDE.md, .gitignore, ferrus.toml, the user's trust lists).  They do it as one
# change set: every new content is computed, and every input validated, before
# the first byte is written, so a bad file met late leaves all files as they
# were.  Writes follow symlinks: a CLAUDE.md or settings file that links to a
# shared copy is updated at its target and stays a link.

class FileChanges:
    """New contents for several files, written all together or not at all.

    Used as ``with FileChanges():`` — planned_read/planned_write inside the block
    (on this thread) go through it, and leaving the block without an exception
    commits.  ``commit`` writes every temporary file first and renames them only
    once all exist; if a rename still fails, the files already replaced get
    their old content back."""

    _active = threading.local()

    def __init__(self):
        self.planned = {}        # real path -> bytes, in the order first planned

    def read(self, path):
        real = os.path.realpath(path)
        if real in self.planned:
            return self.planned[real].decode("utf-8")
        return _read_or_none(real)

    def write(self, path, data):
        self.planned[os.path.realpath(path)] = data.encode("utf-8") if isinstance(data, str) \
            else data

    def commit(self):
        """Write every planned file; returns the real paths that changed."""
        changed = [(real, data) for real, data in self.planned.items()
                   if _read_bytes_or_none(real) != data]
        staged = []
        try:
            for real, data in changed:
                os.makedirs(os.path.dirname(real), exist_ok=True)
                staged.append((real, write_temp_beside(real, data)))
        except BaseException:
            for _real, temp in staged:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            raise
        done = []
        try:
            for real, temp in staged:
                before = _read_bytes_or_none(real)
                os.replace(temp, real)
                done.append((real, before))
        except BaseException:
            for _real, temp in staged[len(done):]:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            for real, before in reversed(done):
                with contextlib.suppress(OSError):
                    if before is None:
                        os.unlink(real)
                    else:
                        atomic_write(real, before)
            raise
        for directory in {os.path.dirname(real) for real, _ in done}:
            fsync_directory(directory)
        return [real for real, _ in done]

    def __enter__(self):
        if getattr(FileChanges._active, "current", None) is not None:
            raise RuntimeError("FileChanges blocks do not nest")
        FileChanges._active.current = self
        return self

    def __exit__(self, kind, value, traceback):
        FileChanges._active.current = None
        if kind is None:
            self.commit()


def _read_bytes_or_none(path):
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _read_or_none(path):
    data = _read_bytes_or_none(path)
    return None if data is None else data.decode("utf-8", errors="replace")


def planned_read(path):
    """A file's text as the current change set would leave it (None: no such file)."""
    changes = getattr(FileChanges._active, "current", None)
    if changes is not None:
        return changes.read(path)
    return _read_or_none(os.path.realpath(path))


def planned_write(path, data):
    """Write through the current change set, or at once (atomically, through symlinks)."""
    changes = getattr(FileChanges._active, "current", None)
    if changes is not None:
        changes.write(path, data)
        return
    real = os.path.realpath(path)
    os.makedirs(os.path.dirname(real), exist_ok=True)
    atomic_write(real, data)


def ensure_gitignore_entry(root, entry, report):
    """Add ``entry`` to .gitignore unless a line already says it (CRLF tolerated)."""
    path = os.path.join(root, ".gitignore")
    text = planned_read(path)
    existing = {line.rstrip("\r").strip() for line in (text or "").split("\n")}
    if entry in existing or entry.rstrip("/") in existing or "/" + entry in existing:
        return False
    if text is None:
        planned_write(path, entry + "\n")
        report("Created .gitignore")
        return True
    if text and not text.endswith("\n"):
        text += "\n"
    planned_write(path, text + entry + "\n")
    report("Added %s to .gitignore" % entry)
    return True


def _strip_json_comments(text):
    """``text`` without // and /* */ comments outside strings (to recognise JSONC)."""
    out = []
    index, length, in_string = 0, len(text), False
    while index < length:
        char = text[index]
        if in_string:
            out.append(char)
            if char == "\\":
                out.append(text[index + 1:index + 2])
                index += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
            out.append(char)
        elif text.startswith("//", index):
            end = text.find("\n", index)
            index = length if end < 0 else end
            continue
        elif text.startswith("/*", index):
            end = text.find("*/", index + 2)
            index = length if end < 0 else end + 2
            continue
        else:
            out.append(char)
        index += 1
    return "".join(out)


def edit_json_file(path, mutate, what=None):
    """Load a JSON object file (missing or empty: {}), apply ``mutate``, write if changed.

    Key order and every unrelated setting are kept; the write is atomic, goes to
    a symlink's target, and joins the current FileChanges when there is one."""
    label = what or path
    text = planned_read(path) or ""
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError as err:
        try:
            json.loads(_strip_json_comments(text))
            has_comments = True
        except ValueError:
            has_comments = False
        if has_comments:
            raise FerrusError(
                "%s has comments (JSON with comments), which ferrus would lose when it rewrites "
                "the file" % label,
                "remove the comments from %s and run the command again; nothing was written"
                % path) from err
        raise FerrusError("Failed to parse %s: %s" % (label, err),
                          "fix the JSON by hand (ferrus never overwrites a file it cannot read); "
                          "nothing was written") from err
    if not isinstance(data, dict):
        raise FerrusError("%s root is not a JSON object" % label,
                          "fix or remove the file; nothing was written")
    before = json.dumps(data, sort_keys=False)
    mutate(data)
    if json.dumps(data, sort_keys=False) != before or not text.strip():
        planned_write(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        return True
    return False


def _json_table(data, key, label):
    value = data.setdefault(key, {})
    if not isinstance(value, dict):
        raise FerrusError("%s %s is not a JSON object" % (label, key), "fix the file by hand")
    return value


def _instruction_markers(role):
    return "<!-- ferrus-%s-instructions -->" % role, "<!-- /ferrus-%s-instructions -->" % role


def instruction_section(role):
    start, end = _instruction_markers(role)
    if role == "executor":
        body = ("This repository is orchestrated by ferrus. As the executor you work through the "
                "ferrus MCP tools: when HQ starts you, its prompt says what to do; when you are "
                "started by hand, call `wait_for_task` first, then implement, `check`, and "
                "`submit`.")
    else:
        body = ("This repository is orchestrated by ferrus. As the supervisor you define tasks, "
                "review submissions and answer consultations through the ferrus MCP tools; the "
                "prompt you were started with names your mode (task definition, planning, spec, "
                "review or consultation).")
    return ("\n%s\n## ferrus %s\n\n%s\n\nThe initial prompt and the ferrus MCP tools define what "
            "you do. ROLE.md, SKILL.md, AGENTS.md and CLAUDE.md are supporting context only and "
            "must not override them.\n%s\n" % (start, role, body, end))


def add_instruction_section(path, role, report):
    text = planned_read(path) or ""
    if _instruction_markers(role)[0] in text:
        return
    planned_write(path, text + instruction_section(role))
    report("Added the %s instructions to %s" % (role, os.path.basename(path)))


def remove_instruction_section(path, role, report):
    text = planned_read(path) or ""
    start, end = _instruction_markers(role)
    first = text.find(start)
    if first < 0:
        return
    last = text.find(end, first)
    last = len(text) if last < 0 else last + len(end)
    if text[last:last + 1] == "\n":
        last += 1
    if first > 0 and text[first - 1] == "\n":
        first -= 1
    planned_write(path, text[:first] + text[last:])
    report("Removed the %s instructions from %s" % (role, os.path.basename(path)))


# -- permission profiles ----------------------------------------------------------------
#
# A headless agent has nobody to answer a permission prompt: whatever its CLI
# would ask about is refused, so each launch says up front what the role may do
# besides calling ferrus's tools (which register already allows).
#   read-only  read the project; the reviewer and consultant (supervisor role)
#   edit       also create and edit files inside the project; the executor.  Its
#              builds and tests run through ferrus's /check, so no shell is granted
#   full       anything the CLI can do, without asking
#   output     pipeline workers: write their one output file (Claude Code can say
#              exactly that; the other CLIs get their nearest, "edit")
# `[hq.<role>] permissions` overrides the role's default.  Interactive sessions
# keep each CLI's own prompts: a person is there to answer them.

DEFAULT_PERMISSIONS = {"supervisor": "read-only", "executor": "edit"}
WORKER_PERMISSIONS = "output"


def effective_permissions(config, role):
    """(profile, where it comes from) for a role's headless launches."""
    choice = getattr(config, role, None)
    if choice is not None and choice.permissions:
        return choice.permissions, "[hq.%s] permissions in %s" % (role, CONFIG_FILE)
    return DEFAULT_PERMISSIONS[role], "the %s's default" % role
