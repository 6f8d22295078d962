"""The recovery's phase table, one step at a time (docs/design.md#62-recovery).

Each step is a function of a `RecoveryContext` and the set; these tests run one step over the
unit tests' fake API server (`testsupport.fakecluster`, below the real `Kube`), the set built
by `testsupport.builders` (one model participant, attempt 2 lost, recovering to 3, at most
three tries), with a
participant of canned replies (`testsupport.scripted`) where a step calls the participants,
and check what the step wrote, which Events it posted and which calls it made.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rollout_operator.decide.setplan import plan_attempt
from rollout_operator.flows.recovery import (
    CHECKPOINT_RECORDS_INVALID,
    CHECKPOINT_RECORDS_UNREACHABLE,
    PHASES,
    RecoveryContext,
    RecoveryFailed,
)
from rollout_operator.flows.recovery.backoff import back_off, on_failed_try
from rollout_operator.flows.recovery.context import RecoveryPass
from rollout_operator.flows.recovery.flow import phase_of
from rollout_operator.flows.recovery.pods import start_pods
from rollout_operator.flows.recovery.restore import not_restorable, restore, resume
from rollout_operator.flows.recovery.stopping import stop_attempt
from rollout_operator.model import api
from rollout_operator.model.api import (
    LABEL_ATTEMPT,
    ROLLOUT_CHECKPOINT_PLURAL,
    ROLLOUT_SET_PLURAL,
    RecoveryPhase,
)
from rollout_operator.model.reasons import Reason
from rollout_protocol import ErrorCode, Failure
from testsupport import builders
from testsupport.fakecluster import FakeCluster
from testsupport.recovery import PassStep, context_over, passes_to_end, written
from testsupport.scripted import Scripted
from testsupport.setplan import running

NS, SET = "ns", "rl"
STAMP = "2026-11-29T12:00:00Z"


class Events:
    """The Events a step posted: (reason, warning)."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, bool]] = []

    async def __call__(self, rset: api.RolloutSet, reason: str, message: str, warn: bool) -> None:
        self.posted.append((reason, warn))


def failing(error: RecoveryFailed) -> PassStep:
    """The table's failure handler, for a try that failed with `error`, as a step."""

    async def step(context: RecoveryContext, run: RecoveryPass) -> RecoveryPass | None:
        return await on_failed_try(context, run, error)

    return step


def recovering(phase: str, **recovery: Any) -> FakeCluster:
    """The set `rl` (one model) in `phase` of a recovery from attempt 2 to 3."""
    cluster = FakeCluster()
    cluster.put(
        builders.set_body(
            generation=2,
            port=9000,
            recovery={"maxRestarts": 3},
            status={
                "attempt": 2,
                "createdAttempt": 2,
                "restarts": 1,
                "recovery": {
                    "phase": phase,
                    "fromAttempt": 2,
                    "targetAttempt": 3,
                    "startedAt": STAMP,
                    "reason": "PodDeleted",
                    "message": "participant model-0 of attempt 2: its pod is gone",
                    **recovery,
                },
            },
        )
    )
    return cluster


def ready_checkpoint(name: str) -> dict[str, Any]:
    return builders.checkpoint_body(
        name,
        set_name=SET,
        namespace=NS,
        generation=1,
        created=STAMP,
        status=builders.checkpoint_status("Ready", at=STAMP, completed=STAMP, attempt=2),
    )


async def the_set(cluster: FakeCluster) -> api.RolloutSet:
    return api.RolloutSet.model_validate(await cluster.kube().get_set(NS, SET))


def stored_status(cluster: FakeCluster) -> dict[str, Any]:
    found = cluster.get(ROLLOUT_SET_PLURAL, NS, SET)
    assert found is not None
    status: dict[str, Any] = found["status"]
    return status


def conditions(cluster: FakeCluster) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in stored_status(cluster).get("conditions", [])}


