"""The OpenAI API as the sim engine speaks it: requests checked into a `Job`, answers and stream
chunks built as plain dicts. Pure; the timing and the I/O are `app`'s.

Fields OpenAI defines that change nothing here (temperature, top_p, seed, user, ...) are
accepted and ignored, as a real engine does with sampling knobs it lacks. Fields whose value
would change the answer are checked, and a bad one is a 400 naming the field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any, Literal

import attrs

from llmgw.http.errors import HTTPError
from llmgw.simengine.fields import bad_request, boolean, json_type, show
from llmgw.simengine.text import Completion, count_tokens

Kind = Literal["chat", "completion"]
MAX_STOP = 4  # OpenAI's limit on stop sequences
# The most tokens one answer may have, as a real engine's context bounds it: an answer is built
# at once, so this bounds the time a request holds the loop (about 1 µs a token).
MAX_TOKENS = 4096

SSE_DONE = b"data: [DONE]\n\n"


@attrs.frozen(kw_only=True)
class Job:
    kind: Kind
    model: str
    prompt_key: str  # a digest of the prompt: what the answer is a function of, with the model and max_tokens
    prompt_tokens: int
    max_tokens: int
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def job_of(body: Any, kind: Kind, served_model: str, max_tokens_default: int) -> Job:
    """`parse_job` as a JSON projection (llmgw.http.jsonbody): run where the body is parsed."""
    return parse_job(kind, body, served_model=served_model, max_tokens_default=max_tokens_default)


def prompt_digest(canonical: str) -> str:
    """The prompt key of a canonical prompt: fixed-size, so what the answer costs does not grow
    with the prompt."""
    return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def parse_job(kind: Kind, body: Any, *, served_model: str, max_tokens_default: int) -> Job:
    """The job a request body asks for; `HTTPError` (400, or 404 for another model) otherwise."""
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {json_type(body)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            f"'model' must be a non-empty string, got {show(model)}; this server serves {served_model!r}"
        )
    if model != served_model:
        raise HTTPError(
            404, f"the model {model!r} does not exist; this server serves {served_model!r}", kind="not_found_error"
        )
    if kind == "chat":
        prompt_key, prompt_tokens = _messages(body.get("messages"))
        max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), max_tokens_default)
    else:
        prompt_key, prompt_tokens = _prompt(body.get("prompt"))
        max_tokens = _max_tokens(body, ("max_tokens",), max_tokens_default)
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise bad_request(f"'n' must be 1 (the sim engine makes one choice per request), got {show(n)}")
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request(f"'stream_options' must be an object, got {json_type(options)}")
    include_usage = boolean(options or {}, "include_usage", "stream_options.include_usage")
    return Job(
        kind=kind,
        model=model,
        prompt_key=prompt_key,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=boolean(body, "ignore_eos"),  # vLLM's extension: exactly max_tokens tokens
    )


def _messages(value: Any) -> tuple[str, int]:
    if not isinstance(value, list) or not value:
        raise bad_request(f"'messages' must be a non-empty array of messages, got {show(value)}")
    canonical, tokens = [], 0
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_request(f"'messages[{i}]' must be an object, got {json_type(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"'messages[{i}].role' must be a string such as \"user\", got {show(role)}")
        content = _content(message.get("content"), f"messages[{i}].content")
        canonical.append([role, content])
        tokens += count_tokens(content)
    return prompt_digest(json.dumps(canonical, ensure_ascii=False, separators=(",", ":"))), tokens


def _content(value: Any, where: str) -> str:
    """A message's text: a string, null (e.g. an assistant's tool call), or an array of parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"'{where}[{i}]' must be an object with a 'type', got {show(part)}")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"'{where}[{i}].text' must be a string, got {show(part.get('text'))}")
                texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"'{where}' must be a string or an array of content parts, got {json_type(value)}")


def _prompt(value: Any) -> tuple[str, int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        raise bad_request(
            f"'prompt' must be a string (or an array of exactly one string), got {show(value)}; "
            "send one request per prompt"
        )
    return prompt_digest(value), count_tokens(value)


def _max_tokens(body: dict[str, Any], names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
            raise bad_request(
                f"'{name}' must be a whole number from 1 to {MAX_TOKENS} (the sim engine's limit), got {show(value)}"
            )
        return value
    return default


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and len(value) <= MAX_STOP and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise bad_request(f"'stop' must be a string or an array of up to {MAX_STOP} strings, got {show(value)}")


# -- answers ------------------------------------------------------------------------------------


def usage(job: Job, completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": completion.tokens,
        "total_tokens": job.prompt_tokens + completion.tokens,
    }


def response_body(job: Job, completion: Completion, *, id: str, created: int) -> dict[str, Any]:
    """The whole answer of a request without `stream`."""
    if job.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": completion.text},
            "logprobs": None,
            "finish_reason": completion.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": completion.text, "logprobs": None, "finish_reason": completion.finish_reason}
        obj = "text_completion"
    return {
        "id": id,
        "object": obj,
        "created": created,
        "model": job.model,
        "choices": [choice],
        "usage": usage(job, completion),
    }


@attrs.frozen(kw_only=True)
class Chunks:
    """The chunks of a streamed answer, in OpenAI's shapes: `opening()` before the first token
    (the assistant's role, for chat), `token()` for each, `closing()` after the last (the finish
    reason, then usage if asked for). `app` frames each with `sse` and sends `SSE_DONE` last."""

    job: Job
    id: str
    created: int

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.job.model, "choices": choices}

    def _choice(self, content: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.job.kind == "completion":
            return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if content is not None:
            delta["content"] = content
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk([self._choice("", None, role=True)])] if self.job.kind == "chat" else []

    def token(self, piece: str) -> dict[str, Any]:
        return self._chunk([self._choice(piece, None)])

    def closing(self, completion: Completion) -> list[dict[str, Any]]:
        last = self._chunk([self._choice(None, completion.finish_reason)])
        if not self.job.include_usage:
            return [last]
        return [last, {**self._chunk([]), "usage": usage(self.job, completion)}]


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying `obj` (the `data:` field, then the blank line that ends it)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def models_body(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "llmgw-sim"}]}


def stream_events(job: Job, completion: Completion, *, id: str, created: int) -> Iterator[tuple[bool, bytes]]:
    """Every SSE event of a streamed answer as (is_token, bytes), in order; `app` waits an output
    token's time before each token event."""
    chunks = Chunks(job=job, id=id, created=created)
    for c in chunks.opening():
        yield False, sse(c)
    for piece in completion.pieces:
        yield True, sse(chunks.token(piece))
    for c in chunks.closing(completion):
        yield False, sse(c)
    yield False, SSE_DONE
