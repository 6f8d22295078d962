"""The eviction policy (`checkpointPolicy.onEviction`, docs/policy.md): an Eviction checkpoint for
a participant pod being deleted with a grace period, the prepare deadline that grace period sets,
and the hold it puts on the recovery."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from ...model.api import Trigger, format_time
from .views import CheckpointView, Create, SetView, parse_time

MIN_EVICTION_GRACE_SECONDS: Final = 3
"""A pod deleted with less grace than this gets no eviction checkpoint: it would be killed
before the prepare got anywhere (a forced delete, or the recovery's own short-grace stop)."""

EVICTION_COMMIT_MARGIN_SECONDS: Final = 2.0
"""An eviction checkpoint's prepare must end this long before the evicted pod is killed: the
commit (records fsynced, manifest written) still has to reach that pod. Commits of the
reference servers take well under a second; a pod killed mid-commit fails the checkpoint with
ParticipantLost."""


def eviction_checkpoint_name(set_name: str, attempt: int) -> str:
    return f"{set_name}-evict-a{attempt}"


@dataclass(frozen=True)
class TerminatingPod:
    """A participant pod with a deletion timestamp (evicted, drained, preempted, deleted)."""

    name: str
    attempt: int
    deletion: datetime
    """When its grace period ends (the deletion timestamp); the pod is killed then."""
    grace_seconds: int
    finished: bool = False

    @classmethod
    def from_pod(cls, raw: Mapping[str, Any], attempt_label: str) -> TerminatingPod | None:
        """None for a pod that is not terminating or carries no attempt label."""
        meta = raw.get("metadata") or {}
        deletion = parse_time(meta.get("deletionTimestamp"))
        try:
            attempt = int((meta.get("labels") or {})[attempt_label])
        except (KeyError, ValueError):
            return None
        if deletion is None:
            return None
        grace = meta.get("deletionGracePeriodSeconds")
        phase = (raw.get("status") or {}).get("phase")
        return cls(
            name=str(meta.get("name", "")),
            attempt=attempt,
            deletion=deletion,
            grace_seconds=int(grace) if isinstance(grace, int) else 0,
            finished=phase in ("Failed", "Succeeded"),
        )


def eviction_decision(view: SetView, pod: TerminatingPod) -> Create | None:
    """An Eviction checkpoint for a participant pod of the current attempt that is being deleted
    with a grace period, unless the operator deletes pods itself (recovery, suspend, the set's
    own deletion): those are not evictions."""
    if (
        not view.policy.on_eviction
        or not view.restorable
        or view.deleting
        or view.recovering
        or view.wants_suspended
        or view.suspended
        or view.attempt is None
        or pod.attempt != view.attempt
        or pod.finished
        or pod.grace_seconds < MIN_EVICTION_GRACE_SECONDS
    ):
        return None
    return Create(
        eviction_checkpoint_name(view.name, view.attempt),
        Trigger.EVICTION,
        f"participant pod {pod.name} is being deleted (grace period {pod.grace_seconds}s, "
        f"killed at {format_time(pod.deletion)})",
    )


@dataclass(frozen=True)
class PrepareDeadline:
    """When a checkpoint's prepare must end, and why when it is not `prepareTimeoutSeconds`."""

    at: datetime
    killed: TerminatingPod | None = None
    """The evicted pod whose grace period set the deadline (None: the prepare timeout did)."""

    @property
    def why(self) -> str:
        """For the checkpoint's messages; empty when the prepare timeout set the deadline."""
        if self.killed is None:
            return ""
        return (
            f"pod {self.killed.name} is killed at {format_time(self.killed.deletion)}, so the "
            f"prepare ends {EVICTION_COMMIT_MARGIN_SECONDS:g}s before that to leave the commit "
            "time"
        )


def eviction_prepare_deadline(
    now: datetime,
    prepare_timeout_seconds: float,
    pods: Sequence[TerminatingPod],
    attempt: int | None,
) -> PrepareDeadline:
    """The prepare deadline of an Eviction checkpoint: `prepareTimeoutSeconds` from now, or the
    end of the first grace period among the attempt's terminating pods less
    `EVICTION_COMMIT_MARGIN_SECONDS`, whichever is earlier.

    A prepare running past the kill would only fail later and less clearly (ParticipantLost
    instead of PrepareTimeout with its blockers), and it would keep the rest of the attempt
    paused for nothing. Every terminating pod of the attempt counts, not only the one whose
    event created the checkpoint: a drain evicts several, and the first kill ends the
    checkpoint. The result can lie in the past (a checkpoint that queued too long, a pod
    deleted with little grace); the flow then fails at once instead of preparing.
    """
    by_timeout = PrepareDeadline(now + timedelta(seconds=prepare_timeout_seconds))
    evicted = [p for p in pods if p.attempt == attempt and not p.finished]
    if attempt is None or not evicted:
        return by_timeout
    first = min(evicted, key=lambda p: (p.deletion, p.name))
    by_grace = first.deletion - timedelta(seconds=EVICTION_COMMIT_MARGIN_SECONDS)
    if by_timeout.at <= by_grace:
        return by_timeout
    return PrepareDeadline(by_grace, killed=first)


def eviction_holds(
    view: SetView,
    pods: Sequence[TerminatingPod],
    checkpoints: Sequence[CheckpointView],
    now: datetime,
) -> frozenset[str]:
    """Terminating pods whose loss the recovery must not act on yet.

    While the eviction checkpoint has not finished (or not even been created: the pod event
    reaches the recovery and the eviction handler in either order), the pod's control plane
    still answers, and recovering now would delete the attempt under the checkpoint. The hold
    ends when that checkpoint is Ready or Failed, or when the pod's grace period is over.
    """
    if view.attempt is None:
        return frozenset()
    evict = next(
        (c for c in checkpoints if c.name == eviction_checkpoint_name(view.name, view.attempt)),
        None,
    )
    if evict is not None and evict.finished:
        return frozenset()
    return frozenset(
        pod.name for pod in pods if eviction_decision(view, pod) is not None and pod.deletion > now
    )
