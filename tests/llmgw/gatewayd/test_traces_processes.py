"""Traces from the product's own processes (docs/operations.md, "Traces"): a gateway of its own
(`llmgw gateway --telemetry FILE`) and `llmgw up`'s gateway worker (server.toml's `[telemetry]`,
handed to the worker in its settings file) export their spans over OTLP/HTTP to a real receiver
on 127.0.0.1 (testlib.otlpreceiver), in the trace of the client's traceparent. Each is stopped
as an operator stops it, and the worker sends what it queued before it exits (within 2 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testlib import up
from testlib.cluster import free_port
from testlib.gateway import Sim, chat, request
from testlib.gatewayproc import start_gateway
from testlib.otlpreceiver import Receiver

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
SERVER = 2


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


def test_a_gateway_of_its_own_exports_its_traces(tmp_path: Path, receiver: Receiver) -> None:
    sim = Sim("chat-0")
    try:
        sim.wait_serving()
        settings = tmp_path / "telemetry.toml"
        settings.write_text(f'[telemetry]\notlp_endpoint = "{receiver.endpoint}"\nservice_name = "edge"\n')
        token = "llmgw-traces-test-token"
        gw = start_gateway(
            tmp_path,
            "edge",
            port=free_port(),
            endpoints=[sim.endpoint()],
            token=token,
            flags=["--telemetry", str(settings)],
        )
        try:
            status, headers, _ = request(
                gw.port,
                "POST",
                "/v1/chat/completions",
                chat(stream=True),
                token=token,
                headers={"traceparent": TRACEPARENT},
            )
            assert status == 200 and headers["x-llmgw-replica"] == "chat-0"
        finally:
            gw.stop()  # SIGTERM: the worker drains, then hands its queued spans over before it exits
        spans = receiver.wait_for(3, timeout=1)  # there already: not left to the batch's 5 s schedule
    finally:
        sim.stop()
    [root] = [s for s in spans if s.kind == SERVER]
    assert root.trace_id == TRACE_ID and root.name == "chat chat"
    assert root.resource["service.name"] == "edge"
    assert str(root.resource["service.instance.id"]).startswith("edge/w0-")
    assert {s.name for s in spans} == {"chat chat", "attempt", "relay"}
    assert "first_token" in root.events
    assert token.encode() not in b"".join(receiver.bodies) and sim.key.encode() not in b"".join(receiver.bodies)


def test_a_bad_telemetry_file_is_told_before_any_worker_starts(tmp_path: Path) -> None:
    settings = tmp_path / "telemetry.toml"
    settings.write_text('[telemetry]\notlp_endpoint = "collector:4318"\n')
    with pytest.raises(AssertionError) as err:
        start_gateway(tmp_path, "edge", port=free_port(), endpoints=[], token="t", flags=["--telemetry", str(settings)])
    assert "$.telemetry.otlp_endpoint" in str(err.value)


def test_llmgw_up_traces_with_server_toml_telemetry(tmp_path: Path, receiver: Receiver) -> None:
    state, port = tmp_path / "state", free_port()
    proc, _ = up.start(state, port)  # writes server.toml
    assert up.stop(proc) == 0
    with (state / "server.toml").open("a") as f:
        f.write(f'\n[telemetry]\notlp_endpoint = "{receiver.endpoint}"\nservice_name = "up-gateway"\n')
    proc, ready = up.start(state, port)
    try:
        body = json.dumps({"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        status, _, _ = request(
            port,
            "POST",
            "/v1/chat/completions",
            body.encode(),
            token=ready["api_key"],
            headers={"traceparent": TRACEPARENT, "content-type": "application/json"},
        )
        assert status == 200
    finally:
        assert up.stop(proc) == 0
    spans = receiver.wait_for(3, timeout=15)
    [root] = [s for s in spans if s.kind == SERVER]
    assert root.trace_id == TRACE_ID and root.name == "chat sim-small"
    assert root.resource["service.name"] == "up-gateway"
    assert [s.attributes["llmgw.outcome"] for s in spans if s.name == "attempt"] == ["ok"]
