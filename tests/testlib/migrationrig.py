"""A gateway in memory in front of two scripted engines, the first of which dies mid-answer
(testlib.memnet, on MockClock): the rig of the request-migration tests
(tests/llmgw/gateway/test_migration.py) that the traces' test of a migrated stream uses too.
Each engine answers a fixed text (WORDS) word by word as SSE, and records the bodies it was sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from llmgw.gateway.migrate import CHAT, COMPLETIONS
from llmgw.gateway.routing import Endpoint
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.wire.gateway_link import ModelInfo
from testlib import memnet

WORDS = [("" if i == 0 else " ") + w for i, w in enumerate("the quick brown fox jumps over the lazy dog again".split())]


class Scripted:
    """An engine answering WORDS from where the request says it is (its final assistant message,
    or the prompt's tail past "Q:"), one SSE event a word, `token_s` apart; `die_after` words and
    it is gone (its connections cut), `stall_after` words and it goes silent; `refuse` (a status and
    a body) is its answer to a continuation. `echo_prefill`: as llama-server (b11434) does, a final
    assistant message continued without `continue_final_message` (its assistant prefill) comes back
    at the start of the answer, in its first content event with the first new word."""

    def __init__(
        self,
        net: memnet.MemoryNet,
        name: str,
        host: str,
        *,
        die_after: int = 0,
        stall_after: int = 0,
        refuse: tuple[int, dict[str, Any]] | None = None,
        echo_prefill: bool = False,
    ):
        self.net, self.name, self.host = net, name, host
        self.echo_prefill = echo_prefill
        self.die_after, self.stall_after, self.refuse = die_after, stall_after, refuse
        self.bodies: list[dict[str, Any]] = []
        net.serve((host, 8000), self.handle)

    def endpoint(self) -> Endpoint:
        return Endpoint(replica_id=self.name, model="m", host=self.host, port=8000, api_key="k")

    async def handle(self, request: Request) -> Response | StreamingResponse:
        body = json.loads(await request.read())
        self.bodies.append(body)
        chat = request.path == CHAT
        echo = ""
        if chat:
            last = body["messages"][-1]
            start = len(last["content"].split()) if last["role"] == "assistant" else 0
            if start and self.echo_prefill and not body.get("continue_final_message"):
                echo = last["content"]
        else:
            start = len(body["prompt"].split("Q:", 1)[1].split()) if "Q:" in body["prompt"] else 0
        if start and self.refuse is not None:
            status, error = self.refuse
            return Response(
                status=status, body=json.dumps(error).encode(), headers=(("content-type", "application/json"),)
            )
        limit = body.get("max_tokens", 100)
        words = WORDS[start : start + limit]
        finish = "stop" if start + len(words) == len(WORDS) else "length"
        kind = "chat.completion.chunk" if chat else "text_completion"
        ident = f"id-{self.name}"

        async def events():
            if chat:
                yield sse({"id": ident, "object": kind, "created": 100 + start, "choices": [_choice(chat, role=True)]})
            for i, w in enumerate(words):
                if self.die_after and i == self.die_after:
                    self.net.kill((self.host, 8000))
                    await trio.sleep_forever()
                if self.stall_after and i == self.stall_after:
                    await trio.sleep_forever()
                await trio.sleep(0.01)
                text = echo + w if i == 0 else w
                yield sse({"id": ident, "object": kind, "created": 100 + start, "choices": [_choice(chat, text=text)]})
            yield sse({"id": ident, "object": kind, "created": 100 + start, "choices": [_choice(chat, finish=finish)]})
            if body.get("stream_options", {}).get("include_usage"):
                usage = {
                    "prompt_tokens": 5 + start,
                    "completion_tokens": len(words),
                    "total_tokens": 5 + start + len(words),
                }
                yield sse({"id": ident, "object": kind, "created": 100 + start, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(status=200, body=events(), headers=(("content-type", "text/event-stream"),))


def _choice(chat: bool, *, text: str = "", role: bool = False, finish: str | None = None) -> dict[str, Any]:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish}
    return {"index": 0, "text": text, "finish_reason": finish}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def parse(body: bytes) -> tuple[list[dict[str, Any]], list[str], bool]:
    """The JSON events, the comment lines, and whether [DONE] ended it."""
    events, comments, done = [], [], False
    for block in body.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith(":"):
                comments.append(line)
            elif line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events, comments, done


def text_of(events: list[dict[str, Any]], chat: bool = True) -> str:
    out = []
    for e in events:
        for c in e.get("choices", []):
            out.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    return "".join(out)


async def setup(tmp_path: Path, nursery: trio.Nursery, engine: str, **options: Any):
    net = memnet.MemoryNet(nursery)
    a = Scripted(net, "m-0", "10.0.0.1", die_after=4)
    b = Scripted(net, "m-1", "10.0.0.2")
    info = ModelInfo(name="m", engine=engine, routes=(CHAT, COMPLETIONS))
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),), details=(info,), **options)
    return net, a, b, gw, info


async def via_a_then_b(gw, a: Scripted, b: Scripted, info: ModelInfo, path: str, request: dict[str, Any]):
    """The request sent while a alone is in rotation; b is put in as soon as a has it."""
    async with trio.open_nursery() as n:
        result: list[Any] = []

        async def call() -> None:
            result.append(await gw.call("POST", path, request))

        n.start_soon(call)
        while not a.bodies:
            await trio.sleep(0.001)
        gw.provider.set((a.endpoint(), b.endpoint()), details=(info,))
    return result[0]
