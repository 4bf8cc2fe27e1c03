"""The gateway's 15-minute history per model, sampled from its metric families."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.gateway.history import History, quantile
from llmgw.gateway.metrics import GatewayMetrics


def test_quantiles_interpolate_within_the_bucket_like_histogram_quantile() -> None:
    bounds = (0.1, 0.5, 1.0)
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.5, bounds, [10, 0, 0, 0]) == pytest.approx(0.05)
    assert quantile(0.5, bounds, [0, 4, 0, 0]) == pytest.approx(0.3)
    assert quantile(0.99, bounds, [50, 49, 1, 0]) == pytest.approx(0.5)
    assert quantile(0.99, bounds, [0, 0, 0, 3]) == 1.0  # above the last bound: at least that


def test_each_sample_is_what_happened_since_the_one_before() -> None:
    metrics = GatewayMetrics()
    history = History(metrics, step_s=10, window_s=30, wall=lambda: 1000.0)
    history.sample(0.0)
    assert history.view()["models"] == {}
    for status, seconds in (("200", 0.2), ("200", 0.2), ("200", 0.2), ("503", 0.001)):
        metrics.requests.inc(model="m", status=status)
        metrics.latency.observe(seconds, model="m")
    metrics.ttfb.observe(0.02, model="m")
    history.sample(10.0)
    [point] = history.view()["models"]["m"]
    assert point["requests"] == 4 and point["rps"] == 0.4 and point["error_rate"] == 0.25
    assert 0.1 < point["p50_s"] <= 0.25 and point["ttfb_p50_s"] == pytest.approx(0.0175)
    history.sample(20.0)  # nothing since: a gap, not a repeat of the last step
    last = history.view()["models"]["m"][-1]
    assert last["requests"] == 0 and last["error_rate"] is None and last["p50_s"] is None
    for t in (30.0, 40.0, 50.0):
        history.sample(t)
    assert len(history.view()["models"]["m"]) == 3  # the window keeps 30 s of 10 s steps
    assert history.view()["window_s"] == 30


@pytest.mark.trio
async def test_serve_samples_every_step_and_says_so(autojump_clock: trio.testing.MockClock) -> None:
    metrics = GatewayMetrics()
    history = History(metrics, step_s=10, window_s=60)
    metrics.requests.inc(model="m", status="200")
    async with trio.open_nursery() as nursery:
        await nursery.start(history.serve)
        metrics.requests.inc(model="m", status="200")
        changed = history.sampled.next()
        await changed.wait()
        assert [p["requests"] for p in history.view()["models"]["m"]] == [1, 1]
        nursery.cancel_scope.cancel()
