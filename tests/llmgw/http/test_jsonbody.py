"""JSON bodies: linear parsing with a depth limit, and the worker process for large bodies."""

from __future__ import annotations

import json

import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmgw.gateway.fields import PrefixModels, RequestFields, request_fields
from llmgw.gateway.prefix import MAX_BLOCKS, Prompt
from llmgw.http import jsonbody
from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import InvalidJson, JsonWorkers, WorkerOptions
from llmgw.simengine import api
from testlib import bodies


def test_valid_json_is_parsed() -> None:
    assert jsonbody.loads(b'{"a": [1, 2, {"b": null}]}') == {"a": [1, 2, {"b": None}]}
    assert jsonbody.loads(b"") is None  # an empty body reads as null


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "is not valid JSON"),
        (b'{"a": "\xff"}', "is not valid UTF-8"),
        (b"[" + b"1" * 5000 + b"]", "is not valid JSON"),  # past int()'s digit limit
        (b"[" * 65 + b"]" * 65, "deeper than 64 levels"),
        (b'{"a":' * 65 + b"1" + b"}" * 65, "deeper than 64 levels"),
        (b"[" * 100_000, "deeper than 64 levels"),  # the parser's own recursion limit
    ],
)
def test_bad_json_is_refused_naming_why(body: bytes, says: str) -> None:
    with pytest.raises(InvalidJson, match=says):
        jsonbody.loads(body)


def test_depth_counts_containers_not_brackets_in_strings() -> None:
    assert jsonbody.loads(b"[" * 64 + b"]" * 64) is not None
    assert jsonbody.loads(b'["' + b"[" * 1000 + b'"]') == ["[" * 1000]
    assert jsonbody.loads(b'["\\"' + b"[" * 1000 + b'"]') == ['"' + "[" * 1000]  # an escaped quote stays inside
    assert jsonbody.loads(b"[" + b"[]," * 10_000 + b"[]]")  # many, but shallow
    assert not jsonbody.depth_exceeds({"a": [[1]], "b": {}}, 3)
    assert jsonbody.depth_exceeds({"a": [[[]]]}, 3)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=2), children, max_size=4)


def _deeper_than(value: object, limit: int, depth: int = 1) -> bool:
    """`depth_exceeds` as its definition says it, recursively: what the fast one must agree with."""
    if not isinstance(value, (dict, list)):
        return False
    if depth > limit:
        return True
    children = value.values() if isinstance(value, dict) else value
    return any(_deeper_than(child, limit, depth + 1) for child in children)


@settings(max_examples=300, deadline=None)
@given(value=st.recursive(st.none() | st.integers() | st.text(max_size=3), _containers, max_leaves=60))
def test_the_depth_is_that_of_the_deepest_container(value: object) -> None:
    for limit in (1, 2, 3, 5):
        assert jsonbody.depth_exceeds(value, limit) == _deeper_than(value, limit)


@pytest.mark.parametrize(
    "body",
    [
        '{"a": ["\u00e9", 1]}'.encode("utf-16"),  # with a BOM
        '{"a": ["\u00e9", 1]}'.encode("utf-16-le"),
        '{"a": ["\u00e9", 1]}'.encode("utf-32"),
        '{"a": ["é", 1]}'.encode("utf-8-sig"),
        '{"a": ["é", 1]}'.encode(),
        b'{"a": ["\xed\xa0\x80", 1]}',  # a lone surrogate in UTF-8: json.loads lets it through
        b'  {"a": 1}',
        b"[1]",
    ],
)
def test_bodies_decode_as_json_loads_decodes_them(body: bytes) -> None:
    assert jsonbody.loads(body) == json.loads(body)


