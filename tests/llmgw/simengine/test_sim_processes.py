"""Real `llmgw engine sim` processes on loopback, spoken to over real HTTP and killed for real.

A single node answers chat and completions, whole and streamed, and honours its key. A
two-node replica rendezvouses over TCP: rank 0 serves only once its worker has joined, and
the replica fails as a whole (the survivor exits 3) when either member is killed or hangs.
Every wait is a bounded poll (`testlib.cluster.wait_until`); ports are picked free.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testlib.cluster import free_port, wait_until
from testlib.proc import Proc

KEY = "replica-key"
EXIT_REPLICA_FAILED = 3


class Sim(Proc):
    """One `llmgw engine sim` process logging JSON lines to a file."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(name, ["engine", "sim", "--log-format", "json", *args], log_path, env)

    def port(self) -> int:
        listening = wait_until(f"{self.name} to listen", lambda: self.events("sim_listening"), alive=[self])
        return int(listening[0]["port"])

    def wait_exit(self, what: str, timeout: float) -> int:
        wait_until(what, lambda: self.returncode is not None, procs=[self], timeout=timeout)
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)  # a test may have stopped it: let it go on to die
        super().kill()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    started: list[Sim] = []

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> Sim:
        sim = Sim(name, list(args), tmp_path / f"{name}.log", env)
        started.append(sim)
        return sim

    try:
        yield start
    finally:
        for sim in started:
            sim.kill()


