"""The CRDs on a real API server: they install, read well in `kubectl explain`, default what the
models default, and refuse each bad spec with the message the pydantic models give."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kopf
import pytest
from pydantic import ValidationError
from rollout_operator.cluster.kube import Kube
from rollout_operator.model import api, crdgen
from testsupport import builders

from devcluster.cluster import Cluster
from harness.objects import wait_established

CRDS = Path(__file__).resolve().parents[2] / "crds"


def install_crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    names = [f"crd/{kind.crd_name}" for kind in crdgen.KINDS]
    wait_established(cluster, names)


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> Cluster:
    install_crds(cluster)
    return cluster


def container(port_name: str = "control") -> dict[str, Any]:
    return {
        "name": "server",
        "image": "unused.invalid/rollout",
        "command": ["sleep", "600"],
        "ports": [{"name": port_name, "containerPort": 8000}],
    }


def rollout_set(name: str = "math-rl", **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "participants": [
            {"role": "model", "template": {"spec": {"containers": [container()]}}},
            {
                "role": "environment",
                "replicas": 2,
                "template": {"spec": {"containers": [container()]}},
            },
        ],
        "storage": {"path": "/tmp/ckpt", "volume": {"hostPath": {"path": "/tmp/ckpt"}}},
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutSet",
        "metadata": {"name": name},
        "spec": spec,
    }


BUCKET = {"endpoint": "http://127.0.0.1:9000", "bucket": "rollouts", "secretName": "creds"}


def create(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> tuple[int, str]:
    result = cluster.kubectl(
        "create", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False
    )
    return result.returncode, result.stderr


def mutated(change: str) -> dict[str, Any]:
    obj = rollout_set()
    spec = obj["spec"]
    if change == "unknown role":
        spec["participants"][0]["role"] = "critic"
    elif change == "replicas 0":
        spec["participants"][0]["replicas"] = 0
    elif change == "duplicate roles":
        spec["participants"][1]["role"] = "model"
    elif change == "turn level that never saves":
        spec["checkpointPolicy"] = {"onTrainerCheckpoint": False}
    elif change == "keepLatest 0":
        spec["checkpointPolicy"] = {"keepLatest": 0}
    elif change == "no control port":
        spec["participants"][0]["template"]["spec"]["containers"] = [container("http")]
    elif change == "restartPolicy Always":
        spec["participants"][0]["template"]["spec"]["restartPolicy"] = "Always"
    elif change == "storage path with ..":
        spec["storage"] = {"path": "/tmp/../etc", "volume": {"emptyDir": {}}}
    elif change == "storage with a volume and a bucket":
        spec["storage"]["s3"] = BUCKET
    elif change == "storage with neither a volume nor a bucket":
        spec["storage"] = {"path": "/tmp/ckpt"}
    elif change == "a bucket with a path":
        spec["storage"] = {"path": "/tmp/ckpt", "s3": BUCKET}
    elif change == "a bucket prefix with ..":
        spec["storage"] = {"s3": {**BUCKET, "prefix": "team/../other"}}
    elif change == "unknown restorePolicy":
        spec["recovery"] = {"restorePolicy": "Keep"}
    elif change == "standby of a missing role":
        roles = {p["role"] for p in spec["participants"]}
        missing = next(r for r in ("environment", "model", "agent", "resources") if r not in roles)
        spec["standby"] = {missing: 1}
    elif change == "standby over 16":
        spec["standby"] = {spec["participants"][0]["role"]: 17}
    elif change == "name too long":
        obj["metadata"]["name"] = "s" * 51
    else:
        raise AssertionError(change)
    return obj


BAD_SPECS = {
    "unknown role": 'Unsupported value: "critic": supported values: "environment", "model"',
    "replicas 0": "replicas in body should be greater than or equal to 1",
    "duplicate roles": api.RULE_UNIQUE_ROLES.message,
    "turn level that never saves": api.RULE_NEVER_SAVES.message,
    "keepLatest 0": "keepLatest in body should be greater than or equal to 1",
    "no control port": api.RULE_CONTROL_PORT.message,
    "restartPolicy Always": api.RULE_RESTART_NEVER.message,
    "storage path with ..": api.RULE_STORAGE_PATH.message,
    "name too long": api.RULE_SET_NAME.message,
    "standby of a missing role": api.RULE_STANDBY_ROLES.message,
    "standby over 16": "less than or equal to 16",
    "unknown restorePolicy": 'Unsupported value: "Keep": supported values: "Recreate", "InPlace"',
    "storage with a volume and a bucket": api.RULE_STORAGE_ONE_BACKEND.message,
    "storage with neither a volume nor a bucket": api.RULE_STORAGE_ONE_BACKEND.message,
    "a bucket with a path": api.RULE_STORAGE_VOLUME_PATH.message,
    "a bucket prefix with ..": api.RULE_S3_PREFIX.message,
}


@pytest.mark.parametrize("change", list(BAD_SPECS))
def test_bad_specs_are_refused_by_the_api_server_and_the_models(
    crds: Cluster, namespace: str, change: str
) -> None:
    obj = mutated(change)
    code, stderr = create(crds, namespace, obj)
    assert code != 0, f"the API server accepted a spec with {change}"
    assert BAD_SPECS[change] in stderr, stderr
    with pytest.raises(ValidationError):
        api.RolloutSet.model_validate(obj)


def test_the_never_save_refusal_says_why(crds: Cluster, namespace: str) -> None:
    _, stderr = create(crds, namespace, mutated("turn level that never saves"))
    assert "would never save" in stderr
    assert "no checkpoint would capture unfinished turns" in stderr


def test_a_good_spec_is_accepted_and_defaulted_like_the_models(
    crds: Cluster, namespace: str
) -> None:
    code, stderr = create(crds, namespace, rollout_set())
    assert code == 0, stderr
    got = json.loads(crds.kubectl("get", "rset", "math-rl", "-n", namespace, "-o", "json").stdout)
    parsed = api.RolloutSetSpec.model_validate(rollout_set()["spec"])
    assert got["spec"]["checkpointPolicy"] == api.dump(parsed.checkpoint_policy)
    assert got["spec"]["recovery"] == api.dump(parsed.recovery)
    assert got["spec"]["progressDeadlineSeconds"] == parsed.progress_deadline_seconds
    assert got["spec"]["participants"][0]["replicas"] == 1


def test_storage_is_immutable(crds: Cluster, namespace: str) -> None:
    assert create(crds, namespace, rollout_set())[0] == 0
    for patch in (
        {"spec": {"storage": {"path": "/tmp/elsewhere"}}},
        {"spec": {"storage": {"volume": {"hostPath": {"path": "/tmp/elsewhere"}}}}},
    ):
        result = crds.kubectl(
            "patch",
            "rset",
            "math-rl",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps(patch),
            check=False,
        )
        assert result.returncode != 0
        assert api.RULE_STORAGE_IMMUTABLE.message in result.stderr
    allowed = {"spec": {"checkpointPolicy": {"keepLatest": 5}}}
    crds.kubectl(
        "patch", "rset", "math-rl", "-n", namespace, "--type=merge", "-p", json.dumps(allowed)
    )


def test_a_bucket_is_accepted_defaulted_like_the_models_and_immutable(
    crds: Cluster, namespace: str
) -> None:
    obj = rollout_set(storage={"s3": BUCKET})
    code, stderr = create(crds, namespace, obj)
    assert code == 0, stderr
    got = json.loads(crds.kubectl("get", "rset", "math-rl", "-n", namespace, "-o", "json").stdout)
    parsed = api.RolloutSetSpec.model_validate(obj["spec"])
    assert got["spec"]["storage"] == api.dump(parsed.storage)
    assert got["spec"]["storage"]["s3"]["region"] == "us-east-1"
    assert got["spec"]["storage"]["s3"]["addressingStyle"] == "path"
    for patch in (
        {"spec": {"storage": {"s3": {"prefix": "elsewhere"}}}},
        {"spec": {"storage": {"s3": {"secretName": "other-creds"}}}},
        {"spec": {"storage": {"s3": None, "path": "/tmp/c", "volume": {"emptyDir": {}}}}},
    ):
        result = crds.kubectl(
            "patch",
            "rset",
            "math-rl",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps(patch),
            check=False,
        )
        assert result.returncode != 0, patch
        assert api.RULE_STORAGE_IMMUTABLE.message in result.stderr


def test_a_volume_cannot_become_a_bucket(crds: Cluster, namespace: str) -> None:
    assert create(crds, namespace, rollout_set())[0] == 0
    patch = {"spec": {"storage": {"path": None, "volume": None, "s3": BUCKET}}}
    result = crds.kubectl(
        "patch",
        "rset",
        "math-rl",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps(patch),
        check=False,
    )
    assert result.returncode != 0
    assert api.RULE_STORAGE_IMMUTABLE.message in result.stderr


def test_short_names_category_and_printer_columns(crds: Cluster, namespace: str) -> None:
    assert create(crds, namespace, rollout_set())[0] == 0
    checkpoint = builders.checkpoint_body(
        "math-rl-step-1",
        set_name="math-rl",
        namespace=None,
        trigger="TrainerCheckpoint",
        trainerStep=1,
    )
    assert create(crds, namespace, checkpoint)[0] == 0
    sets = crds.kubectl("get", "rset", "-n", namespace).stdout.splitlines()
    header = [
        "NAME",
        "READY",
        "ATTEMPT",
        "LATEST-CHECKPOINT",
        "QUEUE",
        "STANDBY",
        "KEPT",
        "REPLACED",
        "AGE",
    ]
    assert sets[0].split() == header
    # The Kueue LocalQueue a set is submitted to (its label) is a column of its own.
    crds.kubectl("label", "rset", "math-rl", "-n", namespace, "kueue.x-k8s.io/queue-name=team-q")
    labelled = crds.kubectl("get", "rset", "-n", namespace).stdout.splitlines()
    assert "team-q" in labelled[1].split()
    checkpoints = crds.kubectl("get", "rckpt", "-n", namespace).stdout.splitlines()
    assert checkpoints[0].split() == ["NAME", "READY", "SET", "TRIGGER", "EPISODES", "PAUSE", "AGE"]
    row = checkpoints[1].split()
    assert row[0] == "math-rl-step-1"
    assert "math-rl" in row[1:]
    assert "TrainerCheckpoint" in row
    everything = crds.kubectl("get", "rollout", "-n", namespace, "-o", "name").stdout.split()
    assert sorted(everything) == [
        "rolloutcheckpoint.checkpoint.rollout.dev/math-rl-step-1",
        "rolloutset.checkpoint.rollout.dev/math-rl",
    ]


def test_checkpoint_rules(crds: Cluster, namespace: str) -> None:
    def checkpoint(name: str, **spec: Any) -> dict[str, Any]:
        return builders.checkpoint_body(
            name, set_name="math-rl", namespace=None, **{"trigger": None, **spec}
        )

    code, stderr = create(crds, namespace, checkpoint("no-step", trigger="TrainerCheckpoint"))
    assert code != 0
    assert api.RULE_TRAINER_STEP.message in stderr
    code, stderr = create(crds, namespace, checkpoint("c" * 129))
    assert code != 0
    assert api.RULE_CHECKPOINT_NAME.message in stderr
    assert create(crds, namespace, checkpoint("manual"))[0] == 0
    result = crds.kubectl(
        "patch",
        "rckpt",
        "manual",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"trigger": "Interval"}}),
        check=False,
    )
    assert result.returncode != 0
    assert api.RULE_CHECKPOINT_SPEC_IMMUTABLE.message in result.stderr


async def test_a_sets_checkpoints_are_listed_by_the_api_server(
    crds: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spec.rolloutSet` is a selectable field: the operator's list of one set's checkpoints
    (every policy pass) is filtered by the API server, unlabelled ones included."""

    def checkpoint(name: str, set_name: str) -> dict[str, Any]:
        return builders.checkpoint_body(name, set_name=set_name, namespace=None, trigger=None)

    for name, set_name in [("a-1", "set-a"), ("a-2", "set-a"), ("b-1", "set-b")]:
        assert create(crds, namespace, checkpoint(name, set_name))[0] == 0
    monkeypatch.setenv("KUBECONFIG", str(crds.kubeconfig))  # how the operator's client logs in
    kube = Kube.connect(kopf.OperatorSettings())
    try:
        listed = await kube.list_checkpoints(namespace, "set-a")
        assert sorted(c["metadata"]["name"] for c in listed) == ["a-1", "a-2"]
        assert kube.field_selectors, "the API server filtered them (no fallback)"
        assert await kube.list_checkpoints(namespace, "set-c") == []
    finally:
        await kube.close()
    shown = crds.kubectl(
        "get", "rckpt", "-n", namespace, "--field-selector=spec.rolloutSet=set-b", "-o", "name"
    ).stdout.split()
    assert shown == ["rolloutcheckpoint.checkpoint.rollout.dev/b-1"]


def test_kubectl_explain_reads_well(crds: Cluster) -> None:
    spec = crds.kubectl("explain", "rolloutset.spec").stdout
    for field in ("participants", "storage", "checkpointPolicy", "recovery", "suspend"):
        assert f"  {field}\t" in spec, spec
    assert "roles are unique" in spec
    assert "Immutable" in spec
    deadline = crds.kubectl("explain", "rolloutset.spec.checkpointPolicy.mustSaveBy").stdout
    assert "RFC 3339" in deadline
    roles = crds.kubectl("explain", "rolloutset.spec.participants.role").stdout
    assert "environment" in roles
    assert "policy" in roles
    status = crds.kubectl("explain", "rolloutcheckpoint.status.conditions").stdout
    assert "Ready (published and restorable)" in status
