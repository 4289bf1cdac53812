"""Register: every agent by name, connecting agents to a project, `ferrus agents`.

Idempotent: registering the same role and agent twice leaves one server entry; the
agents chosen are recorded in [hq.*] of ferrus.toml."""

import json
import os
import subprocess

from .basics import FerrusError, UsageError, did_you_mean
from .system import atomic_write, read_text
from .tomlfile import TomlError, parse_toml, toml_remove_key, toml_set_key
from .config import AGENT_ALIASES, BUILTIN_AGENTS, CONFIG_FILE, canonical_agent, load_config
from .store import Store
from .operations import ROLES
from .agents import entry_mismatch, entry_points_here, server_key
from .agent_files import (FileChanges, add_instruction_section, edit_json_file,
                          effective_permissions, planned_read, planned_write,
                          remove_instruction_section)
from .adapters import ClaudeCode, Codex, CustomAgent, GeminiCli, QwenCode
from .local_agents import LOCAL_AGENT_ADAPTERS, LOCAL_AGENT_REGISTRATION_FILES


# Every built-in agent by name: the four CLIs of adapters.py and the local-model agents
# (nano, opencode, goose) of local_agents.py.
ADAPTERS = {cls.name: cls for cls in (ClaudeCode, Codex, QwenCode, GeminiCli)
            + LOCAL_AGENT_ADAPTERS}


def adapter_for(config, agent):
    if agent not in config.agents.custom:
        agent = canonical_agent(agent)
    if agent in ADAPTERS:
        return ADAPTERS[agent](config)
    if agent in config.agents.custom:
        return CustomAgent(config, config.agents.custom[agent])
    known = BUILTIN_AGENTS + tuple(AGENT_ALIASES) + tuple(config.agents.custom)
    close = did_you_mean(agent, known)
    raise FerrusError("Unknown agent %r. Supported values: %s (or %s for short)" % (
        agent, ", ".join(json.dumps(a) for a in BUILTIN_AGENTS + tuple(config.agents.custom)),
        ", ".join(json.dumps(a) for a in AGENT_ALIASES)),
        ("did you mean %s? Otherwise describe " % json.dumps(close) if close else
         "or describe ") + "it under [agents.custom.<name>] in ferrus.toml")


