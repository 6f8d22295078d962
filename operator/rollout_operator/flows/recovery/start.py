"""How a recovery starts (docs/design.md#62-recovery): the loss recorded in `status.recovery`
(phase StoppingAttempt), unless the set lost participants too often.

`churn` counts recoveries in a sliding window against `maxRestarts` (`decide/churn.py`): past
the bound the set is held Degraded (`RecoveryLimitReached`) until its spec or the retry
annotation changes. `start` records the loss, the restore policy and the new start; a resume
after suspend starts the same way but is not counted.

Both add their changes to the pass's draft (`context.RecoveryPass`), and their Events follow
the pass's one write. A write that loses a race is safe to lose: the next pass looks at the set
again, sees the loss again (a lost pod does not come back) and decides again.
"""

from __future__ import annotations

from typing import Any

from ...decide.churn import ChurnDecision, decide, kept_starts
from ...model.api import (
    ANNOTATION_RETRY_RECOVERY,
    MAX_RECOVERY_STARTS,
    RecoveryHold,
    RecoveryPhase,
    RecoveryStatus,
    RestorePolicy,
    RolloutSet,
    SetConditionType,
    format_time,
)
from ...model.conditions import (
    ConditionUpdate,
    utcnow,
)
from ...model.reasons import Reason
from .context import RecoveryPass, change, logger
from .loss import Loss


def start(run: RecoveryPass, loss: Loss) -> RolloutSet:
    """Record the loss: from now on the recovery owns the set's pods and conditions.

    A resume after suspend (`Loss` with reason `Resumed`, see `policy.suspend.resume_due`) starts
    the same way, but no pod is left to keep (Recreate) and it is not counted against
    `maxRestarts` (a queueing system may suspend and resume a set many times)."""
    rset = run.rset
    attempt = rset.status.attempt or 1
    resume = loss.reason == Reason.RESUMED
    policy = RestorePolicy.RECREATE if resume else rset.spec.recovery.restore_policy
    now = utcnow()
    recovery = RecoveryStatus(
        phase=RecoveryPhase.STOPPING_ATTEMPT,
        from_attempt=attempt,
        target_attempt=attempt + 1,
        started_at=now,
        phase_started_at=now,
        reason=loss.reason,
        message=loss.message,
        restore_policy=policy,
    )
    replacing = (
        "replacing the lost participants (InPlace)"
        if policy is RestorePolicy.IN_PLACE
        else "replacing every participant"
    )
    message = loss.message if resume else f"{loss.message}; {replacing} under attempt {attempt + 1}"
    changes: dict[str, Any] = {"recovery": recovery}
    if not resume:
        starts = kept_starts(
            rset.status.recovery_starts,
            now,
            window_seconds=rset.spec.recovery.window_seconds,
            bound=MAX_RECOVERY_STARTS,
        )
        changes["recoveryStarts"] = [format_time(t) for t in starts]
    rset = change(
        run,
        changes,
        [
            ConditionUpdate.of(SetConditionType.RECOVERING.value, True, loss.reason, message),
            ConditionUpdate.of(SetConditionType.READY.value, False, loss.reason, message),
            ConditionUpdate.of(SetConditionType.PROGRESSING.value, True, loss.reason, message),
        ],
    )
    run.announce(loss.reason, message, not resume)
    return rset


def churn(run: RecoveryPass, loss: Loss) -> ChurnDecision:
    """Whether this loss may start a recovery now (see `churn.decide`). Past the bound the
    set is held: Degraded=True, RecoveryLimitReached, naming the loss (role, container,
    exit code), until the spec or the retry-recovery annotation changes. A hold that no longer
    applies is cleared in the same pass (and write) as what follows: the new hold, or the
    start."""
    rset = run.rset
    token = rset.metadata.annotations.get(ANNOTATION_RETRY_RECOVERY)
    hold = rset.status.recovery_hold
    if hold is not None:
        if hold.generation == rset.metadata.generation and hold.retry_token == token:
            return ChurnDecision(recent=0, stop=hold.message)
        logger.info(
            "set %s: retrying recovery (spec or retry-recovery changed)", rset.metadata.name
        )
        rset = change(run, {"recoveryHold": None, "recoveryStarts": []}, requeue=False)
    recovery = rset.spec.recovery
    decision = decide(
        rset.status.recovery_starts,
        utcnow(),
        max_restarts=recovery.max_restarts,
        window_seconds=recovery.window_seconds,
    )
    if decision.stop is None:
        return decision
    message = (
        f"recovery stopped: {loss.message}; {decision.stop}. Fix the cause, then change the "
        f"spec or run `kubectl annotate rset {rset.metadata.name} "
        f"{ANNOTATION_RETRY_RECOVERY}=<new value> --overwrite` to retry"
    )
    hold = RecoveryHold(
        since=utcnow(), message=message, generation=rset.metadata.generation, retry_token=token
    )
    rset = change(
        run,
        {"recoveryHold": hold},
        [
            ConditionUpdate.of(
                SetConditionType.DEGRADED.value, True, Reason.RECOVERY_LIMIT, message
            ),
            ConditionUpdate.of(SetConditionType.READY.value, False, Reason.RECOVERY_LIMIT, message),
        ],
        requeue=False,
    )
    logger.warning("set %s: %s", rset.metadata.name, message)
    run.announce(Reason.RECOVERY_LIMIT, message, True)
    return decision


# --- the flow -------------------------------------------------------------------------------
