"""How a coordinator reaches one participant: the `ParticipantClient` interface and its HTTP client.

`HttpParticipantClient` sends every call through the `Route` that declares it (`_routes.py`), the
same table the control plane's router is built from, so the two sides of the hop cannot drift.
"""

from __future__ import annotations

import functools
import ssl
import time
from collections.abc import Callable
from typing import Protocol

import anyio
import httpx

from ._routes import (
    COMMIT,
    FORGET,
    PREPARE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    STATUS,
    ReplyT,
    RequestT,
    Route,
)
from ._wire import (
    CommitReply,
    CommitRequest,
    ErrorBody,
    ErrorCode,
    ForgetReply,
    ForgetRequest,
    PrepareReply,
    PrepareRequest,
    RenewReply,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    Role,
    StatusReply,
)


class ParticipantError(Exception):
    """A participant refused a call (its `ErrorBody`) or could not be reached (`unreachable`)."""

    def __init__(
        self, code: ErrorCode, detail: str, instance: str, status_code: int | None = None
    ) -> None:
        super().__init__(f"{instance}: {code.value}: {detail}")
        self.code = code
        self.detail = detail
        self.instance = instance
        self.status_code = status_code


class ParticipantClient(Protocol):
    """How the coordinator reaches one participant; every call is idempotent on retry."""

    @property
    def role(self) -> Role: ...

    @property
    def instance(self) -> str: ...

    async def status(self, deadline_ts: float) -> StatusReply: ...

    async def prepare(self, request: PrepareRequest) -> PrepareReply: ...

    async def renew(self, request: RenewRequest) -> RenewReply: ...

    async def commit(self, request: CommitRequest) -> CommitReply: ...

    async def restore(self, request: RestoreRequest) -> RestoreReply: ...

    async def resume(self, request: ResumeRequest) -> ResumeReply: ...

    async def retire(self, request: RetireRequest) -> RetireReply: ...

    async def forget(self, request: ForgetRequest) -> ForgetReply: ...


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One default TLS context (httpx's own default) for every client this process makes (safe to
    share). httpx builds a fresh one per client otherwise, loading the CA bundle each time: 35 ms
    of CPU and about 1 MB per client, which a coordinator pays for every participant of every
    checkpoint (issue 14: 1,600 clients in a 100-set checkpoint storm)."""
    return httpx.create_ssl_context()


class HttpParticipantClient:
    """A participant's control plane over HTTP.

    Each call's timeout comes from its `deadline_ts` (plus a margin for the reply to travel),
    so a prepare that parks until its deadline is not cut off early. Transport failures are
    retried with backoff until the deadline: every control call is idempotent (replayed
    replies, operation ids), so a retry after a lost reply is safe.
    """

    def __init__(
        self,
        role: Role,
        base_url: str,
        *,
        index: int = 0,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
        reply_margin_seconds: float = 5.0,
    ) -> None:
        self._role = Role(role)
        self._instance = f"{self._role.value}-{index}"
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(verify=_tls_context())
        self._clock = clock
        self._margin = reply_margin_seconds

    @property
    def role(self) -> Role:
        return self._role

    @property
    def instance(self) -> str:
        return self._instance

    @property
    def base_url(self) -> str:
        return self._base_url

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> HttpParticipantClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def status(self, deadline_ts: float) -> StatusReply:
        return await self.call(STATUS, None, deadline_ts)

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        return await self.call(PREPARE, request, request.deadline_ts)

    async def renew(self, request: RenewRequest) -> RenewReply:
        return await self.call(RENEW, request, request.deadline_ts)

    async def commit(self, request: CommitRequest) -> CommitReply:
        return await self.call(COMMIT, request, request.deadline_ts)

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        return await self.call(RESTORE, request, request.deadline_ts)

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        return await self.call(RESUME, request, request.deadline_ts)

    async def retire(self, request: RetireRequest) -> RetireReply:
        return await self.call(RETIRE, request, request.deadline_ts)

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        return await self.call(FORGET, request, request.deadline_ts)

    async def call(
        self, route: Route[RequestT, ReplyT], request: RequestT, deadline_ts: float
    ) -> ReplyT:
        """Send `request` through `route`, retrying transport failures until `deadline_ts`."""
        url = f"{self._base_url}{route.url_path}"
        content = None if request is None else request.model_dump_json().encode()
        headers = dict(self._headers)
        if content is not None:
            headers["Content-Type"] = "application/json"
        give_up = deadline_ts + self._margin
        backoff = 0.05
        while True:
            remaining = give_up - self._clock()
            try:
                with anyio.fail_after(max(remaining, 0.1)):
                    response = await self._client.request(
                        route.method,
                        url,
                        content=content,
                        headers=headers,
                        timeout=httpx.Timeout(max(remaining, 0.1)),
                    )
            except (httpx.TransportError, TimeoutError) as error:
                left = deadline_ts - self._clock()
                if isinstance(error, TimeoutError | httpx.TimeoutException):
                    raise ParticipantError(
                        ErrorCode.UNRESPONSIVE,
                        f"{route.method} {url} got no answer by its deadline: "
                        f"{type(error).__name__}: {error}",
                        self._instance,
                    ) from error
                if left <= 0:
                    raise ParticipantError(
                        ErrorCode.UNREACHABLE,
                        f"{route.method} {url} failed by its deadline: "
                        f"{type(error).__name__}: {error}",
                        self._instance,
                    ) from error
                await anyio.sleep(min(backoff, left))
                backoff = min(backoff * 2, 1.0)
                continue
            return self._decode(response, route.reply)

    def _decode(self, response: httpx.Response, reply_model: type[ReplyT]) -> ReplyT:
        if response.is_success:
            try:
                return reply_model.model_validate_json(response.content)
            except ValueError as error:
                raise ParticipantError(
                    ErrorCode.INTERNAL,
                    f"unexpected {reply_model.__name__} from {response.url}: {error}",
                    self._instance,
                    response.status_code,
                ) from error
        try:
            body = ErrorBody.model_validate_json(response.content)
        except ValueError:
            raise ParticipantError(
                ErrorCode.INTERNAL,
                f"HTTP {response.status_code} from {response.url}: {response.text[:300]}",
                self._instance,
                response.status_code,
            ) from None
        raise ParticipantError(
            body.error.code, body.error.detail, self._instance, response.status_code
        )
