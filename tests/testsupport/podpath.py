"""The test's import path for pods.

devcluster's node agent passes pods no PYTHONPATH of the test's: a pod that must run this
checkout's code (a worktree's tests, with PYTHONPATH naming it) or import a `testsupport` module
is given the path in its container's environment here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
"""The tests folder, which holds `testsupport` (not installed in the venv)."""


def give_import_path(container: dict[str, Any], *, tests: bool = False) -> None:
    """Sets `container`'s PYTHONPATH to the test's own, after the tests folder when `tests` (for
    a `testsupport` module run in the pod); a PYTHONPATH it had is replaced. Nothing is set when
    there is nothing to give."""
    path = os.pathsep.join(
        filter(None, [str(TESTS) if tests else "", os.environ.get("PYTHONPATH")])
    )
    if not path:
        return
    env = [e for e in container.get("env", []) if e["name"] != "PYTHONPATH"]
    container["env"] = [*env, {"name": "PYTHONPATH", "value": path}]
