"""Persist after resume: the cut inside the pause, the persist after it (docs/protocol.md,
"Persist after resume").

The control planes are real (the conformance kit's `serve_app`, each app on its own loopback
port, lifespan on so the watchdogs run), reached through `HttpParticipantClient`; what they
hold is a `FakeParticipant` (below the layer these tests are about). Storage is real files with
fsync under `tmp_path`.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Collection
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
import pytest
from fastapi import FastAPI
from rollout_protocol import (
    PREPARE_ORDER,
    Capability,
    CommitReply,
    CommitRequest,
    ControlConfigError,
    ControlPlane,
    ControlSettings,
    Coordinator,
    Dialect,
    DiscardReply,
    DiscardRequest,
    ErrorCode,
    HttpParticipantClient,
    ParticipantError,
    PersistRequest,
    PrepareReply,
    PrepareRequest,
    RemoveRequest,
    ResumeReply,
    ResumeRequest,
    Role,
    StatusReply,
)
from rollout_protocol import _storage as storage
from rollout_protocol._wire import API_PREFIX, CAPABILITY_REPLY_FIELDS
from rollout_protocol.conformance import serve_app
from testsupport.delegating import Delegating
from testsupport.participants import FakeParticipant

TOKEN = "persist-test-token"
WAIT = 10.0
"""Upper bound for a whole scenario; reaching it is a failure, not a delay."""
SET = "demo"
ROLLOUTS = ["r1", "r2", "r3"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


pytestmark = pytest.mark.anyio


class Journal(Delegating[HttpParticipantClient]):
    """Wraps a participant client, journaling the calls in the order they start."""

    def __init__(self, inner: HttpParticipantClient, journal: list[tuple[str, str]]) -> None:
        super().__init__(inner)
        self.journal = journal

    def _log(self, operation: str) -> None:
        self.journal.append((self.instance, operation))

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        self._log("prepare")
        return await self.inner.prepare(request)

    async def commit(self, request: CommitRequest) -> CommitReply:
        self._log("commit")
        return await self.inner.commit(request)

    async def resume(self, request: ResumeRequest) -> ResumeReply:
        self._log("resume")
        return await self.inner.resume(request)

    async def persist(self, request: PersistRequest) -> CommitReply:
        self._log("persist")
        return await self.inner.persist(request)

    async def discard(self, request: DiscardRequest) -> DiscardReply:
        self._log("discard")
        return await self.inner.discard(request)


class OlderSdkFake(Journal):
    """A fake of a participant built on an SDK before `persist_after_resume`: it refuses the
    field as unknown, as its strict request model does, before doing anything (a fake below
    the coordinator, which is the layer under test), and has no persist or discard route."""

    async def commit(self, request: CommitRequest) -> CommitReply:
        if request.persist_after_resume is not None:
            self._log("commit refused")
            raise ParticipantError(
                ErrorCode.INVALID_REQUEST,
                "persist_after_resume: Extra inputs are not permitted",
                self.instance,
                422,
            )
        return await super().commit(request)

    async def persist(self, request: PersistRequest) -> CommitReply:
        raise AssertionError("an older participant is never asked to persist")

    async def discard(self, request: DiscardRequest) -> DiscardReply:
        raise AssertionError("an older participant is never asked to discard")


@dataclass
class Member:
    fake: FakeParticipant
    plane: ControlPlane
    app: FastAPI


@dataclass
class Set:
    members: dict[Role, Member]
    clients: dict[Role, Journal] = field(default_factory=dict)
    journal: list[tuple[str, str]] = field(default_factory=list)

    def coordinator(self, **options: Any) -> Coordinator:
        return Coordinator([self.clients[role] for role in PREPARE_ORDER], **options)

    def calls(self, operation: str) -> list[str]:
        return [instance for instance, op in self.journal if op == operation]


def _members(
    root: Path, *, gym_roles: Collection[Role] = (), **settings: Any
) -> dict[Role, Member]:
    members: dict[Role, Member] = {}
    for role in PREPARE_ORDER:
        fake = FakeParticipant(role, rollouts=ROLLOUTS)
        dialects = (Dialect.GYM,) if role in gym_roles else (Dialect.ROLLOUT,)
        plane = ControlPlane(
            fake,
            ControlSettings(
                role=role,
                set_name=SET,
                checkpoint_root=root,
                token=TOKEN,
                dialects=dialects,
                **settings,
            ),
        )
        app = FastAPI()
        plane.install(app)
        members[role] = Member(fake, plane, app)
    return members


@asynccontextmanager
async def _served(members: dict[Role, Member], older: Collection[Role] = ()) -> AsyncIterator[Set]:
    served_set = Set(members)
    async with AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for role, member in members.items():
            served = await stack.enter_async_context(serve_app(member.app, role=role, token=TOKEN))
            inner = HttpParticipantClient(role, served.target.base_url, token=TOKEN, client=session)
            wrap = OlderSdkFake if role in older else Journal
            served_set.clients[role] = wrap(inner, served_set.journal)
        yield served_set


def _instance_dir(root: Path, checkpoint_id: str, role: Role) -> Path:
    return root / SET / checkpoint_id / f"{role.value}-0"


async def _cut(coordinator: Coordinator, checkpoint_id: str) -> Any:
    prepared = await coordinator.prepare(checkpoint_id, time.time() + 5)
    assert prepared.ready, prepared.failures
    return await coordinator.commit(
        checkpoint_id, time.time() + 5, prepared.scope(), persist_after_resume=True
    )


# --- the cut, the resume, the persist --------------------------------------------------------


async def test_the_cut_holds_the_records_unwritten_and_the_persist_writes_them_unchanged(
    tmp_path: Path,
) -> None:
    members = _members(tmp_path)
    async with _served(members) as rset:
        coordinator = rset.coordinator()
        with anyio.fail_after(WAIT):
            cut = await _cut(coordinator, "ck-1")
            assert cut.ok, cut.failures
            assert sorted(cut.held) == sorted(f"{r.value}-0" for r in PREPARE_ORDER)
            assert not cut.durable
            for role in PREPARE_ORDER:
                directory = _instance_dir(tmp_path, "ck-1", role)
                assert not (directory / storage.MANIFEST_NAME).exists(), "nothing durable yet"
                status = await rset.clients[role].status(time.time() + 5)
                assert Capability.PERSIST_AFTER_RESUME in status.capabilities
                assert status.held_bytes == cut.manifests[f"{role.value}-0"].bytes
            await coordinator.resume("ck-1", time.time() + 5)
            # episodes run on after the cut: their steps move, one finishes, one begins
            for member in members.values():
                member.fake.steps = {rollout: 99 for rollout in member.fake.steps}
                member.fake.live.pop("r1")
                member.fake.live["r4"] = 0
                member.fake.steps["r4"] = 1
            persisted = await coordinator.persist("ck-1", time.time() + 5, cut=cut)
        assert persisted.ok, persisted.failures
        assert persisted.durable
        assert persisted.manifests == cut.manifests, "the manifests the cut promised"
        assert persisted.manifest_paths == cut.manifest_paths
        for role in PREPARE_ORDER:
            manifest, records = storage.read_records(
                _instance_dir(tmp_path, "ck-1", role), expect_checkpoint_id="ck-1"
            )
            assert manifest == cut.manifests[f"{role.value}-0"]
            assert [(r.rollout_id, r.data["step"]) for r in records] == [
                ("r1", 1),
                ("r2", 1),
                ("r3", 1),
            ], "the records as they were at the cut, nothing that ran after it"
            status = await rset.clients[role].status(time.time() + 5)
            assert status.held_bytes == 0, "the bytes are released once durable"
        # a persist asked again (a coordinator that restarted) replays the durable reply
        again = await coordinator.persist("ck-1", time.time() + 5, cut=cut)
        assert again.manifests == persisted.manifests
        assert again.ok


async def test_the_composed_checkpoint_resumes_before_it_persists_and_publishes_last(
    tmp_path: Path,
) -> None:
    async with _served(_members(tmp_path)) as rset:
        with anyio.fail_after(WAIT):
            result = await rset.coordinator().checkpoint(
                "ck-1",
                prepare_timeout=5,
                commit_timeout=5,
                publish_dir=tmp_path,
                set_name=SET,
                persist_after_resume=True,
            )
        assert result.ok, result.message
        assert result.reason == "Published"
        order = [op for _, op in rset.journal if op in ("commit", "resume", "persist")]
        assert order == ["commit"] * 4 + ["resume"] * 4 + ["persist"] * 4, order
        assert result.commit is not None
        assert result.commit.durable
        assert result.durations.persist_seconds > 0
        assert result.durations.pause_seconds <= result.durations.total_seconds
    published = storage.read_checkpoint_manifest(tmp_path, SET, "ck-1")
    assert sorted(p.instance for p in published.participants) == sorted(
        f"{role.value}-0" for role in PREPARE_ORDER
    )
    for participant in published.participants:
        manifest = storage.read_manifest((tmp_path / participant.manifest_path).parent)
        assert manifest.records_sha256 == participant.records_sha256


async def test_a_set_mixing_old_and_new_participants_is_cut_where_it_can_be(
    tmp_path: Path,
) -> None:
    """The model speaks NeMo Gym's dialect (no such capability there), the resources run an
    older SDK (it refuses the field): both commit durably inside the pause, the others cut; the
    persist asks only those that cut, and the checkpoint publishes all four."""
    members = _members(tmp_path, gym_roles=(Role.MODEL,))
    async with _served(members, older=(Role.RESOURCES,)) as rset:
        with anyio.fail_after(WAIT):
            result = await rset.coordinator().checkpoint(
                "ck-1",
                prepare_timeout=5,
                commit_timeout=5,
                publish_dir=tmp_path,
                set_name=SET,
                persist_after_resume=True,
            )
        assert result.ok, result.message
        assert sorted(rset.calls("persist")) == ["agent-0", "environment-0"]
        assert rset.calls("commit refused") == ["resources-0"]
        assert rset.calls("commit").count("resources-0") == 1, "committed again, the old way"
        first_resume = min(i for i, (_, op) in enumerate(rset.journal) if op == "resume")
        resources_commit = rset.journal.index(("resources-0", "commit"))
        assert resources_commit < first_resume, "the old way: durable inside the pause"
    published = storage.read_checkpoint_manifest(tmp_path, SET, "ck-1")
    assert len(published.participants) == 4
    for participant in published.participants:
        storage.read_records(
            (tmp_path / participant.manifest_path).parent, expect_checkpoint_id="ck-1"
        )


# --- the memory bound --------------------------------------------------------------------------


async def test_a_second_cut_past_the_bound_is_refused_with_a_reason_until_the_first_persists(
    tmp_path: Path,
) -> None:
    members = _members(tmp_path, max_held_bytes=1)
    async with _served(members) as rset:
        coordinator = rset.coordinator()
        with anyio.fail_after(WAIT):
            first = await _cut(coordinator, "ck-1")
            assert first.ok, "a lone cut is taken, whatever the bound"
            await coordinator.resume("ck-1", time.time() + 5)
            second = await _cut(coordinator, "ck-2")
            assert not second.ok
            assert {f.code for f in second.failures} == {ErrorCode.PERSIST_BACKLOG}
            assert "ROLLOUT_MAX_HELD_BYTES" in second.failures[0].detail
            assert "ck-1" in second.failures[0].detail
            await coordinator.abort("ck-2", time.time() + 5)
            persisted = await coordinator.persist("ck-1", time.time() + 5, cut=first)
            assert persisted.ok
            third = await _cut(coordinator, "ck-3")
            assert third.ok, "the bytes of a durable persist no longer count"
            await coordinator.resume("ck-3", time.time() + 5)
            assert (await coordinator.persist("ck-3", time.time() + 5, cut=third)).ok


async def test_remove_refuses_the_records_of_a_cut_still_held(tmp_path: Path) -> None:
    members = _members(tmp_path)
    async with _served(members) as rset:
        coordinator = rset.coordinator()
        with anyio.fail_after(WAIT):
            cut = await _cut(coordinator, "ck-1")
            await coordinator.resume("ck-1", time.time() + 5)
            with pytest.raises(ParticipantError) as refused:
                await rset.clients[Role.AGENT].inner.remove(
                    RemoveRequest(deadline_ts=time.time() + 5, checkpoint_ids=["ck-1"])
                )
            assert refused.value.code is ErrorCode.CONFLICTING_CHECKPOINT
            assert (await coordinator.persist("ck-1", time.time() + 5, cut=cut)).ok


# --- a persist that fails, is discarded, or is never asked -------------------------------------


async def test_a_failed_persist_releases_the_bytes_and_leaves_no_file_a_restore_would_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = _members(tmp_path)
    async with _served(members) as rset:
        coordinator = rset.coordinator()
        with anyio.fail_after(WAIT):
            cut = await _cut(coordinator, "ck-1")
            await coordinator.resume("ck-1", time.time() + 5)

            def full(temp: Path, final: Path) -> bool:
                raise OSError(errno.ENOSPC, "No space left on device")

            # the records file is renamed into place, then creating the manifest fails
            monkeypatch.setattr(storage, "_create_once", full)
            persisted = await coordinator.persist("ck-1", time.time() + 5, cut=cut)
            monkeypatch.undo()
        assert not persisted.ok
        assert {f.code for f in persisted.failures} == {ErrorCode.STORAGE_FAILED}
        assert "ENOSPC" in persisted.failures[0].detail
        for role in PREPARE_ORDER:
            assert not _instance_dir(tmp_path, "ck-1", role).exists(), "partial files removed"
            status = await rset.clients[role].status(time.time() + 5)
            assert status.held_bytes == 0
        with pytest.raises(ParticipantError) as stale:
            await rset.clients[Role.AGENT].persist(
                PersistRequest(checkpoint_id="ck-1", deadline_ts=time.time() + 5)
            )
        assert stale.value.code is ErrorCode.STORAGE_FAILED, "the failure is answered again"
        restored = await coordinator.restore("ck-1", 1, time.time() + 5)
        assert not restored.ok
        assert {f.code for f in restored.failures} == {ErrorCode.RECORDS_UNREACHABLE}


async def test_a_discarded_cut_is_released_and_cannot_be_persisted(tmp_path: Path) -> None:
    members = _members(tmp_path)
    async with _served(members) as rset:
        coordinator = rset.coordinator()
        with anyio.fail_after(WAIT):
            cut = await _cut(coordinator, "ck-1")
            await coordinator.resume("ck-1", time.time() + 5)
            discarded = await coordinator.discard("ck-1", time.time() + 5, cut=cut)
            assert sorted(discarded.discarded) == sorted(cut.held)
            assert not discarded.failures
            persisted = await coordinator.persist("ck-1", time.time() + 5, cut=cut)
        assert {f.code for f in persisted.failures} == {ErrorCode.STALE_CHECKPOINT}
        assert not (tmp_path / SET / "ck-1").exists(), "the folders made ahead went too"


async def test_a_cut_whose_lease_lapses_without_a_persist_is_released_by_the_participant(
    tmp_path: Path,
) -> None:
    members = _members(tmp_path, lease_grace_seconds=0.2)
    async with _served(members) as rset:
        coordinator = rset.coordinator()
        with anyio.fail_after(WAIT):
            prepared = await coordinator.prepare("ck-1", time.time() + 5)
            cut = await coordinator.commit(
                "ck-1", time.time() + 0.3, prepared.scope(), persist_after_resume=True
            )
            assert cut.ok
            await coordinator.resume("ck-1", time.time() + 5)
            agent = rset.clients[Role.AGENT]
            while True:  # polls a condition; the scenario's bound is WAIT
                if not (await agent.status(time.time() + 5)).held_bytes:
                    break
                await anyio.sleep(0.02)
            with pytest.raises(ParticipantError) as lapsed:
                await agent.persist(
                    PersistRequest(checkpoint_id="ck-1", deadline_ts=time.time() + 5)
                )
        assert lapsed.value.code is ErrorCode.STALE_CHECKPOINT
        assert "lease lapsed" in lapsed.value.detail


async def test_a_participant_that_restarted_cannot_persist_and_the_checkpoint_fails(
    tmp_path: Path,
) -> None:
    """The cut's records lived in the process that crashed: its successor knows no such cut
    (`unknown_checkpoint`), the persist fails, and the others' records are discarded."""
    members = _members(tmp_path)
    async with _served(members) as rset:
        coordinator = rset.coordinator()
        with anyio.fail_after(WAIT):
            cut = await _cut(coordinator, "ck-1")
            await coordinator.resume("ck-1", time.time() + 5)
            restarted = _members(tmp_path)[Role.MODEL]
            async with (
                serve_app(restarted.app, role=Role.MODEL, token=TOKEN) as served,
                aiohttp.ClientSession() as session,
            ):
                rset.clients[Role.MODEL] = Journal(
                    HttpParticipantClient(
                        Role.MODEL, served.target.base_url, token=TOKEN, client=session
                    ),
                    rset.journal,
                )
                coordinator = rset.coordinator()
                persisted = await coordinator.persist("ck-1", time.time() + 5, cut=cut)
                assert [f.instance for f in persisted.failures] == ["model-0"]
                assert persisted.failures[0].code is ErrorCode.UNKNOWN_CHECKPOINT
                await coordinator.discard("ck-1", time.time() + 5, cut=cut)
        assert not (tmp_path / SET / "ck-1").exists(), "nothing of the failed checkpoint stays"


