"""API requests and operator CPU per checkpoint, by verb and resource (targets: docs/operations.md,
"API requests and operator CPU per checkpoint").

What one RolloutCheckpoint costs the API server and the operator, for a 4-pod set (4 roles x 1
fleet pod) and a 16-pod set (4 roles x 4), `--checkpoints` checkpoints each (median and max):

- **to Ready**: the operator's requests from the checkpoint's creation until the bench's watch
  sees it Ready, by verb and resource. The set is otherwise idle, so every request in that
  window is the checkpoint's.
- **after Ready**: what the checkpoint causes after it is Ready (the set pass writing
  `latestCheckpoint`, pod hints), until the operator's counters stop moving for
  `QUIET_S` seconds (with a deadline). The cut between the two is read right after the
  bench's watch sees Ready, so requests the operator sends in those milliseconds land before
  it: the split varies by a few requests between checkpoints, the sum much less.
- **pod hints**: `patch pods` (the `latest-checkpoint` pod annotations), counted apart from
  the total, as the issue's target does. Watches are left out of the total too: Kopf re-opens
  each of its watches every `--watch-timeout-seconds` whatever the checkpoint does (they keep
  their rows).
- **operator CPU**: user + system seconds of the operator process (/proc/<pid>/stat) from the
  creation until Ready, and until the counters settled.

How the requests are counted: the operator runs as its own ServiceAccount and
`harness.apiaccounting` installs one API Priority and Fairness FlowSchema per (verb, resource)
matching only it, plus catch-alls (`other`) so nothing it sends goes uncounted (Events and
Kopf's own requests included); the API server's
`apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}` is then its own count. The
pods are fleet participants (devcluster's in-process test double, see docs/devcluster.md); the
control plane, the operator and the coordinator are real. Each set is created, waits Ready and
settles before its first checkpoint; each checkpoint starts from settled counters.

`--baseline-ref REF` also measures the operator of another commit (e.g. the one before a
change) in the same run: a temporary `git worktree` of REF, its operator run with PYTHONPATH on
that worktree's operator/, protocol/ and servers/ and its CRDs applied, on a devcluster of its
own; the worktree is removed afterwards. Targets are printed beside the numbers, not asserted.

    python bench/checkpoint_requests.py [--checkpoints 3] [--baseline-ref REF] [--keep-log]
"""

from __future__ import annotations

import argparse
import asyncio
import filecmp
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import httpx
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import watch
from rollout_operator.model.api import GROUP, ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL, VERSION

from devcluster.cluster import Cluster
from devcluster.config import NodeSpec
from devcluster.kube import open_api
from harness.apiaccounting import OTHER, VERBS, Accounting, admin_http, difference, usage
from harness.fleet import fleet_checkpoint, fleet_set
from harness.objects import apply_crds, create_namespace, is_true
from harness.operatorprocess import OperatorProcess, sigterm_as_interrupt

REPO: Final = Path(__file__).resolve().parents[1]
NAMESPACE: Final = "bench"
ACCOUNTING: Final = Accounting(NAMESPACE, "rollout-operator", "bench-operator")
SIZES: Final = (1, 4)
"""Replicas per role: 4 and 16 pods."""

QUIET_S: Final = 2.0
"""Counters unchanged this long: the operator has settled."""
POLL_S: Final = 0.25
SETTLE_LIMIT_S: Final = 30.0
SET_READY_LIMIT_S: Final = 120.0
CHECKPOINT_LIMIT_S: Final = 60.0
OPERATOR_LIVE_LIMIT_S: Final = 60.0

TARGET_REQUESTS: Final = 10
"""Requests to Ready, pod hints and watches apart (docs/operations.md)."""
TARGET_CPU_16: Final = 0.04
"""Operator CPU seconds to Ready for the 16-pod set (docs/operations.md)."""
HINTS: Final = ("patch", "pods")
"""The pod hints (`latest-checkpoint` annotations), counted apart."""

Key = tuple[str, str]


def say(message: str) -> None:
    print(
        f"[checkpoint-requests {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True
    )


# --- one measured checkpoint ---------------------------------------------------------------------


