"""`llmgw server`: run the control plane (agent endpoint, admin API) until interrupted."""

from __future__ import annotations

import argparse

import trio

from llmgw.cli import Parser
from llmgw.commands.ca import add_server_options, resolve_server_paths


def configure(parser: Parser) -> None:
    add_server_options(parser)


def run(args: argparse.Namespace) -> int:
    from llmgw.server.app import serve_control_plane

    config, state_dir = resolve_server_paths(args)
    trio.run(serve_control_plane, config, state_dir)
    return 0
