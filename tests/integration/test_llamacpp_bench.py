"""The llama.cpp benchmark (tools/bench/llamacpp.py) still runs and prints its JSON, every key of
it, in a short form: the llama-server `./pants test` builds (testlib.llama) on the tests' tiny
model, a few requests of a few tokens. Its figures come from full runs (docs/engines.md);
this only keeps the benchmark from rotting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench import llamacpp

from testlib.benchjson import NONE, NUMBER, assert_shape
from testlib.llama import cached_path, llama_server

PHASE = {
    "concurrency": int,
    "requests": int,
    "completion_tokens": int,
    "wall_s": NUMBER,
    "tokens_per_s": NUMBER,
    "requests_per_s": NUMBER,
    "latency_p50_ms": NUMBER,
    "latency_p90_ms": NUMBER,
    "engine_decode_tokens_per_s_median": (int, float, NONE),
}
SHAPE = {
    "engine": str,
    "version": str,
    "model": str,
    "machine": str,
    "cpus": int,
    "python": str,
    "command": [str],
    "max_tokens": int,
    "start_to_health_s": NUMBER,
    "single_stream": PHASE,
    "concurrent": PHASE,
}


def test_the_llamacpp_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = llamacpp.main(
        ["--server", llama_server(), "--requests", "4", "--concurrency", "2", "--max-tokens", "4"]
        + ["--threads", "1", "--parallel", "2", "--ctx-size", "512"]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert_shape(result, SHAPE)
    assert result["engine"] == "llama.cpp" and result["max_tokens"] == 4
    assert result["single_stream"]["concurrency"] == 1 and result["concurrent"]["concurrency"] == 2
    for phase in ("single_stream", "concurrent"):
        figures = result[phase]
        # ignore_eos: every request generates exactly max_tokens.
        assert figures["completion_tokens"] == figures["requests"] * 4, figures
        assert figures["tokens_per_s"] > 0 and figures["latency_p50_ms"] <= figures["latency_p90_ms"], figures


def test_without_server_it_finds_the_llama_server_the_suite_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wherever the bench's own file is: `./pants run tools/bench/prefix.py` runs a copy of it in a
    sandbox, where the default once looked for tools/llama/build-llama-server beside it and found
    none ("no llama-server at ''") on a machine whose suite had built one."""
    llama_server()  # built: ./pants test builds it before this test runs
    monkeypatch.delenv("LLMGW_LLAMA_SERVER", raising=False)
    assert llamacpp.default_server() == str(cached_path())
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", "/opt/llama-server")  # the variable still wins
    assert llamacpp.default_server() == "/opt/llama-server"


def test_without_server_and_nothing_built_it_says_where_it_looked_and_what_builds_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LLMGW_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("LLMGW_LLAMA_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        llamacpp.main(["--requests", "1"])
    assert exited.value.code == 2
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.endswith(
        f": error: no llama-server built in {tmp_path}: `./pants test` builds it "
        "(or tools/llama/build-llama-server); or pass --server"
    ), said
