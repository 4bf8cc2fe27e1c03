"""The two configuration files' schema, `server.toml` and `agent.toml`: one frozen, keyword-only
attrs class per table, with the defaults (docs/configuration.md says why each), and the few
rules that belong to a value itself (`pip_requirement`, `parse_fabric_flag`).

Classes stay plain: reading them from TOML is `llmgw.config.convert`'s, the rules that span
fields are `llmgw.config.checks`'. Secrets (tokens in config) are held in `Secret`, whose repr
and str never show the value, so a config object can be logged whole without leaking them.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from llmgw import pins
from llmgw.secret import Secret

ENGINES = ("llamacpp", "vllm", "sglang", "sim")
DEFAULT_SERVER_STATE_DIR = "/var/lib/llmgw"
DEFAULT_AGENT_STATE_DIR = "/var/lib/llmgw-agent"
DEFAULT_NVIDIA_SMI = "/usr/bin/nvidia-smi"
DEFAULT_IB_ROOT = "/sys/class/infiniband"
DEFAULT_SMINFO = "/usr/sbin/sminfo"  # infiniband-diags, on Debian/Ubuntu and RHEL alike
# An engine archive may unpack to at most this many bytes and members (docs/configuration.md).
DEFAULT_MAX_UNPACKED_BYTES = 8 << 30
DEFAULT_MAX_MEMBERS = 50_000
# The vLLM every capable NVIDIA node gets unless server.toml says otherwise: the version whose
# `vllm serve --help=all` llmgw's flags were checked against (llmgw.engines.vllm), from PyPI.
DEFAULT_VLLM_VERSION = "0.32.0"
# Engines installed with pip: without `pip` or `archives`, the requirement is NAME==VERSION.
PIP_ENGINES = ("vllm", "sglang")
# Engines that publish their KV-cache events (a model's cache_events; llmgw.engines' specs agree: a test says so).
EVENT_ENGINES = ("vllm", "sglang")
# A llama.cpp build on a node is stopped after this long (docs/engines.md: 5-8 min on 2 cores for
# the CPU build; a CUDA build for one GPU architecture takes several times that).
DEFAULT_BUILD_TIMEOUT_S = 7200.0


# -- server.toml ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ServerSection:
    state_dir: str = DEFAULT_SERVER_STATE_DIR
    agent_listen: str = "0.0.0.0:7443"
    http_listen: str = "127.0.0.1:8080"
    advertise: tuple[str, ...] = ()
    # Where others reach this control plane, named in the lease when it leads so that a standby
    # can say where the leader is ("": from advertise and the listeners; docs/configuration.md).
    agent_url: str = ""
    admin_url: str = ""
    # Where else the cluster page may be opened, beyond http_listen's address, advertise and
    # admin_url (an SSH tunnel's other port, a proxy's second name): a page session's change is
    # refused from any other Origin (`server.page.page_origins`; docs/configuration.md).
    page_origins: tuple[str, ...] = ()
    heartbeat_interval_s: float = 5.0
    heartbeat_ttl_s: float = 30.0
    # Heartbeats a second the control plane takes from all agents together: past
    # heartbeat_interval_s × this many agents, each is told a longer interval (0: never).
    heartbeat_max_rate: float = 50.0
    reconnect_grace_s: float = 35.0
    # Days the audit log keeps an admin action; the leader forgets older ones once a day (0: never).
    audit_keep_days: float = 365.0
    # Gateway worker processes serving http_listen: a number, "auto" (one per CPU), or unset: the
    # command's default, "auto" for `llmgw server` and 1 for `llmgw up`. 0 runs the gateway on
    # the control plane's own loop, for tests and embedding only (docs/configuration.md).
    gateway_workers: int | str | None = None


@attrs.frozen(kw_only=True)
class Limits:
    """The limits one HTTP listener serves under: its deadlines, sizes and connection cap.
    Declared once, here, for `[http]` (`HttpSection`) and every listener of the HTTP stack,
    which takes them as `llmgw.http.limits.Limits` (the sim engine serves at the defaults). What
    each limit does is `llmgw.http.server`'s docstring; why each default, docs/configuration.md."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    body_min_bytes_per_s: int = 1024  # bytes per second, averaged over the body so far; 0 = no minimum
    keepalive_timeout_s: float = 60.0
    send_timeout_s: float = 30.0
    max_head_bytes: int = 16384
    max_body_bytes: int = 8 << 20
    body_budget_bytes: int = 64 << 20  # request bodies buffered at once, all connections together
    max_connections: int = 0  # 0 = sized from the open-file limit, see `fdlimits.default_max_connections`


