"""Faults in every phase of a recovery (docs/operations.md#failure-modes, class 8): a participant
pod lost, the operator SIGKILLed and restarted, or `status.recovery` removed by hand, while a
recovery runs.

Each case: the example set Ready under attempt 1, a Ready checkpoint `base`, four episodes
running through the set (the trainer client, one of them held inside the agent's tool call so
that it is in flight when the model pod is killed); then the model pod of attempt 1 is killed
and the fault lands in the phase under test. Each phase is held open by a participant that
cannot answer (SIGSTOP of its processes; frozen pods stay Ready through a high failure
threshold), never by a sleep:

- StoppingAttempt: a survivor (the agent of attempt 1) is frozen before the loss, so the
  survivors' retire (the lost-work count, up to 5 s) waits on it;
- StartingPods: the environment of the new attempt is frozen while it starts (its readiness
  probe waits 3 s first), so it never turns Ready;
- Restoring: the model of the new attempt is frozen once Ready, so its restore call hangs
  (the operator is killed there, and status.recovery removed, in the last case); its
  environment is frozen while it starts, as above, until then, so that the attempt cannot be
  Ready (and restored) before the model is frozen;
- Resuming: as Restoring, then the environment of the new attempt, which answered its restore,
  is frozen and the model thawed: the operator moves to Resuming and its resume call hangs;
- BackingOff: a try fails first (the frozen replacement model is killed in Restoring), and the
  operator process is frozen while it waits out its back-off (so the phase cannot pass).

After each fault the invariants are checked: the set is Ready with no recovery left, under an
attempt whose pods are the only ones; every participant idle; `base` still Ready with its
manifests on storage and named by `lastRecovery`; every episode finished exactly once; no
traceback in the operator's log. The operator fixture then deletes everything it started.

The last case is the checkpoint's sibling: the operator killed after a checkpoint's cut, while
its resume hangs (the publish is one status write after the persist, not a phase to hold).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from rollout_operator.model import api
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    HOLD_IN_TOOL_ARGS,
    Debug,
    OperatorProcess,
    Resources,
    check_manifests,
    checkpoint_ready,
    condition,
    example_checkpoint,
    example_set,
    freeze,
    is_true,
    participants_by_role,
    phase_is,
    phases,
    pod_pids,
    thaw,
    wait_phase,
    wait_pod_ready,
)

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.adversarial]

RESTORE_TIMEOUT_S = 150
"""A try that waited out its deadline would take this long; every wait below is far shorter."""
WAIT_S = 60
BATCH = 4
ENVIRONMENT_PROBE_DELAY_S = 3
"""The environment's first readiness probe waits this long after it starts: the time a test has
to see its process and freeze it before it can turn Ready."""


def fault_set(storage: Path) -> dict[str, Any]:
    rset = example_set(
        storage,
        extra_args=HOLD_IN_TOOL_ARGS,
        spec={"recovery": {"restoreTimeoutSeconds": RESTORE_TIMEOUT_S, "maxRestarts": 4}},
    )
    for participant in rset["spec"]["participants"]:
        probe = participant["template"]["spec"]["containers"][0]["readinessProbe"]
        probe["failureThreshold"] = 600  # a frozen pod stays Ready: it is slow, not gone
        if participant["role"] == "environment":
            # Room to freeze it while it starts (`Scene.restore_held_on_the_model`): the
            # restore starts the moment every pod of the attempt is Ready, within milliseconds
            # (the operator reads its state from watches), so a delay alone, racing the
            # model's start, is not enough (6 s held; 3 s lost once in a loaded full run).
            probe["initialDelaySeconds"] = ENVIRONMENT_PROBE_DELAY_S
    return rset


def recovery_phase(obj: dict[str, Any]) -> str | None:
    phase = (obj["status"].get("recovery") or {}).get("phase")
    return str(phase) if phase is not None else None


@dataclass
class Scene:
    """One test's set, operator and clients, with the steps the cases share."""

    cluster: Cluster
    namespace: str
    operator: OperatorProcess
    resources: Resources
    storage: Path
    http: httpx.AsyncClient
    hooks: Debug
    """The pause points of the agent of attempt 1."""
    held: str
    """The episode held in the agent's tool call (a checkpoint cannot prepare until it is
    released)."""

    async def in_phase(self, phase: str) -> dict[str, Any]:
        obj: dict[str, Any] = await self.resources.wait_set(
            phase, lambda o: recovery_phase(o) == phase, WAIT_S
        )
        return obj

    async def phase_now(self) -> str | None:
        return recovery_phase(await self.resources.rollout_set())

    def pids(self, pod: str) -> list[int]:
        return pod_pids(self.cluster, self.namespace, pod)

    async def running_pids(self, pod: str) -> list[int]:
        """The pod's processes as soon as it has any (it may not be on the node yet)."""

        async def found() -> list[int] | None:
            try:
                return self.pids(pod)
            except AssertionError:
                return None

        pids: list[int] = await wait_for(found, WAIT_S, f"{pod} running", interval=0.05)
        return pids

    async def kill(self, pod: str) -> None:
        assert await self.cluster.admin.kill_pod_async(self.namespace, pod), pod

    async def restart_operator(self) -> None:
        await anyio.to_thread.run_sync(self.operator.kill)
        await anyio.to_thread.run_sync(self.operator.start)

    async def participant_address(self, pod: str) -> str:
        obj = await self.resources.rollout_set()
        for entry in obj["status"]["participants"]:
            if entry["pod"] == pod:
                return str(entry["address"])
        raise AssertionError(f"{pod} is not a participant in status: {obj['status']}")

    async def restore_held_on_the_model(self) -> list[int]:
        """Attempt 2's model frozen once Ready, before the restore can call it: returns its
        pids (thaw them).

        The environment of attempt 2 is frozen while it starts (before its first readiness
        probe), so the attempt cannot turn Ready, and the restore start, before the model is
        frozen; then the environment is thawed, turns Ready, and the restore call to the model
        hangs."""
        starting = await self.running_pids("math-rl-environment-0-a2")
        freeze(starting)
        try:
            model = "math-rl-model-0-a2"
            await wait_pod_ready(self.resources, model, WAIT_S)
            frozen_model = self.pids(model)
            freeze(frozen_model)
        finally:
            thaw(starting)
        return frozen_model

    async def hold_resuming(self) -> list[int]:
        """Hold the recovery in Resuming: returns the frozen environment's pids (thaw them).

        The model of attempt 2 is frozen once Ready (its restore hangs); the environment of
        attempt 2 answers its restore, then is frozen, and the model is thawed: every restore
        has answered, so the operator writes Resuming and calls resume, which hangs on the
        environment."""
        environment = "math-rl-environment-0-a2"
        frozen_model = await self.restore_held_on_the_model()
        try:
            await self.in_phase("Restoring")
            address = await self.participant_address(environment)
            await wait_phase(self.http, address, "restored", f"{environment} restored")
            frozen_environment = self.pids(environment)
            freeze(frozen_environment)
        finally:
            thaw(frozen_model)
        await self.in_phase("Resuming")
        return frozen_environment


