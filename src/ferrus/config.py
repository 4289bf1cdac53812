"""Config: ferrus.toml as validated dataclasses.

load_config checks every table at once and names the file, the key and what was
expected; ConfigCache reloads only when the file changes."""

import dataclasses
import datetime as _dt
import json
import os
import threading

from .basics import FerrusError, LazyPattern, deferred_dataclass, log
from .system import read_text
from .tomlfile import TomlError, parse_toml


CONFIG_FILE = "ferrus.toml"
BUILTIN_AGENTS = ("claude-code", "codex", "qwen-code", "gemini-cli", "nano", "opencode",
                  "goose")
# Agents whose [agents.<name>] table has keys of their own besides the launch options;
# the agent validates them (nano: nano_setting_problems).
AGENTS_WITH_OWN_SETTINGS = ("nano",)
# The binary names people type for the built-in agents.
AGENT_ALIASES = {"claude": "claude-code", "qwen": "qwen-code", "gemini": "gemini-cli"}
# What a headless agent may do besides calling ferrus's tools (see section 14).
PERMISSION_PROFILES = ("read-only", "edit", "full")
CLAUDE_MCP_ISOLATION = ("merge-user", "ferrus-only")


@deferred_dataclass
class ChecksConfig:
    """[checks]: the project's own lint and test commands, the check gate."""

    commands: list = dataclasses.field(default_factory=list)
    parallel: bool = False
    timeout_secs: int = 600
    fail_fast: bool = False
    max_log_bytes: int = 8 * 1024 * 1024


@deferred_dataclass
class LimitsConfig:
    """[limits]: how often a task may fail its checks or its review, and waits."""

    max_check_retries: int = 20
    max_review_cycles: int = 3
    max_feedback_lines: int = 30
    wait_timeout_secs: int = 60


@deferred_dataclass
class LeaseConfig:
    """[lease]: how long a claim on the task lasts without a heartbeat."""

    ttl_secs: int = 90
    heartbeat_interval_secs: int = 30


@deferred_dataclass
class SpecConfig:
    """[spec]: where specs with milestones live."""

    directory: str = "docs/specs"


@deferred_dataclass
class AgentChoice:
    """One role's agent in [hq.<role>]: which CLI, which model, which permissions."""

    agent: str
    model: str = ""
    permissions: str = ""     # "" = the role's default profile


def canonical_agent(name):
    """A built-in agent's name for what the user typed (`claude` means claude-code)."""
    name = (name or "").strip()
    return AGENT_ALIASES.get(name, name)


@deferred_dataclass
class AgentOptions:
    """``[agents.<name>]``: flags and environment the user adds to an agent's launches."""

    extra_args: list = dataclasses.field(default_factory=list)
    headless_args: list = dataclasses.field(default_factory=list)
    interactive_args: list = dataclasses.field(default_factory=list)
    env: dict = dataclasses.field(default_factory=dict)
    settings: dict = dataclasses.field(default_factory=dict)   # an agent's own keys (nano)


@deferred_dataclass
class CustomAgentSpec:
    """``[agents.custom.<name>]``: an agent CLI described by argv templates."""

    name: str
    interactive: list
    headless: list
    prompt: str = "argv"            # argv | stdin
    version_args: list = dataclasses.field(default_factory=lambda: ["--version"])


@deferred_dataclass
class AgentsConfig:
    """[agents] and [agents.<name>]: skill files, per-agent options, custom CLIs."""

    path: str = ".agents"
    claude_mcp_isolation: str = "merge-user"
    options: dict = dataclasses.field(default_factory=dict)    # agent name -> AgentOptions
    custom: dict = dataclasses.field(default_factory=dict)     # name -> CustomAgentSpec

    def options_for(self, agent):
        return self.options.get(agent) or AgentOptions()


@deferred_dataclass
class CapacityConfig:
    """[capacity]: every limit is off (0) by default."""

    max_tool_calls: int = 0        # ferrus tool calls per task (counted by the MCP servers)
    max_sessions: int = 0          # agent sessions per task
    max_tasks: int = 0             # tasks completed per HQ / `ferrus run`
    max_tokens: int = 0            # tokens per task, from agents that report usage
    max_parallel_agents: int = 0   # agent processes at once
    max_turns: int = 0             # model turns per task, from agents that report them
    context_window: int = 0        # the model's context window in tokens (0: unknown)
    orange_percent: int = 80       # at this share of a limit: Orange, Throttle
    emergency_percent: int = 150   # at this share: EmergencyStop (from 100%: Checkpoint)
    throttle_secs: int = 10        # how long a Throttle waits before spawning

    def enabled(self):
        return any((self.max_tool_calls, self.max_sessions, self.max_tasks, self.max_tokens,
                    self.max_parallel_agents, self.max_turns, self.context_window))


@deferred_dataclass
class SessionsConfig:
    """[sessions]: how HQ supervises each agent slot (ARCHITECTURE.md, 'Session state machine')."""

    max_consecutive_errors: int = 5
    max_total_errors: int = 20
    timeout_secs: int = 3600
    interrupt_grace_secs: int = 10


