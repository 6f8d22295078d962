"""A participant client that passes every call on to the client it wraps.

The unit tests' spies and journals (and bench/protocol_pause.py's timings) wrap a participant
client to watch the calls the coordinator makes; each used to repeat the role, the instance and
every call it does not watch. They subclass `Delegating` and override only the calls they
observe, calling `self.inner` (or `super()`) for the reply.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from rollout_protocol import (
    CommitReply,
    CommitRequest,
    DiscardReply,
    DiscardRequest,
    ForgetReply,
    ForgetRequest,
    ParticipantClient,
    PersistRequest,
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

C = TypeVar("C", bound=ParticipantClient)


class Delegating(Generic[C]):
    """`ParticipantClient` over `inner`: every call is `inner`'s, the role and instance too."""

    def __init__(self, inner: C) -> None:
        self.inner = inner

    @property
    def role(self) -> Role:
        return self.inner.role

    @property
    def instance(self) -> str:
        return self.inner.instance

    async def status(self, deadline_ts: float) -> StatusReply:
        return await self.inner.status(deadline_ts)

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        return await self.inner.prepare(request)

    async def renew(self, request: RenewRequest) -> RenewReply:
        return await self.inner.renew(request)

    async def commit(self, request: CommitRequest) -> CommitReply:
        return await self.inner.commit(request)

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        return await self.inner.restore(request)

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        return await self.inner.resume(request)

    async def retire(self, request: RetireRequest) -> RetireReply:
        return await self.inner.retire(request)

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        return await self.inner.forget(request)

    async def persist(self, request: PersistRequest) -> CommitReply:
        return await self.inner.persist(request)

    async def discard(self, request: DiscardRequest) -> DiscardReply:
        return await self.inner.discard(request)
