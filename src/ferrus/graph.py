"""The repository graph: definitions, imports and calls, its cache and its queries.

The project's definitions, imports and calls live in a rebuildable sqlite3 cache, which
agents (the repository_graph_* tools) and people (``ferrus graph``) search.

``ferrus graph index`` lists the project's files (``git ls-files``: tracked and untracked,
never what git ignores; without git, a walk that leaves out VCS and dependency folders),
re-reads only a file whose size or modification time changed, and extracts it again
(graph_extract.py) only when its content hash changed.  Binary files, files over
GRAPH_MAX_FILE_BYTES, special files and symbolic links — those out of the tree are never
read — are listed with why they were skipped.  It all lives in
``.ferrus/graph/repo-graph.db``: a cache, which ``index --full`` rebuilds from the tree.

A parallel task's worktree is laid over that shared graph as an overlay of its own
(``.ferrus/graph/overlays/<task>.db``): the files its diff names are indexed there, and a
query made for the task sees the overlay's files in place of the shared graph's, which is
never written for a task.  Queries refresh what they read (at most every
GRAPH_REFRESH_SECS per process), and their answers are ranked, cut at GRAPH_ANSWER_CHARS
and paged with ``offset`` like the log resource.
"""

import contextlib
import dataclasses
import os
import re
import stat
import threading
import time

from .basics import LazyPattern, FerrusError, deferred_dataclass, format_timestamp, log, utc_now
from .system import UnsafePath, import_sqlite3, open_inside
from .store import ENDED_STATUSES, FERRUS_DIR, Store, load_task_record
from .git import GitError, GitUnavailable, git_repository, run_git, task_diff
from .operations import (HUMAN, Outcome, Param, ROLES, Tool, task_diff_exclusions,
                         task_git_site)
from .task_queue import queued_task_ids, require_task_id, task_store_of
from .graph_extract import (GRAPH_LINE_CHARS, graph_decode, graph_extract, graph_language,
                            graph_line_count)



GRAPH_DIR = "graph"                        # in .ferrus/
GRAPH_DB_FILE = "repo-graph.db"
GRAPH_OVERLAY_DIR = "overlays"             # in .ferrus/graph/: one database per task
GRAPH_SCHEMA_VERSION = 2                  # 2: a file's lines counted as editors count them
# A file larger than this is listed as "huge" and never read.
GRAPH_MAX_FILE_BYTES = 1 << 20
# At most this many files are listed; the rest are counted and left out.
GRAPH_MAX_FILES = 200_000
# A query builds a graph that does not exist yet only for a project of at most this many
# files (a larger one takes `ferrus graph index` once).
GRAPH_AUTO_BUILD_FILES = 5_000
# A process refreshes the same graph at most this often while answering queries.
GRAPH_REFRESH_SECS = 2.0
# A file is trusted unchanged by its size and mtime only when that mtime is this much
# older than the moment it was hashed (a write in the same clock tick keeps both).
GRAPH_RACY_NS = 2_000_000_000
# How long a writer waits for another process's write to the same graph to end.
GRAPH_BUSY_SECS = 10.0
GRAPH_PAGE_DEFAULT = 20
GRAPH_PAGE_MAX = 100
GRAPH_ANSWER_CHARS = 24 * 1024
GRAPH_EXCERPT_LINES = 60
# Without git, folders of these names are not walked into.
GRAPH_WALK_SKIPPED = frozenset((".git", ".hg", ".svn", ".bzr", FERRUS_DIR, "node_modules",
                                "__pycache__", ".venv", "venv", ".tox", ".mypy_cache",
                                ".pytest_cache", ".ruff_cache", "target", "dist", "build"))
# How definitions rank among equally good name matches.
GRAPH_KIND_RANK = {"class": 0, "struct": 0, "interface": 0, "trait": 0, "enum": 0,
                   "type": 1, "union": 1, "function": 1, "method": 1, "module": 2,
                   "macro": 3, "constant": 3, "variable": 3, "file": 4}


# -- the database ---------------------------------------------------------------------------

_GRAPH_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    path TEXT PRIMARY KEY, lang TEXT NOT NULL, status TEXT NOT NULL, note TEXT,
    size INTEGER, mtime_ns INTEGER, hashed_ns INTEGER, hash TEXT, lines INTEGER,
    module TEXT);
CREATE TABLE IF NOT EXISTS symbols (
    path TEXT NOT NULL, name TEXT NOT NULL, lname TEXT NOT NULL, words TEXT NOT NULL,
    qualname TEXT NOT NULL, lqual TEXT NOT NULL, kind TEXT NOT NULL, line INTEGER NOT NULL,
    end_line INTEGER, signature TEXT);
CREATE TABLE IF NOT EXISTS imports (
    path TEXT NOT NULL, line INTEGER NOT NULL, spec TEXT NOT NULL, keys TEXT NOT NULL,
    target TEXT);
CREATE TABLE IF NOT EXISTS calls (
    path TEXT NOT NULL, line INTEGER NOT NULL, name TEXT NOT NULL, caller TEXT);
