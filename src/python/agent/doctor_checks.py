"""The checks of `llmgw doctor`: each decides one thing about whether this node can do its job.

Each check is a pure function of a discovery `Snapshot` (plus the declared fabrics and, for
the control plane, one connection attempt's `Reach`) returning a `Check`: ok, warn, fail or
unknown, a detail, and for anything but ok the fix. Where a check needs a tool or a file that is
not there, it is "unknown" and says "could not check", never ok. A check that does not apply to
this node (GPUDirect RDMA on a CPU node) is ok and says "not applicable" and why. `CHECKS` is
their order, `NAMES` every name `--ignore` takes; `agent.doctor` runs them.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable, Sequence

import attrs

from agent.discovery import cpu as cpumod
from agent.discovery import fabrics, gpus, infiniband
from agent.discovery.snapshot import DEFAULT_SYSTEMD_DIR, Snapshot
from agent.install import toolchain
from llmgw.config import FabricDecl
from llmgw.wire import agent_link as w

OK = "ok"
WARN = "warn"
FAIL = "fail"
UNKNOWN = "unknown"

GIB = 1 << 30
DISK_FAIL_BELOW = 2 * GIB
DISK_WARN_BELOW = 20 * GIB
# A clock before this is wrong whatever else is true: this code did not exist yet.
CLOCK_FLOOR = calendar.timegm((2025, 1, 1, 0, 0, 0))
PYTHON_SUPPORTED = ((3, 10), (3, 13))

NOT_APPLICABLE = "not applicable"
COULD_NOT = "could not check"


@attrs.frozen(kw_only=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""
    ignored: bool = False


@attrs.frozen(kw_only=True)
class Reach:
    """One attempt to open a TCP connection to the control plane's agent port."""

    target: str
    ok: bool
    detail: str
    fix: str = ""


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _install(snap: Snapshot, package: str) -> str:
    if snap.os_family == "debian":
        return f"`sudo apt-get install {package}`"
    if snap.os_family == "rhel":
        return f"`sudo dnf install {package}`"
    return f"`sudo apt-get install {package}` or `sudo dnf install {package}`"


def check_cpu(snap: Snapshot) -> Check:
    name = "cpu-features"
    cpu = snap.cpu
    if cpu is None:
        return Check(name=name, status=UNKNOWN, detail=f"{COULD_NOT}: /proc/cpuinfo cannot be read")
    head = f"{cpu.model}, {cpu.cores} logical cores"
    if cpu.isa != cpumod.X86:
        return Check(name=name, status=OK, detail=f"{head}: not x86, so SSE4.2/AVX/AVX2/FMA do not apply")
    have = cpumod.features(cpu)
    missing = cpumod.missing_required(cpu)
    virtual = cpumod.virtual_model(cpu)
    if virtual or missing:
        why = [f"the generic virtual CPU model {virtual}" if virtual else ""]
        why.append(f"no {', '.join(missing).upper()}" if missing else "")
        text = "; ".join(x for x in why if x)
        return Check(
            name=name,
            status=WARN,
            detail=f"{head}: {text}; llama.cpp falls back to slower code and nothing looks broken "
            f"({cpumod.MEASURED})",
            fix=cpumod.FIX_PROXMOX,
        )
    listed = " ".join(n for n, present in have.items() if present)
    note = "" if have.get("avx512") else " (no avx512; not needed)"
    return Check(name=name, status=OK, detail=f"{head}: {listed}{note}")


