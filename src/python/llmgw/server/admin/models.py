"""The models added while the cluster runs (`llmgw ctl models add|remove|search`, the admin
API's /admin/v1/models): their one owner, `HubModels`.

An add resolves the request against the Hub (`llmgw.hub.resolve`: commit, files, estimate),
refuses a model that fits no node or fabric of the cluster, then writes the store (the leader's
fence refuses a standby's write), and only then changes the catalog running (`Settings.added`)
and posts a catalog change: the reconciler places its replicas and pushes the nodes, the
gateways' rotation names it. A failure at any step leaves the catalog as it was. A remove is the
same in reverse: the replicas stop at the next pass, and the nodes free the files no model of
the catalog names any more (`DesiredState.keep_files`). An update (`llmgw ctl models update NAME
--revision REV --args ... --engine E`) resolves the model again with what changed, checks it as
an add does and replaces its entry: its replicas are then replaced one at a time by its rollout
(`llmgw.server.state.rollouts`); `--retry` asks a held rollout to go again (any model's, also one
of server.toml's).

A gated repository's token is sealed in the store like the engine keys (`KeySeal`, with
"model:NAME" as associated data); it reaches only the agents that download the files, in the
desired state, and is never shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
import trio

from llmgw.config import Model, Secret, converter, to_dict
from llmgw.config.checks import check_model
from llmgw.engines.registry import SPECS
from llmgw.errors import LlmgwError, MachineError, UsageError
from llmgw.hub.client import HubClient, RepoMatch
from llmgw.hub.files import gguf_choices
from llmgw.hub.resolve import AddRequest, Resolved, resolve
from llmgw.log import get_logger
from llmgw.server.settings import Settings
from llmgw.server.state.catalogtimes import CatalogTimes
from llmgw.server.state.changes import Changes
from llmgw.server.state.closeness import group_kinds
from llmgw.server.state.liveness import Reconciler
from llmgw.server.state.scheduler import NodeView, model_files
from llmgw.server.state.staging import Staging
from llmgw.server.state.versions import version_of
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.server.store.core import HubModelRow
from llmgw.server.store.keyseal import KeySeal

log = get_logger("llmgw.server")

GIB = 1 << 30
SEARCH_DETAILED = 5  # a search lists every match; the first this many with their files' sizes


class UnknownModel(UsageError):
    """No model of that name in the catalog."""


class ModelExists(UsageError):
    """The catalog has a model of that name already."""


class ModelDoesNotFit(UsageError):
    """No node (or fabric) of the cluster could ever hold a replica of the model."""


def _model_from(body: dict[str, Any]) -> Model:
    return converter.structure(body["model"], Model)


class HubModels:
    def __init__(
        self,
        *,
        settings: Settings,
        store: AsyncStore,
        key_seal: KeySeal,
        changes: Changes,
        reconciler: Reconciler,
        node_views: Callable[[], Sequence[NodeView]],
        catalog_times: CatalogTimes | None = None,
        client: Callable[[], HubClient] | None = None,
        staging: Staging | None = None,
        retry: Callable[[str], bool] = lambda name: False,
    ) -> None:
        """`node_views()`: the nodes as placement sees them now; `client()`: the Hub client for
        [hub] as configured now (a reload may change it); `retry(name)`: a held rollout of the
        model goes again (`Rollouts.retry`; whether one was held)."""
        self.settings = settings
        self.store = store
        self.key_seal = key_seal
        self.changes = changes
        self.reconciler = reconciler
        self.node_views = node_views
        self.catalog_times = catalog_times
        self.client = client or (lambda: hub_client(settings))
        self.staging = staging or Staging()
        self.retry = retry
        self.estimates: dict[str, dict[str, Any]] = {}  # name -> the estimate's parts, for views
        self.chosen: dict[str, dict[str, Any]] = {}  # name -> how its files were chosen, for an update
        self._lock = trio.Lock()  # one add or remove at a time: the name checks hold until the write

    def load(self, rows: Sequence[HubModelRow]) -> None:
        """The store's models at start (or at a leader's takeover), into the catalog running."""
        added = {}
        for row in rows:
            try:
                model = _model_from(row.body)
            except (KeyError, TypeError, ValueError, cattrs.BaseValidationError) as exc:  # said, and left in the store
                log.error("hub_model_unreadable", model=row.name, error=str(exc)[:200])
                continue
            token = self.key_seal.open(f"model:{row.name}", row.sealed_token) if row.sealed_token else None
            if token is not None:
                model = _with_token(model, Secret(token))
            added[row.name] = model
            self.estimates[row.name] = dict(row.body.get("estimate") or {})
            self.chosen[row.name] = _chosen(row.body)
        self.settings.set_added(added)
        for name in self.settings.shadowed():
            log.warning("model_shadowed", model=name, fix="server.toml names it too, and its entry is served")

    async def add(self, req: AddRequest, token: Secret | None = None) -> dict[str, Any]:
        async with self._lock:
            self._check_name_free(req.name)
            client = self.client()
            if token is not None:
                client = client.with_token(token)
            if req.engine:
                _check_args(req.engine, req.args)
            resolved = await resolve(client, req)
            model = resolved.model
            _check_args(model.engine, model.args)
            problems = check_model(model, self.settings.current.engines, "$")
            if problems:
                raise UsageError("; ".join(_option_named(p) for p in problems))
            refusal = capacity_refusal(model, resolved.estimate.per_gpu, self.node_views())
            if refusal:
                raise ModelDoesNotFit(f"{model.name} ({_size(resolved)}) fits no node of this cluster: {refusal}")
            self._check_name_free(req.name)  # server.toml reloaded meanwhile
            estimate = _estimate_view(resolved)
            chosen = {"quant": resolved.quant, "file": req.file, "memory_gb": req.memory_gb}
            row = HubModelRow(
                name=model.name,
                body={"model": to_dict(model), "estimate": estimate, **chosen},
                sealed_token=self.key_seal.seal(f"model:{model.name}", token.reveal()) if token else "",
                added_at=time.time(),
            )
            if not await self.store.add_hub_model(row):
                raise ModelExists(f"the store has a model named {model.name} already (added by another control plane?)")
            self.estimates[model.name] = estimate
            self.chosen[model.name] = chosen
            self.settings.set_added({**self.settings.added, model.name: _with_token(model, token) if token else model})
        log.info(
            "model_added",
            model=model.name,
            hf=req.hf,
            commit=model.source.commit,
            files=len(model.source.files),
            bytes=sum(f.size for f in model.source.files),
            memory_gb=model.memory_gb,
        )
        await self._catalog_changed([model.name])
        return self.view(model)

    async def update(
        self,
        name: str,
        *,
        revision: str = "",
        engine: str = "",
        args: Sequence[str] | None = None,
        retry: bool = False,
    ) -> dict[str, Any]:
        """Change a model added from the Hub: another revision (pinned to its commit), engine or
        args; the rest as it was. Its replicas are replaced one at a time (its rollout). `retry`:
        a rollout held after a failure goes again (for any model of the catalog)."""
        changing = bool(revision or engine or args is not None)
        changed = False
        async with self._lock:
            model = self.settings.added.get(name)
            if model is None or name in self.settings.shadowed():
                if not any(m.name == name for m in self.settings.file_models):
                    raise UnknownModel(f"the catalog has no model {name} (`llmgw ctl models` lists them)")
                if changing:
                    raise UsageError(
                        f"{name} is in server.toml's [[models]]: change it there and `llmgw ctl reload` (its "
                        "replicas are replaced one at a time as well)"
                    )
                model = None
            elif changing:
                was = model
                model = await self._updated(model, revision=revision, engine=engine, args=args)
                changed = version_of(model) != version_of(was)
            elif not retry:
                raise UsageError("say what to change: --revision REV, --engine E or --args ..., or --retry")
        retried = self.retry(name) if retry else False
        if model is not None and changing:
            log.info(
                "model_updated",
                model=name,
                commit=model.source.commit,
                engine=model.engine,
                args=list(model.args),
                changed=changed,
            )
        await self._catalog_changed([])
        shown = model or next(m for m in self.settings.current.models if m.name == name)
        view = self.view(shown) if model is not None else {"model": name, "engine": shown.engine}
        return {**view, "args": list(shown.args), "changed": changed, "retried": retried}

    async def _updated(self, model: Model, *, revision: str, engine: str, args: Sequence[str] | None) -> Model:
        """Under the lock: `model` resolved again with what changed, checked, written to the store
        and put in the catalog running; the new entry."""
        chosen = self.chosen.get(model.name, {})
        engine = engine or model.engine
        args = tuple(args) if args is not None else model.args
        _check_args(engine, args)
        client = self.client()
        if model.source.token is not None:
            client = client.with_token(model.source.token)
        req = AddRequest(
            name=model.name,
            hf=model.source.hf,
            revision=revision or model.source.revision,
            # The files chosen as they were at the add (the quantisation, or the pattern), unless
            # the engine changed, which takes other files (GGUF or safetensors).
            file=chosen.get("file", "") if engine == model.engine else "",
            quant=chosen.get("quant", "") if engine == model.engine and not chosen.get("file") else "",
            engine=engine,
            replicas=model.replicas,
            gpus_per_replica=model.gpus_per_replica,
            nodes_per_replica=model.nodes_per_replica,
            memory_gb=chosen.get("memory_gb", 0.0),
            args=args,
            routing=model.routing,
        )
        resolved = await resolve(client, req)
        new = attrs.evolve(
            model,
            engine=resolved.model.engine,
            source=attrs.evolve(resolved.model.source, token=model.source.token),
            memory_gb=resolved.model.memory_gb,
            args=args,
        )
        problems = check_model(new, self.settings.current.engines, "$")
        if problems:
            raise UsageError("; ".join(_option_named(p) for p in problems))
        refusal = capacity_refusal(new, resolved.estimate.per_gpu, self.node_views())
        if refusal:
            raise ModelDoesNotFit(f"{new.name} ({_size(resolved)}) fits no node of this cluster: {refusal}")
        estimate = _estimate_view(resolved)
        chosen = {"quant": resolved.quant, "file": req.file, "memory_gb": req.memory_gb}
        token = model.source.token
        row = HubModelRow(
            name=new.name,
            body={"model": to_dict(new), "estimate": estimate, **chosen},
            sealed_token=self.key_seal.seal(f"model:{new.name}", token.reveal()) if token else "",
            added_at=time.time(),  # kept as it was: the store changes the body and the token only
        )
        if not await self.store.update_hub_model(row):
            raise UnknownModel(f"the store has no model {new.name} (removed by another control plane?)")
        self.estimates[new.name] = estimate
        self.chosen[new.name] = chosen
        self.settings.set_added({**self.settings.added, new.name: new})
        return new

    async def remove(self, name: str) -> dict[str, Any]:
        async with self._lock:
            if name not in self.settings.added:
                if any(m.name == name for m in self.settings.file_models):
                    raise UsageError(f"{name} is in server.toml's [[models]]; remove it there and `llmgw ctl reload`")
                raise UnknownModel(f"the catalog has no model {name} (`llmgw ctl models` lists them)")
            if not await self.store.remove_hub_model(name):
                log.warning("hub_model_not_in_store", model=name)
            added = dict(self.settings.added)
            del added[name]
            self.settings.set_added(added)
            self.estimates.pop(name, None)
            self.staging.forget(name)
        log.info("model_removed", model=name)
        await self._catalog_changed([])
        return {"removed": name}

    async def stage(self, name: str, nodes: Sequence[str]) -> dict[str, Any]:
        """Have `nodes` download `name`'s files now, ahead of its replicas (any catalog model
        with files to download: from the Hub, or a url)."""
        model = next((m for m in self.settings.current.models if m.name == name), None)
        if model is None:
            raise UnknownModel(f"the catalog has no model {name} (`llmgw ctl models` lists them)")
        if not model_files(model):
            raise UsageError(
                f"{name}'s weights are a path on the nodes ({model.source.path or 'none'}): there is nothing to stage"
            )
        views = {n.node_id: n for n in self.node_views()}
        unknown = sorted(set(nodes) - set(views))
        if unknown:
            raise UsageError(f"no node {', '.join(unknown)} in the cluster; `llmgw ctl nodes` lists them")
        asked = self.staging.add(model, nodes, lambda node: views[node].holds)
        for node in asked:
            self.changes.intent_changed(node)
        if asked:
            await self.reconciler.next_pass()  # their agents have been told
        return {"model": name, "staging": asked, "holding": sorted(set(nodes) - set(asked))}

    async def search(self, text: str, *, limit: int = 20) -> list[dict[str, Any]]:
        if not text.strip():
            raise UsageError("give some text to search for, e.g. `llmgw ctl models search qwen gguf`")
        client = self.client()
        matches = await trio.to_thread.run_sync(lambda: client.search(text, limit=limit))
        nodes = self.node_views()
        out = []
        for i, match in enumerate(matches):
            entry: dict[str, Any] = {"repo": match.repo, "downloads": match.downloads, "likes": match.likes}
            if i < SEARCH_DETAILED:
                try:
                    entry["choices"] = await self._choices(client, match, nodes)
                except LlmgwError as exc:
                    entry["error"] = str(exc)
            else:
                entry["files"] = len(match.files)
            out.append(entry)
        return out

    async def _choices(self, client: HubClient, match: RepoMatch, nodes: Sequence[NodeView]) -> list[dict[str, Any]]:
        rev = await trio.to_thread.run_sync(lambda: client.revision(match.repo, "main"))
        out = []
        for c in gguf_choices(rev.files):
            # A rough need before any header is read: the weights and a tenth more (the add sizes it exactly).
            need = int(c.size * 1.1) + (256 << 20)
            fits = [n.node_id for n in nodes if n.alive and n.memory_bytes >= need]
            out.append(
                {
                    "engine": "llamacpp",
                    "file": c.files[0].path,
                    "parts": len(c.files),
                    "quant": c.quant,
                    "bytes": c.size,
                    "approx_memory_bytes": need,
                    "fits_on": fits,
                }
            )
        shards = [f for f in rev.files if "/" not in f.path and f.path.endswith(".safetensors")]
        if shards:
            size = sum(f.size for f in shards)
            # vLLM runs on GPUs: a rough need (the weights, a tenth more, 1 GiB of CUDA context and
            # graphs) against each node's GPU memory in all; the add sizes it from config.json.
            need = int(size * 1.1) + (1 << 30)
            fits = [n.node_id for n in nodes if n.alive and n.gpus and n.gpus * n.gpu_memory_bytes >= need]
            out.append(
                {
                    "engine": "vllm",
                    "file": "*.safetensors",
                    "parts": len(shards),
                    "quant": "",
                    "bytes": size,
                    "approx_memory_bytes": need,
                    "fits_on": fits,
                }
            )
        return out

    def detail(self, listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The catalog's views (`model_views`) with where each model comes from, and for one from
        the Hub its repository, commit, files and estimate."""
        out = []
        for v in listed:
            model = self.settings.added.get(v["model"])
            staged = {"staging_to": self.staging.view().get(v["model"], [])}
            if model is None or v["model"] in self.settings.shadowed():
                out.append({**v, **staged, "from": "server.toml"})
            else:
                out.append({**v, **self.view(model), **staged, "from": "hub"})
        return out

    def view(self, model: Model) -> dict[str, Any]:
        src = model.source
        return {
            "model": model.name,
            "engine": model.engine,
            "hf": src.hf,
            "revision": src.revision,
            "commit": src.commit,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in src.files],
            "bytes": sum(f.size for f in src.files),
            "replicas": model.replicas,
            "memory_gb": model.memory_gb,
            "estimate": self.estimates.get(model.name, {}),
            "token": "set" if src.token else "none",
        }

    def _check_name_free(self, name: str) -> None:
        if any(m.name == name for m in self.settings.file_models):
            raise ModelExists(
                f"server.toml's [[models]] has a model named {name}; pick another name, or remove it there first"
            )
        if name in self.settings.added:
            raise ModelExists(f"the catalog has a model named {name} already; `llmgw ctl models remove {name}` first")

    async def _catalog_changed(self, new: list[str]) -> None:
        self.changes.catalog_changed()
        await self.reconciler.next_pass()
        if self.catalog_times is not None and self.catalog_times.note(new):
            self.changes.rotation.fire()


