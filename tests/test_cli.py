"""The CLI as a user meets it: init and the next steps it names, status, log, reset,
doctor, launchers, the task text `run` takes, error messages and their suggestions."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import ferrus
from conftest import FERRUS_CMD, REPO, run_cli

S = ferrus.S


def test_version(tmp_path):
    result = run_cli("--version", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip() == "ferrus %s" % ferrus.__version__


def test_init_creates_everything_and_says_so(tmp_path):
    result = run_cli("init", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("ferrus.toml", ".ferrus/STATE.json", ".ferrus/STATE.lock", ".ferrus/agents.json",
                 ".ferrus/events.jsonl", ".ferrus/TASK.md", ".ferrus/LAST_SPEC_PATH",
                 ".ferrus/CONSULT_TEMPLATE.md", ".ferrus/SPEC_TEMPLATE.md",
                 ".agents/skills/ferrus/SKILL.md", ".agents/skills/ferrus-executor/ROLE.md",
                 ".agents/skills/ferrus-supervisor/SKILL.md"):
        assert (tmp_path / name).exists(), name
        assert "Created %s" % name in result.stdout
    assert (tmp_path / "docs" / "specs").is_dir()
    assert (tmp_path / ".gitignore").read_text() == ".ferrus/\n"
    assert json.loads((tmp_path / ".ferrus/agents.json").read_text()) == {"agents": []}
    config = ferrus.load_config(str(tmp_path))
    assert config.limits.max_check_retries == 20 and config.lease.ttl_secs == 90
    assert config.supervisor.agent == "claude-code" and config.executor.agent == "codex"
    # The spec template parses into three milestones, the first one ready.
    milestones = ferrus.parse_spec((tmp_path / ".ferrus/SPEC_TEMPLATE.md").read_text())
    assert [m.id for m in milestones] == ["m1.0", "m1.1", "m1.2"]


def test_init_twice_changes_nothing_and_keeps_edits(tmp_path):
    run_cli("init", cwd=tmp_path)
    toml = tmp_path / "ferrus.toml"
    toml.write_text(toml.read_text().replace("commands = []", 'commands = ["true"]  # mine'))
    skill = tmp_path / ".agents/skills/ferrus/SKILL.md"
    skill.write_text("my own notes\n")
    (tmp_path / ".gitignore").write_text("node_modules\n.ferrus/\n")
    snapshot = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = run_cli("init", cwd=tmp_path)
    assert result.returncode == 0
    assert "already exists" in result.stdout
    assert "Created" not in result.stdout
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == snapshot


def test_init_recreates_what_is_missing(tmp_path):
    run_cli("init", cwd=tmp_path)
    os.unlink(str(tmp_path / ".ferrus/QUESTION.md"))
    shutil.rmtree(str(tmp_path / ".agents/skills/ferrus-executor"))
    result = run_cli("init", cwd=tmp_path)
    assert "Created .ferrus/QUESTION.md" in result.stdout
    assert "Created .agents/skills/ferrus-executor/SKILL.md" in result.stdout
    assert result.stdout.count("Created") == 3


def test_init_uses_the_configured_spec_directory_and_escapes_agents_path(tmp_path):
    (tmp_path / "ferrus.toml").write_text('[checks]\n[limits]\n[spec]\ndirectory = "design/specs"\n')
    run_cli("init", cwd=tmp_path)
    assert (tmp_path / "design/specs").is_dir()
    assert not (tmp_path / "docs").exists(), "upstream hard-coded docs/specs (bug 14)"
    other = tmp_path / "other"
    other.mkdir()
    weird = 'agents "quoted" \\ dir'
    result = run_cli("init", "--agents-path", weird, cwd=other)
    assert result.returncode == 0, result.stderr
    assert ferrus.load_config(str(other)).agents.path == weird, "escaped, not corrupted (bug 14)"
    assert (other / weird / "skills/ferrus/SKILL.md").exists()


def test_gitignore_line_is_appended_with_a_newline(tmp_path):
    (tmp_path / ".gitignore").write_text("build")
    run_cli("init", cwd=tmp_path)
    assert (tmp_path / ".gitignore").read_text() == "build\n.ferrus/\n"


def test_init_in_a_fresh_folder_names_every_next_step(tmp_path):
    """`ferrus init` ends with the next steps still to do: in a fresh folder all three."""
    out = run_cli("init", cwd=tmp_path).stdout.strip().splitlines()[-1]
    assert out.startswith("ferrus is initialized. Next: put your lint and test commands in "
                          "[checks] of ferrus.toml, then `")
    assert " register` (the agents [hq.*] names" in out and " run --task " in out


def test_init_in_a_set_up_project_names_only_run(scripted):
    """In a project whose checks are set and agents registered, only `run` is left."""
    out = run_cli("init", cwd=scripted.root).stdout.strip().splitlines()[-1]
    assert out.startswith("ferrus is initialized. Next: `") and out.endswith(
        ' run --task "..."`.')
    assert "[checks]" not in out and "register" not in out


def test_status_text_and_json(project):
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "write the thing")
    ferrus.op_wait_for_task(store, ferrus.Caller("executor", "executor:codex:1"))
    result = run_cli("status", cwd=project)
    assert result.returncode == 0
    assert "Executing" in result.stdout
    assert "executor:codex:1, expires in" in result.stdout
    assert "0/20" in result.stdout and "0/3" in result.stdout
    info = json.loads(run_cli("status", "--json", cwd=project).stdout)
    assert info["state"] == "Executing" and info["lease_holder"] == "executor:codex:1"
    assert info["task_id"].startswith("t-") and info["rev"] == 2
    assert info["seconds_in_state"] >= 0 and info["limits"]["max_review_cycles"] == 3


def test_status_outside_a_project_explains(tmp_path):
    result = run_cli("status", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("ferrus: no .ferrus/ directory")
    assert "hint: run `ferrus init`" in result.stderr
    assert "Traceback" not in result.stderr


def test_status_shows_the_pending_question_and_where_to_answer_it(store, project):
    executor = ferrus.Caller("executor", "executor:test:1")
    ferrus.op_create_task(store, ferrus.HUMAN, "Make work.txt")
    ferrus.op_wait_for_task(store, executor)
    ferrus.op_ask_human(store, executor, "Which colour should the button be?\n\nBlue or red.")
    out = run_cli("status", cwd=project).stdout
    rows = [line.strip() for line in out.splitlines()]
    assert "question  Which colour should the button be?" in rows
    assert "Blue or red." in rows
    assert "answer  in HQ (`ferrus`), or `ferrus run --resume` in a terminal" in rows


def test_a_failure_summary_joins_a_line_ending_in_a_colon_with_the_next():
    assert ferrus.failure_summary("Check failed 2 consecutive times. Last failure:\n"
                                  "Commands failed: a, b\n") == \
        "Check failed 2 consecutive times. Last failure: Commands failed: a, b"
    assert ferrus.failure_summary("Task rejected 3 times without resolution.") == \
        "Task rejected 3 times without resolution."
    assert ferrus.failure_summary(None) == ferrus.failure_summary("  \n") == "no reason recorded"


def test_status_and_a_refused_run_name_the_commands_a_task_failed_on(store, project):
    """A task that failed on its check retries says why in one line — `ferrus status`, a
    refused `ferrus run --task` — with the failing commands, not a line ending "Last
    failure:"."""
    reason = ferrus.t_check_failed(ferrus.StateData(state=S.EXECUTING), ferrus.utc_now(),
                                   "Commands failed: python3 -m pytest -q", 1).failure_reason
    with store.transaction("test") as tx:
        data = tx.state.copy()
        data.state, data.failure_reason = S.FAILED, reason
        tx.set(data, "test_fail")
    assert reason.splitlines()[0].endswith("Last failure:")      # what is recorded
    status = run_cli("status", cwd=project)
    assert "Last failure: Commands failed: python3 -m pytest -q" in status.stdout
    refused = run_cli("run", "--task", "again", cwd=project)
    assert refused.returncode == 1
    assert "the last task failed: Check failed 1 consecutive times. Last failure: " \
        "Commands failed: python3 -m pytest -q" in refused.stderr
    assert store.read_state().state == S.FAILED


