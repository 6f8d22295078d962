"""Kill to resumed with and without a standby pod of the lost role (issue 22's target).

One devcluster (the process node), the operator as a process, the four reference servers as one
set with `restorePolicy: InPlace`, the model taking `--load-seconds` to load (default 30). For
each role, the role's pod is SIGKILLed `--kills` times (default 5) in each of two sets that
differ only in `spec.standby` (none, or one of every role), a checkpoint Ready before each kill.
Kill to resumed is the time from the SIGKILL to the set Ready under the next attempt, as this
process sees it polling the set (every 0.1 s); before each kill the set and its standbys are
Ready again, and the operator's spacing of recoveries (`decide.churn.spacing`: a set that keeps
losing pods has its next recovery held back; `recovery.windowSeconds` is 60 here) has passed,
so what is measured is the recovery, not the hold. Beside it, the operator's part:
`lastRecovery.durationSeconds`, from the loss seen by the operator to resumed (the rest is the
node reporting the dead container and the bench's polling). Prints the median and the spread
per role and variant; the target (printed, not asserted) is at most 1 s with a standby on the
process node.

    python bench/standby.py [--kills 5] [--load-seconds 30] [--roles environment,model]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rollout_operator.decide.churn import spacing

from devcluster.cluster import Cluster
from harness.objects import apply_crds, create_namespace, example_checkpoint, example_set
from harness.operatorprocess import OperatorProcess

ROLES = ("environment", "agent", "resources", "model")
WINDOW_S = 60
TARGET_S = 1.0
POLL_S = 0.1


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def get(cluster: Cluster, namespace: str, *args: str) -> dict[str, Any]:
    result = cluster.kubectl("get", *args, "-n", namespace, "-o", "json")
    found: dict[str, Any] = json.loads(result.stdout)
    return found


def condition(obj: dict[str, Any], kind: str) -> str | None:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item.get("type") == kind:
            return str(item.get("status"))
    return None


def wait(what: str, check: Callable[[], bool], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {limit_s:.0f}s")
        time.sleep(POLL_S)


def one_set(storage: Path, standby: bool, load_s: float) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "recovery": {
            "restorePolicy": "InPlace",
            "restoreTimeoutSeconds": 300,
            "windowSeconds": WINDOW_S,
            "maxRestarts": 50,
        }
    }
    if standby:
        spec["standby"] = dict.fromkeys(ROLES, 1)
    return example_set(storage, extra_args={"model": ["--load-seconds", str(load_s)]}, spec=spec)


def kill_to_resumed(
    cluster: Cluster, namespace: str, role: str, kills: int, standby: bool, number: list[int]
) -> tuple[list[float], list[float]]:
    name = "math-rl"
    seconds: list[float] = []
    operator: list[float] = []

    def rset() -> dict[str, Any]:
        return get(cluster, namespace, "rolloutset", name)

    def up() -> bool:
        obj = rset()
        spare = (obj.get("status") or {}).get("standby") or {}
        ready = condition(obj, "Ready") == "True" and not obj["status"].get("recovery")
        return ready and (not standby or spare.get("ready") == spare.get("desired"))

    def unheld() -> bool:
        """The churn spacing after the set's recent recoveries has passed."""
        now = datetime.now(UTC)
        starts = [
            datetime.fromisoformat(t.replace("Z", "+00:00"))
            for t in rset()["status"].get("recoveryStarts") or []
        ]
        recent = sorted(t for t in starts if now - t < timedelta(seconds=WINDOW_S))
        return not recent or now >= recent[-1] + spacing(len(recent)) + timedelta(seconds=1)

    for _ in range(kills):
        wait("the set (and its standbys) Ready", up, 600)
        wait("the recovery spacing passed", unheld, WINDOW_S + 10)
        number[0] += 1
        ckpt = f"before-kill-{number[0]}"
        cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=json.dumps(example_checkpoint(ckpt))
        )
        wait(
            f"checkpoint {ckpt} Ready",
            lambda c=ckpt: (
                condition(get(cluster, namespace, "rolloutcheckpoint", c), "Ready") == "True"
            ),
            120,
        )
        obj = rset()
        attempt = int(obj["status"]["attempt"])
        [pod] = [p["pod"] for p in obj["status"]["participants"] if p["role"] == role]
        started = time.monotonic()
        cluster.kill_pod(namespace, pod)

        def resumed(a: int = attempt) -> bool:
            o = rset()
            return int(o["status"].get("attempt") or 0) > a and condition(o, "Ready") == "True"

        wait(f"resumed after the {role} pod was killed", resumed, 600)
        seconds.append(time.monotonic() - started)
        last = rset()["status"].get("lastRecovery") or {}
        operator.append(float(last.get("durationSeconds") or 0.0))
        say(
            f"{'standby' if standby else 'none'} {role}: {seconds[-1]:.2f}s "
            f"(operator {operator[-1]:.2f}s, phases {last.get('phaseSeconds')}) "
            f"adopted={last.get('adopted') or []}"
        )
    return seconds, operator


Results = dict[tuple[str, bool], tuple[list[float], list[float]]]


def measure(args: argparse.Namespace, work: Path) -> Results:
    results: Results = {}
    with Cluster.start(work / "devcluster", timeout=180) as cluster:
        apply_crds(cluster)
        for standby in (False, True):
            namespace = f"bench-standby-{'on' if standby else 'off'}"
            create_namespace(cluster, namespace)
            operator = OperatorProcess(
                cluster.kubeconfig, [namespace], work / f"operator-{namespace}.log"
            )
            operator.start()
            try:
                operator.wait_live(60)
                storage = work / namespace
                storage.mkdir()
                obj = one_set(storage, standby, args.load_seconds)
                cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))
                number = [0]
                for role in args.roles:
                    results[(role, standby)] = kill_to_resumed(
                        cluster, namespace, role, args.kills, standby, number
                    )
            finally:
                cluster.kubectl("delete", "rolloutset", "--all", "-n", namespace, check=False)
                operator.stop()
    return results


def _spread(got: list[float]) -> str:
    return f"{statistics.median(got):.2f} ({min(got):.2f}-{max(got):.2f})" if got else "-"


def table(results: Results, roles: Sequence[str]) -> list[str]:
    lines = [
        "| role | no standby: kill to resumed s | operator's part s "
        "| standby: kill to resumed s | operator's part s | target |",
        "|---|---|---|---|---|---|",
    ]
    for role in roles:
        cells = []
        for standby in (False, True):
            wall, operator = results.get((role, standby), ([], []))
            cells += [_spread(wall), _spread(operator)]
        with_standby = results.get((role, True), ([], []))[0]
        met = bool(with_standby) and statistics.median(with_standby) <= TARGET_S
        verdict = "met" if met else "missed"
        lines.append(f"| {role} | {' | '.join(cells)} | <= {TARGET_S:g} s: {verdict} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--load-seconds", type=float, default=30.0)
    parser.add_argument("--roles", default=",".join(ROLES))
    args = parser.parse_args(argv)
    args.roles = [r for r in args.roles.split(",") if r]
    with tempfile.TemporaryDirectory(prefix="bench-standby-") as tmp:
        results = measure(args, Path(tmp))
    print(f"Kill to resumed on the process node, {args.kills} kills per role, model load "
          f"{args.load_seconds:g} s, restorePolicy InPlace")  # fmt: skip
    print("\n".join(table(results, args.roles)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
