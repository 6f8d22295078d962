"""The deadline path: is the `mustSaveBy` checkpoint Ready in time, and by how much?

One devcluster, the operator as a process, one RolloutSet of the counter participant
(`tests/e2e/policy_participant.py`: the real control plane and storage, with a prepare that takes
as long as the bench says). Three manual checkpoints measure the starting cost; then, 20 times:
the checkpoint cost changes (a seeded random walk between 0.2 s and 4 s, with a step up and a
step down, as a participant under varying load would), `mustSaveBy` is set a few seconds past the
operator's current `saveReserveSeconds`, and the bench waits for the operator to record the
outcome. Each deadline checkpoint is a measured duration for the next run.

Per run it prints the cost, the reserve the deadline started with, the deadline checkpoint's
duration, and the margin by which it was Ready before `mustSaveBy` (negative: missed). The
Ready time is when the bench saw phase Ready (polled every 50 ms; `completedAt` has whole
seconds only). The targets: none missed, median margin under twice the median reserve.

Baselines from the same measured durations: starting at `mustSaveBy` (no reserve: every run
misses) and a fixed reserve of DEFAULT_RESERVE_SECONDS (what the operator uses before it has
measured anything: never misses here, but every second of margin is work not saved).

    python bench/deadline.py [--runs 20] [--seed 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
from kubernetes_asyncio import client as k8s
from rollout_operator.decide.policy.deadline import (
    DEFAULT_RESERVE_SECONDS,
    deadline_checkpoint_name,
    save_reserve_seconds,
)
from rollout_operator.decide.policy.views import ANNOTATION_DEADLINE_OUTCOME
from rollout_operator.model import api

from devcluster.cluster import Cluster
from devcluster.kube import open_api
from harness.objects import apply_crds, create_namespace, kubectl_apply
from harness.operatorprocess import OperatorProcess

REPO = Path(__file__).resolve().parents[1]
PARTICIPANT = REPO / "tests" / "e2e" / "policy_participant.py"
NAMESPACE = "bench-deadline"
SET = "walltime"
LEAD_SECONDS = 3
"""How far past the reserve each mustSaveBy is set: the wait before the deadline checkpoint."""
WAIT = 120.0


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def counter_set(storage: Path, control: Path) -> dict[str, Any]:
    container = {
        "name": "counter",
        "image": "rollout-checkpoint-operator:dev",
        "command": [sys.executable, str(PARTICIPANT), "--control-dir", str(control)],
        "ports": [{"name": "control", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "control"}, "periodSeconds": 1},
    }
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.ROLLOUT_SET_KIND,
        "metadata": {"name": SET},
        "spec": {
            "participants": [
                {"role": "environment", "template": {"spec": {"containers": [container]}}}
            ],
            "storage": {
                "path": str(storage),
                "volume": {"hostPath": {"path": str(storage), "type": "DirectoryOrCreate"}},
            },
            "checkpointPolicy": {"afterDeadline": "Continue", "keepLatest": 3},
        },
    }


def costs(runs: int, seed: int) -> list[float]:
    """A random walk in [0.2, 4] s, with one step up and one step down of about 1.5 s."""
    rng = random.Random(seed)
    cost, out = 1.0, []
    for i in range(runs):
        if i == runs // 3:
            cost += 1.5
        if i == 2 * runs // 3:
            cost -= 1.5
        cost = min(4.0, max(0.2, cost + rng.uniform(-0.4, 0.4)))
        out.append(round(cost, 2))
    return out


@dataclass(frozen=True)
class Run:
    cost: float
    reserve: int
    duration: float
    margin: float
    checkpoint: str


class Bench:
    def __init__(self, api_client: Any, control: Path) -> None:
        self.custom = k8s.CustomObjectsApi(api_client)
        self.control = control

    async def rset(self) -> dict[str, Any]:
        obj: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            api.GROUP, api.VERSION, NAMESPACE, api.ROLLOUT_SET_PLURAL, SET
        )
        return obj

    async def checkpoint(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            api.GROUP, api.VERSION, NAMESPACE, api.ROLLOUT_CHECKPOINT_PLURAL, name
        )
        return obj

    async def until(self, what: str, check: Any, interval: float = 0.05) -> Any:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            found = await check()
            if found:
                return found
            await anyio.sleep(interval)
        raise TimeoutError(f"no {what} within {WAIT:.0f}s")

    async def ready_set(self) -> None:
        async def ready() -> bool:
            obj = await self.rset()
            return any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in (obj.get("status") or {}).get("conditions") or []
            )

        await self.until("Ready set", ready, 0.2)

    async def manual(self, name: str) -> float:
        """Take a manual checkpoint; returns its measured duration."""
        body = {
            "apiVersion": api.API_VERSION,
            "kind": api.ROLLOUT_CHECKPOINT_KIND,
            "metadata": {"name": name},
            "spec": {"rolloutSet": SET},
        }
        await self.custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, NAMESPACE, api.ROLLOUT_CHECKPOINT_PLURAL, body
        )

        async def ready() -> float | None:
            status = (await self.checkpoint(name)).get("status") or {}
            if status.get("phase") == "Ready":
                return float(status["durations"]["totalSeconds"])
            return None

        found: float = await self.until(f"checkpoint {name} Ready", ready)
        return found

    async def reserve(self, newest: float) -> int:
        """The reserve once the operator has taken in the newest checkpoint's duration."""

        async def written() -> int | None:
            status = (await self.rset()).get("status") or {}
            durations = status.get("recentCheckpointSeconds") or []
            current = durations and durations[-1] == newest
            if current and status.get("saveReserveSeconds") == save_reserve_seconds(durations):
                return int(status["saveReserveSeconds"])
            return None

        found: int = await self.until("saveReserveSeconds", written)
        return found

    async def deadline(self, cost: float, newest: float) -> Run:
        (self.control / "park-delay").write_text(str(cost))
        reserve = await self.reserve(newest)
        when = datetime.now(UTC) + timedelta(seconds=reserve + LEAD_SECONDS)
        must = api.format_time(when)
        patch = {"spec": {"checkpointPolicy": {"mustSaveBy": must}}}
        await self.custom.patch_namespaced_custom_object(
            api.GROUP,
            api.VERSION,
            NAMESPACE,
            api.ROLLOUT_SET_PLURAL,
            SET,
            patch,
            _content_type="application/merge-patch+json",
        )
        name = deadline_checkpoint_name(SET, when)
        ready_at: list[float] = []

        async def outcome() -> dict[str, Any] | None:
            if not ready_at:
                try:
                    ckpt = await self.checkpoint(name)
                except k8s.ApiException:
                    ckpt = {}
                if (ckpt.get("status") or {}).get("phase") == "Ready":
                    ready_at.append(time.time())
            annotations = (await self.rset())["metadata"].get("annotations") or {}
            record = json.loads(annotations.get(ANNOTATION_DEADLINE_OUTCOME) or "{}")
            return record if record.get("mustSaveBy") == must else None

        record = await self.until(f"outcome of mustSaveBy {must}", outcome)
        ckpt = await self.checkpoint(record.get("checkpoint") or name)
        done = ready_at[0] if ready_at and ckpt["metadata"]["name"] == name else None
        if done is None:  # another checkpoint covered it: use its completedAt
            done = datetime.fromisoformat(ckpt["status"]["completedAt"].replace("Z", "+00:00"))
            done = done.timestamp()
        deadline = datetime.fromisoformat(must.replace("Z", "+00:00")).timestamp()
        return Run(
            cost=cost,
            reserve=reserve,
            duration=float(ckpt["status"]["durations"]["totalSeconds"]),
            margin=deadline - done,
            checkpoint=ckpt["metadata"]["name"],
        )


