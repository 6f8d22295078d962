"""NeMo Gym 0.7's typed episode on the adapter's `/run` (`rollout_gym.episode`, docs/gym.md,
"The typed episode" and "One attempt field"), on each Gym release the adapter supports.

The other side is nemo-gym 0.7.0's own code, run by the 0.7 environment's interpreter
(`testsupport/gym_collector.py`): its rollout collector builds each request from a collector row
(`_episode_request_body`), and parses each reply as 0.7.0's `SingleAgentTurnResponse` and into
the record it stores (`_episode_record`), and its `--resume` reads those records back from the
files it writes (`_load_from_cache`) to say which rollouts it sends again, as which attempt.
Every Gym part is real and runs as a
process: the released stateful counter hosted by `rollout-gym resources`, the adapter, and the
project's model server.

- a materialized task, as 0.7.0's collector sends it, is played and answered with the counter's
  verify as `result`, rewarded 1.0 (no increment lost or doubled); the same task in 0.4's shape
  too, the materialized row unwrapped;
- a peer that refuses for good (a resources "server" without `/seed_session`: 404) ends the
  episode at once as a terminal failure at stage `seed`, which 0.7.0's collector never resumes;
  in 0.4's shape, a code `rollout-collect` does not wait on;
- a lost peer (nothing listening) is a non-terminal failure, which Gym's resume re-sends as
  attempt 1, and the refusal it never re-sends;
- a Gym resume and an operator recovery never make two live attempts of one rollout: while
  attempt 0 is live, attempt 1 is refused before anything begins; after the recovery (a
  checkpoint, every process SIGKILLed, the set restored under attempt 1) attempt 0 is refused
  and attempt 1 continues the checkpointed episode, rewarded as if uninterrupted; in an InPlace
  recovery the retire ends attempt 0's live call as a non-terminal failure, Gym's resume
  re-sends it as attempt 1, refused until the restore and continued after it.
"""

from __future__ import annotations

import functools
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
import pytest
from rollout_protocol import Coordinator, HttpParticipantClient, Role
from test_gym_adapter import GymDriver, row
from testsupport.gym_processes import (
    COUNTER,
    COUNTER_NAME,
    GYM_RELEASES,
    GymProcess,
    gym_python,
    stop_together,
)
from testsupport.server_processes import TOKEN, Debug, ServerProcess, free_port

COLLECTOR = Path(__file__).resolve().parents[1] / "testsupport" / "gym_collector.py"
TASKSET = "counter"
WAIT_S = 60.0


@pytest.fixture(params=GYM_RELEASES)
def release(request: pytest.FixtureRequest) -> str:
    """Each test, on each Gym release the adapter supports (the collector is always 0.7.0's)."""
    value: str = request.param
    return value


def gym_collector(
    rows: list[dict[str, Any]], replies: list[Any], ran: list[tuple[int, Any]] | None = None
) -> dict[str, Any]:
    """What nemo-gym 0.7.0's collector sends for `rows`, makes of `replies` and, given what
    each row's call `ran` into (its reply, or None for none), sends on `--resume`."""
    given: dict[str, Any] = {"rows": rows, "replies": replies}
    if ran is not None:
        given["ran"] = ran
    done = subprocess.run(
        [str(gym_python("0.7")), str(COLLECTOR)],
        input=json.dumps(given),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def collector_row(
    task_id: str, index: int, rollout_id: str | None = None, **task_input: Any
) -> dict[str, Any]:
    """A materialized row as 0.7.0's collector keeps it: the task's envelope, its indices and,
    when given, the explicit rollout id (else Gym's `<task index>-<rollout index>`)."""
    data: dict[str, Any] = {
        "task_id": {"taskset": TASKSET, "task_id": task_id},
        "task_input": task_input or row(),
        "_ng_task_index": index,
        "_ng_rollout_index": 0,
    }
    if rollout_id is not None:
        data["_ng_rollout_id"] = rollout_id
    return data


def typed_body(rollout_id: str, attempt: int) -> dict[str, Any]:
    """The typed request for the counter's task, as 0.7.0's collector builds it (checked against
    its code in `test_a_typed_episode_from_gyms_collector`)."""
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": attempt},
        "task": {"task_id": {"taskset": TASKSET, "task_id": rollout_id}, "task_input": row()},
    }


