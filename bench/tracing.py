"""What tracing costs a checkpoint: the pause with traces exported against tracing off, one run.

Two groups of the four reference servers run on loopback (`rollout-server <role>`, started as
bench/protocol_pause.py starts them): one with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an
OTLP/HTTP receiver in this process (`harness.otlp`, decoding every export request, so the
export is real work on both ends), one without it. Checkpoints are taken by `rollout-coordinate
checkpoint` processes, alternately against each group, the coordinator with the endpoint set
for the traced group and without it for the other, so both sides of every call trace or none
does. The pause is what the coordinator measures (first prepare to resume done).

  off   no endpoint anywhere: the OpenTelemetry API's no-op tracer, no SDK imported
  on    the SDK's tracer provider, batch span processor and OTLP/HTTP exporter in all five
        processes; every call carries a traceparent; FastAPI's own server spans too

The servers hold no episodes here, so the pause is the protocol's own round trips and fsyncs:
tracing's work is per call, not per episode, so this is where its share is largest.

It also times, in this process (no provider installed), what the tracing code adds to a
protocol call when tracing is off: the API's no-op client span plus the header lookup, against
the same loop without them. And it checks that nothing was exported for the off checkpoints.

Prints tables; asserts nothing. Run: `.venv/bin/python bench/tracing.py [--repeats N]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from protocol_pause import TOKEN, cpu_seconds, servers
from rollout_protocol import Role, tracing

from harness.otlp import OtlpReceiver, otlp_receiver

COORDINATE = str(Path(sys.executable).with_name("rollout-coordinate"))
EXPORT: dict[str, str] = {}
"""The SDK's defaults (a batch every 5 s, or at 512 spans): what a user gets."""


def checkpoint(urls: dict[Role, str], root: Path, checkpoint_id: str, env: dict[str, str]) -> float:
    """One `rollout-coordinate checkpoint`; the pause it measured, in seconds."""
    command = [COORDINATE, "checkpoint", "--dir", str(root), "--checkpoint-id", checkpoint_id]
    for role, url in urls.items():
        command += ["--participant", f"{role.value}={url}"]
    done = subprocess.run(command, env=env, capture_output=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{checkpoint_id}: {done.stderr.decode(errors='replace')[-2000:]}")
    return float(json.loads(done.stdout)["durations"]["pause_seconds"])


def noop_cost(calls: int = 200_000) -> tuple[float, float]:
    """Microseconds per call of a no-op client span plus `tracing.headers()`, and of the bare
    loop (no tracer provider is installed in this process)."""
    attributes = {"rollout.instance": "environment-0", "rollout.role": "environment"}
    headers = {"Authorization": "Bearer x"}
    started = time.perf_counter()
    for _ in range(calls):
        with tracing.span(
            "prepare environment-0", kind=tracing.SpanKind.CLIENT, attributes=attributes
        ):
            if traced := tracing.headers():
                headers = {**headers, **traced}
    traced_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(calls):
        sent = headers
    bare_s = time.perf_counter() - started
    del sent
    return traced_s / calls * 1e6, bare_s / calls * 1e6


def run(repeats: int, root: Path, receiver: OtlpReceiver) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    base["ROLLOUT_CONTROL_TOKEN"] = TOKEN
    traced = {**base, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **EXPORT}
    with ExitStack() as stack:
        groups = {}
        pids: dict[str, list[int]] = {}
        for mode, env in (
            ("off", {}),
            ("on", {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **EXPORT}),
        ):
            folder = root / mode
            folder.mkdir()
            started = stack.enter_context(servers(folder, environment=env))
            urls = {role: url for (role, _), (url, _) in started.items()}
            pids[mode] = [pid for _, pid in started.values()]
            groups[mode] = (urls, folder / "checkpoints", base if mode == "off" else traced)
        pauses: dict[str, list[float]] = {"off": [], "on": []}
        cpu_before = {mode: sum(cpu_seconds(pid) for pid in pids[mode]) for mode in pids}
        for mode in ("off", "on"):  # a first checkpoint each: imports, connections, directories
            urls, ckpt_root, env = groups[mode]
            checkpoint(urls, ckpt_root, f"warm-{mode}", env)
        for i in range(repeats):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for mode in order:
                urls, ckpt_root, env = groups[mode]
                pauses[mode].append(checkpoint(urls, ckpt_root, f"{mode}-{i}", env))
        # every second of the servers' CPU while the checkpoints ran, export threads included
        cpu = {
            mode: (sum(cpu_seconds(pid) for pid in pids[mode]) - cpu_before[mode]) / repeats
            for mode in pids
        }
    exported = receiver.spans()
    off_spans = [
        s
        for s in exported
        if str(s.attributes.get("rollout.checkpoint_id", "")).startswith(("off-", "warm-off"))
    ]
    on_traces = {
        s.trace_id
        for s in exported
        if str(s.attributes.get("rollout.checkpoint_id", "")).startswith("on-")
    }
    off_median = statistics.median(pauses["off"])
    on_median = statistics.median(pauses["on"])
    print(f"checkpoint pause, 4 reference servers, {repeats} checkpoints each, alternating")
    print(f"  {'tracing':<10}{'median ms':>12}{'min ms':>10}{'max ms':>10}")
    for mode in ("off", "on"):
        values = pauses[mode]
        print(
            f"  {mode:<10}{statistics.median(values) * 1e3:>12.1f}"
            f"{min(values) * 1e3:>10.1f}{max(values) * 1e3:>10.1f}"
        )
    print(f"  on / off (medians): {on_median / off_median:.2f}")
    print(
        f"the four servers' CPU per checkpoint (their whole run, export included): "
        f"off {cpu['off'] * 1e3:.1f} ms, on {cpu['on'] * 1e3:.1f} ms, "
        f"on / off {cpu['on'] / cpu['off']:.2f}"
    )
    print(
        f"exported: {len(exported)} spans in {receiver.requests} OTLP requests; "
        f"{len(on_traces)} traced checkpoints; spans of tracing-off checkpoints: {len(off_spans)}"
    )
    traced_us, bare_us = noop_cost()
    print(
        f"tracing off, per protocol call in-process: no-op span + traceparent lookup "
        f"{traced_us:.2f} us against {bare_us:.3f} us without; "
        f"{traced_us * 12 / (off_median * 1e6) * 100:.3f}% of the off pause for its 12 calls"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp, otlp_receiver() as receiver:
        run(args.repeats, Path(tmp), receiver)


if __name__ == "__main__":
    main()
