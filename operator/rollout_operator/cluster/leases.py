"""One checkpoint at a time per set: a `coordination.k8s.io/v1` Lease per set.

Why a Lease: docs/design.md#66-one-checkpoint-at-a-time.

The Lease `<set>-checkpoint` in the set's namespace (owned by the set, so it goes with it) names
the checkpoint that holds the set's slot in `spec.holderIdentity`; `kubectl get lease` shows it.
It is taken and released by compare-and-swap: a patch with the resourceVersion last seen as its
precondition, so two takers never both win (the loser's patch is refused and it reads the Lease
again).

The holder keeps the slot while its checkpoint runs, across operator restarts (the successor
continues the checkpoint from its persisted phase and finds its name in the Lease). A holder is
taken over when its checkpoint is gone, being deleted or finished; and when the Lease lapsed
(`renewTime + leaseDurationSeconds`, the longest a checkpoint's steps may take) while its
checkpoint shows no running phase: it never started preparing, or its operator died within the
first second of it (the intermediate phases are written only once they last over a second,
docs/design.md#61-checkpoint). Taking over is then safe: every call of that checkpoint had a
deadline within the Lease's duration, and each participant resumes by itself once its own lease
(that deadline plus a grace shorter than the Lease's margin) lapses, so none is still paused for
it, and its id is stale there. A Lease that names a running checkpoint is never taken over: its
participants would refuse a second checkpoint (`conflicting_checkpoint`).

The last Lease this process wrote is remembered per set, so a take or a release is one request
(the patch) while nobody else wrote it; the Lease is read only when that patch is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

from ..decide.resources import owner_reference
from ..model.api import (
    CHECKPOINT_FINISHED,
    CHECKPOINT_RUNNING,
    RolloutCheckpoint,
    RolloutSet,
    namespace_or_default,
)
from .kube import Conflict, Kube

logger = logging.getLogger(__name__)

LEASE_SUFFIX: Final = "-checkpoint"
MAX_TRIES: Final = 5
"""Compare-and-swap rounds before a take reports the slot busy (each round lost a race to a
writer that changed the Lease; the caller tries again at its next look)."""


def lease_name(set_name: str) -> str:
    """The set's Lease (a set name is a DNS label of at most 50 characters, so this fits)."""
    return f"{set_name}{LEASE_SUFFIX}"