@deferred_dataclass
class PipelinesConfig:
    """[pipelines] in ferrus.toml; runs always live in .ferrus/pipelines/."""

    file: str = "workflows.json"
    max_parallel: int = 4          # the batch-size gate: workers running at once in a run


# [git] commit: when ferrus commits a task's changes.
GIT_COMMIT_POLICIES = ("off", "on_approve")
# [git] publish: what a parallel run pushes after the merge gate passed a task.
GIT_PUBLISH_MODES = ("target", "branch")
# [git] pr: the CLIs that open a pull (or merge) request for a published branch.
PULL_REQUEST_CLIS = ("gh", "glab", "tea")
# The one placeholder a [git] branch template may hold (each task gets its own branch).
GIT_BRANCH_PLACEHOLDER = "{task_id}"


@deferred_dataclass
class GitConfig:
    """[git]: what ferrus does in git besides reading the task's diff (off by default)."""

    branch: str = ""               # e.g. "ferrus/{task_id}"; "" = no branch per task
    commit: str = "off"            # off | on_approve
    # The team's remote in a parallel run (remote.py): fetch the target's upstream
    # before a task is prepared and before each integration; push to this remote after
    # a merge ("" = never); push the target, or the task's branch (with a pull request
    # opened through ``pr``).
    fetch: bool = False
    push: str = ""
    publish: str = "target"        # target | branch
    pr: str = ""                   # "" | gh | glab | tea

    def branch_for(self, task_id):
        """The branch a task gets, or None when [git] branch is off."""
        return self.branch.replace(GIT_BRANCH_PLACEHOLDER, task_id) if self.branch else None


# What [notify] can announce.  The first group needs a human or ends something and is
# on by default; the second reports ordinary progress and is there for those who ask.
NOTIFY_DEFAULT_EVENTS = ("awaiting_human", "complete", "failed", "checkpoint", "emergency_stop",
                         "pipeline_delivered")
NOTIFY_EVENTS = NOTIFY_DEFAULT_EVENTS + ("task_created", "submitted", "rejected")


@deferred_dataclass
class NotifyConfig:
    """[notify]: how a human who is not watching hears that the loop needs them."""

    bell: bool = True              # the terminal bell in HQ and `ferrus run`
    desktop: bool = False          # notify-send, osascript or a PowerShell toast
    command: list = dataclasses.field(default_factory=list)   # argv; {event} {task_id} {summary} {url}
    timeout_secs: int = 30         # a notifier still running then is stopped
    events: list = dataclasses.field(default_factory=lambda: list(NOTIFY_DEFAULT_EVENTS))


def _check_notify(path, notify):
    unknown = [name for name in notify.events if name not in NOTIFY_EVENTS]
    if unknown:
        raise _config_error(path, "notify.events", "must name only these events: %s"
                            % ", ".join(NOTIFY_EVENTS), unknown[0])
    if notify.command and not notify.command[0].strip():
        raise _config_error(path, "notify.command", "must start with a program name",
                            notify.command[0])


INTEGRATION_MODES = ("rebase", "merge")


@deferred_dataclass
class ParallelConfig:
    """[parallel]: several tasks at once, each in its own git worktree, integrated through
    a merge queue that keeps the target branch green (ARCHITECTURE.md, 'Parallel tasks')."""

    max_tasks: int = 1             # 1: one task at a time in the checkout, as ever
    integrate: str = "rebase"      # rebase | merge onto the target's head before the checks
    target: str = ""               # the branch tasks merge into; "" = the one checked out
    worktree_dir: str = ""         # "" = <repository>.ferrus-worktrees beside the repository
    delegates: list = dataclasses.field(default_factory=list)  # agents a team lead may use
    # Shell commands run in each new worktree before its agents start (it holds only what
    # git tracks: install dependencies, link a virtualenv...); a failure fails the task.
    setup: list = dataclasses.field(default_factory=list)
    # What the target gains per task: one squashed commit, or a commit per submission
    # (each checked; a red one is folded into the next).
    history: str = "squash"
    # fnmatch patterns of more paths that, changed by a task, need a human's confirmation
    # (besides GUARDED_NAMES and GUARDED_FOLDERS).
    guarded: list = dataclasses.field(default_factory=list)
    # Where tasks run, filled in this order: "here" (this machine) and [places.NAME] names.
    places: list = dataclasses.field(default_factory=lambda: ["here"])
    # Worktree bootstrap (bootstrap.py): untracked files of the checkout matching these
    # glob patterns (a .env, local settings) are copied (or linked) into each new worktree
    # and never become part of the task's work.
    copy: list = dataclasses.field(default_factory=list)
    copy_mode: str = "copy"        # copy | link (a symbolic link to the checkout's file)
    # Whether copied files also go to a task run at another place than this machine
    # (sent with the request that prepares it there; copies even with copy_mode "link").
    copy_to_places: bool = False
    # Each task's block of ports: FERRUS_TASK_PORT and {port} in setup and teardown
    # (the merge gate has the block at port_base; 0: no ports).
    port_base: int = 20000
    ports_per_task: int = 10
    # Shell commands run in a task's worktree before it is removed (stop a dev server).
    teardown: list = dataclasses.field(default_factory=list)


