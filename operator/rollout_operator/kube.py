"""The operator's Kubernetes client (kubernetes_asyncio) and the few calls it needs.

Kopf watches and patches the objects it handles itself; this client is for everything else:
creating pods, Services and the token Secret, listing pods, and writing a RolloutSet's status
from handlers of other objects (pod events). Objects cross this boundary as plain dicts in the
wire (camelCase) form, which the pure modules (`resources`, `setplan`) work on.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final, cast

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from .api import CHECKPOINT_SET_FIELD, GROUP, ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL, VERSION

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
_MERGE_PATCH: dict[str, Any] = {"_content_type": MERGE_PATCH}
"""The generated client would pick JSON Patch for a dict body; status writes are merge patches."""


_pass_reads: ContextVar[dict[tuple[str, ...], tuple[float, bytes]] | None] = ContextVar(
    "kube_pass_reads", default=None
)
SNAPSHOT_MAX_AGE_SECONDS: Final = 0.4
"""A read older than this is made again: below every poll interval of the flows a pass may run
(the recovery polls its pods every 0.5 s), so a wait inside a pass never sees a frozen world."""


@contextmanager
def pass_snapshot() -> Iterator[None]:
    """Within the block, a set and a pod list read again are served from the first read until
    this process writes anything (issue 14: one reconcile pass read its set and listed its pods
    three times, in the status repair, the recovery check and the reconcile).

    A stored read is used for `SNAPSHOT_MAX_AGE_SECONDS` at most: no staler than the pass
    already is between its steps, and whatever changes meanwhile also wakes the set's loop for
    another pass. Each read parses the stored body again, so callers may change what they get."""
    token = _pass_reads.set({})
    try:
        yield
    finally:
        _pass_reads.reset(token)


def _forget_reads() -> None:
    reads = _pass_reads.get()
    if reads:
        reads.clear()


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
    field_selectors: bool = True
    """Whether the API server filters checkpoints by set (False once it refused to)."""

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
        return cls(api=api, core=client.CoreV1Api(api), custom=client.CustomObjectsApi(api))

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

    @classmethod
    async def _read(
        cls, key: tuple[str, ...], request: Callable[[], Awaitable[Any]], *, fresh: bool = False
    ) -> dict[str, Any]:
        """A read, served from the pass snapshot when one is open and holds it (unless `fresh`:
        then always from the API server, and the snapshot keeps the newer read)."""
        reads = _pass_reads.get()
        stored = reads.get(key) if reads is not None and not fresh else None
        if stored is not None and time.monotonic() - stored[0] <= SNAPSHOT_MAX_AGE_SECONDS:
            body = stored[1]
        else:
            body = await cls._body(request())
            if reads is not None:
                reads[key] = (time.monotonic(), body)
        return cast(dict[str, Any], json.loads(body))

    def to_dict(self, obj: Any) -> dict[str, Any]:
        """A typed client object in its wire form (camelCase keys, strings for times)."""
        return cast(dict[str, Any], self.api.sanitize_for_serialization(obj))

    # --- RolloutSets ----------------------------------------------------------------------------

    async def get_set(
        self, namespace: str, name: str, *, fresh: bool = False
    ) -> dict[str, Any] | None:
        """The set as the API server has it; `fresh` skips the pass snapshot (a read that must
        be newer than one made before, e.g. to explain a pod deletion seen since)."""
        try:
            return await self._read(
                ("set", namespace, name),
                lambda: self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, ROLLOUT_SET_PLURAL, name, _preload_content=False
                ),
                fresh=fresh,
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def patch_set_status(
        self,
        namespace: str,
        name: str,
        status: Mapping[str, Any],
        *,
        resource_version: str | None,
    ) -> dict[str, Any]:
        """Merge-patch the status subresource; with `resource_version`, only if unchanged since.

        The precondition makes concurrent writers (this reconciler, the recovery and checkpoint
        flows) safe: a lost race is a `Conflict`, never a silently overwritten condition.
        """
        _forget_reads()
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            obj = await self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, ROLLOUT_SET_PLURAL, name, body, **_MERGE_PATCH
            )
        except ApiException as error:
            if error.status == 409:
                raise Conflict(api_error_message(error)) from error
            raise
        return cast(dict[str, Any], obj)

    # --- RolloutCheckpoints -----------------------------------------------------------------------

    async def list_checkpoints(self, namespace: str, set_name: str) -> list[dict[str, Any]]:
        """Every RolloutCheckpoint whose `spec.rolloutSet` is `set_name` (people create them
        unlabelled, so a label selector would miss some), in wire form, parsed once.

        The API server filters them by the CRD's selectable field (Kubernetes 1.31+): listing
        the namespace and filtering here parsed every set's checkpoints on every policy pass, a
        fifth of the operator's CPU with 100 sets in a checkpoint storm (py-spy). An API server
        that refuses the field selector (older, or without the CRD applied by this version) is
        asked for the whole namespace from then on, and this process filters."""
        field = f"spec.{CHECKPOINT_SET_FIELD}"
        if self.field_selectors:
            try:
                listing = await self._raw(
                    self.custom.list_namespaced_custom_object(
                        GROUP,
                        VERSION,
                        namespace,
                        ROLLOUT_CHECKPOINT_PLURAL,
                        field_selector=f"{field}={set_name}",
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
                    field,
                    api_error_message(error),
                )
        listing = await self._raw(
            self.custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, ROLLOUT_CHECKPOINT_PLURAL, _preload_content=False
            )
        )
        items = cast(list[dict[str, Any]], listing.get("items") or [])
        return [c for c in items if (c.get("spec") or {}).get(CHECKPOINT_SET_FIELD) == set_name]

    async def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A RolloutCheckpoint in its wire form; None when it does not exist."""
        try:
            obj = await self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, ROLLOUT_CHECKPOINT_PLURAL, name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return cast(dict[str, Any], obj)

    async def patch_checkpoint_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch a RolloutCheckpoint's status subresource (lists in it replace)."""
        _forget_reads()
        body: dict[str, Any] = {"status": dict(status)}
        obj = await self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, ROLLOUT_CHECKPOINT_PLURAL, name, body, **_MERGE_PATCH
        )
        return cast(dict[str, Any], obj)

    # --- core objects ---------------------------------------------------------------------------

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """The pods as the API server sent them (wire dicts, parsed once).

        Not through the generated `V1Pod` models: deserializing every pod into them (dates parsed
        with dateutil) and serializing them back to dicts was half of the operator's CPU with
        100 sets (issue 14, py-spy)."""
        listing = await self._read(
            ("pods", namespace, label_selector),
            lambda: self.core.list_namespaced_pod(
                namespace, label_selector=label_selector, _preload_content=False
            ),
        )
        return cast(list[dict[str, Any]], listing.get("items") or [])

    async def create_pod(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        """Create a pod; False when one with that name exists already (idempotent retries)."""
        body: Any = manifest
        return await _create_if_absent(lambda: self.core.create_namespaced_pod(namespace, body))

    async def delete_pod(
        self, namespace: str, name: str, *, grace_seconds: int | None = None
    ) -> bool:
        """Delete a pod; False when it is gone already."""
        _forget_reads()
        options: dict[str, Any] = {}
        if grace_seconds is not None:
            options["grace_period_seconds"] = grace_seconds
        try:
            await self.core.delete_namespaced_pod(name, namespace, **options)
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
        _forget_reads()
        metadata: dict[str, Any] = {}
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        body: Any = {"metadata": metadata}
        try:
            await self.core.patch_namespaced_pod(name, namespace, body, **_MERGE_PATCH)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    async def create_service(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        body: Any = manifest
        return await _create_if_absent(lambda: self.core.create_namespaced_service(namespace, body))

    async def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._raw(
                self.core.read_namespaced_secret(name, namespace, _preload_content=False)
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def create_secret(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        body: Any = manifest
        return await _create_if_absent(lambda: self.core.create_namespaced_secret(namespace, body))


async def _create_if_absent(create: Callable[[], Awaitable[Any]]) -> bool:
    _forget_reads()
    try:
        await create()
    except ApiException as error:
        if error.status == 409:
            return False
        raise
    return True
