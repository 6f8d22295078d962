"""The conformance kit passes against the four reference servers, as real processes.

Each server runs with a one-second lease grace, so the lease check waits about two seconds. The
single-participant checks run against one cluster per control dialect (they never crash it):
the servers mounting ours, and the same servers mounting only NeMo Gym's
(`ROLLOUT_CONTROL_DIALECTS=gym`), which the kit then speaks. The crash + restore check runs over
a cluster of its own with `ReferenceDriver` (episodes held between agent turns,
every process killed, restarted under attempt 1). `check_park_all` (`steps.wait-holds-prepare`)
runs over single-process servers too: one episode inside the environment's wait step `verify`
keeps the prepare from being ready.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from rollout_protocol import Dialect, Role
from rollout_protocol.conformance import (
    Target,
    check_crash_restore,
    check_park_all,
    check_participant,
)
from testsupport.server_processes import TOKEN, Cluster, ReferenceDriver

GRACE = 1.0
SHORT_LEASE = {"ROLLOUT_LEASE_GRACE_SECONDS": str(GRACE)}


@pytest.fixture(scope="module", params=list(Dialect), ids=lambda dialect: dialect.value)
def kit_cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    env = {**SHORT_LEASE, "ROLLOUT_CONTROL_DIALECTS": request.param.value}
    cluster = Cluster(root=tmp_path_factory.mktemp("kit"), env=env)
    cluster.start(0)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("role", list(Role), ids=lambda role: role.value)
async def test_reference_server_passes_the_kit(kit_cluster: Cluster, role: Role) -> None:
    async with httpx.AsyncClient() as http:
        dialect = Dialect(kit_cluster.env["ROLLOUT_CONTROL_DIALECTS"])
        target = Target(kit_cluster.url(role), role, TOKEN, client=http, dialect=dialect)
        await check_participant(
            target, checkpoint_root=kit_cluster.checkpoint_root, lease_grace_seconds=GRACE
        )


@pytest.mark.anyio
async def test_reference_servers_keep_steps_across_crash_and_restore(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster(env=SHORT_LEASE)
    cluster.start(0)
    async with httpx.AsyncClient(timeout=60) as http:
        await check_crash_restore(
            ReferenceDriver(cluster, http),
            checkpoint_root=cluster.checkpoint_root,
            rollout_ids=["kit-a", "kit-b", "kit-c"],
        )
    assert set(cluster.pids) == {0, 1}


@pytest.mark.anyio
async def test_reference_servers_hold_the_prepare_for_a_wait_step(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster(env=SHORT_LEASE)
    cluster.start(0)
    async with httpx.AsyncClient(timeout=60) as http:
        await check_park_all(ReferenceDriver(cluster, http), rollout_ids=["park-a", "park-b"])
    assert set(cluster.pids) == {0, 1}