HISTORY_MODES = ("squash", "linear")
COPY_MODES = ("copy", "link")
# What [parallel] setup and teardown commands may hold in place of the task's first port.
PORT_PLACEHOLDER = "{port}"


def _check_parallel(path, parallel):
    if parallel.integrate not in INTEGRATION_MODES:
        raise _config_error(path, "parallel.integrate", 'must be "rebase" or "merge"',
                            parallel.integrate)
    if parallel.history not in HISTORY_MODES:
        raise _config_error(path, "parallel.history", 'must be "squash" or "linear"',
                            parallel.history)
    if parallel.copy_mode not in COPY_MODES:
        raise _config_error(path, "parallel.copy_mode", 'must be "copy" or "link"',
                            parallel.copy_mode)
    for pattern in parallel.copy:
        problem = copy_pattern_problem(pattern)
        if problem:
            raise _config_error(path, "parallel.copy", "must hold glob patterns relative to "
                                "the project folder: %s" % problem, pattern)
    if parallel.port_base and parallel.port_base < 1024:
        raise _config_error(path, "parallel.port_base", "must be 0 (no ports) or from 1024 "
                            "(ports below need root)", parallel.port_base)
    last = parallel.port_base + parallel.ports_per_task * 65 - 1    # the gate's and 64 tasks'
    if parallel.port_base and last > 65535:
        raise _config_error(path, "parallel.port_base", "leaves no room for 64 tasks' ports "
                            "of %d each below 65536 (the last would be %d)"
                            % (parallel.ports_per_task, last), parallel.port_base)
    uses_port = [c for c in parallel.setup + parallel.teardown if PORT_PLACEHOLDER in c]
    if uses_port and not parallel.port_base:
        raise _config_error(path, "parallel.port_base", "must be set: a setup or teardown "
                            "command uses {port} (`%s`)" % uses_port[0], parallel.port_base)


def copy_pattern_problem(pattern):
    """Why ``pattern`` cannot be a [parallel] copy pattern, or None."""
    parts = pattern.replace("\\", "/").split("/")
    if not pattern.strip():
        return "an empty pattern"
    if os.path.isabs(pattern) or pattern.startswith(("/", "\\")) or (
            len(parts[0]) == 2 and parts[0][1] == ":"):
        return "it is an absolute path"
    if ".." in parts:
        return "it leaves the project folder (..)"
    if parts[0] in (".git", ".ferrus"):
        return "git's and ferrus's own folders are never copied"
    return None


# -- [sandbox]: what confinement a task asks for -----------------------------------------

@deferred_dataclass
class SandboxConfig:
    """[sandbox] (global) or [places.NAME.sandbox] (one place, over the global one): whether
    a task's agents and checks are confined, what they may write besides their worktree,
    whether they reach the network, and what else they must not see."""

    enabled: bool = False
    writable: list = dataclasses.field(default_factory=list)   # more read-write paths
    network: bool = True
    hidden: list = dataclasses.field(default_factory=list)     # more paths to hide


SANDBOX_KEYS = ("enabled", "writable", "network", "hidden")


def parse_sandbox_table(path, table, where="sandbox", inherit=None, found=None, unknown=None):
    """The SandboxConfig of the TOML table ``table`` (``[where]`` in ``path``); the keys it
    leaves out keep ``inherit``'s values (a place's table over the global [sandbox]).

    A bad value is appended to ``found`` (its key keeps the inherited value), an unknown
    key to ``unknown``; with ``found`` None the first problem is raised."""
    result = dataclasses.replace(inherit) if inherit is not None else SandboxConfig()
    problems = [] if found is None else found
    if not isinstance(table, dict):
        problems.append(_config_error(path, where, "must be a table", table))
    else:
        for key, value in table.items():
            dotted = "%s.%s" % (where, key)
            if key not in SANDBOX_KEYS:
                if unknown is not None:
                    unknown.append(dotted)
                continue
            problem = _sandbox_value_problem(key, value)
            if problem:
                problems.append(_config_error(path, dotted, problem, value))
            else:
                setattr(result, key, list(value) if isinstance(value, list) else value)
    if found is None and problems:
        raise problems[0]
    return result


def _sandbox_value_problem(key, value):
    if key in ("enabled", "network"):
        return None if isinstance(value, bool) else "must be true or false"
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        return "must be an array of paths"
    for item in value:
        if not (os.path.isabs(item) or item == "~" or item.startswith("~/")):
            return "must list absolute paths or paths under ~/ (%s is neither)" % (
                _describe_value(item))
    return None


