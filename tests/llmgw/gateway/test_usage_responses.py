"""The Responses API's usage (`POST /v1/responses`, llmgw.gateway.usage): an answer read whole
counts its response's `usage` (`input_tokens`, `output_tokens`, `input_tokens_details`); a
streamed one its `response.completed` event's, which the client gets as the engine sent it (byte
for byte: nothing asked of the engine, nothing taken out); a stream cut before it counts its
`response.output_text.delta` events relayed, one token each, and the prompt's estimate; budgets
are charged the same. Engines in memory (testlib.memnet) on MockClock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.gateway.budgets import prompt_estimate
from llmgw.gateway.routing import Endpoint
from llmgw.gateway.usage import StreamUsage, Tokens, body_usage
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.wire.gateway_link import RESPONSES, ModelInfo
from testlib import memnet
from testlib.minutebudget import charged, with_budget

WORDS = ["one", " two", ' "input_tokens": 99', " four", " five"]  # a word that looks like a usage key
USAGE = {
    "input_tokens": 11,
    "input_tokens_details": {"cached_tokens": 6},
    "output_tokens": len(WORDS),
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 11 + len(WORDS),
}


def _sse(obj: dict[str, Any]) -> bytes:
    """An event as vLLM and llama-server send it: its type on an `event:` line, compact JSON."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _response(status: str, text: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    output = [
        {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    ]
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "m",
        "status": status,
        "output": output if text else [],
        "tools": [],
        "usage": usage,
    }


def events(words: list[str]) -> list[bytes]:
    """A Responses API stream: the opening events, a delta a word, the closing ones."""
    item = {"type": "message", "id": "msg_1", "role": "assistant", "content": []}
    out = [
        _sse({"type": "response.created", "sequence_number": 0, "response": _response("in_progress", "", None)}),
        _sse({"type": "response.in_progress", "sequence_number": 1, "response": _response("in_progress", "", None)}),
        _sse({"type": "response.output_item.added", "output_index": 0, "item": item}),
        _sse({"type": "response.content_part.added", "item_id": "msg_1", "part": {"type": "output_text", "text": ""}}),
    ]
    for w in words:
        out.append(_sse({"type": "response.output_text.delta", "item_id": "msg_1", "delta": w, "logprobs": []}))
    text = "".join(words)
    out += [
        _sse({"type": "response.output_text.done", "item_id": "msg_1", "text": text}),
        _sse({"type": "response.content_part.done", "item_id": "msg_1", "part": {"type": "output_text", "text": text}}),
        _sse({"type": "response.output_item.done", "output_index": 0, "item": item}),
        _sse({"type": "response.completed", "sequence_number": 9, "response": _response("completed", text, USAGE)}),
    ]
    return out


class Engine:
    """Answers /v1/responses with WORDS, whole or streamed (10 ms an event); `die_after` deltas:
    gone, its connections cut."""

    def __init__(self, net: memnet.MemoryNet, host: str = "10.0.0.1", *, die_after: int = 0) -> None:
        self.net, self.host, self.die_after = net, host, die_after
        self.bodies: list[bytes] = []
        self.sent = b""  # the stream's bytes as the engine sent them
        net.serve((host, 8000), self.handle)

    def endpoint(self) -> Endpoint:
        return Endpoint(replica_id="m-0", model="m", host=self.host, port=8000, api_key="k")

    async def handle(self, request: Request) -> Response | StreamingResponse:
        raw = await request.read()
        self.bodies.append(raw)
        if not json.loads(raw).get("stream"):
            return Response.json(200, _response("completed", "".join(WORDS), USAGE))

        async def stream():
            for i, event in enumerate(events(WORDS)):
                if self.die_after and i == 4 + self.die_after:  # after the 4 opening events and die_after deltas
                    self.net.kill((self.host, 8000))
                    await trio.sleep_forever()
                await trio.sleep(0.01)
                self.sent += event
                yield event

        return StreamingResponse(status=200, body=stream(), headers=(("content-type", "text/event-stream"),))


def request_body(stream: bool) -> bytes:
    body = {"model": "m", "input": "count to five, one word at a time " * 4, "stream": stream}
    return json.dumps(body).encode()


async def gateway(tmp_path: Path, nursery: trio.Nursery, engine: Engine) -> memnet.MemGateway:
    info = ModelInfo(name="m", engine="vllm", routes=(RESPONSES,))
    return await memnet.start_gateway(nursery, tmp_path, engine.net, (engine.endpoint(),), details=(info,))


