"""Fleet participants: many rollout participants served in the node agent's own process.

A test double for scale tests (bench/fleet.py, tests/e2e/test_fleet.py). A pod annotated
`devcluster.rollout.dev/fleet: participant` is not run as a process: the agent serves it in
process, as a *fleet participant*, on the pod's own loopback address and its `control` port.
A fleet participant is the project's real control plane (`rollout_protocol.ControlPlane`, its
`/checkpoint/v1` routes, auth, phases, lease watchdog and storage writer) over a trivial
participant (`RuntimeParticipant` with an empty `EpisodeRuntime`: no episodes, no reference
server, no model), plus a `/healthz` route. Everything above it (API server, scheduler, operator,
coordinator, HTTP on loopback) is what it is for a process pod.

Where the line is: no Python start-up, no imports and no memory of its own per pod (that is what
lets one machine host 1,600 pods); checkpoints carry no episodes, so commits write empty records
files (the manifest, digest and fsync are real); SIGTERM turns the participant unready and keeps
its control plane up, like the reference servers (`rollout-server`), until SIGKILL or a second
SIGTERM; SIGKILL aborts its connections at once and reads as exit code 137. The "process id" of a
fleet container is the agent's own pid: there is no process of its own to signal or to find.

All fleet participants share one HTTP stack: uvicorn's protocol over one asyncio server per
participant socket, with one dispatcher that picks the participant by the local address the
request arrived on. (A `uvicorn.Server` per participant would wake 10 times a second each for its
housekeeping tick; 1,600 of them would keep a core busy doing nothing.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Final

import anyio.to_thread

from devcluster.agent.podmodel import Container, Pod

log = logging.getLogger("devcluster.agent.fleet")

FLEET_ANNOTATION: Final = "devcluster.rollout.dev/fleet"
"""Pod annotation that asks the agent to serve the pod in process (value: a fleet kind)."""
PARTICIPANT: Final = "participant"
"""The one fleet kind: the real control plane over a participant with no episodes."""
CONTROL_PORT_NAME: Final = "control"
FLEET_THREADS: Final = 256
"""Worker threads for the fleet participants' storage I/O (see `FleetHost._stack`)."""

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


class FleetSpecError(ValueError):
    """The pod cannot be served in process (unknown kind, no port, no role); says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def fleet_kind(pod: Pod) -> str | None:
    """The pod's fleet kind, or None for an ordinary (process) pod."""
    return pod.metadata.annotations.get(FLEET_ANNOTATION)


def control_port(container: Container) -> int:
    """The container's port named `control`, else its only port."""
    for port in container.ports:
        if port.name == CONTROL_PORT_NAME:
            return port.container_port
    if len(container.ports) == 1:
        return container.ports[0].container_port
    raise FleetSpecError(
        "FleetNoPort",
        f"container {container.name!r}: a fleet participant needs a containerPort named "
        f"{CONTROL_PORT_NAME!r} to listen on",
    )


class FleetContainer:
    """One in-process container: what a `ContainerRun` holds in place of an OS process."""

    def __init__(self, host: FleetHost, address: tuple[str, int], server: asyncio.Server) -> None:
        self._host = host
        self.address = address
        self._server = server
        self._exited = asyncio.Event()
        self.returncode: int | None = None
        self.draining = False
        self.plane_task: asyncio.Task[None] | None = None
        """Runs the control plane's watchdog until the container exits."""

    @property
    def pid(self) -> int:
        """The hosting process (the agent): a fleet container has no process of its own."""
        return os.getpid()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """SIGTERM once: drain (unready, control plane up); SIGTERM again or SIGKILL: stop."""
        if self.returncode is not None:
            return
        if sig == signal.SIGTERM and not self.draining:
            self.draining = True
            log.info("fleet participant %s:%d: SIGTERM, draining", *self.address)
            return
        self._stop(-sig if sig == signal.SIGKILL else 0)

    def _stop(self, returncode: int) -> None:
        self.returncode = returncode
        self._server.close()
        self._host.drop(self, abort=returncode != 0)
        self._exited.set()


