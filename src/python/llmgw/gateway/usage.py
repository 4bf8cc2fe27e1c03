"""Who used what, on one gateway process: every answer's tokens as its engine counted them
(`usage`), added up per hour, key, team and model (`Usage`), for the control plane's ledger
(issue 48; docs/gateway.md, "Usage").

Where the tokens come from, without parsing what the gateway does not parse already:

- an answer read whole (`body_usage`): its last `"usage"` key, found from the end and decoded
  alone (a few hundred bytes), not the body;
- a streamed chat or text completion: the gateway asks the engine for its usage
  (`stream_options: {"include_usage": true}` added to the body it sends, `with_usage`: spliced
  before the body's last brace, no re-encoding) and `StreamUsage` reads it from the stream's
  whole events. Only an event holding `"prompt_tokens"` is decoded: that key, with its closing
  quote, cannot occur inside a JSON string (a quote there is escaped), so the test is a byte
  search per piece relayed. A client that did not ask for usage gets none: the usage-only
  event is dropped, and a usage the engine put into an event with choices is taken out of it.
  A stream continued on another replica (`gateway/migrate.py`) is read after its rewrite, so
  its usage counts the whole answer as completion and the client's prompt as prompt, as the
  client's own usage says (what the engines spent again on the continuation's prompt is the
  cluster's cost, not the key's).
- a streamed answer of the Responses API (`/v1/responses`, `StreamUsage(responses=True)`): its
  `response.completed` event (or `response.incomplete`) always carries the response's usage
  (`input_tokens`, `output_tokens`): nothing is asked, and nothing taken out (it is part of that
  API). Only an event holding `"input_tokens"` is read, and of it only its usage object (the
  event holds the whole response, the answer's text too). Its stream is passed on byte for byte.

A request counts once it reached an engine and was answered (status below 400), or its client
left mid-answer (499): with the tokens its engine reported. A stream that ended without them (its
client gone, its replica failed and the answer not continued, an engine that says none) counts
what is known instead (`StreamUsage.relayed_tokens`, `gateway/job.py`): the token events relayed
as completion tokens (one token an event in llama.cpp, vLLM, SGLang and the sim: a lower bound
where an engine puts several in one), and an earlier attempt's prompt tokens, else the prompt the
budgets reserve for (`budgets.prompt_estimate`); `llmgw_gateway_usage_estimated_total{model,reason}`
counts those answers (the ledger has no column for it). Counting costs the relay one byte count
a piece sent (its blank lines); only the opening event and at most `CLOSING_EVENTS` at the end are
read, once, and only for such a stream. A Responses API stream counts its
`response.output_text.delta` events instead (and reasoning and tool-call argument deltas), one
token each, by byte searches of their type as they are sent (`RESPONSE_TOKEN_TYPES`: four counts
a piece). An answer read whole that says no usage counts none.

`Usage.record` is the one way in: it adds to the current hour's row, to the Prometheus counters
(`llmgw_gateway_tokens_total{model,kind}` and `llmgw_gateway_usage_requests_total{model}`: per
model, not per key or team, whose number the gateway does not bound) and tells its observers.
The rows not yet reported wait in `pending`; `report` takes them into a numbered report for the
link (`llmgw.wire.gateway_link.UsageReport`), which stays the one unacknowledged report until
`acked`, sent again after every reconnect; what is counted meanwhile waits in `pending`, merged
by row, so memory is bounded by the rows (hours x keys x models), not by the requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from llmgw.gateway.migrate import data_of
from llmgw.metrics import MetricsRegistry
from llmgw.wakeup import Wakeup
from llmgw.wire.gateway_link import UsageReport, UsageRow

TOKENS = "llmgw_gateway_tokens_total"
USAGE_REQUESTS = "llmgw_gateway_usage_requests_total"
USAGE_ESTIMATED = "llmgw_gateway_usage_estimated_total"
HOUR_S = 3600
# The usage object of an answer is a few hundred bytes; past this from its key it is not read.
_MAX_USAGE_BYTES = 4096
_USAGE_KEY = b'"usage"'
_MARK = b'"prompt_tokens"'  # in a stream's event that carries a usage
_RESPONSES_MARK = b'"input_tokens"'  # in a Responses API event that carries one (`response.completed`)
# The types of the Responses API's events that carry one token each. The type, quotes included,
# occurs in no other string but one that is all of it (a quote inside is escaped): the relay
# counts them with a byte search a piece.
RESPONSE_TOKEN_TYPES = (
    b'"response.output_text.delta"',
    b'"response.reasoning_text.delta"',
    b'"response.reasoning_summary_text.delta"',
    b'"response.function_call_arguments.delta"',
)
# At the end of a stream, the events that may carry no token: the finish reason, a usage, an
# error, a comment, [DONE], with room to spare. A cut stream's count reads no more than these.
CLOSING_EVENTS = 8
INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'
_decoder = json.JSONDecoder()


class Tokens(NamedTuple):
    prompt: int = 0
    cached: int = 0  # of `prompt`, where the engine says
    completion: int = 0


def tokens_of(usage: Any) -> Tokens | None:
    """The tokens of a `usage` object: chat and text completions and embeddings (`prompt_tokens`,
    `completion_tokens`, `prompt_tokens_details.cached_tokens`) or the Responses API's
    (`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`); None for anything
    else. On every answer's path: plain lookups."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    if prompt is None:
        prompt, completion, details = (
            usage.get("input_tokens"),
            usage.get("output_tokens"),
            usage.get("input_tokens_details"),
        )
    else:
        completion, details = usage.get("completion_tokens"), usage.get("prompt_tokens_details")
    if not _count(prompt):
        return None
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    return Tokens(prompt, cached if _count(cached) and cached <= prompt else 0, completion if _count(completion) else 0)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def body_usage(body: bytes) -> Tokens | None:
    """The tokens of an answer read whole, from its last `"usage"` key (an engine puts it at the
    top level, after the choices); only that object is decoded."""
    at = body.rfind(_USAGE_KEY)
    if at < 0:
        return None
    text = body[at + len(_USAGE_KEY) : at + _MAX_USAGE_BYTES].decode("utf-8", "replace")
    colon = text.find(":")
    if colon < 0:
        return None
    start = colon + 1
    while start < len(text) and text[start] in " \t\r\n":
        start += 1
    try:
        value, _ = _decoder.raw_decode(text, start)
    except ValueError:
        return None
    return tokens_of(value)


