"""`llmgw server`: run the control plane (agent endpoint, admin API) until interrupted.
SIGHUP (or `llmgw ctl reload`) reads server.toml again."""

from __future__ import annotations

import argparse

from llmgw.cli import Parser
from llmgw.commands._service import run_service
from llmgw.commands.ca import DEFAULT_SERVER_CONFIG, add_server_options, resolve_server_paths


def configure(parser: Parser) -> None:
    add_server_options(parser)


def run(args: argparse.Namespace) -> int:
    from llmgw.server.app import serve_control_plane

    config, state_dir = resolve_server_paths(args)
    path = args.config or (DEFAULT_SERVER_CONFIG if DEFAULT_SERVER_CONFIG.exists() else None)
    return run_service("server", serve_control_plane, config, state_dir, path)