_CRASH_MID_PERSIST = """
import os, sys
from pathlib import Path
from rollout_protocol import Record, Role, encode_record
from rollout_protocol import _storage as storage

def crash(*_args):
    os._exit(137)  # the process dies where the manifest would have been created

storage._create_once = crash
encoded = [encode_record(Record(kind="boundary", rollout_id=f"r{i}", attempt=0)) for i in range(3)]
storage.write_records(
    Path(sys.argv[1]), role=Role.AGENT, instance="agent-0", checkpoint_id="ck-1", attempt=0,
    encoded=encoded,
)
"""


async def test_a_participant_crashing_mid_persist_leaves_no_checkpoint_a_restore_would_take(
    tmp_path: Path,
) -> None:
    """A real process writes a cut's records and dies (SIGKILL-like exit) at the instant the
    manifest would be created: the records file is in place, the manifest is not. No restore
    takes that (the manifest is what makes a checkpoint), and a discard by the restarted
    participant removes the leftovers."""
    directory = _instance_dir(tmp_path, "ck-1", Role.AGENT)
    with anyio.fail_after(60):
        crashed = await anyio.run_process(
            [sys.executable, "-c", _CRASH_MID_PERSIST, str(directory)], check=False
        )
    assert crashed.returncode == 137, crashed.stderr.decode()
    left = sorted(os.listdir(directory))
    assert any(name.startswith("records-") for name in left), left
    assert storage.MANIFEST_NAME not in left
    with pytest.raises(storage.RecordsMissing):
        storage.read_records(directory, expect_checkpoint_id="ck-1")

    members = _members(tmp_path)  # the restarted participants
    async with _served(members) as rset:
        coordinator = rset.coordinator()
        with anyio.fail_after(WAIT):
            restored = await coordinator.restore("ck-1", 1, time.time() + 5)
            assert not restored.ok
            assert "agent-0" in {f.instance for f in restored.failures}
            reply = await rset.clients[Role.AGENT].discard(
                DiscardRequest(checkpoint_id="ck-1", deadline_ts=time.time() + 5)
            )
        assert reply.removed
        assert not reply.discarded
        assert not directory.exists()


