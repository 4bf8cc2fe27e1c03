"""`llmgw ctl`: the operator's view of a running cluster, through the admin API."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import attrs

from llmgw import config, engines
from llmgw.cli import Parser, add_group, add_json_flag, add_leaf
from llmgw.ctl import engines as engine_texts
from llmgw.ctl.client import AdminClient
from llmgw.ctl.page import configure_page  # [i17 page hook]
from llmgw.engines.check import MISSING, OK
from llmgw.errors import UsageError


def add_admin_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("control plane")
    group.add_argument(
        "--state-dir", help="a local control plane's state directory (default: $LLMGW_STATE_DIR or /var/lib/llmgw)"
    )
    group.add_argument("--server", help="admin URL of a control plane elsewhere, e.g. http://10.0.0.1:8080")
    group.add_argument(
        "--credential", help="file holding the admin credential (a copy of the control plane's admin.token)"
    )


def client_from(args: argparse.Namespace) -> AdminClient:
    return AdminClient.locate(server=args.server, credential=args.credential, state_dir=args.state_dir)


def configure(parser: Parser) -> None:
    sub = add_group(parser, "verb")
    nodes = add_leaf(
        sub,
        "nodes",
        "list the nodes: state, replicas, address, agent, heartbeat, hardware, engines, fabrics, certificate",
        run_nodes,
    )
    add_json_flag(nodes)
    add_admin_options(nodes)
    for verb, text, fn in (
        ("replicas", "list replicas: model, nodes, state, port, restarts; and what is pending, with why", run_replicas),
        ("models", "list the catalog: each model with its ready and wanted replicas", run_models),
    ):
        leaf = add_leaf(sub, verb, text, fn)
        add_json_flag(leaf)
        add_admin_options(leaf)
    logs = add_leaf(sub, "logs", "show the tail of a replica's engine log, from every node it runs on", run_logs)
    logs.add_argument("replica", help="replica id, as `llmgw ctl replicas` lists it")
    logs.add_argument(
        "--lines", type=int, default=100, metavar="N", help="how many lines from each member (default 100)"
    )
    add_json_flag(logs)
    add_admin_options(logs)
    reload = add_leaf(
        sub, "reload", "read server.toml again: catalog and engines; unchanged replicas keep running", run_reload
    )
    add_json_flag(reload)
    add_admin_options(reload)
    drain = add_leaf(
        sub,
        "drain",
        "move a node's replicas off it one at a time (each replacement ready before its original stops), then cordon it",
        run_drain,
    )
    drain.add_argument("node", help="node id")
    drain.add_argument(
        "--wait", action="store_true", help="block until the drain is done (or stops), printing progress"
    )
    drain.add_argument(
        "--timeout", type=float, default=3600.0, metavar="S", help="with --wait: give up waiting after S seconds"
    )
    drain.add_argument(
        "--force",
        action="store_true",
        help="stop a replica that cannot be placed elsewhere instead of stopping the drain",
    )
    add_json_flag(drain)
    add_admin_options(drain)
    for verb, text in (("cordon", "stop placing work on a node"), ("uncordon", "allow work on a cordoned node again")):
        leaf = add_leaf(sub, verb, text, run_cordon)
        leaf.add_argument("node", help="node id")
        add_json_flag(leaf)
        add_admin_options(leaf)
    configure_engine_check(sub)
    configure_keys(sub)
    configure_page(sub, add_admin_options, client_from)  # [i17 page hook] `llmgw ctl page`


def run_nodes(args: argparse.Namespace) -> int:
    cluster = client_from(args).cluster()
    nodes = cluster["nodes"]
    if args.json:
        print(json.dumps(nodes, indent=2))
    else:
        print(format_nodes(nodes))
        for note in cluster.get("notes", []):
            print(f"note: {note}")
        for n in nodes:
            for problem in n.get("fabric_problems") or []:
                print(f"{n['id']}: fabric refused: {problem}")
            if n.get("gpu_status") in ("not_found", "failed"):
                print(f"{n['id']}: GPUs: {n.get('gpu_detail')}")
            for line in engine_texts.notes(n):
                print(f"{n['id']}: {line}")
    return 0


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def run_replicas(args: argparse.Namespace) -> int:
    replicas = client_from(args).request("GET", "/admin/v1/replicas")["replicas"]
    if args.json:
        print(json.dumps(replicas, indent=2))
        return 0
    if not replicas:
        print("no replicas: the catalog ([[models]] in server.toml) is empty")
        return 0
    rows = [("REPLICA", "MODEL", "NODES", "STATE", "PORT", "RESTARTS", "DETAIL")]
    for r in replicas:
        if r["state"] == "pending":
            rows.append(("-", r["model"], "-", "pending", "-", "-", r["detail"]))
        else:
            rows.append(
                (
                    r["replica"],
                    r["model"],
                    ",".join(r["nodes"]),
                    r["state"],
                    r["port"] or "-",
                    r["restarts"],
                    r["detail"][:80],
                )
            )
    print(_table(rows))
    return 0


def run_logs(args: argparse.Namespace) -> int:
    path = f"/admin/v1/replicas/{quote(args.replica, safe='')}/logs?lines={args.lines}"
    result = client_from(args).request("GET", path)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for m in result["members"]:
        print(f"==> {result['replica']} rank {m['rank']} on {m['node']} <==")
        print(m["text"].rstrip("\n") if not m["error"] else f"(no log: {m['error']})")
    return 1 if any(m["error"] for m in result["members"]) else 0


def run_reload(args: argparse.Namespace) -> int:
    result = client_from(args).request("POST", "/admin/v1/reload")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"reloaded: {len(result['models'])} models; nodes whose replicas changed: {', '.join(result['nodes_changed']) or 'none'}"
        )
    return 0


def run_drain(args: argparse.Namespace) -> int:
    client = client_from(args)
    path = f"/admin/v1/nodes/{quote(args.node, safe='')}/drain" + ("?force=1" if args.force else "")
    progress = client.request("POST", path)["drain"]
    deadline = time.monotonic() + args.timeout
    last = None
    while args.wait and not progress["done"] and not progress["error"] and time.monotonic() < deadline:
        if not args.json and (progress["moved"], progress["current"]) != last:
            print(
                f"{args.node}: {progress['moved']}/{progress['total']} moved"
                + (f", moving {progress['current']}" if progress["current"] else "")
            )
            last = (progress["moved"], progress["current"])
        time.sleep(1.0)
        node = next((n for n in client.nodes() if n["id"] == args.node), None)
        progress = (node or {}).get("drain") or progress
    if args.json:
        print(json.dumps(progress, indent=2))
    elif progress["error"]:
        print(f"{args.node}: drain stopped: {progress['error']}")
    elif progress["done"]:
        print(
            f"{args.node}: drained: {progress['moved']}/{progress['total']} replicas moved; the node is cordoned and empty"
        )
    else:
        print(f"{args.node}: draining, {progress['moved']}/{progress['total']} moved; follow it with `llmgw ctl nodes`")
    if progress["error"]:
        return 1
    return 0 if progress["done"] or not args.wait else 1


def run_models(args: argparse.Namespace) -> int:
    models = client_from(args).request("GET", "/admin/v1/models")["models"]
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    rows = [("MODEL", "ENGINE", "READY", "GPUS", "NODES", "PENDING")]
    for m in models:
        rows.append(
            (
                m["model"],
                m["engine"],
                f"{m['ready']}/{m['replicas']}",
                m["gpus_per_replica"],
                m["nodes_per_replica"],
                "; ".join(m["pending"]) or "-",
            )
        )
    print(_table(rows) if models else "no models: add [[models]] to server.toml")
    return 0


def run_cordon(args: argparse.Namespace) -> int:
    node = client_from(args).cordon(args.node, args.verb == "cordon")
    if args.json:
        print(json.dumps(node, indent=2))
    else:
        print(f"{node['id']}: {state_text(node)}")
    return 0


def state_text(node: dict[str, Any]) -> str:
    marks = [m for m in ("cordoned", "draining") if node.get(m)]
    drain = node.get("drain")
    if drain and node.get("draining"):
        marks[-1] = f"draining {drain['moved']}/{drain['total']}"
    return node["state"] + (f" ({', '.join(marks)})" if marks else "")


def _gpus(n: dict[str, Any]) -> str:
    gpus = n.get("gpus") or []
    if gpus:
        return f"{len(gpus)} x {gpus[0]['name']}"
    # A node whose nvidia-smi is missing or failing must not look like a CPU node.
    return {"not_found": "nvidia-smi missing!", "failed": "nvidia-smi failed!"}.get(n.get("gpu_status") or "", "none")


def _vllm(n: dict[str, Any]) -> str:
    e = next((e for e in n.get("eligibility") or [] if e["engine"] == "vllm"), None)
    if e is None:
        return "-"
    return {"not_applicable": "not applicable", "eligible": "eligible"}.get(e["status"], e["status"].replace("_", " "))


def _fabrics(n: dict[str, Any]) -> str:
    shown = [f"{f['name']}@{f['identity']}" for f in n.get("fabrics") or []]
    if n.get("fabric_problems"):
        shown.append("refused")
    return ",".join(shown) or "-"


SHOWN_REPLICAS = 3  # named in the REPLICAS cell; more are counted


def _replicas(n: dict[str, Any]) -> str:
    """The replicas the node holds (members it reports, whatever their state): "0", or the count
    and their ids, "2: chat-1,chat-2" (a drain is done when it reads 0)."""
    ids = sorted({r["replica"] for r in n.get("replicas") or []})
    if not ids:
        return "0"
    more = f",+{len(ids) - SHOWN_REPLICAS}" if len(ids) > SHOWN_REPLICAS else ""
    return f"{len(ids)}: {','.join(ids[:SHOWN_REPLICAS])}{more}"


def format_nodes(nodes: list[dict[str, Any]]) -> str:
    if not nodes:
        return "no nodes yet: add one with `sudo llmgw node add USER@HOST` (docs/node-onboarding.md)"
    header = (
        "NODE",
        "STATE",
        "REPLICAS",
        "ADDRESS",
        "AGENT",
        "HEARTBEAT",
        "CPU",
        "GPUS",
        "ENGINES",
        "VLLM",
        "FABRICS",
        "CERT EXPIRES",
    )
    rows = [header]
    for n in nodes:
        age = n.get("last_heartbeat_age_s")
        cpu = n.get("cpu") or {}
        rows.append(
            (
                n["id"],
                state_text(n),
                _replicas(n),
                n.get("address") or "-",
                n.get("agent_version") or "-",
                f"{age:.0f}s ago" if age is not None else "never",
                f"{cpu.get('cores', '?')} x {cpu.get('model', '?')}" if cpu else "-",
                _gpus(n),
                ",".join(e["name"] + engine_texts.mark(e) for e in n.get("engines") or []) or "-",
                _vllm(n),
                _fabrics(n),
                f"{n['cert_not_after']} ({n['cert_expires_in_days']:.0f}d)" if n.get("cert_not_after") else "-",
            )
        )
    return _table(rows)


# -- keys: the gateway's API keys ----------------------------------------------------------


def configure_keys(sub: Any) -> None:
    keys = sub.add_parser(
        "keys", help="the gateway's API keys: create, list, revoke", description="the gateway's API keys"
    )
    verbs = add_group(keys, "keys_verb")
    create = add_leaf(verbs, "create", "create an API key; its token is printed this once", run_keys_create)
    create.add_argument("name", help="a name for the key: who or what uses it")
    create.add_argument("--models", nargs="+", metavar="MODEL", default=[], help="models it may use (default: all)")
    create.add_argument(
        "--rate-per-minute",
        type=int,
        default=0,
        metavar="N",
        help="requests per minute it may make (default: no limit)",
    )
    create.add_argument(
        "--max-concurrency", type=int, default=0, metavar="N", help="requests it may have in flight (default: no limit)"
    )
    listing = add_leaf(verbs, "list", "list the API keys (never their tokens)", run_keys_list)
    revoke = add_leaf(verbs, "revoke", "revoke an API key: its next request is refused", run_keys_revoke)
    revoke.add_argument("name", help="the key's name, as `llmgw ctl keys list` shows it")
    for leaf in (create, listing, revoke):
        add_json_flag(leaf)
        add_admin_options(leaf)


def run_keys_create(args: argparse.Namespace) -> int:
    body = {
        "name": args.name,
        "models": args.models,
        "rate_per_minute": args.rate_per_minute,
        "max_concurrency": args.max_concurrency,
    }
    result = client_from(args).request("POST", "/admin/v1/keys", body)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"created API key {result['key']['name']!r}; its token, shown only this once:")
        print(result["token"])
    return 0


def run_keys_list(args: argparse.Namespace) -> int:
    keys = client_from(args).request("GET", "/admin/v1/keys")["keys"]
    if args.json:
        print(json.dumps(keys, indent=2))
        return 0
    if not keys:
        print("no API keys: create one with `llmgw ctl keys create NAME`")
        return 0
    rows = [("NAME", "MODELS", "RATE/MIN", "CONCURRENCY", "CREATED", "STATE")]
    for k in keys:
        rows.append(
            (
                k["name"],
                ",".join(k["models"]) or "all",
                k["rate_per_minute"] or "-",
                k["max_concurrency"] or "-",
                time.strftime("%Y-%m-%d %H:%M", time.gmtime(k["created_at"])),
                "revoked" if k["revoked_at"] else "valid",
            )
        )
    print(_table(rows))
    return 0


def run_keys_revoke(args: argparse.Namespace) -> int:
    result = client_from(args).request("DELETE", f"/admin/v1/keys/{quote(args.name, safe='')}")
    print(json.dumps(result, indent=2) if args.json else f"revoked API key {result['revoked']!r}")
    return 0


# -- engine-check: runs here, needs no control plane ---------------------------------------

HELP_TIMEOUT_S = 120.0  # vLLM imports torch before it prints its help: tens of seconds on a small node

ENGINE_CHECK_EPILOG = """\
It builds the widest command llmgw would ever give ENGINE (multi-node, every optional flag) and
looks up each flag in the engine's own help: the given text, or else what the installed engine
prints (vLLM: `vllm serve --help=all`, with VLLM_TARGET_DEVICE=cpu unless set). Give the whole
help: a text that does not document --help itself was probably cut short, and is warned about.

