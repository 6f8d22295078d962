"""What a server start costs in imports: CPU seconds to import what `rollout-server <role>`
imports, for this checkout and a baseline commit, in one run, runs alternating.

Prints a table; asserts nothing (docs/operations.md, "What a server start costs").

    python bench/server_imports.py [--baseline-ref REF] [--runs 15]

The baseline's `protocol/` and `servers/` are extracted with `git archive` into a temporary
folder and put first on `PYTHONPATH`, so both sides import the same third-party packages from
this checkout's virtual environment; only the project's own modules differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ROLES = ("environment", "agent", "model", "resources")
MODULE_OF_ROLE = {role: f"rollout_servers.servers.{role}" for role in ROLES}

_MEASURE = """
import resource, sys
import rollout_servers.cli
import {module}
used = resource.getrusage(resource.RUSAGE_SELF)
print(used.ru_utime + used.ru_stime)
"""
"""The child's own CPU after its imports (the interpreter's start included on both sides)."""


def extract(ref: str, into: Path) -> Path:
    """`protocol/` and `servers/` of `ref`, as `git archive` gives them."""
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", ref, "protocol", "servers"],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def cpu_seconds(module: str, pythonpath: str | None) -> float:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE.format(module=module)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-ref", default="HEAD~1")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="server-imports-") as folder:
        base = extract(args.baseline_ref, Path(folder))
        base_path = os.pathsep.join([str(base / "protocol"), str(base / "servers")])
        print(f"CPU seconds to import `rollout-server <role>`, median of {args.runs} runs")
        print(f"{'role':<12} {args.baseline_ref:>14} {'this checkout':>14} {'ratio':>7}")
        for role in ROLES:
            module = MODULE_OF_ROLE[role]
            before: list[float] = []
            after: list[float] = []
            for _ in range(args.runs):
                before.append(cpu_seconds(module, base_path))
                after.append(cpu_seconds(module, None))
            b, a = statistics.median(before), statistics.median(after)
            print(f"{role:<12} {b:>14.3f} {a:>14.3f} {a / b:>7.2f}")


if __name__ == "__main__":
    main()
