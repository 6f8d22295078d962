"""Checkpoint-policy handlers (docs/design.md#63-deadline to 6.5): thin wiring around
`flows.policypass` (and `flows.queuepass`).

- `policy_loop`: a daemon per RolloutSet that runs `PolicyPass` whenever it is woken (any event
  of the set or of one of its RolloutCheckpoints) and otherwise at the time the last pass asked
  for (a deadline start, an interval tick) or every `--resync-seconds` (default 300). One loop
  per set means the policy's decisions for a set never run twice at once in this process, so
  two events cannot both decide to create the same interval checkpoint or both release the
  pods. It returns by itself when the set is deleted or the operator stops (`passloop`).
- `workload_changed`: Kueue changed a queued set's Workload (admitted, evicted): a pass, whose
  `QueuePass` acts on it before the policy's.
- `pod_terminating`: a participant pod got a deletion timestamp: the Eviction checkpoint is
  created right from the pod event (the grace period is short; the loop may be mid-pass).
- the checkpoint events (a checkpoint appeared, finished or went: deadline, suspend and retention
  depend on it) wake the loop from `handlers/rolloutcheckpoint.py` (`wake_policy`), which also
  carries the checkpoints' records finalizer.
- `remove_set_checkpoints`: the set's finalizer (Kopf's `on.delete`): its checkpoints go first.

What one pass of the loop runs is `flows.reconciler.policy_pass`; the loops' wake-up Events are
in the process's `OperatorState` (`state_of(memo).policy_loops`,
docs/design.md#611-the-operators-in-process-state).
"""

from __future__ import annotations

from typing import Any, Final

import kopf

from ..cluster.kube import ApiError
from ..cluster.storage import StorageLocator
from ..decide.policy.views import Note
from ..decide.queue import KUEUE_GROUP, KUEUE_VERSION, WORKLOADS
from ..flows.passloop import STOP_BACKOFF_SECONDS, Next, PassLoop, Stopped
from ..flows.policypass import CheckpointBusy, set_deleted, start_eviction_checkpoint
from ..flows.reconciler import policy_pass
from ..model.api import (
    GROUP,
    LABEL_SET,
    ROLLOUT_SET_PLURAL,
    VERSION,
    RolloutSet,
    namespace_or_default,
)
from .events import post_set_event
from .runtime import kube_of, options_of, state_of

MAX_BACKOFF_SECONDS: Final = 30.0
WAKE_SLACK_SECONDS: Final = 0.02
NOTES_REMEMBERED: Final = 64


def wake_policy(memo: kopf.Memo, namespace: str | None, name: object) -> None:
    """Ask the set's policy loop for a pass soon (no-op when the set has no loop here)."""
    state_of(memo).policy_loops.wake(namespace, name)


async def _post(rset: RolloutSet, note: Note) -> None:
    post_set_event(rset, note.reason, note.message, warning=note.warning)


@kopf.daemon(
    GROUP,
    VERSION,
    ROLLOUT_SET_PLURAL,
    id="policy",
    cancellation_backoff=STOP_BACKOFF_SECONDS,
    cancellation_timeout=10.0,
)
async def policy_loop(
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    logger: kopf.Logger,
    stopped: kopf.DaemonStopped,
    **kwargs: Any,
) -> None:
    """Run the set's checkpoint policy until the set is deleted or the operator stops
    (`passloop`: it returns by itself within `STOP_BACKOFF_SECONDS`, so Kopf never has to
    cancel it)."""
    namespace = namespace_or_default(namespace)
    state = state_of(memo)
    with state.policy_loops.registered(namespace, name) as event:
        waits = PassLoop(stopped, wake=event)
        event.set()
        posted: list[tuple[str, str]] = []

        async def note_once(rset: RolloutSet, note: Note) -> None:
            """Post each distinct note once per loop: a pass repeats its notes until the cause
            goes (an invalid annotation stays until someone fixes it)."""
            if (note.reason, note.message) in posted:
                return
            posted.append((note.reason, note.message))
            del posted[:-NOTES_REMEMBERED]
            await _post(rset, note)

        async def one_pass() -> Next:
            return await policy_pass(
                kube_of(memo, kwargs), namespace, name, state=state, on_note=note_once
            )

        def failed(error: Exception, delay: float) -> None:
            logger.warning("checkpoint policy pass failed (%s); retrying in %.1fs", error, delay)

        try:
            # Exactly at the time a pass asks for (a deadline start is a matter of tenths of a
            # second); a wake a hair early just makes the pass ask for the time again.
            await waits.run_passes(
                one_pass,
                # Without events, only this often (a missed event heals): `--resync-seconds`.
                resync_seconds=options_of(memo).resync_seconds,
                max_backoff_seconds=MAX_BACKOFF_SECONDS,
                slack_seconds=WAKE_SLACK_SECONDS,
                on_failure=failed,
            )
        except Stopped:
            logger.info("policy stopped: the pass under way was cancelled (the next one redoes it)")


@kopf.on.event(GROUP, VERSION, ROLLOUT_SET_PLURAL, id="policy-set-changed")
async def set_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Spec, annotations (a trainer step) or status (Ready, a recovery ended) changed."""
    wake_policy(memo, namespace, name)


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, WORKLOADS, labels={LABEL_SET: kopf.PRESENT}, id="queue")
async def workload_changed(
    namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    """A queued set's Workload was created, admitted, evicted or requeued by Kueue (without
    Kueue's CRDs Kopf logs that it cannot serve this resource, and nothing else changes)."""
    wake_policy(memo, namespace, labels.get(LABEL_SET))


def _terminating(meta: kopf.Meta, **_: Any) -> bool:
    return meta.get("deletionTimestamp") is not None


@kopf.on.event(
    "",
    "v1",
    "pods",
    labels={LABEL_SET: kopf.PRESENT},
    when=_terminating,
    id="eviction",
)
async def pod_terminating(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """An evicted, drained or preempted participant pod: checkpoint inside its grace period.

    Event handlers are not retried by Kopf; a failed create is retried by the next event of the
    terminating pod (its status changes as it stops), and the recovery holds off until the
    grace period ends either way (`cluster.objects.eviction_holds`)."""
    try:
        created = await start_eviction_checkpoint(kube_of(memo, kwargs), body)
    except (ApiError, OSError, TimeoutError) as error:
        logger.warning("eviction checkpoint for pod %s not created: %s", body.meta.name, error)
        return
    if created is not None:
        logger.info("pod %s is being deleted: eviction checkpoint %s", body.meta.name, created)
        kopf.event(
            body,
            type="Normal",
            reason="EvictionCheckpoint",
            message=f"checkpoint {created} saves the set's episodes inside this pod's grace period",
        )


@kopf.on.delete(GROUP, VERSION, ROLLOUT_SET_PLURAL, id="remove-checkpoints", timeout=300)
async def remove_set_checkpoints(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """The finalizer of a RolloutSet: its checkpoints (and their records) go first. Bounded:
    after `timeout` Kopf gives up on this handler and the set goes anyway."""

    async def note(rset: RolloutSet, found: Note) -> None:
        await _post(rset, found)

    try:
        outcome = await set_deleted(
            kube_of(memo, kwargs), body, locator=StorageLocator.from_env(), on_note=note
        )
    except CheckpointBusy as busy:
        raise kopf.TemporaryError(str(busy), delay=2) from busy
    logger.info("RolloutSet %s deleted: %s", body.meta.name, outcome)


__all__ = [
    "pod_terminating",
    "policy_loop",
    "remove_set_checkpoints",
    "set_changed",
    "wake_policy",
    "workload_changed",
]
