"""[sandbox]: a task's agents and checks write only their worktree, temp folder and state.

The config and the command lines are checked everywhere; the real confinement runs
bubblewrap on Linux (skipped, saying why, where bwrap is missing or cannot make a
sandbox): a hostile command in a task's worktree cannot write the home folder, /tmp
outside its own temp folder, the main repository's .git/hooks or its refs, while it
writes its worktree and `git status` / `git add` work there, and ferrus's own MCP server
answers it through the bridge although .ferrus/ is hidden from it.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

import ferrus
from conftest import set_config

GIT_IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
                "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def git(where, *args, check=True):
    return subprocess.run(["git"] + list(args), cwd=str(where), capture_output=True, text=True,
                          env=dict(os.environ, **GIT_IDENTITY), check=check)


# -- config ----------------------------------------------------------------------------------

def test_defaults_are_off_with_network_on():
    config = ferrus.parse_sandbox_table("ferrus.toml", {})
    assert (config.enabled, config.network, config.writable, config.hidden) == (
        False, True, [], [])


def test_a_place_table_overrides_only_the_keys_it_names():
    base = ferrus.parse_sandbox_table("ferrus.toml", {"enabled": True,
                                                       "writable": ["~/.cache/pip"]})
    place = ferrus.parse_sandbox_table("ferrus.toml", {"network": False},
                                        where="places.box1.sandbox", inherit=base)
    assert (place.enabled, place.network, place.writable) == (True, False, ["~/.cache/pip"])
    assert base.network is True           # the global table is not changed by the place's


@pytest.mark.parametrize("table, key, words", [
    ({"enabled": "yes"}, "sandbox.enabled", "must be true or false"),
    ({"writable": "/opt"}, "sandbox.writable", "must be an array of paths"),
    ({"hidden": ["secrets"]}, "sandbox.hidden", "absolute paths or paths under ~/"),
])
def test_a_bad_value_names_its_key_and_what_it_should_be(table, key, words):
    with pytest.raises(ferrus.FerrusError) as caught:
        ferrus.parse_sandbox_table("ferrus.toml", table)
    assert "[%s]" % key in caught.value.message and words in caught.value.message
    assert "ferrus.toml" in caught.value.hint


def test_problems_are_collected_and_unknown_keys_reported_when_asked():
    found, unknown = [], []
    config = ferrus.parse_sandbox_table("ferrus.toml", {"enabled": 1, "netwrk": False},
                                         found=found, unknown=unknown)
    assert len(found) == 1 and unknown == ["sandbox.netwrk"] and config.enabled is False


# -- the tool ---------------------------------------------------------------------------------

def test_linux_without_bwrap_refuses_and_says_how_to_install_it():
    with pytest.raises(ferrus.SandboxUnavailable) as caught:
        ferrus.sandbox_tool("linux", which=lambda name: None)
    assert "bubblewrap" in caught.value.message
    assert "apt-get install bubblewrap" in caught.value.hint
    assert "enabled = false" in caught.value.hint


def test_a_bwrap_that_cannot_make_namespaces_is_refused_with_its_words():
    def run(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, b"", b"bwrap: No permissions to create "
                                                         b"new namespace\n")
    ferrus._BWRAP_WORKS.pop("/opt/fake/bwrap", None)
    with pytest.raises(ferrus.SandboxUnavailable) as caught:
        ferrus.sandbox_tool("linux", which=lambda name: "/opt/fake/bwrap", run=run)
    assert "No permissions to create new namespace" in caught.value.message
    assert "user namespaces" in caught.value.hint


def test_windows_has_no_sandbox_and_never_runs_a_task_unconfined():
    with pytest.raises(ferrus.SandboxUnavailable) as caught:
        ferrus.sandbox_tool("win32")
    assert "no sandbox on win32" in caught.value.message
    assert "Linux place" in caught.value.hint


def test_a_task_sandbox_refuses_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(ferrus, "sandbox_tool", lambda: (_ for _ in ()).throw(
        ferrus.SandboxUnavailable("no sandbox here", "install one")))
    task = ferrus.AgentSandbox(ferrus.SandboxConfig(enabled=True), str(tmp_path),
                               str(tmp_path / "state"))
    with pytest.raises(ferrus.SandboxUnavailable):
        task.wrap(["true"])
    assert not (tmp_path / "state").exists()


# -- command lines ----------------------------------------------------------------------------

def plan_for(tmp_path, **changes):
    hidden = tmp_path / "hidden"
    (hidden / "inner").mkdir(parents=True)
    fields = dict(cwd=str(tmp_path), writable=[str(hidden / "inner")],
                  readable=[(str(tmp_path / "cfg"), str(hidden / "config"))],
                  hidden=[str(hidden)], empty_file=str(tmp_path / "empty"), network=True,
                  env={"TMPDIR": "/t"})
    fields.update(changes)
    return ferrus.SandboxPlan(**fields)


def test_bwrap_hides_a_folder_before_what_comes_back_inside_it_and_then_seals_it(tmp_path):
    argv = ferrus.bwrap_argv(plan_for(tmp_path), ["echo", "hi"])
    hidden = str(tmp_path / "hidden")
    tmpfs = argv.index("--tmpfs")
    assert argv[tmpfs + 1] == hidden
    assert tmpfs < argv.index(str(hidden) + "/inner") < argv.index("--remount-ro")
    assert argv[argv.index("--remount-ro") + 1] == hidden
    assert argv[-3:] == ["--", "echo", "hi"]
    assert "--unshare-net" not in argv and "--new-session" in argv
    assert argv[argv.index("--unsetenv") + 1] == "SSH_AUTH_SOCK"


def test_bwrap_without_network_and_for_a_terminal(tmp_path):
    argv = ferrus.bwrap_argv(plan_for(tmp_path, network=False), ["sh"], terminal=True)
    assert "--unshare-net" in argv and "--new-session" not in argv


def test_sandbox_exec_gets_paths_as_parameters_never_in_the_profile_text(tmp_path):
    evil = tmp_path / 'x") (allow file-write* (subpath "/'
    evil.mkdir()
    plan = plan_for(tmp_path, writable=[str(evil)], network=False)
    profile, params = ferrus.sandbox_exec_profile(plan)
    assert str(evil) not in profile and str(evil) in params.values()
    assert profile.index("(deny file-write*)") < profile.index("(allow file-write* (subpath")
    assert "(deny network* (remote ip))" in profile
    argv = ferrus.sandbox_exec_argv(plan, ["make"])
    assert argv[:2] == [ferrus.SANDBOX_EXEC, "-p"] and argv[-1] == "make"
    assert "-u" in argv and "TMPDIR=/t" in argv


def test_the_repository_config_shown_inside_keeps_no_remote_or_credential(tmp_path):
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "remote.origin.url", "https://user:s3cret@example.com/r.git")
    git(tmp_path, "config", "credential.helper", "store")
    git(tmp_path, "config", "core.hooksPath", "hooks-of-the-task")
    git(tmp_path, "config", "core.autocrlf", 'in"put')
    target = ferrus.sanitized_git_config(str(tmp_path / ".git"), str(tmp_path / "copy"))
    text = open(target).read()
    assert "s3cret" not in text and "credential" not in text and "hooksPath" not in text
    assert "[core]" in text and "repositoryformatversion" in text
    shown = git(tmp_path, "config", "--file", target, "core.autocrlf").stdout.strip()
    assert shown == 'in"put'


# -- the real thing: bubblewrap ---------------------------------------------------------------

def bwrap_or_skip():
    try:
        return ferrus.sandbox_tool()
    except ferrus.SandboxUnavailable as err:
        pytest.skip("no sandbox on this machine: %s" % err.message)


@pytest.fixture
def visible(tmp_path):
    """A folder outside /tmp (which the sandbox hides as a whole), so each test sees the
    sandbox's own rules at work rather than the hidden /tmp."""
    folder = tempfile.mkdtemp(prefix="ferrus-sandbox-test-", dir="/var/tmp")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def task_world(visible):
    """A repository with a task worktree (made by ferrus), a sibling repository, a fake home
    with secrets, and the task's TaskSandbox."""
    root = os.path.join(visible, "repo")
    os.makedirs(os.path.join(root, "src"))
    git(root, "init", "-q", "-b", "main")
    with open(os.path.join(root, "src", "a.txt"), "w") as handle:
        handle.write("one\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    head = git(root, "rev-parse", "HEAD").stdout.strip()
    worktree = os.path.join(visible, "repo.ferrus-worktrees", "t-1")
    ferrus.create_task_worktree(root, worktree, "ferrus/t-1", head)
    other = os.path.join(visible, "other-repo")
    os.makedirs(other)
    git(other, "init", "-q")
    home = os.path.join(visible, "home")
    os.makedirs(os.path.join(home, ".ssh"))
    with open(os.path.join(home, ".ssh", "id_ed25519"), "w") as handle:
        handle.write("PRIVATE KEY\n")
    state = os.path.join(root, ".ferrus", "tasks", "t-1", "sandbox")
    os.makedirs(state)
    with open(os.path.join(root, ".ferrus", "STATE.json"), "w") as handle:
        handle.write("{}\n")
    task = ferrus.AgentSandbox(ferrus.SandboxConfig(enabled=True), worktree, state,
                               repository=root, home=home, tool=bwrap_or_skip())
    return {"root": root, "worktree": worktree, "home": home, "other": other, "head": head,
            "task": task, "visible": visible}


def run_inside(task, script, env=None, **kwargs):
    argv = task.wrap(["/bin/sh", "-c", script])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **GIT_IDENTITY, **(env or {})), **kwargs)


