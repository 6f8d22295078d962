"""How long devcluster takes: building its binaries, starting, and getting pods to Running.

Prints a table; asserts nothing. Targets from the issue: `up` (cached binaries) to /readyz under
20 s, pod create -> Running median under 1 s.

    python bench/devcluster_startup.py [--runs 3] [--pods 20] [--build-log FILE] [--cold-build]

The cold build time comes from a build log (`make cluster-binaries 2>&1 | tee FILE`), or, with
`--cold-build`, from building everything now into a throwaway cache (about 10 minutes on two
cores; Go's module download cache is kept, so downloads are not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from kubernetes_asyncio import client

from devcluster.cluster import Cluster
from devcluster.kube import open_api
from devcluster.paths import REPO_ROOT
from devcluster.testing import process_pod

_BUILT = re.compile(r"\[devcluster\] (\S+): built in (\d+) s")


def build_times_from_log(path: Path) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in _BUILT.finditer(path.read_text())}


def cold_build() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="devcluster-cold-") as scratch:
        env = {
            **os.environ,
            "DEVCLUSTER_CACHE": str(Path(scratch) / "cache"),
            "GOCACHE": str(Path(scratch) / "gocache"),
        }
        result = subprocess.run(
            [str(REPO_ROOT / "devcluster" / "build-binaries.sh")],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    return {m.group(1): float(m.group(2)) for m in _BUILT.finditer(result.stderr)}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


async def pods_to_running(cluster: Cluster, count: int, burst: bool) -> list[float]:
    """Seconds from create to the watch event showing phase Running, per pod."""
    namespace = f"bench-{'burst' if burst else 'seq'}"
    cluster.kubectl("create", "namespace", namespace)
    async with open_api(cluster.kubeconfig) as api:
        core: Any = client.CoreV1Api(api)
        deadline = time.monotonic() + 30
        while True:  # pods are refused until the namespace's default ServiceAccount exists
            try:
                await core.read_namespaced_service_account("default", namespace)
                break
            except client.ApiException:
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.1)
        created: dict[str, float] = {}
        running: dict[str, float] = {}
        names = [f"p{i}" for i in range(count)]
        seen = {name: anyio.Event() for name in names}

        async def watch(ready: anyio.Event) -> None:
            response = await core.list_namespaced_pod(
                namespace, watch=True, timeout_seconds=120, _preload_content=False
            )
            ready.set()
            async with response:
                async for line in response.content:
                    event = json.loads(line)
                    obj = event["object"]
                    name = obj["metadata"]["name"]
                    if obj.get("status", {}).get("phase") == "Running" and name not in running:
                        running[name] = time.monotonic()
                        seen[name].set()
                        if len(running) == count:
                            return

        async def create(name: str) -> None:
            manifest = process_pod(name, ["sleep", "600"])
            created[name] = time.monotonic()
            await core.create_namespaced_pod(namespace, manifest)

        with anyio.fail_after(180):
            async with anyio.create_task_group() as tg:
                ready = anyio.Event()
                tg.start_soon(watch, ready)
                await ready.wait()
                if burst:
                    async with anyio.create_task_group() as creators:
                        for name in names:
                            creators.start_soon(create, name)
                else:
                    for name in names:
                        await create(name)
                        await seen[name].wait()
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
    return [running[name] - created[name] for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="cluster starts to time")
    parser.add_argument("--pods", type=int, default=20, help="pods per create->Running series")
    parser.add_argument("--build-log", type=Path, default=Path("/tmp/build.log"))
    parser.add_argument("--cold-build", action="store_true", help="time a cold build now")
    args = parser.parse_args()

    rows: list[tuple[str, str, str]] = []
    if args.cold_build:
        builds, source = cold_build(), "timed now"
    elif args.build_log.exists():
        builds, source = build_times_from_log(args.build_log), str(args.build_log)
    else:
        builds, source = {}, ""
    if builds:
        for name, seconds in builds.items():
            rows.append((f"cold build: {name}", f"{seconds:.0f} s", source))
        rows.append(("cold build: all binaries", f"{sum(builds.values()):.0f} s", source))
    else:
        rows.append(("cold build", "n/a", "pass --build-log FILE or --cold-build"))

    readyz: list[float] = []
    ready: list[float] = []
    down: list[float] = []
    sequential: list[float] = []
    burst: list[float] = []
    with tempfile.TemporaryDirectory(prefix="devcluster-bench-") as scratch:
        for run in range(args.runs):
            timings: dict[str, float] = {}
            cluster = Cluster.start(Path(scratch) / f"run{run}", timings=timings)
            try:
                readyz.append(timings["readyz"])
                ready.append(timings["ready"])
                if run == 0:
                    sequential = anyio.run(pods_to_running, cluster, args.pods, False)
                    burst = anyio.run(pods_to_running, cluster, args.pods, True)
            finally:
                started = time.monotonic()
                cluster.stop()
                down.append(time.monotonic() - started)

    def med(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} s"

    n = f"median of {args.runs}"
    rows += [
        ("up -> /readyz (cached binaries)", med(readyz), f"{n}; target < 20 s"),
        ("up -> cluster ready (nodes Ready)", med(ready), n),
        ("down (no process left)", med(down), n),
        (
            f"pod create -> Running, one at a time (n={len(sequential)})",
            f"median {med(sequential)}, p90 {percentile(sequential, 0.9):.2f} s",
            "target median < 1 s",
        ),
        (
            f"pod create -> Running, burst of {len(burst)}",
            f"median {med(burst)}, p90 {percentile(burst, 0.9):.2f} s",
            "all created at once",
        ),
    ]
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    header = ("measure", "value", "note")
    print(f"devcluster startup on {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(" | ".join(h.ljust(w) for h, w in zip(header, width, strict=True)))
    print("-+-".join("-" * w for w in width))
    for row in rows:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, width, strict=True)))


if __name__ == "__main__":
    main()