async def test_a_durable_commit_answers_a_persist_with_itself(tmp_path: Path) -> None:
    """A commit made the old way is durable already: a persist of it (a coordinator that asks
    every participant) replays its reply instead of refusing."""
    async with _served(_members(tmp_path)) as rset:
        coordinator = rset.coordinator()
        with anyio.fail_after(WAIT):
            prepared = await coordinator.prepare("ck-1", time.time() + 5)
            committed = await coordinator.commit("ck-1", time.time() + 5, prepared.scope())
            assert committed.ok
            assert committed.durable
            await coordinator.resume("ck-1", time.time() + 5)
            persisted = await coordinator.persist("ck-1", time.time() + 5)
        assert persisted.ok, persisted.failures
        assert persisted.manifests == committed.manifests


# --- versioning and settings -----------------------------------------------------------------


def test_a_commit_that_does_not_ask_for_the_cut_carries_no_new_field() -> None:
    """An older participant refuses unknown fields: a commit the old way must not carry one."""
    old_way = CommitRequest(checkpoint_id="ck-1", deadline_ts=time.time() + 5)
    assert "persist_after_resume" not in old_way.model_dump_json(exclude_none=True)
    cut = CommitRequest(
        checkpoint_id="ck-1", deadline_ts=time.time() + 5, persist_after_resume=True
    )
    assert '"persist_after_resume":true' in cut.model_dump_json(exclude_none=True)


