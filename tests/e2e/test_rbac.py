"""The chart's RBAC is exactly enough, proven on a real API server (devcluster).

The chart's ServiceAccount and RBAC are rendered with the real helm and applied; a token for the
ServiceAccount is minted with the TokenRequest API (`kubectl create token`); the operator runs as
a process whose kubeconfig holds only that token (no client certificate), so every call it makes
is authorized by the chart's rules and nothing else.

- With the default values (cluster mode, `--all-namespaces` as the chart's Deployment runs it),
  the operator runs the examples' story: a set of the four reference servers Ready, a checkpoint
  while episodes run, the model pod killed, recovery under attempt 2 from that checkpoint, every
  episode finished; `/metrics` then shows the checkpoint, restore and attempt metrics with values,
  and the transitions are Kubernetes Events.
- With any single verb of any rule removed, some operation fails with 403: the API server's
  denial ("cannot <verb> resource ...") shows up in the operator's log or in the status of the
  object it was working on. Cases run in namespaced mode (a Role in the case's namespace plus the
  small ClusterRole), whose grants are the cluster mode's plus Kopf's namespace watch
  (tests/unit/test_chart.py proves that parity), so every verb of both modes is covered. To stay
  cheap on two cores each case runs a short probe (a one-pod set, a checkpoint of a missing set,
  a killed pod) in its own namespace, several cases at once.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from rbac_support import (
    GRANTS,
    ROOT,
    Grant,
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
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import release_finalizers, sample, samples

from devcluster.cluster import Cluster
from devcluster.testing import namespace_name
from devcluster.waiting import WaitTimeout, wait_for
from harness.objects import create_namespace, delete_namespace, with_storage
from harness.operatorprocess import OperatorProcess

EXAMPLES = ROOT / "examples"
CASE_TIMEOUT = 60.0
CONCURRENT_CASES = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- the chart's RBAC, rendered and applied ------------------------------------------------------


def granted(docs: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for doc in docs
        if doc["kind"] in ("Role", "ClusterRole")
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def without(docs: list[dict[str, Any]], grant: Grant) -> list[dict[str, Any]]:
    """The same objects with one verb taken out of the rule that grants it."""
    removed = 0
    for doc in docs:
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        rules = []
        for rule in doc["rules"]:
            if grant.group in rule["apiGroups"] and grant.resource in rule["resources"]:
                assert rule["apiGroups"] == [grant.group]
                assert rule["resources"] == [grant.resource]
                if grant.verb in rule["verbs"]:
                    removed += 1
                    rule = {**rule, "verbs": [v for v in rule["verbs"] if v != grant.verb]}
            if rule["verbs"]:
                rules.append(rule)
        doc["rules"] = rules
    assert removed == 1, f"{grant} is granted {removed} times"
    return docs


# --- the operator as a process under that token --------------------------------------------------


# --- the cases match the chart -------------------------------------------------------------------


def test_the_cases_are_the_charts_grants() -> None:
    """Every verb the chart grants has a removal case below, and nothing else does."""
    docs = render_rbac("rel", "ns", namespaced_values("ns"))
    assert granted(docs) == {(g.group, g.resource, g.verb) for g in GRANTS}
    cluster_mode = granted(render_rbac("rel", "ns", {}))
    assert cluster_mode == granted(docs) - {("", "namespaces", "list"), ("", "namespaces", "watch")}


# --- the story under the chart's ServiceAccount ---------------------------------------------------


def example_set(storage: Path) -> dict[str, Any]:
    """examples/rolloutset.yaml with its storage moved to this test's folder."""
    obj = with_storage(yaml.safe_load((EXAMPLES / "rolloutset.yaml").read_text()), storage)
    for participant in obj["spec"]["participants"]:
        if participant["role"] == "model":
            container = participant["template"]["spec"]["containers"][0]
            container["args"] = [*container["args"], "--debug-hooks"]
    return obj