@asynccontextmanager
async def scene(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage: Path,
) -> AsyncIterator[tuple[Scene, dict[str, Any]]]:
    """The set Ready, `base` Ready, and a batch of episodes running (one held in the agent's
    tool call) while the block runs; the block kills the model and lands a fault. On leaving,
    the batch is awaited and its outcomes checked."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(fault_set(storage)))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    await checkpoint_ready(cluster, resources, "base", WAIT_S)

    specs = episode_specs(BATCH, 31, prefix="fault")
    outcomes: list[EpisodeResult | EpisodeFailed] = []
    agent = participants_by_role(ready)["agent"][0]["address"]
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology("math-rl", namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        client = RolloutClient(
            topology, concurrency=BATCH, restore_timeout_s=RESTORE_TIMEOUT_S, run_timeout_s=240
        )
        hooks = Debug(http, agent)
        held = specs[0].rollout_id
        await hooks.arm("tool", held)

        async def run() -> None:
            outcomes.extend(await client.run_all(specs))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await hooks.paused("tool", held)  # in flight in attempt 1 when the model is lost
            here = Scene(cluster, namespace, operator, resources, storage, http, hooks, held)
            yield here, ready
    failed = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    assert not failed, failed
    finished = [o.rollout_id for o in outcomes if isinstance(o, EpisodeResult)]
    assert sorted(finished) == sorted(s.rollout_id for s in specs), "each finished exactly once"


async def check_recovered(scene: Scene, attempt_at_least: int) -> dict[str, Any]:
    """The invariants after the fault; returns the recovered set."""
    recovered: dict[str, Any] = await scene.resources.wait_set(
        f"Ready under attempt >= {attempt_at_least}, no recovery",
        lambda o: (
            (o["status"].get("attempt") or 1) >= attempt_at_least
            and o["status"].get("recovery") is None
            and is_true(o, "Ready")
        ),
        RESTORE_TIMEOUT_S / 2,
    )
    status = recovered["status"]
    attempt = status["attempt"]
    assert status["createdAttempt"] == attempt
    last = status["lastRecovery"]
    assert last["checkpoint"] == "base", last
    assert last["attempt"] == attempt, last
    recovering = condition(recovered, "Recovering") or {}
    assert recovering.get("reason") == "Restored", recovering
    assert not is_true(recovered, "Degraded"), condition(recovered, "Degraded")

    async def only_the_attempt_runs() -> bool:
        listed = await scene.resources.core.list_namespaced_pod(scene.namespace)
        labels = [p.metadata.labels.get(api.LABEL_ATTEMPT) for p in listed.items]
        return labels == [str(attempt)] * len(labels) and len(labels) == 4

    await wait_for(only_the_attempt_runs, WAIT_S, f"only the pods of attempt {attempt}")
    assert set((await phases(scene.http, recovered)).values()) == {"idle"}

    ckpt = await scene.resources.checkpoint("base")
    assert is_true(ckpt, "Ready"), ckpt["status"]
    check_manifests(ckpt, scene.storage)
    return recovered


def check_operator_log(operator: OperatorProcess) -> None:
    log = operator.tail(100_000)
    assert "Traceback" not in log, log[-6000:]


# --- pod loss in StoppingAttempt, Resuming and BackingOff -------------------------------------


async def lose_survivor_while_stopping(scene: Scene, ready: dict[str, Any]) -> str:
    survivor = participants_by_role(ready)["agent"][0]["pod"]
    frozen = scene.pids(survivor)
    freeze(frozen)
    try:
        await scene.kill(participants_by_role(ready)["model"][0]["pod"])
        await scene.in_phase("StoppingAttempt")
        phase = await scene.phase_now()
        await scene.kill(survivor)
    finally:
        thaw(frozen)
    return str(phase)


async def lose_new_pod_while_resuming(scene: Scene, ready: dict[str, Any]) -> str:
    await scene.kill(participants_by_role(ready)["model"][0]["pod"])
    frozen = await scene.hold_resuming()
    try:
        phase = await scene.phase_now()
        await scene.kill("math-rl-environment-0-a2")
    finally:
        thaw(frozen)
    return str(phase)


async def lose_new_pod_while_backing_off(scene: Scene, ready: dict[str, Any]) -> str:
    await scene.kill(participants_by_role(ready)["model"][0]["pod"])
    replacement = "math-rl-model-0-a2"
    frozen = await scene.restore_held_on_the_model()
    try:
        await scene.in_phase("Restoring")
        await scene.kill(replacement)  # the try fails: BackingOff
    finally:
        thaw(frozen)
    await scene.in_phase("BackingOff")
    process = scene.operator.process
    assert process is not None
    os.killpg(process.pid, signal.SIGSTOP)  # the back-off cannot pass while the pod is lost
    try:
        phase = await scene.phase_now()
        await scene.kill("math-rl-environment-0-a2")
    finally:
        os.killpg(process.pid, signal.SIGCONT)
    return str(phase)


POD_LOSSES: dict[str, tuple[Callable[[Scene, dict[str, Any]], Awaitable[str]], int]] = {
    "StoppingAttempt": (lose_survivor_while_stopping, 2),
    "Resuming": (lose_new_pod_while_resuming, 3),
    "BackingOff": (lose_new_pod_while_backing_off, 3),
}
"""Phase -> (the fault, the least attempt the set recovers under)."""


@pytest.mark.parametrize("phase", list(POD_LOSSES))
async def test_a_pod_lost_in_a_recovery_phase_is_recovered_without_loss(
    phase: str,
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    fault, attempt = POD_LOSSES[phase]
    async with scene(cluster, namespace, operator, resources, storage_dir) as (here, ready):
        landed = await fault(here, ready)
        assert landed == phase, f"the fault landed in {landed}, not {phase}"
        await check_recovered(here, attempt)
    check_operator_log(operator)


# --- operator SIGKILL in StartingPods and Resuming -------------------------------------------


async def restart_while_starting(scene: Scene, ready: dict[str, Any]) -> str:
    await scene.kill(participants_by_role(ready)["model"][0]["pod"])
    frozen = await scene.running_pids("math-rl-environment-0-a2")
    freeze(frozen)  # before its first readiness probe: frozen, it never turns Ready
    try:
        await scene.in_phase("StartingPods")
        phase = await scene.phase_now()
        await scene.restart_operator()
    finally:
        thaw(frozen)
    return str(phase)


async def restart_while_resuming(scene: Scene, ready: dict[str, Any]) -> str:
    await scene.kill(participants_by_role(ready)["model"][0]["pod"])
    frozen = await scene.hold_resuming()
    try:
        phase = await scene.phase_now()
        await scene.restart_operator()
    finally:
        thaw(frozen)
    return str(phase)


OPERATOR_LOSSES: dict[str, Callable[[Scene, dict[str, Any]], Awaitable[str]]] = {
    "StartingPods": restart_while_starting,
    "Resuming": restart_while_resuming,
}
"""Restoring: tests/e2e/test_operator_restarts.py (operator SIGKILLed in prepare, commit and
restore); the case below kills it in Restoring too, with status.recovery removed meanwhile."""


@pytest.mark.parametrize("phase", list(OPERATOR_LOSSES))
async def test_the_operator_killed_in_a_recovery_phase_continues_it(
    phase: str,
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    async with scene(cluster, namespace, operator, resources, storage_dir) as (here, ready):
        landed = await OPERATOR_LOSSES[phase](here, ready)
        assert landed == phase, f"the operator was killed in {landed}, not {phase}"
        await check_recovered(here, 2)
    assert operator.starts == 2
    check_operator_log(operator)


# --- status.recovery removed by hand in the middle of a recovery -----------------------------


async def test_a_recovery_removed_from_status_while_it_restores_is_not_adopted_unrestored(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """The operator is killed in Restoring, `status.recovery` is removed by hand, the operator
    starts again: the pods of attempt 2 never restored `base`, so they must not be adopted (the
    set Ready under attempt 2 with every restored episode lost); the recovery starts again
    (reason RecoveryRestarted) and restores `base` under attempt 3."""
    async with scene(cluster, namespace, operator, resources, storage_dir) as (here, ready):
        await here.kill(participants_by_role(ready)["model"][0]["pod"])
        frozen = await here.restore_held_on_the_model()
        try:
            await here.in_phase("Restoring")
            await anyio.to_thread.run_sync(operator.kill)
            cluster.kubectl(
                "patch",
                "rset",
                "math-rl",
                "-n",
                namespace,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps({"status": {"recovery": None}}),
            )
            await anyio.to_thread.run_sync(operator.start)
        finally:
            thaw(frozen)
        recovered = await check_recovered(here, 2)
        assert recovered["status"]["attempt"] == 3, recovered["status"]
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    restarted = [e for e in events["items"] if e["reason"] == "StatusRepaired"]
    assert any("never restored" in e["message"] for e in restarted), restarted
    check_operator_log(operator)


# --- operator SIGKILL after a checkpoint was published ----------------------------------------


async def test_the_operator_killed_while_a_published_checkpoint_resumes_finishes_it(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """The checkpoint side of the same fault timings, after the cut: the checkpoint waits in
    prepare on the episode held in the agent's tool call; the model (prepared) is frozen, the
    episode released, the environment answers its commit (the cut) and is frozen, the model
    thawed: every cut answered, the checkpoint Resuming (not Ready: its records are durable
    only after the persist, docs/design.md#61-checkpoint) and its resume hangs on the
    environment. The operator is killed there; the fresh one finishes the resume and the
    persist: the checkpoint Ready with its manifests, never Failed, every participant idle, no
    recovery."""
    async with scene(cluster, namespace, operator, resources, storage_dir) as (here, ready):
        roles = participants_by_role(ready)
        agent, model, environment = (roles[r][0] for r in ("agent", "model", "environment"))
        cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=json.dumps(example_checkpoint("published"))
        )
        await wait_phase(here.http, agent["address"], "preparing", "the agent preparing")
        await wait_phase(here.http, model["address"], "prepared", "the model prepared")
        frozen_model = here.pids(model["pod"])
        freeze(frozen_model)
        frozen_environment: list[int] = []
        try:
            assert await here.hooks.release("tool", here.held) == 1
            await wait_phase(
                here.http, environment["address"], "committed", "the environment committed"
            )
            frozen_environment = here.pids(environment["pod"])
            freeze(frozen_environment)
            thaw(frozen_model)
            resuming = await resources.wait_checkpoint(
                "published", "Resuming", phase_is("Resuming", "Ready", "Failed"), WAIT_S
            )
            assert resuming["status"]["phase"] == "Resuming", resuming["status"]
            assert not is_true(resuming, "Ready"), "Ready only once every record is durable"
            await here.restart_operator()
        finally:
            thaw(frozen_model)
            thaw(frozen_environment)
        ckpt = await resources.wait_checkpoint(
            "published", "Ready", phase_is("Ready", "Failed"), WAIT_S
        )
        assert ckpt["status"]["phase"] == "Ready", ckpt["status"]
        check_manifests(ckpt, storage_dir)

        async def all_idle() -> bool:
            return set((await phases(here.http, ready)).values()) == {"idle"}

        await wait_for(all_idle, WAIT_S, "every participant idle")
        # latestCheckpoint follows the checkpoint's Ready within a pass of the set.
        rset = await resources.wait_set(
            "latest published",
            lambda o: o["status"].get("latestCheckpoint") == "published",
            10,
        )
        assert rset["status"]["attempt"] == 1
        assert rset["status"].get("recovery") is None
        assert is_true(rset, "Ready")
        base = await resources.checkpoint("base")
        assert is_true(base, "Ready"), base["status"]
    assert operator.starts == 2
    check_operator_log(operator)
