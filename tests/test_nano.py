"""nano, the built-in agent: its settings, its chat-completions client, its file tools
confined to the working folder, its MCP client, and its agent loop (repairs, budgets,
context trimming, what it prints, how it ends when it cannot start).  The model is
tests/fake_models.py's scripted
chat-completions server; the loop tests use nano's own file tools only (the end-to-end
tests in test_e2e_nano.py add ferrus's server)."""

import contextlib
import io
import json
import os
import re
import socket
import threading
import time

import pytest

import ferrus
from conftest import set_config
from fake_models import FakeModels, call, raw_call, say


# -- settings ------------------------------------------------------------------------------

def test_settings_take_valid_values_and_name_each_bad_one():
    settings, problems = ferrus.nano_setting_problems({
        "base_url": "http://127.0.0.1:8080/v1", "model": " qwen ", "temperature": 0,
        "max_tool_calls": 0, "allow_remote": "yes", "context_tokens": 8192})
    assert settings.base_url == "http://127.0.0.1:8080/v1" and settings.model == "qwen"
    assert settings.temperature == 0.0 and settings.context_tokens == 8192
    messages = [p.message for p in problems]
    assert any("max_tool_calls must be a whole number from 1" in m and "got 0" in m
               for m in messages)
    assert any("allow_remote must be true or false" in m for m in messages)
    assert settings.max_tool_calls == ferrus.NanoSettings.max_tool_calls   # the default stays


def test_an_unknown_setting_suggests_the_one_meant():
    _settings, problems = ferrus.nano_setting_problems({"max_tool_call": 5})
    assert problems[0].message.endswith("has no setting max_tool_call")
    assert problems[0].hint == "did you mean max_tool_calls?"


def test_the_answer_must_leave_room_in_the_context():
    settings, problems = ferrus.nano_setting_problems({"context_tokens": 4096,
                                                       "max_tokens": 4096})
    assert "max_tokens must be below context_tokens (4096)" in problems[0].message
    assert settings.max_tokens < settings.context_tokens


@pytest.mark.parametrize("url", ["http://127.0.0.1:11434/v1", "http://localhost:8080/v1/",
                                 "http://[::1]:8000/v1", "http://127.0.0.2/v1"])
def test_loopback_endpoints_need_no_permission(url):
    endpoint = ferrus.nano_endpoint(ferrus.NanoSettings(base_url=url))
    assert endpoint.loopback and endpoint.path == "/v1"


def test_a_remote_endpoint_needs_allow_remote():
    settings = ferrus.NanoSettings(base_url="https://models.example.com/v1")
    with pytest.raises(ferrus.FerrusError) as refused:
        ferrus.nano_endpoint(settings)
    assert "is not on this machine" in refused.value.message
    assert "allow_remote = true" in refused.value.hint
    settings.allow_remote = True
    endpoint = ferrus.nano_endpoint(settings)
    assert (endpoint.scheme, endpoint.port, endpoint.loopback) == ("https", 443, False)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/v1", "http://user:pw@127.0.0.1/v1",
                                 "127.0.0.1:8080", "http://127.0.0.1:99999/v1"])
def test_a_malformed_base_url_is_refused(url):
    with pytest.raises(ferrus.FerrusError):
        ferrus.nano_endpoint(ferrus.NanoSettings(base_url=url))


def test_a_missing_key_variable_is_named():
    settings = ferrus.NanoSettings(api_key_env="LOCAL_KEY")
    with pytest.raises(ferrus.FerrusError) as missing:
        ferrus.nano_api_key(settings, environ={})
    assert "names LOCAL_KEY, which is not set" in missing.value.message
    assert ferrus.nano_api_key(settings, environ={"LOCAL_KEY": " k "}) == "k"
    assert ferrus.nano_api_key(ferrus.NanoSettings(), environ={}) is None


# -- the stream ---------------------------------------------------------------------------

