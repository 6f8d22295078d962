"""The recovery's driver (docs/design.md#62-recovery): `RecoveryFlow`, its phase table, and one
look at a set from its reconcile loop (`recover_if_needed`).

`PHASES` maps each persisted phase of `status.recovery` to its step, run by the runner the
checkpoint flow shares (`flows/phases.py`), each phase in a span of the recovery's trace:

    StoppingAttempt (stopping) -> StartingPods (pods) -> Restoring -> Resuming (restore)
    a failed try: BackingOff (backoff) -> StoppingAttempt (target + 1) ...

A step that raises `RecoveryFailed` ends its try (`backoff.on_failed_try`). The table stops
when no recovery is left, or when the tries are exhausted (Degraded until a person acts).

Every step runs over a `context.RecoveryPass`: the draft of the pass of the set's loop it runs
in. It adds its changes there and writes nothing; the pass sends them in its one write
(`flows/stagedpass.py`), and the transitions' Events follow it (`RecoveryLook.transitions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Final

from rollout_protocol import Coordinator, HttpParticipantClient, tracing

from ...cluster.kube import Kube
from ...cluster.objects import eviction_holds
from ...cluster.statuswriter import PassStatus
from ...decide.policy.suspend import resume_due
from ...model.api import RecoveryPhase, RolloutSet, format_time, namespace_or_default
from ...model.reasons import Reason
from ..phases import FailureHandler, PhaseTable, run_step
from .backoff import back_off, on_failed_try
from .context import (
    DEFAULT_WAITS,
    RecoveryContext,
    RecoveryFailed,
    RecoveryPass,
    RecoveryWaits,
    Transition,
    http_coordinator,
    logger,
    recovery_of,
)
from .loss import Loss, detect_loss, observe
from .pods import start_pods
from .restore import restore, resume
from .start import churn, start
from .stopping import stop_attempt


def phase_of(context: RecoveryContext, run: RecoveryPass | RolloutSet) -> RecoveryPhase | None:
    """The recovery's phase, as persisted (and as the pass's step left it); None when no
    recovery is left, or when its tries are exhausted (Degraded until a person acts:
    `backoff.try_failed`)."""
    rset = run.rset if isinstance(run, RecoveryPass) else run
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
    context: RecoveryContext, run: RecoveryPass, phase: RecoveryPhase
) -> AbstractContextManager[object]:
    """Each phase in one span of the recovery's trace, under its root (sent when it ends). A
    phase whose step waits over several passes (StartingPods, BackingOff) is one span too: a
    pass that only waits sends none, and the pass that leaves the phase sends one from the
    phase's start (its persisted start is whole seconds: never before the second after it,
    so the spans stay in the phases' order)."""
    recovery = recovery_of(run.rset)
    entered = (recovery.phase_started_at or recovery.started_at).timestamp()
    start = min(time.time(), entered + 1.0)
    return tracing.span_if(
        phase.value,
        sent=lambda: run.retry_at is None,
        attributes={"rollout.target_attempt": recovery.target_attempt},
        context=tracing.keyed_parent(trace_key(run.rset)),
        start_time_ns=int(start * 1e9),
    )


PHASES: Final = PhaseTable[RecoveryPhase, RecoveryContext, RecoveryPass](
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
        waits: RecoveryWaits = DEFAULT_WAITS,
    ) -> None:
        self._kube = kube
        self._context = RecoveryContext(
            kube=kube,
            clock=clock,
            waits=waits,
            coordinator=self._coordinator,
        )

    async def _coordinator(
        self, rset: RolloutSet
    ) -> tuple[Coordinator, list[HttpParticipantClient]]:
        """The coordinator over the set's participants (over HTTP; a test passes its own)."""
        return await http_coordinator(self._kube, rset)

    async def step(self, run: RecoveryPass) -> bool:
        """Run the step of the recovery's persisted phase once over the pass: it adds the
        phase that follows (the pass writes it, and the set's loop passes again at once: the
        recovery advances one phase per pass), or, waiting, nothing but when to look again.
        Whether a step ran (none does for a set without a recovery, or whose tries are
        exhausted). When the recovery ends, its trace's root span is sent, from its start."""
        rset = run.rset
        recovery = rset.status.recovery
        if recovery is None or phase_of(self._context, rset) is None:
            return False
        ended = await run_step(PHASES, self._context, run)
        if ended is None or phase_of(self._context, ended) is None:
            namespace = namespace_or_default(rset.metadata.namespace)
            name = rset.metadata.name
            run.after_write.append(
                TraceRoot(
                    name=f"recovery {namespace}/{name}",
                    key=trace_key(rset),
                    start_time_ns=int(recovery.started_at.timestamp() * 1e9),
                    attributes={
                        "rollout.set": name,
                        "rollout.namespace": namespace,
                        "rollout.from_attempt": recovery.from_attempt,
                        "rollout.reason": recovery.reason or "",
                        "rollout.attempt": run.rset.status.attempt or 0 if ended else 0,
                    },
                ).send
            )
        return True


