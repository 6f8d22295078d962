"""An Eviction checkpoint's prepare deadline, through the checkpoint flow: what the participants
are given, what the checkpoint's status shows, and the failure when no grace is left.

The flow and the `Kube` client run for real over the unit tests' fake API server
(`testsupport.fakecluster`); the participant is a client that journals each prepare's deadline
and answers "not ready" (one episode not parked), so every run ends quickly in PrepareTimeout
with the deadline the participant saw on record.
"""

from __future__ import annotations

import time
from typing import cast

import pytest
from rollout_operator.cluster.leases import holder_of, lease_name
from rollout_operator.decide.policy.eviction import EVICTION_COMMIT_MARGIN_SECONDS
from rollout_operator.decide.policy.views import parse_time
from rollout_operator.flows.checkpoint import CheckpointFlow
from rollout_operator.model import api
from rollout_operator.model.reasons import Reason
from rollout_protocol import (
    HttpParticipantClient,
)
from testsupport.checkpointflow import (
    CKPT,
    NS,
    PREPARE_TIMEOUT,
    SET,
    NotParking,
    checkpoint_status,
    condition,
    evicted_pod,
    kept_to_its_own,
    mark_ready,
    set_cluster,
    whole_seconds,
)
from testsupport.fakecluster import FakeCluster


async def run_flow(cluster: FakeCluster, participant: NotParking) -> None:
    def participants(rset: api.RolloutSet, token: str) -> list[HttpParticipantClient]:
        return [cast(HttpParticipantClient, participant)]

    flow = CheckpointFlow(cluster.kube(), participants_factory=participants)
    phase = await flow.run(NS, CKPT)
    assert phase is api.CheckpointPhase.FAILED
    kept_to_its_own(cluster)


async def test_the_evicted_pods_grace_period_bounds_the_prepare() -> None:
    killed_at = whole_seconds(time.time() + 30)
    cluster = set_cluster("Eviction", [evicted_pod(killed_at)])
    participant = NotParking()
    await run_flow(cluster, participant)

    expected = killed_at.timestamp() - EVICTION_COMMIT_MARGIN_SECONDS
    assert participant.prepare_deadlines == [pytest.approx(expected)]
    status = checkpoint_status(cluster)
    assert parse_time(status["deadline"]) == whole_seconds(expected)
    failed = condition(cluster, "Failed")
    assert failed["reason"] == Reason.NOT_PARKED
    assert f"pod math-model-0-a3 is killed at {api.format_time(killed_at)}" in failed["message"]
    assert "terminationGracePeriodSeconds" in failed["message"]
    assert participant.resumed == 1  # the abort reopened admission


async def test_a_shorter_prepare_timeout_still_applies_to_an_eviction() -> None:
    cluster = set_cluster("Eviction", [evicted_pod(whole_seconds(time.time() + 3600), grace=3600)])
    participant = NotParking()
    before = time.time()
    await run_flow(cluster, participant)

    (deadline,) = participant.prepare_deadlines
    assert before + PREPARE_TIMEOUT <= deadline <= time.time() + PREPARE_TIMEOUT
    assert "is killed at" not in condition(cluster, "Failed")["message"]


async def test_other_triggers_keep_the_prepare_timeout_while_a_pod_terminates() -> None:
    cluster = set_cluster("Manual", [evicted_pod(whole_seconds(time.time() + 30))])
    mark_ready(cluster)
    participant = NotParking()
    before = time.time()
    await run_flow(cluster, participant)
    (deadline,) = participant.prepare_deadlines
    assert deadline >= before + PREPARE_TIMEOUT


async def test_no_grace_left_fails_the_checkpoint_without_a_prepare() -> None:
    # Killed within the commit margin: nothing could be committed before the kill.
    killed_at = whole_seconds(time.time() + 1)
    cluster = set_cluster("Eviction", [evicted_pod(killed_at, grace=3)])
    participant = NotParking()
    await run_flow(cluster, participant)

    assert participant.prepare_deadlines == []
    failed = condition(cluster, "Failed")
    assert failed["status"] == "True"
    assert failed["reason"] == Reason.GRACE_PERIOD_TOO_SHORT == "GracePeriodTooShort"
    assert "math-model-0-a3" in failed["message"]
    assert "terminationGracePeriodSeconds" in failed["message"]
    lease = cluster.get("leases", NS, lease_name(SET))  # the set's slot was taken...
    assert lease is not None
    assert holder_of(lease) is None  # ...and released