HOSTILE = r"""
try() { if sh -c "$1" 2>/dev/null; then echo "WROTE $2"; else echo "REFUSED $2"; fi; }
try 'echo x > "$HOME/evil"' home
try 'echo x > /tmp/evil' tmp
try 'echo x > /var/tmp/evil' var-tmp
try 'echo x > "$TMPDIR/scratch"' own-temp
try 'echo "#!/bin/sh" > "$REPO/.git/hooks/pre-commit"' hooks
try 'echo x > "$REPO/src/a.txt"' checkout
try 'echo 0000 > "$REPO/.git/refs/heads/main"' target-ref
try 'echo gitdir: /elsewhere > .git' dot-git
try 'rm -rf "$REPO/.git/objects"' objects
try 'cat "$HOME/.ssh/id_ed25519" | grep -q PRIVATE' secret
try 'test -e "$OTHER/.git"' other-repo
try 'test -e "$REPO/.ferrus/STATE.json"' ferrus-state
try 'echo changed > src/a.txt && echo new > src/b.txt' worktree
try 'git status --short > "$TMPDIR/status"' git-status
try 'git add -A' git-add
try 'git diff --cached --stat | grep -q "2 files changed"' git-diff-cached
try 'git commit -qm hostile' git-commit
"""


def test_a_hostile_command_writes_its_worktree_and_nothing_else(task_world):
    world = task_world
    done = run_inside(world["task"], HOSTILE, env={
        "HOME": world["home"], "REPO": world["root"], "OTHER": world["other"]})
    said = dict(line.split(" ", 1)[::-1] for line in done.stdout.split("\n") if line)
    assert said == {
        "home": "REFUSED", "tmp": "REFUSED", "var-tmp": "REFUSED", "own-temp": "WROTE",
        "hooks": "REFUSED", "checkout": "REFUSED", "target-ref": "REFUSED",
        "dot-git": "REFUSED", "objects": "REFUSED", "secret": "REFUSED",
        "other-repo": "REFUSED", "ferrus-state": "REFUSED", "worktree": "WROTE",
        "git-status": "WROTE", "git-add": "WROTE", "git-diff-cached": "WROTE",
        "git-commit": "REFUSED"}, done.stdout + done.stderr
    # Nothing of it reached the machine outside.
    root = world["root"]
    assert not os.path.exists(os.path.join(world["home"], "evil"))
    assert not os.path.exists("/tmp/evil") and not os.path.exists("/var/tmp/evil")
    assert not os.path.exists(os.path.join(root, ".git", "hooks", "pre-commit"))
    assert open(os.path.join(root, "src", "a.txt")).read() == "one\n"
    assert git(root, "rev-parse", "main").stdout.strip() == world["head"]
    assert git(root, "fsck", "--no-dangling").returncode == 0
    assert open(os.path.join(world["worktree"], "src", "a.txt")).read() == "changed\n"
    # The worktree is still ferrus's: its .git points where ferrus made it point, and
    # ferrus records the work (with the index the sandboxed git add wrote) as a commit.
    checkout = ferrus.task_checkout(root, world["worktree"])
    commit = ferrus.snapshot_worktree(checkout, world["head"], [], "submission")
    files = git(root, "show", "--stat", "--format=", commit).stdout
    assert "src/a.txt" in files and "src/b.txt" in files
    assert git(root, "show", commit + ":src/b.txt").stdout == "new\n"


