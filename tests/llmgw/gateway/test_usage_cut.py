"""A stream that ends without its engine's usage still counts (llmgw.gateway.usage.StreamUsage,
job.Job.finish): a client that leaves after k tokens is counted k completion tokens and the
prompt the budgets estimate (body bytes / 3), and its budget is charged the same; a stream whose
replica is cut and not continued counts the tokens relayed; a stream continued after an attempt
that said a usage takes that attempt's prompt; a whole stream counts its engine's usage exactly.
The sim's own streams check the count: one token an event, the opening and closing left out.
Engines in memory (testlib.memnet) on MockClock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.gateway import usage as usage_module
from llmgw.gateway.budgets import prompt_estimate
from llmgw.gateway.migrate import CHAT, COMPLETIONS
from llmgw.gateway.routing import Endpoint
from llmgw.gateway.usage import StreamUsage
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.simengine import api
from llmgw.wire.gateway_link import ModelInfo
from testlib import memnet
from testlib.minutebudget import charged, with_budget

pytestmark = pytest.mark.trio

WORDS = ["one", " two", " three", " four", " five", " six", " seven", " eight"]
USAGE = {"prompt_tokens": 7, "completion_tokens": len(WORDS), "total_tokens": 7 + len(WORDS)}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Engine:
    """Answers WORDS from where the request says it is (its final assistant message's words), one
    event each, 10 ms apart, after a role-only opening (chat); then the finish reason, its usage
    when asked, [DONE]. `die_after` words: gone (its connections cut). `usage_each`: a usage in
    every event, as vLLM's `continuous_usage_stats` does."""

    def __init__(self, net: memnet.MemoryNet, host: str, *, die_after: int = 0, usage_each: bool = False) -> None:
        self.net, self.host, self.die_after, self.usage_each = net, host, die_after, usage_each
        self.started: trio.Event | None = None  # set when it begins an answer
        net.serve((host, 8000), self.handle)

    def endpoint(self) -> Endpoint:
        return Endpoint(replica_id=f"m-{self.host}", model="m", host=self.host, port=8000, api_key="k")

    async def handle(self, request: Request) -> Response | StreamingResponse:
        body = json.loads(await request.read())
        chat = request.path == CHAT
        last = body["messages"][-1] if chat else {}
        start = len(last["content"].split()) if last.get("role") == "assistant" else 0
        words = WORDS[start:]
        asked = (body.get("stream_options") or {}).get("include_usage")

        def event(choice: dict[str, Any], done: int) -> bytes:
            obj: dict[str, Any] = {"id": "c", "object": "x", "created": 1, "choices": [choice]}
            if self.usage_each and asked:
                obj["usage"] = {"prompt_tokens": 5 + start, "completion_tokens": done, "total_tokens": 5 + start + done}
            return _sse(obj)

        async def events():
            if self.started is not None:
                self.started.set()
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}, 0)
            for i, w in enumerate(words):
                if self.die_after and i == self.die_after:
                    self.net.kill((self.host, 8000))
                    await trio.sleep_forever()
                await trio.sleep(0.01)
                piece = {"delta": {"content": w}} if chat else {"text": w}
                yield event({"index": 0, **piece, "finish_reason": None}, i + 1)
            await trio.sleep(0.01)
            end = {"delta": {}} if chat else {"text": ""}
            yield event({"index": 0, **end, "finish_reason": "stop"}, len(words))
            if asked and not self.usage_each:
                yield _sse({"id": "c", "object": "x", "created": 1, "choices": [], "usage": USAGE})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(status=200, body=events(), headers=(("content-type", "text/event-stream"),))


def request_body(route: str) -> bytes:
    body: dict[str, Any] = {"model": "m", "stream": True}
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": "count to eight, one word at a time " * 4}]
    else:
        body["prompt"] = "count to eight: " * 10
    return json.dumps(body).encode()


async def stream_until(gw: memnet.MemGateway, route: str, body: bytes, tokens: int | None) -> tuple[int, bytes]:
    """Send `body`; read its stream until `tokens` token events came (None: to its end, or its cut),
    then close the connection. The status and what was read."""
    client = await gw.open()
    headers = [("authorization", f"Bearer {gw.token}"), ("content-type", "application/json")]
    await client.send_head("POST", route, [*headers, ("content-length", str(len(body)))])
    await client.send_body(body)
    status, _ = await client.head()
    got = b""
    try:
        while tokens is None or _token_events(got) < tokens:
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


