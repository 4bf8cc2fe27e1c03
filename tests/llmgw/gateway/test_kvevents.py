"""vLLM's and SGLang's KV-cache events as the gateway reads them (`llmgw.gateway.kvevents`):
batches encoded by msgspec as vLLM lays them out decode to what the router needs; a hostile or
broken payload is refused quickly with `EventsError`, never anything else; the ZMTP
subscriber's side over memory streams against a scripted publisher, and against peers that are
not publishers, lie about sizes or close mid-frame."""

from __future__ import annotations

import re
import struct

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.gateway import kvevents as kv
from testlib import kvpublisher as vp
from testlib import record_kvevents as rec
from testlib.zmtp import scripted_publisher

# -- the payload ------------------------------------------------------------------------------


def test_a_batch_as_vllm_encodes_it_gives_its_events() -> None:
    payload = vp.encode(
        [
            vp.stored([11, 12, 13], parent=None, block_size=16),
            vp.stored([14], parent=13, block_size=16),
            vp.BlockRemoved([11, 2**63 + 5], "GPU"),
            vp.AllBlocksCleared(),
        ],
        rank=0,
    )
    assert kv.decode_batch(payload) == [
        kv.Stored(hashes=(11, 12, 13), parent=None, block_size=16, tokens=48),
        kv.Stored(hashes=(14,), parent=13, block_size=16, tokens=16),
        kv.Removed(hashes=(11, 2**63 + 5)),
        kv.Cleared(),
    ]


def test_a_batch_as_older_vllm_encodes_it_events_as_arrays_gives_the_same() -> None:
    payload = vp.encode(
        [vp.stored([11, 12], old=True), vp.OldBlockRemoved([11], "GPU"), vp.OldAllBlocksCleared()], rank=0
    )
    assert kv.decode_batch(payload) == [
        kv.Stored(hashes=(11, 12), parent=None, block_size=16, tokens=32),
        kv.Removed(hashes=(11,)),
        kv.Cleared(),
    ]


