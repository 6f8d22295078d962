"""Contract tests of the NeMo Gym dialect against Gym's own models at the pinned commit.

The fixtures (`gym_contract/*.json`) and the mirrors (`testsupport.gym_upstream`) are written by
hand from NVIDIA-NeMo/Gym at commit 05bf55ac50b5d95eb203ceb8f59145545c6def64 (docs/protocol.md,
"The NeMo Gym dialect"), not produced by our encoder. Both directions are held to them:

- our participant, reached over HTTP with the bodies Gym's coordinator sends: every reply and
  every refusal must validate against the mirror Gym writes it with;
- our client (`HttpParticipantClient`) against a participant that speaks only Gym's dialect
  (validating each body with the mirrors, answering the fixtures): every request it sends must
  validate against Gym's `extra="forbid"` model (a field Gym does not have fails the test), and
  every Gym reply and error code must read as ours (never `internal`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ValidationError
from rollout_protocol import (
    CommitRequest,
    ControlPlane,
    ControlSettings,
    Dialect,
    ErrorCode,
    ForgetRequest,
    HttpParticipantClient,
    ParticipantError,
    PrepareRequest,
    RenewRequest,
    RestoreRequest,
    ResumeRequest,
    RetireRequest,
    Role,
)
from rollout_protocol import _client as client_module
from rollout_protocol.conformance import serve_app
from testsupport import gym_upstream as upstream
from testsupport.participants import FakeParticipant

FIXTURES = Path(__file__).parent / "gym_contract"
TOKEN = "gym-contract-token"
PREFIX = upstream.CHECKPOINT_ROUTE_PREFIX


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _fixture(name: str) -> Any:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def _valid(model: type[BaseModel], body: Any, what: str) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        pytest.fail(f"{what} is not what Gym at {upstream.UPSTREAM_GYM_COMMIT[:8]} has: {error}")


# --- the fixtures are Gym's -------------------------------------------------------------------


@pytest.mark.parametrize("operation", sorted(upstream.REPLIES))
def test_the_fixtures_validate_against_the_upstream_mirrors(operation: str) -> None:
    fixture = _fixture(operation)
    request_model = upstream.REQUESTS[operation]
    if request_model is None:
        assert fixture["request"] is None
    else:
        _valid(request_model, fixture["request"], f"{operation} request fixture")
    _valid(upstream.REPLIES[operation], fixture["reply"], f"{operation} reply fixture")


def test_the_mirrors_refuse_what_gym_refuses() -> None:
    """The mirrors are strict where Gym is: the restore and retire our dialect used to send
    (with `source_checkpoint_id` and `attempt`, without `episode_ids`) are refused."""
    with pytest.raises(ValidationError, match=r"extra_forbidden|Extra inputs"):
        upstream.UpstreamRestoreRequest.model_validate(
            {
                "checkpoint_id": "c1",
                "deadline_ts": 1.0,
                "checkpoint_dir": "c1",
                "episode_ids": [],
                "source_checkpoint_id": "c1",
            }
        )
    with pytest.raises(ValidationError, match="episode_ids"):
        upstream.UpstreamRestoreRequest.model_validate(
            {"checkpoint_id": "c1", "deadline_ts": 1.0, "checkpoint_dir": "c1"}
        )
    with pytest.raises(ValidationError, match=r"extra_forbidden|Extra inputs"):
        upstream.UpstreamRetireRequest.model_validate(
            {
                "checkpoint_id": "op",
                "deadline_ts": 1.0,
                "attempt": 1,
                "episode_ids": [{"rollout_id": "r1", "attempt": 1}],
            }
        )
    with pytest.raises(ValidationError, match="reserved attempt suffix"):
        upstream.UpstreamEpisodeId(rollout_id="task-a3", attempt=0)
    for item in _fixture("errors"):
        body = item["body"]
        if "error" in body:
            detail = _valid(upstream.UpstreamErrorBody, body, "error fixture")
            code = detail.model_dump()["error"]["code"]
            assert upstream.UPSTREAM_ERROR_STATUS[code] == item["status"]
        else:
            _valid(upstream.UpstreamValidationBody, body, "validation fixture")


# --- our participant, as Gym's coordinator reaches it -----------------------------------------


def _plane(root: Path) -> ControlPlane:
    settings = ControlSettings(
        Role.ENVIRONMENT, set_name="g", checkpoint_root=root, token=TOKEN, dialects=(Dialect.GYM,)
    )
    return ControlPlane(FakeParticipant(Role.ENVIRONMENT, rollouts=["r1", "r2"]), settings)


@asynccontextmanager
async def _our_participant(root: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    _plane(root).install(app)
    async with serve_app(app, role=Role.ENVIRONMENT, token=TOKEN) as served:
        yield served.client


async def _send(http: httpx.AsyncClient, operation: str, **changes: Any) -> httpx.Response:
    """The fixture's request of `operation` (with `changes`), as Gym's coordinator sends it."""
    body = {**_fixture(operation)["request"], "deadline_ts": time.time() + 10, **changes}
    _valid(upstream.REQUESTS[operation] or BaseModel, body, f"the {operation} request sent")
    return await http.post(f"{PREFIX}/{operation}", json=body, headers=_auth())


def _reply(response: httpx.Response, operation: str) -> Any:
    assert response.status_code == 200, response.text
    _valid(upstream.REPLIES[operation], response.json(), f"our {operation} reply")
    return response.json()


def _refusal(response: httpx.Response, code: str) -> None:
    body = response.json()
    _valid(upstream.UpstreamErrorBody, body, f"our refusal {response.text}")
    assert body["error"]["code"] == code, response.text
    assert response.status_code == upstream.UPSTREAM_ERROR_STATUS[code], response.text


@pytest.mark.anyio
async def test_our_participant_answers_every_gym_request_as_gym_does(tmp_path: Path) -> None:
    async with _our_participant(tmp_path) as http:
        status = _reply(await http.get(f"{PREFIX}/status", headers=_auth()), "status")
        assert (status["kind"], status["phase"]) == ("environment", "idle")

        prepared = _reply(await _send(http, "prepare"), "prepare")
        assert prepared["phase"] == "prepared"
        assert prepared["report"]["ready"] is True
        _reply(await _send(http, "renew"), "renew")
        committed = _reply(await _send(http, "commit"), "commit")
        assert committed["episode_ids"] == ["r1", "r2"]  # attempt 0: the rollout id itself
        assert committed["manifest"]["record_count"] == 2
        assert committed["manifest"]["kind"] == "environment"
        resumed = _reply(await _send(http, "resume"), "resume")
        assert resumed == {"phase": "idle", "idempotent": False}

        restored = _reply(await _send(http, "restore"), "restore")
        assert restored == {
            "phase": "restored",
            "source_checkpoint_id": "c1",
            "restored": ["r1-a1", "r2-a1"],
        }
        _reply(await _send(http, "resume", checkpoint_id="c1"), "resume")
        retired = _reply(await _send(http, "retire"), "retire")
        assert retired == {"retired": ["r1-a1"]}
        forgotten = _reply(await _send(http, "forget"), "forget")
        assert forgotten == {"forgotten": ["r1"]}


@pytest.mark.anyio
async def test_our_participant_refuses_as_gym_does(tmp_path: Path) -> None:
    async with _our_participant(tmp_path) as http:
        _refusal(await http.get(f"{PREFIX}/status"), "unauthorized")
        _refusal(await _send(http, "renew"), "invalid_phase")  # no checkpoint is open
        _reply(await _send(http, "prepare"), "prepare")
        _refusal(await _send(http, "prepare", checkpoint_id="c2"), "checkpoint_conflict")
        _reply(await _send(http, "resume"), "resume")
        _refusal(await _send(http, "prepare"), "stale_checkpoint")
        unknown = await http.post(
            f"{PREFIX}/prepare",
            json={"checkpoint_id": "c3", "deadline_ts": time.time() + 10, "attempt": 1},
            headers=_auth(),
        )
        assert unknown.status_code == 422, unknown.text
        _valid(upstream.UpstreamValidationBody, unknown.json(), "our refusal of an extra field")


@pytest.mark.anyio
async def test_a_gym_forget_of_ids_never_retired_forgets_nothing_as_gym_does(
    tmp_path: Path,
) -> None:
    """Gym's forget takes any strings (`rollout_ids: list[str]`) and answers them, sorted: a
    rollout id ours cannot carry (`../x`, 10,000 characters, a NUL) was never retired here, so
    there is nothing of it to forget; the rollout ids beside it are forgotten as asked."""
    hostile = ["../x", "r" * 10_000, "r\x00x"]
    async with _our_participant(tmp_path) as http:
        _reply(await _send(http, "retire"), "retire")  # a mark of r1 to forget
        replied = _reply(await _send(http, "forget", rollout_ids=[*hostile, "r1"]), "forget")
        assert replied == {"forgotten": sorted([*hostile, "r1"])}
        only = _reply(
            await _send(http, "forget", checkpoint_id="f2", rollout_ids=hostile), "forget"
        )
        assert only == {"forgotten": sorted(hostile)}


@pytest.mark.anyio
@pytest.mark.parametrize("operation", ["renew", "commit"])
async def test_a_renew_or_commit_of_another_id_conflicts_as_in_gym(
    tmp_path: Path, operation: str
) -> None:
    """Gym's `_admit`: another checkpoint open is `checkpoint_conflict`, none open is
    `invalid_phase` (ours says `unknown_checkpoint` of both)."""
    async with _our_participant(tmp_path) as http:
        other = {"checkpoint_id": "c2", "checkpoint_dir": "c2"} if operation == "commit" else {}
        none_open = await _send(http, operation, **(other or {"checkpoint_id": "c2"}))
        _refusal(none_open, "invalid_phase")
        _reply(await _send(http, "prepare"), "prepare")  # c1 prepared
        conflict = await _send(http, operation, **(other or {"checkpoint_id": "c2"}))
        _refusal(conflict, "checkpoint_conflict")
        assert "'c2'" in conflict.json()["error"]["detail"]


@pytest.mark.anyio
async def test_a_gym_restore_without_a_manifest_is_gyms_invalid_checkpoint_state(
    tmp_path: Path,
) -> None:
    """Gym's store refuses a restore that finds no manifest as `invalid_checkpoint_state`,
    "missing manifest <path>"; ours says it so, and our client reads it back as
    `records_unreachable` (the records are not on this storage, not damaged), from our
    participant as from Gym's own wording."""
    async with _our_participant(tmp_path) as http:
        refused = await _send(http, "restore", checkpoint_id="c7", checkpoint_dir="c7")
        _refusal(refused, "invalid_checkpoint_state")
        detail = refused.json()["error"]["detail"]
        assert detail.startswith("missing manifest: no manifest at "), detail
    (gyms,) = [
        item
        for item in _fixture("errors")
        if item["body"].get("error", {}).get("code") == "invalid_checkpoint_state"
    ]
    for status, body in ((refused.status_code, refused.json()), (gyms["status"], gyms["body"])):
        error = {"status": status, "body": body}
        async with _upstream_client(UpstreamParticipant(error=error)) as client:
            with pytest.raises(ParticipantError) as read:
                await client.prepare(PrepareRequest(checkpoint_id="c1", deadline_ts=_deadline()))
        assert (read.value.code, read.value.status_code) == (ErrorCode.RECORDS_UNREACHABLE, 422)


