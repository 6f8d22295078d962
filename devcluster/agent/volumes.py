"""Volumes, within what host processes without a mount namespace can honour.

A hostPath volume mounted at its own path is the one kind that means the same thing here as on a
real node, so it is the one kind supported. The service-account token volume that admission adds
to every pod is skipped (processes cannot see a per-pod /var/run/secrets). Anything else that a
container mounts fails the pod with a reason, rather than silently pointing it at host paths.
"""

from __future__ import annotations

import os
from pathlib import Path

from devcluster.agent.env import SpecError
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
