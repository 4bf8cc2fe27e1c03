"""A gateway process's table in tests: the link's messages for sim engines (in memory or real
processes, `testlib.memnet.MemSim` or `testlib.gateway.Sim`) and keys made from known tokens, and
the same as a `--table-file` (`llmgw.gatewayd.tablefile`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmgw.gateway.keys import token_hash
from llmgw.wire.convert import converter
from llmgw.wire.gateway_link import GatewayKey, ModelInfo, RotationChanged, RouteEndpoint, ShareChanged

TOKEN = "llmgw-tests-token"  # the token of the key "tests"


def token_of(name: str) -> str:
    return TOKEN if name == "tests" else f"llmgw-{name}-token"


def key(name: str, **limits: Any) -> GatewayKey:
    """The key `name`, whose token is `token_of(name)`."""
    return GatewayKey(name=name, token_sha256=token_hash(token_of(name)), **limits)


def route(sim: Any, *, draining: bool = False) -> RouteEndpoint:
    """A sim engine as the rotation names it (anything with name, model, host, port and key)."""
    return RouteEndpoint(
        replica_id=sim.name, model=sim.model, host=sim.host, port=sim.port, api_key=sim.key, draining=draining
    )


def write_table_file(
    path: Path,
    sims: list[Any],
    *,
    models: tuple[str, ...] = ("chat",),
    keys: tuple[GatewayKey, ...] = (key("tests"),),
    share: ShareChanged | None = None,
    details: tuple[ModelInfo, ...] = (),
) -> Path:
    return write_table(path, tuple(route(s) for s in sims), models=models, keys=keys, share=share, details=details)


def write_table(
    path: Path,
    endpoints: tuple[RouteEndpoint, ...],
    *,
    models: tuple[str, ...],
    keys: tuple[GatewayKey, ...],
    share: ShareChanged | None = None,
    details: tuple[ModelInfo, ...] = (),
) -> Path:
    """The table `llmgw gateway --table-file` reads: that rotation (and what it says of each
    model, `details`), those keys, that share."""
    table: dict[str, Any] = {
        "rotation": converter.unstructure(RotationChanged(models=models, endpoints=endpoints, details=details)),
        "keys": [converter.unstructure(k) for k in keys],
    }
    if share is not None:
        table["share"] = converter.unstructure(share)
    path.write_text(json.dumps(table))
    return path
