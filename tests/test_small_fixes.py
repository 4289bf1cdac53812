"""Small things a new user tripped over: "did you mean", `check` outside a task,
`unregister` cleaning up after itself."""

import io
import os

import ferrus


def test_a_mistyped_command_or_option_gets_a_suggestion(project, cli):
    result = cli("stauts", cwd=project)
    assert result.returncode == 2 and "hint: did you mean status?" in result.stderr
    result = cli("status", "--jsno", cwd=project)
    assert result.returncode == 2 and "hint: did you mean --json?" in result.stderr
    result = cli("run", "--untill-done", cwd=project)
    assert "hint: did you mean --until-done?" in result.stderr
    result = cli("serve", "--role", "executr", cwd=project)
    assert "hint: did you mean executor?" in result.stderr
    result = cli("pipeline", "stauts", cwd=project)
    assert "hint: did you mean status?" in result.stderr
    result = cli("xyzzy", cwd=project)
    assert result.returncode == 2 and "did you mean" not in result.stderr


def test_hq_suggests_a_command(store):
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    shell.handle("/stauts")
    assert "unknown command /stauts — did you mean /status? /help lists them" in out.getvalue()


def test_check_outside_a_task_points_at_force(project, cli):
    result = cli("check", cwd=project)
    assert result.returncode == 1
    assert "Cannot run checks from state Idle" in result.stderr
    assert "hint: `ferrus check --force`" in result.stderr


def test_unregister_removes_the_files_it_emptied(project, cli):
    (project / "CLAUDE.md").write_text("# my notes\n")
    gitignore_before = (project / ".gitignore").read_text()
    before = sorted(os.listdir(str(project)))
    for agent in ("claude-code", "codex", "qwen-code", "gemini-cli"):
        assert cli("register", "--supervisor", agent, "--executor", agent,
                   cwd=project).returncode == 0
        result = cli("unregister", cwd=project)
        assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(str(project))) == before
    assert (project / ".gitignore").read_text() == gitignore_before
    assert (project / "CLAUDE.md").read_text().startswith("# my notes")


def test_unregister_keeps_a_file_with_other_content(project, cli):
    (project / ".qwen").mkdir()
    (project / ".qwen" / "settings.json").write_text('{"theme": "dark"}')
    cli("register", "--executor", "qwen-code", cwd=project)
    cli("unregister", cwd=project)
    assert '"theme": "dark"' in (project / ".qwen" / "settings.json").read_text()


def test_make_test_without_pytest_says_how_to_install_it():
    import shutil
    import subprocess
    import sys
    import pytest
    from conftest import REPO
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # -S hides site-packages, so this interpreter has no pytest.
    result = subprocess.run(["make", "-s", "-C", REPO, "test", "PYTHON=%s -S" % sys.executable],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "pytest is not installed" in result.stderr
    assert "-m pip install pytest" in result.stderr
