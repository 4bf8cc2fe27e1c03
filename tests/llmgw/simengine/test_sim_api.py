"""OpenAI requests checked into jobs, and answers and stream chunks in OpenAI's exact shapes."""

from __future__ import annotations

import json
import math
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


# -- logprobs -------------------------------------------------------------------------------------


def test_chat_logprobs_one_entry_per_token_with_falling_alternatives() -> None:
    j = job(logprobs=True, top_logprobs=5, max_tokens=30)
    c = api.answer_of(j)
    lp = api.response_body(j, c, id="x", created=1)["choices"][0]["logprobs"]
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
    assert [e["token"] for e in lp["content"]] == list(c.pieces)
    for e in lp["content"]:
        assert e["bytes"] == list(e["token"].encode()) and -0.7 < e["logprob"] < 0
        top = e["top_logprobs"]
        assert len(top) == 5 and top[0] == {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True) and len({t["token"] for t in top}) == 5
        assert sum(math.exp(v) for v in values) < 1
        assert all(t["token"].startswith(" ") == e["token"].startswith(" ") for t in top)
    assert lp == api.response_body(j, api.answer_of(job(logprobs=True, top_logprobs=5, max_tokens=30)), id="y", created=2)["choices"][0]["logprobs"]  # fmt: skip
    plain = api.response_body(job(logprobs=True), c, id="x", created=1)["choices"][0]["logprobs"]
    assert all(e["top_logprobs"] == [] for e in plain["content"])  # top_logprobs 0
    assert api.response_body(job(), c, id="x", created=1)["choices"][0]["logprobs"] is None


def test_completion_logprobs_in_the_legacy_shape() -> None:
    j = job("completion", logprobs=3, max_tokens=12)
    c = api.answer_of(j)
    lp = api.response_body(j, c, id="x", created=1)["choices"][0]["logprobs"]
    assert lp["tokens"] == list(c.pieces) and len(lp["token_logprobs"]) == len(c.pieces)
    assert lp["text_offset"] == [len("".join(c.pieces[:i])) for i in range(len(c.pieces))]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len(c.text) - len(c.pieces[-1])
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 3 and top[token] == value and max(top.values()) == value


def test_structured_content_has_logprobs_and_tool_calls_none() -> None:
    shaped = job(logprobs=True, response_format={"type": "json_object"})
    c = api.answer_of(shaped)
    entries = api.response_body(shaped, c, id="x", created=1)["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == c.text
    tools = [{"type": "function", "function": {"name": "f"}}]
    calling = job(logprobs=True, tools=tools)
    body = api.response_body(calling, api.answer_of(calling), id="x", created=1)
    assert body["choices"][0]["logprobs"] == {"content": None, "refusal": None}


@pytest.mark.parametrize(
    ("kind", "body", "says"),
    [
        ("chat", {"top_logprobs": 21, "logprobs": True}, "'top_logprobs' must be a whole number from 0 to 20 (alternatives per token), got 21"),
        ("chat", {"top_logprobs": 2}, "'top_logprobs' 2 needs 'logprobs': true"),
        ("chat", {"logprobs": 3}, "'logprobs' must be true or false, got 3"),
        ("completion", {"logprobs": True}, "'logprobs' must be a whole number from 0 to 20 (alternatives per token), got true"),
        ("completion", {"logprobs": 21}, "'logprobs' must be a whole number from 0 to 20"),
    ],
)  # fmt: skip
def test_bad_logprobs_are_refused(kind: api.Kind, body: dict[str, Any], says: str) -> None:
    base = {"model": "m", **({"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"})}
    assert says in refused(kind, {**base, **body}).message


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_whole_body_is_the_response_body_built_in_slices(kind: api.Kind) -> None:
    fields = {"logprobs": True, "top_logprobs": 20} if kind == "chat" else {"logprobs": 20}
    j = job(kind, max_tokens=400, ignore_eos=True, **fields)
    c = api.answer_of(j)
    parts = list(api.whole_body(j, c, id="x", created=1))
    # 400 tokens × 21 values in slices of 1,024 values (48 tokens): a pause after each of the 9
    # slices, then the body.
    assert parts[:-1] == [None] * 9 and isinstance(parts[-1], bytes) and parts[-1].endswith(b"\n")
    assert json.loads(parts[-1]) == api.response_body(j, c, id="x", created=1)
    plain = job(kind)
    assert list(api.whole_body(plain, api.answer_of(plain), id="x", created=1)) == [
        json.dumps(api.response_body(plain, api.answer_of(plain), id="x", created=1), separators=(",", ":")).encode()
        + b"\n"
    ]


def test_whole_body_keeps_a_clients_text_that_looks_like_the_logprobs_key() -> None:
    # The body's logprobs go where choices[0]'s "logprobs":null is; a string holding that text
    # (here the answer's content, a const of the client's schema) cannot be taken for it.
    j = job(logprobs=True, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": '"logprobs":null'}}})  # fmt: skip
    c = api.answer_of(j)
    (*_, data) = api.whole_body(j, c, id="x", created=1)
    assert json.loads(data) == api.response_body(j, c, id="x", created=1)
    assert json.loads(json.loads(data)["choices"][0]["message"]["content"]) == '"logprobs":null'


def test_streamed_tokens_carry_their_logprobs() -> None:
    for kind, fields in (("chat", {"logprobs": True, "top_logprobs": 2}), ("completion", {"logprobs": 2})):
        j = job(kind, stream=True, max_tokens=6, **fields)
        c = api.answer_of(j)
        whole = api.response_body(j, c, id="x", created=1)["choices"][0]["logprobs"]
        chunks = [ch for ch in parse_sse([e for t, e in api.stream_events(j, c, id="x", created=1) if t])]
        got = [ch["choices"][0]["logprobs"] for ch in chunks]
        if kind == "chat":
            assert [g["content"][0] for g in got] == whole["content"]
        else:
            assert [g["tokens"][0] for g in got] == whole["tokens"]
            assert [g["text_offset"][0] for g in got] == whole["text_offset"]
            assert [g["top_logprobs"][0] for g in got] == whole["top_logprobs"]


# -- tool calls -----------------------------------------------------------------------------------


def test_whole_tool_call_answer_shape() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]  # fmt: skip
    j = job(tools=tools)
    c = api.answer_of(j)
    [call] = c.tool_calls
    body = api.response_body(j, c, id="chatcmpl-1", created=1)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": "add", "arguments": call.arguments_text}}
                ],  # fmt: skip
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ]
    assert body["usage"]["completion_tokens"] == len(call.arguments) == 3  # '{"a": ', the number, '}'


