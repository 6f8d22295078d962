"""One operator for a fleet: 100 RolloutSets of 16 pods each, on one machine.

The pods are fleet participants (devcluster's in-process test double: the real control plane
over a participant with no episodes, see docs/devcluster.md), so this machine can host 1,600 of
them; the API server, scheduler, controller-manager, operator, coordinator and HTTP are real.

Phases, one devcluster, one operator process:

1. **ramp**: `--sets` sets (4 roles x `--replicas` pods) are created at once; time until all are
   Ready.
2. **idle** (`--idle-seconds`): nothing changes; the operator's API request rate by verb, CPU
   and RSS.
3. **reconcile latency**: a spec change on `--probes` sets, one every 0.2 s: time from the patch
   to `status.observedGeneration` reaching the new generation (seen on a watch).
4. **storm**: one RolloutCheckpoint per set, all created within a few seconds: creation -> Ready.
5. **steady** (`--steady-seconds`, an hour compressed): `intervalSeconds: --interval-seconds` on
   every set; meanwhile a pod of each of `--kills` sets is SIGKILLed at once (pod loss ->
   `Recovering=True`, and -> Ready under the next attempt), `--suspends` sets are suspended and
   resumed, and `--annotations` sets get a trainer-step annotation (annotation -> its
   TrainerCheckpoint Ready).

The operator's requests are counted by the API server itself: the operator runs as its own
ServiceAccount, and one FlowSchema per (verb, resource) routes exactly that ServiceAccount's
requests to a priority level of its own (with ample seats, so nothing is throttled; see
`harness.apiaccounting`); the API server's
`apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}`, summed by verb, is then the
operator's request count by verb. (`apiserver_request_total` has verb and resource labels but
no client label; API Priority and Fairness is how a cluster accounts requests per client.)
Latencies are measured by the bench's own watch on the custom resources (admin identity, not
counted). Prints a table with the targets beside the numbers; asserts nothing.

    python bench/fleet.py [--sets 100] [--replicas 4] [--idle-seconds 60]
                          [--steady-seconds 150] [--interval-seconds 60]
                          [--operator-arg=--worker-limit=200 ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import watch
from rollout_operator.model.api import (
    ANNOTATION_TRAINER_STEP,
    GROUP,
    ROLLOUT_CHECKPOINT_PLURAL,
    ROLLOUT_SET_PLURAL,
    VERSION,
)

from devcluster.cluster import Cluster
from devcluster.config import NodeSpec
from devcluster.kube import open_api
from harness.apiaccounting import Accounting, Usage, by_verb, usage
from harness.fleet import fleet_checkpoint, fleet_set
from harness.objects import apply_crds, create_namespace
from harness.operatorprocess import OperatorProcess, sigterm_as_interrupt

NAMESPACE: Final = "fleet"
OPERATOR_SA: Final = "rollout-operator"
VERBS: Final = ("get", "list", "watch", "create", "update", "patch", "delete")
"""The verbs with a column of their own in the table (the total counts every verb)."""
PRIORITY_LEVEL: Final = "fleet-operator"
PODS_PER_NODE: Final = 500
MERGE_PATCH: Final[dict[str, Any]] = {"_content_type": "application/merge-patch+json"}

STORM_LIMIT_S: Final = 180.0
"""How long the storm's checkpoints may take to end (Ready or Failed)."""
STEADY_WAIT_LIMIT_S: Final = 240.0
"""How long the steady phase waits for its kills, suspends and annotations to show, in all."""

TARGET_RECONCILE_P99: Final = 1.0
TARGET_CHECKPOINT_P99: Final = 20.0
"""The storm target on this machine (it was 5 s before the operator-wide limit on
checkpoints running at once made the storm a queue)."""
TARGET_RSS_MB: Final = 200.0
TARGET_IDLE_RATE_PER_SET: Final = 0.1


