"""A llama.cpp replica over several nodes (llama.cpp's RPC) on the control plane, with the registry's
time passed in (no clock read, no sleep): placed on close nodes from their addresses, each member
told every member's address in rank order, rebuilt elsewhere as a whole when a helper is lost or
its member fails, moved as a whole by a drain (on MockClock), reached by the gateways at rank 0
only, and shown with its members."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.config import Model, ModelSource, ServerConfig, ServerSection
from llmgw.fabrics import FabricMap
from llmgw.server.app import ControlPlane
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas, sealed_keys
from llmgw.server.state.rotation import gateway_rotation
from llmgw.server.state.views import replica_view
from llmgw.server.store import keyseal
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wire import agent_link as w
from testlib.controlplane import OFFLINE_ENGINES, make_state
from testlib.waiting import await_true

TTL = 10.0
LLAMA = (w.EngineStatus(name="llamacpp", version="b1", ok=True),)
BIG = Model(name="big", engine="llamacpp", nodes_per_replica=2, source=ModelSource(path="/models/big.gguf"))
ADDRESSES = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3", "far": "10.9.0.1"}


def joined(reg: NodeRegistry, node_id: str, now: float) -> int:
    hello = w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node_id,
        agent_version="t",
        boot_id="b",
        started_at=1.0,
        inventory=w.Inventory(
            hostname=node_id,
            os="l",
            arch="x86_64",
            python="3.11",
            cpu_model="c",
            cpu_cores=2,
            memory_total_bytes=8 << 30,
        ),
        engines=LLAMA,
    )
    conn = reg.connect(hello, address=ADDRESSES[node_id], cert_serial=1, cert_not_after=2e9, now=now)
    reg.heartbeat(node_id, conn, now)
    return conn


def cluster(tmp_path: Path, nodes: str | list[str], catalog=(BIG,)) -> tuple[NodeRegistry, Replicas, dict[str, int]]:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    conns = {n: joined(reg, n, 1) for n in nodes}
    store = AsyncStore.open(tmp_path)
    keys = keyseal.load(tmp_path, sealed_keys=sealed_keys(store.at_open.placements))
    return reg, Replicas(store, reg, lambda: list(catalog), lambda: FabricMap(fabrics=(), notes=()), keys), conns


def model_of(name: str) -> Model:
    return BIG


def test_each_member_is_told_every_members_address_in_rank_order(tmp_path: Path) -> None:
    reg, r, _ = cluster(tmp_path, ["a", "b", "far"])
    assert r.reconcile(1) == {"a", "b"}  # far is on another subnet: not close to a or b
    [placed] = r.placed.values()
    assert placed.placement.nodes == ("a", "b") and placed.placement.fabric == "subnet:10.0.0.0/24"
    [rank0] = r.assignments_for("a", model_of)
    [helper] = r.assignments_for("b", model_of)
    for member, rank in ((rank0, 0), (helper, 1)):
        assert member.node_rank == rank and member.nodes == ("a", "b")
        assert member.member_addrs == ("10.0.0.1", "10.0.0.2") and member.rank0_addr == "10.0.0.1"
        assert member.dist_init_port == placed.dist_init_port > 0  # where helpers serve their RPC
        assert member.weights == rank0.weights and member.api_key == rank0.api_key
    assert r.assignments_for("far", model_of) == ()


def test_a_replica_on_one_node_or_of_another_engine_is_told_no_addresses(tmp_path: Path) -> None:
    one = Model(name="one", engine="llamacpp", source=ModelSource(path="/models/one.gguf"))
    _, r, _ = cluster(tmp_path, ["a"], catalog=(one,))
    r.reconcile(1)
    [alone] = r.assignments_for("a", lambda name: one)
    assert alone.member_addrs == () and alone.rank0_addr == ""
    [p] = r.placed.values()
    assert r.member_addrs(p.placement) == ()
    sim = p.placement.__class__(replica_id="s-0", model="s", nodes=("a", "b"), engine="sim")
    assert r.member_addrs(sim) == ()  # a sim or vLLM replica rendezvouses at rank0_addr alone


def test_a_lost_helper_stops_the_replica_and_it_is_placed_again_as_a_whole_without_it(tmp_path: Path) -> None:
    reg, r, conns = cluster(tmp_path, ["a", "b", "c"])
    r.reconcile(1)
    [(rid, before)] = r.placed.items()
    helper = before.placement.nodes[1]
    others = [n for n in "abc" if n != helper]
    # The helper falls silent; the others heartbeat on. Within its TTL nothing moves.
    for now in (5.0, 10.0):
        for n in others:
            reg.heartbeat(n, conns[n], now)
        assert r.reconcile(now) == set()
    now = 1 + TTL + 1
    for n in others:
        reg.heartbeat(n, conns[n], now)
    changed = r.reconcile(now)
    after = r.placed[rid]
    assert set(after.placement.nodes) == set(others) and helper in changed
    assert r.assignments_for(helper, model_of) == ()  # fenced: its agent stops its member when it returns
    [rank0] = r.assignments_for(after.placement.nodes[0], model_of)
    assert rank0.member_addrs == tuple(ADDRESSES[n] for n in after.placement.nodes)
    assert after.api_key != before.api_key  # a new replica, not the old one's members re-ranked


def test_a_helpers_failed_member_has_the_replica_rebuilt_on_other_nodes(tmp_path: Path) -> None:
    reg, r, conns = cluster(tmp_path, ["a", "b", "c"])
    r.reconcile(1)
    [(rid, before)] = r.placed.items()
    helper = before.placement.nodes[1]
    failed = w.ReplicaStatus(
        replica_id=rid, model="big", state=w.FAILED, node_rank=1, detail="ggml-rpc-server: not found"
    )
    assert r.note_statuses(helper, (failed,))
    assert rid not in r.placed  # stopped at once, on every member
    r.reconcile(2)
    again = r.placed[rid]
    assert helper not in again.placement.nodes and len(again.placement.nodes) == 2
    assert r.node_views(2)[sorted("abc").index(helper)].avoid == frozenset({"big"})


def test_the_gateways_reach_rank_0_only_once_it_is_ready(tmp_path: Path) -> None:
    reg, r, conns = cluster(tmp_path, ["a", "b"])
    r.reconcile(1)
    [(rid, placed)] = r.placed.items()
    rank0, helper = placed.placement.nodes

    def report(node: str, rank: int, state: str, port: int) -> None:
        status = w.ReplicaStatus(replica_id=rid, model="big", state=state, node_rank=rank, port=port)
        reg.replicas_changed(node, conns[node], (status,))

    report(helper, 1, w.READY, 50052)  # the helper's RPC server is up: nothing for a gateway
    assert gateway_rotation(reg, r, [BIG], (), 2).endpoints == ()
    report(rank0, 0, w.READY, 8080)
    [endpoint] = gateway_rotation(reg, r, [BIG], (), 2).endpoints
    assert (endpoint.host, endpoint.port, endpoint.replica_id) == (ADDRESSES[rank0], 8080, rid)


def test_the_replica_is_shown_with_its_members_in_rank_order(tmp_path: Path) -> None:
    reg, r, conns = cluster(tmp_path, ["a", "b"])
    r.reconcile(1)
    [(rid, placed)] = r.placed.items()
    rank0, helper = placed.placement.nodes
    reg.replicas_changed(
        helper, conns[helper], (w.ReplicaStatus(replica_id=rid, model="big", state=w.READY, node_rank=1),)
    )
    # As `llmgw ctl replicas` and the page get it (ClusterViews.replica): each member's report, in rank order.
    members = [next((x for x in reg.nodes[n].replicas if x.replica_id == rid), None) for n in placed.placement.nodes]
    shown = replica_view(rid, placed, members)
    assert shown["nodes"] == [rank0, helper] and shown["engine"] == "llamacpp"
    assert shown["member_states"] == ["assigned", "ready"] and shown["state"] == "assigned,ready"
    assert shown["fabric"] == "subnet:10.0.0.0/24"


@pytest.mark.trio
async def test_a_drain_of_a_helper_moves_the_replica_as_a_whole_once_its_replacement_is_ready(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    config = ServerConfig(engines=OFFLINE_ENGINES, server=ServerSection(state_dir=str(state)), models=(BIG,))
    plane = ControlPlane.open(config, state)
    await nursery.start(plane.drains.serve)
    now = trio.current_time()
    for n in ("a", "b", "c"):
        await plane.store.saw_node(n, ADDRESSES[n])
        joined(plane.registry, n, now)
    plane.replicas.reconcile(now)
    [(rid, original)] = plane.replicas.placed.items()
    helper = original.placement.nodes[1]
    progress = await plane.operations.start_drain(helper, force=False)
    await await_true(lambda: plane.replicas.surge, "the replacement", changed=plane.replicas.saver.to_write.next)
    [replacement] = sorted(plane.replicas.surge)
    new = plane.replicas.placed[replacement].placement
    assert helper not in new.nodes and len(new.nodes) == 2 and rid in plane.replicas.placed  # the original serves on
    # Its helper's member ready is not enough: the replacement is ready when its rank 0 is.
    for rank in (1, 0):
        node = new.nodes[rank]
        status = (w.ReplicaStatus(replica_id=replacement, model="big", state=w.READY, node_rank=rank),)
        plane.registry.nodes[node].replicas = status  # as the endpoint records a ReplicasChanged
        plane._replicas_reported(node, status)
        if rank == 1:
            await trio.sleep(5)  # fake time, within the heartbeat TTL
            assert not progress.done and rid in plane.replicas.placed
    await progress.finished.wait()
    assert progress.done and rid not in plane.replicas.placed
    assert not any(helper in s.placement.nodes for s in plane.replicas.placed.values())