def check_llamacpp_build(snap: Snapshot) -> Check:
    """Can this node build llama.cpp where it would have to? The release's llama.cpp runs on x86_64
    and aarch64 with no compiler; a build is needed for a CUDA build (an NVIDIA GPU and nvcc) and
    on other architectures (and where server.toml asks for one: the agent says so then)."""
    name = "llamacpp-build"
    if not snap.build_missing:
        return Check(
            name=name,
            status=OK,
            detail="a C and C++ compiler, cmake and make or ninja are here: this node can build llama.cpp from "
            "source where it needs to (a CUDA build, an architecture the release does not cover)",
        )
    missing = ", ".join(snap.build_missing)
    fix = f"`sudo {toolchain.install_hint_for(snap.os_family)}`" if snap.os_family else toolchain.install_hint_for("")
    if snap.arch not in ("x86_64", "aarch64"):
        return Check(
            name=name,
            status=WARN,
            detail=f"the release's llama.cpp is built for x86_64 and aarch64, not {snap.arch}: this node builds it from "
            f"source and lacks {missing}; until then llama.cpp is unavailable here (the node joins without it)",
            fix=f"install them: {fix}",
        )
    if snap.gpus.gpus and snap.nvcc:
        return Check(
            name=name,
            status=WARN,
            detail=f"nvcc ({snap.nvcc}) is here for a CUDA build of llama.cpp, but not {missing}: the node runs the "
            "release's CPU build instead, without GPU offload",
            fix=f"install them for a CUDA build: {fix}",
        )
    return Check(
        name=name,
        status=OK,
        detail=f"{NOT_APPLICABLE}: llama.cpp comes prebuilt from the release for {snap.arch}; a build from source "
        f"(server.toml's [engines.llamacpp] release = false, or a version the release does not carry) would need "
        f"{missing}: {fix}",
    )


def check_memory(snap: Snapshot) -> Check:
    if snap.memory is None:
        return Check(name="memory", status=UNKNOWN, detail=f"{COULD_NOT}: /proc/meminfo cannot be read")
    m = snap.memory
    limited = f" (the memory limit of cgroup {m.cgroup}, below the machine's)" if m.cgroup else ""
    return Check(
        name="memory", status=OK, detail=f"{_gib(m.total_bytes)}{limited}, {_gib(m.available_bytes)} available"
    )


def check_python(snap: Snapshot) -> Check:
    version = ".".join(map(str, snap.python))
    low, high = PYTHON_SUPPORTED
    span = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    if snap.python[:2] < low:
        return Check(
            name="python",
            status=FAIL,
            detail=f"CPython {version}; llmgw needs {span}",
            fix="install Python 3.10 or newer (Ubuntu 22.04, Debian 12 and RHEL 9 ship one)",
        )
    if snap.python[:2] > high:
        return Check(
            name="python",
            status=WARN,
            detail=f"CPython {version} is newer than llmgw is tested on ({span})",
            fix=f"if anything misbehaves, run llmgw with a Python from {span}",
        )
    return Check(name="python", status=OK, detail=f"CPython {version}")


def check_disk(snap: Snapshot) -> Check:
    d = snap.disk
    if d is None:
        return Check(name="disk", status=UNKNOWN, detail=f"{COULD_NOT}: free space where weights go cannot be read")
    where = d.path if d.measured_at == d.path else f"{d.path} (not created yet; measured at {d.measured_at})"
    detail = f"{_gib(d.free_bytes)} free of {_gib(d.total_bytes)} at {where}"
    fix = (
        "free space there, or put weights elsewhere with weights_dir in agent.toml (doctor: --weights-dir); "
        "a 7B model at q4_K_M takes about 5 GB, a 70B one at 16 bits about 140 GB"
    )
    if d.free_bytes < DISK_FAIL_BELOW:
        return Check(name="disk", status=FAIL, detail=detail, fix=fix)
    if d.free_bytes < DISK_WARN_BELOW:
        return Check(name="disk", status=WARN, detail=detail, fix=fix)
    return Check(name="disk", status=OK, detail=detail)


def check_clock(snap: Snapshot) -> Check:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(snap.clock.now))
    fix = "turn on time synchronisation: `sudo timedatectl set-ntp true` (or run chronyd)"
    if snap.clock.now < CLOCK_FLOOR:
        return Check(
            name="clock",
            status=FAIL,
            detail=f"the system time is {now}, before this llmgw was written: certificates will be refused",
            fix=fix,
        )
    if snap.clock.synchronized is None:
        return Check(
            name="clock",
            status=UNKNOWN,
            detail=f"{COULD_NOT} whether the clock is synchronised (no adjtimex here); it says {now}",
            fix=fix,
        )
    if not snap.clock.synchronized:
        return Check(
            name="clock",
            status=WARN,
            detail=f"the kernel says the clock is not synchronised (it says {now}); certificates and heartbeats "
            "are judged by it",
            fix=fix,
        )
    return Check(name="clock", status=OK, detail=f"synchronised ({now})")


