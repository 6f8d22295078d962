"""The coordinator against real control planes: order, scope, publish, restore, failures.

Most tests reach the control planes through `HttpParticipantClient` (aiohttp) over the conformance
kit's `serve_app` (the real apps, in process, each on its own loopback port); the loopback tests
run real uvicorn servers on 127.0.0.1, and the CLI test runs `rollout-coordinate` as a separate
process against them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Collection, Generator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.abc
import pytest
import uvicorn
from fastapi import FastAPI
from rollout_protocol import (
    PREPARE_ORDER,
    CommitReply,
    CommitRequest,
    ControlPlane,
    ControlSettings,
    Coordinator,
    Dialect,
    ErrorCode,
    ForgetReply,
    ForgetRequest,
    HttpParticipantClient,
    ParticipantClient,
    ParticipantError,
    Phase,
    PrepareReply,
    PrepareRequest,
    RenewReply,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    Role,
)
from rollout_protocol import _cli as coordination_cli
from rollout_protocol import _storage as storage
from rollout_protocol.conformance import serve_app
from testsupport.delegating import Delegating
from testsupport.participants import FakeParticipant

TOKEN = "coordination-test-token"
WAIT = 10.0
"""Upper bound for a whole scenario; reaching it is a failure, not a delay."""

ROLLOUTS: dict[Role, list[str]] = {
    Role.ENVIRONMENT: ["r1", "r2", "r3"],
    Role.MODEL: ["r1", "r2"],
    Role.AGENT: ["r1", "r2", "r3"],
    Role.RESOURCES: ["r2", "r3"],
}


class Spy(Delegating[ParticipantClient]):
    """Wraps a participant client, journaling the coordinator's calls in the order they start."""

    def __init__(self, inner: ParticipantClient, journal: list[tuple[str, str]]) -> None:
        super().__init__(inner)
        self.journal = journal
        self.renewed = anyio.Event()

    def _log(self, operation: str) -> None:
        self.journal.append((self.instance, operation))

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        self._log("prepare")
        return await self.inner.prepare(request)

    async def renew(self, request: RenewRequest) -> RenewReply:
        self._log("renew")
        reply = await self.inner.renew(request)
        self.renewed.set()
        return reply

    async def commit(self, request: CommitRequest) -> CommitReply:
        self._log("commit")
        return await self.inner.commit(request)

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        self._log("restore")
        return await self.inner.restore(request)

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        self._log("resume")
        return await self.inner.resume(request)

    async def retire(self, request: RetireRequest) -> RetireReply:
        self._log("retire")
        return await self.inner.retire(request)

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        self._log("forget")
        return await self.inner.forget(request)


@dataclass
class Member:
    fake: FakeParticipant
    plane: ControlPlane
    app: FastAPI
    spy: Spy | None = None


@dataclass
class Cluster:
    members: dict[Role, Member]
    journal: list[tuple[str, str]] = field(default_factory=list)

    def fake(self, role: Role) -> FakeParticipant:
        return self.members[role].fake

    def plane(self, role: Role) -> ControlPlane:
        return self.members[role].plane

    def spy(self, role: Role) -> Spy:
        spy = self.members[role].spy
        assert spy is not None
        return spy

    def calls(self, operation: str) -> list[str]:
        return [instance for instance, op in self.journal if op == operation]


def _members(
    root: Path | None,
    *,
    attempt: int = 0,
    rollouts: dict[Role, list[str]] | None = None,
    roots: dict[Role, Path | None] | None = None,
    gym_roles: Collection[Role] = (),
) -> dict[Role, Member]:
    """One participant per role; those of `gym_roles` mount only the NeMo Gym dialect."""
    members: dict[Role, Member] = {}
    hooks: list[tuple[str, str]] = []  # one journal of participant hook calls for all
    for role in PREPARE_ORDER:
        names = (ROLLOUTS if rollouts is None else rollouts).get(role, [])
        fake = FakeParticipant(role, rollouts=names, attempt=attempt, journal=hooks)
        settings = ControlSettings(
            role=role,
            set_name="demo",
            checkpoint_root=(roots or {}).get(role, root),
            attempt=attempt,
            token=TOKEN,
            dialects=(Dialect.GYM,) if role in gym_roles else (Dialect.ROLLOUT,),
        )
        plane = ControlPlane(fake, settings)
        app = FastAPI()
        plane.install(app)
        members[role] = Member(fake, plane, app)
    return members