def pods_of(cluster: FakeCluster, attempt: int) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in cluster.list_objects("pods", NS)
        if p["metadata"].get("labels", {}).get(LABEL_ATTEMPT) == str(attempt)
    )


# --- the table --------------------------------------------------------------------------------


async def test_each_persisted_phase_has_its_step_and_exhausted_tries_stop_the_table() -> None:
    assert set(PHASES.steps) == set(RecoveryPhase)
    cluster = recovering("Restoring", tries=4)
    rset = await the_set(cluster)
    context = context_over(cluster)
    assert phase_of(context, rset) is None, "tries past maxRestarts (3): Degraded, nothing runs"
    assert rset.status.recovery is not None
    rset.status.recovery = rset.status.recovery.model_copy(update={"tries": 1})
    assert phase_of(context, rset) is RecoveryPhase.RESTORING
    rset.status.recovery = None
    assert phase_of(context, rset) is None


async def test_the_table_runs_a_recovery_without_a_checkpoint_to_its_end() -> None:
    """Restoring without a checkpoint, then Resuming: a fresh start under attempt 3."""
    cluster = recovering("Restoring")
    events = Events()
    ended = await passes_to_end(context_over(cluster, events=events), await the_set(cluster))
    assert ended is not None
    assert ended.status.recovery is None
    assert ended.status.attempt == 3
    assert conditions(cluster)["Recovering"]["reason"] == Reason.NO_CHECKPOINT
    assert events.posted == [(Reason.NO_CHECKPOINT, False)]


# --- StoppingAttempt --------------------------------------------------------------------------


async def test_recreate_deletes_the_lost_attempts_pods_and_starts_the_try() -> None:
    cluster = recovering("StoppingAttempt", restorePolicy="Recreate")
    rset = await the_set(cluster)
    for manifest in plan_attempt(rset, 2, []).to_create:
        cluster.put(running(manifest, "127.0.2.1"))
    assert pods_of(cluster, 2), "a pod of the lost attempt runs"
    before = datetime.now(UTC).replace(microsecond=0)
    rset = await written(stop_attempt, context_over(cluster), rset)
    assert pods_of(cluster, 2) == []
    recovery = stored_status(cluster)["recovery"]
    assert recovery["phase"] == "StartingPods"
    assert recovery["replaced"] == ["model-0"]
    assert recovery.get("kept", []) == []
    assert api.RolloutSet.model_validate(cluster.get(ROLLOUT_SET_PLURAL, NS, SET)).status.recovery
    assert rset.status.recovery is not None
    assert rset.status.recovery.next_try_at is not None
    assert rset.status.recovery.next_try_at >= before, "the try's timeout counts from here"


async def test_in_place_with_nothing_kept_falls_back_to_recreate_and_says_why() -> None:
    cluster = recovering("StoppingAttempt", restorePolicy="InPlace")
    events = Events()
    rset = await written(stop_attempt, context_over(cluster, events=events), await the_set(cluster))
    assert rset.status.recovery is not None
    assert rset.status.recovery.restore_policy is api.RestorePolicy.RECREATE
    assert rset.status.recovery.fallback
    assert rset.status.recovery.phase is RecoveryPhase.STARTING_PODS
    assert events.posted == [(Reason.IN_PLACE_FALLBACK, True)]


# --- StartingPods -----------------------------------------------------------------------------


async def test_starting_pods_waits_for_the_target_attempt_then_picks_the_checkpoint() -> None:
    cluster = recovering("StartingPods", nextTryAt=api.format_time(datetime.now(UTC)))
    cluster.put(ready_checkpoint("rl-old"))
    rset = await the_set(cluster)
    for manifest in plan_attempt(rset, 3, []).to_create:
        cluster.put(running(manifest, "127.0.3.1"))
    rset = await written(start_pods, context_over(cluster), rset)
    recovery = stored_status(cluster)["recovery"]
    assert recovery["phase"] == "Restoring"
    assert recovery["checkpoint"] == "rl-old"
    (participant,) = stored_status(cluster)["participants"]
    assert participant["ready"] is True
    assert participant["address"] == "http://127.0.3.1:9000"


