"""What `up` waits for after `/readyz`: a cluster that can actually run a pod.

That means the controller-manager and scheduler answer their health checks, the service-account
controller has made the `default` ServiceAccount (pods are refused without it), and every node is
Ready without a not-ready taint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from kubernetes_asyncio import client

from devcluster.errors import DevclusterError
from devcluster.kube import open_api
from devcluster.pki import ca_context
from devcluster.state import ClusterState
from devcluster.waiting import WaitTimeout, wait_for

_BLOCKING_TAINTS = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}


def node_is_ready(node: Any) -> bool:
    conditions = node.status.conditions or []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    taints = {t.key for t in (node.spec.taints or [])}
    return ready and not (taints & _BLOCKING_TAINTS)


async def wait_cluster_ready(
    kubeconfig: Path,
    state: ClusterState,
    ca: Path,
    check_alive: Callable[[], None],
    deadline: float,
    progress: Callable[[str], None] = lambda _message: None,
) -> None:
    def remaining() -> float:
        return max(0.0, deadline - time.monotonic())

    async with (
        httpx.AsyncClient(verify=ca_context(ca), timeout=2.0) as http,
        open_api(kubeconfig) as api,
    ):
        core = client.CoreV1Api(api)

        def healthy(url: str) -> Callable[[], Any]:
            async def probe() -> bool:
                check_alive()
                try:
                    return (await http.get(url)).status_code == 200
                except httpx.HTTPError:
                    return False

            return probe

        async def default_service_account() -> bool:
            check_alive()
            await core.read_namespaced_service_account("default", "default")
            return True

        async def nodes_ready() -> list[str]:
            check_alive()
            nodes = (await core.list_node()).items
            ready = {n.metadata.name for n in nodes if node_is_ready(n)}
            missing = [spec.name for spec in state.nodes if spec.name not in ready]
            return [] if missing else sorted(ready)

        steps: list[tuple[str, Callable[[], Any], str]] = [
            (
                "kube-controller-manager /healthz",
                healthy(f"https://127.0.0.1:{state.ports.controller_manager}/healthz"),
                "kube-controller-manager",
            ),
            (
                "kube-scheduler /readyz",
                healthy(f"https://127.0.0.1:{state.ports.scheduler}/readyz"),
                "kube-scheduler",
            ),
            (
                "the default ServiceAccount (service-account controller)",
                default_service_account,
                "kube-controller-manager",
            ),
            (
                f"nodes {[n.name for n in state.nodes]} to be Ready",
                nodes_ready,
                "node-agent",
            ),
        ]
        for what, predicate, component in steps:
            try:
                await wait_for(
                    predicate, remaining(), what, interval=0.2, ignore=(client.ApiException,)
                )
            except WaitTimeout as error:
                raise DevclusterError(
                    f"{error}. See {state.dir / 'logs' / (component + '.log')} "
                    "(or raise --timeout on a slow machine)"
                ) from error
            progress(f"ready: {what}")
