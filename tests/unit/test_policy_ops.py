"""The checkpoint policy carried out against an in-memory API: what is created, written, deleted
and removed from storage, and in which order (the order is what makes a crash harmless)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from rollout_operator.cluster.kube import Conflict, Kube
from rollout_operator.cluster.objects import eviction_holds
from rollout_operator.cluster.storage import StorageLocator
from rollout_operator.decide.policy import ANNOTATION_DEADLINE_OUTCOME, Note, Reason
from rollout_operator.flows.policypass import (
    CheckpointBusy,
    PolicyPass,
    checkpoint_deleted,
    set_deleted,
    start_eviction_checkpoint,
)
from rollout_operator.model import api

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
NS = "team"


def stamp(seconds: float) -> str:
    return api.format_time(T0 + timedelta(seconds=seconds))


def not_found() -> ApiException:
    return ApiException(status=404, reason="Not Found")


class FakeApi:
    """Just enough of `Kube` (and its CustomObjectsApi) for the policy; every write journaled."""

    def __init__(self, rset: dict[str, Any]) -> None:
        self.set: dict[str, Any] | None = rset
        self.version = 1
        self.pods: dict[str, dict[str, Any]] = {}
        self.checkpoints: dict[str, dict[str, Any]] = {}
        self.journal: list[str] = []
        self.conflict_next_write = False
        self.custom = self

    def as_kube(self) -> Kube:
        return cast(Kube, self)

    # --- the set ----------------------------------------------------------------------------

    async def get_set(
        self, namespace: str, name: str, *, fresh: bool = False
    ) -> dict[str, Any] | None:
        if self.set is None:
            return None
        obj = copy.deepcopy(self.set)
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    async def patch_set_status(
        self, namespace: str, name: str, status: dict[str, Any], *, resource_version: str | None
    ) -> dict[str, Any]:
        assert self.set is not None
        if self.conflict_next_write or resource_version not in (None, str(self.version)):
            self.conflict_next_write = False
            raise Conflict("the object has been modified")
        self.journal.append(f"status {sorted(status)}")
        for key, value in status.items():
            if value is None:
                self.set.setdefault("status", {}).pop(key, None)
            else:
                self.set.setdefault("status", {})[key] = copy.deepcopy(value)
        self.version += 1
        return copy.deepcopy(self.set)

    async def patch_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, body: Any, **_: Any
    ) -> Any:
        assert plural == api.ROLLOUT_SET_PLURAL
        assert self.set is not None
        annotations = body["metadata"]["annotations"]
        self.journal.append(f"annotate {sorted(annotations)}")
        self.set["metadata"].setdefault("annotations", {}).update(annotations)
        self.version += 1
        return {"metadata": {"resourceVersion": str(self.version)}}

    # --- pods ---------------------------------------------------------------------------------

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(p) for p in self.pods.values()]

    async def delete_pod(
        self, namespace: str, name: str, *, grace_seconds: int | None = None
    ) -> bool:
        self.journal.append(f"delete pod {name}")
        return self.pods.pop(name, None) is not None

    def add_pod(self, name: str, attempt: int = 3, **meta: Any) -> None:
        self.pods[name] = {
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": {api.LABEL_SET: "math", api.LABEL_ATTEMPT: str(attempt)},
                **meta,
            },
            "status": {"phase": "Running"},
        }

    # --- checkpoints --------------------------------------------------------------------------

    async def list_checkpoints(self, namespace: str, set_name: str) -> list[dict[str, Any]]:
        """`Kube.list_checkpoints`: the set's checkpoints, by `spec.rolloutSet`."""
        return [
            copy.deepcopy(c)
            for c in self.checkpoints.values()
            if (c.get("spec") or {}).get("rolloutSet") == set_name
        ]

    async def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.checkpoints[name]) if name in self.checkpoints else None

    async def create_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if name in self.checkpoints:
            raise ApiException(status=409, reason="Conflict")
        self.journal.append(f"create {name}")
        obj = copy.deepcopy(body)
        obj["metadata"]["creationTimestamp"] = stamp(len(self.checkpoints))
        self.checkpoints[name] = obj
        return obj

    async def delete_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any]:
        if name not in self.checkpoints:
            raise not_found()
        self.journal.append(f"delete {name}")
        del self.checkpoints[name]
        return {}

    def add_checkpoint(
        self, name: str, created: float, *, outcome: str | None = None, completed: float = 0
    ) -> None:
        status: dict[str, Any] = {}
        if outcome is not None:
            status = {
                "phase": outcome,
                "completedAt": stamp(completed),
                "conditions": [
                    {
                        "type": outcome,
                        "status": "True",
                        "reason": "Published" if outcome == "Ready" else "PrepareTimeout",
                        "lastTransitionTime": stamp(completed),
                    }
                ],
            }
        self.checkpoints[name] = {
            "metadata": {"name": name, "namespace": NS, "creationTimestamp": stamp(created)},
            "spec": {"rolloutSet": "math", "trigger": "Manual"},
            "status": status,
        }
        if outcome == "Ready" and self.set is not None:
            # As the set's pass does once a checkpoint is Ready: the set's latestCheckpoint
            # names the newest Ready checkpoint (setstatus.checkpoint_fields).
            ready = [
                (c["status"]["completedAt"], c["metadata"]["creationTimestamp"], n)
                for n, c in self.checkpoints.items()
                if c["status"].get("phase") == "Ready"
            ]
            completed_at, _, newest = max(ready)
            self.set["status"]["latestCheckpoint"] = newest
            self.set["status"]["latestCheckpointTime"] = completed_at

    def condition(self, type_: str) -> dict[str, Any]:
        assert self.set is not None
        return next(c for c in self.set["status"]["conditions"] if c["type"] == type_)


