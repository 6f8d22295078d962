"""Helpers for end-to-end tests on devcluster: condition waits, pod predicates, pod manifests.

Every wait takes a timeout and a description and fails with both plus the last value seen, so a
failing e2e test says what it was waiting for instead of hanging or asserting on a stale read.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from devcluster.cluster import Cluster
from devcluster.errors import DevclusterError
from devcluster.procs import is_alive
from devcluster.state import NodeRuntime
from devcluster.waiting import WaitTimeout, wait_for, wait_for_sync

__all__ = [
    "WaitTimeout",
    "condition",
    "e2e_cluster",
    "is_alive",
    "is_ready",
    "namespace_name",
    "process_pod",
    "terminated_state",
    "wait_for",
    "wait_for_pod",
    "wait_for_pod_gone",
    "wait_for_sync",
]

EXISTING_KUBECONFIG_ENV = "ROLLOUT_E2E_KUBECONFIG"
EXISTING_CONTAINER_KUBECONFIG_ENV = "ROLLOUT_E2E_CONTAINER_KUBECONFIG"


@contextmanager
def e2e_cluster(
    tmp_root: Path,
    node_runtime: NodeRuntime = "process",
    images: Sequence[Path] = (),
) -> Iterator[Cluster]:
    """The cluster for a test session: a fresh one in `tmp_root`, stopped afterwards, or the
    running devcluster whose kubeconfig `$ROLLOUT_E2E_KUBECONFIG` names (left running).

    With `node_runtime="containerd"` it is a container node (`$ROLLOUT_E2E_CONTAINER_KUBECONFIG`
    names a running one to borrow), `images` imported into its containerd; stopping it fails if
    anything it created on the machine is left (process, mount, cgroup, veth, namespace)."""
    env = (
        EXISTING_KUBECONFIG_ENV if node_runtime == "process" else EXISTING_CONTAINER_KUBECONFIG_ENV
    )
    existing = os.environ.get(env)
    if existing:
        root = Path(existing).resolve().parent
        if not (root / "state.json").exists():
            raise DevclusterError(
                f"{env}={existing} is not the kubeconfig of a devcluster "
                "(no state.json beside it); the e2e tests need devcluster's kill-pod and "
                "lose-node hooks. Start one with `make cluster` and use .devcluster/kubeconfig."
            )
        attached = Cluster.attach(root)
        if attached.node_runtime != node_runtime:
            raise DevclusterError(f"{env}={existing} runs a {attached.node_runtime} node")
        for archive in images:
            attached.import_image(archive)
        yield attached
        return
    cluster = Cluster.start(
        tmp_root / f"devcluster-{node_runtime}",
        node_runtime=node_runtime,
        images=images,
        timeout=90.0 if node_runtime == "process" else 180.0,
    )
    try:
        yield cluster
    finally:
        cluster.stop()
        left = [f"process {pid}" for pid in cluster.processes()] + cluster.node_leftovers()
        if left:
            raise DevclusterError(f"left after stopping the e2e cluster: {left}")


def namespace_name(test_name: str) -> str:
    """A fresh, valid namespace name derived from the test's name."""
    stem = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:48].rstrip("-")
    return f"e2e-{stem}-{secrets.token_hex(3)}"


def condition(pod: Any, kind: str) -> Any | None:
    """The pod's condition of this type (a V1PodCondition), if present."""
    for item in (pod.status.conditions if pod.status else None) or []:
        if item.type == kind:
            return item
    return None


def is_ready(pod: Any) -> bool:
    ready = condition(pod, "Ready")
    return ready is not None and ready.status == "True"


def terminated_state(pod: Any, container: int = 0) -> Any | None:
    """The container's current terminated state (exit code, reason), or None."""
    statuses = (pod.status.container_statuses if pod.status else None) or []
    if len(statuses) <= container:
        return None
    return statuses[container].state.terminated


async def wait_for_pod(
    core: Any,
    namespace: str,
    name: str,
    predicate: Callable[[Any], bool],
    what: str,
    timeout: float = 30.0,  # noqa: ASYNC109 - a poll budget
) -> Any:
    """Polls the pod until `predicate(pod)` holds and returns it; a missing pod is "not yet"."""

    async def check() -> Any:
        pod = await core.read_namespaced_pod(name, namespace)
        return pod if predicate(pod) else None

    return await wait_for(
        check, timeout, f"pod {namespace}/{name} {what}", ignore=(client.ApiException,)
    )


async def wait_for_pod_gone(
    core: Any,
    namespace: str,
    name: str,
    timeout: float = 30.0,  # noqa: ASYNC109 - a poll budget
) -> None:
    async def gone() -> bool:
        try:
            await core.read_namespaced_pod(name, namespace)
        except client.ApiException as error:
            if error.status == 404:
                return True
            raise
        return False

    await wait_for(gone, timeout, f"pod {namespace}/{name} to be deleted")


def process_pod(
    name: str,
    command: list[str],
    *,
    env: dict[str, str] | None = None,
    extra_env: list[dict[str, Any]] | None = None,
    gpus: int = 0,
    restart_policy: str = "Never",
    grace_seconds: int | None = None,
    readiness_port: int | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    node_selector: dict[str, str] | None = None,
    host_paths: list[str] | None = None,
) -> dict[str, Any]:
    """A one-container Pod manifest for a local process on devcluster.

    `POD_IP` and `POD_NAME` are always set from the downward API; with `readiness_port` the
    container declares a port named `http` and an httpGet readiness probe on it (period 1 s).
    `host_paths` become hostPath volumes mounted at their own paths.
    """
    container: dict[str, Any] = {
        "name": "main",
        "image": "unused.invalid/devcluster",
        "command": command,
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *({"name": k, "value": v} for k, v in (env or {}).items()),
            *(extra_env or []),
        ],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    if readiness_port is not None:
        container["ports"] = [{"name": "http", "containerPort": readiness_port}]
        container["readinessProbe"] = {
            "httpGet": {"path": "/", "port": "http"},
            "periodSeconds": 1,
        }
    spec: dict[str, Any] = {"containers": [container], "restartPolicy": restart_policy}
    if grace_seconds is not None:
        spec["terminationGracePeriodSeconds"] = grace_seconds
    if node_selector:
        spec["nodeSelector"] = node_selector
    if host_paths:
        spec["volumes"] = [
            {"name": f"host-{i}", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
            for i, path in enumerate(host_paths)
        ]
        container["volumeMounts"] = [
            {"name": f"host-{i}", "mountPath": path} for i, path in enumerate(host_paths)
        ]
    metadata: dict[str, Any] = {"name": name, "labels": labels or {}}
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
