"""OCI image archives written from local files, for the container node's own images.

No registry is reachable from this machine, yet containerd needs a sandbox ("pause") image and the
container-node tests need something to run. Both are single-layer images whose files come from
this machine (the pause binary devcluster builds, Debian's static busybox), written here as an
OCI image layout in a tar (what `ctr images import` reads). The archive is byte-for-byte
reproducible from its inputs: fixed mtimes, owners and order, so its digest is a cache key.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
_EPOCH = 0


@dataclass(frozen=True)
class ImageFile:
    """A file in the image: its bytes come from `source` on this machine, or `data`."""

    path: str
    source: Path | None = None
    data: bytes | None = None
    mode: int = 0o755


@dataclass(frozen=True)
class ImageSpec:
    """One single-layer linux/amd64 image: a name (`repo:tag`), files, symlinks, a command."""

    name: str
    files: Sequence[ImageFile]
    symlinks: Mapping[str, str] = field(default_factory=dict)
    directories: Sequence[str] = ()
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    env: Sequence[str] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)


def _tar_info(name: str, kind: bytes, mode: int, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name.lstrip("/"))
    info.type = kind
    info.mode = mode
    info.size = size
    info.mtime = _EPOCH
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _parents(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _layer(spec: ImageSpec) -> bytes:
    directories = set(spec.directories)
    for path in [*(f.path for f in spec.files), *spec.symlinks]:
        directories.update(_parents(path))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in sorted(d.strip("/") for d in directories):
            mode = 0o1777 if directory == "tmp" else 0o755
            tar.addfile(_tar_info(directory + "/", tarfile.DIRTYPE, mode))
        for item in sorted(spec.files, key=lambda f: f.path):
            data = item.data if item.data is not None else _read(item)
            tar.addfile(
                _tar_info(item.path, tarfile.REGTYPE, item.mode, len(data)), io.BytesIO(data)
            )
        for link, target in sorted(spec.symlinks.items()):
            info = _tar_info(link, tarfile.SYMTYPE, 0o777)
            info.linkname = target
            tar.addfile(info)
    return buffer.getvalue()


def _read(item: ImageFile) -> bytes:
    if item.source is None:
        raise ValueError(f"image file {item.path} has neither source nor data")
    return item.source.read_bytes()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def write(spec: ImageSpec, archive: Path) -> str:
    """Writes `spec` as an OCI image-layout tar at `archive`; returns the manifest digest."""
    layer = _layer(spec)
    config = _json(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": list(spec.env),
                "Entrypoint": list(spec.entrypoint) or None,
                "Cmd": list(spec.cmd) or None,
                "WorkingDir": "/",
            },
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
            "history": [{"created_by": "devcluster.ociarchive", "created": "1970-01-01T00:00:00Z"}],
            "created": "1970-01-01T00:00:00Z",
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": {
                "mediaType": CONFIG_MEDIA_TYPE,
                "digest": _digest(config),
                "size": len(config),
            },
            "layers": [
                {"mediaType": LAYER_MEDIA_TYPE, "digest": _digest(layer), "size": len(layer)}
            ],
        }
    )
    _, _, tag = spec.name.rpartition(":")
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [
                {
                    "mediaType": MANIFEST_MEDIA_TYPE,
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": spec.name,
                        "org.opencontainers.image.ref.name": tag,
                    },
                }
            ],
        }
    )
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_suffix(archive.suffix + ".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries: list[tuple[str, bytes]] = [
            ("oci-layout", _json({"imageLayoutVersion": "1.0.0"})),
            ("index.json", index),
        ]
        entries += [
            (f"blobs/sha256/{_digest(blob).removeprefix('sha256:')}", blob)
            for blob in (layer, config, manifest)
        ]
        for directory in ("blobs/", "blobs/sha256/"):
            tar.addfile(_tar_info(directory, tarfile.DIRTYPE, 0o755))
        for name, data in entries:
            tar.addfile(_tar_info(name, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    tmp.replace(archive)
    return _digest(manifest)
