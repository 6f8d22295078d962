"""The reconcile pass against an in-memory API: what it creates and what status it writes."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from rollout_operator.cluster.kube import Conflict, Kube
from rollout_operator.cluster.objects import (
    ENSURE_EVERY_SECONDS,
    OwnedObjects,
    delete_attempt_pods,
    ensure_control_token,
    read_control_token,
)
from rollout_operator.decide.resources import attempt_selector
from rollout_operator.flows import setpass
from rollout_operator.flows.setpass import reconcile_set
from rollout_operator.model import api

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
NS = "team"


@pytest.fixture(autouse=True)
def fresh_owned_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with a process that has ensured nothing (the record is per process)."""
    monkeypatch.setattr(setpass, "owned_objects", OwnedObjects())


class FakeKube:
    """Just enough of `Kube` for the reconciler: objects in dicts, labels matched exactly."""

    def __init__(self, rset: dict[str, Any]) -> None:
        self.set: dict[str, Any] | None = rset
        self.version = 1
        self.pods: dict[str, dict[str, Any]] = {}
        self.secrets: dict[str, dict[str, Any]] = {}
        self.services: dict[str, dict[str, Any]] = {}
        self.status_writes: list[dict[str, Any]] = []
        self.refuse_pods_with: str | None = None
        self.conflict_next_write = False
        self.next_ip = 1

    def as_kube(self) -> Kube:
        return cast(Kube, self)

    async def get_set(
        self, namespace: str, name: str, *, fresh: bool = False
    ) -> dict[str, Any] | None:
        if self.set is None:
            return None
        obj = copy.deepcopy(self.set)
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    async def patch_set_status(
        self, namespace: str, name: str, status: dict[str, Any], *, resource_version: str | None
    ) -> dict[str, Any]:
        assert self.set is not None
        if self.conflict_next_write or resource_version != str(self.version):
            self.conflict_next_write = False
            raise Conflict("the object has been modified")
        self.status_writes.append(copy.deepcopy(status))
        self.set.setdefault("status", {}).update(copy.deepcopy(status))
        self.version += 1
        return self.set

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        wanted = dict(term.split("=") for term in label_selector.split(","))
        return [
            copy.deepcopy(p)
            for p in self.pods.values()
            if all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())
        ]

    async def create_pod(self, namespace: str, manifest: dict[str, Any]) -> bool:
        if self.refuse_pods_with is not None:
            from kubernetes_asyncio.client.exceptions import ApiException

            error = ApiException(status=422, reason="Unprocessable Entity")
            error.body = f'{{"message": "{self.refuse_pods_with}"}}'
            raise error
        name = manifest["metadata"]["name"]
        if name in self.pods:
            return False
        pod = copy.deepcopy(manifest)
        pod["metadata"]["creationTimestamp"] = "2026-11-29T12:00:00Z"
        pod["status"] = {"phase": "Pending"}
        self.pods[name] = pod
        return True

    async def delete_pod(
        self, namespace: str, name: str, *, grace_seconds: int | None = None
    ) -> bool:
        return self.pods.pop(name, None) is not None

    async def create_service(self, namespace: str, manifest: dict[str, Any]) -> bool:
        created = manifest["metadata"]["name"] not in self.services
        self.services.setdefault(manifest["metadata"]["name"], copy.deepcopy(manifest))
        return created

    async def get_secret(
        self, namespace: str, name: str, *, remembered: bool = False
    ) -> dict[str, Any] | None:
        return copy.deepcopy(self.secrets.get(name))

    async def list_checkpoints(self, namespace: str, set_name: str) -> list[dict[str, Any]]:
        return []  # the set's checkpoint fields are tested with InMemorySet (test_set_status)

    async def create_secret(self, namespace: str, manifest: dict[str, Any]) -> bool:
        if manifest["metadata"]["name"] in self.secrets:
            return False
        self.secrets[manifest["metadata"]["name"]] = copy.deepcopy(manifest)
        return True

    # --- what the node would do -----------------------------------------------------------

    def start_pods(self, ready: bool = True) -> None:
        for pod in self.pods.values():
            if pod["status"]["phase"] == "Pending":
                pod["status"] = {
                    "phase": "Running",
                    "podIP": f"127.0.2.{self.next_ip}",
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                }
                self.next_ip += 1

    def condition(self, type_: str) -> dict[str, Any]:
        assert self.set is not None
        found = [c for c in self.set["status"]["conditions"] if c["type"] == type_]
        assert len(found) == 1
        return found[0]


