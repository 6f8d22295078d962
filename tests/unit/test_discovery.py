"""RolloutSet discovery for the trainer client: which statuses are servable, and shared reads."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from rollout_servers.client import TopologySnapshot
from rollout_servers.discovery import RolloutSetTopology, TopologyUnavailable, servable_snapshot


def rollout_set(
    attempt: int | None = 1,
    environments: int = 2,
    *,
    pod_attempt: int | None = None,
    ready: bool = True,
    recovery: bool = False,
    listed: int | None = None,
) -> dict[str, Any]:
    pod_attempt = attempt if pod_attempt is None else pod_attempt
    participants = [
        {
            "role": "environment",
            "index": i,
            "pod": f"math-rl-environment-{i}-a{pod_attempt}",
            "ready": ready,
            "address": f"http://127.0.0.{i + 1}:8000",
        }
        for i in range(environments if listed is None else listed)
    ]
    participants.append({"role": "model", "index": 0, "pod": "math-rl-model-0-a1", "ready": False})
    status: dict[str, Any] = {"participants": participants}
    if attempt is not None:
        status["attempt"] = attempt
    if recovery:
        status["recovery"] = {"phase": "StartingPods", "fromAttempt": 1, "targetAttempt": 2}
        status["conditions"] = [{"type": "Recovering", "status": "True"}]
    return {
        "spec": {
            "participants": [
                {"role": "environment", "replicas": environments},
                {"role": "model", "replicas": 1},
            ]
        },
        "status": status,
    }


def test_a_ready_set_is_servable_with_environments_in_index_order() -> None:
    obj = rollout_set(attempt=3, environments=2)
    obj["status"]["participants"].reverse()
    assert servable_snapshot(obj) == TopologySnapshot(
        3, ("http://127.0.0.1:8000", "http://127.0.0.2:8000")
    )


@pytest.mark.parametrize(
    "obj",
    [
        rollout_set(attempt=None),
        rollout_set(recovery=True),
        rollout_set(ready=False),
        rollout_set(listed=1),
        rollout_set(attempt=1, pod_attempt=2),
    ],
    ids=["no-attempt", "recovering", "not-ready", "missing-instance", "next-attempts-pods"],
)
def test_a_set_in_transition_is_not_servable(obj: dict[str, Any]) -> None:
    assert servable_snapshot(obj) is None


def test_a_kept_pod_serves_the_attempt_its_label_names_not_its_name() -> None:
    """InPlace recovery keeps `...-environment-0-a1` under attempt 2: its status says so."""
    obj = rollout_set(attempt=2, environments=1, pod_attempt=1)
    assert servable_snapshot(obj) is None, "named -a1 and no attempt field: not attempt 2"
    obj["status"]["participants"][0]["attempt"] = 2
    assert servable_snapshot(obj) == TopologySnapshot(2, ("http://127.0.0.1:8000",))
    obj["status"]["participants"][0]["attempt"] = 1
    assert servable_snapshot(obj) is None


class FakeCustomObjects:
    """Serves a scripted sequence of RolloutSet objects, one per GET, counting the GETs."""

    def __init__(self, objects: list[dict[str, Any] | Exception]) -> None:
        self.objects = objects
        self.gets = 0

    async def get_namespaced_custom_object(self, *args: str) -> dict[str, Any]:
        item = self.objects[min(self.gets, len(self.objects) - 1)]
        self.gets += 1
        await anyio.lowlevel.checkpoint()
        if isinstance(item, Exception):
            raise item
        return item


async def test_waiters_share_reads_and_follow_the_attempt() -> None:
    api = FakeCustomObjects(
        [
            rollout_set(attempt=1),
            rollout_set(attempt=1, recovery=True),
            ApiException(status=503, reason="Service Unavailable"),
            rollout_set(attempt=2),
        ]
    )
    topology = RolloutSetTopology(api, "math-rl", "default", poll_interval_s=0.01)
    assert (await topology.current()).attempt == 1
    found: list[TopologySnapshot] = []

    async def wait() -> None:
        found.append(await topology.wait_newer(1))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            for _ in range(20):
                group.start_soon(wait)
    assert {snapshot.attempt for snapshot in found} == {2}
    assert len(found) == 20
    assert api.gets == 4  # twenty waiters, one read per look
    assert topology.latest is not None
    assert topology.latest.attempt == 2


async def test_a_missing_set_says_so() -> None:
    api = FakeCustomObjects([ApiException(status=404, reason="Not Found")])
    topology = RolloutSetTopology(api, "nope", "team-a", poll_interval_s=0.01)
    with pytest.raises(TopologyUnavailable, match="team-a/nope: HTTP 404"):
        await topology.current()
