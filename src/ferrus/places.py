"""Places: where tasks run (here, ssh, an exec prefix) and the channel to them.

A place is ``[places.NAME]`` in ferrus.toml: ``ssh = [argv prefix ending with the host]``
or ``exec = [argv prefix that runs an argv there with stdio]`` (``docker exec -i NAME``,
``kubectl exec -i POD --``, ``runuser -u USER --``), how many tasks at once (``slots``),
where its clones and worktrees live there (``dir``) and its own ``[places.NAME.sandbox]``.
``here`` is this machine.

A Place is the channel to one.  Every call is one process: the prefix, then the place's
Python running a small boot program (given on the command line, base64, so the remote
shell parses nothing but safe characters) with one request (a JSON object, base64 too:
no task title, branch or path can reach a shell there, and no secret is ever in it —
task text and config go on stdin).  The boot program prints a marker line first, so a
call that never reached Python (ssh exit 255, a prefix that failed) is told from one that
did; the first is retried with backoff, as is a connection that drops mid-call (every
request is idempotent).  It then either runs an argv there (``run``), takes a copy of
ferrus (``install``: the files, checked against their content hash, into
``<dir>/ferrus-<hash>/``, once), or hands the request to that copy (place_side.py), which
answers.  A call made before ferrus is there gets exit 85 and installs it first.

Commits move as git packs over the same channel (``git pack-objects --thin`` piped into
``git index-pack --stdin --fix-thin`` at the other end, ``--strict`` when they come
back): no shared file system, no network share, nothing but the task's commits.
PlaceFollower follows a task there: its journal entries and its controller's messages
stream back, a dropped connection is reconnected with backoff from the last entry seen,
and its beats keep the task's lease at the place alive.
"""

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from .basics import FERRUS_FILE, FerrusError, format_duration, say, terminal_safe
from .system import IS_WINDOWS, kill_process_tree, process_group_kwargs, read_text
from .tomlfile import toml_remove_key, toml_remove_table, toml_replace_table
from .config import CONFIG_FILE, PLACE_HERE, load_config
from .store import RUNNING_STATUS, Store
from .git import GitError, GitUnavailable, _git_argv, _git_env, git_repository, run_git
from .sandbox import SandboxUnavailable, sandbox_tool
from .task_queue import task_records
from .register import adapter_for


def configured_places(root):
    """(the project's Config, {name: PlaceConfig}, [parallel] places) — ferrus.toml's
    [sandbox], [places.NAME] and [parallel] places, validated (FerrusError names the key)."""
    config = load_config(root)
    return config, config.places, config.parallel.places


# -- probe: what the place has ----------------------------------------------------------------

# Where each agent CLI keeps a login, and the variables that hold a key for it.
PLACE_AGENT_LOGINS = {
    "claude": (("~/.claude/.credentials.json",),
               ("ANTHROPIC_API_KEY", "CLAUDE_CODE_OAUTH_TOKEN", "ANTHROPIC_AUTH_TOKEN")),
    "codex": (("~/.codex/auth.json",), ("OPENAI_API_KEY", "CODEX_API_KEY")),
    "qwen": (("~/.qwen/oauth_creds.json",), ("OPENAI_API_KEY", "DASHSCOPE_API_KEY")),
    "gemini": (("~/.gemini/oauth_creds.json",),
               ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_APPLICATION_CREDENTIALS")),
}


def agent_login(binary, environ=None):
    """How the agent CLI ``binary`` is logged in here (words), or None when it is not;
    "" for a CLI ferrus cannot tell about."""
    environ = os.environ if environ is None else environ
    known = PLACE_AGENT_LOGINS.get(os.path.basename(binary))
    if known is None:
        return ""
    files, variables = known
    for path in files:
        if os.path.isfile(os.path.expanduser(path)):
            return "credentials in %s" % path
    for name in variables:
        if environ.get(name):
            return "key in $%s" % name
    if os.path.basename(binary) == "claude":
        with contextlib.suppress(OSError, ValueError, AttributeError):
            with open(os.path.expanduser("~/.claude.json"), encoding="utf-8") as handle:
                if json.load(handle).get("oauthAccount"):
                    return "account in ~/.claude.json"
    return None


def place_probe(binaries):
    """What this machine offers a task: Python, git and the agent CLIs ``binaries`` (path,
    version, login)."""
    git = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "--version"], capture_output=True, text=True,
                              timeout=20, stdin=subprocess.DEVNULL)
        git = done.stdout.strip().rpartition(" ")[2] if done.returncode == 0 else ""
    agents = {}
    for binary in binaries:
        path = shutil.which(binary)
        version = ""
        if path:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                done = subprocess.run([path, "--version"], capture_output=True, text=True,
                                      timeout=20, stdin=subprocess.DEVNULL)
                lines = done.stdout.strip().splitlines()
                version = lines[0].strip()[:80] if done.returncode == 0 and lines else ""
        agents[binary] = {"path": path, "version": version,
                          "login": agent_login(binary) if path else None}
    return {"python": "%d.%d.%d" % sys.version_info[:3], "git": git, "agents": agents}


