"""The prepare's stages from the waits participants declare (docs/design.md#44-order): a role
after every role that waits on it, roles nobody orders together, one role per stage for what
declared nothing; and the coordinator preparing a stage's roles at once."""

from __future__ import annotations

import pytest
from rollout_protocol import (
    PREPARE_ORDER,
    SEQUENTIAL_STAGES,
    Capability,
    ControlConfigError,
    ControlSettings,
    Role,
    StatusReply,
    prepare_stages,
)
from rollout_protocol._wire import Phase, fields_unread_by

pytestmark = pytest.mark.unit

ENV, MODEL, AGENT, RES = Role.ENVIRONMENT, Role.MODEL, Role.AGENT, Role.RESOURCES
REFERENCE = {ENV: (AGENT, RES), AGENT: (RES,), MODEL: (), RES: ()}
"""What the reference servers declare (docs/servers.md)."""


def test_nothing_declared_is_one_role_per_stage_in_prepare_order() -> None:
    assert prepare_stages((role, None) for role in Role) == SEQUENTIAL_STAGES
    assert tuple((role,) for role in PREPARE_ORDER) == SEQUENTIAL_STAGES


def test_the_reference_servers_park_environment_and_model_together() -> None:
    assert prepare_stages(REFERENCE.items()) == ((ENV, MODEL), (AGENT,), (RES,))


def test_nobody_waiting_is_one_stage() -> None:
    assert prepare_stages((role, ()) for role in Role) == ((ENV, MODEL, AGENT, RES),)


def test_one_instance_that_declared_nothing_makes_its_role_wait_on_every_later_role() -> None:
    declarations = [*REFERENCE.items(), (ENV, None)]  # a second environment, of an older SDK
    assert prepare_stages(declarations) == ((ENV,), (MODEL, AGENT), (RES,))
    # a model that declared nothing waits on the agent and the resources, as before
    assert prepare_stages([*REFERENCE.items(), (MODEL, None)]) == ((ENV, MODEL), (AGENT,), (RES,))


def test_a_roles_instances_wait_on_the_union_of_their_waits() -> None:
    declarations = [(ENV, ()), (MODEL, ()), (AGENT, ()), (AGENT, (RES,)), (RES, ())]
    assert prepare_stages(declarations) == ((ENV, MODEL, AGENT), (RES,))


def test_roles_without_participants_have_no_stage_and_waits_on_them_are_ignored() -> None:
    assert prepare_stages([(ENV, (AGENT, RES)), (MODEL, ())]) == ((ENV, MODEL),)
    assert prepare_stages([(AGENT, None), (RES, ())]) == ((AGENT,), (RES,))


def test_a_wait_on_a_role_earlier_in_prepare_order_reorders_the_stages() -> None:
    # a model that waits on the environment (a callback): the environment must still admit
    assert prepare_stages([(ENV, ()), (MODEL, (ENV,)), (AGENT, ()), (RES, ())]) == (
        (MODEL, AGENT, RES),
        (ENV,),
    )


def test_a_chain_of_waits_is_as_many_stages_as_it_is_long() -> None:
    chain = [(ENV, (MODEL,)), (MODEL, (AGENT,)), (AGENT, (RES,)), (RES, ())]
    assert prepare_stages(chain) == SEQUENTIAL_STAGES


def test_a_cycle_of_waits_falls_back_to_one_role_per_stage() -> None:
    cycle = [(ENV, ()), (MODEL, (AGENT,)), (AGENT, (MODEL,)), (RES, ())]
    assert prepare_stages(cycle) == SEQUENTIAL_STAGES


def test_settings_refuse_a_role_that_waits_on_itself_and_drop_repeats() -> None:
    with pytest.raises(ControlConfigError, match="cannot wait on itself"):
        ControlSettings(role=AGENT, allow_unauthenticated=True, waits_on=(AGENT,))
    settings = ControlSettings(role=ENV, allow_unauthenticated=True, waits_on=(RES, RES, AGENT))
    assert settings.waits_on == (RES, AGENT)
    assert ControlSettings(role=ENV, allow_unauthenticated=True).waits_on is None


def test_the_declared_waits_reach_only_a_coordinator_that_names_them() -> None:
    named_all = ",".join(cap.value for cap in Capability)
    assert "waits_on" not in fields_unread_by(named_all)
    assert "waits_on" in fields_unread_by(Capability.PERSIST_AFTER_RESUME.value)
    assert "capabilities" not in fields_unread_by(Capability.PERSIST_AFTER_RESUME.value)
    reply = StatusReply(role=ENV, instance="environment-0", attempt=0, phase=Phase.IDLE)
    assert reply.waits_on is None, "undeclared unless the server says so"