PLACE_HERE = "here"
PLACE_DEFAULT_DIR = "~/.ferrus-places"
PLACE_NAME_RE = LazyPattern(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
# A word a shell takes as it is: the place's Python.
PLACE_PYTHON_RE = LazyPattern(r"^[A-Za-z0-9_./+-]+$")
PLACE_KEYS = ("ssh", "exec", "slots", "dir", "python", "path", "multiplex", "sandbox")
PLACE_HERE_KEYS = ("slots", "sandbox")


# -- [places.NAME] ---------------------------------------------------------------------------

@deferred_dataclass
class PlaceConfig:
    """One [places.NAME] table: how to reach the place and what it offers."""

    name: str
    ssh: list = dataclasses.field(default_factory=list)     # argv prefix ending with the host
    exec: list = dataclasses.field(default_factory=list)    # argv prefix running argv there
    slots: "int | None" = 1                                 # tasks at once there (here:
                                                            # None, [parallel] max_tasks)
    dir: str = PLACE_DEFAULT_DIR                            # its clones and worktrees there
    python: str = "python3"                                 # the place's Python (3.9+)
    path: list = dataclasses.field(default_factory=list)    # folders put first on PATH there
    multiplex: bool = True                                  # ssh: one connection for all calls
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)

    @property
    def kind(self):
        return PLACE_HERE if self.name == PLACE_HERE else "ssh" if self.ssh else "exec"


def parse_places_table(path, places, sandbox=None, found=None, unknown=None):
    """{name: PlaceConfig} from ferrus.toml's ``[places]`` (``places``, a dict of tables);
    ``sandbox`` is the global [sandbox] each place's own table goes over.  Problems go to
    ``found`` (the place is left out) or, with ``found`` None, the first is raised."""
    problems = [] if found is None else found
    sandbox = sandbox or SandboxConfig()
    # Here, slots None means [parallel] max_tasks.
    result = {PLACE_HERE: PlaceConfig(PLACE_HERE, slots=None, sandbox=sandbox)}
    if not isinstance(places, dict):
        problems.append(_config_error(path, "places", "must be a table of [places.NAME] "
                                                      "tables", places))
        places = {}
    for name, table in places.items():
        before = len(problems)
        place = _parse_place(path, name, table, sandbox, problems, unknown)
        if len(problems) == before:
            result[name] = place
    if found is None and problems:
        raise problems[0]
    return result


def _parse_place(path, name, table, sandbox, problems, unknown):
    where = "places.%s" % name
    if not PLACE_NAME_RE.match(name):
        problems.append(_config_error(path, where, "is no place name: use letters, digits, "
                                                   "- and _ (at most 32)"))
        return None
    if not isinstance(table, dict):
        problems.append(_config_error(path, where, "must be a table", table))
        return None
    place = PlaceConfig(name, slots=None if name == PLACE_HERE else 1, sandbox=sandbox)
    allowed = PLACE_HERE_KEYS if name == PLACE_HERE else PLACE_KEYS
    for key, value in table.items():
        dotted = "%s.%s" % (where, key)
        if key not in allowed:
            if name == PLACE_HERE and key in PLACE_KEYS:
                problems.append(_config_error(path, dotted, "cannot be set: %s is this "
                                              "machine (only slots and sandbox can)" % name))
            elif unknown is not None:
                unknown.append(dotted)
            continue
        if key == "sandbox":
            place.sandbox = parse_sandbox_table(path, value, dotted, sandbox, problems, unknown)
            continue
        problem = _place_value_problem(key, value)
        if problem:
            problems.append(_config_error(path, dotted, problem, value))
        else:
            setattr(place, key, value)
    if name != PLACE_HERE and bool(place.ssh) == bool(place.exec):
        problems.append(_config_error(path, where, "needs exactly one of ssh = [...] (an ssh "
                                                   "command ending with the host) or exec = "
                                                   "[...] (a prefix that runs a command there)"))
    return place


def _place_value_problem(key, value):
    if key in ("ssh", "exec", "path"):
        if not (isinstance(value, list) and all(isinstance(v, str) and v for v in value)):
            return "must be an array of non-empty strings"
        return None if value or key == "path" else "must not be empty"
    if key == "slots":
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
            return "must be an integer between 1 and 64"
        return None
    if key == "multiplex":
        return None if isinstance(value, bool) else "must be true or false"
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if key == "python" and not PLACE_PYTHON_RE.match(value):
        return "must be a program name or path (letters, digits, _ . / + -)"
    if key == "dir" and not (value.startswith("~/") or value.startswith("/")):
        return "must be an absolute path or start with ~/"
    return None


def parallel_places_problem(names, places):
    """What is wrong with [parallel] places (a list of place names), or None."""
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return "must be an array of place names"
    for name in names:
        if name not in places:
            return "names %s, which is neither \"here\" nor a [places.%s] table" % (
                _describe_value(name), name)
    if len(set(names)) != len(names):
        return "names a place twice"
    return None


# The tables _fill_section reads straight into their dataclass, in file order.
PLAIN_TABLES = ("checks", "limits", "lease", "spec", "capacity", "sessions", "pipelines",
                "notify", "parallel")
KNOWN_TABLES = PLAIN_TABLES + ("agents", "hq", "git", "sandbox", "places")
# [hq.<role>] tables: which agent (and model, permissions) plays each role.
HQ_ROLES = ("supervisor", "executor")
AGENT_CHOICE_KEYS = ("agent", "model", "permissions")
# [agents.<name>] keys, and the argv templates of [agents.custom.<name>].
AGENT_OPTION_LISTS = ("extra_args", "headless_args", "interactive_args")
CUSTOM_AGENT_KEYS = ("interactive", "headless", "prompt", "version_args")


