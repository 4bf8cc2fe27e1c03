"""Waiting in async tests: `await_true`, the one helper for "until this is true", bounded. (The
blocking poll of real processes beside a test, name first, is `testlib.cluster.wait_until`.)

A test waits on the event that makes the condition true: pass the `next` of the `Wakeup` (or
any callable giving the event of the next change) whose firing may make it so, and the
predicate is looked at again at each fire and at no other time. Where nothing announces the
change (a real process, the kernel, a file), it polls every `poll_s` (with `changed` too: at
each fire and at least that often) — on trio's MockClock that costs no real time. Either way
the bound is `timeout` (seconds of trio's clock, fake or real), and running out is an
AssertionError naming what was awaited, with `report()` if given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import trio

T = TypeVar("T")

NextEvent = Callable[[], trio.Event]


async def await_true(
    predicate: Callable[[], T],
    what: str,
    *,
    changed: NextEvent | Sequence[NextEvent] = (),
    timeout: float = 30.0,
    poll_s: float | None = None,
    report: Callable[[], str] | None = None,
) -> T:
    """Until `predicate()` gives something true, which is returned."""
    sources = [changed] if callable(changed) else list(changed)
    if poll_s is None and not sources:
        poll_s = 0.05
    try:
        with trio.fail_after(timeout):
            while True:
                events = [source() for source in sources]  # before looking: a change meanwhile is not lost
                if value := predicate():
                    return value
                with trio.move_on_after(poll_s if poll_s is not None else math.inf):
                    await _any(events)
    except trio.TooSlowError:
        detail = f"\n{report()}" if report is not None else ""
        raise AssertionError(f"{what}: not within {timeout:g} s{detail}") from None


async def _any(events: Sequence[trio.Event]) -> None:
    """Until one of `events` is set (with none: until cancelled)."""
    if any(e.is_set() for e in events):
        return
    if not events:
        await trio.sleep_forever()
    async with trio.open_nursery() as nursery:

        async def one(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(one, event)
