"""The NeMo Gym dialect at the protocol level: the mapping of every field and error code both
ways, pinned against Gym JSON written by hand from Gym's code at the pinned commit (not produced
by our encoder; `test_gym_contract.py` validates against mirrors of Gym's models), and both
sides of the HTTP hop in process.

- pure mapping: prepare, commit, restore, retire replies and requests; capture keys; error
  codes; what cannot be said in the other dialect (`Unmappable`);
- a control plane on the SDK mounting Gym's routes (alone or beside ours), reached with raw
  Gym JSON over HTTP: reply shapes, 409 codes, `checkpoint_dir`, the token;
- `HttpParticipantClient` asking the dialect and speaking the one announced, and probing
  again when a remembered dialect's route is gone.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from rollout_protocol import (
    API_PREFIX,
    ROUTES,
    CommitReply,
    CommitRequest,
    ControlConfigError,
    ControlPlane,
    ControlSettings,
    Coordinator,
    Dialect,
    EpisodeId,
    ErrorCode,
    HttpParticipantClient,
    ParticipantError,
    Phase,
    PrepareReply,
    PrepareRequest,
    RemoveRequest,
    RestoreReply,
    RestoreRequest,
    RetireRequest,
    Role,
)
from rollout_protocol import _client as client_module
from rollout_protocol import _gym as gym
from rollout_protocol.conformance import serve_app
from testsupport.participants import FakeParticipant

TOKEN = "gym-dialect-token"
SIDE = gym.ClientSide(Role.ENVIRONMENT, "environment-0", attempt=3)
SERVER = gym.ServerSide("environment-0", "ns/set/uid", "/ckpt")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- pure mapping -----------------------------------------------------------------------------


def test_every_route_has_its_gym_form_except_remove() -> None:
    paths = {route.name: route.path_in(Dialect.GYM) for route in ROUTES}
    assert paths.pop("remove") is None
    assert paths == {name: f"/ng-control/v1/checkpoint/{name}" for name in paths}
    assert sorted(paths) == sorted(
        ["prepare", "renew", "commit", "restore", "resume", "retire", "forget", "status"]
    )
    assert set(gym.CODECS) == set(paths)


@pytest.mark.parametrize(
    ("episode", "key"),
    [
        (EpisodeId(rollout_id="r1", attempt=0), "r1"),
        (EpisodeId(rollout_id="r1", attempt=1), "r1-a1"),
        (EpisodeId(rollout_id="t-a0", attempt=12), "t-a0-a12"),
        (EpisodeId(rollout_id="t-ab", attempt=0), "t-ab"),
    ],
)
def test_capture_keys_map_both_ways(episode: EpisodeId, key: str) -> None:
    """Gym's capture key: the rollout id at attempt 0, `<id>-a<N>` after (docs/protocol.md)."""
    assert gym.episode_key(episode) == key
    assert gym.parse_capture_key(key) == episode


@pytest.mark.parametrize("rollout_id", ["task-a3", "x:1"])
def test_rollout_ids_gym_cannot_carry_are_refused(rollout_id: str) -> None:
    """Gym reserves the `-a<N>` suffix and has no `:` in its ids: such a rollout has no Gym
    episode, and saying it anyway would name another one."""
    with pytest.raises(gym.Unmappable):
        gym.capture_key(rollout_id, 0)


@pytest.mark.parametrize("key", ["", "-a1", "r 1-a1"])
def test_malformed_capture_keys_are_refused(key: str) -> None:
    with pytest.raises(gym.Unmappable):
        gym.parse_capture_key(key)