@deferred_dataclass
class Config:
    """The whole of ferrus.toml, one dataclass per table, validated by load_config."""

    checks: ChecksConfig = dataclasses.field(default_factory=ChecksConfig)
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)
    lease: LeaseConfig = dataclasses.field(default_factory=LeaseConfig)
    spec: SpecConfig = dataclasses.field(default_factory=SpecConfig)
    agents: AgentsConfig = dataclasses.field(default_factory=AgentsConfig)
    capacity: CapacityConfig = dataclasses.field(default_factory=CapacityConfig)
    sessions: SessionsConfig = dataclasses.field(default_factory=SessionsConfig)
    pipelines: PipelinesConfig = dataclasses.field(default_factory=PipelinesConfig)
    notify: NotifyConfig = dataclasses.field(default_factory=NotifyConfig)
    git: GitConfig = dataclasses.field(default_factory=GitConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    sandbox: "SandboxConfig" = dataclasses.field(default_factory=lambda: SandboxConfig())
    # name -> PlaceConfig; always holds "here" (see parse_places_table)
    places: dict = dataclasses.field(default_factory=lambda: parse_places_table(
        CONFIG_FILE, {}))
    supervisor: "AgentChoice | None" = None
    executor: "AgentChoice | None" = None
    # [hq] human_review: the reviewer's approval waits for a human's confirmation.
    human_review: bool = False
    # Problems in [hq] only matter to commands that launch agents, so they are kept
    # here instead of breaking check, submit and the waits (see
    # ARCHITECTURE.md, 'Differences from upstream ferrus', item 14).
    hq_problems: list = dataclasses.field(default_factory=list)
    unknown_keys: list = dataclasses.field(default_factory=list)
    path: str = CONFIG_FILE

    @property
    def hq_problem(self):
        """The first problem in [hq], or None."""
        return self.hq_problems[0] if self.hq_problems else None

    def require_hq(self):
        if self.hq_problems:
            raise self.hq_problem
        return self


# Upper bounds keep arithmetic sane: upstream overflowed on a huge ttl (see
# ARCHITECTURE.md, 'Differences from upstream ferrus', item 19).
_INT_LIMITS = {
    ("limits", "max_check_retries"): (1, 1_000_000),
    ("limits", "max_review_cycles"): (1, 1_000_000),
    ("limits", "max_feedback_lines"): (0, 100_000),
    ("limits", "wait_timeout_secs"): (0, 86_400),
    ("lease", "ttl_secs"): (1, 31_536_000),
    ("lease", "heartbeat_interval_secs"): (1, 31_536_000),
    ("checks", "timeout_secs"): (1, 604_800),
    ("checks", "max_log_bytes"): (4096, 2 ** 40),
    ("capacity", "orange_percent"): (1, 100),
    ("parallel", "max_tasks"): (1, 64),
    ("parallel", "port_base"): (0, 65535),
    ("parallel", "ports_per_task"): (1, 1000),
    ("capacity", "emergency_percent"): (100, 100_000),
    ("capacity", "throttle_secs"): (0, 86_400),
    ("sessions", "max_consecutive_errors"): (1, 1_000_000),
    ("sessions", "max_total_errors"): (1, 1_000_000),
    ("sessions", "timeout_secs"): (1, 31_536_000),
    ("sessions", "interrupt_grace_secs"): (0, 86_400),
    ("pipelines", "max_parallel"): (1, 1000),
    ("notify", "timeout_secs"): (1, 3600),
}


def _config_error(path, key, expected, got=None, line=None):
    where = "%s: [%s]" % (path, key) if line is None else "%s line %s" % (path, line)
    message = "%s %s" % (where, expected)
    if got is not None:
        message += ", got %s" % _describe_value(got)
    return FerrusError(message, "edit %s and fix that value (docs/REFERENCE.md, section "
                                "ferrus.toml, lists every key)" % path)


def _describe_value(value):
    if isinstance(value, bool):
        return "%s (a boolean)" % ("true" if value else "false")
    if isinstance(value, int):
        return "%d (an integer)" % value
    if isinstance(value, str):
        return "%s (a string)" % json.dumps(value)
    if isinstance(value, list):
        # Arrays hold strings wherever ferrus.toml has them: name the item that is not one.
        odd = next(((i, v) for i, v in enumerate(value) if not isinstance(v, str)), None)
        return "an array" if odd is None else "an array whose item %d is %s" % (
            odd[0] + 1, _describe_value(odd[1]))
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, float):
        return "%r (a number)" % value
    if isinstance(value, (_dt.date, _dt.time)):
        return "%s (a date or time)" % value.isoformat()
    return type(value).__name__


def _value_problem(current, value, limits):
    """What ``value`` should have been, given the default it replaces; None if it fits."""
    if isinstance(current, bool):
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(current, int):
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer"
        low, high = limits
        return None if low <= value <= high else "must be between %d and %d" % (low, high)
    if isinstance(current, str):
        return None if isinstance(value, str) else "must be a string"
    if isinstance(current, list):
        return None if _is_string_list(value) else "must be an array of strings"
    return None


