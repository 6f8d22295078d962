"""Step and token counters: what `GET /stats` shows, and that keeping them costs a long-running
server neither unbounded memory nor longer garbage collections."""

from __future__ import annotations

import gc

import pytest
from rollout_protocol import Role, StepCounters
from rollout_servers.servers import model
from rollout_servers.servers.common import ServerOptions
from rollout_servers.servers.model import ModelServer


def test_step_counters_show_each_rollout_by_attempt_step_and_event() -> None:
    counters = StepCounters(Role.AGENT)
    for event in ("started", "completed"):
        counters.count(1, "r1", "model@0", event)
    counters.count(2, "r1", "model@0", "started")
    counters.count(1, "r2", "tool@1", "failed")

    snapshot = counters.snapshot(["r1"], detail=False)

    assert snapshot["rollouts"] == {
        "r1": {"1": {"model@0": {"started": 1, "completed": 1}}, "2": {"model@0": {"started": 1}}}
    }
    assert snapshot["steps"] == {
        "1": {"model": {"started": 1, "completed": 1}, "tool": {"failed": 1}},
        "2": {"model": {"started": 1}},
    }
    assert set(counters.snapshot(None, detail=True)["rollouts"]) == {"r1", "r2"}


def test_a_step_name_holding_the_key_separator_reads_back_whole() -> None:
    counters = StepCounters(Role.ENVIRONMENT)
    counters.count(1, "r1", "odd\x00name", "completed")
    assert counters.snapshot(["r1"], detail=False)["rollouts"]["r1"] == {
        "1": {"odd\x00name": {"completed": 1}}
    }


def test_kept_rollouts_are_bounded_and_invisible_to_the_garbage_collector() -> None:
    counters = StepCounters(Role.AGENT, keep_rollouts=100)
    for n in range(250):
        counters.count(1, f"r{n}", "model@0", "started")
        counters.count(1, f"r{n}", "model@0", "completed")
    shown = counters.snapshot(None, detail=True)["rollouts"]
    assert sorted(shown) == sorted(f"r{n}" for n in range(150, 250)), "the latest 100 are kept"
    assert counters.snapshot(None, detail=True)["steps"]["1"]["model"]["completed"] == 250
    # a kept rollout's counts are one dict of strings and ints: no object a collection walks
    assert not any(gc.is_tracked(per) for per in counters._rollouts.values())


def test_the_model_server_keeps_the_latest_request_keys_and_counts_every_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model, "_REQUESTS_KEPT", 3)
    server = ModelServer(ServerOptions(role=Role.MODEL, allow_unauthenticated=True), environ={})
    for n in range(5):
        server._count_token(1, f"r{n}/0", 2)
    server._count_token(1, "r4/0")

    tokens = server.extra_stats(None, detail=True)["tokens"]["1"]

    assert tokens["total"] == 11, "every token counts, kept by key or not"
    assert tokens["by_request"] == {"r2/0": 2, "r3/0": 2, "r4/0": 3}
