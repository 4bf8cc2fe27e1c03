"""Event-loop lag: the pure monitor and stall clock on given times, the ticker on MockClock."""

from __future__ import annotations

import random
import time
from functools import partial

import pytest
import trio
import trio.testing

from llmgw import looplag
from llmgw.looplag import (
    BLOCKED_OR_PAUSED,
    BUSY,
    INTERVAL_S,
    MIN_STALL_S,
    WAITING_FOR_CPU,
    WARN_EVERY_S,
    WINDOW_S,
    Gap,
    LagMonitor,
    StallClock,
    serve_loop_lag,
)


def metric(text: str, name: str) -> float:
    """The value of one sample line (`name` with its labels, if any) of a Prometheus text."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.rsplit(" ", 1)[0] == name]
    assert len(values) == 1, (name, text)
    return values[0]


# -- what a gap says -------------------------------------------------------------------------


def test_a_gap_says_whether_the_loop_computed_waited_for_a_cpu_or_neither() -> None:
    assert Gap(lag_s=2.0, cpu_s=2.03).cause == BUSY
    # Computing on a full machine (measured: 6 s held, 2.9 s CPU, 3.1 s waiting for one): a task held it.
    assert Gap(lag_s=6.0, cpu_s=2.9, wait_s=3.1).cause == BUSY
    assert Gap(lag_s=2.0, cpu_s=0.01, wait_s=1.9).cause == WAITING_FOR_CPU
    assert Gap(lag_s=2.0, cpu_s=0.01, wait_s=0.0).cause == BLOCKED_OR_PAUSED  # time.sleep, SIGSTOP
    assert Gap(lag_s=2.0, cpu_s=0.01).cause == BLOCKED_OR_PAUSED  # no schedstat: cannot tell the two apart
    # The busy figure is the CPU-corrected lag: the lag of a process that was not running is not
    # a task holding the loop, and the CPU of a loop that was on time is no lag.
    assert Gap(lag_s=2.0, cpu_s=0.01).busy_s == 0.01
    assert Gap(lag_s=0.0005, cpu_s=0.03).busy_s == 0.0005


# -- the monitor -----------------------------------------------------------------------------


def test_ticks_on_time_warn_nothing_and_are_counted() -> None:
    m = LagMonitor()
    for i in range(100):
        assert m.tick(i * INTERVAL_S, Gap(lag_s=0.0002, cpu_s=0.001)) is None
    text = m.render(100 * INTERVAL_S)
    assert metric(text, "llmgw_event_loop_lag_seconds_count") == 100
    assert metric(text, 'llmgw_event_loop_lag_seconds_bucket{le="0.001"}') == 100
    assert metric(text, "llmgw_event_loop_busy_seconds_count") == 100
    assert metric(text, "llmgw_event_loop_lag_max_seconds") == pytest.approx(0.0002)
    assert "# TYPE llmgw_event_loop_busy_max_seconds gauge" in text


def test_a_lag_warns_at_once_then_at_most_once_per_interval_with_the_worst_and_the_count() -> None:
    m = LagMonitor()
    first = m.tick(1.0, Gap(lag_s=0.8, cpu_s=0.8))
    assert first is not None and first.count == 1 and first.worst.lag_s == 0.8
    assert m.tick(2.0, Gap(lag_s=3.0, cpu_s=0.0)) is None  # within WARN_EVERY_S: held back
    assert m.tick(3.0, Gap(lag_s=0.6, cpu_s=0.6)) is None
    assert m.tick(4.0, Gap(lag_s=0.001, cpu_s=0.0)) is None  # on time: no lag to count
    # The first tick after the interval says what was held back, even if it was itself on time.
    later = m.tick(1.0 + WARN_EVERY_S, Gap(lag_s=0.001, cpu_s=0.0))
    assert later is not None and later.count == 2 and later.worst == Gap(lag_s=3.0, cpu_s=0.0)
    assert later.worst.cause == BLOCKED_OR_PAUSED
    assert m.tick(2.0 + WARN_EVERY_S, Gap(lag_s=0.001, cpu_s=0.0)) is None  # nothing left to say


def test_the_max_gauges_cover_the_last_window_and_the_busy_one_is_cpu_corrected() -> None:
    m = LagMonitor()
    m.tick(10.0, Gap(lag_s=5.0, cpu_s=0.0))  # not running: a lag, but no task held the loop
    m.tick(11.0, Gap(lag_s=0.03, cpu_s=0.05))  # a 30 ms step
    m.tick(12.0, Gap(lag_s=0.001, cpu_s=0.0))
    assert (m.lag_max(12.0), m.busy_max(12.0)) == (5.0, 0.03)
    text = m.render(12.0)
    assert metric(text, "llmgw_event_loop_lag_max_seconds") == 5.0
    assert metric(text, "llmgw_event_loop_busy_max_seconds") == 0.03
    # A test asserting "no step held the loop for more than 20 ms" counts busy ticks above 0.02.
    above = metric(text, "llmgw_event_loop_busy_seconds_count") - metric(
        text, 'llmgw_event_loop_busy_seconds_bucket{le="0.02"}'
    )
    assert above == 1
    assert m.lag_max(10.0 + WINDOW_S + 0.5) == 0.03  # the 5 s lag has left the window
    assert (m.lag_max(11.0 + WINDOW_S + 0.5), m.busy_max(11.0 + WINDOW_S + 0.5)) == (0.001, 0.0)
    assert m.lag_max(100 * WINDOW_S) == 0.0


# -- the stall clock -------------------------------------------------------------------------


def ticks(clock: StallClock, start: float, end: float, step: float = INTERVAL_S) -> float:
    """The ticker observing the clock every `step` from `start` to `end`; the last liveness time."""
    t, live = start, clock.observe(start)
    while t + step <= end + 1e-9:
        t += step
        live = clock.observe(t)
    return live


def test_unwatched_or_on_time_the_clock_is_the_loops() -> None:
    clock = StallClock(hold_s=5)
    assert clock.observe(10.0) == 10.0
    assert clock.observe(70.0) == 70.0  # no ticker: a gap is no evidence of a stall
    clock.watch(70.0)
    assert ticks(clock, 70.0, 80.0) == pytest.approx(80.0)
    # Late ticks, each less than MIN_STALL_S late: a slow loop, still reading its links.
    assert ticks(clock, 80.0, 90.0, step=INTERVAL_S + MIN_STALL_S * 0.9) == pytest.approx(90.0, abs=0.3)
    assert clock.stalls == 0 and clock.stalled_s == 0.0


def test_a_stall_is_credited_and_liveness_time_goes_on_from_where_it_stopped() -> None:
    clock = StallClock(hold_s=0)
    clock.watch(0.0)
    assert ticks(clock, 0.0, 10.0) == pytest.approx(10.0)
    after = clock.observe(52.0)  # nothing ran for 42 s (the request that once held a loop so long)
    assert after == pytest.approx(10.0 + INTERVAL_S + MIN_STALL_S)
    assert clock.stalled_s == pytest.approx(42.0 - INTERVAL_S - MIN_STALL_S) and clock.stalls == 1
    assert ticks(clock, 52.0, 62.0) == pytest.approx(after + 10.0)  # then it runs with the loop again
    # A deadline in liveness time, as trio needs it: liveness time reaches `at` then.
    at = after + 20.0
    assert ticks(clock, 62.0, clock.loop_time(at)) == pytest.approx(at)


def test_a_stall_of_a_heartbeat_interval_or_more_holds_liveness_time_for_one_interval() -> None:
    """Every live agent has a heartbeat waiting in a socket buffer: it is read before silence counts again."""
    hold = 5.0
    clock = StallClock(hold_s=hold)
    clock.watch(0.0)
    before = ticks(clock, 0.0, 10.0)
    assert clock.observe(40.0) == before  # resumed where it stopped, and held there
    assert clock.loop_time(before + 1.0) == pytest.approx(40.0 + hold + 1.0)
    assert ticks(clock, 40.0, 40.0 + hold - 0.01) == before
    assert ticks(clock, 40.0 + hold - 0.01, 40.0 + hold + 10.0) == pytest.approx(before + 10.0, abs=0.02)
    assert clock.stalled_s == pytest.approx(30.0 + hold, abs=0.02) and clock.stalls == 1
    # Another stall, and one begun while that one held: held one interval after the last, no longer.
    clock.observe(62.0)
    held = ticks(clock, 62.0, 63.5)
    clock.observe(70.0)
    assert clock.stalls == 3 and ticks(clock, 70.0, 70.0 + hold - 0.01) == held
    assert ticks(clock, 70.0 + hold - 0.01, 70.0 + hold + 1.0) == pytest.approx(held + 1.0, abs=0.02)
    # A shorter stall leaves each node at least its TTL less one interval to be read: no hold.
    short = StallClock(hold_s=hold)
    short.watch(0.0)
    ticks(short, 0.0, 10.0)
    assert short.observe(13.0) == pytest.approx(13.0 - (3.0 - INTERVAL_S - MIN_STALL_S))


def test_liveness_time_never_goes_back_nor_runs_ahead_of_the_loop() -> None:
    rng = random.Random(24)
    for hold in (0.0, 0.2, 5.0):
        clock = StallClock(hold_s=hold)
        clock.watch(0.0)
        t, live = 0.0, 0.0
        for _ in range(5000):
            # Mostly ticks, sometimes a late one, now and then a stall of up to a minute, and
            # readings by other tasks between ticks.
            t += rng.choice([INTERVAL_S, INTERVAL_S, 0.001, 0.2, 0.4, rng.uniform(0, 60)])
            new = clock.observe(t)
            assert live <= new <= t + 1e-9
            assert t - new == pytest.approx(clock.stalled_s)  # behind the loop by what was credited
            live = new


# -- the ticker ------------------------------------------------------------------------------


@pytest.mark.trio
async def test_the_ticker_notices_a_stall_warns_once_and_credits_the_clock(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING")
    monitor, clock = LagMonitor(), StallClock(hold_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_loop_lag, monitor, clock=clock))
        await trio.sleep(5)
        assert [r for r in caplog.records if r.getMessage() == "event_loop_lagged"] == []
        assert monitor.lag_max(trio.current_time()) == pytest.approx(0.0, abs=1e-6)
        autojump_clock.jump(30)  # the loop held: this task ran for 30 s of the clock without yielding
        await trio.sleep(2)
        warnings = [r.llmgw_fields for r in caplog.records if r.getMessage() == "event_loop_lagged"]
        assert len(warnings) == 1, warnings
        assert warnings[0]["lag_s"] == pytest.approx(30, abs=INTERVAL_S + 0.01)
        assert warnings[0]["lags"] == 1
        # A jump of the clock uses no CPU and waits for none: as a SIGSTOP, it "neither computed nor waited".
        assert warnings[0]["cause"] == BLOCKED_OR_PAUSED
        # All of it credited (held where it began), and the hold of 1 s after it.
        assert clock.stalls == 1 and clock.stalled_s == pytest.approx(30 + 1.0, abs=INTERVAL_S + 0.01)
        assert monitor.lag_max(trio.current_time()) == pytest.approx(30, abs=INTERVAL_S + 0.01)
        nursery.cancel_scope.cancel()
    # Stopped: no ticker vouches for the gaps any more, so none is taken for a stall.
    stalled = clock.stalled_s
    clock.observe(trio.current_time() + 100)
    assert clock.stalled_s == stalled


def test_the_step_timer_counts_each_steps_cpu_time() -> None:
    timer = looplag.StepTimer()

    async def main() -> None:
        trio.lowlevel.add_instrument(timer)
        await trio.lowlevel.checkpoint()
        started = time.thread_time()
        while time.thread_time() - started < 0.03:  # one step computing 30 ms
            pass
        await trio.lowlevel.checkpoint()
        trio.lowlevel.remove_instrument(timer)

    trio.run(main)
    assert timer.longest >= 0.03 and timer.take_window() >= 0.03 and timer.take_window() == 0.0
    text = timer.render()
    assert 'llmgw_event_loop_long_steps_total{over="0.02"} 1' in text
    assert 'llmgw_event_loop_long_steps_total{over="0.1"} 0' in text
