"""Calls from the adapter to Gym servers (the model, a resources server), with Gym's own retry
behaviour bounded and its failure modes translated at the adapter's edge.

NeMo Gym's client (`nemo_gym.server_utils.request`) retries a dropped connection every 0.5 s
for ever, so a peer that is gone (a pod killed by the operator) holds a rollout until somebody
kills the caller. Here the same retries stop at the step's deadline (docs/gym.md, "What the
adapter changes in Gym's behaviour"). Gym's exception middleware answers a request cancelled
inside the server (a server shutting down, a client that went away) with HTTP 500 and the text
`CancelledError()`; `simple_agent` would hand that body to the model as the tool's output. The
adapter recognises it and treats it as the peer being unavailable, never as a tool's answer.

A peer's error answer to a call the protocol needs, and a peer that stays unreachable, become the
episode's error here (`refused`, `unreachable`), one rule for every caller: the `simple_agent`
loop (`rollout_gym.environment`) and the released environment servers' steps
(`rollout_gym.episode_server`, `rollout_gym.turn_steps`); docs/gym.md, "Errors and failures".

Every reply is read bounded (`MAX_REPLY_BYTES`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any, Final

import anyio
import httpx
from rollout_protocol import ErrorCode, ProtocolError

RETRY_SECONDS: Final = 0.5
"""Gym's pause between two tries of a call whose connection failed."""
MAX_REPLY_BYTES: Final = 16 * 1024 * 1024
"""The most the adapter reads of one Gym reply."""
INSTANCE_HEADER: Final = "X-Rollout-Gym-Instance"
"""Set by `rollout-gym resources` on every answer: the process that holds the sessions."""
MAX_SHOWN: Final = 300
"""Characters of a Gym reply an error message shows."""
CANCELLED_BODIES: Final = frozenset({'"CancelledError()"', "CancelledError()"})
"""What Gym's exception middleware writes for a request cancelled inside the server."""
MAY_CHANGE: Final = frozenset({408, 409, 425, 429})
"""The 4xx statuses another try may change (docs/gym.md, "Errors and failures"): nemo-gym 0.7's
rule for an environment server's dependencies (408, 425, 429), and 409, which this project's own
servers answer for a call of another attempt than theirs, a state the set's recovery ends."""


def shown(text: str) -> str:
    """A Gym reply's `text`, cut to `MAX_SHOWN` characters for an error message."""
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


class PeerUnavailable(Exception):
    """A Gym peer could not be reached (or cancelled the call) until the step's deadline."""


@dataclass(frozen=True)
class GymReply:
    """One Gym server's answer: status, body text and the cookies it set."""

    status: int
    text: str
    cookies: dict[str, str]
    instance: str | None = None
    """The hosting process that answered (`X-Rollout-Gym-Instance`), when it says."""

    def json(self) -> Any:
        return json.loads(self.text)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def peer_retryable(status: int) -> bool:
    """Whether a peer's error status may change on another try: `MAY_CHANGE` and every 5xx
    (a 500 included: Gym's servers answer it for whatever their handler raised)."""
    return status in MAY_CHANGE or status >= 500


def refused(what: str, reply: GymReply) -> ProtocolError:
    """The episode's error for a peer's error answer (`what`: the step and the peer's call) to a
    call the protocol needs (docs/gym.md, "Errors and failures"): a status that may change is
    `internal` (the set's recovery plays the episode again); any other 4xx no restore changes:
    `unsupported` for a route the peer does not have (404, 405), `invalid_request` for a task it
    refuses, and the episode ends at once."""
    said = f"{what} answered {reply.status}: {shown(reply.text)}"
    if peer_retryable(reply.status):
        return ProtocolError(ErrorCode.INTERNAL, said)
    code = ErrorCode.UNSUPPORTED if reply.status in (404, 405) else ErrorCode.INVALID_REQUEST
    return ProtocolError(code, f"{said} (a refusal no restore changes)")


def unreachable(what: str, exc: PeerUnavailable) -> ProtocolError:
    """The episode's error for a peer that stayed unreachable until the step's deadline: a lost
    peer, which the set's recovery replaces."""
    return ProtocolError(ErrorCode.UNREACHABLE, f"{what}: {exc}")


def make_client(timeout: float) -> httpx.AsyncClient:
    """The adapter's HTTP client: its cookie jar keeps nothing, since a Gym session is one
    episode's (its cookies travel in the episode's boundary and are sent per call)."""
    return httpx.AsyncClient(timeout=timeout, cookies=CookieJar(policy=_NoCookies()))


class _NoCookies(DefaultCookiePolicy):
    def set_ok(self, cookie: Any, request: Any) -> bool:
        return False


def is_cancellation(status: int, text: str) -> bool:
    """Gym's HTTP 500 for a request cancelled inside the server (its exception middleware
    renders `repr(asyncio.CancelledError())`)."""
    return status == 500 and text.strip() in CANCELLED_BODIES


async def post(
    client: httpx.AsyncClient,
    url: str,
    body: Any,
    *,
    deadline_ts: float,
    cookies: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
) -> GymReply:
    """POST `body` as JSON, retrying a failed connection (and Gym's cancellation 500) every
    `RETRY_SECONDS` until `deadline_ts` (wall clock); `PeerUnavailable` after it. Any other
    answer, error statuses included, is returned: a resources server's 4xx is a valid tool
    output in Gym's agent loop."""
    last = "no try"
    while True:
        left = deadline_ts - time.time()
        if left <= 0:
            raise PeerUnavailable(f"{url}: unreachable until the step's deadline ({last})")
        try:
            with anyio.fail_after(left):
                reply = await _post_once(client, url, body, cookies, headers, left)
        except (httpx.TransportError, TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if not is_cancellation(reply.status, reply.text):
                return reply
            last = "the server cancelled the call (HTTP 500 CancelledError)"
        await anyio.sleep(min(RETRY_SECONDS, max(0.0, deadline_ts - time.time())))


async def _post_once(
    client: httpx.AsyncClient,
    url: str,
    body: Any,
    cookies: Mapping[str, str] | None,
    headers: Mapping[str, str] | None,
    left_s: float,
) -> GymReply:
    sent = dict(headers or {})
    if cookies:  # the episode's own cookies, never a jar shared by episodes (`client`)
        sent["Cookie"] = "; ".join(f"{name}={value}" for name, value in cookies.items())
    request = client.build_request("POST", url, json=body, headers=sent, timeout=left_s)
    response = await client.send(request, stream=True)
    try:
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                raise PeerUnavailable(f"{url}: reply larger than {MAX_REPLY_BYTES} bytes")
            chunks.append(chunk)
    finally:
        await response.aclose()
    set_cookies = {name: value for name, value in response.cookies.items()}
    instance = response.headers.get(INSTANCE_HEADER)
    return GymReply(response.status_code, b"".join(chunks).decode(), set_cookies, instance)
