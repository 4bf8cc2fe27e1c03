"""Placement in an in-memory harness: no I/O, only a cluster view, a catalog and what runs."""

from __future__ import annotations

import attrs

from llmgw.config import Model
from llmgw.server.state.scheduler import GIB, NodeView, Placement, crowded, plan


def node(node_id: str, *, gpus: int = 0, mem: float = 64, engines=("sim", "llamacpp"), fabrics=(), **kw) -> NodeView:
    return NodeView(
        node_id=node_id,
        schedulable=kw.pop("schedulable", True),
        engines=frozenset(engines),
        gpus=gpus,
        memory_bytes=int(mem * GIB),
        fabrics=tuple(fabrics),
        **kw,
    )


def model(name: str = "m", **kw) -> Model:
    return Model(name=name, engine=kw.pop("engine", "sim"), **kw)


def test_replicas_of_one_model_spread_across_nodes() -> None:
    p = plan([node("a"), node("b"), node("c")], [model(replicas=3)], [])
    assert sorted(x.nodes for x in p.start) == [("a",), ("b",), ("c",)]
    assert [x.replica_id for x in p.start] == ["m-0", "m-1", "m-2"]


def test_existing_placements_are_kept_and_an_unrelated_change_reshuffles_nothing() -> None:
    nodes = [node("a"), node("b"), node("c")]
    first = plan(nodes, [model(replicas=2)], [])
    again = plan([*nodes, node("d")], [model(replicas=2), model("other")], first.placements)
    assert again.keep == first.placements and again.stop == ()
    assert [x.model for x in again.start] == ["other"]


def test_gpus_and_memory_must_fit_after_what_is_placed() -> None:
    nodes = [node("a", gpus=2, mem=16), node("b", gpus=1, mem=64)]
    p = plan(nodes, [model(replicas=3, gpus_per_replica=1, memory_gb=10)], [])
    assert sorted(x.nodes for x in p.start) == [("a",), ("b",)]
    [pending] = p.pending
    assert "needs 1 node with working sim, 1 free GPUs, 10 GiB free" in pending.reason
    assert "a has 1 free GPUs" in pending.reason or "a has 6.0 GiB free" in pending.reason


def test_a_moves_replacement_keeps_its_replica_id_and_its_gpus_from_new_placements() -> None:
    """A replacement on top of the catalog's count (`reserved`) is neither kept nor stopped, but
    a pending replica placed meanwhile takes neither its id nor its node's last GPU."""
    nodes = [node("a", gpus=2), node("b", gpus=1), node("c", gpus=1)]
    first = plan(nodes[:1], [model(replicas=1, gpus_per_replica=1)], [])
    [m0] = first.start
    replacement = attrs.evolve(m0, replica_id="m-1", nodes=("b",))  # m-0 moving to b
    p = plan(nodes, [model(replicas=2, gpus_per_replica=1)], [m0], [replacement])
    assert p.keep == (m0,) and p.stop == ()  # the replacement is the move's, not the plan's
    [new] = p.start
    assert new.replica_id == "m-2" and new.nodes == ("c",)  # not m-1, and not b's one GPU
    p = plan(nodes[:2], [model(replicas=3, gpus_per_replica=1)], [m0], [replacement])
    assert [x.nodes for x in p.start] == [("a",)] and p.pending[0].replicas == 1  # b is full


def test_only_schedulable_nodes_with_the_engine() -> None:
    nodes = [
        node("cordoned", schedulable=False, why_not="cordoned"),
        node("no-engine", engines=("sim",)),
        node("ok"),
    ]
    p = plan(nodes, [model(engine="llamacpp", replicas=2)], [])
    # Spreading is a preference: with one eligible node, both replicas share it.
    assert [x.nodes for x in p.start] == [("ok",), ("ok",)] and p.pending == ()
    p = plan(nodes[:2], [model(engine="llamacpp")], [])
    [pending] = p.pending
    assert "cordoned cordoned" in pending.reason and "no-engine has no working llamacpp" in pending.reason


def test_multi_node_replicas_stay_on_one_fabric_and_say_why_not() -> None:
    nodes = [
        node("a", fabrics=("ib-a@sm1",)),
        node("b", fabrics=("ib-a@sm1",)),
        node("c", fabrics=("ib-b@sm2",)),
        node("island"),
    ]
    p = plan(nodes, [model(nodes_per_replica=2)], [])
    [r] = p.start
    assert r.nodes == ("a", "b") and r.fabric == "ib-a@sm1"
    one_gpu_each = [attrs.evolve(n, gpus=1) for n in nodes]
    p2 = plan(one_gpu_each, [model(nodes_per_replica=2, replicas=2, gpus_per_replica=1)], [])
    [pending] = p2.pending
    # ... and why the others are not candidates: here, their GPUs are taken.
    assert pending.reason == "needs 2 nodes on one fabric, 1 available on ib-b (a has 0 free GPUs; b has 0 free GPUs)"
    p3 = plan([node("x"), node("y")], [model(nodes_per_replica=2)], [])
    assert "none of the nodes that fit is on a fabric" in p3.pending[0].reason


def test_the_same_fabric_name_with_two_identities_is_two_fabrics() -> None:
    nodes = [node("a", fabrics=("ib@sm1",)), node("b", fabrics=("ib@sm2",))]
    p = plan(nodes, [model(nodes_per_replica=2)], [])
    assert p.start == () and p.pending[0].reason == "needs 2 nodes on one fabric, 1 available on ib"