@dataclass
class Measured:
    name: str
    outcome: str
    """`Ready`, `Failed <reason>` or `no end within N s`."""
    seconds: float
    """Creation -> Ready seen on the bench's watch."""
    to_ready: Counter[Key]
    after_ready: Counter[Key]
    cpu_to_ready: float
    cpu_total: float
    settled: bool
    """False when the counters still moved at the settle deadline."""

    @property
    def ready(self) -> bool:
        return self.outcome == "Ready"


@dataclass
class Series:
    """The checkpoints of one set size under one operator."""

    variant: str
    replicas: int
    checkpoints: list[Measured] = field(default_factory=list)
    note: str = ""

    @property
    def column(self) -> str:
        return f"{4 * self.replicas} pods" + (f" {self.variant}" if self.variant else "")

    @property
    def ready(self) -> list[Measured]:
        return [m for m in self.checkpoints if m.ready]


@dataclass(frozen=True)
class Variant:
    """An operator to measure: a label and the checkout its code and CRDs come from."""

    label: str
    root: Path
    ref: str


# --- the operator's counters ---------------------------------------------------------------------


@dataclass
class Meter:
    http: httpx.AsyncClient
    pid: int

    async def read(self) -> Counter[Key]:
        return await ACCOUNTING.read_async(self.http)

    def cpu(self) -> float:
        return usage(self.pid).cpu_seconds

    async def settle(self, limit: float = SETTLE_LIMIT_S) -> tuple[Counter[Key], bool]:
        """Polls the counters until they have not moved for `QUIET_S`; returns the last read
        and whether they settled before `limit`."""
        deadline = time.monotonic() + limit
        last = await self.read()
        changed = time.monotonic()
        while True:
            await asyncio.sleep(POLL_S)
            now = await self.read()
            if now != last:
                last, changed = now, time.monotonic()
            elif time.monotonic() - changed >= QUIET_S:
                return last, True
            if time.monotonic() >= deadline:
                return last, False


async def wait_for(
    custom: k8s.CustomObjectsApi,
    plural: str,
    name: str,
    predicate: Callable[[dict[str, Any]], bool],
    limit: float,
) -> dict[str, Any]:
    """The first version of the object satisfying `predicate`, seen on a watch (a watch with no
    resourceVersion starts with the current object); TimeoutError after `limit`."""
    deadline = time.monotonic() + limit
    async with asyncio.timeout(limit):
        while True:
            stream = watch.Watch().stream(
                custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                NAMESPACE,
                plural,
                field_selector=f"metadata.name={name}",
                timeout_seconds=max(1, math.ceil(deadline - time.monotonic())),
            )
            try:
                async with stream:
                    async for event in stream:
                        obj = event["object"]
                        if event["type"] in ("ADDED", "MODIFIED") and predicate(obj):
                            return dict(obj)
            except (OSError, aiohttp.ClientError) as error:
                say(f"watch of {plural}/{name} broke ({error!r}); resuming")
                await asyncio.sleep(0.2)


def _ended(obj: dict[str, Any]) -> bool:
    return is_true(obj, "Ready") or is_true(obj, "Failed")


def _set_ready(obj: dict[str, Any]) -> bool:
    return is_true(obj, "Ready") and (obj.get("status") or {}).get("attempt") == 1


def _failure(obj: dict[str, Any]) -> str:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item.get("type") == "Failed":
            return f"Failed {item.get('reason', '')}"
    return "Failed"


# --- the run -------------------------------------------------------------------------------------


async def _measure_checkpoint(
    custom: k8s.CustomObjectsApi, meter: Meter, set_name: str, name: str
) -> Measured:
    before, settled = await meter.settle()
    if not settled:
        say(f"{set_name}: counters still moving after {SETTLE_LIMIT_S:.0f} s; measuring anyway")
    cpu0 = meter.cpu()
    t0 = time.monotonic()
    await custom.create_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, ROLLOUT_CHECKPOINT_PLURAL, fleet_checkpoint(name, set_name)
    )
    try:
        obj = await wait_for(custom, ROLLOUT_CHECKPOINT_PLURAL, name, _ended, CHECKPOINT_LIMIT_S)
        outcome = "Ready" if is_true(obj, "Ready") else _failure(obj)
    except TimeoutError:
        outcome = f"no end within {CHECKPOINT_LIMIT_S:.0f} s"
    seconds = time.monotonic() - t0
    at_ready = await meter.read()
    cpu1 = meter.cpu()
    after, settled = await meter.settle()
    cpu2 = meter.cpu()
    return Measured(
        name,
        outcome,
        seconds,
        difference(at_ready, before),
        difference(after, at_ready),
        cpu1 - cpu0,
        cpu2 - cpu0,
        settled,
    )