def test_log_text_json_and_tail(project):
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    ferrus.op_force_reset(store, ferrus.HUMAN)
    ferrus.op_create_task(store, ferrus.HUMAN, "t2")
    text = run_cli("log", cwd=project).stdout.splitlines()
    assert len(text) == 3 and "create_task" in text[0] and "Idle → Executing" in text[0]
    lines = run_cli("log", "--json", "-n", "2", cwd=project).stdout.splitlines()
    assert [json.loads(l)["seq"] for l in lines] == [2, 3]
    assert json.loads(lines[0])["event"] == "force_reset"


def test_log_follow_prints_new_entries(project):
    proc = subprocess.Popen(FERRUS_CMD + ["log", "--follow", "--json"],
                            cwd=str(project), stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, NO_COLOR="1"))
    try:
        ferrus.op_create_task(ferrus.Store(str(project)), ferrus.HUMAN, "followed")
        line = proc.stdout.readline()
        assert json.loads(line)["event"] == "create_task"
    finally:
        proc.kill()
        proc.wait()


def test_reset_asks_first_and_yes_skips_the_question(project):
    store = ferrus.Store(str(project))
    ferrus.op_select_milestone  # the selection must survive a reset
    with store.transaction("t") as tx:
        data = tx.state.copy()
        data.selected_spec, data.selected_milestone = "docs/specs/x.md", "m1"
        tx.set(data, "select")
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    result = run_cli("reset", cwd=project, input="")
    assert result.returncode == 2 and "--yes" in result.stderr
    assert store.read_state().state == ferrus.S.EXECUTING
    result = run_cli("reset", "--yes", cwd=project)
    assert result.returncode == 0 and "Idle" in result.stdout
    data = store.read_state()
    assert data.state == ferrus.S.IDLE and data.selected_milestone == "m1"
    assert store.read_file("TASK.md") == ""


