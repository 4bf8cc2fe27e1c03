"""`llmgw ctl models`: the catalog, listed, and changed while the cluster runs.

    llmgw ctl models [list]                   every model: engine, replicas ready, where it comes from
    llmgw ctl models add NAME --hf ORG/REPO   a model from the Hub (or [hub] endpoint's mirror)
    llmgw ctl models remove NAME              its replicas stop; the nodes free its files
    llmgw ctl models update NAME [--revision REV] [--engine E] [--args ...] [--retry]
                                              another revision, engine or args: its replicas are
                                              replaced one at a time; --retry: a stopped update
                                              goes again
    llmgw ctl models stage NAME --nodes N...  those nodes download its files now, ahead of replicas
    llmgw ctl models search TEXT              repositories matching TEXT, their quantisations, sizes
                                              and whether they would fit

A gated repository's token is read from a file (`--token-file`, or `-` for standard input), never
from the command line, where `ps` and the shell's history would show it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from llmgw.cli import add_group, add_json_flag, add_leaf
from llmgw.ctl.client import AdminClient
from llmgw.ctl.tables import model_notes, table
from llmgw.errors import MachineError, UsageError

ClientFrom = Callable[[argparse.Namespace], AdminClient]
ADD_TIMEOUT_S = 600.0  # resolving reads the Hub's metadata, the small files and the GGUF headers


def configure_models(
    sub: Any, add_admin_options: Callable[[argparse.ArgumentParser], None], client_from: ClientFrom
) -> None:
    models = sub.add_parser(
        "models",
        help="the catalog: list it (the default), add a model from the Hub, remove one, search the Hub",
        description="the catalog's models",
    )
    models.set_defaults(run=partial(run_list, client_from))
    add_json_flag(models)
    add_admin_options(models)
    verbs = add_group(models, "models_verb")
    verbs.required = False
    listing = add_leaf(
        verbs, "list", "list the catalog: each model, its replicas and its source", partial(run_list, client_from)
    )
    add = add_leaf(verbs, "add", "add a model from the Hub while the cluster runs", partial(run_add, client_from))
    add.add_argument("name", help="the name clients ask for (the `model` of a request)")
    add.add_argument(
        "--hf", required=True, metavar="ORG/REPO", help="the repository on the Hub, e.g. Qwen/Qwen3-0.6B-GGUF"
    )
    add.add_argument(
        "--revision", default="", metavar="REV", help="a branch, tag or commit (default main); pinned to its commit"
    )
    which = add.add_mutually_exclusive_group()
    which.add_argument("--quant", default="", metavar="Q", help="the GGUF quantisation, e.g. Q4_K_M (llama.cpp)")
    which.add_argument(
        "--file", default="", metavar="PATTERN", help="a glob over the repository's files, e.g. '*Q8_0*.gguf'"
    )
    add.add_argument(
        "--engine",
        default="",
        choices=("llamacpp", "vllm", "sglang"),
        help="default: llamacpp for GGUF, vllm for safetensors",
    )
    add.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas to run (default 1)")
    add.add_argument(
        "--gpus-per-replica", type=int, default=0, metavar="N", help="GPUs each replica takes (default 0: CPU)"
    )
    add.add_argument(
        "--nodes-per-replica",
        type=int,
        default=1,
        metavar="N",
        help="nodes one replica spans (vLLM, SGLang; llama.cpp over its RPC)",
    )
    add.add_argument(
        "--memory-gb",
        type=float,
        default=0.0,
        metavar="GIB",
        help="the memory a replica needs, overriding the estimate",
    )
    add.add_argument(
        "--routing", default="", choices=("", "prefix", "least_outstanding"), help="how the gateway picks a replica"
    )
    add.add_argument(
        "--args", nargs=argparse.REMAINDER, default=[], help="the engine's own arguments, last: --args --ctx-size 8192"
    )
    add.add_argument(
        "--token-file",
        default="",
        metavar="FILE",
        help="a file holding the token of a gated or private repository ('-': standard input)",
    )
    update = add_leaf(
        verbs,
        "update",
        "change a model added with `models add` (revision, engine, args): its replicas are replaced one at a time",
        partial(run_update, client_from),
    )
    update.add_argument("name", help="the model's name, as `llmgw ctl models` lists it")
    update.add_argument(
        "--revision", default="", metavar="REV", help="another branch, tag or commit; pinned to its commit"
    )
    update.add_argument("--engine", default="", choices=("llamacpp", "vllm", "sglang"), help="another engine")
    update.add_argument(
        "--retry",
        action="store_true",
        help="an update that stopped (its new version did not start) goes again; for any model, " "server.toml's too",
    )
    update.add_argument(
        "--args",
        nargs=argparse.REMAINDER,
        default=None,
        help="the engine's own arguments, replacing the model's, last: --args --ctx-size 16384 ('--args' alone: none)",
    )
    remove = add_leaf(
        verbs, "remove", "remove a model added with `models add`: its replicas stop", partial(run_remove, client_from)
    )
    remove.add_argument("name", help="the model's name, as `llmgw ctl models` lists it")
    stage = add_leaf(
        verbs,
        "stage",
        "have nodes download a model's files now, ahead of its replicas",
        partial(run_stage, client_from),
    )
    stage.add_argument("name", help="the model's name, as `llmgw ctl models` lists it")
    stage.add_argument("--nodes", nargs="+", required=True, metavar="NODE", help="the nodes that download it")
    search = add_leaf(
        verbs,
        "search",
        "search the Hub: repositories, their files and whether they would fit",
        partial(run_search, client_from),
    )
    search.add_argument("text", nargs="+", help="words of the repository's name, e.g. qwen gguf")
    search.add_argument("--limit", type=int, default=20, metavar="N", help="at most N repositories (1-100, default 20)")
    for leaf in (listing, add, update, remove, stage, search):
        add_json_flag(leaf)
        add_admin_options(leaf)


def read_token(path: str) -> str:
    """The token in `path` ('-': standard input), stripped; never printed."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise MachineError(
            f"cannot read the token file {path} ({exc.strerror}); fix the path or its permissions"
        ) from None
    token = text.strip()
    if not token:
        raise UsageError(f"the token file {path} is empty; put the repository's access token in it")
    return token


