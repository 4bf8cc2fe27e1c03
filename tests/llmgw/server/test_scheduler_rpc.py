"""Placement of one llama.cpp model over several nodes (llama.cpp's RPC), in the in-memory harness:
the members are close (one fabric, else one subnet of their addresses), each holds its share of
memory, rank 0 is the fastest, and a replica that cannot be placed says why."""

from __future__ import annotations

import pytest

from llmgw.config import Model, ModelSource
from llmgw.server.state.closeness import group_name, groups_of, subnet_of
from llmgw.server.state.scheduler import GIB, NodeView, plan

NET_A, NET_B = "subnet:10.0.0.0/24", "subnet:10.0.1.0/24"


def node(node_id: str, subnet: str = NET_A, *, mem: float = 16, speed: float = 0.0, **kw) -> NodeView:
    return NodeView(
        node_id=node_id,
        schedulable=kw.pop("schedulable", True),
        engines=frozenset(kw.pop("engines", ("llamacpp", "vllm"))),
        gpus=kw.pop("gpus", 0),
        memory_bytes=int(mem * GIB),
        subnet=subnet,
        speeds=(("llamacpp", "cpu", speed),) if speed else (),
        **kw,
    )


def llama(nodes: int = 2, **kw) -> Model:
    return Model(name="big", engine="llamacpp", nodes_per_replica=nodes, **kw)


@pytest.mark.parametrize(
    ("address", "subnet"),
    [
        ("10.0.0.7", "subnet:10.0.0.0/24"),
        ("192.168.5.200", "subnet:192.168.5.0/24"),
        ("::ffff:10.0.0.7", "subnet:10.0.0.0/24"),  # a dual-stack listener's view of an IPv4 peer
        ("fd00:1:2:3:4:5:6:7", "subnet:fd00:1:2:3::/64"),
        ("[fd00::1]", "subnet:fd00::/64"),
        ("", ""),
        ("node1.example", ""),  # not an address: close by fabric only
    ],
)
def test_a_nodes_subnet_is_its_addresses_slash_24_or_slash_64(address: str, subnet: str) -> None:
    assert subnet_of(address) == subnet


def test_only_llamacpp_is_close_by_subnet_and_a_group_reads_as_its_name() -> None:
    assert groups_of("llamacpp", ("ib@sm1",), NET_A) == ("ib@sm1", NET_A)
    assert groups_of("vllm", ("ib@sm1",), NET_A) == ("ib@sm1",)  # NCCL wants its fabric
    assert groups_of("llamacpp", (), "") == ()
    assert (group_name(NET_A), group_name("ib-a@sm1")) == ("subnet 10.0.0.0/24", "ib-a")


def test_a_llamacpp_replica_spans_nodes_of_one_subnet_without_a_fabric() -> None:
    nodes = [node("a"), node("b"), node("c", NET_B)]
    [r] = plan(nodes, [llama()], []).start
    assert (r.nodes, r.fabric, r.engine) == (("a", "b"), NET_A, "llamacpp")
    # The same nodes cannot take a vLLM model over two nodes: it needs a fabric.
    [pending] = plan(nodes, [Model(name="v", engine="vllm", nodes_per_replica=2)], []).pending
    assert pending.reason.startswith("needs 2 nodes on one fabric, none of the nodes that fit is on a fabric")


def test_nodes_of_two_subnets_are_not_close_and_the_reason_says_so() -> None:
    p = plan([node("a"), node("b", NET_B)], [llama()], [])
    assert p.start == ()
    assert p.pending[0].reason == "needs 2 nodes on one fabric or subnet, 1 available on subnet 10.0.0.0/24"
    # Without an address and a fabric a node is close to none.
    p = plan([node("a", ""), node("b", "")], [llama()], [])
    assert "none of the nodes that fit is on a fabric" in p.pending[0].reason


def test_a_fabric_comes_before_a_subnet_even_a_fuller_one() -> None:
    nodes = [node("a"), node("b"), node("c", fabrics=("ib@sm1",)), node("d", fabrics=("ib@sm1",))]
    [r] = plan(nodes, [llama()], []).start
    assert sorted(r.nodes) == ["c", "d"] and r.fabric == "ib@sm1"
    # The fabric full (no memory left on d): the subnet, which c and d are in too.
    nodes[3] = node("d", mem=1, fabrics=("ib@sm1",))
    [r] = plan(nodes, [llama(memory_gb=4)], []).start
    assert r.fabric == NET_A and "d" not in r.nodes and len(r.nodes) == 2


def test_each_member_needs_its_share_free_after_what_is_placed() -> None:
    # 12 GiB a member: b never fits; each member placed takes 12 GiB of its node.
    nodes = [node("a", mem=30), node("b", mem=8), node("c", mem=16), node("d", mem=30)]
    p = plan(nodes, [llama(replicas=3, memory_gb=12)], [])
    assert [x.nodes for x in p.start] == [("a", "c"), ("d", "a")]  # the second spread: d holds none yet
    assert all(x.memory_bytes == 12 * GIB for x in p.start)
    # Left: a 6 GiB, c 4, d 18: one node fits, not two.
    [pending] = p.pending
    assert pending.reason.startswith("needs 2 nodes on one fabric or subnet, 1 available on subnet 10.0.0.0/24 (")
    assert "a has 6.0 GiB free" in pending.reason and "b has 8.0 GiB free" in pending.reason


def test_only_nodes_with_llamacpp_checked_that_may_take_work_are_members() -> None:
    nodes = [
        node("a"),
        node("no-llama", engines=("vllm",)),
        node("cordoned", schedulable=False, why_not="cordoned"),
        node("failed", avoid=frozenset({"big"})),
        node("b"),
    ]
    [r] = plan(nodes, [llama(nodes=2)], []).start
    assert sorted(r.nodes) == ["a", "b"]
    [pending] = plan(nodes, [llama(nodes=3)], []).pending
    for why in ("no-llama has no working llamacpp", "cordoned cordoned", "failed failed to run it"):
        assert why in pending.reason


def test_the_faster_nodes_are_members_and_the_fastest_is_rank_0() -> None:
    nodes = [node("a", speed=10), node("b", speed=80), node("c", speed=20), node("d", speed=160)]
    [r] = plan(nodes, [llama(nodes=3)], []).start
    assert r.nodes == ("d", "b", "c")
    # No figures at all: as before speeds, by name.
    [r] = plan([node(n) for n in "dcba"], [llama(nodes=3)], []).start
    assert r.nodes == ("a", "b", "c")


def test_rank_0_is_a_node_holding_the_weights_among_equally_fast_ones() -> None:
    model = llama(source=ModelSource(url="https://x/m.gguf", sha256="a" * 64))
    nodes = [node("a", speed=50), node("b", speed=52, holds=frozenset({"a" * 64}))]
    [r] = plan(nodes, [model], []).start
    assert r.nodes == ("b", "a")  # only rank 0 reads the weights: the node that has them


def test_replicas_of_one_model_spread_and_a_kept_replica_is_not_moved() -> None:
    nodes = [node(n) for n in "abcd"]
    first = plan(nodes, [llama(replicas=2)], [])
    assert sorted(n for r in first.start for n in r.nodes) == ["a", "b", "c", "d"]
    again = plan([*nodes, node("e", speed=500)], [llama(replicas=2)], first.placements)
    assert again.keep == first.placements and again.start == again.stop == ()
