"""The steps of `llmgw node add`, in the order they run, and the events they emit.

Each step emits `started`, then exactly one of `ok`, `warn` or `failed`, with a detail; the
run stops at the first `failed`. Between the two, a long step may emit `progress` events (the
join, while the node installs llama.cpp), each with what it is doing now. The screens (a urwid checklist in a terminal, one line per
step elsewhere, or one JSON object per event) only draw these events, so what the operator
sees and what a script reads come from one place. `llmgw gateway add` runs its own list of steps
(llmgw.nodeadd.gateway.steps) through the same checklist and screens. Pure: no I/O here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs

STARTED, OK, WARN, FAILED = "started", "ok", "warn", "failed"
PROGRESS = "progress"  # a started step says what it is doing now; its status stays `started`
OUTCOMES = (OK, WARN, FAILED)

# (name, what the operator reads), in order. The authority is read before the node is touched.
STEPS: tuple[tuple[str, str], ...] = (
    ("authority", "read the certificate authority"),
    ("connect", "connect over SSH and verify the host key"),
    ("identify", "read the node's hostname and architecture"),
    ("address", "find the address the agent will dial, covered by the server certificate"),
    ("ship", "ship the release for the node's architecture and verify its sha256"),
    ("doctor", "run llmgw doctor on the node"),
    ("fabrics", "name the fabrics of the node's adapters"),
    ("identity", "make the node's key and CSR there, sign it here"),
    ("trust", "install the certificate and trust the CA root"),
    ("configure", "write agent.toml and the service"),
    ("start", "start the agent"),
    ("join", "wait for the node to join and install llama.cpp"),
)
NAMES = tuple(name for name, _ in STEPS)

Steps = tuple[tuple[str, str], ...]  # (name, what the operator reads), in order


@attrs.frozen(kw_only=True)
class Event:
    step: str
    status: str  # STARTED or one of OUTCOMES
    detail: str = ""


@attrs.define
class Checklist:
    """What has happened so far; `apply` enforces the order and the one-outcome rule."""

    events: list[Event] = attrs.Factory(list)
    status: dict[str, str] = attrs.Factory(dict)
    steps: Steps = STEPS

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


def plain_line(event: Event, steps: Steps = STEPS) -> str | None:
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
