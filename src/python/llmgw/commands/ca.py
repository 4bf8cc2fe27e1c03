"""`llmgw ca`: create the cluster's certificate authority, show it, reissue the server certificate,
issue node certificates by hand, and gateway certificates (`issue --gateway NAME`).

Runs on the control plane, which is the only machine that holds the CA key. Also owns how a
control-plane command finds its files (`add_server_options`, `resolve_server_paths`), which
`llmgw server` and `llmgw node` reuse: --state-dir, else $LLMGW_STATE_DIR, else the config's
[server].state_dir; the config is --config, else /etc/llmgw/server.toml if it exists, else the
defaults.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cryptography import x509

from llmgw.cli import Parser, add_group, add_json_flag, add_leaf
from llmgw.commands._options import add_server_options, resolve_server_paths
from llmgw.config import StoreSection
from llmgw.errors import MachineError, UsageError
from llmgw.log import get_logger
from llmgw.paths import engine_keys_secret_path, ensure_admin_token
from llmgw.pki.ca import CertInfo, cert_info, check_node_id, check_own_gateway_name, parse_sans
from llmgw.pki.files import (
    CAPaths,
    ca_paths,
    init_ca,
    issue_gateway_to_dir,
    issue_server_cert,
    issue_to_dir,
    load_ca,
    load_cert,
    write_cert,
)
from llmgw.server.store import keyseal

log = get_logger("llmgw.ca")


def configure(parser: Parser) -> None:
    sub = add_group(parser, "verb")

    init = add_leaf(sub, "init", "create the certificate authority and the agent port's certificate", run_init)
    add_server_options(init)
    init.add_argument("--validity-days", type=int, metavar="N", help="of the CA (default: [ca].ca_validity_days)")
    _add_san_option(init, required=False)
    add_json_flag(init)

    show = add_leaf(
        sub, "show", "show the CA and the server certificate: subject, fingerprint, expiry, addresses", run_show
    )
    add_server_options(show)
    add_json_flag(show)

    server = add_leaf(sub, "server-cert", "reissue the agent port's certificate for these addresses", run_server_cert)
    add_server_options(server)
    _add_san_option(server, required=True)
    server.add_argument("--validity-days", type=int, metavar="N", help="default: [ca].server_cert_validity_days")
    add_json_flag(server)

    issue = add_leaf(
        sub,
        "issue",
        "sign a node's request, make a node key and certificate by hand, or a gateway's (--gateway NAME)",
        run_issue,
    )
    add_server_options(issue)
    issue.add_argument(
        "node_id", metavar="NODE_ID", nargs="?", help="the node's hostname; becomes the certificate's CN"
    )
    issue.add_argument(
        "--gateway",
        metavar="NAME",
        help="make a gateway's key and certificate (the gateway role, CN=NAME) instead of a node's: "
        "gateway.key, gateway.crt and ca.crt, into --out DIR (default: ./gateway-NAME)",
    )
    issue.add_argument("--csr", type=Path, metavar="FILE", help="the node's request (node.csr) to sign")
    issue.add_argument(
        "--out",
        type=Path,
        metavar="PATH",
        help="with --csr: the certificate file to write (default: standard output); "
        "without: a directory to write node.key, node.crt and ca.crt into (gateway.key, gateway.crt with --gateway)",
    )
    issue.add_argument(
        "--validity-days", type=int, metavar="N", help="default: [ca].node_cert_validity_days, for gateways too"
    )


def _add_san_option(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--san",
        action="append",
        metavar="ADDR",
        required=required,
        help="an address (IP or DNS name) agents dial to reach the control plane; repeat for each"
        + ("" if required else " (default: [server].advertise, else localhost and 127.0.0.1)"),
    )


def run_init(args: argparse.Namespace) -> int:
    cfg, state_dir = resolve_server_paths(args)
    sans = args.san or list(cfg.server.advertise) or ["localhost", "127.0.0.1"]
    parse_sans(sans)  # a bad address must fail before the CA exists, not after
    ca_info = init_ca(state_dir, validity_days=_or(args.validity_days, cfg.ca.ca_validity_days))
    ca = load_ca(state_dir)
    server_info = issue_server_cert(ca, state_dir, sans, validity_days=cfg.ca.server_cert_validity_days)
    token_path = ensure_admin_token(state_dir)
    keyseal.generate(state_dir)  # made now, so that the files to copy once are all there from the start
    paths = ca_paths(state_dir)
    log.info("ca_created", dir=str(paths.dir), fingerprint=ca_info.fingerprint_sha256, sans=list(server_info.sans))
    if args.json:
        _print_json(ca_info, server_info, paths)
    else:
        print(f"created the certificate authority in {paths.dir}")
        _print_cert("CA", paths.ca_cert, ca_info)
        _print_cert("server", paths.server_cert, server_info)
        print(f"admin credential (for `llmgw ctl`, readable only by you): {token_path}")
        print(f"keep {paths.ca_key} on this machine and back it up: every node certificate hangs off it")
        print(
            f"back up {engine_keys_secret_path(state_dir)} with it: it opens the engine keys that llmgw.db holds sealed"
        )
    return 0


def run_show(args: argparse.Namespace) -> int:
    _, state_dir = resolve_server_paths(args)
    paths = ca_paths(state_dir)
    if not _exists(paths.ca_cert):
        load_ca(state_dir)  # raises the error that says how to create one
    ca_info = cert_info(load_cert(paths.ca_cert))  # the certificate only: no need to read the key
    server_info = cert_info(load_cert(paths.server_cert)) if _exists(paths.server_cert) else None
    if args.json:
        _print_json(ca_info, server_info, paths)
        return 0
    _print_cert("CA", paths.ca_cert, ca_info)
    if server_info is None:
        print(f"server: none; issue it with `llmgw ca server-cert --state-dir {state_dir} --san ADDRESS`")
    else:
        _print_cert("server", paths.server_cert, server_info)
    return 0


def run_server_cert(args: argparse.Namespace) -> int:
    cfg, state_dir = resolve_server_paths(args)
    ca = load_ca(state_dir)
    info = issue_server_cert(
        ca, state_dir, args.san, validity_days=_or(args.validity_days, cfg.ca.server_cert_validity_days)
    )
    paths = ca_paths(state_dir)
    log.info("server_cert_issued", sans=list(info.sans), fingerprint=info.fingerprint_sha256)
    if args.json:
        _print_json(None, info, paths)
    else:
        _print_cert("server", paths.server_cert, info)
        print("restart `llmgw server` so the agent port presents it")
    return 0


def run_issue(args: argparse.Namespace) -> int:
    if args.gateway is not None:
        return _issue_gateway(args)
    if args.node_id is None:
        raise UsageError(
            "name the node: `llmgw ca issue NODE_ID --csr FILE` or `--out DIR`; for a gateway, "
            "`llmgw ca issue --gateway NAME`"
        )
    if args.csr is None and args.out is None:
        raise UsageError(
            "give --csr FILE to sign a node's request (the node keeps its key), "
            "or --out DIR to make a key and certificate into DIR by hand"
        )
    if args.csr is not None and args.out is not None and args.out.is_dir():
        raise UsageError(f"with --csr, --out names the certificate file to write, and {args.out} is a directory")
    check_node_id(args.node_id)
    cfg, state_dir = resolve_server_paths(args)
    ca = load_ca(state_dir)
    days = _or(args.validity_days, cfg.ca.node_cert_validity_days)
    if args.csr is None:
        paths = issue_to_dir(ca, args.node_id, args.out, validity_days=days)
        info = cert_info(load_cert(paths.cert))
        _record(state_dir, cfg.store, args.node_id, info)
        log.info("node_cert_issued", node=args.node_id, serial=info.serial, manual=True)
        _print_cert("node", paths.cert, info)
        print(f"copy {paths.key}, {paths.cert} and {paths.ca_cert} into the node's pki directory; delete them here")
        return 0
    try:
        csr_pem = args.csr.read_bytes()
    except OSError as exc:
        raise UsageError(
            f"cannot read the request {args.csr}: {exc.strerror or exc}; pass the node's node.csr"
        ) from None
    cert_pem = ca.sign_csr(csr_pem, args.node_id, validity_days=days)
    info = cert_info(x509.load_pem_x509_certificate(cert_pem))
    _record(state_dir, cfg.store, args.node_id, info)
    log.info("node_cert_issued", node=args.node_id, serial=info.serial, manual=False)
    if args.out is None:
        print(cert_pem.decode(), end="")
    else:
        write_cert(args.out, cert_pem)
        _print_cert("node", args.out, info)
    return 0


def _issue_gateway(args: argparse.Namespace) -> int:
    """A gateway's key and certificate by hand, into a directory: the gateway makes no request
    of its own (its key is made here and copied over, as a node's is by hand)."""
    name = check_own_gateway_name(args.gateway)
    if args.node_id is not None or args.csr is not None:
        raise UsageError(
            "--gateway NAME makes a gateway's key and certificate by itself: give no NODE_ID and no --csr "
            f"(`llmgw ca issue --gateway {name} --out DIR`)"
        )
    cfg, state_dir = resolve_server_paths(args)
    ca = load_ca(state_dir)
    out = args.out if args.out is not None else Path(f"gateway-{name}")
    paths = issue_gateway_to_dir(ca, name, out, validity_days=_or(args.validity_days, cfg.ca.node_cert_validity_days))
    info = cert_info(load_cert(paths.cert))
    # Recorded under its name like a node's, so that the store knows the serial, and revoking
    # every certificate of that name (`llmgw node remove NAME`) revokes it.
    _record(state_dir, cfg.store, name, info)
    log.info("gateway_cert_issued", gateway=name, serial=info.serial)
    _print_cert("gateway", paths.cert, info)
    print(
        f"copy {paths.key}, {paths.cert} and {paths.ca_cert} into the gateway's pki directory on its machine "
        "(docs/gateway.md); delete them here"
    )
    return 0


def _record(state_dir: Path, store_settings: StoreSection, node_id: str, info: CertInfo) -> None:
    """Remember the serial, so `llmgw node remove` revokes this certificate even if it never connected.

    While a control plane runs, it alone opens its database: the serial goes through its admin
    API. With none running (no admin.url, or nothing answers there) the store server.toml's
    `[store]` names is written here, with the method the admin API uses. The store's own errors
    (locked, failed, damaged, unreachable) say what to do either way: the admin API passes them
    on with a 503."""
    from llmgw.config import storeurl
    from llmgw.ctl.client import AdminClient
    from llmgw.ctl.errors import NoControlPlane, NotAnswering
    from llmgw.server.store import Store, store_path

    try:
        admin = AdminClient.locate(server=None, credential=None, state_dir=str(state_dir))
        admin.record_certificate(info.serial, node_id, info.not_after.timestamp())
        return
    except (NoControlPlane, NotAnswering):
        where = (
            storeurl.redact(store_settings.url) if storeurl.is_postgresql(store_settings.url) else store_path(state_dir)
        )
        log.info("no_control_plane_runs", recorded_in=str(where))
    store = Store.open(state_dir, store_settings)
    try:
        store.record_issued(info.serial, node_id, info.not_after.timestamp())
        # As the admin API's route records it (`llmgw.server.admin.audit`), from this machine's shell.
        store.record_audit(
            actor="admin",
            source="local",
            action="certificate.record",
            target=node_id,
            detail={"serial": f"{info.serial:x}", "not_after": info.not_after.timestamp(), "offline": True},
        )
    finally:
        store.close()


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except PermissionError:  # the ca directory is 0700: only its owner may look inside
        raise MachineError(
            f"cannot read {path.parent}: permission denied; run as the user that owns it (e.g. with sudo)"
        ) from None


def _or(given: int | None, default: int) -> int:
    return default if given is None else given


def _print_cert(role: str, path: Path, info: CertInfo) -> None:
    print(f"{role} certificate {path}")
    print(f"  subject:     {info.subject}")
    print(f"  fingerprint: {info.fingerprint_sha256}")
    print(f"  expires:     {info.not_after:%Y-%m-%d %H:%M:%S} UTC")
    if info.sans:
        print(f"  addresses:   {', '.join(info.sans)}")


def _print_json(ca: CertInfo | None, server: CertInfo | None, paths: CAPaths) -> None:
    out: dict = {"dir": str(paths.dir)}
    if ca is not None:
        out["ca"] = {"path": str(paths.ca_cert), **_info_dict(ca)}
    out["server"] = None if server is None else {"path": str(paths.server_cert), **_info_dict(server)}
    print(json.dumps(out, indent=2))


def _info_dict(info: CertInfo) -> dict:
    return {
        "subject": info.subject,
        "issuer": info.issuer,
        "common_name": info.common_name,
        "serial": str(info.serial),  # 159 bits: JSON readers would round a number
        "fingerprint_sha256": info.fingerprint_sha256,
        "not_before": info.not_before.isoformat(),
        "not_after": info.not_after.isoformat(),
        "sans": list(info.sans),
        "is_ca": info.is_ca,
        "role": info.role,
    }
