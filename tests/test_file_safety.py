"""Files ferrus writes: spec names stay short, session logs stay private (issue #11 item 6)."""

import os
import stat
import sys

import pytest

import ferrus

SUP = ferrus.Caller("supervisor", "supervisor:test:0")


def spec_files(project):
    folder = os.path.join(str(project), "docs", "specs")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_create_spec_with_a_very_long_title_gets_a_bounded_name(store, project):
    title = " ".join(["milestone"] * 40)        # 399 characters
    outcome = ferrus.op_create_spec(store, SUP, "# %s\n\n## M1: first\n- [ ] do it\n" % title)
    names = spec_files(project)
    assert len(names) == 1
    name = names[0]
    assert len(name.encode()) <= 100
    assert name.startswith("2026-05-13-milestone-milestone")
    assert not name[:-3].endswith("-")        # cut at a word boundary, no trailing dash
    assert outcome.data["path"] == "docs/specs/" + name
    with open(os.path.join(str(project), "docs", "specs", name)) as handle:
        assert title in handle.read()


def test_create_spec_long_titles_without_word_breaks_are_cut_too(store, project):
    ferrus.op_create_spec(store, SUP, "# %s\n" % ("x" * 300))
    ferrus.op_create_spec(store, SUP, "# %s\n" % ("x" * 300))
    names = spec_files(project)
    assert names == ["2026-05-13-%s-2.md" % ("x" * ferrus.SLUG_MAX_CHARS),
                     "2026-05-13-%s.md" % ("x" * ferrus.SLUG_MAX_CHARS)]


def test_a_failed_spec_write_leaves_no_empty_file(store, project, monkeypatch):
    def full_disk(path, data, durable=True):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ferrus, "atomic_write", full_disk)
    with pytest.raises(OSError):
        ferrus.op_create_spec(store, SUP, "# A spec\n")
    assert spec_files(project) == []


def test_slugify_keeps_short_titles_whole():
    assert ferrus.slugify("Add the thing: v2!") == "add-the-thing-v2"
    assert ferrus.slugify("???") == "spec"
    assert len(ferrus.slugify("ab-" * 100)) <= ferrus.SLUG_MAX_CHARS


def test_atomic_write_handles_a_name_near_the_limit(tmp_path):
    path = str(tmp_path / ("n" * 250))
    ferrus.atomic_write(path, "ok")
    with open(path) as handle:
        assert handle.read() == "ok"
    assert os.listdir(str(tmp_path)) == ["n" * 250]


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
def test_agent_session_log_is_created_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        log_path = str(tmp_path / "logs" / "executor_1.log")
        launch = ferrus.Launch([sys.executable, "-c", "print('transcript')"])
        process = ferrus.AgentProcess(launch, str(tmp_path), log_path, lambda line: [])
        process.proc.wait()
        process.finish()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(log_path).st_mode) == 0o600
    with open(log_path) as handle:
        assert "transcript" in handle.read()


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
def test_an_existing_world_readable_session_log_is_narrowed(tmp_path):
    path = str(tmp_path / "old.log")
    with open(path, "w") as handle:
        handle.write("before\n")
    os.chmod(path, 0o644)
    with ferrus.open_private_log(path) as handle:
        handle.write(b"after\n")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as handle:
        assert handle.read() == "before\nafter\n"


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
def test_pipeline_worker_log_is_created_owner_only(tmp_path):
    base = str(tmp_path / "worker")
    launch = ferrus.Launch([sys.executable, "-c", "print('worker transcript')"])
    proc = ferrus.start_worker_process(launch, str(tmp_path), base)
    proc.wait()
    assert stat.S_IMODE(os.stat(base + ".log").st_mode) == 0o600