def test_a_map_event_needs_only_the_fields_read_and_ignores_the_rest() -> None:
    import msgspec

    h = bytes(range(32))
    raw = [
        # SGLang omits what is None; an unknown key, an unknown kind
        {"type": "BlockStored", "block_hashes": [-5], "token_ids": [1, 2], "block_size": 2, "cache_salt": "s"},
        {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": -5, "token_ids": [3], "block_size": 2},
        {"type": "KVCacheOffloaded", "block_hashes": [h]},
        {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0},
    ]
    assert kv.decode_batch(msgspec.msgpack.encode([0.5, raw])) == [
        kv.Stored(hashes=(-5,), parent=None, block_size=2, tokens=2),
        kv.Stored(hashes=(h,), parent=-5, block_size=2, tokens=1),
        kv.Removed(hashes=(h,)),
    ]


def test_hashes_as_bytes_and_the_fields_a_newer_engine_adds_or_an_older_omits() -> None:
    # Newer vLLM: hashes are bytes (sha256); an unknown kind and extra trailing fields are ignored;
    # the data-parallel rank omitted.
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    payload = vp.encode([vp.stored([h1, h2]), ["KVCacheOffloaded", [h1], "CPU"]])
    assert kv.decode_batch(payload) == [kv.Stored(hashes=(h1, h2), parent=None, block_size=16, tokens=32)]
    extra = vp.encode([["BlockStored", [5], None, [1, 2], 2, None, None, "lora-name", 7]])
    assert kv.decode_batch(extra) == [kv.Stored(hashes=(5,), parent=None, block_size=2, tokens=2)]


def test_msgpack_values_of_every_kind_decode() -> None:
    import msgspec

    value = {
        "a": [None, True, False, -1, -33, -(2**15), -(2**31) - 1, -(2**63), 127, 255, 65535, 2**32 - 1, 2**64 - 1],
        "f": [1.5, float("inf")],
        "s": ["", "x" * 31, "y" * 300, "z" * 70_000],
        "b": [b"", b"\x00" * 300],
        "n": {"m": {}},
    }
    assert kv.unpack(msgspec.msgpack.encode(value)) == value
    assert kv.unpack(struct.pack(">Bf", 0xCA, 0.5)) == 0.5
    assert kv.unpack(b"\xd6\xff" + b"\0" * 4) is None  # a timestamp: not needed, skipped


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"", "past the end"),
        (b"\xc1", "does not begin"),
        (b"\xdd\xff\xff\xff\xff", "more items than"),  # an array of 4 billion in 5 bytes
        (b"\xdf\x7f\xff\xff\xff", "more items than"),
        (b"\xdb\xff\xff\xff\xff", "past the end"),  # a 4 GiB string
        (b"\x91" * 10_000 + b"\xc0", "deeper than"),
        (b"\x81\x90\xc0", "not a string or number"),
        (b"\xa2\xff\xfe", "not UTF-8"),
        (b"\xc0\xc0", "after the msgpack value"),
        (vp.encode([])[:-1], "past the end"),
        (b"\x92\xcb" + b"\0" * 8 + b"\xc0", "not [ts,"),
        (b"\x92\x00\x91\x90", "nor an array led by it"),
        (b"\x92\x00\x91\x81\xa4type\x01", 'no "type"'),
        (b"\x92\x00\x91\x81\xa4type\xabBlockStored", "has no block_hashes, token_ids, block_size"),
        (b"\x92\x00\x91\x81\xa4type\xacBlockRemoved", "BlockRemoved event has no block_hashes"),
        (b"\x92\x00\x91\x92\xabBlockStored\x90", "fewer than"),
        (b"\x92\x00\x91\x95\xabBlockStored\x90\xc0\x90\x00", "malformed"),
        (b"\x92\x00\x91\x92\xacBlockRemoved\x91\xc3", "not an integer or bytes"),
    ],
)
def test_a_broken_or_hostile_payload_is_refused_saying_why(payload: bytes, says: str) -> None:
    with pytest.raises(kv.EventsError, match=re.escape(says)):
        kv.decode_batch(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_refused_with_events_error(data: bytes) -> None:
    try:
        kv.decode_batch(data)
    except kv.EventsError:
        pass


@pytest.mark.trio
async def test_a_large_batch_is_decoded_off_the_loop() -> None:
    payload = vp.encode([vp.stored(list(range(4096)))])
    assert len(payload) > kv.INLINE_DECODE_BYTES
    used: list[bool] = []
    real = trio.to_thread.run_sync

    async def spy(fn, *args, **kw):
        used.append(True)
        return await real(fn, *args, **kw)

    trio.to_thread.run_sync = spy  # type: ignore[assignment]
    try:
        events = await kv.decode_batch_async(payload)
    finally:
        trio.to_thread.run_sync = real  # type: ignore[assignment]
    assert used == [True] and events[0].tokens == 4096 * 16
    assert await kv.decode_batch_async(vp.encode([vp.AllBlocksCleared()])) == [kv.Cleared()]
    assert used == [True]  # a small one on the loop


# -- ZMTP -------------------------------------------------------------------------------------


@pytest.mark.trio
async def test_a_subscriber_reads_a_publishers_messages() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    big = vp.encode([vp.stored(list(range(100)))])  # > 255 bytes: a long frame
    sent = [[b"kv-events", (0).to_bytes(8, "big"), big], [b"kv-events", (1).to_bytes(8, "big"), vp.encode([])]]
    got: list[tuple[int, bytes]] = []
    async with trio.open_nursery() as nursery:

        async def publisher() -> None:
            assert await scripted_publisher(theirs, sent) == b"\x01kv-events"

        nursery.start_soon(publisher)
        sub = kv.Subscription(ours)
        await sub.open()
        async for frames in sub.messages():
            got.append(kv.batch_of(frames))
            if len(got) == 2:
                break
    assert got == [(0, big), (1, vp.encode([]))]


@pytest.mark.parametrize(
    ("greeting", "socket_type", "says"),
    [
        (b"HTTP/1.1 400 Bad Request\r\n".ljust(64, b"\n"), b"PUB", "not a ZeroMQ socket"),
        (kv.GREETING[:10] + b"\x02\x00" + kv.GREETING[12:], b"PUB", "ZMTP 2.0"),
        (kv.GREETING[:12] + b"CURVE".ljust(20, b"\0") + kv.GREETING[32:], b"PUB", "CURVE mechanism"),
        (kv.GREETING, b"REP", "REP socket, not a publisher"),
    ],
)
@pytest.mark.trio
async def test_a_peer_that_is_not_a_null_publisher_is_refused_saying_what_it_is(
    greeting: bytes, socket_type: bytes, says: str
) -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:

        async def publisher() -> None:
            try:
                await scripted_publisher(theirs, [], socket_type=socket_type, greeting=greeting)
            except (AssertionError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        nursery.start_soon(publisher)
        with pytest.raises(kv.EventsError, match=re.escape(says)):
            await kv.Subscription(ours).open()
        await ours.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("tail", "says"),
    [
        (b"\x02" + struct.pack(">Q", 1 << 40), "bytes (at most"),  # a frame claiming a terabyte
        (b"\x08\x00", "reserved bits"),
        (b"\x01\x05abc", "closed the connection"),  # cut mid-frame
        (b"\x01\x00\x04\x05\x04PING", "middle of a message"),
    ],
)
@pytest.mark.trio
async def test_a_publisher_that_lies_about_sizes_or_stops_mid_frame_ends_the_subscription(
    tail: bytes, says: str
) -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:

        async def publisher() -> None:
            await scripted_publisher(theirs, [])
            await theirs.send_all(tail)
            await theirs.aclose()

        nursery.start_soon(publisher)
        sub = kv.Subscription(ours)
        await sub.open()
        with pytest.raises(kv.EventsError, match=re.escape(says)):
            async for _ in sub.messages():
                pass


def test_a_message_not_of_topic_sequence_and_payload_is_refused() -> None:
    with pytest.raises(kv.EventsError, match="2 frames"):
        kv.batch_of([b"kv-events", b"x"])
    with pytest.raises(kv.EventsError, match="8 bytes"):
        kv.batch_of([b"kv-events", b"\0" * 4, b""])
    assert kv.batch_of([b"", (2**40).to_bytes(8, "big"), b"p"]) == (2**40, b"p")


# -- streams recorded from the engines' own publishers (tests/fixtures/kvevents) ----------------


async def read_recorded(data: bytes, n: int) -> list[tuple[int, list[kv.Event]]]:
    """What a subscriber reads of `data`, sent by a peer that then closes: `n` batches, or up to
    where the peer closed (the subscription ending with `EventsError`)."""
    to_us_send, to_us = trio.testing.memory_stream_one_way_pair()
    to_them, _ = trio.testing.memory_stream_one_way_pair()  # what we send: kept, not read
    await to_us_send.send_all(data)
    await to_us_send.aclose()  # its side only: we read the data, then the end
    got: list[tuple[int, list[kv.Event]]] = []
    try:
        sub = kv.Subscription(trio.StapledStream(to_them, to_us))
        await sub.open()
        async for frames in sub.messages():
            seq, payload = kv.batch_of(frames)
            got.append((seq, await kv.decode_batch_async(payload)))
            if len(got) == n:
                break
    except kv.EventsError:
        assert len(got) < n
    return got


@pytest.mark.trio
@pytest.mark.parametrize(("stem", "engine"), rec.RECORDINGS)
async def test_a_recorded_stream_is_read_as_the_engine_published_it_and_cut_anywhere_ends_cleanly(
    stem: str, engine: str
) -> None:
    data = rec.recording(stem)
    expected = rec.expected(engine)
    assert await read_recorded(data, len(expected)) == expected
    # Cut at every byte: the batches before the cut, whole, then the subscription ends.
    ends = []
    for cut in range(len(data)):
        got = await read_recorded(data[:cut], len(expected))
        assert got == expected[: len(got)]
        ends.append(len(got))
    assert ends == sorted(ends) and ends[-1] == len(expected) - 1
