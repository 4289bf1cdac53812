"""Shared fixtures and helpers: a fresh ferrus project in a temporary directory, the CLI
as a subprocess, git repositories, the scripted agent in both roles, waiting for an event."""

import datetime as dt
import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import ferrus  # noqa: E402

FERRUS_PY = os.path.join(REPO, "ferrus.py")
# How the tests start ferrus as a program: through the launcher, which imports ferrus.py
# from its cached bytecode as users' launchers do (`python ferrus.py` compiles the whole
# file on every start, since a script's code is never cached).
FERRUS_CMD = [sys.executable, os.path.join(REPO, "ferrus")]


def _compile_once():
    """Write ferrus.py's bytecode cache now, whatever PYTHONDONTWRITEBYTECODE says (it
    stops only the writing): every ferrus process the tests start then loads it instead
    of compiling the whole file again."""
    import importlib.util
    import py_compile
    cache = importlib.util.cache_from_source(FERRUS_PY)
    try:
        if os.stat(cache).st_mtime >= os.stat(FERRUS_PY).st_mtime:
            return
    except OSError:
        pass
    py_compile.compile(FERRUS_PY, cfile=cache, doraise=True)


_compile_once()


class FakeClock:
    """An injectable clock: tests move time forward instead of sleeping."""

    def __init__(self, start=None):
        self.now = start or dt.datetime(2026, 5, 13, 10, 0, 0, tzinfo=dt.timezone.utc)

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += dt.timedelta(seconds=seconds)


class FakeMonotonic:
    """An injectable monotonic clock (time.monotonic's place): tests set ``now``."""

    def __init__(self, start=1000.0):
        self.now = start

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def project(tmp_path):
    """An initialised project directory (ferrus.toml + .ferrus/)."""
    root = tmp_path / "proj"
    root.mkdir()
    ferrus.init_project(str(root), report=lambda message: None)
    return root


@pytest.fixture
def store(project, clock):
    return ferrus.Store(str(project), clock=clock)


_last_config_stamp = [0]


