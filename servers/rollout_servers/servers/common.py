"""What every reference server shares: app assembly, counters, debug hooks, peers, serving.

Each server is a FastAPI app that is also a checkpoint participant: it owns an `EpisodeRuntime`,
mounts the control plane, and exposes `GET /healthz` (readiness) and `GET /stats` (server-side
step counters, so tests can prove which steps ran in which attempt without timing anything).

Debug hooks exist so protocol tests can stop an episode at an exact point (inside a step, or at
a boundary) and then checkpoint it, deterministically. They are mounted only with
`--debug-hooks`; without the flag every hook point is a no-op.
"""

from __future__ import annotations

import json
import logging
import ssl
import sys
import zlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import httpx
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from rollout_protocol import (
    STEPS_COUNTER,
    ControlPlane,
    ControlSettings,
    Episode,
    EpisodeError,
    EpisodeRuntime,
    ErrorBody,
    ErrorCode,
    ProtocolError,
    Role,
    RunRoute,
    RuntimeParticipant,
    StepCounters,
)
from rollout_protocol.serving import DrainingServer

log = logging.getLogger(__name__)

T = TypeVar("T")


class WireModel(BaseModel):
    """Request and reply bodies of the servers' own routes: strict, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


# --- options ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerOptions:
    """Everything a server is configured with (the CLI fills it)."""

    role: Role
    index: int | None = None
    agent_url: str | None = None
    model_url: str | None = None
    resources_url: str | None = None
    allow_unauthenticated: bool = False
    debug_hooks: bool = False
    episode_timeout_s: float | None = None
    call_timeout_s: float = 600.0
    """Upper bound of one call to a peer (a whole agent invocation is one call)."""
    cleanup_timeout_s: float = 10.0
    """Upper bound of each final-cleanup call, so a dead peer cannot hold an episode forever."""
    backend: str = "builtin"
    upstream_url: str | None = None
    model_name: str = "builtin"
    token_latency_ms: float = 0.0
    mistake_rate: float = 0.25
    load_seconds: float = 0.0
    """Stay unready this long after start (a simulated weight load)."""
    wait_tools: tuple[str, ...] = ()
    """Resources: tools declared not idempotent (their calls are wait steps); the others
    replay (`GET /tools`)."""
    extra: Mapping[str, Any] = field(default_factory=dict)


# --- errors -----------------------------------------------------------------------------------


def episode_error(error: EpisodeError) -> ProtocolError:
    """The wire error for a runtime refusal (docs/sdk.md, "Runtime errors on the wire")."""
    return RunRoute.wire_error(error)


class PeerError(ProtocolError):
    """A call to a peer server failed; carries the peer's error code (or `unreachable`)."""

    http_status: int | None = None
    """The peer's HTTP status, when it answered."""


# --- counters ---------------------------------------------------------------------------------


# --- debug hooks ------------------------------------------------------------------------------


@dataclass
class _Pause:
    point: str
    rollout_id: str | None
    index: int | None
    release: anyio.Event = field(default_factory=anyio.Event)
    waiting: int = 0

    def matches(self, point: str, rollout_id: str | None, index: int | None) -> bool:
        return (
            self.point == point
            and (self.rollout_id is None or self.rollout_id == rollout_id)
            and (self.index is None or self.index == index)
        )


class HookRequest(WireModel):
    point: str = Field(min_length=1, max_length=64)
    rollout_id: str | None = None
    index: int | None = None


class HookWaitRequest(HookRequest):
    count: int = Field(default=1, ge=1)
    paused: bool = False
    """Wait until an armed pause holds a caller, rather than until the point was reached."""
    timeout_s: float = Field(default=10.0, gt=0, le=120)


def _selected(pause: _Pause, request: HookRequest) -> bool:
    """Does a request (None fields: any) name this armed pause?"""
    return (
        pause.point == request.point
        and (request.rollout_id is None or pause.rollout_id == request.rollout_id)
        and (request.index is None or pause.index == request.index)
    )


