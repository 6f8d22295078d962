"""A trainer on this machine: `rollout-collect --rollout-set` as a process, what it wrote, and
its end when a test leaves early.

The container suite (one container node) and the multi-node suite (the kind cluster) both drive
the example set as a user's trainer does: `rollout-collect` follows the set through the API
server (the kubeconfig given) and dials its pods, writing one JSON result a line to `--out`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def start_collecting(
    kubeconfig: Path,
    rollout_set: str,
    namespace: str,
    out: Path,
    *,
    tasks: int,
    concurrency: int,
    seed: int,
) -> subprocess.Popen[str]:
    """`rollout-collect` of `tasks` episodes from the set, results to `out`, progress every 2 s
    on its stdout (stderr merged in): the caller waits on it and reads its output on failure."""
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "rollout-collect"),
            *("--rollout-set", rollout_set, "--namespace", namespace),
            *("--tasks", str(tasks), "--concurrency", str(concurrency), "--seed", str(seed)),
            *("--out", str(out), "--progress-interval", "2"),
        ],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def collected(out: Path) -> list[dict[str, Any]]:
    """The episode results `rollout-collect --out` wrote so far (one JSON object a line)."""
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def stop(process: subprocess.Popen[str]) -> None:
    """Killed and reaped if it still runs (a test that failed before waiting on it)."""
    if process.poll() is None:
        process.kill()
        process.wait()
