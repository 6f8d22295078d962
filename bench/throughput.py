"""Episodes per second with interval checkpoints against none: what checkpointing costs a run.

Four reference servers run on loopback (`rollout-server <role>`; the builtin model generates a
token every `--token-latency-ms`, 20 ms by default: 50 tokens/s per sequence, a decode speed
of the order a GPU serves per sequence under load, so episodes wait on the model as real ones
do). The trainer is the real `RolloutClient` in this process, running the same seeded episodes
(`episode_specs(--episodes, --seed)`) at `--concurrency` in every run. Runs alternate
without / with / with / without (`--pairs` times; the ABBA order cancels a machine that drifts
linearly); during a "with" run a `Coordinator` in this process takes a checkpoint every
`--interval` seconds and publishes it to disk, as `rollout-coordinate checkpoint` would. The
runs with checkpoints take them both ways, in runs of their own: the old way (records written
and fsynced inside the pause, the prepare in four stages) and the new way (the cut inside the
pause, the records persisted after the resume, the prepare in the stages the servers declare;
docs/protocol.md, "Persist after resume" and "Prepare stages"). One block of runs is none, old,
new, new, old, none (`--pairs` blocks), so a machine that drifts linearly favours no kind.

  throughput   episodes / wall seconds of the run (the same episodes in every run)
  ratio        with / without, summed over the runs of each kind; target >= 0.99

A production interval is 60 s or more; the bench scales it down (5 s by default) so that a run
holds several checkpoints and the whole bench stays under a few minutes. The cost per
checkpoint does not scale with the interval, so the printed ratio is a pessimistic estimate of
the 60 s one; the table also shows that one (the loss scaled by interval / 60).

Two more measurements for records encoded at boundaries: how many records of each
checkpoint are byte for byte those of the checkpoint before it (what storing records in
segments referenced by digest would not write again), and the latency of an episode runtime
step with its record encoded at the boundary against the same step without (in this process,
on the record sizes of the reference servers: the agent's transcript and a growing model
generation), p50 and p99.

Every run's rewards must match (same seed, same work); a checkpoint that fails or a reward sum
that differs ends the bench with a message. Prints a table; asserts nothing about speed.
Run: `.venv/bin/python bench/throughput.py [--interval S] [--pairs N] [--episodes N]`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest.mock import patch

import aiohttp
import anyio
from protocol_pause import OLD, STAGED, TOKEN, servers
from rollout_protocol import (
    SEQUENTIAL_STAGES,
    Boundary,
    Coordinator,
    Episode,
    EpisodeRuntime,
    HttpParticipantClient,
    Role,
    StepMode,
)
from rollout_protocol import _storage as storage
from rollout_servers.client import EpisodeFailed, EpisodeSpec, RolloutClient, episode_specs
from rollout_servers.topology import StaticTopology

PRODUCTION_INTERVAL_S = 60.0
NEW = STAGED
WAYS = (OLD, NEW)
"""The old way (records written inside the pause, the prepare in four stages) and the new way
(records persisted after the resume, the prepare in the stages the servers declare): how the
operator took checkpoints before and takes them now (docs/protocol.md, "Persist after resume",
"Prepare stages")."""
MIN_CHECKPOINTS = 3
"""A run "with" checkpoints that took fewer is refused: on a quiet machine 400 episodes ran in
10 s, under one 15 s interval, and the bench printed a ratio of two runs without any."""


@dataclass
class Run:
    """One pass over the seeded episodes, with or without interval checkpoints."""

    way: str | None
    """How checkpoints were taken in the run (`OLD`, `NEW`), None for a run without any."""
    seconds: float = 0.0
    episodes: int = 0
    reward_sum: float = 0.0
    pauses: list[float] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)
    """Seconds from the start of each checkpoint to its records durable (the pause, the old
    way; the pause and the persist after it, the new way)."""
    prepares: list[float] = field(default_factory=list)
    commits: list[float] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=dict)
    """Seconds of each prepare stage (by its roles: `environment+model`), from the coordinator's
    progress messages."""

    @property
    def per_second(self) -> float:
        return self.episodes / self.seconds


async def one_run(
    n: int,
    way: str | None,
    args: argparse.Namespace,
    urls: dict[Role, str],
    checkpoint_root: Path,
    control: aiohttp.ClientSession,
) -> Run:
    """Run the seeded episodes once; with a `way`, take a checkpoint that way every
    `args.interval` seconds."""
    run = Run(way=way)
    specs = [
        EpisodeSpec(rollout_id=f"t{n}-{spec.rollout_id}", task=spec.task)
        for spec in episode_specs(args.episodes, args.seed)
    ]
    client = RolloutClient(
        StaticTopology([urls[Role.ENVIRONMENT]]), concurrency=args.concurrency, run_timeout_s=600
    )
    marks: list[tuple[float, str]] = []
    coordinator = Coordinator(
        [HttpParticipantClient(role, urls[role], token=TOKEN, client=control) for role in Role],
        call_timeout=60,
        on_progress=lambda message: marks.append((time.perf_counter(), message)),
    )
    finished = anyio.Event()
    stages = SEQUENTIAL_STAGES
    if way == NEW:
        stages = coordinator.stages((await coordinator.status(time.time() + 30)).statuses)

    async def checkpoints() -> None:
        taken = 0
        while True:
            with anyio.move_on_after(args.interval):
                await finished.wait()
            if finished.is_set():
                return
            marks.clear()
            result = await coordinator.checkpoint(
                f"run{n}-{taken}",
                prepare_timeout=30,
                commit_timeout=30,
                publish_dir=checkpoint_root,
                set_name="throughput",
                persist_after_resume=way == NEW,
                stages=stages if way == NEW else SEQUENTIAL_STAGES,
            )
            if not result.ok:
                raise SystemExit(f"checkpoint failed: {result.reason}: {result.message}")
            run.pauses.append(result.durations.pause_seconds)
            run.durable.append(result.durations.pause_seconds + result.durations.persist_seconds)
            run.prepares.append(result.durations.prepare_seconds)
            run.commits.append(result.durations.commit_seconds)
            # "prepare <role>: ..." starts a stage; the next message ends it
            for (at, message), (until, _) in itertools.pairwise(marks):
                if message.startswith("prepare ") and ":" in message:
                    role = message.split(":")[0].removeprefix("prepare ")
                    run.stages.setdefault(role, []).append(until - at)
            taken += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        if way is not None:
            group.start_soon(checkpoints)
        results = await client.run_all(specs)
        run.seconds = time.perf_counter() - started
        finished.set()
    failed = [r for r in results if isinstance(r, EpisodeFailed)]
    if failed:
        raise SystemExit(f"{len(failed)} episodes failed, first: {failed[0]}")
    run.episodes = len(results)
    run.reward_sum = sum(r.reward for r in results if not isinstance(r, EpisodeFailed))
    return run


async def bench(args: argparse.Namespace, root: Path) -> None:
    extra = {Role.MODEL: ["--token-latency-ms", str(args.token_latency_ms)]}
    order = [None, OLD, NEW, NEW, OLD, None] * args.pairs
    runs: list[Run] = []
    with servers(root, extra) as procs:
        urls = {role: url for (role, _), (url, _) in procs.items()}
        async with aiohttp.ClientSession() as control:
            for n, way in enumerate(order):
                run = await one_run(n, way, args, urls, root / "checkpoints", control)
                runs.append(run)
                kind = way or "without"
                print(
                    f"run {n} {kind:<8} {run.seconds:7.1f} s  {run.per_second:6.2f} episodes/s  "
                    f"{len(run.pauses)} checkpoints",
                    file=sys.stderr,
                )
    short = [n for n, run in enumerate(runs) if run.way and len(run.pauses) < MIN_CHECKPOINTS]
    if short:
        raise SystemExit(
            f"run(s) {short} with checkpoints took fewer than {MIN_CHECKPOINTS} (the run was "
            f"shorter than {MIN_CHECKPOINTS} intervals of {args.interval:g} s): nothing to "
            "compare; raise --episodes or lower --interval"
        )
    rewards = {round(run.reward_sum, 6) for run in runs}
    if len(rewards) != 1:
        raise SystemExit(f"runs of the same seeded episodes differ in rewards: {sorted(rewards)}")
    report(args, runs)
    unchanged_records(root / "checkpoints" / "throughput")
    await step_latency()


def unchanged_records(set_dir: Path) -> None:
    """Per participant, the records (and bytes) of each published checkpoint whose line is the
    same as in the run's checkpoint before it: what segment reuse would not write again."""
    root = set_dir.parent
    previous: dict[str, set[bytes]] = {}
    totals = {"records": 0, "bytes": 0, "same_records": 0, "same_bytes": 0}
    last_run = None
    # oldest first; the participants' records are where their manifest paths say (their set
    # directory is the servers' ROLLOUT_SET, not the set name the checkpoint is published under)
    for published in storage.published_checkpoints(root, set_dir.name):
        run = published.checkpoint_id.split("-")[0]
        if run != last_run:
            previous, last_run = {}, run
        for participant in published.participants:
            instance_dir = (root / participant.manifest_path).parent
            manifest = storage.read_manifest(instance_dir)
            lines = (instance_dir / manifest.records_file).read_bytes().splitlines()
            before = previous.get(participant.instance)
            if before is not None:
                same = [line for line in lines if line in before]
                totals["records"] += len(lines)
                totals["bytes"] += sum(map(len, lines))
                totals["same_records"] += len(same)
                totals["same_bytes"] += sum(map(len, same))
            previous[participant.instance] = set(lines)
    if not totals["records"]:
        print("records unchanged between checkpoints: no consecutive checkpoints to compare\n")
        return
    print(
        "records unchanged since the run's previous checkpoint (segment reuse would skip them): "
        f"{totals['same_records'] / totals['records']:.1%} of records, "
        f"{totals['same_bytes'] / totals['bytes']:.1%} of bytes\n"
    )