class Hooks:
    """Named points in server code where a test can pause an episode or observe progress.

    `await hooks.point("verify", rollout_id)` records that the point was reached and, when a
    pause is armed for it, waits until the test releases it. Disabled hooks cost one branch.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pauses: list[_Pause] = []
        self._armed: dict[tuple[str, str | None], list[_Pause]] = {}
        """Armed pauses by (point, rollout or None): a hook point looks up, never scans."""
        self._reached: dict[tuple[str, str | None, int | None], int] = defaultdict(int)
        self._held_at: dict[str, int] = defaultdict(int)
        """Callers held per point: a wait for "n held at this point" reads it, never scans (a
        bench arms thousands of pauses and wakes on every point reached)."""
        self._changed = anyio.Event()

    async def point(
        self, name: str, rollout_id: str | None = None, index: int | None = None
    ) -> None:
        if not self.enabled:
            return
        self.notify(name, rollout_id, index)
        candidates = self._armed.get((name, rollout_id), []) + self._armed.get((name, None), [])
        pause = next((p for p in candidates if p.matches(name, rollout_id, index)), None)
        if pause is None:
            return
        pause.waiting += 1
        self._held_at[name] += 1
        self._signal()
        try:
            await pause.release.wait()
        finally:
            pause.waiting -= 1
            self._held_at[name] -= 1
            self._signal()

    def notify(self, name: str, rollout_id: str | None = None, index: int | None = None) -> None:
        if not self.enabled:
            return
        for key in {(name, rollout_id, index), (name, rollout_id, None), (name, None, None)}:
            self._reached[key] += 1
        self._signal()

    def arm(self, request: HookRequest) -> None:
        pause = _Pause(request.point, request.rollout_id, request.index)
        self._pauses.append(pause)
        self._armed.setdefault((pause.point, pause.rollout_id), []).append(pause)

    def release(self, request: HookRequest) -> int:
        released = [p for p in self._pauses if _selected(p, request)]
        for pause in released:
            pause.release.set()
        self._pauses = [p for p in self._pauses if not p.release.is_set()]
        for pause in released:
            self._armed[(pause.point, pause.rollout_id)].remove(pause)
        self._signal()
        return len(released)

    def release_all(self) -> None:
        """Let every held caller go (the server is stopping; nothing may wait on a test)."""
        for pause in self._pauses:
            pause.release.set()
        self._pauses.clear()
        self._armed.clear()
        self._signal()

    async def wait(self, request: HookWaitRequest) -> dict[str, Any]:
        key = (request.point, request.rollout_id, request.index)
        with anyio.move_on_after(request.timeout_s):
            while True:
                changed = self._changed
                if request.paused:
                    held = (
                        self._held_at[request.point]
                        if request.rollout_id is None and request.index is None
                        else sum(p.waiting for p in self._pauses if _selected(p, request))
                    )
                    if held >= request.count:
                        return {"reached": self._reached.get(key, 0), "paused": held}
                elif self._reached.get(key, 0) >= request.count:
                    return {"reached": self._reached[key], "paused": 0}
                await changed.wait()
        raise ProtocolError(
            ErrorCode.DEADLINE_PASSED,
            f"hook {request.point!r} (rollout {request.rollout_id}, index {request.index}) "
            f"not {'paused' if request.paused else 'reached'} within {request.timeout_s}s",
        )

    def state(self) -> dict[str, Any]:
        return {
            "armed": [
                {
                    "point": p.point,
                    "rollout_id": p.rollout_id,
                    "index": p.index,
                    "waiting": p.waiting,
                }
                for p in self._pauses
            ],
            "reached": [
                {"point": k[0], "rollout_id": k[1], "index": k[2], "count": v}
                for k, v in self._reached.items()
            ],
        }

    def _signal(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


# --- outcomes ---------------------------------------------------------------------------------


class Outcome(Generic[T]):
    """The result of work running in another task, awaited by any number of callers."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def set(self, value: T) -> None:
        self._value = value
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    async def wait(self) -> T:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


# --- HTTP to peers ---------------------------------------------------------------------------


