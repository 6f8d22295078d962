"""The participant control plane: phases, replay, ids, lease, auth, validation, storage, retire.

HTTP goes through the real FastAPI app in process (httpx's ASGI transport); the participant
below it is the in-process fake, and storage is the real filesystem under tmp_path.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from rollout_protocol import (
    API_PREFIX,
    CommitReply,
    ControlConfigError,
    ControlPlane,
    ControlSettings,
    ErrorBody,
    ErrorCode,
    Phase,
    PrepareReply,
    PrepareRequest,
    ProtocolError,
    Record,
    RestoreReply,
    Role,
    StatusReply,
)
from rollout_protocol import _storage as storage
from rollout_protocol._phases import PhaseMachine
from testsupport.participants import FakeParticipant

from devcluster.waiting import wait_for

TOKEN = "control-token-for-tests"
WAIT = 5.0
"""Upper bound for any condition a test waits on; reaching it is a failure, not a delay."""


def _deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


def _settings(root: Path | None, **overrides: Any) -> ControlSettings:
    values: dict[str, Any] = {
        "role": Role.ENVIRONMENT,
        "set_name": "demo",
        "checkpoint_root": root,
        "token": TOKEN,
    }
    values.update(overrides)
    return ControlSettings(**values)


@asynccontextmanager
async def _serve(
    plane: ControlPlane, app: FastAPI | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    app = app or FastAPI()
    plane.install(app)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        plane.running(),
        httpx.AsyncClient(
            transport=transport, base_url="http://participant", headers=headers
        ) as client,
    ):
        yield client


async def _post(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    return await client.post(f"{API_PREFIX}/{route}", json=body)


async def _ok(client: httpx.AsyncClient, route: str, checkpoint_id: str) -> httpx.Response:
    response = await _post(client, route, checkpoint_id=checkpoint_id, deadline_ts=_deadline())
    assert response.status_code == 200, response.text
    return response


def _error(response: httpx.Response) -> ErrorBody:
    return ErrorBody.model_validate_json(response.content)


def _assert_error(response: httpx.Response, code: ErrorCode, status: int) -> str:
    assert response.status_code == status, response.text
    body = _error(response)
    assert body.error.code is code, body
    return body.error.detail


async def _status(client: httpx.AsyncClient) -> StatusReply:
    response = await client.get(f"{API_PREFIX}/status")
    assert response.status_code == 200, response.text
    return StatusReply.model_validate_json(response.content)


# --- the pure phase machine -----------------------------------------------------------------


def _prepared(machine: PhaseMachine, checkpoint_id: str, *, ready: bool = True) -> PrepareReply:
    assert machine.admit_prepare(checkpoint_id, 100.0, 1.0) is None
    machine.begin_prepare(checkpoint_id)
    reply = PrepareReply(
        checkpoint_id=checkpoint_id,
        phase=Phase.PREPARED if ready else Phase.PREPARING,
        ready=ready,
    )
    machine.end_prepare(reply)
    return reply


def _code(error: pytest.ExceptionInfo[ProtocolError]) -> ErrorCode:
    return error.value.code


def test_machine_walks_idle_preparing_prepared_committed_and_resume_returns_to_idle() -> None:
    machine = PhaseMachine()
    assert machine.admit_prepare("a", 100.0, 1.0) is None
    assert machine.begin_prepare("a") is True, "first prepare closes admission"
    assert machine.phase is Phase.PREPARING
    reply = PrepareReply(checkpoint_id="a", phase=Phase.PREPARED, ready=True)
    machine.end_prepare(reply)
    assert machine.phase is Phase.PREPARED
    assert machine.admit_prepare("a", 100.0, 1.0) is reply, "a ready prepare is replayed"
    assert machine.admit_commit("a", 100.0, 1.0) is None
    assert machine.resume("a") is True
    assert machine.phase is Phase.IDLE
    assert machine.checkpoint_id is None
    assert machine.lease_expires_ts is None


def test_machine_not_ready_prepare_stays_parked_and_refuses_commit() -> None:
    machine = PhaseMachine()
    _prepared(machine, "a", ready=False)
    assert machine.phase is Phase.PREPARING
    with pytest.raises(ProtocolError) as error:
        machine.admit_commit("a", 100.0, 1.0)
    assert _code(error) is ErrorCode.WRONG_PHASE
    assert machine.admit_prepare("a", 100.0, 1.0) is None, "a retried prepare parks again"
    assert machine.begin_prepare("a") is False, "admission is already closed"


def test_machine_ids_stale_conflicting_unknown_and_deadline() -> None:
    machine = PhaseMachine()
    for call in (
        lambda: machine.admit_commit("a", 100.0, 1.0),
        lambda: machine.admit_renew("a", 100.0, 1.0),
    ):
        with pytest.raises(ProtocolError) as error:
            call()
        assert _code(error) is ErrorCode.UNKNOWN_CHECKPOINT
    with pytest.raises(ProtocolError) as error:
        machine.admit_prepare("a", 1.0, 2.0)
    assert _code(error) is ErrorCode.DEADLINE_PASSED

    _prepared(machine, "a")
    for call in (
        lambda: machine.admit_prepare("b", 100.0, 1.0),
        lambda: machine.admit_restore("b", 1, 100.0, 1.0),
        lambda: machine.resume("b"),
    ):
        with pytest.raises(ProtocolError) as error:
            call()
        assert _code(error) is ErrorCode.CONFLICTING_CHECKPOINT
    with pytest.raises(ProtocolError) as error:
        machine.admit_commit("b", 100.0, 1.0)
    assert _code(error) is ErrorCode.UNKNOWN_CHECKPOINT

    assert machine.resume("a") is True
    for call in (
        lambda: machine.admit_prepare("a", 100.0, 1.0),
        lambda: machine.admit_commit("a", 100.0, 1.0),
        lambda: machine.admit_renew("a", 100.0, 1.0),
    ):
        with pytest.raises(ProtocolError) as error:
            call()
        assert _code(error) is ErrorCode.STALE_CHECKPOINT
    assert machine.resume("a") is True, "resume is idempotent"


def test_machine_restore_goes_stale_per_attempt_and_a_late_prepare_after_resume_is_refused() -> (
    None
):
    machine = PhaseMachine()
    assert machine.resume("late") is True, "resume while idle is accepted"
    with pytest.raises(ProtocolError) as error:
        machine.admit_prepare("late", 100.0, 1.0)
    assert _code(error) is ErrorCode.STALE_CHECKPOINT

    assert machine.admit_restore("x", 1, 100.0, 1.0) is None
    reply = RestoreReply(
        checkpoint_id="x", phase=Phase.RESTORED, attempt=1, restored=[], record_count=0
    )
    machine.end_restore(1, reply)
    assert machine.admit_restore("x", 1, 100.0, 1.0) is reply
    with pytest.raises(ProtocolError) as error:
        machine.admit_prepare("x", 100.0, 1.0)
    assert _code(error) is ErrorCode.WRONG_PHASE
    machine.check_retire()  # allowed after a restore: the failed-restore path retires first
    machine.resume("x")
    with pytest.raises(ProtocolError) as error:
        machine.admit_restore("x", 1, 100.0, 1.0)
    assert _code(error) is ErrorCode.STALE_CHECKPOINT
    assert machine.admit_restore("x", 2, 100.0, 1.0) is None, "a new attempt may restore again"


def test_machine_lease_lapses_only_while_a_checkpoint_is_open() -> None:
    machine = PhaseMachine()
    machine.extend_lease(10.0)
    assert machine.expire(11.0) is None, "idle: nothing to expire"
    _prepared(machine, "a")
    machine.extend_lease(20.0)
    machine.extend_lease(15.0)
    assert machine.lease_expires_ts == 20.0, "a lease is only ever extended"
    assert machine.expire(19.9) is None
    assert machine.expire(20.0) == "a"
    assert machine.phase is Phase.IDLE
    with pytest.raises(ProtocolError) as error:
        machine.admit_commit("a", 100.0, 1.0)
    assert _code(error) is ErrorCode.STALE_CHECKPOINT


def test_machine_retire_refused_while_a_checkpoint_is_open() -> None:
    machine = PhaseMachine()
    machine.check_retire()
    _prepared(machine, "a")
    with pytest.raises(ProtocolError) as error:
        machine.check_retire()
    assert _code(error) is ErrorCode.WRONG_PHASE


# --- settings -------------------------------------------------------------------------------


def test_settings_from_env_need_a_token_or_an_explicit_flag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {
        "ROLLOUT_SET": "math",
        "ROLLOUT_INDEX": "2",
        "ROLLOUT_ATTEMPT": "3",
        "ROLLOUT_CHECKPOINT_ROOT": "/ckpt",
    }
    with pytest.raises(ControlConfigError, match="ROLLOUT_CONTROL_TOKEN"):
        ControlSettings.from_env(Role.MODEL, environ=env)
    settings = ControlSettings.from_env(Role.MODEL, environ=env, allow_unauthenticated=True)
    assert settings.instance == "model-2"
    assert (settings.set_name, settings.attempt) == ("math", 3)
    assert settings.checkpoint_root == Path("/ckpt")
    with caplog.at_level(logging.WARNING):
        ControlPlane(FakeParticipant(Role.MODEL), settings)
    assert "WITHOUT authentication" in caplog.text

    tokened = ControlSettings.from_env(Role.MODEL, environ={**env, "ROLLOUT_CONTROL_TOKEN": "t"})
    assert tokened.token == "t"
    with pytest.raises(ControlConfigError, match="ROLLOUT_ATTEMPT='x'"):
        ControlSettings.from_env(Role.MODEL, environ={**env, "ROLLOUT_ATTEMPT": "x"})
    with pytest.raises(ControlConfigError, match="set name"):
        ControlSettings(role=Role.MODEL, set_name="../x", token="t")


class Run(BaseModel):
    rollout_id: str
    attempt: int


# --- over HTTP ------------------------------------------------------------------------------


async def test_prepare_commit_resume_writes_records_and_replays_replies(tmp_path: Path) -> None:
    fake = FakeParticipant(rollouts=["r1", "r2", "r3"])
    plane = ControlPlane(fake, _settings(tmp_path))
    async with _serve(plane) as client:
        first = await _post(client, "prepare", checkpoint_id="ck", deadline_ts=_deadline())
        assert first.status_code == 200, first.text
        prepared = PrepareReply.model_validate_json(first.content)
        assert prepared.ready
        assert prepared.phase is Phase.PREPARED
        assert prepared.episodes == [], "counts and a digest, no list unless asked"
        assert prepared.episode_count == 3
        # the set digest: the sum of each id's sha256 mod 2**256, whatever the order
        terms = [hashlib.sha256(f"r{i}@0".encode()).digest() for i in (1, 2, 3)]
        total = sum(int.from_bytes(term, "big") for term in terms) % 2**256
        assert prepared.episodes_sha256 == f"{total:064x}"
        assert not fake.admission_open
        status = await _status(client)
        assert status.phase is Phase.PREPARED
        assert status.checkpoint_id == "ck"
        assert status.lease_expires_ts is not None

        again = await _post(client, "prepare", checkpoint_id="ck", deadline_ts=_deadline())
        assert again.content == first.content
        assert fake.park_calls == 1, "a replayed prepare does not park again"

        body = {"checkpoint_id": "ck", "deadline_ts": _deadline(), "rollout_ids": ["r1", "r3"]}
        committed = await client.post(f"{API_PREFIX}/commit", json=body)
        assert committed.status_code == 200, committed.text
        reply = CommitReply.model_validate_json(committed.content)
        retried = await client.post(f"{API_PREFIX}/commit", json=body)
        assert retried.content == committed.content
        assert fake.export_calls == 1, "a replayed commit does not write again"
        assert reply.manifest_path == "demo/ck/environment-0/manifest.json"
        manifest, records = storage.read_records(
            tmp_path / "demo" / "ck" / "environment-0", expect_checkpoint_id="ck"
        )
        assert manifest == reply.manifest
        assert [r.rollout_id for r in records] == ["r1", "r3"]
        assert (await _status(client)).phase is Phase.COMMITTED

        resumed = await _post(client, "resume", checkpoint_id="ck", deadline_ts=_deadline())
        assert resumed.status_code == 200, resumed.text
        assert fake.admission_open
        assert fake.reopen_count == 1
        assert (await _status(client)).phase is Phase.IDLE


async def test_stale_conflicting_unknown_and_passed_deadline_have_their_codes(
    tmp_path: Path,
) -> None:
    plane = ControlPlane(FakeParticipant(rollouts=["r1"]), _settings(tmp_path))
    async with _serve(plane) as client:
        unknown = await _post(client, "commit", checkpoint_id="nope", deadline_ts=_deadline())
        _assert_error(unknown, ErrorCode.UNKNOWN_CHECKPOINT, 404)
        renew = await _post(client, "renew", checkpoint_id="nope", deadline_ts=_deadline())
        _assert_error(renew, ErrorCode.UNKNOWN_CHECKPOINT, 404)
        passed = await _post(client, "prepare", checkpoint_id="a", deadline_ts=time.time() - 1)
        _assert_error(passed, ErrorCode.DEADLINE_PASSED, 408)

        await _ok(client, "prepare", "a")
        other = await _post(client, "prepare", checkpoint_id="b", deadline_ts=_deadline())
        assert "'a' is open" in _assert_error(other, ErrorCode.CONFLICTING_CHECKPOINT, 409)
        renewed = await _post(client, "renew", checkpoint_id="a", deadline_ts=_deadline(60))
        assert renewed.status_code == 200, renewed.text

        await _ok(client, "resume", "a")
        for route in ("prepare", "commit", "renew"):
            stale = await _post(client, route, checkpoint_id="a", deadline_ts=_deadline())
            _assert_error(stale, ErrorCode.STALE_CHECKPOINT, 410)
        again = await _post(client, "resume", checkpoint_id="a", deadline_ts=time.time() - 5)
        assert again.status_code == 200, "resume is idempotent and accepted past its deadline"


async def test_blockers_are_reported_at_the_deadline_and_resume_reopens(tmp_path: Path) -> None:
    rollouts = [f"r{i:03d}" for i in range(150)]
    fake = FakeParticipant(rollouts=[*rollouts, "free"])
    fake.stuck.update(rollouts)
    fake.restarts.add("free")
    plane = ControlPlane(fake, _settings(tmp_path))
    async with _serve(plane) as client:
        response = await _post(client, "prepare", checkpoint_id="ck", deadline_ts=_deadline(0.5))
        reply = PrepareReply.model_validate_json(response.content)
        assert not reply.ready
        assert reply.phase is Phase.PREPARING
        assert reply.blocker_count == 150
        assert len(reply.blockers) == 100, "only the first 100 blockers are listed"
        assert [e.rollout_id for e in reply.restarts] == ["free"]
        assert not fake.admission_open, "a not-ready participant stays parked"
        commit = await _post(client, "commit", checkpoint_id="ck", deadline_ts=_deadline())
        assert "not ready" in _assert_error(commit, ErrorCode.WRONG_PHASE, 409)

        await _ok(client, "resume", "ck")
        assert fake.admission_open


async def test_lease_lapse_resumes_the_participant_by_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeParticipant(rollouts=["r1"])
    plane = ControlPlane(fake, _settings(tmp_path, lease_grace_seconds=0.2))
    async with _serve(plane) as client:
        response = await _post(client, "prepare", checkpoint_id="ck", deadline_ts=_deadline(0.5))
        assert response.status_code == 200, response.text
        assert not fake.admission_open
        assert not gc.isenabled(), "prepared: the collector waits for the checkpoint to close"
        with caplog.at_level(logging.WARNING), anyio.fail_after(WAIT):
            await fake.reopened.wait()
        assert fake.admission_open
        assert plane.phase is Phase.IDLE
        assert gc.isenabled(), "the lapse closed the checkpoint"
        assert "lease of checkpoint ck lapsed" in caplog.text
        late = await _post(client, "commit", checkpoint_id="ck", deadline_ts=_deadline())
        _assert_error(late, ErrorCode.STALE_CHECKPOINT, 410)


async def test_watchdog_runs_with_the_app_lifespan(tmp_path: Path) -> None:
    fake = FakeParticipant(rollouts=["r1"])
    plane = ControlPlane(fake, _settings(tmp_path, lease_grace_seconds=0.1))
    app = FastAPI()
    plane.install(app)
    async with app.router.lifespan_context(app):
        await plane.prepare(PrepareRequest(checkpoint_id="ck", deadline_ts=_deadline(0.3)))
        with anyio.fail_after(WAIT):
            await fake.reopened.wait()
    assert plane.phase is Phase.IDLE


async def test_missing_or_wrong_token_is_401(tmp_path: Path) -> None:
    plane = ControlPlane(FakeParticipant(), _settings(tmp_path))
    async with _serve(plane) as client:
        for headers in (
            {"Authorization": ""},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {TOKEN}"},
        ):
            response = await client.get(f"{API_PREFIX}/status", headers=headers)
            _assert_error(response, ErrorCode.UNAUTHORIZED, 401)
            assert response.headers["www-authenticate"] == "Bearer"
        client.headers.pop("Authorization")
        missing = await client.post(f"{API_PREFIX}/prepare", content=b"not json")
        assert "missing" in _assert_error(missing, ErrorCode.UNAUTHORIZED, 401)
        assert plane.phase is Phase.IDLE


async def test_unauthenticated_mode_needs_no_header(tmp_path: Path) -> None:
    plane = ControlPlane(
        FakeParticipant(), _settings(tmp_path, token=None, allow_unauthenticated=True)
    )
    async with _serve(plane) as client:
        client.headers.pop("Authorization")
        assert (await _status(client)).phase is Phase.IDLE


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"checkpoint_id": "ck"}, "deadline_ts"),
        ({"checkpoint_id": "ck", "deadline_ts": "soon"}, "deadline_ts"),
        ({"checkpoint_id": "ck", "deadline_ts": "1e12"}, "deadline_ts"),
        ({"checkpoint_id": "ck", "deadline_ts": 1e12, "extra": 1}, "extra"),
        ({"checkpoint_id": "../../etc", "deadline_ts": 1e12}, "checkpoint_id"),
        ({"checkpoint_id": "a/b", "deadline_ts": 1e12}, "checkpoint_id"),
        ({"checkpoint_id": ".hidden", "deadline_ts": 1e12}, "checkpoint_id"),
        ({"checkpoint_id": "x" * 129, "deadline_ts": 1e12}, "checkpoint_id"),
    ],
)
async def test_malformed_body_is_422_naming_the_field(
    tmp_path: Path, body: dict[str, Any], field: str
) -> None:
    fake = FakeParticipant()
    plane = ControlPlane(fake, _settings(tmp_path))
    async with _serve(plane) as client:
        response = await client.post(f"{API_PREFIX}/prepare", json=body)
        detail = _assert_error(response, ErrorCode.INVALID_REQUEST, 422)
        assert detail.startswith(f"{field}:"), detail
        assert fake.park_calls == 0


async def test_invalid_json_and_bad_source_instance_are_422(tmp_path: Path) -> None:
    plane = ControlPlane(FakeParticipant(), _settings(tmp_path))
    async with _serve(plane) as client:
        broken = await client.post(f"{API_PREFIX}/prepare", content=b"{nope")
        assert "Invalid JSON" in _assert_error(broken, ErrorCode.INVALID_REQUEST, 422)
        body = {
            "checkpoint_id": "ck",
            "deadline_ts": _deadline(),
            "attempt": 1,
            "source_instance": "../environment-0",
        }
        traversal = await client.post(f"{API_PREFIX}/restore", json=body)
        detail = _assert_error(traversal, ErrorCode.INVALID_REQUEST, 422)
        assert detail.startswith("source_instance:")
        body["source_instance"] = "model-0"
        foreign = await client.post(f"{API_PREFIX}/restore", json=body)
        assert "not a environment instance" in _assert_error(
            foreign, ErrorCode.INVALID_REQUEST, 422
        )


async def test_installed_error_handlers_cover_the_servers_own_routes(tmp_path: Path) -> None:
    app = FastAPI()

    @app.post("/run")
    async def run(body: Run) -> dict[str, str]:
        raise ProtocolError(ErrorCode.TASK_MISMATCH, f"{body.rollout_id}: task differs")

    plane = ControlPlane(FakeParticipant(), _settings(tmp_path))
    async with _serve(plane, app) as client:
        invalid = await client.post("/run", json={"rollout_id": "r1"})
        assert _assert_error(invalid, ErrorCode.INVALID_REQUEST, 422).startswith("attempt:")
        refused = await client.post("/run", json={"rollout_id": "r1", "attempt": 0})
        _assert_error(refused, ErrorCode.TASK_MISMATCH, 409)


async def _checkpoint(client: httpx.AsyncClient, checkpoint_id: str) -> CommitReply:
    prepared = await _post(client, "prepare", checkpoint_id=checkpoint_id, deadline_ts=_deadline())
    assert prepared.status_code == 200, prepared.text
    committed = await _post(client, "commit", checkpoint_id=checkpoint_id, deadline_ts=_deadline())
    assert committed.status_code == 200, committed.text
    resumed = await _post(client, "resume", checkpoint_id=checkpoint_id, deadline_ts=_deadline())
    assert resumed.status_code == 200, resumed.text
    return CommitReply.model_validate_json(committed.content)


async def _restore(client: httpx.AsyncClient, **extra: Any) -> httpx.Response:
    body = {"checkpoint_id": "ck", "deadline_ts": _deadline(), "attempt": 1, **extra}
    return await client.post(f"{API_PREFIX}/restore", json=body)


async def test_restore_installs_under_the_next_attempt_and_replays(tmp_path: Path) -> None:
    async with _serve(
        ControlPlane(FakeParticipant(rollouts=["r1", "r2"]), _settings(tmp_path))
    ) as c:
        await _checkpoint(c, "ck")

    fresh = FakeParticipant()
    plane = ControlPlane(fresh, _settings(tmp_path, attempt=1))
    async with _serve(plane) as client:
        first = await _restore(client)
        assert first.status_code == 200, first.text
        reply = RestoreReply.model_validate_json(first.content)
        assert reply.phase is Phase.RESTORED
        assert reply.record_count == 2
        assert [str(e) for e in reply.restored] == ["r1@1", "r2@1"]
        assert fresh.install_attempt == 1
        assert plane.attempt == 1
        assert not fresh.admission_open, "restored work waits for resume"
        assert (await _restore(client)).content == first.content
        assert fresh.install_calls == 1, "a replayed restore does not install again"

        await _ok(client, "resume", "ck")
        assert fresh.admission_open
        assert plane.phase is Phase.IDLE
        stale = await _restore(client)
        _assert_error(stale, ErrorCode.STALE_CHECKPOINT, 410)


async def test_restore_scope_and_attempt_rules(tmp_path: Path) -> None:
    async with _serve(
        ControlPlane(FakeParticipant(rollouts=["r1", "r2"]), _settings(tmp_path))
    ) as c:
        await _checkpoint(c, "ck")

    fresh = FakeParticipant()
    plane = ControlPlane(fresh, _settings(tmp_path, attempt=2))
    async with _serve(plane) as client:
        behind = await _restore(client, attempt=1)
        assert "already runs attempt 2" in _assert_error(behind, ErrorCode.ATTEMPT_MISMATCH, 409)
        retire = {"operation_id": "op-1", "deadline_ts": _deadline(), "attempt": 3}
        assert (await client.post(f"{API_PREFIX}/retire", json=retire)).is_success
        retired = await _restore(client, attempt=3)
        _assert_error(retired, ErrorCode.ATTEMPT_RETIRED, 410)
        scoped = await _restore(client, attempt=4, rollout_ids=["r2"])
        assert scoped.status_code == 200, scoped.text
        assert [r.rollout_id for r in fresh.installed] == ["r2"]


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def _wrong_count(directory: Path) -> None:
    manifest = storage.read_manifest(directory)
    tampered = manifest.model_copy(update={"record_count": manifest.record_count - 1})
    (directory / storage.MANIFEST_NAME).write_text(tampered.model_dump_json())


@pytest.mark.parametrize("damage", ["flipped_byte", "wrong_count", "refused_by_participant"])
async def test_damaged_records_are_refused_and_nothing_is_installed(
    tmp_path: Path, damage: str
) -> None:
    async with _serve(
        ControlPlane(FakeParticipant(rollouts=["r1", "r2"]), _settings(tmp_path))
    ) as c:
        reply = await _checkpoint(c, "ck")
    directory = tmp_path / "demo" / "ck" / "environment-0"
    fresh = FakeParticipant()
    if damage == "flipped_byte":
        _flip_one_byte(directory / reply.manifest.records_file)
        expected = "sha256"
    elif damage == "wrong_count":
        _wrong_count(directory)
        expected = "holds 2 records, the manifest says 1"
    else:
        fresh.refuse_records = "boundary of r1 names an unknown step"
        expected = "unknown step"

    plane = ControlPlane(fresh, _settings(tmp_path, attempt=1))
    async with _serve(plane) as client:
        response = await _restore(client)
        assert expected in _assert_error(response, ErrorCode.RECORDS_INVALID, 422)
        assert fresh.install_calls == 0
        assert fresh.installed == []
        assert fresh.admission_open, "a refused restore leaves the participant untouched"
        assert plane.phase is Phase.IDLE
        assert plane.attempt == 1


async def test_restore_of_records_not_on_this_storage_is_refused_as_unreachable(
    tmp_path: Path,
) -> None:
    """No manifest of the checkpoint where this participant looks (a commit that never
    finished, or records on a volume this pod does not mount): `records_unreachable`, which the
    operator tells apart from damaged records (`records_invalid`)."""
    fresh = FakeParticipant()
    async with _serve(ControlPlane(fresh, _settings(tmp_path, attempt=1))) as client:
        response = await _restore(client)
        assert "never finished" in _assert_error(response, ErrorCode.RECORDS_UNREACHABLE, 422)
        assert fresh.install_calls == 0


def _os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@pytest.mark.parametrize("failure", ["read_only", "disk_full", "root_is_a_file", "no_root"])
async def test_failing_storage_fails_the_commit_cleanly_and_the_participant_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    root: Path | None = tmp_path
    if failure == "read_only":

        def read_only(path: Path) -> int:
            raise _os_error(errno.EROFS)

        monkeypatch.setattr(storage, "_open_new", read_only)
        expected = "EROFS"
    elif failure == "disk_full":

        def no_space(fd: int, data: bytes) -> None:
            raise _os_error(errno.ENOSPC)

        monkeypatch.setattr(storage, "_write_all", no_space)
        expected = "ENOSPC"
    elif failure == "root_is_a_file":
        root = tmp_path / "file"
        root.write_text("")
        expected = "cannot create checkpoint directory"
    else:
        root = None
        expected = "ROLLOUT_CHECKPOINT_ROOT"

    fake = FakeParticipant(rollouts=["r1"])
    plane = ControlPlane(fake, _settings(root))
    async with _serve(plane) as client:
        await _ok(client, "prepare", "ck")
        commit = await _post(client, "commit", checkpoint_id="ck", deadline_ts=_deadline())
        assert expected in _assert_error(commit, ErrorCode.STORAGE_FAILED, 507)
        assert plane.phase is Phase.PREPARED, "a failed commit leaves the checkpoint prepared"
        assert fake.released == set()
        resumed = await _post(client, "resume", checkpoint_id="ck", deadline_ts=_deadline())
        assert resumed.status_code == 200, resumed.text
        assert fake.admission_open
        assert plane.phase is Phase.IDLE
    if root is not None and root.is_dir():
        assert not (root / "demo" / "ck" / "environment-0" / storage.MANIFEST_NAME).exists()


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for a filesystem state the control plane reaches in a background thread."""

    async def holds() -> bool:
        return condition()

    await wait_for(holds, WAIT, what, interval=0.01)


