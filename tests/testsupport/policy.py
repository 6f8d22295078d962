"""The checkpoint policy's pass over the unit tests' fake API server (`fakecluster.FakeCluster`),
for the unit tests of the policy (tests/unit/test_policy_ops.py) and the adversarial tests of a
set's status and spec: a RolloutSet `math` in namespace `team` as the operator finds it Ready
(`rollout_set`), an API server holding it whose clock stands at `T0` (`seeded`), and `Run`, a
`PolicyPass` at a fixed time on the real client with its notes and set wakes collected."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rollout_operator.cluster.storage import StorageLocator
from rollout_operator.decide.policy.views import Note
from rollout_operator.flows.policypass import PolicyPass
from rollout_operator.flows.state import LoggedNotes
from rollout_operator.model import api

from testsupport import builders
from testsupport.fakecluster import FakeCluster

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
NS = "team"


def stamp(seconds: float) -> str:
    return api.format_time(T0 + timedelta(seconds=seconds))


def seeded(rset: dict[str, Any]) -> FakeCluster:
    """An API server holding the set, whose clock stands at T0 (when what the operator creates
    was created)."""
    cluster = FakeCluster(clock=lambda: T0)
    cluster.put(rset)
    return cluster


def rollout_set(storage: Path, **spec: Any) -> dict[str, Any]:
    """The set `math` of one environment, Ready under attempt 3, its records in `storage`."""
    return builders.set_body(
        name="math",
        namespace=NS,
        uid="uid-1",
        generation=1,
        roles={"environment": None},
        storage=storage,
        volume={"hostPath": {"path": str(storage)}},
        **spec,
        status={
            "attempt": 3,
            "createdAttempt": 3,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "AllParticipantsReady",
                    "lastTransitionTime": stamp(0),
                }
            ],
        },
    )


class Run:
    """A `PolicyPass` at a fixed time on the real client, with its notes and set wakes
    collected."""

    def __init__(self, cluster: FakeCluster, storage: Path) -> None:
        self.kube = cluster.kube()
        self.now = T0 + timedelta(seconds=100)
        self.notes: list[Note] = []
        self.woken: list[tuple[str, str]] = []
        self.storage = storage
        self.logged_notes = LoggedNotes()
        """The operator process's record of logged notes, kept across this Run's passes."""

    async def __call__(self) -> Any:
        async def note(_rset: api.RolloutSet, found: Note) -> None:
            self.notes.append(found)

        return await PolicyPass(
            self.kube,
            clock=lambda: self.now,
            logged_notes=self.logged_notes,
            on_note=note,
            wake_set=lambda ns, name: self.woken.append((ns, name)),
            locator=StorageLocator(None),
        ).run(NS, "math")
