"""Moving replicas without an outage: drains, and spreading replicas that share a node.

A move is always the same four steps, one replica at a time:

1. a replacement is placed where the scheduler allows, on top of the catalog's count;
2. it becomes ready (or the move stops, the replacement is withdrawn, the original stays);
3. the original leaves the gateway's rotation (marked draining) and the requests already on
   it finish, for at most `retire_grace_s` — a stream in flight is not cut by a move;
4. the original stops, and the replacement counts as one of the catalog's.

`llmgw ctl drain NODE` moves everything off a node, then cordons it. Spreading is automatic:
nodes join one at a time, so the first to join gets every replica of a model, and a second
replica on the same machine protects against nothing. Whenever the cluster changes, the
spreader looks for a replica sharing a node with another of its model while a schedulable
node holds none, and moves it there — the same move, so it costs no request.

Drains and the spreader run in nurseries this module owns; a bug in one drain ends that drain
with an error saying so (the admin API shows it), never the control plane.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs
import trio

from llmgw.errors import leaves
from llmgw.log import get_logger
from llmgw.server.replicas import Stored
from llmgw.server.scheduler import crowded
from llmgw.server.store import StoreError, UnknownNode
from llmgw.wire import agent_link as w

if TYPE_CHECKING:
    from llmgw.server.app import ControlPlane

log = get_logger("llmgw.moves")

READY_TIMEOUT_S = 600.0  # a replacement's weights may take long to fetch and load
RETIRE_GRACE_S = 60.0  # requests on the original may finish for this long after it leaves rotation
SPREAD_RETRY_S = 300.0  # after a spreading move that failed, leave that model alone this long


@attrs.define(kw_only=True)
class DrainProgress:
    """One node's drain as the admin API shows it (`view()`), updated as it goes."""

    node: str
    total: int
    moved: int = 0
    current: str | None = None
    done: bool = False
    error: str | None = None

    @property
    def running(self) -> bool:
        return not self.done and self.error is None

    def view(self) -> dict[str, Any]:
        return attrs.asdict(self)


class MoveFailed(Exception):
    """A move stopped; the original keeps running. The message says why, for the operator."""


