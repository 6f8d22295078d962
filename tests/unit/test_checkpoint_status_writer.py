"""The one writer of a RolloutCheckpoint's status and its owner table
(docs/design.md#61-checkpoint): one call site sends a checkpoint's status (counted with `ast`),
every write carries the resourceVersion it was computed from, a refused write is made again
over the checkpoint as it is now, the emptied lists are sent as `[]`, and a flow that writes
outside what it owns is refused before anything is sent."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from rollout_operator.cluster.checkpointstatus import (
    CheckpointStatusWriter,
    status_body,
)
from rollout_operator.model import api
from rollout_operator.model.api import (
    ROLLOUT_CHECKPOINT_PLURAL,
    CheckpointPhase,
    RolloutCheckpoint,
    RolloutCheckpointStatus,
)
from rollout_operator.model.checkpointowners import (
    OWNED_FIELDS,
    OWNED_PHASES,
    CheckpointOwner,
    ForeignCheckpointWrite,
    check_checkpoint_owner,
)
from testsupport.checkpointflow import CKPT, NS, set_cluster
from testsupport.fakecluster import FakeCluster

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "rollout_operator"


def _senders() -> list[str]:
    """Every call of `patch_checkpoint_status` in the operator, as `module:line`."""
    found = []
    for path in sorted(OPERATOR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "patch_checkpoint_status"
            ):
                found.append(f"{path.relative_to(OPERATOR)}:{node.lineno}")
    return found


def test_one_call_site_sends_a_checkpoints_status() -> None:
    senders = _senders()
    assert len(senders) == 1, senders
    assert senders[0].startswith("cluster/checkpointstatus.py:"), senders


def _stored(cluster: FakeCluster, **status: Any) -> RolloutCheckpoint:
    cluster.update(ROLLOUT_CHECKPOINT_PLURAL, NS, CKPT, lambda o: o.update(status=status))
    raw = cluster.get(ROLLOUT_CHECKPOINT_PLURAL, NS, CKPT)
    assert raw is not None
    return RolloutCheckpoint.model_validate(raw)


async def test_a_write_carries_the_resource_version_and_keeps_the_new_one() -> None:
    cluster = set_cluster("Manual", [])
    kube = cluster.kube()
    ckpt = _stored(cluster, phase="Preparing")
    read = ckpt.metadata.resource_version
    writer = CheckpointStatusWriter(kube, CheckpointOwner.FLOW)
    await writer.write(ckpt, {"phase": "Committing"})
    (patch,) = [r for r in cluster.requests if r.verb == "patch"]
    assert patch.body is not None
    assert patch.body["metadata"] == {"resourceVersion": read}
    stored = cluster.get(ROLLOUT_CHECKPOINT_PLURAL, NS, CKPT)
    assert stored is not None
    assert ckpt.metadata.resource_version == stored["metadata"]["resourceVersion"] != read


async def test_a_write_refused_for_a_newer_version_is_made_over_the_checkpoint_as_it_is() -> None:
    cluster = set_cluster("Manual", [])
    kube = cluster.kube(watching=False)
    ckpt = _stored(cluster, phase="Preparing")
    # Another writer (the records finalizer, say) changed the object since it was read.
    cluster.update(
        ROLLOUT_CHECKPOINT_PLURAL,
        NS,
        CKPT,
        lambda o: o["metadata"].update(finalizers=["checkpoint.rollout.dev/records"]),
    )
    writer = CheckpointStatusWriter(kube, CheckpointOwner.FLOW)
    seen: list[str | None] = []

    def build(stored: RolloutCheckpoint) -> dict[str, Any]:
        seen.append(stored.status.phase)
        return {"phase": "Committing"}

    assert await writer.write_retrying(ckpt, build) is not None
    assert seen == ["Preparing", "Preparing"], "built again from the fresh read"
    stored = cluster.get(ROLLOUT_CHECKPOINT_PLURAL, NS, CKPT)
    assert stored is not None
    assert stored["status"]["phase"] == "Committing"
    assert ckpt.metadata.resource_version == stored["metadata"]["resourceVersion"]


def test_the_emptied_lists_are_sent_empty() -> None:
    body = status_body(RolloutCheckpointStatus(phase=CheckpointPhase.FAILED))
    assert body["blockers"] == []
    assert body["participants"] == []


def _status(phase: CheckpointPhase | None, *conditions: tuple[str, str]) -> RolloutCheckpointStatus:
    return RolloutCheckpointStatus.model_validate(
        {
            "phase": phase,
            "conditions": [
                {
                    "type": type_,
                    "status": value,
                    "reason": "Because",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
                for type_, value in conditions
            ],
        }
    )


def test_each_owner_writes_only_in_its_phases_and_fields() -> None:
    running = _status(CheckpointPhase.PREPARING)
    ready = _status(CheckpointPhase.READY, ("Ready", "True"), ("Committed", "True"))
    check_checkpoint_owner(CheckpointOwner.FLOW, running, {"phase": "Committing"})
    with pytest.raises(ForeignCheckpointWrite):
        check_checkpoint_owner(CheckpointOwner.FLOW, ready, {"phase": "Failed"})
    with pytest.raises(ForeignCheckpointWrite):
        check_checkpoint_owner(CheckpointOwner.REPAIR, running, {"phase": "Ready"})
    with pytest.raises(ForeignCheckpointWrite):
        check_checkpoint_owner(CheckpointOwner.VERDICT, ready, {"participants": []})
    verdict = _status(CheckpointPhase.FAILED, ("Ready", "False"), ("Committed", "True"))
    check_checkpoint_owner(CheckpointOwner.VERDICT, ready, _verdict(verdict))
    touched = _status(CheckpointPhase.FAILED, ("Ready", "False"), ("Committed", "False"))
    with pytest.raises(ForeignCheckpointWrite):
        check_checkpoint_owner(CheckpointOwner.VERDICT, ready, _verdict(touched))


def _verdict(status: RolloutCheckpointStatus) -> dict[str, Any]:
    body = api.dump(status)
    return {"phase": body["phase"], "conditions": body["conditions"]}


def test_the_table_covers_every_owner_phase_and_field() -> None:
    wire_fields = {f.alias or n for n, f in RolloutCheckpointStatus.model_fields.items()}
    assert set(OWNED_PHASES) == set(OWNED_FIELDS) == set(CheckpointOwner)
    for owner in CheckpointOwner:
        assert OWNED_FIELDS[owner] <= wire_fields, owner
    # While a checkpoint runs only its flow writes it; once finished, never its flow.
    for phase in [None, *CheckpointPhase]:
        writers = {o for o in CheckpointOwner if phase in OWNED_PHASES[o]}
        finished = phase in api.CHECKPOINT_FINISHED
        assert (CheckpointOwner.FLOW in writers) is not finished, phase
