"""`ferrus register` writes through symlinks and is all-or-nothing (issue #11 item 6)."""

import json
import os

import pytest

import ferrus
from conftest import run_cli

pytestmark = pytest.mark.skipif(os.name == "nt", reason="symlinks need privileges on Windows")

QUIET = lambda message: None  # noqa: E731


def snapshot(*roots):
    """Every file under ``roots`` with its bytes (symlinks recorded as links)."""
    files = {}
    for root in roots:
        for folder, dirs, names in os.walk(str(root)):
            for name in names + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
                path = os.path.join(folder, name)
                if os.path.islink(path):
                    files[path] = ("link", os.readlink(path))
                else:
                    with open(path, "rb") as handle:
                        files[path] = handle.read()
    return files


@pytest.fixture
def home(tmp_path, monkeypatch):
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.delenv("CODEX_HOME", raising=False)
    return folder


def test_register_writes_through_a_symlinked_claude_md(project, tmp_path, home):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "CLAUDE.md").write_text("# Shared instructions\n")
    os.symlink(str(shared / "CLAUDE.md"), str(project / "CLAUDE.md"))
    ferrus.register_agents(str(project), {"supervisor": ("claude-code", None)}, report=QUIET)
    assert os.path.islink(str(project / "CLAUDE.md")), "the link was replaced by a copy"
    text = (shared / "CLAUDE.md").read_text()
    assert text.startswith("# Shared instructions\n") and "ferrus-supervisor-instructions" in text


def test_register_writes_through_symlinked_settings_and_codex_config(project, tmp_path, home):
    shared = tmp_path / "dotfiles"
    shared.mkdir()
    (shared / "config.toml").write_text("# my codex settings\nmodel = \"o3\"\n")
    (shared / "settings.local.json").write_text('{"permissions": {"allow": ["Bash(ls)"]}}\n')
    (project / ".codex").mkdir()
    (project / ".claude").mkdir()
    # A relative link, as dotfile managers make them.
    os.symlink(os.path.relpath(str(shared / "config.toml"), str(project / ".codex")),
               str(project / ".codex" / "config.toml"))
    os.symlink(str(shared / "settings.local.json"), str(project / ".claude" / "settings.local.json"))
    ferrus.register_agents(str(project), {"supervisor": ("claude-code", None),
                                          "executor": ("codex", None)}, report=QUIET)
    assert os.path.islink(str(project / ".codex" / "config.toml"))
    assert os.path.islink(str(project / ".claude" / "settings.local.json"))
    codex = (shared / "config.toml").read_text()
    assert codex.startswith("# my codex settings\n") and "[mcp_servers.ferrus-executor-1]" in codex
    allowed = json.loads((shared / "settings.local.json").read_text())["permissions"]["allow"]
    assert allowed == ["Bash(ls)", "mcp__ferrus-supervisor-1__*"]
    # Unregister writes through the links as well.
    ferrus.unregister_agents(str(project), ["executor"], report=QUIET)
    assert os.path.islink(str(project / ".codex" / "config.toml"))
    assert "ferrus-executor-1" not in (shared / "config.toml").read_text()


def test_a_dangling_symlink_gets_its_target_created(project, tmp_path, home):
    os.symlink(str(tmp_path / "elsewhere" / "GEMINI.md"), str(project / "GEMINI.md"))
    ferrus.register_agents(str(project), {"executor": ("gemini-cli", None)}, report=QUIET)
    assert os.path.islink(str(project / "GEMINI.md"))
    assert "ferrus-executor-instructions" in (tmp_path / "elsewhere" / "GEMINI.md").read_text()


def test_a_commented_trust_file_fails_before_anything_is_written(project, home):
    (home / ".qwen").mkdir()
    (home / ".qwen" / "trustedFolders.json").write_text(
        '{\n  // folders I trust\n  "/somewhere": "TRUST_FOLDER"\n}\n')
    before = snapshot(project, home)
    with pytest.raises(ferrus.FerrusError) as info:
        ferrus.register_agents(str(project), {"supervisor": ("claude-code", None),
                                              "executor": ("qwen-code", None)},
                               trust=True, report=QUIET)
    assert "has comments" in info.value.message and "trustedFolders.json" in info.value.message
    assert "nothing was written" in info.value.hint
    assert snapshot(project, home) == before


def test_cli_register_with_a_commented_trust_file_writes_nothing(project, home):
    (home / ".qwen").mkdir()
    (home / ".qwen" / "trustedFolders.json").write_text('/* mine */ {}\n')
    before = snapshot(project, home)
    result = run_cli("register", "--executor", "qwen-code", "--trust", cwd=project,
                     env={"HOME": str(home)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "has comments" in result.stderr and "hint:" in result.stderr
    assert "Registered" not in result.stdout
    assert snapshot(project, home) == before


def test_a_broken_file_met_late_leaves_the_earlier_ones_alone(project, home):
    (project / ".gemini").mkdir()
    (project / ".gemini" / "settings.json").write_text("[1, 2]\n")   # not an object
    before = snapshot(project, home)
    with pytest.raises(ferrus.FerrusError):
        ferrus.register_agents(str(project), {"supervisor": ("codex", None),
                                              "executor": ("gemini-cli", None)}, report=QUIET)
    assert snapshot(project, home) == before


def test_a_failing_write_leaves_every_file_as_it_was(project, home, monkeypatch):
    before = snapshot(project, home)
    real = ferrus.write_temp_beside
    calls = []

    def full_disk_on_the_third(path, data, durable=True):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, data, durable)
    monkeypatch.setattr(ferrus, "write_temp_beside", full_disk_on_the_third)
    with pytest.raises(OSError):
        ferrus.register_agents(str(project), {"supervisor": ("claude-code", None),
                                              "executor": ("codex", None)}, report=QUIET)
    assert len(calls) == 3
    assert snapshot(project, home) == before       # no temporary file left either


def test_a_failing_rename_puts_back_the_files_already_replaced(project, home, monkeypatch):
    before = snapshot(project, home)
    real = os.replace
    calls = []

    def refuse_the_fourth(source, target):
        calls.append(target)
        if len(calls) == 4:
            raise OSError(30, "Read-only file system")
        return real(source, target)
    monkeypatch.setattr(ferrus.os, "replace", refuse_the_fourth)
    with pytest.raises(OSError):
        ferrus.register_agents(str(project), {"supervisor": ("claude-code", None),
                                              "executor": ("codex", None)}, report=QUIET)
    monkeypatch.setattr(ferrus.os, "replace", real)
    assert len(calls) >= 4
    after = snapshot(project, home)
    # New files are removed again and changed ones restored (directories may remain).
    assert after == before


def test_messages_are_reported_only_after_the_commit(project, home):
    messages = []
    ferrus.register_agents(str(project), {"executor": ("codex", None)}, report=messages.append)
    assert any("Registered ferrus-executor-1 in .codex/config.toml" in m for m in messages)
    assert os.path.exists(str(project / ".codex" / "config.toml"))
