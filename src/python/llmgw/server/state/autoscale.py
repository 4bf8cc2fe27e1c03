"""Replicas that follow the load: models on demand, scaled to zero and back.

A catalog model with `min_replicas` or `max_replicas` (`Model.scaled`) has as many replicas as
its load wants, within its bounds; the others keep `replicas`. The load of a model is what the
gateways say in their heartbeats (`wire.gateway_link.ModelLoad`): its requests waiting for a
replica and in flight on one, on every gateway instance, and whether any arrived since the last
look. The rules (`ScalePolicy.step`, a pure function of the loads and the clock):

- **From zero**: a model with no replica and a request waiting gets one at once. A gateway
  reports the first request it holds for such a model at once, not at its next heartbeat.
- **Up**: the load wants ceil((queued + in flight) / target_per_replica) replicas; when the load
  averaged over the last `up_after_s` wants more than it has, it gets that many (at most
  `max_replicas`) in one step.
- **Down**: when the load would fit one replica fewer below `down_margin` of the target (so a
  steady load does not flap between two counts) for `down_after_s`, one fewer; again after
  `down_after_s` more.
- **Idle**: after `idle_s` without a request, `min_replicas` (0: none), one replica at a time.
- **Room**: a model with none that fits no node (`make_room`, the scheduler's plan with one more
  of it) first has the least recently used idle replica of another scaled model retired, one
  whose going lets it fit (never one with a request on it, nor of a model with a fixed count;
  a parked one first), and starts once that one is gone.
- **Parked**: where its engine can (`Model.park`, `EngineSpec.park`: vLLM's sleep mode, on
  GPUs), a fall parks the replica instead of stopping it: drained the same way, its engine keeps
  running with the model put away, out of the gateways' rotation (`Replicas.parked`), still
  placed where it is. A rise wakes parked replicas before it places new ones (a wake takes a
  fraction of a second, a start the engine's start and the model's load). A model's placed count
  is the replicas it wants plus those parked.

A rise takes effect at once (the scheduler places the new replicas; the gateways hold requests
meanwhile). A fall takes a replica out of the gateways' rotation first and lets its requests
finish (`Moves.retire`, as a drain does: a stream is not cut), and only then lowers the count,
so the replica stopped is the one drained. Each decision is logged with its reason, counted in
/metrics and kept as the model's last (`llmgw ctl models`, `ctl replicas` and the page show it).

Where a model starts: a control plane that starts (a restart, a new leader) takes the count of
each model's replicas placed in the store, within its bounds; a model with none that was in the
catalog before is at `min_replicas` (it was scaled to zero), a new one starts with `replicas`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence

import attrs
import trio

from llmgw.config import AutoscaleSection, Model
from llmgw.log import get_logger
from llmgw.metrics import MetricsRegistry
from llmgw.server.state.changes import Changes
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.server.state.scheduler import plan, replica_slot
from llmgw.server.state.versions import parkable
from llmgw.wakeup import Wakeup, any_of
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g

log = get_logger("llmgw.autoscale")

START, UP, DOWN, IDLE, EVICT = "start", "up", "down", "idle", "evict"
FALLS = (DOWN, IDLE)  # the decisions that park where the model's replicas can
# Replicas of other models tried, least recently used first, for one that would make room.
ROOM_CANDIDATES = 8


@attrs.frozen(kw_only=True)
class Load:
    """A model's requests on every gateway now, and whether one arrived since the last look."""

    queued: int = 0
    in_flight: int = 0
    arrived: bool = False
    oldest_wait_s: float = 0.0

    @property
    def busy(self) -> int:
        return self.queued + self.in_flight


@attrs.frozen(kw_only=True)
class Decision:
    model: str
    kind: str  # START, UP, DOWN, IDLE
    before: int
    after: int
    reason: str  # in words, for the log, `ctl` and the page: "scaled up: 14 queued, 3 in flight for 5 s"
    at: float  # the policy's clock
    wall: float = 0.0  # unix time, for the views
    replica: str = ""  # EVICT: the replica to retire
    woken: int = 0  # START, UP: parked replicas woken (the rest of the rise placed anew)
    parked: bool = False  # DOWN, IDLE: the replica is parked, not stopped; EVICT: the replica retired was parked


@attrs.frozen(kw_only=True)
class Room:
    """Whether one more replica of a model fits the cluster now, and if not, the replica of
    another model whose retirement would make room for it ("": none would)."""

    fits: bool
    replica: str = ""
    model: str = ""
    parked: bool = False  # the replica is parked


