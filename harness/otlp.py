"""An OTLP/HTTP trace receiver for tests and benches: `OtlpReceiver` and `render`.

`OtlpReceiver` is a small real HTTP server (a thread of this process) that takes what the
OpenTelemetry SDK's own `OTLPSpanExporter` sends to `<endpoint>/v1/traces`: protobuf
`ExportTraceServiceRequest` bodies (gzip or not), decoded with `opentelemetry-proto`. It keeps
every span with the `service.name` of the process that sent it, so a test can check the span
tree of one trace across processes. `render` prints such a tree (docs/operations.md shows one).
Not shipped: the operator and the servers only ever send OTLP.
"""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver decoded it (ids as hex)."""

    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    error: bool
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which)


class OtlpReceiver:
    """`POST /v1/traces` on 127.0.0.1 (a free port); `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT
    takes. `spans()` returns what arrived so far, `wait(predicate, timeout)` waits for more."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.requests = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path in ("/v1/metrics", "/v1/logs"):
                    # what FastAPI's own telemetry may send besides traces: taken, not kept
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._take(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        port = self._server.server_address[1]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _take(self, request: ExportTraceServiceRequest) -> None:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", "?"))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=_KINDS.get(span.kind, "unspecified"),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            error=span.status.code == 2,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self._changed:
            self.requests += 1
            self._spans.extend(received)
            self._changed.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self._spans)

    def wait(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float, what: str
    ) -> list[ReceivedSpan]:
        """Until `predicate(spans)` holds; AssertionError naming `what` at the deadline."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{what}: not received within {timeout:g}s; got:\n"
                        + "\n".join(render(self._spans))
                    )
                self._changed.wait(left)
            return list(self._spans)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


def children(spans: Sequence[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    """The spans whose parent is `parent`, in start order."""
    found = [s for s in spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id]
    return sorted(found, key=lambda s: s.start_ns)


def render(spans: Sequence[ReceivedSpan], trace_id: str | None = None) -> list[str]:
    """The span trees (of `trace_id`, or of every trace), one line per span: name, the service
    that sent it, its start after the trace's first span and its duration."""
    chosen = [s for s in spans if trace_id is None or s.trace_id == trace_id]
    ids = {s.span_id for s in chosen}
    roots = sorted((s for s in chosen if s.parent_id not in ids), key=lambda s: s.start_ns)
    lines: list[str] = []
    origin = min((s.start_ns for s in chosen), default=0)

    def walk(span: ReceivedSpan, depth: int) -> None:
        offset = (span.start_ns - origin) / 1e6
        flag = "  ERROR" if span.error else ""
        label = f"{'  ' * depth}{span.name}"
        lines.append(
            f"{label:<44} {span.service:<22} +{offset:8.1f} ms {span.duration_ms:8.1f} ms{flag}"
        )
        for child in children(chosen, span):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return lines
