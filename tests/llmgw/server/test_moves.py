"""Moves on an in-process control plane with a fake clock: replicas placed together while one
node was alone are spread once another joins, each move's replacement ready before the
original goes, and the original's requests finishing before it stops."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.config import Model, ServerConfig, ServerSection
from llmgw.gateway.routing import Endpoint
from llmgw.server.app import ControlPlane
from llmgw.server.state.moves import LOST_LOOK_S
from llmgw.wire import agent_link as w
from testlib.controlplane import OFFLINE_ENGINES, make_state
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

SIM = (w.EngineStatus(name="sim", version="1", ok=True),)
HANG_S = 1000  # fake time: only a hang would take this long


async def join(plane: ControlPlane, node: str) -> None:
    hello = w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node,
        agent_version="t",
        boot_id="b",
        started_at=1.0,
        inventory=w.Inventory(hostname=node, os="l", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=2),
        engines=SIM,
    )
    await plane.store.saw_node(node, "127.0.0.1")
    now = trio.current_time()
    conn = plane.registry.connect(hello, address="127.0.0.1", cert_serial=1, cert_not_after=2e9, now=now)
    plane.registry.heartbeat(node, conn, now)


def ready(plane: ControlPlane, replica_id: str) -> None:
    node = plane.replicas.placed[replica_id].placement.nodes[0]
    statuses = (w.ReplicaStatus(replica_id=replica_id, model="chat", state=w.READY),)
    plane.registry.nodes[node].replicas = statuses  # as the endpoint records a ReplicasChanged
    plane._replicas_reported(node, statuses)


def where(plane: ControlPlane) -> dict[str, tuple[str, ...]]:
    return {k: v.placement.nodes for k, v in sorted(plane.replicas.placed.items())}


async def crowded_plane(
    tmp_path: Path, nursery: trio.Nursery, *, replicas: int = 2, more: tuple[str, ...] = ("b",)
) -> ControlPlane:
    """Two replicas of "chat" placed while node "a" was alone; then "b" joins (or `more`)."""
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    config = ServerConfig(
        engines=OFFLINE_ENGINES,
        server=ServerSection(state_dir=str(state)),
        models=(Model(name="chat", engine="sim", replicas=replicas),),
    )
    plane = ControlPlane.open(config, state)
    await nursery.start(plane.drains.serve)
    await join(plane, "a")
    plane.replicas.reconcile(trio.current_time())
    assert where(plane) == {f"chat-{i}": ("a",) for i in range(replicas)}
    for node in more:
        await join(plane, node)
    return plane


class Spread:
    """A `spread_once` under way (`start_spread`); `moved()` waits for what it returns."""

    def __init__(self) -> None:
        self.answer: list[bool] = []
        self.done = trio.Event()

    async def moved(self) -> bool:
        with trio.fail_after(HANG_S):
            await self.done.wait()
        return self.answer[0]


def start_spread(plane: ControlPlane, nursery: trio.Nursery) -> Spread:
    spread = Spread()

    async def run() -> None:
        spread.answer.append(await plane.moves.spread_once())
        spread.done.set()

    nursery.start_soon(run)
    return spread


async def spread_started(plane: ControlPlane, nursery: trio.Nursery) -> tuple[Spread, str]:
    """`spread_once` started, once it has placed its one replacement; and that replacement."""
    spread = start_spread(plane, nursery)
    await await_true(lambda: plane.replicas.surge, "the replacement", changed=placements_change(plane), timeout=HANG_S)
    [replacement] = plane.replicas.surge
    return spread, replacement


def placements_change(plane: ControlPlane):
    """What fires when the placements change (each change is offered to the store's writer)."""
    return plane.replicas.saver.to_write.next


def rotation_changes(plane: ControlPlane):
    """What fires when a replica leaves rotation or comes back (a move's retiring)."""
    return plane.changes.rotation.next


async def test_a_replica_placed_with_another_of_its_model_moves_to_a_free_node(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog
) -> None:
    caplog.set_level("INFO")
    plane = await crowded_plane(tmp_path, nursery)
    spread, replacement = await spread_started(plane, nursery)
    assert plane.replicas.placed[replacement].placement.nodes == ("b",)
    assert where(plane)["chat-1"] == ("a",)  # the original runs until its replacement is ready
    ready(plane, replacement)
    assert await spread.moved() is True and sorted(where(plane).values()) == [("a",), ("b",)]
    assert not plane.replicas.surge  # the replacement now counts as one of the catalog's
    names = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("spread_", "move_"))]
    assert names == ["spread_started", "move_replacement_ready", "move_original_stopped"]
    assert await plane.moves.spread_once() is False  # spread: nothing more to do


async def test_a_wave_moves_several_crowded_replicas_together_at_most_spread_at_once(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog
) -> None:
    """Four replicas placed while "a" was alone, then three nodes join: one look places a
    replacement on each free node at once (here at most two a wave), each to its own node."""
    caplog.set_level("INFO")
    plane = await crowded_plane(tmp_path, nursery, replicas=4, more=("b", "c", "d"))
    plane.moves.spread_at_once = 2
    for wave in (2, 1):
        spread = start_spread(plane, nursery)
        await await_true(
            lambda n=wave: len(plane.replicas.surge) == n, "the wave", changed=placements_change(plane), timeout=HANG_S
        )
        surge = sorted(plane.replicas.surge)
        assert f"llmgw_replica_moves_in_progress {wave}\n" in plane.moves.render_metrics()
        homes = [plane.replicas.placed[r].placement.nodes for r in surge]
        assert len(set(homes)) == wave and ("a",) not in homes  # each on a node of its own, not "a"
        for replacement in surge:
            ready(plane, replacement)
        assert await spread.moved() is True and not plane.replicas.surge
    assert sorted(where(plane).values()) == [("a",), ("b",), ("c",), ("d",)]
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("spread_", "move_"))]
    assert started[:2] == ["spread_started", "spread_started"]  # the first wave's two, before either was ready
    assert await plane.moves.spread_once() is False
    shown = plane.moves.render_metrics()
    assert 'llmgw_replica_moves_total{outcome="done"} 3\n' in shown and "llmgw_replica_moves_in_progress 0\n" in shown


