"""The recovery's steps write nothing themselves (docs/design.md#62-recovery, "Steps write
nothing"): each adds its changes to the pass of the set's loop, which sends them in its one
write. A step that waits leaves its phase and asks for a pass at the time it waits for; a write
that loses a race leaves the persisted phase, and the next pass runs its step again. The set is
one model, recovering from attempt 2 to 3, on the unit tests' API server
(`testsupport.fakecluster.FakeCluster`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rollout_operator.decide.setplan import plan_attempt
from rollout_operator.flows.passloop import Next
from rollout_operator.flows.reconciler import set_pass
from rollout_operator.flows.recovery import RecoveryWaits
from rollout_operator.flows.state import OperatorState
from rollout_operator.model import api
from rollout_operator.model.api import LABEL_ATTEMPT, ROLLOUT_SET_PLURAL, RolloutSet
from rollout_operator.model.reasons import Reason
from testsupport.fakecluster import FakeCluster
from testsupport.recovery import recovering_model_set, stored_set_status
from testsupport.setplan import running

pytestmark = pytest.mark.unit

NS, SET = "ns", "rl"
TIMEOUT_S = 600


def recovering(phase: str, **recovery: Any) -> FakeCluster:
    return recovering_model_set(
        phase,
        recovery_spec={"maxRestarts": 3, "restoreTimeoutSeconds": TIMEOUT_S},
        **recovery,
    )


class Loop:
    """The set's reconcile loop, one pass at a time, with the transitions it posted."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.state = OperatorState()
        self.transitions: list[str] = []

    async def on_transition(self, rset: RolloutSet, reason: str, message: str, w: bool) -> None:
        self.transitions.append(reason)

    async def __call__(self) -> Next:
        return await set_pass(
            self.cluster.kube(),
            NS,
            SET,
            state=self.state,
            max_replicas_per_role=api.MAX_REPLICAS,
            recovery_waits=RecoveryWaits(),
            warned=set(),
            post_warning=lambda _rset, reason, message: None,
            on_transition=self.on_transition,
        )


async def test_a_lost_race_leaves_the_persisted_phase_and_the_next_pass_runs_its_step_again() -> (
    None
):
    cluster = recovering("Resuming")
    loop = Loop(cluster)
    cluster.refuse("patch", ROLLOUT_SET_PLURAL, status=409, times=1)
    assert (await loop()).again, "the write lost a race: the loop passes again at once"
    assert stored_set_status(cluster)["recovery"]["phase"] == "Resuming", "nothing of it landed"
    assert loop.transitions == [], "no Event for a status that was not written"

    assert (await loop()).again
    status = stored_set_status(cluster)
    assert "recovery" not in status
    assert status["attempt"] == 3
    assert loop.transitions == [Reason.NO_CHECKPOINT]


async def test_starting_pods_not_ready_leaves_the_phase_and_asks_for_a_pass_at_the_deadline() -> (
    None
):
    began = datetime.now(UTC).replace(microsecond=0)
    cluster = recovering("StartingPods", nextTryAt=api.format_time(began))
    loop = Loop(cluster)
    waiting = await loop()
    assert not waiting.again, "the pods' events wake the loop, nothing else until the deadline"
    assert waiting.at == began + timedelta(seconds=TIMEOUT_S)
    assert stored_set_status(cluster)["recovery"]["phase"] == "StartingPods"
    created = [
        p
        for p in cluster.list_objects("pods", NS)
        if p["metadata"].get("labels", {}).get(LABEL_ATTEMPT) == "3"
    ]
    assert [p["metadata"]["name"] for p in created] == ["rl-model-0-a3"]

    rset = api.RolloutSet.model_validate(cluster.get(ROLLOUT_SET_PLURAL, NS, SET))
    for manifest in plan_attempt(rset, 3, []).to_create:
        cluster.put(running(manifest, "127.0.3.1"))
    assert (await loop()).again
    status = stored_set_status(cluster)
    assert status["recovery"]["phase"] == "Restoring", "participants and phase in one write"
    (participant,) = status["participants"]
    assert participant["address"] == "http://127.0.3.1:9000"


async def test_backing_off_leaves_the_phase_and_asks_for_a_pass_at_the_next_try() -> None:
    next_try = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=30)
    cluster = recovering("BackingOff", tries=1, nextTryAt=api.format_time(next_try))
    loop = Loop(cluster)
    waiting = await loop()
    assert (waiting.again, waiting.at) == (False, next_try)
    assert stored_set_status(cluster)["recovery"]["phase"] == "BackingOff"

    cluster.update(
        ROLLOUT_SET_PLURAL,
        NS,
        SET,
        lambda s: s["status"]["recovery"].update(nextTryAt="2026-11-29T12:00:00Z"),
    )
    assert (await loop()).again
    recovery = stored_set_status(cluster)["recovery"]
    assert (recovery["phase"], recovery["targetAttempt"]) == ("StoppingAttempt", 4)
