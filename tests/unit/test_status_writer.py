"""The one writer of a RolloutSet's status and its ownership table
(docs/design.md#69-who-writes-the-sets-status).

The table (`model.owners`) is held to the status model: every field and every condition type
has exactly one owner. A pass's status (`cluster.statuswriter.PassStatus`) refuses a delta of
anything its owner does not own, before any request; the writer (`SetStatusWriter.write_pass`)
sends the wire form with one dump (explicit nulls at the top level only) and the snapshot's
resourceVersion, and leaves a conflict to the loop, which passes again from what won. No flow
calls `patch_set_status` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from rollout_operator.cluster.kube import Conflict
from rollout_operator.cluster.statuswriter import PassStatus, SetDelta, SetStatusWriter
from rollout_operator.model import api
from rollout_operator.model.api import (
    Condition,
    RecoveryHold,
    RecoveryPhase,
    RecoveryStatus,
    RolloutSetStatus,
    SetConditionType,
)
from rollout_operator.model.conditions import ConditionUpdate, merge_conditions, utcnow
from rollout_operator.model.owners import (
    CONDITION_OWNERS,
    FIELD_OWNERS,
    LENT_TO_RECOVERY,
    ForeignStatusWrite,
    StatusOwner,
    check_owner,
    written_keys,
)
from testsupport.fakecluster import FakeCluster
from testsupport.setplan import make_set

pytestmark = pytest.mark.unit

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "rollout_operator"


def wire_names() -> set[str]:
    return {field.alias or name for name, field in RolloutSetStatus.model_fields.items()}


def condition(type_: str, status: bool = True, reason: str = "Because") -> Condition:
    updated = merge_conditions([], [ConditionUpdate.of(type_, status, reason)])
    return updated[0]


def recovery() -> RecoveryStatus:
    now = utcnow()
    return RecoveryStatus(
        phase=RecoveryPhase.STOPPING_ATTEMPT,
        from_attempt=1,
        target_attempt=2,
        started_at=now,
        phase_started_at=now,
    )


# --- the table ----------------------------------------------------------------------------------


def test_every_status_field_has_exactly_one_owner() -> None:
    assert set(FIELD_OWNERS) == wire_names() - {"conditions"}
    assert not set(FIELD_OWNERS) & set(CONDITION_OWNERS), "a key is a field or a condition"


def test_every_condition_type_has_exactly_one_owner() -> None:
    assert set(CONDITION_OWNERS) == {t.value for t in SetConditionType}


def test_every_owner_owns_something_and_only_the_set_pass_lends() -> None:
    owners = {*FIELD_OWNERS.values(), *CONDITION_OWNERS.values()}
    assert owners == set(StatusOwner)
    for key in LENT_TO_RECOVERY:
        assert (FIELD_OWNERS.get(key) or CONDITION_OWNERS.get(key)) is StatusOwner.SET_PASS, key


# --- the check ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owner", "changes"),
    [
        (StatusOwner.POLICY, {"attempt": 2}),
        (StatusOwner.QUEUE, {"saveReserveSeconds": 30}),
        (StatusOwner.SET_PASS, {"recovery": None}),
        (StatusOwner.POLICY, {"conditions": [condition("Ready")]}),
        (StatusOwner.QUEUE, {"conditions": [condition("Suspended")]}),
        (StatusOwner.SET_PASS, {"conditions": [condition("Recovering")]}),
        (StatusOwner.POLICY, {"someNewField": 1}),
    ],
)
def test_a_write_of_a_foreign_field_or_condition_is_refused(
    owner: StatusOwner, changes: dict[str, Any]
) -> None:
    wire = {k: [api.dump(c) for c in v] if k == "conditions" else v for k, v in changes.items()}
    with pytest.raises(ForeignStatusWrite, match=f"the {owner.value} wrote status"):
        check_owner(owner, RolloutSetStatus(), wire)


def test_a_condition_carried_over_unchanged_is_no_write() -> None:
    ready = condition("Ready")
    current = RolloutSetStatus(conditions=[ready])
    merged = merge_conditions([ready], [ConditionUpdate.of("Suspended", True, "Suspending")])
    changes = {"conditions": [api.dump(c) for c in merged]}
    assert written_keys(current, changes) == {"Suspended"}
    check_owner(StatusOwner.POLICY, current, changes)
    dropped = {"conditions": [api.dump(c) for c in merged if c.type != "Ready"]}
    with pytest.raises(ForeignStatusWrite, match="Ready"):
        check_owner(StatusOwner.POLICY, current, dropped)


def test_the_recovery_writes_the_lent_fields_only_while_it_holds_the_set() -> None:
    lent = {"attempt": 2, "createdAttempt": 2, "conditions": [api.dump(condition("Ready"))]}
    with pytest.raises(ForeignStatusWrite, match="attempt"):
        check_owner(StatusOwner.RECOVERY, RolloutSetStatus(), lent)
    check_owner(StatusOwner.RECOVERY, RolloutSetStatus(recovery=recovery()), lent)  # it runs
    check_owner(
        StatusOwner.RECOVERY, RolloutSetStatus(), {**lent, "recovery": api.dump(recovery())}
    )
    ended = {**lent, "recovery": None}
    check_owner(StatusOwner.RECOVERY, RolloutSetStatus(), ended)  # removed by hand meanwhile
    hold = RecoveryHold(since=utcnow(), message="stopped", generation=1)
    check_owner(StatusOwner.RECOVERY, RolloutSetStatus(), {**lent, "recoveryHold": api.dump(hold)})
    with pytest.raises(ForeignStatusWrite, match="lastTrainerStep"):
        check_owner(
            StatusOwner.RECOVERY, RolloutSetStatus(recovery=recovery()), {"lastTrainerStep": 3}
        )


# --- the writer ---------------------------------------------------------------------------------


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


async def write(
    cluster: FakeCluster,
    obj: dict[str, Any],
    owner: StatusOwner,
    changes: dict[str, Any],
    *,
    delta_only: bool = False,
) -> dict[str, Any] | None:
    """`changes` as `owner`'s delta of one pass over `obj`, written as the pass writes."""
    draft = PassStatus(obj)
    draft.add(SetDelta(owner, changes, delta_only=delta_only))
    return await SetStatusWriter(cluster.kube(), owner).write_pass(draft)