async def test_a_replica_placed_while_a_move_is_under_way_takes_neither_its_id_nor_its_place(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The catalog grows while a replacement waits to be ready: the reconciler's new replica
    gets an id of its own (it took the replacement's once, and the move waited 10 minutes for
    a replica that was gone, then stopped the new one), and the move still ends as it should."""
    plane = await crowded_plane(tmp_path, nursery)
    spread, replacement = await spread_started(plane, nursery)
    plane.replicas.models = lambda: (Model(name="chat", engine="sim", replicas=3),)  # a reload: one more
    plane.replicas.reconcile(trio.current_time())
    assert plane.replicas.placed[replacement].placement.nodes == ("b",)  # still the move's
    [grown] = set(where(plane)) - {"chat-0", "chat-1", replacement}
    ready(plane, replacement)
    assert await spread.moved() is True and sorted(where(plane)) == sorted(["chat-0", grown, replacement])


async def test_the_original_stops_only_once_its_requests_have_finished(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    plane = await crowded_plane(tmp_path, nursery)
    original = Endpoint(replica_id="chat-1", model="chat", host="127.0.0.1", port=1)
    plane.gateway.router.acquire(original)  # a stream in flight on it
    nursery.start_soon(plane.moves.spread_once)
    await await_true(lambda: plane.replicas.surge, "the replacement", changed=placements_change(plane), timeout=HANG_S)
    ready(plane, next(iter(plane.replicas.surge)))
    await await_true(
        lambda: "chat-1" in plane.moves.retiring, "out of rotation", changed=rotation_changes(plane), timeout=HANG_S
    )
    await trio.sleep(plane.moves.retire_grace_s / 2)
    assert "chat-1" in plane.replicas.placed  # still serving what it has
    started = trio.current_time()
    plane.gateway.router.release(original)
    plane.gateway.wake()  # what a finished request does
    await await_true(
        lambda: "chat-1" not in plane.replicas.placed,
        "the original gone",
        changed=placements_change(plane),
        timeout=HANG_S,
    )
    assert trio.current_time() - started < 1


async def test_requests_that_outlast_the_grace_do_not_hold_the_move_forever(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog
) -> None:
    plane = await crowded_plane(tmp_path, nursery)
    plane.gateway.router.acquire(Endpoint(replica_id="chat-1", model="chat", host="127.0.0.1", port=1))
    nursery.start_soon(plane.moves.spread_once)
    await await_true(lambda: plane.replicas.surge, "the replacement", changed=placements_change(plane), timeout=HANG_S)
    ready(plane, next(iter(plane.replicas.surge)))
    await await_true(
        lambda: "chat-1" in plane.moves.retiring, "out of rotation", changed=rotation_changes(plane), timeout=HANG_S
    )
    left_rotation = trio.current_time()
    await await_true(
        lambda: "chat-1" not in plane.replicas.placed,
        "the original gone",
        changed=placements_change(plane),
        timeout=HANG_S,
    )
    assert trio.current_time() - left_rotation == pytest.approx(plane.moves.retire_grace_s, abs=0.1)
    assert any(r.getMessage() == "move_retire_grace_over" for r in caplog.records)


async def test_a_move_whose_replacements_node_is_lost_gives_up_then_not_at_the_ready_timeout(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog
) -> None:
    """The nodes stop heartbeating: the move ends once "b" is lost (its TTL, then a look),
    not after the ten minutes a replacement may take to load, and a wave holding the moves'
    lock (a drain waits for it) does not hang on a node that went away."""
    plane = await crowded_plane(tmp_path, nursery)
    started = trio.current_time()
    spread, _ = await spread_started(plane, nursery)
    assert await spread.moved() is False
    ttl = plane.registry.ttl
    assert ttl <= trio.current_time() - started <= ttl + LOST_LOOK_S + 1
    [failed] = [r.llmgw_fields for r in caplog.records if r.getMessage() == "spread_failed"]
    assert "lost its node b: no heartbeat within its TTL; chat-1 keeps running" in failed["reason"]
    assert where(plane) == {"chat-0": ("a",), "chat-1": ("a",)} and not plane.replicas.surge


async def test_a_replacement_that_never_gets_ready_is_withdrawn_and_retried_later(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    plane = await crowded_plane(tmp_path, nursery)
    assert await plane.moves.spread_once() is False  # waited ready_timeout_s (fake time) in vain
    assert where(plane) == {"chat-0": ("a",), "chat-1": ("a",)} and not plane.replicas.surge
    failed_at = trio.current_time()
    assert await plane.moves.spread_once() is False  # within the retry pause: not even tried
    assert not plane.replicas.surge and trio.current_time() == failed_at
    assert 'llmgw_replica_moves_total{outcome="failed"} 1\n' in plane.moves.render_metrics()
    await trio.sleep(plane.moves.spread_retry_s)
    for node in ("a", "b"):  # the nodes kept their heartbeats all along
        plane.registry.heartbeat(node, plane.registry.nodes[node].link.conn_id, trio.current_time())
    nursery.start_soon(plane.moves.spread_once)
    await await_true(lambda: plane.replicas.surge, "a second attempt", changed=placements_change(plane), timeout=HANG_S)
