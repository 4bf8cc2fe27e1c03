"""Chaos on real llama-server replicas: streams killed mid-answer, checked against the greedy answer.

    ./pants run tools/bench/chaos.py -- --engine llamacpp --json     (as root: nodes in network namespaces)

chaos.py's cluster and faults (`chaos.Bench`: three nodes, one model `chat` of two replicas, so one
node is spare; here each fault hits the replica with the most requests in flight, `LlamaBench`),
with the model on llama.cpp instead of the sim: llama-server (agent.toml's `llamacpp_bin`, this
machine's portable build as the tests find it, or `--llama-server`) serving a
GGUF the bench makes, whose greedy answer re-tokenizes to the same tokens (testlib.makegguf,
`cycle=True`), so a stream continued on another replica must end with exactly the text it would
have had uninterrupted. Each replica has one thread and `-np` = `--streams` slots and room for the
short requests in flight (`slots`), so that the one left after a kill carries the whole load: every
stream, the short requests and the continuations, with no request waiting for a slot.

The load (`GreedyLoad`, chaos_load's with greedy streams): `--streams` streams in flight, chat and
text completions in turn, each of exactly `--stream-tokens` tokens (`ignore_eos`), one prompt per
stream slot; before the faults each prompt's uninterrupted greedy answer is asked once, not
streamed, and every stream after is checked against it word for word (`streams_wrong_text`);
and `--rate` short non-streamed requests a second. The faults: `engine_kill` (SIGKILL one
replica's llama-server: the agent starts it again) and `node_kill` (a node's agent and engines
together; it comes back). The result has chaos.py's keys for those faults (failed streams, moved
streams, wrong text, the moved streams' longest gap between two tokens and their gap across the
kill, at p99 and max) and its targets (chaos.targets). With `--keep`, `streams.jsonl` in the kept
directory has every stream's tokens' times and request id, to read beside the gateway's log
(`gateway_stream_broken`, `gateway_stream_migrated`) and each engine's (`node-*/logs/`). The streams are fewer than the sim's 500: two one-thread llama-server
replicas on a 2-core machine carry about a dozen (the default 12; docs/reliability.md).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import sys
from pathlib import Path

import trio
from bench import chaos
from bench import chaos_attacks as attacks
from bench.chaos_cluster import ChaosCluster, poll, report, run_and_print
from bench.chaos_load import CHAT, COMPLETIONS, Load

FAULTS = ("engine_kill", "node_kill")
# Eight 512-wide layers (F32, 130 MB): loaded in a third of a second; on one thread of a 2-core
# machine about 20 ms a token for each of 2 streams, 45 for each of 6, so that a stream of 128
# tokens lasts seconds, as an answer does, and a kill finds streams in the middle.
MODEL_SHAPE = {"n_layer": 8, "n_embd": 512, "n_head": 8, "dtype": "F32"}
CONTEXT_PER_SLOT = 512  # a prompt of a few tokens and at most MAX_STREAM_TOKENS
MAX_STREAM_TOKENS = 256
# A short request's time on a replica carrying the whole load: 16 tokens at 60 ms a step, about
# 1 s on a quiet machine (4-5 s when others' work takes most of its core: no slot count helps
# then). Each replica has this many seconds of `--rate` in slots beside the streams' (`slots`):
# more would not be free, each slot in use slowing the others' steps.
SHORT_REQUEST_S = 2.0


def slots(streams: int, rate: float) -> int:
    """Each replica's slots (`-np`): one per stream and room for the short requests in flight, so
    that one replica alone carries the whole load. With slots for the streams alone, a survivor
    of a kill had every slot taken (its streams, the moved ones, the short requests) and a moved
    stream waited in llama-server for a slot to free, 0.8-1.2 s (docs/reliability.md). A slot
    idle costs its context's memory alone (512 tokens, 8 MiB here)."""
    return streams + math.ceil(rate * SHORT_REQUEST_S)


def catalog(model: Path, slots: int, http_cap: int) -> str:
    args = ["--ctx-size", str(CONTEXT_PER_SLOT * slots), "-np", str(slots), "--threads", "1"]
    return (
        f"[http]\nmax_connections = {http_cap}\nmax_agent_connections = {attacks.AGENT_CAP}\n\n"
        # llama.cpp's speed not measured by itself (agent.bench): it would cost each node CPU the
        # chaos measures nothing of. Its other keys keep their defaults.
        "[engines.llamacpp]\nmeasure_speed = false\n\n"
        f'[[models]]\nname = "{chaos.MODEL}"\nengine = "llamacpp"\nsource = {{ path = "{model}" }}\n'
        f"replicas = {chaos.REPLICAS}\nargs = {json.dumps(args)}\n"
    )


