"""The private worker channel of a multi-worker pod: both ends (docs/protocol.md, "Workers").

A pod whose server runs several worker processes is one participant. Its main process owns the
public port and the one `ControlPlane`, whose participant is a `WorkerPool`: every checkpoint
operation fans out from it to every worker over the worker's Unix socket, on the routes of
`worker_router`, which each worker's plane mounts instead of the control routes. The checkpoint
protocol itself (phases, leases, replayed replies, storage, auth) runs once, in the main
process; a worker only parks, exports, installs, reopens and retires its own episodes.

Which worker holds an episode is a pure function of its rollout id (`owner`): new episodes,
repeated and continued `/run`s, restored records and per-rollout `/stats` all agree on it
without a routing table that could be lost or go stale.

The channel shares each worker's socket with the episode requests the pod routes there from its
public port, so its routes answer only a request that carries the pod's worker key
(`WORKER_KEY_HEADER`): a random key `serve_workers` makes for each pod run and hands to its
workers alone. Whoever reaches the pod's port reaches the server's own routes, never these.
"""

from __future__ import annotations

import hashlib
import hmac
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from ._participant import EpisodeCounts, ParkState, Participant
from ._storage import EncodedRecord
from ._wire import RECORD, EpisodeId, ErrorBody, ErrorCode, ProtocolError, Record, Role

WORKER_PREFIX = "/_worker/v1"
WORKER_KEY_HEADER = "X-Rollout-Worker-Key"
"""Carries the pod's worker key on every call of the private channel."""
NDJSON = "application/x-ndjson"


def owner(rollout_id: str, workers: int) -> int:
    """The worker that holds `rollout_id`'s episodes in a pod of `workers` workers."""
    return zlib.crc32(rollout_id.encode()) % workers


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Park(_Body):
    deadline_ts: float


class _ParkReply(_Body):
    parked: list[EpisodeId]
    blockers: list[EpisodeId]
    restarts: list[EpisodeId]


class _Scope(_Body):
    rollout_ids: list[str] | None = None


class _Retire(_Body):
    attempt: int
    rollout_ids: list[str] | None = None


class _Rewire(_Body):
    peers: dict[Role, str]


class _Counts(_Body):
    live: int = 0
    parked: int = 0
    restored: int = 0


class _Restored(_Body):
    restored: list[EpisodeId]


class PodState(_Body):
    """What the pod's plane is now: the attempt it runs and the instance it is. Every install
    and reopen sends it, so each worker's plane follows it exactly, also back to a standby's
    own instance after a failed adoption (docs/protocol.md, "Workers")."""

    attempt: int
    index: int
    standby: bool


def _lines(records: Sequence[Record]) -> bytes:
    return b"".join(RECORD.dump_json(record) + b"\n" for record in records)


def _parse(body: bytes) -> list[Record]:
    return [RECORD.validate_json(line) for line in body.split(b"\n") if line]


def _counts(participant: Participant) -> _Counts:
    counts = participant.counts()
    return _Counts(live=counts.live, parked=counts.parked, restored=counts.restored)


def worker_router(plane: Any) -> APIRouter:
    """The worker end: what the pod's `WorkerPool` calls on this worker's participant.

    `plane` is the worker's `ControlPlane` (typed `Any`: `_control` imports this module). Its
    attempt and retire marks follow the pod's plane, so the worker's own `/run` checks
    (`plane.attempt`, `plane.is_retired`) answer as a single-process server's would."""
    participant: Participant = plane.participant
    key: str = plane.settings.worker_key
    router = APIRouter(prefix=WORKER_PREFIX, dependencies=[Depends(_key_check(key))])

    @router.post("/close")
    async def close() -> _Counts:
        await participant.close_admission()
        return _counts(participant)

    @router.post("/park")
    async def park(body: _Park) -> _ParkReply:
        state = await participant.park(body.deadline_ts)
        return _ParkReply(parked=state.parked, blockers=state.blockers, restarts=state.restarts)

    @router.post("/export")
    async def export(body: _Scope) -> Response:
        scope = None if body.rollout_ids is None else frozenset(body.rollout_ids)
        lines = b"".join(item.line for item in participant.export_encoded(scope))
        return Response(lines, media_type=NDJSON)

    @router.post("/release")
    async def release(body: _Scope) -> _Counts:
        participant.release_outside(frozenset(body.rollout_ids or ()))
        return _counts(participant)

    @router.post("/validate")
    async def validate(request: Request) -> _Counts:
        try:
            participant.validate(_parse(await request.body()))
        except ValueError as error:
            raise ProtocolError(ErrorCode.RECORDS_INVALID, f"records refused: {error}") from None
        return _counts(participant)

    @router.post("/install")
    async def install(
        request: Request, attempt: int, index: int | None = None, standby: bool = False
    ) -> _Restored:
        restored = await participant.install(_parse(await request.body()), attempt)
        plane.follow(attempt, index, standby)
        return _Restored(restored=restored)

    @router.post("/reopen")
    async def reopen(body: PodState | None = None) -> _Counts:
        await participant.reopen()
        if body is not None:
            plane.follow(body.attempt, body.index, body.standby)
        return _counts(participant)

    @router.post("/retire")
    async def retire(body: _Retire) -> _Restored:
        scope = None if body.rollout_ids is None else frozenset(body.rollout_ids)
        plane.mark_retired(body.attempt, scope)
        return _Restored(restored=await participant.retire(body.attempt, scope))

    @router.post("/forget")
    async def forget(body: _Scope) -> _Counts:
        participant.forget(frozenset(body.rollout_ids or ()))
        return _counts(participant)

    @router.post("/rewire")
    async def rewire(body: _Rewire) -> _Counts:
        participant.rewire(body.peers)
        return _counts(participant)

    @router.get("/counts")
    async def counts() -> _Counts:
        return _counts(participant)

    return router


