"""The recovery's own repairs of a status written by hand
(docs/design.md#610-status-written-by-hand).

- `repair_false_recovery`: a `status.recovery` that no lost participant explains is removed
  before it stops a pod.
- `repair_unfinished_recovery`: a `status.recovery` removed while the recovery ran (its pods
  of the new attempt were never restored) is started again, instead of those pods being adopted.

Both run in the set's loop before the recovery would act on such a status
(`flows/reconciler.py`), over the pass's snapshot: each returns its repair as a delta of the
recovery (`StatusOwner.RECOVERY`), which the pass writes with the rest of its status.
"""

from __future__ import annotations

from typing import Any, Final

from ...cluster.kube import Kube
from ...cluster.objects import observe_pods
from ...cluster.statuswriter import SetDelta
from ...decide.setstatus import NOT_AN_INTERFACE, REPAIRED, finished_attempt
from ...model.api import (
    RecoveryPhase,
    RecoveryStatus,
    RestorePolicy,
    RolloutSet,
    SetConditionType,
    namespace_or_default,
)
from ...model.conditions import (
    ConditionUpdate,
    is_true,
    merge_conditions,
    utcnow,
)
from ...model.owners import StatusOwner
from ...model.reasons import Reason
from .context import logger
from .loss import find_losses, observe

RECOVERY_RESTARTED: Final = "RecoveryRestarted"
"""Condition and recovery reason: a recovery whose `status.recovery` was removed while it ran
starts again (`repair_unfinished_recovery`)."""


async def repair_false_recovery(kube: Kube, rset: RolloutSet) -> SetDelta | None:
    """Remove a `status.recovery` that no lost participant explains
    (docs/design.md#610-status-written-by-hand).

    A recovery stops every pod of the running attempt and restores the latest checkpoint into
    fresh ones: taking one written by hand (`kubectl patch --subresource=status`) for real
    would disrupt every episode for nothing. A recovery the operator started begins in
    StoppingAttempt from the set's current attempt because a participant of it was lost, and
    that loss stays visible until the recovery acts: the pod is gone, finished, terminating or
    on a NotReady node. One that has not tried yet, shows no such loss and no pod of a later
    attempt is removed, with an Event; anything else is left to the recovery flow."""
    status = rset.status
    recovery = status.recovery
    if (
        recovery is None
        or recovery.phase is not RecoveryPhase.STOPPING_ATTEMPT
        or recovery.tries
        or recovery.reason == Reason.RESUMED
        or rset.spec.suspend
        or is_true(status.conditions, SetConditionType.SUSPENDED.value)
    ):
        return None
    attempt = status.attempt or 1
    if recovery.from_attempt != attempt or (status.created_attempt or 0) < attempt:
        return None
    pods, nodes_of, lost_nodes = await observe(kube, rset)
    if any(pod.attempt > attempt for pod in pods):
        return None  # the recovery acted already
    if find_losses(rset, attempt, pods, nodes_of, lost_nodes):
        return None
    message = (
        f"status.recovery said attempt {recovery.from_attempt} lost a participant "
        f"({recovery.reason or 'no reason'}), but every participant pod of attempt {attempt} "
        f"runs: removed it, no pod was stopped; {NOT_AN_INTERFACE}"
    )
    body: dict[str, Any] = {"recovery": None}
    if is_true(status.conditions, SetConditionType.RECOVERING.value):
        body["conditions"] = merge_conditions(
            status.conditions,
            [ConditionUpdate.of(SetConditionType.RECOVERING.value, False, REPAIRED, message)],
            observed_generation=rset.metadata.generation,
        )
    logger.warning("RolloutSet %s/%s: %s", rset.metadata.namespace, rset.metadata.name, message)
    return SetDelta(StatusOwner.RECOVERY, body, events=((REPAIRED, message),), requeue=True)


async def repair_unfinished_recovery(kube: Kube, rset: RolloutSet) -> SetDelta | None:
    """Start the recovery again when its `status.recovery` was removed while it ran.

    Pods of an attempt above the last one the set finished bringing up (`finished_attempt`)
    run while no recovery is recorded: a recovery created them and had not restored (or not
    resumed) them when its record went. Adopting them would run a set whose episodes were never
    restored from the checkpoint (they are lost); the records of the lost attempt are still on
    storage. The recovery starts over from StoppingAttempt under a fresh target attempt
    (`running + 1`): every pod of the attempts in between is stopped, fresh pods restore the
    newest Ready checkpoint, as after a failed try. Recreate, whatever the spec says: which pods
    an InPlace try kept is not known any more."""
    if rset.status.recovery is not None:
        return None
    namespace, name = namespace_or_default(rset.metadata.namespace), rset.metadata.name
    running = {pod.attempt for pod in await observe_pods(kube, namespace, name) if pod.live}
    if not running or max(running) <= finished_attempt(rset):
        return None  # no recovery was cut short; the set pass adopts the running attempt
    running_attempt = max(running)
    status = rset.status
    now = utcnow()
    message = (
        f"pods of attempt {running_attempt} run, but no recovery is recorded and the set "
        f"finished bringing up attempt {finished_attempt(rset)} only (status.recovery was "
        f"removed while a recovery ran): their episodes were never restored, so they are not "
        f"adopted; the recovery starts again under attempt {running_attempt + 1}; "
        f"{NOT_AN_INTERFACE}"
    )
    recovery = RecoveryStatus(
        phase=RecoveryPhase.STOPPING_ATTEMPT,
        from_attempt=min(status.attempt or 1, running_attempt),
        target_attempt=running_attempt + 1,
        started_at=now,
        phase_started_at=now,
        reason=RECOVERY_RESTARTED,
        message=message,
        restore_policy=RestorePolicy.RECREATE,
    )
    conditions = merge_conditions(
        status.conditions,
        [
            ConditionUpdate.of(
                SetConditionType.RECOVERING.value, True, RECOVERY_RESTARTED, message
            ),
            ConditionUpdate.of(SetConditionType.READY.value, False, RECOVERY_RESTARTED, message),
        ],
        observed_generation=rset.metadata.generation,
    )
    logger.warning("RolloutSet %s/%s: %s", namespace, name, message)
    return SetDelta(
        StatusOwner.RECOVERY,
        {"recovery": recovery, "conditions": conditions},
        events=((REPAIRED, message),),
        requeue=True,
    )
