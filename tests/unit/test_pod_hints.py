"""The latest-checkpoint pod hints (`setpass.mark_covered_pods`) are opt-in.

A set without `checkpointPolicy.podHints` gets no `patch pods` after a Ready checkpoint (each
patch is a pod event for every watcher, the operator's own included); a set with it gets one
patch per covered pod, only on pods created before the checkpoint started and not on standbys
(docs/operations.md, "Which pod to preempt"). The API server is `FakeCluster`, below the real
`Kube`.
"""

from __future__ import annotations

from typing import Any

import pytest
from rollout_operator.flows.setpass import mark_covered_pods
from rollout_operator.model import api
from testsupport.builders import checkpoint_body, rollout_set, set_body
from testsupport.fakecluster import FakeCluster

NS = "ns"
STARTED = "2026-12-01T10:00:00Z"
COMPLETED = "2026-12-01T10:00:02Z"


def pod(name: str, created: str, *, standby: bool = False) -> dict[str, Any]:
    labels = {api.LABEL_SET: "rl"}
    if standby:
        labels[api.LABEL_STANDBY] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": labels,
            "creationTimestamp": created,
        },
    }


def ready_checkpoint() -> dict[str, Any]:
    status = {"phase": "Ready", "startedAt": STARTED, "completedAt": COMPLETED}
    return checkpoint_body("ck", set_name="rl", namespace=NS, trigger=None, status=status)


@pytest.mark.parametrize("hints", [False, True])
async def test_pods_are_annotated_only_when_the_policy_asks(hints: bool) -> None:
    cluster = FakeCluster()
    cluster.put(set_body(name="rl", namespace=NS))
    cluster.put(pod("old", "2026-12-01T09:00:00Z"))
    cluster.put(pod("new", "2026-12-01T10:00:01Z"))
    cluster.put(pod("spare", "2026-12-01T09:00:00Z", standby=True))
    policy = {"podHints": True} if hints else {}
    rset = rollout_set(name="rl", namespace=NS, checkpointPolicy=policy)

    await mark_covered_pods(cluster.kube(), rset, "ck", [ready_checkpoint()])

    assert cluster.count("patch", "pods") == (1 if hints else 0)
    annotations = (cluster.get("pods", NS, "old") or {})["metadata"].get("annotations") or {}
    if hints:
        assert annotations == {
            api.ANNOTATION_LATEST_CHECKPOINT: "ck",
            api.ANNOTATION_LATEST_CHECKPOINT_TIME: COMPLETED,
        }
    else:
        assert annotations == {}


def test_pod_hints_are_off_by_default() -> None:
    assert rollout_set().spec.checkpoint_policy.pod_hints is False
