"""Project memory's records: their files read back whole and checked, and merged.

A record file (``.ferrus/memory/records/<task>.json``) is the durable copy of what
project memory learned of a task; the folder is one a checkout's executor can write, so
a file is taken only when every field a search, a page or a prompt uses is what ferrus
writes.  The one thing to know of a record (why its work was sent back, why it failed,
what it did) is said here, for search hits, prompts and archived specs alike.
"""

import json
import os

from .basics import LazyPattern, pretty_json
from .system import UnsafePath, atomic_write, open_inside

_MEMORY_ID_RE = LazyPattern(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")
MEMORY_LIST_ENTRIES = 20                   # submissions and reviews kept (the last ones)

# The outcomes whose work stands (merged, kept, or approved with nothing to change).
_MEMORY_KEPT = ("merged", "done", "unchanged", "complete", "archived")


def _memory_json(text):
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _memory_merge(old, new):
    """``new`` with what only ``old`` knew kept (a rebuild from a rotated journal knows
    less than the record written when the task ended)."""
    if not old:
        return new
    merged = dict(old)
    for key, value in new.items():
        if value not in (None, "", [], 0) or key not in merged:
            merged[key] = value
    if new.get("outcome") != old.get("outcome"):
        merged["reason"] = new.get("reason")     # why it failed is no reason once it merged
    for key, identity in (("submissions", lambda item: (item.get("n"), item.get("time"))),
                          ("reviews", lambda item: (item.get("verdict"), item.get("time")))):
        seen, items = set(), []
        for item in (old.get(key) or []) + (new.get(key) or []):
            mark = identity(item)
            if mark in seen:
                for index, kept in enumerate(items):
                    if identity(kept) == mark:
                        items[index] = dict(kept, **{k: v for k, v in item.items() if v})
                continue
            seen.add(mark)
            items.append(item)
        merged[key] = sorted(items, key=lambda item: item.get("time") or "")[
            -MEMORY_LIST_ENTRIES:]
    return merged


def _memory_write_record_file(folder, record):
    os.makedirs(folder, exist_ok=True)
    atomic_write(os.path.join(folder, record["id"] + ".json"), pretty_json(record) + "\n",
                 durable=False)


def memory_record_problem(record):
    """Why a record file's content is not a record ferrus wrote (None when it is one): a
    record file is read back whole, and the folder is one a checkout's executor can
    write, so every field a search or a prompt uses is checked before any is."""
    text = (str, type(None))
    if not isinstance(record, dict):
        return "it is not a JSON object"
    for key in ("title", "outcome"):
        if not isinstance(record.get(key), str):
            return "its %s is not text" % key
    for key in ("reason", "spec", "milestone", "started_at", "ended_at", "description",
                "commit", "outcome_text", "files_note"):
        if not isinstance(record.get(key), text):
            return "its %s is not text" % key
    for key in ("retried", "files_count"):
        if not isinstance(record.get(key) or 0, int):
            return "its %s is not a number" % key
    items = {"submissions": ("summary", "time", "commit"),
             "reviews": ("verdict", "notes", "time", "by", "cause")}
    for key, fields in items.items():
        value = record.get(key) or []
        if not isinstance(value, list) or not all(
                isinstance(item, dict) and all(isinstance(item.get(field), text)
                                               for field in fields)
                and isinstance(item.get("files", []), list) for item in value):
            return "its %s are not a list of objects with text fields" % key
    files = record.get("files") or []
    if not isinstance(files, list) or not all(isinstance(path, str) for path in files):
        return "its files are not a list of paths"
    for path in files:
        if not memory_path_inside(path):
            return "its file %r is not a path inside the project" % path[:80]
    return None


def memory_path_inside(path):
    """Whether ``path`` is a relative path that stays inside the project."""
    parts = path.replace("\\", "/").split("/")
    return bool(path) and not path.startswith(("/", "\\")) and ".." not in parts and \
        ":" not in parts[0]


def _memory_read_record_files(folder):
    """(records, notes): the task records of the record files in ``folder``, and why
    each file that is not one was skipped."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return [], []
    records, notes = [], []
    for name in names:
        if not name.endswith(".json") or not _MEMORY_ID_RE.match(name[:-5]):
            continue
        try:
            with open_inside(folder, name) as handle:
                data = handle.read((1 << 20) + 1)
        except (OSError, UnsafePath) as err:
            notes.append("%s cannot be read: %s" % (name, getattr(err, "strerror", err)))
            continue
        try:
            record = json.loads(data.decode("utf-8", "replace")) if len(data) <= 1 << 20 \
                else None
        except ValueError:
            notes.append("%s is not valid JSON" % name)
            continue
        problem = "it is over 1 MiB" if record is None else memory_record_problem(record)
        if problem is None and (record.get("id") != name[:-5] or record.get("kind") != "task"):
            problem = "it is not the record of task %s" % name[:-5]
        if problem:
            notes.append("%s: %s" % (name, problem))
        else:
            records.append(record)
    return records, notes


def _memory_key_note(record):
    """The one thing a later executor should know of a record: why its work was sent
    back (said as past when it was approved in the end), else why it failed, else what
    was done (or only submitted, when its work was not kept)."""
    kept = record.get("outcome") in _MEMORY_KEPT
    for item in reversed(record.get("reviews") or []):
        if not item.get("verdict", "").startswith("approved") and item.get("notes"):
            return "%s%s: \"%s\"" % ("before approval, " if kept else "", item["verdict"],
                                     _memory_line(item["notes"], 220))
    if record.get("reason"):
        return _memory_line(record["reason"], 220)
    for item in reversed(record.get("submissions") or []):
        if item.get("summary"):
            return "%s: \"%s\"" % ("done" if kept else "submitted, not kept",
                                   _memory_line(item["summary"], 160))
    if record.get("outcome_text"):
        return "outcome: \"%s\"" % _memory_line(record["outcome_text"], 160)
    return ""


def _memory_line(text, limit):
    text = " ".join((text or "")[:limit * 2].split())
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"
