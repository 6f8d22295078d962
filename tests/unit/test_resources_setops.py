"""The reconcile pass against an in-memory API server (`FakeCluster`, below the operator's real
client): what it creates and what status it writes."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rollout_operator.cluster.kube import Kube
from rollout_operator.cluster.objects import (
    ENSURE_EVERY_SECONDS,
    OwnedObjects,
    delete_attempt_pods,
    ensure_control_token,
    read_control_token,
)
from rollout_operator.decide.resources import attempt_selector
from rollout_operator.flows import setpass
from rollout_operator.flows.setpass import ReconcileOutcome
from rollout_operator.flows.state import OperatorState
from rollout_operator.model import api
from testsupport import builders
from testsupport.fakecluster import FakeCluster

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
NS = "team"


@pytest.fixture
def state() -> OperatorState:
    """Each test starts with a process that has ensured nothing (the record is per process)."""
    return OperatorState()


async def reconcile_set(
    kube: Kube, namespace: str, name: str, *, state: OperatorState, now: datetime
) -> ReconcileOutcome:
    """One pass of the set in the process whose memory is `state`."""
    return await setpass.reconcile_set(
        kube,
        namespace,
        name,
        owned_objects=state.owned_objects,
        latest_written=state.latest_written,
        now=now,
    )


def seeded(rset: dict[str, Any] | None) -> FakeCluster:
    """An API server holding the set (when given), whose clock stands at T0 (when the pods the
    reconciler creates were created)."""
    cluster = FakeCluster(clock=lambda: T0)
    if rset is not None:
        cluster.put(rset)
    return cluster


def stored_set(cluster: FakeCluster) -> dict[str, Any]:
    found = cluster.get(api.ROLLOUT_SET_PLURAL, NS, "rl")
    assert found is not None
    return found


def pods(cluster: FakeCluster) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in cluster.list_objects("pods", NS)}


def names(cluster: FakeCluster, plural: str) -> set[str]:
    return {o["metadata"]["name"] for o in cluster.list_objects(plural, NS)}


def status_writes(cluster: FakeCluster) -> list[dict[str, Any]]:
    """The status patches the operator sent to the set."""
    return [
        dict((r.body or {}).get("status") or {})
        for r in cluster.requests
        if r.verb == "patch" and r.plural == api.ROLLOUT_SET_PLURAL and r.subresource == "status"
    ]


class Node:
    """What the node would do: run the pending pods, each at an address of its own."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.next_ip = 1

    def start_pods(self, ready: bool = True) -> None:
        for name, pod in pods(self.cluster).items():
            if (pod.get("status") or {}).get("phase", "Pending") != "Pending":
                continue
            status = {
                "phase": "Running",
                "podIP": f"127.0.2.{self.next_ip}",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            }
            self.next_ip += 1

            def run(obj: dict[str, Any], status: dict[str, Any] = status) -> None:
                obj["status"] = status

            self.cluster.update("pods", NS, name, run)


def condition(cluster: FakeCluster, type_: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        c for c in stored_set(cluster)["status"]["conditions"] if c["type"] == type_
    ]
    assert len(found) == 1
    return found[0]


def rollout_set(**spec_extra: Any) -> dict[str, Any]:
    participants = [builders.participant(role, None) for role in ("model", "environment")]
    for entry in participants:
        entry["template"]["spec"]["containers"][0]["command"] = ["x"]
    return builders.set_body(
        namespace=NS, uid="uid-1", generation=1, participants=participants, **spec_extra
    )


async def converge(
    kube: Kube, node: Node, state: OperatorState, now: datetime = T0, rounds: int = 5
) -> None:
    """Reconcile and let the node start what was created, until nothing changes."""
    for _ in range(rounds):
        outcome = await reconcile_set(kube, NS, "rl", state=state, now=now)
        assert not outcome.conflict
        node.start_pods()


async def test_first_pass_creates_token_services_and_the_callee_pods(state: OperatorState) -> None:
    cluster = seeded(rollout_set())
    await reconcile_set(cluster.kube(), NS, "rl", state=state, now=T0)
    assert names(cluster, "secrets") == {"rl-control-token"}
    assert names(cluster, "services") == {"rl-model", "rl-environment"}
    assert set(pods(cluster)) == {"rl-model-0-a1"}  # environment waits for the model's address
    status = stored_set(cluster)["status"]
    assert status["attempt"] == 1
    assert "createdAttempt" not in status
    assert condition(cluster, "Ready")["reason"] == "PodsStarting"
    assert condition(cluster, "Progressing")["status"] == "True"


