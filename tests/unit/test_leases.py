"""The per-set checkpoint Lease (`leases.CheckpointLeases`): one checkpoint at a time per set.

The API below the real `Kube` is `testsupport.fakecluster.FakeCluster`, whose Lease patch keeps
the API server's resourceVersion precondition; its `requests` show the Lease requests each step
makes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from rollout_operator.cluster.leases import CheckpointLeases, holder_of, lapsed, lease_name
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL
from testsupport import builders
from testsupport.fakecluster import FakeCluster

NS = "team"
SET = "math"


def _set() -> dict[str, Any]:
    return builders.set_body(
        name=SET,
        namespace=NS,
        uid="set-uid",
        generation=1,
        roles={"model": None},
        port=9000,
        status={"attempt": 1},
    )


def _checkpoint(name: str, phase: str | None) -> dict[str, Any]:
    return builders.checkpoint_body(
        name,
        set_name=SET,
        namespace=NS,
        created="2026-12-01T00:00:00Z",
        status={} if phase is None else {"phase": phase},
    )


@pytest.fixture
def cluster() -> FakeCluster:
    cluster = FakeCluster()
    for obj in (_set(), _checkpoint("a", None), _checkpoint("b", None)):
        cluster.put(obj)
    return cluster


def rset(cluster: FakeCluster) -> api.RolloutSet:
    return api.RolloutSet.model_validate(cluster.get(ROLLOUT_SET_PLURAL, NS, SET))


def the_lease(cluster: FakeCluster) -> dict[str, Any]:
    lease = cluster.get("leases", NS, lease_name(SET))
    assert lease is not None, "no Lease"
    return lease


def lease_calls(cluster: FakeCluster) -> list[str]:
    """The Lease requests made, by verb (get, create, patch)."""
    return [r.verb for r in cluster.requests if r.plural == "leases"]


def change_checkpoint(
    cluster: FakeCluster, name: str, change: Callable[[dict[str, Any]], Any]
) -> None:
    """A write of the checkpoint by someone else (its own flow, a user)."""
    cluster.update(ROLLOUT_CHECKPOINT_PLURAL, NS, name, change)


def phase(value: str) -> Callable[[dict[str, Any]], Any]:
    return lambda ckpt: ckpt["status"].update(phase=value)


async def test_the_first_take_creates_the_lease_owned_by_the_set(cluster: FakeCluster) -> None:
    leases = CheckpointLeases(cluster.kube())
    assert await leases.take(rset(cluster), "a", 600) is None
    lease = the_lease(cluster)
    assert holder_of(lease) == "a"
    assert lease["spec"]["leaseDurationSeconds"] == 600
    assert not lapsed(lease, time.time())
    (owner,) = lease["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("RolloutSet", SET, "set-uid")
    assert lease_calls(cluster) == ["get", "create"]


async def test_release_and_the_next_take_are_one_request_each(cluster: FakeCluster) -> None:
    leases = CheckpointLeases(cluster.kube())
    await leases.take(rset(cluster), "a", 600)
    cluster.requests.clear()
    await leases.release(NS, SET, "a")
    assert holder_of(the_lease(cluster)) is None
    assert await leases.take(rset(cluster), "b", 600) is None
    assert holder_of(the_lease(cluster)) == "b"
    assert lease_calls(cluster) == ["patch", "patch"]
    assert the_lease(cluster)["spec"]["leaseTransitions"] == 0


async def test_a_running_holder_keeps_the_slot_even_when_the_lease_lapsed(
    cluster: FakeCluster,
) -> None:
    await CheckpointLeases(cluster.kube()).take(rset(cluster), "a", 1)
    change_checkpoint(cluster, "a", phase("Committing"))
    later = CheckpointLeases(cluster.kube(), clock=lambda: time.time() + 3600)
    assert await later.take(rset(cluster), "b", 600) == "a"
    assert holder_of(the_lease(cluster)) == "a"


async def test_a_holder_that_never_started_keeps_the_slot_until_the_lease_lapses(
    cluster: FakeCluster,
) -> None:
    """Taken, then the operator died before the first phase write: the holder is Pending."""
    await CheckpointLeases(cluster.kube()).take(rset(cluster), "a", 60)
    assert await CheckpointLeases(cluster.kube()).take(rset(cluster), "b", 600) == "a"
    later = CheckpointLeases(cluster.kube(), clock=lambda: time.time() + 120)
    assert await later.take(rset(cluster), "b", 600) is None
    lease = the_lease(cluster)
    assert holder_of(lease) == "b"
    assert lease["spec"]["leaseTransitions"] == 1


@pytest.mark.parametrize("how", ["Ready", "Failed", "deleted", "deleting"])
async def test_a_finished_or_gone_holder_is_taken_over(cluster: FakeCluster, how: str) -> None:
    await CheckpointLeases(cluster.kube()).take(rset(cluster), "a", 600)
    if how == "deleted":
        cluster.remove(ROLLOUT_CHECKPOINT_PLURAL, NS, "a")
    elif how == "deleting":

        def deleting(ckpt: dict[str, Any]) -> None:
            ckpt["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:01Z"
            ckpt["status"]["phase"] = "Preparing"

        change_checkpoint(cluster, "a", deleting)
    else:
        change_checkpoint(cluster, "a", phase(how))
    assert await CheckpointLeases(cluster.kube()).take(rset(cluster), "b", 600) is None
    assert holder_of(the_lease(cluster)) == "b"


async def test_a_lost_race_reads_the_lease_again_and_never_steals(cluster: FakeCluster) -> None:
    """Two takers with the same remembered version: the second's replace is refused, it reads
    the Lease and finds the first one's running checkpoint."""
    first, second = CheckpointLeases(cluster.kube()), CheckpointLeases(cluster.kube())
    await first.take(rset(cluster), "a", 600)
    await first.release(NS, SET, "a")
    await second.take(rset(cluster), "a", 600)  # remembers the released version...
    await second.release(NS, SET, "a")
    assert await first.take(rset(cluster), "a", 600) is None  # ...which moved on
    change_checkpoint(cluster, "a", phase("Preparing"))
    cluster.requests.clear()
    assert await second.take(rset(cluster), "b", 600) == "a"
    assert lease_calls(cluster) == ["patch", "get"]
    assert holder_of(the_lease(cluster)) == "a"


async def test_releasing_a_slot_held_by_another_checkpoint_changes_nothing(
    cluster: FakeCluster,
) -> None:
    leases = CheckpointLeases(cluster.kube())
    await leases.take(rset(cluster), "a", 600)
    before = cluster.list_objects("leases", NS)
    await leases.release(NS, SET, "b")
    assert cluster.list_objects("leases", NS) == before
