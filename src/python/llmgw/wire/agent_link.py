"""Messages of the agent link (agent <-> control plane), one JSON text frame each, and where
the link is found.

Plain frozen, keyword-only attrs classes; `llmgw.wire.convert` is the only code that turns
them into JSON and back. The first frame from the agent is `Hello`; the control plane answers
`Welcome` then `DesiredState`, and later a new `DesiredState` whenever what it wants changes. A
control plane that does not lead (a standby, when several share one store) answers the hello with
`Redirect` instead, naming the leader, and closes.
Both sides are level-triggered: every connection resends everything, so either side can
restart without losing the other's work. `LinkError` is sent just before the sender closes.

PROTOCOL_VERSION changes whenever a message changes incompatibly; a peer speaking another
version gets a `LinkError(code="protocol_version")` and the link is closed. The order of the
messages is `llmgw.wire.agent_session`'s.
"""

from __future__ import annotations

import attrs

from llmgw.config import DEFAULT_BUILD_TIMEOUT_S, DEFAULT_MAX_MEMBERS, DEFAULT_MAX_UNPACKED_BYTES

# 2: engine wants carry unpack caps and download sizes (EngineWant, EngineArchive), weights
# their download cap (WeightsSource) — fields an agent of version 1 would refuse.
# 3: llama.cpp's source to build (EngineWant.build), pip's indexes (EngineWant.index_url,
# extra_index_urls), an engine's install state and progress (EngineStatus.state, phase, percent).
# 4: the control plane's own release archives (EngineArchive.release), the CPU backend llama.cpp
# loaded (EngineStatus.cpu_backend), an engine this node lacks what it needs for (ENGINE_UNAVAILABLE).
# 5: a standby control plane answers a hello with where the leader is (`Redirect`); the control plane
# sends a heartbeat of its own (`ServerHeartbeat`), so that an agent notices one that stopped.
# 6: the control plane's heartbeat carries the heartbeat interval the agent is to keep from now on
# (`ServerHeartbeat.heartbeat_interval_s`: stretched as the cluster grows, llmgw.server.links.heartbeats).
# 7: an agent's heartbeat says when it was sent (`Heartbeat.sent_at`), for the control plane's
# figure of how long heartbeats take to count.
# 8: rank 0 publishes KV-cache events on a port of its own (ReplicaAssignment.cache_events, ReplicaStatus.events_port).
# 9: a model from the Hub, as files laid out like its repository (WeightsSource.files, repo, commit,
# directory), and the weights a node may delete (DesiredState.keep_files); what a node's weights
# cache holds (Hello.weights, WeightsChanged), models staged to it (DesiredState.stage).
# 10: the port a node serves its weights to the other nodes on (WeightsHeld.port; agent.peers).
# 11: a replica parked by its engine (vLLM's sleep mode): ReplicaAssignment.parkable, parked, and
# the member state PARKED.
# 12: each llama.cpp backend's measured speed on the node (BackendSpeed: Hello.speeds, SpeedsChanged),
# and the control plane's request to measure again (DesiredState.bench).
# 13: the node's Vulkan devices as its loader's vulkaninfo lists them (Inventory.vulkan, vulkan_status,
# vulkan_detail; VulkanDevice, VulkanHeap).
# 14: one llama.cpp model over several nodes through llama.cpp's RPC: every member's address
# (ReplicaAssignment.member_addrs), which rank 0 dials; whether a node measures llama.cpp's speed
# by itself (EngineWant.measure_speed; else only at DesiredState.bench).
PROTOCOL_VERSION = 14

