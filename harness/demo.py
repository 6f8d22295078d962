"""`make demo`: the whole product on a local devcluster, with a pod killed mid-generation.

    python -m harness.demo [--keep] [--dir DIR] [--episodes N] [--seed S]

Steps (each printed as it happens): a devcluster comes up (etcd, kube-apiserver, scheduler,
controller-manager and a node agent with a GPU node and a CPU node), the CRDs are applied, the
operator runs as a process (`rollout-operator run`), `examples/rolloutset.yaml` is applied and
becomes Ready, a trainer client runs episodes against it (the same client and RolloutSet
discovery `rollout-collect --rollout-set` uses), `examples/rolloutcheckpoint.yaml` is taken while
they run, the model pod is SIGKILLed while it generates, the operator recovers the set under
attempt 2 from the checkpoint, and the client finishes every episode. The summary says how many
episodes continued from the checkpoint and how many restarted, how much work was redone, and
when each recovery step happened. Everything is stopped at the end (also on failure and Ctrl-C);
`--keep` leaves the cluster and the operator running (with `--node-runtime containerd` the Helm
release stays installed) and prints the `export KUBECONFIG=` line.

`run_scenario` is shared with `bench/recovery.py` and `bench/container_recovery.py`; its building
blocks live in their own modules, shared with the end-to-end tests and the other benches:
`harness.operatorprocess` (the operator as a process), `harness.objects` (the manifests and
the custom resources) and `harness.measures` (the recovery timeline and the work redone), so
what the demo shows is what they check.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
from rollout_protocol import BucketConfig, BucketStore
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology

from devcluster.cluster import Cluster
from devcluster.image import ProjectImage, build_project_image
from devcluster.kube import open_api
from devcluster.s3 import DEFAULT_BUCKET, credentials_secret
from devcluster.state import S3State
from devcluster.waiting import wait_for
from harness import helm
from harness.measures import (
    RECOVERY_STEPS,
    Redone,
    StatsTracker,
    Timeline,
    bucket_checkpoint_records,
    checkpoint_records,
    generation_prefixes,
    measure_redone,
    observe_recovery,
    started_under,
)
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
from harness.operatorprocess import OperatorProcess, sigterm_as_interrupt

Say = Callable[[str], None]

BUCKET_PREFIX = "demo"
"""With `--s3`: the key prefix of the set's records in the cluster's bucket."""
BUCKET_SECRET = "demo-bucket-credentials"
"""With `--s3`: the Secret holding the S3 server's credentials, named by `spec.storage.s3`."""


def bucket_config(bucket: S3State, prefix: str) -> BucketConfig:
    """How this process reads the set's records in the cluster's bucket (the participants get
    the same from `spec.storage.s3`)."""
    return BucketConfig(
        endpoint=bucket.endpoint,
        bucket=bucket.bucket,
        credentials_dir=bucket.credentials_dir,
        prefix=prefix,
        region=bucket.region,
    )


def _quiet(_message: str) -> None:
    return None


# --- one scenario: episodes, a checkpoint, a pod killed mid-generation, the recovery -----------


@dataclass
class Scenario:
    namespace: str
    workdir: Path
    episodes: int = 48
    seed: int = 7
    concurrency: int = 16
    """Episodes in flight at once (a trainer's rollout batch); the rest queue, so there is
    unfinished work whenever the pod is killed."""
    target_level: str = "turn"
    """`turn`: restore the checkpoint (continue from boundaries); `sibling`: fresh pods only,
    every unfinished episode runs again from its first step (a plain pod restart)."""
    token_latency_ms: float = 20.0
    restore_policy: str = "Recreate"
    """`Recreate`: every pod is replaced after the loss; `InPlace`: only the lost one."""
    load_seconds: float = 0.0
    """The model's simulated weight-loading time (`rollout-server model --load-seconds`)."""
    kill_role: str = "model"
    checkpoint_at_done: float = 0.15
    """Take the checkpoint once this share of the episodes finished."""
    timeout_s: float = 240.0
    kill_at: str = "resumed"
    """When the pod dies: `resumed` (the checkpoint finished and the episodes run again; the
    demo) or `published` (as soon as the checkpoint is Ready=True, i.e. restorable, which is
    before its participants resume: a loss right after the last checkpoint; the benchmark)."""
    kill_delay_s: float = 0.0
    """How long after the checkpoint is Ready the pod is killed: the work of that time is lost
    even with turn-level recovery (it was never checkpointed)."""
    delete_after: bool = False
    """Delete the RolloutSet and its checkpoints while the operator still runs (it holds
    finalizers on them), so the caller can delete the namespace afterwards."""
    operator_image: ProjectImage | None = None
    """On a container node: the operator runs as the chart installs it, a pod of this image
    (`helm install`, `harness.helm`), and the servers as containers of it. None: the operator
    runs as a process (`OperatorProcess`) on the process node."""
    keep_release: bool = False
    """With `operator_image`: leave the Helm release installed at the end (`--keep`), so the
    operator pod goes on running the kept set; otherwise it is uninstalled."""
    bucket: S3State | None = None
    """The set keeps its records in this bucket of the cluster's S3 server (`--s3`), through
    `spec.storage.s3` and a Secret of the server's credentials, instead of on the volume."""
    standby: dict[str, int] | None = None
    """`spec.standby` of the set (e.g. {"model": 1}); the episodes start once every standby is
    Ready too, so the kill's recovery can adopt one."""


