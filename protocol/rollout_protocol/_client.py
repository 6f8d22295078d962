"""How a coordinator reaches one participant: the `ParticipantClient` interface and its HTTP client.

`HttpParticipantClient` sends every call through the `Route` that declares it (`_routes.py`), the
same table the control plane's router is built from, so the two sides of the hop cannot drift.
It sends them with aiohttp: about a third of the client CPU per call that httpx took (0.30 against
0.94 ms against a FastAPI participant on loopback), and a checkpoint of a 16-pod set makes 48.
aiohttp is imported when an `HttpParticipantClient` first sends (the `client` extra of the
`rollout-protocol` distribution): a participant never calls another's control plane, so a server
built on the SDK does not need it.
"""

from __future__ import annotations

import functools
import math
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import anyio

from . import tracing
from ._routes import (
    COMMIT,
    FORGET,
    PREPARE,
    REMOVE,
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
    RemoveReply,
    RemoveRequest,
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

if TYPE_CHECKING:
    import aiohttp


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
    """One default TLS context for every client this process makes (safe to share). A fresh one
    per client would load the CA bundle each time: 35 ms of CPU and about 1 MB per client, which
    a coordinator pays for every participant of every checkpoint (issue 14: 1,600 clients in a
    100-set checkpoint storm)."""
    return ssl.create_default_context()


_KEEPALIVE_S = 4.0
"""How long an owned session keeps an idle connection: under uvicorn's default of 5 s (our
servers keep theirs 30 s), so a call is never sent on a connection the server is closing."""
_CLOSE_WAIT_S = 1.0
"""How long `aclose` waits for its connections' transports to report closed (they are closed at
once; this is only the wait for the event loop to confirm it)."""


@functools.cache
def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a retry may cure. Not `aiohttp.InvalidURL`: a bad base URL never gets better."""
    import aiohttp

    return (
        aiohttp.ClientConnectionError,  # refused, reset, disconnected, TLS, socket timeouts
        aiohttp.ClientPayloadError,  # a reply body cut short or badly encoded
        aiohttp.ClientResponseError,  # a reply that is not HTTP (no status errors here)
        TimeoutError,  # the call's own timeout (and aiohttp's socket timeouts, which are both)
    )


_NO_AIOHTTP = (
    "HttpParticipantClient (and the conformance kit) need aiohttp: "
    "pip install 'rollout-protocol[client]' (or '[kit]')"
)


def _default_session() -> aiohttp.ClientSession:
    """The session a client makes when it is given none (inside a running event loop).

    No connection limit, in all or per host: a prepare holds its connection while it parks (until
    the participant is ready or the deadline passes), so a cap would queue later calls behind
    parked ones and fail them at their deadlines; what bounds the connections is the calls in
    flight, which the coordinator bounds (one per participant and stage, a few per participant).
    Each participant client owns one such session, so an operator with ~1,600 participants in a
    storm holds at most a few connections per participant, never a pool sized for all of them.
    No cookies, no proxy or netrc lookups from the environment (aiohttp would do both in a thread
    per call): control calls go straight to a participant's address, whatever `HTTP_PROXY` and
    its kin say (httpx, the client before, honoured them).
    """
    try:  # imported on first use: only callers of a control plane need it
        import aiohttp
    except ImportError as error:  # pragma: no cover - depends on the installation
        raise ImportError(_NO_AIOHTTP) from error
    connector = aiohttp.TCPConnector(
        ssl=_tls_context(), limit=0, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),  # every call sets its own
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
    )


class HttpParticipantClient:
    """A participant's control plane over HTTP (aiohttp; asyncio event loops only).

    Each call's timeout comes from its `deadline_ts` (plus a margin for the reply to travel),
    so a prepare that parks until its deadline is not cut off early. Transport failures are
    retried with backoff until the deadline: every control call is idempotent (replayed
    replies, operation ids), so a retry after a lost reply is safe. A call that gets no answer
    in time is `unresponsive`, one that cannot reach the participant by its deadline
    `unreachable`, a reply that is not what the route declares `internal`; an `ErrorBody` reply
    is raised with its own code.

    `client` is an `aiohttp.ClientSession` the caller owns (and closes); it is used as it is
    (its connector, limits and TLS settings). Without one the client makes its own session at
    its first call, inside the running event loop, and closes it in `aclose` (or at the end of
    `async with`): one connector with the shared default TLS context (`_tls_context`), no
    connection limit (a parked prepare holds its connection; see `_default_session`), idle
    connections kept 4 s. Redirects are not followed (a 3xx is a bad reply, as any other
    non-2xx without an `ErrorBody`).
    """

    def __init__(
        self,
        role: Role,
        base_url: str,
        *,
        index: int = 0,
        token: str | None = None,
        client: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.time,
        reply_margin_seconds: float = 5.0,
    ) -> None:
        self._role = Role(role)
        self._instance = f"{self._role.value}-{index}"
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        self._json_headers = {**self._headers, "Content-Type": "application/json"}
        self._owns_session = client is None
        self._session = client
        self._closed = False
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
        """Close the session this client made (a caller's session is left open). Closing is not
        interrupted by a cancellation, so a caller closing many clients in a `finally` closes
        them all."""
        if not self._owns_session:
            return
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_WAIT_S):
                await session.close()

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

    async def remove(self, request: RemoveRequest) -> RemoveReply:
        """Remove checkpoints' records through this participant (the operator's retention; not
        part of `ParticipantClient`, which is what a coordinator needs)."""
        return await self.call(REMOVE, request, request.deadline_ts)

    def _session_now(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None:
            if self._closed:
                raise RuntimeError(f"the HTTP client of {self._instance} has been closed")
            session = self._session = _default_session()
        return session

    async def call(
        self, route: Route[RequestT, ReplyT], request: RequestT, deadline_ts: float
    ) -> ReplyT:
        """Send `request` through `route` inside a client span (`tracing`: its `traceparent`
        goes with the request), retrying transport failures until `deadline_ts`."""
        attributes = {"rollout.instance": self._instance, "rollout.role": self._role.value}
        checkpoint_id = getattr(request, "checkpoint_id", None)
        if checkpoint_id is not None:
            attributes["rollout.checkpoint_id"] = checkpoint_id
        name = f"{route.name} {self._instance}"
        with tracing.span(name, kind=tracing.SpanKind.CLIENT, attributes=attributes):
            return await self._send(route, request, deadline_ts)

    async def _send(
        self, route: Route[RequestT, ReplyT], request: RequestT, deadline_ts: float
    ) -> ReplyT:
        session = self._session_now()
        url = f"{self._base_url}{route.url_path}"
        # None is every request field's default: leaving it out means the same, and keeps a
        # field added later (`PrepareRequest.rollout_ids`) out of the way of a participant
        # that predates it (request models refuse unknown fields)
        content = None if request is None else request.model_dump_json(exclude_none=True).encode()
        headers = self._headers if content is None else self._json_headers
        if traced := tracing.headers():  # the client span's traceparent, when tracing is on
            headers = {**headers, **traced}
        give_up = deadline_ts + self._margin
        backoff = 0.05
        import aiohttp  # installed: the session above is aiohttp's

        while True:
            # aiohttp's total timeout bounds the whole call (connect, send, the reply and its
            # body), to the moment: no rounding up to whole seconds (its default beyond 5 s)
            timeout = aiohttp.ClientTimeout(
                total=max(give_up - self._clock(), 0.1), ceil_threshold=math.inf
            )
            try:
                async with session.request(
                    route.method,
                    url,
                    data=content,
                    headers=headers,
                    timeout=timeout,
                    allow_redirects=False,
                ) as response:
                    body = await response.read()
            except _transport_errors() as error:
                left = deadline_ts - self._clock()
                if isinstance(error, TimeoutError):
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
            return self._decode(response, body, route.reply)

    def _decode(
        self, response: aiohttp.ClientResponse, body: bytes, reply_model: type[ReplyT]
    ) -> ReplyT:
        status = response.status
        if 200 <= status < 300:
            try:
                return reply_model.model_validate_json(body)
            except ValueError as error:
                raise ParticipantError(
                    ErrorCode.INTERNAL,
                    f"unexpected {reply_model.__name__} from {response.url}: {error}",
                    self._instance,
                    status,
                ) from error
        try:
            error_body = ErrorBody.model_validate_json(body)
        except ValueError:
            raise ParticipantError(
                ErrorCode.INTERNAL,
                f"HTTP {status} from {response.url}: {_text(body, response.charset)[:300]}",
                self._instance,
                status,
            ) from None
        raise ParticipantError(
            error_body.error.code, error_body.error.detail, self._instance, status
        )


def _text(body: bytes, charset: str | None) -> str:
    """A reply body as text: its declared charset, else UTF-8; undecodable bytes replaced."""
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")