def micro_time(at: float) -> str:
    """`metav1.MicroTime`, as a Lease's times are written."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_micro_time(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    for layout in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(value, layout).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    return None


def holder_spec(
    holder: str, duration_seconds: int, base: Mapping[str, Any] | None, now: float
) -> dict[str, Any]:
    """The Lease `spec` fields that name `holder` from `now` (a Unix time) on, over the Lease
    `base` as last seen: `renewTime` now; `acquireTime` now unless `holder` already held it (a
    renewal); `leaseTransitions` one more when another holder is replaced."""
    stamp = micro_time(now)
    spec = (base or {}).get("spec") or {}
    previous = spec.get("holderIdentity")
    transitions = int(spec.get("leaseTransitions") or 0)
    if previous not in (None, "", holder):
        transitions += 1
    return {
        "holderIdentity": holder,
        "leaseDurationSeconds": duration_seconds,
        "acquireTime": spec.get("acquireTime", stamp) if previous == holder else stamp,
        "renewTime": stamp,
        "leaseTransitions": transitions,
    }


def holder_of(lease: Mapping[str, Any] | None) -> str | None:
    holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
    return holder if isinstance(holder, str) and holder else None


def lapsed(lease: Mapping[str, Any], now: float) -> bool:
    """Whether the holder's time ran out (a Lease without times has lapsed)."""
    spec = lease.get("spec") or {}
    renewed = _parse_micro_time(spec.get("renewTime") or spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds")
    if renewed is None or not isinstance(duration, int):
        return True
    return renewed + duration < now


def holds_slot(holder: RolloutCheckpoint | None, lease: Mapping[str, Any], now: float) -> bool:
    """Whether the Lease's holder keeps the slot (see the module doc)."""
    if holder is None or holder.metadata.deletion_timestamp is not None:
        return False
    if holder.status.phase in CHECKPOINT_FINISHED:
        return False
    return holder.status.phase in CHECKPOINT_RUNNING or not lapsed(lease, now)


class CheckpointLeases:
    """Takes and releases the per-set Leases for the checkpoint flows of this process."""

    def __init__(self, kube: Kube, *, clock: Callable[[], float] = time.time) -> None:
        self._kube = kube
        self._clock = clock
        self._known: dict[tuple[str, str], dict[str, Any]] = {}
        """The Lease as this process last wrote or read it, per (namespace, set)."""

    def _holder_spec(
        self, holder: str | None, duration_seconds: int, base: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The Lease's `spec` fields that name `holder` (None: no holder) from now on."""
        if holder is None:
            return {"holderIdentity": None}
        return holder_spec(holder, duration_seconds, base, self._clock())

    def _new_lease(
        self, key: tuple[str, str], holder: str, duration_seconds: int, owner: RolloutSet
    ) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": lease_name(key[1]), "namespace": key[0]}
        if owner.metadata.uid:
            metadata["ownerReferences"] = [owner_reference(owner)]
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": self._holder_spec(holder, duration_seconds, {}),
        }

    async def _swap(
        self, key: tuple[str, str], lease: Mapping[str, Any], spec: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Patch the Lease's spec if it is still the version `lease` shows (else `Conflict`)."""
        version = str((lease.get("metadata") or {}).get("resourceVersion") or "")
        return await self._kube.patch_lease(key[0], lease_name(key[1]), spec, version)

    async def _read(self, key: tuple[str, str]) -> dict[str, Any] | None:
        lease = await self._kube.get_lease(key[0], lease_name(key[1]))
        if lease is None:
            self._known.pop(key, None)
        else:
            self._known[key] = lease
        return lease

    async def take(self, rset: RolloutSet, checkpoint: str, duration_seconds: int) -> str | None:
        """Hold the set's slot for `checkpoint`: None once held, else the checkpoint that
        holds it."""
        namespace = namespace_or_default(rset.metadata.namespace)
        key = (namespace, rset.metadata.name)
        lease = self._known.get(key) or await self._read(key)
        for _ in range(MAX_TRIES):
            if lease is None:
                created = await self._kube.create_lease(
                    namespace, self._new_lease(key, checkpoint, duration_seconds, rset)
                )
                if created is not None:
                    self._known[key] = created
                    return None
                lease = await self._read(key)
                continue
            holder = holder_of(lease)
            if holder == checkpoint:
                return None
            if holder is not None and await self._holds(namespace, holder, lease):
                return holder
            try:
                self._known[key] = await self._swap(
                    key, lease, self._holder_spec(checkpoint, duration_seconds, lease)
                )
                if holder is not None:
                    logger.info(
                        "set %s: checkpoint %s takes the slot over from %s (it is not running)",
                        rset.metadata.name,
                        checkpoint,
                        holder,
                    )
                return None
            except (Conflict, LookupError):
                lease = await self._read(key)
        return holder_of(lease) or "another writer of the Lease"

    async def holder(self, namespace: str, set_name: str) -> str | None:
        """The checkpoint the set's Lease names now, read from the API server (None: none)."""
        return holder_of(await self._read((namespace, set_name)))

    def held_since(self, namespace: str, set_name: str, ckpt: RolloutCheckpoint) -> float | None:
        """When `ckpt` took the set's Lease (its `acquireTime`, kept across renewals and operator
        restarts), as this process last wrote or read it; None when it does not hold it here.

        The checkpoint's start: a successor that finds no phase written (the intermediate
        phases are written only once they last over a second) takes its start time and prepare
        deadline from here, the same ones the first run had."""
        lease = self._known.get((namespace, set_name))
        if lease is None or holder_of(lease) != ckpt.metadata.name:
            return None
        return _parse_micro_time((lease.get("spec") or {}).get("acquireTime"))

    async def _holds(self, namespace: str, holder: str, lease: Mapping[str, Any]) -> bool:
        raw = await self._kube.get_checkpoint(namespace, holder)
        ckpt = None if raw is None else RolloutCheckpoint.model_validate(raw)
        return holds_slot(ckpt, lease, self._clock())

    async def release(self, namespace: str, set_name: str, checkpoint: str) -> None:
        """Give the set's slot back if `checkpoint` holds it (a no-op otherwise)."""
        key = (namespace, set_name)
        lease = self._known.get(key) or await self._read(key)
        for _ in range(MAX_TRIES):
            if lease is None or holder_of(lease) != checkpoint:
                return
            try:
                self._known[key] = await self._swap(key, lease, self._holder_spec(None, 0, lease))
                return
            except (Conflict, LookupError):
                lease = await self._read(key)
        logger.warning("could not release the checkpoint Lease of set %s", set_name)


__all__ = [
    "CheckpointLeases",
    "holder_of",
    "holder_spec",
    "holds_slot",
    "lapsed",
    "lease_name",
    "micro_time",
]
