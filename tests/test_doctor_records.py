"""`ferrus doctor` sees a damaged agents.json or session record (readers skip them
silently, so without doctor nobody would know) and --fix sets them aside, keeping them."""

import json
import os

from conftest import run_cli


def test_doctor_reports_and_sets_aside_damaged_agent_and_session_records(project):
    root = str(project)
    ferrus_dir = os.path.join(root, ".ferrus")
    with open(os.path.join(ferrus_dir, "agents.json"), "w") as handle:
        handle.write("nope")
    sessions = os.path.join(ferrus_dir, "sessions")
    os.makedirs(sessions, exist_ok=True)
    with open(os.path.join(sessions, "s-good.json"), "w") as handle:
        json.dump({"id": "s-good"}, handle)
    with open(os.path.join(sessions, "s-bad.json"), "w") as handle:
        handle.write("{half a rec")

    found = run_cli("doctor", cwd=root)
    assert found.returncode == 0, found.stderr          # warnings: nothing is broken
    assert ".ferrus/agents.json is damaged" in found.stdout
    assert ".ferrus/sessions/s-bad.json is damaged" in found.stdout
    assert "s-good.json" not in found.stdout

    fixed = run_cli("doctor", "--fix", cwd=root)
    assert fixed.returncode == 0, fixed.stderr
    with open(os.path.join(ferrus_dir, "agents.json")) as handle:
        assert json.load(handle) == {"agents": []}
    assert any(name.startswith("agents.json.corrupt-") for name in os.listdir(ferrus_dir))
    left = sorted(os.listdir(sessions))
    assert "s-good.json" in left and any(n.startswith("s-bad.json.corrupt-") for n in left)
    again = run_cli("doctor", cwd=root)
    assert "damaged" not in again.stdout