class ShardedClients:
    """Several HTTP clients, each with its own connection pool, picked by a key.

    httpcore scans its whole pool for every request it schedules, so a single pool with a
    thousand long calls in flight (one agent invocation per live episode) makes every new call
    cost O(n), and a thousand episodes O(n^2). Spreading the calls over shards keeps every pool
    small; calls with the same key share a shard (and its keep-alive connections).
    """

    def __init__(self, shards: int, timeout_s: float) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        # One TLS context for all shards: httpx builds one per client otherwise (loading the CA
        # bundle, tens of ms each), though peers are usually plain HTTP.
        tls = ssl.create_default_context()
        self._clients = [
            httpx.AsyncClient(
                limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0), verify=tls
            )
            for _ in range(shards)
        ]

    def for_key(self, key: str) -> httpx.AsyncClient:
        return self._clients[zlib.crc32(key.encode()) % len(self._clients)]

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()


PEER_SHARDS = 64
"""16 kept each pool at ~600 calls in flight with 10,000 live episodes, where httpcore's pool
scans took a quarter of the environment server's CPU (bench/protocol_pause.py --episodes 10000)."""
STATS_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {
        "model": ErrorBody,
        "description": "error codes: unauthorized (detail=true lists every rollout id; it takes "
        "the control token, Authorization: Bearer <token>)",
    }
}
_PEER_RETRIES = 3
_PEER_RETRY_DELAY_S = 0.05
SERVER_KEEP_ALIVE_S = 30
"""Servers keep idle connections this long; clients (httpx: 5 s) let them go well before, so a
client never sends on a connection the server is closing."""


# --- the server base --------------------------------------------------------------------------