def checkpoint(name: str, set_name: str) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((EXAMPLES / "rolloutcheckpoint.yaml").read_text())
    obj["metadata"]["name"] = name
    obj["spec"]["rolloutSet"] = set_name
    return obj


async def hold_at_token(http: httpx.AsyncClient, model: str, rollout_id: str) -> None:
    """Arm the model's `token` pause point (`--debug-hooks`) for one episode: it stays
    mid-generation, so the checkpoint provably captures a live episode."""
    body = {"point": "token", "rollout_id": rollout_id, "index": 2}
    reply = await http.post(model + "/debug/arm", json=body)
    assert reply.status_code == 200, reply.text


async def wait_held(http: httpx.AsyncClient, model: str, rollout_id: str) -> None:
    body = {"point": "token", "rollout_id": rollout_id, "paused": True, "count": 1, "timeout_s": 30}
    reply = await http.post(model + "/debug/wait", json=body, timeout=40)
    assert reply.status_code == 200, reply.text


async def test_checkpoint_and_recovery_under_the_charts_service_account(
    cluster: Cluster, crds: None, namespace: str, tmp_path: Path
) -> None:
    docs = render_rbac("rbac-e2e", namespace, {})
    sa_namespace, sa_name = service_account(docs)
    subject = f"system:serviceaccount:{sa_namespace}:{sa_name}"
    storage = tmp_path / "checkpoints"
    storage.mkdir()
    try:
        apply_rbac(cluster, docs, GRANTS[0])
        kubeconfig = token_kubeconfig(cluster, docs, tmp_path / "sa.kubeconfig")
        assert "client-certificate" not in kubeconfig.read_text()
        metrics_port = free_port()
        args = ["--all-namespaces", "--metrics-port", str(metrics_port)]
        with operator_process(kubeconfig, tmp_path / "operator.log", [], args=args) as op:
            try:
                await story(cluster, namespace, storage, op, metrics_port, subject)
            finally:
                cluster.kubectl(
                    "delete", "rckpt,rset", "--all", "-n", namespace, "--timeout=60s", check=False
                )
                print(f"--- operator log ---\n{log_text(op)[-6000:]}")
    finally:
        release_finalizers(cluster, namespace)
        delete_rbac(cluster, docs)


