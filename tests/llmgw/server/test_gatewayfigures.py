"""What the control plane shows of the gateways from their heartbeats: its /metrics has every
family of each of its own workers, each series labelled by worker, and none of a gateway of its
own; the page's history reads every instance heard from."""

from __future__ import annotations

import attrs

from llmgw.gateway.metrics import GatewayMetrics, families_of
from llmgw.http.listeners import ConnectionStats
from llmgw.metrics import merge
from llmgw.server.gateways.figures import WORKER_NAME, history_totals, render_workers
from llmgw.wire import gateway_link as g
from testlib.gateway import parse_metrics


@attrs.define
class Link:
    """What `render_workers` and `history_totals` read of a `LinkedGateway`."""

    name: str
    instance: str
    last: g.GatewayHeartbeat
    heard_at: float = 100.0


def worker(requests: int, seconds: float, shed: int = 0) -> g.GatewayHeartbeat:
    metrics, connections = GatewayMetrics(), ConnectionStats()
    for _ in range(requests):
        metrics.requests.inc(model="chat", status="200")
        metrics.latency.observe(seconds, model="chat")
    connections.shed.inc(shed, listener="http", reason="idle")
    return g.GatewayHeartbeat(seq=1, metrics=families_of(metrics.registry, connections.registry))


def test_metrics_has_every_family_of_each_own_worker_labelled_by_worker_and_no_other_gateway() -> None:
    links = [
        Link(WORKER_NAME, "w0-a", worker(3, 0.02, shed=2)),
        Link(WORKER_NAME, "w1-b", worker(5, 2.0), heard_at=99.5),
        Link("gw-far", "w0-c", worker(1000, 0.02)),  # a gateway of its own: its /metrics is its own
    ]
    text = render_workers(links, now=101.0)
    figures = parse_metrics(text)
    chat = {("model", "chat"), ("status", "200")}
    assert figures[("llmgw_gateway_requests_total", frozenset({("worker", "w0-a"), *chat}))] == 3
    assert figures[("llmgw_gateway_requests_total", frozenset({("worker", "w1-b"), *chat}))] == 5
    assert not any(("worker", "w0-c") in labels for _, labels in figures)
    le_1 = frozenset({("worker", "w1-b"), ("model", "chat"), ("le", "1")})
    le_inf = frozenset({("worker", "w1-b"), ("model", "chat"), ("le", "+Inf")})
    assert figures[("llmgw_gateway_request_duration_seconds_bucket", le_1)] == 0
    assert figures[("llmgw_gateway_request_duration_seconds_bucket", le_inf)] == 5
    shed = {("listener", "http"), ("reason", "idle")}
    assert figures[("llmgw_connections_shed_total", frozenset({("worker", "w0-a"), *shed}))] == 2
    assert figures[("llmgw_gateway_worker_heard_seconds", frozenset({("worker", "w1-b")}))] == 1.5
    # One family each, whatever the number of workers: a HELP and a TYPE line each.
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)) and "# TYPE llmgw_gateway_requests_total counter" in types


def test_the_history_reads_every_instance_heard_from_and_not_one_before_its_first_heartbeat() -> None:
    links = [
        Link(WORKER_NAME, "w0-a", worker(3, 0.02)),
        Link("gw-far", "w0-c", worker(7, 0.02)),
        Link("gw-far", "w1-d", g.GatewayHeartbeat(seq=0)),  # connected, not heard yet
    ]
    totals = history_totals(links)
    assert sorted(totals) == ["control-plane/w0-a", "gw-far/w0-c"]
    assert totals["gw-far/w0-c"]["chat"].requests == 7 and sum(totals["gw-far/w0-c"]["chat"].latency) == 7


def test_with_the_control_planes_own_families_each_family_appears_once() -> None:
    own = ConnectionStats()  # the control plane's listeners: the agent port, its private socket
    own.shed.inc(4, listener="agent", reason="unproven")
    text = merge(render_workers([Link(WORKER_NAME, "w0-a", worker(1, 0.02, shed=2))], now=100.0), own.render())
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), types  # Prometheus refuses a family twice
    figures = parse_metrics(text)
    assert figures[("llmgw_connections_shed_total", frozenset({("listener", "agent"), ("reason", "unproven")}))] == 4
    worker_shed = frozenset({("worker", "w0-a"), ("listener", "http"), ("reason", "idle")})
    assert figures[("llmgw_connections_shed_total", worker_shed)] == 2
