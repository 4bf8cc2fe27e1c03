"""Placement weighs nodes by the speed they measured (agent.bench), in the in-memory harness: the
faster first among the nodes that fit, by the backend a replica would use there; figures within
SPEED_STEP alike; a node without a figure in the middle; no figures, placement as before."""

from __future__ import annotations

from llmgw.config import Model, ModelSource
from llmgw.server.state.scheduler import GIB, NodeView, plan, speed_of, speed_ranks


def node(node_id: str, *speeds: tuple[str, float], gpus: int = 0, mem: float = 64, holds=frozenset()) -> NodeView:
    return NodeView(
        node_id=node_id,
        schedulable=True,
        engines=frozenset({"llamacpp", "sim"}),
        gpus=gpus,
        memory_bytes=int(mem * GIB),
        speeds=tuple(("llamacpp", backend, tps) for backend, tps in speeds),
        holds=frozenset(holds),
    )


def llama(replicas: int = 1, **kw) -> Model:
    return Model(name="m", engine="llamacpp", replicas=replicas, **kw)


def test_the_faster_node_is_taken_first_then_spreading_still_comes_first() -> None:
    nodes = [node("a", ("cpu", 10.0)), node("b", ("cpu", 80.0)), node("c", ("cpu", 40.0))]
    assert [p.nodes for p in plan(nodes, [llama(1)], []).start] == [("b",)]
    # Spread before speed: three replicas go to three nodes, fastest first.
    assert [p.nodes for p in plan(nodes, [llama(3)], []).start] == [("b",), ("c",), ("a",)]
    # The fast node full: the next fastest that fits.
    full = [node("a", ("cpu", 10.0)), node("b", ("cpu", 80.0), mem=2), node("c", ("cpu", 40.0))]
    assert [p.nodes for p in plan(full, [llama(1, memory_gb=4)], []).start] == [("c",)]


def test_a_model_on_gpus_is_placed_by_the_gpu_backends_speed_and_one_on_the_cpu_by_the_cpus() -> None:
    gpu_fast_cpu_slow = node("a", ("cpu", 10.0), ("cuda", 400.0), gpus=1)
    gpu_slow_cpu_fast = node("b", ("cpu", 60.0), ("cuda", 150.0), ("vulkan", 90.0), gpus=1)
    nodes = [gpu_fast_cpu_slow, gpu_slow_cpu_fast]
    assert speed_of(gpu_slow_cpu_fast, llama(gpus_per_replica=1)) == 150.0
    assert speed_of(gpu_slow_cpu_fast, llama()) == 60.0
    assert plan(nodes, [llama(gpus_per_replica=1)], []).start[0].nodes == ("a",)
    assert plan(nodes, [llama()], []).start[0].nodes == ("b",)
    # Another engine's figures say nothing of this one.
    assert speed_of(gpu_fast_cpu_slow, Model(name="s", engine="sim")) == 0.0


def test_figures_within_a_step_rank_alike_and_the_other_rules_decide() -> None:
    # 50 and 55 are within SPEED_STEP: the node already holding the weights wins, as before.
    held = llama(source=ModelSource(url="https://x/m.gguf", sha256="a" * 64))
    nodes = [node("a", ("cpu", 55.0)), node("b", ("cpu", 50.0), holds={"a" * 64})]
    ranks = speed_ranks(held, nodes)
    assert ranks["a"] == ranks["b"]
    assert plan(nodes, [held], []).start[0].nodes == ("b",)
    # Twice as fast outweighs downloading the weights once.
    nodes = [node("a", ("cpu", 100.0)), node("b", ("cpu", 50.0), holds={"a" * 64})]
    assert plan(nodes, [held], []).start[0].nodes == ("a",)


def test_a_node_without_a_figure_ranks_in_the_middle_and_no_figures_place_as_before() -> None:
    nodes = [node("a", ("cpu", 10.0)), node("b"), node("c", ("cpu", 100.0))]
    ranks = speed_ranks(llama(), nodes)
    assert ranks["c"] < ranks["b"] < ranks["a"]
    assert [p.nodes for p in plan(nodes, [llama(3)], []).start] == [("c",), ("b",), ("a",)]
    # No figures: by name, as placement always did among equals.
    bare = [node("c"), node("a"), node("b")]
    assert set(speed_ranks(llama(), bare).values()) == {0}
    assert [p.nodes for p in plan(bare, [llama(3)], []).start] == [("a",), ("b",), ("c",)]


def test_placements_kept_stay_where_they_are_when_a_faster_node_measures() -> None:
    first = plan([node("a", ("cpu", 10.0)), node("b")], [llama(1)], [])
    assert first.start[0].nodes == ("a",)
    again = plan([node("a", ("cpu", 10.0)), node("b", ("cpu", 500.0))], [llama(1)], first.placements)
    assert again.keep == first.placements and again.start == () and again.stop == ()
