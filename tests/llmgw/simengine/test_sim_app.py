"""The sim engine's HTTP side over in-memory streams on a fake clock: routes, the key, readiness,
and how long answers take, streamed and not."""

from __future__ import annotations

import gzip
import json
import math
from functools import partial
from typing import Any

import h11
import pytest
import trio
import trio.testing

from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request
from llmgw.http.openai import error_body
from llmgw.http.server import serve_connection
from llmgw.simengine import api
from llmgw.simengine.app import SimEngine
from llmgw.simengine.options import SimOptions
from llmgw.simengine.text import complete
from testlib import clientschemas, schemacheck

pytestmark = pytest.mark.trio

KEY = "replica-secret"


class Client:
    """An h11 client over a memory stream that notes when each piece of a response arrived."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def request(
        self, method: str, target: str, body: Any = None, *, key: str | None = KEY, raw: bytes | None = None
    ):
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        headers = [("host", "sim"), ("content-length", str(len(data)))]
        if key is not None:
            headers.append(("authorization", f"Bearer {key}"))
        await self.stream.send_all(self.conn.send(h11.Request(method=method, target=target, headers=headers)))
        if data:
            await self.stream.send_all(self.conn.send(h11.Data(data=data)))
        await self.stream.send_all(self.conn.send(h11.EndOfMessage()))
        return await self.response()

    async def response(self) -> tuple[int, dict[str, str], list[tuple[float, bytes]]]:
        """(status, headers, [(arrival time, data)])."""
        status, headers, parts = 0, {}, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                parts.append((trio.current_time(), bytes(event.data)))
            elif isinstance(event, h11.EndOfMessage):
                self.conn.start_next_cycle()
                return status, headers, parts
            else:
                raise AssertionError(f"unexpected {event!r}")


def body_of(parts: list[tuple[float, bytes]]) -> Any:
    return json.loads(b"".join(data for _, data in parts))


def engine(**options: Any) -> SimEngine:
    e = SimEngine(SimOptions(model="m", api_key=KEY, **options), wall_clock=lambda: 1000.0, new_id=lambda: "id1")
    e.serving = True
    return e


async def connect(nursery: trio.Nursery, e: SimEngine) -> Client:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    nursery.start_soon(partial(serve_connection, e.handle, server_stream, errors=error_body))
    return Client(client_stream)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "one two three four"}], "max_tokens": 5}


async def test_whole_answer_waits_prompt_then_output_time(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, engine(prompt_token_ms=100, output_token_ms=50))
        start = trio.current_time()
        status, headers, parts = await c.request("POST", "/v1/chat/completions", CHAT)
        assert status == 200 and headers["content-type"] == "application/json"
        body = body_of(parts)
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
        assert body["id"] == "chatcmpl-id1" and body["created"] == 1000
        # 4 prompt tokens x 100 ms + 5 output tokens x 50 ms
        assert parts[0][0] - start == pytest.approx(0.65)
        nursery.cancel_scope.cancel()


async def test_same_request_same_text_over_http(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, engine())
        first = body_of((await c.request("POST", "/v1/chat/completions", CHAT))[2])
        again = body_of((await c.request("POST", "/v1/chat/completions", CHAT))[2])
        assert first == again
        prompt = complete(
            "m", api.prompt_digest(json.dumps([["user", "one two three four"]], separators=(",", ":"))), 5
        )
        assert first["choices"][0]["message"]["content"] == prompt.text
        completion = {"model": "m", "prompt": "one two", "max_tokens": 3}
        text = body_of((await c.request("POST", "/v1/completions", completion))[2])["choices"][0]["text"]
        assert text == complete("m", api.prompt_digest("one two"), 3).text
        nursery.cancel_scope.cancel()


async def test_stream_sends_each_token_when_it_is_made(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, engine(prompt_token_ms=100, output_token_ms=50))
        start = trio.current_time()
        status, headers, parts = await c.request("POST", "/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 200
        assert headers["content-type"] == "text/event-stream" and headers["transfer-encoding"] == "chunked"
        events = [(at - start, data) for at, data in parts]
        assert all(data.startswith(b"data: ") and data.endswith(b"\n\n") for _, data in events)
        chunks = [json.loads(data[6:]) for _, data in events[:-1]]
        assert events[-1][1] == b"data: [DONE]\n\n"
        # role at 0.4 s (the prompt), then one token every 50 ms, then the finish and [DONE].
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        token_times = [at for at, data in events[1:6]]
        assert token_times == pytest.approx([0.45, 0.5, 0.55, 0.6, 0.65])
        assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None] * 6 + ["length"]
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
        whole = body_of((await c.request("POST", "/v1/chat/completions", CHAT))[2])
        assert text == whole["choices"][0]["message"]["content"]
        nursery.cancel_scope.cancel()


async def test_key_is_required_on_v1_and_not_on_health() -> None:
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, engine())
        for key, says in ((None, "missing API key"), ("wrong", "incorrect API key")):
            status, headers, parts = await c.request("GET", "/v1/models", key=key)
            assert status == 401 and headers["www-authenticate"] == "Bearer"
            error = body_of(parts)["error"]
            assert (
                error["type"] == "authentication_error"
                and error["code"] in (None, "invalid_api_key")
                and says in error["message"]
            )
            assert KEY not in error["message"]
        status, _, parts = await c.request("GET", "/health", key=None)
        assert (status, body_of(parts)) == (200, {"status": "ok"})
        status, _, parts = await c.request("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in body_of(parts)["data"]] == ["m"]
        nursery.cancel_scope.cancel()


async def test_without_a_key_anyone_may_ask() -> None:
    e = SimEngine(SimOptions(model="m"))
    e.serving = True
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, e)
        assert (await c.request("GET", "/v1/models", key=None))[0] == 200
        nursery.cancel_scope.cancel()


async def test_not_serving_is_503_saying_what_it_waits_for() -> None:
    e = engine()
    e.serving = False
    e.set_waiting(lambda: "rendezvous: 0 of 1 workers joined")
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, e)
        for target in ("/health", "/v1/models"):
            status, _, parts = await c.request("GET", target)
            error = body_of(parts)["error"]
            assert status == 503 and error["type"] == "unavailable_error"
            assert error["message"] == "not serving yet: rendezvous: 0 of 1 workers joined"
        e.serving = True
        assert (await c.request("GET", "/health"))[0] == 200
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("method", "target", "raw", "status", "says"),
    [
        ("POST", "/v1/chat/completions", b"{not json", 400, "request body is not valid JSON"),
        ("POST", "/v1/completions", b'{"model": "other", "prompt": "x"}', 404, "the model 'other' does not exist"),
        ("POST", "/v1/completions", b'{"model": "m", "prompt": "x", "n": 3}', 400, "'n' must be 1"),
        ("GET", "/v1/chat/completions", b"", 405, "/v1/chat/completions takes POST, not GET"),
        ("GET", "/v2/nothing", b"", 404, "no route '/v2/nothing'"),
    ],
)
async def test_errors_are_openai_shaped(method: str, target: str, raw: bytes, status: int, says: str) -> None:
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, engine())
        got, headers, parts = await c.request(method, target, raw=raw)
        body = body_of(parts)
        assert got == status and headers["content-type"] == "application/json"
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] is None or isinstance(body["error"]["code"], str)
        assert says in body["error"]["message"]
        nursery.cancel_scope.cancel()


async def test_metrics_answer_from_the_start_without_a_key_with_the_loops_lag(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from llmgw.looplag import LagMonitor, serve_loop_lag

    monitor = LagMonitor()
    e = SimEngine(SimOptions(model="m", api_key=KEY), loop_lag=monitor)
    e.set_waiting(lambda: "loading the model")  # not serving yet: /metrics answers all the same
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_loop_lag, monitor)
        c = await connect(nursery, e)
        await trio.sleep(1)
        status, headers, parts = await c.request("GET", "/metrics", key=None)
        text = b"".join(data for _, data in parts).decode()
        assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
        count = [line for line in text.splitlines() if line.startswith("llmgw_event_loop_lag_seconds_count ")]
        assert count and float(count[0].split()[1]) >= 19  # a tick every 50 ms
        assert "llmgw_event_loop_busy_max_seconds 0" in text
        assert (await c.request("POST", "/metrics", key=None))[0] == 405
        nursery.cancel_scope.cancel()


# -- tool calls, structured output and logprobs over HTTP ------------------------------------------

WEATHER_TOOLS = [clientschemas.WEATHER_TOOL, clientschemas.MULTIPLY_TOOL]


def sse_chunks(parts: list[tuple[float, bytes]]) -> list[tuple[float, Any]]:
    """(arrival time, chunk) for each event; "[DONE]" for the last."""
    out = []
    for at, data in parts:
        for event in data.split(b"\n\n"):
            if event:
                payload = event.removeprefix(b"data: ")
                out.append((at, "[DONE]" if payload == b"[DONE]" else json.loads(payload)))
    return out


def accumulate(chunks: list[Any]) -> dict[str, Any]:
    """A streamed chat answer put together as a client does (the openai SDK's stream state,
    LangChain's chunk merging): deltas appended by choice, tool calls merged by their index."""
    message: dict[str, Any] = {"role": None, "content": None, "tool_calls": []}
    finish, usage = None, None
    for chunk in chunks:
        if chunk == "[DONE]":
            break
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["role"] = delta.get("role") or message["role"]
            if delta.get("content") is not None:
                message["content"] = (message["content"] or "") + delta["content"]
            for part in delta.get("tool_calls") or []:
                calls = message["tool_calls"]
                while len(calls) <= part["index"]:
                    calls.append({"id": None, "type": None, "function": {"name": "", "arguments": ""}})
                call = calls[part["index"]]
                call["id"] = part.get("id") or call["id"]
                call["type"] = part.get("type") or call["type"]
                call["function"]["name"] += part.get("function", {}).get("name") or ""
                call["function"]["arguments"] += part.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {"message": message, "finish_reason": finish, "usage": usage}


async def test_streamed_tool_calls_reassemble_into_the_whole_answer(autojump_clock: trio.testing.MockClock) -> None:
    ask = {
        "model": "m",
        "messages": [{"role": "user", "content": "GetWeather in Oslo, and multiply 6 by 7"}],
        "tools": WEATHER_TOOLS,
        "stream_options": {"include_usage": True},
    }
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, engine(prompt_token_ms=100, output_token_ms=50))
        whole = body_of((await c.request("POST", "/v1/chat/completions", ask))[2])
        start = trio.current_time()
        status, _, parts = await c.request("POST", "/v1/chat/completions", {**ask, "stream": True})
        assert status == 200
        timed = sse_chunks(parts)
        got = accumulate([chunk for _, chunk in timed])
        expected = whole["choices"][0]
        assert got["message"]["tool_calls"] == expected["message"]["tool_calls"]
        assert got["message"]["role"] == "assistant" and got["message"]["content"] is None
        assert got["finish_reason"] == expected["finish_reason"] == "tool_calls" and got["usage"] == whole["usage"]
        arguments = [json.loads(call["function"]["arguments"]) for call in got["message"]["tool_calls"]]
        assert [call["function"]["name"] for call in got["message"]["tool_calls"]] == ["GetWeather", "multiply"]
        assert schemacheck.problems(arguments[0], clientschemas.WEATHER_TOOL["function"]["parameters"]) == []
        assert schemacheck.problems(arguments[1], clientschemas.MULTIPLY_TOOL["function"]["parameters"]) == []
        # The first call's name with the role after the prompt (8 tokens × 100 ms), then one
        # argument token every 50 ms.
        assert whole["usage"]["prompt_tokens"] == 8
        tokens = whole["usage"]["completion_tokens"]
        assert timed[0][0] - start == pytest.approx(0.8)
        assert timed[-1][0] - start == pytest.approx(0.8 + tokens * 0.05)
        nursery.cancel_scope.cancel()


