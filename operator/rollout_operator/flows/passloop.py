"""Waiting and stopping for the per-RolloutSet loops (the `reconcile` and `policy` daemons).

Each loop sleeps until it is woken (an event of the set), until the time its last pass asked
for, or until a backoff ends, and then runs one pass. Kopf stops a daemon by setting its
`stopped` flag (the set was deleted, or the operator exits) and, after `cancellation_backoff`,
cancels it and logs "cancelled. Will escalate." as a warning. A loop that only sleeps and
writes status has nothing to finish, so it should return by itself as soon as it is stopped:
every wait here also ends when the flag is set, and a pass in flight gets `grace_seconds` to
finish before the loop cancels it itself. Cancelling a pass is harmless: everything a pass
decides is persisted in the set's status and objects, so the next start continues from there.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol, TypeVar

import kopf

from ..cluster.kube import ApiError

T = TypeVar("T")

STOP_GRACE_SECONDS: Final = 3.0
"""How long a pass under way may still run after the stop (a few API calls; a recovery's restore
or resume call is cut short and continues from its persisted phase)."""
STOP_BACKOFF_SECONDS: Final = 5.0
"""The daemons' `cancellation_backoff`: longer than the grace, so the loop has returned by
itself before Kopf would cancel it."""
TRANSIENT: Final[tuple[type[Exception], ...]] = (
    ApiError,
    OSError,
    TimeoutError,
    kopf.TemporaryError,
)
"""Failures of a pass that the loop retries after a backoff (the API server, the network)."""


class StopFlag(Protocol):
    """What the loop needs of Kopf's `stopped` kwarg (`kopf.DaemonStopped`)."""

    def is_set(self) -> bool: ...

    def wait(self) -> Awaitable[object]: ...


class Stopped(Exception):
    """The loop was stopped while a pass ran, and the pass did not finish within the grace."""


@dataclass(frozen=True)
class Next:
    """What a pass asks of its loop: another pass at once, or one at `at` (else the resync)."""

    again: bool = False
    at: datetime | None = None


class PassLoop:
    """The waits of one loop: `wake` asks for a pass soon; `stopped` ends every wait."""

    def __init__(
        self,
        stopped: StopFlag,
        *,
        wake: asyncio.Event | None = None,
        grace_seconds: float = STOP_GRACE_SECONDS,
    ) -> None:
        self.wake = wake if wake is not None else asyncio.Event()
        self._stopped = stopped
        self._grace_seconds = grace_seconds

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    async def sleep(self, seconds: float, *, wakeable: bool = True) -> None:
        """Wait `seconds`; end early when stopped and, if `wakeable`, when woken.

        A backoff after a failed pass is not wakeable: the events that keep coming while the
        API server is in trouble would otherwise defeat it.
        """
        if seconds <= 0 or self.stopped or (wakeable and self.wake.is_set()):
            return
        waiters = [asyncio.ensure_future(self._stopped.wait())]
        if wakeable:
            waiters.append(asyncio.ensure_future(self.wake.wait()))
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def run_passes(
        self,
        one_pass: Callable[[], Coroutine[Any, Any, Next]],
        *,
        resync_seconds: float,
        max_backoff_seconds: float,
        slack_seconds: float,
        on_failure: Callable[[Exception, float], None],
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """Run passes until stopped: after a wake, at the time the last pass asked for (plus
        `slack_seconds`), or every `resync_seconds`. A pass failing with one of `TRANSIENT` is
        reported to `on_failure` with the jittered, exponential backoff that follows it.

        Raises `Stopped` when a pass under way outlived the stop's grace (see `run`).
        """
        failures = 0
        while not self.stopped:
            await self.sleep(resync_seconds)
            if self.stopped:
                break
            self.wake.clear()
            try:
                step = await self.run(one_pass())
            except TRANSIENT as error:
                failures += 1
                delay = min(max_backoff_seconds, 2.0**failures) * (0.5 + random.random() / 2)
                on_failure(error, delay)
                await self.sleep(delay, wakeable=False)
                self.wake.set()
                continue
            failures = 0
            if step.again:
                self.wake.set()
            elif step.at is not None:
                remaining = (step.at - now()).total_seconds()
                if remaining < resync_seconds:
                    await self.sleep(max(remaining, 0.0) + slack_seconds)
                    self.wake.set()

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run one pass; when stopped meanwhile, give it `grace_seconds`, then cancel it.

        Raises `Stopped` when the pass was cancelled that way (its exceptions propagate as
        they are otherwise). Cancelling this call cancels the pass too.
        """
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait([task], timeout=self._grace_seconds)
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
                raise Stopped(f"the pass did not finish within {self._grace_seconds}s of the stop")
            return task.result()
        finally:
            task.cancel()
            stop.cancel()


__all__ = [
    "STOP_BACKOFF_SECONDS",
    "STOP_GRACE_SECONDS",
    "TRANSIENT",
    "Next",
    "PassLoop",
    "StopFlag",
    "Stopped",
]
