"""RolloutSet handlers: one reconcile loop per set, woken by everything that concerns it.

A Kopf daemon per RolloutSet runs `flows.reconciler.set_pass` whenever it is woken (spec change,
resume, a pod event of the set) and otherwise at the next progress deadline or every
`--resync-seconds` (default 300). One loop per set means one writer per set in this process: no
two passes of the same set overlap, and a burst of pod events collapses into one pass.

Other flows (the policy and queue passes, checkpoints) wake the loop through
`OperatorState.set_loops` after they change something the set's status should reflect. When the
set is deleted or the operator stops, the loop returns by itself (`passloop`) instead of waiting
for Kopf to cancel it.

Wiring only: what one pass runs, and in which order, is `flows.reconciler.set_pass`; what the
handlers remember between events is in the process's `OperatorState` (`state_of(memo)`,
docs/design.md#611-the-operators-in-process-state).
"""

from __future__ import annotations

import json
from typing import Any, Final

import kopf

from .. import metrics
from ..flows.passloop import STOP_BACKOFF_SECONDS, Next, PassLoop, Stopped
from ..flows.reconciler import set_pass
from ..flows.recovery import RecoveryWaits
from ..model.api import (
    ANNOTATION_RETRY_RECOVERY,
    GROUP,
    LABEL_SET,
    ROLLOUT_SET_PLURAL,
    VERSION,
    RolloutSet,
    namespace_or_default,
)
from ..model.conditions import utcnow
from .events import post_set_event
from .runtime import kube_of, options_of, state_of

MAX_BACKOFF_SECONDS: Final = 30.0


def wake(memo: kopf.Memo, namespace: str | None, name: object) -> None:
    """Ask the set's reconcile loop for a pass soon (no-op when the set has no loop here)."""
    state_of(memo).set_loops.wake(namespace, name)