def chunk(delta=None, finish=None, **extra):
    body = dict({"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]},
                **extra)
    return ("data: %s\n" % json.dumps(body)).encode()


def test_a_stream_folds_into_text_tool_calls_and_usage():
    lines = [b": keep-alive\n", chunk({"role": "assistant", "content": "Let me "}),
             chunk({"content": "look."}),
             chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                    "function": {"name": "read_file", "arguments": ""}}]}),
             chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"path": '}}]}),
             chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"a.py"}'}}]}),
             chunk({"tool_calls": [{"index": 1, "id": "c2", "function": {
                 "name": "grep_search", "arguments": {"pattern": "x"}}}]}),
             chunk(finish="tool_calls"),
             ("data: %s\n" % json.dumps({"choices": [], "usage": {
                 "prompt_tokens": 120, "completion_tokens": 30}})).encode(),
             b"data: [DONE]\n", b"\n"]
    turn = ferrus.fold_chat_stream(lines)
    assert turn.text == "Let me look." and turn.finish_reason == "tool_calls"
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("c1", "read_file", {"path": "a.py"}), ("c2", "grep_search", {"pattern": "x"})]
    assert (turn.prompt_tokens, turn.completion_tokens) == (120, 30)


def test_an_error_in_the_stream_is_the_servers_message():
    with pytest.raises(ferrus.NanoModelError) as failed:
        ferrus.fold_chat_stream([b'data: {"error": {"message": "model crashed"}}\n'])
    assert "model crashed" in failed.value.message


def test_a_stream_cut_off_before_its_end_is_a_server_failure_not_an_answer():
    for cut in ([chunk({"content": "Half a sent"})],
                [chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {
                    "name": "write_file", "arguments": {"path": "b.txt", "content": "x"}}}]})]):
        with pytest.raises(ferrus.NanoModelError) as failed:
            ferrus.fold_chat_stream(cut)
        assert "broke off before its end (no finish_reason, no [DONE])" in \
            failed.value.message and "not the model" in failed.value.message
        assert failed.value.retryable
    # Either end marker alone is a whole answer.
    assert ferrus.fold_chat_stream([chunk({"content": "a"}), b"data: [DONE]\n"]).text == "a"
    assert ferrus.fold_chat_stream([chunk({"content": "b"}, finish="stop")]).text == "b"


def test_a_stream_line_over_the_limit_is_named_as_too_long():
    settings = ferrus.NanoSettings()
    client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "m", settings)
    long_line = b"data: " + b"x" * ferrus.NANO_MAX_LINE_BYTES + b"\n"
    with pytest.raises(ferrus.NanoModelError) as failed:
        list(client._bounded_lines(io.BytesIO(long_line)))
    assert "a line longer than the limit of 1 MB (NANO_MAX_LINE_BYTES)" in \
        failed.value.message and "not JSON" not in failed.value.message


class RawModelServer:
    """A model server that answers each POST with the next of ``answers``: bytes sent
    as they are, then the connection closed; ``PINGS`` sends an SSE ping comment every
    few milliseconds until the client goes away."""

    PINGS = object()

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.url = "http://127.0.0.1:%d/v1" % self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _address = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection):
        with connection, contextlib.suppress(OSError):
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            while len(body) < length:
                body += connection.recv(65536)
            answer = self.answers[min(self.requests, len(self.answers) - 1)]
            self.requests += 1
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                               b"Connection: close\r\n\r\n")
            if answer is self.PINGS:
                while True:
                    connection.sendall(b": ping\n\n")
                    time.sleep(0.01)
            connection.sendall(answer)

    def close(self):
        self.listener.close()


