"""In-memory stand-ins for the `Kube` calls the operator's flows make about one RolloutSet.

They sit below the flows under test: the set is a dict, but status writes keep the API server's
rules that the flows rely on (a stale resourceVersion is a Conflict; a null field is removed).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any, cast

from rollout_operator.cluster.cache import ClusterCache
from rollout_operator.cluster.kube import Conflict, Kube


class RawResponse:
    """What the generated client returns with `_preload_content=False`: a status and a body
    the caller reads (and checks the status of) itself."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.reason = "OK" if status == 200 else "Error"
        self._body = json.dumps(body).encode()

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        return None


class InMemorySet:
    """One RolloutSet, read with its resourceVersion and status-patched with it as precondition."""

    def __init__(self, obj: dict[str, Any], checkpoints: Sequence[dict[str, Any]] = ()) -> None:
        self.set = obj
        self.version = 1
        self.checkpoints = {c["metadata"]["name"]: c for c in checkpoints}
        """RolloutCheckpoints the flows may read (by name); none unless a test gives some."""
        self.leases: dict[str, dict[str, Any]] = {}
        """Leases by name; a patch keeps the API server's resourceVersion precondition."""
        self.lease_version = 0
        self.lease_calls: list[str] = []
        """The Lease requests made, by verb (get, create, patch)."""
        self.cache = ClusterCache()
        """`Kube.cache`, never attached to indexes here: the flows only wait on it."""

    def as_kube(self) -> Kube:
        return cast(Kube, self)

    @property
    def custom(self) -> InMemorySet:
        """`Kube.custom`: the flows list the set's checkpoints through it."""
        return self

    async def list_checkpoints(self, namespace: str, set_name: str) -> list[dict[str, Any]]:
        """`Kube.list_checkpoints`: the set's checkpoints, by `spec.rolloutSet`."""
        return [
            copy.deepcopy(c)
            for c in self.checkpoints.values()
            if (c.get("spec") or {}).get("rolloutSet") == set_name
        ]

    async def get_set(
        self, namespace: str, name: str, *, fresh: bool = False
    ) -> dict[str, Any] | None:
        obj = copy.deepcopy(self.set)
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    async def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.checkpoints.get(name)
        return None if found is None else copy.deepcopy(found)

    async def patch_checkpoint_status(
        self, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """A merge patch of a checkpoint's status (a null field is removed)."""
        current = self.checkpoints[name].setdefault("status", {})
        for key, value in status.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = copy.deepcopy(value)
        return copy.deepcopy(self.checkpoints[name])

    async def patch_set_status(
        self, namespace: str, name: str, status: dict[str, Any], *, resource_version: str | None
    ) -> dict[str, Any]:
        if resource_version not in (None, str(self.version)):
            raise Conflict("the object has been modified")
        current = self.set.setdefault("status", {})
        for key, value in status.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = copy.deepcopy(value)
        self.version += 1
        return await self.get_set(namespace, name) or {}

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.lease_calls.append("get")
        found = self.leases.get(name)
        return None if found is None else copy.deepcopy(found)

    async def create_lease(self, namespace: str, manifest: dict[str, Any]) -> dict[str, Any] | None:
        self.lease_calls.append("create")
        name = manifest["metadata"]["name"]
        if name in self.leases:
            return None
        return self._store_lease(manifest)

    async def patch_lease(
        self, namespace: str, name: str, spec: dict[str, Any], resource_version: str
    ) -> dict[str, Any]:
        """A merge patch of the Lease's spec with the resourceVersion precondition."""
        self.lease_calls.append("patch")
        current = self.leases.get(name)
        if current is None:
            raise LookupError(f"lease {name} is gone")
        if resource_version != current["metadata"]["resourceVersion"]:
            raise Conflict("the object has been modified")
        merged = copy.deepcopy(current)
        for key, value in spec.items():
            if value is None:
                merged["spec"].pop(key, None)
            else:
                merged["spec"][key] = copy.deepcopy(value)
        return self._store_lease(merged)

    def _store_lease(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.lease_version += 1
        stored = copy.deepcopy(manifest)
        stored["metadata"]["resourceVersion"] = str(self.lease_version)
        self.leases[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)
