"""Builders of the objects a RolloutSet owns: names, labels, env, volumes, owners."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from rollout_operator.decide import resources
from rollout_operator.model import api
from rollout_protocol import Role
from testsupport import builders


def template(port: int = 8000, **spec_extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"team": "rl", api.LABEL_ROLE: "spoofed"}},
        "spec": {
            "containers": [
                {
                    "name": "server",
                    "image": "rollout:dev",
                    "command": ["rollout-server"],
                    "env": [
                        {"name": "ROLLOUT_ATTEMPT", "value": "99"},
                        {"name": "EXTRA", "value": "$(ROLLOUT_POD_IP)"},
                    ],
                    "ports": [{"name": "control", "containerPort": port}],
                },
                {"name": "sidecar", "image": "sidecar:dev"},
            ],
            **spec_extra,
        },
    }


def make_set(**participant_replicas: int) -> api.RolloutSet:
    replicas = participant_replicas or {"model": 1, "agent": 1, "environment": 2}
    return builders.rollout_set(
        name="math-rl",
        namespace="team",
        uid="uid-1",
        generation=1,
        participants=[
            {"role": role, "replicas": n, "template": template()} for role, n in replicas.items()
        ],
        volume={"hostPath": {"path": "/data/ckpt"}},
    )


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def build_pod(rset: api.RolloutSet, role: Role, index: int = 0, attempt: int = 3) -> dict[str, Any]:
    participant = rset.spec.participant(role)
    assert participant is not None
    peers = {peer: f"http://127.0.0.{i + 2}:8000" for i, peer in enumerate(resources.PEERS[role])}
    return resources.participant_pod(rset, participant, index, attempt, peers)


def test_pod_name_and_labels_identify_set_role_index_and_attempt() -> None:
    pod = build_pod(make_set(), Role.ENVIRONMENT, index=1, attempt=3)
    meta = pod["metadata"]
    assert meta["name"] == "math-rl-environment-1-a3"
    assert meta["namespace"] == "team"
    assert meta["labels"][api.LABEL_SET] == "math-rl"
    assert meta["labels"][api.LABEL_ROLE] == "environment"  # ours win over the template's
    assert meta["labels"][api.LABEL_INDEX] == "1"
    assert meta["labels"][api.LABEL_ATTEMPT] == "3"
    assert meta["labels"]["team"] == "rl"
    assert meta["annotations"][api.ANNOTATION_SPEC_HASH] == resources.participants_hash(
        make_set().spec
    )


def test_pod_is_owned_by_the_set_as_controller() -> None:
    (owner,) = build_pod(make_set(), Role.MODEL)["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "checkpoint.rollout.dev/v1alpha1",
        "kind": "RolloutSet",
        "name": "math-rl",
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def test_every_container_gets_the_rollout_env_and_the_token_from_the_secret() -> None:
    pod = build_pod(make_set(), Role.AGENT, index=0, attempt=3)
    for container in pod["spec"]["containers"]:
        env = env_of(container)
        assert env["ROLLOUT_SET"] == "math-rl"
        assert env["ROLLOUT_ROLE"] == "agent"
        assert env["ROLLOUT_INDEX"] == "0"
        assert env["ROLLOUT_ATTEMPT"] == "3"
        assert env["ROLLOUT_CHECKPOINT_ROOT"] == "/ckpt"
        assert env["ROLLOUT_CONTROL_TOKEN"] == {
            "secretKeyRef": {"name": "math-rl-control-token", "key": "token"}
        }
        assert env["ROLLOUT_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_template_env_with_our_names_is_dropped_and_ours_come_first() -> None:
    """Kubernetes expands $(VAR) only from earlier entries; a template value must not shadow
    the attempt the operator assigned."""
    server = build_pod(make_set(), Role.MODEL)["spec"]["containers"][0]
    names = [e["name"] for e in server["env"]]
    assert names.count("ROLLOUT_ATTEMPT") == 1
    assert env_of(server)["ROLLOUT_ATTEMPT"] == "3"
    assert names.index("ROLLOUT_POD_IP") < names.index("EXTRA")


def test_peer_urls_are_injected_for_the_roles_this_role_calls() -> None:
    rset = make_set(model=1, agent=1, environment=1, resources=1)
    env = env_of(build_pod(rset, Role.ENVIRONMENT)["spec"]["containers"][0])
    assert {k for k in env if k.startswith("ROLLOUT_PEER_")} == {
        "ROLLOUT_PEER_AGENT_URL",
        "ROLLOUT_PEER_MODEL_URL",
        "ROLLOUT_PEER_RESOURCES_URL",
    }
    agent_env = env_of(build_pod(rset, Role.AGENT)["spec"]["containers"][0])
    assert {k for k in agent_env if k.startswith("ROLLOUT_PEER_")} == {
        "ROLLOUT_PEER_MODEL_URL",
        "ROLLOUT_PEER_RESOURCES_URL",
    }
    model_env = env_of(build_pod(rset, Role.MODEL)["spec"]["containers"][0])
    assert not [k for k in model_env if k.startswith("ROLLOUT_PEER_")]


def test_storage_volume_is_mounted_at_its_path_in_every_container() -> None:
    pod = build_pod(make_set(), Role.MODEL)
    assert {"name": "rollout-checkpoints", "hostPath": {"path": "/data/ckpt"}} in pod["spec"][
        "volumes"
    ]
    for container in pod["spec"]["containers"]:
        assert {"name": "rollout-checkpoints", "mountPath": "/ckpt"} in container["volumeMounts"]


def test_participant_pods_never_restart_in_place() -> None:
    spec = build_pod(make_set(), Role.MODEL)["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False


def test_pods_get_a_stable_per_instance_hostname_under_the_role_service() -> None:
    spec = build_pod(make_set(), Role.ENVIRONMENT, index=1)["spec"]
    assert spec["hostname"] == "environment-1"
    assert spec["subdomain"] == "math-rl-environment"


def test_template_pod_fields_pass_through() -> None:
    rset = api.RolloutSet.model_validate(
        {
            "metadata": {"name": "s", "namespace": "n", "uid": "u"},
            "spec": {
                "participants": [
                    {
                        "role": "model",
                        "template": template(nodeSelector={"gpu": "true"}, hostname="custom"),
                    }
                ],
                "storage": {"path": "/c", "volume": {"emptyDir": {}}},
            },
        }
    )
    spec = build_pod(rset, Role.MODEL)["spec"]
    assert spec["nodeSelector"] == {"gpu": "true"}
    assert spec["hostname"] == "custom"
    assert spec["containers"][1]["image"] == "sidecar:dev"


def test_role_service_is_headless_and_follows_pods_across_attempts() -> None:
    rset = make_set()
    participant = rset.spec.participant(Role.MODEL)
    assert participant is not None
    service = resources.role_service(rset, participant)
    assert service["metadata"]["name"] == "math-rl-model"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {api.LABEL_SET: "math-rl", api.LABEL_ROLE: "model"}
    assert service["spec"]["ports"] == [
        {"name": "control", "port": 8000, "targetPort": "control", "protocol": "TCP"}
    ]
    assert service["metadata"]["ownerReferences"][0]["controller"] is True


def test_control_token_secret_holds_a_fresh_random_token() -> None:
    rset = make_set()
    token = resources.new_control_token()
    assert len(token) >= 40
    assert token != resources.new_control_token()
    secret = resources.control_token_secret(rset, token)
    assert secret["metadata"]["name"] == "math-rl-control-token"
    assert base64.b64decode(secret["data"]["token"]).decode() == token
    assert resources.token_from_secret(secret) == token
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_secret_without_the_token_key_is_an_error() -> None:
    with pytest.raises(ValueError, match="token"):
        resources.token_from_secret({"data": {}})


def test_participants_hash_tracks_participants_and_storage_only() -> None:
    base = make_set()
    same = make_set()
    assert resources.participants_hash(base.spec) == resources.participants_hash(same.spec)
    more = make_set(model=2, agent=1, environment=2)
    assert resources.participants_hash(base.spec) != resources.participants_hash(more.spec)
    policy_changed = base.spec.model_copy(
        update={"checkpoint_policy": api.CheckpointPolicy(keep_latest=5)}
    )
    assert resources.participants_hash(base.spec) == resources.participants_hash(policy_changed)


@pytest.mark.parametrize(
    ("index", "replicas", "peer"), [(0, 1, 0), (3, 1, 0), (3, 2, 1), (2, 4, 2)]
)
def test_peer_index_is_a_fixed_mapping(index: int, replicas: int, peer: int) -> None:
    assert resources.peer_index(index, replicas) == peer


def test_participant_url_brackets_ipv6() -> None:
    assert resources.participant_url("127.0.0.5", 8000) == "http://127.0.0.5:8000"
    assert resources.participant_url("fd00::5", 8000) == "http://[fd00::5]:8000"


def test_owner_reference_needs_the_uid() -> None:
    rset = make_set()
    no_uid = rset.model_copy(update={"metadata": rset.metadata.model_copy(update={"uid": None})})
    with pytest.raises(ValueError, match="uid"):
        resources.owner_reference(no_uid)
