"""`ferrus doctor` warns about a milestone whose `Depends on:` names nothing in its spec:
the picker ignores it, so a typo let `ferrus run --milestone next` take the milestone
before the one it was written to wait for."""

import ferrus
from conftest import run_cli

SPEC = """# Demo

## Milestones

- [ ] #1.0 First
  - ID: m1.0
  - Depends on: none
- [ ] #1.1 Second
  - ID: m1.1
  - Depends on: #1.0, m1.0
- [ ] #2.0 Third
  - ID: m2.0
  - Depends on: #1.O, m9
"""


def test_doctor_names_the_milestone_and_its_unknown_dependencies(project):
    (project / "docs" / "specs" / "2026-01-01-demo.md").write_text(SPEC)
    result = run_cli("doctor", cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr     # a warning only
    out = result.stdout + result.stderr
    assert ("docs/specs/2026-01-01-demo.md: milestone #2.0 depends on #1.O, m9, which no "
            "milestone of this spec is") in out
    assert "milestone #1.1" not in out
    # The picker's rule the warning describes: the unknown names do not hold #2.0 back.
    milestones = ferrus.parse_spec(SPEC)
    assert ferrus.dependencies_met(milestones[2], milestones)


def test_a_spec_with_known_dependencies_gives_no_warning(project):
    (project / "docs" / "specs" / "2026-01-01-demo.md").write_text(SPEC.replace(
        "#1.O, m9", "#1.1"))
    out = run_cli("doctor", cwd=project)
    assert "depends on" not in out.stdout + out.stderr
