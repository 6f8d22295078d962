"""A pass of a set's loop: one read of the set, its stages' deltas, one status write
(docs/design.md#60-layers, "one pass, one snapshot, one write").

Both per-set loops pass this way (`flows/reconciler.py`): the reconcile loop's stages are the
repairs and the recovery's look, then the set pass (`setpass.SetPass`); the policy loop's are
the queue pass (`queuepass.QueuePass`), then the checkpoint policy's pass
(`policypass.PolicyPass`). Each stage looks at the set as the stages before it left it
(`PassStatus.rset`) and acts in two halves around the pass's one write of the set's status:

- `plan(draft)`: what must land before the status (pods or a Workload or a checkpoint created,
  the set's spec or an annotation patched: the stage rebases the draft on what it wrote), and
  the stage's delta of the status added to the draft; False when the stages after it must not
  plan in this pass (a recovery that ran a step, a blocked set, the queue pass holding the set
  on a Workload the API server refused);
- `finish()`: what may only follow the status (pods released or hinted, a Workload's quota
  handed back, retention's deletions, notes), once the write landed.

A set whose spec does not parse reaches the stages as it is: the set pass reports it
(`InvalidSpec`), the others leave it alone (`parsed`).

A lost race (a `Conflict` of a write with the snapshot's resourceVersion) ends the pass with
`again`: nothing after the refused write is done, and the next pass decides from what won.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic import ValidationError

from ..cluster.kube import Conflict, Kube
from ..cluster.statuswriter import PassStatus, SetStatusWriter
from ..model.api import RolloutSet
from ..model.owners import StatusOwner


class PassStage(Protocol):
    """One stage of a staged pass (see the module docstring)."""

    async def plan(self, draft: PassStatus) -> bool: ...

    async def finish(self) -> None: ...


@dataclass(frozen=True)
class StagedPassOutcome:
    draft: PassStatus | None = None
    """The pass's status (its Events, whether it asks for another pass); None when the set is
    gone or being deleted (no stage planned)."""
    again: bool = False
    """A write lost a race: look again at once."""


def parsed(draft: PassStatus) -> RolloutSet | None:
    """The set as the stages so far left it; None when its spec does not parse."""
    try:
        return draft.rset
    except ValidationError:
        return None


async def run_stages(
    kube: Kube, namespace: str, name: str, stages: Sequence[PassStage]
) -> StagedPassOutcome:
    """Read the set once, let each stage plan over the draft (in order, until one says stop),
    write the merged status once, then let the stages that planned finish, in order. A set
    that is gone or being deleted is left alone."""
    snapshot = await kube.get_set(namespace, name)
    if snapshot is None or (snapshot.get("metadata") or {}).get("deletionTimestamp"):
        return StagedPassOutcome()
    draft = PassStatus(snapshot)
    planned: list[PassStage] = []
    try:
        for stage in stages:
            planned.append(stage)
            if not await stage.plan(draft):
                break
        # The deltas were checked against their owners as they were added; the writer's
        # owner is not consulted by `write_pass`.
        await SetStatusWriter(kube, StatusOwner.SET_PASS).write_pass(draft)
    except Conflict:
        return StagedPassOutcome(draft, again=True)
    for stage in planned:
        await stage.finish()
    return StagedPassOutcome(draft)


__all__ = ["PassStage", "StagedPassOutcome", "parsed", "run_stages"]
