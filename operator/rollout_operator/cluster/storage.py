"""How this operator process reaches a set's checkpoint volume (`StorageLocator`).

Records live on the set's storage volume, which every participant pod mounts. The operator
removes them (retention, finalizers; see `flows.records`) itself where it sees the volume: a
`hostPath` volume at its own path (devcluster runs the operator on the node, so it sees the
same folder the pods write), a `persistentVolumeClaim` at
`$ROLLOUT_OPERATOR_STORAGE_DIR/<namespace>/<claimName>` (the chart's `storage.claims`). Anywhere
else it asks the set's participants, or starts a cleanup pod of `$ROLLOUT_CLEANUP_IMAGE` (the
chart sets the operator's own image) that mounts the volume. A set whose records are in an S3-API
bucket has no volume here (`root` is None): the operator removes its keys over the bucket's
endpoint itself (`flows.records`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..model.api import S3Storage, StorageSpec

STORAGE_DIR_ENV: Final = "ROLLOUT_OPERATOR_STORAGE_DIR"
DEFAULT_STORAGE_DIR: Final = "/var/lib/rollout-operator/storage"
CLEANUP_IMAGE_ENV: Final = "ROLLOUT_CLEANUP_IMAGE"


def bucket_description(s3: S3Storage) -> str:
    """A bucket in words (endpoint, bucket, prefix; never its Secret's content)."""
    where = f"{s3.bucket}/{s3.prefix}" if s3.prefix else s3.bucket
    return f"bucket {where} at {s3.endpoint}"


@dataclass(frozen=True)
class StorageLocator:
    """Where this operator process sees a set's checkpoint volume (see the module docstring)."""

    claims_dir: Path | None = None
    cleanup_image: str | None = None
    """The image a records cleanup pod runs (it has `rollout-records`); None: no cleanup pods."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StorageLocator:
        env = os.environ if environ is None else environ
        return cls(
            Path(env.get(STORAGE_DIR_ENV) or DEFAULT_STORAGE_DIR),
            cleanup_image=env.get(CLEANUP_IMAGE_ENV) or None,
        )

    def root(self, namespace: str, storage: StorageSpec) -> Path | None:
        """The folder that is the volume's root here, or None when this process cannot see it
        (or the set keeps its records in a bucket)."""
        volume = storage.volume
        if volume is None:
            return None
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if isinstance(claim, str) and claim and self.claims_dir is not None:
            mounted = self.claims_dir / namespace / claim
            return mounted if mounted.is_dir() else None
        host = (volume.get("hostPath") or {}).get("path")
        if isinstance(host, str) and host:
            path = Path(host)
            return path if path.is_dir() else None
        return None

    def describe(self, namespace: str, storage: StorageSpec) -> str:
        """Where the records are, in words, for a message asking a person to remove them."""
        if storage.s3 is not None:
            return (
                f"{bucket_description(storage.s3)} (only the pods that mount Secret "
                f"{storage.s3.secret_name} hold its credentials)"
            )
        volume = storage.volume or {}
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim:
            return (
                f"claim {namespace}/{claim} (mount it into the operator at "
                f"{self.claims_dir or DEFAULT_STORAGE_DIR}/{namespace}/{claim})"
            )
        host = (volume.get("hostPath") or {}).get("path")
        if host:
            return f"hostPath {host} (not visible to the operator on its node)"
        return f"volume {sorted(volume)} (a kind the operator cannot mount)"
