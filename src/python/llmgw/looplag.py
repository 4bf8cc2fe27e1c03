"""Event-loop lag: how late a process's trio loop runs what is due, and the stall-aware clock
the control plane judges liveness on.

A trio loop runs one task step at a time. A step that computes for 2 s (a pathological
request), a blocking call made on the loop, or a process that does not run at all (SIGSTOP, an
overloaded machine, a suspended VM, another thread holding the GIL) holds every other task for
that long: nothing is read from any socket meanwhile. `serve_loop_lag` sleeps `INTERVAL_S` at a
time and records how late it woke (the *lag*), and what this thread did in that gap: the CPU
time it used (`time.thread_time()`) and, where Linux reports it, the time it waited for a CPU
(`/proc/thread-self/schedstat`). So a warning says which it was:

    busy               CPU time a quarter of the lag or more: a task held the loop computing
    waiting_for_cpu    else run-queue wait half of it or more: the machine (or cgroup) is full
    blocked_or_paused  neither: a blocking call on the loop, or the process was stopped

`LagMonitor` (pure: a wake-up in, metrics and maybe a warning out) keeps the figures for
`/metrics` and rate-limits the warnings: one line per `WARN_EVERY_S` at most, which says how many
lags it stands for. The figures (docs/gateway.md lists them):

    llmgw_event_loop_lag_seconds       histogram: each tick's lag
    llmgw_event_loop_busy_seconds      histogram: each tick's lag that this thread spent
                                       computing, min(lag, CPU time in the gap): an upper bound
                                       of the longest step that ran in that gap
    llmgw_event_loop_lag_max_seconds   gauge: the largest lag within the last WINDOW_S
    llmgw_event_loop_busy_max_seconds  gauge: the largest busy figure within the last WINDOW_S

`StallClock` (pure but for `now()`, which reads trio's clock) is *liveness time*: the loop's
clock less the time the loop could not run. Whoever reads it first after a stall — the ticker,
or a liveness pass or a silence timer that woke at a deadline the stall carried it past —
notices the gap since the last reading and credits it, so a heartbeat that waited in a socket
buffer during a stall is not counted as its node's silence.

Cost: one timer, two clock reads and a `pread` per tick (20 a second), nothing per task.

`StepTimer` is the exact measure, for diagnosis and for tests that must show no step held the
loop longer than a bound: a trio instrument that reads the thread's CPU time before and after
every task step (about a microsecond a step, so off unless asked for: server.toml's
`[debug] measure_steps`). It counts steps by how long each computed, whatever else the machine
did meanwhile:

    llmgw_event_loop_step_max_seconds  gauge: the longest task step since the process started
    llmgw_event_loop_long_steps_total  counter, by `over` (0.005, 0.02, 0.1 s): steps longer
"""

from __future__ import annotations

import collections
import math
import os
import time

import attrs
import trio

from llmgw.log import get_logger
from llmgw.metrics import MetricsRegistry

log = get_logger("llmgw.loop")

INTERVAL_S = 0.05  # the ticker's sleep
WARN_S = 0.5  # a lag from this long is logged
WARN_EVERY_S = 10.0  # at most one warning line per this long
WINDOW_S = 60.0  # the max gauges cover this long
# A tick later than this counts as a stall for liveness, less this much (so a loop that is merely
# slow, late by a fraction of a second at every tick, keeps counting time almost at full rate).
MIN_STALL_S = 0.25
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

BUSY, WAITING_FOR_CPU, BLOCKED_OR_PAUSED = "busy", "waiting_for_cpu", "blocked_or_paused"
WHAT = {
    BUSY: "a task held the loop computing (a slow request or loop); see which in the log lines around it",
    WAITING_FOR_CPU: "the process was ready but got no CPU: the machine or its cgroup is overloaded",
    BLOCKED_OR_PAUSED: (
        "the loop neither computed nor waited for a CPU: a blocking call on the loop (a lock, a disk, "
        "time.sleep), or the process was stopped (SIGSTOP, a suspended VM)"
    ),
}


@attrs.frozen(kw_only=True)
class Gap:
    """One tick: how late it woke, and what this thread did between going to sleep and waking."""

    lag_s: float
    cpu_s: float  # this thread's CPU time over the whole gap (the interval and the lag)
    wait_s: float | None = None  # time spent runnable but not running; None where Linux does not say

    @property
    def busy_s(self) -> float:
        return min(self.lag_s, self.cpu_s)

    @property
    def cause(self) -> str:
        # A loop with nothing to do uses next to no CPU, so a quarter of the lag spent computing
        # means a task held it, even if the machine gave it a CPU only part of that time (the
        # rest is then run-queue wait: both are in the warning).
        if self.cpu_s >= self.lag_s / 4:
            return BUSY
        if self.wait_s is not None and self.wait_s >= self.lag_s / 2:
            return WAITING_FOR_CPU
        return BLOCKED_OR_PAUSED


@attrs.frozen(kw_only=True)
class Lagged:
    """What one warning line says: the worst gap since the last line, and how many lags it stands for."""

    worst: Gap
    count: int