def test_error_codes_map_both_ways() -> None:
    named = {
        ErrorCode.STALE_CHECKPOINT: ("stale_checkpoint", 409),
        ErrorCode.UNKNOWN_CHECKPOINT: ("invalid_phase", 409),
        ErrorCode.CONFLICTING_CHECKPOINT: ("checkpoint_conflict", 409),
        ErrorCode.WRONG_PHASE: ("invalid_phase", 409),
        ErrorCode.DEADLINE_PASSED: ("deadline_exceeded", 409),
        ErrorCode.ATTEMPT_RETIRED: ("stale_attempt", 409),
        ErrorCode.ADMISSION_CLOSED: ("admission_closed", 409),
        ErrorCode.STORAGE_FAILED: ("invalid_checkpoint_state", 422),
        ErrorCode.RECORDS_INVALID: ("invalid_checkpoint_state", 422),
        ErrorCode.RECORDS_UNREACHABLE: ("invalid_checkpoint_state", 422),  # "missing manifest"
        ErrorCode.UNAUTHORIZED: ("unauthorized", 401),
    }
    for code in ErrorCode:
        status, body = gym.gym_error(code, "why")
        if code is ErrorCode.INVALID_REQUEST:  # FastAPI's form, as Gym's models refuse a body
            assert (status, body["detail"][0]["msg"]) == (422, "why")
        elif code in named:
            assert (body["error"]["code"], status) == named[code]
        else:  # passed through with our name and status
            assert body["error"]["code"] == code.value
        back, detail = gym.our_error(status, json.dumps(body).encode())
        expected = {
            ErrorCode.UNKNOWN_CHECKPOINT: ErrorCode.WRONG_PHASE,
            ErrorCode.STORAGE_FAILED: ErrorCode.RECORDS_INVALID,
        }.get(code, code)
        assert back is expected
        assert detail.endswith("why")
    foreign = b'{"error": {"code": "gym_only_code", "detail": "m"}}'
    assert gym.our_error(409, foreign)[0] is ErrorCode.INTERNAL


def test_a_gym_prepare_reply_reads_as_ours() -> None:
    raw = (
        b'{"phase": "prepared", "report": {"ready": true, "blockers": [], "blocker_count": 0,'
        b' "counts": {"parked": 7, "live": 7}, "restarts": ["r9-a3"]}, "a_newer_field": 1}'
    )
    codec = gym.CODECS["prepare"]
    request = PrepareRequest(checkpoint_id="c1", deadline_ts=time.time() + 5)
    ours = codec.to_ours_reply(codec.reply.model_validate_json(raw), request, SIDE)
    assert ours == PrepareReply(
        checkpoint_id="c1",
        phase=Phase.PREPARED,
        ready=True,
        episode_count=7,
        restarts=[EpisodeId(rollout_id="r9", attempt=3)],
    )


def test_our_commit_is_said_in_gym_with_the_scope_as_episodes() -> None:
    codec = gym.CODECS["commit"]
    request = CommitRequest(
        checkpoint_id="c1",
        deadline_ts=100.0,
        rollout_ids=["a", "b", "c"],
        excluded_rollout_ids=["b"],
    )
    sent = codec.to_gym_request(request, SIDE)
    assert sent is not None
    assert sent.model_dump(mode="json", exclude_none=True) == {
        "checkpoint_id": "c1",
        "deadline_ts": 100.0,
        "checkpoint_dir": "c1",
        "episode_ids": [{"rollout_id": "a", "attempt": 3}, {"rollout_id": "c", "attempt": 3}],
    }
    # every parked episode but the restarting ones: no Gym scope says that
    with pytest.raises(gym.Unmappable, match="restarting"):
        codec.to_gym_request(
            CommitRequest(checkpoint_id="c1", deadline_ts=100.0, excluded_rollout_ids=["b"]), SIDE
        )


def test_a_gym_commit_reply_needs_our_extension_to_be_published() -> None:
    codec = gym.CODECS["commit"]
    request = CommitRequest(checkpoint_id="c1", deadline_ts=100.0)
    sha = "ab" * 32
    bare = {
        "phase": "committed",
        "manifest": {
            "schema_version": 1,
            "kind": "environment",
            "instance": "environment-0",
            "checkpoint_id": "c1",
            "records_file": f"records-{sha}.jsonl",
            "records_sha256": sha,
            "record_count": 2,
        },
        "episode_ids": ["r1-a1", "r2-a1"],
    }
    with pytest.raises(gym.Unmappable, match="manifest path"):
        codec.to_ours_reply(codec.reply.model_validate(bare), request, SIDE)
    full = {
        **bare,
        "attempt": 1,
        "bytes": 120,
        "manifest_path": "ns/set/uid/c1/environment-0/manifest.json",
    }
    ours = codec.to_ours_reply(codec.reply.model_validate(full), request, SIDE)
    assert isinstance(ours, CommitReply)
    assert (ours.manifest.record_count, ours.manifest.instance, ours.manifest.role) == (
        2,
        "environment-0",
        Role.ENVIRONMENT,
    )
    assert ours.manifest_path.endswith("manifest.json")


