"""Prefix routing against least outstanding, on real llama.cpp (issue 32), and the routing
decision alone.

    ./pants run tools/bench/prefix.py -- [--json]
        [--conversations C] [--turns T] [--systems S] [--system-tokens N] [--first-tokens F]
        [--turn-tokens U] [--max-tokens M] [--concurrency K] [--replicas R] [--slots P]
        [--layers L] [--width W] [--policies least_outstanding,prefix] [--router-chains N]

For each policy in turn: `--replicas` real llama-server replicas (the release's portable build,
as `./pants test` made it, or $LLMGW_LLAMA_SERVER), started fresh (their caches empty), each
with one thread and `--slots` slots, of a model made here with the `gguf` package
(tests/testlib/tinygguf.py at `--layers` × `--width`: wide enough that prefill of a few thousand
tokens takes a measurable time on a CPU), behind one gateway (tools/bench/gateway_runner.py; both
started by `prefix_cluster.py`) routing the model by that policy. An engine's cache is finite,
as a GPU's KV cache is: llama-server's prompt cache in RAM (`--cache-ram`) is `--cache-mib`, by default room for the
conversations a replica takes by prefix but not for all of them. `--conversations` multi-turn
conversations, all open at once and taking turns (a conversation's next turn waits behind every
other conversation's: users reading answers), `--concurrency` requests at a time, each of
`--turns` turns: a system prompt of `--system-tokens`
(one of `--systems`, shared by the conversations that use it), a first question of
`--first-tokens`, then `--turn-tokens` a turn (tokens of the model's tokenizer, made of its
words: `tokens_per_word` says how many a word makes), each answer `--max-tokens` tokens
(streamed; the engine's own answer goes back into the conversation). The same conversations,
word for word, under every policy.

JSON, per policy (`least_outstanding`, `prefix`): `ttft_p50_ms`, `ttft_p99_ms` (time to the
first streamed event, through the gateway), `throughput_rps` (requests over the phase's wall
time), `load_imbalance` (most requests one replica answered over the fewest), `requests`,
`routes` (the `x-llmgw-route` reasons counted), `wall_s`; then `ttft_p50_ratio` and
`ttft_p99_ratio` (prefix over least outstanding); and the routing decision alone
(`router_decision_p50_us`, `router_decision_p99_us`: `Router.route` with `--router-chains`
prefixes in its table, four replicas, on prompts of the same shape; `router_prompt_p99_us`: the
prompt's hashing, done where the body is parsed). `targets_met` says which of issue 32's
targets hold. Bounded throughout: a fixed workload, a timeout per request, every process stopped
at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import queue
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench.llamacpp import NoServer, default_server
from bench.prefix_cluster import MODEL, Gateway, Replicas, get_status, wait_for
from bench.procs import stop

from llmgw.gateway.prefix import LOAD_FACTOR, Prompt
from llmgw.gateway.routing import PREFIX, Endpoint, Router

POLICIES = ("least_outstanding", "prefix")
REQUEST_TIMEOUT_S = 300.0
MAX_REQUESTS = 5_000
TARGETS = {"ttft_p50_ratio": 0.4, "load_imbalance": 1.3, "router_decision_p99_us": 50.0}


def words(rng: random.Random, count: int) -> str:
    from testlib.tinygguf import WORDS

    return " ".join(rng.choice(WORDS) for _ in range(count))


def tokens_per_word(endpoint: dict) -> float:
    """How many tokens the model's tokenizer makes of a word of the workload's, on average
    (llama-server's /tokenize of a sample): the workload's sizes are in tokens."""
    sample = words(random.Random(1), 2000)
    conn = http.client.HTTPConnection("127.0.0.1", endpoint["port"], timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request(
            "POST",
            "/tokenize",
            body=json.dumps({"content": sample}),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {endpoint['api_key']}"},
        )
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise SystemExit(f"llama-server's /tokenize answered {response.status}: {body[:300]!r}")
    return len(json.loads(body)["tokens"]) / 2000


def conversations(args: argparse.Namespace, per_word: float) -> list[dict]:
    """The workload, the same for every policy: each conversation's system prompt, first
    question and later questions, of about the tokens asked for (`per_word` tokens a word)."""
    rng = random.Random(32)

    def text(tokens: int) -> str:
        return words(rng, max(1, round(tokens / per_word)))

    systems = [f"System {s}. " + text(args.system_tokens) for s in range(args.systems)]
    out = []
    for c in range(args.conversations):
        out.append(
            {
                "system": systems[c % args.systems],
                "questions": [f"Question {c}. " + text(args.first_tokens)]
                + [f"Turn {t} of {c}. " + text(args.turn_tokens) for t in range(1, args.turns)],
            }
        )
    return out


def turn(port: int, token: str, messages: list[dict], max_tokens: int) -> tuple[float, str, str, str, int, int]:
    """One streamed chat request: time to its first event, the answer's text, the replica and
    the route the gateway named, and the prompt's tokens the engine took from its cache and
    those it computed (llama-server's `timings`, in its last event)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    body["ignore_eos"] = True
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        started = time.perf_counter()
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )
        response = conn.getresponse()
        if response.status != 200:
            raise SystemExit(f"the gateway answered {response.status}: {response.read()[:500]!r}")
        first = None
        text = []
        cached = computed = 0
        while True:
            line = response.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            if first is None:
                first = time.perf_counter() - started
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices", ()):
                text.append((choice.get("delta") or {}).get("content") or "")
            timings = event.get("timings")
            if timings:
                cached, computed = timings.get("cache_n", 0), timings.get("prompt_n", 0)
        if first is None:
            raise SystemExit("a stream ended without an event")
        replica, route = response.getheader("x-llmgw-replica", ""), response.getheader("x-llmgw-route", "")
        return first, "".join(text), replica, route, cached, computed
    finally:
        conn.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_policy(args: argparse.Namespace, policy: str, model: Path, tmp: Path, work: list[dict]) -> dict:
    replicas = Replicas(args.server, model, args.replicas, args.slots, args.context, args.cache_mib, tmp)
    gateway = None
    try:
        gateway = Gateway(replicas.endpoints, policy, tmp, args.load_factor)
        warm = [{"role": "user", "content": "hello"}]
        wait_for("the gateway", lambda: get_status(gateway.port, "/health") == 200, [gateway.proc, *replicas.procs])
        for _ in range(args.replicas * 2):  # every engine loaded and answering
            turn(gateway.port, gateway.token, warm, 1)
        todo: queue.Queue = queue.Queue()
        for conversation in work:
            todo.put({**conversation, "messages": [{"role": "system", "content": conversation["system"]}]})
        left = [len(work)]  # conversations not yet at their last turn
        prompt_tokens = [0, 0]  # taken from the engines' caches, computed
        ttfts: list[float] = []
        served: Counter[str] = Counter()
        routes: Counter[str] = Counter()
        failures: list[BaseException] = []
        lock = threading.Lock()

        def client() -> None:
            # One turn of the conversation first in line, which then goes to the back of the
            # line: every conversation is open at once, its turns between the others' (users
            # who read the answer before they write again), as many at a time as clients.
            try:
                while True:
                    try:
                        conversation = todo.get(timeout=1)
                    except queue.Empty:
                        with lock:
                            if left[0] == 0:
                                return
                        continue
                    messages = conversation["messages"]
                    messages.append({"role": "user", "content": conversation["questions"][len(messages) // 2]})
                    ttft, answer, replica, route, cached, computed = turn(
                        gateway.port, gateway.token, messages, args.max_tokens
                    )
                    messages.append({"role": "assistant", "content": answer})
                    with lock:
                        ttfts.append(ttft)
                        prompt_tokens[0] += cached
                        prompt_tokens[1] += computed
                        served[replica] += 1
                        routes[route.rsplit(";", 1)[-1] if route else "none"] += 1
                        if len(messages) // 2 < len(conversation["questions"]):
                            todo.put(conversation)
                        else:
                            left[0] -= 1
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failures.append(exc)
                with lock:
                    left[0] = 0

        started = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S * args.turns * len(work))
        wall = time.perf_counter() - started
        if failures:
            raise SystemExit(f"{policy}: {failures[0]}")
        counts = [served.get(ep["replica_id"], 0) for ep in replicas.endpoints]
        return {
            "ttft_p50_ms": round(1000 * percentile(ttfts, 0.5), 1),
            "ttft_p99_ms": round(1000 * percentile(ttfts, 0.99), 1),
            "throughput_rps": round(len(ttfts) / wall, 3),
            "load_imbalance": round(max(counts) / max(1, min(counts)), 3),
            # Of the prompts' tokens, the share the engines found in their caches (their own word).
            "prompt_cached_share": round(prompt_tokens[0] / max(1, sum(prompt_tokens)), 3),
            "requests": len(ttfts),
            "requests_per_replica": counts,
            "routes": dict(sorted(routes.items())),
            "wall_s": round(wall, 1),
        }
    finally:
        if gateway is not None:
            stop(gateway.proc)
        replicas.stop()


def router_decision(args: argparse.Namespace, work: list[dict]) -> dict:
    """`Router.route` alone, with `--router-chains` prefixes in its table and four replicas."""
    router = Router()
    eps = [Endpoint(replica_id=f"r{i}", model=MODEL, host="10.0.0.1", port=8000 + i) for i in range(4)]
    router.update({MODEL}, eps, {MODEL: PREFIX})
    rng = random.Random(7)
    prompts: list[Prompt] = []
    n = 0
    while len(router.prefix) < args.router_chains:
        conversation = work[n % len(work)]
        messages = [{"role": "system", "content": conversation["system"]}]
        messages += [{"role": "user", "content": f"{n} " + q} for q in conversation["questions"][:2]]
        prompt = Prompt.of({"messages": messages}, MODEL)
        assert prompt is not None
        router.served(eps[n % 4], prompt)
        prompts.append(prompt)
        n += 1
    hashing, deciding = [], []
    for i in range(2000):
        conversation = work[i % len(work)]
        body = {
            "messages": [{"role": "system", "content": conversation["system"]}, {"role": "user", "content": str(i)}]
        }
        t0 = time.perf_counter()
        prompt = Prompt.of(body, MODEL)
        t1 = time.perf_counter()
        assert prompt is not None
        known = prompts[rng.randrange(len(prompts))]
        t2 = time.perf_counter()
        router.route(MODEL, prompt=known if i % 2 else prompt)
        t3 = time.perf_counter()
        hashing.append(t1 - t0)
        deciding.append(t3 - t2)
    return {
        "router_chains": len(router.prefix),
        "router_decision_p50_us": round(1e6 * percentile(deciding, 0.5), 1),
        "router_decision_p99_us": round(1e6 * percentile(deciding, 0.99), 1),
        "router_prompt_p99_us": round(1e6 * percentile(hashing, 0.99), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--json", action="store_true", help="print the JSON only (it always is)")
    parser.add_argument("--server", help="llama-server (default: $LLMGW_LLAMA_SERVER, else the cached build)")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--systems", type=int, default=8, help="distinct system prompts (default: 8)")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument(
        "--first-tokens", type=int, default=1000, help="each conversation's first message (a document, say)"
    )
    parser.add_argument("--turn-tokens", type=int, default=60, help="each later question")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=2,
        help="requests at a time (default: 2, one a replica: a request's time to its first token is then "
        "its own prefill and not another's it shares a replica's one thread with; 4 is noisier)",
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--slots",
        type=int,
        default=16,
        help="llama-server slots per replica (-np; default: 16: the conversations one replica takes by prefix, "
        "half of them all)",
    )
    parser.add_argument("--context", type=int, default=5120, help="context per slot (default: 5120)")
    parser.add_argument(
        "--cache-mib",
        type=int,
        default=320,
        help="llama-server's prompt cache in RAM (--cache-ram), per replica, MiB (default: 320: room for the "
        "conversations one replica takes by prefix, 16 of about 14 MiB at the default model's 4 KiB a token, "
        "not for all 32)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256, help="the model's embedding width (default: 256)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--load-factor", type=float, default=LOAD_FACTOR, help=f"[gateway] prefix_load_factor (default: {LOAD_FACTOR})"
    )
    parser.add_argument("--router-chains", type=int, default=10_000)
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if not policies or any(p not in POLICIES for p in policies):
        parser.error(f"--policies: a comma-separated list of {', '.join(POLICIES)}")
    if args.conversations * args.turns > MAX_REQUESTS or min(args.conversations, args.turns, args.replicas) < 1:
        parser.error(f"--conversations × --turns must be 1..{MAX_REQUESTS}, --replicas at least 1")
    if args.width % 4:
        parser.error("--width must be a multiple of 4 (the model's 4 heads)")
    if args.server is None:
        try:
            args.server = default_server()
        except NoServer as exc:
            parser.error(str(exc))
    if not os.access(args.server, os.X_OK):
        parser.error(f"no llama-server at {args.server!r}; pass --server")
    out: dict = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "settings": {
            k: getattr(args, k)
            for k in (
                "conversations",
                "turns",
                "systems",
                "system_tokens",
                "first_tokens",
                "turn_tokens",
                "max_tokens",
                "concurrency",
                "replicas",
                "slots",
                "context",
                "cache_mib",
                "load_factor",
                "layers",
                "width",
            )
        },
    }
    with tempfile.TemporaryDirectory(prefix="llmgw-prefix-bench-") as tmp_name:
        tmp = Path(tmp_name)
        from testlib.tinygguf import write_tiny_llama

        context = args.context * 2
        model = write_tiny_llama(
            tmp / "model.gguf",
            n_layer=args.layers,
            n_embd=args.width,
            n_head=4,
            n_ff=args.width * 3,
            context=context,
            name="llmgw-prefix-bench",
        )
        out["model_mib"] = round(model.stat().st_size / 2**20, 1)
        one = Replicas(args.server, model, 1, 1, args.context, args.cache_mib, tmp)
        try:
            per_word = tokens_per_word(one.endpoints[0])
        finally:
            one.stop()
        out["tokens_per_word"] = round(per_word, 3)
        work = conversations(args, per_word)
        for policy in policies:
            out[policy] = run_policy(args, policy, model, tmp, work)
    if "prefix" in out and "least_outstanding" in out:
        lo, px = out["least_outstanding"], out["prefix"]
        out["ttft_p50_ratio"] = round(px["ttft_p50_ms"] / lo["ttft_p50_ms"], 3)
        out["ttft_p99_ratio"] = round(px["ttft_p99_ms"] / lo["ttft_p99_ms"], 3)
    out |= router_decision(args, work)
    met = {"router_decision_p99_us": out["router_decision_p99_us"] <= TARGETS["router_decision_p99_us"]}
    if "ttft_p50_ratio" in out:
        met["ttft_p50_ratio"] = out["ttft_p50_ratio"] <= TARGETS["ttft_p50_ratio"]
        met["ttft_p99_no_worse"] = out["ttft_p99_ratio"] <= 1.0
        met["load_imbalance"] = out["prefix"]["load_imbalance"] <= TARGETS["load_imbalance"]
    out["targets_met"] = met
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop children on SIGTERM too
    raise SystemExit(main())
