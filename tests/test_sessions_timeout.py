"""[sessions] timeout_secs: HQ stops an agent session that runs past it, counts the
timeout as an error, backs off and starts the next session.

The controller gets an injected monotonic clock, so the hour-long limit passes
without waiting; the agent is a real scripted process that would work for 30 s.
"""

import ferrus
from conftest import set_config
from conftest import FakeMonotonic
from test_hq import CONFIG, drive

SS = ferrus.SS


def test_a_session_past_timeout_secs_is_stopped_and_retried_after_backoff(scripted,  # noqa: F811
                                                                          monkeypatch):
    set_config(scripted.root, CONFIG + "\n[sessions]\ntimeout_secs = 600\n")
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "slow-executor")
    ferrus.op_create_task(scripted, ferrus.HUMAN, "t")
    clock = FakeMonotonic()
    messages = []
    controller = ferrus.HqController(scripted, messages.append, clock=clock)
    slot = controller.slots["executor"]
    try:
        drive(controller, lambda: slot.state == SS.RUNNING)
        first = slot.process
        assert slot.timer == clock.now + 600

        # One second short of the limit nothing happens.
        clock.now = slot.timer - 1
        controller.poll()
        assert slot.state == SS.RUNNING and slot.process is first and not first.exited()

        # At the limit the session is stopped: a timeout counts as an error, with backoff.
        clock.now = slot.timer
        controller.poll()
        assert any(m.kind == "warning" and m.text == "the executor ran past [sessions] "
                   "timeout_secs; stopping it" for m in messages), messages
        assert slot.process is None and first.exited()
        assert slot.state == SS.COOLING_DOWN
        assert slot.session.consecutive_errors == 1 and slot.session.total_errors == 1
        assert slot.timer == clock.now + 2.0
        assert any(m.text == "retrying the executor in 2s (error 1 in a row)"
                   for m in messages), [m.text for m in messages]
        moves = [(e["detail"]["from"], e["detail"]["to"]) for e in scripted.read_journal()
                 if e["event"] == "session" and e["detail"]["slot"] == "executor"]
        assert moves[-1] == ("Running", "CoolingDown")

        # The backoff elapses on the injected clock and the next session starts.
        controller.poll()
        assert slot.state == SS.COOLING_DOWN
        clock.now = slot.timer
        drive(controller, lambda: slot.state == SS.RUNNING)
        assert slot.process is not first and slot.timer == clock.now + 600
        assert slot.session.consecutive_errors == 1, "running again is not yet a success"
        assert scripted.read_state().state == ferrus.S.EXECUTING
    finally:
        controller.shutdown()
