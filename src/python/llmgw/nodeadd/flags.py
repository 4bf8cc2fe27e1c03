"""The flags the three `add` commands share, and the toolkit's `Options` built from them.

`add_flags` gives a command the machine to log in to, the release and how it travels, the
output (--plain, --json) and SSH's options; `add_link_flags` what a machine that dials the
control plane takes besides (node add, gateway add): the address it dials, the other control
planes, --reissue and the join's timeout. `options_from` checks what can be checked without
reading anything, then reads server.toml and builds a flow's options (the toolkit's fields from
the flags, the flow's own given). `ssh_from` is the SSH flags of a `remove --ssh` command.

Imported when a command's parser is built (every `llmgw gateway` process builds its parser), so
nothing here imports the control plane's client or the SSH library at import time.
"""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from llmgw.commands._options import add_ssh_options, default_known_hosts, resolve_server_paths
from llmgw.errors import UsageError

OptionsT = TypeVar("OptionsT")  # a flow's Options class


def add_flags(parser: argparse.ArgumentParser, *, machine: str, example: str, release_default: str) -> None:
    """The machine (`USER@HOST`, e.g. `example`), the release, the output and SSH's options.
    `machine` is what the target is called (a node, the machine); `release_default` says where
    the release comes from without --release."""
    parser.add_argument("target", metavar="USER@HOST", help=f"how to log in to the {machine}, e.g. {example}")
    parser.add_argument(
        "--release",
        metavar="DIR|FILE|URL",
        default="",
        help="the release to install: a directory with llmgw-VERSION-linux-ARCH.pyz and SHA256SUMS (and "
        f"llama.cpp-bN-linux-ARCH.tar.gz, which a node gets too), one .pyz, or the URL of such a directory "
        f"(fetched by the {machine}); default: {release_default}",
    )
    parser.add_argument(
        "--release-via",
        choices=("ssh", "https"),
        default="",
        help=f"without --release, how the control plane's release reaches the {machine}: https, it downloads it "
        "from the control plane's agent port; ssh, it is copied over SSH, for a machine that cannot reach the "
        "control plane that way (default: https when the control plane holds its file, else ssh)",
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--plain", action="store_true", help="one line per step, even in a terminal")
    out.add_argument("--json", action="store_true", help="one JSON object per event")
    add_ssh_options(parser)


def add_link_flags(
    parser: argparse.ArgumentParser, *, who: str, machine: str, join_timeout: float, join_help: str, planes_help: str
) -> None:
    """What a machine whose `who` (the agent, the gateway) dials the control plane takes besides."""
    parser.add_argument(
        "--server-address",
        metavar="ADDR",
        default="",
        help=f"the address {who} dials (default: this machine's address on the route to the {machine}); the "
        "server certificate must cover it",
    )
    parser.add_argument(
        "--control-plane",
        action="append",
        default=[],
        metavar="wss://HOST:PORT",
        help="another control plane's agent port, when several share a PostgreSQL store: " + planes_help,
    )
    parser.add_argument(
        "--reissue",
        action="store_true",
        help=f"make the {machine} a new key and certificate even if it has valid ones",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=join_timeout,
        metavar="S",
        help=f"{join_help} (default {join_timeout:g})",
    )


def check_target(target: str) -> None:
    """`USER@HOST`, or a UsageError before anything is read."""
    from llmgw.nodeadd import ssh

    ssh.parse_target(target)


def options_from(args: argparse.Namespace, cls: type[OptionsT], **fields: Any) -> OptionsT:
    """`cls` (a flow's Options) from the flags `add_flags` and `add_link_flags` gave, and the
    flow's own `fields`; the flags are checked before server.toml is read."""
    check_target(args.target)
    link = hasattr(args, "join_timeout")
    if link:
        if args.join_timeout <= 0:
            raise UsageError(f"--join-timeout must be positive, not {args.join_timeout:g}")
        for url in args.control_plane:
            if not url.startswith("wss://"):
                raise UsageError(f"--control-plane {url!r} must be a control plane's agent port, wss://HOST:PORT")
        fields = {
            "server_address": args.server_address,
            "control_planes": tuple(dict.fromkeys(args.control_plane)),
            "reissue": args.reissue,
            "join_timeout_s": args.join_timeout,
            **fields,
        }
    server_config, state_dir = resolve_server_paths(args)
    return cls(
        target=args.target,
        server_config=server_config,
        state_dir=state_dir,
        release=args.release,
        release_via=args.release_via,
        **ssh_from(args),
        **fields,
    )


def ssh_from(args: argparse.Namespace) -> dict[str, Any]:
    """The SSH flags (llmgw.commands._options.add_ssh_options) as the toolkit's Options name them."""
    return {
        "known_hosts": args.known_hosts or default_known_hosts(),
        "identity_files": tuple(args.identity) if args.identity else None,
        "accept_new_host_key": args.accept_new_host_key,
        "ssh_port": args.port,
    }
