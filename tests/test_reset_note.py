"""`ferrus reset` counts the files it leaves changed in good English: one file differs."""

import subprocess

import ferrus
from conftest import run_cli


def git(project, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
                   + list(args), cwd=str(project), check=True, capture_output=True)


def test_reset_says_one_file_differs_and_two_files_differ(project):
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "start")
    store = ferrus.Store(str(project))
    for count, verb in ((1, "differs"), (2, "differ")):
        ferrus.op_create_task(store, ferrus.HUMAN, "Change files")
        for index in range(count):
            (project / ("changed%d.txt" % index)).write_text("round %d\n" % count)
        out = run_cli("reset", "--yes", cwd=project).stdout
        assert "%d file%s in the work tree %s from HEAD" % (
            count, "" if count == 1 else "s", verb) in out
        git(project, "add", "-A")
        git(project, "commit", "-q", "-m", "more")
