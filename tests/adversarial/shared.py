"""Helpers of the adversarial tests: a participant's control plane served in process, a set
with its checkpoints on the unit tests' fake API server (`testsupport.fakecluster`) for the
operator's finalizers, and the storage paths that must be refused (`BAD_PATHS`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from rollout_operator.decide.resources import participant_pod
from rollout_operator.model import api
from rollout_protocol import API_PREFIX, ControlPlane, ControlSettings, ErrorBody, ErrorCode, Role
from testsupport import builders
from testsupport.controlplane import served
from testsupport.fakecluster import FakeCluster

TOKEN = "adversarial-control-token"
WAIT = 5.0
"""Upper bound for anything a test waits on; reaching it is a failure, not a delay."""


def deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


@asynccontextmanager
async def serve(plane: ControlPlane) -> AsyncIterator[httpx.AsyncClient]:
    async with served(plane, TOKEN) as client:
        yield client


def refused(response: httpx.Response, code: ErrorCode, status: int) -> str:
    """Assert that `response` is the refusal `status`/`code` in the protocol's error body; its
    detail (what a caller is told was wrong)."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = ErrorBody.model_validate_json(response.content)
    assert body.error.code is code, body
    return body.error.detail


async def post(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", deadline())
    return await client.post(f"{API_PREFIX}/{route}", json=body)


async def checkpoint(client: httpx.AsyncClient, checkpoint_id: str) -> dict[str, Any]:
    """Prepare, commit and resume one checkpoint; the commit reply."""
    for route in ("prepare", "commit", "resume"):
        response = await post(client, route, checkpoint_id=checkpoint_id)
        assert response.status_code == 200, f"{route}: {response.text}"
        if route == "commit":
            committed: dict[str, Any] = response.json()
    return committed


def set_object(namespace: str, uid: str, root: Path, name: str = "math") -> dict[str, Any]:
    """A RolloutSet as the API server returns it; its volume is the folder `root`."""
    container = {"name": "c", "ports": [{"name": "control", "containerPort": 8000}]}
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutSet",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": 1},
        "spec": {
            "participants": [
                {"role": "environment", "template": {"spec": {"containers": [container]}}}
            ],
            "storage": {"path": "/checkpoints", "volume": {"hostPath": {"path": str(root)}}},
        },
        "status": {"attempt": 1, "createdAttempt": 1},
    }


def pod_settings(obj: dict[str, Any], root: Path, attempt: int = 1) -> ControlSettings:
    """The control settings of a participant pod of the set, from the env the operator gives it
    (what `ControlSettings.from_env` reads in the pod), with the volume, mounted at
    `storage.path` in the pod, found at `root` here."""
    rset = api.RolloutSet.model_validate(obj)
    pod = participant_pod(rset, rset.spec.participants[0], 0, attempt, {})
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    assert env["ROLLOUT_CHECKPOINT_ROOT"] == rset.spec.storage.path
    env["ROLLOUT_CHECKPOINT_ROOT"] = str(root)
    env["ROLLOUT_CONTROL_TOKEN"] = TOKEN
    return ControlSettings.from_env(Role.ENVIRONMENT, environ=env)


def set_cluster(obj: dict[str, Any], checkpoints: Sequence[str] = ()) -> FakeCluster:
    """An API server holding the set and a Ready RolloutCheckpoint of it per name in
    `checkpoints`, for the operator's finalizers (run through `cluster.kube()`)."""
    cluster = FakeCluster()
    cluster.put(obj)
    for name in checkpoints:
        cluster.put(ready_checkpoint(obj, name))
    return cluster


def ready_checkpoint(obj: dict[str, Any], name: str) -> dict[str, Any]:
    """A Ready RolloutCheckpoint of the set `obj`."""
    meta = obj["metadata"]
    done = "2026-11-29T12:00:01Z"
    return builders.checkpoint_body(
        name,
        set_name=meta["name"],
        namespace=meta["namespace"],
        created="2026-11-29T12:00:00Z",
        status=builders.checkpoint_status("Ready", at=done, completed=done),
    )


BAD_PATHS = {
    "the root": "/",
    "a trailing slash": "/checkpoints/",
    "proc": "/proc",
    "below sys": "/sys/fs/ckpt",
    "dev": "/dev",
    "etc": "/etc/rollout",
    "usr": "/usr",
    "below usr": "/usr/lib/ckpt",
    "bin": "/bin",
    "boot": "/boot",
    "run": "/run/ckpt",
    "var itself": "/var",
    "tmp itself": "/tmp",
}
"""Storage paths that cannot be right, by case: refused by the models (test_shared_storage) and
by the CRD's CEL rule (test_shared_storage_api)."""
