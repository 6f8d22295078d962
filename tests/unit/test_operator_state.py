"""The parts of the operator's in-process state (`rollout_operator/flows/state.py`,
docs/design.md#611-the-operators-in-process-state) and how handlers find it in Kopf's memo."""

from __future__ import annotations

import asyncio
import copy

import anyio
import kopf
from rollout_operator.flows.state import (
    CheckpointWork,
    LatestWritten,
    LoggedNotes,
    OperatorState,
    SeenSummaries,
    Wakeups,
)
from rollout_operator.handlers.runtime import MEMO_STATE, state_of

# --- Wakeups ------------------------------------------------------------------------------------


def test_a_wake_sets_the_event_of_the_sets_loop_only() -> None:
    loops = Wakeups()
    with loops.registered("team", "a") as a, loops.registered("team", "b") as b:
        loops.wake("team", "a")
        assert a.is_set()
        assert not b.is_set()
        assert sorted(loops.sets()) == [("team", "a"), ("team", "b")]


def test_a_wake_without_a_loop_or_a_name_does_nothing() -> None:
    loops = Wakeups()
    loops.wake("team", "nobody")
    loops.wake("team", None)
    loops.wake("team", 3)
    assert loops.sets() == []


def test_no_namespace_is_the_default_namespace() -> None:
    loops = Wakeups()
    with loops.registered("default", "a") as event:
        loops.wake(None, "a")
        assert event.is_set()


def test_the_event_goes_when_the_loop_returns_or_raises() -> None:
    loops = Wakeups()
    with loops.registered("team", "a"):
        pass
    assert loops.sets() == []
    try:
        with loops.registered("team", "a"):
            raise asyncio.CancelledError
    except asyncio.CancelledError:
        pass
    assert loops.sets() == []


def test_a_second_loop_of_the_set_shares_the_event_and_the_first_to_end_removes_it() -> None:
    """As the module registries did: `setdefault` on start; removed by whichever loop ends
    first while the event is still the one it registered."""
    loops = Wakeups()
    with loops.registered("team", "a") as first:
        with loops.registered("team", "a") as second:
            assert second is first
        assert loops.sets() == []
        loops.wake("team", "a")
        assert not first.is_set()


def test_sets_is_a_copy_that_waking_cannot_change() -> None:
    loops = Wakeups()
    with loops.registered("team", "a"):
        listed = loops.sets()
        with loops.registered("team", "b"):
            assert listed == [("team", "a")]


# --- SeenSummaries ------------------------------------------------------------------------------


def test_a_pod_is_news_the_first_time_and_when_what_is_seen_changes() -> None:
    seen = SeenSummaries()
    assert seen.changed("team", "p", "v1")
    assert not seen.changed("team", "p", "v1")
    assert seen.changed(None, "p", "v1"), "the same pod name in another namespace"
    assert seen.changed("team", "p", "v2")
    assert seen.changed("team", "q", "v2"), "each pod on its own"


def test_a_deleted_pod_is_always_news_and_is_forgotten() -> None:
    seen = SeenSummaries()
    assert seen.changed("team", "p", None), "even one never seen"
    assert seen.changed("team", "p", "v1")
    assert seen.changed("team", "p", None)
    assert seen.changed("team", "p", "v1"), "a pod of the same name later is new"


def test_pods_without_a_namespace_are_in_the_default_one() -> None:
    seen = SeenSummaries()
    assert seen.changed("default", "p", "v1")
    assert not seen.changed(None, "p", "v1")


# --- LatestWritten ------------------------------------------------------------------------------


def test_nothing_is_written_elsewhere_before_the_pass_wrote() -> None:
    written = LatestWritten()
    assert not written.written_elsewhere("team", "a", "ckpt-1")
    assert written.last("team", "a") is None


def test_a_shown_value_other_than_the_last_written_is_written_elsewhere() -> None:
    written = LatestWritten()
    written.record("team", "a", "ckpt-2")
    assert written.last("team", "a") == "ckpt-2"
    assert not written.written_elsewhere("team", "a", "ckpt-2")
    assert written.written_elsewhere("team", "a", "ckpt-1")
    assert written.written_elsewhere("team", "a", None)
    assert not written.written_elsewhere("team", "b", "ckpt-1"), "per set"


def test_none_written_is_remembered_as_written() -> None:
    written = LatestWritten()
    written.record("team", "a", None)
    assert not written.written_elsewhere("team", "a", None)
    assert written.written_elsewhere("team", "a", "ckpt-1")


# --- LoggedNotes --------------------------------------------------------------------------------


def test_each_note_is_logged_the_first_time_only() -> None:
    logged = LoggedNotes()
    assert logged.first_time("team", "a", "InvalidStep", "bad")
    assert not logged.first_time("team", "a", "InvalidStep", "bad")
    assert logged.first_time("team", "a", "InvalidStep", "worse"), "another message"
    assert logged.first_time("team", "b", "InvalidStep", "bad"), "another set"


def test_past_the_limit_the_oldest_note_is_forgotten() -> None:
    logged = LoggedNotes(limit=2)
    assert logged.first_time("team", "a", "R", "1")
    assert logged.first_time("team", "a", "R", "2")
    assert logged.first_time("team", "a", "R", "3")
    assert not logged.first_time("team", "a", "R", "3")
    assert not logged.first_time("team", "a", "R", "2")
    assert logged.first_time("team", "a", "R", "1"), "the oldest was forgotten"


# --- OperatorState in the memo ------------------------------------------------------------------


def test_every_part_is_its_own_per_state() -> None:
    one, two = OperatorState(), OperatorState()
    assert one.set_loops is not one.policy_loops
    assert one.set_loops is not two.set_loops
    assert one.owned_objects is not two.owned_objects
    assert one.transitions is not two.transitions


def test_handlers_share_the_state_the_startup_put_in_the_memo() -> None:
    """Kopf hands each object's handlers a shallow copy of the operator's memo: the state the
    startup handler put there is the same object for all of them."""
    memo = kopf.Memo()
    state = OperatorState()
    memo[MEMO_STATE] = state
    for_one_set, for_another = copy.copy(memo), copy.copy(memo)
    assert state_of(for_one_set) is state
    assert state_of(for_another) is state


def test_a_memo_without_state_gets_one_and_keeps_it() -> None:
    """A handler called without the operator's startup (as unit tests do) runs as in a process
    that has just started, and its later calls with that memo see the same state."""
    memo = kopf.Memo()
    state = state_of(memo)
    assert isinstance(state, OperatorState)
    assert state_of(memo) is state


def test_a_flow_runs_while_its_context_is_entered() -> None:
    work = CheckpointWork()
    with work.flow_running("ns", "ck"):
        assert work.flow_runs("ns", "ck")
        assert not work.flow_runs("ns", "other")
    assert not work.flow_runs("ns", "ck")


async def test_one_records_removal_per_checkpoint_at_a_time() -> None:
    work = CheckpointWork()
    gate = asyncio.Event()
    started: list[str] = []

    async def removal() -> None:
        started.append("ck")
        await gate.wait()

    task = work.remove("ns", "ck", removal)
    assert task is not None
    assert work.remove("ns", "ck", removal) is None, "a repeat while it runs starts nothing"
    gate.set()
    with anyio.fail_after(5):
        await task
    assert started == ["ck"]
    again = work.remove("ns", "ck", removal)
    assert again is not None, "once ended, a new event starts it again"
    await work.close()
    assert again.cancelled()
