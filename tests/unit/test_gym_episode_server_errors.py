"""A released environment server's failed step as the `/run` error `rollout-collect` reads
(`rollout_gym.episode_server`, docs/gym.md, "Errors and failures"): a peer's answer no restore
changes (a 4xx other than 408, 409, 425, 429; 404 and 405 a route it does not have) ends the
episode at once with a code outside `RESTORE_CODES`, naming the step, the peer and its answer;
a peer unreachable until the step's deadline is `unreachable`, and a 5xx (an agent's 500
included, as nemo-gym 0.7.0 classifies it) `internal`: both wait for the set's recovery.

No Gym server: the `single_agent_turn` steps' peers are an in-memory transport in place of the
adapter's HTTP client, and `legacy_agent`'s released relay (which answers with its agent's
status and body) an app that answers `/run` as the agent would. The released servers in
processes: tests/protocol/test_gym_environment_servers.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from rollout_gym import episode_server
from rollout_gym.gym_config import ServerSpec
from rollout_protocol import RESTORE_CODES, ControlSettings, ErrorCode, Role

TOKEN = "episode-server-token"
RESOURCES, AGENT = "weather", "weather_simple_agent"
PEERS = {"resources": "http://resources.test", "agent": "http://agent.test"}
TURN = ServerSpec(
    "weather_single_agent_turn",
    "environment_servers",
    "single_agent_turn",
    {
        "resources_server": {"type": "resources_servers", "name": RESOURCES},
        "agent_server": {"type": "responses_api_agents", "name": AGENT},
        "resources_tool_transports": ["direct_http"],
    },
)
LEGACY = ServerSpec(
    "weather_environment_server",
    "environment_servers",
    "legacy_agent",
    {"agent_server": {"type": "responses_api_agents", "name": AGENT}},
)
ROW = {"responses_create_params": {"input": [{"role": "user", "content": "weather in sf?"}]}}
RESPONSE = {"output": [{"type": "message", "content": [{"type": "output_text", "text": "cold"}]}]}
Answer = tuple[int, Any]
"""A peer's status and JSON body."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def peers(answers: dict[str, Answer | type[Exception]]) -> httpx.MockTransport:
    """The resources server and the agent: `answers` replace the sessions protocol's answers
    by `<peer> <path>` (an exception type: the call raises it, as a gone peer's connection
    does); every other call succeeds."""

    def handle(request: httpx.Request) -> httpx.Response:
        peer = "resources" if request.url.host == "resources.test" else "agent"
        path = request.url.path
        if path.startswith("/ng-rollout/"):
            path = "/v1/responses"
        answer = answers.get(f"{peer} {path}")
        if isinstance(answer, type):
            raise answer(f"{peer} is gone", request=request)
        if answer is not None:
            return httpx.Response(answer[0], json=answer[1])
        body = json.loads(request.content or b"{}")
        ok: dict[str, Any] = {
            "resources /seed_session": {"resources_session_id": body.get("resources_session_id")},
            "resources /verify": {"reward": 1.0, "response": body.get("response")},
            "agent /v1/agent_sessions": {"agent_session_id": body.get("agent_session_id")},
            "agent /v1/responses": RESPONSE,
            "agent /v1/agent_sessions/close": {"agent_session_id": body.get("agent_session_id")},
        }
        cookies = {"set-cookie": f"{peer}_session=s1; Path=/"}
        return httpx.Response(200, json=ok.get(f"{peer} {path}", {}), headers=cookies)

    return httpx.MockTransport(handle)


async def run_once(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    spec: ServerSpec,
    *,
    transport: httpx.MockTransport | None = None,
    relay: Answer | None = None,
) -> httpx.Response:
    """One `/run` of a fresh environment pod whose peers answer as given."""
    if transport is not None:
        client: Callable[[float], httpx.AsyncClient] = lambda timeout: httpx.AsyncClient(  # noqa: E731
            transport=transport, timeout=timeout
        )
        monkeypatch.setattr(episode_server, "make_client", client)
    gym_app = FastAPI()
    if relay is not None:
        status, said = relay

        @gym_app.post("/run")
        async def run() -> JSONResponse:
            return JSONResponse(said, status_code=status)

    control = ControlSettings(
        role=Role.ENVIRONMENT, set_name="demo", checkpoint_root=tmp_path, token=TOKEN
    )
    app = episode_server.build_app(control, spec, gym_app, PEERS, step_timeout_s=0.2)
    transport_in = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport_in, base_url="http://environment") as http,
    ):
        body = {"rollout_id": "r1", "attempt": 0, "task": ROW}
        return await http.post("/run", json=body, timeout=30)


