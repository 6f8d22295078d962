"""Failure-mode class 2 (docs/operations.md#failure-modes) for the names status points at: what the
operator's flows read from a set's status (`recovery.checkpoint`, `latestCheckpoint`,
`activeCheckpoint`) is checked against the checkpoints before it is acted on, since anyone with
`patch` on the status subresource can write it.

The flows and the `Kube` client run for real; the API server below them is the unit tests'
`testsupport.fakecluster.FakeCluster` (status writes keep the resourceVersion precondition)
holding the set and its checkpoints, and those of another set in the same namespace. The e2e
cases of the same class are in test_status_and_size_api.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_operator.cluster.leases import CheckpointLeases, holder_of, lease_name
from rollout_operator.flows.checkpoint.slot import why_wait
from rollout_operator.flows.recovery.pods import restorable_checkpoint
from rollout_operator.flows.recovery.restore import invalidate, still_restorable
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL
from testsupport import builders
from testsupport.fakecluster import FakeCluster
from testsupport.recovery import context_over
from testsupport.recovery import written as pass_written

NS = "team"
SET = "math"
STAMP = "2026-11-29T12:00:00Z"


def _set(status: dict[str, Any]) -> dict[str, Any]:
    container = {"name": "c", "ports": [{"name": "control", "containerPort": 9000}]}
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutSet",
        "metadata": {"name": SET, "namespace": NS, "uid": "u", "generation": 1},
        "spec": {
            "participants": [{"role": "model", "template": {"spec": {"containers": [container]}}}],
            "storage": {"path": "/ckpt", "volume": {"emptyDir": {}}},
        },
        "status": {"attempt": 2, "createdAttempt": 2, **status},
    }


def _checkpoint(name: str, phase: str, *, of: str = SET, minute: int = 0) -> dict[str, Any]:
    at = f"2026-11-29T12:{minute:02d}:00Z"
    completed = at if phase == "Ready" else None
    return builders.checkpoint_body(
        name,
        set_name=of,
        namespace=NS,
        generation=1,
        created=at,
        status=builders.checkpoint_status(phase, at=at, completed=completed, reason="X", attempt=1),
    )


def holding(obj: dict[str, Any], checkpoints: Sequence[dict[str, Any]]) -> FakeCluster:
    """An API server holding the set and these checkpoints."""
    cluster = FakeCluster()
    for each in (obj, *checkpoints):
        cluster.put(each)
    return cluster


def stored(cluster: FakeCluster, plural: str, name: str) -> dict[str, Any]:
    found = cluster.get(plural, NS, name)
    assert found is not None, f"{plural} {name} is gone"
    return found


def set_phase(cluster: FakeCluster, checkpoint: str, phase: str) -> None:
    """The checkpoint's own flow writes its phase."""
    cluster.update(
        ROLLOUT_CHECKPOINT_PLURAL, NS, checkpoint, lambda c: c["status"].update(phase=phase)
    )


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    async def __call__(self, rset: api.RolloutSet, reason: str, message: str, warn: bool) -> None:
        self.posted.append((reason, message))


def _recovering(checkpoint: str) -> dict[str, Any]:
    return _set(
        {
            "recovery": {
                "phase": "Restoring",
                "fromAttempt": 2,
                "targetAttempt": 3,
                "startedAt": STAMP,
                "checkpoint": checkpoint,
                "reason": "PodDeleted",
            }
        }
    )


async def test_a_recovery_never_restores_another_sets_checkpoint_written_into_its_status() -> None:
    """`status.recovery.checkpoint` pointed at a Ready checkpoint of another set: restoring it
    would fail (its records are not under this set's folder) and mark the other set's
    checkpoint invalid. The recovery restores its own newest Ready checkpoint instead."""
    theirs = _checkpoint("theirs", "Ready", of="other", minute=9)
    cluster = holding(
        _recovering("theirs"),
        [
            _checkpoint("mine-old", "Ready", minute=1),
            _checkpoint("mine", "Ready", minute=5),
            theirs,
        ],
    )
    kube = cluster.kube()
    events = Events()
    context = context_over(cluster, events=events)
    rset = api.RolloutSet.model_validate(await kube.get_set(NS, SET))
    repaired = await pass_written(still_restorable, context, rset)
    assert repaired is not None
    assert repaired.status.recovery is not None
    assert repaired.status.recovery.checkpoint == "mine"
    assert stored(cluster, ROLLOUT_SET_PLURAL, SET)["status"]["recovery"]["checkpoint"] == "mine"
    assert [reason for reason, _ in events.posted] == ["StatusRepaired"]
    assert "'theirs'" in events.posted[0][1]


