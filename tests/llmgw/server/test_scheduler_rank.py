"""The scheduler's placements are the rule's, however it finds them (`scheduler._Pool`: one pass
over the nodes per model, not per replica): checked against the rule written plainly — every
replica ranks every node — on random clusters, including nodes that fill up, lost and cordoned
nodes, failed models, fabrics, subnets (llama.cpp), measured speeds, weights held and replicas
placed before."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.config import Model, ModelSource
from llmgw.server.state import scheduler
from llmgw.server.state.scheduler import GIB, NodeView, Pending, Placement, Plan, plan


def plainly(nodes: list[NodeView], catalog: list[Model], placed: list[Placement]) -> Plan:
    """The rule as the module's docstring says it, one replica at a time over every node."""
    by_id = {n.node_id: n for n in nodes}
    models = {m.name: m for m in catalog}
    keep, stop = [], []
    for p in sorted(placed, key=lambda p: p.replica_id):
        model = models.get(p.model)
        valid = (
            model is not None
            and scheduler._fits(model, p)
            and all(n in by_id and by_id[n].alive and model.engine in by_id[n].engines for n in p.nodes)
        )
        (keep if valid else stop).append(p)
    for name, model in models.items():
        mine = [p for p in keep if p.model == name]
        for extra in sorted(mine, key=scheduler.replica_slot, reverse=True)[: max(0, len(mine) - model.replicas)]:
            keep.remove(extra)
            stop.append(extra)
    free = scheduler._Free(
        gpus={n.node_id: n.gpus for n in nodes}, memory={n.node_id: n.memory_bytes for n in nodes}, per_model={}
    )
    for p in keep:
        free.take(p)
    start, pending = [], []
    for model in catalog:
        have = [p for p in keep if p.model == model.name]
        used = {scheduler.replica_slot(p) for p in have}
        for _ in range(model.replicas - len(have)):
            slot = next(i for i in range(len(used) + 1) if i not in used)
            candidates, _why = scheduler._candidates(model, nodes, free)
            chosen: tuple[str, ...] = ()
            fabric = ""
            if model.nodes_per_replica == 1:
                chosen = (candidates[0].node_id,) if candidates else ()
            else:
                # Close: one fabric, else (llama.cpp) one subnet; the fullest of each first.
                by_group: dict[str, list[NodeView]] = {}
                for n in candidates:
                    for g in (*n.fabrics, *((n.subnet,) if model.engine == "llamacpp" and n.subnet else ())):
                        by_group.setdefault(g, []).append(n)
                for g in sorted(by_group, key=lambda g: (g.startswith("subnet:"), -len(by_group[g]), g)):
                    if len(by_group[g]) >= model.nodes_per_replica:
                        members = by_group[g][: model.nodes_per_replica]
                        # Rank 0 the fastest, then one holding the weights.
                        may = [
                            n
                            for n in nodes
                            if n.schedulable and model.engine in n.engines and model.name not in n.avoid
                        ]
                        slower, files = scheduler.speed_ranks(model, may), scheduler.model_files(model)
                        members.sort(key=lambda n: (slower[n.node_id], bool(files) and not files <= n.holds))
                        chosen = tuple(n.node_id for n in members)
                        fabric = g
                        break
            if not chosen:
                reason = scheduler._why_not(model, nodes, free)
                if pending and (pending[-1].model, pending[-1].reason) == (model.name, reason):
                    pending[-1] = attrs.evolve(pending[-1], replicas=pending[-1].replicas + 1)
                else:
                    pending.append(Pending(model=model.name, reason=reason))
                continue
            placement = Placement(
                replica_id=f"{model.name}-{slot}",
                model=model.name,
                nodes=chosen,
                gpus_per_node=model.gpus_per_replica,
                memory_bytes=int(model.memory_gb * GIB),
                engine=model.engine,
                fabric=fabric,
            )
            used.add(slot)
            free.take(placement)
            start.append(placement)
    return Plan(keep=tuple(keep), start=tuple(start), stop=tuple(stop), pending=tuple(pending))


FABRICS = ("ib-a@1", "ib-b@2", "roce@3")
SUBNETS = ("", "subnet:10.0.0.0/24", "subnet:10.0.1.0/24")
WEIGHTS = ModelSource(url="https://x/m.gguf", sha256="a" * 64)


@st.composite
def clusters(draw):
    count = draw(st.integers(1, 12))
    nodes = [
        NodeView(
            node_id=f"n{i:02d}",
            schedulable=draw(st.booleans()) or draw(st.booleans()),  # mostly
            engines=frozenset(draw(st.sets(st.sampled_from(["vllm", "llamacpp"]), min_size=1))),
            gpus=draw(st.integers(0, 8)),
            memory_bytes=draw(st.integers(0, 64)) * GIB,
            fabrics=tuple(draw(st.sets(st.sampled_from(FABRICS), max_size=2))),
            alive=draw(st.booleans()) or draw(st.booleans()),
            avoid=frozenset(draw(st.sets(st.sampled_from(["m0", "m1"]), max_size=1))),
            subnet=draw(st.sampled_from(SUBNETS)),
            speeds=tuple(
                ("llamacpp", "cpu", tps) for tps in draw(st.lists(st.sampled_from([10.0, 11.0, 40.0]), max_size=1))
            ),
            holds=frozenset(draw(st.sets(st.just("a" * 64)))),
        )
        for i in range(count)
    ]
    catalog = [
        Model(
            name=f"m{k}",
            engine=draw(st.sampled_from(["vllm", "llamacpp"])),
            replicas=draw(st.integers(0, 12)),
            gpus_per_replica=draw(st.integers(0, 4)),
            nodes_per_replica=draw(st.sampled_from([1, 1, 2, 3])),
            memory_gb=float(draw(st.integers(0, 24))),
            source=draw(st.sampled_from([ModelSource(), WEIGHTS])),
        )
        for k in range(draw(st.integers(1, 4)))
    ]
    # Some replicas placed before (a plan of an earlier cluster), some of them no longer valid.
    before = plan(nodes, catalog, []).placements
    placed = list(draw(st.lists(st.sampled_from(before), unique=True))) if before else []
    return nodes, catalog, placed


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_the_plan_is_the_rules_plan(cluster) -> None:
    nodes, catalog, placed = cluster
    assert plan(nodes, catalog, placed) == plainly(nodes, catalog, placed)
