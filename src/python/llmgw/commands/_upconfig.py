"""The server.toml of `llmgw up`: what its flags put in it, and what a later `up` changes.

`up` writes server.toml into its state directory the first time; the operator may edit it. A
later `up` keeps the operator's edits and changes only what its own flags decide, saying what
changed (never silently keeping a file that contradicts the flags):

- `--port N`: the gateway's port in `http_listen` (without --port, the saved port stays);
- `--fabric NAME` with `--nodes 2` or more: the model `sim-big`, whose one replica spans two
  nodes of the fabric; `up` removes the sim-big it added when a later run has no such fabric;
- `--model FILE.gguf`: a llama.cpp model named after the file; `up` removes the one it added
  when a later run serves another file or none;
- llama.cpp is wanted on the nodes (`[engines.llamacpp] enabled`) only while a model uses it or
  a llama-server is named (for a model added later from the Hub, `llmgw ctl models add --hf`),
  and then as the llama-server `--llama-server` names (`version = ""`): the local nodes run that
  one, so the control plane has no source to fetch and nothing is built.

Which models `up` added is kept next to the file (`up.json`), so a model the operator added is
never removed. A catalog this `up` can never serve (a model needing more nodes than it starts,
a llama.cpp model with no llama-server) is refused with the file's name and the fix. Pure: the
caller reads and writes the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import tomli_w

from llmgw.errors import UsageError

DEFAULT_PORT = 8080
SMALL = "sim-small"
BIG = "sim-big"


@attrs.frozen(kw_only=True)
class Shape:
    """What this `up` was asked for."""

    nodes: int
    port: int | None = None  # None: keep the saved port (DEFAULT_PORT in a new file)
    fabric: str | None = None
    gguf: Path | None = None  # absolute
    llama_server: bool = False  # a llama-server is named (--llama-server or $LLMGW_LLAMA_SERVER)

    @property
    def spans_nodes(self) -> bool:
        return self.fabric is not None and self.nodes >= 2


@attrs.frozen(kw_only=True)
class Planned:
    doc: dict[str, Any]  # server.toml, as TOML data
    owned: tuple[str, ...]  # the models `up` added and may remove
    changes: tuple[str, ...]  # what changed, for the operator; empty: nothing to write


def _big() -> dict[str, Any]:
    return {"name": BIG, "engine": "sim", "nodes_per_replica": 2}


def _gguf(path: Path) -> dict[str, Any]:
    return {"name": path.stem, "engine": "llamacpp", "source": {"path": str(path)}}


def first(state: Path, shape: Shape) -> Planned:
    """server.toml for a new state directory."""
    doc: dict[str, Any] = {
        "server": {
            "state_dir": str(state),
            "agent_listen": "127.0.0.1:0",
            "http_listen": f"127.0.0.1:{shape.port or DEFAULT_PORT}",
            "advertise": ["127.0.0.1"],
            "heartbeat_interval_s": 1.0,
            "heartbeat_ttl_s": 5.0,
        },
        "models": [{"name": SMALL, "engine": "sim", "replicas": 2}],
    }
    planned = update(doc, (SMALL,), shape, state / "server.toml")
    return attrs.evolve(planned, changes=())  # all of it is new: nothing to list


def legacy_owned(doc: dict[str, Any]) -> tuple[str, ...]:
    """For a state directory from before `up.json`: the models only `up` writes."""
    return tuple(
        m["name"]
        for m in doc.get("models", ())
        if m.get("name") in (SMALL, BIG) or (m.get("engine") == "llamacpp" and "path" in m.get("source", {}))
    )


def update(doc: dict[str, Any], owned: tuple[str, ...], shape: Shape, path: Path) -> Planned:
    """The saved server.toml changed as this `up`'s flags ask; UsageError if it cannot serve."""
    doc = _copy(doc)
    models: list[dict[str, Any]] = doc.setdefault("models", [])
    names = [m.get("name") for m in models]
    mine = [n for n in owned if n in names]  # a model the operator removed is no longer ours
    changes: list[str] = []

    if shape.port is not None:
        server = doc.setdefault("server", {})
        host, _, old = str(server.get("http_listen", f"127.0.0.1:{DEFAULT_PORT}")).rpartition(":")
        if old != str(shape.port):
            server["http_listen"] = f"{host or '127.0.0.1'}:{shape.port}"
            changes.append(f"gateway port {old} -> {shape.port} (--port)")

    if shape.spans_nodes and BIG not in names:
        models.append(_big())
        mine.append(BIG)
        changes.append(f"added model {BIG}: one replica across 2 nodes of fabric {shape.fabric}")
    elif not shape.spans_nodes and BIG in mine:
        models[:] = [m for m in models if m.get("name") != BIG]
        mine.remove(BIG)
        changes.append(
            f"removed model {BIG}: its replica spans 2 nodes of a fabric, and this `up` starts "
            f"{_started(shape)} (`--nodes 2 --fabric NAME` brings it back)"
        )

    served = {m.get("name"): m for m in models if m.get("engine") == "llamacpp"}
    for name in [n for n in mine if n in served]:
        if shape.gguf is None or name != shape.gguf.stem:
            models[:] = [m for m in models if m.get("name") != name]
            mine.remove(name)
            was = served[name].get("source", {}).get("path", "?")
            changes.append(f"removed model {name} ({was}): this `up` has no --model for it")
    if shape.gguf is not None:
        name, wanted = shape.gguf.stem, _gguf(shape.gguf)
        existing = next((m for m in models if m.get("name") == name), None)
        if existing is None:
            models.append(wanted)
            mine.append(name)
            changes.append(f"added model {name}: {shape.gguf} with llama.cpp (--model)")
        elif name not in mine or existing.get("engine") != "llamacpp":
            raise UsageError(
                f"--model {shape.gguf} would be served as model {name!r}, and {path} already has a model "
                f"of that name (engine {existing.get('engine')!r}); rename the file, or remove that model from "
                f"{path}, or use another --state-dir"
            )
        elif existing.get("source", {}).get("path") != str(shape.gguf):
            changes.append(f"model {name} now serves {shape.gguf} (was {existing.get('source', {}).get('path')})")
            existing["source"] = {"path": str(shape.gguf)}

    # A llama-server named: llama.cpp on the nodes, for a model added later (`ctl models add --hf`).
    wanted = shape.llama_server or any(m.get("engine") == "llamacpp" for m in models)
    changes.extend(_llamacpp_wanted(doc, wanted, shape.llama_server))
    _check_servable(models, shape, path)
    return Planned(doc=doc, owned=tuple(mine), changes=tuple(changes))


