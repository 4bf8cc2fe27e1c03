"""The verbs of `llmgw gateway` (llmgw.commands.gateway, which without a verb runs the gateway):

- `add USER@HOST` makes a machine a gateway over SSH (llmgw.nodeadd.gateway.flow, on the onboarding
  toolkit), drawing its steps as every `add` does (a checklist in a terminal, `--plain`, `--json`);
- `remove NAME` revokes every certificate of the gateway's name and closes its links (the control
  plane records a gateway's certificates under its name as a node's under its id, so this is
  `llmgw node remove NAME`); with `--ssh USER@HOST` it also stops and disables the unit there;
- `csr` makes (or keeps) a gateway's key and writes a request for it, on the gateway's machine:
  what `add` runs there, as the gateway's user.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmgw.cli import Parser, add_json_flag, add_leaf
from llmgw.commands._options import add_admin_options, add_server_options, add_ssh_options, client_from
from llmgw.errors import LlmgwError
from llmgw.nodeadd.flags import add_flags, add_link_flags, check_target, options_from, ssh_from
from llmgw.nodeadd.gateway import layout


def add_verbs(parser: Parser) -> None:
    """`add`, `remove` and `csr` under `parser` (`llmgw gateway`); naming none runs the gateway itself."""
    # `prog`: the verbs' usage starts "llmgw gateway add", not with the gateway's own usage lines.
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser, prog=parser.prog)
    _configure_add(
        add_leaf(
            sub,
            "add",
            "make a machine a gateway over SSH: ship llmgw, make its key there and sign its certificate here, start "
            f"{layout.UNIT_NAME}, wait until the control plane lists it linked",
            run_add,
        )
    )
    remove = add_leaf(
        sub,
        "remove",
        "revoke a gateway's certificates (of every machine serving under its name) and close its links; they "
        "cannot link again",
        run_remove,
    )
    remove.add_argument("name", metavar="NAME", help="the gateway's name (its certificate's CN)")
    remove.add_argument(
        "--ssh", metavar="USER@HOST", help=f"also log in there and stop and disable {layout.UNIT_NAME} (its files stay)"
    )
    add_ssh_options(remove)
    add_json_flag(remove)
    add_admin_options(remove)
    csr = add_leaf(
        sub,
        "csr",
        "make this gateway's key (kept if there) and write a request for it, gateway.csr, in --pki-dir "
        "(what `llmgw gateway add` runs on the machine)",
        run_csr,
    )
    csr.add_argument(
        "--pki-dir", type=Path, default=Path(layout.PKI_DIR), metavar="DIR", help=f"default {layout.PKI_DIR}"
    )
    csr.add_argument("--name", required=True, help="the gateway's name, the CN it asks for")


def _configure_add(add: argparse.ArgumentParser) -> None:
    add_flags(
        add,
        machine="machine",
        example="ubuntu@10.0.0.31",
        release_default="the control plane's release for the machine's architecture",
    )
    add.add_argument(
        "--name", default="", help="the gateway's name, its certificate's CN (default: the machine's hostname)"
    )
    add.add_argument(
        "--listen",
        default=layout.DEFAULT_LISTEN,
        metavar="ADDR:PORT",
        help=f"where clients and load balancers reach the gateway (default {layout.DEFAULT_LISTEN})",
    )
    add.add_argument(
        "--workers",
        default="1",
        metavar="N|auto",
        help="worker processes sharing the port, each about one core's worth; auto: one per CPU (default 1)",
    )
    add_link_flags(
        add,
        who="the gateway",
        machine="gateway",
        join_timeout=120.0,
        join_help="how long to wait for the control plane to list the gateway's workers linked",
        planes_help="the gateway's unit passes it as one more --server after this one's (repeatable; "
        "docs/high-availability.md)",
    )
    add_server_options(add)


def run_add(args: argparse.Namespace) -> int:
    from llmgw.nodeadd.checklist import run_checklist
    from llmgw.nodeadd.gateway import flow, steps
    from llmgw.pki.ca import check_gateway_name

    layout.check_listen(args.listen)
    layout.check_workers(args.workers)
    if args.name:
        check_gateway_name(args.name)
    opts = options_from(args, flow.Options, name=args.name, listen=args.listen, workers=args.workers)
    added = run_checklist(
        f"llmgw gateway add {args.target}",
        lambda emit, questions: flow.add_gateway(opts, emit=emit, questions=questions),
        checklist=steps.STEPS,
        plain=args.plain,
        as_json=args.json,
    )
    if isinstance(added, LlmgwError):
        return added.exit_status  # its step's `failed` line (or the screen) said what and why
    if args.json:
        print(json.dumps({"added": added.name, "server": added.server, "listen": added.listen,
                          "workers": added.workers, "version": added.version, "cert_serial": added.cert_serial,
                          "log": added.log}))  # fmt: skip
        return 0
    print(
        f"gateway {added.name} serves {added.listen} ({added.workers} worker(s)), running llmgw {added.version} "
        f"under systemd, {added.linked.removeprefix('linked: ')}; its log: {added.log}. Remove it with "
        f"`llmgw gateway remove {added.name} --ssh {args.target}`."
    )
    return 0


def run_remove(args: argparse.Namespace) -> int:
    import trio

    from llmgw.pki.ca import check_gateway_name

    check_gateway_name(args.name)
    if args.ssh:
        check_target(args.ssh)
    result = client_from(args).remove_node(args.name)
    stopped = trio.run(_stop_remote, args) if args.ssh else ""
    if args.json:
        print(json.dumps({"removed": args.name, "revoked_serials": result["revoked_serials"],
                          "link_closed": result["link_closed"], "gateway_stopped": stopped}, indent=2))  # fmt: skip
        return 0
    serials = ", ".join(result["revoked_serials"]) or "none recorded"
    print(f"gateway {args.name}: revoked certificate serials: {serials}")
    if result["link_closed"]:
        print("its open links were closed")
    print(
        stopped
        or f"stop it on its machine too: `sudo systemctl disable --now {layout.UNIT_NAME}`, or pass --ssh USER@HOST"
    )
    return 0


async def _stop_remote(args: argparse.Namespace) -> str:
    from llmgw.nodeadd import service

    async def how(s) -> tuple[list[str], str]:
        return ["systemctl", "disable", "--now", layout.UNIT_NAME], f"systemctl disable --now {layout.UNIT_NAME}"

    done = "the gateway's certificates were revoked"
    await service.stop_remote(args.ssh, **ssh_from(args), how=how, what="it", done=done, timeout_s=layout.STOP_S + 30)
    return f"stopped and disabled {layout.UNIT_NAME} on {args.ssh}; its files are left in place"


def run_csr(args: argparse.Namespace) -> int:
    from llmgw.pki.files import write_gateway_key_and_csr

    paths = write_gateway_key_and_csr(args.pki_dir, args.name)
    print(f"certificate signing request for gateway {args.name!r}: {paths.csr} (its key: {paths.key})")
    return 0
