"""The team's remote in a parallel run ([git] fetch, push, publish, pr): tasks start
from and merge onto what the team pushed, a merge is pushed (a refused push stops the
queue's integrations), a task's branch is published with a pull request through a
forge CLI — with a bare repository as origin, real git and scripted agents."""

import os
import shutil
import stat

import pytest

import ferrus
from conftest import (committed, enqueue, git, run_cli, run_tasks as run, scripted_setup as setup,
                      statuses)

pytestmark = [pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
              pytest.mark.skipif(os.name == "nt",
                                 reason="POSIX shell scripts as the remote's hook and the forge's CLI")]


@pytest.fixture
def repo(git_project):
    """The git repository with ferrus set up (conftest's git_project)."""
    return git_project


def with_origin(repo, tmp_path):
    """A bare repository as the checkout's origin, main pushed and tracked, and a second
    clone of it (a teammate's)."""
    origin = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(origin))
    git(repo, "remote", "add", "origin", str(origin))
    git(repo, "push", "-q", "-u", "origin", "main")
    teammate = tmp_path / "teammate"
    git(tmp_path, "clone", "-q", str(origin), str(teammate))
    return origin, teammate


def remote_config(**git_keys):
    return "[git]\n%s\n\n" % "\n".join('%s = %s' % (key, value if isinstance(value, str)
                                                      and value in ("true", "false")
                                                      else '"%s"' % value)
                                       for key, value in git_keys.items())


def configured(repo, tmp_path, checks=("test -f README.md",), **git_keys):
    store = setup(repo, list(checks), remote_config(**git_keys))
    origin, teammate = with_origin(repo, tmp_path)
    return store, origin, teammate


def log_of(root, rev):
    return git(root, "log", "--format=%s", rev).stdout.splitlines()


# -- fetch and push: onto what the team has ----------------------------------------------

TEAMMATE_PUSHES = """Alpha, while a teammate pushes.

WRITE alpha.txt: alpha
SHELL cd "{teammate}" && echo team > team.txt && git add team.txt && git -c user.name=m -c user.email=m@e commit -qm "teammate's commit" && git push -q origin main
"""


def test_a_teammates_push_mid_run_is_fetched_the_merge_lands_on_top_and_is_pushed(
        repo, tmp_path):
    store, origin, teammate = configured(repo, tmp_path, fetch="true", push="origin")
    first = enqueue(store, TEAMMATE_PUSHES.format(teammate=teammate))
    second = enqueue(store, "Beta.\n\nWRITE beta.txt: beta\n")
    code, lines = run(store, 1)
    text = "\n".join(lines)
    assert code == ferrus.RUN_COMPLETE, text
    assert statuses(store) == {first: "merged", second: "merged"}
    # The teammate's commit is under both merges, locally and on origin (pushed, no force).
    assert log_of(origin, "main") == log_of(repo, "main")
    assert {"alpha.txt", "beta.txt", "team.txt"} <= set(committed(repo))
    team = git(repo, "rev-parse", "main~2").stdout.strip()
    assert log_of(repo, team)[0] == "teammate's commit"
    # The second task started from the teammate's commit (fetched before it was prepared).
    base = ferrus.read_task_record(store.dir, second)["base"]
    assert git(repo, "merge-base", "--is-ancestor", team, base, check=False).returncode == 0
    assert "moved on upstream" in text and "pushed" in text
    for task in (first, second):
        assert ferrus.read_task_record(store.dir, task)["push"]["status"] == "pushed"


def test_a_refused_push_stops_the_integrations_with_the_reason(repo, tmp_path):
    store, origin, _ = configured(repo, tmp_path, push="origin")
    hook = origin / "hooks" / "pre-receive"
    hook.write_text("#!/bin/sh\necho 'main is protected here' >&2\nexit 1\n")
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    first = enqueue(store, "Alpha.\n\nWRITE alpha.txt: alpha\n")
    second = enqueue(store, "Beta.\n\nWRITE beta.txt: beta\n")
    code, lines = run(store, 2)
    text = "\n".join(lines)
    assert code == ferrus.RUN_FAILED, text
    assert "rejected" in text and "main is protected here" in text
    # The hook refused it and origin did not move: no pull --rebase, the fix is there.
    stopped = text[text.index("stopped: "):]
    assert "git pull --rebase" not in stopped and "origin refused it itself" in stopped
    # Nothing starts integrating after the stop.
    assert "integrating task" not in stopped, stopped
    # Merged here and recorded as not pushed; nothing more merged; origin as it was.
    # (With two at a time either may be merged first.)
    merged, left = sorted((first, second), key=lambda task: statuses(store)[task] != "merged")
    record = ferrus.read_task_record(store.dir, merged)
    assert record["status"] == "merged" and record["push"]["status"] == "rejected"
    assert "main is protected here" in record["push"]["reason"]
    assert ferrus.read_task_record(store.dir, left)["status"] == "running"
    assert len({"alpha.txt", "beta.txt"} & set(committed(repo))) == 1
    assert log_of(origin, "main") == ["start"]
    assert any(e["event"] == "push_rejected" for e in store.read_journal())
    # The views say the task left at work waits for the next run.
    for view in ("status", "tasks"):
        out = run_cli(view, cwd=repo).stdout
        assert "no run works the queue now: %s (" % ferrus.short_task_id(left) in \
            out.replace("No run", "no run"), out