CREATE TABLE IF NOT EXISTS gone (path TEXT PRIMARY KEY);
"""
_GRAPH_INDEXES = (("symbols_by_name", "symbols(lname)"), ("symbols_by_qual", "symbols(lqual)"),
                  ("symbols_by_path", "symbols(path)"), ("imports_by_path", "imports(path)"),
                  ("imports_by_target", "imports(target)"), ("calls_by_name", "calls(name)"),
                  ("calls_by_path", "calls(path)"))
_GRAPH_TABLES = ("files", "symbols", "imports", "calls")


class GraphUnavailable(FerrusError):
    """A graph database sqlite cannot read (it is a cache, rebuilt from the tree), or one
    another process is writing for longer than sqlite waits."""



def graph_db_path(store):
    return store.path(GRAPH_DIR, GRAPH_DB_FILE)


def graph_overlay_path(store, task):
    return store.path(GRAPH_DIR, GRAPH_OVERLAY_DIR, task + ".db")


def graph_connect(path, create=True):
    """An autocommit connection to the graph database at ``path`` with the current
    schema; a file of another schema version or one sqlite cannot read is replaced
    (it is a cache).  None when ``create`` is False and there is no database."""
    sqlite3 = import_sqlite3("the repository graph")
    if not create and not os.path.isfile(path):
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for attempt in (1, 2):
        try:
            connection = sqlite3.connect(path, timeout=GRAPH_BUSY_SECS, isolation_level=None,
                                         check_same_thread=False)
            try:
                version = connection.execute("PRAGMA user_version").fetchone()[0]
                if version not in (0, GRAPH_SCHEMA_VERSION):
                    raise sqlite3.DatabaseError("schema version %d" % version)
                # A cache: no fsync (a file a power cut damaged is made again), and the
                # rollback journal, whose closing costs nothing (WAL checkpoints then).
                connection.execute("PRAGMA synchronous=OFF")
                if version == 0:
                    connection.executescript(_GRAPH_SCHEMA + "".join(
                        "CREATE INDEX IF NOT EXISTS %s ON %s;\n" % index
                        for index in _GRAPH_INDEXES))
                    connection.execute("PRAGMA user_version=%d" % GRAPH_SCHEMA_VERSION)
                return connection
            except BaseException:
                connection.close()
                raise
        except sqlite3.DatabaseError as err:
            if isinstance(err, sqlite3.OperationalError) and "locked" in str(err):
                raise GraphUnavailable("the repository graph %s is locked by another process "
                                   "(%s)" % (path, err), "try again in a moment") from err
            if attempt == 2 or not create:
                raise GraphUnavailable("the repository graph %s cannot be read: %s" % (path, err),
                                   "`ferrus graph index --full` rebuilds it") from err
            log.warning("the repository graph %s cannot be read (%s): rebuilding it",
                        path, err)
            graph_remove_database(path)
    raise AssertionError("unreachable")


def graph_remove_database(path):
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + suffix)


# -- which files there are --------------------------------------------------------------------

def graph_listing(root):
    """(project-relative /-separated paths, how many were left out past GRAPH_MAX_FILES,
    how the list was made): git's tracked and untracked files (what git ignores left
    out), or a walk of the tree without git.  .ferrus/ is never listed."""
    paths = None
    how = "git ls-files"
    with contextlib.suppress(GitUnavailable):
        git_repository(root)
        try:
            out = run_git(root, ["ls-files", "-z", "--cached", "--others", "--exclude-standard"])
            paths = sorted(set(os.fsdecode(out).split("\0")) - {""})
        except GitError as err:
            log.warning("git ls-files failed (%s): walking the tree instead", err.message)
    if paths is None:
        how = "a walk of the tree (no git)"
        paths = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(name for name in dirs if name not in GRAPH_WALK_SKIPPED
                             and not name.startswith("."))
            rel = os.path.relpath(folder, root)
            prefix = "" if rel == os.curdir else rel.replace(os.sep, "/") + "/"
            paths.extend(prefix + name for name in sorted(files))
            if len(paths) > GRAPH_MAX_FILES:
                break
    paths = [path for path in paths if not (path == FERRUS_DIR or
                                            path.startswith(FERRUS_DIR + "/"))]
    left_out = max(0, len(paths) - GRAPH_MAX_FILES)
    return paths[:GRAPH_MAX_FILES], left_out, how


def _graph_inside(path, root):
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


@deferred_dataclass
class GraphIndexReport:
    """What one index run did."""

    files: int = 0
    read: int = 0            # files whose content was read and hashed
    extracted: int = 0       # files whose facts were extracted again
    removed: int = 0
    skipped: dict = dataclasses.field(default_factory=dict)   # status -> count
    left_out: int = 0
    listing: str = ""
    symbols: int = 0
    seconds: float = 0.0
    full: bool = False

    def to_json(self):
        return dataclasses.asdict(self)


def _graph_classify(root, path, max_bytes):
    """(status, lang, stat or None, note) of one listed file, from lstat alone."""
    full = os.path.join(root, *path.split("/"))
    lang = graph_language(path)
    try:
        info = os.lstat(full)
    except OSError:
        return "gone", lang, None, ""
    if stat.S_ISLNK(info.st_mode):
        if not _graph_inside(full, root):
            return "outside", lang, info, "a symbolic link out of the tree (not followed)"
        return "link", lang, info, "a symbolic link (its target is listed on its own)"
    if not stat.S_ISREG(info.st_mode):
        return "special", lang, info, "not a regular file"
    if info.st_size > max_bytes:
        return "huge", lang, info, "larger than %d bytes" % max_bytes
    return "ok", lang, info, ""


def graph_index_files(connection, root, paths, full=False, remove_missing=True,
                      max_bytes=GRAPH_MAX_FILE_BYTES, report=None, base_rows=None):
    """Bring the database up to date with ``paths`` (project-relative) under ``root``:
    unchanged files (same size and mtime, hashed well after that mtime) are not read,
    read files whose hash is unchanged are not extracted again.  With
    ``remove_missing`` the files the database has and ``paths`` lacks are dropped.
    ``base_rows``: the (path, lang, module) of the shared graph an overlay lies over,
    whose files its imports may name too.  Returns the GraphIndexReport."""
    import hashlib             # kept off every command's start-up
    report = report or GraphIndexReport()
    report.full = full
    report.files = len(paths)
    changed_set = False
    extracted = []
    _graph_begin(connection)
    try:
        # Read inside the write transaction: another indexer (the other role's server,
        # or a second query's refresh) may have filled the database while this one
        # waited for the lock, and its rows must not be inserted a second time.
        known = {row[0]: row[1:] for row in connection.execute(
            "SELECT path, size, mtime_ns, hashed_ns, hash, status FROM files")}
        if not known:
            # Filling an empty database: its indexes are made once at the end, which is
            # much faster than keeping them up to date row by row.
            for name, _ in _GRAPH_INDEXES:
                connection.execute("DROP INDEX IF EXISTS %s" % name)
        for path in paths:
            status, lang, info, note = _graph_classify(root, path, max_bytes)
            before = known.get(path)
            if status == "gone":
                if before is not None:
                    _graph_drop(connection, path)       # listed by git, deleted from disk
                    report.removed += 1
                    changed_set = True
                continue
            if status != "ok":
                report.skipped[status] = report.skipped.get(status, 0) + 1
                if before is None or before[4] != status:
                    _graph_drop(connection, path, before is not None)
                    connection.execute(
                        "INSERT INTO files (path, lang, status, note, size, mtime_ns) "
                        "VALUES (?, ?, ?, ?, ?, ?)", (path, lang, status, note, info.st_size,
                                                      info.st_mtime_ns))
                    changed_set = changed_set or before is None
                continue
            if before is None:
                changed_set = True
            if not lang:
                # Not a language ferrus reads: listed for path searches, never opened.
                if before is None or before[4] != "listed" or before[0] != info.st_size:
                    _graph_drop(connection, path, before is not None)
                    connection.execute(
                        "INSERT INTO files (path, lang, status, size, mtime_ns) "
                        "VALUES (?, '', 'listed', ?, ?)", (path, info.st_size,
                                                           info.st_mtime_ns))
                continue
            if (not full and before is not None and before[0] == info.st_size
                    and before[1] == info.st_mtime_ns and before[2] is not None
                    and before[2] - info.st_mtime_ns > GRAPH_RACY_NS):
                continue
            try:
                with open_inside(root, *path.split("/")) as handle:
                    data = handle.read(max_bytes + 1)
            except (OSError, UnsafePath) as err:
                # open_inside refuses a folder on the way that leads out of the tree, and
                # a file swapped for a link since it was listed.
                status = "outside" if isinstance(err, UnsafePath) else "unreadable"
                report.skipped[status] = report.skipped.get(status, 0) + 1
                _graph_drop(connection, path, before is not None)
                connection.execute(
                    "INSERT INTO files (path, lang, status, note) VALUES (?, ?, ?, ?)",
                    (path, lang, status, str(getattr(err, "strerror", None) or err)[:200]))
                continue
            report.read += 1
            hashed = time.time_ns()
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            if not full and before is not None and before[3] == digest and \
                    before[4] in ("indexed", "binary"):
                connection.execute("UPDATE files SET size = ?, mtime_ns = ?, hashed_ns = ? "
                                   "WHERE path = ?", (info.st_size, info.st_mtime_ns, hashed,
                                                      path))
                continue
            _graph_drop(connection, path, before is not None)
            text, note = graph_decode(data)
            if text is None:
                report.skipped["binary"] = report.skipped.get("binary", 0) + 1
                connection.execute(
                    "INSERT INTO files (path, lang, status, note, size, mtime_ns, hashed_ns, "
                    "hash) VALUES (?, ?, 'binary', ?, ?, ?, ?, ?)",
                    (path, lang, note, info.st_size, info.st_mtime_ns, hashed, digest))
                continue
            facts = graph_extract(path, text, lang)
            note = "; ".join(part for part in (note, facts.note) if part)
            connection.execute(
                "INSERT INTO files (path, lang, status, note, size, mtime_ns, hashed_ns, hash, "
                "lines, module) VALUES (?, ?, 'indexed', ?, ?, ?, ?, ?, ?, ?)",
                (path, lang, note or None, info.st_size, info.st_mtime_ns, hashed, digest,
                 graph_line_count(text), facts.module))
            _graph_insert_facts(connection, path, facts)
            extracted.append(path)
        if remove_missing:
            listed = set(paths)
            for path in known:
                if path not in listed:
                    _graph_drop(connection, path)
                    report.removed += 1
            changed_set = changed_set or bool(report.removed)
        report.extracted = len(extracted)
        for name, definition in _GRAPH_INDEXES:
            connection.execute("CREATE INDEX IF NOT EXISTS %s ON %s" % (name, definition))
        if base_rows is not None:
            own = connection.execute(
                "SELECT path, lang, module FROM files WHERE status = 'indexed'").fetchall()
            mine = {row[0] for row in own}
            graph_resolve_imports(connection, None, [row for row in base_rows
                                                     if row[0] not in mine] + own)
        else:
            graph_resolve_imports(connection, None if changed_set else extracted)
        connection.execute("INSERT OR REPLACE INTO meta VALUES ('indexed_at', ?)",
                           (format_timestamp(utc_now()),))
        connection.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):
            connection.execute("ROLLBACK")
        raise
    report.symbols = connection.execute("SELECT count(*) FROM symbols").fetchone()[0]
    return report


def _graph_begin(connection):
    """Start a write transaction, waiting (sqlite's timeout) for another writer."""
    import sqlite3             # kept off every command's start-up
    try:
        connection.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as err:
        raise GraphUnavailable("the repository graph is being written by another process "
                               "(%s)" % err, "try again in a moment") from err


def _graph_drop(connection, path, known=True):
    if not known:
        return                  # nothing of it is stored (a full build's empty database)
    for table in _GRAPH_TABLES:
        connection.execute("DELETE FROM %s WHERE path = ?" % table, (path,))


_GRAPH_CAMEL = LazyPattern(r"([a-z0-9])([A-Z])|([A-Za-z])([0-9])")
_GRAPH_ACRONYM = LazyPattern(r"([A-Z]+)([A-Z][a-z])")
_GRAPH_NOT_WORD = LazyPattern(r"[^A-Za-z0-9]+")


def _graph_space(match):
    return "%s %s" % ((match.group(1), match.group(2)) if match.group(1) else
                      (match.group(3), match.group(4)))


def _graph_words(name):
    """A name split into its lower-case words, each after a space: readState and
    read_state give " read state", item12 " item 12" (a word prefix is then found as
    " re")."""
    if name.isalpha() and name.islower():
        return " " + name
    spaced = _GRAPH_ACRONYM.sub(r"\1 \2", _GRAPH_CAMEL.sub(_graph_space, name))
    return "".join(" " + word for word in _GRAPH_NOT_WORD.split(spaced.lower()) if word)


def _graph_insert_facts(connection, path, facts):
    connection.executemany(
        "INSERT INTO symbols (path, name, lname, words, qualname, lqual, kind, line, end_line, "
        "signature) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(path, name, name.lower(), _graph_words(name), qual, qual.lower(), kind, line, end,
          signature) for name, qual, kind, line, end, signature in facts.symbols])
    connection.executemany(
        "INSERT INTO imports (path, line, spec, keys) VALUES (?, ?, ?, ?)",
        [(path, line, spec[:500], keys[:1000]) for line, spec, keys in facts.imports])
    connection.executemany(
        "INSERT INTO calls (path, line, name, caller) VALUES (?, ?, ?, ?)",
        [(path, line, name, caller) for line, name, caller in facts.calls])


