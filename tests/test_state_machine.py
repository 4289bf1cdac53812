"""The task state machine: every action from every state, counters, leases, STATE.json format."""

import datetime as dt
import json

import pytest

import ferrus
from ferrus import S, StateData

NOW = dt.datetime(2026, 5, 13, 10, 0, 0, tzinfo=dt.timezone.utc)


def apply(action, data):
    """Run one pure transition with representative arguments."""
    calls = {
        "create_task": lambda d: ferrus.t_create_task(d, NOW, "t-1"),
        "claim": lambda d: _claim_checked(d),
        "check_passed": lambda d: ferrus.t_check_passed(d, NOW),
        "check_failed": lambda d: ferrus.t_check_failed(d, NOW, "Commands failed: x", 3),
        "submit": lambda d: ferrus.t_submit(d, NOW),
        "consult": lambda d: ferrus.t_consult(d, NOW),
        "respond_consult": lambda d: _require(d, "respond_consult"),
        "finish_consult": lambda d: ferrus.t_finish_consult(d, NOW),
        "approve": lambda d: ferrus.t_approve(d, NOW),
        "reject": lambda d: ferrus.t_reject(d, NOW, 3),
        "human_approve": lambda d: ferrus.t_human_approve(d, NOW),
        "human_reject": lambda d: ferrus.t_human_reject(d, NOW, 3),
        "integrated": lambda d: ferrus.t_integrated(d, NOW),
        "integration_failed": lambda d: ferrus.t_integration_failed(d, NOW, 3),
        "ask_human": lambda d: ferrus.t_ask_human(d, NOW, "executor:x:1"),
        "answer": lambda d: ferrus.t_answer(d, NOW),
        "heartbeat": lambda d: _require(d, "heartbeat"),
        "reset": lambda d: ferrus.t_reset(d, NOW),
        "force_reset": lambda d: ferrus.t_force_reset(d, NOW),
    }
    return calls[action](data)


def _require(data, action):
    ferrus._require(action, data)
    return data


def _claim_checked(data):
    ferrus._require("claim", data)
    return ferrus.claim(data, "executor:x:1", NOW, 90)


def sample(state):
    data = StateData(state=state, check_retries=1, review_cycles=1,
                     selected_spec="docs/specs/a.md", selected_milestone="m1")
    if state in (S.CONSULTATION,):
        data.paused_state = data.consult_paused_state = S.ADDRESSING
    if state == S.AWAITING_HUMAN:
        data.paused_state = S.REVIEWING
    data = ferrus.claim(data, "executor:x:1", NOW, 90)
    return data


def test_the_table_names_every_action_once():
    actions = [row[0] for row in ferrus.TRANSITIONS]
    assert len(actions) == len(set(actions))
    assert set(actions) == set(ferrus.ALLOWED_FROM)


@pytest.mark.parametrize("action", [row[0] for row in ferrus.TRANSITIONS])
@pytest.mark.parametrize("state", list(S))
def test_every_action_from_every_state(action, state):
    data = sample(state)
    before = data.copy()
    if state in ferrus.ALLOWED_FROM[action]:
        result = apply(action, data)
        assert isinstance(result, StateData)
    else:
        with pytest.raises(ferrus.TransitionError) as err:
            apply(action, data)
        assert str(err.value) == (
            "cannot %s from state %s — current state is invalid for this operation"
            % (action, state.value))
    assert data == before, "transitions are pure: the input is never modified"


def test_create_task_moves_pending_origin_and_clears_everything():
    data = StateData(state=S.IDLE, check_retries=4, review_cycles=2, failure_reason="old",
                     pending_task_spec="docs/specs/a.md", pending_task_milestone="m1",
                     paused_state=S.EXECUTING)
    data = ferrus.claim(data, "executor:old:1", NOW, 90)
    new = ferrus.t_create_task(data, NOW, "t-9")
    assert new.state == S.EXECUTING
    assert (new.check_retries, new.review_cycles, new.failure_reason) == (0, 0, None)
    assert (new.task_spec, new.task_milestone) == ("docs/specs/a.md", "m1")
    assert new.pending_task_spec is None and new.pending_task_milestone is None
    assert new.claimed_by is None and new.lease_until is None and new.last_heartbeat is None
    assert new.paused_state is None
    assert new.task_id == "t-9"
    assert new.state_entered_at == ferrus.format_timestamp(NOW)


