"""The two configuration files, `server.toml` and `agent.toml`: their types and how they load.

Classes stay plain (frozen, keyword-only attrs); all conversion lives in the one converter
below, which refuses unknown keys. Loading reports every problem at once, each with its path
(`expected int @ $.models[0].replicas`), as a `ConfigError`. Type errors come from cattrs;
rules that span fields (unique model names, a known engine) come from `_check_*`, which
returns problems instead of raising so that both kinds are reported together.

Secrets (tokens in config) are held in `Secret`, whose repr and str never show the value, so a
config object can be logged whole without leaking them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, TypeVar, get_origin

import attrs
import cattrs
from cattrs.cols import homogenous_tuple_structure_factory
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn

from llmgw import pins
from llmgw.errors import ConfigError
from llmgw.http.limits import Limits

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on the nodes' 3.10
    import tomli as tomllib

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
# A llama.cpp build on a node is stopped after this long (docs/engines.md: 5-8 min on 2 cores for
# the CPU build; a CUDA build for one GPU architecture takes several times that).
DEFAULT_BUILD_TIMEOUT_S = 7200.0


@attrs.frozen(repr=False)
class Secret:
    """A value that must never be printed. `reveal()` is the one way to read it."""

    _value: str

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('<redacted>')"

    __str__ = __repr__


# -- server.toml ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ServerSection:
    state_dir: str = DEFAULT_SERVER_STATE_DIR
    agent_listen: str = "0.0.0.0:7443"
    http_listen: str = "127.0.0.1:8080"
    advertise: tuple[str, ...] = ()
    heartbeat_interval_s: float = 5.0
    heartbeat_ttl_s: float = 30.0
    reconnect_grace_s: float = 35.0


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
class ModelSource:
    url: str = ""
    sha256: str = ""
    size: int = 0  # the file's size in bytes, if given: the download may bring no more (and no other)
    path: str = ""
    token: Secret | None = None


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
    `release = false` takes nothing from the release; `build = false` builds nowhere."""

    version: str = pins.LLAMACPP_VERSION
    build: EngineBuild | None = attrs.field(default=attrs.Factory(_pinned_build, takes_self=True))
    release: bool = attrs.field(default=attrs.Factory(_release_by_default, takes_self=True))


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
    max_outstanding_per_replica: int = 0
    affinity_chars: int = 0
    max_idle_per_replica: int = 64


@attrs.frozen(kw_only=True)
class DownloadsSection:
    """The most a download whose size is not known may bring (docs/configuration.md says why).
    A source with `size` is capped at that, one whose server sends Content-Length at that."""

    max_archive_gib: int = 4
    max_weights_gib: int = 64

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
class ServerConfig:
    server: ServerSection = ServerSection()
    http: HttpSection = HttpSection()
    ca: CASection = CASection()
    engines: EnginesSection = EnginesSection()
    gateway: GatewaySection = GatewaySection()
    downloads: DownloadsSection = DownloadsSection()
    release: ReleaseSection = ReleaseSection()
    debug: DebugSection = DebugSection()
    models: tuple[Model, ...] = ()


# -- agent.toml ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FabricDecl:
    name: str
    adapters: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class AgentConfig:
    server: str
    node_id: str = ""
    state_dir: str = DEFAULT_AGENT_STATE_DIR
    nvidia_smi: str = DEFAULT_NVIDIA_SMI
    ib_root: str = DEFAULT_IB_ROOT
    sminfo: str = DEFAULT_SMINFO
    weights_dir: str = ""  # "" means <state_dir>/weights
    fabrics: tuple[FabricDecl, ...] = ()
    llamacpp_bin: str = ""  # an operator-installed llama-server: used on this node whatever server.toml pins
    vllm_bin: str = ""  # an operator-installed `vllm` executable
    sglang_python: str = ""  # the Python whose environment has SGLang installed
    source_address: str = ""  # the local address to dial the control plane from ("" = the system's choice)
    build_jobs: int = 0  # parallel jobs of a llama.cpp build here; 0: server.toml's, else from cores and memory
    build_cache: str = ""  # a directory keeping built llama-servers to reuse (by source, CPU and flags); "": none


def weights_dir_of(cfg: AgentConfig) -> str:
    return cfg.weights_dir or str(Path(cfg.state_dir) / "weights")