async def test_a_typed_episode_from_gyms_collector(tmp_path: Path, release: str) -> None:
    canonical = {
        "responses_create_params": row()["responses_create_params"],
        "task_data": {k: v for k, v in row().items() if k != "responses_create_params"},
    }
    rows = [collector_row("t0", 0), collector_row("t1", 1, **canonical)]
    rows += [collector_row("t2", 2), collector_row("t3", 3)]
    requests = gym_collector(rows, [])["requests"]
    expected = typed_body("0-0", 0)
    expected["task"]["task_id"]["task_id"] = "t0"
    assert requests[0] == expected, requests  # the shape the tests below send
    model = ServerProcess.start(tmp_path, Role.MODEL, "--token-latency-ms", "0", attempt=0)
    started: dict[str, GymProcess] = {}
    counter_port = free_port()
    counter_url = f"http://127.0.0.1:{counter_port}"
    try:

        def start_counter() -> None:
            started["counter"] = GymProcess.start(
                tmp_path,
                "resources",
                ["--server", COUNTER, "--name", COUNTER_NAME],
                attempt=0,
                port=counter_port,
                release=release,
            )

        def environment(name: str, resources_url: str, step_timeout_s: float) -> None:
            args = ["--model-url", model.url, "--resources-url", resources_url]
            args += ["--step-timeout-seconds", str(step_timeout_s)]
            started[name] = GymProcess.start(
                tmp_path, "environment", args, attempt=0, release=release
            )

        # the four at once (each waits for its own /healthz; an environment reaches its
        # resources server only per episode): a Gym start is seconds of imports
        async with anyio.create_task_group() as starting:
            starting.start_soon(anyio.to_thread.run_sync, start_counter)
            for name, resources_url, step_timeout_s in (
                ("env", counter_url, 2 * WAIT_S),
                # the model server has no /seed_session (404); a wait for its restore would
                # outlast the test's own deadline for the call
                ("refusing", model.url, 2 * WAIT_S),
                ("lost", f"http://127.0.0.1:{free_port()}", 2),  # nothing listens there
            ):
                call = functools.partial(environment, name, resources_url, step_timeout_s)
                starting.start_soon(anyio.to_thread.run_sync, call)
        env, refusing, lost = started["env"], started["refusing"], started["lost"]
        async with httpx.AsyncClient(timeout=WAIT_S) as http:
            replies = [(await http.post(env.url + "/run", json=body)) for body in requests[:2]]
            materialized_04 = await http.post(
                env.url + "/run",
                json={"rollout_id": "flat-0", "attempt": 0, "task": rows[0]},
            )
            refused = await http.post(refusing.url + "/run", json=requests[2])
            refused_04 = await http.post(
                refusing.url + "/run", json={"rollout_id": "flat-1", "attempt": 0, "task": row()}
            )
            unreachable = await http.post(lost.url + "/run", json=requests[3])
    finally:
        stop_together([*started.values(), model])
    bodies = [reply.json() for reply in (*replies, refused, unreachable)]
    assert [reply.status_code for reply in (*replies, refused, unreachable)] == [200] * 4, bodies
    seen = gym_collector(rows, bodies, ran=list(enumerate(bodies)))
    played, refusal, lost_peer = seen["replies"][:2], seen["replies"][2], seen["replies"][3]
    for request, reply, record in zip(requests, played, seen["records"], strict=False):
        assert reply["episode_id"] == request["episode_id"], reply
        assert reply["task_id"] == request["task"]["task_id"], reply
        assert "failure" not in reply, reply
        assert reply["result"]["reward"] == 1.0, reply  # the counter's own verify
        assert record["reward"] == 1.0, record
    # a refusal no restore changes: terminal, answered at once
    assert refusal["failure"]["terminal"] is True, refusal
    assert refusal["failure"]["stage"] == "seed", refusal
    assert refusal["failure"]["failure_kind"] == "rollout_gym:unsupported", refusal
    assert "seed_session answered 404" in refusal["failure"]["failure_reason"], refusal
    assert seen["records"][2]["_ng_failure_terminal"] is True, seen["records"][2]
    # a lost peer: not terminal, so a resume re-sends it as its next attempt
    assert lost_peer["failure"]["terminal"] is False, lost_peer
    assert lost_peer["failure"]["failure_kind"] == "transport_unreachable", lost_peer
    assert lost_peer["failure"]["stage"] == "seed", lost_peer
    assert seen["records"][3]["_ng_failure_terminal"] is False, seen["records"][3]
    # Gym's own resume: the lost peer's rollout again as attempt 1, never the refused one
    resent = {**requests[3], "episode_id": {"rollout_id": "3-0", "attempt": 1}}
    assert seen["resumed"] == [resent], seen["resumed"]
    # the 0.4 shape: a materialized row played as its task_input; the refusal a final code
    assert materialized_04.status_code == 200, materialized_04.text
    assert materialized_04.json()["reward"] == 1.0, materialized_04.text
    assert refused_04.status_code == 501, refused_04.text
    assert refused_04.json()["error"]["code"] == "unsupported", refused_04.text