async def test_directory_is_made_ahead_of_the_commit_and_an_abort_leaves_nothing(
    tmp_path: Path,
) -> None:
    fake = FakeParticipant(rollouts=["r1"])
    plane = ControlPlane(fake, _settings(tmp_path))
    directory = tmp_path / "demo" / "ck" / "environment-0"
    async with _serve(plane) as client:
        await _ok(client, "prepare", "ck")
        await _until(directory.is_dir, "a ready prepare creates the checkpoint directory")
        assert fake.export_calls == 0, "nothing is exported before the commit"
        await _ok(client, "resume", "ck")
        await _until(lambda: not (tmp_path / "demo" / "ck").exists(), "the abort removes it")
        assert (tmp_path / "demo").is_dir(), "the set directory is left for later checkpoints"

        await _ok(client, "prepare", "ck2")
        await _ok(client, "commit", "ck2")
        await _ok(client, "resume", "ck2")
        # the resume may schedule no removal for a committed checkpoint; a later checkpoint
        # passing through the same background group proves any removal would have run
        await _ok(client, "prepare", "ck3")
        await _until((tmp_path / "demo" / "ck3" / "environment-0").is_dir, "ck3 made ahead")
        _, records = storage.read_records(
            tmp_path / "demo" / "ck2" / "environment-0", expect_checkpoint_id="ck2"
        )
        assert [r.rollout_id for r in records] == ["r1"]


