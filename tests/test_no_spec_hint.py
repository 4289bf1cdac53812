"""`ferrus run --milestone next` without any spec says how to write one by hand: from
.ferrus/SPEC_TEMPLATE.md, which `init` wrote."""

from conftest import run_cli


def test_the_hint_names_the_template(project):
    result = run_cli("run", "--milestone", "next", cwd=project)
    assert result.returncode == 1
    assert "ferrus: there is no spec in docs/specs" in result.stderr
    assert "by hand from the template in .ferrus/SPEC_TEMPLATE.md" in result.stderr
    assert (project / ".ferrus" / "SPEC_TEMPLATE.md").is_file()
