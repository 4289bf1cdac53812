"""Check logs are capped on disk, keeping the head and the tail (issue #11 item 3)."""

import os
import re

import pytest

import ferrus
from conftest import run_cli, set_config


def checks(*commands, max_log_bytes=8 * 1024 * 1024, timeout=600, parallel=False):
    return ferrus.ChecksConfig(commands=list(commands), timeout_secs=timeout, parallel=parallel,
                               max_log_bytes=max_log_bytes)


def run(root, config, keep_lines=30):
    return ferrus.run_checks(str(root), config, os.path.join(str(root), ".ferrus", "logs"),
                             keep_lines=keep_lines)


def read_bytes(path):
    with open(path, "rb") as handle:
        return handle.read()


def numbered_lines(count):
    """A command printing "line 000001" … one per line (12 bytes each)."""
    return "i=1; while [ $i -le %d ]; do printf 'line %%06d\\n' $i; i=$((i+1)); done" % count


def test_small_output_is_logged_whole(project):
    (result,) = run(project, checks("echo hello", max_log_bytes=4096)).results
    data = read_bytes(result.log_path_abs)
    assert b"hello\n" in data and b"bytes cut" not in data
    assert result.log_cut_bytes == 0
    assert not [n for n in os.listdir(os.path.dirname(result.log_path_abs)) if ".tail" in n]


def test_big_output_keeps_head_and_tail_with_a_marker(project):
    budget = 16 * 1024
    (result,) = run(project, checks(numbered_lines(20000), max_log_bytes=budget)).results
    assert result.passed
    data = read_bytes(result.log_path_abs)
    text = data.decode()
    # Header and first lines (the head) are there, then the marker, then the last lines.
    assert text.startswith("$ i=1;")
    assert "line 000001\n" in text
    match = re.search(r"\n\[\u2026 (\d+) bytes cut \u2026\]\n", text)
    assert match, text[budget // 2 - 200: budget // 2 + 200]
    cut = int(match.group(1))
    assert cut == result.log_cut_bytes
    head, tail = text[:match.start()], text[match.end():]
    assert "line 020000\n" in tail
    # Nothing is lost except what the marker counts.
    output_bytes = len("$ %s\n" % result.command) + 20000 * 12
    kept = len(head.encode()) + len(tail.encode()) - len(tail.rsplit("\n[passed", 1)[1]) - 8
    assert cut + kept == output_bytes
    assert len(data) <= budget + 200
    # The tail is contiguous: its line numbers run without a gap to the end.
    numbers = [int(n) for n in re.findall(r"line (\d{6})\n", tail)]
    assert numbers == list(range(numbers[0], 20001))
    assert len(tail.encode()) >= budget // 4
    # The segments are gone and the report names the cut.
    assert not [n for n in os.listdir(os.path.dirname(result.log_path_abs)) if ".tail" in n]


def test_report_and_summary_say_the_log_was_cut(project):
    run_result = run(project, checks(numbered_lines(5000) + "; exit 3", max_log_bytes=4096))
    report = run_result.report(5)
    assert "bytes cut from the middle" in report
    summary = read_bytes(os.path.join(str(project), run_result.log_path)).decode()
    assert "bytes cut from the middle" in summary


def test_a_check_printing_forever_stays_within_the_budget_until_its_timeout(project):
    budget = 64 * 1024
    config = checks("yes 'printing forever'", max_log_bytes=budget, timeout=1)
    (result,) = run(project, config).results
    assert result.status == "timed out"
    assert result.log_cut_bytes > 0
    assert os.path.getsize(result.log_path_abs) <= budget + 200


def test_capped_log_never_holds_more_than_the_budget_on_disk(tmp_path):
    path = str(tmp_path / "out.log")
    log = ferrus.CappedLog(path, 4096)
    for index in range(1000):
        log.write(b"%07d\n" % index)
        on_disk = sum(os.path.getsize(str(tmp_path / n)) for n in os.listdir(str(tmp_path)))
        log.handle.flush()
        for segment in log.segments:
            segment[1].flush()
        assert on_disk <= 4096
    log.close(b"[end]\n")
    assert os.listdir(str(tmp_path)) == ["out.log"]
    data = read_bytes(path)
    assert data.startswith(b"0000000\n") and data.endswith(b"0000999\n[end]\n")
    assert len(data) <= 4096 + 40


def test_a_full_disk_stops_the_log_but_not_the_check(tmp_path):
    class FullDisk:
        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    log = ferrus.CappedLog(str(tmp_path / "out.log"), 4096)
    log.handle.close()
    log.handle = FullDisk()
    log.write(b"some output\n")
    log.write(b"more output\n")
    assert log.total == 24
    log.close(b"trailer")
    assert "No space left on device" in log.error


def test_max_log_bytes_is_validated(project):
    set_config(project, "[checks]\nmax_log_bytes = 12\n")
    result = run_cli("check", "--force", cwd=project)
    assert result.returncode == 1
    assert "[checks.max_log_bytes] must be between 4096 and" in result.stderr
    set_config(project, "[checks]\nmax_log_bytes = \"8M\"\n")
    result = run_cli("check", "--force", cwd=project)
    assert "must be an integer" in result.stderr
    config = ferrus.parse_config("[checks]\nmax_log_bytes = 65536\n")
    assert config.checks.max_log_bytes == 65536
    assert ferrus.parse_config("").checks.max_log_bytes == 8 * 1024 * 1024


def test_cli_check_uses_the_configured_cap(project):
    set_config(project, "[checks]\ncommands = [%r]\nmax_log_bytes = 8192\n"
               % numbered_lines(3000).replace("'", "\\'"))
    result = run_cli("check", "--force", cwd=project)
    assert result.returncode == 0, result.stderr
    logs = [n for n in os.listdir(str(project / ".ferrus" / "logs")) if n.endswith(".log")]
    (name,) = logs
    assert os.path.getsize(str(project / ".ferrus" / "logs" / name)) <= 8192 + 200
