"""Parked replicas on a real cluster on loopback: `llmgw server` (its gateway in a worker process)
and one `llmgw agent` on a node with a GPU (the recorded nvidia-smi of an L4: the hardware edge),
whose vLLM is the operator's (agent.toml `vllm_bin`): the stand-in for `vllm serve`
(`testlib.standin_vllm`, no GPU here), with vLLM's sleep-mode routes. Everything through what an
operator and a client use.

The node is the recorded 8 x H100 board. A vLLM model on demand (min_replicas = 0): the first request starts its replica, started able
to park (--enable-sleep-mode); unused for idle_s it is parked, not stopped (the same engine
process asleep, `ctl replicas` says parked, the decision says why); the next requests, streamed
and not, wake it (no new replica, no new engine) and are answered; a stream on it ends whole.
/metrics counts the park and the wake. Then a vLLM model with two replicas: one engine killed
mid-stream, the answer goes on at the other, asked in vLLM's way (`continue_final_message`)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest

from testlib import standin_vllm
from testlib.calls import metrics_text, post, streamed_whole, together
from testlib.cluster import OPERATORS_LLAMACPP, Cluster, wait_until
from testlib.hardware import nvidia_smi

READY_S = 60.0


@attrs.frozen
class Live:
    cluster: Cluster
    port: int
    token: str
    events: Path  # the stand-in's events: start, sleep, wake, request


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("park")
    weights = root / "weights" / "coder"
    weights.mkdir(parents=True)
    (weights / "config.json").write_text("{}")
    (root / "bin").mkdir()
    vllm = standin_vllm.write_executable(root / "bin" / "vllm")
    events = root / "engine-events.jsonl"
    cluster = Cluster(
        root,
        heartbeat_interval_s=0.5,
        heartbeat_ttl_s=5.0,
        server_toml="gateway_workers = 1\n",
        engines_toml=OPERATORS_LLAMACPP + '[engines.vllm]\nversion = ""\n',  # the node's own vllm (vllm_bin)
    )
    try:
        cluster.init_ca()
        cluster.set_catalog(
            f"""
[autoscale]
interval_s = 0.2

[[models]]
name = "coder"
engine = "vllm"
source = {{ path = "{weights}" }}
min_replicas = 0
max_replicas = 1
replicas = 0
idle_s = 3.0
gpus_per_replica = 1
memory_gb = 4.0
queue_timeout_s = 60.0

