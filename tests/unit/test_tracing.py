"""`rollout_protocol.tracing`: nothing when no OTLP endpoint is set, a traceparent on every
protocol call and an OTLP export when one is.

The traced case runs in a child process (a tracer provider is process-wide and can be set only
once), against a header-recording HTTP server and the OTLP receiver of `harness.otlp`, both in
this process. The e2e test `tests/e2e/test_traces.py` checks whole traces across five processes.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rollout_protocol import tracing

from harness.otlp import otlp_receiver

pytestmark = pytest.mark.unit


class Recorder(http.server.ThreadingHTTPServer):
    """Refuses every request (`invalid_request`, which nobody retries) and keeps its headers."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                recorder.seen.append({k.lower(): v for k, v in self.headers.items()})
                body = json.dumps({"error": {"code": "invalid_request", "detail": "recorded"}})
                self.send_response(422)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            do_POST = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


STATUS_CALL = """
import anyio, sys, time
from rollout_protocol import HttpParticipantClient, ParticipantError, tracing

async def main() -> None:
    async with HttpParticipantClient("model", sys.argv[1], token="t") as client:
        with tracing.root_span("checkpoint c", key="checkpoint/uid-1"):
            try:
                await client.status(time.time() + 10)
            except ParticipantError:
                pass

print(tracing.configure("probe"))
anyio.run(main)
# neither a probe's request nor an fsync outside a trace starts a trace
with tracing.span("GET /healthz", kind=tracing.SpanKind.SERVER), tracing.span("inside"):
    pass
with tracing.span("fsync", only_in_trace=True):
    pass
"""


def test_off_without_an_endpoint_no_sdk_no_header_no_span(recorder: Recorder) -> None:
    assert tracing.configure("probe", environ={}) is False
    assert tracing.configure("probe", environ={"OTEL_SDK_DISABLED": "true"}) is False
    assert tracing.headers() == {}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            STATUS_CALL + "import json; print(json.dumps(sorted(sys.modules)))",
            recorder.url,
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    configured, modules = done.stdout.splitlines()[-2:]
    assert configured == "False"
    loaded = set(json.loads(modules))
    assert not {m for m in loaded if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))}
    assert recorder.seen, "the call reached the server"
    assert all("traceparent" not in headers for headers in recorder.seen)


def test_on_with_an_endpoint_the_call_carries_the_keyed_trace_and_spans_are_exported(
    recorder: Recorder,
) -> None:
    with otlp_receiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        done = subprocess.run(
            [sys.executable, "-c", STATUS_CALL, recorder.url],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert done.stdout.split() == ["True"], done.stderr
        # the process flushed its spans at exit (the SDK's shutdown), so they are here now
        spans = receiver.spans()
    trace_id = f"{tracing.trace_id_of('checkpoint/uid-1'):032x}"
    (sent,) = recorder.seen
    version, sent_trace, parent, flags = sent["traceparent"].split("-")
    assert (version, sent_trace) == ("00", trace_id)
    assert int(flags, 16) & 1, "sampled"
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"checkpoint c", "status model-0"}
    root, call = by_name["checkpoint c"], by_name["status model-0"]
    assert root.trace_id == call.trace_id == trace_id
    assert root.parent_id == ""
    assert call.parent_id == root.span_id
    assert call.span_id == parent, "the header names the client span as the parent"
    assert call.kind == "client"
    assert call.service == "probe"
    assert call.error, "the participant's error marks the call failed"


def test_rollout_collect_starts_the_trace_of_its_batch(recorder: Recorder, tmp_path: Path) -> None:
    """One trace for the batch, a client span per `/run` call, its traceparent on the call (the
    recorder refuses every run, so the episode fails at once and the command ends)."""
    collect = str(Path(sys.executable).with_name("rollout-collect"))
    with otlp_receiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        done = subprocess.run(
            [collect, "--environment", recorder.url, "--tasks", "2", "--out", str(tmp_path / "o")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1, done.stderr  # both episodes refused
        spans = receiver.spans()
    (root,) = [s for s in spans if s.parent_id == ""]
    assert root.name == "collect r"
    assert root.service == "rollout-collect"
    assert root.attributes["rollout.episodes"] == 2
    runs = [s for s in spans if s.parent_id == root.span_id]
    assert sorted(s.name for s in runs) == ["run r0-00000", "run r0-00001"]
    sent = {h["traceparent"].split("-")[2] for h in recorder.seen}
    assert sent == {s.span_id for s in runs}, "each /run names its own span as the parent"


SPANS_IF = """
from rollout_protocol import tracing

print(tracing.configure("probe"))
with tracing.root_span("recovery r", key="recovery/uid-1"):
    with tracing.span_if("waits", sent=lambda: False):
        with tracing.span("inside the wait"):
            pass
    with tracing.span_if("leaves", sent=lambda: True, start_time_ns=1_000_000_000):
        pass
"""


def test_a_span_sent_only_if_its_block_says_so_and_from_the_start_it_is_given() -> None:
    """`span_if`: a block that says its span is not to be sent (a recovery step that waits for
    a later pass) leaves none; one that says so sends it, from the start it was given."""
    with otlp_receiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        done = subprocess.run(
            [sys.executable, "-c", SPANS_IF],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert done.stdout.split() == ["True"], done.stderr
        spans = receiver.spans()
    by_name = {s.name: s for s in spans}
    assert "waits" not in by_name
    leaves, root = by_name["leaves"], by_name["recovery r"]
    assert leaves.parent_id == root.span_id
    assert leaves.start_ns == 1_000_000_000
