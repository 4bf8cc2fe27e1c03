"""`llmgw ctl usage` and `llmgw ctl teams`: who used what, through the admin API.

`ctl usage` prints the ledger's totals (`GET /admin/v1/usage`) per key, team and model (or per
`--by` of them), with requests, prompt, cached and completion tokens, largest first, and a total;
`--key`, `--team`, `--model` keep one of each; `--since`/`--until` take an age (1h, 2d) or an ISO
date or time (`llmgw.ctl.times`), cut at whole hours (UTC); `--json` or `--csv` for programs.
`ctl teams create|list|remove`: the teams keys belong to (`llmgw ctl keys create NAME --team T`);
a team with valid keys is not removed."""

from __future__ import annotations

import argparse
import csv
import io
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import quote, urlencode

from llmgw.cli import add_group, add_json_flag, add_leaf
from llmgw.ctl.client import AdminClient
from llmgw.ctl.tables import table
from llmgw.ctl.times import add_period_options, period_query, utc_text
from llmgw.errors import UsageError

ClientFrom = Callable[[argparse.Namespace], AdminClient]
GROUPS = ("key", "team", "model")
COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")


def configure_usage(
    sub: Any,
    add_admin_options: Callable[[argparse.ArgumentParser], None],
    client_from: ClientFrom,
) -> None:
    leaf = add_leaf(
        sub,
        "usage",
        "who used what: requests and tokens per key, team and model, from the usage ledger",
        partial(run_usage, client_from),
    )
    only = leaf.add_mutually_exclusive_group()
    only.add_argument("--key", metavar="K", help="one key's usage")
    only.add_argument("--team", metavar="T", help="one team's usage")
    leaf.add_argument("--model", metavar="M", help="one model's usage")
    add_period_options(leaf)
    leaf.add_argument(
        "--by",
        metavar="FIELDS",
        default="key,team,model",
        help="a total per these, a comma list of key, team, model (default: all three; '' one total)",
    )
    output = leaf.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the admin API's JSON")
    output.add_argument("--csv", action="store_true", help="print CSV: a header, then a row per total")
    add_admin_options(leaf)


def configure_teams(
    sub: Any,
    add_admin_options: Callable[[argparse.ArgumentParser], None],
    client_from: ClientFrom,
) -> None:
    teams = sub.add_parser(
        "teams", help="the teams API keys belong to: create, list, remove", description="the teams API keys belong to"
    )
    verbs = add_group(teams, "teams_verb")
    create = add_leaf(verbs, "create", "create a team", partial(run_teams_create, client_from))
    create.add_argument("name", help="the team's name")
    listing = add_leaf(
        verbs, "list", "list the teams and how many valid keys each has", partial(run_teams_list, client_from)
    )
    remove = add_leaf(
        verbs,
        "remove",
        "remove a team (refused while a valid key belongs to it)",
        partial(run_teams_remove, client_from),
    )
    remove.add_argument("name", help="the team's name, as `llmgw ctl teams list` shows it")
    for leaf in (create, listing, remove):
        add_json_flag(leaf)
        add_admin_options(leaf)


def usage_query(args: argparse.Namespace, now: float) -> dict[str, str]:
    """The admin API's query for the command's options."""
    by = [g.strip() for g in args.by.split(",") if g.strip()]
    bad = [g for g in by if g not in GROUPS]
    if bad:
        raise UsageError(f"--by takes a comma list of {', '.join(GROUPS)}, got {args.by!r}")
    q = {"group": ",".join(by)}
    for option in ("key", "team", "model"):
        given = getattr(args, option)
        if given:
            q[option] = given
    q.update(period_query(args, now))
    return q


def run_usage(client_from: ClientFrom, args: argparse.Namespace) -> int:
    result = client_from(args).request("GET", "/admin/v1/usage?" + urlencode(usage_query(args, time.time())))
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.csv:
        print(format_csv(result), end="")
    else:
        print(format_usage(result))
    return 0


def format_usage(result: dict[str, Any]) -> str:
    group = result["group"]
    when = f"from {result['since'] or 'the start'} until {result['until'] or 'now'} (whole hours, UTC)"
    if not result["usage"]:
        return f"no usage {when} (for these filters)"
    head = tuple(g.upper() for g in group) + ("REQUESTS", "PROMPT", "CACHED", "COMPLETION", "TOTAL")
    rows: list[tuple] = [head]
    rows += [tuple(r[g] or "-" for g in group) + tuple(r[c] for c in COUNTS) for r in result["usage"]]
    if group and len(result["usage"]) > 1:
        label = ("total",) + ("",) * (len(group) - 1)
        rows.append(label + tuple(result["total"][c] for c in COUNTS))
    return table(rows) + f"\n{when}"


def format_csv(result: dict[str, Any]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*result["group"], *COUNTS])
    for r in result["usage"]:
        writer.writerow([*(r[g] for g in result["group"]), *(r[c] for c in COUNTS)])
    return out.getvalue()


def run_teams_create(client_from: ClientFrom, args: argparse.Namespace) -> int:
    result = client_from(args).request("POST", "/admin/v1/teams", {"name": args.name})
    print(json.dumps(result, indent=2) if args.json else f"created team {result['team']['name']!r}")
    return 0


def run_teams_list(client_from: ClientFrom, args: argparse.Namespace) -> int:
    teams = client_from(args).request("GET", "/admin/v1/teams")["teams"]
    if args.json:
        print(json.dumps(teams, indent=2))
    elif not teams:
        print("no teams: create one with `llmgw ctl teams create NAME`")
    else:
        rows = [("NAME", "KEYS", "CREATED (UTC)")]
        rows += [(t["name"], t["keys"], utc_text(t["created_at"])) for t in teams]
        print(table(rows))
    return 0


def run_teams_remove(client_from: ClientFrom, args: argparse.Namespace) -> int:
    result = client_from(args).request("DELETE", f"/admin/v1/teams/{quote(args.name, safe='')}")
    print(json.dumps(result, indent=2) if args.json else f"removed team {result['removed']!r}")
    return 0
