"""Model versions: which definition of its model each replica runs, so that a changed model's
replicas are replaced one at a time (`llmgw.server.state.rollouts`) instead of all restarted in
place at once.

A version is a digest (`version_of`) of what makes a replica's engine command and weights: the
engine and its version in [engines], the args, the weights (url, sha256, size, path; a Hub
model's repository, commit and files), GPUs, nodes and memory per replica, cache events, and
whether it is started able to park. What only the gateways and the scheduler's count read
(routing, queues, replicas, idle_s) is not in it: changing those replaces nothing. Nor is the
token: a secret is neither hashed into a version nor written with a definition, and a replica of
an older version downloads with the catalog's token.

`ModelVersions` keeps the definition (`llmgw.config.Model`, without its token) of each version a
placement runs, by model and digest -- the catalog's and, while a rollout is under way, the
older ones -- so that a replica keeps its exact assignment until it is replaced, and gives them
to the store with the placements (`rows`; written in the same transaction,
`Store.set_placements`), so that a restarted control plane or a new leader knows what each
replica runs. A model whose rollout stopped is held (`hold`) at the version its replicas serve:
its new replicas get that version too, and it is not rolled again until the catalog's version
of it changes or an operator asks (`release`). Holds are the leader's own, in memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping

import attrs
import cattrs

from llmgw.config import EnginesSection, Model, Secret, converter, to_dict
from llmgw.engines import SPECS
from llmgw.log import get_logger

log = get_logger("llmgw.replicas")

SHOWN = 12  # the digits of a version shown to people


def parkable(model: Model, gpus_per_node: int) -> bool:
    """Whether a replica of `model` is started able to park (`EngineSpec.park`): its replicas
    follow the load, the catalog lets it (`park`), its engine can, and on GPUs (vLLM's sleep mode
    is CUDA's and ROCm's)."""
    spec = SPECS.get(model.engine)
    return model.scaled and model.park and spec is not None and spec.park is not None and gpus_per_node > 0


def engine_version(engines: EnginesSection, engine: str) -> str:
    """[engines]' version of `engine` ("" for the operator's own binary, or an engine it does not name)."""
    source = getattr(engines, engine, None)
    return getattr(source, "version", "") or ""


def version_of(model: Model, engine_version: str = "") -> str:
    """The digest of what a replica of `model` runs (see the module), `engine_version` being
    [engines]' version of its engine ("" where none is named)."""
    src = model.source
    what = {
        "engine": model.engine,
        "engine_version": engine_version,
        "args": list(model.args),
        "weights": {
            "url": src.url,
            "sha256": src.sha256.lower(),
            "size": src.size,
            "path": src.path,
            "hf": src.hf,
            "commit": src.commit,
            "files": [[f.path, f.size, f.sha256] for f in src.files],
        },
        "gpus_per_replica": model.gpus_per_replica,
        "nodes_per_replica": model.nodes_per_replica,
        "memory_gb": model.memory_gb,
        "cache_events": model.cache_events,
        "parkable": parkable(model, model.gpus_per_replica),
    }
    text = json.dumps(what, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def without_token(model: Model) -> Model:
    return model if model.source.token is None else attrs.evolve(model, source=attrs.evolve(model.source, token=None))


def with_token(model: Model, token: Secret | None) -> Model:
    """`model` downloading with `token` (the catalog's: a definition is kept without one)."""
    if model.source.token == token:
        return model
    return attrs.evolve(model, source=attrs.evolve(model.source, token=token))


def row_id(model: str, version: str) -> str:
    return f"{model}@{version}"  # '@' is in no model name (`llmgw.config.NAME`)


@attrs.frozen(kw_only=True)
class Hold:
    """A model held at the version its replicas serve, after a rollout to `target` stopped."""

    target: str  # the catalog's version that did not come up
    serving: str  # the version its replicas run, and its new ones get while held
    reason: str  # "update of coder stopped: ..."
    at: float  # unix time


class ModelVersions:
    """The definitions by (model, version) that placements run, and the models held."""

    def __init__(self, rows: Mapping[str, dict] | None = None) -> None:
        """`rows`: the store's (`rows`' format), read at open."""
        self.known: dict[tuple[str, str], Model] = {}
        self.holds: dict[str, Hold] = {}
        self._rows: dict[tuple[str, str], dict] = {}  # each definition's row, made once
        for key, body in (rows or {}).items():
            try:
                model = converter.structure(body["definition"], Model)
                self.known[(body["model"], body["version"])] = model
            except (KeyError, TypeError, ValueError, cattrs.BaseValidationError) as exc:
                log.error("model_version_unreadable", row=key, error=str(exc)[:200])

    def record(self, model: Model, version: str) -> None:
        """`model` is what `version` runs (the catalog's definition, or a held one's)."""
        key = (model.name, version)
        if key not in self.known:
            self.known[key] = without_token(model)

    def definition(self, model: str, version: str) -> Model | None:
        return self.known.get((model, version))

    def held(self, model: str, catalog_version: str) -> Hold | None:
        """The hold on `model`, if it still holds: a hold on an earlier catalog version is over
        (the model changed again: a new rollout may go)."""
        hold = self.holds.get(model)
        if hold is not None and hold.target != catalog_version:
            del self.holds[model]
            log.info("rollout_hold_over", model=model, reason="the model changed again")
            return None
        return hold

    def hold(self, model: str, hold: Hold) -> None:
        self.holds[model] = hold

    def release(self, model: str) -> bool:
        """Let a held model be rolled again (`llmgw ctl models update NAME --retry`); whether it was held."""
        return self.holds.pop(model, None) is not None

    def rows(self, in_use: Collection[tuple[str, str]]) -> dict[str, dict]:
        """The definitions `in_use` as the store keeps them (by `row_id`); the others no held
        model serves are forgotten."""
        keep = set(in_use) | {(m, h.serving) for m, h in self.holds.items()}
        for key in [k for k in self.known if k not in keep]:
            del self.known[key]
            self._rows.pop(key, None)
        out = {}
        for key in sorted(set(in_use) & self.known.keys()):
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = {"model": key[0], "version": key[1], "definition": to_dict(self.known[key])}
            out[row_id(*key)] = row
        return out
