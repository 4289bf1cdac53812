"""The spec and milestone path end to end, through the entry points a user meets.

The supervisor saves a spec with the MCP tool `create_spec` (as in SPECIFICATION
mode), the human looks at it and picks a milestone in HQ, `ferrus run --milestone`
drives the scripted agents to Complete, and approving the task ticks the milestone
in the spec file and selects the next ready one."""

import re
import subprocess

import ferrus
from conftest import FERRUS_CMD
from mcp_client import McpProcess, tool_text
from test_hq import cli_env
from test_hq_plain_commands import PipedHq
from test_milestones import SPEC, ticked

S = ferrus.S


def ferrus_cli(root, tmp_path, *args, timeout=120):
    return subprocess.run(FERRUS_CMD + list(args), cwd=root,
                          capture_output=True, text=True, env=cli_env(tmp_path),
                          stdin=subprocess.DEVNULL, timeout=timeout)


def test_spec_created_selected_and_run_to_complete_ticks_its_milestone(scripted,  # noqa: F811
                                                                        tmp_path):
    root = scripted.root
    # 1. The supervisor saves the spec; it is selected with its first ready milestone.
    with McpProcess(root, "--role", "supervisor", "--agent-name", "scripted") as server:
        server.initialize()
        result = server.call_tool("create_spec", {"markdown": SPEC})
    assert not result.get("isError"), result
    match = re.fullmatch(r"Spec created at (docs/specs/\S+-three-steps\.md)\. "
                         r"Selected milestone: m1\.", tool_text(result))
    assert match, tool_text(result)
    rel = match.group(1)
    assert ticked(root, rel) == []

    # 2. The human lists it in HQ and picks the second milestone, then the first again.
    shell = PipedHq(root, cli_env(tmp_path))
    try:
        shell.wait_for("/help lists the commands")
        out = shell.command("/milestones", "(m2)")
        assert out[-4:] == [rel, "   [ ] #1.0 Write the first file (m1)",
                            "   [ ] #1.2 Write the third file (m3)",
                            "   [ ] #1.1 Write the second file (m2)"]
        shell.command("/milestones %s m2" % rel, "Selected %s, milestone m2." % rel)
        shell.command("/milestones %s" % rel, "Selected %s, milestone m1." % rel)
        shell.quit()
    finally:
        shell.close()
    assert (scripted.read_state().selected_spec, scripted.read_state().selected_milestone) == (
        rel, "m1")

    # 3. One milestone, run to Complete by the scripted supervisor and executor.
    done = ferrus_cli(root, tmp_path, "run", "--milestone", "next", "--timeout", "240",
                      timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Reviewing → Complete" in done.stdout
    data = scripted.read_state()
    assert data.state == S.COMPLETE
    assert (data.task_spec, data.task_milestone) == (rel, "m1")

    # 4. The milestone is checked off in the file; the selection moved on to m2.
    assert ticked(root, rel) == ["m1"]
    assert "- [x] #1.0 Write the first file" in (tmp_path / "proj" / rel).read_text()
    assert (data.selected_spec, data.selected_milestone) == (rel, "m2")
    approve = [e for e in scripted.read_journal() if e["event"] == "approve"]
    assert len(approve) == 1 and approve[0]["detail"]["milestone_completed"] == "m1"
    status = ferrus_cli(root, tmp_path, "status")
    assert "task from  milestone m1 of %s" % rel in status.stdout
