"""Two operators with one leader Lease (`--leader-lease`, as the chart's single replica runs):
the second waits, doing nothing, until the first has stopped, then starts at once.

This is what a replaced operator pod goes through: a Deployment starts the new pod as soon as
the old one is deleted or evicted, while the old one still stops. The operators are real
processes on a real API server (devcluster); each one's identity is its host and process id.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from testsupport.operator_fixtures import OperatorProcess

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for_sync
from harness.objects import apply_crds

LEASE = "rollout-operator-leader"
WAITING = "waiting for it to stop"


def lease(cluster: Cluster, namespace: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "lease", LEASE, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def identity(operator: OperatorProcess) -> str:
    assert operator.process is not None
    return f"{socket.gethostname()}/{operator.process.pid}"


def live(operator: OperatorProcess) -> bool:
    try:
        return httpx.get(operator.liveness, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(180)
def test_a_second_operator_waits_for_the_leader_lease_and_starts_when_the_first_stops(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    apply_crds(cluster)
    args = ["--standalone", "--leader-lease", f"{namespace}/{LEASE}"]
    first = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "first.log", args=args)
    second = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "second.log", args=args)
    try:
        first.start()
        first.wait_live()
        assert lease(cluster, namespace)["spec"]["holderIdentity"] == identity(first)

        second.start()
        wait_for_sync(
            lambda: WAITING in second.tail(200),
            60,
            "the second operator to say it waits for the Lease",
            interval=0.2,
        )
        assert identity(first) in second.tail(200), "it names whom it waits for"
        assert not live(second), "a waiting operator has not started Kopf's handlers"
        assert second.running

        assert first.terminate() == 0
        second.wait_live(timeout=60)
        held = lease(cluster, namespace)["spec"]
        assert held["holderIdentity"] == identity(second)
        # Released by the first as it stopped, not taken over after it lapsed.
        assert held.get("leaseTransitions", 0) == 0, held
        assert "taking over" not in second.tail(200)
        assert "released" in first.tail(200)
    finally:
        first.stop()
        second.stop()
        print(f"--- first ---\n{first.tail(40)}\n--- second ---\n{second.tail(40)}")
