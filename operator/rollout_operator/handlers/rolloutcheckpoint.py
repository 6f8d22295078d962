"""RolloutCheckpoint handlers: one daemon per unfinished checkpoint runs its flow, and one event
handler for everything else a checkpoint's events mean (`checkpoint_event`).

**The event handler.** Every event of a checkpoint carries its records finalizer (the
operator's own, `RECORDS_FINALIZER`, docs/design.md#65-retention-and-records): added where it is
missing (a checkpoint a person or a trainer created; the policy's carry it from their
creation), and on a checkpoint being deleted a task (`OperatorState.checkpoints`) removes its
records and then the finalizer (`policypass.release_deleted_checkpoint`). And it wakes the
set's loops, only when what they read of the checkpoint changed (`OperatorState.
checkpoints_seen`): the policy loop when the checkpoint finished or is going (deadline,
suspend and retention depend on it), the set's reconcile loop when it entered a phase after
which the set's checkpoint fields may change (none, Preparing, Ready, Failed; `setstatus`) or
is going. Its own finalizer patch, a published status and a first sight of a new checkpoint
wake neither. An event handler, not Kopf's `on.delete`: a change handler on the checkpoint kind
would make Kopf keep a diff-base and its own finalizer on every checkpoint (two patches and two
events each, docs/operations.md "API requests and operator CPU per checkpoint").

**The daemon.**

A daemon (not an event handler) because the flow is long and must continue after an operator
restart: Kopf starts daemons again for every object that still exists, and
`CheckpointFlow.run` continues from the phase persisted in status, or returns at once for a
checkpoint that is already Ready or Failed.

Kopf stops the daemon when its `when` filter turns false, i.e. when the watch delivers the
terminal phase. The flow makes that write its last; the daemon then waits for that stop and never
returns by itself before it (`_until_stopped`: Kopf never starts again a daemon that returned on
its own, so a later reset of the status would go unseen), and `cancellation_backoff` lets it
return instead of being cancelled (Kopf would otherwise cancel at once and log a warning for
every checkpoint). An exception (the API server unreachable, say) restarts the daemon after
`backoff` seconds, and the flow continues from the persisted phase.

The daemon needs no Kopf finalizer (`_without_kopf_finalizer`): every checkpoint carries the
operator's own records finalizer (`RECORDS_FINALIZER`, `handlers/policy.py`), so a deletion
always shows as a deletion timestamp first, which is what stops the daemon; and the records
removal waits until the flow here has ended (`OperatorState.checkpoints.flow_runs`). Kopf's own
finalizer would cost two patches per checkpoint (added at creation, removed when the phase is
terminal) and two more watch events (docs/operations.md, "API requests and operator CPU per
checkpoint").

Kopf also stops the daemon when the checkpoint is deleted or the operator shuts down, and the
two are handled differently (decided in one place, `flows.reconciler.checkpoint_run`, which
builds and runs the flow; the daemon hands it Kopf's stop and why):

- **Deleted**: the daemon cancels the flow at once; a checkpoint that was not published yet is
  aborted (every participant resumed, the set's slot released, the checkpoint Failed with
  reason Aborted), so the participants are not left paused until their leases lapse.
- **The operator stops** (SIGTERM: its pod deleted, `helm upgrade`, a drain): stopping is not
  aborting. The flow gets `HANDOVER_SECONDS` to finish (a commit, publish and resume take well
  under a second); one still running then is cancelled *without* aborting, exactly as if the
  operator had been killed: its phase is in status (one let go after its cut writes phase
  Resuming first, since its participants may be resumed already: `CheckpointFlow`), the
  participants stay prepared under their leases, and the next operator continues it from there
  (docs/design.md#68-the-operators-own-life, docs/install.md "Upgrade"). Aborting would throw away a
  checkpoint that was about to be Ready and make the participants restart their parked work, to save
  only the successor's start-up time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable
from typing import Any, Final

import kopf

from .. import metrics
from ..cluster.kube import ApiError, Kube
from ..cluster.storage import StorageLocator
from ..decide.policy.views import Note
from ..flows.checkpoint import TERMINAL
from ..flows.passloop import TRANSIENT
from ..flows.policypass import keep_records_finalizer, release_deleted_checkpoint
from ..flows.reconciler import checkpoint_run
from ..model.api import (
    CHECKPOINT_SET_FIELD,
    GROUP,
    RECORDS_FINALIZER,
    ROLLOUT_CHECKPOINT_PLURAL,
    VERSION,
    CheckpointPhase,
    RolloutCheckpoint,
    RolloutSet,
    namespace_or_default,
)
from .events import post_set_event
from .policy import wake_policy
from .rolloutset import wake
from .runtime import checkpoint_slots_of, kube_of, leases_of, state_of

HANDOVER_SECONDS: Final = 4.0
"""How long a flow may still run after the operator was told to stop, before it is left to the
next operator (below the daemon's `cancellation_backoff`, after which Kopf cancels it anyway)."""


_ABORTS: Final = kopf.DaemonStoppingReason.RESOURCE_DELETED
"""Only a deleted checkpoint is aborted. An exiting operator hands its checkpoints over
(`_HANDS_OVER`), a paused one (another took over through peering) leaves them to the other, and
the daemon's own end (the terminal phase written) needs nothing."""
_HANDS_OVER: Final = kopf.DaemonStoppingReason.OPERATOR_EXITING


def _stopped_because(stopped: kopf.DaemonStopped, why: kopf.DaemonStoppingReason) -> bool:
    return stopped.reason is not None and bool(stopped.reason & why)


class _DaemonStop:
    """Kopf's `stopped` flag as the checkpoint's run reads it (`reconciler.CheckpointStop`)."""

    def __init__(self, stopped: kopf.DaemonStopped) -> None:
        self._stopped = stopped

    def wait(self) -> Awaitable[object]:
        return self._stopped.wait()

    @property
    def deleted(self) -> bool:
        return _stopped_because(self._stopped, _ABORTS)

    @property
    def operator_exiting(self) -> bool:
        return _stopped_because(self._stopped, _HANDS_OVER)


def _unfinished(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") not in {phase.value for phase in TERMINAL}


@kopf.daemon(
    GROUP,
    VERSION,
    ROLLOUT_CHECKPOINT_PLURAL,
    id="run",
    when=_unfinished,
    backoff=3.0,
    cancellation_backoff=5.0,
    cancellation_timeout=5.0,
)
async def run_checkpoint(
    namespace: str | None,
    name: str,
    body: kopf.Body,
    memo: kopf.Memo,
    logger: kopf.Logger,
    stopped: kopf.DaemonStopped,
    retry: int,
    **kwargs: Any,
) -> None:
    async def event(ckpt: RolloutCheckpoint, reason: str, message: str) -> None:
        kind = "Warning" if ckpt.status.phase is CheckpointPhase.FAILED else "Normal"
        kopf.event(body, type=kind, reason=reason, message=message)

    kube = kube_of(memo, kwargs)
    namespace = namespace_or_default(namespace)
    try:
        phase = await checkpoint_run(
            kube,
            namespace,
            name,
            state=state_of(memo),
            stop=_DaemonStop(stopped),
            handover_seconds=HANDOVER_SECONDS,
            slots=checkpoint_slots_of(memo),
            leases=leases_of(memo),
            on_transition=event,
        )
    except TRANSIENT as error:
        # The API server restarting, the network: weather, not a bug. One line, then Kopf
        # restarts the daemon after the delay and the flow continues from its phase.
        delay = min(30.0, 2.0 ** min(retry + 1, 5))
        raise kopf.TemporaryError(
            f"checkpoint {name}: {type(error).__name__}: {error}; retrying in {delay:.0f}s",
            delay=delay,
        ) from error
    if phase is None:
        return  # deleted, or handed over (the daemon was cancelled before the flow ended)
    logger.info("checkpoint %s ended %s", name, phase)
    ended = await metrics.checkpoint_ended(kube, namespace, name)
    if ended is not None and ended.status.phase is CheckpointPhase.READY:
        kopf.event(
            body, type="Normal", reason="Completed", message=metrics.completion_message(ended)
        )
    rollout_set = body.get("spec", {}).get("rolloutSet")
    if isinstance(rollout_set, str):
        wake(memo, namespace, rollout_set)
        await _until_stopped(kube, stopped, namespace, name, rollout_set)


def _without_kopf_finalizer(handler_id: str, registry: kopf.OperatorRegistry) -> None:
    """Register the daemon `handler_id` as one that needs no Kopf finalizer.

    Kopf marks every daemon as needing its finalizer (so that it is stopped before its object
    goes) and offers no option against it; the checkpoint's own records finalizer does that job
    here (module docstring). Kopf's registry of daemons is not public API: if it changes, this
    raises at import instead of quietly adding the finalizer back
    (tests/unit/test_checkpoint_handlers.py checks the outcome through Kopf's own logic)."""
    spawning = registry._spawning
    handlers = spawning._handlers
    found = [i for i, handler in enumerate(handlers) if handler.id == handler_id]
    if len(found) != 1:
        raise LookupError(f"daemon {handler_id!r} is registered {len(found)} times")
    handlers[found[0]] = dataclasses.replace(handlers[found[0]], requires_finalizer=False)


_without_kopf_finalizer("run", kopf.get_default_registry())


_WAKES_SET: Final = frozenset(
    {
        None,
        CheckpointPhase.PREPARING.value,
        CheckpointPhase.READY.value,
        CheckpointPhase.FAILED.value,
    }
)
"""Checkpoint phases after which the set's checkpoint fields may change (`setstatus`): none (a
status reset by hand), Preparing (`activeCheckpoint`), Ready and Failed."""
_UNSEEN: Final = (None, False)
"""What a checkpoint not seen before counts as: no phase, not being deleted."""
_FINISHED: Final = frozenset(phase.value for phase in TERMINAL)


@kopf.on.event(GROUP, VERSION, ROLLOUT_CHECKPOINT_PLURAL, id="checkpoint-event")
async def checkpoint_event(
    type: str | None,
    namespace: str | None,
    name: str,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """The records finalizer, and a wake of the set's loops when what they read of the
    checkpoint changed (see the module docstring)."""
    namespace = namespace_or_default(namespace)
    set_name = spec.get(CHECKPOINT_SET_FIELD)
    state = state_of(memo)
    deleting = body.meta.get("deletionTimestamp") is not None
    phase = status.get("phase")
    if type == "DELETED":
        state.checkpoints_seen.swap(namespace, name, None)
        wake(memo, namespace, set_name)
        wake_policy(memo, namespace, set_name)
        return
    seen = state.checkpoints_seen.swap(namespace, name, (phase, deleting))
    before = seen if isinstance(seen, tuple) else _UNSEEN
    if (phase, deleting) != before and (phase in _WAKES_SET or deleting != before[1]):
        wake(memo, namespace, set_name)
    if _for_policy(phase, deleting) != _for_policy(*before):
        wake_policy(memo, namespace, set_name)
    await _keep_records_finalizer(memo, kwargs, namespace, name, body, spec, logger)


def _for_policy(phase: object, deleting: bool) -> tuple[object, bool]:
    """What the policy reads of a checkpoint: whether it finished, how, and whether it goes."""
    return (phase if phase in _FINISHED else None, deleting)


async def _keep_records_finalizer(
    memo: kopf.Memo,
    kwargs: dict[str, Any],
    namespace: str,
    name: str,
    body: kopf.Body,
    spec: kopf.Spec,
    logger: kopf.Logger,
) -> None:
    finalizers = body.meta.get("finalizers") or []
    if body.meta.get("deletionTimestamp") is None:
        if RECORDS_FINALIZER not in finalizers:
            try:
                await keep_records_finalizer(kube_of(memo, kwargs), body)
            except (ApiError, OSError, TimeoutError) as error:
                # The next event of the checkpoint tries again (its flow writes its status).
                logger.warning("records finalizer not added to %s: %s", name, error)
        return
    if RECORDS_FINALIZER in finalizers:
        state_of(memo).checkpoints.remove(
            namespace, name, lambda: _release(memo, kwargs, namespace, name, spec, logger)
        )


async def _release(
    memo: kopf.Memo,
    kwargs: dict[str, Any],
    namespace: str,
    name: str,
    spec: kopf.Spec,
    logger: kopf.Logger,
) -> None:
    """A deleted checkpoint's records, then its finalizer (`release_deleted_checkpoint`)."""

    async def note(rset: RolloutSet, found: Note) -> None:
        post_set_event(rset, found.reason, found.message, warning=found.warning)

    checkpoints = state_of(memo).checkpoints
    outcome = await release_deleted_checkpoint(
        kube_of(memo, kwargs),
        namespace,
        name,
        flow_runs=lambda: checkpoints.flow_runs(namespace, name),
        locator=StorageLocator.from_env(),
        on_note=note,
    )
    logger.info("checkpoint %s deleted: %s", name, outcome)
    wake_policy(memo, namespace, spec.get("rolloutSet"))


FINISHED_LOOK_SECONDS = 1.0
"""How often a finished flow's daemon looks at its checkpoint while it waits to be stopped."""


async def _until_stopped(
    kube: Kube, stopped: kopf.DaemonStopped, namespace: str, name: str, set_name: str
) -> None:
    """Return once Kopf stops the daemon (the watch delivered the terminal phase: the `when`
    filter no longer matches), never before.

    A daemon that returns by itself is never started again for its object (Kopf remembers it
    as finished), so a status reset afterwards (a published checkpoint's phase written back to
    Pending by hand) would never reach `repair_published_checkpoint`. If the status turns
    unfinished again before the stop, the daemon restarts at once and the flow looks again."""
    while not stopped.is_set():
        await kube.cache.wait_for_change(namespace, set_name, FINISHED_LOOK_SECONDS)
        if stopped.is_set():
            return
        raw = await kube.get_checkpoint(namespace, name)
        if raw is None:
            return  # deleted: Kopf stops the daemon with it
        phase = (raw.get("status") or {}).get("phase")
        if phase not in {p.value for p in TERMINAL}:
            raise kopf.TemporaryError(
                f"checkpoint {name}: status says {phase or 'no phase'} after the flow ended; "
                "looking again",
                delay=0.5,
            )
