"""Hostile input to a participant's HTTP API: sizes, deadlines, marks, headers, disconnects.

docs/operations.md#failure-modes, class 6 (bounded resources on every participant) and class 7
(headers are input too). Each case asserts the refusal (a 4xx with the protocol's error body naming
what was wrong) and that the participant keeps serving; the streaming case asserts that nothing is
left running. In-process cases use the control plane and servers through ASGI; the others run a real
`rollout-server model` process on loopback (stopped at the end of each test).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from rollout_protocol import (
    API_PREFIX,
    ControlPlane,
    ControlSettings,
    ErrorCode,
    Role,
)
from rollout_servers.servers.common import ServerOptions
from rollout_servers.servers.model import ModelServer
from shared import refused
from testsupport.participants import FakeParticipant
from testsupport.server_processes import TOKEN, ServerProcess, server_env

from devcluster.waiting import wait_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}
BIG = 50 * 1024 * 1024
"""The size seen in the issue: several such bodies were read whole by the model API."""


def _deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


@asynccontextmanager
async def _plane(app: FastAPI | None = None, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    values: dict[str, Any] = {"role": Role.ENVIRONMENT, "set_name": "adv", "token": TOKEN}
    values.update(settings)
    plane = ControlPlane(FakeParticipant(Role.ENVIRONMENT), ControlSettings(**values))
    app = app or FastAPI()
    plane.install(app)
    transport = httpx.ASGITransport(app=app)
    async with (
        plane.running(),
        httpx.AsyncClient(transport=transport, base_url="http://p", headers=AUTH) as client,
    ):
        yield client


# --- class 6: bounded resources ----------------------------------------------------------------


async def test_control_body_over_the_limit_is_refused_unread() -> None:
    async with _plane() as client:
        response = await client.post(
            f"{API_PREFIX}/prepare",
            content=b" " * BIG,
            headers={"content-type": "application/json"},
        )
        detail = refused(response, ErrorCode.PAYLOAD_TOO_LARGE, 413)
        assert "ROLLOUT_MAX_BODY_BYTES" in detail
        ok = await client.get(f"{API_PREFIX}/status")
        assert ok.status_code == 200


async def test_chunked_body_over_the_limit_is_refused() -> None:
    """No Content-Length: the body is counted as it is read and refused past the limit."""
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(64):
            sent += 1
            yield b" " * (1024 * 1024)

    async with _plane(max_body_bytes=4 * 1024 * 1024) as client:
        response = await client.post(f"{API_PREFIX}/prepare", content=chunks())
        refused(response, ErrorCode.PAYLOAD_TOO_LARGE, 413)


async def test_unauthenticated_body_is_not_read() -> None:
    """The token is checked before the body: a caller without it learns nothing from a body."""
    async with _plane() as client:
        response = await client.post(
            f"{API_PREFIX}/prepare",
            content=b"{not json",
            headers={"Authorization": "Bearer wrong", "content-type": "application/json"},
        )
        refused(response, ErrorCode.UNAUTHORIZED, 401)


async def test_model_api_body_over_the_limit_is_refused(tmp_path: Path) -> None:
    server = ModelServer(
        ServerOptions(role=Role.MODEL), environ=server_env(tmp_path / "checkpoints", 0)
    )
    transport = httpx.ASGITransport(app=server.build_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://model") as client:
        prompt = "x" * BIG
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = await client.post(path, json={"prompt": prompt, "messages": []})
            refused(response, ErrorCode.PAYLOAD_TOO_LARGE, 413)


@pytest.mark.parametrize("deadline_ts", [1.7e308, 1e12])
async def test_deadline_beyond_the_horizon_is_refused(deadline_ts: float) -> None:
    """A lease computed from such a deadline would never lapse: refused, naming the field."""
    async with _plane() as client:
        response = await client.post(
            f"{API_PREFIX}/prepare", json={"checkpoint_id": "far", "deadline_ts": deadline_ts}
        )
        detail = refused(response, ErrorCode.INVALID_REQUEST, 422)
        assert "deadline_ts" in detail
        status = (await client.get(f"{API_PREFIX}/status")).json()
        assert status["phase"] == "idle"
        assert status["lease_expires_ts"] is None


async def test_near_deadline_still_accepted_and_lease_bounded() -> None:
    async with _plane(max_deadline_seconds=60.0, lease_grace_seconds=5.0) as client:
        response = await client.post(
            f"{API_PREFIX}/prepare", json={"checkpoint_id": "near", "deadline_ts": _deadline(30)}
        )
        assert response.status_code == 200, response.text
        status = (await client.get(f"{API_PREFIX}/status")).json()
        assert status["lease_expires_ts"] <= time.time() + 60 + 5
        await client.post(
            f"{API_PREFIX}/resume", json={"checkpoint_id": "near", "deadline_ts": _deadline()}
        )


async def test_retire_marks_are_bounded_and_still_refuse() -> None:
    """Marks cannot grow without bound: past the limit a retire is refused until `forget`
    frees marks; a retired (rollout, attempt) is refused throughout."""
    async with _plane(max_retire_marks=100) as client:

        async def retire(op: str, ids: list[str], attempt: int = 0) -> httpx.Response:
            return await client.post(
                f"{API_PREFIX}/retire",
                json={
                    "operation_id": op,
                    "deadline_ts": _deadline(),
                    "attempt": attempt,
                    "rollout_ids": ids,
                },
            )

        first = [f"r{i}" for i in range(100)]
        assert (await retire("op-1", first)).status_code == 200
        refusal = await retire("op-2", ["r-extra"])
        assert "forget" in refused(refusal, ErrorCode.LIMIT_EXCEEDED, 429)
        forget = await client.post(
            f"{API_PREFIX}/forget",
            json={"operation_id": "op-3", "deadline_ts": _deadline(), "rollout_ids": first[:10]},
        )
        assert forget.json()["forgotten"] == 10
        assert (await retire("op-4", ["r-extra"])).status_code == 200
        # a whole-attempt retire covers the attempt's per-rollout marks: they are freed
        assert (await retire("op-5", [], attempt=0)).status_code == 200


def test_retire_marks_fold_when_the_attempt_moves_on() -> None:
    """Marks of attempts below the running one fold into one mark per attempt (then into a
    floor): memory stays bounded across recoveries and every retired pair stays refused."""
    from rollout_protocol._control_state import RetireMarks

    marks = RetireMarks(limit=1000)
    for attempt in range(200):
        marks.add(attempt, frozenset(f"r{attempt}-{i}" for i in range(5)))
        marks.settle(attempt + 1)
    assert marks.count() == 0
    assert len(marks.whole_attempts()) <= 64
    assert all(marks.covers(a, f"r{a}-0") for a in range(200))
    assert not marks.covers(200, "r200-0")


# --- class 7: headers and bodies are input ---------------------------------------------------


@pytest.fixture
def model(tmp_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess.start(
        tmp_path, Role.MODEL, "--token-latency-ms", "400", "--debug-hooks"
    )
    try:
        yield process
    finally:
        process.stop()


@pytest.mark.parametrize(
    "attempt", ["\u00b2", "1\u00b3", "\u00b9\u00b9", "-1", "1e3", "+1", "9" * 40]
)
async def test_attempt_header_is_parsed_strictly(model: ServerProcess, attempt: str) -> None:
    """Superscript digits (sent as Latin-1, as HTTP headers are read) pass `str.isdigit` but
    not `int`: a 500 before."""
    async with httpx.AsyncClient(base_url=model.url, timeout=30) as client:
        response = await client.post(
            "/v1/completions",
            json={"prompt": "hello", "max_tokens": 2},
            headers={"X-Rollout-Request": "r1/k1", "X-Rollout-Attempt": attempt.encode("latin-1")},
        )
        detail = refused(response, ErrorCode.INVALID_REQUEST, 422)
        assert "X-Rollout-Attempt" in detail


async def test_undecodable_body_is_invalid_request() -> None:
    """A body that is not UTF-8 was a bare 400 (undeclared, not the protocol's error body)."""

    class Body(BaseModel):
        value: int

    app = FastAPI()

    @app.post("/run")
    async def run(body: Body) -> dict[str, int]:
        return {"value": body.value}

    async with _plane(app) as client:
        response = await client.post(
            "/run", content=b"\xff\xfe\xd8", headers={"content-type": "application/json"}
        )
        refused(response, ErrorCode.INVALID_REQUEST, 422)


async def test_model_document_declares_bodies_headers_and_errors(model: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=model.url, timeout=30) as client:
        document = (await client.get("/openapi.json")).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        operation = document["paths"][path]["post"]
        assert "requestBody" in operation, path
        headers = {p["name"] for p in operation.get("parameters", []) if p["in"] == "header"}
        assert {"X-Rollout-Request", "X-Rollout-Attempt"} <= headers, path
        assert {"409", "410", "413", "422"} <= set(operation["responses"]), path


# --- class 6: a streaming client that goes away ----------------------------------------------


@pytest.mark.parametrize("keyed", [True, False], ids=["episode", "unkeyed"])
async def test_stream_disconnect_stops_generation(model: ServerProcess, keyed: bool) -> None:
    """The generation stops once its last consumer is gone (it ran to its end before)."""
    headers = {"X-Rollout-Request": "gone-1/k1", "X-Rollout-Attempt": "0"} if keyed else {}
    body = {"prompt": "tell me a story", "max_tokens": 4096, "stream": True}
    async with httpx.AsyncClient(base_url=model.url, timeout=30) as client:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # one token read, then the client goes away

        async def stopped() -> dict[str, Any] | None:
            stats = (await client.get("/stats")).json()
            abandoned = stats.get("abandoned", 0)
            return stats if abandoned >= 1 and stats["live"] == 0 else None

        stats = await wait_for(stopped, 6.0, "the abandoned generation to stop")
        produced = stats["tokens"]["0"]["total"]
        # the whole completion is 20+ tokens at 0.4 s each; a stopped one has only a few
        assert produced <= 6, stats
        again = (await client.get("/stats")).json()["tokens"]["0"]["total"]
        assert again == produced


# --- smaller things: /stats?detail=true lists rollout ids ------------------------------------


async def test_stats_detail_needs_the_control_token(model: ServerProcess) -> None:
    """`detail=true` lists every rollout id the server saw: it takes the control token (it was
    served to anyone who could reach the port). The counts without detail stay open (probes and
    dashboards read them), and so does the filter by a rollout id the caller already knows."""
    rollout = "secret-rollout-7"
    async with httpx.AsyncClient(base_url=model.url, timeout=30) as client:
        done = await client.post(
            "/v1/completions",
            json={"prompt": "hello", "max_tokens": 2},
            headers={"X-Rollout-Request": f"{rollout}/k1", "X-Rollout-Attempt": "0"},
        )
        assert done.status_code == 200, done.text
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            refusal = await client.get("/stats", params={"detail": "true"}, headers=headers)
            refused(refusal, ErrorCode.UNAUTHORIZED, 401)
            assert refusal.headers.get("www-authenticate") == "Bearer"
            assert rollout not in refusal.text
        counts = await client.get("/stats")
        assert counts.status_code == 200, counts.text
        assert rollout not in counts.text, counts.text
        shown = await client.get("/stats", params={"detail": "true"}, headers=AUTH)
        assert shown.status_code == 200, shown.text
        assert rollout in shown.json()["rollouts"], shown.json()
        known = await client.get("/stats", params={"rollout_id": rollout})
        assert rollout in known.json()["rollouts"]
        document = (await client.get("/openapi.json")).json()
        assert "401" in document["paths"]["/stats"]["get"]["responses"]
