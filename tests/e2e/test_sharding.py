"""Sharding: two releases of the chart, each watching its own namespace, run side by side.

A user who outgrows one operator installs the chart twice in namespaced mode
(`watch.mode=namespaced`, `watch.namespaces={...}`) with disjoint namespace lists. Each
release's operator runs here as a process whose kubeconfig holds only its release's
ServiceAccount token (the chart's Role in its namespace and its small ClusterRole, as in
test_rbac.py), so the API server itself would refuse any request into the other shard.

Each namespace gets the same set (one real model server, a trainer step: the policy creates a
checkpoint) at the same time. Both sets become Ready, both checkpoints Ready, each set's Lease
is released by its own checkpoint, and each operator's log names only its own namespace: no
operator acted on, or was refused for, the other's objects.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from rbac_support import (
    GRANTS,
    apply,
    apply_rbac,
    condition,
    delete_rbac,
    get_json,
    log_text,
    namespaced_values,
    operator_process,
    probe_set,
    rbac_denials,
    render_rbac,
    service_account,
    token_kubeconfig,
    wait_obj,
)

from devcluster.cluster import Cluster
from devcluster.testing import namespace_name
from harness.objects import create_namespace, delete_namespace

WAIT_S = 90.0


def _ready(obj: dict[str, Any]) -> bool:
    return condition(obj, "Ready").get("status") == "True"


async def test_two_releases_on_disjoint_namespaces_each_run_only_their_own(
    cluster: Cluster, crds: None, tmp_path: Path
) -> None:
    shards: list[tuple[str, list[dict[str, Any]]]] = []
    try:
        for shard in ("a", "b"):
            namespace = namespace_name(f"shard-{shard}")
            create_namespace(cluster, namespace)
            docs = render_rbac(
                f"shard-{shard}-{secrets.token_hex(3)}", namespace, namespaced_values(namespace)
            )
            shards.append((namespace, docs))
            apply_rbac(cluster, docs, GRANTS[0])
        (ns_a, docs_a), (ns_b, docs_b) = shards
        with (
            operator_process(
                token_kubeconfig(cluster, docs_a, tmp_path / "a.kubeconfig"),
                tmp_path / "a.log",
                [ns_a],
            ) as op_a,
            operator_process(
                token_kubeconfig(cluster, docs_b, tmp_path / "b.kubeconfig"),
                tmp_path / "b.log",
                [ns_b],
            ) as op_b,
        ):
            for namespace, _ in shards:
                storage = tmp_path / namespace
                storage.mkdir()
                apply(cluster, namespace, probe_set(storage))
            for namespace, _ in shards:
                await wait_obj(cluster, "rset", "probe", namespace, "Ready", _ready, WAIT_S)

                def latest_ready(obj: dict[str, Any], namespace: str = namespace) -> bool:
                    latest = (obj.get("status") or {}).get("latestCheckpoint")
                    if not latest:
                        return False
                    return _ready(get_json(cluster, "rckpt", latest, "-n", namespace))

                await wait_obj(
                    cluster,
                    "rset",
                    "probe",
                    namespace,
                    "at a Ready checkpoint",
                    latest_ready,
                    WAIT_S,
                )
                lease = get_json(cluster, "lease", "probe-checkpoint", "-n", namespace)
                assert lease, f"no checkpoint Lease in {namespace}"
                assert not lease["spec"].get("holderIdentity"), lease["spec"]
            for op, own, other, docs in ((op_a, ns_a, ns_b, docs_a), (op_b, ns_b, ns_a, docs_b)):
                text = log_text(op)
                assert own in text, f"the operator of {own} logged nothing of its own set"
                assert other not in text, f"the operator of {own} touched {other}"
                subject = "system:serviceaccount:{}:{}".format(*service_account(docs))
                assert rbac_denials(op, subject) == []
    finally:
        for namespace, docs in shards:
            delete_rbac(cluster, docs)
            delete_namespace(cluster, namespace)
