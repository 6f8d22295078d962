"""Work-loss accounting (docs/operations.md, "Work lost in a recovery"): what a restore kept and
what a loss has done again.

From the bottom up:

- the episode runtime's participant counts the steps its restored records hold (`RestoreReply.
  kept`) and, at a retire, the steps its episodes completed after the last checkpoint it
  committed or restored, except those of finished rollouts (`RetireReply.lost`,
  `lost_since`, `finished`), through a real control plane;
- the model participant does the same with generated tokens;
- the coordinator tells later retire stages which rollouts finished once a whole environment
  (or agent) role retired and said, and collects what everyone reported;
- the operator adds the reports up per recovery (`workloss.work_loss`), naming the
  participants whose work nobody could count, and counts them in its metrics.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY
from rollout_operator import metrics
from rollout_operator.decide.workloss import lost_reports, total_work, work_loss
from rollout_operator.model.api import LostWorkReport, RolloutSet, Work
from rollout_protocol import (
    PREPARE_ORDER,
    Boundary,
    ControlPlane,
    ControlSettings,
    Coordinator,
    Episode,
    EpisodeRuntime,
    HttpParticipantClient,
    LostWork,
    Participant,
    Record,
    Role,
    RuntimeParticipant,
    StepMode,
)
from rollout_protocol.conformance import serve_app
from rollout_servers.servers.common import ServerOptions
from rollout_servers.servers.model import ModelServer
from testsupport.participants import FakeParticipant

pytestmark = pytest.mark.unit

TOKEN = "work-accounting-token"


def soon() -> float:
    return time.time() + 10.0


@asynccontextmanager
async def coordinated(
    participants: Sequence[Participant], root: Path, *, attempt: int = 0
) -> AsyncIterator[Coordinator]:
    """A coordinator over real control planes of `participants` (served in process, each on a
    loopback port, by the conformance kit's `serve_app`)."""
    async with AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        clients = []
        for participant in participants:
            settings = ControlSettings(
                role=participant.role,
                set_name="demo",
                checkpoint_root=root,
                attempt=attempt,
                token=TOKEN,
            )
            plane = ControlPlane(participant, settings)
            app = FastAPI()
            plane.install(app)
            served = await stack.enter_async_context(
                serve_app(app, role=participant.role, token=TOKEN)
            )
            clients.append(
                HttpParticipantClient(
                    participant.role, served.target.base_url, token=TOKEN, client=session
                )
            )
        yield Coordinator(clients)


def step_to(name: str) -> Callable[[], Awaitable[Boundary]]:
    async def run() -> Boundary:
        return Boundary(name)

    return run


async def steps(runtime: EpisodeRuntime, episode: Episode, count: int) -> None:
    for _ in range(count):
        name = f"s{episode.steps_completed}"
        await runtime.step(episode, name, StepMode.REPLAY, step_to("x"))


async def checkpoint(coordinator: Coordinator, root: Path, name: str) -> None:
    result = await coordinator.checkpoint(
        name, prepare_timeout=5, commit_timeout=5, publish_dir=root, set_name="demo"
    )
    assert result.ok, result.message


# --- the runtime participant: steps -------------------------------------------------------------


async def test_retire_reports_the_steps_unfinished_episodes_completed_after_the_checkpoint(
    tmp_path: Path,
) -> None:
    runtime = EpisodeRuntime()
    participant = RuntimeParticipant(Role.ENVIRONMENT, runtime)
    async with coordinated([participant], tmp_path) as coordinator:
        r1 = runtime.begin("r1", 0, Boundary("start"))
        r2 = runtime.begin("r2", 0, Boundary("start"))
        await steps(runtime, r1, 2)
        await steps(runtime, r2, 1)
        await checkpoint(coordinator, tmp_path, "ck-1")
        await steps(runtime, r1, 3)  # after the checkpoint, still running at the loss: lost
        await steps(runtime, r2, 2)  # after the checkpoint, then finished: nothing to redo
        runtime.end(r2)
        r3 = runtime.begin("r3", 0, Boundary("start"))
        await steps(runtime, r3, 2)  # not in the checkpoint: every step is done again

        retired = await coordinator.retire(0, None, soon(), operation_id="loss-1")

    assert retired.failures == []
    assert retired.lost == {"environment-0": LostWork(since="ck-1", counts={"steps": 3 + 2})}


async def test_an_episode_that_ended_without_finishing_is_lost_work_too(tmp_path: Path) -> None:
    # An environment's episode that failed (a peer died) ended, but runs again.
    runtime = EpisodeRuntime()
    participant = RuntimeParticipant(
        Role.ENVIRONMENT, runtime, is_finished=lambda rid, attempt: rid == "r1"
    )
    async with coordinated([participant], tmp_path) as coordinator:
        r1, r2 = runtime.begin("r1", 0, Boundary("a")), runtime.begin("r2", 0, Boundary("a"))
        await checkpoint(coordinator, tmp_path, "ck-1")
        await steps(runtime, r1, 3)
        await steps(runtime, r2, 2)
        runtime.end(r1)  # returned its result
        runtime.end(r2)  # failed
        retired = await coordinator.retire(0, None, soon(), operation_id="loss-1")
    assert retired.lost["environment-0"].counts == {"steps": 2}


async def test_restore_reports_the_steps_its_records_hold_and_counts_lost_work_from_there(
    tmp_path: Path,
) -> None:
    runtime = EpisodeRuntime()
    async with coordinated([RuntimeParticipant(Role.AGENT, runtime)], tmp_path) as coordinator:
        r1, r2 = runtime.begin("r1", 0, Boundary("a")), runtime.begin("r2", 0, Boundary("a"))
        await steps(runtime, r1, 4)
        await steps(runtime, r2, 1)
        await checkpoint(coordinator, tmp_path, "ck-1")

    # A fresh process restores the checkpoint under attempt 1 ...
    fresh = EpisodeRuntime()
    async with coordinated(
        [RuntimeParticipant(Role.AGENT, fresh)], tmp_path, attempt=1
    ) as coordinator:
        restored = await coordinator.restore("ck-1", 1, soon())
        assert restored.ok, restored.failures
        assert restored.kept == {"agent-0": {"steps": 4 + 1}}
        await coordinator.resume("ck-1", soon())
        # ... continues r1 for two steps and loses it: those two are lost, counted from ck-1.
        continued = fresh.begin("r1", 1, Boundary("a"))
        assert continued.steps_completed == 4
        await steps(fresh, continued, 2)
        retired = await coordinator.retire(1, None, soon(), operation_id="loss-2")
    assert retired.lost == {"agent-0": LostWork(since="ck-1", counts={"steps": 2})}


async def test_a_participant_without_a_work_counter_reports_empty_counts(tmp_path: Path) -> None:
    runtime = EpisodeRuntime()
    participant = RuntimeParticipant(Role.RESOURCES, runtime, work_counter=None)
    async with coordinated([participant], tmp_path) as coordinator:
        episode = runtime.begin("r1", 0, Boundary("a"))
        await steps(runtime, episode, 2)
        retired = await coordinator.retire(0, None, soon(), operation_id="loss-1")
    assert retired.lost == {"resources-0": LostWork(since=None, counts={})}


# --- the model participant: tokens --------------------------------------------------------------


def generation(rollout_id: str, key: str, tokens: int) -> Record:
    return Record(
        kind="generation",
        rollout_id=rollout_id,
        attempt=0,
        key=key,
        data={
            "step": "generate",
            "state": {"text": "x" * tokens, "tokens": tokens, "ids": []},
            "digest": None,
            "steps": tokens,
            "active_seconds": 0.0,
        },
    )


def delivered(rollout_id: str, key: str, tokens: int) -> Record:
    return Record(
        kind="delivered",
        rollout_id=rollout_id,
        attempt=0,
        key=key,
        data={"digest": "d", "text": "t", "finish_reason": "stop", "tokens": tokens},
    )


def test_the_model_counts_tokens_kept_and_tokens_generated_after_the_checkpoint() -> None:
    server = ModelServer(ServerOptions(role=Role.MODEL, allow_unauthenticated=True), environ={})
    participant = server.participant
    records = [generation("r1", "0", 4), delivered("r2", "1", 9)]
    # Cut prefixes and held generations are kept; a delivered response sits in its
    # episode's boundary already.
    assert participant.kept_work(records) == {"model_tokens": 4}
    server.progress[("r0", "0")] = (0, 50)  # before the checkpoint: forgotten by it
    server.progress[("r2", "1")] = (0, 9)  # delivered before the checkpoint: forgotten
    participant.checkpointed("ck-1", records)
    assert server.progress == {}
    server.progress.update(
        {
            ("r1", "0"): (0, 10),  # the cut generation went on from 4 to 10 tokens
            ("r2", "2"): (0, 5),  # the next turn of r2 started after the checkpoint
            ("r3", "0"): (0, 7),  # r3 started after the checkpoint
            ("r4", "0"): (1, 3),  # another attempt's work: not this retire's
        }
    )
    assert participant.finished_rollouts(0) is None, "a generation ends before its episode"
    # r2 finished (its environment said so): its last turn is not generated again.
    assert participant.lost_work(0, frozenset({"r2"})) == {"model_tokens": 6 + 7}
    assert server.progress == {("r4", "0"): (1, 3)}, "counted generations are forgotten"
    server.progress[("r2", "2")] = (0, 5)
    assert participant.lost_work(0, None) == {"model_tokens": 5}


def test_a_token_held_across_the_checkpoint_stays_counted_after_it() -> None:
    """A token step running when the checkpoint closed admission is held, not cut: its record
    holds the boundary before the token, the token was counted before the commit, and it is
    lost work if the pod is lost before the generation's next token (which would count it)."""
    server = ModelServer(ServerOptions(role=Role.MODEL, allow_unauthenticated=True), environ={})
    participant = server.participant
    server.progress[("r1", "0")] = (0, 5)  # its 5th token was held at the checkpoint
    server.progress[("r2", "0")] = (0, 3)  # at its boundary: nothing beyond the record
    participant.checkpointed("ck-1", [generation("r1", "0", 4), generation("r2", "0", 3)])
    assert server.progress == {("r1", "0"): (0, 5)}
    assert participant.lost_work(0, None) == {"model_tokens": 1}


# --- the coordinator: who is unfinished ---------------------------------------------------------


class CountingFake(FakeParticipant):
    """A fake that says which rollouts finished, and records what a retire told it."""

    def __init__(self, role: Role, finished: list[str] | None) -> None:
        super().__init__(role, rollouts=["r1", "r2", "r3"])
        self.says_finished = finished
        self.told: list[frozenset[str] | None] = []

    def finished_rollouts(self, attempt: int) -> list[str] | None:
        return self.says_finished

    def lost_work(self, attempt: int, finished: frozenset[str] | None) -> dict[str, int] | None:
        self.told.append(finished)
        return {"model_tokens": 3 - len(finished or ())}


def counting_members(
    environment: list[str] | None, agent: list[str] | None
) -> dict[Role, CountingFake]:
    return {
        Role.ENVIRONMENT: CountingFake(Role.ENVIRONMENT, environment),
        Role.AGENT: CountingFake(Role.AGENT, agent),
        Role.MODEL: CountingFake(Role.MODEL, None),
        Role.RESOURCES: CountingFake(Role.RESOURCES, None),
    }


ROLES = [Role.ENVIRONMENT, Role.AGENT]


async def test_later_stages_are_told_what_the_environment_finished(tmp_path: Path) -> None:
    members = counting_members(["r1"], ["r1", "r2"])
    async with coordinated([members[r] for r in PREPARE_ORDER], tmp_path) as coordinator:
        retired = await coordinator.retire(
            0, None, soon(), operation_id="loss-1", finished_from=ROLES
        )
    assert retired.finished_known
    assert members[Role.ENVIRONMENT].told == [None], "the environment knows by itself"
    for role in (Role.AGENT, Role.MODEL, Role.RESOURCES):
        assert members[role].told == [frozenset({"r1"})], role
    assert retired.lost["model-0"] == LostWork(since=None, counts={"model_tokens": 2})


async def test_without_roles_to_ask_nobody_is_told(tmp_path: Path) -> None:
    members = counting_members(["r1"], ["r1"])
    async with coordinated([members[r] for r in PREPARE_ORDER], tmp_path) as coordinator:
        retired = await coordinator.retire(0, None, soon(), operation_id="loss-1")
    assert not retired.finished_known
    assert members[Role.MODEL].told == [None]
    assert retired.lost["model-0"].counts == {"model_tokens": 3}


async def test_the_agent_tells_when_the_environment_was_lost_or_cannot(tmp_path: Path) -> None:
    for environment_present in (False, True):
        members = counting_members(None, ["r2"])
        roles = PREPARE_ORDER if environment_present else [Role.MODEL, Role.AGENT, Role.RESOURCES]
        async with coordinated([members[r] for r in roles], tmp_path) as coordinator:
            retired = await coordinator.retire(
                0, None, soon(), operation_id="loss-1", finished_from=ROLES
            )
        assert retired.finished_known
        assert members[Role.MODEL].told == [frozenset({"r2"})]
        assert members[Role.AGENT].told == [None]


# --- the operator: one recovery's sums ----------------------------------------------------------

INSTANCES = ["environment-0", "agent-0", "model-0", "model-1", "resources-0"]


def report(instance: str, since: str | None, *, tokens: int = 0, steps: int = 0) -> LostWorkReport:
    return LostWorkReport(instance=instance, since=since, model_tokens=tokens, steps=steps)


def test_a_recovery_adds_up_the_survivors_and_names_the_lost_as_uncounted() -> None:
    loss = work_loss(
        checkpoint="ck-2",
        instances=INSTANCES,
        reports=[
            report("agent-0", "ck-2", steps=7),
            report("model-0", "ck-2", tokens=120),
            report("model-1", "ck-2", tokens=30),
            report("resources-0", "ck-2"),
        ],
        kept=Work(model_tokens=40, steps=90),
    )
    assert (loss.model_tokens_kept, loss.model_tokens_generated_again) == (40, 150)
    assert (loss.steps_kept, loss.steps_redone) == (90, 7)
    assert loss.uncounted == ["environment-0"]


def test_a_report_from_another_checkpoint_says_nothing_about_this_restore() -> None:
    # model-0 committed ck-3, which never became Ready; the recovery restored ck-2.
    loss = work_loss(
        checkpoint="ck-2",
        instances=INSTANCES,
        reports=[report("model-0", "ck-3", tokens=500), report("model-1", "ck-2", tokens=8)],
        kept=None,
    )
    assert loss.model_tokens_generated_again == 8
    assert loss.model_tokens_kept == 0
    assert loss.uncounted == ["agent-0", "environment-0", "model-0", "resources-0"]


def test_without_a_checkpoint_only_reports_from_no_checkpoint_count() -> None:
    loss = work_loss(
        checkpoint=None,
        instances=["environment-0", "model-0"],
        reports=[report("environment-0", None, steps=12), report("model-0", "old", tokens=9)],
        kept=None,
    )
    assert (loss.steps_redone, loss.model_tokens_generated_again) == (12, 0)
    assert loss.uncounted == ["model-0"]


def test_every_pod_lost_counts_nothing_and_names_everyone() -> None:
    loss = work_loss(checkpoint="ck-1", instances=INSTANCES, reports=[], kept=Work(steps=3))
    assert (loss.model_tokens_generated_again, loss.steps_redone, loss.steps_kept) == (0, 0, 3)
    assert loss.uncounted == sorted(INSTANCES)


def test_counters_the_operator_does_not_know_are_ignored_and_reports_are_ordered() -> None:
    assert total_work([{"model_tokens": 3, "steps": 1}, {"steps": 2, "gpu_seconds": 9}]) == Work(
        model_tokens=3, steps=3
    )
    reports = lost_reports({"model-0": ("ck", {"model_tokens": 5}), "agent-0": (None, {})})
    assert [(r.instance, r.since, r.model_tokens, r.steps) for r in reports] == [
        ("agent-0", None, 0, 0),
        ("model-0", "ck", 5, 0),
    ]


# --- the operator's metrics ---------------------------------------------------------------------


def test_a_finished_recovery_counts_its_work_in_the_metrics() -> None:
    name = f"work-{secrets.token_hex(4)}"
    port = {"name": "control", "containerPort": 8000}
    template = {"spec": {"containers": [{"name": "m", "ports": [port]}]}}
    rset = RolloutSet.model_validate(
        {
            "metadata": {"name": name, "namespace": "ns", "uid": "u-1"},
            "spec": {
                "participants": [{"role": "model", "replicas": 1, "template": template}],
                "storage": {"path": "/ckpt", "volume": {"emptyDir": {}}},
            },
            "status": {
                "attempt": 2,
                "lastRecovery": {
                    "completedAt": "2026-12-01T00:00:00Z",
                    "reason": "PodFailed",
                    "attempt": 2,
                    "restorePolicy": "InPlace",
                    "kept": 3,
                    "replaced": 1,
                    "durationSeconds": 4.0,
                    "episodesRestored": 5,
                    "episodesRestarted": 2,
                    "modelTokensKept": 40,
                    "modelTokensGeneratedAgain": 150,
                    "stepsKept": 90,
                    "stepsRedone": 7,
                    "workUncounted": ["environment-0"],
                },
            },
        }
    )

    def value(metric: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(metric, {"namespace": "ns", "set": name, **labels})

    metrics.observe_recovery(rset, "Restored")
    tokens, steps = "rollout_recovery_model_tokens_total", "rollout_recovery_steps_total"
    assert value(tokens, outcome="kept") == 40
    assert value(tokens, outcome="generated_again") == 150
    assert value(steps, outcome="kept") == 90
    assert value(steps, outcome="redone") == 7
    assert value("rollout_recovery_work_uncounted_participants_total") == 1
    episodes = "rollout_recovery_episodes_total"  # restored: installed, not (all) continued
    assert (value(episodes, outcome="restored"), value(episodes, outcome="restarted")) == (5, 2)
    assert value(episodes, outcome="continued") is None
    metrics.observe_recovery(rset, "RestoreFailed")  # a failed try adds nothing
    assert value(tokens, outcome="generated_again") == 150