def _key_check(key: str) -> Callable[[Request], None]:
    """The channel's gate: the pod's worker key, compared in constant time."""
    expected = key.encode()

    def check(request: Request) -> None:
        presented = request.headers.get(WORKER_KEY_HEADER, "").encode()
        if not hmac.compare_digest(presented, expected):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                f"{WORKER_PREFIX} is the pod's private worker channel: only the pod's own main "
                "process may call it",
            )

    return check


class WorkerLost(ProtocolError):
    """A worker did not answer the pod's plane: its episodes are lost (the pod exits)."""


class WorkerPool(Participant):
    """The pod end: one participant made of every worker's episodes.

    Operations the control plane awaits fan out to all workers at once and are merged: a park is
    ready only when every worker's is. The plane's synchronous hooks are served from what the
    async ones fetched (`export_encoded` from the records a ready park captured: admission is
    closed and every episode parked from then until the checkpoint closes) or queued and sent
    before the next async operation (`release_outside`, `forget`, `rewire`). Records are
    validated by the workers during `install` (all of them before any installs anything)."""

    def __init__(self, role: Role, sockets: Sequence[str], key: str) -> None:
        self.role = role
        channel = {WORKER_KEY_HEADER: key}
        self._clients = [_uds_client(path, httpx.Limits(), channel) for path in sockets]
        """The private channel's, one per worker: never queued behind episode requests."""
        unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._proxies = [_uds_client(path, unlimited, {}) for path in sockets]
        """For the episode requests the pod routes to a worker: every live episode holds one
        connection for as long as its `/run`, so the pool has no limit."""
        self._records: list[EncodedRecord] | None = None
        self._queued: list[tuple[str, dict[str, Any]]] = []
        self._counts = EpisodeCounts()
        self.pod_state: Callable[[], PodState] | None = None
        """The pod's plane as it is now (set by `serve_workers`): its identity is sent with
        every install and its whole state with every reopen, so the workers of a standby
        adopted for another instance become it, and go back with the pod when the adoption
        fails."""

    @property
    def workers(self) -> int:
        return len(self._clients)

    def client(self, worker: int) -> httpx.AsyncClient:
        """The client for requests routed to `worker` (not the private channel's)."""
        return self._proxies[worker]

    async def aclose(self) -> None:
        for client in [*self._clients, *self._proxies]:
            await client.aclose()

    # --- the channel ---------------------------------------------------------------------------

    async def _one(
        self,
        worker: int,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        method: str = "POST",
    ) -> httpx.Response:
        try:
            reply = await self._clients[worker].request(
                method,
                WORKER_PREFIX + path,
                json=json if content is None else None,
                content=content,
                headers={"content-type": NDJSON} if content is not None else None,
            )
        except httpx.TransportError as error:
            raise WorkerLost(
                ErrorCode.INTERNAL,
                f"worker {worker} of this pod is gone ({type(error).__name__}); its episodes are "
                "lost and the pod exits, so the set recovers from its last checkpoint",
            ) from error
        if reply.status_code >= 400:
            try:
                detail = ErrorBody.model_validate_json(reply.content).error
                code, text = detail.code, detail.detail
            except ValueError:
                code, text = ErrorCode.INTERNAL, reply.text[:500]
            raise ProtocolError(code, f"worker {worker}: {text}")
        return reply

    async def _each(
        self, path: str, bodies: Mapping[int, Any] | None = None, *, ndjson: bool = False
    ) -> list[httpx.Response]:
        """POST `path` to every worker at once (body per worker: `bodies[k]`, default `{}`)."""
        replies: list[httpx.Response | None] = [None] * self.workers

        async def call(worker: int) -> None:
            body = {} if bodies is None else bodies[worker]
            if ndjson:
                replies[worker] = await self._one(worker, path, content=bytes(body))
            else:
                replies[worker] = await self._one(worker, path, json=body)

        async with anyio.create_task_group() as group:
            for worker in range(self.workers):
                group.start_soon(call, worker)
        return [reply for reply in replies if reply is not None]

    async def _flush(self) -> None:
        queued, self._queued = self._queued, []
        for path, body in queued:
            self._take_counts(await self._each(path, {k: body for k in range(self.workers)}))

    def _take_counts(self, replies: Sequence[httpx.Response]) -> None:
        counts = [_Counts.model_validate_json(reply.content) for reply in replies]
        self._counts = EpisodeCounts(
            live=sum(c.live for c in counts),
            parked=sum(c.parked for c in counts),
            restored=sum(c.restored for c in counts),
        )

    async def refresh_counts(self) -> None:
        """Read every worker's counts (before the plane answers `/status`)."""
        replies: list[httpx.Response | None] = [None] * self.workers

        async def call(worker: int) -> None:
            replies[worker] = await self._one(worker, "/counts", method="GET")

        async with anyio.create_task_group() as group:
            for worker in range(self.workers):
                group.start_soon(call, worker)
        self._take_counts([reply for reply in replies if reply is not None])

    # --- Participant ---------------------------------------------------------------------------

    async def close_admission(self) -> None:
        await self._flush()
        self._take_counts(await self._each("/close"))

    async def park(self, deadline_ts: float) -> ParkState:
        await self._flush()
        body = {"deadline_ts": deadline_ts}
        replies = await self._each("/park", {k: body for k in range(self.workers)})
        states = [_ParkReply.model_validate_json(reply.content) for reply in replies]
        state = ParkState(
            parked=[e for s in states for e in s.parked],
            blockers=[e for s in states for e in s.blockers],
            restarts=[e for s in states for e in s.restarts],
        )
        self._records = None
        if state.ready:
            exported = await self._each("/export", {k: {} for k in range(self.workers)})
            self._records = [
                EncodedRecord(RECORD.validate_json(line), line + b"\n", _sha256(line))
                for reply in exported
                for line in reply.content.split(b"\n")
                if line
            ]
        return state

    def export(self, scope: frozenset[str] | None) -> list[Record]:
        return [item.record for item in self.export_encoded(scope)]

    def export_encoded(self, scope: frozenset[str] | None) -> list[EncodedRecord]:
        if self._records is None:
            raise RuntimeError("no ready prepare captured the workers' records")
        if scope is None:
            return list(self._records)
        return [item for item in self._records if item.record.rollout_id in scope]

    def release_outside(self, scope: frozenset[str]) -> None:
        self._queued.append(("/release", {"rollout_ids": sorted(scope)}))

    def validate(self, records: Sequence[Record]) -> None:
        """Nothing here: each worker validates its share in `install`, before any installs."""

    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        await self._flush()
        shares: dict[int, list[Record]] = {k: [] for k in range(self.workers)}
        for record in records:
            shares[owner(record.rollout_id, self.workers)].append(record)
        bodies = {k: _lines(share) for k, share in shares.items()}
        try:
            await self._each("/validate", bodies, ndjson=True)
        except ProtocolError as error:
            if error.code is ErrorCode.RECORDS_INVALID:
                raise ValueError(error.detail) from None
            raise
        path = f"/install?attempt={attempt}"
        if self.pod_state is not None:
            pod = self.pod_state()
            path += f"&index={pod.index}&standby={str(pod.standby).lower()}"
        replies = await self._each(path, bodies, ndjson=True)
        await self.refresh_counts()
        return _restored(replies)

    async def reopen(self) -> None:
        await self._flush()
        self._records = None
        body = None if self.pod_state is None else self.pod_state().model_dump()
        self._take_counts(await self._each("/reopen", {k: body for k in range(self.workers)}))

    async def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        await self._flush()
        scope = None if rollout_ids is None else sorted(rollout_ids)
        body = {"attempt": attempt, "rollout_ids": scope}
        replies = await self._each("/retire", {k: body for k in range(self.workers)})
        return _restored(replies)

    def forget(self, rollout_ids: frozenset[str]) -> int:
        self._queued.append(("/forget", {"rollout_ids": sorted(rollout_ids)}))
        return 0

    def counts(self) -> EpisodeCounts:
        return self._counts

    def rewire(self, peers: Mapping[Role, str]) -> None:
        wire = {role.value: url for role, url in peers.items()}
        self._queued.append(("/rewire", {"peers": wire}))


def _uds_client(path: str, limits: httpx.Limits, headers: Mapping[str, str]) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=path, limits=limits),
        base_url="http://worker",
        headers=headers,
        timeout=None,
    )


def _sha256(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def _restored(replies: Sequence[httpx.Response]) -> list[EpisodeId]:
    return [e for reply in replies for e in _Restored.model_validate_json(reply.content).restored]