@attrs.frozen(kw_only=True)
class HttpSection(Limits):
    """`[http]`: the HTTP listeners' deadlines and limits, declared once in `Limits` (the shared
    HTTP server's, which serves the gateway and admin API, and the agent port with the same
    deadlines and head limit), and the agent port's own budget; see docs/configuration.md."""

    max_agent_connections: int = 0  # the agent listener's own budget; 0 = sized from the open-file limit


@attrs.frozen(kw_only=True)
class CASection:
    ca_validity_days: int = 3650
    server_cert_validity_days: int = 825
    node_cert_validity_days: int = 365


@attrs.frozen(kw_only=True)
class ModelFile:
    """One file of a model from the Hub: its path in the repository, size and SHA-256, pinned
    when the model was added (`llmgw.hub.resolve`)."""

    path: str
    size: int
    sha256: str


@attrs.frozen(kw_only=True)
class ModelSource:
    url: str = ""
    sha256: str = ""
    size: int = 0  # the file's size in bytes, if given: the download may bring no more (and no other)
    path: str = ""
    token: Secret | None = None
    # A model from the Hub (`llmgw ctl models add NAME --hf ORG/REPO`; not written in server.toml):
    # the repository, the revision asked for, the commit it was pinned to and the files the engine
    # needs, each downloaded from [hub] endpoint and verified on the nodes. The engine is given
    # the first of `files` (llama.cpp: the GGUF, or its first part) or their directory (vLLM, SGLang).
    hf: str = ""
    revision: str = ""
    commit: str = ""
    files: tuple[ModelFile, ...] = ()


@attrs.frozen(kw_only=True)
class Model:
    name: str
    engine: str
    source: ModelSource = ModelSource()
    replicas: int = 1
    gpus_per_replica: int = 0
    nodes_per_replica: int = 1
    memory_gb: float = 0.0
    args: tuple[str, ...] = ()
    # How the gateway picks a replica: "prefix" (where its prompt is cached) or
    # "least_outstanding"; "" (default): prefix for engines that keep a prefix cache.
    routing: str = ""
    # vLLM, SGLang: the engine publishes its KV-cache events and the gateways read them (routing
    # by prefix knows when a replica evicted or cleared what it served). Off by default: the
    # events carry token ids, unauthenticated, on a port of every address of the node.
    cache_events: bool = False
    # Replicas that follow the load (`llmgw.server.state.autoscale`, docs/configuration.md): with
    # either set, the control plane keeps between min_replicas and max_replicas by the model's
    # load, starting from `replicas`; min_replicas = 0 stops every replica after `idle_s` without
    # a request, and the next request starts one (the gateways hold it meanwhile). Unset: always
    # `replicas`.
    min_replicas: int | None = None
    max_replicas: int | None = None
    idle_s: float = 300.0
    # Requests for this model that may wait for a replica on each gateway instance, and for how
    # long; 0: [gateway] max_queue and queue_timeout_s. A cold start takes the engine's start and
    # the model's load: a model on demand may need longer than the gateway's 30 s.
    max_queue: int = 0
    queue_timeout_s: float = 0.0
    # A replica the load no longer needs is parked rather than stopped where its engine can
    # (vLLM's sleep mode, on GPUs: the weights kept in the node's memory, the GPU's freed, woken
    # in a fraction of a second); false: stopped, as on the other engines.
    park: bool = True

    @property
    def scaled(self) -> bool:
        """Its replicas follow the load (min_replicas or max_replicas set)."""
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """The fewest and most replicas it may have: (replicas, replicas) unless scaled. Unset,
        min_replicas is 1 and max_replicas the larger of min_replicas and replicas."""
        if not self.scaled:
            return self.replicas, self.replicas
        low = 1 if self.min_replicas is None else self.min_replicas
        high = max(low, self.replicas, 1) if self.max_replicas is None else self.max_replicas
        return low, high


