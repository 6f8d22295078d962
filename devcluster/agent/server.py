"""The agent's HTTPS endpoint: kubelet-style container logs, and the test hooks.

`kubectl logs` reaches `/containerLogs/...` through the API server, which finds this port in the
Node's `daemonEndpoints` and verifies the certificate against the cluster CA. The `/devcluster/*`
hooks (kill a pod's processes, lose or restore a node) are for tests and the demo; like the rest
of devcluster they listen on loopback only and are not authenticated.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from pathlib import Path

import anyio
import uvicorn
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel


class HookError(Exception):
    """A test hook asked for something this agent does not have; becomes an HTTP error."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


class Killed(BaseModel):
    pod: str
    pids: list[int]


class NodeState(BaseModel):
    node: str
    online: bool


class PodInfo(BaseModel):
    pod: str
    node: str
    ip: str | None
    phase: str
    pids: list[int]
    in_process: bool = False
    """Served in the agent's process (a fleet pod, `devcluster.agent.fleet`): no pids."""


class AgentHooks:
    """What the endpoint needs from the agent, as plain callables (keeps this module testable)."""

    def __init__(
        self,
        kill_pod: Callable[[str, str, str | None], list[int]],
        set_node: Callable[[str, bool], Awaitable[bool]],
        pods: Callable[[], list[PodInfo]],
        log_path: Callable[[str, str, str], Path | None],
    ) -> None:
        self.kill_pod = kill_pod
        self.set_node = set_node
        self.pods = pods
        self.log_path = log_path


def build_app(hooks: AgentHooks) -> FastAPI:
    app = FastAPI(title="devcluster node agent", docs_url=None, redoc_url=None)

    @app.exception_handler(HookError)
    async def hook_error(_request: Request, error: HookError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=error.status)

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok"

    @app.get("/devcluster/pods")
    async def pods() -> list[PodInfo]:
        return hooks.pods()

    @app.post("/devcluster/pods/{namespace}/{name}/kill")
    async def kill(namespace: str, name: str, container: str | None = None) -> Killed:
        pids = hooks.kill_pod(namespace, name, container)
        return Killed(pod=f"{namespace}/{name}", pids=pids)

    @app.post("/devcluster/nodes/{name}/lose")
    async def lose(name: str) -> NodeState:
        return NodeState(node=name, online=await hooks.set_node(name, False))

    @app.post("/devcluster/nodes/{name}/restore")
    async def restore(name: str) -> NodeState:
        return NodeState(node=name, online=await hooks.set_node(name, True))

    @app.get("/containerLogs/{namespace}/{pod}/{container}", response_model=None)
    async def container_logs(
        namespace: str,
        pod: str,
        container: str,
        follow: bool = False,
        tail_lines: int | None = Query(default=None, alias="tailLines"),
        limit_bytes: int | None = Query(default=None, alias="limitBytes"),
    ) -> PlainTextResponse | StreamingResponse:
        path = hooks.log_path(namespace, pod, container)
        if path is None:
            raise HTTPException(404, f"pod {namespace}/{pod} has no container {container!r} here")
        data = path.read_bytes() if path.exists() else b""
        if tail_lines is not None:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-tail_lines:]) if tail_lines > 0 else b""
        if limit_bytes is not None:
            data = data[:limit_bytes]
        if not follow:
            return PlainTextResponse(data)
        return StreamingResponse(_follow(path, data), media_type="text/plain")

    return app


def _read_new(path: Path, offset: int) -> tuple[bytes, int]:
    """Bytes appended since `offset` (from the start again if the file was truncated)."""
    if not path.exists():
        return b"", offset
    size = path.stat().st_size
    if size < offset:
        offset = 0
    if size == offset:
        return b"", offset
    with path.open("rb") as handle:
        handle.seek(offset)
        return handle.read(size - offset), size


async def _follow(path: Path, first: bytes) -> AsyncIterator[bytes]:
    """Streams new log bytes until the client goes away (the server cancels this generator)."""
    yield first
    _, offset = _read_new(path, 0)
    while True:
        await anyio.sleep(0.2)
        chunk, offset = _read_new(path, offset)
        if chunk:
            yield chunk


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the agent owns SIGTERM and shuts down itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def bind(port: int) -> socket.socket:
    """Binds before serving, so a taken port fails here with a clear error (uvicorn would exit)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as error:
        sock.close()
        raise RuntimeError(f"the agent cannot listen on 127.0.0.1:{port}: {error}") from error
    return sock


async def serve(app: FastAPI, sock: socket.socket, cert: Path, key: Path) -> None:
    config = uvicorn.Config(
        app,
        ssl_certfile=str(cert),
        ssl_keyfile=str(key),
        log_level="warning",
        lifespan="off",
        access_log=False,
    )
    server = _Server(config)
    try:
        await server.serve(sockets=[sock])
    finally:
        server.should_exit = True