async def test_the_set_becomes_ready_with_participants_and_observed_generation(
    state: OperatorState,
) -> None:
    cluster = seeded(rollout_set())
    await converge(cluster.kube(), Node(cluster), state)
    running = pods(cluster)
    assert set(running) == {"rl-model-0-a1", "rl-environment-0-a1"}
    env = {
        e["name"]: e.get("value")
        for e in running["rl-environment-0-a1"]["spec"]["containers"][0]["env"]
    }
    model_ip = running["rl-model-0-a1"]["status"]["podIP"]
    assert env["ROLLOUT_PEER_MODEL_URL"] == f"http://{model_ip}:8000"
    status = stored_set(cluster)["status"]
    assert status["createdAttempt"] == 1
    assert status["observedGeneration"] == 1
    assert condition(cluster, "Ready")["status"] == "True"
    assert condition(cluster, "Degraded")["status"] == "False"
    assert [(p["role"], p["ready"], p["address"]) for p in status["participants"]] == [
        ("environment", True, f"http://{running['rl-environment-0-a1']['status']['podIP']}:8000"),
        ("model", True, f"http://{model_ip}:8000"),
    ]


async def test_an_unchanged_status_is_not_written_again(state: OperatorState) -> None:
    cluster = seeded(rollout_set())
    kube = cluster.kube()
    await converge(kube, Node(cluster), state)
    writes = len(status_writes(cluster))
    await reconcile_set(kube, NS, "rl", state=state, now=T0 + timedelta(seconds=5))
    assert len(status_writes(cluster)) == writes


async def test_a_pod_lost_after_creation_is_not_recreated(state: OperatorState) -> None:
    cluster = seeded(rollout_set())
    kube = cluster.kube()
    await converge(kube, Node(cluster), state)
    cluster.remove("pods", NS, "rl-model-0-a1")
    await reconcile_set(kube, NS, "rl", state=state, now=T0)
    assert "rl-model-0-a1" not in pods(cluster)
    assert condition(cluster, "Degraded")["reason"] == "PodsLost"
    assert condition(cluster, "Ready")["status"] == "False"


async def test_a_lost_status_race_is_reported_for_an_immediate_retry(state: OperatorState) -> None:
    cluster = seeded(rollout_set())
    put = stored_set(cluster)
    cluster.refuse(
        "patch", api.ROLLOUT_SET_PLURAL, status=409, message="the object has been modified"
    )
    outcome = await reconcile_set(cluster.kube(), NS, "rl", state=state, now=T0)
    assert outcome.conflict
    assert len(status_writes(cluster)) == 1, "the one status write, refused"
    assert stored_set(cluster) == put, "nothing written"


async def test_a_pod_the_api_server_refuses_degrades_the_set(state: OperatorState) -> None:
    cluster = seeded(rollout_set())
    cluster.refuse(
        "create",
        "pods",
        status=422,
        message="Pod is invalid: spec.containers[0].image: Required value",
    )
    await reconcile_set(cluster.kube(), NS, "rl", state=state, now=T0)
    degraded = condition(cluster, "Degraded")
    assert degraded["reason"] == "PodCreationFailed"
    assert "image: Required value" in degraded["message"]


async def test_the_progress_deadline_is_reported_as_a_recheck_time(state: OperatorState) -> None:
    cluster = seeded(rollout_set(progressDeadlineSeconds=30))
    kube = cluster.kube()
    outcome = await reconcile_set(kube, NS, "rl", state=state, now=T0)
    assert outcome.recheck_at == T0 + timedelta(seconds=30)
    await reconcile_set(kube, NS, "rl", state=state, now=T0 + timedelta(seconds=31))
    assert condition(cluster, "Degraded")["reason"] == "PodsNotStarting"


async def test_while_recovering_only_participants_are_refreshed(state: OperatorState) -> None:
    cluster = seeded(rollout_set())
    kube = cluster.kube()
    await converge(kube, Node(cluster), state)

    def recovering(rset: dict[str, Any]) -> None:
        rset["status"]["recovery"] = {
            "phase": "StartingPods",
            "fromAttempt": 1,
            "targetAttempt": 2,
            "startedAt": "2026-11-29T12:00:00Z",
        }

    cluster.update(api.ROLLOUT_SET_PLURAL, NS, "rl", recovering)
    before = copy.deepcopy(stored_set(cluster)["status"]["conditions"])
    cluster.remove("pods", NS, "rl-model-0-a1")
    await reconcile_set(kube, NS, "rl", state=state, now=T0)
    assert set(pods(cluster)) == {"rl-environment-0-a1"}  # nothing created by the reconciler
    status = stored_set(cluster)["status"]
    assert status["conditions"] == before
    assert [p["pod"] for p in status["participants"]] == [
        "rl-environment-0-a2",
        "rl-model-0-a2",
    ]


async def test_a_suspended_set_creates_no_pods(state: OperatorState) -> None:
    cluster = seeded(rollout_set(suspend=True))
    await reconcile_set(cluster.kube(), NS, "rl", state=state, now=T0)
    assert pods(cluster) == {}
    assert condition(cluster, "Ready")["reason"] == "Suspended"


