"""The weights benchmark (tools/bench/weights.py) still runs and prints its JSON (every key of
it), in a short form: three nodes in shaped network namespaces and a 16 MiB file. Even at this
size the swarm must take the file from its source once and the baseline once per node, and nodes
that cannot reach the source get it from the control plane ([downloads] weights_origin); the
published figures (8 nodes, 2 GiB) are the full run's (docs/performance.md)."""

from __future__ import annotations

from bench import weights

from testlib.benchjson import NUMBER, MapOf, assert_shape

RUN = {
    "nodes": int,
    "peers": bool,
    "spread_s": NUMBER,
    "ready_s": MapOf(NUMBER),
    "source_downloads": NUMBER,
    "source_bytes": int,
    "uploaded_bytes": MapOf(int),
    "agents_cpu_s": NUMBER,
    "cpu_s_per_gib": NUMBER,
    "corrupt_pieces": int,
}
SHAPE = {
    "settings": {"nodes": int, "size_bytes": int, "node_rate": str, "source_rate": str, "machine": str},
    "single": RUN,
    "swarm": RUN,
    "spread_ratio": NUMBER,
    "baseline": RUN,
    "baseline_spread_ratio": NUMBER,
    "control_plane_origin": RUN,
    "targets": {"one_source_download": bool, "spread_ratio_at_most_1_3": bool},
}


def test_the_weights_bench_runs_small() -> None:
    opts = weights.parse(
        [
            "--json",
            "--nodes",
            "3",
            "--size-mib",
            "16",
            "--node-rate",
            "200mbit",
            "--source-rate",
            "100mbit",
            "--control-plane-origin",
        ]
    )
    results = weights.run(opts)
    assert_shape(results, SHAPE)
    size = results["settings"]["size_bytes"]
    assert results["single"]["source_bytes"] == size
    assert results["swarm"]["source_bytes"] == size  # once for the cluster
    assert results["swarm"]["corrupt_pieces"] == 0
    assert results["baseline"]["source_bytes"] == 3 * size  # once per node
    # The other two nodes' file came from the nodes: together they uploaded at least one copy
    # (their links' bytes out, the origin's too).
    assert sum(results["swarm"]["uploaded_bytes"].values()) >= 2 * size
    assert set(results["swarm"]["ready_s"]) == {"node-1", "node-2", "node-3"}
    # Nodes that cannot reach the source got it all the same: the control plane fetched it, once.
    assert results["control_plane_origin"]["source_bytes"] == size
    assert set(results["control_plane_origin"]["ready_s"]) == {"node-1", "node-2", "node-3"}