def _is_string_list(value):
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _fill_section(path, raw, name, target, unknown, found):
    """Copy ``raw[name]`` into the dataclass instance ``target``, type-checked.

    Each bad value is appended to ``found`` (the default stays), each unknown key
    to ``unknown``."""
    table = raw.get(name, {})
    if not isinstance(table, dict):
        found.append(_config_error(path, name, "must be a table", table))
        return
    fields = {f.name for f in dataclasses.fields(target)}
    for key, value in table.items():
        dotted = "%s.%s" % (name, key)
        if key not in fields:
            unknown.append(dotted)
            continue
        problem = _value_problem(getattr(target, key), value,
                                 _INT_LIMITS.get((name, key), (0, 2 ** 31)))
        if problem:
            found.append(_config_error(path, dotted, problem, value))
        else:
            setattr(target, key, value)


def _parse_hq_table(path, hq, config, unknown):
    """[hq]: the agent of each role.  Its problems go to ``config.hq_problems``."""
    if not isinstance(hq, dict):
        config.hq_problems.append(_config_error(path, "hq", "must be a table", hq))
        return
    known_agents = BUILTIN_AGENTS + tuple(config.agents.custom)
    for key, value in hq.items():
        if key == "human_review":         # a setting, not a role: _parse_human_review
            continue
        if key not in HQ_ROLES:
            unknown.append("hq.%s" % key)
            continue
        choice, problems = _parse_agent_choice(path, key, value, known_agents, unknown)
        setattr(config, key, choice)
        config.hq_problems.extend(problems)


def _parse_agent_choice(path, role, value, known_agents, unknown):
    """``[hq.<role>]`` (or the legacy ``[hq] <role> = "agent"``): (choice, problems)."""
    where = "hq.%s" % role
    if isinstance(value, str):
        agent, model, permissions = value, "", ""
    elif isinstance(value, dict):
        unknown.extend("%s.%s" % (where, key) for key in value if key not in AGENT_CHOICE_KEYS)
        agent = value.get("agent")
        model = value.get("model", "")
        permissions = value.get("permissions", "")
        problems = []
        if agent is None:
            problems.append(_config_error(path, where, "needs `agent = \"<agent name>\"`"))
        elif not isinstance(agent, str):
            problems.append(_config_error(path, where + ".agent", "must be an agent name string",
                                          agent))
        if not isinstance(model, str):
            problems.append(_config_error(path, where + ".model", "must be a string", model))
        if permissions not in PERMISSION_PROFILES + ("",):
            problems.append(_config_error(
                path, where + ".permissions", "must be one of %s" % ", ".join(
                    json.dumps(p) for p in PERMISSION_PROFILES), permissions))
        if problems:
            return None, problems
    else:
        return None, [_config_error(path, where, "must be a table with `agent` (or a string)",
                                    value)]
    agent = canonical_agent(agent) if agent.strip() not in known_agents else agent.strip()
    if agent not in known_agents:
        return None, [FerrusError(
            "%s: [%s] agent %s is unknown" % (path, where, json.dumps(agent)),
            "use one of: %s (or describe it under [agents.custom.<name>])"
            % ", ".join(known_agents))]
    return AgentChoice(agent=agent, model=model.strip(), permissions=permissions), []


def _parse_agents_table(path, agents, target, unknown, found):
    """``[agents]``: ``path``, ``[agents.<name>]`` options, ``[agents.custom.<name>]``."""
    if not isinstance(agents, dict):
        found.append(_config_error(path, "agents", "must be a table", agents))
        return
    if "path" in agents:
        if isinstance(agents["path"], str):
            target.path = agents["path"]
        else:
            found.append(_config_error(path, "agents.path", "must be a string", agents["path"]))
    custom = agents.get("custom", {})
    if isinstance(custom, dict):
        _parse_custom_agents(path, custom, target, unknown, found)
    else:
        found.append(_config_error(path, "agents.custom", "must be a table of agent tables",
                                   custom))
        custom = {}
    # Options may name a custom agent whose own table is broken: that error is enough.
    known_agents = BUILTIN_AGENTS + tuple(custom)
    for name, table in agents.items():
        if name in ("path", "custom"):
            continue
        agent = name if name in custom else canonical_agent(name)
        if agent not in known_agents:
            unknown.append("agents.%s" % name)
        elif not isinstance(table, dict):
            found.append(_config_error(path, "agents.%s" % name, "must be a table", table))
        else:
            target.options[agent] = _parse_agent_options(path, name, agent, table, target,
                                                         unknown, found)


