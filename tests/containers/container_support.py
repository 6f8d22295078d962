"""Helpers of the container-node suite: helm on the devcluster, JSON reads, the node containers.

The operator is installed as a user installs it (`harness.helm`: `helm install
charts/rollout-operator`, the image built here, `image.pullPolicy=Never`); these helpers keep the
tests to what they check.
"""

from __future__ import annotations

import json
from typing import Any

from devcluster.cluster import Cluster
from harness.helm import CHART, FULLNAME, RELEASE, helm, helm_install_operator

__all__ = ["CHART", "FULLNAME", "RELEASE", "helm", "helm_install_operator"]


def describe_pods(cluster: Cluster, namespace: str) -> str:
    return cluster.kubectl("describe", "pods", "-n", namespace, check=False).stdout[-6000:]


def get_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return result


def node_containers(cluster: Cluster, namespace: str) -> list[str]:
    """Containers (sandboxes included) the node's containerd holds for pods of `namespace`."""
    result = cluster.ctr(
        "containers", "ls", "-q", f"labels.io.kubernetes.pod.namespace=={namespace}"
    )
    return result.stdout.split()


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item["type"] == type_:
            return dict(item)
    return {}