async def step_latency(steps: int = 20_000) -> None:
    """p50/p99 of `EpisodeRuntime.step` (a step whose work is nothing) with encode-ahead and
    with the encoding switched off (`Episode.reached` a no-op, as before records were encoded
    ahead)."""
    transcript = {"messages": [{"role": "user", "content": "x" * 300}] * 2, "turn": 1}

    async def measure(encode: bool) -> list[float]:
        runtime = EpisodeRuntime()
        agent = runtime.begin("agent", 0, Boundary("model", transcript))
        model = runtime.begin("model", 0, Boundary("generate", {"text": "", "tokens": 0}))
        times: list[float] = []
        with contextlib.ExitStack() as stack:
            if not encode:
                stack.enter_context(patch.object(Episode, "reached", lambda self, kind: None))
            for n in range(steps):
                ep = agent if n % 2 else model
                if ep is agent:
                    boundary = Boundary("model", {**transcript, "turn": n})
                else:
                    text = str(model.boundary.state["text"])[-4000:] + "tok "
                    boundary = Boundary("generate", {"text": text, "tokens": n})

                async def run(boundary: Boundary = boundary) -> Boundary:
                    return boundary

                started = time.perf_counter()
                await runtime.step(ep, "step", StepMode.REPLAY, run)
                times.append(time.perf_counter() - started)
        return times

    without: list[float] = []
    with_: list[float] = []
    for encode in (False, True, True, False):  # ABBA, so warm-up and drift favour neither
        (with_ if encode else without).extend(await measure(encode))
    without.sort()
    with_.sort()

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1e6

    print("episode runtime step latency, microseconds (agent transcript / model generation):")
    print(f"{'':<28}{'p50':>10}{'p99':>10}")
    for label, values in (("encode-ahead off (before)", without), ("encode-ahead on", with_)):
        print(f"{label:<28}{pct(values, 0.5):>10.1f}{pct(values, 0.99):>10.1f}")
    print()


