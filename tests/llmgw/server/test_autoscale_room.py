"""More models than memory, on a control plane in memory with the real scheduler: a model on demand
that fits no node gets room from the least recently used idle replica of another scaled model
(retired first: out of rotation, stopped), never from one with a request on it nor from a model
with a fixed count; then it is placed where that one was."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.config import Model
from llmgw.server.app import ControlPlane
from llmgw.server.state.autoscale import EVICT, START, Room, make_room
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g
from testlib.controlplane import one_node_plane

pytestmark = pytest.mark.trio

GIB = 1 << 30
SIM = (w.EngineStatus(name="sim", version="1", ok=True),)


def on_demand(name: str, start: int) -> Model:
    return Model(name=name, engine="sim", min_replicas=0, max_replicas=1, replicas=start, memory_gb=6.0, idle_s=600.0)


async def plane_with(tmp_path: Path, *models: Model, memory_gib: int = 10) -> ControlPlane:
    return await one_node_plane(tmp_path, models, engines=SIM, memory_total_bytes=memory_gib * GIB)


def room(plane: ControlPlane, name: str, outstanding: dict[str, int] | None = None) -> Room:
    [model] = [m for m in plane.autoscaler.models() if m.name == name]
    return make_room(
        model,
        replicas=plane.replicas,
        policy=plane.autoscaler.policy,
        catalog=plane.autoscaler.models(),
        now=trio.current_time(),
        outstanding=lambda rid: (outstanding or {}).get(rid, 0),
        retiring=plane.moves.retiring,
    )


async def test_the_least_recently_used_idle_replica_makes_room(tmp_path: Path) -> None:
    plane = await plane_with(tmp_path, on_demand("warm", 1), on_demand("cold", 0))
    assert sorted(plane.replicas.placed) == ["warm-0"]
    assert room(plane, "cold") == Room(fits=False, replica="warm-0", model="warm")
    assert room(plane, "cold", {"warm-0": 1}) == Room(fits=False)  # a request on it: never


async def test_a_model_that_fits_needs_no_room(tmp_path: Path) -> None:
    plane = await plane_with(tmp_path, on_demand("warm", 1), on_demand("cold", 0), memory_gib=16)
    assert room(plane, "cold") == Room(fits=True)


async def test_a_replica_of_a_model_with_a_fixed_count_is_never_taken(tmp_path: Path) -> None:
    fixed = Model(name="fixed", engine="sim", replicas=1, memory_gb=6.0)
    plane = await plane_with(tmp_path, fixed, on_demand("cold", 0))
    assert room(plane, "cold") == Room(fits=False)


async def test_of_two_idle_models_the_one_used_longest_ago_goes(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    plane = await plane_with(tmp_path, on_demand("old", 1), on_demand("recent", 1), on_demand("cold", 0), memory_gib=14)
    assert sorted(plane.replicas.placed) == ["old-0", "recent-0"]
    plane.autoscaler.policy.models["recent"].last_active = trio.current_time() + 50
    assert room(plane, "cold").model == "old"


async def test_the_cold_model_starts_where_the_idle_one_was_retired(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog
) -> None:
    caplog.set_level("INFO")
    plane = await plane_with(tmp_path, on_demand("warm", 1), on_demand("cold", 0))
    await nursery.start(plane.reconciler.serve)
    scaler = plane.autoscaler
    queued = (g.ModelLoad(model="cold", queued=3, requests_total=3, oldest_wait_s=0.1),)
    scaler.reports = lambda: [(("gw", "1"), queued)]
    await nursery.start(scaler.serve)
    with trio.fail_after(30):
        while "cold-0" not in plane.replicas.placed:
            await scaler.stepped.next().wait()
    assert "warm-0" not in plane.replicas.placed
    events = [r.getMessage() for r in caplog.records if r.getMessage() == "autoscale_decision"]
    assert len(events) == 2, events  # warm evicted, then cold started
    views = {m.name: scaler.policy.view(m) for m in plane.config.models}
    assert views["warm"]["last"]["kind"] == EVICT and views["warm"]["wanted"] == 0
    assert views["warm"]["last"]["reason"].startswith("stopped to make room for cold")
    assert views["cold"]["last"]["kind"] == START and views["cold"]["wanted"] == 1
