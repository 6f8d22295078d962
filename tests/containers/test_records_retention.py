"""Retention bounds a claim in a team's namespace, on a real kubelet
(docs/design.md#65-retention-and-records).

The operator runs as the chart installs it (a pod in its own namespace, mounting no claim); a
set in another namespace writes its records to a PersistentVolumeClaim of that namespace (a
static PersistentVolume bound by the real controller-manager, its hostPath folder on the node).
Nothing the operator's pod mounts can reach those records, so every removal goes through what
does mount them:

- six manual checkpoints with `keepLatest: 2` while the set runs: the set's participant removes
  the records of the four that retention deletes (the `remove` control call);
- the set suspended (its suspend checkpoint, then its pods released): the checkpoint retention
  drops then is removed by a cleanup pod of the operator's image that mounts the claim;
- the set deleted: a cleanup pod removes the set's whole folder.

After each, the volume holds exactly the records of the Ready checkpoints that remain, and no
cleanup pod is left behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from container_support import condition, get_json, kubectl_apply

from devcluster.image import ProjectImage
from devcluster.testing import namespace_name
from devcluster.waiting import wait_for_sync
from harness.objects import create_namespace, delete_namespace, example_checkpoint
from harness.providers import ContainerClusterProvider

pytestmark = pytest.mark.timeout(900)

SET = "kept"
CLAIM = "team-ckpt"
CLEANUP_LABEL = "checkpoint.rollout.dev/records-of"
SUSPEND = '{"spec":{"suspend":true}}'


def claim_objects(namespace: str, folder: Path) -> list[dict[str, Any]]:
    """A static PersistentVolume on the node's `folder`, pre-bound to the team's claim."""
    volume = f"{namespace}-ckpt"
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(folder), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": CLAIM},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]


def one_pod_set(image: str) -> dict[str, Any]:
    """One reference model server from the image, its records on the team's claim."""
    container = {
        "name": "model",
        "image": image,
        "command": ["rollout-server", "model"],
        "args": ["--host", "$(ROLLOUT_POD_IP)", "--port", "8000"],
        "ports": [{"name": "control", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "control"}, "periodSeconds": 1},
    }
    return {
        "apiVersion": "checkpoint.rollout.dev/v1alpha1",
        "kind": "RolloutSet",
        "metadata": {"name": SET},
        "spec": {
            "participants": [
                {"role": "model", "replicas": 1, "template": {"spec": {"containers": [container]}}}
            ],
            "storage": {"path": "/ckpt", "volume": {"persistentVolumeClaim": {"claimName": CLAIM}}},
            "checkpointPolicy": {"keepLatest": 2},
        },
    }


def test_retention_on_a_claim_in_a_team_namespace_keeps_exactly_the_latest_records(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    storage: Path,
    image_on_node: ProjectImage,
) -> None:
    cluster, team = container_provider, namespace_name("records-team")
    assert team != operator_release
    create_namespace(cluster, team)
    [volume, claim] = claim_objects(team, storage)
    try:
        kubectl_apply(cluster, team, volume)
        kubectl_apply(cluster, team, claim)
        wait_for_sync(
            lambda: get_json(cluster, "pvc", CLAIM, "-n", team)["status"].get("phase") == "Bound",
            60,
            "the team's claim Bound by the controller-manager",
        )
        kubectl_apply(cluster, team, one_pod_set(image_on_node.short_name))

        def rset() -> dict[str, Any]:
            return get_json(cluster, "rolloutset", SET, "-n", team)

        wait_for_sync(
            lambda: condition(rset(), "Ready").get("status") == "True", 300, "the set Ready"
        )
        folder = storage / team / SET / rset()["metadata"]["uid"]

        def ready_checkpoints() -> set[str]:
            listed = get_json(cluster, "rolloutcheckpoints", "-n", team)["items"]
            return {
                c["metadata"]["name"]
                for c in listed
                if (c.get("status") or {}).get("phase") == "Ready"
                and not c["metadata"].get("deletionTimestamp")
            }

        def on_volume() -> set[str]:
            return {p.name for p in folder.iterdir()} if folder.is_dir() else set()

        def cleanup_pods() -> list[str]:
            listed = get_json(cluster, "pods", "-n", team, "-l", CLEANUP_LABEL)["items"]
            return [p["metadata"]["name"] for p in listed]

        def cleanup_pods_seen() -> set[str]:
            """Cleanup pods that ever ran, by the Events the scheduler and kubelet posted."""
            events = get_json(cluster, "events", "-n", team)["items"]
            names = {e["involvedObject"].get("name", "") for e in events}
            return {name for name in names if name.startswith(f"{SET}-records-")}

        def settled() -> bool:
            kept = ready_checkpoints()
            return len(kept) == 2 and on_volume() == kept and not cleanup_pods()

        names = [f"manual-{i}" for i in range(6)]
        for name in names:
            kubectl_apply(cluster, team, example_checkpoint(name, SET))
            wait_for_sync(lambda n=name: n in ready_checkpoints(), 120, f"checkpoint {name} Ready")
        wait_for_sync(settled, 120, "retention settled on the latest two while the set runs")
        assert on_volume() == set(names[-2:]), on_volume()
        assert cleanup_pods_seen() == set(), "the running participant removed them"

        cluster.kubectl(
            "patch",
            "rolloutset",
            SET,
            "-n",
            team,
            "--type=merge",
            "-p",
            '{"spec":{"suspend":true}}',
        )

        def released() -> bool:
            pods = get_json(cluster, "pods", "-n", team, "-l", f"checkpoint.rollout.dev/set={SET}")
            return condition(rset(), "Suspended").get("status") == "True" and not pods["items"]

        wait_for_sync(released, 180, "the set suspended and its pods released")
        wait_for_sync(settled, 240, "retention settled again with no participant running")
        kept = ready_checkpoints()
        assert names[-1] in kept, kept
        assert names[-2] not in kept, "the suspend checkpoint took the place of the older one"
        assert on_volume() == kept
        assert cleanup_pods_seen(), "with no participant running, a cleanup pod removed them"

        cluster.kubectl("delete", "rolloutset", SET, "-n", team, "--wait=false")
        wait_for_sync(
            lambda: (
                cluster.kubectl("get", "rolloutset", SET, "-n", team, check=False).returncode != 0
            ),
            240,
            "the set deleted (its finalizer removes the records first)",
        )
        assert not folder.exists(), sorted(str(p) for p in folder.rglob("*"))
        assert not (storage / team).exists(), "empty parents of the set's folder go too"
        assert cleanup_pods() == []
    finally:
        delete_namespace(cluster, team)
        cluster.kubectl("delete", "pv", volume["metadata"]["name"], "--wait=false", check=False)
