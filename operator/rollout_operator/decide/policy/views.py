"""What the checkpoint policies read and decide (docs/policy.md): the views of a RolloutSet and of
its RolloutCheckpoints, the settled outcome of a deadline, and the decisions (`Create`,
`ConditionChange`, `Note`) every policy returns."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from pydantic import ValidationError

from ...model.api import (
    ANNOTATION_TRAINER_STEP,
    GROUP,
    LABEL_KUEUE_QUEUE,
    AfterDeadline,
    CheckpointConditionType,
    CheckpointPhase,
    CheckpointPolicy,
    ConditionStatus,
    RolloutCheckpoint,
    RolloutSet,
    SetConditionType,
    TargetLevel,
    Trigger,
    format_time,
)

logger = logging.getLogger(__name__)

ANNOTATION_DEADLINE_OUTCOME: Final = f"{GROUP}/deadline-outcome"
"""On a RolloutSet: the settled outcome of the current `mustSaveBy` (JSON, see `DeadlineRecord`).

A deadline is settled once; without this record a later look could not tell "saved in time by
a checkpoint that retention has since deleted" from "never saved", and after a resume a set
suspended by its deadline would be suspended again."""


# --- views --------------------------------------------------------------------------------------


def parse_time(value: object) -> datetime | None:
    """A `metav1.Time` from the wire (or a datetime already), in UTC; None when absent."""
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, str) and value:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
    return None


def _condition_true(conditions: Iterable[Any], type_: str) -> bool:
    return any(c.type == type_ and c.status is ConditionStatus.TRUE for c in conditions)


@dataclass(frozen=True)
class CheckpointView:
    """What the policy needs to know about one RolloutCheckpoint of the set."""

    name: str
    trigger: Trigger
    created: datetime
    phase: CheckpointPhase | None = None
    ready: bool = False
    failed: bool = False
    completed: datetime | None = None
    attempt: int | None = None
    trainer_step: int | None = None
    failure: str = ""
    """The Failed condition's reason and message, for the messages that name this checkpoint."""
    deleting: bool = False
    total_seconds: float | None = None
    """Creation of the first phase to Ready (`status.durations.totalSeconds`)."""

    @property
    def finished(self) -> bool:
        return self.ready or self.failed

    @classmethod
    def from_object(cls, raw: Mapping[str, Any]) -> CheckpointView:
        """From a RolloutCheckpoint as the API server returns it (wire form)."""
        ckpt = RolloutCheckpoint.model_validate(raw)
        meta = raw.get("metadata") or {}
        created = parse_time(meta.get("creationTimestamp")) or datetime.fromtimestamp(0, UTC)
        conditions = ckpt.status.conditions
        failed_condition = next(
            (
                c
                for c in conditions
                if c.type == CheckpointConditionType.FAILED.value
                and c.status is ConditionStatus.TRUE
            ),
            None,
        )
        ready = _condition_true(conditions, CheckpointConditionType.READY.value)
        failed = failed_condition is not None or ckpt.status.phase is CheckpointPhase.FAILED
        return cls(
            name=ckpt.metadata.name,
            trigger=ckpt.spec.trigger,
            created=created,
            phase=ckpt.status.phase,
            # Ready=True is written before the final resume; the phase says when it is over.
            ready=ready and ckpt.status.phase is CheckpointPhase.READY,
            failed=failed and not ready,
            completed=ckpt.status.completed_at,
            attempt=ckpt.status.attempt,
            trainer_step=ckpt.spec.trainer_step,
            failure=(
                f"{failed_condition.reason}: {failed_condition.message}"
                if failed_condition is not None
                else ""
            ),
            deleting=meta.get("deletionTimestamp") is not None,
            total_seconds=(
                ckpt.status.durations.total_seconds if ckpt.status.durations is not None else None
            ),
        )


def checkpoint_views(raw: Iterable[Mapping[str, Any]]) -> list[CheckpointView]:
    """The views of the RolloutCheckpoints given in wire form; an unreadable one is left out
    (and logged)."""
    views: list[CheckpointView] = []
    for obj in raw:
        try:
            views.append(CheckpointView.from_object(obj))
        except ValidationError as error:
            name = (obj.get("metadata") or {}).get("name")
            logger.warning("RolloutCheckpoint %s is unreadable, ignored: %s", name, error)
    return views


@dataclass(frozen=True)
class DeadlineRecord:
    """The settled outcome of one `mustSaveBy` (kept in `ANNOTATION_DEADLINE_OUTCOME`)."""

    must_save_by: datetime
    outcome: str
    checkpoint: str | None = None
    saved: bool = False
    message: str = ""
    """The DeadlineSaved condition's message: written again from here on every look, so the
    condition cannot be left behind by a status write that lost a race."""

    def to_annotation(self) -> str:
        return json.dumps(
            {
                "mustSaveBy": format_time(self.must_save_by),
                "outcome": self.outcome,
                "checkpoint": self.checkpoint,
                "saved": self.saved,
                "message": self.message,
            },
            sort_keys=True,
        )

    def condition(self) -> ConditionChange:
        return ConditionChange(
            SetConditionType.DEADLINE_SAVED.value, self.saved, self.outcome, self.message
        )

    @classmethod
    def from_annotation(cls, value: str | None) -> DeadlineRecord | None:
        """None for a missing or unreadable record (then the deadline is decided afresh)."""
        if not value:
            return None
        try:
            data = json.loads(value)
            when = parse_time(data["mustSaveBy"])
            outcome = data["outcome"]
            checkpoint = data.get("checkpoint")
            message = data.get("message")
        except (ValueError, KeyError, TypeError):
            return None
        if when is None or not isinstance(outcome, str) or not re.match(r"^[A-Za-z]+$", outcome):
            return None
        return cls(
            when,
            outcome,
            checkpoint if isinstance(checkpoint, str) else None,
            saved=data.get("saved") is True,
            message=message if isinstance(message, str) else "",
        )


