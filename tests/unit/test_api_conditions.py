"""Conditions: lastTransitionTime moves only when the status flips."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rollout_operator.model.api import Condition, ConditionStatus
from rollout_operator.model.conditions import (
    ConditionUpdate,
    find_condition,
    is_true,
    merge_conditions,
    same_conditions,
    set_condition,
)

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def test_a_new_condition_transitions_now() -> None:
    result = set_condition(
        [], "Ready", False, "PodsStarting", "0 of 3", observed_generation=1, now=T0
    )
    assert len(result) == 1
    ready = result[0]
    assert ready.status is ConditionStatus.FALSE
    assert ready.last_transition_time == T0
    assert ready.observed_generation == 1


def test_same_status_keeps_the_transition_time_but_updates_the_rest() -> None:
    first = set_condition([], "Ready", False, "PodsStarting", "0 of 3", now=T0)
    second = set_condition(
        first, "Ready", False, "PodsNotStarting", "late", observed_generation=2, now=T1
    )
    ready = second[0]
    assert ready.last_transition_time == T0
    assert (ready.reason, ready.message, ready.observed_generation) == (
        "PodsNotStarting",
        "late",
        2,
    )


def test_a_flip_moves_the_transition_time() -> None:
    first = set_condition([], "Ready", False, "PodsStarting", now=T0)
    second = set_condition(first, "Ready", True, "AllParticipantsReady", now=T1)
    assert second[0].last_transition_time == T1
    assert is_true(second, "Ready")


def test_other_conditions_are_kept_in_their_order() -> None:
    conditions = set_condition([], "Ready", True, "AllParticipantsReady", now=T0)
    conditions = set_condition(conditions, "Degraded", False, "AsExpected", now=T0)
    conditions = set_condition(conditions, "Ready", False, "PodsFailed", now=T1)
    assert [c.type for c in conditions] == ["Ready", "Degraded"]
    degraded = find_condition(conditions, "Degraded")
    assert degraded is not None
    assert degraded.last_transition_time == T0


def test_merge_applies_each_update_with_the_same_rules() -> None:
    current = set_condition([], "Ready", True, "AllParticipantsReady", now=T0)
    merged = merge_conditions(
        current,
        [
            ConditionUpdate.of("Ready", True, "AllParticipantsReady", "still"),
            ConditionUpdate.of("Progressing", False, "AttemptReady"),
        ],
        observed_generation=4,
        now=T1,
    )
    ready, progressing = merged
    assert ready.last_transition_time == T0
    assert ready.message == "still"
    assert progressing.last_transition_time == T1
    assert {c.observed_generation for c in merged} == {4}


def test_same_conditions_detects_no_change() -> None:
    a = set_condition([], "Ready", True, "AllParticipantsReady", now=T0)
    b = merge_conditions(a, [ConditionUpdate.of("Ready", True, "AllParticipantsReady")], now=T1)
    assert same_conditions(a, b)
    c = merge_conditions(a, [ConditionUpdate.of("Ready", False, "PodsFailed")], now=T1)
    assert not same_conditions(a, c)


def test_condition_wire_form_is_a_metav1_condition() -> None:
    condition = Condition(
        type="Ready",
        status=ConditionStatus.TRUE,
        reason="AllParticipantsReady",
        message="ok",
        last_transition_time=T0,
        observed_generation=3,
    )
    assert condition.model_dump(mode="json", by_alias=True) == {
        "type": "Ready",
        "status": "True",
        "reason": "AllParticipantsReady",
        "message": "ok",
        "lastTransitionTime": "2026-11-29T12:00:00Z",
        "observedGeneration": 3,
    }
