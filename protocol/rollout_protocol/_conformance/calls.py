"""The kit's connections to the participants under test: `Target` (what a check is given), one
`_Conn` per target (the participant client in the target's dialect, plain HTTP beside it), and
the small call helpers every check uses (`_ok`, `_refused`, `_expect`, the idle and resume
checks).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import httpx
from pydantic import BaseModel

from .._client import HttpParticipantClient, ParticipantError, _default_session
from .._routes import Dialect
from .._wire import (
    ErrorCode,
    Phase,
    PrepareReply,
    PrepareRequest,
    ResumeRequest,
    Role,
    StatusReply,
)
from .report import CONTROL_MOUNTED, ConformanceError


@dataclass(frozen=True)
class Target:
    """One participant the kit talks to: its base URL, role, control token and counter path.

    `client` (optional) is the `httpx.AsyncClient` the kit sends its own raw requests with
    (refusals, counters); `session` (optional) the `aiohttp.ClientSession` its
    `HttpParticipantClient` sends the protocol's calls with. The kit makes what it is not given,
    and never closes a client or session it was given. `dialect` is the wire dialect the kit
    speaks to the participant (ours, or NeMo Gym's for a participant that mounts it): every
    rule is checked through it, the raw refusals on that dialect's paths and error bodies.
    """

    base_url: str
    role: Role
    token: str
    index: int = 0
    client: httpx.AsyncClient | None = None
    stats_path: str = "/stats"
    session: aiohttp.ClientSession | None = None
    dialect: Dialect = Dialect.ROLLOUT

    @property
    def name(self) -> str:
        return f"{Role(self.role).value}-{self.index}"


@dataclass
class _Conn:
    """A target with an open HTTP client for raw requests and the contract's client."""

    target: Target
    http: httpx.AsyncClient
    participant: HttpParticipantClient
    call_timeout_s: float

    def deadline(self, seconds: float | None = None) -> float:
        return time.time() + (self.call_timeout_s if seconds is None else seconds)

    def url(self, path: str) -> str:
        return self.target.base_url.rstrip("/") + path

    async def status(self, rule: str) -> StatusReply:
        """The participant's status; a status route that is not there at all (404 without the
        protocol's error body) is `control.mounted`, whatever rule asked."""
        try:
            return await self.participant.status(self.deadline())
        except ParticipantError as error:
            if error.status_code == 404 and error.code is ErrorCode.INTERNAL:
                raise _not_mounted(self.target, error) from error
            raise _failed(rule, "GET /status", error) from error


def _not_mounted(target: Target, error: ParticipantError) -> ConformanceError:
    """`control.mounted`: the target answers no control route of the dialect the kit speaks."""
    gym = target.dialect is Dialect.GYM
    return ConformanceError(
        CONTROL_MOUNTED,
        f"{target.name} must serve the control routes of the {target.dialect.value} dialect "
        f"at {target.base_url} (its status route first)",
        f"{error.detail} (no such route: the control plane is not mounted)",
        fix="call plane.install(app) on the app you serve (docs/sdk.md, section 5)"
        + (
            ", with ControlSettings(dialects=(Dialect.GYM,)) for NeMo Gym's dialect"
            if gym
            else "; a participant that mounts only NeMo Gym's dialect is a "
            "Target(..., dialect=Dialect.GYM)"
        ),
    )


@asynccontextmanager
async def _connect(targets: Sequence[Target], call_timeout_s: float) -> AsyncIterator[list[_Conn]]:
    async with AsyncExitStack() as stack:
        conns: list[_Conn] = []
        shared: aiohttp.ClientSession | None = None  # for every target without a session
        for target in targets:
            http = target.client
            if http is None:
                http = await stack.enter_async_context(httpx.AsyncClient())
            session = target.session
            if session is None:
                if shared is None:
                    shared = await stack.enter_async_context(_default_session())
                session = shared
            participant = HttpParticipantClient(
                target.role,
                target.base_url,
                index=target.index,
                token=target.token,
                client=session,
                dialect=target.dialect,
            )
            conns.append(_Conn(target, http, participant, call_timeout_s))
        yield conns


_T = TypeVar("_T")


async def _ok(rule: str, what: str, call: Awaitable[_T]) -> _T:
    try:
        return await call
    except ParticipantError as error:
        raise _failed(rule, what, error) from error


def _failed(rule: str, what: str, error: ParticipantError) -> ConformanceError:
    return ConformanceError(
        rule,
        f"{what} must succeed",
        f"{error.code.value} (HTTP {error.status_code}): {error.detail}",
    )


async def _refused(rule: str, what: str, call: Awaitable[BaseModel], code: ErrorCode) -> None:
    try:
        reply = await call
    except ParticipantError as error:
        if error.code is not code:
            raise ConformanceError(
                rule,
                f"{what} must be refused with {code.value}",
                f"{error.code.value} (HTTP {error.status_code}): {error.detail}",
            ) from error
        return
    raise ConformanceError(
        rule, f"{what} must be refused with {code.value}", f"success: {reply.model_dump_json()}"
    )


def _expect(rule: str, condition: bool, expected: str, observed: object) -> None:
    if not condition:
        raise ConformanceError(rule, expected, str(observed))


def _new_id(label: str) -> str:
    return f"kit-{label}-{uuid.uuid4().hex[:10]}"


async def _expect_idle(conn: _Conn, rule: str, when: str) -> StatusReply:
    status = await conn.status(rule)
    _expect(
        rule,
        status.phase is Phase.IDLE and status.checkpoint_id is None,
        f"{conn.target.name} must be idle with no open checkpoint {when}",
        f"phase {status.phase.value}, checkpoint {status.checkpoint_id!r}",
    )
    return status


async def _resume(conn: _Conn, rule: str, checkpoint_id: str) -> None:
    reply = await _ok(
        rule,
        f"resume of {checkpoint_id}",
        conn.participant.resume(
            ResumeRequest(checkpoint_id=checkpoint_id, deadline_ts=conn.deadline())
        ),
    )
    _expect(
        rule,
        reply.phase is Phase.IDLE,
        f"resume of {checkpoint_id} must answer phase idle",
        reply.phase.value,
    )


async def _prepared(conn: _Conn, rule: str, checkpoint_id: str, deadline_ts: float) -> PrepareReply:
    reply = await _ok(
        rule,
        f"prepare of {checkpoint_id}",
        conn.participant.prepare(
            PrepareRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        ),
    )
    _expect(
        rule,
        reply.ready and reply.phase is Phase.PREPARED,
        f"prepare of {checkpoint_id} on an idle participant must be ready (phase prepared)",
        f"ready={reply.ready}, phase {reply.phase.value}, {reply.blocker_count} blockers",
    )
    return reply


def _named_for(conn: _Conn) -> list[str] | None:
    """The rollouts a refused restore names: none for a Gym target (its restore must name a
    list, and the refusal comes before any record is read), None (every record) for ours."""
    return [] if conn.target.dialect is Dialect.GYM else None
