"""What the admin API and the cluster page show of each node, engine, replica and model: pure
functions of the registry, the placements and the catalog; `now` is the trio clock's, given by
the caller. The role that serves them, reading what it shows at each call, is
`llmgw.server.state.clusterviews.ClusterViews`; the gateway's rotation is made in
`llmgw.server.state.rotation`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import trio

from llmgw.config import EnginesSection, Model
from llmgw.engines import cpubackend, vulkandevices
from llmgw.engines.wants import gpu_verdicts
from llmgw.fabrics import FabricMap, fabric_map
from llmgw.server.state.drains import DrainProgress
from llmgw.server.state.placements import Stored
from llmgw.server.state.registry import JOINED, Node, NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.server.state.versions import SHOWN
from llmgw.wire import agent_link as w

VIEW_BATCH = 200  # node views made between yields to the loop (`Views.node_page`)


def cluster_fabrics(registry: NodeRegistry) -> FabricMap:
    """The cluster's fabrics as placement sees them: by name and identity, with notes."""
    return fabric_map({n.node_id: n.inventory.fabrics for n in registry.nodes.values() if n.inventory})


def node_views(
    registry: NodeRegistry, drains: Mapping[str, DrainProgress], now: float, engines: EnginesSection | None = None
) -> list[dict[str, Any]]:
    return [listed_view(n, registry, drains, now, engines) for _, n in sorted(registry.nodes.items())]


def listed_view(
    node: Node, registry: NodeRegistry, drains: Mapping[str, DrainProgress], now: float, engines: EnginesSection | None
) -> dict[str, Any]:
    """A node as the admin API lists it: its view and its drain, if one is under way."""
    view = node_view(node, registry.liveness(node, now), now, engines)
    drain = drains.get(node.node_id)
    view["drain"] = drain.view() if drain else None
    return view


def _eligibility(inv: w.Inventory | None, engines: EnginesSection | None) -> list[dict[str, Any]]:
    """The control plane's verdicts for the GPU engines server.toml asks for (what decided whether
    the node was asked to install them); without the config, what the agent judged itself."""
    if inv is None:
        return []
    verdicts = gpu_verdicts(engines, inv) if engines is not None else inv.engine_eligibility
    return [{"engine": e.engine, "status": e.status, "reason": e.reason} for e in verdicts]


def engine_view(e: w.EngineStatus, inv: w.Inventory | None = None) -> dict[str, Any]:
    """An engine as the node reports it; `state` is "ok", "failed", "unavailable" or "installing"
    (with phase and percent). llama.cpp's `cpu_backend` is the one it loads on the node, and
    `cpu_note` what that costs there and the fix ("" when it is a good one)."""
    state = e.state or (w.ENGINE_OK if e.ok else w.ENGINE_FAILED)  # an agent older than `state`
    note = (
        cpubackend.note(e.cpu_backend, arch=inv.arch, cpu_model=inv.cpu_model, cpu_flags=inv.cpu_flags)
        if inv is not None and e.cpu_backend
        else ""
    )
    return {
        "name": e.name,
        "version": e.version,
        "ok": e.ok,
        "detail": e.detail,
        "state": state,
        "phase": e.phase if state == w.ENGINE_INSTALLING else "",
        "percent": e.percent if state == w.ENGINE_INSTALLING else None,
        "cpu_backend": e.cpu_backend,
        "cpu_note": note,
    }


def speed_view(x: w.BackendSpeed) -> dict[str, Any]:
    """One engine backend's measured speed (agent.bench): tokens a second of the prompt and of
    generation, `state` ok, measuring, waiting or failed (`detail`: why), the engine version and
    device measured, when (unix time; 0: never) and the `llmgw ctl nodes bench` request it answers."""
    return {
        "engine": x.engine,
        "backend": x.backend,
        "state": x.state,
        "prompt_tps": x.prompt_tps,
        "gen_tps": x.gen_tps,
        "version": x.version,
        "device": x.device,
        "measured_at": x.measured_at,
        "detail": x.detail,
        "request": x.request,
    }


def vulkan_view(d: w.VulkanDevice) -> dict[str, Any]:
    """One Vulkan device (agent.discovery.vulkan): `software` ones are never GPUs; `vram_bytes` is the
    largest device-local heap (0: unknown); `text` is how ctl and the page show it."""
    return {
        "index": d.index,
        "name": d.name,
        "type": d.type,
        "vendor_id": d.vendor_id,
        "driver_name": d.driver_name,
        "driver_info": d.driver_info,
        "api_version": d.api_version,
        "software": d.software,
        "vram_bytes": vulkandevices.vram_bytes(d),
        "text": vulkandevices.describe(d),
    }


