"""The episode runtime: steps, boundaries, wait/replay, admission, restore, retire, time budget.

Every test drives the runtime with events it controls, so ordering is explicit and no test
depends on timing.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import anyio
import anyio.lowlevel
import pytest
from rollout_protocol import (
    AttemptRetired,
    Boundary,
    EpisodeCancelled,
    EpisodeId,
    EpisodeRuntime,
    EpisodeTimeout,
    Role,
    RuntimeParticipant,
    StaleAttempt,
    StepMode,
    TaskMismatch,
)
from rollout_protocol._participant import episodes_digest

FAR = 60.0


def soon() -> float:
    return time.time() + FAR


def released(
    gate: anyio.Event, started: anyio.Event, nxt: Boundary
) -> Callable[[], Awaitable[Boundary]]:
    """A step body that signals `started`, then waits for `gate`, then returns `nxt`."""

    async def run() -> Boundary:
        started.set()
        await gate.wait()
        return nxt

    return run


async def test_wait_step_blocks_park_until_it_finishes() -> None:
    runtime = EpisodeRuntime()
    ep = runtime.begin("r1", 0, Boundary("a", {"n": 0}))
    gate, started = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            runtime.step, ep, "a", StepMode.WAIT, released(gate, started, Boundary("b", {"n": 1}))
        )
        await started.wait()
        runtime.close_admission()
        blocked = await runtime.park(time.time() + 0.05)
        assert blocked.blockers == [EpisodeId(rollout_id="r1", attempt=0)]
        assert not blocked.ready
        parking: list[object] = []

        async def park() -> None:
            parking.append(await runtime.park(soon()))

        tg.start_soon(park)
        gate.set()
    state = parking[0]
    assert state.ready is True
    # the wait step completed while admission was closed: its boundary is the one exported
    [record] = runtime.export(None)
    assert record.data["step"] == "b"
    assert record.data["state"] == {"n": 1}
    assert record.data["steps"] == 1


async def test_replay_step_parks_at_previous_boundary_and_holds_its_result() -> None:
    runtime = EpisodeRuntime()
    ep = runtime.begin("r1", 0, Boundary("verify", {"answer": 4}))
    gate, started = anyio.Event(), anyio.Event()
    finished: list[Boundary] = []

    async def run_step() -> None:
        finished.append(
            await runtime.step(
                ep,
                "verify",
                StepMode.REPLAY,
                released(gate, started, Boundary("return", {"reward": 1})),
            )
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_step)
        await started.wait()
        runtime.close_admission()
        state = await runtime.park(soon())
        assert state.ready
        assert state.parked == [ep.id]
        gate.set()
        # the step's work is done, but the checkpoint is open: the result is held
        await wait_for(lambda: ep.holding)
        assert runtime.export(None)[0].data["step"] == "verify"
        assert ep.boundary.step == "verify"
        assert not finished
        runtime.reopen()
    assert finished == [Boundary("return", {"reward": 1})]
    assert ep.boundary.step == "return"


async def test_no_step_starts_while_admission_is_closed() -> None:
    runtime = EpisodeRuntime()
    ep = runtime.begin("r1", 0, Boundary("a"))
    runtime.close_admission()
    started = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            runtime.step, ep, "a", StepMode.WAIT, released(anyio.Event(), started, Boundary("b"))
        )
        await wait_for(lambda: True)  # let the step reach the gate
        assert not started.is_set()
        assert (await runtime.park(soon())).ready
        tg.cancel_scope.cancel()
    assert ep.boundary.step == "a"


async def test_restored_boundary_is_claimed_by_the_next_attempt_only() -> None:
    source = EpisodeRuntime()
    ep = source.begin("r1", 3, Boundary("verify", {"answer": 7}), digest="d1")
    await source.step(ep, "verify", StepMode.WAIT, _returns(Boundary("return", {"reward": 1.0})))
    records = source.export(None)

    target = EpisodeRuntime()
    target.validate(records)
    assert target.install(records, 4) == [EpisodeId(rollout_id="r1", attempt=4)]
    with pytest.raises(StaleAttempt):
        target.begin("r1", 3, Boundary("seed"), digest="d1")
    with pytest.raises(TaskMismatch):
        target.begin("r1", 4, Boundary("seed"), digest="other")
    claimed = target.begin("r1", 4, Boundary("seed"), digest="d1")
    assert claimed.boundary == Boundary("return", {"reward": 1.0})
    assert claimed.continued_from == 3
    assert claimed.steps_completed == 1


async def test_unclaimed_restored_boundary_is_exported_again_and_released_out_of_scope() -> None:
    runtime = EpisodeRuntime()
    source = EpisodeRuntime()
    for rid in ("r1", "r2"):
        source.begin(rid, 0, Boundary("invoke", {"rid": rid}))
    runtime.install(source.export(None), 1)
    again = runtime.export(None)
    assert sorted((r.rollout_id, r.attempt) for r in again) == [("r1", 1), ("r2", 1)]
    # a second restore moves them on again, boundaries intact
    second = EpisodeRuntime()
    second.install(again, 2)
    assert second.begin("r2", 2, Boundary("seed")).boundary == Boundary("invoke", {"rid": "r2"})
    runtime.release_outside(frozenset({"r1"}))
    assert [r.rollout_id for r in runtime.export(None)] == ["r1"]
    assert runtime.begin("r2", 1, Boundary("seed")).continued_from is None


async def test_invalid_records_are_refused_before_install() -> None:
    runtime = EpisodeRuntime()
    good = EpisodeRuntime()
    good.begin("r1", 0, Boundary("a"))
    [record] = good.export(None)
    with pytest.raises(ValueError, match="kind"):
        runtime.validate([replace(record, kind="other")])
    with pytest.raises(ValueError, match="r1"):
        runtime.validate([replace(record, data={"step": "a"})])
    with pytest.raises(ValueError, match="duplicate"):
        runtime.validate([record, record])


async def test_retire_cancels_before_cleanup_and_cleanup_still_runs() -> None:
    runtime = EpisodeRuntime()
    ep = runtime.begin("r1", 0, Boundary("a"))
    started = anyio.Event()
    log: list[str] = []

    async def driver() -> None:
        with runtime.driving(ep):
            try:
                with runtime.guard(ep):
                    await runtime.step(
                        ep, "a", StepMode.REPLAY, released(anyio.Event(), started, Boundary("b"))
                    )
            except EpisodeCancelled:
                log.append("retired")
            async with runtime.cleanup(ep):
                await anyio.lowlevel.checkpoint()
                log.append("cleaned")
            runtime.end(ep)

    retired: list[list[EpisodeId]] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(driver)
        await started.wait()
        retired.append(await runtime.retire(0, frozenset({"r1"})))
        log.append("retire replied")
    assert log == ["retired", "cleaned", "retire replied"]
    assert retired == [[EpisodeId(rollout_id="r1", attempt=0)]]
    with pytest.raises(AttemptRetired):
        runtime.begin("r1", 0, Boundary("a"))
    assert runtime.forget(frozenset({"r1"})) == 1
    runtime.begin("r1", 0, Boundary("a"))


async def test_retire_during_cleanup_waits_and_does_not_interrupt() -> None:
    runtime = EpisodeRuntime()
    ep = runtime.begin("r1", 0, Boundary("return"))
    in_cleanup, finish = anyio.Event(), anyio.Event()
    log: list[str] = []

    async def driver() -> None:
        with runtime.driving(ep):
            async with runtime.cleanup(ep):
                in_cleanup.set()
                await finish.wait()
                log.append("cleanup done")
            runtime.end(ep)

    async def retire() -> None:
        await runtime.retire(0, None)
        log.append("retire replied")

    async with anyio.create_task_group() as tg:
        tg.start_soon(driver)
        await in_cleanup.wait()
        tg.start_soon(retire)
        await wait_for(lambda: ep.cancelled is False and runtime.is_retired(0, "r1"))
        finish.set()
    assert log == ["cleanup done", "retire replied"]


async def test_retire_ends_request_driven_session_once_steps_unwind() -> None:
    runtime = EpisodeRuntime()
    ep = runtime.begin("r1", 0, Boundary("ready"))
    started = anyio.Event()
    outcome: list[str] = []

    async def request() -> None:
        try:
            await runtime.step(
                ep, "tool", StepMode.WAIT, released(anyio.Event(), started, Boundary("ready"))
            )
        except EpisodeCancelled:
            outcome.append("retired")

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await started.wait()
        await runtime.retire(0, frozenset({"r1"}))
    assert outcome == ["retired"]
    assert runtime.find("r1") is None
    assert ep.closed


async def test_parked_time_does_not_count_against_the_budget() -> None:
    now = [100.0]
    runtime = EpisodeRuntime(episode_timeout_s=10.0, clock=lambda: now[0])
    ep = runtime.begin("r1", 0, Boundary("a"))
    now[0] += 4.0
    runtime.close_admission()
    now[0] += 100.0  # a long checkpoint while parked
    runtime.reopen()
    now[0] += 1.0
    assert ep.active_seconds() == pytest.approx(5.0)
    assert ep.remaining() == pytest.approx(5.0)
    await runtime.step(ep, "a", StepMode.WAIT, _returns(Boundary("b")))
    now[0] += 6.0
    with pytest.raises(EpisodeTimeout):
        await runtime.step(ep, "b", StepMode.WAIT, _returns(Boundary("c")))
    # the active time at the boundary travels with the record (encoded when it was reached), so
    # a restored episode keeps that budget; what ran after the boundary reruns and counts again
    [record] = runtime.export(None)
    assert record.data["step"] == "b"
    assert record.data["active_seconds"] == pytest.approx(5.0)


async def test_participant_reports_parked_and_restored_episodes() -> None:
    runtime = EpisodeRuntime()
    participant = RuntimeParticipant(Role.AGENT, runtime)
    runtime.begin("live", 1, Boundary("model"))
    source = EpisodeRuntime()
    source.begin("old", 0, Boundary("tool"))
    await participant.install(source.export(None), 1)
    await participant.close_admission()
    state = await participant.park(soon())
    assert {str(e) for e in state.parked} == {"live@1", "old@1"}
    assert participant.counts().restored == 1
    await participant.reopen()
    assert runtime.admission_open


def _returns(boundary: Boundary) -> Callable[[], Awaitable[Boundary]]:
    async def run() -> Boundary:
        return boundary

    return run


async def wait_for(condition: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Yield to other tasks until `condition` holds; fail clearly at the deadline."""
    with anyio.fail_after(limit_s):
        while True:
            await anyio.lowlevel.checkpoint()
            if condition():
                return


