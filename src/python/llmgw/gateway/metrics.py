"""The gateway's metric families (llmgw.metrics renders them), any registry's families as a
gateway process's heartbeats carry them (`families_of`), and several workers' families as one
/metrics shows them (`render_by_worker`).

Gauges that mirror state kept elsewhere (replica states, queue depth) are set from that state
just before rendering (`mirror`), so a scrape sees the state as it is, not as it was at the last
event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw.gateway.routing import Route, Router
from llmgw.metrics import Counter, Histogram, MetricsRegistry
from llmgw.wire import gateway_link as g

REQUESTS = "llmgw_gateway_requests_total"
DURATION = "llmgw_gateway_request_duration_seconds"
TTFB = "llmgw_gateway_time_to_first_byte_seconds"
HEARD = "llmgw_gateway_worker_heard_seconds"


class GatewayMetrics:
    """The gateway's families, by name, so callers cannot misspell one."""

    def __init__(self) -> None:
        r = self.registry = MetricsRegistry()
        self.requests = r.counter(REQUESTS, "Requests answered, by model and status.", ("model", "status"))
        self.latency = r.histogram(DURATION, "Time from request to the end of the response.", ("model",))
        self.ttfb = r.histogram(TTFB, "Time from request to the first byte of the response body.", ("model",))
        self.in_flight = r.gauge("llmgw_gateway_in_flight", "Requests being answered now.", ("model",))
        self.queue_depth = r.gauge("llmgw_gateway_queue_depth", "Requests waiting for a ready replica.", ("model",))
        self.retries = r.counter(
            "llmgw_gateway_retries_total", "Requests sent again to another replica, by reason.", ("model", "reason")
        )
        self.migrations = r.counter(
            "llmgw_gateway_migrations_total",
            "Streamed answers whose replica failed mid-answer, by outcome: continued (on another replica), "
            "finished (nothing was left to generate), not_exact (an answer that cannot be continued exactly "
            "ended with an error event), failed (no replica could continue it).",
            ("model", "outcome"),
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
        self.routes = r.counter(
            "llmgw_gateway_routes_total",
            "Answers of models routed by prefix, by how their replica was chosen (prefix_hit: it held the "
            "conversation; prefix_hash: none did, the conversation's rank chose among the least loaded; "
            "prefix_spill: the one holding it was over the load bound, or the one ranked first busier than "
            "another; prefix_only: one candidate).",
            ("model", "route"),
        )
        self.prefix_matched = r.counter(
            "llmgw_gateway_prefix_matched_chars_total",
            "Characters of prompts sent to a replica known to hold them already (routed by prefix).",
            ("model",),
        )
        self.cache_reports = r.counter(
            "llmgw_gateway_replica_cache_reports_total",
            "Reports of what a replica's engine holds that the gateway read (models routed by prefix: "
            "llama.cpp's /slots, every 2 s); the resets among them are counted apart.",
            ("model",),
        )
        self.cache_resets = r.counter(
            "llmgw_gateway_replica_cache_resets_total",
            "Times a replica's engine reported its cache begun again (restarted in place): what it was "
            "recorded as holding was forgotten (models routed by prefix: llama.cpp's /slots, vLLM's and "
            "SGLang's KV-cache events, where a cleared cache counts too).",
            ("model",),
        )
        self.cache_trimmed = r.counter(
            "llmgw_gateway_replica_cache_trimmed_total",
            "Prompt blocks the router stopped taking a replica to hold because its engine's KV-cache events "
            "said it holds less (it evicted them).",
            ("model",),
        )
        self.cache_events_missed = r.counter(
            "llmgw_gateway_replica_cache_events_missed_total",
            "Batches of KV-cache events an engine published that this gateway did not receive (a gap in their numbers).",
            ("model",),
        )
        self.cache_event_failures = r.counter(
            "llmgw_gateway_replica_cache_event_failures_total",
            "Subscriptions to an engine's KV-cache events that could not be made or ended (tried again after a backoff).",
            ("model",),
        )
        self.probes = r.counter(
            "llmgw_gateway_probes_total",
            "Probes of replicas out of rotation, by result (reached, failed).",
            ("result",),
        )

    # The per-request counts, by the series' keys (label values in the order declared above):
    # a request costs no label checking and, for a series already seen, no allocation.

    def answered(self, model: str, status: int | str) -> None:
        """A request answered with `status` (one of the gateway's own errors too)."""
        self.requests.add((model, str(status)))

    def routed(self, model: str, route: Route) -> None:
        """An answer of a model routed by prefix began, from a replica chosen by `route`."""
        self.routes.add((model, route.metric))
        if route.matched_chars:
            self.prefix_matched.add((model,), route.matched_chars)

    def timed(self, model: str, seconds: float) -> None:
        """A forwarded request's time from its arrival to the end of its response."""
        self.latency.observe_at((model,), seconds)

    def first_byte(self, model: str, seconds: float) -> None:
        """A forwarded request's time from its arrival to the first byte of its response body."""
        self.ttfb.observe_at((model,), seconds)

    def mirror(self, router: Router, queued: Mapping[str, int], in_flight: Mapping[str, int]) -> None:
        """Set the gauges that mirror the gateway's state: each replica's state and outstanding
        requests (`router`), and each model's queued and in-flight requests."""
        self.replica_state.clear()
        self.replica_outstanding.clear()
        for model, eps in sorted(router.endpoints.items()):
            for ep in eps:
                self.replica_state.set(1, model=model, replica=ep.replica_id, state=router.state_of(ep))
                self.replica_outstanding.set(
                    router.outstanding.get(ep.replica_id, 0), model=model, replica=ep.replica_id
                )
        for model in sorted(router.models | set(queued) | set(in_flight)):
            self.queue_depth.set(queued.get(model, 0), model=model)
            self.in_flight.set(in_flight.get(model, 0), model=model)

    def render(self) -> str:
        return self.registry.render()


def families_of(*registries: MetricsRegistry) -> tuple[g.MetricFamily, ...]:
    """Every family of `registries`, as a gateway process's heartbeats carry its /metrics."""
    return tuple(_family(f) for r in registries for f in r.families)


def _family(f: Counter | Histogram) -> g.MetricFamily:
    if isinstance(f, Histogram):
        samples = tuple(
            g.Sample(labels=key, counts=tuple(counts), sum=f.sums[key]) for key, counts in sorted(f.counts.items())
        )
        return g.MetricFamily(
            name=f.name, help=f.help, kind=f.kind, labels=f.labels, buckets=f.buckets, samples=samples
        )
    samples = tuple(g.Sample(labels=key, value=value) for key, value in sorted(f.values.items()))
    return g.MetricFamily(name=f.name, help=f.help, kind=f.kind, labels=f.labels, samples=samples)


def render_by_worker(workers: Iterable[tuple[str, Iterable[g.MetricFamily], float]], now: float) -> str:
    """The /metrics of several workers serving one port, whichever answers (docs/gateway.md): every
    family of each worker `(instance, families, taken_at)`, each series labelled `worker` with
    the worker's instance (one family each, with the series of every worker; a worker whose family
    of that name has another shape is left out of it), then `HEARD`, the seconds since each
    worker's figures were taken (`taken_at` and `now`: unix time). The control plane's own workers
    (`llmgw.server.gateways.figures`) and a gateway of its own's (`llmgw.gatewayd.figures`) alike."""
    workers = list(workers)
    merged: dict[str, tuple[g.MetricFamily, list[tuple[str, g.Sample]]]] = {}
    for instance, families, _ in workers:
        for f in families:
            first, samples = merged.setdefault(f.name, (f, []))
            if (first.kind, first.labels, first.buckets) == (f.kind, f.labels, f.buckets):  # else: not one family
                samples.extend((instance, s) for s in f.samples)
    r = MetricsRegistry()
    for f, samples in merged.values():
        _add_by_worker(r, f, samples)
    heard = r.gauge(
        HEARD,
        "Seconds since the worker's figures here were taken (its last heartbeat, or the last it wrote).",
        ("worker",),
    )
    for instance, _, taken_at in workers:
        heard.set(round(max(0.0, now - taken_at), 3), worker=instance)
    return r.render()


def _add_by_worker(r: MetricsRegistry, f: g.MetricFamily, samples: list[tuple[str, g.Sample]]) -> None:
    names = ("worker", *f.labels)
    if f.kind == "histogram":
        histogram = r.histogram(f.name, f.help, names, f.buckets)
        for worker, s in samples:
            histogram.set(list(s.counts), s.sum, **dict(zip(names, (worker, *s.labels), strict=True)))
        return
    family = r.counter(f.name, f.help, names) if f.kind == "counter" else r.gauge(f.name, f.help, names)
    for worker, s in samples:
        family.inc(s.value, **dict(zip(names, (worker, *s.labels), strict=True)))