def node_view(node: Node, state: str, now: float, engines: EnginesSection | None = None) -> dict[str, Any]:
    s = node.link
    inv = node.inventory
    hello = s.hello if s else None
    return {
        "id": node.node_id,
        "state": state,
        "cordoned": node.cordoned,
        "draining": node.draining,
        "connected": bool(s and s.connected),
        "address": node.address,
        "agent_version": hello.agent_version if hello else None,
        "agent_started_at": hello.started_at if hello else None,
        "last_heartbeat_age_s": round(now - s.last_heartbeat_at, 3) if s and s.last_heartbeat_at is not None else None,
        "cpu": {"model": inv.cpu_model, "cores": inv.cpu_cores, "flags": list(inv.cpu_flags)} if inv else None,
        "arch": inv.arch if inv else None,
        "memory_total_bytes": inv.memory_total_bytes if inv else None,
        "gpus": [{"index": g.index, "name": g.name, "memory_total_mib": g.memory_total_mib} for g in inv.gpus]
        if inv
        else [],
        "gpu_status": inv.gpu_status if inv else None,
        "gpu_detail": inv.gpu_detail if inv else "",
        "vulkan": [vulkan_view(d) for d in inv.vulkan] if inv else [],
        "vulkan_status": inv.vulkan_status if inv else None,
        "vulkan_detail": inv.vulkan_detail if inv else "",
        "eligibility": _eligibility(inv, engines),
        "fabric_problems": list(inv.fabric_problems) if inv else [],
        "disk_free_bytes": inv.disk_free_bytes if inv else None,
        "weights": weights_view(node.weights),
        "fabrics": [{"name": f.name, "identity": f.identity, "adapters": list(f.adapters)} for f in inv.fabrics]
        if inv
        else [],
        "engines": [engine_view(e, inv) for e in node.engines],
        "speeds": [speed_view(x) for x in node.speeds],
        # false: the nodes measure llama.cpp's speed only when `llmgw ctl nodes bench` asks.
        "measure_speed": getattr(engines.llamacpp, "measure_speed", True) if engines is not None else True,
        "replicas": [{"replica": r.replica_id, "rank": r.node_rank, "state": r.state} for r in node.replicas],
        "cert_serial": f"{s.cert_serial:x}" if s else None,
        "cert_not_after": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.cert_not_after)) if s else None,
        "cert_expires_in_days": round((s.cert_not_after - time.time()) / 86400, 1) if s else None,
    }


def weights_view(held: w.WeightsHeld) -> dict[str, Any]:
    """What a node's weights cache holds: whole files, downloads under way, bytes, its limit, and
    the port it serves them to the other nodes on (0: none)."""
    return {
        "files": sum(1 for f in held.files if f.complete),
        "downloading": sum(1 for f in held.files if not f.complete),
        "bytes": held.cache_bytes,
        "limit_bytes": held.limit_bytes,
        "free_bytes": held.free_bytes,
        "port": held.port,
    }


def replica_views(registry: NodeRegistry, replicas: Replicas) -> list[dict[str, Any]]:
    """Each placed replica with what its members report, then what could not be placed."""
    reported = {(s.replica_id, node.node_id): s for node in registry.nodes.values() for s in node.replicas}
    out = [
        replica_view(rid, stored, [reported.get((rid, n)) for n in stored.placement.nodes])
        for rid, stored in sorted(replicas.placed.items())
    ]
    return out + pending_views(replicas)


async def replica_views_sliced(registry: NodeRegistry, replicas: Replicas) -> list[dict[str, Any]]:
    """`replica_views`, made VIEW_BATCH at a time with the loop free between (ten thousand
    replicas are tens of milliseconds of views)."""
    reported = {(s.replica_id, node.node_id): s for node in registry.nodes.values() for s in node.replicas}
    placed = sorted(replicas.placed.items())
    out: list[dict[str, Any]] = []
    for start in range(0, len(placed), VIEW_BATCH):
        if start:
            await trio.lowlevel.checkpoint()
        out += (
            replica_view(rid, stored, [reported.get((rid, n)) for n in stored.placement.nodes])
            for rid, stored in placed[start : start + VIEW_BATCH]
        )
    return out + pending_views(replicas)


def replica_view(rid: str, stored: Stored, members: Sequence[w.ReplicaStatus | None]) -> dict[str, Any]:
    """A placed replica with what each member (in rank order; None: nothing reported) says."""
    p = stored.placement
    states = [m.state if m else "assigned" for m in members]
    rank0 = members[0]
    return {
        "replica": rid,
        "model": p.model,
        "engine": p.engine,
        "nodes": list(p.nodes),
        "state": states[0] if len(set(states)) == 1 else ",".join(states),
        "member_states": states,
        "port": rank0.port if rank0 else 0,
        "pids": [m.pid if m else 0 for m in members],  # per member, on its node; 0 while none runs
        "restarts": sum(m.restarts for m in members if m),
        "detail": "; ".join(m.detail for m in members if m and m.detail),
        "fabric": p.fabric,
        "version": stored.version[:SHOWN],  # of its model (`llmgw.server.state.versions`)
    }