async def measure(cluster: Cluster, root: Path, runs: int, seed: int) -> list[Run]:
    storage, control = root / "checkpoints", root / "control"
    storage.mkdir()
    control.mkdir()
    create_namespace(cluster, NAMESPACE)
    operator = OperatorProcess(cluster.kubeconfig, [NAMESPACE], root / "operator.log")
    operator.start()
    try:
        operator.wait_live()
        kubectl_apply(cluster, NAMESPACE, counter_set(storage, control))
        async with open_api(cluster.kubeconfig) as api_client:
            bench = Bench(api_client, control)
            await bench.ready_set()
            schedule = costs(runs, seed)
            (control / "park-delay").write_text(str(schedule[0]))
            newest = 0.0
            for i in range(3):
                newest = await bench.manual(f"warm-{i}")
            results: list[Run] = []
            for i, cost in enumerate(schedule):
                run = await bench.deadline(cost, newest)
                newest = run.duration
                results.append(run)
                _say(
                    f"run {i + 1}: cost {cost:.2f}s reserve {run.reserve}s "
                    f"duration {run.duration:.2f}s margin {run.margin:+.2f}s"
                )
            return results
    except BaseException:
        _say(f"operator log tail:\n{operator.tail(30)}")
        raise
    finally:
        cluster.kubectl("delete", "rckpt,rset", "--all", "-n", NAMESPACE, "--timeout=60s")
        operator.stop()


