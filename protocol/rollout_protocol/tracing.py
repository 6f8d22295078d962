"""OpenTelemetry traces of the checkpoint protocol: one trace per checkpoint and per recovery.

Everything here is written against the OpenTelemetry *API* (`opentelemetry-api`, a dependency of
`rollout-protocol`). Until a tracer provider is installed (`configure` with
`OTEL_EXPORTER_OTLP_ENDPOINT` set, or the program's own), tracing is off: `span` and its kin
return a null context after one check, nothing is recorded or exported, no SDK module is
imported and no `traceparent` header is sent. `configure` installs the SDK (`opentelemetry-sdk` and
`opentelemetry-exporter-otlp-proto-http`, the `tracing` extra) with a batch span processor and
the SDK's own OTLP/HTTP exporter; the standard `OTEL_*` variables configure the exporter
(`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_SERVICE_NAME`, ...). At exit the
spans still queued are flushed for at most `EXIT_FLUSH_TIMEOUT_S`, so a process whose collector
is dead or never answers still exits promptly (docs/operations.md, "Traces").

How a trace crosses processes: `HttpParticipantClient` sends every protocol call inside a client
span and puts that span's W3C `traceparent` header on the request (`headers`); the control plane
continues the trace from it (`server_span`), so a participant's own spans (park, encode, write,
fsync, install, ...) sit under the call that caused them.

Trace ids that survive an operator restart: `root_span(key=...)` starts a trace whose id is
derived from `key` (a checkpoint's uid, a set's uid and the recovery's start), when the SDK was
installed by `configure` (its id generator reads the key). A successor operator that continues a
checkpoint therefore adds its part to the same trace, as a second root span, with nothing
persisted. Under a tracer provider a program installed itself, the id is its generator's.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.sdk.trace.sampling import Sampler

__all__ = [
    "EXIT_FLUSH_TIMEOUT_S",
    "Attributes",
    "SpanKind",
    "configure",
    "failed",
    "headers",
    "keyed_parent",
    "root_span",
    "server_span",
    "span",
    "span_id_of",
    "span_if",
    "trace_id_of",
]

logger = logging.getLogger(__name__)

_PROBES: Final = frozenset({"GET /healthz", "GET /readyz", "GET /livez", "GET /metrics"})
"""Names of the server spans of probes and scrapes: `configure`'s sampler starts no trace
for them."""

Attributes = Mapping[str, AttributeValue]

EXIT_FLUSH_TIMEOUT_S: Final = 2.0
"""How long a process that exports traces waits at exit for its last spans to reach the
collector (docs/operations.md, "Traces"). The SDK's own exit hook waits up to 30 s for its batch
thread, whose exports retry for up to the exporter's timeout (10 s by default), so a process
whose collector was dead or silent took that long to stop; a collector that answers takes a
batch in milliseconds."""
_EXIT_STOP_GRACE_S: Final = 0.2
"""After the exporter is stopped, how long the exit waits for the flush to notice (its retry
backoff wakes at once), so that the flush thread is not logging while the interpreter ends."""

_TRACER: Final = trace.get_tracer("rollout_protocol")
"""The API's proxy tracer: no-op until a provider is installed, then that provider's."""
_PROPAGATOR: Final = TraceContextTextMapPropagator()
"""W3C trace context (`traceparent`, `tracestate`), whatever `OTEL_PROPAGATORS` says."""
_ROOT_TRACE_ID: ContextVar[int | None] = ContextVar("rollout_root_trace_id", default=None)
"""The trace id `configure`'s id generator gives the root span being started (`root_span`)."""
_ROOT_SPAN_ID: ContextVar[int | None] = ContextVar("rollout_root_span_id", default=None)
"""The span id it gives a keyed root span whose children were started before it
(`root_span(..., keyed_span=True)`, `keyed_parent`)."""
_NO_SDK = (
    "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed: no traces "
    "are exported. pip install 'rollout-protocol[tracing]' (opentelemetry-sdk and "
    "opentelemetry-exporter-otlp-proto-http)"
)


