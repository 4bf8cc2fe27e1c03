"""The OpenAI API as the sim engine speaks it: requests checked into a `Job`, answers and stream
chunks built as plain dicts. Pure; the timing and the I/O are `app`'s.

Fields OpenAI defines that change nothing here (temperature, top_p, seed, user, ...) are
accepted and ignored, as a real engine does with sampling knobs it lacks. Fields whose value
would change the answer are checked, and a bad one is a 400 naming the field. Tool calls and
`response_format` are decided while the body is parsed (`structured`): the job carries that
answer. Logprobs are made up per token (`logprobs`).

A request may carry the start of its answer, to be continued (request migration): a chat whose
last message is the assistant's, without tool calls (llama.cpp's assistant prefill; vLLM's and
SGLang's `continue_final_message` with `add_generation_prompt` false), is answered as the
messages before it, from word k on, k the words of that message; a completions prompt that ends
with the start of its own answer, as `continuation.split` finds it. Only a text answer is
continued: tool calls and JSON are made whole (a chat's as for the messages before the partial
answer, as an engine's grammar starts again; a completion's for the whole prompt).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import attrs

from llmgw.http.errors import HTTPError
from llmgw.simengine import continuation, structured
from llmgw.simengine.fields import bad_request, boolean, json_type, show, whole_number
from llmgw.simengine.logprobs import MAX_TOP, Logprobs
from llmgw.simengine.text import Completion, ToolCall, complete, count_tokens, prompt_digest

Kind = Literal["chat", "completion"]
MAX_STOP = 4  # OpenAI's limit on stop sequences
# The most tokens one answer may have, as a real engine's context bounds it: an answer is built
# at once, so this bounds the time a request holds the loop (about 1 µs a token).
MAX_TOKENS = 4096

SSE_DONE = b"data: [DONE]\n\n"
# Logprob values built between two checkpoints of a whole answer (`whole_body`): about 3 ms.
SLICE_VALUES = 1024


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
    logprobs: int | None = None  # alternatives per token when logprobs are asked for
    answer: Completion | None = None  # decided with the body (tool calls, JSON); else text, made later
    start: int = 0  # the text answer's first word: the words of a partial answer the request continues


def job_of(body: Any, kind: Kind, served_model: str, max_tokens_default: int) -> Job:
    """`parse_job` as a JSON projection (llmgw.http.jsonworkers): run where the body is parsed."""
    return parse_job(kind, body, served_model=served_model, max_tokens_default=max_tokens_default)


def parse_job(kind: Kind, body: Any, *, served_model: str, max_tokens_default: int) -> Job:
    """The job a request body asks for; `HTTPError` (400, or 404 for another model) otherwise."""
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {json_type(body)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(f"'model' must be a non-empty string, got {show(model)}; this server serves {served_model!r}")
    if model != served_model:
        raise HTTPError(
            404, f"the model {model!r} does not exist; this server serves {served_model!r}", kind="not_found_error"
        )
    ignore_eos = boolean(body, "ignore_eos")  # vLLM's extension: exactly max_tokens tokens
    if kind == "chat":
        prompt_key, prompt_tokens, turn, start = _messages(body.get("messages"))
        text_key = prompt_key
        _continue_final_message(body)
        max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), max_tokens_default)
        logprobs = _chat_logprobs(body)
    else:
        prompt = _prompt(body.get("prompt"))
        if isinstance(body["prompt"], str):  # an array (of one prompt) is taken whole
            split = continuation.split(model, prompt, ignore_eos=ignore_eos)
        else:
            split = continuation.whole(prompt)
        prompt_key, prompt_tokens, turn = split.prompt_key, count_tokens(prompt), structured.Turn()
        text_key, start = split.answer_key, split.start
        max_tokens = _max_tokens(body, ("max_tokens",), max_tokens_default)
        logprobs = whole_number(body, "logprobs", 0, MAX_TOP, " (alternatives per token)")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise bad_request(f"'n' must be 1 (the sim engine makes one choice per request), got {show(n)}")
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request(f"'stream_options' must be an object, got {json_type(options)}")
    include_usage = boolean(options or {}, "include_usage", "stream_options.include_usage")
    stop = _stop(body.get("stop"))
    answer = structured.decide(
        kind, body, model=model, prompt_key=prompt_key, max_tokens=max_tokens, stop=stop, turn=turn
    )
    if answer is not None:  # made whole, for the prompt as it is
        text_key, start = prompt_key, 0
    elif start and kind == "completion" and split.at and not prompt[split.at - 1].isspace():
        # P and the answer's first word ran together ("Say:" "the"): counted apart, the prompt's
        # tokens are P's and the words sent since, as a chat's are.
        prompt_tokens += 1
    return Job(
        kind=kind,
        model=model,
        prompt_key=text_key,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        answer=answer,
        start=start,
    )


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    top = whole_number(body, "top_logprobs", 0, MAX_TOP, " (alternatives per token)")
    if not boolean(body, "logprobs"):
        if top is not None:
            raise bad_request(f"'top_logprobs' {top} needs 'logprobs': true")
        return None
    return top or 0


def _continue_final_message(body: dict[str, Any]) -> None:
    # vLLM's rule, in its words: the final message is continued, or a new one is opened.
    if boolean(body, "continue_final_message") and boolean(body, "add_generation_prompt", default=True):
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
            "('add_generation_prompt' is true unless given); send \"add_generation_prompt\": false "
            "to continue the final message"
        )


def _messages(value: Any) -> tuple[str, int, structured.Turn, int]:
    """The prompt key, the prompt's tokens, the turn (`structured.Turn`), and the word the
    answer starts at. An assistant's tool calls and a tool result's call id are part of the
    prompt; a message's other fields (name, refusal, ...) are not.

    A last message from the assistant without tool calls is the start of the answer: the key
    and the turn are those of the messages before it, and the answer starts at its word count.
    Its words are prompt tokens all the same, as an engine reads them."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"'messages' must be a non-empty array of messages, got {show(value)}")
    canonical: list[list[Any]] = []
    tokens, role, before, last_user = 0, "", "", ""
    for i, message in enumerate(value):
        before = role
        if not isinstance(message, dict):
            raise bad_request(f"'messages[{i}]' must be an object, got {json_type(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"'messages[{i}].role' must be a string such as \"user\", got {show(role)}")
        content = _content(message.get("content"), f"messages[{i}].content")
        entry: list[Any] = [role, content]
        tokens += count_tokens(content)
        calls = message.get("tool_calls")
        if calls is not None:  # only when present, so that a plain conversation's key is as it was
            entry.append(_tool_calls(calls, f"messages[{i}].tool_calls"))
            tokens += sum(count_tokens(arguments) for _, _, arguments in entry[-1])
        if role == "tool":
            call = message.get("tool_call_id")
            if not isinstance(call, str):
                raise bad_request(
                    f"'messages[{i}].tool_call_id' must be a string, the id of the tool call this result "
                    f"answers, got {show(call)}"
                )
            entry.append(call)
        elif role == "user":
            last_user = content
        canonical.append(entry)
    start = 0
    if role == "assistant" and not value[-1].get("tool_calls"):
        start, role = count_tokens(canonical.pop()[1]), before
    key = prompt_digest(json.dumps(canonical, ensure_ascii=False, separators=(",", ":")))
    return key, tokens, structured.Turn(last_role=role, last_user_text=last_user), start


