"""What one control plane's own work costs as the cluster grows (issue 31): so far the parts that
need no agents, placement and reconciling, measured in this process.

    PYTHONPATH=src/python:tests:tools python3 tools/bench/controlplane.py [--nodes N] [--replicas R]
        [--reconcile-nodes M] [--reconcile-replicas Q] [--rounds K]

1. placement: `scheduler.plan` places R replicas (default 10,000) over N nodes (default 1,000:
   8 GPUs, 512 GiB and two fabrics each, four InfiniBand fabrics and two RoCE ones across them)
   from nothing; the catalog is 40 % single-node one-GPU models, 10 % two-node models (one GPU
   on each node, on one fabric), and the rest CPU-only replicas (no GPU, 4 GiB each), which
   all fit. `placement_ms` (named by the count: `placement_ms_10k` at the default) is the best
   of K rounds (default 3), `replan_ms` the plan of the same cluster with every replica placed
   (all kept), `placement_started` and `placement_pending` what the first plan did.
2. reconcile: one `Replicas.reconcile` pass (`llmgw.server.replicas`, with its store in a
   temporary directory) over M joined nodes (default 1,000) and a catalog of Q replicas
   (default 2,000) of the same mix: `reconcile_first_ms` the pass that places them all,
   `reconcile_ms` a pass that finds nothing to change (the reconciler's steady state), best of
   K; and `list_nodes_ms`, what `GET /admin/v1/nodes` makes of all M nodes (their views and
   the JSON answer, `list_nodes_bytes` long; the HTTP around it aside), best of K.

Prints one JSON object: the settings, the figures, TARGETS (placement under 1 s) and `ok`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import attrs
import trio

from llmgw.config import Model, ServerConfig
from llmgw.fabrics import fabric_map
from llmgw.http.messages import Response
from llmgw.server import keyseal
from llmgw.server.asyncstore import AsyncStore
from llmgw.server.changes import Changes
from llmgw.server.registry import NodeRegistry
from llmgw.server.replicas import Replicas, sealed_keys
from llmgw.server.scheduler import GIB, NodeView, plan
from llmgw.server.views import ClusterViews
from llmgw.wire import agent_link as w

# At most (issue 31): placing 10,000 replicas over 1,000 nodes; listing 1,000 nodes (here without
# the HTTP around it, which the admin API's own tests time apart).
TARGETS = {"placement_ms_10k": 1000.0, "list_nodes_ms": 200.0}
GPUS, MEMORY = 8, 512 * GIB
ENGINE = "vllm"
MAX_NODES, MAX_REPLICAS = 20_000, 200_000


def fabrics_of(i: int) -> tuple[tuple[str, str], ...]:
    """Node i's fabrics as (name, identity): one of four InfiniBand ones and one of two RoCE."""
    return ((f"ib-{i % 4}", f"fe80::{i % 4:x}"), (f"roce-{i % 2}", f"roce-subnet-{i % 2}"))


def catalog(replicas: int) -> list[Model]:
    """R replicas: 40 % single-node one-GPU, 10 % two-node, the rest CPU-only, over 20 models."""
    single, double = replicas * 4 // 10, replicas // 10
    cpu = replicas - single - double
    models = []
    for kind, count, per in (("gpu", single, 8), ("pair", double, 4), ("cpu", cpu, 8)):
        for k in range(per):
            share = count // per + (1 if k < count % per else 0)
            if not share:
                continue
            if kind == "gpu":
                models.append(Model(name=f"{kind}{k}", engine=ENGINE, replicas=share, gpus_per_replica=1, memory_gb=10))
            elif kind == "pair":
                models.append(
                    Model(
                        name=f"{kind}{k}",
                        engine=ENGINE,
                        replicas=share,
                        gpus_per_replica=1,
                        nodes_per_replica=2,
                        memory_gb=20,
                    )
                )
            else:
                models.append(Model(name=f"{kind}{k}", engine=ENGINE, replicas=share, memory_gb=4))
    return models


def node_views(count: int) -> list[NodeView]:
    return [
        NodeView(
            node_id=f"node-{i:05d}",
            schedulable=True,
            engines=frozenset({ENGINE}),
            gpus=GPUS,
            memory_bytes=MEMORY,
            fabrics=tuple(f"{name}@{identity}" for name, identity in fabrics_of(i)),
        )
        for i in range(count)
    ]


