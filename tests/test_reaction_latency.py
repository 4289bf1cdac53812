"""What an agent waits for before it starts, and what the merge queue waits for between
two integrations: neither waits for bookkeeping (the bench's hq_reaction and
parallel_overhead rows measure how long; these tests pin the order)."""

import sys
import threading

import ferrus

SS = ferrus.SS


def session_moves(store):
    return [(e["detail"]["slot"], e["detail"]["from"], e["detail"]["to"])
            for e in store.read_journal() if e["event"] == "session"]


def test_hq_starts_the_agent_before_it_journals_the_session_moves(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "Do it.")
    seen_at_launch, seen_at_message = [], []

    def launcher(slot):
        seen_at_launch.append(session_moves(store))
        return ferrus.Launch(argv=[sys.executable, "-c", "import time; time.sleep(30)"]), \
            (lambda line: [])

    def emit(message):
        if message.kind == "agent" and message.text.startswith("started the executor"):
            seen_at_message.append(session_moves(store))

    controller = ferrus.HqController(store, emit=emit, launcher=launcher)
    try:
        controller.poll()
        # Nothing was committed between the decision to start the executor and its start,
        # nor before HQ said it started ...
        assert seen_at_launch == [[]] and seen_at_message == [[]]
        # ... and the moves are all journaled afterwards, in their order, the pid in Running.
        assert session_moves(store) == [("executor", "Initializing", "BuildingPrompt"),
                                        ("executor", "BuildingPrompt", "Spawning"),
                                        ("executor", "Spawning", "Running")]
        running = [e for e in store.read_journal() if e["event"] == "session"][-1]
        assert running["detail"]["pid"] == controller.slots["executor"].process.pid
        assert store.read_state().extra[ferrus.TASK_SESSIONS_KEY]["sessions"] == 1
        assert controller.slots["executor"].state == SS.RUNNING
    finally:
        controller.shutdown()


def test_a_launcher_that_fails_still_leaves_its_moves_journaled(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "Do it.")

    def launcher(slot):
        raise ferrus.FerrusError("no such agent", "install it")

    controller = ferrus.HqController(store, emit=lambda message: None, launcher=launcher)
    try:
        controller.poll()
        assert session_moves(store) == [("executor", "Initializing", "BuildingPrompt"),
                                        ("executor", "BuildingPrompt", "Spawning"),
                                        ("executor", "Spawning", "Stopped")]
    finally:
        controller.shutdown()


def test_the_merge_queue_starts_the_next_integration_in_the_step_the_last_one_ended(store):
    runner = ferrus.ParallelRunner(store, lambda message: None, 2)
    finished = threading.Thread(target=lambda: None)
    finished.start()
    finished.join()
    runner.integration = {"task": "t-first", "thread": finished, "result": None,
                          "error": None}
    calls = []
    runner._finish_integration = lambda job: calls.append(("finish", job["task"]))
    runner.integrating = lambda: ["t-second"]
    runner._start_integration = lambda task: calls.append(("start", task))
    runner._integrate()
    assert calls == [("finish", "t-first"), ("start", "t-second")]
    assert runner.integration is None        # the stand-in started no thread


def test_a_phase_is_saved_for_recovery_before_the_journal_shows_it(store):
    # A run killed right after its phase entry reached the journal resumes in that phase
    # (tests/test_parallel.py kills a run the moment it sees the entry).
    runner = ferrus.ParallelRunner(store, lambda message: None, 2)
    saved_when_journaled = []
    journal_phase = runner._journal_phase

    def spy(record):
        saved_when_journaled.append((record["phase"],
                                     ferrus.read_parallel_run(store).get("phase")))
        journal_phase(record)
    runner._journal_phase = spy
    assert runner.advance(1) and runner.advance(2)
    assert saved_when_journaled == [(1, 1), (2, 2)]
