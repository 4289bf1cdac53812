"""Places: [places.NAME] config, the channel (an argv run there, whatever it holds; ferrus
copied once by content hash; retries with backoff), commits there and back, a task run
at a place with its journal followed back through a dropped connection, its lease, and
the cleanup of what a killed run left.

The channel's logic runs against `env` (an exec prefix that changes nothing, here); the
same behaviours run against a second local user reached by a real sshd on 127.0.0.1 and
by `runuser -u USER --` (tests/places_harness.py; skipped, saying why, without root or
openssh-server).
"""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import ferrus
from conftest import SCRIPTED_AGENT, SCRIPTED_CHECK, set_config
from places_harness import (PLACE_PYTHON, exec_place, local_place, place_home,  # noqa: F401
                            ssh_place, sshd)  # (exec_place ... sshd: the fixtures)

GIT_IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
                "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def git(where, *args, input=None):
    return subprocess.run(["git"] + list(args), cwd=str(where), capture_output=True, text=True,
                          env=dict(os.environ, **GIT_IDENTITY), check=True,
                          input=input).stdout.strip()


class Sleeps(list):
    """An injectable sleep: records what it was asked to wait, waits for nothing."""

    def __call__(self, seconds):
        self.append(seconds)


# -- config -----------------------------------------------------------------------------------

def parse(places_table, sandbox=None):
    return ferrus.parse_places_table("ferrus.toml", places_table, sandbox)


def test_a_place_is_reached_by_ssh_or_by_an_exec_prefix_with_defaults():
    found = parse({"box1": {"ssh": ["ssh", "-p", "2222", "agents@build-1"], "slots": 4},
                   "pod": {"exec": ["kubectl", "exec", "-i", "agents-0", "--"]}})
    assert set(found) == {"here", "box1", "pod"}
    box = found["box1"]
    assert (box.kind, box.slots, box.dir, box.python) == ("ssh", 4, "~/.ferrus-places",
                                                          "python3")
    assert found["pod"].kind == "exec" and found["pod"].slots == 1
    assert found["here"].kind == "here"


@pytest.mark.parametrize("table, words", [
    ({}, "needs exactly one of ssh"),
    ({"ssh": ["ssh", "h"], "exec": ["env"]}, "needs exactly one of ssh"),
    ({"ssh": []}, "must not be empty"),
    ({"ssh": ["ssh", 3]}, "array of non-empty strings"),
    ({"ssh": ["ssh", "h"], "slots": 0}, "between 1 and 64"),
    ({"ssh": ["ssh", "h"], "python": "python3; rm -rf ~"}, "program name or path"),
    ({"ssh": ["ssh", "h"], "dir": "places"}, "absolute path or start with ~/"),
])
def test_a_bad_place_is_refused_naming_its_key(table, words):
    with pytest.raises(ferrus.FerrusError) as caught:
        parse({"box": table})
    assert words in caught.value.message and "[places.box" in caught.value.message


def test_here_is_this_machine_and_takes_only_slots_and_sandbox():
    with pytest.raises(ferrus.FerrusError) as caught:
        parse({"here": {"ssh": ["ssh", "h"]}})
    assert "[places.here.ssh] cannot be set" in caught.value.message
    found = parse({"here": {"slots": 3, "sandbox": {"enabled": True}}})
    assert found["here"].slots == 3 and found["here"].sandbox.enabled
    assert parse({})["here"].slots is None            # [parallel] max_tasks


def test_a_place_sandbox_goes_over_the_global_one_key_by_key():
    base = ferrus.SandboxConfig(enabled=True, writable=["~/.cache"])
    found = parse({"box": {"ssh": ["ssh", "h"], "sandbox": {"network": False}},
                   "pod": {"exec": ["env"]}}, base)
    assert (found["box"].sandbox.enabled, found["box"].sandbox.network,
            found["box"].sandbox.writable) == (True, False, ["~/.cache"])
    assert found["pod"].sandbox == base


def test_parallel_places_name_here_or_defined_places_once():
    found = parse({"box": {"ssh": ["ssh", "h"]}})
    assert ferrus.parallel_places_problem(["here", "box"], found) is None
    assert "neither \"here\" nor a [places.pod]" in ferrus.parallel_places_problem(
        ["here", "pod"], found)
    assert ferrus.parallel_places_problem(["box", "box"], found) == "names a place twice"


def test_the_config_file_is_read_with_the_other_tables(project):
    set_config(project, '[sandbox]\nenabled = true\n\n[parallel]\nplaces = ["box", "here"]\n\n'
                        '[places.box]\nssh = ["ssh", "b"]\nslots = 2\n\n'
                        '[places.box.sandbox]\nnetwork = false\n')
    config, found, order = ferrus.configured_places(str(project))
    assert order == ["box", "here"] and found["box"].slots == 2
    assert found["box"].sandbox.enabled and not found["box"].sandbox.network
    assert found["here"].sandbox.enabled and found["here"].sandbox.network
    set_config(project, '[parallel]\nplaces = ["nowhere"]\n')
    with pytest.raises(ferrus.FerrusError) as caught:
        ferrus.configured_places(str(project))
    assert "[parallel.places]" in caught.value.message


