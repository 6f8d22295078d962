"""One pass, one snapshot, one write (docs/design.md#6-the-operator): the stages of a pass of
the set's loop return deltas over the one read of the set (`cluster.statuswriter.PassStatus`),
each checked against the owner table as it is added, and the pass sends them in one merge patch
with the snapshot's resourceVersion (`SetStatusWriter.write_pass`); its Events wait for it."""

from __future__ import annotations

from typing import Any

import pytest
from rollout_operator.cluster.kube import Conflict
from rollout_operator.cluster.statuswriter import PassStatus, SetDelta, SetStatusWriter
from rollout_operator.model import api
from rollout_operator.model.api import RecoveryPhase, RecoveryStatus
from rollout_operator.model.conditions import ConditionUpdate, merge_conditions, utcnow
from rollout_operator.model.owners import ForeignStatusWrite, StatusOwner
from testsupport.fakecluster import FakeCluster
from testsupport.setplan import make_set

pytestmark = pytest.mark.unit


def stored_set(cluster: FakeCluster, **status: Any) -> dict[str, Any]:
    obj = make_set().model_dump(mode="json", by_alias=True, exclude_none=True)
    obj["kind"] = "RolloutSet"
    obj["status"] = status
    return cluster.put(obj)


def status_patches(cluster: FakeCluster) -> list[dict[str, Any]]:
    return [
        dict(r.body or {})
        for r in cluster.requests
        if r.verb == "patch" and r.plural == "rolloutsets" and r.subresource == "status"
    ]


def recovery(**fields: Any) -> RecoveryStatus:
    now = utcnow()
    return RecoveryStatus(
        phase=RecoveryPhase.STOPPING_ATTEMPT,
        from_attempt=1,
        target_attempt=2,
        started_at=now,
        phase_started_at=now,
        **fields,
    )


async def test_the_deltas_of_a_pass_go_out_in_one_write_with_the_snapshots_version() -> None:
    cluster = FakeCluster()
    snapshot = stored_set(cluster, attempt=1, createdAttempt=1)
    version = snapshot["metadata"]["resourceVersion"]
    draft = PassStatus(snapshot)
    started = recovery()
    ready_false = merge_conditions([], [ConditionUpdate.of("Ready", False, "Lost")])
    draft.add(
        SetDelta(
            StatusOwner.RECOVERY,
            {"recovery": started, "conditions": ready_false},
            events=(("Repaired", "why"),),
            requeue=True,
        )
    )
    # The next stage sees the first one's changes (the set as the stages so far left it).
    assert draft.rset.status.recovery == started
    draft.add(SetDelta(StatusOwner.SET_PASS, {"participants": [], "attempt": 1}, delta_only=True))
    assert draft.events == [("Repaired", "why")]
    assert draft.requeue

    written = await SetStatusWriter(cluster.kube(), StatusOwner.SET_PASS).write_pass(draft)
    [body] = status_patches(cluster)
    assert body["metadata"] == {"resourceVersion": version}
    assert set(body["status"]) == {"recovery", "conditions", "participants"}, "attempt unchanged"
    assert written is not None
    assert api.RolloutSet.model_validate(written).status.recovery == started


async def test_a_foreign_delta_is_refused_when_added_and_nothing_is_sent() -> None:
    cluster = FakeCluster()
    draft = PassStatus(stored_set(cluster, attempt=1))
    with pytest.raises(ForeignStatusWrite, match="attempt"):
        draft.add(SetDelta(StatusOwner.POLICY, {"attempt": 2}))
    assert await SetStatusWriter(cluster.kube(), StatusOwner.SET_PASS).write_pass(draft) is None
    assert status_patches(cluster) == []


async def test_each_delta_is_checked_against_the_status_it_was_computed_from() -> None:
    """The set pass carries over a condition a repair before it changed (its list is merged
    over the repaired status): no foreign write, since it changes nothing of the recovery's."""
    cluster = FakeCluster()
    recovering = merge_conditions([], [ConditionUpdate.of("Recovering", True, "Stopping")])
    stored = stored_set(
        cluster, recovery=api.dump(recovery()), conditions=[api.dump(c) for c in recovering]
    )
    draft = PassStatus(stored)
    cleared = merge_conditions(recovering, [ConditionUpdate.of("Recovering", False, "Repaired")])
    draft.add(SetDelta(StatusOwner.RECOVERY, {"recovery": None, "conditions": cleared}))
    assert draft.rset.status.recovery is None
    ready = merge_conditions(cleared, [ConditionUpdate.of("Ready", True, "Up")])
    draft.add(SetDelta(StatusOwner.SET_PASS, {"conditions": ready}, delta_only=True))
    await SetStatusWriter(cluster.kube(), StatusOwner.SET_PASS).write_pass(draft)
    [body] = status_patches(cluster)
    assert body["status"]["recovery"] is None, "a removed field is sent as null"
    shown = {c["type"]: c["status"] for c in body["status"]["conditions"]}
    assert shown == {"Recovering": "False", "Ready": "True"}


async def test_a_model_changed_in_the_pass_replaces_the_stored_one_whole() -> None:
    cluster = FakeCluster()
    stored = recovery(checkpoint="rl-manual-1")
    draft = PassStatus(stored_set(cluster, recovery=api.dump(stored)))
    fresh = stored.model_copy(update={"checkpoint": None, "phase": RecoveryPhase.RESTORING})
    draft.add(SetDelta(StatusOwner.RECOVERY, {"recovery": fresh}))
    assert draft.rset.status.recovery == fresh
    written = await SetStatusWriter(cluster.kube(), StatusOwner.SET_PASS).write_pass(draft)
    [body] = status_patches(cluster)
    assert body["status"]["recovery"]["checkpoint"] is None
    assert written is not None
    assert api.RolloutSet.model_validate(written).status.recovery == fresh


async def test_a_pass_that_lost_the_race_writes_nothing_and_says_so() -> None:
    cluster = FakeCluster()
    draft = PassStatus(stored_set(cluster, attempt=1))
    cluster.update("rolloutsets", "ns", "rl", lambda o: o["status"].update(attempt=2))
    draft.add(SetDelta(StatusOwner.SET_PASS, {"createdAttempt": 1}))
    with pytest.raises(Conflict):
        await SetStatusWriter(cluster.kube(), StatusOwner.SET_PASS).write_pass(draft)
    stored = cluster.get("rolloutsets", "ns", "rl")
    assert stored is not None
    assert "createdAttempt" not in stored["status"]
