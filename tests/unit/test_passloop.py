"""The per-set loops stop by themselves: a RolloutSet deleted (or the operator exiting) must not
leave Kopf to cancel the `reconcile` and `policy` daemons, which it logs as "cancelled. Will
escalate." after `cancellation_backoff`.

The stop flag is Kopf's own (`DaemonStopper` and the `stopped` waiter handed to daemons), so
these tests exercise the object the daemons get in the operator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
import anyio.lowlevel
import kopf
import pytest
from kopf._core.intents.stoppers import DaemonStopper, DaemonStoppingReason
from rollout_operator.cluster.kube import Kube
from rollout_operator.flows.passloop import STOP_BACKOFF_SECONDS, PassLoop, Stopped
from rollout_operator.handlers import policy as policy_handlers
from rollout_operator.handlers import rolloutset as set_handlers
from rollout_operator.handlers.runtime import MEMO_KUBE
from testsupport.fakecluster import FakeCluster

PROMPT_SECONDS = 1.0
"""A stop is honoured well inside this (the loop waits on the flag itself, it does not poll)."""


def stopper() -> tuple[DaemonStopper, kopf.DaemonStopped]:
    flag = DaemonStopper()
    return flag, cast(kopf.DaemonStopped, flag.async_waiter)


async def started(task: asyncio.Future[Any]) -> None:
    """Let a task just created run to its first wait: one turn of the loop, whose ready queue
    is first in, first out (a scheduling step, not a timed wait)."""
    await anyio.lowlevel.checkpoint()
    assert not task.done(), "the task ended instead of waiting"


async def until(condition: Callable[[], bool], what: str) -> None:
    """Yield to other tasks until `condition` holds; fail at the deadline."""
    with anyio.fail_after(PROMPT_SECONDS):
        while not condition():
            await anyio.lowlevel.checkpoint()
    assert condition(), what


async def returns_within(seconds: float, task: asyncio.Future[Any]) -> float:
    """The task's own completion time (it must finish, not be cancelled by us)."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    done, _ = await asyncio.wait([task], timeout=seconds)
    assert task in done, f"still running {seconds}s after the stop"
    task.result()  # re-raises whatever it ended with
    return loop.time() - began


# --- PassLoop -------------------------------------------------------------------------------


async def test_sleep_ends_at_the_stop_and_leaves_no_waiters_behind() -> None:
    flag, stopped = stopper()
    waits = PassLoop(stopped)
    before = len(asyncio.all_tasks())
    sleeping = asyncio.ensure_future(waits.sleep(3600.0))
    await started(sleeping)
    flag.set(reason=DaemonStoppingReason.RESOURCE_DELETED)
    await returns_within(PROMPT_SECONDS, sleeping)
    assert waits.stopped
    # Each sleep waits on the flag through a helper task; it must go with the sleep.
    await until(lambda: len(asyncio.all_tasks()) == before, "no waiter left behind")


async def test_a_backoff_ignores_wakes_but_not_the_stop() -> None:
    flag, stopped = stopper()
    waits = PassLoop(stopped)
    backoff = asyncio.ensure_future(waits.sleep(3600.0, wakeable=False))
    waits.wake.set()
    done, _ = await asyncio.wait([backoff], timeout=0.2)
    assert not done, "a wake ended the backoff"
    flag.set(reason=DaemonStoppingReason.OPERATOR_EXITING)
    await returns_within(PROMPT_SECONDS, backoff)


async def test_a_wake_ends_a_wakeable_sleep() -> None:
    _, stopped = stopper()
    waits = PassLoop(stopped)
    sleeping = asyncio.ensure_future(waits.sleep(3600.0))
    await started(sleeping)
    waits.wake.set()
    await returns_within(PROMPT_SECONDS, sleeping)
    assert not waits.stopped


async def test_a_pass_under_way_at_the_stop_finishes_within_the_grace() -> None:
    flag, stopped = stopper()
    waits = PassLoop(stopped, grace_seconds=5.0)
    release = asyncio.Event()
    saw_stop = asyncio.Event()

    async def work() -> str:
        await stopped.wait()  # the pass is under way when the stop comes
        saw_stop.set()
        await release.wait()
        return "written"

    running = asyncio.ensure_future(waits.run(work()))
    await started(running)
    flag.set(reason=DaemonStoppingReason.RESOURCE_DELETED)
    await asyncio.wait_for(saw_stop.wait(), timeout=PROMPT_SECONDS)
    release.set()
    await returns_within(PROMPT_SECONDS, running)
    # a pass cut short at the stop would end in `Stopped`, not with its own result
    assert running.result() == "written"


