"""Sandbox: a task's agents and checks write only its worktree, temp and CLI state.

With ``[sandbox] enabled = true`` (in ferrus.toml, or per place in ``[places.NAME.sandbox]``)
every agent and check of a task runs inside the system's own confinement tool:
bubblewrap (``bwrap``) on Linux, ``sandbox-exec`` on macOS.  A SandboxPlan says what the
command sees: the whole file system read-only; the task's worktree, its temp folder, the
agent CLIs' own state folders and ``writable`` read-write; secrets (``~/.ssh``, ``~/.aws``,
``~/.config/gcloud``, ...), agent and container sockets, other repositories, ``/tmp`` and the
main repository hidden.  Of the main repository's ``.git`` only what git in a linked worktree
reads comes back (objects, refs, HEAD, info and a copy of its config without remotes or
credentials), read-only, plus the worktree's own admin folder read-write; new objects go to
a private object folder of the task (``GIT_OBJECT_DIRECTORY``, the repository's objects as
its alternate), so ``git status``, ``git add`` and ``git diff`` work while nothing the
repository already holds can be changed, and ``git commit`` fails (refs are read-only:
ferrus records the worktree itself at submit).  The network stays on unless
``network = false``.

Where no tool exists (Windows, a Linux without bubblewrap, a kernel that refuses user
namespaces) sandbox_tool raises SandboxUnavailable, which says how to install it: a task
that asked for the sandbox never runs unconfined.  TaskSandbox is one task's
confinement (its checks are wrapped with it); sandbox_agents.py adds the agents' side.
"""

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys

from .startup import SERVER_HOST_ENV, SERVER_HOST_FOLDER, SERVER_HOST_PREFIX
from .basics import FERRUS_FILE, FerrusError, deferred_dataclass
from .system import atomic_write
from .config import PLACE_HERE
from .store import FERRUS_DIR, read_task_record
from .git import run_git, task_checkout


# -- the tool: bubblewrap on Linux, sandbox-exec on macOS ---------------------------------

BWRAP_INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
    "bubblewrap; Arch: pacman -S bubblewrap; Alpine: apk add bubblewrap), or set [sandbox] "
    "enabled = false to run the tasks unconfined")
SANDBOX_EXEC = "/usr/bin/sandbox-exec"
# The variable that makes an agent's `ferrus serve` inside a sandbox relay its stdio to
# the task's MCP bridge (sandbox_agents.py) instead of serving.
SANDBOX_RELAY_ENV = "FERRUS_MCP_RELAY"


class SandboxUnavailable(FerrusError):
    """A task asked for the sandbox and this machine cannot give it: it does not start."""


# {bwrap path: None when it works, else what it said}: asked once per process.
_BWRAP_WORKS = {}


def sandbox_tool(platform=None, which=shutil.which, run=subprocess.run):
    """("bwrap" or "sandbox-exec", its path) for this machine; raises SandboxUnavailable
    (saying how to install one) where there is none or it cannot confine anything."""
    platform = platform or sys.platform
    if platform.startswith("linux"):
        path = which("bwrap")
        if not path:
            raise SandboxUnavailable("[sandbox] is enabled, but bubblewrap (bwrap) is not "
                                     "installed", BWRAP_INSTALL_HINT)
        problem = _BWRAP_WORKS.get(path, False)
        if problem is False:
            problem = _BWRAP_WORKS[path] = _bwrap_problem(path, run)
        if problem:
            raise SandboxUnavailable(
                "bubblewrap (%s) cannot make a sandbox on this machine: %s" % (path, problem),
                "it needs user namespaces: on Debian `sysctl kernel.unprivileged_userns_clone=1`, "
                "on Ubuntu 24.04+ `sysctl kernel.apparmor_restrict_unprivileged_userns=0` (or an "
                "AppArmor profile for bwrap); in a container, allow user namespaces (or run "
                "the task at another place); or set [sandbox] enabled = false")
        return "bwrap", path
    if platform == "darwin":
        if not os.path.exists(SANDBOX_EXEC) and not which("sandbox-exec"):
            raise SandboxUnavailable("[sandbox] is enabled, but %s is missing" % SANDBOX_EXEC,
                                     "it ships with macOS; set [sandbox] enabled = false to "
                                     "run the tasks unconfined")
        return "sandbox-exec", SANDBOX_EXEC if os.path.exists(SANDBOX_EXEC) else \
            which("sandbox-exec")
    raise SandboxUnavailable(
        "[sandbox] is enabled, but ferrus has no sandbox on %s (it uses bubblewrap on Linux "
        "and sandbox-exec on macOS)" % platform,
        "run the tasks at a Linux place ([places.NAME] in ferrus.toml, with its own "
        "[places.NAME.sandbox]), or set [sandbox] enabled = false to run them here unconfined")