def _started(shape: Shape) -> str:
    nodes = f"{shape.nodes} node{'s' if shape.nodes != 1 else ''}"
    return f"{nodes} on fabric {shape.fabric}" if shape.fabric else f"{nodes} without --fabric"


def _llamacpp_wanted(doc: dict[str, Any], wanted: bool, named: bool) -> list[str]:
    """llama.cpp on the nodes only while a model needs it: otherwise each node would build it
    (minutes) for a cluster that never asked for it. `named`: a llama-server is named, which the
    nodes use (version ""), so the pinned source is neither fetched nor built."""
    engines = doc.setdefault("engines", {})
    table = engines.setdefault("llamacpp", {})
    was = table.get("enabled", True)
    if wanted:
        table.pop("enabled", None)
        if named:
            table.setdefault("version", "")
    else:
        table["enabled"] = False
    if not table:
        del engines["llamacpp"]
    if not engines:
        del doc["engines"]
    if was == wanted:
        return []
    return ["llama.cpp wanted on the nodes again (a model uses it)" if wanted else "llama.cpp off: no model uses it"]


def _check_servable(models: list[dict[str, Any]], shape: Shape, path: Path) -> None:
    for m in models:
        name, engine, span = m.get("name"), m.get("engine"), int(m.get("nodes_per_replica", 1))
        if engine == "sim" and span > 1 and (shape.fabric is None or span > shape.nodes):
            raise UsageError(
                f"model {name!r} in {path} needs {span} nodes on one fabric, and this `up` starts "
                f"{_started(shape)}: add `--nodes {max(span, shape.nodes)} --fabric NAME`, or remove the model "
                f"from {path}, or use another --state-dir"
            )
        if engine == "llamacpp" and not shape.llama_server:
            raise UsageError(
                f"model {name!r} in {path} runs on llama.cpp, and no llama-server is named: give "
                "--llama-server PATH or set $LLMGW_LLAMA_SERVER (tools/llama/build-llama-server builds one), "
                f"or remove the model from {path}"
            )


def render(doc: dict[str, Any], header: str) -> str:
    """The TOML text: [server], [engines], then each model as a `[[models]]` block, the way
    docs/configuration.md shows them (tomli_w alone would write the models as one inline array)."""
    rest = {k: v for k, v in doc.items() if k != "models"}
    order = {"server": 0, "engines": 1}
    text = tomli_w.dumps(dict(sorted(rest.items(), key=lambda kv: order.get(kv[0], 2))))
    for model in doc.get("models", ()):
        text += "\n[[models]]\n" + "".join(f"{k} = {_value(v)}\n" for k, v in model.items())
    return header + text


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + " }"
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
