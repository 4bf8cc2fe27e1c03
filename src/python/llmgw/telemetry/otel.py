"""All of llmgw's OpenTelemetry: the tracer of a gateway process (`Tracing`) and one forwarded
request's spans (`RequestTrace`). Imported only when `[telemetry]` names a collector.

A request's trace, as the gateway makes it (OpenTelemetry's GenAI and HTTP conventions where
they fit; never a prompt's text, an answer's or a key):

    {operation} {model}   SERVER  the request, from its head to its answer's last byte; its parent
    │                             the client's `traceparent` if it sent one. gen_ai.operation.name,
    │                             gen_ai.request.model, http.response.status_code, llmgw.request_id;
    │                             event `first_token` (a stream's first body bytes)
    ├── queue             INTERNAL  waiting for a free replica (only when it waited)
    ├── attempt           CLIENT    one replica's exchange, from sending to its answer's end or its
    │   │                           failure: llmgw.replica, server.address/port, llmgw.attempt,
    │   │                           llmgw.migration, llmgw.outcome (ok, connect, first_byte, 502,
    │   │                           503, broken, ...); the engine's `traceparent` is this span's
    │   └── relay         INTERNAL  its answer relayed to the client, from the head on
    └── attempt ...                 the next replica, after a failure or a stream's migration

Spans are made with explicit parents (no context variables: a trio task's context is not the
request's) and exported by the SDK's BatchSpanProcessor on a thread of its own: ending a span
appends it to a bounded queue (`MAX_QUEUE_SPANS`, the oldest dropped when full), so a collector
that is down or slow never holds a request. Sampling is parent-based: a client's sampled
`traceparent` is traced, an unsampled one is not, and a request without one is traced at
`sample_ratio`; a request not traced costs one unsampled span and nothing after.

Kept cheap (docs/performance.md, issue 48): what a span learns after its start (a status, an
outcome, the usage, the time to first token) is kept in a plain dict and given to the SDK once,
as the span ends (one `set_attributes`, not a locked, checked call each); the engine's
`traceparent` is formatted from the attempt's span context as the W3C propagator would, with no
context built to inject from; a child of the gateway's own span is sampled in one look at its
parent (`_ParentBased`). On the exporter's thread, each export encodes up to
`EXPORT_BATCH_SPANS` spans, and the resource's hash, which the encoder takes for every span, is
computed once (`_Resource`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import trio
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, get_current_span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from llmgw import __version__
from llmgw.config import TelemetrySection

MAX_QUEUE_SPANS = 8192  # spans waiting for export; past it the oldest are dropped (about 4 MB)
# Spans encoded and sent in one export (the SDK's default is 512): the exporter's thread wakes
# when this many are queued (or every 5 s), and each export's HTTP request is paid once for them.
EXPORT_BATCH_SPANS = 2048
SHUTDOWN_S = 2.0  # at the process's end: for the spans still queued
_TRACE_HEADERS = (b"traceparent", b"tracestate")
# gen_ai.operation.name by route (OpenTelemetry GenAI conventions); others keep their path.
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
}


class _Resource(Resource):
    """The SDK's Resource with its hash computed once: the OTLP encoder groups every span by its
    resource, and `Resource.__hash__` serialises the attributes to JSON each time."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


class _ParentBased(ParentBased):
    """The SDK's ParentBased(TraceIdRatioBased(ratio)) with its commonest case looked at first: a
    span under one of the gateway's own (a local, sampled parent) is sampled, as ParentBased's
    `local_parent_sampled` (ALWAYS_ON) decides, in one look at the parent instead of three."""

    def __init__(self, ratio: float) -> None:
        super().__init__(TraceIdRatioBased(ratio))

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        parent = get_current_span(parent_context).get_span_context()
        if parent.is_valid and parent.trace_flags.sampled and not parent.is_remote:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, parent.trace_state)
        return super().should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)


