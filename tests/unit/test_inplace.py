"""Planning an InPlace recovery: which pods stay, which are replaced, and who re-wires.

Every role and replica combination of a four-role set is planned: losing any one instance
replaces that instance only, and exactly the kept callers of a replaced instance re-wire.
"""

from __future__ import annotations

import dataclasses

import pytest
from rollout_operator.decide.inplace import instance_name, plan_in_place, rewiring
from rollout_operator.decide.resources import PEERS, peer_index
from rollout_operator.decide.setplan import PodView, desired_instances, plan_attempt
from rollout_operator.model import api
from rollout_protocol import Role
from testsupport.setplan import make_set, running, start_all, views

pytestmark = pytest.mark.unit

SHAPES = [
    {"model": 1, "resources": 1, "agent": 1, "environment": 1},
    {"model": 2, "resources": 1, "agent": 2, "environment": 4},
    {"model": 4, "resources": 2, "agent": 3, "environment": 2},
]


def lost_one(pods: list[PodView], role: Role, index: int) -> list[PodView]:
    """The pods as observed after one of them failed."""
    return [
        dataclasses.replace(p, phase="Failed") if (p.role, p.index) == (role, index) else p
        for p in pods
    ]


def relabel(pods: list[PodView], kept: list[PodView], attempt: int) -> list[PodView]:
    names = {p.name for p in kept}
    return [dataclasses.replace(p, attempt=attempt) for p in pods if p.name in names]


def participants_after(rset: api.RolloutSet, kept: list[PodView]) -> list[api.ParticipantStatus]:
    """Attempt 2 as the recovery creates it: kept pods relabelled, fresh pods for the rest."""
    pods = relabel(kept, kept, 2)
    manifests: list[dict[str, object]] = []
    for _ in range(4):
        plan = plan_attempt(rset, 2, [*pods, *views(*manifests)])  # type: ignore[arg-type]
        manifests.extend(running(m, f"127.0.2.{len(manifests) + 1}") for m in plan.to_create)
    plan = plan_attempt(rset, 2, [*pods, *views(*manifests)])  # type: ignore[arg-type]
    assert plan.all_ready, plan
    return plan.participants


@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: "-".join(f"{k[0]}{v}" for k, v in s.items())
)
def test_losing_any_one_instance_replaces_it_alone_and_rewires_exactly_its_callers(
    shape: dict[str, int],
) -> None:
    rset = make_set(shape)
    pods = start_all(rset)
    for role, index in desired_instances(rset):
        plan = plan_in_place(rset, 1, 2, lost_one(pods, role, index), {(role, index)})
        assert plan.refused is None
        assert plan.replaced == [(role, index)]
        assert {(p.role, p.index) for p in plan.kept} == set(desired_instances(rset)) - {
            (role, index)
        }

        participants = participants_after(rset, plan.kept)
        wiring = rewiring(rset, participants, {p.name for p in plan.kept})
        fresh = next(p for p in participants if (p.role, p.index) == (role, index))
        callers = {
            instance_name((caller, i))
            for caller, callees in PEERS.items()
            if role in callees
            for i in range(shape[caller.value])
            if peer_index(i, shape[role.value]) == index
        }
        assert set(wiring) == callers, (role, index)
        for rewired in wiring.values():
            assert rewired == {role: fresh.address}


def test_a_model_loss_never_touches_the_environment_and_resources_pods() -> None:
    rset = make_set({"model": 4, "resources": 1, "agent": 4, "environment": 4})
    pods = start_all(rset)
    plan = plan_in_place(rset, 1, 2, lost_one(pods, Role.MODEL, 2), {(Role.MODEL, 2)})
    assert plan.replaced == [(Role.MODEL, 2)]
    participants = participants_after(rset, plan.kept)
    wiring = rewiring(rset, participants, {p.name for p in plan.kept})
    # model-2 is called by agent-2 and environment-2 (i mod 4 == 2), by nobody else
    assert set(wiring) == {"agent-2", "environment-2"}


def test_two_losses_at_once_replace_both() -> None:
    rset = make_set({"model": 2, "resources": 1, "agent": 2, "environment": 2})
    pods = lost_one(lost_one(start_all(rset), Role.MODEL, 0), Role.AGENT, 1)
    plan = plan_in_place(rset, 1, 2, pods, {(Role.MODEL, 0), (Role.AGENT, 1)})
    assert sorted(plan.replaced) == sorted([(Role.MODEL, 0), (Role.AGENT, 1)])
    assert len(plan.kept) == 5  # seven instances, two lost


def test_nothing_survived_refuses() -> None:
    rset = make_set({"model": 1})
    pods = start_all(rset)
    plan = plan_in_place(rset, 1, 2, lost_one(pods, Role.MODEL, 0), {(Role.MODEL, 0)})
    assert plan.refused == "no participant pod survived"
    assert plan.replaced == [(Role.MODEL, 0)]


def test_a_spec_changed_while_pods_ran_refuses() -> None:
    rset = make_set()
    pods = [dataclasses.replace(p, spec_hash="older") for p in start_all(rset)]
    plan = plan_in_place(rset, 1, 2, lost_one(pods, Role.AGENT, 0), {(Role.AGENT, 0)})
    assert plan.refused is not None
    assert "spec changed" in plan.refused


def test_planning_again_after_relabelling_gives_the_same_answer() -> None:
    """An operator restart between relabelling and persisting the phase plans once more."""
    rset = make_set({"model": 2, "resources": 1, "agent": 1, "environment": 1})
    pods = lost_one(start_all(rset), Role.ENVIRONMENT, 0)
    first = plan_in_place(rset, 1, 2, pods, {(Role.ENVIRONMENT, 0)})
    kept = {p.name for p in first.kept}
    half = [
        dataclasses.replace(p, attempt=2) if p.name in kept and p.index == 0 else p for p in pods
    ]
    again = plan_in_place(rset, 1, 2, half, {(Role.ENVIRONMENT, 0)})
    assert {p.name for p in again.kept} == kept
    assert again.replaced == first.replaced


def test_terminating_or_failed_survivors_are_not_kept() -> None:
    rset = make_set({"model": 1, "resources": 1, "agent": 1, "environment": 1})
    pods = start_all(rset)
    dying = [
        dataclasses.replace(p, terminating=True) if p.role is Role.RESOURCES else p for p in pods
    ]
    plan = plan_in_place(rset, 1, 2, lost_one(dying, Role.AGENT, 0), {(Role.AGENT, 0)})
    assert sorted(plan.replaced) == sorted([(Role.AGENT, 0), (Role.RESOURCES, 0)])
