"""`restorePolicy: InPlace` as a user runs it: a lost pod is replaced, every other pod is kept.

Each test runs the example set with InPlace recovery, takes a checkpoint while episodes run, kills
one participant pod, and checks that

- only that pod was replaced: every other pod keeps its name, UID and processes (a kept model
  pod never restarts, so it never reloads its weights);
- every episode finished exactly once, with the answer of an uninterrupted run, and no step
  completed before the checkpoint ran again (`check_recovered_run`);
- the set says what the recovery kept and replaced (`status.lastRecovery`, the printer
  columns) and the operator's `/metrics` count it;
- the work it kept and lost (model tokens kept and generated again, steps kept and redone, the
  lost pod named as uncounted) equals what the servers' own counters say: the tokens each
  request generated under each attempt and the steps each episode completed under each
  attempt (`/stats` of the kept pods), against the checkpoint's records on storage
  (`expected_work`).

A last test freezes a pod that should be kept: it cannot retire the lost attempt, and the
recovery falls back to Recreate with reason `InPlaceFallback`. Another loses a kept pod while the
InPlace restore runs (a second loss): the set ends Ready under one later attempt, every pod
replaced, with the same fallback reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_servers.client import EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    ENV_STAGES,
    Debug,
    OperatorProcess,
    RecoveredRun,
    Resources,
    check_recovered_run,
    checkpoint_ready,
    completed,
    condition,
    done_before_checkpoint,
    episodes_running,
    example_set,
    freeze,
    is_true,
    merged_stats,
    phase_is,
    pod_pids,
    records_of,
    running_operator,
    sample,
    samples,
    stats,
    thaw,
)

from devcluster.cluster import Cluster
from devcluster.waiting import WaitTimeout, wait_for
from harness.measures import checkpoint_records, generation_prefixes
from harness.operatorprocess import free_port

pytestmark = pytest.mark.e2e

EPISODES = 16
SEED = 23
HELD_AT_TOKEN = 2
SET = "math-rl"


@dataclass
class MetricsOperator:
    process: OperatorProcess
    metrics_url: str


QUICK_RETIRE_S = 4
"""A survivor that answers retires in milliseconds; one frozen never does."""
QUICK_FLOOR_S = 2
QUICK_WAITS = pytest.mark.operator_args(
    "--inplace-retire-seconds", str(QUICK_RETIRE_S), "--restore-floor-seconds", str(QUICK_FLOOR_S)
)
"""The recovery's fixed waits (docs/operations.md, "Sizing") made short, for the tests that wait
one of them out: a survivor that never retires, a restore that hangs."""


@pytest.fixture
def operator(
    cluster: Cluster, namespace: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[MetricsOperator]:
    port = free_port()
    marker = request.node.get_closest_marker("operator_args")
    extra = [str(a) for a in marker.args] if marker is not None else []
    with running_operator(
        cluster,
        [namespace],
        tmp_path / "operator.log",
        args=["--metrics-port", str(port), *extra],
    ) as process:
        yield MetricsOperator(process, f"http://127.0.0.1:{port}/metrics")


def in_place_set(
    storage: Path, replicas: dict[str, int], spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    obj = example_set(
        storage,
        extra_args={"model": ["--debug-hooks"]},
        spec={
            "recovery": {"restorePolicy": "InPlace", "restoreTimeoutSeconds": 120},
            # The kept pods' latest-checkpoint annotations are checked below (opt-in).
            "checkpointPolicy": {"podHints": True},
            **(spec or {}),
        },
    )
    for participant in obj["spec"]["participants"]:
        participant["replicas"] = replicas.get(participant["role"], 1)
        # devcluster's node advertises 8 GPUs; two model replicas fit.
    return obj


def printed_column(printed: list[str], name: str) -> str:
    """The first row's cell under `name` in `kubectl get` output, by the header's character
    positions (an empty cell, such as STANDBY or QUEUE unset, leaves no word to split on)."""
    header, row = printed[0], printed[1]
    start = header.index(name)
    rest = header[start + len(name) :]
    end = start + len(name) + (len(rest) - len(rest.lstrip())) if rest.strip() else len(row)
    return row[start:end].strip()


def pods_by_instance(obj: dict[str, Any]) -> dict[str, str]:
    return {f"{p['role']}-{p['index']}": p["pod"] for p in obj["status"]["participants"]}


def addresses(obj: dict[str, Any], role: str) -> list[str]:
    return [p["address"] for p in obj["status"]["participants"] if p["role"] == role]


def uids(cluster: Cluster, namespace: str) -> dict[str, str]:
    listed = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in listed["items"]}


async def wait_metrics(url: str, expected: dict[tuple[str, str], float]) -> dict[str, float]:
    """Poll `/metrics` until every (name, outcome) sample has its value (deadline 20 s)."""
    found: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=5) as http:

        async def there() -> bool:
            nonlocal found
            found = samples((await http.get(url)).text)
            return all(
                sample(found, name, set=SET, outcome=outcome) == value
                for (name, outcome), value in expected.items()
            )

        try:
            await wait_for(there, 20, "the recovery metrics", interval=0.3)
        except WaitTimeout:
            got = {k: sample(found, k[0], set=SET, outcome=k[1]) for k in expected}
            raise AssertionError(f"metrics {got}, expected {expected}") from None
    return found


@dataclass
class Outcome:
    before: dict[str, Any]
    after: dict[str, Any]
    checkpoint: dict[str, Any]
    run: RecoveredRun
    results: dict[str, EpisodeResult]
    uids_before: dict[str, str]
    uids_after: dict[str, str]
    lost: str
    """The instance whose pod was killed."""
    stats: dict[str, dict[str, Any]]
    """`/stats?detail=true` of each participant instance after the recovery."""
    pids_before: dict[str, list[int]]
    """The processes of every pod just before the kill, by pod name."""
    pids_after: dict[str, list[int]]
    """The processes of the pods of the same names after the recovery."""


async def checkpoint_kill_recover(
    cluster: Cluster,
    namespace: str,
    resources: Resources,
    storage: Path,
    lose: str,
    *,
    replicas: dict[str, int],
    frozen: str | None = None,
    spec: dict[str, Any] | None = None,
) -> Outcome:
    """Run episodes, checkpoint them (one held mid-generation), kill the pod of instance `lose`,
    and wait until the set runs again under attempt 2; then run the same tasks uninterrupted.

    `lose` is `role-index`, or `model-*`: the model instance that holds the episode, killed
    while it still holds it (so a cut generation is provably in flight on the lost pod). A
    kept model lets the held episode go on before the kill. `frozen`: an instance whose pod
    is stopped (SIGSTOP) at the kill: it cannot retire. `spec` merges into the set's spec; with
    `standby` in it the kill waits until every standby is Ready."""
    obj = in_place_set(storage, replicas, spec)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))

    def ready(o: dict[str, Any]) -> bool:
        standby = (o.get("status") or {}).get("standby") or {}
        return is_true(o, "Ready") and standby.get("ready") == standby.get("desired")

    before = await resources.wait_set("Ready (and its standbys)", ready, 120)
    pods = pods_by_instance(before)
    specs = episode_specs(EPISODES, SEED)
    held = specs[0].rollout_id
    stopped: list[int] = []
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        models = [Debug(http, address) for address in addresses(before, "model")]
        for model in models:
            await model.arm("token", held, index=HELD_AT_TOKEN)
        holder: list[int] = []
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=180, run_timeout_s=240
        )
        try:
            async with episodes_running(client, specs) as outcomes:

                async def held_somewhere() -> bool:
                    for index, model in enumerate(models):
                        state = (await http.get(model.address + "/debug/state")).json()
                        if any(a["waiting"] for a in state["armed"]):
                            holder.append(index)
                            return True
                    return False

                await wait_for(held_somewhere, 60, f"episode {held} held mid-generation")
                ckpt = await checkpoint_ready(cluster, resources, "in-flight")
                assert ckpt["status"]["episodes"] >= 1
                pids_before = {pod: pod_pids(cluster, namespace, pod) for pod in pods.values()}
                kept_model = lose != "model-*"
                if not kept_model:
                    lose = f"model-{holder[0]}"
                uids_before = uids(cluster, namespace)
                if frozen is not None:
                    stopped = pod_pids(cluster, namespace, pods[frozen])
                    freeze(stopped)
                assert await cluster.admin.kill_pod_async(namespace, pods[lose])
                if kept_model:
                    # The model is kept: let the held episode go on generating, only now, so
                    # that it is still unfinished when the pod is lost (released before the
                    # kill, on a loaded machine every episode could finish under attempt 1
                    # before the loss, and none would continue from the checkpoint).
                    for model in models:
                        await model.release("token", held)
                after = await resources.wait_set(
                    "Ready under attempt 2",
                    lambda o: o["status"].get("attempt") == 2 and is_true(o, "Ready"),
                    180,
                )
                pids_after = {
                    pod: pod_pids(cluster, namespace, pod)
                    for pod in pods_by_instance(after).values()
                    if pod in pids_before
                }
        finally:
            thaw(stopped)
        reference_specs = episode_specs(EPISODES, SEED, prefix="ref")
        reference = await RolloutClient(topology, concurrency=EPISODES).run_all(reference_specs)
        by_role: dict[str, list[dict[str, Any]]] = {}
        by_instance: dict[str, dict[str, Any]] = {}
        token = await resources.control_token(SET)
        for participant in after["status"]["participants"]:
            reply = await stats(http, participant["address"], token)
            by_role.setdefault(participant["role"], []).append(reply)
            by_instance[f"{participant['role']}-{participant['index']}"] = reply
    run = RecoveredRun(
        specs=specs,
        outcomes=outcomes,
        reference_specs=reference_specs,
        reference=reference,
        storage=storage,
        checkpoint=ckpt,
        stats={role: merged_stats(replies) for role, replies in by_role.items()},
    )
    return Outcome(
        before=before,
        after=after,
        checkpoint=ckpt,
        run=run,
        results=check_recovered_run(run),
        uids_before=uids_before,
        uids_after=uids(cluster, namespace),
        lost=lose,
        stats=by_instance,
        pids_before=pids_before,
        pids_after=pids_after,
    )


@dataclass
class ExpectedWork:
    model_tokens_kept: int
    model_tokens_generated_again: int
    steps_kept: int
    steps_redone: int


_NOT_STEPS = frozenset({"run", "close", "cleanup"})
"""Names the servers count beside their episode steps (a /run, a session close, cleanup)."""


def expected_work(got: Outcome, storage: Path) -> ExpectedWork:
    """The work the recovery kept and lost, from the servers' own counters and the records.

    Kept: the tokens of the model's generation records (cut prefixes, held responses) and the
    steps the environment and agent records had completed. Lost: the work attempt 1 did after
    the checkpoint on the pods that outlived the loss (a lost pod's counters are gone with it),
    for every rollout that had not finished: those the client got no attempt-1 result for,
    or, when the environment was lost, those whose agent session was not closed under attempt
    1 (an environment closes it as the last thing before it returns the result):

    - tokens: each request's tokens generated under attempt 1 beyond what the checkpoint kept
      of it, for requests the checkpoint had not seen completed (a model call the agent's
      record has behind it);
    - steps: the steps completed under attempt 1 that the checkpoint's record of the episode
      does not have behind it (all of them for an episode it does not hold).
    """
    records = checkpoint_records(storage, SET, got.checkpoint["metadata"]["name"])
    model_records = [r for r in records_of(records, "model") if r.kind == "generation"]
    kept_prefix = generation_prefixes(records)
    agent_records = {r.rollout_id: r for r in records_of(records, "agent")}
    env_records = {r.rollout_id: r for r in records_of(records, "environment")}
    kept = {i: reply for i, reply in got.stats.items() if i != got.lost}
    if not got.lost.startswith("environment-"):
        counted = {rid for rid, result in got.results.items() if result.attempt != 1}
    else:
        closed = {
            rid
            for instance, reply in kept.items()
            if instance.startswith("agent-")
            for rid in got.results
            if completed(reply, rid, 1).get("close")
        }
        counted = set(got.results) - closed

    def done_before(instance: str, rid: str) -> set[str]:
        if instance.startswith("agent-"):
            agent = agent_records.get(rid)
            return set() if agent is None else done_before_checkpoint(agent)
        env = env_records.get(rid)
        return set() if env is None else set(ENV_STAGES[: ENV_STAGES.index(env.data["step"])])

    tokens_again = steps_redone = 0
    for instance, reply in kept.items():
        if instance.startswith("model-"):
            by_request = ((reply.get("tokens") or {}).get("1") or {}).get("by_request") or {}
            for key, count in by_request.items():
                rid, _, turn = key.partition("/")
                if rid in counted and f"model@{turn}" not in done_before("agent-", rid):
                    tokens_again += max(0, int(count) - kept_prefix.get(key, 0))
        elif instance.startswith(("environment-", "agent-")):
            for rid in counted:
                after = set(completed(reply, rid, 1)) - _NOT_STEPS - done_before(instance, rid)
                steps_redone += sum(1 for name in after if completed(reply, rid, 1)[name])
    return ExpectedWork(
        model_tokens_kept=sum(int(r.data["state"]["tokens"]) for r in model_records),
        model_tokens_generated_again=tokens_again,
        steps_kept=sum(
            int(r.data["steps"]) for r in [*env_records.values(), *agent_records.values()]
        ),
        steps_redone=steps_redone,
    )


CASES = {
    "environment": ({}, "environment-0"),
    "agent": ({}, "agent-0"),
    "resources": ({}, "resources-0"),
    "one-of-two-models": ({"model": 2, "agent": 2, "environment": 2}, "model-*"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_in_place_replaces_only_the_lost_pod(
    cluster: Cluster,
    namespace: str,
    operator: MetricsOperator,
    resources: Resources,
    storage_dir: Path,
    case: str,
) -> None:
    replicas, lose = CASES[case]
    got = await checkpoint_kill_recover(
        cluster, namespace, resources, storage_dir, lose, replicas=replicas
    )
    lose = got.lost
    before, after = pods_by_instance(got.before), pods_by_instance(got.after)
    assert set(before) == set(after)
    for instance, pod in after.items():
        if instance == lose:
            assert pod == before[instance].removesuffix("-a1") + "-a2", pod
            assert pod not in got.uids_before
        else:
            assert pod == before[instance], f"{instance} was replaced: {pod}"
            assert got.uids_after[pod] == got.uids_before[pod], f"{pod} was recreated"
            assert got.pids_after[pod] == got.pids_before[pod], f"{pod}'s process restarted"

    # What the set says about the recovery.
    last = got.after["status"]["lastRecovery"]
    assert last["restorePolicy"] == "InPlace"
    assert (last["kept"], last["replaced"]) == (len(after) - 1, 1)
    assert last["checkpoint"] == "in-flight"
    # `episodesRestored` counts what the checkpoint installed; the trainer sees continue only
    # those still unfinished at the loss (the field says what it counts).
    continued = [r for r in got.results.values() if r.continued_from == 1]
    assert 1 <= len(continued) <= last["episodesRestored"] <= got.checkpoint["status"]["episodes"]
    assert last["checkpointAgeSeconds"] >= 0
    assert {"StoppingAttempt", "StartingPods", "Restoring", "Resuming"} <= set(last["phaseSeconds"])
    recovering = condition(got.after, "Recovering")
    assert recovering is not None
    assert recovering["reason"] == "Restored"
    assert "kept" in recovering["message"]
    printed = cluster.kubectl("get", "rset", SET, "-n", namespace).stdout.splitlines()
    assert printed_column(printed, "KEPT") == str(len(after) - 1)
    assert printed_column(printed, "REPLACED") == "1"

    # Every kept pod carries the time of the checkpoint that covers it.
    for instance, pod in after.items():
        if instance == lose:
            continue
        annotations = json.loads(
            cluster.kubectl("get", "pod", pod, "-n", namespace, "-o", "json").stdout
        )["metadata"]["annotations"]
        assert annotations["checkpoint.rollout.dev/latest-checkpoint"] == "in-flight"
        assert annotations["checkpoint.rollout.dev/latest-checkpoint-time"].endswith("Z")

    # The work it kept and lost, as the servers' own counters and the records say.
    work = expected_work(got, storage_dir)
    assert work.model_tokens_kept >= HELD_AT_TOKEN, "the held generation's prefix is kept"
    assert {
        "modelTokensKept": last["modelTokensKept"],
        "modelTokensGeneratedAgain": last["modelTokensGeneratedAgain"],
        "stepsKept": last["stepsKept"],
        "stepsRedone": last["stepsRedone"],
    } == {
        "modelTokensKept": work.model_tokens_kept,
        "modelTokensGeneratedAgain": work.model_tokens_generated_again,
        "stepsKept": work.steps_kept,
        "stepsRedone": work.steps_redone,
    }, f"lastRecovery {last}"
    assert last["workUncounted"] == [lose], "only the lost pod's work is unknown"

    # The operator's /metrics count it.
    found = await wait_metrics(
        operator.metrics_url,
        {
            ("rollout_recovery_pods_total", "kept"): len(after) - 1,
            ("rollout_recovery_pods_total", "replaced"): 1,
            ("rollout_recovery_episodes_total", "restored"): last["episodesRestored"],
            ("rollout_recovery_model_tokens_total", "kept"): work.model_tokens_kept,
            ("rollout_recovery_model_tokens_total", "generated_again"): (
                work.model_tokens_generated_again
            ),
            ("rollout_recovery_steps_total", "kept"): work.steps_kept,
            ("rollout_recovery_steps_total", "redone"): work.steps_redone,
        },
    )
    assert sample(found, "rollout_recovery_duration_seconds_count", set=SET, phase="Total") == 1
    assert sample(found, "rollout_recovery_checkpoint_age_seconds_count", set=SET) == 1
    assert sample(found, "rollout_recovery_work_uncounted_participants_total", set=SET) == 1


@QUICK_WAITS
async def test_a_survivor_that_cannot_retire_falls_back_to_recreate(
    cluster: Cluster,
    namespace: str,
    operator: MetricsOperator,
    resources: Resources,
    storage_dir: Path,
) -> None:
    got = await checkpoint_kill_recover(
        cluster,
        namespace,
        resources,
        storage_dir,
        "environment-0",
        replicas={},
        frozen="resources-0",
    )
    assert sorted(pods_by_instance(got.after).values()) == [
        f"{SET}-agent-0-a2",
        f"{SET}-environment-0-a2",
        f"{SET}-model-0-a2",
        f"{SET}-resources-0-a2",
    ]
    last = got.after["status"]["lastRecovery"]
    assert last["restorePolicy"] == "Recreate"
    assert (last["kept"], last["replaced"]) == (0, 4)
    # The failed InPlace try already retired the survivors it could: nobody counted the work
    # lost after the checkpoint, and the set says so rather than report zero as known.
    assert last["workUncounted"] == [
        "agent-0",
        "environment-0",
        "model-0",
        "resources-0",
    ]
    assert last["modelTokensKept"] == expected_work(got, storage_dir).model_tokens_kept
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    fallbacks = [e for e in events["items"] if e["reason"] == "InPlaceFallback"]
    assert fallbacks, "no InPlaceFallback Event"
    assert "resources-0" in fallbacks[0]["message"]
    assert fallbacks[0]["type"] == "Warning"


@pytest.mark.adversarial
async def test_a_second_loss_during_an_in_place_restore_ends_in_one_attempt(
    cluster: Cluster,
    namespace: str,
    operator: MetricsOperator,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """A kept pod lost while the InPlace restore runs.

    The environment pod is killed; the kept model holds the InPlace restore into attempt 2 at
    its `install` pause point (`--debug-hooks`), so the recovery is in Restoring with the model
    kept, whatever the timing (a replacement frozen once Ready raced a restore that now takes
    milliseconds). Then the kept model is killed too. The try ends at once
    (ReplacementPodLost), the next try falls back to Recreate (reason InPlaceFallback: the
    failed try retired attempt 2 on every kept pod, so none can be kept), and the set ends Ready
    under attempt 3 alone: no pod of attempt 1 or 2 left, every episode finished exactly once
    from the base checkpoint."""
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps(in_place_set(storage_dir, {}))
    )
    before = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 120)
    pods = pods_by_instance(before)
    specs = episode_specs(EPISODES, SEED)
    held = specs[0].rollout_id
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology(SET, namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        (model,) = [Debug(http, address) for address in addresses(before, "model")]
        await model.arm("token", held, index=HELD_AT_TOKEN)
        client = RolloutClient(
            topology, concurrency=EPISODES, restore_timeout_s=180, run_timeout_s=240
        )
        async with episodes_running(client, specs) as outcomes:
            await model.paused("token", held, limit_s=60)
            ckpt = await checkpoint_ready(cluster, resources, "base")
            assert ckpt["status"]["episodes"] >= 1
            uids_before = uids(cluster, namespace)

            await model.arm("install")
            assert await cluster.admin.kill_pod_async(namespace, pods["environment-0"])
            # Released only after the loss, as in `checkpoint_kill_recover`: released before,
            # on a loaded machine every episode could finish under attempt 1 first, and none
            # would continue from the checkpoint (seen at three xdist workers).
            await model.release("token", held)
            await model.paused("install", limit_s=90)
            restoring = await resources.wait_set(
                "Restoring into attempt 2",
                lambda o: (o["status"].get("recovery") or {}).get("phase") == "Restoring",
                60,
            )
            recovery = restoring["status"]["recovery"]
            assert recovery["restorePolicy"] == "InPlace", recovery
            assert recovery["targetAttempt"] == 2, recovery
            assert pods["model-0"] in recovery["kept"], recovery
            assert await cluster.admin.kill_pod_async(namespace, pods["model-0"])
            after = await resources.wait_set(
                "Ready with no recovery",
                lambda o: o["status"].get("recovery") is None and is_true(o, "Ready"),
                180,
            )
        reference_specs = episode_specs(EPISODES, SEED, prefix="ref")
        reference = await RolloutClient(topology, concurrency=EPISODES).run_all(reference_specs)
        by_role: dict[str, list[dict[str, Any]]] = {}
        token = await resources.control_token(SET)
        for participant in after["status"]["participants"]:
            reply = await stats(http, participant["address"], token)
            by_role.setdefault(participant["role"], []).append(reply)

    # One attempt: the set, its last recovery, its participants and its pods agree.
    status = after["status"]
    last = status["lastRecovery"]
    assert (status["attempt"], status["createdAttempt"], last["attempt"]) == (3, 3, 3), last
    assert {p["attempt"] for p in status["participants"]} == {3}, status["participants"]
    listed = json.loads(
        cluster.kubectl(
            "get", "pods", "-n", namespace, "-l", f"checkpoint.rollout.dev/set={SET}", "-o", "json"
        ).stdout
    )["items"]
    labels = {p["metadata"]["name"]: p["metadata"]["labels"] for p in listed}
    assert {name: label["checkpoint.rollout.dev/attempt"] for name, label in labels.items()} == {
        f"{SET}-{instance}-a3": "3" for instance in pods
    }
    assert not set(uids(cluster, namespace).values()) & set(uids_before.values())

    # It restored the base checkpoint, which stays Ready; Recreate, and why.
    assert last["checkpoint"] == "base", last
    assert last["restorePolicy"] == "Recreate", last
    assert (last["kept"], last["replaced"]) == (0, len(pods)), last
    base = await resources.wait_checkpoint("base", "Ready", phase_is("Ready", "Failed"), 10)
    assert is_true(base, "Ready"), base["status"]
    recovering = condition(after, "Recovering")
    assert recovering is not None
    assert (recovering["status"], recovering["reason"]) == ("False", "Restored"), recovering
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for event in events["items"]:
        by_reason.setdefault(event["reason"], []).append(event)
    lost = by_reason.get("ReplacementPodLost", [])
    assert [e["message"] for e in lost if "model-0 of attempt 2" in e["message"]], sorted(by_reason)
    fallbacks = [e for e in by_reason.get("InPlaceFallback", []) if e["type"] == "Warning"]
    assert [
        e["message"]
        for e in fallbacks
        if "the InPlace try failed: ReplacementPodLost" in e["message"]
        and "model-0 of attempt 2" in e["message"]
    ], [e["message"] for e in fallbacks]

    # Every episode finished exactly once, none under the abandoned attempt 2.
    results = check_recovered_run(
        RecoveredRun(
            specs=specs,
            outcomes=outcomes,
            reference_specs=reference_specs,
            reference=reference,
            storage=storage_dir,
            checkpoint=ckpt,
            stats={role: merged_stats(replies) for role, replies in by_role.items()},
            attempt=3,
        )
    )
    assert {r.attempt for r in results.values()} <= {1, 3}
    assert "Traceback" not in operator.process.log.read_text(), operator.process.tail(60)


FROZEN_RESTORE_TIMEOUT_S = 14
"""Above the restore step's floor (`QUICK_FLOOR_S` under `QUICK_WAITS`) plus the pods' start
(a few seconds), so the try's own deadline binds."""
TRY_MARGIN_S = 5 + 2 * 2
"""docs/api.md: a call gives up 5 s after its deadline, then the retire and the resume of the
participant that missed it wait at most 2 s each."""


@pytest.mark.adversarial
@QUICK_WAITS
async def test_a_kept_pod_frozen_during_an_in_place_restore_ends_the_try_within_its_bound(
    cluster: Cluster,
    namespace: str,
    operator: MetricsOperator,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """Every deadline of a recovery try is end to end.

    The environment pod is killed; the kept model is caught inside the InPlace restore (its
    `install` pause point) and then frozen (SIGSTOP), so the restore call hangs, and the retire
    and resume that clean up after the failed try meet the same frozen pod. The try must end
    within `restoreTimeoutSeconds` plus the margin docs/api.md states, measured on the set's own
    status (the recovery's start and the failed try's back-off time); once thawed, the next try
    (a Recreate fallback) brings the set back Ready."""
    obj = in_place_set(storage_dir, {})
    obj["spec"]["recovery"]["restoreTimeoutSeconds"] = FROZEN_RESTORE_TIMEOUT_S
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))
    before = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 120)
    pods = pods_by_instance(before)
    frozen: list[int] = []
    async with httpx.AsyncClient() as http:
        (model,) = [Debug(http, address) for address in addresses(before, "model")]
        await checkpoint_ready(cluster, resources, "base")
        await model.arm("install")
        assert await cluster.admin.kill_pod_async(namespace, pods["environment-0"])
        try:
            await model.paused("install", limit_s=90)
            frozen = pod_pids(cluster, namespace, pods["model-0"])
            freeze(frozen)
            failed = await resources.wait_set(
                "the try failed (backing off)",
                lambda o: ((o["status"].get("recovery") or {}).get("tries") or 0) >= 1,
                FROZEN_RESTORE_TIMEOUT_S + 60,
            )
        finally:
            thaw(frozen)
        recovery = failed["status"]["recovery"]
        started = _seconds(recovery["startedAt"])
        # The failed try's back-off: `next_try_at` is its end rounded down to the second plus
        # 2 s (the first try's delay), so the try ended at most `next_try_at - 2`.
        ended_at_most = _seconds(recovery["nextTryAt"]) - 2
        # `startedAt` is rounded down to the second too: one more second of slack.
        assert ended_at_most - started <= FROZEN_RESTORE_TIMEOUT_S + TRY_MARGIN_S + 1, recovery
        assert ended_at_most - started >= FROZEN_RESTORE_TIMEOUT_S - 1, (
            "the try waited for its deadline (the frozen restore), not for something else",
            recovery,
        )
        await model.release("install")
        after = await resources.wait_set(
            "Ready with no recovery",
            lambda o: o["status"].get("recovery") is None and is_true(o, "Ready"),
            180,
        )
    assert after["status"]["attempt"] >= 3, "the failed try's attempt is never adopted"


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


