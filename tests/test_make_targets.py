"""The Makefile's targets as a developer meets them: `make test` without pytest says how
to install it instead of failing with Python's bare "No module named pytest"."""

import shutil
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_without_pytest_says_how_to_install_it():
    # -S hides site-packages, so this interpreter has no pytest.
    result = subprocess.run(["make", "-s", "-C", REPO, "test", "PYTHON=%s -S" % sys.executable],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "pytest is not installed" in result.stderr
    assert "-m pip install pytest" in result.stderr
