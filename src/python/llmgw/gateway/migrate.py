"""Answers that survive: what a streamed answer continued on another replica is made of. Pure.

A streamed chat or text completion is relayed in whole SSE events (`Events`: the bytes up to the
last blank line go out, a torn event's start waits for its end), and the events sent are kept,
bounded (`MAX_KEPT_BYTES`). When the replica relaying it fails mid-answer (reset, engine exit,
node lost, silent past the stall limit), the gateway (`llmgw.gateway.job`) asks another replica
to continue it from what the client has (`Sent.of`, `continuation`), in each engine's way:

- chat: the conversation plus an assistant message holding the answer so far, to be continued,
  with `continue_final_message: true` and `add_generation_prompt: false` (vLLM's and SGLang's
  way; llama.cpp takes a final assistant message as the start of its answer, its prefill, either
  way, but only the flag tells it the message is a continuation: without it llama-server b11434
  streams the message's text back in its first event, and the client would get it twice); the
  sim as either.
- text completions: the prompt plus the text so far.
- `max_tokens` / `max_completion_tokens` less what was generated (one token per event that
  carried text: llama.cpp, vLLM, SGLang and the sim send one each).

The continuation's events are rewritten (`Rewrite`) so the client sees one stream: the first
answer's `id` and `created`, the continuation's opening role-only delta dropped, its usage counting
the tokens generated before as completion, not prompt; and a comment line before `[DONE]`
(`: llmgw migrated N`), since the answer's headers went out before.

Not every answer can be continued exactly (`not_exact`): with `n` > 1 (several choices, each at
its own point), a tool call under way (its arguments are not text the engine can resume),
`echo` (the prompt comes back first), `suffix`, `best_of`, or a constrained output (`response_format`,
`guided_*`: the grammar would start over mid-value). Those end with an error event naming why.
Sampling with a seed, and logprobs, continue: the rest is sampled by the new replica (not the
words that seed would have given from there), each token's logprobs its own.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ROUTES = frozenset({CHAT, COMPLETIONS})
# The events of one answer kept for a continuation: past this the answer is relayed on but cannot
# be continued (a runaway answer does not hold memory without bound). About 10,000 tokens' events.
MAX_KEPT_BYTES = 2 << 20
# Asked with continue_final_message; the sim: a final assistant message alone (it takes either).
_FLAG_ENGINES = frozenset({"vllm", "sglang", "llamacpp"})
_CONSTRAINED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema")


# What every stream of one gateway process keeps, together: past it a stream keeps nothing more
# and cannot be continued (a thousand long answers at once do not take gigabytes).
MAX_KEPT_TOTAL_BYTES = 256 << 20


class KeptBudget:
    """The bytes all streams of a process keep for a continuation, bounded."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int = MAX_KEPT_TOTAL_BYTES) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class Events:
    """A stream cut at its events' boundaries: `feed` returns the bytes up to the last blank line
    so far (whole events, to send), keeping the rest for the next piece; those sent are kept
    (`kept`) until `MAX_KEPT_BYTES`, or the process's `KeptBudget` is spent. Linear in the bytes
    fed: each is scanned for a boundary once (a boundary split across two pieces is found by
    looking one byte back). `release` gives the budget back (the stream ended)."""

    __slots__ = ("_tail", "_kept", "kept_bytes", "overflow", "budget")

    def __init__(self, budget: KeptBudget | None = None) -> None:
        self._tail = bytearray()
        self._kept: list[bytes] = []
        self.kept_bytes = 0
        self.overflow = False  # more than MAX_KEPT_BYTES sent, or no budget left: not kept, not continued
        self.budget = budget if budget is not None else KeptBudget()

    def release(self) -> None:
        self.budget.give(self.kept_bytes)
        self.kept_bytes = 0
        self._kept = []

    def feed(self, piece: bytes) -> bytes:
        tail = self._tail
        start = max(0, len(tail) - 1)
        tail += piece
        end = tail.rfind(b"\n\n", start)
        if end < 0:
            if len(tail) > MAX_KEPT_BYTES:  # not SSE after all, or one giant event: passed on, not kept
                self._overflow()
                return self.rest()
            return b""
        whole = bytes(tail[: end + 2])
        del tail[: end + 2]
        if not self.overflow:
            if self.kept_bytes + len(whole) > MAX_KEPT_BYTES or not self.budget.take(len(whole)):
                self._overflow()
            else:
                self.kept_bytes += len(whole)
                self._kept.append(whole)
        return whole

    def _overflow(self) -> None:
        self.release()
        self.overflow = True

    def rest(self) -> bytes:
        """What came after the last whole event (at the stream's clean end: sent as it is)."""
        out = bytes(self._tail)
        self._tail.clear()
        return out

    @property
    def kept(self) -> bytes:
        return b"".join(self._kept)


