"""Small things a new user tripped over: "did you mean", `check` outside a task,
`unregister` cleaning up after itself."""

import io
import os

import ferrus


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
