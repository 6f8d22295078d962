"""RolloutCheckpoint handlers: one daemon per unfinished checkpoint runs its flow.

A daemon (not an event handler) because the flow is long and must continue after an operator
restart: Kopf starts daemons again for every object that still exists, and
`CheckpointFlow.run` continues from the phase persisted in status, or returns at once for a
checkpoint that is already Ready or Failed.

Kopf stops the daemon when its `when` filter turns false, i.e. when the flow writes the terminal
phase. The flow makes that write its last, and `cancellation_backoff` lets it return by itself
instead of being cancelled mid-way (Kopf would otherwise cancel at once and log a warning for
every checkpoint). An exception (the API server unreachable, say) restarts the daemon after
`backoff` seconds, and the flow continues from the persisted phase.
"""

from __future__ import annotations

from typing import Any

import kopf

from .. import metrics
from ..api import GROUP, ROLLOUT_CHECKPOINT_PLURAL, VERSION, CheckpointPhase, RolloutCheckpoint
from ..checkpointing import TERMINAL, CheckpointFlow
from .rolloutset import wake
from .runtime import kube_of


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
    **_: Any,
) -> None:
    async def event(ckpt: RolloutCheckpoint, reason: str, message: str) -> None:
        kind = "Warning" if ckpt.status.phase is CheckpointPhase.FAILED else "Normal"
        kopf.event(body, type=kind, reason=reason, message=message)

    flow = CheckpointFlow(kube_of(memo), on_transition=event)
    phase = await flow.run(namespace or "default", name)
    logger.info("checkpoint %s ended %s", name, phase)
    ended = await metrics.checkpoint_ended(kube_of(memo), namespace or "default", name)
    if ended is not None and ended.status.phase is CheckpointPhase.READY:
        kopf.event(
            body, type="Normal", reason="Completed", message=metrics.completion_message(ended)
        )
    rollout_set = body.get("spec", {}).get("rolloutSet")
    if isinstance(rollout_set, str):
        wake(namespace, rollout_set)
