"""Shared fixtures: a fresh ferrus project in a temporary directory, the CLI as a subprocess."""

import datetime as dt
import json
import os
import subprocess
import sys

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
    """Run `python ferrus.py ARGS` and return the CompletedProcess (text mode)."""
    full_env = dict(os.environ)
    full_env.pop("FERRUS_DEBUG", None)
    full_env["NO_COLOR"] = "1"
    if env:
        full_env.update(env)
    return subprocess.run(FERRUS_CMD + list(args), cwd=str(cwd), input=input,
                          capture_output=True, text=True, env=full_env, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


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