def _parse_agent_options(path, name, agent, table, target, unknown, found):
    """``[agents.<name>]``: flags and environment added to an agent's launches."""
    options = AgentOptions()
    for key, value in table.items():
        dotted = "agents.%s.%s" % (name, key)
        if key in AGENT_OPTION_LISTS:
            if _is_string_list(value):
                setattr(options, key, list(value))
            else:
                found.append(_config_error(path, dotted, "must be an array of strings", value))
        elif key == "env":
            if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
                options.env = dict(value)
            else:
                found.append(_config_error(path, dotted, "must be a table of strings", value))
        elif key == "mcp_isolation" and agent == "claude-code":
            if value in CLAUDE_MCP_ISOLATION:
                target.claude_mcp_isolation = value
            else:
                # Upstream silently treated typos as merge-user (see
                # ARCHITECTURE.md, 'Differences from upstream ferrus', item 14).
                found.append(_config_error(path, dotted, "must be \"merge-user\" or "
                                           "\"ferrus-only\"", value))
        elif agent in AGENTS_WITH_OWN_SETTINGS:
            options.settings[key] = value      # checked by the agent (nano_setting_problems)
        else:
            unknown.append(dotted)
    return options


def _parse_custom_agents(path, custom, target, unknown, found):
    """``[agents.custom.<name>]``: agent CLIs described by argv templates."""
    for name, table in custom.items():
        where = "agents.custom.%s" % name
        if not isinstance(table, dict):
            found.append(_config_error(path, where, "must be a table", table))
            continue
        problems = []
        if name in BUILTIN_AGENTS:
            problems.append(_config_error(path, where, "must not reuse a built-in agent name"))
        missing = [k for k in ("interactive", "headless") if k not in table]
        if missing:
            problems.append(_config_error(path, where, "needs %s (argv templates)"
                                          % " and ".join(missing)))
        for key in ("interactive", "headless", "version_args"):
            value = table.get(key, ["-"])
            if not _is_string_list(value):
                problems.append(_config_error(path, "%s.%s" % (where, key),
                                              "must be an array of strings", value))
            elif not value and key != "version_args":
                problems.append(_config_error(path, "%s.%s" % (where, key),
                                              "must not be empty (an argv template)"))
        if table.get("prompt", "argv") not in ("argv", "stdin"):
            problems.append(_config_error(path, where + ".prompt", "must be \"argv\" or \"stdin\"",
                                          table["prompt"]))
        unknown.extend("%s.%s" % (where, key) for key in table if key not in CUSTOM_AGENT_KEYS)
        found.extend(problems)
        if not problems:
            spec = CustomAgentSpec(name=name, interactive=list(table["interactive"]),
                                   headless=list(table["headless"]),
                                   prompt=table.get("prompt", "argv"))
            if "version_args" in table:
                spec.version_args = list(table["version_args"])
            target.custom[name] = spec


def parse_config(text, path=CONFIG_FILE, problems=None):
    """Build a validated :class:`Config` from ferrus.toml text.

    Every table is checked and every bad value found.  The first error is raised,
    unless ``problems`` is a list: then each error is appended to it and the bad
    values keep their defaults, so `ferrus doctor` can list them all at once.
    Problems in [hq] are kept in ``config.hq_problems`` either way (only commands
    that launch agents need [hq]); unknown keys in ``config.unknown_keys``."""
    try:
        raw = parse_toml(text)
    except TomlError as err:
        raise FerrusError("%s is not valid TOML: %s" % (path, err),
                          "fix the syntax at that line (`ferrus init` in an empty folder writes a "
                          "commented example; docs/REFERENCE.md, section ferrus.toml, lists every "
                          "key)") from None
    config = Config(path=path)
    unknown = config.unknown_keys
    found = [] if problems is None else problems
    for name in PLAIN_TABLES:
        _fill_section(path, raw, name, getattr(config, name), unknown, found)
    for check, table in ((_check_notify, config.notify), (_check_parallel, config.parallel)):
        try:
            check(path, table)
        except FerrusError as err:
            found.append(err)
    _parse_agents_table(path, raw.get("agents", {}), config.agents, unknown, found)
    _parse_hq_table(path, raw.get("hq", {}), config, unknown)
    # Not one of hq_problems, which only agent launches notice: a mistyped value must
    # not let the reviewer's approval complete a task the human meant to confirm.
    _parse_human_review(path, raw.get("hq", {}), config, found)
    _parse_git_table(path, raw.get("git", {}), config.git, unknown, found)
    config.sandbox = parse_sandbox_table(path, raw.get("sandbox", {}), found=found,
                                         unknown=unknown)
    config.places = parse_places_table(path, raw.get("places", {}), config.sandbox, found,
                                       unknown)
    problem = parallel_places_problem(config.parallel.places, config.places)
    if problem:
        found.append(_config_error(path, "parallel.places", problem, config.parallel.places))
        config.parallel.places = [PLACE_HERE]
    unknown.extend(name for name in raw if name not in KNOWN_TABLES)
    if found and problems is None:
        first, count = found[0], len(found) + len(config.hq_problems)
        if count > 1:
            raise FerrusError(first.message, "%s; `ferrus doctor` lists all %d problems in %s"
                              % (first.hint, count, path))
        raise first
    return config


def _parse_human_review(path, hq, config, found):
    value = hq.get("human_review", False) if isinstance(hq, dict) else False
    if not isinstance(value, bool):
        found.append(_config_error(path, "hq.human_review", "must be true or false", value))
        return
    config.human_review = value


