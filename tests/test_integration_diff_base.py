"""After the merge queue sends a task back with its branch moved onto the target (rebased
for a red check on the merged result, or merged with the target for a conflict), the
task's diff -- what its reviewer is shown, `ferrus diff`, HQ's /diff -- is measured from
that target head: the task's own work, not what other tasks brought to the target."""

import ferrus
from conftest import enqueue, run_tasks, scripted_setup, statuses


def test_a_task_sent_back_for_red_checks_after_the_merge_diffs_against_the_target(git_project):
    # The check fails when both files exist: each task alone passes it.
    store = scripted_setup(git_project, ["test ! -f left.txt || test ! -f right.txt"])
    enqueue(store, "Left.\n\nWRITE left.txt: left\n")
    enqueue(store, "Right.\n\nWRITE right.txt: right\n")
    code, lines = run_tasks(store, 2)
    assert code == ferrus.RUN_FAILED, "\n".join(lines)
    failed = [task for task, status in statuses(store).items() if status == "failed"]
    assert len(failed) == 1
    task_store = store.for_task(failed[0])
    mine = "right.txt" if "right" in task_store.read_file("TASK.md") else "left.txt"
    other = {"right.txt": "left.txt", "left.txt": "right.txt"}[mine]
    diff = ferrus.op_diff(task_store)
    assert [f["path"] for f in diff.data["files"]] == [mine], diff.text
    assert other not in diff.text
    assert "the merge queue put the task's branch on the target's head" in diff.text
    sent_back = [e for e in store.read_journal() if e["event"] == "integration_failed"]
    main_head = ferrus.target_head(str(git_project), "main")
    assert sent_back and all(e["detail"]["onto"] == main_head[:12] for e in sent_back)
    assert task_store.read_state().task_base["commit"] == main_head