def test_restore_maps_both_ways_and_refuses_what_gym_cannot_ask() -> None:
    codec = gym.CODECS["restore"]
    request = RestoreRequest(
        checkpoint_id="c1", deadline_ts=100.0, attempt=2, rollout_ids=["r", "s"]
    )
    sent = codec.to_gym_request(request, SIDE)
    assert sent is not None
    # Gym names the checkpointed attempts; each continues as its next attempt
    assert sent.model_dump(mode="json") == {
        "checkpoint_id": "c1",
        "deadline_ts": 100.0,
        "checkpoint_dir": "c1",
        "episode_ids": [{"rollout_id": "r", "attempt": 1}, {"rollout_id": "s", "attempt": 1}],
    }
    assert codec.to_ours_request(sent, SERVER) == request
    reply = codec.reply.model_validate(
        {"phase": "restored", "source_checkpoint_id": "c1", "restored": ["r-a2"]}
    )
    ours = codec.to_ours_reply(reply, request, SIDE)
    assert isinstance(ours, RestoreReply)
    assert (ours.attempt, ours.restored, ours.record_count) == (
        2,
        [EpisodeId(rollout_id="r", attempt=2)],
        1,
    )
    for update in (
        {"rollout_ids": None},
        {"attempt": 0},
        {"peers": {Role.AGENT: "http://10.0.0.1:8000"}},
        {"index": 1},
        {"source_instance": "environment-1"},
    ):
        with pytest.raises(gym.Unmappable):
            codec.to_gym_request(request.model_copy(update=update), SIDE)
    # a Gym restore named by another id than the checkpoint it restores: not our participants'
    with pytest.raises(gym.Unmappable, match="checkpoint_id"):
        codec.to_ours_request(
            gym.GymRestoreRequest(
                checkpoint_id="op-7",
                deadline_ts=100.0,
                checkpoint_dir="c1",
                episode_ids=[gym.GymEpisodeId(rollout_id="r", attempt=1)],
            ),
            SERVER,
        )


@pytest.mark.parametrize(
    ("directory", "accepted"),
    [
        ("c1", True),
        ("ns/set/uid/c1", True),
        ("/ckpt/ns/set/uid/c1", True),
        ("/ckpt/ns/set/uid/c1/", True),
        ("/elsewhere/c1", False),
        ("ns/other/uid/c1", False),
        ("c2", False),
    ],
)
def test_checkpoint_dir_must_be_where_the_participant_keeps_it(
    directory: str, accepted: bool
) -> None:
    if accepted:
        gym.checkpoint_id_of_dir(directory, "c1", SERVER)
    else:
        with pytest.raises(gym.Unmappable, match="checkpoint_dir"):
            gym.checkpoint_id_of_dir(directory, "c1", SERVER)


def test_retire_scope_is_episodes_of_the_retired_attempt() -> None:
    codec = gym.CODECS["retire"]
    request = RetireRequest(
        operation_id="op", deadline_ts=100.0, attempt=1, rollout_ids=["a"], finished=["b"]
    )
    sent = codec.to_gym_request(request, SIDE)
    assert sent is not None
    assert sent.model_dump(mode="json") == {
        "checkpoint_id": "op",
        "deadline_ts": 100.0,
        "episode_ids": [{"rollout_id": "a", "attempt": 1}],
    }
    assert codec.to_ours_request(sent, SERVER) == request.model_copy(update={"finished": None})
    # every episode of an attempt: a Gym retire names its episodes
    with pytest.raises(gym.Unmappable, match="names its episodes"):
        codec.to_gym_request(request.model_copy(update={"rollout_ids": None}), SIDE)
    mixed = gym.GymRetireRequest(
        checkpoint_id="op",
        deadline_ts=100.0,
        episode_ids=[
            gym.GymEpisodeId(rollout_id="a", attempt=1),
            gym.GymEpisodeId(rollout_id="b", attempt=0),
        ],
    )
    with pytest.raises(gym.Unmappable, match="attempts"):
        codec.to_ours_request(mixed, SERVER)


