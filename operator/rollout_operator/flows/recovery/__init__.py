"""Pod-loss recovery (docs/design.md#62-recovery): fresh pods under attempt + 1, restore, resume,
as a table of phase steps.

`detect_loss` says whether the set's current attempt lost a participant (a pod that failed,
was deleted, or sits on a node that is NotReady). `RecoveryFlow.step` then drives
`status.recovery` through its phases, one per pass of the set's loop, each added to the pass's
one write (`context.RecoveryPass`), so an operator restart continues the recovery instead of
starting a second one:

    StoppingAttempt -> StartingPods -> Restoring -> Resuming -> (done: attempt = target)
    a failed try: BackingOff -> StoppingAttempt (target + 1) ...

Restore is all or nothing (the coordinator retires the target attempt everywhere when any
participant fails), so a failed try cannot reuse its pods: the next try runs under a newer
attempt, after a backoff, at most `recovery.maxRestarts` times.

`restorePolicy: Recreate` replaces every pod in StoppingAttempt. `InPlace` (see
`decide/inplace.py`) replaces only the lost ones there: the kept pods retire the lost attempt
and are relabelled to the target attempt, and the restore re-wires kept callers whose callee
was replaced. When that cannot be done safely (nothing survived, the spec changed, a kept pod
refuses to retire) the try falls back to Recreate, with reason `InPlaceFallback` on the
Recovering condition and an Event; a failed InPlace try is followed by Recreate tries.

One module per group of phases, each step a function of a `context.RecoveryContext` and the
set: `start` (the loss recorded, or held by churn), `stopping` (StoppingAttempt), `pods`
(StartingPods), `restore` (Restoring, Resuming), `backoff` (BackingOff and a failed try);
`loss` (what is lost), `repair` (a recovery written or removed by hand); `flow` holds the table,
`RecoveryFlow` and `recover_if_needed`. This package's names are the flow's public surface.
"""

from __future__ import annotations

from .context import (
    CHECKPOINT_RECORDS_INVALID,
    CHECKPOINT_RECORDS_UNREACHABLE,
    InPlaceRefused,
    RecoveryContext,
    RecoveryFailed,
    RecoveryWaits,
    phase_seconds_until,
)
from .flow import PHASES, RecoveryFlow, RecoveryLook, recover_if_needed, start_resume
from .loss import Loss, detect_loss, find_losses, observe
from .repair import RECOVERY_RESTARTED, repair_false_recovery, repair_unfinished_recovery
from .restore import counts_as_restart
from .stopping import finished_from, reported_losses

__all__ = [
    "CHECKPOINT_RECORDS_INVALID",
    "CHECKPOINT_RECORDS_UNREACHABLE",
    "PHASES",
    "RECOVERY_RESTARTED",
    "InPlaceRefused",
    "Loss",
    "RecoveryContext",
    "RecoveryFailed",
    "RecoveryFlow",
    "RecoveryLook",
    "RecoveryWaits",
    "counts_as_restart",
    "detect_loss",
    "find_losses",
    "finished_from",
    "observe",
    "phase_seconds_until",
    "recover_if_needed",
    "repair_false_recovery",
    "repair_unfinished_recovery",
    "reported_losses",
    "start_resume",
]
