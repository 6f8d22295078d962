"""A recovery's context over the unit tests' fake API server (`fakecluster.FakeCluster`), so a
test runs one recovery step (a function of a `RecoveryContext` and the set) on the real `Kube`:
short waits, the set's status written through the recovery's own writer, and, where the step
calls the participants, one participant of canned replies (`scripted.Scripted`)."""

from __future__ import annotations

import time
from typing import cast

from rollout_operator.cluster.statuswriter import SetStatusWriter
from rollout_operator.flows.recovery import RecoveryContext, RecoveryWaits
from rollout_operator.flows.recovery.context import OnTransition
from rollout_operator.model import api
from rollout_operator.model.owners import StatusOwner
from rollout_protocol import Coordinator, HttpParticipantClient

from testsupport.fakecluster import FakeCluster
from testsupport.scripted import Scripted


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

    return RecoveryContext(
        kube=kube,
        writer=SetStatusWriter(kube, StatusOwner.RECOVERY),
        clock=time.time,
        waits=RecoveryWaits(retire_seconds=1.0, restore_floor_seconds=5.0),
        coordinator=coordinator,
        on_transition=events,
    )
