"""Counting one client's API requests by verb and resource, from the API server's own counters.

`apiserver_request_total` has verb and resource labels but no client label; API Priority and
Fairness (APF) is how a cluster accounts requests per client. `Accounting` gives the client its
own ServiceAccount (cluster-admin: the benches are not about RBAC), a priority level with ample
seats (nothing is throttled) and one FlowSchema per (verb, resource) matching only that
ServiceAccount, then `apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}` is the
client's request count for that verb and resource. Resources not listed fall through to one
catch-all schema per verb (resource `other`, which also takes non-resource URLs such as
discovery), and a last catch-all over every verb (verb `other`), so nothing the client sends
goes uncounted.

APF matches a resource rule's `resources` exactly, subresource included: `pods` does not match
`pods/status`, so each subresource the client writes is listed on its own.

Used by `bench/fleet.py` (requests by verb) and `bench/checkpoint_requests.py` (by verb and
resource). The parsing (`dispatched_counts`) is pure and unit-tested.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devcluster.cluster import Cluster

DISPATCHED: Final = "apiserver_flowcontrol_dispatched_requests_total"

VERBS: Final = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
"""APF's request verbs for resource requests (a watch is `watch`, not `get`)."""

OTHER: Final = "other"
"""The resource (or verb) of requests no specific FlowSchema matched."""

OPERATOR_GROUP: Final = "checkpoint.rollout.dev"

RESOURCES: Final[tuple[tuple[str, str], ...]] = (
    (OPERATOR_GROUP, "rolloutcheckpoints"),
    (OPERATOR_GROUP, "rolloutcheckpoints/status"),
    (OPERATOR_GROUP, "rolloutsets"),
    (OPERATOR_GROUP, "rolloutsets/status"),
    ("", "pods"),
    ("", "pods/status"),
    ("", "events"),
    ("events.k8s.io", "events"),
    ("", "secrets"),
    ("", "services"),
    ("", "nodes"),
    ("", "namespaces"),
    ("coordination.k8s.io", "leases"),
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("kopf.dev", "kopfpeerings"),
    ("kopf.dev", "clusterkopfpeerings"),
)
"""(API group, resource[/subresource]) pairs counted on their own: what the operator and Kopf
touch, and the per-set checkpoint Lease (docs/design.md#66-one-checkpoint-at-a-time). Anything else
is counted as `other` under its verb."""

FIRST_PRECEDENCE: Final = 10
"""Our schemas take 10.. upwards, below every suggested schema that could match a
ServiceAccount (`kube-system-service-accounts` 900, `service-accounts` 9000)."""


def resource_label(group: str, resource: str) -> str:
    """How a resource reads in a table: bare for the core group and the operator's own,
    `resource.group` otherwise (`events.events.k8s.io`, `leases.coordination.k8s.io`)."""
    if group in ("", OPERATOR_GROUP):
        return resource
    plural, _, sub = resource.partition("/")
    return f"{plural}.{group}" + (f"/{sub}" if sub else "")


def service_account_kubeconfig(
    cluster: Cluster, namespace: str, name: str, path: Path, *, duration_seconds: int = 3600
) -> Path:
    """A kubeconfig that authenticates with a fresh token of the ServiceAccount and nothing
    else (`kubectl create token`: the TokenRequest API), so every request it makes is
    authorized by that ServiceAccount's RBAC alone."""
    token = cluster.kubectl(
        "create", "token", name, "-n", namespace, f"--duration={duration_seconds}s"
    ).stdout.strip()
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    subject = f"system:serviceaccount:{namespace}:{name}"
    if claims["sub"] != subject:
        raise RuntimeError(f"unexpected token subject {claims['sub']}, wanted {subject}")
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "devcluster",
                "cluster": {"server": cluster.server, "certificate-authority": str(cluster.ca)},
            }
        ],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [
            {
                "name": "sa",
                "context": {"cluster": "devcluster", "user": name, "namespace": namespace},
            }
        ],
        "current-context": "sa",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass(frozen=True)
class Schema:
    """One FlowSchema: its name, rank, and the (verb, resource label) it counts."""

    name: str
    precedence: int
    verb: str
    resource: str
    rule: dict[str, Any]


