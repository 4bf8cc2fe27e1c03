"""What vLLM and SGLang say of their prefix caches: their KV-cache events, read as they publish
them (ZeroMQ PUB, msgpack), without a ZeroMQ or msgpack library.

An engine started with `--kv-events-config` (`llmgw.engines.vllm`, `llmgw.engines.sglang`)
binds a ZeroMQ PUB socket and sends, for each scheduler step that changed its cache, one
message of three frames: the topic, a sequence number (8 bytes, big-endian, from 0 at each
start) and a batch, msgpack `[ts, [event, ...]]` (and the data-parallel rank when set), each
event a map tagged by its kind (vLLM since between 0.20 and 0.28, SGLang 0.5.23; both seen in
wheels of those releases):

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
     "block_size": 16, ...}
    {"type": "BlockRemoved", "block_hashes": [...], ...}
    {"type": "AllBlocksCleared"}

or, from older vLLM releases (0.11, 0.20), an array led by its kind with the fields in order:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, ...]
    ["BlockRemoved", block_hashes, ...]
    ["AllBlocksCleared"]

Block hashes are the engine's (integers or bytes, over token ids: the gateway, which has no
tokenizer, cannot compute them); fields other than the ones read here are ignored, as are
kinds not listed (a newer engine's). `tests/fixtures/kvevents/` holds streams recorded from
each engine's own publisher code (`testlib/record_kvevents.py` says how).

`Subscription` is the subscriber's side of ZMTP 3.0 (RFC 23, the NULL mechanism: the engine's
publisher has no other) over any trio stream: the greeting, READY with Socket-Type SUB, one
subscription, then messages. What the router does with the
events: `llmgw.gateway.routing.Router.engine_events`.

Everything a peer sends is bounded: a frame over `MAX_MESSAGE_BYTES` ends the subscription, a
msgpack value nests at most `MAX_DEPTH` deep and claims no more items than it has bytes.
Decoding is pure Python and linear in the message; a large one is decoded in a thread
(`decode_batch_async`) so the loop is never held while it is.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio

MAX_MESSAGE_BYTES = 16 << 20
MAX_DEPTH = 16
INLINE_DECODE_BYTES = 16 << 10  # larger batches are decoded in a thread
TOPIC = b"kv-events"  # what llmgw's engines publish on (`--kv-events-config`'s "topic")


class EventsError(Exception):
    """The publisher broke the protocol (or is not a ZeroMQ publisher): the subscription ends."""


# -- msgpack (the subset of https://github.com/msgpack/msgpack/blob/master/spec.md a batch uses,
#    which is all of it but extension types other than the timestamp) -----------------------

_FIXED = {
    0xCA: (4, struct.Struct(">f")),
    0xCB: (8, struct.Struct(">d")),
    0xCC: (1, struct.Struct(">B")),
    0xCD: (2, struct.Struct(">H")),
    0xCE: (4, struct.Struct(">I")),
    0xCF: (8, struct.Struct(">Q")),
    0xD0: (1, struct.Struct(">b")),
    0xD1: (2, struct.Struct(">h")),
    0xD2: (4, struct.Struct(">i")),
    0xD3: (8, struct.Struct(">q")),
}
_LENGTHS = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}
# lead byte -> (kind, bytes of its length): str, bin, array, map, ext
_SIZED = {
    0xD9: ("str", 1),
    0xDA: ("str", 2),
    0xDB: ("str", 4),
    0xC4: ("bin", 1),
    0xC5: ("bin", 2),
    0xC6: ("bin", 4),
    0xDC: ("array", 2),
    0xDD: ("array", 4),
    0xDE: ("map", 2),
    0xDF: ("map", 4),
    0xC7: ("ext", 1),
    0xC8: ("ext", 2),
    0xC9: ("ext", 4),
}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise EventsError("a msgpack value runs past the end of its message")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def value(self, depth: int = 0) -> Any:
        data, pos = self.data, self.pos
        if pos >= len(data):
            raise EventsError("a msgpack value runs past the end of its message")
        lead = data[pos]
        self.pos = pos + 1
        if lead <= 0x7F:
            return lead
        if lead >= 0xE0:
            return lead - 0x100
        if 0xA0 <= lead <= 0xBF:
            return self._text(lead & 0x1F)
        if 0x90 <= lead <= 0x9F:
            return self._array(lead & 0x0F, depth)
        if 0x80 <= lead <= 0x8F:
            return self._map(lead & 0x0F, depth)
        if lead == 0xC0:
            return None
        if lead in (0xC2, 0xC3):
            return lead == 0xC3
        fixed = _FIXED.get(lead)
        if fixed is not None:
            size, fmt = fixed
            return fmt.unpack(self.take(size))[0]
        sized = _SIZED.get(lead)
        if sized is not None:
            kind, width = sized
            n = _LENGTHS[width].unpack(self.take(width))[0]
            if kind == "str":
                return self._text(n)
            if kind == "bin":
                return self.take(n)
            if kind == "array":
                return self._array(n, depth)
            if kind == "map":
                return self._map(n, depth)
            self.take(1 + n)  # an extension type (a timestamp): its meaning is not needed here
            return None
        if lead in _FIXEXT:
            self.take(1 + _FIXEXT[lead])
            return None
        raise EventsError(f"byte 0x{lead:02x} does not begin a msgpack value")

    def _text(self, n: int) -> str:
        try:
            return self.take(n).decode()
        except UnicodeDecodeError as exc:
            raise EventsError("a msgpack string is not UTF-8") from exc

    def _array(self, n: int, depth: int) -> list:
        if depth >= MAX_DEPTH:
            raise EventsError(f"msgpack nested deeper than {MAX_DEPTH}")
        if n > len(self.data) - self.pos:  # each item takes a byte at least
            raise EventsError("a msgpack array claims more items than its message has bytes")
        value = self.value
        return [value(depth + 1) for _ in range(n)]

    def _map(self, n: int, depth: int) -> dict:
        if depth >= MAX_DEPTH:
            raise EventsError(f"msgpack nested deeper than {MAX_DEPTH}")
        if 2 * n > len(self.data) - self.pos:
            raise EventsError("a msgpack map claims more items than its message has bytes")
        out = {}
        for _ in range(n):
            key = self.value(depth + 1)
            try:
                out[key] = self.value(depth + 1)
            except TypeError as exc:  # an unhashable key
                raise EventsError("a msgpack map has a key that is not a string or number") from exc
        return out


def unpack(data: bytes) -> Any:
    """One msgpack value that is the whole of `data`."""
    reader = _Reader(data)
    value = reader.value()
    if reader.pos != len(data):
        raise EventsError(f"{len(data) - reader.pos} bytes after the msgpack value")
    return value


# -- events ---------------------------------------------------------------------------------


@attrs.frozen
class Stored:
    """Blocks the engine cached: `hashes` in prompt order, the first one's parent `parent`
    (None: they begin a prompt), `block_size` tokens each, `tokens` tokens in all."""

    hashes: tuple[Any, ...]
    parent: Any
    block_size: int
    tokens: int


@attrs.frozen
class Removed:
    """Blocks the engine evicted."""

    hashes: tuple[Any, ...]


@attrs.frozen
class Cleared:
    """The engine emptied its cache."""


Event = Stored | Removed | Cleared


def _hash(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise EventsError(f"a block hash is {type(value).__name__}, not an integer or bytes")
    return value


def _hashes(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise EventsError("an event's block_hashes is not an array")
    return tuple(_hash(v) for v in value)


_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size")
_STORED_REQUIRED = ("block_hashes", "token_ids", "block_size")  # SGLang leaves out a None parent


def _event(raw: Any) -> Event | None:
    """One event, either encoding; None for a kind the router does not read."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise EventsError('an event map has no "type" naming its kind')
        if kind == "BlockStored":
            missing = [name for name in _STORED_REQUIRED if name not in raw]
            if missing:
                raise EventsError(f"a BlockStored event has no {', '.join(missing)}")
            fields = [raw.get(name) for name in _STORED]
        elif kind == "BlockRemoved":
            if "block_hashes" not in raw:
                raise EventsError("a BlockRemoved event has no block_hashes")
            fields = [raw["block_hashes"]]
        else:
            fields = []
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind, fields = raw[0], raw[1:]
        if kind == "BlockStored" and len(fields) < 4:
            raise EventsError("a BlockStored event has fewer than its 4 fields")
        if kind == "BlockRemoved" and not fields:
            raise EventsError("a BlockRemoved event has no block_hashes")
    else:
        raise EventsError("an event is neither a map tagged by its kind nor an array led by it")
    if kind == "BlockStored":
        hashes, parent, tokens, block_size = fields[:4]
        if not isinstance(tokens, list) or not isinstance(block_size, int) or block_size <= 0:
            raise EventsError("a BlockStored event's token_ids or block_size is malformed")
        return Stored(
            hashes=_hashes(hashes),
            parent=None if parent is None else _hash(parent),
            block_size=block_size,
            tokens=len(tokens),
        )
    if kind == "BlockRemoved":
        return Removed(hashes=_hashes(fields[0]))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None  # a newer engine's kind: what it says is not needed to route


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one batch (`[ts, [event, ...], ...]`), the kinds the router reads."""
    batch = unpack(payload)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventsError("a batch is not [ts, [event, ...]]")
    events: list[Event] = []
    for raw in batch[1]:
        event = _event(raw)
        if event is not None:
            events.append(event)
    return events


async def decode_batch_async(payload: bytes) -> list[Event]:
    """`decode_batch`, in a thread when the batch is large (pure Python lets the loop have the
    interpreter back every switch interval; a long batch on the loop would hold it)."""
    if len(payload) <= INLINE_DECODE_BYTES:
        return decode_batch(payload)
    return await trio.to_thread.run_sync(decode_batch, payload)


# -- ZMTP 3.0, the subscriber's side ----------------------------------------------------------

# Signature, version 3.0, mechanism NULL, as-server 0, filler: 64 bytes (RFC 23).
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


def frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    """One ZMTP frame."""
    flags = (_MORE if more else 0) | (_COMMAND if command else 0)
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def ready(socket_type: bytes) -> bytes:
    """The READY command naming our socket type."""
    prop = bytes([len(b"Socket-Type")]) + b"Socket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return frame(bytes([len(b"READY")]) + b"READY" + prop, command=True)


def _properties(body: bytes) -> dict[str, bytes]:
    props, pos = {}, 0
    while pos < len(body):
        n = body[pos]
        name = body[pos + 1 : pos + 1 + n]
        pos += 1 + n
        if pos + 4 > len(body):
            raise EventsError("the publisher's READY is cut short")
        (size,) = struct.unpack(">I", body[pos : pos + 4])
        pos += 4
        if pos + size > len(body):
            raise EventsError("the publisher's READY is cut short")
        props[name.decode("ascii", "replace").lower()] = body[pos : pos + size]
        pos += size
    return props


class _Buffered:
    """Exact reads from a stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = await self.stream.receive_some(max(65536, n - len(self.buf)))
            if not chunk:
                raise EventsError("the publisher closed the connection")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


