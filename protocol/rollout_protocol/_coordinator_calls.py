"""How the coordinator (`_coordinator.py`) calls its participants: every participant of a stage
at once, each failure a value so that the others still finish (`FanOut`), and the replies and
failures read back in participant order (`split`).

Held apart from the `Coordinator`, which owns one `FanOut` for its lifetime: the fan-out keeps
the one piece of state a coordinator has, the participants that missed a call's deadline, which
every later call waits for only briefly.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar

import anyio

from ._client import ParticipantClient, ParticipantError
from ._coordinator_outcomes import Failure
from ._wire import ErrorCode

logger = logging.getLogger(f"{__package__}._coordinator")
"""The coordinator's one logger (`rollout_protocol._coordinator`)."""

_T = TypeVar("_T")

_MISSED: Final = frozenset({ErrorCode.UNRESPONSIVE, ErrorCode.UNREACHABLE})
"""Failures that mean a call's deadline passed without an answer."""


class FanOut:
    """Calls participants at once; remembers those that missed a deadline."""

    def __init__(self, missed_call_seconds: float) -> None:
        self._missed_call_seconds = missed_call_seconds
        self._missed: set[str] = set()
        """Participants that did not answer by a call's deadline (hung, frozen, gone): every
        later call of this coordinator waits for them `missed_call_seconds` at most, so an
        abort or a cleanup after a failed restore never waits a whole call timeout again on
        the participant that caused it."""

    async def __call__(
        self,
        participants: Sequence[ParticipantClient],
        call: Callable[[ParticipantClient], Awaitable[_T]],
    ) -> dict[str, _T | ParticipantError]:
        """Call every participant at once; a failure is a value, so the others still finish."""
        results: dict[str, _T | ParticipantError] = {}

        async def one(participant: ParticipantClient) -> None:
            instance = participant.instance
            try:
                results[instance] = await self._call_bounded(participant, call)
            except ParticipantError as error:
                results[instance] = error
                if error.code in _MISSED:
                    self._missed.add(instance)
            except Exception as error:
                logger.exception("call to %s failed unexpectedly", instance)
                results[instance] = ParticipantError(
                    ErrorCode.INTERNAL, f"{type(error).__name__}: {error}", instance
                )

        async with anyio.create_task_group() as group:
            for participant in participants:
                group.start_soon(one, participant)
        return results

    async def _call_bounded(
        self, participant: ParticipantClient, call: Callable[[ParticipantClient], Awaitable[_T]]
    ) -> _T:
        """The call; for a participant that already missed a deadline here, cut at
        `missed_call_seconds`."""
        if participant.instance not in self._missed:
            return await call(participant)
        with anyio.move_on_after(self._missed_call_seconds):
            return await call(participant)
        raise ParticipantError(
            ErrorCode.UNRESPONSIVE,
            f"no answer within {self._missed_call_seconds:g}s (it already missed a deadline of "
            "this checkpoint or recovery, so it is not waited for in full again)",
            participant.instance,
        )


def split(
    participants: Sequence[ParticipantClient], results: dict[str, _T | ParticipantError]
) -> tuple[list[_T], list[Failure]]:
    """Replies and failures in participant order (stable output for people and tests)."""
    replies: list[_T] = []
    failures: list[Failure] = []
    for participant in participants:
        result = results[participant.instance]
        if isinstance(result, ParticipantError):
            failures.append(Failure.of(result))
        else:
            replies.append(result)
    return replies, failures
