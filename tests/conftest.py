"""Shared pytest configuration: tests are marked by the folder they live in.

The devcluster fixtures live here rather than in `e2e/conftest.py` because two folders use them
(`e2e/` and `adversarial/`) and a session fixture defined in both would start two clusters:

- `cluster` (session): a devcluster started once per session in a temporary directory and
  stopped at the end (teardown fails if any process survives), or the running devcluster whose
  kubeconfig `ROLLOUT_E2E_KUBECONFIG` names, left running (e.g. `make cluster` then
  `ROLLOUT_E2E_KUBECONFIG=.devcluster/kubeconfig pytest tests/e2e`). Nothing starts unless a
  test asks for it.
- `container_cluster` (session): the same on a container node (real kubelet, containerd, runc,
  kube-proxy, CNI bridge; `make node-binaries`, root), or the running one that
  `ROLLOUT_E2E_CONTAINER_KUBECONFIG` names; its teardown also fails if a mount, cgroup, veth or
  network namespace it created is left. Images go in with `container_cluster.import_image`.
- `namespace`: a fresh namespace per test, with its `default` ServiceAccount in place (pods are
  refused before it exists); its pods are force-deleted and the namespace deleted afterwards.
  Set `ROLLOUT_E2E_KEEP_NAMESPACES=1` to keep them for debugging.

`make test` runs the suite on two pytest-xdist workers: each worker is a session of its own and
starts its own process-node devcluster when a test first asks for one (devcluster reserves pod
IP ranges and ports machine-wide, so two run side by side), and the tests that need the container
node are one scheduling unit, so only one worker ever starts it. A module whose module fixture
is costly (Kueue's controller) is one unit too, so it starts once.

Fixtures that more than one folder uses and that are not about the cluster itself are plugins in
the `testsupport` package, registered here by `pytest_plugins` (pytest reads it only in this,
the root conftest): `testsupport.operator_fixtures` (`operator`, `storage_dir`, `resources`, for
`e2e/` and `adversarial/`) and `testsupport.s3_server` (`s3_server`, `s3_bucket`: a real S3
server on loopback and a fresh bucket per test, for every folder). Shared helpers that are not
fixtures are imported from `testsupport` modules; no test module imports another.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.cluster import Cluster
from devcluster.testing import e2e_cluster, namespace_name
from harness.objects import create_namespace, delete_namespace

pytest_plugins = ["testsupport.operator_fixtures", "testsupport.s3_server"]

_MARK_BY_FOLDER = {
    "unit": pytest.mark.unit,
    "protocol": pytest.mark.protocol,
    "e2e": pytest.mark.e2e,
    "adversarial": pytest.mark.adversarial,
    "containers": pytest.mark.containers,
    "kind": pytest.mark.kind,
}


CONTAINER_NODE_GROUP = "container-node"
"""The tests that start or use a container node: one machine holds one (its kube-proxy and
kubelet bind fixed ports), so `make test`'s two xdist workers run these on one worker, one after
another, while the other takes the rest (`pytest_xdist_make_scheduler` below)."""

_CONTAINER_NODE_FILES = ("tests/e2e/test_container_node.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        mark = _MARK_BY_FOLDER.get(Path(str(item.fspath)).parent.name)
        if mark is not None:
            item.add_marker(mark)


_WHOLE_MODULES = ("tests/e2e/test_kueue.py",)
"""Modules that one worker runs whole: their module fixture is costly (Kueue's controller,
about 25 s to start), and split across the two workers it would start twice."""


def _scope_of(nodeid: str) -> str:
    """The xdist scheduling unit of a test: the container-node group, a whole module of
    `_WHOLE_MODULES`, else the test itself."""
    path = nodeid.split("::", 1)[0]
    # tests/kind: its kubelets change the same machine-wide tunables a container node records
    # and puts back (docs/kind.md), so the two never run at once.
    if path.startswith(("tests/containers/", "tests/kind/")) or path in _CONTAINER_NODE_FILES:
        return CONTAINER_NODE_GROUP
    if path in _WHOLE_MODULES:
        return path
    return nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling with our scopes: each test is a unit of its own except the
    container-node group, which one worker runs whole (the largest scope is handed out first,
    so it starts at once). `--dist loadgroup` would do this with `xdist_group` marks, but
    pytest-xdist 3.8 renames the node ids it groups by in a way pytest 9 no longer reads."""
    from xdist.scheduler import LoadScopeScheduling

    class ContainerNodeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope_of(nodeid)

    return ContainerNodeScheduling(config, log)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with e2e_cluster(tmp_path_factory.mktemp("e2e")) as running:
        yield running


@pytest.fixture(scope="session")
def container_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with e2e_cluster(tmp_path_factory.mktemp("e2e-containers"), node_runtime="containerd") as up:
        yield up


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    yield from _fresh_namespace(cluster, request)


@pytest.fixture
def container_namespace(
    container_cluster: Cluster, request: pytest.FixtureRequest
) -> Iterator[str]:
    """`namespace` on the container node's cluster."""
    yield from _fresh_namespace(container_cluster, request)


def _fresh_namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = namespace_name(request.node.name)
    create_namespace(cluster, name)
    yield name
    if not os.environ.get("ROLLOUT_E2E_KEEP_NAMESPACES"):
        delete_namespace(cluster, name)