def _bwrap_problem(path, run):
    try:
        done = run([path, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-pid", "--",
                    "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return said[-1] if said else "exit %d" % done.returncode
    return None


# -- the plan: what one sandboxed command sees -------------------------------------------

# Secrets of the user's own (under ~), hidden whatever the config says; `hidden` adds more.
SANDBOX_SECRET_PATHS = (
    "~/.ssh", "~/.aws", "~/.config/gcloud", "~/.azure", "~/.kube", "~/.docker", "~/.gnupg",
    "~/.password-store", "~/.netrc", "~/.git-credentials", "~/.config/gh", "~/.config/hub",
    "~/.pypirc", "~/.npmrc", "~/.vault-token", "~/.terraform.d", "~/.local/share/keyrings",
    "~/.config/op", "~/.m2/settings.xml", "~/.gradle/gradle.properties", "~/.cargo/credentials",
    "~/.cargo/credentials.toml")
# Sockets that act for the user (ssh-agent and gpg-agent live in the runtime folder) or
# for root (a container engine): a read-only mount does not stop connect().
SANDBOX_SOCKET_PATHS = ("/run/user/{uid}", "/run/docker.sock", "/var/run/docker.sock",
                        "/run/podman", "/run/containerd", "/run/crio")
# Variables that point at such a socket.
# And the server host's socket (server_host.py): it serves outside any sandbox.
SANDBOX_UNSET_VARIABLES = ("SSH_AUTH_SOCK", "GPG_AGENT_INFO", "DOCKER_HOST",
                           "CONTAINER_HOST", SERVER_HOST_ENV)
# Where each built-in agent CLI keeps its own state (a folder ending in / is made when
# missing, as the CLI would make it; the others are shown only when they exist).
SANDBOX_AGENT_STATE = {
    "claude-code": ("~/.claude/", "~/.claude.json", "~/.config/claude"),
    "codex": ("$CODEX_HOME/", "~/.codex/"),
    "qwen-code": ("~/.qwen/",),
    "gemini-cli": ("~/.gemini/",),
}
# What git in a linked worktree reads of the repository's own .git (besides its config,
# of which a copy without remotes and credentials is shown, and its admin folder).
SANDBOX_GIT_ENTRIES = ("objects", "refs", "packed-refs", "HEAD", "info", "shallow",
                       "reftable", "modules", "lfs")
# Of the repository's config, only what says how to read the repository; the rest
# (remotes with their URLs, credential helpers, url rewrites, hooks) stays outside.
_SANDBOX_GIT_SECTIONS = ("core", "extensions", "index")
_SANDBOX_GIT_DROPPED = ("core.hookspath", "core.fsmonitor", "core.sshcommand", "core.askpass",
                        "core.editor", "core.pager", "core.gitproxy", "core.worktree",
                        "core.alternaterefscommand", "core.attributesfile",
                        "core.excludesfile")
# Above this many entries, a folder is not searched for other repositories.
_SANDBOX_SCAN_LIMIT = 5000


@deferred_dataclass
class SandboxPlan:
    """Everything one sandboxed command may see and write, as absolute real paths.

    ``readable`` holds (source, target) pairs shown read-only at target (a file shown in
    place, or the config copy shown as the repository's); ``writable`` paths are shown
    read-write; ``hidden`` ones are empty folders or empty files.  Deeper paths win over
    the folders they are in, so a readable file inside the writable worktree (its .git
    pointer) stays read-only, and a part of a hidden repository can come back."""

    cwd: str
    writable: list
    readable: list
    hidden: list
    empty_file: str
    network: bool = True
    env: dict = dataclasses.field(default_factory=dict)
    unset: tuple = SANDBOX_UNSET_VARIABLES


def _real(path):
    return os.path.realpath(os.path.abspath(path))


def _expand(path, home):
    """``path`` with ~ (and $CODEX_HOME & co.) expanded; None when it names nothing here."""
    if path.startswith("$"):
        name, _, rest = path[1:].partition("/")
        value = os.environ.get(name)
        return os.path.join(value, rest) if value else None
    if path == "~" or path.startswith("~/"):
        return os.path.join(home, path[2:]) if home else None
    return path


def _depth(path):
    return len([part for part in path.split(os.sep) if part])


def _inside(path, folder):
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _repositories_beside(path, keep):
    """The git repositories (folders holding a .git) next to ``path``: the user's other
    repositories beside the project, the other tasks' worktrees beside this one."""
    parent = os.path.dirname(path)
    if parent == path or parent == os.sep:
        return []
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    if len(names) > _SANDBOX_SCAN_LIMIT:
        return []
    found = []
    for name in names:
        candidate = os.path.join(parent, name)
        if candidate == path or any(_inside(k, candidate) for k in keep):
            continue
        with contextlib.suppress(OSError):
            if os.path.isdir(candidate) and os.path.lexists(os.path.join(candidate, ".git")):
                found.append(_real(candidate))
    return found


def _program_run(argv):
    """(real path, path as named) of the program ``argv`` starts — the sandbox may hide
    the folder it is named in (a virtual environment under /tmp) while the program itself
    is the agent CLI the configuration chose — and a virtual environment's pyvenv.cfg
    beside it, which that Python reads to know what it is."""
    if not argv:
        return []
    program = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0])
    if not program or not os.path.isfile(program):
        return []
    program = os.path.abspath(program)
    found = [(_real(program), program)]
    settings = os.path.join(os.path.dirname(os.path.dirname(program)), "pyvenv.cfg")
    if os.path.isfile(settings):
        found.append((_real(settings), settings))
    return found