def test_streamed_tool_calls_in_openais_delta_shape() -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("one", "two")]
    j = job(tools=tools, stream=True, messages=[{"role": "user", "content": "one two"}])
    c = api.answer_of(j)
    events = list(api.stream_events(j, c, id="chatcmpl-1", created=5))
    chunks = parse_sse([e for _, e in events])
    deltas = [ch["choices"][0]["delta"] if ch != "[DONE]" and ch["choices"] else ch for ch in chunks]
    first, second = c.tool_calls
    assert deltas[0] == {"role": "assistant", "content": None, "tool_calls": [{"index": 0, "id": first.id, "type": "function", "function": {"name": "one", "arguments": ""}}]}  # fmt: skip
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert deltas[2] == {"tool_calls": [{"index": 1, "id": second.id, "type": "function", "function": {"name": "two", "arguments": ""}}]}  # fmt: skip
    assert deltas[3] == {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}
    assert deltas[4] == {} and chunks[4]["choices"][0]["finish_reason"] == "tool_calls" and deltas[5] == "[DONE]"
    assert [is_token for is_token, _ in events] == [False, True, False, True, False, False]


# -- continuing an answer (request migration) ------------------------------------------------------

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about rivers"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}  # vLLM's and SGLang's way


def continued(received: Any, conversation: list[dict[str, Any]] = CONVERSATION, **body: Any) -> api.Job:
    return job(messages=[*conversation, {"role": "assistant", "content": received}], **body)


def streamed_text(j: api.Job, c: Completion) -> str:
    chunks = parse_sse([e for is_token, e in api.stream_events(j, c, id="x", created=1) if is_token])
    return "".join(ch["choices"][0]["delta"]["content"] if j.kind == "chat" else ch["choices"][0]["text"] for ch in chunks)  # fmt: skip


