"""The one writer of a RolloutSet's status (docs/design.md#69-who-writes-the-sets-status).

Every flow that changes the set's status (the set pass, the recovery, the policy, the queue,
and the repairs as the owners of what they repair) adds its changes to the pass's status as a
delta of its owner (`model.owners.StatusOwner`), and the pass writes them once
(`flows/stagedpass.py`). On the way:

- a delta setting a field or condition its owner does not own is refused as it is added
  (`model.owners.check_owner` raises `ForeignStatusWrite`): two owners of one field would undo
  each other's writes;
- every value is put in its wire form with one function (`wire`, built on `model.api.dump`);
- the write is one merge patch with the resourceVersion the changes were computed from, so a
  lost race is a `Conflict`, never a silently overwritten field, left to the loop (a pass that
  decides again from what won).

Explicit nulls: a top-level field set to None is sent as null, which deletes it (a merge patch
has no other way to remove `status.recovery`); a model is written whole (`replacing`): what the
stored object has and the model no longer has is sent as null, so a field set back to None goes
(a recovery's `checkpoint` when its next try starts fresh); a list replaces the stored list.
Events are the flows' business and are posted after the write returns.

A pass of the set's loop (docs/design.md#6-the-operator, "one pass, one snapshot, one write")
collects its stages' changes in a `PassStatus` over the one snapshot it read: each stage returns
a `SetDelta` (its owner, its changes, its Events, whether to requeue) computed from the set as
the stages before it left it, the delta is checked against the owner table as it is added, and
`SetStatusWriter.write_pass` sends the merged changes once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from ..model.api import RolloutSet, RolloutSetStatus, dump, namespace_or_default
from ..model.owners import StatusOwner, check_owner
from .kube import Kube


def wire(value: Any) -> Any:
    """`value` as it goes into the status patch: models by `model.api.dump`, lists and dicts
    item by item, everything else (None included: a delete at the top level) as it is."""
    if isinstance(value, BaseModel):
        return dump(value)
    if isinstance(value, list | tuple):
        return [wire(v) for v in value]
    if isinstance(value, Mapping):
        return {k: wire(v) for k, v in value.items()}
    return value


def replacing(stored: Any, written: Any) -> Any:
    """`written` as a merge patch that replaces `stored` whole: every key `stored` has and
    `written` lacks is sent as null (deleted), in nested objects too. A model is always written
    whole, so a field it set back to None must go from the stored object as well."""
    if not isinstance(stored, Mapping) or not isinstance(written, Mapping):
        return written
    patch = {key: replacing(stored.get(key), value) for key, value in written.items()}
    patch.update({key: None for key in stored if key not in written})
    return patch


@dataclass(frozen=True)
class SetDelta:
    """What one stage of a pass changes in the set's status, computed from the pass's snapshot
    (as the stages before it left it): `changes` in wire names (values models or wire values),
    the Warning Events (reason, message) to post once the write landed, and whether the loop
    should run another pass at once."""

    owner: StatusOwner
    changes: Mapping[str, Any] = field(default_factory=dict)
    events: tuple[tuple[str, str], ...] = ()
    requeue: bool = False
    delta_only: bool = False
    """Leave out what the status shows already (the set pass writes its whole view)."""


def _without_nulls(value: Any) -> Any:
    """`value` as the stored object holds it after a merge patch: nulls in objects removed."""
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


class PassStatus:
    """The set's status as one pass changes it: the snapshot the pass read, and the deltas of
    its stages merged over it in order. `rset` is the set as the stages so far left it (what
    the next stage computes from); nothing is sent before `SetStatusWriter.write_pass`."""

    def __init__(self, obj: Mapping[str, Any]) -> None:
        self.snapshot = obj
        self._shown: dict[str, Any] = dict(obj.get("status") or {})
        self._body: dict[str, Any] = {}
        self._whole: set[str] = set()
        self.events: list[tuple[str, str]] = []
        self.requeue = False
        self._parsed: RolloutSet | None = None

    @property
    def raw(self) -> dict[str, Any]:
        """The set in its wire form, with the changes added so far."""
        return {**self.snapshot, "status": dict(self._shown)}

    @property
    def rset(self) -> RolloutSet:
        """The set parsed, with the changes added so far (`ValidationError` if invalid); parsed
        once per change, as every stage reads it."""
        if self._parsed is None:
            self._parsed = RolloutSet.model_validate(self.raw)
        return self._parsed

    @property
    def changed(self) -> bool:
        return bool(self._body)

    def rebase(self, written: Mapping[str, Any]) -> None:
        """The pass wrote the set itself (its spec or metadata, with the snapshot's
        resourceVersion as precondition, or an annotation), or read it again from the API
        server (the recovery, before it acts on a loss or a resume): `written`, as the API
        server returned it, becomes the snapshot the changes are merged over and sent
        against."""
        self.snapshot = written
        self._shown = dict(written.get("status") or {})
        for key, value in self._body.items():
            if value is None:
                self._shown.pop(key, None)
            else:
                self._shown[key] = _without_nulls(value)
        self._parsed = None

    def add(self, delta: SetDelta) -> None:
        """Merge `delta` over the status as the stages so far left it; `ForeignStatusWrite`
        when it sets a field or condition its owner does not own."""
        body = {key: wire(value) for key, value in delta.changes.items()}
        if delta.delta_only:
            body = {key: value for key, value in body.items() if self._shown.get(key) != value}
        if body:
            checked = dict(body)
            for key, value in delta.changes.items():
                if isinstance(value, BaseModel) and key in checked:
                    checked[key] = replacing(self._shown.get(key), checked[key])
            check_owner(delta.owner, RolloutSetStatus.model_validate(self._shown), checked)
        if body:
            self._parsed = None
        for key, value in body.items():
            self._body[key] = value
            if isinstance(delta.changes[key], BaseModel):
                self._whole.add(key)
            if value is None:
                self._shown.pop(key, None)
            else:
                self._shown[key] = _without_nulls(value)
        self.events.extend(delta.events)
        self.requeue = self.requeue or delta.requeue

    def body(self) -> dict[str, Any]:
        """The one merge patch over the snapshot: models replace the stored object whole."""
        stored = self.snapshot.get("status") or {}
        return {
            key: replacing(stored.get(key), value) if key in self._whole else value
            for key, value in self._body.items()
        }


class SetStatusWriter:
    """Writes the set's status on behalf of one owner."""

    def __init__(self, kube: Kube, owner: StatusOwner) -> None:
        self._kube = kube
        self.owner = owner

    async def write_pass(self, draft: PassStatus) -> dict[str, Any] | None:
        """Send the pass's merged changes (each checked against its owner as it was added),
        only if the set is still at the snapshot's resourceVersion (`Conflict` otherwise).
        Returns the written set, or None when no stage changed anything."""
        if not draft.changed:
            return None
        meta = draft.snapshot["metadata"]
        namespace = namespace_or_default(meta.get("namespace"))
        return await self._send(namespace, meta["name"], draft.body(), meta.get("resourceVersion"))

    async def _send(
        self, namespace: str, name: str, body: dict[str, Any], version: str | None
    ) -> dict[str, Any]:
        return await self._kube.patch_set_status(namespace, name, body, resource_version=version)


__all__ = [
    "PassStatus",
    "SetDelta",
    "SetStatusWriter",
    "replacing",
    "wire",
]
