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

The building blocks (`OperatorProcess`, `run_scenario`, the measurements) are shared with the
end-to-end tests and `bench/recovery.py`, so what the demo shows is what they check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
import httpx
import yaml
from kubernetes_asyncio import client as k8s
from rollout_operator.decide.resources import secret_name, token_from_secret
from rollout_operator.model.api import GROUP, ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL, VERSION
from rollout_protocol import _storage as storage
from rollout_servers.client import EpisodeFailed, EpisodeResult, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology

from devcluster.cluster import Cluster
from devcluster.image import ProjectImage, build_project_image
from devcluster.kube import open_api
from devcluster.waiting import wait_for, wait_for_sync
from harness import helm

REPO: Final = Path(__file__).resolve().parents[1]
EXAMPLES: Final = REPO / "examples"
CRDS: Final = REPO / "crds"
SET_NAME: Final = "math-rl"

Say = Callable[[str], None]


def _quiet(_message: str) -> None:
    return None


# --- the operator as a process --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class OperatorProcess:
    """`rollout-operator run --namespace NS` as a child process in its own process group.

    Its output goes to a log file (tests print the tail when they fail). `stop` is the clean
    end (SIGTERM, then SIGKILL after a deadline); `kill` is a crash (SIGKILL to the group), for
    tests that restart the operator in the middle of a checkpoint or a recovery.

    `args` are appended to `rollout-operator run` (`--all-namespaces` with no `namespaces`,
    `--metrics-port N`, `--standalone`, ...). `environment` replaces this process's environment
    for the child (the RBAC test leaves out every `KUBE*` variable so that no credentials but
    its token kubeconfig reach the operator); `KUBECONFIG` is set to `kubeconfig` either way.
    `module` is what `python -m` runs: the package's entry point, or `rollout_operator.cli`
    for a commit from before it had one (a bench's baseline).
    """

    def __init__(
        self,
        kubeconfig: Path,
        namespaces: Sequence[str],
        log: Path,
        *,
        args: Sequence[str] = (),
        environment: Mapping[str, str] | None = None,
        module: str = "rollout_operator",
    ) -> None:
        self.kubeconfig = kubeconfig
        self.module = module
        self.namespaces = list(namespaces)
        self.log = log
        self.args = list(args)
        self.environment = dict(environment) if environment is not None else None
        self.liveness = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        if self.running:
            raise RuntimeError("the operator is running already")
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        argv = [sys.executable, "-m", self.module, "run", "--liveness", self.liveness]
        for namespace in self.namespaces:
            argv += ["--namespace", namespace]
        argv += self.args
        base = os.environ if self.environment is None else self.environment
        env = {**base, "KUBECONFIG": str(self.kubeconfig)}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with self.log.open("ab") as out:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"\n===== operator start #{self.starts} at {stamp} =====\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_live(self, timeout: float = 30.0) -> None:
        """Until the liveness endpoint answers (Kopf started its watches and handlers)."""

        def live() -> bool:
            if not self.running:
                raise RuntimeError(f"the operator exited; log:\n{self.tail()}")
            try:
                return httpx.get(self.liveness, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for_sync(live, timeout, "the operator's liveness endpoint", interval=0.2)

    def _signal(self, sig: signal.Signals) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL: the operator dies wherever it is (a crash, an OOM kill, a node loss)."""
        if self.process is None:
            return
        self._signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(timeout=30)
        self._signal(signal.SIGKILL)  # anything it left in its group
        self.process = None

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])


# --- manifests ------------------------------------------------------------------------------


def apply_crds(cluster: Cluster, crds: Path = CRDS) -> None:
    """Applies the CRDs in `crds` (this checkout's by default; a bench comparing with another
    commit passes that commit's) and waits until both are Established."""
    cluster.kubectl("apply", "-f", str(crds))
    names = [f"crd/{ROLLOUT_SET_PLURAL}.{GROUP}", f"crd/{ROLLOUT_CHECKPOINT_PLURAL}.{GROUP}"]
    established = '{.status.conditions[?(@.type=="Established")].status}'

    # Not `kubectl wait --for=condition=Established`: on a freshly created CRD whose status has
    # no conditions yet it fails at once ("conditions accessor error") instead of waiting.
    def both_established() -> bool:
        return all(
            cluster.kubectl("get", name, "-o", f"jsonpath={established}", check=False).stdout
            == "True"
            for name in names
        )

    wait_for_sync(both_established, 60, "the CRDs to be Established", interval=0.2)


def create_namespace(cluster: Cluster, name: str) -> None:
    """A namespace whose default ServiceAccount exists (pods are refused before it does)."""
    cluster.kubectl("create", "namespace", name)
    wait_for_sync(
        lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        30,
        f"the default ServiceAccount of namespace {name}",
        interval=0.2,
    )


def _load(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict), f"{path} is not one YAML object"
    return loaded


def with_storage(obj: dict[str, Any], storage_dir: Path) -> dict[str, Any]:
    """A RolloutSet manifest with its storage moved to `storage_dir`: a hostPath mounted at the
    same path (devcluster runs pods on this machine, so the records land exactly there)."""
    path = str(storage_dir)
    obj["spec"]["storage"] = {
        "path": path,
        "volume": {"hostPath": {"path": path, "type": "DirectoryOrCreate"}},
    }
    return obj


def example_set(
    storage_dir: Path,
    *,
    name: str = SET_NAME,
    extra_args: Mapping[str, Sequence[str]] | None = None,
    spec: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`examples/rolloutset.yaml` with its storage moved to `storage_dir` (devcluster mounts a
    hostPath at the same path, so the records land exactly there on this machine).

    `extra_args` appends server arguments per role (e.g. `--debug-hooks`); `spec` merges
    top-level spec fields (e.g. `recovery`).
    """
    obj = with_storage(_load(EXAMPLES / "rolloutset.yaml"), storage_dir)
    obj["metadata"]["name"] = name
    for participant in obj["spec"]["participants"]:
        more = list((extra_args or {}).get(participant["role"], ()))
        if more:
            container = participant["template"]["spec"]["containers"][0]
            container["args"] = [*container.get("args", []), *more]
    for key, value in (spec or {}).items():
        current = obj["spec"].get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            obj["spec"][key] = {**current, **value}
        else:
            obj["spec"][key] = value
    return obj


def example_checkpoint(name: str, set_name: str = SET_NAME) -> dict[str, Any]:
    obj = _load(EXAMPLES / "rolloutcheckpoint.yaml")
    obj["metadata"]["name"] = name
    obj["spec"]["rolloutSet"] = set_name
    return obj


def kubectl_apply(cluster: Cluster, namespace: str, obj: Mapping[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def condition(obj: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item.get("type") == type_:
            return dict(item)
    return None


def is_true(obj: Mapping[str, Any], type_: str) -> bool:
    found = condition(obj, type_)
    return found is not None and found.get("status") == "True"


# --- reading the custom resources -----------------------------------------------------------


class Resources:
    """The two custom resources of one namespace, read through kubernetes_asyncio."""

    def __init__(self, api: Any, namespace: str) -> None:
        self.custom = k8s.CustomObjectsApi(api)
        self.core = k8s.CoreV1Api(api)
        self.namespace = namespace

    async def rollout_set(self, name: str = SET_NAME) -> dict[str, Any]:
        obj: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, ROLLOUT_SET_PLURAL, name
        )
        return obj

    async def control_token(self, name: str = SET_NAME) -> str:
        """The set's control token, from the Secret the operator generated for it: what a
        caller shows for the participants' control routes and `GET /stats?detail=true`."""
        secret = await self.core.read_namespaced_secret(secret_name(name), self.namespace)
        return token_from_secret({"data": secret.data})

    async def checkpoint(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, ROLLOUT_CHECKPOINT_PLURAL, name
        )
        return obj

    async def wait_set(
        self,
        what: str,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float,  # noqa: ASYNC109 - a poll budget
        name: str = SET_NAME,
    ) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            obj = await self.rollout_set(name)
            return obj if predicate(obj) else None

        return await wait_for(check, timeout, f"RolloutSet {name} {what}", interval=0.1)

    async def wait_checkpoint(
        self,
        name: str,
        what: str,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float,  # noqa: ASYNC109 - a poll budget
        interval: float = 0.1,
    ) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            obj = await self.checkpoint(name)
            return obj if predicate(obj) else None

        return await wait_for(
            check,
            timeout,
            f"RolloutCheckpoint {name} {what}",
            interval=interval,
            ignore=(k8s.ApiException,),
        )


def phase_is(*phases: str) -> Callable[[dict[str, Any]], bool]:
    def check(obj: dict[str, Any]) -> bool:
        return (obj.get("status") or {}).get("phase") in phases

    return check


def participants_by_role(obj: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for participant in (obj.get("status") or {}).get("participants") or []:
        out[participant["role"]].append(participant)
    return out


# --- observing a recovery --------------------------------------------------------------------


@dataclass
class Timeline:
    """When the observer first saw each step of the first recovery (monotonic seconds)."""

    events: dict[str, float] = field(default_factory=dict)
    attempts: list[int] = field(default_factory=list)

    def mark(self, event: str, at: float) -> None:
        self.events.setdefault(event, at)

    def since(self, event: str, origin: str = "killed") -> float | None:
        if event not in self.events or origin not in self.events:
            return None
        return self.events[event] - self.events[origin]


RECOVERY_STEPS: Final = (
    ("killed", "pod killed"),
    ("loss_detected", "loss detected (Recovering)"),
    ("pods_ready", "fresh pods Ready"),
    ("restored", "records restored"),
    ("resumed", "resumed, set Ready"),
)


async def observe_recovery(
    resources: Resources, timeline: Timeline, from_attempt: int, stop: anyio.Event
) -> None:
    """Poll the set every 0.1 s and note when its recovery from `from_attempt` moves on.

    Phases map to the steps a user cares about: the recovery appears (loss detected), it enters
    Restoring (the fresh pods are all Ready), Resuming (every participant installed the records),
    and it disappears with the attempt advanced (resumed; the set is Ready again).
    """
    while not stop.is_set():
        try:
            obj = await resources.rollout_set()
        except (k8s.ApiException, OSError, TimeoutError):
            obj = None
        now = time.monotonic()
        if obj is not None:
            status = obj.get("status") or {}
            recovery = status.get("recovery")
            attempt = status.get("attempt")
            if isinstance(attempt, int) and attempt not in timeline.attempts:
                timeline.attempts.append(attempt)
            if recovery and recovery.get("fromAttempt") == from_attempt:
                timeline.mark("loss_detected", now)
                phase = recovery.get("phase")
                if phase in ("Restoring", "Resuming"):
                    timeline.mark("pods_ready", now)
                if phase == "Resuming":
                    timeline.mark("restored", now)
            elif isinstance(attempt, int) and attempt > from_attempt:
                timeline.mark("loss_detected", now)
                timeline.mark("pods_ready", now)
                timeline.mark("restored", now)
                timeline.mark("resumed", now)
                return
        with anyio.move_on_after(0.1):
            await stop.wait()


class StatsTracker:
    """The last `/stats?detail=true` of every participant pod the set has shown.

    Pods of a lost attempt die (the model by SIGKILL, the others when the recovery deletes
    them), and their counters with them; the tracker keeps the last reply each pod gave, polled
    every `interval` seconds, so work done before the loss can be compared with the work done
    again after it. Counts may miss what a dying pod did in its last interval.
    """

    def __init__(self, http: httpx.AsyncClient, token: str, interval: float = 0.2) -> None:
        self.http = http
        self.interval = interval
        self.headers = {"Authorization": f"Bearer {token}"}
        """detail=true lists rollout ids: the participants ask for the set's control token."""
        self.addresses: dict[str, tuple[str, str]] = {}
        """pod name -> (role, address)"""
        self.last: dict[str, dict[str, Any]] = {}

    def learn(self, obj: Mapping[str, Any]) -> None:
        for participant in (obj.get("status") or {}).get("participants") or []:
            if participant.get("address"):
                self.addresses[participant["pod"]] = (participant["role"], participant["address"])

    async def poll_pod(self, pod: str) -> dict[str, Any] | None:
        """Read one pod's counters now (and keep them); None when it does not answer."""
        _, address = self.addresses[pod]
        try:
            reply = await self.http.get(
                address + "/stats", params={"detail": "true"}, headers=self.headers, timeout=1.0
            )
        except httpx.HTTPError:
            return None
        if reply.status_code != 200:
            return None
        body: dict[str, Any] = reply.json()
        self.last[pod] = body
        return body

    async def poll_once(self) -> None:
        async with anyio.create_task_group() as group:
            for pod in list(self.addresses):
                group.start_soon(self.poll_pod, pod)

    async def run(self, resources: Resources, stop: anyio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(k8s.ApiException, OSError, TimeoutError):
                self.learn(await resources.rollout_set())
            await self.poll_once()
            with anyio.move_on_after(self.interval):
                await stop.wait()

    def by_role(self, role: str) -> list[dict[str, Any]]:
        return [
            self.last[pod]
            for pod, (r, _) in self.addresses.items()
            if r == role and pod in self.last
        ]


# --- measuring what was redone ------------------------------------------------------------------


def checkpoint_folder(storage_root: Path, set_name: str, checkpoint: str) -> Path:
    """A checkpoint's folder on the volume: `<namespace>/<set>/<uid>/<checkpoint>` for a set
    the operator runs (one namespace and uid per test storage folder), `<set>/<checkpoint>`
    for participants run without it."""
    found = sorted(storage_root.glob(f"*/{set_name}/*/{checkpoint}"))
    if not found:
        return storage_root / set_name / checkpoint
    assert len(found) == 1, f"checkpoint {checkpoint} of {set_name} in several sets: {found}"
    return found[0]


def checkpoint_records(storage_root: Path, set_name: str, checkpoint: str) -> dict[str, list[Any]]:
    """The records of a published checkpoint, per participant instance (verified digests)."""
    base = checkpoint_folder(storage_root, set_name, checkpoint)
    out: dict[str, list[Any]] = {}
    for directory in sorted(p for p in base.iterdir() if p.is_dir()):
        _, records = storage.read_records(directory, expect_checkpoint_id=checkpoint)
        out[directory.name] = records
    return out


def generation_prefixes(records: Mapping[str, list[Any]]) -> dict[str, int]:
    """Tokens the checkpoint kept per model request (`<rollout>/<key>`): a cut generation's
    prefix, or the whole of a held or delivered response."""
    kept: dict[str, int] = {}
    for instance, items in records.items():
        if not instance.startswith("model-"):
            continue
        for record in items:
            data = record.data
            tokens = (
                data.get("tokens")
                if record.kind == "delivered"
                else (data.get("state") or {}).get("tokens")
            )
            if isinstance(tokens, int):
                key = f"{record.rollout_id}/{record.key}"
                kept[key] = max(kept.get(key, 0), tokens)
    return kept


@dataclass
class Redone:
    """Work done more than once, over the episodes that ran again after the loss."""

    rerun: int = 0
    """Episodes whose /run was re-issued under the new attempt."""
    steps: int = 0
    """Completed environment stages and agent steps (model and tool calls) that had completed
    before, in an earlier attempt: each step name of an episode counts once in a clean run. A
    model call answered again from the checkpoint's record (a response held or delivered while
    the checkpoint was open) generates nothing and is not counted."""
    tokens: int = 0
    """Model tokens generated again: generated before the loss and not kept by the restored
    checkpoint (its cut prefixes and held responses), for requests generated again after it."""
    by_step: dict[str, int] = field(default_factory=dict)
    """Steps redone by kind (`model`, `tool`, `seed`, `invoke_agent`, `verify`)."""


def completed_steps(
    stats: Sequence[Mapping[str, Any]], rollout_id: str, after: int | None = None
) -> dict[str, int]:
    """Completions per step name of one rollout, summed over pods and attempts (only the
    attempts later than `after`, when given)."""
    counts: dict[str, int] = defaultdict(int)
    for reply in stats:
        by_attempt = (reply.get("rollouts") or {}).get(rollout_id) or {}
        for attempt, steps in by_attempt.items():
            if after is not None and int(attempt) <= after:
                continue
            for name, events in steps.items():
                if name in ("run", "close", "cleanup"):
                    continue
                counts[name] += int(events.get("completed", 0))
    return counts


def tokens_by_attempt(stats: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, int]]:
    """Model tokens per attempt and request key, summed over model pods."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for reply in stats:
        for attempt, entry in (reply.get("tokens") or {}).items():
            for key, count in (entry.get("by_request") or {}).items():
                out[int(attempt)][key] += int(count)
    return out


def started_under(tracker: StatsTracker, attempt: int) -> set[str]:
    """Rollouts whose /run started on an environment under `attempt`."""
    return {
        rid
        for reply in tracker.by_role("environment")
        for rid, by_attempt in (reply.get("rollouts") or {}).items()
        if ((by_attempt.get(str(attempt)) or {}).get("run") or {}).get("started")
    }


def measure_redone(
    tracker: StatsTracker,
    results: Sequence[EpisodeResult],
    first_attempt: int,
    kept_prefixes: Mapping[str, int],
) -> Redone:
    """Steps and tokens redone by the episodes that ran again after the loss of `first_attempt`:
    those that had started under it and finished under a later attempt. (Episodes the client
    had not started yet when the pod died redo nothing.)"""
    workers = tracker.by_role("environment") + tracker.by_role("agent")
    started = started_under(tracker, first_attempt)
    rerun = [r for r in results if r.attempt > first_attempt and r.rollout_id in started]
    redone = Redone(rerun=len(rerun))
    tokens = tokens_by_attempt(tracker.by_role("model"))
    before = tokens.get(first_attempt, {})
    after: dict[str, int] = defaultdict(int)
    for attempt, by_key in tokens.items():
        if attempt > first_attempt:
            for key, count in by_key.items():
                after[key] += count
    for result in rerun:
        rid = result.rollout_id
        later = completed_steps(workers, rid, after=first_attempt)
        for name, count in completed_steps(workers, rid).items():
            kind, _, turn = name.partition("@")
            if kind == "model" and after.get(f"{rid}/{turn}", 0) == 0:
                # Served again from the checkpoint's record (a held or delivered response):
                # the agent's step ran again, the model generated nothing.
                count -= later.get(name, 0)
            if count > 1:
                redone.steps += count - 1
                redone.by_step[kind] = redone.by_step.get(kind, 0) + count - 1
    rerun_ids = {r.rollout_id for r in rerun}
    for key, count in before.items():
        if key.partition("/")[0] in rerun_ids and after.get(key, 0) > 0:
            redone.tokens += max(0, count - kept_prefixes.get(key, 0))
    return redone


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
    manifest = example_set(
        storage_dir, extra_args={"model": model_args}, spec={"recovery": recovery}
    )
    kubectl_apply(cluster, scenario.namespace, manifest)
    say(
        f"applied examples/rolloutset.yaml (recovery.targetLevel {scenario.target_level}, "
        f"restorePolicy {scenario.restore_policy}"
        + (f", model load {scenario.load_seconds:g}s" if scenario.load_seconds else "")
        + ")"
    )


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
            "Ready", lambda o: is_true(o, "Ready"), 90 + scenario.load_seconds
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
    records = (
        checkpoint_records(storage_dir, SET_NAME, checkpoint["metadata"]["name"])
        if scenario.target_level == "turn"
        else {}
    )
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


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """`make demo` killed with SIGTERM cleans up like Ctrl-C does."""

    def handler(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    args = parser.parse_args(argv)

    root = args.dir or Path(tempfile.mkdtemp(prefix="rollout-demo-"))
    cluster: Cluster | None = None
    scenario = Scenario(
        namespace="demo", workdir=root / "demo", episodes=args.episodes, seed=args.seed
    )
    containers = args.node_runtime == "containerd"
    keep = False
    code = 1
    with _sigterm_as_interrupt():
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
                )
            else:
                _say(
                    f"starting devcluster in {root / 'cluster'} (etcd, kube-apiserver, scheduler, "
                    "controller-manager, node agent: gpu-0 with 8 GPUs, cpu-0)"
                )
                cluster = Cluster.start(root / "cluster", progress=None)
            _say(f"devcluster up in {time.monotonic() - started:.1f}s; applying crds/")
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
