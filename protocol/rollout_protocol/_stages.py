"""The prepare's stages, from the waits participants declare (docs/design.md#44-order).

A prepare parks a caller's episodes while the callees it *waits* for still admit calls: a
wait-mode step (a non-idempotent tool call, a shielded final cleanup) must finish before its
episode parks, and it reaches a callee that must not be parked yet. A call made by a replay-mode
step needs nothing (the episode counts as parked at its previous boundary). So the only order a
prepare needs is "a role after every role that waits on it", and roles nobody orders may park at
once, in one stage.

A participant declares the roles it waits on in its status (`StatusReply.waits_on`, capability
`declared_waits`). One that declares nothing (an older SDK, NeMo Gym's dialect, a participant
that did not answer) is taken to wait on every role after it in `PREPARE_ORDER`: the four
stages, one role each, that every prepare made before declarations existed. A role's waits are
those of all its instances together.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Final

from ._wire import PREPARE_ORDER, Role

PrepareStages = tuple[tuple[Role, ...], ...]
"""Roles by stage: every instance of a stage's roles is prepared at once, stage after stage."""

SEQUENTIAL_STAGES: Final[PrepareStages] = tuple((role,) for role in PREPARE_ORDER)
"""One role per stage in `PREPARE_ORDER`: what nothing declared allows."""


def _undeclared(role: Role) -> frozenset[Role]:
    """What a role that declared nothing is taken to wait on: every role after it."""
    return frozenset(PREPARE_ORDER[PREPARE_ORDER.index(role) + 1 :])


def prepare_stages(declarations: Iterable[tuple[Role, Collection[Role] | None]]) -> PrepareStages:
    """The fewest stages in which each role comes after every role that waits on it, from one
    (role, waits) pair per participant (waits None: it declared nothing, see the module's
    docstring); a role's stage is the longest chain of waits that ends at it. Roles without a
    participant are in no stage, and waits on them are ignored. A cycle of waits has no order
    that parks everyone; it gets one role per stage in `PREPARE_ORDER`, as before declarations
    existed."""
    declared: dict[Role, frozenset[Role] | None] = {}
    for role, waits in declarations:
        known = declared.get(role, frozenset())
        declared[role] = None if waits is None or known is None else known | frozenset(waits)
    present = [role for role in PREPARE_ORDER if role in declared]
    edges = {
        role: ((_undeclared(role) if waits is None else waits) & frozenset(present)) - {role}
        for role, waits in declared.items()
    }
    waited_by = {role: [caller for caller in present if role in edges[caller]] for role in present}
    stage: dict[Role, int] = {}
    visiting: set[Role] = set()

    def stage_of(role: Role) -> int | None:
        """The role's stage, or None on a cycle of waits through it."""
        if role in stage:
            return stage[role]
        if role in visiting:
            return None
        visiting.add(role)
        callers = [stage_of(caller) for caller in waited_by[role]]
        visiting.discard(role)
        if None in callers:
            return None
        stage[role] = 1 + max((level for level in callers if level is not None), default=-1)
        return stage[role]

    if any(stage_of(role) is None for role in present):
        return tuple((role,) for role in present)
    return tuple(
        tuple(role for role in present if stage[role] == level)
        for level in range(1 + max(stage.values(), default=-1))
    )
