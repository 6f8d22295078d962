"""Fixtures for end-to-end tests on a real Kubernetes control plane (devcluster).

- `cluster` (session) and `namespace`: in `tests/conftest.py`, shared with `tests/adversarial/`
  (one devcluster per session whichever folders run).
- `kube`: a kubernetes_asyncio `ApiClient` for the cluster, closed after the test.
- `crds` (module): the project's CRDs and Kueue's applied and Established, for the RBAC tests
  (test_rbac.py, test_sharding.py; their helpers are in `rbac_support`). A module that defines
  its own `crds` (test_policy_validation.py) uses that one instead.
- `operator`, `storage_dir`, `resources`: in `testsupport.operator_fixtures`, a plugin that
  `tests/conftest.py` registers (shared with `tests/adversarial/`).

Waiting helpers (`wait_for`, `wait_for_pod`, ...) live in `devcluster.testing`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from rbac_support import CRDS, GROUP

from devcluster import kueue
from devcluster.cluster import Cluster
from devcluster.kube import open_api
from harness.objects import wait_established


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


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


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    # Kueue's CRDs too (no Kueue controller): the chart grants Workloads, and the RBAC tests
    # prove those grants like every other (`make cluster-binaries` builds Kueue).
    kueue.apply_crds(cluster)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    wait_established(cluster, [f"crd/rolloutsets.{GROUP}", f"crd/rolloutcheckpoints.{GROUP}"])
