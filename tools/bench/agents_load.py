"""Simulated agents for `tools/bench/controlplane.py`: in one process, the agents FROM..TO-1 of a
certificate directory, each the product's own agent link (`agent.link.AgentLink`: TCP, TLS with
its own client certificate, the WebSocket upgrade, a real hello with an inventory of 8 GPUs and
2 fabrics, heartbeats at the interval the control plane tells), to a control plane on loopback.

    PYTHONPATH=src/python:tests:tools python3 -m bench.agents_load --port P --certs DIR --first A --count N

Each agent's files are DIR/node-NNNNN/{node.key,node.crt} and DIR/ca.crt. Every half second it
prints one JSON line, `{"connected": C, "sessions": S, "attempts": A, "cuts": K}` (links up now,
sessions ever, dials ever: a dial that brought no session was refused or failed; cuts made). A
line `cut` on its standard input closes every link at once (the agents dial again on their own
backoff, as after a network cut) and says so at once, in a line with `cuts` one more: the links
may all be up again by the next half second, so "fewer connected" is no sign that it was done.
End of input or SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import attrs
import trio

from agent.link import AgentLink, Target
from llmgw import log
from llmgw.pki.tls import client_ssl_context
from llmgw.wire import agent_link as w

REPORT_S = 0.5
GPUS = 8
ENGINE = "vllm"  # what every agent reports installed
REPLICA_PORT = 9  # discard: where a replica would serve, never dialled by the bench


def node_id(i: int) -> str:
    return f"node-{i:05d}"


def fabrics_of(i: int) -> tuple[tuple[str, str, str], ...]:
    """Agent i's fabrics as (name, identity, kind): one of four InfiniBand ones, one of two RoCE."""
    return ((f"ib-{i % 4}", f"fe80::{i % 4:x}", "infiniband"), (f"roce-{i % 2}", f"roce-subnet-{i % 2}", "roce"))


def inventory(i: int) -> w.Inventory:
    gpu = w.Gpu(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        uuid="",
        memory_total_mib=81559,
        memory_free_mib=81000,
        driver_version="580.65.06",
        compute_capability="9.0",
        pci_bus_id="",
    )
    return w.Inventory(
        hostname=node_id(i),
        os="linux",
        arch="x86_64",
        python="3.11",
        cpu_model="AMD EPYC 9454 48-Core Processor",
        cpu_cores=96,
        memory_total_bytes=1536 << 30,
        gpus=tuple(
            attrs.evolve(gpu, index=k, uuid=f"GPU-{i:05d}-{k}", pci_bus_id=f"0000:{k:02x}:00.0") for k in range(GPUS)
        ),
        fabrics=tuple(
            w.Fabric(name=name, identity=identity, adapters=(f"mlx5_{k}",), kind=kind)
            for k, (name, identity, kind) in enumerate(fabrics_of(i))
        ),
        gpu_status=w.GPUS_PRESENT,
    )


def hello(i: int, replicas: tuple[w.ReplicaStatus, ...] = ()) -> w.Hello:
    return w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node_id(i),
        agent_version="bench",
        boot_id=f"boot-{i}",
        started_at=1.0,
        inventory=inventory(i),
        engines=(w.EngineStatus(name=ENGINE, version="0.32.0", ok=True),),
        replicas=replicas,
    )


def ready(desired: w.DesiredState | None) -> tuple[w.ReplicaStatus, ...]:
    """Every replica member `desired` assigns, reported ready at once (a bench's engine: none
    runs; the gateway is never sent a request to one)."""
    if desired is None:
        return ()
    return tuple(
        w.ReplicaStatus(replica_id=a.replica_id, model=a.model, state=w.READY, node_rank=a.node_rank, port=REPLICA_PORT)
        for a in desired.replicas
    )


async def run(port: int, certs: Path, first: int, count: int) -> None:
    streams: set[trio.abc.Stream] = set()
    links: list[AgentLink] = []
    running: dict[int, tuple[w.ReplicaStatus, ...]] = {}  # what each agent "runs": its hello says it

    def hello_now(i: int) -> w.Hello:
        return hello(i, running.get(i, ()))

    for i in range(first, first + count):
        d = certs / node_id(i)
        link = AgentLink(
            target=Target(host="127.0.0.1", port=port),
            node_id=node_id(i),
            ssl_context=client_ssl_context(certs / "ca.crt", d / "node.crt", d / "node.key"),
            make_hello=partial(hello_now, i),
        )
        original = link.dial

        async def dial(target: Target, original=original) -> trio.abc.Stream:
            stream = await original(target)
            streams.add(stream)
            return stream

        link.dial = dial
        links.append(link)

    async def run_replicas(i: int, link: AgentLink) -> None:
        """Each desired state's replicas, ready at once, as an agent whose engines start instantly."""
        while True:
            await link.desired_changed()
            statuses = ready(link.state.desired)
            if statuses != running.get(i, ()):
                running[i] = statuses
                await link.send(w.ReplicasChanged(replicas=statuses))

    cuts = 0

    def say() -> None:
        connected = sum(1 for link in links if link.state.connected)
        sessions = sum(link.state.sessions for link in links)
        attempts = sum(link.state.attempts for link in links)
        print(
            json.dumps({"connected": connected, "sessions": sessions, "attempts": attempts, "cuts": cuts}), flush=True
        )

    async def report() -> None:
        while True:
            say()
            await trio.sleep(REPORT_S)

    async def commands(nursery: trio.Nursery) -> None:
        nonlocal cuts
        stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
        buffered = b""
        while True:
            data = await stdin.receive_some(1024)
            if not data:
                nursery.cancel_scope.cancel()
                return
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                if line.strip() == b"cut":
                    for stream in list(streams):
                        streams.discard(stream)
                        await trio.aclose_forcefully(stream)
                    cuts += 1
                    say()

    async with trio.open_nursery() as nursery:
        for i, link in zip(range(first, first + count), links, strict=True):
            nursery.start_soon(link.serve)
            nursery.start_soon(run_replicas, i, link)
        nursery.start_soon(report)
        nursery.start_soon(commands, nursery)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--port", type=int, required=True, help="the control plane's agent port on 127.0.0.1")
    parser.add_argument("--certs", type=Path, required=True, help="the certificates' directory")
    parser.add_argument("--first", type=int, required=True, help="the first agent's number")
    parser.add_argument("--count", type=int, required=True, help="how many agents")
    args = parser.parse_args(argv)
    log.setup("info")  # the agents' lines (why a link went down), on stderr: the bench keeps them
    trio.run(run, args.port, args.certs, args.first, args.count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