# The pathological bodies of the no-stall issue: each is linear for the C decoder. The old
# pre-scan took seconds on the first (a regex that restarted at each quote).
ADVERSARIAL = {
    "escaped-quotes-unterminated": b'{"model":"m","x":"' + b'\\"' * 30_000 + b"[" * 65,
    "brackets-in-strings": b'{"model":"m","x":"' + b"[{" * 30_000 + b'"}',
    "empty-arrays": b"[" + b"[]," * 20_000 + b"[]]",
    "many-keys": b"{" + b",".join(b'"k%d":0' % i for i in range(5000)) + b"}",
    "unicode-escapes": b'{"x":"' + b"\\ud83d\\ude00" * 5000 + b'"}',
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_bodies_are_parsed_or_refused(name: str) -> None:
    # How long they take is measured by tools/bench/bodies.py, not here.
    body = ADVERSARIAL[name]
    try:
        value = jsonbody.loads(body)
    except InvalidJson as exc:
        assert name in ("escaped-quotes-unterminated",) and "not valid JSON" in exc.message
    else:
        assert isinstance(value, (dict, list))


def test_only_small_bodies_of_few_values_are_parsed_on_the_loop() -> None:
    assert jsonbody.inline(b'{"model": "m", "messages": [' + b'{"role": "user", "content": "hi"},' * 100 + b"{}]}")
    assert not jsonbody.inline(b"[" + b"[]," * 5000 + b"[]]")  # small, but 10,000 values
    assert not jsonbody.inline(b'"' + b"x" * (jsonbody.INLINE_MAX_BYTES + 1) + b'"')  # one value, but large


def test_the_gateway_reads_model_stream_and_for_a_model_routed_by_prefix_its_prompt() -> None:
    messages = [{"role": "user", "content": "x" * 3000}, {"role": "user", "content": "y" * 3000}, {"role": "z"}]
    body = {"model": "m", "stream": True, "messages": messages}
    fields = request_fields(body, PrefixModels(models=frozenset({"m"})))
    assert fields.model == "m" and fields.stream
    assert fields.prompt == Prompt.of(body, "m") and fields.prompt is not None
    assert request_fields(body, PrefixModels(models=frozenset({"other"}))).prompt is None
    assert request_fields({"model": "m", "prompt": "p"}) == RequestFields(model="m", stream=False, prompt=None)
    with pytest.raises(InvalidJson, match="'model' must be a non-empty string .* got an array of 100000 items"):
        request_fields({"model": [0] * 100_000})
    with pytest.raises(InvalidJson, match="'stream' must be true or false"):
        request_fields({"model": "m", "stream": "yes"})


_text = st.text(st.characters(codec="utf-8"), max_size=40)  # escapes, non-ASCII, surrogates' kin
_message_values = st.recursive(
    st.none() | st.integers() | _text,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_text, inner, max_size=6),
    max_leaves=30,
)
_messages = st.lists(st.dictionaries(_text, _message_values, max_size=5) | _message_values, max_size=6)


@settings(max_examples=200, deadline=None)
@given(messages=_messages, more=_messages, block=st.integers(1, 80))
@example(messages=[{"role": "user", "content": "a", "x": 1}], more=[{"role": "user", "content": "a"}], block=4)
def test_a_conversation_continued_keeps_every_chain_of_its_start(messages: list, more: list, block: int) -> None:
    # Whatever the messages hold: once the first user message is in, the next turns' prompt has
    # every chain of this one's, so the replica that served it is found again.
    messages = [*messages, {"role": "user", "content": "the first question"}]
    prefix = PrefixModels(models=frozenset({"m"}), block_chars=block, max_blocks=10_000)
    start = request_fields({"model": "m", "messages": messages}, prefix).prompt
    later = request_fields({"model": "m", "messages": [*messages, *more]}, prefix).prompt
    assert start is not None and later is not None
    assert later.chains[: len(start.chains)] == start.chains
    assert later.anchor == start.anchor


