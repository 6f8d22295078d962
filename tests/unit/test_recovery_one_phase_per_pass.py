"""The recovery advances one phase per pass of the set's loop (docs/design.md#60-layers, "One
pass, one snapshot, one write"): a pass that ran a recovery step has persisted the phase that
follows and asks its loop for another pass at once; the set pass does not run in it. The set is
one model in Restoring without a checkpoint (a fresh start under attempt 3, no participant
called), on the unit tests' API server (`testsupport.fakecluster.FakeCluster`)."""

from __future__ import annotations

import pytest
from rollout_operator.flows.reconciler import set_pass
from rollout_operator.flows.recovery import RecoveryWaits
from rollout_operator.flows.state import OperatorState
from rollout_operator.model import api
from rollout_operator.model.api import RolloutSet
from rollout_operator.model.reasons import Reason
from testsupport.fakecluster import FakeCluster
from testsupport.recovery import recovering_model_set, stored_set_status

pytestmark = pytest.mark.unit

NS, SET = "ns", "rl"


def restoring() -> FakeCluster:
    return recovering_model_set("Restoring", recovery_spec={"maxRestarts": 3})


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
    status = stored_set_status(cluster)
    assert status["recovery"]["phase"] == "Resuming", "one phase, persisted"
    assert status["attempt"] == 2
    assert "observedGeneration" not in status, "the set pass did not run in that pass"
    assert transitions == []

    assert await one_pass(), "the last phase ran: the next pass is the set pass's"
    status = stored_set_status(cluster)
    assert "recovery" not in status
    assert status["attempt"] == 3
    assert transitions == [Reason.NO_CHECKPOINT]

    # Attempt 3 has no pod on this API server: its participant is lost. The pass that sees it
    # starts the next recovery, persists its first phase, and leaves that phase to the next pass.
    assert await one_pass(), "a recovery started: the loop passes again at once"
    recovery = stored_set_status(cluster)["recovery"]
    assert (recovery["phase"], recovery["fromAttempt"], recovery["targetAttempt"]) == (
        "StoppingAttempt",
        3,
        4,
    )