def test_writable_adds_a_path_and_hidden_hides_one(task_world):
    world = task_world
    cache = os.path.join(world["visible"], "cache")
    secret = os.path.join(world["visible"], "secret.txt")
    os.makedirs(cache)
    with open(secret, "w") as handle:
        handle.write("s\n")
    world["task"].config = ferrus.SandboxConfig(enabled=True, writable=[cache],
                                                 hidden=[secret])
    done = run_inside(world["task"], 'echo x > "%s/ok" && test ! -s "%s" && echo FINE'
                      % (cache, secret))
    assert done.stdout.strip() == "FINE", done.stderr
    assert os.path.isfile(os.path.join(cache, "ok"))


def test_network_off_reaches_no_server_and_on_reaches_one(task_world):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]

    def answer():
        with contextlib.suppress(OSError):       # closed when the test ends
            while True:
                listener.accept()[0].close()
    threading.Thread(target=answer, daemon=True).start()
    probe = ("python3 -c \"import socket; socket.create_connection(('127.0.0.1', %d), 5)\" "
             "2>/dev/null && echo CONNECTED || echo NO-NETWORK" % port)
    task = task_world["task"]
    assert run_inside(task, probe).stdout.strip() == "CONNECTED"
    task.config = ferrus.SandboxConfig(enabled=True, network=False)
    assert run_inside(task, probe).stdout.strip() == "NO-NETWORK"
    listener.close()


