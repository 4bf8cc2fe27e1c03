"""Replicas on the control plane: the catalog turned into placements, kept in SQLite, and each
node's share of them as the assignments in its desired state. What it holds of each placement, by
replica and by node, is `llmgw.server.state.placements`'.

`Replicas.reconcile(now)` builds the cluster view the scheduler needs from the registry, runs
the pure `scheduler.plan`, keeps the result and returns the nodes whose assignments changed;
the caller pushes their desired state. The placements in memory are the truth while the
control plane runs: every change is offered to `saver`, whose loop (`saver.serve`, started by
the control plane) writes the latest set to the store in the background, so a locked or failing
database never holds up the reconciler (it retries until the write goes through). The rules
that make it safe:

- A node known from before a control-plane restart (liveness `unknown`) keeps its placements
  and gets nothing new: its agent is still running them and will be adopted when it reconnects.
- A lost node's replicas are placed elsewhere, as a whole. Fencing is level-triggered: the lost
  node's desired state no longer lists them, so when it comes back its agent stops them.
- A replica a node reports as `failed` is rebuilt elsewhere; that node is avoided for that model
  (until the model's version changes: a new version may run where the last one failed).
- Each placement runs a version of its model (`llmgw.server.state.versions`), its definition kept
  until the placement goes: a changed model's replicas keep their assignments, exact, and are
  replaced one at a time by its rollout (`llmgw.server.state.rollouts`), not restarted in place.
  New placements get the model's target version: the catalog's, or while its rollout is held
  after a failure, the version its replicas serve (`targets`).

Each replica's engine key is in memory in plain text and in the store only sealed
(`llmgw.server.store.keyseal`). A row of an earlier version holds its key in plain text: it is read
as it is (its engines keep running with it) and `at_open[PLAIN]` names it; `seal_at_start`,
called by the control plane as it opens, rewrites the store sealed before anything runs.
"""

from __future__ import annotations

import random
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from llmgw.config import ENGINES, Model
from llmgw.fabrics import FabricMap
from llmgw.log import get_logger
from llmgw.server.state.closeness import over_rpc, subnet_of
from llmgw.server.state.placements import Placements, Stored
from llmgw.server.state.registry import JOINED, JOINING, LOST, UNKNOWN, Node, NodeRegistry, gen_speeds
from llmgw.server.state.scheduler import NodeView, Pending, Placement, plan
from llmgw.server.state.versions import ModelVersions, parkable, version_of, with_token
from llmgw.server.state.weights import default_weights
from llmgw.server.store.asyncstore import AsyncStore, LatestWriter
from llmgw.server.store.keyseal import KeySeal
from llmgw.wire import agent_link as w

log = get_logger("llmgw.replicas")

# Rendezvous ports are drawn at random from a range away from the usual defaults (29500 is
# torch.distributed's): a port taken on the rank-0 node fails that replica, which is then rebuilt
# with another draw instead of hitting the same port again. The range lies below Linux's
# ephemeral ports (32768-60999 by default): a port there may be the local end of any outgoing
# connection on the node (a busy `llmgw up`, where every node is 127.0.0.1, failed a drain's
# replacement five times on one that was).
DIST_INIT_PORTS = range(12000, 20000)
_rng = random.SystemRandom()


def _free_port(used: set[int]) -> int:
    while True:
        port = _rng.choice(DIST_INIT_PORTS)
        if port not in used:
            return port


# How a row came out of the database.
SEALED = "sealed"  # as this version writes it
PLAIN = "plain"  # an earlier version's row, with the key in plain text: sealed now, the same key
REPLACED = "replaced"  # its key did not open (sealed under a lost secret): a new key, the engine restarts


def _to_row(s: Stored, surge: bool) -> dict:
    # The version beside the placement, not in it: an earlier llmgw reads the placement as a
    # Placement's fields, and skips what else the row holds.
    row = {
        "placement": attrs.asdict(s.placement),
        "sealed_key": s.sealed_key,
        "dist_init_port": s.dist_init_port,
        "version": s.version,
    }
    if surge:
        row["surge"] = True  # a move's replacement, not yet one of the catalog's
    return row