def _token_events(body: bytes) -> int:
    n = 0
    for data in body.split(b"\n\n"):
        if data.startswith(b"data: {"):
            choices = json.loads(data[6:]).get("choices") or [{}]
            n += bool(choices[0].get("text") or (choices[0].get("delta") or {}).get("content"))
    return n


def estimated(gw: memnet.MemGateway, reason: str) -> float:
    return gw.gateway.usage.estimated_total.get(model="m", reason=reason)


async def gateway(tmp_path: Path, nursery: trio.Nursery, *engines: Engine, **options: Any) -> memnet.MemGateway:
    info = ModelInfo(name="m", engine="vllm", routes=(CHAT, COMPLETIONS))
    eps = tuple(e.endpoint() for e in engines)
    return await memnet.start_gateway(nursery, tmp_path, engines[0].net, eps, details=(info,), **options)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
async def test_a_client_gone_after_k_tokens_counts_k_and_the_prompts_estimate(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, route: str
) -> None:
    net = memnet.MemoryNet(nursery)
    gw = await gateway(tmp_path, nursery, Engine(net, "10.0.0.1"))
    budgets = with_budget(gw)
    body = request_body(route)
    status, got = await stream_until(gw, route, body, 3)
    assert status == 200 and _token_events(got) == 3 and b'"finish_reason":"stop"' not in got
    prompt = prompt_estimate(len(body))
    assert prompt == len(body) // 3 > 0
    assert list(gw.gateway.usage.pending.values()) == [[1, prompt, 0, 3]]
    assert estimated(gw, "client_gone") == 1
    assert charged(budgets) == prompt + 3  # the budget is charged what the ledger counts
    assert 'llmgw_gateway_usage_estimated_total{model="m",reason="client_gone"} 1' in gw.gateway.render_metrics()


@pytest.mark.parametrize("migrations", [0, 1])
async def test_a_stream_cut_and_not_continued_counts_the_tokens_relayed(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, migrations: int
) -> None:
    # migrations 0: cut as it is; 1: no other replica to continue it, an error event ends it.
    net = memnet.MemoryNet(nursery)
    gw = await gateway(tmp_path, nursery, Engine(net, "10.0.0.1", die_after=4), max_migrations=migrations)
    budgets = with_budget(gw)
    body = request_body(CHAT)
    status, got = await stream_until(gw, CHAT, body, None)
    assert status == 200 and _token_events(got) == 4
    assert (b'"code":"replica_failed"' in got) == bool(migrations)
    prompt = prompt_estimate(len(body))
    assert list(gw.gateway.usage.pending.values()) == [[1, prompt, 0, 4]]
    assert estimated(gw, "cut") == 1 and estimated(gw, "client_gone") == 0
    assert charged(budgets) == prompt + 4