@dataclass
class ScenarioReport:
    scenario: Scenario
    results: list[EpisodeResult]
    failed: list[EpisodeFailed]
    checkpoint: dict[str, Any]
    killed_pod: str
    in_flight_at_kill: int
    timeline: Timeline
    redone: Redone
    wall_seconds: float
    final_set: dict[str, Any]

    @property
    def continued(self) -> list[EpisodeResult]:
        return [r for r in self.results if r.continued]

    started_before_loss: set[str] = field(default_factory=set)

    @property
    def restarted(self) -> list[EpisodeResult]:
        """Started before the loss, not in the checkpoint: run again from the first step."""
        return [
            r
            for r in self.results
            if r.attempt > 1 and not r.continued and r.rollout_id in self.started_before_loss
        ]

    @property
    def started_after_loss(self) -> list[EpisodeResult]:
        """Still queued in the client when the pod died: nothing of theirs was lost."""
        return [
            r
            for r in self.results
            if r.attempt > 1 and r.rollout_id not in self.started_before_loss
        ]

    @property
    def finished_before_loss(self) -> list[EpisodeResult]:
        return [r for r in self.results if r.attempt == 1]


async def _live_generations(http: httpx.AsyncClient, address: str) -> int:
    reply = await http.get(address + "/stats", timeout=2.0)
    return int(reply.json().get("live", 0)) if reply.status_code == 200 else 0


async def run_scenario(cluster: Cluster, scenario: Scenario, say: Say = _quiet) -> ScenarioReport:
    """Run the scenario in its namespace (created here) with its own operator process; the
    operator is stopped at the end, the namespace left for the caller to delete."""
    workdir = scenario.workdir
    storage_dir = workdir / "checkpoints"
    storage_dir.mkdir(parents=True, exist_ok=True)
    namespace = scenario.namespace
    create_namespace(cluster, namespace)
    if scenario.operator_image is not None:
        return await _run_with_helm_operator(cluster, scenario, scenario.operator_image, say)
    operator = OperatorProcess(cluster.kubeconfig, [namespace], workdir / "operator.log")
    operator.start()
    try:
        operator.wait_live()
        pid = operator.process.pid if operator.process else "?"
        say(f"operator running (pid {pid}, log {operator.log})")
        _apply_example_set(cluster, scenario, storage_dir, say)
        return await _drive(cluster, scenario, storage_dir, say)
    except Exception:
        say(f"operator log tail:\n{operator.tail(30)}")
        raise
    finally:
        _delete_after(cluster, scenario)
        operator.stop()


async def _run_with_helm_operator(
    cluster: Cluster, scenario: Scenario, image: ProjectImage, say: Say
) -> ScenarioReport:
    """`run_scenario` on a container node: the operator installed by Helm as a pod of `image`
    (uninstalled at the end unless `scenario.keep_release`), the servers as containers of it.
    They run as the image's user 10001, so the hostPath storage is world-writable (sticky) and
    its parents up to the scenario's folder are traversable."""
    namespace = scenario.namespace
    storage_dir = scenario.workdir / "checkpoints"
    storage_dir.chmod(0o1777)
    for folder in (scenario.workdir, scenario.workdir.parent):
        folder.chmod(folder.stat().st_mode | 0o755)
    started = time.monotonic()
    await anyio.to_thread.run_sync(helm.install_operator, cluster, namespace, image)
    say(
        f"operator installed by Helm in {time.monotonic() - started:.1f}s: "
        f"deployment/{helm.FULLNAME} in {namespace}, image {image.short_name} "
        f"({image.digest[:19]}...), pullPolicy Never"
    )
    try:
        _apply_example_set(cluster, scenario, storage_dir, say)
        return await _drive(cluster, scenario, storage_dir, say)
    except Exception:
        logs = cluster.kubectl(
            "logs", f"deployment/{helm.FULLNAME}", "-n", namespace, "--tail=30", check=False
        )
        say(f"operator log tail:\n{logs.stdout}")
        raise
    finally:
        _delete_after(cluster, scenario)
        if not scenario.keep_release:
            await anyio.to_thread.run_sync(helm.uninstall_operator, cluster, namespace)