@attrs.frozen(kw_only=True)
class EngineArchive:
    """A prebuilt engine for one architecture and backend: a .tar.gz/.tgz/.tar.xz/.zip file."""

    arch: str  # as `uname -m` prints it: x86_64, aarch64
    backend: str = "cpu"  # "cpu" or "cuda": cuda archives go to nodes with an NVIDIA GPU
    url: str
    sha256: str
    binary: str  # the executable's path inside the archive
    size: int = 0  # the archive's size in bytes, if given: the download may bring no more (and no other)


@attrs.frozen(kw_only=True)
class EngineSource:
    """Which version of an engine the nodes should have, and where it comes from.

    version "" means: use the engine the operator installed on each node (agent.toml's
    `llamacpp_bin`, `vllm_bin`, `sglang_python`). enabled = false: the nodes are not asked for
    it at all (llama.cpp on a cluster that serves no GGUF model, like `llmgw up` without --model)."""

    version: str = ""
    archives: tuple[EngineArchive, ...] = ()
    pip: str = ""  # a pip requirement installed into a venv per version, e.g. "vllm==0.11.0"
    index_url: str = ""  # pip's --index-url for it ("": pip's default, PyPI unless the node's pip.conf says)
    extra_index_url: tuple[str, ...] = ()  # more indexes pip may take packages from
    enabled: bool = True
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES  # an archive unpacking to more is refused
    max_members: int = DEFAULT_MAX_MEMBERS  # likewise an archive with more members


@attrs.frozen(kw_only=True)
class VllmSource(EngineSource):
    """[engines.vllm]: as EngineSource, but a table that names no version gets the pinned one,
    so `[engines.vllm]` with only `index_url` still installs vLLM (version = "" for the operator's)."""

    version: str = DEFAULT_VLLM_VERSION


@attrs.frozen(kw_only=True)
class EngineBuild:
    """llama.cpp's source, built into llama-server on each node that no archive fits: a .tar.gz
    holding llama.cpp's tree (at its top or in a `llama.cpp/` directory)."""

    url: str
    sha256: str
    size: int = 0  # the file's size in bytes, if given: the download may bring no more (and no other)
    jobs: int = 0  # parallel compile jobs; 0: from the node's cores and free memory (about 1 GiB a job)
    timeout_s: float = DEFAULT_BUILD_TIMEOUT_S  # the whole build (configure, compile) is stopped after this


PINNED_LLAMACPP_BUILD = EngineBuild(
    url=pins.LLAMACPP_SDIST_URL, sha256=pins.LLAMACPP_SDIST_SHA256, size=pins.LLAMACPP_SDIST_SIZE
)


def _pinned_build(source: LlamacppSource) -> EngineBuild | None:
    # The pinned source is that of the pinned version only: a table naming another version builds
    # nothing unless it names that version's source too.
    return PINNED_LLAMACPP_BUILD if source.version == pins.LLAMACPP_VERSION else None


def _release_by_default(source: LlamacppSource) -> bool:
    # The release's archives are the default source; a table that names its own archives, or a
    # source to build other than the pinned one, keeps to what it names (as before the release
    # carried llama.cpp) unless it also says `release = true`.
    return not source.archives and source.build in (None, PINNED_LLAMACPP_BUILD)


