"""The project's image, built here for real from the Dockerfile (buildah, local Debian base).

What a user of the image relies on: the archive names the image and carries the Dockerfile's
config (non-root numeric user, the operator's help as default command, the ports), every console
script runs in a container of it as that user on a read-only-to-it root, and a second build with
the same inputs is the cached one (same digest) instead of a rebuild.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path
from typing import Any

import pytest

from devcluster.image import BuildResult, build_project_image, run_in_image

# A cold build (base and image) takes minutes on a loaded two-core machine; `make test` builds it
# first (`make image`), so here it is usually found cached.
pytestmark = pytest.mark.timeout(900)

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _archive_json(build: BuildResult, member: str) -> Any:
    with tarfile.open(build.image.archive) as archive:
        extracted = archive.extractfile(member)
        assert extracted is not None, member
        return json.load(extracted)


def test_the_image_builds_from_the_dockerfile_on_the_local_base(
    project_image_build: BuildResult,
) -> None:
    image = project_image_build.image
    assert image.name == "docker.io/library/rollout-checkpoint-operator:dev"
    assert image.short_name == "rollout-checkpoint-operator:dev"
    assert DIGEST.fullmatch(image.digest), image.digest
    assert DIGEST.fullmatch(image.image_id), image.image_id
    assert image.archive.stat().st_size == image.archive_bytes > 0
    build_log = (image.directory / "build.log").read_text()
    # Both stages of the Dockerfile ran, FROM the local base passed as PYTHON_IMAGE.
    base = f"localhost/rollout-base:{image.base}"
    assert f"FROM {base} AS builder" in build_log
    assert f"FROM {base} AS runtime" in build_log
    assert "Successfully installed" in build_log
    assert "rollout-checkpoint-operator-0" in build_log


def test_the_archive_names_the_image_and_carries_the_dockerfiles_config(
    project_image_build: BuildResult,
) -> None:
    image = project_image_build.image
    index = _archive_json(project_image_build, "index.json")
    [manifest_entry] = index["manifests"]
    assert manifest_entry["digest"] == image.digest
    assert manifest_entry["annotations"]["org.opencontainers.image.ref.name"] == image.name
    manifest = _archive_json(project_image_build, f"blobs/sha256/{image.digest[7:]}")
    assert manifest["config"]["digest"] == image.image_id
    config = _archive_json(project_image_build, f"blobs/sha256/{image.image_id[7:]}")["config"]
    assert config["User"] == "10001:10001"
    assert config["Cmd"] == ["rollout-operator", "--help"]
    assert set(config["ExposedPorts"]) == {"8080/tcp", "9090/tcp", "8000/tcp"}
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["PATH"].startswith("/opt/rollout/bin:")
    assert env["HOME"] == "/tmp"
    assert config["Labels"]["org.opencontainers.image.title"] == "rollout-checkpoint-operator"


def test_the_console_scripts_run_in_a_container_of_the_image_as_its_user(
    project_image_build: BuildResult,
) -> None:
    script = (
        'echo "user $(id -u):$(id -g)"; '
        "rollout-operator --help; rollout-server --help; rollout-collect --help; "
        "rollout-coordinate --help; "
        "python -c 'import sys; print(\"python\", sys.version_info[:2])'; "
        "if touch /opt/rollout/written 2>/dev/null; then echo ROOT-WRITABLE; fi"
    )
    result = run_in_image(project_image_build.image, ["sh", "-ec", script])
    output = f"stdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-2000:]}"
    assert result.returncode == 0, output
    lines = result.stdout.splitlines()
    assert "user 10001:10001" in lines, output
    for tool in ("rollout-operator", "rollout-server", "rollout-collect", "rollout-coordinate"):
        assert f"usage: {tool}" in result.stdout, output
    assert "python (3, 11)" in lines, output
    assert "ROOT-WRITABLE" not in result.stdout


def test_a_second_build_with_the_same_inputs_is_the_cached_one(
    project_image_build: BuildResult, image_inputs: Path
) -> None:
    again = build_project_image(image_inputs)
    assert again.was_cached, again.log
    assert again.image == project_image_build.image
