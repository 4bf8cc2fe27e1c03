"""`llmgw server`: run the control plane (agent port, gateway, admin API) until interrupted.
SIGHUP (or `llmgw ctl reload`) reads server.toml again.

`llmgw server backup FILE` copies the control plane's SQLite database while the server runs;
`llmgw server migrate-store --to URL` copies its store into another, empty, one (SQLite to
PostgreSQL or back) while no server runs; `llmgw server check-store` says whether this machine
reaches the store server.toml names, and which it is; `llmgw server add USER@HOST` makes another
machine a second control plane on the same PostgreSQL store, over SSH (llmgw.nodeadd.server.flow,
on the onboarding toolkit).
The options that find the state directory (--state-dir, --config) may come before or after the
subcommand.
"""

from __future__ import annotations

import argparse
import json

from llmgw.cli import Parser, add_json_flag, add_leaf
from llmgw.commands._options import DEFAULT_SERVER_CONFIG, add_server_options, resolve_server_paths
from llmgw.commands._service import run_service


def configure(parser: Parser) -> None:
    parser.usage = (
        "%(prog)s [--state-dir DIR] [--config FILE] [--log-level LEVEL] [--log-format FORMAT]\n"
        "       %(prog)s backup [--state-dir DIR] [--config FILE] [--force] [--json] FILE\n"
        "       %(prog)s migrate-store [--state-dir DIR] [--config FILE] [--from URL] --to URL [--json]\n"
        "       %(prog)s check-store [--state-dir DIR] [--config FILE] [--json]\n"
        "       %(prog)s add USER@HOST [--store URL] [--advertise ADDR] [--release DIR|FILE|URL] [--plain|--json] ..."
    )
    parser.description = (
        "With no COMMAND: run the control plane (the agent port, the gateway and the admin API) until "
        "SIGTERM or Ctrl-C; SIGHUP reads server.toml again. With a COMMAND: do that instead."
    )
    add_server_options(parser)
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND", parser_class=Parser)  # none: run the server
    backup = add_leaf(
        sub,
        "backup",
        "copy the control plane's database (nodes, cordons, placements, API keys, revocations) to FILE, "
        "safely while the server runs",
        run_backup,
    )
    add_server_options(backup)
    for action in backup._actions:
        if action.dest in ("state_dir", "config"):
            # Given before `backup`, the value stays: a subcommand's defaults would overwrite it.
            action.default = argparse.SUPPRESS
    backup.add_argument("file", metavar="FILE", help="the backup to write (mode 0600); see docs/operations.md")
    backup.add_argument("--force", action="store_true", help="replace FILE if it exists (default: refuse)")
    add_json_flag(backup)
    migrate = add_leaf(
        sub,
        "migrate-store",
        "copy the control plane's store (nodes, certificates issued and revoked, API keys, catalog, placements) "
        "into another, empty, store, in one transaction, and verify it: SQLite to PostgreSQL, or back. Run it "
        "while no control plane uses either (docs/operations.md)",
        run_migrate_store,
    )
    add_server_options(migrate)
    for action in migrate._actions:
        if action.dest in ("state_dir", "config"):
            action.default = argparse.SUPPRESS
    migrate.add_argument(
        "--to",
        required=True,
        metavar="URL",
        help="the target: a PostgreSQL connection string (postgresql://USER@HOST:PORT/DBNAME, no password in it), or "
        '"sqlite" for the state directory\'s llmgw.db; it must be empty',
    )
    migrate.add_argument(
        "--from",
        dest="source",
        metavar="URL",
        help='the source, as --to (default: the store server.toml\'s [store] names, "sqlite" without one)',
    )
    migrate.add_argument(
        "--to-password-file",
        default="",
        metavar="FILE",
        help="the target's PostgreSQL password, in a file of mode 0600 (default: ~/.pgpass or PGPASSFILE)",
    )
    migrate.add_argument(
        "--from-password-file",
        default="",
        metavar="FILE",
        help="the source's, with --from (default: ~/.pgpass or PGPASSFILE)",
    )
    add_json_flag(migrate)
    check = add_leaf(
        sub,
        "check-store",
        "say whether this machine reaches the store server.toml names ([store] url, with its password_file), and "
        "which store it is; changes nothing (what `llmgw server add` runs on the new machine before starting it)",
        run_check_store,
    )
    _own_server_options(check)
    add_json_flag(check)
    _configure_add(
        add_leaf(
            sub,
            "add",
            "make another machine a control plane sharing this one's PostgreSQL store, over SSH: ship llmgw, copy the "
            "CA, the engine-key secret, the admin credential and the store's password, write its server.toml and "
            "unit, check it reaches the store, start it, and wait for its admin API to answer with the same CA",
            run_add,
        )
    )


def _own_server_options(parser: argparse.ArgumentParser) -> None:
    add_server_options(parser)
    for action in parser._actions:
        if action.dest in ("state_dir", "config"):
            action.default = argparse.SUPPRESS  # given before the verb, the value stays


def _configure_add(add: argparse.ArgumentParser) -> None:
    from llmgw.nodeadd.flags import add_flags

    add_flags(
        add,
        machine="machine",
        example="ubuntu@10.0.0.12",
        release_default="the control plane's release for the machine's architecture",
    )
    add.add_argument(
        "--store",
        default="",
        metavar="URL",
        help="the PostgreSQL url the machine reaches this control plane's store at, written to its server.toml "
        "(default: [store] url of this one's); no password in it: [store] password_file is copied",
    )
    add.add_argument(
        "--advertise",
        action="append",
        default=[],
        metavar="ADDR",
        help="an address agents and gateways dial the new control plane at, which its agent port's certificate "
        "covers (repeatable; default: the HOST of USER@HOST)",
    )
    add.add_argument(
        "--start-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="how long to wait for the new control plane's admin API to answer (default 120)",
    )
    _own_server_options(add)