def call(
    port: int, method: str, path: str, body: Any = None, key: str | None = KEY
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"content-type": "application/json"}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def stream(port: int, path: str, body: Any) -> tuple[dict[str, str], list[tuple[float, str]]]:
    """The SSE `data:` payloads of a streamed answer, each with the time its line arrived."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        events = []
        while True:
            line = response.readline()  # http.client undoes the chunked framing
            if not line:
                break
            if line.startswith(b"data: "):
                events.append((time.monotonic(), line[6:].strip().decode()))
        return {k.lower(): v for k, v in response.getheaders()}, events
    finally:
        conn.close()


def health(port: int) -> int | None:
    try:
        return call(port, "GET", "/health", key=None)[0]
    except OSError:
        return None


def test_single_node_answers_chat_and_completions_whole_and_streamed(spawn: Any) -> None:
    sim = spawn("sim", "--model", "tiny", "--port", "0", "--output-token-ms", "20", env={"LLMGW_SIM_API_KEY": KEY})
    port = sim.port()
    wait_until("health 200", lambda: health(port) == 200, procs=[sim], alive=[sim])

    status, _, body = call(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["tiny"]
    status, headers, body = call(port, "GET", "/v1/models", key="wrong")
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "say something nice"}], "max_tokens": 6}
    status, headers, body = call(port, "POST", "/v1/chat/completions", chat)
    assert status == 200 and headers["content-type"] == "application/json"
    whole = json.loads(body)
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert whole["choices"][0]["finish_reason"] == "length"
    assert json.loads(call(port, "POST", "/v1/chat/completions", chat)[2])["choices"] == whole["choices"]

    headers, events = stream(port, "/v1/chat/completions", {**chat, "stream": True})
    assert headers["content-type"] == "text/event-stream" and headers["transfer-encoding"] == "chunked"
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    token_times = [
        at for (at, _), c in zip(events[:-1], chunks, strict=True) if c["choices"][0]["delta"].get("content")
    ]
    assert len(token_times) == 6
    assert token_times[-1] - token_times[0] >= 5 * 0.020 * 0.9  # sent as made, 20 ms apart, not all at once

    completion = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 4, "stream": True}
    _, events = stream(port, "/v1/completions", completion)
    streamed = "".join(json.loads(data)["choices"][0]["text"] for _, data in events[:-1])
    status, _, body = call(port, "POST", "/v1/completions", {**completion, "stream": False})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == streamed
    assert json.loads(body)["usage"]["prompt_tokens"] == 4

    status, _, body = call(port, "POST", "/v1/completions", {**completion, "model": "gpt-4"})
    assert status == 404 and "does not exist" in json.loads(body)["error"]["message"]

    sim.popen.send_signal(signal.SIGTERM)
    assert sim.wait_exit("sim to stop on SIGTERM", 10) == 0
    assert sim.events("sim_stopped")


def two_node_args(dist_port: int, rank: int, *extra: str) -> list[str]:
    return [
        "--model",
        "big",
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--dist-init-addr",
        f"127.0.0.1:{dist_port}",
        *extra,
    ]


def test_rank0_serves_only_after_its_worker_joins_and_fails_when_it_is_killed(spawn: Any) -> None:
    dist = free_port()
    rank0 = spawn("rank0", *two_node_args(dist, 0, "--port", "0"))
    port = rank0.port()
    wait_until(
        "rank 0 to wait for its worker", lambda: rank0.events("rendezvous_waiting"), procs=[rank0], alive=[rank0]
    )
    status, _, body = call(port, "GET", "/health", key=None)
    assert status == 503 and "waiting for rank 1" in json.loads(body)["error"]["message"]

    worker = spawn("worker", *two_node_args(dist, 1))
    wait_until("rank 0 to serve", lambda: health(port) == 200, procs=[worker], alive=[rank0, worker])
    assert [e["rank"] for e in rank0.events("worker_joined")] == [1]
    assert worker.events("rendezvous_complete")
    chat = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert call(port, "POST", "/v1/chat/completions", chat, key=None)[0] == 200

    worker.popen.kill()
    assert rank0.wait_exit("rank 0 to fail after its worker was killed", 5) == EXIT_REPLICA_FAILED
    lost = rank0.events("worker_lost")
    assert lost and lost[0]["rank"] == 1 and "closed the connection" in lost[0]["reason"]
    assert "llmgw engine: rank 1 (127.0.0.1:" in rank0.log_path.read_text()


def test_worker_waits_for_rank0_and_fails_when_rank0_is_killed(spawn: Any) -> None:
    dist = free_port()
    worker = spawn("worker", *two_node_args(dist, 1), "--log-level", "debug")
    wait_until(
        "the worker to retry", lambda: len(worker.events("rendezvous_retry")) >= 2, procs=[worker], alive=[worker]
    )
    rank0 = spawn("rank0", *two_node_args(dist, 0, "--port", "0", "--startup-delay-s", "0.3"))
    port = rank0.port()
    wait_until("rank 0 to serve", lambda: health(port) == 200, procs=[worker], alive=[rank0, worker])
    assert rank0.events("sim_loading")

    rank0.popen.kill()
    assert worker.wait_exit("the worker to fail after rank 0 was killed", 5) == EXIT_REPLICA_FAILED
    assert worker.events("rank0_lost")


def test_hung_worker_is_detected_by_heartbeat(spawn: Any) -> None:
    dist = free_port()
    rank0 = spawn("rank0", *two_node_args(dist, 0, "--port", "0"))
    port = rank0.port()
    worker = spawn("worker", *two_node_args(dist, 1))
    wait_until("rank 0 to serve", lambda: health(port) == 200, procs=[worker], alive=[rank0, worker])
    worker.popen.send_signal(signal.SIGSTOP)  # alive and connected, but silent
    stopped = time.monotonic()
    assert rank0.wait_exit("rank 0 to notice the hung worker", 15) == EXIT_REPLICA_FAILED
    assert time.monotonic() - stopped >= 4  # by the 5 s heartbeat timeout, not by a closed socket
    assert "hung" in rank0.events("worker_lost")[0]["reason"]


def test_rendezvous_timeouts_and_a_simulated_crash_exit_3(spawn: Any) -> None:
    lonely = spawn("lonely", *two_node_args(free_port(), 1, "--rendezvous-timeout-s", "1"))
    abandoned = spawn("abandoned", *two_node_args(free_port(), 0, "--port", "0", "--rendezvous-timeout-s", "1"))
    crashing = spawn("crashing", "--model", "m", "--port", "0", "--fail-after-s", "0.5")
    assert lonely.wait_exit("the worker to give up", 10) == EXIT_REPLICA_FAILED
    assert "was not reachable within 1 s" in lonely.log_path.read_text()
    assert abandoned.wait_exit("rank 0 to give up", 10) == EXIT_REPLICA_FAILED
    assert "not every worker joined within 1 s" in abandoned.log_path.read_text()
    assert "waiting for rank 1" in abandoned.events("rendezvous_timed_out")[0]["status"]
    assert crashing.wait_exit("the simulated crash", 10) == EXIT_REPLICA_FAILED
    assert crashing.events("sim_crash_simulated")
