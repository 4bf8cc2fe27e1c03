"""The checklist every onboarding flow reports to: the events its steps emit, and the rules of
their order.

Each step emits `started`, then exactly one of `ok`, `warn` or `failed`, with a detail; the
run stops at the first `failed`. Between the two, a long step may emit `progress` events (node
add's join, while the node installs llama.cpp), each with what it is doing now. The screens (a
urwid checklist in a terminal, one line per step elsewhere, or one JSON object per event) only
draw these events, so what the operator sees and what a script reads come from one place. Each
flow names its own steps (`Steps`: llmgw.nodeadd.node.steps, .gateway.steps, .server.steps),
drawn by the same checklist and screens. Pure: no I/O here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs

STARTED, OK, WARN, FAILED = "started", "ok", "warn", "failed"
PROGRESS = "progress"  # a started step says what it is doing now; its status stays `started`
OUTCOMES = (OK, WARN, FAILED)

Steps = tuple[tuple[str, str], ...]  # (name, what the operator reads), in order


@attrs.frozen(kw_only=True)
class Event:
    step: str
    status: str  # STARTED or one of OUTCOMES
    detail: str = ""


@attrs.define(kw_only=True)
class Checklist:
    """What has happened so far of a flow's `steps`; `apply` enforces the order and the
    one-outcome rule."""

    steps: Steps
    events: list[Event] = attrs.Factory(list)
    status: dict[str, str] = attrs.Factory(dict)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.steps)

    def apply(self, event: Event) -> None:
        names = self.names
        if event.step not in names:
            raise ValueError(f"unknown step {event.step!r}")  # a bug in the caller
        if self.failed is not None:
            raise ValueError(f"step {event.step!r} after {self.failed!r} failed")
        current = self.status.get(event.step)
        if event.status == PROGRESS:
            if current != STARTED:
                raise ValueError(f"step {event.step!r} reported progress while not running")
            self.events.append(event)
            return
        if event.status == STARTED:
            if current is not None:
                raise ValueError(f"step {event.step!r} started twice")
            done = [n for n in names[: names.index(event.step)] if self.status.get(n) not in OUTCOMES]
            if done:
                raise ValueError(f"step {event.step!r} started before {done[0]!r} finished")
        elif event.status in OUTCOMES:
            if current != STARTED:
                raise ValueError(f"step {event.step!r} finished without starting")
        else:
            raise ValueError(f"unknown status {event.status!r}")
        self.status[event.step] = event.status
        self.events.append(event)

    @property
    def failed(self) -> str | None:
        return next((n for n in self.names if self.status.get(n) == FAILED), None)

    @property
    def done(self) -> bool:
        return self.failed is not None or all(self.status.get(n) in OUTCOMES for n in self.names)


def plain_line(event: Event, steps: Steps) -> str | None:
    """One line per finished step (`started` prints nothing), e.g. `ok     connect  ubuntu@10.0.0.21`,
    and one per progress report, e.g. `..     join       installing llama.cpp 40% (build)`."""
    if event.status == STARTED:
        return None
    if event.status == PROGRESS:
        return f"{'..':<6} {event.step:<10} {event.detail}"
    text = f"{event.status:<6} {event.step:<10} {dict(steps)[event.step]}"
    return f"{text}: {event.detail}" if event.detail else text


def json_line(event: Event) -> str:
    return json.dumps({"step": event.step, "status": event.status, "detail": event.detail})


def summary(checklist: Checklist) -> Sequence[str]:
    return [f"{checklist.status.get(n, 'pending'):<7} {text}" for n, text in checklist.steps]