@kopf.on.create(GROUP, VERSION, ROLLOUT_SET_PLURAL, id="created")
async def created(
    namespace: str | None, name: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """A new set: its loop starts with it; make sure the first pass is not delayed."""
    logger.info("RolloutSet created; starting attempt 1")
    wake(memo, namespace, name)


@kopf.on.update(GROUP, VERSION, ROLLOUT_SET_PLURAL, field="spec", id="spec-changed")
async def spec_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    wake(memo, namespace, name)


def _retry_requested(annotations: kopf.Annotations, status: kopf.Status, **_: Any) -> bool:
    """A held recovery whose retry-recovery annotation no longer has the value it stopped at.
    (Kopf leaves annotations under the operator's own prefix out of its diffs, since its
    progress storage writes there, so an on.update handler never sees this one change.)"""
    hold = status.get("recoveryHold")
    if not hold:
        return False
    return bool(annotations.get(ANNOTATION_RETRY_RECOVERY) != hold.get("retryToken"))


@kopf.on.event(GROUP, VERSION, ROLLOUT_SET_PLURAL, when=_retry_requested, id="retry-recovery")
async def retry_recovery(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A user asked to retry a recovery the churn bound held: a pass now, not at the resync."""
    wake(memo, namespace, name)


def _status_to_check(status: kopf.Status, **_: Any) -> bool:
    """Status a pass must look at soon: a recovery, or an attempt other than the last one whose
    pods were all created (a recovery under way, or a value written by hand)."""
    if status.get("recovery"):
        return True
    attempt, created = status.get("attempt"), status.get("createdAttempt")
    return attempt is not None and created is not None and attempt != created


@kopf.on.event(GROUP, VERSION, ROLLOUT_SET_PLURAL, when=_status_to_check, id="status-check")
async def status_check(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A pass soon, whoever wrote the status. The loop is busy while it runs a recovery (the
    wake then costs one pass after it); a recovery or attempt written by hand is checked
    against the pods at once (`repair_false_recovery`, `repair_set_attempt`) instead of at
    the next resync."""
    wake(memo, namespace, name)


def _latest_written_elsewhere(
    namespace: str | None, name: str, status: kopf.Status, memo: kopf.Memo, **_: Any
) -> bool:
    written = state_of(memo).latest_written
    return written.written_elsewhere(
        namespace_or_default(namespace), name, status.get("latestCheckpoint")
    )


@kopf.on.event(GROUP, VERSION, ROLLOUT_SET_PLURAL, when=_latest_written_elsewhere, id="latest")
async def latest_checkpoint_written(
    namespace: str | None, name: str, memo: kopf.Memo, **_: Any
) -> None:
    """`status.latestCheckpoint` is not what the set's pass wrote: the pass writes it back."""
    wake(memo, namespace, name)


@kopf.on.resume(GROUP, VERSION, ROLLOUT_SET_PLURAL, id="resumed")
async def resumed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """After an operator restart: everything is re-read from the API, nothing from memory."""
    wake(memo, namespace, name)


def _what_the_pass_sees(body: kopf.Body) -> str:
    """A pod's labels, deletion, node and status: what the set's pass and its recovery decide
    on. Not its annotations (the pass's own latest-checkpoint hints) nor its resourceVersion."""
    meta = body.get("metadata") or {}
    seen = {
        "labels": meta.get("labels"),
        "deletionTimestamp": meta.get("deletionTimestamp"),
        "nodeName": (body.get("spec") or {}).get("nodeName"),
        "status": body.get("status"),
    }
    return json.dumps(seen, sort_keys=True)


@kopf.on.event("", "v1", "pods", labels={LABEL_SET: kopf.PRESENT}, id="pod-event")
async def pod_event(
    type: str | None,
    namespace: str | None,
    name: str,
    labels: kopf.Labels,
    body: kopf.Body,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A pass of the pod's set, unless only what the pass ignores changed (the set's pass
    annotating its pods after a checkpoint would otherwise wake it once per pod)."""
    set_name = labels.get(LABEL_SET)
    if not set_name:
        return
    seen = None if type == "DELETED" else _what_the_pass_sees(body)
    if state_of(memo).pods_seen.changed(namespace, name, seen):
        wake(memo, namespace, set_name)


def _node_not_ready(status: kopf.Status, **_: Any) -> bool:
    conditions = status.get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    return ready is None or ready.get("status") != "True"


@kopf.on.event("", "v1", "nodes", when=_node_not_ready, id="node-not-ready")
async def node_not_ready(memo: kopf.Memo, **_: Any) -> None:
    """A node went NotReady: every set looks at once whether a participant ran there."""
    loops = state_of(memo).set_loops
    for namespace, name in loops.sets():
        loops.wake(namespace, name)


async def _recovery_event(rset: RolloutSet, reason: str, message: str, warning: bool) -> None:
    metrics.observe_recovery(rset, reason)
    post_set_event(rset, reason, message, warning=warning)


def _post_warning(rset: RolloutSet, reason: str, message: str) -> None:
    post_set_event(rset, reason, message, warning=True)


@kopf.on.event(GROUP, VERSION, ROLLOUT_SET_PLURAL, id="observe")
async def observe_set(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The attempt gauge, and an Event for each transition the flows do not post themselves."""
    for change in state_of(memo).transitions.observe(type, body):
        kind = "Warning" if change.warning else "Normal"
        kopf.event(body, type=kind, reason=change.reason, message=change.message)


@kopf.daemon(
    GROUP,
    VERSION,
    ROLLOUT_SET_PLURAL,
    id="reconcile",
    cancellation_backoff=STOP_BACKOFF_SECONDS,
    cancellation_timeout=10.0,
)
async def reconcile_loop(
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    logger: kopf.Logger,
    stopped: kopf.DaemonStopped,
    **kwargs: Any,
) -> None:
    """Reconcile the set until it is deleted or the operator stops (`passloop`: it returns by
    itself within `STOP_BACKOFF_SECONDS`, so Kopf never has to cancel it)."""
    namespace = namespace_or_default(namespace)
    state = state_of(memo)
    with state.set_loops.registered(namespace, name) as event:
        waits = PassLoop(stopped, wake=event)
        event.set()

        warned: set[tuple[str, str]] = set()
        """Warning Events posted by this loop (each once while the set's loop runs)."""

        async def one_pass() -> Next:
            return await set_pass(
                kube_of(memo, kwargs),
                namespace,
                name,
                state=state,
                max_replicas_per_role=options_of(memo).max_replicas_per_role,
                recovery_waits=RecoveryWaits(
                    retire_seconds=options_of(memo).inplace_retire_seconds,
                    restore_floor_seconds=options_of(memo).restore_floor_seconds,
                ),
                warned=warned,
                post_warning=_post_warning,
                on_transition=_recovery_event,
            )

        def failed(error: Exception, delay: float) -> None:
            logger.warning("reconcile failed (%s); retrying in %.1fs", error, delay)

        try:
            await waits.run_passes(
                one_pass,
                # Without events, only this often (a missed event heals): `--resync-seconds`.
                resync_seconds=options_of(memo).resync_seconds,
                max_backoff_seconds=MAX_BACKOFF_SECONDS,
                slack_seconds=0.5,
                on_failure=failed,
                now=utcnow,
            )
        except Stopped:
            logger.info(
                "reconcile stopped; the pass under way was cancelled (status has its state)"
            )
