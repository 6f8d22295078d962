"""Multi-worker participants, the parts without processes: which worker holds a rollout, what
the settings and the status route say, the operator's refusal, `/stats` merged over workers and
the reference CLI's `--workers` (docs/protocol.md, "Workers")."""

from __future__ import annotations

import argparse
import re
import socket
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn
from fastapi import FastAPI
from rollout_operator.decide.workers import unmanaged_workers
from rollout_protocol import (
    CommitRequest,
    ControlConfigError,
    ControlPlane,
    ControlSettings,
    EpisodeId,
    EpisodeRuntime,
    MultiProcess,
    PrepareRequest,
    ProtocolError,
    Record,
    RestoreRequest,
    Role,
    RuntimeParticipant,
    StatusReply,
)
from rollout_protocol._workers import PodState, WorkerPool
from rollout_protocol.conformance import (
    WORKERS_MANAGED,
    WORKERS_PRIVATE,
    WORKERS_SPREAD,
    ConformanceError,
    Target,
    check_crash_restore,
    check_workers,
    rollout_ids_per_worker,
    serve_app,
)
from rollout_protocol.workers import merge_stats, owner
from rollout_servers.cli import build_parser, worker_count
from rollout_servers.servers.common import ServerOptions
from rollout_servers.servers.resources import ResourcesServer

BASE = {"ROLLOUT_CONTROL_TOKEN": "t"}


def settings(**env: str) -> ControlSettings:
    return ControlSettings.from_env(Role.ENVIRONMENT, environ={**BASE, **env})


def test_a_rollout_always_lives_in_the_same_worker_and_all_workers_get_some() -> None:
    ids = [f"r{n}" for n in range(300)]
    assert [owner(rid, 4) for rid in ids] == [owner(rid, 4) for rid in ids]
    counts = [sum(owner(rid, 4) == k for rid in ids) for k in range(4)]
    assert min(counts) > 40, counts  # spread: each of 4 workers holds a share of 300
    assert {owner(rid, 1) for rid in ids} == {0}


def test_settings_say_how_the_server_runs_its_processes() -> None:
    assert settings().multi_process is MultiProcess.SINGLE
    worker = settings(ROLLOUT_WORKER="1/3", ROLLOUT_WORKER_KEY="k")
    assert (worker.worker, worker.workers, worker.multi_process) == (1, 3, MultiProcess.MANAGED)
    unmanaged = settings(WEB_CONCURRENCY="4")
    assert (unmanaged.unmanaged_workers, unmanaged.multi_process) == (4, MultiProcess.UNMANAGED)
    with pytest.raises(ControlConfigError, match="ROLLOUT_WORKER"):
        settings(ROLLOUT_WORKER="three")
    with pytest.raises(ControlConfigError, match="worker 3 is not one of 3"):
        settings(ROLLOUT_WORKER="3/3")


def test_the_status_route_reports_unmanaged_workers() -> None:
    participant = RuntimeParticipant(Role.ENVIRONMENT, EpisodeRuntime())
    status = ControlPlane(participant, settings(WEB_CONCURRENCY="2")).status()
    assert (status.multi_process, status.workers) == (MultiProcess.UNMANAGED, 2)
    single = ControlPlane(participant, settings()).status()
    assert (single.multi_process, single.workers) == (MultiProcess.SINGLE, 1)


def status(instance: str, multi: MultiProcess, workers: int = 1) -> StatusReply:
    return StatusReply(
        role=Role(instance.split("-")[0]),
        instance=instance,
        attempt=1,
        phase="idle",
        multi_process=multi,
        workers=workers,
    )


def test_the_operator_refuses_a_set_with_an_unmanaged_pod_and_names_it() -> None:
    pods = {"environment-0": "math-environment-0-a1", "agent-0": "math-agent-0-a1"}
    fine = [
        status("environment-0", MultiProcess.MANAGED, 3),
        status("agent-0", MultiProcess.SINGLE),
    ]
    assert unmanaged_workers(fine, pods) is None
    refused = unmanaged_workers([status("environment-0", MultiProcess.UNMANAGED, 2), fine[1]], pods)
    assert refused is not None
    assert "pod math-environment-0-a1 (environment-0, 2 worker processes)" in refused
    assert "math-agent-0-a1" not in refused
    assert "serve_workers" in refused


def test_stats_of_workers_merge_counts_but_not_the_attempt() -> None:
    a = {"attempt": 2, "live": 1, "steps": {"2": {"seed": {"completed": 3}}}, "rollouts": {"x": 1}}
    b = {"attempt": 2, "live": 2, "steps": {"2": {"seed": {"completed": 4}}}, "rollouts": {"y": 2}}
    assert merge_stats(a, b) == {
        "attempt": 2,
        "live": 3,
        "steps": {"2": {"seed": {"completed": 7}}},
        "rollouts": {"x": 1, "y": 2},
    }


def kit_app(settings: ControlSettings) -> FastAPI:
    app = FastAPI()
    ControlPlane(RuntimeParticipant(Role.ENVIRONMENT, EpisodeRuntime()), settings).install(app)
    return app