def _apply_example_set(cluster: Cluster, scenario: Scenario, storage_dir: Path, say: Say) -> None:
    model_args = ["--token-latency-ms", f"{scenario.token_latency_ms:g}"]
    if scenario.load_seconds:
        model_args += ["--load-seconds", f"{scenario.load_seconds:g}"]
    recovery = {
        "targetLevel": scenario.target_level,
        "restorePolicy": scenario.restore_policy,
        "restoreTimeoutSeconds": int(120 + scenario.load_seconds),
    }
    spec: dict[str, Any] = {"recovery": recovery}
    if scenario.standby:
        spec["standby"] = dict(scenario.standby)
    manifest = example_set(storage_dir, extra_args={"model": model_args}, spec=spec)
    if scenario.bucket is not None:
        bucket = scenario.bucket
        kubectl_apply(
            cluster,
            scenario.namespace,
            credentials_secret(bucket, scenario.namespace, BUCKET_SECRET),
        )
        manifest["spec"]["storage"] = {
            "s3": {
                "endpoint": bucket.endpoint,
                "bucket": bucket.bucket,
                "prefix": BUCKET_PREFIX,
                "region": bucket.region,
                "secretName": BUCKET_SECRET,
            }
        }
        say(f"records in s3://{bucket.bucket}/{BUCKET_PREFIX} (Secret {BUCKET_SECRET})")
    kubectl_apply(cluster, scenario.namespace, manifest)
    say(
        f"applied examples/rolloutset.yaml (recovery.targetLevel {scenario.target_level}, "
        f"restorePolicy {scenario.restore_policy}"
        + (f", model load {scenario.load_seconds:g}s" if scenario.load_seconds else "")
        + ")"
    )


def _ready_with_standbys(obj: dict[str, Any]) -> bool:
    standby = (obj.get("status") or {}).get("standby") or {}
    return is_true(obj, "Ready") and standby.get("ready") == standby.get("desired")


def _delete_after(cluster: Cluster, scenario: Scenario) -> None:
    if scenario.delete_after:
        for kind in ("rckpt", "rset"):
            cluster.kubectl(
                "delete", kind, "--all", "-n", scenario.namespace, "--timeout=60s", check=False
            )