def coordinator(driver: GymDriver, session: aiohttp.ClientSession) -> Coordinator:
    """The operator's coordinator of the driver's three participants."""
    return Coordinator(
        [
            HttpParticipantClient(t.role, t.base_url, token=TOKEN, client=session)
            for t in driver.participants()
        ]
    )


async def test_a_gym_resume_and_a_recovery_never_run_two_attempts(
    tmp_path: Path, release: str
) -> None:
    rid = "typed-0"
    async with httpx.AsyncClient(timeout=WAIT_S) as http, aiohttp.ClientSession() as session:
        driver = GymDriver(tmp_path, http, strategy="replay", release=release)
        try:
            await driver.restart(0)
            env, _, model = driver._running()
            await Debug(http, model.url).arm("finish", rid)
            first: list[BaseException] = []
            async with anyio.create_task_group() as group:

                async def attempt_0() -> None:
                    try:
                        await http.post(env.url + "/run", json=typed_body(rid, 0))
                    except httpx.TransportError as error:  # the crash below
                        first.append(error)

                group.start_soon(attempt_0)
                await driver.wait_mid_episode([rid], time.time() + WAIT_S)
                # a Gym resume while attempt 0 is live here: refused before anything begins
                early = await http.post(env.url + "/run", json=typed_body(rid, 1))
                stats_early = (
                    await http.get(env.url + "/stats", params={"rollout_id": rid})
                ).json()
                checkpoint = await coordinator(driver, session).checkpoint(
                    "typed-ckpt", prepare_timeout=20, commit_timeout=20
                )
                assert checkpoint.ok, checkpoint.message
                await driver.crash()
            assert first, "attempt 0's call ends with the crash"
            await driver.restart(1)  # the operator's recovery: the set's attempt is 1
            env, _, _ = driver._running()
            restoring = coordinator(driver, session)
            restored = await restoring.restore("typed-ckpt", 1, time.time() + WAIT_S)
            assert restored.ok, restored.failures
            resumed = await restoring.resume("typed-ckpt", time.time() + WAIT_S)
            assert not resumed.failures
            stale = await http.post(env.url + "/run", json=typed_body(rid, 0))
            again = await http.post(env.url + "/run", json=typed_body(rid, 1))
            stats = (await http.get(env.url + "/stats", params={"rollout_id": rid})).json()
        finally:
            driver.stop()
    bodies = [reply.json() for reply in (early, stale, again)]
    assert [reply.status_code for reply in (early, stale, again)] == [200] * 3, bodies
    seen = gym_collector([], bodies)
    early_failure, stale_failure = seen["replies"][0]["failure"], seen["replies"][1]["failure"]
    assert early_failure["terminal"] is False, early_failure
    assert early_failure["stage"] == "admission", early_failure
    assert "runs attempt 0, not 1" in early_failure["failure_reason"], early_failure
    assert list(stats_early["rollouts"][rid]) == ["0"], stats_early  # nothing began under 1
    assert stale_failure["terminal"] is False, stale_failure
    assert "runs attempt 1, not 0" in stale_failure["failure_reason"], stale_failure
    assert seen["replies"][2]["result"]["reward"] == 1.0, seen["replies"][2]
    under_1 = stats["rollouts"][rid]["1"]
    assert "seed" not in under_1, stats  # continued from the checkpoint, not started again
    assert under_1["run"]["started"] == 1, stats