async def test_park_reads_the_ids_and_digest_kept_as_episodes_come_and_go() -> None:
    """Nothing blocking: `park` answers from the ids and set digest the runtime keeps (no scan);
    they equal a digest computed from scratch after begins, claims, ends, drops and retires,
    and a wait step or a cleanup in flight still makes the episode a blocker."""
    runtime = EpisodeRuntime()
    a = runtime.begin("a", 0, Boundary("s"))
    runtime.begin("b", 0, Boundary("s"), key="k1")
    runtime.begin("b", 0, Boundary("s"), key="k2")  # two keys, one episode id
    source = EpisodeRuntime()
    for rid in ("c", "d", "e"):
        source.begin(rid, 0, Boundary("s"))
    runtime.install(source.export(None), 1)
    runtime.begin("c", 1, Boundary("x"))  # claims restored c@1
    runtime.drop_restored("d")
    runtime.end(a)
    await runtime.retire(1, frozenset({"e"}))
    expected = [EpisodeId(rollout_id="b", attempt=0), EpisodeId(rollout_id="c", attempt=1)]

    state = await runtime.park(soon())
    assert sorted(map(str, state.parked)) == ["b@0", "c@1"]
    assert state.parked_sha256 == episodes_digest(reversed(expected))
    assert state.parked_sha256 != episodes_digest(expected[:1])

    b1 = runtime.find("b", "k1")
    assert b1 is not None
    gate, started = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            runtime.step, b1, "tool", StepMode.WAIT, released(gate, started, Boundary("t"))
        )
        await started.wait()
        blocked = await runtime.park(time.time())  # the deadline has passed: report now
        assert [str(e) for e in blocked.blockers] == ["b@0"]
        assert blocked.parked_sha256 is None
        gate.set()
    cleaning, release = anyio.Event(), anyio.Event()

    async def cleanup() -> None:
        async with runtime.cleanup(b1):
            cleaning.set()
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(cleanup)
        await cleaning.wait()
        assert [str(e) for e in (await runtime.park(time.time())).blockers] == ["b@0"]
        release.set()
    after = await runtime.park(soon())
    assert after.parked_sha256 == episodes_digest(expected)
