"""A mistyped agent name gets the closest known one, and the short names are listed."""

from conftest import run_cli


def test_a_typo_is_answered_with_the_name_meant(project):
    result = run_cli("register", "--supervisor", "claud", "--executor", "codex", cwd=project)
    assert result.returncode == 1
    assert "Unknown agent 'claud'. Supported values: \"claude-code\", \"codex\", " \
        "\"qwen-code\", \"gemini-cli\", \"nano\", \"opencode\", \"goose\" (or \"claude\", " \
        "\"qwen\", \"gemini\" for short)" in result.stderr
    assert 'hint: did you mean "claude"? Otherwise describe it under [agents.custom.<name>]' \
        in result.stderr
    far = run_cli("register", "--supervisor", "zzz", "--executor", "codex", cwd=project)
    assert "hint: or describe it under [agents.custom.<name>]" in far.stderr
