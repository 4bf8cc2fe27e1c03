"""What this node is, as the agent reports it in `hello`: the wire `Inventory` of a snapshot.

`collect(config)` looks at the node (blocking: call it with `trio.to_thread.run_sync`) and
`inventory_of(snapshot, declared)` is the pure mapping, so the control plane sees exactly what
`llmgw doctor` saw: GPUs with nvidia-smi's status, vLLM's and SGLang's eligibility with their reasons, the
InfiniBand / RoCE adapters, the fabric groups they form, the Vulkan devices vulkaninfo lists (a
software one marked so), and the declared fabrics that hold
(those that do not are listed in `fabric_problems`, each with its fix, and are not sent as
fabrics, so the node is an island for them rather than a member of the wrong fabric).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.discovery import fabrics
from agent.discovery.gpus import eligibility
from agent.discovery.snapshot import Snapshot, Sources, discover, sources_from_config
from llmgw.config import AgentConfig, FabricDecl
from llmgw.engines.eligibility import RULES
from llmgw.wire.agent_link import Inventory


def inventory_of(snap: Snapshot, declared: Sequence[FabricDecl] = ()) -> Inventory:
    check = fabrics.check_declarations(declared, snap.ib.adapters)
    return Inventory(
        hostname=snap.hostname,
        os=snap.os,
        arch=snap.arch,
        python=".".join(map(str, snap.python)),
        cpu_model=snap.cpu.model if snap.cpu else "unknown",
        cpu_cores=snap.cpu.cores if snap.cpu else 0,
        cpu_flags=snap.cpu.flags if snap.cpu else (),
        memory_total_bytes=snap.memory.total_bytes if snap.memory else 0,
        memory_available_bytes=snap.memory.available_bytes if snap.memory else 0,
        gpus=snap.gpus.gpus,
        fabrics=check.fabrics,
        kernel=snap.kernel,
        weights_dir=snap.disk.path if snap.disk else "",
        disk_free_bytes=snap.disk.free_bytes if snap.disk else 0,
        gpu_status=snap.gpus.status,
        gpu_detail=snap.gpus.detail + (f"; fix: {snap.gpus.fix}" if snap.gpus.fix else ""),
        engine_eligibility=tuple(eligibility(snap.gpus, rule) for rule in RULES.values()),
        ib_adapters=snap.ib.adapters,
        fabric_groups=fabrics.group_adapters(snap.ib.adapters),
        fabric_problems=tuple(f"{p.message}; fix: {p.fix}" for p in check.problems),
        vulkan=snap.vulkan.devices,
        vulkan_status=snap.vulkan.status,
        vulkan_detail=snap.vulkan.detail + (f"; fix: {snap.vulkan.fix}" if snap.vulkan.fix else ""),
    )


def collect(config: AgentConfig | None = None, sources: Sources | None = None) -> Inventory:
    """Look at this node now. Blocking (tool runs are bounded by `Sources.tool_timeout_s`)."""
    if sources is None:
        sources = sources_from_config(config) if config else Sources()
    return inventory_of(discover(sources), config.fabrics if config else ())