def llama_server_path(given: str) -> str:
    if given:
        if not os.access(given, os.X_OK):
            raise SystemExit(f"chaos: --llama-server {given}: no executable there")
        return given
    import pytest

    from testlib.llama import llama_server

    try:
        return llama_server()
    except pytest.fail.Exception as exc:  # its message says where it looked
        raise SystemExit(f"chaos: {exc}; or give --llama-server PATH") from None


def outstanding(port: int, model: str) -> dict[str, int]:
    """Requests each replica of `model` has outstanding in the gateway now, over all its workers
    (`llmgw_gateway_replica_outstanding` of its /metrics); {} when it does not answer."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/metrics")
        data = conn.getresponse().read().decode()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for m in re.finditer(r"^llmgw_gateway_replica_outstanding\{([^}]*)\} (\S+)$", data, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("model") == model:
            out[labels["replica"]] = out.get(labels["replica"], 0) + int(float(m.group(2)))
    return out


class LlamaBench(chaos.Bench):
    """chaos.Bench, its faults dealt to the replica (or its node) with the most requests in the
    gateway: with a few streams, prompt affinity may leave the other replica idle at the moment,
    and a kill there would cut nothing."""

    def _replica_on(self, spare_ok: bool = False) -> tuple[str, dict]:
        busy = outstanding(self.cluster.http_port, chaos.MODEL)
        replica = max(self.placed(), key=lambda r: busy.get(r["replica"], 0))  # the first of equals
        return replica["nodes"][0], replica


class GreedyLoad(Load):
    """chaos_load's load with greedy streams, one prompt per stream slot (each round asks it
    again), each checked against the uninterrupted answer to its prompt (`learn`)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.answers: dict[str, str] = {}

    def stream_body(self, slot: int, round_: int) -> tuple[str, dict]:
        body: dict = {
            "model": self.model,
            "max_tokens": self.stream_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        if slot % 2:
            return COMPLETIONS, {**body, "prompt": f"Chaos stream {slot}:"}
        return CHAT, {**body, "messages": [{"role": "user", "content": f"chaos stream {slot}"}]}

    @staticmethod
    def _key(path: str, body: dict) -> str:
        return json.dumps([path, body.get("prompt"), body.get("messages")])

    def expected(self, path: str, body: dict) -> str:
        return self.answers[self._key(path, body)]

    async def learn(self) -> float:
        """Ask each slot's prompt once, not streamed, before the load: the uninterrupted greedy
        answers (`expected`). Returns the longest one took."""
        slowest = 0.0
        for slot in range(self.streams):
            path, body = self.stream_body(slot, 0)
            data = bytearray()
            started = trio.current_time()
            status = await self.one(path, {**body, "stream": False}, data.extend)
            slowest = max(slowest, trio.current_time() - started)
            if status != 200:
                raise SystemExit(
                    f"chaos: the uninterrupted answer to stream {slot}: HTTP {status}: {bytes(data[:200])!r}"
                )
            choice = json.loads(data)["choices"][0]
            self.answers[self._key(path, body)] = choice["message"]["content"] if path == CHAT else choice["text"]
        return slowest


async def main_async(args: argparse.Namespace, root: Path) -> dict:
    from testlib.makegguf import make_gguf

    load_average = [round(x, 2) for x in os.getloadavg()]  # before the bench's own processes
    netns = os.geteuid() == 0 and not args.no_netns
    faults = tuple(f for f in (args.faults or ",".join(FAULTS)).split(",") if f)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise SystemExit(f"unknown faults {sorted(unknown)}; with --engine llamacpp: {', '.join(FAULTS)}")
    binary = llama_server_path(args.llama_server)
    model = make_gguf(root / "cycle.gguf", cycle=True, **MODEL_SHAPE)
    interval = args.heartbeat_interval_s
    http_cap = attacks.http_cap(args.streams)
    n_slots = args.slots or slots(args.streams, args.rate)
    cluster = await trio.to_thread.run_sync(
        lambda: ChaosCluster(
            root,
            nodes=chaos.NODES,
            netns=netns,
            catalog=catalog(model, n_slots, http_cap),
            heartbeat_interval_s=interval,
            heartbeat_ttl_s=args.heartbeat_ttl_s,
            agent_toml=f"llamacpp_bin = {json.dumps(binary)}\n",
        )
    )
    try:
        await trio.to_thread.run_sync(cluster.start_server)
        for node in chaos.NODES:
            cluster.start_agent(node)
        token = await trio.to_thread.run_sync(lambda: cluster.token("chaos"))
        load = GreedyLoad(
            "127.0.0.1",
            cluster.http_port,
            token,
            model=chaos.MODEL,
            rate=args.rate,
            streams=args.streams,
            stream_tokens=args.stream_tokens,
        )
        bench = LlamaBench(cluster, load, args.heartbeat_ttl_s, http_cap)
        async with trio.open_nursery() as nursery:
            if not await trio.to_thread.run_sync(lambda: poll("full capacity", bench.full, chaos.FULL_TIMEOUT_S)):
                raise SystemExit("chaos: the cluster did not reach full capacity; see the logs under " + str(root))
            alone_s = await load.learn()
            load.spread_s = alone_s  # the streams' starts spread over one stream's length, alone
            await nursery.start(load.run)
            with trio.move_on_after(chaos.FULL_TIMEOUT_S):
                await load.steady.wait()
            await bench.run(faults)
            nursery.cancel_scope.cancel()
        bench.watch_exits()
        if args.keep:
            load.dump(root / "streams.jsonl")
        answers = set(load.answers.values())
        return report(
            {
                "engine": "llamacpp",
                "llama_server": binary,
                "model": {**MODEL_SHAPE, "n_vocab": 600, "cycle": True},
                "slots_per_replica": n_slots,
                "threads_per_replica": 1,
                "nodes": len(chaos.NODES),
                "network_namespaces": netns,
                "replicas": chaos.REPLICAS,
                "rate_per_s": args.rate,
                "streams": args.streams,
                "stream_tokens": args.stream_tokens,
                "uninterrupted_answers": len(load.answers),
                "distinct_uninterrupted_answers": len(answers),
                "uninterrupted_answer_s": round(alone_s, 3),
                "http_max_connections": http_cap,
                "heartbeat_interval_s": interval,
                "heartbeat_ttl_s": args.heartbeat_ttl_s,
                "load_average_at_start": load_average,
            },
            bench,
            chaos.targets(bench.results, args.heartbeat_ttl_s, interval),
        )
    finally:
        await trio.to_thread.run_sync(cluster.close)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--engine", choices=("llamacpp",), default="llamacpp", help="(chaos.py hands over with it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    parser.add_argument("--faults", help=f"comma-separated, in order (default: {','.join(FAULTS)})")
    parser.add_argument("--rate", type=float, default=2.0, help="short non-streamed requests a second (default 2)")
    parser.add_argument("--streams", type=int, default=12, help="streams in flight (default 12)")
    parser.add_argument(
        "--slots",
        type=int,
        default=0,
        help=f"each replica's slots (-np) (default: --streams and {SHORT_REQUEST_S:g} s of --rate)",
    )
    parser.add_argument(
        "--stream-tokens", type=int, default=128, help="tokens of each stream, exactly (ignore_eos) (default 128)"
    )
    parser.add_argument("--heartbeat-interval-s", type=float, default=5.0, help="server.toml's (default 5)")
    parser.add_argument("--heartbeat-ttl-s", type=float, default=30.0, help="server.toml's (default 30)")
    parser.add_argument(
        "--llama-server", default="", help="the llama-server to run (default: the tests' portable build)"
    )
    parser.add_argument("--no-netns", action="store_true", help="nodes on loopback addresses even as root")
    parser.add_argument("--keep", action="store_true", help="keep the cluster's directory (logs) afterwards")
    args = parser.parse_args(argv)
    if not 1 <= args.stream_tokens <= MAX_STREAM_TOKENS:
        parser.error(
            f"--stream-tokens {args.stream_tokens}: give 1 to {MAX_STREAM_TOKENS} (each slot holds {CONTEXT_PER_SLOT})"
        )
    if args.streams < 1:
        parser.error(f"--streams {args.streams}: give at least 1")
    return run_and_print(main_async, args, "llmgw-chaos-llama-")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
