"""`ferrus unregister` for Claude Code, one role at a time, through the CLI.

register writes .claude/mcp-<role>.json, a permission rule per role in
.claude/settings.local.json, a section per role in CLAUDE.md and .gitignore
lines; unregister takes back exactly its own part and leaves the user's."""

import json


def agents(cli, project):
    result = cli("agents", "--json", cwd=project)
    return {row["role"]: row for row in json.loads(result.stdout)}


def test_unregister_claude_code_role_by_role_keeps_the_users_settings(project, cli):
    claude = project / ".claude"
    claude.mkdir()
    users_settings = {"permissions": {"allow": ["Bash(ls:*)"]}, "theme": "dark"}
    (claude / "settings.local.json").write_text(json.dumps(users_settings))
    (project / "CLAUDE.md").write_text("# My notes\n")
    gitignore_before = (project / ".gitignore").read_text()

    done = cli("register", "--supervisor", "claude-code", "--executor", "claude-code",
               cwd=project)
    assert done.returncode == 0, done.stderr
    settings = json.loads((claude / "settings.local.json").read_text())
    assert settings["permissions"]["allow"] == [
        "Bash(ls:*)", "mcp__ferrus-supervisor-1__*", "mcp__ferrus-executor-1__*"]
    assert all(row["registered"] for row in agents(cli, project).values())

    # Only the executor: its server file, rule and instructions go; the supervisor stays.
    done = cli("unregister", "--executor", cwd=project)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "Removed ferrus-executor-1 from .claude/",
        "Removed the executor instructions from CLAUDE.md",
        "Removed .claude/mcp-executor.json (nothing else was in it)",
        "Removed .claude/mcp-executor.json from .gitignore"]
    assert sorted(p.name for p in claude.iterdir()) == ["mcp-supervisor.json",
                                                         "settings.local.json"]
    settings = json.loads((claude / "settings.local.json").read_text())
    assert settings == {"permissions": {"allow": ["Bash(ls:*)", "mcp__ferrus-supervisor-1__*"]},
                        "theme": "dark"}
    text = (project / "CLAUDE.md").read_text()
    assert "ferrus-supervisor-instructions" in text and "executor" not in text
    rows = agents(cli, project)
    assert rows["supervisor"]["registered"] and rows["supervisor"]["points_here"]
    assert not rows["executor"]["registered"]

    # Again: nothing of the executor is left, and nothing else is touched.
    done = cli("unregister", "--executor", cwd=project)
    assert done.returncode == 0, done.stderr
    assert json.loads((claude / "settings.local.json").read_text()) == settings
    assert (claude / "mcp-supervisor.json").exists()

    # The rest: the project is as the user left it.
    done = cli("unregister", cwd=project)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in claude.iterdir()) == ["settings.local.json"]
    assert json.loads((claude / "settings.local.json").read_text()) == users_settings
    assert (project / "CLAUDE.md").read_text() == "# My notes\n"
    # settings.local.json stays (it has the user's settings), and so does its ignore line:
    # a local settings file must not show up as a change to commit.
    assert (project / ".gitignore").read_text() == gitignore_before + \
        ".claude/settings.local.json\n"
    assert not any(row["registered"] for row in agents(cli, project).values())
