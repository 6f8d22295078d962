"""What the operator's watches have seen: sets, checkpoints and pods by set, nodes.

Why: docs/design.md#60-layers, "State from watches".

Kopf already watches every resource the operator handles. Its indexes (`@kopf.index`, wired in
`handlers/indexes.py`) keep the objects those watches deliver, and Kopf fills them before any
handler or daemon runs, so a reader never sees a half-listed cluster. `ClusterCache` answers
the flows' reads from those indexes instead of the API server: a steady pass, and a checkpoint's
whole critical path, read nothing over the network.

A watch lags the writes it reports. So that the operator reads its own writes, every object the
`Kube` client gets back from a write is kept beside the index (`saw`) until the watch has
delivered that version or a newer one. Such an entry only ever replaces an older version of an
object the index holds (same uid): an object deleted meanwhile is gone from the index, and a
remembered write never brings it back. Pods this process created are the one exception: they
are shown for `CREATED_POD_SECONDS` before their first watch event arrives, so the pass that
created them does not create them again.

Values are stored as the JSON bytes of the object. A set or a checkpoint is parsed on every read,
so callers may change what they get. Pods are parsed once per version and the parsed object is
shared by every read (a pass reads its set's pods several times, and parsing them again was a
fifth of the operator's CPU per checkpoint): pods are read, never changed, by the operator.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import anyio

from ..model.api import CHECKPOINT_SET_FIELD, LABEL_SET, namespace_or_default

SETS: Final = "rollout_sets"
CHECKPOINTS: Final = "rollout_checkpoints"
PODS: Final = "set_pods"
NODES: Final = "nodes"
INDEXES: Final = (SETS, CHECKPOINTS, PODS, NODES)
"""The ids of the Kopf indexes (`handlers/indexes.py`); Kopf passes each to every handler as a
keyword argument of that name."""
WORKLOADS: Final = "set_workloads"
"""Kueue's Workloads of queued sets, by set (`decide.queue`). Optional: read when Kopf passes
it, and a Workload read goes to the API server otherwise."""
OPTIONAL_INDEXES: Final = (WORKLOADS,)

CREATED_POD_SECONDS: Final = 10.0
"""How long a pod this process created is shown before the watch reports it."""


@dataclass(frozen=True)
class Seen:
    """One object as last seen: its identity, resourceVersion and wire-form JSON."""

    uid: str
    resource_version: int
    body: bytes

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Seen:
        """The object without `metadata.managedFields` (the API server's field ownership
        bookkeeping, often the largest part of a pod, which the operator never reads)."""
        meta = obj.get("metadata") or {}
        kept = dict(obj)
        if "managedFields" in meta:
            kept["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
        return cls(
            uid=str(meta.get("uid") or ""),
            resource_version=_version(meta.get("resourceVersion")),
            body=json.dumps(kept, separators=(",", ":")).encode(),
        )

    def parse(self) -> dict[str, Any]:
        """A fresh copy of the object."""
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed

    @functools.cached_property
    def shared(self) -> dict[str, Any]:
        """The object parsed once, shared by every reader: never change it."""
        return self.parse()


def _version(value: object) -> int:
    """A resourceVersion as a number (etcd's revision); 0 when it is not one."""
    try:
        return int(str(value))
    except ValueError:
        return 0


class IndexView(Protocol):
    """What this module needs of a `kopf.Index`: a read-only mapping of key -> store."""

    def __contains__(self, key: object) -> bool: ...

    def __getitem__(self, key: Any) -> Iterable[Seen]: ...


def set_key(namespace: str, name: str) -> tuple[str, str]:
    return (namespace, name)


def checkpoints_of_set_key(namespace: str, set_name: str) -> tuple[str, str, str]:
    return ("set", namespace, set_name)


def checkpoint_key(namespace: str, name: str) -> tuple[str, str, str]:
    return ("name", namespace, name)


def pods_key(namespace: str, set_name: str) -> tuple[str, str]:
    return (namespace, set_name)


def workloads_key(namespace: str, set_name: str) -> tuple[str, str]:
    return (namespace, set_name)


def index_entries(
    kind: str, obj: Mapping[str, Any]
) -> tuple[dict[Any, Seen], tuple[str, str] | None]:
    """What one object contributes to the index of `kind`, and the (namespace, name) of the set
    it belongs to (whose waiters its change wakes). One definition for the Kopf indexes
    (`handlers/indexes.py`) and the unit tests' fake cluster, which feeds a `ClusterCache` as
    the watches would."""
    meta = obj.get("metadata") or {}
    namespace, name = namespace_or_default(meta.get("namespace")), str(meta.get("name") or "")
    seen = Seen.of(obj)
    if kind == SETS:
        return {set_key(namespace, name): seen}, (namespace, name)
    if kind == CHECKPOINTS:
        entries: dict[Any, Seen] = {checkpoint_key(namespace, name): seen}
        set_name = (obj.get("spec") or {}).get(CHECKPOINT_SET_FIELD)
        if not isinstance(set_name, str):
            return entries, None
        entries[checkpoints_of_set_key(namespace, set_name)] = seen
        return entries, (namespace, set_name)
    if kind == PODS:
        set_name = (meta.get("labels") or {}).get(LABEL_SET)
        if not isinstance(set_name, str):
            return {}, None
        return {pods_key(namespace, set_name): seen}, (namespace, set_name)
    if kind == NODES:
        return {name: seen}, None
    if kind == WORKLOADS:
        set_name = (meta.get("labels") or {}).get(LABEL_SET)
        if not isinstance(set_name, str):
            return {}, None
        return {workloads_key(namespace, set_name): seen}, (namespace, set_name)
    raise ValueError(f"no index of {kind!r}")


@dataclass
class _Written:
    seen: Seen
    set_key: tuple[str, str] | None
    at: float


class ClusterCache:
    """Reads served from Kopf's indexes, with this process's own writes on top."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._indexes: dict[str, IndexView] = {}
        self._written: dict[tuple[str, str, str], _Written] = {}
        self._changes: dict[tuple[str, str], anyio.Event] = {}
        self._clock = clock

    # --- wiring ---------------------------------------------------------------------------------

    def attach(self, kwargs: Mapping[str, Any]) -> None:
        """Take Kopf's indexes from a handler's keyword arguments (the same objects for the
        operator's whole life; Kopf fills them before the first handler runs)."""
        if len(self._indexes) == len(INDEXES) + len(OPTIONAL_INDEXES):
            return
        for name in (*INDEXES, *OPTIONAL_INDEXES):
            index = kwargs.get(name)
            if index is not None:
                self._indexes[name] = index

    @property
    def ready(self) -> bool:
        return all(name in self._indexes for name in INDEXES)

    @property
    def watches_workloads(self) -> bool:
        return self.ready and WORKLOADS in self._indexes

    def changed(self, namespace: str, set_name: str) -> None:
        """Something of the set changed (its object, a pod, a checkpoint): wake its waiters."""
        event = self._changes.pop((namespace, set_name), None)
        if event is not None:
            event.set()

    async def wait_for_change(self, namespace: str, set_name: str, seconds: float) -> None:
        """Return at the set's next change, or after `seconds`."""
        event = self._changes.setdefault((namespace, set_name), anyio.Event())
        with anyio.move_on_after(seconds):
            await event.wait()

    # --- reads ----------------------------------------------------------------------------------

    def _store(self, index: str, key: object) -> list[Seen]:
        view = self._indexes[index]
        return list(view[key]) if key in view else []

    def _newest(self, kind: str, seen: Seen | None, namespace: str, name: str) -> Seen | None:
        """The index's version or our own write, whichever is newer (see the module doc)."""
        written = self._written.get((kind, namespace, name))
        if written is None:
            return seen
        if seen is None:
            recent = self._clock() - written.at < CREATED_POD_SECONDS
            if kind == PODS and recent:
                return written.seen
            if not recent:
                del self._written[(kind, namespace, name)]
            return None
        if seen.uid != written.seen.uid or seen.resource_version >= written.seen.resource_version:
            del self._written[(kind, namespace, name)]
            return seen
        return written.seen

    def get_set(self, namespace: str, name: str) -> dict[str, Any] | None:
        stored = self._store(SETS, set_key(namespace, name))
        found = self._newest(SETS, stored[0] if stored else None, namespace, name)
        return None if found is None else found.parse()

    def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        stored = self._store(CHECKPOINTS, checkpoint_key(namespace, name))
        found = self._newest(CHECKPOINTS, stored[0] if stored else None, namespace, name)
        return None if found is None else found.parse()

    def list_checkpoints(self, namespace: str, set_name: str) -> list[dict[str, Any]]:
        stored = self._store(CHECKPOINTS, checkpoints_of_set_key(namespace, set_name))
        return self._merged(CHECKPOINTS, stored, namespace, set_name, lambda obj: True)

    def list_pods(
        self, namespace: str, set_name: str, labels: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        """The set's pods whose labels include `labels` (shared objects: read, never change)."""

        def matches(obj: Mapping[str, Any]) -> bool:
            have = (obj.get("metadata") or {}).get("labels") or {}
            return all(have.get(k) == v for k, v in labels.items())

        stored = self._store(PODS, pods_key(namespace, set_name))
        return self._merged(PODS, stored, namespace, set_name, matches, shared=True)

    def _merged(
        self,
        kind: str,
        stored: list[Seen],
        namespace: str,
        set_name: str,
        keep: Callable[[Mapping[str, Any]], bool],
        *,
        shared: bool = False,
    ) -> list[dict[str, Any]]:
        by_name: dict[str, dict[str, Any]] = {}
        for seen in stored:
            obj = seen.shared if shared else seen.parse()
            name = obj["metadata"]["name"]
            newest = self._newest(kind, seen, namespace, name)
            if newest is not None and newest is not seen:
                obj = newest.shared if shared else newest.parse()
            by_name[name] = obj
        for (written_kind, written_ns, name), written in list(self._written.items()):
            if written_kind != kind or written_ns != namespace or name in by_name:
                continue
            if written.set_key != (namespace, set_name):
                continue
            newest = self._newest(kind, None, namespace, name)
            if newest is not None:
                by_name[name] = newest.shared if shared else newest.parse()
        return [obj for _, obj in sorted(by_name.items()) if keep(obj)]

    def get_workload(self, namespace: str, set_name: str, name: str) -> dict[str, Any] | None:
        """The set's Workload `name` as the watch last saw it (or as this process wrote it)."""
        stored = [
            seen
            for seen in self._store(WORKLOADS, workloads_key(namespace, set_name))
            if seen.shared["metadata"]["name"] == name
        ]
        found = self._newest(WORKLOADS, stored[0] if stored else None, namespace, name)
        return None if found is None else found.parse()

    def get_node(self, name: str) -> dict[str, Any] | None:
        """A node as the watch last saw it; None when the watch has not seen it (or it is
        gone)."""
        stored = self._store(NODES, name)
        return stored[0].parse() if stored else None

    # --- our own writes -------------------------------------------------------------------------

    def saw(self, kind: str, obj: Mapping[str, Any], *, set_name: str | None = None) -> None:
        """Remember an object a write of this process returned (until the watch catches up)."""
        meta = obj.get("metadata") or {}
        namespace, name = namespace_or_default(meta.get("namespace")), str(meta.get("name") or "")
        if not name:
            return
        self._written[(kind, namespace, name)] = _Written(
            seen=Seen.of(obj),
            set_key=(namespace, set_name) if set_name is not None else None,
            at=self._clock(),
        )
        if set_name is not None:
            self.changed(namespace, set_name)


__all__ = [
    "CHECKPOINTS",
    "INDEXES",
    "NODES",
    "OPTIONAL_INDEXES",
    "PODS",
    "SETS",
    "WORKLOADS",
    "ClusterCache",
    "Seen",
    "checkpoint_key",
    "checkpoints_of_set_key",
    "index_entries",
    "pods_key",
    "set_key",
    "workloads_key",
]
