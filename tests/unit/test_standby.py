"""Standby pods (docs/design.md#62-recovery), the pure parts: the pod a standby is, what the set's
pass keeps, which standby a recovery adopts, and whom an adopted standby is re-wired to."""

from __future__ import annotations

from typing import Any

from rollout_operator.decide.inplace import adopted_instances, rewiring
from rollout_operator.decide.resources import (
    ENV_STANDBY,
    participant_pod,
    standby_pod,
    template_hash,
)
from rollout_operator.decide.setplan import PodView, plan_attempt
from rollout_operator.decide.standby import StandbyView, adoptions, plan_standbys
from rollout_operator.model import api
from rollout_protocol import Role
from testsupport import builders

NS = "team"


def rollout_set(standby: dict[str, int]) -> api.RolloutSet:
    return builders.rollout_set(
        name="math",
        namespace=NS,
        uid="uid-1",
        participants=[
            builders.participant(role, replicas, container_name=role, image="img")
            for role, replicas in (("environment", 2), ("model", 1))
        ],
        standby=standby,
        status={"attempt": 1, "createdAttempt": 1},
    )


def running(pod: dict[str, Any], ip: str) -> dict[str, Any]:
    pod["status"] = {
        "phase": "Running",
        "podIP": ip,
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    return pod


def attempt_pods(rset: api.RolloutSet) -> list[dict[str, Any]]:
    environment, model = rset.spec.participants
    model_pod = running(participant_pod(rset, model, 0, 1, {}), "10.0.0.10")
    peers = {Role.MODEL: "http://10.0.0.10:8000"}
    return [
        model_pod,
        running(participant_pod(rset, environment, 0, 1, peers), "10.0.0.11"),
        running(participant_pod(rset, environment, 1, 1, peers), "10.0.0.12"),
    ]


def views(rset: api.RolloutSet, pods: list[dict[str, Any]]) -> list[StandbyView]:
    return [v for v in (StandbyView.from_pod(p, rset.metadata.name) for p in pods) if v]


def test_a_standby_pod_is_the_roles_pod_in_no_attempt() -> None:
    rset = rollout_set({"environment": 1})
    environment = rset.spec.participants[0]
    pod = standby_pod(rset, environment, 0, 1, {Role.MODEL: "http://10.0.0.10:8000"})
    labels = pod["metadata"]["labels"]
    assert labels[api.LABEL_STANDBY] == "true"
    assert api.LABEL_ATTEMPT not in labels, "no attempt: nothing that selects one sees it"
    assert api.LABEL_INDEX not in labels
    assert labels[api.LABEL_SET] == "math"
    assert PodView.from_pod(pod) is None, "the attempt planner and loss detection skip it"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[ENV_STANDBY] == "1"
    assert env["ROLLOUT_PEER_MODEL_URL"] == "http://10.0.0.10:8000"
    assert pod["metadata"]["annotations"][api.ANNOTATION_TEMPLATE_HASH] == template_hash(
        environment
    )
    assert pod["metadata"]["name"] == "math-environment-standby-0-a1"


def test_the_pass_starts_standbys_only_once_the_attempt_is_ready() -> None:
    rset = rollout_set({"environment": 1, "model": 1})
    pods = attempt_pods(rset)
    plan = plan_attempt(rset, 1, [v for v in (PodView.from_pod(p) for p in pods) if v])
    assert plan.all_ready
    decided = plan_standbys(rset, [], 1, plan)
    assert sorted(p["metadata"]["name"] for p in decided.create) == [
        "math-environment-standby-0-a1",
        "math-model-standby-0-a1",
    ]
    assert decided.status is not None
    assert decided.status.shown == "0/2"
    assert plan_standbys(rset, [], 1, None).create == [], "not while the set recovers"

    made = [running(p, f"10.0.1.{i}") for i, p in enumerate(decided.create)]
    again = plan_standbys(rset, views(rset, made), 1, plan)
    assert again.create == []
    assert again.delete == []
    assert again.status is not None
    assert again.status.shown == "2/2"


def test_stale_finished_and_surplus_standbys_go_and_are_never_adopted() -> None:
    rset = rollout_set({"environment": 1})
    environment = rset.spec.participants[0]
    stale = running(standby_pod(rset, environment, 0, 1, {}), "10.0.1.1")
    stale["metadata"]["annotations"][api.ANNOTATION_TEMPLATE_HASH] = "an-older-template"
    dead = standby_pod(rset, environment, 1, 1, {})
    dead["status"] = {"phase": "Failed"}
    good = running(standby_pod(rset, environment, 2, 1, {}), "10.0.1.3")
    extra = running(standby_pod(rset, environment, 3, 1, {}), "10.0.1.4")
    seen = views(rset, [stale, dead, good, extra])
    decided = plan_standbys(rset, seen, 1, None)
    assert sorted(decided.delete) == sorted(
        [stale["metadata"]["name"], dead["metadata"]["name"], extra["metadata"]["name"]]
    )
    picks = adoptions(
        rset,
        [(Role.ENVIRONMENT, 1)],
        [
            v
            for v in seen
            if v.name != good["metadata"]["name"] and v.name != extra["metadata"]["name"]
        ],
    )
    assert picks == {}, "a stale or finished standby is never adopted"
    picks = adoptions(rset, [(Role.ENVIRONMENT, 1), (Role.MODEL, 0)], seen)
    assert [(i, s.name) for i, s in picks.items()] == [
        ((Role.ENVIRONMENT, 1), good["metadata"]["name"])
    ], "one standby per missing instance of its own role"


def test_a_standby_of_another_set_or_not_ready_is_not_adopted() -> None:
    rset = rollout_set({"environment": 1})
    environment = rset.spec.participants[0]
    starting = standby_pod(rset, environment, 0, 1, {})
    starting["status"] = {"phase": "Running", "podIP": "10.0.1.1"}  # not Ready yet
    assert adoptions(rset, [(Role.ENVIRONMENT, 0)], views(rset, [starting])) == {}
    other = running(standby_pod(rset, environment, 1, 1, {}), "10.0.1.2")
    other["metadata"]["labels"][api.LABEL_SET] = "another-set"
    assert views(rset, [other]) == []


def test_an_adopted_standby_is_wired_to_every_peer_and_kept_callers_to_it() -> None:
    rset = rollout_set({"model": 1})
    participants = [
        api.ParticipantStatus(
            role=Role.MODEL, index=0, pod="math-model-standby-0-a1", attempt=2, ready=True,
            address="http://10.0.1.1:8000",
        ),
        api.ParticipantStatus(
            role=Role.ENVIRONMENT, index=0, pod="math-environment-0-a1", attempt=2, ready=True,
            address="http://10.0.0.11:8000",
        ),
        api.ParticipantStatus(
            role=Role.ENVIRONMENT, index=1, pod="math-environment-1-a1", attempt=2, ready=True,
            address="http://10.0.0.12:8000",
        ),
    ]  # fmt: skip
    adopted = adopted_instances(["model-0=math-model-standby-0-a1"])
    assert adopted == {"model-0": "math-model-standby-0-a1"}
    kept = {"math-environment-0-a1", "math-environment-1-a1"}
    peers = rewiring(rset, participants, kept, adopted.values())
    assert peers == {
        "environment-0": {Role.MODEL: "http://10.0.1.1:8000"},
        "environment-1": {Role.MODEL: "http://10.0.1.1:8000"},
    }
