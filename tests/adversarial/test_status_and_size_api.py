"""Failure-mode classes 2 and 3 (docs/operations.md#failure-modes) on a real API server, with the
operator running.

Class 2: status is the operator's memory, and users can write it (`kubectl patch
--subresource=status`). A status that contradicts the cluster is repaired from what the cluster
shows (the pods' attempt labels, the checkpoint's manifests on storage), with an Event; it never
makes the operator run a second attempt beside the first, nor run a Ready checkpoint again.

Class 3: unbounded specs. A spec larger than Kopf's annotations can hold is reconciled and
deleted; `replicas: 10000` is refused by the API server; a set over the operator's configured
replicas limit gets a clear condition and no pods.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rollout_operator.model import api
from testsupport.operator_fixtures import (
    OperatorProcess,
    Resources,
    check_manifests,
    condition,
    example_checkpoint,
    example_set,
    is_true,
    phase_is,
    running_operator,
)

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for

pytestmark = pytest.mark.e2e

REPAIRED = "StatusRepaired"


def _apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def _patch_status(cluster: Cluster, namespace: str, kind: str, name: str, status: Any) -> None:
    cluster.kubectl(
        "patch",
        kind,
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def _pod_attempts(cluster: Cluster, namespace: str) -> set[str]:
    listed = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json")
    pods = json.loads(listed.stdout)["items"]
    return {p["metadata"]["labels"].get(api.LABEL_ATTEMPT, "?") for p in pods}


def _events(cluster: Cluster, namespace: str, reason: str) -> list[dict[str, Any]]:
    listed = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"reason={reason}", "-o", "json"
    )
    items: list[dict[str, Any]] = json.loads(listed.stdout)["items"]
    return items


async def test_a_patched_status_attempt_never_runs_a_second_attempt(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """`status.attempt: 2` written on a Ready set of attempt 1: the operator reads the attempt
    from its pods' labels, writes 1 back with an Event, and never creates pods of attempt 2."""
    _apply(cluster, namespace, example_set(storage_dir))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    assert _pod_attempts(cluster, namespace) == {"1"}

    _patch_status(cluster, namespace, "rset", "math-rl", {"attempt": 2})

    async def repaired() -> bool:
        return bool(_events(cluster, namespace, REPAIRED))

    await wait_for(repaired, 30, "an Event saying status was repaired", interval=0.2)
    obj = await resources.wait_set("attempt 1 again", lambda o: o["status"]["attempt"] == 1, 10)
    assert is_true(obj, "Ready"), obj["status"]
    assert _pod_attempts(cluster, namespace) == {"1"}, "pods of a second attempt were created"