# -- ferrus as a place gets it ----------------------------------------------------------------

def place_program():
    """(content hash, [(name, bytes)]) of ferrus as it is copied to a place: ferrus.py."""
    with open(FERRUS_FILE, "rb") as handle:
        contents = [("ferrus.py", handle.read())]
    return program_hash(contents), contents


def program_hash(contents):
    import hashlib       # here: OpenSSL loads only for a command that needs a place
    digest = hashlib.sha256()
    for name, data in sorted(contents):
        digest.update(name.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest()


# The boot program: what the place's Python runs first, whatever the request.  Written
# for any Python 3 (it says which is too old), with no quote or backslash of its own
# outside strings, as it travels base64-encoded on the command line.
PLACE_BOOT = r'''
import sys, os, json, base64, hashlib
sys.stdout.write("ferrus-place 1\n")
sys.stdout.flush()
if sys.version_info < (3, 9):
    sys.stderr.write("ferrus: this place runs Python %d.%d; ferrus needs 3.9 or later\n"
                     % sys.version_info[:2])
    sys.exit(86)
import pwd
request = json.loads(base64.b64decode(sys.argv[1]).decode("utf-8"))
user = pwd.getpwuid(os.getuid())
if not os.access(os.environ.get("HOME") or "/nonexistent", os.W_OK):
    # An exec prefix such as `runuser -u USER --` keeps the caller's HOME.
    os.environ.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
for folder in reversed(request.get("path") or []):
    os.environ["PATH"] = os.path.expanduser(folder) + os.pathsep + os.environ.get("PATH", "")
base = os.path.expanduser(request["dir"])
program = os.path.join(base, "ferrus-" + request["hash"][:16])
kind = request["kind"]
if kind == "install":
    header = json.loads(sys.stdin.buffer.readline().decode("utf-8"))
    contents = [(name, sys.stdin.buffer.read(size)) for name, size in header["files"]]
    digest = hashlib.sha256()
    for name, data in sorted(contents):
        digest.update(name.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0" + data)
    if digest.hexdigest() != request["hash"]:
        sys.stderr.write("ferrus: the copy of ferrus arrived damaged (hash mismatch)\n")
        sys.exit(3)
    os.makedirs(base, mode=0o700, exist_ok=True)
    temporary = "%s.%d.tmp" % (program, os.getpid())
    os.makedirs(temporary)
    import py_compile
    for name, data in contents:
        with open(os.path.join(temporary, os.path.basename(name)), "wb") as handle:
            handle.write(data)
        # Compiled once here, so no later call compiles ferrus again (even where the
        # environment says not to write bytecode).
        py_compile.compile(os.path.join(temporary, os.path.basename(name)),
                           dfile=os.path.join(program, os.path.basename(name)), doraise=False)
    open(os.path.join(temporary, ".complete"), "w").close()
    try:
        os.rename(temporary, program)
    except OSError:
        import shutil
        shutil.rmtree(temporary, ignore_errors=True)
    sys.stdout.write(json.dumps({"program": program}) + "\n")
elif kind == "run":
    os.chdir(os.path.expanduser(request.get("cwd") or "~"))
    os.environ.update(request.get("env") or {})
    sys.stdout.flush()
    try:
        os.execvp(request["argv"][0], request["argv"])
    except OSError as err:
        sys.stderr.write("ferrus: cannot run %s at this place: %s\n" % (request["argv"][0], err))
        sys.exit(127)
else:
    if not os.path.isfile(os.path.join(program, ".complete")):
        sys.exit(85)
    sys.path.insert(0, program)
    import ferrus
    sys.exit(ferrus.place_side_main(request, base, program))
'''
PLACE_MARKER = b"ferrus-place 1\n"
PLACE_EXIT_NO_FERRUS = 85
PLACE_EXIT_OLD_PYTHON = 86
# Seconds between tries of a call that did not reach the place or dropped (about 16 s).
PLACE_RETRY_DELAYS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
PLACE_CALL_TIMEOUT = 300.0
# What a task's commits coming back may weigh at most.
PLACE_MAX_PACK_BYTES = 2 << 30


def place_boot_line():
    """The `python -c` code that runs the boot program: safe characters only."""
    import base64
    encoded = base64.b64encode(PLACE_BOOT.encode("utf-8")).decode("ascii")
    return 'import base64,sys;exec(base64.b64decode("%s"))' % encoded


class PlaceUnreachable(FerrusError):
    """A place that could not be reached (or kept dropping the connection) after retries."""


class PlaceBroken(FerrusError):
    """A place that answers but cannot run ferrus: no Python 3.9+, or the prefix is missing."""


# -- the channel ------------------------------------------------------------------------------

class Place:
    """The channel to one place (see the module docstring).  ``sleep`` waits between
    retries (tests pass their own), ``delays`` are those waits."""

    def __init__(self, config, sleep=time.sleep, delays=PLACE_RETRY_DELAYS, program=None):
        self.config = config
        self.name = config.name
        self.sleep = sleep
        self.delays = tuple(delays)
        self.program = program or place_program()
        self.retries = 0             # calls tried again after a drop, in this process
        self.known = {}              # {project: commits its repository there has}

    def describe(self):
        import shlex
        prefix = self.config.ssh or self.config.exec
        return "%s %s" % (self.config.kind, " ".join(shlex.quote(w) for w in (
            prefix[-1:] if self.config.ssh else prefix)))

    def _prefix(self):
        if self.config.exec:
            return list(self.config.exec)
        prefix = list(self.config.ssh)
        # Never a password prompt (nobody would answer it), dead connections noticed,
        # and one connection for every call when ssh can share one.  Before the host, so
        # the user's own -o options (earlier) still win.
        ours = ["-o", "BatchMode=yes", "-o", "ServerAliveInterval=15",
                "-o", "ServerAliveCountMax=3"]
        if self.config.multiplex and not IS_WINDOWS and \
                os.path.basename(prefix[0]) == "ssh":
            ours += ["-o", "ControlMaster=auto", "-o", "ControlPersist=60",
                     "-o", "ControlPath=" + _control_folder() + "/%C"]
        if os.path.basename(prefix[0]) == "ssh":
            prefix[-1:-1] = ours
        return prefix

    def argv(self, request):
        """The local argv that carries ``request`` to the place."""
        import shlex
        import base64
        request = dict(request, dir=self.config.dir, hash=self.program[0],
                       path=list(self.config.path))
        words = [self.config.python, "-c", place_boot_line(),
                 base64.b64encode(json.dumps(request).encode("utf-8")).decode("ascii")]
        if self.config.exec:
            return self._prefix() + words
        # ssh hands one string to the login shell there: every word is quoted, and none
        # holds anything but letters, digits and a few signs anyway.
        return self._prefix() + ["exec " + " ".join(shlex.quote(w) for w in words)]

    # -- one call, with retries ----------------------------------------------------------

    def request(self, request, input=None, feed=None, timeout=PLACE_CALL_TIMEOUT):
        """(exit code, stdout after the marker, stderr) of ``request`` at the place;
        ``input`` bytes or ``feed()`` (a fresh readable for each try) on its stdin.
        Retries what did not reach the place or dropped; installs ferrus when missing."""
        tries = 0
        installed = False
        while True:
            code, out, err, reached = self._attempt(self.argv(request), input, feed, timeout)
            verdict = self._verdict(code, err, reached, request.get("kind") == "ferrus")
            if verdict == "ok":
                return code, out, err
            if verdict == "no-ferrus" and not installed:
                self.install()
                installed = True
                continue
            if verdict in ("unreachable", "dropped") and tries < len(self.delays):
                self.sleep(self.delays[tries])
                tries += 1
                self.retries += 1
                continue
            raise self._failure(verdict, code, err, tries)

    def _attempt(self, argv, input, feed, timeout):
        finish = None
        stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
        if feed is not None:
            stdin, finish = feed()
        try:
            proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        except OSError as err:
            if finish:
                finish()
            raise PlaceBroken("place %s: cannot start %s here: %s" % (
                self.name, argv[0], err.strerror or err), "install it, or fix [places.%s] "
                "in %s" % (self.name, CONFIG_FILE)) from None
        if feed is not None:
            stdin.close()         # the child has its own copy
        try:
            out, err = proc.communicate(input, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            code = None
        finally:
            if finish:
                finish()
        at = out.find(PLACE_MARKER)
        reached = at >= 0
        return code, out[at + len(PLACE_MARKER):] if reached else out, err, reached

    def _verdict(self, code, err, reached, ferrus_call=False):
        """What one try came to: ok, dropped or unreachable (tried again), no-ferrus
        (copied, then tried again), no-python or old-python (the place cannot serve).
        ``ferrus_call``: ferrus there answers 0 or 1 and nothing else, so any other exit
        is the connection's (an exec prefix has no exit status of its own for that)."""
        if reached:
            if code == PLACE_EXIT_NO_FERRUS:
                return "no-ferrus"
            if code == PLACE_EXIT_OLD_PYTHON:
                return "old-python"
            if code is None or (self.config.ssh and code == 255) or \
                    (ferrus_call and code not in (0, 1)):
                return "dropped"
            return "ok"
        if code in (126, 127):
            return "no-python"
        return "unreachable"

    def _failure(self, verdict, code, err, tries):
        import shlex
        said = _said(err)
        where = "place %s (%s)" % (self.name, self.describe())
        if verdict == "old-python":
            return PlaceBroken("%s: %s" % (where, said or "its Python is older than 3.9"),
                               "install Python 3.9 or later there, and name it in "
                               "[places.%s] python" % self.name)
        if verdict == "no-python":
            return PlaceBroken("%s: cannot run %s there%s" % (where, self.config.python,
                                                               ": " + said if said else ""),
                               "install Python 3.9 or later there (or name it in "
                               "[places.%s] python)" % self.name)
        if verdict == "no-ferrus":
            return PlaceBroken("%s: ferrus is still missing there after copying it" % where,
                               "check that [places.%s] dir is writable there" % self.name)
        return PlaceUnreachable(
            "%s %s%s" % (where, "could not be reached" if verdict == "unreachable" else
                         "kept dropping the connection", " (%d tries): %s" % (tries + 1, said)
                         if said else " (%d tries, exit %s)" % (tries + 1, code)),
            "check that `%s true` works from this machine; its tasks wait or go to another "
            "place" % " ".join(shlex.quote(w) for w in self.config.ssh or self.config.exec))

    def install(self):
        """Copy ferrus there (the boot program checks the content hash)."""
        digest, contents = self.program
        header = json.dumps({"files": [[name, len(data)] for name, data in contents]})
        data = header.encode("utf-8") + b"\n" + b"".join(data for _, data in contents)
        code, out, err = self.request({"kind": "install"}, input=data)
        if code != 0:
            raise PlaceBroken("place %s: ferrus could not be copied there: %s" % (
                self.name, _said(err) or "exit %s" % code),
                "check that [places.%s] dir (%s) can be written there" % (self.name,
                                                                          self.config.dir))
        return self._answer("install", code, out, err).get("program")

    def call(self, op, input=None, timeout=PLACE_CALL_TIMEOUT, **fields):
        """The JSON answer of ferrus's request ``op`` at the place (place_side.py)."""
        data = json.dumps(input).encode("utf-8") if input is not None and \
            not isinstance(input, bytes) else input
        code, out, err = self.request(dict(fields, kind="ferrus", op=op), input=data,
                                      timeout=timeout)
        return self._answer(op, code, out, err)

    def _answer(self, op, code, out, err):
        try:
            answer = json.loads(out.decode("utf-8").strip().rpartition("\n")[2] or "null")
        except ValueError:
            answer = None
        if code == 0 and isinstance(answer, dict):
            return answer
        if isinstance(answer, dict) and "error" in answer:
            raise FerrusError("place %s: %s" % (self.name, answer["error"]),
                              answer.get("hint") or None)
        raise FerrusError("place %s: %s failed (exit %s)%s" % (
            self.name, op, code, ": " + _last_line(err) if _last_line(err) else ""),
            "`ferrus places` checks the place")

    def run(self, argv, cwd=None, env=None, input=None, timeout=PLACE_CALL_TIMEOUT):
        """subprocess.CompletedProcess of ``argv`` run at the place in ``cwd`` (there;
        ``~`` allowed) with ``env`` added; stdout and stderr as bytes."""
        code, out, err = self.request({"kind": "run", "argv": list(argv), "cwd": cwd,
                                       "env": dict(env or {})}, input=input, timeout=timeout)
        return subprocess.CompletedProcess(list(argv), code, out, err)

    def popen(self, request, **kwargs):
        """A Popen carrying ``request`` (no retries: the caller streams, and reconnects),
        in a process group of its own: ending it ends the prefix and whatever it started
        here (an exec prefix such as runuser stays the parent of the far end)."""
        return subprocess.Popen(self.argv(request), **dict(process_group_kwargs(), **kwargs))

    # -- what the place has -------------------------------------------------------------------

    def probe(self, binaries):
        """The place's Python, git, agent CLIs (path, version, login) and jobs."""
        return self.call("probe", binaries=list(binaries))

    # -- commits there and back ---------------------------------------------------------------

    def send_commit(self, root, project, commit, name):
        """``commit`` (and what it needs that the place lacks) into the place's repository
        of ``project``, kept there under the ref ``name``.  A commit this Place sent (or
        saw there) before is not sent again: the task's prepare keeps it under its own
        ref there."""
        known = self.known.get(project)
        if known is not None and commit in known:
            return {"commit": commit}
        known = self.known[project] = set(self.call("refs", project=project).get(
            "commits") or [])
        if commit in known:
            return {"commit": commit}
        haves = _commits_here(root, sorted(known))
        revisions = ("\n".join([commit] + ["^" + h for h in haves]) + "\n").encode()

        def feed():
            pack = subprocess.Popen(_git_argv(["pack-objects", "--revs", "--thin", "--stdout",
                                               "-q"]), cwd=root, env=_git_env(),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL)
            pack.stdin.write(revisions)
            pack.stdin.close()

            def finish():
                pack.stdout.close()
                if pack.wait() != 0:
                    raise GitError("git pack-objects failed for %s" % commit[:12],
                                   "is the commit in this repository?")
            return pack.stdout, finish
        code, out, err = self.request(dict(kind="ferrus", op="receive", project=project,
                                           commit=commit, name=name), feed=feed)
        answer = self._answer("receive", code, out, err)
        known.add(commit)
        return answer

    def fetch_commit(self, root, project, commit, haves=(), ref=None):
        """``commit`` from the place's repository into this one (checked with index-pack
        --strict); ``haves``: commits both have (the task's base), left out of the pack.
        ``ref``: the local ref that keeps it."""
        request = {"kind": "ferrus", "op": "send", "project": project, "commit": commit,
                   "haves": list(haves)}
        tries = 0
        installed = False
        while True:
            verdict, code, said = self._fetch_once(root, request)
            if verdict == "ok":
                break
            if verdict == "no-ferrus" and not installed:
                self.install()
                installed = True
                continue
            if verdict in ("dropped", "unreachable") and tries < len(self.delays):
                self.sleep(self.delays[tries])
                tries += 1
                self.retries += 1
                continue
            raise self._failure(verdict, code, said, tries)
        run_git(root, ["cat-file", "-e", commit + "^{commit}"])
        if ref:
            run_git(root, ["update-ref", ref, commit])
        return commit

    def _fetch_once(self, root, request):
        """(verdict, exit code, what was said) of one try: the pack the place writes after
        its marker, piped into index-pack here.  An error the place answers is raised."""
        errors = tempfile.TemporaryFile()
        with errors:
            proc = self.popen(request, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=errors)
            index = None
            head, total, reached = b"", 0, False
            try:
                for chunk in iter(lambda: proc.stdout.read(65536), b""):
                    if index is None:
                        head += chunk
                        at = head.find(PLACE_MARKER)
                        if at < 0 or len(head) < at + len(PLACE_MARKER) + 4:
                            continue
                        reached, chunk = True, head[at + len(PLACE_MARKER):]
                        if chunk.startswith(b"{"):           # an answer, not a pack
                            head = chunk + proc.stdout.read(65536)
                            break
                        index = subprocess.Popen(
                            _git_argv(["index-pack", "--stdin", "--fix-thin", "--strict"]),
                            cwd=root, env=_git_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
                    total += len(chunk)
                    if total > PLACE_MAX_PACK_BYTES:
                        raise FerrusError("place %s sent more than %d MiB for commit %s" % (
                            self.name, PLACE_MAX_PACK_BYTES >> 20, request["commit"][:12]),
                            "are a task's commits that large? fetch them by hand")
                    index.stdin.write(chunk)
            except BrokenPipeError:
                pass                          # index-pack gave up: its words say why
            finally:
                if index is not None:
                    with contextlib.suppress(OSError):
                        index.stdin.close()
                if proc.poll() is None and index is None:
                    proc.kill()
                code = proc.wait()
                indexed = b""
                if index is not None:
                    indexed = index.stderr.read()
                    index.stderr.close()
                    index.wait()
            errors.seek(0)
            said = errors.read(65536)
        reached = reached or PLACE_MARKER in head
        if index is None and reached and head.startswith(b"{"):
            return "ok", code, self._answer("send", code, head, said)
        if index is not None and code == 0 and index.returncode == 0:
            return "ok", code, b""
        if not reached:
            return self._verdict(code, said, False), code, said
        verdict = self._verdict(code, said, True, True)
        return ("dropped", code, indexed or said) if verdict == "ok" else (verdict, code, said)

    # -- a task there -------------------------------------------------------------------------

    def prepare_task(self, store, task, base, text, origin=None, agent=None, resume_from=None,
                     lease=None, copied=(), files=()):
        """Send ``base`` there and make the task's worktree and store there, the task
        created from ``text`` (its files first put back as ``resume_from``, saved work of
        an earlier try, has them); with ``lease`` its job starts in the same call.
        ``copied`` and ``files``: [parallel] copy's paths and their packed files
        (copy_to_places).  The answer names its worktree there (and its job)."""
        project = place_project_key(store.root)
        self.send_commit(store.root, project, base, task)
        if resume_from:
            self.send_commit(store.root, project, resume_from, task + "-resume")
        config = store.config()
        payload = {
            "config": place_config_text(store.root, self.config.sandbox), "text": text,
            "origin": origin or {}, "agent": agent, "setup": list(config.parallel.setup),
            "resume_from": resume_from, "copied": list(copied), "files": list(files),
            "agents": {role: [choice.agent, choice.model or None] for role, choice in (
                ("supervisor", config.supervisor), ("executor", config.executor)) if choice}}
        fields = {"start": True, "lease": lease} if lease else {}
        return self.call("prepare", input=payload, project=project, task=task, base=base,
                         inside=project_folder_in_repository(store.root), **fields)

    def follow(self, store, task, after=0, messages_from=0, **options):
        """A started PlaceFollower of ``task`` there."""
        return PlaceFollower(self, place_project_key(store.root), task, after, messages_from,
                             **options).start()


def _control_folder():
    """Where ssh keeps its shared connections: a private folder of this user's, short
    (a socket path must fit in about 100 bytes)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = os.path.join(tempfile.gettempdir(), "ferrus-ssh-%d" % uid)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder


def _last_line(data):
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return terminal_safe(lines[-1])[:300] if lines else ""


def _said(err):
    """The last line a place wrote on stderr, without ferrus's own "ferrus: " before it."""
    said = _last_line(err)
    return said[len("ferrus: "):] if said.startswith("ferrus: ") else said


def _commits_here(root, commits):
    """Those of ``commits`` this repository has."""
    if not commits:
        return []
    out = run_git(root, ["cat-file", "--batch-check=%(objectname) %(objecttype)"],
                  stdin=("\n".join(commits) + "\n").encode())
    return [line.split()[0] for line in out.decode().splitlines()
            if line.endswith(" commit")]


def place_project_key(root):
    """The name a project has at every place: from this machine's name and its repository's
    path, so two projects (or two machines) never share one there, and nothing of the path
    itself leaves this machine."""
    import socket
    import hashlib
    try:
        where = git_repository(root).toplevel
    except GitUnavailable:
        where = root
    digest = hashlib.sha256(("%s\0%s" % (socket.gethostname(), os.path.realpath(where)))
                            .encode("utf-8")).hexdigest()
    return "p-" + digest[:12]


def project_folder_in_repository(root):
    """The project's folder inside its repository ("." at its top), as the worktree there
    has it."""
    try:
        top = git_repository(root).toplevel
    except GitUnavailable:
        return "."
    return os.path.relpath(os.path.realpath(root), os.path.realpath(top)).replace(os.sep, "/")


def place_config_text(root, sandbox=None):
    """ferrus.toml as a place gets it: without [places] and [parallel] places (how this
    machine reaches places) and [notify] (what runs here when a task ends, webhooks and
    tokens included), its [sandbox] the place's own (``sandbox``: the place's table over
    the global one)."""
    text = read_text(os.path.join(root, CONFIG_FILE), default="")
    for table in ("places", "notify"):
        text = toml_remove_table(text, (table,))
    text = toml_remove_key(text, ("parallel",), "places")
    if sandbox is not None:
        text = toml_replace_table(text, ("sandbox",), dataclasses.asdict(sandbox))
    return text


# -- following a task there -------------------------------------------------------------------

class PlaceFollower:
    """Follows one task at a place: its journal entries there ({"entry"}), its
    STATE.json and scratch files whenever they change ({"task": {"state", "files"}}), its
    controller's messages ({"message"}), beats ({"beat"}: the seq and the task's state
    there) and the end of its job ({"end"}), as items of ``get()``.  A dropped connection
    is opened again with backoff from the last entry and message seen, so nothing comes
    twice and nothing is lost; after ``delays`` run out without a line, one {"lost": why}
    item ends it."""

    def __init__(self, place, project, task, after=0, messages_from=0, beat=2.0, lease=90.0,
                 sleep=None, delays=None):
        import queue
        self.place = place
        self.project = project
        self.task = task
        self.after = after
        self.messages_from = messages_from
        self.beat = beat
        self.lease = lease
        self.sleep = sleep or place.sleep
        self.delays = tuple(delays if delays is not None else place.delays)
        self.items = queue.Queue()
        self.drops = 0
        self.ended = None
        self.lost = None
        self.connection = None        # the process carrying the current connection
        self._stopping = threading.Event()
        self._thread = None

    def start(self):
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="ferrus-follow-%s" % self.task)
        self._thread.start()
        return self

    def get(self, timeout=None):
        """The next item, or None when none came within ``timeout``."""
        import queue
        try:
            return self.items.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self):
        self._stopping.set()
        self.cut()
        if self._thread is not None:
            self._thread.join(5)

    def cut(self):
        """End the current connection (it is opened again unless stopping)."""
        connection = self.connection
        if connection is not None and connection.poll() is None:
            kill_process_tree(connection, grace=0)

    def _request(self):
        return {"kind": "ferrus", "op": "follow", "project": self.project, "task": self.task,
                "after": self.after, "messages_from": self.messages_from,
                "beat": self.beat, "lease": self.lease}

    def _run(self):
        failures = 0
        while not self._stopping.is_set():
            try:
                lines = self._connect_and_read()
            except FerrusError as err:
                self._lose(err.message)
                return
            if self.ended is not None or self.lost is not None or self._stopping.is_set():
                return
            # A connection that brought lines before it dropped is opened again at once;
            # one that brought none waits longer each time, then the place is lost.
            failures = 0 if lines else failures + 1
            if failures > len(self.delays):
                self._lose("the connection to place %s dropped %d times in a row without "
                           "a word" % (self.place.name, failures))
                return
            self.drops += 1
            if failures:
                self.sleep(self.delays[failures - 1])

    def _lose(self, why):
        if self.drops:
            why += " (after %d reconnection%s)" % (self.drops, "" if self.drops == 1 else "s")
        self.lost = why
        self.items.put({"lost": why})

    def _connect_and_read(self):
        errors = tempfile.TemporaryFile()
        with errors:
            try:
                proc = self.place.popen(self._request(), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=errors)
            except OSError as err:
                raise PlaceBroken("cannot start %s here: %s" % (
                    self.place.argv({})[0], err.strerror or err)) from None
            self.connection = proc
            reached, count = False, 0
            with proc.stdout:
                for raw in proc.stdout:
                    if not reached:
                        reached = raw == PLACE_MARKER
                        continue
                    try:
                        item = json.loads(raw.decode("utf-8"))
                    except ValueError:
                        continue
                    count += 1
                    self._take(item)
            code = proc.wait()
            if code == PLACE_EXIT_NO_FERRUS and reached:
                self.place.install()
                return 1
            if code in (126, 127, PLACE_EXIT_OLD_PYTHON):
                errors.seek(0)
                raise self.place._failure("no-python" if code != PLACE_EXIT_OLD_PYTHON
                                          else "old-python", code, errors.read(4096), 0)
            return count

    def _take(self, item):
        if "error" in item:
            self._lose("place %s: %s" % (self.place.name, item["error"]))
            return
        if "entry" in item:
            self.after = max(self.after, item["entry"].get("seq", 0))
        if "message" in item:
            self.messages_from = max(self.messages_from, item.get("at", 0))
        if "beat" in item:
            self.after = max(self.after, item["beat"].get("seq", 0))
            self.messages_from = max(self.messages_from, item["beat"].get("at", 0))
        if "end" in item:
            self.ended = item["end"]
        self.items.put(item)


# -- `ferrus places` --------------------------------------------------------------------------

def place_binaries(config):
    """The agent CLIs the project's roles (and [parallel] delegates) run, by binary."""
    names = [choice.agent for choice in (config.supervisor, config.executor) if choice]
    names += list(config.parallel.delegates)
    binaries = []
    for name in names:
        with contextlib.suppress(FerrusError):
            binary = adapter_for(config, name).binary
            if binary not in binaries:
                binaries.append(binary)
    return binaries


def running_tasks(store):
    """The ids of the project's tasks that are running (their work may be at a place)."""
    return [task for task, record in task_records(store)
            if record.get("status") == RUNNING_STATUS]


def places_report(root, make_place=Place, clock=time.monotonic):
    """`ferrus places`: one row per place, live: reachable, Python, git, the agent CLIs
    there (installed, version, logged in), slots and how many are free."""
    config, places, order = configured_places(root)
    binaries = place_binaries(config)
    rows = []
    for name, place in sorted(places.items(), key=lambda item: (
            item[0] not in order, order.index(item[0]) if item[0] in order else 0, item[0])):
        row = {"place": name, "kind": place.kind, "in_use": name in order,
               "slots": place.slots if place.slots is not None else
               config.parallel.max_tasks}
        started = clock()
        try:
            if name == PLACE_HERE:
                found = place_probe(binaries)
                row["reach"] = "this machine"
            else:
                channel = make_place(place)
                row["reach"] = channel.describe()
                found = channel.probe(binaries)
        except FerrusError as err:
            row.update(reachable=False, problem=err.message, hint=err.hint)
            rows.append(row)
            continue
        row.update(reachable=True, secs=round(clock() - started, 3),
                   python=found.get("python"), git=found.get("git") or None,
                   agents=found.get("agents") or {})
        if name == PLACE_HERE:
            busy = len(running_tasks_here(root))
        else:
            busy = len([job for job in found.get("jobs") or [] if job.get("state") == "running"])
        row["free"] = max(0, row["slots"] - busy)
        problems = _place_problems(row, binaries)
        if place.sandbox.enabled and name == PLACE_HERE:
            try:
                row["sandbox"] = "on (%s)" % sandbox_tool()[0]
            except SandboxUnavailable as err:
                problems.append((err.message, err.hint))
        elif place.sandbox.enabled:
            row["sandbox"] = "on (checked when a task starts there)"
        if problems:
            row["problem"], row["hint"] = problems[0]
        rows.append(row)
    return rows


def running_tasks_here(root):
    with contextlib.suppress(FerrusError, OSError):
        return running_tasks(Store(root))
    return []


def _place_problems(row, binaries):
    problems = []
    if not row.get("git"):
        problems.append(("git is not installed at place %s" % row["place"],
                         "install git there (ferrus moves commits with it)"))
    for binary in binaries:
        agent = row["agents"].get(binary) or {}
        if not agent.get("path"):
            problems.append(("%s is not installed at place %s" % (binary, row["place"]),
                             "install it there (for the npm CLIs: npm install -g ...), or "
                             "add its folder to [places.%s] path" % row["place"]))
        elif agent.get("login") is None:
            problems.append(("%s is not logged in at place %s" % (binary, row["place"]),
                             "log in there as the place's user (run it once interactively), "
                             "or give it its API key in that user's environment"))
    return problems


def describe_place_row(row):
    """`ferrus places` lines for one row."""
    head = "%-10s %s" % (row["place"], row.get("reach") or row["kind"])
    if not row.get("reachable"):
        return [head + ": unreachable", "           problem: %s" % row["problem"],
                "           fix: %s" % row["hint"]]
    lines = [head + (" (%s)" % format_duration(row["secs"]) if row["place"] != PLACE_HERE
                     else ""),
             "           Python %s, git %s; %d slot%s, %d free%s%s" % (
                 row["python"], row.get("git") or "missing", row["slots"],
                 "" if row["slots"] == 1 else "s", row["free"],
                 "; sandbox %s" % row["sandbox"] if row.get("sandbox") else "",
                 "" if row["in_use"] else "; not in [parallel] places")]
    for binary, agent in sorted(row.get("agents", {}).items()):
        if not agent.get("path"):
            lines.append("           %s: not installed" % binary)
        else:
            login = agent.get("login")
            lines.append("           %s: %s, %s" % (binary, agent.get("version") or "version "
                                                     "unknown", "not logged in" if login is None
                                                     else "logged in (%s)" % login if login
                                                     else "login unknown"))
    if row.get("problem"):
        lines += ["           problem: %s" % row["problem"], "           fix: %s" % row["hint"]]
    return lines


def clean_places(root, make_place=Place):
    """What killed runs left at each place: tasks of this project no running task keeps,
    and the copies of ferrus no job uses.  Returns (place, removed paths or problem) rows."""
    config, places, order = configured_places(root)
    project = place_project_key(root)
    keep = [[project, task] for task in running_tasks(Store(root))]
    results = []
    for name, place in sorted(places.items()):
        if name == PLACE_HERE:
            continue
        try:
            answer = make_place(place).call("clean", project=project, keep=keep)
            results.append((name, answer.get("removed") or [], None))
        except FerrusError as err:
            results.append((name, [], err.full_text()))
    return results


def cmd_places(args, root):
    if args.clean:
        failed = False
        for name, removed, problem in clean_places(root):
            if problem:
                failed = True
                say("%-10s could not be cleaned: %s" % (name, problem))
            else:
                say("%-10s %s" % (name, "removed %d leftover%s: %s" % (
                    len(removed), "" if len(removed) == 1 else "s", ", ".join(removed))
                    if removed else "nothing left over"))
        return 1 if failed else 0
    rows = places_report(root)
    if args.json:
        say(json.dumps(rows, indent=2))
    else:
        for row in rows:
            for line in describe_place_row(row):
                say(line)
    return 1 if any("problem" in row for row in rows if row["in_use"]) else 0


def add_places_parser(sub):
    """`ferrus places` on the top-level subparsers."""
    p = sub.add_parser("places", help="where tasks run: each place, checked live (reachable, "
                                      "Python, git, agent CLIs and their login, free slots)")
    p.add_argument("--json", action="store_true", help="machine-readable rows")
    p.add_argument("--clean", action="store_true",
                   help="remove what killed runs left at the places (worktrees, stores, old "
                        "copies of ferrus; never a running task's)")
    p.set_defaults(run=cmd_places)
