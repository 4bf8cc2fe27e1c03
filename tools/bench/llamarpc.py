"""One llama.cpp model split over 2 and 3 nodes through llama.cpp's RPC, against the same model on
one node: load time, prompt and generation tokens per second.

    ./pants run tools/bench/llamarpc.py -- --json                     (a 365 MB F16 model, ~6 minutes)
    ./pants run tools/bench/llamarpc.py -- --json --nodes 2 --n-layer 2 --n-embd 64 \\
        --prompt-tokens 16 --n-predict 4 --completions 1               (the smoke run)

Nodes are network namespaces joined through this machine, each link shaped to --link-rate both
ways by tc's token bucket (testlib.shapednet.ShapedStar). The model is made here
(testlib.makegguf: random weights, so its text is noise; its shape sets the work). Needs root.

What runs is what llmgw's agents run, started directly rather than through a cluster: on each
helper node `ggml-rpc-server -H 127.0.0.1` behind llmgw's own tunnel (agent.rpctunnel's
TunnelServer, in a process of its own: tools/bench/llamarpc_tunnel.py, with a node certificate
of one CA, admitting the serving node alone), and on the serving node (node-0) the tunnel's
local ends (TunnelClient, its certificate checked by each helper's) and llama-server with
`--rpc` to them. For reference the same split without the tunnel: each rpc-server listening on
its node's address and llama-server dialling it directly (`direct`), so the tunnel's cost is
the difference. Both ends run with GGML_RPC_NO_RDMA=1, as the agents start them.

The split (`split`) is the agents' (llmgw.engines.llamacpp.rpc_layer_split, docs/engines.md "How
the layers are split"): each of N members holds n_layer // N of the repeating layers (the
remainder one more on each helper from rank 1 on); node-0's CPU keeps the first ones with the
token embeddings, and `--n-gpu-layers` (which counts the output layer) with `--tensor-split` gives
each helper its share, the last one the output layer too. The buffers llama-server reports for
each device are in the JSON (`buffers_mib`).

Per configuration: llama-server started (the helpers' rpc-servers and tunnels ready before it),
`load_s` from its start to /health answering 200 (its weights read, the helpers' sent over the
links, its own warm-up run), one warm-up completion, then --completions
completions of the same --prompt-tokens token ids (no prompt cache: each is prefilled whole)
generating exactly --n-predict tokens (ignore_eos). The figures are llama-server's own
`timings`: prompt_per_second and predicted_per_second, their median, min and max over the
completions. Every llama.cpp process runs with --threads (default 1): all the members share this machine's
cores, and llama.cpp's threads wait for each other spinning, so two threads a process on two
cores other work also uses lose most of their time (measured here, one node: 8 tokens/s
generated with -t 2 against 67 with -t 1, at a load average of 4-5). One member computes at a
time for one request (the layers are a pipeline), so one thread each uses one core of the two.

`--json` prints one object: `settings`, `engine`, `machine` (cpus, load average at the start and
the end), and `configurations` by name (one, direct-2, tunnel-2, direct-3, tunnel-3), each with
its figures and, but for `one`, its ratios to one's (`vs_one`). Every wait and request is bounded
in time; every process and namespace is removed at the end, an error's too.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import llamacpp, llamarpc_tunnel

from llmgw.engines.llamacpp import NO_RDMA, rpc_layer_split
from llmgw.llamarecipe import RPC_SERVER
from llmgw.pki.ca import new_ca
from llmgw.pki.files import issue_to_dir
from testlib.makegguf import make_gguf
from testlib.proc import llmgw_env
from testlib.shapednet import ShapedStar
from testlib.shapednet import preflight as net_preflight
from testlib.tinygguf import vocabulary

SERVER_PORT = 8080
RPC_PORT = 50052
TUNNEL_PORT = 50100
LOAD_TIMEOUT_S = 300.0  # a model's load: its weights sent to the helpers over the shaped links
READY_TIMEOUT_S = 60.0  # an rpc-server or a tunnel end listening
MAX_COMPLETIONS = 50
SPLIT_RULE = (
    "the agents' (llmgw.engines.llamacpp.rpc_layer_split): each member n_layer // N repeating layers, the "
    "remainder one more on each helper from rank 1; node-0's CPU the first ones, --n-gpu-layers the helpers' "
    "plus the output layer, --tensor-split their shares (the last helper's with the output layer)"
)
HOW = (
    "the pieces llmgw's agents run, started directly (no control plane or agents): ggml-rpc-server "
    "on each helper behind agent.rpctunnel's TunnelServer, llama-server --rpc on node-0 through "
    "TunnelClient (tunnel-N); and llama-server dialling each rpc-server directly (direct-N)"
)
# llama-server's log: "load_tensors:   CPU_Mapped model buffer size =   180.03 MiB", "RPC0[...] ..."
BUFFER = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")


class BenchFailed(Exception):
    """A process did not start or a request failed; the message says which, with its log's tail."""


