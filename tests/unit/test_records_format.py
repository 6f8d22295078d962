"""Records encoded ahead (docs/design.md#45-storage-and-records): what a commit writes, what restore
reads, what it refuses.

A participant built on `EpisodeRuntime` encodes an episode's record when the episode reaches a
boundary; the commit writes those bytes as they are (records format 2, named by the digest of
the lines' digests). Restore still reads format 1: `tests/fixtures/records_v1/checkpoints` was
written by the code before this change (see its `generate.py`) and is restored here through
the control plane. HTTP goes through the real FastAPI app in process (httpx's ASGI transport),
storage is the real filesystem under tmp_path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_protocol import (
    Boundary,
    CommitReply,
    ControlPlane,
    ControlSettings,
    EpisodeRuntime,
    ErrorBody,
    ErrorCode,
    RestoreReply,
    Role,
    RuntimeParticipant,
    StepMode,
)
from rollout_protocol import _storage as storage
from testsupport.controlplane import call, served

TOKEN = "records-format-token"
FIXTURE = Path(__file__).parents[1] / "fixtures" / "records_v1" / "checkpoints"


def _returns(boundary: Boundary) -> Callable[[], Awaitable[Boundary]]:
    async def run() -> Boundary:
        return boundary

    return run


@asynccontextmanager
async def _serve(runtime: EpisodeRuntime, root: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = ControlSettings(
        role=Role.ENVIRONMENT, set_name="demo", checkpoint_root=root, token=TOKEN
    )
    plane = ControlPlane(RuntimeParticipant(Role.ENVIRONMENT, runtime), settings)
    async with served(plane, TOKEN) as client:
        yield client


async def _call(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    return await call(client, route, **body)


async def _checkpoint(client: httpx.AsyncClient, checkpoint_id: str) -> CommitReply:
    for route in ("prepare", "commit"):
        response = await _call(client, route, checkpoint_id=checkpoint_id)
        assert response.status_code == 200, response.text
    reply = CommitReply.model_validate_json(response.content)
    response = await _call(client, "resume", checkpoint_id=checkpoint_id)
    assert response.status_code == 200, response.text
    return reply


def test_the_fixture_is_format_1_and_reads_as_written() -> None:
    directory = FIXTURE / "demo" / "ck-v1" / "environment-0"
    manifest, records = storage.read_records(directory, expect_checkpoint_id="ck-v1")
    assert manifest.schema_version == 1
    raw = (directory / manifest.records_file).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == manifest.records_sha256
    assert [r.rollout_id for r in records] == ["r-walker", "r-fresh", "r-restored"]
    assert records[0].data["state"] == {"turn": 3, "said": ["héllo", "wörld"]}


async def test_a_checkpoint_written_before_encode_ahead_restores(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    runtime = EpisodeRuntime()
    async with _serve(runtime, tmp_path) as client:
        response = await _call(client, "restore", checkpoint_id="ck-v1", attempt=1)
        assert response.status_code == 200, response.text
        reply = RestoreReply.model_validate_json(response.content)
        assert sorted(str(e) for e in reply.restored) == [
            "r-fresh@1",
            "r-restored@1",
            "r-walker@1",
        ]
        assert (await _call(client, "resume", checkpoint_id="ck-v1")).status_code == 200
    walker = runtime.begin("r-walker", 1, Boundary("seed"), digest="d" * 64)
    assert walker.boundary == Boundary("turn", {"turn": 3, "said": ["héllo", "wörld"]})
    assert walker.steps_completed == 3
    assert walker.continued_from == 0
    # and the next checkpoint of the restored episodes is written in the current format
    async with _serve(runtime, tmp_path) as client:
        committed = await _checkpoint(client, "ck-v2")
    assert committed.manifest.schema_version == storage.RECORDS_FORMAT == 2
    directory = tmp_path / "demo" / "ck-v2" / "environment-0"
    _, records = storage.read_records(directory, expect_checkpoint_id="ck-v2")
    assert sorted(r.rollout_id for r in records) == ["r-fresh", "r-restored", "r-walker"]


async def test_records_are_encoded_at_the_boundary_and_the_commit_writes_those_bytes(
    tmp_path: Path,
) -> None:
    runtime = EpisodeRuntime()
    moving = runtime.begin("r-moving", 0, Boundary("a", {"n": 0}))
    runtime.begin("r-still", 0, Boundary("a", {"n": 0}))
    before = {e.record.rollout_id: e for e in runtime.export_encoded(None)}
    await runtime.step(moving, "a", StepMode.WAIT, _returns(Boundary("b", {"n": 1})))
    after = {e.record.rollout_id: e for e in runtime.export_encoded(None)}
    assert after["r-still"] is before["r-still"], "a boundary that did not move is not re-encoded"
    assert after["r-moving"] is not before["r-moving"]
    assert json.loads(after["r-moving"].line)["data"]["state"] == {"n": 1}
    async with _serve(runtime, tmp_path) as client:
        committed = await _checkpoint(client, "ck-1")
        again = {e.record.rollout_id: e for e in runtime.export_encoded(None)}
        await _checkpoint(client, "ck-2")
    assert again.keys() == after.keys()
    assert all(again[k] is after[k] for k in after), "a checkpoint re-encodes nothing"
    directory = tmp_path / "demo" / "ck-1" / "environment-0"
    written = (directory / committed.manifest.records_file).read_bytes()
    assert written == after["r-moving"].line + after["r-still"].line
    assert committed.manifest.records_sha256 == storage.records_digest(
        hashlib.sha256(line).digest() for line in written.splitlines()
    )
    _, records = storage.read_records(directory, expect_checkpoint_id="ck-1")
    assert [r.data["steps"] for r in records] == [1, 0]


def _write(directory: Path, encoded: list[storage.EncodedRecord]) -> None:
    storage.write_records(
        directory,
        role=Role.ENVIRONMENT,
        instance="environment-0",
        checkpoint_id="ck",
        attempt=0,
        encoded=encoded,
    )


def _encoded_runtime() -> list[storage.EncodedRecord]:
    runtime = EpisodeRuntime()
    for index in range(3):
        runtime.begin(f"r{index}", 0, Boundary("a", {"text": f"episode {index}"}))
    return runtime.export_encoded(None)


def test_an_encoded_record_damaged_before_the_write_is_refused_at_restore(tmp_path: Path) -> None:
    encoded = _encoded_runtime()
    # the line changed after its digest was taken (memory damage between boundary and commit)
    damaged = dataclasses.replace(encoded[1], line=encoded[1].line.replace(b"episode", b"episodf"))
    _write(tmp_path, [encoded[0], damaged, encoded[2]])
    with pytest.raises(storage.RecordsInvalid, match="has sha256"):
        storage.read_records(tmp_path, expect_checkpoint_id="ck")


@pytest.mark.parametrize("damage", ["flipped-byte", "no-final-newline", "lines-swapped"])
def test_a_format_2_file_damaged_on_disk_is_refused(tmp_path: Path, damage: str) -> None:
    _write(tmp_path, _encoded_runtime())
    manifest = storage.read_manifest(tmp_path)
    path = tmp_path / manifest.records_file
    raw = path.read_bytes()
    if damage == "flipped-byte":
        raw = raw.replace(b"episode 2", b"episode 3")
        expected = "has sha256"
    elif damage == "no-final-newline":
        raw = raw[:-1] + b" "
        expected = "does not end with a newline"
    else:
        first, second, third = raw.splitlines(keepends=True)
        raw = second + first + third
        expected = "has sha256"
    path.write_bytes(raw)
    with pytest.raises(storage.RecordsInvalid, match=expected):
        storage.read_records(tmp_path, expect_checkpoint_id="ck")


async def test_a_corrupt_format_2_checkpoint_is_refused_by_restore_before_installing(
    tmp_path: Path,
) -> None:
    runtime = EpisodeRuntime()
    runtime.begin("r1", 0, Boundary("a", {"n": 1}))
    async with _serve(runtime, tmp_path) as client:
        committed = await _checkpoint(client, "ck")
    path = tmp_path / "demo" / "ck" / "environment-0" / committed.manifest.records_file
    path.write_bytes(path.read_bytes().replace(b'"n":1', b'"n":2'))
    fresh = EpisodeRuntime()
    async with _serve(fresh, tmp_path) as client:
        response = await _call(client, "restore", checkpoint_id="ck", attempt=1)
    assert response.status_code != 200
    assert ErrorBody.model_validate_json(response.content).error.code is ErrorCode.RECORDS_INVALID
    assert fresh.restored() == []