async def story(
    cluster: Cluster,
    namespace: str,
    storage: Path,
    op: OperatorProcess,
    metrics_port: int,
    subject: str,
) -> None:
    apply(cluster, namespace, example_set(storage))
    ready = await wait_obj(
        cluster,
        "rset",
        "math-rl",
        namespace,
        "Ready",
        lambda o: condition(o, "Ready").get("status") == "True",
        120,
    )
    model = next(p for p in ready["status"]["participants"] if p["role"] == "model")
    specs = episode_specs(8, 5)
    held = specs[0].rollout_id

    outcomes: list[EpisodeResult | EpisodeFailed] = []
    async with (
        httpx.AsyncClient(timeout=10) as http,
        rollout_set_topology("math-rl", namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        await hold_at_token(http, model["address"], held)
        rollout_client = RolloutClient(
            topology, concurrency=8, restore_timeout_s=120, run_timeout_s=180
        )
        async with anyio.create_task_group() as group:

            async def run() -> None:
                outcomes.extend(await rollout_client.run_all(specs))

            group.start_soon(run)
            await wait_held(http, model["address"], held)

            apply(cluster, namespace, checkpoint("sa-1", "math-rl"))
            ckpt = await wait_obj(
                cluster,
                "rckpt",
                "sa-1",
                namespace,
                "Ready or Failed",
                lambda o: (o.get("status") or {}).get("phase") in ("Ready", "Failed"),
                90,
            )
            assert condition(ckpt, "Ready").get("status") == "True", ckpt["status"]
            assert ckpt["status"]["episodes"] >= 1

            assert await cluster.admin.kill_pod_async(namespace, model["pod"])
            recovered = await wait_obj(
                cluster,
                "rset",
                "math-rl",
                namespace,
                "Ready under attempt 2",
                lambda o: (
                    o["status"].get("attempt") == 2
                    and condition(o, "Ready").get("status") == "True"
                ),
                120,
            )
            assert condition(recovered, "Recovering")["reason"] == "Restored"
    failures = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    assert not failures, failures
    assert len(outcomes) == 8
    (held_result,) = [o for o in outcomes if o.rollout_id == held]
    assert isinstance(held_result, EpisodeResult)
    assert (held_result.attempt, held_result.continued_from) == (2, 1)

    # /metrics has values for what just happened. The handlers record a transition right after
    # writing it, so poll until the last of them is there.
    by_set = {"namespace": namespace, "set": "math-rl"}
    ready_ckpt = {**by_set, "trigger": "Manual", "outcome": "Ready"}
    expected: list[tuple[str, dict[str, str], Any]] = [
        ("rollout_checkpoint_duration_seconds_count", ready_ckpt, 1),
        ("rollout_checkpoint_pause_seconds_count", ready_ckpt, 1),
        ("rollout_checkpoint_episodes_continued_total", by_set, ckpt["status"]["episodes"]),
        ("rollout_checkpoint_episodes_restarted_total", by_set, ckpt["status"]["restarts"]),
        ("rollout_restores_total", {**by_set, "outcome": "Restored"}, 1),
        ("rollout_set_attempt", by_set, 2),
    ]
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    found: dict[str, float] = {}
    missing: list[Any] = []
    async with httpx.AsyncClient(timeout=5) as http:

        async def all_exposed() -> bool:
            nonlocal found, missing
            found = samples((await http.get(url)).text)
            missing = [
                (name, labels, want)
                for name, labels, want in expected
                if sample(found, name, **labels) != want
            ]
            return not missing

        try:
            await wait_for(all_exposed, 20, "the metrics", interval=0.3)
        except WaitTimeout:
            raise AssertionError(f"metrics not there: {missing}") from None
    assert (sample(found, "rollout_checkpoint_duration_seconds_sum", **ready_ckpt) or 0) > 0
    assert (sample(found, "rollout_checkpoint_bytes_total", **by_set) or 0) > 0

    # Events on the transitions, posted under the ServiceAccount.
    wanted = {
        ("RolloutCheckpoint", "Published"),
        ("RolloutCheckpoint", "Completed"),
        ("RolloutSet", "AllParticipantsReady"),
        ("RolloutSet", "PodFailed"),
        ("RolloutSet", "StartingPods"),
        ("RolloutSet", "Restored"),
    }
    reasons: set[tuple[str, str]] = set()

    async def all_posted() -> bool:
        nonlocal reasons
        events = get_json(cluster, "events", "-n", namespace).get("items") or []
        reasons = {(e["involvedObject"]["kind"], e["reason"]) for e in events}
        return wanted <= reasons

    try:
        await wait_for(all_posted, 20, "the Events", interval=0.3)
    except WaitTimeout:
        raise AssertionError(f"Events missing: {sorted(wanted - reasons)}") from None

    # Exactly enough: the story needed no permission the chart does not grant.
    assert rbac_denials(op, subject) == []


# --- one verb removed at a time ------------------------------------------------------------------


@dataclass
class Outcome:
    grant: Grant
    seen: bool
    detail: str
    seconds: float = 0.0
    """From the operator's start to the denial (or the deadline)."""


def found_denial(
    cluster: Cluster, namespace: str, op: OperatorProcess, grant: Grant, *, objects: bool
) -> bool:
    """The denial in the operator's log or, with `objects`, in the status of the set or the
    checkpoint (refusals the operator reports there, e.g. of a pod or a Service)."""
    if grant.denial in log_text(op).replace("\\", ""):
        return True
    if not objects:
        return False
    found = cluster.kubectl("get", "rset,rckpt", "-n", namespace, "-o", "json", check=False)
    return grant.denial in found.stdout.replace("\\", "")


def run_case(cluster: Cluster, grant: Grant, folder: Path) -> Outcome:
    """Start the operator with `grant` taken away and drive the probe until the denial shows.

    Synchronous (it runs in a worker thread): every step is a kubectl call or a short poll.
    """
    namespace = namespace_name(f"rbac-{grant.id}")
    folder.mkdir()
    storage = folder / "checkpoints"
    storage.mkdir()
    create_namespace(cluster, namespace)
    # A release of its own: the ClusterRole and its binding are cluster-wide, cases run at once.
    release = f"rbac-{secrets.token_hex(4)}"
    docs = without(render_rbac(release, namespace, namespaced_values(namespace)), grant)
    try:
        other = next(g for g in GRANTS if g != grant)
        apply_rbac(cluster, docs, other)
        kubeconfig = token_kubeconfig(cluster, docs, folder / "sa.kubeconfig")
        log = folder / "operator.log"
        with operator_process(kubeconfig, log, [namespace], graceful=False) as op:
            if grant.step == "queue":
                apply(cluster, namespace, queued_probe_set(storage))
            elif grant.step != "start":
                apply(cluster, namespace, probe_set(storage))
                apply(cluster, namespace, checkpoint("orphan", "absent"))
            acted = False
            started = time.monotonic()
            deadline = started + CASE_TIMEOUT
            polls = 0
            # The log every 0.3 s; kubectl (a process each time) only every 1.5 s.
            while not found_denial(cluster, namespace, op, grant, objects=polls % 5 == 4):
                if time.monotonic() > deadline:
                    return Outcome(grant, False, log_text(op)[-3000:], CASE_TIMEOUT)
                if polls % 5 == 0 and grant.step == "kill" and not acted:
                    acted = kill_probe_when_running(cluster, namespace)
                if polls % 5 == 0 and grant.step == "delete" and not acted:
                    acted = delete_probe_with_a_checkpoint(cluster, namespace)
                if polls % 5 == 0 and grant.step == "queue" and not acted:
                    acted = play_kueue(cluster, namespace)
                polls += 1
                time.sleep(0.3)  # a poll interval under CASE_TIMEOUT, not a synchronisation
            return Outcome(grant, True, "", time.monotonic() - started)
    finally:
        release_finalizers(cluster, namespace)
        delete_rbac(cluster, docs)
        delete_namespace(cluster, namespace)


def kill_probe_when_running(cluster: Cluster, namespace: str) -> bool:
    """Kill the probe's pod once the set counts its attempt as created (so it is a loss)."""
    rset = get_json(cluster, "rset", "probe", "-n", namespace)
    if (rset.get("status") or {}).get("createdAttempt") != 1:
        return False
    pod = get_json(cluster, "pod", "probe-model-0-a1", "-n", namespace)
    if (pod.get("status") or {}).get("phase") != "Running":
        return False
    return bool(cluster.kill_pod(namespace, "probe-model-0-a1"))


def delete_probe_with_a_checkpoint(cluster: Cluster, namespace: str) -> bool:
    """Delete the probe set once the policy created its trainer-step checkpoint."""
    listed = get_json(cluster, "rckpt", "-n", namespace).get("items") or []
    if not [c for c in listed if c["spec"]["rolloutSet"] == "probe"]:
        return False
    cluster.kubectl("delete", "rset", "probe", "-n", namespace, "--wait=false")
    return True


# --- the queue step: the test plays Kueue (only its CRDs are installed here) ------------------

PROBE_FLAVOR = "rbac-probe-flavor"
PROBE_PRIORITY = "rbac-probe-priority"


def play_kueue_objects(cluster: Cluster) -> None:
    """The cluster-scoped Kueue objects the queued probe names. Idempotent, but applied once
    before the cases start: two concurrent applies of a new object race (both read it absent,
    one create then fails with AlreadyExists)."""
    objects = [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": PROBE_FLAVOR},
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": PROBE_PRIORITY},
            "value": 1,
        },
    ]
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )


def queued_probe_set(storage: Path) -> dict[str, Any]:
    body = probe_set(storage)
    body["metadata"]["labels"] = {
        "kueue.x-k8s.io/queue-name": "rbac-probe-queue",
        "kueue.x-k8s.io/priority-class": PROBE_PRIORITY,
    }
    return body


def _kueue_status(cluster: Cluster, namespace: str, name: str, status: dict[str, Any]) -> None:
    cluster.kubectl(
        "patch",
        "workloads.kueue.x-k8s.io",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def _kueue_condition(type_: str, status: str, reason: str) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": f"{reason} (written by the RBAC test, playing Kueue)",
        "lastTransitionTime": stamp,
    }


def play_kueue(cluster: Cluster, namespace: str) -> bool:
    """As Kueue would: admit the probe's Workload on the probe flavor, then evict it once the
    set runs (the operator then reads the flavor, suspends, and hands the quota back)."""
    listed = get_json(cluster, "workloads.kueue.x-k8s.io", "-n", namespace).get("items") or []
    if not listed:
        return False
    workload = listed[0]
    name = workload["metadata"]["name"]
    have = {c["type"]: c["status"] for c in (workload.get("status") or {}).get("conditions") or []}
    if have.get("QuotaReserved") != "True":
        admission = {
            "clusterQueue": "rbac-probe-cq",
            "podSetAssignments": [{"name": "model", "flavors": {"cpu": PROBE_FLAVOR}, "count": 1}],
        }
        conditions = [
            _kueue_condition("QuotaReserved", "True", "QuotaReserved"),
            _kueue_condition("Admitted", "True", "Admitted"),
        ]
        _kueue_status(cluster, namespace, name, {"admission": admission, "conditions": conditions})
        return False
    if (
        condition(get_json(cluster, "rset", "probe", "-n", namespace), "Ready").get("status")
        != "True"
    ):
        return False
    conditions = [
        _kueue_condition("QuotaReserved", "True", "QuotaReserved"),
        _kueue_condition("Admitted", "True", "Admitted"),
        _kueue_condition("Evicted", "True", "Preempted"),
    ]
    _kueue_status(cluster, namespace, name, {"conditions": conditions})
    return True