@attrs.frozen(kw_only=True)
class LlamacppSource(EngineSource):
    """[engines.llamacpp]: by default the pinned release, from the control plane's release
    archives (`llama.cpp-VERSION-linux-ARCH.tar.gz`, every CPU variant) on the architectures they
    cover, else built on each node from its source. On a node, in order (agent.engines): agent.toml's
    llamacpp_bin; version "" (the operator's llama-server); an `archives` entry that fits (cuda where
    there is a GPU); a CUDA build where the node has a GPU and nvcc; the release's archive; a build.
    `release = false` takes nothing from the release; `build = false` builds nowhere.
    `measure_speed = false`: the nodes measure llama.cpp's speed (agent.bench) only when
    `llmgw ctl nodes bench` asks, not by themselves once it is installed."""

    version: str = pins.LLAMACPP_VERSION
    build: EngineBuild | None = attrs.field(default=attrs.Factory(_pinned_build, takes_self=True))
    release: bool = attrs.field(default=attrs.Factory(_release_by_default, takes_self=True))
    measure_speed: bool = True


@attrs.frozen(kw_only=True)
class EnginesSection:
    llamacpp: LlamacppSource = LlamacppSource()
    vllm: VllmSource | None = VllmSource()  # on by default; `enabled = false` turns it off
    sglang: EngineSource | None = None  # only where named


def pip_requirement(name: str, source: EngineSource) -> str:
    """What pip installs for a pip engine: `pip` if given, else NAME==VERSION; "" if not pip-installed."""
    if source.pip or source.archives or not source.version or name not in PIP_ENGINES:
        return source.pip
    return f"{name}=={source.version}"


@attrs.frozen(kw_only=True)
class GatewaySection:
    """`[gateway]`: how the gateway waits for replicas and gives up on them (docs/configuration.md
    says why each default). The gateway takes this class as its options (`Gateway(options=...)`)."""

    connect_timeout_s: float = 1.0
    first_byte_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    queue_timeout_s: float = 30.0
    max_queue: int = 1024
    max_attempts: int = 3
    # A stream whose replica fails mid-answer is continued on another (`llmgw.gateway.migrate`), at
    # most this many times; 0: never (the answer is cut, as before). Once its tokens flow, a stream
    # silent for `stream_stall_s` counts as failed.
    max_migrations: int = 2
    stream_stall_s: float = 30.0
    max_outstanding_per_replica: int = 0
    affinity_chars: int = 0  # replaced by prefix routing: a config that sets it is refused, saying so
    max_idle_per_replica: int = 64
    # Prefix routing (`llmgw.gateway.prefix`): the prompt's blocks, how much of it counts, how
    # much busier than the least loaded replica a cache-holding one may be, and how many prompt
    # prefixes each gateway process remembers.
    prefix_block_chars: int = 256
    prefix_max_chars: int = 65536
    prefix_load_factor: float = 1.25
    prefix_table_entries: int = 200_000


@attrs.frozen(kw_only=True)
class AutoscaleSection:
    """`[autoscale]`: how the replicas of models with min_replicas/max_replicas follow their load
    (`llmgw.server.state.autoscale`; docs/configuration.md says how to tune it)."""

    # A model's load is its requests queued and in flight on every gateway; it wants
    # ceil(load / target_per_replica) replicas.
    target_per_replica: float = 4.0
    up_after_s: float = 5.0  # the load has wanted more replicas this long: more
    down_after_s: float = 60.0  # the load would fit one fewer, below `down_margin` of the target, this long: one fewer
    down_margin: float = 0.5
    interval_s: float = 1.0  # how often the load is looked at (a request for a model with none is acted on at once)


@attrs.frozen(kw_only=True)
class DownloadsSection:
    """The most a download whose size is not known may bring (docs/configuration.md says why).
    A source with `size` is capped at that, one whose server sends Content-Length at that."""

    max_archive_gib: int = 4
    max_weights_gib: int = 64
    # Who downloads a weights file from its source, once per cluster: "node" (one node the tracker
    # names; the others take it from the nodes), or "control_plane" (the control plane, for nodes
    # without internet; llmgw.server.nodes.weightsorigin).
    weights_origin: str = "node"

    @property
    def max_archive_bytes(self) -> int:
        return self.max_archive_gib << 30

    @property
    def max_weights_bytes(self) -> int:
        return self.max_weights_gib << 30


