"""A set whose records live only in an S3-API bucket, on a real API server with the operator
and a real S3 server on loopback (`s3_bucket`, tests/testsupport/s3_server.py): no folder is
shared between its pods and the operator.

Two sets share the bucket and its key prefix. Created before their credentials Secret, they say
which Secret they need and start no pod; once it exists they run. The first checkpoints,
retention keeps exactly its `keepLatest` newest checkpoints' keys, its participant is killed and
the new attempt restores the latest checkpoint's records from the bucket, and deleting the set
removes every key of its own and none of the other set's
(docs/design.md#65-retention-and-records).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
from obstore.store import S3Store
from policy_support import (
    WAIT,
    counter_set,
    create_checkpoint,
    manual_checkpoint,
    wait_condition,
    wait_ready,
)
from testsupport.operator_fixtures import (
    OperatorProcess,
    Resources,
    is_true,
    kubectl_apply,
    pod_pids,
    recovered_under,
)
from testsupport.s3_server import S3Bucket

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for

PREFIX = "shared/rl"
SECRET = "bucket-creds"


def bucket_set(name: str, bucket: S3Bucket, control: Path, keep: int = 2) -> dict[str, Any]:
    body = counter_set(name, control, control, policy={"keepLatest": keep})
    body["spec"]["storage"] = {
        "s3": {
            "endpoint": bucket.endpoint,
            "bucket": bucket.name,
            "prefix": PREFIX,
            "region": bucket.server.region,
            "secretName": SECRET,
        }
    }
    return body


def keys(store: S3Store, below: str) -> set[str]:
    """Every key of the bucket below `below` (a listing is the ground truth here: nothing
    writes while the test looks)."""
    import obstore

    return {meta["path"] for batch in obstore.list(store, prefix=below) for meta in batch}


def checkpoints_in(store: S3Store, set_prefix: str) -> set[str]:
    """The checkpoint ids that have keys below the set's own `<prefix>/<ns>/<set>/<uid>/`."""
    return {key[len(set_prefix) :].split("/", 1)[0] for key in keys(store, set_prefix)}


async def set_prefix(resources: Resources, name: str) -> str:
    uid = (await resources.rollout_set(name))["metadata"]["uid"]
    return f"{PREFIX}/{resources.namespace}/{name}/{uid}/"


def restored_steps(store: S3Store, set_prefix_: str, checkpoint: str) -> dict[str, int]:
    """The counters the checkpoint's records in the bucket hold (its one participant's)."""
    import obstore

    [records] = [
        key
        for key in keys(store, f"{set_prefix_}{checkpoint}/environment-0/")
        if key.rsplit("/", 1)[-1].startswith("records-")
    ]
    lines = bytes(obstore.get(store, records).bytes()).decode().splitlines()
    return {
        entry["rollout_id"]: int(entry["data"]["step"])
        for entry in (json.loads(line) for line in lines if line.strip())
    }


async def state_of(resources: Resources, name: str) -> dict[str, Any]:
    rset = await resources.rollout_set(name)
    [participant] = rset["status"]["participants"]
    async with httpx.AsyncClient() as http:
        reply = await http.get(participant["address"] + "/state", timeout=5)
    reply.raise_for_status()
    state: dict[str, Any] = reply.json()
    return state


async def test_a_bucket_set_checkpoints_retains_recovers_and_removes_only_its_own_keys(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    s3_bucket: S3Bucket,
    tmp_path: Path,
) -> None:
    store = s3_bucket.store()
    # The neighbour shares the bucket and the prefix; its name extends the first set's.
    for name in ("bkt", "bkt2"):
        (tmp_path / name).mkdir()
        kubectl_apply(cluster, namespace, bucket_set(name, s3_bucket, tmp_path / name))
    # No Secret yet: the set says which one it needs, and starts no pod.
    blocked = await wait_condition(
        resources, "bkt", "Degraded", reason="StorageSecretInvalid", status="True"
    )
    assert f"secret {namespace}/{SECRET}" in blocked["message"]
    assert (await resources.core.list_namespaced_pod(namespace)).items == []
    await resources.core.create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": SECRET},
            "stringData": {
                "accessKeyId": s3_bucket.credentials.access_key_id,
                "secretAccessKey": s3_bucket.credentials.secret_access_key,
            },
        },
    )
    for name in ("bkt", "bkt2"):
        await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), WAIT, name=name)
    await create_checkpoint(resources, manual_checkpoint("n1", "bkt2"))
    await wait_ready(resources, "n1")
    neighbour = keys(store, await set_prefix(resources, "bkt2"))
    assert any(key.endswith("/n1/environment-0/manifest.json") for key in neighbour), neighbour

    # Three checkpoints; retention (keepLatest 2) removes the first one's keys.
    mine = await set_prefix(resources, "bkt")
    for checkpoint in ("c1", "c2", "c3"):
        await create_checkpoint(resources, manual_checkpoint(checkpoint, "bkt"))
        await wait_ready(resources, checkpoint)

    async def retained() -> bool:
        return checkpoints_in(store, mine) == {"c2", "c3"}

    await wait_for(retained, WAIT, "exactly c2's and c3's keys in the bucket", interval=0.2)
    expected = restored_steps(store, mine, "c3")

    # The participant dies; the new attempt restores c3 from the bucket (no volume exists).
    rset = await resources.rollout_set("bkt")
    [pod] = [p["pod"] for p in rset["status"]["participants"]]
    for pid in pod_pids(cluster, namespace, pod):
        os.killpg(pid, signal.SIGKILL)
    recovered = await recovered_under(resources, 2, WAIT, set_name="bkt")
    assert recovered["status"]["latestCheckpoint"] == "c3"
    state = await state_of(resources, "bkt")
    assert state["attempt"] == 2
    assert state["restored_from"] == expected

    # Deleting the set removes its keys, and none of the neighbour's.
    cluster.kubectl("delete", "rset", "bkt", "-n", namespace, "--timeout=90s")
    assert keys(store, f"{PREFIX}/{namespace}/bkt/") == set()
    assert keys(store, await set_prefix(resources, "bkt2")) == neighbour
