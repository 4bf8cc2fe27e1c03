"""The gateway's last 15 minutes per model, for the cluster page's plots.

Sampled from the gateway's figures, every `STEP_S`: each point is what happened since the
previous sample — requests per second, the share answered with a 5xx, and p50/p99 of the
request duration and of the time to first byte, estimated from the histogram buckets as
Prometheus' `histogram_quantile` does (linear within the bucket). Nothing on the request path
changes: the gateway counts as it did.

The figures come from sources, each counting since it started: the control plane's own
gateway when it runs in its process (`totals_of`, its metric families), and every gateway
instance connected over the gateway link (`totals_of_families`, the families of its last
heartbeat). A step
adds up what each source counted since the step before. A source seen for the first time is
a baseline (a gateway that reconnects after the control plane restarted does not put all it
counted since its own start into one step); one that goes away and comes back within the
window goes on from where it was.

`sample` is pure bookkeeping given a time; `serve` is the loop that calls it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from llmgw.gateway.metrics import DURATION, REQUESTS, TTFB, GatewayMetrics
from llmgw.metrics import LATENCY_BUCKETS
from llmgw.wakeup import Wakeup
from llmgw.wire import gateway_link as g

STEP_S = 10.0
WINDOW_S = 15 * 60.0


@attrs.frozen(kw_only=True)
class Point:
    at: float  # wall-clock seconds at the end of the step
    requests: int
    rps: float
    error_rate: float | None  # None: no requests in the step
    p50_s: float | None
    p99_s: float | None
    ttfb_p50_s: float | None
    ttfb_p99_s: float | None

    def view(self) -> dict[str, Any]:
        return attrs.asdict(self)


def quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """The q-quantile of observations counted per bucket (`counts[i]` in (bounds[i-1], bounds[i]],
    the last one above every bound), or None with no observations."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(counts):
        if count and seen + count >= rank:
            if i >= len(bounds):
                return bounds[-1]  # above the last bound: all we know is "at least this"
            lower = bounds[i - 1] if i > 0 else 0.0
            return lower + (bounds[i] - lower) * (rank - seen) / count
        seen += count
    return bounds[-1]


@attrs.define
class ModelTotals:
    """What one source counted for one model since it started."""

    requests: float = 0.0
    errors: float = 0.0  # answered with a 5xx
    latency: list[int] = attrs.Factory(list)  # per bucket of LATENCY_BUCKETS, the last above them
    ttfb: list[int] = attrs.Factory(list)


Totals = Mapping[str, ModelTotals]  # by model
Sources = Callable[[], Mapping[str, Totals]]  # by source name


def totals_of(metrics: GatewayMetrics) -> dict[str, ModelTotals]:
    """A gateway's totals, from its metric families."""
    out: dict[str, ModelTotals] = {}
    for (model, status), value in metrics.requests.values.items():
        _count(out.setdefault(model, ModelTotals()), status, value)
    for family, field in ((metrics.latency, "latency"), (metrics.ttfb, "ttfb")):
        for (model,), counts in family.counts.items():
            setattr(out.setdefault(model, ModelTotals()), field, list(counts))
    return out


def totals_of_families(families: Sequence[g.MetricFamily]) -> dict[str, ModelTotals]:
    """A gateway instance's totals, from the metric families of its last heartbeat (a histogram
    of other buckets than ours is left out: it cannot be added up with ours)."""
    out: dict[str, ModelTotals] = {}
    for f in families:
        if f.name == REQUESTS and f.labels == ("model", "status"):
            for s in f.samples:
                _count(out.setdefault(s.labels[0], ModelTotals()), s.labels[1], s.value)
        elif f.name in (DURATION, TTFB) and f.labels == ("model",) and f.buckets == LATENCY_BUCKETS:
            for s in f.samples:
                setattr(
                    out.setdefault(s.labels[0], ModelTotals()),
                    "latency" if f.name == DURATION else "ttfb",
                    list(s.counts),
                )
    return out


