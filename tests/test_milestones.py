"""Specs and milestones advance: the task's origin, ticking, selection, `ferrus run
--milestone` / `--until-done`, and the explicit reset over a Failed task."""

import io
import json
import os
import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, SCRIPTED_CHECK, run_cli, set_config
from test_hq import CONFIG, cli_env

S = ferrus.S

SPEC = """# Three steps

## Milestones

- [ ] #1.0 Write the first file
  - ID: m1
  - Depends on: none
- [ ] #1.2 Write the third file
  - ID: m3
  - Depends on: #1.1
- [ ] #1.1 Write the second file
  - ID: m2
  - Depends on: #1.0

## Acceptance Criteria

- work.txt exists
"""


def write_spec(root, text=SPEC, name="2026-01-01-three-steps.md"):
    directory = os.path.join(str(root), "docs", "specs")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "w") as handle:
        handle.write(text)
    return "docs/specs/" + name


def ticked(root, rel):
    return [m.id for m in ferrus.parse_spec(ferrus.read_text(os.path.join(str(root), rel)))
            if m.completed]


def approve_current(store):
    reviewer = ferrus.Caller("supervisor", "supervisor:test:1")
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state = S.REVIEWING
        tx.set(data, "test_submit")
    return ferrus.op_approve(store, reviewer)


def test_create_task_with_an_origin_ticks_and_advances_by_dependencies(store, project):
    rel = write_spec(project)
    ferrus.op_select_milestone(store, ferrus.HUMAN, rel, "m1")
    ferrus.op_create_task(store, ferrus.HUMAN, "first", origin=(rel, "m1"))
    data = store.read_state()
    assert (data.task_spec, data.task_milestone) == (rel, "m1")
    assert data.pending_task_spec is None
    approve_current(store)
    assert ticked(project, rel) == ["m1"]
    # m3 comes first in the document but waits for #1.1; the selection skips it.
    assert store.read_state().selected_milestone == "m2"
    ferrus.op_force_reset(store, ferrus.HUMAN)
    ferrus.op_create_task(store, ferrus.HUMAN, "second", origin=(rel, "m2"))
    approve_current(store)
    # m3 is earlier in the file than m2; it is ready now and still gets selected.
    assert store.read_state().selected_milestone == "m3"
    entry = [e for e in store.read_journal() if e["event"] == "approve"][-1]
    assert entry["detail"]["milestone_completed"] == "m2"


def test_staged_origin_reaches_the_supervisors_create_task(store, project):
    """HQ's /task stages the selected milestone; the MCP create_task takes it."""
    rel = write_spec(project)
    ferrus.op_select_milestone(store, ferrus.HUMAN, rel)
    ferrus.op_stage_task_origin(store, ferrus.HUMAN, rel, "m1")
    supervisor = ferrus.Caller("supervisor", "supervisor:test:1")
    ferrus.op_create_task(store, supervisor, "Do milestone one")
    data = store.read_state()
    assert (data.task_spec, data.task_milestone, data.pending_task_milestone) == (rel, "m1", None)
    approve_current(store)
    assert ticked(project, rel) == ["m1"] and store.read_state().selected_milestone == "m2"


class _Shell(ferrus.HqShell):
    """The plain HQ shell with the supervisor's session replaced by a direct create_task."""

    def __init__(self, store, replies, define=True):
        super().__init__(store, stdin=io.StringIO(""), stdout=io.StringIO())
        self.lines.extend(replies)
        self.define = define
        self.prompts = []

    def interactive(self, role, prompt):
        self.prompts.append(prompt)
        if self.define:
            ferrus.op_create_task(self.store, ferrus.Caller("supervisor", "supervisor:t:1"),
                                  "Defined from the milestone")


def test_hq_task_records_the_selected_milestone_as_origin(store, project):
    rel = write_spec(project)
    ferrus.op_select_milestone(store, ferrus.HUMAN, rel)
    shell = _Shell(store, [])
    shell.cmd_task("")
    data = store.read_state()
    assert (data.task_spec, data.task_milestone) == (rel, "m1")
    assert "Milestone ID: m1" in shell.prompts[0]