# -- which file an import names ---------------------------------------------------------------

class _GraphResolver:
    """The files of the graph, looked up the ways imports name them."""

    JS_EXTENSIONS = ("", ".ts", ".tsx", ".d.ts", ".js", ".jsx", ".mjs", ".cjs", ".mts",
                     ".cts", "/index.ts", "/index.tsx", "/index.js", "/index.jsx",
                     "/index.mjs")

    def __init__(self, rows):
        self.paths = set()
        self.modules = {}            # python dotted suffix -> [paths]
        self.folders = {}            # folder suffix -> folder (go, java)
        self.names = {}              # file name -> [paths]
        for path, lang, module in rows:
            self.paths.add(path)
            self.names.setdefault(path.rsplit("/", 1)[-1], []).append(path)
            if lang == "python" and module:
                parts = module.split(".")
                for start in range(len(parts)):
                    self.modules.setdefault(".".join(parts[start:]), []).append(path)
            if lang in ("go", "java"):
                folder = path.rsplit("/", 1)[0] if "/" in path else ""
                parts = folder.split("/") if folder else []
                for start in range(len(parts)):
                    self.folders.setdefault("/".join(parts[start:]), folder)

    @staticmethod
    def _closest(importer, candidates):
        """The candidate sharing the longest folder prefix with the importer."""
        if not candidates:
            return None
        return min(candidates, key=lambda path: (-len(os.path.commonprefix([path, importer])),
                                                 len(path), path))

    def resolve(self, importer, lang, keys):
        if lang == "python":
            for key in keys.split("|"):
                found = self._closest(importer, self.modules.get(key))
                if key and found:
                    return found
            return None
        folder = importer.rsplit("/", 1)[0] if "/" in importer else ""
        if lang in ("javascript", "typescript"):
            if not keys.startswith("."):
                return None
            base = os.path.normpath(os.path.join(folder, keys)).replace(os.sep, "/")
            if base.startswith(".."):
                return None
            return next((base + ext for ext in self.JS_EXTENSIONS if base + ext in self.paths),
                        None)
        if lang == "go":
            parts = keys.split("/")
            for start in range(len(parts)):
                found = self.folders.get("/".join(parts[start:]))
                if found is not None and found:
                    return found + "/"
            return None
        if lang == "java":
            dotted = keys[:-2] if keys.endswith(".*") else keys
            if keys.endswith(".*"):
                found = self.folders.get(dotted.replace(".", "/"))
                return found + "/" if found else None
            return self._by_suffix(importer, dotted.replace(".", "/") + ".java")
        if lang == "rust":
            return self._rust(importer, folder, keys)
        if lang in ("c", "cpp"):
            kind, _, name = keys.partition(":")
            if kind == "local":
                near = os.path.normpath(os.path.join(folder, name)).replace(os.sep, "/")
                if near in self.paths:
                    return near
            return self._by_suffix(importer, name)
        return None

    def _by_suffix(self, importer, suffix):
        suffix = suffix.lstrip("/")
        candidates = [path for path in self.names.get(suffix.rsplit("/", 1)[-1], ())
                      if path == suffix or path.endswith("/" + suffix)]
        return self._closest(importer, candidates)

    def _rust(self, importer, folder, keys):
        kind, _, rest = keys.partition(":")
        stem = importer.rsplit("/", 1)[-1][:-3]
        if kind == "mod":
            here = folder if stem in ("mod", "lib", "main") else \
                (folder + "/" if folder else "") + stem
            for candidate in ("%s/%s.rs" % (here, rest), "%s/%s/mod.rs" % (here, rest)):
                candidate = candidate.lstrip("/")
                if candidate in self.paths:
                    return candidate
            return None
        if kind != "use":
            return None
        parts = [part for part in rest.split("::") if part]
        if not parts or parts[0] not in ("crate", "self", "super"):
            return None
        if parts[0] == "crate":
            top = importer.split("/src/")[0] + "/src" if "/src/" in importer else \
                ("src" if importer.startswith("src/") else folder)
        else:
            top = folder if parts[0] == "self" else folder.rsplit("/", 1)[0] if "/" in folder \
                else ""
        parts = parts[1:]
        for cut in range(len(parts), 0, -1):
            joined = "/".join(parts[:cut])
            for candidate in ("%s/%s.rs" % (top, joined), "%s/%s/mod.rs" % (top, joined)):
                candidate = candidate.lstrip("/")
                if candidate in self.paths:
                    return candidate
        return None