def test_a_refused_push_s_hint_fits_what_git_said():
    hook = ferrus.push_refused_hint(
        " ! [remote rejected] abc -> main (pre-receive hook declined)", "origin", "main")
    assert "pull --rebase" not in hook and "origin refused it itself" in hook
    moved = ferrus.push_refused_hint(
        " ! [rejected]        abc -> main (fetch first)", "origin", "main")
    assert "`git pull --rebase origin main`, then `git push origin main`" in moved
    unreachable = ferrus.push_refused_hint("fatal: Could not read from remote repository.",
                                           "origin", "main")
    assert "pull --rebase" not in unreachable and "can be reached" in unreachable


def test_a_missing_remote_is_an_error_before_any_agent_starts(repo):
    store = setup(repo, ["true"], remote_config(push="upstream"))
    enqueue(store, "Alpha.\n\nWRITE alpha.txt: alpha\n")
    with pytest.raises(ferrus.FerrusError) as err:
        run(store, 1)
    assert "there is no git remote upstream" in err.value.message
    assert not os.listdir(os.environ["SCRIPTED_DIR"])      # no agent ran


def test_a_target_and_upstream_that_diverged_stop_the_run(repo, tmp_path):
    store, origin, teammate = configured(repo, tmp_path, fetch="true")
    (teammate / "team.txt").write_text("team\n")
    git(teammate, "add", "team.txt")
    git(teammate, "-c", "user.name=m", "-c", "user.email=m@e", "commit", "-qm", "theirs")
    git(teammate, "push", "-q", "origin", "main")
    (repo / "mine.txt").write_text("mine\n")
    git(repo, "add", "mine.txt")
    git(repo, "commit", "-qm", "mine")
    enqueue(store, "Alpha.\n\nWRITE alpha.txt: alpha\n")
    with pytest.raises(ferrus.FerrusError) as err:
        run(store, 1)
    assert "have diverged" in err.value.message and "never rewrites history" in \
        err.value.hint


# -- publish = "branch": a pull request through the forge's CLI ----------------------------

FAKE_GH = """#!/bin/sh
printf '%s\\n' "$@" >> "{record}"
printf -- '--\\n' >> "{record}"
if [ "$1" = pr ]; then echo "https://example.test/team/project/pull/7"; fi
exit 0
"""


def fake_cli(tmp_path, monkeypatch, name="gh"):
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    record = tmp_path / ("%s-argv" % name)
    script = folder / name
    script.write_text(FAKE_GH.format(record=record))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder) + os.pathsep + os.environ["PATH"])
    return record


def test_a_published_branch_gets_a_pull_request_and_the_target_stays(repo, tmp_path,
                                                                    monkeypatch):
    record = fake_cli(tmp_path, monkeypatch)
    store, origin, _ = configured(repo, tmp_path, push="origin", publish="branch", pr="gh")
    task = enqueue(store, "Add alpha.\n\nWRITE alpha.txt: alpha\n")
    code, lines = run(store, 1)
    assert code == ferrus.RUN_COMPLETE, "\n".join(lines)
    row = ferrus.read_task_record(store.dir, task)
    branch = ferrus.TASK_BRANCH_PREFIX + task
    assert row["status"] == "published"
    assert row["published"]["branch"] == branch and row["published"]["remote"] == "origin"
    assert row["published"]["pull_request"] == "https://example.test/team/project/pull/7"
    # The branch is on origin with the work; main moved nowhere.
    assert "alpha.txt" in committed(origin, branch)
    assert log_of(origin, "main") == ["start"] and "alpha.txt" not in committed(repo)
    calls = record.read_text().split("--\n")
    assert calls[0].split() == ["auth", "status"]            # before any agent started
    argv = calls[1].splitlines()
    assert argv[:2] == ["pr", "create"]
    assert argv[argv.index("--base") + 1] == "main" and argv[argv.index("--head") + 1] == \
        branch
    assert argv[argv.index("--title") + 1] == "Add alpha."
    body = argv[argv.index("--body") + 1:]
    assert "## Review" in body and "## Merge gate" in body and "- `test -f README.md`" in body
    diff = ferrus.op_task_diff(store, task).text
    assert "published as origin's branch %s" % branch in diff and "+alpha" in diff


def test_a_missing_pull_request_cli_is_an_error_before_any_agent_starts(repo, tmp_path,
                                                                       monkeypatch):
    folder = tmp_path / "empty-bin"
    folder.mkdir()
    git_bin = os.path.dirname(shutil.which("git"))
    monkeypatch.setenv("PATH", os.pathsep.join([str(folder), git_bin]))
    store, _, _ = configured(repo, tmp_path, push="origin", publish="branch", pr="glab")
    enqueue(store, "Alpha.\n\nWRITE alpha.txt: alpha\n")
    if shutil.which("glab"):
        pytest.skip("glab is installed in git's folder")
    with pytest.raises(ferrus.FerrusError) as err:
        run(store, 1)
    assert "`glab` is not on PATH" in err.value.message and "glab auth login" in \
        err.value.hint
    assert not os.listdir(os.environ["SCRIPTED_DIR"])


@pytest.mark.parametrize("table,expected", [
    ('publish = "branch"', "needs [git] push"),
    ('push = "origin"\npr = "gh"', 'needs publish = "branch"'),
    ('push = "origin"\npublish = "branch"\npr = "hub"', "must be one of"),
    ('push = "--force"', "must be the name of a git remote"),
    ("fetch = 1", "must be true or false"),
])
def test_bad_remote_settings_are_refused(table, expected):
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.parse_config("[git]\n%s\n" % table)
    assert expected in err.value.message, err.value.message
