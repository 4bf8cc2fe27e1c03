"""What the control plane shows of the gateway instances connected to it, from the last heartbeat
of each (`GatewayLink.last`): the figures behind the cluster page's history (`history_totals`)
and, when its own gateway runs in worker processes, the gateway's families in its /metrics
(`render_workers`).

The rule for /metrics on `http_listen` (docs/gateway.md): it is the control plane's, relayed by
whichever worker took the connection — the families of each of its own workers (the gateway
named `WORKER_NAME`: everything a worker's own /metrics has, the gateway's families, its table's
staleness, its listener's connections) as the worker's last heartbeat said them, every series
labelled `worker` with the worker's instance (`w0-…`; a restarted worker is a new instance, its
counters start from zero as a restarted process's do), and the seconds since each worker was
heard; then the control plane's own families. So a scrape sees every worker at once, whichever
answers, each figure at most a heartbeat interval old. Not `instance`: Prometheus sets that label
itself on every series, from the scrape's target. A standalone gateway's figures are not here:
its own /metrics serves them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from llmgw.gateway.history import Totals, totals_of_families
from llmgw.metrics import MetricsRegistry
from llmgw.pki.ca import CONTROL_PLANE_GATEWAY
from llmgw.server.gatewayfeed import GatewayLink
from llmgw.wire import gateway_link as g

WORKER_NAME = CONTROL_PLANE_GATEWAY  # the gateway name of the control plane's own workers (their certificate's CN)


def history_totals(links: Iterable[GatewayLink]) -> dict[str, Totals]:
    """Every instance's totals by "name/instance", for the page's history (`History` sources);
    an instance not heard from yet is left out, so that its first heartbeat is its baseline."""
    return {f"{link.name}/{link.instance}": totals_of_families(link.last.metrics) for link in links if link.last.seq}


def own_workers(links: Iterable[GatewayLink]) -> list[GatewayLink]:
    return [link for link in links if link.name == WORKER_NAME]


def render_workers(links: Iterable[GatewayLink], now: float | None = None) -> str:
    """The metric families of the control plane's own workers (`links` of WORKER_NAME), each
    series labelled `worker`, then the seconds since each was heard; `now`: unix time."""
    now = time.time() if now is None else now
    workers = own_workers(links)
    merged: dict[str, tuple[g.MetricFamily, list[tuple[str, g.Sample]]]] = {}
    for link in workers:
        for f in link.last.metrics:
            first, samples = merged.setdefault(f.name, (f, []))
            if (first.kind, first.labels, first.buckets) == (f.kind, f.labels, f.buckets):  # else: not one family
                samples.extend((link.instance, s) for s in f.samples)
    r = MetricsRegistry()
    for f, samples in merged.values():
        _add_family(r, f, samples)
    heard = r.gauge(
        "llmgw_gateway_worker_heard_seconds",
        "Seconds since the worker's last heartbeat, whose figures these are.",
        ("worker",),
    )
    for link in workers:
        heard.set(round(max(0.0, now - link.heard_at), 3), worker=link.instance)
    return r.render()


def _add_family(r: MetricsRegistry, f: g.MetricFamily, samples: list[tuple[str, g.Sample]]) -> None:
    names = ("worker", *f.labels)
    if f.kind == "histogram":
        histogram = r.histogram(f.name, f.help, names, f.buckets)
        for worker, s in samples:
            histogram.set(list(s.counts), s.sum, **dict(zip(names, (worker, *s.labels), strict=True)))
        return
    family = r.counter(f.name, f.help, names) if f.kind == "counter" else r.gauge(f.name, f.help, names)
    for worker, s in samples:
        family.inc(s.value, **dict(zip(names, (worker, *s.labels), strict=True)))