class _WindowMax:
    """The largest value observed within the last `window_s` (a monotonic deque: O(1) amortised)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._items: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, now: float, value: float) -> None:
        while self._items and self._items[-1][1] <= value:
            self._items.pop()
        self._items.append((now, value))
        self._expire(now)

    def get(self, now: float) -> float:
        self._expire(now)
        return self._items[0][1] if self._items else 0.0

    def _expire(self, now: float) -> None:
        while self._items and self._items[0][0] < now - self.window_s:
            self._items.popleft()


class LagMonitor:
    """The figures of a process's event-loop lag, and when to warn about it. Pure: `tick` is
    given the time and the gap; nothing here reads a clock."""

    def __init__(self, *, warn_s: float = WARN_S, warn_every_s: float = WARN_EVERY_S, window_s: float = WINDOW_S):
        self.warn_s, self.warn_every_s = warn_s, warn_every_s
        self.metrics = MetricsRegistry()
        self._lag = self.metrics.histogram(
            "llmgw_event_loop_lag_seconds",
            f"How late the event loop's {INTERVAL_S * 1000:g} ms timer woke: how long every task due then waited.",
            buckets=LAG_BUCKETS,
        )
        self._busy = self.metrics.histogram(
            "llmgw_event_loop_busy_seconds",
            "The part of each lag this thread spent computing, min(lag, CPU time in the gap): "
            "an upper bound of the longest task step that ran in it.",
            buckets=LAG_BUCKETS,
        )
        self._lag_max_gauge = self.metrics.gauge(
            "llmgw_event_loop_lag_max_seconds", f"The largest event-loop lag within the last {window_s:g} s."
        )
        self._busy_max_gauge = self.metrics.gauge(
            "llmgw_event_loop_busy_max_seconds",
            f"The largest busy figure (min(lag, CPU time in the gap)) within the last {window_s:g} s.",
        )
        self._lag_max = _WindowMax(window_s)
        self._busy_max = _WindowMax(window_s)
        self._worst: Gap | None = None  # since the last warning line
        self._count = 0
        self._next_warning_at = -math.inf

    def tick(self, now: float, gap: Gap) -> Lagged | None:
        """Record one tick; a warning to log, if one is due (at most one per `warn_every_s`)."""
        self._lag.observe(gap.lag_s)
        self._busy.observe(gap.busy_s)
        self._lag_max.add(now, gap.lag_s)
        self._busy_max.add(now, gap.busy_s)
        if gap.lag_s >= self.warn_s:
            self._count += 1
            if self._worst is None or gap.lag_s > self._worst.lag_s:
                self._worst = gap
        if self._worst is None or now < self._next_warning_at:
            return None
        lagged = Lagged(worst=self._worst, count=self._count)
        self._worst, self._count = None, 0
        self._next_warning_at = now + self.warn_every_s
        return lagged

    def lag_max(self, now: float) -> float:
        return self._lag_max.get(now)

    def busy_max(self, now: float) -> float:
        return self._busy_max.get(now)

    def render(self, now: float) -> str:
        self._lag_max_gauge.set(self.lag_max(now))
        self._busy_max_gauge.set(self.busy_max(now))
        return self.metrics.render()


class StallClock:
    """Liveness time: the loop's clock less the time the loop could not run.

    While a ticker watches the loop (`watch`), every reading notices the gap since the previous
    one (anyone's). A gap later than the ticker's interval by more than `min_stall_s` is a
    stall: that lateness, less `min_stall_s`, is credited, so liveness time goes on from where
    it was when the loop stopped. A stall of at least `hold_s` (one heartbeat interval: every
    live agent then has a heartbeat waiting in a socket buffer) also holds liveness time where
    the stall began until `hold_s` after the loop resumed, so those heartbeats are read before
    any silence counts again (a stall while held holds it `hold_s` after that one: the holds do
    not add up). Liveness time never goes backwards and never runs ahead of the loop's clock.

    Unwatched (no ticker, e.g. a test that starts no lag monitor), it is the loop's clock.
    """

    def __init__(self, *, interval_s: float = INTERVAL_S, min_stall_s: float = MIN_STALL_S, hold_s: float = 0.0):
        self.interval_s, self.min_stall_s, self.hold_s = interval_s, min_stall_s, hold_s
        self.stalled_s = 0.0  # credited so far (holds included, as they pass)
        self.stalls = 0
        self._last: float | None = None  # the previous reading, while watched
        self._floor = -math.inf  # the last liveness time given: it never goes back
        self._hold_until = -math.inf  # loop time until which liveness time stands still

    def watch(self, now: float) -> None:
        self._last = now

    def unwatch(self) -> None:
        self._last = None

    def observe(self, now: float) -> float:
        """The liveness time at loop time `now`, crediting a stall that ended just before it."""
        if self._last is not None:
            late = now - self._last - self.interval_s
            if late > self.min_stall_s:
                credit = late - self.min_stall_s
                self.stalled_s += credit
                self.stalls += 1
                if self.hold_s > 0 and credit >= self.hold_s:
                    self._hold_until = max(self._hold_until, now + self.hold_s)
            self._last = max(self._last, now)
        # Held: the loop time that passes up to `_hold_until` is credited as it passes.
        held_to = min(now, self._hold_until)
        if held_to - self.stalled_s > self._floor:
            self.stalled_s = held_to - self._floor
        self._floor = max(self._floor, now - self.stalled_s)
        return self._floor

    def now(self) -> float:
        return self.observe(trio.current_time())

    def loop_time(self, at: float) -> float:
        """The loop time at which liveness time reaches `at` (from the last reading), unless a stall
        comes first: a deadline for `trio.move_on_at`; whoever wakes at it reads `now()` again."""
        if math.isinf(at) or math.isinf(self._hold_until):  # no deadline, or never held
            return at + self.stalled_s
        return max(at + self.stalled_s, self._hold_until + (at - self._floor))

    def render(self) -> str:
        registry = MetricsRegistry()
        registry.counter(
            "llmgw_event_loop_stalled_seconds_total",
            "Time the event loop could not run that liveness does not count as any node's silence.",
        ).inc(self.stalled_s)
        registry.counter("llmgw_event_loop_stalls_total", "Stalls of the event loop liveness time skipped.").inc(
            self.stalls
        )
        return registry.render()


class _RunQueueWait:
    """This thread's time spent runnable but not running, from /proc/thread-self/schedstat (its
    second field, in ns); None where the kernel does not keep it."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> float | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