async def test_records_that_are_not_json_fail_the_commit_and_the_participant_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeParticipant(rollouts=["r1"])
    exported = fake.export

    def with_an_object(scope: frozenset[str] | None) -> list[Record]:
        return [replace(record, data={"oops": object()}) for record in exported(scope)]

    monkeypatch.setattr(fake, "export", with_an_object)
    plane = ControlPlane(fake, _settings(tmp_path))
    async with _serve(plane) as client:
        await _ok(client, "prepare", "ck")
        commit = await _post(client, "commit", checkpoint_id="ck", deadline_ts=_deadline())
        assert "not serialisable" in _assert_error(commit, ErrorCode.INTERNAL, 500)
        assert plane.phase is Phase.PREPARED
        await _ok(client, "resume", "ck")
        assert fake.admission_open
    assert not (tmp_path / "demo" / "ck" / "environment-0" / storage.MANIFEST_NAME).exists()


async def test_the_collector_is_off_only_while_prepared(tmp_path: Path) -> None:
    assert gc.isenabled()
    plane = ControlPlane(FakeParticipant(rollouts=["r1"]), _settings(tmp_path))
    other = ControlPlane(
        FakeParticipant(Role.MODEL, rollouts=["r1"]), _settings(tmp_path, role=Role.MODEL)
    )
    async with _serve(plane) as client, _serve(other) as other_client:
        await _ok(client, "prepare", "ck")
        assert not gc.isenabled(), "a prepared participant pauses the collector"
        await _ok(other_client, "prepare", "ck")
        await _ok(client, "commit", "ck")
        await _ok(client, "resume", "ck")
        assert not gc.isenabled(), "still off: another participant in this process is prepared"
        await _ok(other_client, "resume", "ck")
        assert gc.isenabled(), "on again once no checkpoint is open"

        stuck = FakeParticipant(rollouts=["r1"])
        stuck.stuck.add("r1")
        blocked = ControlPlane(stuck, _settings(tmp_path, index=1))
        async with _serve(blocked) as blocked_client:
            body = {"checkpoint_id": "ck2", "deadline_ts": _deadline(1.0)}
            reply = await blocked_client.post(f"{API_PREFIX}/prepare", json=body)
            assert reply.status_code == 200, reply.text
            assert not PrepareReply.model_validate_json(reply.content).ready
            assert gc.isenabled(), "a participant still waiting for blockers keeps collecting"
        await _ok(client, "prepare", "ck3")
        assert not gc.isenabled()
    assert gc.isenabled(), "a control plane that stops while prepared releases its hold"