async def test_a_restore_failure_never_marks_another_sets_checkpoint_invalid() -> None:
    """The class-9 verdict (Ready=False, RecordsInvalid) is written only on a checkpoint of
    the recovering set, whatever name status held."""
    theirs = _checkpoint("theirs", "Ready", of="other")
    cluster = holding(_recovering("theirs"), [theirs])
    before = stored(cluster, ROLLOUT_CHECKPOINT_PLURAL, "theirs")
    kube = cluster.kube()
    context = context_over(cluster)
    rset = api.RolloutSet.model_validate(await kube.get_set(NS, SET))
    await invalidate(context, rset, "theirs", "sha256 mismatch")
    assert stored(cluster, ROLLOUT_CHECKPOINT_PLURAL, "theirs") == before


async def test_a_recovery_restores_the_newest_ready_checkpoint_not_a_written_latest() -> None:
    """`status.latestCheckpoint` written back to an older checkpoint (or to none) does not
    decide what a recovery restores: its newest Ready checkpoint does."""
    for written in ("mine-old", None, "theirs"):
        cluster = holding(
            _set({"latestCheckpoint": written}),
            [
                _checkpoint("mine-old", "Ready", minute=1),
                _checkpoint("mine", "Ready", minute=5),
                _checkpoint("mine-failed", "Failed", minute=7),
                _checkpoint("theirs", "Ready", of="other", minute=9),
            ],
        )
        kube = cluster.kube()
        context = context_over(cluster)
        rset = api.RolloutSet.model_validate(await kube.get_set(NS, SET))
        assert await restorable_checkpoint(context, rset) == "mine", written


async def test_a_cleared_active_checkpoint_does_not_start_a_second_checkpoint() -> None:
    """`status.activeCheckpoint` cleared while checkpoint `running` prepares: another checkpoint
    of the set waits for it (the participants would refuse a second one as conflicting). The slot
    is the set's Lease, which status does not hold: `activeCheckpoint` is only shown (the set's
    pass derives it from the checkpoints)."""
    ready_set = _set(
        {
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "R", "lastTransitionTime": STAMP}
            ],
            "participants": [
                {"role": "model", "index": 0, "pod": "p", "ready": True, "address": "http://x"}
            ],
        }
    )
    cluster = holding(
        ready_set, [_checkpoint("running", "Pending"), _checkpoint("next", "Pending")]
    )
    kube = cluster.kube()
    leases = CheckpointLeases(kube)
    rset = api.RolloutSet.model_validate(await kube.get_set(NS, SET))
    assert await leases.take(rset, "running", 600) is None
    set_phase(cluster, "running", "Preparing")
    # a user clears `activeCheckpoint` (`kubectl patch --subresource=status`)
    cluster.update(ROLLOUT_SET_PLURAL, NS, SET, lambda s: s["status"].pop("activeCheckpoint", None))
    rset = api.RolloutSet.model_validate(await kube.get_set(NS, SET))
    assert why_wait(rset) is None, "the set itself lets a checkpoint start"
    assert await CheckpointLeases(kube).take(rset, "next", 600) == "running"
    assert holder_of(stored(cluster, "leases", lease_name(SET))) == "running"
    # with nothing running, `next` takes the slot over (one compare-and-swap)
    set_phase(cluster, "running", "Ready")
    assert await CheckpointLeases(kube).take(rset, "next", 600) is None
    assert holder_of(stored(cluster, "leases", lease_name(SET))) == "next"
