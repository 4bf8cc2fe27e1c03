"""`llmgw node`: a node's membership of the cluster.

`add USER@HOST` onboards a machine over SSH (llmgw.nodeadd.node.flow, on the onboarding
toolkit), drawing its steps as a checklist in a terminal, one line per step elsewhere
(`--plain`), or one JSON object per event (`--json`). `remove NODE` forgets a node and revokes its certificate; with `--ssh USER@HOST` it
also stops and disables the agent there.
"""

from __future__ import annotations

import argparse
import json

from llmgw import driverpaths
from llmgw.cli import Parser, add_group, add_json_flag, add_leaf, fabric_arg
from llmgw.commands._options import add_admin_options, add_server_options, add_ssh_options, client_from
from llmgw.errors import LlmgwError
from llmgw.nodeadd.flags import add_flags, add_link_flags, check_target, options_from, ssh_from


def configure(parser: Parser) -> None:
    sub = add_group(parser, "verb")
    add = add_leaf(
        sub,
        "add",
        "make a machine a node over SSH: ship llmgw, run doctor, issue its certificate, start its agent, "
        "wait for it to join",
        run_add,
    )
    add_flags(
        add,
        machine="node",
        example="ubuntu@10.0.0.21",
        release_default="the control plane's release for the node's architecture ([release] in server.toml)",
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
        "--no-system-trust",
        action="store_true",
        help="leave the node's system trust store alone (the agent trusts only its own pki/ca.crt); for an OS "
        "whose store llmgw does not know",
    )
    add_link_flags(
        add,
        who="the agent",
        machine="node",
        join_timeout=600.0,
        join_help="how long to wait for the agent to join and check llama.cpp without news from the node: the "
        "wait goes on while the node reports install progress",
        planes_help="the node's agent.toml names it after this one's, and the agent tries each in turn (repeatable; "
        "docs/high-availability.md)",
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
    from llmgw.nodeadd.checklist import run_checklist
    from llmgw.nodeadd.node import flow, steps

    opts = options_from(
        args,
        flow.Options,
        fabrics=tuple(args.fabric),
        ignore_doctor=frozenset(n.strip() for item in args.ignore_doctor for n in item.split(",") if n.strip()),
        system_trust=not args.no_system_trust,
        llamacpp_bin=args.llamacpp_bin,
        vllm_bin=args.vllm_bin,
        sglang_python=args.sglang_python,
        driver_paths=driverpaths.given(args),
    )
    added = run_checklist(
        f"llmgw node add {args.target}",
        lambda emit, questions: flow.add_node(opts, emit=emit, questions=questions),
        checklist=steps.STEPS,
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


def _added_text(added) -> str:
    return (
        f"node {added.node_id} joined, running llmgw {added.version} under {added.service}; "
        f"its log: {added.log}. See it with `llmgw ctl nodes`."
    )


# -- remove --------------------------------------------------------------------------------


def run_remove(args: argparse.Namespace) -> int:
    import trio

    if args.ssh:
        check_target(args.ssh)
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
    from llmgw.nodeadd import service
    from llmgw.nodeadd.node import install, layout

    async def how(s) -> tuple[list[str], str]:
        probe = await s.run(["sh", "-c", layout.PROBE], timeout_s=60)
        return install.stop_argv(layout.parse_probe(probe.stdout).systemd)

    done = "the node was removed from the cluster"
    words = await service.stop_remote(args.ssh, **ssh_from(args), how=how, what="its agent", done=done, timeout_s=120)
    return f"stopped and disabled the agent on {args.ssh} ({words}); its files are left in place"
