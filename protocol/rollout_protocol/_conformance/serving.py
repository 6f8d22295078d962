"""In-process participants for the checks: `serve_app` and `start_app` run an ASGI app (its
lifespan too, so the lease watchdog runs) on a loopback port and give a `ServedApp` whose
`target` the checks take.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import httpx
import uvicorn
from anyio.abc import TaskGroup, TaskStatus
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._wire import (
    Role,
)
from .calls import Target


class _Loopback:
    """HTTP for an in-process app: uvicorn's protocol on a loopback port, in this event loop.

    Every client reaches the app as it would a process (the kit's httpx client and the aiohttp
    session of its participant client alike). `close` drops it as a killed process would: the
    port refuses connections, open connections are dropped, and requests in flight are cancelled
    without an answer. The app's lifespan is not run here (`ServedApp` runs it).
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted connections only then (with
        # the default protocol 0 every reply on a kept-alive connection waits ~40 ms for an ACK)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(128)
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        # idle connections are kept longer than any client keeps them (httpx 5 s), so a client
        # never sends on a connection this side is closing; `close` ends them all anyway
        config = uvicorn.Config(
            self._serve,
            interface="asgi3",
            lifespan="off",
            log_config=None,
            proxy_headers=False,
            timeout_keep_alive=60,
        )
        self._server = uvicorn.Server(config)
        self._requests: set[anyio.CancelScope] = set()
        self._closed = False

    async def start(self) -> None:
        config = self._server.config
        config.load()
        self._server.lifespan = config.lifespan_class(config)  # "off": nothing runs
        await self._server.startup(sockets=[self._socket])

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        # a request cancelled by `close` ends here, quietly: its connection is gone already
        with anyio.CancelScope() as request:
            if self._closed:
                return
            self._requests.add(request)
            try:
                await self._app(scope, receive, send)
            finally:
                self._requests.discard(request)

    def close(self) -> None:
        """Stop at once (idempotent): refuse connections, drop open ones, cancel requests."""
        self._closed = True
        for server in getattr(self._server, "servers", []):
            server.close()
        self._socket.close()
        for connection in list(self._server.server_state.connections):
            connection.transport.abort()  # before the cancellations: no answer goes out
        for request in list(self._requests):
            request.cancel()


class ServedApp:
    """An ASGI app served in process with its lifespan running; `target` reaches it.

    The app answers HTTP on a loopback port (127.0.0.1, a port the system picks) in this event
    loop; `client` is an httpx client with that base URL (the target's `client`).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        role: Role,
        token: str,
        index: int = 0,
        stats_path: str = "/stats",
    ) -> None:
        self.app = app
        self._http = _Loopback(app)
        self.client = httpx.AsyncClient(base_url=self._http.url)
        self.target = Target(self._http.url, role, token, index, self.client, stats_path)
        self._scope = anyio.CancelScope()
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self._graceful = True

    async def _run(self, *, task_status: TaskStatus[None], timeout_s: float) -> None:
        to_app, app_inbox = anyio.create_memory_object_stream[Message](4)
        app_outbox, from_app = anyio.create_memory_object_stream[Message](4)
        try:
            with self._scope:
                async with anyio.create_task_group() as group:
                    scope: dict[str, Any] = {
                        "type": "lifespan",
                        "asgi": {"version": "3.0", "spec_version": "2.0"},
                        "state": {},
                    }

                    async def lifespan() -> None:
                        await self.app(scope, app_inbox.receive, app_outbox.send)

                    group.start_soon(lifespan)
                    await to_app.send({"type": "lifespan.startup"})
                    with anyio.fail_after(timeout_s):
                        message = await from_app.receive()
                    if message["type"] != "lifespan.startup.complete":
                        raise RuntimeError(f"the app did not start: {message}")
                    await self._http.start()
                    task_status.started()
                    await self._stop.wait()
                    self._http.close()
                    if self._graceful:
                        with anyio.move_on_after(timeout_s):
                            await to_app.send({"type": "lifespan.shutdown"})
                            await from_app.receive()
                    group.cancel_scope.cancel()
        finally:
            self._http.close()
            self._stopped.set()
            for stream in (to_app, app_inbox, app_outbox, from_app):
                stream.close()

    async def crash(self) -> None:
        """Stop the app as a SIGKILL would: no shutdown, its tasks and requests cancelled,
        connections dropped, calls refused."""
        self._http.close()
        self._graceful = False
        self._scope.cancel()
        await self._stopped.wait()
        await self.client.aclose()

    async def stop(self) -> None:
        """Stop serving HTTP (requests still in flight are cancelled), run the app's lifespan
        shutdown, then close the client."""
        self._stop.set()
        await self._stopped.wait()
        await self.client.aclose()


async def start_app(
    group: TaskGroup,
    app: ASGIApp,
    *,
    role: Role,
    token: str,
    index: int = 0,
    stats_path: str = "/stats",
    startup_timeout_s: float = 10.0,
) -> ServedApp:
    """Serve `app` in a task of `group` (lifespan started before this returns).

    Stop it with `ServedApp.stop()` or `ServedApp.crash()`; for drivers that crash and restart
    apps while the kit runs.
    """
    served = ServedApp(app, role=role, token=token, index=index, stats_path=stats_path)
    await group.start(_start_served, served, startup_timeout_s)
    return served


async def _start_served(
    served: ServedApp, timeout_s: float, *, task_status: TaskStatus[None]
) -> None:
    await served._run(task_status=task_status, timeout_s=timeout_s)


@asynccontextmanager
async def serve_app(
    app: ASGIApp,
    *,
    role: Role,
    token: str,
    index: int = 0,
    stats_path: str = "/stats",
    startup_timeout_s: float = 10.0,
) -> AsyncIterator[ServedApp]:
    """Serve `app` in process for the block (lifespan startup before, shutdown after).

    An error raised in the block comes out as itself (a `ConformanceError` stays one), not
    wrapped in the task group's exception group.
    """
    error: Exception | None = None
    async with anyio.create_task_group() as group:
        served = await start_app(
            group,
            app,
            role=role,
            token=token,
            index=index,
            stats_path=stats_path,
            startup_timeout_s=startup_timeout_s,
        )
        try:
            yield served
        except Exception as raised:
            error = raised
        finally:
            with anyio.CancelScope(shield=True):
                await served.stop()
    if error is not None:
        raise error
