"""Drains: `llmgw ctl drain NODE` moves every replica off a node, one at a time, then cordons it.

`Drains.start` (the admin API's call) checks the node, marks it draining (through the node
intent's owner, `llmgw.server.state.intent`: the store first, so a refusal changes nothing), makes its
`DrainProgress` and sends the drain on a channel;
`Drains.serve` receives each and runs it as a job in its own nursery, until it is done, stops
(no room for a replacement, one that never got ready) or the control plane stops. A node has at
most one drain running: asking again returns the running one's progress.

A drain is a job, not a loop: a bug in one ends that drain with an error saying so (the admin
API shows it), never the control plane, and the operator runs it again. Each move is
`llmgw.server.state.moves`' (replacement ready before the original stops), one at a time with the
spreader (`Moves.lock`); at its end the node is cordoned, again through the intent's owner.
`Drains` is also the read-only mapping node -> its last drain's progress, and each progress has
an event to wait on (`DrainProgress.finished`: set once, when the drain is done or stopped).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import trio

from llmgw.errors import leaves
from llmgw.log import get_logger
from llmgw.server.errors import StoreError, UnknownNode
from llmgw.server.state.intent import NodeIntent
from llmgw.server.state.moves import MoveFailed, Moves
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas

log = get_logger("llmgw.moves")  # drains were moves' until they had a module of their own


@attrs.define(kw_only=True)
class DrainProgress:
    """One node's drain as the admin API shows it (`view()`), updated as it goes."""

    node: str
    total: int
    moved: int = 0
    current: str | None = None
    done: bool = False
    error: str | None = None
    finished: trio.Event = attrs.field(factory=trio.Event, repr=False)  # set once: done, or stopped with an error

    @property
    def running(self) -> bool:
        return not self.done and self.error is None

    def stop(self, error: str) -> None:
        self.error = error
        self.finished.set()

    def complete(self) -> None:
        self.current, self.done = None, True
        self.finished.set()

    def view(self) -> dict[str, Any]:
        return attrs.asdict(self, filter=lambda a, _: a.name != "finished")


@attrs.frozen(kw_only=True)
class DrainRequest:
    """What `start` sends the drains service (the replicas to move are those on the node once the
    drain holds the moves' lock)."""

    force: bool
    progress: DrainProgress


class Drains(Mapping[str, DrainProgress]):
    def __init__(self, *, registry: NodeRegistry, intent: NodeIntent, replicas: Replicas, moves: Moves) -> None:
        self.registry = registry
        self.intent = intent
        self.replicas = replicas
        self.moves = moves
        self._progress: dict[str, DrainProgress] = {}
        self._send, self._receive = trio.open_memory_channel[DrainRequest](0)
        self._serving = False

    # -- the mapping: node -> progress of its last drain ------------------------------------

    def __getitem__(self, node_id: str) -> DrainProgress:
        return self._progress[node_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._progress)

    def __len__(self) -> int:
        return len(self._progress)

    def running(self) -> bool:
        return any(d.running for d in self._progress.values())

    # -- asking for one ---------------------------------------------------------------------

    async def start(self, node_id: str, *, force: bool) -> DrainProgress:
        """Start draining `node_id` (`UnknownNode` if it is not known); its progress, updated as
        the drain goes. Returns once the drains service has the drain."""
        node = self.registry.nodes.get(node_id)
        if node is None:
            raise UnknownNode(node_id, sorted(self.registry.nodes))
        if not self._serving:
            raise RuntimeError("Drains.start before Drains.serve runs")
        current = self._progress.get(node_id)
        if current is not None and current.running:
            return current
        await self.intent.start_draining(node)
        todo = self._on_node(node_id)
        progress = self._progress[node_id] = DrainProgress(node=node_id, total=len(todo))
        log.info("drain_started", node=node_id, replicas=list(todo), force=force)
        await self._send.send(DrainRequest(force=force, progress=progress))
        return progress

    def _on_node(self, node_id: str) -> tuple[str, ...]:
        return tuple(sorted(k for k, v in self.replicas.placed.items() if node_id in v.placement.nodes))

    # -- running them -----------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Receive drains and run each in this nursery until it is done, stops or we are cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._serving = True
                task_status.started()
                async for request in self._receive:
                    await nursery.start(self._run, request)
        finally:
            self._serving = False

    async def _run(self, request: DrainRequest, *, task_status: trio.TaskStatus[None]) -> None:
        """One drain, whose failure stays its own: a bug ends this drain with an error saying so."""
        task_status.started()
        progress = request.progress
        try:
            async with self.moves.lock:
                await self._drain(request)
        except Exception as exc:
            log.exception("drain_failed", node=progress.node, replica=progress.current)
            progress.stop(
                f"internal error while draining {progress.node}: {leaves(exc)[0]!r}; the log has the traceback; "
                f"run `llmgw ctl drain {progress.node}` again"
            )

    async def _drain(self, request: DrainRequest) -> None:
        progress = request.progress
        node_id = progress.node
        # What is on the node now that this drain holds the moves' lock: a move that held it
        # before (the spreader's, the autoscaler's) may have taken one of the replicas asked for.
        todo = self._on_node(node_id)
        progress.total = len(todo)
        for rid in todo:
            progress.current = rid
            if rid not in self.replicas.placed:
                # Gone meanwhile (lost, failed, a catalog change): off the node, nothing to move.
                progress.total -= 1
                log.info("drain_replica_gone", node=node_id, replica=rid)
                continue
            replacement, reason = self.replicas.place_replacement(rid, self.registry.clock.now())
            if replacement is None and not request.force:
                progress.stop(
                    f"cannot move {rid} off {node_id}: {reason}. The drain stopped and {rid} keeps running "
                    f"there; free capacity elsewhere, or run `llmgw ctl drain {node_id} --force` to stop it "
                    "without a replacement"
                )
                log.warning("drain_stopped", node=node_id, replica=rid, reason=reason)
                return
            try:
                if replacement is not None:
                    await self.moves.replace(rid, replacement)
                else:
                    await self.moves.retire(rid, None)
            except MoveFailed as exc:
                progress.stop(f"{exc}; the drain stopped")
                log.warning("drain_stopped", node=node_id, replica=rid, reason=str(exc))
                return
            progress.moved += 1
        try:
            await self.intent.drained(node_id)
        except (StoreError, UnknownNode) as exc:
            # Drained and cordoned all the same; only a restart would find the old marks.
            log.warning("drain_marks_not_saved", node=node_id, reason=str(exc), fix=f"`llmgw ctl cordon {node_id}`")
        progress.complete()
        log.info("drain_done", node=node_id, moved=progress.moved)
