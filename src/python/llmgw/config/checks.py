"""The rules of the configuration files that span fields or need more than a type: unique model
names, a known engine, a URL with its sha256, timeouts that agree, absolute paths on the nodes.

Each check returns its problems, each ending with its path (`... @ $.models[1].name`), instead of
raising, so that a file's type errors and rule problems are reported together.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from llmgw import pins
from llmgw.config import storeurl
from llmgw.config.schema import (
    ENGINES,
    EVENT_ENGINES,
    NAME,
    PIP_ENGINES,
    AgentConfig,
    AutoscaleSection,
    EngineBuild,
    EnginesSection,
    GatewaySection,
    Model,
    ModelSource,
    ServerConfig,
    TelemetrySection,
)

_HOSTPORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}$")


WEIGHTS_ORIGINS = ("node", "control_plane")


def check_server(cfg: ServerConfig) -> list[str]:
    problems = []
    if cfg.server.heartbeat_ttl_s <= cfg.server.heartbeat_interval_s:
        problems.append(
            f"heartbeat_ttl_s ({cfg.server.heartbeat_ttl_s}) must be longer than heartbeat_interval_s "
            f"({cfg.server.heartbeat_interval_s}) @ $.server.heartbeat_ttl_s"
        )
    rate = cfg.server.heartbeat_max_rate
    if not (math.isfinite(rate) and rate >= 0):
        problems.append(
            f"must be a number of heartbeats a second, 0 or more (0: every agent heartbeats every "
            f"heartbeat_interval_s however many there are), got {rate} @ $.server.heartbeat_max_rate"
        )
    elif rate and cfg.server.heartbeat_interval_s * rate < 1:
        problems.append(
            f"heartbeat_max_rate ({rate}) takes fewer than one agent at heartbeat_interval_s "
            f"({cfg.server.heartbeat_interval_s}); raise it, or 0 to turn stretching off @ $.server.heartbeat_max_rate"
        )
    keep = cfg.server.audit_keep_days
    if not (math.isfinite(keep) and keep >= 0):
        problems.append(
            f"must be a number of days, 0 or more (0: the audit log keeps every entry), got {keep} "
            "@ $.server.audit_keep_days"
        )
    for key in ("agent_listen", "http_listen"):
        value = getattr(cfg.server, key)
        if not _HOSTPORT.match(value):
            problems.append(f"expected HOST:PORT, got {value!r} @ $.server.{key}")
    for i, origin in enumerate(cfg.server.page_origins):
        found = _ORIGIN.match(origin)
        if not found or found.group(2) and not 0 < int(found.group(2)[1:]) < 65536:
            problems.append(
                f"expected an origin as a browser's address bar starts, http://HOST[:PORT] or https://HOST[:PORT] "
                f"with no path, got {origin!r} @ $.server.page_origins[{i}]"
            )
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
    problems.extend(storeurl.problems(cfg.store.url, cfg.store.password_file))
    problems.extend(_check_lease(cfg))
    problems.extend(_check_engines(cfg.engines))
    problems.extend(_check_gateway(cfg.gateway))
    problems.extend(_check_autoscale(cfg.autoscale))
    problems.extend(check_telemetry(cfg.telemetry))
    for key in ("max_archive_gib", "max_weights_gib"):
        if getattr(cfg.downloads, key) < 1:
            problems.append(f"must be at least 1 @ $.downloads.{key}")
    if cfg.downloads.weights_origin not in WEIGHTS_ORIGINS:
        problems.append(
            f"expected one of {', '.join(map(repr, WEIGHTS_ORIGINS))}, got {cfg.downloads.weights_origin!r} "
            "@ $.downloads.weights_origin"
        )
    if cfg.release.dir and not Path(cfg.release.dir).is_absolute():
        problems.append(f"expected an absolute path, got {cfg.release.dir!r} @ $.release.dir")
    seen: dict[str, int] = {}
    for i, m in enumerate(cfg.models):
        at = f"$.models[{i}]"
        if m.name in seen:
            problems.append(f"model name {m.name!r} is already used by $.models[{seen[m.name]}] @ {at}.name")
        seen.setdefault(m.name, i)
        if m.source.hf:
            problems.append(
                f"a model from the Hub is added with `llmgw ctl models add {m.name} --hf {m.source.hf}`, which pins "
                f"its commit and files; server.toml's models name a url or a path @ {at}.source.hf"
            )
        problems.extend(check_model(m, cfg.engines, at))
    return problems


def check_model(m: Model, engines: EnginesSection, at: str) -> list[str]:
    """The rules of one model, wherever it comes from (server.toml, or `llmgw ctl models add`,
    whose problems name the command's options by these paths)."""
    problems: list[str] = []
    if not NAME.match(m.name):
        problems.append(
            f"model name {m.name!r} may use only letters, digits, '.', '_' and '-' "
            f"and start with a letter or digit @ {at}.name"
        )
    if m.engine not in ENGINES:
        problems.append(f"unknown engine {m.engine!r} (one of: {', '.join(ENGINES)}) @ {at}.engine")
    if m.nodes_per_replica < 1:
        problems.append(f"must be at least 1 @ {at}.nodes_per_replica")
    problems.extend(_check_scale(m, at))
    if m.gpus_per_replica < 0 or m.memory_gb < 0:
        bad = "gpus_per_replica" if m.gpus_per_replica < 0 else "memory_gb"
        problems.append(f"must not be negative @ {at}.{bad}")
    source = getattr(engines, m.engine, None)
    if source is not None and not source.enabled:
        problems.append(
            f"model {m.name!r} uses {m.engine}, which [engines.{m.engine}] turns off (enabled = false); "
            f"remove that line or this model @ {at}.engine"
        )
    if m.routing not in ("", "prefix", "least_outstanding"):
        problems.append(
            f'unknown routing {m.routing!r}: "prefix" (where the prompt is cached), "least_outstanding", '
            f"or leave it out (prefix for engines with a prefix cache) @ {at}.routing"
        )
    if m.cache_events:
        if m.engine in ENGINES and m.engine not in EVENT_ENGINES:
            problems.append(
                f"{m.engine} publishes no KV-cache events ({' and '.join(EVENT_ENGINES)} do); remove cache_events "
                f"@ {at}.cache_events"
            )
        elif m.routing == "least_outstanding":
            problems.append(
                "cache_events serves routing by prefix, and this model is routed by load (routing = "
                f'"least_outstanding"); remove one of them @ {at}.cache_events'
            )
    # llama.cpp over several nodes (its RPC) needs ggml-rpc-server beside llama-server on every node:
    # the release's and llmgw's own builds have it; one the operator installed (version "",
    # llamacpp_bin, archives) may not, which only its node can tell: its agent reports the replica
    # failed, with the fix.
    problems.extend(_check_source(m.source, f"{at}.source", needed=m.engine != "sim"))
    return problems


def _check_scale(m: Model, at: str) -> list[str]:
    """replicas, min_replicas, max_replicas, idle_s and the model's queue: each problem naming the fix."""
    if not m.scaled:
        if m.replicas < 1:
            return [
                f"must be at least 1 @ {at}.replicas (a model with no replica while unused: min_replicas = 0 and "
                "max_replicas = 1, see docs/configuration.md)"
            ]
        problems = []
    else:
        low, high = m.bounds
        problems = []
        if m.min_replicas is not None and m.min_replicas < 0:
            problems.append(f"must not be negative, got {m.min_replicas} @ {at}.min_replicas")
        if m.max_replicas is not None and m.max_replicas < 1:
            problems.append(f"must be at least 1, got {m.max_replicas} @ {at}.max_replicas")
        if not problems and low > high:
            problems.append(f"min_replicas ({low}) is more than max_replicas ({high}) @ {at}.max_replicas")
        if not problems and not low <= m.replicas <= high:
            problems.append(
                f"replicas ({m.replicas}) is the count the model starts with, between min_replicas ({low}) and "
                f"max_replicas ({high}); set it in that range (0 starts none until the first request) @ {at}.replicas"
            )
        if not m.idle_s > 0:
            problems.append(f"must be more than 0 seconds, got {m.idle_s} @ {at}.idle_s")
    if m.max_queue < 0:
        problems.append(f"must not be negative (0: [gateway] max_queue), got {m.max_queue} @ {at}.max_queue")
    if m.queue_timeout_s < 0:
        problems.append(
            f"must not be negative (0: [gateway] queue_timeout_s), got {m.queue_timeout_s} @ {at}.queue_timeout_s"
        )
    return problems


def _check_autoscale(a: AutoscaleSection) -> list[str]:
    problems = []
    for key in ("target_per_replica", "up_after_s", "down_after_s", "interval_s"):
        if not getattr(a, key) > 0:
            problems.append(f"must be more than 0, got {getattr(a, key)} @ $.autoscale.{key}")
    if not 0 < a.down_margin <= 1:
        problems.append(
            f"must be more than 0 and at most 1 (one fewer replica once the load is under this share of the target), "
            f"got {a.down_margin} @ $.autoscale.down_margin"
        )
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


_OTLP_URL = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:\d{1,5})?(/[^\s?#]*)?$")


def check_telemetry(tel: TelemetrySection, at: str = "$.telemetry") -> list[str]:
    """`[telemetry]`'s rules (server.toml's, and the file of `llmgw gateway --telemetry`)."""
    problems = []
    if tel.otlp_endpoint and not _OTLP_URL.match(tel.otlp_endpoint):
        problems.append(
            "expected a collector's OTLP/HTTP base URL, http://HOST:PORT or https://HOST:PORT[/PATH] "
            f"(/v1/traces is appended), got {tel.otlp_endpoint!r} @ {at}.otlp_endpoint"
        )
    if not (math.isfinite(tel.sample_ratio) and 0 <= tel.sample_ratio <= 1):
        problems.append(
            f"expected the share of requests traced, from 0 to 1, got {tel.sample_ratio} @ {at}.sample_ratio"
        )
    if not (math.isfinite(tel.timeout_s) and tel.timeout_s > 0):
        problems.append(f"must be more than 0 seconds, got {tel.timeout_s} @ {at}.timeout_s")
    if not tel.service_name:
        problems.append(f"must not be empty @ {at}.service_name")
    if tel.headers_file and not Path(tel.headers_file).is_absolute():
        problems.append(f"expected an absolute path, got {tel.headers_file!r} @ {at}.headers_file")
    return problems


def _check_gateway(gw: GatewaySection) -> list[str]:
    problems = []
    for key in (
        "connect_timeout_s",
        "first_byte_timeout_s",
        "read_timeout_s",
        "probe_interval_s",
        "probe_timeout_s",
        "stream_stall_s",
    ):
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
    for key in ("max_queue", "max_outstanding_per_replica", "max_idle_per_replica", "max_migrations"):
        if getattr(gw, key) < 0:
            problems.append(f"must not be negative, got {getattr(gw, key)} @ $.gateway.{key}")
    if gw.affinity_chars:
        problems.append(
            'affinity_chars is gone: models are routed by prefix now (each model\'s routing = "prefix", the '
            "default for llama.cpp, vLLM and SGLang; docs/gateway.md); remove this line @ $.gateway.affinity_chars"
        )
    for key in ("prefix_block_chars", "prefix_max_chars", "prefix_table_entries"):
        if getattr(gw, key) < 1:
            problems.append(f"must be at least 1, got {getattr(gw, key)} @ $.gateway.{key}")
    if gw.prefix_max_chars < gw.prefix_block_chars:
        problems.append(
            f"prefix_max_chars ({gw.prefix_max_chars}) must be at least prefix_block_chars "
            f"({gw.prefix_block_chars}) @ $.gateway.prefix_max_chars"
        )
    if gw.prefix_load_factor < 1:
        problems.append(
            f"must be at least 1 (1: a cache-holding replica may have one request more than the least "
            f"loaded), got {gw.prefix_load_factor} @ $.gateway.prefix_load_factor"
        )
    return problems


# A path in a Hub repository as a node stores it: segments of plain names, nothing that climbs.
_REPO_PATH = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._+-]{0,199}/){0,4}[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")


def check_repo_path(path: str) -> bool:
    return bool(_REPO_PATH.match(path)) and ".." not in path.split("/")


def _check_hub_source(src: ModelSource, at: str) -> list[str]:
    problems = []
    if src.url or src.path:
        problems.append(f"a model from the Hub names no url or path @ {at}")
    if not re.fullmatch(r"[0-9a-f]{40}", src.commit):
        problems.append(f"a model from the Hub is pinned to a commit (40 lowercase hex digits) @ {at}.commit")
    if not src.files:
        problems.append(f"a model from the Hub lists the files its engine needs @ {at}.files")
    for j, f in enumerate(src.files):
        if not check_repo_path(f.path):
            problems.append(f"file path {f.path!r} is not a plain relative path @ {at}.files[{j}].path")
        if not re.fullmatch(r"[0-9a-f]{64}", f.sha256):
            problems.append(f"needs its sha256 as 64 lowercase hex digits @ {at}.files[{j}].sha256")
        if f.size < 0:
            problems.append(f"must not be negative @ {at}.files[{j}].size")
    return problems


def _check_source(src: ModelSource, at: str, *, needed: bool) -> list[str]:
    if src.hf:
        return _check_hub_source(src, at)
    if src.files or src.commit:
        return [f"files and commit belong to a model from the Hub (hf) @ {at}"]
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


def _check_lease(cfg: ServerConfig) -> list[str]:
    problems = []
    store, server = cfg.store, cfg.server
    if not 0 < store.lease_renew_s <= 60:
        problems.append(
            f"must be more than 0 and at most 60 seconds, got {store.lease_renew_s} @ $.store.lease_renew_s"
        )
    elif not 2 * store.lease_renew_s <= store.lease_ttl_s <= 600:
        problems.append(
            f"must be at least twice lease_renew_s ({store.lease_renew_s}), so that one renewal may fail without "
            f"losing the lease, and at most 600 seconds; got {store.lease_ttl_s} @ $.store.lease_ttl_s"
        )
    if server.agent_url and not _WSS.match(server.agent_url):
        problems.append(
            f"expected wss://HOST:PORT (this control plane's agent_listen, as others reach it), got "
            f"{server.agent_url!r} @ $.server.agent_url"
        )
    if server.admin_url and not _HTTP.match(server.admin_url):
        problems.append(
            f"expected http://HOST:PORT or https://HOST:PORT (its admin API, as others reach it), got "
            f"{server.admin_url!r} @ $.server.admin_url"
        )
    return problems


LLAMACPP_BACKENDS = ("auto", "cpu", "vulkan")  # agent.toml's llamacpp_backend
_WSS = re.compile(r"^wss://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}$")
_HTTP = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}$")
_ORIGIN = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:\d{1,5})?$")


