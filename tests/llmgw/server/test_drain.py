"""Rolling drain on the control plane, on MockClock: each replacement ready before its original
stops; no room elsewhere stops the drain instead of causing an outage; --force proceeds anyway.
Each test waits on the drain's own event (`DrainProgress.finished`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.config import Model, ServerConfig, ServerSection
from llmgw.server.app import ControlPlane
from llmgw.wire import agent_link as w
from testlib.controlplane import OFFLINE_ENGINES, make_state
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

SIM = (w.EngineStatus(name="sim", version="1", ok=True),)


async def plane_with(tmp_path: Path, nursery: trio.Nursery, nodes: list[str], replicas: int) -> ControlPlane:
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    config = ServerConfig(
        engines=OFFLINE_ENGINES,
        server=ServerSection(state_dir=str(state)),
        models=(Model(name="chat", engine="sim", replicas=replicas),),
    )
    plane = ControlPlane.open(config, state)
    await nursery.start(plane.drains.serve)
    now = trio.current_time()
    for n in nodes:
        hello = w.Hello(
            protocol_version=w.PROTOCOL_VERSION,
            node_id=n,
            agent_version="t",
            boot_id="b",
            started_at=1.0,
            inventory=w.Inventory(hostname=n, os="l", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=2),
            engines=SIM,
        )
        await plane.store.saw_node(n, "127.0.0.1")
        conn = plane.registry.connect(hello, address="127.0.0.1", cert_serial=1, cert_not_after=2e9, now=now)
        plane.registry.heartbeat(n, conn, now)
    plane.replicas.reconcile(now)
    return plane


def ready(plane: ControlPlane, replica_id: str) -> None:
    node = plane.replicas.placed[replica_id].placement.nodes[0]
    statuses = (w.ReplicaStatus(replica_id=replica_id, model="chat", state=w.READY),)
    plane.registry.nodes[node].replicas = statuses  # as the endpoint records a ReplicasChanged
    plane._replicas_reported(node, statuses)


def events(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(("drain_", "move_"))]


async def test_each_replacement_is_ready_before_its_original_stops(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog
) -> None:
    caplog.set_level("INFO")
    plane = await plane_with(tmp_path, nursery, ["a", "b", "c"], replicas=3)
    on_a = sorted(k for k, v in plane.replicas.placed.items() if "a" in v.placement.nodes)
    assert len(on_a) == 1
    progress = await plane.operations.start_drain("a", force=False)
    await await_true(lambda: plane.replicas.surge, "the replacement", changed=plane.replicas.saver.to_write.next)
    await trio.sleep(10)  # fake time, within the nodes' heartbeat TTL: the drain waits for readiness, not a timer
    assert progress.moved == 0 and on_a[0] in plane.replicas.placed  # waiting: the original still runs
    [replacement] = sorted(plane.replicas.surge)
    assert "a" not in plane.replicas.placed[replacement].placement.nodes
    ready(plane, replacement)
    readied_at = trio.current_time()
    await progress.finished.wait()
    assert progress.done and trio.current_time() - readied_at < 1  # at once, not at a poll
    assert on_a[0] not in plane.replicas.placed and replacement in plane.replicas.placed
    assert events(caplog) == ["drain_started", "move_replacement_ready", "move_original_stopped", "drain_done"]
    node = plane.registry.nodes["a"]
    assert (
        node.cordoned and not node.draining and [r for r in await plane.store.nodes() if r.node_id == "a"][0].cordoned
    )
    assert not any("a" in v.placement.nodes for v in plane.replicas.placed.values())
    assert plane.replicas.reconcile(trio.current_time()) == set()  # the replacement counts as one of three


async def test_no_room_elsewhere_stops_the_drain_and_force_proceeds(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    plane = await plane_with(tmp_path, nursery, ["only"], replicas=1)
    [original] = plane.replicas.placed
    plane.registry.nodes["only"].draining = False
    progress = await plane.operations.start_drain("only", force=False)
    await progress.finished.wait()
    assert f"cannot move {original} off only" in progress.error and "--force" in progress.error
    assert original in plane.replicas.placed  # no outage
    forced = await plane.operations.start_drain("only", force=True)
    await forced.finished.wait()
    assert forced.done and forced.error is None
    assert original not in plane.replicas.placed


async def test_a_replica_moved_by_a_move_before_the_drain_is_not_counted_as_the_drains(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The spreader (or a rollout) holds the moves' lock when the drain is asked for and takes the
    # node's replica elsewhere: the drain then finds nothing to move, and says so (0 of 0), not
    # "1 of 2 moved" for a node that is empty.
    plane = await plane_with(tmp_path, nursery, ["a", "b", "c"], replicas=2)
    [on_a] = [k for k, v in plane.replicas.placed.items() if "a" in v.placement.nodes]
    async with plane.moves.lock:
        progress = await plane.operations.start_drain("a", force=False)
        assert progress.total == 1
        replacement, _ = plane.replicas.place_replacement(on_a, plane.registry.clock.now())
        assert replacement is not None and "a" not in replacement.placement.nodes
        async with trio.open_nursery() as moving:
            moving.start_soon(plane.moves.replace, on_a, replacement)
            await await_true(
                lambda: plane.replicas.surge, "the replacement", changed=plane.replicas.saver.to_write.next
            )
            [new] = sorted(plane.replicas.surge)
            ready(plane, new)
    await progress.finished.wait()
    assert progress.done and progress.error is None
    assert (progress.moved, progress.total) == (0, 0)
    assert not any("a" in v.placement.nodes for v in plane.replicas.placed.values())
