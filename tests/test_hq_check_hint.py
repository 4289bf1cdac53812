"""HQ's /check outside a task points at /check --force, as `ferrus check` points at
`ferrus check --force`."""

import io

import ferrus


def test_check_in_idle_hints_at_force(store):
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    try:
        shell.handle("/check")
    finally:
        shell.controller.shutdown()
    text = out.getvalue()
    assert "error: Cannot run checks from state Idle." in text
    assert "hint: /check --force runs the checks in any state and changes nothing" in text
