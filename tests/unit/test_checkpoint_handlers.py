"""What the operator registers with Kopf for the RolloutCheckpoint kind, and what Kopf then does
to every checkpoint event (docs/design.md#65-retention-and-records).

No change handler (`on.create`, `on.update`, `on.delete`, `on.field`, `on.resume`) and no daemon
that needs Kopf's finalizer: Kopf then keeps no diff-base and puts no finalizer of its own on a
checkpoint (two patches and two watch events per checkpoint before). The records finalizer is
the operator's own (`RECORDS_FINALIZER`), tested with the flows in test_policy_ops.py. The
diff-base is built only for the kinds that have change handlers (`settings.DIFF_BASE_KINDS`),
checked against Kopf's registry so a change handler added later cannot go without one.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
import rollout_operator.handlers  # noqa: F401  (registers every handler)
from rollout_operator.flows.state import OperatorState
from rollout_operator.handlers.rolloutcheckpoint import checkpoint_event
from rollout_operator.handlers.runtime import MEMO_STATE
from rollout_operator.model import api
from rollout_operator.model.settings import DIFF_BASE_KINDS, DIFFBASE_KEY, CompactDiffBaseStorage
from testsupport import builders

PLURAL_OF_KIND = {
    api.ROLLOUT_SET_KIND: api.ROLLOUT_SET_PLURAL,
    api.ROLLOUT_CHECKPOINT_KIND: api.ROLLOUT_CHECKPOINT_PLURAL,
}


def _selects(handler: Any, plural: str) -> bool:
    return bool(handler.selector.any_name == plural or handler.selector.plural == plural)


def test_the_checkpoint_kind_has_no_change_handlers() -> None:
    registry = kopf.get_default_registry()
    changing = [
        h.id
        for h in registry._changing.get_all_handlers()
        if _selects(h, api.ROLLOUT_CHECKPOINT_PLURAL)
    ]
    assert changing == []


def test_no_handler_of_the_checkpoint_kind_asks_for_kopfs_finalizer() -> None:
    registry = kopf.get_default_registry()
    daemons = [
        h
        for h in registry._spawning.get_all_handlers()
        if _selects(h, api.ROLLOUT_CHECKPOINT_PLURAL)
    ]
    assert [h.id for h in daemons] == ["run"], "the checkpoint flow's daemon is still there"
    assert all(not h.requires_finalizer for h in daemons)


def test_the_diff_base_is_built_for_exactly_the_kinds_with_change_handlers() -> None:
    registry = kopf.get_default_registry()
    with_changes = {
        plural
        for h in registry._changing.get_all_handlers()
        for plural in (api.ROLLOUT_SET_PLURAL, api.ROLLOUT_CHECKPOINT_PLURAL, "pods", "nodes")
        if _selects(h, plural)
    }
    assert with_changes == {PLURAL_OF_KIND[kind] for kind in DIFF_BASE_KINDS}


def test_the_diff_base_of_a_kind_without_change_handlers_is_empty() -> None:
    storage = CompactDiffBaseStorage(prefix=api.GROUP, key=DIFFBASE_KEY, v1=False)
    checkpoint = builders.checkpoint_body(
        "ck", set_name="rl", namespace=None, trigger=None, labels={"a": "b"}
    )
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"x": 1}}
    rollout_set = {
        "apiVersion": api.API_VERSION,
        "kind": api.ROLLOUT_SET_KIND,
        "metadata": {"name": "rl"},
        "spec": {"suspend": True},
    }
    assert storage.build(body=kopf.Body(checkpoint)) == {}
    assert storage.build(body=kopf.Body(pod)) == {}
    assert storage.build(body=kopf.Body(rollout_set)) == {"spec": {"suspend": True}}


# --- which checkpoint events wake the set's loops -------------------------------------------------


def checkpoint_body(phase: str | None, *, deleting: bool = False) -> dict[str, Any]:
    return builders.checkpoint_body(
        "ck",
        set_name="rl",
        trigger=None,
        finalizers=[api.RECORDS_FINALIZER],
        deleted="2026-12-01T10:00:00Z" if deleting else None,
        status={"phase": phase} if phase else {},
    )


async def test_only_events_that_change_what_a_loop_reads_wake_it() -> None:
    """A fast checkpoint's life: created, its finalizer, published (Resuming), Ready, deleted.
    The policy looks when it finished and when it goes; the set's pass also when it entered
    Preparing (`activeCheckpoint`). A first sight without a phase and the finalizer wake
    neither."""
    state = OperatorState()
    memo = kopf.Memo()
    memo[MEMO_STATE] = state
    woken: list[tuple[str, str]] = []

    async def event(type_: str | None, body: dict[str, Any]) -> None:
        with (
            state.set_loops.registered("ns", "rl") as set_loop,
            state.policy_loops.registered("ns", "rl") as policy_loop,
        ):
            wrapped = kopf.Body(body)
            await checkpoint_event(
                type=type_,
                namespace="ns",
                name="ck",
                body=wrapped,
                spec=wrapped.spec,
                status=wrapped.status,
                memo=memo,
                logger=logging.getLogger("test"),
            )
            phase = str((body.get("status") or {}).get("phase"))
            if set_loop.is_set():
                woken.append(("set", phase))
            if policy_loop.is_set():
                woken.append(("policy", phase))

    await event("ADDED", checkpoint_body(None))
    await event("MODIFIED", checkpoint_body(None))  # its own finalizer, say
    await event("MODIFIED", checkpoint_body("Resuming"))
    await event("MODIFIED", checkpoint_body("Ready"))
    await event("MODIFIED", checkpoint_body("Ready"))  # an annotation changed
    assert woken == [("set", "Ready"), ("policy", "Ready")]
    woken.clear()
    await event("MODIFIED", checkpoint_body("Ready", deleting=True))
    assert woken == [("set", "Ready"), ("policy", "Ready")]
    woken.clear()
    await event("MODIFIED", checkpoint_body(None))  # another one of that name, reset: Preparing
    await event("MODIFIED", checkpoint_body("Preparing"))
    assert ("set", "Preparing") in woken
    assert ("policy", "Preparing") not in woken
