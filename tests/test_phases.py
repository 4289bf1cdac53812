"""The phase machine of a parallel run (docs/ARCHITECTURE.md, 'Phase machine'): its
allowed transitions, the recovery target after a crash, the capacity gate on every move
with its GateRecord, and the dispatch gates checked before collecting."""

import itertools

import pytest

import ferrus
from conftest import set_config

ALLOWED = {(0, 1), (1, 2), (2, 3), (3, 4), (4, 3), (4, 5), (5, 1), (5, 2), (5, 6), (6, 7),
           (7, 1)}
GREEN = ferrus.Signals()
NO_LIMITS = ferrus.CapacityConfig()


def machine_in(phase):
    """A machine that reached ``phase`` through allowed moves (as a real run would)."""
    machine = ferrus.PhaseMachine()
    path = {0: [], 1: [1], 2: [1, 2], 3: [1, 2, 3], 4: [1, 2, 3, 4], 5: [1, 2, 3, 4, 5],
            6: [1, 2, 3, 4, 5, 6], 7: [1, 2, 3, 4, 5, 6, 7]}[phase]
    for target in path:
        machine.transition(target, GREEN, NO_LIMITS)
    assert machine.phase == phase
    return machine


def test_phase_names_are_the_eight_phases_of_the_cycle():
    assert ferrus.PHASE_NAMES == ("preflight", "plan", "prepare", "dispatch", "collect",
                                  "integrate", "report", "cleanup")
    assert ferrus.phase_label(3) == "P3 dispatch"
    allowed = {(a, b) for a, targets in ferrus.PHASE_TRANSITIONS.items() for b in targets}
    assert allowed == ALLOWED


@pytest.mark.parametrize("source,target", sorted(ALLOWED))
def test_every_allowed_transition_moves_and_records(source, target):
    machine = machine_in(source)
    before = len(machine.history)
    action, record = machine.transition(target, GREEN, NO_LIMITS)
    assert (action, machine.phase) == ("Continue", target)
    assert machine.history[before:] == [record]
    assert (record["phase"], record["from_phase"], record["tier"]) == (target, source, "Green")


@pytest.mark.parametrize("source,target", [pair for pair in itertools.product(range(8), range(8))
                                           if pair not in ALLOWED])
def test_every_other_pair_is_refused_and_changes_nothing(source, target):
    machine = machine_in(source)
    history = list(machine.history)
    with pytest.raises(ferrus.InvalidPhaseTransition) as err:
        machine.transition(target, GREEN, NO_LIMITS)
    assert machine.phase == source and machine.history == history
    assert (err.value.from_phase, err.value.to_phase) == (source, target)
    assert err.value.allowed == machine.allowed_targets()
    assert ferrus.phase_label(source) in err.value.message
    assert ferrus.phase_label(target) in err.value.message
    assert err.value.hint


@pytest.mark.parametrize("target", [8, -1, "3", None, True, 2.0])
def test_what_is_not_a_phase_is_refused(target):
    machine = machine_in(1)
    with pytest.raises(ferrus.InvalidPhaseTransition):
        machine.transition(target, GREEN, NO_LIMITS)
    assert machine.phase == 1 and len(machine.history) == 1


def test_the_recovery_target_is_the_only_way_out_of_preflight_then_the_cycle_goes_on():
    machine = ferrus.PhaseMachine()
    machine.set_recovery_target(4)
    with pytest.raises(ferrus.InvalidPhaseTransition) as err:
        machine.transition(1, GREEN, NO_LIMITS)
    assert err.value.allowed == (4,) and machine.history == []
    for target in (2, 3, 5, 7):
        with pytest.raises(ferrus.InvalidPhaseTransition):
            machine.transition(target, GREEN, NO_LIMITS)
    machine.transition(4, GREEN, NO_LIMITS)
    assert (machine.phase, machine.recovery_target) == (4, 0)
    machine.transition(3, GREEN, NO_LIMITS)      # and then the normal cycle
    machine.transition(4, GREEN, NO_LIMITS)
    machine.transition(5, GREEN, NO_LIMITS)
    assert machine.phase == 5 and [r["phase"] for r in machine.history] == [4, 3, 4, 5]