def with_usage(body: bytes) -> bytes:
    """`body` (a JSON object with no `stream_options`, as parsed) asking for the usage in the
    stream's last event: the member spliced in before its last brace."""
    end = body.rstrip().rfind(b"}")
    return body[:end] + b"," + INCLUDE_USAGE + body[end:]


def usage_options(body: dict[str, Any]) -> tuple[bool, bytes]:
    """For a streamed request's parsed `body`: whether its client asked for the usage, and, when
    it sent `stream_options` without asking, the body to send instead (its options with
    `include_usage` added; b"": none needed, `with_usage` splices it in)."""
    if "stream_options" not in body:
        return False, b""
    options = body["stream_options"]
    if isinstance(options, dict) and options.get("include_usage") is True:
        return True, b""
    # Re-encoded, not spliced: a second "stream_options" member is read differently by different parsers.
    merged = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
    out = {**body, "stream_options": merged}
    return False, json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode()


class StreamUsage:
    """One stream's usage, read from its whole events as they are relayed (`events`), and taken
    out of them when the client did not ask for it (`asked` False). `body_bytes`: the client's
    request's size, for the prompt's estimate. What the client was sent (`sent`, as `job.stream`
    relays) is what a stream cut before its usage counts (`relayed_tokens`). `responses`: a
    Responses API stream (its usage in `response.completed`, always there: passed on as it is)."""

    __slots__ = (
        "asked",
        "responses",
        "mark",
        "tokens",
        "earlier",
        "body_bytes",
        "relayed",
        "deltas",
        "first",
        "prev",
        "last",
    )

    def __init__(self, asked: bool, body_bytes: int = 0, *, responses: bool = False) -> None:
        self.asked = asked or responses  # the Responses API's usage is the client's own: never taken out
        self.responses = responses
        self.mark = _RESPONSES_MARK if responses else _MARK
        self.tokens: Tokens | None = None  # the last usage seen (an engine's last is the whole answer's)
        self.earlier: Tokens | None = None  # the last usage of an attempt before the stream moved
        self.body_bytes = body_bytes
        self.relayed = 0  # events sent to the client (blank lines of the pieces sent)
        self.deltas = 0  # a Responses API stream's token events sent (`RESPONSE_TOKEN_TYPES`)
        self.first = b""  # the first piece sent that held an event, the one before the last, the last
        self.prev = b""
        self.last = b""

    def sent(self, whole: bytes) -> None:
        """`whole` (events, as `events` returned them) reached the client: what a stream cut
        before its usage counts. One byte count of its blank lines, no parsing."""
        if not self.relayed:
            self.first = whole
        self.relayed += whole.count(b"\n\n")
        if self.responses:
            for kind in RESPONSE_TOKEN_TYPES:
                self.deltas += whole.count(kind)
            return
        self.prev, self.last = self.last, whole

    def relayed_tokens(self) -> int:
        """The completion tokens the client was sent: every event relayed but the opening one
        and the closing ones when they carry no token (a chat answer's role; the finish reason,
        an error, a comment, `[DONE]`). Only those few events are read (at most CLOSING_EVENTS
        from the end), however long the pieces: the others are tokens. A Responses API stream:
        its token events, counted as they were sent."""
        if self.responses:
            return self.deltas
        first = self.first
        n, floor = self.relayed, 0
        if first:
            floor = first.find(b"\n\n") + 2
            if not _event_token(first[:floor]):
                n -= 1
        walk = CLOSING_EVENTS
        for piece in (self.last, self.prev):
            bottom = floor if piece is first else 0  # the opening is counted once
            end = len(piece)
            while walk and end > bottom:
                walk -= 1
                start = piece.rfind(b"\n\n", bottom, end - 2)
                start = bottom if start < 0 else start + 2
                if _event_token(piece[start:end]):
                    return max(0, n)
                n -= 1
                end = start
            if piece is first or not walk:
                break
        return max(0, n)

    def events(self, whole: bytes) -> bytes:
        """`whole` (whole events) as the client gets them, their usage read: unchanged, unless
        the client did not ask for the usage and an event holds it."""
        mark = self.mark
        if mark not in whole:
            return whole
        events = whole.replace(b"\r\n", b"\n").split(b"\n\n")
        if self.asked:  # read, passed on as the engine sent it
            for event in events:
                if mark in event:
                    self._read(event)
            return whole
        out = bytearray()
        for event in events:
            if not event:
                continue
            if mark in event:
                event = self._event(event)
                if not event:
                    continue
            out += event + b"\n\n"
        return bytes(out)

    def _read(self, event: bytes) -> None:
        """The usage of an event the client gets as it is."""
        if self.responses:
            # `response.completed` holds the whole response: its usage object alone is decoded
            # (the last "usage" key of the event: the response's own, after its output).
            tokens = body_usage(event)
            if tokens is None:  # another key "usage" after it (a tool's schema): the event decoded
                tokens = _response_usage(event)
            if tokens is not None:
                self.tokens = tokens
            return
        self._event(event)

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        data = b"\n".join(line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:"))
        try:
            chunk = json.loads(data)
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        tokens = tokens_of(chunk.get("usage"))
        if tokens is None:
            return event
        self.tokens = tokens
        if self.asked:
            return event
        if not chunk.get("choices"):
            return b""  # the usage-only event the client did not ask for
        del chunk["usage"]
        others = b"".join(line + b"\n" for line in lines if not line.startswith(b"data:"))
        return others + b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()


def _response_usage(event: bytes) -> Tokens | None:
    """The usage of a Responses API event (`response.completed`: `response.usage`), decoded whole."""
    data = data_of(event)
    if not data:
        return None
    try:
        chunk = json.loads(data[0])
    except ValueError:
        return None
    response = chunk.get("response") if isinstance(chunk, dict) else None
    return tokens_of(response.get("usage")) if isinstance(response, dict) else None


def _event_token(event: bytes) -> bool:
    """Whether one whole event carries a token of the answer: text of a choice, its content,
    reasoning or a tool call (a chat delta), in any choice."""
    data = data_of(event)
    if not data:
        return False  # a comment
    try:
        chunk = json.loads(data[0])
    except ValueError:
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls", "function_call")
        ):
            return True
    return False