async def test_the_collector_comes_back_only_after_the_participant_reopened(
    tmp_path: Path,
) -> None:
    """The collection that catches up on the pause's garbage runs after the reopen, not in it."""
    collecting_at_reopen: list[bool] = []

    class Recording(FakeParticipant):
        async def reopen(self) -> None:
            collecting_at_reopen.append(gc.isenabled())
            await super().reopen()

    async with _serve(ControlPlane(Recording(rollouts=["r1"]), _settings(tmp_path))) as client:
        await _ok(client, "prepare", "ck")
        await _ok(client, "commit", "ck")
        await _ok(client, "resume", "ck")
        assert collecting_at_reopen == [False]
        assert gc.isenabled()


async def test_a_collector_the_application_switched_off_stays_off(tmp_path: Path) -> None:
    gc.disable()
    try:
        plane = ControlPlane(FakeParticipant(rollouts=["r1"]), _settings(tmp_path))
        async with _serve(plane) as client:
            await _ok(client, "prepare", "ck")
            await _ok(client, "resume", "ck")
            assert not gc.isenabled()
    finally:
        gc.enable()


async def test_commit_scope_releases_restored_state_outside_it(tmp_path: Path) -> None:
    async with _serve(
        ControlPlane(FakeParticipant(rollouts=["r1", "r2"]), _settings(tmp_path))
    ) as c:
        await _checkpoint(c, "ck")
    fresh = FakeParticipant()
    plane = ControlPlane(fresh, _settings(tmp_path, attempt=1))
    async with _serve(plane) as client:
        assert (await _restore(client)).is_success
        await _ok(client, "resume", "ck")
        await _ok(client, "prepare", "ck2")
        body = {"checkpoint_id": "ck2", "deadline_ts": _deadline(), "rollout_ids": ["r2"]}
        assert (await client.post(f"{API_PREFIX}/commit", json=body)).is_success
        assert fresh.released == {"r1"}
        _, records = storage.read_records(
            tmp_path / "demo" / "ck2" / "environment-0", expect_checkpoint_id="ck2"
        )
        assert [(r.rollout_id, r.attempt) for r in records] == [("r2", 1)]