class Member:
    """A process in a namespace with its log in a file; stopped (TERM, then KILL) by `stop`."""

    def __init__(self, name: str, ns, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        with log.open("wb") as out:
            self.popen = ns.popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def check(self) -> None:
        if self.popen.poll() is not None:
            raise BenchFailed(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def split_args(n_layer: int, members: int) -> list[str]:
    """`--n-gpu-layers` and `--tensor-split` as rank 0's agent gives them (llmgw.engines.llamacpp's
    rpc_layer_split, nodes without GPUs): about 1/members of the layers on each member."""
    if members == 1:
        return []
    layers, shares = rpc_layer_split(n_layer, members, 0)
    return ["--n-gpu-layers", str(layers), "--tensor-split", ",".join(map(str, shares))]


def prompt_ids(n: int) -> list[int]:
    """`n` token ids: BOS, then the vocabulary's plain pieces in turn (no control token)."""
    tokens, _, types = vocabulary()
    plain = [i for i, t in enumerate(types) if t == 1]  # gguf.TokenType.NORMAL
    return [1] + [plain[(7 * i) % len(plain)] for i in range(n - 1)]


def wait_line(member: Member, deadline_s: float) -> dict:
    """The first line a tunnel end prints (its JSON), within `deadline_s`."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        member.check()
        text = member.log.read_text(errors="replace")
        for line in text.splitlines():
            if line.startswith("{"):
                return json.loads(line)
        time.sleep(0.05)
    raise BenchFailed(f"{member.name} not ready within {deadline_s:g} s:\n{member.tail()}")


def wait_listening(member: Member, ns, port: int, deadline_s: float) -> None:
    """Until `member` (in `ns`) listens on `port` (any address), by `ss` inside the namespace:
    a probe connection would take the rpc-server's one client."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        member.check()
        if f":{port} " in ns.run("ss", "-Htln", f"sport = :{port}"):
            return
        time.sleep(0.05)
    raise BenchFailed(f"{member.name} not listening on {port} within {deadline_s:g} s:\n{member.tail()}")


def request(host: str, port: int, path: str, body: dict | None, timeout: float) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data.startswith(b"{") else data
    finally:
        conn.close()


def wait_health(server: Member, host: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        server.check()
        try:
            if request(host, SERVER_PORT, "/health", None, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise BenchFailed(f"llama-server not ready within {deadline_s:g} s:\n{server.tail()}")


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def run_config(
    root: Path, net: ShapedStar, *, nodes: int, path: str, model: Path, pki: dict, opts: argparse.Namespace
) -> dict[str, Any]:
    """One configuration on the star's first `nodes` nodes: its helpers, then llama-server, its
    load time and completions. Its processes are stopped before it returns or raises."""
    root.mkdir(parents=True)
    server_bin = opts.server
    rpc_bin = str(Path(server_bin).with_name(RPC_SERVER))
    threads = ["-t", str(opts.threads)]
    env = {**os.environ, **NO_RDMA}
    serving = net.nodes[0]
    members: list[Member] = []
    try:
        rpc: list[str] = []
        helpers = []
        for rank in range(1, nodes):
            ns = net.nodes[rank]
            host = "127.0.0.1" if path == "tunnel" else ns.node_addr
            argv = [rpc_bin, "-H", host, "-p", str(RPC_PORT), *threads]
            rpc_server = Member(f"rpc-server node-{rank}", ns, argv, root / f"rpc-server-{rank}.log", env)
            members.append(rpc_server)
            if path == "direct":
                wait_listening(rpc_server, ns, RPC_PORT, READY_TIMEOUT_S)
                rpc.append(f"{ns.node_addr}:{RPC_PORT}")
                continue
            end = Member(
                f"tunnel node-{rank}",
                ns,
                [sys.executable, llamarpc_tunnel.__file__, "helper", *pki[rank], "--admits", "node-0"]
                + ["--listen", f"{ns.node_addr}:{TUNNEL_PORT}", "--rpc-port", str(RPC_PORT)],
                root / f"tunnel-{rank}.log",
                llmgw_env(),
            )
            members.append(end)
            wait_line(end, READY_TIMEOUT_S)
            helpers += ["--helper", f"node-{rank}={ns.node_addr}:{TUNNEL_PORT}"]
        if helpers:
            end = Member(
                "tunnel node-0",
                serving,
                [sys.executable, llamarpc_tunnel.__file__, "serving", *pki[0], *helpers],
                root / "tunnel-0.log",
                llmgw_env(),
            )
            members.append(end)
            rpc = [f"127.0.0.1:{port}" for port in wait_line(end, READY_TIMEOUT_S)["ports"]]
        split = split_args(opts.n_layer, nodes)
        argv = [server_bin, "--model", str(model), "--host", serving.node_addr, "--port", str(SERVER_PORT)]
        argv += ["--ctx-size", str(opts.ctx_size), "--parallel", "1", *threads, "-lv", "4", *split]
        if rpc:
            argv += ["--rpc", ",".join(rpc)]
        started = time.monotonic()
        server = Member("llama-server node-0", serving, argv, root / "llama-server.log", env)
        members.append(server)
        wait_health(server, serving.node_addr, LOAD_TIMEOUT_S)
        load_s = time.monotonic() - started
        body = {"prompt": prompt_ids(opts.prompt_tokens), "n_predict": opts.n_predict, "ignore_eos": True}
        body |= {"cache_prompt": False, "temperature": 0}
        runs = []
        for i in range(opts.completions + 1):  # the first warms up
            status, answer = request(serving.node_addr, SERVER_PORT, "/completion", body, timeout=opts.request_timeout)
            if status != 200:
                raise BenchFailed(f"llama-server answered {status}: {answer!r:.300}\n{server.tail()}")
            t = answer["timings"]
            if t["prompt_n"] != opts.prompt_tokens or t["predicted_n"] != opts.n_predict:
                raise BenchFailed(f"asked {opts.prompt_tokens} prompt and {opts.n_predict} generated tokens: {t}")
            if i:
                runs.append({k: t[k] for k in ("prompt_n", "prompt_per_second", "predicted_n", "predicted_per_second")})
        buffers = {dev: float(mib) for dev, mib in BUFFER.findall(server.log.read_text(errors="replace"))}
        return {
            "nodes": nodes,
            "path": path,
            "args": split + (["--rpc", ",".join(rpc)] if rpc else []),
            "buffers_mib": buffers,
            "load_s": round(load_s, 2),
            "prompt_tokens_per_s": spread([r["prompt_per_second"] for r in runs]),
            "generation_tokens_per_s": spread([r["predicted_per_second"] for r in runs]),
            "runs": runs,
        }
    finally:
        for member in reversed(members):
            member.stop()


def issue_certificates(root: Path, nodes: int) -> dict[int, list[str]]:
    """Node certificates of one CA for node-0..node-N-1, as the tunnel ends' arguments."""
    ca = new_ca(validity_days=2)
    out = {}
    for rank in range(nodes):
        files = issue_to_dir(ca, f"node-{rank}", root / f"node-{rank}", validity_days=2)
        out[rank] = ["--cert", str(files.cert), "--key", str(files.key), "--ca", str(files.ca_cert)]
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one llama.cpp model over 2 and 3 nodes (RPC) against one node")
    parser.add_argument(
        "--server", help="llama-server (default: $LLMGW_LLAMA_SERVER, else the cached build); ggml-rpc-server beside it"
    )
    parser.add_argument("--nodes", default="2,3", help="the splits to measure beside one node, e.g. 2,3")
    parser.add_argument("--no-direct", action="store_true", help="skip the runs without the tunnel")
    parser.add_argument("--link-rate", default="1gbit")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--n-head-kv", type=int, default=4)
    parser.add_argument("--dtype", default="F16", choices=("F32", "F16", "Q8_0"))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--completions", type=int, default=3)
    parser.add_argument("--ctx-size", type=int, default=1024)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="each llama.cpp process's -t (default 1: the members share this machine's cores, see above)",
    )
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dir", type=Path, default=None, help="where files go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the directory (every process's log) afterwards")
    opts = parser.parse_args(argv)
    try:
        opts.splits = sorted({int(n) for n in opts.nodes.split(",")})
    except ValueError:
        parser.error(f"--nodes {opts.nodes!r}: node counts separated by commas, e.g. 2,3")
    if not opts.splits or min(opts.splits) < 2 or max(opts.splits) > 8:
        parser.error(f"--nodes {opts.nodes!r}: each split is over 2 to 8 nodes")
    if opts.n_layer < max(opts.splits):
        parser.error(f"--n-layer {opts.n_layer} cannot be split over {max(opts.splits)} nodes: one layer each at least")
    if not 1 <= opts.completions <= MAX_COMPLETIONS:
        parser.error(f"--completions must be 1..{MAX_COMPLETIONS}")
    if opts.prompt_tokens < 2 or opts.prompt_tokens + opts.n_predict > opts.ctx_size:
        parser.error("--prompt-tokens (at least 2) and --n-predict must fit in --ctx-size together")
    return opts


def run(opts: argparse.Namespace) -> dict[str, Any]:
    if why := net_preflight():
        raise SystemExit(f"llamarpc bench: {why}")
    if opts.server is None:
        try:
            opts.server = llamacpp.default_server()
        except llamacpp.NoServer as exc:
            raise SystemExit(f"llamarpc bench: {exc}") from None
    if not (Path(opts.server).with_name(RPC_SERVER)).is_file():
        raise SystemExit(f"llamarpc bench: no {RPC_SERVER} beside {opts.server}: a llama.cpp built with GGML_RPC=ON")
    load_start = list(os.getloadavg())
    tmp = tempfile.mkdtemp(prefix="llmgw-llamarpc-bench-", dir=opts.dir)
    try:
        root = Path(tmp)
        model = make_gguf(
            root / "model.gguf",
            n_layer=opts.n_layer,
            n_embd=opts.n_embd,
            n_head=opts.n_head,
            n_head_kv=opts.n_head_kv,
            dtype=opts.dtype,
        )
        most = max(opts.splits)
        pki = issue_certificates(root / "pki", most)
        configs: dict[str, Any] = {}
        with ShapedStar(root / "net", nodes=most, node_rate=opts.link_rate) as net:
            configs["one"] = run_config(root / "one", net, nodes=1, path="alone", model=model, pki=pki, opts=opts)
            for n in opts.splits:
                for path in ("tunnel",) if opts.no_direct else ("direct", "tunnel"):
                    name = f"{path}-{n}"
                    configs[name] = run_config(root / name, net, nodes=n, path=path, model=model, pki=pki, opts=opts)
        one = configs["one"]
        for name, c in configs.items():
            if name != "one":
                c["vs_one"] = {
                    key: round(c[key]["median"] / one[key]["median"], 3)
                    for key in ("prompt_tokens_per_s", "generation_tokens_per_s")
                } | {"load_s": round(c["load_s"] / one["load_s"], 3)}
        version = subprocess.run([opts.server, "--version"], capture_output=True, text=True, timeout=30, check=False)
        return {
            "settings": {
                "model": {
                    "n_layer": opts.n_layer,
                    "n_embd": opts.n_embd,
                    "n_head": opts.n_head,
                    "n_head_kv": opts.n_head_kv,
                    "dtype": opts.dtype,
                    "bytes": model.stat().st_size,
                },
                "prompt_tokens": opts.prompt_tokens,
                "n_predict": opts.n_predict,
                "completions": opts.completions,
                "ctx_size": opts.ctx_size,
                "threads": opts.threads,
                "link_rate": opts.link_rate,
                "split": SPLIT_RULE,
                "how": HOW,
            },
            "engine": {
                "llama_server": opts.server,
                "version": next(
                    (ln for ln in (version.stdout + version.stderr).splitlines() if ln.startswith("version")), ""
                ),
            },
            "machine": {
                "arch": platform.machine(),
                "cpus": os.cpu_count() or 0,
                "load_start": [round(x, 2) for x in load_start],
                "load_end": [round(x, 2) for x in os.getloadavg()],
            },
            "configurations": configs,
        }
    finally:
        if opts.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        results = run(opts)
    except BenchFailed as exc:
        print(f"llamarpc bench: {exc}", file=sys.stderr)
        return 1
    if opts.json:
        print(json.dumps(results, indent=2))
    else:
        for name, c in results["configurations"].items():
            print(
                f"{name}: load {c['load_s']} s, prompt {c['prompt_tokens_per_s']['median']} tokens/s, "
                f"generation {c['generation_tokens_per_s']['median']} tokens/s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