def graph_resolve_imports(connection, paths=None, resolver_rows=None):
    """Fill in the file each import names (None: external or unknown), for the imports
    of ``paths``, or of every file when the set of files changed (``paths`` None)."""
    rows = resolver_rows if resolver_rows is not None else connection.execute(
        "SELECT path, lang, module FROM files WHERE status = 'indexed'").fetchall()
    resolver = _GraphResolver(rows)
    langs = {path: lang for path, lang, _ in rows}
    if paths is None:
        imports = connection.execute("SELECT rowid, path, keys FROM imports").fetchall()
    else:
        imports = []
        for path in paths:
            imports.extend(connection.execute(
                "SELECT rowid, path, keys FROM imports WHERE path = ?", (path,)).fetchall())
    updates = []
    for rowid, path, keys in imports:
        target = resolver.resolve(path, langs.get(path, ""), keys) if keys else None
        updates.append((target, rowid))
    connection.executemany("UPDATE imports SET target = ? WHERE rowid = ?", updates)


# -- keeping the graph up to date ------------------------------------------------------------

def graph_index(store, full=False):
    """Index the project's files into the shared graph (``full``: from scratch).
    Returns the GraphIndexReport."""
    started = time.monotonic()
    path = graph_db_path(store)
    if full:
        graph_remove_database(path)
    paths, left_out, how = graph_listing(store.root)
    connection = graph_connect(path)
    try:
        report = graph_index_files(connection, store.root, paths, full=full)
    finally:
        connection.close()
    report.left_out, report.listing = left_out, how
    report.seconds = round(time.monotonic() - started, 3)
    _graph_forget_ended_overlays(store)
    with _GRAPH_REFRESH_LOCK:
        _GRAPH_REFRESHED[path] = time.monotonic()
    return report


def graph_index_before_task(store):
    """Bring the shared graph up to date where a task starts, so its agents' first
    repository_graph_* call does not wait for the indexing: as a query would (a graph
    never built is built only in a project of at most GRAPH_AUTO_BUILD_FILES files).
    Never raises: a graph that cannot be indexed now is indexed by the first query,
    which says why not."""
    try:
        if not os.path.isfile(graph_db_path(store)):
            paths, _, _ = graph_listing(store.root)
            if len(paths) > GRAPH_AUTO_BUILD_FILES:
                return None
        return graph_index(store)
    except (FerrusError, OSError) as err:
        log.info("the repository graph was not indexed before the task: %s",
                 getattr(err, "message", err))
    except Exception as err:          # sqlite3.Error and the like
        log.info("the repository graph was not indexed before the task: %s", err)
    return None


def _graph_forget_ended_overlays(store):
    """Overlays of tasks that ended or left the queue go: the task's work is merged into
    the shared graph's tree, or gone."""
    folder = store.path(GRAPH_DIR, GRAPH_OVERLAY_DIR)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    live = set(queued_task_ids(store))
    for name in names:
        task = name[:-3] if name.endswith(".db") else None
        if task is None:
            continue
        record, problem = load_task_record(store.dir, task) if task in live else ({}, None)
        if task not in live or (not problem and record.get("status") in ENDED_STATUSES):
            graph_remove_database(os.path.join(folder, name))


def graph_task_worktree(store):
    """The worktree folder a task store's code is in, when it is not the checkout."""
    if store.task is None:
        return None
    try:
        workdir = store.workdir
    except FerrusError:
        return None
    if os.path.normcase(os.path.abspath(workdir)) == os.path.normcase(store.root):
        return None
    return workdir if os.path.isdir(workdir) else None


def graph_refresh_overlay(store, base_connection):
    """Index a parallel task's changes (its diff: base → worktree) into its overlay,
    over the shared graph ``base_connection`` holds.  Returns (overlay path, report)."""
    workdir = graph_task_worktree(store)
    data = store.read_state()
    diff = task_diff(task_git_site(store), data.task_base, task_diff_exclusions(store),
                     patch=False)
    present, gone = [], set()
    for changed in diff.files:
        if changed.old_path:
            gone.add(changed.old_path)
        if os.path.lexists(os.path.join(workdir, *changed.path.split("/"))):
            present.append(changed.path)
        else:
            gone.add(changed.path)
    gone -= set(present)
    path = graph_overlay_path(store, store.task)
    connection = graph_connect(path)
    try:
        base_rows = base_connection.execute(
            "SELECT path, lang, module FROM files WHERE status = 'indexed'").fetchall()
        base_rows = [row for row in base_rows if row[0] not in gone]
        report = graph_index_files(connection, workdir, sorted(present), base_rows=base_rows)
        _graph_begin(connection)
        connection.execute("DELETE FROM gone")
        connection.executemany("INSERT INTO gone (path) VALUES (?)", [(p,) for p in gone])
        connection.execute("INSERT OR REPLACE INTO meta VALUES ('worktree', ?)", (workdir,))
        connection.execute("COMMIT")
    finally:
        connection.close()
    return path, report


# {database path: monotonic time of its last refresh in this process}
_GRAPH_REFRESHED = {}
_GRAPH_REFRESH_LOCK = threading.Lock()


def _graph_due(path, clock=time.monotonic):
    with _GRAPH_REFRESH_LOCK:
        last = _GRAPH_REFRESHED.get(path)
        if last is not None and clock() - last < GRAPH_REFRESH_SECS:
            return False
        _GRAPH_REFRESHED[path] = clock()
        return True


class GraphView:
    """The graph as one task sees it: the shared graph, with the task's overlay laid
    over it when it works in a worktree.  Queries read the g_* views."""

    def __init__(self, store, connection, overlay=None, notes=()):
        self.store = store
        self.connection = connection
        self.overlay = overlay
        self.notes = list(notes)
        hidden = "(SELECT path FROM overlay.files UNION SELECT path FROM overlay.gone)"
        for table in ("files", "symbols", "imports", "calls"):
            if overlay:
                sql = ("CREATE TEMP VIEW g_%s AS SELECT * FROM main.%s WHERE path NOT IN %s "
                       "UNION ALL SELECT * FROM overlay.%s" % (table, table, hidden, table))
            else:
                sql = "CREATE TEMP VIEW g_%s AS SELECT * FROM main.%s" % (table, table)
            connection.execute(sql)

    def close(self):
        self.connection.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def workdir(self):
        """Where the files the view shows are on disk."""
        return graph_task_worktree(self.store) if self.overlay else self.store.root

    def rows(self, sql, params=()):
        return self.connection.execute(sql, params).fetchall()


def graph_open(store, refresh=True):
    """The GraphView for ``store`` (a task's store gets its overlay), after an
    incremental refresh of what it reads (``refresh``; at most every
    GRAPH_REFRESH_SECS per process).  A graph never built is built first when the
    project has at most GRAPH_AUTO_BUILD_FILES files, else FerrusError says how."""
    path = graph_db_path(store)
    notes = []
    if not os.path.isfile(path):
        paths, _, _ = graph_listing(store.root)
        if len(paths) > GRAPH_AUTO_BUILD_FILES:
            raise FerrusError("the repository graph is not built yet, and this project has "
                              "%d files" % len(paths),
                              "run `ferrus graph index` once in the project (later queries "
                              "keep it up to date)")
        graph_index(store)
    elif refresh and _graph_due(path):
        try:
            graph_index(store)
        except GraphUnavailable as err:
            notes.append("the graph was not refreshed: %s" % err.message)
    connection = graph_connect(path)
    overlay = None
    try:
        if graph_task_worktree(store):
            overlay = graph_overlay_path(store, store.task)
            try:
                if not refresh or not _graph_due(overlay):
                    if not os.path.isfile(overlay):
                        graph_refresh_overlay(store, connection)
                else:
                    graph_refresh_overlay(store, connection)
            except (GitUnavailable, GitError, GraphUnavailable) as err:
                notes.append("task %s's changes are not laid over the graph: %s"
                             % (store.task, err.message))
                overlay = None if not os.path.isfile(overlay) else overlay
            if overlay:
                connection.execute("ATTACH DATABASE ? AS overlay", (overlay,))
        return GraphView(store, connection, overlay, notes)
    except BaseException:
        connection.close()
        raise