@pytest.mark.parametrize("flags", [{}, CONTINUE], ids=["llama.cpp", "vllm"])
def test_a_final_assistant_message_is_continued_word_for_word(flags: dict[str, Any]) -> None:
    before = job(messages=CONVERSATION, max_tokens=1000)
    whole = api.answer_of(before)
    n = len(whole.pieces)
    for k in (1, 2, n // 2, n - 1, n):  # the first word, mid-answer, the last word, the natural end
        received = "".join(whole.pieces[:k])
        for content in (received, [{"type": "text", "text": received}]):
            j = continued(content, max_tokens=1000, stream=True, **flags)
            rest = api.answer_of(j)
            assert received + rest.text == whole.text and received + streamed_text(j, rest) == whole.text
            assert (j.prompt_key, j.start, rest.finish_reason) == (before.prompt_key, k, "stop")
            # Every message is prompt; only the new words are the completion's.
            assert api.usage(j, rest) == {"prompt_tokens": 6 + k, "completion_tokens": n - k, "total_tokens": 6 + n}
    assert api.answer_of(continued(whole.text, **flags)).pieces == ()  # already at its end


def test_max_tokens_counts_the_new_words_and_ignore_eos_goes_past_the_end() -> None:
    whole = api.answer_of(job(messages=CONVERSATION, max_tokens=1000))
    received = "".join(whole.pieces[:3])
    rest = api.answer_of(continued(received, max_tokens=4))
    assert rest.pieces == whole.pieces[3:7] and rest.finish_reason == "length"
    n = len(whole.pieces)
    long = api.answer_of(job(messages=CONVERSATION, max_tokens=n + 10, ignore_eos=True))
    received = "".join(long.pieces[: n + 2])
    rest = api.answer_of(continued(received, max_tokens=8, ignore_eos=True))
    assert received + rest.text == long.text and rest.finish_reason == "length"


def test_a_continued_answers_logprobs_are_the_uninterrupted_ones() -> None:
    before = job(messages=CONVERSATION, max_tokens=1000, logprobs=True, top_logprobs=2)
    entries = api.response_body(before, api.answer_of(before), id="x", created=1)["choices"][0]["logprobs"]["content"]
    j = continued("".join(e["token"] for e in entries[:4]), max_tokens=1000, logprobs=True, top_logprobs=2)
    assert api.response_body(j, api.answer_of(j), id="x", created=1)["choices"][0]["logprobs"]["content"] == entries[4:]


def test_a_client_prefill_that_is_not_the_answer_is_continued_all_the_same() -> None:
    j = continued("Sure, here is", max_tokens=5)
    assert j.start == 3 and j.prompt_tokens == 9 and j.prompt_key == job(messages=CONVERSATION).prompt_key
    rest = api.answer_of(j)
    assert rest == complete("m", j.prompt_key, 5, start=3) and rest.pieces[0].startswith(" ")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"continue_final_message": True}, "Cannot set both `continue_final_message` and `add_generation_prompt` to True"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "send \"add_generation_prompt\": false"),
        ({"continue_final_message": "yes"}, "'continue_final_message' must be true or false"),
    ],
)  # fmt: skip
def test_continue_final_message_with_a_generation_prompt_is_refused(body: dict[str, Any], says: str) -> None:
    messages = [*CONVERSATION, {"role": "assistant", "content": "the"}]
    err = refused("chat", {"model": "m", "messages": messages, **body})
    assert err.status == 400 and says in err.message


def test_only_a_text_answer_is_continued() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    asked = [{"role": "user", "content": "get_weather in Oslo"}]
    # A last assistant message with tool calls is the prompt, as before: a new answer.
    calling = job(messages=[*asked, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert calling.start == 0 and calling.prompt_key != job(messages=asked).prompt_key
    # The text answer to a tool's result is continued, with the tools still given.
    result = [*asked, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    whole = api.answer_of(job(messages=result, tools=tools, max_tokens=1000))
    assert not whole.tool_calls
    received = "".join(whole.pieces[:5])
    rest = api.answer_of(continued(received, result, tools=tools, max_tokens=1000))
    assert received + rest.text == whole.text
    # Where the uninterrupted answer is tool calls or JSON, the answer is that, whole.
    assert api.answer_of(continued("the", asked, tools=tools)) == api.answer_of(job(messages=asked, tools=tools))
    shaped = {"response_format": {"type": "json_object"}}
    assert api.answer_of(continued('{"answer": "', **shaped)) == api.answer_of(job(messages=CONVERSATION, **shaped))


@pytest.mark.parametrize("prompt", ["Tell me a story", "Say: ", ""])
def test_a_completions_prompt_ending_with_its_answers_start_is_continued(prompt: str) -> None:
    before = job("completion", prompt=prompt, max_tokens=1000, logprobs=1)
    whole = api.answer_of(before)
    n = len(whole.pieces)
    logprobs = api.response_body(before, whole, id="x", created=1)["choices"][0]["logprobs"]
    for k in (1, n // 2, n - 1, n):
        received = "".join(whole.pieces[:k])
        j = job("completion", prompt=prompt + received, max_tokens=1000, stream=True, logprobs=1)
        rest = api.answer_of(j)
        assert received + rest.text == whole.text and received + streamed_text(j, rest) == whole.text
        assert (j.prompt_key, j.start, rest.finish_reason) == (api.prompt_digest(prompt), k, "stop")
        # The earlier prompt and the words sent, though P and the first word touch ("story" "the").
        assert api.usage(j, rest)["prompt_tokens"] == len(prompt.split()) + k
        assert api.usage(j, rest)["completion_tokens"] == n - k
        got = api.response_body(j, rest, id="x", created=1)["choices"][0]["logprobs"]
        assert got["token_logprobs"] == logprobs["token_logprobs"][k:]
    received = "".join(whole.pieces[:3])
    rest = api.answer_of(job("completion", prompt=prompt + received, max_tokens=2))
    assert rest.pieces == whole.pieces[3:5] and rest.finish_reason == "length"
    # An array of prompts is taken whole.
    listed = job("completion", prompt=[prompt + received])
    assert listed.start == 0 and listed.prompt_key == api.prompt_digest(prompt + received)
