"""The checkpoint policy's decisions (pure): every trigger, the deadline, suspend, retention.

Time is an argument (`T0 + seconds`), so each test states exactly when it looks.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError
from rollout_operator.decide.policy import (
    ANNOTATION_DEADLINE_OUTCOME,
    DEFAULT_RESERVE_SECONDS,
    EVICTION_COMMIT_MARGIN_SECONDS,
    CheckpointView,
    DeadlineRecord,
    Reason,
    SetView,
    SuspendAction,
    TerminatingPod,
    deadline_decision,
    eviction_decision,
    eviction_holds,
    eviction_prepare_deadline,
    interval_decision,
    latest_after_delete,
    plan,
    retention,
    save_reserve_seconds,
    suspend_decision,
    trainer_step_decision,
)
from rollout_operator.model import api, crdgen
from rollout_operator.model.api import CheckpointPhase, Trigger
from testsupport import builders

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def stamp(seconds: float) -> str:
    return api.format_time(at(seconds))


def rollout_set(
    *,
    policy: dict[str, Any] | None = None,
    recovery: dict[str, Any] | None = None,
    suspend: bool = False,
    status: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
    ready_since: float | None = 0.0,
    suspended: tuple[bool, str] | None = None,
) -> api.RolloutSet:
    conditions: list[dict[str, Any]] = []
    if ready_since is not None:
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllParticipantsReady",
                "lastTransitionTime": stamp(ready_since),
            }
        )
    if suspended is not None:
        conditions.append(
            {
                "type": "Suspended",
                "status": "True" if suspended[0] else "False",
                "reason": suspended[1],
                "lastTransitionTime": stamp(0),
            }
        )
    return builders.rollout_set(
        name="math",
        namespace="team",
        uid=None,
        annotations=annotations or {},
        participants=[
            builders.participant("environment", None, container_name="server", image="rollout:dev")
        ],
        volume={"hostPath": {"path": "/ckpt"}},
        checkpointPolicy=policy or {},
        recovery=recovery or {},
        suspend=suspend,
        status={"attempt": 3, "createdAttempt": 3, "conditions": conditions, **(status or {})},
    )


def view(live_pods: int = 4, **kwargs: Any) -> SetView:
    return SetView.from_set(rollout_set(**kwargs), live_pods=live_pods)


def ckpt(
    name: str,
    created: float,
    *,
    trigger: Trigger = Trigger.MANUAL,
    completed: float | None = None,
    ready: bool = False,
    failed: bool = False,
) -> CheckpointView:
    phase = (
        CheckpointPhase.READY
        if ready
        else CheckpointPhase.FAILED
        if failed
        else CheckpointPhase.PREPARING
    )
    return CheckpointView(
        name=name,
        trigger=trigger,
        created=at(created),
        phase=phase,
        ready=ready,
        failed=failed,
        completed=at(completed) if completed is not None else None,
        failure="PrepareTimeout: 1 episode(s) were not parked" if failed else "",
    )


# --- the save reserve ---------------------------------------------------------------------------


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


# --- trainer checkpoints ------------------------------------------------------------------------


def test_a_new_trainer_step_creates_a_trainer_checkpoint_once() -> None:
    decision = trainer_step_decision(view(annotations={api.ANNOTATION_TRAINER_STEP: "120"}))
    assert decision.create is not None
    assert decision.create.name == "math-step-120"
    assert decision.create.trigger is Trigger.TRAINER_CHECKPOINT
    assert decision.create.trainer_step == 120
    assert decision.record_step == 120
    again = view(annotations={api.ANNOTATION_TRAINER_STEP: "120"}, status={"lastTrainerStep": 120})
    assert trainer_step_decision(again).create is None


def test_trainer_steps_make_no_checkpoint_when_off_or_at_sibling_level() -> None:
    annotations = {api.ANNOTATION_TRAINER_STEP: "7"}
    off = view(annotations=annotations, policy={"onTrainerCheckpoint": False, "intervalSeconds": 9})
    sibling = view(annotations=annotations, recovery={"targetLevel": "sibling"})
    for decision in (trainer_step_decision(off), trainer_step_decision(sibling)):
        assert decision.create is None
        assert decision.note is not None
        assert decision.note.reason == Reason.TRAINER_STEP_IGNORED
    assert "onTrainerCheckpoint is false" in str(trainer_step_decision(off).note)
    assert "sibling" in str(trainer_step_decision(sibling).note)


def test_an_invalid_trainer_step_is_reported_not_guessed() -> None:
    decision = trainer_step_decision(view(annotations={api.ANNOTATION_TRAINER_STEP: "step-7"}))
    assert decision.create is None
    assert decision.note is not None
    assert decision.note.warning
    assert decision.note.reason == Reason.INVALID_TRAINER_STEP
    assert "whole number" in decision.note.message


# --- interval -----------------------------------------------------------------------------------


def test_interval_counts_from_the_end_of_the_last_checkpoint() -> None:
    rset = view(policy={"intervalSeconds": 60})
    last = [ckpt("a", 100, completed=130, ready=True)]
    waiting = interval_decision(rset, last, at(150))
    assert waiting.create is None
    assert waiting.wake_at == at(190)
    due = interval_decision(rset, last, at(190))
    assert due.create is not None
    assert due.create.trigger is Trigger.INTERVAL
    assert due.create.name == "math-interval-20261129-120310"


def test_interval_counts_from_when_the_attempt_became_ready() -> None:
    rset = view(policy={"intervalSeconds": 60}, ready_since=500)
    assert interval_decision(rset, [ckpt("a", 0, completed=5, ready=True)], at(520)).wake_at == at(
        560
    )


def test_no_interval_tick_while_a_checkpoint_runs_or_the_set_does_not_run() -> None:
    running = [ckpt("a", 0, completed=5, ready=True), ckpt("b", 100)]
    assert interval_decision(view(policy={"intervalSeconds": 10}), running, at(500)) == (
        interval_decision(view(policy={"intervalSeconds": 10}), running, at(501))
    )
    assert interval_decision(view(policy={"intervalSeconds": 10}), running, at(500)).create is None
    for stopped in (
        view(policy={"intervalSeconds": 10}, ready_since=None),
        view(policy={"intervalSeconds": 10}, suspend=True),
        view(policy={"intervalSeconds": 10}, status={"recovery": recovery_status()}),
    ):
        decision = interval_decision(stopped, [], at(500))
        assert decision.create is None
        assert decision.wake_at is None


def recovery_status(checkpoint: str | None = None) -> dict[str, Any]:
    body = {
        "phase": "Restoring",
        "fromAttempt": 3,
        "targetAttempt": 4,
        "startedAt": stamp(0),
    }
    if checkpoint:
        body["checkpoint"] = checkpoint
    return body


# --- deadline -----------------------------------------------------------------------------------


def deadline_view(
    must: float = 1000, durations: list[float] | None = None, **kwargs: Any
) -> SetView:
    policy = {"mustSaveBy": stamp(must), "afterDeadline": "Continue", **kwargs.pop("policy", {})}
    status = {"recentCheckpointSeconds": durations or [4.0] * 5, **kwargs.pop("status", {})}
    return view(policy=policy, status=status, **kwargs)


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


# --- suspend ------------------------------------------------------------------------------------


def test_suspend_checkpoints_first_then_releases_the_pods() -> None:
    rset = view(suspend=True)
    first = suspend_decision(rset, [])
    assert first.action is SuspendAction.CHECKPOINT
    assert first.create is not None
    assert first.create.name == "math-suspend-a3"
    assert first.create.trigger is Trigger.SUSPEND
    assert first.condition is not None
    assert first.condition.reason == Reason.SUSPENDING
    running = suspend_decision(rset, [ckpt("math-suspend-a3", 10)])
    assert running.action is SuspendAction.WAIT
    assert running.create is None
    done = suspend_decision(rset, [ckpt("math-suspend-a3", 10, completed=12, ready=True)])
    assert done.action is SuspendAction.RELEASE
    assert done.condition is not None
    assert done.condition.status is True
    assert "math-suspend-a3 holds the state" in done.condition.message


def test_a_failed_suspend_checkpoint_still_releases_and_names_what_a_resume_restores() -> None:
    rset = view(suspend=True, status={"latestCheckpoint": "older"})
    decision = suspend_decision(rset, [ckpt("math-suspend-a3", 10, completed=12, failed=True)])
    assert decision.action is SuspendAction.RELEASE
    assert decision.condition is not None
    assert "a resume restores older" in decision.condition.message


def test_suspend_waits_for_a_running_recovery() -> None:
    rset = view(suspend=True, status={"recovery": recovery_status()})
    assert suspend_decision(rset, []).action is SuspendAction.WAIT


def test_suspend_without_pods_is_immediate_and_stays_released() -> None:
    assert suspend_decision(view(suspend=True, live_pods=0), []).action is SuspendAction.RELEASE
    done = view(suspend=True, live_pods=0, suspended=(True, Reason.SUSPENDED))
    assert suspend_decision(done, []).action is SuspendAction.NONE
    stray = view(suspend=True, live_pods=1, suspended=(True, Reason.SUSPENDED))
    assert suspend_decision(stray, []).action is SuspendAction.RELEASE


def test_unsuspend_resumes_and_withdrawn_suspend_is_reported() -> None:
    resumed = suspend_decision(view(live_pods=0, suspended=(True, Reason.SUSPENDED)), [])
    assert resumed.action is SuspendAction.RESUME
    assert resumed.condition is not None
    assert resumed.condition.reason == Reason.RESUMED
    withdrawn = suspend_decision(view(suspended=(False, Reason.SUSPENDING)), [])
    assert withdrawn.condition is not None
    assert withdrawn.condition.reason == Reason.SUSPEND_CANCELLED
    assert suspend_decision(view(), []).action is SuspendAction.NONE


def test_after_deadline_suspend_uses_the_deadline_checkpoint() -> None:
    own = "math-deadline-20261129-121640"
    rset = deadline_view(policy={"afterDeadline": "Suspend"})
    done = [ckpt(own, 993, trigger=Trigger.DEADLINE, completed=997, ready=True)]
    decided = plan(rset, done, at(998))
    assert decided.settle is not None
    assert decided.settle.checkpoint == own
    assert decided.suspend is SuspendAction.RELEASE
    assert decided.creates == []
    suspended = next(c for c in decided.conditions if c.type == "Suspended")
    assert suspended.reason == Reason.DEADLINE_REACHED
    assert own in suspended.message
    assert "later mustSaveBy" in suspended.message


def test_after_deadline_suspend_lifts_when_the_deadline_moves() -> None:
    record = DeadlineRecord(at(1000), Reason.SAVED, "x", saved=True)
    annotations = {ANNOTATION_DEADLINE_OUTCOME: record.to_annotation()}
    still = deadline_view(
        policy={"afterDeadline": "Suspend"},
        annotations=annotations,
        suspended=(True, Reason.DEADLINE_REACHED),
        live_pods=0,
    )
    assert suspend_decision(still, []).action is SuspendAction.NONE
    moved = deadline_view(
        must=9000,
        policy={"afterDeadline": "Suspend"},
        annotations=annotations,
        suspended=(True, Reason.DEADLINE_REACHED),
        live_pods=0,
    )
    assert suspend_decision(moved, []).action is SuspendAction.RESUME


# --- eviction -----------------------------------------------------------------------------------


def terminating(
    attempt: int = 3, grace: int = 20, deletion: float = 120, name: str = "math-model-0-a3"
) -> TerminatingPod:
    return TerminatingPod(name=name, attempt=attempt, deletion=at(deletion), grace_seconds=grace)


def test_an_evicted_pod_of_the_current_attempt_gets_one_eviction_checkpoint() -> None:
    create = eviction_decision(view(), terminating())
    assert create is not None
    assert create.name == "math-evict-a3"
    assert create.trigger is Trigger.EVICTION
    assert "grace period 20s" in create.why


@pytest.mark.parametrize(
    ("rset", "pod"),
    [
        (view(policy={"onEviction": False}), terminating()),
        (view(), terminating(attempt=2)),
        (view(), terminating(grace=1)),
        (view(suspend=True), terminating()),
        (view(suspended=(True, Reason.SUSPENDED)), terminating()),
        (view(status={"recovery": recovery_status()}), terminating()),
        (view(recovery={"targetLevel": "sibling"}), terminating()),
    ],
    ids=["off", "old-attempt", "no-grace", "suspending", "suspended", "recovering", "sibling"],
)
def test_pods_the_operator_deletes_itself_are_not_evictions(
    rset: SetView, pod: TerminatingPod
) -> None:
    assert eviction_decision(rset, pod) is None


def test_recovery_holds_an_evicted_pod_until_its_checkpoint_finished_or_grace_ended() -> None:
    pods = [terminating(), terminating(grace=1, name="forced")]
    assert eviction_holds(view(), pods, [], at(100)) == {"math-model-0-a3"}
    assert eviction_holds(view(), pods, [ckpt("math-evict-a3", 101)], at(102)) == {
        "math-model-0-a3"
    }
    finished = [ckpt("math-evict-a3", 101, completed=105, ready=True)]
    assert eviction_holds(view(), pods, finished, at(106)) == frozenset()
    assert eviction_holds(view(), pods, [], at(120)) == frozenset()


def test_an_eviction_prepare_ends_before_the_evicted_pod_is_killed() -> None:
    # Pod killed at t=120 (20 s grace from t=100); the prepare starts at t=101 with 300 s of
    # prepareTimeoutSeconds: the grace period decides, less the commit's margin.
    deadline = eviction_prepare_deadline(at(101), 300, [terminating()], attempt=3)
    assert deadline.at == at(120 - EVICTION_COMMIT_MARGIN_SECONDS)
    assert deadline.killed == terminating()
    assert "pod math-model-0-a3 is killed at 2026-11-29T12:02:00Z" in deadline.why
    assert f"{EVICTION_COMMIT_MARGIN_SECONDS:g}s before" in deadline.why


def test_an_eviction_prepare_keeps_a_shorter_prepare_timeout() -> None:
    deadline = eviction_prepare_deadline(at(101), 10, [terminating()], attempt=3)
    assert deadline.at == at(111)
    assert deadline.killed is None
    assert deadline.why == ""


def test_the_first_kill_among_the_attempts_terminating_pods_decides() -> None:
    # A drain evicts several pods; pods of another attempt or already stopped do not count.
    pods = [
        terminating(deletion=130, name="math-env-0-a3"),
        terminating(deletion=115, name="math-model-0-a3"),
        terminating(attempt=2, deletion=105, name="math-model-0-a2"),
        TerminatingPod("math-agent-0-a3", 3, at(104), 20, finished=True),
    ]
    deadline = eviction_prepare_deadline(at(101), 300, pods, attempt=3)
    assert deadline.killed is not None
    assert deadline.killed.name == "math-model-0-a3"
    assert deadline.at == at(115 - EVICTION_COMMIT_MARGIN_SECONDS)


def test_an_eviction_deadline_can_be_past_already() -> None:
    """A checkpoint that queued until its pod's grace period ran out: the deadline lies before
    `now`, and the flow fails it (GracePeriodTooShort) instead of preparing."""
    deadline = eviction_prepare_deadline(at(119), 300, [terminating()], attempt=3)
    assert deadline.at < at(119)
    assert deadline.killed is not None


def test_without_a_terminating_pod_the_prepare_timeout_applies() -> None:
    assert eviction_prepare_deadline(at(101), 300, [], attempt=3).at == at(401)
    assert eviction_prepare_deadline(at(101), 300, [terminating()], attempt=None).at == at(401)


def test_terminating_pods_are_read_from_the_wire_form() -> None:
    pod = {
        "metadata": {
            "name": "p",
            "labels": {api.LABEL_ATTEMPT: "4"},
            "deletionTimestamp": stamp(30),
            "deletionGracePeriodSeconds": 20,
        },
        "status": {"phase": "Running"},
    }
    assert TerminatingPod.from_pod(pod, api.LABEL_ATTEMPT) == TerminatingPod(
        "p", 4, at(30), 20, False
    )
    del pod["metadata"]["deletionTimestamp"]
    assert TerminatingPod.from_pod(pod, api.LABEL_ATTEMPT) is None


# --- retention ----------------------------------------------------------------------------------


def test_retention_orders_checkpoints_completed_within_one_second() -> None:
    # Three checkpoints Ready in the same second: completedAt keeps microseconds (MicroTime),
    # so the oldest one goes, whatever order the API lists them in.
    completions = {"c3": 20.5, "c2": 20.1, "c4": 20.9}
    checkpoints = [ckpt(n, 10, completed=t, ready=True) for n, t in completions.items()]
    assert retention(checkpoints, 2, []) == ["c2"]
    status = api.RolloutCheckpointStatus(completed_at=at(20.5))
    wire = api.dump(status)["completedAt"]
    assert wire.endswith(".500000Z")
    assert api.RolloutCheckpointStatus.model_validate({"completedAt": wire}).completed_at == at(
        20.5
    )


def test_retention_keeps_the_newest_ready_and_failed_and_never_the_protected() -> None:
    checkpoints = [
        ckpt("r1", 0, completed=1, ready=True),
        ckpt("r2", 10, completed=11, ready=True),
        ckpt("r3", 20, completed=21, ready=True),
        ckpt("r4", 30, completed=31, ready=True),
        ckpt("f1", 5, completed=6, failed=True),
        ckpt("f2", 15, completed=16, failed=True),
        ckpt("f3", 25, completed=26, failed=True),
        ckpt("running", 40),
    ]
    assert sorted(retention(checkpoints, 2, [None])) == ["f1", "r1", "r2"]
    assert sorted(retention(checkpoints, 2, ["r1", None])) == ["f1", "r2"]
    assert retention(checkpoints, 10, []) == []


def test_latest_moves_to_the_newest_other_ready_checkpoint() -> None:
    checkpoints = [
        ckpt("old", 0, completed=1, ready=True),
        ckpt("new", 10, completed=11, ready=True),
        ckpt("bad", 20, completed=21, failed=True),
    ]
    newest = latest_after_delete(checkpoints, "new")
    assert newest is not None
    assert newest.name == "old"
    assert latest_after_delete(checkpoints[:1], "old") is None


# --- one pass -----------------------------------------------------------------------------------


def test_a_trainer_checkpoint_resets_the_interval_instead_of_running_beside_it() -> None:
    rset = view(policy={"intervalSeconds": 10}, annotations={api.ANNOTATION_TRAINER_STEP: "3"})
    decided = plan(rset, [ckpt("a", 0, completed=1, ready=True)], at(500))
    assert [c.trigger for c in decided.creates] == [Trigger.TRAINER_CHECKPOINT]
    assert decided.last_trainer_step == 3


def test_a_pass_reports_the_reserve_retention_and_failed_records() -> None:
    rset = view(policy={"keepLatest": 1}, status={"recentCheckpointSeconds": [4.0, 4.0]})
    checkpoints = [
        ckpt("a", 0, completed=1, ready=True),
        ckpt("b", 5, completed=6, ready=True),
        ckpt("c", 7, completed=8, failed=True),
    ]
    decided = plan(rset, checkpoints, at(10))
    assert decided.reserve == 7
    assert decided.delete == ["a"]
    assert decided.remove_records == ["c"]


def test_a_checkpoint_object_is_read_with_its_outcome() -> None:
    raw = {
        "metadata": {"name": "c1", "creationTimestamp": stamp(5)},
        "spec": {"rolloutSet": "math", "trigger": "Eviction"},
        "status": {
            "phase": "Failed",
            "completedAt": stamp(9),
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "ParticipantLost",
                    "message": "pod gone",
                    "lastTransitionTime": stamp(9),
                }
            ],
        },
    }
    got = CheckpointView.from_object(raw)
    assert got.failed
    assert not got.ready
    assert got.finished
    assert got.created == at(5)
    assert got.completed == at(9)
    assert got.failure == "ParticipantLost: pod gone"


# --- validation -------------------------------------------------------------------------------


def test_interval_at_sibling_level_is_refused_with_the_reason() -> None:
    body = rollout_set().spec.model_dump(by_alias=True, mode="json")
    body["recovery"] = {"targetLevel": "sibling"}
    body["checkpointPolicy"] = {"intervalSeconds": 60}
    with pytest.raises(ValidationError) as caught:
        api.RolloutSetSpec.model_validate(body)
    assert api.RULE_SIBLING_INTERVAL.message in str(caught.value)
    assert api.RULE_SIBLING_INTERVAL.cel in str(crdgen.crd(crdgen.ROLLOUT_SET))
