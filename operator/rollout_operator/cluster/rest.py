"""The operator's HTTP client for the Kubernetes API: JSON in, JSON out, on aiohttp.

The operator needs about fifteen calls on seven kinds of object, all in the wire form (plain
dicts with camelCase keys) that Kopf hands its handlers. A generated client library adds
nothing to that but cost: kubernetes_asyncio's import alone is about 45-60 MB resident, more
than the rest of the operator's code together, and Kopf imports it whenever it is installed
(`rollout_operator.__main__` keeps it out of the operator's process).

- `credentials` finds where the API server is and who we are: the pod's service account
  (the API server's address from `KUBERNETES_SERVICE_HOST`/`_PORT`, as client-go's in-cluster
  config takes it, so no cluster DNS is needed), else the kubeconfig through Kopf's own loader.
  Kopf logs in with the same function (`handlers.runtime`), so both clients are one identity.
- `ApiClient.request` makes one request. A refused one raises `ApiError` with the API
  server's status and message; an unreachable server raises `ConnectionError` or
  `TimeoutError`, which every flow treats as transient. A 401 logs in again once (service
  account tokens are rotated by the kubelet) before it gives up.
- `Transport` is what `Kube` needs from it: the unit tests' fake cluster implements the same.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol, cast
from urllib.parse import quote

import aiohttp
import kopf

logger = logging.getLogger(__name__)

JSON: Final = "application/json"
MERGE_PATCH: Final = "application/merge-patch+json"

REQUEST_TIMEOUT_SECONDS: Final = 60.0
"""No single request may wait longer (the API server answers in milliseconds; a minute means it
or the network is gone, and the flow's own retry or deadline takes it from there)."""

USER_AGENT: Final = "rollout-operator"
"""How the API server's request metrics and audit log name this client."""

SERVICE_ACCOUNT: Final = "/var/run/secrets/kubernetes.io/serviceaccount"


class ApiError(Exception):
    """The API server refused a request: `status` is the HTTP status, `message` its reason."""

    def __init__(self, status: int, reason: str, body: bytes = b"") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        super().__init__(f"HTTP {status}: {self.message}")

    @property
    def message(self) -> str:
        """The API server's own message (a `Status` body), e.g. why a pod was refused."""
        try:
            parsed = json.loads(self.body or b"")
        except ValueError:
            parsed = None
        message = parsed.get("message") if isinstance(parsed, dict) else None
        return message if isinstance(message, str) and message else self.reason


def api_path(
    plural: str,
    *,
    group: str = "",
    version: str = "v1",
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection or an object: core kinds under /api/v1, others under
    /apis/GROUP/VERSION; namespaced when `namespace` is given."""
    parts = ["api", "v1"] if not group else ["apis", group, version]
    if namespace is not None:
        parts += ["namespaces", namespace]
    parts.append(plural)
    if name is not None:
        parts.append(name)
    if subresource is not None:
        parts.append(subresource)
    return "/" + "/".join(quote(part, safe="") for part in parts)


class Transport(Protocol):
    """One request to the API server, answered with the JSON object it returned."""

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str = JSON,
    ) -> dict[str, Any]: ...


def in_cluster(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo | None:
    """The pod's service account, when running in a pod that has one mounted."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    token_path = os.path.join(SERVICE_ACCOUNT, "token")
    if not host or not port or not os.path.exists(token_path):
        return None
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    with open(token_path, encoding="utf-8") as file:
        token = file.read().strip()
    namespace: str | None = None
    namespace_path = os.path.join(SERVICE_ACCOUNT, "namespace")
    if os.path.exists(namespace_path):
        with open(namespace_path, encoding="utf-8") as file:
            namespace = file.read().strip() or None
    ca_path = os.path.join(SERVICE_ACCOUNT, "ca.crt")
    return kopf.ConnectionInfo(
        server=f"https://{host}:{port}",
        ca_path=ca_path if os.path.exists(ca_path) else None,
        token=token or None,
        default_namespace=namespace,
        trust_env=settings.networking.trust_env,
    )


def credentials(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """Where the API server is and who we are: the service account in a pod, else the
    kubeconfig ($KUBECONFIG or ~/.kube/config; a token, a client certificate or a password,
    not exec plugins)."""
    info = in_cluster(settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError(
            "no Kubernetes credentials: not in a pod with a service account, and no kubeconfig "
            "($KUBECONFIG or ~/.kube/config)"
        )
    return info


class ApiClient:
    """An aiohttp session with the operator's credentials; at most `max_concurrent` requests
    open at once (more wait here, not in the API server's queues)."""

    def __init__(
        self, login: Callable[[], kopf.ConnectionInfo], *, max_concurrent: int = 100
    ) -> None:
        self._login = login
        self._max_concurrent = max_concurrent
        self._info = login()
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            info = self._info
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_concurrent, ssl=info.as_ssl_context()
                ),
                headers={**info.as_http_headers(), "User-Agent": USER_AGENT, "Accept": JSON},
                proxy=info.proxy_url,
                trust_env=info.trust_env,
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS),
            )
        return self._session

    async def _relogin(self) -> None:
        logger.info("the API server refused our credentials (HTTP 401): logging in again")
        self._info = self._login()
        await self.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str = JSON,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        status, reason, content = await self._send(method, path, query, data, content_type)
        if status == 401:
            await self._relogin()
            status, reason, content = await self._send(method, path, query, data, content_type)
        if not 200 <= status <= 299:
            raise ApiError(status, reason, content)
        return cast(dict[str, Any], json.loads(content)) if content else {}

    async def _send(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None,
        data: str | None,
        content_type: str,
    ) -> tuple[int, str, bytes]:
        headers = {"Content-Type": content_type} if data is not None else None
        try:
            url = self._info.server.rstrip("/") + path
            async with self._open().request(
                method, url, params=query, data=data, headers=headers
            ) as response:
                return response.status, response.reason or "", await response.read()
        except aiohttp.ClientError as error:  # refused, reset, disconnected: all transient
            raise ConnectionError(f"{method} {path}: {error}") from error
        except TimeoutError as error:
            raise TimeoutError(
                f"{method} {path}: no answer in {REQUEST_TIMEOUT_SECONDS:.0f} s"
            ) from error

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