@dataclass(frozen=True)
class TraceRoot:
    """The root span of an ended recovery's trace, keyed by the recovery: the phases' spans of
    every pass joined it already (`phase_span`). Sent after the pass's write that ends the
    recovery, so a write that lost a race (the step runs again) sends none."""

    name: str
    key: str
    start_time_ns: int
    attributes: Mapping[str, str | int]

    def send(self) -> None:
        with tracing.root_span(
            self.name,
            key=self.key,
            keyed_span=True,
            start_time_ns=self.start_time_ns,
            attributes=dict(self.attributes),
        ):
            pass


async def start_resume(kube: Kube, run: RecoveryPass, live_pods: int) -> bool:
    """Start the recovery of a resume when one is due (`policy.suspend.resume_due`: the policy
    cleared Suspended and none of the set's pods runs); whether it started (added to the
    pass)."""
    rset = run.rset
    if not resume_due(rset, live_pods):
        return False
    # Read again before a new attempt's pods are created: a suspend written meanwhile wins.
    namespace, name = namespace_or_default(rset.metadata.namespace), rset.metadata.name
    raw = await kube.get_set(namespace, name, fresh=True)
    if raw is None:
        return False
    run.draft.rebase(raw)
    rset = run.rset
    if not resume_due(rset, live_pods):
        return False
    attempt = rset.status.attempt or 1
    message = (
        f"resumed after suspend: attempt {attempt + 1} restores the latest Ready checkpoint "
        "into fresh pods"
    )
    logger.info("set %s: %s", name, message)
    start(run, Loss(Reason.RESUMED, message))
    return True


@dataclass(frozen=True)
class RecoveryLook:
    """What one look at a set did: ran a recovery, or asks to look again at `retry_at`; the
    transitions whose Events follow the pass's write."""

    ran: bool
    """The recovery started, or ran a step (its changes in the pass's draft: the set pass does
    not plan in this pass; the loop passes again at once when the step advanced, else at
    `retry_at` or the set's next event)."""
    retry_at: datetime | None = None
    transitions: tuple[Transition, ...] = ()
    after_write: tuple[Callable[[], None], ...] = ()
    """What may only follow the pass's write, after the transitions' Events (an ended
    recovery's trace root)."""


async def recover_if_needed(
    kube: Kube,
    draft: PassStatus,
    *,
    waits: RecoveryWaits = DEFAULT_WAITS,
) -> RecoveryLook:
    """One look at the set: run one phase of its recovery, or start one when a participant was
    lost (unless the set lost participants too often: see `churn`), adding its first phase
    for the next pass to run; either way to the pass's `draft`, which the pass writes once.

    `draft` holds the set as the pass read it. Says whether a recovery ran, when to look
    again when one has to wait, and the transitions to post after the pass's write.
    """
    run = RecoveryPass(draft)
    ran = await look(kube, run, RecoveryFlow(kube, waits=waits))
    return RecoveryLook(
        ran=ran,
        retry_at=run.retry_at,
        transitions=tuple(run.transitions),
        after_write=tuple(run.after_write),
    )


async def look(kube: Kube, run: RecoveryPass, flow: RecoveryFlow) -> bool:
    """`recover_if_needed` over the pass `run`: whether a recovery ran (`RecoveryLook.ran`)."""
    rset = run.rset
    if rset.status.recovery is not None:
        return await flow.step(run)
    namespace, name = namespace_or_default(rset.metadata.namespace), rset.metadata.name
    pods, nodes_of, lost_nodes = await observe(kube, rset)
    live = sum(1 for p in pods if not (p.terminating or p.finished))
    if await start_resume(kube, run, live):
        return True
    terminating = any(p.terminating for p in pods)
    held = await eviction_holds(kube, rset) if terminating else frozenset()
    if detect_loss(rset, pods, nodes_of, lost_nodes, held) is None:
        return False
    # Read the set again after the pods: whoever deletes pods on purpose marks the set
    # first (a suspend writes Suspended=True, then deletes), so a deletion seen above is
    # always explained by this read, never taken for a loss from a stale one (so it
    # must not come from the pass snapshot, which may hold the read from before the pods).
    # The pass goes on from this read (its write carries its resourceVersion).
    raw = await kube.get_set(namespace, name, fresh=True)
    if raw is None:
        return False
    run.draft.rebase(raw)
    rset = run.rset
    if rset.status.recovery is not None:
        return await flow.step(run)
    loss = detect_loss(rset, pods, nodes_of, lost_nodes, held)
    if loss is None:
        return False
    decision = churn(run, loss)
    if decision.stop is not None:
        return False
    if decision.not_before is not None:
        run.look_again_at(decision.not_before)
        return False
    logger.warning("set %s lost a participant: %s", name, loss.message)
    start(run, loss)
    return True  # its first phase added: the next pass runs it
