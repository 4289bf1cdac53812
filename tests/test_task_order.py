"""Tasks queued within the same second keep their order: the queue's order is its ids'."""

import datetime as dt
import os

import ferrus


def test_tasks_queued_in_one_second_run_in_the_order_they_were_queued(project, monkeypatch):
    moment = dt.datetime(2026, 11, 24, 6, 30, 0, tzinfo=dt.timezone.utc)
    monkeypatch.setattr(ferrus, "utc_now", lambda: moment)
    store = ferrus.Store(str(project))
    queued = [ferrus.op_enqueue_task(store, ferrus.HUMAN, "Task %d." % n).data["task_id"]
              for n in range(40)]
    assert len(set(queued)) == 40
    assert ferrus.queued_task_ids(store) == queued
    assert [row["id"] for row in ferrus.task_rows(store)] == queued
    assert all(task.startswith("t-20261124T063000-") for task in queued)


def test_a_second_whose_ids_are_used_up_takes_the_next_one(project, monkeypatch):
    times = iter([dt.datetime(2026, 11, 24, 6, 30, 0, tzinfo=dt.timezone.utc),
                  dt.datetime(2026, 11, 24, 6, 30, 1, tzinfo=dt.timezone.utc)])
    monkeypatch.setattr(ferrus, "utc_now", lambda: next(times))
    monkeypatch.setattr(ferrus.time, "sleep", lambda seconds: None)
    store = ferrus.Store(str(project))
    os.makedirs(store.path(ferrus.TASKS_DIR, "t-20261124T063000-ffffff"))
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Late.").data["task_id"]
    assert task.startswith("t-20261124T063001-")
