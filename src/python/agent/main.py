"""The agent process: load agent.toml, check the node's identity files, keep the link up.

`run_agent` is the root of the agent's one nursery; `llmgw agent run` calls it. Each of its
loops (replicas, link, assignments, reports, inventory, engines, bench) runs under
`llmgw.supervision.Background`: a failure after start is logged with its traceback and that
loop alone starts again with backoff, so the link and the replicas outlive a failing
inventory or engine check; a failure at start ends the agent with its own message.

The agent watches its own event loop (`llmgw.looplag`): a lag is logged (`event_loop_lagged`,
once per 10 s at most, saying whether the loop was busy, short of CPU, or blocked or paused).
It has no HTTP server, so the figures stay in the log.
"""

from __future__ import annotations

import os
import time
import uuid
from functools import partial
from pathlib import Path

import attrs
import trio

from agent import ibdiags, inventory
from agent.bench import Bench, replicas_busy, serve_bench
from agent.discovery import system
from agent.engines import Engines, engine_store, serve_engines
from agent.link import AgentLink
from agent.node_address import NodeAddress
from agent.node_id import node_id_of
from agent.peers import Members, PeerClient, PeerServer, peer_ssl_context
from agent.replica_rpc import RpcIdentity
from agent.replica_supervisor import Supervisor, serve_assignments
from agent.swarm import Peering, Tracker
from agent.weights import WeightsStore
from agent.weights_report import held_now, serve_staging, serve_weights_report
from llmgw import __version__, private
from llmgw.config import AgentConfig, control_planes, weights_cache_bytes_of, weights_dir_of
from llmgw.engines.wants import vulkan_devices_env
from llmgw.errors import LlmgwError
from llmgw.linkio import Targets
from llmgw.log import get_logger
from llmgw.looplag import LagMonitor, serve_loop_lag
from llmgw.pki.files import NODE_DIR_WHAT, node_paths
from llmgw.pki.tls import client_ssl_context
from llmgw.supervision import Background
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent")

INVENTORY_INTERVAL_S = 60.0


@attrs.frozen(kw_only=True)
class Identity:
    node_id: str
    boot_id: str
    started_at: float


def boot_id(path: Path = Path("/proc/sys/kernel/random/boot_id")) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return f"unknown-{uuid.uuid4()}"


def check_private(state_dir: Path) -> None:
    """Refuse to start (`private.NotPrivate`, with the fixes) unless the node's private directories
    are its own and closed to others: pki/ (the node key; the key itself is checked where TLS reads
    it) and run/ (the records that decide which processes the agent adopts and signals), and the
    state directory that holds them is writable by no one else."""
    found = private.check(state_dir, "the agent's state directory", is_dir=True, writable_only=True)
    found += private.check(state_dir / "pki", NODE_DIR_WHAT, is_dir=True)
    found += private.check(state_dir / "run", "the records of the engines this agent runs", is_dir=True)
    if found:
        raise private.NotPrivate(found)


def engines_environ(config: AgentConfig, inv: w.Inventory) -> dict[str, str] | None:
    """The engines' base environment: this process's (None), or with what llama.cpp's Vulkan build
    needs to use a software device when agent.toml forces "vulkan" (wants.vulkan_devices_env), where
    the operator's environment does not already say it."""
    extra = {k: v for k, v in vulkan_devices_env(config.llamacpp_backend, inv).items() if k not in os.environ}
    if not extra:
        return None
    log.info("engine_environment", reason='llamacpp_backend = "vulkan" on software Vulkan devices alone', **extra)
    return {**os.environ, **extra}