async def test_starting_pods_creates_them_and_fails_the_try_at_its_deadline() -> None:
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    cluster = recovering("StartingPods", nextTryAt=api.format_time(long_ago))
    with pytest.raises(RecoveryFailed) as failed:
        await written(start_pods, context_over(cluster), await the_set(cluster))
    assert failed.value.reason == Reason.PODS_NOT_READY
    assert "not Ready within restoreTimeoutSeconds" in failed.value.message
    assert pods_of(cluster, 3) == ["rl-model-0-a3"], "the replacement pod was created"


# --- Restoring and Resuming -------------------------------------------------------------------


def with_participant(cluster: FakeCluster) -> None:
    cluster.update(
        ROLLOUT_SET_PLURAL,
        NS,
        SET,
        lambda s: s["status"].update(
            participants=[
                {
                    "role": "model",
                    "index": 0,
                    "pod": "rl-model-0-a3",
                    "ready": True,
                    "address": "http://127.0.3.1:9000",
                }
            ]
        ),
    )


async def test_restore_restores_the_checkpoint_under_the_target_attempt() -> None:
    cluster = recovering("Restoring", checkpoint="rl-old")
    cluster.put(ready_checkpoint("rl-old"))
    with_participant(cluster)
    participant = Scripted(parked=("r1", "r2"))
    rset = await written(restore, context_over(cluster, participant), await the_set(cluster))
    assert participant.called("restore") == ["rl-old"]
    assert participant.called("resume") == [], "Resuming resumes"
    assert rset.status.recovery is not None
    assert rset.status.recovery.phase is RecoveryPhase.RESUMING
    assert rset.status.recovery.episodes_restored == 2


