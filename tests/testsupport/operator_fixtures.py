"""Fixtures and helpers for end-to-end tests of the operator with the reference servers.

The fixtures are a pytest plugin, registered for every folder by `pytest_plugins` in
`tests/conftest.py` (a test just names them); the helpers are imported from here
(`from testsupport.operator_fixtures import ...`):

- `operator`: the CRDs applied and `rollout-operator run --namespace <ns>` running as a process
  (KUBECONFIG of the test cluster), its log in the test's tmp dir and its tail printed when the
  test fails; restartable (`operator.kill()` is a SIGKILL, `operator.start()` a fresh process).
  At teardown the test's RolloutSets and RolloutCheckpoints are deleted while the operator still
  runs (it removes its finalizers), then it is stopped; nothing it started is left running.
- `storage_dir`: a per-test checkpoint root; `example_set(storage_dir)` patches the example's
  `storage.path` and hostPath to it (devcluster mounts a hostPath at the same path).
- `resources`: the custom resources of the test namespace (kubernetes_asyncio).

Helpers for the servers' own endpoints: `stats` (`GET /stats?detail=true`), `Debug` (the
`/debug/*` pause points of a server started with `--debug-hooks`), and `pod_pids` /
`freeze` / `thaw` (SIGSTOP and SIGCONT of a pod's processes: a participant that stops
answering, to hold the operator in a phase deterministically).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from kubernetes_asyncio import client
from rollout_protocol import read_manifest
from rollout_servers.client import EpisodeFailed, EpisodeResult, EpisodeSpec, RolloutClient

from devcluster.cluster import Cluster
from devcluster.kube import open_api
from devcluster.waiting import wait_for
from harness.measures import checkpoint_records
from harness.objects import (
    SET_NAME,
    Resources,
    apply_crds,
    condition,
    create_namespace,
    example_checkpoint,
    example_set,
    is_true,
    kubectl_apply,
    participants_by_role,
    phase_is,
)
from harness.operatorprocess import OperatorProcess

__all__ = [
    "Debug",
    "OperatorProcess",
    "RecoveredRun",
    "Resources",
    "check_manifests",
    "check_recovered_run",
    "checkpoint_ready",
    "condition",
    "create_namespace_for_test",
    "episodes_running",
    "example_checkpoint",
    "example_set",
    "freeze",
    "is_true",
    "kubectl_apply",
    "merged_stats",
    "operator",
    "participants_by_role",
    "phase_is",
    "phases",
    "pod_pids",
    "records_of",
    "recovered_under",
    "resources",
    "running_operator",
    "sample",
    "samples",
    "stats",
    "storage_dir",
    "thaw",
    "wait_phase",
    "wait_pod_ready",
]


def cleanup_namespace_objects(cluster: Cluster, namespace: str) -> None:
    """Delete the namespace's checkpoints and sets (the operator must run to release them)."""
    for kind in ("rckpt", "rset"):
        cluster.kubectl(
            "delete", kind, "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False
        )


def release_finalizers(cluster: Cluster, namespace: str) -> None:
    """Last resort when the operator could not delete them: drop the finalizers."""
    for kind in ("rckpt", "rset"):
        names = cluster.kubectl("get", kind, "-n", namespace, "-o", "name", check=False).stdout
        for name in names.split():
            cluster.kubectl(
                "patch",
                name,
                "-n",
                namespace,
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )


@contextlib.contextmanager
def running_operator(
    cluster: Cluster,
    namespaces: list[str],
    log: Path,
    *,
    args: Sequence[str] = (),
    environment: Mapping[str, str] | None = None,
) -> Iterator[OperatorProcess]:
    """The operator as a process (`environment` replaces this process's for it)."""
    apply_crds(cluster)
    process = OperatorProcess(
        cluster.kubeconfig, namespaces, log, args=args, environment=environment
    )
    process.start()
    try:
        process.wait_live()
        yield process
    finally:
        try:
            if not process.running:
                process.start()
            for namespace in namespaces:
                cleanup_namespace_objects(cluster, namespace)
        finally:
            process.stop()
            for namespace in namespaces:
                release_finalizers(cluster, namespace)
            print(f"--- operator log ({log}) ---\n{process.tail(80)}")


def create_namespace_for_test(cluster: Cluster, stem: str) -> str:
    """A fresh namespace on a cluster the test owns (deleted with that cluster)."""
    name = f"e2e-{stem}-{secrets.token_hex(3)}"
    create_namespace(cluster, name)
    return name