class Moves:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.drains: dict[str, DrainProgress] = {}
        self.ready_timeout_s = READY_TIMEOUT_S
        self.retire_grace_s = RETIRE_GRACE_S
        self.spread_retry_s = SPREAD_RETRY_S
        self.retiring: set[str] = set()  # originals out of rotation, their requests finishing
        self._jobs: trio.Nursery | None = None  # set while `serve` runs
        self._moving = trio.Lock()  # one move at a time, drains and spreading together
        self._replicas_changed = trio.Event()
        self._spread_failed_at: dict[str, float] = {}  # model -> when its last spreading move failed

    def replicas_changed(self) -> None:
        """Called when an agent reports replica states: a replacement may have become ready."""
        self._replicas_changed.set()
        self._replicas_changed = trio.Event()

    # -- running ----------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the drains: each runs in this nursery until it is done, stops or the plane stops."""
        try:
            async with trio.open_nursery() as nursery:
                self._jobs = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._jobs = None

    # -- one move ---------------------------------------------------------------------------

    async def _push(self, nodes) -> None:
        for n in nodes:
            await self.plane.endpoint.push_desired_state(n)

    async def _wait_ready(self, replica_id: str, rank0: str) -> bool:
        with trio.move_on_after(self.ready_timeout_s):
            while self.plane._member_state(replica_id, rank0) != w.READY:
                await self._replicas_changed.wait()
            return True
        return False

    async def replace(self, replica_id: str, replacement: Stored) -> None:
        """Steps 2-4 for a replacement already placed; `MoveFailed` if it never got ready."""
        new = replacement.placement
        await self._push(new.nodes)
        if not await self._wait_ready(new.replica_id, new.nodes[0]):
            self.plane.replicas.retire(new.replica_id, new.replica_id)
            await self._push(new.nodes)
            raise MoveFailed(
                f"the replacement {new.replica_id} of {replica_id} did not become ready within "
                f"{self.ready_timeout_s:g} s; {replica_id} keeps running (`llmgw ctl replicas` says why)"
            )
        log.info("move_replacement_ready", replica=replica_id, replacement=new.replica_id, on=list(new.nodes))
        await self.retire(replica_id, new.replica_id)

    async def retire(self, replica_id: str, replacement_id: str | None) -> None:
        """Steps 3-4: out of rotation, its requests finish (bounded), then it stops."""
        original = self.plane.replicas.placed.get(replica_id)
        if original is None:
            return
        self.retiring.add(replica_id)
        self.plane._rotation_touched()
        try:
            finished = await self.plane.gateway.quiesce(replica_id, self.retire_grace_s)
            if not finished:
                log.warning(
                    "move_retire_grace_over",
                    replica=replica_id,
                    after_s=self.retire_grace_s,
                    outstanding=self.plane.gateway.router.outstanding.get(replica_id, 0),
                )
            self.plane.replicas.retire(replica_id, replacement_id)
        finally:
            self.retiring.discard(replica_id)
            self.plane._rotation_touched()
        await self._push(original.placement.nodes)
        log.info("move_original_stopped", replica=replica_id, replacement=replacement_id)

    # -- drains -----------------------------------------------------------------------------

    async def start_drain(self, node_id: str, *, force: bool) -> DrainProgress:
        plane = self.plane
        if node_id not in plane.registry.nodes:
            raise UnknownNode(node_id, sorted(plane.registry.nodes))
        if self._jobs is None:
            raise RuntimeError("start_drain before Moves.serve runs")
        current = self.drains.get(node_id)
        if current is not None and current.running:
            return current
        await plane.store.set_draining(node_id, True, known_at=plane.registry.nodes[node_id].address)
        plane.registry.nodes[node_id].draining = True
        plane._rotation_touched()
        todo = sorted(k for k, v in plane.replicas.placed.items() if node_id in v.placement.nodes)
        progress = self.drains[node_id] = DrainProgress(node=node_id, total=len(todo))
        log.info("drain_started", node=node_id, replicas=todo, force=force)
        await self._jobs.start(self._run_drain, todo, force, progress)
        return progress

    async def _run_drain(
        self, todo: list[str], force: bool, progress: DrainProgress, *, task_status: trio.TaskStatus[None]
    ) -> None:
        """One drain, whose failure stays its own: a bug ends this drain with an error saying so."""
        task_status.started()
        try:
            async with self._moving:
                await self._drain(progress.node, todo, force, progress)
        except Exception as exc:
            log.exception("drain_failed", node=progress.node, replica=progress.current)
            progress.error = (
                f"internal error while draining {progress.node}: {leaves(exc)[0]!r}; the log has the traceback; "
                f"run `llmgw ctl drain {progress.node}` again"
            )
        finally:
            # [i17 page hook] Done or stopped: the node is no longer draining (the rotation's
            # draining marks change), and open cluster pages show how the drain ended.
            self.plane._rotation_touched()

    async def _drain(self, node_id: str, todo: list[str], force: bool, progress: DrainProgress) -> None:
        plane = self.plane
        for rid in todo:
            progress.current = rid
            if rid not in plane.replicas.placed:
                continue  # gone meanwhile (lost, failed, catalog change)
            replacement, reason = plane.replicas.place_replacement(rid, trio.current_time())
            if replacement is None and not force:
                progress.error = (
                    f"cannot move {rid} off {node_id}: {reason}. The drain stopped and {rid} keeps running "
                    f"there; free capacity elsewhere, or run `llmgw ctl drain {node_id} --force` to stop it "
                    "without a replacement"
                )
                log.warning("drain_stopped", node=node_id, replica=rid, reason=reason)
                return
            try:
                if replacement is not None:
                    await self.replace(rid, replacement)
                else:
                    await self.retire(rid, None)
            except MoveFailed as exc:
                progress.error = f"{exc}; the drain stopped"
                log.warning("drain_stopped", node=node_id, replica=rid, reason=str(exc))
                return
            progress.moved += 1
        node = plane.registry.nodes.get(node_id)
        if node is not None:
            node.cordoned, node.draining = True, False
        try:
            await plane.store.set_cordoned(node_id, True, known_at=node.address if node else None)
            await plane.store.set_draining(node_id, False)
        except (StoreError, UnknownNode) as exc:
            # Drained and cordoned all the same; only a restart would find the old marks.
            log.warning("drain_marks_not_saved", node=node_id, reason=str(exc), fix=f"`llmgw ctl cordon {node_id}`")
        progress.current, progress.done = None, True
        log.info("drain_done", node=node_id, moved=progress.moved)

    # -- spreading --------------------------------------------------------------------------

    async def serve_spread(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Whenever the cluster changes, move one crowded replica if a node is free for it."""
        task_status.started()
        while True:
            changed = self.plane.cluster_changed()
            moved = await self.spread_once()
            if not moved:
                with trio.move_on_after(self._next_retry()):
                    await changed.wait()

    def _next_retry(self) -> float:
        now = trio.current_time()
        waits = [at + self.spread_retry_s - now for at in self._spread_failed_at.values()]
        return max(0.0, min(waits)) if waits else math.inf

    async def spread_once(self) -> bool:
        """One spreading move, if one would help; whether a move was made."""
        plane = self.plane
        now = trio.current_time()
        if any(d.running for d in self.drains.values()):
            return False  # a drain is moving things: let it finish first
        for rid in crowded(plane.replicas.node_views(now), [s.placement for s in plane.replicas.placed.values()]):
            model = plane.replicas.placed[rid].placement.model
            failed_at = self._spread_failed_at.get(model)
            if failed_at is not None and now < failed_at + self.spread_retry_s:
                continue
            proposal, _ = plane.replicas.propose_replacement(rid, now)
            if proposal is None or not plane.replicas.spreads(proposal):
                continue  # no free node would take it: staying crowded is better than nothing
            async with self._moving:
                if rid not in plane.replicas.placed:
                    return True
                replacement = plane.replicas.add_surge(proposal)
                log.info("spread_started", replica=rid, model=model, to=list(proposal.nodes))
                try:
                    await self.replace(rid, replacement)
                except MoveFailed as exc:
                    self._spread_failed_at[model] = trio.current_time()
                    log.warning("spread_failed", replica=rid, reason=str(exc), retry_in_s=self.spread_retry_s)
                    return False
            self._spread_failed_at.pop(model, None)
            return True
        return False
