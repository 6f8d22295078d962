"""Who owns each field and condition of a RolloutSet's status
(docs/design.md#69-who-writes-the-sets-status).

Several flows write the set's status, one merge patch each; two that wrote the same field
would undo each other's work pass after pass. So every top-level field of `RolloutSetStatus`
and every condition type has exactly one owner, and `cluster.statuswriter.SetStatusWriter`,
the one writer of the set's status, refuses (`ForeignStatusWrite`) a write of anything the
writing flow does not own. The table is data so a unit test can hold it to the model.

One rule lends fields: while a recovery runs it owns the set's pods
(docs/design.md#62-recovery), so the recovery may write the set pass's attempt fields,
`participants` and health conditions (`LENT_TO_RECOVERY`) in a write on a set that records
a recovery (`status.recovery`), in one that starts or ends a recovery (it writes
`status.recovery`), or in one that stops recovering (`status.recoveryHold` written).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final

from .api import Condition, RolloutSetStatus, SetConditionType, dump


class StatusOwner(StrEnum):
    """The flows that write the set's status (a repair writes as the owner of what it repairs)."""

    SET_PASS = "set pass"
    RECOVERY = "recovery"
    POLICY = "policy"
    QUEUE = "queue"


_SET = StatusOwner.SET_PASS
_RECOVERY = StatusOwner.RECOVERY
_POLICY = StatusOwner.POLICY
_QUEUE = StatusOwner.QUEUE

FIELD_OWNERS: Final[Mapping[str, StatusOwner]] = MappingProxyType(
    {
        "observedGeneration": _SET,
        "attempt": _SET,
        "createdAttempt": _SET,
        "participants": _SET,
        "standby": _SET,
        "latestCheckpoint": _SET,
        "latestCheckpointTime": _SET,
        "recentCheckpointSeconds": _SET,
        "activeCheckpoint": _SET,
        "recovery": _RECOVERY,
        "lastRecovery": _RECOVERY,
        "restarts": _RECOVERY,
        "recoveryStarts": _RECOVERY,
        "recoveryHold": _RECOVERY,
        "saveReserveSeconds": _POLICY,
        "lastTrainerStep": _POLICY,
    }
)
"""Each top-level status field (its wire name) and its one owner; `conditions` is a list whose
entries are owned by type (`CONDITION_OWNERS`)."""

CONDITION_OWNERS: Final[Mapping[str, StatusOwner]] = MappingProxyType(
    {
        SetConditionType.READY.value: _SET,
        SetConditionType.PROGRESSING.value: _SET,
        SetConditionType.DEGRADED.value: _SET,
        SetConditionType.RECOVERING.value: _RECOVERY,
        SetConditionType.SUSPENDED.value: _POLICY,
        SetConditionType.DEADLINE_SAVED.value: _POLICY,
        SetConditionType.QUOTA_PENDING.value: _QUEUE,
        SetConditionType.PREEMPTED.value: _QUEUE,
    }
)
"""Each condition type of the set and its one owner."""

LENT_TO_RECOVERY: Final = frozenset(
    {
        "attempt",
        "createdAttempt",
        "participants",
        SetConditionType.READY.value,
        SetConditionType.PROGRESSING.value,
        SetConditionType.DEGRADED.value,
    }
)
"""What the set pass owns and the recovery writes while it runs: the pods of its target attempt
(`participants`), the health conditions while the set recovers (or stops recovering), and, in
the write that ends it, the attempt it brought up."""

CONDITIONS: Final = "conditions"


class ForeignStatusWrite(Exception):
    """A flow wrote a status field or condition it does not own: a bug in the operator, never
    a state of the cluster, so it is raised (and fails the test that found it), not dropped."""


def _conditions_by_type(conditions: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Conditions (models or their wire form) by type, in one form, to compare them."""
    parsed = (c if isinstance(c, Condition) else Condition.model_validate(c) for c in conditions)
    return {c.type: dump(c) for c in parsed}


def written_keys(current: RolloutSetStatus, changes: Mapping[str, Any]) -> set[str]:
    """The fields and condition types a write of `changes` (wire form) over `current` sets:
    every top-level key but `conditions`, and the types whose entry the new list adds, drops
    or changes (the list replaces the old one; an entry it carries over unchanged is no write)."""
    keys = {key for key in changes if key != CONDITIONS}
    if CONDITIONS in changes:
        before = _conditions_by_type(current.conditions)
        after = _conditions_by_type(changes[CONDITIONS] or [])
        keys |= {t for t in before.keys() | after.keys() if before.get(t) != after.get(t)}
    return keys


def recovery_holds(current: RolloutSetStatus, changes: Mapping[str, Any]) -> bool:
    """Whether the recovery holds the set for this write (`LENT_TO_RECOVERY`): the set records
    a recovery, or the write starts, ends or holds one (it carries `recovery`, a null
    included, or `recoveryHold`). A write that ends a recovery is judged by what it writes,
    not by the status under it: after a conflict it is written again over a status whose
    `recovery` someone may have removed meanwhile."""
    return (
        current.recovery is not None
        or "recovery" in changes
        or changes.get("recoveryHold") is not None
    )


def check_owner(owner: StatusOwner, current: RolloutSetStatus, changes: Mapping[str, Any]) -> None:
    """Raise `ForeignStatusWrite` unless `owner` owns everything the write sets."""
    foreign = []
    for key in sorted(written_keys(current, changes)):
        found = FIELD_OWNERS.get(key) or CONDITION_OWNERS.get(key)
        if found is owner:
            continue
        if owner is _RECOVERY and key in LENT_TO_RECOVERY and recovery_holds(current, changes):
            continue
        foreign.append(f"{key} (owner: {found or 'nobody'})")
    if foreign:
        raise ForeignStatusWrite(
            f"the {owner.value} wrote status it does not own: {', '.join(foreign)} "
            "(docs/design.md#69-who-writes-the-sets-status)"
        )


__all__ = [
    "CONDITION_OWNERS",
    "FIELD_OWNERS",
    "LENT_TO_RECOVERY",
    "ForeignStatusWrite",
    "StatusOwner",
    "check_owner",
    "recovery_holds",
    "written_keys",
]