async def test_the_kit_fails_a_server_whose_workers_private_channel_answers_outsiders() -> None:
    """A fake of a pod of 3 workers (its status says so) whose `/_worker/v1/counts` answers
    anyone, as one worker's route did when the pod forwarded the private channel: the kit
    refuses it; the same pod without that route passes."""
    settings = ControlSettings(Role.ENVIRONMENT, token="t", workers=3)
    sealed = kit_app(settings)
    async with serve_app(sealed, role=Role.ENVIRONMENT, token="t") as served:
        await check_workers(served.target, workers=3)
    leaky = kit_app(settings)

    @leaky.get("/_worker/v1/counts")
    async def counts() -> dict[str, int]:
        return {"live": 0, "parked": 0, "restored": 0}

    async with serve_app(leaky, role=Role.ENVIRONMENT, token="t") as served:
        with pytest.raises(ConformanceError) as caught:
            await check_workers(served.target, workers=3)
    assert caught.value.rule == WORKERS_PRIVATE
    assert "without a token" in str(caught.value)
    assert "200" in str(caught.value)


async def test_the_kit_fails_an_unmanaged_server_and_names_the_fix() -> None:
    settings = ControlSettings(Role.ENVIRONMENT, token="t", unmanaged_workers=2)
    async with serve_app(kit_app(settings), role=Role.ENVIRONMENT, token="t") as served:
        with pytest.raises(ConformanceError) as caught:
            await check_workers(served.target)
    assert caught.value.rule == WORKERS_MANAGED
    assert "serve_workers" in str(caught.value)


class NoEpisodes:
    """A driver whose checks must stop before any episode: its rollout ids miss a worker."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def participants(self) -> list[Target]:
        return [self.target]

    async def run_episode(self, rollout_id: str, attempt: int) -> Any:
        raise AssertionError("no episode may run")

    async def wait_mid_episode(self, rollout_ids: Sequence[str], deadline_ts: float) -> None:
        raise AssertionError("no episode may run")

    async def crash(self) -> None:
        raise AssertionError("no crash")

    async def restart(self, attempt: int) -> None:
        raise AssertionError("no restart")


async def test_the_kit_wants_rollout_ids_in_every_worker(tmp_path: Path) -> None:
    settings = ControlSettings(Role.ENVIRONMENT, token="t", workers=3)
    ids = rollout_ids_per_worker(3)
    assert sorted(owner(rid, 3) for rid in ids) == [0, 1, 2]
    async with serve_app(kit_app(settings), role=Role.ENVIRONMENT, token="t") as served:
        with pytest.raises(ConformanceError) as caught:
            await check_crash_restore(
                NoEpisodes(served.target), checkpoint_root=tmp_path, rollout_ids=ids[:2]
            )
    assert caught.value.rule == WORKERS_SPREAD
    assert caught.value.fault.startswith("the driver")


def args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_the_reference_cli_takes_workers_from_the_flag_or_web_concurrency() -> None:
    assert worker_count(args("environment", "--workers", "3"), {}) == 3
    assert worker_count(args("agent"), {"WEB_CONCURRENCY": "2"}) == 2
    assert worker_count(args("resources"), {}) == 1
    with pytest.raises(SystemExit, match="one process per engine"):
        worker_count(args("model", "--workers", "2"), {})
    assert worker_count(args("model"), {}) == 1


@pytest.mark.parametrize("declared", ["²", "٣", "3 ", "+3", "3_0", "-1", "three"])
def test_web_concurrency_is_a_whole_number_of_ascii_digits_or_refused(declared: str) -> None:
    """`str.isdigit()` takes `²` (which `int()` refuses) and `int()` takes `٣`, ` 3`, `3_0`:
    both the CLI and the control plane's settings refuse them with the variable's name."""
    refusal = re.escape(f"WEB_CONCURRENCY={declared!r} is not a whole number")
    with pytest.raises(SystemExit, match=refusal):
        worker_count(args("agent"), {"WEB_CONCURRENCY": declared})
    with pytest.raises(ControlConfigError, match="WEB_CONCURRENCY"):
        settings(WEB_CONCURRENCY=declared)


@asynccontextmanager
async def served_workers(
    tmp_path: Path, workers: list[ControlPlane], pod_settings: ControlSettings
) -> AsyncIterator[ControlPlane]:
    """A pod's plane over `workers` (worker planes in process, each served on a Unix socket of
    its own as `serve_workers` serves them), its pool following the pod as `serve_workers` sets
    it up."""
    paths, servers = [], []
    async with anyio.create_task_group() as group:
        for k, worker in enumerate(workers):
            app = FastAPI()
            worker.install(app)
            path = str(tmp_path / f"worker-{k}.sock")
            listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listening.bind(path)  # bound and listening before serving: calls wait in its backlog
            listening.listen()
            server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
            group.start_soon(server.serve, [listening])
            paths.append(path)
            servers.append(server)
        pool = WorkerPool(Role.ENVIRONMENT, paths, "k")
        pod = ControlPlane(pool, pod_settings)
        pool.pod_state = lambda: PodState(
            attempt=pod.attempt, index=pod.settings.index, standby=pod.settings.standby
        )
        try:
            yield pod
        finally:
            for server in servers:
                server.should_exit = True
            await pool.aclose()


def worker_plane(participant: RuntimeParticipant, slot: str) -> ControlPlane:
    return ControlPlane(
        participant, settings(ROLLOUT_WORKER=slot, ROLLOUT_WORKER_KEY="k", ROLLOUT_STANDBY="1")
    )


async def test_the_workers_of_an_adopted_standby_become_the_instance_it_was_adopted_for(
    tmp_path: Path,
) -> None:
    """A standby pod's install under another instance's index reaches its workers: the pool
    sends the pod's identity with the install, and each worker's plane (and so the `instance`
    its server reports at `/healthz` and `/stats`) follows it."""
    worker = worker_plane(RuntimeParticipant(Role.ENVIRONMENT, EpisodeRuntime()), "0/1")
    assert worker.settings.standby
    async with served_workers(tmp_path, [worker], settings(ROLLOUT_STANDBY="1")) as pod:
        pool = pod.participant
        assert isinstance(pool, WorkerPool)
        # the pod's plane as a restore under index 2 leaves it, once the records verified
        pool.pod_state = lambda: PodState(attempt=0, index=2, standby=False)
        with anyio.fail_after(30):
            await pool.install([], 1)
    assert (worker.settings.instance, worker.settings.standby) == ("environment-2", False)
    assert worker.attempt == 1


class BrokenInstall(RuntimeParticipant):
    """A worker's participant whose install fails (a broken engine, a full disk)."""

    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        raise RuntimeError("the engine did not take the records")