def check_agent(cfg: AgentConfig) -> list[str]:
    problems = []
    if cfg.build_jobs < 0:
        problems.append(f"must not be negative (0: automatic), got {cfg.build_jobs} @ $.build_jobs")
    if cfg.build_cache and not cfg.build_cache.startswith("/"):
        problems.append(f"build_cache must be an absolute path, got {cfg.build_cache!r} @ $.build_cache")
    if cfg.llamacpp_backend not in LLAMACPP_BACKENDS:
        problems.append(
            f"expected one of {', '.join(LLAMACPP_BACKENDS)}, got {cfg.llamacpp_backend!r} @ $.llamacpp_backend"
        )
    if isinstance(cfg.server, tuple):
        if not cfg.server:
            problems.append("expected a wss:// URL of the control plane, or a list of every control plane's @ $.server")
        for i, url in enumerate(cfg.server):
            if not url.startswith("wss://"):
                problems.append(f"expected a wss:// URL of a control plane, got {url!r} @ $.server[{i}]")
            elif url in cfg.server[:i]:
                problems.append(f"{url!r} is named twice @ $.server[{i}]")
    elif not cfg.server.startswith("wss://"):
        problems.append(f"expected a wss:// URL of the control plane, got {cfg.server!r} @ $.server")
    for key in ("nvidia_smi", "ib_root", "sminfo"):  # the agent runs from / under systemd: relative means nothing
        if not getattr(cfg, key).startswith("/"):
            problems.append(f"{key} must be an absolute path, got {getattr(cfg, key)!r} @ $.{key}")
    if not (math.isfinite(cfg.weights_cache_gib) and cfg.weights_cache_gib >= 0):
        problems.append(
            f"must be a size in GiB, 0 or more (0: no limit but the disk's), got {cfg.weights_cache_gib} "
            "@ $.weights_cache_gib"
        )
    if cfg.weights_dir and not cfg.weights_dir.startswith("/"):
        problems.append(f"weights_dir must be an absolute path, got {cfg.weights_dir!r} @ $.weights_dir")
    if cfg.node_id and not NAME.match(cfg.node_id):
        problems.append(f"node id {cfg.node_id!r} may use only letters, digits, '.', '_' and '-' @ $.node_id")
    owner: dict[str, str] = {}
    for i, f in enumerate(cfg.fabrics):
        if not NAME.match(f.name):
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
