"""The project's image as the container node and its tests use it, built by `image/build.sh`.

`image/build.sh` builds the image from the Dockerfile with buildah on a local Debian base and
caches it as an OCI archive keyed by a digest of its inputs; this module calls it and reads what it
wrote (`image.json`), so tests, the demo and benches share one cached build. `run_in_image` runs a
command in the image with buildah in a throwaway storage and a private mount namespace, so nothing
(container, mount, layer) outlives the call.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from devcluster.errors import DevclusterError
from devcluster.paths import REPO_ROOT

BUILDAH_CONF = REPO_ROOT / "image" / "containers.conf"
"""The project's own containers.conf for buildah: runc as the OCI runtime (crun, which buildah
prefers where podman brought it, refuses these machines' hybrid cgroup layout)."""


@dataclass(frozen=True)
class ProjectImage:
    """One cached build: its archive and what `image/build.sh` recorded about it."""

    directory: Path
    name: str
    """Fully qualified (`docker.io/library/rollout-checkpoint-operator:dev`): the name the
    kubelet resolves the chart's and examples' short name to."""
    digest: str
    """The manifest digest (`sha256:...`)."""
    image_id: str
    """The config digest, the id containerd and buildah list."""
    size_bytes: int
    archive_bytes: int
    inputs: str
    base: str
    build_seconds: int

    @property
    def archive(self) -> Path:
        return self.directory / "image.oci.tar"

    @property
    def short_name(self) -> str:
        """The name manifests use (`rollout-checkpoint-operator:dev`)."""
        return self.name.removeprefix("docker.io/library/")

    @classmethod
    def read(cls, directory: Path) -> ProjectImage:
        info = json.loads((directory / "image.json").read_text())
        return cls(
            directory=directory,
            name=str(info["name"]),
            digest=str(info["digest"]),
            image_id=str(info["id"]),
            size_bytes=int(info["size_bytes"]),
            archive_bytes=int(info["archive_bytes"]),
            inputs=str(info["inputs"]),
            base=str(info["base"]),
            build_seconds=int(info["build_seconds"]),
        )


@dataclass(frozen=True)
class BuildResult:
    image: ProjectImage
    log: str
    """What the build script printed on stderr (progress lines, the summary)."""

    @property
    def was_cached(self) -> bool:
        return "[image] cached (" in self.log


BUILD_INPUTS = (
    "Dockerfile",
    ".dockerignore",
    "pyproject.toml",
    "README.md",
    "operator",
    "servers",
    "protocol",
    "image",
)
"""What `image/build.sh` reads from a checkout (the Dockerfile's context and the scripts)."""


def snapshot_build_inputs(destination: Path, source: Path = REPO_ROOT) -> Path:
    """Copies the build inputs of `source` to `destination`, so that a test session builds, and
    compares against, one fixed state of a checkout that may be edited meanwhile."""
    for name in BUILD_INPUTS:
        origin = source / name
        if origin.is_dir():
            shutil.copytree(
                origin,
                destination / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
            )
        else:
            destination.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, destination / name)
    return destination


def build_project_image(source: Path = REPO_ROOT, timeout: float = 1200) -> BuildResult:
    """Builds the image of the checkout (or copy of one) at `source`, or finds it cached; fails
    with the script's own error lines."""
    missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        raise DevclusterError(
            f"{' and '.join(missing)} not installed: run `make image` once (it installs them from "
            "Debian's packages and builds the image)"
        )
    script = source / "image" / "build.sh"
    done = subprocess.run(
        [str(script)], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise DevclusterError(
            f"image/build.sh failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        )
    directory = Path(done.stdout.strip().splitlines()[-1])
    return BuildResult(image=ProjectImage.read(directory), log=done.stderr)


def run_in_image(
    image: ProjectImage, argv: list[str], timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Runs `argv` in a container of the image (buildah over runc, no network).

    The container runs as the image's own user, in a storage created for this call and removed
    after it, inside a private mount namespace: no mount, container or layer outlives the call.
    """
    with tempfile.TemporaryDirectory(prefix="rollout-image-run-") as scratch:
        script = (
            'set -eu; s="--root $1/storage --runroot $1/run --storage-driver overlay"; shift; '
            'c=$(buildah $s from --quiet --pull-never "oci-archive:$1"); shift; '
            'trap "buildah $s rm $c >/dev/null" EXIT; '
            'buildah $s run --isolation oci --network none "$c" -- "$@"'
        )
        return subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                script,
                "run-in-image",
                scratch,
                str(image.archive),
                *argv,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            # runc, whatever the machine's containers.conf says (image/containers.conf)
            env={**os.environ, "CONTAINERS_CONF": str(BUILDAH_CONF)},
        )