# (key, team, model, prompt, cached, completion): what `Usage.record` tells its observers.
Observer = Callable[[str, str, str, int, int, int], None]


class Usage:
    """One gateway process's counts by (hour, key, team, model), not yet acknowledged by the
    control plane, and its token counters. `wall`: the clock the hours are of (unix time)."""

    def __init__(self, registry: MetricsRegistry | None = None, *, wall: Callable[[], float] = time.time) -> None:
        r = registry if registry is not None else MetricsRegistry()
        self.tokens_total = r.counter(
            TOKENS,
            "Tokens of the answers, as their engines counted them, by model and kind (prompt; cached: of the "
            "prompt, where the engine says; completion).",
            ("model", "kind"),
        )
        self.requests_total = r.counter(
            USAGE_REQUESTS, "Requests counted in the usage ledger (answered by an engine), by model.", ("model",)
        )
        self.estimated_total = r.counter(
            USAGE_ESTIMATED,
            "Streamed answers counted without their engine's usage, by model and why (client_gone, cut, "
            "no_usage): their completion tokens the token events relayed, their prompt an earlier attempt's "
            "or the body's size / 3.",
            ("model", "reason"),
        )
        self.wall = wall
        self.pending: dict[tuple[int, str, str, str], list[int]] = {}  # row -> [requests, prompt, cached, completion]
        self.unacked: UsageReport | None = None  # the report sent and not yet acknowledged
        self.seq = 0  # of the last report made
        self.observers: list[Observer] = []
        self._series: dict[str, tuple[tuple[str, ...], ...]] = {}  # model -> its counters' keys
        self.linked = False  # a link reports them (`gatewayd/link.py`); else `flushed` has nothing to wait for
        self.flushing = Wakeup()  # `flush`: the link sends what is pending at once
        self.acknowledged = Wakeup()  # the control plane acknowledged a report

    def observe(self, observer: Observer) -> None:
        """Call `observer(key, team, model, prompt, cached, completion)` at every `record`."""
        self.observers.append(observer)

    def record(self, key: str, team: str, model: str, prompt: int, cached: int, completion: int) -> None:
        """One answered request of `key` (of `team`) for `model`, with its engine's tokens."""
        row = (int(self.wall() // HOUR_S) * HOUR_S, key, team, model)
        counts = self.pending.get(row)
        if counts is None:
            self.pending[row] = [1, prompt, cached, completion]
        else:
            counts[0] += 1
            counts[1] += prompt
            counts[2] += cached
            counts[3] += completion
        series = self._series.get(model)
        if series is None:  # the counters' keys, made once a model
            tokens = self.tokens_total
            series = self._series[model] = (
                self.requests_total.key(model=model),
                *(tokens.key(model=model, kind=kind) for kind in ("prompt", "cached", "completion")),
            )
        self.requests_total.add(series[0])
        if prompt:
            self.tokens_total.add(series[1], prompt)
        if cached:
            self.tokens_total.add(series[2], cached)
        if completion:
            self.tokens_total.add(series[3], completion)
        for observer in self.observers:
            observer(key, team, model, prompt, cached, completion)

    def report(self) -> UsageReport | None:
        """The report to send now: the one not yet acknowledged (again: after a reconnect), else
        the pending rows in a new one (they leave `pending`), else None."""
        if self.unacked is not None:
            return self.unacked
        if not self.pending:
            return None
        self.seq += 1
        rows = tuple(
            UsageRow(
                hour=hour,
                key=key,
                team=team,
                model=model,
                requests=c[0],
                prompt_tokens=c[1],
                cached_tokens=c[2],
                completion_tokens=c[3],
            )
            for (hour, key, team, model), c in sorted(self.pending.items())
        )
        self.pending = {}
        self.unacked = UsageReport(seq=self.seq, rows=rows)
        return self.unacked

    def acked(self, seq: int) -> bool:
        """The control plane holds report `seq`; whether it was the one waiting."""
        if self.unacked is None or self.unacked.seq != seq:
            return False
        self.unacked = None
        self.acknowledged.fire()
        return True

    def flush(self) -> None:
        """Have the link send what is pending now, not at its next interval."""
        self.flushing.fire()

    async def flushed(self) -> None:
        """Return once everything counted is acknowledged (the caller bounds the wait: a link that
        is down acknowledges nothing); at once when no link reports the counts."""
        while self.linked and self.unreported:
            acknowledged = self.acknowledged.next()
            self.flush()
            await acknowledged.wait()

    @property
    def unreported(self) -> bool:
        """Whether anything counted is not yet acknowledged."""
        return bool(self.pending) or self.unacked is not None
