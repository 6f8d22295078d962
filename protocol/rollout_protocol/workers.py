"""Serving one participant with several worker processes: `serve_workers`.

A pod's main process owns the public port and the one control plane; it starts `workers`
processes that each build the server's app (`app_factory`, called in the worker) and serve it
on a Unix socket of their own. The main process routes every request that names a rollout
(`rollout_id` in its JSON body or query) to the worker that holds that rollout
(`owner(rollout_id)`), merges `GET /stats` over all workers and answers `/healthz` ready only
when every worker is. Checkpoint operations fan out to every worker (`_workers.WorkerPool`);
records are one file and one manifest per pod, exactly as a single-process participant writes
them (docs/protocol.md, "Workers").

A worker that dies takes episodes with it that no checkpoint may silently miss: the main
process then stops the other workers and exits with `WORKER_LOST_EXIT`, so the pod ends
(restartPolicy Never) and the operator recovers the set from its last Ready checkpoint under
attempt + 1. A checkpoint open at that moment fails (the pod is lost).

This module needs uvicorn (`pip install 'rollout-protocol[serve]'`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ._control import ControlPlane
from ._routes import GYM_CAPABILITIES_PATH
from ._settings import WORKER_ENV, WORKER_KEY_ENV, ControlSettings, declared_workers
from ._wire import API_PREFIX, ROLLOUT_ID_PATTERN, ErrorCode, ProtocolError, Role
from ._workers import PodState, WorkerPool, owner
from .serving import DrainingServer

__all__ = ["WORKER_LOST_EXIT", "WorkerApp", "declared_workers", "owner", "serve_workers"]

log = logging.getLogger(__name__)

WORKER_LOST_EXIT = 70
"""The main process's exit code when one of its workers died."""
_STOP_WAIT_S = 10.0
_WORKER_KEEP_ALIVE_S = 30
"""A worker keeps idle connections longer than the main process's client does (httpx: 5 s),
so the client never sends on a connection the worker is closing."""
_FORWARD_TRIES = 3
"""A routed request that failed in transport is sent again: requests about an episode are
idempotent (a repeated `/run` attaches to the episode or answers its result, docs/sdk.md)."""
_HOP_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
)


@dataclass(frozen=True)
class WorkerApp:
    """What `app_factory` may return: the worker's app and what its first SIGTERM calls (turn
    unready, answer `/run` with 503 `admission_closed`: docs/sdk.md, section 8)."""

    app: ASGIApp
    on_drain: Callable[[], None] | None = None
    on_stop: Callable[[], None] | None = None


AppFactory = Callable[[], "ASGIApp | WorkerApp"]


