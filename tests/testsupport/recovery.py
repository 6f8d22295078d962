"""A recovery's context over the unit tests' fake API server (`fakecluster.FakeCluster`), so a
test runs one recovery step (a function of a `RecoveryContext` and a `RecoveryPass`) on the real
`Kube`: short waits, and, where the step calls the participants, one participant of canned
replies (`scripted.Scripted`). A step writes nothing itself (docs/design.md#60-layers, "One pass,
one snapshot, one write"): `written` runs it as a pass of the set's loop would, over one read of
the set, then sends what it added in one write and posts its transitions after it."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from rollout_operator.cluster.kube import Kube
from rollout_operator.cluster.statuswriter import PassStatus, SetStatusWriter
from rollout_operator.flows.phases import run_step
from rollout_operator.flows.recovery import (
    PHASES,
    RecoveryContext,
    RecoveryFlow,
    RecoveryWaits,
    start_resume,
)
from rollout_operator.flows.recovery.context import RecoveryPass
from rollout_operator.flows.recovery.flow import phase_of
from rollout_operator.model import api
from rollout_operator.model.owners import StatusOwner
from rollout_protocol import Coordinator, HttpParticipantClient

from testsupport import builders
from testsupport.fakecluster import FakeCluster
from testsupport.scripted import Scripted

PassStep = Callable[[RecoveryContext, RecoveryPass], Awaitable[RecoveryPass | None]]
OnTransition = Callable[[api.RolloutSet, str, str, bool], Awaitable[None]]
"""Told of each transition's Event (the set, its reason, its message, whether a warning)."""


@dataclass(frozen=True)
class EventsContext(RecoveryContext):
    """A recovery's context with where `written` posts the transitions' Events (the operator's
    set loop posts them itself, after its pass's write)."""

    events: OnTransition | None = None


def context_over(
    cluster: FakeCluster, participant: Scripted | None = None, events: OnTransition | None = None
) -> RecoveryContext:
    kube = cluster.kube()

    async def coordinator(
        rset: api.RolloutSet,
    ) -> tuple[Coordinator, list[HttpParticipantClient]]:
        assert participant is not None, "this step calls no participant"
        clients = [cast(HttpParticipantClient, participant)]
        return Coordinator(clients), clients

    return EventsContext(
        kube=kube,
        clock=time.time,
        waits=RecoveryWaits(retire_seconds=1.0, restore_floor_seconds=5.0),
        coordinator=coordinator,
        events=events,
    )


async def _pass_over(kube: Kube, rset: api.RolloutSet) -> RecoveryPass:
    raw = await kube.get_set(api.namespace_or_default(rset.metadata.namespace), rset.metadata.name)
    assert raw is not None, "the set is stored"
    return RecoveryPass(PassStatus(raw))


async def _write(
    kube: Kube, run: RecoveryPass, events: OnTransition | None = None
) -> api.RolloutSet:
    stored = await SetStatusWriter(kube, StatusOwner.RECOVERY).write_pass(run.draft)
    written = run.rset if stored is None else api.RolloutSet.model_validate(stored)
    for then in run.after_write:
        then()
    if events is not None:
        for reason, message, warn in run.transitions:
            await events(written, reason, message, warn)
    return written


async def written(
    step: PassStep, context: RecoveryContext, rset: api.RolloutSet
) -> api.RolloutSet | None:
    """Run `step` over one pass of the stored set `rset`, write what it added, post its
    transitions; the set as written, or None when the step ended the recovery's run."""
    run = await _pass_over(context.kube, rset)
    ended = await step(context, run)
    events = context.events if isinstance(context, EventsContext) else None
    shown = await _write(context.kube, run, events)
    return None if ended is None else shown


async def passes_to_end(context: RecoveryContext, rset: api.RolloutSet) -> api.RolloutSet | None:
    """One phase per pass (each written), until no phase is left; the set as the last pass
    wrote it, or None when a step ended the run."""
    current: api.RolloutSet | None = rset
    while current is not None and phase_of(context, current) is not None:
        current = await written(lambda c, run: run_step(PHASES, c, run), context, current)
    return current


async def flow_pass(flow: RecoveryFlow, cluster: FakeCluster, namespace: str, name: str) -> bool:
    """One step of the set's recovery by `flow`, over one read of the set, written."""
    raw = await cluster.kube().get_set(namespace, name)
    assert raw is not None, "the set is stored"
    run = RecoveryPass(PassStatus(raw))
    ran = await flow.step(run)
    await _write(cluster.kube(), run)
    return ran


async def start_resume_written(kube: Kube, rset: api.RolloutSet, live_pods: int) -> bool:
    """`recovery.start_resume` over one pass of the stored set, written."""
    run = await _pass_over(kube, rset)
    started = await start_resume(kube, run, live_pods)
    await _write(kube, run)
    return started


RECOVERING_NS, RECOVERING_SET = "ns", "rl"
"""Where `recovering_model_set` puts its set."""


def recovering_model_set(
    phase: str, *, recovery_spec: dict[str, Any], **recovery: Any
) -> FakeCluster:
    """An API server holding the set `rl` of one model recovering from attempt 2 to 3 in
    `phase` (its pod lost), with `spec.recovery` and the recovery's further fields given."""
    cluster = FakeCluster()
    cluster.put(
        builders.set_body(
            generation=2,
            port=9000,
            recovery=recovery_spec,
            status={
                "attempt": 2,
                "createdAttempt": 2,
                "recovery": {
                    "phase": phase,
                    "fromAttempt": 2,
                    "targetAttempt": 3,
                    "startedAt": "2026-11-29T12:00:00Z",
                    "reason": "PodDeleted",
                    "message": "participant model-0 of attempt 2: its pod is gone",
                    **recovery,
                },
            },
        )
    )
    return cluster


def stored_set_status(cluster: FakeCluster) -> dict[str, Any]:
    """The status of `recovering_model_set`'s set as the API server holds it."""
    found = cluster.get(api.ROLLOUT_SET_PLURAL, RECOVERING_NS, RECOVERING_SET)
    assert found is not None
    status: dict[str, Any] = found["status"]
    return status
