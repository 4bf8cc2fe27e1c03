"""The engines llmgw can start, by the name the catalog uses."""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.engines import llamacpp, sglang, sim, vllm
from llmgw.engines.errors import LaunchError
from llmgw.engines.launch import Command, ReplicaLaunch
from llmgw.engines.spec import EngineSpec

SPECS: dict[str, EngineSpec] = {s.name: s for s in (llamacpp.SPEC, vllm.SPEC, sglang.SPEC, sim.SPEC)}


def spec_for(engine: str) -> EngineSpec:
    try:
        return SPECS[engine]
    except KeyError:
        raise LaunchError(f"unknown engine {engine!r} (one of: {', '.join(SPECS)})") from None


def build_command(launch: ReplicaLaunch, executable: str | Sequence[str] | None = None) -> Command:
    """The command that starts `launch` with its engine; see `EngineSpec.build`."""
    return spec_for(launch.engine).build(launch, executable)
