"""`rollout-server model --load-seconds N`: a start cost that can be simulated.

A model pod turns Ready when its `/healthz` answers 200 (the readiness probe). With a load time
the server answers 503 `loading` until the time is paid, as a real engine does while it loads
weights; without one it is ready as soon as it runs.
"""

from __future__ import annotations

import anyio
import httpx
import pytest
from rollout_protocol import Role
from rollout_servers.servers.common import ServerOptions
from rollout_servers.servers.model import ModelServer

pytestmark = pytest.mark.unit


def model(load_seconds: float) -> ModelServer:
    options = ServerOptions(role=Role.MODEL, allow_unauthenticated=True, load_seconds=load_seconds)
    return ModelServer(options, environ={})


async def health(server: ModelServer, app: object) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport) as http:
        return await http.get("http://model/healthz")


async def test_a_model_that_loads_is_not_ready_until_it_has_loaded() -> None:
    server = model(load_seconds=3600)
    app = server.build_app()
    async with app.router.lifespan_context(app):
        reply = await health(server, app)
        assert not server.loaded.is_set()
    assert reply.status_code == 503
    assert reply.json()["status"] == "loading"


async def test_a_model_without_a_load_time_is_ready_once_it_runs() -> None:
    server = model(load_seconds=0)
    app = server.build_app()
    async with app.router.lifespan_context(app):
        with anyio.fail_after(5):
            await server.loaded.wait()
        reply = await health(server, app)
    assert reply.status_code == 200
    assert reply.json()["status"] == "ok"