def trace_id_of(key: str) -> int:
    """The 128-bit trace id `root_span` derives from `key` (never the invalid id 0)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "big") or 1


def span_id_of(key: str) -> int:
    """The 64-bit span id of a keyed root span (`keyed_parent`), derived from `key`."""
    return int.from_bytes(hashlib.sha256(b"span:" + key.encode()).digest()[:8], "big") or 1


def keyed_parent(key: str) -> Context:
    """A context whose parent is the keyed root span of `key` (`root_span(key=key,
    keyed_span=True)`): the spans of work spread over many calls (a recovery's phases, one per
    pass of its loop) join one trace under one root, which is ended when the work is done."""
    parent = trace.SpanContext(
        trace_id=trace_id_of(key),
        span_id=span_id_of(key),
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def configure(
    service_name: str,
    *,
    attributes: Attributes | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Export this process's spans over OTLP/HTTP when an OTLP endpoint is configured.

    True when this call installed the SDK's tracer provider. It does nothing (False) when
    neither `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as it is) nor
    `OTEL_EXPORTER_OTLP_ENDPOINT` (`/v1/traces` appended) is set in `environ`, when
    `OTEL_SDK_DISABLED` is true, when a tracer provider is installed already (by an earlier
    call, or by the program itself: its provider is used as it is), or when the SDK is not
    installed (logged). `service_name` is the resource's `service.name` unless
    `OTEL_SERVICE_NAME` says otherwise; `attributes` are added to the resource
    (`OTEL_RESOURCE_ATTRIBUTES` too, by the SDK).
    """
    env = os.environ if environ is None else environ
    endpoint = _traces_endpoint(env)
    if endpoint is None:
        return False
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return False
    return _install_sdk(service_name, attributes, env, endpoint)