# The agent port (server.toml's agent_listen: one TLS port) serves three things: the link, a
# WebSocket at AGENT_PATH whose upgrade request names the node in NODE_ID_HEADER, and the
# artifact mirror, `GET ARTIFACTS_PREFIX + SHA256`, both to node certificates only; and the
# release files, `GET RELEASE_PREFIX + NAME` (a release file or SHA256SUMS), to any peer, since a
# node fetches its release before it has a certificate (llmgw.server.nodes.releases).
AGENT_PATH = "/v1/agent"
NODE_ID_HEADER = "x-llmgw-node-id"
ARTIFACTS_PREFIX = "/v1/artifacts/"
RELEASE_PREFIX = "/v1/release/"
# The weights tracker (llmgw.server.links.tracker), on the agent port to node certificates:
# `GET PEERS_PREFIX + SHA256` says which nodes hold or fetch that file and whether the asker is
# the one to fetch it from its source. Each agent serves the files it holds to the other nodes on
# a port of its own (`WeightsHeld.port`): `GET WEIGHTS_PREFIX + SHA256` (a byte range) and
# `GET WEIGHTS_PREFIX + SHA256 + PIECES_SUFFIX` (which pieces it has, and their hashes).
PEERS_PREFIX = "/v1/weights/peers/"
# `GET MEMBERS_TARGET`: the cluster's nodes, whom a node serves weights to (`{"members": [...]}`);
# a node asks when one it does not know comes for pieces (it may have joined since).
MEMBERS_TARGET = PEERS_PREFIX + "members"
WEIGHTS_PREFIX = "/v1/weights/"
PIECES_SUFFIX = "/pieces"
# The tracker's name for the control plane as a peer, when it seeds a file itself ([downloads]
# weights_origin = "control_plane"): no node id starts with "@".
CONTROL_PLANE_PEER = "@control-plane"


# -- what a node has (filled by discovery) -------------------------------------------------
#
# Every field added after the first release has a default, so an older agent's hello still
# parses; a new field an older control plane does not know is refused by its converter, which
# is why PROTOCOL_VERSION moves when a released message changes.


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


# Values of Inventory.gpu_status.
GPUS_PRESENT = "present"  # nvidia-smi listed them
GPUS_NONE = "none"  # no nvidia-smi and no NVIDIA GPU on the PCI bus: a CPU node
GPUS_NOT_FOUND = "not_found"  # NVIDIA GPUs on the PCI bus but no nvidia-smi where configured
GPUS_FAILED = "failed"  # nvidia-smi is there and fails (driver not loaded, wrong version, ...)
GPUS_UNKNOWN = "unknown"  # the agent did not say


# Values of EngineEligibility.status. "not_applicable" is not "skipped": vLLM on a CPU node is
# not a thing that was left out, it is a thing that does not exist there.
ELIGIBLE = "eligible"
INELIGIBLE = "ineligible"
NOT_APPLICABLE = "not_applicable"
UNKNOWN = "unknown"


@attrs.frozen(kw_only=True)
class EngineEligibility:
    """Whether this node's hardware can run an engine at all, and why (before any install)."""

    engine: str
    status: str
    reason: str


@attrs.frozen(kw_only=True)
class IbPort:
    """One port of an InfiniBand / RoCE adapter, as sysfs (and sminfo, ip) report it."""

    port: int
    state: str  # the kernel's name: "ACTIVE", "DOWN", "INIT", "ARMED"
    phys_state: str  # "LinkUp", "Polling", "Disabled", ...
    link_layer: str  # "InfiniBand", or "Ethernet" for RoCE
    rate: str = ""  # "200 Gb/sec (4X HDR)"
    lid: int = 0
    sm_lid: int = 0  # 0: no subnet manager has configured this port
    gid_prefix: str = ""  # subnet prefix of GID 0: "fe80:0000:0000:0000" unless the SM sets one
    netdev: str = ""  # RoCE: the Ethernet interface
    network: str = ""  # RoCE: that interface's IP network, "192.168.50.0/24"
    sm_guid: str = ""  # InfiniBand: the master subnet manager's port GUID, as sminfo reports it
    identity: str = ""  # the fabric this port is on ("ib-sm:0x...", "roce:10.1.0.0/24"); "" if none
    identity_error: str = ""  # why an active port has no identity


@attrs.frozen(kw_only=True)
class IbAdapter:
    name: str  # "mlx5_0"
    node_guid: str = ""  # "0c42:a103:0012:3456"
    ports: tuple[IbPort, ...] = ()


