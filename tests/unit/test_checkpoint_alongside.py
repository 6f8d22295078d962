"""`alongside`: the Committing status write runs while the participants commit."""

from __future__ import annotations

import anyio
import pytest
from rollout_operator.flows.checkpoint import CheckpointFailed, alongside


async def test_the_write_and_the_step_overlap_and_the_step_result_is_returned() -> None:
    write_started = anyio.Event()
    step_seen_write = anyio.Event()
    finished: list[str] = []

    async def write() -> None:
        write_started.set()
        with anyio.fail_after(5):
            await step_seen_write.wait()
        finished.append("write")

    async def step() -> str:
        with anyio.fail_after(5):
            await write_started.wait()  # the write is under way before the step returns
        step_seen_write.set()
        return "committed"

    assert await alongside(write(), step()) == "committed"
    assert finished == ["write"], "the write completes before alongside returns"


async def test_a_failed_step_wins_and_cancels_the_write() -> None:
    cancelled = anyio.Event()

    async def write() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    async def step() -> str:
        raise CheckpointFailed("CommitFailed", "environment-0: storage_failed")

    with pytest.raises(CheckpointFailed, match="storage_failed"):
        await alongside(write(), step())
    assert cancelled.is_set()


async def test_a_failed_write_is_raised_after_the_step() -> None:
    stepped: list[str] = []

    async def write() -> None:
        raise RuntimeError("status write refused")

    async def step() -> str:
        stepped.append("committed")
        return "committed"

    with pytest.raises(RuntimeError, match="status write refused"):
        await alongside(write(), step())
    assert stepped == ["committed"], "the step ran to completion first"
