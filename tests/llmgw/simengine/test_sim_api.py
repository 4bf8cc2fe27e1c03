"""OpenAI requests checked into jobs, and answers and stream chunks in OpenAI's exact shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.http.errors import HTTPError
from llmgw.simengine import api
from llmgw.simengine.text import Completion, complete


def job(kind: api.Kind = "chat", **body: Any) -> api.Job:
    base: dict[str, Any] = {"model": "m"}
    base.update({"messages": [{"role": "user", "content": "a b c"}]} if kind == "chat" else {"prompt": "a b c"})
    base.update(body)
    return api.parse_job(kind, base, served_model="m", max_tokens_default=7)


def refused(kind: api.Kind, body: Any) -> HTTPError:
    with pytest.raises(HTTPError) as info:
        api.parse_job(kind, body, served_model="m", max_tokens_default=7)
    return info.value


def test_chat_prompt_tokens_count_every_message_content() -> None:
    j = job(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "one two"}, {"type": "image_url", "image_url": {}}]},
            {"role": "assistant", "content": None},
        ]
    )
    assert j.prompt_tokens == 4 and j.max_tokens == 7 and not j.stream
    assert j.prompt_key == job(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two"}, {"role": "assistant", "content": ""}]).prompt_key  # fmt: skip


def test_fields_that_change_the_answer_are_read() -> None:
    j = job(max_tokens=3, stop="x", stream=True, stream_options={"include_usage": True}, temperature=0.2)
    assert (j.max_tokens, j.stop, j.stream, j.include_usage) == (3, ("x",), True, True)
    assert job(max_completion_tokens=4, max_tokens=9).max_tokens == 4
    c = job("completion", prompt=["one two three four"], max_tokens=2, ignore_eos=True)
    assert (c.prompt_key, c.prompt_tokens, c.max_tokens, c.ignore_eos) == (
        api.prompt_digest("one two three four"),
        4,
        2,
        True,
    )
    assert len(c.prompt_key) == 32  # fixed-size, however long the prompt


@pytest.mark.parametrize(
    ("kind", "body", "status", "says"),
    [
        ("chat", [1], 400, "request body must be a JSON object, got an array"),
        ("chat", {"messages": []}, 400, "'model' must be a non-empty string, got null; this server serves 'm'"),
        ("chat", {"model": "gpt-4", "messages": []}, 404, "the model 'gpt-4' does not exist; this server serves 'm'"),
        ("chat", {"model": "m", "messages": []}, 400, "'messages' must be a non-empty array of messages, got []"),
        ("chat", {"model": "m", "messages": [{"content": "x"}]}, 400, "'messages[0].role' must be a string"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": 5}]}, 400, "'messages[0].content' must be a string or an array"),
        ("completion", {"model": "m", "prompt": ["a", "b"]}, 400, "'prompt' must be a string (or an array of exactly one string)"),
        ("completion", {"model": "m", "prompt": "a", "max_tokens": 0}, 400, "'max_tokens' must be a whole number from 1 to 4096 (the sim engine's limit), got 0"),
        ("completion", {"model": "m", "prompt": "a", "max_tokens": "5"}, 400, "'max_tokens' must be a whole number from 1 to 4096 (the sim engine's limit), got \"5\""),
        ("completion", {"model": "m", "prompt": "a", "n": 2}, 400, "'n' must be 1"),
        ("completion", {"model": "m", "prompt": "a", "stream": "yes"}, 400, "'stream' must be true or false, got \"yes\""),
        ("completion", {"model": "m", "prompt": "a", "stop": [1]}, 400, "'stop' must be a string or an array of up to 4 strings"),
        ("completion", {"model": "m", "prompt": "a", "stream_options": {"include_usage": 1}}, 400, "'stream_options.include_usage' must be true or false"),
    ],
)  # fmt: skip
def test_bad_requests_name_what_is_wrong(kind: api.Kind, body: Any, status: int, says: str) -> None:
    err = refused(kind, body)
    assert err.status == status and says in err.message
    assert err.kind == ("not_found_error" if status == 404 else "invalid_request_error")


def test_whole_chat_answer_shape() -> None:
    j = job(max_tokens=3)
    c = complete("m", j.prompt_key, 3)
    body = api.response_body(j, c, id="chatcmpl-1", created=100)
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }


def test_whole_completion_answer_shape() -> None:
    j = job("completion")
    c = Completion(pieces=("x", " y"), finish_reason="stop")
    body = api.response_body(j, c, id="cmpl-1", created=5)
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "x y", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def parse_sse(events: list[bytes]) -> list[Any]:
    out = []
    for event in events:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
        payload = event[len(b"data: ") : -2]
        out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def test_chat_stream_events_role_tokens_finish_usage_done() -> None:
    j = job(stream=True, stream_options={"include_usage": True})
    c = Completion(pieces=("x", " y"), finish_reason="length")
    events = list(api.stream_events(j, c, id="chatcmpl-1", created=5))
    assert [is_token for is_token, _ in events] == [False, True, True, False, False, False]
    chunks = parse_sse([e for _, e in events])
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    assert chunks[0] == {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}  # fmt: skip
    assert chunks[1] == {**head, "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]}  # fmt: skip
    assert chunks[2]["choices"][0]["delta"] == {"content": " y"}
    assert chunks[3] == {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]}
    assert chunks[4] == {
        **head,
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    assert chunks[5] == "[DONE]"


def test_completion_stream_events_without_usage() -> None:
    j = job("completion", stream=True)
    c = Completion(pieces=("x",), finish_reason="stop")
    chunks = parse_sse([e for _, e in api.stream_events(j, c, id="cmpl-1", created=5)])
    assert [ch if ch == "[DONE]" else ch["choices"] for ch in chunks] == [
        [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}],
        "[DONE]",
    ]
    assert chunks[0]["object"] == "text_completion"


def test_models_lists_the_one_model() -> None:
    assert api.models_body("m", 5) == {
        "object": "list",
        "data": [{"id": "m", "object": "model", "created": 5, "owned_by": "llmgw-sim"}],
    }
