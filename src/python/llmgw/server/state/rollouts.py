"""Rollouts: a model whose definition changed (its args, weights, engine or engine version, by a
reload of server.toml or `llmgw ctl models update`) has its replicas replaced one at a time, each
new one ready before an old one leaves, rather than all restarted in place at once.

Every placement runs a version of its model (`llmgw.server.state.versions`), and keeps the
definition of it until it goes, so a catalog change alone restarts nothing. A replica is *behind*
when its version is not its model's target (`Replicas.behind`). `Rollouts.serve` looks after each
pass of the reconciler, and for each model with replicas behind makes one move
(`Moves.replace`, as a drain's): a replacement of the target version on top of the count, ready,
then the old replica out of every gateway's rotation, its requests finished, stopped. One move at
a time with drains, spreading and scale-downs (`Moves.lock`, taken again for each replica so those
go on between), so the model never has fewer ready replicas than before. A behind replica that is
parked is stopped without a replacement (it serves nothing; the next rise places one of the new
version). Which one goes: one that does not serve (not ready) first, then one sharing a node with
the replacement (the replicas stay spread), then the lowest.

A replacement that does not become ready (its agent reports it failed, its node is lost, or
`READY_TIMEOUT_S`) stops the rollout: the replacement is withdrawn, the old replicas serve on with
their version, and the model is held (`ModelVersions.hold`: its new replicas get the serving
version too) with the reason, which `llmgw ctl models` and the cluster page show, until the
catalog's version of it changes again or an operator asks (`llmgw ctl models update NAME
--retry`: `retry`). No room for a replacement is no failure: the rollout waits, saying why, and
tries again at the next change.

A new leader (or a restarted control plane) reads the placements with their versions and the
definitions from the store, and goes on: the replicas behind are still behind. A replacement
under way at the change is withdrawn (its row says it was a move's: `Replicas`), and the rollout
places another.
A hold is also the leader's own: a new leader tries a held version once more, and holds it again
if it fails.
"""

from __future__ import annotations

import math
import time
from typing import Any

import trio

from llmgw.log import get_logger
from llmgw.server.state.changes import Changes, rest
from llmgw.server.state.moves import MoveFailed, Moves
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.server.state.scheduler import replica_slot
from llmgw.server.state.versions import SHOWN, Hold
from llmgw.wire import agent_link as w

log = get_logger("llmgw.rollouts")

UPDATING, STOPPED = "updating", "stopped"
# A rollout waiting for room looks again this often besides at each change the reconciler sees:
# room also comes from what passes no reconcile (a replica of another model retired).
WAITING_LOOK_S = 30.0


