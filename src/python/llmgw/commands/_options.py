"""Options several commands share, and what they resolve to: the control plane's files
(`add_server_options`), its admin API (`add_admin_options`) and an SSH login
(`add_ssh_options`). Light on purpose: `llmgw gateway` builds its verbs' options at every start,
its workers' too, so nothing here imports the control plane or the admin client at import time.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw import config
from llmgw.paths import STATE_DIR_ENV, state_dir_from

if TYPE_CHECKING:
    from llmgw.ctl.client import AdminClient

DEFAULT_SERVER_CONFIG = Path("/etc/llmgw/server.toml")


def add_server_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("control plane")
    group.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=f"where the control plane keeps its state (default: ${STATE_DIR_ENV}, else [server].state_dir of the config)",
    )
    group.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"server.toml (default: {DEFAULT_SERVER_CONFIG} if it exists, else built-in defaults)",
    )


def resolve_server_paths(args: argparse.Namespace) -> tuple[config.ServerConfig, Path]:
    """The server config and state directory a control-plane command works on."""
    path = getattr(args, "config", None)
    if path is None and DEFAULT_SERVER_CONFIG.exists():
        path = DEFAULT_SERVER_CONFIG
    cfg = config.load_server_config(path) if path is not None else config.ServerConfig()
    return cfg, state_dir_from(getattr(args, "state_dir", None), cfg.server.state_dir)


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
    from llmgw.ctl.client import AdminClient

    return AdminClient.locate(server=args.server, credential=args.credential, state_dir=args.state_dir)


def default_known_hosts() -> Path:
    return Path.home() / ".ssh" / "known_hosts"


def add_ssh_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SSH")
    group.add_argument("--port", type=int, default=22, help="the machine's SSH port (default 22)")
    group.add_argument(
        "-i",
        "--identity",
        action="append",
        type=Path,
        metavar="KEY",
        help="a private key to log in with (repeatable; default: ssh's usual files in ~/.ssh, and the SSH agent)",
    )
    group.add_argument(
        "--known-hosts",
        type=Path,
        metavar="FILE",
        help="known_hosts to verify the machine's host key against (default: ~/.ssh/known_hosts)",
    )
    group.add_argument(
        "--accept-new-host-key",
        action="store_true",
        help="trust a host not yet in known_hosts and add it there (in a terminal you are asked instead)",
    )