def _config_path(args: argparse.Namespace):
    return getattr(args, "config", None) or (DEFAULT_SERVER_CONFIG if DEFAULT_SERVER_CONFIG.exists() else None)


def run(args: argparse.Namespace) -> int:
    from llmgw.server.app import serve_control_plane

    config, state_dir = resolve_server_paths(args)
    path = _config_path(args)
    return run_service("server", serve_control_plane, config, state_dir, path)


def run_backup(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmgw.paths import engine_keys_secret_path
    from llmgw.server.store.backup import backup

    config, state_dir = resolve_server_paths(args)
    info = backup(state_dir, Path(args.file), force=args.force, settings=config.store)
    counts = {
        "nodes": info.nodes,
        "api_keys": info.api_keys,
        "placements": info.placements,
        "revoked_certificates": info.revoked_certificates,
    }
    if args.json:
        print(json.dumps({"source": str(info.source), "backup": str(info.path), "bytes": info.size_bytes, **counts}))
    else:
        print(
            f"backed up {info.source} to {info.path} ({info.size_bytes} bytes): {info.nodes} nodes, "
            f"{info.api_keys} valid API keys, {info.placements} replica placements, "
            f"{info.revoked_certificates} revoked certificates"
        )
        if info.placements:
            print(
                f"its engine keys are sealed: they open with {engine_keys_secret_path(state_dir)}, which it does not "
                "hold; copy that file once (docs/operations.md)"
            )
    return 0


def run_migrate_store(args: argparse.Namespace) -> int:
    from llmgw.config import storeurl
    from llmgw.server.store.migratestore import migrate_store
    from llmgw.server.store.schema import TABLE_ROWS

    config, state_dir = resolve_server_paths(args)
    copied = migrate_store(
        state_dir,
        config.store,
        to=args.to,
        to_password_file=args.to_password_file,
        source=args.source,
        from_password_file=args.from_password_file,
    )
    if args.json:
        print(json.dumps({"source": copied.source, "target": copied.target, "rows": copied.rows, "verified": True}))
        return 0
    print(f"copied {copied.source} to {copied.target} in one transaction; every table read back as its source:")
    width = max(len(what) for what in TABLE_ROWS.values())
    for table, n in copied.rows.items():
        print(f"  {TABLE_ROWS[table]:<{width}}  {n}")
    if storeurl.is_postgresql(args.to):
        print(
            f'next: set [store] url = "{storeurl.redact(args.to)}" (with its user, and password_file) in server.toml, '
            "then start `llmgw server`"
        )
    else:
        print('next: remove [store] url from server.toml (or set it to "sqlite"), then start `llmgw server`')
    return 0


def run_check_store(args: argparse.Namespace) -> int:
    from llmgw.server.store.check import look

    config, state_dir = resolve_server_paths(args)
    seen = look(state_dir, config.store)
    print(json.dumps(seen.as_json()) if args.json else seen.text())
    return 0


def run_add(args: argparse.Namespace) -> int:
    from functools import partial

    import attrs

    from llmgw.config import parse_toml
    from llmgw.errors import LlmgwError, UsageError
    from llmgw.nodeadd.checklist import run_checklist
    from llmgw.nodeadd.flags import check_target, options_from
    from llmgw.nodeadd.server import flow, layout, steps
    from llmgw.server.store.check import look

    check_target(args.target)  # a bad argument is a usage error before anything is read
    if args.start_timeout <= 0:
        raise UsageError(f"--start-timeout must be positive, not {args.start_timeout:g}")
    store_url = layout.check_store_url(args.store) if args.store else ""
    path = _config_path(args)
    opts = options_from(args, flow.Options, config_path=path, advertise=tuple(args.advertise))
    source = parse_toml(path.read_text(encoding="utf-8"), str(path)) if path is not None else {}
    config = opts.server_config  # server.toml, read by options_from after the flags were checked
    opts = attrs.evolve(
        opts,
        source=source,
        store_url=store_url or config.store.url,
        look_store=partial(look, opts.state_dir, config.store),
    )
    added = run_checklist(
        f"llmgw server add {args.target}",
        lambda emit, questions: flow.add_server(opts, emit=emit, questions=questions, timeout_s=args.start_timeout),
        checklist=steps.STEPS,
        plain=args.plain,
        as_json=args.json,
    )
    if isinstance(added, LlmgwError):
        return added.exit_status  # its step's `failed` line (or the screen) said what and why
    if args.json:
        print(json.dumps({"added": added.host, "version": added.version, "ca_fingerprint": added.fingerprint,
                          "store": added.store, "changed": list(added.changed), "log": added.log}))  # fmt: skip
        return 0
    runs = (
        f"the control plane on {added.host} runs llmgw {added.version} under systemd ({layout.UNIT_NAME}), with this "
        f"cluster's CA (sha256 {added.fingerprint[:23]}...) and the store {added.store}; its log: {added.log}"
    )
    print(f"{runs}." if added.changed else f"nothing changed: {runs}.")
    return 0