@attrs.frozen(kw_only=True)
class FabricGroup:
    """Active adapters that report one fabric identity: what `node add` asks the operator to name."""

    identity: str
    kind: str  # "infiniband" or "roce"
    adapters: tuple[str, ...]
    detail: str = ""  # for people: "subnet manager 0x0002c90300a1b2c3 (LID 1)"


@attrs.frozen(kw_only=True)
class Fabric:
    """A fabric this node is on: the operator's name and the identity the adapters report.

    Only declarations that were checked against the adapters are sent: every adapter exists,
    is active and reports `identity`. The control plane places by (name, identity), so two
    fabrics given one name stay two, and a typo in a name cannot merge anything.
    """

    name: str
    identity: str
    adapters: tuple[str, ...] = ()
    kind: str = ""  # "infiniband" or "roce"


# Values of VulkanDevice.type: Vulkan's VkPhysicalDeviceType, named short.
VULKAN_DISCRETE = "discrete"
VULKAN_INTEGRATED = "integrated"
VULKAN_VIRTUAL = "virtual"  # a GPU passed through a hypervisor (virtio-gpu's Venus)
VULKAN_CPU = "cpu"  # a software rasterizer on the CPU (Mesa's lavapipe / llvmpipe)
VULKAN_OTHER = "other"


@attrs.frozen(kw_only=True)
class VulkanHeap:
    """One memory heap of a Vulkan device (VkMemoryHeap)."""

    size_bytes: int
    device_local: bool = False  # the device's own memory (VRAM on a discrete card)


@attrs.frozen(kw_only=True)
class VulkanDevice:
    """One Vulkan physical device, as `vulkaninfo --summary` lists it (its heaps from the full text)."""

    index: int  # vulkaninfo's GPU number: the order the loader enumerates devices in
    name: str  # "AMD Radeon RX 7900 XTX (RADV NAVI31)"
    type: str  # one of VULKAN_* above
    vendor_id: str  # PCI vendor id as vulkaninfo prints it: "0x1002"; Mesa's software devices "0x10005"
    device_id: str = ""
    driver_id: str = ""  # "DRIVER_ID_MESA_RADV"
    driver_name: str = ""  # "radv", "NVIDIA", "llvmpipe"
    driver_info: str = ""  # "Mesa 22.3.6", "535.183.01"
    driver_version: str = ""
    api_version: str = ""  # the Vulkan version the driver supports: "1.3.230"
    # Not a GPU: a software device (type cpu) is listed so the operator sees the loader works, and
    # placement never counts it as a GPU.
    software: bool = False
    heaps: tuple[VulkanHeap, ...] = ()  # (): vulkaninfo's full text could not be read


# Values of Inventory.vulkan_status.
VULKAN_PRESENT = "present"  # vulkaninfo lists at least one device (maybe only a software one)
VULKAN_NONE = "none"  # vulkaninfo runs but the loader finds no driver or no device
VULKAN_MISSING = "missing"  # no vulkaninfo (vulkan-tools not installed)
VULKAN_FAILED = "failed"  # vulkaninfo fails, hangs or prints what is not its summary
VULKAN_UNKNOWN = "unknown"  # the agent did not say (older than protocol 13)


@attrs.frozen(kw_only=True)
class Inventory:
    hostname: str
    os: str
    arch: str  # `uname -m`
    python: str
    cpu_model: str
    cpu_cores: int
    cpu_flags: tuple[str, ...] = ()
    memory_total_bytes: int = 0
    gpus: tuple[Gpu, ...] = ()
    fabrics: tuple[Fabric, ...] = ()
    kernel: str = ""
    memory_available_bytes: int = 0
    weights_dir: str = ""
    disk_free_bytes: int = 0  # free where weights go (or its nearest existing parent)
    gpu_status: str = GPUS_UNKNOWN
    gpu_detail: str = ""  # for people: what was found, or what is wrong and the fix
    engine_eligibility: tuple[EngineEligibility, ...] = ()
    ib_adapters: tuple[IbAdapter, ...] = ()
    fabric_groups: tuple[FabricGroup, ...] = ()
    fabric_problems: tuple[str, ...] = ()  # declared fabrics refused, each with its fix
    vulkan: tuple[VulkanDevice, ...] = ()
    vulkan_status: str = VULKAN_UNKNOWN
    vulkan_detail: str = ""  # for people: what was found, or what is wrong and the fix


