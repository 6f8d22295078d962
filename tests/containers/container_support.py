"""Helpers of the container-node suite: helm on the devcluster, JSON reads, the node containers.

The operator is installed as a user installs it (`helm install charts/rollout-operator`, the image
built here, `image.pullPolicy=Never`); these helpers keep the tests to what they check.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from devcluster.cluster import Cluster
from devcluster.image import ProjectImage
from devcluster.paths import find_binaries

CHART = Path(__file__).resolve().parents[2] / "charts" / "rollout-operator"
RELEASE = "rel"
FULLNAME = f"{RELEASE}-rollout-operator"


def helm(cluster: Cluster, *args: str, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    """The pinned helm on the cluster's kubeconfig, its caches under the cluster's folder."""
    binary = find_binaries(("helm",))["helm"]
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(cluster.dir / "helm" / "cache"),
        "HELM_CONFIG_HOME": str(cluster.dir / "helm" / "config"),
        "HELM_DATA_HOME": str(cluster.dir / "helm" / "data"),
    }
    argv = [str(binary), *args, "--kubeconfig", str(cluster.kubeconfig)]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def helm_install_operator(
    cluster: Cluster, namespace: str, image: ProjectImage, *values: str
) -> subprocess.CompletedProcess[str]:
    """`helm install rel charts/rollout-operator` with the image built here, waiting for Ready."""
    tag = image.short_name.rsplit(":", 1)[1]
    argv = ["install", RELEASE, str(CHART), "--namespace", namespace]
    argv += ["--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never"]
    for value in values:
        argv += ["--set", value]
    return helm(cluster, *argv, "--wait", "--timeout", "300s")


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
