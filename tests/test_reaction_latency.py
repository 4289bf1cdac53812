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


def test_an_approved_task_enters_the_merge_queue_in_the_step_that_sees_it(store):
    runner = ferrus.ParallelRunner(store, lambda message: None, 2)
    assert runner.advance(1) and runner.advance(2) and runner.advance(3) and runner.advance(4)
    started = []
    runner.integrating = lambda: ["t-approved"]
    runner._start_integration = started.append
    runner._collect()
    assert runner.machine.phase == 5 and started == ["t-approved"]


def test_the_next_integration_starts_before_the_merged_tasks_worktrees_are_removed(store):
    runner = ferrus.ParallelRunner(store, lambda message: None, 2)
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    runner.integration = {"task": "t-merged", "thread": done}
    order = []

    def finish(job):
        # What _end_task does for a merged task: its worktrees' removal is held.
        assert runner.held_cleanups is not None
        runner.held_cleanups.append(lambda: order.append("removed t-merged"))
        order.append("merged t-merged")

    runner._finish_integration = finish
    runner.integrating = lambda: ["t-next"]
    runner._start_integration = lambda task: order.append("started " + task)
    runner._integrate()
    assert order == ["merged t-merged", "started t-next", "removed t-merged"]
    assert runner.held_cleanups is None     # outside a wind-up, removals are not held


def sleeping_agents(launched):
    """A launcher whose agents sleep (their names go to ``launched``)."""
    def launcher(slot):
        launched.append(slot.name)
        return ferrus.Launch(argv=[sys.executable, "-c", "import time; time.sleep(30)"]), \
            (lambda line: [])
    return launcher


def test_stopping_the_agents_journals_no_move_for_an_idle_slot(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "Do it.")
    controller = ferrus.HqController(store, emit=lambda message: None,
                                     launcher=sleeping_agents([]))
    try:
        controller.poll()
        before = len(session_moves(store))
        controller.stop_all()
        # The running executor's stop is journaled; the idle reviewer and consultant
        # only start afresh.
        assert session_moves(store)[before:] == [("executor", "Running", "Stopped")]
        assert all(slot.state == SS.INITIALIZING and slot.process is None
                   for slot in controller.slots.values())
    finally:
        controller.shutdown()


def test_held_session_moves_wait_for_the_release_and_still_count_as_sessions(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "Do it.")
    launched = []
    controller = ferrus.HqController(store, emit=lambda message: None,
                                     launcher=sleeping_agents(launched))
    try:
        controller.hold_session_moves()
        controller.poll()
        assert launched == ["executor"] and session_moves(store) == []
        assert controller.signals().sessions == 1      # the gate counts the started one
        controller.release_session_moves()
        assert [to for _, _, to in session_moves(store)] == ["BuildingPrompt", "Spawning",
                                                             "Running"]
        assert controller.signals().sessions == 1
    finally:
        controller.shutdown()


class StubController:
    """A task's controller as the runner's step sees it (no question, no slots): each
    call is recorded in ``calls``, and ``poll`` also does ``on_poll(self)``."""

    def __init__(self, name, calls=None, on_poll=None):
        self.name = name
        self.shown_question = self.shown_confirmation = None
        self.slots = {}
        self.calls = [] if calls is None else calls
        self.on_poll = on_poll

    def hold_session_moves(self):
        self.calls.append(("hold", self.name))

    def poll(self):
        self.calls.append(("poll", self.name))
        if self.on_poll is not None:
            self.on_poll(self)

    def release_session_moves(self):
        self.calls.append(("release", self.name))


def test_a_runner_step_starts_every_agent_before_it_journals_their_moves(store):
    calls = []
    runner = ferrus.ParallelRunner(store, lambda message: None, 2)
    runner.controllers = {"t-a": StubController("a", calls),
                          "t-b": StubController("b", calls)}
    runner._watch_task = lambda task, controller: None
    runner.finished = True                 # only the polling part of the step
    runner.step()
    assert calls == [("hold", "a"), ("hold", "b"), ("poll", "a"), ("poll", "b"),
                     ("release", "a"), ("release", "b")]


def test_a_runner_step_starts_a_few_agents_and_the_rest_in_the_next_steps(store):
    """A step that started every needed agent at once left the other tasks' hand-offs
    waiting for it: a step starts AGENT_STARTS_PER_STEP at most, in the tasks' order."""
    started, waiting = [], set()

    def start_once(controller):
        if controller.name in waiting and controller.may_start_agent():
            waiting.discard(controller.name)
            started.append((steps[0], controller.name))

    runner = ferrus.ParallelRunner(store, lambda message: None, 8)
    runner.AGENT_STARTS_PER_STEP = 2
    controllers = {"t-%d" % n: StubController("t-%d" % n, on_poll=start_once)
                   for n in range(5)}
    waiting.update(controllers)
    for controller in controllers.values():
        controller.may_start_agent = runner._may_start_agent
    runner.controllers = controllers
    runner._watch_task = lambda task, controller: None
    runner.finished = True                 # only the polling part of the step
    steps = [0]
    for steps[0] in range(1, 4):
        runner.step()
    assert started == [(1, "t-0"), (1, "t-1"), (2, "t-2"), (2, "t-3"), (3, "t-4")]
    # Outside a step (an HQ winding a task down) nothing is held back.
    assert runner._may_start_agent() and runner._may_start_agent() and \
        runner._may_start_agent()


def test_an_agent_a_slot_needs_waits_while_the_runner_says_not_now(store):
    ferrus.op_create_task(store, ferrus.HUMAN, "Do it.")
    launched = []
    controller = ferrus.HqController(store, emit=lambda message: None,
                                     launcher=sleeping_agents(launched))
    allowed = [False]
    controller.may_start_agent = lambda: allowed[0]
    try:
        controller.poll()
        assert launched == [] and controller.slots["executor"].state == SS.SPAWNING
        controller.poll()
        assert launched == []
        allowed[0] = True
        controller.poll()
        assert launched == ["executor"] and controller.slots["executor"].state == SS.RUNNING
        # Its moves were journaled once each, however long it waited in Spawning.
        assert [to for _, _, to in session_moves(store)] == ["BuildingPrompt", "Spawning",
                                                             "Running"]
    finally:
        controller.shutdown()