def parse_fabric_flag(text: str) -> FabricDecl:
    """`--fabric NAME[:ADAPTER,ADAPTER]` as a declaration; ValueError says what is wrong.

    Whether the adapters exist and agree is not decided here: that needs the hardware
    (`agent.discovery.fabrics`).
    """
    name, sep, rest = text.partition(":")
    if not _NAME.match(name):
        raise ValueError(
            f"fabric name {name!r} may use only letters, digits, '.', '_' and '-' (e.g. --fabric ib-a:mlx5_0,mlx5_1)"
        )
    adapters = tuple(a.strip() for a in rest.split(",")) if sep else ()
    if sep and (not adapters or any(not _ADAPTER.match(a) for a in adapters)):
        raise ValueError(
            f"adapters of fabric {name!r} must be a comma-separated list of names like mlx5_0, got {rest!r} "
            f"(e.g. --fabric {name}:mlx5_0,mlx5_1, or --fabric {name} for the default two)"
        )
    if len(set(adapters)) != len(adapters):
        raise ValueError(f"fabric {name!r} names an adapter twice: {rest!r}")
    return FabricDecl(name=name, adapters=adapters)


# -- the converter -------------------------------------------------------------------------

converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
converter.register_structure_hook(Secret, lambda v, _: Secret(_expect_str(v)))
converter.register_unstructure_hook(Secret, lambda s: "<redacted>")


def _expect_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _strict(kind: type, name: str):
    # cattrs would turn "3" into 3 and 1.5 into 1; a config file that says "3" is a mistake
    # worth naming, not one to paper over.
    def hook(value: Any, _: type) -> Any:
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise TypeError(f"expected {name}, got {type(value).__name__} {value!r}")
        return value

    return hook


def _is_list_type(t: Any) -> bool:
    return get_origin(t) is tuple and t.__args__[-1] is Ellipsis


def _list_hook(t: Any):
    inner = homogenous_tuple_structure_factory(t, converter)

    def hook(value: Any, _: type) -> Any:
        # Without this a string would be taken as a list of its characters.
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {type(value).__name__} {value!r}")
        return inner(value, t)

    return hook


def _is_table_type(t: Any) -> bool:
    return attrs.has(t) and t is not Secret


def _table_hook(cl: type):
    inner = make_dict_structure_fn(cl, converter, _cattrs_forbid_extra_keys=True, _cattrs_detailed_validation=True)

    def hook(value: Any, _: type) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected a table, got {type(value).__name__} {value!r}")
        return inner(value, cl)

    return hook


def _build_or_false(value: Any, _: type) -> EngineBuild | None:
    # TOML has no null: `build = false` is how a table says "build nowhere".
    if value is False:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"expected a table (url, sha256, ...) or false, got {type(value).__name__} {value!r}")
    return converter.structure(value, EngineBuild)


converter.register_structure_hook(EngineBuild | None, _build_or_false)
converter.register_unstructure_hook(EngineBuild | None, lambda b: False if b is None else converter.unstructure(b))
converter.register_structure_hook_factory(_is_list_type, _list_hook)
converter.register_structure_hook_factory(_is_table_type, _table_hook)
converter.register_structure_hook(int, _strict(int, "int"))
converter.register_structure_hook(float, _strict(float, "a number"))
converter.register_structure_hook(str, _strict(str, "a string"))
converter.register_structure_hook(bool, _strict(bool, "true or false"))


