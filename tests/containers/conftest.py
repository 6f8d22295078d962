"""Fixtures for the container-node suite: the project's image, built here from its Dockerfile.

- `project_image_build` (session): `image/build.sh` (buildah on the local Debian base) run once
  per session on a snapshot of the checkout's build inputs (`image_inputs`), so every test of
  the session sees one state of a checkout others may be editing. Cached by a digest of the
  inputs: only the first session on a machine with these inputs pays for the build. A missing
  buildah fails with the command that installs it (`make image`).
- `image_on_node` (session): that image imported into the container node's containerd.
- `container_cluster` and `container_namespace`: in `tests/conftest.py` (a real kubelet with
  containerd; `make node-binaries`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from devcluster.image import BuildResult, ProjectImage, build_project_image, snapshot_build_inputs


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
def image_on_node(container_cluster: Cluster, project_image_build: BuildResult) -> ProjectImage:
    """The project's image, imported into the container node's containerd (namespace k8s.io)."""
    image = project_image_build.image
    container_cluster.import_image(image.archive)
    listed = container_cluster.ctr("images", "ls", "-q").stdout.split()
    assert image.name in listed, listed
    return image