def data_of(events: bytes) -> list[str]:
    """The `data:` payloads of whole SSE events, in order (multi-line data joined by newlines)."""
    out = []
    for event in events.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines).decode("utf-8", "replace"))
    return out


@attrs.frozen(kw_only=True)
class Sent:
    """What the client has of an answer: its identity and its text so far, and whether it can be
    continued (`not_exact`: why not)."""

    id: str = ""
    created: int = 0
    text: str = ""
    tokens: int = 0  # events that carried text: one token each
    finished: str = ""  # a finish_reason seen: the answer was over but for its last events
    usage_sent: bool = False
    done: bool = False  # [DONE] sent
    not_exact: str = ""

    @classmethod
    def of(cls, route: str, events: bytes) -> Sent:
        reading = Reading(route)
        for data in data_of(events):
            reading.add(data)
        return reading.sent()


class Reading:
    """`Sent` read one event's data at a time (the caller may yield between them: an answer of
    many events is not read in one go on the loop)."""

    def __init__(self, route: str) -> None:
        self.route = route
        self.id, self.created, self.pieces, self.tokens = "", 0, [], 0
        self.finished, self.usage, self.done, self.why = "", False, False, ""

    def add(self, data: str) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            self.why = self.why or "an event of the answer was not JSON"
            return
        if not isinstance(chunk, dict):
            return
        if not self.id and isinstance(chunk.get("id"), str):
            self.id = chunk["id"]
            self.created = chunk["created"] if isinstance(chunk.get("created"), int) else 0
        if chunk.get("usage"):
            self.usage = True
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.why = self.why or "the answer has several choices (n > 1)"
                continue
            if choice.get("finish_reason"):
                self.finished = str(choice["finish_reason"])
            if self.route == CHAT:
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict):
                    continue
                if delta.get("tool_calls") or delta.get("function_call"):
                    self.why = self.why or "a tool call was under way"
                text = delta.get("content")
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                self.pieces.append(text)
                self.tokens += 1

    def sent(self) -> Sent:
        return Sent(
            id=self.id,
            created=self.created,
            text="".join(self.pieces),
            tokens=self.tokens,
            finished=self.finished,
            usage_sent=self.usage,
            done=self.done,
            not_exact=self.why,
        )


