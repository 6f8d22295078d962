"""The operator's Kubernetes client and the few calls it needs (on `rest.ApiClient`).

Kopf watches and patches the objects it handles itself; this client is for everything else:
creating pods, Services and the token Secret, the per-set checkpoint Lease, and writing status.
Objects cross this boundary as plain dicts in the wire (camelCase) form, which the pure modules
(`resources`, `setplan`) work on.

Reads are served from the watches (`cache.ClusterCache`, once the Kopf handlers attached it):
sets, checkpoints, the set's pods and nodes cost no request. A read with `fresh=True` goes to
the API server; only a destructive decision makes one (see `Kube.get_set`). Every object a write
returns goes into the cache, so the operator reads its own writes before the watch reports them;
a write refused for a stale resourceVersion reads the object again first, so the retry that
follows sees the version that won.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from ..decide.queue import (
    KUEUE_GROUP,
    KUEUE_VERSION,
    PRIORITY_CLASSES,
    RESOURCE_FLAVORS,
    WORKLOADS,
)
from ..model.api import (
    CHECKPOINT_SET_FIELD,
    GROUP,
    LABEL_SET,
    ROLLOUT_CHECKPOINT_PLURAL,
    ROLLOUT_SET_PLURAL,
    VERSION,
)
from .cache import CHECKPOINTS, PODS, SETS, ClusterCache
from .cache import WORKLOADS as CACHED_WORKLOADS
from .rest import MERGE_PATCH, ApiClient, ApiError, Transport, api_path, credentials

__all__ = ["ApiError", "Conflict", "Kube"]

logger = logging.getLogger(__name__)


class Conflict(Exception):
    """The object changed between our read and our write (HTTP 409); read again and retry."""


def _sets(namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    return api_path(
        ROLLOUT_SET_PLURAL,
        group=GROUP,
        version=VERSION,
        namespace=namespace,
        name=name,
        subresource=subresource,
    )


def _checkpoints(namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    return api_path(
        ROLLOUT_CHECKPOINT_PLURAL,
        group=GROUP,
        version=VERSION,
        namespace=namespace,
        name=name,
        subresource=subresource,
    )


def _kueue(
    plural: str, namespace: str | None, name: str | None = None, subresource: str | None = None
) -> str:
    return api_path(
        plural,
        group=KUEUE_GROUP,
        version=KUEUE_VERSION,
        namespace=namespace,
        name=name,
        subresource=subresource,
    )


def _leases(namespace: str, name: str | None = None) -> str:
    return api_path(
        "leases", group="coordination.k8s.io", version="v1", namespace=namespace, name=name
    )


@dataclass
class Kube:
    """One API client for the process; created in the startup hook, closed at cleanup."""

    http: Transport
    field_selectors: bool = True
    """Whether the API server filters checkpoints by set (False once it refused to)."""
    cache: ClusterCache = field(default_factory=ClusterCache)
    """The watches' view; reads go to the API server until the handlers attach Kopf's indexes."""
    _secrets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """Secrets read or created by this process (the control tokens: never replaced while they
    exist, so a checkpoint reads its set's token from here, not from the API server)."""

    @classmethod
    def connect(
        cls, settings: kopf.OperatorSettings, *, max_concurrent_requests: int = 100
    ) -> Kube:
        """The client with the operator's credentials (`rest.credentials`, as Kopf logs in).

        At most `max_concurrent_requests` requests are open at once; more wait in the client
        (`--api-concurrency`): with a hundred sets passing at once, an unbounded operator had 50
        requests executing in the API server at the same time, and every client of a busy
        server waits longer for it."""
        return cls(
            http=ApiClient(lambda: credentials(settings), max_concurrent=max_concurrent_requests)
        )

    async def close(self) -> None:
        if isinstance(self.http, ApiClient):
            await self.http.close()

    async def _get(self, path: str) -> dict[str, Any] | None:
        """The object at `path`; None when it does not exist."""
        try:
            return await self.http.request("GET", path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def _merge(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.http.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    # --- RolloutSets ----------------------------------------------------------------------------

    async def get_set(
        self, namespace: str, name: str, *, fresh: bool = False
    ) -> dict[str, Any] | None:
        """The set as the watch last saw it (or as this process last wrote it).

        `fresh=True` asks the API server instead. Only decisions that cannot be taken back
        read that way: whether a pod deletion was the set's own suspend or a loss (a recovery
        would stop every participant), and the re-read after a refused write (`Conflict`)."""
        if not fresh and self.cache.ready:
            return self.cache.get_set(namespace, name)
        obj = await self._get(_sets(namespace, name))
        if obj is not None:
            self.cache.saw(SETS, obj)
        return obj

    async def patch_set_status(
        self,
        namespace: str,
        name: str,
        status: Mapping[str, Any],
        *,
        resource_version: str | None,
    ) -> dict[str, Any]:
        """Merge-patch the status subresource; with `resource_version`, only if unchanged since.

        The precondition makes concurrent writers (this reconciler, the recovery and the
        policy) safe: a lost race is a `Conflict`, never a silently overwritten condition.
        """
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            obj = await self._merge(_sets(namespace, name, "status"), body)
        except ApiError as error:
            if error.status == 409:
                await self.get_set(namespace, name, fresh=True)
                raise Conflict(error.message) from error
            raise
        self.cache.saw(SETS, obj, set_name=name)
        return obj

    async def annotate_set(self, namespace: str, name: str, key: str, value: str) -> str | None:
        """Set one annotation of the set; returns the set's new resourceVersion."""
        obj = await self._merge(_sets(namespace, name), {"metadata": {"annotations": {key: value}}})
        self.cache.saw(SETS, obj, set_name=name)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        return version if isinstance(version, str) else None

    async def patch_set(
        self, namespace: str, name: str, body: Mapping[str, Any], *, resource_version: str | None
    ) -> dict[str, Any]:
        """Merge-patch the set's metadata and spec (the queue pass's `spec.suspend` and
        placement annotation), only if unchanged since `resource_version` (else `Conflict`)."""
        patch = dict(body)
        if resource_version is not None:
            patch["metadata"] = {
                **(patch.get("metadata") or {}),
                "resourceVersion": resource_version,
            }
        try:
            obj = await self._merge(_sets(namespace, name), patch)
        except ApiError as error:
            if error.status == 409:
                await self.get_set(namespace, name, fresh=True)
                raise Conflict(error.message) from error
            raise
        self.cache.saw(SETS, obj, set_name=name)
        return obj

    # --- Kueue (a queued set's Workload; docs/policy.md) -----------------------------------------

    async def get_workload(self, namespace: str, set_name: str, name: str) -> dict[str, Any] | None:
        """The set's Workload `name`, from the watch of Workloads (`cache.WORKLOADS`), or from
        the API server where that watch is not running."""
        if self.cache.watches_workloads:
            return self.cache.get_workload(namespace, set_name, name)
        # No watch of Workloads (Kueue's CRDs absent when the operator started): a read, which
        # the chart does not grant; the create that follows says what is wrong (QuotaPending).
        try:
            return await self._get(_kueue(WORKLOADS, namespace, name))
        except ApiError as error:
            if error.status == 403:
                return None
            raise

    async def create_workload(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        """Create it; False when one of that name exists already."""
        created = await self._create_if_absent(_kueue(WORKLOADS, namespace), manifest)
        if created is not None:
            self.cache.saw(CACHED_WORKLOADS, created, set_name=_set_label(created))
        return created is not None

    async def patch_workload_status(
        self, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch the Workload's status (its `metadata.resourceVersion`, when the body
        names one, is the precondition: `Conflict` when Kueue wrote it meanwhile)."""
        try:
            obj = await self._merge(_kueue(WORKLOADS, namespace, name, "status"), body)
        except ApiError as error:
            if error.status == 409:
                raise Conflict(error.message) from error
            raise
        self.cache.saw(CACHED_WORKLOADS, obj, set_name=_set_label(obj))
        return obj

    async def get_resource_flavor(self, name: str) -> dict[str, Any] | None:
        return await self._get(_kueue(RESOURCE_FLAVORS, None, name))

    async def get_workload_priority_class(self, name: str) -> dict[str, Any] | None:
        return await self._get(_kueue(PRIORITY_CLASSES, None, name))

    # --- RolloutCheckpoints -----------------------------------------------------------------------

    async def list_checkpoints(self, namespace: str, set_name: str) -> list[dict[str, Any]]:
        """Every RolloutCheckpoint whose `spec.rolloutSet` is `set_name` (people create them
        unlabelled, so a label selector would miss some), in wire form.

        From the watch's index when attached. Without it, the API server filters them by the
        CRD's selectable field (Kubernetes 1.31+); one that refuses the field selector (older,
        or without the CRD applied by this version) is asked for the whole namespace from then
        on, and this process filters."""
        if self.cache.ready:
            return self.cache.list_checkpoints(namespace, set_name)
        field_name = f"spec.{CHECKPOINT_SET_FIELD}"
        if self.field_selectors:
            try:
                listing = await self.http.request(
                    "GET",
                    _checkpoints(namespace),
                    query={"fieldSelector": f"{field_name}={set_name}"},
                )
                return cast(list[dict[str, Any]], listing.get("items") or [])
            except ApiError as error:
                if error.status != 400:
                    raise
                self.field_selectors = False
                logger.info(
                    "the API server does not filter RolloutCheckpoints by %s (%s): listing the "
                    "namespace and filtering in the operator instead",
                    field_name,
                    error.message,
                )
        listing = await self.http.request("GET", _checkpoints(namespace))
        items = cast(list[dict[str, Any]], listing.get("items") or [])
        return [c for c in items if (c.get("spec") or {}).get(CHECKPOINT_SET_FIELD) == set_name]

    async def get_checkpoint(
        self, namespace: str, name: str, *, fresh: bool = False
    ) -> dict[str, Any] | None:
        """A RolloutCheckpoint in its wire form; None when it does not exist."""
        if not fresh and self.cache.ready:
            return self.cache.get_checkpoint(namespace, name)
        obj = await self._get(_checkpoints(namespace, name))
        if obj is not None:
            self.cache.saw(CHECKPOINTS, obj)
        return obj

    async def create_checkpoint(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        """Create a RolloutCheckpoint; False when one of that name exists already."""
        created = await self._create_if_absent(_checkpoints(namespace), manifest)
        if created is not None:
            self.cache.saw(CHECKPOINTS, created, set_name=_checkpoint_set(created))
        return created is not None

    async def delete_checkpoint(self, namespace: str, name: str) -> bool:
        """Delete a RolloutCheckpoint; False when it is gone already."""
        return await self._delete(_checkpoints(namespace, name))

    async def set_checkpoint_finalizers(
        self, namespace: str, name: str, finalizers: list[str], *, resource_version: str
    ) -> dict[str, Any] | None:
        """Replace the checkpoint's finalizers if it is unchanged since `resource_version` (a
        merge patch replaces the whole list, so a writer in between is a `Conflict`, never a
        finalizer of someone else's dropped); None when the checkpoint is gone."""
        body = {"metadata": {"finalizers": finalizers, "resourceVersion": resource_version}}
        try:
            obj = await self._merge(_checkpoints(namespace, name), body)
        except ApiError as error:
            if error.status == 409:
                raise Conflict(error.message) from error
            if error.status == 404:
                return None
            raise
        meta = obj.get("metadata") or {}
        if not (meta.get("deletionTimestamp") and not meta.get("finalizers")):
            # (The last finalizer of a deleted object: the API server removes it now, and the
            # watch's DELETED event drops it from the cache; nothing to remember.)
            self.cache.saw(CHECKPOINTS, obj, set_name=_checkpoint_set(obj))
        return obj

    async def patch_checkpoint_status(
        self, namespace: str, name: str, status: Mapping[str, Any], *, resource_version: str | None
    ) -> dict[str, Any]:
        """Merge-patch a RolloutCheckpoint's status subresource (lists in it replace); with
        `resource_version`, only if unchanged since (else `Conflict`). Written only by
        `checkpointstatus.CheckpointStatusWriter`."""
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            obj = await self._merge(_checkpoints(namespace, name, "status"), body)
        except ApiError as error:
            if error.status == 409:
                raise Conflict(error.message) from error
            raise
        self.cache.saw(CHECKPOINTS, obj, set_name=_checkpoint_set(obj))
        return obj

    # --- core objects ---------------------------------------------------------------------------

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """The pods whose labels match `label_selector` (`key=value,...`), as wire dicts.

        A selector that names a set is answered from the watch's index of the set's pods, with
        objects shared by every reader (read them, never change them)."""
        labels = _equality_selector(label_selector)
        set_name = labels.get(LABEL_SET) if labels is not None else None
        if labels is not None and set_name is not None and self.cache.ready:
            return self.cache.list_pods(namespace, set_name, labels)
        listing = await self.http.request(
            "GET", api_path("pods", namespace=namespace), query={"labelSelector": label_selector}
        )
        return cast(list[dict[str, Any]], listing.get("items") or [])

    async def create_pod(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        """Create a pod; False when one with that name exists already (idempotent retries)."""
        created = await self._create_if_absent(api_path("pods", namespace=namespace), manifest)
        if created is not None:
            self.cache.saw(PODS, created, set_name=_set_label(created))
        return created is not None

    async def delete_pod(
        self, namespace: str, name: str, *, grace_seconds: int | None = None
    ) -> bool:
        """Delete a pod; False when it is gone already."""
        query = None if grace_seconds is None else {"gracePeriodSeconds": str(grace_seconds)}
        return await self._delete(api_path("pods", namespace=namespace, name=name), query)

    async def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> bool:
        """Merge-patch a pod's labels and annotations (a None label is removed); False when
        the pod is gone."""
        metadata: dict[str, Any] = {}
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        try:
            obj = await self._merge(
                api_path("pods", namespace=namespace, name=name), {"metadata": metadata}
            )
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        self.cache.saw(PODS, obj, set_name=_set_label(obj))
        return True

    async def get_node(self, name: str) -> dict[str, Any] | None:
        """A node (wire form); None when it does not exist (or the watch has not seen it)."""
        if self.cache.ready:
            return self.cache.get_node(name)
        return await self._get(api_path("nodes", name=name))

    async def create_service(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        path = api_path("services", namespace=namespace)
        return await self._create_if_absent(path, manifest) is not None

    async def get_secret(
        self, namespace: str, name: str, *, remembered: bool = False
    ) -> dict[str, Any] | None:
        """A Secret; with `remembered`, the one this process last read or created if any."""
        if remembered and (namespace, name) in self._secrets:
            return self._secrets[(namespace, name)]
        secret = await self._get(api_path("secrets", namespace=namespace, name=name))
        if secret is None:
            self._secrets.pop((namespace, name), None)
        else:
            self._secrets[(namespace, name)] = secret
        return secret

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Secret read now and never remembered: a user's Secret (a bucket's credentials),
        of which this process keeps no copy beyond the call that needs it."""
        return await self._get(api_path("secrets", namespace=namespace, name=name))

    async def create_secret(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        created = await self._create_if_absent(api_path("secrets", namespace=namespace), manifest)
        if created is not None:
            self._secrets[(namespace, str(manifest["metadata"]["name"]))] = created
        return created is not None

    # --- Leases -----------------------------------------------------------------------------------

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._get(_leases(namespace, name))

    async def create_lease(
        self, namespace: str, manifest: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Create a Lease; None when one of that name exists already."""
        return await self._create_if_absent(_leases(namespace), manifest)

    async def patch_lease(
        self, namespace: str, name: str, spec: Mapping[str, Any], resource_version: str
    ) -> dict[str, Any]:
        """Merge-patch a Lease's spec if its resourceVersion is still `resource_version` (a
        `Conflict` when it changed since; `LookupError` when it is gone)."""
        body = {"metadata": {"resourceVersion": resource_version}, "spec": dict(spec)}
        try:
            return await self._merge(_leases(namespace, name), body)
        except ApiError as error:
            if error.status == 409:
                raise Conflict(error.message) from error
            if error.status == 404:
                raise LookupError(f"lease {namespace}/{name} is gone") from error
            raise

    # --- the verbs, once ------------------------------------------------------------------------

    async def _create_if_absent(
        self, path: str, manifest: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """The created object; None when one of that name exists (HTTP 409)."""
        try:
            return await self.http.request("POST", path, body=manifest)
        except ApiError as error:
            if error.status == 409:
                return None
            raise

    async def _delete(self, path: str, query: Mapping[str, str] | None = None) -> bool:
        """Delete the object at `path`; False when it is gone already."""
        try:
            await self.http.request("DELETE", path, query=query)
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return True


def _set_label(obj: Mapping[str, Any]) -> str | None:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_SET)
    return value if isinstance(value, str) else None


def _checkpoint_set(obj: Mapping[str, Any]) -> str | None:
    value = (obj.get("spec") or {}).get(CHECKPOINT_SET_FIELD)
    return value if isinstance(value, str) else None


def _equality_selector(selector: str) -> dict[str, str] | None:
    """`a=b,c=d` as a dict; None for any other selector syntax."""
    labels: dict[str, str] = {}
    for term in selector.split(","):
        key, sep, value = term.partition("=")
        if not sep or not key or "!" in key or value.startswith("="):
            return None
        labels[key.strip()] = value.strip()
    return labels
