"""Builders for planning an attempt's pods without a cluster (`decide.setplan`), for the unit
tests of the set plan and of InPlace recovery: `make_set` (a RolloutSet `rl` of the four roles),
`running` (a planned pod as the API returns it once started), `views` (pods as the plan sees
them) and `start_all` (the plan driven as the reconciler does until every pod runs)."""

from __future__ import annotations

from typing import Any

from rollout_operator.decide.setplan import PodView, plan_attempt
from rollout_operator.model import api

from testsupport import builders


def make_set(
    replicas: dict[str, int] | None = None, deadline: int = 60, suspend: bool = False
) -> api.RolloutSet:
    replicas = replicas or {"model": 1, "resources": 1, "agent": 1, "environment": 2}
    return builders.rollout_set(
        generation=2,
        roles=replicas,
        port=9000,
        progressDeadlineSeconds=deadline,
        suspend=suspend,
    )


def running(manifest: dict[str, Any], ip: str, ready: bool = True) -> dict[str, Any]:
    """A pod as the API returns it after the node started it."""
    pod = dict(manifest)
    pod["metadata"] = {**manifest["metadata"], "creationTimestamp": "2026-11-29T12:00:00Z"}
    pod["status"] = {
        "phase": "Running",
        "podIP": ip,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    return pod


def views(*pods: dict[str, Any]) -> list[PodView]:
    out = [PodView.from_pod(p) for p in pods]
    assert all(v is not None for v in out)
    return [v for v in out if v is not None]


def start_all(rset: api.RolloutSet, attempt: int = 1) -> list[PodView]:
    """Drive the plan as the reconciler does: create what can be created, start it, repeat."""
    pods: list[dict[str, Any]] = []
    for _ in range(4):
        plan = plan_attempt(rset, attempt, views(*pods))
        for manifest in plan.to_create:
            pods.append(running(manifest, f"127.0.1.{len(pods) + 1}"))
    return views(*pods)