SERVICE_MANAGER_FIX = (
    "run the node with systemd as its init, or start the agent at boot yourself: llmgw agent supervise --daemon "
    "--config /etc/llmgw/agent.toml --pid-file /run/llmgw-agent.pid --log /var/log/llmgw-agent.log"
)


def check_service_manager(snap: Snapshot) -> Check:
    name = "service-manager"
    if snap.systemd:
        return Check(name=name, status=OK, detail="systemd")
    return Check(
        name=name,
        status=WARN,
        detail=f"no systemd here (no {DEFAULT_SYSTEMD_DIR}): `llmgw node add` runs the agent under llmgw's own "
        "supervisor (`llmgw agent supervise`), which does not start it again after a reboot",
        fix=SERVICE_MANAGER_FIX,
    )


def check_nvidia(snap: Snapshot) -> Check:
    g = snap.gpus
    if g.status == w.GPUS_PRESENT:
        return Check(name="nvidia-smi", status=OK, detail=g.detail)
    if g.status == w.GPUS_NONE:
        return Check(name="nvidia-smi", status=OK, detail=f"{g.detail}: a CPU node, which is not an error")
    return Check(name="nvidia-smi", status=FAIL, detail=g.detail, fix=g.fix)


def check_vllm(snap: Snapshot) -> Check:
    e = gpus.vllm_eligibility(snap.gpus)
    if e.status == w.ELIGIBLE:
        return Check(name="vllm", status=OK, detail=f"eligible: {e.reason}")
    if e.status == w.NOT_APPLICABLE:
        return Check(name="vllm", status=OK, detail=f"{NOT_APPLICABLE}: {e.reason}")
    if e.status == w.INELIGIBLE:
        fix = (
            "upgrade the NVIDIA driver"
            if gpus.driver_too_old(snap.gpus)
            else "nothing to fix for llama.cpp, which this node still serves; vLLM needs a Turing (T4, RTX 20xx) or newer GPU"
        )
        return Check(name="vllm", status=WARN, detail=f"not eligible: {e.reason}", fix=fix)
    return Check(
        name="vllm",
        status=UNKNOWN,
        detail=f"{COULD_NOT}: the GPUs cannot be read (see nvidia-smi above)",
        fix="fix nvidia-smi first",
    )


def check_vulkan(snap: Snapshot) -> Check:
    """llama.cpp's Vulkan build wants a Vulkan GPU. Only a node with a GPU (a render node in
    /dev/dri) and no usable Vulkan device has something to fix; NVIDIA GPUs serve through CUDA."""
    name = "vulkan"
    v = snap.vulkan
    if v.gpus:
        return Check(name=name, status=OK, detail=v.detail)
    if snap.gpus.status == w.GPUS_PRESENT:
        return Check(name=name, status=OK, detail=f"{v.detail}; not needed: the NVIDIA GPUs serve through CUDA")
    if not v.render_nodes:
        return Check(
            name=name,
            status=OK,
            detail=f"{v.detail}; no GPU here (no render node in {v.dri_dir}), so nothing to fix",
        )
    here = ", ".join(v.render_nodes)
    if v.status == w.VULKAN_PRESENT:  # a software device alone
        return Check(
            name=name,
            status=WARN,
            detail=f"a GPU is here ({here}) but Vulkan sees only {v.detail}",
            fix=f"install the GPU's Vulkan driver ({_install(snap, 'mesa-vulkan-drivers')} for AMD and Intel; "
            "NVIDIA's comes with its driver), and let the agent's user open the render node (the `render` group)",
        )
    fix = _install(snap, "vulkan-tools mesa-vulkan-drivers") if v.status == w.VULKAN_MISSING else v.fix
    return Check(name=name, status=WARN, detail=f"{v.detail}: llama.cpp's Vulkan build cannot use it", fix=fix)


def _running(snap: Snapshot, comm: str) -> bool | None:
    # /proc/PID/comm holds at most 15 characters: "nv-fabricmanager" appears as "nv-fabricmanage".
    if snap.commands is None:
        return None
    return any(c.startswith(comm[:15]) for c in snap.commands)


