"""The gateway benchmark (tools/bench/gateway.py) still runs and prints its JSON, every key of
it, in a short form: every phase at tiny sizes, the workers phase (`llmgw gateway --workers 1`,
then `--workers 2`) for half a second each. Its figures come from full runs on a quiet machine
(docs/performance.md); this only keeps the benchmark from rotting, and checks what does not
depend on the machine's load: every request answered, every event of every stream relayed,
both workers served (the kernel spread the connections), and the CPU counted is the gateway's
parent and its workers, no more and no fewer processes.

These runs cover the benchmark's parts too: `gateway_runner.py` (the gateway of phases 1-4),
`rawhttp.py`, `rawupstream.py` and `rawload.py` (the canned upstream, streamed and not, and the
Python load generator: phase 3's, phase 5's, and phases 1-2's with `--generator rawhttp`),
`loadgen.py` (wrk, which tools/testenv/prepare.py installs, and the fallback), `gateway_workers.py`
and `procs.py`."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig

import pytest
from bench import gateway, procs, rawhttp, rawload

from testlib.benchjson import NONE, NUMBER, Maybe, assert_shape

RUN = {"capture_output": True, "text": True, "timeout": 30, "check": True}
SETTINGS = {
    "python": str,
    "gateway_python": str,
    "gateway_python_version": str,
    "machine": str,
    "cpus": int,
    "targets": {name: NUMBER for name in gateway.TARGETS},
}
PHASES_1_3 = {
    "otlp_endpoint": str,  # '' unless --otlp-endpoint: phases 1-4's gateway traces requests to it
    "sample_ratio": float,  # of those requests, the share traced (--sample-ratio, [telemetry] sample_ratio)
    "latency_seconds": int,
    "throughput_seconds": int,
    "throughput_connections": int,
    "sse_streams": int,
    "sse_events_per_stream": int,
    "sse_gap_ms": float,
    "streams": int,
    "generator": str,
    "generator_version": str,
    # 1: concurrency 1
    "latency_direct_requests": int,
    "latency_gateway_requests": int,
    "direct_p50_ms": NUMBER,
    "direct_p99_ms": NUMBER,
    "gateway_p50_ms": NUMBER,
    "gateway_p99_ms": NUMBER,
    "added_p50_ms": NUMBER,
    "added_p99_ms": NUMBER,
    # 2: concurrency 64
    "direct_rps": int,
    "throughput_rps": int,
    "throughput_requests": int,
    "throughput_gateway_cpu_s": NUMBER,
    "cpu_ms_per_request": NUMBER,
    "throughput_load_cpu_share": NUMBER,
    "throughput_upstream_cpu_share": NUMBER,
    "throughput_others_cpu_share": NUMBER,
    "throughput_steal_share": NUMBER,
    # 3: SSE relay
    "sse_generator": str,
    "sse_connections": int,
    "sse_events": int,
    "sse_gateway_cpu_s": NUMBER,
    "sse_wall_s": NUMBER,
    "sse_events_per_cpu_second": (int, NONE),
    "cpu_ms_per_stream": NUMBER,
}
OK_1_3 = {name: bool for name in ("cpu_ms_per_request", "added_p50_ms", "added_p99_ms", "sse_events_per_cpu_second")}


def streams_shape(count: int) -> dict:
    return {
        "streams_open": int,
        "streams_failed": int,
        "streams_first_failure": Maybe(str),
        "streams_open_s": NUMBER,
        "streams_rss_idle_mib": NUMBER,
        f"streams_{count}_rss_mib": NUMBER,
    }


def workers_shape(workers: int) -> dict:
    shape: dict = {
        "workers": int,
        "workers_seconds": NUMBER,
        "workers_rounds": int,
        "workers_connections_per_worker": int,
        "workers_scaling": NUMBER,
        "workers_cpu_per_request_ratio": NUMBER,
    }
    for n in (1, workers):
        for k in ("rps", "cpu_per_request_ms", "load_cpu_share", "upstream_cpu_share", "others_cpu_share"):
            shape[f"workers_{n}_{k}"] = NUMBER  # medians
        shape[f"workers_{n}_requests"] = int
        shape[f"workers_{n}_rps_rounds"] = [int]
        shape[f"workers_{n}_cpu_per_request_ms_rounds"] = [NUMBER]
        shape[f"workers_{n}_others_cpu_share_rounds"] = [NUMBER]
        shape[f"workers_{n}_worker_cpu_s"] = [NUMBER]
        shape[f"workers_{n}_parent_cpu_s"] = NUMBER
        shape[f"workers_{n}_processes"] = int
    return shape


OK_WORKERS = {"workers_scaling": bool, "workers_cpu_per_request_ratio": bool}


def check_phases_1_3(result: dict) -> None:
    assert result["latency_direct_requests"] > 0 and result["latency_gateway_requests"] > 0, result
    assert 0 < result["direct_p50_ms"] <= result["direct_p99_ms"], result
    assert 0 < result["gateway_p50_ms"] <= result["gateway_p99_ms"], result
    assert result["direct_rps"] > 0 and result["throughput_rps"] > 0 and result["throughput_requests"] > 0, result
    assert result["cpu_ms_per_request"] > 0, result  # the runner's own CPU, counted
    # Every stream answered with all its events, and the gateway's CPU counted for them.
    assert result["sse_events"] == result["sse_streams"] * result["sse_events_per_stream"], result
    assert result["sse_events_per_cpu_second"] > 0 and result["cpu_ms_per_stream"] > 0, result
    # The upstream paced each stream's events (the first at once).
    assert result["sse_wall_s"] >= (result["sse_events_per_stream"] - 1) * result["sse_gap_ms"] / 1000, result


def test_the_gateway_benchmark_runs_every_phase(capsys: pytest.CaptureFixture[str]) -> None:
    code = gateway.main(
        ["--latency-seconds", "1", "--seconds", "1", "--sse-streams", "16", "--sse-events", "64", "--sse-gap-ms", "1"]
        + ["--streams", "20", "--workers", "2", "--workers-seconds", "0.5", "--workers-rounds", "1"]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    ok = {**OK_1_3, "streams_rss_mib": bool, "streams_all_open": bool, **OK_WORKERS}
    assert_shape(result, {**SETTINGS, **PHASES_1_3, **streams_shape(20), **workers_shape(2), "ok": ok})
    # tools/testenv/prepare.py installs wrk for `./pants test`; the fallback is the next test's.
    assert result["generator"] == ("wrk" if shutil.which("wrk") else "rawhttp"), result
    check_phases_1_3(result)
    assert result["streams_open"] == 20 and result["streams_failed"] == 0, result
    for n in (1, 2):
        assert result[f"workers_{n}_requests"] > 0 and result[f"workers_{n}_rps"] > 0, result
        assert result[f"workers_{n}_cpu_per_request_ms"] > 0, result
    assert len(result["workers_2_worker_cpu_s"]) == 2 and all(c > 0 for c in result["workers_2_worker_cpu_s"]), result
    # The CPU counted is the parent's and each worker's.
    assert result["workers_1_processes"] == 2 and result["workers_2_processes"] == 3, result
    assert result["workers_scaling"] > 0 and result["workers_cpu_per_request_ratio"] > 0


def test_without_wrk_the_python_generator_loads_the_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    code = gateway.main(
        ["--generator", "rawhttp", "--latency-seconds", "1", "--seconds", "1"]
        + ["--sse-streams", "32", "--sse-events", "64", "--sse-gap-ms", "0", "--streams", "0", "--workers", "0"]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert_shape(result, {**SETTINGS, **PHASES_1_3, "ok": OK_1_3})
    assert result["generator"] == "rawhttp", result
    check_phases_1_3(result)


def test_a_sample_ratio_needs_a_collector_and_a_share() -> None:
    for argv in (["--sample-ratio", "0.01"], ["--otlp-endpoint", "http://127.0.0.1:4318", "--sample-ratio", "2"]):
        with pytest.raises(SystemExit) as exc:
            gateway.main(argv)
        assert exc.value.code == 2  # argparse's usage error, before anything starts


def test_the_workers_phase_runs_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert gateway.main(["--workers-only", "--workers", "3", "--workers-seconds", "0.3", "--workers-rounds", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert_shape(result, {**SETTINGS, **workers_shape(3), "ok": OK_WORKERS})  # phases 1-4 skipped
    assert result["workers"] == 3 and len(result["workers_3_worker_cpu_s"]) == 3
    assert result["workers_3_processes"] == 4, result
    assert len(result["workers_1_rps_rounds"]) == len(result["workers_3_rps_rounds"]) == 2
    assert result["workers_1_requests"] > 0 and result["workers_3_requests"] > 0


def test_the_gateways_run_under_the_python3_a_nodes_service_runs_the_zipapp_with_when_it_is_this_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    on_path = shutil.which("python3", path=procs.SERVICE_PATH)
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    expected = sys.executable
    if on_path is not None:
        version = subprocess.run([on_path, "-c", "import sys; print(*sys.version_info[:2], sep='.')"], **RUN)
        expected = on_path if version.stdout.strip() == mine else sys.executable
    assert procs.gateway_python("auto")[0] == expected
    assert procs.gateway_python("current") == (sys.executable, platform.python_version())
    with pytest.raises(
        SystemExit, match=f"--python /bin/false: found nothing that runs; the gateway needs Python {mine}"
    ):
        procs.gateway_python("/bin/false")
    # A gateway run by another interpreter imports this one's packages and code, not its standard library.
    stdlib = sysconfig.get_paths()["stdlib"]
    assert stdlib in procs.child_env()["PYTHONPATH"].split(os.pathsep)
    assert stdlib not in procs.child_env("/usr/bin/other-python")["PYTHONPATH"].split(os.pathsep)
    # The gateway the figures come from is the one named: its own interpreter says so.
    code = gateway.main(
        ["--python", "current", "--latency-seconds", "1", "--seconds", "1", "--sse-streams", "8"]
        + ["--sse-events", "16", "--streams", "0", "--workers", "0"]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["gateway_python"] == sys.executable, result
    assert result["gateway_python_version"] == platform.python_version()


def test_an_open_stream_is_told_from_a_refusal_without_waiting_for_an_event() -> None:
    # A 503 keeps its connection open: the open-streams phase once waited on it for an event
    # until its deadline, and the whole benchmark ended in TooSlowError.
    refused = b'HTTP/1.1 503 Service Unavailable\r\ncontent-length: 9\r\n\r\n{"e": 1}\n'
    assert gateway.stream_answer(refused) is False
    assert gateway.stream_answer(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream") is None
    assert gateway.stream_answer(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n") is None
    assert gateway.stream_answer(b"HTTP/1.1 200 OK\r\n\r\ne6\r\ndata: {}") is True


def test_the_python_generator_parses_answers_split_anywhere() -> None:
    stream = rawhttp.STREAM_HEAD + b"".join(rawhttp.stream_chunks(3))
    wire = rawhttp.ANSWER + stream + rawhttp.ANSWER
    expected = [(b"200", 0), (b"200", 3), (b"200", 0)]
    for cut in range(1, len(wire)):
        answers = rawload.Answers()
        got = answers.feed(wire[:cut]) + answers.feed(wire[cut:])
        assert [(head.split()[1], events) for head, events in got] == expected, cut


def test_an_event_split_between_chunks_is_counted_once() -> None:
    body = rawhttp.chunk(b"data: a\n") + rawhttp.chunk(b"\ndata: b\n\n") + b"0\r\n\r\n"
    got = rawload.Answers().feed(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body)
    assert [events for _, events in got] == [2]


def test_an_answer_without_a_length_or_chunks_is_refused() -> None:
    with pytest.raises(rawhttp.BadMessage, match="neither a length nor chunks"):
        rawload.Answers().feed(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello")


def test_the_upstream_streams_whatever_the_spacing_of_stream_true() -> None:
    for body in (b'{"stream": true}', b'{"stream":true}', b'{"model": "chat", "stream" :  true}'):
        assert rawhttp.STREAMED.search(body), body
    assert not rawhttp.STREAMED.search(b'{"stream": false}')
