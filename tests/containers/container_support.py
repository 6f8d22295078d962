"""Helpers of the container suite: helm on the provider's cluster, JSON reads, node containers.

The operator is installed as a user installs it (`harness.helm`: `helm install
charts/rollout-operator`, the image built here, `image.pullPolicy=Never`); these helpers keep the
tests to what they check.
"""

from __future__ import annotations

import json
from typing import Any

from testsupport.trainer import collected

from harness.helm import CHART, FULLNAME, RELEASE, helm, helm_install_operator
from harness.providers import ContainerClusterProvider

__all__ = ["CHART", "FULLNAME", "RELEASE", "collected", "helm", "helm_install_operator"]


def kubectl_apply(cluster: ContainerClusterProvider, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def describe_pods(cluster: ContainerClusterProvider, namespace: str) -> str:
    return cluster.kubectl("describe", "pods", "-n", namespace, check=False).stdout[-6000:]


def diagnostics(cluster: ContainerClusterProvider, namespace: str) -> str:
    """What a failed test's reader needs first: the sets' and checkpoints' status, the
    namespace's events, and the tail of each operator pod's log (pytest shows it on failure)."""
    parts = []
    for what in (
        ("get", "rolloutsets,rolloutcheckpoints", "-n", namespace, "-o", "yaml"),
        ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
        ("get", "pods", "-n", namespace, "-o", "wide"),
        ("logs", "-n", namespace, "-l", "app.kubernetes.io/name=rollout-operator", "--tail=120"),
    ):
        result = cluster.kubectl(*what, check=False)
        parts.append(f"--- kubectl {' '.join(what)} ---\n{result.stdout[-12000:]}{result.stderr}")
    return "\n".join(parts)


def get_json(cluster: ContainerClusterProvider, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return result


def node_containers(cluster: ContainerClusterProvider, namespace: str) -> list[str]:
    """Containers (sandboxes included) the node's containerd holds for pods of `namespace`."""
    return cluster.node_containers(namespace)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item["type"] == type_:
            return dict(item)
    return {}


def evict(cluster: ContainerClusterProvider, namespace: str, pod: str) -> None:
    """Evict a pod through the Eviction API, as `kubectl drain` does."""
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": pod, "namespace": namespace},
    }
    path = f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction"
    cluster.kubectl("create", "--raw", path, "-f", "-", input=json.dumps(eviction))
