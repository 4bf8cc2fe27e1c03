"""The gateway benchmark (tools/bench/gateway.py) still runs and prints its JSON, in a short form:
every phase at tiny sizes, the workers phase (`llmgw gateway --workers 1`, then `--workers 2`)
for half a second each. Its figures come from full runs on a quiet machine (docs/performance.md);
this only keeps the benchmark from rotting, and checks what does not depend on the machine's
load: every request answered, both workers served (the kernel spread the connections), and the
CPU counted is the gateway's parent and its workers, no more and no fewer processes."""

from __future__ import annotations

import json

import pytest
from bench import gateway


def test_the_gateway_benchmark_runs_every_phase(capsys: pytest.CaptureFixture[str]) -> None:
    code = gateway.main(
        ["--requests", "10", "--sse-requests", "2", "--streams", "20"]
        + ["--workers", "2", "--workers-seconds", "0.5", "--workers-rounds", "1"]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    for figure in ("added_latency_p50_ms", "throughput_ratio", "sse_chunks_per_cpu_second", "streams_20_rss_mib"):
        assert isinstance(result[figure], (int, float)), (figure, result)
    assert result["streams_open"] == 20 and result["streams_failed"] == 0
    for n in (1, 2):
        assert result[f"workers_{n}_requests"] > 0 and result[f"workers_{n}_rps"] > 0, result
        assert result[f"workers_{n}_cpu_per_request_ms"] > 0, result
    assert len(result["workers_2_worker_cpu_s"]) == 2 and all(c > 0 for c in result["workers_2_worker_cpu_s"]), result
    # The CPU counted is the parent's and each worker's.
    assert result["workers_1_processes"] == 2 and result["workers_2_processes"] == 3, result
    assert result["workers_scaling"] > 0 and result["workers_cpu_per_request_ratio"] > 0
    assert set(result["ok"]) == {
        "added_latency_p50",
        "throughput_ratio",
        "sse_chunks_per_cpu_second",
        "streams_rss",
        "streams_all_open",
        "workers_scaling",
        "workers_cpu_per_request",
    }


def test_the_workers_phase_runs_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert gateway.main(["--workers-only", "--workers", "3", "--workers-seconds", "0.3", "--workers-rounds", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "added_latency_p50_ms" not in result  # phases 1-4 skipped
    assert result["workers"] == 3 and len(result["workers_3_worker_cpu_s"]) == 3
    assert result["workers_3_processes"] == 4, result
    assert len(result["workers_1_rps_rounds"]) == len(result["workers_3_rps_rounds"]) == 2
    assert result["workers_1_requests"] > 0 and result["workers_3_requests"] > 0
    assert set(result["ok"]) == {"workers_scaling", "workers_cpu_per_request"}


def test_an_open_stream_is_told_from_a_refusal_without_waiting_for_an_event() -> None:
    # A 503 keeps its connection open: the open-streams phase once waited on it for an event
    # until its deadline, and the whole benchmark ended in TooSlowError.
    refused = b'HTTP/1.1 503 Service Unavailable\r\ncontent-length: 9\r\n\r\n{"e": 1}\n'
    assert gateway.stream_answer(refused) is False
    assert gateway.stream_answer(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream") is None
    assert gateway.stream_answer(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n") is None
    assert gateway.stream_answer(b"HTTP/1.1 200 OK\r\n\r\ne6\r\ndata: {}") is True