# -- queries ------------------------------------------------------------------------------------

_GRAPH_RANK_SQL = "CASE kind %s ELSE 5 END" % " ".join(
    "WHEN '%s' THEN %d" % item for item in sorted(GRAPH_KIND_RANK.items()))
_GRAPH_SYMBOL_COLUMNS = "path, line, name, qualname, kind, signature, end_line"


def _graph_like(text):
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _graph_symbol(row, match):
    path, line, name, qual, kind, signature, end = row
    return {"path": path, "line": line, "end_line": end, "name": name, "qualname": qual,
            "kind": kind, "signature": signature or "", "match": match,
            "location": "%s:%d" % (path, line)}


def graph_search(view, query, kind=None, path=None, limit=GRAPH_PAGE_DEFAULT, offset=0):
    """(hits, more) for ``query``: a name, a qualified name (Class.method, Type::fn), a
    path, or words ("read state").  Best first: the exact name, the exact qualified name,
    the name in any case, a qualified name ending so, a name starting so, a name holding
    it, every word at the start of a word of the name; a path (or its end) after those,
    or first when the query holds a "/".  Ties: classes and types before functions
    before variables, shorter names first, then path and line."""
    text = query.strip()
    lower = text.lower()
    qual = re.sub(r"::|->|#", ".", lower)
    where, params = [], []
    if kind:
        where.append("kind = ?")
        params.append(kind)
    if path:
        folder = path.strip("/")
        where.append("(path = ? OR substr(path, 1, ?) = ?)")
        params += [folder, len(folder) + 1, folder + "/"]
    extra = "".join(" AND " + clause for clause in where)
    need = offset + limit + 1
    tiers = [("exact", "lname = ? AND name = ?", [lower, text]),
             ("qualified", "lqual = ?", [qual]), ("name", "lname = ?", [lower])]
    if "." in qual:
        # Store.read_state also finds pkg.Store.read_state: its last part is the name.
        tiers.append(("qualified-suffix", "lname = ? AND lqual LIKE ? ESCAPE '\\'",
                      [qual.rsplit(".", 1)[-1], "%." + _graph_like(qual)]))
    tiers.append(("prefix", "lname >= ? AND lname < ?", [lower, lower + "\U0010ffff"]))
    # The tiers above use an index; the substring and the words tiers are read in one
    # scan of the definitions (the scan is what a search costs at 100,000 of them).
    scan, scan_args = "instr(lname, ?) > 0", [lower]
    words = re.findall(r"[a-z0-9]+", _graph_split_query(text))
    if len(words) > 1:
        scan = "%s OR (%s)" % (scan, " AND ".join(["instr(words, ?) > 0"] * len(words)))
        scan_args += [" " + word for word in words]
    tiers.append((None, scan, scan_args))
    path_first = "/" in text
    hits, seen = [], set()
    if path_first:
        _graph_path_hits(view, text, path, need, hits, seen)
    for name, condition, args in tiers:
        if len(hits) >= need or not lower:
            break
        for row in view.rows(
                "SELECT %s, instr(lname, ?) > 0 FROM g_symbols WHERE (%s)%s ORDER BY "
                "instr(lname, ?) = 0, %s, length(name), path, line LIMIT ?" % (
                    _GRAPH_SYMBOL_COLUMNS, condition, extra, _GRAPH_RANK_SQL),
                [lower] + args + params + [lower, need]):
            key = (row[0], row[1], row[3])
            if key not in seen:
                seen.add(key)
                hits.append(_graph_symbol(row[:-1], name or (
                    "substring" if row[-1] else "words")))
    if not path_first and len(hits) < need and not kind and \
            ("." in text or "/" in text):
        _graph_path_hits(view, text, path, need, hits, seen)
    return hits[offset:offset + limit], len(hits) > offset + limit


def _graph_split_query(text):
    return _graph_words(text)


def _graph_path_hits(view, text, within, need, hits, seen):
    needle = text.strip().lstrip("./").lower()
    if not needle:
        return
    rows = view.rows("SELECT path, lang, status FROM g_files WHERE path = ? UNION ALL "
                     "SELECT path, lang, status FROM g_files WHERE instr(lower(path), ?) > 0 "
                     "AND path != ? ORDER BY 1 LIMIT ?", (needle, needle, needle, need * 4))
    ranked = sorted(rows, key=lambda row: (row[0] != needle, not row[0].lower().endswith(
        "/" + needle), len(row[0]), row[0]))
    for path, lang, status in ranked:
        if within and not (path == within.strip("/") or
                           path.startswith(within.strip("/") + "/")):
            continue
        if len(hits) >= need:
            return
        key = (path, 1, None)
        if key not in seen:
            seen.add(key)
            hits.append({"path": path, "line": 1, "end_line": None,
                         "name": path.rsplit("/", 1)[-1], "qualname": path, "kind": "file",
                         "signature": "%s file%s" % (lang or "other",
                                                     "" if status in ("indexed", "listed")
                                                     else " (%s)" % status),
                         "match": "path", "location": "%s:1" % path})


def graph_file(view, path):
    rows = view.rows("SELECT path, lang, status, note, size, lines FROM g_files WHERE path = ?",
                     (path,))
    if not rows:
        return None
    path, lang, status, note, size, lines = rows[0]
    return {"path": path, "lang": lang or "other", "status": status, "note": note or "",
            "size": size, "lines": lines}


def graph_resolve_target(view, target):
    """(file path, symbol name or None) that ``target`` names: PATH, PATH:SYMBOL (the last
    colon that leaves a known path), or a bare symbol name (its best definitions' files
    are looked at by the caller).  A path typed with ./ or a Windows separator is
    normalised."""
    text = target.strip().replace("\\", "/")
    while text.startswith("./"):
        text = text[2:]
    if graph_file(view, text.rstrip("/")):
        return text.rstrip("/"), None
    cut = text.rfind(":")
    while cut > 0:
        if graph_file(view, text[:cut]):
            return text[:cut], text[cut + 1:].strip() or None
        cut = text.rfind(":", 0, cut)
    return None, text


def graph_definitions(view, path, symbol):
    """The definitions in ``path`` that ``symbol`` names (qualified name first)."""
    lower = re.sub(r"::|->|#", ".", symbol.lower())
    rows = view.rows("SELECT %s FROM g_symbols WHERE path = ? AND (lqual = ? OR lname = ? "
                     "OR lqual LIKE ? ESCAPE '\\') ORDER BY lqual != ?, line LIMIT 20"
                     % _GRAPH_SYMBOL_COLUMNS,
                     (path, lower, lower, "%." + _graph_like(lower), lower))
    return [_graph_symbol(row, "definition") for row in rows]


def graph_outline(view, path):
    return [_graph_symbol(row, "definition") for row in view.rows(
        "SELECT %s FROM g_symbols WHERE path = ? ORDER BY line, qualname"
        % _GRAPH_SYMBOL_COLUMNS, (path,))]


def graph_imports_of(view, path):
    return [{"path": path, "line": line, "spec": spec, "target": target,
             "location": "%s:%d" % (path, line)}
            for line, spec, target in view.rows(
                "SELECT line, spec, target FROM g_imports WHERE path = ? ORDER BY line, spec",
                (path,))]


