"""Class 2 of issue 15 for the names status points at: what the operator's flows read from a
set's status (`recovery.checkpoint`, `latestCheckpoint`, `activeCheckpoint`) is checked against
the checkpoints before it is acted on, since anyone with `patch` on the status subresource can
write it.

The flows run for real; the API below them is `kube_fakes.InMemorySet` (status writes keep the
resourceVersion precondition) holding the set and its checkpoints, and those of another set in
the same namespace. The e2e cases of the same class are in test_status_and_size_api.py.
"""

from __future__ import annotations

import copy
from typing import Any, cast

from kube_fakes import InMemorySet
from rollout_operator.cluster.kube import Kube
from rollout_operator.cluster.leases import CheckpointLeases, holder_of, lease_name
from rollout_operator.flows.checkpoint import CheckpointFlow
from rollout_operator.flows.recovery import RecoveryFlow
from rollout_operator.model import api

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
    ready = "True" if phase in ("Ready", "Resuming") else "False"
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutCheckpoint",
        "metadata": {"name": name, "namespace": NS, "generation": 1, "creationTimestamp": at},
        "spec": {"rolloutSet": of, "trigger": "Manual"},
        "status": {
            "phase": phase,
            "attempt": 1,
            "completedAt": at if phase == "Ready" else None,
            "conditions": [
                {"type": "Ready", "status": ready, "reason": "X", "lastTransitionTime": at}
            ],
        },
    }


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
    api_ = InMemorySet(
        _recovering("theirs"),
        [
            _checkpoint("mine-old", "Ready", minute=1),
            _checkpoint("mine", "Ready", minute=5),
            theirs,
        ],
    )
    events = Events()
    flow = RecoveryFlow(cast(Kube, api_), on_transition=events)
    rset = api.RolloutSet.model_validate(await api_.get_set(NS, SET))
    repaired = await flow._still_restorable(rset)
    assert repaired.status.recovery is not None
    assert repaired.status.recovery.checkpoint == "mine"
    assert api_.set["status"]["recovery"]["checkpoint"] == "mine"
    assert [reason for reason, _ in events.posted] == ["StatusRepaired"]
    assert "'theirs'" in events.posted[0][1]


async def test_a_restore_failure_never_marks_another_sets_checkpoint_invalid() -> None:
    """The class-9 verdict (Ready=False, RecordsInvalid) is written only on a checkpoint of
    the recovering set, whatever name status held."""
    theirs = _checkpoint("theirs", "Ready", of="other")
    api_ = InMemorySet(_recovering("theirs"), [theirs])
    before = copy.deepcopy(theirs)
    flow = RecoveryFlow(cast(Kube, api_))
    rset = api.RolloutSet.model_validate(await api_.get_set(NS, SET))
    await flow._invalidate(rset, "theirs", "sha256 mismatch")
    assert api_.checkpoints["theirs"] == before


async def test_a_recovery_restores_the_newest_ready_checkpoint_not_a_written_latest() -> None:
    """`status.latestCheckpoint` written back to an older checkpoint (or to none) does not
    decide what a recovery restores: its newest Ready checkpoint does."""
    for written in ("mine-old", None, "theirs"):
        api_ = InMemorySet(
            _set({"latestCheckpoint": written}),
            [
                _checkpoint("mine-old", "Ready", minute=1),
                _checkpoint("mine", "Ready", minute=5),
                _checkpoint("mine-failed", "Failed", minute=7),
                _checkpoint("theirs", "Ready", of="other", minute=9),
            ],
        )
        flow = RecoveryFlow(cast(Kube, api_))
        rset = api.RolloutSet.model_validate(await api_.get_set(NS, SET))
        assert await flow._restorable_checkpoint(rset) == "mine", written


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
    api_ = InMemorySet(
        ready_set, [_checkpoint("running", "Pending"), _checkpoint("next", "Pending")]
    )
    leases = CheckpointLeases(cast(Kube, api_))
    rset = api.RolloutSet.model_validate(await api_.get_set(NS, SET))
    assert await leases.take(rset, "running", 600) is None
    api_.checkpoints["running"]["status"]["phase"] = "Preparing"
    api_.set["status"].pop("activeCheckpoint", None)
    rset = api.RolloutSet.model_validate(await api_.get_set(NS, SET))
    flow = CheckpointFlow(cast(Kube, api_))
    assert flow._why_wait(rset) is None, "the set itself lets a checkpoint start"
    assert await CheckpointLeases(cast(Kube, api_)).take(rset, "next", 600) == "running"
    assert holder_of(api_.leases[lease_name(SET)]) == "running"
    # with nothing running, `next` takes the slot over (one compare-and-swap)
    api_.checkpoints["running"]["status"]["phase"] = "Ready"
    assert await CheckpointLeases(cast(Kube, api_)).take(rset, "next", 600) is None
    assert holder_of(api_.leases[lease_name(SET)]) == "next"
