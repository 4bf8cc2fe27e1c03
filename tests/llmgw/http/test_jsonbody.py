"""JSON bodies: one rule for every body (RFC 8259, strictly) in our words, linear parsing with a depth
limit, the worker process for large bodies giving the loop's answers, and 415 for a compressed body."""

from __future__ import annotations

import io
import json
import math
import pickle
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmgw.gateway.fields import PrefixModels, RequestFields, request_fields
from llmgw.gateway.prefix import MAX_BLOCKS, Prompt
from llmgw.http import jsonbody, jsonworkers
from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import InvalidJson
from llmgw.http.jsonworkers import JsonWorkers, WorkerOptions
from llmgw.http.messages import BodySource, Request
from llmgw.simengine import api
from testlib import bodies


def test_valid_json_is_parsed() -> None:
    assert jsonbody.loads(b'{"a": [1, 2, {"b": null}]}') == {"a": [1, 2, {"b": None}]}
    assert jsonbody.loads(b"") is None  # an empty body reads as null


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "is not valid JSON"),
        (b'{"a": "\xff"}', "is not valid UTF-8 at byte 7 .ff 22 7d: not a UTF-8 sequence."),
        (b"[" + b"1" * 5000 + b"]", "has a number of more than 4300 digits"),  # past int()'s digit limit
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
        '{"a": ["é", 1]}'.encode("utf-8-sig"),  # a byte order mark is ignored (RFC 8259 §8.1)
        '{"a": ["é", 1]}'.encode(),
        b'{"a": ["\\u00e9\\ud83d\\ude00", 1.5e300, -0.0, 1e-999999]}',  # a pair is one character; underflow is 0
        b'["\\\\ud800"]',  # a backslash, then the letters ud800: no escape
        b'  {"a": 1}',
        b"[1]",
        b"[" + b"1" * 4300 + b"]",  # as many digits as int() takes
    ],
)
def test_utf8_json_is_read_as_json_loads_reads_it(body: bytes) -> None:
    assert jsonbody.loads(body) == json.loads(body)


