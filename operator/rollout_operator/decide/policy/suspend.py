"""The suspend policy (`spec.suspend` and `afterDeadline: Suspend`, docs/policy.md): checkpoint,
then release every pod; and the resume back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from ...model.api import ConditionStatus, RolloutSet, SetConditionType, Trigger, format_time
from ...model.reasons import Reason
from .views import CheckpointView, ConditionChange, Create, SetView


def suspend_checkpoint_name(set_name: str, attempt: int) -> str:
    return f"{set_name}-suspend-a{attempt}"


class SuspendAction(StrEnum):
    NONE = "None"
    WAIT = "Wait"
    CHECKPOINT = "Checkpoint"
    RELEASE = "Release"
    """Mark Suspended=True, then delete every participant pod of the set."""
    RESUME = "Resume"
    """Suspended=False; the set's loop then starts a recovery to attempt + 1 that restores the
    latest checkpoint (`resume_due`)."""


@dataclass(frozen=True)
class SuspendDecision:
    action: SuspendAction = SuspendAction.NONE
    condition: ConditionChange | None = None
    create: Create | None = None


def resume_due(rset: RolloutSet, live_pods: int) -> bool:
    """Whether the set's loop should start the recovery of a resume now: the policy cleared
    Suspended (reason `Resumed`) of a set whose attempt had come up, none of its pods runs,
    and no recovery started or ended since the resume (the recovery owns `status.recovery`;
    the policy only says Suspended=False).

    A resume is a recovery to attempt + 1 that restores the latest Ready checkpoint into fresh
    pods, with reason `Resumed`: not a loss, so it counts in neither `restarts` nor the churn
    window. A set that never ran pods, or still runs some, needs none: the set's pass creates
    or keeps the attempt's pods."""
    status = rset.status
    if rset.spec.suspend or status.recovery is not None or live_pods:
        return False
    if status.created_attempt is None or status.created_attempt < (status.attempt or 1):
        return False
    suspended = next(
        (c for c in status.conditions if c.type == SetConditionType.SUSPENDED.value), None
    )
    if (
        suspended is None
        or suspended.status is not ConditionStatus.FALSE
        or suspended.reason != Reason.RESUMED
    ):
        return False
    last = status.last_recovery
    return last is None or last.completed_at <= suspended.last_transition_time


def _suspended_condition(status: bool, reason: str, message: str) -> ConditionChange:
    return ConditionChange(SetConditionType.SUSPENDED.value, status, reason, message)


def suspend_decision(view: SetView, checkpoints: Sequence[CheckpointView]) -> SuspendDecision:
    """`spec.suspend` and `afterDeadline: Suspend`: checkpoint, then release every pod; and back.

    The pods go only after the suspend checkpoint finished (Ready or Failed: a queueing system
    that suspends a set wants its resources back either way; the message says what a resume
    will restore). After a settled deadline its checkpoint is the suspend checkpoint: nothing is
    saved twice.
    """
    by_deadline = view.suspend_by_deadline and not view.suspend
    reason = Reason.DEADLINE_REACHED if by_deadline else Reason.SUSPENDED
    cause = (
        f"mustSaveBy {format_time(view.policy.must_save_by)} passed and afterDeadline is Suspend"
        if by_deadline and view.policy.must_save_by is not None
        else "Kueue holds the set (its Workload is not admitted)"
        if view.queued
        else "spec.suspend is true"
    )
    undo = (
        "set a later mustSaveBy, remove it, or set afterDeadline Continue to resume"
        if by_deadline
        else "Kueue resumes it when it admits the Workload again"
        if view.queued
        else "set spec.suspend false to resume"
    )
    if not view.wants_suspended:
        if view.suspended:
            return SuspendDecision(
                SuspendAction.RESUME,
                _suspended_condition(
                    False,
                    Reason.RESUMED,
                    "resumed: fresh pods restore the latest Ready checkpoint and continue",
                ),
            )
        if view.suspend_condition_reason == Reason.SUSPENDING:
            return SuspendDecision(
                SuspendAction.NONE,
                _suspended_condition(
                    False,
                    Reason.SUSPEND_CANCELLED,
                    "suspend was withdrawn before the pods were released; the set keeps running",
                ),
            )
        return SuspendDecision()
    if view.suspended:
        if view.live_pods and not view.recovering:
            return SuspendDecision(SuspendAction.RELEASE)
        return SuspendDecision()
    if view.recovering:
        return SuspendDecision(
            SuspendAction.WAIT,
            _suspended_condition(
                False,
                Reason.SUSPENDING,
                f"{cause}; waiting for the running recovery to finish before the suspend "
                "checkpoint",
            ),
        )

    def release(saved: str) -> SuspendDecision:
        return SuspendDecision(
            SuspendAction.RELEASE,
            _suspended_condition(True, reason, f"{cause}; {saved}; pods released. {undo}"),
        )

    if view.live_pods == 0 or view.attempt is None:
        return release("no participant pods ran")
    if not view.restorable:
        return release(
            "no checkpoint with recovery.targetLevel sibling (episodes restart after a resume)"
        )
    record = view.deadline_record
    if by_deadline and record is not None:
        if record.checkpoint:
            return release(f"checkpoint {record.checkpoint} (the deadline's) holds the state")
        return release(f"the deadline saved nothing ({record.outcome})")
    name = suspend_checkpoint_name(view.name, view.attempt)
    mine = next((c for c in checkpoints if c.name == name), None)
    if mine is None or not mine.finished:
        return SuspendDecision(
            SuspendAction.CHECKPOINT if mine is None else SuspendAction.WAIT,
            _suspended_condition(
                False,
                Reason.SUSPENDING,
                f"{cause}; saving checkpoint {name} before releasing the pods",
            ),
            Create(name, Trigger.SUSPEND, cause) if mine is None else None,
        )
    if mine.ready:
        return release(f"checkpoint {name} holds the state and a resume restores it")
    latest = view.latest_checkpoint
    fallback = f"a resume restores {latest}" if latest else "a resume starts episodes afresh"
    return release(f"the suspend checkpoint {name} failed ({mine.failure}); {fallback}")