@pytest.mark.trio
async def test_small_bodies_are_parsed_inline_and_large_ones_in_the_worker() -> None:
    workers = JsonWorkers()
    try:
        small = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        assert (await workers.parse(small, request_fields)).model == "m"
        assert workers.parsed_in_worker == 0
        large = json.dumps({"model": "big", "stream": True, "pad": "x" * (2 << 20)}).encode()
        fields = await workers.parse(large, request_fields)
        assert fields == RequestFields(model="big", stream=True, prompt=None)
        # A prompt's chains computed in the worker are those the loop computes (no salted hash).
        chat = {"model": "big", "messages": [{"role": "user", "content": "q" * (2 << 20)}]}
        prefix = PrefixModels(models=frozenset({"big"}))
        fields = await workers.parse(json.dumps(chat).encode(), request_fields, prefix)
        assert fields.prompt == Prompt.of(chat, "big") and len(fields.prompt.chains) == MAX_BLOCKS
        assert workers.parsed_in_worker == 2
        # The worker stays for the next one, and refusals come back as they were raised.
        with pytest.raises(InvalidJson, match="'stream' must be true or false"):
            await workers.parse(large.replace(b'"stream": true', b'"stream": 1'), request_fields)
        with pytest.raises(InvalidJson, match="is not valid JSON"):
            await workers.parse(large[:-1], request_fields)
        with pytest.raises(InvalidJson, match="deeper than 64"):
            await workers.parse(
                b'{"a":' + b"[" * 100 + b"]" * 100 + b', "pad": "' + b"x" * 70_000 + b'"}', jsonbody.whole
            )
        # The sim engine's projection raises the HTTP layer's error: it crosses intact.
        big_chat = {"model": "other", "messages": [{"role": "user", "content": "w " * 50_000}]}
        with pytest.raises(HTTPError) as refused:
            await workers.parse(json.dumps(big_chat).encode(), api.job_of, "chat", "m", 16)
        assert refused.value.status == 404 and "does not exist" in refused.value.message
        job = await workers.parse(json.dumps({**big_chat, "model": "m"}).encode(), api.job_of, "chat", "m", 16)
        assert job.prompt_tokens == 50_000 and len(job.prompt_key) == 32
    finally:
        await workers.aclose()


@pytest.mark.trio
async def test_a_body_too_slow_to_parse_is_refused_and_its_worker_replaced() -> None:
    workers = JsonWorkers(options=WorkerOptions(parse_timeout_s=0.001))
    try:
        slow = b"[" + b"[]," * (3 << 20) + b"[]]"  # about half a second for the decoder
        with pytest.raises(InvalidJson, match="took longer than 0.001 s to parse"):
            await workers.parse(slow, jsonbody.whole)
        workers.options = WorkerOptions()
        assert await workers.parse(b'{"pad": "' + b"x" * 70_000 + b'"}', jsonbody.whole) == {"pad": "x" * 70_000}
    finally:
        await workers.aclose()


@pytest.mark.trio
async def test_past_the_waiting_limit_large_bodies_are_busy_at_once() -> None:
    workers = JsonWorkers(options=WorkerOptions(max_waiting=0))
    try:
        with pytest.raises(jsonbody.ParserBusy, match="waiting to be parsed"):
            await workers.parse(b'{"pad": "' + b"x" * 70_000 + b'"}', jsonbody.whole)
        assert await workers.parse(b'{"small": 1}', jsonbody.whole) == {"small": 1}  # inline: never waits
    finally:
        await workers.aclose()


def test_a_projection_must_be_importable_by_the_worker() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        jsonbody._reference(lambda value: value)
    assert jsonbody._resolve(jsonbody._reference(request_fields)) is request_fields


@pytest.mark.trio
async def test_a_worker_that_dies_is_reported_busy_and_started_again() -> None:
    workers = JsonWorkers()
    try:
        pad = b'{"pad": "' + b"x" * 70_000 + b'"}'
        assert await workers.parse(pad, jsonbody.whole)
        process = workers._workers[0].process
        assert process is not None
        process.kill()
        await process.wait()
        # The dead one is noticed before the next body is sent, and replaced.
        assert await workers.parse(pad, jsonbody.whole) == {"pad": "x" * 70_000}
    finally:
        await workers.aclose()


def test_closing_unused_workers_starts_nothing() -> None:
    async def main() -> None:
        workers = JsonWorkers()
        await workers.parse(b"{}", jsonbody.whole)
        assert all(w.process is None for w in workers._workers)
        await workers.aclose()

    trio.run(main)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies.strategy("m", 64 << 10))
def test_any_body_is_parsed_or_refused_with_a_message(body: bytes) -> None:
    # Whatever the bytes: a value, or InvalidJson naming the problem; never another exception.
    try:
        fields = request_fields(jsonbody.loads(body), PrefixModels(models=frozenset({"m"})))
    except InvalidJson as exc:
        assert exc.message and len(exc.message) < 400
    else:
        assert fields.model == "m"