# --- a participant on the SDK, reached with raw Gym JSON --------------------------------------


def _plane(root: Path, dialects: tuple[Dialect, ...]) -> ControlPlane:
    settings = ControlSettings(
        Role.ENVIRONMENT, set_name="g", checkpoint_root=root, token=TOKEN, dialects=dialects
    )
    return ControlPlane(FakeParticipant(Role.ENVIRONMENT, rollouts=["r1", "r2"]), settings)


@asynccontextmanager
async def _served(root: Path, dialects: tuple[Dialect, ...]) -> AsyncIterator[Any]:
    app = FastAPI()
    _plane(root, dialects).install(app)
    async with serve_app(app, role=Role.ENVIRONMENT, token=TOKEN) as served:
        yield served


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


async def _gym(http: httpx.AsyncClient, name: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", time.time() + 10)
    return await http.post(f"/ng-control/v1/checkpoint/{name}", json=body, headers=_auth())


@pytest.mark.anyio
async def test_a_gym_only_participant_answers_gym_json(tmp_path: Path) -> None:
    async with _served(tmp_path, (Dialect.GYM,)) as served:
        http = served.client
        assert (await http.get(f"{API_PREFIX}/status", headers=_auth())).status_code == 404
        unauthorized = await http.get("/ng-control/v1/capabilities")
        assert unauthorized.status_code == 401
        assert unauthorized.json()["error"]["code"] == "unauthorized"
        capabilities = (await http.get("/ng-control/v1/capabilities", headers=_auth())).json()
        assert capabilities["dialects"] == ["gym"]
        assert "remove" not in capabilities["operations"]

        prepared = await _gym(http, "prepare", checkpoint_id="c1")
        assert prepared.status_code == 200, prepared.text
        assert prepared.json() == {
            "phase": "prepared",
            "report": {
                "ready": True,
                "blockers": [],
                "blocker_count": 0,
                "counts": {"parked": 2},
                "restarts": [],
            },
        }
        conflict = await _gym(http, "prepare", checkpoint_id="c2")
        assert (conflict.status_code, conflict.json()["error"]["code"]) == (
            409,
            "checkpoint_conflict",
        )
        elsewhere = await _gym(http, "commit", checkpoint_id="c1", checkpoint_dir="/tmp/x/c1")
        assert elsewhere.status_code == 422
        assert "checkpoint_dir" in elsewhere.json()["detail"][0]["msg"]
        stop = await _gym(http, "commit", checkpoint_id="c1", checkpoint_dir="c1", stop=True)
        assert stop.status_code == 422  # no `stop` at the pinned commit: an unknown field
        commit = {
            "checkpoint_id": "c1",
            "checkpoint_dir": str(tmp_path / "g" / "c1"),
            "episode_ids": [{"rollout_id": "r1", "attempt": 0}],
        }
        committed = await _gym(http, "commit", **commit)
        assert committed.status_code == 200, committed.text
        reply = committed.json()
        assert reply["phase"] == "committed"
        assert reply["manifest"]["record_count"] == 1
        assert reply["episode_ids"] == ["r1"]
        assert (tmp_path / reply["manifest_path"]).is_file()
        again = await _gym(http, "commit", **commit)
        assert again.content == committed.content  # a repeated (id, commit) replays its result
        restore = {
            "checkpoint_id": "c1",
            "checkpoint_dir": "c1",
            "episode_ids": [{"rollout_id": "r1", "attempt": 0}],
        }
        early = await _gym(http, "restore", **restore)
        assert (early.status_code, early.json()["error"]["code"]) == (409, "invalid_phase")
        # a renew of a checkpoint that is not the open one while c1 is: our
        # `unknown_checkpoint`, said as Gym's `_admit` says it, `checkpoint_conflict`
        unknown = await _gym(http, "renew", checkpoint_id="c9")
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (
            409,
            "checkpoint_conflict",
        )
        resumed = await _gym(http, "resume", checkpoint_id="c1")
        assert resumed.json() == {"phase": "idle", "idempotent": False}
        stale = await _gym(http, "prepare", checkpoint_id="c1")
        assert (stale.status_code, stale.json()["error"]["code"]) == (409, "stale_checkpoint")
        restored = await _gym(http, "restore", **restore)
        assert restored.json() == {
            "phase": "restored",
            "source_checkpoint_id": "c1",
            "restored": ["r1-a1"],
        }
        status = (await http.get("/ng-control/v1/checkpoint/status", headers=_auth())).json()
        assert (status["kind"], status["phase"], status["attempt"], status["checkpoint_id"]) == (
            "environment",
            "restored",
            1,
            "c1",
        )


# --- the coordinator's side: capabilities, then the announced dialect -------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("mounted", "spoken"),
    [
        ((Dialect.ROLLOUT,), Dialect.ROLLOUT),
        ((Dialect.GYM,), Dialect.GYM),
        ((Dialect.GYM, Dialect.ROLLOUT), Dialect.ROLLOUT),
    ],
    ids=["ours", "gym", "both"],
)
async def test_the_client_speaks_the_dialect_announced(
    tmp_path: Path, mounted: tuple[Dialect, ...], spoken: Dialect
) -> None:
    async with (
        _served(tmp_path, mounted) as served,
        HttpParticipantClient(Role.ENVIRONMENT, served.target.base_url, token=TOKEN) as client,
    ):
        coordinator = Coordinator([client])
        result = await coordinator.checkpoint("c1", prepare_timeout=10, commit_timeout=10)
        assert result.ok, result
        assert client.dialect is spoken
        assert client_module._DIALECTS[served.target.base_url] is spoken
        if spoken is Dialect.GYM:
            with pytest.raises(ParticipantError) as refused:
                await client.remove(
                    RemoveRequest(deadline_ts=time.time() + 5, checkpoint_ids=["c1"])
                )
            assert refused.value.code is ErrorCode.UNSUPPORTED