class FleetHost:
    """The agent's fleet: serves every fleet container of every pod on this agent."""

    def __init__(self) -> None:
        self._apps: dict[tuple[str, int], ASGIApp] = {}
        self._containers: dict[tuple[str, int], FleetContainer] = {}
        self._config: Any = None
        self._state: Any = None

    def _stack(self) -> tuple[Any, Any]:
        if self._config is None:
            # Every participant's storage I/O (records, fsyncs, directories) runs in this
            # process's worker threads; anyio's default of 40 made prepares of one set wait
            # behind the commits of others until their deadlines passed (a 30-set storm).
            limiter = anyio.to_thread.current_default_thread_limiter()
            limiter.total_tokens = max(limiter.total_tokens, FLEET_THREADS)
            from uvicorn.config import Config
            from uvicorn.server import ServerState

            config = Config(
                app=self._dispatch,
                http="httptools",
                interface="asgi3",
                proxy_headers=False,
                lifespan="off",
                log_config=None,
                access_log=False,
                timeout_keep_alive=30,
            )
            config.load()
            state = ServerState()
            state.default_headers = list(config.encoded_headers)
            self._config, self._state = config, state
        return self._config, self._state

    async def _dispatch(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        server = scope.get("server")
        app = self._apps.get((server[0], server[1])) if server else None
        if app is None:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"no fleet participant here"})
            return
        await app(scope, receive, send)

    async def start(
        self, pod: Pod, container: Container, env: Mapping[str, str], ip: str
    ) -> FleetContainer:
        """Bind the participant's socket and serve it; raises `FleetSpecError` or `OSError`."""
        kind = fleet_kind(pod)
        if kind != PARTICIPANT:
            raise FleetSpecError(
                "FleetUnknownKind",
                f"annotation {FLEET_ANNOTATION}={kind!r}: the only fleet kind is {PARTICIPANT!r}",
            )
        address = (ip, control_port(container))
        config, state = self._stack()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise

        def protocol() -> asyncio.Protocol:
            made: asyncio.Protocol = config.http_protocol_class(
                config=config, server_state=state, app_state={}
            )
            return made

        loop = asyncio.get_running_loop()
        server = await loop.create_server(protocol, sock=sock, backlog=128)
        running = FleetContainer(self, address, server)
        try:
            app = await _participant_app(running, env)
        except BaseException:
            server.close()
            raise
        self._apps[address] = app
        self._containers[address] = running
        return running

    def drop(self, running: FleetContainer, *, abort: bool) -> None:
        """Forget a stopped container; SIGKILL (abort) also cuts its open connections."""
        if self._containers.get(running.address) is running:
            del self._containers[running.address]
            self._apps.pop(running.address, None)
        if self._state is not None:
            for connection in list(self._state.connections):
                if getattr(connection, "server", None) == running.address:
                    transport = getattr(connection, "transport", None)
                    if transport is not None:
                        (transport.abort if abort else transport.close)()

    def __len__(self) -> int:
        return len(self._containers)


async def _participant_app(running: FleetContainer, env: Mapping[str, str]) -> ASGIApp:
    """The real control plane over an episode-less participant, its watchdog running."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from rollout_protocol import (
        ControlConfigError,
        ControlPlane,
        ControlSettings,
        EpisodeRuntime,
        Role,
        RuntimeParticipant,
    )

    try:
        role = Role(env.get("ROLLOUT_ROLE", ""))
    except ValueError:
        raise FleetSpecError(
            "FleetNoRole",
            f"ROLLOUT_ROLE={env.get('ROLLOUT_ROLE')!r}: a fleet participant needs the role the "
            "operator puts into its pods",
        ) from None
    try:
        settings = ControlSettings.from_env(role, environ=env)
    except ControlConfigError as error:
        raise FleetSpecError("FleetBadSettings", str(error)) from None
    plane = ControlPlane(RuntimeParticipant(role, EpisodeRuntime()), settings)
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        if running.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", "fleet": PARTICIPANT, "role": role.value})

    plane.install(app)
    watching = asyncio.Event()

    async def run_plane() -> None:
        async with plane.running():
            watching.set()
            await running.wait()
        await plane.aclose()

    task = asyncio.create_task(run_plane(), name=f"fleet-plane-{running.address}")
    running.plane_task = task
    waiter = asyncio.ensure_future(watching.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        task.result()  # the plane failed to start: raise its error here
    return app
