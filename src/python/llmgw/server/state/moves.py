"""Moving replicas without an outage: drains, and spreading replicas that share a node.

A move is always the same four steps, for one replica:

1. a replacement is placed where the scheduler allows, on top of the catalog's count;
2. it becomes ready (or the move stops, the replacement is withdrawn, the original stays);
3. the original leaves the gateway's rotation (marked draining) and the requests already on
   it finish, for at most `retire_grace_s` — a stream in flight is not cut by a move: the
   control plane waits for every gateway, its own workers and the standalone ones, to say so
   (`GatewayFeed.quiesce`);
4. the original stops, and the replacement counts as one of the catalog's.

`llmgw ctl drain NODE` moves everything off a node, then cordons it. Spreading is automatic:
nodes join one at a time, so the first to join gets every replica of a model, and a second
replica on the same machine protects against nothing. Whenever the cluster changes, the
spreader looks for a replica sharing a node with another of its model while a schedulable
node holds none, and moves it there — the same move, so it costs no request. The spreader
makes its moves in waves: one look over the cluster places a replacement for up to
`spread_at_once` crowded replicas, each on a node that holds none of its model, and the wave's
moves go on together (a thousand nodes joining at once leave hundreds crowded on the first).

Drains run in `llmgw.server.state.drains`, and rollouts (a changed model's replicas replaced one
by one) in `llmgw.server.state.rollouts`; both call `replace` and `retire` here, one move at a
time; a drain's move, a rollout's and a spreading wave never run together (`lock`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import trio

from llmgw.log import get_logger
from llmgw.metrics import MetricsRegistry
from llmgw.server.state.changes import Changes, rest
from llmgw.server.state.placements import Stored
from llmgw.server.state.registry import LOST, NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.server.state.scheduler import crowded
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w

log = get_logger("llmgw.moves")

READY_TIMEOUT_S = 600.0  # a replacement's weights may take long to fetch and load
RETIRE_GRACE_S = 60.0  # requests on the original may finish for this long after it leaves rotation
SPREAD_RETRY_S = 300.0  # after a spreading move that failed, leave that model alone this long
LOST_LOOK_S = 5.0  # a move waiting for its replacement looks this often whether the replacement's node was lost
# Spreading moves made together, in one wave: a thousand nodes joining at once leave hundreds of
# replicas crowded on the first (the bench of issue 31: 875 of 1,000), and one at a time took
# minutes, each move a look over the whole cluster.
SPREAD_AT_ONCE = 32


class MoveFailed(Exception):
    """A move stopped; the original keeps running. The message says why, for the operator;
    `replacement`, `nodes` and `why` are its parts (a rollout says them its own way)."""

    def __init__(self, message: str, *, replacement: str = "", nodes: tuple[str, ...] = (), why: str = "") -> None:
        super().__init__(message)
        self.replacement = replacement
        self.nodes = nodes
        self.why = why


class Moves:
    """One move at a time (`lock`), for the drains and the spreader; `retiring` are the originals
    out of the gateway's rotation whose requests are finishing."""

    def __init__(
        self,
        *,
        replicas: Replicas,
        registry: NodeRegistry,
        quiesce: Callable[[str, float], Awaitable[bool]],
        outstanding: Callable[[str], int],
        changes: Changes,
        push: Callable[[str], Awaitable[None]],
        draining: Callable[[], bool],
        retiring: set[str] | None = None,
    ) -> None:
        """`retiring`: the set this keeps of the originals out of rotation (the gateway's
        endpoints read the same set). `quiesce(replica, timeout_s)`: until no gateway has a
        request on the replica, whether it got there; `outstanding(replica)`: how many they have."""
        self.replicas = replicas
        self.registry = registry
        self.quiesce = quiesce
        self.outstanding = outstanding
        self.changes = changes
        self._push_one = push  # a node's desired state to its agent
        self._draining = draining  # whether a drain is running: the spreader waits for it
        self.ready_timeout_s = READY_TIMEOUT_S
        self.retire_grace_s = RETIRE_GRACE_S
        self.spread_retry_s = SPREAD_RETRY_S
        self.spread_at_once = SPREAD_AT_ONCE
        self.retiring: set[str] = retiring if retiring is not None else set()
        self.lock = trio.Lock()  # one move (or spreading wave) at a time, drains and spreading together
        self.reported = Wakeup()  # an agent reported its replicas: a replacement may be ready
        self._spread_failed_at: dict[str, float] = {}  # model -> when its last spreading move failed
        self.metrics = MetricsRegistry()
        self._ended = self.metrics.counter(
            "llmgw_replica_moves_total",
            "Moves of a replica (a drain's or spreading's) that ended, by outcome: done (the "
            "replacement ready, the original stopped) or failed (the replacement not ready in time, "
            "or its node lost; the original runs on).",
            ("outcome",),
        )
        self._under_way = self.metrics.gauge(
            "llmgw_replica_moves_in_progress", "Moves under way: a replacement placed, its original not yet stopped."
        )

    def render_metrics(self) -> str:
        self._under_way.set(len(self.replicas.surge))
        return self.metrics.render()

    def replicas_changed(self) -> None:
        """Called when an agent reports replica states: a replacement may have become ready."""
        self.reported.fire()

    # -- one move ---------------------------------------------------------------------------

    async def _push(self, nodes: Iterable[str]) -> None:
        for n in nodes:
            await self._push_one(n)

    def _member_state(self, replica_id: str, node_id: str) -> str | None:
        node = self.registry.nodes.get(node_id)
        s = next((s for s in node.replicas if s.replica_id == replica_id), None) if node else None
        return s.state if s else None

    async def _wait_ready(self, replica_id: str, nodes: tuple[str, ...]) -> str:
        """Until the replacement is ready on its rank 0 (""), or why not: its time is over, a
        member's agent gave up on it (reported it failed: the placement is gone), or a node of it
        was lost or removed (looked at with each report, and every LOST_LOOK_S)."""
        with trio.move_on_after(self.ready_timeout_s):
            while True:
                reported = self.reported.next()
                if self._member_state(replica_id, nodes[0]) == w.READY:
                    return ""
                gone = self._failed(replica_id, nodes) or self._gone(nodes)
                if gone:
                    return gone
                with trio.move_on_after(LOST_LOOK_S):
                    await reported.wait()
        return f"did not become ready within {self.ready_timeout_s:g} s"

    def _failed(self, replica_id: str, nodes: tuple[str, ...]) -> str:
        """Why the replacement failed, once a member's agent gave up on it ("" while none did)."""
        if replica_id in self.replicas.placed:
            return ""
        for n in nodes:
            node = self.registry.nodes.get(n)
            status = next((s for s in node.replicas if s.replica_id == replica_id), None) if node else None
            if status is not None and status.state == w.FAILED:
                return f"failed: {w.brief_detail(status.detail) if status.detail else 'its agent gave up on it'}"
        return "was withdrawn (its model or its nodes changed)"

    def _gone(self, nodes: tuple[str, ...]) -> str:
        now = self.registry.clock.now()
        for n in nodes:
            node = self.registry.nodes.get(n)
            if node is None:
                return f"lost its node {n}: removed"
            if self.registry.liveness(node, now) == LOST:
                return f"lost its node {n}: no heartbeat within its TTL"
        return ""

    async def replace(self, replica_id: str, replacement: Stored) -> None:
        """Steps 2-4 for a replacement already placed; `MoveFailed` if it never got ready."""
        new = replacement.placement
        await self._push(new.nodes)
        why = await self._wait_ready(new.replica_id, new.nodes)
        if why:
            self.replicas.retire(new.replica_id, new.replica_id)
            self._ended.inc(outcome="failed")
            await self._push(new.nodes)
            raise MoveFailed(
                f"the replacement {new.replica_id} on {','.join(new.nodes)} of {replica_id} {why}; {replica_id} keeps running "
                "(`llmgw ctl replicas` says why)",
                replacement=new.replica_id,
                nodes=new.nodes,
                why=why,
            )
        log.info("move_replacement_ready", replica=replica_id, replacement=new.replica_id, on=list(new.nodes))
        await self.retire(replica_id, new.replica_id)
        self._ended.inc(outcome="done")

    async def retire(self, replica_id: str, replacement_id: str | None, then: Callable[[], None] | None = None) -> None:
        """Steps 3-4: out of rotation, its requests finish (bounded), then it stops. `then()` is
        called just before it leaves the placements, with nothing awaited between (a scale-down
        lowers its model's count there: `llmgw.server.state.autoscale`)."""
        original = self.replicas.placed.get(replica_id)
        if original is None:
            return
        async with self._out_of_rotation(replica_id):
            if then is not None:
                then()
            self.replicas.retire(replica_id, replacement_id)
        await self._push(original.placement.nodes)
        log.info("move_original_stopped", replica=replica_id, replacement=replacement_id)

    async def park(self, replica_id: str, then: Callable[[], None]) -> None:
        """A scale-down that parks: out of rotation, its requests finish (bounded), then its
        engine is told to park its model (`Replicas.parked`, which keeps it out of rotation until
        woken). `then()` is called just before, with nothing awaited between."""
        original = self.replicas.placed.get(replica_id)
        if original is None:
            return
        async with self._out_of_rotation(replica_id):
            then()
            self.replicas.parked.add(replica_id)
        await self._push(original.placement.nodes)
        log.info("replica_parking", replica=replica_id, model=original.placement.model)

    @contextlib.asynccontextmanager
    async def _out_of_rotation(self, replica_id: str) -> AsyncIterator[None]:
        """Out of the gateways' rotation (marked retiring) until every request on it finished, or
        `retire_grace_s`; the body runs then, and it is no longer marked after."""
        self.retiring.add(replica_id)
        self.changes.rotation.fire()
        try:
            finished = await self.quiesce(replica_id, self.retire_grace_s)
            if not finished:
                log.warning(
                    "move_retire_grace_over",
                    replica=replica_id,
                    after_s=self.retire_grace_s,
                    outstanding=self.outstanding(replica_id),
                )
            yield
        finally:
            self.retiring.discard(replica_id)
            self.changes.rotation.fire()

    # -- spreading --------------------------------------------------------------------------

    async def serve_spread(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Whenever the cluster changes, move one crowded replica if a node is free for it."""
        task_status.started()
        while True:
            changed = self.changes.settled.next()
            started = time.perf_counter()
            moved = await self.spread_once()
            if not moved:
                # Rested like the reconciler whose passes wake it (`changes.rest`): a look over
                # thousands of nodes after each pass would double what passes cost.
                await rest(time.perf_counter() - started)
                with trio.move_on_after(self._next_retry()):
                    await changed.wait()

    def _next_retry(self) -> float:
        now = trio.current_time()
        waits = [at + self.spread_retry_s - now for at in self._spread_failed_at.values()]
        return max(0.0, min(waits)) if waits else math.inf

    async def spread_once(self) -> bool:
        """One wave of spreading moves, if one would help (up to `spread_at_once`, made together:
        each replacement goes to a node that holds no replica of its model, so their loads
        share nothing); whether a move was made."""
        replicas = self.replicas
        now, live_now = trio.current_time(), self.registry.clock.now()  # retries; liveness
        if self._draining():
            return False  # a drain is moving things: let it finish first
        if not replicas.placed:
            return False  # nothing to spread (and no node's view to build: a cluster still joining)
        candidates = [
            rid
            for rid in crowded(replicas.node_views(live_now), [s.placement for s in replicas.placed.values()])
            if not self._resting(replicas.placed[rid].placement.model, now)
        ]
        if not candidates:
            return False
        async with self.lock:
            wave = []
            proposals = replicas.propose_spread([r for r in candidates if r in replicas.placed], live_now)
            holding = replicas.holding()
            for rid, proposal in proposals:
                if len(wave) == self.spread_at_once:
                    break
                taken = holding.setdefault(proposal.model, set())
                if taken & set(proposal.nodes):
                    continue  # no free node would take it: staying crowded is better than nothing
                taken.update(proposal.nodes)
                wave.append((rid, replicas.add_surge(proposal)))
                log.info("spread_started", replica=rid, model=proposal.model, to=list(proposal.nodes))
            if not wave:
                return False
            moved: list[bool] = []
            async with trio.open_nursery() as nursery:
                for rid, replacement in wave:
                    nursery.start_soon(self._spread, rid, replacement, moved)
        return any(moved)

    def _resting(self, model: str, now: float) -> bool:
        failed_at = self._spread_failed_at.get(model)
        return failed_at is not None and now < failed_at + self.spread_retry_s

    async def _spread(self, replica_id: str, replacement: Stored, moved: list[bool]) -> None:
        model = replacement.placement.model
        try:
            await self.replace(replica_id, replacement)
        except MoveFailed as exc:
            self._spread_failed_at[model] = trio.current_time()
            log.warning("spread_failed", replica=replica_id, reason=str(exc), retry_in_s=self.spread_retry_s)
            moved.append(False)
            return
        if not self._resting(model, trio.current_time()):
            self._spread_failed_at.pop(model, None)
        moved.append(True)