def test_a_place_gets_the_config_without_places_or_notify(project):
    set_config(project, '[checks]\ncommands = ["make test"]\n\n[notify]\ncommand = '
                        '["curl", "https://hooks.example/T0KEN"]\n\n[places.box]\nssh = '
                        '["ssh", "secret-host"]\n\n[places.box.sandbox]\nenabled = true\n')
    text = ferrus.place_config_text(str(project))
    assert "make test" in text and "T0KEN" not in text and "secret-host" not in text
    assert "[places" not in text
    # The place's own [sandbox] (its table over the global one) is the one it gets.
    text = ferrus.place_config_text(str(project), ferrus.SandboxConfig(enabled=True,
                                                                       network=False))
    raw = ferrus.parse_toml(text)
    assert raw["sandbox"] == {"enabled": True, "writable": [], "network": False, "hidden": []}
    assert raw["checks"]["commands"] == ["make test"]


# -- the command line that reaches a place ----------------------------------------------------

HOSTILE_WORDS = ["$(touch PWNED)", "`touch PWNED`", "; touch PWNED", "' ; touch PWNED '",
                 '" && touch PWNED "', "a\nb", "\\", "$HOME", "!!", "*"]


def test_the_remote_command_line_holds_only_safe_characters():
    place = ferrus.Place(ferrus.PlaceConfig("box", ssh=["ssh", "-p", "22", "a@b"]))
    argv = place.argv({"kind": "run", "argv": ["echo"] + HOSTILE_WORDS, "cwd": "~/x y"})
    remote = argv[-1]
    assert remote.startswith("exec python3 -c ")
    assert re.fullmatch(r"[A-Za-z0-9 ._/+=\-'\"(),;]+", remote), remote
    for word in HOSTILE_WORDS:
        assert word not in remote
    exec_argv = ferrus.Place(ferrus.PlaceConfig("pod", exec=["docker", "exec", "-i", "c"])) \
        .argv({"kind": "run", "argv": ["true"]})
    assert exec_argv[:6] == ["docker", "exec", "-i", "c", "python3", "-c"]


def test_ssh_gets_its_options_before_the_host_and_after_the_users_own():
    place = ferrus.Place(ferrus.PlaceConfig("box", ssh=["ssh", "-o", "ControlPersist=5",
                                                        "user@host"]))
    prefix = place._prefix()
    assert prefix[:3] == ["ssh", "-o", "ControlPersist=5"] and prefix[-1] == "user@host"
    assert "BatchMode=yes" in prefix and "ControlMaster=auto" in prefix
    plain = ferrus.Place(ferrus.PlaceConfig("box", ssh=["ssh", "h"], multiplex=False))
    assert "ControlMaster=auto" not in plain._prefix()


# -- the channel, for real (this machine, through `env`) --------------------------------------

def test_an_argv_runs_there_exactly_as_given(local_place, tmp_path):
    odd = tmp_path / "a 'dir' $(x)"
    odd.mkdir()
    place = ferrus.Place(local_place)
    done = place.run(["printf", "%s\\n"] + HOSTILE_WORDS, cwd=str(odd),
                     env={"ODD": "$(touch PWNED)"})
    assert done.returncode == 0
    assert done.stdout.decode().split("\n")[:-1] == "\n".join(HOSTILE_WORDS).split("\n")
    assert place.run(["sh", "-c", 'printf %s "$ODD"; pwd'], cwd=str(odd),
                     env={"ODD": "$(touch PWNED)"}).stdout.decode() == \
        "$(touch PWNED)%s\n" % odd
    assert not list(tmp_path.rglob("PWNED")) and not os.path.exists("PWNED")
    assert place.run(["sh", "-c", "exit 7"]).returncode == 7


def test_ferrus_is_copied_there_once_by_content_hash(local_place, tmp_path):
    installs = []

    class Counting(ferrus.Place):
        def install(self):
            installs.append(self.program[0])
            return super().install()
    first = Counting(local_place)
    assert first.probe([])["ferrus"] == "ferrus-" + first.program[0][:16]
    assert first.probe([])["python"]
    Counting(local_place).probe([])                  # another run: the copy is there
    assert len(installs) == 1
    copy = tmp_path / "place" / ("ferrus-" + first.program[0][:16])
    assert sorted(p.name for p in copy.iterdir() if p.suffix == ".py") == ["ferrus.py"]
    # Another ferrus (another content): a copy of its own, beside the first.
    digest, contents = first.program
    changed = [(name, data + b"\n# another version\n") for name, data in contents]
    other = Counting(local_place, program=(ferrus.program_hash(changed), changed))
    other.probe([])
    assert len(installs) == 2
    assert (tmp_path / "place" / ("ferrus-" + other.program[0][:16])).is_dir()


