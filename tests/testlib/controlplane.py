"""Building blocks of control-plane tests: a state directory with its CA, server certificate
and admin credential; a hello as an agent would send it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llmgw import paths, pki
from llmgw.wire import agent_link as w


def make_state(state: Path, *, sans: Sequence[str] = ("127.0.0.1",), days: int = 3) -> pki.CA:
    """What `llmgw ca init` leaves in a control plane's state directory; returns the CA."""
    pki.init_ca(state, validity_days=days)
    ca = pki.load_ca(state)
    ca.issue_server_cert(state, list(sans), validity_days=days)
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
