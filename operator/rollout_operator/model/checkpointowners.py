"""Who may write a RolloutCheckpoint's status, and when (docs/design.md#61-checkpoint).

Three flows write a checkpoint's status, each through the one writer
(`cluster.checkpointstatus.CheckpointStatusWriter`), and each only while the checkpoint is in
the phases it owns, so two of them never undo each other's write:

- the checkpoint's own flow (`CheckpointOwner.FLOW`) owns the whole status until the
  checkpoint is finished: every phase up to and including its terminal Ready or Failed write;
- the restore's verdict (`CheckpointOwner.VERDICT`, the recovery) writes only `phase` and the
  `Ready` and `Failed` conditions, and only on a finished checkpoint (a Ready one whose records
  a restore refused);
- the Failed-checkpoint repair (`CheckpointOwner.REPAIR`, the policy pass) writes a Ready status
  back, only on a finished checkpoint (one whose status says Failed although every participant
  committed its records).

The table is data so a unit test can hold it to the model; `check_checkpoint_owner` raises
`ForeignCheckpointWrite` for a write outside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final

from .api import (
    CHECKPOINT_FINISHED,
    CheckpointConditionType,
    CheckpointPhase,
    RolloutCheckpointStatus,
    dump,
)


class CheckpointOwner(StrEnum):
    """The flows that write a checkpoint's status."""

    FLOW = "checkpoint flow"
    VERDICT = "restore verdict"
    REPAIR = "failed-checkpoint repair"


_UNFINISHED: Final = frozenset({None, *CheckpointPhase} - CHECKPOINT_FINISHED)
ALL_FIELDS: Final = frozenset(
    field.alias or name for name, field in RolloutCheckpointStatus.model_fields.items()
)

OWNED_PHASES: Final[Mapping[CheckpointOwner, frozenset[CheckpointPhase | None]]] = MappingProxyType(
    {
        CheckpointOwner.FLOW: _UNFINISHED,
        CheckpointOwner.VERDICT: CHECKPOINT_FINISHED,
        CheckpointOwner.REPAIR: CHECKPOINT_FINISHED,
    }
)
"""The stored phases over which each owner may write (None: no phase yet, or reset)."""

OWNED_FIELDS: Final[Mapping[CheckpointOwner, frozenset[str]]] = MappingProxyType(
    {
        CheckpointOwner.FLOW: ALL_FIELDS,
        CheckpointOwner.VERDICT: frozenset({"phase", "conditions"}),
        CheckpointOwner.REPAIR: ALL_FIELDS,
    }
)
"""The status fields (wire names) each owner may write."""

OWNED_CONDITIONS: Final[Mapping[CheckpointOwner, frozenset[str] | None]] = MappingProxyType(
    {
        CheckpointOwner.FLOW: None,
        CheckpointOwner.VERDICT: frozenset(
            {CheckpointConditionType.READY.value, CheckpointConditionType.FAILED.value}
        ),
        CheckpointOwner.REPAIR: None,
    }
)
"""The condition types each owner may change (None: every type)."""


class ForeignCheckpointWrite(Exception):
    """A write of a checkpoint's status by a flow that does not own it now: a bug."""


def check_checkpoint_owner(
    owner: CheckpointOwner, stored: RolloutCheckpointStatus, body: Mapping[str, Any]
) -> None:
    """Raise `ForeignCheckpointWrite` unless `owner` may write `body` (the wire status patch)
    over the status as stored (`stored`)."""
    if stored.phase not in OWNED_PHASES[owner]:
        raise ForeignCheckpointWrite(
            f"{owner} does not write a checkpoint in phase {stored.phase or 'unset'}"
        )
    foreign = set(body) - OWNED_FIELDS[owner]
    if foreign:
        raise ForeignCheckpointWrite(f"{owner} does not own {sorted(foreign)}")
    types = OWNED_CONDITIONS[owner]
    if types is None or "conditions" not in body:
        return
    before = {c.type: dump(c) for c in stored.conditions}
    after = {c["type"]: c for c in body["conditions"] or []}
    changed = {t for t in before.keys() | after.keys() if before.get(t) != after.get(t)}
    if changed - types:
        raise ForeignCheckpointWrite(
            f"{owner} does not own the conditions {sorted(changed - types)}"
        )


__all__ = [
    "OWNED_CONDITIONS",
    "OWNED_FIELDS",
    "OWNED_PHASES",
    "CheckpointOwner",
    "ForeignCheckpointWrite",
    "check_checkpoint_owner",
]