async def test_structured_output_streamed_and_whole_validates(autojump_clock: trio.testing.MockClock) -> None:
    ask = {
        "model": "m",
        "messages": [{"role": "user", "content": "solve 8x + 7 = -23"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "Math", "schema": clientschemas.MATH_STRICT, "strict": True},
        },  # fmt: skip
    }
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, engine())
        whole = body_of((await c.request("POST", "/v1/chat/completions", ask))[2])
        content = whole["choices"][0]["message"]["content"]
        assert schemacheck.problems(json.loads(content), clientschemas.MATH_STRICT) == []
        parts = (await c.request("POST", "/v1/chat/completions", {**ask, "stream": True}))[2]
        assert accumulate([chunk for _, chunk in sse_chunks(parts)])["message"]["content"] == content
        nursery.cancel_scope.cancel()


async def test_logprobs_whole_and_streamed_over_http(autojump_clock: trio.testing.MockClock) -> None:
    ask = {**CHAT, "max_tokens": 4096, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, engine())
        status, _, parts = await c.request("POST", "/v1/chat/completions", ask)
        content = body_of(parts)["choices"][0]["logprobs"]["content"]
        assert status == 200 and len(content) == 4096 and all(len(e["top_logprobs"]) == 20 for e in content)
        ask = {**ask, "max_tokens": 5, "stream": True}
        streamed = [chunk for _, chunk in sse_chunks((await c.request("POST", "/v1/chat/completions", ask))[2])]
        entries = [ch["choices"][0]["logprobs"]["content"][0] for ch in streamed[1:-2]]
        assert entries == content[:5]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'tool_choice.function.name' 'nope' names no tool in 'tools'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a+"}}}}, "'response_format.json_schema.schema': 'pattern' is not supported"),
        ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be a whole number from 0 to 20"),
    ],
)  # fmt: skip
async def test_what_the_sim_cannot_do_is_an_openai_shaped_400(body: dict[str, Any], says: str) -> None:
    async with trio.open_nursery() as nursery:
        c = await connect(nursery, engine())
        status, _, parts = await c.request("POST", "/v1/chat/completions", {**CHAT, **body})
        error = body_of(parts)["error"]
        assert status == 400 and error["type"] == "invalid_request_error" and says in error["message"]
        nursery.cancel_scope.cancel()


