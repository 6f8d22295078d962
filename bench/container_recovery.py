"""The recovery timeline on the container node next to the process node, in one run.

The same scenario (`harness.demo.run_scenario`: the example RolloutSet, episodes, a checkpoint
while they run, the model SIGKILLed with generations in flight, turn-level recovery under
attempt 2) runs twice, one cluster after the other so they never share the two cores:

  (p) the process node: the servers as host processes of the node agent, the operator a process;
  (c) the container node: a real kubelet runs the servers as containers of the project's image
      (containerd, runc, CNI bridge), the operator installed by Helm as a pod of it.

Prints (no assertions) the seconds from the kill to each step a user sees (loss detected, fresh
pods Ready, records restored, resumed and Ready), the container start share (fresh pods Ready
minus loss detected, over kill to resumed: the part of the recovery the node spends starting
pods), and the ratio c/p for each step.

With `--standby`, the container node's scenario runs twice more, once with a model standby
(`spec.standby: {model: 1}`, restorePolicy InPlace) and once without it under InPlace, and
prints kill to resumed for both (the target: at most 2 s with a standby).

    python bench/container_recovery.py [--episodes 32] [--seed 7] [--token-latency-ms 20]
                                       [--standby]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

from devcluster.cluster import Cluster
from devcluster.image import ProjectImage, build_project_image
from harness.demo import Scenario, ScenarioReport, run_scenario
from harness.measures import RECOVERY_STEPS
from harness.objects import apply_crds


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _run(
    root: Path,
    image: ProjectImage | None,
    args: argparse.Namespace,
    *,
    name: str | None = None,
    standby: dict[str, int] | None = None,
    restore_policy: str = "Recreate",
) -> ScenarioReport:
    name = name or ("process" if image is None else "containers")
    started = time.monotonic()
    if image is None:
        cluster = Cluster.start(root / name)
    else:
        cluster = Cluster.start(
            root / name, node_runtime="containerd", images=[image.archive], timeout=180.0
        )
    _say(f"{name}: devcluster up in {time.monotonic() - started:.1f}s")
    try:
        apply_crds(cluster)
        scenario = Scenario(
            namespace=f"bench-{name}",
            workdir=root / f"{name}-run",
            episodes=args.episodes,
            seed=args.seed,
            token_latency_ms=args.token_latency_ms,
            kill_at="published",
            delete_after=True,
            operator_image=image,
            standby=standby,
            restore_policy=restore_policy,
        )
        return anyio.run(run_scenario, cluster, scenario, _say)
    finally:
        cluster.stop()


def _share(report: ScenarioReport) -> float | None:
    ready = report.timeline.since("pods_ready")
    detected = report.timeline.since("loss_detected")
    resumed = report.timeline.since("resumed")
    if ready is None or detected is None or not resumed:
        return None
    return (ready - detected) / resumed


def table(process: ScenarioReport, containers: ScenarioReport) -> list[str]:
    lines = [
        f"{'seconds after the kill':<30} {'process node':>13} {'container node':>15} {'c/p':>7}"
    ]
    for key, label in RECOVERY_STEPS[1:]:
        p = process.timeline.since(key)
        c = containers.timeline.since(key)
        ratio = f"{c / p:.2f}" if p and c is not None else "-"
        p_text = f"{p:.2f}" if p is not None else "-"
        c_text = f"{c:.2f}" if c is not None else "-"
        lines.append(f"{label:<30} {p_text:>13} {c_text:>15} {ratio:>7}")
    shares = [_share(process), _share(containers)]
    shown = [f"{s:.0%}" if s is not None else "-" for s in shares]
    lines.append(f"{'pod start share of recovery':<30} {shown[0]:>13} {shown[1]:>15}")
    for name, report in (("process", process), ("container", containers)):
        lines.append(
            f"{name} node: {len(report.results)} episodes finished, {len(report.failed)} "
            f"failed, {len(report.continued)} continued from the checkpoint"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--token-latency-ms", type=float, default=20.0)
    parser.add_argument("--standby", action="store_true", help="only the standby comparison")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-container-recovery-"))
    root.chmod(0o755)  # the container node's servers (user 10001) write under it
    started = time.monotonic()
    build = build_project_image()
    _say(f"image {build.image.name} ({'cached' if build.was_cached else 'built'})")
    if args.standby:
        plain = _run(root, build.image, args, name="inplace", restore_policy="InPlace")
        spare = _run(
            root, build.image, args, name="standby", standby={"model": 1}, restore_policy="InPlace"
        )
        print(f"{'container node, model killed (InPlace)':<40} {'no standby':>11} {'standby':>9}")
        for key, label in RECOVERY_STEPS[1:]:
            cells = [plain.timeline.since(key), spare.timeline.since(key)]
            shown = [f"{c:.2f}" if c is not None else "-" for c in cells]
            print(f"{label:<40} {shown[0]:>11} {shown[1]:>9}")
        resumed = spare.timeline.since("resumed")
        met = resumed is not None and resumed <= 2.0
        print(f"target: kill to resumed at most 2 s with a standby: {'met' if met else 'missed'}")
    else:
        process = _run(root, None, args)
        containers = _run(root, build.image, args)
        for line in table(process, containers):
            print(line)
    print(f"\n(bench took {time.monotonic() - started:.0f}s; logs and records in {root})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
