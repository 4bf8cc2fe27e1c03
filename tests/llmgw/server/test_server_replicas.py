"""The control plane's replicas: placed from the catalog, stored, adopted after a restart,
moved off a lost node (fenced there), rebuilt elsewhere when they fail."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.config import HubSection, Model, ModelSource
from llmgw.fabrics import FabricMap
from llmgw.gatewayd import table
from llmgw.server.links.gatewaytable import rotation_message
from llmgw.server.state.placements import Placements, Stored
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas, sealed_keys
from llmgw.server.state.rotation import gateway_rotation
from llmgw.server.state.scheduler import Placement
from llmgw.server.state.weights import weights_source
from llmgw.server.store import keyseal
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wire import agent_link as w
from llmgw.wire.convert import decode, encode
from llmgw.wire.gateway_link import ControlMessage

TTL = 10.0
SIM = (w.EngineStatus(name="sim", version="1", ok=True),)
CATALOG = [Model(name="chat", engine="sim", replicas=2)]


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
        engines=SIM,
    )
    conn = reg.connect(hello, address=f"10.0.0.{len(reg.nodes) + 1}", cert_serial=1, cert_not_after=2e9, now=now)
    reg.heartbeat(node_id, conn, now)
    return conn


def replicas(tmp_path: Path, reg: NodeRegistry, catalog=CATALOG) -> Replicas:
    store = AsyncStore.open(tmp_path)
    keys = keyseal.load(tmp_path, sealed_keys=sealed_keys(store.at_open.placements))
    return Replicas(store, reg, lambda: catalog, lambda: FabricMap(fabrics=(), notes=()), keys)


def test_placed_stored_and_handed_to_each_node(tmp_path: Path) -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    for n in ("a", "b"):
        joined(reg, n, 1)
    r = replicas(tmp_path, reg)
    assert r.reconcile(1) == {"a", "b"}
    [on_a] = r.assignments_for("a", lambda name: CATALOG[0])
    [on_b] = r.assignments_for("b", lambda name: CATALOG[0])
    assert {on_a.replica_id, on_b.replica_id} == {"chat-0", "chat-1"}
    assert on_a.api_key and on_a.api_key != on_b.api_key  # a secret per replica
    assert r.reconcile(2) == set()  # nothing changed, nothing pushed
    # The weights' size and the download maximum travel with the assignment.
    sized = Model(
        name="chat", engine="sim", replicas=2, source=ModelSource(url="https://h/m.gguf", sha256="a" * 64, size=7)
    )
    (tmp_path / "sized").mkdir(mode=0o700)
    r = replicas(tmp_path / "sized", reg, [sized])
    r.reconcile(3)
    [with_size] = r.assignments_for(
        "a", lambda name: sized, partial(weights_source, max_weights_bytes=64 << 30, hub=HubSection())
    )
    assert (with_size.weights.size, with_size.weights.max_bytes) == (7, 64 << 30)


def test_a_model_with_cache_events_tells_its_node_and_the_gateways_learn_where_its_engine_publishes(
    tmp_path: Path,
) -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    conn = joined(reg, "a", 1)
    catalog = [Model(name="chat", engine="sim", replicas=1, cache_events=True)]
    r = replicas(tmp_path, reg, catalog)
    r.reconcile(1)
    [on_a] = r.assignments_for("a", lambda name: catalog[0])
    assert on_a.cache_events is True
    status = w.ReplicaStatus(replica_id=on_a.replica_id, model="chat", state=w.READY, port=8000, events_port=8001)
    reg.replicas_changed("a", conn, (status,))
    rotation = gateway_rotation(reg, r, catalog, (), 2)
    assert [(e.port, e.events_port) for e in rotation.endpoints] == [(8000, 8001)]
    received = decode(encode(rotation_message(rotation)), ControlMessage)  # over the gateway link
    [sent] = received.endpoints
    assert table.endpoint(sent).events_port == 8001  # as a gateway process holds it


@pytest.mark.trio
async def test_after_a_control_plane_restart_the_same_replicas_are_kept(tmp_path: Path) -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    for n in ("a", "b"):
        joined(reg, n, 1)
    first = replicas(tmp_path, reg)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.saver.serve)
        first.reconcile(1)
        nursery.cancel_scope.cancel()  # a stop at once: the writer's last flush saves them
    assert not first.saver.pending
    keys = {k: v.api_key for k, v in first.placed.items()}
    # A new control plane: nodes known from the store, not reconnected yet.
    reg2 = NodeRegistry(heartbeat_ttl_s=TTL, started_at=100)
    for n in ("a", "b"):
        reg2.know(n)
    second = replicas(tmp_path, reg2)
    assert second.reconcile(101) == set()
    assert {k: v.api_key for k, v in second.placed.items()} == keys
    for n in ("a", "b"):
        joined(reg2, n, 102)  # the agents come back
    assert second.reconcile(102) == set()  # adopted: none restarted


@pytest.mark.trio
async def test_after_a_restart_a_replica_whose_node_is_not_back_is_unknown_to_gateways_until_it_returns_or_is_lost(
    tmp_path: Path,
) -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    for n in ("a", "b"):
        joined(reg, n, 1)
    first = replicas(tmp_path, reg)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.saver.serve)
        first.reconcile(1)
        nursery.cancel_scope.cancel()
    home = {stored.placement.nodes[0]: rid for rid, stored in first.placed.items()}
    reg2 = NodeRegistry(heartbeat_ttl_s=TTL, started_at=100, reconnect_grace_s=5)
    for n in ("a", "b"):
        reg2.know(n)
    second = replicas(tmp_path, reg2)
    second.reconcile(101)
    rotation = gateway_rotation(reg2, second, CATALOG, (), 101)
    assert rotation.endpoints == () and rotation.unknown == {"chat-0", "chat-1"}  # not gone: not known yet

    conn = joined(reg2, "a", 102)  # a's agent is back, its engine serving on
    reg2.replicas_changed("a", conn, (w.ReplicaStatus(replica_id=home["a"], model="chat", state=w.READY, port=8000),))
    rotation = gateway_rotation(reg2, second, CATALOG, (), 102)
    assert [(e.replica_id, e.port) for e in rotation.endpoints] == [(home["a"], 8000)]
    assert rotation.unknown == {home["b"]}

    reg2.heartbeat("a", conn, 100 + TTL + 5)
    rotation = gateway_rotation(reg2, second, CATALOG, (), 100 + TTL + 5 + 1)  # b lost: its grace is over
    assert [e.replica_id for e in rotation.endpoints] == [home["a"]] and rotation.unknown == frozenset()


def test_a_lost_nodes_replica_moves_and_is_fenced_there(tmp_path: Path) -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    for n in ("a", "b", "c"):
        joined(reg, n, 1)
    r = replicas(tmp_path, reg, [Model(name="chat", engine="sim", replicas=1)])
    r.reconcile(1)
    [(rid, stored)] = r.placed.items()
    home = stored.placement.nodes[0]
    for n in ("a", "b", "c"):
        if n != home:
            reg.heartbeat(n, reg.nodes[n].link.conn_id, 1 + TTL)
    changed = r.reconcile(1 + TTL + 1)  # `home` has been silent for longer than the TTL
    new_home = r.placed[rid].placement.nodes[0]
    assert new_home != home and changed == {home, new_home}
    assert r.assignments_for(home, lambda name: Model(name="chat", engine="sim")) == ()  # it must stop there


def test_a_failed_replica_is_rebuilt_on_another_node(tmp_path: Path) -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    for n in ("a", "b"):
        joined(reg, n, 1)
    r = replicas(tmp_path, reg, [Model(name="chat", engine="sim", replicas=1)])
    r.reconcile(1)
    [(rid, stored)] = r.placed.items()
    home = stored.placement.nodes[0]
    status = w.ReplicaStatus(replica_id=rid, model="chat", state=w.FAILED, detail="exit 3")
    assert r.note_statuses(home, (status,))
    r.reconcile(2)
    assert r.placed[rid].placement.nodes[0] != home


def pending_events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.llmgw_fields["reason"]) for r in caplog.records if r.getMessage() == "replica_pending"]


def test_a_pending_replica_is_logged_once_and_a_forming_cluster_is_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0, reconnect_grace_s=5)
    r = replicas(tmp_path, reg, [Model(name="chat", engine="sim", replicas=2), Model(name="gpu", engine="vllm")])
    r.reconcile(1)  # just started, no node yet
    conn = reg.connect(
        w.Hello(
            protocol_version=w.PROTOCOL_VERSION,
            node_id="a",
            agent_version="t",
            boot_id="b",
            started_at=1.0,
            inventory=None,
            engines=(),  # the agent has not checked its engines yet
        ),
        address="10.0.0.1",
        cert_serial=1,
        cert_not_after=2e9,
        now=2,
    )
    r.reconcile(2)
    r.reconcile(2.5)  # the same again: nothing new to say
    reg.heartbeat("a", conn, 3)
    r.reconcile(3)
    reg.engines_changed("a", conn, SIM)
    r.reconcile(4)  # chat placed; the vLLM model still has nowhere to go, and the cluster is forming
    assert all(level == "INFO" for level, _ in pending_events(caplog)), pending_events(caplog)
    assert [reason for _, reason in pending_events(caplog)] == [
        "needs 1 node with working sim, none available (no nodes)",
        "needs 1 node with working vllm, none available (no nodes)",
        "needs 1 node with working sim, none available (a joining)",
        "needs 1 node with working vllm, none available (a joining)",
        "needs 1 node with working sim, none available (a has not reported its engines yet)",
        "needs 1 node with working vllm, none available (a has not reported its engines yet)",
        "needs 1 node with working vllm, none available (a has no working vllm)",
    ]
    caplog.clear()
    reg.heartbeat("a", conn, TTL + 5.5)
    r.reconcile(TTL + 5.5)  # formed: what is still pending now is a problem, said once
    r.reconcile(TTL + 6)
    assert pending_events(caplog) == [
        ("WARNING", "needs 1 node with working vllm, none available (a has no working vllm)")
    ]
    assert [v.replicas for v in r.pending] == [1]


def test_rendezvous_ports_are_drawn_below_the_ephemeral_range() -> None:
    """A rendezvous port among the ephemeral ones may be the local end of any outgoing connection on
    the rank-0 node; the draw stays below Linux's default range (and this machine's)."""
    from llmgw.server.state.replicas import DIST_INIT_PORTS, _free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert DIST_INIT_PORTS.stop <= min(low, 32768)
    used = set(DIST_INIT_PORTS[:-1])
    assert _free_port(used) == DIST_INIT_PORTS[-1]  # never one already used


def test_each_models_details_say_its_routes_its_created_and_why_none_can_become_ready(tmp_path: Path) -> None:
    """What the gateways learn of each model (`ModelInfo`): a model with a replica on its way is
    not unservable (its requests wait); one with nowhere to go, or only lost nodes, is, with the
    reason; while the cluster is still forming, nothing is."""
    from llmgw.wire import gateway_link as g

    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0, reconnect_grace_s=0)
    catalog = [
        Model(name="chat", engine="sim", replicas=1),
        Model(name="huge", engine="sim", replicas=1, memory_gb=1000),
        Model(name="embed", engine="vllm", args=("--runner", "pooling")),
    ]
    now = TTL + 5  # past the forming window
    joined(reg, "a", now)
    r = replicas(tmp_path, reg, catalog)
    r.reconcile(now)

    def details(at: float) -> dict[str, g.ModelInfo]:
        rotation = gateway_rotation(reg, r, catalog, (), at, {"chat": 1234.0})
        return {d.name: d for d in rotation.details}

    got = details(now)
    assert got["chat"] == g.ModelInfo(name="chat", engine="sim", routes=(g.CHAT, g.COMPLETIONS), created=1234)
    assert got["huge"].unservable.startswith("no replica can be placed: ") and got["huge"].retry_after_s == 30
    assert got["embed"].routes == (g.EMBEDDINGS, g.SCORE, g.RERANK, g.TOKENIZE, g.DETOKENIZE)
    assert got["embed"].unservable  # no node has vLLM
    # Starting, then failed there with nowhere else to go.
    [(rid, stored)] = [(k, s) for k, s in r.placed.items() if s.placement.model == "chat"]
    reg.nodes["a"].replicas = (w.ReplicaStatus(replica_id=rid, model="chat", state=w.STARTING),)
    assert details(now)["chat"].unservable == ""
    assert r.note_statuses("a", (w.ReplicaStatus(replica_id=rid, model="chat", state=w.FAILED, detail="exit 3"),))
    r.reconcile(now)
    assert details(now)["chat"].unservable.startswith("no replica can be placed: ")
    # Its only node lost: the reason names it.
    r2 = replicas(tmp_path / "two", reg, catalog[:1])
    joined(reg, "b", now)
    r2.reconcile(now)
    home = next(iter(r2.placed.values())).placement.nodes[0]
    later = now + TTL + 1  # nobody heard since `now`
    rotation = gateway_rotation(reg, r2, catalog[:1], (), later, {})
    assert rotation.details[0].unservable == f"the nodes of its replicas are lost: {home}"
    # While the cluster forms (just after a start), nothing is unservable: nodes may be on their way.
    early = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    r3 = replicas(tmp_path / "three", early, catalog)
    r3.reconcile(1)
    assert all(d.unservable == "" for d in gateway_rotation(early, r3, catalog, (), 1, {}).details)
    # Just after a start with every node here, nothing is on its way: what cannot be placed is
    # unservable at once (not only past the window in which absent nodes may come back).
    fresh = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0, reconnect_grace_s=30)
    joined(fresh, "a", 1)
    r4 = replicas(tmp_path / "four", fresh, catalog[:2])
    r4.reconcile(2)
    got = {d.name: d for d in gateway_rotation(fresh, r4, catalog[:2], (), 2, {}).details}
    assert got["chat"].unservable == "" and got["huge"].unservable.startswith("no replica can be placed: ")
    # A node installing the engine a model needs: its replica is on its way, not unservable.
    reg5 = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0, reconnect_grace_s=0)
    joined(reg5, "a", now)
    r5 = replicas(tmp_path / "five", reg5, catalog[2:])
    r5.reconcile(now)
    assert gateway_rotation(reg5, r5, catalog[2:], (), now, {}).details[0].unservable  # no vllm at all
    reg5.nodes["a"].engines = (*SIM, w.EngineStatus(name="vllm", version="", ok=False, state=w.ENGINE_INSTALLING))
    assert gateway_rotation(reg5, r5, catalog[2:], (), now, {}).details[0].unservable == ""


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "del", "pop"]),
            st.sampled_from([f"r{i}" for i in range(6)]),
            st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=2, unique=True),
        ),
        max_size=40,
    )
)
def test_the_placements_index_by_node_follows_every_change(steps) -> None:
    """`Placements.on(node)` (what a node's desired state lists) is always what a look over all
    of them would find, whatever was set, replaced, deleted or popped."""
    placed, plain = Placements(), {}
    for op, rid, nodes in steps:
        stored = Stored(
            placement=Placement(replica_id=rid, model="m", engine="sim", nodes=tuple(nodes)),
            api_key="k",
            sealed_key="s",
        )
        if op == "set":
            placed[rid], plain[rid] = stored, stored
        elif rid in plain:
            del plain[rid]
            if op == "del":
                del placed[rid]
            else:
                assert placed.pop(rid).placement.replica_id == rid
        else:
            assert placed.pop(rid, None) is None
        for node in "abcd":
            assert placed.on(node) == {k for k, v in plain.items() if node in v.placement.nodes}
    assert dict(placed) == plain and Placements(plain.items()).on("a") == placed.on("a")
    with pytest.raises(TypeError, match="by item only"):
        placed.update(plain)
