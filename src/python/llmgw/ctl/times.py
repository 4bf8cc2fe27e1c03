"""How `llmgw ctl` reads a time given on its command line (`--since`, `--until`): an age back
from now ("90s", "30m", "1h", "2d", "1w") or an ISO 8601 date or time ("2026-12-07",
"2026-12-07T10:00", "2026-12-07 10:00:00+01:00"; UTC when it names no offset, as the tables print
times). Pure: `now` is given."""

from __future__ import annotations

import argparse
import datetime as dt
import re

from llmgw.errors import UsageError

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"(\d{1,9}(?:\.\d{1,6})?)([smhdw])")


def parse_time(text: str, now: float, *, option: str = "--since") -> float:
    """`text` as unix seconds: an age before `now`, or an ISO date or time."""
    given = text.strip()
    age = _AGE.fullmatch(given)
    if age is not None:
        return now - float(age.group(1)) * UNITS[age.group(2)]
    try:
        when = dt.datetime.fromisoformat(given.replace("Z", "+00:00") if given.endswith("Z") else given)
    except ValueError:
        raise UsageError(
            f"{option} {text!r} is not a time: give an age (90s, 30m, 1h, 2d, 1w) or an ISO date or time "
            "(2026-12-07, 2026-12-07T10:00, UTC unless it names an offset)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def utc_text(at: float) -> str:
    """A unix time as the tables print it: "2026-12-07 10:00:01" (UTC)."""
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def add_period_options(parser: argparse.ArgumentParser) -> None:
    """`--since` and `--until`, as `ctl usage` and `ctl audit` take them."""
    parser.add_argument("--since", metavar="WHEN", help="from then on: an age (30m, 1h, 2d, 1w) or an ISO date or time")
    parser.add_argument("--until", metavar="WHEN", help="before then (the same forms)")


def period_query(args: argparse.Namespace, now: float) -> dict[str, str]:
    """The admin API's `since` and `until` for the options given (unix seconds, as repr)."""
    q = {}
    for option in ("since", "until"):
        given = getattr(args, option)
        if given:
            q[option] = repr(parse_time(given, now, option=f"--{option}"))
    return q
