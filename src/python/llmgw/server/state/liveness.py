"""The reconciler: notices every change of a node's liveness as it happens — including a loss no
message announces, at the deadline the registry names — and places replicas accordingly. It is
the one place that reconciles and pushes desired state after a change.

Each pass logs the liveness transitions, runs `Replicas.reconcile` and pushes the desired state
of every node whose assignments changed, and of the nodes a change asked for (`Changes`: an
operator's intent, a reload), then fires `changes.settled` (the spreader looks after it). It
waits for the next node change (`changes.nodes`) or the registry's next deadline.
`next_pass()` is for whoever posted a change and answers once it took effect (a reload, a
cordon): it returns once a pass that began after the call has ended, with the nodes whose
assignments that pass changed.

Time is liveness time (`registry.clock`): when the loop was stalled, the pass that wakes at a
deadline the stall carried it past reads the clock first, which credits the stall, so it finds
nobody's deadline passed yet and waits again for the moved one (`clock.loop_time`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable

import trio

from llmgw.log import get_logger
from llmgw.server.state.changes import Changes, rest
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas

log = get_logger("llmgw.server")

DEADLINE_GAP_S = 1.0


class Reconciler:
    def __init__(
        self,
        registry: NodeRegistry,
        replicas: Replicas,
        changes: Changes,
        push: Callable[[str], Awaitable[None]],
        connected: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        """`push(node)` sends a node its desired state; `connected()` names the nodes with a link
        (those a catalog change pushes to)."""
        self.registry = registry
        self.replicas = replicas
        self.changes = changes
        self.push = push
        self.connected = connected
        self._begun = 0  # passes begun, ever (a restart of `serve` keeps counting)
        self._ended = 0  # passes ended
        self._awaited: dict[int, _Awaited] = {}  # a pass `next_pass` waits for -> what it changed

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        clock = self.registry.clock
        task_status.started()
        # Woken at a deadline, the pass runs only if a node's liveness changed: with thousands of
        # nodes a deadline passes every moment (each heartbeat moves one), and a node that
        # heartbeated meanwhile changes nothing. The deadlines are looked at no more often than
        # this (a lost node is noticed that much after its TTL at most).
        gap = min(DEADLINE_GAP_S, self.registry.ttl / 10)
        woken = True  # by a change (and the first time)
        while True:
            changed = self.changes.nodes.next()  # before looking: a change during this pass is not lost
            now = clock.now()
            took = 0.0
            if woken or self.registry.any_transition(now):
                started = time.perf_counter()
                await self._pass(now)
                took = time.perf_counter() - started
            with trio.move_on_at(clock.loop_time(max(self.registry.next_deadline(now), now + gap))) as deadline:
                await changed.wait()
            woken = not deadline.cancelled_caught
            if woken and took and not self._awaited:  # someone waiting for a pass (a reload) gets it at once
                await rest(took)  # the changes meanwhile taken in one pass (`changes.rest`)

    async def _pass(self, now: float) -> None:
        self._begun += 1
        number = self._begun
        pushes, everyone = self.changes.take_pushes()
        try:
            for t in self.registry.transitions(now):
                log.info(f"node_{t.new}", node=t.node_id, was=t.old)
                self.changes.rotation.fire()
            placed = self.replicas.reconcile(now)
            if number in self._awaited:
                self._awaited[number].changed = set(placed)
            for node_id in sorted(placed | pushes | (set(self.connected()) if everyone else set())):
                await self.push(node_id)
        finally:
            self._ended = number
            self.changes.settled.fire()  # after the reconcile: the spreader sees its result

    async def next_pass(self) -> set[str]:
        """Wait for a pass that begins after this call to end; the nodes whose assignments it
        changed. (A pass that failed ends too: the answer is then empty, and the log says why.)"""
        number = self._begun + 1
        awaited = self._awaited.setdefault(number, _Awaited())
        awaited.waiters += 1
        try:
            while self._ended < number:
                await self.changes.settled.next().wait()
            return set(awaited.changed)
        finally:
            awaited.waiters -= 1
            if not awaited.waiters:
                del self._awaited[number]


class _Awaited:
    """One pass someone waits for: how many wait, and the nodes whose assignments it changed."""

    def __init__(self) -> None:
        self.waiters = 0
        self.changed: set[str] = set()