async def test_a_whole_stream_counts_its_engines_usage_not_the_estimate(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    gw = await gateway(tmp_path, nursery, Engine(net, "10.0.0.1"))
    budgets = with_budget(gw)
    status, got = await stream_until(gw, CHAT, request_body(CHAT), None)
    assert status == 200 and got.endswith(b"data: [DONE]\n\n") and _token_events(got) == len(WORDS)
    assert list(gw.gateway.usage.pending.values()) == [[1, 7, 0, len(WORDS)]]
    assert gw.gateway.usage.estimated_total.values == {}
    assert charged(budgets) == 7 + len(WORDS)


async def test_a_stream_cut_after_a_move_takes_the_earlier_attempts_prompt(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The first engine says a usage in every event and dies after 3 words; the continuation says
    # none and dies after 2 more, and there is no second move: the prompt is the first attempt's
    # (5), the completion what was relayed (5), not the partial usage the first attempt last said (3).
    net = memnet.MemoryNet(nursery)
    a = Engine(net, "10.0.0.1", die_after=3, usage_each=True)
    b = Engine(net, "10.0.0.2", die_after=2)
    gw = await gateway(tmp_path, nursery, a, max_migrations=1)
    a_took = trio.Event()
    a.started = a_took
    async with trio.open_nursery() as n:
        result: list[tuple[int, bytes]] = []

        async def call() -> None:
            result.append(await stream_until(gw, CHAT, request_body(CHAT), None))

        n.start_soon(call)
        await a_took.wait()  # b joins the rotation once a has the request
        gw.provider.set((a.endpoint(), b.endpoint()), details=(ModelInfo(name="m", engine="vllm", routes=(CHAT,)),))
    [(status, got)] = result
    assert status == 200 and _token_events(got) == 5 and b"llmgw migrated" not in got
    assert list(gw.gateway.usage.pending.values()) == [[1, 5, 0, 5]]
    assert gw.gateway.usage.estimated_total.values == {("m", "cut"): 1}


def _sim_events(kind: str) -> list[bytes]:
    body: dict[str, Any] = {"model": "sim", "stream": True, "max_tokens": 12, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "tell me about the sea"}]
    else:
        body["prompt"] = "the sea is"
    job = api.parse_job(kind, body, served_model="sim", max_tokens_default=64)
    completion = api.answer_of(job)
    return [event for _, event in api.stream_events(job, completion, id="x", created=1)]


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_the_sims_events_carry_one_token_each(kind: str) -> None:
    # The sim's own stream, event by event as the gateway relays it: cut after any event before
    # its usage, the count is the tokens sent so far; cut just before the usage, the engine's
    # own completion_tokens exactly.
    events = _sim_events(kind)
    usage = json.loads(events[-2][6:])["usage"]
    assert usage["completion_tokens"] == 12 and events[-1] == b"data: [DONE]\n\n"
    for cut in range(1, len(events) - 1):  # the events sent before the usage event
        meter = StreamUsage(asked=False)
        for event in events[:cut]:
            meter.sent(meter.events(event))
        assert meter.tokens is None
        tokens = sum(1 for e in events[:cut] if _token_events(e))
        assert meter.relayed_tokens() == tokens, cut
    assert tokens == usage["completion_tokens"]  # cut just before the usage: the engine's count
    # The same events in one piece (a slow client, the gateway reading several at once).
    meter = StreamUsage(asked=False)
    meter.sent(b"".join(events[:-2]))
    assert meter.relayed_tokens() == usage["completion_tokens"]


async def test_the_sim_in_memory_client_gone_after_k_tokens(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    [sim] = memnet.start_sims(net, 1, model="m", output_token_ms=20)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (sim.endpoint(),))
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "the sea"}], "stream": True}).encode()
    status, got = await stream_until(gw, CHAT, body, 5)
    assert status == 200 and _token_events(got) == 5
    assert list(gw.gateway.usage.pending.values()) == [[1, len(body) // 3, 0, 5]]


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> bytes:
    return _sse({"id": "c", "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]})


async def test_the_opening_and_closing_events_are_left_out_wherever_the_pieces_fall() -> None:
    opening, done = _chunk({"role": "assistant", "content": ""}), b"data: [DONE]\n\n"
    tok = [_chunk({"content": f" w{i}"}) for i in range(3)]
    finish, comment = _chunk(finish="stop"), b": llmgw migrated 1\n\n"
    error = _sse({"error": {"message": "gone", "code": "replica_failed"}})
    cases = [
        ([opening + tok[0], tok[1], tok[2] + finish, done], 3),  # the end split over two pieces
        ([opening, tok[0] + tok[1] + tok[2] + finish + comment + done], 3),
        ([opening + tok[0] + tok[1] + finish], 2),  # one piece
        ([opening], 0),
        ([opening, error], 0),
        ([tok[0], tok[1] + error], 2),  # no opening (a completion, a continuation)
        ([_chunk({"reasoning_content": "hm"}) + _chunk({"tool_calls": [{"index": 0}]})], 2),
    ]
    for pieces, tokens in cases:
        meter = StreamUsage(asked=False)
        for piece in pieces:
            meter.sent(piece)
        assert meter.relayed_tokens() == tokens, pieces


async def test_a_long_cut_stream_is_counted_without_reading_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # 20,099 token events in pieces of 100, cut: every event counted, and only the opening and
    # the closing events read (json.loads counts the events read).
    meter = StreamUsage(asked=False)
    tok = _chunk({"content": " w"})
    meter.sent(_chunk({"role": "assistant", "content": ""}) + tok * 99)
    for _ in range(199):
        meter.sent(tok * 100)
    meter.sent(tok * 100 + _chunk(finish="length"))
    read: list[str] = []
    loads = json.loads

    def counting(data: str) -> Any:
        read.append(data)
        return loads(data)

    monkeypatch.setattr(usage_module.json, "loads", counting)
    assert meter.relayed_tokens() == 99 + 199 * 100 + 100
    assert len(read) == 3  # the opening, the finish, the last token
