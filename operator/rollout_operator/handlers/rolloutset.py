"""RolloutSet handlers: one reconcile loop per set, woken by everything that concerns it.

A Kopf daemon per RolloutSet runs `flows.setpass.reconcile_set` whenever it is woken (spec change,
resume, a pod event of the set) and otherwise at the next progress deadline or every
`--resync-seconds` (default 300). One loop per set means one writer per set in this process: no
two passes of the same set overlap, and a burst of pod events collapses into one pass.

Other flows (recovery, checkpoints) call `wake(namespace, name)` after they change something
the set's status should reflect. When the set is deleted or the operator stops, the loop returns
by itself (`passloop`) instead of waiting for Kopf to cancel it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Final

import kopf

from .. import metrics
from ..flows.passloop import STOP_BACKOFF_SECONDS, Next, PassLoop, Stopped
from ..flows.recovery import recover_if_needed, repair_false_recovery
from ..flows.repairs import repair_set_attempt
from ..flows.setpass import latest_written_elsewhere, reconcile_set
from ..model.api import (
    ANNOTATION_RETRY_RECOVERY,
    CHECKPOINT_SET_FIELD,
    GROUP,
    LABEL_SET,
    ROLLOUT_CHECKPOINT_PLURAL,
    ROLLOUT_SET_PLURAL,
    VERSION,
    CheckpointPhase,
    RolloutSet,
)
from ..model.conditions import utcnow
from .events import post_set_event
from .runtime import kube_of, options_of

MAX_BACKOFF_SECONDS: Final = 30.0

_wakeups: dict[tuple[str, str], asyncio.Event] = {}


def wake(namespace: str | None, name: str) -> None:
    """Ask the set's reconcile loop for a pass soon (no-op when the set has no loop here)."""
    event = _wakeups.get((namespace or "default", name))
    if event is not None:
        event.set()


@kopf.on.create(GROUP, VERSION, ROLLOUT_SET_PLURAL, id="created")
async def created(namespace: str | None, name: str, logger: kopf.Logger, **_: Any) -> None:
    """A new set: its loop starts with it; make sure the first pass is not delayed."""
    logger.info("RolloutSet created; starting attempt 1")
    wake(namespace, name)


@kopf.on.update(GROUP, VERSION, ROLLOUT_SET_PLURAL, field="spec", id="spec-changed")
async def spec_changed(namespace: str | None, name: str, **_: Any) -> None:
    wake(namespace, name)


def _retry_requested(annotations: kopf.Annotations, status: kopf.Status, **_: Any) -> bool:
    """A held recovery whose retry-recovery annotation no longer has the value it stopped at.
    (Kopf leaves annotations under the operator's own prefix out of its diffs, since its
    progress storage writes there, so an on.update handler never sees this one change.)"""
    hold = status.get("recoveryHold")
    if not hold:
        return False
    return bool(annotations.get(ANNOTATION_RETRY_RECOVERY) != hold.get("retryToken"))


@kopf.on.event(GROUP, VERSION, ROLLOUT_SET_PLURAL, when=_retry_requested, id="retry-recovery")
async def retry_recovery(namespace: str | None, name: str, **_: Any) -> None:
    """A user asked to retry a recovery the churn bound held: a pass now, not at the resync."""
    wake(namespace, name)


def _status_to_check(status: kopf.Status, **_: Any) -> bool:
    """Status a pass must look at soon: a recovery, or an attempt other than the last one whose
    pods were all created (a recovery under way, or a value written by hand)."""
    if status.get("recovery"):
        return True
    attempt, created = status.get("attempt"), status.get("createdAttempt")
    return attempt is not None and created is not None and attempt != created


@kopf.on.event(GROUP, VERSION, ROLLOUT_SET_PLURAL, when=_status_to_check, id="status-check")
async def status_check(namespace: str | None, name: str, **_: Any) -> None:
    """A pass soon, whoever wrote the status. The loop is busy while it runs a recovery (the
    wake then costs one pass after it); a recovery or attempt written by hand is checked
    against the pods at once (`repair_false_recovery`, `repair_set_attempt`) instead of at
    the next resync."""
    wake(namespace, name)


def _latest_written_elsewhere(
    namespace: str | None, name: str, status: kopf.Status, **_: Any
) -> bool:
    return latest_written_elsewhere(namespace or "default", name, status.get("latestCheckpoint"))


@kopf.on.event(GROUP, VERSION, ROLLOUT_SET_PLURAL, when=_latest_written_elsewhere, id="latest")
async def latest_checkpoint_written(namespace: str | None, name: str, **_: Any) -> None:
    """`status.latestCheckpoint` is not what the set's pass wrote: the pass writes it back."""
    wake(namespace, name)


_SET_FIELDS_CHANGE: Final = frozenset(
    {None, CheckpointPhase.PREPARING, CheckpointPhase.READY, CheckpointPhase.FAILED}
)
"""Checkpoint phases after which the set's checkpoint fields may change (`setstatus`)."""


