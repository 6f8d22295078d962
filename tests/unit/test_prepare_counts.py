"""Prepare replies carry counts and a digest, not episode lists (docs/protocol.md, "Commit scope"):
their size does not grow with the number of episodes, and the commit scope is agreed without
shipping lists.

Real control planes over the in-process FastAPI app (httpx's ASGI transport) in front of the
fake participant; storage is the real filesystem under tmp_path.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import httpx
from rollout_protocol import (
    API_PREFIX,
    Capability,
    CommitOutcome,
    CommitReply,
    ControlPlane,
    ControlSettings,
    Coordinator,
    EpisodeId,
    ErrorCode,
    ParticipantClient,
    ParticipantError,
    Phase,
    PrepareReply,
    PrepareRequest,
    Role,
)
from rollout_protocol import _storage as storage
from rollout_protocol._coordinator import PrepareOutcome, _prepare_outcome
from rollout_protocol._coordinator_persist import commit_outcome
from rollout_protocol._wire import fields_unread_by
from testsupport.controlplane import served
from testsupport.participants import FakeParticipant

TOKEN = "prepare-counts-token"


@asynccontextmanager
async def _serve(fake: FakeParticipant, root: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = ControlSettings(
        role=Role.ENVIRONMENT, set_name="demo", checkpoint_root=root, token=TOKEN
    )
    plane = ControlPlane(fake, settings)
    async with served(plane, TOKEN) as client:
        yield client


async def _prepare(rollouts: int, root: Path, **body: object) -> tuple[int, PrepareReply]:
    fake = FakeParticipant(rollouts=[f"rollout-{i:06d}" for i in range(rollouts)])
    async with _serve(fake, root) as client:
        response = await client.post(
            f"{API_PREFIX}/prepare",
            json={"checkpoint_id": "ck", "deadline_ts": time.time() + 10, **body},
        )
        assert response.status_code == 200, response.text
        await client.post(
            f"{API_PREFIX}/resume", json={"checkpoint_id": "ck", "deadline_ts": time.time() + 10}
        )
    return len(response.content), PrepareReply.model_validate_json(response.content)


async def test_a_prepare_reply_is_the_same_size_for_ten_episodes_and_ten_thousand(
    tmp_path: Path,
) -> None:
    small_size, small = await _prepare(10, tmp_path / "small")
    large_size, large = await _prepare(10_000, tmp_path / "large")
    assert (small.episode_count, large.episode_count) == (10, 10_000)
    assert small.episodes == large.episodes == []
    assert small.episodes_sha256 != large.episodes_sha256
    assert large_size - small_size <= 4, "only the count's digits differ"


async def test_a_requested_scope_lists_only_its_parked_episodes(tmp_path: Path) -> None:
    _, reply = await _prepare(10_000, tmp_path, rollout_ids=["rollout-000007", "rollout-999999"])
    assert [str(e) for e in reply.episodes] == ["rollout-000007@0"]
    assert reply.episode_count == 10_000


def _reply(instance: str, count: int) -> tuple[str, PrepareReply]:
    return instance, PrepareReply(
        checkpoint_id="ck", phase="prepared", ready=True, episode_count=count
    )


def test_the_outcome_counts_the_role_that_sees_most_and_scopes_without_lists() -> None:
    replies = dict(
        [
            _reply("environment-0", 500),
            _reply("environment-1", 400),
            _reply("agent-0", 300),
            _reply("resources-0", 900),
        ]
    )
    outcome: PrepareOutcome = _prepare_outcome("ck", replies, [], None, [])
    assert outcome.episode_count == 900
    assert outcome.scope() is None, "unrestricted: every parked episode, no list"
    assert outcome.excluded() == []
    assert outcome.committed_count(None) == 900
    assert outcome.committed_count(["a", "b"]) == 2


async def test_an_excluded_rollout_is_neither_written_nor_kept_when_restored(
    tmp_path: Path,
) -> None:
    fake = FakeParticipant(rollouts=["r1", "r2", "r3"])
    fake.restored.add("r2")
    async with _serve(fake, tmp_path) as client:
        for route, extra in (("prepare", {}), ("commit", {"excluded_rollout_ids": ["r2"]})):
            response = await client.post(
                f"{API_PREFIX}/{route}",
                json={"checkpoint_id": "ck", "deadline_ts": time.time() + 10, **extra},
            )
            assert response.status_code == 200, response.text
    _, records = storage.read_records(
        tmp_path / "demo" / "ck" / "environment-0", expect_checkpoint_id="ck"
    )
    assert [r.rollout_id for r in records] == ["r1", "r3"]
    assert fake.released == {"r2"}


class ListingOnlyParticipant:
    """A participant from before `PrepareRequest.rollout_ids`: it refuses the field (as request
    models refuse unknown fields) and lists every parked episode."""

    role = Role.ENVIRONMENT
    instance = "environment-0"

    def __init__(self) -> None:
        self.requests: list[PrepareRequest] = []

    async def prepare(self, request: PrepareRequest) -> PrepareReply:
        self.requests.append(request)
        if request.rollout_ids is not None:
            raise ParticipantError(
                ErrorCode.INVALID_REQUEST,
                "rollout_ids: Extra inputs are not permitted",
                self.instance,
                422,
            )
        return PrepareReply(
            checkpoint_id=request.checkpoint_id,
            phase=Phase.PREPARED,
            ready=True,
            episodes=[EpisodeId(rollout_id=r, attempt=0) for r in ("a", "b", "c")],
        )


async def test_a_participant_before_counts_is_asked_again_without_the_scope() -> None:
    old = ListingOnlyParticipant()
    coordinator = Coordinator([cast(ParticipantClient, old)])
    outcome = await coordinator.prepare("ck", time.time() + 10, scope=["b", "z"])
    assert outcome.ready, outcome.failures
    assert [r.rollout_ids for r in old.requests] == [["b", "z"], None]
    assert outcome.scope(["b", "z"]) == ["b"], "intersected with what it listed"
    assert outcome.episode_count == 3


def test_the_checkpoint_counts_what_the_commit_replies_say_the_records_hold() -> None:
    """A `/run` after a participant's prepare is written by a commit of the whole set: the
    count is the commit replies' (`committed_episodes`), by role as the prepare's, and the
    prepare's only where a participant did not say (an older SDK)."""
    prepared = _prepare_outcome(
        "ck", dict([_reply("environment-0", 5), _reply("environment-1", 4)]), [], None, []
    )

    def commit(**counts: int | None) -> CommitOutcome:
        replies = [
            CommitReply(
                checkpoint_id="ck",
                phase=Phase.COMMITTED,
                manifest=storage.records_manifest(
                    role=Role(instance.rsplit("_", 1)[0]),
                    instance=instance.replace("_", "-"),
                    checkpoint_id="ck",
                    attempt=0,
                    encoded=[],
                ),
                manifest_path=f"ck/{instance}/manifest.json",
                committed_episodes=count,
            )
            for instance, count in counts.items()
        ]
        return commit_outcome("ck", None, [], replies, [])

    assert prepared.episode_count == 9
    said = commit(environment_0=6, environment_1=4, model_0=2)
    assert said.episode_count(prepared) == 10
    older = commit(environment_0=6, environment_1=None, model_0=2)
    assert older.episode_count(prepared) == 9
    # a field an older coordinator does not read is left out of every reply to it, so its name
    # is never one an older coordinator reads elsewhere (the prepare reply's count)
    unread = fields_unread_by(None)
    assert "committed_episodes" in unread
    assert "episode_count" not in unread
    assert "committed_episodes" not in fields_unread_by(Capability.COMMITTED_EPISODES.value)
