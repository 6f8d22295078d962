"""A `status.recovery` written by hand, removed before it stops a pod
(docs/design.md#610-status-written-by-hand).

The recovery's own repair: it writes as the recovery (`StatusOwner.RECOVERY`), and it runs in
the set's loop before the recovery would act on such a status (`flows/reconciler.py`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ...cluster.kube import Conflict, Kube
from ...cluster.statuswriter import SetStatusWriter
from ...decide.policy import RESUMED_REASON
from ...decide.setstatus import NOT_AN_INTERFACE, REPAIRED, Repair
from ...model.api import (
    RecoveryPhase,
    RolloutSet,
    SetConditionType,
)
from ...model.conditions import (
    ConditionUpdate,
    is_true,
    merge_conditions,
)
from ...model.owners import StatusOwner
from .context import logger
from .loss import find_losses, observe


async def repair_false_recovery(kube: Kube, namespace: str, name: str) -> Repair | None:
    """Remove a `status.recovery` that no lost participant explains
    (docs/design.md#610-status-written-by-hand).

    A recovery stops every pod of the running attempt and restores the latest checkpoint into
    fresh ones: taking one written by hand (`kubectl patch --subresource=status`) for real
    would disrupt every episode for nothing. A recovery the operator started begins in
    StoppingAttempt from the set's current attempt because a participant of it was lost, and
    that loss stays visible until the recovery acts: the pod is gone, finished, terminating or
    on a NotReady node. One that has not tried yet, shows no such loss and no pod of a later
    attempt is removed, with an Event; anything else is left to the recovery flow."""
    raw = await kube.get_set(namespace, name)
    if raw is None or (raw.get("metadata") or {}).get("deletionTimestamp"):
        return None
    try:
        rset = RolloutSet.model_validate(raw)
    except ValidationError:
        return None
    status = rset.status
    recovery = status.recovery
    if (
        recovery is None
        or recovery.phase is not RecoveryPhase.STOPPING_ATTEMPT
        or recovery.tries
        or recovery.reason == RESUMED_REASON
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
    try:
        await SetStatusWriter(kube, StatusOwner.RECOVERY).write(rset, body)
    except Conflict:
        return None  # written meanwhile; the next pass looks again
    logger.warning("RolloutSet %s/%s: %s", namespace, name, message)
    return Repair(REPAIRED, message)
