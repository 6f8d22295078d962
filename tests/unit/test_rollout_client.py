"""The trainer-side client's reaction to failed `/run` calls, against a fake environment.

The fake is an httpx transport (the layer below the client); the client code runs unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from rollout_protocol import ErrorBody, ErrorCode, ErrorDetail
from rollout_servers.client import (
    EpisodeFailed,
    EpisodeResult,
    EpisodeSpec,
    RolloutClient,
)
from rollout_servers.discovery import recovery_bound_seconds
from rollout_servers.tasks import shipped_tasks
from rollout_servers.topology import (
    FileTopology,
    MutableTopology,
    StaticTopology,
    TopologySnapshot,
)

TASK = shipped_tasks()[0]


def error(code: ErrorCode, status: int) -> httpx.Response:
    body = ErrorBody(error=ErrorDetail(code=code, detail="fake"))
    return httpx.Response(status, content=body.model_dump_json())


def ok(request: httpx.Request, continued_from: int | None = None) -> httpx.Response:
    body = json.loads(request.content)
    return httpx.Response(
        200,
        json={
            "rollout_id": body["rollout_id"],
            "attempt": body["attempt"],
            "answer": TASK.answer,
            "reward": 1.0,
            "steps": 3,
            "continued_from": continued_from,
        },
    )


def fake(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_a_failed_run_is_reissued_under_the_next_attempt_on_the_same_index() -> None:
    topology = MutableTopology(["http://env-0", "http://env-1", "http://env-2"], attempt=4)
    seen: list[tuple[str, int]] = []
    waiting = anyio.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        attempt = json.loads(request.content)["attempt"]
        seen.append((request.url.host, attempt))
        if attempt == 4:
            waiting.set()
            raise httpx.ConnectError("connection refused", request=request)
        return ok(request, continued_from=4)

    client = RolloutClient(topology, restore_timeout_s=30)
    results: list[EpisodeResult] = []
    async with fake(handler) as http, anyio.create_task_group() as group:

        async def episode() -> None:
            results.append(await client.run_episode(EpisodeSpec("r-7", TASK), http))

        group.start_soon(episode)
        await waiting.wait()
        topology.set(5)
    index = client.assign("r-7", 3)
    assert seen == [(f"env-{index}", 4), (f"env-{index}", 5)]
    assert results[0].attempt == 5
    assert results[0].continued
    assert client.progress.reissued == 1


async def run_beside(
    client: RolloutClient,
    handler: Callable[[httpx.Request], Awaitable[httpx.Response]],
    meanwhile: Callable[[], Awaitable[None]],
) -> EpisodeResult:
    """One episode through `handler`, with `meanwhile` running beside it; 10 s at most."""
    results: list[EpisodeResult] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:

                async def episode() -> None:
                    results.append(await client.run_episode(EpisodeSpec("r-1", TASK), http))

                group.start_soon(episode)
                await meanwhile()
    return results[0]


async def test_a_reply_that_never_comes_is_given_up_when_the_attempt_is_superseded() -> None:
    """A server on a lost node never answers and nothing closes the connection: the call
    waits only until the set runs a newer attempt, then the episode is re-issued there."""
    topology = MutableTopology(["http://env-0"], attempt=1)
    calls: list[int] = []
    hanging = anyio.Event()
    given_up = anyio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        attempt = json.loads(request.content)["attempt"]
        calls.append(attempt)
        if attempt == 1:
            hanging.set()
            try:
                await anyio.sleep_forever()
            finally:
                given_up.set()
        return ok(request, continued_from=1)

    async def supersede() -> None:
        await hanging.wait()
        topology.set(2)

    client = RolloutClient(topology, restore_timeout_s=30)
    result = await run_beside(client, handler, supersede)
    assert given_up.is_set(), "the call to the superseded attempt was given up"
    assert calls == [1, 2]
    assert result.attempt == 2
    assert client.progress.reissued == 1


async def test_a_reply_under_the_current_attempt_is_awaited_however_long_it_takes() -> None:
    """Without a newer attempt nothing gives the call up: an episode runs as long as it
    runs (the reply comes after the topology was read again, and is the result)."""
    topology = MutableTopology(["http://env-0"], attempt=1)
    release = anyio.Event()
    started = anyio.Event()
    calls: list[int] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content)["attempt"])
        started.set()
        await release.wait()
        return ok(request)

    async def same_attempt_then_reply() -> None:
        await started.wait()
        topology.set(1, ["http://env-0"])  # the same attempt again: no supersession
        release.set()

    client = RolloutClient(topology, restore_timeout_s=30)
    result = await run_beside(client, handler, same_attempt_then_reply)
    assert calls == [1]
    assert result.attempt == 1


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (ErrorCode.ATTEMPT_RETIRED, 410),
        (ErrorCode.ATTEMPT_MISMATCH, 409),
        (ErrorCode.UNREACHABLE, 502),
        (ErrorCode.ADMISSION_CLOSED, 503),
    ],
)
async def test_restore_codes_wait_for_a_newer_attempt(code: ErrorCode, status: int) -> None:
    calls: list[int] = []
    refused = anyio.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        attempt = json.loads(request.content)["attempt"]
        calls.append(attempt)
        if attempt == 0:
            refused.set()
            return error(code, status)
        return ok(request)

    topology = MutableTopology(["http://env-0"], attempt=0)
    client = RolloutClient(topology, restore_timeout_s=30)
    async with fake(handler) as http, anyio.create_task_group() as group:
        group.start_soon(client.run_episode, EpisodeSpec("r-1", TASK), http)
        with anyio.fail_after(10):
            await refused.wait()
        topology.set(1)
    assert calls == [0, 1]


async def test_a_transport_error_with_no_restore_retries_the_same_attempt() -> None:
    attempts: list[int] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        attempts.append(json.loads(request.content)["attempt"])
        if len(attempts) == 1:
            raise httpx.ConnectError("connection reset", request=request)
        return ok(request)

    client = RolloutClient(StaticTopology(["http://env-0"], attempt=3), restore_timeout_s=30)
    async with fake(flaky) as http:
        result = await client.run_episode(EpisodeSpec("r-1", TASK), http)
    assert attempts == [3, 3]
    assert result.attempt == 3


async def test_refusals_no_restore_fixes_fail_at_once() -> None:
    client = RolloutClient(StaticTopology(["http://env-0"]))
    async with fake(lambda _: error(ErrorCode.TASK_MISMATCH, 409)) as http:
        with pytest.raises(EpisodeFailed, match="task_mismatch"):
            await client.run_episode(EpisodeSpec("r-1", TASK), http)


async def test_attempt_that_never_advances_fails_with_the_reason() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = RolloutClient(StaticTopology(["http://env-0"]), restore_timeout_s=0.05)
    async with fake(refuse) as http:
        with pytest.raises(EpisodeFailed, match="did not advance past 0"):
            await client.run_episode(EpisodeSpec("r-1", TASK), http)


async def test_run_all_reports_each_outcome(tmp_path: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        rid = json.loads(request.content)["rollout_id"]
        return error(ErrorCode.TASK_MISMATCH, 409) if rid == "bad" else ok(request)

    topology_file = tmp_path / "topology.json"
    topology_file.write_text(json.dumps({"attempt": 2, "environments": ["http://env-0"]}))
    seen: list[Any] = []
    async with fake(handler) as http:
        client = RolloutClient(FileTopology(topology_file), concurrency=2, http=http)
        outcomes = await client.run_all(
            [EpisodeSpec(rid, TASK) for rid in ("a", "bad", "c")], seen.append
        )
    assert [type(o) for o in outcomes] == [EpisodeResult, EpisodeFailed, EpisodeResult]
    assert len(seen) == 3
    assert (client.progress.done, client.progress.failed, client.progress.attempt) == (2, 1, 2)


def test_assignment_is_stable_and_spread() -> None:
    client = RolloutClient(StaticTopology(["a", "b", "c", "d"]))
    first = [client.assign(f"r{i}", 4) for i in range(400)]
    assert first == [client.assign(f"r{i}", 4) for i in range(400)]
    assert all(first.count(i) > 50 for i in range(4))


class RecoveringTopology:
    """A set that went into a recovery and never comes out: `current()` waits for it, as
    `RolloutSetTopology.current()` does while the set is in transition."""

    def __init__(self) -> None:
        self.first = True

    async def current(self) -> TopologySnapshot:
        if self.first:
            self.first = False
            return TopologySnapshot(1, ("http://env-0",))
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_recovery_that_never_ends_is_bounded_by_the_restore_timeout() -> None:
    """A transport error re-reads the topology; during a recovery that read waits, and the
    wait counts against the restore timeout (it used to wait for as long as the set did)."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = RolloutClient(RecoveringTopology(), restore_timeout_s=0.5)
    async with fake(refuse) as http:
        with anyio.fail_after(10), pytest.raises(EpisodeFailed, match="did not advance past 1"):
            await client.run_episode(EpisodeSpec("r-1", TASK), http)


def test_the_recovery_bound_covers_every_try_and_backoff() -> None:
    defaults = recovery_bound_seconds({"spec": {}})
    # 11 tries of 600 s (+60 s of control calls each), backoffs 2+4+8+16+32 then 60 s x 6
    assert defaults == 11 * 660 + (2 + 4 + 8 + 16 + 32) + 6 * 60
    tight = recovery_bound_seconds(
        {"spec": {"recovery": {"maxRestarts": 1, "restoreTimeoutSeconds": 30}}}
    )
    assert tight == 2 * 90 + 2 + 4