@pytest.mark.anyio
async def test_a_remembered_dialect_is_probed_again_when_its_routes_are_gone(
    tmp_path: Path,
) -> None:
    async with _served(tmp_path, (Dialect.GYM,)) as served:
        url = served.target.base_url
        client_module._DIALECTS[url] = Dialect.ROLLOUT  # an earlier pod at this address
        async with HttpParticipantClient(Role.ENVIRONMENT, url, token=TOKEN) as client:
            status = await client.status(time.time() + 5)
            assert (status.phase, client.dialect) == ("idle", Dialect.GYM)
        async with HttpParticipantClient(
            Role.ENVIRONMENT, url, token=TOKEN, dialect=Dialect.ROLLOUT
        ) as fixed:
            with pytest.raises(ParticipantError) as missing:
                await fixed.status(time.time() + 5)
            assert (missing.value.code, missing.value.status_code) == (ErrorCode.INTERNAL, 404)


def test_both_dialects_are_published_from_the_one_route_table(tmp_path: Path) -> None:
    app = FastAPI()
    _plane(tmp_path, (Dialect.ROLLOUT, Dialect.GYM)).install(app)
    paths = app.openapi()["paths"]
    for route in ROUTES:
        for dialect in Dialect:
            path = route.path_in(dialect)
            if path is not None:
                assert route.method.lower() in paths[path], path
    assert "/ng-control/v1/capabilities" in paths
    prepare = paths["/ng-control/v1/checkpoint/prepare"]["post"]["responses"]
    assert "checkpoint_conflict" in prepare["409"]["description"]
    assert "stale_checkpoint" in prepare["409"]["description"]
    assert "410" not in prepare  # Gym says stale with 409


def test_the_dialects_come_from_the_pod_environment() -> None:
    env = {"ROLLOUT_CONTROL_TOKEN": "t"}
    assert ControlSettings.from_env(Role.MODEL, environ=env).dialects == (Dialect.ROLLOUT,)
    both = {**env, "ROLLOUT_CONTROL_DIALECTS": "gym, rollout"}
    assert ControlSettings.from_env(Role.MODEL, environ=both).dialects == (
        Dialect.GYM,
        Dialect.ROLLOUT,
    )
    with pytest.raises(ControlConfigError, match="ROLLOUT_CONTROL_DIALECTS"):
        ControlSettings.from_env(Role.MODEL, environ={**env, "ROLLOUT_CONTROL_DIALECTS": "grpc"})
    with pytest.raises(ControlConfigError, match="at least one"):
        ControlSettings(Role.MODEL, token="t", dialects=())
