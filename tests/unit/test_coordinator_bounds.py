"""A participant that missed one deadline is not waited for in full again by the same flow.

The coordinator remembers who did not answer by a call's deadline (hung, frozen, gone) and cuts
its later calls at `missed_call_seconds`: the cleanup after a failed restore (retire, then
resume everyone) and an abort's resume would otherwise each wait a whole call timeout on the
participant that caused them (a recovery try with `restoreTimeoutSeconds: 60` took
134 s that way). The participants here are fakes named as such: `Answering` replies at once,
`Frozen` never answers and gives up at each call's deadline as `HttpParticipantClient` does.
"""

from __future__ import annotations

import time

import anyio
import pytest
from rollout_protocol import (
    Coordinator,
    ErrorCode,
    ParticipantError,
    Phase,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    Role,
)

pytestmark = pytest.mark.unit

CALL_TIMEOUT = 30.0
"""The coordinator's per-call time for its cleanup calls: far beyond the test's own bound."""
MISSED_CALL_SECONDS = 0.2
WAIT = 10.0
"""Upper bound for the whole scenario; reaching it is a failure (the bound did not hold)."""


class Answering:
    """A participant that restores, retires and resumes at once (a fake)."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.instance = f"{role.value}-0"
        self.calls: list[str] = []

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        self.calls.append("restore")
        return RestoreReply(
            checkpoint_id=request.checkpoint_id,
            phase=Phase.RESTORED,
            attempt=request.attempt,
            restored=[],
            record_count=0,
        )

    async def retire(self, request: RetireRequest) -> RetireReply:
        self.calls.append("retire")
        return RetireReply(operation_id=request.operation_id, retired=[])

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        self.calls.append("resume")
        return ResumeReply(checkpoint_id=request.checkpoint_id, phase=Phase.IDLE)


class Frozen:
    """A participant that never answers (a SIGSTOPped process, a fake): each call gives up
    at its deadline as `HttpParticipantClient` does."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.instance = f"{role.value}-0"
        self.calls: list[str] = []

    async def _hang(self, operation: str, deadline_ts: float) -> None:
        self.calls.append(operation)
        with anyio.move_on_after(max(deadline_ts - time.time(), 0.0)):
            await anyio.Event().wait()  # never set: no answer comes
        raise ParticipantError(
            ErrorCode.UNRESPONSIVE, f"{operation}: no answer by its deadline", self.instance
        )

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        await self._hang("restore", request.deadline_ts)
        raise AssertionError("unreachable")

    async def retire(self, request: RetireRequest) -> RetireReply:
        await self._hang("retire", request.deadline_ts)
        raise AssertionError("unreachable")

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        await self._hang("resume", request.deadline_ts)
        raise AssertionError("unreachable")


async def test_the_cleanup_after_a_failed_restore_does_not_wait_again_on_the_frozen() -> None:
    model, frozen = Answering(Role.MODEL), Frozen(Role.ENVIRONMENT)
    coordinator = Coordinator(
        [model, frozen],  # type: ignore[list-item]  # fakes of the calls a restore makes
        call_timeout=CALL_TIMEOUT,
        missed_call_seconds=MISSED_CALL_SECONDS,
    )
    with anyio.fail_after(WAIT):  # without the bound, the retire alone waits CALL_TIMEOUT
        outcome = await coordinator.restore("ck-1", 2, time.time() + 0.3)
    assert not outcome.ok
    assert [(f.instance, f.code) for f in outcome.failures] == [
        ("environment-0", ErrorCode.UNRESPONSIVE)
    ]
    assert model.calls == ["restore", "retire", "resume"], "the healthy one is cleaned up"
    assert frozen.calls == ["restore", "retire", "resume"], "the frozen one is still asked"
    assert outcome.retired is not None
    assert outcome.resumed is not None
    for cut in (*outcome.retired.failures, *outcome.resumed.failures):
        assert cut.instance == "environment-0"
        assert cut.code is ErrorCode.UNRESPONSIVE
        assert "already missed a deadline" in cut.detail


async def test_a_participant_that_answers_is_never_cut() -> None:
    healthy = Answering(Role.MODEL)
    coordinator = Coordinator(
        [healthy],  # type: ignore[list-item]  # a fake of the calls made here
        missed_call_seconds=MISSED_CALL_SECONDS,
    )
    with anyio.fail_after(WAIT):
        outcome = await coordinator.restore("ck-1", 2, time.time() + 5)
        resumed = await coordinator.resume("ck-1", time.time() + 5)
    assert outcome.ok
    assert resumed.failures == []