# One rule for every body (the docstring of `jsonbody.loads`): each of these is refused, in our
# words, on the loop and in the worker alike. Each was accepted, or refused in Python's words,
# before the rule was written down.
REFUSED = {
    "nan": (b'{"t": NaN}', "request body has NaN, which is not JSON (RFC 8259 has no NaN or Infinity)"),
    "infinity": (b'{"t": Infinity}', "request body has Infinity, which is not JSON"),
    "minus-infinity": (b'{"t": [-Infinity]}', "request body has -Infinity, which is not JSON"),
    "overflow": (b'{"t": 1e999999}', "has the number 1e999999, past the largest a double holds"),
    "negative-overflow": (b'{"t": -2e308}', "has the number -2e308, past the largest a double holds"),
    "overflow-without-exponent": (b'{"t": 1' + b"0" * 400 + b".5}", "(403 characters), past the largest a double"),
    "too-many-digits": (b'{"t": ' + b"9" * 4301 + b"}", "request body has a number of more than 4300 digits; no field"),
    "utf-16-bom": ('{"a": "é"}'.encode("utf-16"), "is not UTF-8 (it looks like UTF-16 or UTF-32); send JSON text in"),
    "utf-16-le": ('{"a": "é"}'.encode("utf-16-le"), "is not UTF-8 (it looks like UTF-16 or UTF-32)"),
    "utf-16-be": ('{"a": "é"}'.encode("utf-16-be"), "is not UTF-8 (it looks like UTF-16 or UTF-32)"),
    "utf-32": ('{"a": "é"}'.encode("utf-32"), "is not UTF-8 (it looks like UTF-16 or UTF-32)"),
    "encoded-surrogate": (
        b'{"a": ["\xed\xa0\x80", 1]}',
        "is not valid UTF-8 at byte 8 (ed a0 80: a surrogate code point, which UTF-8 does not encode)",
    ),
    "encoded-pair": (b'["\xed\xa0\xbd\xed\xb8\x80"]', "at byte 2 (ed a0 bd: a surrogate code point"),  # CESU-8
    "escaped-high-surrogate": (
        b'["a\\ud800b"]',
        "has a string with the lone surrogate \\ud800, which is not a character",
    ),
    "escaped-low-surrogate": (b'{"k": "\\uDC00"}', "the lone surrogate \\udc00"),
    "escaped-surrogate-in-a-key": (b'{"\\udbff": 1}', "the lone surrogate \\udbff"),
    "reversed-pair": (b'["\\ude00\\ud83d"]', "the lone surrogate \\ude00"),
    "after-a-backslash": (b'["\\\\\\ud800"]', "the lone surrogate \\ud800"),  # an escaped backslash, then the escape
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_one_rule_refuses_what_rfc_8259_does_not_allow_in_our_words(name: str) -> None:
    body, says = REFUSED[name]
    with pytest.raises(InvalidJson) as refused:
        jsonbody.loads(body)
    assert says in refused.value.message
    assert refused.value.code == "invalid_json"
    for python in ("sys.", "set_int_max_str_digits", "Exceeds the limit", "(char "):
        assert python not in refused.value.message


@pytest.mark.parametrize("body", [b'{"t": NaN}', b'["\\ud800"]', b"[1e999]", b'"\xed\xb0\x80"'])
def test_what_the_rule_refuses_is_a_400_naming_it(body: bytes) -> None:
    with pytest.raises(HTTPError) as refused:
        jsonbody.parse_json(body)
    assert refused.value.status == 400 and refused.value.code == "invalid_json"


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
        with pytest.raises(jsonworkers.ParserBusy, match="waiting to be parsed"):
            await workers.parse(b'{"pad": "' + b"x" * 70_000 + b'"}', jsonbody.whole)
        assert await workers.parse(b'{"small": 1}', jsonbody.whole) == {"small": 1}  # inline: never waits
    finally:
        await workers.aclose()


def test_a_projection_must_be_importable_by_the_worker() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        jsonworkers._reference(lambda value: value)
    assert jsonworkers._resolve(jsonworkers._reference(request_fields)) is request_fields


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


# -- the worker gives the loop's answers ---------------------------------------------------------


def _verdict(parse: Callable[[], Any]) -> tuple:
    try:
        return ("ok", parse())
    except InvalidJson as exc:
        return ("refused", exc.message, exc.code)


def _in_worker(body: bytes) -> tuple:
    """`body` through `worker_main` in this process, framed as the parent frames it, the answer
    unpickled as the parent unpickles it."""
    header = pickle.dumps((jsonworkers._reference(jsonbody.whole), (), len(body)))
    out = io.BytesIO()
    assert jsonworkers.worker_main(io.BytesIO(jsonworkers._FRAME.pack(len(header)) + header + body), out) == 0
    answer = out.getvalue()
    (size,) = jsonworkers._FRAME.unpack(answer[: jsonworkers._FRAME.size])
    kind, value = pickle.loads(answer[jsonworkers._FRAME.size : jsonworkers._FRAME.size + size])
    if kind == "ok":
        return ("ok", value)
    assert isinstance(value, InvalidJson), value
    return ("refused", value.message, value.code)


_LONE = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
_plain = st.text(max_size=6)  # no surrogates
# At most one surrogate in a string: never a pair, whichever way the string is written.
_strings = _plain | st.tuples(_plain, _LONE, _plain).map("".join)
_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _strings,  # floats: NaN and infinities too
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_strings, inner, max_size=4),
    max_leaves=12,
)
_ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"]


