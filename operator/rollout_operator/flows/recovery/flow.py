"""The recovery's driver (docs/design.md#62-recovery): `RecoveryFlow`, its phase table, and one
look at a set from its reconcile loop (`recover_if_needed`).

`PHASES` maps each persisted phase of `status.recovery` to its step, run by the runner the
checkpoint flow shares (`flows/phases.py`), each phase in a span of the recovery's trace:

    StoppingAttempt (stopping) -> StartingPods (pods) -> Restoring -> Resuming (restore)
    a failed try: BackingOff (backoff) -> StoppingAttempt (target + 1) ...

A step that raises `RecoveryFailed` ends its try (`backoff.on_failed_try`). The table stops
when no recovery is left, or when the tries are exhausted (Degraded until a person acts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Final

from rollout_protocol import Coordinator, HttpParticipantClient, tracing

from ...cluster.kube import Kube
from ...cluster.objects import eviction_holds
from ...cluster.statuswriter import SetStatusWriter
from ...decide.churn import ChurnDecision
from ...decide.policy.suspend import resume_due
from ...model.api import RecoveryPhase, RolloutSet, format_time, namespace_or_default
from ...model.owners import StatusOwner
from ...model.reasons import Reason
from ..phases import FailureHandler, PhaseTable, run_step
from .backoff import back_off, on_failed_try
from .context import (
    DEFAULT_WAITS,
    OnTransition,
    RecoveryContext,
    RecoveryFailed,
    RecoveryWaits,
    http_coordinator,
    logger,
    read_set,
    recovery_of,
)
from .loss import Loss, detect_loss, observe
from .pods import start_pods
from .restore import restore, resume
from .start import churn, start
from .stopping import stop_attempt


def phase_of(context: RecoveryContext, rset: RolloutSet) -> RecoveryPhase | None:
    """The recovery's persisted phase; None when no recovery is left, or when its tries are
    exhausted (Degraded until a person acts: `backoff.try_failed`)."""
    recovery = rset.status.recovery
    if recovery is None or recovery.tries > rset.spec.recovery.max_restarts:
        return None
    return recovery.phase


def trace_key(rset: RolloutSet) -> str:
    """The key of the recovery's one trace: the set's uid and the recovery's start, so the
    phases of every pass (and of an operator that continues it after a restart) join it."""
    recovery = rset.status.recovery
    assert recovery is not None, "a recovery's trace is keyed by the recovery"
    namespace = namespace_or_default(rset.metadata.namespace)
    return (
        f"recovery/{rset.metadata.uid or namespace + '/' + rset.metadata.name}/"
        f"{format_time(recovery.started_at)}"
    )


def phase_span(
    context: RecoveryContext, rset: RolloutSet, phase: RecoveryPhase
) -> AbstractContextManager[object]:
    """Each phase in a span of the recovery's trace, under its root (sent when it ends)."""
    recovery = recovery_of(rset)
    return tracing.span(
        phase.value,
        attributes={"rollout.target_attempt": recovery.target_attempt},
        context=tracing.keyed_parent(trace_key(rset)),
    )


PHASES: Final = PhaseTable[RecoveryPhase, RecoveryContext, RolloutSet](
    steps=MappingProxyType(
        {
            RecoveryPhase.STOPPING_ATTEMPT: stop_attempt,
            RecoveryPhase.STARTING_PODS: start_pods,
            RecoveryPhase.RESTORING: restore,
            RecoveryPhase.RESUMING: resume,
            RecoveryPhase.BACKING_OFF: back_off,
        }
    ),
    phase_of=phase_of,
    on_failure=FailureHandler(RecoveryFailed, on_failed_try),
    span=phase_span,
)
"""The recovery's phases and the step of each."""