def test_a_tampered_worktree_gets_no_sandbox(task_world):
    with open(os.path.join(task_world["worktree"], ".git"), "w") as handle:
        handle.write("gitdir: %s\n" % os.path.join(task_world["other"], ".git"))
    with pytest.raises(ferrus.TamperedWorktree):
        task_world["task"].wrap(["true"])


def test_a_parallel_task_gets_its_sandbox_from_its_record(task_world):
    root = task_world["root"]
    os.unlink(os.path.join(root, ".ferrus", "STATE.json"))      # the fixture's stand-in
    ferrus.init_project(root, report=lambda message: None)
    store = ferrus.Store(root)
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "a task").data["task_id"]
    worktree = os.path.join(task_world["visible"], "repo.ferrus-worktrees", task)
    ferrus.create_task_worktree(root, worktree, "ferrus/" + task, task_world["head"])
    ferrus.update_task(store, ferrus.ORCHESTRATOR, task, "prepare_task", {
        "status": "running", "worktree": worktree, "workdir": os.path.join(worktree, "src"),
        "branch": "ferrus/" + task, "base": task_world["head"], "store": "worktree"})
    assert ferrus.AgentSandbox.for_task(store.for_task(task), ferrus.SandboxConfig()) is None
    confined = ferrus.AgentSandbox.for_task(store.for_task(task),
                                        ferrus.SandboxConfig(enabled=True))
    confined.tool = bwrap_or_skip()
    done = run_inside(confined, 'pwd; echo x > mine && echo x > "%s/src/theirs" 2>/dev/null '
                                '|| echo REFUSED' % task_world["worktree"])
    assert done.stdout.split() == [os.path.join(worktree, "src"), "REFUSED"], done.stderr
    assert os.path.isfile(os.path.join(worktree, "src", "mine"))
    assert os.path.isdir(store.for_task(task).task_path("sandbox"))


# -- ferrus's MCP server, outside, for an agent inside ----------------------------------------