async def test_an_invalid_spec_is_reported_not_raised(state: OperatorState) -> None:
    body = rollout_set()
    body["spec"]["participants"][0]["replicas"] = 0
    cluster = seeded(body)
    await reconcile_set(cluster.kube(), NS, "rl", state=state, now=T0)
    assert condition(cluster, "Degraded")["reason"] == "InvalidSpec"
    assert "replicas" in condition(cluster, "Degraded")["message"]


async def test_a_deleted_set_is_left_alone(state: OperatorState) -> None:
    cluster = seeded(None)
    outcome = await reconcile_set(cluster.kube(), NS, "rl", state=state, now=T0)
    assert outcome.recheck_at is None
    assert pods(cluster) == {}


async def test_the_token_is_generated_once_and_readable_for_the_coordinator() -> None:
    cluster = seeded(rollout_set())
    kube = cluster.kube()
    rset = api.RolloutSet.model_validate(rollout_set())
    first = await ensure_control_token(kube, rset)
    assert await ensure_control_token(kube, rset) == first
    assert await read_control_token(kube, NS, "rl") == first


async def test_a_foreign_secret_with_the_token_name_blocks_the_set(state: OperatorState) -> None:
    cluster = seeded(rollout_set())
    cluster.put(
        {
            "kind": "Secret",
            "metadata": {"name": "rl-control-token", "namespace": NS},
            "data": {"token": "eA=="},
        }
    )
    await reconcile_set(cluster.kube(), NS, "rl", state=state, now=T0)
    assert condition(cluster, "Degraded")["reason"] == "TokenSecretConflict"
    assert pods(cluster) == {}


async def test_delete_attempt_pods_removes_only_that_attempt(state: OperatorState) -> None:
    cluster = seeded(rollout_set())
    kube = cluster.kube()
    await converge(kube, Node(cluster), state)
    other = pods(cluster)["rl-model-0-a1"]
    for key in ("uid", "resourceVersion", "creationTimestamp"):
        del other["metadata"][key]  # another object: the API server gives it its own
    other["metadata"]["name"] = "rl-model-0-a2"
    other["metadata"]["labels"]["checkpoint.rollout.dev/attempt"] = "2"
    cluster.put(other)
    rset = api.RolloutSet.model_validate(rollout_set())
    deleted = await delete_attempt_pods(kube, rset, 1)
    assert sorted(deleted) == ["rl-environment-0-a1", "rl-model-0-a1"]
    assert set(pods(cluster)) == {"rl-model-0-a2"}
    assert (
        attempt_selector("rl", 2)
        == "checkpoint.rollout.dev/set=rl,checkpoint.rollout.dev/attempt=2"
    )


@pytest.mark.parametrize("created_attempt", [None, 1])
async def test_spec_change_under_running_pods_is_refused(
    created_attempt: int | None, state: OperatorState
) -> None:
    cluster = seeded(rollout_set())
    kube = cluster.kube()
    await converge(kube, Node(cluster), state)

    def changed(rset: dict[str, Any]) -> None:
        if created_attempt is None:
            del rset["status"]["createdAttempt"]
        rset["spec"]["participants"][1]["replicas"] = 2
        rset["metadata"]["generation"] = 2

    cluster.update(api.ROLLOUT_SET_PLURAL, NS, "rl", changed)
    await reconcile_set(kube, NS, "rl", state=state, now=T0)
    assert "rl-environment-1-a1" not in pods(cluster)
    assert condition(cluster, "Degraded")["reason"] == "SpecChangeRefused"
    assert condition(cluster, "Degraded")["observedGeneration"] == 2
    assert stored_set(cluster)["status"]["observedGeneration"] == 2


async def test_token_and_services_are_checked_once_per_window_not_on_every_pass() -> None:
    now = [1000.0]
    state = OperatorState(owned_objects=OwnedObjects(clock=lambda: now[0]))
    cluster = seeded(rollout_set())
    kube = cluster.kube()

    def clear(plural: str) -> None:
        for name in names(cluster, plural):
            cluster.remove(plural, NS, name)

    await reconcile_set(kube, NS, "rl", state=state, now=T0)
    assert names(cluster, "secrets")
    assert names(cluster, "services")
    clear("secrets")
    clear("services")
    now[0] += ENSURE_EVERY_SECONDS - 1
    await reconcile_set(kube, NS, "rl", state=state, now=T0)
    assert names(cluster, "secrets") == set(), (
        "a pass within the window looked for the Secret again"
    )
    assert names(cluster, "services") == set(), (
        "a pass within the window created the Services again"
    )
    now[0] += 2
    await reconcile_set(kube, NS, "rl", state=state, now=T0)
    assert names(cluster, "secrets"), "a deleted Secret was not created again after the window"
    assert names(cluster, "services"), "deleted Services were not created again after the window"
