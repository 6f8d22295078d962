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
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from operator_fixtures import release_finalizers, sample, samples
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology

from devcluster.cluster import Cluster
from devcluster.paths import find_binaries
from devcluster.testing import namespace_name, wait_for_sync
from devcluster.waiting import WaitTimeout, wait_for
from harness.apiaccounting import service_account_kubeconfig
from harness.objects import with_storage
from harness.operatorprocess import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rollout-operator"
CRDS = ROOT / "crds"
EXAMPLES = ROOT / "examples"
KUBE_VERSION = "1.37.2"
GROUP = "checkpoint.rollout.dev"
CASE_TIMEOUT = 60.0
CONCURRENT_CASES = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- the chart's RBAC, rendered and applied ------------------------------------------------------


def render_rbac(release: str, namespace: str, values: dict[str, str]) -> list[dict[str, Any]]:
    """The chart's ServiceAccount and RBAC objects, as `helm install -n <namespace>` would."""
    helm = find_binaries(("helm",))["helm"]
    argv = [str(helm), "template", release, str(CHART), "--namespace", namespace]
    argv += ["--kube-version", KUBE_VERSION]
    for key, value in values.items():
        argv += ["--set", f"{key}={value}"]
    argv += ["--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"]
    env = {**os.environ, "HELM_CACHE_HOME": "/nonexistent", "HELM_CONFIG_HOME": "/nonexistent"}
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@dataclass(frozen=True)
class Grant:
    """One verb on one resource, and which probe step first needs it."""

    group: str
    resource: str
    verb: str
    step: str
    """start: Kopf's watches; set: a RolloutSet (with a trainer step: the policy creates a
    checkpoint); checkpoint: a RolloutCheckpoint; kill: a pod lost (recovery); delete: the set
    deleted (its finalizer deletes its checkpoints)."""

    @property
    def id(self) -> str:
        return f"{self.verb}-{self.resource.replace('/', '-')}"

    @property
    def denial(self) -> str:
        """What the API server says when it refuses this verb (quotes unescaped)."""
        return f'cannot {self.verb} resource "{self.resource}" in API group "{self.group}"'


def _g(group: str, resource: str, steps: dict[str, str]) -> list[Grant]:
    return [Grant(group, resource, verb, step) for verb, step in steps.items()]


GRANTS = [
    *_g(GROUP, "rolloutsets", {"get": "kill", "list": "start", "watch": "start", "patch": "set"}),
    *_g(GROUP, "rolloutsets/status", {"patch": "set"}),
    *_g(
        GROUP,
        "rolloutcheckpoints",
        {
            "list": "start",
            "watch": "start",
            "create": "set",
            "patch": "checkpoint",
            "delete": "delete",
        },
    ),
    *_g(GROUP, "rolloutcheckpoints/status", {"patch": "checkpoint"}),
    *_g(
        "",
        "pods",
        {
            "list": "start",
            "watch": "start",
            "create": "set",
            "delete": "kill",
            "patch": "checkpoint",
        },
    ),
    *_g("", "services", {"create": "set"}),
    *_g("", "secrets", {"get": "set", "create": "set"}),
    *_g("", "events", {"create": "set"}),
    *_g("", "nodes", {"list": "start", "watch": "start"}),
    *_g(
        "coordination.k8s.io",
        "leases",
        {"get": "checkpoint", "create": "checkpoint", "patch": "checkpoint"},
    ),
    *_g("apiextensions.k8s.io", "customresourcedefinitions", {"list": "start", "watch": "start"}),
    *_g("", "namespaces", {"list": "start", "watch": "start"}),
]
"""Every verb the namespaced-mode chart grants (test_the_cases_are_the_charts_grants checks)."""


def namespaced_values(namespace: str) -> dict[str, str]:
    return {"watch.mode": "namespaced", "watch.namespaces": "{" + namespace + "}"}


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


def service_account(docs: list[dict[str, Any]]) -> tuple[str, str]:
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    return account["metadata"]["namespace"], account["metadata"]["name"]


def apply_rbac(cluster: Cluster, docs: list[dict[str, Any]], probe: Grant) -> None:
    """Apply, then wait until the authorizer's cache grants `probe` (RBAC is eventually
    consistent: an operator started earlier would see 403s that the rules do not cause)."""
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
    )
    namespace, name = service_account(docs)
    resource = probe.resource.split("/")[0] + (f".{probe.group}" if probe.group else "")
    argv = ["auth", "can-i", probe.verb, resource, f"--as=system:serviceaccount:{namespace}:{name}"]
    if "/" in probe.resource:
        argv.append(f"--subresource={probe.resource.split('/')[1]}")
    if probe.resource not in ("nodes", "namespaces", "customresourcedefinitions"):
        argv += ["-n", namespace]
    wait_for_sync(
        lambda: cluster.kubectl(*argv, check=False).stdout.strip() == "yes",
        15,
        f"RBAC to grant {probe.verb} {probe.resource} to {name}",
        interval=0.1,
    )