def test_an_agent_inside_reaches_ferrus_through_the_bridge_though_ferrus_dir_is_hidden(
        task_world):
    world = task_world
    root = world["root"]
    os.unlink(os.path.join(root, ".ferrus", "STATE.json"))      # the fixture's stand-in
    ferrus.init_project(root, report=lambda message: None)
    set_config(root, "")
    relay = ("import sys; sys.path[:0] = [%r]; import ferrus, os; "
             "print('state-visible', os.path.exists(%r), file=sys.stderr); "
             "sys.exit(ferrus.relay_mcp_stdio(os.environ[ferrus.SANDBOX_RELAY_ENV]))"
             % (os.path.dirname(ferrus.FERRUS_FILE), os.path.join(root, ".ferrus", "STATE.json")))
    launch = ferrus.Launch(argv=[sys.executable, "-c", relay], stdin=None, env={})
    task = world["task"]
    task.root = root
    task.config = ferrus.SandboxConfig(enabled=True, network=False)   # the socket still works
    wrapped = task.wrap_launch(launch, "executor", "scripted")
    bridge = task.bridges["executor"]
    try:
        messages = [
            {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
             "params": {"name": "status", "arguments": {}}}]
        done = subprocess.run(wrapped.argv, input="".join(json.dumps(m) + "\n"
                                                          for m in messages),
                              capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, FERRUS_SESSION="s-1", **wrapped.env))
    finally:
        task.close()
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert [reply["id"] for reply in replies] == [1, 2], done.stderr
    assert replies[0]["result"]["serverInfo"]["name"] == "ferrus"
    assert "Idle" in replies[1]["result"]["content"][0]["text"]
    assert "state-visible False" in done.stderr
    assert not os.path.exists(bridge.path)


def test_the_relay_says_where_it_could_not_connect(tmp_path, capsys):
    read_end, write_end = os.pipe()
    code = ferrus.relay_mcp_stdio(str(tmp_path / "gone.sock"), "s-1", read_end, write_end)
    os.close(read_end)
    os.close(write_end)
    assert code == 1
    assert "cannot reach ferrus's MCP server" in capsys.readouterr().err


def talk(bridge, hello, messages):
    """What the bridge's server answers ``messages`` after the relay's ``hello`` line."""
    client = socket.socket(socket.AF_UNIX)
    client.connect(bridge.path)
    stream = client.makefile("rwb")
    stream.write((json.dumps(hello) + "\n").encode())
    for message in messages:
        stream.write((json.dumps(message) + "\n").encode())
    try:
        stream.flush()
        client.shutdown(socket.SHUT_WR)
        replies = [json.loads(line) for line in stream.read().splitlines()]
    except ConnectionResetError:
        replies = []                 # refused: closed before reading what was sent
    client.close()
    return replies


HANDSHAKE = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t",
                                                                        "version": "1"}}},
    {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}]


def test_the_bridge_serves_its_role_and_only_sessions_of_its_own_task(project):
    store = ferrus.Store(str(project))
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "a task").data["task_id"]
    other = ferrus.op_enqueue_task(store, ferrus.HUMAN, "another").data["task_id"]
    for started in (task, other):           # as the runner starts them: a state of their own
        ferrus.atomic_write(store.for_task(started).task_path("STATE.json"),
                            ferrus.StateData().to_json())
    bridge = ferrus.SandboxMcpBridge(str(project), "executor", "scripted", task=task).start()
    try:
        replies = talk(bridge, {"session": task + ".s-1"}, HANDSHAKE)
        refused = talk(bridge, {"session": other + ".s-1"}, HANDSHAKE)
        no_hello = talk(bridge, {}, HANDSHAKE)
    finally:
        bridge.close()
    tools = {tool["name"] for tool in replies[1]["result"]["tools"]}
    assert "submit" in tools and "approve" not in tools       # the executor's, nothing more
    assert refused == [] and no_hello == []                    # another task's: no server
    assert not os.path.exists(bridge.folder)


# -- does each agent CLI start inside? --------------------------------------------------------

def test_agent_report_tells_a_cli_that_starts_inside_from_one_that_does_not(project, visible):
    tool = bwrap_or_skip()
    good = os.path.join(visible, "good-agent")
    bad = os.path.join(visible, "bad-agent")
    with open(good, "w") as handle:
        handle.write("#!/bin/sh\necho good 1.0 > \"$TMPDIR/v\" && cat \"$TMPDIR/v\"\n")
    with open(bad, "w") as handle:
        handle.write("#!/bin/sh\necho 1 > \"$HOME/.bad-agent-state\" || exit 3\necho bad 1.0\n")
    for path in (good, bad):
        os.chmod(path, 0o755)
    set_config(project, """
[agents.custom.good]
interactive = [%s]
headless = [%s]
version_args = []

[agents.custom.bad]
interactive = [%s]
headless = [%s]
version_args = []

[hq.supervisor]
agent = "good"

[hq.executor]
agent = "bad"
""" % ((json.dumps(good),) * 2 + (json.dumps(bad),) * 2))
    home = os.path.join(visible, "home")
    os.makedirs(home)
    rows = {row["role"]: row for row in ferrus.sandbox_agent_report(str(project), tool=tool,
                                                                     home=home)}
    assert rows["supervisor"]["works"] is True
    assert "starts inside the sandbox (bwrap): good 1.0" == rows["supervisor"]["note"]
    assert rows["executor"]["works"] is False
    assert "fails inside the sandbox (exit 3)" in rows["executor"]["note"]
    assert not os.path.exists(os.path.join(home, ".bad-agent-state"))


