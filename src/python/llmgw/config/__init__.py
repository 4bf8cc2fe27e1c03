"""The two configuration files, `server.toml` and `agent.toml`: their types and how they load.

    schema    one frozen, keyword-only attrs class per table, with its defaults; `Secret`
    convert   the one cattrs converter: refuses unknown keys, takes nothing loosely
    checks    the rules that span fields (unique model names, a known engine, agreeing timeouts)
    load      TOML in, a checked config out, or one `ConfigError` with every problem at once

Loading reports every problem of a file together, each with its path (`expected int @
$.models[0].replicas`): type errors come from the converter, rule problems from the checks,
which return problems instead of raising. Everything is imported from here (`llmgw.config`); the
modules are the rooms it is kept in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from llmgw.config.schema import (
    ADAPTER,
    DEFAULT_AGENT_STATE_DIR,
    DEFAULT_BUILD_TIMEOUT_S,
    DEFAULT_IB_ROOT,
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_UNPACKED_BYTES,
    DEFAULT_NVIDIA_SMI,
    DEFAULT_SERVER_STATE_DIR,
    DEFAULT_SMINFO,
    DEFAULT_VLLM_VERSION,
    ENGINES,
    NAME,
    PINNED_LLAMACPP_BUILD,
    PIP_ENGINES,
    AgentConfig,
    AutoscaleSection,
    CASection,
    DebugSection,
    DownloadsSection,
    EngineArchive,
    EngineBuild,
    EngineSource,
    EnginesSection,
    FabricDecl,
    GatewaySection,
    HttpSection,
    HubSection,
    Limits,
    LlamacppSource,
    Model,
    ModelFile,
    ModelSource,
    ReleaseSection,
    Secret,
    ServerConfig,
    ServerSection,
    StoreSection,
    TelemetrySection,
    VllmSource,
    control_planes,
    parse_fabric_flag,
    pip_requirement,
    weights_cache_bytes_of,
    weights_dir_of,
)

# The converter and the loaders are imported when first asked for (PEP 562): a process that reads
# no config file but uses the schema's classes (a sim engine's HTTP stack takes its Limits from
# here) is spared cattrs and the checks, 0.06 CPU-s of its start.
_LAZY = {
    "converter": "llmgw.config.convert",
    "to_dict": "llmgw.config.convert",
    "agent_config_from_dict": "llmgw.config.load",
    "load_agent_config": "llmgw.config.load",
    "load_server_config": "llmgw.config.load",
    "parse_toml": "llmgw.config.load",
    "server_config_from_dict": "llmgw.config.load",
}
if TYPE_CHECKING:
    from llmgw.config.convert import converter, to_dict
    from llmgw.config.load import (
        agent_config_from_dict,
        load_agent_config,
        load_server_config,
        parse_toml,
        server_config_from_dict,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ADAPTER",
    "AgentConfig",
    "AutoscaleSection",
    "CASection",
    "DEFAULT_AGENT_STATE_DIR",
    "DEFAULT_BUILD_TIMEOUT_S",
    "DEFAULT_IB_ROOT",
    "DEFAULT_MAX_MEMBERS",
    "DEFAULT_MAX_UNPACKED_BYTES",
    "DEFAULT_NVIDIA_SMI",
    "DEFAULT_SERVER_STATE_DIR",
    "DEFAULT_SMINFO",
    "DEFAULT_VLLM_VERSION",
    "DebugSection",
    "DownloadsSection",
    "ENGINES",
    "EngineArchive",
    "EngineBuild",
    "EngineSource",
    "EnginesSection",
    "FabricDecl",
    "GatewaySection",
    "HttpSection",
    "HubSection",
    "Limits",
    "LlamacppSource",
    "Model",
    "ModelFile",
    "ModelSource",
    "NAME",
    "PINNED_LLAMACPP_BUILD",
    "PIP_ENGINES",
    "ReleaseSection",
    "Secret",
    "ServerConfig",
    "ServerSection",
    "StoreSection",
    "TelemetrySection",
    "VllmSource",
    "agent_config_from_dict",
    "control_planes",
    "converter",
    "load_agent_config",
    "load_server_config",
    "parse_fabric_flag",
    "parse_toml",
    "pip_requirement",
    "server_config_from_dict",
    "to_dict",
    "weights_cache_bytes_of",
    "weights_dir_of",
]
