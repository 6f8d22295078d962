"""One environment pod with 1, 2 and 4 worker processes: episode throughput with and without
interval checkpoints, and the checkpoint pause with 1,000 live episodes spread over the workers.

The four reference servers run on loopback (`protocol_pause.servers`); only the environment
changes between rows (`rollout-server environment --workers W`); agent, resources and model stay
one process each. For each W:

  throughput   the same seeded episodes (`episode_specs(--episodes, --seed)`), run by the real
               `RolloutClient` at `--concurrency`, once without and once with a checkpoint every
               `--interval` seconds (`throughput.one_run`: every run's rewards must match);
               episodes per wall second, and with / without
  pause        `--pause-episodes` episodes started at once against a slow model (every episode
               stays live inside a model call), then `--pauses` checkpoints, each prepare ->
               commit -> publish -> resume over all four roles; the median pause (admission
               closed to reopened), and its ratio to the 1-worker pause

On a machine with fewer cores than workers, more workers cannot add throughput: the figures say
what the coordination costs there, not what a many-core pod gains. Prints a table; asserts
nothing about speed.
Run: `.venv/bin/python bench/workers.py [--episodes N] [--interval S] [--pause-episodes N]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import anyio
import httpx
from protocol_pause import TOKEN, servers
from rollout_protocol import Coordinator, HttpParticipantClient, Role
from rollout_servers.tasks import shipped_tasks
from throughput import Run, one_run

WORKERS = (1, 2, 4)


async def throughput(args: argparse.Namespace, root: Path, workers: int) -> tuple[Run, Run]:
    extra = {
        Role.ENVIRONMENT: ["--workers", str(workers)],
        Role.MODEL: ["--token-latency-ms", str(args.token_latency_ms)],
    }
    with servers(root, extra) as procs:
        urls = {role: url for (role, _), (url, _) in procs.items()}
        async with aiohttp.ClientSession() as control:
            without = await one_run(0, False, args, urls, root / "checkpoints", control)
            with_ = await one_run(1, True, args, urls, root / "checkpoints", control)
    if round(without.reward_sum, 6) != round(with_.reward_sum, 6):
        raise SystemExit(f"rewards differ: {without.reward_sum} against {with_.reward_sum}")
    return without, with_


async def pause(args: argparse.Namespace, root: Path, workers: int) -> list[float]:
    """Median-able pauses of `args.pauses` checkpoints with `args.pause_episodes` live."""
    extra = {
        Role.ENVIRONMENT: ["--workers", str(workers)],
        Role.MODEL: ["--token-latency-ms", "1000"],  # every episode waits inside a model call
    }
    tasks = shipped_tasks()
    with servers(root, extra) as procs:
        urls = {role: url for (role, _), (url, _) in procs.items()}
        async with (
            aiohttp.ClientSession() as control,
            httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as http,
            anyio.create_task_group() as group,
        ):
            participants = [
                HttpParticipantClient(role, urls[role], token=TOKEN, client=control)
                for role in Role
            ]
            environment = participants[[p.role for p in participants].index(Role.ENVIRONMENT)]

            async def episode(n: int) -> None:
                task = tasks[n % len(tasks)].model_copy(update={"seed": n})
                body = {"rollout_id": f"p{n}", "attempt": 0, "task": task.wire()}
                await http.post(urls[Role.ENVIRONMENT] + "/run", json=body)

            for n in range(args.pause_episodes):
                group.start_soon(episode, n)
            deadline = time.monotonic() + 300
            while True:  # a bench's wait for its load, with a deadline
                status = await environment.status(time.time() + 30)
                if status.live_episodes >= args.pause_episodes:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {status.live_episodes} episodes live after 300 s")
                await anyio.sleep(0.2)
            coordinator = Coordinator(participants, call_timeout=120)
            pauses = []
            for k in range(args.pauses):
                result = await coordinator.checkpoint(
                    f"pause-{workers}-{k}", prepare_timeout=60, commit_timeout=60
                )
                if not result.ok:
                    raise SystemExit(f"checkpoint failed: {result.reason}: {result.message}")
                if result.prepare.episode_count < args.pause_episodes:
                    held = result.prepare.episode_count
                    raise SystemExit(f"checkpoint held {held} episodes only")
                pauses.append(result.durations.pause_seconds)
            group.cancel_scope.cancel()
    return pauses


async def bench(args: argparse.Namespace, root: Path) -> None:
    rows = []
    for workers in args.workers:
        for folder in (root / f"t{workers}", root / f"p{workers}"):
            folder.mkdir()
        without, with_ = await throughput(args, root / f"t{workers}", workers)
        pauses = await pause(args, root / f"p{workers}", workers)
        rows.append((workers, without, with_, statistics.median(pauses)))
        print(
            f"workers {workers}: {without.per_second:.2f} / {with_.per_second:.2f} episodes/s "
            f"without / with ({len(with_.pauses)} checkpoints); pause {rows[-1][3]:.3f} s",
            file=sys.stderr,
        )
    base_rate = rows[0][1].per_second
    base_pause = rows[0][3]
    print(
        f"environment pod, {args.episodes} episodes (seed {args.seed}) at concurrency "
        f"{args.concurrency}, checkpoint every {args.interval:g} s; pause: "
        f"{args.pause_episodes} live episodes, median of {args.pauses} checkpoints"
    )
    print(
        f"{'workers':>7} {'without ep/s':>12} {'with ep/s':>10} {'with/without':>12} "
        f"{'vs 1 worker':>11} {'checkpoints':>11} {'pause s':>8} {'pause vs 1':>10}"
    )
    for workers, without, with_, median_pause in rows:
        print(
            f"{workers:>7} {without.per_second:>12.2f} {with_.per_second:>10.2f} "
            f"{with_.per_second / without.per_second:>12.3f} "
            f"{without.per_second / base_rate:>11.2f} {len(with_.pauses):>11} "
            f"{median_pause:>8.3f} {median_pause / base_pause:>10.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=400, help="episodes per throughput run")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between checkpoints")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--token-latency-ms", type=float, default=2.0)
    parser.add_argument("--pause-episodes", type=int, default=1000)
    parser.add_argument("--pauses", type=int, default=3, help="checkpoints per pause row")
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKERS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as root:
        anyio.run(bench, args, Path(root))


if __name__ == "__main__":
    main()