async def test_an_older_coordinator_reads_a_new_participants_replies(tmp_path: Path) -> None:
    """An older coordinator (an operator not yet upgraded) names no capability and reads replies
    strictly: a new participant leaves the capabilities' reply fields out of what it answers
    it, and answers them to a coordinator that names them."""
    new_fields = frozenset().union(*CAPABILITY_REPLY_FIELDS.values())
    old_status = set(StatusReply.model_fields) - new_fields
    old_commit = set(CommitReply.model_fields) - new_fields
    member = _members(tmp_path)[Role.AGENT]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with serve_app(member.app, role=Role.AGENT, token=TOKEN) as served:
        url = served.target.base_url + API_PREFIX
        async with httpx.AsyncClient(timeout=WAIT) as http:
            status = (await http.get(f"{url}/status", headers=auth)).json()
            assert set(status) <= old_status, set(status) - old_status
            body = {"checkpoint_id": "ck-1", "deadline_ts": time.time() + 5}
            prepared = await http.post(f"{url}/prepare", json=body, headers=auth)
            assert prepared.status_code == 200, prepared.text
            committed = await http.post(f"{url}/commit", json=body, headers=auth)
            assert committed.status_code == 200, committed.text
            assert set(committed.json()) <= old_commit, set(committed.json()) - old_commit
            await http.post(f"{url}/resume", json=body, headers=auth)
            named = {**auth, "Rollout-Capabilities": Capability.PERSIST_AFTER_RESUME.value}
            status = (await http.get(f"{url}/status", headers=named)).json()
    assert status["capabilities"] == [Capability.PERSIST_AFTER_RESUME.value]
    assert status["held_bytes"] == 0


