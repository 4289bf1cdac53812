"""ferrus — deterministic, restart-safe orchestration of coding agents.

ferrus drives coding agents through a Supervisor → Executor → Reviewer loop.  The
loop is an explicit state machine kept on disk in ``.ferrus/``; agents are
stateless workers that move it forward only through ferrus's MCP tools, and a
check gate (the project's own lint and test commands) plus a reviewer stand
between "done" and "accepted".

This file is the whole tool.  It uses only the Python standard library and runs
on CPython 3.9+ on Linux, macOS and Windows.  Run it as ``python ferrus.py``,
``python -m ferrus``, through the ``ferrus`` launcher, or as an installed
``ferrus`` command — all four behave the same.  It is generated from the modules
of src/ferrus/ (see below); each part of it sits under a banner naming its module.

Other programs may import ferrus.  What they may rely on is listed in ``__all__``:
the store and its state types, the operations (``op_*``, the one implementation of
every behaviour), the config loader and its dataclasses, the MCP server entry
``serve_stdio``, ``main`` and ``FerrusError``.  Everything else may change between
versions without notice."""

# The modules in build order (tools/amalgamate.py): each uses only those before it.
MODULES = (
    "startup",
    "basics",
    "system",
    "tomlfile",
    "config",
    "task_machine",
    "session_machine",
    "gates",
    "store",
    "checks",
    "git",
    "worktrees",
    "sandbox",
    "bootstrap",
    "specs",
    "operations",
    "work",
    "base_checks",
    "task_queue",
    "graph_extract",
    "graph",
    "memory_records",
    "memory",
    "remote",
    "jsonrpc",
    "mcp",
    "agents",
    "server_host",
    "agent_files",
    "adapters",
    "nano_model",
    "nano",
    "local_agents",
    "probe",
    "register",
    "sandbox_agents",
    "places",
    "prompts",
    "sessions",
    "web_link",
    "notify",
    "orchestrator",
    "journal_view",
    "controller",
    "place_tasks",
    "merge_queue",
    "race",
    "parallel",
    "task_cancel",
    "run",
    "pipeline_defs",
    "pipelines",
    "scaffold",
    "place_side",
    "doctor",
    "build_backend",
    "hq_board",
    "hq_commands",
    "hq_shell",
    "curses_draw",
    "hq_curses",
    "cli_views",
    "web_page",
    "web_api",
    "web",
    "cli",
    "api",
)
