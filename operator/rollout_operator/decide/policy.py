"""The checkpoint policy, decided (`checkpointPolicy` and `suspend`: docs/policy.md).

Everything here is pure: views of a RolloutSet and of its RolloutCheckpoints go in, together with
`now`; decisions come out (which checkpoint to create under which name, what to delete, which
condition to show, when to look again). `flows.policypass` reads the objects and carries the
decisions out; the Kopf handlers in `handlers/policy.py` only wake it. Keeping the decisions pure is
what lets the unit tests drive a deadline, an overtaken wait or a suspend through every branch with
an injected clock and no API server.

Three rules shape every decision:

- **Names are deterministic.** Every checkpoint the policy creates is named after what caused it
  (`<set>-step-<N>`, `<set>-interval-<due time>`, `<set>-deadline-<mustSaveBy>`,
  `<set>-evict-a<attempt>`, `<set>-suspend-a<attempt>`), so an operator that crashed after the
  create and decides again gets "exists already" instead of a second checkpoint.
- **The state lives in the API.** What was decided before is read back from the objects (the
  checkpoints, the set's status and one annotation for a settled deadline), never kept in
  memory, so a restarted operator decides the same.
- **One checkpoint at a time per set** (docs/design.md#66-one-checkpoint-at-a-time): the policy
  never starts a timer checkpoint while another one of the set is unfinished; the checkpoint flow
  queues the others.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Final

from pydantic import ValidationError

from ..model.api import (
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

RESUMED_REASON: Final = "Resumed"
"""The recovery reason of a resume from suspend (it is not a loss)."""
ANNOTATION_DEADLINE_OUTCOME: Final = f"{GROUP}/deadline-outcome"
"""On a RolloutSet: the settled outcome of the current `mustSaveBy` (JSON, see `DeadlineRecord`).

