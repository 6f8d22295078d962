"""The operator installed by Helm, as a user installs it, on a devcluster container node.

`install_operator` runs the pinned helm (`make cluster-binaries` builds it) with
`charts/rollout-operator`, the image built here (`image/build.sh`, imported into the node's
containerd) and `image.pullPolicy=Never`, and waits for the Deployment; `uninstall_operator`
removes the release. Shared by `make demo-containers`, the container-node tests and benches.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Final, Protocol

from devcluster.cluster import Cluster
from devcluster.errors import DevclusterError
from devcluster.image import ProjectImage
from devcluster.paths import find_binaries

CHART: Final = Path(__file__).resolve().parents[1] / "charts" / "rollout-operator"
RELEASE: Final = "rel"
FULLNAME: Final = f"{RELEASE}-rollout-operator"


class HelmTarget(Protocol):
    """A cluster helm runs against: a devcluster `Cluster` or a `harness.providers` provider."""

    @property
    def dir(self) -> Path:
        """A folder of the cluster's own, for helm's caches."""
        ...

    @property
    def kubeconfig(self) -> Path: ...


def helm(cluster: HelmTarget, *args: str, timeout: float = 420) -> subprocess.CompletedProcess[str]:
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
    cluster: HelmTarget, namespace: str, image: ProjectImage, *values: str
) -> subprocess.CompletedProcess[str]:
    """`helm install rel charts/rollout-operator` with the image built here, waiting for Ready."""
    tag = image.short_name.rsplit(":", 1)[1]
    argv = ["install", RELEASE, str(CHART), "--namespace", namespace]
    argv += ["--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never"]
    for value in values:
        argv += ["--set", value]
    return helm(cluster, *argv, "--wait", "--timeout", "300s")


def install_operator(cluster: Cluster, namespace: str, image: ProjectImage) -> None:
    """`helm_install_operator`, failing with helm's error and the pods' description."""
    result = helm_install_operator(cluster, namespace, image)
    if result.returncode != 0:
        pods = cluster.kubectl("describe", "pods", "-n", namespace, check=False).stdout
        raise DevclusterError(f"helm install failed: {result.stderr.strip()}\n{pods[-4000:]}")


def uninstall_operator(cluster: Cluster, namespace: str) -> None:
    helm(cluster, "uninstall", RELEASE, "--namespace", namespace, "--wait", "--timeout", "120s")
