"""A pass of a set's policy loop: one read of the set, its stages' deltas, one status write
(docs/design.md#60-layers, "one pass, one snapshot, one write").

The loop's stages (the queue pass, `queuepass.QueuePass`, then the checkpoint policy's pass,
`policypass.PolicyPass`) each look at the set as the stages before them left it and act in two
halves around the pass's one write of the set's status:

- `plan(draft)`: what must land before the status (a Workload or a checkpoint created, the
  set's spec or an annotation patched: the stage rebases the draft on what it wrote), and the
  stage's delta of the status added to the draft; False when the stages after it must not
  plan in this pass (the queue pass holding the set on a Workload the API server refused);
- `finish()`: what may only follow the status (pods released, a Workload's quota handed back,
  retention's deletions, notes), once the write landed.

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
from ..model.owners import StatusOwner


class PassStage(Protocol):
    """One stage of a staged pass (see the module docstring)."""

    async def plan(self, draft: PassStatus) -> bool: ...

    async def finish(self) -> None: ...


@dataclass(frozen=True)
class StagedPassOutcome:
    ran: bool = False
    """The set was there, valid and not being deleted: the stages planned."""
    again: bool = False
    """A write lost a race: look again at once."""


def _valid(draft: PassStatus) -> bool:
    """The set parses (parsed once: the stages read `draft.rset`)."""
    try:
        return draft.rset is not None
    except ValidationError:
        return False


async def run_stages(
    kube: Kube, namespace: str, name: str, stages: Sequence[PassStage]
) -> StagedPassOutcome:
    """Read the set once, let each stage plan over the draft (in order, until one says stop),
    write the merged status once, then let the stages that planned finish, in order. A set
    that is gone, being deleted or invalid (the set's own pass reports an invalid spec) is left
    alone."""
    snapshot = await kube.get_set(namespace, name)
    if snapshot is None or (snapshot.get("metadata") or {}).get("deletionTimestamp"):
        return StagedPassOutcome()
    draft = PassStatus(snapshot)
    if not _valid(draft):
        return StagedPassOutcome()
    planned: list[PassStage] = []
    try:
        for stage in stages:
            planned.append(stage)
            if not await stage.plan(draft):
                break
        # The deltas were checked against their owners as they were added; the writer's
        # owner is not consulted by `write_pass`.
        await SetStatusWriter(kube, StatusOwner.POLICY).write_pass(draft)
    except Conflict:
        return StagedPassOutcome(ran=True, again=True)
    for stage in planned:
        await stage.finish()
    return StagedPassOutcome(ran=True)


__all__ = ["PassStage", "StagedPassOutcome", "run_stages"]
