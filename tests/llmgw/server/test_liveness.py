"""The control plane notices a lost node on its own, on time, with no message arriving (MockClock)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.config import ServerConfig, ServerSection
from llmgw.looplag import serve_loop_lag
from llmgw.server.app import ControlPlane
from llmgw.wire import agent_link as w
from testlib.controlplane import OFFLINE_ENGINES, make_state

pytestmark = pytest.mark.trio

TTL = 30.0


def hello(node_id: str) -> w.Hello:
    return w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node_id,
        agent_version="t",
        boot_id="b",
        started_at=1.0,
        inventory=w.Inventory(hostname=node_id, os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1),
    )


@pytest.fixture
async def plane(tmp_path: Path) -> ControlPlane:
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    return ControlPlane.open(
        ServerConfig(engines=OFFLINE_ENGINES, server=ServerSection(state_dir=str(state), heartbeat_ttl_s=TTL)), state
    )


def reconciler(plane: ControlPlane):
    return plane.reconciler.serve


def events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.getMessage(), r.llmgw_fields["node"]) for r in caplog.records if r.getMessage().startswith("node_")]


async def test_a_silent_node_is_declared_lost_one_ttl_after_its_last_heartbeat(
    plane: ControlPlane, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    async with trio.open_nursery() as nursery:
        await nursery.start(reconciler(plane))
        conn = plane.registry.connect(
            hello("n1"), address="127.0.0.2", cert_serial=1, cert_not_after=2e9, now=trio.current_time()
        )
        plane.registry.heartbeat("n1", conn, trio.current_time())
        last = trio.current_time()
        plane.changes.node_changed()  # what the endpoint does on a hello or a heartbeat
        await trio.sleep(1)
        assert events(caplog) == [("node_joined", "n1")]
        await trio.sleep(TTL - 2)  # still within the TTL of the heartbeat
        assert events(caplog) == [("node_joined", "n1")]
        await trio.sleep(2)
        assert events(caplog) == [("node_joined", "n1"), ("node_lost", "n1")]
        assert plane.registry.liveness(plane.registry.nodes["n1"], trio.current_time()) == "lost"
        assert trio.current_time() - last == pytest.approx(TTL + 1, abs=0.01)
        nursery.cancel_scope.cancel()


async def test_nodes_known_from_the_store_are_lost_only_after_a_ttl_and_the_reconnect_grace(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    from llmgw.server.store import Store

    store = Store.open(state)
    store.saw_node("old", "127.0.0.3")
    store.set_cordoned("old", True)
    store.close()
    plane = ControlPlane.open(
        ServerConfig(engines=OFFLINE_ENGINES, server=ServerSection(state_dir=str(state), heartbeat_ttl_s=TTL)), state
    )
    assert plane.registry.nodes["old"].cordoned  # operator intent survives the restart
    async with trio.open_nursery() as nursery:
        await nursery.start(reconciler(plane))
        grace = plane.config.server.reconnect_grace_s
        assert grace >= 30  # agents retry at most 30 s apart: a restart must not look like a loss
        await trio.sleep(TTL + grace - 1)
        assert [v["state"] for v in plane.views.node_views()] == ["unknown"]
        assert events(caplog) == []
        await trio.sleep(2)
        assert events(caplog) == [("node_lost", "old")]
        nursery.cancel_scope.cancel()


async def test_a_stalled_loop_loses_no_heartbeating_node_and_a_silent_one_after_its_ttl(
    plane: ControlPlane, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The control plane's loop is held for longer than the TTL (a task computing, on MockClock a
    jump of the clock while it runs); node a's heartbeat was waiting meanwhile, node b had gone
    silent just before. The reconciler, the ticker and a's heartbeat wake in whatever order trio
    picks: a is never lost, b is lost a TTL of liveness time after its last heartbeat."""
    caplog.set_level("INFO")
    clock = plane.registry.clock
    interval = plane.config.server.heartbeat_interval_s
    beating = {"a", "b"}
    last: dict[str, float] = {}

    async def heartbeats(node_id: str, conn: int) -> None:
        while node_id in beating:  # what the endpoint does with each heartbeat it reads
            plane.registry.heartbeat(node_id, conn, clock.now())
            last[node_id] = trio.current_time()
            plane.changes.node_changed()
            await trio.sleep(interval)

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_loop_lag, plane.loop_lag, clock=clock))
        await nursery.start(reconciler(plane))
        for n in ("a", "b"):
            conn = plane.registry.connect(
                hello(n), address="127.0.0.2", cert_serial=1, cert_not_after=2e9, now=clock.now()
            )
            plane.registry.heartbeat(n, conn, clock.now())  # joined before the reconciler looks
            nursery.start_soon(heartbeats, n, conn)
        await trio.sleep(3 * interval + 1)
        beating.discard("b")
        await trio.sleep(interval)  # b's last heartbeat is behind us
        b_last = last["b"]
        stall = TTL + 10
        autojump_clock.jump(stall)  # this task holds the loop: nothing else runs meanwhile
        await trio.sleep(TTL - (trio.current_time() - stall - b_last) - 1)  # short of b's moved deadline
        assert events(caplog) == [("node_joined", "a"), ("node_joined", "b")]
        assert [r.llmgw_fields["cause"] for r in caplog.records if r.getMessage() == "event_loop_lagged"] == [
            "blocked_or_paused"
        ]
        await trio.sleep(interval + 3)  # past it (and past the hold of one interval)
        assert events(caplog) == [("node_joined", "a"), ("node_joined", "b"), ("node_lost", "b")]
        views = {v["id"]: v["state"] for v in plane.views.node_views()}
        assert views == {"a": "joined", "b": "lost"}
        nursery.cancel_scope.cancel()