def rollout_set(**spec_extra: Any) -> dict[str, Any]:
    container = {
        "name": "c",
        "command": ["x"],
        "ports": [{"name": "control", "containerPort": 8000}],
    }
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RolloutSet",
        "metadata": {"name": "rl", "namespace": NS, "uid": "uid-1", "generation": 1},
        "spec": {
            "participants": [
                {"role": "model", "template": {"spec": {"containers": [container]}}},
                {"role": "environment", "template": {"spec": {"containers": [container]}}},
            ],
            "storage": {"path": "/ckpt", "volume": {"emptyDir": {}}},
            **spec_extra,
        },
    }


async def converge(fake: FakeKube, now: datetime = T0, rounds: int = 5) -> None:
    """Reconcile and let the 'node' start what was created, until nothing changes."""
    for _ in range(rounds):
        outcome = await reconcile_set(fake.as_kube(), NS, "rl", now=now)
        assert not outcome.conflict
        fake.start_pods()


async def test_first_pass_creates_token_services_and_the_callee_pods() -> None:
    fake = FakeKube(rollout_set())
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert set(fake.secrets) == {"rl-control-token"}
    assert set(fake.services) == {"rl-model", "rl-environment"}
    assert set(fake.pods) == {"rl-model-0-a1"}  # environment waits for the model's address
    assert fake.set is not None
    status = fake.set["status"]
    assert status["attempt"] == 1
    assert "createdAttempt" not in status
    assert fake.condition("Ready")["reason"] == "PodsStarting"
    assert fake.condition("Progressing")["status"] == "True"


async def test_the_set_becomes_ready_with_participants_and_observed_generation() -> None:
    fake = FakeKube(rollout_set())
    await converge(fake)
    assert set(fake.pods) == {"rl-model-0-a1", "rl-environment-0-a1"}
    env = {
        e["name"]: e.get("value")
        for e in fake.pods["rl-environment-0-a1"]["spec"]["containers"][0]["env"]
    }
    model_ip = fake.pods["rl-model-0-a1"]["status"]["podIP"]
    assert env["ROLLOUT_PEER_MODEL_URL"] == f"http://{model_ip}:8000"
    assert fake.set is not None
    status = fake.set["status"]
    assert status["createdAttempt"] == 1
    assert status["observedGeneration"] == 1
    assert fake.condition("Ready")["status"] == "True"
    assert fake.condition("Degraded")["status"] == "False"
    assert [(p["role"], p["ready"], p["address"]) for p in status["participants"]] == [
        ("environment", True, f"http://{fake.pods['rl-environment-0-a1']['status']['podIP']}:8000"),
        ("model", True, f"http://{model_ip}:8000"),
    ]


async def test_an_unchanged_status_is_not_written_again() -> None:
    fake = FakeKube(rollout_set())
    await converge(fake)
    writes = len(fake.status_writes)
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0 + timedelta(seconds=5))
    assert len(fake.status_writes) == writes


async def test_a_pod_lost_after_creation_is_not_recreated() -> None:
    fake = FakeKube(rollout_set())
    await converge(fake)
    del fake.pods["rl-model-0-a1"]
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert "rl-model-0-a1" not in fake.pods
    assert fake.condition("Degraded")["reason"] == "PodsLost"
    assert fake.condition("Ready")["status"] == "False"


async def test_a_lost_status_race_is_reported_for_an_immediate_retry() -> None:
    fake = FakeKube(rollout_set())
    fake.conflict_next_write = True
    outcome = await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert outcome.conflict
    assert fake.status_writes == []


async def test_a_pod_the_api_server_refuses_degrades_the_set() -> None:
    fake = FakeKube(rollout_set())
    fake.refuse_pods_with = "Pod is invalid: spec.containers[0].image: Required value"
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    degraded = fake.condition("Degraded")
    assert degraded["reason"] == "PodCreationFailed"
    assert "image: Required value" in degraded["message"]


async def test_the_progress_deadline_is_reported_as_a_recheck_time() -> None:
    fake = FakeKube(rollout_set(progressDeadlineSeconds=30))
    outcome = await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert outcome.recheck_at == T0 + timedelta(seconds=30)
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0 + timedelta(seconds=31))
    assert fake.condition("Degraded")["reason"] == "PodsNotStarting"


