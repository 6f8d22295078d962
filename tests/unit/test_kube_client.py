"""`Kube`, the operator's client, over the unit tests' fake API server (`FakeCluster`).

These pin what both sides promise: the client's reads come from the watches once attached
(no request), fall back to the API server before, and a refused write says why; the fake keeps
the API server's rules the flows rely on (resourceVersion preconditions, the status
subresource, merge-patch nulls, field selectors). The real API server's answers to the same
calls are in tests/e2e (test_crds.py, test_leases and the flows' e2e tests).
"""

from __future__ import annotations

from typing import Any

import pytest
from rollout_operator.cluster.kube import ApiError, Conflict
from testsupport import builders
from testsupport.fakecluster import FakeCluster

pytestmark = pytest.mark.unit


def checkpoint(name: str, set_name: str) -> dict[str, Any]:
    return builders.checkpoint_body(name, set_name=set_name, trigger=None)


def rollout_set(name: str = "s", **status: Any) -> dict[str, Any]:
    return {"kind": "RolloutSet", "metadata": {"name": name, "namespace": "ns"}, "status": status}


def names(items: list[dict[str, Any]]) -> list[str]:
    return [c["metadata"]["name"] for c in items]


def seeded(**options: Any) -> FakeCluster:
    cluster = FakeCluster(**options)
    for name, set_name in (("a-1", "set-a"), ("b-1", "set-b"), ("a-2", "set-a")):
        cluster.put(checkpoint(name, set_name))
    return cluster


async def test_the_api_server_filters_checkpoints_by_set() -> None:
    cluster = seeded()
    kube = cluster.kube(watching=False)
    assert names(await kube.list_checkpoints("ns", "set-a")) == ["a-1", "a-2"]
    assert names(await kube.list_checkpoints("ns", "set-b")) == ["b-1"]
    asked = [r.query.get("fieldSelector") for r in cluster.requests]
    assert asked == ["spec.rolloutSet=set-a", "spec.rolloutSet=set-b"]


async def test_an_api_server_that_refuses_the_selector_is_asked_for_everything_from_then_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = seeded(field_selectors=False)
    kube = cluster.kube(watching=False)
    with caplog.at_level("INFO", logger="rollout_operator.cluster.kube"):
        assert names(await kube.list_checkpoints("ns", "set-a")) == ["a-1", "a-2"]
        assert names(await kube.list_checkpoints("ns", "set-b")) == ["b-1"]
    asked = [r.query.get("fieldSelector") for r in cluster.requests]
    assert asked == ["spec.rolloutSet=set-a", None, None], "refused once, then not asked"
    assert not kube.field_selectors
    said = [r.getMessage() for r in caplog.records if "does not filter" in r.getMessage()]
    assert len(said) == 1, said
    assert "field label not supported" in said[0]


async def test_reads_come_from_the_watches_once_attached() -> None:
    cluster = seeded()
    cluster.put(rollout_set())
    kube = cluster.kube()
    assert names(await kube.list_checkpoints("ns", "set-a")) == ["a-1", "a-2"]
    assert (await kube.get_set("ns", "s") or {})["metadata"]["name"] == "s"
    assert await kube.get_checkpoint("ns", "missing") is None
    assert cluster.requests == [], "no request for a read the index answers"
    assert (await kube.get_set("ns", "s", fresh=True) or {})["metadata"]["name"] == "s"
    assert [r.verb for r in cluster.requests] == ["get"]


async def test_a_status_write_with_a_stale_resource_version_is_a_conflict() -> None:
    cluster = FakeCluster()
    stored = cluster.put(rollout_set(attempt=1))
    kube = cluster.kube()
    version = stored["metadata"]["resourceVersion"]
    written = await kube.patch_set_status("ns", "s", {"attempt": 2}, resource_version=version)
    assert written["status"] == {"attempt": 2}
    with pytest.raises(Conflict, match="modified"):
        await kube.patch_set_status("ns", "s", {"attempt": 3}, resource_version=version)
    assert (await kube.get_set("ns", "s") or {})["status"] == {"attempt": 2}


async def test_a_merge_patch_null_removes_a_field_and_status_is_a_subresource() -> None:
    cluster = FakeCluster()
    cluster.put(rollout_set(attempt=1, recovery={"phase": "Stopping"}))
    kube = cluster.kube()
    await kube.patch_set_status("ns", "s", {"recovery": None}, resource_version=None)
    assert cluster.get("rolloutsets", "ns", "s")["status"] == {"attempt": 1}  # type: ignore[index]
    await kube.annotate_set("ns", "s", "k", "v")
    stored = cluster.get("rolloutsets", "ns", "s") or {}
    assert stored["metadata"]["annotations"] == {"k": "v"}
    assert stored["status"] == {"attempt": 1}, "a write of the object leaves its status alone"


async def test_creates_and_deletes_say_whether_they_did_anything() -> None:
    cluster = FakeCluster()
    kube = cluster.kube()
    manifest = checkpoint("c", "s")
    assert await kube.create_checkpoint("ns", manifest) is True
    assert await kube.create_checkpoint("ns", manifest) is False, "409: it exists"
    assert names(await kube.list_checkpoints("ns", "s")) == ["c"], "the watch saw it"
    assert await kube.delete_checkpoint("ns", "c") is True
    assert await kube.delete_checkpoint("ns", "c") is False, "404: gone already"
    assert await kube.list_checkpoints("ns", "s") == []


async def test_a_refused_request_carries_the_api_servers_message() -> None:
    cluster = FakeCluster()
    cluster.refuse("create", "pods", status=422, message='Pod "p" is invalid: spec.containers')
    kube = cluster.kube()
    with pytest.raises(ApiError) as refused:
        await kube.create_pod("ns", {"metadata": {"name": "p"}})
    assert refused.value.status == 422
    assert refused.value.message == 'Pod "p" is invalid: spec.containers'
    assert await kube.create_pod("ns", {"metadata": {"name": "p"}}) is True, "refused once"