def _from_row(replica_id: str, row: dict, keys: KeySeal) -> tuple[Stored, str]:
    p = dict(row["placement"])
    p["nodes"] = tuple(p["nodes"])
    placement = Placement(**p)
    if "api_key" in row:  # written before keys were sealed: {"placement", "api_key", "dist_init_port"}
        key, how = row["api_key"], PLAIN
    else:
        opened = keys.open(replica_id, row["sealed_key"])
        key, how = (opened, SEALED) if opened is not None else (_new_key(), REPLACED)
    sealed = row["sealed_key"] if how == SEALED else keys.seal(replica_id, key)
    stored = Stored(
        placement=placement,
        api_key=key,
        sealed_key=sealed,
        dist_init_port=row["dist_init_port"],
        version=row.get("version", ""),
    )
    return stored, how


def sealed_keys(rows: dict[str, dict]) -> int:
    """How many stored placements hold a sealed key (which only the secret opens)."""
    return sum(1 for row in rows.values() if "sealed_key" in row)


def _new_key() -> str:
    return secrets.token_urlsafe(24)


def _arriving(state: str, node: Node) -> bool:
    """Connected (or expected back) but not yet ready for work. Every agent checks and reports
    its engines (sim at least) right after it joins: until then it is arriving, not short of one."""
    return state in (JOINING, UNKNOWN) or (state == JOINED and not node.engines)