def graph_importers_of(view, path):
    folder = path.rsplit("/", 1)[0] + "/" if "/" in path else "/"
    return [{"path": importer, "line": line, "spec": spec, "target": target,
             "location": "%s:%d" % (importer, line)}
            for importer, line, spec, target in view.rows(
                "SELECT path, line, spec, target FROM g_imports WHERE (target = ? OR target = ?) "
                "AND path != ? ORDER BY path, line", (path, folder, path))]


def graph_callers_of(view, names, path=None, importers=(), limit=2000):
    """Call sites of ``names`` outside ``path`` (the files in ``importers`` first): by
    name only — a call of another ``read`` is one too."""
    names = sorted(set(names))
    rows = []
    for start in range(0, len(names), 400):
        chunk = names[start:start + 400]
        rows += view.rows("SELECT path, line, name, caller FROM g_calls WHERE name IN (%s)%s "
                          "ORDER BY path, line LIMIT ?" % (
                              ", ".join("?" * len(chunk)), " AND path != ?" if path else ""),
                          chunk + ([path] if path else []) + [limit])
    importers = set(importers)
    rows.sort(key=lambda row: (row[0] not in importers, row[0], row[1]))
    return [{"path": where, "line": line, "name": name, "caller": caller,
             "location": "%s:%d" % (where, line)} for where, line, name, caller in rows[:limit]]


def graph_calls_from(view, path, qualname):
    return [{"path": path, "line": line, "name": name, "caller": qualname,
             "location": "%s:%d" % (path, line)}
            for line, name in view.rows(
                "SELECT line, name FROM g_calls WHERE path = ? AND caller = ? ORDER BY line",
                (path, qualname))]


def _graph_called_names(outline):
    """The names in a file others would call it by (not variables, not dunders)."""
    return [item["name"] for item in outline
            if item["kind"] not in ("variable", "constant", "module", "impl")
            and not (item["name"].startswith("__") and item["name"].endswith("__"))
            and len(item["name"]) > 2]


def graph_excerpt(view, path, line, end_line, before=0):
    """The lines [line - before, end_line] of ``path`` as it is on disk now, at most
    GRAPH_EXCERPT_LINES of them ("" when it cannot be read)."""
    try:
        with open_inside(view.workdir, *path.split("/")) as handle:
            data = handle.read(GRAPH_MAX_FILE_BYTES + 1)
    except (OSError, UnsafePath):
        return ""
    text, _ = graph_decode(data)
    if text is None:
        return ""
    lines = text.split("\n")
    first = max(1, line - before)
    last = min(len(lines), max(end_line or line, line), first + GRAPH_EXCERPT_LINES - 1)
    return "\n".join("%5d  %s" % (number, lines[number - 1][:GRAPH_LINE_CHARS])
                     for number in range(first, last + 1))


def graph_status(view):
    """Counts and times of what the view holds."""
    counts = dict(view.rows("SELECT status, count(*) FROM g_files GROUP BY status"))
    langs = dict(view.rows("SELECT lang, count(*) FROM g_files WHERE status = 'indexed' "
                           "GROUP BY lang"))
    meta = dict(view.rows("SELECT key, value FROM main.meta"))
    status = {"built": True, "database": view.store.relpath(graph_db_path(view.store)),
              "indexed_at": meta.get("indexed_at"),
              "files": sum(counts.values()), "files_by_status": counts,
              "languages": langs,
              "symbols": view.rows("SELECT count(*) FROM g_symbols")[0][0],
              "imports": view.rows("SELECT count(*) FROM g_imports")[0][0],
              "calls": view.rows("SELECT count(*) FROM g_calls")[0][0],
              "overlay": None, "notes": view.notes}
    if view.overlay:
        status["overlay"] = {
            "task": view.store.task, "worktree": view.workdir,
            "files": view.rows("SELECT count(*) FROM overlay.files")[0][0],
            "gone": view.rows("SELECT count(*) FROM overlay.gone")[0][0]}
    return status


# -- operations (CLI, MCP) ----------------------------------------------------------------------