# --- our client, against a participant that speaks only Gym's dialect -------------------------


@dataclass
class UpstreamParticipant:
    """A Gym participant as the pinned commit has one: no capabilities route, each body
    validated with Gym's models (FastAPI's 422 on refusal), the fixtures answered."""

    sent: dict[str, list[Any]] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None
    reply_changes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get(f"{PREFIX}/status")
        async def status() -> Response:
            self.sent.setdefault("status", []).append(None)
            return self._answer("status")

        @app.post(PREFIX + "/{operation}")
        async def operation(operation: str, request: Request) -> Response:
            body = json.loads(await request.body())
            self.sent.setdefault(operation, []).append(body)
            model = upstream.REQUESTS[operation]
            assert model is not None
            try:
                model.model_validate(body)
            except ValidationError as error:
                self.refusals.append(f"{operation}: {error}")
                items = [
                    {"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
                    for e in error.errors()
                ]
                return Response(json.dumps({"detail": items}), 422, media_type="application/json")
            return self._answer(operation)

        return app

    def _answer(self, operation: str) -> Response:
        if self.error is not None:
            return Response(
                json.dumps(self.error["body"]), self.error["status"], media_type="application/json"
            )
        reply = {**_fixture(operation)["reply"], **self.reply_changes.get(operation, {})}
        return Response(json.dumps(reply), 200, media_type="application/json")


@asynccontextmanager
async def _upstream_client(
    participant: UpstreamParticipant, dialect: Dialect | None = Dialect.GYM
) -> AsyncIterator[HttpParticipantClient]:
    async with serve_app(participant.app(), role=Role.ENVIRONMENT, token=TOKEN) as served:
        client_module._DIALECTS.pop(served.target.base_url, None)
        async with HttpParticipantClient(
            Role.ENVIRONMENT, served.target.base_url, token=TOKEN, dialect=dialect
        ) as client:
            yield client


def _deadline() -> float:
    return time.time() + 10


@pytest.mark.anyio
async def test_every_request_our_client_sends_is_one_gym_accepts() -> None:
    participant = UpstreamParticipant(
        reply_changes={
            # our participants' extension of Gym's commit reply: without it a checkpoint is not
            # published (a pure Gym reply is refused below)
            "commit": {"attempt": 0, "bytes": 10, "manifest_path": "g/c1/environment-0/m.json"}
        }
    )
    async with _upstream_client(participant) as client:
        status = await client.status(_deadline())
        assert (status.phase, status.attempt) == ("idle", 0)
        prepared = await client.prepare(
            PrepareRequest(checkpoint_id="c1", deadline_ts=_deadline(), rollout_ids=["r1"])
        )
        assert prepared.ready
        assert [str(e) for e in prepared.restarts] == ["r3@1"]
        await client.renew(RenewRequest(checkpoint_id="c1", deadline_ts=_deadline()))
        committed = await client.commit(
            CommitRequest(checkpoint_id="c1", deadline_ts=_deadline(), rollout_ids=["r1", "r2"])
        )
        assert committed.manifest.record_count == 2
        await client.resume(ResumeRequest(checkpoint_id="c1", deadline_ts=_deadline()))
        restored = await client.restore(
            RestoreRequest(
                checkpoint_id="c1", deadline_ts=_deadline(), attempt=1, rollout_ids=["r1", "r2"]
            )
        )
        assert [str(e) for e in restored.restored] == ["r1@1", "r2@1"]
        retired = await client.retire(
            RetireRequest(
                operation_id="retire-1",
                deadline_ts=_deadline(),
                attempt=1,
                rollout_ids=["r1"],
                finished=["r2"],
            )
        )
        assert [str(e) for e in retired.retired] == ["r1@1"]
        forgotten = await client.forget(
            ForgetRequest(operation_id="forget-1", deadline_ts=_deadline(), rollout_ids=["r1"])
        )
        assert forgotten.forgotten == 1
    assert participant.refusals == []
    assert sorted(participant.sent) == sorted(upstream.REQUESTS)
    for operation, bodies in participant.sent.items():
        model = upstream.REQUESTS[operation]
        for body in bodies:
            if model is not None:
                _valid(model, body, f"our client's {operation} request")
    assert participant.sent["restore"][0]["episode_ids"] == [
        {"rollout_id": "r1", "attempt": 0},
        {"rollout_id": "r2", "attempt": 0},
    ]


@pytest.mark.anyio
async def test_a_pure_gym_commit_reply_is_refused_not_published() -> None:
    """Gym's commit reply has no records size nor manifest path: nothing can be published."""
    async with _upstream_client(UpstreamParticipant()) as client:
        with pytest.raises(ParticipantError, match="manifest path") as refused:
            await client.commit(CommitRequest(checkpoint_id="c1", deadline_ts=_deadline()))
        assert refused.value.code is ErrorCode.INTERNAL


@pytest.mark.anyio
async def test_our_client_finds_a_gym_participant_by_its_status() -> None:
    """No capabilities route at the pinned commit: the client asks Gym's status, as Gym's own
    coordinator discovers participants, and speaks Gym."""
    async with _upstream_client(UpstreamParticipant(), dialect=None) as client:
        await client.status(_deadline())
        assert client.dialect is Dialect.GYM


@pytest.mark.anyio
@pytest.mark.parametrize("item", _fixture("errors"), ids=lambda item: str(item["body"])[:40])
async def test_every_gym_error_reads_as_one_of_ours(item: dict[str, Any]) -> None:
    async with _upstream_client(UpstreamParticipant(error=item)) as client:
        with pytest.raises(ParticipantError) as refused:
            await client.prepare(PrepareRequest(checkpoint_id="c1", deadline_ts=_deadline()))
    assert refused.value.code is not ErrorCode.INTERNAL, refused.value
    assert refused.value.status_code == item["status"]
