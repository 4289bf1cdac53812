"""A running check is shown by the controller of the task whose worktree it runs in, and
by no other: each task of a parallel run shows only its own checks."""

import json
import os

import ferrus


def task_with_worktree(store, task, worktree):
    os.makedirs(worktree)
    os.makedirs(os.path.dirname(ferrus.task_record_path(store.dir, task)))
    ferrus.atomic_write(ferrus.task_record_path(store.dir, task),
                        json.dumps({"id": task, "status": "running", "worktree": str(worktree)}))
    return store.for_task(task)


def test_each_task_sees_only_the_checks_running_in_its_worktree(project, tmp_path):
    store = ferrus.Store(str(project))
    left = task_with_worktree(store, "t-20261124T063000-000001", tmp_path / "left")
    right = task_with_worktree(store, "t-20261124T063000-000002", tmp_path / "right")
    directory = store.path(ferrus.CHECK_PROCESS_DIR)
    records = [ferrus.CheckProcessRecord(directory, "check_1_a", "make left", left.workdir),
               ferrus.CheckProcessRecord(directory, "check_1_b", "make right", right.workdir),
               ferrus.CheckProcessRecord(directory, "check_1_c", "make here", str(project))]
    # A pid file of an older ferrus names no folder: every task shows it.
    os.makedirs(directory, exist_ok=True)
    ferrus.atomic_write(os.path.join(directory, "check_1_d.json"),
                        json.dumps({"command": "make old"}))
    try:
        assert ferrus.running_check_commands(left) == {"check_1_a": "make left",
                                                       "check_1_d": "make old"}
        assert ferrus.running_check_commands(right) == {"check_1_b": "make right",
                                                        "check_1_d": "make old"}
        assert ferrus.running_check_commands(store) == {"check_1_c": "make here",
                                                        "check_1_d": "make old"}
    finally:
        for record in records:
            record.close()


def test_a_check_records_the_folder_it_runs_in(project, tmp_path):
    worktree = tmp_path / "worktree"
    worktree.mkdir()
    # The command copies its own pid file while it runs.
    command = "cat %s/*.json > seen.json" % os.path.join(
        str(project), ferrus.FERRUS_DIR, ferrus.CHECK_PROCESS_DIR)
    run = ferrus.run_checks(str(worktree), ferrus.ChecksConfig(commands=[command]),
                            os.path.join(str(project), ferrus.FERRUS_DIR, "logs"),
                            project=str(project))
    assert run.passed
    assert json.loads((worktree / "seen.json").read_text())["cwd"] == str(worktree)
