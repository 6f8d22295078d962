"""`cache.ClusterCache`: reads from Kopf's indexes, with this process's own writes on top.

The indexes are plain dicts of key -> list of `Seen` here (a `kopf.Index` is a read-only mapping
of key -> store of values); the clock is injected.
"""

from __future__ import annotations

from typing import Any

import anyio
from rollout_operator.cluster.cache import (
    CHECKPOINTS,
    CREATED_POD_SECONDS,
    INDEXES,
    NODES,
    PODS,
    SETS,
    ClusterCache,
    Seen,
    checkpoint_key,
    checkpoints_of_set_key,
    pods_key,
    set_key,
)
from rollout_operator.model.api import LABEL_ATTEMPT, LABEL_SET

NS = "team"


def obj(name: str, version: int, uid: str = "u", **fields: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS, "uid": uid, "resourceVersion": str(version)},
        **fields,
    }


def pod(name: str, version: int, attempt: int) -> dict[str, Any]:
    found = obj(name, version, uid=name)
    found["metadata"]["labels"] = {LABEL_SET: "math", LABEL_ATTEMPT: str(attempt)}
    return found


class Indexes:
    def __init__(self) -> None:
        self.by_name: dict[str, dict[Any, list[Seen]]] = {name: {} for name in INDEXES}

    def put(self, index: str, key: Any, *objects: dict[str, Any]) -> None:
        self.by_name[index][key] = [Seen.of(o) for o in objects]

    def cache(self, clock: list[float]) -> ClusterCache:
        cache = ClusterCache(clock=lambda: clock[0])
        assert not cache.ready
        cache.attach(self.by_name)
        assert cache.ready
        return cache


def test_reads_come_from_the_indexes() -> None:
    indexes = Indexes()
    indexes.put(SETS, set_key(NS, "math"), obj("math", 5, status={"attempt": 2}))
    checkpoint = obj("c1", 6, spec={"rolloutSet": "math"})
    indexes.put(CHECKPOINTS, checkpoint_key(NS, "c1"), checkpoint)
    indexes.put(CHECKPOINTS, checkpoints_of_set_key(NS, "math"), checkpoint)
    indexes.put(PODS, pods_key(NS, "math"), pod("p-a1", 7, 1), pod("p-a2", 8, 2))
    indexes.put(NODES, "node-1", {"metadata": {"name": "node-1"}})
    cache = indexes.cache([0.0])
    found = cache.get_set(NS, "math")
    assert found is not None
    assert found["status"] == {"attempt": 2}
    assert cache.get_set(NS, "other") is None
    assert [c["metadata"]["name"] for c in cache.list_checkpoints(NS, "math")] == ["c1"]
    assert cache.get_checkpoint(NS, "c1") == checkpoint
    attempt_2 = cache.list_pods(NS, "math", {LABEL_SET: "math", LABEL_ATTEMPT: "2"})
    assert [p["metadata"]["name"] for p in attempt_2] == ["p-a2"]
    assert cache.get_node("node-1") == {"metadata": {"name": "node-1"}}
    assert cache.get_node("gone") is None
    # every read parses anew: what a caller changes is its own copy
    found["status"]["attempt"] = 9
    assert cache.get_set(NS, "math") == obj("math", 5, status={"attempt": 2})
    # pods are parsed once per version and shared (the operator only reads them)
    again = cache.list_pods(NS, "math", {LABEL_SET: "math", LABEL_ATTEMPT: "2"})
    assert again[0] is attempt_2[0]


def test_a_write_is_read_back_until_the_watch_delivers_it() -> None:
    indexes = Indexes()
    indexes.put(SETS, set_key(NS, "math"), obj("math", 5, status={"attempt": 1}))
    cache = indexes.cache([0.0])
    cache.saw(SETS, obj("math", 6, status={"attempt": 2}), set_name="math")
    assert cache.get_set(NS, "math") == obj("math", 6, status={"attempt": 2})
    # the watch delivers that version, then a newer one written by someone else
    indexes.put(SETS, set_key(NS, "math"), obj("math", 7, status={"attempt": 3}))
    assert cache.get_set(NS, "math") == obj("math", 7, status={"attempt": 3})


def test_an_older_write_never_hides_a_newer_watch_event() -> None:
    indexes = Indexes()
    indexes.put(SETS, set_key(NS, "math"), obj("math", 9, status={"attempt": 4}))
    cache = indexes.cache([0.0])
    cache.saw(SETS, obj("math", 8, status={"attempt": 3}))
    assert cache.get_set(NS, "math") == obj("math", 9, status={"attempt": 4})


def test_a_deleted_object_is_not_brought_back_by_a_remembered_write() -> None:
    indexes = Indexes()
    indexes.put(SETS, set_key(NS, "math"), obj("math", 5))
    cache = indexes.cache([0.0])
    cache.saw(SETS, obj("math", 6))
    del indexes.by_name[SETS][set_key(NS, "math")]
    assert cache.get_set(NS, "math") is None
    # nor is an object of the same name created anew (another uid)
    indexes.put(SETS, set_key(NS, "math"), obj("math", 3, uid="new"))
    assert cache.get_set(NS, "math") == obj("math", 3, uid="new")


def test_a_created_pod_is_shown_before_its_first_watch_event_for_a_while() -> None:
    indexes = Indexes()
    indexes.put(PODS, pods_key(NS, "math"), pod("p-0", 5, 1))
    clock = [100.0]
    cache = indexes.cache(clock)
    cache.saw(PODS, pod("p-1", 6, 1), set_name="math")
    names = [p["metadata"]["name"] for p in cache.list_pods(NS, "math", {LABEL_SET: "math"})]
    assert names == ["p-0", "p-1"]
    clock[0] += CREATED_POD_SECONDS + 1
    names = [p["metadata"]["name"] for p in cache.list_pods(NS, "math", {LABEL_SET: "math"})]
    assert names == ["p-0"], "never reported by the watch: gone"


async def test_a_change_of_the_set_ends_a_wait_for_it() -> None:
    cache = Indexes().cache([0.0])
    async with anyio.create_task_group() as group:
        ended = anyio.Event()

        async def wait() -> None:
            await cache.wait_for_change(NS, "math", 30)
            ended.set()

        group.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        cache.changed(NS, "other")
        await anyio.wait_all_tasks_blocked()
        assert not ended.is_set()
        cache.changed(NS, "math")
        with anyio.fail_after(5):
            await ended.wait()


def test_managed_fields_are_not_kept() -> None:
    """The API server's field bookkeeping is never read by the operator and is most of a pod."""
    indexes = Indexes()
    found = pod("p-0", 5, 1)
    found["metadata"]["managedFields"] = [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}]
    indexes.put(PODS, pods_key(NS, "math"), found)
    (shown,) = indexes.cache([0.0]).list_pods(NS, "math", {LABEL_SET: "math"})
    assert "managedFields" not in shown["metadata"]
    assert shown["metadata"]["labels"] == found["metadata"]["labels"]
