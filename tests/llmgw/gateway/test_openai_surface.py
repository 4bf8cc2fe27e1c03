"""The gateway as OpenAI's clients see it, beyond chat: the routes each model's engine serves, one
model by id, `created`, a request id on every answer, a model none of whose replicas can become
ready failing at once, and the engines' errors in OpenAI's words (`gateway/engineerrors.py`).
Sim engines in memory on MockClock (`testlib.memnet`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.gateway.engineerrors import normalized
from llmgw.wire import gateway_link as g
from testlib import memnet
from testlib.gateway import chat

CREATED = 1_750_000_000


def info(name: str, **kw) -> g.ModelInfo:
    return g.ModelInfo(name=name, engine="sim", routes=(g.CHAT, g.COMPLETIONS), created=CREATED, **kw)


@pytest.mark.trio
async def test_models_by_id_with_created_and_the_routes_a_models_engine_serves(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),), details=(info("chat"),))
    status, _, body = await gw.call("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"] == [
        {"id": "chat", "object": "model", "created": CREATED, "owned_by": "llmgw"}
    ]
    status, headers, body = await gw.call("GET", "/v1/models/chat")
    assert status == 200 and json.loads(body)["created"] == CREATED and headers["x-request-id"]
    status, _, body = await gw.call("GET", "/v1/models/nope")
    error = json.loads(body)["error"]
    assert status == 404 and (error["code"], error["param"]) == ("model_not_found", "model")
    status, _, body = await gw.call("GET", "/v1/models/chat", token="llmgw-wrong")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"

    # A route the sim does not serve: the gateway's own answer, not the engine's.
    status, headers, body = await gw.call("POST", "/v1/embeddings", {"model": "chat", "input": "hello"})
    error = json.loads(body)["error"]
    assert status == 404 and (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "unsupported_route",
        "model",
    )
    assert "'chat' (engine sim) does not serve POST /v1/embeddings" in error["message"]
    assert "/v1/chat/completions, /v1/completions" in error["message"] and "x-llmgw-replica" not in headers
    # Those it serves are forwarded.
    assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 200
    # A provider that does not say what a model serves (an older table): every route goes through.
    gw.provider.set((a.endpoint(),))
    await trio.testing.wait_all_tasks_blocked()
    status, headers, _ = await gw.call("POST", "/v1/embeddings", {"model": "chat", "input": "hello"})
    assert status == 404 and headers["x-llmgw-replica"] == a.name  # the engine's own 404, relayed


@pytest.mark.trio
async def test_a_request_id_on_every_answer_the_callers_own_when_usable(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),))
    ids = set()
    for method, path, body, token in (
        ("POST", "/v1/chat/completions", chat(), ""),
        ("POST", "/v1/chat/completions", chat(stream=True), ""),
        ("POST", "/v1/chat/completions", chat(), None),
        ("GET", "/v1/models", None, ""),
        ("GET", "/health", None, ""),
        ("GET", "/nowhere", None, ""),
    ):
        _, headers, _ = await gw.call(method, path, body, token=token)
        assert headers["x-request-id"].startswith("req_") and len(headers["x-request-id"]) == 28
        ids.add(headers["x-request-id"])
    assert len(ids) == 6
    _, headers, _ = await gw.call("POST", "/v1/chat/completions", chat(), headers={"x-request-id": "trace-42/abc"})
    assert headers["x-request-id"] == "trace-42/abc"
    for unusable in ("x" * 129, "has space", 'quote"d'):
        _, headers, _ = await gw.call("POST", "/v1/chat/completions", chat(), headers={"x-request-id": unusable})
        assert headers["x-request-id"].startswith("req_")


@pytest.mark.trio
async def test_a_model_none_of_whose_replicas_can_become_ready_fails_at_once(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    why = "no replica can be placed: no node has 80 GiB of memory free"
    gw = await memnet.start_gateway(
        nursery,
        tmp_path,
        net,
        (),
        models=frozenset({"chat"}),
        details=(info("chat", unservable=why, retry_after_s=30),),
        queue_timeout_s=20,
    )
    started = trio.current_time()
    status, headers, body = await gw.call("POST", "/v1/chat/completions", chat())
    assert trio.current_time() - started < 0.01  # not the queue's 20 s
    error = json.loads(body)["error"]
    assert status == 503 and (error["type"], error["code"]) == ("server_error", "model_unavailable")
    assert why in error["message"] and "'chat'" in error["message"]
    assert headers["retry-after"] == "30" and headers["x-should-retry"] == "false"

    # One that is starting (nothing ready, nothing unservable) waits in the queue, and is served
    # once its replica is ready.
    gw.provider.set((), frozenset({"chat"}), (info("chat"),))
    results = []

    async def ask() -> None:
        results.append(await gw.call("POST", "/v1/chat/completions", chat()))

    async with trio.open_nursery() as inner:
        inner.start_soon(ask)
        await trio.sleep(5)
        assert results == []
        gw.provider.set((a.endpoint(),), None, (info("chat"),))
    assert results[0][0] == 200

    # Becoming unservable while it waits ends the wait then.
    gw.provider.set((), frozenset({"chat"}), (info("chat"),))
    await trio.testing.wait_all_tasks_blocked()
    async with trio.open_nursery() as inner:
        inner.start_soon(ask)
        await trio.sleep(2)
        gw.provider.set((), frozenset({"chat"}), (info("chat", unservable="the nodes of its replicas are lost: n1"),))
    assert results[1][0] == 503 and json.loads(results[1][2])["error"]["code"] == "model_unavailable"


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        # llama.cpp: its own type for a prompt past the context
        (
            400,
            {
                "error": {
                    "code": 400,
                    "message": "the request exceeds the available context size, try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": 5000,
                    "n_ctx": 4096,
                }
            },
            ("invalid_request_error", "context_length_exceeded", "messages", {"n_prompt_tokens": 5000}),
        ),
        # vLLM / SGLang: the words of the message
        (
            400,
            {
                "object": "error",
                "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            ("invalid_request_error", "context_length_exceeded", "messages", {}),
        ),
        # Any other engine error: OpenAI's type for its status, an integer code dropped
        (
            400,
            {"object": "error", "message": "temperature must be >= 0", "type": "BadRequestError", "code": 400},
            ("invalid_request_error", None, None, {}),
        ),
        (
            500,
            {"error": {"code": 500, "message": "CUDA out of memory", "type": "server_error"}},
            ("server_error", None, None, {}),
        ),
        (
            400,
            {"error": {"message": "bad tool", "type": "invalid_request_error", "param": "tools", "code": "bad_tool"}},
            None,  # already in the shape
        ),
    ],
)
def test_engine_errors_in_openais_shape(status: int, body: dict, expected) -> None:
    raw = json.dumps(body).encode()
    out = normalized(status, raw)
    if expected is None:
        assert out is None
        return
    assert out is not None
    error = json.loads(out)["error"]
    kind, code, param, kept = expected
    assert (error["type"], error["code"], error["param"]) == (kind, code, param)
    assert error["message"] == (body.get("error") or body)["message"] and "object" not in error
    assert kept.items() <= error.items()


def test_engine_answers_that_are_not_error_objects_pass_unchanged() -> None:
    for status, raw in (
        (400, b"not json"),
        (400, b'{"detail": "FastAPI said no"}'),
        (404, b"[1, 2, 3]"),
        (200, b'{"error": {"message": "an answer, not an error"}}'),
        (400, b'{"error": {"message": "' + b"x" * 70_000 + b'"}}'),  # past what is parsed on the loop
        (400, b'{"error": {"message": 7}}'),
    ):
        assert normalized(status, raw) is None