async def post(gw: memnet.MemGateway, body: bytes, deltas: int | None = None) -> tuple[int, bytes]:
    """Send `body` to /v1/responses; read the answer until `deltas` delta events came (None: to
    its end, or its cut), then close the connection. The status and what was read."""
    client = await gw.open()
    headers = [("authorization", f"Bearer {gw.token}"), ("content-type", "application/json")]
    await client.send_head("POST", RESPONSES, [*headers, ("content-length", str(len(body)))])
    await client.send_body(body)
    status, _ = await client.head()
    got = b""
    try:
        while deltas is None or got.count(b'"response.output_text.delta"') < deltas:
            piece = await client.chunk()
            if piece is None:
                break
            got += piece
    except Exception:  # noqa: BLE001 - a cut stream ends without its last chunk
        pass
    await client.stream.aclose()
    with trio.fail_after(10):
        while gw.gateway.in_flight_total:
            await gw.gateway.finished.next().wait()
    return status, got


# -- reading, without a gateway ----------------------------------------------------------------


def test_a_whole_response_counts_its_usage() -> None:
    body = json.dumps(_response("completed", "".join(WORDS), USAGE)).encode()
    assert body_usage(body) == Tokens(prompt=11, cached=6, completion=len(WORDS))


def test_a_stream_is_read_and_passed_on_as_it_is() -> None:
    meter = StreamUsage(False, 100, responses=True)  # whatever the client said: its usage is its own
    whole = b"".join(events(WORDS))
    assert meter.events(whole) is whole
    meter.sent(whole)
    assert meter.tokens == Tokens(prompt=11, cached=6, completion=len(WORDS))
    assert meter.relayed_tokens() == len(WORDS)  # the delta events, the opening and closing left out
    # Event by event, CRLF line ends too: the same bytes back, the same count.
    meter = StreamUsage(False, responses=True)
    for event in events(WORDS):
        event = event.replace(b"\n", b"\r\n")
        assert meter.events(event) is event
        meter.sent(event)
    assert meter.tokens == Tokens(prompt=11, cached=6, completion=len(WORDS))
    assert meter.relayed_tokens() == len(WORDS)


def test_a_reasoning_and_a_tool_calls_deltas_count_and_other_usages_are_not_believed() -> None:
    meter = StreamUsage(True, responses=True)
    pieces = [
        _sse({"type": "response.reasoning_text.delta", "delta": "hm"}),
        _sse({"type": "response.function_call_arguments.delta", "delta": '{"a"'}),
        # The type in its text is not a type.
        _sse({"type": "response.output_text.delta", "delta": "a response.output_text.delta"}),
    ]
    for piece in pieces:
        meter.sent(meter.events(piece))
    assert meter.relayed_tokens() == 3 and meter.tokens is None
    # A tool whose schema has a property "usage" after the response's usage: the event is decoded.
    response = _response("completed", "x", USAGE)
    del response["tools"]  # put after the usage
    response["tools"] = [{"type": "function", "name": "f", "parameters": {"properties": {"usage": {"type": "string"}}}}]
    completed = _sse({"type": "response.completed", "response": response})
    assert completed.rfind(b'"usage"') > completed.find(b'"input_tokens"')
    assert meter.events(completed) is completed and meter.tokens == Tokens(11, 6, len(WORDS))


# -- through a gateway -------------------------------------------------------------------------


@pytest.mark.trio
@pytest.mark.parametrize("stream", [False, True])
async def test_the_engines_usage_is_counted_and_its_budget_charged(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    net = memnet.MemoryNet(nursery)
    engine = Engine(net)
    gw = await gateway(tmp_path, nursery, engine)
    budgets = with_budget(gw)
    body = request_body(stream)
    status, got = await post(gw, body)
    assert status == 200
    assert engine.bodies == [body]  # nothing asked of the engine: no stream_options
    if stream:
        assert engine.sent and got == engine.sent  # byte for byte, its usage event too
    else:
        assert json.loads(got)["usage"] == USAGE
    assert list(gw.gateway.usage.pending.values()) == [[1, 11, 6, len(WORDS)]]
    assert gw.gateway.usage.estimated_total.values == {}
    assert charged(budgets) == 11 + len(WORDS)


@pytest.mark.trio
@pytest.mark.parametrize("how", ["client_gone", "cut"])
async def test_a_stream_ended_before_its_usage_counts_the_deltas_relayed(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, how: str
) -> None:
    net = memnet.MemoryNet(nursery)
    engine = Engine(net, die_after=3 if how == "cut" else 0)
    gw = await gateway(tmp_path, nursery, engine)
    budgets = with_budget(gw)
    body = request_body(True)
    status, got = await post(gw, body, 2 if how == "client_gone" else None)
    k = 2 if how == "client_gone" else 3
    assert status == 200 and got.count(b'"response.output_text.delta"') == k
    assert b"response.completed" not in got
    prompt = prompt_estimate(len(body))
    assert list(gw.gateway.usage.pending.values()) == [[1, prompt, 0, k]]
    assert gw.gateway.usage.estimated_total.values == {("m", how): 1}
    assert charged(budgets) == prompt + k