@pytest.mark.parametrize("bad", [0, 8, -2, "4", True])
def test_a_recovery_target_must_be_a_phase_after_preflight(bad):
    machine = ferrus.PhaseMachine()
    with pytest.raises(ferrus.FerrusError):
        machine.set_recovery_target(bad)
    assert machine.recovery_target == 0


def test_a_recovery_target_is_set_only_in_preflight():
    machine = machine_in(2)
    with pytest.raises(ferrus.FerrusError) as err:
        machine.set_recovery_target(4)
    assert "P2 prepare" in err.value.message
    assert machine.recovery_target == 0


def test_saved_and_resumed():
    machine = machine_in(5)
    saved = machine.to_json()
    assert saved == {"phase": 5, "recovery_target": 0}
    again = ferrus.PhaseMachine.from_json(saved)
    assert (again.phase, again.recovery_target, again.history) == (5, 0, [])
    resumed = ferrus.PhaseMachine.resumed(saved)
    assert (resumed.phase, resumed.recovery_target) == (0, 5)
    assert resumed.allowed_targets() == (5,)
    # Killed again while still in P0 of that recovery: the target survives.
    twice = ferrus.PhaseMachine.resumed(resumed.to_json())
    assert (twice.phase, twice.recovery_target) == (0, 5)
    # Killed before leaving P0 on a fresh start: a fresh start again.
    assert ferrus.PhaseMachine.resumed({"phase": 0, "recovery_target": 0}).allowed_targets() \
        == (1,)


@pytest.mark.parametrize("saved", [[], {"phase": 9}, {"phase": "2"},
                                   {"phase": 3, "recovery_target": 4},
                                   {"phase": 0, "recovery_target": -1}])
def test_a_damaged_saved_machine_is_a_clear_error(saved):
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.PhaseMachine.from_json(saved)
    assert err.value.hint


# -- the capacity gate on every move -----------------------------------------------------

def test_checkpoint_leaves_the_phase_and_records_the_decision():
    machine = machine_in(3)
    limits = ferrus.CapacityConfig(max_tool_calls=10)
    signals = ferrus.Signals(tool_calls=10, turns=4, tasks_completed=1,
                             context_tokens_used=5000, context_tokens_max=200000)
    with pytest.raises(ferrus.ShutdownRequired) as err:
        machine.transition(4, signals, limits)
    assert machine.phase == 3
    assert err.value.action == "Checkpoint" and machine.history[-1] is err.value.record
    record = err.value.record
    assert (record["phase"], record["tier"], record["action"], record["signal"]) == (
        4, "Red", "Checkpoint", "tool_calls")
    assert "P4 collect" in err.value.message and "[capacity]" in err.value.hint
    # Once the limit is raised the same move goes through.
    action, _ = machine.transition(4, signals, ferrus.CapacityConfig(max_tool_calls=100))
    assert action == "Continue" and machine.phase == 4 and len(machine.history) == 5


def test_emergency_stop_and_throttle():
    machine = machine_in(1)
    limits = ferrus.CapacityConfig(max_turns=10)
    with pytest.raises(ferrus.ShutdownRequired) as err:
        machine.transition(2, ferrus.Signals(turns=15), limits)
    assert err.value.action == "EmergencyStop" and machine.phase == 1
    action, record = machine.transition(2, ferrus.Signals(turns=8), limits)
    assert (action, record["tier"], machine.phase) == ("Throttle", "Orange", 2)


def test_a_checkpoint_in_preflight_keeps_the_recovery_target():
    machine = ferrus.PhaseMachine()
    machine.set_recovery_target(5)
    with pytest.raises(ferrus.ShutdownRequired):
        machine.transition(5, ferrus.Signals(sessions=3), ferrus.CapacityConfig(max_sessions=3))
    assert (machine.phase, machine.recovery_target) == (0, 5)


