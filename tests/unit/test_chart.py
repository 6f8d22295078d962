"""The Helm chart, checked with the real helm binary (`.bin/devcluster/helm`, built by
`make cluster-binaries`): lint and template for the default values and namespaced mode, the
strict values schema, RBAC parity between the modes, peering, the NetworkPolicy, and the CRDs
kept identical to the generated ones in crds/.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster.paths import find_binaries

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rollout-operator"
KUBE_VERSION = "1.37.2"
"""helm built without version ldflags assumes Kubernetes 1.20, older than the chart allows."""
PEERING_CRDS = "kopf.dev-peerings.yaml"
"""The one file of the chart's crds/ that crdgen does not write: Kopf's peering CRDs."""


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = find_binaries(("helm",))["helm"]
    # A private HOME-less environment: helm must not read or write the user's repositories.
    env = {**os.environ, "HELM_CACHE_HOME": "/nonexistent", "HELM_CONFIG_HOME": "/nonexistent"}
    result = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def sets(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


NAMESPACED = {"watch.mode": "namespaced", "watch.namespaces": "{team-a,team-b}"}


def render(values: dict[str, str] | None = None) -> list[dict[str, Any]]:
    out = helm(
        "template",
        "rel",
        str(CHART),
        "--namespace",
        "ops",
        "--kube-version",
        KUBE_VERSION,
        *sets(values or {}),
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = only(docs, "Deployment")["spec"]["template"]["spec"]
    assert len(spec["containers"]) == 1
    result: dict[str, Any] = spec["containers"][0]
    return result


def is_leader(doc: dict[str, Any]) -> bool:
    return str(doc["metadata"]["name"]).endswith("-leader")


def grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# --- lint and template ------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, NAMESPACED], ids=["default", "namespaced"])
def test_helm_lint_passes(values: dict[str, str]) -> None:
    result = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *sets(values))
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_default_values_render_a_cluster_wide_standalone_operator() -> None:
    docs = render()
    assert sorted(d["kind"] for d in docs) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
        "ServiceAccount",
    ]
    deployment = only(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    main = container(docs)
    assert main["command"] == ["rollout-operator"]
    args = main["args"]
    assert args[0] == "run"
    assert "--all-namespaces" in args
    assert "--standalone" in args
    assert "--peering" not in args
    # A replaced pod's successor waits for this Lease until the old operator has stopped.
    assert args[args.index("--leader-lease") + 1] == "ops/rel-rollout-operator-leader"
    assert args[args.index("--liveness") + 1] == "http://0.0.0.0:8080/healthz"
    assert args[args.index("--metrics-port") + 1] == "9090"
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # Liveness waits while the operator waits for its Lease (Kopf serves /healthz after that):
    # the previous pod's stop within its grace period, 30 s.
    live = main["livenessProbe"]
    assert live["initialDelaySeconds"] + live["periodSeconds"] * live["failureThreshold"] >= 60
    assert {p["name"]: p["containerPort"] for p in main["ports"]} == {
        "health": 8080,
        "metrics": 9090,
    }
    assert main["resources"]["requests"]
    assert main["resources"]["limits"]["memory"]


def test_the_replicas_limit_is_set_at_install() -> None:
    """`operator.maxReplicasPerRole` reaches the operator (docs/operations.md#failure-modes, class
    3); the schema keeps it within the API's bound."""
    args = container(render())["args"]
    assert args[args.index("--max-replicas-per-role") + 1] == "256"
    args = container(render({"operator.maxReplicasPerRole": "8"}))["args"]
    assert args[args.index("--max-replicas-per-role") + 1] == "8"
    result = helm(
        "template",
        "rel",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        *sets({"operator.maxReplicasPerRole": "5000"}),
        check=False,
    )
    assert result.returncode != 0
    assert "maxReplicasPerRole" in result.stderr, result.stderr


