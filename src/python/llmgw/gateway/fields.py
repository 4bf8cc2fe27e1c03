"""What the gateway reads of a request body: the model, whether it streams, and the prompt's
start for prefix affinity. Pure; run where the body is parsed (`llmgw.http.jsonbody`: on the
loop for small bodies, in the JSON worker for large ones), so only these few fields come back.
The body itself is forwarded as it came.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import attrs

from llmgw.http.jsonbody import InvalidJson

AFFINITY_SOURCE_CHARS = 4096  # of the rendered messages, at most: the prefix is cut from these


@attrs.frozen(kw_only=True)
class RequestFields:
    model: str
    stream: bool
    # The prompt's first `affinity_chars` characters (at most AFFINITY_SOURCE_CHARS), for prefix
    # affinity; None when affinity is off.
    prompt: str | None


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
        chars = min(affinity_chars, AFFINITY_SOURCE_CHARS)
        if "prompt" in body:
            prompt = body["prompt"] if isinstance(body["prompt"], str) else None
        else:
            prompt = _rendered(body.get("messages"), chars)
        if prompt is not None:
            prompt = prompt[:chars]
    return RequestFields(model=model, stream=bool(stream), prompt=prompt)


def _rendered(messages: Any, chars: int) -> str | None:
    """The messages as JSON text, `json.dumps(messages)` without its closing bracket (so that a
    conversation's text starts as its next turn's does), exact in its first `chars` characters
    at least: rendered one by one and stopped once long enough, each message cut first (`_cut`)
    so that a long system prompt is not serialised whole."""
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    size = 1  # the rendering's length: "[", the parts, ", " between them
    for message in messages:
        part = json.dumps(_cut(message, chars))
        size += len(part) + (2 if parts else 0)
        parts.append(part)
        if size >= chars:
            break
    return "[" + ", ".join(parts)


def _cut(value: Any, chars: int, levels: int = 3) -> Any:
    """`value` with its strings longer than `chars` cut to `chars` and its lists and objects
    longer than `chars` items cut to `chars` items, `levels` deep (a message, its fields, the
    parts of its content): rendered, it is what `json.dumps(value)` renders up to its first cut,
    and at least `chars` characters follow the start of a cut in either (JSON escapes only
    lengthen a string; an item renders as one character at least), so the first `chars`
    characters of the two agree, and of the messages' rendering too."""
    if isinstance(value, str):
        return value[:chars] if len(value) > chars else value
    if not levels:
        return value
    if isinstance(value, dict):
        return {k: _cut(v, chars, levels - 1) for k, v in itertools.islice(value.items(), chars)}
    if isinstance(value, list):
        return [_cut(v, chars, levels - 1) for v in value[:chars]]
    return value


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
