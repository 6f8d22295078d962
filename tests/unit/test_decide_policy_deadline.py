"""The deadline policy (`decide/policy/deadline.py`, pure): the save reserve, the deadline
checkpoint's start, what covers a deadline and how it settles.

Time is an argument (`T0 + seconds`), so each test states exactly when it looks.
"""

from __future__ import annotations

from rollout_operator.decide.policy.deadline import (
    DEFAULT_RESERVE_SECONDS,
    deadline_decision,
    save_reserve_seconds,
)
from rollout_operator.decide.policy.plan import plan
from rollout_operator.decide.policy.views import (
    ANNOTATION_DEADLINE_OUTCOME,
    CheckpointView,
    DeadlineRecord,
    SetView,
)
from rollout_operator.model import api
from rollout_operator.model.api import CheckpointPhase, Trigger
from rollout_operator.model.reasons import Reason
from testsupport.policy import T0, stamp
from testsupport.policyviews import at, ckpt, deadline_view, rollout_set, view


def test_reserve_without_measurements_is_the_generous_default() -> None:
    assert save_reserve_seconds([]) == DEFAULT_RESERVE_SECONDS


def test_reserve_covers_steady_durations_with_factor_and_margin() -> None:
    # median 4, no spread: ceil(4 * 1.25 + 2) = 7
    assert save_reserve_seconds([4.0] * 10) == 7


def test_one_slow_checkpoint_raises_the_reserve_at_once() -> None:
    steady = save_reserve_seconds([2.0] * 10)
    assert save_reserve_seconds([2.0] * 10 + [9.0]) >= 9.0 * 1.25 + 2 > steady


def test_an_old_outlier_does_not_dominate_and_one_fast_run_does_not_shrink_it() -> None:
    durations = [3.0, 3.2, 2.9, 60.0, 3.1, 3.0, 2.8, 3.0, 3.1, 3.0]
    assert save_reserve_seconds(durations) < 10
    assert save_reserve_seconds([*durations, 0.1]) == save_reserve_seconds(durations)


def test_reserve_ignores_unusable_numbers() -> None:
    assert save_reserve_seconds([float("nan"), -1.0, 4.0]) == 7


def test_deadline_waits_until_must_save_by_minus_the_reserve() -> None:
    rset = deadline_view()  # reserve 7 s
    decision = deadline_decision(rset, [], 7, at(900))
    assert decision.create is None
    assert decision.wake_at == at(993)
    assert decision.condition is not None
    assert decision.condition.reason == Reason.WAITING
    assert "saveReserveSeconds 7" in decision.condition.message


def test_deadline_checkpoint_starts_at_its_start_time() -> None:
    decision = deadline_decision(deadline_view(), [], 7, at(993))
    assert decision.create is not None
    assert decision.create.name == "math-deadline-20261129-121640"
    assert decision.create.trigger is Trigger.DEADLINE
    assert decision.condition is not None
    assert decision.condition.reason == Reason.SAVING


def test_deadline_checkpoint_ready_in_time_settles_saved_with_the_margin() -> None:
    own = ckpt("math-deadline-20261129-121640", 993, trigger=Trigger.DEADLINE)
    running = deadline_decision(deadline_view(), [own], 7, at(995))
    assert running.create is None
    assert running.settle is None
    done = ckpt(own.name, 993, trigger=Trigger.DEADLINE, completed=997, ready=True)
    decision = deadline_decision(deadline_view(), [done], 7, at(998))
    assert decision.settle == DeadlineRecord(
        at(1000), Reason.SAVED, own.name, saved=True, message=decision.settle.message
    )
    assert decision.condition is not None
    assert decision.condition.status is True
    assert "3s before mustSaveBy" in decision.condition.message


def test_a_deadline_wait_overtaken_by_a_running_checkpoint_saves_nothing_twice() -> None:
    manual = ckpt("trainer-120", 980, trigger=Trigger.TRAINER_CHECKPOINT)
    decision = deadline_decision(deadline_view(), [manual], 7, at(993))
    assert decision.create is None
    assert decision.condition is not None
    assert decision.condition.reason == Reason.SAVING
    assert "trainer-120" in decision.condition.message
    done = ckpt("trainer-120", 980, completed=996, ready=True)
    settled = deadline_decision(deadline_view(), [done], 7, at(996))
    assert settled.create is None
    assert settled.settle is not None
    assert settled.settle.checkpoint == "trainer-120"


def test_a_checkpoint_ready_before_the_start_time_does_not_cover_the_deadline() -> None:
    early = ckpt("early", 900, completed=950, ready=True)
    decision = deadline_decision(deadline_view(), [early], 7, at(993))
    assert decision.create is not None
    assert decision.create.trigger is Trigger.DEADLINE


def test_once_started_the_deadline_checkpoint_is_the_outcome_whatever_the_reserve_does() -> None:
    # Its own duration can raise the reserve so far that an earlier manual checkpoint would now
    # fall after the start time: it must not be taken for the deadline's save after the fact.
    own = ckpt("math-deadline-20261129-121640", 993, trigger=Trigger.DEADLINE, completed=997)
    done = CheckpointView(**{**own.__dict__, "ready": True, "phase": CheckpointPhase.READY})
    earlier = ckpt("manual", 980, completed=988, ready=True)
    decision = deadline_decision(deadline_view(), [earlier, done], 13, at(998))
    assert decision.settle is not None
    assert decision.settle.checkpoint == own.name


