"""Planning an attempt's pods (peer order) and the set's conditions, without a cluster."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from rollout_operator.decide.setplan import (
    PodView,
    attempt_instances,
    describe_spec_change,
    plan_attempt,
    set_conditions,
)
from rollout_operator.model import api
from rollout_operator.model.conditions import ConditionUpdate
from rollout_operator.model.reasons import Reason
from rollout_protocol import Role
from testsupport.setplan import make_set, running, start_all, views

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def env(manifest: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in manifest["spec"]["containers"][0]["env"] if "value" in e}


def test_callees_are_created_first_and_callers_wait_for_their_addresses() -> None:
    rset = make_set()
    plan = plan_attempt(rset, 1, [])
    assert sorted(p["metadata"]["name"] for p in plan.to_create) == [
        "rl-model-0-a1",
        "rl-resources-0-a1",
    ]
    assert sorted(plan.waiting_for_peers) == [
        "rl-agent-0-a1",
        "rl-environment-0-a1",
        "rl-environment-1-a1",
    ]
    assert not plan.complete


def test_the_agent_gets_its_peers_urls_then_the_environment_gets_all_three() -> None:
    rset = make_set()
    first = plan_attempt(rset, 1, [])
    model, resources = sorted(first.to_create, key=lambda p: p["metadata"]["name"])
    pods = [running(model, "127.0.1.1"), running(resources, "127.0.1.2")]
    second = plan_attempt(rset, 1, views(*pods))
    (agent,) = second.to_create
    assert agent["metadata"]["name"] == "rl-agent-0-a1"
    assert env(agent)["ROLLOUT_PEER_MODEL_URL"] == "http://127.0.1.1:9000"
    assert env(agent)["ROLLOUT_PEER_RESOURCES_URL"] == "http://127.0.1.2:9000"
    pods.append(running(agent, "127.0.1.3"))
    third = plan_attempt(rset, 1, views(*pods))
    assert [p["metadata"]["name"] for p in third.to_create] == [
        "rl-environment-0-a1",
        "rl-environment-1-a1",
    ]
    for environment in third.to_create:
        assert env(environment)["ROLLOUT_PEER_AGENT_URL"] == "http://127.0.1.3:9000"
        assert env(environment)["ROLLOUT_PEER_MODEL_URL"] == "http://127.0.1.1:9000"


def test_each_instance_talks_to_index_mod_replicas_of_its_peer() -> None:
    rset = make_set({"model": 1, "agent": 2, "environment": 3})
    pods = start_all(rset)
    assert len(pods) == 6
    assert plan_attempt(rset, 1, pods).all_ready
    agents = {p.index: p.ip for p in pods if p.role is Role.AGENT}
    # Plan again without the environment pods to read the env they were built with.
    rebuilt = plan_attempt(rset, 1, [p for p in pods if p.role is not Role.ENVIRONMENT])
    urls = {m["metadata"]["name"]: env(m)["ROLLOUT_PEER_AGENT_URL"] for m in rebuilt.to_create}
    assert urls == {
        "rl-environment-0-a1": f"http://{agents[0]}:9000",
        "rl-environment-1-a1": f"http://{agents[1]}:9000",
        "rl-environment-2-a1": f"http://{agents[0]}:9000",
    }


def test_participants_show_every_desired_pod_with_its_address() -> None:
    rset = make_set({"model": 1, "environment": 1})
    plan = plan_attempt(rset, 1, start_all(rset))
    shown = [(p.role, p.index, p.pod, p.ready, p.address) for p in plan.participants]
    assert shown == [
        (Role.ENVIRONMENT, 0, "rl-environment-0-a1", True, "http://127.0.1.2:9000"),
        (Role.MODEL, 0, "rl-model-0-a1", True, "http://127.0.1.1:9000"),
    ]


def test_pods_of_other_attempts_and_sets_are_not_counted() -> None:
    rset = make_set({"model": 1})
    other_attempt = plan_attempt(rset, 1, [])
    pods = views(running(other_attempt.to_create[0], "127.0.0.9"))
    plan = plan_attempt(rset, 2, pods)
    assert [p["metadata"]["name"] for p in plan.to_create] == ["rl-model-0-a2"]


def test_a_spec_change_under_running_pods_freezes_the_plan() -> None:
    rset = make_set({"model": 1, "environment": 1})
    pods = start_all(rset)
    scaled = make_set({"model": 1, "environment": 2})
    plan = plan_attempt(scaled, 1, pods)
    assert plan.stale
    assert not plan.to_create
    assert not plan.waiting_for_peers
    assert [p.pod for p in plan.participants] == ["rl-environment-0-a1", "rl-model-0-a1"]
    health = set_conditions(scaled, plan, pods_created=True, now=T0)
    by_type = {c.type: c for c in health.conditions}
    assert by_type["Degraded"].reason == Reason.SPEC_CHANGE_REFUSED
    assert "revert" in by_type["Degraded"].message
    assert "(environment: replicas 1 -> 2)" in by_type["Degraded"].message
    assert by_type["Ready"].status.value == "True"  # the running pods still serve


def test_a_refused_change_names_the_roles_and_what_changed() -> None:
    rset = make_set({"model": 1, "environment": 2})
    pods = start_all(rset)
    body = rset.model_dump(mode="json", by_alias=True, exclude_none=True)
    body["spec"]["participants"][0]["template"]["spec"]["containers"][0]["image"] = "new:tag"
    body["spec"]["participants"].append(body["spec"]["participants"][0] | {"role": "agent"})
    body["spec"]["participants"][1]["replicas"] = 1
    changed = api.RolloutSet.model_validate(body)
    assert describe_spec_change(changed, pods) == [
        "environment: replicas 2 -> 1",
        "model: template changed",
        "agent: added to the spec",
    ]


def conditions(health_conditions: list[ConditionUpdate]) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status.value, c.reason) for c in health_conditions}


def test_all_ready_is_ready_and_not_progressing() -> None:
    rset = make_set()
    plan = plan_attempt(rset, 1, start_all(rset))
    health = set_conditions(rset, plan, pods_created=True, now=T0)
    assert conditions(health.conditions) == {
        "Ready": ("True", Reason.ALL_READY),
        "Degraded": ("False", Reason.AS_EXPECTED),
        "Progressing": ("False", Reason.ATTEMPT_READY),
    }
    assert health.recheck_at is None


def test_starting_pods_are_progressing_until_the_deadline() -> None:
    rset = make_set(deadline=60)
    plan = plan_attempt(
        rset,
        1,
        views(*(running(m, "127.0.0.2", ready=False) for m in plan_attempt(rset, 1, []).to_create)),
    )
    health = set_conditions(rset, plan, pods_created=False, now=T0 + timedelta(seconds=10))
    assert conditions(health.conditions) == {
        "Ready": ("False", Reason.STARTING),
        "Degraded": ("False", Reason.AS_EXPECTED),
        "Progressing": ("True", Reason.STARTING),
    }
    assert health.recheck_at == T0 + timedelta(seconds=60)
    ready = next(c for c in health.conditions if c.type == "Ready")
    assert "0 of 5" in ready.message
    assert "waiting for peer addresses" in ready.message

    late = set_conditions(rset, plan, pods_created=False, now=T0 + timedelta(seconds=61))
    assert conditions(late.conditions) == {
        "Ready": ("False", Reason.NOT_STARTING),
        "Degraded": ("True", Reason.NOT_STARTING),
        "Progressing": ("False", Reason.DEADLINE_EXCEEDED),
    }
    assert late.recheck_at is None


def unschedulable(manifest: dict[str, Any]) -> dict[str, Any]:
    pod = dict(manifest)
    pod["metadata"] = {**manifest["metadata"], "creationTimestamp": "2026-11-29T12:00:00Z"}
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
            }
        ],
    }
    return pod


def test_unschedulable_pods_past_the_deadline_say_why() -> None:
    rset = make_set({"model": 1}, deadline=5)
    (manifest,) = plan_attempt(rset, 1, []).to_create
    plan = plan_attempt(rset, 1, views(unschedulable(manifest)))
    health = set_conditions(rset, plan, pods_created=True, now=T0 + timedelta(seconds=6))
    degraded = next(c for c in health.conditions if c.type == "Degraded")
    assert degraded.reason == Reason.NOT_STARTING
    assert "Unschedulable: 0/2 nodes are available" in degraded.message
    assert "rl-model-0-a1" in degraded.message


def failed(manifest: dict[str, Any], code: int) -> dict[str, Any]:
    pod = dict(manifest)
    pod["metadata"] = {**manifest["metadata"], "creationTimestamp": "2026-11-29T12:00:00Z"}
    pod["status"] = {
        "phase": "Failed",
        "podIP": "127.0.0.7",
        "containerStatuses": [
            {"name": "c", "state": {"terminated": {"exitCode": code, "reason": "Error"}}}
        ],
    }
    return pod


def test_a_failed_pod_degrades_the_set_with_its_exit_code() -> None:
    rset = make_set({"model": 1})
    (manifest,) = plan_attempt(rset, 1, []).to_create
    plan = plan_attempt(rset, 1, views(failed(manifest, 137)))
    assert plan.participants[0].address is None  # a dead pod is nobody's peer
    health = set_conditions(rset, plan, pods_created=True, now=T0)
    assert conditions(health.conditions)["Degraded"] == ("True", Reason.FAILED)
    degraded = next(c for c in health.conditions if c.type == "Degraded")
    assert "exited with code 137 (Error)" in degraded.message


def test_a_pod_gone_after_creation_is_lost_not_recreated() -> None:
    rset = make_set({"model": 1})
    plan = plan_attempt(rset, 1, [])
    health = set_conditions(rset, plan, pods_created=True, now=T0)
    assert conditions(health.conditions)["Degraded"] == ("True", Reason.LOST)


def test_refused_creations_are_reported() -> None:
    rset = make_set({"model": 1})
    plan = plan_attempt(rset, 1, [])
    health = set_conditions(
        rset, plan, pods_created=False, create_errors=["rl-model-0-a1: Pod is invalid"], now=T0
    )
    assert conditions(health.conditions)["Degraded"] == ("True", Reason.CREATE_FAILED)


def test_a_suspended_set_without_pods_is_not_ready_for_that_reason() -> None:
    rset = make_set(suspend=True)
    health = set_conditions(rset, plan_attempt(rset, 1, []), pods_created=False, now=T0)
    assert conditions(health.conditions) == {
        "Ready": ("False", Reason.SUSPENDED),
        "Progressing": ("False", Reason.SUSPENDED),
        "Degraded": ("False", Reason.AS_EXPECTED),
    }


def test_pod_view_reads_waiting_reasons_and_ignores_foreign_pods() -> None:
    assert PodView.from_pod({"metadata": {"name": "x", "labels": {}}}) is None
    rset = make_set({"model": 1})
    (manifest,) = plan_attempt(rset, 1, []).to_create
    pod = dict(manifest)
    pod["status"] = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": "c",
                "state": {"waiting": {"reason": "ErrImagePull", "message": "no such image"}},
            }
        ],
    }
    view = PodView.from_pod(pod)
    assert view is not None
    assert view.problem == "ErrImagePull: no such image"
    assert view.live
    assert not view.finished
    assert not view.ready


def test_attempt_instances_follow_the_pods_after_a_refused_change() -> None:
    """A replica the new spec adds must not look like a lost participant of the running
    attempt (recovery's loss detection uses this too)."""
    rset = make_set({"model": 1, "environment": 1})
    pods = start_all(rset)
    assert attempt_instances(rset, 1, pods) == [(Role.ENVIRONMENT, 0), (Role.MODEL, 0)]
    scaled = make_set({"model": 1, "environment": 2})
    assert attempt_instances(scaled, 1, pods) == [(Role.ENVIRONMENT, 0), (Role.MODEL, 0)]
    assert attempt_instances(scaled, 2, pods) == [
        (Role.ENVIRONMENT, 0),
        (Role.ENVIRONMENT, 1),
        (Role.MODEL, 0),
    ]