@asynccontextmanager
async def _in_process(members: dict[Role, Member]) -> AsyncIterator[Cluster]:
    """Every member's app served in process on its own loopback port (lifespan on, so the
    watchdog runs), reached through one session and wrapped in a journaling spy."""
    cluster = Cluster(members)
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(aiohttp.ClientSession())
        for role, member in members.items():
            served = await stack.enter_async_context(serve_app(member.app, role=role, token=TOKEN))
            inner = HttpParticipantClient(role, served.target.base_url, token=TOKEN, client=client)
            member.spy = Spy(inner, cluster.journal)
        yield cluster


def _coordinator(cluster: Cluster, **options: Any) -> Coordinator:
    return Coordinator([cluster.spy(role) for role in PREPARE_ORDER], **options)


def _reverse(cluster: Cluster) -> list[str]:
    return [cluster.plane(role).settings.instance for role in reversed(PREPARE_ORDER)]


def _in_order(cluster: Cluster) -> list[str]:
    return [cluster.plane(role).settings.instance for role in PREPARE_ORDER]


async def test_checkpoint_prepares_in_order_commits_the_scope_publishes_and_resumes_at_once(
    tmp_path: Path,
) -> None:
    members = _members(tmp_path)
    members[Role.MODEL].fake.restarts.add("r2")
    async with _in_process(members) as cluster:
        with anyio.fail_after(WAIT):
            result = await _coordinator(cluster).checkpoint(
                "ck-1",
                prepare_timeout=5,
                commit_timeout=5,
                publish_dir=tmp_path,
                set_name="demo",
                trainer_step=7,
            )
        assert result.ok, result.message
        assert result.reason == "Published"
        assert cluster.calls("prepare") == _in_order(cluster)
        assert sorted(cluster.calls("resume")) == sorted(_reverse(cluster))
        last_commit = max(cluster.journal.index((i, "commit")) for i in _in_order(cluster))
        first_resume = min(cluster.journal.index((i, "resume")) for i in _in_order(cluster))
        assert last_commit < first_resume, "every commit is sent before anyone resumes"
        assert result.commit is not None
        assert result.commit.scope is None, "every parked episode: no list shipped"
        assert result.commit.excluded == ["r2"], "minus restarts"
        assert result.message.startswith("2 episodes in")
        assert result.durations.pause_seconds >= result.durations.prepare_seconds
        for role in PREPARE_ORDER:
            assert cluster.plane(role).phase is Phase.IDLE
            assert cluster.fake(role).admission_open

    published = storage.read_checkpoint_manifest(tmp_path, "demo", "ck-1")
    assert result.published == str(tmp_path / "demo" / "ck-1" / "checkpoint.json")
    assert published.rollout_ids == [], "the scope was not restricted"
    assert published.trainer_step == 7
    assert published.restarts == 1
    assert sorted(p.instance for p in published.participants) == sorted(_in_order(cluster))
    _, records = storage.read_records(
        tmp_path / "demo" / "ck-1" / "resources-0", expect_checkpoint_id="ck-1"
    )
    assert [r.rollout_id for r in records] == ["r3"]


