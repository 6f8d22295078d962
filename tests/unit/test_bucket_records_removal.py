"""A bucket set's records are removed without the operator holding the bucket's credentials
(docs/design.md#65-retention-and-records): through a participant that mounts them, asked one at
a time (every pod sees the same bucket), else through a cleanup pod that mounts the Secret.

Real parts: the S3 server on loopback (`s3_bucket`), the participants' control plane served on a
loopback port, `rollout-records` run with the cleanup pod's own command and env. The API server
is the in-memory `FakeCluster`; no kubelet runs here, so the test plays its part below the
operator (the Secret's files in a folder, the termination message written back)."""

from __future__ import annotations

import base64
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import obstore
import pytest
from fastapi import FastAPI
from obstore.store import S3Store
from rollout_operator.cluster.storage import StorageLocator
from rollout_operator.decide.resources import (
    CREDENTIALS_MOUNT,
    TOKEN_KEY,
    secret_name,
    set_dir,
)
from rollout_operator.flows.records import RecordsRemover, RemovalPending
from rollout_operator.model import api
from rollout_protocol import BucketConfig, ControlPlane, ControlSettings, Role
from rollout_protocol._records_cli import main as records_main
from rollout_protocol.conformance import serve_app
from testsupport.controlplane import call, served
from testsupport.fakecluster import FakeCluster
from testsupport.participants import FakeParticipant
from testsupport.policy import NS, T0, rollout_set, seeded
from testsupport.s3_server import S3Bucket

TOKEN = "records-token"
PREFIX = "shared"


def bucket_body(tmp_path: Path, bucket: S3Bucket, name: str = "math") -> dict[str, Any]:
    body = rollout_set(tmp_path)
    body["metadata"]["name"] = name
    body["metadata"]["uid"] = f"uid-{name}"
    body["spec"]["storage"] = {
        "s3": {
            "endpoint": bucket.endpoint,
            "bucket": bucket.name,
            "prefix": PREFIX,
            "secretName": "bucket-creds",
        }
    }
    return body


def plane(bucket: S3Bucket, credentials: Path, rset: api.RolloutSet) -> ControlPlane:
    settings = ControlSettings(
        role=Role.ENVIRONMENT,
        set_name=rset.metadata.name,
        set_dir=set_dir(rset),
        bucket=BucketConfig(
            endpoint=bucket.endpoint,
            bucket=bucket.name,
            credentials_dir=credentials,
            prefix=PREFIX,
        ),
        token=TOKEN,
    )
    return ControlPlane(FakeParticipant(rollouts=["r1", "r2"]), settings)


async def checkpoints(target: ControlPlane, *ids: str) -> None:
    async with served(target, TOKEN) as client:
        for cid in ids:
            for route in ("prepare", "commit", "resume"):
                response = await call(
                    client, route, checkpoint_id=cid, deadline_ts=time.time() + 20
                )
                assert response.status_code == 200, response.text


def keys(store: S3Store, below: str) -> set[str]:
    return {meta["path"] for batch in obstore.list(store, prefix=below) for meta in batch}


def ids_of(store: S3Store, rset: api.RolloutSet) -> set[str]:
    base = f"{PREFIX}/{set_dir(rset)}/"
    return {key[len(base) :].split("/", 1)[0] for key in keys(store, base)}


def pod(name: str, ip: str, index: int) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                api.LABEL_SET: "math",
                api.LABEL_ROLE: "environment",
                api.LABEL_INDEX: str(index),
                api.LABEL_ATTEMPT: "1",
            },
        },
        "status": {"phase": "Running", "podIP": ip},
    }


