"""What the gateway reads of a request body: the model, whether it streams (and whether its client
asked for the usage), and, for a model routed by prefix, the prompt in blocks
(`llmgw.gateway.prefix.Prompt`). Pure; run where the body is parsed (`llmgw.http.jsonbody`: on
the loop for small bodies, in the JSON worker for large ones), so only these few fields come
back. The body itself is forwarded as it came, but for a stream's request for its usage
(`llmgw.gateway.usage`).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from llmgw.gateway.prefix import BLOCK_CHARS, MAX_BLOCKS, Prompt
from llmgw.gateway.usage import usage_options
from llmgw.http.jsonbody import InvalidJson


@attrs.frozen(kw_only=True)
class PrefixModels:
    """The models whose requests are routed by prefix, and how their prompts are cut."""

    models: frozenset[str] = frozenset()
    block_chars: int = BLOCK_CHARS
    max_blocks: int = MAX_BLOCKS


NO_PREFIX = PrefixModels()


@attrs.frozen(kw_only=True)
class RequestFields:
    model: str
    stream: bool
    # The prompt in blocks, for a model routed by prefix; None for others, or a body without one.
    prompt: Prompt | None = None
    # A stream's: whether the client asked for the usage (`stream_options.include_usage`), and the
    # body to send for one that sent `stream_options` without asking (`gateway.usage.usage_options`).
    include_usage: bool = False
    usage_body: bytes = b""
    # The longest answer it asks for (`max_tokens`, `max_completion_tokens` or the Responses API's
    # `max_output_tokens`; None: not said) times its choices (`n`): what a token budget reserves
    # for it (`llmgw.gateway.budgets.estimate`). Not checked here: the engine answers a bad one.
    max_tokens: int | None = None


def request_fields(body: Any, prefix: PrefixModels = NO_PREFIX) -> RequestFields:
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
    if model in prefix.models:
        prompt = Prompt.of(body, model, block_chars=prefix.block_chars, max_blocks=prefix.max_blocks)
    include_usage, usage_body = usage_options(body) if stream else (False, b"")
    return RequestFields(
        model=model,
        stream=bool(stream),
        prompt=prompt,
        include_usage=include_usage,
        usage_body=usage_body,
        max_tokens=_longest_answer(body),
    )


def _longest_answer(body: dict) -> int | None:
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            n = body.get("n", 1)
            return value * (n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 128 else 1)
    return None


def slot_tasks(body: Any) -> list[int]:
    """The task ids in llama-server's `GET /slots` answer: a slot that has run a task says its
    id (`id_task`); [] for anything else."""
    if not isinstance(body, list):
        return []
    tasks = (s.get("id_task") for s in body if isinstance(s, dict))
    return [t for t in tasks if isinstance(t, int) and not isinstance(t, bool)]


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
