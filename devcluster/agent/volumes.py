"""Volumes, within what host processes without a mount namespace can honour.

A hostPath volume mounted at its own path is the one kind that means the same thing here as on a
real node. A Secret volume is the other kind supported, as far as a process without a mount
namespace allows: its keys are written as files (mode 0600) into a folder of the pod's own work
directory before each container starts, and every env value of the container that names the
mount path (or a path below it) names that folder instead (`secret_volume_env`). A program that
finds the files through its env (as the participants find their bucket's credentials through
`ROLLOUT_STORAGE_S3_CREDENTIALS_DIR`) reads them as on a real node; one that opens the mount path
from a literal does not find them. The service-account token volume that admission adds to every
pod is skipped (processes cannot see a per-pod /var/run/secrets). Anything else that a container
mounts fails the pod with a reason, rather than silently pointing it at host paths.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import anyio
import anyio.to_thread

from devcluster.agent.env import ConfigError, ObjectReader, SpecError
from devcluster.agent.podmodel import Container, Pod, Volume

_SERVICE_ACCOUNT_VOLUME_PREFIX = "kube-api-access-"


def _is_token_volume(volume: Volume) -> bool:
    return volume.projected is not None and volume.name.startswith(_SERVICE_ACCOUNT_VOLUME_PREFIX)


def prepare_volumes(pod: Pod, containers: list[Container]) -> None:
    """Checks every mount and creates `DirectoryOrCreate`/`FileOrCreate` host paths."""
    volumes = {volume.name: volume for volume in pod.spec.volumes}
    for container in containers:
        for mount in container.volume_mounts:
            volume = volumes.get(mount.name)
            if volume is None:
                raise SpecError("UnsupportedVolume", f"volumeMount {mount.name!r} names no volume")
            if _is_token_volume(volume):
                continue
            where = f"volume {volume.name!r} ({volume.kind()}) mounted at {mount.mount_path}"
            if volume.secret is not None:
                if mount.sub_path or volume.secret.items:
                    raise SpecError(
                        "UnsupportedVolume",
                        f"{where} in container {container.name!r}: devcluster mounts a whole "
                        "Secret (no subPath, no items)",
                    )
                continue
            if volume.host_path is None:
                raise SpecError(
                    "UnsupportedVolume",
                    f"{where} in container {container.name!r}: devcluster runs containers as host "
                    "processes without a mount namespace and supports only hostPath volumes whose "
                    "mountPath equals their path",
                )
            host = os.path.normpath(volume.host_path.path)
            if os.path.normpath(mount.mount_path) != host or mount.sub_path:
                raise SpecError(
                    "UnsupportedVolume",
                    f"{where} in container {container.name!r}: a hostPath volume must be mounted "
                    f"at its own path ({host}) without subPath on devcluster",
                )
            _ensure_host_path(Path(host), volume.host_path.type or "", where)


def _ensure_host_path(path: Path, kind: str, where: str) -> None:
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    elif kind == "Directory" and not path.is_dir():
        raise SpecError("HostPathMissing", f"{where}: {path} is not a directory")
    elif kind == "File" and not path.is_file():
        raise SpecError("HostPathMissing", f"{where}: {path} is not a file")


async def secret_volume_env(
    pod: Pod, container: Container, env: Mapping[str, str], reader: ObjectReader, into: Path
) -> dict[str, str]:
    """Write the Secret volumes `container` mounts into folders below `into` (one per volume,
    read afresh, so a changed Secret reaches the next start) and return `env` with each value
    that names a mount path, or a path below it, naming the folder instead (module docstring).

    A missing Secret is a `ConfigError` (the container waits and it is tried again), unless the
    volume is optional, which gives an empty folder as the kubelet does."""
    volumes = {volume.name: volume for volume in pod.spec.volumes}
    moved: dict[str, Path] = {}
    for mount in container.volume_mounts:
        volume = volumes.get(mount.name)
        if volume is None or volume.secret is None:
            continue
        source = volume.secret
        data = await reader.secret(pod.metadata.namespace, source.secret_name)
        if data is None and not source.optional:
            raise ConfigError(
                f'secret "{source.secret_name}" not found (volume {volume.name!r} of container '
                f"{container.name!r})"
            )
        folder = into / "volumes" / volume.name
        await anyio.to_thread.run_sync(_write_files, folder, data or {})
        moved[str(PurePosixPath(mount.mount_path))] = folder
    if not moved:
        return dict(env)
    return {name: _moved(value, moved) for name, value in env.items()}


def _write_files(folder: Path, data: Mapping[str, str]) -> None:
    """The Secret's keys as files of `folder` (0700), each written under a temporary name and
    renamed, so a reader never sees half a key; keys no longer in the Secret are removed."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for key, value in data.items():
        if "/" in key or key in ("", ".", ".."):
            raise SpecError("UnsupportedVolume", f"secret key {key!r} is not a file name")
        temporary = folder / f".{key}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(value)
        os.replace(temporary, folder / key)
    for stale in folder.iterdir():
        if stale.name not in data:
            stale.unlink()


def _moved(value: str, moved: Mapping[str, Path]) -> str:
    for mount_path, folder in moved.items():
        if value == mount_path:
            return str(folder)
        if value.startswith(mount_path + "/"):
            return str(folder) + value[len(mount_path) :]
    return value
