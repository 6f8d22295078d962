"""All the checkpoint policies for one look at a set (docs/policy.md), in the order where their
decisions meet; `flows.policypass.PolicyPass` carries the plan out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from ...model.reasons import Reason
from .deadline import deadline_decision, save_reserve_seconds
from .interval import interval_decision
from .retention import retention
from .suspend import SuspendAction, suspend_decision
from .trainerstep import trainer_step_decision
from .views import CheckpointView, ConditionChange, Create, DeadlineRecord, Note, SetView


@dataclass(frozen=True)
class PolicyPlan:
    """Everything one look at a set decided; `flows.policypass.PolicyPass` carries it out."""

    reserve: int
    creates: list[Create] = field(default_factory=list)
    conditions: list[ConditionChange] = field(default_factory=list)
    last_trainer_step: int | None = None
    settle: DeadlineRecord | None = None
    suspend: SuspendAction = SuspendAction.NONE
    delete: list[str] = field(default_factory=list)
    remove_records: list[str] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    wake_at: datetime | None = None


def plan(view: SetView, checkpoints: Sequence[CheckpointView], now: datetime) -> PolicyPlan:
    """Decide everything for one set at `now`.

    Order matters where decisions meet: the deadline is decided before the suspend (a deadline
    settled in this pass suspends in the same pass, with its checkpoint), and the trainer step
    before the interval (its checkpoint resets the timer, so both never start together).
    """
    reserve = save_reserve_seconds(view.durations)
    if (
        view.deadline_reason == Reason.SAVING
        and view.stored_reserve is not None
        and not view.deadline_settled
    ):
        # A save for the deadline is under way: its start time stays where it was. Otherwise
        # the saving checkpoint's own duration would grow the reserve, move the start earlier
        # and let an older checkpoint, finished before the real start, "cover" the deadline.
        reserve = view.stored_reserve
    creates: list[Create] = []
    conditions: list[ConditionChange] = []
    notes: list[Note] = []
    wakes: list[datetime] = []

    trainer = trainer_step_decision(view)
    if trainer.create is not None:
        creates.append(trainer.create)
    if trainer.note is not None:
        notes.append(trainer.note)

    deadline = deadline_decision(view, checkpoints, reserve, now)
    if deadline.condition is not None:
        conditions.append(deadline.condition)
    if deadline.create is not None:
        creates.append(deadline.create)
    if deadline.wake_at is not None:
        wakes.append(deadline.wake_at)
    if deadline.settle is not None:
        view = _with_record(view, deadline.settle)

    if not creates:
        interval = interval_decision(view, checkpoints, now)
        if interval.create is not None:
            creates.append(interval.create)
        if interval.wake_at is not None:
            wakes.append(interval.wake_at)

    suspend = suspend_decision(view, checkpoints)
    if suspend.condition is not None:
        conditions.append(suspend.condition)
    if suspend.create is not None and not creates:
        # Another checkpoint starts in this pass: the suspend is decided again once it exists
        # (a deadline checkpoint then settles the deadline and serves as the suspend's).
        creates.append(suspend.create)

    return PolicyPlan(
        reserve=reserve,
        creates=creates,
        conditions=conditions,
        last_trainer_step=trainer.record_step,
        settle=deadline.settle,
        suspend=suspend.action,
        delete=retention(
            checkpoints, view.policy.keep_latest, (view.latest_checkpoint, view.restoring)
        ),
        remove_records=[c.name for c in checkpoints if c.failed],
        notes=notes,
        wake_at=min(wakes) if wakes else None,
    )


def _with_record(view: SetView, record: DeadlineRecord) -> SetView:
    return replace(view, deadline_record=record)