def test_the_gate_record_has_every_field_of_the_audit_trail():
    machine = machine_in(0)
    signals = ferrus.Signals(tool_calls=3, turns=7, tasks_completed=2,
                             context_tokens_used=1234, context_tokens_max=200000)
    _, record = machine.transition(1, signals, ferrus.CapacityConfig(max_turns=100))
    assert {key: record[key] for key in ("phase", "tier", "action", "tool_calls", "turns",
                                          "tasks_completed", "context_tokens_used",
                                          "context_tokens_max")} == {
        "phase": 1, "tier": "Green", "action": "Continue", "tool_calls": 3, "turns": 7,
        "tasks_completed": 2, "context_tokens_used": 1234, "context_tokens_max": 200000}
    assert record["phase_name"] == "plan" and record["limits"] == {"max_turns": 100}
    assert ferrus.json.loads(ferrus.json.dumps(record)) == record     # journal-ready


# -- turns and the context window as signals -----------------------------------------------

@pytest.mark.parametrize("used,tier,action", [(0, "Green", "Continue"),
                                              (79_999, "Green", "Continue"),
                                              (80_000, "Orange", "Throttle"),
                                              (100_000, "Red", "Checkpoint"),
                                              (150_000, "Red", "EmergencyStop")])
def test_the_context_share_is_judged_against_the_window(used, tier, action):
    signals = ferrus.Signals(context_tokens_used=used, context_tokens_max=100_000)
    assert ferrus.classify(signals, ferrus.CapacityConfig()) == (
        tier, action, "context_tokens_used" if used else None)


def test_an_unknown_window_judges_no_context():
    signals = ferrus.Signals(context_tokens_used=10 ** 9, context_tokens_max=0)
    assert ferrus.classify(signals, ferrus.CapacityConfig()) == ("Green", "Continue", None)


@pytest.mark.parametrize("turns,tier,action", [(7, "Green", "Continue"), (8, "Orange", "Throttle"),
                                               (10, "Red", "Checkpoint"),
                                               (15, "Red", "EmergencyStop")])
def test_turns_are_judged_against_max_turns(turns, tier, action):
    limits = ferrus.CapacityConfig(max_turns=10)
    assert ferrus.classify(ferrus.Signals(turns=turns), limits) == (tier, action, "turns")
    assert ferrus.classify(ferrus.Signals(turns=10 ** 6), ferrus.CapacityConfig())[0] == "Green"


def test_the_worst_of_turns_context_and_the_rest_decides():
    limits = ferrus.CapacityConfig(max_turns=100, max_tool_calls=10)
    signals = ferrus.Signals(turns=50, tool_calls=6, context_tokens_used=90,
                             context_tokens_max=100)
    assert ferrus.classify(signals, limits) == ("Orange", "Throttle", "context_tokens_used")


def test_max_turns_and_context_window_are_capacity_keys(project):
    set_config(project, "[capacity]\nmax_turns = 40\ncontext_window = 200000\n")
    capacity = ferrus.load_config(str(project)).capacity
    assert (capacity.max_turns, capacity.context_window) == (40, 200000)
    assert capacity.enabled()
    assert ferrus.CapacityConfig(context_window=1000).enabled()
    set_config(project, "[capacity]\nmax_turns = -1\n")
    with pytest.raises(ferrus.FerrusError) as err:
        ferrus.load_config(str(project))
    assert "capacity.max_turns" in err.value.message


def test_the_hq_gate_record_keeps_its_format_and_adds_the_new_signals():
    record = ferrus.gate_record("spawn:executor", "Green", "Continue",
                                ferrus.Signals(turns=3, context_tokens_used=9,
                                               context_tokens_max=10),
                                ferrus.CapacityConfig(max_turns=5))
    assert record["target"] == "spawn:executor" and record["turns"] == 3
    assert record["context_tokens_used"] == 9 and record["limits"] == {"max_turns": 5}


# -- dispatch gates ------------------------------------------------------------------------

