"""An OpenTelemetry collector's OTLP/HTTP traces endpoint on 127.0.0.1, for the tests of the
gateway's traces: a real HTTP server (a thread of the test) that decodes each POST /v1/traces as
the collector does, `ExportTraceServiceRequest` (protobuf), and keeps its spans. `down()` makes it
answer 503 to every export (a collector in trouble); `stop()` closes it."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import attrs
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@attrs.frozen
class ReceivedSpan:
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    attributes: dict
    events: tuple[str, ...]
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.headers: list[dict[str, str]] = []
        self.bodies: list[bytes] = []  # each export as it came: what a test says never leaves the gateway
        self.failing = False
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if receiver.failing:
                    self.send_response(503)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
                if ok:
                    receiver._take(body, dict(self.headers.items()))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver")
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _take(self, body: bytes, headers: dict[str, str]) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=tuple(e.name for e in s.events),
                            status_code=s.status.code,
                            resource=resource,
                        )
                    )
        with self._cond:
            self.exports += 1
            self.headers.append({k.lower(): v for k, v in headers.items()})
            self.bodies.append(body)
            self.spans.extend(spans)
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 20.0) -> list[ReceivedSpan]:
        """The spans once at least `count` came (blocking; bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.spans) < count:
                left = deadline - time.monotonic()
                assert left > 0, f"{len(self.spans)} spans received of {count} within {timeout:g} s: {self.spans}"
                self._cond.wait(left)
            return list(self.spans)

    def down(self) -> None:
        self.failing = True

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
