"""The Gym adapter's calls to Gym servers (`rollout_gym._peers`, docs/gym.md): NeMo Gym's
endless retry of a peer that is gone, bounded by the step's deadline, and its cancellation
HTTP 500 translated at the adapter's edge instead of being taken for a tool's output.

Over real HTTP on loopback (the SDK's `serve_app`). The peer is a fake of a Gym server's edge,
named as one: it answers what Gym's exception middleware answers for a request cancelled inside
the server (`500` with the JSON string `"CancelledError()"`), without nemo-gym, which the
project's own venv does not have.
"""

from __future__ import annotations

import time

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from rollout_gym._peers import PeerUnavailable, is_cancellation, make_client, post
from rollout_protocol import Role
from rollout_protocol.conformance import serve_app
from testsupport.server_processes import free_port


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def fake_gym_edge(cancelled_first: int) -> tuple[FastAPI, list[str]]:
    """A fake Gym server: its first `cancelled_first` calls end as Gym's middleware ends a
    cancelled request; then a tool that answers 200, and one route that answers 404."""
    app = FastAPI()
    calls: list[str] = []

    @app.post("/increment_counter")
    async def increment() -> JSONResponse:
        calls.append("increment_counter")
        if len(calls) <= cancelled_first:
            return JSONResponse(content="CancelledError()", status_code=500)
        return JSONResponse(content={"success": True})

    @app.post("/missing")
    async def missing() -> JSONResponse:
        calls.append("missing")
        return JSONResponse(content={"detail": "Not Found"}, status_code=404)

    return app, calls


def test_cancellation_is_told_from_a_server_error() -> None:
    assert is_cancellation(500, '"CancelledError()"')
    assert not is_cancellation(500, '"ValueError()"')
    assert not is_cancellation(200, '"CancelledError()"')


async def test_a_gone_peer_is_retried_until_the_deadline_only() -> None:
    url = f"http://127.0.0.1:{free_port()}/increment_counter"  # nothing listens there
    async with make_client(5) as http:
        start = time.monotonic()
        with pytest.raises(PeerUnavailable, match="unreachable until the step's deadline"):
            await post(http, url, {"count": 1}, deadline_ts=time.time() + 1.2)
        elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 3.0, elapsed  # Gym's own client would still be retrying


async def test_the_cancellation_500_is_retried_not_returned_as_a_tool_output() -> None:
    app, calls = fake_gym_edge(cancelled_first=2)
    async with serve_app(app, role=Role.RESOURCES, token="t") as served, make_client(5) as http:
        base = served.target.base_url
        reply = await post(
            http, base + "/increment_counter", {"count": 1}, deadline_ts=time.time() + 10
        )
        assert (reply.status, reply.json()) == (200, {"success": True})
        assert calls == ["increment_counter"] * 3
        # any other error status is the tool's answer, as in Gym's agent loop
        missing = await post(http, base + "/missing", {}, deadline_ts=time.time() + 10)
        assert (missing.status, missing.json()) == (404, {"detail": "Not Found"})


async def test_a_peer_that_keeps_cancelling_fails_at_the_deadline() -> None:
    app, _ = fake_gym_edge(cancelled_first=10_000)
    async with serve_app(app, role=Role.RESOURCES, token="t") as served, make_client(5) as http:
        with pytest.raises(PeerUnavailable, match="cancelled the call"):
            await post(
                http,
                served.target.base_url + "/increment_counter",
                {"count": 1},
                deadline_ts=time.time() + 1.2,
            )
