"""A participant whose records go to an S3-API bucket that fails: unreachable, slow, answering
500 or 503 SlowDown, full, or refusing the credentials, at commit and at restore.

The participant is the real control plane (its FastAPI app, in process) over the in-process fake
participant; the bucket is the real S3 server of `make s3-server`, reached through a loopback
proxy that injects each fault (`s3_network`, testsupport/fake_network.py). What must hold
(docs/protocol.md, "Records in a bucket"): a commit fails with `storage_failed` and a reason by
its deadline, never later; a restore retries inside its deadline and then fails with
`storage_failed` (a throttle or a timeout is never `records_unreachable`, which says the
checkpoint is not there); a passing fault is retried away; credentials refused name the mounted
Secret's folder, never a key.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import obstore
import pytest
from fastapi import FastAPI
from rollout_protocol import (
    API_PREFIX,
    BucketConfig,
    CommitReply,
    ControlPlane,
    ControlSettings,
    ErrorBody,
    ErrorCode,
    Phase,
    RestoreReply,
    Role,
)
from testsupport.fake_network import (
    INSUFFICIENT_STORAGE,
    QUOTA_EXCEEDED,
    SERVER_ERROR,
    SLOW_DOWN,
    FakeNetwork,
    S3Error,
)
from testsupport.participants import FakeParticipant
from testsupport.s3_server import S3Bucket

TOKEN = "control-token-for-tests"
DEADLINE_S = 2.0
"""The commit's and the restore's deadline in these tests: each fault outlasts it."""
LATE_S = 1.0
"""How far past its deadline a failed call may answer on a loaded machine (the reply's own
trip); a call that waited on the bucket beyond its deadline takes much longer."""
SET_DIR = "team/demo/uid-1"
EXPIRED = S3Error(400, "ExpiredToken", "The provided token has expired.")


def _settings(bucket: S3Bucket, folder: Path, **overrides: Any) -> ControlSettings:
    values: dict[str, Any] = {
        "role": Role.ENVIRONMENT,
        "set_name": "demo",
        "set_dir": SET_DIR,
        "bucket": BucketConfig(
            endpoint=bucket.endpoint,
            bucket=bucket.name,
            credentials_dir=bucket.write_credentials(folder),
            prefix="records",
        ),
        "token": TOKEN,
    }
    values.update(overrides)
    return ControlSettings(**values)


@asynccontextmanager
async def _serve(plane: ControlPlane) -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    plane.install(app)
    async with (
        plane.running(),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://participant",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30.0,
        ) as client,
    ):
        yield client


async def _post(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    return await client.post(f"{API_PREFIX}/{route}", json=body)


async def _commit(client: httpx.AsyncClient, checkpoint_id: str) -> tuple[httpx.Response, float]:
    """Prepare, then commit by a deadline `DEADLINE_S` ahead: the reply and that deadline."""
    prepared = await _post(
        client, "prepare", checkpoint_id=checkpoint_id, deadline_ts=time.time() + 10
    )
    assert prepared.status_code == 200, prepared.text
    deadline = time.time() + DEADLINE_S
    return await _post(
        client, "commit", checkpoint_id=checkpoint_id, deadline_ts=deadline
    ), deadline


def _failed(response: httpx.Response, deadline: float) -> str:
    """The detail of a `storage_failed` reply that came by its deadline."""
    assert time.time() <= deadline + LATE_S, "the call waited on the bucket past its deadline"
    assert response.status_code == 507, response.text
    body = ErrorBody.model_validate_json(response.content)
    assert body.error.code is ErrorCode.STORAGE_FAILED, body
    return body.error.detail


def _keys(bucket: S3Bucket) -> list[str]:
    return sorted(meta["path"] for batch in obstore.list(bucket.store()) for meta in batch)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("drop", "the endpoint is unreachable"),
        ("slow", "did not answer by the call's deadline|the request timed out"),
        ("500", "the server failed (HTTP 500, InternalError)"),
        ("503", "the server throttles requests (HTTP 503, SlowDown)"),
        ("507", "the bucket is full (HTTP 507, InsufficientStorage)"),
        ("quota", "the bucket is full (HTTP 403, QuotaExceeded)"),
    ],
)
async def test_a_commit_to_a_failing_bucket_fails_with_its_reason_by_its_deadline(
    s3_bucket: S3Bucket, s3_network: FakeNetwork, tmp_path: Path, fault: str, reason: str
) -> None:
    bucket = s3_bucket.through(s3_network)
    fake = FakeParticipant(rollouts=["r1", "r2"])
    async with _serve(ControlPlane(fake, _settings(bucket, tmp_path / "creds"))) as client:
        {
            "drop": lambda: s3_network.drop(),
            "slow": lambda: s3_network.slow(30.0),
            "500": lambda: s3_network.fail(SERVER_ERROR),
            "503": lambda: s3_network.fail(SLOW_DOWN),
            "507": lambda: s3_network.fail(INSUFFICIENT_STORAGE),
            "quota": lambda: s3_network.fail(QUOTA_EXCEEDED),
        }[fault]()

        response, deadline = await _commit(client, "ck-1")

        detail = _failed(response, deadline)
        assert any(part in detail for part in reason.split("|")), detail
        assert s3_network.seen, "the commit did try the bucket"
        s3_network.heal()
        resumed = await _post(client, "resume", checkpoint_id="ck-1", deadline_ts=time.time() + 10)
        assert resumed.status_code == 200, resumed.text
        assert fake.admission_open, "the episodes run on"
    assert not [key for key in _keys(s3_bucket) if key.endswith("manifest.json")]


@pytest.mark.parametrize(
    ("fault", "where"),
    [(SLOW_DOWN, "manifest"), (SERVER_ERROR, "records-"), (None, "manifest")],
)
async def test_a_passing_fault_at_commit_is_retried_within_the_deadline(
    s3_bucket: S3Bucket,
    s3_network: FakeNetwork,
    tmp_path: Path,
    fault: S3Error | None,
    where: str,
) -> None:
    bucket = s3_bucket.through(s3_network)
    fake = FakeParticipant(rollouts=["r1"])
    async with _serve(ControlPlane(fake, _settings(bucket, tmp_path / "creds"))) as client:
        if fault is None:
            met = s3_network.drop(methods={"PUT"}, path_contains=where, times=2).name
        else:
            met = s3_network.fail(fault, methods={"PUT"}, path_contains=where, times=2).name

        response, _ = await _commit(client, "ck-1")

        assert response.status_code == 200, response.text
        assert len(s3_network.faulted(met)) == 2
        reply = CommitReply.model_validate_json(response.content)
        assert reply.manifest_path == f"{SET_DIR}/ck-1/environment-0/manifest.json"
    assert f"records/{reply.manifest_path}" in _keys(s3_bucket)


@pytest.mark.parametrize("error", [EXPIRED, None])
async def test_credentials_refused_at_commit_name_the_secrets_folder_never_a_key(
    s3_bucket: S3Bucket,
    s3_network: FakeNetwork,
    tmp_path: Path,
    error: S3Error | None,
) -> None:
    folder = tmp_path / "creds"
    bucket = s3_bucket.through(s3_network)
    settings = _settings(bucket, folder)
    if error is None:
        (folder / "secretAccessKey").write_text("a-wrong-secret")
    else:
        s3_network.fail(error)
    async with _serve(ControlPlane(FakeParticipant(rollouts=["r1"]), settings)) as client:
        response, deadline = await _commit(client, "ck-1")

    detail = _failed(response, deadline)
    assert "the server refused the credentials" in detail
    assert f"check the credentials in {folder} (accessKeyId, secretAccessKey" in detail
    assert (error or S3Error(403, "SignatureDoesNotMatch", "")).code in detail
    for secret in (
        s3_bucket.credentials.access_key_id,
        s3_bucket.credentials.secret_access_key,
        "a-wrong-secret",
    ):
        assert secret not in detail
    assert len(s3_network.seen) == 1, "refused credentials are not retried"


async def _committed(bucket: S3Bucket, folder: Path) -> None:
    """A checkpoint `ck` of two rollouts in the bucket, committed through a first plane."""
    plane = ControlPlane(FakeParticipant(rollouts=["r1", "r2"]), _settings(bucket, folder))
    async with _serve(plane) as client:
        response, _ = await _commit(client, "ck")
        assert response.status_code == 200, response.text
        await _post(client, "resume", checkpoint_id="ck", deadline_ts=time.time() + 10)


async def _restore(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
    deadline = time.time() + DEADLINE_S
    body = {"checkpoint_id": "ck", "deadline_ts": deadline, "attempt": 1}
    return await client.post(f"{API_PREFIX}/restore", json=body), deadline


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("503", "the server throttles requests (HTTP 503, SlowDown)"),
        ("500", "the server failed (HTTP 500, InternalError)"),
        ("slow", "did not answer by the call's deadline|the request timed out"),
        ("drop", "the endpoint is unreachable"),
    ],
)
async def test_a_restore_retries_inside_its_deadline_then_fails_as_storage_never_as_missing(
    s3_bucket: S3Bucket, s3_network: FakeNetwork, tmp_path: Path, fault: str, reason: str
) -> None:
    folder = tmp_path / "creds"
    await _committed(s3_bucket, folder)
    bucket = s3_bucket.through(s3_network)
    {
        "503": lambda: s3_network.fail(SLOW_DOWN, methods={"GET"}),
        "500": lambda: s3_network.fail(SERVER_ERROR, methods={"GET"}),
        "slow": lambda: s3_network.slow(30.0, methods={"GET"}),
        "drop": lambda: s3_network.drop(methods={"GET"}),
    }[fault]()
    fresh = FakeParticipant()
    async with _serve(ControlPlane(fresh, _settings(bucket, folder, attempt=1))) as client:
        response, deadline = await _restore(client)

        detail = _failed(response, deadline)
        assert any(part in detail for part in reason.split("|")), detail
        assert fresh.install_calls == 0, "nothing is installed from a bucket that failed"
        if fault in ("503", "500", "drop"):
            assert len(s3_network.seen) > 1, "the restore retried before giving up"

        s3_network.heal()
        again, _ = await _restore(client)
        assert again.status_code == 200, again.text
        assert RestoreReply.model_validate_json(again.content).record_count == 2


async def test_a_restore_whose_last_try_the_deadline_cuts_names_what_the_tries_before_met(
    s3_bucket: S3Bucket, s3_network: FakeNetwork, tmp_path: Path
) -> None:
    """Two tries dropped, then every try slow: the last try times out only because the
    deadline cuts it short, so the failure names the unreachable endpoint the tries met, and
    the timeout after it, each with its count."""
    folder = tmp_path / "creds"
    await _committed(s3_bucket, folder)
    s3_network.drop(methods={"GET"}, times=2)
    s3_network.slow(30.0, methods={"GET"})
    fresh = FakeParticipant()
    plane = ControlPlane(fresh, _settings(s3_bucket.through(s3_network), folder, attempt=1))
    async with _serve(plane) as client:
        response, deadline = await _restore(client)

    detail = _failed(response, deadline)
    # the slow try ends at the deadline: as a timeout the store saw (3 tries) or, when the
    # call's own deadline comes first, still in flight (2 tries); either way the drops show
    shown = re.search(r"no success by the call's deadline after (\d) tries: (.*)", detail)
    assert shown is not None, detail
    tries, seen = shown.groups()
    assert (tries, seen) in {
        ("3", "the endpoint is unreachable (2), the request timed out"),
        ("2", "the endpoint is unreachable (2)"),
    }, detail
    assert fresh.install_calls == 0


async def test_a_throttled_restore_succeeds_once_the_throttle_passes(
    s3_bucket: S3Bucket, s3_network: FakeNetwork, tmp_path: Path
) -> None:
    folder = tmp_path / "creds"
    await _committed(s3_bucket, folder)
    throttle = s3_network.fail(SLOW_DOWN, methods={"GET"}, path_contains="manifest", times=3)
    fresh = FakeParticipant()
    plane = ControlPlane(fresh, _settings(s3_bucket.through(s3_network), folder, attempt=1))
    async with _serve(plane) as client:
        response, _ = await _restore(client)

        assert response.status_code == 200, response.text
        assert len(s3_network.faulted(throttle.name)) == 3
        assert [r.rollout_id for r in fresh.installed] == ["r1", "r2"]
        assert plane.phase is Phase.RESTORED


async def test_a_checkpoint_not_in_the_bucket_is_records_unreachable(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    """What the operator falls back on: the one answer that says the records are not there."""
    settings = _settings(s3_bucket, tmp_path / "creds", attempt=1)
    async with _serve(ControlPlane(FakeParticipant(), settings)) as client:
        response, _ = await _restore(client)

    assert response.status_code == 422, response.text
    body = ErrorBody.model_validate_json(response.content)
    assert body.error.code is ErrorCode.RECORDS_UNREACHABLE, body
    assert "no manifest at team/demo/uid-1/ck/environment-0/manifest.json" in body.error.detail


async def test_a_persist_to_a_failing_bucket_fails_by_its_deadline_and_leaves_no_manifest(
    s3_bucket: S3Bucket, s3_network: FakeNetwork, tmp_path: Path
) -> None:
    """After the cut and the resume, the episodes run on while the persist meets the failing
    bucket; the persist fails with its reason by its deadline, and nothing it wrote stays."""
    bucket = s3_bucket.through(s3_network)
    fake = FakeParticipant(rollouts=["r1", "r2"])
    async with _serve(ControlPlane(fake, _settings(bucket, tmp_path / "creds"))) as client:
        prepared = await _post(client, "prepare", checkpoint_id="ck", deadline_ts=time.time() + 10)
        assert prepared.status_code == 200, prepared.text
        s3_network.fail(SLOW_DOWN, methods={"PUT"}, path_contains="manifest")
        cut = await _post(
            client,
            "commit",
            checkpoint_id="ck",
            deadline_ts=time.time() + 10,
            persist_after_resume=True,
        )
        assert cut.status_code == 200, cut.text
        assert not CommitReply.model_validate_json(cut.content).durable
        resumed = await _post(client, "resume", checkpoint_id="ck", deadline_ts=time.time() + 10)
        assert resumed.status_code == 200, resumed.text
        assert fake.admission_open, "the episodes run on while the records are persisted"

        deadline = time.time() + DEADLINE_S
        persisted = await _post(client, "persist", checkpoint_id="ck", deadline_ts=deadline)
        detail = _failed(persisted, deadline)

        assert "still being written" in detail or "throttles requests" in detail, detail
        assert s3_network.faulted("503 SlowDown"), "the manifest's create met the throttle"
        s3_network.heal()
        discarded = await _post(client, "discard", checkpoint_id="ck", deadline_ts=time.time() + 10)
        assert discarded.status_code == 200, discarded.text
    assert _keys(s3_bucket) == [], "no records and no manifest of a failed persist stay"
