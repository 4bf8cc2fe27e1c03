"""server.toml as the control plane runs it, and its one writer: a reload (`Settings.reread`).

`current` is read at each use and never kept: a reload replaces it. What a reload changes is the
engines and the catalog (`[engines]`, `[[models]]`); the sections read once at start (`FIXED`)
keep their running values, and a reload that finds them changed says which need a restart. A bad
file changes nothing: its problems are raised (`ConfigError`) and the running configuration stays.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from llmgw.config import ServerConfig, load_server_config
from llmgw.log import get_logger
from llmgw.server.errors import NoConfigFile

log = get_logger("llmgw.server")

FIXED = ("server", "store", "http", "ca", "gateway", "release", "debug")  # read once, at start


class Settings:
    def __init__(self, config: ServerConfig, path: Path | None = None) -> None:
        """`path`: the file it was read from (None: started without one, so nothing to reload)."""
        self.current = config
        self.path = path

    def reread(self) -> ServerConfig:
        """Read the file again and take its engines and catalog; the configuration now running.
        `NoConfigFile` without a file; `ConfigError` for a bad one (nothing changed)."""
        if self.path is None:
            raise NoConfigFile()
        new = load_server_config(self.path)
        changed_fixed = [f"[{name}]" for name in FIXED if getattr(new, name) != getattr(self.current, name)]
        if changed_fixed:
            log.warning("reload_ignores", sections=changed_fixed, fix="restart `llmgw server` for those")
        self.current = attrs.evolve(self.current, engines=new.engines, models=new.models)
        return self.current
