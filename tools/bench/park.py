"""Parked replicas (vLLM's sleep mode) against stopped ones, measured on a cluster on loopback.

    ./pants run tools/bench/park.py -- --json [--runs N] [--load-s S] [--wake-s S] [--smoke]

vLLM cannot run here (no GPU), so the engine is the stand-in for `vllm serve`
(`testlib.standin_vllm`, the operator's `vllm_bin` of an agent whose nvidia-smi is the recorded
one of an 8 x H100 board: the hardware edge). It takes `--load-s` to load its model after a start
(vLLM's reload of a model: 30-100 s by its docs; a few seconds here so the runs stay short) and
`--wake-s` to wake from sleep (vLLM's docs: 0.1-0.4 s); what it stands for is the engine's own
time, which the agent's log measures (`replica_woken`'s took_s, the start to ready). What this
measures is the rest: llmgw's path around the engine, on real processes and sockets.

Two models on demand, the same but for `park`: `parks` (true: a fall parks the replica) and
`stops` (false: a fall stops it). For each, `--runs` times: wait until it has no ready replica
(parked, or none), send one streamed request and time its first token:

- `stops`: `cold_first_token_s`, split into the decision, the engine's start and load, the rest;
- `parks`: `wake_first_token_s`, split into the decision (request sent -> `autoscale_decision`),
  the dispatch (-> the agent asks the engine), the engine's wake (`replica_woken`'s took_s) and
  the rest (-> the first token); `wake_overhead_s` = all of it but the engine's wake.

Also `park_s`: from the idle decision until the agent has the engine parked (drained, told,
asleep). Prints one JSON object. Target: `wake_overhead_s` <= 1 (the wake path's share of llmgw:
a tenth of a second's engine wake must not be buried under it).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from testlib import standin_vllm
from testlib.cluster import OPERATORS_LLAMACPP, Cluster, wait_until
from testlib.hardware import nvidia_smi

READY_S = 120.0
TOKENS = 16
WAKE_OVERHEAD_TARGET_S = 1.0


def ts(record: dict[str, Any]) -> float:
    """A log line's time, as unix seconds."""
    return datetime.datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp()


def catalog(weights: Path, idle_s: float) -> str:
    out = ["[autoscale]\ninterval_s = 0.2\n"]
    for name, park in (("parks", "true"), ("stops", "false")):
        out.append(
            f'[[models]]\nname = "{name}"\nengine = "vllm"\nsource = {{ path = "{weights}" }}\n'
            f"min_replicas = 0\nmax_replicas = 1\nreplicas = 0\nidle_s = {idle_s}\ngpus_per_replica = 1\n"
            f"memory_gb = 8.0\nqueue_timeout_s = {READY_S}\npark = {park}\n"
        )
    return "\n".join(out)


def first_token(port: int, token: str, model: str) -> dict[str, Any]:
    """One streamed request: when it was sent, its first token came, and whether it ended whole."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS})
    body = body[:-1] + ', "stream": true}'
    sent = time.time()
    out: dict[str, Any] = {"sent": sent, "status": 0, "first_token": None, "whole": False}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=READY_S)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=body,
            headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
        )
        response = conn.getresponse()
        out["status"] = response.status
        while line := response.readline():
            if line.startswith(b"data: ") and out["first_token"] is None and b'"content"' in line:
                out["first_token"] = time.time()
            if line.strip() == b"data: [DONE]":
                out["whole"] = True
    finally:
        conn.close()
    if out["status"] != 200 or not out["whole"] or out["first_token"] is None:
        raise SystemExit(f"a request for {model} failed: {out}")
    return out


def replica_state(cluster: Cluster, model: str) -> str | None:
    rows = [r for r in cluster.replicas() or [] if r["replica"] is not None and r["model"] == model]
    return rows[0]["state"] if rows else None


def decision_after(cluster: Cluster, model: str, kind: str, since: float) -> dict[str, Any]:
    return next(
        d
        for d in cluster.server.events("autoscale_decision")
        if d["model"] == model and d["kind"] == kind and ts(d) >= since
    )


def one_wake(cluster: Cluster, port: int, token: str, agent: Any) -> dict[str, float]:
    """A request to `parks` while its replica is parked: its first token, split by the logs."""
    idle = wait_until("parks parked", lambda: replica_state(cluster, "parks") == "parked" or None, timeout=READY_S)
    del idle
    answer = first_token(port, token, "parks")
    sent = answer["sent"]
    decision = decision_after(cluster, "parks", "start", sent)
    woken = next(e for e in agent.events() if e.get("event") == "replica_woken" and ts(e) >= ts(decision))
    engine_s = float(woken["took_s"])
    asked = ts(woken) - engine_s  # the log line is written once the engine answered
    total = answer["first_token"] - sent
    return {
        "first_token_s": total,
        "decision_s": ts(decision) - sent,
        "dispatch_s": asked - ts(decision),
        "engine_wake_s": engine_s,
        "after_woken_s": answer["first_token"] - ts(woken),
        "overhead_s": total - engine_s,
    }


def one_cold(cluster: Cluster, port: int, token: str, agent: Any) -> dict[str, float]:
    """A request to `stops` while it has no replica: its first token, split by the logs."""
    wait_until("stops at zero", lambda: replica_state(cluster, "stops") is None or None, timeout=READY_S)
    time.sleep(0.5)  # past the retirement's last push
    answer = first_token(port, token, "stops")
    sent = answer["sent"]
    decision = decision_after(cluster, "stops", "start", sent)
    mine = [e for e in agent.events() if str(e.get("replica", "")).startswith("stops-") and ts(e) >= ts(decision)]
    spawned = next(ts(e) for e in mine if e.get("event") == "replica_starting")
    up = next(ts(e) for e in mine if e.get("event") == "replica_state" and e.get("state") == "ready")
    total = answer["first_token"] - sent
    return {
        "first_token_s": total,
        "decision_s": ts(decision) - sent,
        "dispatch_s": spawned - ts(decision),
        "engine_start_and_load_s": up - spawned,
        "after_ready_s": answer["first_token"] - up,
    }


def park_s(cluster: Cluster, agent: Any) -> list[float]:
    """Each idle decision of `parks` to the agent's `replica_parked` after it."""
    out = []
    parked = [ts(e) for e in agent.events() if e.get("event") == "replica_parked"]
    for d in cluster.server.events("autoscale_decision"):
        if d["model"] == "parks" and d["kind"] == "idle":
            after = [t for t in parked if t >= ts(d)]
            if after:
                out.append(min(after) - ts(d))
    return out


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return min(runs, key=lambda r: r["first_token_s"])


