"""ferrus.toml problems are reported where users look: doctor lists every table's
errors once, status shows a broken file instead of defaults, an empty [checks] is
flagged, and doctor --fix says what it really repaired."""

import json

import ferrus
from conftest import set_config

BROKEN = """
[checks]
commands = ["true"]
timeout_secs = -1

[sessions]
max_consecutive_errors = "five"
colour = "blue"

[pipelines]
max_parallel = 0

[capacity]
orange_percent = "high"

[limits]
max_check_retries = 3
"""


def test_doctor_reports_every_table_once(project, cli):
    set_config(project, BROKEN)
    result = cli("doctor", cwd=project)
    assert result.returncode == 1
    out = result.stdout
    assert "[checks.timeout_secs] must be between 1 and 604800, got -1" in out
    assert "[sessions.max_consecutive_errors] must be an integer, got \"five\"" in out
    assert "[pipelines.max_parallel] must be between 1 and 1000, got 0" in out
    assert "[capacity.orange_percent] must be an integer" in out
    assert out.count("unknown key sessions.colour") == 1
    assert "unknown key" not in result.stderr
    for needle in ("timeout_secs", "max_consecutive_errors", "max_parallel", "orange_percent"):
        assert out.count(needle) == 1, needle


def test_a_bad_sessions_value_is_a_config_error_everywhere(project):
    set_config(project, '[checks]\ncommands = ["true"]\n[sessions]\nmax_total_errors = "x"\n')
    store = ferrus.Store(str(project))
    try:
        store.config()
    except ferrus.FerrusError as err:
        assert "sessions.max_total_errors" in err.message
    else:
        raise AssertionError("the bad [sessions] value was accepted")


def test_status_shows_a_broken_config_instead_of_defaults(project, cli):
    set_config(project, BROKEN)
    result = cli("status", cwd=project)
    assert result.returncode == 0      # status reports; the error is part of the report
    assert "error: ferrus.toml: [checks.timeout_secs]" in result.stdout
    assert "limit unknown" in result.stdout and "0/20" not in result.stdout
    assert "lists all 4 problems" in result.stdout
    as_json = cli("status", "--json", cwd=project)
    info = json.loads(as_json.stdout)
    assert "checks.timeout_secs" in info["config_error"] and "limits" not in info


def test_empty_checks_are_flagged_by_status_doctor_and_run(project, cli):
    set_config(project, "[checks]\ncommands = []\n")
    status = cli("status", cwd=project)
    assert status.returncode == 0
    assert "passes every submission" in status.stdout
    assert "passes every" in json.loads(cli("status", "--json", cwd=project).stdout)[
        "config_warnings"][0]
    doctor = cli("doctor", cwd=project)
    assert doctor.returncode == 0 and "passes every submission" in doctor.stdout
    assert "consistent, with 1 warning(s)" in doctor.stdout
    lines = []
    store = ferrus.Store(str(project))

    def refuse(slot):
        raise ferrus.FerrusError("no agent in this test")
    ferrus.run_loop(store, "t", timeout=0, out=lines.append, launcher=refuse)
    assert any("passes every submission" in line for line in lines)


def test_doctor_fix_says_when_it_repaired_nothing(project, cli):
    set_config(project, "[checks]\ncommands = []\n")
    result = cli("doctor", "--fix", cwd=project)
    assert "all errors repaired" not in result.stdout
    assert "there was no error to repair (1 warning(s) above)" in result.stdout
    (project / ".ferrus" / "STATE.json").write_text("{broken")
    result = cli("doctor", "--fix", cwd=project)
    assert result.returncode == 0
    assert "repaired 1 problem(s); no errors remain" in result.stdout


def test_heartbeat_interval_reaches_the_executor(project):
    set_config(project, '[checks]\ncommands = ["true"]\n[lease]\nheartbeat_interval_secs = 17\n'
                        '[limits]\nwait_timeout_secs = 1\n')
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    controller = ferrus.HqController(store, emit=lambda message: None)
    prompt = controller.needed_slots(store.read_state())["executor"]
    assert "/heartbeat about every 17 seconds" in prompt
    claimed = ferrus.op_wait_for_task(store, ferrus.Caller("executor", "executor:t:1"))
    assert claimed.data["heartbeat_interval_secs"] == 17
