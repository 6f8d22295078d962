"""Run a long protocol step while watching that what it depends on still holds.

A checkpoint's prepare or commit, and a recovery's restore, call participants with deadlines
of minutes; a participant pod lost meanwhile would keep the step waiting for a dead pod until
that deadline. `while_holding` runs the step beside a watch that looks again whenever `pause`
returns (an event of the set, or a timer), and cancels the step as soon as the watch says why
it cannot succeed any more.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

_T = TypeVar("_T")


class NoLongerHolds(Exception):
    """The watched condition broke while the step ran; the message says how."""


async def while_holding(
    step: Callable[[], Awaitable[_T]],
    broken: Callable[[], Awaitable[str | None]],
    pause: Callable[[], Awaitable[None]],
) -> _T:
    """The step's result, or `NoLongerHolds` with the first reason `broken` gave (the step is
    cancelled then). `broken` runs only after a `pause`, never before the step starts."""
    why: list[str] = []
    results: list[_T] = []

    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while True:
                await pause()
                reason = await broken()
                if reason is not None:
                    why.append(reason)
                    group.cancel_scope.cancel()
                    return

        async def work() -> None:
            results.append(await step())
            group.cancel_scope.cancel()

        group.start_soon(watch)
        group.start_soon(work)
    if why:
        raise NoLongerHolds(why[0])
    return results[0]