def _changes_set_fields(status: kopf.Status, meta: kopf.Meta, **_: Any) -> bool:
    phase = status.get("phase")
    return phase in _SET_FIELDS_CHANGE or meta.get("deletionTimestamp") is not None


@kopf.on.event(
    GROUP, VERSION, ROLLOUT_CHECKPOINT_PLURAL, when=_changes_set_fields, id="checkpoint-event"
)
async def checkpoint_event(namespace: str | None, spec: kopf.Spec, **_: Any) -> None:
    """A checkpoint started, finished or is going: the set's pass derives `activeCheckpoint`,
    `latestCheckpoint` and the durations from its checkpoints, and writes the pods' hints."""
    set_name = spec.get(CHECKPOINT_SET_FIELD)
    if isinstance(set_name, str):
        wake(namespace, set_name)


@kopf.on.resume(GROUP, VERSION, ROLLOUT_SET_PLURAL, id="resumed")
async def resumed(namespace: str | None, name: str, **_: Any) -> None:
    """After an operator restart: everything is re-read from the API, nothing from memory."""
    wake(namespace, name)


_pods_seen: dict[tuple[str, str], str] = {}
"""Per pod, what the set's pass last could see of it (`_what_the_pass_sees`)."""


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
    **_: Any,
) -> None:
    """A pass of the pod's set, unless only what the pass ignores changed (the set's pass
    annotating its pods after a checkpoint would otherwise wake it once per pod)."""
    set_name = labels.get(LABEL_SET)
    if not set_name:
        return
    key = (namespace or "default", name)
    if type == "DELETED":
        _pods_seen.pop(key, None)
    else:
        seen = _what_the_pass_sees(body)
        if _pods_seen.get(key) == seen:
            return
        _pods_seen[key] = seen
    wake(namespace, set_name)


def _node_not_ready(status: kopf.Status, **_: Any) -> bool:
    conditions = status.get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    return ready is None or ready.get("status") != "True"


@kopf.on.event("", "v1", "nodes", when=_node_not_ready, id="node-not-ready")
async def node_not_ready(**_: Any) -> None:
    """A node went NotReady: every set looks at once whether a participant ran there."""
    for namespace, name in list(_wakeups):
        wake(namespace, name)


async def _recovery_event(rset: RolloutSet, reason: str, message: str, warning: bool) -> None:
    metrics.observe_recovery(rset, reason)
    post_set_event(rset, reason, message, warning=warning)


_transitions = metrics.SetTransitions()


@kopf.on.event(GROUP, VERSION, ROLLOUT_SET_PLURAL, id="observe")
async def observe_set(type: str | None, body: kopf.Body, **_: Any) -> None:
    """The attempt gauge, and an Event for each transition the flows do not post themselves."""
    for change in _transitions.observe(type, body):
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
    memo: Any,
    logger: kopf.Logger,
    stopped: kopf.DaemonStopped,
    **kwargs: Any,
) -> None:
    """Reconcile the set until it is deleted or the operator stops (`passloop`: it returns by
    itself within `STOP_BACKOFF_SECONDS`, so Kopf never has to cancel it)."""
    namespace = namespace or "default"
    key = (namespace, name)
    event = _wakeups.setdefault(key, asyncio.Event())
    waits = PassLoop(stopped, wake=event)
    event.set()

    warned: set[tuple[str, str]] = set()
    """Warning Events posted by this loop (each once while the set's loop runs)."""

    async def one_pass() -> Next:
        kube = kube_of(memo, kwargs)
        # Status first: a recovery or a pass acting on an attempt no pod runs would start a
        # second attempt beside the first (docs/design.md#610-status-written-by-hand).
        repaired = await repair_set_attempt(kube, namespace, name)
        if repaired is not None:
            raw = await kube.get_set(namespace, name)
            if raw is not None:
                post_set_event(
                    RolloutSet.model_validate(raw), repaired.reason, repaired.message, warning=True
                )
        # A recovery nobody lost a participant for would stop every running pod (class 2).
        false_recovery = await repair_false_recovery(kube, namespace, name)
        if false_recovery is not None:
            raw = await kube.get_set(namespace, name)
            if raw is not None:
                post_set_event(
                    RolloutSet.model_validate(raw),
                    false_recovery.reason,
                    false_recovery.message,
                    warning=True,
                )
        look = await recover_if_needed(kube, namespace, name, on_transition=_recovery_event)
        outcome = await reconcile_set(
            kube,
            namespace,
            name,
            max_replicas_per_role=options_of(memo).max_replicas_per_role,
        )
        for reason, message in outcome.warnings:
            if (reason, message) not in warned:
                warned.add((reason, message))
                raw = await kube.get_set(namespace, name)
                if raw is not None:
                    post_set_event(RolloutSet.model_validate(raw), reason, message, warning=True)
        times = [t for t in (outcome.recheck_at, look.retry_at) if t is not None]
        return Next(again=outcome.conflict, at=min(times) if times else None)

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
        logger.info("reconcile stopped; the pass under way was cancelled (status has its state)")
    finally:
        if _wakeups.get(key) is event:
            del _wakeups[key]