async def _drive(
    cluster: Cluster, scenario: Scenario, storage_dir: Path, say: Say
) -> ScenarioReport:
    namespace = scenario.namespace
    async with open_api(cluster.kubeconfig) as api, httpx.AsyncClient() as http:
        resources = Resources(api, namespace)
        started = time.monotonic()
        ready = await resources.wait_set(
            "Ready (and its standbys)", _ready_with_standbys, 90 + scenario.load_seconds
        )
        say(
            f"RolloutSet {SET_NAME} Ready in {time.monotonic() - started:.1f}s: "
            + ", ".join(p["pod"] for p in ready["status"]["participants"])
        )
        specs = episode_specs(scenario.episodes, scenario.seed)
        outcomes: list[EpisodeResult | EpisodeFailed] = []
        timeline = Timeline()
        stop = anyio.Event()
        tracker = StatsTracker(http, await resources.control_token())
        tracker.learn(ready)
        async with rollout_set_topology(
            SET_NAME, namespace, kubeconfig=cluster.kubeconfig
        ) as topology:
            rollout_client = RolloutClient(
                topology,
                concurrency=scenario.concurrency,
                restore_timeout_s=scenario.timeout_s,
                run_timeout_s=scenario.timeout_s,
            )
            client_started = time.monotonic()
            client_done = anyio.Event()
            async with anyio.create_task_group() as group:

                async def run_client() -> None:
                    outcomes.extend(await rollout_client.run_all(specs))
                    client_done.set()

                group.start_soon(run_client)
                group.start_soon(tracker.run, resources, stop)
                say(
                    f"client: {scenario.episodes} episodes (seed {scenario.seed}, "
                    f"{scenario.concurrency} at a time) against rolloutset/{SET_NAME}, "
                    "followed through the Kubernetes API"
                )
                with anyio.fail_after(scenario.timeout_s):
                    want = max(1, int(scenario.episodes * scenario.checkpoint_at_done))

                    async def progressed() -> bool:
                        return rollout_client.progress.done >= want

                    await wait_for(
                        progressed, scenario.timeout_s, f"{want} episodes to finish", interval=0.05
                    )
                    model = participants_by_role(ready)[scenario.kill_role][0]
                    checkpoint = await _take_checkpoint(
                        cluster, resources, say, rollout_client, scenario.kill_at
                    )
                    timeline.mark("checkpoint_ready", time.monotonic())
                    if scenario.kill_delay_s > 0:
                        await anyio.sleep(scenario.kill_delay_s)

                    async def generating() -> int:
                        # The same read is the model's last counters before it dies.
                        reply = await tracker.poll_pod(model["pod"])
                        return int(reply.get("live", 0)) if reply else 0

                    in_flight = await wait_for(
                        generating, 30, f"the {scenario.kill_role} to be generating", interval=0.02
                    )
                    timeline.mark("killed", time.monotonic())
                    if cluster.node_runtime == "process":
                        pids = await cluster.admin.kill_pod_async(namespace, model["pod"])
                        killed = f"pid {', '.join(map(str, pids))}"
                    else:
                        # Inside the container: containerd's shim delivers it to the server.
                        await anyio.to_thread.run_sync(cluster.kill_pod, namespace, model["pod"])
                        killed = "its container's process, through containerd"
                    say(
                        f"SIGKILL {model['pod']} ({killed}) with "
                        f"{in_flight} generation(s) in flight; "
                        f"{rollout_client.progress.done}/{scenario.episodes} episodes done"
                    )
                    group.start_soon(observe_recovery, resources, timeline, 1, stop)
                    await _report_progress(timeline, rollout_client, client_done, say)
                wall = time.monotonic() - client_started
                await tracker.poll_once()
                if "resumed" not in timeline.events:
                    # Every episode finished without the lost pod: the recovery still runs.
                    say("all episodes finished; waiting for the recovery to end")
                    await resources.wait_set(
                        "Ready under a new attempt", _recovered, scenario.timeout_s
                    )
                    now = time.monotonic()
                    for key, label in RECOVERY_STEPS[1:]:
                        if key not in timeline.events:
                            timeline.mark(key, now)
                            say(f"recovery: {label}, {timeline.since(key):.2f}s after the kill")
                stop.set()
        final_set = await resources.rollout_set()
    results = [o for o in outcomes if isinstance(o, EpisodeResult)]
    failed = [o for o in outcomes if isinstance(o, EpisodeFailed)]
    # What the measurements are computed from, for anyone who wants to look closer.
    with (scenario.workdir / "results.jsonl").open("w", encoding="utf-8") as out:
        for result in results:
            out.write(result.model_dump_json() + "\n")
    (scenario.workdir / "stats.json").write_text(json.dumps(tracker.last, indent=1))
    records: dict[str, list[Any]] = {}
    if scenario.target_level == "turn" and scenario.bucket is not None:
        set_dir = f"{namespace}/{SET_NAME}/{final_set['metadata']['uid']}"
        store = BucketStore(bucket_config(scenario.bucket, BUCKET_PREFIX))
        records = await anyio.to_thread.run_sync(
            lambda: bucket_checkpoint_records(store, set_dir, checkpoint)
        )
    elif scenario.target_level == "turn":
        records = checkpoint_records(storage_dir, SET_NAME, checkpoint["metadata"]["name"])
    redone = measure_redone(tracker, results, 1, generation_prefixes(records))
    return ScenarioReport(
        scenario=scenario,
        results=results,
        failed=failed,
        checkpoint=checkpoint,
        killed_pod=model["pod"],
        in_flight_at_kill=in_flight,
        timeline=timeline,
        redone=redone,
        wall_seconds=wall,
        final_set=final_set,
        started_before_loss=started_under(tracker, 1),
    )