STANDBY_CASES = {
    # InPlace: the kept pods stay, the lost model's instance is taken by the model standby,
    # which restores the cut generation and continues it.
    "model, InPlace": ({"model": 1}, "InPlace", "model-*"),
    # Recreate: every pod goes; the agent standby takes agent-0, fresh pods the rest.
    "agent, Recreate": ({"agent": 1}, "Recreate", "agent-0"),
    "environment, InPlace": ({"environment": 1}, "InPlace", "environment-0"),
    "resources, Recreate": ({"resources": 1}, "Recreate", "resources-0"),
}


@pytest.mark.parametrize("case", list(STANDBY_CASES))
async def test_a_standby_is_adopted_for_the_lost_instance(
    cluster: Cluster,
    namespace: str,
    operator: MetricsOperator,
    resources: Resources,
    storage_dir: Path,
    case: str,
) -> None:
    """A Ready standby of the lost role takes the lost instance (its UID is the
    standby's), restores the instance's records with its identity and peers, every episode
    finishes exactly once (`check_recovered_run`), and a replacement standby starts."""
    standby, policy, lose = STANDBY_CASES[case]
    spec = {
        "standby": standby,
        "recovery": {"restorePolicy": policy, "restoreTimeoutSeconds": 120},
    }
    got = await checkpoint_kill_recover(
        cluster, namespace, resources, storage_dir, lose, replicas={}, spec=spec
    )
    [spare] = got.before["status"]["standby"]["pods"]
    after = pods_by_instance(got.after)
    assert after[got.lost] == spare, (got.lost, after)
    assert got.uids_after[spare] == got.uids_before[spare], "adopted, not recreated"
    last = got.after["status"]["lastRecovery"]
    assert last["adopted"] == [f"{got.lost}={spare}"], last
    assert last["restorePolicy"] == policy
    assert last["checkpoint"] == "in-flight"
    labels = json.loads(cluster.kubectl("get", "pod", spare, "-n", namespace, "-o", "json").stdout)[
        "metadata"
    ]["labels"]
    assert labels["checkpoint.rollout.dev/attempt"] == "2"
    assert "checkpoint.rollout.dev/standby" not in labels

    # A replacement standby, made under attempt 2, Ready; the adoption is counted.
    replaced = await resources.wait_set(
        "a replacement standby Ready",
        lambda o: (
            (o["status"].get("standby") or {}).get("ready") == 1
            and spare not in o["status"]["standby"]["pods"]
        ),
        120,
    )
    [fresh] = replaced["status"]["standby"]["pods"]
    assert fresh.endswith("-a2"), fresh
    async with httpx.AsyncClient(timeout=5) as http:

        async def counted() -> bool:
            found = samples((await http.get(operator.metrics_url)).text)
            return sample(found, "rollout_standby_pods_total", set=SET, event="adopted") == 1.0

        await wait_for(counted, 20, "the adoption counted in rollout_standby_pods_total")