def run(opts: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="llmgw-park-"))
    try:
        weights = root / "weights" / "model"
        weights.mkdir(parents=True)
        (weights / "config.json").write_text("{}")
        (root / "bin").mkdir()
        vllm = standin_vllm.write_executable(root / "bin" / "vllm")
        cluster = Cluster(
            root,
            heartbeat_interval_s=0.5,
            heartbeat_ttl_s=5.0,
            server_toml="gateway_workers = 1\n",
            engines_toml=OPERATORS_LLAMACPP + '[engines.vllm]\nversion = ""\n',
        )
        try:
            cluster.init_ca()
            cluster.set_catalog(catalog(weights, opts.idle_s))
            cluster.add_node("node-gpu", agent_toml=f'nvidia_smi = "{nvidia_smi("h100")}"\nvllm_bin = "{vllm}"\n')
            cluster.start_server()
            agent = cluster.start_agent(
                "node-gpu", env={"STANDIN_LOAD_S": str(opts.load_s), "STANDIN_WAKE_S": str(opts.wake_s)}
            )
            cluster.wait_nodes(
                "node-gpu with its vllm checked",
                lambda ns: any(e["name"] == "vllm" and e["ok"] for e in ns.get("node-gpu", {}).get("engines", [])),
                timeout=READY_S,
            )
            [ready] = cluster.server.events("server_ready")
            port = int(ready["admin_url"].rsplit(":", 1)[1])
            token = cluster.ctl("keys", "create", "bench")["token"]
            first_token(port, token, "parks")  # its first start: cold, then parked when idle
            wakes = [one_wake(cluster, port, token, agent) for _ in range(opts.runs)]
            colds = [one_cold(cluster, port, token, agent) for _ in range(opts.runs)]
            parks = park_s(cluster, agent)
        finally:
            cluster.close()
        wake, cold = best(wakes), best(colds)
        return {
            "settings": {
                "machine": platform.machine(),
                "engine": "stand-in vllm (testlib.standin_vllm)",
                "engine_load_s": opts.load_s,
                "engine_wake_s": opts.wake_s,
                "idle_s": opts.idle_s,
                "runs": opts.runs,
                "smoke": opts.smoke,
            },
            "parked": {
                "wake_first_token_s": round(wake["first_token_s"], 3),
                "wake_overhead_s": round(wake["overhead_s"], 3),
                "split": {k: round(v, 3) for k, v in wake.items() if k not in ("first_token_s", "overhead_s")},
                "runs": [round(r["first_token_s"], 3) for r in wakes],
                "park_s": [round(p, 3) for p in parks],
            },
            "stopped": {
                "cold_first_token_s": round(cold["first_token_s"], 3),
                "cold_overhead_s": round(cold["first_token_s"] - cold["engine_start_and_load_s"], 3),
                "split": {k: round(v, 3) for k, v in cold.items() if k != "first_token_s"},
                "runs": [round(r["first_token_s"], 3) for r in colds],
            },
            "targets": {"wake_overhead_at_most_1_s": wake["overhead_s"] <= WAKE_OVERHEAD_TARGET_S},
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object (the only output)")
    parser.add_argument("--runs", type=int, default=5, help="wakes and cold starts each (default: 5)")
    parser.add_argument("--load-s", type=float, default=5.0, help="the engine's model load after a start (default: 5)")
    parser.add_argument("--wake-s", type=float, default=0.2, help="the engine's wake from sleep (default: 0.2)")
    parser.add_argument("--idle-s", type=float, default=2.0, help="the models' idle_s (default: 2)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the suite's smoke run")
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.runs, opts.load_s = 1, 0.2
    if not 1 <= opts.runs <= 50 or not 0 <= opts.load_s <= 300 or not 0 <= opts.wake_s <= 60 or opts.idle_s <= 0:
        parser.error("--runs 1-50, --load-s 0-300, --wake-s 0-60, --idle-s above 0")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    print(json.dumps(run(opts), indent=None if opts.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