def git_branch_name_problem(name):
    """Why ``name`` cannot be a git branch name (git's check-ref-format rules), or None."""
    if not name or name == "@" or name.startswith(("-", "/")) or name.endswith(("/", ".")):
        return "must not be empty, \"@\", start with - or /, or end with / or ."
    if any(ord(ch) < 32 or ch == "\x7f" or ch in " ~^:?*[\\" for ch in name):
        return "must not hold spaces, control characters or any of ~ ^ : ? * [ \\"
    if ".." in name or "//" in name or "@{" in name:
        return "must not hold .., // or @{"
    for part in name.split("/"):
        if part.startswith(".") or part.endswith(".lock"):
            return "must not have a part that starts with . or ends with .lock"
    return None


def _parse_git_table(path, git, target, unknown, found):
    """``[git]``: the branch template and the commit policy."""
    if not isinstance(git, dict):
        found.append(_config_error(path, "git", "must be a table", git))
        return
    for key, value in git.items():
        if key not in ("branch", "commit") + GIT_REMOTE_KEYS:
            unknown.append("git.%s" % key)
    branch = git.get("branch", "")
    if not isinstance(branch, str):
        found.append(_config_error(path, "git.branch", "must be a branch name template such "
                                   "as \"ferrus/{task_id}\" (or \"\" for no branch)", branch))
    elif branch:
        leftover = branch.replace(GIT_BRANCH_PLACEHOLDER, "")
        problem = None
        if GIT_BRANCH_PLACEHOLDER not in branch:
            problem = "must contain {task_id}, so that each task gets a branch of its own"
        elif "{" in leftover or "}" in leftover:
            problem = "may hold no placeholder but {task_id}"
        else:
            problem = git_branch_name_problem(branch.replace(GIT_BRANCH_PLACEHOLDER,
                                                             "t-0123456789ab"))
            if problem:
                problem = "is no valid branch name: it " + problem
        if problem:
            found.append(_config_error(path, "git.branch", problem, branch))
        else:
            target.branch = branch
    commit = git.get("commit", "off")
    if commit not in GIT_COMMIT_POLICIES:
        found.append(_config_error(path, "git.commit", "must be one of %s" % ", ".join(
            json.dumps(p) for p in GIT_COMMIT_POLICIES), commit))
    else:
        target.commit = commit
    _parse_git_remote_keys(path, git, target, found)


GIT_REMOTE_KEYS = ("fetch", "push", "publish", "pr")


def _parse_git_remote_keys(path, git, target, found):
    """``[git]`` fetch, push, publish and pr: the team's remote in a parallel run."""
    fetch = git.get("fetch", False)
    if not isinstance(fetch, bool):
        found.append(_config_error(path, "git.fetch", "must be true or false", fetch))
    else:
        target.fetch = fetch
    push = git.get("push", "")
    if not isinstance(push, str) or push.startswith("-") or any(
            ch.isspace() or ord(ch) < 32 for ch in push):
        found.append(_config_error(path, "git.push", "must be the name of a git remote "
                                   "(such as \"origin\"), or \"\" never to push", push))
        push = ""
    else:
        target.push = push
    publish = git.get("publish", "target")
    if publish not in GIT_PUBLISH_MODES:
        found.append(_config_error(path, "git.publish", "must be \"target\" or \"branch\"",
                                   publish))
    elif publish == "branch" and not push:
        found.append(_config_error(path, "git.publish", "= \"branch\" needs [git] push, "
                                   "the remote the task's branch is pushed to", publish))
    else:
        target.publish = publish
    pr = git.get("pr", "")
    if pr not in PULL_REQUEST_CLIS + ("",):
        found.append(_config_error(path, "git.pr", "must be one of %s (or \"\")" % ", ".join(
            json.dumps(cli) for cli in PULL_REQUEST_CLIS), pr))
    elif pr and target.publish != "branch":
        found.append(_config_error(path, "git.pr", "needs publish = \"branch\": a pull request "
                                   "is opened for the task's pushed branch", pr))
    else:
        target.pr = pr


def load_config(root):
    """Read and validate ``<root>/ferrus.toml``."""
    path = os.path.join(root, CONFIG_FILE)
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise FerrusError("%s not found in %s" % (CONFIG_FILE, root),
                          "run `ferrus init` in the project root first") from None
    return parse_config(text, CONFIG_FILE)


class ConfigCache:
    """Re-reads ferrus.toml only when it changed on disk (mtime, size or inode)."""

    def __init__(self, root):
        self.root = root
        self._stamp = None
        self._config = None
        self._lock = threading.Lock()

    def get(self):
        path = os.path.join(self.root, CONFIG_FILE)
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            if stamp is None or stamp != self._stamp:
                self._config = load_config(self.root)
                self._stamp = stamp
                # Once per change of the file, not on every read (`ferrus doctor`
                # lists them too).
                for key in self._config.unknown_keys:
                    log.warning("%s: unknown key %s is ignored", CONFIG_FILE, key)
            return self._config


NO_CHECKS_WARNING = ("%s has no [checks] commands, so the check gate passes every "
                     "submission" % CONFIG_FILE)
NO_CHECKS_HINT = ("add your lint and test commands, e.g. commands = [\"make lint\", "
                  "\"make test\"] under [checks]")