@attrs.frozen(kw_only=True)
class ReleaseSection:
    """The release files the control plane serves nodes on the agent port (docs/configuration.md):
    `dir`, a release directory (both architectures' files and SHA256SUMS); "" for the release this
    llmgw runs from. `serve = false` serves none, and the agent port then admits no peer without a
    node certificate at all."""

    serve: bool = True
    dir: str = ""


@attrs.frozen(kw_only=True)
class DebugSection:
    """Diagnostics that disturb the control plane on purpose, each off unless turned on here."""

    allow_stall: bool = False  # POST /admin/v1/debug/stall: hold the event loop (docs/reliability.md)
    measure_steps: bool = False  # time every task step of the loop (llmgw.looplag.StepTimer): ~1 µs a step


@attrs.frozen(kw_only=True)
class HubSection:
    """`[hub]`: where models named by their Hub repository come from (`llmgw ctl models add
    --hf`): the Hugging Face Hub, or any server that speaks its API (an internal mirror, for a
    cluster without the internet). `token_file`: a file (mode 0600) holding the token used for
    gated and private repositories when a model brings none of its own."""

    endpoint: str = "https://huggingface.co"
    token_file: str = ""
    timeout_s: float = 30.0


@attrs.frozen(kw_only=True)
class StoreSection:
    """`[store]`: where the control plane keeps its state. `url` is "sqlite" (the state
    directory's llmgw.db) or a libpq connection string (`llmgw.config.storeurl` reads it, and
    prints it redacted); a PostgreSQL password comes from `password_file` (mode 0600) or from
    libpq's own ~/.pgpass / PGPASSFILE, never from the url. With PostgreSQL, several control
    planes may share the store: one leads, by a lease of `lease_ttl_s` renewed every
    `lease_renew_s` (docs/high-availability.md); SQLite has no lease (its one control plane leads)."""

    url: str = "sqlite"
    password_file: str = ""
    lease_ttl_s: float = 5.0
    lease_renew_s: float = 1.0


# [telemetry] sample_ratio's default: the share of requests without a traceparent that are traced.
DEFAULT_SAMPLE_RATIO = 0.01


@attrs.frozen(kw_only=True)
class TelemetrySection:
    """`[telemetry]`: the gateway's traces (`llmgw.telemetry`), exported over OTLP/HTTP to a
    collector; off while `otlp_endpoint` is "" (nothing of OpenTelemetry is then imported).
    `otlp_endpoint` is the collector's base URL, `/v1/traces` appended as OTLP/HTTP's own
    OTEL_EXPORTER_OTLP_ENDPOINT is; `headers_file` a file (mode 0600) of `Name: value` lines sent
    with every export (a vendor's API key), read at start and never logged. A request whose
    client sent a sampled `traceparent` is traced whatever `sample_ratio` says (parent-based).
    `sample_ratio` is 1 % by default, as Istio's is: tracing every request costs the gateway about
    twice its CPU per request with OpenTelemetry's Python SDK (docs/operations.md#traces)."""

    otlp_endpoint: str = ""
    service_name: str = "llmgw-gateway"
    sample_ratio: float = DEFAULT_SAMPLE_RATIO
    headers_file: str = ""
    timeout_s: float = 10.0  # one export's request, in the exporter's own thread

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint)


@attrs.frozen(kw_only=True)
class ServerConfig:
    server: ServerSection = ServerSection()
    store: StoreSection = StoreSection()
    http: HttpSection = HttpSection()
    ca: CASection = CASection()
    engines: EnginesSection = EnginesSection()
    gateway: GatewaySection = GatewaySection()
    autoscale: AutoscaleSection = AutoscaleSection()
    downloads: DownloadsSection = DownloadsSection()
    release: ReleaseSection = ReleaseSection()
    debug: DebugSection = DebugSection()
    hub: HubSection = HubSection()
    telemetry: TelemetrySection = TelemetrySection()
    models: tuple[Model, ...] = ()


