"""What a request names, read strictly: query parameters, whole numbers, flags, ids in paths.

Every refusal is `HTTPError(400)` whose message names the parameter, the value given (cut
short when long: a request head may be 16 KiB) and what is accepted. Nothing here lets a
malformed value reach a place where it would fail as a bug instead:

- whole numbers are ASCII digits only (`str.isdigit` also takes '²', which `int` refuses),
  bounded in length before `int` runs (CPython refuses strings of more than 4300 digits with a
  ValueError), then bounded in value, so that what passes fits SQLite's 64-bit integers;
- a query parameter is given at most once and must be one the route takes: a typo
  (`?forse=1`) or a repeat (`?lines=5&lines=500`) is refused, never silently ignored or
  half-used. Routes that take none refuse any;
- an id in a path is percent-decoded as UTF-8 (invalid UTF-8 is refused, not replaced); the
  caller then checks it against the id's grammar.

Used by the admin API and the cluster page (`llmgw.server.admin.api`, `llmgw.server.admin.page`). The
gateway's OpenAI routes do not use `query`: OpenAI's clients add parameters of their own
(`api-version`), which the gateway ignores as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import unquote

from llmgw.errors import cut, shown
from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request


def query(request: Request, takes: Mapping[str, str]) -> dict[str, str]:
    """The query's parameters by name, each given once, every name one of `takes` (name ->
    what it takes, for the message). A parameter given without `=` has the value ""."""
    unknown = sorted(set(request.query) - set(takes))
    if unknown:
        accepted = (
            "it takes " + "; ".join(f"{name}: {what}" for name, what in takes.items())
            if takes
            else "it takes no query parameters"
        )
        raise HTTPError(400, f"{cut(request.path)} has no query parameter {shown(unknown[0])}; {accepted}")
    repeated = next((name for name, values in request.query.items() if len(values) > 1), None)
    if repeated is not None:
        raise HTTPError(400, f"query parameter {repeated} is given {len(request.query[repeated])} times; give it once")
    return {name: values[0] for name, values in request.query.items()}


def whole_number(value: str, name: str, low: int, high: int) -> int:
    """`value` as a whole number from `low` to `high` (0 <= low <= high), in ASCII digits."""
    digits = value.lstrip("0") or "0"
    # The length first: `int` of a long string is slow, and refused past 4300 digits.
    if value.isascii() and value.isdigit() and len(digits) <= len(str(high)):
        number = int(digits)
        if low <= number <= high:
            return number
    raise HTTPError(400, f"{name} must be a whole number from {low} to {high}, got {shown(value)}")


FLAG_VALUES = {"1": True, "true": True, "0": False, "false": False}


def flag(value: str, name: str) -> bool:
    """`value` as true or false: 1, true, 0 or false."""
    if value in FLAG_VALUES:
        return FLAG_VALUES[value]
    raise HTTPError(400, f"{name} must be 1 or 0 (or true or false), got {shown(value)}")


def path_segment(raw: str, what: str) -> str:
    """A percent-encoded path segment, decoded; 400 if the bytes are not UTF-8."""
    try:
        return unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise HTTPError(400, f"{what} {shown(raw)} is not valid UTF-8 once percent-decoded") from None
