"""RolloutCheckpoint handlers: one daemon per unfinished checkpoint runs its flow.

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
two are handled differently:

- **Deleted**: the daemon cancels the flow at once; a checkpoint that was not published yet is
  aborted (every participant resumed, the set's slot released, the checkpoint Failed with
  reason Aborted), so the participants are not left paused until their leases lapse.
- **The operator stops** (SIGTERM: its pod deleted, `helm upgrade`, a drain): stopping is not
  aborting. The flow gets `HANDOVER_SECONDS` to finish (a commit, publish and resume take well
  under a second); one still running then is cancelled *without* aborting, exactly as if the
  operator had been killed: its phase is in status, the participants stay prepared under
  their leases, and the next operator continues it from there
  (docs/design.md#68-the-operators-own-life, docs/install.md "Upgrade"). Aborting would throw away a
  checkpoint that was about to be Ready and make the participants restart their parked work, to save
  only the successor's start-up time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import anyio
import kopf

from .. import metrics
from ..cluster.kube import Kube
from ..flows.checkpoint import TERMINAL, CheckpointFlow
from ..flows.passloop import TRANSIENT
from ..model.api import (
    GROUP,
    ROLLOUT_CHECKPOINT_PLURAL,
    VERSION,
    CheckpointPhase,
    RolloutCheckpoint,
)
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
    flow = CheckpointFlow(
        kube, on_transition=event, slots=checkpoint_slots_of(memo), leases=leases_of(memo)
    )
    phases: list[CheckpointPhase | None] = []
    failures: list[Exception] = []

    def _aborts() -> bool:
        return _stopped_because(stopped, _ABORTS)

    async with anyio.create_task_group() as group:

        async def cancel_when_stopped() -> None:
            await stopped.wait()
            if _aborts():
                group.cancel_scope.cancel()
            elif _stopped_because(stopped, _HANDS_OVER):
                await anyio.sleep(HANDOVER_SECONDS)  # the flow's own end cancels this first
                logger.info(
                    "checkpoint %s: the operator stops; left in its phase for the next one", name
                )
                group.cancel_scope.cancel()

        async def work() -> None:
            try:
                with state_of(memo).checkpoints.flow_running(namespace or "default", name):
                    phases.append(
                        await flow.run(namespace or "default", name, abort_when_cancelled=_aborts)
                    )
            except Exception as error:  # raised below, outside the task group's wrapping
                failures.append(error)
            finally:
                group.cancel_scope.cancel()

        group.start_soon(cancel_when_stopped)
        group.start_soon(work)
    if failures:
        if isinstance(failures[0], TRANSIENT):
            # The API server restarting, the network: weather, not a bug. One line, then Kopf
            # restarts the daemon after the delay and the flow continues from its phase.
            delay = min(30.0, 2.0 ** min(retry + 1, 5))
            error = failures[0]
            raise kopf.TemporaryError(
                f"checkpoint {name}: {type(error).__name__}: {error}; retrying in {delay:.0f}s",
                delay=delay,
            )
        raise failures[0]
    if _aborts() or not phases:
        return  # deleted, or handed over (the daemon was cancelled before the flow ended)
    phase = phases[0]
    logger.info("checkpoint %s ended %s", name, phase)
    ended = await metrics.checkpoint_ended(kube, namespace or "default", name)
    if ended is not None and ended.status.phase is CheckpointPhase.READY:
        kopf.event(
            body, type="Normal", reason="Completed", message=metrics.completion_message(ended)
        )
    rollout_set = body.get("spec", {}).get("rolloutSet")
    if isinstance(rollout_set, str):
        wake(memo, namespace, rollout_set)
        await _until_stopped(kube, stopped, namespace or "default", name, rollout_set)


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
