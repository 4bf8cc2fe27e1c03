"""What the gateway reads of a request body: the model, whether it streams, and the prompt's
start for prefix affinity. Pure; run where the body is parsed (`llmgw.http.jsonbody`: on the
loop for small bodies, in the JSON worker for large ones), so only these few fields come back.
The body itself is forwarded as it came.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from llmgw.http.jsonbody import InvalidJson

AFFINITY_SOURCE_CHARS = 4096  # of the rendered messages, at most: the prefix is cut from these


@attrs.frozen(kw_only=True)
class RequestFields:
    model: str
    stream: bool
    prompt: str | None  # the prompt's start, for prefix affinity; None when affinity is off


def request_fields(body: Any, affinity_chars: int) -> RequestFields:
    """The fields of a forwarded request's body, or `InvalidJson` naming what is wrong."""
    if not isinstance(body, dict):
        raise InvalidJson(f"request body must be a JSON object, got {_json_type(body)}")
    model = body.get("model")
    if "model" not in body:
        raise InvalidJson(
            "'model' is missing: name a model (GET /v1/models lists them)",
            code="missing_required_parameter",
            param="model",
        )
    if not isinstance(model, str) or not model:
        raise InvalidJson(
            f"'model' must be a non-empty string naming a model (GET /v1/models lists them), got {_show(model)}",
            code="invalid_type",
            param="model",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, (bool, type(None))):
        raise InvalidJson(f"'stream' must be true or false, got {_show(stream)}", code="invalid_type", param="stream")
    prompt = None
    if affinity_chars:
        if "prompt" in body:
            prompt = body["prompt"] if isinstance(body["prompt"], str) else None
        else:
            prompt = _rendered(body.get("messages"))
        if prompt is not None:
            prompt = prompt[:AFFINITY_SOURCE_CHARS]
    return RequestFields(model=model, stream=bool(stream), prompt=prompt)


def _rendered(messages: Any) -> str | None:
    """The messages as text, in order, far enough for an affinity prefix: rendered one by one
    and stopped once long enough, so a long conversation is not serialised whole."""
    if not isinstance(messages, list):
        return None
    parts, size = [], 0
    for message in messages:
        part = json.dumps(message)
        parts.append(part)
        size += len(part)
        if size >= AFFINITY_SOURCE_CHARS:
            break
    return "[" + ", ".join(parts)


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (dict, "an object"), (list, "an array"), (str, "a string")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else "a number"


def _show(value: Any) -> str:
    """A value for a message, bounded whatever its size."""
    if isinstance(value, (dict, list)):
        return f"{_json_type(value)} of {len(value)} items"
    text = json.dumps(value[:60] if isinstance(value, str) else value)
    return text if len(text) <= 60 else text[:57] + "..."