def probe_version(argv, timeout=10.0):
    """First line of `<agent> --version`, or '' (bounded: upstream had no timeout)."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = result.stdout.strip().splitlines()
    return lines[0].strip() if result.returncode == 0 and lines else ""


def add_registration_options(parser):
    """The options of `ferrus register` (and HQ's /register): one list for both."""
    parser.add_argument("--supervisor", metavar="AGENT", help="agent for the supervisor role")
    parser.add_argument("--supervisor-model", metavar="M", help="model for the supervisor")
    parser.add_argument("--executor", metavar="AGENT", help="agent for the executor role")
    parser.add_argument("--executor-model", metavar="M", help="model for the executor")
    parser.add_argument("--trust", action="store_true",
                        help="also mark this project trusted in the agents' user settings "
                             "(Codex, Gemini, Qwen), so their `mcp list` shows it")
    return parser


def registration_choices(args, root):
    """{role: (agent, model)} from add_registration_options' arguments, checked as
    upstream checks them; with no option at all, the agents [hq.*] of ferrus.toml
    name.  Returns (choices, from_config)."""
    if not (args.supervisor or args.executor or args.supervisor_model is not None
            or args.executor_model is not None):
        choices = configured_registration(root)
        if not choices:
            raise UsageError("At least one of --supervisor or --executor must be specified",
                             "e.g. ferrus register --supervisor claude-code --executor codex "
                             "(a bare `ferrus register` uses [hq.supervisor] and [hq.executor] "
                             "of ferrus.toml, and this project names neither)")
        return choices, True
    # Upstream's checks, in upstream's order.
    if not args.supervisor and not args.executor:
        raise UsageError("At least one of --supervisor or --executor must be specified",
                         "e.g. ferrus register --supervisor claude-code --executor codex")
    if args.supervisor_model is not None and not args.supervisor:
        raise UsageError("--supervisor-model requires --supervisor")
    if args.executor_model is not None and not args.executor:
        raise UsageError("--executor-model requires --executor")
    return {role: (getattr(args, role), getattr(args, role + "_model"))
            for role in ROLES if getattr(args, role)}, False


# -- register -------------------------------------------------------------------------

def configured_registration(root):
    """What a bare `register` registers: the agents [hq.supervisor] and [hq.executor]
    of ferrus.toml name, with their models."""
    config = Store(root).config().require_hq()
    return {role: (choice.agent, choice.model or None)
            for role, choice in ((role, getattr(config, role, None)) for role in ROLES)
            if choice is not None and choice.agent}


def register_agents(root, choices, trust=False, report=print):
    """`ferrus register`: write each role's agent configuration and update [hq].

    ``choices`` maps role -> (agent, model-or-None).  Everything is validated
    before the first file is written (see
    ARCHITECTURE.md, 'Differences from upstream ferrus', item 11)."""
    if not os.path.exists(os.path.join(root, CONFIG_FILE)):
        raise FerrusError("%s not found — run `ferrus init` first" % CONFIG_FILE)
    config = load_config(root)
    choices = {role: (agent if agent in config.agents.custom else canonical_agent(agent), model)
               for role, (agent, model) in choices.items()}
    adapters = {role: adapter_for(config, agent) for role, (agent, _) in choices.items()}
    # One change set: every file's new content is computed (and every input read
    # and validated) before any is written; the messages follow the commit.
    messages = []
    with FileChanges():
        for role in ROLES:
            if role not in choices:
                continue
            agent, model = choices[role]
            model = (model or "").strip()
            adapter = adapters[role]
            adapter.register(root, role, model, messages.append)
            if adapter.instructions_file:
                add_instruction_section(os.path.join(root, adapter.instructions_file), role,
                                        messages.append)
            if trust:
                trust_project(adapter, root, messages.append)
            update_hq_config(root, role, agent, model if choices[role][1] is not None else None,
                             messages.append)
    for message in messages:
        report(message)


def update_hq_config(root, role, agent, model, report):
    """Set [hq.<role>] agent (and model) in ferrus.toml, keeping every comment.

    Switching to another agent without naming a model clears the old vendor's
    model instead of keeping it (see
    ARCHITECTURE.md, 'Differences from upstream ferrus', item 10); models are trimmed."""
    path = os.path.join(root, CONFIG_FILE)
    text = planned_read(path)
    if text is None:
        raise FerrusError("%s not found — run `ferrus init` first" % CONFIG_FILE)
    try:
        raw = parse_toml(text)
        hq = raw.get("hq", {})
        for other in ROLES:
            flat = hq.get(other) if isinstance(hq, dict) else None
            if isinstance(flat, str):      # legacy flat form: migrate to [hq.<role>]
                text = toml_remove_key(text, ("hq",), other)
                text = toml_set_key(text, ("hq", other), "agent", flat)
        current = ((hq.get(role) if isinstance(hq, dict) else None) or {})
        previous_agent = current.get("agent") if isinstance(current, dict) else current
        text = toml_set_key(text, ("hq", role), "agent", agent)
        if model is not None:
            text = toml_set_key(text, ("hq", role), "model", model.strip())
        elif previous_agent != agent:
            text = toml_set_key(text, ("hq", role), "model", "")
    except TomlError as err:
        raise FerrusError("%s: %s" % (CONFIG_FILE, err),
                          "fix [hq] in %s by hand; nothing was written" % CONFIG_FILE) from err
    planned_write(path, text)
    said = "agent = %s" % json.dumps(agent)
    if model is not None:
        said += ", model = %s" % json.dumps(model.strip()) + (
            " (the agent's own default)" if not model.strip() else "")
    report("Set [hq.%s] %s in %s" % (role, said, CONFIG_FILE))


def trust_project(adapter, root, report):
    """Mark the project trusted in the agent's user config (only with --trust)."""
    home = os.path.expanduser("~")
    root = os.path.abspath(root)
    if adapter.name == "codex":
        path = os.path.join(os.environ.get("CODEX_HOME") or os.path.join(home, ".codex"),
                            "config.toml")
        text = planned_read(path) or ""
        try:
            parse_toml(text)
            new = toml_set_key(text, ("projects", root), "trust_level", "trusted")
        except TomlError as err:
            raise FerrusError("%s: %s" % (path, err),
                              "fix the file by hand first, or register without --trust; "
                              "nothing was written") from err
        if new != text:
            planned_write(path, new)
            report("Trusted %s in %s" % (root, path))
    elif adapter.name in ("gemini-cli", "qwen-code"):
        path = os.path.join(home, "." + adapter.binary, "trustedFolders.json")

        def trust(data):
            data[root] = "TRUST_FOLDER"
        if edit_json_file(path, trust):
            report("Trusted %s in %s" % (root, path))


def unregister_agents(root, roles, report=print):
    config = load_config(root)
    messages = []
    with FileChanges():
        _unregister_roles(root, config, roles, messages.append)
    for message in messages:
        report(message)
    # After the changes are on disk: only then can a file be seen to be empty.
    remove_emptied_registration_files(root, report)


def _unregister_roles(root, config, roles, report):
    for role in roles:
        choice = getattr(config, role)
        agents = [choice.agent] if choice else []
        # Remove what any adapter wrote for this role, whatever [hq] says now.
        for name in BUILTIN_AGENTS + tuple(config.agents.custom):
            adapter = adapter_for(config, name)
            if adapter.registration(root, role) is not None or name in agents:
                adapter.unregister(root, role, report)
                if adapter.instructions_file:
                    remove_instruction_section(os.path.join(root, adapter.instructions_file),
                                               role, report)


# Every file `register` may create or extend, relative to the project root.
REGISTRATION_FILES = (".claude/mcp-supervisor.json", ".claude/mcp-executor.json",
                      ".claude/settings.local.json", ".codex/config.toml", ".qwen/settings.json",
                      ".gemini/settings.json", "CLAUDE.md", "AGENTS.md", "QWEN.md", "GEMINI.md"
                      ) + LOCAL_AGENT_REGISTRATION_FILES


def _hollow(value):
    """True for JSON holding nothing but empty objects and arrays."""
    if isinstance(value, dict):
        return all(_hollow(v) for v in value.values())
    if isinstance(value, list):
        return all(_hollow(v) for v in value)
    return False


# What an agent CLI started in a parallel task's worktree reads from its working folder.
# Its task reaches ferrus as FERRUS_SESSION (the session id starts with the task id),
# which the ferrus server inherits from the CLI (Codex passes only the variables its
# env_vars lists).  The server itself comes by absolute path or on the command line for
# Claude Code (--mcp-config), Codex (-c) and Qwen Code (--mcp-config JSON); Gemini CLI
# has no such flag and reads .gemini/settings.json from the folder it starts in, so
# without its copy an agent in a worktree has no ferrus tools.  The other copies keep
# the project's settings for interactive sessions there (Claude's allows ferrus's
# tools).  diff_exclusions keeps them out of every diff and commit.
WORKTREE_AGENT_FILES = (".qwen/settings.json", ".gemini/settings.json",
                        ".claude/settings.local.json")


def copy_agent_configuration(root, worktree):
    """Copy the project's agent registration files into a task's worktree, so an agent
    started there reaches the same ferrus (its servers' -C names the project)."""
    for relative in WORKTREE_AGENT_FILES:
        source = os.path.join(root, *relative.split("/"))
        if not os.path.isfile(source):
            continue
        target = os.path.join(worktree, *relative.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        atomic_write(target, read_text(source))


def remove_emptied_registration_files(root, report):
    """After unregister: delete the registration files left with nothing in them (and
    their .gitignore lines and emptied folders); a file with anything else stays."""
    for rel in REGISTRATION_FILES:
        path = os.path.join(root, *rel.split("/"))
        if not os.path.isfile(path):
            continue
        text = read_text(path)
        if rel.endswith(".json"):
            try:
                empty = _hollow(json.loads(text))
            except ValueError:
                empty = False
        else:
            empty = not text.strip()
        if not empty:
            continue
        os.unlink(path)
        report("Removed %s (nothing else was in it)" % rel)
        remove_gitignore_entry(root, rel, report)
        folder = os.path.dirname(path)
        if folder != root and not os.listdir(folder):
            os.rmdir(folder)


def remove_gitignore_entry(root, entry, report):
    """Drop the exact line ``ensure_gitignore_entry`` added for ``entry``."""
    path = os.path.join(root, ".gitignore")
    text = planned_read(path) or ""
    lines = text.split("\n")
    kept = [line for line in lines if line.rstrip("\r").strip() != entry]
    if len(kept) != len(lines):
        planned_write(path, "\n".join(kept))
        report("Removed %s from .gitignore" % entry)


def agents_report(root, probe=probe_version):
    """`ferrus agents`: per role, the agent, its binary, version and registration."""
    config = load_config(root).require_hq()
    rows = []
    for role in ROLES:
        choice = getattr(config, role)
        if choice is None:
            rows.append({"role": role, "agent": None, "problem": "no [hq.%s] in ferrus.toml" % role,
                         "hint": "ferrus register --%s <agent>" % role})
            continue
        adapter = adapter_for(config, choice.agent)
        path = adapter.executable()
        entry = adapter.registration(root, role)
        profile, source = effective_permissions(config, role)
        row = {"role": role, "agent": choice.agent, "model": choice.model or None,
               "binary": adapter.binary, "path": path,
               "version": probe(adapter.version_argv()) if path else "",
               "registered": entry is not None,
               "points_here": entry_points_here(entry, root),
               "permissions": profile, "permissions_from": source,
               "permission_args": adapter.permission_args(profile)}
        mismatch = entry_mismatch(entry, root) if entry is not None else None
        warnings = permission_warnings(config, role)
        if not path:
            row["problem"] = "%s is not installed" % adapter.binary
            row["hint"] = adapter.install_hint()
        elif entry is None:
            row["problem"] = "no %s entry in its MCP configuration" % server_key(role)
            row["hint"] = "ferrus register --%s %s" % (role, choice.agent)
        elif mismatch and mismatch[0] == "error":
            row["problem"] = mismatch[1]
            row["hint"] = "ferrus register --%s %s" % (role, choice.agent)
        elif mismatch:
            warnings.insert(0, (mismatch[1], "ferrus register --%s %s registers it afresh "
                                "for this ferrus and this Python" % (role, choice.agent)))
        if warnings:
            row["warnings"] = [{"warning": text, "hint": hint} for text, hint in warnings]
        rows.append(row)
    return rows


def permission_warnings(config, role):
    """[(warning, hint)] about what a role's headless agent may do: an executor that
    cannot edit fails every task at the check gate."""
    choice = getattr(config, role, None)
    if choice is None:
        return []
    adapter = adapter_for(config, choice.agent)
    profile, source = effective_permissions(config, role)
    warnings = []
    fix = 'set `permissions = "edit"` under [hq.executor] in %s' % CONFIG_FILE
    if role == "executor":
        can_edit = adapter.can_edit(profile)
        if can_edit is False:
            warnings.append(("the executor (%s) cannot edit files: permissions are %s (%s)"
                             % (choice.agent, json.dumps(profile), source), fix))
        elif can_edit is None:
            warnings.append(("ferrus cannot tell whether the executor (%s) may edit files: its "
                             "[agents.custom.%s] argv templates decide" % (choice.agent,
                                                                           choice.agent),
                             "make its headless template grant file edits"))
    if profile == "read-only" and adapter.can_edit(profile) is True:
        # goose: its developer extension edits in every mode, whatever the profile says.
        warnings.append(("the %s (%s) can edit files although its permissions are "
                         "\"read-only\": %s cannot be held to reading" % (
                             role, choice.agent, choice.agent),
                         "register an agent that can be held to reading for the %s "
                         "(`ferrus register --%s AGENT`), and keep %s for the executor"
                         % (role, role, choice.agent)))
    if (profile == "full" and isinstance(adapter, ClaudeCode) and hasattr(os, "geteuid")
            and os.geteuid() == 0 and "IS_SANDBOX" not in adapter.options.env):
        # Measured with 2.1.197: "--dangerously-skip-permissions cannot be used with
        # root/sudo privileges for security reasons", and the session ends at once.
        warnings.append(("Claude Code refuses permissions = \"full\" (bypassPermissions) "
                         "when run as root, so the %s would exit at once" % role,
                         "in a sandbox, add `env = { IS_SANDBOX = \"1\" }` under "
                         "[agents.claude-code]; otherwise use \"edit\""))
    flags = {arg.split("=", 1)[0] for arg in adapter.permission_args(profile)
             if arg.startswith("-")}
    options = adapter.options.extra_args + adapter.options.headless_args
    overridden = sorted({arg.split("=", 1)[0] for arg in options} & flags)
    if overridden:
        warnings.append(("[agents.%s] sets %s itself; it follows ferrus's %s flags and may "
                         "change what the %s may do" % (choice.agent, ", ".join(overridden),
                                                        json.dumps(profile), role),
                         "use [hq.%s] permissions instead" % role))
    return warnings