def test_agent_report_without_a_sandbox_says_so(project, monkeypatch):
    def unavailable():
        raise ferrus.SandboxUnavailable("no sandbox here", "install bubblewrap")
    monkeypatch.setattr(ferrus, "sandbox_tool", unavailable)
    rows = ferrus.sandbox_agent_report(str(project))
    assert rows == [{"role": None, "agent": None, "works": False,
                     "problem": "no sandbox here", "hint": "install bubblewrap"}]


def test_the_real_claude_cli_starts_inside(project, visible):
    tool = bwrap_or_skip()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fake_anthropic import find_agent
    claude = find_agent("claude")
    if not claude:
        pytest.skip("the claude CLI is not installed (npm install @anthropic-ai/claude-code)")
    set_config(project, '[hq.supervisor]\nagent = "claude-code"\n\n'
                        '[hq.executor]\nagent = "claude-code"\n')
    home = os.path.join(visible, "home")
    os.makedirs(home)
    old_path = os.environ["PATH"]
    os.environ["PATH"] = os.path.dirname(claude) + os.pathsep + old_path
    try:
        rows = ferrus.sandbox_agent_report(str(project), tool=tool, home=home)
    finally:
        os.environ["PATH"] = old_path
    assert [row["works"] for row in rows] == [True, True], rows
    assert "Claude Code" in rows[0]["note"]


# -- a whole task, its agents confined --------------------------------------------------------

def scripted_project(visible, config):
    """visible/proj: a repository with ferrus set up by ``config`` (the scripted agent in
    both roles), everything committed on main."""
    root = os.path.join(visible, "proj")
    os.makedirs(root)
    git(root, "init", "-q", "-b", "main")
    ferrus.init_project(root, report=lambda message: None)
    set_config(root, config)
    ferrus.register_agents(root, {"supervisor": ("scripted", None),
                                  "executor": ("scripted", None)}, report=lambda m: None)
    with open(os.path.join(root, ".gitignore"), "w") as handle:
        handle.write(".ferrus/\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    return root


def test_a_task_runs_to_complete_with_its_agents_confined(visible):
    """`ferrus run` with the scripted agent in both roles, each started in the sandbox: the
    executor's hostile shell lines fail, its work lands, the reviewer approves through
    the bridge (the `ferrus serve` its MCP configuration starts relays inside)."""
    tool = bwrap_or_skip()
    from conftest import SCRIPTED_CONFIG
    root = scripted_project(visible, SCRIPTED_CONFIG)
    memory = os.path.join(visible, "memory")
    home = os.path.join(visible, "home")
    os.makedirs(memory)
    os.makedirs(home)
    store = ferrus.Store(root)
    # Under `make coverage` every Python process the test starts writes its data file to
    # the checkout's .coverage-data/, the sandboxed agents' too.
    measured = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            ".coverage-data")
    task_sandbox = ferrus.AgentSandbox(
        ferrus.SandboxConfig(enabled=True, writable=[memory] + (
            [measured] if os.path.isdir(measured) else [])), root,
        os.path.join(root, ".ferrus", "sandbox"), repository=root, home=home, tool=tool,
        root=root)

    def inner(slot):
        config = store.config()
        choice = getattr(config, slot.role)
        adapter = ferrus.adapter_for(config, choice.agent)
        return adapter.headless(root, slot.role, slot.session.prompt, choice.model), \
            adapter.parse_line
    launcher = task_sandbox.launcher(inner, lambda role: "scripted")
    task = ("Do the work.\nSHELL echo x > %s/evil\nSHELL echo x > /tmp/evil-from-task\n"
            "SHELL echo x > %s/.git/hooks/post-checkout\n"
            "SHELL echo forged > %s/.ferrus/STATE.json\n" % (home, root, root))
    said = []
    old = dict(os.environ)
    os.environ.update(SCRIPTED_DIR=memory, HOME=home, **GIT_IDENTITY)
    try:
        code = ferrus.run_loop(store, task=task, launcher=launcher, timeout=120,
                               out=said.append)
    finally:
        os.environ.clear()
        os.environ.update(old)
        task_sandbox.close()
    assert code == ferrus.RUN_COMPLETE, "\n".join(said)
    assert store.read_state().state == ferrus.TaskState.COMPLETE
    assert open(os.path.join(root, "work.txt")).read() == "work\n"
    assert not os.path.exists(os.path.join(home, "evil"))
    assert not os.path.exists("/tmp/evil-from-task")
    assert not os.path.exists(os.path.join(root, ".git", "hooks", "post-checkout"))
    logs = os.path.join(root, ".ferrus", "logs")
    executor_said = "".join(open(os.path.join(logs, name)).read() for name in os.listdir(logs)
                            if name.startswith("executor"))
    assert executor_said.count("Read-only file system") == 4, executor_said


