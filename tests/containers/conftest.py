"""Fixtures for the container-node suite: the project's image, built here from its Dockerfile.

- `project_image_build` (session): `image/build.sh` (buildah on the local Debian base) run once
  per session on a snapshot of the checkout's build inputs (`image_inputs`), so every test of
  the session sees one state of a checkout others may be editing. Cached by a digest of the
  inputs: only the first session on a machine with these inputs pays for the build. A missing
  buildah fails with the command that installs it (`make image`).
- `container_provider` (session): the cluster the suite runs against, a
  `harness.providers.ContainerClusterProvider`: devcluster's container node (`container_cluster`
  from `tests/conftest.py`, a real kubelet with containerd; `make node-binaries`) by default, or
  an existing kind cluster with `ROLLOUT_E2E_PROVIDER=kind` and `KIND_CLUSTER` (`make kind-e2e`).
  Its teardown fails if a container of a test namespace is left on the node.
- `image_on_node` (session): the project's image on the provider's node (devcluster: the buildah
  build above, imported; kind: `docker build` and `kind load image-archive`).
- `provider_namespace`: a fresh namespace per test on the provider's cluster.
- `storage`: a hostPath folder for a set's records, writable by the image's user.
- `operator_release`: the operator installed by Helm into `provider_namespace` (watching it);
  the test's sets are deleted before the release is uninstalled, and the sets', checkpoints',
  events' and operator's state is printed first (pytest shows it when the test failed).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from container_support import describe_pods, diagnostics, helm, helm_install_operator

from devcluster.cluster import Cluster
from devcluster.image import BuildResult, ProjectImage, build_project_image, snapshot_build_inputs
from devcluster.testing import namespace_name, wait_for_sync
from harness.helm import RELEASE
from harness.objects import create_namespace, delete_namespace
from harness.providers import (
    ContainerClusterProvider,
    DevclusterProvider,
    kind_provider_from_environment,
    provider_name_from_environment,
)

TEST_NAMESPACE_PREFIX = "e2e-"


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def image_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout's build inputs as this session found them (others may edit the checkout)."""
    return snapshot_build_inputs(tmp_path_factory.mktemp("image-inputs"))


@pytest.fixture(scope="session")
def project_image_build(image_inputs: Path) -> BuildResult:
    return build_project_image(image_inputs)


@pytest.fixture(scope="session")
def container_provider(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ContainerClusterProvider]:
    provider: ContainerClusterProvider
    if provider_name_from_environment() == "kind":
        provider = kind_provider_from_environment(tmp_path_factory.mktemp("kind"))
    else:
        cluster: Cluster = request.getfixturevalue("container_cluster")
        provider = DevclusterProvider(cluster)
    yield provider
    # The namespaces go without waiting; their containers must be gone from the node soon after.
    wait_for_sync(
        lambda: not provider.leftovers(TEST_NAMESPACE_PREFIX),
        timeout=180,
        what=f"no container of a test namespace left on the {provider.name} node",
        interval=1.0,
    )


@pytest.fixture
def provider_namespace(
    container_provider: ContainerClusterProvider, request: pytest.FixtureRequest
) -> Iterator[str]:
    """`namespace` of `tests/conftest.py` on the provider's cluster: created with its `default`
    ServiceAccount in place, its pods force-deleted and itself deleted afterwards (kept with
    `ROLLOUT_E2E_KEEP_NAMESPACES=1`)."""
    name = namespace_name(request.node.name)
    create_namespace(container_provider, name)
    yield name
    if not os.environ.get("ROLLOUT_E2E_KEEP_NAMESPACES"):
        delete_namespace(container_provider, name)


@pytest.fixture(scope="session")
def image_on_node(container_provider: ContainerClusterProvider, image_inputs: Path) -> ProjectImage:
    """The project's image on the provider's node (containerd namespace k8s.io)."""
    return container_provider.load_project_image(image_inputs)


@pytest.fixture
def storage(container_provider: ContainerClusterProvider) -> Iterator[Path]:
    """The hostPath the participants write records to: world-writable with the sticky bit (the
    servers run as the image's user 10001), outside pytest's root-only temporary folder; made on
    the node by the provider (on kind the node is a container, the folder is inside it)."""
    folder = Path(tempfile.mkdtemp(prefix="rollout-containers-", dir="/tmp"))
    container_provider.make_writable_folder(folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def operator_release(
    container_provider: ContainerClusterProvider,
    provider_namespace: str,
    image_on_node: ProjectImage,
) -> Iterator[str]:
    result = helm_install_operator(container_provider, provider_namespace, image_on_node)
    assert result.returncode == 0, (
        f"{result.stderr}\n{describe_pods(container_provider, provider_namespace)}"
    )
    try:
        yield provider_namespace
    finally:
        print(diagnostics(container_provider, provider_namespace))
        # The set goes first (its finalizers need the operator), then the release, always: a
        # release left behind keeps its cluster-wide ClusterRole and every later install fails.
        try:
            container_provider.kubectl(
                "delete",
                "rolloutset",
                "--all",
                "-n",
                provider_namespace,
                "--timeout=120s",
                check=False,
                timeout=150.0,  # past kubectl's own --timeout, so kubectl says what it waited on
            )
        finally:
            helm(container_provider, "uninstall", RELEASE, "--namespace", provider_namespace)