# Values of EngineStatus.state. "" comes from an agent that predates it: read `ok`.
ENGINE_OK = "ok"
ENGINE_INSTALLING = "installing"
ENGINE_FAILED = "failed"  # an install or check went wrong (a bad archive, a binary that does not run)
# Nothing went wrong, but this node lacks what the engine's source needs here (a compiler for a
# build) or no source fits it: the node serves what else it has, and the agent tries again.
ENGINE_UNAVAILABLE = "unavailable"
# Values of EngineStatus.phase while installing, in the order an install goes through them.
INSTALL_PHASES = ("fetch", "unpack", "configure", "build", "install", "check")


@attrs.frozen(kw_only=True)
class EngineStatus:
    """An engine the agent has installed and checked (ok) or failed to (detail says why).

    While a version is being installed, `state` is "installing" with its `phase` and `percent`
    (None: the phase gives no measure). `ok` still says whether the engine can be used now: an
    upgrade keeps the old version in use (ok, `version` the old one) until the new one is checked."""

    name: str
    version: str
    ok: bool
    detail: str = ""
    state: str = ""  # ENGINE_OK, ENGINE_INSTALLING, ENGINE_FAILED, ENGINE_UNAVAILABLE
    phase: str = ""  # one of INSTALL_PHASES while installing
    percent: int | None = None  # 0..100 of the phase, while installing
    # llama.cpp: the CPU backend it loads on this node, as its library is named (`haswell` for
    # libggml-cpu-haswell.so, the baseline `x64`), CPU_BUILT_IN for a build that links its one
    # backend in, "" when not known (another engine, or not checked yet). llmgw.engines.cpubackend.
    cpu_backend: str = ""


@attrs.frozen(kw_only=True)
class ReplicaStatus:
    """What the agent observes of one replica member on this node."""

    replica_id: str
    model: str
    state: str  # one of REPLICA_STATES
    node_rank: int = 0
    port: int = 0  # where rank 0 serves the API on this node (0 until it listens)
    events_port: int = 0  # where rank 0's engine publishes KV-cache events (ReplicaAssignment.cache_events); 0: none
    restarts: int = 0  # engine process restarts since the agent started
    detail: str = ""  # why, for failed/restarting: with the engine's last log lines
    pid: int = 0


# A replica member's life on a node. `ready` = rank 0 answers its health check (workers: running);
# `parked`: its engine runs with the model put away (vLLM's sleep mode: ReplicaAssignment.parked),
# serving nothing until it is woken.
FETCHING, STARTING, READY, RESTARTING, FAILED, STOPPING, STOPPED, PARKED = (
    "fetching",
    "starting",
    "ready",
    "restarting",
    "failed",
    "stopping",
    "stopped",
    "parked",
)
REPLICA_STATES = (FETCHING, STARTING, READY, RESTARTING, FAILED, STOPPING, STOPPED, PARKED)
# What a restarting or failed replica's `detail` puts before the last lines of its engine's log.
LOG_TAIL_MARK = "Last lines of its log:\n"
BRIEF_LOG_LINES = 3


def brief_detail(detail: str) -> str:
    """A replica's `detail` made one line for a reason shown elsewhere (a rollout that stopped):
    what happened and the last few non-blank lines of its engine's log, where the error is (an
    engine's argument error ends its usage text). The whole tail stays in the engine's log."""
    head, mark, tail = detail.partition(LOG_TAIL_MARK)
    if not mark:
        return detail
    last = [line.strip() for line in tail.splitlines() if line.strip()][-BRIEF_LOG_LINES:]
    return head.rstrip() + (" Its log ends: " + " / ".join(last) if last else "")