[[models]]
name = "duo"
engine = "vllm"
source = {{ path = "{weights}" }}
replicas = 2
gpus_per_replica = 1
memory_gb = 4.0
"""
        )
        cluster.add_node("node-gpu", agent_toml=f'nvidia_smi = "{nvidia_smi("h100")}"\nvllm_bin = "{vllm}"\n')
        server = cluster.start_server()
        cluster.start_agent(
            "node-gpu", env={"STANDIN_EVENTS_FILE": str(events), "STANDIN_TOKEN_MS": "20", "STANDIN_LOAD_S": "0.5"}
        )
        cluster.wait_nodes(
            "node-gpu joined with its vllm checked",
            lambda ns: any(e["name"] == "vllm" and e["ok"] for e in ns.get("node-gpu", {}).get("engines", [])),
        )
        [ready] = server.events("server_ready")
        token = cluster.ctl("keys", "create", "park")["token"]
        yield Live(cluster=cluster, port=int(ready["admin_url"].rsplit(":", 1)[1]), token=token, events=events)
    finally:
        cluster.close()


def chat(live: Live, *, stream: bool = False, max_tokens: int = 6) -> tuple[int, dict[str, str], bytes]:
    body = {"model": "coder", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return post(live.port, live.token, {**body, "stream": stream})


def replica(live: Live) -> dict[str, Any] | None:
    return next((r for r in live.cluster.replicas() or [] if r["replica"] is not None and r["model"] == "coder"), None)


def engine_events(live: Live, pid: int | None = None) -> list[str]:
    """The engine's events but requests: of every engine, or of the one with `pid` (a start is
    written by the engine itself, so each of its own is there)."""
    lines = [json.loads(line) for line in (live.events.read_text().splitlines() if live.events.exists() else [])]
    return [e["event"] for e in lines if e["event"] != "request" and (pid is None or e["pid"] == pid)]


def test_an_idle_vllm_replica_is_parked_and_woken_by_the_next_requests_with_the_same_engine(live: Live) -> None:
    assert replica(live) is None
    status, _, body = chat(live)
    assert status == 200, body
    first = replica(live)
    assert first is not None and first["state"] == "ready"
    [member] = live.cluster.ctl("logs", first["replica"], "--lines", "50")["members"]
    assert "--enable-sleep-mode" in member["text"]  # the command the agent logged

    # Unused for idle_s: parked, not stopped.
    parked = wait_until("coder parked", lambda: (r := replica(live)) and r["state"] == "parked" and r, timeout=30)
    assert parked["replica"] == first["replica"]
    assert engine_events(live, first["pids"][0]) == ["start", "sleep"]
    [m] = [m for m in live.cluster.ctl("models") if m["model"] == "coder"]
    assert (m["scale"]["wanted"], m["scale"]["parked"]) == (0, 1)
    assert m["scale"]["last"]["reason"] == "idle for 3 s: scaled to zero, parked"
    text = live.cluster.llmgw("ctl", "replicas", "--state-dir", str(live.cluster.state)).stdout
    assert "coder: replicas 0-1 (idle after 3 s), wants 0, 1 parked; idle for 3 s: scaled to zero, parked" in text
    assert " parked " in text  # the replica's state in its row

    # The next requests, streamed and not, wake it: the same replica, the same engine.
    started = time.monotonic()
    answers = together(partial(chat, live), [{"stream": i % 2 == 0, "max_tokens": 6} for i in range(4)])
    took = time.monotonic() - started
    for i, (status, _, body, _) in enumerate(answers):
        assert status == 200, body
        assert streamed_whole(body, 6) if i % 2 == 0 else json.loads(body)["choices"][0]["message"]["content"]
    woken = replica(live)
    assert woken is not None and (woken["replica"], woken["state"]) == (first["replica"], "ready")
    assert woken["pids"] == first["pids"]  # the same engine process: woken, not started again
    assert engine_events(live, first["pids"][0]) == ["start", "sleep", "wake"]
    coder = [e for e in engine_events(live) if e in ("sleep", "wake")]
    assert coder == ["sleep", "wake"]  # and no other engine of coder started: the duo's never sleep
    assert took < 10, took
    decisions = [(d["kind"], d["reason"]) for d in live.cluster.server.events("autoscale_decision")]
    assert decisions[-1][0] == "start" and decisions[-1][1].startswith("woken on demand (parked): ")
    metrics = metrics_text(live.port)
    assert 'llmgw_autoscale_parks_total{model="coder",action="park"} 1' in metrics
    assert 'llmgw_autoscale_parks_total{model="coder",action="wake"} 1' in metrics


def test_a_vllm_stream_whose_engine_dies_goes_on_at_the_other_replica(live: Live) -> None:
    wait_until(
        "both duo replicas ready",
        lambda: sum(r["state"] == "ready" for r in live.cluster.replicas() or [] if r["model"] == "duo") == 2 or None,
        timeout=READY_S,
    )
    body = {"model": "duo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=90)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"authorization": f"Bearer {live.token}", "content-type": "application/json"},
        )
        response = conn.getresponse()
        replica = response.getheader("x-llmgw-replica")
        first = response.readline() + response.readline()  # the first event, a word (20 ms apart)
        [row] = [r for r in live.cluster.replicas() or [] if r["replica"] == replica]
        os.kill(row["pids"][0], signal.SIGKILL)
        rest = response.read()
    finally:
        conn.close()
    lines = [line for line in (first + rest).decode().splitlines() if line]
    assert lines[-1] == "data: [DONE]" and ": llmgw migrated 1" in lines, lines[-3:]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    text = "".join((e["choices"][0]["delta"].get("content") or "") for e in events if e["choices"])
    assert text == " ".join(standin_vllm.words(40))  # every word once, in order
    assert len({e["id"] for e in events}) == 1
    said = [json.loads(line) for line in live.events.read_text().splitlines() if line.strip()]
    continued = [e for e in said if e["event"] == "request" and e.get("continued")]
    assert len(continued) == 1 and 1 <= continued[0]["continued"] < 40 and continued[0]["pid"] != row["pids"][0]