@pytest.mark.parametrize(
    ("refusal", "reason", "verdict", "says"),
    [
        (
            ErrorCode.RECORDS_INVALID,
            Reason.CHECKPOINT_INVALID,
            CHECKPOINT_RECORDS_INVALID,
            "failed verification",
        ),
        (
            ErrorCode.RECORDS_UNREACHABLE,
            Reason.CHECKPOINT_UNREACHABLE,
            CHECKPOINT_RECORDS_UNREACHABLE,
            "unreachable",
        ),
    ],
)
async def test_records_refused_or_not_found_make_the_checkpoint_not_restorable(
    refusal: ErrorCode, reason: str, verdict: str, says: str
) -> None:
    """Damaged records (`records_invalid`) and records the restoring participant cannot find on
    its storage (`records_unreachable`: a volume only a lost node had) both end the try with
    their own reason and mark the checkpoint Ready=False with their own verdict, so the next try
    restores another checkpoint instead of this one again."""
    cluster = recovering("Restoring", checkpoint="rl-old")
    cluster.put(ready_checkpoint("rl-old"))
    with_participant(cluster)
    participant = Scripted(restore_fails=refusal)
    with pytest.raises(RecoveryFailed) as failed:
        await written(restore, context_over(cluster, participant), await the_set(cluster))
    assert failed.value.reason == reason
    assert says in failed.value.message
    assert "rl-old" in failed.value.message
    ckpt = cluster.get(ROLLOUT_CHECKPOINT_PLURAL, NS, "rl-old")
    assert ckpt is not None
    assert ckpt["status"]["phase"] == "Failed"
    ready = next(c for c in ckpt["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", verdict)
    assert "model-0" in ready["message"], "names the participant that refused"


def test_damaged_records_outrank_missing_ones_and_other_failures_keep_the_checkpoint() -> None:
    def failure(instance: str, code: ErrorCode) -> Failure:
        return Failure(instance=instance, code=code, detail="why")

    both = not_restorable(
        "c1",
        [
            failure("model-0", ErrorCode.RECORDS_UNREACHABLE),
            failure("environment-0", ErrorCode.RECORDS_INVALID),
        ],
    )
    assert both is not None
    assert (both[0], both[1].reason) == (CHECKPOINT_RECORDS_INVALID, Reason.CHECKPOINT_INVALID)
    assert "environment-0" in both[1].message
    missing = not_restorable("c1", [failure("model-0", ErrorCode.RECORDS_UNREACHABLE)])
    assert missing is not None
    assert (missing[0], missing[1].reason) == (
        CHECKPOINT_RECORDS_UNREACHABLE,
        Reason.CHECKPOINT_UNREACHABLE,
    )
    for code in (ErrorCode.STORAGE_FAILED, ErrorCode.UNREACHABLE, ErrorCode.INTERNAL):
        assert not_restorable("c1", [failure("model-0", code)]) is None, code


async def test_resume_ends_the_recovery_under_the_target_attempt() -> None:
    cluster = recovering("Resuming", checkpoint="rl-old")
    cluster.put(ready_checkpoint("rl-old"))
    with_participant(cluster)
    participant = Scripted()
    events = Events()
    rset = await written(resume, context_over(cluster, participant, events), await the_set(cluster))
    assert rset is not None
    assert participant.called("resume") == ["rl-old"]
    status = stored_status(cluster)
    assert "recovery" not in status
    assert (status["attempt"], status["createdAttempt"], status["restarts"]) == (3, 3, 2)
    assert status["lastRecovery"]["checkpoint"] == "rl-old"
    shown = conditions(cluster)
    assert shown["Ready"]["status"] == "True"
    assert shown["Recovering"]["reason"] == Reason.RESTORED
    assert events.posted == [(Reason.RESTORED, False)]


# --- a failed try and BackingOff --------------------------------------------------------------


async def test_a_failed_try_backs_off_and_the_next_runs_under_a_newer_attempt() -> None:
    cluster = recovering("Restoring")
    events = Events()
    context = context_over(cluster, events=events)
    failed = RecoveryFailed(Reason.RESTORE_FAILED, "the restore failed")
    rset = await written(failing(failed), context, await the_set(cluster))
    assert rset is not None
    assert rset.status.recovery is not None
    assert rset.status.recovery.phase is RecoveryPhase.BACKING_OFF
    assert rset.status.recovery.tries == 1
    assert events.posted == [(Reason.RESTORE_FAILED, True)]
    # BackingOff waits until nextTryAt, then the next try stops the attempt it tried
    cluster.update(
        ROLLOUT_SET_PLURAL,
        NS,
        SET,
        lambda s: s["status"]["recovery"].update(nextTryAt=STAMP),
    )
    rset = await written(back_off, context, await the_set(cluster))
    assert rset.status.recovery is not None
    assert rset.status.recovery.phase is RecoveryPhase.STOPPING_ATTEMPT
    assert rset.status.recovery.target_attempt == 4


@pytest.mark.parametrize("reason", [Reason.CHECKPOINT_INVALID, Reason.CHECKPOINT_UNREACHABLE])
async def test_an_unrestorable_checkpoint_is_not_a_counted_try_and_the_last_try_degrades(
    reason: str,
) -> None:
    cluster = recovering("Restoring", tries=3)
    events = Events()
    context = context_over(cluster, events=events)
    invalid = RecoveryFailed(reason, "records failed verification or are not there")
    rset = await written(failing(invalid), context, await the_set(cluster))
    assert events.posted == [(reason, True)], "a Warning Event says why"
    assert rset is not None
    assert rset.status.recovery is not None
    assert rset.status.recovery.tries == 3, "not counted"
    lost = RecoveryFailed(Reason.REPLACEMENT_LOST, "a replacement pod was lost")
    assert await written(failing(lost), context, rset) is None
    degraded = conditions(cluster)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", Reason.RESTARTS_EXHAUSTED)