@attrs.define
class _Model:
    wanted: int
    last_active: float
    recent: list[tuple[float, int, int]] = attrs.field(factory=list)  # looks at the load: (when, queued, in flight)
    fewer_since: float | None = None  # the load has fit one fewer since
    lowering: bool = False  # a replica is being retired: no other decision until it is
    awaiting: str = ""  # the model a replica is being retired of to make room for this one
    last: Decision | None = None


class ScalePolicy:
    """How many replicas each scaled model wants. No I/O; `now` is the caller's clock."""

    def __init__(
        self,
        settings: Callable[[], AutoscaleSection],
        initial: Callable[[Model], int],
        parked: Callable[[str], int] = lambda model: 0,
        parks: Callable[[Model], bool] = lambda model: False,
    ) -> None:
        """`initial(model)`: the count a model starts with when first seen (see the module);
        `parked(name)`: its replicas parked now (`Replicas.parked`), on top of those it wants;
        `parks(model)`: whether a fall of it parks a replica rather than stopping one."""
        self.settings = settings
        self.initial = initial
        self.parked = parked
        self.parks = parks
        self.models: dict[str, _Model] = {}

    def wanted(self, model: Model, now: float) -> int:
        """The replicas `model` wants now (first seen: its initial count, within its bounds)."""
        state = self.models.get(model.name)
        if state is None:
            low, high = model.bounds
            state = self.models[model.name] = _Model(wanted=min(high, max(low, self.initial(model))), last_active=now)
        return state.wanted

    def effective(self, catalog: Sequence[Model], now: float) -> tuple[Model, ...]:
        """The catalog with each scaled model's `replicas` as it wants now, its parked ones on top."""
        out = []
        for m in catalog:
            if m.scaled:
                wanted = self.wanted(m, now) + self.parked(m.name)
                out.append(m if m.replicas == wanted else attrs.evolve(m, replicas=wanted))
            else:
                out.append(m)
        return tuple(out)

    def forget(self, names: Iterable[str]) -> None:
        for name in names:
            self.models.pop(name, None)

    def step(
        self,
        catalog: Sequence[Model],
        loads: Mapping[str, Load],
        now: float,
        ready: Callable[[str], int] | None = None,
        room: Callable[[Model], Room] | None = None,
    ) -> list[Decision]:
        """Look at every scaled model's load once: the decisions made. A rise changes the count
        now; a fall (DOWN, IDLE) marks the model lowering, and `lowered` lowers the count once the
        replica it retired is gone (or `not_lowered` if none could be). `ready(model)`: its
        replicas ready now; while fewer are ready than it wants, it gets no more (the requests
        waiting for those on their way say nothing of what more would carry). Asked only of a
        model whose load wants more. `room(model)`: asked before a model with none is started:
        where it does not fit, the least recently used idle replica of another scaled model that
        would make room is retired first (EVICT, for that model), and this one starts once it is
        gone; where nothing would, it starts all the same (and is pending with the reason)."""
        s = self.settings()
        decisions = []
        for m in catalog:
            if not m.scaled:
                continue
            self.wanted(m, now)
            state = self.models[m.name]
            low, high = m.bounds
            load = loads.get(m.name, Load())
            if load.arrived or load.busy:
                state.last_active = now
            if state.lowering or state.awaiting:
                continue
            decision = None
            if state.wanted < low or state.wanted > high:  # its bounds changed (a reload)
                kind = UP if state.wanted < low else DOWN
                after = low if state.wanted < low else state.wanted - 1
                decision = self._decide(m, state, kind, after, f"min_replicas/max_replicas are now {low}-{high}", now)
            elif state.wanted == 0:
                if load.queued and high > 0:
                    what = f"{load.queued} request{'s' if load.queued != 1 else ''} waiting"
                    if self.parked(m.name):
                        decision = self._decide(m, state, START, 1, f"woken on demand (parked): {what}", now, woken=1)
                    else:
                        decision = self._evict_for(m, state, room(m), now) if room is not None else None
                    if decision is None:
                        decision = self._decide(m, state, START, 1, f"started on demand: {what}", now)
            else:
                decision = self._up(m, state, load, s, high, now, ready) or self._down(m, state, load, s, low, now)
            if decision is not None:
                decisions.append(decision)
        return decisions

    def _up(
        self,
        m: Model,
        state: _Model,
        load: Load,
        s: AutoscaleSection,
        high: int,
        now: float,
        ready: Callable[[str], int] | None,
    ) -> Decision | None:
        # The load over the last up_after_s, averaged: one look between two requests (a client's
        # answer done, its next not yet sent) does not start the wait over.
        recent = state.recent
        recent.append((now, load.queued, load.in_flight))
        start = now - s.up_after_s
        while len(recent) > 1 and recent[1][0] <= start:  # one look at or before the start: the window is covered
            recent.pop(0)
        if recent[0][0] > start:
            return None
        window = recent[1:] or recent
        queued = sum(q for _, q, _ in window) / len(window)
        flight = sum(f for _, _, f in window) / len(window)
        need = min(high, math.ceil((queued + flight) / s.target_per_replica - 1e-9))
        if need <= state.wanted:
            return None
        if ready is not None and ready(m.name) < state.wanted:
            state.recent = [(now, load.queued, load.in_flight)]  # measured again once those wanted are ready
            return None
        held = now - recent[0][0]
        state.recent = []
        woken = min(need - state.wanted, self.parked(m.name))
        reason = f"scaled up: {queued:.0f} queued, {flight:.0f} in flight on average over {held:.0f} s"
        if woken:
            reason += f" ({woken} woken from parked)"
        return self._decide(m, state, UP, need, reason, now, woken=woken)

    def _down(self, m: Model, state: _Model, load: Load, s: AutoscaleSection, low: int, now: float) -> Decision | None:
        if state.wanted > low and not load.busy and now - state.last_active >= m.idle_s:
            state.fewer_since = None
            to = "scaled to zero" if low == 0 and state.wanted == 1 else "one replica fewer"
            if self.parks(m):
                to += ", parked"
            return self._decide(m, state, IDLE, state.wanted - 1, f"idle for {m.idle_s:g} s: {to}", now)
        floor = max(low, 1)
        if state.wanted <= floor or load.busy > s.target_per_replica * s.down_margin * (state.wanted - 1):
            state.fewer_since = None
            return None
        if state.fewer_since is None:
            state.fewer_since = now
        held = now - state.fewer_since
        if held < s.down_after_s:
            return None
        state.fewer_since = now  # the next step down waits as long again
        reason = f"scaled down: {load.busy} requests on {state.wanted} replicas for {held:.0f} s"
        if self.parks(m):
            reason += ", one parked"
        return self._decide(m, state, DOWN, state.wanted - 1, reason, now)

    def _evict_for(self, m: Model, state: _Model, room: Room, now: float) -> Decision | None:
        """A replica retired to make room for `m` (its model lowered by one), or None: `m` fits,
        or nothing would make room."""
        victim = self.models.get(room.model)
        if room.fits or not room.replica or victim is None or victim.lowering:
            return None
        if not room.parked and victim.wanted < 1:
            return None
        state.awaiting = room.model
        idle = now - victim.last_active
        what = "a parked replica stopped" if room.parked else "stopped"
        decision = Decision(
            model=room.model,
            kind=EVICT,
            before=victim.wanted,
            after=victim.wanted if room.parked else victim.wanted - 1,
            reason=f"{what} to make room for {m.name} (idle {idle:.0f} s)",
            at=now,
            wall=time.time(),
            replica=room.replica,
            parked=room.parked,
        )
        victim.last = decision
        victim.lowering = True
        return decision

    def _decide(
        self, m: Model, state: _Model, kind: str, after: int, reason: str, now: float, woken: int = 0
    ) -> Decision:
        decision = Decision(
            model=m.name,
            kind=kind,
            before=state.wanted,
            after=after,
            reason=reason,
            at=now,
            wall=time.time(),
            woken=woken,
            parked=kind in FALLS and self.parks(m),
        )
        state.last = decision
        if after > state.wanted:
            state.wanted = after
            state.fewer_since = None
        else:
            state.lowering = True
        return decision

    def lowered(self, model: str, fewer: bool = True) -> None:
        """The replica a fall retired (or parked) is gone: one fewer (`fewer`; False: the replica
        retired was parked, and the count it wants stays)."""
        state = self.models.get(model)
        if state is not None:
            if fewer:
                state.wanted = max(0, state.wanted - 1)
            state.lowering = False
            state.fewer_since = None  # the next step down waits down_after_s from here
        for other in self.models.values():  # a model waiting for the room this made starts at the next look
            if other.awaiting == model:
                other.awaiting = ""

    def not_lowered(self, model: str) -> None:
        """A fall found no replica to retire (none placed): the count falls all the same."""
        self.lowered(model)

    def view(self, model: Model) -> dict | None:
        """What `ctl` and the page show of a scaled model: its bounds, the count it wants and its
        last decision."""
        state = self.models.get(model.name)
        if not model.scaled or state is None:
            return None
        low, high = model.bounds
        last = state.last
        return {
            "min": low,
            "max": high,
            "wanted": state.wanted,
            "parked": self.parked(model.name),
            "idle_s": model.idle_s,
            "lowering": state.lowering,
            "last": None
            if last is None
            else {
                "kind": last.kind,
                "before": last.before,
                "after": last.after,
                "reason": last.reason,
                "at": last.wall,
            },
        }


