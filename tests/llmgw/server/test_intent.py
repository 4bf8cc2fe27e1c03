"""One owner per piece of the control plane's state, on MockClock: the node intent's owner writes
the store, then memory, then posts the change; the reconciler is what pushes after it (a cordon:
that node; a reload: every connected node), and the admin's calls answer once it has."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.config import ServerConfig, ServerSection, load_server_config
from llmgw.server.app import ControlPlane
from llmgw.server.errors import StoreBusy, UnknownNode
from llmgw.wire import agent_link as w
from testlib.controlplane import OFFLINE_ENGINES, hello, make_state

pytestmark = pytest.mark.trio

SIM = (w.EngineStatus(name="sim", version="1", ok=True),)


async def plane_with(tmp_path: Path, *nodes: str, config_path: Path | None = None) -> tuple[ControlPlane, list[str]]:
    """A control plane (not served) whose nodes joined; its reconciler records what it pushes."""
    state = tmp_path / "cp"
    make_state(state)
    config = (
        load_server_config(config_path)
        if config_path
        else ServerConfig(engines=OFFLINE_ENGINES, server=ServerSection(state_dir=str(state)))
    )
    plane = ControlPlane.open(config, state, config_path)
    now = trio.current_time()
    for n in nodes:
        await plane.store.saw_node(n, "127.0.0.1")
        conn = plane.registry.connect(
            hello(n, engines=SIM), address="127.0.0.1", cert_serial=1, cert_not_after=2e9, now=now
        )
        plane.registry.heartbeat(n, conn, now)
    pushed: list[str] = []

    async def push(node_id: str) -> None:
        pushed.append(node_id)

    plane.reconciler.push = push
    plane.reconciler.connected = lambda: list(nodes)  # as if each had a link
    return plane, pushed


class RefusingStore:
    """A store another process holds locked: every write is refused, nothing changes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def set_cordoned(self, node_id: str, cordoned: bool, *, known_at: str | None = None) -> None:
        raise StoreBusy(self.path, 1.0)

    async def set_draining(self, node_id: str, draining: bool, *, known_at: str | None = None) -> None:
        raise StoreBusy(self.path, 1.0)

    async def set_drained(self, node_id: str, *, known_at: str | None = None) -> None:
        raise StoreBusy(self.path, 1.0)


async def test_a_cordon_is_stored_then_held_in_memory_then_pushed_by_the_reconciler(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    plane, pushed = await plane_with(tmp_path, "a", "b")
    await nursery.start(plane.reconciler.serve)
    await trio.testing.wait_all_tasks_blocked()
    pushed.clear()  # the first pass's
    await plane.operations.set_cordoned("a", True)  # answers once the pass that pushes it has ended
    assert pushed == ["a"]  # that node's desired state, not everyone's
    assert plane.registry.nodes["a"].cordoned and plane.desired_state("a").cordoned
    assert [(r.node_id, r.cordoned) for r in await plane.store.nodes()] == [("a", True), ("b", False)]
    await plane.operations.set_cordoned("a", False)
    assert pushed == ["a", "a"] and not plane.desired_state("a").cordoned


async def test_a_refused_intent_changes_nothing_in_memory_and_pushes_nothing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    plane, _ = await plane_with(tmp_path, "a")
    plane.intent.store = RefusingStore(plane.store.path)
    node = plane.registry.nodes["a"]
    with pytest.raises(StoreBusy):
        await plane.intent.cordon("a", True)
    with pytest.raises(StoreBusy):
        await plane.intent.start_draining(node)
    assert (node.cordoned, node.draining) == (False, False)
    assert plane.changes.take_pushes() == (set(), False)
    with pytest.raises(UnknownNode):  # neither the store nor the registry knows it: nothing is made up
        await ControlPlane.open(plane.config, plane.state_dir).intent.cordon("ghost", True)


async def test_a_drain_marks_draining_then_drained_in_one_write_and_each_is_pushed(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    plane, _ = await plane_with(tmp_path, "a")
    node = plane.registry.nodes["a"]
    await plane.intent.start_draining(node)
    assert node.draining and [r.draining for r in await plane.store.nodes()] == [True]
    assert plane.changes.take_pushes() == ({"a"}, False)
    await plane.intent.drained("a")
    assert (node.cordoned, node.draining) == (True, False)
    assert [(r.cordoned, r.draining) for r in await plane.store.nodes()] == [(True, False)]
    assert plane.changes.take_pushes() == ({"a"}, False)
    # The drain's replicas are gone whatever the store says: memory follows, the refusal is raised.
    node.cordoned, node.draining = False, True
    plane.intent.store = RefusingStore(plane.store.path)
    with pytest.raises(StoreBusy):
        await plane.intent.drained("a")
    assert (node.cordoned, node.draining) == (True, False)
    assert plane.changes.take_pushes() == ({"a"}, False)


async def test_a_reload_is_a_catalog_change_the_reconciler_places_and_pushes_to_every_connected_node(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    toml = tmp_path / "server.toml"
    # No release served: a reload reads the release's files in a thread, and on this clock that
    # wait would jump past the nodes' heartbeats (they send none here).
    head = f'[server]\nstate_dir = "{tmp_path / "cp"}"\n[release]\nserve = false\n[engines.llamacpp]\nversion = ""\n'
    toml.write_text(head + '[[models]]\nname = "one"\nengine = "sim"\n')
    plane, pushed = await plane_with(tmp_path, "a", "b", config_path=toml)
    await nursery.start(plane.reconciler.serve)
    await trio.testing.wait_all_tasks_blocked()
    assert list(plane.replicas.placed) == ["one-0"]
    pushed.clear()
    toml.write_text(head + '[[models]]\nname = "one"\nengine = "sim"\n[[models]]\nname = "two"\nengine = "sim"\n')
    result = await plane.operations.reload()
    [two] = [s for s in plane.replicas.placed.values() if s.placement.model == "two"]
    assert result == {"models": ["one", "two"], "nodes_changed": list(two.placement.nodes)}
    assert sorted(pushed) == ["a", "b"]  # engines may have changed for everyone: each pushed once
    assert [m.name for m in plane.config.models] == ["one", "two"]


async def test_next_pass_waits_for_a_pass_that_begins_after_it_is_called(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    plane, pushed = await plane_with(tmp_path, "a")
    gate = trio.Event()

    async def slow_push(node_id: str) -> None:
        await gate.wait()
        pushed.append(node_id)

    plane.reconciler.push = slow_push
    plane.changes.intent_changed("a")
    nursery.start_soon(plane.reconciler.serve)
    await trio.testing.wait_all_tasks_blocked()  # a pass is under way, held in its push of "a"
    answered: list[set[str]] = []

    async def waiter() -> None:
        answered.append(await plane.reconciler.next_pass())

    nursery.start_soon(waiter)
    await trio.testing.wait_all_tasks_blocked()
    plane.changes.node_changed()  # what the waiter posted
    gate.set()
    await trio.testing.wait_all_tasks_blocked()
    assert pushed == ["a"] and answered == [set()]  # the pass under way ended; the next one too
    assert plane.reconciler._ended == 2
