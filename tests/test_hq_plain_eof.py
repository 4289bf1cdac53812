"""Plain HQ fed by a pipe ends with its input; when a task is in flight it says so and
where the task stays, instead of vanishing with its agents stopped and nothing said."""

import io

import ferrus
from conftest import scripted_project


def test_input_ending_with_a_task_in_flight_says_what_is_left(project, tmp_path, monkeypatch):
    store = scripted_project(project, tmp_path / "memory")
    monkeypatch.setenv("SCRIPTED_DIR", str(tmp_path / "memory"))
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO("/task Make work.txt\n"), stdout=out,
                           resume=False)
    assert shell.run() == 0
    text = out.getvalue()
    assert "Input ended: HQ leaves" in text
    assert "the task stays Executing. `ferrus run --resume` or `ferrus hq` goes on" in text
    data = store.read_state()
    assert data.state == ferrus.S.EXECUTING and data.claimed_by is None


def test_input_ending_with_nothing_in_flight_says_nothing_more(project, tmp_path):
    store = scripted_project(project, tmp_path / "memory")
    out = io.StringIO()
    assert ferrus.HqShell(store, stdin=io.StringIO("/status\n"), stdout=out).run() == 0
    assert "Input ended" not in out.getvalue()
