"""A fake Kubernetes API server in memory, for unit tests of the operator (a named fake).

`FakeCluster` implements `rollout_operator.cluster.rest.Transport`, the one method the real
client (`Kube`) sends every request through, so a unit test runs the operator's real `Kube`,
its real cache and its real flows, and fakes only the API server below them. What it keeps of
the API server's behaviour is what the operator relies on:

- objects by kind, namespace and name, with a `uid`, a `creationTimestamp` (from `clock`, the
  API server's own clock: a test that runs the flows at a fixed time gives the cluster the
  same one) and a `resourceVersion` from one counter that every write advances;
- create (409 when the name is taken), get and delete (404 when absent), list with equality
  label selectors and field selectors (`spec.rolloutSet=NAME`, `metadata.name=NAME`; with
  `field_selectors=False` it refuses them with 400, as API servers before 1.31 did);
- JSON merge patches (RFC 7386: a null removes a field) with the `metadata.resourceVersion`
  precondition (409 when stale); the status subresource (a patch of `/status` changes only the
  status, a patch of the object never changes it, for the kinds that have one);
- the watches: after every change it feeds the Kopf-shaped indexes that the operator's
  `ClusterCache` reads (`cache.index_entries`, the same definition the Kopf index handlers use)
  and wakes the set's waiters, as a watch event would, with no lag.

Tests seed and change objects as a user or a kubelet would (`put`, `update`, `remove`), and
see what the operator did in `requests`. `refuse` makes the next matching requests fail.
"""

from __future__ import annotations

import copy
import itertools
import json
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rollout_operator.cluster.cache import (
    INDEXES,
    OPTIONAL_INDEXES,
    ClusterCache,
    Seen,
    index_entries,
)
from rollout_operator.cluster.kube import Kube
from rollout_operator.cluster.rest import JSON, MERGE_PATCH, ApiError
from rollout_operator.model.api import (
    GROUP,
    ROLLOUT_CHECKPOINT_PLURAL,
    ROLLOUT_SET_PLURAL,
    namespace_or_default,
)

WITH_STATUS = frozenset({ROLLOUT_SET_PLURAL, ROLLOUT_CHECKPOINT_PLURAL, "pods", "workloads"})
"""Kinds whose status is a subresource (written only through `/status`)."""

INDEX_OF = {
    ROLLOUT_SET_PLURAL: "rollout_sets",
    ROLLOUT_CHECKPOINT_PLURAL: "rollout_checkpoints",
    "pods": "set_pods",
    "nodes": "nodes",
    "workloads": "set_workloads",
}
"""Which of the operator's indexes (`cache.INDEXES`) watches each kind."""

KINDS = {
    ROLLOUT_SET_PLURAL: ("RolloutSet", f"{GROUP}/v1alpha1"),
    ROLLOUT_CHECKPOINT_PLURAL: ("RolloutCheckpoint", f"{GROUP}/v1alpha1"),
    "pods": ("Pod", "v1"),
    "services": ("Service", "v1"),
    "secrets": ("Secret", "v1"),
    "nodes": ("Node", "v1"),
    "leases": ("Lease", "coordination.k8s.io/v1"),
    "workloads": ("Workload", "kueue.x-k8s.io/v1beta2"),
    "resourceflavors": ("ResourceFlavor", "kueue.x-k8s.io/v1beta2"),
    "workloadpriorityclasses": ("WorkloadPriorityClass", "kueue.x-k8s.io/v1beta2"),
}
CLUSTER_SCOPED = frozenset({"nodes", "resourceflavors", "workloadpriorityclasses"})
"""Kinds without a namespace."""


@dataclass(frozen=True)
class Request:
    """One request the operator made."""

    method: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None
    query: Mapping[str, str]
    body: Mapping[str, Any] | None

    @property
    def verb(self) -> str:
        """The API server's verb: get, list, create, patch, delete."""
        if self.method == "GET":
            return "get" if self.name else "list"
        return {"POST": "create", "PATCH": "patch", "DELETE": "delete"}[self.method]


@dataclass
class _Refusal:
    matches: Callable[[Request], bool]
    status: int
    message: str
    times: int


class FakeIndex:
    """A `kopf.Index` as the operator reads it: key -> the values stored under it."""

    def __init__(self) -> None:
        self._by_object: dict[tuple[str | None, str], dict[Any, Seen]] = {}

    def set(self, key: tuple[str | None, str], entries: dict[Any, Seen]) -> None:
        if entries:
            self._by_object[key] = entries
        else:
            self._by_object.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return any(key in entries for entries in self._by_object.values())

    def __getitem__(self, key: Any) -> Iterator[Seen]:
        return iter([entries[key] for entries in self._by_object.values() if key in entries])