def pending_views(replicas: Replicas) -> list[dict[str, Any]]:
    """A row per replica the scheduler holds back, as ctl counts them."""
    out = []
    for pend in replicas.pending:
        row = {"replica": None, "model": pend.model, "state": "pending", "detail": pend.reason, "nodes": []}
        out.extend(dict(row) for _ in range(pend.replicas))
    return out


PROGRESS_SHOWN = 20  # replicas on their way shown per model; `llmgw ctl replicas` lists every one


def model_views(
    models: Sequence[Model],
    replica_views: Iterable[Mapping[str, Any]],
    scale_of: Callable[[Model], dict[str, Any] | None] = lambda model: None,
    rollouts: Mapping[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Each catalog model with its ready replicas and why any is pending; one pass over the
    replicas (there may be ten thousand), not one per model. `scale_of(model)`: a scaled model's
    bounds, wanted count and last decision (`ScalePolicy.view`), its `replicas` then the count
    it wants now; `rollouts`: by model, its rollout under way or stopped (`Rollouts.views`)."""
    ready: dict[str, int] = {}
    pending: dict[str, list[str]] = {}
    coming: dict[str, list[str]] = {}  # replicas on their way: downloading, starting
    for v in replica_views:
        if v["state"] == w.READY:
            ready[v["model"]] = ready.get(v["model"], 0) + 1
        elif v["state"] == "pending":
            pending.setdefault(v["model"], []).append(v["detail"])
        elif v["state"] in (w.FETCHING, w.STARTING) and len(coming.get(v["model"], ())) < PROGRESS_SHOWN:
            what = v["detail"] or v["state"]
            coming.setdefault(v["model"], []).append(f"{v['replica']} on {','.join(v['nodes'])}: {what}")
    scales = {m.name: scale_of(m) for m in models if m.scaled}
    return [
        {
            "model": m.name,
            "engine": m.engine,
            "replicas": m.replicas if (scale := scales.get(m.name)) is None else scale["wanted"],
            "scale": scale,
            "ready": ready.get(m.name, 0),
            "pending": pending.get(m.name, []),
            "progress": coming.get(m.name, []),
            "gpus_per_replica": m.gpus_per_replica,
            "nodes_per_replica": m.nodes_per_replica,
            "rollout": (rollouts or {}).get(m.name),
        }
        for m in models
    ]


def cpu_warning(cpu: Mapping[str, Any] | None) -> str:
    """What `llmgw doctor` says of a generic virtual CPU (its rules, llmgw.engines.cpubackend), from
    what the node reported: its model name, or x86 flags without AVX2/FMA."""
    if not cpu:
        return ""
    model, flags = cpu.get("model") or "", set(cpu.get("flags") or ())
    generic = bool(cpubackend.virtual_model(model))
    x86 = bool(flags & {"sse2", "lm", "fpu"})
    lacking = cpubackend.missing_x86(flags)
    if generic or (x86 and lacking):
        missing = f" (no {', '.join(lacking)})" if x86 and lacking else ""
        return (
            f"generic virtual CPU {model!r}{missing}: llama.cpp runs its slow scalar code; give the VM the host's "
            "CPU model (Proxmox: `qm set VMID --cpu host`), see `llmgw doctor`"
        )
    return ""


def page_node_view(
    node: Node, state: str, now: float, engines: EnginesSection | None, drain: DrainProgress | None
) -> dict[str, Any]:
    """A node as the cluster page shows it: its admin view (`node_view`) and its drain, but
    instead of the heartbeat's age, which changes at every heartbeat, `heard_at`: when the last
    one came (liveness time, the clock of the frame's `now`) for a node that is not joined, None
    for a joined one (its heartbeats are on time); and instead of the CPU's flags, which only
    `llmgw doctor`'s rule reads, its `cpu_warning`."""
    view = node_view(node, state, now, engines)
    s = node.link
    del view["last_heartbeat_age_s"]
    view["heard_at"] = s.last_heartbeat_at if s and state != JOINED else None
    if view["cpu"] is not None:
        view["cpu_warning"] = cpu_warning(view["cpu"])
        del view["cpu"]["flags"]
    else:
        view["cpu_warning"] = ""
    view["drain"] = drain.view() if drain else None
    return view