def not_exact(route: str, body: dict[str, Any]) -> str:
    """Why an answer to `body` cannot be continued exactly whatever it holds so far ("": it can)."""
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return "the answer has several choices (n > 1)"
    if route == COMPLETIONS:
        if body.get("echo"):
            return "the prompt is echoed (echo)"
        if body.get("suffix"):
            return "the answer is an insertion before a suffix (suffix)"
        best = body.get("best_of")
        if isinstance(best, int) and best > 1:
            return "best_of > 1"
        if not isinstance(body.get("prompt"), str):
            return "the prompt is not one string"
    elif not isinstance(body.get("messages"), list):
        return "the request has no list of messages"
    for key in _CONSTRAINED:
        value = body.get(key)
        if value and not (key == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            return f"the output is constrained ({key}): a grammar does not resume mid-answer"
    return ""


def remaining(body: dict[str, Any], used: int) -> tuple[dict[str, Any], bool]:
    """`body` with its token limits less `used`, and whether any room is left (False: the limit
    was reached, the answer is over)."""
    out, left = dict(body), True
    for key in ("max_completion_tokens", "max_tokens"):
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            out[key] = limit - used
            left = left and limit - used >= 1
    return out, left


def continuation(route: str, engine: str, body: dict[str, Any], sent: Sent) -> dict[str, Any]:
    """The request that continues `sent` on a replica of `engine` (the limits already less what was used)."""
    out = dict(body)
    if route == CHAT:
        out["messages"] = [*body["messages"], {"role": "assistant", "content": sent.text}]
        if engine in _FLAG_ENGINES:
            out["continue_final_message"] = True
            out["add_generation_prompt"] = False
    else:
        out["prompt"] = body["prompt"] + sent.text
    return out


NOT_EXACT, FINISHED = "not_exact", "finished"


def continuation_payload(body: Any, route: str, engine: str, text: str, tokens: int) -> tuple[str, str, bytes]:
    """From the client's request `body` (parsed) and what it has of the answer: ("", "", the
    continuation's body to send), (NOT_EXACT, why, b"") or (FINISHED, "", b"": its token limit
    was reached). A module-level function of plain arguments: the gateway's JSON workers run it
    for a large body (`llmgw.http.jsonworkers`), the loop for a small one."""
    if not isinstance(body, dict):
        return NOT_EXACT, "its body is not a JSON object", b""
    why = not_exact(route, body)
    if why:
        return NOT_EXACT, why, b""
    body, left = remaining(body, tokens)
    if not left:
        return FINISHED, "", b""
    made = continuation(route, engine, body, Sent(text=text, tokens=tokens))
    return "", "", json.dumps(made, separators=(",", ":"), ensure_ascii=False).encode()


def encode(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class Rewrite:
    """A continuation's events as the client's one stream goes on: `id` and `created` the first
    answer's, the opening role-only delta dropped (the client has had its role), the usage adding
    the tokens sent before as completion tokens (the engine counted them as prompt), and a comment
    before `[DONE]` saying how many times the answer moved."""

    def __init__(self, route: str, sent: Sent, migrations: int) -> None:
        self.route, self.sent, self.migrations = route, sent, migrations

    def events(self, whole: bytes) -> bytes:
        out = bytearray()
        for data in data_of(whole):
            if data.strip() == "[DONE]":
                out += f": llmgw migrated {self.migrations}\n\n".encode() + b"data: [DONE]\n\n"
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                out += b"data: " + data.encode() + b"\n\n"
                continue
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk and "choices" not in chunk:
                out += encode(chunk)
                continue
            chunk = self._chunk(chunk)
            if chunk is not None:
                out += encode(chunk)
        return bytes(out)

    def _chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        sent = self.sent
        if sent.id:
            chunk["id"] = sent.id
        if sent.created:
            chunk["created"] = sent.created
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                usage = dict(usage)
                usage["prompt_tokens"] = max(0, prompt - sent.tokens)
                usage["completion_tokens"] = completion + sent.tokens
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                chunk["usage"] = usage
        if self.route == CHAT:
            choices = []
            for choice in chunk.get("choices") or ():
                delta = dict(choice.get("delta") or {})
                delta.pop("role", None)
                if not delta.get("content") and len(delta) <= 1 and not choice.get("finish_reason"):
                    if not any(v for k, v in delta.items() if k != "content") and not choice.get("logprobs"):
                        continue  # the opening role-only delta
                choices.append({**choice, "delta": delta})
            if not choices and chunk.get("choices") and not chunk.get("usage"):
                return None
            chunk["choices"] = choices
        return chunk


def error_event(message: str, code: str) -> bytes:
    """An error in OpenAI's shape as a stream's last event (no `[DONE]` follows: it did not end well)."""
    return encode({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


def finish_event(route: str, sent: Sent, reason: str) -> bytes:
    """The event that ends an answer whose replica failed just as its token limit was reached."""
    if route == CHAT:
        choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice, kind = {"index": 0, "text": "", "finish_reason": reason}, "text_completion"
    return encode({"id": sent.id, "object": kind, "created": sent.created, "choices": [choice]})
