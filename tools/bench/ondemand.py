"""Models on demand, measured on real llama-server replicas of made GGUF models (two sizes).

    ./pants run tools/bench/ondemand.py -- --json [--runs N] [--step-s S] [--smoke]

A cluster on loopback (`llmgw server` with a gateway worker, one `llmgw agent` whose llama.cpp is
the suite's llama-server), its catalog two models on demand (`min_replicas = 0`), and then:

1. **Cold starts** (`--runs` per model): with the model at zero replicas, one streamed request;
   the time to its first token (`cold_first_token_s`), split by the logs' timestamps into the
   decision (request sent -> the control plane's `autoscale_decision`), the dispatch (-> the
   agent's `replica_starting`: the engine spawned), the engine's start and model load (-> the
   replica `ready`) and the rest (-> the first token: the gateway learning of it, the prefill).
   `model_load_s` is the same llama-server started by hand on the same file until its /health
   answers, so `cold_overhead_s` = `cold_first_token_s` - `model_load_s` is what llmgw adds.
2. **A stepped load** on the small model (`min_replicas = 1`, `max_replicas = 3`, the [autoscale]
   defaults): one client for a while, then `--step-clients` clients for `--step-s`, then one
   again while the extra replicas are retired. `scale_up_decision_s`: the step's start (the
   queue forming) to the first `up` decision; `queue_wait_p99_ms` during the step (the gateway's
   `x-llmgw-overhead-ms`: time before a replica took the request); replica-seconds used against a
   fixed `max_replicas` over the same time; the time to the first token p50/p99 during the step
   (the waiting is in llama-server's slots: the gateway sends every request on); `failed_requests`
   over the whole trace (a non-200, a cut stream), through every scale-down.

Prints one JSON object. Targets: `cold_overhead_s` <= 2, `scale_up_decision_s` <= 10, 0 failed.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import math
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.llamacpp import NoServer, default_server, free_port
from bench.procs import stop

from testlib.cluster import Cluster, wait_until
from testlib.makegguf import make_gguf

MODELS = {  # name: make_gguf arguments
    "small": dict(n_layer=4, n_embd=256, n_head=8, n_head_kv=2, n_vocab=4000, dtype="F16"),
    "large": dict(n_layer=16, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, n_vocab=16000, dtype="F16"),
}
SMOKE_MODELS = {"small": MODELS["small"]}
LLAMA_ARGS = ["--ctx-size", "1024", "-np", "4"]
READY_S = 180.0
TOKENS = 24  # each request's answer, streamed
COLD_TARGET_S, DECISION_TARGET_S = 2.0, 10.0


def ts(record: dict[str, Any]) -> float:
    """A log line's time, as unix seconds."""
    return datetime.datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp()


def catalog(files: dict[str, Path]) -> str:
    """Each made model on demand (cold starts), and `step`, the small one again, from one to three
    replicas (the stepped load); the [autoscale] defaults but for a look every half second."""
    out = ["[autoscale]\ninterval_s = 0.5\n"]
    for name, path in [*files.items(), ("step", files["small"])]:
        bounds = (
            "min_replicas = 1\nmax_replicas = 3\nreplicas = 1"
            if name == "step"
            else "min_replicas = 0\nmax_replicas = 1\nreplicas = 0"
        )
        out.append(
            f'[[models]]\nname = "{name}"\nengine = "llamacpp"\nsource = {{ path = "{path}" }}\n{bounds}\n'
            f"idle_s = 3.0\nqueue_timeout_s = 300\nargs = {json.dumps(LLAMA_ARGS)}\n"
        )
    return "\n".join(out)


