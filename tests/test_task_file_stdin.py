"""`ferrus run --task-file -` reads the task from stdin, as `ferrus reject --file -` does."""

import ferrus
from conftest import run_cli, scripted_project


def test_the_task_comes_from_stdin(project, tmp_path, monkeypatch):
    store = scripted_project(project, tmp_path / "memory")
    monkeypatch.setenv("SCRIPTED_DIR", str(tmp_path / "memory"))
    result = run_cli("run", "--quiet", "--task-file", "-", cwd=project,
                     input="Make work.txt\nwith a second line\n", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Task complete." in result.stdout
    assert store.read_file("TASK.md").strip() == "Make work.txt\nwith a second line"


def test_an_empty_stdin_is_an_empty_task(project):
    result = run_cli("run", "--task-file", "-", cwd=project, input="  \n")
    assert result.returncode == 2 and "the task description is empty" in result.stderr