async def _measure_operator(
    cluster: Cluster, variant: Variant, pid: int, storage: Path, checkpoints: int
) -> list[Series]:
    found: list[Series] = []
    async with open_api(cluster.kubeconfig) as api, admin_http(cluster) as http:
        custom = k8s.CustomObjectsApi(api)
        meter = Meter(http, pid)
        _, settled = await meter.settle(60.0)
        say(f"{variant.label}: operator started, counters {'settled' if settled else 'moving'}")
        for replicas in SIZES:
            series = Series(variant.label, replicas)
            found.append(series)
            set_name = f"set-{4 * replicas}"
            body = fleet_set(set_name, storage, replicas=replicas)
            # no retention inside the series: every checkpoint of it does the same work
            body["spec"]["checkpointPolicy"]["keepLatest"] = checkpoints + 1
            await custom.create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, ROLLOUT_SET_PLURAL, body
            )
            try:
                await wait_for(custom, ROLLOUT_SET_PLURAL, set_name, _set_ready, SET_READY_LIMIT_S)
            except TimeoutError:
                series.note = f"set not Ready within {SET_READY_LIMIT_S:.0f} s"
                say(f"{variant.label}: {set_name} {series.note}; skipped")
                continue
            for i in range(checkpoints):
                measured = await _measure_checkpoint(custom, meter, set_name, f"{set_name}-{i}")
                series.checkpoints.append(measured)
                say(
                    f"{variant.label}: {set_name} checkpoint {i}: {measured.outcome} after "
                    f"{measured.seconds:.2f} s, {_total(measured.to_ready)} requests "
                    f"(+{_total(measured.after_ready)} after), operator CPU "
                    f"{measured.cpu_total:.3f} s"
                )
    return found


def _measure_variant(variant: Variant, work: Path, args: argparse.Namespace) -> list[Series]:
    """One devcluster and one operator for the variant: every set size, then both down."""
    say(f"{variant.label}: devcluster up (operator from {variant.ref})")
    node = NodeSpec(name="bench-0", cpu="1000", memory="4Ti", pods=110)
    with Cluster.start(work / "devcluster", nodes=[node], timeout=180) as cluster:
        create_namespace(cluster, NAMESPACE)
        apply_crds(cluster, variant.root / "crds")
        ACCOUNTING.install(cluster, work)
        kubeconfig = ACCOUNTING.token_kubeconfig(cluster, work / "operator.kubeconfig")
        storage = work / "checkpoints"
        storage.mkdir()
        environment = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        environment["PYTHONPATH"] = os.pathsep.join(
            str(variant.root / part) for part in ("protocol", "operator", "servers", ".")
        )
        operator = OperatorProcess(
            kubeconfig,
            [NAMESPACE],
            work / "operator.log",
            args=["--standalone"],
            environment=environment,
            # older commits have no package entry point (it keeps kubernetes_asyncio out)
            module="rollout_operator"
            if (variant.root / "operator" / "rollout_operator" / "__main__.py").exists()
            else "rollout_operator.cli",
        )
        operator.start()
        try:
            operator.wait_live(OPERATOR_LIVE_LIMIT_S)
            assert operator.process is not None
            pid = operator.process.pid
            return asyncio.run(_measure_operator(cluster, variant, pid, storage, args.checkpoints))
        finally:
            operator.stop()
            if args.keep_log:
                print(operator.tail(80), file=sys.stderr)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()


