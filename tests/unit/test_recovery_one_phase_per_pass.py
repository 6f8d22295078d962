"""The recovery advances one phase per pass of the set's loop (docs/design.md#60-layers, "One
pass, one snapshot, one write"): a pass that ran a recovery step has persisted the phase that
follows and asks its loop for another pass at once; the set pass does not run in it. The set is
one model in Restoring without a checkpoint (a fresh start under attempt 3, no participant
called), on the unit tests' API server (`testsupport.fakecluster.FakeCluster`)."""

from __future__ import annotations

from typing import Any

import pytest
from rollout_operator.flows.reconciler import set_pass
from rollout_operator.flows.recovery import RecoveryWaits
from rollout_operator.flows.state import OperatorState
from rollout_operator.model import api
from rollout_operator.model.api import ROLLOUT_SET_PLURAL, RolloutSet
from rollout_operator.model.reasons import Reason
from testsupport import builders
from testsupport.fakecluster import FakeCluster

pytestmark = pytest.mark.unit

NS, SET = "ns", "rl"


def restoring() -> FakeCluster:
    cluster = FakeCluster()
    cluster.put(
        builders.set_body(
            generation=2,
            port=9000,
            recovery={"maxRestarts": 3},
            status={
                "attempt": 2,
                "createdAttempt": 2,
                "recovery": {
                    "phase": "Restoring",
                    "fromAttempt": 2,
                    "targetAttempt": 3,
                    "startedAt": "2026-11-29T12:00:00Z",
                    "reason": "PodDeleted",
                    "message": "participant model-0 of attempt 2: its pod is gone",
                },
            },
        )
    )
    return cluster


def stored_status(cluster: FakeCluster) -> dict[str, Any]:
    found = cluster.get(ROLLOUT_SET_PLURAL, NS, SET)
    assert found is not None
    status: dict[str, Any] = found["status"]
    return status


async def test_each_pass_runs_one_recovery_phase_persists_it_and_passes_again_at_once() -> None:
    cluster = restoring()
    state = OperatorState()
    transitions: list[str] = []

    async def on_transition(rset: RolloutSet, reason: str, message: str, warn: bool) -> None:
        transitions.append(reason)

    async def one_pass() -> bool:
        step = await set_pass(
            cluster.kube(),
            NS,
            SET,
            state=state,
            max_replicas_per_role=api.MAX_REPLICAS,
            recovery_waits=RecoveryWaits(),
            warned=set(),
            post_warning=lambda _rset, reason, message: None,
            on_transition=on_transition,
        )
        return step.again

    assert await one_pass(), "a phase ran: the loop passes again at once"
    status = stored_status(cluster)
    assert status["recovery"]["phase"] == "Resuming", "one phase, persisted"
    assert status["attempt"] == 2
    assert "observedGeneration" not in status, "the set pass did not run in that pass"
    assert transitions == []

    assert await one_pass(), "the last phase ran: the next pass is the set pass's"
    status = stored_status(cluster)
    assert "recovery" not in status
    assert status["attempt"] == 3
    assert transitions == [Reason.NO_CHECKPOINT]

    # Attempt 3 has no pod on this API server: its participant is lost. The pass that sees it
    # starts the next recovery, persists its first phase, and leaves that phase to the next pass.
    assert await one_pass(), "a recovery started: the loop passes again at once"
    recovery = stored_status(cluster)["recovery"]
    assert (recovery["phase"], recovery["fromAttempt"], recovery["targetAttempt"]) == (
        "StoppingAttempt",
        3,
        4,
    )