async def test_a_pass_still_running_after_the_grace_is_cancelled() -> None:
    flag, stopped = stopper()
    waits = PassLoop(stopped, grace_seconds=0.1)
    cancelled = asyncio.Event()

    async def stuck() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    running = asyncio.ensure_future(waits.run(stuck()))
    await started(running)
    flag.set(reason=DaemonStoppingReason.RESOURCE_DELETED)
    done, _ = await asyncio.wait([running], timeout=PROMPT_SECONDS)
    assert running in done
    with pytest.raises(Stopped):
        running.result()
    assert cancelled.is_set()


async def test_a_pass_error_propagates_unchanged() -> None:
    _, stopped = stopper()
    waits = PassLoop(stopped)

    async def failing() -> None:
        raise TimeoutError("API server slow")

    with pytest.raises(TimeoutError, match="API server slow"):
        await waits.run(failing())


# --- the daemons ------------------------------------------------------------------------------


class DeletingSets(Kube):
    """Every read finds the set being deleted: each pass is a no-op, as right after a delete."""

    def __init__(self) -> None:
        super().__init__(http=FakeCluster())
        self.reads = 0
        self.read = asyncio.Event()

    async def get_set(
        self, namespace: str, name: str, *, fresh: bool = False
    ) -> dict[str, Any] | None:
        self.reads += 1
        self.read.set()
        return {"metadata": {"name": name, "deletionTimestamp": "2026-11-29T12:00:00Z"}}


Daemon = Callable[..., Awaitable[None]]
DAEMONS: list[tuple[str, Daemon]] = [
    ("reconcile", set_handlers.reconcile_loop),
    ("policy", policy_handlers.policy_loop),
]


def cancellation_backoff(handler_id: str) -> float:
    """What the daemon is registered with (Kopf cancels it only after this long)."""
    registry = kopf.get_default_registry()
    handlers = registry._spawning.get_all_handlers()
    (handler,) = [h for h in handlers if h.id == handler_id]
    backoff = handler.cancellation_backoff
    assert backoff is not None, f"daemon {handler_id!r} has no cancellation_backoff"
    return float(backoff)


@pytest.mark.parametrize(("handler_id", "daemon"), DAEMONS, ids=[d[0] for d in DAEMONS])
async def test_an_idle_daemon_returns_by_itself_when_the_set_is_deleted(
    handler_id: str, daemon: Daemon
) -> None:
    backoff = cancellation_backoff(handler_id)
    assert backoff == STOP_BACKOFF_SECONDS
    kube = DeletingSets()
    memo = kopf.Memo()
    memo[MEMO_KUBE] = kube
    flag, stopped = stopper()
    running = asyncio.ensure_future(
        daemon(
            namespace="team",
            name="math-rl",
            memo=memo,
            logger=_logger(),
            stopped=stopped,
        )
    )
    await asyncio.wait_for(kube.read.wait(), timeout=5.0)  # a pass ran; now it sleeps
    flag.set(reason=DaemonStoppingReason.RESOURCE_DELETED)
    took = await returns_within(backoff, running)
    assert took < PROMPT_SECONDS


@pytest.mark.parametrize(("handler_id", "daemon"), DAEMONS, ids=[d[0] for d in DAEMONS])
async def test_a_daemon_backing_off_returns_by_itself_when_the_operator_exits(
    handler_id: str, daemon: Daemon
) -> None:
    """Without a client every pass fails (`kopf.TemporaryError`): the loop is in its backoff."""
    backoff = cancellation_backoff(handler_id)
    flag, stopped = stopper()
    failed = asyncio.Event()
    logger = _logger(on_warning=failed.set)
    running = asyncio.ensure_future(
        daemon(namespace="team", name="math-rl", memo=kopf.Memo(), logger=logger, stopped=stopped)
    )
    await asyncio.wait_for(failed.wait(), timeout=5.0)
    flag.set(reason=DaemonStoppingReason.OPERATOR_EXITING)
    took = await returns_within(backoff, running)
    assert took < PROMPT_SECONDS


def _logger(on_warning: Callable[[], None] | None = None) -> Any:
    """A logger like Kopf's (an adapter) that tells the test when the loop warned."""

    class Recording(logging.LoggerAdapter[logging.Logger]):
        def warning(self, msg: object, *args: object, **kwargs: Any) -> None:
            super().warning(msg, *args, **kwargs)
            if on_warning is not None:
                on_warning()

    return Recording(logging.getLogger("test.passloop"), {})