def hub_client(settings: Settings) -> HubClient:
    """The client of [hub] as configured now, with its token_file's token if it names one."""
    hub = settings.current.hub
    token = None
    if hub.token_file:
        try:
            text = Path(hub.token_file).read_text().strip()
        except OSError as exc:
            raise MachineError(
                f"cannot read [hub] token_file {hub.token_file} ({exc.strerror}); fix the path or its permissions"
            ) from None
        token = Secret(text) if text else None
    return HubClient(hub.endpoint, token=token, timeout_s=hub.timeout_s)


def capacity_refusal(model: Model, per_gpu: int, nodes: Sequence[NodeView]) -> str:
    """Why no node (or fabric) of `nodes` could ever hold a replica of `model`, whatever else
    runs; "" if one could, or if the cluster has no node yet (nothing to judge by)."""
    live = [n for n in nodes if n.alive]
    if not live:
        return ""
    need = int(model.memory_gb * GIB)
    gpus = model.gpus_per_replica

    def holds(n: NodeView) -> bool:
        on_gpus = not gpus or not n.gpu_memory_bytes or n.gpu_memory_bytes >= per_gpu
        return n.memory_bytes >= need and n.gpus >= gpus and on_gpus

    fitting = [n for n in live if holds(n)]
    if model.nodes_per_replica == 1:
        if fitting:
            return ""
        if gpus:
            best = max(live, key=lambda n: (n.gpus >= gpus, n.gpu_memory_bytes))
            have = f"the best has {best.gpus} GPUs of {best.gpu_memory_bytes / GIB:.2f} GiB"
            want = f"{gpus} GPUs of {per_gpu / GIB:.2f} GiB each"
        else:
            best = max(live, key=lambda n: n.memory_bytes)
            have = f"the largest has {best.memory_bytes / GIB:.2f} GiB"
            want = f"{need / GIB:.2f} GiB of memory"
        return (
            f"a replica needs {want} on one node; {have}; add a larger node, quantise more (--quant), shorten the context (--args --ctx-size N), or give "
            "--memory-gb if the estimate is wrong"
        )
    by_group: dict[str, int] = {}
    for n in fitting:
        for g in n.groups(model):
            by_group[g] = by_group.get(g, 0) + 1
    if any(count >= model.nodes_per_replica for count in by_group.values()):
        return ""
    most, kinds = max(by_group.values(), default=0), group_kinds(model.engine)
    return (
        f"a replica needs {model.nodes_per_replica} nodes of {kinds} that each hold its share "
        f"({need / GIB:.2f} GiB{f', {gpus} GPUs of {per_gpu / GIB:.2f} GiB' if gpus else ''}); at most {most} do; "
        f"add nodes to that {kinds.removeprefix('one ')}, lower --nodes-per-replica, or give --memory-gb if the "
        "estimate is wrong"
    )