def _paths_named(argv):
    """Absolute paths of existing files an argv names (``/p`` or ``--opt=/p``): an agent's
    MCP configuration may sit in the hidden project checkout, and must stay readable."""
    found = []
    for arg in argv[1:]:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if os.path.isabs(value) and os.path.isfile(value):
            found.append(_real(value))
    return found


def sanitized_git_config(common_dir, target):
    """Write to ``target`` the repository's config reduced to how to read the repository
    (core, extensions, index; no remote, URL, credential or hook setting), as the sandbox
    shows it in place of the real one."""
    out = run_git(common_dir, ["config", "--file", os.path.join(common_dir, "config"),
                               "--list", "-z"], ok=(0, 1))
    sections = {}
    for entry in os.fsdecode(out).split("\0"):
        key, _, value = entry.partition("\n")
        section, dot, name = key.partition(".")
        if not dot or "." in name or section not in _SANDBOX_GIT_SECTIONS or \
                key in _SANDBOX_GIT_DROPPED or not name.replace("-", "").isalnum():
            continue
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace(
            "\n", "\\n").replace("\t", "\\t")
        sections.setdefault(section, []).append('\t%s = "%s"\n' % (name, escaped))
    text = "".join("[%s]\n%s" % (section, "".join(lines)) for section, lines in
                   sections.items())
    atomic_write(target, text, durable=False)
    return target