def test_doctor_on_a_healthy_project(project):
    result = run_cli("doctor", cwd=project)
    assert result.returncode == 0 and "consistent" in result.stdout


def test_doctor_explains_and_repairs_a_corrupt_state(project):
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    (project / ".ferrus/STATE.json").write_text('{"state": "Exec')
    result = run_cli("status", cwd=project)
    assert result.returncode == 1 and "not valid JSON" in result.stderr
    assert "ferrus doctor" in result.stderr
    result = run_cli("doctor", cwd=project)
    assert result.returncode == 1 and "repair:" in result.stdout and "--fix" in result.stdout
    result = run_cli("doctor", "--fix", cwd=project)
    assert result.returncode == 0, result.stdout
    assert any(n.startswith("STATE.json.corrupt-") for n in os.listdir(str(project / ".ferrus")))
    data = store.read_state()
    assert data.state == ferrus.S.IDLE and data.rev == 1, "rev continues the journal"
    ferrus.op_create_task(store, ferrus.HUMAN, "again")
    assert [e["seq"] for e in store.read_journal()] == [1, 2]


def test_doctor_reconciles_state_ahead_of_the_journal(project):
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "t")
    with open(store.journal_path(), "w"):
        pass                                  # the journal lost its line
    result = run_cli("doctor", cwd=project)
    assert "without a journal line" in result.stdout
    assert run_cli("doctor", "--fix", cwd=project).returncode == 0
    assert [e["seq"] for e in store.read_journal()] == [1, 2]
    assert store.read_state().rev == 2


def test_doctor_recreates_missing_files_and_removes_stray_temp_files(project):
    os.unlink(str(project / ".ferrus/STATE.lock"))
    stray = project / ".ferrus" / (".STATE.json.abc" + ferrus.TEMP_SUFFIX)
    stray.write_text("{")
    os.utime(str(stray), (1, 1))
    result = run_cli("doctor", cwd=project)
    assert "STATE.lock is missing" in result.stdout and "stray temporary file" in result.stdout
    assert run_cli("doctor", "--fix", cwd=project).returncode == 0
    assert (project / ".ferrus/STATE.lock").exists() and not stray.exists()


@pytest.mark.parametrize("text,fragments", [
    ("[limits]\nmax_check_retries = \"many\"\n",
     ["ferrus.toml: [limits.max_check_retries] must be an integer", '"many" (a string)']),
    ("[lease]\nttl_secs = 99999999999999999\n", ["[lease.ttl_secs] must be between"]),
    ("[checks]\ncommands = \"pytest\"\n", ["[checks.commands] must be an array of strings"]),
    ("[checks\n", ["ferrus.toml is not valid TOML", "line 1"]),
    ("[agents.claude]\nmcp_isolation = \"ferrus_only\"\n", ["mcp_isolation"]),
])
def test_invalid_config_names_file_key_and_expectation(project, text, fragments):
    (project / "ferrus.toml").write_text(text)
    ferrus.op_create_task(ferrus.Store(str(project)), ferrus.HUMAN, "t")
    result = run_cli("check", cwd=project)
    assert result.returncode == 1
    for fragment in fragments:
        assert fragment in result.stderr
    assert "hint:" in result.stderr and "Traceback" not in result.stderr


def test_a_bad_hq_agent_does_not_break_the_check_gate(project):
    """Upstream bug 15: a typo in [hq] made check, submit and the waits fail."""
    text = (project / "ferrus.toml").read_text().replace('agent = "codex"', 'agent = "codx"')
    (project / "ferrus.toml").write_text(text)
    ferrus.op_create_task(ferrus.Store(str(project)), ferrus.HUMAN, "t")
    assert run_cli("check", cwd=project).returncode == 0
    findings = ferrus.doctor_findings(str(project))
    assert any("codx" in f.problem for f in findings)


def test_a_mistyped_command_or_option_gets_a_suggestion(project):
    result = run_cli("stauts", cwd=project)
    assert result.returncode == 2 and "hint: did you mean status?" in result.stderr
    result = run_cli("status", "--jsno", cwd=project)
    assert result.returncode == 2 and "hint: did you mean --json?" in result.stderr
    result = run_cli("run", "--untill-done", cwd=project)
    assert "hint: did you mean --until-done?" in result.stderr
    result = run_cli("serve", "--role", "executr", cwd=project)
    assert "hint: did you mean executor?" in result.stderr
    result = run_cli("pipeline", "stauts", cwd=project)
    assert "hint: did you mean status?" in result.stderr
    result = run_cli("xyzzy", cwd=project)
    assert result.returncode == 2 and "did you mean" not in result.stderr


