"""Scenario `steps.wait-holds-prepare` (`workers.park-all` on several workers),
`check_park_all`: a prepare is not ready while an episode is inside a step that cannot park,
and is ready with every parked episode once that step ends.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import anyio
import anyio.to_thread

from .._coordinator import Coordinator
from .calls import _connect, _expect, _new_id
from .drivers import StepHoldingDriver
from .report import DRIVER, STEPS_WAIT, WORKERS_PARK, ConformanceError
from .workers import _check_spread, _held_by, _multi_worker


async def check_park_all(
    driver: StepHoldingDriver,
    *,
    rollout_ids: Sequence[str],
    busy_wait_s: float = 1.0,
    timeout_s: float = 60.0,
    call_timeout_s: float = 30.0,
) -> None:
    """`steps.wait-holds-prepare` (`workers.park-all` when a participant of the group runs
    several managed workers): the last of `rollout_ids` is held inside a step that cannot park
    (`hold_in_step`), the others mid-way at a boundary (`wait_mid_episode`); with the ids one
    per worker (`rollout_ids_per_worker`), the parked episodes and the busy one live in
    different workers. A prepare whose deadline is `busy_wait_s` away must not be ready and
    must name the busy episode among its blockers; once the step is released, a prepare of a
    new id must be ready with the parked episodes in it. Both are resumed; the group is then
    crashed and restarted under attempt + 1 (its first-attempt episodes never end by
    themselves), so it is usable, idle, afterwards.
    """
    rids = list(rollout_ids)
    _expect(STEPS_WAIT, len(set(rids)) == len(rids) >= 2, "two or more distinct ids", rids)
    async with _connect(driver.participants(), call_timeout_s) as conns:
        statuses = [await conn.status(STEPS_WAIT) for conn in conns]
        _check_spread(statuses, rids)
        workers = _multi_worker(conns, statuses)
        attempts = {status.attempt for status in statuses}
        _expect(STEPS_WAIT, len(attempts) == 1, "the group must run one attempt", attempts)
        attempt = attempts.pop()
        coordinator = Coordinator([conn.participant for conn in conns], call_timeout=call_timeout_s)
        await driver.hold_in_step(rids[-1])
        failures: dict[str, str] = {}

        async def first_run(rid: str) -> None:
            try:
                await driver.run_episode(rid, attempt)
            except Exception as error:
                failures[rid] = f"{type(error).__name__}: {error}"

        broke: ConformanceError | None = None  # raised outside the task group, as itself
        first, second = _new_id("park-busy"), _new_id("park-all")
        async with anyio.create_task_group() as episodes:
            for rid in rids:
                episodes.start_soon(first_run, rid)
            try:
                await _park_all_steps(
                    driver,
                    coordinator,
                    (first, second),
                    rids,
                    workers,
                    failures,
                    busy_wait_s,
                    timeout_s,
                    call_timeout_s,
                )
            except ConformanceError as error:
                broke = error
            finally:
                with anyio.CancelScope(shield=True):
                    # a resume of an id already resumed (or never prepared) changes nothing
                    for cid in (first, second):
                        await coordinator.resume(cid, time.time() + call_timeout_s)
                    await driver.crash()
                episodes.cancel_scope.cancel()
    if broke is not None:
        raise broke
    await driver.restart(attempt + 1)


check_workers_park_all = check_park_all


"""`check_park_all` by its first name (it checks `workers.park-all` on multi-worker groups)."""


async def _park_all_steps(
    driver: StepHoldingDriver,
    coordinator: Coordinator,
    ids: tuple[str, str],
    rids: Sequence[str],
    workers: Mapping[str, int],
    failures: Mapping[str, str],
    busy_wait_s: float,
    timeout_s: float,
    call_timeout_s: float,
) -> None:
    """`check_workers_park_all` once its episodes run: the two prepares."""
    busy, parked = rids[-1], list(rids[:-1])
    first, second = ids
    rule = WORKERS_PARK if workers else STEPS_WAIT
    try:
        with anyio.fail_after(timeout_s):
            await driver.wait_mid_episode(parked, time.time() + timeout_s)
            await driver.wait_in_step(busy, time.time() + timeout_s)
    except Exception as error:
        raise ConformanceError(
            rule,
            f"{parked} must wait mid-way and {busy} inside its held step",
            f"the driver raised {type(error).__name__}: {error}; failures: {dict(failures)}",
            fault=f"{DRIVER}, or the participant if the episodes failed",
        ) from error
    early = await coordinator.prepare(first, time.time() + busy_wait_s, scope=rids)
    if early.ready or not any(e.rollout_id == busy for e in early.blockers):
        raise ConformanceError(
            rule,
            f"with {parked} parked and {busy}{_held_by(busy, workers)} inside a step that "
            "cannot park, the prepare must not be ready and name it as a blocker",
            f"ready={early.ready}, blockers {[str(e) for e in early.blockers]}, "
            f"{early.episode_count} parked",
            fix="run every step whose effect cannot be redone (a write, a tool that is not "
            "idempotent) as StepMode.WAIT"
            + ("; serve workers with rollout_protocol.workers.serve_workers" if workers else ""),
        )
    await coordinator.abort(first, time.time() + call_timeout_s)
    await driver.release_step(busy)
    ready = await coordinator.prepare(second, time.time() + call_timeout_s, scope=rids)
    _expect(
        rule,
        ready.ready and set(parked) <= set(ready.scope(rids) or ()),
        f"once {busy}'s step ended, every episode must park: the prepare must be ready with "
        f"{parked}",
        f"ready={ready.ready}, scope {ready.scope(rids)}, stopped at {ready.stopped_at}, "
        f"failures {[str(f) for f in ready.failures]}",
    )
