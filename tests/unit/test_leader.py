"""The leader Lease (`leader.LeaderLease`): one operator process works at a time.

The API below the real `Kube` is `testsupport.fakecluster.FakeCluster`, whose Lease patch keeps
the API server's resourceVersion precondition. Time is an injected clock where the test moves
it; the waits that are real (a waiting process polling) are bounded by `anyio.fail_after`.
"""

from __future__ import annotations

import time

import anyio
import pytest
from rollout_operator.cluster.leader import LeaderLease
from rollout_operator.cluster.leases import holder_of, lapsed
from testsupport.fakecluster import FakeCluster

from devcluster.waiting import wait_for

NS = "ops"
NAME = "rel-rollout-operator-leader"


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def lease_of(cluster: FakeCluster) -> dict[str, object]:
    lease = cluster.get("leases", NS, NAME)
    assert lease is not None, "no Lease"
    return lease


async def reads_reach(cluster: FakeCluster, count: int) -> None:
    """Until the Lease was read `count` times (a waiting process polls it)."""

    async def reached() -> bool:
        return cluster.count("get", "leases") >= count

    await wait_for(reached, 5, f"{count} reads of the Lease", interval=0.005)


def leader(cluster: FakeCluster, identity: str, clock: Clock | None = None) -> LeaderLease:
    return LeaderLease(
        cluster.kube(watching=False),
        NS,
        NAME,
        identity,
        clock=clock or time.monotonic,
        poll_seconds=0.01,
        renew_seconds=0.01,
    )


async def test_the_first_operator_creates_the_lease_and_holds_it() -> None:
    cluster = FakeCluster()
    with anyio.fail_after(5):
        await leader(cluster, "pod-a").acquire()
    lease = lease_of(cluster)
    assert holder_of(lease) == "pod-a"
    assert not lapsed(lease, time.time())
    assert [r.verb for r in cluster.requests] == ["get", "create"]


async def test_a_second_operator_waits_until_the_first_releases_then_starts_at_once() -> None:
    cluster = FakeCluster()
    first, second = leader(cluster, "pod-a"), leader(cluster, "pod-b")
    await first.acquire()
    acquired = anyio.Event()

    async def take() -> None:
        await second.acquire()
        acquired.set()

    async with anyio.create_task_group() as group:
        group.start_soon(take)
        # The second polls while the first renews: it must not take a live holder's Lease.
        for _ in range(3):
            await reads_reach(cluster, cluster.count("get", "leases") + 1)
            assert await first.renew_once()
        assert not acquired.is_set()
        assert holder_of(lease_of(cluster)) == "pod-a"
        await first.release()
        with anyio.fail_after(5):
            await acquired.wait()
    assert holder_of(lease_of(cluster)) == "pod-b"
    # The first one finds it lost and says so: its process stops.
    assert not await first.renew_once()


async def test_a_lease_whose_holder_stopped_renewing_is_taken_over_when_it_lapsed() -> None:
    cluster, clock = FakeCluster(), Clock()
    await leader(cluster, "pod-a", clock).acquire()
    waiting = leader(cluster, "pod-b", clock)
    async with anyio.create_task_group() as group:
        group.start_soon(waiting.acquire)
        await reads_reach(cluster, 3)  # it saw the Lease, and waits
        assert holder_of(lease_of(cluster)) == "pod-a"
        clock.now += 31  # unchanged for longer than leaseDurationSeconds (30) on its clock
    lease = lease_of(cluster)
    assert holder_of(lease) == "pod-b"
    assert lease["spec"]["leaseTransitions"] == 1  # type: ignore[index]