async def test_retire_marks_refuse_work_are_idempotent_and_forget_drops_them(
    tmp_path: Path,
) -> None:
    fake = FakeParticipant(rollouts=["r1", "r2"])
    plane = ControlPlane(fake, _settings(tmp_path))
    async with _serve(plane) as client:
        await _ok(client, "prepare", "ck")
        body = {
            "operation_id": "op-1",
            "deadline_ts": _deadline(),
            "attempt": 0,
            "rollout_ids": ["r1"],
        }
        refused = await client.post(f"{API_PREFIX}/retire", json=body)
        _assert_error(refused, ErrorCode.WRONG_PHASE, 409)
        await _ok(client, "resume", "ck")

        first = await client.post(f"{API_PREFIX}/retire", json=body)
        assert first.status_code == 200, first.text
        assert (await client.post(f"{API_PREFIX}/retire", json=body)).content == first.content
        assert fake.retired == [(0, frozenset({"r1"}))], "retried retire is not repeated"
        assert plane.is_retired(0, "r1")
        assert not plane.is_retired(0, "r2")
        assert not plane.is_retired(1, "r1")

        whole = {"operation_id": "op-2", "deadline_ts": _deadline(), "attempt": 5}
        assert (await client.post(f"{API_PREFIX}/retire", json=whole)).is_success
        assert plane.is_retired(5, "anything")
        assert (await _status(client)).retired_attempts == [5]

        forget = {"operation_id": "op-3", "deadline_ts": _deadline(), "rollout_ids": ["r1"]}
        forgotten = await client.post(f"{API_PREFIX}/forget", json=forget)
        assert forgotten.json() == {"operation_id": "op-3", "forgotten": 1}
        assert not plane.is_retired(0, "r1")
        assert plane.is_retired(5, "r1"), "whole-attempt marks stay"
        reused = await client.post(f"{API_PREFIX}/forget", json={**forget, "operation_id": "op-1"})
        _assert_error(reused, ErrorCode.INVALID_REQUEST, 422)