class Subscription:
    """A SUB socket's side of one connection to a publisher, over `stream` (TCP, or a memory
    stream in the tests): `open` does the handshake and subscribes to `topic`; `messages`
    yields each message's frames."""

    def __init__(self, stream: trio.abc.Stream, topic: bytes = TOPIC) -> None:
        self.stream = stream
        self.topic = topic
        self._in = _Buffered(stream)

    async def open(self) -> None:
        await self.stream.send_all(GREETING)
        greeting = await self._in.exactly(64)
        if greeting[0] != 0xFF or greeting[9] != 0x7F:
            raise EventsError("the peer is not a ZeroMQ socket (its greeting has no ZMTP signature)")
        if greeting[10] < 3:
            raise EventsError(f"the peer speaks ZMTP {greeting[10]}.{greeting[11]}; 3.0 or later is needed")
        mechanism = greeting[12:32].rstrip(b"\0")
        if mechanism != b"NULL":
            raise EventsError(
                f"the peer wants the {mechanism.decode('ascii', 'replace')} mechanism; NULL is spoken here"
            )
        await self.stream.send_all(ready(b"SUB"))
        body, more, command = await self._frame()
        if not command or body[:1] != b"\x05" or body[1:6] != b"READY":
            raise EventsError("the peer's first command is not READY")
        kind = _properties(body[6:]).get("socket-type", b"")
        if kind not in (b"PUB", b"XPUB"):
            raise EventsError(f"the peer is a ZeroMQ {kind.decode('ascii', 'replace') or '?'} socket, not a publisher")
        await self.stream.send_all(frame(b"\x01" + self.topic))  # subscribe (ZMTP 3.0's way)

    async def _frame(self) -> tuple[bytes, bool, bool]:
        (flags,) = await self._in.exactly(1)
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise EventsError(f"a frame's flags 0x{flags:02x} have reserved bits set")
        if flags & _LONG:
            (size,) = struct.unpack(">Q", await self._in.exactly(8))
        else:
            (size,) = await self._in.exactly(1)
        if size > MAX_MESSAGE_BYTES:
            raise EventsError(f"a frame of {size} bytes (at most {MAX_MESSAGE_BYTES} are read)")
        return await self._in.exactly(size), bool(flags & _MORE), bool(flags & _COMMAND)

    async def messages(self) -> AsyncIterator[list[bytes]]:
        """Each message's frames, commands (PING, a publisher's own) skipped."""
        while True:
            frames: list[bytes] = []
            size = 0
            while True:
                body, more, command = await self._frame()
                if command:
                    if frames:
                        raise EventsError("a command in the middle of a message")
                    break
                frames.append(body)
                size += len(body)
                if size > MAX_MESSAGE_BYTES:
                    raise EventsError(f"a message of more than {MAX_MESSAGE_BYTES} bytes")
                if not more:
                    yield frames
                    break


def batch_of(frames: list[bytes]) -> tuple[int, bytes]:
    """A publisher's message (topic, sequence, payload): its sequence number and payload."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise EventsError(f"a message of {len(frames)} frames, not topic, sequence (8 bytes) and payload")
    return int.from_bytes(frames[1], "big"), frames[2]
