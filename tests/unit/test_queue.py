"""A RolloutSet under Kueue: the decisions (`decide.queue`, pure) and the queue pass carried out
against the in-memory API server (`FakeCluster`, a named fake below the operator's real client),
together with the policy pass it hands a suspend to. Kueue itself is played by the test, writing
the Workload's status as Kueue would; the e2e (tests/e2e/test_kueue.py) runs the real Kueue."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rollout_operator.decide import queue
from rollout_operator.decide.policy.views import Note
from rollout_operator.decide.resources import participant_pod
from rollout_operator.flows.queuepass import QueuePass, WorkloadNotCreated
from rollout_operator.model import api
from rollout_operator.model.reasons import Reason
from testsupport.fakecluster import FakeCluster
from testsupport.policy import NS, T0, Run, rollout_set, seeded, stamp

pytestmark = pytest.mark.unit

PREEMPTION = (
    "Preempted to accommodate a workload (UID: u-2, JobUID: j-2) due to prioritization in the "
    "ClusterQueue; preemptor path: /gpus; preemptee path: /gpus"
)


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


def queued_set(storage: Path, **labels: str) -> dict[str, Any]:
    """`math` labelled for LocalQueue `team-q`, with a model role that asks for a GPU as a
    limit only (as pods usually do)."""
    body = rollout_set(storage)
    body["metadata"]["labels"] = {queue.LABEL_QUEUE: "team-q", **labels}
    model = {
        "name": "m",
        "ports": [{"name": "control", "containerPort": 8000}],
        "resources": {"limits": {"nvidia.com/gpu": "2"}, "requests": {"cpu": "1"}},
    }
    body["spec"]["participants"].append(
        {"role": "model", "replicas": 2, "template": {"spec": {"containers": [model]}}}
    )
    return body


def as_set(body: dict[str, Any]) -> api.RolloutSet:
    return api.RolloutSet.model_validate(body)


def workload(
    *conditions: tuple[str, str, str, str], admission: dict[str, Any] | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [
            {
                "type": t,
                "status": s,
                "reason": r,
                "message": m,
                "lastTransitionTime": stamp(0),
            }
            for t, s, r, m in conditions
        ]
    }
    if admission is not None:
        status["admission"] = admission
    return {
        "apiVersion": queue.WORKLOAD_API_VERSION,
        "kind": "Workload",
        "metadata": {"name": "w", "namespace": NS, "generation": 1, "resourceVersion": "7"},
        "status": status,
    }


ADMISSION = {
    "clusterQueue": "gpus",
    "podSetAssignments": [
        {"name": "environment", "flavors": {"cpu": "default"}, "count": 1},
        {"name": "model", "flavors": {"nvidia.com/gpu": "h100", "cpu": "default"}, "count": 2},
    ],
}
ADMITTED = (
    ("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue gpus"),
    ("Admitted", "True", "Admitted", "The workload is admitted"),
)
EVICTED = ("Evicted", "True", "Preempted", PREEMPTION)
FLAVORS = {
    "default": queue.Flavor("default"),
    "h100": queue.Flavor(
        "h100",
        {"gpu.example/model": "h100"},
        ({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},),
    ),
}


def view(body: dict[str, Any], pods_left: int = 0) -> queue.QueueSetView:
    return queue.QueueSetView.from_set(as_set(body), pods_left=pods_left)


def decide(body: dict[str, Any], found: dict[str, Any] | None, **kw: Any) -> queue.QueuePlan:
    rset = as_set(body)
    wv = queue.WorkloadView.from_object(found) if found is not None else None
    manifest = queue.workload_manifest(rset, kw.pop("priority", None)) if found is None else None
    return queue.decide(
        view(body, kw.pop("pods_left", 0)), wv, manifest=manifest, now=T0, flavors=FLAVORS, **kw
    )


def conditions(plan: queue.QueuePlan) -> dict[str, tuple[bool, str, str]]:
    return {c.type: (c.status, c.reason, c.message) for c in plan.conditions}


def suspended(body: dict[str, Any], message: str) -> dict[str, Any]:
    body["spec"]["suspend"] = True
    body["status"]["conditions"].append(
        {
            "type": "Suspended",
            "status": "True",
            "reason": "Suspended",
            "message": message,
            "lastTransitionTime": stamp(5),
        }
    )
    return body


# --- decisions ------------------------------------------------------------------------------------


def test_a_new_queued_set_gets_a_workload_with_one_pod_set_per_role_and_is_held(
    storage: Path,
) -> None:
    body = queued_set(storage, **{queue.LABEL_PRIORITY_CLASS: "low"})
    plan = decide(body, None, priority=100)
    assert plan.suspend is True
    assert plan.create is not None
    spec = plan.create["spec"]
    assert spec["queueName"] == "team-q"
    assert spec["priority"] == 100
    assert spec["priorityClassRef"]["name"] == "low"
    assert [(p["name"], p["count"]) for p in spec["podSets"]] == [("environment", 1), ("model", 2)]
    body["spec"]["standby"] = {"model": 1}
    with_standby = decide(body, None, priority=100).create
    assert with_standby is not None
    assert [p["count"] for p in with_standby["spec"]["podSets"]] == [1, 3]
    model = spec["podSets"][1]["template"]["spec"]["containers"][0]
    # A limit-only GPU counts as its request, as the API server defaults a pod's.
    assert model["resources"]["requests"] == {"cpu": "1", "nvidia.com/gpu": "2"}
    meta = plan.create["metadata"]
    assert meta["labels"][api.LABEL_SET] == "math"
    assert meta["ownerReferences"][0]["uid"] == "uid-1"
    assert meta["name"] == queue.workload_name(as_set(body))
    assert conditions(plan)["QuotaPending"][:2] == (True, Reason.WORKLOAD_CREATED)


def test_a_missing_priority_class_creates_nothing_and_says_so(storage: Path) -> None:
    body = queued_set(storage, **{queue.LABEL_PRIORITY_CLASS: "nope"})
    rset = as_set(body)
    plan = queue.decide(
        view(body),
        None,
        manifest=queue.workload_manifest(rset, None),
        priority_class_missing="nope",
        now=T0,
    )
    assert plan.create is None
    status, reason, message = conditions(plan)["QuotaPending"]
    assert (status, reason) == (True, Reason.PRIORITY_CLASS_NOT_FOUND)
    assert "nope" in message
    assert plan.notes[0].warning


def test_pending_shows_kueues_own_message(storage: Path) -> None:
    why = "couldn't assign flavors to pod set model: insufficient unused quota for nvidia.com/gpu"
    plan = decide(queued_set(storage), workload(("QuotaReserved", "False", "Pending", why)))
    assert plan.suspend is True
    assert plan.create is None
    assert plan.release is None
    status, reason, message = conditions(plan)["QuotaPending"]
    assert (status, reason) == (True, "Pending")
    assert why in message


def test_admission_starts_the_set_with_the_flavors_placement(storage: Path) -> None:
    body = queued_set(storage)
    body["spec"]["suspend"] = True
    plan = decide(body, workload(*ADMITTED, admission=ADMISSION))
    assert plan.suspend is False
    assert plan.placement is not None
    status, reason, message = conditions(plan)["QuotaPending"]
    assert (status, reason) == (False, Reason.ADMITTED)
    assert "gpus" in message
    assert "model: default/h100" in message
    # The pods the set's pass creates then carry the flavors' selector and tolerations.
    body["metadata"]["annotations"] = {queue.ANNOTATION_PLACEMENT: plan.placement}
    rset = as_set(body)
    model = next(p for p in rset.spec.participants if p.role.value == "model")
    pod = participant_pod(rset, model, 0, 1, {})
    assert pod["spec"]["nodeSelector"] == {"gpu.example/model": "h100"}
    assert pod["spec"]["tolerations"] == [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    env = next(p for p in rset.spec.participants if p.role.value == "environment")
    assert "nodeSelector" not in participant_pod(rset, env, 0, 1, {})["spec"]
    assert not queue.queue_holds(rset)


def test_an_admitted_running_set_is_left_alone(storage: Path) -> None:
    body = queued_set(storage)
    found = workload(*ADMITTED, admission=ADMISSION)
    placed = decide(body, found).placement
    body["metadata"]["annotations"] = {queue.ANNOTATION_PLACEMENT: placed or ""}
    plan = decide(body, found)
    assert (plan.suspend, plan.placement, plan.create, plan.release) == (None, None, None, None)


def test_preemption_suspends_first_and_names_the_preemptor(storage: Path) -> None:
    plan = decide(queued_set(storage), workload(*ADMITTED, EVICTED, admission=ADMISSION))
    assert plan.suspend is True
    assert plan.release is None, "the quota goes only once the pods are gone"
    status, reason, message = conditions(plan)["Preempted"]
    assert (status, reason) == (True, "Preempted")
    assert "UID: u-2, JobUID: j-2" in message
    assert "suspend checkpoint" in message


def test_pods_still_there_hold_the_quota(storage: Path) -> None:
    body = suspended(queued_set(storage), "spec.suspend is true; checkpoint math-suspend-a3 ...")
    plan = decide(body, workload(*ADMITTED, EVICTED, admission=ADMISSION), pods_left=1)
    assert plan.release is None
    assert plan.suspend is None


def test_released_pods_hand_the_quota_back_as_kueue_expects(storage: Path) -> None:
    kept = "spec.suspend is true; checkpoint math-suspend-a3 holds the state; pods released"
    body = suspended(queued_set(storage), kept)
    plan = decide(body, workload(*ADMITTED, EVICTED, admission=ADMISSION))
    assert plan.release is not None
    status = plan.release["status"]
    assert status["admission"] is None
    by_type = {c["type"]: c for c in status["conditions"]}
    assert (by_type["QuotaReserved"]["status"], by_type["QuotaReserved"]["reason"]) == (
        "False",
        "Pending",
    )
    assert by_type["Admitted"]["status"] == "False"
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True", "Preempted")
    assert by_type["Evicted"]["status"] == "True", "Kueue's own condition is left as it was"
    assert plan.release["metadata"]["resourceVersion"] == "7"
    message = conditions(plan)["Preempted"][2]
    assert "math-suspend-a3 holds the state" in message
    assert "quota handed back" in message
    assert plan.notes == (Note("QuotaReleased", message, warning=False),)


def test_a_failed_suspend_checkpoint_still_releases_the_quota_and_says_so(storage: Path) -> None:
    kept = (
        "spec.suspend is true; the suspend checkpoint math-suspend-a3 failed (PrepareTimeout); "
        "a resume restores math-1; pods released"
    )
    body = suspended(queued_set(storage), kept)
    plan = decide(body, workload(*ADMITTED, EVICTED, admission=ADMISSION))
    assert plan.release is not None
    message = conditions(plan)["Preempted"][2]
    assert "failed (PrepareTimeout)" in message
    assert "quota handed back" in message
    assert plan.notes[0].warning


def test_readmission_resumes_and_clears_preempted(storage: Path) -> None:
    body = suspended(queued_set(storage), "... pods released")
    body["status"]["conditions"].append(
        {
            "type": "Preempted",
            "status": "True",
            "reason": "Preempted",
            "message": PREEMPTION,
            "lastTransitionTime": stamp(5),
        }
    )
    readmitted = workload(*ADMITTED, ("Evicted", "False", "QuotaReserved", ""), admission=ADMISSION)
    plan = decide(body, readmitted)
    assert plan.suspend is False
    assert conditions(plan)["Preempted"][:2] == (False, Reason.READMITTED)


def test_without_the_label_the_set_is_not_held(storage: Path) -> None:
    body = rollout_set(storage)
    assert queue.queue_of(as_set(body)) is None
    assert not queue.queue_holds(as_set(body))
    assert queue.queue_holds(as_set(queued_set(storage)))


# --- the pass, against the fake API server -----------------------------------------------------


def add_pod(cluster: FakeCluster, name: str) -> None:
    cluster.put(
        {
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": {api.LABEL_SET: "math", api.LABEL_ATTEMPT: "3"},
            },
            "status": {"phase": "Running"},
        }
    )


def kueue_writes(cluster: FakeCluster, name: str, *conditions: tuple[str, str, str, str]) -> None:
    """The test plays Kueue: it sets these conditions (and the admission while QuotaReserved)."""

    def change(obj: dict[str, Any]) -> None:
        status = obj.setdefault("status", {})
        have = {c["type"]: c for c in status.get("conditions") or []}
        for t, s, r, m in conditions:
            have[t] = {
                "type": t,
                "status": s,
                "reason": r,
                "message": m,
                "lastTransitionTime": stamp(1),
            }
        status["conditions"] = list(have.values())
        if have.get("QuotaReserved", {}).get("status") == "True":
            status["admission"] = ADMISSION

    cluster.update("workloads", NS, name, change)


async def test_the_pass_without_the_label_sends_nothing(storage: Path) -> None:
    cluster = seeded(rollout_set(storage))
    before = len(cluster.requests)
    outcome = await QueuePass(cluster.kube(), clock=lambda: T0).run(NS, "math")
    assert outcome.plan is None
    assert [r for r in cluster.requests[before:] if r.verb not in ("get", "list")] == []


async def test_preemption_end_to_end_on_the_fake_api_server(storage: Path) -> None:
    """Admission starts the set; an eviction suspends it, the policy saves the suspend
    checkpoint and releases the pods, and only then the quota goes back; readmission resumes."""
    body = queued_set(storage, **{queue.LABEL_PRIORITY_CLASS: "low"})
    cluster = seeded(body)
    cluster.put({"kind": "WorkloadPriorityClass", "metadata": {"name": "low"}, "value": 10})
    for flavor in ("default", "h100"):
        cluster.put({"kind": "ResourceFlavor", "metadata": {"name": flavor}, "spec": {}})
    notes: list[Note] = []

    async def note(_rset: api.RolloutSet, found: Note) -> None:
        notes.append(found)

    kube = cluster.kube()
    queued = QueuePass(kube, clock=lambda: T0, on_note=note)
    policy = Run(cluster, storage)
    policy.kube = kube
    name = queue.workload_name(as_set(body))

    async def both() -> None:
        await queued.run(NS, "math")
        await policy()

    def stored() -> dict[str, Any]:
        found = cluster.get(api.ROLLOUT_SET_PLURAL, NS, "math")
        assert found is not None
        return found

    def condition(type_: str) -> dict[str, Any]:
        return next(c for c in stored()["status"]["conditions"] if c["type"] == type_)

    await both()
    created = cluster.get("workloads", NS, name)
    assert created is not None
    assert created["spec"]["priority"] == 10
    assert stored()["spec"]["suspend"] is True
    assert condition("QuotaPending")["status"] == "True"

    kueue_writes(cluster, name, *ADMITTED)
    await both()
    assert stored()["spec"]["suspend"] is False
    assert queue.ANNOTATION_PLACEMENT in stored()["metadata"]["annotations"]
    assert condition("QuotaPending")["reason"] == "Admitted"

    add_pod(cluster, "math-environment-0-a3")  # the set's pass ran attempt 3's pods
    kueue_writes(cluster, name, EVICTED)
    await both()
    assert stored()["spec"]["suspend"] is True
    assert condition("Preempted")["status"] == "True"
    checkpoints = cluster.list_objects(api.ROLLOUT_CHECKPOINT_PLURAL, NS)
    assert [c["metadata"]["name"] for c in checkpoints] == ["math-suspend-a3"]
    assert cluster.list_objects("pods", NS), "no pod goes before the checkpoint is Ready"
    assert (cluster.get("workloads", NS, name) or {})["status"].get("admission")

    def ready(obj: dict[str, Any]) -> None:
        obj["status"] = {
            "phase": "Ready",
            "completedAt": stamp(3),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Published",
                    "lastTransitionTime": stamp(3),
                }
            ],
        }

    cluster.update(api.ROLLOUT_CHECKPOINT_PLURAL, NS, "math-suspend-a3", ready)
    await both()  # the policy releases the pods (Suspended=True, then the deletes)
    assert not cluster.list_objects("pods", NS)
    assert condition("Suspended")["status"] == "True"
    await both()  # pods gone: the quota goes back
    released = cluster.get("workloads", NS, name) or {}
    assert "admission" not in released["status"]
    by_type = {c["type"]: c for c in released["status"]["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False"
    assert by_type["Requeued"]["status"] == "True"
    assert "math-suspend-a3 holds the state" in condition("Preempted")["message"]
    assert [n.reason for n in notes] == ["QuotaReleased"]

    # Kueue readmits it once the preemptor is done: the set resumes (the policy clears
    # Suspended with reason Resumed; the set's loop then starts the recovery to attempt 4).
    kueue_writes(cluster, name, *ADMITTED, ("Evicted", "False", "QuotaReserved", ""))
    await both()
    assert stored()["spec"]["suspend"] is False
    assert condition("Preempted")["reason"] == Reason.READMITTED
    assert (condition("Suspended")["status"], condition("Suspended")["reason"]) == (
        "False",
        Reason.RESUMED,
    )


async def test_without_kueue_installed_the_set_says_so_and_creates_no_pods(storage: Path) -> None:
    cluster = seeded(queued_set(storage))
    cluster.refuse("create", "workloads", status=404, message="the server could not find it")
    with pytest.raises(WorkloadNotCreated):
        await QueuePass(cluster.kube(), clock=lambda: T0).run(NS, "math")
    stored = cluster.get(api.ROLLOUT_SET_PLURAL, NS, "math") or {}
    pending = next(c for c in stored["status"]["conditions"] if c["type"] == "QuotaPending")
    assert (pending["status"], pending["reason"]) == ("True", "KueueNotInstalled")
    assert "install Kueue" in pending["message"]
    assert queue.queue_holds(as_set(stored))
