"""server.toml as the control plane runs it, and its one writer: a reload (`Settings.reread`).

`current` is read at each use and never kept: a reload replaces it. What a reload changes is the
engines and the catalog (`[engines]`, `[[models]]`); the sections read once at start (`FIXED`)
keep their running values, and a reload that finds them changed says which need a restart. A bad
file changes nothing: its problems are raised (`ConfigError`) and the running configuration stays.

The catalog running is server.toml's models and those added while the cluster runs (`llmgw ctl
models add`, kept in the store: `added`). Where both name a model, server.toml's wins: an added
model of that name is shadowed (and said so) until server.toml no longer names it; `ctl models
add` refuses a name server.toml uses.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from llmgw.config import Model, ServerConfig, load_server_config
from llmgw.log import get_logger
from llmgw.server.errors import NoConfigFile

log = get_logger("llmgw.server")

FIXED = ("server", "store", "http", "ca", "gateway", "release", "debug", "telemetry")  # read once, at start


class Settings:
    def __init__(self, config: ServerConfig, path: Path | None = None) -> None:
        """`path`: the file it was read from (None: started without one, so nothing to reload)."""
        self.current = config
        self.path = path
        self.file_models = config.models  # server.toml's, as last read
        self.added: dict[str, Model] = {}  # the models added from the Hub, by name

    def set_added(self, models: dict[str, Model]) -> None:
        """The models added while the cluster runs, as the store holds them now."""
        self.added = dict(models)
        self._merge()

    def shadowed(self) -> list[str]:
        """Added models that server.toml names too (server.toml's wins)."""
        names = {m.name for m in self.file_models}
        return sorted(n for n in self.added if n in names)

    def _merge(self) -> None:
        names = {m.name for m in self.file_models}
        extra = tuple(m for name, m in sorted(self.added.items()) if name not in names)
        self.current = attrs.evolve(self.current, models=self.file_models + extra)

    def reread(self) -> ServerConfig:
        """Read the file again and take its engines and catalog; the configuration now running.
        `NoConfigFile` without a file; `ConfigError` for a bad one (nothing changed)."""
        if self.path is None:
            raise NoConfigFile()
        new = load_server_config(self.path)
        changed_fixed = [f"[{name}]" for name in FIXED if getattr(new, name) != getattr(self.current, name)]
        if changed_fixed:
            log.warning("reload_ignores", sections=changed_fixed, fix="restart `llmgw server` for those")
        self.current = attrs.evolve(self.current, engines=new.engines, hub=new.hub)
        self.file_models = new.models
        self._merge()
        for name in self.shadowed():
            log.warning(
                "model_shadowed",
                model=name,
                fix="server.toml names it too, and its entry is served; remove one of them",
            )
        return self.current
