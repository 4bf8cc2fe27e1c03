"""Messages of the agent link (agent <-> control plane), one JSON text frame each.

Plain frozen, keyword-only attrs classes; `llmgw.wire.convert` is the only code that turns
them into JSON and back. The first frame from the agent is `Hello`; the control plane answers
`Welcome` then `DesiredState`, and later a new `DesiredState` whenever what it wants changes.
Both sides are level-triggered: every connection resends everything, so either side can
restart without losing the other's work. `LinkError` is sent just before the sender closes.

PROTOCOL_VERSION changes whenever a message changes incompatibly; a peer speaking another
version gets a `LinkError(code="protocol_version")` and the link is closed.
"""

from __future__ import annotations

import attrs

PROTOCOL_VERSION = 1


# -- what a node has (filled by discovery) -------------------------------------------------


@attrs.frozen(kw_only=True)
class Gpu:
    index: int
    name: str
    uuid: str
    memory_total_mib: int
    memory_free_mib: int
    driver_version: str
    compute_capability: str
    pci_bus_id: str


@attrs.frozen(kw_only=True)
class Fabric:
    """A fabric this node is on: the operator's name and the identity the adapters report."""

    name: str
    identity: str
    adapters: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Inventory:
    hostname: str
    os: str
    arch: str
    python: str
    cpu_model: str
    cpu_cores: int
    cpu_flags: tuple[str, ...] = ()
    memory_total_bytes: int = 0
    gpus: tuple[Gpu, ...] = ()
    fabrics: tuple[Fabric, ...] = ()


@attrs.frozen(kw_only=True)
class EngineStatus:
    """An engine the agent has installed and checked (ok) or failed to (detail says why)."""

    name: str
    version: str
    ok: bool
    detail: str = ""


@attrs.frozen(kw_only=True)
class ReplicaStatus:
    replica_id: str
    model: str
    state: str


# -- agent -> control plane ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Hello:
    protocol_version: int
    node_id: str
    agent_version: str
    boot_id: str
    started_at: float  # unix time the agent process started: "joined" means a heartbeat since then
    inventory: Inventory
    engines: tuple[EngineStatus, ...] = ()
    replicas: tuple[ReplicaStatus, ...] = ()


@attrs.frozen(kw_only=True)
class Heartbeat:
    seq: int


@attrs.frozen(kw_only=True)
class InventoryChanged:
    inventory: Inventory


# -- control plane -> agent ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Welcome:
    node_id: str
    server_version: str
    heartbeat_interval_s: float


@attrs.frozen(kw_only=True)
class DesiredState:
    generation: int
    cordoned: bool = False
    engines: tuple[str, ...] = ()


# -- either way ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class LinkError:
    """Sent before closing: `code` is for programs, `message` for the operator (with the fix)."""

    code: str
    message: str


AgentMessage = Hello | Heartbeat | InventoryChanged | LinkError
ServerMessage = Welcome | DesiredState | LinkError

# Error codes of LinkError.
BAD_MESSAGE = "bad_message"
UNKNOWN_TYPE = "unknown_type"
PROTOCOL = "protocol_version"
NODE_ID_MISMATCH = "node_id_mismatch"
REVOKED = "revoked"
UNEXPECTED = "unexpected_message"
