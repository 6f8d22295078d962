"""Fixtures for end-to-end tests on a real Kubernetes control plane (devcluster).

- `cluster` (session) and `namespace`: in `tests/conftest.py`, shared with `tests/adversarial/`
  (one devcluster per session whichever folders run).
- `kube`: a kubernetes_asyncio `ApiClient` for the cluster, closed after the test.

Waiting helpers (`wait_for`, `wait_for_pod`, ...) live in `devcluster.testing`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.cluster import Cluster
from devcluster.kube import open_api


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
