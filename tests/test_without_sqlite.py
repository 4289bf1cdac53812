"""A Python built without its sqlite3 module (some minimal builds are) still runs ferrus:
every command starts and works, a task runs to its end, and only the repository graph and
project memory — sqlite caches — say that they need it, from the CLI and as MCP tool
errors; `ferrus spec archive` files a spec without the list of its tasks."""

import pytest

import ferrus
from conftest import run_cli, scripted_project
from mcp_client import McpProcess


@pytest.fixture
def no_sqlite(tmp_path):
    """The environment of a Python whose ``import sqlite3`` fails as it does in a build
    without the _sqlite3 extension (a module of that name first on the path raises)."""
    folder = tmp_path / "no_sqlite"
    folder.mkdir()
    (folder / "_sqlite3.py").write_text("raise ImportError(\"No module named '_sqlite3'\")\n")
    return {"PYTHONPATH": str(folder)}


def test_every_other_command_works_and_the_graph_says_what_it_needs(project, no_sqlite):
    probe = run_cli("status", cwd=project, env=no_sqlite)
    assert probe.returncode == 0, probe.stderr
    for argv in (["--help"], ["status", "--json"], ["log"], ["doctor"], ["tasks"],
                 ["graph", "--help"], ["memory", "--help"], ["spec", "--help"]):
        result = run_cli(*argv, cwd=project, env=no_sqlite)
        assert result.returncode == 0, (argv, result.stderr)
        assert "sqlite" not in result.stderr, (argv, result.stderr)
    for argv in (["graph", "index"], ["graph", "search", "main"], ["graph", "status"]):
        result = run_cli(*argv, cwd=project, env=no_sqlite)
        assert result.returncode == 1, (argv, result.stdout, result.stderr)
        assert "ferrus: the repository graph needs Python's sqlite3 module" in result.stderr
        assert "hint:" in result.stderr and "Traceback" not in result.stderr
    for argv in (["memory", "status"], ["memory", "search", "cache"], ["memory", "rebuild"],
                 ["memory", "show", "t-1"]):
        result = run_cli(*argv, cwd=project, env=no_sqlite)
        assert result.returncode == 1, (argv, result.stdout, result.stderr)
        assert "ferrus: project memory needs Python's sqlite3 module" in result.stderr
        assert "hint:" in result.stderr and "Traceback" not in result.stderr


def test_a_task_runs_to_its_end_and_memory_says_once_that_it_is_off(project, tmp_path,
                                                                     no_sqlite):
    scripted_project(project, tmp_path / "scripted")
    env = dict(no_sqlite, SCRIPTED_DIR=str(tmp_path / "scripted"))
    result = run_cli("run", "--task", "Make work.txt", cwd=project, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ferrus.Store(str(project)).read_state().state == ferrus.S.COMPLETE
    assert result.stderr.count("project memory is off: project memory needs Python's "
                               "sqlite3 module") == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_a_spec_is_archived_without_the_list_of_its_tasks(project, no_sqlite):
    store = ferrus.Store(str(project))
    created = ferrus.op_create_spec(store, ferrus.HUMAN, "# Retries\n\n## Milestones\n\n"
                                    "- [x] #1.0 Retry the fetch\n  - ID: m1\n")
    result = run_cli("spec", "archive", created.data["path"], "--outcome", "Shipped.",
                     cwd=project, env=no_sqlite)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Archived" in result.stdout
    assert "note: its tasks are not listed: project memory needs Python's sqlite3" \
        in result.stdout
    archived = project / "docs" / "specs" / "archive"
    text = next(archived.iterdir()).read_text()
    assert "## Outcome\n\nShipped.\n\n### Tasks\n\n- [x] #1.0 Retry the fetch (m1)\n" in text


def test_the_mcp_tools_answer_an_error_and_the_server_goes_on(project, no_sqlite):
    server = McpProcess(project, "--role", "executor", env=no_sqlite)
    try:
        server.initialize()
        names = [tool["name"] for tool in server.result("tools/list")["tools"]]
        assert "repository_graph_search" in names and "project_context_search" in names
        for name, arguments in (("repository_graph_search", {"query": "main"}),
                                ("project_context_search", {"query": "cache"}),
                                ("project_memory_status", {})):
            answer = server.call_tool(name, arguments)
            assert answer["isError"], name
            assert "needs Python's sqlite3 module" in answer["content"][0]["text"]
        assert not server.call_tool("status", {}).get("isError")
    finally:
        server.close()