def test_hq_task_without_a_created_task_forgets_the_staged_origin(store, project):
    rel = write_spec(project)
    ferrus.op_select_milestone(store, ferrus.HUMAN, rel)
    _Shell(store, [], define=False).cmd_task("")
    data = store.read_state()
    assert data.state == S.IDLE and data.pending_task_milestone is None


def _fail(store):
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.failure_reason = S.FAILED, "Review cycle limit reached"
        tx.set(data, "test_fail")


def test_hq_task_over_a_failed_task_asks_first(store, project):
    _fail(store)
    shell = _Shell(store, ["n"])
    shell.cmd_task("Another try")
    assert store.read_state().state == S.FAILED
    assert "failed task is kept" in shell.stdout.getvalue()
    shell = _Shell(store, ["y"])
    shell.cmd_task("Another try")
    assert store.read_state().state == S.EXECUTING


def test_run_task_over_failed_needs_reset(project, cli):
    store = ferrus.Store(str(project))
    _fail(store)
    result = cli("run", "--task", "x", cwd=project)
    assert result.returncode == 1
    assert "the last task failed: Review cycle limit reached" in result.stderr
    assert "--reset" in result.stderr
    assert store.read_state().state == S.FAILED


def test_find_milestone_refuses_what_is_not_ready(store, project):
    rel = write_spec(project)
    with pytest.raises(ferrus.FerrusError, match="depends on #1.1"):
        ferrus.find_milestone(store, "m3")
    path, _, milestone = ferrus.find_milestone(store, "#1.0")
    assert (path, milestone.id) == (rel, "m1")
    with pytest.raises(ferrus.FerrusError, match="no milestone m9"):
        ferrus.find_milestone(store, "m9")
    write_spec(project, SPEC.replace("- [ ] #1.0", "- [x] #1.0"))
    with pytest.raises(ferrus.FerrusError, match="already complete"):
        ferrus.find_milestone(store, "m1")
    assert ferrus.find_milestone(store, "next")[2].id == "m2"


def test_next_needs_a_selected_spec_when_there_are_several(store, project):
    write_spec(project)
    write_spec(project, name="other.md")
    with pytest.raises(ferrus.FerrusError, match="no spec is selected"):
        ferrus.find_milestone(store, "next")


def test_milestone_task_text_carries_the_milestone_lines(project):
    rel = write_spec(project)
    text = ferrus.read_text(os.path.join(str(project), rel))
    milestone = ferrus.parse_spec(text)[0]
    task = ferrus.milestone_task_text(rel, text, milestone)
    assert "#1.0 Write the first file" in task and "Depends on: none" in task
    assert "#1.2" not in task and rel in task




