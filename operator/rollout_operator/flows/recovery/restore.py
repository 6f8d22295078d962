"""Phases Restoring and Resuming of the recovery (docs/design.md#62-recovery): the checkpoint
into every participant at once under the target attempt, then resume and the recovery's end.

The checkpoint named in `status.recovery` is checked against the cluster first (a name written by
hand is replaced by the newest Ready checkpoint of the set). A restore is all or nothing across
the participants; records that fail verification mark that checkpoint not restorable
(`RecordsInvalid`), and so do records a participant cannot find on the storage it sees
(`RecordsUnreachable`: they were on a volume only a lost node had); the next try restores an
older Ready checkpoint or starts fresh, never waiting for that storage. Resuming clears
`status.recovery`, moves `attempt` to the target and writes `lastRecovery` (what was kept,
restored and lost) and the conditions, in one write.

Each step adds its changes to the pass's draft, sent in the pass's one write (a checkpoint
replaced by `still_restorable` in the same write as Resuming, or as the failed try). Safe to run
again from Restoring or Resuming (a successor's, or the next pass's after the write lost a
race): a participant replays a repeated restore of the same checkpoint, attempt and identity
(docs/protocol.md, "Replay and checkpoint ids"), and a repeated resume of a restored checkpoint
resumes nothing more; a checkpoint marked not restorable stays so (its own status, written
before the try failed), and the next pass picks another.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, Final, TypeVar

from rollout_protocol import (
    ErrorCode,
    Failure,
)

from ...cluster.checkpointstatus import CheckpointStatusWriter
from ...cluster.kube import ApiError
from ...decide.inplace import adopted_instances, instance_name, rewiring
from ...decide.setplan import attempt_instances
from ...decide.setstatus import NOT_AN_INTERFACE, REPAIRED
from ...decide.workloss import total_work, work_loss
from ...model.api import (
    CheckpointConditionType,
    CheckpointPhase,
    LastRecovery,
    RecoveryPhase,
    RecoveryStatus,
    RolloutCheckpoint,
    RolloutSet,
    SetConditionType,
    TargetLevel,
    dump,
    namespace_or_default,
)
from ...model.checkpointowners import CheckpointOwner
from ...model.conditions import (
    ConditionUpdate,
    is_true,
    set_condition,
    truncate,
    utcnow,
)
from ...model.reasons import Reason
from ..watching import NoLongerHolds, while_holding
from .context import (
    CHECKPOINT_RECORDS_INVALID,
    CHECKPOINT_RECORDS_UNREACHABLE,
    POLL_SECONDS,
    RecoveryContext,
    RecoveryFailed,
    RecoveryPass,
    change,
    logger,
    phase_seconds_until,
    read_checkpoint,
    recovery_of,
    set_phase,
    try_deadline,
)
from .loss import find_losses, observe
from .pods import restorable_checkpoint


def counts_as_restart(recovery: RecoveryStatus) -> bool:
    """Whether a finished recovery adds one to `status.restarts`.

    `restarts` counts what went wrong (a participant failed, was deleted, its node was lost),
    so people and alerts can read it as the set's instability. A resume after suspend runs as
    a recovery too (fresh pods restore the latest checkpoint under attempt + 1), but nothing
    was lost: it advances the attempt and says `Resumed`/`Restored` in the conditions, and
    leaves `restarts` alone (a queueing system may suspend and resume a set many times)."""
    return recovery.reason != Reason.RESUMED


_T = TypeVar("_T")


async def still_restorable(context: RecoveryContext, run: RecoveryPass) -> RecoveryPass:
    """Check `recovery.checkpoint` against the cluster before restoring it: a Ready
    checkpoint of this set. Anything else (written by hand: another set's checkpoint, a
    Failed or missing one) is replaced by the newest Ready one (or a fresh start), with an
    Event, before a restore could fail on it and mark it invalid: added to the pass, whose one
    write carries it with what the restore adds (or the failed try)."""
    rset = run.rset
    recovery = recovery_of(rset)
    if recovery.checkpoint is None:
        return run
    ckpt = await read_checkpoint(context, rset, recovery.checkpoint)
    if ckpt is not None and is_true(ckpt.status.conditions, "Ready"):
        return run
    pick = await restorable_checkpoint(context, rset)
    why = "does not exist" if ckpt is None else "is not Ready"
    message = (
        f"status.recovery.checkpoint said {recovery.checkpoint!r}, but no checkpoint of set "
        f"{rset.metadata.name} by that name {why}: restoring "
        + (f"{pick} instead" if pick else "nothing (no Ready checkpoint: a fresh start)")
        + f"; {NOT_AN_INTERFACE}"
    )
    logger.warning("set %s: %s", rset.metadata.name, message)
    set_phase(run, RecoveryPhase.RESTORING, checkpoint=pick)
    run.announce(REPAIRED, message, True)
    return run


async def restore(context: RecoveryContext, run: RecoveryPass) -> RecoveryPass:
    """Restoring: the checkpoint (checked against the cluster first) into every participant
    at once under the target attempt, all or nothing; then add Resuming."""
    rset = (await still_restorable(context, run)).rset
    recovery = recovery_of(rset)
    if recovery.checkpoint is None:
        set_phase(run, RecoveryPhase.RESUMING)
        return run
    checkpoint = recovery.checkpoint
    # the rollouts a participant's commit listed: a NeMo Gym participant restores only those
    # it is told (docs/protocol.md, "The NeMo Gym dialect")
    ckpt = await read_checkpoint(context, rset, checkpoint)
    listed = {
        entry.instance: entry.rollout_ids
        for entry in (ckpt.status.participants if ckpt is not None else [])
        if entry.rollout_ids is not None
    }
    coordinator, clients = await context.coordinator(rset)
    adopted = adopted_instances(recovery.adopted)
    peers = rewiring(rset, rset.status.participants, set(recovery.kept), adopted.values())
    try:
        deadline = max(try_deadline(rset), context.clock() + context.waits.restore_floor_seconds)
        outcome = await while_pods_hold(
            context,
            rset,
            lambda: coordinator.restore(
                checkpoint,
                recovery.target_attempt,
                deadline,
                peers=peers,
                adopted=list(adopted),
                listed=listed,
            ),
        )
    finally:
        for client in clients:
            await client.aclose()
    if not outcome.ok:
        refused = not_restorable(checkpoint, outcome.failures)
        if refused is not None:
            verdict, failed = refused
            await invalidate(context, rset, checkpoint, failed.message, verdict=verdict)
            raise failed
        raise RecoveryFailed(
            Reason.RESTORE_FAILED,
            f"restore of {recovery.checkpoint} under attempt {recovery.target_attempt} "
            "failed (retired everywhere): " + "; ".join(str(f) for f in outcome.failures[:3]),
        )
    logger.info(
        "set %s: restored %d episode(s) of %s under attempt %d",
        rset.metadata.name,
        len(outcome.episodes),
        recovery.checkpoint,
        recovery.target_attempt,
    )
    set_phase(
        run,
        RecoveryPhase.RESUMING,
        episodes_restored=len(outcome.episodes),
        kept_work=total_work(outcome.kept.values()),
    )
    return run


async def resume(context: RecoveryContext, run: RecoveryPass) -> RecoveryPass | None:
    """Resuming: resume the restored participants, then end the recovery in the pass's one
    write (`attempt` is the target, `lastRecovery`, the conditions), its Event after it."""
    rset = run.rset
    recovery = recovery_of(rset)
    if recovery.checkpoint is not None:
        coordinator, clients = await context.coordinator(rset)
        checkpoint = recovery.checkpoint
        try:
            resumed = await while_pods_hold(
                context,
                rset,
                lambda: coordinator.resume(
                    checkpoint, context.clock() + context.waits.restore_floor_seconds
                ),
            )
        finally:
            for client in clients:
                await client.aclose()
        if resumed.failures:
            raise RecoveryFailed(
                Reason.RESTORE_FAILED,
                "resume after restore failed: " + "; ".join(str(f) for f in resumed.failures[:3]),
            )
        reason = Reason.RESTORED
        how = f"restored checkpoint {recovery.checkpoint}"
    elif rset.spec.recovery.target_level is TargetLevel.SIBLING:
        reason, how = Reason.SIBLING_RESTART, "targetLevel sibling: episodes restart"
    else:
        reason, how = Reason.NO_CHECKPOINT, "no Ready checkpoint: episodes restart from scratch"
    now = utcnow()
    took = (now - recovery.started_at).total_seconds()
    kept = f"; kept {len(recovery.kept)} pod(s)" if recovery.kept else ""
    message = (
        f"recovered from {recovery.reason or 'a lost participant'} in {took:.0f}s: "
        f"attempt {recovery.target_attempt} runs; {how}{kept}"
    )
    last = await last_recovery(context, rset, recovery, now)
    change(
        run,
        {
            "recovery": None,
            "lastRecovery": last,
            "attempt": recovery.target_attempt,
            "createdAttempt": recovery.target_attempt,
            "restarts": rset.status.restarts + (1 if counts_as_restart(recovery) else 0),
        },
        [
            ConditionUpdate.of(SetConditionType.RECOVERING.value, False, reason, message),
            ConditionUpdate.of(SetConditionType.READY.value, True, reason, message),
            ConditionUpdate.of(SetConditionType.DEGRADED.value, False, reason, message),
        ],
    )
    run.announce(reason, message, False)
    return run


async def while_pods_hold(
    context: RecoveryContext, rset: RolloutSet, step: Callable[[], Awaitable[_T]]
) -> _T:
    """Run a restore or resume step, cancelled as soon as a pod of the target attempt is
    lost: the next try starts at once instead of after the step's deadline (a call to a
    dead pod retries until then)."""
    recovery = recovery_of(rset)
    target = recovery.target_attempt

    async def lost() -> str | None:
        try:
            pods, nodes_of, lost_nodes = await observe(context.kube, rset)
        except (ApiError, OSError, TimeoutError) as error:
            logger.debug("observing the pods of %s failed: %s", rset.metadata.name, error)
            return None
        losses = find_losses(rset, target, pods, nodes_of, lost_nodes)
        return next((loss.message for loss in losses.values()), None)

    async def next_look() -> None:
        await context.kube.cache.wait_for_change(
            namespace_or_default(rset.metadata.namespace), rset.metadata.name, POLL_SECONDS
        )

    try:
        return await while_holding(step, lost, next_look)
    except NoLongerHolds as broken:
        raise RecoveryFailed(
            Reason.REPLACEMENT_LOST, f"{broken}; the next try starts now"
        ) from None


def not_restorable(
    checkpoint: str, failures: Sequence[Failure]
) -> tuple[str, RecoveryFailed] | None:
    """The checkpoint's verdict when a participant refused its records (`records_invalid`) or
    found none on its storage (`records_unreachable`), with the try's failure; None when the
    restore failed for another reason (the pods', retried under the same checkpoint).

    Damaged records win over missing ones: they are the stronger statement about the
    checkpoint. Either way it is never restored again (a lost node's volume may come back, but
    a recovery that waited for it could wait forever)."""
    for code, verdict, reason, why in _REFUSALS:
        refused = [f for f in failures if f.code is code]
        if refused:
            detail = "; ".join(str(f) for f in refused[:3])
            return verdict, RecoveryFailed(
                reason,
                f"the records of checkpoint {checkpoint} {why} ({detail}); it is marked "
                "Ready=False and the next try restores the newest older Ready checkpoint, or "
                "starts fresh",
            )
    return None


_REFUSALS: Final = (
    (
        ErrorCode.RECORDS_INVALID,
        CHECKPOINT_RECORDS_INVALID,
        Reason.CHECKPOINT_INVALID,
        "failed verification",
    ),
    (
        ErrorCode.RECORDS_UNREACHABLE,
        CHECKPOINT_RECORDS_UNREACHABLE,
        Reason.CHECKPOINT_UNREACHABLE,
        "are unreachable from the restoring participants: they are not on the storage these "
        "pods mount (on a volume only a lost node had? checkpoint to storage every node mounts "
        "to restore across nodes)",
    ),
)
"""What a participant's refusal of the records says about the checkpoint, strongest first: the
code, the checkpoint's verdict, the try's reason, and the message's words."""


async def invalidate(
    context: RecoveryContext,
    rset: RolloutSet,
    name: str,
    detail: str,
    verdict: str = CHECKPOINT_RECORDS_INVALID,
) -> None:
    """A restore's refusal is permanent: the checkpoint is no longer restorable.

    Its Ready condition turns False (reason `verdict`: RecordsInvalid or RecordsUnreachable,
    phase Failed), so no later recovery tries it again, retention treats its records as
    garbage, and the set's pass moves `latestCheckpoint` to the newest other Ready
    checkpoint."""
    ckpt = await read_checkpoint(context, rset, name)
    if ckpt is not None:
        message = truncate(f"restore refused it, not restorable: {detail}", 1000)

        def refused(stored: RolloutCheckpoint) -> dict[str, Any]:
            conditions = stored.status.conditions
            for type_, status in (
                (CheckpointConditionType.READY, False),
                (CheckpointConditionType.FAILED, True),
            ):
                conditions = set_condition(
                    conditions,
                    type_.value,
                    status,
                    verdict,
                    message,
                    observed_generation=stored.metadata.generation,
                )
            return {
                "phase": CheckpointPhase.FAILED.value,
                "conditions": [dump(c) for c in conditions],
            }

        await CheckpointStatusWriter(context.kube, CheckpointOwner.VERDICT).write_retrying(
            ckpt, refused
        )
    logger.warning("set %s: checkpoint %s is not restorable: %s", rset.metadata.name, name, detail)


async def last_recovery(
    context: RecoveryContext, rset: RolloutSet, recovery: RecoveryStatus, now: datetime
) -> LastRecovery:
    """What this recovery kept and lost, for status, the printer columns and metrics."""
    spent = phase_seconds_until(recovery, now)
    age: float | None = None
    restarted = 0
    if recovery.checkpoint is not None:
        ckpt = await read_checkpoint(context, rset, recovery.checkpoint)
        if ckpt is not None:
            restarted = ckpt.status.restarts or 0
            completed = ckpt.status.completed_at
            if completed is not None:
                age = max(0.0, (recovery.started_at - completed).total_seconds())
    loss = work_loss(
        checkpoint=recovery.checkpoint,
        instances=[instance_name(i) for i in attempt_instances(rset, recovery.from_attempt, [])],
        reports=recovery.lost_work,
        kept=recovery.kept_work,
    )
    return LastRecovery(
        completed_at=now,
        reason=recovery.reason or "Unknown",
        attempt=recovery.target_attempt,
        restore_policy=recovery.restore_policy,
        kept=len(recovery.kept),
        replaced=len(recovery.replaced),
        adopted=recovery.adopted,
        checkpoint=recovery.checkpoint,
        checkpoint_age_seconds=None if age is None else round(age, 3),
        episodes_restored=recovery.episodes_restored or 0,
        episodes_restarted=restarted,
        duration_seconds=round(max(0.0, (now - recovery.started_at).total_seconds()), 3),
        phase_seconds=spent,
        model_tokens_kept=loss.model_tokens_kept,
        model_tokens_generated_again=loss.model_tokens_generated_again,
        steps_kept=loss.steps_kept,
        steps_redone=loss.steps_redone,
        work_uncounted=loss.uncounted,
    )
