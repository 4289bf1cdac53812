"""A curses dialog whose question is wider than the terminal keeps its end — the question
itself and `[y/N]` — on screen: a long failure reason used to push them off the row."""

import ferrus
from test_hq_curses import pane_for, Pane  # noqa: F401  (fixtures)

S = ferrus.S


def test_fit_banner_cuts_the_middle_and_keeps_both_ends():
    text = "The last task failed (%s). Reset it and start a new task?  [y/N]" % ("x" * 200)
    fitted = ferrus.fit_banner(text, 100)
    assert len(fitted) == 100 and "…" in fitted
    assert fitted.startswith("The last task failed (")
    assert fitted.endswith("Reset it and start a new task?  [y/N]")
    assert ferrus.fit_banner("short", 100) == "short"
    assert ferrus.fit_banner("abc", 1) == "c" and ferrus.fit_banner("abc", 0) == ""


def test_the_reset_question_over_a_failed_task_shows_its_keys(scripted, pane_for):  # noqa: F811
    with scripted.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.task_id = S.FAILED, "t-1"
        data.failure_reason = "Check failed 20 consecutive times. Last failure:\n" \
            "Commands failed: " + ", ".join("python3 -m pytest -q tests/test_%d.py" % i
                                            for i in range(6))
        tx.set(data, "test_fail")
    pane = pane_for()
    pane.wait_for("ferrus HQ 0.1")
    pane.type("/task Again", "Enter")
    lines = pane.wait(lambda lines: len(lines) > 1 and "[y/N]" in lines[1],
                      what="the question with its keys")
    assert "Reset it and start a new task?  [y/N]" in lines[1]
    pane.keys("n")
    pane.wait_for("Nothing changed; the failed task is kept")
    assert scripted.read_state().state == S.FAILED