def test_run_until_done_works_through_a_spec_of_three_milestones(scripted, tmp_path):
    rel = write_spec(scripted.root)
    result = subprocess.run(FERRUS_CMD + ["run", "--until-done", "--timeout", "240"],
                            cwd=scripted.root, capture_output=True, text=True,
                            env=cli_env(tmp_path), stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(ticked(scripted.root, rel)) == ["m1", "m2", "m3"]
    created = [e["detail"].get("milestone") for e in scripted.read_journal()
               if e["event"] == "create_task"]
    assert created == ["m1", "m2", "m3"]
    assert "every milestone is complete (3 done in this run)" in result.stdout
    assert scripted.read_state().selected_milestone is None
    # Nothing is left: another run says so and succeeds.
    again = subprocess.run(FERRUS_CMD + ["run", "--milestone", "next"],
                           cwd=scripted.root, capture_output=True, text=True,
                           env=cli_env(tmp_path), stdin=subprocess.DEVNULL, timeout=60)
    assert again.returncode == 0 and "every milestone of the spec is complete" in again.stdout


def test_run_milestone_stops_on_failure(scripted, monkeypatch):
    rel = write_spec(scripted.root)
    set_config(scripted.root, CONFIG.replace(json.dumps(SCRIPTED_CHECK), '"false"').replace(
        "[limits]", "[limits]\nmax_check_retries = 1"))
    lines = []
    code = ferrus.run_milestones(scripted, "next", until_done=True, timeout=120, out=lines.append,
                                 allow_red_base=True)      # `false` fails before the task too
    assert code == ferrus.RUN_FAILED
    assert ticked(scripted.root, rel) == []
    assert [e["detail"].get("milestone") for e in scripted.read_journal()
            if e["event"] == "create_task"] == ["m1"]


def test_a_task_given_as_text_never_takes_a_stale_staged_origin(store, project, cli):
    rel = write_spec(project)
    # An HQ /task interrupted before the supervisor created anything left this behind.
    ferrus.op_stage_task_origin(store, ferrus.HUMAN, rel, "m1")
    _Shell(store, []).cmd_task("Unrelated work")
    data = store.read_state()
    assert data.task_milestone is None and data.pending_task_milestone is None


def test_status_shows_the_milestone_a_task_implements(store, project, cli):
    rel = write_spec(project)
    ferrus.op_create_task(store, ferrus.HUMAN, "first", origin=(rel, "m1"))
    result = cli("status", cwd=project)
    assert "task from  milestone m1 of %s" % rel in result.stdout


def put_milestone_task(store, state):
    """A task made from milestone m1.0 of docs/specs/demo.md, in ``state``."""
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.task_id = state, "t-1"
        data.task_milestone, data.task_spec = "m1.0", "docs/specs/demo.md"
        if state == S.FAILED:
            data.failure_reason = "Task rejected 3 times without resolution."
        tx.set(data, "test_state")


@pytest.mark.parametrize("state, note", [
    (S.EXECUTING, "approving ticks it"),
    (S.COMPLETE, "ticked when it was approved"),
    (S.FAILED, "not ticked: the task failed"),
])
def test_status_says_what_approval_does_or_did_to_the_milestones_box(store, project, state,
                                                                      note):
    """After Complete the box is ticked already, after Failed it is not."""
    put_milestone_task(store, state)
    out = run_cli("status", cwd=project).stdout
    row = next(line for line in out.splitlines() if "task from" in line)
    assert row.strip() == "task from  milestone m1.0 of docs/specs/demo.md (%s)" % note


def test_run_milestone_next_without_a_spec_names_the_template(project):
    """`ferrus run --milestone next` without any spec says how to write one by hand: from
    .ferrus/SPEC_TEMPLATE.md, which `init` wrote."""
    result = run_cli("run", "--milestone", "next", cwd=project)
    assert result.returncode == 1
    assert "ferrus: there is no spec in docs/specs" in result.stderr
    assert "by hand from the template in .ferrus/SPEC_TEMPLATE.md" in result.stderr
    assert (project / ".ferrus" / "SPEC_TEMPLATE.md").is_file()


def test_hq_milestones_without_specs_says_how_to_write_one(store):
    out = io.StringIO()
    shell = ferrus.HqShell(store, stdin=io.StringIO(""), stdout=out)
    shell.cmd_milestones("")
    assert "no specs in docs/specs/ yet: /spec drafts one" in out.getvalue()


def test_run_milestone_over_a_task_in_flight_keeps_the_selection(store, project):
    rel = write_spec(project)
    ferrus.op_select_milestone(store, ferrus.HUMAN, rel, "m1")
    ferrus.op_create_task(store, ferrus.HUMAN, "something else")
    with pytest.raises(ferrus.FerrusError, match="already in flight"):
        ferrus.run_milestones(store, "m1", out=lambda text: None)
    write_spec(project, SPEC.replace("- [ ] #1.0", "- [x] #1.0"))
    with pytest.raises(ferrus.FerrusError, match="already in flight"):
        ferrus.run_milestones(store, "next", out=lambda text: None)
    assert store.read_state().selected_milestone == "m1"