def _describe_checkout() -> str:
    """This checkout, its commit, and whether the operator's code or CRDs differ from it."""
    head = _git("rev-parse", "--short=10", "HEAD")
    changed = _git("status", "--porcelain", "--", "operator", "protocol", "servers", "crds")
    return f"{REPO} at {head}" + (" with uncommitted changes" if changed else "")


def _crds_differ(a: Path, b: Path) -> bool:
    compared = filecmp.dircmp(a, b)
    return bool(compared.left_only or compared.right_only or compared.diff_files)


# --- the table -----------------------------------------------------------------------------------


def _total(counts: Counter[Key]) -> int:
    """Requests without the pod hints and without watches (Kopf re-opens each watch every
    `--watch-timeout-seconds`, whatever the checkpoint does; they still have rows of their own)."""
    return sum(v for k, v in counts.items() if k != HINTS and k[0] != "watch")


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _num(value: float, digits: int | None) -> str:
    """`digits` None: a count (a median of an even number of checkpoints may end in .5)."""
    if math.isnan(value):
        return "-"
    return f"{value:g}" if digits is None else f"{value:.{digits}f}"


def _count(key: Key) -> Callable[[Counter[Key]], float]:
    return lambda counts: counts[key]


def _lists(counts: Counter[Key]) -> float:
    return sum(v for (verb, _), v in counts.items() if verb == "list")


def _order(key: Key) -> tuple[int, str, int]:
    verb, resource = key
    rank = VERBS.index(verb) if verb in VERBS else len(VERBS)
    return (0 if resource != OTHER else 1, resource, rank)


def table(all_series: Sequence[Series], checkpoints: int) -> list[str]:
    """One row per (verb, resource) and per summary figure; one column per (size, operator).
    A request cell is `to Ready + after Ready`, medians over the Ready checkpoints."""
    columns = list(all_series)
    keys: set[Key] = set()
    for series in columns:
        for m in series.ready:
            keys |= {k for k, v in (m.to_ready + m.after_ready).items() if v}

    def cell(series: Series, count: Callable[[Counter[Key]], float]) -> str:
        ready = series.ready
        if not ready:
            return "-"
        to = _median([count(m.to_ready) for m in ready])
        return f"{_num(to, None)} + {_num(_median([count(m.after_ready) for m in ready]), None)}"

    def totals(series: Series) -> str:
        ready = series.ready
        if not ready:
            return "-"
        to = [_total(m.to_ready) for m in ready]
        after = [_total(m.after_ready) for m in ready]
        return f"{_num(_median(to), None)} + {_num(_median(after), None)} (max {max(to)})"

    def cpu(series: Series) -> str:
        ready = series.ready
        if not ready:
            return "-"
        return (
            f"{_num(_median([m.cpu_to_ready for m in ready]), 3)} / "
            f"{_num(_median([m.cpu_total for m in ready]), 3)}"
        )

    def seconds(series: Series) -> str:
        times = [m.seconds for m in series.ready]
        return f"{_num(_median(times), 2)} / {_num(max(times, default=math.nan), 2)}"

    body: list[tuple[str, list[str], str] | None] = []  # None: a rule
    for key in sorted(keys, key=_order):
        verb, resource = key
        label = f"{verb} {resource}" + (" (pod hints)" if key == HINTS else "")
        body.append((label, [cell(s, _count(key)) for s in columns], ""))
    body += [
        None,
        (
            "total without pod hints, watches (max)",
            [totals(s) for s in columns],
            f"<= {TARGET_REQUESTS} to Ready",
        ),
        ("pod hints (patch pods)", [cell(s, _count(HINTS)) for s in columns], "<= 1 per pod"),
        ("LIST (any resource)", [cell(s, _lists) for s in columns], "0 to Ready"),
        (
            "operator CPU s: to Ready / with after",
            [cpu(s) for s in columns],
            f"<= {TARGET_CPU_16} (16 pods)",
        ),
        ("created -> Ready s (median / max)", [seconds(s) for s in columns], ""),
        ("checkpoints Ready", [f"{len(s.ready)}/{len(s.checkpoints)}" for s in columns], ""),
    ]
    width = max(
        [len(s.column) for s in columns] + [len(c) for r in body if r for c in r[1]], default=8
    )

    def row(label: str, cells: Sequence[str], target: str = "") -> str:
        return (
            f"| {label:<40} | " + " | ".join(f"{c:>{width}}" for c in cells) + f" | {target:<18} |"
        )

    rule = f"|{'-' * 42}|" + "|".join("-" * (width + 2) for _ in columns) + f"|{'-' * 20}|"
    lines = [
        f"requests per checkpoint: 'to Ready + after Ready', median of {checkpoints} checkpoints "
        "(API server's APF counters for the operator's ServiceAccount)",
        "",
        row("verb resource", [s.column for s in columns], "target"),
        rule,
        *(rule if r is None else row(*r) for r in body),
    ]
    notes: list[str] = []
    for series in columns:
        if series.note:
            notes.append(f"{series.column}: {series.note}")
        for m in series.checkpoints:
            if not m.ready:
                notes.append(f"{series.column}: {m.name} {m.outcome} (left out of the medians)")
            elif not m.settled:
                notes.append(
                    f"{series.column}: {m.name}: counters still moving {SETTLE_LIMIT_S:.0f} s "
                    "after Ready (its 'after Ready' is cut there)"
                )
    if any(key[1] == OTHER for s in columns for m in s.checkpoints for key in m.to_ready):
        notes.append(
            f"rows '{OTHER}': requests to resources not listed in harness.apiaccounting "
            "(add them there to see which)"
        )
    verdicts = _verdicts(columns)
    if verdicts:
        lines += ["", "targets (printed, not asserted):", *(f"  {v}" for v in verdicts)]
    if notes:
        lines += ["", *notes]
    return lines


