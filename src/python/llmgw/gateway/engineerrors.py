"""An engine's error answer in OpenAI's shape. Pure: status and body in, body out.

Each engine words its errors its own way: llama.cpp sends `{"error": {"code": 400, "message",
"type": "exceed_context_size_error", ...}}`, vLLM and SGLang `{"object": "error", "message",
"type": "BadRequestError", "param", "code": 400}`. A client of the gateway gets one shape, the one
OpenAI's SDKs read (`{"error": {"message", "type", "param", "code"}}`, `code` a string or null):
the engine's message as it is, its other fields kept, the type one of OpenAI's, and a prompt
longer than the model's context as OpenAI says it (`context_length_exceeded`, param `messages`),
so `e.code` is the same whichever engine serves the model.

Only small bodies are rewritten (`MAX_REWRITTEN`, parsed on the loop); anything else, or a body
that is not such an error, is relayed as it came.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmgw.http.jsonbody import INLINE_MAX_BYTES, InvalidJson, inline, loads

MAX_REWRITTEN = INLINE_MAX_BYTES
CONTEXT_LENGTH = "context_length_exceeded"
OPENAI_TYPES = frozenset(
    {"invalid_request_error", "authentication_error", "permission_error", "not_found_error", "server_error", "requests"}
)
# How each engine says a prompt does not fit: llama.cpp's type, and the words of vLLM's and
# SGLang's messages ("This model's maximum context length is 4096 tokens", "... is longer than
# the model's context length ...").
_CONTEXT_TYPES = frozenset({"exceed_context_size_error", CONTEXT_LENGTH})
_CONTEXT_WORDS = re.compile(r"maximum context length|context length|context size|context window", re.IGNORECASE)


def normalized(status: int, body: bytes) -> bytes | None:
    """`body`, an engine's answer with the error `status` (4xx/5xx), in OpenAI's shape; None to
    relay it unchanged (not an error object, too large to parse here, already in the shape)."""
    out = openai_error(status, body)
    if out is None:
        return None
    rewritten = json.dumps({"error": out}).encode()
    return None if rewritten == body else rewritten


def openai_error(status: int, body: bytes) -> dict[str, Any] | None:
    """The error object of an engine's answer with the error `status`, in OpenAI's shape
    (`message`, `type`, `param`, `code` and the engine's other fields); None if `body` is no such
    error or is too large to parse here."""
    if status < 400 or len(body) > MAX_REWRITTEN or not inline(body):
        return None
    try:
        doc = loads(body, what="the engine's error")
    except InvalidJson:
        return None
    error = _error_object(doc)
    if error is None:
        return None
    message = error.get("message")
    if not isinstance(message, str):
        return None
    kind, code = error.get("type"), error.get("code")
    param = error.get("param") if isinstance(error.get("param"), str) else None
    if kind in _CONTEXT_TYPES or code == CONTEXT_LENGTH or (status == 400 and _CONTEXT_WORDS.search(message[:2000])):
        kind, code, param = "invalid_request_error", CONTEXT_LENGTH, param or "messages"
    else:
        if kind not in OPENAI_TYPES:
            kind = "server_error" if status >= 500 else "invalid_request_error"
        code = code if isinstance(code, str) else None
    out: dict[str, Any] = {k: v for k, v in error.items() if k not in ("object",)}
    out.update(message=message, type=kind, param=param, code=code)
    return out


def _error_object(doc: Any) -> dict[str, Any] | None:
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("error"), dict):
        return doc["error"]
    if doc.get("object") == "error" and "message" in doc:
        return doc
    return None
