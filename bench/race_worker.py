"""Child process for the transition race: COUNT transactions on one .ferrus/.

    python race_worker.py FERRUS_PY ROOT INDEX COUNT

Prints ``ready``, waits for a line on stdin (the parent releases every worker
at once), then alternates two kinds of ``store.transaction`` read-modify-write:

* even k: ``Store.append_event`` (a journal entry that bumps ``rev``);
* odd k: a real state change, Idle -> Executing (``t_create_task``, TASK.md
  written) or back (``t_force_reset``, TASK.md cleared), which also increments
  the ``bench_counter`` field kept in STATE.json.

Ends with one JSON line: transitions done, errors, elapsed seconds, and where
the time went: how long this worker held STATE.lock, waited for it, and spent
in os.fsync (counted by wrapping ``os.fsync`` and ``FileLock``; the wrappers
cost microseconds against milliseconds per transition).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcpclient import load_ferrus  # noqa: E402


def instrument(ferrus, stats):
    """Count fsyncs and time the lock: wraps os.fsync and ferrus.FileLock in this process."""
    real_fsync = os.fsync

    def fsync(fd):
        started = time.perf_counter()
        try:
            return real_fsync(fd)
        finally:
            stats["fsyncs"] += 1
            stats["fsync_s"] += time.perf_counter() - started
    os.fsync = fsync

    lock_class = ferrus.FileLock
    real_acquire, real_release = lock_class.acquire, lock_class.release

    def acquire(self):
        started = time.perf_counter()
        result = real_acquire(self)
        self._bench_acquired = time.perf_counter()
        stats["lock_wait_s"] += self._bench_acquired - started
        return result

    def release(self):
        acquired = getattr(self, "_bench_acquired", None)
        real_release(self)
        if acquired is not None:
            stats["lock_held_s"] += time.perf_counter() - acquired
            self._bench_acquired = None
    lock_class.acquire, lock_class.release = acquire, release


def toggle(ferrus, store, actor, index, k):
    with store.transaction(actor) as tx:
        data = tx.state
        now = store.clock()
        counter = int(data.extra.get("bench_counter", 0))
        if data.state == ferrus.TaskState.IDLE:
            new = ferrus.t_create_task(data, now, ferrus.new_id("t"))
            tx.write("TASK.md", "race task from worker %d, step %d\n" % (index, k))
            event = "create_task"
        else:
            new = ferrus.t_force_reset(data, now)
            tx.write("TASK.md", "")
            event = "force_reset"
        new.extra = dict(data.extra)
        new.extra["bench_counter"] = counter + 1
        tx.set(new, event, worker=index, k=k)


def main(argv):
    ferrus = load_ferrus(argv[1])
    root, index, count = argv[2], int(argv[3]), int(argv[4])
    store = ferrus.Store(root)
    stats = {"fsyncs": 0, "fsync_s": 0.0, "lock_wait_s": 0.0, "lock_held_s": 0.0}
    instrument(ferrus, stats)
    actor = "bench:race:%d" % index
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    if not sys.stdin.readline():
        return 1
    done = toggles = 0
    errors = []
    started = time.perf_counter()
    for k in range(count):
        try:
            if k % 2 == 0:
                store.append_event(actor, "bench_tick", {"worker": index, "k": k})
            else:
                toggle(ferrus, store, actor, index, k)
                toggles += 1
            done += 1
        except Exception as err:  # reported, never silently dropped
            if len(errors) < 5:
                errors.append("%s: %s" % (type(err).__name__, err))
            elif len(errors) == 5:
                errors.append("...")
    elapsed = time.perf_counter() - started
    result = {"worker": index, "done": done, "toggles": toggles, "errors": errors,
              "elapsed": elapsed}
    result.update(stats)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
