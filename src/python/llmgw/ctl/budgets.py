"""`llmgw ctl budgets`: token budgets of keys and teams, set, listed (with what each spent in its
period and what remains) and removed through the admin API (docs/gateway.md, "Budgets")."""

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

ClientFrom = Callable[[argparse.Namespace], AdminClient]
PERIODS = ("minute", "day", "month")


def configure_budgets(
    sub: Any,
    add_admin_options: Callable[[argparse.ArgumentParser], None],
    client_from: ClientFrom,
) -> None:
    budgets = sub.add_parser(
        "budgets",
        help="token budgets of keys and teams: set, list, remove",
        description="token budgets of keys and teams (prompt plus completion tokens a minute, day or month, UTC)",
    )
    verbs = add_group(budgets, "budgets_verb")
    setting = add_leaf(
        verbs, "set", "set a budget (or a new amount for one there)", partial(run_budgets_set, client_from)
    )
    scope = setting.add_mutually_exclusive_group(required=True)
    scope.add_argument("--key", metavar="NAME", help="the key's budget")
    scope.add_argument("--team", metavar="NAME", help="the team's budget: all its keys together")
    setting.add_argument("--model", default="", metavar="MODEL", help="for this model alone (default: every model)")
    setting.add_argument("--period", required=True, choices=PERIODS, help="per minute, day or month (UTC)")
    setting.add_argument(
        "--tokens", required=True, type=int, metavar="N", help="prompt plus completion tokens a period"
    )
    listing = add_leaf(
        verbs, "list", "list the budgets, with what each spent in its period", partial(run_budgets_list, client_from)
    )
    remove = add_leaf(verbs, "remove", "remove a budget", partial(run_budgets_remove, client_from))
    remove.add_argument("id", help="the budget's id, as `llmgw ctl budgets list` shows it (KIND:NAME:MODEL:PERIOD)")
    for leaf in (setting, listing, remove):
        add_json_flag(leaf)
        add_admin_options(leaf)


def run_budgets_set(client_from: ClientFrom, args: argparse.Namespace) -> int:
    kind, name = ("key", args.key) if args.key is not None else ("team", args.team)
    body = {"scope_kind": kind, "scope": name, "model": args.model, "period": args.period, "tokens": args.tokens}
    result = client_from(args).request("POST", "/admin/v1/budgets", body)
    budget = result["budget"]
    if args.json:
        print(json.dumps(budget, indent=2))
    else:
        print(f"budget {budget['id']}: {budget['tokens']} tokens a {budget['period']}")
    return 0


def run_budgets_list(client_from: ClientFrom, args: argparse.Namespace) -> int:
    budgets = client_from(args).request("GET", "/admin/v1/budgets")["budgets"]
    if args.json:
        print(json.dumps(budgets, indent=2))
        return 0
    if not budgets:
        print("no budgets: set one with `llmgw ctl budgets set --key NAME --period day --tokens N`")
        return 0
    rows = [("ID", "KEY/TEAM", "MODEL", "PERIOD", "TOKENS", "SPENT", "REMAINING", "RESETS (UTC)")]
    for b in budgets:
        rows.append(
            (
                b["id"],
                f"{b['scope_kind']} {b['scope']}",
                b["model"] or "all",
                b["period"],
                b["tokens"],
                "-" if b["spent"] is None else b["spent"],
                "-" if b["remaining"] is None else b["remaining"],
                "-" if b["resets_at"] is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(b["resets_at"])),
            )
        )
    print(table(rows))
    return 0


def run_budgets_remove(client_from: ClientFrom, args: argparse.Namespace) -> int:
    result = client_from(args).request("DELETE", f"/admin/v1/budgets/{quote(args.id, safe='')}")
    print(json.dumps(result, indent=2) if args.json else f"removed budget {result['removed']}")
    return 0
