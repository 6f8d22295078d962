"""What a stop of its daemon does to a checkpoint under way (`flows.reconciler.checkpoint_run`,
docs/design.md#68-the-operators-own-life): a deleted checkpoint is aborted at once, an exiting
operator hands it over once `handover_seconds` ran out, and any other stop lets it run on.

The API server is the unit tests' fake (`testsupport.fakecluster`, below the real `Kube`); the
participant is a real control plane over a `FakeParticipant`, served on loopback and reached
through the set's status address, as the operator reaches a pod; the stop is a stand-in for
Kopf's `stopped` flag (`StopStandIn`), set from inside the participant's park so it lands while
the flow prepares."""

from __future__ import annotations

from pathlib import Path

import anyio
from rollout_operator.flows.reconciler import checkpoint_run
from rollout_operator.flows.state import OperatorState
from rollout_operator.model import api
from testsupport.checkpointflow import (
    CKPT,
    NS,
    SET,
    checkpoint_status,
    condition,
    mark_ready,
    served_participant,
    set_cluster,
)
from testsupport.fakecluster import FakeCluster
from testsupport.participants import FakeParticipant

WAIT = 30.0
"""Upper bound for a whole scenario; reaching it is a failure, not a delay."""


class StopStandIn:
    """Kopf's `stopped` flag as `checkpoint_run` reads it: set, and why."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self.deleted = False
        self.operator_exiting = False

    async def wait(self) -> None:
        await self._event.wait()

    def stop(self, *, deleted: bool = False, operator_exiting: bool = False) -> None:
        self.deleted, self.operator_exiting = deleted, operator_exiting
        self._event.set()


def _cluster(url: str) -> FakeCluster:
    cluster = set_cluster("Manual", [])
    mark_ready(cluster)

    def served_at(obj: dict[str, object]) -> None:
        obj["status"]["participants"][0]["address"] = url  # type: ignore[index]

    cluster.update(api.ROLLOUT_SET_PLURAL, NS, SET, served_at)
    return cluster


def _stop_while_parking(fake: FakeParticipant, stop: StopStandIn, **why: bool) -> None:
    """The daemon is stopped (for `why`) while the participant parks; the park then waits
    (bounded by its deadline) for a gate that only the end of the scenario opens."""
    fake.park_gate = anyio.Event()

    async def stopped() -> None:
        stop.stop(**why)

    fake.on_park = stopped


async def _run(cluster: FakeCluster, stop: StopStandIn, handover_seconds: float) -> object:
    async def transition(ckpt: api.RolloutCheckpoint, reason: str, message: str) -> None:
        return None

    with anyio.fail_after(WAIT):
        return await checkpoint_run(
            cluster.kube(),
            NS,
            CKPT,
            state=OperatorState(),
            stop=stop,
            handover_seconds=handover_seconds,
            slots=None,
            leases=None,
            on_transition=transition,
        )


async def test_a_deleted_checkpoint_is_aborted_at_once(tmp_path: Path) -> None:
    async with served_participant(tmp_path) as (fake, url):
        cluster = _cluster(url)
        stop = StopStandIn()
        _stop_while_parking(fake, stop, deleted=True)
        # A handover far beyond the scenario: only the deletion can end the run in time.
        assert await _run(cluster, stop, handover_seconds=WAIT * 10) is None
    assert checkpoint_status(cluster)["phase"] == "Failed"
    assert condition(cluster, "Ready")["reason"] == "Aborted"
    assert fake.admission_open, "the abort resumed the participant"


async def test_an_exiting_operator_hands_the_checkpoint_over_without_aborting_it(
    tmp_path: Path,
) -> None:
    async with served_participant(tmp_path) as (fake, url):
        cluster = _cluster(url)
        stop = StopStandIn()
        _stop_while_parking(fake, stop, operator_exiting=True)
        assert await _run(cluster, stop, handover_seconds=0.2) is None
    assert checkpoint_status(cluster).get("phase") != "Failed", "handed over, not aborted"
    assert not fake.admission_open, "still prepared under its lease, for the next operator"


async def test_any_other_stop_lets_the_checkpoint_run_to_its_end(tmp_path: Path) -> None:
    async with served_participant(tmp_path) as (fake, url):
        cluster = _cluster(url)
        stop = StopStandIn()

        async def stopped() -> None:
            stop.stop()

        fake.on_park = stopped
        # A handover far beyond the scenario: the run ends by itself or not at all.
        assert await _run(cluster, stop, handover_seconds=WAIT * 10) is api.CheckpointPhase.READY
    assert condition(cluster, "Ready")["status"] == "True"
