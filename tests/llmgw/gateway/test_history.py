"""The gateway's 15-minute history per model, sampled from its metric families or from the
figures gateway instances send in their heartbeats, each source counted since the step before."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.gateway.history import History, quantile, totals_of_families
from llmgw.gateway.metrics import GatewayMetrics, families_of


def test_quantiles_interpolate_within_the_bucket_like_histogram_quantile() -> None:
    bounds = (0.1, 0.5, 1.0)
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.5, bounds, [10, 0, 0, 0]) == pytest.approx(0.05)
    assert quantile(0.5, bounds, [0, 4, 0, 0]) == pytest.approx(0.3)
    assert quantile(0.99, bounds, [50, 49, 1, 0]) == pytest.approx(0.5)
    assert quantile(0.99, bounds, [0, 0, 0, 3]) == 1.0  # above the last bound: at least that


def test_each_sample_is_what_happened_since_the_one_before() -> None:
    metrics = GatewayMetrics()
    history = History.of(metrics, step_s=10, window_s=30, wall=lambda: 1000.0)
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
    history = History.of(metrics, step_s=10, window_s=60)
    metrics.requests.inc(model="m", status="200")
    async with trio.open_nursery() as nursery:
        await nursery.start(history.serve)
        metrics.requests.inc(model="m", status="200")
        changed = history.sampled.next()
        await changed.wait()
        # The first sample is the source's baseline: what it counted before is not a step's.
        assert [p["requests"] for p in history.view()["models"]["m"]] == [0, 1]
        nursery.cancel_scope.cancel()


def gateway(requests: int, errors: int = 0, seconds: float = 0.2) -> GatewayMetrics:
    metrics = GatewayMetrics()
    for _ in range(requests):
        metrics.requests.inc(model="m", status="200")
        metrics.latency.observe(seconds, model="m")
    for _ in range(errors):
        metrics.requests.inc(model="m", status="502")
    return metrics


def test_instances_add_up_each_from_its_own_baseline_and_one_that_returns_goes_on() -> None:
    """What gateway instances say in heartbeats: totals since each started. A step adds what each
    counted since the step before; a new one is a baseline, not a burst of all it ever did."""
    said: dict[str, GatewayMetrics] = {"a": gateway(5)}
    history = History(
        lambda: {name: totals_of_families(families_of(m.registry)) for name, m in said.items()}, step_s=10, window_s=60
    )
    history.sample(0.0)
    said = {"a": gateway(8), "b": gateway(100, errors=10)}  # b: a gateway back after the control plane restarted
    history.sample(10.0)
    assert history.view()["models"]["m"][-1]["requests"] == 3
    said = {"a": gateway(9), "b": gateway(104, errors=12)}
    history.sample(20.0)
    point = history.view()["models"]["m"][-1]
    assert point["requests"] == 1 + 6 and point["error_rate"] == pytest.approx(2 / 7, abs=1e-4)
    assert 0.1 < point["p50_s"] <= 0.25
    said = {"b": gateway(104, errors=12)}  # a's link is down for a step
    history.sample(30.0)
    assert history.view()["models"]["m"][-1]["requests"] == 0
    said = {"a": gateway(12), "b": gateway(104, errors=12)}  # a is back: it goes on from 9
    history.sample(40.0)
    assert history.view()["models"]["m"][-1]["requests"] == 3
