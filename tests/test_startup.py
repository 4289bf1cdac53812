"""ferrus runs where users put it: a project root whose own modules share standard
library names, subdirectories, and `-C` a missing folder."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import ferrus
from conftest import FERRUS_PY, REPO

SHADOWED = ("queue", "logging", "secrets", "signal", "enum", "json", "subprocess",
            "threading", "tempfile", "argparse", "dataclasses", "types")
INIT = {"protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"}}


@pytest.fixture
def shadowed_project(tmp_path):
    """ferrus.py and its launcher copied into a project root full of modules that
    share standard-library names and refuse to be imported."""
    root = tmp_path / "proj"
    root.mkdir()
    for name in SHADOWED:
        (root / (name + ".py")).write_text("raise SystemExit('the project %s.py was imported')\n"
                                           % name)
    shutil.copy(FERRUS_PY, str(root / "ferrus.py"))
    shutil.copy(os.path.join(REPO, "ferrus"), str(root / "ferrus"))
    return root


def env():
    clean = dict(os.environ, NO_COLOR="1")
    clean.pop("PYTHONPATH", None)
    return clean


def run(argv, cwd, **kw):
    return subprocess.run(argv, cwd=str(cwd), capture_output=True, text=True, env=env(),
                          timeout=60, **kw)


def test_every_way_of_starting_ferrus_gets_the_standard_library(shadowed_project):
    root = shadowed_project
    python = sys.executable
    init = run([python, "ferrus.py", "init"], root)
    assert init.returncode == 0, init.stderr
    for argv in ([python, "ferrus.py", "status"], [python, "-m", "ferrus", "status"],
                 [python, str(root / "ferrus"), "status"], [python, "ferrus.py", "doctor"]):
        result = run(argv, root)
        if "-m" in argv and "Could not import runpy module" in result.stderr:
            # This Python imports runpy's own modules (types, enum, ...) from the
            # current folder before any `-m` module runs (3.9, 3.10, and 3.11+ without
            # frozen modules, as in some venvs): nothing ferrus can change, and the
            # README says to use ./ferrus or `python ferrus.py` there.
            continue
        assert "was imported" not in result.stderr + result.stdout, argv
        assert result.returncode == 0, (argv, result.stderr)


def test_the_registered_server_command_gets_the_standard_library(shadowed_project):
    root = shadowed_project
    assert run([sys.executable, "ferrus.py", "init"], root).returncode == 0
    registered = run([sys.executable, "ferrus.py", "register", "--executor", "claude-code"], root)
    assert registered.returncode == 0, registered.stderr
    entry = list(json.loads((root / ".claude" / "mcp-executor.json").read_text())["mcpServers"].values())[0]
    request = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INIT})
    result = run([entry["command"]] + entry["args"], root, input=request + "\n")
    assert "was imported" not in result.stderr
    assert json.loads(result.stdout.splitlines()[0])["result"]["serverInfo"]["name"] == "ferrus"


def test_boot_code_loads_this_file_without_putting_its_folder_on_sys_path():
    code = ferrus.ferrus_boot_code()
    assert "sys.path.insert" not in code and repr(ferrus.FERRUS_FILE) in code


def test_commands_find_the_project_from_a_subdirectory(project, cli):
    deep = project / "src" / "pkg"
    deep.mkdir(parents=True)
    status = cli("status", "--json", cwd=deep)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "Idle"
    checked = cli("-C", "src", "check", "--force", cwd=project)
    assert checked.returncode == 0, checked.stderr
    created = cli("run", "--task", "x", "--timeout", "0.01", cwd=deep)
    assert "no .ferrus" not in created.stderr.lower()
    # init still creates a project where it is asked to, even inside another one.
    inner = cli("init", cwd=deep)
    assert inner.returncode == 0 and (deep / ".ferrus").is_dir()


def test_dash_c_a_missing_directory_says_so(tmp_path, cli):
    result = cli("-C", "nowhere", "status", cwd=tmp_path)
    assert result.returncode == 2
    assert "ferrus: -C nowhere: no such directory" in result.stderr
    (tmp_path / "file").write_text("")
    result = cli("-C", "file", "status", cwd=tmp_path)
    assert "not a directory" in result.stderr


# -- what a command does not use is made later -------------------------------------------

def test_a_deferred_dataclass_is_made_when_first_used():
    @ferrus.deferred_dataclass(frozen=True)
    class Point:
        """A point."""
        x: int
        tags: list = ferrus.dataclasses.field(default_factory=list)

    assert not ferrus.dataclasses.is_dataclass(Point)
    assert [f.name for f in ferrus.fields_of(Point)] == ["x", "tags"]   # made on asking
    point = Point(3)
    assert point == Point(3) and point.tags == [] and repr(point).endswith("Point(x=3, tags=[])")
    with pytest.raises(ferrus.dataclasses.FrozenInstanceError):
        point.x = 4

    @ferrus.deferred_dataclass
    class Pair:
        a: int
        b: int = 2

    assert Pair(1) == Pair(1, 2) and ferrus.dataclasses.is_dataclass(Pair)

    @ferrus.deferred_dataclass
    class Base:
        a: int
        b: int = 2

    @ferrus.deferred_dataclass
    class Triple(Base):
        c: int = 3

    assert repr(Triple(1)).endswith("Triple(a=1, b=2, c=3)")     # the base is made first
    assert Base(1) == Base(1, 2)


def test_a_class_made_a_deferred_dataclass_twice_is_refused():
    with pytest.raises(TypeError, match="twice"):
        @ferrus.deferred_dataclass
        @ferrus.deferred_dataclass
        class Twice:
            a: int


def test_imported_ferrus_has_only_ordinary_dataclasses():
    """Other programs import ferrus: its public dataclasses are dataclasses at once."""
    assert ferrus._PENDING_DATACLASSES == {} or all(
        cls.__module__ != "ferrus" for cls in ferrus._PENDING_DATACLASSES)
    assert ferrus.dataclasses.is_dataclass(ferrus.Config)
    assert [f.name for f in ferrus.dataclasses.fields(ferrus.ChecksConfig)][:1] == ["commands"]


def test_started_as_a_program_ferrus_makes_only_the_dataclasses_a_command_uses(project):
    code = ("import sys, importlib.util, io, contextlib\n"
            "sys.modules['__main__'].FERRUS_LAUNCHER = True\n"
            "spec = importlib.util.spec_from_file_location('ferrus', %r)\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['ferrus'] = m\n"
            "spec.loader.exec_module(m)\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    code = m.main(['-C', %r, 'status'])\n"
            "print(code, len(m._PENDING_DATACLASSES))\n" % (FERRUS_PY, str(project)))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env(), timeout=120)
    assert done.returncode == 0, done.stderr
    code, pending = map(int, done.stdout.split())
    assert code == 0 and pending > 10


def test_an_agents_server_starts_as_a_program_and_leaves_what_it_never_uses(project):
    """The MCP entry `register` writes starts ferrus as the launcher does: an agent's
    server starts once per session, so it must not make every dataclass, compile every
    pattern, or load the HTTP client nano alone uses."""
    probe = ("import atexit, os, re, sys\n"
             "compiled = []\n"
             "original = re._compile\n"
             # re is a package from 3.11 on (re/__init__.py), a module (re.py) before
             "home = re.__file__\n"
             "home = os.path.dirname(home) if os.path.basename(home).startswith('__init__') \\\n"
             "    else os.path.splitext(home)[0]\n"
             "def counting(pattern, flags):\n"
             "    caller = sys._getframe(1)\n"
             "    while caller.f_code.co_filename.startswith(home):\n"
             "        caller = caller.f_back\n"
             "    if caller.f_code.co_filename.endswith('ferrus.py'):\n"
             "        compiled.append(pattern)\n"
             "    return original(pattern, flags)\n"
             "re._compile = counting\n"
             "def report():\n"
             "    f = sys.modules['ferrus']\n"
             "    sys.stderr.write('PROBE %d %d %d\\n' % (len(f._PENDING_DATACLASSES),\n"
             "        'http.client' in sys.modules, len(set(compiled))))\n"
             "atexit.register(report)\n")
    argv = ["-c", probe + ferrus.ferrus_boot_code(), "-C", str(project), "--version"]
    done = subprocess.run([sys.executable] + argv, capture_output=True, text=True, env=env(),
                          timeout=120)
    assert done.returncode == 0, done.stderr
    pending, http_loaded, patterns = map(int, done.stderr.split("PROBE ")[1].split())
    assert pending > 10, "the server made the dataclasses it does not use"
    assert not http_loaded
    assert patterns == 0, "ferrus compiled %d patterns before the server did anything" % patterns


def test_module_level_patterns_are_compiled_when_first_used():
    """A pattern compiled at import costs every start of every command; LazyPattern
    compiles it on first use (tests/test_architecture.py keeps new ones lazy)."""
    pattern = ferrus.LazyPattern(r"(?P<word>[a-z]+)-(\d+)")
    assert pattern._compiled is None
    assert pattern.match("abc-12").group("word") == "abc"
    assert pattern.sub(r"\2", "abc-12") == "12" and pattern.groups == 2
    assert pattern.findall("a-1 b-2") == [("a", "1"), ("b", "2")]
    assert "match" in vars(pattern)          # looked up once, then the instance's own


def test_an_entry_an_older_ferrus_registered_still_points_here(tmp_path):
    older = {"command": os.path.abspath(sys.executable),
             "args": ["-c", ferrus.ferrus_boot_code(marked=False), "-C", str(tmp_path),
                      "serve", "--role", "executor"]}
    assert ferrus.entry_points_here(older, str(tmp_path))
    severity, words = ferrus.entry_mismatch(older, str(tmp_path))
    assert severity == "warning" and "older ferrus" in words
    current = dict(older, args=["-c", ferrus.ferrus_boot_code()] + older["args"][2:])
    assert ferrus.entry_mismatch(current, str(tmp_path)) is None
    without_site = dict(older, args=["-S"] + current["args"])
    assert ferrus.entry_points_here(without_site, str(tmp_path))
    assert ferrus.entry_mismatch(without_site, str(tmp_path)) is None
    other = dict(older, args=["-S", "-c", "import other"] + older["args"][2:])
    assert not ferrus.entry_points_here(other, str(tmp_path))
    assert ferrus.entry_mismatch(other, str(tmp_path))[0] == "error"


def test_ferrus_starts_itself_without_site_unless_coverage_measures_it(monkeypatch):
    """site's .pth files cost every start of an agent's server and ferrus needs nothing
    from site-packages; coverage.py starts in a measured process through one of them."""
    for name in ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    argv = ferrus.ferrus_boot_argv()
    assert argv[:3] == [os.path.abspath(sys.executable), "-S", "-c"]
    done = subprocess.run(argv + ["--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ferrus" in done.stdout, done.stderr
    entry = ferrus.ferrus_server_entry("/p", "executor", "claude-code")
    assert entry["args"][:2] == ["-S", "-c"]
    monkeypatch.setenv("COVERAGE_PROCESS_CONFIG", "x")
    assert ferrus.ferrus_boot_argv()[1:2] == ["-c"]
