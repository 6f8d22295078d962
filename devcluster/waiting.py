"""Waiting on a condition with a deadline that fails loudly, for product code and tests alike.

A timeout names what was awaited and the last thing seen, because "timed out" alone sends people
to the logs for information the waiter already had.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")

logger = logging.getLogger(__name__)
"""Each wait that held says, at DEBUG, what and after how long: a test run with
`--log-file-level=DEBUG` shows where its time went (docs/kind.md, "Measured")."""


class WaitTimeout(TimeoutError):
    """The condition did not hold before the deadline."""


def _message(what: str, timeout: float, last: object, error: BaseException | None) -> str:
    text = f"timed out after {timeout:.1f} s waiting for {what}; last value: {last!r}"
    if error is not None:
        text += f"; last error: {type(error).__name__}: {error}"
    return text


def _held(what: str, started: float) -> None:
    logger.debug("held after %.1f s: %s", time.monotonic() - started, what)


async def wait_for(
    predicate: Callable[[], Awaitable[T | None]],
    timeout: float,  # noqa: ASYNC109 - a poll budget, not a cancellation timeout
    what: str,
    interval: float = 0.1,
    ignore: tuple[type[Exception], ...] = (),
) -> T:
    """Awaits `predicate()` until it returns something truthy, and returns that.

    Exceptions of the `ignore` types count as "not yet" (e.g. a 404 before an object exists); any
    other exception propagates at once.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            last = await predicate()
            if last:
                _held(what, deadline - timeout)
                return last
        except ignore as caught:
            error = caught
        if time.monotonic() >= deadline:
            raise WaitTimeout(_message(what, timeout, last, error))
        await anyio.sleep(interval)


def wait_for_sync(
    predicate: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.1,
    ignore: tuple[type[Exception], ...] = (),
) -> T:
    """The blocking twin of `wait_for`, for synchronous code and fixtures."""
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            value = predicate()
            last = value
            if value:
                _held(what, deadline - timeout)
                return value
        except ignore as caught:
            error = caught
        if time.monotonic() >= deadline:
            raise WaitTimeout(_message(what, timeout, last, error))
        time.sleep(interval)
