"""The checkpoint policy carried out against an in-memory API server (`FakeCluster`, below the
operator's real client): what is created, written, deleted and removed from storage, and in
which order (the order is what makes a crash harmless)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from rollout_operator.cluster.objects import eviction_holds
from rollout_operator.cluster.storage import StorageLocator
from rollout_operator.decide.policy.suspend import resume_due
from rollout_operator.decide.policy.views import ANNOTATION_DEADLINE_OUTCOME, Note
from rollout_operator.flows.policypass import (
    CheckpointBusy,
    checkpoint_deleted,
    keep_records_finalizer,
    release_deleted_checkpoint,
    set_deleted,
    start_eviction_checkpoint,
)
from rollout_operator.model import api
from rollout_operator.model.reasons import Reason
from testsupport import builders
from testsupport.fakecluster import FakeCluster
from testsupport.policy import NS, T0, Run, rollout_set, seeded, stamp
from testsupport.recovery import start_resume_written


class Sent:
    """The writes the operator sent to the fake API server, in words, in order: every one it
    sent, refused or not (a create answered "exists" counts too). Reads are left out: the
    watches answer them."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.since = 0

    def clear(self) -> None:
        self.since = len(self.cluster.requests)

    def __call__(self) -> list[str]:
        said = []
        for r in self.cluster.requests[self.since :]:
            body: dict[str, Any] = dict(r.body or {})
            if r.verb in ("get", "list"):
                continue
            if r.verb == "create" and r.plural == api.ROLLOUT_CHECKPOINT_PLURAL:
                said.append(f"create {body['metadata']['name']}")
            elif r.verb == "patch" and r.plural == api.ROLLOUT_SET_PLURAL:
                if r.subresource == "status":
                    said.append(f"status {sorted(body['status'])}")
                else:
                    said.append(f"annotate {sorted(body['metadata']['annotations'])}")
            elif r.verb == "delete" and r.plural == "pods":
                said.append(f"delete pod {r.name}")
            elif r.verb == "delete" and r.plural == api.ROLLOUT_CHECKPOINT_PLURAL:
                said.append(f"delete {r.name}")
            else:
                said.append(f"{r.verb} {r.plural}/{r.name}")
        return said


def add_pod(cluster: FakeCluster, name: str, attempt: int = 3, **meta: Any) -> dict[str, Any]:
    return cluster.put(
        {
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": {api.LABEL_SET: "math", api.LABEL_ATTEMPT: str(attempt)},
                **meta,
            },
            "status": {"phase": "Running"},
        }
    )


def add_checkpoint(
    cluster: FakeCluster,
    name: str,
    created: float,
    *,
    outcome: str | None = None,
    completed: float = 0,
) -> dict[str, Any]:
    """A checkpoint as it stands once done (it replaces one of that name)."""
    status: dict[str, Any] = {}
    if outcome is not None:
        status = builders.checkpoint_status(
            outcome,
            at=stamp(completed),
            completed=stamp(completed),
            type_=outcome,
            reason="Published" if outcome == "Ready" else "PrepareTimeout",
        )
    stored = cluster.put(
        builders.checkpoint_body(
            name, set_name="math", namespace=NS, created=stamp(created), status=status
        )
    )
    if outcome == "Ready" and cluster.get(api.ROLLOUT_SET_PLURAL, NS, "math") is not None:
        # As the set's pass does once a checkpoint is Ready: the set's latestCheckpoint
        # names the newest Ready checkpoint (setstatus.checkpoint_fields).
        ready = [
            (c["status"]["completedAt"], c["metadata"]["creationTimestamp"], c["metadata"]["name"])
            for c in cluster.list_objects(api.ROLLOUT_CHECKPOINT_PLURAL, NS)
            if c["status"].get("phase") == "Ready"
        ]
        completed_at, _, newest = max(ready)

        def point(rset: dict[str, Any]) -> None:
            rset["status"]["latestCheckpoint"] = newest
            rset["status"]["latestCheckpointTime"] = completed_at

        cluster.update(api.ROLLOUT_SET_PLURAL, NS, "math", point)
    return stored


