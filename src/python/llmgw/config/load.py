"""Loading the configuration files: TOML text in, a checked `ServerConfig` or `AgentConfig` out,
or one `ConfigError` with every problem of the file (its types, then its rules)."""

from __future__ import annotations

import sys
from pathlib import Path

from llmgw.config.checks import check_agent, check_server
from llmgw.config.convert import structure
from llmgw.config.schema import AgentConfig, ServerConfig
from llmgw.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on the nodes' 3.10
    import tomli as tomllib


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
    cfg = structure(data, ServerConfig, label)
    problems = check_server(cfg)
    if problems:
        raise ConfigError(label, problems)
    return cfg


def agent_config_from_dict(data: dict, label: str = "agent.toml") -> AgentConfig:
    cfg = structure(data, AgentConfig, label)
    problems = check_agent(cfg)
    if problems:
        raise ConfigError(label, problems)
    return cfg


def load_server_config(path: Path) -> ServerConfig:
    return server_config_from_dict(_read_toml(path), str(path))


def load_agent_config(path: Path) -> AgentConfig:
    return agent_config_from_dict(_read_toml(path), str(path))