def test_a_lost_node_gets_its_replicas_rebuilt_elsewhere_as_a_whole() -> None:
    fab = ("ib@sm1",)
    nodes = [node(n, fabrics=fab) for n in "abc"]
    first = plan(nodes, [model(nodes_per_replica=2)], [])
    [r] = first.start
    lost = [
        attrs.evolve(n, alive=False, schedulable=False, why_not="lost") if n.node_id == r.nodes[1] else n for n in nodes
    ]
    p = plan(lost, [model(nodes_per_replica=2)], first.placements)
    assert p.stop == (r,)
    [new] = p.start
    assert r.nodes[1] not in new.nodes and len(new.nodes) == 2 and new.replica_id == r.replica_id


def test_a_changed_model_or_a_lower_count_stops_the_right_replicas() -> None:
    nodes = [node("a"), node("b"), node("c")]
    first = plan(nodes, [model(replicas=3)], [])
    fewer = plan(nodes, [model(replicas=1)], first.placements)
    assert [x.replica_id for x in fewer.keep] == ["m-0"]
    assert sorted(x.replica_id for x in fewer.stop) == ["m-1", "m-2"]
    changed = plan(nodes, [model(replicas=1, memory_gb=1)], fewer.keep)
    assert [x.replica_id for x in changed.stop] == ["m-0"] and [x.replica_id for x in changed.start] == ["m-0"]
    gone = plan(nodes, [], first.placements)
    assert len(gone.stop) == 3 and gone.start == ()


def test_a_removed_node_is_like_a_lost_one() -> None:
    r = Placement(replica_id="m-0", model="m", nodes=("gone",), engine="sim")
    p = plan([node("a")], [model()], [r])
    assert p.stop == (r,) and p.start[0].nodes == ("a",)


# -- crowded replicas: candidates for a spreading move -------------------------------------------


def test_replicas_placed_together_while_alone_are_crowded_once_another_node_is_free() -> None:
    alone = plan([node("a")], [model(replicas=3)], [])
    assert [x.nodes for x in alone.start] == [("a",)] * 3  # the only node when they were placed
    assert crowded([node("a")], alone.placements) == []  # nowhere better: not crowded
    # A node joins: every replica but the oldest on "a" may move, the newest first.
    assert crowded([node("a"), node("b")], alone.placements) == ["m-2", "m-1"]


def test_a_node_that_cannot_take_work_makes_nothing_crowded() -> None:
    together = plan([node("a")], [model(replicas=2)], []).placements
    assert crowded([node("a"), node("b", schedulable=False)], together) == []
    spread = plan([node("a"), node("b")], [model(replicas=2)], []).placements
    assert crowded([node("a"), node("b"), node("c")], spread) == []  # already one per node


def test_multi_node_replicas_are_not_moved_for_spreading() -> None:
    placed = [Placement(replica_id=f"m-{i}", model="m", nodes=("a", "b"), engine="sim", fabric="f") for i in range(2)]
    assert crowded([node("a"), node("b"), node("c")], placed) == []


def test_replicas_held_back_for_one_reason_are_one_pending_entry_with_their_count() -> None:
    p = plan([node("a", schedulable=False, why_not="joining")], [model(replicas=3), model("other")], [])
    assert [(x.model, x.replicas) for x in p.pending] == [("m", 3), ("other", 1)]
    assert p.pending[0].reason == "needs 1 node with working sim, none available (a joining)"


def test_a_replica_goes_where_its_weights_are_other_things_equal() -> None:
    from llmgw.config import ModelFile, ModelSource

    files = (
        ModelFile(path="m-00001-of-00002.gguf", size=1, sha256="a" * 64),
        ModelFile(path="m-00002-of-00002.gguf", size=1, sha256="b" * 64),
    )
    hub = model(engine="llamacpp", replicas=2, source=ModelSource(hf="o/r", commit="c" * 40, files=files))
    holds, part = frozenset({"a" * 64, "b" * 64}), frozenset({"a" * 64})
    nodes = [node("a"), node("b", holds=part), node("c", holds=holds), node("d", holds=holds | {"x" * 64})]
    # The two nodes holding both parts, though they sort last by name; spread still comes first.
    assert sorted(x.nodes for x in plan(nodes, [hub], []).start) == [("c",), ("d",)]
    three = plan(nodes, [attrs.evolve(hub, replicas=3)], [])
    assert sorted(x.nodes for x in three.start) == [("a",), ("c",), ("d",)]
    # A URL source counts its one file; a path source none (every node is alike).
    url = model("u", engine="llamacpp", source=ModelSource(url="http://x/m.gguf", sha256="b" * 64))
    assert [x.nodes for x in plan(nodes, [url], []).start] == [("c",)]
    path = model("p", engine="llamacpp", source=ModelSource(path="/m.gguf"))
    assert [x.nodes for x in plan(nodes, [path], []).start] == [("a",)]
    # A drain or a lost node: the replacement goes to the other holder, d, not to a or b.
    placed = plan(nodes, [attrs.evolve(hub, replicas=1)], []).start
    assert [x.nodes for x in placed] == [("c",)]
    drained = [n if n.node_id != "c" else attrs.evolve(n, schedulable=False) for n in nodes]
    fresh = plan([n for n in drained if n.node_id != "c"], [attrs.evolve(hub, replicas=1)], [])
    assert [x.nodes for x in fresh.start] == [("d",)]
