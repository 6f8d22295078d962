"""What every step of the recovery shares: its reasons, waits and errors, the context a step
is given, and the pass a step adds its changes of the set's status to.

Every step is a function of a `RecoveryContext` and a `RecoveryPass` (the pass of the set's
loop it runs in: the set as the pass's snapshot shows it, with what the step changed so far),
and returns the pass, `status.recovery` in its next phase, or None when the recovery has
nothing left to do. A step writes no status itself: it adds its changes to the pass's draft
(`change`, `set_phase`: deltas of the recovery, `model/owners.py`), and the pass sends them in
its one write (`flows/stagedpass.py`, docs/design.md#60-layers); the transitions' Events are
posted after that write (docs/design.md#69-who-writes-the-sets-status).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from rollout_protocol import Coordinator, HttpParticipantClient

from ...cluster.kube import Kube
from ...cluster.objects import read_control_token
from ...cluster.statuswriter import PassStatus, SetDelta
from ...model.api import (
    RecoveryPhase,
    RecoveryStatus,
    RestoreVerdict,
    RolloutCheckpoint,
    RolloutSet,
    SetConditionType,
    namespace_or_default,
)
from ...model.conditions import ConditionUpdate, merge_conditions, truncate, utcnow
from ...model.owners import StatusOwner
from ...model.reasons import Reason
from ...model.settings import DEFAULT_RESTORE_FLOOR_SECONDS, DEFAULT_RETIRE_SECONDS

# One logger for the whole recovery, named as the flow (its lines read the same from every step).
logger = logging.getLogger(__package__)

POLL_SECONDS: Final = 0.5
MAX_BACKOFF_SECONDS: Final = 60.0
STOP_GRACE_SECONDS: Final = 1
"""Grace period for the pods of a lost attempt. Their episodes continue from the checkpoint
under the next attempt, so nothing of theirs is worth draining for; their GPUs are needed by
the replacement pods, and a survivor that kept working could report episodes the restore also
continues. (The servers turn unready on SIGTERM and keep serving until SIGKILL, so a long grace
would keep them busy for all of it.)"""

COUNT_RETIRE_SECONDS: Final = 5.0
"""How long a Recreate recovery waits for the pods it is about to delete to retire the lost
attempt, only so that they report the work it loses (`lastRecovery`); one that does not
answer by then is deleted anyway and its work is listed as uncounted."""


CHECKPOINT_RECORDS_INVALID: Final = RestoreVerdict.RECORDS_INVALID.value
"""Reason on a RolloutCheckpoint whose records failed verification at restore (Ready=False)."""
CHECKPOINT_RECORDS_UNREACHABLE: Final = RestoreVerdict.RECORDS_UNREACHABLE.value
"""Reason on a RolloutCheckpoint whose records a restoring participant could not find on its
storage (`records_unreachable`: the folder or manifest absent there; Ready=False)."""


@dataclass(frozen=True)
class RecoveryWaits:
    """The recovery's fixed waits, set by the operator's options (`model/settings.py`): how
    long the pods an InPlace recovery keeps may take to retire the lost attempt, and the least
    time a restore or resume call gets when the try's own deadline is nearer."""

    retire_seconds: float = DEFAULT_RETIRE_SECONDS
    restore_floor_seconds: float = DEFAULT_RESTORE_FLOOR_SECONDS


DEFAULT_WAITS: Final = RecoveryWaits()
"""The waits of a flow the operator's options did not set (the tests' flows)."""


class RecoveryFailed(Exception):
    """Ends a recovery with this reason and message; the message (which may quote what a
    participant said) is cut to `MAX_MESSAGE_CHARS`, as it goes into the set's status."""

    def __init__(self, reason: str, message: str) -> None:
        message = truncate(message)
        super().__init__(message)
        self.reason = reason
        self.message = message


class InPlaceRefused(Exception):
    """An InPlace recovery cannot keep its survivors safely; the try falls back to Recreate."""


CoordinatorFactory = Callable[
    [RolloutSet], Awaitable[tuple[Coordinator, list[HttpParticipantClient]]]
]
"""The coordinator over the set's participants, and the clients to close after it."""


@dataclass(frozen=True)
class RecoveryContext:
    """The operator's parts a recovery uses: the same for every step of every try."""

    kube: Kube
    clock: Callable[[], float]
    waits: RecoveryWaits
    coordinator: CoordinatorFactory


def recovery_of(rset: RolloutSet) -> RecoveryStatus:
    """The set's running recovery; a step runs only while there is one."""
    recovery = rset.status.recovery
    assert recovery is not None, "a recovery step runs only while status.recovery is set"
    return recovery