def _traces_endpoint(env: Mapping[str, str]) -> str | None:
    """The OTLP/HTTP traces URL the environment names, if any."""
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None
    if endpoint is None and (base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        endpoint = base.removesuffix("/") + "/v1/traces"  # as the SDK's exporter makes it
    return endpoint


def _install_sdk(
    service_name: str, attributes: Attributes | None, env: Mapping[str, str], endpoint: str
) -> bool:
    """Install the SDK's tracer provider with a batch OTLP/HTTP exporter to `endpoint`, and
    flush it at exit; False (logged) when the SDK is not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased
    except ImportError:
        logger.warning("%s", _NO_SDK)
        return False
    # OTEL_TRACES_SAMPLER, when set, is the SDK's to read (sampler=None)
    sampler = None if env.get("OTEL_TRACES_SAMPLER") else ParentBased(_quiet_probes())
    resource_attributes: dict[str, AttributeValue] = dict(attributes or {})
    if not env.get("OTEL_SERVICE_NAME"):
        resource_attributes[SERVICE_NAME] = service_name
    provider = TracerProvider(
        sampler=sampler,
        resource=Resource.create(resource_attributes),
        id_generator=_keyed_ids(),
        shutdown_on_exit=False,  # unbounded with a dead collector: `_flush_at_exit` instead
    )
    exporter = OTLPSpanExporter(endpoint=endpoint)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    atexit.register(_flush_at_exit, provider.force_flush, exporter.shutdown)
    logger.info("exporting traces over OTLP/HTTP as %s", service_name)
    return True


def _keyed_ids() -> IdGenerator:
    """The SDK's id generator that gives a root span started by `root_span` its keyed trace id
    (called once the SDK imported)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class KeyedIds(RandomIdGenerator):
        """Random ids, except the trace id of a root span started by `root_span`."""

        def generate_trace_id(self) -> int:
            keyed = _ROOT_TRACE_ID.get()
            return keyed if keyed is not None else super().generate_trace_id()

        def generate_span_id(self) -> int:
            keyed = _ROOT_SPAN_ID.get()
            return keyed if keyed is not None else super().generate_span_id()

    return KeyedIds()


def _quiet_probes() -> Sampler:
    """The SDK sampler that starts no trace for a probe or a scrape (called once the SDK
    imported)."""
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class QuietProbes(Sampler):
        """Every trace, except those a health probe or a scrape starts (FastAPI traces every
        request it serves: a readiness probe each second would be a trace each second)."""

        def should_sample(
            self,
            parent_context: Context | None,
            trace_id: int,
            name: str,
            kind: SpanKind | None = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            if name in _PROBES:
                return SamplingResult(Decision.DROP)
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

        def get_description(self) -> str:
            return "QuietProbes"

    return QuietProbes()


def _flush_at_exit(
    flush: Callable[[], object],
    stop: Callable[[], object],
    timeout_s: float = EXIT_FLUSH_TIMEOUT_S,
) -> None:
    """Export the spans still queued for at most `timeout_s`, then stop the exporter.

    The flush runs in a daemon thread that the exit waits for only `timeout_s`: against a dead
    collector the exporter would retry with backoff, against one that accepts and never answers
    a request would wait for the exporter's whole timeout. Stopping the exporter ends its
    retries at once (the backoff waits on its shutdown event); a request still waiting on a
    silent collector is left to the daemon thread, which ends with the process.
    """
    flushing = threading.Thread(target=flush, name="rollout-traces-exit-flush", daemon=True)
    flushing.start()
    flushing.join(timeout_s)
    if flushing.is_alive():
        logger.warning(
            "the OTLP collector did not take the last spans within %gs: exiting without them",
            timeout_s,
        )
    stop()
    flushing.join(_EXIT_STOP_GRACE_S)


def _off() -> bool:
    """No tracer provider is installed: every span would be the API's no-op one."""
    return isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


_NOTHING: Final = nullcontext(trace.INVALID_SPAN)
"""What `span`, `root_span` and `server_span` return while `_off()`: entering the API's no-op
span machinery costs about 8 us a span on the development machine, this about 0.5 us."""


def root_span(
    name: str,
    *,
    key: str | None = None,
    attributes: Attributes | None = None,
    keyed_span: bool = False,
    start_time_ns: int | None = None,
) -> AbstractContextManager[Span]:
    """A span that starts a trace (whatever span is current), with the id `trace_id_of(key)`
    under `configure`'s provider (a random one without `key`); current inside the block, ended
    (and marked as an error by an exception) when it leaves. With `keyed_span` (and a `key`)
    its span id is `span_id_of(key)`: the parent of the spans started under `keyed_parent(key)`
    before it, from `start_time_ns` on."""
    if _off():
        return _NOTHING
    token = _ROOT_TRACE_ID.set(None if key is None else trace_id_of(key))
    span_token = _ROOT_SPAN_ID.set(span_id_of(key) if keyed_span and key is not None else None)
    try:
        root = _TRACER.start_span(
            name, context=Context(), attributes=attributes, start_time=start_time_ns
        )
    finally:
        _ROOT_SPAN_ID.reset(span_token)
        _ROOT_TRACE_ID.reset(token)
    return trace.use_span(root, end_on_exit=True)


def span(
    name: str,
    *,
    attributes: Attributes | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    context: Context | None = None,
    only_in_trace: bool = False,
) -> AbstractContextManager[Span]:
    """A child of the current span (or of `context`), current inside the block. With
    `only_in_trace`, nothing outside a trace (low-level work such as an fsync, done by many
    callers, makes no traces of its own)."""
    if _off():
        return _NOTHING
    if only_in_trace and not trace.get_current_span().get_span_context().is_valid:
        return _NOTHING
    return _TRACER.start_as_current_span(name, context=context, kind=kind, attributes=attributes)


@contextmanager
def span_if(
    name: str,
    *,
    sent: Callable[[], bool],
    attributes: Attributes | None = None,
    context: Context | None = None,
    start_time_ns: int | None = None,
) -> Iterator[Span]:
    """A child span like `span`, from `start_time_ns` on (now without one), ended and sent only
    when `sent()` says so as the block leaves (or when the block raised): work that turned out
    to be part of a span a later block ends (a step that waits and runs again) leaves none."""
    if _off():
        yield trace.INVALID_SPAN
        return
    started = _TRACER.start_span(
        name, context=context, attributes=attributes, start_time=start_time_ns
    )
    with trace.use_span(started, end_on_exit=False):
        try:
            yield started
        except BaseException:
            started.end()
            raise
    if sent():
        started.end()


def failed(reason: str, message: str) -> None:
    """Mark the current span failed: status ERROR with `reason` (CamelCase) and `message`."""
    current = trace.get_current_span()
    current.set_attribute("rollout.reason", reason)
    current.set_status(Status(StatusCode.ERROR, f"{reason}: {message}"))


def headers() -> dict[str, str]:
    """The current span's `traceparent` (and `tracestate`) headers; empty when no span is
    recording (tracing off), so nothing is added to a request."""
    carrier: dict[str, str] = {}
    if _off():
        return carrier
    _PROPAGATOR.inject(carrier)
    return carrier


def server_span(
    name: str, headers: Mapping[str, str], *, attributes: Attributes | None = None
) -> AbstractContextManager[Span]:
    """The span of a request a server handles: a child of the current span when the server
    framework traced the request already (FastAPI's own telemetry, an ASGI instrumentation:
    they continued the caller's trace), else a server span continuing the request's
    `traceparent` (or whatever is current when it carries none)."""
    if _off():
        return _NOTHING
    if trace.get_current_span().get_span_context().is_valid:
        return span(name, attributes=attributes)
    context = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
    return span(name, kind=SpanKind.SERVER, context=context, attributes=attributes)