@dataclass(frozen=True)
class SetView:
    """What the policy needs to know about the RolloutSet (spec, status, annotations, pods)."""

    name: str
    policy: CheckpointPolicy
    target_level: TargetLevel
    suspend: bool
    attempt: int | None
    created_attempt: int | None
    recovering: bool
    ready_since: datetime | None
    """When the set last became Ready (None while it is not)."""
    suspended: bool
    suspend_condition_reason: str | None
    has_deadline_condition: bool
    last_trainer_step: int | None
    trainer_step_annotation: str | None
    deadline_record: DeadlineRecord | None
    durations: tuple[float, ...]
    latest_checkpoint: str | None
    restoring: str | None
    live_pods: int
    deleting: bool = False
    deadline_reason: str | None = None
    """The reason on the DeadlineSaved condition as last written (Saving: a save is under way)."""
    stored_reserve: int | None = None
    """`status.saveReserveSeconds` as last written."""
    queued: bool = False
    """Labelled for a Kueue LocalQueue: `spec.suspend` is Kueue's (through the queue pass)."""

    @classmethod
    def from_set(cls, rset: RolloutSet, *, live_pods: int) -> SetView:
        status = rset.status
        ready = next((c for c in status.conditions if c.type == SetConditionType.READY.value), None)
        suspended = next(
            (c for c in status.conditions if c.type == SetConditionType.SUSPENDED.value), None
        )
        annotations = rset.metadata.annotations
        return cls(
            name=rset.metadata.name,
            policy=rset.spec.checkpoint_policy,
            target_level=rset.spec.recovery.target_level,
            suspend=rset.spec.suspend,
            attempt=status.attempt,
            created_attempt=status.created_attempt,
            recovering=status.recovery is not None,
            ready_since=(
                ready.last_transition_time
                if ready is not None and ready.status is ConditionStatus.TRUE
                else None
            ),
            suspended=suspended is not None and suspended.status is ConditionStatus.TRUE,
            suspend_condition_reason=suspended.reason if suspended is not None else None,
            has_deadline_condition=any(
                c.type == SetConditionType.DEADLINE_SAVED.value for c in status.conditions
            ),
            last_trainer_step=status.last_trainer_step,
            trainer_step_annotation=annotations.get(ANNOTATION_TRAINER_STEP),
            deadline_record=DeadlineRecord.from_annotation(
                annotations.get(ANNOTATION_DEADLINE_OUTCOME)
            ),
            durations=tuple(status.recent_checkpoint_seconds),
            latest_checkpoint=status.latest_checkpoint,
            restoring=status.recovery.checkpoint if status.recovery is not None else None,
            live_pods=live_pods,
            deleting=rset.metadata.deletion_timestamp is not None,
            deadline_reason=next(
                (
                    c.reason
                    for c in status.conditions
                    if c.type == SetConditionType.DEADLINE_SAVED.value
                ),
                None,
            ),
            stored_reserve=status.save_reserve_seconds,
            queued=bool(rset.metadata.labels.get(LABEL_KUEUE_QUEUE)),
        )

    @property
    def restorable(self) -> bool:
        """Whether a recovery of this set ever restores a checkpoint (turn level only)."""
        return self.target_level is TargetLevel.TURN

    @property
    def deadline_settled(self) -> bool:
        """The current `mustSaveBy` has its outcome recorded."""
        must = self.policy.must_save_by
        record = self.deadline_record
        # Compared as written on the wire: whole seconds, whatever precision the spec had.
        return (
            must is not None
            and record is not None
            and format_time(record.must_save_by) == format_time(must)
        )

    @property
    def suspend_by_deadline(self) -> bool:
        """`afterDeadline: Suspend` applies: the current deadline is settled."""
        return self.policy.after_deadline is AfterDeadline.SUSPEND and self.deadline_settled

    @property
    def wants_suspended(self) -> bool:
        return self.suspend or self.suspend_by_deadline

    @property
    def runs(self) -> bool:
        """Whether the set runs an attempt a timer checkpoint could capture now."""
        return (
            not self.deleting
            and not self.recovering
            and not self.wants_suspended
            and not self.suspended
            and self.ready_since is not None
        )


def name_stamp(when: datetime) -> str:
    """A time as it appears in a checkpoint name (UTC, whole seconds)."""
    return when.astimezone(UTC).strftime("%Y%m%d-%H%M%S")


# --- decisions ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Create:
    """Create this RolloutCheckpoint (idempotent: the name is deterministic)."""

    name: str
    trigger: Trigger
    why: str
    trainer_step: int | None = None


@dataclass(frozen=True)
class ConditionChange:
    type: str
    status: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Note:
    """A Kubernetes Event worth posting on the set (deduplicated by the caller)."""

    reason: str
    message: str
    warning: bool = False