def rollout_set(storage: Path, **spec: Any) -> dict[str, Any]:
    container = {"name": "c", "ports": [{"name": "control", "containerPort": 8000}]}
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutSet",
        "metadata": {"name": "math", "namespace": NS, "uid": "uid-1", "generation": 1},
        "spec": {
            "participants": [
                {"role": "environment", "template": {"spec": {"containers": [container]}}}
            ],
            "storage": {"path": str(storage), "volume": {"hostPath": {"path": str(storage)}}},
            **spec,
        },
        "status": {
            "attempt": 3,
            "createdAttempt": 3,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "AllParticipantsReady",
                    "lastTransitionTime": stamp(0),
                }
            ],
        },
    }


SET_DIR = f"{NS}/math/uid-1"
"""The set's directory on its volume (`resources.set_dir`)."""


def records(root: Path, checkpoint: str) -> Path:
    folder = root / SET_DIR / checkpoint / "environment-0"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    return folder.parent


class Run:
    """A `PolicyPass` at a fixed time, with its notes and set wakes collected."""

    def __init__(self, fake: FakeApi, storage: Path) -> None:
        self.fake = fake
        self.now = T0 + timedelta(seconds=100)
        self.notes: list[Note] = []
        self.woken: list[tuple[str, str]] = []
        self.storage = storage

    async def __call__(self) -> Any:
        async def note(_rset: api.RolloutSet, found: Note) -> None:
            self.notes.append(found)

        return await PolicyPass(
            self.fake.as_kube(),
            clock=lambda: self.now,
            on_note=note,
            wake_set=lambda ns, name: self.woken.append((ns, name)),
            locator=StorageLocator(None),
        ).run(NS, "math")


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    return tmp_path