class Ticking:
    """A clock that moves one second each time it is read."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def test_a_reply_that_never_ends_is_stopped_by_the_request_timeout():
    server = RawModelServer([RawModelServer.PINGS])
    settings = ferrus.NanoSettings(base_url=server.url, request_timeout_secs=5)
    client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "m", settings,
                                          clock=Ticking(), retries=0)
    try:
        with pytest.raises(ferrus.NanoModelError) as failed:
            client.complete([{"role": "user", "content": "x"}], [])
    finally:
        client.close()
        server.close()
    assert "did not answer within 5 s" in failed.value.message
    assert "request_timeout_secs" in failed.value.hint


def test_the_session_budget_holds_while_an_answer_is_in_flight(workdir):
    server = RawModelServer([RawModelServer.PINGS])
    clock = Ticking()
    settings = ferrus.NanoSettings(base_url=server.url, max_session_secs=8)
    client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "m", settings,
                                          clock=clock, sleep=lambda seconds: None)
    agent = ferrus.NanoAgent(client, ferrus.NanoToolbox(ferrus.NanoFileTools(
        str(workdir), "edit")), settings, ferrus.NanoStreamOutput(io.StringIO(), "s", "m"),
        clock=clock, workdir=str(workdir))
    try:
        outcome = agent.run("Create b.txt holding hi.")
    finally:
        client.close()
        server.close()
    assert outcome.exit_code == 1 and "its budget is 8 s ([agents.nano] max_session_secs)" \
        in outcome.text
    assert server.requests == 1


def sse(*chunks):
    return b"".join(chunks)


def test_an_answer_cut_off_mid_stream_is_retried_and_never_executed(workdir):
    whole_call = chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {
        "name": "write_file", "arguments": {"path": "b.txt", "content": "cut\n"}}}]})
    half_call = chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {
        "name": "write_file", "arguments": '{"path": "b.txt", "cont'}}]})
    stop = sse(chunk({"content": "Done."}, finish="stop"), b"data: [DONE]\n\n")
    for cuts in ([whole_call], [half_call], [chunk({"content": "Half a sent"})]):
        server = RawModelServer(cuts * 3)
        settings = ferrus.NanoSettings(base_url=server.url)
        client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "m", settings,
                                              sleep=lambda seconds: None)
        out = io.StringIO()
        agent = ferrus.NanoAgent(client, ferrus.NanoToolbox(ferrus.NanoFileTools(
            str(workdir), "edit")), settings, ferrus.NanoStreamOutput(out, "s", "m"),
            clock=Clock(), workdir=str(workdir))
        try:
            outcome = agent.run("Create b.txt holding hi.")
        finally:
            client.close()
            server.close()
        assert outcome.exit_code == 1 and "broke off before its end" in outcome.text
        assert "malformed" not in out.getvalue() and not (workdir / "b.txt").exists()
        assert server.requests == 3                       # tried, then retried twice
    server = RawModelServer([whole_call, stop])           # once cut, then whole
    settings = ferrus.NanoSettings(base_url=server.url)
    client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "m", settings,
                                          sleep=lambda seconds: None)
    try:
        assert client.complete([{"role": "user", "content": "x"}], []).text == "Done."
    finally:
        client.close()
        server.close()


# -- the file tools -----------------------------------------------------------------------

@pytest.fixture
def workdir(tmp_path):
    root = tmp_path / "work"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("one\ntwo\nthree\n")
    (root / ".ferrus").mkdir()
    (root / ".ferrus" / "STATE.json").write_text("{}")
    (root / ".git").write_text("gitdir: elsewhere\n")
    (tmp_path / "secret.txt").write_text("outside")
    return root


def test_paths_outside_the_working_folder_are_refused(workdir, tmp_path):
    tools = ferrus.NanoFileTools(str(workdir), "full")
    os.symlink(str(tmp_path / "secret.txt"), str(workdir / "link.txt"))
    for path in ("../secret.txt", str(tmp_path / "secret.txt"), "link.txt"):
        ok, text = tools.call("read_file", {"path": path})
        assert not ok and "outside the working folder" in text, (path, text)
    ok, text = tools.call("write_file", {"path": "../x.txt", "content": "x"})
    assert not ok and not (tmp_path / "x.txt").exists()
    for path in (".ferrus/STATE.json", ".git", "src/../.ferrus/STATE.json"):
        ok, text = tools.call("read_file", {"path": path})
        assert not ok and "ferrus's or git's own" in text
    ok, text = tools.call("list_directory", {"path": "."})
    assert ok and text.split("\n") == ["link.txt", "src/"]


def test_read_gives_a_line_range_and_says_what_it_left_out(workdir):
    tools = ferrus.NanoFileTools(str(workdir), "read-only")
    assert tools.call("read_file", {"path": "src/a.py", "start_line": 2, "end_line": 2}) == (
        True, "src/a.py: lines 2-2 of 3\ntwo\n")
    ok, text = tools.call("read_file", {"path": "src/a.py", "start_line": 9})
    assert ok and "it has 3 lines, none from line 9" in text
    (workdir / "blob.bin").write_bytes(b"\0\1\2")
    assert tools.call("read_file", {"path": "blob.bin"}) == (
        False, "blob.bin is a binary file (3 bytes)")
    ok, text = tools.call("read_file", {"path": "src/a.py", "start_line": "x"})
    assert not ok and "start_line must be a whole number" in text


def test_search_finds_lines_by_regular_expression(workdir):
    tools = ferrus.NanoFileTools(str(workdir), "read-only")
    assert tools.call("grep_search", {"pattern": "t(wo|hree)", "include": "*.py"}) == (
        True, "src/a.py:2: two\nsrc/a.py:3: three")
    assert tools.call("grep_search", {"pattern": "STATE|{}"})[1] == "no match in 1 file(s)"
    ok, text = tools.call("grep_search", {"pattern": "("})
    assert not ok and "not a valid regular expression" in text


class HeartbeatServer:
    name = "ferrus"

    def __init__(self):
        self.beats = 0

    def call_tool(self, name, arguments, timeout):
        self.beats += 1
        return False, "ok"


def test_heartbeats_stop_when_the_sessions_budget_is_spent(workdir):
    server, clock = HeartbeatServer(), Clock()
    toolbox = ferrus.NanoToolbox(ferrus.NanoFileTools(str(workdir), "edit"))
    toolbox.tools["heartbeat"] = ferrus.NanoTool("heartbeat", "mcp__ferrus__heartbeat", {},
                                                 server, "heartbeat")
    heartbeat = ferrus.NanoHeartbeat(toolbox, 30, budget_secs=1800, clock=clock)
    clock.now += 1799
    assert heartbeat.beat() and server.beats == 1
    clock.now += 1
    assert not heartbeat.beat() and server.beats == 1


def test_a_path_no_file_can_have_is_an_error_for_the_model(workdir):
    tools = ferrus.NanoFileTools(str(workdir), "edit")
    for name, args in (("write_file", {"path": "a\u0000b", "content": "x"}),
                       ("read_file", {"path": "src/\u0000"}),
                       ("grep_search", {"pattern": "x", "path": "\u0000"})):
        ok, text = tools.call(name, args)
        assert not ok and "null byte" in text, (name, text)


def test_search_names_the_files_too_large_to_search(workdir, monkeypatch):
    (workdir / "big.log").write_text("two\n" * 20)
    monkeypatch.setattr(ferrus, "NANO_SEARCH_FILE_BYTES", 40)
    tools = ferrus.NanoFileTools(str(workdir), "read-only")
    ok, text = tools.call("grep_search", {"pattern": "two"})
    assert ok and text.split("\n") == ["src/a.py:2: two", "not searched (over 40 bytes; "
                                       "read_file reads them by line range): big.log"]


def test_edits_are_exact_and_unique(workdir):
    tools = ferrus.NanoFileTools(str(workdir), "edit")
    assert tools.call("write_file", {"path": "new/b.txt", "content": "x\ny\n"}) == (
        True, "created new/b.txt (2 lines)")
    ok, text = tools.call("replace", {"path": "src/a.py", "old_string": "four",
                                      "new_string": "4"})
    assert not ok and "was not found" in text
    (workdir / "twice.txt").write_text("a\na\n")
    ok, text = tools.call("replace", {"path": "twice.txt", "old_string": "a",
                                      "new_string": "b"})
    assert not ok and "occurs 2 times" in text
    assert tools.call("replace", {"path": "twice.txt", "old_string": "a", "new_string": "b",
                                  "replace_all": True})[0]
    assert (workdir / "twice.txt").read_text() == "b\nb\n"
    (workdir / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    assert tools.call("replace", {"path": "crlf.txt", "old_string": "one\ntwo",
                                  "new_string": "1\n2"})[0]
    assert (workdir / "crlf.txt").read_bytes() == b"1\r\n2\r\n"


def test_each_profile_gives_its_own_tools(workdir):
    assert ferrus.nano_file_tool_names("read-only") == ["list_directory", "read_file",
                                                        "grep_search"]
    assert "write_file" in ferrus.nano_file_tool_names("edit")
    assert "run_shell_command" not in ferrus.nano_file_tool_names("edit")
    tools = ferrus.NanoFileTools(str(workdir), "read-only")
    assert tools.call("write_file", {"path": "x", "content": ""}) == (False,
                                                                      "no tool write_file here")


def test_a_worker_writes_only_its_output_file(workdir, tmp_path):
    output = tmp_path / "out" / "result.md"
    given = tmp_path / "secret.txt"
    tools = ferrus.NanoFileTools(str(workdir), "output", output=str(output), reads=[str(given)])
    assert not tools.call("write_file", {"path": "src/a.py", "content": "x"})[0]
    assert tools.call("write_file", {"path": str(output), "content": "done"})[0]
    assert output.read_text() == "done"
    assert tools.call("read_file", {"path": str(given)})[1].endswith("outside")


@pytest.mark.skipif(os.name == "nt", reason="POSIX shell commands")
def test_a_shell_command_has_a_timeout_and_bounded_output(workdir):
    tools = ferrus.NanoFileTools(str(workdir), "full", command_timeout_secs=1, result_chars=2000)
    ok, text = tools.call("run_shell_command", {"command": "echo hi; exit 3"})
    assert (ok, text) == (False, "exit 3\nhi\n")
    ok, text = tools.call("run_shell_command", {"command": "sleep 30", "timeout_secs": 60})
    assert not ok and text.startswith("timed out after 1 s (stopped)")
    ok, text = tools.call("run_shell_command", {"command": "yes line | head -n 100000"})
    assert ok and "bytes cut" in text and len(text) < 2200


# -- the MCP client against a real `ferrus serve` -----------------------------------------

def test_the_mcp_client_gets_the_roles_tools_and_calls_them(project):
    entry = ferrus.ferrus_server_entry(str(project), "supervisor", "nano")
    env = {k: v for k, v in os.environ.items() if k != ferrus.SESSION_ENV}
    client = ferrus.NanoMcpClient("ferrus-supervisor-1", entry, str(project), env)
    try:
        client.initialize()
        names = {tool["name"] for tool in client.list_tools()}
        assert {"wait_for_review", "approve", "reject"} <= names
        assert not names & {"submit", "check", "wait_for_task"}
        is_error, text = client.call_tool("status", {}, 30)
        assert not is_error and "Idle" in text
        resources, _templates = client.list_resources()
        assert any(r.get("uri") == "ferrus://task" for r in resources)
        with pytest.raises(ferrus.FerrusError):
            client.request("no/such/method")
    finally:
        client.close()


# -- the agent loop -----------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def run_agent(workdir, script, profile="edit", clock=None, **settings):
    """Run a NanoAgent on ``script``'s model with nano's file tools; (outcome, events
    printed, fake server)."""
    out = io.StringIO()
    with FakeModels(script) as fake:
        config = ferrus.NanoSettings(base_url=fake.url + "/v1", model="m", **settings)
        client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(config), "m", config,
                                              sleep=lambda seconds: None)
        toolbox = ferrus.NanoToolbox(ferrus.NanoFileTools(str(workdir), profile))
        output = ferrus.NanoStreamOutput(out, "s-test", "m")
        agent = ferrus.NanoAgent(client, toolbox, config, output, clock=clock or Clock(),
                                 workdir=str(workdir))
        outcome = agent.run("Create b.txt holding hi.")
        client.close()
    lines = out.getvalue().splitlines()
    return outcome, lines, fake


def steps(*actions):
    """A model that takes ``actions`` one per turn, then stops."""
    def script(conversation):
        done = len(conversation.calls)
        return actions[done] if done < len(actions) else say("Done.")
    return script


def test_a_malformed_call_is_answered_once_and_the_model_goes_on(workdir):
    outcome, lines, fake = run_agent(workdir, steps(
        raw_call("write_file", '{"path": "b.txt", content: hi}'),
        call("write_file", {"path": "b.txt", "content": "hi\n"})))
    assert outcome.exit_code == 0 and outcome.text == "Done."
    assert (workdir / "b.txt").read_text() == "hi\n"
    answer = json.loads(fake.main[1].calls[0][2])
    assert answer["error"] == "malformed tool call" and "not valid JSON" in answer["problem"]
    assert answer["parameters"]["required"] == ["path", "content"]
    assert any(line.startswith("nano: repairing a malformed tool call: the arguments are "
                               "not valid JSON") for line in lines)


def test_a_second_malformed_call_in_a_row_ends_the_session(workdir):
    outcome, lines, _fake = run_agent(workdir, steps(
        raw_call("write_file", "not json"), raw_call("writ_file", "{}", exact=True)))
    assert outcome.exit_code == 1
    assert outcome.text.startswith("nano stopped: the model's tool call was malformed again "
                                   "after one repair: there is no tool named \"writ_file\"; "
                                   "did you mean write_file?")
    assert "ferrus agents --probe" in outcome.text
    result = json.loads(lines[-1])
    assert result["type"] == "result" and result["is_error"] is True


def test_a_call_written_as_text_is_made_a_tool_call(workdir):
    outcome, lines, _fake = run_agent(workdir, steps(say(
        '<tool_call>{"name": "write_file", "arguments": {"path": "b.txt", "content": "t"}}'
        '</tool_call>')))
    assert outcome.exit_code == 0 and (workdir / "b.txt").read_text() == "t"
    assert any("wrote its call of write_file as text" in line for line in lines)


def test_budgets_stop_a_session_with_a_message_naming_them(workdir):
    clock = Clock()

    def slow_reader(conversation):
        clock.now += 400
        return call("list_directory", {})
    outcome, _lines, _fake = run_agent(workdir, slow_reader, clock=clock,
                                       max_session_secs=1000)
    assert outcome.exit_code == 1
    assert outcome.text.startswith("nano stopped: this session ran 20 min, its budget is "
                                   "1000 s ([agents.nano] max_session_secs)")
    assert "the next session goes on from it" in outcome.text
    outcome, _lines, _fake = run_agent(workdir, lambda c: call("list_directory", {}),
                                       max_session_tokens=500)
    assert "its budget is 500 ([agents.nano] max_session_tokens)" in outcome.text


def test_the_oldest_exchanges_go_when_the_context_fills(workdir):
    (workdir / "big.txt").write_text("word " * 3000)
    seen = []

    def reader(conversation):
        seen.append(len(conversation.body["messages"]))
        return call("read_file", {"path": "big.txt"}) if len(seen) < 8 else say("Done.")
    outcome, lines, fake = run_agent(workdir, reader, context_tokens=12000, max_tokens=1000)
    assert outcome.exit_code == 0
    assert any(line.startswith("nano: removed ") for line in lines)
    assert max(seen) < 2 + 2 * 8 and seen[-1] < seen[5] + 2
    first_user = fake.main[-1].body["messages"][1]["content"]
    assert first_user.startswith("Create b.txt holding hi.")
    assert "earlier messages of this session were removed" in first_user


def test_what_nano_prints_is_read_by_ferrus_as_tool_calls_and_usage(workdir):
    _outcome, lines, fake = run_agent(workdir, steps(call("list_directory", {}),
                                                     call("read_file", {"path": "src/a.py"})))
    tally = ferrus.UsageTally()
    for line in lines:
        for event in ferrus._parse_claude_style(line):
            tally.add(event)
    assert tally.tool_calls == 2 and tally.turns == 3 and tally.agent_session == "s-test"
    assert tally.input_tokens == sum(ferrus_tokens(c.body) for c in fake.main)
    assert tally.output_tokens > 0 and tally.model == "m"


def ferrus_tokens(body):
    return max(1, len(json.dumps(body)) // 4)       # what fake_models reports


def test_the_only_model_of_a_server_is_used_when_none_is_set():
    with FakeModels(lambda c: say("hi")) as fake:
        settings = ferrus.NanoSettings(base_url=fake.url + "/v1")
        client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "", settings)
        assert ferrus.resolve_nano_model(client, "") == "fake"
        assert ferrus.resolve_nano_model(client, "mine") == "mine"
        client.close()


def test_an_unreachable_server_is_named_with_what_to_start():
    settings = ferrus.NanoSettings(base_url="http://127.0.0.1:9/v1")
    client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "m", settings,
                                          sleep=lambda seconds: None)
    with pytest.raises(ferrus.NanoModelError) as failed:
        client.complete([{"role": "user", "content": "x"}], [])
    assert "cannot reach the model server at http://127.0.0.1:9/v1" in failed.value.message
    assert "ollama serve" in failed.value.hint


# -- when nano cannot start -------------------------------------------------------------

REMOTE_NANO = """
[agents.nano]
base_url = "http://10.1.2.3:11434/v1"
model = "m"