def loads_of(
    reports: Iterable[tuple[tuple[str, str], Sequence[g.ModelLoad]]], seen: dict[tuple[str, str, str], int]
) -> dict[str, Load]:
    """Each model's load over every gateway instance's last report ((name, instance), its models).
    `seen`: each instance's `requests_total` per model at the last look, updated here: one that
    rose, or a first report of requests taken, is an arrival. An instance that no longer reports
    is forgotten."""
    loads: dict[str, Load] = {}
    now_seen: dict[tuple[str, str, str], int] = {}
    for (name, instance), models in reports:
        for m in models:
            key = (name, instance, m.model)
            now_seen[key] = m.requests_total
            arrived = m.requests_total > seen.get(key, 0)
            was = loads.get(m.model)
            if was is None:
                loads[m.model] = Load(
                    queued=m.queued, in_flight=m.in_flight, arrived=arrived, oldest_wait_s=m.oldest_wait_s
                )
            else:
                loads[m.model] = Load(
                    queued=was.queued + m.queued,
                    in_flight=was.in_flight + m.in_flight,
                    arrived=was.arrived or arrived,
                    oldest_wait_s=max(was.oldest_wait_s, m.oldest_wait_s),
                )
    seen.clear()
    seen.update(now_seen)
    return loads


def initial_count(model: Model, replicas: Replicas, *, known: bool) -> int:
    """The count a scaled model starts with on this control plane: its replicas placed in the
    store (a restart, a new leader), else `min_replicas` for a model in the catalog before (it had
    been scaled to zero), else `replicas`. Within its bounds (`ScalePolicy.wanted`)."""
    placed = sum(
        1 for rid, s in replicas.placed.items() if s.placement.model == model.name and rid not in replicas.surge
    )
    if placed:
        return placed
    return model.bounds[0] if known else model.replicas