def _check_args(engine: str, args: Sequence[str]) -> None:
    """No argument may set what llmgw sets itself (the model's path, the port, the key); the rest
    is checked against the engine's own help by `llmgw ctl engine-check`."""
    if engine not in SPECS:
        raise UsageError(f"unknown engine {engine!r} (one of: {', '.join(SPECS)}) (--engine)")
    overriding = sorted({a.partition("=")[0] for a in args if a.startswith("-")} & SPECS[engine].managed)
    if overriding:
        raise UsageError(
            f"--args sets {', '.join(overriding)}, which llmgw sets itself for {engine}; remove it from the args"
        )


def _chosen(body: dict[str, Any]) -> dict[str, Any]:
    """How a stored model's files were chosen at its add (a row of an earlier llmgw has the
    quantisation only: the estimate sized it)."""
    memory = body.get("memory_gb", 0.0)
    return {
        "quant": str(body.get("quant") or ""),
        "file": str(body.get("file") or ""),
        "memory_gb": float(memory) if isinstance(memory, (int, float)) else 0.0,
    }


def _with_token(model: Model, token: Secret | None) -> Model:
    return attrs.evolve(model, source=attrs.evolve(model.source, token=token))


def _estimate_view(r: Resolved) -> dict[str, Any]:
    e = r.estimate
    return {
        "total_bytes": e.total,
        "per_gpu_bytes": e.per_gpu,
        "weights_bytes": e.weights,
        "kv_cache_bytes": e.kv_cache,
        "compute_bytes": e.compute,
        "output_bytes": e.output,
        "overhead_bytes": e.overhead,
        "context": e.context,
        "parallel": e.parallel,
        "gpus": e.gpus,
    }


def _size(r: Resolved) -> str:
    return f"{r.estimate.total / GIB:.2f} GiB estimated"


_OPTIONS = {"$.name": "NAME", "$.replicas": "--replicas", "$.engine": "--engine", "$.routing": "--routing"}


def _option_named(problem: str) -> str:
    """A check's problem (`... @ $.replicas`) with the command's option in place of the path."""
    text, _, at = problem.rpartition(" @ ")
    return f"{text} ({_OPTIONS.get(at, at)})" if text else problem
