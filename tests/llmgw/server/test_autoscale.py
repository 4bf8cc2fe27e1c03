"""The autoscaler's rules (llmgw.server.state.autoscale), on a clock the test moves: from zero at
the first waiting request, up after up_after_s of more load than the replicas' target, down one at
a time below the margin (no flapping on a steady load), idle to min_replicas, the bounds after a
reload, what a gateway instance's reports add up to, and the loop that retires a replica before
the count falls."""

from __future__ import annotations

import math

import attrs
import pytest
import trio
import trio.testing

from llmgw.config import AutoscaleSection, Model
from llmgw.server.state.autoscale import DOWN, EVICT, IDLE, START, UP, Autoscaler, Load, Room, ScalePolicy, loads_of
from llmgw.wire import gateway_link as g

SETTINGS = AutoscaleSection(target_per_replica=4.0, up_after_s=5.0, down_after_s=60.0, down_margin=0.5)


def scaled(name: str = "m", *, low: int = 0, high: int = 3, start: int = 0, idle_s: float = 300.0) -> Model:
    return Model(name=name, engine="sim", min_replicas=low, max_replicas=high, replicas=start, idle_s=idle_s)


def policy(initial: int | None = None) -> ScalePolicy:
    return ScalePolicy(lambda: SETTINGS, lambda m: m.replicas if initial is None else initial)


def test_a_model_with_a_fixed_count_is_left_alone() -> None:
    fixed = Model(name="f", engine="sim", replicas=2)
    p = policy()
    assert p.step([fixed], {"f": Load(queued=100)}, 0.0) == []
    assert p.effective([fixed], 0.0) == (fixed,)
    assert p.view(fixed) is None


def test_a_request_waiting_for_a_model_with_none_starts_one_at_once() -> None:
    m = scaled()
    p = policy()
    assert p.effective([m], 0.0)[0].replicas == 0
    assert p.step([m], {}, 1.0) == []
    [d] = p.step([m], {"m": Load(queued=3, arrived=True)}, 2.0)
    assert (d.kind, d.before, d.after, d.reason) == (START, 0, 1, "started on demand: 3 requests waiting")
    assert p.effective([m], 2.0)[0].replicas == 1
    assert p.view(m)["last"]["reason"] == "started on demand: 3 requests waiting"


def test_more_load_than_the_target_for_up_after_s_adds_what_it_wants_in_one_step() -> None:
    m = scaled(start=1, high=5)
    p = policy()
    load = Load(queued=10, in_flight=4)  # 14 wants ceil(14 / 4) = 4
    assert p.step([m], {"m": load}, 0.0) == []
    assert p.step([m], {"m": load}, 4.9) == []
    [d] = p.step([m], {"m": load}, 5.0)
    assert (d.kind, d.before, d.after) == (UP, 1, 4)
    assert d.reason == "scaled up: 10 queued, 4 in flight on average over 5 s"
    assert p.effective([m], 5.0)[0].replicas == 4


def test_a_burst_shorter_than_up_after_s_adds_nothing_and_a_dip_between_requests_does_not_restart_the_wait() -> None:
    m = scaled(start=1)
    p = policy()
    # 8 for two seconds (two replicas' worth), then 1: over any 5 s it averages one replica's.
    for t, busy in [(0.0, 8), (1.0, 8), (2.0, 1), (3.0, 1), (4.0, 1), (5.0, 1), (6.0, 1), (7.0, 1)]:
        assert p.step([m], {"m": Load(in_flight=busy)}, t) == [], t
    # A steady 12 with one look at 2 (a client between two requests) in the middle: still up at 5 s.
    p = policy()
    for t, busy in [(0.0, 12), (1.0, 12), (2.0, 2), (3.0, 12), (4.0, 12)]:
        assert p.step([m], {"m": Load(in_flight=busy)}, t) == [], t
    [d] = p.step([m], {"m": Load(in_flight=12)}, 5.0)
    assert (d.kind, d.after) == (UP, 3)  # ceil(10 / 4): the average of the last 5 s


def test_never_above_max_replicas() -> None:
    m = scaled(start=1, high=2)
    p = policy()
    p.step([m], {"m": Load(queued=100)}, 0.0)
    [d] = p.step([m], {"m": Load(queued=100)}, 5.0)
    assert d.after == 2
    assert p.step([m], {"m": Load(queued=100)}, 100.0) == []


