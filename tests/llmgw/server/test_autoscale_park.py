"""Parked replicas on the control plane (llmgw.server.state.autoscale, Moves.park): a vLLM model
whose replicas follow the load, on a node with GPUs, parks a replica on a fall instead of stopping
it (drained first, then its node told `parked`; out of the rotation though its engine still says
ready), and a request for it wakes that replica instead of placing another; a parked replica is
the first to make room for another model, and its going lowers nothing the model wants. A model
with `park = false`, or on no GPU, stops its replicas as before. Everything on a real
`ControlPlane` with its store, its scheduler and its gateways' feed, on trio's autojump clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.config import Model, ModelSource
from llmgw.server.app import ControlPlane
from llmgw.server.state.autoscale import EVICT, IDLE, START, Room, make_room
from llmgw.server.state.rotation import gateway_rotation
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g
from testlib.controlplane import one_node_plane

pytestmark = pytest.mark.trio

GIB = 1 << 30
GPU = w.Gpu(
    index=0,
    name="NVIDIA L4",
    uuid="GPU-0",
    memory_total_mib=23034,
    memory_free_mib=23034,
    driver_version="550.54",
    compute_capability="8.9",
    pci_bus_id="00000000:01:00.0",
)
ENGINES = (w.EngineStatus(name="vllm", version="0.32.0", ok=True), w.EngineStatus(name="sim", version="1", ok=True))
SOURCE = ModelSource(path="/srv/models/m")


def vllm(name: str, *, park: bool = True, gpus: int = 1, replicas: int = 1, high: int = 2) -> Model:
    return Model(
        name=name,
        engine="vllm",
        source=SOURCE,
        min_replicas=0,
        max_replicas=high,
        replicas=replicas,
        idle_s=60.0,
        gpus_per_replica=gpus,
        memory_gb=4.0,
        park=park,
    )


async def plane_with(tmp_path: Path, *models: Model, gpus: int = 1) -> ControlPlane:
    return await one_node_plane(
        tmp_path,
        models,
        engines=ENGINES,
        cpu_cores=8,
        memory_total_bytes=64 * GIB,
        gpus=(GPU,) * gpus,
        gpu_status=w.GPUS_PRESENT,
    )


def report(plane: ControlPlane, state: str = w.READY) -> None:
    """Node a's agent says every replica placed there is in `state` (rank 0, on a port)."""
    statuses = tuple(
        w.ReplicaStatus(replica_id=rid, model=s.placement.model, state=state, port=9000 + i)
        for i, (rid, s) in enumerate(sorted(plane.replicas.placed.items()))
    )
    node = plane.registry.nodes["a"]
    assert node.link is not None
    plane.registry.replicas_changed("a", node.link.conn_id, statuses)


def assignments(plane: ControlPlane) -> dict[str, w.ReplicaAssignment]:
    model_of = {m.name: m for m in plane.autoscaler.models()}.get
    return {a.replica_id: a for a in plane.replicas.assignments_for("a", model_of)}


def loads(scaler, model: str, *, queued: int = 0, total: int = 0) -> None:
    said = (g.ModelLoad(model=model, queued=queued, requests_total=total),)
    scaler.reports = lambda: [(("gw", "1"), said)]


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