async def serve_loop_lag(
    monitor: LagMonitor,
    *,
    clock: StallClock | None = None,
    interval_s: float = INTERVAL_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Tick every `interval_s` until cancelled: each tick's gap goes to `monitor` (and its warning
    to the log), each wake-up to `clock`, which is watched while this runs. One per process: it
    measures the loop it runs on, whoever else runs there."""
    wait = _RunQueueWait()  # opened here: /proc/thread-self is the loop's thread
    try:
        if clock is not None:
            clock.watch(trio.current_time())
        task_status.started()
        while True:
            cpu, waited = time.thread_time(), wait.read()
            due = trio.current_time() + interval_s
            await trio.sleep_until(due)
            woke = trio.current_time()
            if clock is not None:
                clock.observe(woke)
            after = wait.read()
            gap = Gap(
                lag_s=max(0.0, woke - due),
                cpu_s=time.thread_time() - cpu,
                wait_s=after - waited if after is not None and waited is not None else None,
            )
            lagged = monitor.tick(woke, gap)
            if lagged is not None:
                warn(lagged)
    finally:
        if clock is not None:
            clock.unwatch()
        wait.close()


LONG_STEP_BOUNDS = (0.005, 0.02, 0.1)
LONG_STEP_LOG_S = 0.02  # a step longer than this is logged with its task's name


class StepTimer(trio.abc.Instrument):
    """The CPU time of every task step of the loop it is added to (`trio.lowlevel.add_instrument`),
    as the longest since start and counts over `LONG_STEP_BOUNDS`. A step's CPU time, not its
    wall time: a step the machine preempted is not counted as long."""

    def __init__(self) -> None:
        self.metrics = MetricsRegistry()
        self._max = self.metrics.gauge(
            "llmgw_event_loop_step_max_seconds", "The longest task step of the event loop since start (CPU time)."
        )
        self._long = self.metrics.counter(
            "llmgw_event_loop_long_steps_total",
            "Task steps of the event loop longer than `over` seconds (CPU time).",
            ("over",),
        )
        self.longest = 0.0
        self.window = 0.0  # the longest since `take_window` last read it
        self._started: float | None = None  # None: added in the middle of a step, not timed
        for bound in LONG_STEP_BOUNDS:
            self._long.inc(0, over=f"{bound:g}")
        self._max.set(0.0)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._started is None:
            return
        took = time.thread_time() - self._started
        self._started = None
        if took > LONG_STEP_LOG_S:
            log.info("event_loop_long_step", task=task.name, seconds=round(took, 4))
        if took > self.window:
            self.window = took
        if took > LONG_STEP_BOUNDS[0]:
            for bound in LONG_STEP_BOUNDS:
                if took > bound:
                    self._long.inc(over=f"{bound:g}")
        if took > self.longest:
            self.longest = took
            self._max.set(took)

    def take_window(self) -> float:
        """The longest step since the last call (a benchmark's per-request figure)."""
        window, self.window = self.window, 0.0
        return window

    def render(self) -> str:
        return self.metrics.render()


def warn(lagged: Lagged) -> None:
    worst = lagged.worst
    log.warning(
        "event_loop_lagged",
        lag_s=round(worst.lag_s, 3),
        cpu_s=round(worst.cpu_s, 3),
        runqueue_s=round(worst.wait_s, 3) if worst.wait_s is not None else None,
        cause=worst.cause,
        what=WHAT[worst.cause],
        lags=lagged.count,  # at least WARN_S each, since the last such line
    )
