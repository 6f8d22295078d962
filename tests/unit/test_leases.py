"""The per-set checkpoint Lease (`leases.CheckpointLeases`): one checkpoint at a time per set.

The API below is `kube_fakes.InMemorySet`, whose Lease replace keeps the API server's
resourceVersion precondition; its `lease_calls` count the requests each step makes.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
from kube_fakes import InMemorySet
from rollout_operator.cluster.leases import CheckpointLeases, holder_of, lapsed, lease_name
from rollout_operator.model import api

NS = "team"
SET = "math"


def _set() -> dict[str, Any]:
    container = {"name": "c", "ports": [{"name": "control", "containerPort": 9000}]}
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutSet",
        "metadata": {"name": SET, "namespace": NS, "uid": "set-uid", "generation": 1},
        "spec": {
            "participants": [{"role": "model", "template": {"spec": {"containers": [container]}}}],
            "storage": {"path": "/ckpt", "volume": {"emptyDir": {}}},
        },
        "status": {"attempt": 1},
    }


def _checkpoint(name: str, phase: str | None) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutCheckpoint",
        "metadata": {"name": name, "namespace": NS, "creationTimestamp": "2026-12-01T00:00:00Z"},
        "spec": {"rolloutSet": SET, "trigger": "Manual"},
        "status": {} if phase is None else {"phase": phase},
    }


@pytest.fixture
def fake() -> InMemorySet:
    return InMemorySet(_set(), [_checkpoint("a", None), _checkpoint("b", None)])


def rset(fake: InMemorySet) -> api.RolloutSet:
    return api.RolloutSet.model_validate(copy.deepcopy(fake.set))


async def test_the_first_take_creates_the_lease_owned_by_the_set(fake: InMemorySet) -> None:
    leases = CheckpointLeases(fake.as_kube())
    assert await leases.take(rset(fake), "a", 600) is None
    lease = fake.leases[lease_name(SET)]
    assert holder_of(lease) == "a"
    assert lease["spec"]["leaseDurationSeconds"] == 600
    assert not lapsed(lease, time.time())
    (owner,) = lease["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("RolloutSet", SET, "set-uid")
    assert fake.lease_calls == ["get", "create"]


async def test_release_and_the_next_take_are_one_request_each(fake: InMemorySet) -> None:
    leases = CheckpointLeases(fake.as_kube())
    await leases.take(rset(fake), "a", 600)
    fake.lease_calls.clear()
    await leases.release(NS, SET, "a")
    assert holder_of(fake.leases[lease_name(SET)]) is None
    assert await leases.take(rset(fake), "b", 600) is None
    assert holder_of(fake.leases[lease_name(SET)]) == "b"
    assert fake.lease_calls == ["patch", "patch"]
    assert fake.leases[lease_name(SET)]["spec"]["leaseTransitions"] == 0


async def test_a_running_holder_keeps_the_slot_even_when_the_lease_lapsed(
    fake: InMemorySet,
) -> None:
    await CheckpointLeases(fake.as_kube()).take(rset(fake), "a", 1)
    fake.checkpoints["a"]["status"]["phase"] = "Committing"
    later = CheckpointLeases(fake.as_kube(), clock=lambda: time.time() + 3600)
    assert await later.take(rset(fake), "b", 600) == "a"
    assert holder_of(fake.leases[lease_name(SET)]) == "a"


async def test_a_holder_that_never_started_keeps_the_slot_until_the_lease_lapses(
    fake: InMemorySet,
) -> None:
    """Taken, then the operator died before the first phase write: the holder is Pending."""
    await CheckpointLeases(fake.as_kube()).take(rset(fake), "a", 60)
    assert await CheckpointLeases(fake.as_kube()).take(rset(fake), "b", 600) == "a"
    later = CheckpointLeases(fake.as_kube(), clock=lambda: time.time() + 120)
    assert await later.take(rset(fake), "b", 600) is None
    lease = fake.leases[lease_name(SET)]
    assert holder_of(lease) == "b"
    assert lease["spec"]["leaseTransitions"] == 1


@pytest.mark.parametrize("how", ["Ready", "Failed", "deleted", "deleting"])
async def test_a_finished_or_gone_holder_is_taken_over(fake: InMemorySet, how: str) -> None:
    await CheckpointLeases(fake.as_kube()).take(rset(fake), "a", 600)
    if how == "deleted":
        del fake.checkpoints["a"]
    elif how == "deleting":
        fake.checkpoints["a"]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:01Z"
        fake.checkpoints["a"]["status"]["phase"] = "Preparing"
    else:
        fake.checkpoints["a"]["status"]["phase"] = how
    assert await CheckpointLeases(fake.as_kube()).take(rset(fake), "b", 600) is None
    assert holder_of(fake.leases[lease_name(SET)]) == "b"


async def test_a_lost_race_reads_the_lease_again_and_never_steals(fake: InMemorySet) -> None:
    """Two takers with the same remembered version: the second's replace is refused, it reads
    the Lease and finds the first one's running checkpoint."""
    first, second = CheckpointLeases(fake.as_kube()), CheckpointLeases(fake.as_kube())
    await first.take(rset(fake), "a", 600)
    await first.release(NS, SET, "a")
    await second.take(rset(fake), "a", 600)  # remembers the released version...
    await second.release(NS, SET, "a")
    assert await first.take(rset(fake), "a", 600) is None  # ...which moved on
    fake.checkpoints["a"]["status"]["phase"] = "Preparing"
    fake.lease_calls.clear()
    assert await second.take(rset(fake), "b", 600) == "a"
    assert fake.lease_calls == ["patch", "get"]
    assert holder_of(fake.leases[lease_name(SET)]) == "a"


async def test_releasing_a_slot_held_by_another_checkpoint_changes_nothing(
    fake: InMemorySet,
) -> None:
    leases = CheckpointLeases(fake.as_kube())
    await leases.take(rset(fake), "a", 600)
    before = copy.deepcopy(fake.leases)
    await leases.release(NS, SET, "b")
    assert fake.leases == before