exit status:
  0  every flag llmgw uses is documented
  1  warnings only (e.g. the help looks cut short)
  2  flags llmgw uses are missing, or the models' args are wrong; or nothing was checked
     (the engine could not be asked for its help, or a usage error)"""


def configure_engine_check(sub: Any) -> None:
    check = add_leaf(
        sub, "engine-check", "check that an engine still takes every flag llmgw gives it", run_engine_check
    )
    check.formatter_class = argparse.RawDescriptionHelpFormatter
    check.epilog = ENGINE_CHECK_EPILOG
    check.add_argument(
        "engine", metavar="ENGINE", choices=sorted(engines.SPECS), help=f"one of: {', '.join(sorted(engines.SPECS))}"
    )
    source = check.add_mutually_exclusive_group()
    source.add_argument("--help-output", metavar="TEXT", help='the engine\'s help, e.g. "$(llama-server --help 2>&1)"')
    source.add_argument("--help-file", type=Path, metavar="FILE", help="a file holding the engine's help")
    check.add_argument(
        "--binary",
        metavar="PATH",
        help="the installed engine to ask: llama-server, vllm, the Python that has sglang, or llmgw "
        "(default: found on PATH; for sim, this llmgw)",
    )
    check.add_argument(
        "--config", type=Path, metavar="FILE", help="also check the args of this server.toml's models on ENGINE"
    )
    add_json_flag(check)


def run_engine_check(args: argparse.Namespace) -> int:
    spec = engines.spec_for(args.engine)
    if args.help_output is not None:
        text, source = args.help_output, "--help-output"
    elif args.help_file is not None:
        text, source = _read_help_file(args.help_file), str(args.help_file)
    else:
        text, source = _run_help(spec, args.binary)
    result = engines.check_engine(spec.name, text)
    if args.config is not None:
        problems = []
        for model in config.load_server_config(args.config).models:
            if model.engine == spec.name:
                problems += [f"model {model.name!r}: {p}" for p in engines.check_args(spec.name, model.args, text)]
        result = attrs.evolve(result, arg_problems=tuple(problems))
    if args.json:
        print(json.dumps({**result.to_dict(), "help_source": source}, indent=2))
    else:
        print(format_engine_check(result, spec, source))
    return result.status


def _read_help_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read the help file {path}: {exc.strerror or exc}") from None


def _run_help(spec: engines.EngineSpec, binary: str | None) -> tuple[str, str]:
    executable: str | tuple[str, ...] | None = binary
    extra_env: dict[str, str] = {}
    if binary is None and spec.name == "sim":
        # The sim is this program: ask this llmgw, not whichever one is on PATH.
        executable = (sys.executable, "-m", "llmgw")
        extra_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    command = spec.help_command(executable, environ=os.environ)
    shown = " ".join(command.argv)
    try:
        done = subprocess.run(
            command.argv,
            env={**os.environ, **extra_env, **command.env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=HELP_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        raise engines.EngineHelpError(
            f"{command.argv[0]!r} not found, so {spec.title} cannot be asked for its help; "
            "pass --binary PATH, or the help itself with --help-output or --help-file"
        ) from None
    except PermissionError:
        raise engines.EngineHelpError(f"{command.argv[0]!r} is not executable; pass --binary PATH") from None
    except subprocess.TimeoutExpired:
        raise engines.EngineHelpError(f"`{shown}` printed no help within {HELP_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        said = "\n".join((done.stderr or done.stdout).strip().splitlines()[-10:]) or "(nothing)"
        raise engines.EngineHelpError(f"`{shown}` failed (exit status {done.returncode}); it said:\n{said}")
    return done.stdout or done.stderr, f"`{shown}`"


def format_engine_check(result: engines.EngineCheck, spec: engines.EngineSpec, source: str) -> str:
    missing = set(result.missing)
    lines = [
        f"{spec.title}: {result.documented} flags documented by {source}; "
        f"llmgw's flags were written for {result.flags_for}",
        *(f"  {'MISSING' if f in missing else 'ok':<8}{f}" for f in result.checked),
    ]
    lines += [
        f"  MISSING {v} (environment variable llmgw sets; the help no longer mentions it)" for v in result.missing_env
    ]
    lines += [f"args: {p}" for p in result.arg_problems]
    lines += [f"warning: {w}" for w in result.warnings]
    if result.status == MISSING:
        lines.append(
            f"result: {len(result.missing) + len(result.missing_env)} of llmgw's flags missing, "
            f"{len(result.arg_problems)} problems in models' args (exit 2)"
        )
    else:
        lines.append("result: " + ("ok (exit 0)" if result.status == OK else "warnings (exit 1)"))
    return "\n".join(lines)
