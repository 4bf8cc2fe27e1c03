"""`llmgw ctl`: the operator's view of a running cluster, through the admin API."""

from __future__ import annotations

import argparse
import json
from typing import Any

from llmgw.cli import Parser, add_group, add_json_flag, add_leaf
from llmgw.ctl.client import AdminClient


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
        "list the nodes: state, address, agent, heartbeat, hardware, engines, fabrics, certificate",
        run_nodes,
    )
    add_json_flag(nodes)
    add_admin_options(nodes)
    for verb, text in (("cordon", "stop placing work on a node"), ("uncordon", "allow work on a cordoned node again")):
        leaf = add_leaf(sub, verb, text, run_cordon)
        leaf.add_argument("node", help="node id")
        add_json_flag(leaf)
        add_admin_options(leaf)


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


def format_nodes(nodes: list[dict[str, Any]]) -> str:
    if not nodes:
        return 'no nodes yet: see docs/operations.md, "Adding a node by hand"'
    header = (
        "NODE",
        "STATE",
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
                n.get("address") or "-",
                n.get("agent_version") or "-",
                f"{age:.0f}s ago" if age is not None else "never",
                f"{cpu.get('cores', '?')} x {cpu.get('model', '?')}" if cpu else "-",
                _gpus(n),
                ",".join(e["name"] + ("" if e["ok"] else "(failed)") for e in n.get("engines") or []) or "-",
                _vllm(n),
                _fabrics(n),
                f"{n['cert_not_after']} ({n['cert_expires_in_days']:.0f}d)" if n.get("cert_not_after") else "-",
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