def test_a_steady_load_between_the_margin_and_the_target_does_not_flap() -> None:
    m = scaled(start=1, high=4)
    p = policy()
    # 9 requests want ceil(9 / 4) = 3 replicas.
    p.step([m], {"m": Load(in_flight=9)}, 0.0)
    assert [d.after for d in p.step([m], {"m": Load(in_flight=9)}, 5.0)] == [3]
    # One fewer (2) would take 9 > 4 * 0.5 * 2 = 4: it stays at 3 however long it lasts.
    for t in range(6, 1000, 7):
        assert p.step([m], {"m": Load(in_flight=9, arrived=True)}, float(t)) == [], t


def test_a_falling_load_retires_one_replica_at_a_time_each_after_down_after_s() -> None:
    m = scaled(start=3, low=1, high=3)
    p = policy()
    light = {"m": Load(in_flight=1, arrived=True)}  # 1 <= 4 * 0.5 * 2: one fewer would do
    assert p.step([m], light, 0.0) == []
    [d] = p.step([m], light, 60.0)
    assert (d.kind, d.before, d.after) == (DOWN, 3, 2)
    assert d.reason == "scaled down: 1 requests on 3 replicas for 60 s"
    # Still 3 until the replica it retires is gone; nothing else decided meanwhile.
    assert p.effective([m], 60.0)[0].replicas == 3
    assert p.view(m)["lowering"] is True
    assert p.step([m], light, 200.0) == []
    p.lowered("m")
    assert p.effective([m], 200.0)[0].replicas == 2
    assert p.step([m], light, 200.0) == []  # the next step waits down_after_s again
    [d] = p.step([m], light, 260.0)
    assert (d.before, d.after) == (2, 1)
    p.lowered("m")
    assert p.step([m], light, 1000.0) == []  # min_replicas = 1, and a request came meanwhile


def test_idle_for_idle_s_scales_to_zero_and_the_next_request_brings_it_back() -> None:
    m = scaled(start=1, idle_s=300.0)
    p = policy()
    p.step([m], {"m": Load(in_flight=1, arrived=True)}, 0.0)
    assert p.step([m], {}, 299.0) == []
    [d] = p.step([m], {}, 300.0)
    assert (d.kind, d.before, d.after, d.reason) == (IDLE, 1, 0, "idle for 300 s: scaled to zero")
    assert p.effective([m], 300.0)[0].replicas == 1  # until its replica is retired
    p.lowered("m")
    assert p.effective([m], 301.0)[0].replicas == 0
    assert p.step([m], {}, 2000.0) == []
    [d] = p.step([m], {"m": Load(queued=1, arrived=True)}, 5000.0)
    assert (d.kind, d.after, d.reason) == (START, 1, "started on demand: 1 request waiting")


def test_idle_with_several_goes_down_one_at_a_time_to_min_replicas() -> None:
    m = scaled(start=3, low=1, high=3, idle_s=30.0)  # idle_s under down_after_s: idle decides
    p = policy()
    p.step([m], {"m": Load(arrived=True)}, 0.0)
    [d] = p.step([m], {}, 30.0)
    assert (d.kind, d.after, d.reason) == (IDLE, 2, "idle for 30 s: one replica fewer")
    p.lowered("m")
    [d] = p.step([m], {}, 31.0)
    assert (d.kind, d.after) == (IDLE, 1)
    p.lowered("m")
    assert p.step([m], {}, 500.0) == []  # min_replicas


def test_a_request_arriving_keeps_a_model_warm_though_none_is_in_flight_at_each_look() -> None:
    m = scaled(start=1, idle_s=300.0)
    p = policy()
    for t in range(0, 3000, 200):  # short requests, each over between two looks
        assert p.step([m], {"m": Load(arrived=True)}, float(t)) == [], t


def test_bounds_changed_by_a_reload_bring_the_count_within_them() -> None:
    p = policy()
    m = scaled(start=3, low=1, high=3)
    p.step([m], {"m": Load(in_flight=12, arrived=True)}, 0.0)
    narrower = attrs.evolve(m, max_replicas=2, replicas=2)
    [d] = p.step([narrower], {"m": Load(in_flight=12, arrived=True)}, 1.0)
    assert (d.kind, d.before, d.after) == (DOWN, 3, 2)
    assert d.reason == "min_replicas/max_replicas are now 1-2"
    p.lowered("m")
    raised = attrs.evolve(m, min_replicas=3, max_replicas=4, replicas=3)
    [d] = p.step([raised], {}, 2.0)
    assert (d.kind, d.before, d.after) == (UP, 2, 3)