async def test_bodies_are_held_to_the_gateways_json_rule() -> None:
    # The sim stands in for an engine behind the gateway, and parses as the gateway does
    # (llmgw.http.jsonbody): a compressed body is 415 from its head, NaN a 400 in our words.
    e = engine()
    auth = {"authorization": f"Bearer {KEY}"}
    try:
        compressed = gzip.compress(json.dumps(CHAT).encode())
        with pytest.raises(HTTPError) as refused:
            await e.handle(
                Request.of(
                    "POST", "/v1/chat/completions", body=compressed, headers={**auth, "content-encoding": "gzip"}
                )
            )
        assert (refused.value.status, refused.value.code) == (415, "unsupported_content_encoding")
        assert refused.value.message == "Content-Encoding 'gzip' is not supported; send the request body uncompressed"
        nan = json.dumps({**CHAT, "temperature": math.nan}).encode()
        with pytest.raises(HTTPError) as refused:
            await e.handle(Request.of("POST", "/v1/chat/completions", body=nan, headers=auth))
        assert refused.value.status == 400 and "request body has NaN, which is not JSON" in refused.value.message
    finally:
        await e.aclose()


# -- continuing an answer over HTTP (request migration) --------------------------------------------


async def post(client: Client, target: str, body: Any) -> list[tuple[float, bytes]]:
    status, _, parts = await client.request("POST", target, body)
    assert status == 200
    return parts