class RecoveryFlow:
    """Drives one set's `status.recovery` to completion (or to Degraded after maxRestarts)."""

    def __init__(
        self,
        kube: Kube,
        *,
        clock: Callable[[], float] = time.time,
        on_transition: OnTransition | None = None,
        waits: RecoveryWaits = DEFAULT_WAITS,
    ) -> None:
        self._kube = kube
        self._context = RecoveryContext(
            kube=kube,
            writer=SetStatusWriter(kube, StatusOwner.RECOVERY),
            clock=clock,
            waits=waits,
            coordinator=self._coordinator,
            on_transition=on_transition,
        )

    async def _coordinator(
        self, rset: RolloutSet
    ) -> tuple[Coordinator, list[HttpParticipantClient]]:
        """The coordinator over the set's participants (over HTTP; a test passes its own)."""
        return await http_coordinator(self._kube, rset)

    async def start(self, rset: RolloutSet, loss: Loss) -> RolloutSet:
        """Record the loss (`start.start`)."""
        return await start(self._context, rset, loss)

    async def churn(self, rset: RolloutSet, loss: Loss) -> tuple[ChurnDecision, RolloutSet]:
        """Whether this loss may start a recovery now (`start.churn`)."""
        return await churn(self._context, rset, loss)

    async def run(self, namespace: str, name: str) -> bool:
        """Read the set and run one step of its recovery (`step`)."""
        rset = await read_set(self._context, namespace, name)
        return rset is not None and await self.step(rset)

    async def step(self, rset: RolloutSet) -> bool:
        """Run the step of the recovery's persisted phase once: it persists the phase that
        follows, and the set's loop passes again at once (the recovery advances one phase per
        pass). Whether a step ran (none does for a set without a recovery, or whose tries are
        exhausted). When the recovery ends, its trace's root span is sent, from its start."""
        recovery = rset.status.recovery
        if recovery is None or phase_of(self._context, rset) is None:
            return False
        ended = await run_step(PHASES, self._context, rset)
        if ended is None or phase_of(self._context, ended) is None:
            namespace = namespace_or_default(rset.metadata.namespace)
            name = rset.metadata.name
            with tracing.root_span(
                f"recovery {namespace}/{name}",
                key=trace_key(rset),
                keyed_span=True,
                start_time_ns=int(recovery.started_at.timestamp() * 1e9),
                attributes={
                    "rollout.set": name,
                    "rollout.namespace": namespace,
                    "rollout.from_attempt": recovery.from_attempt,
                    "rollout.reason": recovery.reason or "",
                    "rollout.attempt": ended.status.attempt or 0 if ended is not None else 0,
                },
            ):
                pass
        return True


async def start_resume(kube: Kube, flow: RecoveryFlow, rset: RolloutSet, live_pods: int) -> bool:
    """Start the recovery of a resume when one is due (`policy.suspend.resume_due`: the policy
    cleared Suspended and none of the set's pods runs); whether it started."""
    if not resume_due(rset, live_pods):
        return False
    # Read again before a new attempt's pods are created: a suspend written meanwhile wins.
    namespace, name = namespace_or_default(rset.metadata.namespace), rset.metadata.name
    raw = await kube.get_set(namespace, name, fresh=True)
    if raw is None:
        return False
    rset = RolloutSet.model_validate(raw)
    if not resume_due(rset, live_pods):
        return False
    attempt = rset.status.attempt or 1
    message = (
        f"resumed after suspend: attempt {attempt + 1} restores the latest Ready checkpoint "
        "into fresh pods"
    )
    logger.info("set %s: %s", name, message)
    await flow.start(rset, Loss(Reason.RESUMED, message))
    return True


@dataclass(frozen=True)
class RecoveryLook:
    """What one look at a set did: ran a recovery, or asks to look again at `retry_at`."""

    ran: bool
    """The recovery started, or ran a step (its phase persisted: the loop passes again at once
    and goes on from it)."""
    retry_at: datetime | None = None


async def recover_if_needed(
    kube: Kube,
    rset: RolloutSet,
    *,
    on_transition: OnTransition | None = None,
    waits: RecoveryWaits = DEFAULT_WAITS,
) -> RecoveryLook:
    """One look at the set: run one phase of its recovery, or start one when a participant was
    lost (unless the set lost participants too often: see `churn`), which persists its first
    phase for the next pass to run.

    `rset` is the set as the pass read it. Says whether a recovery ran, and when to look again
    when one has to wait its turn.
    """
    namespace, name = namespace_or_default(rset.metadata.namespace), rset.metadata.name
    flow = RecoveryFlow(kube, on_transition=on_transition, waits=waits)
    if rset.status.recovery is None:
        pods, nodes_of, lost_nodes = await observe(kube, rset)
        live = sum(1 for p in pods if not (p.terminating or p.finished))
        if await start_resume(kube, flow, rset, live):
            return RecoveryLook(ran=True)
        terminating = any(p.terminating for p in pods)
        held = await eviction_holds(kube, rset) if terminating else frozenset()
        loss = detect_loss(rset, pods, nodes_of, lost_nodes, held)
        if loss is None:
            return RecoveryLook(ran=False)
        # Read the set again after the pods: whoever deletes pods on purpose marks the set
        # first (a suspend writes Suspended=True, then deletes), so a deletion seen above is
        # always explained by this read, never taken for a loss from a stale one (so it
        # must not come from the pass snapshot, which may hold the read from before the pods).
        raw = await kube.get_set(namespace, name, fresh=True)
        if raw is None:
            return RecoveryLook(ran=False)
        rset = RolloutSet.model_validate(raw)
        if rset.status.recovery is None:
            loss = detect_loss(rset, pods, nodes_of, lost_nodes, held)
            if loss is None:
                return RecoveryLook(ran=False)
            decision, rset = await flow.churn(rset, loss)
            if decision.stop is not None:
                return RecoveryLook(ran=False)
            if decision.not_before is not None:
                return RecoveryLook(ran=False, retry_at=decision.not_before)
            logger.warning("set %s lost a participant: %s", name, loss.message)
            await flow.start(rset, loss)
            return RecoveryLook(ran=True)  # its first phase persisted: the next pass runs it
    return RecoveryLook(ran=await flow.step(rset))
