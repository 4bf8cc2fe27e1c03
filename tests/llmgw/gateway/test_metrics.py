"""The Prometheus text exposition, parsed back."""

from __future__ import annotations

import pytest

from llmgw.gateway.metrics import GatewayMetrics
from testlib.gateway import parse_metrics


def test_counters_and_histograms_render_as_prometheus_text() -> None:
    m = GatewayMetrics()
    m.requests.inc(model="chat", status="200")
    m.requests.inc(model="chat", status="200")
    m.requests.inc(model='we"ird', status="404")
    for v in (0.003, 0.2, 7.0, 500.0):
        m.latency.observe(v, model="chat")
    text = m.render()
    assert "# TYPE llmgw_gateway_requests_total counter" in text
    assert "# TYPE llmgw_gateway_request_duration_seconds histogram" in text
    parsed = parse_metrics(text)
    chat = frozenset({("model", "chat")})
    assert parsed[("llmgw_gateway_requests_total", chat | {("status", "200")})] == 2
    assert parsed[("llmgw_gateway_request_duration_seconds_count", chat)] == 4
    assert parsed[("llmgw_gateway_request_duration_seconds_bucket", chat | {("le", "0.005")})] == 1
    assert parsed[("llmgw_gateway_request_duration_seconds_bucket", chat | {("le", "10")})] == 3
    assert parsed[("llmgw_gateway_request_duration_seconds_bucket", chat | {("le", "+Inf")})] == 4
    assert parsed[("llmgw_gateway_request_duration_seconds_sum", chat)] == 507.203
    assert 'model="we\\"ird"' in text


def test_a_series_is_named_by_all_its_labels_and_counted_by_its_key_alike() -> None:
    m = GatewayMetrics()
    for wrong in ({"model": "chat"}, {"model": "chat", "status": "200", "x": "1"}, {"model": "chat", "code": "1"}):
        with pytest.raises(ValueError, match=r"takes labels \('model', 'status'\)"):
            m.requests.inc(**wrong)
    key = m.requests.key(status=200, model="chat")  # in the family's order, as strings
    assert key == ("chat", "200")
    m.requests.add(key)
    m.requests.inc(model="chat", status="200")
    m.answered("chat", 200)
    assert m.requests.get(model="chat", status="200") == 3
    m.latency.observe_at(m.latency.key(model="chat"), 0.003)
    m.timed("chat", 0.2)
    m.latency.observe(7.0, model="chat")
    parsed = parse_metrics(m.render())
    chat = frozenset({("model", "chat")})
    assert parsed[("llmgw_gateway_request_duration_seconds_count", chat)] == 3
    assert parsed[("llmgw_gateway_request_duration_seconds_bucket", chat | {("le", "0.005")})] == 1