def stored_set(cluster: FakeCluster) -> dict[str, Any]:
    found = cluster.get(api.ROLLOUT_SET_PLURAL, NS, "math")
    assert found is not None
    return found


def checkpoint(cluster: FakeCluster, name: str) -> dict[str, Any] | None:
    return cluster.get(api.ROLLOUT_CHECKPOINT_PLURAL, NS, name)


def condition(cluster: FakeCluster, type_: str) -> dict[str, Any]:
    return next(c for c in stored_set(cluster)["status"]["conditions"] if c["type"] == type_)


SET_DIR = f"{NS}/math/uid-1"
"""The set's directory on its volume (`resources.set_dir`)."""


def records(root: Path, checkpoint: str) -> Path:
    folder = root / SET_DIR / checkpoint / "environment-0"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    return folder.parent


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    return tmp_path


async def test_a_trainer_step_creates_an_owned_checkpoint_and_records_the_step(
    storage: Path,
) -> None:
    body = rollout_set(storage)
    body["metadata"]["annotations"] = {api.ANNOTATION_TRAINER_STEP: "5"}
    cluster = seeded(body)
    sent = Sent(cluster)
    run = Run(cluster, storage)
    await run()
    created = checkpoint(cluster, "math-step-5")
    assert created is not None
    assert created["spec"] == {
        "rolloutSet": "math",
        "trigger": "TrainerCheckpoint",
        "trainerStep": 5,
    }
    assert created["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert created["metadata"]["labels"] == {api.LABEL_SET: "math"}
    assert created["metadata"]["finalizers"] == [api.RECORDS_FINALIZER], "no patch adds it"
    assert "step 5" in created["metadata"]["annotations"]["checkpoint.rollout.dev/why"]
    assert sent() == [
        "create math-step-5",
        "status ['lastTrainerStep', 'saveReserveSeconds']",
    ]
    assert stored_set(cluster)["status"]["saveReserveSeconds"] == 60
    sent.clear()
    await run()
    assert sent() == []  # decided once: nothing created or written again


async def test_suspend_marks_suspended_before_it_deletes_the_pods(storage: Path) -> None:
    cluster = seeded(rollout_set(storage, suspend=True))
    add_pod(cluster, "math-environment-0-a3")
    sent = Sent(cluster)
    run = Run(cluster, storage)
    await run()
    assert "create math-suspend-a3" in sent()
    assert condition(cluster, "Suspended")["reason"] == Reason.SUSPENDING
    assert cluster.list_objects("pods")  # nothing released before the checkpoint finished
    add_checkpoint(cluster, "math-suspend-a3", 1, outcome="Ready", completed=3)
    sent.clear()
    await run()
    assert sent() == [
        "status ['conditions']",
        "delete pod math-environment-0-a3",
    ]
    suspended = condition(cluster, "Suspended")
    assert suspended["status"] == "True"
    assert "math-suspend-a3 holds the state" in suspended["message"]


async def test_resume_clears_suspended_and_the_sets_loop_starts_the_recovery(
    storage: Path,
) -> None:
    """The policy writes only its own condition and wakes the set's loop; the recovery (the
    one writer of `status.recovery`) starts the resume's recovery to the next attempt."""
    body = rollout_set(storage)
    body["status"]["conditions"].append(
        {
            "type": "Suspended",
            "status": "True",
            "reason": "Suspended",
            "lastTransitionTime": stamp(0),
        }
    )
    body["status"]["recoveryStarts"] = [stamp(-50)]
    cluster = seeded(body)
    run = Run(cluster, storage)
    await run()
    resumed = stored_set(cluster)["status"]
    assert "recovery" not in resumed, "the policy does not write the recovery"
    assert condition(cluster, "Suspended")["status"] == "False"
    assert condition(cluster, "Suspended")["reason"] == "Resumed"
    assert run.woken == [(NS, "math")]

    kube = cluster.kube()
    rset = api.RolloutSet.model_validate(stored_set(cluster))
    assert await start_resume_written(kube, rset, live_pods=0)
    status = stored_set(cluster)["status"]
    recovery = status["recovery"]
    assert (recovery["fromAttempt"], recovery["targetAttempt"]) == (3, 4)
    assert recovery["phase"] == "StoppingAttempt"
    assert recovery["reason"] == "Resumed"
    assert recovery["restorePolicy"] == "Recreate"
    assert condition(cluster, "Recovering")["status"] == "True"
    assert condition(cluster, "Recovering")["reason"] == "Resumed"
    assert status["recoveryStarts"] == [stamp(-50)], "a resume is not a loss: not counted"
    rset = api.RolloutSet.model_validate(stored_set(cluster))
    assert not await start_resume_written(kube, rset, live_pods=0), "once"


def test_a_resume_is_due_once_and_only_without_running_pods(storage: Path) -> None:
    body = rollout_set(storage)
    resumed_at = stamp(10)
    body["status"]["conditions"].append(
        {
            "type": "Suspended",
            "status": "False",
            "reason": "Resumed",
            "lastTransitionTime": resumed_at,
        }
    )
    rset = api.RolloutSet.model_validate(body)
    assert resume_due(rset, live_pods=0)
    assert not resume_due(rset, live_pods=1), "pods still run: the set keeps them"
    never_ran = api.RolloutSet.model_validate(
        {**body, "status": {**body["status"], "createdAttempt": None}}
    )
    assert not resume_due(never_ran, live_pods=0), "a set that never ran just starts"
    suspended_again = api.RolloutSet.model_validate(
        {**body, "spec": {**body["spec"], "suspend": True}}
    )
    assert not resume_due(suspended_again, live_pods=0)
    last = {
        "completedAt": stamp(20),
        "reason": "Resumed",
        "attempt": 4,
        "restorePolicy": "Recreate",
        "kept": 0,
        "replaced": 1,
        "durationSeconds": 5.0,
    }
    done = api.RolloutSet.model_validate(
        {**body, "status": {**body["status"], "lastRecovery": last}}
    )
    assert not resume_due(done, live_pods=0), "a recovery ended after the resume: it ran"
    last_before = {**last, "completedAt": stamp(5), "reason": "PodFailed"}
    before = api.RolloutSet.model_validate(
        {**body, "status": {**body["status"], "lastRecovery": last_before}}
    )
    assert resume_due(before, live_pods=0), "the last recovery ended before the suspend"


async def test_a_settled_deadline_is_recorded_before_the_pods_are_released(
    storage: Path,
) -> None:
    policy = {"mustSaveBy": stamp(200), "afterDeadline": "Suspend"}
    body = rollout_set(storage, checkpointPolicy=policy)
    body["status"]["recentCheckpointSeconds"] = [4.0]
    cluster = seeded(body)
    add_pod(cluster, "math-environment-0-a3")
    add_checkpoint(cluster, "math-manual", 190, outcome="Ready", completed=195)
    sent = Sent(cluster)
    run = Run(cluster, storage)
    run.now = T0 + timedelta(seconds=196)
    await run()
    assert sent() == [
        f"annotate ['{ANNOTATION_DEADLINE_OUTCOME}']",
        "status ['conditions', 'saveReserveSeconds']",
        "delete pod math-environment-0-a3",
    ]
    assert condition(cluster, "DeadlineSaved")["reason"] == Reason.SAVED
    assert condition(cluster, "Suspended")["reason"] == Reason.DEADLINE_REACHED


async def test_a_lost_status_race_asks_for_another_pass(storage: Path) -> None:
    cluster = seeded(rollout_set(storage))
    cluster.refuse(
        "patch", api.ROLLOUT_SET_PLURAL, status=409, message="the object has been modified"
    )
    outcome = await Run(cluster, storage)()
    assert outcome.again


async def test_retention_deletes_old_checkpoints_and_failed_records_leave_storage(
    storage: Path,
) -> None:
    body = rollout_set(storage, checkpointPolicy={"keepLatest": 1})
    body["status"]["latestCheckpoint"] = "new"
    cluster = seeded(body)
    add_checkpoint(cluster, "old", 1, outcome="Ready", completed=2)
    add_checkpoint(cluster, "new", 3, outcome="Ready", completed=4)
    add_checkpoint(cluster, "broken", 5, outcome="Failed", completed=6)
    failed = records(storage, "broken")
    kept = records(storage, "new")
    sent = Sent(cluster)
    await Run(cluster, storage)()
    assert "delete old" in sent()
    assert checkpoint(cluster, "new") is not None
    assert not failed.exists()
    assert kept.exists()


async def test_the_finalizer_removes_records_and_leaves_latest_to_the_sets_pass(
    storage: Path,
) -> None:
    """The set's pass is the one writer of `latestCheckpoint` (it moves off a deleting
    checkpoint, test_set_status); the finalizer only removes the records."""
    body = rollout_set(storage)
    body["status"]["latestCheckpoint"] = "new"
    cluster = seeded(body)
    add_checkpoint(cluster, "old", 1, outcome="Ready", completed=2)
    new = add_checkpoint(cluster, "new", 3, outcome="Ready", completed=4)
    folder = records(storage, "new")
    before = stored_set(cluster)
    outcome = await checkpoint_deleted(cluster.kube(), new, locator=StorageLocator(None))
    assert "removed" in outcome
    assert not folder.exists()
    assert stored_set(cluster) == before


def restoring_new(storage: Path) -> FakeCluster:
    """The set while its recovery restores checkpoint `new`."""
    body = rollout_set(storage)
    body["status"]["recovery"] = {
        "phase": "Restoring",
        "fromAttempt": 3,
        "targetAttempt": 4,
        "startedAt": stamp(0),
        "checkpoint": "new",
    }
    return seeded(body)


async def test_the_finalizer_waits_while_a_recovery_restores_the_checkpoint(storage: Path) -> None:
    cluster = restoring_new(storage)
    new = add_checkpoint(cluster, "new", 3, outcome="Ready", completed=4)
    with pytest.raises(CheckpointBusy):
        await checkpoint_deleted(cluster.kube(), new, locator=StorageLocator(None))


async def test_records_the_operator_cannot_reach_are_reported_not_blocking(tmp_path: Path) -> None:
    body = rollout_set(tmp_path)
    body["spec"]["storage"]["volume"] = {"persistentVolumeClaim": {"claimName": "ckpt"}}
    cluster = seeded(body)
    new = add_checkpoint(cluster, "new", 3, outcome="Ready", completed=4)
    notes: list[Note] = []

    async def note(_rset: api.RolloutSet, found: Note) -> None:
        notes.append(found)

    outcome = await checkpoint_deleted(
        cluster.kube(),
        new,
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
    cluster = seeded(body)
    add_checkpoint(cluster, "a", 1, outcome="Ready", completed=2)
    records(storage, "orphan")
    kube = cluster.kube()
    with pytest.raises(CheckpointBusy):
        await set_deleted(kube, body, locator=StorageLocator(None))
    assert cluster.list_objects(api.ROLLOUT_CHECKPOINT_PLURAL) == []
    outcome = await set_deleted(kube, body, locator=StorageLocator(None))
    assert "removed" in outcome
    assert not (storage / NS).exists(), "the set's folder and its empty parents go"


async def test_an_evicted_pod_gets_a_checkpoint_and_holds_the_recovery(storage: Path) -> None:
    cluster = seeded(rollout_set(storage))
    pod = add_pod(
        cluster, "math-model-0-a3", deletionTimestamp=stamp(120), deletionGracePeriodSeconds=20
    )
    kube = cluster.kube()
    now = T0 + timedelta(seconds=100)
    assert await start_eviction_checkpoint(kube, pod, clock=lambda: now) == "math-evict-a3"
    assert (checkpoint(cluster, "math-evict-a3") or {})["spec"]["trigger"] == "Eviction"
    assert await start_eviction_checkpoint(kube, pod, clock=lambda: now) is None
    rset = api.RolloutSet.model_validate(await kube.get_set(NS, "math"))
    assert await eviction_holds(kube, rset, clock=lambda: now) == {"math-model-0-a3"}
    add_checkpoint(cluster, "math-evict-a3", 1, outcome="Ready", completed=5)
    assert await eviction_holds(kube, rset, clock=lambda: now) == frozenset()


async def test_pods_deleted_by_a_suspend_are_not_evictions(storage: Path) -> None:
    cluster = seeded(rollout_set(storage, suspend=True))
    pod = add_pod(
        cluster, "math-model-0-a3", deletionTimestamp=stamp(120), deletionGracePeriodSeconds=30
    )
    now = T0 + timedelta(seconds=100)
    assert await start_eviction_checkpoint(cluster.kube(), pod, clock=lambda: now) is None
    assert cluster.list_objects(api.ROLLOUT_CHECKPOINT_PLURAL) == []


# --- the records finalizer (the operator's own, not Kopf's) ---------------------------------------


def finalized(cluster: FakeCluster, name: str, finalizers: list[str]) -> dict[str, Any]:
    def mark(obj: dict[str, Any]) -> None:
        obj["metadata"]["finalizers"] = finalizers

    return cluster.update(api.ROLLOUT_CHECKPOINT_PLURAL, NS, name, mark)


def deleting(cluster: FakeCluster, name: str) -> dict[str, Any]:
    def mark(obj: dict[str, Any]) -> None:
        obj["metadata"]["deletionTimestamp"] = stamp(10)

    return cluster.update(api.ROLLOUT_CHECKPOINT_PLURAL, NS, name, mark)


async def test_a_checkpoint_someone_else_created_gets_the_records_finalizer_once(
    storage: Path,
) -> None:
    cluster = seeded(rollout_set(storage))
    add_checkpoint(cluster, "by-hand", 1)
    theirs = finalized(cluster, "by-hand", ["example.com/keep"])
    kube = cluster.kube()
    assert await keep_records_finalizer(kube, theirs)
    stored = checkpoint(cluster, "by-hand")
    assert stored is not None
    assert stored["metadata"]["finalizers"] == ["example.com/keep", api.RECORDS_FINALIZER]
    assert not await keep_records_finalizer(kube, stored), "present: nothing to add"
    assert cluster.count("patch", api.ROLLOUT_CHECKPOINT_PLURAL) == 1


async def test_a_finalizer_added_over_a_stale_version_is_left_to_the_next_event(
    storage: Path,
) -> None:
    """A merge patch replaces the whole list: over a stale version it would drop a finalizer
    someone added meanwhile, so the write carries the version it read and loses the race."""
    cluster = seeded(rollout_set(storage))
    stale = add_checkpoint(cluster, "by-hand", 1)
    finalized(cluster, "by-hand", ["example.com/keep"])
    assert not await keep_records_finalizer(cluster.kube(), stale)
    stored = checkpoint(cluster, "by-hand")
    assert stored is not None
    assert stored["metadata"]["finalizers"] == ["example.com/keep"]


async def test_no_finalizer_is_added_to_a_checkpoint_being_deleted(storage: Path) -> None:
    cluster = seeded(rollout_set(storage))
    add_checkpoint(cluster, "going", 1)
    assert not await keep_records_finalizer(cluster.kube(), deleting(cluster, "going"))
    assert cluster.count("patch", api.ROLLOUT_CHECKPOINT_PLURAL) == 0


async def test_a_deleted_checkpoint_loses_its_records_then_only_its_own_finalizer(
    storage: Path,
) -> None:
    cluster = seeded(rollout_set(storage))
    add_checkpoint(cluster, "old", 1, outcome="Ready", completed=2)
    folder = records(storage, "old")
    finalized(cluster, "old", [api.RECORDS_FINALIZER, "example.com/keep"])
    deleting(cluster, "old")
    outcome = await release_deleted_checkpoint(
        cluster.kube(), NS, "old", flow_runs=lambda: False, locator=StorageLocator(None)
    )
    assert "removed" in outcome
    assert not folder.exists()
    stored = checkpoint(cluster, "old")
    assert stored is not None
    assert stored["metadata"]["finalizers"] == ["example.com/keep"]


def releasing(
    cluster: FakeCluster,
    name: str,
    outcomes: list[str],
    *,
    flow_runs: Callable[[], bool] = lambda: False,
    retry_seconds: float = 5.0,
) -> Callable[[], Awaitable[None]]:
    """The records removal of checkpoint `name`, to run as a task; its outcome goes to
    `outcomes`."""

    async def release() -> None:
        outcomes.append(
            await release_deleted_checkpoint(
                cluster.kube(),
                NS,
                name,
                flow_runs=flow_runs,
                locator=StorageLocator(None),
                retry_seconds=retry_seconds,
            )
        )

    return release


async def test_the_records_stay_until_the_deleted_checkpoints_flow_has_ended(
    storage: Path,
) -> None:
    """A deleted checkpoint's flow aborts first (participants resumed, the Lease released);
    nothing is removed while it runs, and the removal goes on once it ended."""
    cluster = seeded(rollout_set(storage))
    add_checkpoint(cluster, "running", 1, outcome="Ready", completed=2)
    folder = records(storage, "running")
    finalized(cluster, "running", [api.RECORDS_FINALIZER])
    deleting(cluster, "running")
    flow = anyio.Event()
    outcomes: list[str] = []
    release = releasing(cluster, "running", outcomes, flow_runs=lambda: not flow.is_set())
    async with anyio.create_task_group() as group:
        group.start_soon(release)
        await anyio.wait_all_tasks_blocked()
        assert folder.exists(), "removed while the flow still ran"
        assert cluster.count("patch", api.ROLLOUT_CHECKPOINT_PLURAL) == 0
        flow.set()
        # The flow's last write (its Failed phase) is an event of the set: the removal looks.
        cluster.update(api.ROLLOUT_CHECKPOINT_PLURAL, NS, "running", lambda obj: None)
    assert outcomes
    assert "removed" in outcomes[0]
    assert not folder.exists()
    stored = checkpoint(cluster, "running")
    assert stored is not None
    assert stored["metadata"]["finalizers"] == []


async def test_a_busy_removal_tries_again_until_the_recovery_is_done(storage: Path) -> None:
    cluster = restoring_new(storage)
    add_checkpoint(cluster, "new", 3, outcome="Ready", completed=4)
    finalized(cluster, "new", [api.RECORDS_FINALIZER])
    deleting(cluster, "new")
    outcomes: list[str] = []
    async with anyio.create_task_group() as group:
        group.start_soon(releasing(cluster, "new", outcomes, retry_seconds=0.01))
        await anyio.wait_all_tasks_blocked()
        assert not outcomes, "a restoring recovery holds the removal"

        def recovered(rset: dict[str, Any]) -> None:
            rset["status"].pop("recovery")

        cluster.update(api.ROLLOUT_SET_PLURAL, NS, "math", recovered)
    assert outcomes
    stored = checkpoint(cluster, "new")
    assert stored is not None
    assert stored["metadata"]["finalizers"] == []
