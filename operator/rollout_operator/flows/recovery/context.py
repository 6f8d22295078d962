"""What every step of the recovery shares: its reasons, waits and errors, the context a step
is given, and the writes of the set's status as the recovery.

Every step is a function of a `RecoveryContext` and the set, and returns the set as it wrote it
(`status.recovery` in its next phase), or None when the recovery has nothing left to do. The
recovery writes the set's status only through `patch` and `set_phase`, as its owner
(`model/owners.py`, docs/design.md#69-who-writes-the-sets-status).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from rollout_protocol import Coordinator, HttpParticipantClient

from ...cluster.kube import Conflict, Kube
from ...cluster.objects import read_control_token
from ...cluster.statuswriter import SetGone, SetStatusWriter
from ...model.api import (
    RecoveryPhase,
    RecoveryStatus,
    RestoreVerdict,
    RolloutCheckpoint,
    RolloutSet,
    SetConditionType,
    namespace_or_default,
)
from ...model.conditions import ConditionUpdate, merge_conditions, truncate, utcnow
from ...model.reasons import Reason
from ...model.settings import DEFAULT_RESTORE_FLOOR_SECONDS, DEFAULT_RETIRE_SECONDS

# One logger for the whole recovery, named as the flow (its lines read the same from every step).
logger = logging.getLogger(__package__)

POLL_SECONDS: Final = 0.5
MAX_BACKOFF_SECONDS: Final = 60.0
STOP_GRACE_SECONDS: Final = 1
"""Grace period for the pods of a lost attempt. Their episodes continue from the checkpoint
under the next attempt, so nothing of theirs is worth draining for; their GPUs are needed by
the replacement pods, and a survivor that kept working could report episodes the restore also
continues. (The servers turn unready on SIGTERM and keep serving until SIGKILL, so a long grace
would keep them busy for all of it.)"""

COUNT_RETIRE_SECONDS: Final = 5.0
"""How long a Recreate recovery waits for the pods it is about to delete to retire the lost
attempt, only so that they report the work it loses (`lastRecovery`); one that does not
answer by then is deleted anyway and its work is listed as uncounted."""


CHECKPOINT_RECORDS_INVALID: Final = RestoreVerdict.RECORDS_INVALID.value
"""Reason on a RolloutCheckpoint whose records failed verification at restore (Ready=False)."""
CHECKPOINT_RECORDS_UNREACHABLE: Final = RestoreVerdict.RECORDS_UNREACHABLE.value
"""Reason on a RolloutCheckpoint whose records a restoring participant could not find on its
storage (`records_unreachable`: the folder or manifest absent there; Ready=False)."""


@dataclass(frozen=True)
class RecoveryWaits:
    """The recovery's fixed waits, set by the operator's options (`model/settings.py`): how
    long the pods an InPlace recovery keeps may take to retire the lost attempt, and the least
    time a restore or resume call gets when the try's own deadline is nearer."""

    retire_seconds: float = DEFAULT_RETIRE_SECONDS
    restore_floor_seconds: float = DEFAULT_RESTORE_FLOOR_SECONDS


DEFAULT_WAITS: Final = RecoveryWaits()
"""The waits of a flow the operator's options did not set (the tests' flows)."""


class RecoveryFailed(Exception):
    """Ends a recovery with this reason and message; the message (which may quote what a
    participant said) is cut to `MAX_MESSAGE_CHARS`, as it goes into the set's status."""

    def __init__(self, reason: str, message: str) -> None:
        message = truncate(message)
        super().__init__(message)
        self.reason = reason
        self.message = message


class InPlaceRefused(Exception):
    """An InPlace recovery cannot keep its survivors safely; the try falls back to Recreate."""


OnTransition = Callable[[RolloutSet, str, str, bool], Awaitable[None]]
"""Posts the Event of a transition (the set, its reason, its message, whether a warning)."""

CoordinatorFactory = Callable[
    [RolloutSet], Awaitable[tuple[Coordinator, list[HttpParticipantClient]]]
]
"""The coordinator over the set's participants, and the clients to close after it."""


@dataclass(frozen=True)
class RecoveryContext:
    """The operator's parts a recovery uses: the same for every step of every try."""

    kube: Kube
    writer: SetStatusWriter
    clock: Callable[[], float]
    waits: RecoveryWaits
    coordinator: CoordinatorFactory
    on_transition: OnTransition | None = None

    async def transition(self, rset: RolloutSet, reason: str, message: str, warn: bool) -> None:
        """Post the transition's Event (once the status that records it was written)."""
        if self.on_transition is not None:
            await self.on_transition(rset, reason, message, warn)


