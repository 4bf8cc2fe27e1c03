"""The gateway's traces (llmgw.telemetry): spans exported with OpenTelemetry's SDK over OTLP/HTTP
to a real receiver on 127.0.0.1 that decodes the protobuf a collector gets (testlib.otlpreceiver).

A traced request: one SERVER span whose parent is the client's traceparent, children for the wait
for a replica, each attempt (its replica and outcome) and the relay (the attempt's child), a
first_token event; the engine gets the attempt's traceparent (the client's trace id) and the
client's tracestate; no prompt text or key in what is exported. Off: nothing of OpenTelemetry is
imported and the client's traceparent reaches the engine as it came. A collector that is down or
failing holds no request."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from llmgw import telemetry
from llmgw.config import TelemetrySection, server_config_from_dict
from llmgw.errors import ConfigError
from llmgw.gateway.app import Gateway
from llmgw.gateway.routing import Endpoint
from llmgw.gateway.services import serve_services
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.http.openai import error_body
from llmgw.http.server import bound_address, serve_http
from llmgw.server.state.keys import KeyRing
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.simengine.app import SimEngine
from llmgw.simengine.options import SimOptions
from testlib.endpoints import StaticEndpoints
from testlib.gateway import request as http_request
from testlib.otlpreceiver import Receiver
from testlib.proc import llmgw_env

pytestmark = pytest.mark.trio

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
PROMPT = "a prompt whose words never leave the gateway"
SERVER, CLIENT = 2, 3  # OTLP's SpanKind numbers


class RecordingEngine:
    """The sim engine's handler on a loopback port, each request's headers kept."""

    def __init__(self, output_token_ms: float = 0.0) -> None:
        self.sim = SimEngine(SimOptions(model="chat", api_key="engine-key", output_token_ms=output_token_ms))
        self.sim.serving = True
        self.headers: list[dict[str, str]] = []
        self.port = 0

    async def handle(self, request: Request) -> Response | StreamingResponse:
        self.headers.append(dict(request.headers))
        return await self.sim.handle(request)

    async def start(self, nursery: trio.Nursery) -> Endpoint:
        listeners = await nursery.start(
            lambda task_status: serve_http(self.handle, "127.0.0.1", 0, errors=error_body, task_status=task_status)
        )
        self.port = bound_address(listeners)[1]
        return Endpoint(replica_id="chat-0", model="chat", host="127.0.0.1", port=self.port, api_key="engine-key")


async def start_gateway(nursery, tmp_path: Path, endpoints, tracing, **options) -> tuple[int, str, Gateway]:
    from llmgw.config import GatewaySection

    keys = KeyRing(AsyncStore.open(tmp_path / "cp"))
    _, token = await keys.create("tests")
    gateway = Gateway(StaticEndpoints(tuple(endpoints)), keys.table, options=GatewaySection(**options), tracing=tracing)
    await nursery.start(serve_services, gateway)
    listeners = await nursery.start(
        lambda task_status: serve_http(gateway.handle, "127.0.0.1", 0, errors=error_body, task_status=task_status)
    )
    return bound_address(listeners)[1], token, gateway


def chat_body(**extra: Any) -> dict:
    return {"model": "chat", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, **extra}


async def call(port: int, token: str, body: dict, headers: dict | None = None):
    return await trio.to_thread.run_sync(
        lambda: http_request(port, "POST", "/v1/chat/completions", body, token=token, headers=headers)
    )


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


def flush(tracing) -> None:
    tracing.processor.force_flush()  # exports what is queued now, on this thread


def by_name(spans, name: str):
    return [s for s in spans if s.name == name]


async def test_a_traced_stream_is_one_trace_under_the_clients_span(
    tmp_path: Path, nursery: trio.Nursery, receiver: Receiver
) -> None:
    headers_file = tmp_path / "otlp-headers"
    headers_file.write_text("# the collector's credential\nX-Collector-Key: collector-secret\n")
    headers_file.chmod(0o600)
    section = TelemetrySection(
        otlp_endpoint=receiver.endpoint + "/", service_name="gw-test", headers_file=str(headers_file)
    )
    tracing = telemetry.start(section, instance="gw/w0")
    assert tracing is not None
    engine = RecordingEngine()
    port, token, _ = await start_gateway(nursery, tmp_path, [await engine.start(nursery)], tracing)

    status, _, body = await call(
        port, token, chat_body(stream=True), {"traceparent": TRACEPARENT, "tracestate": "vendor=x"}
    )
    assert status == 200 and b"data: [DONE]" in body
    flush(tracing)
    spans = receiver.wait_for(3)

    [root] = [s for s in spans if s.kind == SERVER]
    assert root.name == "chat chat"  # GenAI's "{operation} {model}"
    assert (root.trace_id, root.parent_id) == (TRACE_ID, CLIENT_SPAN)  # under the client's span
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.model"] == "chat"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["llmgw.time_to_first_token_ms"] >= 0
    assert "first_token" in root.events
    assert root.resource["service.name"] == "gw-test" and root.resource["service.instance.id"] == "gw/w0"
    [attempt] = by_name(spans, "attempt")
    assert (attempt.kind, attempt.parent_id, attempt.trace_id) == (CLIENT, root.span_id, TRACE_ID)
    assert attempt.attributes["llmgw.replica"] == "chat-0" and attempt.attributes["llmgw.outcome"] == "ok"
    assert attempt.attributes["server.port"] == engine.port
    [relay] = by_name(spans, "relay")
    assert relay.parent_id == attempt.span_id
    assert not by_name(spans, "queue")  # a replica was free: no wait, no span

    # The engine got the attempt's traceparent: the client's trace, the attempt as its parent.
    [got] = engine.headers
    assert got["traceparent"] == f"00-{TRACE_ID}-{attempt.span_id}-01"
    assert got["tracestate"] == "vendor=x"
    # The collector got the headers file's credential; nothing exported holds the prompt or a key.
    assert receiver.headers[0]["x-collector-key"] == "collector-secret"
    exported = b"".join(receiver.bodies)
    for secret in (PROMPT.encode(), token.encode(), b"engine-key", b"collector-secret"):
        assert secret not in exported
    with trio.fail_after(10):
        await tracing.aclose()


async def test_a_request_that_waits_has_a_queue_span_and_one_without_traceparent_a_root(
    tmp_path: Path, nursery: trio.Nursery, receiver: Receiver
) -> None:
    tracing = telemetry.start(TelemetrySection(otlp_endpoint=receiver.endpoint, sample_ratio=1.0))
    engine = RecordingEngine(output_token_ms=30)
    port, token, _ = await start_gateway(
        nursery, tmp_path, [await engine.start(nursery)], tracing, max_outstanding_per_replica=1
    )
    async with trio.open_nursery() as n:
        for _ in range(2):
            n.start_soon(call, port, token, chat_body(stream=True))
    flush(tracing)
    spans = receiver.wait_for(7)
    roots = [s for s in spans if s.kind == SERVER]
    assert len(roots) == 2 and all(r.parent_id == "" for r in roots)  # no traceparent: roots of their own
    assert len({r.trace_id for r in roots}) == 2
    [queue] = by_name(spans, "queue")  # the second waited for the first
    assert queue.parent_id in {r.span_id for r in roots}
    # Each engine request carried its own trace's traceparent.
    sent = {h["traceparent"].split("-")[1] for h in engine.headers}
    assert sent == {r.trace_id for r in roots}
    # The engine's usage (asked of a stream by the gateway, llmgw.gateway.usage) on the request's span.
    for root in roots:
        assert root.attributes["gen_ai.usage.output_tokens"] == 6 and root.attributes["gen_ai.usage.input_tokens"] > 0
    with trio.fail_after(10):
        await tracing.aclose()


async def test_a_refused_request_is_a_span_with_its_error(
    tmp_path: Path, nursery: trio.Nursery, receiver: Receiver
) -> None:
    tracing = telemetry.start(TelemetrySection(otlp_endpoint=receiver.endpoint, sample_ratio=1.0))
    engine = RecordingEngine()
    port, token, _ = await start_gateway(nursery, tmp_path, [await engine.start(nursery)], tracing)
    status, _, _ = await call(port, token, {**chat_body(), "model": "nope"}, {"traceparent": TRACEPARENT})
    assert status == 404
    flush(tracing)
    [root] = receiver.wait_for(1)
    assert root.trace_id == TRACE_ID and root.attributes["http.response.status_code"] == 404
    assert root.attributes["error.type"] == "model_not_found"
    assert "gen_ai.usage.output_tokens" not in root.attributes  # no engine answered
    assert root.status_code == 0  # a client's error is not the server's (HTTP conventions)
    assert not engine.headers


async def test_off_the_clients_traceparent_reaches_the_engine_as_it_came(tmp_path: Path, nursery: trio.Nursery) -> None:
    assert telemetry.start(TelemetrySection()) is None
    engine = RecordingEngine()
    port, token, gateway = await start_gateway(nursery, tmp_path, [await engine.start(nursery)], None)
    assert gateway.tracing is None
    status, _, _ = await call(port, token, chat_body(), {"traceparent": TRACEPARENT, "tracestate": "vendor=x"})
    assert status == 200
    assert (engine.headers[0]["traceparent"], engine.headers[0]["tracestate"]) == (TRACEPARENT, "vendor=x")


async def test_an_unsampled_request_is_not_traced_and_its_traceparent_goes_on_unchanged(
    tmp_path: Path, nursery: trio.Nursery, receiver: Receiver
) -> None:
    tracing = telemetry.start(TelemetrySection(otlp_endpoint=receiver.endpoint, sample_ratio=0.0))
    engine = RecordingEngine()
    port, token, _ = await start_gateway(nursery, tmp_path, [await engine.start(nursery)], tracing)
    unsampled = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
    assert (await call(port, token, chat_body(), {"traceparent": unsampled}))[0] == 200
    assert (await call(port, token, chat_body()))[0] == 200  # ratio 0: a new trace is not sampled
    assert (await call(port, token, chat_body(), {"traceparent": TRACEPARENT}))[0] == 200  # sampled: traced
    flush(tracing)
    spans = receiver.wait_for(3)
    assert {s.trace_id for s in spans} == {TRACE_ID}
    assert engine.headers[0]["traceparent"] == unsampled and "traceparent" not in engine.headers[1]
    with trio.fail_after(10):
        await tracing.aclose()


@pytest.mark.parametrize("collector", ["closed", "failing"])
async def test_a_collector_down_or_failing_holds_no_request(
    tmp_path: Path, nursery: trio.Nursery, receiver: Receiver, collector: str
) -> None:
    if collector == "closed":
        receiver.stop()  # nothing listens on its port now
    else:
        receiver.down()  # answers 503 to every export, which the SDK retries with backoff
    tracing = telemetry.start(TelemetrySection(otlp_endpoint=receiver.endpoint, sample_ratio=1.0, timeout_s=5.0))
    engine = RecordingEngine()
    port, token, _ = await start_gateway(nursery, tmp_path, [await engine.start(nursery)], tracing)
    tracing.processor._batch_processor._worker_awaken.set()  # an export under way meanwhile
    with trio.fail_after(10):  # 40 requests; each is a few ms on loopback
        for _ in range(40):
            status, _, _ = await call(port, token, chat_body(stream=True), {"traceparent": TRACEPARENT})
            assert status == 200
    assert len(engine.headers) == 40
    with trio.fail_after(5):  # the process's end is bounded too (SHUTDOWN_S)
        await tracing.aclose()


async def test_a_migrated_stream_shows_both_attempts(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, receiver: Receiver
) -> None:
    from llmgw.gateway.migrate import CHAT, COMPLETIONS
    from testlib.migrationrig import WORDS, parse, text_of, via_a_then_b
    from testlib.migrationrig import setup as migration_setup

    tracing = telemetry.start(TelemetrySection(otlp_endpoint=receiver.endpoint, sample_ratio=1.0))
    net, a, b, gw, info = await migration_setup(tmp_path, nursery, "vllm")
    gw.gateway.tracing = tracing
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, _, body = await via_a_then_b(gw, a, b, info, CHAT, request)
    assert status == 200 and text_of(parse(body)[0]) == "".join(WORDS)
    flush(tracing)
    spans = receiver.wait_for(5)
    [root] = [s for s in spans if s.kind == SERVER]
    first, second = sorted(by_name(spans, "attempt"), key=lambda s: s.attributes["llmgw.attempt"])
    assert (first.attributes["llmgw.replica"], first.attributes["llmgw.outcome"]) == ("m-0", "broken")
    assert first.status_code == 2
    assert (second.attributes["llmgw.replica"], second.attributes["llmgw.migration"]) == ("m-1", 1)
    assert second.attributes["llmgw.outcome"] == "ok" and {first.parent_id, second.parent_id} == {root.span_id}
    assert len(by_name(spans, "relay")) == 2
    assert COMPLETIONS  # the module's routes, imported with it
    await tracing.aclose()


async def test_an_answer_read_whole_that_broke_ends_its_relay_with_its_attempt(receiver: Receiver) -> None:
    """`_relay` began the relay (the head came), then the body broke (UpstreamBroken): the
    request goes to another replica; the first relay is exported, not left open."""
    tracing = telemetry.start(TelemetrySection(otlp_endpoint=receiver.endpoint, sample_ratio=1.0))
    trace = tracing.request("/v1/completions", {}, "rid")
    trace.admitted("m")
    for replica in ("m-0", "m-1"):
        trace.attempt(replica, "127.0.0.1", 1, [])
        trace.relaying(200)
        if replica == "m-0":
            trace.attempt_failed("broken", "m-0 failed in the middle of a response")
    trace.end(200)
    flush(tracing)
    spans = receiver.wait_for(5)
    relays = by_name(spans, "relay")
    assert len(relays) == 2 and [r.status_code for r in relays].count(2) == 1
    outcomes = {s.attributes["llmgw.replica"]: s.attributes["llmgw.outcome"] for s in by_name(spans, "attempt")}
    assert outcomes == {"m-0": "broken", "m-1": "ok"}
    [root] = [s for s in spans if s.kind == SERVER]
    assert root.name == "text_completion m"
    await tracing.aclose()


async def test_off_nothing_of_opentelemetry_is_imported() -> None:
    """A gateway process without [telemetry] loads no OpenTelemetry module (a fresh interpreter:
    the test process itself has imported them)."""
    script = (
        "import sys\n"
        "import llmgw.cli, llmgw.commands.gateway, llmgw.gatewayd.main, llmgw.gateway.app, llmgw.server.app\n"
        "from llmgw import telemetry\n"
        "from llmgw.config import TelemetrySection\n"
        "assert telemetry.start(TelemetrySection()) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=llmgw_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


async def test_telemetry_config_is_checked(tmp_path: Path) -> None:
    cfg = server_config_from_dict({"telemetry": {"otlp_endpoint": "http://collector:4318"}})
    assert cfg.telemetry.enabled and cfg.telemetry.sample_ratio == 0.01  # 1 % unless set
    assert not server_config_from_dict({}).telemetry.enabled  # off by default
    with pytest.raises(ConfigError) as err:
        server_config_from_dict(
            {"telemetry": {"otlp_endpoint": "collector:4318", "sample_ratio": 2.0, "headers_file": "rel", "x": 1}}
        )
    assert "unknown key 'x'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        server_config_from_dict({"telemetry": {"otlp_endpoint": "collector:4318", "sample_ratio": 2.0}})
    text = str(err.value)
    assert "$.telemetry.otlp_endpoint" in text and "$.telemetry.sample_ratio" in text
    # `llmgw gateway --telemetry FILE`: the one table, by the same rules.
    path = tmp_path / "telemetry.toml"
    path.write_text('[telemetry]\notlp_endpoint = "https://otel.example:4318"\nsample_ratio = 0.25\n')
    assert telemetry.load_section(path) == TelemetrySection(
        otlp_endpoint="https://otel.example:4318", sample_ratio=0.25
    )
    path.write_text("[gateway]\nmax_queue = 1\n")
    with pytest.raises(ConfigError, match="unknown table 'gateway'"):
        telemetry.load_section(path)
    # A headers file is a credential: refused when others may read it, and never quoted.
    headers = tmp_path / "headers"
    headers.write_text("Authorization: Bearer sekrit\nnot a header\n")
    headers.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        telemetry.read_headers(str(headers))
    headers.chmod(0o600)
    with pytest.raises(ConfigError) as err:
        telemetry.read_headers(str(headers))
    assert "line 2" in str(err.value) and "sekrit" not in str(err.value)
