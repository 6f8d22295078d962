"""An Eviction checkpoint's prepare deadline, through the checkpoint flow: what the participants
are given, what the checkpoint's status shows, and the failure when no grace is left.

The flow and the `Kube` client run for real over the unit tests' fake API server
(`testsupport.fakecluster`); the participant is a client that journals each prepare's deadline
and answers "not ready" (one episode not parked), so every run ends quickly in PrepareTimeout
with the deadline the participant saw on record.
"""

from __future__ import annotations

import base64
import time
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from rollout_operator.cluster.leases import holder_of, lease_name
from rollout_operator.decide.policy import EVICTION_COMMIT_MARGIN_SECONDS, parse_time
from rollout_operator.decide.resources import TOKEN_KEY, secret_name
from rollout_operator.flows.checkpoint import CheckpointFlow, Reason
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL
from rollout_protocol import (
    EpisodeId,
    HttpParticipantClient,
    Phase,
    PrepareReply,
    PrepareRequest,
    ResumeReply,
    ResumeRequest,
    Role,
)
from testsupport.fakecluster import FakeCluster

NS = "team"
SET = "math"
CKPT = "math-evict-a3"
PREPARE_TIMEOUT = 300


def whole_seconds(ts: float) -> datetime:
    return datetime.fromtimestamp(int(ts), UTC)


def set_cluster(trigger: str, pods: list[dict[str, Any]]) -> FakeCluster:
    """An API server holding the set, its pods, its token Secret and one checkpoint."""
    cluster = FakeCluster()
    cluster.put(
        {
            "apiVersion": api.API_VERSION,
            "kind": "RolloutSet",
            "metadata": {"name": SET, "namespace": NS, "uid": "u", "generation": 1},
            "spec": {
                "participants": [
                    {
                        "role": "model",
                        "template": {
                            "spec": {
                                "containers": [
                                    {
                                        "name": "c",
                                        "ports": [{"name": "control", "containerPort": 8000}],
                                    }
                                ]
                            }
                        },
                    }
                ],
                "storage": {"path": "/ckpt", "volume": {"hostPath": {"path": "/ckpt"}}},
                "checkpointPolicy": {"prepareTimeoutSeconds": PREPARE_TIMEOUT},
            },
            "status": {
                "attempt": 3,
                "participants": [
                    {
                        "role": "model",
                        "index": 0,
                        "pod": "math-model-0-a3",
                        "ready": False,
                        "address": "http://10.0.0.1:8000",
                    }
                ],
            },
        }
    )
    cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": secret_name(SET), "namespace": NS},
            "data": {TOKEN_KEY: base64.b64encode(b"token").decode()},
        }
    )
    for pod in pods:
        cluster.put(pod)
    cluster.put(
        {
            "apiVersion": api.API_VERSION,
            "kind": "RolloutCheckpoint",
            "metadata": {"name": CKPT, "namespace": NS, "generation": 1},
            "spec": {"rolloutSet": SET, "trigger": trigger},
            "status": {},
        }
    )
    return cluster


def checkpoint_status(cluster: FakeCluster) -> dict[str, Any]:
    ckpt = cluster.get(ROLLOUT_CHECKPOINT_PLURAL, NS, CKPT)
    assert ckpt is not None, f"checkpoint {CKPT} is gone"
    status: dict[str, Any] = ckpt.get("status") or {}
    return status


def condition(cluster: FakeCluster, type_: str) -> dict[str, Any]:
    conditions = checkpoint_status(cluster)["conditions"]
    found: dict[str, Any] = next(c for c in conditions if c["type"] == type_)
    return found


def mark_ready(cluster: FakeCluster) -> None:
    """The set and its participant Ready, as the reconciler writes them."""

    def ready(obj: dict[str, Any]) -> None:
        obj["status"]["participants"][0]["ready"] = True
        obj["status"]["conditions"] = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllParticipantsReady",
                "lastTransitionTime": api.format_time(datetime.now(UTC)),
            }
        ]

    cluster.update(ROLLOUT_SET_PLURAL, NS, SET, ready)


def kept_to_its_own(cluster: FakeCluster) -> None:
    """The flow read only the set's token Secret and wrote only its own checkpoint's status."""
    assert {r.name for r in cluster.requests if r.plural == "secrets"} <= {secret_name(SET)}
    written = {
        r.name
        for r in cluster.requests
        if r.plural == ROLLOUT_CHECKPOINT_PLURAL and r.verb != "get"
    }
    assert written <= {CKPT}


class NotParking:
    """A model participant with one episode that never parks; journals prepare deadlines."""

    role = Role.MODEL
    instance = "model-0"

    def __init__(self) -> None:
        self.prepare_deadlines: list[float] = []
        self.resumed = 0

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        self.prepare_deadlines.append(request.deadline_ts)
        return PrepareReply(
            checkpoint_id=request.checkpoint_id,
            phase=Phase.PREPARING,
            ready=False,
            blockers=[EpisodeId(rollout_id="r1", attempt=3)],
            blocker_count=1,
        )

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        self.resumed += 1
        return ResumeReply(checkpoint_id=request.checkpoint_id, phase=Phase.IDLE)

    async def aclose(self) -> None:
        pass


def evicted_pod(killed_at: datetime, grace: int = 30) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "math-model-0-a3",
            "namespace": NS,
            "labels": {api.LABEL_SET: SET, api.LABEL_ATTEMPT: "3"},
            "deletionTimestamp": api.format_time(killed_at),
            "deletionGracePeriodSeconds": grace,
        },
        "status": {"phase": "Running"},
    }


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