@pytest.fixture
def operator(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    with running_operator(cluster, [namespace], tmp_path / "operator.log") as process:
        yield process


@pytest.fixture
def storage_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    return folder


@pytest.fixture
async def resources(cluster: Cluster, namespace: str) -> AsyncIterator[Resources]:
    async with open_api(cluster.kubeconfig) as api:
        yield Resources(api, namespace)


async def stats(http: httpx.AsyncClient, address: str, token: str) -> dict[str, Any]:
    """`GET /stats?detail=true` with the set's control token (`Resources.control_token`):
    the per-rollout counters list rollout ids, which a participant shows only to its operator."""
    reply = await http.get(
        address + "/stats",
        params={"detail": "true"},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert reply.status_code == 200, f"{address}/stats: {reply.status_code} {reply.text}"
    body: dict[str, Any] = reply.json()
    return body


class Debug:
    """The `/debug/*` hooks of one server (started with `--debug-hooks`)."""

    def __init__(self, http: httpx.AsyncClient, address: str) -> None:
        self.http = http
        self.address = address

    async def _post(self, path: str, body: dict[str, Any], limit_s: float = 30.0) -> Any:
        reply = await self.http.post(self.address + path, json=body, timeout=limit_s)
        assert reply.status_code == 200, f"{self.address}{path} {body}: {reply.text}"
        return reply.json()

    async def arm(
        self, point: str, rollout_id: str | None = None, index: int | None = None
    ) -> None:
        await self._post("/debug/arm", {"point": point, "rollout_id": rollout_id, "index": index})

    async def release(self, point: str, rollout_id: str | None = None) -> int:
        body = await self._post("/debug/release", {"point": point, "rollout_id": rollout_id})
        return int(body["released"])

    async def paused(
        self, point: str, rollout_id: str | None = None, *, count: int = 1, limit_s: float = 30.0
    ) -> None:
        """Return once `count` callers are held at `point` (a server-side long poll)."""
        await self._post(
            "/debug/wait",
            {
                "point": point,
                "rollout_id": rollout_id,
                "paused": True,
                "count": count,
                "timeout_s": limit_s,
            },
            limit_s=limit_s + 5,
        )


def pod_pids(cluster: Cluster, namespace: str, pod: str) -> list[int]:
    """The process-group leaders of a pod's running containers (from the node agent)."""
    with httpx.Client(verify=cluster.ssl_context(), timeout=10) as http:
        reply = http.get(cluster.state.agent_url + "/devcluster/pods")
    reply.raise_for_status()
    for entry in reply.json():
        if entry["pod"] == f"{namespace}/{pod}":
            pids = [int(pid) for pid in entry["pids"]]
            assert pids, f"pod {namespace}/{pod} runs no process"
            return pids
    raise AssertionError(f"pod {namespace}/{pod} is not on the node agent")


def freeze(pids: list[int]) -> None:
    """SIGSTOP: the participant stops answering (its sockets stay open, calls just hang)."""
    for pid in pids:
        os.killpg(pid, signal.SIGSTOP)


def thaw(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)


# --- episodes in the background ------------------------------------------------------------


@contextlib.asynccontextmanager
async def episodes_running(
    client: RolloutClient, specs: Sequence[EpisodeSpec]
) -> AsyncIterator[list[EpisodeResult | EpisodeFailed]]:
    """Run the episodes in the background while the block acts on the set; leaving the block
    waits until every one ended. Yields the list their outcomes land in."""
    outcomes: list[EpisodeResult | EpisodeFailed] = []

    async def run() -> None:
        outcomes.extend(await client.run_all(specs))

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        yield outcomes


# --- participants' control-plane phases ---------------------------------------------------


async def phases(http: httpx.AsyncClient, rset: dict[str, Any]) -> dict[str, str]:
    """Each participant's control-plane phase, from its (unauthenticated) /healthz."""
    out = {}
    for participant in rset["status"]["participants"]:
        reply = await http.get(participant["address"] + "/healthz", timeout=5)
        out[f"{participant['role']}-{participant['index']}"] = reply.json()["phase"]
    return out


async def wait_phase(
    http: httpx.AsyncClient, address: str, phase: str, what: str, limit_s: float = 30
) -> None:
    async def check() -> bool:
        reply = await http.get(address + "/healthz", timeout=2)
        return bool(reply.json()["phase"] == phase)

    await wait_for(check, limit_s, what, interval=0.05, ignore=(httpx.HTTPError,))


async def checkpoint_ready(
    cluster: Cluster,
    resources: Resources,
    name: str,
    limit_s: float = 60,
    set_name: str = SET_NAME,
) -> dict[str, Any]:
    """Create the example RolloutCheckpoint `name` of `set_name` as a user would (`kubectl
    apply`), wait until it ends, and return it; it must have ended Ready."""
    kubectl_apply(cluster, resources.namespace, example_checkpoint(name, set_name))
    ckpt = await resources.wait_checkpoint(
        name, "Ready or Failed", phase_is("Ready", "Failed"), limit_s
    )
    assert is_true(ckpt, "Ready"), ckpt["status"]
    return ckpt


async def recovered_under(
    resources: Resources, attempt: int, limit_s: float, set_name: str = SET_NAME
) -> dict[str, Any]:
    """Wait until the set is Ready under `attempt` with its `latestCheckpoint` written (the
    set's pass writes it right after a recovery), and return it."""
    return await resources.wait_set(
        f"Ready under attempt {attempt}",
        lambda o: (
            o["status"].get("attempt") == attempt
            and is_true(o, "Ready")
            and bool(o["status"].get("latestCheckpoint"))
        ),
        limit_s,
        set_name,
    )


async def wait_pod_ready(resources: Resources, pod: str, limit_s: float) -> None:
    """Return as soon as the pod reports Ready (polled every 50 ms: a test may need to act on
    it before the operator does, e.g. freeze it before a restore)."""

    async def ready() -> bool:
        found = await resources.core.read_namespaced_pod(pod, resources.namespace)
        conditions = {c.type: c.status for c in found.status.conditions or []}
        return conditions.get("Ready") == "True"

    await wait_for(
        ready,
        limit_s,
        f"pod {pod} Ready",
        interval=0.05,
        ignore=(client.ApiException, AttributeError),
    )


# --- the operator's /metrics ----------------------------------------------------------------


def samples(text: str) -> dict[str, float]:
    """`name{labels} value` lines of a Prometheus exposition, keyed by name{labels}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, number = line.rpartition(" ")
            out[key] = float(number)
    return out


def sample(found: dict[str, float], name: str, **labels: str) -> float | None:
    for key, number in found.items():
        metric, _, rest = key.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return number
    return None


# --- what a recovery must preserve ----------------------------------------------------------

ENV_STAGES = ("seed", "invoke_agent", "verify", "return")

HOLD_IN_TOOL_ARGS: dict[str, list[str]] = {
    "agent": ["--debug-hooks"],
    "resources": ["--wait-tools", "calculator"],
}
"""`example_set(extra_args=...)` for tests that hold a checkpoint in Preparing with an agent's
calculator call held at its `tool` hook: the resources server declares the calculator not
idempotent, so the call is a wait step the prepare waits for (declared idempotent, as by
default, it would replay and the prepare would not wait)."""


def check_manifests(ckpt: dict[str, Any], storage: Path) -> None:
    """Every participant's manifest is on storage and says what the checkpoint's status says."""
    listed = ckpt["status"]["participants"]
    assert sorted(p["instance"] for p in listed) == [
        "agent-0",
        "environment-0",
        "model-0",
        "resources-0",
    ]
    for entry in listed:
        manifest = read_manifest((storage / entry["manifest"]).parent)
        assert manifest.checkpoint_id == ckpt["metadata"]["name"]
        assert manifest.records_sha256 == entry["recordsSha256"]
        assert manifest.record_count == entry["recordCount"]
        assert manifest.bytes == entry["bytes"]


def completed(reply: dict[str, Any], rollout_id: str, attempt: int) -> dict[str, int]:
    """Completions per step name of one rollout under one attempt, from a server's /stats."""
    steps = ((reply.get("rollouts") or {}).get(rollout_id) or {}).get(str(attempt)) or {}
    return {name: int(events.get("completed", 0)) for name, events in steps.items()}


def done_before_checkpoint(agent_record: Any) -> set[str]:
    """Agent steps that had completed when the checkpoint recorded this session (a session
    at `tool` of turn t has its model call of turn t behind it)."""
    step = agent_record.data["step"]
    turn = int(agent_record.data["state"]["turn"])
    names = {f"model@{t}" for t in range(turn)} | {f"tool@{t}" for t in range(turn)}
    if step == "tool":
        names.add(f"model@{turn}")
    if step == "done":
        names |= {f"model@{turn}", f"tool@{turn}"}
    return names


def records_of(records: dict[str, list[Any]], role: str) -> list[Any]:
    """The records of every instance of `role` (instances are `role-index`)."""
    return [
        r for instance, found in records.items() if instance.startswith(f"{role}-") for r in found
    ]


def merged_stats(replies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The /stats of several instances of one role as one: a rollout sticks to one instance, so
    the per-rollout counts and the model's per-request tokens never overlap."""
    merged: dict[str, Any] = {"rollouts": {}, "tokens": {}}
    for reply in replies:
        merged["rollouts"].update(reply.get("rollouts") or {})
        for attempt, tokens in (reply.get("tokens") or {}).items():
            into = merged["tokens"].setdefault(attempt, {"by_request": {}})
            into["by_request"].update(tokens.get("by_request") or {})
    return merged


@dataclass
class RecoveredRun:
    """A run of episodes across one recovery, plus an uninterrupted run of the same tasks."""

    specs: Sequence[EpisodeSpec]
    outcomes: Sequence[EpisodeResult | EpisodeFailed]
    reference_specs: Sequence[EpisodeSpec]
    reference: Sequence[EpisodeResult | EpisodeFailed]
    storage: Path
    checkpoint: dict[str, Any]
    """The Ready RolloutCheckpoint the recovery restored."""
    stats: dict[str, dict[str, Any]]
    """/stats?detail=true of the new attempt's environment, agent and model, by role."""
    attempt: int = 2
    """The attempt the set runs after the recovery (the checkpoint's attempt is the lost one)."""


def check_recovered_run(run: RecoveredRun) -> dict[str, EpisodeResult]:
    """The invariants of docs/design.md#8-invariants after a recovery, checked from the client's
    results, the new attempt's server-side counters and the checkpoint's records on storage:

    - every episode finished exactly once, with the answer, reward and turns of the
      uninterrupted run of the same task;
    - no episode completed twice: one that finished under the lost attempt did not run again
      under the new one, and each one that ran again completed there once;
    - no step completed before the checkpoint ran again (environment stages and agent turns);
    - a generation cut by the checkpoint continued from its prefix: the new attempt generated
      exactly the tokens the uninterrupted generation has beyond it.
    """
    failures = [o for o in run.outcomes if isinstance(o, EpisodeFailed)]
    assert not failures, failures
    results = {o.rollout_id: o for o in run.outcomes if isinstance(o, EpisodeResult)}
    assert len(results) == len(run.specs)
    refs = [r for r in run.reference if isinstance(r, EpisodeResult)]
    assert len(refs) == len(run.reference_specs) == len(run.specs)
    ref_of = {
        spec.rollout_id: ref_spec.rollout_id
        for spec, ref_spec in zip(run.specs, run.reference_specs, strict=True)
    }
    for spec, ref in zip(run.specs, refs, strict=True):
        got = results[spec.rollout_id]
        assert (got.answer, got.reward, got.steps) == (ref.answer, ref.reward, ref.steps), (
            spec.rollout_id
        )
    lost = int(run.checkpoint["status"]["attempt"])
    assert {r.attempt for r in results.values()} <= {lost, run.attempt}

    env_stats, agent_stats = run.stats["environment"], run.stats["agent"]
    for rid, result in results.items():
        runs = completed(env_stats, rid, run.attempt).get("run", 0)
        assert runs == (1 if result.attempt == run.attempt else 0), (rid, result.attempt, runs)

    name = run.checkpoint["metadata"]["name"]
    set_name = run.checkpoint["spec"]["rolloutSet"]
    records = checkpoint_records(run.storage, set_name, name)
    env_records = {r.rollout_id: r for r in records_of(records, "environment")}
    agent_records = {r.rollout_id: r for r in records_of(records, "agent")}
    assert len(env_records) == run.checkpoint["status"]["episodes"]
    continued = [rid for rid, r in results.items() if r.continued_from == lost]
    assert continued, (
        "no episode continued from the checkpoint: "
        + ", ".join(f"{r.rollout_id}@{r.attempt}<-{r.continued_from}" for r in results.values())
        + f"; checkpoint scope {sorted(env_records)}"
    )
    assert set(continued) <= set(env_records)
    for rid in continued:
        stage = env_records[rid].data["step"]
        before = ENV_STAGES[: ENV_STAGES.index(stage)]
        env_now = completed(env_stats, rid, run.attempt)
        assert not [s for s in before if env_now.get(s)], (rid, stage, env_now)
        if rid in agent_records:
            agent_now = {n for n, c in completed(agent_stats, rid, run.attempt).items() if c}
            redone = done_before_checkpoint(agent_records[rid]) & agent_now
            assert not redone, (rid, agent_records[rid].data["step"], redone)

    tokens = run.stats["model"]["tokens"][str(run.attempt)]["by_request"]
    for record in records_of(records, "model"):
        if record.kind != "generation" or record.data["step"] != "generate":
            continue
        rid = record.rollout_id
        key = f"{rid}/{record.key}"
        if results[rid].attempt == run.attempt and key in tokens:
            prefix = int(record.data["state"]["tokens"])
            assert tokens[key] == tokens[f"{ref_of[rid]}/{record.key}"] - prefix, key
    return results