def _allowed(value: Any) -> bool:
    """RFC 8259 as the rule reads it, for a value before it is written."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return not any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, list):
        return all(map(_allowed, value))
    if isinstance(value, dict):
        return all(_allowed(k) and _allowed(v) for k, v in value.items())
    return True


@settings(max_examples=300, deadline=None)
@given(value=_values, ascii=st.booleans(), encoding=st.sampled_from(_ENCODINGS))
@example(value={"t": math.nan}, ascii=True, encoding="utf-8")
@example(value=["a\ud800"], ascii=True, encoding="utf-8")  # escaped
@example(value=["a\ud800"], ascii=False, encoding="utf-8")  # encoded
@example(value={"a": "é"}, ascii=False, encoding="utf-16-le")
def test_a_body_is_taken_as_the_rule_says_and_the_worker_says_the_same(value: Any, ascii: bool, encoding: str) -> None:
    # Python writes NaN and Infinity, escapes or encodes a lone surrogate, and encodes in UTF-16
    # or 32 if asked: the rule takes the body if and only if it is UTF-8 and its value allowed.
    body = json.dumps(value, ensure_ascii=ascii).encode(encoding, "surrogatepass")
    verdict = _verdict(lambda: jsonbody.project(body, jsonbody.whole))
    if encoding.startswith("utf-8") and _allowed(value):
        assert verdict == ("ok", value)
    else:
        assert verdict[0] == "refused" and "sys." not in verdict[1], verdict
    assert _in_worker(body) == verdict


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies.strategy("m", 4096) | st.sampled_from([b for b, _ in REFUSED.values()]) | st.binary(max_size=40))
def test_the_worker_answers_any_body_as_the_loop_does(body: bytes) -> None:
    assert _in_worker(body) == _verdict(lambda: jsonbody.project(body, jsonbody.whole))


@pytest.mark.trio
async def test_a_worker_process_refuses_by_the_same_rule() -> None:
    # Padded past INLINE_MAX_BYTES, so that each goes to the worker process; its answer is what
    # `loads` says of the same bytes on the loop.
    pad = b'["' + b"x" * (jsonbody.INLINE_MAX_BYTES + 1) + b'", '
    sent = [pad + body + b"]" for body, _ in REFUSED.values()]
    sent.append(('["' + "x" * jsonbody.INLINE_MAX_BYTES + '", "é"]').encode("utf-16"))
    sent.append(b"\xef\xbb\xbf" + pad + b'"\\ud83d\\ude00"]')  # a BOM and a pair: taken
    workers = JsonWorkers()
    try:
        for body in sent:
            inline = _verdict(lambda body=body: jsonbody.loads(body))
            try:
                answer = ("ok", await workers.parse(body, jsonbody.whole))
            except InvalidJson as exc:
                answer = ("refused", exc.message, exc.code)
            assert answer == inline
        assert workers.parsed_in_worker == len(sent)
        assert answer[0] == "ok" and answer[1][1] == "\U0001f600"
    finally:
        await workers.aclose()


# -- compressed bodies -----------------------------------------------------------------------------


class _Unread(BodySource):
    async def read(self, *args: Any) -> bytes:
        raise AssertionError("the body was read")


@pytest.mark.trio
@pytest.mark.parametrize(
    ("raw_headers", "named"),
    [
        (((b"content-encoding", b"gzip"),), "gzip"),
        (((b"content-encoding", b"GZIP , identity"),), "GZIP"),
        (((b"content-encoding", b"identity"), (b"content-encoding", b"br")), "br"),
        (((b"content-encoding", b"deflate, x-" + b"z" * 200),), "deflate, x-zzz"),
    ],
)
async def test_a_compressed_body_is_415_from_the_head(raw_headers, named: str) -> None:
    workers = JsonWorkers()
    request = attrs.evolve(Request.of("POST", "/v1/chat/completions", raw_headers=raw_headers), body=_Unread())
    for read in (jsonbody.read_json(request), jsonworkers.parse_body(request, workers, jsonbody.whole)):
        with pytest.raises(HTTPError) as refused:
            await read
        error = refused.value
        assert (error.status, error.code, error.headers) == (
            415,
            "unsupported_content_encoding",
            (("accept-encoding", "identity"),),
        )
        assert error.message.startswith(f"Content-Encoding '{named}")
        assert error.message.endswith("is not supported; send the request body uncompressed")
        assert len(error.message) < 200
    await workers.aclose()


@pytest.mark.trio
async def test_no_coding_or_identity_is_read_as_json() -> None:
    workers = JsonWorkers()
    for headers in ({}, {"content-encoding": "identity"}, {"content-encoding": " Identity "}, {"content-encoding": ""}):
        request = Request.of("POST", "/", body=b'{"a": 1}', headers=headers)
        assert await jsonbody.read_json(request) == {"a": 1}
        assert await jsonworkers.parse_body(request, workers, jsonbody.whole) == {"a": 1}
    await workers.aclose()