A deadline is settled once; without this record a later look could not tell "saved in time by
a checkpoint that retention has since deleted" from "never saved", and after a resume a set
suspended by its deadline would be suspended again."""

DEFAULT_RESERVE_SECONDS: Final = 60
"""The reserve before any checkpoint of the set has been measured: generous, because a deadline
checkpoint that starts too early costs a minute of unsaved work, one that starts too late costs
every unfinished turn."""
RESERVE_MARGIN_SECONDS: Final = 2.0
"""Added to every estimate: the operator's own latency (watch event, daemon start, the status
writes of the flow) that no measured duration contains when the next checkpoint starts."""
RESERVE_FACTOR: Final = 1.25
"""The estimate is scaled up by this much: checkpoint cost grows with the work in flight."""
RESERVE_MAD_K: Final = 3.0
"""How many (MAD-estimated) standard deviations above the median the estimate reaches."""
RESERVE_RECENT: Final = 3
"""The longest of this many newest durations is always covered, so a slowdown raises the reserve
with the first slow checkpoint instead of after the median moves."""
MAD_TO_SIGMA: Final = 1.4826
"""Scales the median absolute deviation to a standard deviation for normal data."""

MIN_EVICTION_GRACE_SECONDS: Final = 3
"""A pod deleted with less grace than this gets no eviction checkpoint: it would be killed
before the prepare got anywhere (a forced delete, or the recovery's own short-grace stop)."""

EVICTION_COMMIT_MARGIN_SECONDS: Final = 2.0
"""An eviction checkpoint's prepare must end this long before the evicted pod is killed: the
commit (records fsynced, manifest written) still has to reach that pod. Commits of the
reference servers take well under a second; a pod killed mid-commit fails the checkpoint with
ParticipantLost."""

_STEP_PATTERN: Final = re.compile(r"^[0-9]{1,18}$")


class Reason:
    """Reasons of the conditions the policy writes on a RolloutSet (CamelCase, stable)."""

    # DeadlineSaved
    WAITING: Final = "Waiting"
    SAVING: Final = "Saving"
    SAVED: Final = "Saved"
    MISSED: Final = "Missed"
    CHECKPOINT_FAILED: Final = "CheckpointFailed"
    NOTHING_TO_SAVE: Final = "NothingToSave"
    NO_DEADLINE: Final = "NoDeadline"
    # Suspended
    SUSPENDING: Final = "Suspending"
    SUSPENDED: Final = "Suspended"
    DEADLINE_REACHED: Final = "DeadlineReached"
    RESUMED: Final = "Resumed"
    SUSPEND_CANCELLED: Final = "SuspendCancelled"
    # events
    INVALID_TRAINER_STEP: Final = "InvalidTrainerStep"
    TRAINER_STEP_IGNORED: Final = "TrainerStepIgnored"


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


# --- names --------------------------------------------------------------------------------------


def _stamp(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y%m%d-%H%M%S")


def trainer_checkpoint_name(set_name: str, step: int) -> str:
    return f"{set_name}-step-{step}"


def interval_checkpoint_name(set_name: str, due: datetime) -> str:
    return f"{set_name}-interval-{_stamp(due)}"


def deadline_checkpoint_name(set_name: str, must_save_by: datetime) -> str:
    return f"{set_name}-deadline-{_stamp(must_save_by)}"


def eviction_checkpoint_name(set_name: str, attempt: int) -> str:
    return f"{set_name}-evict-a{attempt}"


def suspend_checkpoint_name(set_name: str, attempt: int) -> str:
    return f"{set_name}-suspend-a{attempt}"


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


# --- the save reserve (docs/design.md#63-deadline) ------------------------------------------------


def save_reserve_seconds(
    durations: Sequence[float],
    *,
    default: int = DEFAULT_RESERVE_SECONDS,
    margin: float = RESERVE_MARGIN_SECONDS,
    factor: float = RESERVE_FACTOR,
) -> int:
    """How long before `mustSaveBy` the deadline checkpoint starts.

    Robust against one odd duration in either direction: the median plus `RESERVE_MAD_K` times
    the MAD-estimated spread (so a single fast checkpoint does not shrink it, and an outlier does
    not dominate it), but never less than the longest of the newest `RESERVE_RECENT` (so a
    slowdown counts at once), scaled by `factor` plus `margin`, rounded up to whole seconds.
    """
    usable = [d for d in durations if math.isfinite(d) and d >= 0]
    if not usable:
        return default
    median = statistics.median(usable)
    mad = statistics.median(abs(d - median) for d in usable)
    spread = median + RESERVE_MAD_K * MAD_TO_SIGMA * mad
    recent = max(usable[-RESERVE_RECENT:])
    return math.ceil(max(spread, recent) * factor + margin)


def deadline_start(must_save_by: datetime, reserve_seconds: int) -> datetime:
    """When the deadline checkpoint starts: `mustSaveBy - saveReserveSeconds`."""
    return must_save_by - timedelta(seconds=reserve_seconds)


# --- trainer checkpoints ------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerStepDecision:
    create: Create | None = None
    record_step: int | None = None
    """The step to store as `status.lastTrainerStep` (set together with the create)."""
    note: Note | None = None


def parse_trainer_step(value: str | None) -> int | None:
    if value is None or not _STEP_PATTERN.match(value.strip()):
        return None
    return int(value.strip())


def trainer_step_decision(view: SetView) -> TrainerStepDecision:
    """A TrainerCheckpoint for a newly reported trainer step, when the policy asks for one.

    A step at or below `status.lastTrainerStep` is done already (a re-applied manifest, an
    operator restart). With `targetLevel: sibling` the trainer's own checkpoint holds what a
    recovery needs, so nothing follows it (seed 000).
    """
    raw = view.trainer_step_annotation
    if raw is None:
        return TrainerStepDecision()
    step = parse_trainer_step(raw)
    if step is None:
        return TrainerStepDecision(
            note=Note(
                Reason.INVALID_TRAINER_STEP,
                f"annotation {ANNOTATION_TRAINER_STEP}={raw!r} is not a trainer step (a whole "
                'number such as "120"); no checkpoint was created. Write the step the trainer '
                "checkpoint was saved at.",
                warning=True,
            )
        )
    if view.last_trainer_step is not None and step <= view.last_trainer_step:
        return TrainerStepDecision()
    if view.target_level is TargetLevel.SIBLING:
        return TrainerStepDecision(
            note=Note(
                Reason.TRAINER_STEP_IGNORED,
                f"trainer step {step}: no checkpoint with recovery.targetLevel sibling (the "
                "trainer checkpoint already holds what a recovery needs)",
            )
        )
    if not view.policy.on_trainer_checkpoint:
        return TrainerStepDecision(
            note=Note(
                Reason.TRAINER_STEP_IGNORED,
                f"trainer step {step}: no checkpoint, checkpointPolicy.onTrainerCheckpoint is "
                "false",
            )
        )
    return TrainerStepDecision(
        create=Create(
            trainer_checkpoint_name(view.name, step),
            Trigger.TRAINER_CHECKPOINT,
            f"the trainer reported a trainer checkpoint at step {step}",
            trainer_step=step,
        ),
        record_step=step,
    )


# --- interval -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimedDecision:
    create: Create | None = None
    wake_at: datetime | None = None


def _unfinished(checkpoints: Iterable[CheckpointView]) -> list[CheckpointView]:
    return [c for c in checkpoints if not c.finished and not c.deleting]


def interval_decision(
    view: SetView, checkpoints: Sequence[CheckpointView], now: datetime
) -> TimedDecision:
    """An Interval checkpoint `intervalSeconds` after the last checkpoint of any trigger ended
    (or after the attempt became Ready, whichever is later).

    Counting from the end of the previous checkpoint means a tick can never fall inside a
    running checkpoint (no two at once, nothing queued behind a slow one), and a trainer or
    manual checkpoint resets the timer instead of being followed by a redundant one.
    """
    interval = view.policy.interval_seconds
    if interval is None or not view.runs or _unfinished(checkpoints):
        return TimedDecision()
    ends = [c.completed or c.created for c in checkpoints]
    assert view.ready_since is not None  # view.runs
    base = max([view.ready_since, *ends])
    due = base + timedelta(seconds=interval)
    if now < due:
        return TimedDecision(wake_at=due)
    return TimedDecision(
        create=Create(
            interval_checkpoint_name(view.name, due),
            Trigger.INTERVAL,
            f"intervalSeconds {interval} since {format_time(base)}",
        )
    )


# --- deadline -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeadlineDecision:
    condition: ConditionChange | None = None
    create: Create | None = None
    wake_at: datetime | None = None
    settle: DeadlineRecord | None = None
    """Record this outcome (the deadline is then decided for good)."""


def _deadline_condition(status: bool, reason: str, message: str) -> ConditionChange:
    return ConditionChange(SetConditionType.DEADLINE_SAVED.value, status, reason, message)


def _settled(
    must: datetime, outcome: str, checkpoint: str | None, status: bool, message: str
) -> DeadlineDecision:
    record = DeadlineRecord(must, outcome, checkpoint, saved=status, message=message)
    return DeadlineDecision(condition=record.condition(), settle=record)


def deadline_decision(
    view: SetView, checkpoints: Sequence[CheckpointView], reserve: int, now: datetime
) -> DeadlineDecision:
    """The `mustSaveBy` checkpoint: started `reserve` seconds early, never twice.

    From the start time S on, a checkpoint of any trigger that is running, or became Ready at
    or after S, covers the deadline: its state is as fresh as one the deadline could still get
    finished in time, so a deadline wait that another checkpoint overtook saves nothing. Only
    when nothing covers it does the deadline create its own checkpoint (late, if the operator
    got to it late: a late save beats none, and `Missed` says so).
    """
    must = view.policy.must_save_by
    if must is None:
        if view.has_deadline_condition:
            return DeadlineDecision(
                condition=_deadline_condition(False, Reason.NO_DEADLINE, "mustSaveBy is unset")
            )
        return DeadlineDecision()
    if view.deadline_settled:
        assert view.deadline_record is not None
        return DeadlineDecision(condition=view.deadline_record.condition())
    when = format_time(must)
    start = deadline_start(must, reserve)
    own = deadline_checkpoint_name(view.name, must)
    if not view.restorable:
        if now < start:
            return DeadlineDecision(
                condition=_deadline_condition(
                    False,
                    Reason.WAITING,
                    f"mustSaveBy {when}: recovery.targetLevel sibling restores no checkpoint, "
                    "so none is taken; afterDeadline applies then",
                ),
                wake_at=start,
            )
        return _settled(
            must,
            Reason.NOTHING_TO_SAVE,
            None,
            False,
            f"mustSaveBy {when}: no checkpoint with recovery.targetLevel sibling (unfinished "
            "episodes restart after a resume)",
        )
    mine = next((c for c in checkpoints if c.name == own and not c.deleting), None)
    if now < start and mine is None:
        return DeadlineDecision(
            condition=_deadline_condition(
                False,
                Reason.WAITING,
                f"the deadline checkpoint starts at {format_time(start)}: mustSaveBy {when} "
                f"minus saveReserveSeconds {reserve}",
            ),
            wake_at=start,
        )
    if mine is not None and not mine.failed:
        # Once the deadline started its own checkpoint, that one is the outcome: the start time
        # moves with the reserve (its own duration changes it), and an earlier checkpoint must
        # not become "covering" after the fact.
        covering = [mine]
    else:
        covering = [
            c
            for c in checkpoints
            if not c.failed
            and not c.deleting
            and (not c.finished or (c.completed is not None and c.completed >= start))
        ]
    ready = sorted(
        (c for c in covering if c.ready),
        key=lambda c: (c.completed or c.created, c.name),
    )
    if ready:
        first = ready[0]
        done = first.completed or now
        margin = (must - done).total_seconds()
        if margin >= 0:
            return _settled(
                must,
                Reason.SAVED,
                first.name,
                True,
                f"checkpoint {first.name} ({first.trigger.value}) was Ready at "
                f"{format_time(done)}, {margin:.0f}s before mustSaveBy {when} "
                f"(saveReserveSeconds {reserve})",
            )
        return _settled(
            must,
            Reason.MISSED,
            first.name,
            False,
            f"checkpoint {first.name} ({first.trigger.value}) was Ready at {format_time(done)}, "
            f"{-margin:.0f}s after mustSaveBy {when}; saveReserveSeconds ({reserve}) has grown "
            "with its duration. If checkpoints often take longer, set mustSaveBy with more slack",
        )
    running = [c for c in covering if not c.finished]
    if running:
        current = min(running, key=lambda c: (c.created, c.name))
        return DeadlineDecision(
            condition=_deadline_condition(
                False,
                Reason.SAVING,
                f"checkpoint {current.name} ({current.trigger.value}) must be Ready by "
                f"mustSaveBy {when}",
            )
        )
    if mine is not None and mine.failed:
        return _settled(
            must,
            Reason.CHECKPOINT_FAILED,
            None,
            False,
            f"the deadline checkpoint {own} failed ({mine.failure or 'no reason given'}); "
            f"nothing was saved for mustSaveBy {when}. Fix the cause shown on {own}",
        )
    if view.suspended or view.deleting:
        # A set that is still starting is not this case: its deadline checkpoint waits in the
        # checkpoint queue until the set is Ready (bounded by the flow's own deadline).
        return _settled(
            must,
            Reason.NOTHING_TO_SAVE,
            None,
            False,
            f"mustSaveBy {when}: the set is suspended (no participant pods run), so there is "
            "nothing a deadline checkpoint could capture",
        )
    late = "" if now < must else f" ({(now - must).total_seconds():.0f}s late)"
    return DeadlineDecision(
        condition=_deadline_condition(
            False,
            Reason.SAVING,
            f"checkpoint {own} must be Ready by mustSaveBy {when}{late}",
        ),
        create=Create(
            own,
            Trigger.DEADLINE,
            f"mustSaveBy {when} minus saveReserveSeconds {reserve}{late}",
        ),
    )


# --- suspend ------------------------------------------------------------------------------------


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


# --- eviction -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TerminatingPod:
    """A participant pod with a deletion timestamp (evicted, drained, preempted, deleted)."""

    name: str
    attempt: int
    deletion: datetime
    """When its grace period ends (the deletion timestamp); the pod is killed then."""
    grace_seconds: int
    finished: bool = False

    @classmethod
    def from_pod(cls, raw: Mapping[str, Any], attempt_label: str) -> TerminatingPod | None:
        """None for a pod that is not terminating or carries no attempt label."""
        meta = raw.get("metadata") or {}
        deletion = parse_time(meta.get("deletionTimestamp"))
        try:
            attempt = int((meta.get("labels") or {})[attempt_label])
        except (KeyError, ValueError):
            return None
        if deletion is None:
            return None
        grace = meta.get("deletionGracePeriodSeconds")
        phase = (raw.get("status") or {}).get("phase")
        return cls(
            name=str(meta.get("name", "")),
            attempt=attempt,
            deletion=deletion,
            grace_seconds=int(grace) if isinstance(grace, int) else 0,
            finished=phase in ("Failed", "Succeeded"),
        )


def eviction_decision(view: SetView, pod: TerminatingPod) -> Create | None:
    """An Eviction checkpoint for a participant pod of the current attempt that is being deleted
    with a grace period, unless the operator deletes pods itself (recovery, suspend, the set's
    own deletion): those are not evictions."""
    if (
        not view.policy.on_eviction
        or not view.restorable
        or view.deleting
        or view.recovering
        or view.wants_suspended
        or view.suspended
        or view.attempt is None
        or pod.attempt != view.attempt
        or pod.finished
        or pod.grace_seconds < MIN_EVICTION_GRACE_SECONDS
    ):
        return None
    return Create(
        eviction_checkpoint_name(view.name, view.attempt),
        Trigger.EVICTION,
        f"participant pod {pod.name} is being deleted (grace period {pod.grace_seconds}s, "
        f"killed at {format_time(pod.deletion)})",
    )


@dataclass(frozen=True)
class PrepareDeadline:
    """When a checkpoint's prepare must end, and why when it is not `prepareTimeoutSeconds`."""

    at: datetime
    killed: TerminatingPod | None = None
    """The evicted pod whose grace period set the deadline (None: the prepare timeout did)."""

    @property
    def why(self) -> str:
        """For the checkpoint's messages; empty when the prepare timeout set the deadline."""
        if self.killed is None:
            return ""
        return (
            f"pod {self.killed.name} is killed at {format_time(self.killed.deletion)}, so the "
            f"prepare ends {EVICTION_COMMIT_MARGIN_SECONDS:g}s before that to leave the commit "
            "time"
        )


def eviction_prepare_deadline(
    now: datetime,
    prepare_timeout_seconds: float,
    pods: Sequence[TerminatingPod],
    attempt: int | None,
) -> PrepareDeadline:
    """The prepare deadline of an Eviction checkpoint: `prepareTimeoutSeconds` from now, or the
    end of the first grace period among the attempt's terminating pods less
    `EVICTION_COMMIT_MARGIN_SECONDS`, whichever is earlier.

    A prepare running past the kill would only fail later and less clearly (ParticipantLost
    instead of PrepareTimeout with its blockers), and it would keep the rest of the attempt
    paused for nothing. Every terminating pod of the attempt counts, not only the one whose
    event created the checkpoint: a drain evicts several, and the first kill ends the
    checkpoint. The result can lie in the past (a checkpoint that queued too long, a pod
    deleted with little grace); the flow then fails at once instead of preparing.
    """
    by_timeout = PrepareDeadline(now + timedelta(seconds=prepare_timeout_seconds))
    evicted = [p for p in pods if p.attempt == attempt and not p.finished]
    if attempt is None or not evicted:
        return by_timeout
    first = min(evicted, key=lambda p: (p.deletion, p.name))
    by_grace = first.deletion - timedelta(seconds=EVICTION_COMMIT_MARGIN_SECONDS)
    if by_timeout.at <= by_grace:
        return by_timeout
    return PrepareDeadline(by_grace, killed=first)


def eviction_holds(
    view: SetView,
    pods: Sequence[TerminatingPod],
    checkpoints: Sequence[CheckpointView],
    now: datetime,
) -> frozenset[str]:
    """Terminating pods whose loss the recovery must not act on yet.

    While the eviction checkpoint has not finished (or not even been created: the pod event
    reaches the recovery and the eviction handler in either order), the pod's control plane
    still answers, and recovering now would delete the attempt under the checkpoint. The hold
    ends when that checkpoint is Ready or Failed, or when the pod's grace period is over.
    """
    if view.attempt is None:
        return frozenset()
    evict = next(
        (c for c in checkpoints if c.name == eviction_checkpoint_name(view.name, view.attempt)),
        None,
    )
    if evict is not None and evict.finished:
        return frozenset()
    return frozenset(
        pod.name for pod in pods if eviction_decision(view, pod) is not None and pod.deletion > now
    )


# --- retention (docs/design.md#65-retention-and-records) ------------------------------------------


def retention(
    checkpoints: Sequence[CheckpointView], keep_latest: int, protected: Iterable[str | None]
) -> list[str]:
    """The checkpoints to delete: Ready ones beyond the newest `keep_latest`, and Failed ones
    beyond the newest `keep_latest` (their records are removed at once; the objects stay a
    while to show why they failed). Never a protected one (the set's latest, the one a recovery
    restores) and never an unfinished one."""
    keep = {name for name in protected if name}

    def newest_first(items: Iterable[CheckpointView]) -> list[CheckpointView]:
        return sorted(items, key=lambda c: (c.completed or c.created, c.created), reverse=True)

    live = [c for c in checkpoints if not c.deleting]
    doomed: list[str] = []
    for group in (
        newest_first(c for c in live if c.ready),
        newest_first(c for c in live if c.failed),
    ):
        doomed.extend(c.name for c in group[keep_latest:] if c.name not in keep)
    return doomed


def latest_after_delete(
    checkpoints: Sequence[CheckpointView], deleting: str
) -> CheckpointView | None:
    """The newest Ready checkpoint other than `deleting`: what the set's `latestCheckpoint`
    points at once `deleting` is gone."""
    ready = [c for c in checkpoints if c.ready and not c.deleting and c.name != deleting]
    return max(ready, key=lambda c: (c.completed or c.created, c.created), default=None)


# --- one pass -----------------------------------------------------------------------------------


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