def check_fabric_manager(snap: Snapshot) -> Check:
    name = "fabric-manager"
    if snap.gpus.status != w.GPUS_PRESENT:
        return Check(name=name, status=OK, detail=f"{NOT_APPLICABLE}: no NVIDIA GPU")
    if snap.pci is None:
        return Check(
            name=name, status=UNKNOWN, detail=f"{COULD_NOT}: the PCI bus cannot be read to look for NVSwitches"
        )
    if not snap.pci.nvswitches:
        return Check(name=name, status=OK, detail=f"{NOT_APPLICABLE}: no NVSwitch on the PCI bus")
    running = _running(snap, "nv-fabricmanager")
    switches = f"{snap.pci.nvswitches} NVSwitches"
    if running is None:
        return Check(name=name, status=UNKNOWN, detail=f"{COULD_NOT} whether nv-fabricmanager runs: /proc unreadable")
    if running:
        return Check(name=name, status=OK, detail=f"{switches}; nv-fabricmanager is running")
    driver = snap.gpus.gpus[0].driver_version
    return Check(
        name=name,
        status=FAIL,
        detail=f"{switches} and nv-fabricmanager is not running: CUDA cannot use these GPUs until it has configured "
        "the switches",
        fix=f"install the fabric manager of the driver's exact version ({driver}), then "
        "`sudo systemctl enable --now nvidia-fabricmanager`",
    )


def check_imex(snap: Snapshot) -> Check:
    name = "imex"
    if snap.gpus.status != w.GPUS_PRESENT or not gpus.multi_node_nvlink(snap.gpus.gpus):
        return Check(name=name, status=OK, detail=f"{NOT_APPLICABLE}: not a multi-node NVLink system (GB200/GB300)")
    running = _running(snap, "nvidia-imex")
    if running is None:
        return Check(name=name, status=UNKNOWN, detail=f"{COULD_NOT} whether nvidia-imex runs: /proc unreadable")
    if running:
        return Check(name=name, status=OK, detail="multi-node NVLink system; nvidia-imex is running")
    return Check(
        name=name,
        status=FAIL,
        detail="multi-node NVLink system and nvidia-imex is not running: GPU memory cannot be shared across its nodes",
        fix="list the NVLink domain's node addresses in /etc/nvidia-imex/nodes_config.cfg, then "
        "`sudo systemctl enable --now nvidia-imex`",
    )


def _active_adapters(snap: Snapshot) -> list[str]:
    return [a.name for a in snap.ib.adapters if any(infiniband.is_active(p) for p in a.ports)]


def check_gpudirect(snap: Snapshot) -> Check:
    name = "gpudirect-rdma"
    active = _active_adapters(snap)
    if snap.gpus.status != w.GPUS_PRESENT or not active:
        return Check(
            name=name, status=OK, detail=f"{NOT_APPLICABLE}: needs NVIDIA GPUs and an active InfiniBand/RoCE adapter"
        )
    if snap.modules is None:
        return Check(name=name, status=UNKNOWN, detail=f"{COULD_NOT}: /proc/modules cannot be read")
    loaded = {"nvidia_peermem", "nv_peer_mem"} & snap.modules
    if loaded:
        return Check(name=name, status=OK, detail=f"{', '.join(sorted(loaded))} loaded ({', '.join(active)})")
    return Check(
        name=name,
        status=WARN,
        detail="nvidia_peermem is not loaded: the adapters cannot reach GPU memory directly, so multi-node traffic "
        "is copied through host memory",
        fix="`sudo modprobe nvidia_peermem` and `echo nvidia_peermem | sudo tee /etc/modules-load.d/nvidia-peermem.conf`",
    )


def check_subnet_manager(snap: Snapshot) -> Check:
    name = "subnet-manager"
    linked = [
        (a.name, p)
        for a in snap.ib.adapters
        for p in a.ports
        if p.link_layer == infiniband.INFINIBAND and (p.phys_state == infiniband.LINK_UP or infiniband.is_active(p))
    ]
    if not linked:
        return Check(name=name, status=OK, detail=f"{NOT_APPLICABLE}: no InfiniBand port has a link")
    bad = [(a, p) for a, p in linked if not (infiniband.is_active(p) and p.sm_lid)]
    if bad:
        text = "; ".join(f"{a} port {p.port}: link up, state {p.state}, SM LID {p.sm_lid}" for a, p in bad)
        return Check(
            name=name,
            status=FAIL,
            detail=f"no subnet manager: {text}; a port is unusable until a subnet manager configures it",
            fix="run a subnet manager on the fabric: the managed switch's, or opensm on one host "
            f"({_install(snap, 'opensm')}, then `sudo systemctl enable --now opensm`)",
        )
    seen = ", ".join(f"{a}/{p.port}: LID {p.sm_lid}" + (f" ({p.sm_guid})" if p.sm_guid else "") for a, p in linked)
    return Check(name=name, status=OK, detail=f"every linked InfiniBand port sees one: {seen}")