def test_an_empty_task_is_refused_before_the_complete_task_is_cleared(project, capsys):
    store = ferrus.Store(str(project))
    ferrus.op_create_task(store, ferrus.HUMAN, "first")
    with store.transaction("test") as tx:           # pretend it was approved
        done = tx.state.copy()
        done.state = S.COMPLETE
        tx.set(done, "approve")
    before = store.read_state()
    assert ferrus.main(["-C", str(project), "run", "--task", "   "]) == 2
    err = capsys.readouterr().err
    assert "the task description is empty" in err and "hint:" in err
    after = store.read_state()
    assert (after.state, after.rev) == (S.COMPLETE, before.rev), "nothing was reset"


def test_run_task_file_dash_reads_the_task_from_stdin(scripted):
    """`ferrus run --task-file -` reads the task from stdin, as `ferrus reject --file -`
    does."""
    result = run_cli("run", "--quiet", "--task-file", "-", cwd=scripted.root,
                     input="Make work.txt\nwith a second line\n", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Task complete." in result.stdout
    assert scripted.read_file("TASK.md").strip() == "Make work.txt\nwith a second line"


def test_run_task_file_dash_with_an_empty_stdin_is_an_empty_task(project):
    result = run_cli("run", "--task-file", "-", cwd=project, input="  \n")
    assert result.returncode == 2 and "the task description is empty" in result.stderr


@pytest.mark.skipif(os.name == "nt", reason="POSIX argv bytes")
def test_text_that_is_not_utf8_is_refused_without_a_traceback(project):
    """A byte that is not UTF-8 in `ferrus run --task` (or a line typed into HQ) is
    refused with what is wrong and nothing changes, instead of reaching the commit as a
    lone surrogate and crashing it with a traceback.  A Complete task is kept too."""
    store = ferrus.Store(str(project))
    env = dict(os.environ, FERRUS_LOG="warning")
    bad = b"fix \xff it"
    run = subprocess.run([os.fsencode(part) for part in FERRUS_CMD] + [b"-C",
                          os.fsencode(str(project)), b"run", b"--task", bad],
                         stdin=subprocess.DEVNULL, capture_output=True, env=env, timeout=120)
    err = run.stderr.decode("utf-8", "replace")
    assert run.returncode == 1 and "Traceback" not in err, err
    assert "the task description is not valid UTF-8: it holds the byte 0xff at character 5" \
        in err and "hint:" in err, err
    assert store.read_state().state == ferrus.S.IDLE
    hq = subprocess.run(FERRUS_CMD + ["-C", str(project), "hq", "--no-tui"],
                        input=b"/task " + bad + b"\n/tell executor " + bad + b"\n/quit\n",
                        capture_output=True, env=env,
                        timeout=120)
    out = hq.stdout.decode("utf-8", "replace") + hq.stderr.decode("utf-8", "replace")
    assert "Traceback" not in out and out.count("not valid UTF-8") == 2, out
    assert store.read_state().state == ferrus.S.IDLE
    before = store.read_state().rev
    with pytest.raises(ferrus.FerrusError):
        ferrus.op_create_task(store, ferrus.HUMAN, "fix \udcff it")
    assert store.read_state().rev == before


def test_config_is_reread_when_it_changes(project):
    store = ferrus.Store(str(project))
    assert store.config().limits.max_review_cycles == 3
    path = project / "ferrus.toml"
    path.write_text(path.read_text().replace("max_review_cycles = 3", "max_review_cycles = 7"))
    stamp = os.stat(str(path)).st_mtime_ns + 10 ** 9
    os.utime(str(path), ns=(stamp, stamp))
    assert store.config().limits.max_review_cycles == 7


def test_launcher_works_through_a_symlink_from_anywhere(project, tmp_path):
    if os.name == "nt":
        pytest.skip("symlinks need privileges on Windows")
    link = tmp_path / "bin" / "ferrus"
    link.parent.mkdir()
    os.symlink(os.path.join(REPO, "ferrus"), str(link))
    result = subprocess.run([str(link), "status", "--json"], cwd=str(project),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["state"] == "Idle"


def test_python_dash_m_ferrus(project):
    result = subprocess.run([sys.executable, "-m", "ferrus", "--version"], cwd=str(project),
                            capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO))
    assert result.returncode == 0 and result.stdout.startswith("ferrus ")


def test_minus_c_runs_in_another_directory(project, tmp_path):
    result = run_cli("-C", str(project), "status", "--json", cwd=tmp_path)
    assert json.loads(result.stdout)["state"] == "Idle"
