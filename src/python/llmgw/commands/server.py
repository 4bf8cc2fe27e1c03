"""`llmgw server`: run the control plane (agent endpoint, gateway, admin API) until interrupted.
SIGHUP (or `llmgw ctl reload`) reads server.toml again.

`llmgw server backup FILE` copies the control plane's SQLite database while the server runs;
`llmgw server migrate-store --to URL` copies its store into another, empty, one (SQLite to
PostgreSQL or back) while no server runs. The options that find the state directory
(--state-dir, --config) may come before or after the subcommand.
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
        "       %(prog)s migrate-store [--state-dir DIR] [--config FILE] [--from URL] --to URL [--json]"
    )
    parser.description = (
        "With no COMMAND: run the control plane (the agent endpoint, the gateway and the admin API) until "
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


def run(args: argparse.Namespace) -> int:
    from llmgw.server.app import serve_control_plane

    config, state_dir = resolve_server_paths(args)
    path = args.config or (DEFAULT_SERVER_CONFIG if DEFAULT_SERVER_CONFIG.exists() else None)
    return run_service("server", serve_control_plane, config, state_dir, path)


def run_backup(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmgw.paths import engine_keys_secret_path
    from llmgw.server.backup import backup

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
    from llmgw.server.migratestore import migrate_store
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