def _tool_calls(value: Any, where: str) -> list[tuple[str, str, str]]:
    """An assistant message's `tool_calls` as (id, name, arguments)."""
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be an array of tool calls, got {json_type(value)}")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise bad_request(
                f"'{where}[{i}]' must be a tool call: "
                f'{{"id": ID, "type": "function", "function": {{"name": NAME, "arguments": JSON_TEXT}}}}, got {show(call)}'
            )
        ident = call.get("id")
        calls.append((ident if isinstance(ident, str) else "", function["name"], function["arguments"]))
    return calls


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


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        raise bad_request(
            f"'prompt' must be a string (or an array of exactly one string), got {show(value)}; "
            "send one request per prompt"
        )
    return value


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


def answer_of(job: Job) -> Completion:
    """What the job is answered: the answer decided with the body, or the prompt's text."""
    if job.answer is not None:
        return job.answer
    return complete(job.model, job.prompt_key, job.max_tokens, job.stop, job.ignore_eos, job.start)


def usage(job: Job, completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": completion.tokens,
        "total_tokens": job.prompt_tokens + completion.tokens,
    }


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_text}}


def _logprobs(job: Job, completion: Completion) -> dict[str, Any] | None:
    if job.logprobs is None:
        return None
    made = Logprobs(job.model, job.prompt_key, job.logprobs)
    if job.kind == "completion":
        return made.completion(completion.pieces, job.start)
    if completion.tool_calls:  # OpenAI gives none for a tool call's arguments
        return {"content": None, "refusal": None}
    return made.chat(completion.pieces, job.start)


def response_body(job: Job, completion: Completion, *, id: str, created: int) -> dict[str, Any]:
    """The whole answer of a request without `stream` (`whole_body` is the same, as bytes built
    in steps)."""
    if job.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": completion.text}
        if completion.tool_calls:
            message = {"role": "assistant", "content": None, "tool_calls": [_tool_call(c) for c in completion.tool_calls]}  # fmt: skip
        choice = {
            "index": 0,
            "message": message,
            "logprobs": _logprobs(job, completion),
            "finish_reason": completion.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": completion.text,
            "logprobs": _logprobs(job, completion),
            "finish_reason": completion.finish_reason,
        }
        obj = "text_completion"
    return {
        "id": id,
        "object": obj,
        "created": created,
        "model": job.model,
        "choices": [choice],
        "usage": usage(job, completion),
    }


