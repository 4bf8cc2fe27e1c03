"""`llmgw ctl nodes bench [NODE...]`: have nodes measure their engines' speed again (agent.bench)
and print the figures once they arrive, waiting at most --wait seconds (`POST /admin/v1/bench`).
How a node's speeds read is `llmgw.ctl.engines.speed_lines`, which `llmgw ctl nodes` prints too."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from llmgw.cli import add_json_flag, add_leaf
from llmgw.ctl.client import AdminClient
from llmgw.ctl.engines import speed_lines
from llmgw.errors import UsageError

DEFAULT_WAIT_S = 150.0  # an agent takes at most a minute a backend
MAX_WAIT_S = 600.0
LINK_SLACK_S = 30.0  # the HTTP call's own timeout beyond the wait


def configure_bench(
    verbs: Any,
    add_admin_options: Callable[[argparse.ArgumentParser], None],
    client_from: Callable[[argparse.Namespace], AdminClient],
) -> None:
    bench = add_leaf(
        verbs,
        "bench",
        "measure llama.cpp's speed on nodes again (every connected node if none is named) and print it",
        lambda args: run_bench(args, client_from),
    )
    bench.add_argument("nodes", nargs="*", metavar="NODE", help="node ids (default: every connected node)")
    bench.add_argument(
        "--wait",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="S",
        help=f"wait at most S seconds for the figures (default {DEFAULT_WAIT_S:g}, at most {MAX_WAIT_S:g})",
    )
    add_json_flag(bench)
    add_admin_options(bench)


def run_bench(args: argparse.Namespace, client_from: Callable[[argparse.Namespace], AdminClient]) -> int:
    if not 0 <= args.wait <= MAX_WAIT_S:
        raise UsageError(f"--wait must be from 0 to {MAX_WAIT_S:g} seconds, got {args.wait:g}")
    answer = client_from(args).request(
        "POST", "/admin/v1/bench", {"nodes": args.nodes, "wait_s": args.wait}, timeout_s=args.wait + LINK_SLACK_S
    )
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(bench_text(answer))
    return 0 if all(n.get("asked") and n.get("done") for n in answer["nodes"]) else 1


def bench_text(answer: dict[str, Any]) -> str:
    """What `ctl nodes bench` prints: per node, each backend's figures, or why there are none."""
    if not answer["nodes"]:
        return "no connected node to measure"
    lines = []
    for n in answer["nodes"]:
        if not n.get("asked"):
            lines.append(f"{n['node']}: not asked: {n.get('error', '')}")
            continue
        mine = [s for s in n["speeds"] if s.get("request") == answer["request"]]
        shown = speed_lines({"speeds": mine})
        lines += [f"{n['node']}: {line}" for line in shown]
        if not n.get("done"):
            lines.append(f"{n['node']}: still measuring when the wait ended; see `llmgw ctl nodes` later")
    return "\n".join(lines)