async def test_while_recovering_only_participants_are_refreshed() -> None:
    fake = FakeKube(rollout_set())
    await converge(fake)
    assert fake.set is not None
    fake.set["status"]["recovery"] = {
        "phase": "StartingPods",
        "fromAttempt": 1,
        "targetAttempt": 2,
        "startedAt": "2026-11-29T12:00:00Z",
    }
    before = copy.deepcopy(fake.set["status"]["conditions"])
    del fake.pods["rl-model-0-a1"]
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert set(fake.pods) == {"rl-environment-0-a1"}  # nothing created by the reconciler
    assert fake.set["status"]["conditions"] == before
    assert [p["pod"] for p in fake.set["status"]["participants"]] == [
        "rl-environment-0-a2",
        "rl-model-0-a2",
    ]


async def test_a_suspended_set_creates_no_pods() -> None:
    fake = FakeKube(rollout_set(suspend=True))
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert fake.pods == {}
    assert fake.condition("Ready")["reason"] == "Suspended"


async def test_an_invalid_spec_is_reported_not_raised() -> None:
    body = rollout_set()
    body["spec"]["participants"][0]["replicas"] = 0
    fake = FakeKube(body)
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert fake.condition("Degraded")["reason"] == "InvalidSpec"
    assert "replicas" in fake.condition("Degraded")["message"]


async def test_a_deleted_set_is_left_alone() -> None:
    fake = FakeKube(rollout_set())
    fake.set = None
    outcome = await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert outcome.recheck_at is None
    assert fake.pods == {}


async def test_the_token_is_generated_once_and_readable_for_the_coordinator() -> None:
    fake = FakeKube(rollout_set())
    rset = api.RolloutSet.model_validate(rollout_set())
    first = await ensure_control_token(fake.as_kube(), rset)
    assert await ensure_control_token(fake.as_kube(), rset) == first
    assert await read_control_token(fake.as_kube(), NS, "rl") == first


async def test_a_foreign_secret_with_the_token_name_blocks_the_set() -> None:
    fake = FakeKube(rollout_set())
    fake.secrets["rl-control-token"] = {
        "metadata": {"name": "rl-control-token"},
        "data": {"token": "eA=="},
    }
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert fake.condition("Degraded")["reason"] == "TokenSecretConflict"
    assert fake.pods == {}


async def test_delete_attempt_pods_removes_only_that_attempt() -> None:
    fake = FakeKube(rollout_set())
    await converge(fake)
    other = copy.deepcopy(fake.pods["rl-model-0-a1"])
    other["metadata"]["name"] = "rl-model-0-a2"
    other["metadata"]["labels"]["checkpoint.rollout.dev/attempt"] = "2"
    fake.pods["rl-model-0-a2"] = other
    rset = api.RolloutSet.model_validate(rollout_set())
    deleted = await delete_attempt_pods(fake.as_kube(), rset, 1)
    assert sorted(deleted) == ["rl-environment-0-a1", "rl-model-0-a1"]
    assert set(fake.pods) == {"rl-model-0-a2"}
    assert (
        attempt_selector("rl", 2)
        == "checkpoint.rollout.dev/set=rl,checkpoint.rollout.dev/attempt=2"
    )


@pytest.mark.parametrize("created_attempt", [None, 1])
async def test_spec_change_under_running_pods_is_refused(created_attempt: int | None) -> None:
    fake = FakeKube(rollout_set())
    await converge(fake)
    assert fake.set is not None
    if created_attempt is None:
        del fake.set["status"]["createdAttempt"]
    fake.set["spec"]["participants"][1]["replicas"] = 2
    fake.set["metadata"]["generation"] = 2
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert "rl-environment-1-a1" not in fake.pods
    assert fake.condition("Degraded")["reason"] == "SpecChangeRefused"
    assert fake.condition("Degraded")["observedGeneration"] == 2
    assert fake.set["status"]["observedGeneration"] == 2


async def test_token_and_services_are_checked_once_per_window_not_on_every_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(setpass, "owned_objects", OwnedObjects(clock=lambda: now[0]))
    fake = FakeKube(rollout_set())
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert fake.secrets
    assert fake.services
    fake.secrets.clear()
    fake.services.clear()
    now[0] += ENSURE_EVERY_SECONDS - 1
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert fake.secrets == {}, "a pass within the window looked for the Secret again"
    assert fake.services == {}, "a pass within the window created the Services again"
    now[0] += 2
    await reconcile_set(fake.as_kube(), NS, "rl", now=T0)
    assert fake.secrets, "a deleted Secret was not created again after the window"
    assert fake.services, "deleted Services were not created again after the window"
