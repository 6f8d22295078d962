"""What a RolloutSet's status says about its checkpoints, derived from the checkpoints (pure).

The set's pass is the one writer of `latestCheckpoint`, `latestCheckpointTime`,
`recentCheckpointSeconds` and `activeCheckpoint` (docs/design.md#69-who-writes-the-sets-status): it
computes them here from the set's RolloutCheckpoints on every pass and writes them when they
changed. Nothing else writes them, so a value that differs from what the pass last wrote was written
by someone else (status is user-writable): it is written back, with a `StatusRepaired` Event
(docs/design.md#610-status-written-by-hand).

- `latestCheckpoint`: the newest Ready checkpoint that is not being deleted (one being
  published, phase Resuming, is Ready already); what a recovery restores.
- `latestCheckpointTime`: when the newest *finished* Ready checkpoint completed. It is also the
  mark up to which checkpoint durations were counted.
- `recentCheckpointSeconds`: the total durations of the last `RECENT_DURATIONS` finished Ready
  checkpoints, appended as they finish (the deadline's save reserve is built on them), so the
  history outlives retention.
- `activeCheckpoint`: the checkpoint that is running (Preparing to Resuming), for people; the
  slot itself is the set's Lease (`leases`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any, Final

from ..model.api import CHECKPOINT_RUNNING, CheckpointPhase, RolloutSet, format_time
from .policy.views import CheckpointView

REPAIRED: Final = "StatusRepaired"
"""Event and condition reason: status contradicted the cluster and was written back."""
NOT_AN_INTERFACE: Final = (
    "status is the operator's record, not a user interface: do not write it (kubectl patch "
    "--subresource=status); change spec, or create a RolloutCheckpoint, instead"
)
RESET_PHASES: Final = frozenset({None, CheckpointPhase.PENDING, CheckpointPhase.QUEUED})
"""Phases of a checkpoint that has not started (or whose status was reset)."""
PUBLISHING_PHASES: Final = frozenset({CheckpointPhase.RESUMING, CheckpointPhase.PERSISTING})
"""Phases of a checkpoint whose Ready=True is written while its participants resume."""
RECENT_DURATIONS: Final = 20
"""How many recent checkpoint durations the set keeps (the deadline reserve is built on them)."""


@dataclass(frozen=True)
class Repair:
    """What was written back, for the Event (and, where the caller writes it, the patch)."""

    reason: str
    message: str
    patch: dict[str, Any] = field(default_factory=dict)


def finished_attempt(rset: RolloutSet) -> int:
    """The newest attempt the set is known to have brought up completely: the set pass writes
    `createdAttempt` once every pod of the running attempt was created and Ready, a recovery
    writes it (and `lastRecovery.attempt`) only when it finished (restored, resumed). Pods of
    a later attempt were created by a recovery that did not finish."""
    status = rset.status
    last = status.last_recovery.attempt if status.last_recovery is not None else 1
    return max(status.created_attempt or 1, last)


def newest_ready(views: Sequence[CheckpointView]) -> CheckpointView | None:
    """The newest Ready checkpoint (by completion, then creation) that is not being deleted."""
    ready = [c for c in views if c.ready and not c.deleting]
    return max(ready, key=lambda c: (c.completed or c.created, c.created), default=None)


def latest_repair(rset: RolloutSet, views: Sequence[CheckpointView]) -> Repair | None:
    """None when `status.latestCheckpoint` agrees with the set's checkpoints (`views`, the
    checkpoints whose spec.rolloutSet is this set); else the Repair whose `patch` writes back
    the newest Ready one."""
    shown = rset.status.latest_checkpoint
    by_name = {c.name: c for c in views}
    newest = newest_ready(views)
    expected = newest.name if newest is not None else None
    if shown == expected:
        return None
    named = by_name.get(shown) if shown else None
    if (
        named is not None
        and not named.deleting
        and (named.phase in PUBLISHING_PHASES or named.phase in RESET_PHASES)
    ):
        # Being published: it is the latest once its phase is Ready. A reset status: its daemon
        # decides (a published checkpoint is repaired to Ready, see repair_published_checkpoint,
        # which takes this name as proof when it cannot see the volume). A recovery restores
        # the newest Ready checkpoint meanwhile, whatever this says.
        return None
    if not shown:
        why = f"it was unset while {expected} is Ready"
    elif named is None:
        why = f"no RolloutCheckpoint {shown} of set {rset.metadata.name} exists"
    elif not named.ready:
        why = f"checkpoint {shown} is not Ready (phase {named.phase or 'unset'})"
    else:
        why = f"checkpoint {expected} is Ready and newer than {shown}"
    patch: dict[str, Any] = {"latestCheckpoint": expected, "latestCheckpointTime": None}
    if newest is not None:
        patch["latestCheckpointTime"] = (newest.completed or newest.created).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
    message = (
        f"status.latestCheckpoint said {shown!r}, but {why}: wrote back "
        f"{expected!r} (a recovery restores the newest Ready checkpoint); {NOT_AN_INTERFACE}"
    )
    return Repair(REPAIRED, message, patch)


def checkpoint_fields(
    rset: RolloutSet, views: Sequence[CheckpointView], last_written: str | None
) -> tuple[dict[str, Any], Repair | None]:
    """The set's checkpoint fields as its pass writes them, and the Repair when the shown
    `latestCheckpoint` was written by someone else (`last_written`: what this process's pass
    wrote last; None when it wrote nothing yet, e.g. after a restart)."""
    status = rset.status
    fields: dict[str, Any] = {}
    running = sorted(v.name for v in views if v.phase in CHECKPOINT_RUNNING and not v.deleting)
    fields["activeCheckpoint"] = running[0] if running else None
    repair = latest_repair(rset, views)
    if repair is not None:
        fields["latestCheckpoint"] = repair.patch["latestCheckpoint"]
        if last_written is None or status.latest_checkpoint == last_written:
            repair = None  # a checkpoint was published (or the last one deleted): no repair
    counted = status.latest_checkpoint_time
    finished = sorted(
        (
            v
            for v in views
            if v.phase is CheckpointPhase.READY and v.ready and v.completed is not None
        ),
        key=lambda v: v.completed or v.created,
    )
    new = [v for v in finished if counted is None or (v.completed and v.completed > counted)]
    if new:
        totals = [v.total_seconds for v in new if v.total_seconds is not None]
        recent = [*status.recent_checkpoint_seconds, *totals][-RECENT_DURATIONS:]
        fields["recentCheckpointSeconds"] = recent
        completed = new[-1].completed
        assert completed is not None
        # As precise as completedAt: the mark must not fall behind what it counted.
        fields["latestCheckpointTime"] = (
            completed.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            if completed.microsecond
            else format_time(completed)
        )
    return fields, repair
