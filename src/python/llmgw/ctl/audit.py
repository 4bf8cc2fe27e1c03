"""`llmgw ctl audit`: the audit log of admin actions (`GET /admin/v1/audit`), newest first: who
made each (`admin`, the credential; `page:SESSION`, a cluster page session), when, from where,
what and on what, with what changed. `--since`/`--until` take an age (1h, 2d) or an ISO date or
time (`llmgw.ctl.times`)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlencode

from llmgw.cli import add_json_flag, add_leaf
from llmgw.ctl.client import AdminClient
from llmgw.ctl.tables import table
from llmgw.ctl.times import add_period_options, period_query, utc_text
from llmgw.errors import UsageError

ClientFrom = Callable[[argparse.Namespace], AdminClient]
MAX_LIMIT = 10_000  # the admin API's
DETAIL_CHARS = 100  # a row's DETAIL cell, cut past this (--json has it whole)


def configure_audit(
    sub: Any,
    add_admin_options: Callable[[argparse.ArgumentParser], None],
    client_from: ClientFrom,
) -> None:
    leaf = add_leaf(
        sub,
        "audit",
        "the audit log: every admin action, who made it, when, from where and what changed (newest first)",
        partial(run_audit, client_from),
    )
    add_period_options(leaf)
    leaf.add_argument("--action", metavar="A", help="one action (key.create) or a family of them (key)")
    leaf.add_argument("--actor", metavar="X", help="admin, page (every page session) or page:SESSION")
    leaf.add_argument("--target", metavar="NAME", help="what was acted on: a key's, node's or model's name")
    leaf.add_argument(
        "--limit", type=int, default=100, metavar="N", help=f"at most N entries, 1 to {MAX_LIMIT} (default 100)"
    )
    add_json_flag(leaf)
    add_admin_options(leaf)


def query(args: argparse.Namespace, now: float) -> dict[str, Any]:
    """The admin API's query for the command's options."""
    if not 1 <= args.limit <= MAX_LIMIT:
        raise UsageError(f"--limit must be from 1 to {MAX_LIMIT}, got {args.limit}")
    q: dict[str, Any] = {"limit": args.limit}
    q.update(period_query(args, now))
    for option in ("action", "actor", "target"):
        given = getattr(args, option)
        if given:
            q[option] = given
    return q


def run_audit(client_from: ClientFrom, args: argparse.Namespace) -> int:
    q = query(args, time.time())
    entries = client_from(args).request("GET", "/admin/v1/audit?" + urlencode(q))["entries"]
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    print(format_audit(entries))
    if len(entries) == args.limit:
        print(f"(the newest {args.limit}; --limit or --until for more)")
    return 0


def format_audit(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "no audit entries (for these filters)"
    rows = [("TIME (UTC)", "ACTOR", "SOURCE", "ACTION", "TARGET", "DETAIL")]
    for e in entries:
        rows.append(
            (
                utc_text(e["at"]),
                e["actor"],
                e["source"] or "-",
                e["action"],
                e["target"] or "-",
                detail_text(e["detail"]),
            )
        )
    return table(rows)


def detail_text(detail: dict[str, Any]) -> str:
    """`{"models": ["chat"], "force": false}` as `models=chat force=false`, cut at DETAIL_CHARS."""
    parts = []
    for key, value in detail.items():
        if isinstance(value, list):
            shown = ",".join(str(v) for v in value) or "[]"
        elif isinstance(value, (dict, bool)) or value is None:
            shown = json.dumps(value, separators=(",", ":"))
        else:
            shown = str(value)
        parts.append(f"{key}={shown}")
    text = " ".join(parts) or "-"
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 1] + "…"
