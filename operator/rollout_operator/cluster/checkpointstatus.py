"""The one writer of a RolloutCheckpoint's status (docs/design.md#61-checkpoint).

Every flow that changes a checkpoint's status (its own flow, the restore's verdict, the
Failed-checkpoint repair) writes through a `CheckpointStatusWriter` made for its owner
(`model.checkpointowners.CheckpointOwner`). The writer:

- refuses a write the owner may not make over the status as stored
  (`check_checkpoint_owner` raises `ForeignCheckpointWrite`);
- puts the status in its wire form with one function (`status_body`), where the empty-list
  rule lives: a list in a merge patch replaces the stored one, and a list the model holds empty
  is left out of its wire form, so the lists a status may empty are sent as `[]`;
- writes one merge patch with the resourceVersion of the checkpoint as the flow knows it, so a
  lost race is a `Conflict`, never a silently overwritten field; `write_retrying` reads the
  checkpoint again and writes what `build` makes of it (the owner checked again), and keeps the
  written resourceVersion on the caller's object for its next write.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from ..model.api import RolloutCheckpoint, RolloutCheckpointStatus, dump, namespace_or_default
from ..model.checkpointowners import CheckpointOwner, check_checkpoint_owner
from .kube import Conflict, Kube

CONFLICT_TRIES: Final = 20
"""How often `write_retrying` writes before it gives up on a checkpoint that keeps changing."""

EMPTIED_LISTS: Final = ("blockers", "participants")
"""The status lists a write may empty (a failed checkpoint's participants, a retried one's
blockers): sent as `[]`, since a list left out of a merge patch stays as it was."""


class CheckpointGone(Exception):
    """The checkpoint was deleted while a write was retried."""


def status_body(status: RolloutCheckpointStatus) -> dict[str, Any]:
    """The whole status as a merge patch: its wire form, the emptied lists sent as `[]`."""
    body = dump(status)
    for key in EMPTIED_LISTS:
        body.setdefault(key, [])
    return body


Build = Callable[[RolloutCheckpoint], Mapping[str, Any] | None]
"""From the checkpoint as stored to the status patch to write (None: nothing to write)."""


class CheckpointStatusWriter:
    """Writes checkpoints' status on behalf of one owner."""

    def __init__(self, kube: Kube, owner: CheckpointOwner) -> None:
        self._kube = kube
        self.owner = owner

    async def write(self, ckpt: RolloutCheckpoint, body: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patch `body` (a wire status patch) over `ckpt`'s status, only if the
        checkpoint is still at `ckpt`'s resourceVersion (`Conflict` otherwise). The written
        object's resourceVersion goes onto `ckpt`; returns the written object."""
        check_checkpoint_owner(self.owner, ckpt.status, body)
        written = await self._kube.patch_checkpoint_status(
            namespace_or_default(ckpt.metadata.namespace),
            ckpt.metadata.name,
            body,
            resource_version=ckpt.metadata.resource_version,
        )
        ckpt.metadata.resource_version = (written.get("metadata") or {}).get("resourceVersion")
        return written

    async def write_retrying(
        self, ckpt: RolloutCheckpoint, build: Build, *, tries: int = CONFLICT_TRIES
    ) -> dict[str, Any] | None:
        """Write `build(ckpt)`; after a `Conflict`, read the checkpoint again and write what
        `build` makes of it, up to `tries` writes. Returns the written object (None when
        `build` found nothing to write); raises `CheckpointGone` when the checkpoint was
        deleted, `Conflict` when every try lost."""
        stored = ckpt
        namespace = namespace_or_default(ckpt.metadata.namespace)
        for _ in range(tries):
            body = build(stored)
            if body is None:
                return None
            try:
                written = await self.write(stored, body)
            except Conflict:
                stored = await self._again(namespace, stored)
                continue
            ckpt.metadata.resource_version = stored.metadata.resource_version
            return written
        raise Conflict(f"checkpoint {ckpt.metadata.name}: {tries} status writes lost to others")

    async def _again(self, namespace: str, refused: RolloutCheckpoint) -> RolloutCheckpoint:
        """The checkpoint after a refused write: the watch's copy when it is newer than the
        one refused (what changed is mostly this process's own finalizer patch, which the
        cache saw already: no request), else the API server's."""
        name = refused.metadata.name
        cached = await self._kube.get_checkpoint(namespace, name)
        if cached is not None:
            version = (cached.get("metadata") or {}).get("resourceVersion")
            if version != refused.metadata.resource_version:
                return RolloutCheckpoint.model_validate(cached)
        raw = await self._kube.get_checkpoint(namespace, name, fresh=True)
        if raw is None:
            raise CheckpointGone(name)
        return RolloutCheckpoint.model_validate(raw)


__all__ = [
    "CONFLICT_TRIES",
    "EMPTIED_LISTS",
    "CheckpointGone",
    "CheckpointStatusWriter",
    "status_body",
]
