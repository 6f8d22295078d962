"""The runner the checkpoint and the recovery flows share: a table of phase steps.

Both flows persist a phase in their object's status before they act, so an operator that
restarts continues where the last one stopped (docs/design.md#61-checkpoint,
docs/design.md#62-recovery). Each flow declares a `PhaseTable`: which phase an object is in
now (`phase_of`, read from its status and, for the checkpoint, from what this run has done in
memory), and one step per phase, a function of the flow's context and the object that returns
the object as it left it. `run_step` switches on the phase in one place and runs its step once
(the recovery: one phase per pass of the set's loop); `run_phases` runs steps until none is
left (the checkpoint). A step writes the phase that follows it (the recovery's object is the
pass of the set's loop, whose one write carries it); the table decides nothing else.

A step may end the run by returning None (the object is gone, or needs a person); a table may
name an exception type that a step raises to end only its try (`on_failure`: the recovery's
failed try backs off and runs again).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

PhaseT = TypeVar("PhaseT", bound=Enum)
ContextT = TypeVar("ContextT")
ObjectT = TypeVar("ObjectT")

Step = Callable[[ContextT, ObjectT], Awaitable[ObjectT | None]]
"""One phase's work: from the flow's context and the object to the object as the step left it
(its next phase written), or None when the flow has nothing left to do."""


@dataclass(frozen=True)
class FailureHandler(Generic[ContextT, ObjectT]):
    """What a step's `error` (an instance of `catches`) turns into: the object to go on with
    (its phase written by `handle`), or None to stop."""

    catches: type[Exception]
    handle: Callable[[ContextT, ObjectT, Exception], Awaitable[ObjectT | None]]


def _no_span(context: object, obj: object, phase: Enum) -> AbstractContextManager[object]:
    return nullcontext()


@dataclass(frozen=True)
class PhaseTable(Generic[PhaseT, ContextT, ObjectT]):
    """A flow's phases: the step of each, and which phase an object is in now.

    `phase_of` returns None when nothing is left to run. `span` wraps each step (and the
    failure handling of its error) in a trace span, when the flow traces per phase.
    """

    steps: Mapping[PhaseT, Step[ContextT, ObjectT]]
    phase_of: Callable[[ContextT, ObjectT], PhaseT | None]
    on_failure: FailureHandler[ContextT, ObjectT] | None = None
    span: Callable[[ContextT, ObjectT, PhaseT], AbstractContextManager[object]] = _no_span

    def step(self, phase: PhaseT) -> Step[ContextT, ObjectT]:
        """The step of `phase`; a phase without one is a bug in the table."""
        try:
            return self.steps[phase]
        except KeyError:
            raise LookupError(f"no step for phase {phase.value!r}") from None


async def run_step(
    table: PhaseTable[PhaseT, ContextT, ObjectT], context: ContextT, obj: ObjectT
) -> ObjectT | None:
    """Run the step of the object's phase once (a flow that advances one phase per pass of its
    loop); the object as the step left it, its next phase written, or None when the step
    ended the flow. An object in no phase is returned as it is."""
    phase = table.phase_of(context, obj)
    if phase is None:
        return obj
    step = table.step(phase)
    with table.span(context, obj, phase):
        if table.on_failure is None:
            return await step(context, obj)
        try:
            return await step(context, obj)
        except table.on_failure.catches as error:
            # The try ends; the handler goes on from the object as the step found it.
            return await table.on_failure.handle(context, obj, error)


async def run_phases(
    table: PhaseTable[PhaseT, ContextT, ObjectT], context: ContextT, obj: ObjectT
) -> ObjectT | None:
    """Run the step of the object's phase until no phase is left (or a step returns None);
    the object as the last step left it."""
    current: ObjectT | None = obj
    while current is not None:
        if table.phase_of(context, current) is None:
            return current
        current = await run_step(table, context, current)
    return None