async def _report_progress(
    timeline: Timeline, rollout_client: RolloutClient, done: anyio.Event, say: Say
) -> None:
    """Until the client finished: each recovery step once, as the observer sees it, and the
    episode count at most once a second (when it changed)."""
    shown: set[str] = set()
    last = ""
    next_line = 0.0
    while not done.is_set():
        for key, label in RECOVERY_STEPS[1:]:
            at = timeline.since(key)
            if at is not None and key not in shown:
                shown.add(key)
                say(f"recovery: {label}, {at:.2f}s after the kill")
        if time.monotonic() >= next_line:
            progress = rollout_client.progress
            line = (
                f"episodes: {progress.done}/{progress.total} done, "
                f"{progress.reissued} re-issued to a new attempt"
            )
            if line != last:
                say(line)
                last = line
            next_line = time.monotonic() + 1.0
        with anyio.move_on_after(0.1):
            await done.wait()


def _recovered(obj: dict[str, Any]) -> bool:
    status = obj.get("status") or {}
    return (status.get("attempt") or 1) > 1 and not status.get("recovery") and is_true(obj, "Ready")


def _published(obj: dict[str, Any]) -> bool:
    return is_true(obj, "Ready") or phase_is("Failed")(obj)


async def _take_checkpoint(
    cluster: Cluster,
    resources: Resources,
    say: Say,
    rollout_client: RolloutClient,
    kill_at: str,
) -> dict[str, Any]:
    name = "math-rl-manual-1"
    kubectl_apply(cluster, resources.namespace, example_checkpoint(name))
    say(f"applied examples/rolloutcheckpoint.yaml ({rollout_client.progress.done} episodes done)")
    if kill_at == "published":
        done = await resources.wait_checkpoint(name, "published", _published, 90, interval=0.02)
        if is_true(done, "Ready"):
            episodes = done["status"].get("episodes")
            say(f"checkpoint {name} published (Ready=True): {episodes} episodes committed")
            return done
    done = await resources.wait_checkpoint(
        name, "Ready or Failed", phase_is("Ready", "Failed"), 90, interval=0.02
    )
    status = done["status"]
    if status.get("phase") != "Ready":
        failed = condition(done, "Failed") or {}
        raise RuntimeError(
            f"checkpoint {name} failed: {failed.get('reason')}: {failed.get('message')}"
        )
    durations = status.get("durations") or {}
    say(
        f"checkpoint {name} Ready: {status.get('episodes')} episodes committed, "
        f"{status.get('restarts')} restart, {len(status.get('participants') or [])} manifests, "
        f"pause {durations.get('pauseSeconds')}s"
    )
    return done


# --- the summary --------------------------------------------------------------------------------


def summary(report: ScenarioReport) -> list[str]:
    results = report.results
    lines = [
        "",
        "== summary ==",
        f"episodes: {len(results)} finished, {len(report.failed)} failed "
        f"(of {report.scenario.episodes})",
        f"  finished before the loss (attempt 1):     {len(report.finished_before_loss)}",
        f"  continued from the checkpoint (attempt 2): {len(report.continued)}",
        f"  restarted from scratch (attempt 2):        {len(report.restarted)}",
        f"  not started before the loss (attempt 2):   {len(report.started_after_loss)}",
        f"checkpoint {report.checkpoint['metadata']['name']}: "
        f"{report.checkpoint['status'].get('episodes')} episodes in its scope",
        f"work redone by the {report.redone.rerun} episodes unfinished at the loss: "
        f"{report.redone.steps} steps, {report.redone.tokens} model tokens "
        f"({report.redone.tokens * report.scenario.token_latency_ms / 1000:.1f} model-busy "
        "seconds)",
        f"killed {report.killed_pod} with {report.in_flight_at_kill} generation(s) in flight, "
        f"{report.timeline.since('killed', 'checkpoint_ready') or 0:.2f}s after the checkpoint "
        "was Ready",
        "recovery timeline (seconds after the kill):",
    ]
    for key, label in RECOVERY_STEPS:
        at = report.timeline.since(key)
        lines.append(f"  {label:<30} {'-' if at is None else f'{at:6.2f}'}")
    status = report.final_set.get("status") or {}
    lines.append(
        f"RolloutSet: attempt {status.get('attempt')}, restarts {status.get('restarts')}, "
        f"latest checkpoint {status.get('latestCheckpoint')}"
    )
    lines.append(f"all episodes finished {report.wall_seconds:.1f}s after the client started")
    return lines


# --- the command ------------------------------------------------------------------------------


