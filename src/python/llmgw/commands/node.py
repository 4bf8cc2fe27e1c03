"""`llmgw node`: a node's membership of the cluster. `remove` forgets it and revokes its certificate."""

from __future__ import annotations

import argparse
import json

from llmgw.cli import Parser, add_group, add_json_flag, add_leaf
from llmgw.commands.ctl import add_admin_options, client_from


def configure(parser: Parser) -> None:
    sub = add_group(parser, "verb")
    remove = add_leaf(
        sub,
        "remove",
        "forget a node and revoke its certificate; its open link is closed and it cannot connect again",
        run_remove,
    )
    remove.add_argument("node", help="node id")
    add_json_flag(remove)
    add_admin_options(remove)


def run_remove(args: argparse.Namespace) -> int:
    result = client_from(args).remove_node(args.node)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        serials = ", ".join(result["revoked_serials"]) or "none recorded"
        print(f"removed {result['removed']}; revoked certificate serials: {serials}")
        if result["link_closed"]:
            print("its open link was closed")
        print("stop the agent on the machine too (systemctl disable --now llmgw-agent)")
    return 0