class Replicas:
    def __init__(
        self,
        store: AsyncStore,
        registry: NodeRegistry,
        models: Callable[[], Sequence[Model]],
        fabrics: Callable[[], FabricMap],
        keys: KeySeal,
        engine_version: Callable[[str], str] = lambda engine: "",
    ) -> None:
        """`models()`: the catalog as placed (each scaled model at the count it wants);
        `engine_version(engine)`: [engines]' version of it now, part of a model's version."""
        self.registry = registry
        self.models = models
        self.fabrics = fabrics
        self.keys = keys
        self.engine_version = engine_version
        # The definitions the placements run (from the store: what a new leader needs to keep
        # older versions running until their rollout replaces them), and the models held.
        self.versions = ModelVersions(store.at_open.model_versions)
        self._digests: dict[int, tuple[Model, str, str]] = {}  # id(model) -> (model, engine version, its version)
        self._targeted: dict[str, str] = {}  # each model's target version at the last reconcile
        self.placed = Placements()
        self.at_open: dict[str, list[str]] = {PLAIN: [], REPLACED: []}  # replica ids, by how their row was read
        withdrawn = []
        for rid, row in store.at_open.placements.items():
            if row.get("surge"):
                # A move's replacement the control plane before this one placed: the move (a drain's,
                # a rollout's, spreading's) is not under way here, so neither is its replacement. Its
                # agent stops it; a rollout places another. (Counted instead, the count's excess
                # would be stopped, the newest first: maybe an old replica that serves.)
                withdrawn.append(rid)
                continue
            self.placed[rid], how = _from_row(rid, row, keys)
            self.at_open.setdefault(how, []).append(rid)
        if withdrawn:
            log.info("replica_replacements_withdrawn", replicas=withdrawn, why="their moves were the last leader's")
        self.saver: LatestWriter[tuple[dict[str, dict], dict[str, dict]]] = LatestWriter(
            "placements", lambda rows: store.set_placements(*rows)
        )
        self.pending: tuple[Pending, ...] = ()
        self._pending_logged: dict[Pending, str] = {}  # each pending reason, and the level it was logged at
        self.failed_on: dict[str, set[str]] = {}  # node -> models that failed there
        self.surge: set[str] = set()  # replacements a drain placed on top of the catalog's count
        # Replicas whose engines are told to park their model (the autoscaler's, vLLM's sleep
        # mode): placed and counted, out of the gateways' rotation until woken. Kept in memory: a
        # new leader wakes them, and they park again after their model's idle_s.
        self.parked: set[str] = set()
        self._rows: dict[str, tuple[Stored, bool, dict]] = {}  # `rows`' row of each placement, as made

    def node_views(self, now: float) -> list[NodeView]:
        keys_of: dict[str, list[str]] = {}
        for f in self.fabrics().fabrics:
            for n in f.nodes:
                keys_of.setdefault(n, []).append(f.key)
        views = []
        for node_id, node in sorted(self.registry.nodes.items()):
            state = self.registry.liveness(node, now)
            inv = node.inventory
            if state == UNKNOWN:
                # Not reconnected yet after our restart: keep what it runs, place nothing new.
                engines = frozenset(ENGINES)
            else:
                engines = frozenset(e.name for e in node.engines if e.ok)
            why = "lost" if state == LOST else "cordoned" if node.cordoned else "draining" if node.draining else state
            unreported = state == JOINED and _arriving(state, node)
            if unreported and why == JOINED:
                why = "has not reported its engines yet"
            views.append(
                NodeView(
                    node_id=node_id,
                    schedulable=state == JOINED and not node.cordoned and not node.draining and not unreported,
                    engines=engines,
                    gpus=len(inv.gpus) if inv else 0,
                    memory_bytes=inv.memory_total_bytes if inv else 0,
                    fabrics=tuple(keys_of.get(node_id, ())),
                    alive=state != LOST,
                    why_not=why,
                    avoid=frozenset(self.failed_on.get(node_id, ())),
                    gpu_memory_bytes=min((g.memory_total_mib for g in inv.gpus), default=0) << 20 if inv else 0,
                    holds=frozenset(f.sha256 for f in node.weights.files if f.complete),
                    speeds=gen_speeds(node.speeds),
                    subnet=subnet_of(node.address),
                )
            )
        return views

    def note_statuses(self, node_id: str, statuses: Sequence[w.ReplicaStatus]) -> bool:
        """Record members a node reports failed; True if that should trigger a reconcile."""
        changed = False
        for s in statuses:
            if s.state == w.FAILED and s.replica_id in self.placed:
                self.failed_on.setdefault(node_id, set()).add(s.model)
                log.warning("replica_failed", replica=s.replica_id, node=node_id, detail=s.detail)
                del self.placed[s.replica_id]  # rebuilt elsewhere at the next reconcile
                self.parked.discard(s.replica_id)
                changed = True
        return changed

    def reconcile(self, now: float) -> set[str]:
        """Place what the catalog wants; returns the nodes whose assignments changed."""
        targets = self.targets()
        adopted = self._follow(targets)
        before = {k: s.placement.nodes for k, s in self.placed.items()}
        counted, surge = self.counted()
        models = [m for m, _ in targets.values()]
        result = plan(self.node_views(now), models, counted, surge, self.runs(targets), self.busy())
        placed = Placements((p.replica_id, self.placed[p.replica_id]) for p in result.keep)
        for k in self.surge:
            if k in self.placed:
                placed[k] = self.placed[k]  # a drain owns these
        used_ports = {s.dist_init_port for s in placed.values()}
        for p in result.start:
            port = 0
            if len(p.nodes) > 1:
                port = _free_port(used_ports)
                used_ports.add(port)
            placed[p.replica_id] = self._new(p, port, targets[p.model][1])
            log.info("replica_placed", replica=p.replica_id, model=p.model, nodes=list(p.nodes))
        for p in result.stop:
            log.info("replica_stopped", replica=p.replica_id, model=p.model, nodes=list(p.nodes))
        self._report_pending(result.pending, self.forming(now))
        self.pending = result.pending
        changed = set()
        for rid in set(before) | set(placed):
            old, new = before.get(rid), placed[rid].placement.nodes if rid in placed else None
            if old != new:
                changed |= set(old or ()) | set(new or ())
        save = changed or adopted or placed.keys() != self.placed.keys()
        self.placed = placed
        self.parked.intersection_update(placed.keys())
        if save:
            self._save()
        return changed

    def forming(self, now: float) -> bool:
        """The cluster is still assembling by itself: just after the control plane started (nodes
        known from before may come back), with no node at all yet, or with a node that has
        connected but not yet joined and reported its engines."""
        if self.registry.forming(now) or not self.registry.nodes:
            return True
        return any(_arriving(self.registry.liveness(node, now), node) for node in self.registry.nodes.values())

    def nodes_on_their_way(self, now: float) -> bool:
        """A node that may yet take work is on its way: one connected or expected back but not
        ready (`_arriving`), or, with no node known at all, the first moments after the start.
        Unlike `forming`, a cluster whose every node is here is not waiting for anything, however
        recently the control plane started."""
        if not self.registry.nodes:
            return self.registry.forming(now)
        return any(_arriving(self.registry.liveness(node, now), node) for node in self.registry.nodes.values())

    def _report_pending(self, pending: Sequence[Pending], forming: bool) -> None:
        """Log each pending reason once: at info while the cluster is still forming (a replica
        waiting for nodes that are on their way is no problem), as a warning once it is formed
        and the replica still has nowhere to go — also when the reason stayed the same."""
        level = "info" if forming else "warning"
        logged: dict[Pending, str] = {}
        for pend in pending:
            before = self._pending_logged.get(pend)
            if before is None or (before, level) == ("info", "warning"):
                emit = log.info if forming else log.warning
                emit("replica_pending", model=pend.model, replicas=pend.replicas, reason=pend.reason)
                before = level
            logged[pend] = before
        self._pending_logged = logged

    # -- versions -------------------------------------------------------------------------

    def version(self, model: Model) -> str:
        """`version_of(model)` with [engines]' version of its engine now (remembered per catalog
        entry: thousands of assignments are made of a few models)."""
        engine_version = self.engine_version(model.engine)
        hit = self._digests.get(id(model))
        if hit is not None and hit[0] is model and hit[1] == engine_version:
            return hit[2]
        if len(self._digests) > 4096:
            self._digests.clear()
        digest = version_of(model, engine_version)
        self._digests[id(model)] = (model, engine_version, digest)
        return digest

    def targets(self) -> dict[str, tuple[Model, str]]:
        """Each model of the catalog as placed, with the definition its new replicas get and its
        version: the catalog's, or for a model held after a failed rollout, the version its
        replicas serve (its count as the catalog's). Notes each catalog definition, so that it
        is known once the catalog moves on."""
        out: dict[str, tuple[Model, str]] = {}
        for m in self.models():
            version = self.version(m)
            self.versions.record(m, version)
            hold = self.versions.held(m.name, version)
            serving = self.versions.definition(m.name, hold.serving) if hold is not None else None
            if hold is not None and serving is not None:
                out[m.name] = (with_token(attrs.evolve(serving, replicas=m.replicas), m.source.token), hold.serving)
            else:
                out[m.name] = (m, version)
        return out

    def runs(self, targets: dict[str, tuple[Model, str]]) -> dict[str, Model]:
        """By replica id, the older definition each placement of a model being rolled runs."""
        out = {}
        for rid, s in self.placed.items():
            target = targets.get(s.placement.model)
            if target is not None and s.version != target[1]:
                definition = self.versions.definition(s.placement.model, s.version)
                if definition is not None:
                    out[rid] = definition
        return out

    def behind(self) -> dict[str, list[str]]:
        """By model, its replicas the catalog counts (no move's replacement) that run a version
        other than its target: what its rollout has still to replace, by replica id."""
        targets = self.targets()
        out: dict[str, list[str]] = {}
        for rid, s in sorted(self.placed.items()):
            target = targets.get(s.placement.model)
            if target is None or rid in self.surge or s.version in ("", target[1]):
                continue
            if self.versions.definition(s.placement.model, s.version) is not None:
                out.setdefault(s.placement.model, []).append(rid)
        return out

    def _follow(self, targets: dict[str, tuple[Model, str]]) -> bool:
        """At a reconcile: a model whose target version changed may go on every node again (the
        nodes it failed on failed an older version); a placement with no version (a row of an
        earlier llmgw), or one whose definition is not known, takes its model's target, what
        its assignment is from now on. Whether a placement changed."""
        for name, (_, version) in targets.items():
            if self._targeted.get(name, version) != version:
                for failed in self.failed_on.values():
                    failed.discard(name)
            self._targeted[name] = version
        adopted = False
        for rid, s in list(self.placed.items()):
            target = targets.get(s.placement.model)
            if target is None or s.version == target[1]:
                continue
            if s.version and self.versions.definition(s.placement.model, s.version) is not None:
                continue
            if s.version:
                log.warning(
                    "replica_version_unknown",
                    replica=rid,
                    model=s.placement.model,
                    version=s.version[:12],
                    detail="the store holds no definition of what it runs: it is given the catalog's (its engine "
                    "restarts with it)",
                )
            self.placed[rid] = attrs.evolve(s, version=target[1])
            adopted = True
        return adopted

    # -- moves ------------------------------------------------------------------------------

    def propose_replacement(self, replica_id: str, now: float) -> tuple[Placement | None, str]:
        """Where one more replica of `replica_id`'s model would go now, on top of the catalog's
        count (the reason when nowhere); changes nothing. It is of the model's target version."""
        original = self.placed[replica_id].placement
        targets = self.targets()
        models = [
            attrs.evolve(m, replicas=m.replicas + 1) if m.name == original.model else m for m, _ in targets.values()
        ]
        counted, surge = self.counted()
        result = plan(self.node_views(now), models, counted, surge, self.runs(targets), self.busy())
        new = [p for p in result.start if p.model == original.model]
        if not new:
            reason = next((p.reason for p in result.pending if p.model == original.model), "no place for it")
            return None, reason
        return new[0], ""

    def propose_spread(self, replica_ids: Sequence[str], now: float) -> list[tuple[str, Placement]]:
        """Where one more replica of each of `replica_ids`' models would go now (one look for all:
        a spreading wave), on top of the catalog's count, paired with the replica it would
        replace, in their order; those with no place are left out. Changes nothing."""
        wanted = Counter(self.placed[rid].placement.model for rid in replica_ids)
        targets = self.targets()
        models = [
            attrs.evolve(m, replicas=m.replicas + wanted[m.name]) if m.name in wanted else m
            for m, _ in targets.values()
        ]
        counted, surge = self.counted()
        new: dict[str, list[Placement]] = {}
        for p in plan(self.node_views(now), models, counted, surge, self.runs(targets), self.busy()).start:
            new.setdefault(p.model, []).append(p)
        out = []
        for rid in replica_ids:
            found = new.get(self.placed[rid].placement.model)
            if found:
                out.append((rid, found.pop(0)))
        return out

    def busy(self) -> set[str]:
        """Replica ids a node still reports that are placed no more: a new replica must not take
        one, or the old engine's last report ("ready", on its port) would pass for the new one's
        (a move would retire its original before the replacement ran; the gateways would send
        requests to a stopping engine)."""
        return {
            s.replica_id
            for node in self.registry.nodes.values()
            for s in node.replicas
            if s.replica_id not in self.placed
        }

    def counted(self) -> tuple[list[Placement], list[Placement]]:
        """The placements the catalog counts, and the moves' replacements on top of them: a plan
        neither keeps nor stops those, but leaves their GPUs and replica ids alone (a pending
        replica placed while a move was under way took its replacement's id, and the move
        waited for a replica that was gone)."""
        counted, surge = [], []
        for k, s in self.placed.items():
            (surge if k in self.surge else counted).append(s.placement)
        return counted, surge

    def add_surge(self, p: Placement) -> Stored:
        """Place `p` on top of the catalog's count (a move's replacement, until `retire`)."""
        used = {s.dist_init_port for s in self.placed.values()}
        port = _free_port(used) if len(p.nodes) > 1 else 0
        target = self.targets().get(p.model)
        stored = self._new(p, port, target[1] if target is not None else "")
        self.placed[p.replica_id] = stored
        self.surge.add(p.replica_id)
        self._save()
        return stored

    def place_replacement(self, replica_id: str, now: float) -> tuple[Stored | None, str]:
        """For a drain: one more replica of `replica_id`'s model, placed where the scheduler
        allows (the draining node is not schedulable), on top of the catalog's count."""
        proposal, reason = self.propose_replacement(replica_id, now)
        return (self.add_surge(proposal), "") if proposal is not None else (None, reason)

    def holding(self) -> dict[str, set[str]]:
        """Model -> the nodes a replica of it runs on now."""
        out: dict[str, set[str]] = {}
        for stored in self.placed.values():
            out.setdefault(stored.placement.model, set()).update(stored.placement.nodes)
        return out

    def retire(self, replica_id: str, replacement: str | None) -> None:
        """For a drain: the original goes; its replacement now counts as one of the catalog's."""
        self.placed.pop(replica_id, None)
        self.parked.discard(replica_id)
        if replacement is not None:
            self.surge.discard(replacement)
        self._save()

    def _new(self, p: Placement, dist_init_port: int, version: str) -> Stored:
        key = _new_key()
        return Stored(
            placement=p,
            api_key=key,
            sealed_key=self.keys.seal(p.replica_id, key),
            dist_init_port=dist_init_port,
            version=version,
        )

    def rows(self) -> dict[str, dict]:
        """The placements as the store keeps them: no key in plain text. Each row is made once
        per placement (a wave of moves saves at each of its steps, a thousand rows each time)."""
        made, out = self._rows, {}
        for k, v in self.placed.items():
            row = made.get(k)
            surge = k in self.surge
            if row is None or row[0] is not v or row[1] != surge:
                row = made[k] = (v, surge, _to_row(v, surge))
            out[k] = row[2]
        if len(made) > len(out):
            for k in made.keys() - out.keys():
                del made[k]
        return out

    def version_rows(self) -> dict[str, dict]:
        """The definitions the placements run, as the store keeps them (`ModelVersions.rows`)."""
        return self.versions.rows({(s.placement.model, s.version) for s in self.placed.values() if s.version})

    def _save(self) -> None:
        self.saver.offer((self.rows(), self.version_rows()))

    def member_addrs(self, p: Placement) -> tuple[str, ...]:
        """Every member's address in rank order, as the registry knows it, for a llama.cpp replica
        over several nodes (rank 0 dials each helper's RPC server there); () for any other."""
        if not over_rpc(p.engine) or len(p.nodes) < 2:
            return ()
        return tuple((n.address if (n := self.registry.nodes.get(node_id)) else "") for node_id in p.nodes)

    def assignments_for(
        self,
        node_id: str,
        model_of: Callable[[str], Model | None],
        weights_of: Callable[[Model], w.WeightsSource] = default_weights,
    ) -> tuple[w.ReplicaAssignment, ...]:
        """`weights_of(model)`: where the node gets the model's weights (`desired.weights_source`).
        `model_of(name)`: the catalog's entry; a replica of an older version is given the
        definition it runs (with the catalog's token), so its engine does not restart."""
        out = []
        for rid in sorted(self.placed.on(node_id)):
            stored = self.placed[rid]
            p = stored.placement
            model = model_of(p.model)
            if model is None:
                continue
            if stored.version and stored.version != self.version(model):
                runs = self.versions.definition(p.model, stored.version)
                if runs is not None:
                    model = with_token(runs, model.source.token)
            rank0 = self.registry.nodes.get(p.nodes[0])
            out.append(
                w.ReplicaAssignment(
                    replica_id=rid,
                    model=p.model,
                    engine=p.engine,
                    weights=weights_of(model),
                    api_key=stored.api_key,
                    nodes=p.nodes,
                    node_rank=p.nodes.index(node_id),
                    rank0_addr=rank0.address if rank0 and len(p.nodes) > 1 else "",
                    dist_init_port=stored.dist_init_port,
                    member_addrs=self.member_addrs(p),
                    gpus=p.gpus_per_node,
                    args=model.args,
                    cache_events=model.cache_events,
                    parkable=parkable(model, p.gpus_per_node),
                    parked=rid in self.parked,
                )
            )
        return tuple(out)


def seal_at_start(store: AsyncStore, replicas: Replicas, secret: Path) -> None:
    """Before anything runs: a database of an earlier version held engine keys in plain text;
    they are sealed in place and scrubbed from its files, with the same keys (the engines
    running with them are adopted as they are). Keys that did not open have new ones. `secret`
    is the file the keys are sealed with, for the log."""
    plain, replaced = replicas.at_open[PLAIN], replicas.at_open[REPLACED]
    if not plain and not replaced:
        return
    if not store.scrub_placements_at_start(replicas.rows()):
        log.warning(
            "engine_keys_scrub_incomplete",
            path=str(store.path),
            detail="another process reading the database kept its write-ahead log from being emptied: the old "
            "rows stay in it until the log is reused, or emptied when the last process using the database closes it; "
            "stop that process (a sqlite3 shell?)",
        )
    if plain:
        log.info(
            "engine_keys_sealed",
            replicas=plain,
            detail=f"{store.path} held them in plain text; sealed with {secret}, the engines keep their keys",
        )
    if replaced:
        log.warning(
            "engine_keys_replaced",
            replicas=replaced,
            detail=f"their keys do not open with {secret} (sealed with another secret): new keys; their engines "
            "restart once",
        )
