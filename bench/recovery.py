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

How "redone" is counted (see `harness.measures.measure_redone`): every episode step has a
unique name (`seed`, `invoke_agent`, `verify` on the environment, `model@<turn>` and
`tool@<turn>` on the agent), so each completion of a name beyond the first is a step done
again. Tokens generated again are the tokens a request had generated before the loss that the
restored checkpoint did not keep (its cut prefixes and held responses), for the requests that
were generated again after it. Counters come from each pod's /stats, polled every 0.2 s, so a
dying pod's last fraction of a second may be missed (in both runs alike).

A second comparison keeps warm model pods: the environment pod is SIGKILLed while the model
takes `--load-seconds` (default 30) to load its weights, once with `restorePolicy: Recreate`
(every pod replaced, the model loads again) and once with `InPlace` (only the environment pod
replaced, the model pod kept). It prints the time from the kill to resumed and the model tokens
generated again in each, as measured from the servers' `/stats` (above) and as the operator
reports them in `status.lastRecovery` (the participants' own counts: docs/operations.md, "Work
lost in a recovery"); the target is InPlace at least `--load-seconds` shorter.

    python bench/recovery.py [--episodes 48] [--seed 7] [--token-latency-ms 20]
                             [--load-seconds 30] [--skip-policies | --only-policies]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

from devcluster.cluster import Cluster
from harness.demo import Scenario, ScenarioReport, run_scenario
from harness.measures import RECOVERY_STEPS
from harness.objects import apply_crds


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


def policy_table(
    recreate: ScenarioReport, in_place: ScenarioReport, load_seconds: float
) -> list[str]:
    """Recreate against InPlace after the loss of a non-model pod, the model loading for
    `load_seconds`."""
    took = [r.timeline.since("resumed") for r in (recreate, in_place)]
    kept = [
        (r.final_set.get("status") or {}).get("lastRecovery") or {} for r in (recreate, in_place)
    ]

    def shown(value: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if value is None else fmt.format(value)

    def row(name: str, a: str, b: str) -> str:
        return f"| {name:<42} | {a:>10} | {b:>10} |"

    lines = [
        f"losing the {recreate.scenario.kill_role} pod with a model that loads for "
        f"{load_seconds:g}s: {recreate.scenario.episodes} episodes, seed {recreate.scenario.seed}",
        "",
        row("", "Recreate", "InPlace"),
        f"|{'-' * 44}|{'-' * 12}|{'-' * 12}|",
        row("kill -> resumed, set Ready (s)", shown(took[0]), shown(took[1])),
        row(
            "pods kept / replaced",
            f"{kept[0].get('kept', '-')} / {kept[0].get('replaced', '-')}",
            f"{kept[1].get('kept', '-')} / {kept[1].get('replaced', '-')}",
        ),
        row(
            "model tokens regenerated (measured)",
            str(recreate.redone.tokens),
            str(in_place.redone.tokens),
        ),
        row("steps redone (measured)", str(recreate.redone.steps), str(in_place.redone.steps)),
        row(
            "model tokens regenerated (lastRecovery)",
            str(kept[0].get("modelTokensGeneratedAgain", "-")),
            str(kept[1].get("modelTokensGeneratedAgain", "-")),
        ),
        row(
            "model tokens kept (lastRecovery)",
            str(kept[0].get("modelTokensKept", "-")),
            str(kept[1].get("modelTokensKept", "-")),
        ),
        row(
            "steps redone / kept (lastRecovery)",
            f"{kept[0].get('stepsRedone', '-')} / {kept[0].get('stepsKept', '-')}",
            f"{kept[1].get('stepsRedone', '-')} / {kept[1].get('stepsKept', '-')}",
        ),
        row(
            "work uncounted (lastRecovery)",
            ",".join(kept[0].get("workUncounted", [])) or "-",
            ",".join(kept[1].get("workUncounted", [])) or "-",
        ),
        row("wall time to finish (s)", shown(recreate.wall_seconds), shown(in_place.wall_seconds)),
        row("episodes failed", str(len(recreate.failed)), str(len(in_place.failed))),
    ]
    if took[0] is not None and took[1] is not None:
        saved = took[0] - took[1]
        target = "met" if saved >= load_seconds else "NOT met"
        lines += [
            "",
            f"InPlace saved {saved:.1f}s (target: at least the {load_seconds:g}s load: {target})",
        ]
    return lines


async def _policies(cluster: Cluster, root: Path, args: argparse.Namespace) -> list[ScenarioReport]:
    reports = []
    for policy in ("Recreate", "InPlace"):
        scenario = Scenario(
            namespace=f"bench-{policy.lower()}",
            workdir=root / policy.lower(),
            episodes=args.episodes,
            seed=args.seed,
            token_latency_ms=args.token_latency_ms,
            restore_policy=policy,
            load_seconds=args.load_seconds,
            kill_role="environment",
            kill_at="resumed",
            delete_after=True,
            timeout_s=240.0 + 2 * args.load_seconds,
        )
        _say(
            f"run: restorePolicy {policy}, environment pod lost, model load {args.load_seconds:g}s"
        )
        reports.append(await run_scenario(cluster, scenario, _say))
        cluster.kubectl("delete", "namespace", scenario.namespace, "--wait=true", "--timeout=60s")
    return reports


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
    parser.add_argument(
        "--load-seconds",
        type=float,
        default=30.0,
        help="the model's simulated weight loading in the Recreate/InPlace comparison",
    )
    parser.add_argument(
        "--skip-policies", action="store_true", help="skip the Recreate/InPlace comparison"
    )
    parser.add_argument(
        "--only-policies", action="store_true", help="run only the Recreate/InPlace comparison"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    started = time.monotonic()
    cluster = Cluster.start(root / "cluster")
    try:
        apply_crds(cluster)
        levels = None if args.only_policies else anyio.run(_both, cluster, root, args)
        policies = None if args.skip_policies else anyio.run(_policies, cluster, root, args)
    finally:
        cluster.stop()
    if levels is not None:
        for line in table(*levels):
            print(line)
    if policies is not None:
        print()
        for line in policy_table(*policies, args.load_seconds):
            print(line)
    print(f"\n(bench took {time.monotonic() - started:.0f}s; operator logs and records in {root})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