class ResumeBarrier:
    """Holds every resume call until all participants' resumes are in flight. A coordinator that
    resumed one stage after another never sends the second stage's call while the first waits
    here: each wait then ends at its bound (a failure, not a delay) and that resume fails."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.arrived = 0
        self.all_in_flight = anyio.Event()

    async def wait(self) -> None:
        self.arrived += 1
        if self.arrived == self.parties:
            self.all_in_flight.set()
        with anyio.fail_after(WAIT / 8):
            await self.all_in_flight.wait()


class BarrierSpy(Spy):
    """A journaling spy whose resume waits at a shared `ResumeBarrier` before it is sent."""

    def __init__(
        self, inner: ParticipantClient, journal: list[tuple[str, str]], barrier: ResumeBarrier
    ) -> None:
        super().__init__(inner, journal)
        self.barrier = barrier

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        self._log("resume")
        await self.barrier.wait()
        return await self.inner.resume(request)


async def test_a_published_checkpoint_resumes_every_participant_at_once(tmp_path: Path) -> None:
    """One round of resume calls, not one per role: the pause shrinks by three round trips."""
    async with _in_process(_members(tmp_path)) as cluster:
        barrier = ResumeBarrier(len(PREPARE_ORDER))
        spies = [
            BarrierSpy(cluster.spy(role).inner, cluster.journal, barrier) for role in PREPARE_ORDER
        ]
        with anyio.fail_after(WAIT):
            result = await Coordinator(spies).checkpoint(
                "ck-1", prepare_timeout=5, commit_timeout=5, publish_dir=tmp_path, set_name="demo"
            )
        assert result.ok, result.message
        assert result.resume is not None
        assert result.resume.failures == [], "resumes were sent one stage at a time"
        assert barrier.all_in_flight.is_set()
        assert sorted(result.resume.resumed) == sorted(_in_order(cluster))
        for role in PREPARE_ORDER:
            assert cluster.fake(role).admission_open
            assert cluster.plane(role).phase is Phase.IDLE


async def test_requested_scope_is_intersected_with_live_episodes(tmp_path: Path) -> None:
    async with _in_process(_members(tmp_path)) as cluster:
        result = await _coordinator(cluster).checkpoint(
            "ck-1", prepare_timeout=5, commit_timeout=5, scope=["r2", "r9"]
        )
    assert result.ok, result.message
    assert result.reason == "Committed", "no publish_dir: the caller publishes"
    assert result.commit is not None
    assert result.commit.scope == ["r2"]
    assert not (tmp_path / "demo" / "ck-1" / "checkpoint.json").exists()


async def test_stops_at_the_first_stage_not_ready_reports_blockers_and_aborts_at_once(
    tmp_path: Path,
) -> None:
    members = _members(tmp_path)
    members[Role.MODEL].fake.stuck.add("r2")
    async with _in_process(members) as cluster:
        with anyio.fail_after(WAIT):
            result = await _coordinator(cluster).checkpoint(
                "ck-1", prepare_timeout=1.0, commit_timeout=5, publish_dir=tmp_path
            )
        assert not result.ok
        assert result.reason == "NotReady"
        assert result.prepare.stopped_at is Role.MODEL
        assert [str(e) for e in result.prepare.blockers] == ["r2@0"]
        assert result.prepare.blocker_count == 1
        assert "r2@0" in result.message
        assert cluster.calls("prepare") == ["environment-0", "model-0"]
        assert cluster.fake(Role.AGENT).park_calls == 0
        assert cluster.calls("commit") == []
        # An abort resumes everyone at once (one hung participant holds nobody else).
        assert sorted(cluster.calls("resume")) == sorted(_reverse(cluster))
        for role in PREPARE_ORDER:
            assert cluster.fake(role).admission_open
            assert cluster.plane(role).phase is Phase.IDLE
    assert not (tmp_path / "demo" / "ck-1").exists(), "nothing was written"


async def test_prepared_leases_are_renewed_while_later_stages_park(tmp_path: Path) -> None:
    members = _members(tmp_path)
    async with _in_process(members) as cluster:
        # The model parks only once the environment (prepared first) has been renewed.
        cluster.fake(Role.MODEL).park_gate = cluster.spy(Role.ENVIRONMENT).renewed
        with anyio.fail_after(WAIT):
            result = await _coordinator(cluster, renew_interval=0.02).checkpoint(
                "ck-1", prepare_timeout=WAIT, commit_timeout=5
            )
        assert result.ok, result.message
        assert cluster.spy(Role.ENVIRONMENT).renewed.is_set()
        renewed = set(cluster.calls("renew"))
        assert "environment-0" in renewed
        assert "resources-0" not in renewed, "only prepared participants are renewed"


async def test_a_prepared_participant_losing_the_checkpoint_ends_prepare_early(
    tmp_path: Path,
) -> None:
    members = _members(tmp_path)
    environment = members[Role.ENVIRONMENT].plane

    async def environment_forgets() -> None:
        # What a lapsed lease or a restarted process looks like to the coordinator.
        await environment.resume(ResumeRequest(checkpoint_id="ck-1", deadline_ts=time.time() + 5))

    members[Role.MODEL].fake.on_park = environment_forgets
    members[Role.MODEL].fake.park_gate = anyio.Event()  # never set: parks until its deadline
    async with _in_process(members) as cluster:
        with anyio.fail_after(WAIT):
            result = await _coordinator(cluster, renew_interval=0.02).checkpoint(
                "ck-1", prepare_timeout=120, commit_timeout=5
            )
        assert not result.ok
        assert result.reason == "PrepareFailed"
        assert result.prepare.stopped_at is Role.MODEL
        assert [(f.instance, f.code) for f in result.prepare.failures] == [
            ("environment-0", ErrorCode.STALE_CHECKPOINT)
        ]
        assert cluster.calls("commit") == []
        for role in PREPARE_ORDER:
            assert cluster.fake(role).admission_open


async def test_a_restarted_gym_participant_ends_prepare_early(tmp_path: Path) -> None:
    """A participant that speaks only the NeMo Gym dialect and restarted after it prepared
    remembers no checkpoint: Gym refuses the renew as `invalid_phase` (none open), which is
    read back as `wrong_phase`, not `unknown_checkpoint`. It has lost the checkpoint all the
    same, and the prepare ends there instead of parking the later stages to their deadline."""
    members = _members(tmp_path, gym_roles={Role.ENVIRONMENT})
    restarted = _members(tmp_path, gym_roles={Role.ENVIRONMENT})[Role.ENVIRONMENT]
    members[Role.MODEL].fake.park_gate = anyio.Event()  # never set: parks until its deadline
    async with _in_process(members) as cluster, AsyncExitStack() as stack:
        client = await stack.enter_async_context(aiohttp.ClientSession())
        served = await stack.enter_async_context(
            serve_app(restarted.app, role=Role.ENVIRONMENT, token=TOKEN)
        )
        fresh = HttpParticipantClient(
            Role.ENVIRONMENT, served.target.base_url, token=TOKEN, client=client
        )

        async def environment_restarts() -> None:
            cluster.spy(Role.ENVIRONMENT).inner = fresh  # the same address, a new process

        members[Role.MODEL].fake.on_park = environment_restarts
        with anyio.fail_after(WAIT):
            result = await _coordinator(cluster, renew_interval=0.02).checkpoint(
                "ck-1", prepare_timeout=120, commit_timeout=5
            )
        assert not result.ok
        assert result.reason == "PrepareFailed"
        assert result.prepare.stopped_at is Role.MODEL
        assert [(f.instance, f.code) for f in result.prepare.failures] == [
            ("environment-0", ErrorCode.WRONG_PHASE)
        ]
        assert cluster.calls("commit") == []


async def test_a_failed_commit_reports_the_reason_and_everyone_resumes(tmp_path: Path) -> None:
    members = _members(tmp_path, roots={Role.AGENT: None})
    async with _in_process(members) as cluster:
        result = await _coordinator(cluster).checkpoint(
            "ck-1", prepare_timeout=5, commit_timeout=5, publish_dir=tmp_path
        )
        assert not result.ok
        assert result.reason == "CommitFailed"
        assert result.commit is not None
        assert [(f.instance, f.code) for f in result.commit.failures] == [
            ("agent-0", ErrorCode.STORAGE_FAILED)
        ]
        assert "ROLLOUT_CHECKPOINT_ROOT" in result.message
        assert sorted(cluster.calls("resume")) == sorted(_reverse(cluster)), "aborted at once"
        for role in PREPARE_ORDER:
            assert cluster.plane(role).phase is Phase.IDLE
    assert not (tmp_path / "demo" / "ck-1" / "checkpoint.json").exists()


async def test_publish_refuses_a_directory_the_participants_did_not_write(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    async with _in_process(_members(tmp_path / "shared")) as cluster:
        result = await _coordinator(cluster).checkpoint(
            "ck-1", prepare_timeout=5, commit_timeout=5, publish_dir=elsewhere, set_name="demo"
        )
        assert result.reason == "PublishFailed"
        assert "never finished" in result.message
        assert sorted(cluster.calls("resume")) == sorted(_reverse(cluster)), "aborted at once"
    assert not (elsewhere / "demo" / "ck-1" / "checkpoint.json").exists()


async def _take_checkpoint(root: Path) -> None:
    async with _in_process(_members(root)) as cluster:
        result = await _coordinator(cluster).checkpoint(
            "ck-1", prepare_timeout=5, commit_timeout=5, publish_dir=root, set_name="demo"
        )
        assert result.ok, result.message


async def test_restore_is_all_or_nothing_retiring_the_attempt_and_resuming(tmp_path: Path) -> None:
    await _take_checkpoint(tmp_path)
    fresh = _members(tmp_path, attempt=1, rollouts={})
    fresh[Role.RESOURCES].fake.refuse_records = "session r2 has no verifier"
    async with _in_process(fresh) as cluster:
        with anyio.fail_after(WAIT):
            outcome = await _coordinator(cluster).restore("ck-1", 1, time.time() + 5)
        assert not outcome.ok
        assert [(f.instance, f.code) for f in outcome.failures] == [
            ("resources-0", ErrorCode.RECORDS_INVALID)
        ]
        assert "no verifier" in outcome.failures[0].detail
        assert outcome.retired is not None
        assert outcome.retired.attempt == 1
        assert outcome.retired.failures == []
        retire_order = cluster.calls("retire")
        assert retire_order[:2] == ["environment-0", "agent-0"]
        assert sorted(retire_order[2:]) == ["model-0", "resources-0"]
        assert sorted(cluster.calls("resume")) == sorted(_reverse(cluster))
        assert cluster.journal.index(("resources-0", "resume")) > cluster.journal.index(
            ("model-0", "retire")
        ), "retire happens before anything resumes"
        for role in PREPARE_ORDER:
            assert cluster.plane(role).is_retired(1, "r1")
            assert cluster.fake(role).live == {}, "nothing restored stays installed"
            assert cluster.fake(role).admission_open
            assert cluster.plane(role).phase is Phase.IDLE
        assert cluster.fake(Role.RESOURCES).install_calls == 0


async def test_restore_succeeds_everywhere_and_waits_for_resume(tmp_path: Path) -> None:
    await _take_checkpoint(tmp_path)
    async with _in_process(_members(tmp_path, attempt=1, rollouts={})) as cluster:
        coordinator = _coordinator(cluster)
        outcome = await coordinator.restore("ck-1", 1, time.time() + 5)
        assert outcome.ok
        assert outcome.restored == {
            "environment-0": 3,
            "model-0": 2,
            "agent-0": 3,
            "resources-0": 2,
        }
        assert sorted(str(e) for e in outcome.episodes) == ["r1@1", "r2@1", "r3@1"]
        assert cluster.plane(Role.MODEL).phase is Phase.RESTORED
        assert not cluster.fake(Role.MODEL).admission_open
        resumed = await coordinator.resume("ck-1", time.time() + 5)
        assert resumed.failures == []
        assert cluster.fake(Role.MODEL).admission_open
        assert cluster.plane(Role.MODEL).attempt == 1


async def test_restore_names_the_rollouts_a_gym_commit_listed(tmp_path: Path) -> None:
    """A participant's listed rollouts (`CommitOutcome.listed`, kept with the checkpoint) are
    what its restore names, within the scope; a participant without a listing is asked for
    every record in the scope, as before."""
    await _take_checkpoint(tmp_path)
    async with _in_process(_members(tmp_path, attempt=1, rollouts={})) as cluster:
        asked: dict[str, list[str] | None] = {}
        for role in PREPARE_ORDER:
            spy = cluster.spy(role)
            inner_restore = spy.restore

            async def restore(
                request: RestoreRequest, spy: Spy = spy, inner: Any = inner_restore
            ) -> RestoreReply:
                asked[spy.instance] = request.rollout_ids
                reply: RestoreReply = await inner(request)
                return reply

            spy.restore = restore  # type: ignore[method-assign]
        listed = {"environment-0": ["r1", "r2"], "model-0": ["r2"]}
        coordinator = _coordinator(cluster)
        outcome = await coordinator.restore("ck-1", 1, time.time() + 5, ["r2", "r3"], listed=listed)
        assert outcome.ok, outcome.failures
        assert asked == {
            "environment-0": ["r2"],
            "agent-0": ["r2", "r3"],
            "model-0": ["r2"],
            "resources-0": ["r2", "r3"],
        }
        await coordinator.resume("ck-1", time.time() + 5)


async def test_retire_and_forget_reach_everyone(tmp_path: Path) -> None:
    async with _in_process(_members(tmp_path)) as cluster:
        coordinator = _coordinator(cluster)
        retired = await coordinator.retire(0, ["r1"], time.time() + 5, operation_id="op-1")
        assert retired.failures == []
        assert sorted(str(e) for e in retired.retired) == ["r1@0", "r1@0", "r1@0"]
        assert cluster.calls("retire")[:2] == ["environment-0", "agent-0"]
        again = await coordinator.retire(0, ["r1"], time.time() + 5, operation_id="op-1")
        assert again.retired == retired.retired
        assert cluster.fake(Role.ENVIRONMENT).retired == [(0, frozenset({"r1"}))]
        forgotten = await coordinator.forget(["r1"], time.time() + 5)
        assert forgotten.forgotten == 4
        assert not cluster.plane(Role.AGENT).is_retired(0, "r1")


# --- real loopback HTTP ---------------------------------------------------------------------


class _InProcessServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Several servers share the test process: leave pytest's signal handlers alone.
        yield


@asynccontextmanager
async def _served(members: dict[Role, Member]) -> AsyncIterator[dict[Role, str]]:
    """Serve each member's app on 127.0.0.1 with uvicorn (lifespan on, so the watchdog runs).

    Each socket listens before its server starts, so clients may connect at once: the kernel
    queues them until uvicorn accepts, and no readiness poll is needed.
    """
    urls: dict[Role, str] = {}
    servers: list[uvicorn.Server] = []
    sockets: list[socket.socket] = []
    async with anyio.create_task_group() as group:
        for role, member in members.items():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            sockets.append(sock)
            server = _InProcessServer(
                uvicorn.Config(member.app, log_level="warning", lifespan="on")
            )
            servers.append(server)
            group.start_soon(server.serve, [sock])
            urls[role] = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            yield urls
        finally:
            for server in servers:
                server.should_exit = True
    for sock in sockets:
        sock.close()


def _http_participants(
    urls: dict[Role, str], client: aiohttp.ClientSession
) -> list[HttpParticipantClient]:
    return [
        HttpParticipantClient(role, urls[role], token=TOKEN, client=client)
        for role in PREPARE_ORDER
    ]


async def test_checkpoint_crash_and_restore_over_loopback_http(tmp_path: Path) -> None:
    first = _members(tmp_path)
    with anyio.fail_after(WAIT):
        async with _served(first) as urls, aiohttp.ClientSession() as client:
            result = await Coordinator(_http_participants(urls, client)).checkpoint(
                "ck-1", prepare_timeout=5, commit_timeout=5, publish_dir=tmp_path, set_name="demo"
            )
            assert result.ok, result.message

        second = _members(tmp_path, attempt=1, rollouts={})
        async with _served(second) as urls, aiohttp.ClientSession() as client:
            coordinator = Coordinator(_http_participants(urls, client))
            outcome = await coordinator.restore("ck-1", 1, time.time() + 5)
            assert outcome.ok, outcome.failures
            assert (await coordinator.resume("ck-1", time.time() + 5)).failures == []
            statuses = await coordinator.status(time.time() + 5)
    for role in PREPARE_ORDER:
        exported = first[role].fake.export(None)
        installed = second[role].fake.installed
        assert [(r.rollout_id, r.data) for r in installed] == [
            (r.rollout_id, r.data) for r in exported
        ]
        assert second[role].fake.install_attempt == 1
    assert {s.attempt for s in statuses.statuses} == {1}
    assert {s.phase for s in statuses.statuses} == {Phase.IDLE}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_http_participant_maps_errors_and_gives_up_at_the_deadline(tmp_path: Path) -> None:
    members = _members(tmp_path, rollouts={})
    async with _served({Role.ENVIRONMENT: members[Role.ENVIRONMENT]}) as urls:
        async with HttpParticipantClient(
            Role.ENVIRONMENT, urls[Role.ENVIRONMENT], token="wrong"
        ) as bad:
            with pytest.raises(ParticipantError) as refused:
                await bad.status(time.time() + 5)
            assert refused.value.code is ErrorCode.UNAUTHORIZED
            assert refused.value.status_code == 401
            assert refused.value.instance == "environment-0"
        async with HttpParticipantClient(
            Role.ENVIRONMENT, urls[Role.ENVIRONMENT], token=TOKEN
        ) as ok:
            with pytest.raises(ParticipantError) as unknown:
                await ok.commit(CommitRequest(checkpoint_id="x", deadline_ts=time.time() + 5))
            assert unknown.value.code is ErrorCode.UNKNOWN_CHECKPOINT

    nobody = f"http://127.0.0.1:{_free_port()}"
    async with HttpParticipantClient(
        Role.MODEL, nobody, token=TOKEN, reply_margin_seconds=0.1
    ) as gone:
        with anyio.fail_after(WAIT), pytest.raises(ParticipantError) as unreachable:
            await gone.status(time.time() + 0.3)
    assert unreachable.value.code is ErrorCode.UNREACHABLE
    assert "ClientConnectorError" in unreachable.value.detail  # aiohttp's refused connection


async def test_http_participant_without_an_answer_is_unresponsive_at_its_deadline() -> None:
    """A participant that takes the call and never answers: the call ends at its deadline plus
    the reply margin (not before, not rounded up), unresponsive, and is not sent again."""
    connections = 0

    async def never_answer(stream: anyio.abc.SocketStream) -> None:
        nonlocal connections
        connections += 1
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                while True:
                    await stream.receive()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, never_answer)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with HttpParticipantClient(
            Role.MODEL, f"http://127.0.0.1:{port}", token=TOKEN, reply_margin_seconds=0.2
        ) as silent:
            request = PrepareRequest(checkpoint_id="x", deadline_ts=time.time() + 0.3)
            started = time.monotonic()
            with anyio.fail_after(WAIT), pytest.raises(ParticipantError) as unresponsive:
                await silent.prepare(request)
            took = time.monotonic() - started
        group.cancel_scope.cancel()
    assert unresponsive.value.code is ErrorCode.UNRESPONSIVE
    assert "got no answer by its deadline" in unresponsive.value.detail
    assert 0.45 <= took < 1.5, took
    assert connections == 1, "a call that got no answer in time is not retried"


# --- the CLI --------------------------------------------------------------------------------


def _participant_args(urls: dict[Role, str]) -> list[str]:
    args: list[str] = []
    for role in PREPARE_ORDER:
        args += ["--participant", f"{role.value}={urls[role]}"]
    return args


@pytest.mark.parametrize(
    "gym_roles", [(), (Role.ENVIRONMENT, Role.MODEL)], ids=["ours", "gym-environment-and-model"]
)
async def test_cli_checkpoint_in_a_separate_process_then_restore(
    tmp_path: Path, gym_roles: tuple[Role, ...]
) -> None:
    """`rollout-coordinate` checkpoints and restores a set; in the second case two of its
    participants speak only NeMo Gym's dialect, which the CLI finds by asking them."""
    env = {**os.environ, "ROLLOUT_CONTROL_TOKEN": TOKEN}
    with anyio.fail_after(WAIT * 3):
        async with _served(_members(tmp_path, gym_roles=gym_roles)) as urls:
            command = [sys.executable, "-m", "rollout_protocol._cli", "checkpoint"]
            command += [*_participant_args(urls), "--dir", str(tmp_path), "--checkpoint-id", "c1"]
            done = await anyio.run_process(command, env=env, check=False)
        assert done.returncode == 0, done.stderr.decode()
        summary = json.loads(done.stdout)
        assert summary["ok"] is True
        assert summary["reason"] == "Published"
        assert "prepare environment" in done.stderr.decode()
        published = storage.read_checkpoint_manifest(tmp_path, "demo", "c1")
        assert published.attempt == 0
        # a Gym participant's commit lists its rollouts, kept for its restore (which must name
        # them); ours restore every record they wrote, so nothing is kept for them
        kept = {entry.role: entry.rollout_ids for entry in published.participants}
        records = {Role.ENVIRONMENT: ["r1", "r2", "r3"], Role.MODEL: ["r1", "r2"]}
        assert kept == {role: records[role] if role in gym_roles else None for role in kept}

        fresh = _members(tmp_path, attempt=1, rollouts={}, gym_roles=gym_roles)
        async with _served(fresh) as urls:
            out, err = io.StringIO(), io.StringIO()
            # no --episode: a Gym participant is named the rollouts checkpoint.json kept for it
            code = await coordination_cli.run(
                ["restore", *_participant_args(urls), "--dir", str(tmp_path)],
                out=out,
                err=err,
                environ={"ROLLOUT_CONTROL_TOKEN": TOKEN},
            )
    assert code == 0, err.getvalue()
    restored = json.loads(out.getvalue())
    assert restored["ok"] is True
    assert restored["restore"]["attempt"] == 1
    assert fresh[Role.ENVIRONMENT].fake.install_attempt == 1


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["status", "--participant", "environment=http://127.0.0.1:1"], {}, "is not set"),
        (["status", "--participant", "nobody=http://x"], {"T": "t"}, "role must be one of"),
        (
            ["checkpoint", "--participant", "model=http://x"],
            {"ROLLOUT_CONTROL_TOKEN": "t"},
            "--dir",
        ),
        (
            ["status", "--participant", "model=http://a", "--participant", "model-0=http://b"],
            {"ROLLOUT_CONTROL_TOKEN": "t"},
            "given twice",
        ),
    ],
)
async def test_cli_usage_errors_exit_2_with_a_clear_message(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    err = io.StringIO()
    code = await coordination_cli.run(argv, out=io.StringIO(), err=err, environ=environ)
    assert code == coordination_cli.EXIT_USAGE
    assert message in err.getvalue()


async def test_cli_unreachable_participant_exits_1(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = ["checkpoint", "--participant", f"environment=http://127.0.0.1:{_free_port()}"]
    argv += ["--dir", str(tmp_path), "--timeout", "0.3"]
    with anyio.fail_after(WAIT):
        code = await coordination_cli.run(
            argv, out=out, err=err, environ={"ROLLOUT_CONTROL_TOKEN": TOKEN}
        )
    assert code == coordination_cli.EXIT_FAILED
    assert "cannot reach environment-0" in err.getvalue()
    assert json.loads(out.getvalue())["ok"] is False
