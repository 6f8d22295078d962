"""A standby's identity is all or nothing: hostile and failing restores of a standby participant.

A standby (`ROLLOUT_STANDBY=1`) becomes the instance an adopting restore names
(`RestoreRequest.index`). These cases drive a real control plane (FastAPI through httpx's ASGI
transport, records on the real filesystem under tmp_path) with a standby participant below it and
assert docs/protocol.md, "Restore and replay": a repeated restore is replayed only when it asks
for what was restored (another index is refused, never answered with the other instance's
reply), and a restore that fails leaves the standby a standby with its own instance, so the right
restore still succeeds afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rollout_protocol import (
    API_PREFIX,
    MAX_INSTANCE_INDEX,
    ControlPlane,
    ControlSettings,
    EpisodeId,
    ErrorCode,
    Record,
    RestoreReply,
    Role,
    StatusReply,
)
from shared import refused
from testsupport.controlplane import call, served
from testsupport.participants import FakeParticipant

TOKEN = "control-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


def _settings(root: Path, **overrides: Any) -> ControlSettings:
    values: dict[str, Any] = {
        "role": Role.ENVIRONMENT,
        "set_name": "adv",
        "checkpoint_root": root,
        "token": TOKEN,
    }
    values.update(overrides)
    return ControlSettings(**values)


async def _checkpoint_instances(root: Path, rollouts_by_index: dict[int, list[str]]) -> None:
    """Checkpoint `ck` of instances environment-<index>, each with its own rollouts."""
    for index, rollouts in rollouts_by_index.items():
        participant = FakeParticipant(index=index, rollouts=rollouts)
        async with served(ControlPlane(participant, _settings(root, index=index)), TOKEN) as client:
            for route in ("prepare", "commit", "resume"):
                done = await call(client, route, checkpoint_id="ck")
                assert done.status_code == 200, done.text


async def _restore(client: httpx.AsyncClient, **extra: Any) -> httpx.Response:
    body = {"checkpoint_id": "ck", "deadline_ts": _deadline(), "attempt": 1, **extra}
    return await client.post(f"{API_PREFIX}/restore", json=body)


async def _status(client: httpx.AsyncClient) -> StatusReply:
    response = await client.get(f"{API_PREFIX}/status")
    assert response.status_code == 200, response.text
    return StatusReply.model_validate_json(response.content)


async def _still_a_standby(client: httpx.AsyncClient, participant: FakeParticipant) -> None:
    status = await _status(client)
    assert status.standby is True, f"a failed restore took the identity: {status}"
    assert status.instance == "environment-0", "the standby keeps its own instance"
    assert status.attempt == 0
    assert participant.install_calls == 0, "nothing was installed"


async def _the_right_restore_adopts(client: httpx.AsyncClient) -> None:
    """After whatever the test tried, the correct restore (index 1) still adopts the standby."""
    right = await _restore(client, index=1)
    assert right.status_code == 200, right.text
    status = await _status(client)
    assert (status.instance, status.standby, status.attempt) == ("environment-1", False, 1)


class FailingInstall(FakeParticipant):
    """A standby whose first install fails (a broken engine, a full disk): after the records
    verified, the last step of the restore."""

    def __init__(self) -> None:
        super().__init__()
        self.failures_left = 1

    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        if self.failures_left > 0:
            self.failures_left -= 1
            raise RuntimeError("the engine did not take the records")
        return await super().install(records, attempt)


async def test_a_repeated_restore_as_another_index_is_refused_not_replayed(
    tmp_path: Path,
) -> None:
    await _checkpoint_instances(tmp_path, {0: ["r0"], 1: ["r1"]})
    standby = FakeParticipant()
    async with served(ControlPlane(standby, _settings(tmp_path, standby=True)), TOKEN) as client:
        first = await _restore(client, index=1)
        assert first.status_code == 200, first.text
        assert (await _status(client)).instance == "environment-1"

        other = await _restore(client, index=0)
        detail = refused(other, ErrorCode.CONFLICTING_CHECKPOINT, 409)
        assert "'environment-1', now 'environment-0'" in detail, detail
        status = await _status(client)
        assert status.instance == "environment-1", "it stays the instance it was restored as"
        assert [r.rollout_id for r in standby.installed] == ["r1"]
        assert standby.install_calls == 1

        for same in ({"index": 1}, {}):  # a retry of the same restore is still replayed
            again = await _restore(client, **same)
            assert again.status_code == 200, again.text
            assert RestoreReply.model_validate_json(again.content) == (
                RestoreReply.model_validate_json(first.content)
            )
        assert standby.install_calls == 1

        scoped = await _restore(client, index=1, rollout_ids=["r1", "r9"])
        refused(scoped, ErrorCode.CONFLICTING_CHECKPOINT, 409)


async def test_a_restore_of_an_index_without_records_leaves_the_standby_a_standby(
    tmp_path: Path,
) -> None:
    await _checkpoint_instances(tmp_path, {1: ["r1"]})
    standby = FakeParticipant()
    async with served(ControlPlane(standby, _settings(tmp_path, standby=True)), TOKEN) as client:
        missing = await _restore(client, index=2)
        refused(missing, ErrorCode.RECORDS_UNREACHABLE, 422)
        await _still_a_standby(client, standby)

        await _the_right_restore_adopts(client)
        assert [r.rollout_id for r in standby.installed] == ["r1"]


async def test_an_index_too_long_for_a_path_is_refused_as_invalid_before_any_io(
    tmp_path: Path,
) -> None:
    await _checkpoint_instances(tmp_path, {1: ["r1"]})
    standby = FakeParticipant()
    async with served(ControlPlane(standby, _settings(tmp_path, standby=True)), TOKEN) as client:
        for index in (10**300, MAX_INSTANCE_INDEX + 1):
            refusal = await _restore(client, index=index)
            detail = refused(refusal, ErrorCode.INVALID_REQUEST, 422)
            assert "index" in detail, detail
            await _still_a_standby(client, standby)
        too_long = await _restore(client, source_instance="environment-" + "9" * 300)
        refused(too_long, ErrorCode.INVALID_REQUEST, 422)
        await _still_a_standby(client, standby)

        await _the_right_restore_adopts(client)


async def test_a_restore_whose_install_fails_gives_the_identity_back(tmp_path: Path) -> None:
    await _checkpoint_instances(tmp_path, {1: ["r1"]})
    standby = FailingInstall()
    async with served(ControlPlane(standby, _settings(tmp_path, standby=True)), TOKEN) as client:
        failed = await _restore(client, index=1)
        refused(failed, ErrorCode.INTERNAL, 500)
        await _still_a_standby(client, standby)
        assert standby.admission_open, "the failed install reopened admission"

        await _the_right_restore_adopts(client)