def _count(totals: ModelTotals, status: str, value: float) -> None:
    totals.requests += value
    if status.isdigit() and int(status) >= 500:
        totals.errors += value


class History:
    def __init__(
        self,
        sources: Sources,
        *,
        step_s: float = STEP_S,
        window_s: float = WINDOW_S,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`sources()`: each source's totals now, by its name (the module docstring)."""
        self.sources = sources
        self.step_s = step_s
        self.window_s = window_s
        self.points = max(1, int(window_s // step_s))
        self.wall = wall
        self.series: dict[str, deque[Point]] = {}
        self._seen: dict[str, tuple[float, Totals]] = {}  # source -> (when last seen, its totals then)
        self._last_at: float | None = None
        self.sampled = Wakeup()  # after each sample

    @classmethod
    def of(cls, metrics: GatewayMetrics, **options: Any) -> History:
        """The history of one gateway, from its metric families."""
        return cls(lambda: {"": totals_of(metrics)}, **options)

    def _step(self, now: float) -> dict[str, ModelTotals]:
        """What every source counted since the previous sample, by model."""
        step: dict[str, ModelTotals] = {}
        for name, totals in self.sources().items():
            seen = self._seen.get(name)
            self._seen[name] = (now, totals)
            if seen is None:
                for model in totals:
                    step.setdefault(model, ModelTotals())  # a baseline: its models shown, nothing counted
                continue
            for model, total in totals.items():
                _add(step.setdefault(model, ModelTotals()), total, seen[1].get(model, ModelTotals()))
        self._seen = {name: seen for name, seen in self._seen.items() if now - seen[0] <= self.window_s}
        return step

    def sample(self, now: float) -> None:
        """Append, for every model seen so far, what happened since the previous sample."""
        step = self._step(now)
        for model in self.series:
            step.setdefault(model, ModelTotals())  # a model gone quiet gets its gap
        elapsed = now - self._last_at if self._last_at is not None else self.step_s
        self._last_at = now
        at = self.wall()
        for model, total in sorted(step.items()):
            requests = int(total.requests)
            point = Point(
                at=round(at, 3),
                requests=requests,
                rps=round(requests / elapsed, 3) if elapsed > 0 else 0.0,
                error_rate=round(total.errors / requests, 4) if requests else None,
                p50_s=_round(quantile(0.5, LATENCY_BUCKETS, total.latency)),
                p99_s=_round(quantile(0.99, LATENCY_BUCKETS, total.latency)),
                ttfb_p50_s=_round(quantile(0.5, LATENCY_BUCKETS, total.ttfb)),
                ttfb_p99_s=_round(quantile(0.99, LATENCY_BUCKETS, total.ttfb)),
            )
            self.series.setdefault(model, deque(maxlen=self.points)).append(point)
        self.sampled.fire()

    def view(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "window_s": self.step_s * self.points,
            "models": {model: [p.view() for p in points] for model, points in sorted(self.series.items())},
        }

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.sample(trio.current_time())  # the baseline: what was counted before the page's window
        task_status.started()
        next_at = trio.current_time() + self.step_s
        while True:
            await trio.sleep_until(next_at)
            self.sample(trio.current_time())
            next_at += self.step_s


def _add(step: ModelTotals, now: ModelTotals, before: ModelTotals) -> None:
    """Add to `step` what `now` counted past `before` (a count that went down: a new start)."""
    step.requests += max(0.0, now.requests - before.requests)
    step.errors += max(0.0, now.errors - before.errors)
    step.latency = _sum(step.latency, _delta(now.latency, before.latency))
    step.ttfb = _sum(step.ttfb, _delta(now.ttfb, before.ttfb))


def _sum(a: list[int], b: list[int]) -> list[int]:
    if not a:
        return list(b)
    if not b:
        return a
    return [x + y for x, y in zip(a, b, strict=True)]


def _delta(now: list[int], before: list[int]) -> list[int]:
    if not before or len(before) != len(now):
        return list(now)
    return [max(0, a - b) for a, b in zip(now, before, strict=True)]


def _round(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 4)
