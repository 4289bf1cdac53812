"""`ferrus web` from the shell, and a board beside `ferrus run` (--web): the URL with its
token, loopback unless --host says otherwise (with a warning), clear errors for a port in
use or out of range, and .ferrus/web.json — the running board's address, never its
token — which [notify] reads to link a task's page, gone when the board stops."""

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

import ferrus
from conftest import FERRUS_CMD, scripted_project


def command(*args):
    return FERRUS_CMD + list(args)


def environment():
    env = dict(os.environ, NO_COLOR="1")
    env.pop("FERRUS_DEBUG", None)
    env.pop(ferrus.SESSION_ENV, None)
    return env


class Served:
    """A `ferrus web` process and the lines it printed so far."""

    def __init__(self, cwd, *args):
        self.proc = subprocess.Popen(command("web", *args), cwd=str(cwd), env=environment(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()
        self.seen = []

    def _read(self, stream):
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def line_with(self, words, timeout=30, start=""):
        deadline = time.monotonic() + timeout
        for line in self.seen:
            if words in line and line.startswith(start):
                return line
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            if words in line and line.startswith(start):
                return line
        raise AssertionError("no line with %r in %r (exit %s)" % (words, self.seen,
                                                                   self.proc.poll()))

    def url(self):
        return self.line_with("?token=", start="    http").strip()

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(20)
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()


def get(url, token, path="/api/tasks"):
    base = url.split("/?token=")[0]
    request = urllib.request.Request(base + path, headers={"Authorization": "Bearer " + token})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def test_ferrus_web_prints_its_url_serves_the_project_and_stops_cleanly(project):
    store = ferrus.Store(str(project))
    task = ferrus.op_enqueue_task(store, ferrus.HUMAN, "Served task").data["task_id"]
    served = Served(project, "--port", "0")
    try:
        url = served.url()
        assert url.startswith("http://127.0.0.1:") and "/?token=" in url
        assert served.line_with("ferrus web: serving") == "ferrus web: serving %s" % project
        token = url.split("?token=")[1]
        assert [t["title"] for t in get(url, token)["tasks"]] == ["Served task"]
        [record] = json.loads((project / ".ferrus" / "web.json").read_text())["boards"]
        assert record["url"] == url.split("/?token=")[0] and token not in json.dumps(record)
        assert record["pid"] == served.proc.pid
        assert ferrus.web_board_url(store, task) == "%s/task/%s" % (record["url"], task)
        assert ferrus.web_board_url(store) == record["url"] + "/"
    finally:
        code = served.stop()
    assert code == 128 + signal.SIGTERM
    assert not (project / ".ferrus" / "web.json").exists()
    assert ferrus.web_board_url(store, task) is None


def test_ctrl_c_stops_ferrus_web_with_exit_0(project):
    served = Served(project, "--port", "0")
    served.url()
    assert served.stop(signal.SIGINT) == 0
    assert not (project / ".ferrus" / "web.json").exists()


def test_listening_beyond_loopback_warns_and_suggests_the_ssh_tunnel(project):
    served = Served(project, "--host", "0.0.0.0", "--port", "0")
    try:
        assert "other machines can reach it" in served.line_with("ferrus: warning: the board")
        assert "plain HTTP" in served.line_with("without --tls-cert")
        assert "ssh -L 8765:127.0.0.1:8765" in served.line_with("hint:")
        url = served.url()
        assert url.startswith("http://%s:" % socket.gethostname())
        assert get(url, url.split("?token=")[1])["tasks"] == []     # loopback still answers
    finally:
        served.stop()


def test_a_port_in_use_is_said_with_what_to_do(project):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(command("web", "--port", str(port)), cwd=str(project),
                              env=environment(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "ferrus: cannot listen on 127.0.0.1 port %d:" % port in done.stderr
    assert "hint: --port 0 picks a free port" in done.stderr
    assert not (project / ".ferrus" / "web.json").exists()


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_out_of_range_is_a_usage_error(project, port):
    done = subprocess.run(command("web", "--port", port), cwd=str(project), env=environment(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "a port is a number from 0 to 65535" in done.stderr


def test_ferrus_web_outside_a_project_says_to_init_one(tmp_path):
    done = subprocess.run(command("web", "--port", "0"), cwd=str(tmp_path), env=environment(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "ferrus: no .ferrus/ directory" in done.stderr and "ferrus init" in done.stderr


def test_a_busy_web_port_beside_a_run_hints_its_own_option(project):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(command("run", "--task", "Busy port", "--web", "--web-port",
                                      str(port)), cwd=str(project), env=environment(),
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ferrus: cannot listen on 127.0.0.1 port %d:" % port in done.stderr
    assert "hint: --web-port 0 picks a free port; --web-host names" in done.stderr


def test_ferrus_run_web_serves_the_board_while_it_runs(project, tmp_path):
    scripted_project(project, tmp_path / "memory")
    env = dict(environment(), SCRIPTED_DIR=str(tmp_path / "memory"))
    done = subprocess.run(command("run", "--task", "Make work.txt", "--web", "--web-port", "0"),
                          cwd=str(project), env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert "ferrus web: the board is at http://127.0.0.1:" in done.stderr, done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert ferrus.Store(str(project)).read_state().state == ferrus.S.COMPLETE
    assert not (project / ".ferrus" / "web.json").exists()


def test_a_board_beside_a_run_says_where_it_is_and_closes(store):
    said = []
    board = ferrus.start_web_beside(store, "127.0.0.1", 0, said.append)
    try:
        assert said == ["ferrus web: the board is at %s" % board.url]
        assert ferrus.web_board_url(store) == board.base_url + "/"
    finally:
        board.close()
    assert ferrus.web_board_url(store) is None


def board_record(**entry):
    """web.json naming one board: this process's unless ``entry`` says otherwise."""
    entry = dict({"url": "http://127.0.0.1:8765", "pid": os.getpid(),
                  "start": ferrus.process_start(os.getpid())}, **entry)
    return json.dumps({"boards": [entry]})


@pytest.mark.parametrize("record", [
    "not json", "[]", '{"boards": 1}', board_record(pid="1"),
    board_record(url="javascript:alert(1)"), board_record(url="http://127.0.0.1:1/x?y"),
    board_record(pid=999999999),
    # The pid is alive but is another process now (its start time differs).
    board_record(start="not this process's start"),
])
def test_a_stale_or_odd_web_json_links_nothing(store, record):
    with open(store.path(ferrus.WEB_RECORD_FILE), "w") as handle:
        handle.write(record)
    assert ferrus.web_board_url(store, "t-20260101T000000-abcdef") is None


def test_a_task_id_in_a_link_is_quoted(store):
    with open(store.path(ferrus.WEB_RECORD_FILE), "w") as handle:
        handle.write(board_record())
    assert ferrus.web_board_url(store, "a b/../c") == "http://127.0.0.1:8765/task/a%20b%2F..%2Fc"


def test_each_board_keeps_its_own_entry_until_it_stops(store):
    first = ferrus.start_web_beside(store, "127.0.0.1", 0, lambda line: None)
    try:
        second = ferrus.start_web_beside(store, "127.0.0.1", 0, lambda line: None)
        boards = json.loads(open(store.path(ferrus.WEB_RECORD_FILE)).read())["boards"]
        assert [b["url"] for b in boards] == [first.base_url, second.base_url]
        second.close()
        assert ferrus.web_board_url(store) == first.base_url + "/"
    finally:
        first.close()
    assert ferrus.web_board_url(store) is None
    assert not os.path.exists(store.path(ferrus.WEB_RECORD_FILE))


def test_a_killed_boards_entry_is_dropped_when_another_board_starts(store):
    with open(store.path(ferrus.WEB_RECORD_FILE), "w") as handle:
        handle.write(board_record(url="http://127.0.0.1:1", start="a process gone by now"))
    board = ferrus.start_web_beside(store, "127.0.0.1", 0, lambda line: None)
    try:
        boards = json.loads(open(store.path(ferrus.WEB_RECORD_FILE)).read())["boards"]
        assert [b["url"] for b in boards] == [board.base_url]
    finally:
        board.close()


def test_hq_web_serves_the_board_while_hq_runs(project):
    done = subprocess.run(command("hq", "--no-tui", "--web", "--web-port", "0"),
                          cwd=str(project), env=environment(), capture_output=True, text=True,
                          timeout=120, input="/quit\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ferrus web: the board is at http://127.0.0.1:" in done.stdout + done.stderr
    assert not (project / ".ferrus" / "web.json").exists()
