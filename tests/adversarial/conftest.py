"""The adversarial suite: hostile inputs and fault timings, one test per input.

Every test asserts the invariants that matter whatever the input: nothing Ready is lost (a
checkpoint that was restorable still restores), nothing is left running or blocked (threads,
processes, the participant's control lock), and the refusal names what was wrong. Tests that need
an API server use the session `cluster` of `tests/conftest.py`; the others run without one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The in-process fake participant of the unit tests (`fakes`) serves here too.
_UNIT = str(Path(__file__).resolve().parents[1] / "unit")
if _UNIT not in sys.path:
    sys.path.append(_UNIT)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