class RolloutServer:
    """Base of the four reference servers. Subclasses add routes and episode logic."""

    role: Role
    waits_on: tuple[Role, ...]
    """The roles this server calls from wait-mode steps (a tool call it waits for, the final
    cleanup), declared in its status so a prepare parks it before them and roles nobody waits
    on together (docs/design.md#44-order)."""
    record_kind = "boundary"
    work_counter: str | None = STEPS_COUNTER
    """How the participant reports its episodes' steps in restore and retire replies (work
    kept and lost); None: not at all."""

    def __init__(self, options: ServerOptions, *, environ: Mapping[str, str] | None = None) -> None:
        self.options = options
        self.peers: dict[Role, str] = {
            role: url
            for role, url in (
                (Role.AGENT, options.agent_url),
                (Role.MODEL, options.model_url),
                (Role.RESOURCES, options.resources_url),
            )
            if url is not None
        }
        """The base URL of each peer role this server calls; a restore may re-wire them."""
        self.stats = StepCounters(self.role)
        self.hooks = Hooks(options.debug_hooks)
        self.runtime = EpisodeRuntime(
            self.record_kind,
            episode_timeout_s=options.episode_timeout_s,
            observer=self._observe,
        )
        self.participant = self.make_participant()
        self.settings = ControlSettings.from_env(
            self.role,
            index=options.index,
            allow_unauthenticated=options.allow_unauthenticated,
            environ=environ,
            waits_on=self.waits_on,
        )
        self.plane = ControlPlane(self.participant, self.settings)
        self.draining = False
        self.loaded = anyio.Event()
        """Set once the (simulated) start cost is paid: `/healthz` answers 503 until then."""
        self._tasks: anyio.abc.TaskGroup | None = None
        self._peers: ShardedClients | None = None

    def _observe(self, episode: Episode, name: str, event: str) -> None:
        self.stats.observe(episode, name, event)
        if event == "held":
            self.hooks.notify("held", episode.rollout_id)
        elif event == "started" and name == "run":
            # `RunRoute` registered the episode (its run is the step "run"): a test can tell
            # that a /run arrived, also while admission is closed and no step can start
            self.hooks.notify("begun", episode.rollout_id)

    # --- to override --------------------------------------------------------------------------

    def make_participant(self) -> RuntimeParticipant:
        return RuntimeParticipant(
            self.role,
            self.runtime,
            on_event=self.hooks.notify,
            on_rewire=self.rewire,
            work_counter=self.work_counter,
            is_finished=self.is_finished,
        )

    def is_finished(self, rollout_id: str, attempt: int) -> bool:
        """Whether an episode that ended here had finished (its result went back); by
        default every ended episode did (a session ends when its caller closes it)."""
        return True

    def add_routes(self, app: FastAPI) -> None:
        """Add the role's own routes."""

    def extra_stats(self, rollout_ids: list[str] | None, detail: bool) -> dict[str, Any]:
        """The role's own `/stats` fields; anything per rollout only with `detail` (which takes
        the control token) or for the rollouts named in `rollout_ids`."""
        return {}

    async def on_shutdown(self) -> None:
        """Release what the role holds beyond the shared HTTP client (runs at app shutdown)."""

    # --- shared -------------------------------------------------------------------------------

    @property
    def attempt(self) -> int:
        return self.plane.attempt

    def peer_url(self, role: Role) -> str | None:
        """Where this server reaches `role` (None: it was given no such peer)."""
        return self.peers.get(role)

    def rewire(self, peers: Mapping[Role, str]) -> None:
        """Call new peers from now on (an InPlace recovery replaced a pod this one calls).

        Runs inside a restore, after the retire of the old attempt: no call to the old peer
        is in flight any more, and the next one goes to the new URL.
        """
        self.peers.update(peers)

    def http(self, key: str) -> httpx.AsyncClient:
        """The HTTP client for calls about `key` (a rollout, a request key)."""
        if self._peers is None:
            raise RuntimeError("the server is not running (no HTTP clients yet)")
        return self._peers.for_key(key)

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn` in the server's task group (outlives the request that started it)."""
        if self._tasks is None:
            raise RuntimeError("the server is not running (no task group yet)")
        self._tasks.start_soon(fn, *args)

    def check_attempt(self, rollout_id: str, attempt: int) -> None:
        """Refuse work of a retired attempt, or of another attempt than this process runs."""
        if self.plane.is_retired(attempt, rollout_id) or self.runtime.is_retired(
            attempt, rollout_id
        ):
            raise ProtocolError(
                ErrorCode.ATTEMPT_RETIRED, f"attempt {attempt} of {rollout_id} was retired here"
            )
        if attempt != self.attempt:
            raise ProtocolError(
                ErrorCode.ATTEMPT_MISMATCH,
                f"this {self.role.value} server runs attempt {self.attempt}, not {attempt}",
            )

    async def call_peer(
        self,
        url: str | None,
        path: str,
        body: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        method: str = "POST",
    ) -> dict[str, Any]:
        """POST JSON to a peer (`method="GET"`: read a route, `body` unused); its error body
        (or its absence) becomes a `PeerError`.

        `key` picks the connection pool (default: the body's rollout id). Every peer call is
        idempotent by key (a session's seed, a tool call's index, a model request's key, ...),
        so a transport error (a kept-alive connection the peer closed at the same moment, a
        reset under load) is retried a few times before it counts as the peer being gone.
        """
        if url is None:
            raise ProtocolError(ErrorCode.INTERNAL, f"no peer URL configured for {path}")
        timeout = self.options.call_timeout_s if timeout_s is None else timeout_s
        shard = key if key is not None else str(body.get("rollout_id", path))
        for retry in range(_PEER_RETRIES + 1):
            try:
                reply = await self.http(shard).request(
                    method,
                    url.rstrip("/") + path,
                    json=dict(body) if method != "GET" else None,
                    timeout=timeout,
                    headers=headers,
                )
                break
            except httpx.TransportError as error:
                if retry == _PEER_RETRIES or isinstance(error, httpx.TimeoutException):
                    raise PeerError(
                        ErrorCode.UNREACHABLE, f"{url}{path}: {type(error).__name__}: {error}"
                    ) from error
                await anyio.sleep(_PEER_RETRY_DELAY_S * (retry + 1))
        if reply.status_code >= 400:
            raise peer_error(url + path, reply)
        data = reply.json()
        if not isinstance(data, dict):
            raise PeerError(ErrorCode.INTERNAL, f"{url}{path}: expected a JSON object")
        return data

    def build_app(self) -> FastAPI:
        app = FastAPI(
            title=f"rollout {self.role.value} server", lifespan=self._lifespan, docs_url=None
        )
        server = self

        @app.get("/healthz")
        async def healthz() -> Response:
            ready = server._tasks is not None and not server.draining and server.loaded.is_set()
            if server.draining:
                state = "draining"
            elif server._tasks is not None and not server.loaded.is_set():
                state = "loading"
            else:
                state = "ok" if ready else "starting"
            body = {
                "status": state,
                "role": server.role.value,
                "instance": server.plane.settings.instance,  # a standby's changes when adopted
                "attempt": server.attempt,
                "phase": server.plane.phase.value,
            }
            return JSONResponse(body, status_code=200 if ready else 503)

        @app.get("/stats", responses=STATS_ERRORS)
        async def stats(
            rollout_id: list[str] | None = Query(default=None),  # noqa: B008
            detail: bool = False,
            *,
            request: Request,
        ) -> dict[str, Any]:
            if detail:
                # Every rollout id this server saw: the operator's and the trainer's to know.
                server.plane.authorize(request.headers.get("authorization"))
            counts = server.runtime.counts()
            return {
                "role": server.role.value,
                "instance": server.plane.settings.instance,
                "attempt": server.attempt,
                "live": counts.live,
                "parked": counts.parked,
                "restored": counts.restored,
                **server.stats.snapshot(rollout_id, detail),
                **server.extra_stats(rollout_id, detail),
            }

        if self.options.debug_hooks:
            self._add_debug_routes(app)
        self.add_routes(app)
        self.plane.install(app)
        return app

    async def _load(self) -> None:
        """Pay the configured start cost, then turn ready (a real engine loads weights here)."""
        if self.options.load_seconds > 0:
            log.info("%s: loading for %.1fs", self.role.value, self.options.load_seconds)
            await anyio.sleep(self.options.load_seconds)
        self.loaded.set()

    def _add_debug_routes(self, app: FastAPI) -> None:
        hooks = self.hooks

        @app.post("/debug/arm")
        async def arm(request: HookRequest) -> dict[str, Any]:
            hooks.arm(request)
            return {"armed": True}

        @app.post("/debug/release")
        async def release(request: HookRequest) -> dict[str, Any]:
            return {"released": hooks.release(request)}

        @app.post("/debug/wait")
        async def wait(request: HookWaitRequest) -> dict[str, Any]:
            return await hooks.wait(request)

        @app.get("/debug/state")
        async def state() -> dict[str, Any]:
            return hooks.state()

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self._peers = ShardedClients(PEER_SHARDS, self.options.call_timeout_s)
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                tasks.start_soon(self._load)
                try:
                    yield
                finally:
                    tasks.cancel_scope.cancel()
                    self._tasks = None
        finally:
            with anyio.CancelScope(shield=True):
                await self._peers.aclose()
                await self.on_shutdown()


def peer_error(where: str, reply: httpx.Response) -> PeerError:
    try:
        body = ErrorBody.model_validate_json(reply.content)
        error = PeerError(body.error.code, f"{where}: {body.error.detail}")
    except ValueError:
        error = PeerError(ErrorCode.INTERNAL, f"{where}: HTTP {reply.status_code}")
    error.http_status = reply.status_code
    return error


# --- serving ----------------------------------------------------------------------------------


def serve(
    server: RolloutServer,
    host: str,
    port: int,
    *,
    drain_seconds: float | None = None,
    graceful_seconds: int = 5,
    log_level: str = "info",
) -> None:
    """Run `server` until stopped; print one JSON `ready` line on stdout once it listens."""
    app = server.build_app()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=graceful_seconds,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        lifespan="on",
    )

    def ready(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def drain() -> None:
        server.draining = True
        log.warning("SIGTERM: draining; the control plane stays up until the process is stopped")
        ready(json.dumps({"event": "draining"}))

    def stopping() -> None:
        server.draining = True
        server.hooks.release_all()

    DrainingServer(
        config, on_drain=drain, drain_seconds=drain_seconds, ready_line=ready, on_stop=stopping
    ).run()
