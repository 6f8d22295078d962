"""Where the policy meets the set's own loop: an evicted pod is not lost while its checkpoint
runs, a set suspended by its deadline is neither lost nor degraded, and a resume after suspend
is not counted as a restart."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

import pytest
from rollout_operator.cluster.kube import Kube
from rollout_operator.decide.setplan import PodView, plan_attempt, set_conditions
from rollout_operator.flows.recovery import RecoveryFlow, detect_loss
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_SET_PLURAL
from rollout_operator.model.reasons import Reason
from rollout_protocol import (
    Coordinator,
    HttpParticipantClient,
    Phase,
    ResumeReply,
    ResumeRequest,
    Role,
)
from testsupport import builders
from testsupport.fakecluster import FakeCluster
from testsupport.recovery import flow_pass

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def rollout_set(*, suspended: bool = False) -> api.RolloutSet:
    conditions = []
    if suspended:
        conditions.append(
            {
                "type": "Suspended",
                "status": "True",
                "reason": "DeadlineReached",
                "lastTransitionTime": "2026-11-29T12:00:00Z",
            }
        )
    return builders.rollout_set(
        generation=2,
        roles={"model": None},
        port=9000,
        status={"attempt": 2, "createdAttempt": 2, "conditions": conditions},
    )


def model_pod(*, terminating: bool) -> PodView:
    return PodView(
        name="rl-model-0-a2",
        set_name="rl",
        role=Role.MODEL,
        index=0,
        attempt=2,
        phase="Running",
        ready=not terminating,
        ip="127.0.3.1",
        terminating=terminating,
        spec_hash=None,
        template_hash=None,
        created=T0,
        problem=None,
    )


def test_a_terminating_pod_is_lost_unless_its_eviction_checkpoint_holds_it() -> None:
    pods = [model_pod(terminating=True)]
    loss = detect_loss(rollout_set(), pods, {}, set())
    assert loss is not None
    assert loss.reason == Reason.POD_DELETED
    assert detect_loss(rollout_set(), pods, {}, set(), frozenset({"rl-model-0-a2"})) is None


def test_a_set_suspended_by_its_deadline_has_lost_nothing() -> None:
    assert detect_loss(rollout_set(suspended=True), [], {}, set()) is None


def test_a_set_suspended_by_its_deadline_is_not_degraded() -> None:
    rset = rollout_set(suspended=True)
    health = set_conditions(rset, plan_attempt(rset, 2, []), pods_created=True, now=T0)
    shown = {c.type: (c.status, c.reason, c.message) for c in health.conditions}
    assert shown["Ready"][:2] == ("False", Reason.SUSPENDED)
    assert "suspended after mustSaveBy" in shown["Ready"][2]
    assert shown["Degraded"][:2] == ("False", Reason.AS_EXPECTED)


# --- restarts -----------------------------------------------------------------------------------


class Resumable:
    """The restored model participant: the recovery's last step resumes it."""

    role = Role.MODEL
    instance = "model-0"

    def __init__(self) -> None:
        self.resumed: list[str] = []

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        self.resumed.append(request.checkpoint_id)
        return ResumeReply(checkpoint_id=request.checkpoint_id, phase=Phase.IDLE)

    async def aclose(self) -> None:
        pass


class ResumingFlow(RecoveryFlow):
    """The flow with its participants in process instead of over HTTP."""

    def __init__(self, kube: Kube, participant: Resumable) -> None:
        super().__init__(kube)
        self.participant = participant

    async def _coordinator(
        self, rset: api.RolloutSet
    ) -> tuple[Coordinator, list[HttpParticipantClient]]:
        clients = [cast(HttpParticipantClient, self.participant)]
        return Coordinator(clients), clients


def set_in_last_recovery_step(reason: str) -> dict[str, Any]:
    """Attempt 2 -> 3, checkpoint restored, only the resume left; two restarts so far."""
    obj = rollout_set().model_dump(mode="json", by_alias=True, exclude_none=True)
    obj["status"].update(
        {
            "restarts": 2,
            "recovery": {
                "phase": "Resuming",
                "fromAttempt": 2,
                "targetAttempt": 3,
                "startedAt": "2026-11-29T12:00:00Z",
                "checkpoint": "rl-suspend-a2",
                "reason": reason,
                "message": "why the recovery started",
            },
            "participants": [
                {
                    "role": "model",
                    "index": 0,
                    "pod": "rl-model-0-a3",
                    "ready": True,
                    "address": "http://127.0.3.2:9000",
                }
            ],
        }
    )
    return obj


@pytest.mark.parametrize(
    ("reason", "restarts"),
    [
        (Reason.RESUMED, 2),
        (Reason.POD_DELETED, 3),
        (Reason.POD_FAILED, 3),
        (Reason.NODE_LOST, 3),
    ],
    ids=["resume", "pod-deleted", "pod-failed", "node-lost"],
)
async def test_a_resume_is_not_a_restart_but_a_loss_is(reason: str, restarts: int) -> None:
    cluster = FakeCluster()  # the one set; status patches keep the resourceVersion precondition
    cluster.put(set_in_last_recovery_step(reason))
    participant = Resumable()
    await flow_pass(ResumingFlow(cluster.kube(), participant), cluster, "ns", "rl")

    written = cluster.get(ROLLOUT_SET_PLURAL, "ns", "rl")
    assert written is not None
    status = written["status"]
    assert participant.resumed == ["rl-suspend-a2"]
    assert "recovery" not in status
    assert status["restarts"] == restarts
    # Everything else the recovery records is the same for a resume.
    assert status["attempt"] == 3
    assert status["createdAttempt"] == 3
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Recovering"]["status"] == "False"
    assert conditions["Recovering"]["reason"] == Reason.RESTORED
    assert f"recovered from {reason}" in conditions["Recovering"]["message"]
