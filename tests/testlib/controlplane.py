"""Building blocks of control-plane tests: a state directory with its CA, server certificate
and admin credential; a hello as an agent would send it."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from llmgw import paths
from llmgw.config import (
    AgentConfig,
    EnginesSection,
    LlamacppSource,
    Model,
    ReleaseSection,
    ServerConfig,
    ServerSection,
    StoreSection,
)
from llmgw.pki.ca import CA
from llmgw.pki.files import init_ca, issue_server_cert, issue_to_dir, load_ca, node_paths
from llmgw.wire import agent_link as w
from testlib.cluster import free_port

# The engines of an in-process control plane in a test: llama.cpp as the operator's install
# (version ""), so nothing is fetched from the internet (the default's source to build, which
# the mirror fetches at start) and nothing built (minutes of CPU); these tests serve sim models.
# Nor measured by itself (agent.bench): an agent given a llama-server would spend seconds of CPU on
# it that no test but test_speed_bench (which turns it on) looks at.
OFFLINE_ENGINES = EnginesSection(llamacpp=LlamacppSource(version="", measure_speed=False))


def make_state(state: Path, *, sans: Sequence[str] = ("127.0.0.1",), days: int = 3) -> CA:
    """What `llmgw ca init` leaves in a control plane's state directory; returns the CA."""
    init_ca(state, validity_days=days)
    ca = load_ca(state)
    issue_server_cert(ca, state, list(sans), validity_days=days)
    paths.ensure_admin_token(state)
    return ca


def hello(
    node_id: str,
    *,
    started_at: float = 1.0,
    boot_id: str = "b",
    engines: tuple[w.EngineStatus, ...] = (),
    **inventory,
) -> w.Hello:
    inv = {"hostname": node_id, "os": "linux", "arch": "x86_64", "python": "3.11", "cpu_model": "c", "cpu_cores": 2}
    inv.update(inventory)
    return w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node_id,
        agent_version="test",
        boot_id=boot_id,
        started_at=started_at,
        inventory=w.Inventory(**inv),
        engines=engines,
    )


@attrs.frozen(kw_only=True)
class Local:
    """An in-process control plane's configuration and CA, and how agents join it."""

    state: Path
    ca: CA
    port: int  # the agent port's number, fixed so a restarted control plane is found again
    config: ServerConfig

    def agent(self, root: Path, node_id: str, *, source_address: str = "") -> AgentConfig:
        """A node with its own certificate, dialling this control plane."""
        node_dir = root / node_id
        issue_to_dir(self.ca, node_id, node_paths(node_dir).dir, validity_days=3)
        return AgentConfig(
            server=f"wss://127.0.0.1:{self.port}",
            node_id=node_id,
            state_dir=str(node_dir),
            source_address=source_address,
        )


def local(tmp_path: Path, monkeypatch, models: tuple[Model, ...]) -> Local:
    """State, CA and config for a control plane run in the test's own process, whose agents run
    real sim engines as `python -m llmgw` (given this process's sys.path: a PEX under Pants)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    state = tmp_path / "cp"
    ca = make_state(state)
    port = free_port()
    config = ServerConfig(
        server=ServerSection(
            state_dir=str(state), agent_listen=f"127.0.0.1:{port}", http_listen="127.0.0.1:0", heartbeat_interval_s=0.2
        ),
        engines=OFFLINE_ENGINES,
        models=models,
    )
    return Local(state=state, ca=ca, port=port, config=config)


async def serve_plane(
    state: Path,
    nursery: trio.Nursery,
    *,
    engines: EnginesSection = OFFLINE_ENGINES,
    release: ReleaseSection | None = None,
    heartbeat_interval_s: float = ServerSection().heartbeat_interval_s,
    store: StoreSection | None = None,
):
    """A control plane on `state` (made with `make_state`) serving in `nursery`, both listeners on
    loopback ports of the system's choosing; the plane and its bound addresses. `store`: server.toml's
    `[store]` (default: the state directory's SQLite file)."""
    from llmgw.server.app import ControlPlane  # here: most users of this module need no control plane

    server = ServerSection(
        state_dir=str(state),
        agent_listen="127.0.0.1:0",
        http_listen="127.0.0.1:0",
        heartbeat_interval_s=heartbeat_interval_s,
    )
    config = ServerConfig(
        server=server, engines=engines, release=release or ReleaseSection(), store=store or StoreSection()
    )
    plane = ControlPlane.open(config, state)
    return plane, await nursery.start(plane.serve)


def join(plane, node_id: str = "a", *, engines: tuple[w.EngineStatus, ...], **inventory) -> int:
    """Node `node_id` joins an in-process control plane as its agent's hello would make it (with
    `inventory`'s fields), heartbeats once: the link's id."""
    now = trio.current_time()
    conn = plane.registry.connect(
        hello(node_id, engines=engines, **inventory), address="127.0.0.1", cert_serial=1, cert_not_after=2e9, now=now
    )
    plane.registry.heartbeat(node_id, conn, now)
    return conn


async def one_node_plane(tmp_path: Path, models: Sequence[Model], *, engines: tuple[w.EngineStatus, ...], **inventory):
    """A control plane in the test's process (not serving) with `models`, node "a" joined with
    `engines` and `inventory`, and its replicas placed: the unit tests of placement, scaling and
    rollouts start here. Reporting replicas is the test's (`plane.registry.replicas_changed`)."""
    from llmgw.server.app import ControlPlane  # the server's code, for the tests that want one

    state = tmp_path / "cp"
    make_state(state)
    config = ServerConfig(engines=OFFLINE_ENGINES, server=ServerSection(state_dir=str(state)), models=tuple(models))
    plane = ControlPlane.open(config, state)
    await plane.store.saw_node("a", "127.0.0.1")
    join(plane, engines=engines, **inventory)
    plane.replicas.reconcile(trio.current_time())
    return plane