async def test_a_reset_status_of_a_ready_checkpoint_is_repaired_not_run_again(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """A Ready checkpoint whose status is wiped (phase, conditions, participants): its
    manifests on storage prove it was published, so it is Ready again (reason StatusRepaired),
    with the same records; it is never prepared again and its records are never removed."""
    _apply(cluster, namespace, example_set(storage_dir))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    _apply(cluster, namespace, example_checkpoint("c1"))
    ready = await resources.wait_checkpoint("c1", "Ready", phase_is("Ready", "Failed"), 60)
    assert is_true(ready, "Ready"), ready["status"]
    before = sorted((p["instance"], p["recordsSha256"]) for p in ready["status"]["participants"])

    _patch_status(
        cluster,
        namespace,
        "rckpt",
        "c1",
        {"phase": None, "conditions": None, "participants": None, "attempt": None},
    )

    def repaired_ready(obj: dict[str, Any]) -> bool:
        ready_condition = condition(obj, "Ready")
        return ready_condition is not None and ready_condition.get("reason") == REPAIRED

    after = await resources.wait_checkpoint("c1", "repaired to Ready", repaired_ready, 30)
    assert after["status"]["phase"] == "Ready", after["status"]
    assert is_true(after, "Ready"), after["status"]
    assert (
        sorted((p["instance"], p["recordsSha256"]) for p in after["status"]["participants"])
        == before
    )
    check_manifests(after, storage_dir)
    # latestCheckpoint follows a checkpoint's Ready within a pass of the set (its one writer).
    await resources.wait_set("latest c1", lambda o: o["status"].get("latestCheckpoint") == "c1", 10)
    assert _events(cluster, namespace, REPAIRED), "no Event says the status was repaired"


async def test_a_ready_checkpoint_set_failed_by_hand_keeps_its_records(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """A Ready checkpoint whose status is written Failed: retention took it for garbage and
    removed its records at once (a restorable checkpoint lost). Every participant's manifest and
    records of it are on storage and verify, so it is repaired to Ready (reason StatusRepaired)
    with its records, and stays the set's latest."""
    _apply(cluster, namespace, example_set(storage_dir))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    _apply(cluster, namespace, example_checkpoint("c1"))
    ready = await resources.wait_checkpoint("c1", "Ready", phase_is("Ready", "Failed"), 60)
    assert is_true(ready, "Ready"), ready["status"]
    before = sorted((p["instance"], p["recordsSha256"]) for p in ready["status"]["participants"])
    now = "2026-01-01T00:00:00Z"
    _patch_status(
        cluster,
        namespace,
        "rckpt",
        "c1",
        {
            "phase": "Failed",
            "conditions": [
                {
                    "type": t,
                    "status": v,
                    "reason": "ByHand",
                    "message": "x",
                    "lastTransitionTime": now,
                }
                for t, v in (("Ready", "False"), ("Failed", "True"), ("Committed", "True"))
            ],
        },
    )

    def repaired_ready(obj: dict[str, Any]) -> bool:
        ready_condition = condition(obj, "Ready")
        return ready_condition is not None and ready_condition.get("reason") == REPAIRED

    after = await resources.wait_checkpoint("c1", "repaired to Ready", repaired_ready, 60)
    assert after["status"]["phase"] == "Ready", after["status"]
    assert not is_true(after, "Failed"), after["status"]
    assert (
        sorted((p["instance"], p["recordsSha256"]) for p in after["status"]["participants"])
        == before
    )
    check_manifests(after, storage_dir)
    # latestCheckpoint follows a checkpoint's Ready within a pass of the set (its one writer).
    await resources.wait_set("latest c1", lambda o: o["status"].get("latestCheckpoint") == "c1", 10)
    assert _events(cluster, namespace, REPAIRED), "no Event says the status was repaired"
    assert "Traceback" not in operator.tail(400), operator.tail(60)


def _pod_uids(cluster: Cluster, namespace: str) -> dict[str, str]:
    listed = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json")
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in json.loads(listed.stdout)["items"]}


async def test_a_written_recovery_stops_no_pod(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """`status.recovery` written on a Ready set whose pods all run: a recovery would stop every
    pod and restore the latest checkpoint into new ones. No participant was lost, so the
    recovery is removed (Event StatusRepaired) and every pod keeps running under attempt 1."""
    _apply(cluster, namespace, example_set(storage_dir))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    pods = _pod_uids(cluster, namespace)
    _patch_status(
        cluster,
        namespace,
        "rset",
        "math-rl",
        {
            "recovery": {
                "phase": "StoppingAttempt",
                "fromAttempt": 1,
                "targetAttempt": 2,
                "startedAt": "2026-01-01T00:00:00Z",
                "reason": "PodDeleted",
            }
        },
    )

    async def repaired() -> bool:
        return bool(_events(cluster, namespace, REPAIRED))

    await wait_for(repaired, 30, "an Event saying status was repaired", interval=0.2)
    obj = await resources.wait_set(
        "no recovery", lambda o: o["status"].get("recovery") is None and is_true(o, "Ready"), 10
    )
    assert obj["status"]["attempt"] == 1, obj["status"]
    assert _pod_uids(cluster, namespace) == pods, "a pod was stopped or replaced"
    assert "Traceback" not in operator.tail(400), operator.tail(60)


async def test_a_written_latest_checkpoint_is_repaired_to_the_newest_ready_one(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """`status.latestCheckpoint` (what a recovery restores) written back to an older Ready
    checkpoint, then to a name that does not exist: each time it is written back to the newest
    Ready checkpoint, with an Event, and both checkpoints keep their records."""
    _apply(cluster, namespace, example_set(storage_dir))
    await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    for name in ("c1", "c2"):
        _apply(cluster, namespace, example_checkpoint(name))
        done = await resources.wait_checkpoint(name, "Ready", phase_is("Ready", "Failed"), 60)
        assert is_true(done, "Ready"), done["status"]
    for written in ("c1", "not-a-checkpoint"):
        _patch_status(cluster, namespace, "rset", "math-rl", {"latestCheckpoint": written})

        async def repaired(written: str = written) -> bool:
            return any(
                written in e.get("message", "") for e in _events(cluster, namespace, REPAIRED)
            )

        await wait_for(repaired, 30, f"an Event saying {written!r} was written back", interval=0.2)
        await resources.wait_set(
            "latest c2 again", lambda o: o["status"].get("latestCheckpoint") == "c2", 10
        )
    for name in ("c1", "c2"):
        check_manifests(await resources.checkpoint(name), storage_dir)
    assert "Traceback" not in operator.tail(400), operator.tail(60)


def _large_set(storage_dir: Path) -> dict[str, Any]:
    """The example set with 150 KiB of environment in each of two templates: a spec more than
    the 256 KiB that all of an object's annotations may hold, each template within the
    operator's bound (`api.MAX_TEMPLATE_BYTES`), well within what the API server stores."""
    obj = example_set(storage_dir)
    for participant in obj["spec"]["participants"][:2]:
        container = participant["template"]["spec"]["containers"][0]
        container.setdefault("env", []).append({"name": "BIG", "value": "x" * (150 * 1024)})
    return obj


async def test_a_spec_larger_than_kopfs_annotations_is_reconciled_and_deleted(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    # `kubectl create`: `apply` would copy the spec into its own annotation, over the limit.
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(_large_set(storage_dir)))
    await resources.wait_set(
        "reconciled", lambda o: (o.get("status") or {}).get("observedGeneration") == 1, 60
    )
    annotations = (await resources.rollout_set())["metadata"].get("annotations") or {}
    assert sum(len(k) + len(v) for k, v in annotations.items()) < 64 * 1024, sorted(annotations)
    cluster.kubectl("delete", "rset", "math-rl", "-n", namespace, "--wait=false")

    async def gone() -> bool:
        got = cluster.kubectl("get", "rset", "math-rl", "-n", namespace, check=False)
        return got.returncode != 0

    await wait_for(gone, 60, "the large RolloutSet to be deleted", interval=0.2)
    assert "Too long" not in operator.tail(400), operator.tail(40)


def test_ten_thousand_replicas_are_refused_by_the_api_server(
    cluster: Cluster, namespace: str, operator: OperatorProcess, storage_dir: Path
) -> None:
    obj = example_set(storage_dir)
    obj["spec"]["participants"][0]["replicas"] = 10000
    done = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False)
    assert done.returncode != 0, "replicas: 10000 was accepted"
    assert f"less than or equal to {api.MAX_REPLICAS}" in done.stderr, done.stderr


async def test_replicas_over_the_operators_limit_get_a_condition_and_no_pods(
    cluster: Cluster, namespace: str, resources: Resources, storage_dir: Path, tmp_path: Path
) -> None:
    """The limit configured at install (`--max-replicas-per-role`, the chart's
    `operator.maxReplicasPerRole`) is below the API's bound: such a set is Degraded with reason
    ReplicasOverLimit, and no pod is created."""
    obj = example_set(storage_dir)
    obj["spec"]["participants"][0]["replicas"] = 3
    with running_operator(
        cluster, [namespace], tmp_path / "operator.log", args=["--max-replicas-per-role", "2"]
    ):
        _apply(cluster, namespace, obj)
        refused = await resources.wait_set("Degraded", lambda o: is_true(o, "Degraded"), 30)
        degraded = condition(refused, "Degraded")
        assert degraded is not None
        assert degraded["reason"] == "ReplicasOverLimit", degraded
        assert "at most 2" in degraded["message"], degraded
        assert "model" in degraded["message"], degraded
        assert _pod_attempts(cluster, namespace) == set()
