"""Failure-mode classes 2 and 3 (docs/operations.md#failure-modes) where the logic is pure, and the
smaller things on the way.

- status repair: a published checkpoint is recognised from its manifests on storage, and only a
  complete, fresh set of them counts;
- bounds: Kopf's diff-base stays small for a large spec; replicas over the install's limit, a
  template over `MAX_TEMPLATE_BYTES` and a reference environment without its agent are refused
  before any pod exists (the custom environment example, which calls only the model, stays valid);
- a template volume with the reserved name is reported; an invalid trainer-step annotation is
  logged once, not on every pass.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from rollout_operator.cluster.storage import StorageLocator
from rollout_operator.decide.policy.views import checkpoint_views
from rollout_operator.decide.resources import STORAGE_VOLUME_NAME, reserved_volume_notes
from rollout_operator.decide.setstatus import latest_repair
from rollout_operator.flows.checkpointrepairs import (
    completed_on_storage,
    published_manifests,
    records_proven,
    repair_failed_checkpoint,
)
from rollout_operator.flows.setpass import missing_peers, spec_over_limits
from rollout_operator.model import api
from rollout_operator.model.settings import MAX_DIFFBASE_FIELD_BYTES, compact_essence
from rollout_protocol import ControlPlane
from shared import checkpoint, pod_settings, serve, set_object
from testsupport import builders
from testsupport.fakecluster import FakeCluster
from testsupport.participants import FakeParticipant
from testsupport.policy import Run, rollout_set, seeded

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
UID = "0b9e1f7c-aaaa-4c1e-9d55-000000000001"


def _set(obj: dict[str, Any]) -> api.RolloutSet:
    return api.RolloutSet.model_validate(obj)


async def _published(root: Path, obj: dict[str, Any], checkpoint_id: str) -> None:
    plane = ControlPlane(FakeParticipant(rollouts=["r1"]), pod_settings(obj, root))
    async with serve(plane) as client:
        await checkpoint(client, checkpoint_id)


async def test_the_manifests_of_a_published_checkpoint_prove_it_was_published(
    tmp_path: Path,
) -> None:
    obj = set_object("team-a", UID, tmp_path)
    await _published(tmp_path, obj, "c1")
    created = datetime.now(UTC) - timedelta(minutes=1)
    found = published_manifests(tmp_path, _set(obj), "c1", created)
    assert found is not None
    assert sorted(found) == ["environment-0"]
    assert found["environment-0"][1].record_count == 1


async def test_records_older_than_the_checkpoint_object_prove_nothing(tmp_path: Path) -> None:
    """A checkpoint created again under an old name finds the old object's records: they are
    not its own, and it runs instead of being taken for published."""
    obj = set_object("team-a", UID, tmp_path)
    await _published(tmp_path, obj, "c1")
    later = datetime.now(UTC) + timedelta(minutes=1)
    assert published_manifests(tmp_path, _set(obj), "c1", later) is None


async def test_a_checkpoint_with_a_missing_participant_manifest_is_not_published(
    tmp_path: Path,
) -> None:
    obj = set_object("team-a", UID, tmp_path)
    await _published(tmp_path, obj, "c1")
    obj["spec"]["participants"][0]["replicas"] = 2  # environment-1 never committed
    assert published_manifests(tmp_path, _set(obj), "c1", None) is None
    assert published_manifests(tmp_path, _set(obj), "other", None) is None


async def test_a_failed_checkpoints_records_are_proven_only_when_they_verify(
    tmp_path: Path,
) -> None:
    """What keeps the records of a checkpoint whose status says Failed: every participant's
    manifest and records, verified as a restore verifies them. Records altered on storage prove
    nothing (a corrupt checkpoint's records are still removed as garbage)."""
    obj = set_object("team-a", UID, tmp_path)
    await _published(tmp_path, obj, "c1")
    created = datetime.now(UTC) - timedelta(minutes=1)
    assert completed_on_storage(tmp_path, _set(obj), "c1", created) is not None
    proof = records_proven(tmp_path, _set(obj), "c1", created)
    assert proof is not None
    assert "1 participant manifests and records" in proof
    found = published_manifests(tmp_path, _set(obj), "c1", created)
    assert found is not None
    path, manifest = found["environment-0"]
    records = path.parent / manifest.records_file
    stat = records.stat()
    records.write_bytes(records.read_bytes().replace(b"r1", b"r9"))  # same size, other digest
    os.utime(records, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert completed_on_storage(tmp_path, _set(obj), "c1", created) is None
    assert records_proven(tmp_path, _set(obj), "c1", created) is None


@pytest.mark.parametrize(
    ("reason", "repaired"),
    [
        ("CommitFailed", True),
        (api.RestoreVerdict.RECORDS_INVALID.value, False),
        (api.RestoreVerdict.RECORDS_UNREACHABLE.value, False),
    ],
)
async def test_a_failed_checkpoint_whose_records_verify_is_ready_again_unless_a_restore_refused_it(
    tmp_path: Path, reason: str, repaired: bool
) -> None:
    """Status that says Failed while every record verifies is repaired to Ready; the recovery's
    own verdicts are not: records a restoring participant found damaged, or could not find on
    the storage it mounts (`RecordsUnreachable`), stay unrestorable even where the operator
    sees them verify (the restoring pods may not; a recovery would try them again)."""
    obj = set_object("team-a", UID, tmp_path)
    await _published(tmp_path, obj, "c1")
    at = (datetime.now(UTC) - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    raw = builders.checkpoint_body(
        "c1",
        set_name="math",
        namespace="team-a",
        generation=1,
        created=at,
        status=builders.checkpoint_status("Failed", at=at, type_="Failed", reason=reason),
    )
    cluster = FakeCluster()
    cluster.put(obj)
    cluster.put(raw)
    repair = await repair_failed_checkpoint(
        cluster.kube(), _set(obj), raw, locator=StorageLocator()
    )
    stored = cluster.get(api.ROLLOUT_CHECKPOINT_PLURAL, "team-a", "c1")
    assert stored is not None
    if repaired:
        assert repair is not None
        assert stored["status"]["phase"] == "Ready"
    else:
        assert repair is None
        assert stored["status"]["phase"] == "Failed"


def test_kopfs_diff_base_of_a_large_spec_stays_small_and_still_shows_changes() -> None:
    big = {"spec": {"participants": ["x" * 300_000], "suspend": False}, "metadata": {}}
    compact = compact_essence(big)
    assert len(json.dumps(compact)) < 4 * MAX_DIFFBASE_FIELD_BYTES
    assert compact["spec"]["suspend"] is False  # small fields stay readable
    changed = compact_essence({"spec": {"participants": ["y" * 300_000], "suspend": False}})
    assert changed["spec"]["participants"] != compact["spec"]["participants"]
    small = {"spec": {"participants": ["a"]}}
    assert compact_essence(small) == small


def test_ten_thousand_replicas_are_refused_by_the_models(tmp_path: Path) -> None:
    obj = set_object("team-a", UID, tmp_path)
    obj["spec"]["participants"][0]["replicas"] = 10000
    with pytest.raises(ValidationError, match="less than or equal to 1024"):
        _set(obj)


def test_replicas_over_the_install_limit_are_refused_before_any_pod(tmp_path: Path) -> None:
    obj = set_object("team-a", UID, tmp_path)
    obj["spec"]["participants"][0]["replicas"] = 300
    refused = spec_over_limits(_set(obj), 256)
    assert refused is not None
    assert refused.reason == "ReplicasOverLimit"
    assert "300" in refused.message
    assert "256" in refused.message
    assert spec_over_limits(_set(obj), 300) is None


def test_a_template_larger_than_the_bound_is_refused(tmp_path: Path) -> None:
    obj = set_object("team-a", UID, tmp_path)
    container = obj["spec"]["participants"][0]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "BIG", "value": "x" * api.MAX_TEMPLATE_BYTES}]
    refused = spec_over_limits(_set(obj), 256)
    assert refused is not None
    assert refused.reason == "TemplateTooLarge"


def _example(path: Path, storage: Path) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(path.read_text())
    obj["metadata"].update(namespace="team-a", uid=UID, generation=1)
    obj["spec"]["storage"] = {
        "path": "/checkpoints",
        "volume": {"hostPath": {"path": str(storage)}},
    }
    return obj


def test_a_reference_environment_without_its_agent_is_refused(tmp_path: Path) -> None:
    obj = _example(EXAMPLES / "rolloutset.yaml", tmp_path)
    assert missing_peers(_set(obj)) is None
    obj["spec"]["participants"] = [p for p in obj["spec"]["participants"] if p["role"] != "agent"]
    refused = missing_peers(_set(obj))
    assert refused is not None
    assert refused.reason == "MissingParticipant"
    assert "no agent" in refused.message


def test_the_custom_environment_that_calls_only_the_model_stays_valid(tmp_path: Path) -> None:
    obj = _example(EXAMPLES / "custom-environment" / "rolloutset.yaml", tmp_path)
    assert {p["role"] for p in obj["spec"]["participants"]} == {"environment", "model"}
    assert missing_peers(_set(obj)) is None


def test_a_template_volume_with_the_reserved_name_is_reported(tmp_path: Path) -> None:
    obj = set_object("team-a", UID, tmp_path)
    template_spec = obj["spec"]["participants"][0]["template"]["spec"]
    assert reserved_volume_notes(_set(obj)) == []
    template_spec["volumes"] = [{"name": STORAGE_VOLUME_NAME, "emptyDir": {}}]
    notes = reserved_volume_notes(_set(obj))
    assert len(notes) == 1
    assert STORAGE_VOLUME_NAME in notes[0]
    assert "environment" in notes[0]


async def test_an_invalid_trainer_step_is_logged_once_not_on_every_pass(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    body = rollout_set(tmp_path)
    body["metadata"]["annotations"] = {api.ANNOTATION_TRAINER_STEP: "step-twelve-once"}
    run = Run(seeded(body), tmp_path)
    with caplog.at_level(logging.INFO, logger="rollout_operator.flows.policypass"):
        for _ in range(3):
            await run()
    logged = [r for r in caplog.records if "step-twelve-once" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert len(run.notes) == 3  # the Event sink still sees each pass (it deduplicates itself)


def _view(name: str, phase: str | None, completed: int, set_name: str = "math") -> dict[str, Any]:
    """A RolloutCheckpoint as the API server returns it (wire form)."""
    at = (datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=completed)).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    status: dict[str, Any] = {}
    if phase is not None:
        done = at if phase == "Ready" else None
        status = builders.checkpoint_status(phase, at=at, completed=done, reason="X")
    return builders.checkpoint_body(name, set_name=set_name, created=at, status=status)


def _latest_of(latest: str | None, *raw: dict[str, Any]) -> dict[str, Any] | None:
    obj = set_object("ns", UID, Path("/checkpoints"))
    obj["status"] = {"latestCheckpoint": latest}
    repaired = latest_repair(_set(obj), checkpoint_views(raw))
    return None if repaired is None else repaired.patch


@pytest.mark.parametrize(
    ("written", "why"),
    [
        ("gone", "no RolloutCheckpoint gone"),  # a name that does not exist
        ("other-sets", "no RolloutCheckpoint other-sets"),  # one of another set
        ("failed", "is not Ready"),
        ("older", "is Ready and newer than older"),
        (None, "unset while newest is Ready"),
    ],
)
def test_a_written_latest_checkpoint_is_repaired_to_the_newest_ready_one(
    written: str | None, why: str
) -> None:
    """`status.latestCheckpoint` is what a recovery restores: a name written by hand that
    contradicts the set's checkpoints is written back, never restored (a checkpoint of another
    set would have been marked invalid by the restore that failed on it)."""
    views = [
        _view("older", "Ready", 1),
        _view("newest", "Ready", 5),
        _view("failed", "Failed", 7),
        _view("other-sets", "Ready", 9, set_name="another"),
    ]
    obj = set_object("ns", UID, Path("/checkpoints"))
    obj["status"] = {"latestCheckpoint": written}
    mine = [v for v in views if v["spec"]["rolloutSet"] == obj["metadata"]["name"]]
    repaired = latest_repair(_set(obj), checkpoint_views(mine))
    assert repaired is not None
    assert repaired.reason == "StatusRepaired"
    assert why in repaired.message, repaired.message
    assert repaired.patch == {
        "latestCheckpoint": "newest",
        "latestCheckpointTime": "2026-01-01T00:05:00Z",
    }


def test_a_latest_checkpoint_that_agrees_or_is_being_published_is_left_alone() -> None:
    assert _latest_of("newest", _view("older", "Ready", 1), _view("newest", "Ready", 5)) is None
    # the flow points the set at its checkpoint while it resumes, before the phase is Ready
    assert _latest_of("next", _view("newest", "Ready", 5), _view("next", "Resuming", 6)) is None
    assert _latest_of(None, _view("failed", "Failed", 1)) is None
    # a reset status: the checkpoint's own daemon repairs it to Ready (or runs it) first
    assert _latest_of("reset", _view("newest", "Ready", 5), _view("reset", None, 6)) is None
    assert _latest_of("gone") == {"latestCheckpoint": None, "latestCheckpointTime": None}