def standby_ready(o: dict[str, Any]) -> bool:
    standby = (o.get("status") or {}).get("standby") or {}
    return is_true(o, "Ready") and standby.get("ready") == standby.get("desired") == 1


async def ready_with_an_environment_standby(
    cluster: Cluster,
    namespace: str,
    resources: Resources,
    storage: Path,
    grace_seconds: int | None = None,
) -> tuple[dict[str, Any], str]:
    """The InPlace set with one environment standby, Ready: the set and the standby's pod
    (`grace_seconds`: the pods' terminationGracePeriodSeconds, when not Kubernetes' 30 s)."""
    obj = in_place_set(storage, {}, {"standby": {"environment": 1}})
    if grace_seconds is not None:
        for participant in obj["spec"]["participants"]:
            participant["template"]["spec"]["terminationGracePeriodSeconds"] = grace_seconds
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))
    before = await resources.wait_set("Ready with its standby", standby_ready, 120)
    [spare] = before["status"]["standby"]["pods"]
    return before, spare


async def test_an_idle_standby_lost_is_replaced_without_a_recovery(
    cluster: Cluster,
    namespace: str,
    operator: MetricsOperator,
    resources: Resources,
    storage_dir: Path,
) -> None:
    before, spare = await ready_with_an_environment_standby(
        cluster, namespace, resources, storage_dir
    )
    assert await cluster.admin.kill_pod_async(namespace, spare)
    after = await resources.wait_set(
        "a new standby Ready",
        lambda o: standby_ready(o) and spare not in o["status"]["standby"]["pods"],
        120,
    )
    assert after["status"]["attempt"] == 1, "a standby's loss is no participant's loss"
    assert after["status"].get("recovery") is None
    assert after["status"].get("restarts", 0) == 0
    assert pods_by_instance(after) == pods_by_instance(before)
    assert spare not in uids(cluster, namespace), "the dead one went"


