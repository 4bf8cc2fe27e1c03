"""Reading an OpenAI request's fields for the sim engine: each bad value a 400 naming the field
and what it got, in the words OpenAI's own errors use. Pure; shared by `api` and `structured`."""

from __future__ import annotations

import json
from typing import Any

from llmgw.http.errors import HTTPError


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, message, kind="invalid_request_error")


def boolean(body: dict[str, Any], name: str, where: str | None = None, *, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{where or name}' must be true or false, got {show(value)}")
    return value


def whole_number(body: dict[str, Any], name: str, low: int, high: int, why: str = "") -> int | None:
    """`body[name]`: None when absent, else a whole number from `low` to `high`."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(f"'{name}' must be a whole number from {low} to {high}{why}, got {show(value)}")
    return value


def json_type(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (dict, "an object"), (list, "an array"), (str, "a string")):
        if isinstance(value, kind):
            return name
    if value is None:
        return "null"
    return "a number" if isinstance(value, (int, float)) else type(value).__name__


def show(value: Any) -> str:
    """`value` as JSON for a message, cut to about 60 characters."""
    if isinstance(value, (dict, list)) and len(value) > 20:  # not the whole of a large value
        return f"{json_type(value)} of {len(value)} items"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."