def _say(message: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    for i, line in enumerate(message.splitlines() or [""]):
        print(f"[demo {stamp}] {line}" if i == 0 else f"               {line}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave the cluster and operator running"
    )
    parser.add_argument(
        "--dir", type=Path, help="devcluster directory (default: a new temporary one)"
    )
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--node-runtime",
        choices=["process", "containerd"],
        default="process",
        help="containerd: a real kubelet runs the servers as containers of the project's image "
        "and the operator is installed by Helm (`make demo-containers`)",
    )
    parser.add_argument(
        "--s3",
        action="store_true",
        help="the devcluster also runs an S3 server on loopback with a bucket "
        "(`make s3-server`; devcluster/s3.py), stopped and its data removed with the cluster",
    )
    args = parser.parse_args(argv)

    root = args.dir or Path(tempfile.mkdtemp(prefix="rollout-demo-"))
    cluster: Cluster | None = None
    scenario = Scenario(
        namespace="demo", workdir=root / "demo", episodes=args.episodes, seed=args.seed
    )
    containers = args.node_runtime == "containerd"
    s3_bucket = DEFAULT_BUCKET if args.s3 else None
    keep = False
    code = 1
    with sigterm_as_interrupt():
        try:
            started = time.monotonic()
            if containers:
                _say("building the image from the Dockerfile (image/build.sh; cached by inputs)")
                build = build_project_image()
                image = build.image
                _say(
                    f"image {image.name} {image.digest[:19]}... "
                    + ("(cached)" if build.was_cached else f"built in {image.build_seconds}s")
                )
                scenario.operator_image = image
                scenario.keep_release = args.keep
                started = time.monotonic()
                _say(
                    f"starting devcluster in {root / 'cluster'} with a container node (etcd, "
                    "kube-apiserver, scheduler, controller-manager; kubelet, containerd, runc, "
                    "kube-proxy, CNI bridge: gpu-0 with 8 GPUs), the image imported"
                )
                cluster = Cluster.start(
                    root / "cluster",
                    progress=None,
                    node_runtime="containerd",
                    images=[image.archive],
                    timeout=180.0,
                    s3_bucket=s3_bucket,
                )
            else:
                _say(
                    f"starting devcluster in {root / 'cluster'} (etcd, kube-apiserver, scheduler, "
                    "controller-manager, node agent: gpu-0 with 8 GPUs, cpu-0)"
                )
                cluster = Cluster.start(root / "cluster", progress=None, s3_bucket=s3_bucket)
                scenario.bucket = cluster.s3
            _say(f"devcluster up in {time.monotonic() - started:.1f}s; applying crds/")
            if cluster.s3 is not None:
                _say(
                    f"S3 server at {cluster.s3.endpoint}, bucket {cluster.s3.bucket}, "
                    f"credentials in {cluster.s3.credentials_dir}"
                )
            apply_crds(cluster)
            report = anyio.run(run_scenario, cluster, scenario, _say)
            for line in summary(report):
                print(line, flush=True)
            code = 0 if not report.failed else 1
            keep = args.keep
        except KeyboardInterrupt:
            _say("interrupted; cleaning up")
            code = 130
        except Exception as error:
            _say(f"FAILED: {type(error).__name__}: {error}")
            code = 1
        finally:
            if cluster is not None and keep:
                if containers:
                    print(
                        f"operator left installed by Helm: release {helm.RELEASE}, "
                        f"deployment/{helm.FULLNAME} in namespace {scenario.namespace}"
                    )
                else:
                    _restart_operator_for_keep(cluster, scenario)
                print(f"\nleft running; stop with: python -m devcluster down --dir {cluster.dir}")
                print(f"export KUBECONFIG={cluster.kubeconfig}")
                print(f"kubectl get rset,rckpt,pods -n {scenario.namespace}")
            elif cluster is not None:
                _say("stopping the cluster (every pod, the operator, the control plane)")
                cluster.stop()
                left = [f"process {pid}" for pid in cluster.processes()]
                left += cluster.node_leftovers()
                if left:
                    _say(f"WARNING: left on this machine: {left}")
    return code


def _restart_operator_for_keep(cluster: Cluster, scenario: Scenario) -> None:
    """`--keep`: the scenario's operator stopped with it; run one detached for the user."""
    operator = OperatorProcess(
        cluster.kubeconfig, [scenario.namespace], scenario.workdir / "operator.log"
    )
    operator.start()
    operator.wait_live()
    pid = operator.process.pid if operator.process else "?"
    print(f"operator running (pid {pid}, log {operator.log}); stop it with: kill {pid}")


if __name__ == "__main__":
    raise SystemExit(main())
