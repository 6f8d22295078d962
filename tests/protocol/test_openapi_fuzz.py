"""An off-the-shelf OpenAPI fuzzer (schemathesis) against every server's published document.

Each reference server (wired to its peers, as in a set) and the custom example environment runs
as a real process on loopback with the control token. For every operation of its
`/openapi.json` the fuzzer sends a bounded number of generated requests, valid ones and
deliberately invalid ones (bodies, headers, query parameters), with the token, and checks:

- `not_a_server_error`: no 5xx, whatever the input;
- `status_code_conformance`: every status answered is one the document declares.

The example count is bounded (`EXAMPLES` per operation and mode) so the file stays well under
two minutes on two cores; hypothesis runs derandomized, so a run is reproducible.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from rollout_protocol import Role
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance
from testsupport.server_processes import TOKEN, Cluster, free_port, server_env

from devcluster.waiting import wait_for_sync

EXAMPLES = int(os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "12"))
"""Generated requests per operation and generation mode."""
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom-environment"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SKIPPED_PREFIXES = ("/debug/",)
"""Test-only routes (mounted with --debug-hooks): they long-poll on purpose."""
STOP_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(root=tmp_path_factory.mktemp("fuzz"))
    cluster.start(0)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def example_url(tmp_path_factory: pytest.TempPathFactory, fuzz_cluster: Cluster) -> Iterator[str]:
    """The custom example environment (`python -m adventure_env`), using the cluster's model."""
    root = tmp_path_factory.mktemp("fuzz-example")
    port = free_port()
    env = server_env(root / "checkpoints", 0)
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(EXAMPLE), env.get("PYTHONPATH")])))
    url = f"http://127.0.0.1:{port}"
    with (root / "environment.log").open("ab") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "adventure_env",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--model-url",
                fuzz_cluster.url(Role.MODEL),
            ],
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    try:

        def ready() -> bool:
            assert process.poll() is None, f"the example exited ({process.returncode})"
            try:
                return httpx.get(url + "/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for_sync(ready, 30, f"the example environment at {url}")
        yield url
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT_S)


def fuzz(base_url: str) -> list[str]:
    """Run the fuzzer over every operation of the server's document; the failures found."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", timeout=10)
    failures: list[str] = []
    checks: list[Any] = [not_a_server_error, status_code_conformance]
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path.startswith(SKIPPED_PREFIXES):
            continue
        operations += 1
        strategy = st.one_of(
            operation.as_strategy(schemathesis.GenerationMode.POSITIVE),
            operation.as_strategy(schemathesis.GenerationMode.NEGATIVE),
        )

        @settings(
            max_examples=2 * EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def run(case: schemathesis.Case) -> None:
            try:
                case.call_and_validate(
                    base_url=base_url, headers=dict(AUTH), checks=checks, timeout=30
                )
            except (AssertionError, BaseExceptionGroup) as error:
                # recorded, not raised: no shrinking, and every operation still runs
                found = f"{case.operation.label}: {str(error)[:800]}"
                if found not in failures:
                    failures.append(found)

        run()
    assert operations > 0, f"{base_url}/openapi.json has no operations"
    return failures


@pytest.mark.parametrize("role", list(Role), ids=[role.value for role in Role])
def test_reference_server_survives_the_fuzzer(fuzz_cluster: Cluster, role: Role) -> None:
    failures = fuzz(fuzz_cluster.url(role))
    assert not failures, "\n\n".join(failures)


def test_custom_example_survives_the_fuzzer(example_url: str) -> None:
    failures = fuzz(example_url)
    assert not failures, "\n\n".join(failures)