def test_the_operator_runs_non_root_on_a_read_only_root_filesystem() -> None:
    docs = render()
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container(docs)["securityContext"]
    assert security == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container(docs)["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    # OpenShift-style platforms assign the user: null leaves it out.
    platform = render(
        {"podSecurityContext.runAsUser": "null", "podSecurityContext.fsGroup": "null"}
    )
    context = only(platform, "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert "runAsUser" not in context
    assert "fsGroup" not in context
    assert context["runAsNonRoot"] is True


def test_checkpoint_claims_are_mounted_where_the_operator_removes_records() -> None:
    docs = render({"storage.claims": "{ckpt-a,ckpt-b}"})
    main = container(docs)
    assert {
        "name": "ROLLOUT_OPERATOR_STORAGE_DIR",
        "value": "/var/lib/rollout-operator/storage",
    } in (main["env"])
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert mounts["storage-0"] == "/var/lib/rollout-operator/storage/ops/ckpt-a"
    assert mounts["storage-1"] == "/var/lib/rollout-operator/storage/ops/ckpt-b"
    volumes = only(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in volumes
        if "persistentVolumeClaim" in v
    }
    assert claims == {"storage-0": "ckpt-a", "storage-1": "ckpt-b"}


def test_cluster_mode_binds_one_cluster_role_to_the_service_account() -> None:
    docs = render()
    account = only(docs, "ServiceAccount")["metadata"]
    binding = only(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == only(docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": "ops"}
    ]
    assert (
        only(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
        == (account["name"])
    )


def test_namespaced_mode_grants_namespaced_resources_only_in_the_watched_namespaces() -> None:
    docs = render(NAMESPACED)
    roles = [d for d in docs if d["kind"] == "Role" and not is_leader(d)]
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and not is_leader(d)]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["subjects"][0]["namespace"] == "ops"
    # The leader Lease is in the release namespace, which is not watched here: a Role of its own.
    (leader,) = [d for d in docs if d["kind"] == "Role" and is_leader(d)]
    assert leader["metadata"]["namespace"] == "ops"
    assert grants(leader["rules"]) == {
        ("coordination.k8s.io", "leases", verb) for verb in ("get", "create", "patch")
    }
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding" and is_leader(d)]
    assert binding["roleRef"]["name"] == leader["metadata"]["name"]
    assert binding["metadata"]["namespace"] == "ops"
    cluster = grants(only(docs, "ClusterRole")["rules"])
    assert {resource for _, resource, _ in cluster} == {
        "nodes",
        "customresourcedefinitions",
        "namespaces",
        "resourceflavors",
        "workloadpriorityclasses",
    }
    assert not {verb for _, _, verb in cluster} - {"get", "list", "watch"}, "cluster-wide: reads"
    args = container(docs)["args"]
    assert args[1:5] == ["--namespace", "team-a", "--namespace", "team-b"]
    assert "--all-namespaces" not in args


def test_the_leader_lease_needs_a_role_of_its_own_only_outside_the_watched_namespaces() -> None:
    """Cluster mode grants Leases everywhere, and a watched release namespace has them in its
    Role: only a namespaced release outside its watched namespaces renders the leader Role."""
    for values in ({}, {"watch.mode": "namespaced", "watch.namespaces": "{ops,team-a}"}):
        docs = render(values)
        assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding") and is_leader(d)]
        rules = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
        granted = set().union(*(grants(r["rules"]) for r in rules))
        assert ("coordination.k8s.io", "leases", "patch") in granted


def test_both_modes_grant_the_same_verbs() -> None:
    """Namespaced mode splits the cluster-mode rules; it adds only Kopf's namespace watch."""
    cluster_mode = grants(only(render(), "ClusterRole")["rules"])
    docs = render(NAMESPACED)
    namespaced_mode = grants(only(docs, "ClusterRole")["rules"]) | grants(
        next(d for d in docs if d["kind"] == "Role")["rules"]
    )
    assert namespaced_mode - cluster_mode == {
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }
    assert cluster_mode <= namespaced_mode


def test_no_rule_grants_wildcards_or_writes_it_does_not_need() -> None:
    for values in ({}, NAMESPACED):
        docs = render(values)
        for role in (d for d in docs if d["kind"] in ("ClusterRole", "Role")):
            for group, resource, verb in grants(role["rules"]):
                assert "*" not in (group, resource, verb)
                assert verb not in {"update", "deletecollection", "escalate", "bind", "impersonate"}
                if resource in {"secrets", "services", "events"}:
                    assert verb in {"get", "create"}, f"{resource}: {verb}"


def test_kueue_workloads_are_created_and_released_never_changed_or_deleted() -> None:
    """The operator owns its sets' Workloads (Kueue's external-framework contract): it creates
    them and clears their quota reservation in status; Kueue's objects it only reads."""
    for values in ({}, NAMESPACED):
        docs = render(values)
        kueue = {
            (resource, verb)
            for role in (d for d in docs if d["kind"] in ("ClusterRole", "Role"))
            for group, resource, verb in grants(role["rules"])
            if group == "kueue.x-k8s.io"
        }
        assert kueue == {
            ("workloads", "list"),
            ("workloads", "watch"),
            ("workloads", "create"),
            ("workloads/status", "patch"),
            ("workloadpriorityclasses", "get"),
            ("resourceflavors", "get"),
        }


def test_owner_reference_enforcement_adds_the_finalizers_update() -> None:
    plain = grants(only(render(), "ClusterRole")["rules"])
    enforced = grants(
        only(render({"rbac.ownerReferencesPermissionEnforcement": "true"}), "ClusterRole")["rules"]
    )
    assert enforced - plain == {("checkpoint.rollout.dev", "rolloutsets/finalizers", "update")}


# --- peering ------------------------------------------------------------------------------------


def test_more_than_one_replica_runs_with_peering_and_distinct_priorities(tmp_path: Path) -> None:
    docs = render({"replicas": "2"})
    deployment = only(docs, "Deployment")
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    peering = only(docs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "rollout-operator"
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in grants(
        only(docs, "ClusterRole")["rules"]
    )
    main = container(docs)
    args = main["args"]
    assert args[args.index("--peering") + 1] == "rollout-operator"
    assert "--standalone" not in args
    assert "--leader-lease" not in args, "peering chooses the working replica"
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in main[
        "env"
    ]

    # Run the container's command with a stand-in `rollout-operator` that prints its argv:
    # each pod gets an integer priority of its own (Kopf pauses peers of equal priority).
    stand_in = tmp_path / "rollout-operator"
    stand_in.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    stand_in.chmod(0o755)
    priorities = set()
    for pod in ("rel-rollout-operator-7d9f-abcde", "rel-rollout-operator-7d9f-fghij"):
        env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "POD_ID": pod}
        out = subprocess.run(
            [*main["command"], *args], env=env, capture_output=True, text=True, check=True
        ).stdout.split("\n")
        assert out[: len(args)] == args
        assert out[len(args)] == "--priority"
        priorities.add(int(out[len(args) + 1]))
    assert len(priorities) == 2


def test_namespaced_peering_uses_a_kopf_peering_per_namespace() -> None:
    docs = render({**NAMESPACED, "replicas": "3"})
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert not [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    for role in (d for d in docs if d["kind"] == "Role"):
        assert ("kopf.dev", "kopfpeerings", "watch") in grants(role["rules"])


# --- metrics and network policy -----------------------------------------------------------------


def test_metrics_service_and_optional_service_monitor() -> None:
    docs = render({"metrics.serviceMonitor.enabled": "true"})
    service = only(docs, "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert (
        service["spec"]["selector"] == only(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    )
    monitor = only(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    refused = helm(
        "template",
        "rel",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        *sets({"metrics.serviceMonitor.enabled": "true", "metrics.service.enabled": "false"}),
        check=False,
    )
    assert refused.returncode != 0
    assert "metrics.serviceMonitor.enabled needs metrics.service.enabled" in refused.stderr


def test_tracing_sets_the_otlp_endpoint_only_when_given() -> None:
    names = {e["name"] for e in container(render())["env"]}
    assert not {n for n in names if n.startswith("OTEL_")}, "no endpoint: no tracing"
    env = container(
        render(
            {
                "tracing.otlpEndpoint": "http://collector.obs:4318",
                "tracing.env.OTEL_SERVICE_NAME": "ops-operator",
            }
        )
    )["env"]
    given = {e["name"]: e.get("value") for e in env}
    assert given["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.obs:4318"
    assert given["OTEL_SERVICE_NAME"] == "ops-operator"
    refused = helm(
        "template",
        "rel",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        *sets({"tracing.env.HTTP_PROXY": "x"}),
        check=False,
    )
    assert refused.returncode != 0, "tracing.env holds OTEL_* variables only"


def test_network_policy_admits_only_the_operator_and_peers_to_the_control_port() -> None:
    docs = render({**NAMESPACED, "networkPolicy.enabled": "true"})
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    spec = policies[0]["spec"]
    assert spec["podSelector"] == {
        "matchExpressions": [{"key": "checkpoint.rollout.dev/set", "operator": "Exists"}]
    }
    assert spec["policyTypes"] == ["Ingress"]
    operator_rule, peers_rule = spec["ingress"]
    assert operator_rule["ports"] == [{"protocol": "TCP", "port": "control"}]
    source = operator_rule["from"][0]
    assert source["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    assert (
        source["podSelector"]["matchLabels"]
        == (only(docs, "Deployment")["spec"]["selector"]["matchLabels"])
    )
    assert peers_rule["from"][0]["podSelector"] == spec["podSelector"]

    strict = render(
        {**NAMESPACED, "networkPolicy.enabled": "true", "networkPolicy.allowParticipants": "false"}
    )
    assert len(next(d for d in strict if d["kind"] == "NetworkPolicy")["spec"]["ingress"]) == 1

    cluster_mode = helm(
        "template",
        "rel",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        *sets({"networkPolicy.enabled": "true"}),
        check=False,
    )
    assert cluster_mode.returncode != 0
    assert "networkPolicy.enabled needs networkPolicy.namespaces" in cluster_mode.stderr


# --- the values schema --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"image.tga": "v1"}, "at '/image': additional properties 'tga' not allowed"),
        (
            {"metrics.serviceMonitor.enabeld": "true"},
            "at '/metrics/serviceMonitor': additional properties 'enabeld' not allowed",
        ),
        ({"replica": "2"}, "additional properties 'replica' not allowed"),
        ({"watch.mode": "namespace"}, "at '/watch/mode'"),
        ({"watch.mode": "namespaced"}, "at '/watch/namespaces': minItems: got 0, want 1"),
    ],
    ids=["misspelt-nested", "misspelt-deep", "misspelt-top", "bad-enum", "namespaced-no-list"],
)
def test_the_schema_refuses_misspelt_and_invalid_values(
    values: dict[str, str], message: str
) -> None:
    result = helm(
        "template", "rel", str(CHART), "--kube-version", KUBE_VERSION, *sets(values), check=False
    )
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


PASSTHROUGH = {".affinity", ".tolerations[]", ".networkPolicy.extraIngress[]"}
"""Kubernetes objects passed through verbatim (the API server validates them)."""


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from schema_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")


def test_every_level_of_the_schema_refuses_unknown_keys() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    objects = 0
    for path, node in schema_nodes(schema):
        if node.get("type") != "object":
            continue
        objects += 1
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path or '<root>'}"
        elif isinstance(node.get("additionalProperties"), dict):
            assert node["additionalProperties"] == {"type": "string"}, f"{path}: a string map"
        else:
            assert path in PASSTHROUGH, f"{path}: an object without a closed schema"
    assert objects > 20


def test_every_value_in_values_yaml_is_described_by_the_schema() -> None:
    """The defaults validate (helm lint does that) and every default key has a schema node."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def check(value: Any, node: dict[str, Any], path: str) -> None:
        if isinstance(value, dict) and "properties" in node:
            for key, sub in value.items():
                assert key in node["properties"], f"{path}.{key} has no schema"
                check(sub, node["properties"][key], f"{path}.{key}")

    check(values, schema, "")


# --- CRDs ---------------------------------------------------------------------------------------


def test_chart_crds_are_identical_to_the_generated_ones() -> None:
    """Sync with `python -m rollout_operator.model.crdgen --dir charts/rollout-operator/crds`."""
    generated = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    in_chart = {p.name: p.read_bytes() for p in (CHART / "crds").iterdir()}
    assert generated, "crds/ is empty"
    assert set(in_chart) == {*generated, PEERING_CRDS}
    for name, content in generated.items():
        assert in_chart[name] == content, (
            f"charts/rollout-operator/crds/{name} differs from crds/{name}; run "
            "`python -m rollout_operator.model.crdgen --dir charts/rollout-operator/crds`"
        )


def test_the_peering_crds_are_kopfs_resources() -> None:
    docs = list(yaml.safe_load_all((CHART / "crds" / PEERING_CRDS).read_text()))
    names = {(d["spec"]["names"]["kind"], d["spec"]["scope"]) for d in docs}
    assert names == {("ClusterKopfPeering", "Cluster"), ("KopfPeering", "Namespaced")}
    for doc in docs:
        assert doc["spec"]["group"] == "kopf.dev"
        (version,) = doc["spec"]["versions"]
        assert version["name"] == "v1"
        assert "subresources" not in version, "Kopf patches status on the main resource"