async def test_a_trainer_step_creates_an_owned_checkpoint_and_records_the_step(
    storage: Path,
) -> None:
    body = rollout_set(storage)
    body["metadata"]["annotations"] = {api.ANNOTATION_TRAINER_STEP: "5"}
    fake = FakeApi(body)
    run = Run(fake, storage)
    await run()
    created = fake.checkpoints["math-step-5"]
    assert created["spec"] == {
        "rolloutSet": "math",
        "trigger": "TrainerCheckpoint",
        "trainerStep": 5,
    }
    assert created["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert created["metadata"]["labels"] == {api.LABEL_SET: "math"}
    assert "step 5" in created["metadata"]["annotations"]["checkpoint.rollout.dev/why"]
    assert fake.journal == [
        "create math-step-5",
        "status ['lastTrainerStep', 'saveReserveSeconds']",
    ]
    assert fake.set is not None
    assert fake.set["status"]["saveReserveSeconds"] == 60
    fake.journal.clear()
    await run()
    assert fake.journal == []  # decided once: nothing created or written again


async def test_suspend_marks_suspended_before_it_deletes_the_pods(storage: Path) -> None:
    fake = FakeApi(rollout_set(storage, suspend=True))
    fake.add_pod("math-environment-0-a3")
    run = Run(fake, storage)
    await run()
    assert "create math-suspend-a3" in fake.journal
    assert fake.condition("Suspended")["reason"] == Reason.SUSPENDING
    assert fake.pods  # nothing released before the checkpoint finished
    fake.add_checkpoint("math-suspend-a3", 1, outcome="Ready", completed=3)
    fake.journal.clear()
    await run()
    assert fake.journal == [
        "status ['conditions']",
        "delete pod math-environment-0-a3",
    ]
    suspended = fake.condition("Suspended")
    assert suspended["status"] == "True"
    assert "math-suspend-a3 holds the state" in suspended["message"]


async def test_resume_starts_a_recovery_to_the_next_attempt(storage: Path) -> None:
    body = rollout_set(storage)
    body["status"]["conditions"].append(
        {
            "type": "Suspended",
            "status": "True",
            "reason": "Suspended",
            "lastTransitionTime": stamp(0),
        }
    )
    fake = FakeApi(body)
    run = Run(fake, storage)
    await run()
    assert fake.set is not None
    recovery = fake.set["status"]["recovery"]
    assert (recovery["fromAttempt"], recovery["targetAttempt"]) == (3, 4)
    assert recovery["phase"] == "StoppingAttempt"
    assert recovery["reason"] == "Resumed"
    assert fake.condition("Suspended")["status"] == "False"
    assert fake.condition("Recovering")["status"] == "True"
    assert run.woken == [(NS, "math")]


async def test_a_settled_deadline_is_recorded_before_the_pods_are_released(
    storage: Path,
) -> None:
    policy = {"mustSaveBy": stamp(200), "afterDeadline": "Suspend"}
    fake = FakeApi(rollout_set(storage, checkpointPolicy=policy))
    fake.set["status"]["recentCheckpointSeconds"] = [4.0]  # type: ignore[index]
    fake.add_pod("math-environment-0-a3")
    fake.add_checkpoint("math-manual", 190, outcome="Ready", completed=195)
    run = Run(fake, storage)
    run.now = T0 + timedelta(seconds=196)
    await run()
    assert fake.journal == [
        f"annotate ['{ANNOTATION_DEADLINE_OUTCOME}']",
        "status ['conditions', 'saveReserveSeconds']",
        "delete pod math-environment-0-a3",
    ]
    assert fake.condition("DeadlineSaved")["reason"] == Reason.SAVED
    assert fake.condition("Suspended")["reason"] == Reason.DEADLINE_REACHED


async def test_a_lost_status_race_asks_for_another_pass(storage: Path) -> None:
    fake = FakeApi(rollout_set(storage))
    fake.conflict_next_write = True
    outcome = await Run(fake, storage)()
    assert outcome.again


async def test_retention_deletes_old_checkpoints_and_failed_records_leave_storage(
    storage: Path,
) -> None:
    fake = FakeApi(rollout_set(storage, checkpointPolicy={"keepLatest": 1}))
    fake.set["status"]["latestCheckpoint"] = "new"  # type: ignore[index]
    fake.add_checkpoint("old", 1, outcome="Ready", completed=2)
    fake.add_checkpoint("new", 3, outcome="Ready", completed=4)
    fake.add_checkpoint("broken", 5, outcome="Failed", completed=6)
    failed = records(storage, "broken")
    kept = records(storage, "new")
    await Run(fake, storage)()
    assert "delete old" in fake.journal
    assert "new" in fake.checkpoints
    assert not failed.exists()
    assert kept.exists()


async def test_the_finalizer_removes_records_and_leaves_latest_to_the_sets_pass(
    storage: Path,
) -> None:
    """The set's pass is the one writer of `latestCheckpoint` (it moves off a deleting
    checkpoint, test_set_status); the finalizer only removes the records."""
    fake = FakeApi(rollout_set(storage))
    fake.set["status"]["latestCheckpoint"] = "new"  # type: ignore[index]
    fake.add_checkpoint("old", 1, outcome="Ready", completed=2)
    fake.add_checkpoint("new", 3, outcome="Ready", completed=4)
    folder = records(storage, "new")
    before = copy.deepcopy(fake.set)
    outcome = await checkpoint_deleted(
        fake.as_kube(), fake.checkpoints["new"], locator=StorageLocator(None)
    )
    assert "removed" in outcome
    assert not folder.exists()
    assert fake.set == before


async def test_the_finalizer_waits_while_a_recovery_restores_the_checkpoint(storage: Path) -> None:
    fake = FakeApi(rollout_set(storage))
    fake.set["status"]["recovery"] = {  # type: ignore[index]
        "phase": "Restoring",
        "fromAttempt": 3,
        "targetAttempt": 4,
        "startedAt": stamp(0),
        "checkpoint": "new",
    }
    fake.add_checkpoint("new", 3, outcome="Ready", completed=4)
    with pytest.raises(CheckpointBusy):
        await checkpoint_deleted(
            fake.as_kube(), fake.checkpoints["new"], locator=StorageLocator(None)
        )


async def test_records_the_operator_cannot_reach_are_reported_not_blocking(tmp_path: Path) -> None:
    body = rollout_set(tmp_path)
    body["spec"]["storage"]["volume"] = {"persistentVolumeClaim": {"claimName": "ckpt"}}
    fake = FakeApi(body)
    fake.add_checkpoint("new", 3, outcome="Ready", completed=4)
    notes: list[Note] = []

    async def note(_rset: api.RolloutSet, found: Note) -> None:
        notes.append(found)

    outcome = await checkpoint_deleted(
        fake.as_kube(),
        fake.checkpoints["new"],
        locator=StorageLocator(tmp_path / "claims"),
        on_note=note,
    )
    assert "not removed" in outcome
    assert notes[0].reason == "RecordsNotRemoved"
    assert notes[0].warning
    assert f"{tmp_path / 'claims'}/{NS}/ckpt" in notes[0].message


def test_claims_are_found_under_the_operators_storage_dir(tmp_path: Path) -> None:
    claim = tmp_path / NS / "ckpt"
    claim.mkdir(parents=True)
    spec = api.StorageSpec(path="/ckpt", volume={"persistentVolumeClaim": {"claimName": "ckpt"}})
    assert StorageLocator(tmp_path).root(NS, spec) == claim
    assert StorageLocator(tmp_path).root("other", spec) is None
    env = StorageLocator.from_env({"ROLLOUT_OPERATOR_STORAGE_DIR": str(tmp_path)})
    assert env.claims_dir == tmp_path


async def test_deleting_a_set_deletes_its_checkpoints_then_sweeps_its_folder(
    storage: Path,
) -> None:
    body = rollout_set(storage)
    fake = FakeApi(body)
    fake.add_checkpoint("a", 1, outcome="Ready", completed=2)
    records(storage, "orphan")
    with pytest.raises(CheckpointBusy):
        await set_deleted(fake.as_kube(), body, locator=StorageLocator(None))
    assert fake.checkpoints == {}
    outcome = await set_deleted(fake.as_kube(), body, locator=StorageLocator(None))
    assert "removed" in outcome
    assert not (storage / NS).exists(), "the set's folder and its empty parents go"


async def test_an_evicted_pod_gets_a_checkpoint_and_holds_the_recovery(storage: Path) -> None:
    fake = FakeApi(rollout_set(storage))
    fake.add_pod("math-model-0-a3", deletionTimestamp=stamp(120), deletionGracePeriodSeconds=20)
    now = T0 + timedelta(seconds=100)
    pod = fake.pods["math-model-0-a3"]
    assert await start_eviction_checkpoint(fake.as_kube(), pod, clock=lambda: now) == (
        "math-evict-a3"
    )
    assert fake.checkpoints["math-evict-a3"]["spec"]["trigger"] == "Eviction"
    assert await start_eviction_checkpoint(fake.as_kube(), pod, clock=lambda: now) is None
    rset = api.RolloutSet.model_validate(await fake.get_set(NS, "math"))
    assert await eviction_holds(fake.as_kube(), rset, clock=lambda: now) == {"math-model-0-a3"}
    fake.add_checkpoint("math-evict-a3", 1, outcome="Ready", completed=5)
    assert await eviction_holds(fake.as_kube(), rset, clock=lambda: now) == frozenset()


async def test_pods_deleted_by_a_suspend_are_not_evictions(storage: Path) -> None:
    fake = FakeApi(rollout_set(storage, suspend=True))
    fake.add_pod("math-model-0-a3", deletionTimestamp=stamp(120), deletionGracePeriodSeconds=30)
    now = T0 + timedelta(seconds=100)
    pod = fake.pods["math-model-0-a3"]
    assert await start_eviction_checkpoint(fake.as_kube(), pod, clock=lambda: now) is None
    assert fake.checkpoints == {}