[hq.supervisor]
agent = "nano"

[hq.executor]
agent = "nano"
"""


def test_ferrus_run_refuses_settings_nano_would_refuse_before_a_task_exists(project, cli):
    set_config(project, REMOTE_NANO)
    result = cli("run", "--task", "Create a.txt.", cwd=project)
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'base_url "http://10.1.2.3:11434/v1" is not on this machine' in result.stderr
    assert "set allow_remote = true under [agents.nano]" in result.stderr
    assert json.loads(cli("status", "--json", cwd=project).stdout)["state"] == "Idle"


def test_a_start_up_problem_is_nanos_last_event_so_a_run_shows_why_it_ended(project, cli):
    set_config(project, REMOTE_NANO)
    result = cli("nano", "--role", "executor", "--mcp-config",
                 str(project / ".ferrus" / "nano-mcp-executor.json"), "--prompt", "Work.",
                 cwd=project)
    assert result.returncode == 1
    assert result.stderr.startswith("ferrus: [agents.nano] base_url")
    events = [event for line in result.stdout.splitlines()
              for event in ferrus._parse_claude_style(line)]
    said = [event.text for event in events if event.kind == "said"]
    assert len(said) == 1 and "is not on this machine" in said[0] and \
        "hint: nano sends the project's code to that server" in said[0]
