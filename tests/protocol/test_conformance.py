"""The conformance kit passes against the four reference servers, as real processes.

Each server runs with a one-second lease grace, so the lease check waits about two seconds. The
single-participant checks run against one cluster (they never crash it); the crash + restore
check runs over a cluster of its own with `ReferenceDriver` (episodes held between agent turns,
every process killed, restarted under attempt 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from rollout_protocol import Role
from rollout_protocol.conformance import Target, check_crash_restore, check_participant
from testsupport.server_processes import TOKEN, Cluster, ReferenceDriver

GRACE = 1.0
SHORT_LEASE = {"ROLLOUT_LEASE_GRACE_SECONDS": str(GRACE)}


@pytest.fixture(scope="module")
def kit_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(root=tmp_path_factory.mktemp("kit"), env=SHORT_LEASE)
    cluster.start(0)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("role", list(Role), ids=lambda role: role.value)
async def test_reference_server_passes_the_kit(kit_cluster: Cluster, role: Role) -> None:
    async with httpx.AsyncClient() as http:
        target = Target(kit_cluster.url(role), role, TOKEN, client=http)
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