def pick_to_retire(
    replicas: Replicas, model: str, retiring: Collection[str], outstanding: Callable[[str], int]
) -> str | None:
    """Which replica of `model` a scale-down retires (or parks): of those the catalog counts (not a
    move's replacement), not being retired already and not parked, one of an older version first
    (its rollout has one fewer to replace), then the one with the fewest requests on it, the
    newest of those."""
    mine = [
        s.placement
        for rid, s in replicas.placed.items()
        if s.placement.model == model
        and rid not in replicas.surge
        and rid not in retiring
        and rid not in replicas.parked
    ]
    if not mine:
        return None
    old = set(replicas.behind().get(model, ()))
    return min(mine, key=lambda p: (p.replica_id not in old, outstanding(p.replica_id), -replica_slot(p))).replica_id


def make_room(
    model: Model,
    *,
    replicas: Replicas,
    policy: ScalePolicy,
    catalog: Sequence[Model],
    now: float,
    outstanding: Callable[[str], int],
    retiring: Collection[str],
) -> Room:
    """Whether one more replica of `model` fits the cluster now (the scheduler's own plan, with
    one more of it), and if not, the replica whose retirement would let it: of the scaled models
    above their min_replicas, not `model`, a replica with no request on it (as the gateways last
    said) and not being retired, parked ones first (of any scaled model: a parked replica is
    idle), then its model's least recently used; each tried with the plan (the first
    ROOM_CANDIDATES). `catalog`: as placed now (`ScalePolicy.effective`)."""
    counted, surge = replicas.counted()
    nodes = replicas.node_views(now)
    runs = replicas.runs(replicas.targets())
    more = [attrs.evolve(m, replicas=m.replicas + 1) if m.name == model.name else m for m in catalog]
    if any(p.model == model.name for p in plan(nodes, more, counted, surge, runs).start):
        return Room(fits=True)
    scaled = {m.name: m for m in catalog if m.scaled and m.name != model.name}
    candidates = []
    for p in counted:
        m = scaled.get(p.model)
        state = policy.models.get(p.model)
        parked = p.replica_id in replicas.parked
        if m is None or state is None or state.lowering or (state.wanted <= m.bounds[0] and not parked):
            continue
        if p.replica_id in retiring or outstanding(p.replica_id):
            continue
        candidates.append((not parked, state.last_active, p))
    candidates.sort(key=lambda c: (c[0], c[1], c[2].replica_id))
    for awake, _, victim in candidates[:ROOM_CANDIDATES]:
        fewer = [attrs.evolve(m, replicas=m.replicas - 1) if m.name == victim.model else m for m in more]
        rest = [p for p in counted if p.replica_id != victim.replica_id]
        if any(p.model == model.name for p in plan(nodes, fewer, rest, surge, runs).start):
            return Room(fits=False, replica=victim.replica_id, model=victim.model, parked=not awake)
    return Room(fits=False)