async def test_a_failed_adoption_gives_every_workers_identity_back(tmp_path: Path) -> None:
    """A standby pod of two workers adopted for `environment-2`: one worker installs (and
    follows the new identity), the other fails. The pod's restore fails, and the reopen that
    follows brings both workers back to the standby's own instance and attempt, as the pod."""
    env = {"ROLLOUT_CHECKPOINT_ROOT": str(tmp_path), "ROLLOUT_SET": "s"}
    deadline = time.time() + 30
    lost = ControlPlane(
        RuntimeParticipant(Role.ENVIRONMENT, EpisodeRuntime()),
        settings(ROLLOUT_INDEX="2", **env),
    )
    async with lost.running():
        await lost.prepare(PrepareRequest(checkpoint_id="c", deadline_ts=deadline))
        await lost.commit(CommitRequest(checkpoint_id="c", deadline_ts=deadline))
    installs = worker_plane(RuntimeParticipant(Role.ENVIRONMENT, EpisodeRuntime()), "0/2")
    fails = worker_plane(BrokenInstall(Role.ENVIRONMENT, EpisodeRuntime()), "1/2")
    pod_settings = settings(ROLLOUT_STANDBY="1", **env)
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    async with served_workers(sockets, [installs, fails], pod_settings) as pod:
        with anyio.fail_after(30), pytest.raises(ProtocolError, match="install failed"):
            await pod.restore(
                RestoreRequest(checkpoint_id="c", attempt=1, deadline_ts=deadline, index=2)
            )
    assert (pod.settings.instance, pod.settings.standby, pod.attempt) == ("environment-0", True, 0)
    for worker in (installs, fails):
        assert (worker.settings.instance, worker.settings.standby) == ("environment-0", True)
        assert worker.attempt == 0


async def test_a_reference_server_reports_the_instance_it_was_adopted_as(tmp_path: Path) -> None:
    """`/healthz` and `/stats` of a standby reference server adopted for `resources-2` name
    `resources-2` (they read the plane's identity, not the start-up settings)."""
    env = {"ROLLOUT_CHECKPOINT_ROOT": str(tmp_path), "ROLLOUT_SET": "s", **BASE}
    options = ServerOptions(role=Role.RESOURCES)
    lost = ResourcesServer(options, environ={**env, "ROLLOUT_INDEX": "2"})
    deadline = time.time() + 30
    async with serve_app(lost.build_app(), role=Role.RESOURCES, token="t"):
        assert (
            await lost.plane.prepare(PrepareRequest(checkpoint_id="c", deadline_ts=deadline))
        ).ready
        await lost.plane.commit(CommitRequest(checkpoint_id="c", deadline_ts=deadline))
    standby = ResourcesServer(options, environ={**env, "ROLLOUT_STANDBY": "1"})
    async with serve_app(standby.build_app(), role=Role.RESOURCES, token="t") as served:
        before = (await served.client.get("/healthz")).json()["instance"]
        await standby.plane.restore(
            RestoreRequest(checkpoint_id="c", attempt=1, deadline_ts=deadline, index=2)
        )
        health = (await served.client.get("/healthz")).json()
        stats = (await served.client.get("/stats")).json()
    assert before != "resources-2"
    assert (health["instance"], stats["instance"]) == ("resources-2", "resources-2")
