"""A stream whose replica fails mid-answer continues on another (llmgw.gateway.migrate, job.stream):
scripted engines in memory (testlib.memnet, on MockClock) that answer a fixed text word by word as
SSE, the first of which dies after some words. The client must get one stream: every word once,
in order, the first answer's `id` and `created`, usage counting the words before the failure as
completion tokens, a comment saying it moved; and the continuation must be asked in the engine's
way (the sim: a final assistant message; llama.cpp, vLLM and SGLang: with continue_final_message,
which llama-server needs not to stream the message back first; completions: the prompt plus the
text so far), with the token limit less what was sent. Answers
that cannot be continued exactly end with an error event; with max_migrations = 0 the stream is
cut as before; a stream silent past stream_stall_s counts as failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.gateway.migrate import (
    CHAT,
    COMPLETIONS,
    MAX_KEPT_BYTES,
    Events,
    KeptBudget,
    Rewrite,
    Sent,
    continuation_payload,
)
from llmgw.wire.gateway_link import ModelInfo
from testlib import memnet
from testlib.migrationrig import WORDS, Scripted, parse, setup, sse, text_of, via_a_then_b

pytestmark = pytest.mark.trio


async def test_a_chat_stream_whose_replica_dies_continues_on_another_word_for_word(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net, a, b, gw, info = await setup(tmp_path, nursery, "llamacpp")
    b.echo_prefill = True  # as llama-server does unless asked with continue_final_message
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 100}
    request["stream_options"] = {"include_usage": True}
    status, headers, body = await via_a_then_b(gw, a, b, info, CHAT, request)
    assert headers["x-llmgw-replica"] == "m-0" and status == 200  # the headers went out from a
    events, comments, done = parse(body)
    assert text_of(events) == "".join(WORDS)  # every word once, in order
    assert done and comments == [": llmgw migrated 1"]
    assert {e["id"] for e in events} == {"id-m-0"} and {e["created"] for e in events} == {100}
    assert sum(1 for e in events if (e["choices"] and e["choices"][0]["delta"].get("role"))) == 1
    [usage] = [e["usage"] for e in events if e.get("usage")]
    assert usage == {"prompt_tokens": 5, "completion_tokens": len(WORDS), "total_tokens": 5 + len(WORDS)}
    # A final assistant message holding the four words sent, the limit less four; llama-server
    # told it is a continuation (else it streams the four words back first: they came twice).
    cont = b.bodies[-1]
    assert cont["messages"][-1] == {"role": "assistant", "content": "".join(WORDS[:4])}
    assert cont["max_tokens"] == 96
    assert (cont["continue_final_message"], cont["add_generation_prompt"]) == (True, False)
    metrics = gw.gateway.render_metrics()
    assert 'llmgw_gateway_migrations_total{model="m",outcome="continued"} 1' in metrics


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_vllm_and_sglang_are_asked_with_continue_final_message(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, engine: str
) -> None:
    net, a, b, gw, info = await setup(tmp_path, nursery, engine)
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, _, body = await via_a_then_b(gw, a, b, info, CHAT, request)
    assert status == 200 and text_of(parse(body)[0]) == "".join(WORDS)
    cont = b.bodies[-1]
    assert cont["messages"][-1] == {"role": "assistant", "content": "".join(WORDS[:4])}
    assert (cont["continue_final_message"], cont["add_generation_prompt"]) == (True, False)
    assert "max_tokens" not in cont  # none was asked


async def test_an_answer_that_cannot_be_continued_exactly_ends_with_an_error_event(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net, a, b, gw, info = await setup(tmp_path, nursery, "sim")
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
    status, _, body = await via_a_then_b(gw, a, b, info, CHAT, request)
    events, _, done = parse(body)
    assert status == 200 and not done and b.bodies == []
    assert text_of(events[:-1]) == "".join(WORDS[:4])
    error = events[-1]["error"]
    assert error["code"] == "replica_failed" and "cannot be continued exactly" in error["message"]
    assert "n > 1" in error["message"]
    assert 'outcome="not_exact"} 1' in gw.gateway.render_metrics()


async def test_without_migrations_the_stream_is_cut_as_before(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net, a, b, gw, info = await setup(tmp_path, nursery, "sim", max_migrations=0)
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with pytest.raises(Exception):  # noqa: B017 - the client sees the body end without its last chunk
        await via_a_then_b(gw, a, b, info, CHAT, request)
    assert b.bodies == []


async def test_a_stream_silent_past_stream_stall_s_is_continued(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    a = Scripted(net, "m-0", "10.0.0.1", stall_after=3)
    b = Scripted(net, "m-1", "10.0.0.2")
    info = ModelInfo(name="m", engine="sim", routes=(CHAT, COMPLETIONS))
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),), details=(info,), stream_stall_s=2.0)
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    started = trio.current_time()
    status, _, body = await via_a_then_b(gw, a, b, info, CHAT, request)
    assert status == 200 and text_of(parse(body)[0]) == "".join(WORDS)
    assert b.bodies[-1]["messages"][-1]["content"] == "".join(WORDS[:3])
    assert 2.0 <= trio.current_time() - started < 5.0  # the stall limit, not read_timeout_s (600 s)


async def test_completions_continue_with_the_prompt_plus_the_text_so_far(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net, a, b, gw, info = await setup(tmp_path, nursery, "vllm")
    request = {"model": "m", "prompt": "Q:", "stream": True, "max_tokens": 8}
    status, _, body = await via_a_then_b(gw, a, b, info, COMPLETIONS, request)
    events, comments, done = parse(body)
    assert status == 200 and done and comments == [": llmgw migrated 1"]
    assert text_of(events, chat=False) == "".join(WORDS[:8])
    assert b.bodies[-1]["prompt"] == "Q:" + "".join(WORDS[:4]) and b.bodies[-1]["max_tokens"] == 4


async def test_a_continuation_the_engine_refuses_ends_with_its_error_and_the_replica_stays(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # llama-server's answer when the prompt and the answer so far pass its context: the replica is
    # well (another would say the same), so the stream ends with that error, and b stays in rotation.
    net = memnet.MemoryNet(nursery)
    a = Scripted(net, "m-0", "10.0.0.1", die_after=4)
    too_long = {
        "error": {
            "code": 400,
            "message": "the request exceeds the available context size",
            "type": "exceed_context_size_error",
        }
    }
    b = Scripted(net, "m-1", "10.0.0.2", refuse=(400, too_long))
    info = ModelInfo(name="m", engine="llamacpp", routes=(CHAT, COMPLETIONS))
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),), details=(info,))
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, _, body = await via_a_then_b(gw, a, b, info, CHAT, request)
    events, _, done = parse(body)
    assert status == 200 and not done and text_of(events[:-1]) == "".join(WORDS[:4])
    error = events[-1]["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert (
        "m-1 refused to continue it (400)" in error["message"] and "exceeds the available context" in error["message"]
    )
    assert len(b.bodies) == 1  # asked once, not again
    router = gw.gateway.router
    assert [ep.replica_id for ep in router.in_rotation("m")] == ["m-1"]
    assert "m-1" not in router.down and router.outstanding.get("m-1", 0) == 0  # the stream let go of it
    metrics = gw.gateway.render_metrics()
    assert 'llmgw_gateway_migrations_total{model="m",outcome="refused"} 1' in metrics


async def test_a_continuation_answered_503_leaves_rotation_counted_as_503(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    a = Scripted(net, "m-0", "10.0.0.1", die_after=4)
    busy = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    b = Scripted(net, "m-1", "10.0.0.2", refuse=(503, busy))
    info = ModelInfo(name="m", engine="llamacpp", routes=(CHAT, COMPLETIONS))
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),), details=(info,), queue_timeout_s=1.0)
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, _, body = await via_a_then_b(gw, a, b, info, CHAT, request)
    events, _, done = parse(body)
    assert status == 200 and not done
    error = events[-1]["error"]
    assert error["code"] == "replica_failed" and "no other could continue it: m-1 answered 503" in error["message"]
    metrics = gw.gateway.render_metrics()
    assert 'llmgw_gateway_replica_down_total{model="m",reason="503"} 1' in metrics
    assert 'outcome="failed"} 1' in metrics


async def test_events_are_cut_at_blank_lines_and_kept() -> None:
    ev = Events()
    assert ev.feed(b"data: 1\n") == b""
    assert ev.feed(b"\ndata: 2\n\ndata: 3") == b"data: 1\n\ndata: 2\n\n"
    assert ev.feed(b"\n\n") == b"data: 3\n\n"
    assert ev.kept == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"


async def test_what_was_sent_and_what_cannot_be_continued() -> None:
    tool = sse({"id": "x", "created": 1, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert Sent.of(CHAT, tool).not_exact == "a tool call was under way"
    two = sse({"id": "x", "created": 1, "choices": [{"index": 1, "delta": {"content": "a"}}]})
    assert Sent.of(CHAT, two).not_exact.startswith("the answer has several choices")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    assert continuation_payload({**body, "n": 2}, CHAT, "sim", "a", 1)[0] == "not_exact"
    assert (
        continuation_payload({**body, "response_format": {"type": "json_object"}}, CHAT, "sim", "a", 1)[0]
        == "not_exact"
    )
    assert continuation_payload({**body, "response_format": {"type": "text"}}, CHAT, "sim", "a", 1)[0] == ""
    assert continuation_payload(body, CHAT, "sim", "a b", 10) == ("finished", "", b"")
    assert continuation_payload({"model": "m", "prompt": ["a", "b"]}, COMPLETIONS, "sim", "", 0)[0] == "not_exact"
    assert (
        continuation_payload({"model": "m", "prompt": "a", "suffix": "z"}, COMPLETIONS, "sim", "", 0)[0] == "not_exact"
    )
    outcome, _, payload = continuation_payload({**body, "seed": 7, "logprobs": True}, CHAT, "vllm", "a b", 2)
    made = json.loads(payload)
    assert outcome == "" and made["continue_final_message"] is True and made["add_generation_prompt"] is False
    assert made["seed"] == 7 and made["max_tokens"] == 8


async def test_a_rewrite_keeps_the_first_answers_identity_and_counts_usage() -> None:
    sent = Sent(id="first", created=5, text="a b", tokens=2)
    r = Rewrite(CHAT, sent, 1)
    out = r.events(
        sse({"id": "x", "created": 9, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        + sse({"id": "x", "created": 9, "choices": [{"index": 0, "delta": {"content": " c"}}]})
        + sse({"id": "x", "created": 9, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}})
        + b"data: [DONE]\n\n"
    )
    events, comments, done = parse(out)
    assert [e["choices"] for e in events[:1]] == [[{"index": 0, "delta": {"content": " c"}}]]
    assert all(e["id"] == "first" and e["created"] == 5 for e in events)
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert done and comments == [": llmgw migrated 1"]


async def test_the_kept_events_are_bounded_per_stream_and_per_process() -> None:
    budget = KeptBudget(limit=100)
    one, two = Events(budget), Events(budget)
    assert one.feed(b"data: " + b"x" * 50 + b"\n\n") and budget.used == 58
    two.feed(b"data: " + b"y" * 50 + b"\n\n")  # past the process's budget: not kept
    assert two.overflow and two.kept == b"" and budget.used == 58
    one.release()
    assert budget.used == 0
    big = Events(KeptBudget())
    big.feed(b"data: " + b"z" * (MAX_KEPT_BYTES + 1) + b"\n\n")
    assert big.overflow and big.kept == b""


@pytest.mark.parametrize("asked", [False, True])
async def test_a_migrated_streams_usage_counts_the_whole_answer_whether_or_not_the_client_asked(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, asked: bool
) -> None:
    # The gateway asks each engine for its usage; the continuation's, rewritten, counts the words
    # before the failure as completion: that goes to the ledger, and to the client only if asked.
    net, a, b, gw, info = await setup(tmp_path, nursery, "vllm")
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if asked:
        request["stream_options"] = {"include_usage": True}
    status, _, body = await via_a_then_b(gw, a, b, info, CHAT, request)
    events, _, done = parse(body)
    assert status == 200 and done and text_of(events) == "".join(WORDS)
    assert b.bodies[-1]["stream_options"] == {"include_usage": True}
    usages = [e["usage"] for e in events if e.get("usage")]
    assert usages == (
        [{"prompt_tokens": 5, "completion_tokens": len(WORDS), "total_tokens": 5 + len(WORDS)}] if asked else []
    )
    [(row, counts)] = gw.gateway.usage.pending.items()
    assert row[1:] == ("tests", "", "m") and counts == [1, 5, 0, len(WORDS)]
