"""`llmgw node`: a node's membership of the cluster.

`add USER@HOST` onboards a machine over SSH (llmgw.nodeadd.flow), drawing its steps as a
checklist in a terminal, one line per step elsewhere (`--plain`), or one JSON object per event
(`--json`). `remove NODE` forgets a node and revokes its certificate; with `--ssh USER@HOST` it
also stops and disables the agent there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import trio

from llmgw import driverpaths
from llmgw.cli import Parser, add_group, add_json_flag, add_leaf, fabric_arg
from llmgw.commands._options import (
    add_admin_options,
    add_server_options,
    add_ssh_options,
    client_from,
    default_known_hosts,
    resolve_server_paths,
)
from llmgw.errors import LlmgwError, UsageError
from llmgw.nodeadd import steps
from llmgw.nodeadd.questions import Questions, Unattended

T = TypeVar("T")


def configure(parser: Parser) -> None:
    sub = add_group(parser, "verb")
    add = add_leaf(
        sub,
        "add",
        "make a machine a node over SSH: ship llmgw, run doctor, issue its certificate, start its agent, "
        "wait for it to join",
        run_add,
    )
    add.add_argument("target", metavar="USER@HOST", help="how to log in to the machine, e.g. ubuntu@10.0.0.21")
    add.add_argument(
        "--release",
        metavar="DIR|FILE|URL",
        default="",
        help="the release to install: a directory with llmgw-VERSION-linux-ARCH.pyz and SHA256SUMS, one .pyz, or "
        "the URL of such a directory (fetched by the node); default: the control plane's release for the node's "
        "architecture ([release] in server.toml)",
    )
    add.add_argument(
        "--release-via",
        choices=("ssh", "https"),
        default="",
        help="without --release, how the control plane's release reaches the node: https, the node downloads it "
        "from the control plane's agent port; ssh, it is copied over SSH, for a node that cannot reach the "
        "control plane that way (default: https when the control plane holds the node's file, else ssh)",
    )
    add.add_argument(
        "--fabric",
        action="append",
        type=fabric_arg,
        default=[],
        metavar="NAME[:ADAPTER,...]",
        help="the fabric a group of the node's adapters is on, e.g. ib-a:mlx5_0,mlx5_1 (repeatable; in a "
        "terminal you are asked)",
    )
    add.add_argument(
        "--ignore-doctor",
        action="append",
        default=[],
        metavar="CHECK[,CHECK]",
        help="go on although doctor's CHECK fails on the node (in a terminal you are asked)",
    )
    add.add_argument(
        "--reissue", action="store_true", help="make the node a new key and certificate even if it has valid ones"
    )
    add.add_argument(
        "--no-system-trust",
        action="store_true",
        help="leave the node's system trust store alone (the agent trusts only its own pki/ca.crt); for an OS "
        "whose store llmgw does not know",
    )
    add.add_argument(
        "--server-address",
        metavar="ADDR",
        default="",
        help="the address the agent dials (default: this machine's address on the route to the node); the "
        "server certificate must cover it",
    )
    add.add_argument(
        "--control-plane",
        action="append",
        default=[],
        metavar="wss://HOST:PORT",
        help="another control plane's agent endpoint, when several share a PostgreSQL store: the node's agent.toml "
        "names it after this one's, and the agent tries each in turn (repeatable; docs/high-availability.md)",
    )
    add.add_argument(
        "--join-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="how long to wait for the agent to join and check llama.cpp without news from the node: the wait "
        "goes on while the node reports install progress (default 600)",
    )
    engines = add.add_argument_group('engines you installed yourself (used when the engine\'s version is "")')
    engines.add_argument("--llamacpp-bin", default="", metavar="PATH", help="llama-server on the node")
    engines.add_argument("--vllm-bin", default="", metavar="PATH", help="the vllm command on the node")
    engines.add_argument("--sglang-python", default="", metavar="PATH", help="the Python of SGLang on the node")
    where = add.add_argument_group(
        "where the driver tools are on the node (written to its agent.toml and used by the doctor run there; "
        "not given: the value of its agent.toml from an earlier add, else the usual place)"
    )
    driverpaths.add_options(where, absolute=True, overrides="the node's agent.toml")
    out = add.add_mutually_exclusive_group()
    out.add_argument("--plain", action="store_true", help="one line per step, even in a terminal")
    out.add_argument("--json", action="store_true", help="one JSON object per event")
    add_ssh_options(add)
    add_server_options(add)

    remove = add_leaf(
        sub,
        "remove",
        "forget a node and revoke its certificate; its open link is closed and it cannot connect again",
        run_remove,
    )
    remove.add_argument("node", help="node id")
    remove.add_argument(
        "--ssh", metavar="USER@HOST", help="also log in there and stop and disable the agent (its files stay)"
    )
    add_ssh_options(remove)
    add_json_flag(remove)
    add_admin_options(remove)


# -- add -----------------------------------------------------------------------------------


def run_add(args: argparse.Namespace) -> int:
    from llmgw.nodeadd import flow, ssh

    ssh.parse_target(args.target)  # a bad target is a usage error before anything is read
    if args.join_timeout <= 0:
        raise UsageError(f"--join-timeout must be positive, not {args.join_timeout:g}")
    for url in args.control_plane:
        if not url.startswith("wss://"):
            raise UsageError(f"--control-plane {url!r} must be a control plane's agent endpoint, wss://HOST:PORT")
    server_config, state_dir = resolve_server_paths(args)
    opts = flow.Options(
        target=args.target,
        server_config=server_config,
        state_dir=state_dir,
        known_hosts=args.known_hosts or default_known_hosts(),
        identity_files=tuple(args.identity) if args.identity else None,
        accept_new_host_key=args.accept_new_host_key,
        ssh_port=args.port,
        release=args.release,
        release_via=args.release_via,
        server_address=args.server_address,
        control_planes=tuple(dict.fromkeys(args.control_plane)),
        fabrics=tuple(args.fabric),
        ignore_doctor=frozenset(n.strip() for item in args.ignore_doctor for n in item.split(",") if n.strip()),
        reissue=args.reissue,
        system_trust=not args.no_system_trust,
        join_timeout_s=args.join_timeout,
        llamacpp_bin=args.llamacpp_bin,
        vllm_bin=args.vllm_bin,
        sglang_python=args.sglang_python,
        driver_paths=driverpaths.given(args),
    )
    added = run_checklist(
        f"llmgw node add {args.target}",
        lambda emit, questions: flow.add_node(opts, emit=emit, questions=questions),
        plain=args.plain,
        as_json=args.json,
    )
    if isinstance(added, LlmgwError):
        return added.exit_status  # its step's `failed` line (or the screen) said what and why
    if args.json:
        print(json.dumps({"added": added.node_id, "server": added.server, "version": added.version,
                          "service": added.service, "cert_serial": added.cert_serial, "log": added.log}))  # fmt: skip
    else:
        print(_added_text(added))
    return 0


def run_checklist(
    title: str,
    body: Callable[[Callable[[steps.Event], None], Questions], Awaitable[T]],
    *,
    checklist: steps.Steps = steps.STEPS,
    plain: bool,
    as_json: bool,
) -> T | LlmgwError:
    """Run `body(emit, questions)` (a flow of `checklist`'s steps) under the checklist screen in a
    terminal, else printing one line per step (`plain`) or one JSON object per event (`as_json`),
    with unattended answers. A failure comes back, not raised: its step has shown it already."""
    if not (plain or as_json) and sys.stdin.isatty() and sys.stdout.isatty():
        from llmgw.nodeadd.screen import run_with_screen

        try:
            return trio.run(run_with_screen, title, body, checklist)
        except LlmgwError as exc:
            return exc  # the screen has printed the checklist and the failure
    render = steps.json_line if as_json else partial(steps.plain_line, steps=checklist)

    def emit(event: steps.Event) -> None:
        line = render(event)
        if line is not None:
            print(line, flush=True)

    try:
        return trio.run(body, emit, Unattended())
    except LlmgwError as exc:
        return exc


def _added_text(added) -> str:
    return (
        f"node {added.node_id} joined, running llmgw {added.version} under {added.service}; "
        f"its log: {added.log}. See it with `llmgw ctl nodes`."
    )


# -- remove --------------------------------------------------------------------------------


def run_remove(args: argparse.Namespace) -> int:
    if args.ssh:
        from llmgw.nodeadd import ssh

        ssh.parse_target(args.ssh)
    result = client_from(args).remove_node(args.node)
    stopped = ""
    if args.ssh:
        stopped = trio.run(_stop_remote, args)
    if args.json:
        print(json.dumps({**result, "agent_stopped": stopped}, indent=2))
        return 0
    serials = ", ".join(result["revoked_serials"]) or "none recorded"
    print(f"removed {result['removed']}; revoked certificate serials: {serials}")
    if result["link_closed"]:
        print("its open link was closed")
    if stopped:
        print(stopped)
    else:
        print(
            "stop the agent on the machine too: `sudo systemctl disable --now llmgw-agent`, or where it runs "
            "without systemd `sudo llmgw agent stop`; or pass --ssh USER@HOST to have it done"
        )
    return 0


async def _stop_remote(args: argparse.Namespace) -> str:
    from llmgw.errors import PeerError
    from llmgw.nodeadd import install, layout, ssh

    async with ssh.open_session(
        args.ssh,
        known_hosts=args.known_hosts or default_known_hosts(),
        accept_new_host_key=args.accept_new_host_key,
        client_keys=tuple(args.identity) if args.identity else None,
        port=args.port,
    ) as s:
        probe = await s.run(["sh", "-c", layout.PROBE], timeout_s=60)
        facts = layout.parse_probe(probe.stdout)
        if facts.systemd:
            argv = ["systemctl", "disable", "--now", layout.UNIT_NAME]
            how = f"systemctl disable --now {layout.UNIT_NAME}"
        else:
            argv = install.stop_supervisor_argv()
            how = f"llmgw agent stop --pid-file {layout.PID_FILE}"
        res = await s.run(argv, sudo=True, timeout_s=120)
        if res.exit_status != 0:
            raise PeerError(
                f"the node was removed from the cluster, but stopping its agent on {args.ssh} failed "
                f"({how}: exit status {res.exit_status}: {(res.stderr or res.stdout).strip()[-400:]}); "
                "stop it there by hand"
            )
        return f"stopped and disabled the agent on {args.ssh} ({how}); its files are left in place"
