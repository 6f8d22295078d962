"""What the operator logs when the API server is busy or away (docs/operations.md#failure-modes,
class 11).

Kopf's API client logged every failed try of a request it retries at ERROR, with the API server's
whole Status object: a freshly installed CRD answers 429 TooManyRequests ("storage is
(re)initializing") for a second, so every operator start next to `kubectl apply -f crds/` printed
ERROR lines about nothing. The lines below are Kopf's own (its exception class and its message
format, `kopf._cogs.clients.api.request`), sent through the root handler the operator's CLI
installs, as in `rollout-operator run`.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
from kopf._cogs.clients.errors import APITooManyRequestsError
from rollout_operator.cli import quiet_retried_requests

URL = "GET https://127.0.0.1:6443/apis/checkpoint.rollout.dev/v1alpha1/namespaces/a/rolloutsets"
STATUS = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": "storage is (re)initializing",
    "reason": "TooManyRequests",
    "details": {"retryAfterSeconds": 1},
    "code": 429,
}


@pytest.fixture
def operator_log() -> Iterator[io.StringIO]:
    """The root logger as `rollout-operator run` leaves it: a handler at INFO, then the CLI's
    filters (installed by the same call the CLI makes)."""
    root = logging.getLogger()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(name)s [%(levelname)s] %(message)s"))
    saved = root.level, list(root.handlers)
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    quiet_retried_requests()
    try:
        yield out
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]


def _kopf_retry_line(logger: logging.Logger, error: Exception, last: bool = False) -> None:
    idx = "#9/9" if last else "#1/9"
    if last:
        logger.error(f"Request attempt {idx} failed; escalating: {URL} -> {error!r}")
    else:
        logger.error(f"Request attempt {idx} failed; will retry: {URL} -> {error!r}")


def test_a_429_while_crds_initialise_is_one_info_line(operator_log: io.StringIO) -> None:
    error = APITooManyRequestsError(STATUS, status=429, headers={})
    _kopf_retry_line(logging.getLogger("kopf._cogs.clients.watching"), error)
    lines = operator_log.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert "[INFO]" in lines[0], lines[0]
    assert "ERROR" not in lines[0], lines[0]
    assert "429 TooManyRequests: storage is (re)initializing" in lines[0], lines[0]
    assert URL in lines[0], lines[0]
    assert "'kind': 'Status'" not in lines[0], lines[0]


def test_a_retried_connection_failure_is_a_warning(operator_log: io.StringIO) -> None:
    """The API server restarting (class 11): each retried try is one WARNING, not an ERROR."""
    error = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 6443)")
    _kopf_retry_line(logging.getLogger("kopf.objects"), error)
    (line,) = operator_log.getvalue().splitlines()
    assert line.startswith("kopf.objects [WARNING] API request failed, retrying (try #1/9)"), line
    assert "ConnectionRefusedError" in line


def test_a_request_that_gives_up_is_still_an_error(operator_log: io.StringIO) -> None:
    error = APITooManyRequestsError(STATUS, status=429, headers={})
    _kopf_retry_line(logging.getLogger("kopf._cogs.clients.watching"), error, last=True)
    other = logging.getLogger("rollout_operator.flows.recovery")
    other.error("Request attempt #1/9 failed; will retry: not Kopf's line")
    lines = operator_log.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert all("[ERROR]" in line for line in lines), lines


def test_at_warning_level_the_429_line_is_not_printed(operator_log: io.StringIO) -> None:
    logging.getLogger().setLevel(logging.WARNING)
    error = APITooManyRequestsError(STATUS, status=429, headers={})
    _kopf_retry_line(logging.getLogger("kopf._cogs.clients.watching"), error)
    assert operator_log.getvalue() == ""
