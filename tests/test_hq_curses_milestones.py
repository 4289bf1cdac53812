"""Milestone selection in the curses HQ: /milestones opens a list dialog over a real
terminal (tmux, as in test_hq_curses.py); arrows move, Enter selects, Esc cancels."""

import shutil

import pytest

from test_hq_curses import pane_for  # noqa: F401  (the fixture: `ferrus hq` in tmux)
from test_milestones import write_spec

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

TITLE = "Select a spec or milestone  (↑↓ move, Enter selects, Esc cancels)"


def options_of(lines):
    return [line.strip() for line in lines if "(the first ready milestone)" in line or
            line.strip().startswith("[ ] #1.")]


def selection(store):
    data = store.read_state()
    return data.selected_spec, data.selected_milestone


def test_curses_milestone_dialog_selects_and_cancels(scripted, pane_for):  # noqa: F811
    rel = write_spec(scripted.root)
    pane = pane_for(SCRIPTED_BEHAVIOR="")
    pane.wait(lambda lines: lines[0].startswith("ferrus HQ │ Idle"), what="status line")

    # The dialog lists the spec (its first ready milestone) and every milestone in order.
    pane.type("/milestones", "Enter")
    screen = pane.wait(lambda lines: any(TITLE in line for line in lines) and
                       len(options_of(lines)) == 4, what="the dialog and its four lines")
    assert options_of(screen) == ["%s  (the first ready milestone)" % rel,
                       "[ ] #1.0 Write the first file (m1)",
                       "[ ] #1.2 Write the third file (m3)",
                       "[ ] #1.1 Write the second file (m2)"]
    # Down once, Enter: the first milestone.
    pane.keys("Down")
    pane.keys("Enter")
    pane.wait_for("Selected %s, milestone m1." % rel)
    assert selection(scripted) == (rel, "m1")

    # Esc cancels wherever the cursor is: nothing changes.
    pane.type("/milestones", "Enter")
    pane.wait_for(TITLE)
    pane.keys("Down", "Down", "Up")
    pane.keys("Escape")
    pane.wait(lambda lines: not any(TITLE in line for line in lines), what="the dialog to close")
    assert selection(scripted) == (rel, "m1")

    # The cursor stops at the last line (m2); the status line shows the choice.
    pane.type("/milestones", "Enter")
    pane.wait_for(TITLE)
    pane.keys("Down", "Down", "Down", "Down", "Down")
    pane.keys("Enter")
    pane.wait(lambda lines: "Selected %s, milestone m2." % rel in "\n".join(lines) and
              lines[0].endswith("spec three-steps · m2"), what="m2 selected")
    assert selection(scripted) == (rel, "m2")

    # The cursor stops at the first line too: the spec, i.e. its first ready milestone.
    pane.type("/milestones", "Enter")
    pane.wait_for(TITLE)
    pane.keys("Down", "Up", "Up")
    pane.keys("Enter")
    pane.wait(lambda lines: sum("Selected %s, milestone m1." % rel in line
                                for line in lines) == 2, what="the spec's first milestone")
    assert selection(scripted) == (rel, "m1")

    pane.type("/quit", "Enter")
    assert pane.exited() == 0