class Rollouts:
    def __init__(self, *, replicas: Replicas, moves: Moves, registry: NodeRegistry, changes: Changes) -> None:
        self.replicas = replicas
        self.moves = moves
        self.registry = registry
        self.changes = changes
        self.waiting: dict[str, str] = {}  # model -> why its next replacement has no place
        self.replacing: dict[str, str] = {}  # model -> the replica being replaced now

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """After each pass of the reconciler, one move for each model with replicas behind."""
        task_status.started()
        while True:
            changed = self.changes.settled.next()
            started = time.perf_counter()
            if not await self.roll_once():
                await rest(time.perf_counter() - started)  # a look over every placement, as the spreader's
                with trio.move_on_after(WAITING_LOOK_S if self.waiting else math.inf):
                    await changed.wait()

    async def roll_once(self) -> bool:
        """One move for each model that has replicas behind its target; whether one was made."""
        due = self.replicas.behind()
        for model in set(self.waiting) - set(due):
            del self.waiting[model]
        moved = False
        for model in sorted(due):
            async with self.moves.lock:
                moved = await self._roll_one(model) or moved
        return moved

    async def _roll_one(self, model: str) -> bool:
        """Under the moves' lock: replace (or stop, if parked) one replica of `model` behind its
        target; whether one was."""
        replicas = self.replicas
        behind = replicas.behind().get(model, [])
        if not behind:
            return False
        parked = [rid for rid in behind if rid in replicas.parked]
        if parked:
            rid = parked[0]
            log.info("rollout_parked_stopped", model=model, replica=rid)
            await self.moves.retire(rid, None)
            return True
        target = replicas.targets()[model][1]
        replacement, reason = replicas.place_replacement(behind[0], self.registry.clock.now())
        if replacement is None:
            if self.waiting.get(model) != reason:
                log.warning("rollout_waiting", model=model, reason=reason)
                self.waiting[model] = reason
                self.changes.rotation.fire()  # the page shows why
            return False
        self.waiting.pop(model, None)
        rid = self._pick(behind, replacement.placement.nodes)
        serving = replicas.placed[rid].version
        self.replacing[model] = rid
        log.info(
            "rollout_replacing",
            model=model,
            replica=rid,
            replacement=replacement.placement.replica_id,
            on=list(replacement.placement.nodes),
            version=target[:SHOWN],
            left=len(behind),
        )
        self.changes.rotation.fire()
        try:
            await self.moves.replace(rid, replacement)
        except MoveFailed as exc:
            on = ",".join(exc.nodes)
            reason = f"update of {model} stopped: {exc.replacement} on {on} {exc.why}"
            replicas.versions.hold(model, Hold(target=target, serving=serving, reason=reason, at=time.time()))
            log.warning("rollout_stopped", model=model, version=target[:SHOWN], reason=reason, serving=serving[:SHOWN])
            self.changes.node_changed()  # its new replicas get the serving version now
            return False
        finally:
            self.replacing.pop(model, None)
            self.changes.rotation.fire()
        if model not in replicas.behind():
            log.info("rollout_done", model=model, version=target[:SHOWN])
        return True

    def _pick(self, behind: list[str], nodes: tuple[str, ...]) -> str:
        """Which of `behind` the replacement on `nodes` replaces: one not serving (not ready)
        first, then one on the same nodes, then the lowest."""
        placed = self.replicas.placed

        def ready(rid: str) -> bool:
            node = self.registry.nodes.get(placed[rid].placement.nodes[0])
            return node is not None and any(s.replica_id == rid and s.state == w.READY for s in node.replicas)

        return min(
            behind,
            key=lambda rid: (
                ready(rid),
                not set(placed[rid].placement.nodes) & set(nodes),
                replica_slot(placed[rid].placement),
            ),
        )

    def retry(self, model: str) -> bool:
        """An operator asks again (`llmgw ctl models update NAME --retry`): a held model is rolled
        again at the next look; whether it was held."""
        released = self.replicas.versions.release(model)
        if released:
            log.info("rollout_retried", model=model)
            for failed in self.replicas.failed_on.values():
                failed.discard(model)
            self.changes.node_changed()
        return released

    def views(self) -> dict[str, dict[str, Any]]:
        """What `ctl models` and the page show of each model's rollout, by model: under way (its
        replicas on the target version of all it has), or stopped with the reason; models with
        neither are left out. One pass over the placements for every model."""
        replicas = self.replicas
        targets = replicas.targets()  # drops the holds of models that changed since
        behind = replicas.behind()
        mine: dict[str, list[str]] = {}
        for rid, s in replicas.placed.items():
            if rid not in replicas.surge and s.placement.model in targets:
                mine.setdefault(s.placement.model, []).append(s.version)
        out: dict[str, dict[str, Any]] = {}
        for model, (_, target) in targets.items():
            versions = mine.get(model, [])
            hold = replicas.versions.holds.get(model)
            if hold is not None:
                out[model] = {
                    "state": STOPPED,
                    "version": hold.target[:SHOWN],
                    "replicas": len(versions),
                    "updated": versions.count(hold.target),
                    "replacing": None,
                    "waiting": "",
                    "reason": hold.reason,
                    "at": hold.at,
                }
            elif model in behind:
                out[model] = {
                    "state": UPDATING,
                    "version": target[:SHOWN],
                    "replicas": len(versions),
                    "updated": versions.count(target),
                    "replacing": self.replacing.get(model),
                    "waiting": self.waiting.get(model, ""),
                    "reason": "",
                    "at": None,
                }
        return out