DELETED_POD_GRACE_S = 2
"""terminationGracePeriodSeconds of the suspend test's pods (above: why)."""


async def test_suspend_stops_the_standbys_and_deleting_the_set_deletes_them(
    cluster: Cluster,
    namespace: str,
    operator: MetricsOperator,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """Standbys go with the set's pods on suspend, come back after the resume
    (which is not a restart), and go when the set is deleted.

    The set's deletion deletes its pods through their owner references (the garbage
    collector); each then gets its template's termination grace, which a participant spends
    draining (it stays up until stopped). The test's pods have a short grace so that the last
    wait is for the deletion, not for Kubernetes' default 30 s."""
    _, spare = await ready_with_an_environment_standby(
        cluster, namespace, resources, storage_dir, grace_seconds=DELETED_POD_GRACE_S
    )

    async def none_left() -> bool | None:
        # the test's namespace holds this set's pods only
        return True if not uids(cluster, namespace) else None

    assert spare in uids(cluster, namespace)
    merge = ["--type", "merge", "-p"]
    cluster.kubectl("patch", "rset", SET, "-n", namespace, *merge, '{"spec":{"suspend":true}}')
    await wait_for(none_left, 120, "every pod, the standby too, gone", interval=0.5)

    cluster.kubectl("patch", "rset", SET, "-n", namespace, *merge, '{"spec":{"suspend":false}}')
    resumed = await resources.wait_set(
        "resumed, with a new standby Ready",
        lambda o: standby_ready(o) and spare not in o["status"]["standby"]["pods"],
        180,
    )
    assert resumed["status"].get("restarts", 0) == 0, "a resume is not a restart"

    cluster.kubectl("delete", "rset", SET, "-n", namespace, "--timeout=120s")
    await wait_for(none_left, 60, "the set's pods and standby gone", interval=0.5)


@pytest.mark.adversarial
async def test_a_standby_lost_during_its_adoption_ends_in_one_attempt(
    cluster: Cluster,
    namespace: str,
    operator: MetricsOperator,
    resources: Resources,
    storage_dir: Path,
) -> None:
    """The model pod is killed, the model standby is adopted and held inside its
    restore (`install` pause point), then killed too. The try fails, the next one runs under
    attempt 3 with fresh pods (no standby is left: replacements start once the set runs), and
    the set ends Ready under attempt 3 alone."""
    obj = in_place_set(storage_dir, {}, {"standby": {"model": 1}})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))
    before = await resources.wait_set("Ready with its standby", standby_ready, 120)
    pods = pods_by_instance(before)
    [spare] = before["status"]["standby"]["pods"]
    pod = json.loads(cluster.kubectl("get", "pod", spare, "-n", namespace, "-o", "json").stdout)
    async with httpx.AsyncClient() as http:
        standby = Debug(http, f"http://{pod['status']['podIP']}:8000")
        await checkpoint_ready(cluster, resources, "base")
        await standby.arm("install")
        assert await cluster.admin.kill_pod_async(namespace, pods["model-0"])
        await standby.paused("install", limit_s=90)
        adopting = await resources.wait_set(
            "the standby adopted",
            lambda o: bool((o["status"].get("recovery") or {}).get("adopted")),
            30,
        )
        assert adopting["status"]["recovery"]["adopted"] == [f"model-0={spare}"]
        assert await cluster.admin.kill_pod_async(namespace, spare)
        after = await resources.wait_set(
            "Ready with no recovery",
            lambda o: o["status"].get("recovery") is None and is_true(o, "Ready"),
            180,
        )
    assert after["status"]["attempt"] == 3, after["status"]
    assert {p["attempt"] for p in after["status"]["participants"]} == {3}
    assert spare not in pods_by_instance(after).values()
    assert after["status"]["lastRecovery"]["adopted"] == []
    listed = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)
    left = {
        p["metadata"]["name"]
        for p in listed["items"]
        if (p["metadata"].get("labels") or {}).get("checkpoint.rollout.dev/attempt") in ("1", "2")
        and not p["metadata"].get("deletionTimestamp")
    }
    assert left == set(), f"pods of attempt 1 or 2 left: {left}"
