"""Phase BackingOff of the recovery, and what a failed try turns into (docs/design.md#62-recovery).

A step that raises `RecoveryFailed` ends its try: the next one waits an exponential backoff
(BackingOff) and starts again in StoppingAttempt under a newer attempt, until
`recovery.maxRestarts` tries failed (then the set is Degraded until a person acts). A checkpoint
whose records failed verification is not counted: the next try restores another one. A failed
InPlace try is followed by Recreate tries.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import anyio
from rollout_protocol import tracing

from ...model.api import (
    RecoveryPhase,
    RestorePolicy,
    RolloutSet,
    SetConditionType,
    namespace_or_default,
)
from ...model.conditions import (
    ConditionUpdate,
)
from ...model.reasons import Reason
from .context import (
    MAX_BACKOFF_SECONDS,
    RecoveryContext,
    RecoveryFailed,
    logger,
    patch,
    read_set,
    recovery_of,
    set_phase,
)
from .stopping import fall_back


async def on_failed_try(
    context: RecoveryContext, rset: RolloutSet, error: Exception
) -> RolloutSet | None:
    """The phase table's failure handler: a step's `RecoveryFailed` ends its try."""
    assert isinstance(error, RecoveryFailed), "the table catches only RecoveryFailed"
    tracing.failed(error.reason, error.message)
    return await try_failed(context, rset, error)


async def try_failed(
    context: RecoveryContext, rset: RolloutSet | None, failed: RecoveryFailed
) -> RolloutSet | None:
    """A failed try, on the set read again: counted (unless the checkpoint was invalid), then
    BackingOff until the next one; past maxRestarts, Degraded and None (the run ends)."""
    if rset is None:
        return None
    namespace = namespace_or_default(rset.metadata.namespace)
    fresh = await read_set(context, namespace, rset.metadata.name)
    if fresh is None or fresh.status.recovery is None:
        return fresh
    rset = fresh
    recovery = recovery_of(rset)
    # A checkpoint whose records failed verification, or are on storage these pods do not see,
    # is not the pods' fault: the next try restores another checkpoint, and every such one is
    # tried at most once.
    counted = failed.reason not in (Reason.CHECKPOINT_INVALID, Reason.CHECKPOINT_UNREACHABLE)
    tries = recovery.tries + (1 if counted else 0)
    logger.warning(
        "set %s recovery try %d failed: %s: %s",
        rset.metadata.name,
        tries,
        failed.reason,
        failed.message,
    )
    if tries > rset.spec.recovery.max_restarts:
        message = (
            f"gave up after {tries} tries (recovery.maxRestarts "
            f"{rset.spec.recovery.max_restarts}); last: {failed.message}. Fix the cause and "
            "delete the failed pods, or raise maxRestarts"
        )
        rset = await patch(
            context,
            rset,
            {"recovery": recovery.model_copy(update={"tries": tries})},
            [
                ConditionUpdate.of(
                    SetConditionType.DEGRADED.value, True, Reason.RESTARTS_EXHAUSTED, message
                ),
                ConditionUpdate.of(
                    SetConditionType.RECOVERING.value, False, Reason.RESTARTS_EXHAUSTED, message
                ),
            ],
        )
        await failed_try_event(context, rset, failed)
        return None
    delay = min(MAX_BACKOFF_SECONDS, 2.0 ** min(tries, 10)) if counted else 1.0
    next_try = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=delay)
    rset = await set_phase(
        context,
        rset,
        RecoveryPhase.BACKING_OFF,
        tries=tries,
        next_try_at=next_try,
        message=f"{failed.reason}: {failed.message}",
    )
    await failed_try_event(context, rset, failed)
    return rset


async def failed_try_event(
    context: RecoveryContext, rset: RolloutSet, failed: RecoveryFailed
) -> None:
    """The failed try's Event, posted once the status that records it was written
    (docs/design.md#69-who-writes-the-sets-status)."""
    await context.transition(rset, failed.reason, failed.message, True)


async def back_off(context: RecoveryContext, rset: RolloutSet) -> RolloutSet:
    """BackingOff: wait until `nextTryAt`, then the next try under a newer attempt
    (StoppingAttempt), Recreate from now on."""
    recovery = recovery_of(rset)
    if recovery.next_try_at is not None:
        wait = recovery.next_try_at.timestamp() - context.clock()
        if wait > 0:
            await anyio.sleep(wait)
    # The failed try's attempt was retired everywhere (kept pods included); the next try
    # needs fresh pods, all of them. A failed InPlace try (a kept pod lost or refusing
    # during the restore) falls back like a refused plan does: reason InPlaceFallback on
    # the Recovering condition and an Event, so the user learns why the kept pods went.
    if recovery.restore_policy is RestorePolicy.IN_PLACE:
        rset = await fall_back(
            context, rset, f"the InPlace try failed: {recovery.message or 'see events'}"
        )
        recovery = recovery_of(rset)
    return await set_phase(
        context, rset, RecoveryPhase.STOPPING_ATTEMPT, target_attempt=recovery.target_attempt + 1
    )