async def test_an_idle_replica_is_parked_then_woken_by_a_request_not_placed_anew(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    plane = await plane_with(tmp_path, vllm("m"))
    scaler = plane.autoscaler
    [rid] = plane.replicas.placed
    a = assignments(plane)[rid]
    assert (a.parkable, a.parked) == (True, False)
    report(plane)
    now = lambda: plane.registry.clock.now()  # noqa: E731 - the scaler's clock
    assert gateway_rotation(plane.registry, plane.replicas, scaler.models(), set(), now()).endpoints

    loads(scaler, "m")
    scaler.step(nursery)  # first look: active now
    scaler.clock = lambda: now() + 61.0  # idle_s later
    [d] = scaler.step(nursery)
    assert (d.kind, d.parked, d.reason) == (IDLE, True, "idle for 60 s: scaled to zero, parked")
    await settle()
    assert plane.replicas.parked == {rid}
    assert rid in plane.replicas.placed  # still placed: its engine runs, the model put away
    assert assignments(plane)[rid].parked is True
    view = scaler.policy.view(vllm("m"))
    assert (view["wanted"], view["parked"]) == (0, 1)
    assert [m.replicas for m in scaler.models()] == [1]  # wanted 0 + parked 1: the scheduler keeps it
    assert plane.replicas.reconcile(now()) == set()  # nothing placed or stopped
    # Its engine still says ready (the agent has not parked it yet): out of the rotation all the same.
    rotation = gateway_rotation(plane.registry, plane.replicas, scaler.models(), set(), now())
    assert rotation.endpoints == ()
    [info] = rotation.details
    assert info.unservable == "" and info.on_demand  # held by the gateways, not refused
    report(plane, w.PARKED)
    [info] = gateway_rotation(plane.registry, plane.replicas, scaler.models(), set(), now()).details
    assert info.unservable == ""
    metrics = scaler.render_metrics()
    assert 'llmgw_autoscale_parks_total{model="m",action="park"} 1' in metrics
    assert 'llmgw_autoscale_replicas_parked{model="m"} 1' in metrics

    loads(scaler, "m", queued=2, total=2)
    [d] = scaler.step(nursery)
    assert (d.kind, d.woken, d.after) == (START, 1, 1)
    assert d.reason == "woken on demand (parked): 2 requests waiting"
    assert plane.replicas.parked == set()
    assert assignments(plane)[rid].parked is False
    assert plane.replicas.reconcile(now()) == set()  # the same replica, nothing new placed
    assert list(plane.replicas.placed) == [rid]
    assert 'llmgw_autoscale_parks_total{model="m",action="wake"} 1' in scaler.render_metrics()
    report(plane)
    assert [
        e.replica_id for e in gateway_rotation(plane.registry, plane.replicas, scaler.models(), set(), now()).endpoints
    ] == [rid]


@pytest.mark.parametrize(("model", "gpus"), [(vllm("m", park=False), 1), (vllm("m", gpus=0), 0)])
async def test_without_park_or_without_gpus_an_idle_replica_stops(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, model: Model, gpus: int
) -> None:
    plane = await plane_with(tmp_path, model, gpus=gpus)
    scaler = plane.autoscaler
    [rid] = plane.replicas.placed
    assert assignments(plane)[rid].parkable is False
    report(plane)
    loads(scaler, "m")
    scaler.step(nursery)
    scaler.clock = lambda: plane.registry.clock.now() + 61.0
    [d] = scaler.step(nursery)
    assert (d.kind, d.parked, d.reason) == (IDLE, False, "idle for 60 s: scaled to zero")
    await settle()
    assert plane.replicas.placed == {} and plane.replicas.parked == set()


async def test_a_parked_replica_is_the_first_to_make_room_and_its_going_lowers_nothing_wanted(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # One GPU: one replica at a time. "p" is parked; "busy" was used later but is awake.
    plane = await plane_with(tmp_path, vllm("p"), vllm("cold", replicas=0))
    scaler = plane.autoscaler
    [rid] = plane.replicas.placed
    report(plane)
    loads(scaler, "p")
    scaler.step(nursery)
    scaler.clock = lambda: plane.registry.clock.now() + 61.0
    scaler.step(nursery)
    await settle()
    assert plane.replicas.parked == {rid}
    room = make_room(
        vllm("cold", replicas=0),
        replicas=plane.replicas,
        policy=scaler.policy,
        catalog=scaler.models(),
        now=plane.registry.clock.now(),
        outstanding=lambda r: 0,
        retiring=plane.moves.retiring,
    )
    assert room == Room(fits=False, replica=rid, model="p", parked=True)
    loads(scaler, "cold", queued=1, total=1)
    [d] = scaler.step(nursery)
    assert (d.kind, d.model, d.parked, d.before, d.after) == (EVICT, "p", True, 0, 0)
    assert d.reason.startswith("a parked replica stopped to make room for cold")
    await settle()
    assert rid not in plane.replicas.placed and plane.replicas.parked == set()
    view = scaler.policy.view(vllm("p"))
    assert (view["wanted"], view["parked"]) == (0, 0)
    [d] = scaler.step(nursery)
    assert (d.model, d.kind, d.woken) == ("cold", START, 0)  # placed anew: it had nothing parked
