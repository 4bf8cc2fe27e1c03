"""The llama.cpp RPC benchmark (tools/bench/llamarpc.py) still runs and prints its JSON, every key
of it, in a short form: the tests' llama-server and ggml-rpc-server on a made model of 2 layers
64 wide, one node against a split over 2 shaped namespace nodes, with and without llmgw's tunnel,
one completion of 16 prompt tokens and 4 generated. Its figures come from full runs
(docs/performance.md); this only keeps the benchmark from rotting, and checks that the split is
the one it says (half the layers on the helper) and that every figure is one."""

from __future__ import annotations

from bench import llamarpc

from testlib.benchjson import NUMBER, MapOf, Maybe, assert_shape
from testlib.llama import llama_server

SPREAD = {"median": NUMBER, "min": NUMBER, "max": NUMBER}
RUN = {"prompt_n": int, "prompt_per_second": NUMBER, "predicted_n": int, "predicted_per_second": NUMBER}
CONFIGURATION = {
    "nodes": int,
    "path": str,
    "args": [str],
    "buffers_mib": MapOf(NUMBER),
    "load_s": NUMBER,
    "prompt_tokens_per_s": SPREAD,
    "generation_tokens_per_s": SPREAD,
    "runs": [RUN],
    "vs_one": Maybe({"prompt_tokens_per_s": NUMBER, "generation_tokens_per_s": NUMBER, "load_s": NUMBER}),
}
SHAPE = {
    "settings": {
        "model": {"n_layer": int, "n_embd": int, "n_head": int, "n_head_kv": int, "dtype": str, "bytes": int},
        "prompt_tokens": int,
        "n_predict": int,
        "completions": int,
        "ctx_size": int,
        "threads": int,
        "link_rate": str,
        "split": str,
        "how": str,
    },
    "engine": {"llama_server": str, "version": str},
    "machine": {"arch": str, "cpus": int, "load_start": [NUMBER], "load_end": [NUMBER]},
    "configurations": MapOf(CONFIGURATION),
}


def test_the_llamarpc_bench_runs_small() -> None:
    opts = llamarpc.parse(
        ["--json", "--server", llama_server(), "--nodes", "2", "--n-layer", "2", "--n-embd", "64"]
        + ["--n-head", "4", "--n-head-kv", "2", "--prompt-tokens", "16", "--n-predict", "4"]
        + ["--completions", "1", "--ctx-size", "128", "--link-rate", "200mbit"]
    )
    results = llamarpc.run(opts)
    assert_shape(results, SHAPE)
    configs = results["configurations"]
    assert list(configs) == ["one", "direct-2", "tunnel-2"]
    assert "vs_one" not in configs["one"] and all("vs_one" in c for name, c in configs.items() if name != "one")
    for name, c in configs.items():
        assert c["load_s"] > 0, (name, c)
        for run in c["runs"]:
            assert run["prompt_n"] == 16 and run["predicted_n"] == 4, (name, run)
            assert run["prompt_per_second"] > 0 and run["predicted_per_second"] > 0, (name, run)
    # One layer each: node-0's CPU the first, the helper the second with the output layer.
    for name in ("direct-2", "tunnel-2"):
        c = configs[name]
        assert c["args"][:4] == ["--n-gpu-layers", "2", "--tensor-split", "2"], c["args"]
        rpc = [dev for dev in c["buffers_mib"] if dev.startswith("RPC")]
        assert len(rpc) == 1 and c["buffers_mib"][rpc[0]] > 0, c["buffers_mib"]
    # The tunnel's local end on node-0's loopback; the direct run dials the helper's address.
    assert configs["tunnel-2"]["args"][-1].startswith("127.0.0.1:")
    assert not configs["direct-2"]["args"][-1].startswith("127.0.0.1:")
    assert len(results["machine"]["load_start"]) == 3 == len(results["machine"]["load_end"])
