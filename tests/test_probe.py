"""The tool-calling probe tells a model that can drive ferrus from one that cannot.

Scripted chat-completions models play each kind of model a user may point nano at: one
that does the exercise, one that only chats, one that writes broken JSON, one that
calls the wrong tool or forgets the word, one that will not stop.  `ferrus agents
--probe` and `ferrus doctor --probe` report each nano role's verdict."""

import json
import os
import re
import subprocess

import pytest

import ferrus
from conftest import FERRUS_CMD, set_config
from fake_models import FakeModels, call, raw_call, say


def the_word(conversation):
    found = re.search(r"secret word is (\S+)", conversation.calls[0][2])
    return found.group(1) if found else None


def capable(conversation):
    """A model that does the exercise."""
    if not conversation.calls:
        return call("lookup_word", {"key": "ferrus"})
    if len(conversation.calls) == 1:
        return call("submit_word", {"word": the_word(conversation)})
    return say("DONE")


def verdict_of(script):
    with FakeModels(script) as fake:
        settings = ferrus.NanoSettings(base_url=fake.url + "/v1")
        client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "m", settings,
                                              retries=0)
        ticks = iter(range(0, 1000, 2))
        verdict = ferrus.probe_model(client, clock=lambda: next(ticks))
        client.close()
    return verdict


def test_a_model_that_calls_tools_passes():
    verdict = verdict_of(capable)
    assert verdict.passed and verdict.reason == "" and verdict.turns == 3
    assert verdict.seconds == 2 and verdict.input_tokens > 0 and verdict.output_tokens > 0


@pytest.mark.parametrize("script, reason, detail", [
    (lambda c: say("Sure! I would call lookup_word now."), "no tool calls",
     'the model answered in text instead of calling lookup_word: "Sure! I would call'),
    (lambda c: raw_call("lookup_word", "{key: ferrus}"), "malformed JSON",
     "the arguments of lookup_word are not JSON: {key: ferrus}"),
    (lambda c: call("submit_word", {"word": "x"}), "wrong tool",
     'the model called "submit_word" instead of lookup_word'),
    (lambda c: call("lookup_word", {"key": "fer"}) if not c.calls else None,
     "wrong arguments", 'lookup_word got {"key": "fer"}, not key "ferrus"'),
    (lambda c: call("lookup_word", {"key": "ferrus"}) if not c.calls else
     call("submit_word", {"word": "amber"}), "wrong arguments",
     'submit_word got {"word": "amber"}, not the word amber-'),
    (lambda c: call("lookup_word", {"key": "ferrus"}) if len(c.calls) != 1 else
     call("submit_word", {"word": the_word(c)}), "did not stop",
     "after the exercise the model called lookup_word again"),
])
def test_each_way_of_failing_is_named(script, reason, detail):
    verdict = verdict_of(script)
    assert not verdict.passed and verdict.reason == reason
    assert verdict.detail.startswith(detail), verdict.detail


def test_an_unreachable_server_is_a_server_error():
    settings = ferrus.NanoSettings(base_url="http://127.0.0.1:9/v1")
    client = ferrus.ChatCompletionsClient(ferrus.nano_endpoint(settings), "m", settings,
                                          retries=0)
    verdict = ferrus.probe_model(client)
    assert (verdict.passed, verdict.reason) == (False, "server error")
    assert "cannot reach the model server" in verdict.detail


