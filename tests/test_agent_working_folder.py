"""An agent starts in its folder with $PWD naming that folder, as a shell starts a program:
opencode (a Bun program) takes its project folder from $PWD rather than from its working
directory, and with the $PWD of wherever ferrus was started it refused every edit in the
project or the task's worktree as outside its project."""

import sys

import ferrus

PRINT_FOLDERS = "import os; print('cwd=%s pwd=%s' % (os.getcwd(), os.environ.get('PWD')))"


def test_an_agent_session_sees_its_folder_in_pwd(tmp_path, monkeypatch):
    monkeypatch.setenv("PWD", str(tmp_path))          # ferrus itself runs elsewhere
    folder = tmp_path / "worktree"
    folder.mkdir()
    log_path = str(tmp_path / "logs" / "executor.log")
    launch = ferrus.Launch([sys.executable, "-c", PRINT_FOLDERS])
    process = ferrus.AgentProcess(launch, str(folder), log_path, lambda line: [])
    process.proc.wait()
    process.finish()
    with open(log_path) as handle:
        printed = handle.read()
    assert "pwd=%s\n" % folder in printed, printed


def test_a_pipeline_worker_sees_its_folder_in_pwd(tmp_path, monkeypatch):
    monkeypatch.setenv("PWD", "/")
    folder = tmp_path / "project"
    folder.mkdir()
    base = str(tmp_path / "worker")
    launch = ferrus.Launch([sys.executable, "-c", PRINT_FOLDERS])
    ferrus.start_worker_process(launch, str(folder), base).wait()
    with open(base + ".log") as handle:
        printed = handle.read()
    assert "pwd=%s\n" % folder in printed, printed