def run_add(client_from: ClientFrom, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {
        "name": args.name,
        "hf": args.hf,
        "revision": args.revision,
        "quant": args.quant,
        "file": args.file,
        "engine": args.engine,
        "replicas": args.replicas,
        "gpus_per_replica": args.gpus_per_replica,
        "nodes_per_replica": args.nodes_per_replica,
        "memory_gb": args.memory_gb,
        "routing": args.routing,
        "args": list(args.args),
    }
    if args.token_file:
        body["token"] = read_token(args.token_file)
    if not args.json:
        print(f"resolving {args.hf} at {args.revision or 'main'} on the Hub ...", file=sys.stderr, flush=True)
    model = client_from(args).request("POST", "/admin/v1/models", body, timeout_s=ADD_TIMEOUT_S)["model"]
    if args.json:
        print(json.dumps(model, indent=2))
        return 0
    e = model.get("estimate") or {}
    print(
        f"added {model['model']}: {model['hf']} at {model['commit'][:12]} ({model['revision']}), "
        f"{len(model['files'])} files, {_gib(model['bytes'])}, {model['engine']}"
    )
    if e:
        print(
            f"a replica needs about {_gib(e['total_bytes'])} (weights {_gib(e['weights_bytes'])}, "
            f"KV cache {_gib(e['kv_cache_bytes'])} for {e['context']} tokens, compute {_gib(e['compute_bytes'])}); "
            f"placed with {model['memory_gb']:g} GiB"
        )
    print("its replicas start as the nodes download it: `llmgw ctl replicas` shows their progress")
    return 0


def run_update(client_from: ClientFrom, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"revision": args.revision, "engine": args.engine, "retry": args.retry}
    if args.args is not None:
        body["args"] = list(args.args)
    if not args.json and (args.revision or args.engine or args.args is not None):
        print(f"resolving {args.name} again on the Hub ...", file=sys.stderr, flush=True)
    path = f"/admin/v1/models/{quote(args.name, safe='')}/update"
    result = client_from(args).request("POST", path, body, timeout_s=ADD_TIMEOUT_S)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    name = result["model"]
    if result.get("commit") and (args.revision or args.engine or args.args is not None):
        what = f"{result['hf']} at {result['commit'][:12]} ({result['revision']}), {result['engine']}"
        what += f", args {' '.join(result['args']) or '(none)'}"
        if result["changed"]:
            print(f"updated {name}: {what}")
            print("its replicas are replaced one at a time, each new one ready first: `llmgw ctl models` shows how far")
        else:
            print(f"{name} runs that already ({what}): nothing to replace")
    if args.retry:
        print(
            f"{name}: its stopped update goes again: `llmgw ctl models` shows how far"
            if result["retried"]
            else f"{name}: no update of it had stopped; nothing to retry"
        )
    return 0


def run_remove(client_from: ClientFrom, args: argparse.Namespace) -> int:
    result = client_from(args).request("DELETE", f"/admin/v1/models/{quote(args.name, safe='')}")
    print(json.dumps(result, indent=2) if args.json else f"removed {result['removed']}: its replicas stop")
    return 0


def run_stage(client_from: ClientFrom, args: argparse.Namespace) -> int:
    result = client_from(args).request(
        "POST", f"/admin/v1/models/{quote(args.name, safe='')}/stage", {"nodes": args.nodes}
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if result["staging"]:
        print(
            f"{result['model']}: {', '.join(result['staging'])} download its files now (`llmgw ctl nodes` shows them)"
        )
    if result["holding"]:
        print(f"{result['model']}: {', '.join(result['holding'])} hold its files already")
    return 0


def run_search(client_from: ClientFrom, args: argparse.Namespace) -> int:
    query = urlencode({"q": " ".join(args.text), "limit": str(args.limit)})
    results = client_from(args).request("GET", f"/admin/v1/models/search?{query}", timeout_s=ADD_TIMEOUT_S)["results"]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    if not results:
        print("no repository matches")
        return 0
    rows = [("REPOSITORY", "FILE", "QUANT", "SIZE", "FITS ON")]
    for r in results:
        if "error" in r:
            rows.append((r["repo"], "-", "-", "-", r["error"][:60]))
        for c in r.get("choices", ()):
            parts = f" (+{c['parts'] - 1})" if c["parts"] > 1 and c["engine"] == "llamacpp" else ""
            fits = c.get("fits_on")
            where = (
                "-"
                if fits is None
                else (", ".join(fits[:4]) + (" ..." if len(fits) > 4 else "") if fits else "no node")
            )
            rows.append((r["repo"], c["file"] + parts, c["quant"] or "-", _gib(c["bytes"]), where))
        if "choices" not in r and "error" not in r:
            rows.append((r["repo"], f"{r.get('files', 0)} files", "", "", "(search more narrowly for details)"))
    print(table(rows))
    return 0


def run_list(client_from: ClientFrom, args: argparse.Namespace) -> int:
    models = client_from(args).request("GET", "/admin/v1/models")["models"]
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    rows = [("MODEL", "ENGINE", "READY", "GPUS", "NODES", "SOURCE", "PENDING")]
    for m in models:
        source = f"{m['hf']}@{m['commit'][:8]}" if m.get("from") == "hub" else "server.toml"
        rows.append(
            (
                m["model"],
                m["engine"],
                f"{m['ready']}/{m['replicas']}",
                m["gpus_per_replica"],
                m["nodes_per_replica"],
                source,
                "; ".join(m["pending"]) or "-",
            )
        )
    if models:
        print(table(rows))
        for m in models:  # replicas on their way: downloading (MiB, MiB/s), starting
            for note in model_notes(m):  # how its replicas follow the load; its rollout
                print(f"  {m['model']}: {note}")
            for line in m.get("progress") or ():
                print(f"  {m['model']}: {line}")
            if m.get("staging_to"):
                print(f"  {m['model']}: staging to {', '.join(m['staging_to'])}")
    else:
        print("no models: `llmgw ctl models add NAME --hf ORG/REPO`, or [[models]] in server.toml")
    return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