def test_an_overtaken_wait_keeps_its_start_time_when_the_saving_checkpoint_is_slow() -> None:
    # trainer-120 was saving for the deadline (condition Saving, reserve 7 => start 993). Its
    # own 16 s duration would raise the reserve to 22 (start 978) and let "warm", Ready at 985
    # (before the real start), cover the deadline after the fact; the start stays at 993.
    conditions = [
        {
            "type": "Ready",
            "status": "True",
            "reason": "AllParticipantsReady",
            "lastTransitionTime": stamp(0),
        },
        {
            "type": "DeadlineSaved",
            "status": "False",
            "reason": "Saving",
            "message": "checkpoint trainer-120 must be Ready",
            "lastTransitionTime": stamp(993),
        },
    ]
    status = {"saveReserveSeconds": 7, "conditions": conditions}
    durations = [4.0, 4.0, 4.0, 4.0, 16.0]
    rset = deadline_view(durations=durations, status=status)
    assert save_reserve_seconds(tuple(durations)) > 7
    warm = ckpt("warm", 975, completed=985, ready=True)
    trainer = ckpt(
        "trainer-120", 980, trigger=Trigger.TRAINER_CHECKPOINT, completed=996, ready=True
    )
    decided = plan(rset, [warm, trainer], at(997))
    assert decided.reserve == 7
    assert decided.settle is not None
    assert decided.settle.checkpoint == "trainer-120"


def test_a_checkpoint_ready_after_must_save_by_settles_missed() -> None:
    late = ckpt("math-deadline-20261129-121640", 993, completed=1004, ready=True)
    decision = deadline_decision(deadline_view(), [late], 7, at(1005))
    assert decision.settle is not None
    assert decision.settle.outcome == Reason.MISSED
    assert decision.condition is not None
    assert decision.condition.status is False
    assert "4s after mustSaveBy" in decision.condition.message


def test_a_failed_deadline_checkpoint_settles_with_its_reason() -> None:
    failed = ckpt("math-deadline-20261129-121640", 993, completed=999, failed=True)
    decision = deadline_decision(deadline_view(), [failed], 7, at(999))
    assert decision.settle is not None
    assert decision.settle.outcome == Reason.CHECKPOINT_FAILED
    assert decision.create is None
    assert "PrepareTimeout" in decision.settle.message


def test_a_deadline_found_late_still_saves_and_says_so() -> None:
    decision = deadline_decision(deadline_view(), [], 7, at(1010))
    assert decision.create is not None
    assert decision.condition is not None
    assert "10s late" in decision.condition.message


def test_a_settled_deadline_is_never_decided_again() -> None:
    record = DeadlineRecord(at(1000), Reason.SAVED, "x", saved=True, message="saved by x")
    rset = deadline_view(annotations={ANNOTATION_DEADLINE_OUTCOME: record.to_annotation()})
    decision = deadline_decision(rset, [], 7, at(5000))
    assert decision.create is None
    assert decision.settle is None
    assert decision.condition is not None
    assert decision.condition.message == "saved by x"


def test_a_moved_deadline_is_decided_afresh() -> None:
    record = DeadlineRecord(at(1000), Reason.SAVED, "x", saved=True)
    rset = deadline_view(
        must=2000, annotations={ANNOTATION_DEADLINE_OUTCOME: record.to_annotation()}
    )
    decision = deadline_decision(rset, [], 7, at(1500))
    assert decision.wake_at == at(1993)


def test_a_starting_set_gets_its_deadline_checkpoint_queued() -> None:
    starting = deadline_view(live_pods=0, ready_since=None)
    decision = deadline_decision(starting, [], 7, at(995))
    assert decision.create is not None


def test_nothing_to_save_when_suspended_or_at_sibling_level() -> None:
    suspended = deadline_view(live_pods=0, suspended=(True, Reason.SUSPENDED))
    idle = deadline_decision(suspended, [], 7, at(995))
    assert idle.settle is not None
    assert idle.settle.outcome == Reason.NOTHING_TO_SAVE
    sibling = deadline_view(recovery={"targetLevel": "sibling"})
    assert deadline_decision(sibling, [], 7, at(900)).create is None
    settled = deadline_decision(sibling, [], 7, at(995)).settle
    assert settled is not None
    assert settled.outcome == Reason.NOTHING_TO_SAVE


def test_unsetting_must_save_by_says_so_only_where_a_condition_was_shown() -> None:
    assert deadline_decision(view(), [], 7, at(0)).condition is None
    shown = rollout_set(status={})
    shown.status.conditions.append(
        api.Condition(
            type="DeadlineSaved",
            status=api.ConditionStatus.FALSE,
            reason="Waiting",
            last_transition_time=T0,
        )
    )
    decision = deadline_decision(SetView.from_set(shown, live_pods=1), [], 7, at(0))
    assert decision.condition is not None
    assert decision.condition.reason == Reason.NO_DEADLINE


def test_deadline_records_survive_the_annotation_and_garbage_is_ignored() -> None:
    record = DeadlineRecord(at(1000), Reason.MISSED, "c", saved=False, message="late by 3s")
    assert DeadlineRecord.from_annotation(record.to_annotation()) == record
    for garbage in ("", "{", "[]", '{"mustSaveBy": "x", "outcome": "Saved"}', '{"outcome": 1}'):
        assert DeadlineRecord.from_annotation(garbage) is None
