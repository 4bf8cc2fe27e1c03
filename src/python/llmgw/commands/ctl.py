"""`llmgw ctl`: the operator's view of a running cluster, through the admin API.

The verbs on nodes, replicas and models are here; `keys` is `llmgw.ctl.keys`, `page`
`llmgw.ctl.page`, `audit` `llmgw.ctl.audit`, `usage` and `teams` `llmgw.ctl.usage`, `budgets` `llmgw.ctl.budgets`, `engine-check` (which needs no control plane) `llmgw.ctl.enginecheck`; how
the answers read in a terminal is `llmgw.ctl.tables`."""

from __future__ import annotations

import argparse
import json
import time
from urllib.parse import quote

from llmgw.cli import Parser, add_group, add_json_flag, add_leaf
from llmgw.commands._options import add_admin_options, client_from
from llmgw.ctl import engines as engine_texts
from llmgw.ctl.audit import configure_audit
from llmgw.ctl.bench import configure_bench
from llmgw.ctl.budgets import configure_budgets
from llmgw.ctl.enginecheck import configure_engine_check
from llmgw.ctl.keys import configure_keys
from llmgw.ctl.models import configure_models
from llmgw.ctl.page import configure_page  # [i17 page hook]
from llmgw.ctl.tables import format_nodes, model_notes, state_text, table, vulkan_text
from llmgw.ctl.usage import configure_teams, configure_usage
from llmgw.errors import UsageError


def configure(parser: Parser) -> None:
    sub = add_group(parser, "verb")
    nodes = add_leaf(
        sub,
        "nodes",
        "list the nodes: state, replicas, address, agent, heartbeat, hardware, engines and their measured speed, "
        "fabrics, certificate; `nodes bench` measures llama.cpp's speed again",
        run_nodes,
    )
    nodes.add_argument("--state", choices=("joined", "joining", "lost", "unknown"), help="only the nodes in this state")
    nodes.add_argument(
        "--limit", type=int, metavar="N", help="at most N nodes (one page; --json then says where the next starts)"
    )
    nodes.add_argument("--after", default="", metavar="NODE", help="the nodes after this node id (by id)")
    add_json_flag(nodes)
    add_admin_options(nodes)
    nodes_verbs = add_group(nodes, "nodes_verb")
    nodes_verbs.required = False  # `ctl nodes` alone lists them
    configure_bench(nodes_verbs, add_admin_options, client_from)
    replicas = add_leaf(
        sub,
        "replicas",
        "list replicas: model, nodes, state, port, restarts; and what is pending, with why",
        run_replicas,
    )
    add_json_flag(replicas)
    add_admin_options(replicas)
    configure_models(sub, add_admin_options, client_from)
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
    configure_keys(sub, add_admin_options, client_from)
    configure_teams(sub, add_admin_options, client_from)
    configure_usage(sub, add_admin_options, client_from)
    configure_page(sub, add_admin_options, client_from)  # [i17 page hook] `llmgw ctl page`
    configure_audit(sub, add_admin_options, client_from)
    configure_budgets(sub, add_admin_options, client_from)


def run_nodes(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be 1 or more, got {args.limit}")
    cluster = client_from(args).cluster(state=args.state or "", limit=args.limit, after=args.after)
    nodes = cluster["nodes"]
    if args.json and args.limit is not None:
        print(json.dumps({"nodes": nodes, "next": cluster.get("next")}, indent=2))  # a page: where the next starts
    elif args.json:
        print(json.dumps(nodes, indent=2))
    else:
        print(format_nodes(nodes))
        for note in cluster.get("notes", []):
            print(f"note: {note}")
        if cluster.get("next"):
            print(f"more: llmgw ctl nodes --limit {args.limit} --after {cluster['next']}")
        for n in nodes:
            for problem in n.get("fabric_problems") or []:
                print(f"{n['id']}: fabric refused: {problem}")
            if n.get("gpu_status") in ("not_found", "failed"):
                print(f"{n['id']}: GPUs: {n.get('gpu_detail')}")
            if vulkan := vulkan_text(n):
                print(f"{n['id']}: {vulkan}")
            for line in engine_texts.notes(n):
                print(f"{n['id']}: {line}")
    return 0


def run_replicas(args: argparse.Namespace) -> int:
    client = client_from(args)
    replicas = client.request("GET", "/admin/v1/replicas")["replicas"]
    if args.json:
        print(json.dumps(replicas, indent=2))
        return 0
    # Models whose replicas follow the load (their bounds and last decision) or are being
    # replaced by a rollout: under the table.
    scaled = [
        (m["model"], text) for m in client.request("GET", "/admin/v1/models")["models"] for text in model_notes(m)
    ]
    if not replicas:
        print("no replicas: the catalog ([[models]] in server.toml) is empty" if not scaled else "no replicas")
        for name, text in scaled:
            print(f"  {name}: {text}")
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
    print(table(rows))
    for name, text in scaled:
        print(f"  {name}: {text}")
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


def run_cordon(args: argparse.Namespace) -> int:
    node = client_from(args).cordon(args.node, args.verb == "cordon")
    if args.json:
        print(json.dumps(node, indent=2))
    else:
        print(f"{node['id']}: {state_text(node)}")
    return 0