def test_a_copy_that_arrives_damaged_is_refused(local_place):
    digest, contents = ferrus.place_program()
    place = ferrus.Place(local_place, program=("0" * 64, contents))
    with pytest.raises(ferrus.PlaceBroken) as caught:
        place.install()
    assert "arrived damaged" in caught.value.message


FLAKY = r"""
import os, sys
count_file, failures, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
count = int(open(count_file).read()) if os.path.exists(count_file) else 0
open(count_file, "w").write(str(count + 1))
if count < failures:
    if mode == "unreachable":
        sys.stderr.write("connect to host box port 22: Connection refused\n")
        sys.exit(255)
    sys.stdout.write("ferrus-place 1\n")        # reached, then the connection dies
    sys.stdout.flush()
    os.kill(os.getpid(), 9)
os.execvp(sys.argv[4], sys.argv[4:])
"""


def flaky_place(tmp_path, failures, mode, place_dir):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    return ferrus.PlaceConfig("flaky", exec=[sys.executable, str(script),
                                             str(tmp_path / "count"), str(failures), mode],
                              dir=place_dir, python=sys.executable)


def test_an_unreachable_place_is_tried_again_with_backoff(local_place, tmp_path):
    sleeps = Sleeps()
    place = ferrus.Place(flaky_place(tmp_path, 3, "unreachable", local_place.dir),
                         sleep=sleeps)
    assert place.run(["echo", "hi"]).stdout == b"hi\n"
    assert sleeps == [0.25, 0.5, 1.0] and place.retries == 3


def test_a_place_that_stays_unreachable_is_named_with_what_it_said(local_place, tmp_path):
    sleeps = Sleeps()
    place = ferrus.Place(flaky_place(tmp_path, 99, "unreachable", local_place.dir),
                         sleep=sleeps, delays=(1, 2))
    with pytest.raises(ferrus.PlaceUnreachable) as caught:
        place.run(["echo", "hi"])
    assert "place flaky" in caught.value.message and "could not be reached" in \
        caught.value.message and "Connection refused" in caught.value.message
    assert "3 tries" in caught.value.message and sleeps == [1, 2]
    assert "other place" in caught.value.hint


def test_a_call_whose_connection_dies_half_way_is_made_again(local_place, tmp_path):
    sleeps = Sleeps()
    place = ferrus.Place(flaky_place(tmp_path, 2, "dropped", local_place.dir), sleep=sleeps)
    assert place.call("jobs") == {"jobs": []}
    assert len(sleeps) == 2


def test_a_place_without_python_says_so(local_place):
    config = ferrus.PlaceConfig("nopy", exec=["env"], dir=local_place.dir,
                                python="/nonexistent/python3")
    with pytest.raises(ferrus.PlaceBroken) as caught:
        ferrus.Place(config, sleep=Sleeps()).run(["true"])
    assert "cannot run /nonexistent/python3 there" in caught.value.message
    assert "Python 3.9" in caught.value.hint


def test_a_prefix_missing_here_says_so(local_place):
    config = ferrus.PlaceConfig("gone", exec=["no-such-prefix-cli"], dir=local_place.dir)
    with pytest.raises(ferrus.PlaceBroken) as caught:
        ferrus.Place(config).run(["true"])
    assert "cannot start no-such-prefix-cli here" in caught.value.message


def test_an_old_python_there_is_named():
    place = ferrus.Place(ferrus.PlaceConfig("old", ssh=["ssh", "h"]))
    failure = place._failure("old-python", 86, b"ferrus: this place runs Python 3.6; ferrus "
                                               b"needs 3.9 or later\n", 0)
    assert isinstance(failure, ferrus.PlaceBroken)
    assert "Python 3.6" in failure.message and "[places.old] python" in failure.hint


OLD_PYTHONS = [path for path in (os.path.expanduser("~/.pyenv/versions/%s/bin/python" % v)
                                 for v in ("2.7.18", "3.6.15", "3.8.18")) if os.path.exists(path)]


@pytest.mark.parametrize("python", OLD_PYTHONS or ["none"])
def test_a_place_whose_python_is_too_old_is_named_with_its_version(local_place, python):
    if python == "none":
        pytest.skip("no Python older than 3.9 on this machine (pyenv)")
    config = ferrus.PlaceConfig("old", exec=["env"], dir=local_place.dir, python=python)
    sleeps = Sleeps()
    with pytest.raises(ferrus.PlaceBroken) as caught:
        ferrus.Place(config, sleep=sleeps).run(["true"])
    version = re.search(r"versions/(\d+\.\d+)", python).group(1)
    assert caught.value.message == "place old (exec env): this place runs Python %s; " \
                                   "ferrus needs 3.9 or later" % version
    assert sleeps == []


# -- commits there and back -------------------------------------------------------------------