def _verdicts(columns: Sequence[Series]) -> list[str]:
    found = []
    for series in columns:
        ready = series.ready
        if not ready:
            continue
        requests = max(_total(m.to_ready) for m in ready)
        lists = max(_lists(m.to_ready) for m in ready)
        parts = [
            f"requests {'ok' if requests <= TARGET_REQUESTS else 'MISSED'}",
            f"no LIST {'ok' if lists == 0 else 'MISSED'}",
        ]
        if series.replicas == 4:
            cpu = _median([m.cpu_total for m in ready])
            parts.append(f"CPU {'ok' if cpu <= TARGET_CPU_16 else 'MISSED'}")
        found.append(f"{series.column}: {', '.join(parts)}")
    return found


# --- main ----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints per set size")
    parser.add_argument(
        "--baseline-ref",
        metavar="REF",
        help="also measure the operator of this git commit (a temporary worktree of it)",
    )
    parser.add_argument("--keep-log", action="store_true", help="print the operators' log tails")
    args = parser.parse_args(argv)
    wall = time.monotonic()
    all_series: list[Series] = []
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="bench-ckpt-req-") as tmp:
        work = Path(tmp)
        variants: list[Variant] = []
        baseline: Path | None = None
        try:
            if args.baseline_ref:
                commit = _git("rev-parse", "--verify", f"{args.baseline_ref}^{{commit}}")
                _git("worktree", "add", "--detach", str(work / "baseline-src"), commit)
                baseline = work / "baseline-src"
                variants.append(Variant("base", baseline, f"{args.baseline_ref} ({commit[:10]})"))
                if _crds_differ(baseline / "crds", REPO / "crds"):
                    say("the baseline's CRDs differ from this checkout's: its own are applied")
            variants.append(Variant("current" if baseline else "", REPO, _describe_checkout()))
            for variant in variants:
                folder = work / (variant.label or "current")
                folder.mkdir()
                all_series += _measure_variant(variant, folder, args)
        except KeyboardInterrupt:
            print("interrupted: the table has what finished", file=sys.stderr)
        finally:
            if baseline is not None:
                _git("worktree", "remove", "--force", str(baseline))
        # sizes side by side: 4 pods of every operator, then 16
        all_series.sort(key=lambda s: (s.replicas, [v.label for v in variants].index(s.variant)))
        print("\n".join(table(all_series, args.checkpoints)))
        for variant in variants:
            print(f"{variant.label or 'operator'}: {variant.ref}")
    print(f"\nbench wall time {time.monotonic() - wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