# -- `ferrus run --parallel` with [sandbox] on ------------------------------------------------

def sandboxed_queue_project(visible):
    """A repository whose queue runs with [sandbox] on; the scripted agent keeps its memory
    in visible/memory, made writable inside."""
    from conftest import SCRIPTED_CONFIG
    memory = os.path.join(visible, "memory")
    os.makedirs(memory, exist_ok=True)
    return ferrus.Store(scripted_project(
        visible, SCRIPTED_CONFIG + "\n[sandbox]\nenabled = true\nwritable = [%s]\n\n"
                                   "[parallel]\nmax_tasks = 2\n" % json.dumps(memory)))


def test_a_parallel_run_confines_each_tasks_agents_and_a_hostile_one_still_merges(
        visible, monkeypatch):
    """Two tasks through `ferrus run --parallel` with [sandbox] on: the hostile executor's
    writes outside its worktree (home, /var/tmp, the project's checkout, its .git/hooks
    and .ferrus/) all fail, its work and the other task's are merged."""
    bwrap_or_skip()
    store = sandboxed_queue_project(visible)
    root = store.root
    home = os.path.join(visible, "home")
    memory = os.path.join(visible, "memory")
    os.makedirs(home)
    monkeypatch.setenv("HOME", home)
    monkeypatch.setenv("SCRIPTED_DIR", memory)
    for name, value in GIT_IDENTITY.items():
        monkeypatch.setenv(name, value)
    targets = [os.path.join(home, "evil"), "/var/tmp/ferrus-evil-%d" % os.getpid(),
               os.path.join(root, "evil.txt"), os.path.join(root, ".git", "hooks", "pre-commit")]
    hostile = "Hostile work.\n\nWRITE work.txt: work\n" + "".join(
        "SHELL echo x > %s\n" % path for path in targets) + \
        "SHELL echo forged > %s/.ferrus/STATE.json\n" % root
    tasks = [ferrus.op_enqueue_task(store, ferrus.HUMAN, text).data["task_id"]
             for text in (hostile, "Plain work.\n\nWRITE plain.txt: plain\n")]
    lines = []
    try:
        code = ferrus.run_parallel(store, 2, timeout=240, out=lines.append)
    finally:
        written = [path for path in targets if os.path.exists(path)]
        for path in written:
            os.unlink(path)
    assert not written, written
    logs = os.path.join(root, ".ferrus", "logs")
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines) + "".join(
        open(os.path.join(logs, name)).read()[-1500:] for name in sorted(os.listdir(logs))
        if "executor" in name)[-3000:]
    assert {row["id"]: row["status"] for row in ferrus.task_rows(store)} == {
        task: "merged" for task in tasks}
    assert git(root, "show", "main:work.txt").stdout == "work\n"
    assert git(root, "show", "main:plain.txt").stdout == "plain\n"
    assert json.loads(open(os.path.join(root, ".ferrus", "STATE.json")).read())["rev"]
    logs = os.path.join(root, ".ferrus", "logs")
    said = "".join(open(os.path.join(logs, name)).read() for name in os.listdir(logs)
                   if tasks[0] in name and "executor" in name)
    assert said.count("Read-only file system") + said.count("No such file or directory") >= \
        len(targets), said
    for task in tasks:      # each task's sandbox folder went with it
        assert not os.path.exists(store.for_task(task).task_path("sandbox"))


