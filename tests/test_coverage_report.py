"""`.ci/coverage-report`, the printer behind `make coverage`: regions by module, floor.

It is fed coverage.py's JSON shape directly, so these tests need no coverage.py."""

import importlib.machinery
import importlib.util
import io
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      ".ci", "coverage-report")

RULE = "# " + "=" * 76
SOURCE = '''"""Head."""
import os

%(rule)s
# src/ferrus/first.py (from its line 10)
%(rule)s
# First: the first module.

def alpha(x):
    if x:
        return 1
    y = 2
    z = 3
    return y + z


%(rule)s
# src/ferrus/second.py (from its line 3)
%(rule)s
# Second: the second module.

class Beta:
    def one(self):
        a = 1
        return a

    def two(self):
        return 2


def gamma(flag):
    if flag:
        pass
    return 0
''' % {"rule": RULE}


@pytest.fixture(scope="module")
def script():
    loader = importlib.machinery.SourceFileLoader("coverage_report", SCRIPT)
    spec = importlib.util.spec_from_loader("coverage_report", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def fake_data(path):
    # Lines of the built file (as coverage.py numbers them): 2 import, 9 def alpha, 10 if,
    # 11 return 1, 12-14 rest of alpha, 22 class, 23 def one, 24-25 body, 27 def two,
    # 28 return, 31 def gamma, 32 if, 33 pass, 34 return.
    executed = [2, 9, 10, 11, 22, 23, 27, 31, 32, 33, 34]
    missing = [12, 13, 14, 24, 25, 28]
    return {"files": {path: {
        "executed_lines": executed, "missing_lines": missing,
        "executed_branches": [[10, 11], [32, 33]],
        "missing_branches": [[10, 12], [32, 34]],
        "summary": {"percent_covered": 56.25, "num_statements": 17, "missing_lines": 6,
                    "num_branches": 4, "missing_branches": 2}}}}


def test_regions_are_grouped_by_module_with_the_modules_own_lines(script, tmp_path):
    path = tmp_path / "ferrus.py"
    path.write_text(SOURCE)
    out = io.StringIO()
    total = script.report(fake_data(str(path)), str(path), 60, out=out)
    text = out.getvalue()
    assert total == 56.25
    lines = [line.rstrip() for line in text.splitlines()]
    first, second = lines.index("src/ferrus/first.py"), lines.index("src/ferrus/second.py")
    assert first < second
    # One region for alpha's tail (its branch 10->12 lands in it, so it is not repeated),
    # numbered as lines of first.py (its code starts at its line 10).
    assert lines[first + 1].split() == ["13-15", "alpha", "(3", "statements)"]
    assert lines[first + 2] == ""
    # Beta.one and Beta.two are separate regions although no statement runs between them.
    assert lines[second + 1].split() == ["5-6", "Beta.one", "(2", "statements)"]
    assert lines[second + 2].split() == ["9", "Beta.two", "(1", "statement)"]
    assert lines[second + 3].split() == ["13->15", "gamma:", "branch", "never", "taken"]
    assert "ferrus.py: 56.25% covered (statements and branches); floor 60%" in text
    # Module shares count statements and branches: first has 4 of 8 (3 of 6 statements,
    # 1 of 2 branches), second 8 of 12 (7 of 10, 1 of 2); the import is the file's head.
    assert [line.split()[-2:] for line in lines if line.startswith("  src/ferrus/first.py")] \
        == [["50.00%", "4"]]
    assert [line.split()[-2:] for line in lines if line.startswith("  src/ferrus/second.py")] \
        == [["66.67%", "4"]]
    assert [line.split()[-2:] for line in lines if line.startswith("  ferrus.py (head)")] == [
        ["100.00%", "0"]]


def test_brief_prints_only_the_totals(script, tmp_path):
    path = tmp_path / "ferrus.py"
    path.write_text(SOURCE)
    out = io.StringIO()
    script.report(fake_data(str(path)), str(path), None, brief=True, out=out)
    assert "Uncovered regions" not in out.getvalue()
    assert "floor" not in out.getvalue()


def test_data_without_the_file_is_a_clear_error(script, tmp_path, capsys):
    path = tmp_path / "ferrus.py"
    path.write_text(SOURCE)
    with pytest.raises(SystemExit) as exit_info:
        script.report({"files": {"/elsewhere/other.py": {}}}, str(path), None)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "the coverage data has no ferrus.py (measured: /elsewhere/other.py)" in err
    assert "hint:" in err


def test_make_coverage_without_coverage_py_says_how_to_get_it():
    """A Python that has pytest but no coverage.py and is no virtual environment is
    left alone: make says what is missing and how to get it, and measures nothing."""
    import shutil
    import subprocess
    import sys
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    base = os.path.join(sys.base_prefix, "bin", "python3")
    if not os.path.exists(base):
        pytest.skip("no base interpreter at %s" % base)
    probe = subprocess.run([base, "-c", "import pytest\ntry:\n import coverage\nexcept "
                            "ImportError:\n raise SystemExit(0)\nraise SystemExit(1)"],
                           capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip("%s lacks pytest or already has coverage.py" % base)
    repo = os.path.dirname(os.path.dirname(SCRIPT))
    result = subprocess.run(["make", "-s", "-C", repo, "coverage", "PYTHON=%s" % base],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "coverage.py 7.10+ is not installed for %s" % base in result.stderr
    assert "hint: python3 -m venv .venv" in result.stderr
    assert "passed" not in result.stdout, "the tests ran anyway"