def best_ms(fn, rounds: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(rounds):
        started = time.perf_counter()
        result = fn()
        best = min(best, (time.perf_counter() - started) * 1000)
    return best, result


def placement_phase(nodes: int, replicas: int, rounds: int) -> dict:
    views, models = node_views(nodes), catalog(replicas)
    ms, first = best_ms(lambda: plan(views, models, []), rounds)
    replan, again = best_ms(lambda: plan(views, models, list(first.start)), rounds)
    assert not again.start and not again.stop, "a plan of a placed cluster changed it"
    return {
        f"placement_ms_{count_name(replicas)}": round(ms, 1),
        "placement_started": len(first.start),
        "placement_pending": sum(p.replicas for p in first.pending),
        "replan_ms": round(replan, 1),
    }


def count_name(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def hello(node_id: str, i: int) -> w.Hello:
    gpu = w.Gpu(
        index=0,
        name="NVIDIA H100",
        uuid="",
        memory_total_mib=81559,
        memory_free_mib=81000,
        driver_version="580.65.06",
        compute_capability="9.0",
        pci_bus_id="",
    )
    inventory = w.Inventory(
        hostname=node_id,
        os="linux",
        arch="x86_64",
        python="3.11",
        cpu_model="c",
        cpu_cores=64,
        memory_total_bytes=MEMORY,
        gpus=tuple(attrs.evolve(gpu, index=k, uuid=f"GPU-{k}", pci_bus_id=f"0000:{k:02x}:00.0") for k in range(GPUS)),
        fabrics=tuple(w.Fabric(name=name, identity=identity, kind="infiniband") for name, identity in fabrics_of(i)),
    )
    return w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node_id,
        agent_version="bench",
        boot_id="b",
        started_at=1.0,
        inventory=inventory,
        engines=(w.EngineStatus(name=ENGINE, version="0", ok=True),),
    )


def reconcile_phase(nodes: int, replicas: int, rounds: int, tmp: Path) -> dict:
    registry = NodeRegistry(heartbeat_ttl_s=30.0, started_at=-100.0, reconnect_grace_s=0.0)
    hellos = [hello(f"node-{i:05d}", i) for i in range(nodes)]
    for h in hellos:
        conn = registry.connect(h, address="10.0.0.1", cert_serial=1, cert_not_after=2e9, now=0.0)
        registry.heartbeat(h.node_id, conn, 0.0)
    fabrics = fabric_map({h.node_id: h.inventory.fabrics for h in hellos})
    store = AsyncStore.open(tmp)
    keys = keyseal.load(tmp, sealed_keys=sealed_keys(store.at_open.placements))
    models = catalog(replicas)
    r = Replicas(store, registry, lambda: models, lambda: fabrics, keys)
    started = time.perf_counter()
    changed = r.reconcile(1.0)
    first = (time.perf_counter() - started) * 1000
    steady, again = best_ms(lambda: r.reconcile(1.0), rounds)
    assert not again, "a pass with nothing new changed something"
    # What GET /admin/v1/nodes makes of them, all in one answer (the HTTP around it aside).
    views = ClusterViews(registry=registry, replicas=r, drains={}, config=ServerConfig, changes=Changes())
    listed, body = best_ms(lambda: Response.json(200, {"nodes": trio.run(partial(views.node_page))[0]}).body, rounds)
    return {
        "list_nodes_ms": round(listed, 1),
        "list_nodes_bytes": len(body),
        "reconcile_nodes": nodes,
        "reconcile_replicas": replicas,
        "reconcile_placed": len(r.placed),
        "reconcile_nodes_changed": len(changed),
        "reconcile_first_ms": round(first, 1),
        "reconcile_ms": round(steady, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--nodes", type=int, default=1000, help="phase 1's nodes (default: 1000)")
    parser.add_argument("--replicas", type=int, default=10_000, help="phase 1's replicas (default: 10000)")
    parser.add_argument("--reconcile-nodes", type=int, default=1000, help="phase 2's nodes (default: 1000)")
    parser.add_argument("--reconcile-replicas", type=int, default=2000, help="phase 2's replicas (default: 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, the best kept (default: 3)")
    args = parser.parse_args(argv)
    for name in ("nodes", "reconcile_nodes"):
        if not 1 <= getattr(args, name) <= MAX_NODES:
            parser.error(f"--{name.replace('_', '-')} must be 1..{MAX_NODES}")
    for name in ("replicas", "reconcile_replicas"):
        if not 1 <= getattr(args, name) <= MAX_REPLICAS:
            parser.error(f"--{name.replace('_', '-')} must be 1..{MAX_REPLICAS}")
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds must be 1..20")
    result: dict = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "nodes": args.nodes,
        "replicas": args.replicas,
        "rounds": args.rounds,
    }
    result |= placement_phase(args.nodes, args.replicas, args.rounds)
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-cp-") as tmp:
        result |= reconcile_phase(args.reconcile_nodes, args.reconcile_replicas, args.rounds, Path(tmp))
    result["targets"] = TARGETS
    # Each target is for its size: 10,000 replicas (in the key's name), 1,000 nodes listed or more.
    sized = {k: v for k, v in TARGETS.items() if k != "list_nodes_ms" or args.reconcile_nodes >= 1000}
    result["ok"] = {k: result[k] <= v for k, v in sized.items() if k in result}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