def whole_body(job: Job, completion: Completion, *, id: str, created: int) -> Iterator[bytes | None]:
    """`response_body` as JSON bytes (the last item), built in steps: between two of them (each
    `None`) the caller lets other tasks run. Logprobs may be 86,000 values (4,096 tokens and 20
    alternatives each, 6 MB of JSON), 0.3 s of work in one go; a slice of `SLICE_VALUES` is a
    few ms, each slice is encoded as it is made, and the body is joined in one copy."""
    if job.logprobs is None or (job.kind == "chat" and completion.tool_calls):
        yield _dumps(response_body(job, completion, id=id, created=created)).encode() + b"\n"
        return
    made = Logprobs(job.model, job.prompt_key, job.logprobs)
    pieces = completion.pieces
    step = max(1, SLICE_VALUES // (job.logprobs + 1))
    keys = ("content",) if job.kind == "chat" else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    fragments: dict[str, list[bytes]] = {key: [] for key in keys}  # each slice's arrays, encoded
    offset = 0
    for start in range(0, len(pieces), step):
        part = pieces[start : start + step]
        if job.kind == "chat":
            made_slice = made.chat(part, job.start + start)
        else:
            made_slice = made.completion(part, job.start + start, offset)
            offset += sum(map(len, part))
        for key in keys:
            fragments[key].append(_dumps(made_slice[key])[1:-1].encode())  # the array's inside
        yield None
    body = _dumps(response_body(attrs.evolve(job, logprobs=None), completion, id=id, created=created)).encode()
    # The first `"logprobs":null` is choices[0]'s: nothing before it is the client's, and a quote
    # inside a JSON string is escaped, so no string can hold this text.
    at = body.index(b'"logprobs":null')
    out = [body[:at], b'"logprobs":{']
    for i, key in enumerate(keys):
        out += [b"," if i else b"", b'"', key.encode(), b'":[', b",".join(fragments[key]), b"]"]
    out += [b',"refusal":null}' if job.kind == "chat" else b"}", body[at + len(b'"logprobs":null') :], b"\n"]
    yield b"".join(out)  # the megabytes copied once


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))  # as `Response.json` writes it


@attrs.frozen(kw_only=True)
class Chunks:
    """The chunks of a streamed answer, in OpenAI's shapes: `opening()` before the first token
    (the assistant's role, for chat, and a first tool call's id and name), `token()` for each
    token of the content, `call()` for each further tool call's id and name, `arguments()` for
    each token of a call's arguments, `closing()` after the last (the finish reason, then usage
    if asked for). `app` frames each with `sse` and sends `SSE_DONE` last."""

    job: Job
    id: str
    created: int

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.job.model, "choices": choices}

    def _delta(self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return self._chunk([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def opening(self, completion: Completion) -> list[dict[str, Any]]:
        if self.job.kind != "chat":
            return []
        if completion.tool_calls:
            head = self._header(0, completion.tool_calls[0])
            return [self._delta({"role": "assistant", "content": None, "tool_calls": [head]})]
        return [self._delta({"role": "assistant", "content": ""})]

    def token(self, piece: str, index: int = 0, offset: int = 0, logprobs: Logprobs | None = None) -> dict[str, Any]:
        """The chunk of the content's token `piece`, the `index`-th, at character `offset`."""
        if self.job.kind == "completion":
            lp = None if logprobs is None else logprobs.completion((piece,), index, offset)
            return self._chunk([{"index": 0, "text": piece, "logprobs": lp, "finish_reason": None}])
        lp = None if logprobs is None else {"content": [logprobs.chat_entry(index, piece)], "refusal": None}
        return self._delta({"content": piece}, logprobs=lp)

    def _header(self, index: int, call: ToolCall) -> dict[str, Any]:
        return {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}

    def call(self, index: int, call: ToolCall) -> dict[str, Any]:
        return self._delta({"tool_calls": [self._header(index, call)]})

    def arguments(self, index: int, piece: str) -> dict[str, Any]:
        return self._delta({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})

    def closing(self, completion: Completion) -> list[dict[str, Any]]:
        if self.job.kind == "chat":
            last = self._delta({}, completion.finish_reason)
        else:
            last = self._chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": completion.finish_reason}])
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
    for c in chunks.opening(completion):
        yield False, sse(c)
    for i, call in enumerate(completion.tool_calls):
        if i:
            yield False, sse(chunks.call(i, call))
        for piece in call.arguments:
            yield True, sse(chunks.arguments(i, piece))
    logprobs = None if job.logprobs is None else Logprobs(job.model, job.prompt_key, job.logprobs)
    offset = 0
    for index, piece in enumerate(completion.pieces, job.start):
        yield True, sse(chunks.token(piece, index, offset, logprobs))
        offset += len(piece)
    for c in chunks.closing(completion):
        yield False, sse(c)
    yield False, SSE_DONE
