"""Failure-mode class 1 (docs/operations.md#failure-modes): storage is shared and must be owned
exactly.

Sets with the same name in different namespaces share a volume; users put other things on it;
a set's cleanup must remove only what the operator's participants wrote for that very set, and
storage paths that cannot be right are refused before any pod mounts them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from rollout_operator.cluster.storage import StorageLocator
from rollout_operator.decide.policy.views import Note
from rollout_operator.flows.policypass import checkpoint_deleted, set_deleted
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_CHECKPOINT_PLURAL
from rollout_protocol import ControlPlane
from shared import BAD_PATHS, checkpoint, pod_settings, post, serve, set_cluster, set_object
from testsupport.participants import FakeParticipant

LOCATOR = StorageLocator(None)
"""The operator sees a hostPath volume at its own path (as on devcluster)."""


async def _restored(obj: dict[str, Any], root: Path, checkpoint_id: str) -> list[str]:
    """Restore `checkpoint_id` into a fresh participant of the set (attempt 2): what it got."""
    fresh = FakeParticipant()
    async with serve(ControlPlane(fresh, pod_settings(obj, root, attempt=2))) as client:
        reply = await post(client, "restore", checkpoint_id=checkpoint_id, attempt=2)
        assert reply.status_code == 200, f"the Ready checkpoint is lost: {reply.text}"
        assert (await post(client, "resume", checkpoint_id=checkpoint_id)).status_code == 200
    return sorted(record.rollout_id for record in fresh.installed)


async def test_same_set_name_in_two_namespaces_keeps_each_sets_records(tmp_path: Path) -> None:
    """Two sets named `math` in two namespaces on one volume, both with a Ready checkpoint
    `c1`: deleting team-b's `c1` must leave team-a's restorable."""
    root = tmp_path / "volume"
    root.mkdir()
    team_a = set_object("team-a", "0b9e1f7c-aaaa-4c1e-9d55-000000000001", root)
    team_b = set_object("team-b", "0b9e1f7c-bbbb-4c1e-9d55-000000000002", root)
    for obj, rollouts in ((team_a, ["a1", "a2"]), (team_b, ["b1"])):
        plane = ControlPlane(FakeParticipant(rollouts=rollouts), pod_settings(obj, root))
        async with serve(plane) as client:
            await checkpoint(client, "c1")

    cluster_b = set_cluster(team_b, ["c1"])
    c1 = cluster_b.get(ROLLOUT_CHECKPOINT_PLURAL, "team-b", "c1")
    assert c1 is not None
    await checkpoint_deleted(cluster_b.kube(), c1, locator=LOCATOR)

    assert await _restored(team_a, root, "c1") == ["a1", "a2"]


def collect(notes: list[Note]) -> Callable[[api.RolloutSet, Note], Awaitable[None]]:
    async def note(_rset: api.RolloutSet, found: Note) -> None:
        notes.append(found)

    return note


async def test_deleting_a_set_that_never_ran_keeps_what_others_put_on_the_volume(
    tmp_path: Path,
) -> None:
    """A set named like a folder someone else keeps on the volume, deleted before it ran a
    pod: the folder and everything in it stay."""
    root = tmp_path / "volume"
    theirs = root / "math"
    (theirs / "datasets").mkdir(parents=True)
    (theirs / "notes.txt").write_text("not the operator's\n")
    (theirs / "datasets" / "train.jsonl").write_text("{}\n")
    obj = set_object("team-a", "0b9e1f7c-aaaa-4c1e-9d55-000000000001", root)

    notes: list[Note] = []
    outcome = await set_deleted(
        set_cluster(obj).kube(), obj, locator=LOCATOR, on_note=collect(notes)
    )

    assert (theirs / "notes.txt").read_text() == "not the operator's\n", outcome
    assert (theirs / "datasets" / "train.jsonl").is_file(), outcome
    assert notes == [], "not the set's folder: nothing of the set was left behind"
    assert "was absent" in outcome, outcome


async def test_deleting_a_set_keeps_files_that_are_not_its_records(tmp_path: Path) -> None:
    """Inside the set's own folder, only what participants write (manifests, records files,
    their temporary files) goes: a file someone added, and whatever a symlink points at, stay."""
    root = tmp_path / "volume"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.bin").write_text("keep me\n")
    obj = set_object("team-a", "0b9e1f7c-aaaa-4c1e-9d55-000000000001", root)
    plane = ControlPlane(FakeParticipant(rollouts=["a1"]), pod_settings(obj, root))
    async with serve(plane) as client:
        committed = await checkpoint(client, "c1")
    instance_dir = (root / committed["manifest_path"]).parent
    (instance_dir / "added-by-a-person.txt").write_text("mine\n")
    (instance_dir.parent / "link-out").symlink_to(elsewhere)

    notes: list[Note] = []
    outcome = await set_deleted(
        set_cluster(obj).kube(), obj, locator=LOCATOR, on_note=collect(notes)
    )

    assert (instance_dir / "added-by-a-person.txt").read_text() == "mine\n"
    assert [n.reason for n in notes] == ["RecordsNotRemoved"], "one Warning naming what stays"
    assert "added-by-a-person.txt" in notes[0].message
    assert "kept" in outcome, outcome
    assert not (instance_dir / "manifest.json").exists(), "its own records go"
    assert (elsewhere / "precious.bin").read_text() == "keep me\n"


async def test_a_symlinked_set_folder_does_not_lead_cleanup_into_another_set(
    tmp_path: Path,
) -> None:
    """A participant of team-b (it can write the shared volume) replaces its set's folder with
    a symlink to team-a's: deleting team-b's checkpoint must not remove team-a's records."""
    root = tmp_path / "volume"
    root.mkdir()
    team_a = set_object("team-a", "0b9e1f7c-aaaa-4c1e-9d55-000000000001", root)
    team_b = set_object("team-b", "0b9e1f7c-bbbb-4c1e-9d55-000000000002", root)
    plane = ControlPlane(FakeParticipant(rollouts=["a1"]), pod_settings(team_a, root))
    async with serve(plane) as client:
        committed = await checkpoint(client, "c1")
    set_a = (root / committed["manifest_path"]).parents[2]
    set_b = root / str(pod_settings(team_b, root).set_dir)
    set_b.parent.mkdir(parents=True)
    set_b.symlink_to(set_a)

    cluster_b = set_cluster(team_b, ["c1"])
    kube_b = cluster_b.kube()
    c1 = cluster_b.get(ROLLOUT_CHECKPOINT_PLURAL, "team-b", "c1")
    assert c1 is not None
    await checkpoint_deleted(kube_b, c1, locator=LOCATOR)
    cluster_b.remove(ROLLOUT_CHECKPOINT_PLURAL, "team-b", "c1")  # its finalizer is done
    await set_deleted(kube_b, team_b, locator=LOCATOR)

    assert await _restored(team_a, root, "c1") == ["a1"]


@pytest.mark.parametrize("path", list(BAD_PATHS.values()), ids=list(BAD_PATHS))
def test_storage_paths_that_cannot_be_right_are_refused_by_the_models(path: str) -> None:
    obj = set_object("team-a", "0b9e1f7c-aaaa-4c1e-9d55-000000000001", Path("/srv/ckpt"))
    obj["spec"]["storage"]["path"] = path
    with pytest.raises(ValidationError, match=r"storage\.path must be"):
        api.RolloutSet.model_validate(obj)


@pytest.mark.parametrize(
    "path", ["/checkpoints", "/tmp/rollout-checkpoints", "/var/lib/ckpt", "/mnt/ckpt", "/data"]
)
def test_storage_paths_that_are_fine_are_accepted(path: str) -> None:
    obj = set_object("team-a", "0b9e1f7c-aaaa-4c1e-9d55-000000000001", Path("/srv/ckpt"))
    obj["spec"]["storage"]["path"] = path
    assert api.RolloutSet.model_validate(obj).spec.storage.path == path