@dataclass(frozen=True)
class Accounting:
    """A client identity whose requests the API server counts by verb and resource.

    `prefix` names the priority level, the FlowSchemas and the ClusterRoleBinding; two
    accountings in one cluster need different prefixes (and ServiceAccounts)."""

    namespace: str
    service_account: str
    prefix: str
    resources: tuple[tuple[str, str], ...] = RESOURCES

    @property
    def subject(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    def schemas(self) -> list[Schema]:
        """Most specific first: (verb, resource) pairs, then one catch-all per verb, then one
        for every verb; each with its own precedence (APF breaks ties by name)."""
        found: list[Schema] = []
        precedence = FIRST_PRECEDENCE
        for verb in VERBS:
            for group, resource in self.resources:
                slug = resource.replace("/", ".") + (f".{group}" if group else "")
                rule = {
                    "resourceRules": [
                        {
                            "verbs": [verb],
                            "apiGroups": [group],
                            "resources": [resource],
                            "namespaces": ["*"],
                            "clusterScope": True,
                        }
                    ]
                }
                label = resource_label(group, resource)
                found.append(Schema(f"{self.prefix}-{verb}-{slug}", precedence, verb, label, rule))
                precedence += 1
        for verb in VERBS:
            rule = {
                "resourceRules": [
                    {
                        "verbs": [verb],
                        "apiGroups": ["*"],
                        "resources": ["*"],
                        "namespaces": ["*"],
                        "clusterScope": True,
                    }
                ],
                "nonResourceRules": [{"verbs": [verb], "nonResourceURLs": ["*"]}],
            }
            found.append(Schema(f"{self.prefix}-{verb}-{OTHER}", precedence, verb, OTHER, rule))
            precedence += 1
        rule = {
            "resourceRules": [
                {
                    "verbs": ["*"],
                    "apiGroups": ["*"],
                    "resources": ["*"],
                    "namespaces": ["*"],
                    "clusterScope": True,
                }
            ],
            "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
        }
        found.append(Schema(f"{self.prefix}-{OTHER}", precedence, OTHER, OTHER, rule))
        return found

    def objects(self) -> list[dict[str, Any]]:
        """The ServiceAccount, its cluster-admin binding, the priority level and the schemas."""
        subject = {
            "kind": "ServiceAccount",
            "serviceAccount": {"name": self.service_account, "namespace": self.namespace},
        }
        docs: list[dict[str, Any]] = [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": self.service_account, "namespace": self.namespace},
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"{self.prefix}-admin"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [
                    {
                        "kind": "ServiceAccount",
                        "name": self.service_account,
                        "namespace": self.namespace,
                    }
                ],
            },
            {
                "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
                "kind": "PriorityLevelConfiguration",
                "metadata": {"name": self.prefix},
                "spec": {
                    "type": "Limited",
                    "limited": {
                        "nominalConcurrencyShares": 200,
                        "lendablePercent": 0,
                        "limitResponse": {
                            "type": "Queue",
                            "queuing": {"queues": 64, "handSize": 6, "queueLengthLimit": 500},
                        },
                    },
                },
            },
        ]
        for schema in self.schemas():
            docs.append(
                {
                    "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
                    "kind": "FlowSchema",
                    "metadata": {"name": schema.name},
                    "spec": {
                        "priorityLevelConfiguration": {"name": self.prefix},
                        "matchingPrecedence": schema.precedence,
                        "distinguisherMethod": {"type": "ByUser"},
                        "rules": [{"subjects": [subject], **schema.rule}],
                    },
                }
            )
        return docs

    def install(self, cluster: Cluster, work: Path) -> None:
        path = work / f"{self.prefix}-accounting.yaml"
        path.write_text(yaml.safe_dump_all(self.objects()))
        cluster.kubectl("apply", "-f", str(path))

    def token_kubeconfig(self, cluster: Cluster, path: Path) -> Path:
        """A kubeconfig that authenticates as the ServiceAccount (a two-hour token)."""
        return service_account_kubeconfig(
            cluster, self.namespace, self.service_account, path, duration_seconds=7200
        )

    def counts(self, metrics_text: str) -> Counter[tuple[str, str]]:
        """The client's requests so far by (verb, resource) from the API server's `/metrics`."""
        return dispatched_counts(
            metrics_text, {s.name: (s.verb, s.resource) for s in self.schemas()}
        )

    def read(self, cluster: Cluster) -> Counter[tuple[str, str]]:
        """`counts` of a fresh `/metrics` read with kubectl (as admin: not counted)."""
        return self.counts(cluster.kubectl("get", "--raw", "/metrics").stdout)

    async def read_async(self, http: httpx.AsyncClient) -> Counter[tuple[str, str]]:
        """`counts` of a fresh `/metrics` read through `admin_http` (no kubectl process per
        read: for polling)."""
        response = await http.get("/metrics")
        response.raise_for_status()
        return self.counts(response.text)


def admin_context(cluster: Cluster) -> ssl.SSLContext:
    """TLS to the API server as devcluster's admin (`system:masters`), trusting its CA."""
    context = cluster.ssl_context()
    pki = cluster.layout.pki
    context.load_cert_chain(pki / "admin.crt", pki / "admin.key")
    return context


def admin_http(cluster: Cluster, timeout: float = 10.0) -> httpx.AsyncClient:
    """An HTTP client to the API server as devcluster's admin (`system:masters`: APF exempts it,
    so its own reads are never counted in an accounting)."""
    return httpx.AsyncClient(
        base_url=cluster.server, verify=admin_context(cluster), timeout=timeout
    )


def dispatched_counts(
    metrics_text: str, schemas: Mapping[str, tuple[str, str]]
) -> Counter[tuple[str, str]]:
    """Sums `apiserver_flowcontrol_dispatched_requests_total` over the FlowSchemas in `schemas`
    (name -> (verb, resource)); other schemas' samples are ignored. Only the lines of that
    counter are parsed: the API server's whole exposition is megabytes."""
    lines = "\n".join(line for line in metrics_text.splitlines() if line.startswith(DISPATCHED))
    counts: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(lines + "\n"):
        for sample in family.samples:
            if sample.name != DISPATCHED:
                continue
            key = schemas.get(sample.labels.get("flow_schema", ""))
            if key is not None:
                counts[key] += round(sample.value)
    return counts


def by_verb(counts: Mapping[tuple[str, str], int]) -> dict[str, float]:
    """Request counts summed over resources: every verb of `VERBS` (0 when none), plus `other`
    when the last catch-all counted anything."""
    verbs: dict[str, float] = dict.fromkeys(VERBS, 0.0)
    for (verb, _resource), value in counts.items():
        verbs[verb] = verbs.get(verb, 0.0) + value
    return verbs


def difference(
    after: Mapping[tuple[str, str], int], before: Mapping[tuple[str, str], int]
) -> Counter[tuple[str, str]]:
    """Requests between two reads (keys with no requests left out)."""
    keys: Iterable[tuple[str, str]] = set(after) | set(before)
    return Counter(
        {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k) != before.get(k)}
    )


# --- the client process's CPU and memory --------------------------------------------------------


@dataclass
class Usage:
    cpu_seconds: float
    rss_mb: float


def usage(pid: int) -> Usage:
    """User + system CPU seconds (all threads) and RSS of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return Usage(cpu, rss)
