"""One trace per checkpoint and per recovery, across the operator and the four participant pods.

A test receiver (`harness.otlp`: a real HTTP server in this process that decodes the protobuf
`ExportTraceServiceRequest`s) takes what the OpenTelemetry SDK's own OTLP/HTTP exporter sends
from five processes: the operator (`rollout-operator run`, OTEL_EXPORTER_OTLP_ENDPOINT in its
environment) and the four reference servers (the same variable in their pod templates, as
docs/operations.md tells users to set it). On a 4-pod set on devcluster the test checkpoints
once and checks the checkpoint's span tree: one trace, whose id is derived from the
RolloutCheckpoint's uid; the operator's phases under its root; under each protocol phase exactly
one client span per participant call; under each call the participant's own spans (the commit
is the cut: encode; the persist after the resume: write and the fsyncs). Then it SIGKILLs the
model pod and checks the recovery's trace: its phases, and the restore and resume calls with the
participants' verify / install / reopen.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_protocol.tracing import trace_id_of
from testsupport.operator_fixtures import (
    OperatorProcess,
    Resources,
    checkpoint_ready,
    example_set,
    is_true,
    participants_by_role,
    running_operator,
)
from testsupport.podpath import give_import_path

from devcluster.cluster import Cluster
from harness.otlp import OtlpReceiver, ReceivedSpan, children, otlp_receiver, render

pytestmark = pytest.mark.e2e

INSTANCES = ("agent-0", "environment-0", "model-0", "resources-0")
PARTICIPANT_SERVICES = {f"rollout-{i.split('-')[0]}" for i in INSTANCES}
EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s of a span's end
SPANS_LIMIT_S = 30.0


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture
def traced_operator(
    cluster: Cluster, namespace: str, tmp_path: Path, receiver: OtlpReceiver
) -> Iterator[OperatorProcess]:
    environment = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **EXPORT}
    with running_operator(
        cluster, [namespace], tmp_path / "operator.log", environment=environment
    ) as process:
        yield process


def traced_set(storage_dir: Path, endpoint: str) -> dict[str, object]:
    """The example set, every participant's container exporting to `endpoint`."""
    rset = example_set(storage_dir)
    variables = [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": endpoint}]
    variables += [{"name": k, "value": v} for k, v in EXPORT.items()]
    for participant in rset["spec"]["participants"]:
        for container in participant["template"]["spec"]["containers"]:
            container["env"] = [*container.get("env", []), *variables]
            give_import_path(container)
    return rset


def in_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def descendants(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    found: list[ReceivedSpan] = []
    for child in children(spans, parent):
        found += [child, *descendants(spans, child)]
    return found


def calls_complete(trace: list[ReceivedSpan], operation: str, own: tuple[str, ...]) -> bool:
    """Every participant's `operation` call arrived with its server-side span and `own` spans
    (the participants export a moment after the operator)."""
    calls = [s for s in trace if s.kind == "client" and s.name.startswith(f"{operation} ")]
    if len(calls) < len(INSTANCES):
        return False
    for call in calls:
        names = {s.name for s in descendants(trace, call)}
        if not {operation, *own} <= names:
            return False
    return True


def check_calls(
    trace: list[ReceivedSpan], phase: ReceivedSpan, operation: str, own: tuple[str, ...]
) -> None:
    """Under `phase`: one client span per participant for `operation`, and under each the
    participant's own `operation` span (from its own service) with `own` below it."""
    # (a slow prepare also renews the leases of the stages already prepared: `renew` calls)
    calls = [
        c
        for c in children(trace, phase)
        if c.kind == "client" and c.name.startswith(f"{operation} ")
    ]
    assert sorted(c.name for c in calls) == sorted(f"{operation} {i}" for i in INSTANCES), (
        "\n".join(render(trace))
    )
    for call in calls:
        instance = call.name.split(" ", 1)[1]
        service = f"rollout-{instance.split('-')[0]}"
        assert call.service == "rollout-operator"
        assert call.attributes["rollout.instance"] == instance
        below = descendants(trace, call)
        served = [s for s in below if s.name == operation and s.service == service]
        assert len(served) == 1, f"{call.name}: " + ", ".join(s.name for s in below)
        inside = {s.name for s in descendants(trace, served[0])}
        assert set(own) <= inside, f"{call.name}: {sorted(inside)}"
        assert all(s.service == service for s in below), "a call's spans come from its pod"


async def test_one_trace_per_checkpoint_and_per_recovery_across_five_processes(
    cluster: Cluster,
    namespace: str,
    receiver: OtlpReceiver,
    traced_operator: OperatorProcess,
    resources: Resources,
    storage_dir: Path,
) -> None:
    rset = traced_set(storage_dir, receiver.endpoint)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(rset))
    ready = await resources.wait_set("Ready", lambda o: is_true(o, "Ready"), 90)

    # --- one checkpoint ----------------------------------------------------------------------
    ckpt = await checkpoint_ready(cluster, resources, "traced")
    trace_id = f"{trace_id_of('checkpoint/' + ckpt['metadata']['uid']):032x}"
    spans = receiver.wait(
        lambda got: (
            any(s.parent_id == "" for s in in_trace(got, trace_id))  # the root ended
            and all(
                calls_complete(in_trace(got, trace_id), op, own)
                for op, own in (
                    ("prepare", ("park",)),
                    ("commit", ("encode",)),
                    ("resume", ()),
                    ("persist", ("write", "fsync")),
                )
            )
        ),
        SPANS_LIMIT_S,
        "the checkpoint's spans from the operator and the four participants",
    )
    trace = in_trace(spans, trace_id)
    print(f"--- trace {trace_id} of checkpoint traced ---")
    print("\n".join(render(trace)))
    roots = [s for s in trace if s.parent_id == ""]
    assert [r.name for r in roots] == [f"checkpoint {namespace}/traced"], "one root, one trace"
    (root,) = roots
    assert root.service == "rollout-operator"
    writes = sorted(
        (s for s in descendants(trace, root) if s.name == "write status"), key=lambda s: s.end_ns
    )
    assert writes[-1].attributes["rollout.phase"] == "Ready", "its last status write"
    assert {s.service for s in trace} == {"rollout-operator", *PARTICIPANT_SERVICES}
    phases = {s.name: s for s in children(trace, root)}
    order = ["prepare", "commit", "resume", "persist", "publish"]
    assert {"slot", *order} <= set(phases), sorted(phases)
    for earlier, later in itertools.pairwise(order):  # the pause is the cut; durable after it
        assert phases[earlier].end_ns <= phases[later].start_ns, (earlier, later)
    check_calls(trace, phases["prepare"], "prepare", ("park",))
    check_calls(trace, phases["commit"], "commit", ("encode",))
    check_calls(trace, phases["resume"], "resume", ("reopen",))
    check_calls(trace, phases["persist"], "persist", ("write", "fsync"))
    assert not [s for s in trace if s.error], "nothing failed"

    # --- one recovery ------------------------------------------------------------------------
    model = participants_by_role(ready)["model"][0]
    assert await cluster.admin.kill_pod_async(namespace, model["pod"])
    await resources.wait_set(
        "Ready again under attempt 2",
        lambda o: (o["status"].get("attempt") or 0) >= 2 and is_true(o, "Ready"),
        120,
    )
    name = f"recovery {namespace}/{ready['metadata']['name']}"

    def recovered(got: list[ReceivedSpan]) -> bool:
        roots = [s for s in got if s.name == name and s.parent_id == ""]
        if not roots:
            return False
        trace = in_trace(got, roots[0].trace_id)
        return calls_complete(trace, "restore", ("verify", "install")) and calls_complete(
            trace, "resume", ("reopen",)
        )

    spans = receiver.wait(recovered, SPANS_LIMIT_S, "the recovery's spans")
    (root,) = [s for s in spans if s.name == name and s.parent_id == ""]
    trace = in_trace(spans, root.trace_id)
    print(f"--- trace {root.trace_id} of the recovery ---")
    print("\n".join(render(trace)))
    assert [s for s in trace if s.parent_id == ""] == [root], "one root, one trace"
    assert root.attributes["rollout.from_attempt"] == 1
    assert root.attributes["rollout.attempt"] == 2
    steps = children(trace, root)
    assert [s.name for s in steps] == ["StoppingAttempt", "StartingPods", "Restoring", "Resuming"]
    restoring, resuming = steps[2], steps[3]
    check_calls(trace, restoring, "restore", ("verify", "install"))
    check_calls(trace, resuming, "resume", ("reopen",))
    assert {s.service for s in trace} == {"rollout-operator", *PARTICIPANT_SERVICES}