def dispatched(*pairs):
    return [ferrus.DispatchRecord(task, "executor", agent, "s-%s" % task) for task, agent in pairs]


def test_coverage_passes_when_every_chosen_task_was_dispatched():
    records = dispatched(("t1", "claude-code"), ("t2", "codex"))
    records.append(ferrus.DispatchRecord("t1", "reviewer", "codex", "s-r1"))
    ferrus.check_dispatch_coverage(["t1", "t2"], records)


def test_coverage_fails_naming_the_uncovered_tasks():
    with pytest.raises(ferrus.DispatchGateError) as err:
        ferrus.check_dispatch_coverage(["t1", "t2", "t3"], dispatched(("t2", "codex")))
    assert err.value.gate == "coverage" and err.value.tasks == ["t1", "t3"]
    assert "t1, t3" in err.value.message and err.value.hint


def test_batch_size_passes_up_to_max_tasks():
    ferrus.check_batch_size(["t1", "t2", "t2"], 2)     # a task chosen twice is one task
    ferrus.check_batch_size(["t%d" % i for i in range(50)], 0)     # 0: no limit


def test_batch_size_fails_above_max_tasks():
    with pytest.raises(ferrus.DispatchGateError) as err:
        ferrus.check_batch_size(["t1", "t2", "t3"], 2)
    assert err.value.gate == "batch" and err.value.tasks == ["t3"]
    assert "3 tasks chosen, at most 2" in err.value.message


def test_delegation_passes_for_allowed_agents_and_undelegated_tasks():
    tasks = [("t1", {"delegated_by": "s-lead"}), ("t2", {"spec": "x.md"}), ("t3", None)]
    records = dispatched(("t1", "claude-code"), ("t2", "codex"), ("t3", "gemini-cli"))
    ferrus.check_delegation(tasks, records, ["claude-code"])
    ferrus.check_delegation(tasks, records, None)      # no topology: any agent


def test_delegation_fails_for_an_agent_the_topology_does_not_allow():
    tasks = [("t1", {"delegated_by": "s-lead"}), ("t2", {"delegated_by": "s-lead"})]
    records = dispatched(("t1", "claude-code"), ("t2", "codex"))
    records.append(ferrus.DispatchRecord("t2", "reviewer", "claude-code"))
    with pytest.raises(ferrus.DispatchGateError) as err:
        ferrus.check_delegation(tasks, records, {"claude-code"})
    assert err.value.gate == "delegation" and err.value.tasks == ["t2"]
    assert "t2" in err.value.message and "s-lead" in err.value.message \
        and "codex" in err.value.message
    assert "claude-code" in err.value.hint


def test_delegation_fails_for_a_delegated_task_without_an_executor():
    records = [ferrus.DispatchRecord("t1", "reviewer", "claude-code")]
    with pytest.raises(ferrus.DispatchGateError) as err:
        ferrus.check_delegation([("t1", {"delegated_by": "s-lead"})], records, ["claude-code"])
    assert err.value.tasks == ["t1"] and "no executor" in err.value.message


def test_run_dispatch_gates_passes_and_raises_the_first_failure():
    tasks = [("t1", {"delegated_by": "s-lead"}), ("t2", {})]
    good = dispatched(("t1", "claude-code"), ("t2", "codex"))
    ferrus.run_dispatch_gates(["t1", "t2"], good, tasks, 2, ["claude-code"])
    with pytest.raises(ferrus.DispatchGateError) as err:     # uncovered and too many
        ferrus.run_dispatch_gates(["t1", "t2", "t3"], good, tasks, 2, ["claude-code"])
    assert err.value.gate == "coverage"
    with pytest.raises(ferrus.DispatchGateError) as err:
        ferrus.run_dispatch_gates(["t1", "t2"], good, tasks, 1, ["claude-code"])
    assert err.value.gate == "batch"
    with pytest.raises(ferrus.DispatchGateError) as err:
        ferrus.run_dispatch_gates(["t1", "t2"], good, tasks, 2, ["codex"])
    assert err.value.gate == "delegation"
