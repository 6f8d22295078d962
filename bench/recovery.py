"""What turn-level recovery saves: the operator's restore against a restart from scratch.

One devcluster, the same workload twice (same episodes, same seed, same checkpoint taken at the
same point, the model pod SIGKILLed at the same point: once a quarter of the episodes finished
and the checkpoint is Ready, while the model has generations in flight):

  (a) `recovery.targetLevel: turn`: the operator restores the checkpoint into attempt 2 and
      every episode continues from its last boundary;
  (b) `recovery.targetLevel: sibling`: fresh pods only, so every unfinished episode is run
      again from its first turn (what a Deployment or JobSet restart gives).

Prints a table (no assertions): steps redone, model tokens generated again and the model-busy
seconds they cost, wall time until every episode finished, and the ratio a/b; then the
recovery timeline of both runs. The target is steps redone (a) at most 5% of (b)'s.

How "redone" is counted (see `harness.demo.measure_redone`): every episode step has a
unique name (`seed`, `invoke_agent`, `verify` on the environment, `model@<turn>` and
`tool@<turn>` on the agent), so each completion of a name beyond the first is a step done
again. Tokens generated again are the tokens a request had generated before the loss that the
restored checkpoint did not keep (its cut prefixes and held responses), for the requests that
were generated again after it. Counters come from each pod's /stats, polled every 0.2 s, so a
dying pod's last fraction of a second may be missed (in both runs alike).

    python bench/recovery.py [--episodes 48] [--seed 7] [--token-latency-ms 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

from devcluster.cluster import Cluster
from harness.demo import (
    RECOVERY_STEPS,
    Scenario,
    ScenarioReport,
    apply_crds,
    run_scenario,
)


def _ratio(a: float, b: float) -> str:
    return "-" if b == 0 else f"{a / b:.1%}"


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def table(turn: ScenarioReport, sibling: ScenarioReport) -> list[str]:
    latency = turn.scenario.token_latency_ms / 1000

    def row(name: str, a: float, b: float, fmt: str = "{:.0f}", ratio: bool = True) -> str:
        shown_a, shown_b = fmt.format(a), fmt.format(b)
        return (
            f"| {name:<38} | {shown_a:>12} | {shown_b:>12} | {_ratio(a, b) if ratio else '':>8} |"
        )

    gaps = [r.timeline.since("killed", "checkpoint_ready") or 0.0 for r in (turn, sibling)]
    lines = [
        f"recovery after a SIGKILL of the model pod: {turn.scenario.episodes} episodes "
        f"({turn.scenario.concurrency} at a time), seed {turn.scenario.seed}, "
        f"{turn.scenario.token_latency_ms:g} ms per token; killed {gaps[0]:.2f}s (a) and "
        f"{gaps[1]:.2f}s (b) after the checkpoint was "
        + ("published (Ready=True)" if turn.scenario.kill_at == "published" else "done"),
        "",
        f"| {'':<38} | {'(a) turn':>12} | {'(b) scratch':>12} | {'a/b':>8} |",
        f"|{'-' * 40}|{'-' * 14}|{'-' * 14}|{'-' * 10}|",
        row(
            "episodes unfinished when the pod died",
            turn.redone.rerun,
            sibling.redone.rerun,
            ratio=False,
        ),
        row(
            "  continued from the checkpoint",
            len(turn.continued),
            len(sibling.continued),
            ratio=False,
        ),
        row(
            "  restarted from their first step",
            len(turn.restarted),
            len(sibling.restarted),
            ratio=False,
        ),
        row("steps redone", turn.redone.steps, sibling.redone.steps),
        row("model tokens generated again", turn.redone.tokens, sibling.redone.tokens),
        row(
            "model-busy seconds redone",
            turn.redone.tokens * latency,
            sibling.redone.tokens * latency,
            "{:.2f}",
        ),
        row("wall time to finish (s)", turn.wall_seconds, sibling.wall_seconds, "{:.1f}"),
        row("episodes failed", len(turn.failed), len(sibling.failed), ratio=False),
        "",
        "recovery timeline, seconds after the kill:",
        f"| {'':<30} | {'(a) turn':>10} | {'(b) scratch':>11} |",
        f"|{'-' * 32}|{'-' * 12}|{'-' * 13}|",
    ]
    for key, label in RECOVERY_STEPS[1:]:
        a, b = turn.timeline.since(key), sibling.timeline.since(key)
        shown_a = "-" if a is None else f"{a:.2f}"
        shown_b = "-" if b is None else f"{b:.2f}"
        lines.append(f"| {label:<30} | {shown_a:>10} | {shown_b:>11} |")
    for report, label in ((turn, "(a)"), (sibling, "(b)")):
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(report.redone.by_step.items()))
        lines.insert(-0, f"steps redone {label} by kind: {kinds or 'none'}")
    target = "met" if turn.redone.steps <= 0.05 * sibling.redone.steps else "NOT met"
    lines += [
        "",
        f"steps redone a/b = {_ratio(turn.redone.steps, sibling.redone.steps)} "
        f"(target at most 5%: {target})",
    ]
    return lines


async def _both(cluster: Cluster, root: Path, args: argparse.Namespace) -> list[ScenarioReport]:
    reports = []
    for level in ("turn", "sibling"):
        scenario = Scenario(
            namespace=f"bench-{level}",
            workdir=root / level,
            episodes=args.episodes,
            seed=args.seed,
            target_level=level,
            token_latency_ms=args.token_latency_ms,
            kill_at=args.kill_at,
            kill_delay_s=args.kill_delay,
            delete_after=True,
        )
        _say(f"run ({'a' if level == 'turn' else 'b'}): recovery.targetLevel {level}")
        reports.append(await run_scenario(cluster, scenario, _say))
        # The finished run's pods would compete for the two cores with the next run.
        cluster.kubectl("delete", "namespace", scenario.namespace, "--wait=true", "--timeout=60s")
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--kill-at",
        choices=["published", "resumed"],
        default="published",
        help="kill once the checkpoint is published (Ready=True), or once its participants "
        "resumed and the model generates again",
    )
    parser.add_argument(
        "--kill-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="kill the model this long after the checkpoint is Ready (work since then is lost)",
    )
    parser.add_argument(
        "--token-latency-ms",
        type=float,
        default=50.0,
        help="model time per token; episodes last a few seconds at the default",
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    started = time.monotonic()
    cluster = Cluster.start(root / "cluster")
    try:
        apply_crds(cluster)
        turn, sibling = anyio.run(_both, cluster, root, args)
    finally:
        cluster.stop()
    for line in table(turn, sibling):
        print(line)
    print(f"\n(bench took {time.monotonic() - started:.0f}s; operator logs and records in {root})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