def probe_project(project, fake, executor_model="capable"):
    set_config(project, '[agents.nano]\nbase_url = "%s/v1"\n' % fake.url)
    env = {k: v for k, v in os.environ.items() if k != "FERRUS_SESSION"}
    for role, model in (("supervisor", "chatty"), ("executor", executor_model)):
        done = subprocess.run(FERRUS_CMD + ["register", "--%s" % role, "nano",
                                            "--%s-model" % role, model], cwd=str(project),
                              capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
    return env


def by_model(conversation):
    return capable(conversation) if conversation.body.get("model") == "capable" else \
        say("Hello! How can I help?")


def test_ferrus_agents_probe_reports_each_roles_model(project):
    with FakeModels(by_model) as fake:
        env = probe_project(project, fake)
        text = subprocess.run(FERRUS_CMD + ["agents", "--probe"], cwd=str(project),
                              capture_output=True, text=True, env=env, timeout=60)
        data = subprocess.run(FERRUS_CMD + ["agents", "--probe", "--json"],
                              cwd=str(project), capture_output=True, text=True, env=env,
                              timeout=60)
    assert text.returncode == 1, text.stdout + text.stderr
    lines = text.stdout
    assert "supervisor nano (model chatty at %s/v1)" % fake.url in lines
    assert "probe: FAIL — no tool calls: the model answered in text" in lines
    assert "fix: this model (or its server's chat template) does not make tool calls" in lines
    assert re.search(r"executor   nano \(model capable at .*\)\n +probe: pass — 3 turns in "
                     r"\d+\.\d s, \d+ tokens", lines), lines
    rows = {row["role"]: row for row in json.loads(data.stdout)}
    assert rows["executor"]["passed"] and not rows["supervisor"]["passed"]
    assert rows["supervisor"]["reason"] == "no tool calls"


def test_ferrus_doctor_names_a_bad_nano_setting_and_the_probe_refuses_it(project):
    with FakeModels(by_model) as fake:
        env = probe_project(project, fake)
        set_config(project, '[agents.nano]\nbase_url = "%s/v1"\nmax_tool_call = 3\n\n'
                            '[hq.supervisor]\nagent = "nano"\nmodel = "capable"\n\n'
                            '[hq.executor]\nagent = "nano"\nmodel = "capable"\n' % fake.url)
        done = subprocess.run(FERRUS_CMD + ["doctor", "--probe"], cwd=str(project),
                              capture_output=True, text=True, env=env, timeout=60)
    assert "error: ferrus.toml [agents.nano] has no setting max_tool_call" in done.stdout
    assert "what to do: did you mean max_tool_calls?" in done.stdout
    # nano would refuse to start with it, so the probe does not run the model either.
    assert done.stdout.count("probe: FAIL — not configured: ferrus.toml [agents.nano] has "
                             "no setting max_tool_call") == 2
    assert done.returncode == 1


class SlowClient:
    """A client whose every answer takes 50 s of its clock (and says what it was given)."""

    def __init__(self):
        self.now = 0.0
        self.given = []

    def clock(self):
        return self.now

    def complete(self, messages, tools, within_secs=None):
        self.given.append(within_secs)
        if within_secs <= 50:
            self.now += within_secs
            raise ferrus.NanoModelError("the model server at x did not answer within %d s"
                                        % within_secs, "raise request_timeout_secs")
        self.now += 50
        if len(self.given) == 1:
            return ferrus.NanoTurn(tool_calls=[ferrus.NanoToolCall(
                "c1", "lookup_word", '{"key": "ferrus"}')])
        return ferrus.NanoTurn(tool_calls=[ferrus.NanoToolCall(
            "c2", "submit_word", '{"word": "amber-1"}')])


def test_the_whole_exercise_has_the_probes_time_limit():
    client = SlowClient()
    verdict = ferrus.probe_model(client, word="amber-1")
    assert client.given == [120, 70, 20] and client.now == 120
    assert (verdict.passed, verdict.reason) == (False, "timeout")
    assert verdict.detail.startswith("the model did not finish the exercise within 120 s")


def test_a_failure_report_gives_one_indented_fix_line():
    client = SlowClient()
    verdict = ferrus.probe_model(client, word="amber-1")
    row = dict(role="executor", agent="nano", probed=True, model="m", **{
        key: getattr(verdict, key) for key in ("passed", "reason", "detail", "hint",
                                               "seconds", "turns")})
    lines = ferrus._probe_lines(row).split("\n")
    assert all(line.startswith("           ") for line in lines[1:]), lines
    assert sum("raise [agents.nano] request_timeout_secs" in line for line in lines) == 1
    assert not any(line.lstrip().startswith("hint:") for line in lines)
    row.update(reason="server error", detail="the model server answered HTTP 500",
               hint="see the model server's own log")
    assert ferrus._probe_lines(row).split("\n")[-1] == \
        "           fix: see the model server's own log"