def streamed_text(parts: list[tuple[float, bytes]]) -> str:
    """The text of a streamed answer, a chat's or a completion's."""
    text = ""
    for _, chunk in sse_chunks(parts):
        if chunk != "[DONE]" and chunk["choices"]:
            choice = chunk["choices"][0]
            text += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
    return text


async def test_an_answer_cut_mid_stream_is_continued_by_another_replica(autojump_clock: trio.testing.MockClock) -> None:
    ask = {"model": "m", "messages": [{"role": "user", "content": "tell me about rivers"}], "max_tokens": 1000}
    async with trio.open_nursery() as nursery:
        first, second = await connect(nursery, engine()), await connect(nursery, engine())
        whole = body_of(await post(first, "/v1/chat/completions", ask))["choices"][0]["message"]["content"]
        words = whole.split(" ")
        for k in (1, len(words) // 2, len(words)):
            received = " ".join(words[:k])
            messages = [*ask["messages"], {"role": "assistant", "content": received}]
            for flags in ({}, {"continue_final_message": True, "add_generation_prompt": False}):
                again = {**ask, **flags, "messages": messages}
                rest = body_of(await post(second, "/v1/chat/completions", again))
                assert received + rest["choices"][0]["message"]["content"] == whole
                assert rest["choices"][0]["finish_reason"] == "stop"
                assert rest["usage"]["prompt_tokens"] == 4 + k and rest["usage"]["completion_tokens"] == len(words) - k
                streamed = await post(second, "/v1/chat/completions", {**again, "stream": True})
                assert received + streamed_text(streamed) == whole
        status, _, parts = await second.request(
            "POST", "/v1/chat/completions", {**ask, "messages": messages, "continue_final_message": True}
        )
        error = body_of(parts)["error"]
        assert status == 400 and "Cannot set both `continue_final_message` and `add_generation_prompt`" in error["message"]  # fmt: skip
        completion = {"model": "m", "prompt": "Once", "max_tokens": 1000}
        whole = body_of(await post(first, "/v1/completions", completion))["choices"][0]["text"]
        received = " ".join(whole.split(" ")[:7])
        again = {**completion, "prompt": "Once" + received}
        assert received + body_of(await post(second, "/v1/completions", again))["choices"][0]["text"] == whole
        streamed = await post(second, "/v1/completions", {**again, "stream": True})
        assert received + streamed_text(streamed) == whole
        nursery.cancel_scope.cancel()
