"""Phase BackingOff of the recovery, and what a failed try turns into (docs/design.md#62-recovery).

A step that raises `RecoveryFailed` ends its try: the next one waits an exponential backoff
(BackingOff) and starts again in StoppingAttempt under a newer attempt, until
`recovery.maxRestarts` tries failed (then the set is Degraded until a person acts). A checkpoint
whose records failed verification is not counted: the next try restores another one. A failed
InPlace try is followed by Recreate tries.

BackingOff does not sleep within itself: before `nextTryAt` it leaves the phase as it is and
the loop passes again then; after it, the next try (a fall-back from InPlace with it) is added to
the pass in one write. A failed try is added to the pass the step failed in, over what the step
had added before it failed. Safe to run again: a write that lost a race leaves the persisted
phase, and the next pass redoes its step (the failed one fails again, or goes on, and is
recorded then); BackingOff redoes its fall-back and its next try alike.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rollout_protocol import tracing

from ...model.api import (
    RecoveryPhase,
    RestorePolicy,
    SetConditionType,
)
from ...model.conditions import (
    ConditionUpdate,
)
from ...model.reasons import Reason
from .context import (
    MAX_BACKOFF_SECONDS,
    RecoveryContext,
    RecoveryFailed,
    RecoveryPass,
    change,
    logger,
    recovery_of,
    set_phase,
)
from .stopping import fall_back


async def on_failed_try(
    context: RecoveryContext, run: RecoveryPass, error: Exception
) -> RecoveryPass | None:
    """The phase table's failure handler: a step's `RecoveryFailed` ends its try."""
    assert isinstance(error, RecoveryFailed), "the table catches only RecoveryFailed"
    tracing.failed(error.reason, error.message)
    return try_failed(run, error)


def try_failed(run: RecoveryPass, failed: RecoveryFailed) -> RecoveryPass | None:
    """A failed try, on the set as the failed step left the pass: counted (unless the
    checkpoint was invalid), then BackingOff until the next one; past maxRestarts, Degraded
    and None (the run ends)."""
    rset = run.rset
    if rset.status.recovery is None:
        return run
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
        change(
            run,
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
        failed_try_event(run, failed)
        return None
    delay = min(MAX_BACKOFF_SECONDS, 2.0 ** min(tries, 10)) if counted else 1.0
    next_try = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=delay)
    set_phase(
        run,
        RecoveryPhase.BACKING_OFF,
        tries=tries,
        next_try_at=next_try,
        message=f"{failed.reason}: {failed.message}",
    )
    failed_try_event(run, failed)
    return run


def failed_try_event(run: RecoveryPass, failed: RecoveryFailed) -> None:
    """The failed try's Event, posted once the pass's write that records it landed
    (docs/design.md#69-who-writes-the-sets-status)."""
    run.announce(failed.reason, failed.message, True)


async def back_off(context: RecoveryContext, run: RecoveryPass) -> RecoveryPass:
    """BackingOff: until `nextTryAt`, nothing (the loop passes again then); then the next try
    under a newer attempt (StoppingAttempt), Recreate from now on."""
    rset = run.rset
    recovery = recovery_of(rset)
    if recovery.next_try_at is not None and recovery.next_try_at.timestamp() > context.clock():
        run.look_again_at(recovery.next_try_at)
        return run
    # The failed try's attempt was retired everywhere (kept pods included); the next try
    # needs fresh pods, all of them. A failed InPlace try (a kept pod lost or refusing
    # during the restore) falls back like a refused plan does: reason InPlaceFallback on
    # the Recovering condition and an Event, so the user learns why the kept pods went.
    if recovery.restore_policy is RestorePolicy.IN_PLACE:
        rset = fall_back(run, f"the InPlace try failed: {recovery.message or 'see events'}")
        recovery = recovery_of(rset)
    set_phase(run, RecoveryPhase.STOPPING_ATTEMPT, target_attempt=recovery.target_attempt + 1)
    return run