def test_the_held_bytes_bound_comes_from_the_pod_environment() -> None:
    env = {"ROLLOUT_CONTROL_TOKEN": "t", "ROLLOUT_MAX_HELD_BYTES": "1048576"}
    assert ControlSettings.from_env(Role.AGENT, environ=env).max_held_bytes == 1048576
    default = ControlSettings.from_env(Role.AGENT, environ={"ROLLOUT_CONTROL_TOKEN": "t"})
    assert default.max_held_bytes == 256 * 1024 * 1024
    with pytest.raises(ControlConfigError, match="ROLLOUT_MAX_HELD_BYTES"):
        ControlSettings.from_env(Role.AGENT, environ={**env, "ROLLOUT_MAX_HELD_BYTES": "-1"})


async def test_a_persist_slower_than_its_deadline_fails_the_call_and_a_retry_gets_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow storage: the call answers `storage_failed` at its deadline while the write goes on
    (its bytes still held and counted); a retried persist waits for the same write and answers
    durable once it ends."""
    members = _members(tmp_path)
    slow = threading.Event()
    write = storage.write_records

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        if not slow.wait(timeout=WAIT):  # a fake of a slow volume, below the control plane
            raise AssertionError("the test never let the write go on")
        return write(*args, **kwargs)

    async with _served(members) as rset:
        coordinator = rset.coordinator()
        agent = rset.clients[Role.AGENT]
        with anyio.fail_after(WAIT):
            cut = await _cut(coordinator, "ck-1")
            await coordinator.resume("ck-1", time.time() + 5)
            monkeypatch.setattr(storage, "write_records", slow_write)
            with pytest.raises(ParticipantError) as late:
                await agent.persist(
                    PersistRequest(checkpoint_id="ck-1", deadline_ts=time.time() + 0.3)
                )
            assert late.value.code is ErrorCode.STORAGE_FAILED
            assert "still being written" in late.value.detail
            assert (await agent.status(time.time() + 5)).held_bytes == cut.manifests[
                "agent-0"
            ].bytes, "held until the write ends"
            slow.set()
            persisted = await coordinator.persist("ck-1", time.time() + 5, cut=cut)
        assert persisted.ok, persisted.failures
        assert (await agent.status(time.time() + 5)).held_bytes == 0
