"""`rollout-operator` and `python -m rollout_operator`: the operator process's entry point.

Kopf imports kubernetes_asyncio whenever it is installed, only to recognise that library's
model objects should a handler pass one to it. The operator hands Kopf plain dicts and talks to
the API server through its own client (`cluster.rest`), yet that import alone was 45-60 MB of
the process's resident memory, about a quarter of it. The wheel still installs
kubernetes_asyncio for `rollout-collect --rollout-set` (the trainer's discovery), so this entry
point keeps it out of the operator's process before anything imports Kopf.
"""

from __future__ import annotations

import sys


def main() -> int:
    if "kubernetes_asyncio" not in sys.modules:
        sys.modules["kubernetes_asyncio"] = None  # type: ignore[assignment]  # import raises
    from .cli import main as run

    return run()


if __name__ == "__main__":
    raise SystemExit(main())