def recovery_of(rset: RolloutSet) -> RecoveryStatus:
    """The set's running recovery; a step runs only while there is one."""
    recovery = rset.status.recovery
    assert recovery is not None, "a recovery step runs only while status.recovery is set"
    return recovery


def phase_seconds_until(recovery: RecoveryStatus, now: datetime) -> dict[str, float]:
    """Seconds spent per phase, counting the current phase up to `now`."""
    spent = dict(recovery.phase_seconds)
    began = recovery.phase_started_at or recovery.started_at
    current = recovery.phase.value
    spent[current] = round(spent.get(current, 0.0) + max(0.0, (now - began).total_seconds()), 3)
    return spent


def try_deadline(rset: RolloutSet) -> float:
    """When this try's restoreTimeoutSeconds end (counted from `nextTryAt`, its start)."""
    recovery = recovery_of(rset)
    begun = (recovery.next_try_at or recovery.started_at).timestamp()
    return max(begun, 0.0) + rset.spec.recovery.restore_timeout_seconds


# --- the set's status, written as the recovery ---------------------------------------------------


async def read_set(context: RecoveryContext, namespace: str, name: str) -> RolloutSet | None:
    raw = await context.kube.get_set(namespace, name)
    return None if raw is None else RolloutSet.model_validate(raw)


async def patch(
    context: RecoveryContext,
    rset: RolloutSet,
    changes: dict[str, Any],
    conditions: list[ConditionUpdate] | None = None,
) -> RolloutSet:
    """Write `changes` and the merged `conditions` as the recovery (`SetStatusWriter`,
    which re-reads and writes again after a conflict, the conditions merged anew)."""

    def build(current: RolloutSet) -> dict[str, Any]:
        if not conditions:
            return changes
        merged = merge_conditions(
            current.status.conditions,
            conditions,
            observed_generation=current.metadata.generation,
        )
        return {**changes, "conditions": merged}

    try:
        return await context.writer.write_retrying(rset, build)
    except SetGone:
        raise RecoveryFailed("SetDeleted", "the RolloutSet was deleted") from None
    except Conflict:
        raise RecoveryFailed(
            "StatusConflict", "could not write the set's status (conflicts)"
        ) from None


async def set_phase(
    context: RecoveryContext, rset: RolloutSet, phase: RecoveryPhase, **fields: Any
) -> RolloutSet:
    """Enter `phase` (with `fields`), counting the time spent in the one it leaves."""
    recovery = recovery_of(rset)
    now = utcnow()
    spent = phase_seconds_until(recovery, now)
    updated = recovery.model_copy(
        update={"phase": phase, "phase_seconds": spent, "phase_started_at": now, **fields}
    )
    message = f"attempt {updated.from_attempt} -> {updated.target_attempt}: {phase.value}" + (
        f" (checkpoint {updated.checkpoint})" if updated.checkpoint else ""
    )
    rset = await patch(
        context,
        rset,
        {"recovery": updated},
        [ConditionUpdate.of(SetConditionType.RECOVERING.value, True, phase.value, message)],
    )
    logger.info("set %s recovery: %s", rset.metadata.name, message)
    return rset


async def read_checkpoint(
    context: RecoveryContext, rset: RolloutSet, name: str
) -> RolloutCheckpoint | None:
    """The RolloutCheckpoint `name` of this set; None when there is none, or when the name
    is another set's (a name read from status may have been written by hand: the flow
    never restores, nor marks invalid, a checkpoint of another set)."""
    raw = await context.kube.get_checkpoint(namespace_or_default(rset.metadata.namespace), name)
    if raw is None:
        return None
    ckpt = RolloutCheckpoint.model_validate(raw)
    return ckpt if ckpt.spec.rollout_set == rset.metadata.name else None


async def http_coordinator(
    kube: Kube, rset: RolloutSet
) -> tuple[Coordinator, list[HttpParticipantClient]]:
    """The coordinator over every participant of the set's status, over HTTP."""
    token = await read_control_token(
        kube, namespace_or_default(rset.metadata.namespace), rset.metadata.name
    )
    if token is None:
        raise RecoveryFailed("TokenMissing", "the set's control-token Secret is missing")
    participants = [
        HttpParticipantClient(p.role, p.address, index=p.index, token=token)
        for p in rset.status.participants
        if p.address
    ]
    if len(participants) != len(rset.status.participants):
        raise RecoveryFailed(Reason.PODS_NOT_READY, "a replacement pod has no address")
    return Coordinator(participants), participants
