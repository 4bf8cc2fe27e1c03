"""An engine install's progress on the link: the latest (phase, percent) the installer reported,
sent at most once a second, and at once when the phase changes.

The installer reports synchronously from its own task (`Latest.note`, a `OnProgress`): it must
never wait for the link. `serve_progress` runs beside the install, in the same nursery, and
sends what is latest when it may; reports that arrive faster are folded into the next one, so a
build printing a hundred lines a second costs one message a second. `Throttle` is the pure rule.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import attrs
import trio

from llmgw.wakeup import Wakeup

INTERVAL_S = 1.0


@attrs.define
class Throttle:
    interval_s: float = INTERVAL_S
    phase: str | None = None  # of the last report sent
    at: float = -math.inf  # when it was sent

    def delay(self, phase: str, now: float) -> float:
        """How long to hold a report of `phase`: nothing at a new phase, else what is left of the interval."""
        if phase != self.phase:
            return 0.0
        return max(0.0, self.at + self.interval_s - now)

    def sent(self, phase: str, now: float) -> None:
        self.phase, self.at = phase, now


class Latest:
    """What the installer said last. `note` is the installer's callback (synchronous, never blocks)."""

    def __init__(self) -> None:
        self.value: tuple[str, int | None] | None = None
        self.noted = Wakeup()
        self._notes = 0  # reports so far
        self._taken = 0  # reports `changed` has returned (the latest of them)

    def note(self, phase: str, percent: int | None) -> None:
        self.value = (phase, percent)
        self._notes += 1
        self.noted.fire()

    async def changed(self) -> tuple[str, int | None]:
        """The latest report, once there is one this has not returned yet (reports made while
        nobody waited are not lost: the latest of them is returned at once)."""
        while True:
            noted = self.noted.next()
            if self._taken < self._notes:
                break
            await noted.wait()
        self._taken = self._notes
        assert self.value is not None
        return self.value


async def serve_progress(
    latest: Latest,
    report: Callable[[str, int | None], Awaitable[None]],
    *,
    interval_s: float = INTERVAL_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Send what `latest` holds through `report`, throttled, until cancelled (when the install ends)."""
    throttle = Throttle(interval_s=interval_s)
    sent: tuple[str, int | None] | None = None
    task_status.started()
    while True:
        phase, _ = await latest.changed()
        with trio.move_on_after(throttle.delay(phase, trio.current_time())):
            while phase == throttle.phase:  # the same phase: wait out the interval, unless it changes
                phase, _ = await latest.changed()
        assert latest.value is not None
        if latest.value == sent:
            continue  # folded into the report already sent
        sent = phase, percent = latest.value
        await report(phase, percent)
        throttle.sent(phase, trio.current_time())