def table(results: list[Run]) -> list[str]:
    lines = [
        f"| {'run':>3} | {'cost s':>6} | {'reserve s':>9} | {'duration s':>10} | "
        f"{'margin s':>8} | {'missed':>6} |",
        f"|{'-' * 5}|{'-' * 8}|{'-' * 11}|{'-' * 12}|{'-' * 10}|{'-' * 8}|",
    ]
    for i, run in enumerate(results, 1):
        lines.append(
            f"| {i:>3} | {run.cost:>6.2f} | {run.reserve:>9} | {run.duration:>10.2f} | "
            f"{run.margin:>8.2f} | {'yes' if run.margin < 0 else 'no':>6} |"
        )
    margins = [r.margin for r in results]
    reserves = [r.reserve for r in results]
    missed = sum(1 for m in margins if m < 0)
    median_margin, median_reserve = statistics.median(margins), statistics.median(reserves)
    fixed = [DEFAULT_RESERVE_SECONDS - r.duration for r in results]
    lines += [
        "",
        f"| {'':<44} | {'measured reserve':>16} | {'no reserve':>10} | "
        f"{f'fixed {DEFAULT_RESERVE_SECONDS}s':>10} |",
        f"|{'-' * 46}|{'-' * 18}|{'-' * 12}|{'-' * 12}|",
        f"| {'runs that missed mustSaveBy':<44} | {missed:>16} | {len(results):>10} | "
        f"{sum(1 for m in fixed if m < 0):>10} |",
        f"| {'median margin before mustSaveBy (s)':<44} | {median_margin:>16.2f} | "
        f"{-statistics.median(r.duration for r in results):>10.2f} | "
        f"{statistics.median(fixed):>10.2f} |",
        f"| {'smallest margin (s)':<44} | {min(margins):>16.2f} | "
        f"{-max(r.duration for r in results):>10.2f} | {min(fixed):>10.2f} |",
        "",
        f"median reserve {median_reserve:.0f}s; median margin / median reserve = "
        f"{median_margin / median_reserve:.2f} (target < 2); missed {missed} (target 0); "
        f"median margin against the fixed {DEFAULT_RESERVE_SECONDS}s reserve: "
        f"{median_margin / statistics.median(fixed):.0%}",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-deadline-"))
    started = time.monotonic()
    cluster = Cluster.start(root / "cluster")
    try:
        apply_crds(cluster)
        results = anyio.run(measure, cluster, root, args.runs, args.seed)
    finally:
        cluster.stop()
    print(
        f"deadline checkpoints: {args.runs} runs, seed {args.seed}, mustSaveBy set "
        f"saveReserveSeconds + {LEAD_SECONDS}s ahead each time"
    )
    print()
    for line in table(results):
        print(line)
    print(f"\n(bench took {time.monotonic() - started:.0f}s; operator log and records in {root})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
