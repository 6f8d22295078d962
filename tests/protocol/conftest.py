"""Fixtures for protocol tests: clusters of real server processes (see
`testsupport.server_processes`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testsupport.server_processes import Cluster


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Any]:
    """Clusters for tests that crash them; every one is stopped at teardown."""
    clusters: list[Cluster] = []

    def make(**kwargs: Any) -> Cluster:
        cluster = Cluster(root=tmp_path / f"cluster-{len(clusters)}", **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the tests that never crash it (saves four process starts per test)."""
    cluster = Cluster(root=tmp_path_factory.mktemp("shared"))
    cluster.start(0)
    try:
        yield cluster
    finally:
        cluster.stop()
