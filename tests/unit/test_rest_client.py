"""`rest.ApiClient`, the operator's HTTP client, against a real HTTP server on loopback.

A stand-in API server (aiohttp, a named fake) answers as the real one does for what the client
must handle itself: the Status body of a refusal, a 401 after the service account's token was
rotated (the client logs in again once), and a server that is not there at all.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator

import kopf
import pytest
from aiohttp import web
from rollout_operator.cluster.rest import MERGE_PATCH, ApiClient, ApiError, api_path

pytestmark = pytest.mark.unit


class StandIn:
    """Accepts the bearer token in `valid`; records each request's method, path and body."""

    def __init__(self) -> None:
        self.valid = "token-1"
        self.seen: list[tuple[str, str, str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.text()
        self.seen.append(
            (request.method, request.path_qs, request.headers.get("Content-Type", ""), body)
        )
        if request.headers.get("Authorization") != f"Bearer {self.valid}":
            return web.json_response({"kind": "Status", "message": "Unauthorized"}, status=401)
        if request.path.endswith("/missing"):
            message = 'rolloutsets.checkpoint.rollout.dev "missing" not found'
            return web.json_response({"kind": "Status", "message": message}, status=404)
        return web.json_response({"path": request.path, "body": json.loads(body or "null")})


@pytest.fixture
async def stand_in() -> AsyncIterator[tuple[StandIn, str]]:
    server = StandIn()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def client_for(url: str, tokens: list[str]) -> ApiClient:
    """A client whose every login reads the next token (as a rotated token file would)."""
    logins = iter(tokens)
    return ApiClient(lambda: kopf.ConnectionInfo(server=url, token=next(logins)))


async def test_a_request_sends_json_and_a_merge_patch_says_so(
    stand_in: tuple[StandIn, str],
) -> None:
    server, url = stand_in
    client = client_for(url, ["token-1"])
    try:
        path = api_path("pods", namespace="ns", name="p")
        answer = await client.request(
            "PATCH", path, body={"metadata": {"labels": None}}, content_type=MERGE_PATCH
        )
    finally:
        await client.close()
    assert answer == {
        "path": "/api/v1/namespaces/ns/pods/p",
        "body": {"metadata": {"labels": None}},
    }
    method, _, content_type, _ = server.seen[0]
    assert (method, content_type) == ("PATCH", MERGE_PATCH)


async def test_a_refusal_carries_the_api_servers_message(stand_in: tuple[StandIn, str]) -> None:
    _, url = stand_in
    client = client_for(url, ["token-1"])
    try:
        with pytest.raises(ApiError) as refused:
            await client.request("GET", "/apis/checkpoint.rollout.dev/v1alpha1/x/missing")
    finally:
        await client.close()
    assert refused.value.status == 404
    assert refused.value.message == 'rolloutsets.checkpoint.rollout.dev "missing" not found'


async def test_a_rotated_token_is_read_again_once(stand_in: tuple[StandIn, str]) -> None:
    server, url = stand_in
    client = client_for(url, ["token-1", "token-2", "token-3"])
    try:
        assert await client.request("GET", "/api/v1/nodes")
        server.valid = "token-2"  # the kubelet rotated the token file
        assert await client.request("GET", "/api/v1/nodes")
        server.valid = "token-9"  # and now nothing we read is accepted
        with pytest.raises(ApiError) as refused:
            await client.request("GET", "/api/v1/nodes")
    finally:
        await client.close()
    assert refused.value.status == 401
    assert len(server.seen) == 5, "one retry after each 401, never more"


async def test_an_api_server_that_is_not_there_is_a_connection_error() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = client_for(f"http://127.0.0.1:{port}", ["token-1"])
    try:
        with pytest.raises(ConnectionError):
            await client.request("GET", "/api/v1/nodes")
    finally:
        await client.close()


def test_paths_of_core_and_custom_kinds() -> None:
    assert api_path("nodes", name="n1") == "/api/v1/nodes/n1"
    assert (
        api_path(
            "rolloutsets",
            group="g.dev",
            version="v1",
            namespace="ns",
            name="s",
            subresource="status",
        )
        == "/apis/g.dev/v1/namespaces/ns/rolloutsets/s/status"
    )
