"""A participant's control plane served in process, for the tests of the protocol's HTTP side.

`served(plane, token)` installs the real FastAPI app of a `ControlPlane`, runs the plane (its
lease watchdog and background work) and yields an httpx client that reaches the app through
httpx's ASGI transport with the bearer token set; `call` posts one control operation with a
deadline ten seconds ahead unless the body names one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from rollout_protocol import API_PREFIX, ControlPlane


@asynccontextmanager
async def served(
    plane: ControlPlane, token: str, app: FastAPI | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    app = app or FastAPI()
    plane.install(app)
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        plane.running(),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://participant", headers=headers
        ) as client,
    ):
        yield client


async def call(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", time.time() + 10.0)
    return await client.post(f"{API_PREFIX}/{route}", json=body)
