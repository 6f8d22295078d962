"""The adversarial suite: hostile inputs and fault timings, one test per input.

Every test asserts the invariants that matter whatever the input: nothing Ready is lost (a
checkpoint that was restorable still restores), nothing is left running or blocked (threads,
processes, the participant's control lock), and the refusal names what was wrong. Tests that need
an API server use the session `cluster` of `tests/conftest.py`; the others run without one.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
