"""Unbounded replies: a participant that answers far more than any real reply.

The protocol client (`HttpParticipantClient`, which `rollout-coordinate` and the operator use)
reads every reply under a bound per reply kind (docs/protocol.md, "Limits"). A real HTTP server on
loopback answers 256 MiB, generated as it is sent (one 1 MiB block written again and again, never
the whole reply), with a declared `Content-Length` or chunked; the client must refuse it with a
clear error, holding no more than a few MiB while it does (tracemalloc's peak over the call), and
stop reading (the server manages to send only a little of it).

What a participant says is untrusted in size too: the operator cuts every message it writes into
a status, a condition or an Event (`rollout_operator.model.conditions.truncate`), shown here with
a 1 MiB error detail through the checkpoint flow on the fake API server (`testsupport`).
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import cast

import anyio
import pytest
from rollout_operator.flows.checkpoint import CheckpointFlow
from rollout_operator.model import api
from rollout_operator.model.conditions import MAX_FAILURE_CHARS, MAX_MESSAGE_CHARS, truncate
from rollout_protocol import (
    MAX_ERROR_REPLY_BYTES,
    MAX_SMALL_REPLY_BYTES,
    Dialect,
    ErrorCode,
    HttpParticipantClient,
    ParticipantError,
    PrepareReply,
    PrepareRequest,
    Role,
)
from testsupport.checkpointflow import CKPT, NS, NotParking, condition, mark_ready, set_cluster

HUGE = 256 * 1024 * 1024
"""The size seen in the issue: a capabilities reply of 256 MiB took the coordinator's memory from
about 125 MB to 570 MB."""
BLOCK = b"x" * (1024 * 1024)
HELD_BOUND = 16 * 1024 * 1024
"""The most the client may hold while refusing (traced allocations of the whole process, the
loopback server's own write buffers included)."""
DEADLINE_S = 60.0


@dataclass
class Hostile:
    """A loopback HTTP server that answers every request with `HUGE` bytes."""

    status: int
    declare_length: bool
    port: int = 0
    sent: int = 0
    requests: list[str] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.requests.append(head.split(b"\r\n", 1)[0].decode())
            framing = (
                f"Content-Length: {HUGE}" if self.declare_length else "Transfer-Encoding: chunked"
            )
            writer.write(
                f"HTTP/1.1 {self.status} X\r\nContent-Type: application/json\r\n"
                f"{framing}\r\n\r\n".encode()
            )
            prefix = b'{"dialects": ["'
            remaining = HUGE
            first = True
            while remaining > 0:
                block = BLOCK[: min(len(BLOCK), remaining)]
                if first:
                    block = prefix + block[len(prefix) :]
                    first = False
                if self.declare_length:
                    writer.write(block)
                else:
                    writer.write(f"{len(block):x}\r\n".encode() + block + b"\r\n")
                await writer.drain()
                self.sent += len(block)
                remaining -= len(block)
            if not self.declare_length:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client stopped reading and closed: what a bounded client does
        finally:
            writer.close()


@asynccontextmanager
async def _serving(hostile: Hostile) -> AsyncIterator[str]:
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        await hostile.handle(reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    hostile.port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{hostile.port}"
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


@pytest.mark.parametrize(
    ("status", "declare_length", "dialect", "bound"),
    [
        pytest.param(200, False, None, MAX_SMALL_REPLY_BYTES, id="capabilities-chunked"),
        pytest.param(200, True, None, MAX_SMALL_REPLY_BYTES, id="capabilities-declared"),
        pytest.param(200, False, Dialect.ROLLOUT, MAX_SMALL_REPLY_BYTES, id="status-chunked"),
        pytest.param(500, False, Dialect.ROLLOUT, MAX_ERROR_REPLY_BYTES, id="error-chunked"),
    ],
)
async def test_a_huge_reply_is_refused_without_being_held(
    status: int, declare_length: bool, dialect: Dialect | None, bound: int
) -> None:
    hostile = Hostile(status, declare_length)
    async with _serving(hostile) as url:
        client = HttpParticipantClient(Role.MODEL, url, token="t", dialect=dialect)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            with anyio.fail_after(DEADLINE_S), pytest.raises(ParticipantError) as refused:
                await client.status(time.time() + DEADLINE_S)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            await client.aclose()
    assert peak < HELD_BOUND, f"the client held {peak} bytes refusing a {HUGE}-byte reply"
    assert hostile.sent < HUGE // 4, f"the client read on: {hostile.sent} bytes were sent"
    assert refused.value.code is ErrorCode.INTERNAL
    assert f"answered more than {bound} bytes" in refused.value.detail, refused.value.detail[:300]
    assert 'docs/protocol.md, "Limits"' in refused.value.detail
    assert len(hostile.requests) == 1, "a reply too large is not retried"


# --- the operator: what a participant said, in a checkpoint's status -----------------------------


class Loud(NotParking):
    """A model participant whose prepare is refused with a 1 MiB detail."""

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        raise ParticipantError(ErrorCode.STORAGE_FAILED, "y" * (1024 * 1024), self.instance, 507)


async def test_a_1_mib_error_message_ends_cut_in_the_checkpoints_status() -> None:
    cluster = set_cluster("Manual", [])
    mark_ready(cluster)
    events: list[tuple[str, str]] = []

    def participants(rset: api.RolloutSet, token: str) -> list[HttpParticipantClient]:
        return [cast(HttpParticipantClient, Loud())]

    async def on_transition(ckpt: api.RolloutCheckpoint, reason: str, message: str) -> None:
        events.append((reason, message))

    flow = CheckpointFlow(
        cluster.kube(),
        participants_factory=participants,
        slots=anyio.Semaphore(1),
        on_transition=on_transition,
    )
    with anyio.fail_after(DEADLINE_S):
        phase = await flow.run(NS, CKPT)
    assert phase is api.CheckpointPhase.FAILED
    for type_ in ("Ready", "Failed"):
        message = condition(cluster, type_)["message"]
        assert "model-0: storage_failed: yyy" in message, message[:300]
        assert len(message) <= MAX_FAILURE_CHARS + 100, f"{type_}: {len(message)} characters"
        assert "(cut: " in message, "a reader sees the message was cut"
    failed = [message for reason, message in events if message.startswith("prepare failed")]
    assert failed, events
    assert all(len(message) <= MAX_MESSAGE_CHARS for message in failed)


def test_truncate_keeps_short_text_and_cuts_long_text_to_its_bound() -> None:
    assert truncate("short") == "short"
    for limit in (1, 10, 1000, MAX_MESSAGE_CHARS):
        cut = truncate("z" * (1024 * 1024), limit)
        assert len(cut) == limit
