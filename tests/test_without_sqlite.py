"""A Python built without its sqlite3 module (some minimal builds are) still runs ferrus:
every command starts and works, and only the repository graph and project memory —
sqlite caches — say that they need it, from the CLI and as MCP tool errors."""

import pytest

from conftest import run_cli
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
                 ["graph", "--help"]):
        result = run_cli(*argv, cwd=project, env=no_sqlite)
        assert result.returncode == 0, (argv, result.stderr)
        assert "sqlite" not in result.stderr, (argv, result.stderr)
    for argv in (["graph", "index"], ["graph", "search", "main"], ["graph", "status"]):
        result = run_cli(*argv, cwd=project, env=no_sqlite)
        assert result.returncode == 1, (argv, result.stdout, result.stderr)
        assert "ferrus: the repository graph needs Python's sqlite3 module" in result.stderr
        assert "hint:" in result.stderr and "Traceback" not in result.stderr


def test_the_mcp_tools_answer_an_error_and_the_server_goes_on(project, no_sqlite):
    server = McpProcess(project, "--role", "executor", env=no_sqlite)
    try:
        server.initialize()
        names = [tool["name"] for tool in server.result("tools/list")["tools"]]
        assert "repository_graph_search" in names
        answer = server.call_tool("repository_graph_search", {"query": "main"})
        assert answer["isError"]
        assert "needs Python's sqlite3 module" in answer["content"][0]["text"]
        assert not server.call_tool("status", {}).get("isError")
    finally:
        server.close()
