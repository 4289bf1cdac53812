"""Upstream interop: agents.json carries upstream's required fields, and a STATE.json
that upstream wrote (no rev) is continued by the journal without a doctor error."""

import json

import ferrus
from conftest import set_config

S = ferrus.S


def test_state_written_by_upstream_continues_the_journal(project, cli):
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "first")
    ferrus.op_force_reset(store, ferrus.HUMAN)
    assert store.last_journal_seq() == 2
    # Upstream ferrus then creates a task: it writes STATE.json its way, without rev.
    upstream = {"schema_version": 1, "state": "Executing", "check_retries": 0,
                "review_cycles": 0, "failure_reason": None,
                "updated_at": "2026-05-13T10:00:00.123Z", "owner_pid": 4242}
    (project / ".ferrus" / "STATE.json").write_text(json.dumps(upstream, indent=2))
    doctor = cli("doctor", cwd=project)
    assert "error:" not in doctor.stdout, doctor.stdout
    assert doctor.returncode == 0
    assert store.read_state().rev == 2
    ferrus.op_force_reset(store, ferrus.HUMAN)
    assert [e["seq"] for e in store.read_journal()] == [1, 2, 3]
    assert store.read_state().rev == 3
    assert cli("doctor", cwd=project).returncode == 0


def test_agents_json_entries_carry_agent_type(project):
    set_config(project, '[checks]\ncommands = ["true"]\n[hq.executor]\nagent = "codex"\n')
    store = ferrus.Store(str(project))
    controller = ferrus.HqController(store, emit=lambda message: None)
    controller._record_agent(controller.slots["executor"], "suspended")
    controller._record_agent(controller.slots["reviewer"], "suspended")
    entries = {e["name"]: e for e in json.loads(
        (project / ".ferrus" / "agents.json").read_text())["agents"]}
    assert entries["executor"]["agent_type"] == "codex"
    assert entries["executor"]["role"] == "executor"
    # No [hq.supervisor]: the field is still there, as upstream requires it.
    assert entries["reviewer"]["agent_type"] == "unknown"
    for entry in entries.values():
        assert {"role", "agent_type", "name", "pid", "status"} <= set(entry)
