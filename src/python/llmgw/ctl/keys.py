"""`llmgw ctl keys`: the gateway's API keys, created, listed and revoked through the admin API.
A key's token is printed once, when it is created; the control plane keeps only its hash."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import quote

from llmgw.cli import add_group, add_json_flag, add_leaf
from llmgw.ctl.client import AdminClient
from llmgw.ctl.tables import table

ClientFrom = Callable[[argparse.Namespace], AdminClient]  # the admin client the command's options name


def configure_keys(
    sub: Any,
    add_admin_options: Callable[[argparse.ArgumentParser], None],
    client_from: ClientFrom,
) -> None:
    keys = sub.add_parser(
        "keys", help="the gateway's API keys: create, list, revoke", description="the gateway's API keys"
    )
    verbs = add_group(keys, "keys_verb")
    create = add_leaf(
        verbs, "create", "create an API key; its token is printed this once", partial(run_keys_create, client_from)
    )
    create.add_argument("name", help="a name for the key: who or what uses it")
    create.add_argument("--models", nargs="+", metavar="MODEL", default=[], help="models it may use (default: all)")
    create.add_argument(
        "--rate-per-minute",
        type=int,
        default=0,
        metavar="N",
        help="requests per minute it may make (default: no limit)",
    )
    create.add_argument(
        "--max-concurrency", type=int, default=0, metavar="N", help="requests it may have in flight (default: no limit)"
    )
    create.add_argument(
        "--team", default="", metavar="T", help="the team it belongs to, whose usage it counts under (`ctl teams`)"
    )
    listing = add_leaf(verbs, "list", "list the API keys (never their tokens)", partial(run_keys_list, client_from))
    revoke = add_leaf(
        verbs, "revoke", "revoke an API key: its next request is refused", partial(run_keys_revoke, client_from)
    )
    revoke.add_argument("name", help="the key's name, as `llmgw ctl keys list` shows it")
    for leaf in (create, listing, revoke):
        add_json_flag(leaf)
        add_admin_options(leaf)


def run_keys_create(client_from: ClientFrom, args: argparse.Namespace) -> int:
    body = {
        "name": args.name,
        "models": args.models,
        "rate_per_minute": args.rate_per_minute,
        "max_concurrency": args.max_concurrency,
    }
    if args.team:
        body["team"] = args.team
    result = client_from(args).request("POST", "/admin/v1/keys", body)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"created API key {result['key']['name']!r}; its token, shown only this once:")
        print(result["token"])
    return 0


def run_keys_list(client_from: ClientFrom, args: argparse.Namespace) -> int:
    keys = client_from(args).request("GET", "/admin/v1/keys")["keys"]
    if args.json:
        print(json.dumps(keys, indent=2))
        return 0
    if not keys:
        print("no API keys: create one with `llmgw ctl keys create NAME`")
        return 0
    rows = [("NAME", "TEAM", "MODELS", "RATE/MIN", "CONCURRENCY", "CREATED", "STATE")]
    for k in keys:
        rows.append(
            (
                k["name"],
                k.get("team") or "-",
                ",".join(k["models"]) or "all",
                k["rate_per_minute"] or "-",
                k["max_concurrency"] or "-",
                time.strftime("%Y-%m-%d %H:%M", time.gmtime(k["created_at"])),
                "revoked" if k["revoked_at"] else "valid",
            )
        )
    print(table(rows))
    return 0


def run_keys_revoke(client_from: ClientFrom, args: argparse.Namespace) -> int:
    result = client_from(args).request("DELETE", f"/admin/v1/keys/{quote(args.name, safe='')}")
    print(json.dumps(result, indent=2) if args.json else f"revoked API key {result['revoked']!r}")
    return 0