def graph_page_bounds(limit, offset, default, names=("limit", "offset")):
    """(limit, offset) of a paged query: ``limit`` 1..GRAPH_PAGE_MAX (default ``default``),
    ``offset`` from 0; FerrusError for what is not, naming it as ``names`` (the CLI's
    -n and --offset)."""
    limit = default if limit is None else limit
    offset = 0 if offset is None else offset
    for name, value, low in ((names[0], limit, 1), (names[1], offset, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise FerrusError("%s must be a whole number of at least %d, not %r"
                              % (name, low, value), "leave it out for the default")
    return min(limit, GRAPH_PAGE_MAX), offset


def _graph_line(item):
    relation = item.get("relation") or "defines"
    if relation in ("defines", "definition"):
        line = "%s  %s  %s" % (item["location"], item["kind"], item["qualname"])
        if item.get("signature") and item["kind"] != "file":
            line += "  — " + item["signature"]
        return line
    if relation == "imports":
        return "%s  imports %s → %s" % (item["location"], item["spec"],
                                         item.get("target") or "(outside the project)")
    if relation == "imported_by":
        return "%s  imports it (%s)" % (item["location"], item["spec"])
    if relation == "calls":
        return "%s  calls %s" % (item["location"], item["name"])
    return "%s  calls %s%s" % (item["location"], item["name"],
                               "  (in %s)" % item["caller"] if item.get("caller") else "")


_GRAPH_HEADINGS = {"defines": "Definitions:", "imports": "Imports:",
                   "imported_by": "Imported by:", "called_from": "Called from:",
                   "calls": "Calls:"}


def _graph_render(head, items, offset, more, notes=(), sections=True):
    """(text, the items that fit, next offset or None): ``items`` one line each under
    their section headings, cut at GRAPH_ANSWER_CHARS; a last line says how to read on."""
    lines = [head] if head else []
    size = len(head)
    shown = []
    section = None
    for item in items:
        line = _graph_line(item)
        heading = _GRAPH_HEADINGS.get(item.get("relation") or "defines") if sections else None
        add = len(line) + 3 + (len(heading) + 1 if heading and heading != section else 0)
        if shown and size + add > GRAPH_ANSWER_CHARS:
            more = True
            break
        if heading and heading != section:
            lines.append(heading)
            section = heading
        lines.append("  " + line if sections else line)
        size += add
        shown.append(item)
    following = offset + len(shown) if more else None
    if following is not None:
        lines.append("[ferrus: there is more; call again with offset=%d]" % following)
    lines += ["note: %s" % note for note in notes]
    return "\n".join(lines), shown, following


def op_graph_index(store, caller, full=False):
    """`ferrus graph index`: bring the shared graph up to date (``full``: rebuild it),
    and the overlay of ``store``'s task when it works in a worktree."""
    store.require()
    report = graph_index(store, full=full)
    skipped = _graph_skipped(report.skipped)
    text = ("Indexed %d files in %.2f s (%d read, %d extracted, %d removed): %d "
            "definitions." % (report.files, report.seconds, report.read, report.extracted,
                              report.removed, report.symbols))
    if skipped:
        text += " Skipped: %s." % skipped
    if report.left_out:
        text += " %d more files were left out (at most %d are indexed)." % (
            report.left_out, GRAPH_MAX_FILES)
    data = {"report": report.to_json(), "overlay": None}
    if graph_task_worktree(store):
        connection = graph_connect(graph_db_path(store))
        try:
            _, overlay = graph_refresh_overlay(store, connection)
        finally:
            connection.close()
        data["overlay"] = overlay.to_json()
        text += " Task %s's worktree: %d changed files laid over it." % (store.task,
                                                                         overlay.files)
    return Outcome(text, data)


_GRAPH_SKIP_WORDS = {"binary": ("binary", "binary"),
                     "huge": ("over the size limit", "over the size limit"),
                     "outside": ("link out of the tree", "links out of the tree"),
                     "link": ("symbolic link", "symbolic links"),
                     "special": ("special file", "special files"),
                     "unreadable": ("unreadable", "unreadable")}


def _graph_skipped(counts):
    """``3 binary, 1 link out of the tree`` of {status: count}."""
    return ", ".join("%d %s" % (count, _GRAPH_SKIP_WORDS.get(status, (status, status))[
        count != 1]) for status, count in sorted(counts.items()))


def op_graph_status(store, caller):
    """`ferrus graph status` and repository_graph_status: what the graph holds."""
    store.require()
    import_sqlite3("the repository graph")        # said first: no graph can be built without
    if not os.path.isfile(graph_db_path(store)):
        text = ("The repository graph is not built yet: `ferrus graph index` builds it (a "
                "query builds it by itself in a project of at most %d files)."
                % GRAPH_AUTO_BUILD_FILES)
        return Outcome(text, {"built": False, "database": store.relpath(graph_db_path(store)),
                              "indexed_at": None, "files": 0, "files_by_status": {},
                              "languages": {}, "symbols": 0, "imports": 0, "calls": 0,
                              "overlay": None, "notes": []})
    with graph_open(store, refresh=False) as view:
        status = graph_status(view)
    skipped = {key: value for key, value in status["files_by_status"].items()
               if key not in ("indexed", "listed")}
    text = ("Repository graph (%s), indexed %s: %d files (%d read for definitions%s), %d "
            "definitions, %d imports, %d calls." % (
                status["database"], status["indexed_at"] or "?", status["files"],
                status["files_by_status"].get("indexed", 0),
                "; skipped: " + _graph_skipped(skipped) if skipped else "", status["symbols"], status["imports"], status["calls"]))
    if status["languages"]:
        text += "\nLanguages: " + ", ".join("%s %d" % item for item in
                                            sorted(status["languages"].items()) if item[0])
    if status["overlay"]:
        text += ("\nTask %s: its worktree's %d changed files (and %d it deleted) are laid "
                 "over the shared graph." % (status["overlay"]["task"],
                                             status["overlay"]["files"],
                                             status["overlay"]["gone"]))
    text += "".join("\nnote: %s" % note for note in status["notes"])
    return Outcome(text, status)


def _graph_text_argument(value, name, limit=1000):
    if not isinstance(value, str) or not value.strip():
        raise FerrusError("%s must be non-empty text" % name,
                          "pass a name, a qualified name (Class.method) or a path")
    if len(value) > limit:
        raise FerrusError("%s is %d characters long; at most %d are taken" % (
            name, len(value), limit), "pass a shorter %s" % name)
    return value


def op_graph_search(store, caller, query, kind=None, path=None, limit=None, offset=None):
    """`ferrus graph search` and repository_graph_search: definitions by name, qualified
    name, words or path, best first (see graph_search), with file:line."""
    _graph_text_argument(query, "query")
    for name, value in (("kind", kind), ("path", path)):
        if value is not None:
            _graph_text_argument(value, name, 500)
    limit, offset = graph_page_bounds(limit, offset, GRAPH_PAGE_DEFAULT)
    store.require()
    with graph_open(store) as view:
        hits, more = graph_search(view, query, kind and kind.strip(),
                                  path and path.strip().replace("\\", "/"), limit, offset)
        notes = view.notes
    if not hits:
        text = "No definition or file matches %r%s." % (query.strip(), "" if not offset
                                                        else " past offset %d" % offset)
        return Outcome(text + "".join("\nnote: %s" % n for n in notes),
                       {"query": query, "hits": [], "offset": offset, "next_offset": None,
                        "notes": notes})
    text, shown, following = _graph_render("", hits, offset, more, notes, sections=False)
    return Outcome(text, {"query": query, "hits": shown, "offset": offset,
                          "next_offset": following, "notes": notes})


def _graph_named(view, target):
    """(path, symbol, definitions) for a target: a file, a definition in a file, or a
    bare name (its best definitions anywhere); FerrusError when it names nothing."""
    path, symbol = graph_resolve_target(view, target)
    if path is not None and symbol is None:
        return path, None, []
    if path is not None:
        found = graph_definitions(view, path, symbol)
        if not found:
            raise FerrusError("%s defines no %s" % (path, symbol),
                              "`ferrus graph show %s` lists what it defines" % path)
        return path, symbol, found
    hits, _ = graph_search(view, symbol, limit=10)
    found = [hit for hit in hits if hit["match"] in ("exact", "qualified", "name",
                                                       "qualified-suffix")]
    if not found:
        raise FerrusError("no file or definition is named %s" % target.strip(),
                          "`ferrus graph search %s` finds near matches" % target.strip())
    paths = {hit["path"] for hit in found}
    return (found[0]["path"] if len(paths) == 1 else None), symbol, found


def op_graph_show(store, caller, target, limit=None, offset=None):
    """`ferrus graph show PATH[:SYMBOL]`: a file's definitions (outline) and imports, or a
    definition with its source lines and the calls it makes."""
    _graph_text_argument(target, "target")
    limit, offset = graph_page_bounds(limit, offset, GRAPH_PAGE_MAX)
    store.require()
    with graph_open(store) as view:
        path, symbol, found = _graph_named(view, target)
        info = graph_file(view, path) if path else None
        notes = view.notes
        if symbol is None:
            items = graph_outline(view, path)
            if offset == 0:
                items += [dict(item, relation="imports") for item in graph_imports_of(view,
                                                                                      path)]
            head = "%s — %s, %s%s" % (path, info["lang"], "%d line%s" % (
                info["lines"], "" if info["lines"] == 1 else "s")
                                       if info["lines"] is not None else info["status"],
                                       " (%s)" % info["note"] if info["note"] else "")
            page = items[offset:offset + limit]
            text, shown, following = _graph_render(head, page, offset,
                                                   len(items) > offset + limit, notes)
            return Outcome(text, {"target": target, "file": info, "items": shown,
                                  "excerpt": "", "offset": offset, "next_offset": following,
                                  "notes": notes})
        first = found[0]
        excerpt = graph_excerpt(view, first["path"], first["line"], first["end_line"])
        items = list(found) + [dict(item, relation="calls") for item in
                               graph_calls_from(view, first["path"], first["qualname"])]
    page = items[offset:offset + limit]
    head = "%s%s" % (first["location"], "" if len(found) == 1 else
                     " (and %d more definitions of %s)" % (len(found) - 1, symbol))
    if excerpt and offset == 0:
        head += "\n" + excerpt
    text, shown, following = _graph_render(head, page, offset, len(items) > offset + limit,
                                           notes)
    return Outcome(text, {"target": target, "file": info, "items": shown,
                          "excerpt": excerpt if offset == 0 else "", "offset": offset,
                          "next_offset": following, "notes": notes})


def op_graph_context(store, caller, target, limit=None, offset=None):
    """`ferrus graph context` and repository_graph_context: a file's or a definition's
    neighbours — what it defines, what it imports, who imports it, who calls its
    names (files that import it first) — paged."""
    _graph_text_argument(target, "target")
    limit, offset = graph_page_bounds(limit, offset, 50)
    store.require()
    with graph_open(store) as view:
        path, symbol, found = _graph_named(view, target)
        info = graph_file(view, path) if path else None
        notes = view.notes
        if symbol is None:
            outline = graph_outline(view, path)
            importers = graph_importers_of(view, path)
            items = (outline + [dict(item, relation="imports")
                                for item in graph_imports_of(view, path)]
                     + [dict(item, relation="imported_by") for item in importers]
                     + [dict(item, relation="called_from") for item in graph_callers_of(
                         view, _graph_called_names(outline), path,
                         [item["path"] for item in importers])])
            head = "Context of %s (%s)" % (path, info["lang"])
        else:
            names = {item["name"] for item in found}
            own = {(item["path"], item["line"]) for item in found}
            importers = [item["path"] for definition in found
                         for item in graph_importers_of(view, definition["path"])]
            callers = [item for item in graph_callers_of(view, names, None, importers)
                       if (item["path"], item["line"]) not in own]
            items = (list(found)
                     + [dict(item, relation="calls") for definition in found[:1]
                        for item in graph_calls_from(view, definition["path"],
                                                     definition["qualname"])]
                     + [dict(item, relation="called_from") for item in callers])
            head = "Context of %s" % (found[0]["qualname"] if len(found) == 1 else symbol)
    page = items[offset:offset + limit]
    text, shown, following = _graph_render(head, page, offset, len(items) > offset + limit,
                                           notes)
    return Outcome(text, {"target": target, "file": info, "items": shown, "offset": offset,
                          "next_offset": following, "notes": notes})


# -- MCP tools ----------------------------------------------------------------------------------

_GRAPH_PAGE_PARAMS = (
    Param("limit", "integer", "Optional: how many items (default %d, at most %d)."
          % (GRAPH_PAGE_DEFAULT, GRAPH_PAGE_MAX), required=False),
    Param("offset", "integer", "Optional: where to go on from (the next_offset of the "
                               "previous answer).", required=False))
_GRAPH_PAGE_OUT = {"offset": "integer", "next_offset": "integer?", "notes": "array"}

GRAPH_TOOLS = (
    Tool("repository_graph_status", "Repository graph status",
         "What the repository graph knows: files by status and language, definitions, "
         "imports and calls, when it was indexed, and (for a task in its own worktree) the "
         "changed files laid over it. Read-only.", ROLES,
         lambda st, c: op_graph_status(st, c), (),
         {"built": "boolean", "database": "string", "indexed_at": "string?", "files": "integer",
          "files_by_status": "object", "languages": "object", "symbols": "integer",
          "imports": "integer", "calls": "integer", "overlay": "object?", "notes": "array"},
         read_only=True, idempotent=True),
    Tool("repository_graph_search", "Search the repository graph",
         "Find definitions by name (load_config), qualified name (Store.read_state, "
         "Config::new), words (\"read state\") or file path: ranked hits with file:line, "
         "kind and signature, best first. Use it before reading files to know where to "
         "look. Paged: pass next_offset as offset for more. Read-only.", ROLES,
         lambda st, c, query, kind=None, path=None, limit=None, offset=None: op_graph_search(
             st, c, query, kind, path, limit, offset),
         (Param("query", "string", "A name, Class.method, words or a path."),
          Param("kind", "string", "Optional: only this kind (class, function, method, "
                                  "struct, interface, trait, enum, type, module, macro, "
                                  "constant, variable).", required=False),
          Param("path", "string", "Optional: only under this folder or in this file "
                                  "(relative to the project).", required=False))
         + _GRAPH_PAGE_PARAMS,
         dict(_GRAPH_PAGE_OUT, query="string", hits="array"), read_only=True, idempotent=True),
    Tool("repository_graph_context", "Repository graph context",
         "The neighbours of a file or a definition: what it defines, what it imports, which "
         "files import it and where its names are called (by name: another definition of "
         "the same name counts too), each with file:line. Target: a path (src/app.py), a "
         "definition in it (src/app.py:Store.load) or a bare name. Paged like search. "
         "Read-only.", ROLES,
         lambda st, c, target, limit=None, offset=None: op_graph_context(st, c, target, limit,
                                                                         offset),
         (Param("target", "string", "A path, PATH:SYMBOL, or a name."),) + _GRAPH_PAGE_PARAMS,
         dict(_GRAPH_PAGE_OUT, target="string", file="object?", items="array"),
         read_only=True, idempotent=True),
)


# -- the command line ---------------------------------------------------------------------------

def _graph_cli_path(store, text):
    """A path typed in a shell (relative to where the user stands) as the graph names it,
    when it is a file or folder of the project; else the text as given."""
    full = os.path.abspath(text)
    if os.path.exists(full):
        relative = os.path.relpath(full, store.root)
        if relative != os.pardir and not relative.startswith(os.pardir + os.sep) and \
                not os.path.isabs(relative):
            return relative.replace(os.sep, "/")
    return text


def cmd_graph(args, root):
    store = Store(root).require()
    if getattr(args, "task", None):
        store = task_store_of(store, require_task_id(store, args.task))
    command = args.graph_command
    if command in ("search", "show", "context"):
        graph_page_bounds(args.n, args.offset, 1, names=("-n", "--offset"))
    if command == "index":
        outcome = op_graph_index(store, HUMAN, full=args.full)
    elif command == "status":
        outcome = op_graph_status(store, HUMAN)
    elif command == "search":
        path = _graph_cli_path(store, args.path) if args.path else None
        outcome = op_graph_search(store, HUMAN, " ".join(args.query), args.kind, path,
                                  args.n, args.offset)
    else:
        target = args.target
        head, colon, symbol = target.rpartition(":")
        if colon and head and not os.path.exists(target) and os.path.exists(head):
            target = "%s:%s" % (_graph_cli_path(store, head), symbol)
        else:
            target = _graph_cli_path(store, target)
        run = op_graph_show if command == "show" else op_graph_context
        outcome = run(store, HUMAN, target, args.n, args.offset)
    outcome.print(args.json)
    return 0


def add_graph_parser(sub):
    """`ferrus graph …` on the top-level subparsers."""
    p = sub.add_parser("graph", help="the repository graph: where things are defined, "
                                     "imported and called")
    commands = p.add_subparsers(dest="graph_command", metavar="COMMAND")
    commands.required = True
    c = commands.add_parser("index", help="bring .ferrus/graph/repo-graph.db up to date "
                                          "(only changed files are read again)")
    c.add_argument("--full", action="store_true",
                   help="rebuild it from scratch instead of incrementally")
    c.add_argument("--task", metavar="ID", help="also index this parallel task's worktree "
                                                "changes into its overlay")
    c.add_argument("--json", action="store_true", help="the report as one JSON object")
    c = commands.add_parser("status", help="what the graph holds and when it was indexed")
    c.add_argument("--task", metavar="ID", help="as this parallel task sees it (its overlay)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c = commands.add_parser("search", help="definitions by name, Class.method, words or path")
    c.add_argument("query", nargs="+", metavar="NAME", help="what to look for")
    c.add_argument("--kind", metavar="K", help="only definitions of this kind (class, "
                                                "function, method, struct, …)")
    c.add_argument("--path", metavar="P", help="only in this file or under this folder")
    for name, what in (("show", "a file's definitions and imports, or a definition with its "
                                "source lines and the calls it makes"),
                       ("context", "a file's or a definition's neighbours: what it defines "
                                   "and imports, who imports it, who calls its names")):
        d = commands.add_parser(name, help=what)
        d.add_argument("target", metavar="PATH[:SYMBOL]",
                       help="a file, a definition in it (src/app.py:Store.load) or a name")
    for c in commands.choices.values():
        if c.prog.split()[-1] in ("search", "show", "context"):
            c.add_argument("-n", type=int, default=None, metavar="N",
                           help="at most N items (default 20 for search, 50 for context, "
                                "100 for show; at most 100)")
            c.add_argument("--offset", type=int, default=None, metavar="K",
                           help="go on from item K (what the last line of a cut answer "
                                "says)")
            c.add_argument("--task", metavar="ID",
                           help="as this parallel task sees it: its worktree's changes laid "
                                "over the shared graph")
            c.add_argument("--json", action="store_true", help="the answer as one JSON object")
    p.set_defaults(run=cmd_graph)
