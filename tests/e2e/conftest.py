"""Fixtures for end-to-end tests on a real Kubernetes control plane (devcluster).

- `cluster` (session): a devcluster started once per session in a temporary directory and stopped
  at the end (teardown fails if any process survives), or the running devcluster whose kubeconfig
  `ROLLOUT_E2E_KUBECONFIG` names, left running (e.g. `make cluster` then
  `ROLLOUT_E2E_KUBECONFIG=.devcluster/kubeconfig pytest tests/e2e`).
- `namespace`: a fresh namespace per test, with its `default` ServiceAccount in place (pods are
  refused before it exists); its pods are force-deleted and the namespace deleted afterwards.
  Set `ROLLOUT_E2E_KEEP_NAMESPACES=1` to keep them for debugging.
- `kube`: a kubernetes_asyncio `ApiClient` for the cluster, closed after the test.

Waiting helpers (`wait_for`, `wait_for_pod`, ...) live in `devcluster.testing`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.cluster import Cluster
from devcluster.kube import open_api
from devcluster.testing import e2e_cluster, namespace_name, wait_for_sync


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with e2e_cluster(tmp_path_factory.mktemp("e2e")) as running:
        yield running


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = namespace_name(request.node.name)
    cluster.kubectl("create", "namespace", name)
    wait_for_sync(
        lambda: (
            cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
            == 0
        ),
        timeout=30,
        what=f"the default ServiceAccount in namespace {name}",
        interval=0.2,
    )
    yield name
    if os.environ.get("ROLLOUT_E2E_KEEP_NAMESPACES"):
        return
    cluster.kubectl(
        "delete",
        "pods",
        "--all",
        "-n",
        name,
        "--force",
        "--grace-period=0",
        "--wait=false",
        check=False,
    )
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
async def kube(cluster: Cluster) -> AsyncIterator[Any]:
    async with open_api(cluster.kubeconfig) as api:
        yield api


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    """A host folder pods can mount as hostPath (mountPath == path) to hand files to the test."""
    folder = tmp_path / "shared"
    folder.mkdir()
    return folder