async def test_resume_interrupts_a_prepare_that_is_still_parking(tmp_path: Path) -> None:
    fake = FakeParticipant(rollouts=["r1"])
    fake.stuck.add("r1")
    parking = anyio.Event()

    async def started() -> None:
        parking.set()

    fake.on_park = started
    plane = ControlPlane(fake, _settings(tmp_path))
    replies: list[httpx.Response] = []
    async with _serve(plane) as client:

        async def prepare() -> None:
            far = _deadline(600)
            replies.append(await _post(client, "prepare", checkpoint_id="ck", deadline_ts=far))

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                group.start_soon(prepare)
                await parking.wait()
                await _ok(client, "resume", "ck")
        assert "resumed while this prepare was parking" in _assert_error(
            replies[0], ErrorCode.STALE_CHECKPOINT, 410
        )
        assert fake.admission_open
        assert plane.phase is Phase.IDLE


class RewiringParticipant(FakeParticipant):
    """A fake that accepts new peer URLs on restore (a kept survivor of an InPlace recovery)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.peers: dict[Role, str] = {Role.AGENT: "http://old-agent:8000"}

    def rewire(self, peers: Mapping[Role, str]) -> None:
        self.peers.update(peers)


async def test_restore_with_peers_rewires_before_installing(tmp_path: Path) -> None:
    async with _serve(ControlPlane(FakeParticipant(rollouts=["r1"]), _settings(tmp_path))) as c:
        await _checkpoint(c, "ck")

    kept = RewiringParticipant()
    async with _serve(ControlPlane(kept, _settings(tmp_path))) as client:
        reply = await _restore(client, peers={"agent": "http://10.0.0.9:8000"})
        assert reply.status_code == 200, reply.text
        assert kept.peers == {Role.AGENT: "http://10.0.0.9:8000"}
        assert kept.install_attempt == 1


async def test_restore_with_peers_is_unsupported_without_rewire_and_installs_nothing(
    tmp_path: Path,
) -> None:
    async with _serve(ControlPlane(FakeParticipant(rollouts=["r1"]), _settings(tmp_path))) as c:
        await _checkpoint(c, "ck")

    plain = FakeParticipant()
    plane = ControlPlane(plain, _settings(tmp_path))
    async with _serve(plane) as client:
        refused = await _restore(client, peers={"agent": "http://10.0.0.9:8000"})
        detail = _assert_error(refused, ErrorCode.UNSUPPORTED, 501)
        assert "re-wire" in detail
        assert plain.install_calls == 0
        assert plane.phase is Phase.IDLE
        assert plane.attempt == 0
        bad = await _restore(client, peers={"agent": "ftp://x"})
        _assert_error(bad, ErrorCode.INVALID_REQUEST, 422)
        ok = await _restore(client)
        assert ok.status_code == 200, ok.text


async def test_a_standby_takes_the_instance_its_restore_names_and_restores_its_records(
    tmp_path: Path,
) -> None:
    """An adopted standby becomes the lost instance (index 2 here): it restores that
    instance's records, re-wires, and commits as that instance from then on."""
    lost = FakeParticipant(index=2, rollouts=["r1", "r2"])
    async with _serve(ControlPlane(lost, _settings(tmp_path, index=2))) as c:
        await _checkpoint(c, "ck")

    standby = RewiringParticipant()
    plane = ControlPlane(standby, _settings(tmp_path, standby=True))
    async with _serve(plane) as client:
        assert (await _status(client)).standby is True
        reply = await _restore(client, index=2, peers={"agent": "http://10.0.0.9:8000"})
        assert reply.status_code == 200, reply.text
        assert sorted(r.rollout_id for r in standby.installed) == ["r1", "r2"]
        assert standby.peers == {Role.AGENT: "http://10.0.0.9:8000"}
        status = await _status(client)
        assert status.instance == "environment-2"
        assert status.standby is False
        assert status.attempt == 1
        resumed = await _post(client, "resume", checkpoint_id="ck", deadline_ts=_deadline())
        assert resumed.status_code == 200, resumed.text
        committed = await _checkpoint(client, "after")
        assert committed.manifest_path == "demo/after/environment-2/manifest.json"


async def test_only_a_standby_takes_another_instance(tmp_path: Path) -> None:
    async with _serve(ControlPlane(FakeParticipant(rollouts=["r1"]), _settings(tmp_path))) as c:
        await _checkpoint(c, "ck")
    plain = FakeParticipant()
    async with _serve(ControlPlane(plain, _settings(tmp_path))) as client:
        refused = await _restore(client, index=1)
        detail = _assert_error(refused, ErrorCode.INVALID_REQUEST, 422)
        assert "not a standby" in detail
        assert plain.install_calls == 0
        same = await _restore(client, index=0)
        assert same.status_code == 200, "its own index is no change"