@pytest.fixture
def repository(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    (root / "a.txt").write_text("one\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "first")
    (root / "b.txt").write_text("two\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "second")
    return root


def test_commits_go_to_a_place_and_come_back(local_place, repository, tmp_path):
    place = ferrus.Place(local_place)
    project = ferrus.place_project_key(str(repository))
    head = git(repository, "rev-parse", "HEAD")
    place.send_commit(str(repository), project, head, "t-1")
    there = tmp_path / "place" / "projects" / project / "checkout"
    assert git(there, "rev-parse", "refs/ferrus-place/t-1") == head
    assert git(there, "show", head + ":b.txt") == "two"
    # Work done there: a commit on the base, made with the place's own git.
    tree = git(there, "mktree", input="100644 blob %s\tc.txt\n" % git(
        there, "hash-object", "-w", "--stdin", input="three\n"))
    made = git(there, "commit-tree", tree, "-p", head, "-m", "work there")
    place.fetch_commit(str(repository), project, made, haves=[head], ref="refs/ferrus/t-1/back")
    assert git(repository, "rev-parse", "refs/ferrus/t-1/back") == made
    assert git(repository, "show", made + ":c.txt") == "three"
    # A second send finds what the place has: only the new commit travels.
    (repository / "d.txt").write_text("four\n")
    git(repository, "add", "-A")
    git(repository, "commit", "-qm", "third")
    place.send_commit(str(repository), project, git(repository, "rev-parse", "HEAD"), "t-2")
    assert git(there, "show", "refs/ferrus-place/t-2:d.txt") == "four"


def test_a_commit_the_place_lacks_is_an_error_naming_the_place(local_place, repository):
    sleeps = Sleeps()
    place = ferrus.Place(local_place, sleep=sleeps)
    project = ferrus.place_project_key(str(repository))
    head = git(repository, "rev-parse", "HEAD")
    place.send_commit(str(repository), project, head, "t-1")
    with pytest.raises(ferrus.FerrusError) as caught:
        place.fetch_commit(str(repository), project, "f" * 40, haves=[head])
    assert caught.value.message == "place local: commit ffffffffffff is not in this " \
                                   "place's repository"
    assert sleeps == []                    # an answer, not a connection to try again


# -- a task at a place ------------------------------------------------------------------------

def place_project(tmp_path, agent_argv, check=SCRIPTED_CHECK):
    """A project (a git repository, everything committed) whose agents are the scripted one
    at ``agent_argv`` (a path valid at the place)."""
    root = tmp_path / "proj"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    ferrus.init_project(str(root), report=lambda message: None)
    set_config(root, """
[checks]
commands = [%s]

[limits]
wait_timeout_secs = 5

[agents.custom.scripted]
interactive = %s
headless = %s
prompt = "stdin"

[hq.supervisor]
agent = "scripted"

[hq.executor]
agent = "scripted"
""" % (json.dumps(check), json.dumps(agent_argv), json.dumps(agent_argv)))
    (root / ".gitignore").write_text(".ferrus/\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    return ferrus.Store(str(root))


TASK_ID = "t-20261127T100000-0a1b2c"
TITLE = "Add work $(touch PWNED) `id` ; rm -rf ~ 'quoted' \"too\""


def follow_until(follower, done, timeout=120):
    """Items until ``done(item)``, or fail with what came."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        item = follower.get(timeout=0.5)
        if item is None:
            continue
        seen.append(item)
        if "lost" in item:
            break
        if done(item):
            return seen
    raise AssertionError("not seen in time; came: %s" % json.dumps(seen)[-3000:])


def at_state(state):
    return lambda item: ("beat" in item and item["beat"]["task"]["state"] == state) or \
        ("end" in item)


def run_task_there(place, store, tmp_path, cut=False):
    """Prepare, start and follow a task at ``place`` to Integrating; fetch its submission;
    tell it it is integrated; follow it to its end.  ``cut`` kills the connection the
    follower reads while the task runs.  Returns (items, follower, fetched commit)."""
    base = git(store.root, "rev-parse", "HEAD")
    prepared = place.prepare_task(store, TASK_ID, base, TITLE + "\n\nWrite the work file.")
    assert prepared["branch"] == "ferrus/" + TASK_ID
    project = ferrus.place_project_key(store.root)
    place.call("start", project=project, task=TASK_ID, lease=60)
    follower = place.follow(store, TASK_ID, beat=0.3)
    try:
        items = []
        if cut:
            items += follow_until(follower, lambda item: "entry" in item)
            follower.cut()
        items += follow_until(follower, at_state("Integrating"))
        view = items[-1]["beat"]["task"]
        commit = place.fetch_commit(store.root, project, view["submitted"], haves=[base],
                                    ref="refs/ferrus/%s/place-submit" % TASK_ID)
        answer = place.call("act", project=project, task=TASK_ID, action="integrated")
        assert answer["state"] == "Complete"
        items += follow_until(follower, lambda item: "end" in item)
    finally:
        follower.stop()
    return items, follower, commit


def check_task_came_back(store, items, commit):
    events = [item["entry"]["event"] for item in items if "entry" in item]
    for wanted in ("create_task", "submit", "approve", "integrated"):
        assert wanted in events, events
    seqs = [item["entry"]["seq"] for item in items if "entry" in item]
    assert seqs == sorted(set(seqs)), "an entry came twice or out of order: %s" % seqs
    assert all(item["entry"]["task_id"] == TASK_ID for item in items if "entry" in item)
    assert any(item.get("message", {}).get("event") == "submission" for item in items)
    mirrored = [item["task"] for item in items if "task" in item]
    assert [m["state"]["state"] for m in mirrored][-1] == "Complete"
    assert any(m["state"]["state"] == "Integrating" and
               m["files"]["SUBMISSION.md"] == "Did the work." for m in mirrored)
    end = items[-1]["end"]
    assert end["job"]["state"] == "ended" and end["job"]["reason"] == "ended"
    assert end["task"]["state"] == "Complete"
    assert git(store.root, "show", commit + ":work.txt") == "work"
    assert git(store.root, "rev-parse", "main") != commit        # the target is untouched


def test_a_task_runs_at_a_place_and_its_journal_comes_back(local_place, tmp_path):
    store = place_project(tmp_path, [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    place = ferrus.Place(local_place)
    items, follower, commit = run_task_there(place, store, tmp_path)
    check_task_came_back(store, items, commit)
    project = ferrus.place_project_key(store.root)
    record = ferrus.read_task_record(str(tmp_path / "place" / "projects" / project /
                                         "checkout" / ".ferrus"), TASK_ID)
    assert record["title"] == TITLE
    assert not list(tmp_path.rglob("PWNED"))


def test_a_dropped_connection_is_taken_up_where_it_stopped(local_place, tmp_path):
    store = place_project(tmp_path, [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    place = ferrus.Place(local_place)
    items, follower, commit = run_task_there(place, store, tmp_path, cut=True)
    assert follower.drops >= 1
    check_task_came_back(store, items, commit)


def test_a_job_nobody_follows_ends_when_its_lease_runs_out(local_place, tmp_path, monkeypatch):
    monkeypatch.setenv("SCRIPTED_BEHAVIOR", "slow-executor")
    store = place_project(tmp_path, [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    place = ferrus.Place(local_place)
    base = git(store.root, "rev-parse", "HEAD")
    place.prepare_task(store, TASK_ID, base, "Slow work.")
    project = ferrus.place_project_key(store.root)
    place.call("start", project=project, task=TASK_ID, lease=1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        jobs = place.call("jobs")["jobs"]
        if jobs and jobs[0]["state"] != "running":
            break
        time.sleep(0.2)
    assert jobs[0]["state"] == "ended" and jobs[0]["reason"] == "lease expired", jobs
    there = ferrus.Store(str(tmp_path / "place" / "projects" / project / "checkout"))
    registry = json.loads(open(there.path("agents.json")).read())
    assert all(entry["status"] != "running" for entry in registry["agents"]), registry
    # Its work and its state stay there: a new lease takes it up again.
    assert there.for_task(TASK_ID).read_state().state == ferrus.TaskState.EXECUTING


def test_a_cancelled_task_at_a_place_keeps_its_work(local_place, tmp_path):
    store = place_project(tmp_path, [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    place = ferrus.Place(local_place)
    base = git(store.root, "rev-parse", "HEAD")
    project = ferrus.place_project_key(store.root)
    prepared = place.prepare_task(store, TASK_ID, base, "Work to keep.")
    assert place.call("act", project=project, task=TASK_ID, action="save")["saved"] is None
    place.run(["sh", "-c", "echo kept > half-done.txt"], cwd=prepared["workdir"])
    saved = place.call("act", project=project, task=TASK_ID, action="save")["saved"]
    assert saved["ref"].startswith("refs/ferrus/%s/saved-" % TASK_ID)
    place.fetch_commit(store.root, project, saved["commit"], haves=[base],
                       ref=saved["ref"])
    assert git(store.root, "show", saved["ref"] + ":half-done.txt") == "kept"


def test_the_lease_counts_by_its_own_clock():
    now = [100.0]
    lease = ferrus.PlaceLease(10.0, clock=lambda: now[0])
    now[0] += 9
    assert not lease.expired()
    lease.seen("token-1")
    now[0] += 9
    assert not lease.expired()            # renewed 9 s ago
    lease.seen("token-1")                 # the same token again is no renewal
    now[0] += 2
    assert lease.expired()
    lease.seen("token-2", secs=30)
    now[0] += 29
    assert not lease.expired()


def test_a_stop_ends_the_job_and_says_so(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    (tmp_path / "stop").write_text("stop\n")
    reason = ferrus.supervise_job(child, str(tmp_path), ferrus.PlaceLease(60),
                                      poll=0.01, sleep=Sleeps())
    assert reason == "stopped" and child.poll() is not None


def test_clean_removes_what_a_killed_run_left_and_nothing_in_use(local_place, tmp_path):
    store = place_project(tmp_path, [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    place = ferrus.Place(local_place)
    base = git(store.root, "rev-parse", "HEAD")
    project = ferrus.place_project_key(store.root)
    left, kept = "t-20261127T100000-111111", "t-20261127T100000-222222"
    for task in (left, kept):
        place.prepare_task(store, task, base, "Work %s." % task)
    stale = tmp_path / "place" / "ferrus-0123456789abcdef"
    stale.mkdir()
    removed = place.call("clean", project=project, keep=[[project, kept]])["removed"]
    there = tmp_path / "place" / "projects" / project
    assert not (there / "tasks" / left).exists() and (there / "tasks" / kept).is_dir()
    assert str(there / "tasks" / left) in removed and not stale.exists()
    assert (tmp_path / "place" / ("ferrus-" + place.program[0][:16])).is_dir()
    assert "ferrus/" + left not in git(there / "checkout", "branch", "--list")


def test_doctor_finds_and_removes_what_a_killed_run_left_at_a_place(local_place, tmp_path):
    store = place_project(tmp_path, [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    with open(os.path.join(store.root, "ferrus.toml"), "a") as handle:
        handle.write('\n[places.local]\nexec = ["env"]\ndir = %s\npython = %s\n' % (
            json.dumps(local_place.dir), json.dumps(sys.executable)))
    place = ferrus.Place(local_place)
    place.prepare_task(store, TASK_ID, git(store.root, "rev-parse", "HEAD"), "Left behind.")
    findings = ferrus.place_findings(store.root)
    assert [f.problem for f in findings] == [
        "place local still holds task %s (its job none): a run ended without removing it"
        % TASK_ID]
    findings[0].fix()
    assert ferrus.place_findings(store.root) == []
    assert not (tmp_path / "place" / "projects" / ferrus.place_project_key(store.root) /
                "tasks" / TASK_ID).exists()


def test_a_task_at_a_place_runs_with_its_agents_confined(local_place, tmp_path):
    """The place's [sandbox] at work: the task's agents there run in bubblewrap, reach
    ferrus through the bridge, and a hostile executor's writes outside its worktree fail
    while its work comes back (the `ferrus serve` its MCP configuration starts relays)."""
    try:
        ferrus.sandbox_tool()
    except ferrus.SandboxUnavailable as err:
        pytest.skip("no sandbox on this machine: %s" % err.message)
    store = place_project(tmp_path, [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    local_place.sandbox = ferrus.SandboxConfig(enabled=True)
    place = ferrus.Place(local_place)
    evil = os.path.expanduser("~/ferrus-place-sandbox-evil")
    base = git(store.root, "rev-parse", "HEAD")
    prepared = place.prepare_task(store, TASK_ID, base, (
        "Work confined.\nSHELL echo x > %s\nSHELL echo forged > %s/.ferrus/STATE.json\n"
        "SHELL git -C %s/.git/.. status >/dev/null 2>&1 || echo x > %s/.git/hooks/pre-commit"
        % (evil, "{checkout}", "{checkout}", "{checkout}")).replace(
        "{checkout}", str(tmp_path / "place" / "projects" / ferrus.place_project_key(
            store.root) / "checkout")))
    project = ferrus.place_project_key(store.root)
    place.call("start", project=project, task=TASK_ID, lease=60)
    follower = place.follow(store, TASK_ID, beat=0.3)
    try:
        items = follow_until(follower, at_state("Integrating"))
        submitted = items[-1]["beat"]["task"]["submitted"]
        place.fetch_commit(store.root, project, submitted, haves=[base])
        place.call("act", project=project, task=TASK_ID, action="integrated")
        items += follow_until(follower, lambda item: "end" in item)
    finally:
        follower.stop()
        if os.path.exists(evil):
            os.unlink(evil)
            pytest.fail("the sandboxed executor wrote into the home folder")
    assert items[-1]["end"]["task"]["state"] == "Complete"
    assert git(store.root, "show", submitted + ":work.txt") == "work"
    checkout = prepared["checkout"]
    assert not os.path.exists(os.path.join(checkout, ".git", "hooks", "pre-commit"))
    assert json.loads(open(os.path.join(checkout, ".ferrus", "STATE.json")).read())["state"]
    logs = os.path.join(checkout, ".ferrus", "logs")
    said = "".join(open(os.path.join(logs, n)).read() for n in os.listdir(logs)
                   if "executor" in n)
    assert "bwrap" in said and said.count("Read-only file system") >= 2, said


# -- another user, through sshd and runuser ---------------------------------------------------

@pytest.fixture(params=["ssh", "exec"])
def remote_place(request):
    return request.getfixturevalue(request.param + "_place")


def test_a_remote_place_is_another_user_sharing_no_path(remote_place, tmp_path):
    place = ferrus.Place(remote_place)
    done = place.run(["sh", "-c", "id -un; echo $HOME; test -r %s || echo no-access"
                      % tmp_path])
    assert done.stdout.decode().split() == ["ferrusplace", place_home(), "no-access"]
    done = place.run(["printf", "%s\\n"] + HOSTILE_WORDS, cwd="~")
    assert done.stdout.decode().split("\n")[:-1] == "\n".join(HOSTILE_WORDS).split("\n")
    assert not os.path.exists(os.path.join(place_home(), "PWNED"))


def place_agent(place, remote_place):
    """The scripted agent, copied to the place (its CLI, as the place's admin installs it)."""
    folder = os.path.join(place_home(), remote_place.dir[2:], "agents")
    with open(SCRIPTED_AGENT, "rb") as handle:
        place.run(["sh", "-c", 'mkdir -p "$1" && cat > "$1/scripted_agent.py"', "sh", folder],
                  input=handle.read())
    return [PLACE_PYTHON, os.path.join(folder, "scripted_agent.py"), "{role}", "{mcp_config}"]


def test_a_task_runs_at_a_remote_place_through_a_killed_connection(remote_place, tmp_path):
    place = ferrus.Place(remote_place)
    store = place_project(tmp_path, place_agent(place, remote_place))
    items, follower, commit = run_task_there(place, store, tmp_path, cut=True)
    assert follower.drops >= 1
    check_task_came_back(store, items, commit)
    removed = place.call("remove", project=ferrus.place_project_key(store.root),
                         task=TASK_ID)["removed"]
    assert any(path.endswith("/tasks/" + TASK_ID) for path in removed)


def test_a_killed_shared_ssh_connection_is_made_again(ssh_place):
    place = ferrus.Place(ssh_place, sleep=Sleeps())
    place.call("jobs")
    prefix = place._prefix()
    said = subprocess.run(prefix[:-1] + ["-O", "check", prefix[-1]], capture_output=True,
                          text=True).stderr
    master = int(re.search(r"pid=(\d+)", said).group(1))
    os.kill(master, signal.SIGKILL)
    assert place.call("jobs") == {"jobs": []}


# -- `ferrus places` --------------------------------------------------------------------------

def test_places_report_checks_each_place_live(project, ssh_place, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "")
    set_config(project, """
[parallel]
places = ["here", "box", "gone"]

[places.box]
ssh = %s
dir = %s
python = %s

[places.gone]
exec = ["false"]

[hq.supervisor]
agent = "claude-code"

[hq.executor]
agent = "claude-code"
""" % (json.dumps(ssh_place.ssh), json.dumps(ssh_place.dir), json.dumps(PLACE_PYTHON)))
    made = []

    def make_place(config):
        made.append(config.name)
        return ferrus.Place(config, sleep=Sleeps(), delays=(0,))
    rows = {row["place"]: row for row in ferrus.places_report(str(project), make_place)}
    assert [name for name in rows] == ["here", "box", "gone"] and made == ["box", "gone"]
    box = rows["box"]
    assert box["reachable"] and box["python"].startswith("3.") and box["git"]
    assert box["agents"]["claude"]["path"] is None
    assert box["problem"] == "claude is not installed at place box"
    assert box["free"] == 1
    assert not rows["gone"]["reachable"] and "could not be reached" in rows["gone"]["problem"]
    lines = "\n".join(line for row in rows.values() for line in ferrus.describe_place_row(row))
    assert "box        ssh ferrusplace@127.0.0.1" in lines
    assert "claude: not installed" in lines and "gone       exec false: unreachable" in lines


def test_ferrus_places_prints_each_place_and_cleans_leftovers(local_place, tmp_path, capsys):
    import argparse
    store = place_project(tmp_path, [sys.executable, SCRIPTED_AGENT, "{role}", "{mcp_config}"])
    with open(os.path.join(store.root, "ferrus.toml"), "a") as handle:
        handle.write('\n[parallel]\nplaces = ["here", "local"]\n\n[places.local]\nexec = '
                     '["env"]\ndir = %s\npython = %s\nslots = 2\n' % (
                         json.dumps(local_place.dir), json.dumps(sys.executable)))
    args = argparse.Namespace(json=True, clean=False)
    assert ferrus.cmd_places(args, store.root) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["place"], row["reachable"], row["slots"], row["free"]) for row in rows] == [
        ("here", True, 1, 1), ("local", True, 2, 2)]
    ferrus.Place(local_place).prepare_task(store, TASK_ID, git(store.root, "rev-parse",
                                                                "HEAD"), "Left behind.")
    args = argparse.Namespace(json=False, clean=True)
    assert ferrus.cmd_places(args, store.root) == 0
    said = capsys.readouterr().out
    assert said.startswith("local      removed 2 leftovers: ") and TASK_ID in said


def follow_in_rounds(tmp_path, monkeypatch, journal, states, clock):
    """What follow_place_task sends, in order ((kind, seq or rev)), when by round N the
    place's journal holds ``journal[N]`` and the task's STATE.json is at rev
    ``states[N]``; the job ends at round 4."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.json").write_text(json.dumps({"state": "running", "pid": os.getpid()}))
    rounds = [0]

    class Store:
        def journal_since(self, position, after):
            got = [{"seq": seq, "task_id": "t-1", "event": "e%d" % seq}
                   for seq in journal[rounds[0]] if seq > after]
            return got, position

        def for_task(self, task):
            return self

        def path(self, *parts):
            return str(tmp_path.joinpath(*parts))

    class Project:
        def store(self):
            return Store()

        def job(self, task):
            return str(job)

    def files(store, task, shown):
        rev = states[rounds[0]]
        return None if rev == shown else {"state": {"rev": rev}, "files": {}}

    def sleep(seconds):
        rounds[0] += 1
        if rounds[0] == 4:
            (job / "job.json").write_text(json.dumps({"state": "ended"}))

    monkeypatch.setattr(ferrus, "place_task_files", files)
    monkeypatch.setattr(ferrus, "place_task_view", lambda store, task: {})
    out = io.BytesIO()
    rounds[0] = 1
    ferrus.follow_place_task(Project(), "t-1", 0, 0, out, beat=1000.0,
                             clock=lambda: clock(rounds[0]), sleep=sleep)
    said = [json.loads(line) for line in out.getvalue().decode().splitlines()]
    return [("entry", item["entry"]["seq"]) if "entry" in item else
            ("state", item["task"]["state"]["rev"]) for item in said
            if "entry" in item or "task" in item]


def test_a_task_state_goes_to_the_orchestrator_after_the_entry_that_led_to_it(tmp_path,
                                                                               monkeypatch):
    """STATE.json is written before its journal line: a follower that read the journal
    just before the commit saw the new state first, the orchestrator kept the entry
    pending until the next beat, and a task merged before that beat lost its `approve`
    entry.  The state now waits for its entry."""
    order = follow_in_rounds(tmp_path, monkeypatch, journal={1: [1, 2], 2: [3], 3: [], 4: []},
                             states={1: 3, 2: 3, 3: 3, 4: 3}, clock=lambda round_: 0.0)
    assert order == [("entry", 1), ("entry", 2), ("entry", 3), ("state", 3)]


def test_a_state_whose_journal_line_never_comes_is_sent_after_a_while(tmp_path, monkeypatch):
    order = follow_in_rounds(tmp_path, monkeypatch, journal={1: [1, 2], 2: [], 3: [], 4: []},
                             states={1: 3, 2: 3, 3: 3, 4: 3},
                             clock=lambda round_: round_ * ferrus.PLACE_VIEW_WAIT_SECS)
    assert order == [("entry", 1), ("entry", 2), ("state", 3)]


def test_a_beat_from_the_place_carries_the_usage_its_sessions_reported(tmp_path):
    """The capacity gates here count a task at a place as one here: tool calls and
    sessions from what is mirrored, tokens and turns from the place's beats."""
    import io as _io
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.json").write_text(json.dumps({"state": "ended"}))
    place_store = ferrus.Store(str(tmp_path / "there"))
    sessions = tmp_path / "there" / ".ferrus" / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "other.json").write_text(json.dumps({
        "id": "other", "task_id": "t-2", "input_tokens": 99, "turns": 9}))
    for number, (tokens, turns) in enumerate([(1000, 2), (200, 1)]):
        (sessions / ("s-%d.json" % number)).write_text(json.dumps({
            "id": "s-%d" % number, "task_id": "t-1", "input_tokens": tokens,
            "output_tokens": 0, "turns": turns, "started_at": "2026-11-27T10:00:0%dZ" % number}))

    class Project:
        def store(self):
            return place_store

        def job(self, task):
            return str(job)

    out = _io.BytesIO()
    ferrus.follow_place_task(Project(), "t-1", 0, 0, out, sleep=lambda seconds: None)
    beats = [json.loads(line)["beat"] for line in out.getvalue().decode().splitlines()
             if "beat" in json.loads(line)]
    assert beats and beats[-1]["usage"] == {"tokens": 1200, "turns": 3}


def test_a_task_at_a_place_counts_its_usage_toward_the_runs_budget(tmp_path):
    store = place_project(tmp_path, ["true"])
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Far.\n\nAway.\n").data["task_id"]
    store.for_task(task).create_state(ferrus.StateData())
    far = ferrus.PlaceTask(store, task, None, lambda message: None, lambda *a, **k: None,
                           None, 60)
    assert far.signals().tokens_used == 0
    far._take({"beat": {"usage": {"tokens": 1200, "turns": 3}}})
    signals = far.signals()
    assert (signals.tokens_used, signals.turns) == (1200, 3)
    far.continue_after_checkpoint()           # the budget counts again from here
    far._take({"beat": {"usage": {"tokens": 1500, "turns": 4}}})
    assert (far.signals().tokens_used, far.signals().turns) == (300, 1)
    far._take({"beat": {"usage": {"tokens": -5, "turns": "many"}}})   # ignored
    assert far.signals().tokens_used == 300
