"""The eviction policy (`decide/policy/eviction.py`, pure): which deleted pods get an Eviction
checkpoint, the prepare deadline their grace period sets, and the hold on the recovery.

Time is an argument (`T0 + seconds`), so each test states exactly when it looks.
"""

from __future__ import annotations

import pytest
from rollout_operator.decide.policy.eviction import (
    EVICTION_COMMIT_MARGIN_SECONDS,
    TerminatingPod,
    eviction_decision,
    eviction_holds,
    eviction_prepare_deadline,
)
from rollout_operator.decide.policy.views import SetView
from rollout_operator.model import api
from rollout_operator.model.api import Trigger
from rollout_operator.model.reasons import Reason
from testsupport.policy import stamp
from testsupport.policyviews import at, ckpt, recovery_status, view


def terminating(
    attempt: int = 3, grace: int = 20, deletion: float = 120, name: str = "math-model-0-a3"
) -> TerminatingPod:
    return TerminatingPod(name=name, attempt=attempt, deletion=at(deletion), grace_seconds=grace)


def test_an_evicted_pod_of_the_current_attempt_gets_one_eviction_checkpoint() -> None:
    create = eviction_decision(view(), terminating())
    assert create is not None
    assert create.name == "math-evict-a3"
    assert create.trigger is Trigger.EVICTION
    assert "grace period 20s" in create.why


@pytest.mark.parametrize(
    ("rset", "pod"),
    [
        (view(policy={"onEviction": False}), terminating()),
        (view(), terminating(attempt=2)),
        (view(), terminating(grace=1)),
        (view(suspend=True), terminating()),
        (view(suspended=(True, Reason.SUSPENDED)), terminating()),
        (view(status={"recovery": recovery_status()}), terminating()),
        (view(recovery={"targetLevel": "sibling"}), terminating()),
    ],
    ids=["off", "old-attempt", "no-grace", "suspending", "suspended", "recovering", "sibling"],
)
def test_pods_the_operator_deletes_itself_are_not_evictions(
    rset: SetView, pod: TerminatingPod
) -> None:
    assert eviction_decision(rset, pod) is None


def test_recovery_holds_an_evicted_pod_until_its_checkpoint_finished_or_grace_ended() -> None:
    pods = [terminating(), terminating(grace=1, name="forced")]
    assert eviction_holds(view(), pods, [], at(100)) == {"math-model-0-a3"}
    assert eviction_holds(view(), pods, [ckpt("math-evict-a3", 101)], at(102)) == {
        "math-model-0-a3"
    }
    finished = [ckpt("math-evict-a3", 101, completed=105, ready=True)]
    assert eviction_holds(view(), pods, finished, at(106)) == frozenset()
    assert eviction_holds(view(), pods, [], at(120)) == frozenset()


def test_an_eviction_prepare_ends_before_the_evicted_pod_is_killed() -> None:
    # Pod killed at t=120 (20 s grace from t=100); the prepare starts at t=101 with 300 s of
    # prepareTimeoutSeconds: the grace period decides, less the commit's margin.
    deadline = eviction_prepare_deadline(at(101), 300, [terminating()], attempt=3)
    assert deadline.at == at(120 - EVICTION_COMMIT_MARGIN_SECONDS)
    assert deadline.killed == terminating()
    assert "pod math-model-0-a3 is killed at 2026-11-29T12:02:00Z" in deadline.why
    assert f"{EVICTION_COMMIT_MARGIN_SECONDS:g}s before" in deadline.why


def test_an_eviction_prepare_keeps_a_shorter_prepare_timeout() -> None:
    deadline = eviction_prepare_deadline(at(101), 10, [terminating()], attempt=3)
    assert deadline.at == at(111)
    assert deadline.killed is None
    assert deadline.why == ""


def test_the_first_kill_among_the_attempts_terminating_pods_decides() -> None:
    # A drain evicts several pods; pods of another attempt or already stopped do not count.
    pods = [
        terminating(deletion=130, name="math-env-0-a3"),
        terminating(deletion=115, name="math-model-0-a3"),
        terminating(attempt=2, deletion=105, name="math-model-0-a2"),
        TerminatingPod("math-agent-0-a3", 3, at(104), 20, finished=True),
    ]
    deadline = eviction_prepare_deadline(at(101), 300, pods, attempt=3)
    assert deadline.killed is not None
    assert deadline.killed.name == "math-model-0-a3"
    assert deadline.at == at(115 - EVICTION_COMMIT_MARGIN_SECONDS)


def test_an_eviction_deadline_can_be_past_already() -> None:
    """A checkpoint that queued until its pod's grace period ran out: the deadline lies before
    `now`, and the flow fails it (GracePeriodTooShort) instead of preparing."""
    deadline = eviction_prepare_deadline(at(119), 300, [terminating()], attempt=3)
    assert deadline.at < at(119)
    assert deadline.killed is not None


def test_without_a_terminating_pod_the_prepare_timeout_applies() -> None:
    assert eviction_prepare_deadline(at(101), 300, [], attempt=3).at == at(401)
    assert eviction_prepare_deadline(at(101), 300, [terminating()], attempt=None).at == at(401)


def test_terminating_pods_are_read_from_the_wire_form() -> None:
    pod = {
        "metadata": {
            "name": "p",
            "labels": {api.LABEL_ATTEMPT: "4"},
            "deletionTimestamp": stamp(30),
            "deletionGracePeriodSeconds": 20,
        },
        "status": {"phase": "Running"},
    }
    assert TerminatingPod.from_pod(pod, api.LABEL_ATTEMPT) == TerminatingPod(
        "p", 4, at(30), 20, False
    )
    del pod["metadata"]["deletionTimestamp"]
    assert TerminatingPod.from_pod(pod, api.LABEL_ATTEMPT) is None
