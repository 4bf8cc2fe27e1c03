"""Who used what, on the gateway (llmgw.gateway.usage): the usage read from an answer read whole
and from a stream's events, the stream's request asking the engine for it and the client seeing
exactly what it asked for, the counts by hour, key, team and model, and the one unacknowledged
report. End to end through a gateway over memory streams (testlib.memnet, MockClock): a scripted
engine that says its usage only when asked, as the OpenAI API does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.gateway.migrate import CHAT, COMPLETIONS
from llmgw.gateway.routing import Endpoint
from llmgw.gateway.usage import (
    INCLUDE_USAGE,
    StreamUsage,
    Tokens,
    Usage,
    body_usage,
    tokens_of,
    usage_options,
    with_usage,
)
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.wire.gateway_link import ModelInfo, UsageRow
from testlib import memnet

# -- reading the usage -------------------------------------------------------------------------


def test_body_usage_reads_the_last_usage_key_alone() -> None:
    answer = {
        "id": "x",
        "choices": [{"message": {"content": 'a "usage": {"prompt_tokens": 99} in the text'}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}},
    }
    assert body_usage(json.dumps(answer).encode()) == Tokens(prompt=12, cached=8, completion=3)
    spaced = b'{"choices": [], "usage" :\n {"prompt_tokens": 2, "completion_tokens": 1}}'
    assert body_usage(spaced) == Tokens(prompt=2, completion=1)
    assert body_usage(b'{"choices": []}') is None
    assert body_usage(b'{"usage": null}') is None
    assert body_usage(b'{"usage": {"prompt_tokens": ') is None  # cut short: none, not an error
    # The Responses API's names; embeddings have no completion.
    assert tokens_of({"input_tokens": 4, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 1}}) == Tokens(
        prompt=4, cached=1, completion=2
    )
    assert tokens_of({"prompt_tokens": 7, "total_tokens": 7}) == Tokens(prompt=7)
    assert tokens_of({"prompt_tokens": -1}) is None and tokens_of({"prompt_tokens": True}) is None
    # cached tokens past the prompt are not believed
    assert tokens_of({"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 5}}) == Tokens(prompt=1)


def test_a_streams_request_asks_for_the_usage() -> None:
    body = b'{"model": "m", "stream": true}\n'
    sent = with_usage(body)
    assert json.loads(sent) == {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    assert INCLUDE_USAGE in sent
    assert usage_options({"model": "m"}) == (False, b"")
    assert usage_options({"model": "m", "stream_options": {"include_usage": True}}) == (True, b"")
    asked, other = usage_options({"model": "m", "stream_options": {"include_usage": False, "continuous": 1}})
    assert not asked and json.loads(other)["stream_options"] == {"include_usage": True, "continuous": 1}
    asked, other = usage_options({"model": "m", "stream_options": None})
    assert not asked and json.loads(other) == {"model": "m", "stream_options": {"include_usage": True}}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


TOKEN = _event({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
LAST = _event({"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})


def test_a_stream_without_usage_is_passed_on_as_it_is() -> None:
    meter = StreamUsage(asked=False)
    assert meter.events(TOKEN * 3) is not None and meter.events(TOKEN * 3) == TOKEN * 3
    assert meter.tokens is None


def test_the_usage_event_is_read_and_dropped_unless_the_client_asked() -> None:
    meter = StreamUsage(asked=False)
    assert meter.events(TOKEN + LAST + b"data: [DONE]\n\n") == TOKEN + b"data: [DONE]\n\n"
    assert meter.tokens == Tokens(prompt=5, completion=2)
    asked = StreamUsage(asked=True)
    assert asked.events(TOKEN + LAST) == TOKEN + LAST and asked.tokens == Tokens(prompt=5, completion=2)
    # An engine that puts the usage into the event with the finish reason: taken out of it.
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    finish = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
    meter = StreamUsage(asked=False)
    out = meter.events(_event(finish).replace(b"\n\n", b"\r\n\r\n"))
    assert json.loads(out.removeprefix(b"data: ")) == {k: v for k, v in finish.items() if k != "usage"}
    assert meter.tokens == Tokens(prompt=5, completion=2)
    # A text that names the key is not a usage (its quotes are escaped).
    text = _event({"choices": [{"index": 0, "text": 'say "prompt_tokens"'}]})
    assert StreamUsage(asked=False).events(text) == text


# -- counting ----------------------------------------------------------------------------------


def test_counts_are_added_by_hour_key_team_and_model_and_reported_once_until_acked() -> None:
    now = [7200.0 + 10]
    usage = Usage(wall=lambda: now[0])
    seen: list[tuple] = []
    usage.observe(lambda *a: seen.append(a))
    usage.record("k1", "t", "m", 10, 4, 3)
    usage.record("k1", "t", "m", 1, 0, 1)
    usage.record("k2", "", "m", 2, 0, 0)
    now[0] = 3 * 3600.0  # the next hour
    usage.record("k1", "t", "m", 5, 0, 5)
    assert seen[0] == ("k1", "t", "m", 10, 4, 3) and len(seen) == 4
    first = usage.report()
    assert first is not None and first.seq == 1
    assert first.rows == (
        UsageRow(
            hour=7200, key="k1", team="t", model="m", requests=2, prompt_tokens=11, cached_tokens=4, completion_tokens=4
        ),
        UsageRow(hour=7200, key="k2", team="", model="m", requests=1, prompt_tokens=2),
        UsageRow(hour=10800, key="k1", team="t", model="m", requests=1, prompt_tokens=5, completion_tokens=5),
    )
    usage.record("k1", "t", "m", 1, 0, 1)  # counted meanwhile: waits for the next report
    assert usage.report() is first  # not acknowledged: the same again (a reconnect sends it again)
    assert not usage.acked(2) and usage.acked(1) and usage.unreported
    second = usage.report()
    assert second is not None and second.seq == 2 and second.rows[0].requests == 1
    assert usage.acked(2) and not usage.unreported and usage.report() is None
    text = usage.tokens_total
    assert text.values[("m", "prompt")] == 19 and text.values[("m", "cached")] == 4
    assert usage.requests_total.values[("m",)] == 5


# -- through a gateway -------------------------------------------------------------------------

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}


class Engine:
    """Answers three words, streamed or not; says its usage in a stream only when asked."""

    def __init__(self, net: memnet.MemoryNet, host: str = "10.0.0.1") -> None:
        self.host = host
        self.bodies: list[dict[str, Any]] = []
        net.serve((host, 8000), self.handle)

    def endpoint(self) -> Endpoint:
        return Endpoint(replica_id="m-0", model="m", host=self.host, port=8000, api_key="k")

    async def handle(self, request: Request) -> Response | StreamingResponse:
        body = json.loads(await request.read())
        self.bodies.append(body)
        if not body.get("stream"):
            answer = {"id": "c", "choices": [{"index": 0, "message": {"content": "a b c"}}], "usage": USAGE}
            return Response.json(200, answer)

        async def events():
            for w in ("a", " b", " c"):
                yield _event({"id": "c", "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]})
            yield _event({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _event({"id": "c", "choices": [], "usage": USAGE})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(status=200, body=events(), headers=(("content-type", "text/event-stream"),))


@pytest.mark.trio
@pytest.mark.parametrize(("stream", "options"), [(False, None), (True, None), (True, {"include_usage": True})])
async def test_the_engines_usage_is_counted_and_the_client_sees_what_it_asked_for(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, stream: bool, options: Any
) -> None:
    net = memnet.MemoryNet(nursery)
    engine = Engine(net)
    info = ModelInfo(name="m", engine="vllm", routes=(CHAT, COMPLETIONS))
    gw = await memnet.start_gateway(nursery, tmp_path, net, (engine.endpoint(),), details=(info,))
    request: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if options is not None:
        request["stream_options"] = options
    status, _, body = await gw.call("POST", CHAT, request)
    assert status == 200
    if stream:
        assert engine.bodies[0]["stream_options"] == {"include_usage": True}  # asked of the engine either way
        events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: {")]
        usages = [e["usage"] for e in events if "usage" in e]
        assert usages == ([USAGE] if options else [])  # the client sees exactly what it asked for
        assert body.endswith(b"data: [DONE]\n\n")
    else:
        assert "stream_options" not in engine.bodies[0] and json.loads(body)["usage"] == USAGE
    [(row, counts)] = gw.gateway.usage.pending.items()
    assert row[1:] == ("tests", "", "m") and counts == [1, 7, 4, 3]
    metrics = gw.gateway.render_metrics()
    assert 'llmgw_gateway_tokens_total{model="m",kind="completion"} 3' in metrics


@pytest.mark.trio
async def test_an_engines_error_is_not_counted(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)

    async def refuse(request: Request) -> Response:
        await request.read()
        return Response.json(400, {"error": {"message": "bad", "type": "invalid_request_error"}})

    net.serve(("10.0.0.1", 8000), refuse)
    ep = Endpoint(replica_id="m-0", model="m", host="10.0.0.1", port=8000, api_key="k")
    gw = await memnet.start_gateway(nursery, tmp_path, net, (ep,))
    status, _, _ = await gw.call("POST", CHAT, {"model": "m", "messages": []})
    assert status == 400 and gw.gateway.usage.pending == {}


@pytest.mark.trio
async def test_a_stream_asked_for_and_answered_whole_counts_the_bodys_usage(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)

    async def whole(request: Request) -> Response:
        await request.read()
        return Response.json(200, {"id": "c", "choices": [], "usage": USAGE})  # an engine that ignored "stream"

    net.serve(("10.0.0.1", 8000), whole)
    ep = Endpoint(replica_id="m-0", model="m", host="10.0.0.1", port=8000, api_key="k")
    gw = await memnet.start_gateway(nursery, tmp_path, net, (ep,))
    status, _, _ = await gw.call("POST", CHAT, {"model": "m", "messages": [], "stream": True})
    assert status == 200 and list(gw.gateway.usage.pending.values()) == [[1, 7, 4, 3]]
