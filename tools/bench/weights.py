"""How a weights file reaches every node: once from the internet, then node to node.

    ./pants run tools/bench/weights.py -- --json                 (8 nodes, 2 GiB, ~12 minutes)
    ./pants run tools/bench/weights.py -- --json --source-rate 500mbit --control-plane-origin
    ./pants run tools/bench/weights.py -- --json --nodes 3 --size-mib 16 --no-baseline   (the smoke run)

A real cluster: `llmgw server` on this machine, an `llmgw agent` in each of N network namespaces
and the file's source (tools/bench/rangeserver.py, HTTP with Range) in one more, every link shaped
by tc's token bucket (testlib.shapednet: each node's link at --node-rate both ways, the source's
upstream at --source-rate). The catalog has one model of the sim engine whose weights are the
file (url, sha256, size), with a replica on every node, so every node needs the file at once.
Needs root (namespaces, tc). Three runs, each with fresh nodes and an empty cache:

- single: one node alone downloads the file from the source (the time the others are measured by);
- swarm: N nodes, as shipped (agent.swarm: one node fetches from the source, the others from it
  and from each other);
- baseline (unless --no-baseline): N nodes with `weights_from_peers = false`, each downloading
  from the source through the same upstream;
- control_plane_origin (with --control-plane-origin): N nodes that cannot reach the source (it
  listens on this machine's loopback) and a control plane with `[downloads] weights_origin =
  "control_plane"`, which fetches the file and seeds it.

The JSON: per run, `spread_s` (from the first node's start of the download to the last node's
file verified, from the agents' `weights_download` and `weights_ready` log events),
`source_downloads` (bytes the source sent / the file's size), `uploaded_bytes` (by node: bytes
out of its link during the run, so protocol and control traffic included), `cpu_s_per_gib`
(CPU time of all agents over GiB received by all nodes); and `spread_ratio` = swarm spread_s /
single spread_s (the target: at most 1.3) and the baseline's.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import rangeserver

from llmgw.ctl.client import AdminClient
from testlib.proc import Proc, llmgw_here, run_llmgw
from testlib.shapednet import ShapedStar
from testlib.shapednet import preflight as net_preflight

FILE_NAME = "model.bin"
MODEL = "weights-bench"
SOURCE_PORT = 8080
READY_GRACE_S = 180.0  # beyond the transfer's own time at the rates given: joins, hashing, a loaded machine


def make_file(path: Path, size: int) -> str:
    """`size` bytes that do not compress (a weights file does not), and their SHA-256."""
    digest = hashlib.sha256()
    block = os.urandom(1 << 20)
    with path.open("wb") as f:
        left = size
        i = 0
        while left:
            chunk = hashlib.sha256(i.to_bytes(8, "big")).digest() + block[32:]
            chunk = chunk[: min(left, len(chunk))]
            f.write(chunk)
            digest.update(chunk)
            left -= len(chunk)
            i += 1
    return digest.hexdigest()


def _ts(event: dict) -> float:
    return (
        datetime.datetime.strptime(event["ts"], "%Y-%m-%dT%H:%M:%S.%fZ")
        .replace(tzinfo=datetime.timezone.utc)
        .timestamp()
    )


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _tx_bytes(ns) -> int:
    return int(ns.run("cat", f"/sys/class/net/{ns.link.inside}/statistics/tx_bytes").strip() or 0)


def _cli(*args: str) -> str:
    out = run_llmgw(*args, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"`llmgw {' '.join(args)}` exited {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def run_once(
    root: Path,
    *,
    nodes: int,
    peers: bool,
    file: Path,
    sha256: str,
    opts: argparse.Namespace,
    control_plane_origin: bool = False,
) -> dict[str, Any]:
    """One run on a fresh star: the time until every node holds the file, and what it cost.
    `control_plane_origin`: the source listens on this machine's loopback, which no node can
    reach (nodes without internet), and server.toml has the control plane fetch and seed it."""
    size = file.stat().st_size
    root.mkdir(parents=True)
    procs: list[Proc] = []
    with ShapedStar(root / "net", nodes=nodes, node_rate=opts.node_rate, source_rate=opts.source_rate) as net:
        assert net.source is not None
        stats = root / "source-stats.json"
        server_script = rangeserver.__file__  # stdlib only: runs as a script anywhere
        serve = [sys.executable, str(server_script), str(file), "--stats", str(stats)]
        if control_plane_origin:  # on this machine's loopback, a port no other program has
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                local_port = probe.getsockname()[1]
            source = subprocess.Popen([*serve, "--host", "127.0.0.1", "--port", str(local_port)])
            source_url = f"http://127.0.0.1:{local_port}/{FILE_NAME}"
        else:
            serve += ["--port", str(SOURCE_PORT)]
            source = net.source.popen(serve)
            source_url = f"http://{net.source.node_addr}:{SOURCE_PORT}/{FILE_NAME}"
        try:
            deadline = time.monotonic() + 30
            while not stats.exists():  # written once it listens
                if source.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the source ({' '.join(map(str, serve))}) did not start: exit {source.poll()}")
                time.sleep(0.05)
            agent_socket = socket.socket()
            agent_socket.bind(("0.0.0.0", 0))
            port = agent_socket.getsockname()[1]
            agent_socket.close()
            state = root / "state"
            config = root / "server.toml"
            advertise = ["127.0.0.1", *(ns.host_addr for ns in net.nodes)]
            head = (
                "[server]\n"
                f'state_dir = "{state}"\n'
                f'agent_listen = "0.0.0.0:{port}"\n'
                f'http_listen = "127.0.0.1:0"\n'
                f"advertise = {json.dumps(advertise)}\n\n"
                "[engines.llamacpp]\nenabled = false\n\n"
                + ('[downloads]\nweights_origin = "control_plane"\n\n' if control_plane_origin else "")
            )
            model = (
                f'[[models]]\nname = "{MODEL}"\nengine = "sim"\nreplicas = {nodes}\n'
                f'source = {{ url = "{source_url}", '
                f'sha256 = "{sha256}", size = {size} }}\n'
            )
            config.write_text(head)  # the model comes once every node has joined: they start together
            llmgw_here("ca", "init", "--config", str(config))  # set-up: the command's code in this process
            server = Proc("server", ["server", "--config", str(config), "--log-format", "json"], root / "server.log")
            procs.append(server)
            agents: dict[str, Proc] = {}
            for i, ns in enumerate(net.nodes):
                node = f"node-{i + 1}"
                home = root / node
                agent_toml = root / f"{node}.toml"
                agent_toml.write_text(
                    f'server = "wss://{ns.host_addr}:{port}"\nnode_id = "{node}"\nstate_dir = "{home}"\n'
                    f"weights_from_peers = {'true' if peers else 'false'}\n"
                )
                llmgw_here("agent", "csr", "--config", str(agent_toml))
                pki = home / "pki"
                llmgw_here(
                    "ca",
                    "issue",
                    node,
                    "--config",
                    str(config),
                    "--csr",
                    str(pki / "node.csr"),
                    "--out",
                    str(pki / "node.crt"),
                )
                shutil.copy(state / "ca" / "ca.crt", pki / "ca.crt")
            deadline = time.monotonic() + 60
            while not server.events("server_ready"):
                if server.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the control plane did not start:\n{server.tail()}")
                time.sleep(0.1)
            for i, ns in enumerate(net.nodes):
                node = f"node-{i + 1}"
                agents[node] = Proc(
                    node,
                    ["agent", "run", "--config", str(root / f"{node}.toml"), "--log-format", "json"],
                    root / f"{node}.log",
                    prefix=["ip", "netns", "exec", ns.name],
                )
                procs.append(agents[node])
            admin = AdminClient.locate(server=None, credential=None, state_dir=str(state))
            deadline = time.monotonic() + 120
            while sum(n["state"] == "joined" for n in admin.nodes()) < nodes:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the nodes did not join: {admin.nodes()}\n{server.tail()}")
                time.sleep(0.2)
            tx_before = {ns.name: _tx_bytes(ns) for ns in net.nodes}
            cpu_before = sum(_cpu_s(a.popen.pid) for a in agents.values())
            config.write_text(head + model)
            _cli("ctl", "reload", "--state-dir", str(state))
            rate_bytes = min(net.rate_bits(net.source), net.rate_bits(net.nodes[0])) / 8
            budget = READY_GRACE_S + size / rate_bytes * (nodes if not peers else 2)
            deadline = time.monotonic() + budget
            while not all(a.events("weights_ready") for a in agents.values()):
                for node, a in agents.items():
                    if a.returncode is not None:
                        raise RuntimeError(f"the agent of {node} exited:\n{a.tail()}")
                if time.monotonic() > deadline:
                    waiting = [n for n, a in agents.items() if not a.events("weights_ready")]
                    raise RuntimeError(
                        f"{waiting} hold no verified file after {budget:.0f} s:\n{agents[waiting[0]].tail()}"
                    )
                time.sleep(0.2)
            cpu = sum(_cpu_s(a.popen.pid) for a in agents.values()) - cpu_before
            uploaded = {f"node-{i + 1}": _tx_bytes(ns) - tx_before[ns.name] for i, ns in enumerate(net.nodes)}
            started = min(_ts(e) for a in agents.values() for e in a.events("weights_download"))
            ready = {n: _ts(a.events("weights_ready")[0]) - started for n, a in agents.items()}
            sent = json.loads(stats.read_text())["bytes_sent"]
            for node in agents:
                held = root / node / "weights" / sha256 / FILE_NAME
                if not held.is_file() or held.stat().st_size != size:
                    raise RuntimeError(f"{node} has no whole file at {held}")
            corrupt = sum(len(a.events("weights_peer_corrupt")) for a in agents.values())
            return {
                "nodes": nodes,
                "peers": peers,
                "spread_s": round(max(ready.values()), 2),
                "ready_s": {n: round(t, 2) for n, t in sorted(ready.items())},
                "source_downloads": round(sent / size, 3),
                "source_bytes": sent,
                "uploaded_bytes": uploaded,
                "agents_cpu_s": round(cpu, 2),
                "cpu_s_per_gib": round(cpu / (nodes * size / 2**30), 2),
                "corrupt_pieces": corrupt,
            }
        finally:
            for p in procs:
                p.kill()
            source.kill()
            source.wait(10)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="weights from the internet once, then node to node")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--node-rate", default="1gbit")
    parser.add_argument("--source-rate", default="200mbit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run where every node downloads alone")
    parser.add_argument(
        "--control-plane-origin",
        action="store_true",
        help="one more run: nodes without internet, the control plane fetching the file and seeding it",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dir", type=Path, default=None, help="where files go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the directory (logs of every process) afterwards")
    return parser.parse_args(argv)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """The three runs (two with --no-baseline) and the figures over them."""
    why = net_preflight()
    if why:
        raise SystemExit(f"weights bench: {why}")
    tmp = tempfile.mkdtemp(prefix="llmgw-weights-bench-", dir=opts.dir)
    try:
        root = Path(tmp)
        file = root / FILE_NAME
        size = opts.size_mib << 20
        sha256 = make_file(file, size)
        results: dict[str, Any] = {
            "settings": {
                "nodes": opts.nodes,
                "size_bytes": size,
                "node_rate": opts.node_rate,
                "source_rate": opts.source_rate,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            }
        }
        results["single"] = run_once(root / "single", nodes=1, peers=True, file=file, sha256=sha256, opts=opts)
        results["swarm"] = run_once(root / "swarm", nodes=opts.nodes, peers=True, file=file, sha256=sha256, opts=opts)
        single = results["single"]["spread_s"]
        results["spread_ratio"] = round(results["swarm"]["spread_s"] / single, 3)
        if not opts.no_baseline:
            results["baseline"] = run_once(
                root / "baseline", nodes=opts.nodes, peers=False, file=file, sha256=sha256, opts=opts
            )
            results["baseline_spread_ratio"] = round(results["baseline"]["spread_s"] / single, 3)
        if opts.control_plane_origin:
            results["control_plane_origin"] = run_once(
                root / "control-plane-origin",
                nodes=opts.nodes,
                peers=True,
                file=file,
                sha256=sha256,
                opts=opts,
                control_plane_origin=True,
            )
        results["targets"] = {
            "one_source_download": results["swarm"]["source_downloads"] <= 1.0,
            "spread_ratio_at_most_1_3": results["spread_ratio"] <= 1.3,
        }
        return results
    finally:
        if opts.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    opts = parse()
    results = run(opts)
    if opts.json:
        print(json.dumps(results, indent=2))
    else:
        for key, value in results.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