# -- agent -> control plane ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class HeldFile:
    """A weights file in a node's cache: whole and verified, or a download under way (`complete`
    False, `size` what has arrived)."""

    sha256: str
    size: int
    complete: bool = True
    last_used: float = 0.0  # unix time a replica last used it (0: not known)


@attrs.frozen(kw_only=True)
class WeightsHeld:
    """What a node's weights cache holds, for placement (a replica goes where its files are) and
    for people (`ctl nodes`: files and disk use)."""

    files: tuple[HeldFile, ...] = ()
    cache_bytes: int = 0  # every file's bytes, partial ones included
    limit_bytes: int = 0  # agent.toml's weights_cache_gib in bytes; 0: no limit
    free_bytes: int = 0  # free on the disk of the weights directory
    port: int = 0  # where this node serves its weights to the other nodes (agent.peers); 0: it does not


# Values of BackendSpeed.state.
SPEED_OK = "ok"  # measured: the figures are this backend's
SPEED_MEASURING = "measuring"  # a measurement is under way (the figures, if any, are the last one's)
SPEED_WAITING = "waiting"  # this node's replicas are busy: measured once they are idle
SPEED_FAILED = "failed"  # the measurement went wrong: `detail` says why (the node serves on)


@attrs.frozen(kw_only=True)
class BackendSpeed:
    """How fast one backend of an engine ran the agent's made model on this node (agent.bench):
    llama-server's own timings of one completion. One entry per backend (llama.cpp: "cpu",
    "cuda", "vulkan"), so that a node with several says each; placement weighs nodes by the
    generation speed of the backend a replica would use (llmgw.server.state.scheduler)."""

    engine: str  # "llamacpp"
    backend: str  # "cpu", or the GPU backend's name as llama.cpp lists its devices ("cuda", "vulkan")
    state: str  # SPEED_OK, SPEED_MEASURING, SPEED_WAITING, SPEED_FAILED
    prompt_tps: float = 0.0  # prompt tokens a second (llama-server's timings.prompt_per_second)
    gen_tps: float = 0.0  # generated tokens a second (timings.predicted_per_second)
    version: str = ""  # the engine's version measured ("": the operator's install)
    device: str = ""  # the device measured ("CUDA0"; "" for the CPU)
    measured_at: float = 0.0  # unix time the figures were taken (0: never)
    detail: str = ""  # why it failed or waits
    request: str = ""  # the control plane's DesiredState.bench this answers ("": measured on its own)


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
    weights: WeightsHeld = WeightsHeld()
    speeds: tuple[BackendSpeed, ...] = ()


@attrs.frozen(kw_only=True)
class Heartbeat:
    seq: int
    # When the agent sent it, by its own clock (unix seconds; 0: not said): the control plane
    # counts the time from here to its registry's update (`llmgw_agent_heartbeat_delay_seconds`).
    sent_at: float = 0.0


@attrs.frozen(kw_only=True)
class InventoryChanged:
    inventory: Inventory


@attrs.frozen(kw_only=True)
class WeightsChanged:
    weights: WeightsHeld


@attrs.frozen(kw_only=True)
class SpeedsChanged:
    """Every backend's speed on this node, as measured last (level-triggered: the whole set)."""

    speeds: tuple[BackendSpeed, ...]


@attrs.frozen(kw_only=True)
class ReplicasChanged:
    """Every replica member on this node, as observed now (level-triggered: the whole set)."""

    replicas: tuple[ReplicaStatus, ...]


@attrs.frozen(kw_only=True)
class LogsReply:
    """The tail of a replica member's engine log on this node (`error` if there is none)."""

    request_id: int
    replica_id: str
    text: str = ""
    error: str = ""


@attrs.frozen(kw_only=True)
class EnginesChanged:
    """The engines the node has checked to run (ok) or failed to install (detail says why)."""

    engines: tuple[EngineStatus, ...]


