"""The gateway's metric families (llmgw.metrics renders them).

Gauges that mirror state kept elsewhere (replica states, queue depth) are set by the gateway
just before rendering, so a scrape sees the state as it is, not as it was at the last event.
"""

from __future__ import annotations

from llmgw.metrics import MetricsRegistry


class GatewayMetrics:
    """The gateway's families, by name, so callers cannot misspell one."""

    def __init__(self) -> None:
        r = self.registry = MetricsRegistry()
        self.requests = r.counter(
            "llmgw_gateway_requests_total", "Requests answered, by model and status.", ("model", "status")
        )
        self.latency = r.histogram(
            "llmgw_gateway_request_duration_seconds", "Time from request to the end of the response.", ("model",)
        )
        self.ttfb = r.histogram(
            "llmgw_gateway_time_to_first_byte_seconds",
            "Time from request to the first byte of the response body.",
            ("model",),
        )
        self.in_flight = r.gauge("llmgw_gateway_in_flight", "Requests being answered now.", ("model",))
        self.queue_depth = r.gauge("llmgw_gateway_queue_depth", "Requests waiting for a ready replica.", ("model",))
        self.retries = r.counter(
            "llmgw_gateway_retries_total", "Requests sent again to another replica, by reason.", ("model", "reason")
        )
        self.replica_state = r.gauge(
            "llmgw_gateway_replica_state",
            "1 for each replica in the gateway's view, labelled with its state (ready, draining, down).",
            ("model", "replica", "state"),
        )
        self.replica_outstanding = r.gauge(
            "llmgw_gateway_replica_outstanding", "Requests outstanding on each replica.", ("model", "replica")
        )
        self.replica_down = r.counter(
            "llmgw_gateway_replica_down_total",
            "Times a replica left rotation after a failed attempt, by reason; it returns when a probe reaches it.",
            ("model", "reason"),
        )
        self.probes = r.counter(
            "llmgw_gateway_probes_total",
            "Probes of replicas out of rotation, by result (reached, failed).",
            ("result",),
        )

    def render(self) -> str:
        return self.registry.render()
