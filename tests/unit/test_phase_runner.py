"""The runner the checkpoint and the recovery flows share (`flows/phases.py`,
docs/design.md#612-phase-tables): the step of the current phase runs until no phase is left; a
step that returns None ends the run; the table's failure handler turns a step's error into the
object to go on with; a phase without a step is a bug said by name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType

import pytest
from rollout_operator.flows.phases import FailureHandler, PhaseTable, run_phases


class Phase(Enum):
    FIRST = "First"
    SECOND = "Second"
    RETRY = "Retry"


@dataclass(frozen=True)
class Thing:
    phase: Phase | None
    tries: int = 0


@dataclass
class Journal:
    ran: list[str] = field(default_factory=list)
    spans: list[str] = field(default_factory=list)


class Refused(Exception):
    pass


async def first(journal: Journal, thing: Thing) -> Thing:
    journal.ran.append("first")
    return replace(thing, phase=Phase.SECOND)


async def second(journal: Journal, thing: Thing) -> Thing:
    journal.ran.append("second")
    if thing.tries == 0:
        raise Refused("not yet")
    return replace(thing, phase=None)


async def retry(journal: Journal, thing: Thing) -> Thing | None:
    journal.ran.append("retry")
    return None if thing.tries > 2 else replace(thing, phase=Phase.SECOND)


async def on_refused(journal: Journal, thing: Thing, error: Exception) -> Thing:
    journal.ran.append(f"failed: {error}")
    return replace(thing, phase=Phase.RETRY, tries=thing.tries + 1)


def phase_of(journal: Journal, thing: Thing) -> Phase | None:
    return thing.phase


def span(journal: Journal, thing: Thing, phase: Phase) -> AbstractContextManager[object]:
    @contextmanager
    def spanned() -> Iterator[None]:
        journal.spans.append(phase.value)
        yield

    return spanned()


TABLE = PhaseTable[Phase, Journal, Thing](
    steps=MappingProxyType({Phase.FIRST: first, Phase.SECOND: second, Phase.RETRY: retry}),
    phase_of=phase_of,
    on_failure=FailureHandler(Refused, on_refused),
    span=span,
)


async def test_steps_run_in_their_phases_and_a_failed_step_goes_to_the_handler() -> None:
    journal = Journal()
    ended = await run_phases(TABLE, journal, Thing(Phase.FIRST))
    assert ended == Thing(None, tries=1)
    assert journal.ran == ["first", "second", "failed: not yet", "retry", "second"]
    assert journal.spans == ["First", "Second", "Retry", "Second"], "one span per step"


async def test_a_step_that_returns_none_ends_the_run() -> None:
    journal = Journal()
    assert await run_phases(TABLE, journal, Thing(Phase.RETRY, tries=3)) is None
    assert journal.ran == ["retry"]


async def test_an_object_with_no_phase_left_runs_nothing() -> None:
    journal = Journal()
    assert await run_phases(TABLE, journal, Thing(None)) == Thing(None)
    assert journal.ran == []


async def test_without_a_handler_a_steps_error_ends_the_run_and_a_missing_step_is_named() -> None:
    bare = PhaseTable[Phase, Journal, Thing](
        steps=MappingProxyType({Phase.SECOND: second}), phase_of=phase_of
    )
    with pytest.raises(Refused):
        await run_phases(bare, Journal(), Thing(Phase.SECOND))
    with pytest.raises(LookupError, match="no step for phase 'First'"):
        await run_phases(bare, Journal(), Thing(Phase.FIRST))
