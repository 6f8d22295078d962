"""Fixtures and helpers for end-to-end tests of the operator with the reference servers.

Import the fixtures into a test module (`from operator_fixtures import operator, ...`):

- `operator`: the CRDs applied and `rollout-operator run --namespace <ns>` running as a process
  (KUBECONFIG of the test cluster), its log in the test's tmp dir and its tail printed when the
  test fails; restartable (`operator.kill()` is a SIGKILL, `operator.start()` a fresh process).
  At teardown the test's RolloutSets and RolloutCheckpoints are deleted while the operator still
  runs (it removes its finalizers), then it is stopped; nothing it started is left running.
- `storage_dir`: a per-test checkpoint root; `example_set(storage_dir)` patches the example's
  `storage.path` and hostPath to it (devcluster mounts a hostPath at the same path).
- `resources`: the custom resources of the test namespace (kubernetes_asyncio).

Helpers for the servers' own endpoints: `stats` (`GET /stats?detail=true`), `Debug` (the
`/debug/*` pause points of a server started with `--debug-hooks`), and `pod_pids` /
`freeze` / `thaw` (SIGSTOP and SIGCONT of a pod's processes: a participant that stops
answering, to hold the operator in a phase deterministically).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_operator.demo import (
    OperatorProcess,
    Resources,
    apply_crds,
    condition,
    example_checkpoint,
    example_set,
    is_true,
    kubectl_apply,
    participants_by_role,
    phase_is,
)

from devcluster.cluster import Cluster
from devcluster.kube import open_api

__all__ = [
    "Debug",
    "OperatorProcess",
    "Resources",
    "condition",
    "example_checkpoint",
    "example_set",
    "freeze",
    "is_true",
    "kubectl_apply",
    "operator",
    "participants_by_role",
    "phase_is",
    "pod_pids",
    "resources",
    "stats",
    "storage_dir",
    "thaw",
]


def cleanup_namespace_objects(cluster: Cluster, namespace: str) -> None:
    """Delete the namespace's checkpoints and sets (the operator must run to release them)."""
    for kind in ("rckpt", "rset"):
        cluster.kubectl(
            "delete", kind, "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False
        )


def release_finalizers(cluster: Cluster, namespace: str) -> None:
    """Last resort when the operator could not delete them: drop the finalizers."""
    for kind in ("rckpt", "rset"):
        names = cluster.kubectl("get", kind, "-n", namespace, "-o", "name", check=False).stdout
        for name in names.split():
            cluster.kubectl(
                "patch",
                name,
                "-n",
                namespace,
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )


@contextlib.contextmanager
def running_operator(
    cluster: Cluster, namespaces: list[str], log: Path
) -> Iterator[OperatorProcess]:
    apply_crds(cluster)
    process = OperatorProcess(cluster.kubeconfig, namespaces, log)
    process.start()
    try:
        process.wait_live()
        yield process
    finally:
        try:
            if not process.running:
                process.start()
            for namespace in namespaces:
                cleanup_namespace_objects(cluster, namespace)
        finally:
            process.stop()
            for namespace in namespaces:
                release_finalizers(cluster, namespace)
            print(f"--- operator log ({log}) ---\n{process.tail(80)}")


@pytest.fixture
def operator(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    with running_operator(cluster, [namespace], tmp_path / "operator.log") as process:
        yield process


@pytest.fixture
def storage_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    return folder


@pytest.fixture
async def resources(cluster: Cluster, namespace: str) -> AsyncIterator[Resources]:
    async with open_api(cluster.kubeconfig) as api:
        yield Resources(api, namespace)


async def stats(http: httpx.AsyncClient, address: str) -> dict[str, Any]:
    reply = await http.get(address + "/stats", params={"detail": "true"}, timeout=10)
    assert reply.status_code == 200, f"{address}/stats: {reply.status_code} {reply.text}"
    body: dict[str, Any] = reply.json()
    return body


class Debug:
    """The `/debug/*` hooks of one server (started with `--debug-hooks`)."""

    def __init__(self, http: httpx.AsyncClient, address: str) -> None:
        self.http = http
        self.address = address

    async def _post(self, path: str, body: dict[str, Any], limit_s: float = 30.0) -> Any:
        reply = await self.http.post(self.address + path, json=body, timeout=limit_s)
        assert reply.status_code == 200, f"{self.address}{path} {body}: {reply.text}"
        return reply.json()

    async def arm(
        self, point: str, rollout_id: str | None = None, index: int | None = None
    ) -> None:
        await self._post("/debug/arm", {"point": point, "rollout_id": rollout_id, "index": index})

    async def release(self, point: str, rollout_id: str | None = None) -> int:
        body = await self._post("/debug/release", {"point": point, "rollout_id": rollout_id})
        return int(body["released"])

    async def paused(
        self, point: str, rollout_id: str | None = None, *, count: int = 1, limit_s: float = 30.0
    ) -> None:
        """Return once `count` callers are held at `point` (a server-side long poll)."""
        await self._post(
            "/debug/wait",
            {
                "point": point,
                "rollout_id": rollout_id,
                "paused": True,
                "count": count,
                "timeout_s": limit_s,
            },
            limit_s=limit_s + 5,
        )


def pod_pids(cluster: Cluster, namespace: str, pod: str) -> list[int]:
    """The process-group leaders of a pod's running containers (from the node agent)."""
    with httpx.Client(verify=cluster.ssl_context(), timeout=10) as http:
        reply = http.get(cluster.state.agent_url + "/devcluster/pods")
    reply.raise_for_status()
    for entry in reply.json():
        if entry["pod"] == f"{namespace}/{pod}":
            pids = [int(pid) for pid in entry["pids"]]
            assert pids, f"pod {namespace}/{pod} runs no process"
            return pids
    raise AssertionError(f"pod {namespace}/{pod} is not on the node agent")


def freeze(pids: list[int]) -> None:
    """SIGSTOP: the participant stops answering (its sockets stay open, calls just hang)."""
    for pid in pids:
        os.killpg(pid, signal.SIGSTOP)


def thaw(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)