# -- agent.toml ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FabricDecl:
    name: str
    adapters: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class AgentConfig:
    # The control plane's agent port (wss://HOST:PORT), or every control plane's when several
    # share a PostgreSQL store: the agent tries them in turn and follows a standby to the leader.
    server: str | tuple[str, ...]
    node_id: str = ""
    state_dir: str = DEFAULT_AGENT_STATE_DIR
    nvidia_smi: str = DEFAULT_NVIDIA_SMI
    ib_root: str = DEFAULT_IB_ROOT
    sminfo: str = DEFAULT_SMINFO
    weights_dir: str = ""  # "" means <state_dir>/weights
    # The downloaded weights kept here, at most (GiB); past it the least recently used unused files
    # go (agent.weights_cache). 0: no limit but the disk's.
    weights_cache_gib: float = 0.0
    # The TCP port this node serves its weights to the cluster's other nodes on (mutual TLS with
    # node certificates; agent.peers). 0: one the kernel picks, told to the control plane.
    weights_port: int = 0
    # Fetch weights from the other nodes, the source only where the tracker says so (agent.swarm).
    # false: every file from its source by this node alone (it still serves what it holds).
    weights_from_peers: bool = True
    fabrics: tuple[FabricDecl, ...] = ()
    llamacpp_bin: str = ""  # an operator-installed llama-server: used on this node whatever server.toml pins
    vllm_bin: str = ""  # an operator-installed `vllm` executable
    sglang_python: str = ""  # the Python whose environment has SGLang installed
    source_address: str = ""  # the local address to dial the control plane from ("" = the system's choice)
    build_jobs: int = 0  # parallel jobs of a llama.cpp build here; 0: server.toml's, else from cores and memory
    build_cache: str = ""  # a directory keeping built llama-servers to reuse (by source, CPU and flags); "": none
    # Which of the release's llama.cpp builds this node takes: "auto" (Vulkan's where the node has a
    # Vulkan device that is not a software one, else the CPU's), "cpu" or "vulkan" (docs/engines.md).
    llamacpp_backend: str = "auto"


def control_planes(cfg: AgentConfig) -> tuple[str, ...]:
    """agent.toml's `server`, one or several, as a tuple in its order."""
    return cfg.server if isinstance(cfg.server, tuple) else (cfg.server,)


def weights_dir_of(cfg: AgentConfig) -> str:
    return cfg.weights_dir or str(Path(cfg.state_dir) / "weights")


def weights_cache_bytes_of(cfg: AgentConfig) -> int:
    """agent.toml's `weights_cache_gib` in bytes; 0: no limit."""
    return int(cfg.weights_cache_gib * 2**30)


def parse_fabric_flag(text: str) -> FabricDecl:
    """`--fabric NAME[:ADAPTER,ADAPTER]` as a declaration; ValueError says what is wrong.

    Whether the adapters exist and agree is not decided here: that needs the hardware
    (`agent.discovery.fabrics`).
    """
    name, sep, rest = text.partition(":")
    if not NAME.match(name):
        raise ValueError(
            f"fabric name {name!r} may use only letters, digits, '.', '_' and '-' (e.g. --fabric ib-a:mlx5_0,mlx5_1)"
        )
    adapters = tuple(a.strip() for a in rest.split(",")) if sep else ()
    if sep and (not adapters or any(not ADAPTER.match(a) for a in adapters)):
        raise ValueError(
            f"adapters of fabric {name!r} must be a comma-separated list of names like mlx5_0, got {rest!r} "
            f"(e.g. --fabric {name}:mlx5_0,mlx5_1, or --fabric {name} for the default two)"
        )
    if len(set(adapters)) != len(adapters):
        raise ValueError(f"fabric {name!r} names an adapter twice: {rest!r}")
    return FabricDecl(name=name, adapters=adapters)


# The grammar of names in config and on the command line (models, nodes, fabrics; adapters).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ADAPTER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