def test_a_parallel_run_with_the_sandbox_on_and_no_bwrap_refuses_to_start(visible,
                                                                          monkeypatch):
    store = sandboxed_queue_project(visible)
    ferrus.op_enqueue_task(store, ferrus.HUMAN, "Plain work.\n\nWRITE plain.txt: plain\n")

    def missing():
        raise ferrus.SandboxUnavailable("bubblewrap (bwrap) is not installed",
                                        ferrus.BWRAP_INSTALL_HINT)
    monkeypatch.setattr(ferrus, "sandbox_tool", missing)
    with pytest.raises(ferrus.FerrusError) as refused:
        ferrus.run_parallel(store, 2, timeout=30, out=lambda line: None)
    assert "bubblewrap" in refused.value.message and "apt" in refused.value.hint
    assert {row["status"] for row in ferrus.task_rows(store)} == {"queued"}


def test_an_agent_program_named_through_an_absolute_link_in_a_visible_folder_starts(
        task_world):
    """A virtual environment outside the hidden folders names its Python through an
    absolute link (bin/python -> /usr/bin/python3.9): bubblewrap cannot make a mount point
    through such a link, so the file is shown at the link's real path, which the link
    still reaches inside."""
    world = task_world
    folder = os.path.join(world["visible"], "venv", "bin")
    os.makedirs(folder)
    program = os.path.join(folder, "agent")
    os.symlink(os.path.realpath("/bin/sh"), program)
    assert os.path.isabs(os.readlink(program))
    done = subprocess.run(world["task"].wrap([program, "-c", "echo STARTED"]),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["STARTED"]


def test_an_agent_program_in_a_hidden_folder_still_starts(task_world, tmp_path):
    """The agent CLI the configuration names may live where the sandbox hides (a virtual
    environment under /tmp): the program itself, and its pyvenv.cfg, stay readable where
    they are named; the rest of that folder stays hidden."""
    world = task_world
    venv = tempfile.mkdtemp(prefix="ferrus-venv-", dir="/tmp")
    try:
        os.makedirs(os.path.join(venv, "bin"))
        program = os.path.join(venv, "bin", "agent")
        os.symlink("/bin/sh", program)
        with open(os.path.join(venv, "pyvenv.cfg"), "w") as handle:
            handle.write("home = /usr/bin\n")
        with open(os.path.join(venv, "secret"), "w") as handle:
            handle.write("s\n")
        argv = world["task"].wrap([program, "-c", 'cat "$1"; test -e "$SECRET" || echo HIDDEN',
                                   "sh", os.path.join(venv, "pyvenv.cfg")])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, SECRET=os.path.join(venv, "secret")))
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["home", "=", "/usr/bin", "HIDDEN"]
    finally:
        shutil.rmtree(venv)


def test_a_run_that_stops_early_leaves_no_bridge_behind(visible, monkeypatch):
    """A run that times out (or is interrupted) while sandboxed agents work ends their
    MCP bridges too: no server outside, no socket folder left in the temp dir."""
    bwrap_or_skip()
    store = sandboxed_queue_project(visible)
    monkeypatch.setenv("SCRIPTED_DIR", os.path.join(visible, "memory"))
    for name, value in GIT_IDENTITY.items():
        monkeypatch.setenv(name, value)
    folders = []
    made = ferrus.SandboxMcpBridge.__init__

    def recording(self, *args, **kwargs):
        made(self, *args, **kwargs)
        folders.append(self.folder)
    monkeypatch.setattr(ferrus.SandboxMcpBridge, "__init__", recording)
    ferrus.op_enqueue_task(store, ferrus.HUMAN, "Slow.\n\nSHELL sleep 60\n")
    code = ferrus.run_parallel(store, 1, timeout=8, out=lambda line: None)
    assert code == ferrus.RUN_TIMEOUT
    assert folders and not [folder for folder in folders if os.path.exists(folder)]
