"""`ferrus init` ends with the next steps still to do: in a fresh folder all three, in a
project whose checks are set and agents registered only `run`."""

import ferrus
from conftest import run_cli, scripted_project


def test_a_fresh_project_gets_every_step(tmp_path):
    out = run_cli("init", cwd=tmp_path).stdout.strip().splitlines()[-1]
    assert out.startswith("ferrus is initialized. Next: put your lint and test commands in "
                          "[checks] of ferrus.toml, then `")
    assert " register` (the agents [hq.*] names" in out and " run --task " in out


def test_a_set_up_project_is_only_told_to_run(project, tmp_path):
    scripted_project(project, tmp_path / "memory")       # checks set, both roles registered
    out = run_cli("init", cwd=project).stdout.strip().splitlines()[-1]
    assert out.startswith("ferrus is initialized. Next: `") and out.endswith(
        ' run --task "..."`.')
    assert "[checks]" not in out and "register" not in out
