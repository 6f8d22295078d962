"""`RunRoute`, the SDK's `/run` duties (docs/sdk.md, section 2), over real HTTP: the order of the
refusals (a retired attempt refused although its result is kept), a repeated `/run` attached to
the live episode whose steps run once, mismatched attempts and tasks refused, errors mapped, and
ids the wire cannot carry refused as the protocol's 422.

The server is a small app on the public SDK served on a loopback port in this event loop
(`rollout_protocol.conformance.serve_app`); its one step waits on an event the test sets, so
every "while it runs" below is a state the test holds, not a moment it times. The control plane
is the real one: retires go through its `/checkpoint/v1/retire` route with the token.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from rollout_protocol import (
    API_PREFIX,
    AttemptRetired,
    Boundary,
    ControlPlane,
    ControlSettings,
    Episode,
    EpisodeCancelled,
    EpisodeError,
    EpisodeExists,
    EpisodeRuntime,
    EpisodeTimeout,
    ErrorCode,
    ProtocolError,
    Role,
    RunRoute,
    RuntimeParticipant,
    StaleAttempt,
    StepCounters,
    StepMode,
    TaskMismatch,
)
from rollout_protocol.conformance import ServedApp, serve_app

from devcluster.waiting import wait_for

TOKEN = "run-route-token"
WAIT_S = 10.0
"""Upper bound of every condition a test waits on; reaching it is a failure, not a delay."""
POLL_S = 0.005
TASK = {"id": "t-1", "question": "what is 6*7?"}


class RunRequest(BaseModel):
    rollout_id: str
    attempt: int
    task: dict[str, Any]


class RunResult(BaseModel):
    rollout_id: str
    attempt: int
    answer: int
    continued_from: int | None = None


@dataclass
class Server:
    """The app's state the tests read and steer."""

    app: FastAPI
    runtime: EpisodeRuntime
    counters: StepCounters
    runs: RunRoute[RunResult] = field(init=False)
    release: anyio.Event = field(default_factory=anyio.Event)
    """The step `work@0` waits for it."""
    step_entered: anyio.Event = field(default_factory=anyio.Event)
    step_runs: int = 0
    """Times the step's body ran (whatever the counters say)."""
    calls: int = 0
    """`/run` calls that reached the route (and, with no await before it, `RunRoute.run`'s
    wait: a test that sees `calls == n` knows the n-th call is attached or answered)."""
    draining: bool = False
    fail_with: Exception | None = None
    """The step raises this (once) instead of answering."""


def build(root: Path) -> Server:
    counters = StepCounters(Role.ENVIRONMENT)
    runtime = EpisodeRuntime(observer=counters.observe)
    settings = ControlSettings(
        Role.ENVIRONMENT, set_name="run-route", checkpoint_root=root, token=TOKEN
    )
    plane = ControlPlane(RuntimeParticipant(Role.ENVIRONMENT, runtime), settings)
    app = FastAPI()
    server = Server(app, runtime, counters)
    server.runs = RunRoute[RunResult](plane, runtime, draining=lambda: server.draining)

    async def work(episode: Episode) -> Boundary:
        server.step_runs += 1
        server.step_entered.set()
        await server.release.wait()
        if server.fail_with is not None:
            error, server.fail_with = server.fail_with, None
            raise error
        return Boundary("done", {"answer": 42})

    async def play(episode: Episode) -> RunResult:
        while episode.boundary.step != "done":
            await runtime.step(episode, "work@0", StepMode.WAIT, lambda: work(episode))
        return RunResult(
            rollout_id=episode.rollout_id,
            attempt=episode.attempt,
            answer=episode.boundary.state["answer"],
            continued_from=episode.continued_from,
        )

    @app.post("/run")
    async def run(request: RunRequest) -> RunResult:
        server.calls += 1
        return await server.runs.run(request, play, first=Boundary("work", {}))

    @app.get("/stats")
    async def stats(rollout_id: str) -> dict[str, Any]:
        return counters.snapshot([rollout_id], detail=False)

    plane.install(app)
    return server


@asynccontextmanager
async def served(tmp_path: Path) -> AsyncIterator[tuple[Server, ServedApp]]:
    server = build(tmp_path)
    async with serve_app(server.app, role=Role.ENVIRONMENT, token=TOKEN) as app:
        yield server, app


