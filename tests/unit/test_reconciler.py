"""The per-set loops' passes (`rollout_operator/flows/reconciler.py`) against the in-memory API
server (`FakeCluster`): they keep their memory in the `OperatorState` they are handed
(docs/design.md#611-the-operators-in-process-state), and in nothing else."""

from __future__ import annotations

from pathlib import Path

from rollout_operator.cluster.kube import Kube
from rollout_operator.decide import queue
from rollout_operator.decide.policy.views import Note
from rollout_operator.flows.reconciler import policy_pass, set_pass
from rollout_operator.flows.recovery import RecoveryWaits
from rollout_operator.flows.state import OperatorState
from rollout_operator.model import api
from rollout_operator.model.api import RolloutSet
from testsupport.fakecluster import FakeCluster
from testsupport.policy import NS, rollout_set, seeded


def _names(cluster: FakeCluster, plural: str) -> set[str]:
    return {o["metadata"]["name"] for o in cluster.list_objects(plural, NS)}


async def _no_transition(rset: RolloutSet, reason: str, message: str, warning: bool) -> None:
    raise AssertionError(f"no recovery expected: {reason}: {message}")


async def _set_pass(kube: Kube, state: OperatorState, warnings: list[tuple[str, str]]) -> None:
    """One pass of the set `math`'s loop, its Warning Events kept in `warnings`."""
    await set_pass(
        kube,
        NS,
        "math",
        state=state,
        max_replicas_per_role=api.MAX_REPLICAS,
        recovery_waits=RecoveryWaits(),
        warned=set(),
        post_warning=lambda _rset, reason, message: warnings.append((reason, message)),
        on_transition=_no_transition,
    )


async def test_the_set_pass_remembers_in_the_state_it_is_handed(tmp_path: Path) -> None:
    body = rollout_set(tmp_path)
    del body["status"]  # a new set: no attempt whose pods could be lost
    cluster = seeded(body)
    kube = cluster.kube()
    warnings: list[tuple[str, str]] = []
    state = OperatorState()

    async def one_pass(state: OperatorState) -> None:
        await _set_pass(kube, state, warnings)

    await one_pass(state)
    assert _names(cluster, "secrets"), "the first pass ensures the token Secret"
    shown = cluster.get(api.ROLLOUT_SET_PLURAL, NS, "math")
    assert shown is not None
    latest = shown["status"].get("latestCheckpoint")
    assert not state.latest_written.written_elsewhere(NS, "math", latest)
    assert state.latest_written.written_elsewhere(NS, "math", "written-by-hand")

    for secret in _names(cluster, "secrets"):
        cluster.remove("secrets", NS, secret)
    await one_pass(state)
    assert _names(cluster, "secrets") == set(), "this state ensured it lately: not again"
    await one_pass(OperatorState())
    assert _names(cluster, "secrets"), "a process that has just started ensures it again"
    assert warnings == []


async def test_the_policy_pass_logs_its_notes_in_the_state_it_is_handed(tmp_path: Path) -> None:
    body = rollout_set(tmp_path)
    body["metadata"]["annotations"] = {api.ANNOTATION_TRAINER_STEP: "step-twelve"}
    kube = seeded(body).kube()
    notes: list[Note] = []
    state = OperatorState()

    async def note(_rset: RolloutSet, found: Note) -> None:
        notes.append(found)

    await policy_pass(kube, NS, "math", state=state, on_note=note)
    assert notes, "an invalid trainer step is a note"
    assert all(not state.logged_notes.first_time(NS, "math", n.reason, n.message) for n in notes), (
        "each note the pass saw is logged in this state"
    )
    await policy_pass(kube, NS, "math", state=state, on_note=note)
    assert len(notes) == 2 * len({(n.reason, n.message) for n in notes}), (
        "the sink sees every pass's notes"
    )


def _status_writes(cluster: FakeCluster) -> int:
    return sum(
        1
        for r in cluster.requests
        if r.verb == "patch" and r.plural == api.ROLLOUT_SET_PLURAL and r.subresource == "status"
    )


async def test_a_set_pass_writes_the_status_at_most_once_and_not_when_nothing_changed(
    tmp_path: Path,
) -> None:
    """One write per pass, as the set's one owner computes it (docs/design.md#69-who-writes-the-
    sets-status): the repairs and the recovery write nothing on a set whose status the cluster
    bears out, and a pass that finds nothing new writes nothing."""
    body = rollout_set(tmp_path)
    del body["status"]
    cluster = seeded(body)
    kube = cluster.kube()
    state = OperatorState()

    async def one_pass() -> int:
        before = _status_writes(cluster)
        await _set_pass(kube, state, [])
        return _status_writes(cluster) - before

    assert await one_pass() == 1, "the first pass creates the pod and writes the status once"
    assert await one_pass() == 0, "nothing changed: nothing written"
    for pod in cluster.list_objects("pods", NS):
        pod["status"] = {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        }
        cluster.put(pod)
    assert await one_pass() == 1, "the pod is Ready: the set is up, written once"
    shown = cluster.get(api.ROLLOUT_SET_PLURAL, NS, "math")
    assert shown is not None
    assert shown["status"]["createdAttempt"] == 1
    assert await one_pass() == 0, "a steady set: nothing written"


async def test_a_policy_pass_writes_the_queues_and_the_policys_status_in_one_patch(
    tmp_path: Path,
) -> None:
    """A queued set seen first: the queue pass creates its Workload and holds the set
    (`spec.suspend`), and the policy pass acts on the hold in the same pass; their conditions
    go out in one status patch, against the set as the hold left it."""
    body = rollout_set(tmp_path)
    body["metadata"]["labels"] = {queue.LABEL_QUEUE: "team-q"}
    cluster = seeded(body)
    kube = cluster.kube()
    notes: list[Note] = []

    async def note(_rset: RolloutSet, found: Note) -> None:
        notes.append(found)

    before = _status_writes(cluster)
    await policy_pass(kube, NS, "math", state=OperatorState(), on_note=note)
    assert _status_writes(cluster) == before + 1
    shown = cluster.get(api.ROLLOUT_SET_PLURAL, NS, "math")
    assert shown is not None
    assert shown["spec"]["suspend"] is True, "the queue pass holds the set"
    conditions = {c["type"]: c["status"] for c in shown["status"]["conditions"]}
    assert conditions[api.SetConditionType.QUOTA_PENDING.value] == "True"
    assert conditions[api.SetConditionType.SUSPENDED.value] == "True"
    assert _names(cluster, "workloads") == {queue.workload_name(RolloutSet.model_validate(shown))}
