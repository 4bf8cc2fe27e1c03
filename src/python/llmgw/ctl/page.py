"""`llmgw ctl page`: a one-time URL that logs a browser into the cluster page.

The admin credential mints the login (POST /admin/v1/page/login); the URL holds only a code the
control plane remembers, good once and for a few minutes, never the credential itself.
Read-only unless `--actions`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from llmgw.cli import add_json_flag, add_leaf
from llmgw.ctl.client import AdminClient


def page_url(client: AdminClient, *, actions: bool) -> dict[str, Any]:
    answer = client.request("POST", "/admin/v1/page/login", {"actions": actions})
    return {**answer, "url": client.url + answer["path"]}


def configure_page(
    sub: Any,
    add_admin_options: Callable[[argparse.ArgumentParser], None],
    client_from: Callable[[argparse.Namespace], AdminClient],
) -> None:
    def run(args: argparse.Namespace) -> int:
        login = page_url(client_from(args), actions=args.actions)
        if args.json:
            print(json.dumps({"url": login["url"], "expires_in_s": login["expires_in_s"], "actions": login["actions"]}))
            return 0
        minutes = f"{login['expires_in_s'] / 60:g}"
        print(login["url"])
        print(
            f"Open it within {minutes} minutes; it works once. The session it starts is "
            + (
                "allowed to cordon, drain and revoke."
                if args.actions
                else "read-only (--actions for one that may act)."
            )
        )
        return 0

    leaf = add_leaf(
        sub,
        "page",
        "print a one-time URL that opens the cluster page in a browser (the credential stays here)",
        run,
    )
    leaf.add_argument(
        "--actions",
        action="store_true",
        help="the page may cordon, uncordon, drain and revoke keys (default: read-only)",
    )
    add_json_flag(leaf)
    add_admin_options(leaf)