def phase_seconds_until(recovery: RecoveryStatus, now: datetime) -> dict[str, float]:
    """Seconds spent per phase, counting the current phase up to `now`."""
    spent = dict(recovery.phase_seconds)
    began = recovery.phase_started_at or recovery.started_at
    current = recovery.phase.value
    spent[current] = round(spent.get(current, 0.0) + max(0.0, (now - began).total_seconds()), 3)
    return spent


def try_deadline(rset: RolloutSet) -> float:
    """When this try's restoreTimeoutSeconds end (counted from `nextTryAt`, its start)."""
    recovery = recovery_of(rset)
    begun = (recovery.next_try_at or recovery.started_at).timestamp()
    return max(begun, 0.0) + rset.spec.recovery.restore_timeout_seconds


# --- the set's status, changed as the recovery -------------------------------------------------


Transition = tuple[str, str, bool]
"""A transition's Event: its reason, its message, whether a warning."""


class RecoveryPass:
    """What one pass of the set's loop does with the recovery: the pass's draft of the set's
    status (`PassStatus`), to which the step adds its changes as deltas of the recovery; the
    transitions whose Events follow the pass's write, and what else may only follow it; and,
    for a step that waits, when to look again (the pods' events wake the loop before that)."""

    def __init__(self, draft: PassStatus) -> None:
        self.draft = draft
        self.transitions: list[Transition] = []
        self.after_write: list[Callable[[], None]] = []
        self.retry_at: datetime | None = None

    @property
    def rset(self) -> RolloutSet:
        """The set as the pass read it, with the changes added so far."""
        return self.draft.rset

    def announce(self, reason: str, message: str, warn: bool) -> None:
        """The transition's Event, posted once the pass's write landed."""
        self.transitions.append((reason, message, warn))

    def look_again_at(self, when: datetime) -> None:
        """The step waits: the loop passes again at `when` (or at the set's next event)."""
        self.retry_at = when if self.retry_at is None else min(self.retry_at, when)


def change(
    run: RecoveryPass,
    changes: dict[str, Any],
    conditions: list[ConditionUpdate] | None = None,
    *,
    requeue: bool = True,
) -> RolloutSet:
    """Add `changes` and the `conditions` (merged over the set's as the pass left them) to the
    pass's draft as the recovery; `requeue`: the loop passes again at once after the write.
    Returns the set as the pass now shows it."""
    rset = run.rset
    if conditions:
        merged = merge_conditions(
            rset.status.conditions, conditions, observed_generation=rset.metadata.generation
        )
        changes = {**changes, "conditions": merged}
    run.draft.add(SetDelta(StatusOwner.RECOVERY, changes, requeue=requeue))
    return run.rset


def set_phase(run: RecoveryPass, phase: RecoveryPhase, **fields: Any) -> RolloutSet:
    """Enter `phase` (with `fields`), counting the time spent in the one it leaves."""
    recovery = recovery_of(run.rset)
    now = utcnow()
    spent = phase_seconds_until(recovery, now)
    updated = recovery.model_copy(
        update={"phase": phase, "phase_seconds": spent, "phase_started_at": now, **fields}
    )
    message = f"attempt {updated.from_attempt} -> {updated.target_attempt}: {phase.value}" + (
        f" (checkpoint {updated.checkpoint})" if updated.checkpoint else ""
    )
    rset = change(
        run,
        {"recovery": updated},
        [ConditionUpdate.of(SetConditionType.RECOVERING.value, True, phase.value, message)],
    )
    logger.info("set %s recovery: %s", rset.metadata.name, message)
    return rset


async def read_checkpoint(
    context: RecoveryContext, rset: RolloutSet, name: str
) -> RolloutCheckpoint | None:
    """The RolloutCheckpoint `name` of this set; None when there is none, or when the name
    is another set's (a name read from status may have been written by hand: the flow
    never restores, nor marks invalid, a checkpoint of another set)."""
    raw = await context.kube.get_checkpoint(namespace_or_default(rset.metadata.namespace), name)
    if raw is None:
        return None
    ckpt = RolloutCheckpoint.model_validate(raw)
    return ckpt if ckpt.spec.rollout_set == rset.metadata.name else None


async def http_coordinator(
    kube: Kube, rset: RolloutSet
) -> tuple[Coordinator, list[HttpParticipantClient]]:
    """The coordinator over every participant of the set's status, over HTTP."""
    token = await read_control_token(
        kube, namespace_or_default(rset.metadata.namespace), rset.metadata.name
    )
    if token is None:
        raise RecoveryFailed("TokenMissing", "the set's control-token Secret is missing")
    participants = [
        HttpParticipantClient(p.role, p.address, index=p.index, token=token)
        for p in rset.status.participants
        if p.address
    ]
    if len(participants) != len(rset.status.participants):
        raise RecoveryFailed(Reason.PODS_NOT_READY, "a replacement pod has no address")
    return Coordinator(participants), participants