# -- control plane -> agent ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Welcome:
    node_id: str
    server_version: str
    heartbeat_interval_s: float


@attrs.frozen(kw_only=True)
class ServerHeartbeat:
    """The control plane is there: sent every heartbeat interval, so that an agent notices one
    that stopped (paused, or cut off while its kernel still answers) and dials the next. It
    carries the interval the agent is to heartbeat at from now on (the Welcome's at first; the
    control plane stretches it as the cluster grows, `llmgw.server.links.heartbeats`); 0: as it was."""

    seq: int
    heartbeat_interval_s: float = 0.0


@attrs.frozen(kw_only=True)
class EngineArchive:
    arch: str
    backend: str
    url: str  # "" for a release archive
    sha256: str
    binary: str
    mirrored: bool = False  # the control plane has it: fetch it over the link's port instead
    size: int = 0  # server.toml's size of the archive in bytes; 0: not given
    max_bytes: int = 0  # without size or Content-Length, the most the download may bring; 0: the agent's default
    # A file of the control plane's release (llmgw.releasefiles.LLAMA_NAME): fetched from
    # RELEASE_PREFIX + release on the link's port. Taken only where no configured archive fits.
    release: str = ""


@attrs.frozen(kw_only=True)
class EngineBuild:
    """Source to build the engine from on a node that no archive fits (llama.cpp only)."""

    url: str
    sha256: str
    mirrored: bool = False  # the control plane has it: fetch it over the link's port instead
    size: int = 0  # server.toml's size of the source archive in bytes; 0: not given
    max_bytes: int = 0  # without size or Content-Length, the most the download may bring; 0: the agent's default
    jobs: int = 0  # parallel compile jobs; 0: the node decides from its cores and memory
    timeout_s: float = DEFAULT_BUILD_TIMEOUT_S  # the build is stopped after this long


@attrs.frozen(kw_only=True)
class EngineWant:
    """An engine the control plane wants on the node. version "" = the operator's install."""

    name: str
    version: str
    archives: tuple[EngineArchive, ...] = ()
    pip: str = ""  # a pip requirement, installed into a venv of its own
    index_url: str = ""  # pip's --index-url ("": pip's own, PyPI unless the node's pip.conf says otherwise)
    extra_index_urls: tuple[str, ...] = ()  # pip's --extra-index-url, each
    # The caps on unpacking an archive (server.toml's [engines.NAME]); an older control plane
    # sends none and the defaults apply.
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES
    max_members: int = DEFAULT_MAX_MEMBERS
    build: EngineBuild | None = None  # no archive fits the node: build it from this source
    # llama.cpp's: the node measures its speed once installed (agent.bench); False: only when
    # asked (DesiredState.bench).
    measure_speed: bool = True


@attrs.frozen(kw_only=True)
class WeightsFile:
    """One file of a model from the Hub: where it is in the repository, where to download it,
    and what it must be."""

    path: str  # in the repository: the engine finds it there, in the model's directory
    url: str
    sha256: str
    size: int


@attrs.frozen(kw_only=True)
class WeightsSource:
    url: str = ""  # downloaded once per node, verified against sha256
    sha256: str = ""
    path: str = ""  # already on the node (the operator's arrangement)
    token: str = ""  # bearer token for the download; a secret: never logged
    size: int = 0  # server.toml's size of the file in bytes; 0: not given
    max_bytes: int = 0  # without size or Content-Length, the most the download may bring; 0: the agent's default
    # A model from the Hub: its files, laid out as in the repository at `commit` (the engine is
    # given the first file, or for `directory` their directory). Each is downloaded once per
    # node and verified like a url source.
    repo: str = ""
    commit: str = ""
    files: tuple[WeightsFile, ...] = ()
    directory: bool = False  # vLLM, SGLang: the engine takes the directory