@dataclass
class WayColumn:
    """The runs with checkpoints taken one way, summed and against the runs without."""

    per_second: float
    checkpoints: int
    pause: list[float]
    prepare: list[float]
    stages: dict[str, list[float]]
    commit: list[float]
    durable: list[float]
    paused_share: float
    ratio: float
    pairs: list[float]
    """Each run with checkpoints against the run without them in its half of the block."""
    at_production: float


def rate(group: list[Run]) -> float:
    return sum(run.episodes for run in group) / sum(run.seconds for run in group)


def way_column(args: argparse.Namespace, with_: list[Run], without: list[Run]) -> WayColumn:
    ratio = rate(with_) / rate(without)
    pauses = [pause for run in with_ for pause in run.pauses]
    return WayColumn(
        per_second=rate(with_),
        checkpoints=len(pauses),
        pause=pauses,
        prepare=[p for r in with_ for p in r.prepares],
        stages={
            name: [d for r in with_ for d in r.stages[name]]
            for name in dict.fromkeys(name for r in with_ for name in r.stages)
        },
        commit=[c for r in with_ for c in r.commits],
        durable=[d for r in with_ for d in r.durable],
        paused_share=sum(pauses) / sum(r.seconds for r in with_),
        ratio=ratio,
        pairs=[w.per_second / o.per_second for w, o in zip(with_, without, strict=True)],
        at_production=1 - (1 - ratio) * args.interval / PRODUCTION_INTERVAL_S,
    )


