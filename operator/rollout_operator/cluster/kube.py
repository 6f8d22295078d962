"""The operator's Kubernetes client (kubernetes_asyncio) and the few calls it needs.

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

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from ..model.api import (
    CHECKPOINT_SET_FIELD,
    GROUP,
    LABEL_SET,
    ROLLOUT_CHECKPOINT_PLURAL,
    ROLLOUT_SET_PLURAL,
    VERSION,
)
from .cache import CHECKPOINTS, PODS, SETS, ClusterCache

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
_MERGE_PATCH: dict[str, Any] = {"_content_type": MERGE_PATCH}
"""The generated client would pick JSON Patch for a dict body; status writes are merge patches."""


class Conflict(Exception):
    """The object changed between our read and our write (HTTP 409); read again and retry."""


def api_error_message(error: ApiException) -> str:
    """The API server's own message (a `Status` body), e.g. why a pod was refused."""
    try:
        body = json.loads(error.body or "")
        message = body.get("message")
        if isinstance(message, str) and message:
            return message
    except (TypeError, ValueError):
        pass
    return f"HTTP {error.status}: {error.reason}"


@dataclass
class Kube:
    """One API client for the process; created in the startup hook, closed at cleanup."""

    api: client.ApiClient
    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    coordination: client.CoordinationV1Api | None = None
    field_selectors: bool = True
    """Whether the API server filters checkpoints by set (False once it refused to)."""
    cache: ClusterCache = field(default_factory=ClusterCache)
    """The watches' view; reads go to the API server until the handlers attach Kopf's indexes."""
    _secrets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """Secrets read or created by this process (the control tokens: never replaced while they
    exist, so a checkpoint reads its set's token from here, not from the API server)."""

    @classmethod
    async def connect(
        cls, *, max_concurrent_requests: int = 100, kubeconfig: str | None = None
    ) -> Kube:
        """In-cluster service account first, then the kubeconfig (as Kopf's login does):
        `kubeconfig`, else $KUBECONFIG or ~/.kube/config.

        At most `max_concurrent_requests` requests are open at once; more wait in the client
        (`--api-concurrency`): with a hundred sets passing at once, an unbounded operator had 50
        requests executing in the API server at the same time, and every client of a busy
        server waits longer for it."""
        configuration = client.Configuration()
        configuration.connection_pool_maxsize = max_concurrent_requests
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            await config.load_kube_config(
                config_file=kubeconfig, client_configuration=configuration
            )
        api = client.ApiClient(configuration)
        return cls(
            api=api,
            core=client.CoreV1Api(api),
            custom=client.CustomObjectsApi(api),
            coordination=client.CoordinationV1Api(api),
        )

    async def close(self) -> None:
        await self.api.close()

    @staticmethod
    async def _body(request: Awaitable[Any]) -> bytes:
        """The body of a request made with `_preload_content=False` (the generated client checks
        no status then: an error status is raised here as it would be there)."""
        response = await request
        try:
            body: bytes = await response.read()
            if not 200 <= response.status <= 299:
                error = ApiException(status=response.status, reason=response.reason)
                error.body = body
                raise error
            return body
        finally:
            response.release()

    @classmethod
    async def _raw(cls, request: Awaitable[Any]) -> dict[str, Any]:
        return cast(dict[str, Any], json.loads(await cls._body(request)))

    def to_dict(self, obj: Any) -> dict[str, Any]:
        """A typed client object in its wire form (camelCase keys, strings for times)."""
        return cast(dict[str, Any], self.api.sanitize_for_serialization(obj))

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
        try:
            obj = await self._raw(
                self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, ROLLOUT_SET_PLURAL, name, _preload_content=False
                )
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
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
            obj = await self._raw(
                self.custom.patch_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    namespace,
                    ROLLOUT_SET_PLURAL,
                    name,
                    body,
                    _preload_content=False,
                    **_MERGE_PATCH,
                )
            )
        except ApiException as error:
            if error.status == 409:
                await self.get_set(namespace, name, fresh=True)
                raise Conflict(api_error_message(error)) from error
            raise
        self.cache.saw(SETS, obj, set_name=name)
        return obj

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
                listing = await self._raw(
                    self.custom.list_namespaced_custom_object(
                        GROUP,
                        VERSION,
                        namespace,
                        ROLLOUT_CHECKPOINT_PLURAL,
                        field_selector=f"{field_name}={set_name}",
                        _preload_content=False,
                    )
                )
                return cast(list[dict[str, Any]], listing.get("items") or [])
            except ApiException as error:
                if error.status != 400:
                    raise
                self.field_selectors = False
                logger.info(
                    "the API server does not filter RolloutCheckpoints by %s (%s): listing the "
                    "namespace and filtering in the operator instead",
                    field_name,
                    api_error_message(error),
                )
        listing = await self._raw(
            self.custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, ROLLOUT_CHECKPOINT_PLURAL, _preload_content=False
            )
        )
        items = cast(list[dict[str, Any]], listing.get("items") or [])
        return [c for c in items if (c.get("spec") or {}).get(CHECKPOINT_SET_FIELD) == set_name]

    async def get_checkpoint(
        self, namespace: str, name: str, *, fresh: bool = False
    ) -> dict[str, Any] | None:
        """A RolloutCheckpoint in its wire form; None when it does not exist."""
        if not fresh and self.cache.ready:
            return self.cache.get_checkpoint(namespace, name)
        try:
            obj = await self._raw(
                self.custom.get_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    namespace,
                    ROLLOUT_CHECKPOINT_PLURAL,
                    name,
                    _preload_content=False,
                )
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        self.cache.saw(CHECKPOINTS, obj)
        return obj

    async def patch_checkpoint_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch a RolloutCheckpoint's status subresource (lists in it replace)."""
        body: dict[str, Any] = {"status": dict(status)}
        obj = await self._raw(
            self.custom.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                namespace,
                ROLLOUT_CHECKPOINT_PLURAL,
                name,
                body,
                _preload_content=False,
                **_MERGE_PATCH,
            )
        )
        set_name = (obj.get("spec") or {}).get(CHECKPOINT_SET_FIELD)
        self.cache.saw(CHECKPOINTS, obj, set_name=set_name if isinstance(set_name, str) else None)
        return obj

    # --- core objects ---------------------------------------------------------------------------

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """The pods whose labels match `label_selector` (`key=value,...`), as wire dicts.

        A selector that names a set is answered from the watch's index of the set's pods, with
        objects shared by every reader (read them, never change them).
        Not through the generated `V1Pod` models otherwise: deserializing every pod into them
        (dates parsed with dateutil) was half of the operator's CPU with 100 sets (issue 14)."""
        labels = _equality_selector(label_selector)
        set_name = labels.get(LABEL_SET) if labels is not None else None
        if labels is not None and set_name is not None and self.cache.ready:
            return self.cache.list_pods(namespace, set_name, labels)
        listing = await self._raw(
            self.core.list_namespaced_pod(
                namespace, label_selector=label_selector, _preload_content=False
            )
        )
        return cast(list[dict[str, Any]], listing.get("items") or [])

    async def create_pod(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        """Create a pod; False when one with that name exists already (idempotent retries)."""
        body: Any = manifest
        created = await _create_if_absent(
            lambda: self._raw(
                self.core.create_namespaced_pod(namespace, body, _preload_content=False)
            )
        )
        if created is not None:
            self.cache.saw(PODS, created, set_name=_set_label(created))
        return created is not None

    async def delete_pod(
        self, namespace: str, name: str, *, grace_seconds: int | None = None
    ) -> bool:
        """Delete a pod; False when it is gone already."""
        options: dict[str, Any] = {}
        if grace_seconds is not None:
            options["grace_period_seconds"] = grace_seconds
        try:
            await self._body(
                self.core.delete_namespaced_pod(name, namespace, _preload_content=False, **options)
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    async def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> bool:
        """Merge-patch a pod's labels and annotations; False when the pod is gone."""
        metadata: dict[str, Any] = {}
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        body: Any = {"metadata": metadata}
        try:
            obj = await self._raw(
                self.core.patch_namespaced_pod(
                    name, namespace, body, _preload_content=False, **_MERGE_PATCH
                )
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        self.cache.saw(PODS, obj, set_name=_set_label(obj))
        return True

    async def get_node(self, name: str) -> dict[str, Any] | None:
        """A node (wire form); None when it does not exist (or the watch has not seen it)."""
        if self.cache.ready:
            return self.cache.get_node(name)
        try:
            return await self._raw(self.core.read_node(name, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def create_service(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        body: Any = manifest
        created = await _create_if_absent(
            lambda: self._raw(
                self.core.create_namespaced_service(namespace, body, _preload_content=False)
            )
        )
        return created is not None

    async def get_secret(
        self, namespace: str, name: str, *, remembered: bool = False
    ) -> dict[str, Any] | None:
        """A Secret; with `remembered`, the one this process last read or created if any."""
        if remembered and (namespace, name) in self._secrets:
            return self._secrets[(namespace, name)]
        try:
            secret = await self._raw(
                self.core.read_namespaced_secret(name, namespace, _preload_content=False)
            )
        except ApiException as error:
            if error.status == 404:
                self._secrets.pop((namespace, name), None)
                return None
            raise
        self._secrets[(namespace, name)] = secret
        return secret

    async def create_secret(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        body: Any = manifest
        created = await _create_if_absent(
            lambda: self._raw(
                self.core.create_namespaced_secret(namespace, body, _preload_content=False)
            )
        )
        if created is not None:
            self._secrets[(namespace, str(manifest["metadata"]["name"]))] = created
        return created is not None

    # --- Leases -----------------------------------------------------------------------------------

    def _leases(self) -> client.CoordinationV1Api:
        if self.coordination is None:
            self.coordination = client.CoordinationV1Api(self.api)
        return self.coordination

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._raw(
                self._leases().read_namespaced_lease(name, namespace, _preload_content=False)
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def create_lease(
        self, namespace: str, manifest: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Create a Lease; None when one of that name exists already."""
        body: Any = manifest
        return await _create_if_absent(
            lambda: self._raw(
                self._leases().create_namespaced_lease(namespace, body, _preload_content=False)
            )
        )

    async def patch_lease(
        self, namespace: str, name: str, spec: Mapping[str, Any], resource_version: str
    ) -> dict[str, Any]:
        """Merge-patch a Lease's spec if its resourceVersion is still `resource_version` (a
        `Conflict` when it changed since; `LookupError` when it is gone)."""
        body: Any = {"metadata": {"resourceVersion": resource_version}, "spec": dict(spec)}
        try:
            return await self._raw(
                self._leases().patch_namespaced_lease(
                    name, namespace, body, _preload_content=False, **_MERGE_PATCH
                )
            )
        except ApiException as error:
            if error.status == 409:
                raise Conflict(api_error_message(error)) from error
            if error.status == 404:
                raise LookupError(f"lease {namespace}/{name} is gone") from error
            raise


def _set_label(obj: Mapping[str, Any]) -> str | None:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_SET)
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


async def _create_if_absent(
    create: Callable[[], Awaitable[dict[str, Any]]],
) -> dict[str, Any] | None:
    """The created object; None when one of that name exists (HTTP 409)."""
    try:
        return await create()
    except ApiException as error:
        if error.status == 409:
            return None
        raise