def test_the_initial_count_comes_from_the_caller_within_the_bounds() -> None:
    p = policy(initial=7)
    assert p.effective([scaled(high=3)], 0.0)[0].replicas == 3
    p = policy(initial=0)
    assert p.effective([scaled(low=1, high=3, start=1)], 0.0)[0].replicas == 1


def test_a_model_that_left_the_catalog_is_forgotten() -> None:
    p = policy()
    m = scaled(start=1, high=3)
    p.step([m], {"m": Load(queued=40)}, 0.0)
    p.step([m], {"m": Load(queued=40)}, 5.0)
    assert p.effective([m], 5.0)[0].replicas == 3
    p.forget(["m"])
    assert p.effective([m], 6.0)[0].replicas == 1  # back as new: its initial count


def report(model: str, *, queued: int = 0, in_flight: int = 0, total: int = 0, wait: float = 0.0) -> g.ModelLoad:
    return g.ModelLoad(model=model, queued=queued, in_flight=in_flight, requests_total=total, oldest_wait_s=wait)


def test_loads_add_up_over_instances_and_a_rising_total_is_an_arrival() -> None:
    seen: dict = {}
    a, b = ("gw", "1"), ("gw", "2")
    loads = loads_of(
        [(a, (report("m", queued=2, total=5, wait=1.5),)), (b, (report("m", in_flight=3, total=9, wait=0.5),))], seen
    )
    assert loads["m"] == Load(queued=2, in_flight=3, arrived=True, oldest_wait_s=1.5)  # first reports of requests taken
    loads = loads_of([(a, (report("m", total=5),)), (b, (report("m", total=9),))], seen)
    assert loads["m"] == Load(arrived=False)  # nothing new
    loads = loads_of([(a, (report("m", total=6),)), (b, (report("m", total=9),))], seen)
    assert loads["m"].arrived
    # An instance gone is forgotten; one that comes back (a restart) starts from its own totals.
    loads_of([(b, (report("m", total=9),))], seen)
    assert set(seen) == {("gw", "2", "m")}
    assert loads_of([(a, (report("m", total=1),)), (b, (report("m", total=9),))], seen)["m"].arrived


class Harness:
    """An Autoscaler with its I/O in memory: the catalog, the gateways' reports, and the
    retirements it asks for (each released by the test)."""

    def __init__(self, catalog: list[Model]) -> None:
        self.catalog = catalog
        self.reports: list = []
        self.now = 0.0
        self.changes = 0
        self.retiring: list[tuple[str, object]] = []
        self.released = trio.Event()
        self.heard = trio.Event()
        self.placed = {"m": ["m-0", "m-1"]}
        self.scaler = Autoscaler(
            settings=lambda: SETTINGS,
            catalog=lambda: self.catalog,
            initial=lambda m: m.replicas,
            reports=lambda: self.reports,
            heard=lambda: [self.heard],
            changed=self._changed,
            retire=self._retire,
            pick=lambda model: (self.placed.get(model) or [None])[-1],
            clock=lambda: self.now,
        )

    def _changed(self) -> None:
        self.changes += 1

    async def _retire(self, replica: str, then) -> None:
        self.retiring.append((replica, then))
        await self.released.wait()
        then()
        self.placed["m"].remove(replica)


