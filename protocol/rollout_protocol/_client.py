"""How a coordinator reaches one participant: the `ParticipantClient` interface and its HTTP client.

`HttpParticipantClient` sends every call through the `Route` that declares it (`_routes.py`), the
same table the control plane's router is built from, so the two sides of the hop cannot drift.
It sends them with aiohttp: about a third of the client CPU per call that httpx took (0.30 against
0.94 ms against a FastAPI participant on loopback), and a checkpoint of a 16-pod set makes 48.
aiohttp is imported when an `HttpParticipantClient` first sends (the `client` extra of the
`rollout-protocol` distribution): a participant never calls another's control plane, so a server
built on the SDK does not need it.

A client speaks one of two dialects (`Dialect`): ours, or NeMo Gym's (`_gym.py` maps each route's
request and reply). Unless it is told which, it asks before its first call: our participants
announce their dialects at `GET /ng-control/v1/capabilities` (our extension; a participant that
lists ours is spoken to in ours, any other announcement is Gym's); without that route it asks
Gym's `GET /ng-control/v1/checkpoint/status`, as Gym's own coordinator discovers participants: a
reply naming the participant's `kind` is Gym's, anything else is ours. The answer is remembered
per base URL for the life of the process (`_DIALECTS`), so a coordinator that makes new clients
for each checkpoint probes a pod once; a remembered dialect whose route turns out to be missing
(a new pod at the same address) is probed again once.
"""

from __future__ import annotations

