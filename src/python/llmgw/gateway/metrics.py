"""The gateway's metric families (llmgw.metrics renders them).

Gauges that mirror state kept elsewhere (replica states, queue depth) are set from that state
just before rendering (`mirror`), so a scrape sees the state as it is, not as it was at the last
event.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.gateway.routing import Router
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

    def mirror(self, router: Router, queued: Mapping[str, int], in_flight: Mapping[str, int]) -> None:
        """Set the gauges that mirror the gateway's state: each replica's state and outstanding
        requests (`router`), and each model's queued and in-flight requests."""
        self.replica_state.clear()
        self.replica_outstanding.clear()
        for model, eps in sorted(router.endpoints.items()):
            for ep in eps:
                self.replica_state.set(1, model=model, replica=ep.replica_id, state=router.state_of(ep))
                self.replica_outstanding.set(router.outstanding.get(ep.replica_id, 0), model=model, replica=ep.replica_id)
        for model in sorted(router.models | set(queued) | set(in_flight)):
            self.queue_depth.set(queued.get(model, 0), model=model)
            self.in_flight.set(in_flight.get(model, 0), model=model)

    def render(self) -> str:
        return self.registry.render()
