"""An operator that stops after a checkpoint's cut hands it over in phase Resuming
(docs/design.md#68-the-operators-own-life).

The phases inside the pause are written late (`context.UnwrittenPhases`): a successor that
finds an earlier phase prepares and cuts again, and the participants replay their replies. The
resume is the one call they cannot replay (the checkpoint id is spent once resumed), so an
operator let go by its stop (`HANDOVER_SECONDS`, handlers/rolloutcheckpoint.py) while the
resume may have reached the participants writes Resuming before it goes, and its successor
resumes and persists the held cut instead of being refused the id as stale (`LeaseLapsed`).

The API server is the unit tests' fake (`testsupport.fakecluster`, below the real `Kube`); the
participant is a real control plane (`rollout_protocol.ControlPlane` over a `FakeParticipant`,
served on loopback), reached through `HttpParticipantClient`; its records land under
`tmp_path`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import cast

import aiohttp
import anyio
import pytest
from rollout_operator.flows.checkpoint import CheckpointFlow, FlowSettings
from rollout_operator.model import api
from rollout_protocol import (
    CommitReply,
    CommitRequest,
    HttpParticipantClient,
    PersistRequest,
    PrepareReply,
    PrepareRequest,
    ResumeReply,
    ResumeRequest,
    Role,
)
from testsupport.checkpointflow import (
    CKPT,
    NS,
    TOKEN,
    checkpoint_status,
    condition,
    mark_ready,
    served_participant,
)
from testsupport.checkpointflow import set_cluster as checkpoint_cluster
from testsupport.delegating import Delegating
from testsupport.fakecluster import FakeCluster

WAIT = 30.0
"""Upper bound for a whole scenario; reaching it is a failure, not a delay."""


class Journaled(Delegating[HttpParticipantClient]):
    """The participant's client as the flow uses it, journaling each call; with
    `reply_lost`, a resume reaches the participant and its reply never comes back (the
    operator is told to stop while it waits for it)."""

    def __init__(self, inner: HttpParticipantClient, journal: list[str]) -> None:
        super().__init__(inner)
        self.journal = journal
        self.reply_lost: anyio.Event | None = None

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        self.journal.append("prepare")
        return await self.inner.prepare(request)

    async def commit(self, request: CommitRequest) -> CommitReply:
        self.journal.append("commit")
        return await self.inner.commit(request)

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        self.journal.append("resume")
        reply = await self.inner.resume(request)
        if self.reply_lost is not None:
            self.reply_lost.set()
            await anyio.sleep_forever()
        return reply

    async def persist(self, request: PersistRequest) -> CommitReply:
        self.journal.append("persist")
        return await self.inner.persist(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def operator(
    cluster: FakeCluster,
    clients: Callable[[], Journaled],
    settings: FlowSettings | None = None,
) -> CheckpointFlow:
    """One operator process's flow: its own client of the API server and its own Leases."""

    def participants(rset: api.RolloutSet, token: str) -> list[HttpParticipantClient]:
        assert token == TOKEN
        return [cast(HttpParticipantClient, clients())]

    return CheckpointFlow(cluster.kube(), settings=settings, participants_factory=participants)


@pytest.fixture
def cluster() -> FakeCluster:
    ready = checkpoint_cluster("Manual", [])
    mark_ready(ready)
    return ready


async def test_an_operator_stopped_after_the_resume_writes_resuming_and_its_successor_persists(
    cluster: FakeCluster, tmp_path: Path
) -> None:
    journal: list[str] = []
    async with AsyncExitStack() as stack:
        _, url = await stack.enter_async_context(served_participant(tmp_path))
        session = await stack.enter_async_context(aiohttp.ClientSession())

        def client() -> Journaled:
            return Journaled(
                HttpParticipantClient(Role.MODEL, url, token=TOKEN, client=session), journal
            )

        stopping = client()
        stopping.reply_lost = reached = anyio.Event()
        # The phases inside the pause stay unwritten, as in a checkpoint faster than a second.
        first = operator(cluster, lambda: stopping, FlowSettings(phase_write_seconds=WAIT * 10))
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                # An operator that stops lets its flows go without aborting them.
                group.start_soon(lambda: first.run(NS, CKPT, abort_when_cancelled=lambda: False))
                await reached.wait()
                assert checkpoint_status(cluster).get("phase") is None, "nothing written yet"
                group.cancel_scope.cancel()
        assert journal == ["prepare", "commit", "resume"]
        assert checkpoint_status(cluster)["phase"] == "Resuming", (
            "the participant resumed: a successor must not prepare this id again"
        )

        journal.clear()
        with anyio.fail_after(WAIT):
            phase = await operator(cluster, client).run(NS, CKPT)
        assert phase is api.CheckpointPhase.READY, checkpoint_status(cluster)
        assert journal == ["resume", "persist"], "the successor resumed and persisted the cut"
        assert condition(cluster, "Ready")["status"] == "True"
        (published,) = checkpoint_status(cluster)["participants"]
        assert published["instance"] == "model-0"
        written = [path async for path in anyio.Path(tmp_path).glob(f"**/{CKPT}/model-0/*")]
        assert written, "the held records are durable"