_NO_CONTEXT = Context()  # the base of a span's context: not the task's current one, which is not the request's


def traces_url(endpoint: str) -> str:
    """The collector's base URL with OTLP/HTTP's traces path appended, as the SDK does with
    OTEL_EXPORTER_OTLP_ENDPOINT."""
    return endpoint.rstrip("/") + "/v1/traces"


class Tracing:
    """One process's tracer and exporter. `request` starts a request's trace; `aclose` exports
    what is queued (bounded) and stops the exporter's thread."""

    def __init__(self, section: TelemetrySection, *, headers: dict[str, str], instance: str = "") -> None:
        attributes = {"service.name": section.service_name, "service.version": __version__}
        if instance:
            attributes["service.instance.id"] = instance
        self.provider = TracerProvider(
            resource=_Resource(Resource.create(attributes)),
            sampler=_ParentBased(section.sample_ratio),
        )
        self.exporter = OTLPSpanExporter(
            endpoint=traces_url(section.otlp_endpoint), headers=headers, timeout=section.timeout_s
        )
        self.processor = BatchSpanProcessor(
            self.exporter, max_queue_size=MAX_QUEUE_SPANS, max_export_batch_size=EXPORT_BATCH_SPANS
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("llmgw.gateway", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.endpoint = traces_url(section.otlp_endpoint)

    def request(self, path: str, headers: dict[str, str], request_id: str) -> RequestTrace | None:
        """A forwarded request's trace, or None when it is not sampled (its `traceparent`, if
        any, then goes to the engine as it came)."""
        parent = self.propagator.extract(headers) if "traceparent" in headers else _NO_CONTEXT
        span = self.tracer.start_span(
            "POST " + path,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "url.path": path,
                "gen_ai.operation.name": OPERATIONS.get(path, path),
                "llmgw.request_id": request_id,
            },
        )
        if not span.is_recording():
            return None
        return RequestTrace(self, span, path)

    async def aclose(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Export what is queued and stop, within `timeout_s` (a collector that is away loses them)."""
        with trio.move_on_after(timeout_s):
            await trio.to_thread.run_sync(partial(self._shutdown, timeout_s), abandon_on_cancel=True)

    def _shutdown(self, timeout_s: float) -> None:
        self.processor._batch_processor.shutdown(timeout_millis=int(timeout_s * 1000))


class RequestTrace:
    """One forwarded request's spans, ended once however the request ends (`end`, `failed`).
    `ending` and `attempt_ending` hold the attributes their span learnt since its start, set
    as it ends."""

    __slots__ = (
        "tracing",
        "span",
        "path",
        "context",
        "ending",
        "attempt_span",
        "attempt_ending",
        "relay_span",
        "attempts",
        "done",
    )

    def __init__(self, tracing: Tracing, span: Span, path: str) -> None:
        self.tracing, self.span, self.path = tracing, span, path
        self.context: Context = set_span_in_context(span, _NO_CONTEXT)
        self.ending: dict[str, AttributeValue] = {}
        self.attempt_span: Span | None = None
        self.attempt_ending: dict[str, AttributeValue] = {}
        self.relay_span: Span | None = None
        self.attempts = 0
        self.done = False

    def admitted(self, model: str) -> None:
        """Its key and model were accepted: the span is named for the model (GenAI's way)."""
        self.span.update_name(f"{OPERATIONS.get(self.path, self.path)} {model}")
        self.ending["gen_ai.request.model"] = model

    def queue(self) -> Span:
        """The span of a wait for a free replica; the caller ends it."""
        return self.tracing.tracer.start_span("queue", context=self.context)

    def attempt(
        self, replica: str, host: str, port: int, headers: Sequence[tuple[bytes, bytes]], migration: int = 0
    ) -> list[tuple[bytes, bytes]]:
        """An attempt on a replica begins: its span, and the request's `headers` with the client's
        trace fields replaced by this span's (its `tracestate` carried on)."""
        self.attempts += 1
        attributes: dict[str, AttributeValue] = {
            "llmgw.replica": replica,
            "server.address": host,
            "server.port": port,
            "llmgw.attempt": self.attempts,
        }
        if migration:
            attributes["llmgw.migration"] = migration
        span = self.tracing.tracer.start_span(
            "attempt", context=self.context, kind=SpanKind.CLIENT, attributes=attributes
        )
        self.attempt_span, self.attempt_ending = span, {}
        out = [(k, v) for k, v in headers if k not in _TRACE_HEADERS]
        # What TraceContextTextMapPropagator.inject writes for this span.
        ctx = span.get_span_context()
        out.append((b"traceparent", b"00-%032x-%016x-%02x" % (ctx.trace_id, ctx.span_id, ctx.trace_flags)))
        if ctx.trace_state:
            out.append((b"tracestate", ctx.trace_state.to_header().encode()))
        return out

    def attempt_failed(self, reason: str, why: str) -> None:
        """The attempt failed: before its answer reached the client (another may follow), or
        mid-answer (`relay_broken`); a relay under way (a body read whole that broke) ends too."""
        self._end_relay(StatusCode.ERROR, why)
        span, self.attempt_span = self.attempt_span, None
        if span is not None:
            self.attempt_ending["llmgw.outcome"] = reason
            span.set_attributes(self.attempt_ending)
            span.set_status(Status(StatusCode.ERROR, why))
            span.end()

    def relaying(self, status: int) -> None:
        """The replica's answer began (its head): it is relayed from here."""
        span = self.attempt_span
        if span is None:
            return
        self.attempt_ending["http.response.status_code"] = status
        self.relay_span = self.tracing.tracer.start_span("relay", context=set_span_in_context(span, _NO_CONTEXT))

    def first_token(self) -> None:
        """A stream's first body bytes reached the gateway (its time to first token)."""
        now = time.time_ns()
        self.span.add_event("first_token", timestamp=now)
        start = self.span.start_time  # type: ignore[attr-defined] - the SDK's span has it
        if start is not None:
            self.ending["llmgw.time_to_first_token_ms"] = round((now - start) / 1e6, 3)

    def relay_broken(self, why: str) -> None:
        """The stream broke mid-answer: its relay and attempt end (a migration may follow)."""
        self.attempt_failed("broken", why)

    def usage(self, input_tokens: int | None, output_tokens: int | None) -> None:
        """The answer's usage, when the gateway knows it."""
        if input_tokens is not None:
            self.ending["gen_ai.usage.input_tokens"] = input_tokens
        if output_tokens is not None:
            self.ending["gen_ai.usage.output_tokens"] = output_tokens

    def end(self, status: int, why: str = "") -> None:
        """The request ended with `status` to the client (499: the client went away)."""
        if self.done:
            return
        self.done = True
        error = status >= 500 or status == 499
        self._end_relay(StatusCode.ERROR if error else StatusCode.UNSET, f"ended with {status}")
        span, self.attempt_span = self.attempt_span, None
        if span is not None:
            self.attempt_ending["llmgw.outcome"] = "ok" if not error else f"ended_{status}"
            span.set_attributes(self.attempt_ending)
            span.end()
        self.ending["http.response.status_code"] = status
        self.span.set_attributes(self.ending)
        if error:
            self.span.set_status(Status(StatusCode.ERROR, why or f"answered {status}"))
        self.span.end()

    def failed(self, status: int, code: str, message: str) -> None:
        """The request was refused or failed with an error of the gateway's own (`code`: its
        error code, `error.type`)."""
        if self.done:
            return
        self.ending["error.type"] = code or str(status)
        self.attempt_failed("failed", message)
        self.end(status, message)

    def _end_relay(self, code: StatusCode, why: str) -> None:
        span, self.relay_span = self.relay_span, None
        if span is not None:
            if code is StatusCode.ERROR:
                span.set_status(Status(code, why))
            span.end()