async def test_an_in_place_recovery_ends_the_live_attempt_before_the_next_runs(
    tmp_path: Path, release: str
) -> None:
    """The operator's InPlace recovery: the processes stay, attempt 0 is retired in them (its
    live episode stopped) and the checkpoint restored under attempt 1. Attempt 0's typed call
    ends as a non-terminal failure (`cancelled`), so Gym's resume re-sends it as attempt 1,
    which continues the checkpointed episode; until the restore, attempt 1 is refused."""
    rid = "typed-1"
    rows = [collector_row(rid, 0, rollout_id=rid)]
    [request_0] = gym_collector(rows, [])["requests"]
    assert request_0 == typed_body(rid, 0), request_0
    async with httpx.AsyncClient(timeout=WAIT_S) as http, aiohttp.ClientSession() as session:
        driver = GymDriver(tmp_path, http, strategy="replay", release=release)
        try:
            await driver.restart(0)
            env, _, model = driver._running()
            await Debug(http, model.url).arm("finish", rid)
            first: list[httpx.Response] = []
            async with anyio.create_task_group() as group:

                async def attempt_0() -> None:
                    first.append(await http.post(env.url + "/run", json=request_0))

                group.start_soon(attempt_0)
                await driver.wait_mid_episode([rid], time.time() + WAIT_S)
                recovery = coordinator(driver, session)
                checkpoint = await recovery.checkpoint(
                    "typed-ckpt", prepare_timeout=20, commit_timeout=20
                )
                assert checkpoint.ok, checkpoint.message
                retired = await recovery.retire(0, None, time.time() + WAIT_S)
                assert not retired.failures, retired.failures
                await Debug(http, model.url).release("token", rid)
            # Gym's resume of what attempt 0's call answered: the rollout as attempt 1
            resume = gym_collector(rows, [first[0].json()], ran=[(0, first[0].json())])
            [request_1] = resume["resumed"]
            assert request_1["episode_id"] == {"rollout_id": rid, "attempt": 1}, request_1
            between = await http.post(env.url + "/run", json=request_1)
            restored = await recovery.restore("typed-ckpt", 1, time.time() + WAIT_S)
            assert restored.ok, restored.failures
            resumed = await recovery.resume("typed-ckpt", time.time() + WAIT_S)
            assert not resumed.failures
            again = await http.post(env.url + "/run", json=request_1)
            stats = (await http.get(env.url + "/stats", params={"rollout_id": rid})).json()
        finally:
            driver.stop()
    ended = resume["replies"][0]["failure"]
    assert (ended["terminal"], ended["failure_kind"]) == (False, "cancelled"), ended
    assert resume["records"][0]["_ng_failure_terminal"] is False, resume["records"][0]
    replies = [between, again]
    assert [reply.status_code for reply in replies] == [200] * 2, [r.text for r in replies]
    seen = gym_collector([], [reply.json() for reply in replies])
    refused = seen["replies"][0]["failure"]
    assert (refused["terminal"], refused["stage"]) == (False, "admission"), refused
    assert seen["replies"][1]["result"]["reward"] == 1.0, seen["replies"][1]
    under_1 = stats["rollouts"][rid]["1"]
    assert "seed" not in under_1, stats  # continued from the checkpoint
    assert under_1["run"]["started"] == 1, stats