async def test_a_renewing_holder_keeps_its_lease_whatever_the_clocks_say() -> None:
    """The waiter's clock runs far ahead of the holder's renewTime (nodes' clocks differ):
    as long as the Lease keeps changing, it is not taken."""
    cluster, waiter_clock = FakeCluster(), Clock()
    holder = leader(cluster, "pod-a")
    await holder.acquire()
    waiter_clock.now += 3600
    waiting = leader(cluster, "pod-b", waiter_clock)
    async with anyio.create_task_group() as group:
        group.start_soon(waiting.acquire)
        for _ in range(5):
            await reads_reach(cluster, cluster.count("get", "leases") + 1)
            waiter_clock.now += 20  # less than the duration between two renewals it saw
            assert await holder.renew_once()
        assert holder_of(lease_of(cluster)) == "pod-a"
        group.cancel_scope.cancel()


async def test_a_restarted_container_of_the_holding_pod_takes_its_lease_at_once() -> None:
    cluster = FakeCluster()
    await leader(cluster, "pod-a").acquire()
    cluster.requests.clear()
    with anyio.fail_after(5):
        await leader(cluster, "pod-a").acquire()
    assert holder_of(lease_of(cluster)) == "pod-a"
    assert [r.verb for r in cluster.requests] == ["get", "patch"]


async def test_renewing_is_one_patch_and_moves_the_renew_time() -> None:
    cluster, clock = FakeCluster(), Clock()
    held = leader(cluster, "pod-a", clock)
    await held.acquire()
    before = lease_of(cluster)["spec"]["renewTime"]  # type: ignore[index]
    clock.now += 5
    cluster.requests.clear()
    assert await held.renew_once()
    assert [r.verb for r in cluster.requests] == ["patch"]
    assert lease_of(cluster)["spec"]["renewTime"] != before  # type: ignore[index]


async def test_an_operator_that_cannot_renew_stops_at_the_renew_deadline() -> None:
    cluster, clock = FakeCluster(), Clock()
    held = leader(cluster, "pod-a", clock)
    await held.acquire()
    cluster.refuse("patch", "leases", status=503, message="the API server is away", times=100)
    clock.now += 10
    assert await held.renew_once(), "a failed renewal within the deadline (15 s) is retried"
    clock.now += 5
    assert not await held.renew_once()
    assert holder_of(lease_of(cluster)) == "pod-a", "it stops while the Lease is its own"


async def test_a_renewal_that_hangs_is_cut_off_at_the_deadline() -> None:
    """The API server unreachable: the patch never answers. The holder must not wait on it past
    its deadline (a successor takes a Lease unchanged for its duration)."""
    cluster = FakeCluster()
    kube = cluster.kube(watching=False)
    held = LeaderLease(kube, NS, NAME, "pod-a", renew_deadline_seconds=0.3)
    await held.acquire()

    async def hang(*_: object, **__: object) -> dict[str, object]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    kube.patch_lease = hang  # type: ignore[method-assign]
    with anyio.fail_after(5):
        assert not await held.renew_once()


async def test_a_stale_release_leaves_the_successors_lease_alone() -> None:
    """The old holder releases after a successor took its lapsed Lease over: the
    compare-and-swap is refused, and the successor keeps it."""
    cluster, clock = FakeCluster(), Clock()
    old = leader(cluster, "pod-a", clock)
    await old.acquire()
    successor = leader(cluster, "pod-b", clock)
    async with anyio.create_task_group() as group:
        group.start_soon(successor.acquire)
        await reads_reach(cluster, 3)
        clock.now += 31
    assert holder_of(lease_of(cluster)) == "pod-b"
    patches = cluster.count("patch", "leases")
    await old.release()
    assert cluster.count("patch", "leases") == patches + 1, "it tried, with its stale version"
    assert holder_of(lease_of(cluster)) == "pod-b"


@pytest.mark.parametrize("holder", [None, "pod-a"])
async def test_release_leaves_a_lease_the_process_does_not_hold_alone(holder: str | None) -> None:
    cluster = FakeCluster()
    held = leader(cluster, "pod-a")
    await held.acquire()
    other = leader(cluster, "pod-b")
    if holder is None:
        await held.release()
        await other.acquire()
        await held.release()  # no longer its own: nothing changes
        assert holder_of(lease_of(cluster)) == "pod-b"
    else:
        await other.release()  # pod-b never held it
        assert holder_of(lease_of(cluster)) == "pod-a"