async def post_run(
    app: ServedApp, rollout_id: str, attempt: int = 0, task: dict[str, Any] | None = None
) -> httpx.Response:
    body = {"rollout_id": rollout_id, "attempt": attempt, "task": TASK if task is None else task}
    return await app.client.post("/run", json=body, timeout=WAIT_S)


def refused(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


async def retire(app: ServedApp, rollout_id: str, attempt: int = 0) -> None:
    body = {
        "operation_id": f"retire-{rollout_id}-{attempt}",
        "deadline_ts": time.time() + WAIT_S,
        "attempt": attempt,
        "rollout_ids": [rollout_id],
    }
    reply = await app.client.post(
        f"{API_PREFIX}/retire", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert reply.status_code == 200, reply.text


def steps(server: Server, rollout_id: str) -> dict[str, dict[str, int]]:
    """This rollout's counts of attempt 0, by step: `work@0` and `run`."""
    rollouts = server.counters.snapshot([rollout_id], detail=False)["rollouts"]
    counted: dict[str, dict[str, int]] = rollouts.get(rollout_id, {}).get("0", {})
    return counted


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition()` (the server runs in this event loop) until it holds; fail at the
    deadline."""

    async def holds() -> bool:
        return condition()

    await wait_for(holds, WAIT_S, what, interval=POLL_S)


async def in_background(
    group: anyio.abc.TaskGroup, call: Callable[[], Awaitable[httpx.Response]]
) -> list[httpx.Response]:
    """Start `call` in `group`; its response lands in the returned list."""
    answers: list[httpx.Response] = []

    async def go() -> None:
        answers.append(await call())

    group.start_soon(go)
    return answers


async def test_a_retired_attempt_is_refused_though_its_result_is_kept(tmp_path: Path) -> None:
    async with served(tmp_path) as (server, app):
        server.release.set()
        first = await post_run(app, "r-retired")
        assert first.status_code == 200, first.text
        again = await post_run(app, "r-retired")
        assert again.json() == first.json()  # kept: answered again ...
        assert steps(server, "r-retired")["work@0"] == {"started": 1, "completed": 1}  # ... no step

        await retire(app, "r-retired")
        assert server.runs.is_finished("r-retired", 0)  # the result is still kept
        assert refused(await post_run(app, "r-retired")) == (410, "attempt_retired")
        assert server.step_runs == 1


async def test_a_repeated_run_attaches_to_the_live_episode(tmp_path: Path) -> None:
    async with served(tmp_path) as (server, app), anyio.create_task_group() as group:
        first = await in_background(group, lambda: post_run(app, "r-live"))
        with anyio.fail_after(WAIT_S):
            await server.step_entered.wait()
        second = await in_background(group, lambda: post_run(app, "r-live"))
        await until(lambda: server.calls == 2, "the repeated /run reached the route")
        assert not first  # both wait on the one episode
        assert not second
        assert len(server.runtime.live()) == 1
        server.release.set()
        await until(lambda: bool(first and second), "both calls answered")
        assert first[0].status_code == second[0].status_code == 200, second[0].text
        assert first[0].json() == second[0].json()
        assert server.step_runs == 1
        counts = steps(server, "r-live")
        assert counts["work@0"] == {"started": 1, "completed": 1}
        assert counts["run"] == {"started": 1, "completed": 1}


async def test_other_attempts_and_tasks_are_refused(tmp_path: Path) -> None:
    async with served(tmp_path) as (server, app), anyio.create_task_group() as group:
        assert refused(await post_run(app, "r-other", attempt=1)) == (409, "attempt_mismatch")
        assert "r-other" not in server.counters.snapshot(["r-other"], False)["rollouts"]

        first = await in_background(group, lambda: post_run(app, "r-task"))
        with anyio.fail_after(WAIT_S):
            await server.step_entered.wait()
        other_task = {"id": "t-2", "question": "what is 7*6?"}
        assert refused(await post_run(app, "r-task", task=other_task)) == (409, "task_mismatch")
        assert refused(await post_run(app, "r-task", attempt=1)) == (409, "attempt_mismatch")
        server.release.set()
        await until(lambda: bool(first), "the first call answered")
        assert first[0].status_code == 200
        # finished: the same task is answered again, another task is refused, never played
        assert refused(await post_run(app, "r-task", task=other_task)) == (409, "task_mismatch")
        assert (await post_run(app, "r-task")).json() == first[0].json()
        assert server.step_runs == 1


async def test_errors_leave_as_the_protocols_replies(tmp_path: Path) -> None:
    async with served(tmp_path) as (server, app), anyio.create_task_group() as group:
        # a bug in the episode: 500 internal, nothing kept, the next /run plays it again
        server.fail_with = RuntimeError("boom")
        server.release.set()
        assert refused(await post_run(app, "r-bug")) == (500, "internal")
        assert not server.runs.is_finished("r-bug", 0)
        assert steps(server, "r-bug")["run"] == {"started": 1, "failed": 1}
        assert (await post_run(app, "r-bug")).status_code == 200

        # a refusal of the episode's own passes as it is
        server.fail_with = ProtocolError(ErrorCode.UNREACHABLE, "the tool is gone")
        assert refused(await post_run(app, "r-own")) == (502, "unreachable")

        # a retire while it runs: the caller and the attached caller both get 410
        server.release = anyio.Event()
        server.step_entered = anyio.Event()
        calls = server.calls
        first = await in_background(group, lambda: post_run(app, "r-cut"))
        with anyio.fail_after(WAIT_S):
            await server.step_entered.wait()
        second = await in_background(group, lambda: post_run(app, "r-cut"))
        await until(lambda: server.calls == calls + 2, "the repeated /run reached the route")
        await retire(app, "r-cut")
        await until(lambda: bool(first and second), "both calls answered")
        assert refused(first[0]) == refused(second[0]) == (410, "attempt_retired")

        # shutting down: 503 before anything else, even for a kept result
        server.draining = True
        assert refused(await post_run(app, "r-bug")) == (503, "admission_closed")


@pytest.mark.parametrize(
    ("rollout_id", "attempt", "field"),
    [
        ("../x", 0, "rollout_id"),
        ("r" * 10_000, 0, "rollout_id"),
        ("r\x00x", 0, "rollout_id"),
        ("", 0, "rollout_id"),
        ("r-1", -1, "attempt"),
    ],
    ids=["dot-dot-slash", "10000-chars", "nul", "empty", "negative-attempt"],
)
async def test_an_id_the_wire_cannot_carry_is_a_422_naming_it(
    tmp_path: Path, rollout_id: str, attempt: int, field: str
) -> None:
    """The server's own body model takes any string (as the guide's does): `RunRoute` checks
    the id where it enters, before any duty or the runtime, and answers the protocol's 422
    naming the field, without echoing the id; nothing begins."""
    async with served(tmp_path) as (server, app):
        server.release.set()
        reply = await post_run(app, rollout_id, attempt=attempt)
        assert refused(reply) == (422, "invalid_request")
        detail = reply.json()["error"]["detail"]
        assert detail.startswith(f"{field}: "), detail
        assert len(detail) < 200
        assert server.step_runs == 0
        assert server.runtime.find(rollout_id) is None


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (AttemptRetired("x"), ErrorCode.ATTEMPT_RETIRED),
        (EpisodeCancelled("x"), ErrorCode.ATTEMPT_RETIRED),
        (StaleAttempt("x"), ErrorCode.ATTEMPT_MISMATCH),
        (TaskMismatch("x"), ErrorCode.TASK_MISMATCH),
        (EpisodeTimeout("x"), ErrorCode.DEADLINE_PASSED),
        (EpisodeError("x"), ErrorCode.INTERNAL),
    ],
)
def test_the_runtimes_errors_map_as_the_guide_says(error: EpisodeError, code: ErrorCode) -> None:
    assert RunRoute.wire_error(error).code is code


def test_episode_exists_maps_to_attempt_mismatch() -> None:
    runtime = EpisodeRuntime()
    live = runtime.begin("r-1", 0, Boundary("a"))
    assert RunRoute.wire_error(EpisodeExists(live)).code is ErrorCode.ATTEMPT_MISMATCH
