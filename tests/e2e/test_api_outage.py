"""An API server outage is weather, not an error (docs/operations.md#failure-modes, class 11).

While a checkpoint waits in prepare (an episode held inside the agent's tool call), the
kube-apiserver is stopped; the episode is released while it is down. The cut and the resume
need no API server (the phases inside the pause are written late), so the episodes run on; the
flow's first write after the resume, phase Persisting, cannot land (docs/protocol.md, "Persist
after resume"). Once the flow has noticed, the API server starts again. The operator rides it
out: no traceback and no failed daemon run in its log (connection errors are retried with one
line each), the checkpoint becomes Ready, and every episode finishes.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import httpx
import pytest
from rollout_servers.client import EpisodeFailed, RolloutClient, episode_specs
from rollout_servers.discovery import rollout_set_topology
from testsupport.operator_fixtures import (
    HOLD_IN_TOOL_ARGS,
    Debug,
    OperatorProcess,
    Resources,
    episodes_running,
    example_checkpoint,
    example_set,
    is_true,
    participants_by_role,
    phase_is,
    wait_phase,
)

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for_sync

pytestmark = [pytest.mark.e2e, pytest.mark.adversarial]  # fault timings


async def test_a_restarting_api_server_is_ridden_out(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    rset = example_set(storage_dir, extra_args=HOLD_IN_TOOL_ARGS)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(rset))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)
    agent = participants_by_role(ready)["agent"][0]
    specs = episode_specs(4, 53)
    held = specs[0].rollout_id
    async with (
        httpx.AsyncClient() as http,
        rollout_set_topology("math-rl", namespace, kubeconfig=cluster.kubeconfig) as topology,
    ):
        hooks = Debug(http, agent["address"])
        await hooks.arm("tool", held)
        client = RolloutClient(topology, concurrency=4, restore_timeout_s=120)
        async with episodes_running(client, specs) as outcomes:
            await hooks.paused("tool", held)
            cluster.kubectl(
                "apply", "-n", namespace, "-f", "-", input=json.dumps(example_checkpoint("calm"))
            )
            await wait_phase(http, agent["address"], "preparing", "the agent to be preparing")
            log_before = operator.log.read_text(errors="replace")

            def outage() -> None:
                """The API server is down: let the episode park, and wait until the flow
                tried to go on after the resume (its Persisting write failed)."""
                with httpx.Client(timeout=10) as sync:
                    reply = sync.post(
                        agent["address"] + "/debug/release",
                        json={"point": "tool", "rollout_id": held},
                    )
                    assert reply.json() == {"released": 1}

                def noticed() -> bool:
                    text = operator.log.read_text(errors="replace")[len(log_before) :]
                    return any(
                        line in text
                        for line in (
                            "Persisting not written yet",
                            "Traceback",
                            "failed temporarily",
                        )
                    )

                wait_for_sync(noticed, 60, "the checkpoint flow to hit the outage", interval=0.2)

            await anyio.to_thread.run_sync(
                lambda: cluster.restart("kube-apiserver", while_down=outage)
            )
            ckpt = await resources.wait_checkpoint(
                "calm", "Ready or Failed", phase_is("Ready", "Failed"), 90
            )
    assert is_true(ckpt, "Ready"), ckpt["status"]
    assert not [o for o in outcomes if isinstance(o, EpisodeFailed)], outcomes
    assert len(outcomes) == len(specs)

    during = operator.log.read_text(errors="replace")[len(log_before) :]
    assert "Traceback" not in during, during[-4000:]
    assert "failed temporarily" not in during, "the flow rode the outage out in its run"
    assert "Persisting not written yet" in during, "the outage met the write after the resume"
