"""The suspend policy (`decide/policy/suspend.py`, pure): checkpoint, release, resume, and a suspend
after a deadline.

Time is an argument (`T0 + seconds`), so each test states exactly when it looks.
"""

from __future__ import annotations

from rollout_operator.decide.policy.plan import plan
from rollout_operator.decide.policy.suspend import SuspendAction, suspend_decision
from rollout_operator.decide.policy.views import ANNOTATION_DEADLINE_OUTCOME, DeadlineRecord
from rollout_operator.model.api import Trigger
from rollout_operator.model.reasons import Reason
from testsupport.policyviews import at, ckpt, deadline_view, recovery_status, view


def test_suspend_checkpoints_first_then_releases_the_pods() -> None:
    rset = view(suspend=True)
    first = suspend_decision(rset, [])
    assert first.action is SuspendAction.CHECKPOINT
    assert first.create is not None
    assert first.create.name == "math-suspend-a3"
    assert first.create.trigger is Trigger.SUSPEND
    assert first.condition is not None
    assert first.condition.reason == Reason.SUSPENDING
    running = suspend_decision(rset, [ckpt("math-suspend-a3", 10)])
    assert running.action is SuspendAction.WAIT
    assert running.create is None
    done = suspend_decision(rset, [ckpt("math-suspend-a3", 10, completed=12, ready=True)])
    assert done.action is SuspendAction.RELEASE
    assert done.condition is not None
    assert done.condition.status is True
    assert "math-suspend-a3 holds the state" in done.condition.message


def test_a_failed_suspend_checkpoint_still_releases_and_names_what_a_resume_restores() -> None:
    rset = view(suspend=True, status={"latestCheckpoint": "older"})
    decision = suspend_decision(rset, [ckpt("math-suspend-a3", 10, completed=12, failed=True)])
    assert decision.action is SuspendAction.RELEASE
    assert decision.condition is not None
    assert "a resume restores older" in decision.condition.message


def test_suspend_waits_for_a_running_recovery() -> None:
    rset = view(suspend=True, status={"recovery": recovery_status()})
    assert suspend_decision(rset, []).action is SuspendAction.WAIT


def test_suspend_without_pods_is_immediate_and_stays_released() -> None:
    assert suspend_decision(view(suspend=True, live_pods=0), []).action is SuspendAction.RELEASE
    done = view(suspend=True, live_pods=0, suspended=(True, Reason.SUSPENDED))
    assert suspend_decision(done, []).action is SuspendAction.NONE
    stray = view(suspend=True, live_pods=1, suspended=(True, Reason.SUSPENDED))
    assert suspend_decision(stray, []).action is SuspendAction.RELEASE


def test_unsuspend_resumes_and_withdrawn_suspend_is_reported() -> None:
    resumed = suspend_decision(view(live_pods=0, suspended=(True, Reason.SUSPENDED)), [])
    assert resumed.action is SuspendAction.RESUME
    assert resumed.condition is not None
    assert resumed.condition.reason == Reason.RESUMED
    withdrawn = suspend_decision(view(suspended=(False, Reason.SUSPENDING)), [])
    assert withdrawn.condition is not None
    assert withdrawn.condition.reason == Reason.SUSPEND_CANCELLED
    assert suspend_decision(view(), []).action is SuspendAction.NONE


def test_after_deadline_suspend_uses_the_deadline_checkpoint() -> None:
    own = "math-deadline-20261129-121640"
    rset = deadline_view(policy={"afterDeadline": "Suspend"})
    done = [ckpt(own, 993, trigger=Trigger.DEADLINE, completed=997, ready=True)]
    decided = plan(rset, done, at(998))
    assert decided.settle is not None
    assert decided.settle.checkpoint == own
    assert decided.suspend is SuspendAction.RELEASE
    assert decided.creates == []
    suspended = next(c for c in decided.conditions if c.type == "Suspended")
    assert suspended.reason == Reason.DEADLINE_REACHED
    assert own in suspended.message
    assert "later mustSaveBy" in suspended.message


def test_after_deadline_suspend_lifts_when_the_deadline_moves() -> None:
    record = DeadlineRecord(at(1000), Reason.SAVED, "x", saved=True)
    annotations = {ANNOTATION_DEADLINE_OUTCOME: record.to_annotation()}
    still = deadline_view(
        policy={"afterDeadline": "Suspend"},
        annotations=annotations,
        suspended=(True, Reason.DEADLINE_REACHED),
        live_pods=0,
    )
    assert suspend_decision(still, []).action is SuspendAction.NONE
    moved = deadline_view(
        must=9000,
        policy={"afterDeadline": "Suspend"},
        annotations=annotations,
        suspended=(True, Reason.DEADLINE_REACHED),
        live_pods=0,
    )
    assert suspend_decision(moved, []).action is SuspendAction.RESUME
