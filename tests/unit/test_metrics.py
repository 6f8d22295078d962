"""The operator's Prometheus metrics and set-transition Events (`rollout_operator.metrics`).

Metrics live in the process-wide default registry (what `--metrics-port` serves), so every test
uses set names of its own and reads values back through the registry, as a scrape would.
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from rollout_operator import metrics
from rollout_operator.model.api import RolloutCheckpoint, RolloutSet
from testsupport import builders
from testsupport.fakecluster import FakeCluster

NAMESPACE = "team-a"
SHA = "ab" * 32


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def checkpoint(set_name: str, phase: str, **status: Any) -> RolloutCheckpoint:
    return builders.rollout_checkpoint(
        name=unique("ckpt"),
        set_name=set_name,
        namespace=NAMESPACE,
        status={"phase": phase, **status},
    )


def participant(instance: str, size: int) -> dict[str, Any]:
    return {
        "instance": instance,
        "manifest": f"s/c/{instance}/manifest.json",
        "recordsSha256": SHA,
        "recordCount": 3,
        "bytes": size,
    }


def rollout_set(name: str, attempt: int) -> RolloutSet:
    return builders.rollout_set(
        name=name,
        namespace=NAMESPACE,
        uid="u-1",
        participants=[builders.participant("model", container_name="m")],
        status={"attempt": attempt},
    )


# --- checkpoints --------------------------------------------------------------------------------


def test_a_ready_checkpoint_records_durations_bytes_and_episodes() -> None:
    name = unique("set")
    ready = checkpoint(
        name,
        "Ready",
        episodes=12,
        restarts=2,
        participants=[participant("model-0", 1000), participant("environment-0", 234)],
        durations={
            "prepareSeconds": 0.2,
            "commitSeconds": 0.1,
            "pauseSeconds": 0.4,
            "totalSeconds": 1.5,
        },
    )
    assert metrics.observe_checkpoint(ready) is True
    labels = {"namespace": NAMESPACE, "set": name, "trigger": "Manual", "outcome": "Ready"}
    assert value("rollout_checkpoint_duration_seconds_count", **labels) == 1
    assert value("rollout_checkpoint_duration_seconds_sum", **labels) == pytest.approx(1.5)
    assert value("rollout_checkpoint_duration_seconds_bucket", **labels, le="1.0") == 0
    assert value("rollout_checkpoint_duration_seconds_bucket", **labels, le="2.5") == 1
    assert value("rollout_checkpoint_pause_seconds_sum", **labels) == pytest.approx(0.4)
    by_set = {"namespace": NAMESPACE, "set": name}
    assert value("rollout_checkpoint_bytes_total", **by_set) == 1234
    assert value("rollout_checkpoint_episodes_continued_total", **by_set) == 12
    assert value("rollout_checkpoint_episodes_restarted_total", **by_set) == 2

    metrics.observe_checkpoint(
        checkpoint(name, "Ready", episodes=3, participants=[participant("m", 6)])
    )
    assert value("rollout_checkpoint_bytes_total", **by_set) == 1240
    assert value("rollout_checkpoint_episodes_continued_total", **by_set) == 15
    assert value("rollout_checkpoint_duration_seconds_count", **labels) == 1, "no duration known"


def test_a_failed_checkpoint_counts_its_duration_but_no_bytes_or_episodes() -> None:
    name = unique("set")
    failed = checkpoint(
        name,
        "Failed",
        episodes=5,
        startedAt="2026-01-01T10:00:00Z",
        completedAt="2026-01-01T10:00:07Z",
    )
    assert metrics.observe_checkpoint(failed) is True
    labels = {"namespace": NAMESPACE, "set": name, "trigger": "Manual", "outcome": "Failed"}
    assert value("rollout_checkpoint_duration_seconds_sum", **labels) == 7
    assert value("rollout_checkpoint_pause_seconds_count", **labels) is None
    assert value("rollout_checkpoint_bytes_total", namespace=NAMESPACE, set=name) is None
    assert (
        value("rollout_checkpoint_episodes_continued_total", namespace=NAMESPACE, set=name) is None
    )


@pytest.mark.parametrize("phase", ["Queued", "Preparing", "Committing", "Resuming"])
def test_a_running_checkpoint_records_nothing(phase: str) -> None:
    name = unique("set")
    assert metrics.observe_checkpoint(checkpoint(name, phase, episodes=4)) is False
    text = generate_latest(REGISTRY).decode()
    assert f'set="{name}"' not in text


def test_the_completion_message_says_what_it_holds_and_costs() -> None:
    ready = checkpoint(
        "s", "Ready", episodes=7, restarts=1, durations={"pauseSeconds": 0.25, "totalSeconds": 2.0}
    )
    assert metrics.completion_message(ready) == (
        "participants resumed; 7 episode(s) continue from it, 1 restart; took 2.000s; "
        "admission closed 0.250s"
    )


async def test_checkpoint_ended_reads_the_final_status_and_records_it() -> None:
    name = unique("set")
    ready = checkpoint(
        name, "Ready", episodes=2, durations={"totalSeconds": 3.0, "pauseSeconds": 0.1}
    )
    cluster = FakeCluster()
    cluster.put(ready.model_dump(mode="json", by_alias=True, exclude_none=True))
    kube = cluster.kube(watching=False)
    ended = await metrics.checkpoint_ended(kube, NAMESPACE, ready.metadata.name)
    assert ended is not None
    assert ended.status.episodes == 2
    assert [(r.verb, r.plural, r.name) for r in cluster.requests] == [
        ("get", "rolloutcheckpoints", ready.metadata.name)
    ]
    labels = {"namespace": NAMESPACE, "set": name, "trigger": "Manual", "outcome": "Ready"}
    assert value("rollout_checkpoint_duration_seconds_sum", **labels) == 3.0
    assert await metrics.checkpoint_ended(kube, NAMESPACE, "deleted") is None


# --- recovery and attempts ----------------------------------------------------------------------


@pytest.mark.parametrize("outcome", sorted(metrics.RESTORE_OUTCOMES))
def test_restores_are_counted_by_outcome_and_follow_the_attempt(outcome: str) -> None:
    name = unique("set")
    metrics.observe_recovery(rollout_set(name, 2), "PodFailed")
    assert (
        value("rollout_restores_total", namespace=NAMESPACE, set=name, outcome="PodFailed") is None
    )
    assert value("rollout_set_attempt", namespace=NAMESPACE, set=name) == 2
    metrics.observe_recovery(rollout_set(name, 3), outcome)
    assert value("rollout_restores_total", namespace=NAMESPACE, set=name, outcome=outcome) == 1
    assert value("rollout_set_attempt", namespace=NAMESPACE, set=name) == 3


# --- set transitions ----------------------------------------------------------------------------


def condition(type_: str, status: str, reason: str, message: str = "") -> dict[str, str]:
    return {"type": type_, "status": status, "reason": reason, "message": message or reason}


def body(name: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NAMESPACE}, "status": status}


def test_the_first_sight_primes_and_the_attempt_gauge_follows_every_event() -> None:
    name = unique("set")
    watch = metrics.SetTransitions()
    ready = [condition("Ready", "True", "AllParticipantsReady")]
    assert watch.observe(None, body(name, attempt=4, conditions=ready)) == []
    assert value("rollout_set_attempt", namespace=NAMESPACE, set=name) == 4
    assert watch.observe("MODIFIED", body(name, attempt=4, conditions=ready)) == []
    assert watch.observe("DELETED", body(name, attempt=4, conditions=ready)) == []
    assert value("rollout_set_attempt", namespace=NAMESPACE, set=name) is None
    metrics.forget_set(NAMESPACE, name)  # a second removal is harmless


def test_reconciler_condition_changes_become_one_event_per_update() -> None:
    name = unique("set")
    watch = metrics.SetTransitions()
    watch.observe("ADDED", body(name))
    starting = [
        condition("Ready", "False", "Starting", "starting the participant pods of attempt 1"),
        condition("Progressing", "True", "Starting"),
    ]
    (first,) = watch.observe("MODIFIED", body(name, attempt=1, conditions=starting))
    assert first == metrics.Transition(
        "Starting",
        "Ready=False, Progressing=True: starting the participant pods of attempt 1",
        False,
    )
    ready = [
        condition("Ready", "True", "AllParticipantsReady", "all 1 participant pods are Ready"),
        condition("Progressing", "False", "AllParticipantsReady"),
    ]
    (second,) = watch.observe("MODIFIED", body(name, attempt=1, conditions=ready))
    assert second.reason == "AllParticipantsReady"
    assert not second.warning
    assert watch.observe("MODIFIED", body(name, attempt=1, conditions=ready)) == []
    degraded = [*ready[:1], condition("Degraded", "True", "PodCreationRefused", "quota")]
    degraded[0] = condition("Ready", "False", "PodCreationRefused", "quota")
    (third,) = watch.observe("MODIFIED", body(name, attempt=1, conditions=degraded))
    assert third.reason == "PodCreationRefused"
    assert third.warning
    assert third.message.startswith("Degraded=True, Ready=False: ")


def test_a_recovery_hold_is_posted_by_the_recovery_only() -> None:
    """The hold writes Degraded and Ready, then the set's pass writes them again with its own
    message: neither update is one more Warning (the recovery posts the hold once)."""
    name = unique("set")
    watch = metrics.SetTransitions()
    watch.observe("ADDED", body(name, attempt=3, conditions=[condition("Ready", "True", "A")]))
    held = "recovery stopped: model-0 of attempt 3: OOMKilled; 11 recoveries in 3600s"
    hold = [
        condition("Ready", "False", "RecoveryLimitReached", held),
        condition("Degraded", "True", "RecoveryLimitReached", held),
    ]
    assert watch.observe("MODIFIED", body(name, attempt=3, conditions=hold)) == []
    again = [
        condition("Ready", "False", "RecoveryLimitReached", held + " (set pass)"),
        condition("Degraded", "True", "RecoveryLimitReached", held + " (set pass)"),
    ]
    assert watch.observe("MODIFIED", body(name, attempt=3, conditions=again)) == []
    retried = [condition("Ready", "True", "AllParticipantsReady", "all Ready")]
    (back,) = watch.observe("MODIFIED", body(name, attempt=4, conditions=retried))
    assert back.reason == "AllParticipantsReady", "other transitions still post"


def test_recovery_phases_get_events_but_its_start_and_end_do_not() -> None:
    """The recovery flow posts the start and the end itself (with the loss and the outcome)."""
    name = unique("set")
    watch = metrics.SetTransitions()
    watch.observe("ADDED", body(name, attempt=1, conditions=[condition("Ready", "True", "A")]))

    def recovering(phase: str, target: int = 2) -> dict[str, Any]:
        message = f"attempt 1 -> {target}: {phase}"
        return body(
            name,
            attempt=1,
            recovery={"phase": phase, "fromAttempt": 1, "targetAttempt": target},
            conditions=[
                condition("Ready", "False", "PodFailed"),
                condition("Recovering", "True", phase, message),
            ],
        )

    assert watch.observe("MODIFIED", recovering("StoppingAttempt")) == []
    (starting,) = watch.observe("MODIFIED", recovering("StartingPods"))
    assert starting == metrics.Transition("StartingPods", "attempt 1 -> 2: StartingPods", False)
    (backing_off,) = watch.observe("MODIFIED", recovering("BackingOff"))
    assert backing_off.warning
    (next_try,) = watch.observe("MODIFIED", recovering("StoppingAttempt", target=3))
    assert next_try.reason == "StoppingAttempt"
    done = body(name, attempt=3, conditions=[condition("Ready", "True", "Restored")])
    assert watch.observe("MODIFIED", done) == []
    assert value("rollout_set_attempt", namespace=NAMESPACE, set=name) == 3


def test_the_exposition_names_every_metric() -> None:
    text = generate_latest(REGISTRY).decode()
    for name in (
        "rollout_checkpoint_duration_seconds",
        "rollout_checkpoint_pause_seconds",
        "rollout_checkpoint_bytes_total",
        "rollout_checkpoint_episodes_continued_total",
        "rollout_checkpoint_episodes_restarted_total",
        "rollout_restores_total",
        "rollout_set_attempt",
    ):
        assert f"# HELP {name.removesuffix('_total')}" in text