def delete_rbac(cluster: Cluster, docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            cluster.kubectl(
                "delete", doc["kind"], doc["metadata"]["name"], "--wait=false", check=False
            )


def token_kubeconfig(cluster: Cluster, docs: list[dict[str, Any]], path: Path) -> Path:
    """A kubeconfig that authenticates with a fresh ServiceAccount token and nothing else."""
    namespace, name = service_account(docs)
    return service_account_kubeconfig(cluster, namespace, name, path)


# --- the operator as a process under that token --------------------------------------------------


def log_text(op: OperatorProcess) -> str:
    return op.log.read_text(errors="replace") if op.log.exists() else ""


def rbac_denials(op: OperatorProcess, subject: str) -> list[str]:
    """Log lines with an RBAC denial of `subject` (other 403s, e.g. a namespace being
    terminated, are not about RBAC)."""
    marker = f'User "{subject}" cannot'
    return [line for line in log_text(op).replace("\\", "").splitlines() if marker in line]


@contextmanager
def operator_process(
    kubeconfig: Path,
    log: Path,
    namespaces: list[str],
    *,
    args: Sequence[str] = (),
    graceful: bool = True,
) -> Iterator[OperatorProcess]:
    """`rollout-operator run --standalone` with the token kubeconfig. Stopped with SIGTERM (Kopf
    stops its daemons, up to their cancellation timeouts), or SIGKILL when nothing it would
    finish matters (the probes)."""
    # Only the token kubeconfig: no admin credentials may leak in through the environment.
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
    running = OperatorProcess(
        kubeconfig, namespaces, log, args=[*args, "--standalone"], environment=environment
    )
    running.start()
    try:
        yield running
    finally:
        if graceful:
            running.stop()
        else:
            running.kill()


def create_namespace(cluster: Cluster, name: str) -> None:
    cluster.kubectl("create", "namespace", name)
    wait_for_sync(
        lambda: (
            cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
            == 0
        ),
        30,
        f"the default ServiceAccount in {name}",
        interval=0.2,
    )


def delete_namespace(cluster: Cluster, name: str) -> None:
    cluster.kubectl(
        "delete",
        "pods",
        "--all",
        "-n",
        name,
        "--force",
        "--grace-period=0",
        "--wait=false",
        check=False,
    )
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=30s",
        f"crd/rolloutsets.{GROUP}",
        f"crd/rolloutcheckpoints.{GROUP}",
    )


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def get_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        return {}
    loaded: dict[str, Any] = json.loads(result.stdout)
    return loaded


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item.get("type") == type_:
            return dict(item)
    return {}


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


async def wait_obj(
    cluster: Cluster, kind: str, name: str, namespace: str, what: str, check: Any, limit_s: float
) -> dict[str, Any]:
    last: dict[str, Any] = {}

    async def shown() -> dict[str, Any] | None:
        nonlocal last
        last = get_json(cluster, kind, name, "-n", namespace)
        return last if last and check(last) else None

    try:
        return await wait_for(shown, limit_s, f"{kind}/{name} {what}", interval=0.3)
    except WaitTimeout:
        raise AssertionError(
            f"{kind}/{name} not {what} within {limit_s}s; status: {last.get('status')}"
        ) from None


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


def probe_set(storage: Path) -> dict[str, Any]:
    """One real model server: enough for the set, its pods, Services, Secret, a recovery, and a
    policy checkpoint that completes (and then annotates the pod)."""
    container = {
        "name": "probe",
        "image": "unused.invalid/probe",
        "command": [str(Path(sys.executable).parent / "rollout-server"), "model"],
        "args": ["--host", "$(POD_IP)", "--port", "8000"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "control", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "control"}, "periodSeconds": 1},
    }
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "RolloutSet",
        # A trainer step: the checkpoint policy creates a RolloutCheckpoint for it.
        "metadata": {"name": "probe", "annotations": {f"{GROUP}/trainer-step": "1"}},
        "spec": {
            "participants": [
                {"role": "model", "replicas": 1, "template": {"spec": {"containers": [container]}}}
            ],
            "storage": {
                "path": str(storage),
                "volume": {"hostPath": {"path": str(storage), "type": "DirectoryOrCreate"}},
            },
        },
    }


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
            if grant.step != "start":
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


STEPS = ["start", "set", "checkpoint", "kill", "delete"]


@pytest.mark.parametrize("step", STEPS)
async def test_each_verb_removed_fails_with_403(
    cluster: Cluster, crds: None, step: str, tmp_path: Path
) -> None:
    """One operator per removed verb, each in its own namespace, a few at a time."""
    cases = [g for g in GRANTS if g.step == step]
    outcomes: list[Outcome] = []
    limiter = anyio.CapacityLimiter(CONCURRENT_CASES)

    async def one(grant: Grant) -> None:
        outcome = await anyio.to_thread.run_sync(
            run_case, cluster, grant, tmp_path / grant.id, limiter=limiter
        )
        outcomes.append(outcome)

    async with anyio.create_task_group() as group:
        for grant in cases:
            group.start_soon(one, grant)
    for o in sorted(outcomes, key=lambda o: -o.seconds):
        print(f"{o.grant.verb} {o.grant.resource}: 403 after {o.seconds:.1f}s")
    missing = [o for o in outcomes if not o.seen]
    assert not missing, "no 403 seen without: " + "\n\n".join(
        f"{o.grant.verb} {o.grant.resource}; operator log tail:\n{o.detail}" for o in missing
    )
    assert len(outcomes) == len(cases)