class Client:
    """Streamed chat completions through the gateway; each request's (start, status, whole,
    queue wait in ms, first token time)."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token

    def one(self, model: str, tokens: int = TOKENS) -> dict[str, Any]:
        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": tokens,
                "stream": True,
                "temperature": 0,
            }
        )
        started = time.time()
        out: dict[str, Any] = {"start": started, "status": 0, "whole": False, "wait_ms": None, "first_token": None}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=READY_S)
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                body=body,
                headers={"authorization": f"Bearer {self.token}", "content-type": "application/json"},
            )
            response = conn.getresponse()
            out["status"] = response.status
            wait = response.getheader("x-llmgw-overhead-ms")
            out["wait_ms"] = float(wait) if wait else None
            while line := response.readline():
                if line.startswith(b"data: ") and out["first_token"] is None and b'"content"' in line:
                    out["first_token"] = time.time()
                if line.strip() == b"data: [DONE]":
                    out["whole"] = True
        except OSError as exc:
            out["error"] = str(exc)
        finally:
            conn.close()
        out["end"] = time.time()
        return out


def standalone_load_s(server: str, model: Path) -> float:
    """llama-server alone on `model`: from its start until /health answers 200."""
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        [server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *LLAMA_ARGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while time.monotonic() - started < READY_S:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited {proc.returncode} on {model}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            time.sleep(0.01)
        raise SystemExit(f"llama-server was not ready on {model} within {READY_S:.0f} s")
    finally:
        stop(proc)


def placed(cluster: Cluster, model: str) -> list[dict[str, Any]]:
    return [r for r in cluster.replicas() or [] if r["replica"] is not None and r["model"] == model]


def cold_start(cluster: Cluster, client: Client, model: str, agent_log: Any) -> dict[str, float]:
    """One request to `model` at zero replicas: its first token's time, split by the logs."""
    wait_until(f"{model} at zero", lambda: not placed(cluster, model) or None, timeout=READY_S)
    time.sleep(0.5)  # past the retirement's last push
    sent = time.time()
    answer = client.one(model)
    if answer["status"] != 200 or not answer["whole"] or answer["first_token"] is None:
        raise SystemExit(f"a cold request for {model} failed: {answer}")
    decision = next(
        d
        for d in cluster.server.events("autoscale_decision")
        if d["model"] == model and d["kind"] == "start" and ts(d) >= sent
    )
    mine = [
        e for e in agent_log.events() if str(e.get("replica", "")).startswith(f"{model}-") and ts(e) >= ts(decision)
    ]
    spawned = next(ts(e) for e in mine if e.get("event") == "replica_starting")
    up = next(ts(e) for e in mine if e.get("event") == "replica_state" and e.get("state") == "ready")
    return {
        "first_token_s": answer["first_token"] - sent,
        "decision_s": ts(decision) - sent,
        "dispatch_s": spawned - ts(decision),
        "engine_start_and_load_s": up - spawned,
        "after_ready_s": answer["first_token"] - up,
    }