async def test_a_foreign_write_fails_before_any_request() -> None:
    cluster = FakeCluster()
    obj = stored_set(cluster, attempt=1)
    with pytest.raises(ForeignStatusWrite, match="attempt"):
        await write(cluster, obj, StatusOwner.POLICY, {"attempt": 2})
    assert status_patches(cluster) == []


async def test_one_wire_form_with_nulls_only_at_the_top_and_the_read_version() -> None:
    cluster = FakeCluster()
    obj = stored_set(cluster, attempt=1, recovery=api.dump(recovery()))
    rset = api.RolloutSet.model_validate(obj)
    ready = merge_conditions([], [ConditionUpdate.of("Ready", True, "Restored")])
    changes = {"recovery": None, "attempt": 2, "conditions": ready}
    written = await write(cluster, obj, StatusOwner.RECOVERY, changes)
    assert written is not None
    [body] = status_patches(cluster)
    assert body["metadata"] == {"resourceVersion": rset.metadata.resource_version}
    assert body["status"]["recovery"] is None, "a top-level null deletes the field"
    [sent] = body["status"]["conditions"]
    assert "observedGeneration" not in sent, "inside a model, None is left out"
    assert sent == api.dump(ready[0])
    assert "recovery" not in written["status"]
    assert written["status"]["attempt"] == 2


async def test_a_model_field_set_back_to_none_is_deleted_from_the_stored_object() -> None:
    """A model written whole replaces the stored one: a field it no longer has (a recovery
    whose next try restores nothing, `checkpoint` None) is sent as null, or the merge patch
    would keep the stored value and the next try would restore the old checkpoint."""
    cluster = FakeCluster()
    first = recovery().model_copy(update={"checkpoint": "rl-manual-1"})
    obj = stored_set(cluster, attempt=1, recovery=api.dump(first))
    fresh_start = first.model_copy(update={"checkpoint": None, "phase": RecoveryPhase.RESTORING})
    written = await write(cluster, obj, StatusOwner.RECOVERY, {"recovery": fresh_start})
    assert written is not None
    [body] = status_patches(cluster)
    assert body["status"]["recovery"]["checkpoint"] is None
    stored = api.RolloutSet.model_validate(written).status.recovery
    assert stored is not None
    assert stored.checkpoint is None
    assert stored.phase is RecoveryPhase.RESTORING


async def test_delta_only_writes_what_the_stored_status_does_not_show() -> None:
    cluster = FakeCluster()
    obj = stored_set(cluster, attempt=1, observedGeneration=2)
    unchanged = {"attempt": 1, "observedGeneration": 2, "activeCheckpoint": None}
    assert await write(cluster, obj, StatusOwner.SET_PASS, unchanged, delta_only=True) is None
    assert status_patches(cluster) == []
    changed = {**unchanged, "createdAttempt": 1}
    await write(cluster, obj, StatusOwner.SET_PASS, changed, delta_only=True)
    [body] = status_patches(cluster)
    assert body["status"] == {"createdAttempt": 1}


async def test_a_conflict_is_left_to_the_loop() -> None:
    cluster = FakeCluster()
    obj = stored_set(cluster)
    cluster.update("rolloutsets", "ns", "rl", lambda o: o["status"].update(attempt=1))
    with pytest.raises(Conflict):
        await write(cluster, obj, StatusOwner.POLICY, {"lastTrainerStep": 4})


def test_only_the_writer_patches_the_sets_status() -> None:
    callers = []
    for path in sorted(OPERATOR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "patch_set_status":
                callers.append(path.relative_to(OPERATOR).as_posix())
    assert sorted(set(callers)) == ["cluster/statuswriter.py"]
