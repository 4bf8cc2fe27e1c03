"""The agent process: load agent.toml, check the node's identity files, keep the link up.

`run_agent` is the root of the agent's one nursery; `llmgw agent run` calls it.
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import attrs
import trio

from agent import ibdiags, inventory
from agent.discovery import system
from agent.link import AgentLink, Target
from llmgw import __version__, pki
from llmgw.config import AgentConfig
from llmgw.log import get_logger
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent")


@attrs.frozen(kw_only=True)
class Identity:
    node_id: str
    boot_id: str
    started_at: float


def node_id_of(config: AgentConfig) -> str:
    return config.node_id or socket.gethostname()


def boot_id(path: Path = Path("/proc/sys/kernel/random/boot_id")) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return f"unknown-{uuid.uuid4()}"


async def run_agent(config: AgentConfig, *, task_status: trio.TaskStatus[AgentLink] = trio.TASK_STATUS_IGNORED) -> None:
    state_dir = Path(config.state_dir)
    files = pki.node_paths(state_dir)
    identity = Identity(node_id=node_id_of(config), boot_id=boot_id(), started_at=time.time())
    ssl_context = pki.client_ssl_context(files.ca_cert, files.cert, files.key)
    if config.fabrics:
        # Fabric identities come from sminfo (infiniband-diags): install it where it is missing.
        outcome = await trio.to_thread.run_sync(
            lambda: ibdiags.ensure(config.sminfo, system.os_family(Path("/etc/os-release")), needed=True)
        )
        log.info("infiniband_diags", status=outcome.status, detail=outcome.detail)
    # Discovery runs tools with timeouts and reads sysfs: off the event loop.
    inv = await trio.to_thread.run_sync(inventory.collect, config)
    for problem in inv.fabric_problems:
        log.warning("fabric_refused", problem=problem)

    def make_hello() -> w.Hello:
        return w.Hello(
            protocol_version=w.PROTOCOL_VERSION,
            node_id=identity.node_id,
            agent_version=__version__,
            boot_id=identity.boot_id,
            started_at=identity.started_at,
            inventory=inv,
        )

    link = AgentLink(
        target=Target.parse(config.server), node_id=identity.node_id, ssl_context=ssl_context, make_hello=make_hello
    )
    log.info("agent_starting", node=identity.node_id, server=config.server, state_dir=str(state_dir))
    async with trio.open_nursery() as nursery:
        await nursery.start(link.serve)
        task_status.started(link)