@attrs.frozen(kw_only=True)
class ReplicaAssignment:
    """One member of one replica that this node must run (node_rank of len(nodes))."""

    replica_id: str
    model: str  # also the served model name
    engine: str
    weights: WeightsSource = WeightsSource()
    api_key: str  # per replica: only the gateway may use the engine's port; never logged
    nodes: tuple[str, ...]  # rank order
    node_rank: int = 0
    rank0_addr: str = ""  # the rank-0 node's address as the members dial it (multi-node)
    dist_init_port: int = 0
    # Every member's address in rank order, as the control plane reaches each node (multi-node
    # llama.cpp): ranks 1.. lend their devices through llama.cpp's RPC server, which the node's
    # agent serves on member_addrs[rank]:dist_init_port behind mutual TLS that admits rank 0's
    # node alone (agent.rpctunnel); rank 0 dials them all. () for every other replica.
    member_addrs: tuple[str, ...] = ()
    gpus: int = 0  # GPUs on this node for this member
    args: tuple[str, ...] = ()  # the catalog's engine args
    ib_adapters: tuple[str, ...] = ()
    # Rank 0 publishes its KV-cache events on a port of its own (the catalog's cache_events;
    # vLLM and SGLang), reported as ReplicaStatus.events_port.
    cache_events: bool = False
    # The engine is started able to park its model (`EngineSpec.park`: vLLM's sleep mode), for a
    # model whose replicas follow the load (llmgw.server.state.autoscale).
    parkable: bool = False
    # Park it now (rank 0 asks its engine; PARKED once done), or wake it. Not part of what the
    # member runs (`agent.adoption.fingerprint`): a change parks or wakes, it never restarts.
    parked: bool = False


@attrs.frozen(kw_only=True)
class DesiredState:
    generation: int
    cordoned: bool = False
    engines: tuple[EngineWant, ...] = ()
    replicas: tuple[ReplicaAssignment, ...] = ()  # everything this node should run; others stop
    # The SHA-256 of every weights file the catalog names (url sources and the Hub's files): the
    # node may delete the downloaded files it holds that are not among them and that no replica
    # uses. None (a control plane before this field): delete nothing.
    keep_files: tuple[str, ...] | None = None
    # Models staged here ahead of their replicas (`llmgw ctl models stage`): download their files
    # into the weights cache now, one after another, and run nothing.
    stage: tuple[WeightsSource, ...] = ()
    # Measure the engines' speeds again (`llmgw ctl nodes bench`): a token the agent has not
    # measured for yet asks for one measurement, answered in BackendSpeed.request; "": none asked.
    bench: str = ""


@attrs.frozen(kw_only=True)
class LogsRequest:
    request_id: int
    replica_id: str
    lines: int = 100


# -- either way ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Redirect:
    """A control plane that does not lead answers a hello with this, on the agent link and the
    gateway link alike, then closes (a LinkError NOT_LEADER follows it): `leader` is the leader's
    agent port (wss://HOST:PORT, as the lease names it), "" while no control plane leads (a
    takeover under way); `message` says so for the operator."""

    leader: str
    message: str


@attrs.frozen(kw_only=True)
class LinkError:
    """Sent before closing: `code` is for programs, `message` for the operator (with the fix)."""

    code: str
    message: str


AgentMessage = (
    Hello
    | Heartbeat
    | InventoryChanged
    | EnginesChanged
    | ReplicasChanged
    | WeightsChanged
    | SpeedsChanged
    | LogsReply
    | LinkError
)
ServerMessage = Welcome | DesiredState | LogsRequest | ServerHeartbeat | Redirect | LinkError

# Error codes of LinkError.
BAD_MESSAGE = "bad_message"
UNKNOWN_TYPE = "unknown_type"
PROTOCOL = "protocol_version"
NODE_ID_MISMATCH = "node_id_mismatch"
REVOKED = "revoked"
UNEXPECTED = "unexpected_message"
CERT_EXPIRED = "certificate_expired"
SILENT = "silent"  # the control plane heard nothing for longer than the heartbeat TTL
NOT_LEADER = "not_leader"  # this control plane does not lead (after a Redirect, or when it stepped down)
