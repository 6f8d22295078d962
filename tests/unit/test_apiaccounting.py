"""The request accounting behind the benches (`harness.apiaccounting`): the FlowSchemas it
installs and how the API server's APF counters are read back into (verb, resource) counts."""

from __future__ import annotations

from collections import Counter

import pytest

from harness.apiaccounting import (
    OTHER,
    VERBS,
    Accounting,
    by_verb,
    difference,
    dispatched_counts,
    resource_label,
)

pytestmark = pytest.mark.unit

ACCOUNTING = Accounting("bench", "rollout-operator", "bench-operator")


def test_schemas_are_distinct_and_ranked_before_the_service_account_defaults() -> None:
    schemas = ACCOUNTING.schemas()
    names = [s.name for s in schemas]
    assert len(set(names)) == len(names)
    assert all(len(n) <= 253 and n == n.lower() and "/" not in n for n in names)
    precedences = [s.precedence for s in schemas]
    assert len(set(precedences)) == len(precedences)
    # below kube-system-service-accounts (900) and service-accounts (9000), so they see the
    # ServiceAccount's requests first
    assert max(precedences) < 900
    # the specific (verb, resource) schemas come before the catch-alls, the last takes any verb
    assert [s.resource for s in schemas][-len(VERBS) - 1 :] == [OTHER] * (len(VERBS) + 1)
    assert schemas[-1].verb == OTHER
    assert schemas[-1].precedence == max(precedences)
    assert {(s.verb, s.resource) for s in schemas} >= {
        ("patch", "rolloutcheckpoints/status"),
        ("create", "events"),
        ("create", "events.events.k8s.io"),
        ("list", "pods"),
        ("update", "leases.coordination.k8s.io"),
    }


def test_every_schema_matches_only_the_service_account() -> None:
    flows = [d for d in ACCOUNTING.objects() if d["kind"] == "FlowSchema"]
    assert len(flows) == len(ACCOUNTING.schemas())
    for flow in flows:
        (rule,) = flow["spec"]["rules"]
        assert rule["subjects"] == [
            {
                "kind": "ServiceAccount",
                "serviceAccount": {"name": "rollout-operator", "namespace": "bench"},
            }
        ]
        assert flow["spec"]["priorityLevelConfiguration"] == {"name": "bench-operator"}
    subresource = next(f for f in flows if f["metadata"]["name"].startswith("bench-operator-get-"))
    assert subresource["spec"]["rules"][0]["resourceRules"][0]["verbs"] == ["get"]


def test_resource_labels() -> None:
    assert resource_label("", "pods") == "pods"
    assert resource_label("checkpoint.rollout.dev", "rolloutsets/status") == "rolloutsets/status"
    assert resource_label("coordination.k8s.io", "leases") == "leases.coordination.k8s.io"
    assert resource_label("apps", "deployments/scale") == "deployments.apps/scale"


def sample(name: str, schema: str, level: str, value: int) -> str:
    return f'{name}{{flow_schema="{schema}",priority_level="{level}"}} {value}'


DISPATCHED = "apiserver_flowcontrol_dispatched_requests_total"
EXECUTING = "apiserver_flowcontrol_current_executing_requests"
METRICS = "\n".join(
    [
        f"# HELP {DISPATCHED} [BETA] Number of requests executed by API Priority and Fairness",
        f"# TYPE {DISPATCHED} counter",
        sample(
            DISPATCHED,
            "bench-operator-get-rolloutcheckpoints.checkpoint.rollout.dev",
            "bench-operator",
            3,
        ),
        sample(DISPATCHED, "bench-operator-patch-pods", "bench-operator", 16),
        sample(DISPATCHED, "bench-operator-get-other", "bench-operator", 2),
        sample(DISPATCHED, "bench-operator-other", "bench-operator", 1),
        sample(DISPATCHED, "exempt", "exempt", 900),
        sample(DISPATCHED, "service-accounts", "workload-low", 40),
        f"# HELP {EXECUTING} [BETA] Number of requests executing",
        f"# TYPE {EXECUTING} gauge",
        sample(EXECUTING, "bench-operator-patch-pods", "bench-operator", 1),
        'apiserver_request_total{code="200",resource="pods",verb="PATCH"} 77',
        "",
    ]
)


def test_dispatched_counts_read_only_our_schemas() -> None:
    counts = ACCOUNTING.counts(METRICS)
    assert counts == Counter(
        {
            ("get", "rolloutcheckpoints"): 3,
            ("patch", "pods"): 16,
            ("get", OTHER): 2,
            (OTHER, OTHER): 1,
        }
    )
    assert dispatched_counts(METRICS, {}) == Counter()


def test_by_verb_and_difference() -> None:
    before = Counter({("get", "pods"): 2, ("patch", "pods"): 4})
    after = Counter({("get", "pods"): 5, ("patch", "pods"): 4, ("list", "pods"): 1})
    assert difference(after, before) == Counter({("get", "pods"): 3, ("list", "pods"): 1})
    verbs = by_verb(after)
    assert verbs["get"] == 5.0
    assert verbs["list"] == 1.0
    assert verbs["delete"] == 0.0
    assert set(verbs) == set(VERBS)
    assert by_verb({(OTHER, OTHER): 2})[OTHER] == 2