async def run_agent(
    config: AgentConfig,
    *,
    watch_loop: bool = True,
    task_status: trio.TaskStatus[AgentLink] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`watch_loop`: measure the event loop's lag; off where another service of the same process
    already does (`llmgw up`: its control plane)."""
    state_dir = Path(config.state_dir)
    files = node_paths(state_dir)
    check_private(state_dir)
    identity = Identity(node_id=node_id_of(config), boot_id=boot_id(), started_at=time.time())
    ssl_context = client_ssl_context(files.ca_cert, files.cert, files.key)
    if config.fabrics:
        # Fabric identities come from sminfo (infiniband-diags): install it where it is missing.
        outcome = await trio.to_thread.run_sync(
            lambda: ibdiags.ensure(config.sminfo, system.os_family(Path("/etc/os-release")), needed=True)
        )
        log.info("infiniband_diags", status=outcome.status, detail=outcome.detail)
    # Discovery runs tools with timeouts and reads sysfs: off the event loop.
    current = Current(inventory=await trio.to_thread.run_sync(inventory.collect, config))
    engines = Engines()
    # Engines listen on the address the control plane reaches this node at: the link's local one.
    address = NodeAddress()
    # The supervisor belongs to the agent, not to the link: replicas outlive any session.
    supervisor = Supervisor(
        state_dir=state_dir,
        # No ssl_context: weights come from public URLs, checked with the system's CAs, not the cluster's.
        weights=WeightsStore(Path(weights_dir_of(config)), limit_bytes=weights_cache_bytes_of(config)),
        engine_command=engines.command_for,
        gpus=lambda: tuple(g.index for g in current.inventory.gpus),
        listen_host=address,
        rpc=RpcIdentity.of(files),  # llama.cpp's RPC between nodes goes through this node's tunnels
        env=engines_environ(config, current.inventory),
    )
    weights = supervisor.life.weights
    current.weights = await trio.to_thread.run_sync(held_now, weights)  # the hello says it
    for problem in current.inventory.fabric_problems:
        log.warning("fabric_refused", problem=problem)

    def make_hello() -> w.Hello:
        return w.Hello(
            protocol_version=w.PROTOCOL_VERSION,
            node_id=identity.node_id,
            agent_version=__version__,
            boot_id=identity.boot_id,
            started_at=identity.started_at,
            inventory=current.inventory,
            engines=engines.as_tuple(),
            replicas=supervisor.statuses(),
            weights=current.weights,
            speeds=bench.as_tuple(),
        )

    # llama.cpp's speed on this node, measured while its replicas are idle (agent.bench).
    bench = Bench(
        directory=state_dir / "bench",
        busy=partial(replicas_busy, lambda: [r.pid for r in supervisor.statuses()]),
    )
    link = AgentLink(
        target=Targets.parse(control_planes(config)),
        node_id=identity.node_id,
        ssl_context=ssl_context,
        make_hello=make_hello,
        source_address=config.source_address,
        address=address,
    )
    servers = ", ".join(control_planes(config))
    log.info("agent_starting", node=identity.node_id, server=servers, state_dir=str(state_dir))
    background = Background(log, node=identity.node_id)  # `llmgw up` runs several agents in one process
    # Weights from and to the other nodes (agent.peers, agent.swarm): the tracker is asked at the
    # control plane this agent is linked to.
    tracker = Tracker(lambda: link.target.url, ssl_context)
    members = Members(tracker.members)
    peering = Peering(
        node_id=identity.node_id,
        tracker=tracker,
        client=PeerClient(files.ca_cert, files.cert, files.key, control_plane_context=ssl_context),
        members=members,
    )
    weights.peering = peering if config.weights_from_peers else None
    peer_server = PeerServer(weights.offer, peer_ssl_context(files), members)
    async with trio.open_nursery() as nursery:
        if watch_loop:
            await nursery.start(background.run, "loop_lag", partial(serve_loop_lag, LagMonitor()))
        try:
            weights.serve_port = await nursery.start(
                background.run, "weights_peers", peer_server.serve, config.weights_port
            )
        except OSError as exc:
            log.warning(
                "weights_port_unavailable",
                port=config.weights_port,
                reason=str(exc),
                detail="this node fetches weights from the others but serves none; free the port or change "
                "weights_port in agent.toml",
            )
        current.weights = attrs.evolve(current.weights, port=weights.serve_port)
        link.answer_logs = partial(answer_logs, supervisor)
        await nursery.start(background.run, "replicas", supervisor.serve)
        engines.vouch(supervisor.adopted_engines())
        await nursery.start(background.run, "link", link.serve)
        await nursery.start(
            background.run,
            "assignments",
            serve_assignments,
            supervisor,
            lambda: link.state.desired,
            link.desired_changed,
        )
        await nursery.start(background.run, "reports", supervisor.serve_reports, link.send)

        async def report_weights(held: w.WeightsHeld) -> None:
            current.weights = held
            await link.send(w.WeightsChanged(weights=held))

        await nursery.start(
            background.run, "weights", serve_weights_report, weights, lambda: current.weights, report_weights
        )
        await nursery.start(
            background.run, "staging", serve_staging, weights, lambda: link.state.desired, link.desired_changed
        )
        await nursery.start(background.run, "inventory", serve_inventory, config, current, link)
        await nursery.start(
            background.run,
            "engines",
            partial(
                serve_engines,
                config,
                engines,
                lambda: link.state.desired,
                link.desired_changed,
                link.send,
                lambda: current.inventory,
                store=engine_store(config, ssl_context),
                server_url=lambda: link.target.url,  # the control plane linked to last: the leader
            ),
        )
        await nursery.start(
            background.run,
            "bench",
            partial(serve_bench, bench, engines, lambda: link.state.desired, link.desired_changed, link.send),
        )
        task_status.started(link)


def answer_logs(supervisor: Supervisor, request: w.LogsRequest) -> w.LogsReply:
    """`llmgw ctl logs`: the tail of a replica's engine log here, or why there is none."""
    try:
        text = supervisor.tail(request.replica_id, lines=max(1, min(request.lines, 10000)))
    except LlmgwError as exc:
        return w.LogsReply(request_id=request.request_id, replica_id=request.replica_id, error=str(exc))
    return w.LogsReply(request_id=request.request_id, replica_id=request.replica_id, text=text)


def _stable(inv: w.Inventory) -> w.Inventory:
    """The inventory without what changes by the minute (free memory, disk, GPU memory)."""
    return attrs.evolve(
        inv,
        memory_available_bytes=0,
        disk_free_bytes=0,
        gpus=tuple(attrs.evolve(g, memory_free_mib=0) for g in inv.gpus),
    )


@attrs.define
class Current:
    inventory: w.Inventory
    weights: w.WeightsHeld = w.WeightsHeld()  # what the weights cache holds, as last told


async def serve_inventory(
    config: AgentConfig,
    current: Current,
    link: AgentLink,
    *,
    interval_s: float = INVENTORY_INTERVAL_S,
    read=None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Look at the node again every `interval_s`; tell the control plane when anything changed
    (a GPU gone, a link down, memory added). A reconnect's hello carries the latest anyway."""
    task_status.started()
    while True:
        await trio.sleep(interval_s)
        fresh = await (read() if read is not None else trio.to_thread.run_sync(inventory.collect, config))
        if _stable(fresh) != _stable(current.inventory):
            current.inventory = fresh
            sent = await link.send(w.InventoryChanged(inventory=fresh))
            log.info("inventory_changed", sent=sent)
