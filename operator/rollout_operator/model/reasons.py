"""The reasons of the conditions and Events the operator writes (CamelCase, stable: they are part
of the API, and alerts and scripts match them; docs/api.md). One vocabulary for both resources,
grouped by the condition that carries them."""

from __future__ import annotations

from typing import Final


class Reason:
    """Condition and Event reasons of a RolloutSet and of a RolloutCheckpoint."""

    # RolloutSet: Ready, Progressing and Degraded (the set's pass, `decide.setplan`)
    ALL_READY: Final = "AllParticipantsReady"
    STARTING: Final = "PodsStarting"
    NOT_STARTING: Final = "PodsNotStarting"
    FAILED: Final = "PodsFailed"
    LOST: Final = "PodsLost"
    CREATE_FAILED: Final = "PodCreationFailed"
    SPEC_CHANGE_REFUSED: Final = "SpecChangeRefused"
    SUSPENDED: Final = "Suspended"
    AS_EXPECTED: Final = "AsExpected"
    ATTEMPT_READY: Final = "AttemptReady"
    DEADLINE_EXCEEDED: Final = "ProgressDeadlineExceeded"
    RECOVERY_LIMIT: Final = "RecoveryLimitReached"
    """Participants were lost too often: recovery stopped (`churn`)."""

    # RolloutSet: Recovering (the recovery, `flows.recovery`; RECOVERY_LIMIT above too)
    POD_FAILED: Final = "PodFailed"
    POD_DELETED: Final = "PodDeleted"
    NODE_LOST: Final = "NodeLost"
    RECOVERED: Final = "Recovered"
    RESTORED: Final = "Restored"
    NO_CHECKPOINT: Final = "NoCheckpoint"
    SIBLING_RESTART: Final = "SiblingRestart"
    RESTORE_FAILED: Final = "RestoreFailed"
    PODS_NOT_READY: Final = "ReplacementPodsNotReady"
    RESTARTS_EXHAUSTED: Final = "MaxRestartsExceeded"
    IN_PLACE_FALLBACK: Final = "InPlaceFallback"
    REPLACEMENT_LOST: Final = "ReplacementPodLost"
    CHECKPOINT_INVALID: Final = "CheckpointInvalid"
    """The restored checkpoint's records failed verification: the next try restores an older
    Ready checkpoint, or starts fresh."""
    CHECKPOINT_UNREACHABLE: Final = "CheckpointUnreachable"
    """A participant found no records of the restored checkpoint on the storage it sees (they
    were on a volume only a lost node had): the next try restores an older Ready checkpoint,
    or starts fresh, instead of waiting for that storage to come back."""

    # RolloutSet: DeadlineSaved (the checkpoint policy, `decide.policy`)
    WAITING: Final = "Waiting"
    SAVING: Final = "Saving"
    SAVED: Final = "Saved"
    MISSED: Final = "Missed"
    CHECKPOINT_FAILED: Final = "CheckpointFailed"
    NOTHING_TO_SAVE: Final = "NothingToSave"
    NO_DEADLINE: Final = "NoDeadline"
    # RolloutSet: Suspended (the checkpoint policy; SUSPENDED above too)
    SUSPENDING: Final = "Suspending"
    DEADLINE_REACHED: Final = "DeadlineReached"
    RESUMED: Final = "Resumed"
    """Also the recovery's reason of a resume from suspend (it is not a loss)."""
    SUSPEND_CANCELLED: Final = "SuspendCancelled"
    # the checkpoint policy's Events on a RolloutSet
    INVALID_TRAINER_STEP: Final = "InvalidTrainerStep"
    TRAINER_STEP_IGNORED: Final = "TrainerStepIgnored"

    # RolloutSet: QuotaPending and Preempted (`decide.queue`; SAVING above too)
    ADMITTED: Final = "Admitted"
    PENDING: Final = "Pending"
    WORKLOAD_CREATED: Final = "WorkloadCreated"
    PRIORITY_CLASS_NOT_FOUND: Final = "PriorityClassNotFound"
    READMITTED: Final = "Readmitted"

    # RolloutCheckpoint: its conditions (the checkpoint flow, `flows.checkpoint`)
    QUEUED: Final = "Queued"
    PREPARING: Final = "Preparing"
    PREPARED: Final = "AllParked"
    NOT_PARKED: Final = "PrepareTimeout"
    COMMITTED: Final = "RecordsWritten"
    PUBLISHED: Final = "Published"
    SET_NOT_FOUND: Final = "SetNotFound"
    SET_NOT_READY: Final = "SetNotReady"
    PARTICIPANT_LOST: Final = "ParticipantLost"
    PARTICIPANT_UNRESPONSIVE: Final = "ParticipantUnresponsive"
    ABORTED: Final = "Aborted"
    PREPARE_FAILED: Final = "PrepareFailed"
    COMMIT_FAILED: Final = "CommitFailed"
    PERSIST_FAILED: Final = "PersistFailed"
    PERSIST_BACKLOG: Final = "PersistBacklog"
    LEASE_LAPSED: Final = "LeaseLapsed"
    INVALID: Final = "InvalidCheckpoint"
    GRACE_PERIOD_TOO_SHORT: Final = "GracePeriodTooShort"
    UNMANAGED_WORKERS: Final = "UnmanagedWorkers"