def check_ib_diags(snap: Snapshot, declared: Sequence[FabricDecl]) -> Check:
    name = "infiniband-diags"
    has_ib = any(p.link_layer == infiniband.INFINIBAND for a in snap.ib.adapters for p in a.ports)
    if snap.ib.sminfo_installed:
        return Check(name=name, status=OK, detail=f"sminfo at {snap.ib.sminfo}")
    if not has_ib:
        return Check(name=name, status=OK, detail=f"{NOT_APPLICABLE}: no InfiniBand adapter")
    fix = f"the agent installs infiniband-diags when it starts; to check now, {_install(snap, 'infiniband-diags')}"
    if not declared:
        return Check(
            name=name,
            status=OK,
            detail=f"sminfo not found at {snap.ib.sminfo}; needed only once a fabric is declared "
            "(the agent installs it)",
        )
    return Check(
        name=name,
        status=WARN,
        detail=f"sminfo (infiniband-diags) not found at {snap.ib.sminfo}: the subnet managers, and so the declared "
        "fabrics, cannot be identified",
        fix=f"{fix} (or pass --sminfo PATH)",
    )


def check_fabrics(snap: Snapshot, declared: Sequence[FabricDecl]) -> Check:
    name = "fabrics"
    groups = fabrics.group_adapters(snap.ib.adapters)
    if not declared:
        where = f"; adapter groups here: {fabrics.groups_text(groups)}" if groups else ""
        return Check(
            name=name,
            status=OK,
            detail=f"none declared: this node is its own island (single-node replicas only){where}",
        )
    result = fabrics.check_declarations(declared, snap.ib.adapters)
    if result.problems:
        status = FAIL if any(p.severity == fabrics.FAIL for p in result.problems) else UNKNOWN
        fixes = list(dict.fromkeys(p.fix for p in result.problems))
        return Check(
            name=name,
            status=status,
            detail="; ".join(p.message for p in result.problems),
            fix="; ".join(fixes),
        )
    held = "; ".join(f"{f.name} = {','.join(f.adapters)} on {f.identity}" for f in result.fabrics)
    return Check(name=name, status=OK, detail=held)


def check_control_plane(reach: Reach) -> Check:
    if reach.ok:
        return Check(name="control-plane", status=OK, detail=reach.detail)
    return Check(name="control-plane", status=FAIL, detail=reach.detail, fix=reach.fix)


CHECKS: tuple[tuple[str, Callable[..., Check]], ...] = (
    ("cpu-features", check_cpu),
    ("memory", check_memory),
    ("python", check_python),
    ("disk", check_disk),
    ("clock", check_clock),
    ("service-manager", check_service_manager),
    ("llamacpp-build", check_llamacpp_build),
    ("nvidia-smi", check_nvidia),
    ("vllm", check_vllm),
    ("vulkan", check_vulkan),
    ("fabric-manager", check_fabric_manager),
    ("imex", check_imex),
    ("gpudirect-rdma", check_gpudirect),
    ("subnet-manager", check_subnet_manager),
)
NAMES = (*(n for n, _ in CHECKS), "infiniband-diags", "fabrics", "control-plane")


def run_checks(
    snap: Snapshot,
    declared: Sequence[FabricDecl] = (),
    *,
    reach: Reach | None = None,
    ignore: frozenset[str] = frozenset(),
) -> tuple[Check, ...]:
    checks = [fn(snap) for _, fn in CHECKS]
    checks += [check_ib_diags(snap, declared), check_fabrics(snap, declared)]
    if reach is not None:
        checks.append(check_control_plane(reach))
    return tuple(attrs.evolve(c, ignored=c.name in ignore) for c in checks)