async def test_one_participant_removes_a_checkpoints_keys_and_no_other_sets(
    tmp_path: Path, s3_bucket: S3Bucket
) -> None:
    credentials = s3_bucket.write_credentials(tmp_path / "creds")
    body = bucket_body(tmp_path, s3_bucket)
    rset = api.RolloutSet.model_validate(body)
    # A neighbour whose name extends this set's, under the same prefix.
    neighbour = api.RolloutSet.model_validate(bucket_body(tmp_path, s3_bucket, "math2"))
    await checkpoints(plane(s3_bucket, credentials, neighbour), "a")
    mine = plane(s3_bucket, credentials, rset)
    await checkpoints(mine, "a", "b")
    store = s3_bucket.store()
    theirs = keys(store, f"{PREFIX}/{set_dir(neighbour)}/")
    assert ids_of(store, rset) == {"a", "b"}

    app = FastAPI()
    mine.install(app)
    async with mine.running(), serve_app(app, role=Role.ENVIRONMENT, token=TOKEN) as served_app:
        port = httpx.URL(served_app.target.base_url).port
        body["spec"]["participants"][0]["replicas"] = 2
        body["spec"]["participants"][0]["template"]["spec"]["containers"][0]["ports"] = [
            {"name": "control", "containerPort": port}
        ]
        cluster = seeded(body)
        cluster.put(
            {
                "kind": "Secret",
                "metadata": {"name": secret_name("math"), "namespace": NS},
                "data": {TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()},
            }
        )
        # Two pods answer on the same address: a bucket is asked once, not once per pod.
        cluster.put(pod("math-environment-0-a1", "127.0.0.1", 0))
        cluster.put(pod("math-environment-1-a1", "127.0.0.1", 1))
        remover = RecordsRemover(cluster.kube(), StorageLocator(None, cleanup_image="img:1"))
        removal = await remover.remove(api.RolloutSet.model_validate(body), ["a"])
    assert removal.not_removed is None, removal
    assert "a removed by 1 participant(s)" in removal.outcome
    assert ids_of(store, rset) == {"b"}
    assert keys(store, f"{PREFIX}/{set_dir(neighbour)}/") == theirs
    assert cluster.count("create", "pods") == 0, "no cleanup pod while a participant answers"


def act_as_kubelet(cluster: FakeCluster, credentials: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the cleanup pod's own command with its own env, its Secret's files at `credentials`
    (what the kubelet mounts at the pod's mount path), then write the status a kubelet would."""
    [created] = cluster.list_objects("pods", NS)
    [container] = created["spec"]["containers"]
    [mount] = container["volumeMounts"]
    assert mount == {
        "name": "rollout-checkpoints",
        "mountPath": CREDENTIALS_MOUNT,
        "readOnly": True,
    }
    for entry in container["env"]:
        value = entry["value"]
        monkeypatch.setenv(entry["name"], str(credentials) if value == CREDENTIALS_MOUNT else value)
    log = credentials.parent / "termination-log"
    argv = [str(log) if arg == "/dev/termination-log" else arg for arg in container["command"]]
    assert argv[:2] == ["rollout-records", "remove"]
    assert "--root" not in argv
    code = records_main(argv[1:])
    created["status"] = {
        "phase": "Succeeded" if code == 0 else "Failed",
        "containerStatuses": [
            {
                "name": container["name"],
                "state": {"terminated": {"exitCode": code, "message": log.read_text()}},
            }
        ],
    }
    cluster.put(created)
    return str(created["metadata"]["name"])


async def test_without_participants_a_cleanup_pod_mounting_the_secret_removes_the_keys(
    tmp_path: Path, s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = s3_bucket.write_credentials(tmp_path / "creds")
    body = bucket_body(tmp_path, s3_bucket)
    rset = api.RolloutSet.model_validate(body)
    neighbour = api.RolloutSet.model_validate(bucket_body(tmp_path, s3_bucket, "math2"))
    await checkpoints(plane(s3_bucket, credentials, neighbour), "a")
    await checkpoints(plane(s3_bucket, credentials, rset), "a", "b")
    store = s3_bucket.store()
    theirs = keys(store, f"{PREFIX}/{set_dir(neighbour)}/")
    stray = f"{PREFIX}/{set_dir(rset)}/b/notes.txt"
    obstore.put(store, stray, b"someone else's")

    cluster = seeded(body)
    soon = (T0 + timedelta(seconds=5)).timestamp()  # the API server's clock stands at T0
    remover = RecordsRemover(
        cluster.kube(), StorageLocator(None, cleanup_image="img:1"), clock=lambda: soon
    )
    with pytest.raises(RemovalPending, match="cleanup pod"):
        await remover.remove(rset, ["a"])
    name = act_as_kubelet(cluster, credentials, monkeypatch)
    removal = await remover.remove(rset, ["a"])
    assert removal.not_removed is None, removal
    assert f"a removed by cleanup pod {name}" in removal.outcome
    assert ids_of(store, rset) == {"b"}

    with pytest.raises(RemovalPending):
        await remover.remove(rset, None)
    act_as_kubelet(cluster, credentials, monkeypatch)
    whole = await remover.remove(rset, None)
    assert whole.not_removed is not None
    assert "b/notes.txt" in whole.not_removed
    assert keys(store, f"{PREFIX}/{set_dir(rset)}/") == {stray}
    assert keys(store, f"{PREFIX}/{set_dir(neighbour)}/") == theirs
    for value in (s3_bucket.credentials.secret_access_key, s3_bucket.credentials.access_key_id):
        assert value not in whole.outcome
