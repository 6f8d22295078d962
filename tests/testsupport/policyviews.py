"""The pure checkpoint policies' inputs as the unit tests of `decide/policy/` build them: the set
`math` of one environment as a `SetView` (`view`, `deadline_view`), its checkpoints as
`CheckpointView`s (`ckpt`), all at `T0 + seconds` (`at`), and where the set's latest checkpoint
moves when one is deleted (`latest_after_delete`, through the set pass's own `newest_ready`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from rollout_operator.decide.policy.views import CheckpointView, SetView
from rollout_operator.decide.setstatus import newest_ready
from rollout_operator.model import api
from rollout_operator.model.api import CheckpointPhase, Trigger

from testsupport import builders
from testsupport.policy import T0, stamp


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def rollout_set(
    *,
    policy: dict[str, Any] | None = None,
    recovery: dict[str, Any] | None = None,
    suspend: bool = False,
    status: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
    ready_since: float | None = 0.0,
    suspended: tuple[bool, str] | None = None,
) -> api.RolloutSet:
    conditions: list[dict[str, Any]] = []
    if ready_since is not None:
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllParticipantsReady",
                "lastTransitionTime": stamp(ready_since),
            }
        )
    if suspended is not None:
        conditions.append(
            {
                "type": "Suspended",
                "status": "True" if suspended[0] else "False",
                "reason": suspended[1],
                "lastTransitionTime": stamp(0),
            }
        )
    return builders.rollout_set(
        name="math",
        namespace="team",
        uid=None,
        annotations=annotations or {},
        participants=[
            builders.participant("environment", None, container_name="server", image="rollout:dev")
        ],
        volume={"hostPath": {"path": "/ckpt"}},
        checkpointPolicy=policy or {},
        recovery=recovery or {},
        suspend=suspend,
        status={"attempt": 3, "createdAttempt": 3, "conditions": conditions, **(status or {})},
    )


def view(live_pods: int = 4, **kwargs: Any) -> SetView:
    return SetView.from_set(rollout_set(**kwargs), live_pods=live_pods)


def ckpt(
    name: str,
    created: float,
    *,
    trigger: Trigger = Trigger.MANUAL,
    completed: float | None = None,
    ready: bool = False,
    failed: bool = False,
) -> CheckpointView:
    phase = (
        CheckpointPhase.READY
        if ready
        else CheckpointPhase.FAILED
        if failed
        else CheckpointPhase.PREPARING
    )
    return CheckpointView(
        name=name,
        trigger=trigger,
        created=at(created),
        phase=phase,
        ready=ready,
        failed=failed,
        completed=at(completed) if completed is not None else None,
        failure="PrepareTimeout: 1 episode(s) were not parked" if failed else "",
    )


def recovery_status(checkpoint: str | None = None) -> dict[str, Any]:
    body = {
        "phase": "Restoring",
        "fromAttempt": 3,
        "targetAttempt": 4,
        "startedAt": stamp(0),
    }
    if checkpoint:
        body["checkpoint"] = checkpoint
    return body


def deadline_view(
    must: float = 1000, durations: list[float] | None = None, **kwargs: Any
) -> SetView:
    policy = {"mustSaveBy": stamp(must), "afterDeadline": "Continue", **kwargs.pop("policy", {})}
    status = {"recentCheckpointSeconds": durations or [4.0] * 5, **kwargs.pop("status", {})}
    return view(policy=policy, status=status, **kwargs)


def latest_after_delete(
    checkpoints: Sequence[CheckpointView], deleting: str
) -> CheckpointView | None:
    """What the set's `latestCheckpoint` points at once `deleting` is being deleted: the set
    pass's `newest_ready` over the checkpoints as they read then."""
    return newest_ready(
        [replace(c, deleting=True) if c.name == deleting else c for c in checkpoints]
    )