@dataclass
class FakeCluster:
    """The API server and its watches, in memory (see the module doc)."""

    field_selectors: bool = True
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    """The API server's clock: what `creationTimestamp` says of an object created or put."""
    requests: list[Request] = field(default_factory=list)
    objects: dict[tuple[str, str | None, str], dict[str, Any]] = field(default_factory=dict)
    """(plural, namespace, name) -> the stored object (change it only through `update`)."""
    indexes: dict[str, FakeIndex] = field(
        default_factory=lambda: {name: FakeIndex() for name in (*INDEXES, *OPTIONAL_INDEXES)}
    )
    _versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _refusals: list[_Refusal] = field(default_factory=list)
    _caches: list[ClusterCache] = field(default_factory=list)

    # --- the operator's side ----------------------------------------------------------------------

    def kube(self, *, watching: bool = True) -> Kube:
        """A real `Kube` over this API server; with `watching`, its cache reads the indexes
        (as once the Kopf handlers attached them), else every read is a request."""
        kube = Kube(http=self)
        if watching:
            kube.cache.attach(self.indexes)
        self._caches.append(kube.cache)
        return kube

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str = JSON,
    ) -> dict[str, Any]:
        request = _parse(method, path, query or {}, body)
        self.requests.append(request)
        for refusal in self._refusals:
            if refusal.times > 0 and refusal.matches(request):
                refusal.times -= 1
                raise _error(refusal.status, refusal.message)
        if request.method == "PATCH" and content_type != MERGE_PATCH:
            raise _error(415, f"the fake takes merge patches only, not {content_type}")
        return copy.deepcopy(self._serve(request))

    def refuse(
        self,
        verb: str,
        plural: str,
        *,
        status: int,
        message: str = "refused by the test",
        name: str | None = None,
        times: int = 1,
    ) -> None:
        """Fail the next `times` requests with this verb on this kind (and name)."""

        def matches(request: Request) -> bool:
            named = name is None or request.name == name
            return request.verb == verb and request.plural == plural and named

        self._refusals.append(_Refusal(matches, status, message, times))

    def heal(self) -> None:
        """Refuse nothing more: the API server is back."""
        self._refusals.clear()

    def count(self, verb: str, plural: str) -> int:
        return sum(1 for r in self.requests if r.verb == verb and r.plural == plural)

    # --- the test's side (a user, a kubelet, a controller) ---------------------------------------

    def put(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create or replace an object as given (status included), as `kubectl apply` and a
        kubelet would together."""
        plural = _plural_of(obj)
        meta = obj.get("metadata") or {}
        namespace = (
            None if plural in CLUSTER_SCOPED else namespace_or_default(meta.get("namespace"))
        )
        key = (plural, namespace, str(meta["name"]))
        stored = copy.deepcopy(dict(obj))
        old = self.objects.get(key)
        stored_meta = stored.setdefault("metadata", {})
        stored_meta.setdefault("uid", (old or {}).get("metadata", {}).get("uid") or _uid())
        stored_meta.setdefault("creationTimestamp", self._now())
        if namespace is not None:
            stored_meta["namespace"] = namespace
        return self._store(key, stored)

    def update(
        self, plural: str, namespace: str | None, name: str, change: Callable[[dict[str, Any]], Any]
    ) -> dict[str, Any]:
        """Change a stored object in place (`change` edits it), as another writer would."""
        key = (plural, namespace, name)
        obj = copy.deepcopy(self.objects[key])
        change(obj)
        return self._store(key, obj)

    def remove(self, plural: str, namespace: str | None, name: str) -> None:
        """The object is gone (deleted by someone else)."""
        self._forget((plural, namespace, name))

    def get(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get((plural, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def list_objects(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (kind, ns, _), obj in sorted(self.objects.items(), key=lambda item: item[0][2])
            if kind == plural and (namespace is None or ns == namespace)
        ]

    # --- the API server ---------------------------------------------------------------------------

    def _now(self) -> str:
        return self.clock().astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _serve(self, request: Request) -> dict[str, Any]:
        plural, namespace, name = request.plural, request.namespace, request.name
        if name is None:
            if request.method == "GET":
                return {"items": self._select(request)}
            if request.method == "POST":
                return self._create(plural, namespace, dict(request.body or {}))
            raise _error(405, f"{request.method} on a collection")
        key = (plural, namespace, name)
        current = self.objects.get(key)
        if current is None:
            raise _error(404, f'{plural} "{name}" not found')
        if request.method == "GET":
            return current
        if request.method == "DELETE":
            self._forget(key)
            return {"kind": "Status", "status": "Success"}
        if request.method == "PATCH":
            return self._patch(key, current, dict(request.body or {}), request.subresource)
        raise _error(405, request.method)

    def _select(self, request: Request) -> list[dict[str, Any]]:
        labels = _pairs(request.query.get("labelSelector", ""))
        fields = _pairs(request.query.get("fieldSelector", ""))
        if fields and not self.field_selectors:
            raise _error(400, f"field label not supported: {next(iter(fields))}")
        found = []
        for (plural, namespace, _), obj in sorted(self.objects.items(), key=lambda i: i[0][2]):
            if plural != request.plural or namespace != request.namespace:
                continue
            have = (obj.get("metadata") or {}).get("labels") or {}
            if any(have.get(k) != v for k, v in labels.items()):
                continue
            if any(_field(obj, k) != v for k, v in fields.items()):
                continue
            found.append(obj)
        return found

    def _create(
        self, plural: str, namespace: str | None, manifest: dict[str, Any]
    ) -> dict[str, Any]:
        meta = manifest.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise _error(422, "metadata.name: Required value")
        key = (plural, namespace, str(name))
        if key in self.objects:
            raise _error(409, f'{plural} "{name}" already exists')
        meta.update(uid=_uid(), creationTimestamp=self._now())
        if namespace is not None:
            meta["namespace"] = namespace
        if plural in WITH_STATUS:
            manifest.pop("status", None)
        kind, api_version = KINDS.get(plural, ("", ""))
        manifest.setdefault("kind", kind)
        manifest.setdefault("apiVersion", api_version)
        return self._store(key, manifest)

    def _patch(
        self,
        key: tuple[str, str | None, str],
        current: dict[str, Any],
        patch: dict[str, Any],
        subresource: str | None,
    ) -> dict[str, Any]:
        precondition = (patch.get("metadata") or {}).get("resourceVersion")
        if precondition is not None and precondition != current["metadata"]["resourceVersion"]:
            raise _error(
                409,
                "Operation cannot be fulfilled: the object has been modified; please apply "
                "your changes to the latest version and try again",
            )
        if subresource == "status":
            patch = {"status": patch.get("status")}
        elif key[0] in WITH_STATUS:
            patch = {k: v for k, v in patch.items() if k != "status"}
        return self._store(key, _merge(current, patch))

    def _store(self, key: tuple[str, str | None, str], obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["resourceVersion"] = str(next(self._versions))
        self.objects[key] = obj
        self._watched(key, obj)
        return obj

    def _forget(self, key: tuple[str, str | None, str]) -> None:
        obj = self.objects.pop(key, None)
        if obj is not None:
            self._watched(key, obj, removed=True)

    def _watched(
        self, key: tuple[str, str | None, str], obj: dict[str, Any], *, removed: bool = False
    ) -> None:
        """What the operator's watch would do with this change: re-index and wake."""
        index = INDEX_OF.get(key[0])
        if index is None:
            return
        entries, owner = index_entries(index, obj)
        self.indexes[index].set((key[1], key[2]), {} if removed else entries)
        if owner is not None:
            for cache in self._caches:
                cache.changed(*owner)


def _parse(
    method: str, path: str, query: Mapping[str, str], body: Mapping[str, Any] | None
) -> Request:
    parts = path.strip("/").split("/")
    parts = parts[2:] if parts[0] == "api" else parts[3:]  # drop api/v1 or apis/GROUP/VERSION
    namespace = None
    if parts[0] == "namespaces" and len(parts) >= 3:
        namespace, parts = parts[1], parts[2:]
    plural = parts[0]
    name = parts[1] if len(parts) > 1 else None
    subresource = parts[2] if len(parts) > 2 else None
    return Request(method, plural, namespace, name, subresource, dict(query), body)


def _plural_of(obj: Mapping[str, Any]) -> str:
    kind = obj.get("kind")
    for plural, (known, _) in KINDS.items():
        if known == kind:
            return plural
    raise ValueError(f"the fake cluster does not know the kind {kind!r}")


def _merge(current: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge key by key, null removes, the rest replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    merged = dict(current) if isinstance(current, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge(merged.get(key), value)
    return merged


def _pairs(selector: str) -> dict[str, str]:
    pairs = {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        pairs[key.strip()] = value.strip().lstrip("=")
    return pairs


def _field(obj: Mapping[str, Any], path: str) -> Any:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _error(status: int, message: str) -> ApiError:
    body = json.dumps({"kind": "Status", "code": status, "message": message}).encode()
    return ApiError(status, message, body)


def _uid() -> str:
    return str(uuid.uuid4())


__all__ = ["FakeCluster", "FakeIndex", "Request"]
