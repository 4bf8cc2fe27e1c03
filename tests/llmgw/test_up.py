"""`llmgw up` as a newcomer runs it: one real process tree, a working gateway, a key that works,
Ctrl-C stops everything, and a second run reuses the state."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from testlib import hostile
from testlib.proc import llmgw_env

READY_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(state: Path, port: int) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "up", "--state-dir", str(state), "--port", str(port), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=llmgw_env(),
    )
    events = []
    assert proc.stdout is not None
    for line in proc.stdout:  # bounded: `up` itself gives up after its ready timeout
        event = json.loads(line)
        events.append(event["event"])
        if event["event"] == "ready":
            assert events[0] == "starting" and "node_joined" in events
            return proc, event
    raise AssertionError(f"llmgw up ended before ready: exit {proc.wait(10)}, events {events}")


def chat(url: str, key: str) -> dict:
    body = json.dumps({"model": "sim-small", "messages": [{"role": "user", "content": "hello"}]}).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    return proc.wait(timeout=30)


def test_up_serves_a_sim_model_through_the_gateway_and_restarts_on_its_state(tmp_path: Path) -> None:
    state, port = tmp_path / "state", free_port()
    proc, ready = start(state, port)
    try:
        assert ready["gateway_url"] == f"http://127.0.0.1:{port}" and ready["api_key"]
        answer = chat(ready["gateway_url"], ready["api_key"])
        assert answer["choices"][0]["message"]["content"]
        # The crash first reported: half a request head, then FIN. It used to end `up` (exit 70).
        for _ in range(20):
            hostile.cut_at("127.0.0.1", port, b"GET /health HTTP/1.1\r\nHo", 24, how="fin")
        assert proc.poll() is None
        assert chat(ready["gateway_url"], ready["api_key"])["choices"][0]["message"]["content"]
    finally:
        code = stop(proc)
    assert code == 0
    proc, again = start(state, port)  # the same state: same CA, same key
    try:
        assert again["api_key"] == ready["api_key"]
        assert chat(again["gateway_url"], again["api_key"])["model"] == "sim-small"
    finally:
        assert stop(proc) == 0


def test_up_serves_a_gguf_file_with_the_real_llama_server(tmp_path: Path) -> None:
    from testlib.llama import llama_server
    from testlib.tinygguf import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny.gguf")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw",
            "up",
            "--state-dir",
            str(tmp_path / "state"),
            "--port",
            str(port),
            "--model",
            str(model),
            "--llama-server",
            llama_server(),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=llmgw_env(),
    )
    try:
        assert proc.stdout is not None
        ready = next(e for e in map(json.loads, proc.stdout) if e["event"] == "ready")
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 8}).encode()
        request = urllib.request.Request(
            f"{ready['gateway_url']}/v1/completions",
            data=body,
            headers={"Authorization": f"Bearer {ready['api_key']}", "Content-Type": "application/json"},
        )
        # The llama.cpp replica may still be loading when `ready` (which waits for the sim) comes:
        # the gateway queues the request until it is ready.
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.headers["x-llmgw-replica"].startswith("tiny-")
            answer = json.loads(response.read())
        assert answer["choices"][0]["text"] is not None and answer["usage"]["completion_tokens"] > 0
    finally:
        assert stop(proc) == 0


def test_up_with_nodes_on_a_simulated_fabric_runs_a_two_node_replica(tmp_path: Path) -> None:
    from testlib.proc import run_llmgw

    state, port = tmp_path / "state", free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw",
            "up",
            "--state-dir",
            str(state),
            "--port",
            str(port),
            "--nodes",
            "2",
            "--fabric",
            "ib-a",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=llmgw_env(),
    )
    try:
        assert proc.stdout is not None
        joined = set()
        for event in map(json.loads, proc.stdout):
            joined |= {event["node"]} if event["event"] == "node_joined" else set()
            if event["event"] == "ready":
                break
        assert joined == {"local-1", "local-2"}
        nodes = json.loads(run_llmgw("ctl", "nodes", "--json", "--state-dir", str(state)).stdout)
        assert {n["address"] for n in nodes} == {"127.0.0.1", "127.0.0.2"}
        assert all(f["name"] == "ib-a" for n in nodes for f in n["fabrics"]) and all(n["fabrics"] for n in nodes)
        for _ in range(300):  # the two-node replica may still be meeting at its rendezvous
            replicas = json.loads(run_llmgw("ctl", "replicas", "--json", "--state-dir", str(state)).stdout)
            big = [r for r in replicas if r["model"] == "sim-big"]
            if big and big[0]["state"] == "ready":
                break
        assert big and big[0]["state"] == "ready" and sorted(big[0]["nodes"]) == ["local-1", "local-2"], replicas
    finally:
        assert stop(proc) == 0
