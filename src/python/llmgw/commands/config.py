"""`llmgw config check`: load a server.toml or agent.toml and report every problem in it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmgw import config
from llmgw.cli import Parser, add_group, add_json_flag, add_leaf
from llmgw.log import get_logger

log = get_logger("llmgw.config")


def configure(parser: Parser) -> None:
    sub = add_group(parser, "verb")
    check = add_leaf(sub, "check", "check a configuration file; exit 2 if it has problems", run_check)
    check.add_argument("file", type=Path, help="server.toml or agent.toml")
    check.add_argument(
        "--kind",
        choices=("server", "agent", "auto"),
        default="auto",
        help="which file it is (auto: from its name; agent.toml is an agent file, anything else a server file)",
    )
    add_json_flag(check)


def run_check(args: argparse.Namespace) -> int:
    kind = args.kind
    if kind == "auto":
        kind = "agent" if args.file.name.startswith("agent") else "server"
    cfg = config.load_agent_config(args.file) if kind == "agent" else config.load_server_config(args.file)
    data = config.to_dict(cfg)
    log.debug("config_loaded", file=str(args.file), kind=kind, config=data)
    if args.json:
        print(json.dumps({"file": str(args.file), "kind": kind, "ok": True, "config": data}, indent=2))
    else:
        print(f"{args.file}: ok ({kind} configuration)")
    return 0