def plan_sandbox(config, work_tree, state_dir, cwd=None, repository=None, agents=(),
                 home=None, readable=(), argv=(), store_dir=None):
    """The SandboxPlan of a task whose files are at ``work_tree`` (a linked worktree of the
    repository the checkout ``repository`` is in, or any folder) and whose sandbox keeps
    its temp folder and private git objects in ``state_dir`` (outside the worktree).

    ``agents`` are the agent CLIs it runs (their state folders are writable, made when
    missing); ``readable`` more files to show read-only (ferrus itself is always shown);
    ``argv`` a command whose named files stay readable; ``store_dir`` the project's
    .ferrus/, hidden even where the task works in the project's own checkout.  A
    worktree whose .git does not point where the repository keeps it is refused
    (TamperedWorktree)."""
    home = home or os.path.expanduser("~")
    home = _real(home) if home != "~" else None          # "~": no HOME to speak of
    work_tree = _real(work_tree)
    state_dir = _real(state_dir)
    temp = os.path.join(state_dir, "tmp")
    objects = os.path.join(state_dir, "objects")
    empty = os.path.join(state_dir, "empty")
    for folder in (temp, objects):
        os.makedirs(folder, exist_ok=True)
    if not os.path.isfile(empty):
        atomic_write(empty, "", durable=False)
    writable = [work_tree, temp]
    shown = [(path, path) for path in _ferrus_program_files()]
    shown += [(_real(path), _real(path)) for path in list(readable) + _paths_named(argv)]
    shown += _program_run(argv)
    hidden = []
    env = {"TMPDIR": temp, "TMP": temp, "TEMP": temp}
    for agent in agents:
        writable += _agent_state(agent, home)
    writable += [_real(p) for p in filter(None, (_expand(w, home) for w in config.writable))
                 if os.path.exists(p)]
    toplevel = None
    if repository is not None and os.path.isfile(os.path.join(work_tree, ".git")):
        checkout = task_checkout(repository, work_tree)
        toplevel = _real(_toplevel(repository))
        git_shown, git_writable, git_hidden = _git_parts(checkout, state_dir)
        shown += git_shown
        writable += git_writable + [objects]
        hidden += git_hidden
        env["GIT_OBJECT_DIRECTORY"] = objects
        env["GIT_ALTERNATE_OBJECT_DIRECTORIES"] = _real(os.path.join(checkout.common_dir,
                                                                     "objects"))
    elif os.path.isdir(os.path.join(work_tree, ".git")):
        # A plain checkout: its .git is the repository itself, shown read-only (git reads
        # work; git add cannot write the index there).
        shown.append((os.path.join(work_tree, ".git"),) * 2)
    if store_dir and os.path.isdir(store_dir):
        hidden.append(_real(store_dir))
    hidden += _hidden_paths(config, home, work_tree, toplevel, writable)
    writable = _unique_paths(writable)
    hidden = [path for path in _unique_paths(hidden) if path not in writable]
    return SandboxPlan(cwd=_real(cwd or work_tree), writable=writable,
                       readable=_unique_paths(shown), hidden=hidden, empty_file=empty,
                       network=config.network, env=env)


def _unique_paths(items):
    seen, result = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            result.append(item)
    return result


def _toplevel(repository):
    return os.fsdecode(run_git(repository, ["rev-parse", "--show-toplevel"])).strip()


def _ferrus_program_files():
    """ferrus itself: an agent's `ferrus serve` inside must be able to start, wherever
    ferrus.py lives."""
    return [_real(FERRUS_FILE)] if os.path.isfile(FERRUS_FILE) else []


def _agent_state(agent, home):
    paths = []
    for entry in SANDBOX_AGENT_STATE.get(agent, ()):
        path = _expand(entry.rstrip("/"), home)
        if not path:
            continue
        if entry.endswith("/") and not os.path.exists(path):
            with contextlib.suppress(OSError):
                os.makedirs(path, mode=0o700)
        if os.path.exists(path):
            paths.append(_real(path))
    return paths


