"""A set whose records live in an S3-API bucket (`spec.storage.s3`, docs/api.md "Storage"): the
models refuse what the CEL rules refuse, the participant pods get the bucket's environment and
its credentials Secret mounted read-only (never its content), and a missing Secret or key blocks
the set with a condition that names the Secret and says what to do.

The set's pass runs against the in-memory API server (`FakeCluster`, below the operator's real
client); the same rules on a real API server are in tests/e2e/test_crds.py."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError
from rollout_operator.cluster.objects import STORAGE_SECRET_INVALID
from rollout_operator.cluster.storage import StorageLocator
from rollout_operator.decide import resources
from rollout_operator.flows import setpass
from rollout_operator.flows.state import OperatorState
from rollout_operator.model import api, crdgen
from testsupport import builders
from testsupport.fakecluster import FakeCluster

NS = "team"
T0 = datetime(2026, 12, 7, 12, 0, 0, tzinfo=UTC)
BUCKET = {
    "endpoint": "http://127.0.0.1:9000",
    "bucket": "rollouts",
    "prefix": "team-a/rl",
    "secretName": "bucket-creds",
}
SECRET_VALUE = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def bucket_set(**bucket: Any) -> dict[str, Any]:
    participants = [builders.participant(role, None) for role in ("model", "environment")]
    for entry in participants:
        entry["template"]["spec"]["containers"][0]["command"] = ["x"]
    return builders.set_body(
        namespace=NS,
        uid="uid-1",
        generation=1,
        participants=participants,
        bucket={**BUCKET, **bucket},
    )


def credentials(**data: str) -> dict[str, Any]:
    return {
        "kind": "Secret",
        "metadata": {"name": "bucket-creds", "namespace": NS},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


# --- the model ----------------------------------------------------------------------------------


def test_a_bucket_is_accepted_with_the_defaults_the_crd_gives() -> None:
    storage = api.RolloutSet.model_validate(bucket_set()).spec.storage
    assert storage.volume is None
    assert storage.path is None
    assert storage.s3 is not None
    assert storage.s3.region == "us-east-1"
    assert storage.s3.addressing_style is api.AddressingStyle.PATH
    assert api.dump(storage) == {"s3": {**BUCKET, "region": "us-east-1", "addressingStyle": "path"}}


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ({"path": "/ckpt", "volume": {"emptyDir": {}}, "s3": BUCKET}, "RULE_STORAGE_ONE_BACKEND"),
        ({}, "RULE_STORAGE_ONE_BACKEND"),
        ({"path": "/ckpt"}, "RULE_STORAGE_ONE_BACKEND"),
        ({"path": "/ckpt", "s3": BUCKET}, "RULE_STORAGE_VOLUME_PATH"),
        ({"volume": {"emptyDir": {}}}, "RULE_STORAGE_VOLUME_PATH"),
        ({"s3": {**BUCKET, "prefix": "a/../b"}}, "RULE_S3_PREFIX"),
        ({"s3": {**BUCKET, "prefix": "/a"}}, "RULE_S3_PREFIX"),
        ({"s3": {**BUCKET, "prefix": "a//b"}}, "RULE_S3_PREFIX"),
        ({"s3": {**BUCKET, "prefix": "a/"}}, "RULE_S3_PREFIX"),
        ({"s3": {**BUCKET, "prefix": "a/./b"}}, "RULE_S3_PREFIX"),
        ({"s3": {**BUCKET, "prefix": "a/-b"}}, "RULE_S3_PREFIX"),
        ({"s3": {**BUCKET, "prefix": "a b"}}, "RULE_S3_PREFIX"),
    ],
)
def test_the_models_refuse_what_the_cel_rules_refuse(storage: dict[str, Any], message: str) -> None:
    body = bucket_set()
    body["spec"]["storage"] = storage
    with pytest.raises(ValidationError) as refused:
        api.RolloutSet.model_validate(body)
    rule: api.Rule = getattr(api, message)
    assert rule.message in str(refused.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("endpoint", "ftp://127.0.0.1:9000"),
        ("endpoint", "http://user:password@127.0.0.1:9000"),
        ("bucket", "Rollouts"),
        ("bucket", "ab"),
        ("bucket", "under_score"),
        ("bucket", "b" * 64),
        ("endpoint", "http://127.0.0.1:9000/path"),
        ("region", "US-EAST-1"),
        ("region", "us east"),
        ("addressingStyle", "dns"),
        ("secretName", "Bucket_Creds"),
    ],
)
def test_bad_bucket_fields_are_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError):
        api.RolloutSet.model_validate(bucket_set(**{field: value}))


def test_a_shared_prefix_and_an_empty_one_are_fine() -> None:
    for prefix in ("", "rollouts", "team-a/rl.v2/_x"):
        assert api.RolloutSet.model_validate(bucket_set(prefix=prefix)).spec.storage.s3


def test_the_crd_carries_the_rules_where_their_fields_are() -> None:
    storage = crdgen.crd(crdgen.ROLLOUT_SET)["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"
    ]["spec"]["properties"]["storage"]
    rules = [r["rule"] for r in storage["x-kubernetes-validations"]]
    assert api.RULE_STORAGE_ONE_BACKEND.cel in rules
    assert api.RULE_STORAGE_VOLUME_PATH.cel in rules
    assert "required" not in storage
    s3 = storage["properties"]["s3"]
    assert [r["rule"] for r in s3["x-kubernetes-validations"]] == [api.RULE_S3_PREFIX.cel]
    assert s3["required"] == ["endpoint", "bucket", "secretName"]


# --- the participant pods -----------------------------------------------------------------------


def pod_of(body: dict[str, Any]) -> dict[str, Any]:
    rset = api.RolloutSet.model_validate(body)
    return resources.participant_pod(rset, rset.spec.participants[0], 0, 2, {})


def test_participant_pods_get_the_bucket_env_and_the_secret_mounted_read_only() -> None:
    pod = pod_of(bucket_set(addressingStyle="virtual", region="eu-west-1"))
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ROLLOUT_STORAGE_S3_ENDPOINT"] == "http://127.0.0.1:9000"
    assert env["ROLLOUT_STORAGE_S3_BUCKET"] == "rollouts"
    assert env["ROLLOUT_STORAGE_S3_PREFIX"] == "team-a/rl"
    assert env["ROLLOUT_STORAGE_S3_REGION"] == "eu-west-1"
    assert env["ROLLOUT_STORAGE_S3_ADDRESSING"] == "virtual"
    assert env["ROLLOUT_STORAGE_S3_CREDENTIALS_DIR"] == resources.CREDENTIALS_MOUNT
    assert env["ROLLOUT_SET_DIR"] == f"{NS}/rl/uid-1"
    assert "ROLLOUT_CHECKPOINT_ROOT" not in env
    assert {
        "name": resources.STORAGE_VOLUME_NAME,
        "mountPath": resources.CREDENTIALS_MOUNT,
        "readOnly": True,
    } in container["volumeMounts"]
    assert {
        "name": resources.STORAGE_VOLUME_NAME,
        "secret": {"secretName": "bucket-creds"},
    } in pod["spec"]["volumes"]


def test_a_volume_sets_pods_are_built_as_before() -> None:
    body = bucket_set()
    body["spec"]["storage"] = {"path": "/ckpt", "volume": {"emptyDir": {}}}
    pod = pod_of(body)
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ROLLOUT_CHECKPOINT_ROOT"] == "/ckpt"
    assert not any(name.startswith("ROLLOUT_STORAGE_S3_") for name in env)
    assert {"name": resources.STORAGE_VOLUME_NAME, "mountPath": "/ckpt"} in container[
        "volumeMounts"
    ]
    assert {"name": resources.STORAGE_VOLUME_NAME, "emptyDir": {}} in pod["spec"]["volumes"]


def test_a_buckets_cleanup_pod_mounts_the_secret_and_names_no_root() -> None:
    rset = api.RolloutSet.model_validate(bucket_set())
    pod = resources.cleanup_pod(rset, ("ckpt-1",), "rollout-operator:dev")
    [container] = pod["spec"]["containers"]
    assert container["command"] == [
        "rollout-records",
        "remove",
        "--set-dir",
        f"{NS}/rl/uid-1",
        "--termination-log",
        "/dev/termination-log",
        "--checkpoint",
        "ckpt-1",
    ]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["ROLLOUT_STORAGE_S3_BUCKET"] == "rollouts"
    assert env["ROLLOUT_STORAGE_S3_CREDENTIALS_DIR"] == resources.CREDENTIALS_MOUNT
    assert container["volumeMounts"] == [
        {
            "name": resources.STORAGE_VOLUME_NAME,
            "mountPath": resources.CREDENTIALS_MOUNT,
            "readOnly": True,
        }
    ]
    assert pod["spec"]["volumes"] == [
        {"name": resources.STORAGE_VOLUME_NAME, "secret": {"secretName": "bucket-creds"}}
    ]


def test_the_operator_sees_no_volume_of_a_bucket_set() -> None:
    rset = api.RolloutSet.model_validate(bucket_set())
    locator = StorageLocator(claims_dir=None)
    assert locator.root(NS, rset.spec.storage) is None
    assert locator.describe(NS, rset.spec.storage) == (
        "bucket rollouts/team-a/rl at http://127.0.0.1:9000 (only the pods that mount Secret "
        "bucket-creds hold its credentials)"
    )


# --- the credentials Secret ---------------------------------------------------------------------


async def one_pass(cluster: FakeCluster, state: OperatorState) -> setpass.ReconcileOutcome:
    return await setpass.reconcile_set(
        cluster.kube(),
        NS,
        "rl",
        owned_objects=state.owned_objects,
        latest_written=state.latest_written,
        now=T0,
    )


def degraded(cluster: FakeCluster) -> dict[str, Any]:
    stored = cluster.get(api.ROLLOUT_SET_PLURAL, NS, "rl")
    assert stored is not None
    [found] = [c for c in stored["status"]["conditions"] if c["type"] == "Degraded"]
    return dict(found)


def participant_pods(cluster: FakeCluster) -> list[str]:
    return [p["metadata"]["name"] for p in cluster.list_objects("pods", NS)]


@pytest.mark.parametrize(
    ("secret", "said"),
    [
        (None, "does not exist or is empty"),
        (credentials(accessKeyId="AKIDEXAMPLE"), "has no secretAccessKey"),
        (credentials(secretAccessKey=SECRET_VALUE), "has no accessKeyId"),
    ],
)
async def test_a_missing_secret_or_key_blocks_the_set_naming_the_secret_never_its_content(
    secret: dict[str, Any] | None, said: str
) -> None:
    cluster = FakeCluster(clock=lambda: T0)
    cluster.put(bucket_set())
    if secret is not None:
        cluster.put(secret)
    state = OperatorState()
    outcome = await one_pass(cluster, state)
    condition = degraded(cluster)
    assert condition["status"] == "True"
    assert condition["reason"] == STORAGE_SECRET_INVALID
    assert f"secret {NS}/bucket-creds" in condition["message"]
    assert said in condition["message"]
    assert "kubectl create secret generic bucket-creds" in condition["message"]
    assert participant_pods(cluster) == []
    # Looked at again soon: the person fixes a Secret, which wakes no loop of the set.
    assert outcome.recheck_at is not None
    assert outcome.recheck_at - T0 <= timedelta(seconds=60)
    stored = json.dumps(cluster.get(api.ROLLOUT_SET_PLURAL, NS, "rl"))
    for value in (SECRET_VALUE, "AKIDEXAMPLE"):
        assert value not in stored
        assert base64.b64encode(value.encode()).decode() not in stored


async def test_once_the_secret_is_there_the_pods_are_created() -> None:
    cluster = FakeCluster(clock=lambda: T0)
    cluster.put(bucket_set())
    state = OperatorState()
    await one_pass(cluster, state)
    assert participant_pods(cluster) == []
    cluster.put(credentials(accessKeyId="AKIDEXAMPLE", secretAccessKey=SECRET_VALUE))
    await one_pass(cluster, state)
    assert participant_pods(cluster) == ["rl-model-0-a1"]
    assert degraded(cluster)["status"] == "False"
    [pod] = cluster.list_objects("pods", NS)
    assert SECRET_VALUE not in json.dumps(pod)