STEPS = ["start", "set", "checkpoint", "kill", "delete", "queue"]


@pytest.mark.parametrize("step", STEPS)
async def test_each_verb_removed_fails_with_403(
    cluster: Cluster, crds: None, step: str, tmp_path: Path
) -> None:
    """One operator per removed verb, each in its own namespace, a few at a time."""
    cases = [g for g in GRANTS if g.step == step]
    outcomes: list[Outcome] = []
    limiter = anyio.CapacityLimiter(CONCURRENT_CASES)
    if step == "queue":
        await anyio.to_thread.run_sync(play_kueue_objects, cluster)

    async def one(grant: Grant) -> None:
        outcome = await anyio.to_thread.run_sync(
            run_case, cluster, grant, tmp_path / grant.id, limiter=limiter
        )
        outcomes.append(outcome)

    try:
        async with anyio.create_task_group() as group:
            for grant in cases:
                group.start_soon(one, grant)
    finally:
        if step == "queue":
            cluster.kubectl(
                "delete",
                f"resourceflavors.kueue.x-k8s.io/{PROBE_FLAVOR}",
                f"workloadpriorityclasses.kueue.x-k8s.io/{PROBE_PRIORITY}",
                "--ignore-not-found",
            )
    for o in sorted(outcomes, key=lambda o: -o.seconds):
        print(f"{o.grant.verb} {o.grant.resource}: 403 after {o.seconds:.1f}s")
    missing = [o for o in outcomes if not o.seen]
    assert not missing, "no 403 seen without: " + "\n\n".join(
        f"{o.grant.verb} {o.grant.resource}; operator log tail:\n{o.detail}" for o in missing
    )
    assert len(outcomes) == len(cases)