def ready_count(replicas: Replicas, registry: NodeRegistry, model: str) -> int:
    """The replicas of `model` whose rank 0 reports ready."""
    count = 0
    for rid, stored in replicas.placed.items():
        p = stored.placement
        if p.model != model:
            continue
        rank0 = registry.nodes.get(p.nodes[0])
        if rank0 is not None and any(
            r.replica_id == rid and r.node_rank == 0 and r.state == w.READY for r in rank0.replicas
        ):
            count += 1
    return count


def parks(model: Model, replicas: Replicas) -> bool:
    """Whether a fall of `model` parks a replica: every replica of it placed now was started able
    to (`parkable`: its engine parks, on GPUs, and the catalog lets it)."""
    placed = [s.placement for s in replicas.placed.values() if s.placement.model == model.name]
    return bool(placed) and all(parkable(model, p.gpus_per_node) for p in placed)


def parked_count(replicas: Replicas, model: str) -> int:
    """The replicas of `model` parked now."""
    placed = replicas.placed
    return sum(1 for rid in replicas.parked if rid in placed and placed[rid].placement.model == model)


def wake(replicas: Replicas, changes: Changes, model: str, n: int) -> int:
    """Wake up to `n` parked replicas of `model` (their nodes' desired states say so at the
    reconciler's next pass, and they join the rotation once their engines report ready): how
    many were."""
    placed = replicas.placed
    woken = sorted(rid for rid in replicas.parked if rid in placed and placed[rid].placement.model == model)[:n]
    for rid in woken:
        replicas.parked.discard(rid)
        for node in placed[rid].placement.nodes:
            changes.intent_changed(node)
        log.info("replica_waking", replica=rid, model=model)
    return len(woken)


Reports = Callable[[], Iterable[tuple[tuple[str, str], Sequence[g.ModelLoad]]]]


