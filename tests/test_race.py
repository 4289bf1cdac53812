"""Races (`ferrus task add TEXT --race N|AGENTS`): one task tried by several attempts side
by side, each a parallel task of its own; the first attempt that passes its review and
the merge gate is merged, the others are cancelled with their work saved — with real
git and the scripted agent registered under several names."""

import json
import os
import shutil
import sys

import pytest

import ferrus
from conftest import SCRIPTED_AGENT, git, run_cli, run_tasks as run, scripted_setup as setup, statuses

pytestmark = [pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
              pytest.mark.skipif(os.name == "nt",
                                 reason="POSIX shell scripts as the racers' commands")]


@pytest.fixture
def repo(git_project):
    """The git repository with ferrus set up (conftest's git_project)."""
    return git_project


def racer(name):
    """[agents.custom.NAME]: the scripted agent, told its name through RACE_AGENT."""
    argv = ["env", "RACE_AGENT=%s" % name, sys.executable, SCRIPTED_AGENT, "{role}",
            "{mcp_config}"]
    return "[agents.custom.%s]\ninteractive = %s\nheadless = %s\nprompt = \"stdin\"\n\n" % (
        name, json.dumps(argv), json.dumps(argv))


# The fast attempt finishes first, but its answer passes only in its own worktree (a
# gitignored file it made): the merge gate, in a clean checkout, fails it.  The steady
# one finishes second with the right answer; the slow one is still at work.
RACE_TASK = """Answer the question.

SHELL case "$RACE_AGENT" in fast) echo wrong > answer.txt; touch .local-pass;; steady) sleep 4; echo right > answer.txt;; slow) sleep 40; echo right > answer.txt;; esac
"""
RACE_CHECK = "test ! -e answer.txt || grep -q right answer.txt || test -e .local-pass"


def race_project(repo):
    store = setup(repo, [RACE_CHECK], "".join(racer(n) for n in ("fast", "steady", "slow")))
    with open(str(repo / ".gitignore"), "w") as handle:
        handle.write(".local-pass\n")
    git(repo, "add", ".gitignore")
    git(repo, "commit", "-qm", "ignore the local pass")
    return store


def test_the_second_finisher_first_through_the_gate_wins_and_one_commit_lands(repo):
    store = race_project(repo)
    before = git(repo, "rev-parse", "main").stdout.strip()
    queued = ferrus.op_enqueue_race(store, ferrus.HUMAN, RACE_TASK, ferrus.parse_race(
        "fast,steady,slow", store.config()))
    race, tasks = queued.data["race"], queued.data["tasks"]
    fast, steady, slow = tasks
    code, lines = run(store, 3)
    text = "\n".join(lines)
    assert code == ferrus.RUN_COMPLETE, text
    assert statuses(store) == {fast: "cancelled", steady: "merged", slow: "cancelled"}
    # Exactly one commit reached the target: the steady attempt's.
    assert git(repo, "rev-list", "--count", "%s..main" % before).stdout.strip() == "1"
    assert open(str(repo / "answer.txt")).read() == "right\n"
    # The fast one did finish first: the gate failed it before the steady one merged.
    entries = store.read_journal()
    failed = [e for e in entries if e["event"] == "integration_failed"]
    assert failed and failed[0]["task_id"] == fast
    merged = next(e["seq"] for e in entries if e["event"] == "task_merged")
    assert failed[0]["seq"] < merged
    # The losers were cancelled with their work saved, and never come back.
    for loser in (fast, slow):
        record = ferrus.read_task_record(store.dir, loser)
        assert record["lost_to"] == steady
        if loser == fast:
            assert record["saved"]["ref"]
        with pytest.raises(ferrus.FerrusError) as err:
            ferrus.op_retry_task(store, ferrus.HUMAN, loser)
        assert "lost its race" in err.value.message
    # Every attempt's outcome, time and cost is recorded.
    decided = [e for e in entries if e["event"] == "race_decided"]
    assert len(decided) == 1 and decided[0]["detail"]["winner"] == steady
    attempts = decided[0]["detail"]["attempts"]
    assert [(a["agent"], a["status"]) for a in attempts] == [
        ("fast", "cancelled"), ("steady", "merged"), ("slow", "cancelled")]
    assert all(a["secs"] is not None and "cost_usd" in a for a in attempts)
    assert "race %s: attempt 2" % race in text
    # `ferrus tasks` groups the race's attempts under its heading.
    out = run_cli("tasks", cwd=repo)
    assert out.returncode == 0, out.stderr
    heading = [line for line in out.stdout.splitlines() if line.startswith("race ")]
    assert heading == ["race %s: Answer the question. — won by attempt 2 (%s): merged" % (
        race, ferrus.short_task_id(steady))]
    for number in (1, 2, 3):
        assert "attempt %d of 3: " % number in out.stdout
    listed = json.loads(run_cli("tasks", "--json", cwd=repo).stdout)
    assert [a["task"] for a in listed["races"][0]["attempts"]] == tasks


def test_a_race_starts_its_attempts_together_and_counts_as_that_many_tasks(repo):
    store = setup(repo, ["true"], racer("one") + racer("two"))
    alone = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Alone.\n\nWRITE a.txt: a\n"
                                   ).data["task_id"]
    race = ferrus.op_enqueue_race(store, ferrus.HUMAN, "Both.\n\nWRITE b.txt: b\n",
                                  [("one", ""), ("two", "")]).data["tasks"]
    records = {task: ferrus.read_task_record(store.dir, task) for task in [alone] + race}
    queued = [alone] + race
    assert ferrus.plan_batch(queued, records, 3) == queued
    assert ferrus.plan_batch(queued, records, 2) == [alone]     # the race waits, whole
    assert ferrus.plan_batch(race + [alone], records, 1) == []   # nothing passes it
    # A run that cannot start every attempt at once leaves the race queued, and says so.
    code, lines = run(store, 1)
    assert code == ferrus.RUN_FAILED
    assert "a race's attempts start together" in "\n".join(lines)
    assert statuses(store) == {alone: "merged", race[0]: "queued", race[1]: "queued"}


def test_race_specs_name_known_agents_only(repo):
    store = setup(repo, ["true"], racer("one"))
    config = store.config()
    assert ferrus.parse_race("3", config) == [(None, "")] * 3
    assert ferrus.parse_race("3", config, "one") == [("one", "")] * 3
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.parse_race("3", config, "nosuch")
    assert "--agent nosuch is not an agent ferrus knows" in err.value.message
    assert ferrus.parse_race("one, claude:opus", config) == [("one", ""),
                                                            ("claude-code", "opus")]
    for spec, said in (("1", "from 2 to 64 attempts"), ("65", "from 2 to 64 attempts"),
                       ("one", "from 2 to 64 attempts"),
                       ("one,nosuch", "nosuch is not an agent ferrus knows")):
        with pytest.raises(ferrus.FerrusError) as err:
            ferrus.parse_race(spec, config)
        assert said in err.value.message, spec
    out = run_cli("task", "add", "Do it.", "--race", "one,nosuch", cwd=repo)
    assert out.returncode != 0 and "nosuch is not an agent ferrus knows" in out.stderr
    assert ferrus.task_rows(store) == []                        # nothing was queued
    out = run_cli("task", "add", "Do it.", "--race", "one,scripted", cwd=repo)
    assert out.returncode == 0, out.stderr
    assert "Race r-" in out.stdout and "2 attempts" in out.stdout
    rows = ferrus.task_rows(store)
    assert sorted(row["agent"] for row in rows) == ["one", "scripted"]
    assert len({row["race"]["id"] for row in rows}) == 1