import functools
import math
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from . import _gym as gym
from . import tracing
from ._routes import (
    COMMIT,
    DISCARD,
    FORGET,
    GYM_CAPABILITIES_PATH,
    PERSIST,
    PREPARE,
    REMOVE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    STATUS,
    Dialect,
    ReplyT,
    RequestT,
    Route,
)
from ._wire import (
    CAPABILITIES_HEADER,
    Capability,
    CommitReply,
    CommitRequest,
    DiscardReply,
    DiscardRequest,
    ErrorBody,
    ErrorCode,
    ForgetReply,
    ForgetRequest,
    PersistRequest,
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

    async def persist(self, request: PersistRequest) -> CommitReply:
        """Write a cut's records after the resume (the capability `persist_after_resume`)."""
        ...

    async def discard(self, request: DiscardRequest) -> DiscardReply:
        """Release a cut's records and remove what its persist wrote."""
        ...


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One default TLS context for every client this process makes (safe to share). A fresh one
    per client would load the CA bundle each time: 35 ms of CPU and about 1 MB per client, which
    a coordinator pays for every participant of every checkpoint (1,600 clients in a
    100-set checkpoint storm)."""
    return ssl.create_default_context()


_KEEPALIVE_S = 4.0
"""How long an owned session keeps an idle connection: under uvicorn's default of 5 s (our
servers keep theirs 30 s), so a call is never sent on a connection the server is closing."""
_CLOSE_WAIT_S = 1.0
"""How long `aclose` waits for its connections' transports to report closed (they are closed at
once; this is only the wait for the event loop to confirm it)."""


MAX_REPLY_BYTES = 64 * 1024 * 1024
"""The most the client reads of a reply that lists episodes or rollouts (prepare, commit,
restore, retire): four times the largest request a participant reads (`MAX_BODY_BYTES`), ample
for a restore of a million episodes. docs/protocol.md, "Limits"."""
MAX_SMALL_REPLY_BYTES = 1024 * 1024
"""The most the client reads of a reply of a fixed shape (status, renew, resume, forget, remove,
the Gym capabilities): a thousand times a real one."""
MAX_ERROR_REPLY_BYTES = 1024 * 1024
"""The most the client reads of a reply that is not 2xx (an error body, whatever the route)."""
REPLY_LIMITS: dict[str, int] = {
    "prepare": MAX_REPLY_BYTES,
    "commit": MAX_REPLY_BYTES,
    "restore": MAX_REPLY_BYTES,
    "retire": MAX_REPLY_BYTES,
}
"""The bound of each route's 2xx reply, by route name; a route not named has
`MAX_SMALL_REPLY_BYTES`. A reply past its bound is refused, not read on (`ReplyTooLarge`)."""
_READ_CHUNK = 64 * 1024
"""How much of a reply is taken from the connection at a time while it is counted."""


def reply_limit(route_name: str) -> int:
    """The most bytes the client reads of a 2xx reply of `route_name` (docs/protocol.md,
    "Limits")."""
    return REPLY_LIMITS.get(route_name, MAX_SMALL_REPLY_BYTES)


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


_REMEMBERED_DIALECTS = 65_536
_DIALECTS: OrderedDict[str, Dialect] = OrderedDict()
"""The dialect each participant base URL announced (oldest forgotten first)."""


def _remember_dialect(base_url: str, dialect: Dialect) -> None:
    _DIALECTS[base_url] = dialect
    _DIALECTS.move_to_end(base_url)
    while len(_DIALECTS) > _REMEMBERED_DIALECTS:
        _DIALECTS.popitem(last=False)


class _RouteMissing(Exception):
    """A 404 without a protocol error body: the participant has no such route (in the dialect
    spoken), so the dialect remembered for its address may be out of date."""

    def __init__(self, error: ParticipantError) -> None:
        super().__init__(str(error))
        self.error = error


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
        # replies are counted as they arrive (`_read_bounded`): a compressed reply would be
        # counted after it was inflated, so none is asked for (`Accept-Encoding: identity`)
        auto_decompress=False,
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
        dialect: Dialect | None = None,
    ) -> None:
        self._role = Role(role)
        self._fixed_dialect = None if dialect is None else Dialect(dialect)
        self._dialect = self._fixed_dialect
        self._instance = f"{self._role.value}-{index}"
        self._base_url = base_url.rstrip("/")
        # the capabilities whose reply fields this client reads (docs/protocol.md)
        self._headers = {
            "Accept-Encoding": "identity",
            CAPABILITIES_HEADER: ",".join(cap.value for cap in Capability),
        }
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
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

    @property
    def dialect(self) -> Dialect | None:
        """The dialect this client speaks: the one it was given, or the one the participant
        announced (None until the first call reads it)."""
        return self._dialect

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

    async def persist(self, request: PersistRequest) -> CommitReply:
        return await self.call(PERSIST, request, request.deadline_ts)

    async def discard(self, request: DiscardRequest) -> DiscardReply:
        return await self.call(DISCARD, request, request.deadline_ts)

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
        """Send `request` through `route` in the participant's dialect inside a client span
        (`tracing`: its `traceparent` goes with the request), retrying transport failures until
        `deadline_ts`."""
        attributes = {"rollout.instance": self._instance, "rollout.role": self._role.value}
        checkpoint_id = getattr(request, "checkpoint_id", None)
        if checkpoint_id is not None:
            attributes["rollout.checkpoint_id"] = checkpoint_id
        name = f"{route.name} {self._instance}"
        with tracing.span(name, kind=tracing.SpanKind.CLIENT, attributes=attributes):
            return await self._dispatch(route, request, deadline_ts)

    async def _dispatch(
        self, route: Route[RequestT, ReplyT], request: RequestT, deadline_ts: float
    ) -> ReplyT:
        for probe in (False, True):
            dialect = self._dialect
            if dialect is None:
                dialect = await self._negotiate(deadline_ts)
            try:
                if dialect is Dialect.ROLLOUT:
                    return await self._call_rollout(route, request, deadline_ts)
                return await self._call_gym(route, request, deadline_ts)
            except _RouteMissing as missing:
                if self._fixed_dialect is not None or probe:
                    raise missing.error from None
                _DIALECTS.pop(self._base_url, None)
                self._dialect = None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _negotiate(self, deadline_ts: float) -> Dialect:
        """Ask the participant's dialect (or take the one its address announced before)."""
        dialect = _DIALECTS.get(self._base_url)
        if dialect is None:
            url = f"{self._base_url}{GYM_CAPABILITIES_PATH}"
            status, body, charset = await self._send(
                "GET", url, None, self._headers, deadline_ts, "capabilities", MAX_SMALL_REPLY_BYTES
            )
            if status == 404:  # not one of ours that speaks Gym: ask Gym's own discovery route
                dialect = await self._gym_status_probe(deadline_ts)
            elif 200 <= status < 300:
                try:
                    capabilities = gym.GymCapabilities.model_validate_json(body)
                except ValueError as error:
                    raise ParticipantError(
                        ErrorCode.INTERNAL,
                        f"unexpected capabilities from {url}: {error}",
                        self._instance,
                        status,
                    ) from error
                in_ours = Dialect.ROLLOUT.value in capabilities.dialects
                dialect = Dialect.ROLLOUT if in_ours else Dialect.GYM
            else:
                raise self._gym_error(status, body, charset, url)
            _remember_dialect(self._base_url, dialect)
        self._dialect = dialect
        return dialect

    async def _gym_status_probe(self, deadline_ts: float) -> Dialect:
        """Gym's discovery: its participants answer `GET .../checkpoint/status` with their
        `kind`; a refused token is raised, any other answer means ours (a participant from
        before capabilities, or a pod of several workers that routes only rollouts)."""
        path = STATUS.path_in(Dialect.GYM)
        url = f"{self._base_url}{path}"
        status, body, charset = await self._send(
            "GET", url, None, self._headers, deadline_ts, "status", MAX_SMALL_REPLY_BYTES
        )
        if status == 401:
            raise self._gym_error(status, body, charset, url)
        if 200 <= status < 300:
            try:
                gym.GymStatusReply.model_validate_json(body)
            except ValueError:
                return Dialect.ROLLOUT
            return Dialect.GYM
        return Dialect.ROLLOUT

    async def _call_rollout(
        self, route: Route[RequestT, ReplyT], request: RequestT, deadline_ts: float
    ) -> ReplyT:
        url = f"{self._base_url}{route.url_path}"
        # None is every request field's default: leaving it out means the same, and keeps a
        # field added later (`PrepareRequest.rollout_ids`) out of the way of a participant
        # that predates it (request models refuse unknown fields)
        content = None if request is None else request.model_dump_json(exclude_none=True).encode()
        headers = self._headers if content is None else self._json_headers
        status, body, charset = await self._send(
            route.method, url, content, headers, deadline_ts, route.name, reply_limit(route.name)
        )
        return self._decode(status, body, charset, url, route.reply)

    async def _call_gym(
        self, route: Route[RequestT, ReplyT], request: RequestT, deadline_ts: float
    ) -> ReplyT:
        path = route.path_in(Dialect.GYM)
        if path is None:
            raise ParticipantError(
                ErrorCode.UNSUPPORTED,
                f"{route.name}: the NeMo Gym dialect this participant speaks has no such operation",
                self._instance,
            )
        codec = gym.codec(route)
        attempt = None
        if isinstance(request, CommitRequest) and request.rollout_ids is not None:
            attempt = (await self.status(deadline_ts)).attempt  # Gym scopes name episodes
        side = gym.ClientSide(self._role, self._instance, attempt)
        try:
            sent = codec.to_gym_request(request, side)
        except gym.Unmappable as error:
            raise ParticipantError(ErrorCode.UNSUPPORTED, str(error), self._instance) from None
        content = None if sent is None else sent.model_dump_json(exclude_none=True).encode()
        headers = self._headers if content is None else self._json_headers
        url = f"{self._base_url}{path}"
        status, body, charset = await self._send(
            route.method, url, content, headers, deadline_ts, route.name, reply_limit(route.name)
        )
        if not 200 <= status < 300:
            raise self._gym_error(status, body, charset, url)
        try:
            reply: Any = codec.to_ours_reply(codec.reply.model_validate_json(body), request, side)
        except ValueError as error:  # a pydantic ValidationError or `Unmappable`
            raise ParticipantError(
                ErrorCode.INTERNAL,
                f"unexpected {codec.reply.__name__} from {url}: {error}",
                self._instance,
                status,
            ) from error
        result: ReplyT = reply
        return result

    async def _send(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: dict[str, str],
        deadline_ts: float,
        kind: str,
        limit: int,
    ) -> tuple[int, bytes, str | None]:
        """One request, transport failures retried with backoff until `deadline_ts`: the
        reply's status, body and charset. The body is read up to `limit` bytes for a 2xx reply
        of `kind` (`MAX_ERROR_REPLY_BYTES` for any other), and a reply past it is refused
        (`ReplyTooLarge`, not retried): one broken or hostile participant cannot make its
        caller hold more than that (docs/protocol.md, "Limits")."""
        session = self._session_now()
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
                    method,
                    url,
                    data=content,
                    headers=headers,
                    timeout=timeout,
                    allow_redirects=False,
                ) as response:
                    ok = 200 <= response.status < 300
                    body = await _read_bounded(response, limit if ok else MAX_ERROR_REPLY_BYTES)
            except _ReplyTooLarge as large:
                ok = 200 <= large.status < 300
                what = f"a {kind} reply" if ok else f"an HTTP {large.status} reply"
                raise ParticipantError(
                    ErrorCode.INTERNAL,
                    f"{method} {url}: the participant answered more than {large.limit} bytes"
                    f"{large.how}; the client reads at most {large.limit} bytes of {what} "
                    '(docs/protocol.md, "Limits")',
                    self._instance,
                    large.status,
                ) from None
            except _transport_errors() as error:
                left = deadline_ts - self._clock()
                if isinstance(error, TimeoutError):
                    raise ParticipantError(
                        ErrorCode.UNRESPONSIVE,
                        f"{method} {url} got no answer by its deadline: "
                        f"{type(error).__name__}: {error}",
                        self._instance,
                    ) from error
                if left <= 0:
                    raise ParticipantError(
                        ErrorCode.UNREACHABLE,
                        f"{method} {url} failed by its deadline: {type(error).__name__}: {error}",
                        self._instance,
                    ) from error
                await anyio.sleep(min(backoff, left))
                backoff = min(backoff * 2, 1.0)
                continue
            return response.status, body, response.charset

    def _decode(
        self, status: int, body: bytes, charset: str | None, url: str, reply_model: type[ReplyT]
    ) -> ReplyT:
        if 200 <= status < 300:
            try:
                return reply_model.model_validate_json(body)
            except ValueError as error:
                raise ParticipantError(
                    ErrorCode.INTERNAL,
                    f"unexpected {reply_model.__name__} from {url}: {error}",
                    self._instance,
                    status,
                ) from error
        try:
            error_body = ErrorBody.model_validate_json(body)
        except ValueError:
            refused = ParticipantError(
                ErrorCode.INTERNAL,
                f"HTTP {status} from {url}: {_text(body, charset)[:300]}",
                self._instance,
                status,
            )
            if status == 404:
                raise _RouteMissing(refused) from None
            raise refused from None
        raise ParticipantError(
            error_body.error.code, error_body.error.detail, self._instance, status
        )

    def _gym_error(
        self, status: int, body: bytes, charset: str | None, url: str
    ) -> ParticipantError | _RouteMissing:
        """The error a non-2xx Gym reply stands for (our codes, `_gym.our_error`)."""
        try:
            code, detail = gym.our_error(status, body)
        except ValueError:
            error = ParticipantError(
                ErrorCode.INTERNAL,
                f"HTTP {status} from {url}: {_text(body, charset)[:300]}",
                self._instance,
                status,
            )
            return _RouteMissing(error) if status == 404 else error
        return ParticipantError(code, detail, self._instance, status)


class _ReplyTooLarge(Exception):
    """A reply passed the bound it was read under (`_read_bounded`)."""

    def __init__(self, status: int, limit: int, how: str) -> None:
        super().__init__(f"HTTP {status}: more than {limit} bytes{how}")
        self.status = status
        self.limit = limit
        self.how = how


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The reply's body, read as it arrives and counted: at most `limit` bytes are ever held.

    A declared `Content-Length` over `limit` is refused before a byte of the body is read; an
    undeclared (chunked) or lying one is refused as soon as the count passes it. Either way the
    connection is closed, not kept for reuse, so the rest of the reply is never read."""
    declared = response.content_length
    if declared is not None and declared > limit:
        response.close()
        raise _ReplyTooLarge(response.status, limit, f" (Content-Length: {declared})")
    body = bytearray()
    async for chunk in response.content.iter_chunked(_READ_CHUNK):
        if len(body) + len(chunk) > limit:
            response.close()
            raise _ReplyTooLarge(response.status, limit, "")
        body += chunk
    return bytes(body)


def _text(body: bytes, charset: str | None) -> str:
    """A reply body as text: its declared charset, else UTF-8; undecodable bytes replaced."""
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")