def report(args: argparse.Namespace, runs: list[Run]) -> None:
    without = [run for run in runs if run.way is None]
    old, new = (way_column(args, [r for r in runs if r.way == way], without) for way in WAYS)
    print(
        f"\n{args.episodes} seeded episodes per run at concurrency {args.concurrency}, "
        f"model {args.token_latency_ms:g} ms/token, {len(runs)} runs (none, old, new, new, old, "
        f"none), a checkpoint every {args.interval:g} s in the runs with; old: records written "
        "inside the pause, new: persisted after the resume\n"
    )
    rows = [
        ("episodes/s with checkpoints", f"{old.per_second:.3f}", f"{new.per_second:.3f}"),
        ("checkpoints taken", f"{old.checkpoints}", f"{new.checkpoints}"),
        ("pause per checkpoint, median s", median(old.pause), median(new.pause)),
        ("  prepare (parking at boundaries)", median(old.prepare), median(new.prepare)),
        *(
            (
                f"    stage {name}",
                median(old.stages.get(name, [])),
                median(new.stages.get(name, [])),
            )
            for name in dict.fromkeys([*old.stages, *new.stages])
        ),
        ("  commit (the new way: the cut)", median(old.commit), median(new.commit)),
        ("start -> records durable, median s", median(old.durable), median(new.durable)),
        ("paused share of the runs with", f"{old.paused_share:.4f}", f"{new.paused_share:.4f}"),
        ("ratio with / without", f"{old.ratio:.4f}", f"{new.ratio:.4f}"),
        (
            "  each run against its none",
            " ".join(f"{r:.3f}" for r in old.pairs),
            " ".join(f"{r:.3f}" for r in new.pairs),
        ),
        (
            f"ratio scaled to a {PRODUCTION_INTERVAL_S:g} s interval",
            f"{old.at_production:.4f}",
            f"{new.at_production:.4f}",
        ),
    ]
    print(f"{'episodes/s without checkpoints':<40}{rate(without):>12.3f}")
    print(f"{'':<40}{'old way':>12}{'new way':>12}")
    for label, old_value, new_value in rows:
        print(f"{label:<40}{old_value:>12}{new_value:>12}")
    verdict = {
        way: "met" if column.ratio >= 0.99 else "missed"
        for way, column in zip(WAYS, (old, new), strict=True)
    }
    print(f"(target: with / without >= 0.99; old way {verdict[OLD]}, new way {verdict[NEW]})\n")
    print(
        json.dumps(
            {
                "without_per_s": rate(without),
                **{
                    way: {
                        "per_s": column.per_second,
                        "ratio": column.ratio,
                        "ratio_at_60s": column.at_production,
                        "checkpoints": column.checkpoints,
                        "pause_median_s": statistics.median(column.pause),
                        "durable_median_s": statistics.median(column.durable),
                        "run_ratios": column.pairs,
                    }
                    for way, column in zip(WAYS, (old, new), strict=True)
                },
            }
        )
    )


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.4f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between checkpoints")
    parser.add_argument("--pairs", type=int, default=1, help="blocks of 6 runs (ABCCBA)")
    parser.add_argument("--episodes", type=int, default=2000, help="episodes per run")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--token-latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
        anyio.run(bench, args, Path(tmp))


if __name__ == "__main__":
    main()