def serve_workers(
    app_factory: AppFactory,
    *,
    role: Role,
    workers: int,
    host: str,
    port: int,
    settings: ControlSettings | None = None,
    drain_seconds: float | None = None,
    ready_line: Callable[[str], None] | None = None,
    log_level: str = "info",
    start_timeout_s: float = 120.0,
) -> None:
    """Serve `workers` processes of `app_factory`'s app behind one port and one control plane.

    `app_factory` runs in each worker (it must be picklable: a module-level function, or a
    `functools.partial` of one) and builds the app exactly as a single-process server does,
    `ControlSettings.from_env(role)` and `plane.install(app)` included: in a worker the plane
    serves the pod's private worker channel instead of the control routes. `settings` are the
    main process's (default: `ControlSettings.from_env(role)`). Blocks until stopped."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    base = settings if settings is not None else ControlSettings.from_env(role)
    settings = replace(base, workers=workers, worker=None, worker_key=None, unmanaged_workers=1)
    key = secrets.token_hex(32)  # the private channel's: handed to this run's workers alone
    directory = _SocketDirectory.create()
    sockets = [os.path.join(directory.path, f"worker-{k}.sock") for k in range(workers)]
    processes: list[multiprocessing.process.BaseProcess] = []
    stopping = threading.Event()
    try:
        started = _spawn_workers(app_factory, role, sockets, key, log_level, processes)
        _await_started(processes, started, start_timeout_s)
        threading.Thread(
            target=_watch,
            args=(processes, stopping, directory),
            name="rollout-workers-watch",
            daemon=True,
        ).start()
        pool = WorkerPool(role, sockets, key)
        plane = ControlPlane(pool, settings)
        pool.pod_state = lambda: PodState(
            attempt=plane.attempt, index=plane.settings.index, standby=plane.settings.standby
        )
        app = _pod_app(pool, plane)
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on"
        )

        def drain() -> None:
            app.state.draining = True
            for process in processes:
                _signal(process, signal.SIGTERM)
            if ready_line is not None:
                ready_line(json.dumps({"event": "draining"}))

        def stop() -> None:
            stopping.set()
            app.state.draining = True

        DrainingServer(
            config, on_drain=drain, drain_seconds=drain_seconds, ready_line=ready_line, on_stop=stop
        ).run()
    finally:
        stopping.set()
        _stop_all(processes)
        directory.remove()


def _spawn_workers(
    app_factory: AppFactory,
    role: Role,
    sockets: list[str],
    key: str,
    log_level: str,
    processes: list[multiprocessing.process.BaseProcess],
) -> list[multiprocessing.connection.Connection]:
    """Start one worker process per socket, each appended to `processes` as it starts (so that
    the caller stops those already started if a later one fails); the pipes on which each
    says it started."""
    context = multiprocessing.get_context("spawn")
    started: list[multiprocessing.connection.Connection] = []
    for k, path in enumerate(sockets):
        ours, theirs = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker_main,
            args=(app_factory, k, len(sockets), path, key, theirs, log_level),
            name=f"{role.value}-worker-{k}",
        )
        process.start()
        theirs.close()
        processes.append(process)
        started.append(ours)
    return started


def _await_started(
    processes: list[multiprocessing.process.BaseProcess],
    started: list[multiprocessing.connection.Connection],
    start_timeout_s: float,
) -> None:
    """Wait until every worker said it started, all within `start_timeout_s`; stop the pod
    (SystemExit `WORKER_LOST_EXIT`) at the first that did not."""
    deadline = time.monotonic() + start_timeout_s
    for k, (worker, ours) in enumerate(zip(processes, started, strict=True)):
        if not _started(worker, ours, max(0.0, deadline - time.monotonic())):
            log.critical(
                "worker %d did not start (exit code %s; its log is above): stopping the pod "
                "(exit %d)",
                k,
                worker.exitcode,
                WORKER_LOST_EXIT,
            )
            raise SystemExit(WORKER_LOST_EXIT)


class _SocketDirectory:
    """The folder of a pod run's worker sockets, in the temporary directory (mode 0700: the
    pod's user only), removed when the run ends.

    A run that cannot remove it (SIGKILL) leaves it behind, so each run first removes the
    folders of runs that ended: a run holds an exclusive `flock` on the folder's `lock` file
    for as long as it lives, and the kernel drops it with the process, however it ends and in
    whatever PID namespace it ran."""

    PREFIX = "rollout-workers-"
    LOCK = "lock"

    def __init__(self, path: str, lock: int) -> None:
        self.path, self._lock = path, lock

    @classmethod
    def create(cls) -> _SocketDirectory:
        parent = tempfile.gettempdir()
        cls._remove_ended(parent)
        path = tempfile.mkdtemp(prefix=cls.PREFIX, dir=parent)
        # locked under another name first: another pod's sweep never finds `lock` unlocked
        fresh = os.path.join(path, f"{cls.LOCK}.new")
        lock = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.rename(fresh, os.path.join(path, cls.LOCK))
        return cls(path, lock)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock)

    @classmethod
    def _remove_ended(cls, parent: str) -> None:
        """Remove this user's socket folders whose run holds no lock on them any more."""
        with contextlib.suppress(OSError), os.scandir(parent) as entries:
            for entry in entries:
                if entry.name.startswith(cls.PREFIX) and cls._ended(entry):
                    shutil.rmtree(entry.path, ignore_errors=True)

    @classmethod
    def _ended(cls, entry: os.DirEntry[str]) -> bool:
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                return False
            lock = os.open(
                os.path.join(entry.path, cls.LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError:
            return False  # not ours, or a run that has not locked it yet: left alone
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its run is alive
        finally:
            os.close(lock)
        return True


# --- the worker process ----------------------------------------------------------------------


def _worker_main(
    app_factory: AppFactory,
    index: int,
    workers: int,
    path: str,
    key: str,
    started: multiprocessing.connection.Connection,
    log_level: str,
) -> None:
    """A worker: dies with the main process, builds its app, serves it on its socket."""
    _die_with_parent()
    os.environ[WORKER_ENV] = f"{index}/{workers}"
    os.environ[WORKER_KEY_ENV] = key
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s worker-{index} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    built = app_factory()
    worker = built if isinstance(built, WorkerApp) else WorkerApp(built)
    config = uvicorn.Config(
        worker.app,
        uds=path,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_keep_alive=_WORKER_KEEP_ALIVE_S,
    )

    def ready(_: str) -> None:
        started.send(b"ready")
        started.close()

    DrainingServer(
        config,
        on_drain=worker.on_drain or (lambda: None),
        drain_seconds=None,
        ready_line=ready,
        on_stop=worker.on_stop,
    ).run()


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the main process dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(WORKER_LOST_EXIT)


# --- the main process ------------------------------------------------------------------------


def _started(
    process: multiprocessing.process.BaseProcess,
    started: multiprocessing.connection.Connection,
    timeout_s: float,
) -> bool:
    """Whether the worker said it serves within `timeout_s` (False: it died or hangs)."""
    ready = multiprocessing.connection.wait([started, process.sentinel], timeout=timeout_s)
    if started in ready:
        with contextlib.suppress(EOFError, OSError):
            return bool(started.recv() == b"ready")
    return False


def _watch(
    processes: list[multiprocessing.process.BaseProcess],
    stopping: threading.Event,
    directory: _SocketDirectory,
) -> None:
    """Exit the pod when a worker dies (unless the pod is stopping anyway)."""
    sentinels = [process.sentinel for process in processes]
    multiprocessing.connection.wait(sentinels)
    if stopping.is_set():
        return
    dead = [(k, p.exitcode) for k, p in enumerate(processes) if not p.is_alive()]
    log.critical(
        "worker process(es) %s exited (codes %s): their episodes are lost; stopping the pod "
        "(exit %d) so the set recovers from its last checkpoint",
        [k for k, _ in dead],
        [code for _, code in dead],
        WORKER_LOST_EXIT,
    )
    for process in processes:
        _signal(process, signal.SIGKILL)
    for process in processes:
        process.join(_STOP_WAIT_S)  # reaped before the pod ends: no worker outlives it
    directory.remove()
    sys.stderr.flush()
    os._exit(WORKER_LOST_EXIT)


def _signal(process: multiprocessing.process.BaseProcess, sig: int) -> None:
    if process.pid is not None and process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)


def _stop_all(processes: list[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        _signal(process, signal.SIGINT)
    for process in processes:
        process.join(_STOP_WAIT_S)
        if process.is_alive():
            _signal(process, signal.SIGKILL)
            process.join(_STOP_WAIT_S)


class _RefreshCounts:
    """Reads every worker's episode counts before the plane answers `GET /status`."""

    def __init__(self, app: ASGIApp, pool: WorkerPool) -> None:
        self.app, self.pool = app, pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == f"{API_PREFIX}/status":
            with contextlib.suppress(ProtocolError):
                await self.pool.refresh_counts()
        await self.app(scope, receive, send)


def _pod_app(pool: WorkerPool, plane: ControlPlane) -> FastAPI:
    """The main process's app: the control plane, `/healthz`, `/stats`, and the router."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await pool.aclose()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    plane.install(app)
    app.add_middleware(_RefreshCounts, pool=pool)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        replies = [await _forward(pool, k, "GET", "/healthz", b"", {}) for k in range(pool.workers)]
        for reply in replies:
            if reply.status_code >= 400 and reply.status_code != 404:
                return reply
        pod = {"phase": plane.phase.value, "attempt": plane.attempt, "workers": pool.workers}
        if replies[0].status_code == 404:
            return JSONResponse({"status": "ok", **pod})
        try:
            body = json.loads(bytes(replies[0].body))
        except ValueError:
            return replies[0]
        # the pod's phase and attempt: a worker's own plane never opens a checkpoint
        return JSONResponse({**body, **pod} if isinstance(body, dict) else body)

    @app.get("/stats", include_in_schema=False)
    async def stats(request: Request) -> Response:
        query = request.url.query
        path = "/stats" + (f"?{query}" if query else "")
        headers = _headers(request)
        merged: Any = None
        for k in range(pool.workers):
            reply = await _forward(pool, k, "GET", path, b"", headers)
            if reply.status_code >= 400:
                return reply
            body = json.loads(bytes(reply.body))
            merged = body if merged is None else merge_stats(merged, body)
        return JSONResponse(merged)

    async def route(request: Request) -> Response:
        body = await request.body()
        rollout_id = _rollout_id(body, request)
        if rollout_id is None and request.url.path == GYM_CAPABILITIES_PATH:
            # the client's dialect probe: the pod's plane mounts no Gym routes (a 404 says ours)
            raise ProtocolError(ErrorCode.NOT_FOUND, f"{request.url.path}: no Gym dialect here")
        if rollout_id is None:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"{request.url.path}: a request to a pod of {pool.workers} workers must name its "
                "rollout (`rollout_id` in the JSON body or the query) so it reaches the worker "
                "that holds it",
            )
        worker = owner(rollout_id, pool.workers)
        query = request.url.query
        path = request.url.path + (f"?{query}" if query else "")
        return await _forward(pool, worker, request.method, path, body, _headers(request))

    app.add_api_route(
        "/{path:path}",
        route,
        methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
        include_in_schema=False,
    )
    return app


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS | {"host"}}


def _rollout_id(body: bytes, request: Request) -> str | None:
    """The rollout a request names: `rollout_id` in its JSON object body, else the one
    `rollout_id` of its query; None when it names none. A named id must be one the wire can
    carry (`ROLLOUT_ID_PATTERN`), or the request is refused here (422) rather than hashed."""
    named: str | None = None
    if body.lstrip(_JSON_SPACE)[:1] == b"{":
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            data = None
        if isinstance(data, dict) and isinstance(data.get("rollout_id"), str):
            named = data["rollout_id"]
    if named is None:
        query = request.query_params.getlist("rollout_id")
        named = query[0] if len(query) == 1 else None
    if named is not None and re.fullmatch(ROLLOUT_ID_PATTERN, named) is None:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"rollout_id {named[:64]!r}: a rollout id matches {ROLLOUT_ID_PATTERN}",
        )
    return named


_JSON_SPACE = b" \t\r\n"
"""The whitespace JSON allows before a value (RFC 8259)."""


async def _forward(
    pool: WorkerPool, worker: int, method: str, path: str, body: bytes, headers: dict[str, str]
) -> Response:
    for attempt in range(_FORWARD_TRIES):
        try:
            reply = await pool.client(worker).request(method, path, content=body, headers=headers)
            break
        except httpx.TransportError as error:
            if attempt + 1 < _FORWARD_TRIES:
                log.warning("%s to worker %d: %r; sending it again", path, worker, error)
                continue
            raise ProtocolError(
                ErrorCode.ADMISSION_CLOSED,
                f"worker {worker} of this pod does not answer ({type(error).__name__}: {error}); "
                "a worker that died stops the pod",
            ) from None
    kept = {k: v for k, v in reply.headers.items() if k.lower() not in _HOP_HEADERS}
    return Response(reply.content, status_code=reply.status_code, headers=kept)


def merge_stats(a: Any, b: Any, key: str = "") -> Any:
    """Two workers' `/stats`: objects merged key by key, counts added (not `attempt`)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for name, value in b.items():
            out[name] = merge_stats(out[name], value, name) if name in out else value
        return out
    numbers = isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool)
    if numbers and key != "attempt":
        return a + b
    return a
