"""What the crash scenarios need from the environment under test: the `EpisodeDriver` and
`StepHoldingDriver` protocols a server author implements, and the kit's calls through a
driver (`/run` expected refused, every episode run to its end).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import anyio
import anyio.to_thread

from .._fake_model import FakeModel
from .calls import Target, _expect
from .model import _check_driver_holds
from .report import (
    DRIVER,
    PARTICIPANT,
    RUN_ATTEMPT,
    RUN_RETIRED,
    STEPS,
    ConformanceError,
    RunRefused,
)


class EpisodeDriver(Protocol):
    """What `check_crash_restore` needs from the environment under test (you implement it).

    A driver covers a group of participants that run episodes together (an environment with
    its agent, model and resources peers, or one participant alone). All methods run on the
    kit's event loop.
    """

    def participants(self) -> Sequence[Target]:
        """The group's participants as they are now (after a `restart`, the new ones)."""
        ...

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        """Send `/run` for `rollout_id` under `attempt`; return the server's result (its JSON)
        once the episode ended, or raise `RunRefused` when the server refused the call
        (`return RunRefused.reply(response)` does both). Any other exception is the driver's.

        Under the first attempt, episodes must stop mid-way (see `wait_mid_episode`) and stay
        there: the kit checkpoints them and crashes the group while this call is in flight
        (it then ignores how the call ends). The kit also repeats this call while an episode is
        held, and under attempt + 1 for a finished episode, an attempt the group does not run
        and a retired one: send the same `/run` each time. Give `<id>-uninterrupted`
        (`UNINTERRUPTED_SUFFIX`) the task of `<id>` (`base_rollout_id`).
        """
        ...

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        """Return once every episode has completed at least one step and is parked at a
        boundary where it stays (e.g. held by a test hook between two steps, or by a fake model
        that blocks); raise at `deadline_ts` (unix seconds) otherwise, saying what it waited
        for (the kit reports that message; it cancels the call only `driver_grace_s` later)."""
        ...

    async def crash(self) -> None:
        """Kill every participant of the group at once, without any shutdown (SIGKILL)."""
        ...

    async def restart(self, attempt: int) -> None:
        """Start fresh participants under `attempt` (`ROLLOUT_ATTEMPT`) with the same set name
        and checkpoint root, and return once they answer."""
        ...


class StepHoldingDriver(EpisodeDriver, Protocol):
    """An `EpisodeDriver` that can also hold one episode inside a step that cannot park (a
    `StepMode.WAIT` step, say one waiting on a tool), for `check_workers_park_all`."""

    async def hold_in_step(self, rollout_id: str) -> None:
        """Before its first `/run`: make `rollout_id` stop inside such a step and stay there
        until `release_step` (and not be held at a boundary by `wait_mid_episode`'s hold)."""
        ...

    async def wait_in_step(self, rollout_id: str, deadline_ts: float) -> None:
        """Return once `rollout_id` is inside the held step; raise at `deadline_ts` otherwise."""
        ...

    async def release_step(self, rollout_id: str) -> None:
        """Let the held step end (the episode then parks at its next boundary, or finishes)."""
        ...


async def _run_refused(
    driver: EpisodeDriver, rule: str, rid: str, attempt: int, codes: Mapping[str, int], why: str
) -> None:
    """`/run rid@attempt` must be refused with one of `codes` (code -> HTTP status)."""
    expected = " or ".join(f"{status} {code}" for code, status in codes.items())
    try:
        result = await driver.run_episode(rid, attempt)
    except RunRefused as refusal:
        _expect(
            rule,
            codes.get(refusal.code) == refusal.status_code,
            f"/run {rid}@{attempt} ({why}) must be refused with {expected}",
            str(refusal),
        )
        return
    except Exception as error:
        raise ConformanceError(
            rule,
            f"/run {rid}@{attempt} ({why}) must be refused with {expected}",
            f"the driver raised {type(error).__name__}: {error}",
            fault=DRIVER,
            fix="raise RunRefused for an error reply (return RunRefused.reply(response))",
        ) from error
    raise ConformanceError(
        rule,
        f"/run {rid}@{attempt} ({why}) must be refused with {expected}",
        f"it was answered: {str(result)[:300]}",
        fix=_RUN_FIXES[rule],
    )


_RUN_FIXES: Mapping[str, str] = {
    RUN_ATTEMPT: "before starting an episode, refuse attempt != plane.attempt with "
    "ProtocolError(ErrorCode.ATTEMPT_MISMATCH, ...) (409)",
    RUN_RETIRED: "check plane.is_retired(attempt, rollout_id) first, before any cached result, "
    "and refuse with ProtocolError(ErrorCode.ATTEMPT_RETIRED, ...) (410)",
}


async def _run_all(
    driver: EpisodeDriver,
    rids: Sequence[str],
    attempt: int,
    timeout_s: float,
    what: str,
    model: FakeModel | None = None,
) -> dict[str, Any]:
    """Run every episode to its end concurrently; each must finish with a result (a driver
    mistake the `model` recorded on the way is reported first, as the driver's)."""
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}

    async def one(rid: str) -> None:
        try:
            results[rid] = await driver.run_episode(rid, attempt)
        except Exception as error:
            failures[rid] = f"{type(error).__name__}: {error}"

    with anyio.move_on_after(timeout_s):
        async with anyio.create_task_group() as group:
            for rid in rids:
                group.start_soon(one, rid)
    unfinished = [rid for rid in rids if rid not in results and rid not in failures]
    _check_driver_holds(model)
    if unfinished:
        failures["(unfinished)"] = f"{unfinished} not finished within {timeout_s}s"
        raise ConformanceError(
            STEPS,
            f"every {what} must finish under attempt {attempt}",
            str(failures),
            fault=f"{PARTICIPANT}, or the driver if it still holds them",
            fix="if your driver holds episodes (a test hook, a fake that blocks), hold only "
            "the first attempt's own rollouts, armed once before the crash (the kit's "
            "FakeModel reports a later hold at once); otherwise find where the episode waits",
        )
    _expect(STEPS, not failures, f"every {what} must finish under attempt {attempt}", failures)
    return results