def stepped(cluster: Cluster, client: Client, step_clients: int, step_s: float, base_s: float) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop_at = {"n": 1}  # clients running: the first `n` keep going
    done = threading.Event()

    def run(i: int) -> None:
        deadline = time.time() + base_s * 3 + step_s + 600
        while not done.is_set() and time.time() < deadline:
            if i >= stop_at["n"]:
                time.sleep(0.05)
                continue
            r = client.one("step")
            with lock:
                results.append(r)

    samples: list[tuple[float, int]] = []

    def sample() -> None:
        while not done.is_set():
            samples.append((time.time(), len(placed(cluster, "step"))))
            time.sleep(0.5)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(step_clients)]
    sampler = threading.Thread(target=sample, daemon=True)
    started = time.time()
    for t in [*threads, sampler]:
        t.start()
    time.sleep(base_s)
    step_start = time.time()
    stop_at["n"] = step_clients
    time.sleep(step_s)
    step_end = time.time()
    stop_at["n"] = 1
    # One client on while the extra replicas are drained and retired (down_after_s each).
    wait_until("step back to one replica", lambda: len(placed(cluster, "step")) == 1 or None, timeout=600)
    time.sleep(base_s)
    done.set()
    for t in [*threads, sampler]:
        t.join(READY_S)
    ended = time.time()
    ups = [d for d in cluster.server.events("autoscale_decision") if d["model"] == "step" and d["kind"] == "up"]
    downs = [
        d for d in cluster.server.events("autoscale_decision") if d["model"] == "step" and d["kind"] in ("down", "idle")
    ]
    first_up = min((ts(d) for d in ups if ts(d) >= step_start), default=math.nan)
    during = sorted(r["wait_ms"] for r in results if step_start <= r["start"] < step_end and r["wait_ms"] is not None)
    failed = [r for r in results if r["status"] != 200 or not r["whole"]]
    replica_s = sum((b[0] - a[0]) * a[1] for a, b in zip(samples, samples[1:], strict=False))
    out: dict[str, Any] = {
        "requests": len(results),
        "failed_requests": len(failed),
        "up_decisions": len(ups),
        "down_decisions": len(downs),
        "replica_seconds": round(replica_s, 1),
        "fixed_max_replica_seconds": round(3 * (samples[-1][0] - samples[0][0]), 1) if samples else 0.0,
        "trace_s": round(ended - started, 1),
        "max_replicas_seen": max((n for _, n in samples), default=0),
    }
    if not math.isnan(first_up):  # the load wanted no more (a step too small)
        out["scale_up_decision_s"] = round(first_up - step_start, 2)
    if during:
        out["queue_wait_p50_ms"] = round(during[len(during) // 2], 1)
        out["queue_wait_p99_ms"] = round(during[min(len(during) - 1, int(len(during) * 0.99))], 1)
    # The gateway sends every request on at once (no per-replica cap): the waiting is in
    # llama-server's slots, which the time to the first token shows.
    firsts = sorted(
        1000 * (r["first_token"] - r["start"])
        for r in results
        if step_start <= r["start"] < step_end and r["first_token"] is not None
    )
    if firsts:
        out["first_token_p50_ms"] = round(firsts[len(firsts) // 2], 1)
        out["first_token_p99_ms"] = round(firsts[min(len(firsts) - 1, int(len(firsts) * 0.99))], 1)
    return out


def run(opts: argparse.Namespace) -> dict[str, Any]:
    server = opts.server or default_server()
    root = Path(tempfile.mkdtemp(prefix="llmgw-ondemand-"))
    try:
        shapes = SMOKE_MODELS if opts.smoke else MODELS
        files = {name: make_gguf(root / f"{name}.gguf", **args) for name, args in shapes.items()}
        load_s = {name: min(standalone_load_s(server, path) for _ in range(2)) for name, path in files.items()}
        (root / "cluster").mkdir()
        cluster = Cluster(
            root / "cluster", heartbeat_interval_s=0.5, heartbeat_ttl_s=5.0, server_toml="gateway_workers = 1\n"
        )
        try:
            cluster.init_ca()
            cluster.set_catalog(catalog(files))
            cluster.add_node("node-a", agent_toml=f'llamacpp_bin = "{server}"\n')
            cluster.start_server()
            agent = cluster.start_agent("node-a")
            cluster.wait_replicas(
                "step ready",
                lambda rs: any(r["model"] == "step" and r["state"] == "ready" for r in rs),
                timeout=READY_S,
            )
            [ready] = cluster.server.events("server_ready")
            client = Client(int(ready["admin_url"].rsplit(":", 1)[1]), cluster.ctl("keys", "create", "bench")["token"])
            cold: dict[str, Any] = {}
            for name, path in files.items():
                runs = [cold_start(cluster, client, name, agent) for _ in range(opts.runs)]
                best = min(runs, key=lambda r: r["first_token_s"])
                cold[name] = {
                    "model_bytes": path.stat().st_size,
                    "model_load_s": round(load_s[name], 3),
                    "cold_first_token_s": round(best["first_token_s"], 3),
                    "cold_overhead_s": round(best["first_token_s"] - load_s[name], 3),
                    "split": {k: round(v, 3) for k, v in best.items() if k != "first_token_s"},
                    "runs": [round(r["first_token_s"], 3) for r in runs],
                }
            step = stepped(cluster, client, opts.step_clients, opts.step_s, opts.base_s)
        finally:
            cluster.close()
        worst_overhead = max(c["cold_overhead_s"] for c in cold.values())
        return {
            "settings": {
                "machine": platform.machine(),
                "models": {name: path.stat().st_size for name, path in files.items()},
                "llama_args": LLAMA_ARGS,
                "runs": opts.runs,
                "step_clients": opts.step_clients,
                "step_s": opts.step_s,
                "smoke": opts.smoke,
            },
            "cold": cold,
            "step": step,
            "targets": {
                "cold_overhead_at_most_2_s": worst_overhead <= COLD_TARGET_S,
                "scale_up_decision_at_most_10_s": step.get("scale_up_decision_s", math.inf) <= DECISION_TARGET_S,
                "no_failed_requests": step["failed_requests"] == 0,
            },
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object (the only output)")
    parser.add_argument("--server", help="llama-server to run (default: the suite's build)")
    parser.add_argument("--runs", type=int, default=3, help="cold starts of each model (default: 3)")
    parser.add_argument("--step-clients", type=int, default=8, help="clients during the step (default: 8)")
    parser.add_argument("--step-s", type=float, default=40.0, help="how long the step lasts (default: 40)")
    parser.add_argument("--base-s", type=float, default=10.0, help="one client before and after it (default: 10)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the suite's smoke run")
    opts = parser.parse_args(argv)
    if not 1 <= opts.runs <= 20 or not 1 <= opts.step_clients <= 64 or not 0 < opts.step_s <= 600:
        parser.error("--runs 1-20, --step-clients 1-64, --step-s up to 600")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        result = run(opts)
    except NoServer as exc:
        raise SystemExit(str(exc)) from None
    print(json.dumps(result, indent=None if opts.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