def _git_parts(checkout, state_dir):
    """(shown, writable, hidden) of the repository's .git for a sandboxed linked worktree:
    the whole common dir hidden, what git reads of it shown read-only, the worktree's own
    admin folder writable except the two files that tie it to its worktree."""
    common = _real(checkout.common_dir)
    admin = _real(checkout.git_dir)
    shown = [(os.path.join(common, name),) * 2 for name in SANDBOX_GIT_ENTRIES
             if os.path.lexists(os.path.join(common, name))]
    shown.append((sanitized_git_config(common, os.path.join(state_dir, "git-config")),
                   os.path.join(common, "config")))
    alternates = os.path.join(common, "objects", "info", "alternates")
    with contextlib.suppress(OSError):
        with open(alternates, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                line = line.strip()
                if line and not line.startswith("#"):
                    path = _real(line if os.path.isabs(line) else
                                 os.path.join(common, "objects", line))
                    if os.path.isdir(path):
                        shown.append((path, path))
    # Deeper than the admin folder, so they stay read-only in it: rewriting them would
    # point the worktree (or ferrus's view of it) at another repository.
    for name in ("gitdir", "commondir", "config.worktree"):
        if os.path.isfile(os.path.join(admin, name)):
            shown.append((os.path.join(admin, name),) * 2)
    shown.append((os.path.join(_real(checkout.work_tree), ".git"),) * 2)
    return shown, [admin], [common]


def _hidden_paths(config, home, work_tree, toplevel, writable):
    paths = [p for p in (_expand(s, home) for s in SANDBOX_SECRET_PATHS) if p]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    paths += [p.format(uid=uid) for p in SANDBOX_SOCKET_PATHS]
    paths += [p for p in (_expand(h, home) for h in config.hidden) if p]
    found = [_real(p) for p in paths if os.path.lexists(p)]
    if sys.platform.startswith("linux"):
        found.append("/tmp")          # other programs' temp files; its own comes back
        # Server hosts' sockets (server_host.py) stay hidden even where /tmp is writable.
        import glob
        found += glob.glob(os.path.join(SERVER_HOST_FOLDER, SERVER_HOST_PREFIX + "*"))
    keep = writable + ([toplevel] if toplevel else [])
    if toplevel and toplevel != work_tree:
        found.append(toplevel)        # the user's checkout, .ferrus/ and .git included
        found += _repositories_beside(toplevel, keep)
    found += _repositories_beside(work_tree, keep)
    return found


# -- the command line: bubblewrap ------------------------------------------------------------

def bwrap_argv(plan, argv, bwrap="bwrap", terminal=False):
    """``argv`` run by bubblewrap as ``plan`` says.  Its own pid namespace ends every
    process inside when bwrap goes (and bwrap goes with its parent); a new session keeps
    it from typing into the terminal (not with ``terminal``, for an interactive agent)."""
    full = [bwrap, "--die-with-parent", "--unshare-pid"]
    if not terminal:
        full.append("--new-session")
    if not plan.network:
        full.append("--unshare-net")
    full += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    mounts = []          # (depth, order, args): parents before what is inside them
    folders = []
    for path in plan.hidden:
        if os.path.isdir(path) and not os.path.islink(path):
            mounts.append((_depth(path), 0, ["--tmpfs", path]))
            folders.append(path)
        else:
            mounts.append((_depth(path), 0, ["--ro-bind", plan.empty_file, path]))
    for source, target in plan.readable:
        target = _mount_point(target, plan.hidden)
        mounts.append((_depth(target), 1, ["--ro-bind", source, target]))
    for path in plan.writable:
        mounts.append((_depth(path), 1, ["--bind", path, path]))
    for _depth_, _order, args in sorted(mounts, key=lambda item: (item[0], item[1])):
        full += args
    # Last, once every mount point inside them is made: the hiding folders read-only,
    # so a write meant for a hidden place fails instead of vanishing into memory.
    for path in folders:
        full += ["--remount-ro", path]
    for name in plan.unset:
        full += ["--unsetenv", name]
    for name, value in sorted(plan.env.items()):
        full += ["--setenv", name, value]
    return full + ["--chdir", plan.cwd, "--"] + list(argv)


def _mount_point(target, hidden):
    """Where to mount a file shown at ``target``.  bubblewrap makes a mount point by
    following the path from its own setup root, not the sandbox's, so an absolute symlink
    on the way (a virtual environment's bin/python) leads nowhere there ("Can't create
    file").  Inside a hidden folder the path is made afresh, links and all gone; anywhere
    else the link stays visible as it is, and mounting at its real path is what it reaches."""
    if any(_inside(target, folder) for folder in hidden):
        return target
    return _real(target)


# -- the command line: sandbox-exec (macOS) ---------------------------------------------------

def sandbox_exec_profile(plan):
    """(profile text, its -D parameters) for sandbox-exec.  Paths travel as parameters,
    never inside the profile's text, so no path can change the profile.  Later rules win:
    everything may be read and nothing written, then the writable paths, then the hidden
    ones (no read, no write), then what comes back of them."""
    params = {}

    def param(kind, path):
        name = "P%d" % len(params)
        params[name] = path
        return '(%s (param "%s"))' % (kind, name)

    lines = ["(version 1)", "(allow default)", "(deny file-write*)",
             "(allow file-write* (literal \"/dev/null\") (literal \"/dev/zero\") "
             "(regex #\"^/dev/tty\") (regex #\"^/dev/fd/\"))"]
    for path in plan.writable:
        lines.append("(allow file-write* %s)" % param("subpath", path))
    for path in plan.hidden:
        kind = "subpath" if os.path.isdir(path) else "literal"
        lines.append("(deny file-read* file-write* %s)" % param(kind, path))
    for source, target in plan.readable:
        if source != target:
            continue          # no mounts here: the real config stays, read-only
        kind = "subpath" if os.path.isdir(target) else "literal"
        lines.append("(allow file-read* %s)" % param(kind, target))
        lines.append("(deny file-write* %s)" % param(kind, target))
    for path in plan.writable:
        if any(_inside(path, hidden) for hidden in plan.hidden):
            lines.append("(allow file-read* %s)" % param("subpath", path))
    for source, target in plan.readable:
        if source == target and any(_inside(target, w) for w in plan.writable):
            lines.append("(deny file-write* %s)" % param("literal", target))
    if not plan.network:
        # IP networking only: the Unix socket to ferrus's MCP server stays reachable.
        lines.append("(deny network* (remote ip))")
        lines.append("(deny network* (local ip))")
    return "\n".join(lines) + "\n", params


def sandbox_exec_argv(plan, argv, tool=SANDBOX_EXEC):
    profile, params = sandbox_exec_profile(plan)
    full = [tool, "-p", profile]
    for name, value in params.items():
        full += ["-D", "%s=%s" % (name, value)]
    env = ["/usr/bin/env"] + [arg for name in plan.unset for arg in ("-u", name)]
    env += ["%s=%s" % item for item in sorted(plan.env.items())]
    # sandbox-exec has no --chdir: the caller starts it in plan.cwd.
    return full + env + list(argv)


def sandbox_argv(plan, argv, tool=None, terminal=False):
    """``argv`` confined as ``plan`` says, by ``tool`` ((kind, path) from sandbox_tool)."""
    kind, path = tool or sandbox_tool()
    if kind == "bwrap":
        return bwrap_argv(plan, argv, path, terminal)
    return sandbox_exec_argv(plan, argv, path)


# -- one task's confinement -------------------------------------------------------------------

class TaskSandbox:
    """One task's confinement: its plan, made again for every command (so the repository's
    config copy and the hidden repositories are current), and the wrap of a command.

    ``state_dir`` is the task's own folder outside its worktree (``.ferrus/tasks/<id>/
    sandbox``): its temp folder and its private git objects live there.  ``root`` is the
    ferrus project whose store is hidden from the task, ``task`` its id (None for the
    project's own task).  sandbox_agents.AgentSandbox adds its agents' side."""

    def __init__(self, config, work_tree, state_dir, cwd=None, repository=None, agents=(),
                 home=None, tool=None, root=None, task=None):
        self.config = config
        self.work_tree = work_tree
        self.state_dir = state_dir
        self.cwd = cwd
        self.repository = repository
        self.agents = tuple(agents)
        self.home = home
        self.tool = tool
        self.root = root or repository
        self.task = task

    @classmethod
    def for_task(cls, store, config, agents=()):
        """The sandbox of the task of ``store`` (a parallel task's store: its worktree as
        its record names it; else the project's own checkout), by ``config`` (the
        [sandbox] of the place it runs at); None when that sandbox is off."""
        if not config.enabled:
            return None
        if store.task is None:
            return cls(config, store.root, store.path("sandbox"), repository=store.root,
                       agents=agents, root=store.root)
        record = read_task_record(store.dir, store.task)
        return cls(config, record.get("worktree") or store.workdir,
                   store.task_path("sandbox"), cwd=store.workdir, repository=store.root,
                   agents=agents, root=store.root, task=store.task)

    def require(self):
        """The tool, or SandboxUnavailable: nothing of the task may start unconfined."""
        if self.tool is None:
            self.tool = sandbox_tool()
        return self.tool

    def plan(self, argv=(), readable=()):
        return plan_sandbox(self.config, self.work_tree, self.state_dir, self.cwd,
                            self.repository, self.agents, self.home, readable, argv,
                            os.path.join(self.root, FERRUS_DIR) if self.root else None)

    def wrap(self, argv, terminal=False):
        """``argv`` (a check command's, say) confined to the task."""
        tool = self.require()
        return sandbox_argv(self.plan(argv), argv, tool, terminal)

    def close(self):
        """End what the sandbox keeps running (nothing here; the agents' side has more)."""

    def remove(self):
        """The task's temp folder and private objects (when the task has ended)."""
        self.close()
        shutil.rmtree(self.state_dir, ignore_errors=True)


def check_wrapper(store):
    """The wrap of the check commands of ``store``'s task (TaskSandbox.wrap), or None when
    the sandbox of the place it runs at is off."""
    config = store.config()
    confinement = TaskSandbox.for_task(store, config.places[PLACE_HERE].sandbox)
    return confinement.wrap if confinement is not None else None
