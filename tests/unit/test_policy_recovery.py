"""Where the policy meets the set's own loop: an evicted pod is not lost while its checkpoint
runs, and a set suspended by its deadline is neither lost nor degraded."""

from __future__ import annotations

from datetime import UTC, datetime

from rollout_operator import api
from rollout_operator.recovery import Reason as RecoveryReason
from rollout_operator.recovery import detect_loss
from rollout_operator.setplan import PodView, Reason, plan_attempt, set_conditions
from rollout_servers.protocol import Role

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def rollout_set(*, suspended: bool = False) -> api.RolloutSet:
    container = {"name": "c", "ports": [{"name": "control", "containerPort": 9000}]}
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
    return api.RolloutSet.model_validate(
        {
            "metadata": {"name": "rl", "namespace": "ns", "uid": "u", "generation": 2},
            "spec": {
                "participants": [
                    {"role": "model", "template": {"spec": {"containers": [container]}}}
                ],
                "storage": {"path": "/ckpt", "volume": {"emptyDir": {}}},
            },
            "status": {"attempt": 2, "createdAttempt": 2, "conditions": conditions},
        }
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
    assert loss.reason == RecoveryReason.POD_DELETED
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