def error_of(reply: httpx.Response) -> tuple[ErrorCode, str]:
    error = reply.json()["error"]
    return ErrorCode(error["code"]), str(error["detail"])


async def test_the_peers_answering_as_the_protocol_wants_is_a_result(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The fake peers play a whole episode: a failure below is the answer the test changed."""
    reply = await run_once(monkeypatch, tmp_path, TURN, transport=peers({}))
    assert reply.status_code == 200, reply.text
    assert (reply.json()["reward"], reply.json()["answer"]) == (1.0, "cold")


@pytest.mark.parametrize(
    ("peer_path", "answer", "code", "step"),
    [
        # an agent without 0.7's sessions (a route it does not have)
        ("agent /v1/agent_sessions", (404, "Not Found"), ErrorCode.UNSUPPORTED, "seed_agent"),
        # a task the agent's model refuses, with the model's status
        ("agent /v1/responses", (400, "no image input"), ErrorCode.INVALID_REQUEST, "agent"),
        ("resources /verify", (422, "no expected answer"), ErrorCode.INVALID_REQUEST, "verify"),
        ("resources /seed_session", (405, "Not Allowed"), ErrorCode.UNSUPPORTED, "seed_resources"),
    ],
)
async def test_a_peers_refusal_no_restore_changes_ends_the_episode_at_once(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    peer_path: str,
    answer: Answer,
    code: ErrorCode,
    step: str,
) -> None:
    transport = peers({peer_path: answer})
    reply = await run_once(monkeypatch, tmp_path, TURN, transport=transport)
    found, detail = error_of(reply)
    assert found is code, reply.text
    assert found not in RESTORE_CODES, "terminal: rollout-collect fails the episode at once"
    peer, path = peer_path.split(" ")
    name = RESOURCES if peer == "resources" else AGENT
    assert f"step {step}: {peer} {name}" in detail, detail
    said = f"answered {answer[0]}: {json.dumps(answer[1])}"
    assert said in detail, detail
    assert path in detail or step == "agent", detail  # the agent's path names the capture key


@pytest.mark.parametrize(
    ("peer_path", "answer", "code"),
    [
        ("agent /v1/agent_sessions", httpx.ConnectError, ErrorCode.UNREACHABLE),
        ("resources /seed_session", httpx.ConnectError, ErrorCode.UNREACHABLE),
        ("agent /v1/responses", (500, "FileNotFoundError('words.txt')"), ErrorCode.INTERNAL),
        ("resources /verify", (503, "restarting"), ErrorCode.INTERNAL),
        # this project's servers: a call of another attempt than theirs, which a recovery ends
        ("agent /v1/responses", (409, {"error": {"code": "attempt_mismatch"}}), ErrorCode.INTERNAL),
        ("resources /seed_session", (429, "busy"), ErrorCode.INTERNAL),
    ],
)
async def test_a_lost_peer_or_a_status_that_may_change_waits_for_the_recovery(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    peer_path: str,
    answer: Answer | type[Exception],
    code: ErrorCode,
) -> None:
    reply = await run_once(monkeypatch, tmp_path, TURN, transport=peers({peer_path: answer}))
    found, detail = error_of(reply)
    assert found is code, reply.text
    assert found in RESTORE_CODES, "non-terminal: rollout-collect waits for the next attempt"
    peer = peer_path.split(" ")[0]
    assert f"{peer} {RESOURCES if peer == 'resources' else AGENT}" in detail, detail


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (404, ErrorCode.UNSUPPORTED),
        (422, ErrorCode.INVALID_REQUEST),
        (500, ErrorCode.INTERNAL),
        (502, ErrorCode.INTERNAL),
    ],
)
async def test_legacy_agents_relayed_answer_is_classified_as_the_agent_gave_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, status: int, code: ErrorCode
) -> None:
    """`legacy_agent`'s relay answers with the agent's `/run` status: a 4xx no restore changes
    is final, a 500 (whatever the agent's handler raised) waits, as nemo-gym 0.7.0's collector
    counts it (a failure it re-sends on resume)."""
    reply = await run_once(monkeypatch, tmp_path, LEGACY, relay=(status, "the agent said"))
    found, detail = error_of(reply)
    assert found is code, reply.text
    assert (found in RESTORE_CODES) is (status >= 500)
    said = f'step agent: agent {AGENT} (relayed by {LEGACY.name}): /run answered {status}: "the'
    assert said in detail, detail