def test_check_counters_and_failure_at_the_limit():
    data = StateData(state=S.ADDRESSING)
    data = ferrus.t_check_failed(data, NOW, "Commands failed: a", 3)
    assert (data.state, data.check_retries, data.failure_reason) == (
        S.ADDRESSING, 1, "Commands failed: a")
    data = ferrus.t_check_failed(data, NOW, "Commands failed: a", 3)
    data = ferrus.t_check_passed(data, NOW)
    assert (data.check_retries, data.failure_reason) == (0, None)
    for _ in range(2):
        data = ferrus.t_check_failed(data, NOW, "Commands failed: b", 3)
        assert data.state == S.ADDRESSING
    data = ferrus.t_check_failed(data, NOW, "Commands failed: b", 3)
    assert data.state == S.FAILED
    assert data.failure_reason == "Check failed 3 consecutive times. Last failure:\nCommands failed: b"


def test_check_keeps_the_lease_but_submit_clears_it():
    data = ferrus.claim(StateData(state=S.EXECUTING), "executor:x:1", NOW, 90)
    assert ferrus.t_check_passed(data, NOW).claimed_by == "executor:x:1"
    assert ferrus.t_check_failed(data, NOW, "r", 5).claimed_by == "executor:x:1"
    submitted = ferrus.t_submit(data, NOW)
    assert submitted.state == S.REVIEWING and submitted.claimed_by is None


def test_reject_counts_cycles_resets_retries_and_fails_at_the_limit():
    data = StateData(state=S.REVIEWING, check_retries=5)
    data = ferrus.t_reject(data, NOW, 2)
    assert (data.state, data.review_cycles, data.check_retries) == (S.ADDRESSING, 1, 0)
    data.state = S.REVIEWING
    data = ferrus.t_reject(data, NOW, 2)
    assert data.state == S.FAILED
    assert data.failure_reason == "Task rejected 2 times without resolution."


def test_approve_clears_the_lease():
    data = ferrus.claim(StateData(state=S.REVIEWING), "supervisor:x:1", NOW, 90)
    done = ferrus.t_approve(data, NOW)
    assert done.state == S.COMPLETE and done.lease_until is None


@pytest.mark.parametrize("origin", [S.EXECUTING, S.ADDRESSING])
def test_consult_round_trip_restores_the_paused_state_and_keeps_the_lease(origin):
    data = ferrus.claim(StateData(state=origin), "executor:x:1", NOW, 90)
    consulting = ferrus.t_consult(data, NOW)
    assert consulting.state == S.CONSULTATION and consulting.paused_state == origin
    assert consulting.claimed_by == "executor:x:1"
    back = ferrus.t_finish_consult(consulting, NOW)
    assert back.state == origin and back.paused_state is None


@pytest.mark.parametrize("origin", [S.EXECUTING, S.ADDRESSING])
def test_upstream_bug_4_ask_human_during_consultation_keeps_the_consultation(origin):
    data = ferrus.t_consult(StateData(state=origin), NOW)
    asking = ferrus.t_ask_human(data, NOW, "supervisor:x:1")
    assert asking.state == S.AWAITING_HUMAN and asking.paused_state == S.CONSULTATION
    answered = ferrus.t_answer(asking, NOW)
    assert answered.state == S.CONSULTATION
    assert answered.paused_state == origin, "upstream lost this and fell back to Idle"
    assert ferrus.t_finish_consult(answered, NOW).state == origin


def test_finish_consult_without_any_paused_state_resumes_executing_not_idle():
    data = StateData(state=S.CONSULTATION)
    assert ferrus.t_finish_consult(data, NOW).state == S.EXECUTING


@pytest.mark.parametrize("origin", [S.EXECUTING, S.ADDRESSING, S.REVIEWING])
def test_ask_human_and_answer_restore_the_state(origin):
    asking = ferrus.t_ask_human(StateData(state=origin), NOW, "executor:x:1")
    assert asking.question_from == "executor:x:1"
    back = ferrus.t_answer(asking, NOW)
    assert back.state == origin and back.paused_state is None and back.question_from is None


def test_reset_keeps_only_the_selection():
    data = sample(S.FAILED)
    data.task_id, data.rev = "t-1", 41
    fresh = ferrus.t_reset(data, NOW)
    assert fresh.state == S.IDLE
    assert (fresh.selected_spec, fresh.selected_milestone) == ("docs/specs/a.md", "m1")
    assert fresh.task_id is None and fresh.claimed_by is None and fresh.check_retries == 0
    assert fresh.rev == 41, "rev keeps counting so the journal stays gapless"


def test_claim_sets_the_lease():
    data = ferrus.claim(StateData(state=S.EXECUTING), "executor:a:1", NOW, 90)
    assert data.claimed_by == "executor:a:1"
    assert ferrus.lease_deadline(data) == NOW + dt.timedelta(seconds=90)
    assert ferrus.lease_deadline(StateData(claimed_by="executor:a:1")) is None, \
        "claimed_by alone does not make a claim"
    assert data.lease_until == "2026-05-13T10:01:30Z"
    assert data.last_heartbeat == "2026-05-13T10:00:00Z"