def say(message: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the operator's identity and its per-verb accounting ------------------------------------------

ACCOUNTING: Final = Accounting(NAMESPACE, OPERATOR_SA, PRIORITY_LEVEL)
"""The operator's ServiceAccount and one FlowSchema per (verb, resource) matching only it
(`harness.apiaccounting`); this bench sums them by verb."""


def operator_requests(cluster: Cluster) -> dict[str, float]:
    """The operator's requests so far by verb, from the API server's APF counters."""
    return by_verb(ACCOUNTING.read(cluster))


# --- the operator process's CPU and memory -------------------------------------------------------


COMPONENTS: Final = {
    "agent": "devcluster agent",
    "apiserver": "kube-apiserver",
    "etcd": "/etcd ",
}
"""Where the rest of the machine's CPU goes: the node agent (every fleet participant is in
it), the API server and etcd, found by their command lines under the bench's work folder."""


def component_pids(work: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(work) not in command:
            continue
        for name, marker in COMPONENTS.items():
            if marker in command and name not in found:
                found[name] = int(proc.name)
    return found


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class Window:
    """Requests by verb, CPU and peak RSS of the operator over a stretch of time, and the CPU
    of the other components and of the whole machine."""

    name: str
    seconds: float
    requests: dict[str, float]
    cpu_seconds: float
    rss_mb: float
    component_cpu: dict[str, float] = field(default_factory=dict)
    machine_cpu: float = 0.0

    def rate(self, verb: str | None = None) -> float:
        total = sum(self.requests.values()) if verb is None else self.requests.get(verb, 0.0)
        return total / self.seconds if self.seconds > 0 else 0.0


Begun = tuple[float, dict[str, float], Usage, dict[str, float], float]


class Meter:
    def __init__(self, cluster: Cluster, pid: int, work: Path) -> None:
        self.cluster = cluster
        self.pid = pid
        self.peak_rss = 0.0
        self.components = component_pids(work)

    def sample_rss(self) -> float:
        rss = usage(self.pid).rss_mb
        self.peak_rss = max(self.peak_rss, rss)
        return rss

    def _components(self) -> dict[str, float]:
        return {name: usage(pid).cpu_seconds for name, pid in self.components.items()}

    def start(self) -> Begun:
        return (
            time.monotonic(),
            operator_requests(self.cluster),
            usage(self.pid),
            self._components(),
            machine_busy_seconds(),
        )

    def stop(self, name: str, begun: Begun) -> Window:
        t0, r0, u0, c0, m0 = begun
        r1, u1, c1, m1 = (
            operator_requests(self.cluster),
            usage(self.pid),
            self._components(),
            machine_busy_seconds(),
        )
        self.peak_rss = max(self.peak_rss, u1.rss_mb)
        return Window(
            name,
            time.monotonic() - t0,
            {verb: r1.get(verb, 0.0) - r0.get(verb, 0.0) for verb in r1.keys() | r0.keys()},
            u1.cpu_seconds - u0.cpu_seconds,
            u1.rss_mb,
            {k: c1[k] - c0[k] for k in c1 if k in c0},
            m1 - m0,
        )


# --- watching the custom resources -------------------------------------------------------------


@dataclass
class Waiter:
    predicate: Callable[[dict[str, Any]], bool]
    future: asyncio.Future[float]


@dataclass
class Observer:
    """Follows RolloutSets and RolloutCheckpoints on watches; `when(kind, name, predicate)`
    resolves with the monotonic time of the first event whose object satisfies it."""

    custom: k8s.CustomObjectsApi
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    waiters: dict[tuple[str, str], list[Waiter]] = field(default_factory=lambda: defaultdict(list))

    async def follow(self, plural: str) -> None:
        version: str | None = None
        while True:
            try:
                if version is None:
                    listing = await self.custom.list_namespaced_custom_object(
                        GROUP, VERSION, NAMESPACE, plural
                    )
                    for item in listing["items"]:
                        self._seen(plural, item)
                    version = listing["metadata"]["resourceVersion"]
                stream = watch.Watch().stream(
                    self.custom.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    NAMESPACE,
                    plural,
                    resource_version=version,
                    timeout_seconds=120,
                    allow_watch_bookmarks=True,
                )
                async with stream:
                    async for event in stream:
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            version = None
                            break
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._seen(plural, obj)
            except k8s.ApiException as error:
                if error.status == 410:
                    version = None
                else:
                    await asyncio.sleep(0.5)
            except (OSError, TimeoutError, aiohttp.ClientError) as error:
                # A busy API server drops or times out the watch: resume (or relist) as an
                # informer would; a dead watch here would read as sets that never turn Ready.
                say(f"watch of {plural} broke ({error!r}); resuming")
                await asyncio.sleep(0.5)

    def _seen(self, plural: str, obj: dict[str, Any]) -> None:
        now = time.monotonic()
        key = (plural, obj["metadata"]["name"])
        self.objects[key] = obj
        pending = self.waiters.get(key)
        if pending:
            for waiter in list(pending):
                if not waiter.future.done() and waiter.predicate(obj):
                    waiter.future.set_result(now)
                    pending.remove(waiter)

    def when(
        self, plural: str, name: str, predicate: Callable[[dict[str, Any]], bool]
    ) -> asyncio.Future[float]:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        current = self.objects.get((plural, name))
        if current is not None and predicate(current):
            future.set_result(time.monotonic())
        else:
            self.waiters[(plural, name)].append(Waiter(predicate, future))
        return future


def condition_is(kind: str, status: str = "True") -> Callable[[dict[str, Any]], bool]:
    def check(obj: dict[str, Any]) -> bool:
        for item in (obj.get("status") or {}).get("conditions") or []:
            if item.get("type") == kind:
                return bool(item.get("status") == status)
        return False

    return check


def observed(generation: int) -> Callable[[dict[str, Any]], bool]:
    def check(obj: dict[str, Any]) -> bool:
        return int((obj.get("status") or {}).get("observedGeneration") or 0) >= generation

    return check


def ready_at_attempt(attempt: int) -> Callable[[dict[str, Any]], bool]:
    ready = condition_is("Ready")

    def check(obj: dict[str, Any]) -> bool:
        return ready(obj) and (obj.get("status") or {}).get("attempt") == attempt

    return check


async def gather_times(
    futures: Mapping[str, asyncio.Future[float]], started: Mapping[str, float], limit_s: float
) -> tuple[list[float], list[str]]:
    """Seconds from each start to its future's time; names that missed `limit_s` are listed."""
    if futures:
        await asyncio.wait(list(futures.values()), timeout=limit_s)
    times, missed = [], []
    for name, future in futures.items():
        if future.done():
            times.append(future.result() - started[name])
        else:
            missed.append(name)
            future.cancel()
    return times, missed


def _failure(obj: dict[str, Any]) -> tuple[str, str]:
    """The reason and message of a checkpoint's Failed condition."""
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item.get("type") == "Failed":
            return str(item.get("reason", "")), str(item.get("message", ""))
    return "", ""


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Report:
    sets: int
    pods: int
    ramp_seconds: float = 0.0
    windows: dict[str, Window] = field(default_factory=dict)
    reconcile: list[float] = field(default_factory=list)
    pod_reaction: list[float] = field(default_factory=list)
    storm: list[float] = field(default_factory=list)
    storm_failed: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Storm checkpoints that ended Failed: name -> (reason, message)."""
    storm_spread: float = 0.0
    interval: list[float] = field(default_factory=list)
    recovery: list[float] = field(default_factory=list)
    suspend: list[float] = field(default_factory=list)
    resume: list[float] = field(default_factory=list)
    trainer: list[float] = field(default_factory=list)
    missed: dict[str, list[str]] = field(default_factory=dict)
    peak_rss: float = 0.0


async def run(args: argparse.Namespace, cluster: Cluster, work: Path, report: Report) -> Report:
    names = [f"set-{i:03d}" for i in range(args.sets)]
    create_namespace(cluster, NAMESPACE)
    apply_crds(cluster)
    ACCOUNTING.install(cluster, work)
    kubeconfig = ACCOUNTING.token_kubeconfig(cluster, work / "operator.kubeconfig")
    storage = work / "checkpoints"
    storage.mkdir()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
    if args.operator_source is not None:
        # Another checkout's operator (a `git worktree` of an older commit): before/after runs
        # of the same bench.
        root = args.operator_source.resolve()
        environment["PYTHONPATH"] = os.pathsep.join(
            str(root / part) for part in ("protocol", "operator", "servers", ".")
        )
    operator = OperatorProcess(
        kubeconfig,
        [NAMESPACE],
        work / "operator.log",
        args=["--standalone", *args.operator_arg],
        environment=environment,
    )
    operator.start()
    meter: Meter | None = None
    try:
        operator.wait_live(60)
        assert operator.process is not None
        meter = Meter(cluster, operator.process.pid, work)
        async with open_api(cluster.kubeconfig) as api:
            custom = k8s.CustomObjectsApi(api)
            observer = Observer(custom)
            follows = [
                asyncio.create_task(observer.follow(ROLLOUT_SET_PLURAL)),
                asyncio.create_task(observer.follow(ROLLOUT_CHECKPOINT_PLURAL)),
            ]
            try:
                await _phases(args, cluster, custom, observer, meter, names, storage, report)
            finally:
                for task in follows:
                    task.cancel()
    finally:
        if meter is not None:
            report.peak_rss = meter.peak_rss
        operator.stop()
        if args.keep_log:
            print(operator.tail(60), file=sys.stderr)
    return report


async def _create(custom: k8s.CustomObjectsApi, plural: str, obj: dict[str, Any]) -> None:
    await custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural, obj)


async def _patch_set(custom: k8s.CustomObjectsApi, name: str, body: dict[str, Any]) -> None:
    await custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        NAMESPACE,
        ROLLOUT_SET_PLURAL,
        name,
        body,
        **MERGE_PATCH,
    )


async def _bounded(limit: int, jobs: Sequence[Any]) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(job: Any) -> None:
        async with gate:
            await job

    await asyncio.gather(*(one(job) for job in jobs))


async def _phases(
    args: argparse.Namespace,
    cluster: Cluster,
    custom: k8s.CustomObjectsApi,
    observer: Observer,
    meter: Meter,
    names: list[str],
    storage: Path,
    report: Report,
) -> None:
    # 1. ramp
    say(f"ramp: creating {len(names)} sets of {4 * args.replicas} fleet pods")
    begun = meter.start()
    t0 = time.monotonic()
    ready = {n: observer.when(ROLLOUT_SET_PLURAL, n, ready_at_attempt(1)) for n in names}
    await _bounded(
        16,
        [
            _create(custom, ROLLOUT_SET_PLURAL, fleet_set(n, storage, replicas=args.replicas))
            for n in names
        ],
    )
    progress = asyncio.create_task(_progress("ramp: sets Ready", ready, meter))
    times, missed = await gather_times(ready, dict.fromkeys(names, t0), args.ramp_limit_seconds)
    progress.cancel()
    report.ramp_seconds = max(times) if times else math.nan
    report.missed["ramp"] = missed
    report.windows["ramp"] = meter.stop("ramp", begun)
    say(f"ramp: {len(times)}/{len(names)} Ready after {report.ramp_seconds:.1f}s")
    if missed:
        say(f"ramp: {len(missed)} sets not Ready within the limit; the other phases are skipped")
        return

    # 2. idle
    say(f"idle: {args.idle_seconds}s with nothing changing")
    await asyncio.sleep(5)  # the last sets' follow-up passes
    begun = meter.start()
    await asyncio.sleep(args.idle_seconds)
    report.windows["idle"] = meter.stop("idle", begun)

    # 3. reconcile latency: spec change -> observedGeneration
    probes = names[: args.probes]
    say(f"reconcile: a spec change on {len(probes)} sets")
    begun = meter.start()
    started: dict[str, float] = {}
    seen: dict[str, asyncio.Future[float]] = {}
    for name in probes:
        generation = int(observer.objects[(ROLLOUT_SET_PLURAL, name)]["metadata"]["generation"])
        seen[name] = observer.when(ROLLOUT_SET_PLURAL, name, observed(generation + 1))
        started[name] = time.monotonic()
        await _patch_set(custom, name, {"spec": {"checkpointPolicy": {"keepLatest": 3}}})
        await asyncio.sleep(0.2)
    report.reconcile, report.missed["reconcile"] = await gather_times(seen, started, 60)
    report.windows["reconcile"] = meter.stop("reconcile", begun)
    say(
        f"reconcile: p50 {quantile(report.reconcile, 0.5):.2f}s "
        f"p99 {quantile(report.reconcile, 0.99):.2f}s"
    )

    # 4. storm: every set checkpoints within the same few seconds
    say(f"storm: a checkpoint on each of {len(names)} sets at once")
    begun = meter.start()
    started, seen = {}, {}
    t0 = time.monotonic()

    is_ready, is_failed = condition_is("Ready"), condition_is("Failed")

    async def checkpoint(name: str) -> None:
        ckpt = f"{name}-storm"
        # waits for either end: a Failed checkpoint is a result (counted against the target)
        seen[ckpt] = observer.when(
            ROLLOUT_CHECKPOINT_PLURAL, ckpt, lambda obj: is_ready(obj) or is_failed(obj)
        )
        started[ckpt] = time.monotonic()
        await _create(custom, ROLLOUT_CHECKPOINT_PLURAL, fleet_checkpoint(ckpt, name))

    await _bounded(16, [checkpoint(n) for n in names])
    report.storm_spread = time.monotonic() - t0
    progress = asyncio.create_task(_progress("storm: checkpoints Ready or Failed", seen, meter))
    _, report.missed["storm"] = await gather_times(seen, started, STORM_LIMIT_S)
    progress.cancel()
    report.windows["storm"] = meter.stop("storm", begun)
    ends = {
        n: observer.objects[(ROLLOUT_CHECKPOINT_PLURAL, n)] for n, f in seen.items() if f.done()
    }
    report.storm = [seen[n].result() - started[n] for n, obj in ends.items() if is_ready(obj)]
    report.storm_failed = {
        n: _failure(obj) for n, obj in ends.items() if is_failed(obj) and not is_ready(obj)
    }
    say(
        f"storm: {len(report.storm)}/{len(names)} Ready, {len(report.storm_failed)} Failed, "
        f"p50 {quantile(report.storm, 0.5):.2f}s p99 {quantile(report.storm, 0.99):.2f}s"
    )
    for reason, count in Counter(r for r, _ in report.storm_failed.values()).most_common():
        example = next(m for r, m in report.storm_failed.values() if r == reason)
        say(f"storm: {count} Failed {reason}, e.g. {example[:240]}")

    # 5. steady: interval checkpoints everywhere, kills, suspends, trainer annotations
    say(f"steady: intervalSeconds {args.interval_seconds} on every set for {args.steady_seconds}s")
    begun = meter.start()
    t_steady = time.monotonic()
    interval_ready: list[float] = []
    before = {
        key for key in observer.objects if key[0] == ROLLOUT_CHECKPOINT_PLURAL
    }  # storm and earlier checkpoints
    await _bounded(
        16,
        [
            _patch_set(
                custom,
                n,
                {"spec": {"checkpointPolicy": {"intervalSeconds": args.interval_seconds}}},
            )
            for n in names
        ],
    )
    # Disjoint groups: the spec-change probes first, then suspends, annotations, kills.
    rest_names = names[args.probes :] or names
    suspended = rest_names[: args.suspends]
    annotated = rest_names[args.suspends : args.suspends + args.annotations]
    victims = [n for n in rest_names[args.suspends + args.annotations :]][: args.kills]

    await asyncio.sleep(min(20.0, args.steady_seconds / 6))
    say(f"steady: SIGKILL one pod in each of {len(victims)} sets at once")
    started, recovering, recovered = {}, {}, {}
    for name in victims:
        obj = observer.objects[(ROLLOUT_SET_PLURAL, name)]
        attempt = int(obj["status"]["attempt"])
        pod = obj["status"]["participants"][0]["pod"]
        recovering[name] = observer.when(ROLLOUT_SET_PLURAL, name, condition_is("Recovering"))
        recovered[name] = observer.when(ROLLOUT_SET_PLURAL, name, ready_at_attempt(attempt + 1))
        started[name] = time.monotonic()
        await cluster.admin.kill_pod_async(NAMESPACE, pod)

    say(f"steady: suspend {len(suspended)} sets, annotate {len(annotated)} with a trainer step")
    suspend_started = {n: time.monotonic() for n in suspended}
    suspend_done = {
        n: observer.when(ROLLOUT_SET_PLURAL, n, condition_is("Suspended")) for n in suspended
    }
    for name in suspended:
        suspend_started[name] = time.monotonic()
        await _patch_set(custom, name, {"spec": {"suspend": True}})
    trainer_started, trainer_done = {}, {}
    for name in annotated:
        ckpt = f"{name}-step-1000"
        trainer_done[ckpt] = observer.when(ROLLOUT_CHECKPOINT_PLURAL, ckpt, condition_is("Ready"))
        trainer_started[ckpt] = time.monotonic()
        await _patch_set(
            custom, name, {"metadata": {"annotations": {ANNOTATION_TRAINER_STEP: "1000"}}}
        )

    # one deadline for every wait of the phase, so that a saturated fleet still finishes the
    # bench within its 15 minutes (what missed it is listed under the table)
    limit = time.monotonic() + STEADY_WAIT_LIMIT_S

    def left(most: float) -> float:
        return max(1.0, min(most, limit - time.monotonic()))

    report.pod_reaction, missed_reaction = await gather_times(recovering, started, left(60))
    report.recovery, report.missed["recovery"] = await gather_times(recovered, started, left(180))
    report.missed["pod-reaction"] = missed_reaction
    report.suspend, report.missed["suspend"] = await gather_times(
        suspend_done, suspend_started, left(120)
    )
    resume_started, resume_done = {}, {}
    for name in suspended:
        attempt = int(observer.objects[(ROLLOUT_SET_PLURAL, name)]["status"].get("attempt", 1))
        resume_done[name] = observer.when(ROLLOUT_SET_PLURAL, name, condition_is("Ready"))
        resume_started[name] = time.monotonic()
        await _patch_set(custom, name, {"spec": {"suspend": False}})
    report.resume, report.missed["resume"] = await gather_times(
        resume_done, resume_started, left(180)
    )
    report.trainer, report.missed["trainer"] = await gather_times(
        trainer_done, trainer_started, left(120)
    )
    rest = args.steady_seconds - (time.monotonic() - t_steady)
    if rest > 0:
        say(f"steady: {rest:.0f}s more of interval checkpoints")
        await asyncio.sleep(rest)
    report.windows["steady"] = meter.stop("steady", begun)
    for (plural, name), obj in observer.objects.items():
        if plural != ROLLOUT_CHECKPOINT_PLURAL or (plural, name) in before:
            continue
        if (obj.get("spec") or {}).get("trigger") != "Interval" or not condition_is("Ready")(obj):
            continue
        durations = (obj.get("status") or {}).get("durations") or {}
        created = obj["metadata"]["creationTimestamp"]
        ready_time = next(
            c["lastTransitionTime"] for c in obj["status"]["conditions"] if c["type"] == "Ready"
        )
        delta = (
            datetime.fromisoformat(ready_time.replace("Z", "+00:00"))
            - datetime.fromisoformat(created.replace("Z", "+00:00"))
        ).total_seconds()
        interval_ready.append(max(delta, float(durations.get("totalSeconds") or 0.0)))
    report.interval = interval_ready


async def _progress(what: str, futures: Mapping[str, asyncio.Future[float]], meter: Meter) -> None:
    while True:
        await asyncio.sleep(15)
        done = sum(1 for f in futures.values() if f.done())
        say(f"{what}: {done}/{len(futures)} (operator RSS {meter.sample_rss():.0f} MB)")


# --- the table -----------------------------------------------------------------------------------


def _fmt(value: float, unit: str = "s") -> str:
    return "-" if math.isnan(value) else f"{value:.2f} {unit}".strip()


def table(report: Report, args: argparse.Namespace) -> list[str]:
    def row(name: str, value: str, target: str = "", verdict: str = "") -> str:
        return f"| {name:<52} | {value:>20} | {target:>12} | {verdict:>6} |"

    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"  # nan compares False: a phase not run reads MISSED

    def pq(values: Sequence[float]) -> str:
        if not values:
            return "-"
        return f"{quantile(values, 0.5):.2f} / {quantile(values, 0.99):.2f} s"

    idle = report.windows.get("idle")
    idle_per_set = idle.rate() / report.sets if idle is not None else math.nan
    reconcile_p99 = quantile(report.reconcile, 0.99)
    # a Failed or unfinished storm checkpoint counts as missing the target
    storm_p99 = (
        quantile(report.storm, 0.99)
        if not report.storm_failed and not report.missed.get("storm")
        else math.inf
    )
    lines = [
        f"fleet: {report.sets} sets x {report.pods // report.sets} fleet pods = {report.pods} pods,"
        f" one operator ({' '.join(args.operator_arg) or 'default flags'}"
        + (f", from {args.operator_source}" if args.operator_source else "")
        + ")",
        "",
        row("", "measured", "target", ""),
        f"|{'-' * 54}|{'-' * 22}|{'-' * 14}|{'-' * 8}|",
        row(
            "ramp: all sets Ready after",
            _fmt(report.ramp_seconds)
            if not report.missed.get("ramp")
            else f"{report.sets - len(report.missed['ramp'])}/{report.sets} in "
            f"{args.ramp_limit_seconds:.0f} s",
        ),
        row(
            "reconcile: spec change -> observedGeneration p50/p99",
            pq(report.reconcile),
            f"p99 < {TARGET_RECONCILE_P99:g} s",
            verdict(reconcile_p99 < TARGET_RECONCILE_P99),
        ),
        row("reconcile: pod SIGKILL -> Recovering=True p50/p99", pq(report.pod_reaction)),
        row(
            f"checkpoint storm ({report.sets} in {report.storm_spread:.1f} s): created->Ready",
            pq(report.storm)
            + (f", {len(report.storm_failed)} Failed" if report.storm_failed else ""),
            f"p99 < {TARGET_CHECKPOINT_P99:g} s",
            verdict(storm_p99 < TARGET_CHECKPOINT_P99),
        ),
        row(
            f"interval checkpoints ({len(report.interval)}): created->Ready",
            pq(report.interval),
        ),
        row(
            f"recovery, {len(report.recovery)} sets lose a pod at once: kill->Ready",
            pq(report.recovery),
        ),
        row(f"suspend ({len(report.suspend)} sets): patch->Suspended", pq(report.suspend)),
        row(f"resume ({len(report.resume)} sets): patch->Ready", pq(report.resume)),
        row(f"trainer annotation ({len(report.trainer)}): -> checkpoint Ready", pq(report.trainer)),
        row(
            "operator RSS (peak)",
            _fmt(report.peak_rss, "MB"),
            f"< {TARGET_RSS_MB:g} MB",
            verdict(report.peak_rss < TARGET_RSS_MB),
        ),
        row(
            "idle API requests per set",
            f"{idle_per_set:.3f} req/s",
            f"< {TARGET_IDLE_RATE_PER_SET:g} req/s",
            verdict(idle_per_set < TARGET_IDLE_RATE_PER_SET) if idle is not None else "",
        ),
        "",
        "operator by phase (requests/s by verb from the API server's APF counters; CPU = "
        "operator CPU seconds per wall second):",
        f"| {'phase':<10} | {'secs':>6} | {'CPU':>5} | {'RSS MB':>6} | {'total':>7} | "
        + " | ".join(f"{v:>6}" for v in VERBS)
        + " |",
    ]
    for window in report.windows.values():
        lines.append(
            f"| {window.name:<10} | {window.seconds:>6.0f} | "
            f"{window.cpu_seconds / window.seconds:>5.2f} | {window.rss_mb:>6.0f} | "
            f"{window.rate():>7.2f} | "
            + " | ".join(f"{window.rate(v):>6.2f}" for v in VERBS)
            + " |"
        )
    cores = os.cpu_count() or 1
    lines += [
        "",
        f"CPU seconds per wall second by component (the machine has {cores} cores; machine = "
        "everything not idle, /proc/stat):",
        f"| {'phase':<10} | {'operator':>8} | "
        + " | ".join(f"{name:>9}" for name in COMPONENTS)
        + f" | {'machine':>7} |",
    ]
    for window in report.windows.values():
        per = window.seconds or 1.0
        lines.append(
            f"| {window.name:<10} | {window.cpu_seconds / per:>8.2f} | "
            + " | ".join(f"{window.component_cpu.get(n, math.nan) / per:>9.2f}" for n in COMPONENTS)
            + f" | {window.machine_cpu / per:>7.2f} |"
        )
    missed = {k: v for k, v in report.missed.items() if v}
    if missed:
        lines.append("")
        for phase, names in missed.items():
            lines.append(f"missed deadline in {phase}: {len(names)} ({', '.join(names[:5])})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=4, help="pods per role (4 roles)")
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--steady-seconds", type=float, default=150.0)
    parser.add_argument("--interval-seconds", type=int, default=60)
    parser.add_argument("--probes", type=int, default=20, help="sets whose spec is changed")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--suspends", type=int, default=3)
    parser.add_argument("--annotations", type=int, default=5)
    parser.add_argument("--ramp-limit-seconds", type=float, default=480.0)
    parser.add_argument(
        "--operator-arg", action="append", default=[], help="passed to rollout-operator run"
    )
    parser.add_argument(
        "--operator-source",
        type=Path,
        metavar="DIR",
        help="run the operator from this checkout (e.g. a worktree of an older commit)",
    )
    parser.add_argument("--keep-log", action="store_true", help="print the operator log's tail")
    args = parser.parse_args(argv)
    args.probes = min(args.probes, args.sets)
    pods = args.sets * 4 * args.replicas
    nodes = [
        NodeSpec(name=f"fleet-{i}", cpu="1000", memory="4Ti", pods=PODS_PER_NODE)
        for i in range(max(1, math.ceil(pods / PODS_PER_NODE)))
    ]
    wall = time.monotonic()
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        work = Path(tmp)
        say(f"devcluster with {len(nodes)} nodes of {PODS_PER_NODE} pods")
        report = Report(sets=args.sets, pods=pods)
        try:
            with Cluster.start(work / "devcluster", nodes=nodes, timeout=180) as cluster:
                asyncio.run(run(args, cluster, work, report))
        except KeyboardInterrupt:
            print("interrupted: the table has the phases that finished", file=sys.stderr)
    print("\n".join(table(report, args)))
    print(f"\nbench wall time {time.monotonic() - wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
