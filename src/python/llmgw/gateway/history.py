"""The gateway's last 15 minutes per model, for the cluster page's plots.

Sampled from the gateway's own metric families (the counters and histograms `/metrics`
serves), every `STEP_S`: each point is what happened since the previous sample — requests per
second, the share answered with a 5xx, and p50/p99 of the request duration and of the time to
first byte, estimated from the histogram buckets as Prometheus' `histogram_quantile` does
(linear within the bucket). Nothing on the request path changes: the gateway counts as it did.

`sample` is pure bookkeeping given a time; `serve` is the loop that calls it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from llmgw.gateway.metrics import GatewayMetrics
from llmgw.wakeup import Wakeup

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
class _Seen:
    requests: float = 0.0
    errors: float = 0.0
    latency: list[int] = attrs.Factory(list)
    ttfb: list[int] = attrs.Factory(list)


class History:
    def __init__(
        self,
        metrics: GatewayMetrics,
        *,
        step_s: float = STEP_S,
        window_s: float = WINDOW_S,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.step_s = step_s
        self.points = max(1, int(window_s // step_s))
        self.wall = wall
        self.series: dict[str, deque[Point]] = {}
        self._seen: dict[str, _Seen] = {}
        self._last_at: float | None = None
        self.sampled = Wakeup()  # after each sample

    def _totals(self) -> dict[str, _Seen]:
        m = self.metrics
        out: dict[str, _Seen] = {}
        for (model, status), value in m.requests.values.items():
            seen = out.setdefault(model, _Seen())
            seen.requests += value
            if status.isdigit() and int(status) >= 500:
                seen.errors += value
        for family, field in ((m.latency, "latency"), (m.ttfb, "ttfb")):
            for (model,), counts in family.counts.items():
                setattr(out.setdefault(model, _Seen()), field, list(counts))
        return out

    def sample(self, now: float) -> None:
        """Append, for every model seen so far, what happened since the previous sample."""
        totals = self._totals()
        elapsed = now - self._last_at if self._last_at is not None else self.step_s
        self._last_at = now
        at = self.wall()
        for model, total in sorted(totals.items()):
            before = self._seen.get(model, _Seen())
            requests = int(total.requests - before.requests)
            errors = total.errors - before.errors
            latency = _delta(total.latency, before.latency)
            ttfb = _delta(total.ttfb, before.ttfb)
            lb, tb = self.metrics.latency.buckets, self.metrics.ttfb.buckets
            point = Point(
                at=round(at, 3),
                requests=requests,
                rps=round(requests / elapsed, 3) if elapsed > 0 else 0.0,
                error_rate=round(errors / requests, 4) if requests else None,
                p50_s=_round(quantile(0.5, lb, latency)),
                p99_s=_round(quantile(0.99, lb, latency)),
                ttfb_p50_s=_round(quantile(0.5, tb, ttfb)),
                ttfb_p99_s=_round(quantile(0.99, tb, ttfb)),
            )
            self.series.setdefault(model, deque(maxlen=self.points)).append(point)
        self._seen = totals
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


def _delta(now: list[int], before: list[int]) -> list[int]:
    if not before:
        return list(now)
    return [a - b for a, b in zip(now, before, strict=True)]


def _round(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 4)