# -- timestamps and STATE.json compatibility ------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("2026-05-13T10:00:00Z", dt.datetime(2026, 5, 13, 10, 0, 0)),
    ("2026-05-13T10:00:00.123456789Z", dt.datetime(2026, 5, 13, 10, 0, 0, 123456)),
    ("2026-05-13T10:00:00.5Z", dt.datetime(2026, 5, 13, 10, 0, 0, 500000)),
    ("2026-05-13T12:00:00.123+02:00", dt.datetime(2026, 5, 13, 10, 0, 0, 123000)),
    ("2026-05-13T05:30:00-04:30", dt.datetime(2026, 5, 13, 10, 0, 0)),
])
def test_parse_timestamp_accepts_rfc3339(text, expected):
    assert ferrus.parse_timestamp(text) == expected.replace(tzinfo=dt.timezone.utc)


@pytest.mark.parametrize("micro,text", [
    (0, "2026-05-13T10:00:00Z"), (123000, "2026-05-13T10:00:00.123Z"),
    (123456, "2026-05-13T10:00:00.123456Z"), (100, "2026-05-13T10:00:00.000100Z")])
def test_format_timestamp_uses_the_fewest_exact_digits(micro, text):
    assert ferrus.format_timestamp(NOW.replace(microsecond=micro)) == text


@pytest.mark.parametrize("bad", ["", "yesterday", "2026-05-13 10:00", "2026-05-13T10:00:00"])
def test_parse_timestamp_rejects_garbage(bad):
    with pytest.raises(ValueError):
        ferrus.parse_timestamp(bad)


UPSTREAM_STATE = """{
  "schema_version": 1,
  "state": "Addressing",
  "check_retries": 2,
  "review_cycles": 1,
  "failure_reason": "Commands failed: cargo test",
  "updated_at": "2026-05-13T10:00:00.123456789Z",
  "owner_pid": 4242,
  "claimed_by": "executor:codex:1",
  "lease_until": "2026-05-13T10:01:30.987654321Z",
  "last_heartbeat": "2026-05-13T10:00:00.123456789Z",
  "selected_spec": "docs/specs/2026-05-01-auth.md",
  "selected_milestone": "m1.1",
  "task_spec": "docs/specs/2026-05-01-auth.md",
  "task_milestone": "m1.0"
}"""


def test_upstream_state_json_round_trips_byte_for_byte():
    data = StateData.from_json(UPSTREAM_STATE)
    assert data.state == S.ADDRESSING and data.owner_pid == 4242
    assert data.to_json() == UPSTREAM_STATE, "9-digit fractions and field order survive"
    assert ferrus.lease_deadline(data) > dt.datetime(2026, 5, 13, 10, 1, 0, tzinfo=dt.timezone.utc)


def test_our_state_json_is_readable_the_way_upstream_reads_it():
    data = ferrus.t_create_task(StateData(), NOW, "t-1")
    data = ferrus.t_ask_human(ferrus.t_consult(data, NOW), NOW, "executor:x:1")
    data.rev = 7
    raw = json.loads(data.to_json())
    # Upstream's required fields, enum spellings and always-present null.
    assert list(raw)[:7] == ["schema_version", "state", "check_retries", "review_cycles",
                             "failure_reason", "updated_at", "owner_pid"]
    assert raw["state"] == "AwaitingHuman" and raw["paused_state"] == "Consultation"
    assert raw["failure_reason"] is None
    assert raw["rev"] == 7 and raw["consult_paused_state"] == "Executing"
    assert not data.to_json().endswith("\n")
    assert StateData.from_json(data.to_json()) == data


def test_unknown_fields_from_a_newer_writer_are_kept():
    text = UPSTREAM_STATE[:-2] + ',\n  "future_field": {"a": 1}\n}'
    data = StateData.from_json(text)
    assert json.loads(data.to_json())["future_field"] == {"a": 1}


@pytest.mark.parametrize("text,fragment", [
    ("", "not valid JSON"),
    ("[]", "must hold a JSON object"),
    ('{"state": "Idle", "check_retries": 0}', "review_cycles"),
    ('{"state": "Sleeping", "check_retries": 0, "review_cycles": 0}', "unknown state"),
    ('{"state": "Idle", "check_retries": -1, "review_cycles": 0}', "non-negative"),
    ('{"state": "Idle", "check_retries": 0, "review_cycles": 0, "lease_until": "soon"}',
     "RFC 3339"),
])
def test_corrupt_state_is_explained(text, fragment):
    with pytest.raises(ferrus.StateCorrupt) as err:
        StateData.from_json(text)
    assert fragment in err.value.message
    assert "ferrus doctor" in err.value.hint