def set_config(root, text):
    """Replace ferrus.toml and make sure the config cache sees the change.

    Two writes within one timestamp tick could share an mtime (and a size), so the
    mtime is pushed strictly forward on every call."""
    path = os.path.join(str(root), "ferrus.toml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    stamp = max(os.stat(path).st_mtime_ns, _last_config_stamp[0]) + 1_000_000
    _last_config_stamp[0] = stamp
    os.utime(path, ns=(stamp, stamp))


def run_cli(*args, cwd, input=None, env=None, timeout=60):
    """Run `ferrus ARGS` in ``cwd`` and return the CompletedProcess (text mode).

    ``input`` is its stdin (without it, stdin is empty: however pytest was started, no
    ferrus asks a terminal); ``env`` adds or overrides variables, after NO_COLOR=1 and
    without the caller's FERRUS_DEBUG."""
    full_env = dict(os.environ)
    full_env.pop("FERRUS_DEBUG", None)
    full_env["NO_COLOR"] = "1"
    if env:
        full_env.update(env)
    stdin = {"stdin": subprocess.DEVNULL} if input is None else {"input": input}
    return subprocess.run(FERRUS_CMD + list(args), cwd=str(cwd), capture_output=True,
                          text=True, env=full_env, timeout=timeout, **stdin)


@pytest.fixture
def cli():
    return run_cli


def write(root, rel, data):
    """Write ``data`` (text, written as UTF-8 with its newlines as given, or bytes) to
    ``root``/``rel`` (slash-separated), creating its folders."""
    path = os.path.join(str(root), *rel.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(path, "wb") as handle:
        handle.write(data)


def wait_until(condition, what, timeout=60, proc=None, interval=0.02):
    """Poll ``condition`` until it holds and return what it returned; fail after
    ``timeout`` seconds naming ``what``, or at once when ``proc`` (a Popen) ends first.
    Tests wait for the event they check, never for a fixed time."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError("the process ended before %s: %r" % (what, proc.communicate()))
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.1f s waiting for %s" % (timeout, what))
        time.sleep(interval)


# -- git ------------------------------------------------------------------------------------

# Who the commits a test makes itself are by.  ferrus's own commits (made in this process
# or a ferrus process) never see it: they use the repository's identity or the
# environment's, as each test arranges.
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
                "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def git(root, *args, check=True, env=None):
    """Run git in ``root`` for a test's own steps and return the CompletedProcess (text).

    The caller's GIT_* variables and the system's git configuration are left out, so the
    machine's set-up cannot change a test: `git init` makes main, commits are by
    GIT_IDENTITY, file:// submodules are allowed; ``env`` adds or overrides variables.
    A failure raises CalledProcessError unless ``check`` is false."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    clean.update(GIT_CONFIG_NOSYSTEM="1", **GIT_IDENTITY)
    clean.update(env or {})
    return subprocess.run(["git", "-c", "init.defaultBranch=main",
                           "-c", "protocol.file.allow=always"] + list(args),
                          cwd=str(root), env=clean, capture_output=True, text=True, check=check)


def branches(root):
    """The repository's local branches, by short name."""
    return git(root, "for-each-ref", "--format=%(refname:short)", "refs/heads/").stdout.split()


def committed(root, rev="main"):
    """The paths of the files in ``rev``'s tree, sorted."""
    return sorted(git(root, "ls-tree", "-r", "--name-only", rev).stdout.split())


# -- the scripted agent (tests/scripted_agent.py) as both roles ------------------------

SCRIPTED_AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripted_agent.py")
def custom_agent_config(name, argv, prompt="stdin"):
    """ferrus.toml text making the custom agent ``name`` (``argv``) both roles' agent."""
    return """
[agents.custom.%(name)s]
interactive = %(argv)s
headless = %(argv)s
prompt = "%(prompt)s"

[hq.supervisor]
agent = "%(name)s"

[hq.executor]
agent = "%(name)s"
""" % {"name": name, "argv": json.dumps(argv), "prompt": prompt}


# The scripted executor appends "work" to work.txt; the check passes on the untouched
# project too (no work.txt yet), as a project's tests pass before a task starts: `ferrus
# run` tries the checks on the base before any agent starts and stops on a red one.
SCRIPTED_CHECK = "test ! -e work.txt || grep -q work work.txt"
SCRIPTED_CONFIG = """
[checks]
commands = [%s]

[limits]
wait_timeout_secs = 5
""" % json.dumps(SCRIPTED_CHECK) + custom_agent_config(
    "scripted", [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])


def scripted_project(project, memory):
    """Configure ``project`` to run the scripted agent in both roles, with its memory
    folder ``memory`` created; returns the project's Store."""
    set_config(project, SCRIPTED_CONFIG)
    ferrus.register_agents(str(project), {"supervisor": ("scripted", None),
                                          "executor": ("scripted", None)},
                           report=lambda m: None)
    os.makedirs(str(memory), exist_ok=True)
    return ferrus.Store(str(project))


@pytest.fixture
def scripted(project, tmp_path, monkeypatch):
    """The project with the scripted agent in both roles (SCRIPTED_CONFIG), its memory
    in tmp_path/memory and no behaviour set; returns the project's Store."""
    store = scripted_project(project, tmp_path / "memory")
    monkeypatch.setenv("SCRIPTED_DIR", str(tmp_path / "memory"))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "")
    return store


# -- the scripted agent in a git repository (queued and parallel tasks) -----------------

def scripted_config(checks, extra="", checks_extra="", review_cycles=3):
    """ferrus.toml text for the scripted agent in both roles with [checks] ``checks``
    (``checks_extra``: more lines of [checks]), ``review_cycles`` review cycles, then
    ``extra`` (its first lines still in [limits])."""
    return ("[checks]\ncommands = %s\n%s\n[limits]\nwait_timeout_secs = 5\n"
            "max_review_cycles = %d\n\n" % (json.dumps(checks), checks_extra, review_cycles) +
            extra +
            custom_agent_config("scripted", [sys.executable, SCRIPTED_AGENT, "{role}",
                                             "{mcp_config}"]))


@pytest.fixture
def git_project(tmp_path, monkeypatch):
    """A git repository (tmp_path/project, nothing committed) with ferrus initialised;
    the environment gives ferrus's commits an identity and the scripted agent its memory
    folder (tmp_path/memory) and no behaviour.  scripted_setup() finishes it."""
    root = tmp_path / "project"
    root.mkdir()
    for name, value in GIT_IDENTITY.items():
        monkeypatch.setenv(name, value)
    memory = tmp_path / "memory"
    memory.mkdir()
    monkeypatch.setenv("SCRIPTED_DIR", str(memory))
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "")
    git(root, "init", "-q")
    ferrus.init_project(str(root), report=lambda m: None)
    return root


def scripted_setup(root, checks, extra="", checks_extra="", review_cycles=3):
    """``root`` (a git_project) configured by scripted_config(), the scripted agent
    registered in both roles, a README.md, and everything committed on main (the user's
    checkout, clean); returns the project's Store."""
    set_config(root, scripted_config(checks, extra, checks_extra, review_cycles))
    ferrus.register_agents(str(root), {"supervisor": ("scripted", None),
                                       "executor": ("scripted", None)}, report=lambda m: None)
    write(root, "README.md", "hello\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    return ferrus.Store(str(root))


def enqueue(store, text):
    """Queue a task with ``text`` as the human; returns its id."""
    return ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]


def statuses(store):
    """{task id: status} of every task of the queue."""
    return {row["id"]: row["status"] for row in ferrus.task_rows(store)}


def run_tasks(store, n, timeout=240, **kwargs):
    """Work the queue ``n`` tasks at a time (ferrus.run_parallel, in this process);
    returns (exit code, the lines it printed)."""
    lines = []
    code = ferrus.run_parallel(store, n, timeout=timeout, out=lines.append, **kwargs)
    return code, lines