class Autoscaler:
    """The policy at work on the leader: looks at the gateways' loads every `interval_s` and
    whenever a gateway reports (`heard`), raises counts at once and lowers them one retired
    replica at a time."""

    def __init__(
        self,
        *,
        settings: Callable[[], AutoscaleSection],
        catalog: Callable[[], Sequence[Model]],
        initial: Callable[[Model], int],
        reports: Reports,
        heard: Callable[[], Sequence[trio.Event]],
        changed: Callable[[], None],
        retire: Callable[[str, Callable[[], None]], Awaitable[None]],
        pick: Callable[[str], str | None],
        clock: Callable[[], float],
        ready: Callable[[str], int] | None = None,
        room: Callable[[Model], Room] | None = None,
        park: Callable[[str, Callable[[], None]], Awaitable[None]] | None = None,
        parks: Callable[[Model], bool] = lambda model: False,
        parked: Callable[[str], int] = lambda model: 0,
        wake: Callable[[str, int], int] = lambda model, n: 0,
    ) -> None:
        """`catalog()`: the catalog as configured (each model's bounds); `reports()`: each gateway
        instance's last `ModelLoad`s; `heard()`: events a gateway's next report sets (one per source: the link's heartbeats, the
        gateway on this loop);
        `changed()`: a count rose (the reconciler looks again); `retire(replica, then)`: take the
        replica out of rotation, let its requests finish, call `then()` and stop it; `pick(model)`:
        the replica of `model` to retire (None: none placed); `clock()`: the registry's clock;
        `ready(model)`: its replicas ready now; `room(model)`: whether one more replica of it fits,
        else which replica to retire for it (`make_room`); `park(replica, then)`: as `retire`, but
        the replica is parked, not stopped; `parks(model)`: whether its falls park; `parked(model)`:
        its replicas parked now; `wake(model, n)`: wake n of them (how many were)."""
        self.settings = settings
        self.catalog = catalog
        self.policy = ScalePolicy(settings, initial, parked, parks)
        self.reports = reports
        self.heard = heard
        self.changed = changed
        self.retire = retire
        self.pick = pick
        self.clock = clock
        self.ready = ready
        self.room = room
        self.park = park
        self.wake = wake
        self.again = Wakeup()  # a replica retired: a model waiting for the room it made starts now
        self.seen: dict[tuple[str, str, str], int] = {}
        self.stepped = Wakeup()  # after each look: tests and benches wait on it
        self.metrics = MetricsRegistry()
        self._decisions = self.metrics.counter(
            "llmgw_autoscale_decisions_total",
            "Changes to a scaled model's replica count, by model and kind: start (from zero, for a waiting "
            "request), up (the load wanted more), down (it fit fewer), idle (no request for idle_s), evict (an "
            "idle replica stopped to make room for a model with none). Those that parked a replica or woke one "
            "are also counted in llmgw_autoscale_parks_total.",
            ("model", "kind"),
        )
        self._wanted = self.metrics.gauge(
            "llmgw_autoscale_replicas_wanted", "The replicas a scaled model wants now.", ("model",)
        )
        self._parks = self.metrics.counter(
            "llmgw_autoscale_parks_total",
            "Replicas of a scaled model parked (its engine keeps running with the model put away: vLLM's sleep "
            "mode) or woken, by model and action (park, wake).",
            ("model", "action"),
        )
        self._parked = self.metrics.gauge(
            "llmgw_autoscale_replicas_parked", "The replicas of a scaled model parked now.", ("model",)
        )

    def models(self) -> tuple[Model, ...]:
        """The catalog as the scheduler and the gateways' rotation take it: each scaled model's
        count as it wants now."""
        return self.policy.effective(self.catalog(), self.clock())

    def render_metrics(self) -> str:
        self._wanted.clear()
        self._parked.clear()
        for m in self.catalog():
            if m.scaled and m.name in self.policy.models:
                self._wanted.set(self.policy.models[m.name].wanted, model=m.name)
                self._parked.set(self.policy.parked(m.name), model=m.name)
        return self.metrics.render()

    def step(self, nursery: trio.Nursery) -> list[Decision]:
        """One look: the decisions made, a fall's retirement started in `nursery`."""
        catalog = self.catalog()
        self.policy.forget(set(self.policy.models) - {m.name for m in catalog})
        decisions = self.policy.step(catalog, loads_of(self.reports(), self.seen), self.clock(), self.ready, self.room)
        rose = False
        for d in decisions:
            self._decisions.inc(model=d.model, kind=d.kind)
            log.info("autoscale_decision", model=d.model, kind=d.kind, before=d.before, after=d.after, reason=d.reason)
            if d.woken:
                # At once, with the count that rose: the placed count (wanted + parked) stays.
                woken = self.wake(d.model, d.woken)
                if woken:
                    self._parks.inc(woken, model=d.model, action="wake")
            if d.after > d.before:
                rose = True
            else:
                nursery.start_soon(self._lower, d)
        if rose:
            self.changed()
        self.stepped.fire()
        return decisions

    async def _lower(self, d: Decision) -> None:
        model = d.model
        replica = d.replica or self.pick(model)
        if replica is None:
            self.policy.not_lowered(model)
            self.changed()
            return
        done = False
        park = d.parked and d.kind in FALLS and self.park is not None

        def then() -> None:
            nonlocal done
            done = True
            self.policy.lowered(model, fewer=not (d.kind == EVICT and d.parked))
            if park:
                self._parks.inc(model=model, action="park")

        try:
            if park:
                assert self.park is not None
                await self.park(replica, then)
            else:
                await self.retire(replica, then)
        finally:
            if not done:  # cancelled, or the replica was gone already: the count falls all the same
                self.policy.lowered(model, fewer=not (d.kind == EVICT and d.parked))
                self.changed()
            self.again.fire()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                heard = [*self.heard(), self.again.next()]
                self.step(nursery)
                with trio.move_on_after(self.settings().interval_s):
                    await any_of(heard)