@pytest.mark.trio
async def test_the_loop_raises_at_once_and_lowers_after_the_retirement() -> None:
    h = Harness([scaled(start=2, low=0, high=3, idle_s=10.0)])
    async with trio.open_nursery() as nursery:
        h.reports = [(("gw", "1"), (report("m", in_flight=1, total=1),))]
        assert h.scaler.step(nursery) == []
        assert h.scaler.models()[0].replicas == 2
        h.reports = [(("gw", "1"), (report("m", total=1),))]
        h.now = 10.0
        [d] = h.scaler.step(nursery)
        assert d.kind == IDLE
        await trio.testing.wait_all_tasks_blocked()
        assert [r for r, _ in h.retiring] == ["m-1"]
        assert h.scaler.models()[0].replicas == 2  # not until the replica is gone
        h.released.set()
        await trio.testing.wait_all_tasks_blocked()
        assert h.scaler.models()[0].replicas == 1
        assert h.placed["m"] == ["m-0"]
        before = h.changes
        h.reports = [(("gw", "1"), (report("m", queued=4, total=5, wait=0.2),))]
        h.now = 11.0
        h.scaler.step(nursery)  # arrived: no longer idle; one replica for 4 is enough
        assert h.changes == before
        assert "llmgw_autoscale_decisions_total" in h.scaler.render_metrics()
        assert 'llmgw_autoscale_replicas_wanted{model="m"} 1' in h.scaler.render_metrics()
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_fall_with_no_replica_to_retire_lowers_the_count_all_the_same() -> None:
    h = Harness([scaled(start=1, low=0, high=3, idle_s=10.0)])
    h.placed = {}
    async with trio.open_nursery() as nursery:
        h.scaler.step(nursery)
        h.now = 10.0
        [d] = h.scaler.step(nursery)
        await trio.testing.wait_all_tasks_blocked()
        assert (d.kind, h.scaler.models()[0].replicas) == (IDLE, 0)
        assert h.changes == 1
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_serve_looks_when_a_gateway_reports_without_waiting_for_the_interval() -> None:
    h = Harness([scaled(start=0, high=2)])
    async with trio.open_nursery() as nursery:
        await nursery.start(h.scaler.serve)
        stepped = h.scaler.stepped.next()
        h.reports = [(("gw", "1"), (report("m", queued=1, total=1),))]
        h.heard.set()
        h.heard = trio.Event()
        with trio.fail_after(0.5):  # well inside the 1 s interval
            await stepped.wait()
        assert h.scaler.models()[0].replicas == 1
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("busy", [0, 1, 4, 5, 8, 9, 100])
def test_what_the_load_wants(busy: int) -> None:
    m = scaled(start=1, high=50)
    p = policy()
    p.step([m], {"m": Load(in_flight=busy, arrived=True)}, 0.0)
    decisions = p.step([m], {"m": Load(in_flight=busy, arrived=True)}, 5.0)
    want = max(1, math.ceil(busy / 4))
    assert [d.after for d in decisions] == ([want] if want > 1 else [])


def test_no_more_replicas_while_those_wanted_are_not_yet_ready() -> None:
    m = scaled(start=0, high=3)
    p = policy()
    ready = {"m": 0}
    [d] = p.step([m], {"m": Load(queued=12)}, 0.0, ready.get)
    assert d.kind == START
    # The 12 waiting are waiting for the one starting: they ask for no more until it is ready.
    assert p.step([m], {"m": Load(queued=12)}, 30.0, ready.get) == []
    ready["m"] = 1
    assert p.step([m], {"m": Load(queued=12)}, 31.0, ready.get) == []  # up_after_s from here
    [d] = p.step([m], {"m": Load(queued=12)}, 36.0, ready.get)
    assert (d.kind, d.after) == (UP, 3)


def test_a_model_that_does_not_fit_waits_for_the_replica_retired_to_make_room() -> None:
    cold, warm = scaled("cold", start=0, high=1), scaled("warm", start=1, high=1)
    p = policy()
    p.step([cold, warm], {"warm": Load(arrived=True)}, 0.0)
    verdicts = {"cold": Room(fits=False, replica="warm-0", model="warm")}
    [d] = p.step([cold, warm], {"cold": Load(queued=2)}, 100.0, room=lambda m: verdicts[m.name])
    assert (d.model, d.kind, d.before, d.after, d.replica) == ("warm", EVICT, 1, 0, "warm-0")
    assert d.reason == "stopped to make room for cold (idle 100 s)"
    # Nothing else for either until the replica is gone: cold stays at 0 (held, not refused).
    assert p.step([cold, warm], {"cold": Load(queued=5)}, 101.0, room=lambda m: verdicts[m.name]) == []
    assert [m.replicas for m in p.effective([cold, warm], 101.0)] == [0, 1]
    p.lowered("warm")
    verdicts["cold"] = Room(fits=True)
    [d] = p.step([cold, warm], {"cold": Load(queued=5)}, 102.0, room=lambda m: verdicts[m.name])
    assert (d.model, d.kind, d.after) == ("cold", START, 1)
    assert [m.replicas for m in p.effective([cold, warm], 102.0)] == [1, 0]


def test_a_model_that_fits_or_for_which_nothing_makes_room_starts_at_once() -> None:
    for verdict in (Room(fits=True), Room(fits=False)):
        p = policy()
        m = scaled("cold", start=0, high=1)
        [d] = p.step([m], {"cold": Load(queued=1)}, 0.0, room=lambda _m, v=verdict: v)
        assert (d.kind, d.after) == (START, 1)  # where nothing fits it is pending, with the reason