def _format_error(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        allowed = sorted(f.name.lstrip("_") for f in attrs.fields(exc.cl))
        keys = ", ".join(repr(k) for k in sorted(exc.extra_fields))
        return f"unknown key {keys} (allowed here: {', '.join(allowed)})"
    if isinstance(exc, KeyError):
        return "required key is missing"
    if isinstance(exc, TypeError) and str(exc).startswith("expected"):
        return str(exc)
    return f"invalid value: {exc}"


T = TypeVar("T")


def _structure(data: dict, cls: type[T], path: str) -> T:
    try:
        return converter.structure(data, cls)
    except (ClassValidationError, IterableValidationError) as exc:
        raise ConfigError(path, cattrs.transform_error(exc, path="$", format_exception=_format_error)) from None


def _check_server(cfg: ServerConfig) -> list[str]:
    problems = []
    if cfg.server.heartbeat_ttl_s <= cfg.server.heartbeat_interval_s:
        problems.append(
            f"heartbeat_ttl_s ({cfg.server.heartbeat_ttl_s}) must be longer than heartbeat_interval_s "
            f"({cfg.server.heartbeat_interval_s}) @ $.server.heartbeat_ttl_s"
        )
    for key in ("agent_listen", "http_listen"):
        value = getattr(cfg.server, key)
        if not _HOSTPORT.match(value):
            problems.append(f"expected HOST:PORT, got {value!r} @ $.server.{key}")
    for key in ("head_timeout_s", "body_timeout_s", "keepalive_timeout_s", "send_timeout_s"):
        if getattr(cfg.http, key) <= 0:
            problems.append(f"must be more than 0 seconds @ $.http.{key}")
    for key in ("max_head_bytes", "max_body_bytes"):
        if getattr(cfg.http, key) < 1024:
            problems.append(f"must be at least 1024 @ $.http.{key}")
    if cfg.http.body_budget_bytes < cfg.http.max_body_bytes:
        problems.append(
            f"must be at least max_body_bytes ({cfg.http.max_body_bytes}), or a body of the largest size "
            f"allowed could never be read; got {cfg.http.body_budget_bytes} @ $.http.body_budget_bytes"
        )
    for key in ("body_min_bytes_per_s", "max_connections", "max_agent_connections"):
        if getattr(cfg.http, key) < 0:
            problems.append(
                f"must not be negative (0 means {'no minimum' if key.startswith('body') else 'sized from the open-file limit'}) @ $.http.{key}"
            )
    for key in ("ca_validity_days", "server_cert_validity_days", "node_cert_validity_days"):
        if getattr(cfg.ca, key) < 1:
            problems.append(f"must be at least 1 @ $.ca.{key}")
    problems.extend(_check_engines(cfg.engines))
    problems.extend(_check_gateway(cfg.gateway))
    for key in ("max_archive_gib", "max_weights_gib"):
        if getattr(cfg.downloads, key) < 1:
            problems.append(f"must be at least 1 @ $.downloads.{key}")
    if cfg.release.dir and not Path(cfg.release.dir).is_absolute():
        problems.append(f"expected an absolute path, got {cfg.release.dir!r} @ $.release.dir")
    seen: dict[str, int] = {}
    for i, m in enumerate(cfg.models):
        at = f"$.models[{i}]"
        if not _NAME.match(m.name):
            problems.append(
                f"model name {m.name!r} may use only letters, digits, '.', '_' and '-' "
                f"and start with a letter or digit @ {at}.name"
            )
        if m.name in seen:
            problems.append(f"model name {m.name!r} is already used by $.models[{seen[m.name]}] @ {at}.name")
        seen.setdefault(m.name, i)
        if m.engine not in ENGINES:
            problems.append(f"unknown engine {m.engine!r} (one of: {', '.join(ENGINES)}) @ {at}.engine")
        for key in ("replicas", "nodes_per_replica"):
            if getattr(m, key) < 1:
                problems.append(f"must be at least 1 @ {at}.{key}")
        if m.gpus_per_replica < 0 or m.memory_gb < 0:
            bad = "gpus_per_replica" if m.gpus_per_replica < 0 else "memory_gb"
            problems.append(f"must not be negative @ {at}.{bad}")
        source = getattr(cfg.engines, m.engine, None)
        if source is not None and not source.enabled:
            problems.append(
                f"model {m.name!r} uses {m.engine}, which [engines.{m.engine}] turns off (enabled = false); "
                f"remove that line or this model @ {at}.engine"
            )
        if m.engine == "llamacpp" and m.nodes_per_replica > 1:
            problems.append(f"llama.cpp runs on one node; set nodes_per_replica = 1 @ {at}.nodes_per_replica")
        problems.extend(_check_source(m.source, f"{at}.source", needed=m.engine != "sim"))
    return problems


def _check_engines(engines: EnginesSection) -> list[str]:
    problems = []
    for name in ("llamacpp", "vllm", "sglang"):
        source = getattr(engines, name)
        if source is None:
            continue
        at = f"$.engines.{name}"
        build = getattr(source, "build", None)
        # The release carries the pinned llama.cpp only: another version needs a source of its own.
        released = getattr(source, "release", False) and source.version == pins.LLAMACPP_VERSION
        if source.version and not (source.archives or source.pip or build or released) and name not in PIP_ENGINES:
            more = " or `build`" if name == "llamacpp" else ""
            problems.append(
                f'version {source.version!r} needs `archives`{more} or `pip` to install it from, or version = "" to '
                f"use the engine the operator installed on each node @ {at}"
            )
        if build is not None:
            problems.extend(_check_build(source.version, build, f"{at}.build"))
        if source.archives and source.pip:
            problems.append(f"give either archives or pip, not both @ {at}")
        if (source.index_url or source.extra_index_url) and (source.archives or not source.version):
            problems.append(
                f"index_url and extra_index_url are where pip finds {name}; they need a version installed with pip, "
                f"not archives or the operator's install @ {at}"
            )
        for key, urls in (
            ("index_url", (source.index_url,) if source.index_url else ()),
            ("extra_index_url", source.extra_index_url),
        ):
            for url in urls:
                if not url.startswith(("https://", "http://")):
                    problems.append(f"expected an http(s) URL of a package index, got {url!r} @ {at}.{key}")
        for key in ("max_unpacked_bytes", "max_members"):
            if getattr(source, key) < 1:
                problems.append(f"must be at least 1, got {getattr(source, key)} @ {at}.{key}")
        seen = set()
        for j, a in enumerate(source.archives):
            where = f"{at}.archives[{j}]"
            if a.backend not in ("cpu", "cuda"):
                problems.append(f'backend must be "cpu" or "cuda", got {a.backend!r} @ {where}.backend')
            if (a.arch, a.backend) in seen:
                problems.append(f"a second archive for {a.arch}/{a.backend} @ {where}")
            seen.add((a.arch, a.backend))
            if not a.url.startswith(("https://", "http://")):
                problems.append(f"expected an http(s) URL, got {a.url!r} @ {where}.url")
            if not re.fullmatch(r"[0-9a-f]{64}", a.sha256):
                problems.append(f"sha256 must be 64 lowercase hex digits @ {where}.sha256")
            if a.size < 0:
                problems.append(f"must not be negative (0: not given), got {a.size} @ {where}.size")
            if not a.binary or a.binary.startswith("/") or ".." in a.binary.split("/"):
                problems.append(f"binary must be a relative path inside the archive, got {a.binary!r} @ {where}.binary")
    return problems


def _check_build(version: str, build: EngineBuild, at: str) -> list[str]:
    problems = []
    if not version:
        problems.append(
            f'version "" means the operator\'s llama-server on each node, so there is nothing to build: give the '
            f"version this source is, or remove `build` @ {at}"
        )
    if not build.url.startswith(("https://", "http://")):
        problems.append(f"expected an http(s) URL, got {build.url!r} @ {at}.url")
    if not re.fullmatch(r"[0-9a-f]{64}", build.sha256):
        problems.append(f"sha256 must be 64 lowercase hex digits @ {at}.sha256")
    for key in ("size", "jobs"):
        if getattr(build, key) < 0:
            problems.append(f"must not be negative (0: {'not given' if key == 'size' else 'automatic'}) @ {at}.{key}")
    if build.timeout_s <= 0:
        problems.append(f"must be more than 0 seconds, got {build.timeout_s} @ {at}.timeout_s")
    return problems


def _check_gateway(gw: GatewaySection) -> list[str]:
    problems = []
    for key in ("connect_timeout_s", "first_byte_timeout_s", "read_timeout_s", "probe_interval_s", "probe_timeout_s"):
        if getattr(gw, key) <= 0:
            problems.append(f"must be more than 0 seconds, got {getattr(gw, key)} @ $.gateway.{key}")
    if gw.queue_timeout_s < 0:
        problems.append(f"must not be negative, got {gw.queue_timeout_s} @ $.gateway.queue_timeout_s")
    if gw.read_timeout_s < gw.first_byte_timeout_s:
        problems.append(
            f"read_timeout_s ({gw.read_timeout_s}) must be at least first_byte_timeout_s "
            f"({gw.first_byte_timeout_s}) @ $.gateway.read_timeout_s"
        )
    if gw.max_attempts < 1:
        problems.append(f"must be at least 1, got {gw.max_attempts} @ $.gateway.max_attempts")
    for key in ("max_queue", "max_outstanding_per_replica", "affinity_chars", "max_idle_per_replica"):
        if getattr(gw, key) < 0:
            problems.append(f"must not be negative, got {getattr(gw, key)} @ $.gateway.{key}")
    return problems


def _check_source(src: ModelSource, at: str, *, needed: bool) -> list[str]:
    if src.url and src.path:
        return [f"give either url or path, not both @ {at}"]
    if src.size < 0:
        return [f"must not be negative (0: not given), got {src.size} @ {at}.size"]
    if src.size and not src.url:
        return [f"size is the size of the file at url; give it with url, not path @ {at}.size"]
    if src.url:
        if not src.url.startswith(("https://", "http://")):
            return [f"expected an http(s) URL, got {src.url!r} @ {at}.url"]
        if not re.fullmatch(r"[0-9a-f]{64}", src.sha256):
            return [f"a url source needs sha256 = 64 lowercase hex digits @ {at}.sha256"]
    elif src.path:
        if not src.path.startswith("/"):
            return [f"path must be absolute on the nodes, got {src.path!r} @ {at}.path"]
    elif needed:
        return [f"needs url (with sha256) or path @ {at}"]
    return []


def _check_agent(cfg: AgentConfig) -> list[str]:
    problems = []
    if cfg.build_jobs < 0:
        problems.append(f"must not be negative (0: automatic), got {cfg.build_jobs} @ $.build_jobs")
    if cfg.build_cache and not cfg.build_cache.startswith("/"):
        problems.append(f"build_cache must be an absolute path, got {cfg.build_cache!r} @ $.build_cache")
    if not cfg.server.startswith("wss://"):
        problems.append(f"expected a wss:// URL of the control plane, got {cfg.server!r} @ $.server")
    for key in ("nvidia_smi", "ib_root", "sminfo"):  # the agent runs from / under systemd: relative means nothing
        if not getattr(cfg, key).startswith("/"):
            problems.append(f"{key} must be an absolute path, got {getattr(cfg, key)!r} @ $.{key}")
    if cfg.weights_dir and not cfg.weights_dir.startswith("/"):
        problems.append(f"weights_dir must be an absolute path, got {cfg.weights_dir!r} @ $.weights_dir")
    if cfg.node_id and not _NAME.match(cfg.node_id):
        problems.append(f"node id {cfg.node_id!r} may use only letters, digits, '.', '_' and '-' @ $.node_id")
    owner: dict[str, str] = {}
    for i, f in enumerate(cfg.fabrics):
        if not _NAME.match(f.name):
            problems.append(
                f"fabric name {f.name!r} may use only letters, digits, '.', '_' and '-' @ $.fabrics[{i}].name"
            )
        for a in f.adapters:
            if a in owner and owner[a] != f.name:
                problems.append(
                    f"adapter {a!r} is under fabrics {owner[a]!r} and {f.name!r}; an adapter belongs to one "
                    f"fabric (a replica given adapters on two fabrics hangs on its first all-reduce) "
                    f"@ $.fabrics[{i}].adapters"
                )
            owner.setdefault(a, f.name)
    return problems


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_ADAPTER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HOSTPORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}$")


def _read_toml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            str(path), ["file not found; create it (see docs/configuration.md) or pass --config"]
        ) from None
    except (PermissionError, IsADirectoryError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), [f"cannot be read: {exc.__class__.__name__}: {exc}"]) from None
    return parse_toml(text, str(path))


def parse_toml(text: str, label: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(label, [f"not valid TOML: {exc}"]) from None


def server_config_from_dict(data: dict, label: str = "server.toml") -> ServerConfig:
    cfg = _structure(data, ServerConfig, label)
    problems = _check_server(cfg)
    if problems:
        raise ConfigError(label, problems)
    return cfg


def agent_config_from_dict(data: dict, label: str = "agent.toml") -> AgentConfig:
    cfg = _structure(data, AgentConfig, label)
    problems = _check_agent(cfg)
    if problems:
        raise ConfigError(label, problems)
    return cfg


def load_server_config(path: Path) -> ServerConfig:
    return server_config_from_dict(_read_toml(path), str(path))


def load_agent_config(path: Path) -> AgentConfig:
    return agent_config_from_dict(_read_toml(path), str(path))


def to_dict(cfg: Any) -> dict:
    """The config as plain data, secrets redacted: safe to print and to log."""
    return converter.unstructure(cfg)
